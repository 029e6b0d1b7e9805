//! `aether-agent edge`: the xDS server of an edge gateway (proposals/018). It serves one
//! Gateway of the `aether` class to its own Envoy (supervised by `aether-agent proxy`, hot
//! restarts and drain as on a node):
//!
//! - the Gateway API objects come from a config directory (`--config-dir`) or from the
//!   cluster (`--from-kubernetes`, [`kubernetes`]), exactly one of the two;
//! - `aether_api::edge::project` validates the Gateway and attaches its routes: the one
//!   projector, which the status writer calls too;
//! - the endpoints of the services those routes name come from the registrar's Watch
//!   stream, scoped to exactly those services (the edge follows no other);
//! - upstream calls into the mesh present the gateway's own SVID (`--namespace`,
//!   `--service-account`), so authorization policies can name the gateway.
//!
//! Admin (`--admin`): `/healthz`, `/readyz`, `/metrics`, and `/debug/edge`, the
//! projection's verdict (the Gateway's, each listener's and each route's conditions).

pub mod kubernetes;
pub mod objects;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use aether_api::edge::{Edge, EdgeInputs as Projection};
use aether_common::admin::{AdminServer, answered};
use aether_common::readiness::Readiness;
use aether_common::tasks::Tasks;
use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_server::AggregatedDiscoveryServiceServer;
use parking_lot::Mutex;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::sync::watch;
use tokio_stream::wrappers::UnixListenerStream;
use tokio_util::sync::CancellationToken;

use crate::catalog_watch::{self, Interest, WatchedCatalog};
use crate::identity::{Identities, Identity, IdentityConfig, IdentityMetrics};
use crate::pod::{LocalPod, PodInfo};
use crate::registrar_link::{AgentContext, LinkConfig, LinkRole, RegistrarLink};
use crate::xds::cache::Cache;
use crate::xds::resources::Generated;
use crate::xds::resources::edge::{EdgeInputs, backend_services, generate};
use crate::xds::resources::transport::Mtls;
use crate::xds::{AdsServer, Hooks, XdsMetrics};
use objects::Objects;

#[derive(Clone, Debug, clap::Args)]
pub struct EdgeConfig {
    /// The Gateway this edge serves, `<namespace>/<name>`.
    #[arg(long, env = "AETHER_GATEWAY")]
    pub gateway: String,

    /// A directory of Gateway API objects (YAML): GatewayClasses, Gateways, routes,
    /// ReferenceGrants, Namespaces and the TLS Secrets listeners reference. Exactly one of
    /// this and `--from-kubernetes`.
    #[arg(long, env = "AETHER_EDGE_CONFIG_DIR")]
    pub config_dir: Option<PathBuf>,

    /// Read the Gateway API objects from the cluster (in-cluster or KUBECONFIG client):
    /// watches of GatewayClasses, the Gateway, the route kinds, ReferenceGrants and
    /// Namespaces, and of TLS Secrets in `--certificate-namespaces` only. Exactly one of
    /// this and `--config-dir`.
    #[arg(long, env = "AETHER_EDGE_FROM_KUBERNETES")]
    pub from_kubernetes: bool,

    /// With `--from-kubernetes`: the namespaces (comma-separated) whose `kubernetes.io/tls`
    /// Secrets the edge reads, one namespaced watch each (RBAC: a Role in each); default the
    /// Gateway's own. A certificateRef to another namespace is reported InvalidCertificateRef.
    #[arg(long, env = "AETHER_EDGE_CERTIFICATE_NAMESPACES", value_delimiter = ',')]
    pub certificate_namespaces: Vec<String>,

    /// The registrar's gRPC URL (https://: mTLS; http:// only for a test, in plaintext).
    #[arg(
        long,
        env = "AETHER_REGISTRAR",
        default_value = "https://aether-registrar.aether-system.svc:18090"
    )]
    pub registrar: String,

    #[command(flatten)]
    pub registrar_link: LinkConfig,

    /// The name the edge watches the registrar as (its pod's name).
    #[arg(long, env = "POD_NAME", default_value = "aether-edge")]
    pub pod_name: String,

    /// The edge's own namespace and service account: its SPIFFE ID
    /// (`spiffe://<td>/ns/<namespace>/sa/<service account>`).
    #[arg(long, env = "POD_NAMESPACE", default_value = "aether-system")]
    pub namespace: String,
    #[arg(long, env = "AETHER_SERVICE_ACCOUNT", default_value = "aether-edge")]
    pub service_account: String,

    /// The xDS socket the edge's Envoy connects to (0600).
    #[arg(long, env = "AETHER_XDS_SOCKET", default_value = "/run/aether/edge/xds.sock")]
    pub xds_socket: PathBuf,

    /// Health, readiness, metrics and `/debug/edge`.
    #[arg(long, env = "AETHER_ADMIN", default_value = "127.0.0.1:15022")]
    pub admin: SocketAddr,

    /// The address the Gateway's listeners bind.
    #[arg(long, env = "AETHER_EDGE_BIND_ADDRESS", default_value = "0.0.0.0")]
    pub bind_address: std::net::IpAddr,

    /// Added to each Gateway port to get the port Envoy binds (e.g. 10000: port 80 is
    /// served on 10080, for an Envoy without NET_BIND_SERVICE; the Service maps it back).
    #[arg(long, env = "AETHER_EDGE_PORT_OFFSET", default_value_t = 0)]
    pub port_offset: u16,

    #[arg(long, env = "AETHER_MESH_DOMAIN", default_value = "aether.internal")]
    pub mesh_domain: String,

    #[command(flatten)]
    pub identity: IdentityConfig,

    #[arg(long, env = "AETHER_LOG_FORMAT", default_value = "text")]
    pub log_format: aether_common::telemetry::LogFormat,

    /// Metrics push and traces (OTLP), as every binary.
    #[command(flatten)]
    pub telemetry: aether_common::telemetry::TelemetryConfig,
}

/// Names the edge's telemetry (`aether_edge_*`, service.name aether-edge).
pub const TELEMETRY: aether_common::telemetry::Component = aether_common::telemetry::Component {
    component: "edge",
    binary: "aether-edge",
    version: env!("CARGO_PKG_VERSION"),
};

#[derive(Debug, thiserror::Error)]
pub enum EdgeError {
    #[error("--gateway {0}: expected <namespace>/<name>")]
    Gateway(String),
    #[error("the Gateway API objects: {0}")]
    Objects(String),
    #[error(transparent)]
    Identity(#[from] crate::identity::IdentityError),
    #[error("the registrar link: {0}")]
    Registrar(#[from] crate::registrar_link::LinkError),
    #[error("binding the Unix socket {path}: {source}")]
    Socket { path: String, source: std::io::Error },
    #[error(transparent)]
    Admin(#[from] aether_common::admin::AdminError),
    #[error(transparent)]
    Stopped(#[from] aether_common::tasks::TaskFailed),
    #[error("telemetry: {0}")]
    Telemetry(#[from] aether_common::telemetry::TelemetryError),
}

/// How long shutdown waits for the edge's tasks.
const DRAIN_DEADLINE: Duration = Duration::from_secs(10);

/// Serves the edge until `shutdown`.
pub async fn run(config: EdgeConfig, shutdown: CancellationToken) -> Result<(), EdgeError> {
    let gateway = check_gateway(&config.gateway)?;
    let source = objects_source(&config, &gateway)?;
    let readiness = Readiness::new();
    let serving = readiness.gate("edge");
    let synced = readiness.gate("catalog");
    synced.set_not_ready("waiting for the first catalog from the registrar");
    let tasks = Tasks::new(shutdown.clone(), &readiness);
    let mut registry = Registry::default();
    let metrics = EdgeMetrics::register(&mut registry);
    let metrics_push = aether_common::telemetry::MetricsPush::register(&config.telemetry, TELEMETRY, &mut registry);

    let objects_rx = follow_objects(source, &tasks, &shutdown).await?;

    let identity = Identity::start(&config.identity, metrics.identity.clone(), shutdown.clone())?;
    let own = own_pod(&config);
    if let Some(identity) = &identity {
        identity.sync(std::slice::from_ref(&own));
    }
    let (interest_tx, views_rx) = follow_catalog(&config, &metrics, &tasks, &shutdown)?;

    let cache = Cache::default();
    serve_xds(&config, cache.clone(), &metrics, &tasks, &shutdown)?;
    let verdict = Verdict::default();
    let builder = Builder {
        gateway,
        config: config.clone(),
        mtls: identity.as_ref().map(|_| Mtls {
            trust_domain: config.identity.trust_domain.clone(),
        }),
        identity_id: own.id(),
        cache,
        interest: interest_tx,
        verdict: verdict.clone(),
        held_since: None,
    };
    let identities = identity.as_ref().map(Identity::subscribe);
    tasks.critical(
        "the edge builder",
        builder.run(objects_rx, views_rx, identities, synced, shutdown.clone()),
    );

    let registry = Arc::new(registry);
    metrics_push.spawn(registry.clone(), None, shutdown.clone())?;
    let admin = AdminServer::bind(config.admin, readiness.clone(), registry)
        .await?
        .with_pages(verdict.pages());
    tasks.critical("the admin server", admin.serve(shutdown.clone()));
    serving.set_ready();
    tracing::info!(gateway = %config.gateway, xds = %config.xds_socket.display(), admin = %config.admin, "edge serving");
    shutdown.cancelled().await;
    serving.set_not_ready("shutting down");
    Ok(tasks.drain(DRAIN_DEADLINE).await?)
}

/// Starts the source of the Gateway API objects; their latest set.
async fn follow_objects(
    source: ObjectsSource,
    tasks: &Tasks,
    shutdown: &CancellationToken,
) -> Result<watch::Receiver<Arc<Objects>>, EdgeError> {
    let (objects_tx, objects_rx) = watch::channel(Arc::new(Objects::default()));
    match source {
        ObjectsSource::Dir(dir) => tasks.critical(
            "the config directory",
            objects::follow_dir(dir, objects_tx, shutdown.clone()),
        ),
        ObjectsSource::Kubernetes(watches) => {
            let client = crate::pod_source::kubernetes::client_from_env()
                .await
                .map_err(|e| EdgeError::Objects(format!("--from-kubernetes: {e}")))?;
            tasks.critical(
                "the Gateway API watches",
                kubernetes::follow(client, watches, objects_tx, shutdown.clone()),
            );
        }
    }
    Ok(objects_rx)
}

/// Follows the registrar's catalog as a reader: the interest to set (the services the
/// routes name) and the views it publishes.
fn follow_catalog(
    config: &EdgeConfig,
    metrics: &EdgeMetrics,
    tasks: &Tasks,
    shutdown: &CancellationToken,
) -> Result<(watch::Sender<Interest>, watch::Receiver<Arc<WatchedCatalog>>), EdgeError> {
    let context = AgentContext {
        node_name: config.pod_name.clone(),
        pod_identity: Some(config.identity.kind),
        spire_workload_socket: config.identity.spire_workload_socket.clone(),
    };
    // A reader's certificate (`spiffe://<td>/aether/edge/<ns>/<sa>`): the edge never writes endpoints.
    let link = RegistrarLink::start_as(
        &config.registrar,
        &config.registrar_link,
        &context,
        LinkRole::Edge,
        shutdown.clone(),
    )?;
    let (interest_tx, interest_rx) = watch::channel(Interest::default());
    let (views_tx, views_rx) = watch::channel(Arc::new(WatchedCatalog::default()));
    let connected = metrics.registrar_connected.clone();
    tasks.critical(
        "the registrar watch",
        catalog_watch::follow(link, interest_rx, views_tx, connected, shutdown.clone()),
    );
    Ok((interest_tx, views_rx))
}

/// `<namespace>/<name>`, both DNS labels.
fn check_gateway(gateway: &str) -> Result<(String, String), EdgeError> {
    let bad = || EdgeError::Gateway(aether_common::quote::quote(gateway).to_string());
    let (namespace, name) = gateway.split_once('/').ok_or_else(bad)?;
    if crate::upstreams::check(namespace).is_err() || name.is_empty() || name.len() > 253 {
        return Err(bad());
    }
    Ok((namespace.to_owned(), name.to_owned()))
}

/// Where the Gateway API objects come from.
#[derive(Debug)]
pub enum ObjectsSource {
    Dir(PathBuf),
    Kubernetes(kubernetes::Watches),
}

/// `--config-dir` or `--from-kubernetes` (exactly one), with `--certificate-namespaces`
/// (each a DNS label).
pub fn objects_source(config: &EdgeConfig, gateway: &(String, String)) -> Result<ObjectsSource, EdgeError> {
    match (&config.config_dir, config.from_kubernetes) {
        (Some(dir), false) => Ok(ObjectsSource::Dir(dir.clone())),
        (None, true) => {
            let namespaces = &config.certificate_namespaces;
            if let Some(bad) = namespaces.iter().find(|n| crate::upstreams::check(n).is_err()) {
                let bad = aether_common::quote::quote(bad);
                return Err(EdgeError::Objects(format!(
                    "--certificate-namespaces: {bad} is not a namespace"
                )));
            }
            Ok(ObjectsSource::Kubernetes(kubernetes::Watches::new(
                gateway.clone(),
                namespaces.clone(),
            )))
        }
        (dir, _) => Err(EdgeError::Objects(format!(
            "exactly one of --config-dir and --from-kubernetes is required (given: {})",
            if dir.is_some() { "both" } else { "neither" }
        ))),
    }
}

/// The edge as the identity providers see a workload: its namespace and service account.
fn own_pod(config: &EdgeConfig) -> LocalPod {
    LocalPod {
        container_id: String::new(),
        netns: PathBuf::new(),
        ips: Vec::new(),
        info: PodInfo {
            namespace: config.namespace.clone(),
            name: config.pod_name.clone(),
            service_account: config.service_account.clone(),
            ..Default::default()
        },
        listener_sockets: Default::default(),
    }
}

fn serve_xds(
    config: &EdgeConfig,
    cache: Cache,
    metrics: &EdgeMetrics,
    tasks: &Tasks,
    shutdown: &CancellationToken,
) -> Result<(), EdgeError> {
    let listener = crate::server::bind_private(&config.xds_socket).map_err(|e| match e {
        crate::server::StartError::Socket { path, source } => EdgeError::Socket { path, source },
        other => EdgeError::Socket {
            path: config.xds_socket.display().to_string(),
            source: std::io::Error::other(other.to_string()),
        },
    })?;
    let hooks = Hooks {
        metrics: metrics.xds.clone(),
        // The edge serves what its Gateway names; nothing is looked up on demand.
        on_demand: Arc::new(|_: &str, _: &[String]| {}),
    };
    let server = tonic::transport::Server::builder()
        .add_service(
            AggregatedDiscoveryServiceServer::new(AdsServer::new(cache, hooks))
                .max_decoding_message_size(4 * 1024 * 1024),
        )
        .serve_with_incoming_shutdown(UnixListenerStream::new(listener), shutdown.clone().cancelled_owned());
    tasks.critical("the xDS server", async move {
        if let Err(error) = server.await {
            tracing::error!(%error, "xDS server failed");
        }
    });
    Ok(())
}

/// The edge's instruments, `aether_edge_*`.
struct EdgeMetrics {
    xds: XdsMetrics,
    identity: IdentityMetrics,
    registrar_connected: Gauge,
}

impl EdgeMetrics {
    fn register(registry: &mut Registry) -> Self {
        let this = Self {
            xds: XdsMetrics::default(),
            identity: IdentityMetrics::default(),
            registrar_connected: Gauge::default(),
        };
        let registry = registry.sub_registry_with_prefix("aether_edge");
        this.xds.register(registry);
        this.identity.register(registry);
        registry.register(
            "registrar_connected",
            "1 while the Watch stream to the registrar is up",
            this.registrar_connected.clone(),
        );
        this
    }
}

/// The last projection, for `/debug/edge`.
#[derive(Clone, Default)]
struct Verdict(Arc<Mutex<Option<Edge>>>);

impl Verdict {
    fn pages(&self) -> aether_common::admin::Pages {
        let verdict = self.clone();
        Arc::new(move |path: &str| {
            let answer = (path == "/debug/edge").then(|| match &*verdict.0.lock() {
                Some(edge) => (200, aether_api::edge::status_json(edge).to_string()),
                None => (503, "{\"error\":\"no projection yet\"}".to_owned()),
            });
            answered(answer)
        })
    }
}

/// Projects and generates whenever the objects, the catalog or the gateway's SVID change.
struct Builder {
    gateway: (String, String),
    config: EdgeConfig,
    mtls: Option<Mtls>,
    identity_id: String,
    cache: Cache,
    interest: watch::Sender<Interest>,
    verdict: Verdict,
    /// Since when a new configuration waits for the catalog of a service it names.
    held_since: Option<Instant>,
}

/// How long a new configuration waits for the catalog of the services it newly names
/// before it is served anyway (their share answering 500 until the catalog comes).
const CATALOG_WAIT: Duration = Duration::from_secs(5);

impl Builder {
    async fn run(
        mut self,
        mut objects: watch::Receiver<Arc<Objects>>,
        mut views: watch::Receiver<Arc<WatchedCatalog>>,
        mut identities: Option<watch::Receiver<Arc<Identities>>>,
        synced: aether_common::readiness::Gate,
        shutdown: CancellationToken,
    ) {
        let mut first_view = true;
        loop {
            let current_objects = objects.borrow_and_update().clone();
            let view = views.borrow_and_update().clone();
            let current_identities = match &mut identities {
                Some(rx) => rx.borrow_and_update().clone(),
                None => Arc::new(Identities::default()),
            };
            let held_until = match self.build(&current_objects, &view, &current_identities) {
                Built::Ready(generated) => {
                    self.apply(generated).await;
                    None
                }
                Built::Held(until) => Some(until),
            };
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep_until(held_until.unwrap_or_else(Instant::now).into()), if held_until.is_some() => {}
                changed = objects.changed() => if changed.is_err() { return },
                changed = views.changed() => {
                    if changed.is_err() { return }
                    if std::mem::take(&mut first_view) {
                        synced.set_ready();
                    }
                }
                changed = async { identities.as_mut().expect("guarded").changed().await }, if identities.is_some() => {
                    if changed.is_err() { return }
                }
            }
        }
    }

    /// Serves `generated`, make-before-break: the clusters it adds go out first (the
    /// routes still on the old ones), then its routes with the clusters it drops still
    /// there, then the rest, each step once Envoy has ACKed the one before. A request never
    /// finds its route's cluster missing (500) while a change converges.
    async fn apply(&self, generated: Generated) {
        const UPSTREAM: [&str; 3] = [crate::xds::CLUSTER, crate::xds::ENDPOINT, crate::xds::SECRET];
        let current = self.cache.snapshot();
        let serving = current.get(crate::xds::LISTENER).is_some_and(|l| !l.is_empty());
        let now: Generated = (current.types.iter())
            .map(|(type_url, named)| (type_url.clone(), named.values().cloned().collect()))
            .collect();
        if serving {
            let (adding, added) = with_upstreams_of(&now, &generated, &UPSTREAM);
            if !added.is_empty() {
                self.step(adding, &added, "the new clusters").await;
            }
            let (moving, _) = with_upstreams_of(&generated, &now, &UPSTREAM);
            let moved: Vec<(&str, String)> = [crate::xds::LISTENER, crate::xds::ROUTE]
                .into_iter()
                .flat_map(|type_url| {
                    let changed = (generated.get(type_url).into_iter().flatten())
                        .filter(|r| current.version_of(type_url, &r.name) != Some(r.version.as_str()));
                    changed.map(move |r| (type_url, r.name.clone()))
                })
                .collect();
            if !moved.is_empty() && moving != generated {
                self.step(moving, &moved, "the new routes").await;
            }
        }
        self.cache.set(generated);
    }

    /// Serves `resources` and waits until Envoy has ACKed `wanted` (at most [`CATALOG_WAIT`]).
    async fn step(&self, resources: Generated, wanted: &[(&str, String)], what: &str) {
        self.cache.set(resources);
        if let Err(error) = self.cache.wait_acked(wanted, CATALOG_WAIT).await {
            tracing::warn!(%error, "Envoy has not taken {what}: going on with the change");
        }
    }

    /// Projects and generates: `Ready` to serve, or `Held` until a time (or until the
    /// catalog covers the new configuration, whichever comes first).
    fn build(&mut self, objects: &Objects, view: &WatchedCatalog, identities: &Identities) -> Built {
        let key = format!("{}/{}", self.gateway.0, self.gateway.1);
        let Some(gateway) = objects.gateways.get(&key) else {
            tracing::debug!(gateway = %key, "the Gateway does not exist (yet): serving nothing");
            *self.verdict.0.lock() = None;
            self.interest.send_if_modified(|i| replace(i, Interest::default()));
            return Built::Ready(Generated::default());
        };
        let class = objects.classes.get(&gateway.spec.gateway_class_name);
        let catalog = &view.catalog;
        let exists = |service: &str| catalog.services.contains_key(service) || !view.filter.contains(service);
        let now = k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(k8s_openapi::jiff::Timestamp::now());
        let edge = aether_api::edge::project(
            &Projection {
                class,
                gateway,
                routes: &objects.routes,
                grants: &objects.grants,
                namespace_labels: &objects.namespace_labels,
                secrets: &objects.secrets,
                service_exists: &exists,
            },
            &now,
        );
        let services = backend_services(&edge);
        let covered = (services.iter()).all(|s| view.filter.contains(s) && view.catalog.services.contains_key(s));
        let wanted = Interest::Services {
            services,
            policy_namespaces: Default::default(),
        };
        self.interest.send_if_modified(|i| replace(i, wanted));
        // A route moved to a service the catalog has not sent yet would answer 500 until it
        // comes: the running configuration serves on while the registrar catches up.
        let serving = (self.cache.snapshot().get(crate::xds::LISTENER)).is_some_and(|l| !l.is_empty());
        if !covered && serving {
            let since = *self.held_since.get_or_insert_with(Instant::now);
            if since.elapsed() < CATALOG_WAIT {
                *self.verdict.0.lock() = Some(edge);
                return Built::Held(since + CATALOG_WAIT);
            }
            tracing::warn!(gateway = %key, "the registrar has not sent the catalog of every backend in {CATALOG_WAIT:?}: serving the new routes anyway");
        }
        self.held_since = None;
        let generated = generate(&EdgeInputs {
            edge: &edge,
            catalog,
            mesh_domain: &self.config.mesh_domain,
            bind_address: &self.config.bind_address.to_string(),
            port_offset: u32::from(self.config.port_offset),
            mtls: self.mtls.as_ref(),
            identities,
            identity_id: &self.identity_id,
        });
        tracing::debug!(gateway = %key, ports = edge.ports.len(), "edge configuration built");
        *self.verdict.0.lock() = Some(edge);
        Built::Ready(generated)
    }
}

/// `base` plus the resources of `types` that `other` has and `base` lacks; and those
/// added (type URL, name), secrets aside (an ACK of a secret says nothing of a cluster).
fn with_upstreams_of<'a>(
    base: &Generated,
    other: &'a Generated,
    types: &[&'a str],
) -> (Generated, Vec<(&'a str, String)>) {
    let mut out = base.clone();
    let mut added = Vec::new();
    for type_url in types {
        let have: BTreeSet<&str> = base
            .get(*type_url)
            .into_iter()
            .flatten()
            .map(|r| r.name.as_str())
            .collect();
        for resource in other
            .get(*type_url)
            .into_iter()
            .flatten()
            .filter(|r| !have.contains(r.name.as_str()))
        {
            if *type_url != crate::xds::SECRET {
                added.push((*type_url, resource.name.clone()));
            }
            out.entry((*type_url).to_owned()).or_default().push(resource.clone());
        }
    }
    (out, added)
}

/// What a build made of the objects and the catalog.
enum Built {
    Ready(Generated),
    /// Waiting for the catalog of a service the new configuration names, until then.
    Held(Instant),
}

/// Replaces `current` with `wanted` if they differ; whether it did.
fn replace(current: &mut Interest, wanted: Interest) -> bool {
    let changed = *current != wanted;
    if changed {
        *current = wanted;
    }
    changed
}
