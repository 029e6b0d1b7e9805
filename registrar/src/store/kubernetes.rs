//! The Kubernetes store (`--store kubernetes`): the catalog derived, read-only, from
//! the cluster. See proposals/004.
//!
//! - **Endpoints** come from Pods labelled `aether.io/managed=true` (all namespaces),
//!   one per pod IP, by the rule the agent registers its pods with
//!   ([`aether_common::pod_endpoint`], [`aether_common::pod_meta`]): service
//!   `<ns>/<config.aether.io/service or service account>`; health HEALTHY when the pod's `Ready` condition is `True`, UNHEALTHY
//!   otherwise, DRAINING once it has a `deletionTimestamp`; locality from its Node's
//!   `topology.kubernetes.io/region` / `zone` labels. Pods without an IP or mesh port,
//!   or that have finished, have no endpoint.
//! - **VIPs** must stay stable, so they are stored: in one ConfigMap
//!   (`--kube-vip-configmap`, data key `<ns>.<name>` → VIP; namespaces and names are
//!   DNS labels, so the dot is unambiguous). A replica that sees a managed pod of a
//!   service without a VIP allocates one (the usual hash slot, probing past the
//!   ConfigMap's VIPs) and writes the ConfigMap with its `resourceVersion`: of
//!   replicas racing, one wins and the others get 409, re-read and find the VIP.
//!   VIPs are never removed, so a service that comes back keeps its address.
//! - A service is in the catalog while it has a VIP and at least one endpoint. It
//!   carries the attributes of the Kubernetes Service of the same namespace and name
//!   (`kubernetes`: clusterIPs, trafficDistribution) from the Service watch
//!   ([`ClusterServices`]), which does not hold `load` back longer than [`ROUTES_GRACE`]
//!   either.
//! - **Configuration records** are the cluster's objects of each kind, projected by the
//!   one projector from the registrar's watch of the kind (HTTPRoutes and GRPCRoutes with
//!   Service parents from [`ClusterRoutes`], AuthorizationPolicies with the mesh root
//!   namespace from [`ClusterPolicies`], HTTPFilters from [`ClusterHttpFilters`]); a
//!   refused object keeps its last accepted version while this process runs. A kind does not hold `load` back longer than
//!   [`ROUTES_GRACE`] (a cluster without its CRD has none).
//! - Agents' Register/Unregister are accepted and ignored (`accepts_writes` is false).
//!
//! The watches (pods, nodes, the ConfigMap, Services, each record kind) feed one task that recomputes the
//! derived catalog after each burst of events and diffs it against the last one; every
//! changed record gets the next revision of a per-process counter. Revisions are local:
//! each replica derives the same catalog from the same cluster on its own.

use parking_lot::Mutex;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::net::IpAddr;
use std::pin::pin;
use std::sync::Arc;
use std::time::Duration;

use aether_common::pod_endpoint::{self, PodEndpoints};
use aether_common::pod_meta::{self, AppProtocol};
use aether_proto::registry::v1::{Endpoint, External, Locality, PodInfo as PodRef, Service};
use async_trait::async_trait;
use futures::StreamExt;
use k8s_openapi::api::core::v1::{ConfigMap, Node, Pod, PodSpec, PodStatus};
use kube::api::{ObjectMeta, PostParams};
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use kube::{Api, Client};
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

use super::{Contents, Feed, FeedChange, FeedChangeKind, FeedEvent, Revision, Store, StoreError, StoreOp, Stored};
use crate::cluster::Sets;
use crate::cluster::services::{ClusterServices, ServiceSet};
use crate::external_services::{ClusterExternalServices, ExternalServices};
use crate::http_filters::{ClusterHttpFilters, HttpFilters};
use crate::mesh_configs::{ClusterMeshConfigs, MeshConfigs};
use crate::model::{ServiceKey, validate_endpoint};
use crate::policies::{ClusterPolicies, Policies};
use crate::records::{ConfigKind, ConfigRecord, ConfigRecords, Record};
use crate::routes::Routes;
use crate::routes::kubernetes::ClusterRoutes;
use crate::sources::{Destination, KUBERNETES, ObjectKind, ObjectSet, Projector, report};
use crate::vip::VipAllocator;

/// Where VIPs are kept unless `--kube-vip-configmap` says otherwise.
pub const DEFAULT_VIP_CONFIGMAP: &str = "aether-system/aether-registrar-vips";
pub use aether_common::pod_meta::{REGION_LABEL, ZONE_LABEL};
/// Changes kept for feeds that fall behind; further behind gets a Resync.
const LOG_LIMIT: usize = 100_000;
/// Events arriving within this window are folded into one recompute.
const DEBOUNCE: Duration = Duration::from_millis(20);
/// Pause before retrying a failed VIP write.
const VIP_RETRY: Duration = Duration::from_millis(500);
/// The longest `load` waits for the first set of each record kind, and of Services.
pub const ROUTES_GRACE: Duration = Duration::from_secs(5);

#[derive(Clone)]
pub struct KubeConfig {
    /// `<namespace>/<name>` of the VIP ConfigMap.
    pub vip_configmap: String,
    pub vips: VipAllocator,
    /// The cluster's route objects (the registrar's one route watch).
    pub routes: ClusterRoutes,
    /// The cluster's Services (the registrar's one Service watch).
    pub services: ClusterServices,
    /// The cluster's AuthorizationPolicies (the registrar's one policy watch), and how
    /// they are projected.
    pub policies: ClusterPolicies,
    pub policy_options: aether_api::authorization::ProjectOptions,
    /// The cluster's HTTPFilters (the registrar's one HTTPFilter watch).
    pub http_filters: ClusterHttpFilters,
    /// The cluster's MeshConfigs (projected with the same root namespace as policies).
    pub mesh_configs: ClusterMeshConfigs,
    /// The cluster's ExternalServices: services with a VIP and no pods.
    pub external_services: ClusterExternalServices,
}

pub struct KubeStore {
    shared: Arc<Shared>,
    /// Stops the watch task when the store is dropped.
    _stop: tokio_util::sync::DropGuard,
    client: Client,
}

struct Shared {
    state: Mutex<Derived>,
    /// The derived catalog's revision, bumped after each recompute that changed it.
    revision: watch::Sender<Revision>,
    /// True once pods, nodes and the ConfigMap have each been listed once, and the routes
    /// and Services (or [`ROUTES_GRACE`] passed).
    synced: watch::Sender<bool>,
}

/// The derived catalog and its recent changes.
#[derive(Default)]
struct Derived {
    revision: Revision,
    services: BTreeMap<String, Stored<Service>>,
    endpoints: BTreeMap<(String, String), Stored<Endpoint>>,
    /// Configuration records by kind (at its index) and key.
    configs: [BTreeMap<String, Stored<ConfigRecord>>; ConfigKind::ALL.len()],
    log: VecDeque<FeedChange>,
}

impl Derived {
    fn contents(&self) -> Contents {
        Contents {
            revision: self.revision,
            services: self.services.values().cloned().collect(),
            endpoints: self.endpoints.values().cloned().collect(),
            configs: self.configs.iter().flat_map(BTreeMap::values).cloned().collect(),
            unreadable: Vec::new(),
        }
    }

    fn record(&mut self, kind: FeedChangeKind) -> Revision {
        self.revision += 1;
        self.log.push_back(FeedChange {
            revision: self.revision,
            kind,
        });
        while self.log.len() > LOG_LIMIT {
            self.log.pop_front();
        }
        self.revision
    }

    /// Replaces the catalog with `services`/`endpoints`, logging each difference.
    fn update(&mut self, services: BTreeMap<String, Service>, endpoints: BTreeMap<(String, String), Endpoint>) -> bool {
        let before = self.revision;
        // Endpoints leave before their services, and services arrive before their endpoints.
        let gone: Vec<_> = self
            .endpoints
            .keys()
            .filter(|k| !endpoints.contains_key(*k))
            .cloned()
            .collect();
        for (service, address) in gone {
            self.endpoints.remove(&(service.clone(), address.clone()));
            self.record(FeedChangeKind::EndpointDeleted { service, address });
        }
        let gone: Vec<_> = self
            .services
            .keys()
            .filter(|k| !services.contains_key(*k))
            .cloned()
            .collect();
        for key in gone {
            self.services.remove(&key);
            self.record(FeedChangeKind::ServiceDeleted { key });
        }
        for (key, service) in services {
            if self.services.get(&key).is_some_and(|s| s.value == service) {
                continue;
            }
            let revision = self.record(FeedChangeKind::ServicePut(service.clone()));
            self.services.insert(
                key,
                Stored {
                    value: service,
                    revision,
                },
            );
        }
        for (key, endpoint) in endpoints {
            if self.endpoints.get(&key).is_some_and(|e| e.value == endpoint) {
                continue;
            }
            let revision = self.record(FeedChangeKind::EndpointPut(endpoint.clone()));
            self.endpoints.insert(
                key,
                Stored {
                    value: endpoint,
                    revision,
                },
            );
        }
        self.revision != before
    }

    /// Replaces the records of `kind` with `records` (by key), logging each difference.
    fn update_configs(&mut self, kind: ConfigKind, records: &BTreeMap<String, ConfigRecord>) -> bool {
        let before = self.revision;
        let held = &self.configs[kind.index()];
        let gone: Vec<String> = held.keys().filter(|k| !records.contains_key(*k)).cloned().collect();
        for key in gone {
            self.configs[kind.index()].remove(&key);
            self.record(FeedChangeKind::ConfigDeleted { kind, key });
        }
        for (key, record) in records {
            if self.configs[kind.index()].get(key).is_some_and(|r| r.value == *record) {
                continue;
            }
            let revision = self.record(FeedChangeKind::ConfigPut(record.clone()));
            let stored = Stored {
                value: record.clone(),
                revision,
            };
            self.configs[kind.index()].insert(key.clone(), stored);
        }
        self.revision != before
    }
}

/// `<namespace>/<name>` of the VIP ConfigMap, checked.
fn parse_configmap(value: &str) -> Result<(String, String), StoreError> {
    let bad = |why: &str| StoreError::Config(format!("--kube-vip-configmap: {value:?}: {why}"));
    let (ns, name) = value
        .split_once('/')
        .ok_or_else(|| bad("expected \"<namespace>/<name>\""))?;
    ServiceKey::from_parts("--kube-vip-configmap", ns, name).map_err(|e| bad(&e.reason))?;
    Ok((ns.to_owned(), name.to_owned()))
}

/// The ConfigMap data key of a service: `<ns>.<name>` (ConfigMap keys cannot hold '/').
pub fn vip_data_key(service: &str) -> String {
    service.replacen('/', ".", 1)
}

fn service_from_data_key(key: &str) -> Option<String> {
    let (ns, name) = key.split_once('.')?;
    ServiceKey::from_parts("vip", ns, name).ok().map(|k| k.to_string())
}

impl KubeStore {
    /// Starts watching the cluster through `client`. `load` waits until the first
    /// lists are in.
    pub fn start(client: Client, config: KubeConfig) -> Result<Self, StoreError> {
        let (namespace, name) = parse_configmap(&config.vip_configmap)?;
        let shared = Arc::new(Shared {
            state: Mutex::new(Derived::default()),
            revision: watch::Sender::new(0),
            synced: watch::Sender::new(false),
        });
        let stop = CancellationToken::new();
        let deriver = Deriver {
            shared: shared.clone(),
            configmaps: Api::namespaced(client.clone(), &namespace),
            configmap: name,
            vips: config.vips,
            pods: HashMap::new(),
            nodes: HashMap::new(),
            vip_map: BTreeMap::new(),
            skipped: HashMap::new(),
            configs: ConfigRecords::default(),
            externals: BTreeMap::new(),
            attributes: Arc::default(),
            synced: [false; SYNCED],
        };
        let (tx, rx) = mpsc::channel(1024);
        let mesh_configs = MeshConfigs {
            options: config.policy_options.clone(),
        };
        let policies = Policies {
            options: config.policy_options,
        };
        let watches = vec![
            tokio::spawn(derive(config.routes, Routes, tx.clone())),
            tokio::spawn(derive(config.policies, policies, tx.clone())),
            tokio::spawn(derive(config.http_filters, HttpFilters, tx.clone())),
            tokio::spawn(derive(config.mesh_configs, mesh_configs, tx.clone())),
            tokio::spawn(derive(config.external_services, ExternalServices, tx.clone())),
            tokio::spawn(forward_services(config.services, tx.clone())),
        ];
        tokio::spawn(deriver.run(client.clone(), (tx, rx), watches, stop.clone()));
        Ok(Self {
            shared,
            _stop: stop.drop_guard(),
            client,
        })
    }
}

#[async_trait]
impl Store for KubeStore {
    fn kind(&self) -> &'static str {
        "kubernetes"
    }

    async fn load(&self) -> Result<Contents, StoreError> {
        let mut synced = self.shared.synced.subscribe();
        synced
            .wait_for(|s| *s)
            .await
            .map_err(|_| StoreError::Unavailable("the Kubernetes watch task stopped".into()))?;
        Ok(self.shared.state.lock().contents())
    }

    async fn commit(&self, ops: Vec<StoreOp>) -> Result<Revision, StoreError> {
        // Never called with writes (accepts_writes is false); be explicit if it is.
        if !ops.is_empty() {
            tracing::warn!(
                ops = ops.len(),
                "the Kubernetes store is read-only; ignoring writes (endpoints come from Pods)"
            );
        }
        Ok(*self.shared.revision.borrow())
    }

    fn feed(&self, after: Revision) -> Feed {
        let shared = self.shared.clone();
        let revisions = shared.revision.subscribe();
        Box::pin(futures::stream::unfold(
            (shared, revisions, after),
            |(shared, mut revisions, mut after)| async move {
                if revisions.wait_for(|r| *r > after).await.is_err() {
                    // The store is gone; a feed never ends, so wait forever.
                    futures::future::pending::<()>().await;
                }
                let state = shared.state.lock();
                let oldest = state.log.front().map_or(state.revision + 1, |c| c.revision);
                let event = if oldest > after + 1 {
                    FeedEvent::Resync(state.contents())
                } else {
                    FeedEvent::Changes {
                        revision: state.revision,
                        changes: state.log.iter().filter(|c| c.revision > after).cloned().collect(),
                    }
                };
                after = state.revision;
                drop(state);
                Some((event, (shared, revisions, after)))
            },
        ))
    }

    async fn refresh(&self, _nodes: Vec<String>) -> Result<(), StoreError> {
        Ok(())
    }

    async fn expired_nodes(&self) -> Result<Vec<String>, StoreError> {
        // Endpoints leave with their pods.
        Ok(Vec::new())
    }

    async fn ping(&self) -> Result<(), StoreError> {
        self.client
            .apiserver_version()
            .await
            .map(|_| ())
            .map_err(|e| StoreError::Unavailable(format!("Kubernetes API: {e}")))
    }

    fn accepts_writes(&self) -> bool {
        false
    }
}

/// What a Pod contributes, extracted once per event.
#[derive(Clone, Debug, PartialEq)]
struct PodView {
    key: String,
    endpoints: Vec<Endpoint>,
    node: String,
    service: String,
}

enum Input {
    Pod(Box<Event<Pod>>),
    Node(Box<Event<Node>>),
    ConfigMap(Box<Event<ConfigMap>>),
    /// The cluster's Services; `None`: not listed within [`ROUTES_GRACE`].
    Services(Option<Arc<ServiceSet>>),
    /// The records projected from the cluster's objects of a kind, by key; `None`: not
    /// listed within [`ROUTES_GRACE`].
    Records(ConfigKind, Option<BTreeMap<String, ConfigRecord>>),
    /// The cluster's ExternalServices, projected, by service key; `None`: not listed
    /// within [`ROUTES_GRACE`].
    Externals(Option<BTreeMap<String, External>>),
    Failed(&'static str, String),
}

/// Re-lists in progress: each replaces its set when complete.
#[derive(Default)]
struct Relists {
    pods: Option<HashMap<String, PodView>>,
    nodes: Option<HashMap<String, Locality>>,
    vips: Option<BTreeMap<String, String>>,
}

struct Deriver {
    shared: Arc<Shared>,
    configmaps: Api<ConfigMap>,
    configmap: String,
    vips: VipAllocator,
    pods: HashMap<String, PodView>,
    nodes: HashMap<String, Locality>,
    /// service key → VIP, as the ConfigMap holds it.
    vip_map: BTreeMap<String, String>,
    /// Pods skipped for bad data, with the reason last logged (each logged once).
    skipped: HashMap<String, String>,
    /// The records of each kind as last projected from the cluster.
    configs: ConfigRecords,
    /// The ExternalServices as last projected, by service key.
    externals: BTreeMap<String, External>,
    /// Each Service's attributes, by service key.
    attributes: Arc<ServiceSet>,
    /// Pods, nodes, ConfigMap listed once; Services and each record kind listed (or
    /// late): see [`SYNCED`].
    synced: [bool; SYNCED],
}

/// What must be listed before the catalog is served: pods, nodes, the VIP ConfigMap,
/// Services (at [`SERVICES_SYNCED`]), then each record kind (at [`records_synced`]).
const SYNCED: usize = 5 + ConfigKind::ALL.len();
const SERVICES_SYNCED: usize = 3;
/// After every record kind.
const EXTERNALS_SYNCED: usize = SYNCED - 1;

fn records_synced(kind: ConfigKind) -> usize {
    SERVICES_SYNCED + 1 + kind.index()
}

/// Projects each set of one kind's objects as the cluster watch publishes it, and hands
/// the records to the deriver; the first within [`ROUTES_GRACE`], or `None` then, so a
/// kind never holds the catalog back for long. Sets whose specs did not change (only
/// statuses did) are not projected again.
async fn derive<K, S>(mut sets: Sets<S>, kind: K, tx: mpsc::Sender<Input>)
where
    K: ObjectKind,
    K::Record: ToDeriver,
    S: ObjectSet<Object = K::Object>,
{
    let mut next = match tokio::time::timeout(ROUTES_GRACE, sets.next()).await {
        Ok(Some(set)) => Some(set),
        Ok(None) => return,
        Err(_) => {
            let objects = K::Record::objects();
            tracing::warn!("the {objects} objects are not listed yet; serving the catalog without them until they are");
            None
        }
    };
    let (mut projector, mut reported, mut projected) = (Projector::new(kind), Vec::new(), None);
    loop {
        let records = next.filter(|set| projected != Some(set.spec_version())).map(|set| {
            projected = Some(set.spec_version());
            let projection = projector.project_holding(set.origins(), &HashSet::new());
            report::<K::Record>(KUBERNETES, &projection.refused, &mut reported);
            projection.records
        });
        if (records.is_some() || projected.is_none()) && tx.send(K::Record::input(records)).await.is_err() {
            return;
        }
        match sets.next().await {
            Some(set) => next = Some(set),
            None => return,
        }
    }
}

/// What the deriver is handed a kind's projections as.
trait ToDeriver: Destination {
    fn input(records: Option<BTreeMap<String, Self>>) -> Input;
}

impl<T: Record> ToDeriver for T {
    fn input(records: Option<BTreeMap<String, Self>>) -> Input {
        let records = records.map(|records| {
            let records = records.into_iter();
            records
                .map(|(key, record)| (key, ConfigRecord::from(Arc::new(record))))
                .collect()
        });
        Input::Records(T::KIND, records)
    }
}

impl ToDeriver for External {
    fn input(records: Option<BTreeMap<String, Self>>) -> Input {
        Input::Externals(records)
    }
}

/// Forwards each set of Services; the first within [`ROUTES_GRACE`], or `None` then.
async fn forward_services(mut services: ClusterServices, tx: mpsc::Sender<Input>) {
    let first = match tokio::time::timeout(ROUTES_GRACE, services.next()).await {
        Ok(Some(set)) => Some(set),
        Ok(None) => return,
        Err(_) => {
            tracing::warn!(
                "the Services are not listed yet; serving the catalog without their attributes until they are"
            );
            None
        }
    };
    let mut next = first;
    loop {
        if tx.send(Input::Services(next)).await.is_err() {
            return;
        }
        match services.next().await {
            Some(set) => next = Some(set),
            None => return,
        }
    }
}

/// Forwards one watch into the deriver's queue.
async fn forward<K, F>(
    stream: impl futures::Stream<Item = Result<Event<K>, watcher::Error>>,
    what: &'static str,
    tx: mpsc::Sender<Input>,
    wrap: F,
) where
    F: Fn(Event<K>) -> Input,
{
    let mut stream = pin!(stream);
    let mut failing = false;
    while let Some(next) = stream.next().await {
        let input = match next {
            Ok(event) => {
                if std::mem::take(&mut failing) {
                    tracing::info!(watch = what, "Kubernetes watch recovered");
                }
                wrap(event)
            }
            Err(error) => {
                let first = !std::mem::replace(&mut failing, true);
                if !first {
                    tracing::debug!(watch = what, %error, "Kubernetes watch failing; retrying with backoff");
                    continue;
                }
                Input::Failed(what, error.to_string())
            }
        };
        if tx.send(input).await.is_err() {
            return;
        }
    }
}

impl Deriver {
    /// Derives the catalog from the inputs of `channel` (the record and Service
    /// watches already forward into it, in `watches`) until `stop`.
    async fn run(
        mut self,
        client: Client,
        (tx, mut rx): (mpsc::Sender<Input>, mpsc::Receiver<Input>),
        mut watches: Vec<tokio::task::JoinHandle<()>>,
        stop: CancellationToken,
    ) {
        let labels = format!("{}=true", pod_meta::MANAGED_LABEL);
        let pods = watcher::watcher(
            Api::<Pod>::all(client.clone()),
            watcher::Config::default().labels(&labels),
        )
        .default_backoff();
        let nodes = watcher::watcher(Api::<Node>::all(client.clone()), watcher::Config::default()).default_backoff();
        let configmap = watcher::watcher(
            self.configmaps.clone(),
            watcher::Config::default().fields(&format!("metadata.name={}", self.configmap)),
        )
        .default_backoff();
        watches.extend([
            tokio::spawn(forward(pods, "pods", tx.clone(), |e| Input::Pod(Box::new(e)))),
            tokio::spawn(forward(nodes, "nodes", tx.clone(), |e| Input::Node(Box::new(e)))),
            tokio::spawn(forward(configmap, "vip configmap", tx, |e| {
                Input::ConfigMap(Box::new(e))
            })),
        ]);
        tracing::info!(configmap = %self.configmap, "deriving the catalog from managed Pods and Nodes");
        let mut relists = Relists::default();
        loop {
            let first = tokio::select! {
                _ = stop.cancelled() => break,
                input = rx.recv() => input,
            };
            let Some(first) = first else { break };
            let mut inputs = vec![first];
            // Fold a burst of events into one recompute.
            let deadline = tokio::time::Instant::now() + DEBOUNCE;
            while let Ok(Some(input)) = tokio::time::timeout_at(deadline, rx.recv()).await {
                inputs.push(input);
                if inputs.len() >= 4096 {
                    break;
                }
            }
            for input in inputs {
                self.apply(input, &mut relists);
            }
            if self.synced.iter().all(|s| *s) {
                self.allocate_missing_vips().await;
                self.recompute();
                self.shared.synced.send_replace(true);
            }
        }
        for task in watches {
            task.abort();
        }
    }

    fn apply(&mut self, input: Input, relists: &mut Relists) {
        match input {
            Input::Pod(event) => match *event {
                Event::Init => relists.pods = Some(HashMap::new()),
                Event::InitApply(pod) => {
                    if let Some(view) = self.view(&pod) {
                        relists.pods.get_or_insert_default().insert(view.key.clone(), view);
                    }
                }
                Event::InitDone => {
                    self.pods = relists.pods.take().unwrap_or_default();
                    self.synced[0] = true;
                }
                Event::Apply(pod) => {
                    let key = pod_key(&pod);
                    match self.view(&pod) {
                        Some(view) => self.pods.insert(key, view),
                        None => self.pods.remove(&key),
                    };
                }
                Event::Delete(pod) => {
                    let key = pod_key(&pod);
                    self.skipped.remove(&key);
                    self.pods.remove(&key);
                }
            },
            Input::Node(event) => match *event {
                Event::Init => relists.nodes = Some(HashMap::new()),
                Event::InitApply(node) => {
                    let name = node.metadata.name.clone().unwrap_or_default();
                    relists.nodes.get_or_insert_default().insert(name, locality(&node));
                }
                Event::InitDone => {
                    self.nodes = relists.nodes.take().unwrap_or_default();
                    self.synced[1] = true;
                }
                Event::Apply(node) => {
                    self.nodes
                        .insert(node.metadata.name.clone().unwrap_or_default(), locality(&node));
                }
                Event::Delete(node) => {
                    self.nodes.remove(node.metadata.name.as_deref().unwrap_or_default());
                }
            },
            Input::ConfigMap(event) => match *event {
                Event::Init => relists.vips = Some(BTreeMap::new()),
                Event::InitApply(cm) => *relists.vips.get_or_insert_default() = vip_entries(&cm),
                Event::InitDone => {
                    self.vip_map = relists.vips.take().unwrap_or_default();
                    self.synced[2] = true;
                }
                Event::Apply(cm) => self.vip_map = vip_entries(&cm),
                // Deleting the ConfigMap would forget every VIP; keep serving the ones we
                // know and write them back with the next allocation.
                Event::Delete(_) => tracing::warn!(
                    configmap = %self.configmap,
                    "the VIP ConfigMap was deleted; keeping the VIPs already known"
                ),
            },
            Input::Services(set) => {
                if let Some(set) = set {
                    self.attributes = set;
                }
                self.synced[SERVICES_SYNCED] = true;
            }
            Input::Records(kind, records) => {
                if let Some(records) = records {
                    self.configs.replace(kind, records);
                }
                self.synced[records_synced(kind)] = true;
            }
            Input::Externals(externals) => {
                if let Some(externals) = externals {
                    self.externals = externals;
                }
                self.synced[EXTERNALS_SYNCED] = true;
            }
            Input::Failed(what, error) => {
                tracing::warn!(watch = what, %error, "Kubernetes watch failed; retrying with backoff (serving the last state)");
            }
        }
    }

    /// A managed pod's contribution; `None` (logged once) if it has nothing to serve.
    fn view(&mut self, pod: &Pod) -> Option<PodView> {
        let key = pod_key(pod);
        match pod_endpoints(pod) {
            Ok(view) => {
                self.skipped.remove(&key);
                view
            }
            Err(error) => {
                if self.skipped.get(&key) != Some(&error) {
                    tracing::warn!(pod = %key, %error, "skipping a managed pod");
                    self.skipped.insert(key, error);
                }
                None
            }
        }
    }

    /// Writes VIPs for services that have pods, and external services, without one yet.
    async fn allocate_missing_vips(&mut self) {
        let with_pods = (self.pods.values().filter(|p| !p.endpoints.is_empty())).map(|p| p.service.clone());
        let missing: BTreeSet<String> = (with_pods.chain(self.externals.keys().cloned()))
            .filter(|s| !self.vip_map.contains_key(s))
            .collect();
        if missing.is_empty() {
            return;
        }
        for attempt in 0..5 {
            match self.write_vips(&missing).await {
                Ok(entries) => {
                    self.vip_map = entries;
                    return;
                }
                Err(VipWrite::Conflict) => {
                    tracing::debug!(attempt, "another replica updated the VIP ConfigMap first; re-reading");
                }
                Err(VipWrite::Failed(error)) => {
                    tracing::warn!(%error, services = ?missing, "writing VIPs to the ConfigMap failed; retrying");
                    tokio::time::sleep(VIP_RETRY).await;
                }
            }
        }
        tracing::warn!(services = ?missing, "could not store VIPs yet; their endpoints wait for the next change");
    }

    async fn write_vips(&self, missing: &BTreeSet<String>) -> Result<BTreeMap<String, String>, VipWrite> {
        let failed = |e: kube::Error| {
            if matches!(&e, kube::Error::Api(s) if s.code == 409) {
                VipWrite::Conflict
            } else {
                VipWrite::Failed(e.to_string())
            }
        };
        let current = self.configmaps.get_opt(&self.configmap).await.map_err(failed)?;
        let mut entries = current.as_ref().map(vip_entries).unwrap_or_default();
        // What this replica knew survives a deleted ConfigMap.
        for (service, vip) in &self.vip_map {
            entries.entry(service.clone()).or_insert_with(|| vip.clone());
        }
        let mut taken: HashSet<IpAddr> = entries.values().filter_map(|v| v.parse().ok()).collect();
        for service in missing {
            if entries.contains_key(service) {
                continue;
            }
            let Ok(key) = ServiceKey::parse("service", service) else {
                continue;
            };
            match self.vips.allocate(&key, |ip| taken.contains(&ip)) {
                Ok(vip) => {
                    taken.insert(vip);
                    entries.insert(service.clone(), vip.to_string());
                    tracing::info!(%service, %vip, "allocated a VIP");
                }
                Err(error) => tracing::error!(%service, %error, "cannot allocate a VIP"),
            }
        }
        let data: BTreeMap<String, String> = entries.iter().map(|(s, v)| (vip_data_key(s), v.clone())).collect();
        let written = match current {
            Some(mut cm) => {
                cm.data = Some(data);
                // Carries metadata.resourceVersion: a concurrent write answers 409.
                self.configmaps
                    .replace(&self.configmap, &PostParams::default(), &cm)
                    .await
                    .map_err(failed)?
            }
            None => {
                let cm = ConfigMap {
                    metadata: ObjectMeta {
                        name: Some(self.configmap.clone()),
                        labels: Some(BTreeMap::from([(
                            "app.kubernetes.io/managed-by".to_owned(),
                            "aether-registrar".to_owned(),
                        )])),
                        ..Default::default()
                    },
                    data: Some(data),
                    ..Default::default()
                };
                self.configmaps
                    .create(&PostParams::default(), &cm)
                    .await
                    .map_err(failed)?
            }
        };
        Ok(vip_entries(&written))
    }

    /// Recomputes the derived catalog and publishes what changed.
    fn recompute(&mut self) {
        let mut services = BTreeMap::new();
        let mut endpoints = BTreeMap::new();
        let mut pods: Vec<&PodView> = self.pods.values().collect();
        // A deterministic winner if two pods claim one address.
        pods.sort_by(|a, b| a.key.cmp(&b.key));
        for pod in pods {
            let Some(vip) = self.vip_map.get(&pod.service) else {
                continue;
            };
            let (namespace, name) = pod.service.split_once('/').unwrap_or_default();
            services.entry(pod.service.clone()).or_insert_with(|| Service {
                namespace: namespace.to_owned(),
                name: name.to_owned(),
                vip: vip.clone(),
                kubernetes: self.attributes.get(pod.service.as_str()).cloned(),
                external: None,
            });
            for endpoint in &pod.endpoints {
                let mut endpoint = endpoint.clone();
                endpoint.locality = self.nodes.get(&pod.node).cloned();
                endpoints.insert((endpoint.service.clone(), endpoint.address.clone()), endpoint);
            }
        }
        // An ExternalService whose name pods' service holds is refused (as with a writable store).
        for (key, external) in &self.externals {
            let Some(vip) = self.vip_map.get(key) else { continue };
            if services.contains_key(key) {
                tracing::warn!(service = %key, "ExternalService refused: a mesh service of this namespace and name exists (its pods register it)");
                continue;
            }
            let (namespace, name) = key.split_once('/').unwrap_or_default();
            let service = Service {
                namespace: namespace.to_owned(),
                name: name.to_owned(),
                vip: vip.clone(),
                kubernetes: None,
                external: Some(Box::new(external.clone())),
            };
            services.insert(key.clone(), service);
        }
        let mut state = self.shared.state.lock();
        let mut changed = state.update(services, endpoints);
        for kind in ConfigKind::ALL {
            changed |= state.update_configs(kind, self.configs.of(kind));
        }
        if changed {
            let revision = state.revision;
            drop(state);
            self.shared.revision.send_replace(revision);
        }
    }
}

enum VipWrite {
    Conflict,
    Failed(String),
}

fn pod_key(pod: &Pod) -> String {
    format!(
        "{}/{}",
        pod.metadata.namespace.as_deref().unwrap_or("default"),
        pod.metadata.name.as_deref().unwrap_or_default()
    )
}

fn vip_entries(cm: &ConfigMap) -> BTreeMap<String, String> {
    cm.data
        .iter()
        .flatten()
        .filter_map(|(key, vip)| {
            let service = service_from_data_key(key)?;
            vip.parse::<IpAddr>().ok()?;
            Some((service, vip.clone()))
        })
        .collect()
}

/// A node's locality from its topology labels.
fn locality(node: &Node) -> Locality {
    let labels = node.metadata.labels.iter().flatten();
    let topology = aether_common::pod_meta::locality_from_labels(labels.map(|(k, v)| (k.as_str(), v.as_str())));
    Locality {
        region: topology.region,
        zone: topology.zone,
        subzone: String::new(),
    }
}

/// The endpoints a managed pod serves (one per pod IP), without locality (that comes
/// from its node). `Ok(None)`: nothing to serve (no IP yet, finished, no mesh port).
/// `Err`: the pod's mesh configuration is wrong, naming the field.
fn pod_endpoints(pod: &Pod) -> Result<Option<PodView>, String> {
    let metadata = &pod.metadata;
    let labels = metadata.labels.as_ref();
    if !pod_meta::is_managed(labels.into_iter().flatten().map(|(k, v)| (k.as_str(), v.as_str()))) {
        return Ok(None);
    }
    let namespace = metadata.namespace.clone().unwrap_or_else(|| "default".into());
    let spec = pod.spec.as_ref().ok_or("spec: missing")?;
    let status = pod.status.as_ref();
    if matches!(status.and_then(|s| s.phase.as_deref()), Some("Succeeded" | "Failed")) {
        return Ok(None);
    }
    let service_account = spec.service_account_name.clone().unwrap_or_default();
    let service = pod_service(metadata, &namespace, &service_account)?;
    let ports = pod_ports(spec)?;
    let addresses = pod_addresses(status);
    if ports.is_empty() || addresses.is_empty() {
        return Ok(None);
    }
    let node = spec.node_name.clone().unwrap_or_default();
    let endpoints = PodEndpoints {
        service: service.clone(),
        ports,
        health: pod_endpoint::health(metadata.deletion_timestamp.is_some(), is_ready(status)),
        pod: PodRef {
            namespace,
            name: metadata.name.clone().unwrap_or_default(),
            uid: metadata.uid.clone().unwrap_or_default(),
            // The one the Pod runs as: Kubernetes assigns `default` when it names none.
            service_account: match service_account.as_str() {
                "" => pod_meta::DEFAULT_SERVICE_ACCOUNT.to_owned(),
                named => named.to_owned(),
            },
        },
        node: node.clone(),
        locality: None,
    };
    let mut valid = Vec::new();
    for (i, endpoint) in endpoints.at(&addresses).into_iter().enumerate() {
        // The catalog validates too; checking here names the pod field at fault.
        let checked = validate_endpoint(&format!("status.podIPs[{i}]"), Some(endpoint)).map_err(|e| e.to_string())?;
        valid.push(checked.endpoint);
    }
    Ok(Some(PodView {
        key: pod_key(pod),
        endpoints: valid,
        node,
        service,
    }))
}

/// The key of the service a pod serves: its service annotation, else its service
/// account's name; an error names whichever was used.
fn pod_service(metadata: &ObjectMeta, namespace: &str, service_account: &str) -> Result<String, String> {
    let annotation = metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(pod_meta::SERVICE_ANNOTATION))
        .map(String::as_str);
    let name = pod_meta::service_name(annotation, service_account);
    let key = ServiceKey::from_parts(
        annotation.map_or("spec.serviceAccountName", |_| pod_meta::SERVICE_ANNOTATION),
        namespace,
        name,
    )
    .map_err(|e| e.to_string())?;
    Ok(key.to_string())
}

/// The pod's ports the mesh serves; an error names a container port out of range.
fn pod_ports(spec: &PodSpec) -> Result<Vec<(u16, AppProtocol)>, String> {
    let mut raw = Vec::new();
    for (c, container) in spec.containers.iter().enumerate() {
        for (p, port) in container.ports.iter().flatten().enumerate() {
            let field = format!("spec.containers[{c}].ports[{p}]");
            let number =
                pod_endpoint::container_port(&field, i64::from(port.container_port)).map_err(|e| e.to_string())?;
            raw.push((
                number,
                port.name.clone().unwrap_or_default(),
                port.protocol.clone().unwrap_or_default(),
            ));
        }
    }
    Ok(pod_meta::mesh_ports(
        raw.iter().map(|(n, name, proto)| (*n, name.as_str(), proto.as_str())),
    ))
}

/// The pod's IPs: `status.podIPs`, else `status.podIP`.
fn pod_addresses(status: Option<&PodStatus>) -> Vec<String> {
    let mut addresses: Vec<String> = status
        .and_then(|s| s.pod_ips.as_ref())
        .into_iter()
        .flatten()
        .map(|ip| ip.ip.clone())
        .collect();
    if addresses.is_empty()
        && let Some(ip) = status.and_then(|s| s.pod_ip.clone())
    {
        addresses.push(ip);
    }
    addresses
}

/// The pod's `Ready` condition is `True`.
fn is_ready(status: Option<&PodStatus>) -> bool {
    status
        .and_then(|s| s.conditions.as_ref())
        .into_iter()
        .flatten()
        .any(|c| c.type_ == "Ready" && c.status == "True")
}

#[cfg(test)]
mod tests {
    use super::*;
    use aether_proto::registry::v1::{Health, Protocol};

    fn pod(json: serde_json::Value) -> Pod {
        serde_json::from_value(json).expect("a Pod")
    }

    fn base() -> serde_json::Value {
        serde_json::json!({
            "metadata": {"name": "web-1", "namespace": "shop", "uid": "u-1",
                "labels": {"aether.io/managed": "true"}},
            "spec": {"serviceAccountName": "web", "nodeName": "n1", "containers": [
                {"name": "app", "ports": [{"name": "http", "containerPort": 8080},
                                          {"containerPort": 53, "protocol": "UDP"},
                                          {"name": "grpc", "containerPort": 9090}]}]},
            "status": {"phase": "Running", "podIP": "10.0.0.7", "podIPs": [{"ip": "10.0.0.7"}, {"ip": "fd00::7"}],
                "conditions": [{"type": "Ready", "status": "True"}]}
        })
    }

    #[test]
    fn a_ready_pod_serves_one_endpoint_per_ip() {
        let view = pod_endpoints(&pod(base())).unwrap().unwrap();
        assert_eq!(view.service, "shop/web");
        assert_eq!(view.node, "n1");
        let addresses: Vec<_> = view.endpoints.iter().map(|e| e.address.as_str()).collect();
        assert_eq!(addresses, ["10.0.0.7", "fd00::7"]);
        let e = &view.endpoints[0];
        assert_eq!(e.health, Health::Healthy as i32);
        let ports: Vec<_> = e.ports.iter().map(|p| (p.port, p.protocol)).collect();
        assert_eq!(ports, [(8080, Protocol::Http as i32), (9090, Protocol::Grpc as i32)]);
        assert_eq!(e.pod.as_ref().unwrap().uid, "u-1");
    }

    #[test]
    fn health_follows_ready_and_deletion() {
        let mut json = base();
        json["status"]["conditions"][0]["status"] = "False".into();
        assert_eq!(
            pod_endpoints(&pod(json.clone())).unwrap().unwrap().endpoints[0].health,
            Health::Unhealthy as i32
        );
        json["metadata"]["deletionTimestamp"] = "2025-01-01T00:00:00Z".into();
        assert_eq!(
            pod_endpoints(&pod(json)).unwrap().unwrap().endpoints[0].health,
            Health::Draining as i32
        );
    }

    #[test]
    fn nothing_to_serve_and_bad_config() {
        let mut json = base();
        json["status"]["phase"] = "Succeeded".into();
        assert!(pod_endpoints(&pod(json)).unwrap().is_none());
        let mut json = base();
        json["status"] = serde_json::json!({"phase": "Pending"});
        assert!(pod_endpoints(&pod(json)).unwrap().is_none(), "no IP yet");
        let mut json = base();
        json["metadata"]["labels"]["aether.io/managed"] = "false".into();
        assert!(pod_endpoints(&pod(json)).unwrap().is_none());
        let mut json = base();
        json["metadata"]["annotations"] = serde_json::json!({"config.aether.io/service": "Bad_Name"});
        let error = pod_endpoints(&pod(json)).unwrap_err();
        assert!(
            error.starts_with("config.aether.io/service: \"shop/Bad_Name\""),
            "{error}"
        );
        let mut json = base();
        json["spec"]["containers"][0]["ports"][1]["containerPort"] = 70000.into();
        assert_eq!(
            pod_endpoints(&pod(json)).unwrap_err(),
            "spec.containers[0].ports[1].containerPort: 70000 is out of range (1..=65535)"
        );
    }

    #[test]
    fn vip_data_keys_round_trip() {
        assert_eq!(vip_data_key("shop/cart"), "shop.cart");
        assert_eq!(service_from_data_key("shop.cart").as_deref(), Some("shop/cart"));
        assert_eq!(service_from_data_key("nodot"), None);
        assert!(parse_configmap("aether-system/vips").is_ok());
        assert!(parse_configmap("vips").is_err());
    }

    #[test]
    fn updates_log_each_difference_once() {
        let mut derived = Derived::default();
        let service = Service {
            namespace: "ns".into(),
            name: "a".into(),
            vip: "240.240.0.1".into(),
            kubernetes: None,
            external: None,
        };
        let endpoint = Endpoint {
            service: "ns/a".into(),
            address: "10.0.0.1".into(),
            ..Default::default()
        };
        let services = BTreeMap::from([("ns/a".to_owned(), service.clone())]);
        let endpoints = BTreeMap::from([(("ns/a".to_owned(), "10.0.0.1".to_owned()), endpoint.clone())]);
        assert!(derived.update(services.clone(), endpoints.clone()));
        assert_eq!(derived.revision, 2);
        assert!(!derived.update(services, endpoints), "no change, no revision");
        assert!(derived.update(BTreeMap::new(), BTreeMap::new()));
        let kinds: Vec<_> = derived.log.iter().map(|c| c.kind.clone()).collect();
        assert_eq!(
            kinds,
            [
                FeedChangeKind::ServicePut(service),
                FeedChangeKind::EndpointPut(endpoint),
                FeedChangeKind::EndpointDeleted {
                    service: "ns/a".into(),
                    address: "10.0.0.1".into()
                },
                FeedChangeKind::ServiceDeleted { key: "ns/a".into() },
            ]
        );
    }
}
