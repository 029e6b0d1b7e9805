//! `aether-agent run`: wiring and start-up reconciliation.

use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::Arc;

use aether_common::admin::{AdminError, AdminServer, Pages, answered};
use aether_common::readiness::{Gate, Readiness};
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

use crate::access_log::RecentFailures;
use crate::catalog_watch::{self, Interest, WatchedCatalog};
use crate::cni::{CniMetrics, CniService, CniSettings, Effects};
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
    Kubernetes(#[from] kubernetes::ClientError),
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
    /// The `agent` readiness gate.
    serving: Gate,
}

/// How long shutdown waits for the agent's tasks to end.
const DRAIN_DEADLINE: Duration = Duration::from_secs(10);

/// The agent stopped because a critical task ended early.
#[derive(Debug, thiserror::Error)]
#[error(transparent)]
pub struct Stopped(#[from] pub aether_common::tasks::TaskFailed);

impl Running {
    /// Runs until shutdown, then waits for every task. `Err` names the critical task
    /// whose early end stopped the agent.
    pub async fn wait(self) -> Result<(), Stopped> {
        self.shutdown.cancelled().await;
        self.serving.set_not_ready("shutting down");
        Ok(self.tasks.drain(DRAIN_DEADLINE).await?)
    }
}

/// Binds a Unix socket readable and writable by its owner only.
pub(crate) fn bind_private(path: &Path) -> Result<UnixListener, StartError> {
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
    let pods = open_pod_store(&config)?;
    let (locality, kube_client) = locality(&config).await?;
    let link = RegistrarLink::start_for(
        &config.registrar,
        &config.registrar_link,
        &crate::registrar_link::AgentContext::of(&config),
        shutdown.clone(),
    )?;
    let registrar = Registrar::new(link.clone(), config.node_name.clone(), locality.clone());
    let mut registry = Registry::default();
    let metrics = AgentMetrics::register(&mut registry, &config);
    let metrics_push = MetricsPush::register(&config.telemetry, TELEMETRY, &mut registry);
    let dns_records = dns_records(&config, &metrics)?;
    let identity = crate::identity::Identity::start(&config.identity, metrics.identity.clone(), shutdown.clone())?;
    let cache = Cache::default();
    let (node, catalog_tx, deps_rx) = node(&config, locality, pods, &cache, identity, &metrics);
    let readiness = Readiness::new();
    let serving = readiness.gate("agent");
    let tasks = Tasks::new(shutdown.clone(), &readiness);
    open_once_synced(readiness.gate("catalog"), catalog_tx.subscribe(), &tasks, &shutdown);
    let capture = capture_config(&config);
    recover_pods(&node, &registrar, &capture, &tasks).await;
    node.rebuild();

    let directory = follow_pods(
        &config,
        kube_client.clone(),
        &node,
        &registrar,
        &capture,
        &tasks,
        &shutdown,
    );
    let watches = Watches {
        link: link.clone(),
        dependencies: deps_rx,
        views: catalog_tx,
        connected: metrics.registrar_connected.clone(),
    };
    let services = watches.start(dns_records, &tasks, &shutdown);
    tasks.critical(
        "the mesh ClusterIP capture sync",
        crate::capture::cluster_ips::sync(capture.clone(), node.clone(), services, shutdown.clone()),
    );
    tasks.critical("the node controller", node.clone().run(shutdown.clone()));

    let cni = cni_service(&config, registrar, capture, directory, &node, &metrics);
    let failures = serve_sockets(&config, cache, &node, cni, &metrics, &tasks, &shutdown)?;
    let inspector = metrics.inspector(&config, node.clone(), link, failures);
    let admin_addr = serve_admin(
        &config,
        registry,
        metrics_push,
        &metrics,
        inspector,
        &readiness,
        &tasks,
        &shutdown,
    )
    .await?;
    serving.set_ready();
    if let Some(client) = kube_client {
        tasks.spawn(untaint_when_ready(client, &config, readiness, shutdown.clone()));
    }
    tracing::info!(node = %config.node_name, xds = %config.xds_socket.display(), cni = %config.cni_socket.display(),
        %admin_addr, "agent serving");

    Ok(Running {
        admin_addr,
        node,
        tasks,
        shutdown,
        serving,
    })
}

/// The mesh-dns record file's writer.
fn dns_records(
    config: &Config,
    metrics: &AgentMetrics,
) -> Result<crate::dns_records::DnsRecords, crate::dns_records::DnsRecordsError> {
    let (dir, restamp) = (&config.state_dir, config.dns_records_restamp);
    crate::dns_records::DnsRecords::new(dir, restamp, &config.mesh_domain, metrics.dns_records.clone())
}

/// The CNI plugin's service: admits pods into the node, capturing and registering them.
fn cni_service(
    config: &Config,
    registrar: Registrar,
    capture: crate::capture::CaptureConfig,
    directory: PodDirectory,
    node: &Node,
    metrics: &AgentMetrics,
) -> CniService {
    let effects = Effects::production(registrar, capture.clone(), config.netns_pin_dir.clone(), node.clone());
    let settings = CniSettings {
        excluded_namespaces: config.excluded(),
        pod_lookup_timeout: config.pod_lookup_timeout,
        capture,
        uds: crate::uds::UdsLinks {
            link_dir: config.uds_link_dir.clone(),
            kubelet_root: config.kubelet_root_dir.clone(),
        },
    };
    CniService::new(node.clone(), directory, settings, effects, metrics.cni.clone())
}

/// Opens `catalog` once the first consistent catalog arrived from the registrar. A later
/// outage keeps it open: the node goes on serving the last catalog it had.
fn open_once_synced(
    catalog: Gate,
    mut views: watch::Receiver<Arc<WatchedCatalog>>,
    tasks: &Tasks,
    shutdown: &CancellationToken,
) {
    catalog.set_not_ready("waiting for the first catalog from the registrar");
    let shutdown = shutdown.clone();
    tasks.spawn(async move {
        tokio::select! {
            _ = shutdown.cancelled() => {}
            changed = views.changed() => if changed.is_ok() {
                catalog.set_ready();
            },
        }
    });
}

/// The node controller, with the channels its catalog Watch feeds (views in) and follows
/// (its dependency set out).
fn node(
    config: &Config,
    locality: Locality,
    pods: PodStore,
    cache: &Cache,
    identity: Option<crate::identity::Identity>,
    metrics: &AgentMetrics,
) -> (Node, watch::Sender<Arc<WatchedCatalog>>, watch::Receiver<Interest>) {
    let (catalog_tx, catalog_rx) = watch::channel(Arc::new(WatchedCatalog::default()));
    let (deps_tx, deps_rx) = watch::channel(Interest::default());
    let node = Node::new(
        &config.mesh_domain,
        locality,
        pods,
        cache.clone(),
        catalog_rx,
        deps_tx,
        metrics.node.clone(),
    )
    .with_cluster_domain(&config.cluster_domain)
    .with_uds_link_dir(&config.uds_link_dir)
    .with_external_dns(crate::xds::resources::external::ExternalDns {
        servers: config.external_dns.clone(),
    })
    .with_node_name(&config.node_name);
    let node = match identity {
        Some(identity) => node.with_identity(identity),
        None => node,
    };
    (node, catalog_tx, deps_rx)
}

/// How pods' traffic is captured (nftables in their netns).
fn capture_config(config: &Config) -> crate::capture::CaptureConfig {
    crate::capture::CaptureConfig::new(
        &config.state_dir,
        config.mesh_vip_cidr,
        config.mesh_dns,
        config.proxy_mark,
    )
    .with_inbound_mtls(config.inbound_mtls)
}

/// The state dir (0700) and the local pod store in it.
fn open_pod_store(config: &Config) -> Result<PodStore, StartError> {
    std::fs::create_dir_all(&config.state_dir).map_err(|source| StartError::Dir {
        path: config.state_dir.display().to_string(),
        source,
    })?;
    let _ = std::fs::set_permissions(&config.state_dir, std::fs::Permissions::from_mode(0o700));
    Ok(PodStore::open(&config.state_dir)?)
}

/// Starts the pod source and keeps the node's pods' metadata in step with it.
fn follow_pods(
    config: &Config,
    kube_client: Option<kube::Client>,
    node: &Node,
    registrar: &Registrar,
    capture: &crate::capture::CaptureConfig,
    tasks: &Tasks,
    shutdown: &CancellationToken,
) -> PodDirectory {
    let directory = PodDirectory::default();
    start_pod_source(config, kube_client, &directory, tasks, shutdown);
    let sync = sync_pod_info(
        directory.clone(),
        node.clone(),
        registrar.clone(),
        capture.clone(),
        shutdown.clone(),
    );
    tasks.critical("pod info sync", sync);
    let follow = follow_mesh_configs(node.clone(), capture.clone(), shutdown.clone());
    tasks.critical("MeshConfig follower", follow);
    directory
}

/// Keeps every local pod's inbound mTLS mode in step with its namespace's MeshConfig (and
/// the mesh-wide one) as the registrar's stream changes them: no restart, no new ADD.
async fn follow_mesh_configs(node: Node, capture: crate::capture::CaptureConfig, shutdown: CancellationToken) {
    let mut catalog = node.watched();
    let mut applied = None;
    loop {
        let settings = crate::mesh_settings::MeshSettings::new(&catalog.borrow_and_update().catalog.mesh_configs);
        if applied.as_ref() != Some(&settings) {
            for pod in node.pods() {
                let namespace_mode = settings.of(&pod.info.namespace).inbound_mtls;
                crate::capture::follow_inbound_mtls(&capture, &pod, namespace_mode).await;
            }
            applied = Some(settings);
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            changed = catalog.changed() => if changed.is_err() { return },
        }
    }
}

/// Removes the readiness taint from the agent's Node once the agent is ready (its gates:
/// serving, catalog synced) and its Envoy LIVE (see `node_taint`).
fn untaint_when_ready(
    client: kube::Client,
    config: &Config,
    readiness: Readiness,
    shutdown: CancellationToken,
) -> impl std::future::Future<Output = ()> + use<> {
    let envoy = crate::proxy::admin::EnvoyAdmin::new(config.envoy_admin);
    let ready = move || {
        let agent_ready = readiness.get().is_ok();
        async move { agent_ready && envoy.server_info().await.is_ok_and(|info| info.is_live()) }
    };
    let nodes = kube::Api::all(client);
    crate::node_taint::remove_when_ready(nodes, config.node_name.clone(), ready, shutdown)
}

/// The node's locality (flags, else the Node's labels), and the Kubernetes client of the
/// Kubernetes pod source.
async fn locality(config: &Config) -> Result<(Locality, Option<kube::Client>), StartError> {
    let locality = Locality {
        region: config.region.clone(),
        zone: config.zone.clone(),
        subzone: config.subzone.clone(),
    };
    match config.pod_source {
        PodSourceKind::Static => Ok((locality, None)),
        PodSourceKind::Kubernetes => {
            let client = kubernetes::client_from_env().await?;
            let locality = kubernetes::locality(locality, client.clone(), &config.node_name).await;
            Ok((locality, Some(client)))
        }
    }
}

/// The agent's instruments, each registered once under `aether_agent_*`.
struct AgentMetrics {
    xds: XdsMetrics,
    node: NodeMetrics,
    registrar_connected: Gauge,
    cni: CniMetrics,
    envoy_requests: EnvoyRequestMetrics,
    identity: crate::identity::IdentityMetrics,
    dns_records: crate::dns_records::DnsRecordsMetrics,
    decisions: crate::access_log::Decisions,
}

impl AgentMetrics {
    /// What the debug API reads: the node, the registrar link, and these instruments.
    fn inspector(
        &self,
        config: &Config,
        node: Node,
        link: RegistrarLink,
        failures: RecentFailures,
    ) -> crate::debug::Inspector {
        let errors = crate::debug::ErrorCounters {
            cni: self.cni.clone(),
            identity: self.identity.errors.clone(),
            dns_records: self.dns_records.write_errors.clone(),
            envoy_stats: self.envoy_requests.failures.clone(),
        };
        let (registrar, dns) = (&self.registrar_connected, &self.dns_records.connected);
        crate::debug::Inspector::new(config, node, link, registrar, dns, failures, self.decisions.clone())
            .with_errors(errors)
    }

    fn register(registry: &mut Registry, config: &Config) -> Self {
        if config.envoy_access_log {
            crate::request_metrics::enable_access_log(&config.telemetry.otlp_endpoint);
        }
        let this = Self {
            xds: XdsMetrics::default(),
            node: NodeMetrics::default(),
            registrar_connected: Gauge::default(),
            cni: CniMetrics::default(),
            envoy_requests: EnvoyRequestMetrics::new(config.envoy_admin, ENVOY_STATS_TIMEOUT),
            identity: crate::identity::IdentityMetrics::default(),
            dns_records: crate::dns_records::DnsRecordsMetrics::default(),
            decisions: crate::access_log::Decisions::default(),
        };
        registry.register_collector(Box::new(this.envoy_requests.clone()));
        let metrics = registry.sub_registry_with_prefix("aether_agent");
        this.xds.register(metrics);
        this.node.register(metrics);
        metrics.register(
            "registrar_connected",
            "1 while the registrar watch stream is up",
            this.registrar_connected.clone(),
        );
        this.cni.register(metrics);
        metrics.register(
            "envoy_stats_failures",
            "Reads of Envoy's request metrics from its admin that failed (the last values are kept)",
            this.envoy_requests.failures.clone(),
        );
        this.identity.register(metrics);
        this.dns_records.register(metrics);
        this.decisions.register(metrics);
        this
    }
}

/// The agent's two Watches on the registrar: its dependency set (for the node) and every
/// service's record (for the DNS record file).
struct Watches {
    link: RegistrarLink,
    dependencies: watch::Receiver<Interest>,
    views: watch::Sender<Arc<WatchedCatalog>>,
    connected: Gauge,
}

impl Watches {
    /// Starts both; returns the services-only views (every mesh service, no endpoints).
    fn start(
        self,
        dns_records: crate::dns_records::DnsRecords,
        tasks: &Tasks,
        shutdown: &CancellationToken,
    ) -> watch::Receiver<Arc<WatchedCatalog>> {
        tasks.critical(
            "the catalog watch",
            catalog_watch::follow(
                self.link.clone(),
                self.dependencies,
                self.views,
                self.connected,
                shutdown.clone(),
            ),
        );
        let (dns_views_tx, dns_views) = watch::channel(Arc::new(WatchedCatalog::default()));
        tasks.critical(
            "the DNS catalog watch",
            catalog_watch::follow(
                self.link,
                watch::channel(Interest::ServicesOnly).1,
                dns_views_tx,
                dns_records.connected(),
                shutdown.clone(),
            ),
        );
        tasks.critical(
            "the DNS record writer",
            dns_records.run(dns_views.clone(), shutdown.clone()),
        );
        dns_views
    }
}

/// Pods from a previous run: those whose sandbox is gone are dropped (and unregistered),
/// the rest registered again and their capture checked.
async fn recover_pods(node: &Node, registrar: &Registrar, capture: &crate::capture::CaptureConfig, tasks: &Tasks) {
    let mut known = 0;
    for pod in node.pods() {
        if !pod.netns.exists() {
            tracing::info!(pod = %pod.id(), netns = %pod.netns.display(), "forgetting a pod whose sandbox is gone");
            let _ = node.remove_pod(&pod).await;
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
    let (capture, pods) = (capture.clone(), node.pods());
    tasks.spawn(async move { crate::capture::reconcile(&capture, &pods).await });
}

/// Follows pod metadata from the pod directory (static) or the API server (Kubernetes).
fn start_pod_source(
    config: &Config,
    kube_client: Option<kube::Client>,
    directory: &PodDirectory,
    tasks: &Tasks,
    shutdown: &CancellationToken,
) {
    match kube_client {
        None => tasks.critical(
            "the pod directory",
            static_dir::run(config.pod_dir.clone(), directory.clone(), shutdown.clone()),
        ),
        Some(client) => tasks.critical(
            "the Kubernetes pod source",
            kubernetes::run(client, config.node_name.clone(), directory.clone(), shutdown.clone()),
        ),
    }
}

/// The xDS socket (Envoy: xDS and its log of failed calls) and the CNI socket (the
/// plugin), both 0600.
fn serve_sockets(
    config: &Config,
    cache: Cache,
    node: &Node,
    cni: CniService,
    metrics: &AgentMetrics,
    tasks: &Tasks,
    shutdown: &CancellationToken,
) -> Result<RecentFailures, StartError> {
    let hooks = Hooks {
        metrics: metrics.xds.clone(),
        on_demand: {
            let node = node.clone();
            Arc::new(move |type_url: &str, names: &[String]| node.on_demand(type_url, names))
        },
    };
    let failures = RecentFailures::default();
    let xds_listener = bind_private(&config.xds_socket)?;
    let cni_listener = bind_private(&config.cni_socket)?;
    let xds_server = tonic::transport::Server::builder()
        // Envoy's requests are small (subscriptions, ACKs); an explicit bound, tonic's
        // default. Responses (the node's config) are not bounded.
        .add_service(
            AggregatedDiscoveryServiceServer::new(AdsServer::new(cache, hooks))
                .max_decoding_message_size(4 * 1024 * 1024),
        )
        // Envoy's log of failed calls and authorization decisions (crate::access_log),
        // on the same private socket.
        .add_service(crate::access_log::service(failures.clone(), metrics.decisions.clone()))
        .serve_with_incoming_shutdown(
            UnixListenerStream::new(xds_listener),
            shutdown.clone().cancelled_owned(),
        );
    let cni_server = tonic::transport::Server::builder()
        .add_service(crate::cni::server(cni))
        .serve_with_incoming_shutdown(
            UnixListenerStream::new(cni_listener),
            shutdown.clone().cancelled_owned(),
        );
    tasks.critical("the xDS server", log_failure("xDS server", xds_server));
    tasks.critical("the CNI server", log_failure("CNI server", cni_server));
    Ok(failures)
}

/// The admin server (health, readiness, metrics, debug pages) and the OTLP metrics push.
#[allow(clippy::too_many_arguments)]
async fn serve_admin(
    config: &Config,
    registry: Registry,
    metrics_push: MetricsPush,
    metrics: &AgentMetrics,
    inspector: crate::debug::Inspector,
    readiness: &Readiness,
    tasks: &Tasks,
    shutdown: &CancellationToken,
) -> Result<SocketAddr, StartError> {
    let registry = Arc::new(registry);
    let envoy_requests = metrics.envoy_requests.clone();
    let refresh: Refresh = Arc::new(move || {
        let envoy_requests = envoy_requests.clone();
        Box::pin(async move { envoy_requests.refresh().await })
    });
    metrics_push.spawn(registry.clone(), Some(refresh.clone()), shutdown.clone())?;
    let admin = AdminServer::bind(config.admin, readiness.clone(), registry)
        .await?
        .with_pages(crate::debug::pages(debug_pages(inspector.node.clone()), inspector))
        .with_refresh(refresh);
    let admin_addr = admin.local_addr().map_err(|source| StartError::Socket {
        path: config.admin.to_string(),
        source,
    })?;
    tasks.critical("the admin server", admin.serve(shutdown.clone()));
    Ok(admin_addr)
}

/// A server's future as a task: its error is logged (its end is judged by [`Tasks`]).
async fn log_failure<E: std::fmt::Display>(what: &'static str, server: impl Future<Output = Result<(), E>>) {
    if let Err(error) = server.await {
        tracing::error!(%error, "{what} failed");
    }
}

/// Keeps local pods' metadata current with the pod source: a pod that starts
/// terminating drains; annotation changes re-scope the node.
async fn sync_pod_info(
    directory: PodDirectory,
    node: Node,
    registrar: Registrar,
    capture: crate::capture::CaptureConfig,
    shutdown: CancellationToken,
) {
    let mut changes = directory.subscribe();
    loop {
        for pod in node.pods() {
            let Some(info) = directory.get(&pod.id()) else { continue };
            if info == pod.info || (!pod.info.uid.is_empty() && info.uid != pod.info.uid) {
                continue;
            }
            let updated = match node.update_pod(&pod, info).await {
                Ok(Some(updated)) => updated,
                // A DEL or a new sandbox in the meantime won.
                Ok(None) => continue,
                Err(error) => {
                    tracing::error!(pod = %pod.id(), %error, "saving updated pod metadata failed");
                    continue;
                }
            };
            if let Err(status) = registrar.register(&updated).await {
                tracing::warn!(pod = %pod.id(), %status, "updating the pod's endpoint failed");
            }
            let namespace_mode = node.mesh_settings().of(&updated.info.namespace).inbound_mtls;
            crate::capture::follow_inbound_mtls(&capture, &updated, namespace_mode).await;
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            changed = changes.changed() => if changed.is_err() { return },
        }
    }
}

fn debug_pages(node: Node) -> Pages {
    Arc::new(move |path: &str| {
        let body = node.debug_page(path);
        answered(body.map(|body| (200, serde_json::to_string_pretty(&body).expect("JSON serialises"))))
    })
}
