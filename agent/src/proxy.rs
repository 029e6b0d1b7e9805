//! `aether-agent proxy`: the supervisor of the node's Envoy (PID 1 of the proxy container).
//!
//! It renders the bootstrap from `proxy/bootstrap.yaml`, starts Envoy at epoch 0 with a dynamic base id kept in
//! the state dir, hot-restarts it (epoch + 1) when the template or the binary changes or on SIGHUP — only onto a
//! bootstrap `envoy --mode validate` accepts and a binary with the same hot-restart version — takes over a live
//! predecessor's Envoy found through the shared state dir, restarts a crashed Envoy with backoff, and drains on
//! SIGTERM. Envoy's own parent shutdown retires old epochs; the supervisor never kills a parent.

pub mod admin;
pub mod bootstrap;
pub mod config;
pub mod envoy;
pub mod metrics;
pub mod state;
pub mod supervisor;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use aether_common::admin::{AdminServer, Pages, Readiness};
use aether_common::telemetry::{Identity, MetricsPush};
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;

pub use config::ProxyConfig;
pub use supervisor::{Status, Supervisor, SupervisorError};

/// How often a successor retries its admin port while the predecessor (on the host network) still holds it.
const ADMIN_BIND_RETRY: Duration = Duration::from_millis(500);

/// Names the supervisor's telemetry (`aether_proxy_*`, service.name aether-proxy).
pub const TELEMETRY: Identity = Identity {
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

/// Runs the supervisor until SIGTERM (after draining Envoy) or until a successor has taken its Envoy over.
pub async fn run(config: ProxyConfig, shutdown: CancellationToken) -> Result<(), ProxyError> {
    let mut registry = Registry::default();
    let metrics = metrics::ProxyMetrics::default();
    metrics.register(registry.sub_registry_with_prefix("aether_proxy"));
    let metrics_push = MetricsPush::register(&config.telemetry, TELEMETRY, &mut registry);
    let readiness = Readiness::new("starting Envoy");
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
    let supervisor = Supervisor::new(config, metrics, readiness, status)?;
    let result = supervisor.run(shutdown).await;
    admin_stop.cancel();
    Ok(result?)
}

/// Binds the admin server, retrying while the address is in use: during a surge rollout on the host network the
/// predecessor holds it until it exits.
async fn serve_admin(
    addr: std::net::SocketAddr,
    readiness: Readiness,
    registry: Arc<Registry>,
    pages: Pages,
    stop: CancellationToken,
) {
    let mut warned = false;
    loop {
        match AdminServer::bind(addr, readiness.clone(), registry.clone()).await {
            Ok(server) => {
                tracing::info!(%addr, "supervisor admin serving");
                server.with_pages(pages).serve(stop).await;
                return;
            }
            Err(error) => {
                if !warned {
                    tracing::warn!(%error, "supervisor admin address busy; retrying");
                    warned = true;
                }
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tokio::time::sleep(ADMIN_BIND_RETRY) => {}
                }
            }
        }
    }
}

fn pages(status: Arc<Mutex<Status>>) -> Pages {
    Arc::new(move |path: &str| match path {
        "/debug/proxy" => {
            let status = status.lock().expect("status lock").clone();
            Some((200, serde_json::to_string_pretty(&status).unwrap_or_default()))
        }
        _ => None,
    })
}
