//! Wiring: configuration → sockets, record table, forwarder, admin server.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use aether_common::admin::{AdminError, AdminServer, Pages, answered};
use aether_common::readiness::{Gate, Readiness};
use aether_common::tasks::TaskFailed;
use aether_common::tasks::Tasks;
use aether_common::telemetry::{Component, MetricsPush};
use prometheus_client::registry::Registry;
use tokio::net::{TcpListener, UdpSocket};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tokio_util::task::task_tracker::TaskTrackerToken;

use crate::config::{Config, RESOLV_CONF};
use crate::forward::{ForwardError, Forwarder, parse_resolv_conf, parse_upstream};
use crate::handler::{Handler, HandlerError};
use crate::metrics::Metrics;
use crate::ratelimit::SharedRateLimited;
use crate::reload::Reloader;
use crate::server::{self, Server, ServerError};
use crate::table::CurrentTable;

/// How often a surge successor retries the admin address its predecessor still holds.
const ADMIN_BIND_RETRY: Duration = Duration::from_millis(500);

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Handler(#[from] HandlerError),
    #[error("--upstream: {0}")]
    Upstream(#[from] ForwardError),
    #[error("--upstream not given and {RESOLV_CONF} has no usable nameserver")]
    NoUpstream,
    #[error(transparent)]
    Bind(#[from] ServerError),
    #[error(transparent)]
    Admin(#[from] AdminError),
    #[error("registering sockets with the runtime: {0}")]
    Runtime(std::io::Error),
    #[error("telemetry: {0}")]
    Telemetry(#[from] aether_common::telemetry::TelemetryError),
}

/// Names mesh-dns's telemetry (`aether_mesh_dns_*`, service.name aether-mesh-dns).
pub const TELEMETRY: Component = Component {
    component: "mesh_dns",
    binary: "aether-mesh-dns",
    version: env!("CARGO_PKG_VERSION"),
};

pub struct Running {
    pub dns_addr: SocketAddr,
    pub admin_addr: SocketAddr,
    /// The servers, the reloader and the admin server.
    tasks: Tasks,
    /// Each TCP connection and each UDP thread.
    connections: TaskTracker,
    shutdown: CancellationToken,
    /// The `mesh-dns` readiness gate.
    serving: Gate,
}

/// How long shutdown waits for tasks and in-flight queries.
const DRAIN_DEADLINE: Duration = Duration::from_secs(5);

/// A critical task ended before shutdown and stopped mesh-dns.
#[derive(Debug, thiserror::Error)]
#[error("stopped because {0}")]
pub struct Stopped(#[from] TaskFailed);

impl Running {
    /// Serves until shutdown, then drains. `Err` names the critical task whose early
    /// end stopped mesh-dns.
    pub async fn wait(self) -> Result<(), Stopped> {
        self.shutdown.cancelled().await;
        self.serving.set_not_ready("shutting down");
        let drained = self.tasks.drain(DRAIN_DEADLINE).await;
        self.connections.close();
        let _ = tokio::time::timeout(DRAIN_DEADLINE, self.connections.wait()).await;
        drained.map_err(Stopped)
    }
}

pub async fn start(config: Config, shutdown: CancellationToken) -> Result<Running, StartError> {
    let (upstreams, search) = upstreams_and_search(&config)?;
    let store = Arc::new(CurrentTable::default());
    let handler = Handler::new(store.clone(), &config.mesh_domain, &config.cluster_domain, &search)?;
    let metrics = Metrics::new();
    let forwarder = Forwarder::new(upstreams.clone(), config.upstream_timeout, metrics.forward.clone())?;
    let mut registry = Registry::default();
    metrics.register(&mut registry);
    let metrics_push = MetricsPush::register(&config.telemetry, TELEMETRY, &mut registry);
    let reloader = loaded_reloader(&config, store.clone(), metrics.clone());

    let workers = config.worker_count();
    let (udp, tcp) = server::bind(config.listen, workers)?;
    let dns_addr = tcp.local_addr().map_err(StartError::Runtime)?;
    let server = Arc::new(Server {
        handler,
        forwarder,
        metrics,
        inflight: Semaphore::new(config.max_inflight.max(1)),
        tcp_idle_timeout: config.tcp_idle_timeout,
        upstream_errors_log: SharedRateLimited::new(Duration::from_secs(10)),
        malformed_log: SharedRateLimited::new(Duration::from_secs(10)),
    });
    let readiness = match &config.ready_file {
        Some(path) => Readiness::new().with_file(path),
        None => Readiness::new(),
    };
    let serving = readiness.gate("mesh-dns");
    let tasks = Tasks::new(shutdown.clone(), &readiness);
    let connections = TaskTracker::new();
    for (i, socket) in udp.into_iter().enumerate() {
        spawn_udp_thread(i, socket, server.clone(), connections.token(), shutdown.clone())?;
    }
    let listener = TcpListener::from_std(tcp).map_err(StartError::Runtime)?;
    tasks.critical(
        "the TCP server",
        server::serve_tcp(server.clone(), listener, connections.clone(), shutdown.clone()),
    );
    tasks.critical("the record file reloader", reloader.run(shutdown.clone()));

    let registry = Arc::new(registry);
    if let Some(push) = metrics_push.spawn(registry.clone(), None, shutdown.clone())? {
        tasks.spawn(async move {
            let _ = push.await;
        });
    }
    let pages = debug_pages(server.clone(), upstreams, config.mesh_domain.clone());
    let admin_addr = serve_admin(config.admin, &readiness, registry, pages, &tasks, &shutdown).await?;
    serving.set_ready();
    tracing::info!(%dns_addr, %admin_addr, workers, upstreams = ?server.forwarder.upstreams(),
        mesh_domain = %config.mesh_domain, records = %config.records.display(), "mesh-dns serving");
    Ok(Running {
        dns_addr,
        admin_addr,
        tasks,
        connections,
        shutdown,
        serving,
    })
}

/// The upstreams (`--upstream`, else the nameservers of resolv.conf) and the search
/// domains (`--search-domain` and resolv.conf's).
fn upstreams_and_search(config: &Config) -> Result<(Vec<SocketAddr>, Vec<String>), StartError> {
    let resolv = std::fs::read_to_string(RESOLV_CONF).unwrap_or_default();
    let (resolv_servers, resolv_search) = parse_resolv_conf(&resolv);
    let upstreams = if config.upstreams.is_empty() {
        if resolv_servers.is_empty() {
            return Err(StartError::NoUpstream);
        }
        resolv_servers
    } else {
        config
            .upstreams
            .iter()
            .enumerate()
            .map(|(i, u)| parse_upstream(u).ok_or_else(|| ForwardError::BadUpstream(i, u.clone())))
            .collect::<Result<Vec<_>, _>>()?
    };
    let mut search = config.search_domains.clone();
    search.extend(resolv_search);
    Ok((upstreams, search))
}

/// The record file reloader, with the file loaded already if there is a usable one.
fn loaded_reloader(config: &Config, store: Arc<CurrentTable>, metrics: Metrics) -> Reloader {
    let mut reloader = Reloader {
        path: config.records.clone(),
        store,
        metrics,
        poll_interval: config.poll_interval,
        stale_after: config.stale_after,
        initial: None,
    };
    // Load before binding so a restarted instance answers mesh names from its first query.
    if let Err(error) = reloader.load_now() {
        tracing::info!(%error, "no usable record file at start; mesh names get SERVFAIL until one loads");
    }
    reloader
}

/// Serves one UDP socket on a thread of its own with a single-threaded runtime: a query
/// is received, answered and sent on one core with no cross-thread wake-ups (the kernel
/// spreads queries over the SO_REUSEPORT sockets). Forwards run as tasks on the same
/// thread. `done` is dropped when the thread has finished its in-flight queries.
fn spawn_udp_thread(
    i: usize,
    socket: std::net::UdpSocket,
    server: Arc<Server>,
    done: TaskTrackerToken,
    shutdown: CancellationToken,
) -> Result<(), StartError> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(StartError::Runtime)?;
    let socket = {
        let _entered = runtime.enter();
        Arc::new(UdpSocket::from_std(socket).map_err(StartError::Runtime)?)
    };
    std::thread::Builder::new()
        .name(format!("dns-udp-{i}"))
        .spawn(move || {
            runtime.block_on(async {
                let local = TaskTracker::new();
                server::serve_udp(server, socket, local.clone(), shutdown).await;
                local.close();
                local.wait().await;
            });
            drop(done);
        })
        .map_err(StartError::Runtime)?;
    Ok(())
}

/// Binds and serves the admin server; returns its address. When the address is taken,
/// DNS is served anyway and the admin server follows once the address is free.
async fn serve_admin(
    addr: SocketAddr,
    readiness: &Readiness,
    registry: Arc<Registry>,
    pages: Pages,
    tasks: &Tasks,
    shutdown: &CancellationToken,
) -> Result<SocketAddr, StartError> {
    match AdminServer::bind(addr, readiness.clone(), registry.clone()).await {
        Ok(admin) => {
            let bound = admin.local_addr().map_err(StartError::Runtime)?;
            tasks.critical("the admin server", admin.with_pages(pages).serve(shutdown.clone()));
            Ok(bound)
        }
        // A surge rollout on the host network: the predecessor holds the address until it is deleted. DNS is
        // served meanwhile (SO_REUSEPORT); the admin endpoints follow once the address is free.
        Err(AdminError::Bind { source, .. }) if source.kind() == std::io::ErrorKind::AddrInUse => {
            let (readiness, shutdown) = (readiness.clone(), shutdown.clone());
            tasks.spawn(async move {
                if let Some(admin) =
                    AdminServer::bind_retrying(addr, readiness, registry, ADMIN_BIND_RETRY, &shutdown).await
                {
                    admin.with_pages(pages).serve(shutdown).await;
                }
            });
            Ok(addr)
        }
        Err(error) => Err(error.into()),
    }
}

fn debug_pages(server: Arc<Server>, upstreams: Vec<SocketAddr>, domain: String) -> Pages {
    Arc::new(move |path: &str| {
        if path != "/debug/records" {
            return answered(None);
        }
        let handler = &server.handler;
        let table = handler.store().load();
        let aliases = table.as_ref().map_or(&[][..], |t| &t.aliases[..]);
        let (served, left_out): (Vec<_>, Vec<_>) = aliases.iter().partition(|a| handler.serves_alias(a));
        let names = |zones: Vec<&crate::zone::Zone>| zones.iter().map(|z| z.name().to_string()).collect::<Vec<_>>();
        let body = serde_json::json!({
            "mesh_domain": domain,
            "aliases": names(served),
            "aliases_left_out": names(left_out),
            "upstreams": upstreams.iter().map(|u| u.to_string()).collect::<Vec<_>>(),
            "loaded": table.is_some(),
            "generation": table.as_ref().map(|t| t.generation),
            "records": table.as_ref().map(|t| t.len()),
            "written_at_unix_ms": table.as_ref().and_then(|t| t.written_at.duration_since(std::time::UNIX_EPOCH).ok()).map(|d| d.as_millis() as u64),
        });
        answered(Some((
            200,
            serde_json::to_string_pretty(&body).expect("JSON serialises"),
        )))
    })
}
