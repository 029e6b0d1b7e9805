//! The node controller: local pods + the node's catalog slice + on-demand lookups →
//! the dependency set (the registrar watch filter) and the xDS snapshot.
//!
//! Changes are coalesced: after the first change the controller waits a few
//! milliseconds for more (bounded), then rebuilds once. The cache pushes only the
//! resources whose bytes changed.

use parking_lot::Mutex;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use aether_proto::registry::v1::Locality;
use aether_proto::view::Catalog;
use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::{Notify, watch};
use tokio_util::sync::CancellationToken;

use crate::catalog_watch::{Interest, WatchedCatalog};
use crate::identity::Identity;
use crate::pod::LocalPod;
use crate::pod_store::PodStore;
use crate::xds;
use crate::xds::cache::Cache;
use crate::xds::resources::{self, Generator, Inputs};

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

#[derive(Clone)]
pub struct Node {
    pub mesh_domain: Arc<str>,
    pub locality: Locality,
    pub pods: PodStore,
    pub cache: Cache,
    pub catalog: watch::Receiver<Arc<WatchedCatalog>>,
    dependencies: Arc<watch::Sender<Interest>>,
    on_demand: Arc<Mutex<OnDemand>>,
    generator: Arc<Mutex<Generator>>,
    wake: Arc<Notify>,
    /// The pod-store generation the last published snapshot was built from.
    built: Arc<watch::Sender<u64>>,
    pub metrics: NodeMetrics,
    /// Where local pods' SVIDs come from; `None`: plaintext between pods.
    pub identity: Option<Identity>,
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
        self.generator = Arc::new(Mutex::new(Generator::with_mtls(&identity.current().trust_domain)));
        self.identity = Some(identity);
        self
    }

    /// The node's dependency set: local pods' upstreams and own services, and what
    /// was looked up on demand recently.
    pub fn dependencies(&self, pods: &[LocalPod]) -> BTreeSet<String> {
        let mut deps = BTreeSet::new();
        for pod in pods {
            deps.insert(pod.info.service());
            deps.extend(pod.info.upstreams().services);
        }
        let mut on_demand = self.on_demand.lock();
        on_demand.services.retain(|_, at| at.elapsed() < ON_DEMAND_TTL);
        let OnDemand { services, clusters, .. } = &mut *on_demand;
        clusters.retain(|_, service| services.contains_key(service));
        deps.extend(on_demand.services.keys().cloned());
        deps
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
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = pods_changed.changed() => {}
                _ = catalog.changed() => {}
                _ = identities.changed() => {}
                _ = self.wake.notified() => {}
            }
            // Coalesce a burst: wait for quiet, but never longer than DEBOUNCE_MAX.
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
        let deps = self.dependencies(&pods);
        let wanted = Interest::Services(deps.clone());
        self.dependencies.send_if_modified(|current| {
            let changed = *current != wanted;
            *current = wanted;
            changed
        });
        let watched = self.catalog.borrow().clone();
        // Serve only what is both wanted and known; a service leaving the set goes now.
        let catalog = Catalog {
            services: watched
                .catalog
                .services
                .iter()
                .filter(|(k, _)| deps.contains(*k))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
            endpoints: watched
                .catalog
                .endpoints
                .iter()
                .filter(|(k, _)| deps.contains(*k))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
        };
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
        });
        self.metrics.dependencies.set(deps.len() as i64);
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
