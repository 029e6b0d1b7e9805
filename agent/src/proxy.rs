//! `aether-agent proxy`: the supervisor of the node's Envoy (PID 1 of the proxy container).
//!
//! It renders the bootstrap from `proxy/bootstrap.yaml`, starts Envoy at epoch 0 with a dynamic base id kept in
//! the state dir, hot-restarts it (epoch + 1) when the template or the binary changes or on SIGHUP — only onto a
//! bootstrap `envoy --mode validate` accepts and a binary with the same hot-restart version — takes over a live
//! predecessor's Envoy found through the shared state dir, restarts a crashed Envoy with backoff, and drains on
//! SIGTERM. Envoy's own parent shutdown retires old epochs; the supervisor never kills a parent.
//!
//! The decisions (epochs, triggers, backoff, supersession) are [`machine`]: events in, actions out, no I/O.
//! [`supervisor`] performs the actions through a [`host::Host`] (processes, Envoy's admin, the binary) and reports
//! what happened as events; its tests run it against a fake host on a paused clock.

pub mod admin;
pub mod bootstrap;
pub mod config;
pub mod envoy;
pub mod epoch;
#[cfg(test)]
mod fake;
pub mod host;
pub mod machine;
pub mod metrics;
pub mod predecessor;
pub mod state;
pub mod supervisor;

use parking_lot::Mutex;
use std::sync::Arc;
use std::time::Duration;

use aether_common::admin::{AdminServer, Pages, answered};
use aether_common::readiness::Readiness;
use aether_common::telemetry::{Component, MetricsPush};
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;

pub use config::ProxyConfig;
pub use supervisor::{Ended, Status, Supervisor, SupervisorError};

/// How often a successor retries its admin port while the predecessor (on the host network) still holds it.
const ADMIN_BIND_RETRY: Duration = Duration::from_millis(500);

/// Names the supervisor's telemetry (`aether_proxy_*`, service.name aether-proxy).
pub const TELEMETRY: Component = Component {
    component: "proxy",
    binary: "aether-proxy",
    version: env!("CARGO_PKG_VERSION"),
};

#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    #[error(transparent)]
    Supervisor(#[from] SupervisorError),
    #[error("telemetry: {0}")]
    Telemetry(#[from] aether_common::telemetry::TelemetryError),
}

/// Runs the supervisor until SIGTERM: draining Envoy, or, once a successor has taken it over, idle.
pub async fn run(config: ProxyConfig, shutdown: CancellationToken) -> Result<(), ProxyError> {
    let mut registry = Registry::default();
    let metrics = metrics::ProxyMetrics::default();
    metrics.register(registry.sub_registry_with_prefix("aether_proxy"));
    let metrics_push = MetricsPush::register(&config.telemetry, TELEMETRY, &mut registry);
    let readiness = match &config.ready_file {
        Some(path) => Readiness::new().with_file(path),
        None => Readiness::new(),
    };
    let status = Arc::new(Mutex::new(Status::default()));
    let admin_stop = CancellationToken::new();
    let registry = Arc::new(registry);
    metrics_push.spawn(registry.clone(), None, admin_stop.clone())?;
    tokio::spawn(serve_admin(
        config.admin,
        readiness.clone(),
        registry,
        pages(status.clone()),
        admin_stop.clone(),
    ));
    let supervisor = Supervisor::new(config, metrics, readiness.gate("envoy"), status)?;
    let ended = supervisor.run(shutdown.clone()).await;
    // Frees the admin address for the successor.
    admin_stop.cancel();
    if let Ok(Ended::HandedOff) = ended {
        // Exiting now would make the kubelet restart this container, and a restarted supervisor would take the
        // Envoy back from the successor: stay until this pod is deleted.
        tracing::info!("our Envoy now belongs to the successor; idle until SIGTERM");
        shutdown.cancelled().await;
    }
    ended?;
    Ok(())
}

/// Serves the supervisor's admin endpoints once the address is free (see [`AdminServer::bind_retrying`]).
async fn serve_admin(
    addr: std::net::SocketAddr,
    readiness: Readiness,
    registry: Arc<Registry>,
    pages: Pages,
    stop: CancellationToken,
) {
    if let Some(server) = AdminServer::bind_retrying(addr, readiness, registry, ADMIN_BIND_RETRY, &stop).await {
        tracing::info!(%addr, "supervisor admin serving");
        server.with_pages(pages).serve(stop).await;
    }
}

fn pages(status: Arc<Mutex<Status>>) -> Pages {
    Arc::new(move |path: &str| {
        answered(match path {
            "/debug/proxy" => {
                let status = status.lock().clone();
                Some((200, serde_json::to_string_pretty(&status).unwrap_or_default()))
            }
            _ => None,
        })
    })
}
