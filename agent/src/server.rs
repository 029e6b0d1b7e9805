//! `aether-agent run`: wiring and start-up reconciliation.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::Arc;

use aether_common::admin::{AdminError, AdminServer, Pages, Readiness};
use aether_common::tasks::Tasks;
use aether_common::telemetry::otlp::Refresh;
use aether_common::telemetry::{Component, MetricsPush};
use aether_proto::registry::v1::Locality;
use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_server::AggregatedDiscoveryServiceServer;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use std::time::Duration;
use tokio::net::UnixListener;
use tokio::sync::watch;
use tokio_stream::wrappers::UnixListenerStream;
use tokio_util::sync::CancellationToken;

use crate::catalog_watch::{self, Interest, WatchedCatalog};
use crate::cni::CniService;
use crate::config::{Config, PodSourceKind};
use crate::node::{Node, NodeMetrics};
use crate::pod_source::{PodDirectory, kubernetes, static_dir};
use crate::pod_store::{PodStore, PodStoreError};
use crate::registrar::Registrar;
use crate::registrar_link::RegistrarLink;
use crate::request_metrics::EnvoyRequestMetrics;
use crate::xds::cache::Cache;
use crate::xds::{AdsServer, Hooks, XdsMetrics};

/// Names the agent's telemetry (`aether_agent_*`, service.name aether-agent).
pub const TELEMETRY: Component = Component {
    component: "agent",
    binary: "aether-agent",
    version: env!("CARGO_PKG_VERSION"),
};
/// Longest a read of Envoy's request metrics may take (per /metrics scrape or OTLP push).
const ENVOY_STATS_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(1);

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("creating {path}: {source}")]
    Dir { path: String, source: std::io::Error },
    #[error(transparent)]
    PodStore(#[from] PodStoreError),
    #[error("the registrar link: {0}")]
    Registrar(#[from] crate::registrar_link::LinkError),
    #[error("binding the Unix socket {path}: {source}")]
    Socket { path: String, source: std::io::Error },
    #[error(transparent)]
    Admin(#[from] AdminError),
    #[error("--pod-source kubernetes: {0}")]
    Kubernetes(String),
    #[error("mesh-dns records: {0}")]
    DnsRecords(#[from] crate::dns_records::DnsRecordsError),
    #[error("telemetry: {0}")]
    Telemetry(#[from] aether_common::telemetry::TelemetryError),
    #[error(transparent)]
    Identity(#[from] crate::identity::IdentityError),
}

pub struct Running {
    pub admin_addr: SocketAddr,
    pub node: Node,
    tasks: Tasks,
    shutdown: CancellationToken,
    readiness: Readiness,
}

/// How long shutdown waits for the agent's tasks to end.
const DRAIN_DEADLINE: Duration = Duration::from_secs(10);

impl Running {
    /// Runs until shutdown, then waits for every task. `Err` names the critical task
    /// whose early end stopped the agent.
    pub async fn wait(self) -> Result<(), String> {
        self.shutdown.cancelled().await;
        self.readiness.set_not_ready("shutting down");
        self.tasks.drain(DRAIN_DEADLINE).await
    }
}

/// Binds a Unix socket readable and writable by its owner only.
fn bind_private(path: &Path) -> Result<UnixListener, StartError> {
    let fail = |source| StartError::Socket {
        path: path.display().to_string(),
        source,
    };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(fail)?;
    }
    // A socket left by a previous run would make bind fail.
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(fail(e)),
    }
    let listener = UnixListener::bind(path).map_err(fail)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(fail)?;
    Ok(listener)
}

pub async fn start(config: Config, shutdown: CancellationToken) -> Result<Running, StartError> {
    std::fs::create_dir_all(&config.state_dir).map_err(|source| StartError::Dir {
        path: config.state_dir.display().to_string(),
        source,
    })?;
    let _ = std::fs::set_permissions(&config.state_dir, std::fs::Permissions::from_mode(0o700));
    let pods = PodStore::open(&config.state_dir)?;
    let mut locality = Locality {
        region: config.region.clone(),
        zone: config.zone.clone(),
        subzone: config.subzone.clone(),
    };
    // The Kubernetes pod source's client, also used once here for the Node's locality.
    let kube_client = match config.pod_source {
        PodSourceKind::Kubernetes => Some(kubernetes::client_from_env().await.map_err(StartError::Kubernetes)?),
        PodSourceKind::Static => None,
    };
    if let Some(client) = &kube_client {
        locality = kubernetes::locality(locality, client.clone(), &config.node_name).await;
    }
    let link = RegistrarLink::start_for(
        &config.registrar,
        &config.registrar_link,
        &crate::registrar_link::AgentContext::of(&config),
        shutdown.clone(),
    )?;
    let registrar = Registrar::new(link.clone(), config.node_name.clone(), locality.clone());

    let mut registry = Registry::default();
    let metrics = registry.sub_registry_with_prefix("aether_agent");
    let xds_metrics = XdsMetrics::default();
    xds_metrics.register(metrics);
    let node_metrics = NodeMetrics::default();
    metrics.register(
        "dependencies",
        "Services in the node's dependency set",
        node_metrics.dependencies.clone(),
    );
    metrics.register(
        "clusters",
        "Clusters served to the node's Envoy",
        node_metrics.clusters.clone(),
    );
    metrics.register("pods", "Mesh pods on this node", node_metrics.pods.clone());
    metrics.register(
        "pod_config_errors",
        "Malformed mesh annotation entries on this node's pods (skipped; see /debug/pods)",
        node_metrics.pod_config_errors.clone(),
    );
    metrics.register(
        "rebuilds",
        "xDS snapshots that changed something",
        node_metrics.rebuilds.clone(),
    );
    let registrar_connected = Gauge::default();
    metrics.register(
        "registrar_connected",
        "1 while the registrar watch stream is up",
        registrar_connected.clone(),
    );
    let cni_calls = prometheus_client::metrics::family::Family::default();
    metrics.register("cni_calls", "CNI plugin calls, by method and result", cni_calls.clone());
    let cni_add_phases = crate::cni::add_phases();
    metrics.register(
        "cni_add_phase_seconds",
        "Time successful AddPod calls spent registering, waiting for Envoy, programming capture, and in total",
        cni_add_phases.clone(),
    );
    if config.envoy_access_log {
        crate::request_metrics::enable_access_log(&config.telemetry.otlp_endpoint);
    }
    let envoy_requests = EnvoyRequestMetrics::new(config.envoy_admin, ENVOY_STATS_TIMEOUT);
    metrics.register(
        "envoy_stats_failures",
        "Reads of Envoy's request metrics from its admin that failed (the last values are kept)",
        envoy_requests.failures.clone(),
    );
    registry.register_collector(Box::new(envoy_requests.clone()));
    let metrics_push = MetricsPush::register(&config.telemetry, TELEMETRY, &mut registry);
    let metrics = registry.sub_registry_with_prefix("aether_agent");

    let identity_metrics = crate::identity::IdentityMetrics::default();
    identity_metrics.register(metrics);
    let dns_records_metrics = crate::dns_records::DnsRecordsMetrics::default();
    dns_records_metrics.register(metrics);
    let dns_records =
        crate::dns_records::DnsRecords::new(&config.state_dir, config.dns_records_restamp, dns_records_metrics)?;
    let identity = crate::identity::Identity::start(&config.identity, identity_metrics, shutdown.clone())?;

    let (catalog_tx, catalog_rx) = watch::channel(Arc::new(WatchedCatalog::default()));
    let (deps_tx, deps_rx) = watch::channel(Interest::Services(BTreeSet::new()));
    let cache = Cache::default();
    let node = Node::new(
        &config.mesh_domain,
        locality,
        pods.clone(),
        cache.clone(),
        catalog_rx,
        deps_tx,
        node_metrics,
    );
    let node = match identity {
        Some(identity) => node.with_identity(identity),
        None => node,
    };

    let readiness = Readiness::new("starting");
    let tasks = Tasks::new(shutdown.clone(), readiness.clone());

    // Pods from a previous run: drop those whose sandbox is gone, re-register the rest.
    let mut known = 0;
    for pod in pods.all() {
        if !pod.netns.exists() {
            tracing::info!(pod = %pod.id(), netns = %pod.netns.display(), "forgetting a pod whose sandbox is gone");
            let _ = pods.remove_sandbox(&pod.id(), &pod.container_id).await;
            let registrar = registrar.clone();
            tasks.spawn(async move {
                let _ = registrar.unregister(&pod.info.service(), &pod.ips).await;
            });
            continue;
        }
        known += 1;
        let registrar = registrar.clone();
        tasks.spawn(async move {
            if let Err(status) = registrar.register(&pod).await {
                tracing::warn!(pod = %pod.id(), %status, "re-registering a known pod failed; it is retried on the next change");
            }
        });
    }
    tracing::info!(pods = known, "local pods recovered from the state dir");
    let capture = crate::capture::CaptureConfig::new(
        &config.state_dir,
        config.mesh_vip_cidr,
        config.mesh_dns,
        config.proxy_mark,
    );
    {
        let (capture, pods) = (capture.clone(), pods.all());
        tasks.spawn(async move { crate::cni::reconcile_capture(&capture, &pods).await });
    }
    node.rebuild();

    let directory = PodDirectory::default();
    match kube_client {
        None => {
            tasks.critical(
                "the pod directory",
                static_dir::run(config.pod_dir.clone(), directory.clone(), shutdown.clone()),
            );
        }
        Some(client) => {
            tasks.critical(
                "the Kubernetes pod source",
                kubernetes::run(client, config.node_name.clone(), directory.clone(), shutdown.clone()),
            );
        }
    }
    tasks.critical(
        "pod info sync",
        sync_pod_info(directory.clone(), node.clone(), registrar.clone(), shutdown.clone()),
    );
    tasks.critical(
        "the catalog watch",
        catalog_watch::follow(link.clone(), deps_rx, catalog_tx, registrar_connected, shutdown.clone()),
    );
    tasks.critical("the node controller", node.clone().run(shutdown.clone()));
    let (dns_views_tx, dns_views) = watch::channel(Arc::new(WatchedCatalog::default()));
    tasks.critical(
        "the DNS catalog watch",
        catalog_watch::follow(
            link,
            watch::channel(Interest::ServicesOnly).1,
            dns_views_tx,
            dns_records.connected(),
            shutdown.clone(),
        ),
    );
    tasks.critical("the DNS record writer", dns_records.run(dns_views, shutdown.clone()));

    let hooks = Hooks {
        metrics: xds_metrics,
        on_demand: {
            let node = node.clone();
            Arc::new(move |type_url: &str, names: &[String]| node.on_demand(type_url, names))
        },
    };
    let xds_listener = bind_private(&config.xds_socket)?;
    let cni_listener = bind_private(&config.cni_socket)?;
    let xds_server = tonic::transport::Server::builder()
        // Envoy's requests are small (subscriptions, ACKs); an explicit bound, tonic's
        // default. Responses (the node's config) are not bounded.
        .add_service(
            AggregatedDiscoveryServiceServer::new(AdsServer::new(cache.clone(), hooks))
                .max_decoding_message_size(4 * 1024 * 1024),
        )
        .serve_with_incoming_shutdown(
            UnixListenerStream::new(xds_listener),
            shutdown.clone().cancelled_owned(),
        );
    let cni = CniService {
        node: node.clone(),
        directory,
        registrar,
        excluded_namespaces: config.excluded(),
        pod_lookup_timeout: config.pod_lookup_timeout,
        calls: cni_calls,
        add_phases: cni_add_phases,
        capture,
        pin_dir: config.netns_pin_dir.clone(),
    };
    let cni_server = tonic::transport::Server::builder()
        .add_service(crate::cni::server(cni))
        .serve_with_incoming_shutdown(
            UnixListenerStream::new(cni_listener),
            shutdown.clone().cancelled_owned(),
        );

    let registry = Arc::new(registry);
    let refresh: Refresh = Arc::new(move || {
        let envoy_requests = envoy_requests.clone();
        Box::pin(async move { envoy_requests.refresh().await })
    });
    metrics_push.spawn(registry.clone(), Some(refresh.clone()), shutdown.clone())?;
    let admin = AdminServer::bind(config.admin, readiness.clone(), registry)
        .await?
        .with_pages(debug_pages(node.clone()))
        .with_refresh(refresh);
    let admin_addr = admin.local_addr().map_err(|source| StartError::Socket {
        path: config.admin.to_string(),
        source,
    })?;
    tasks.critical("the admin server", admin.serve(shutdown.clone()));
    tasks.critical("the xDS server", log_failure("xDS server", xds_server));
    tasks.critical("the CNI server", log_failure("CNI server", cni_server));
    readiness.set_ready();
    tracing::info!(node = %config.node_name, xds = %config.xds_socket.display(), cni = %config.cni_socket.display(),
        %admin_addr, "agent serving");

    Ok(Running {
        admin_addr,
        node,
        tasks,
        shutdown,
        readiness,
    })
}

/// A server's future as a task: its error is logged (its end is judged by [`Tasks`]).
async fn log_failure<E: std::fmt::Display>(what: &'static str, server: impl Future<Output = Result<(), E>>) {
    if let Err(error) = server.await {
        tracing::error!(%error, "{what} failed");
    }
}

/// Keeps local pods' metadata current with the pod source: a pod that starts
/// terminating drains; annotation changes re-scope the node.
async fn sync_pod_info(directory: PodDirectory, node: Node, registrar: Registrar, shutdown: CancellationToken) {
    let mut changes = directory.subscribe();
    loop {
        for pod in node.pods.all() {
            let Some(info) = directory.get(&pod.id()) else { continue };
            if info == pod.info || (!pod.info.uid.is_empty() && info.uid != pod.info.uid) {
                continue;
            }
            let mut updated = pod.clone();
            updated.info = info;
            // Only onto the same sandbox: a DEL or a new sandbox in the meantime wins.
            let mut applied = false;
            let saved = node
                .pods
                .change(|pods| match pods.get_mut(&pod.id()) {
                    Some(current) if current.container_id == pod.container_id => {
                        *current = updated.clone();
                        applied = true;
                        true
                    }
                    _ => false,
                })
                .await;
            if let Err(error) = saved {
                tracing::error!(pod = %pod.id(), %error, "saving updated pod metadata failed");
                continue;
            }
            if !applied {
                continue;
            }
            if let Err(status) = registrar.register(&updated).await {
                tracing::warn!(pod = %pod.id(), %status, "updating the pod's endpoint failed");
            }
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            changed = changes.changed() => if changed.is_err() { return },
        }
    }
}

fn debug_pages(node: Node) -> Pages {
    Arc::new(move |path: &str| {
        let body = match path {
            "/debug/pods" => {
                let pods: Vec<_> = node
                    .pods
                    .all()
                    .into_iter()
                    .map(|p| {
                        serde_json::json!({
                            "pod": p.id(),
                            "container_id": p.container_id,
                            "netns": p.netns,
                            "ips": p.ips,
                            "service": p.info.service(),
                            "upstreams": p.info.upstreams().services,
                            "config_errors": p.info.config_errors(),
                            "terminating": p.info.terminating,
                        })
                    })
                    .collect();
                serde_json::json!({ "pods": pods })
            }
            "/debug/dependencies" => {
                let pods = node.pods.all();
                let watched = node.catalog.borrow().clone();
                serde_json::json!({
                    "dependencies": node.dependencies(&pods),
                    "watched": watched.filter,
                    "known": watched.catalog.services.keys().collect::<Vec<_>>(),
                })
            }
            "/debug/xds" => {
                let snapshot = node.cache.snapshot();
                // "acked": what the newest connected Envoy (the one serving) holds.
                let streams = node.cache.streams();
                let acked = streams.newest().map(|s| s.acked.clone()).unwrap_or_default();
                let types: serde_json::Map<String, serde_json::Value> = snapshot
                    .types
                    .iter()
                    .map(|(type_url, resources)| {
                        let entries: serde_json::Map<String, serde_json::Value> = resources
                            .iter()
                            .map(|(name, r)| {
                                let have = acked.get(type_url).and_then(|m| m.get(name));
                                (name.clone(), serde_json::json!({ "served": r.version, "acked": have }))
                            })
                            .collect();
                        (type_url.clone(), serde_json::Value::Object(entries))
                    })
                    .collect();
                serde_json::json!({ "serial": snapshot.serial, "streams": streams.live.len(), "types": types })
            }
            _ => return None,
        };
        Some((200, serde_json::to_string_pretty(&body).expect("JSON serialises")))
    })
}
