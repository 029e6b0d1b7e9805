//! The node controller: local pods + the node's catalog slice + on-demand lookups →
//! the dependency set (the registrar watch filter) and the xDS snapshot.
//!
//! A change after a quiet spell is built at once; changes in a burst are coalesced:
//! the controller waits a few milliseconds for more (bounded), then rebuilds once.
//! The cache pushes only the resources whose bytes changed.

use parking_lot::Mutex;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use aether_proto::registry::v1::{Locality, Route};
use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::{Notify, watch};
use tokio_util::sync::CancellationToken;

use crate::catalog_watch::{Interest, WatchedCatalog};
use crate::identity::Identity;
use crate::pod::{LocalPod, PodInfo};
use crate::pod_store::{PodStore, PodStoreError};
use crate::xds;
use crate::xds::cache::{Cache, WaitError};
use crate::xds::resources::{self, Generator, Inputs};

mod inspect;
pub use inspect::NodeView;

/// Quiet time that ends a burst of changes.
pub const DEBOUNCE: Duration = Duration::from_millis(5);
/// Most time a burst may delay a rebuild.
pub const DEBOUNCE_MAX: Duration = Duration::from_millis(20);
/// How long a service looked up on demand stays in the dependency set.
pub const ON_DEMAND_TTL: Duration = Duration::from_secs(3600);

#[derive(Clone, Default)]
pub struct NodeMetrics {
    pub dependencies: Gauge,
    pub clusters: Gauge,
    pub pods: Gauge,
    /// Annotation entries skipped as malformed, across local pods.
    pub pod_config_errors: Gauge,
    pub rebuilds: prometheus_client::metrics::counter::Counter,
    /// Routes in the node's catalog skipped as invalid (Envoy must never see them).
    pub invalid_routes: Gauge,
    /// HTTP filters in the node's catalog skipped as invalid.
    pub invalid_http_filters: Gauge,
    /// MeshConfigs in the node's catalog skipped as invalid.
    pub invalid_mesh_configs: Gauge,
    /// Authorization policies refused, by policy and field (their last good version stays).
    pub refused_policies: prometheus_client::metrics::family::Family<Vec<(String, String)>, Gauge>,
}

impl NodeMetrics {
    /// Registers under the agent's `aether_agent` registry.
    pub fn register(&self, metrics: &mut prometheus_client::registry::Registry) {
        metrics.register(
            "dependencies",
            "Services in the node's dependency set",
            self.dependencies.clone(),
        );
        metrics.register("clusters", "Clusters served to the node's Envoy", self.clusters.clone());
        metrics.register("pods", "Mesh pods on this node", self.pods.clone());
        metrics.register(
            "pod_config_errors",
            "Malformed mesh annotation entries on this node's pods (skipped; see /debug/pods)",
            self.pod_config_errors.clone(),
        );
        metrics.register(
            "invalid_routes",
            "Routes in the node's catalog skipped as invalid, never sent to Envoy (see the agent's log)",
            self.invalid_routes.clone(),
        );
        metrics.register(
            "invalid_http_filters",
            "HTTP filters in the node's catalog skipped as invalid, never sent to Envoy (see the agent's log)",
            self.invalid_http_filters.clone(),
        );
        metrics.register(
            "invalid_mesh_configs",
            "MeshConfigs in the node's catalog skipped as invalid (their namespace falls back to the mesh-wide settings)",
            self.invalid_mesh_configs.clone(),
        );
        metrics.register(
            "refused_authorization_policies",
            "Authorization policies not enforced as written, by policy and field (invalid, or HTTP fields on a TCP port of a local pod; see the agent's log)",
            self.refused_policies.clone(),
        );
        metrics.register(
            "rebuilds",
            "xDS snapshots that changed something",
            self.rebuilds.clone(),
        );
    }
}

#[derive(Default)]
struct OnDemand {
    /// Service key → when it was last asked for.
    services: BTreeMap<String, Instant>,
    /// Cluster names asked for, with their service, until the lookup ends.
    pending: BTreeMap<String, String>,
    /// Every cluster name asked for, with its service (expires with the service).
    clusters: BTreeMap<String, String>,
}

/// What the node's pods need of the catalog.
#[derive(Debug, Default)]
pub struct Demand {
    /// The dependency set: what the node watches.
    pub services: BTreeSet<String>,
    /// Local pods' own services that no local pod declares, looked up or reaches by a
    /// route: known (their ports shape inbound chains, their VIPs route), but Envoy gets
    /// their clusters only when it asks for one on demand, as for any undeclared name.
    pub own_only: BTreeSet<String>,
}

/// The node's state. Local pods change through it alone (CNI calls, the pod source,
/// start-up recovery), so every change reaches the dependency set and the snapshot.
#[derive(Clone)]
pub struct Node {
    mesh_domain: Arc<str>,
    locality: Locality,
    pods: PodStore,
    cache: Cache,
    catalog: watch::Receiver<Arc<WatchedCatalog>>,
    dependencies: Arc<watch::Sender<Interest>>,
    on_demand: Arc<Mutex<OnDemand>>,
    generator: Arc<Mutex<Generator>>,
    wake: Arc<Notify>,
    /// The pod-store generation the last published snapshot was built from.
    built: Arc<watch::Sender<u64>>,
    metrics: NodeMetrics,
    /// Where local pods' SVIDs come from; `None`: plaintext between pods.
    identity: Option<Identity>,
}

/// Why Envoy is not serving a pod (yet).
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("the node has not rebuilt its config with {0}; retry")]
    NotRebuilt(String),
    #[error("the registrar has not answered for {0}'s upstreams; retry")]
    UpstreamsUnanswered(String),
    #[error(transparent)]
    Envoy(#[from] WaitError),
}

impl Node {
    pub fn new(
        mesh_domain: &str,
        locality: Locality,
        pods: PodStore,
        cache: Cache,
        catalog: watch::Receiver<Arc<WatchedCatalog>>,
        dependencies: watch::Sender<Interest>,
        metrics: NodeMetrics,
    ) -> Self {
        Self {
            mesh_domain: mesh_domain.into(),
            locality,
            pods,
            cache,
            catalog,
            dependencies: Arc::new(dependencies),
            on_demand: Arc::default(),
            generator: Arc::default(),
            wake: Arc::default(),
            built: Arc::new(watch::channel(0).0),
            metrics,
            identity: None,
        }
    }

    /// mTLS between pods, with SVIDs from `identity` (served as SDS secrets).
    pub fn with_identity(mut self, identity: Identity) -> Self {
        self.generator.lock().enable_mtls(&identity.current().trust_domain);
        self.identity = Some(identity);
        self
    }

    /// Kubernetes' cluster DNS domain (`--cluster-domain`): services with a Kubernetes
    /// Service also answer to `<svc>.<ns>.svc.<cluster domain>`.
    pub fn with_cluster_domain(self, cluster_domain: &str) -> Self {
        self.generator.lock().set_cluster_domain(cluster_domain);
        self
    }

    /// Where pods' Unix sockets are reached (`--uds-link-dir`).
    pub fn with_uds_link_dir(self, dir: &std::path::Path) -> Self {
        self.generator.lock().set_uds_link_dir(dir);
        self
    }

    /// The DNS servers external services' hosts are resolved with (`--external-dns`).
    pub fn with_external_dns(self, dns: crate::xds::resources::external::ExternalDns) -> Self {
        self.generator.lock().set_external_dns(dns);
        self
    }

    /// This node's name: its endpoints come first for services that PreferSameNode.
    pub fn with_node_name(self, node_name: &str) -> Self {
        self.generator.lock().set_node_name(node_name);
        self
    }

    /// The catalog as the registrar's stream last left it, and its changes.
    pub fn watched(&self) -> watch::Receiver<Arc<WatchedCatalog>> {
        self.catalog.clone()
    }

    /// The mesh's settings from the MeshConfigs the node holds.
    pub fn mesh_settings(&self) -> crate::mesh_settings::MeshSettings {
        crate::mesh_settings::MeshSettings::new(&self.catalog.borrow().catalog.mesh_configs)
    }

    /// The local pods.
    pub fn pods(&self) -> Vec<LocalPod> {
        self.pods.all()
    }

    /// The local pod in sandbox `container_id`.
    pub fn pod_in(&self, container_id: &str) -> Option<LocalPod> {
        self.pods.by_container(container_id)
    }

    /// Adds (or replaces) a local pod in memory; the node starts building its config at
    /// once. Returns the pod-store generation that holds it, for [`Node::saved`] and
    /// [`Node::wait_served`].
    pub fn add_pod(&self, pod: LocalPod) -> u64 {
        self.pods.stage(pod)
    }

    /// Returns once the pod store on disk holds `generation` (or a later one).
    pub async fn saved(&self, generation: u64) -> Result<(), PodStoreError> {
        self.pods.persist(generation).await
    }

    /// Forgets `pod` if it is still in the same sandbox (a newer sandbox stays); returns
    /// it if it was forgotten.
    pub async fn remove_pod(&self, pod: &LocalPod) -> Result<Option<LocalPod>, PodStoreError> {
        self.pods.remove_sandbox(&pod.id(), &pod.container_id).await
    }

    /// New metadata from the pod source for `pod`, onto the same sandbox only (a DEL or a
    /// new sandbox in the meantime wins); returns the updated pod if it was applied.
    pub async fn update_pod(&self, pod: &LocalPod, info: PodInfo) -> Result<Option<LocalPod>, PodStoreError> {
        self.pods.update_info(&pod.id(), &pod.container_id, info).await
    }

    /// The node's dependency set: local pods' upstreams and own services, what was
    /// looked up on demand recently, and the services the routes of those send to (one
    /// level: a backend's own routes add nothing, so the set cannot chase itself).
    pub fn dependencies(&self, pods: &[LocalPod]) -> BTreeSet<String> {
        self.demand(pods).services
    }

    /// [`Node::dependencies`], with the part of it no local pod calls.
    pub fn demand(&self, pods: &[LocalPod]) -> Demand {
        let mut called = BTreeSet::new();
        for pod in pods {
            called.extend(pod.info.upstreams().services);
        }
        {
            let mut on_demand = self.on_demand.lock();
            on_demand.services.retain(|_, at| at.elapsed() < ON_DEMAND_TTL);
            let OnDemand { services, clusters, .. } = &mut *on_demand;
            clusters.retain(|_, service| services.contains_key(service));
            called.extend(on_demand.services.keys().cloned());
        }
        let own: BTreeSet<String> = pods.iter().map(|pod| pod.info.service()).collect();
        let mut services: BTreeSet<String> = called.union(&own).cloned().collect();
        let namespaces: BTreeSet<&str> = pods.iter().map(|p| p.info.namespace.as_str()).collect();
        let watched = self.catalog.borrow().clone();
        let backends: BTreeSet<String> = watched
            .catalog
            .routes
            .values()
            .filter(|route| route_applies_here(route, &services, &namespaces))
            .flat_map(|route| aether_api::route::backend_services(route).map(str::to_owned))
            .collect();
        called.extend(backends.iter().cloned());
        services.extend(backends);
        let own_only = own.difference(&called).cloned().collect();
        Demand { services, own_only }
    }

    /// The xDS hook: Envoy asked for clusters the snapshot does not have. Mesh
    /// authorities are looked up (pending until the registrar answers); anything else
    /// is absent at once.
    pub fn on_demand(&self, type_url: &str, names: &[String]) {
        if type_url != xds::CLUSTER {
            return;
        }
        let mut marked = Vec::new();
        {
            let mut on_demand = self.on_demand.lock();
            for name in names {
                if let Some((service, _)) = resources::parse_authority(name, &self.mesh_domain) {
                    tracing::info!(cluster = %name, %service, "on-demand lookup");
                    on_demand.services.insert(service.clone(), Instant::now());
                    on_demand.pending.insert(name.clone(), service.clone());
                    on_demand.clusters.insert(name.clone(), service);
                    marked.push((type_url.to_owned(), name.clone()));
                }
            }
        }
        if !marked.is_empty() {
            self.cache.add_pending(marked);
            self.wake.notify_one();
        }
    }

    /// The pod-store generation of the last published snapshot, as it moves.
    pub fn built_generation(&self) -> watch::Receiver<u64> {
        self.built.subscribe()
    }

    /// Asks for a rebuild (pods or catalog changed outside the watched channels).
    pub fn poke(&self) {
        self.wake.notify_one();
    }

    /// Rebuilds on every change until `shutdown`.
    pub async fn run(self, shutdown: CancellationToken) {
        let mut pods_changed = self.pods.subscribe();
        let mut catalog = self.catalog.clone();
        // Without a provider this channel never changes.
        let (_never, idle) = watch::channel(Arc::default());
        let mut identities = self.identity.as_ref().map_or(idle, Identity::subscribe);
        loop {
            self.rebuild();
            let rebuilt = tokio::time::Instant::now();
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = pods_changed.changed() => {}
                _ = catalog.changed() => {}
                _ = identities.changed() => {}
                _ = self.wake.notified() => {}
            }
            // A change after a quiet spell is built at once: a lone pod's ADD waits for no timer.
            if rebuilt.elapsed() >= DEBOUNCE {
                continue;
            }
            // One that follows the last rebuild closely is part of a burst: coalesce it, waiting
            // for quiet, but never longer than DEBOUNCE_MAX.
            let deadline = tokio::time::Instant::now() + DEBOUNCE_MAX;
            loop {
                let quiet = tokio::time::Instant::now() + DEBOUNCE;
                tokio::select! {
                    _ = tokio::time::sleep_until(quiet.min(deadline)) => break,
                    _ = pods_changed.changed() => {}
                    _ = catalog.changed() => {}
                    _ = identities.changed() => {}
                    _ = self.wake.notified() => {}
                }
            }
        }
    }

    pub fn rebuild(&self) {
        // One span per rebuild: what --trace-sample-rate samples and OTLP exports.
        let _span = tracing::info_span!("xds_rebuild").entered();
        // Reading inputs, generating and publishing happen under one lock, so
        // concurrent rebuilds publish in the order they read their inputs.
        let mut generator = self.generator.lock();
        let (pods, generation) = self.pods.snapshot();
        if let Some(identity) = &self.identity {
            // New pods get an SVID (the built-in CA issues at once), gone ones lose it.
            identity.sync(&pods);
            generator.set_identities(identity.current());
        }
        let Demand {
            services: deps,
            own_only,
        } = self.demand(&pods);
        // Policies select destination pods of their own namespace: those of ours.
        let wanted = Interest::node(deps.clone(), pods.iter().map(|p| p.info.namespace.as_str()));
        self.dependencies.send_if_modified(|current| {
            let changed = *current != wanted;
            *current = wanted;
            changed
        });
        let watched = self.catalog.borrow().clone();
        // Serve only what is both wanted and known; a service leaving the set goes now.
        let catalog = watched.catalog.restricted(|k| deps.contains(k));
        // A lookup ends when the registrar has answered for a filter including it.
        let (pending, on_demand_clusters) = {
            let mut on_demand = self.on_demand.lock();
            on_demand.pending.retain(|_, service| !watched.filter.contains(service));
            let pending: BTreeSet<(String, String)> = on_demand
                .pending
                .keys()
                .map(|name| (xds::CLUSTER.to_owned(), name.clone()))
                .collect();
            (pending, on_demand.clusters.clone())
        };
        let resources = generator.generate(&Inputs {
            pods: &pods,
            catalog: &catalog,
            mesh_domain: &self.mesh_domain,
            locality: &self.locality,
            on_demand: &on_demand_clusters,
            own_only: &own_only,
        });
        self.metrics.dependencies.set(deps.len() as i64);
        self.metrics.invalid_routes.set(generator.invalid_routes() as i64);
        self.metrics
            .invalid_http_filters
            .set(generator.invalid_http_filters() as i64);
        self.metrics
            .invalid_mesh_configs
            .set(generator.invalid_mesh_configs() as i64);
        self.metrics.refused_policies.clear();
        for refused in generator.refused_policies() {
            let labels = vec![
                ("policy".into(), refused.policy().into()),
                ("field".into(), refused.field().into()),
            ];
            self.metrics.refused_policies.get_or_create(&labels).inc();
        }
        self.metrics.pods.set(pods.len() as i64);
        self.metrics
            .pod_config_errors
            .set(pods.iter().map(|p| p.info.config_errors().len()).sum::<usize>() as i64);
        self.metrics
            .clusters
            .set(resources.get(xds::CLUSTER).map_or(0, Vec::len) as i64);
        if self.cache.set_with_pending(resources, pending) {
            self.metrics.rebuilds.inc();
        }
        self.built.send_if_modified(|built| {
            let newer = generation > *built;
            *built = (*built).max(generation);
            newer
        });
    }
}

/// What Envoy holds of a pod: the CNI calls wait on these.
impl Node {
    /// Waits until Envoy can serve `pod`: a snapshot built from pod-store `generation`
    /// (or later) is out, so a previous sandbox's ACKed listeners of the same name do not
    /// count, and its listeners, its upstreams' clusters (with endpoints) and the virtual
    /// hosts routing to them are ACKed.
    pub async fn wait_served(&self, pod: &LocalPod, generation: u64, timeout: Duration) -> Result<(), ServeError> {
        let deadline = tokio::time::Instant::now() + timeout;
        let mut built = self.built_generation();
        if tokio::time::timeout_at(deadline, built.wait_for(|built| *built >= generation))
            .await
            .is_err()
        {
            return Err(ServeError::NotRebuilt(pod.id()));
        }
        let upstreams = pod.info.upstreams().services;
        let watched = self.upstreams_answered(pod, &upstreams, deadline).await?;
        // ...then until Envoy has ACKed the pod's listeners and those upstreams' clusters.
        let mut wanted = listener_names(pod);
        if self.identity.is_some() {
            wanted.extend(resources::pod_identity_names(pod));
        }
        let clusters: Vec<String> = (upstreams.iter())
            .flat_map(|upstream| resources::cluster_names(&watched.catalog, upstream, &self.mesh_domain))
            .collect();
        // ...and the routes to them (their virtual hosts in the pod's table).
        let snapshot = self.cache.snapshot();
        for name in &clusters {
            wanted.push((xds::CLUSTER, name.clone()));
            // An external service's clusters carry their endpoints (Envoy resolves them).
            if snapshot.version_of(xds::ENDPOINT, name).is_some() {
                wanted.push((xds::ENDPOINT, name.clone()));
            }
        }
        let vhosts = resources::pod_virtual_host_names(&snapshot, pod, &clusters);
        wanted.extend(vhosts.into_iter().map(|name| (xds::VIRTUAL_HOST, name)));
        let remaining = deadline.saturating_duration_since(tokio::time::Instant::now());
        Ok(self.cache.wait_acked(&wanted, remaining).await?)
    }

    /// The pod's upstreams must be usable when ADD returns: waits until the registrar
    /// has answered for a watch filter that includes them.
    async fn upstreams_answered(
        &self,
        pod: &LocalPod,
        upstreams: &BTreeSet<String>,
        deadline: tokio::time::Instant,
    ) -> Result<Arc<WatchedCatalog>, ServeError> {
        let mut catalog = self.catalog.clone();
        loop {
            let watched = catalog.borrow_and_update().clone();
            if upstreams.iter().all(|u| watched.filter.contains(u)) {
                return Ok(watched);
            }
            if tokio::time::timeout_at(deadline, catalog.changed()).await.is_err() {
                return Err(ServeError::UpstreamsUnanswered(pod.id()));
            }
        }
    }

    /// Waits until no Envoy holds the pod's listeners (at most `timeout`).
    pub async fn wait_unserved(&self, pod: &LocalPod, timeout: Duration) -> Result<(), WaitError> {
        self.cache.wait_removed(&listener_names(pod), timeout).await
    }

    /// Waits until Envoy holds the pod's listeners, ACKed (at most `timeout`).
    pub async fn wait_listeners(&self, pod: &LocalPod, timeout: Duration) -> Result<(), WaitError> {
        self.cache.wait_acked(&listener_names(pod), timeout).await
    }
}

/// Whether a route may shape a call from this node: it is attached to a dependency,
/// as a producer route, or as a consumer route of a namespace with pods here.
fn route_applies_here(route: &Route, deps: &BTreeSet<String>, namespaces: &BTreeSet<&str>) -> bool {
    route.parents.iter().any(|parent| {
        let producer = parent
            .service
            .split_once('/')
            .is_some_and(|(ns, _)| ns == route.namespace);
        deps.contains(&parent.service) && (producer || namespaces.contains(route.namespace.as_str()))
    })
}

fn listener_names(pod: &LocalPod) -> Vec<(&'static str, String)> {
    resources::pod_listener_names(pod)
        .into_iter()
        .map(|n| (xds::LISTENER, n))
        .collect()
}

/// The node's debug pages: `/debug/pods`, `/debug/dependencies`, `/debug/xds`.
impl Node {
    pub fn debug_page(&self, path: &str) -> Option<serde_json::Value> {
        match path {
            "/debug/pods" => Some(self.debug_pods()),
            "/debug/dependencies" => Some(self.debug_dependencies()),
            "/debug/xds" => Some(self.debug_xds()),
            _ => None,
        }
    }

    fn debug_pods(&self) -> serde_json::Value {
        let pods: Vec<_> = self
            .pods()
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

    fn debug_dependencies(&self) -> serde_json::Value {
        let pods = self.pods();
        let demand = self.demand(&pods);
        let watched = self.catalog.borrow().clone();
        serde_json::json!({
            "dependencies": demand.services,
            "own_only": demand.own_only,
            "watched": watched.filter,
            "known": watched.catalog.services.keys().collect::<Vec<_>>(),
        })
    }

    fn debug_xds(&self) -> serde_json::Value {
        let snapshot = self.cache.snapshot();
        // "acked": what the newest connected Envoy (the one serving) holds.
        let streams = self.cache.streams();
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pod::MANAGED_LABEL;

    fn node(state: &std::path::Path) -> (Node, watch::Sender<Arc<WatchedCatalog>>, Cache) {
        let cache = Cache::default();
        let (catalog_tx, catalog) = watch::channel(Arc::new(WatchedCatalog::default()));
        let (dependencies, _) = watch::channel(Interest::default());
        let pods = PodStore::open(state).unwrap();
        let node = Node::new(
            "aether.internal",
            Locality::default(),
            pods,
            cache.clone(),
            catalog,
            dependencies,
            NodeMetrics::default(),
        );
        (node, catalog_tx, cache)
    }

    fn route(namespace: &str, name: &str, parent: &str, backends: &[&str]) -> (String, Arc<Route>) {
        use aether_proto::registry::v1::{RouteBackend, RouteParent, RouteRule};
        let route = Route {
            namespace: namespace.into(),
            name: name.into(),
            parents: vec![RouteParent {
                service: parent.into(),
                port: 0,
            }],
            rules: vec![RouteRule {
                backends: backends
                    .iter()
                    .map(|b| RouteBackend {
                        service: (*b).into(),
                        weight: 1,
                        ..Default::default()
                    })
                    .collect(),
                ..Default::default()
            }],
            ..Default::default()
        };
        (aether_proto::view::route_key(&route), Arc::new(route))
    }

    #[tokio::test]
    async fn route_backends_join_the_dependency_set_one_level_deep() {
        use aether_proto::registry::v1::{Mirror, RouteBackend, RouteFilter, route_filter};
        let state = tempfile::tempdir().unwrap();
        let (node, catalog, _) = node(state.path());
        let mut info = PodInfo {
            namespace: "demo".into(),
            name: "p".into(),
            ..PodInfo::default()
        };
        info.annotations
            .insert(crate::upstreams::ANNOTATION.into(), "cart,shop/pay".into());
        node.add_pod(LocalPod {
            container_id: "c-p".into(),
            listener_sockets: Default::default(),
            netns: "/run/netns/p".into(),
            ips: vec!["10.0.0.1".parse().unwrap()],
            info: info.clone(),
        });
        let (key, split) = route("demo", "canary", "demo/cart", &["demo/cart", "demo/cart-v2"]);
        let mut split = (*split).clone();
        split.rules[0].filters.push(RouteFilter {
            filter: Some(route_filter::Filter::RequestMirror(Mirror {
                backend: Some(RouteBackend {
                    service: "demo/shadow".into(),
                    ..Default::default()
                }),
                percent: 10,
            })),
        });
        let routes = BTreeMap::from([
            (key, Arc::new(split)),
            // A backend's own route does not pull its backends in.
            route("demo", "v2-split", "demo/cart-v2", &["demo/cart-v3"]),
            // A consumer route of a namespace without pods here applies to no one here.
            route("batch", "pin", "demo/cart", &["demo/cart-batch"]),
            // One of a namespace with pods here does.
            route("demo", "pin", "shop/pay", &["shop/pay-v2"]),
            // A route on a service outside the dependency set adds nothing.
            route("shop", "other", "shop/other", &["shop/other-v2"]),
        ]);
        let mut watched = WatchedCatalog::default();
        watched.catalog.routes = routes;
        catalog.send_replace(Arc::new(watched));
        let deps = node.dependencies(&node.pods());
        let expected: BTreeSet<String> = [
            info.service().as_str(),
            "demo/cart",
            "demo/cart-v2",
            "demo/shadow",
            "shop/pay",
            "shop/pay-v2",
        ]
        .into_iter()
        .map(str::to_owned)
        .collect();
        assert_eq!(deps, expected);
        // p's own service is known, but no one here calls it: no cluster until asked.
        assert_eq!(node.demand(&node.pods()).own_only, BTreeSet::from([info.service()]));
        // A local caller makes it a called dependency like any other.
        let mut caller = PodInfo {
            namespace: "demo".into(),
            name: "q".into(),
            service_account: "q".into(),
            ..PodInfo::default()
        };
        (caller.annotations).insert(crate::upstreams::ANNOTATION.into(), info.service());
        node.add_pod(LocalPod {
            container_id: "c-q".into(),
            listener_sockets: Default::default(),
            netns: "/run/netns/q".into(),
            ips: vec!["10.0.0.2".parse().unwrap()],
            info: caller.clone(),
        });
        let demand = node.demand(&node.pods());
        assert_eq!(demand.own_only, BTreeSet::from([caller.service()]));
        assert!(demand.services.contains(&info.service()) && demand.services.contains(&caller.service()));
    }

    #[tokio::test]
    async fn the_watch_asks_for_the_policies_of_the_local_pods_namespaces_as_pods_come_and_go() {
        let state = tempfile::tempdir().unwrap();
        let (node, _catalog, _) = node(state.path());
        let pod = |namespace: &str, name: &str, ip: &str| LocalPod {
            container_id: format!("c-{name}"),
            listener_sockets: Default::default(),
            netns: format!("/run/netns/{name}").into(),
            ips: vec![ip.parse().unwrap()],
            info: PodInfo {
                namespace: namespace.into(),
                name: name.into(),
                ..PodInfo::default()
            },
        };
        let namespaces = |node: &Node| match &*node.dependencies.borrow() {
            Interest::Services { policy_namespaces, .. } => policy_namespaces.iter().cloned().collect::<Vec<_>>(),
            Interest::ServicesOnly => panic!("the node never watches services only"),
        };
        node.add_pod(pod("demo", "a", "10.0.0.1"));
        node.add_pod(pod("demo", "b", "10.0.0.2"));
        let shop = pod("shop", "c", "10.0.0.3");
        node.add_pod(shop.clone());
        node.rebuild();
        assert_eq!(namespaces(&node), ["demo", "shop"]);
        node.remove_pod(&shop).await.unwrap();
        node.rebuild();
        assert_eq!(namespaces(&node), ["demo"], "the last pod of shop left");
    }

    /// A catalog with `demo/cart`, one endpoint serving HTTP on port 80.
    fn cart_on_port_80() -> aether_proto::view::CatalogView {
        use aether_proto::registry::v1::{Endpoint, Port, Protocol, Service};
        let mut catalog = aether_proto::view::CatalogView::default();
        let service = Service {
            namespace: "demo".into(),
            name: "cart".into(),
            vip: "240.240.0.1".into(),
            kubernetes: None,
            external: None,
        };
        let endpoint = Endpoint {
            service: "demo/cart".into(),
            address: "10.1.0.1".into(),
            ports: vec![Port {
                name: String::new(),
                port: 80,
                protocol: Protocol::Http as i32,
            }],
            weight: 1,
            ..Default::default()
        };
        catalog.services.insert("demo/cart".into(), service);
        let endpoints = std::collections::BTreeMap::from([("10.1.0.1".to_owned(), endpoint)]);
        catalog.endpoints.insert("demo/cart".into(), Arc::new(endpoints));
        catalog
    }

    #[tokio::test(start_paused = true)]
    async fn a_pod_is_served_once_built_with_its_upstreams_answered_and_acked() {
        let state = tempfile::tempdir().unwrap();
        let (node, catalog, cache) = node(state.path());
        let mut info = PodInfo {
            namespace: "demo".into(),
            name: "p".into(),
            ..PodInfo::default()
        };
        info.labels.insert(MANAGED_LABEL.into(), "true".into());
        info.annotations
            .insert(crate::upstreams::ANNOTATION.into(), "cart".into());
        let pod = LocalPod {
            container_id: "c-p".into(),
            listener_sockets: Default::default(),
            netns: "/run/netns/p".into(),
            ips: vec!["10.0.0.1".parse().unwrap()],
            info,
        };
        let generation = node.add_pod(pod.clone());
        let wait = || node.wait_served(&pod, generation, Duration::from_secs(1));
        let error = wait().await.unwrap_err().to_string();
        assert_eq!(error, "the node has not rebuilt its config with demo/p; retry");
        node.rebuild();
        let error = wait().await.unwrap_err().to_string();
        assert_eq!(error, "the registrar has not answered for demo/p's upstreams; retry");
        catalog.send_replace(Arc::new(WatchedCatalog {
            filter: node.dependencies(&node.pods()),
            catalog: cart_on_port_80(),
            ..WatchedCatalog::default()
        }));
        node.rebuild();
        assert!(matches!(
            wait().await,
            Err(ServeError::Envoy(WaitError::NotAcked { .. }))
        ));
        let envoy = cache.open_stream();
        let ack_all = |of_type: &dyn Fn(&str) -> bool| {
            for (type_url, resources) in cache.snapshot().types.iter().filter(|(t, _)| of_type(t)) {
                let acked: Vec<_> = resources
                    .values()
                    .map(|r| (r.name.clone(), Some(r.version.clone())))
                    .collect();
                envoy.record_ack(type_url, &acked);
            }
        };
        // Listeners and clusters are not enough: the route to the upstream must be there too.
        ack_all(&|type_url| type_url != xds::VIRTUAL_HOST);
        let error = wait().await.unwrap_err().to_string();
        assert_eq!(
            error,
            "Envoy has not acknowledged outbound/cart.demo.aether.internal:80"
        );
        ack_all(&|type_url| type_url == xds::VIRTUAL_HOST);
        wait().await.unwrap();
        node.wait_listeners(&pod, Duration::from_millis(1)).await.unwrap();

        // Gone from the node, the pod's listeners are held until Envoy lets go of them.
        assert_eq!(node.remove_pod(&pod).await.unwrap(), Some(pod.clone()));
        node.rebuild();
        let held = node.wait_unserved(&pod, Duration::from_millis(10)).await.unwrap_err();
        assert!(matches!(held, WaitError::StillHeld { .. }), "{held}");
        for (type_url, name) in listener_names(&pod) {
            envoy.record_ack(type_url, &[(name, None)]);
        }
        node.wait_unserved(&pod, Duration::from_millis(10)).await.unwrap();
    }
}
