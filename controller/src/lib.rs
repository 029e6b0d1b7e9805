//! `aether-controller`: the mesh's admission webhooks.
//!
//! - [`validate`]: every mesh object (pods' mesh annotations, AuthorizationPolicy,
//!   HTTPFilter, HTTPRoute/GRPCRoute/TCPRoute/TLSRoute with Service parents) judged by the function that
//!   projects it at run time (`aether-api`), so apply-time and run-time verdicts agree;
//! - [`mutate`]: a new pod in a mesh namespace joins the mesh (label, DNS search domains);
//! - [`mesh_domain`]: the domain those search domains name (`--follow-mesh-config`);
//! - [`admission`]: AdmissionReview v1 in and out, as kube-apiserver speaks it;
//! - [`server`]: HTTPS for kube-apiserver, the serving certificate reloaded from its files;
//! - [`leader`]: leader election on a Lease (`--node-taints`, `--gateway-status`);
//! - [`node_taints`]: the leader's half of the node readiness taint;
//! - [`gateway_status`]: the leader writes the edge's Gateway API status.
//!
//! Every replica serves the webhooks; only the leader writes (proposal 015).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use aether_common::admin::{AdminError, AdminServer};
use aether_common::readiness::{Gate, Readiness};
use aether_common::tasks::{TaskFailed, Tasks};
use aether_common::telemetry::{Component, MetricsPush};
use aether_common::tls::{CertFiles, CertSlot, TlsError};
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

pub mod admission;
pub mod config;
pub mod gateway_status;
pub mod leader;
pub mod mesh_domain;
pub mod mutate;
pub mod node_taints;
pub mod server;
pub mod validate;

use config::Config;

/// Names the controller's telemetry (`aether_controller_*`, service.name aether-controller).
pub const TELEMETRY: Component = Component {
    component: "controller",
    binary: "aether-controller",
    version: env!("CARGO_PKG_VERSION"),
};

/// How long open reviews may take to finish at shutdown.
const DRAIN: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("the serving certificate: {0}")]
    Tls(#[from] TlsError),
    #[error("the TLS configuration: {0}")]
    Rustls(#[from] rustls::Error),
    #[error("binding the webhook address {addr}: {source}")]
    Bind { addr: SocketAddr, source: std::io::Error },
    #[error(transparent)]
    Admin(#[from] AdminError),
    #[error("telemetry: {0}")]
    Telemetry(#[from] aether_common::telemetry::TelemetryError),
    #[error("--node-taints and --follow-mesh-config need a Kubernetes client: {0}")]
    Kube(#[from] kube::Error),
}

pub struct Running {
    pub webhook_addr: SocketAddr,
    pub admin_addr: SocketAddr,
    tasks: Tasks,
    serving: Gate,
    shutdown: CancellationToken,
}

impl Running {
    /// Until shutdown (or a critical task's failure), then drains.
    pub async fn wait(self) -> Result<(), TaskFailed> {
        self.shutdown.cancelled().await;
        self.serving.set_not_ready("shutting down");
        self.tasks.drain(DRAIN).await
    }
}

/// Campaigns for the Lease and, while leading, keeps the node readiness taints
/// (`--node-taints`) and writes the edge's Gateway API status (`--gateway-status`).
fn lead(config: &Config, client: kube::Client, tasks: &Tasks, shutdown: &CancellationToken) {
    let (leading, follows) = tokio::sync::watch::channel(false);
    let election = leader::Election {
        leases: kube::Api::namespaced(client.clone(), &config.namespace),
        name: config.lease.clone(),
        identity: config.identity.clone(),
        duration: config.lease_duration,
    };
    tasks.critical("the leader election", election.run(leading, shutdown.clone()));
    if config.node_taints {
        let reconciler = node_taints::Reconciler {
            nodes: kube::Api::all(client.clone()),
            pods: kube::Api::namespaced(client.clone(), &config.namespace),
            agent_selector: config.agent_selector.clone(),
            grace: config.node_taint_grace,
        };
        tasks.critical(
            "the node readiness taints",
            reconciler.run(follows.clone(), shutdown.clone()),
        );
    }
    if config.gateway_status {
        let writer = gateway_status::StatusWriter {
            client,
            edges_namespace: config.namespace.clone(),
            timing: gateway_status::Timing::default(),
        };
        tasks.critical("the Gateway API status", writer.run(follows, shutdown.clone()));
    }
}

/// Binds the webhook and admin addresses and serves until `shutdown`.
pub async fn start(config: Config, shutdown: CancellationToken) -> Result<Running, StartError> {
    let files = CertFiles {
        cert_flag: "--tls-cert",
        cert: config.tls_cert.clone(),
        key_flag: "--tls-key",
        key: config.tls_key.clone(),
    };
    let slot = CertSlot::from_files(files, shutdown.clone())?;
    let tls = server::tls_config(slot)?;
    let listener = TcpListener::bind(config.listen)
        .await
        .map_err(|source| StartError::Bind {
            addr: config.listen,
            source,
        })?;
    let webhook_addr = listener.local_addr().map_err(|source| StartError::Bind {
        addr: config.listen,
        source,
    })?;
    let options = aether_api::authorization::ProjectOptions {
        root_namespace: config.mesh_root_namespace.clone(),
    };
    let install_domain: Arc<str> = config.mesh_domain.as_str().into();
    let (mesh_domain, follows) = tokio::sync::watch::channel(install_domain.clone());
    let webhooks = Arc::new(server::Webhooks {
        validator: validate::Validator {
            options: options.clone(),
        },
        mutator: mutate::Mutator::new(follows),
        metrics: server::Metrics::default(),
    });
    let mut registry = Registry::default();
    webhooks.metrics.register(&mut registry);
    let metrics_push = MetricsPush::register(&config.telemetry, TELEMETRY, &mut registry);
    let registry = Arc::new(registry);
    let readiness = Readiness::new();
    let serving = readiness.gate("webhooks");
    let tasks = Tasks::new(shutdown.clone(), &readiness);
    tasks.critical(
        "the webhook server",
        server::serve(listener, tls, webhooks, shutdown.clone()),
    );
    if let Some(push) = metrics_push.spawn(registry.clone(), None, shutdown.clone())? {
        tasks.spawn(async move {
            let _ = push.await;
        });
    }
    let client = match (config.node_taints || config.follow_mesh_config, config.gateway_status) {
        (true, _) => Some(kube::Client::try_default().await?),
        // On by default: a controller run outside a cluster still serves its webhooks.
        (false, true) => kube::Client::try_default()
            .await
            .inspect_err(|error| {
                tracing::warn!(%error, "--gateway-status: no Kubernetes client (no in-cluster config, no KUBECONFIG): \
                    the edge's Gateway API status is not written")
            })
            .ok(),
        (false, false) => None,
    };
    if let (true, Some(client)) = (config.node_taints || config.gateway_status, &client) {
        lead(&config, client.clone(), &tasks, &shutdown);
    }
    if let (true, Some(client)) = (config.follow_mesh_config, client) {
        let follower = mesh_domain::Follower {
            api: kube::Api::namespaced(client, &config.mesh_root_namespace),
            options,
            install: install_domain,
            gate: readiness.gate("mesh-config"),
        };
        tasks.critical("the mesh domain", follower.run(mesh_domain, shutdown.clone()));
    }
    let admin = AdminServer::bind(config.admin, readiness.clone(), registry).await?;
    let admin_addr = admin.local_addr().map_err(|source| StartError::Bind {
        addr: config.admin,
        source,
    })?;
    tasks.critical("the admin server", admin.serve(shutdown.clone()));
    serving.set_ready();
    tracing::info!(%webhook_addr, %admin_addr, mesh_domain = %config.mesh_domain, "aether-controller serving");
    Ok(Running {
        webhook_addr,
        admin_addr,
        tasks,
        serving,
        shutdown,
    })
}
