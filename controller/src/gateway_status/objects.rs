//! The objects the edge's status is computed from, each kind watched in all namespaces
//! while this replica leads: GatewayClasses, Gateways, HTTPRoutes, GRPCRoutes, TCPRoutes,
//! TLSRoutes, ReferenceGrants, Namespaces (their labels, for `allowedRoutes` selectors)
//! and Services (which backends exist; each Gateway's own Service, for its addresses).
//! Secrets are not watched (see [`super::secrets`]).
//!
//! The set is usable once every kind is listed or known absent: a kind whose CRD is not
//! installed (404) holds nothing, is said once, and is looked for again every
//! `absent_retry`; any other failure keeps the objects last seen and is retried with
//! backoff (said once until it changes or clears).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Debug;

use std::sync::Arc;
use std::time::Duration;

use aether_api::gateway::{Gateway, GatewayClass, GrpcRoute, HttpRoute, ReferenceGrant, TcpRoute, TlsRoute};
use aether_api::route::RouteObject;
use aether_common::kube_watch::{self, Change, Follow};
use k8s_openapi::api::core::v1::{Namespace, Service};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::runtime::watcher;
use kube::{Api, Client, Resource};
use parking_lot::Mutex;
use serde::de::DeserializeOwned;
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// The first and the longest pause after a watch failure other than a missing CRD.
const BACKOFF: (Duration, Duration) = (Duration::from_millis(500), Duration::from_secs(30));
/// The kinds watched: the set is known once each is listed or absent.
const KINDS: usize = 9;

/// Every object the status is computed from.
#[derive(Clone, Debug, Default)]
pub struct Objects {
    /// By name.
    pub classes: BTreeMap<String, GatewayClass>,
    /// By `<namespace>/<name>`.
    pub gateways: BTreeMap<String, Gateway>,
    /// By route key ([`RouteObject::key`]).
    pub routes: BTreeMap<String, RouteObject>,
    /// By `<namespace>/<name>`.
    pub grants: BTreeMap<String, ReferenceGrant>,
    /// Namespace name → its labels.
    pub namespace_labels: BTreeMap<String, BTreeMap<String, String>>,
    /// By `<namespace>/<name>` (the backend key the projector asks about).
    pub services: BTreeMap<String, Service>,
}

/// `<namespace>/<name>`, or the name of a cluster-scoped object.
pub fn key(meta: &ObjectMeta) -> String {
    let name = meta.name.as_deref().unwrap_or_default();
    match meta.namespace.as_deref() {
        Some(namespace) => format!("{namespace}/{name}"),
        None => name.to_owned(),
    }
}

/// A kind watched, and where its objects live in [`Objects`].
pub trait Watched: Resource<DynamicType = ()> + Clone + Debug + DeserializeOwned + Send + Sync + 'static {
    /// Puts the object in its place (replacing the one of the same key).
    fn store(self, objects: &mut Objects);
    /// Takes it out.
    fn forget(&self, objects: &mut Objects);
    /// Takes every object of the kind out.
    fn clear(objects: &mut Objects);
    /// What is kept of an object: by default all but its managed fields.
    fn trim(mut self) -> Self {
        self.meta_mut().managed_fields = None;
        self
    }
}

impl Watched for GatewayClass {
    fn store(self, objects: &mut Objects) {
        objects.classes.insert(key(&self.metadata), self);
    }
    fn forget(&self, objects: &mut Objects) {
        objects.classes.remove(&key(&self.metadata));
    }
    fn clear(objects: &mut Objects) {
        objects.classes.clear();
    }
}

impl Watched for Gateway {
    fn store(self, objects: &mut Objects) {
        objects.gateways.insert(key(&self.metadata), self);
    }
    fn forget(&self, objects: &mut Objects) {
        objects.gateways.remove(&key(&self.metadata));
    }
    fn clear(objects: &mut Objects) {
        objects.gateways.clear();
    }
}

impl Watched for ReferenceGrant {
    fn store(self, objects: &mut Objects) {
        objects.grants.insert(key(&self.metadata), self);
    }
    fn forget(&self, objects: &mut Objects) {
        objects.grants.remove(&key(&self.metadata));
    }
    fn clear(objects: &mut Objects) {
        objects.grants.clear();
    }
}

impl Watched for Namespace {
    fn store(self, objects: &mut Objects) {
        let labels = self.metadata.labels.unwrap_or_default();
        objects
            .namespace_labels
            .insert(self.metadata.name.unwrap_or_default(), labels);
    }
    fn forget(&self, objects: &mut Objects) {
        objects
            .namespace_labels
            .remove(self.metadata.name.as_deref().unwrap_or_default());
    }
    fn clear(objects: &mut Objects) {
        objects.namespace_labels.clear();
    }
}

impl Watched for Service {
    fn store(self, objects: &mut Objects) {
        objects.services.insert(key(&self.metadata), self);
    }
    fn forget(&self, objects: &mut Objects) {
        objects.services.remove(&key(&self.metadata));
    }
    fn clear(objects: &mut Objects) {
        objects.services.clear();
    }
    /// Its name, namespace and labels, clusterIP and load-balancer status.
    fn trim(self) -> Self {
        let spec = self.spec.map(|spec| k8s_openapi::api::core::v1::ServiceSpec {
            cluster_ip: spec.cluster_ip,
            ..Default::default()
        });
        Service {
            metadata: ObjectMeta {
                name: self.metadata.name,
                namespace: self.metadata.namespace,
                labels: self.metadata.labels,
                ..ObjectMeta::default()
            },
            spec,
            status: self.status,
        }
    }
}

/// The route kinds: each a [`RouteObject`] variant in [`Objects::routes`].
macro_rules! route_kind {
    ($type:ty, $variant:ident) => {
        impl Watched for $type {
            fn store(self, objects: &mut Objects) {
                let object = RouteObject::$variant(self);
                objects.routes.insert(object.key(), object);
            }
            fn forget(&self, objects: &mut Objects) {
                objects.routes.remove(&RouteObject::$variant(self.clone()).key());
            }
            fn clear(objects: &mut Objects) {
                objects
                    .routes
                    .retain(|_, r| !matches!(r, RouteObject::$variant(_)));
            }
        }
    };
}

route_kind!(HttpRoute, Http);
route_kind!(GrpcRoute, Grpc);
route_kind!(TcpRoute, Tcp);
route_kind!(TlsRoute, Tls);

#[derive(Default)]
struct State {
    objects: Objects,
    /// The kinds listed, or known absent.
    settled: BTreeSet<String>,
}

/// The watches of every kind, stopped when dropped.
pub struct Watches {
    state: Arc<Mutex<State>>,
    changes: watch::Receiver<u64>,
    tasks: Vec<JoinHandle<()>>,
}

impl Watches {
    /// Starts watching every kind through `client`.
    pub fn start(client: &Client, absent_retry: Duration) -> Watches {
        let state = Arc::new(Mutex::new(State::default()));
        let (changed, changes) = watch::channel(0u64);
        let shared = Shared {
            state: state.clone(),
            changed,
            absent_retry,
        };
        let c = client;
        let tasks = vec![
            tokio::spawn(follow(Api::<GatewayClass>::all(c.clone()), shared.clone())),
            tokio::spawn(follow(Api::<Gateway>::all(c.clone()), shared.clone())),
            tokio::spawn(follow(Api::<HttpRoute>::all(c.clone()), shared.clone())),
            tokio::spawn(follow(Api::<GrpcRoute>::all(c.clone()), shared.clone())),
            tokio::spawn(follow(Api::<TcpRoute>::all(c.clone()), shared.clone())),
            tokio::spawn(follow(Api::<TlsRoute>::all(c.clone()), shared.clone())),
            tokio::spawn(follow(Api::<ReferenceGrant>::all(c.clone()), shared.clone())),
            tokio::spawn(follow(Api::<Namespace>::all(c.clone()), shared.clone())),
            tokio::spawn(follow(Api::<Service>::all(c.clone()), shared)),
        ];
        debug_assert_eq!(tasks.len(), KINDS);
        Watches { state, changes, tasks }
    }

    /// `read` of the objects once every kind is known; `None` before.
    pub fn read<T>(&self, read: impl FnOnce(&Objects) -> T) -> Option<T> {
        let state = self.state.lock();
        (state.settled.len() == KINDS).then(|| read(&state.objects))
    }

    /// Until an object or a kind's state changes.
    pub async fn changed(&mut self) {
        if self.changes.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

impl Drop for Watches {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

#[derive(Clone)]
struct Shared {
    state: Arc<Mutex<State>>,
    changed: watch::Sender<u64>,
    absent_retry: Duration,
}

impl Shared {
    fn update(&self, change: impl FnOnce(&mut State)) {
        change(&mut self.state.lock());
        self.changed.send_modify(|version| *version += 1);
    }
}

/// Follows one kind's watch into the shared state (`aether_common::kube_watch`: a missing
/// CRD is taken as none, other failures retry with backoff).
async fn follow<K: Watched>(api: Api<K>, shared: Shared) {
    let kind = K::kind(&()).into_owned();
    let settings = Follow {
        what: format!("the {kind} kind (for Gateway API status)"),
        absent_retry: shared.absent_retry,
        backoff: BACKOFF,
        quiet_decoding: false,
    };
    let mut relist: Option<Vec<K>> = None;
    kube_watch::follow(api, watcher::Config::default(), settings, |change| {
        match change {
            Change::Relist => relist = Some(Vec::new()),
            Change::Applied(object) => match &mut relist {
                Some(listed) => listed.push(object.trim()),
                None => shared.update(|state| object.trim().store(&mut state.objects)),
            },
            Change::Listed => {
                let listed = relist.take().unwrap_or_default();
                shared.update(|state| {
                    K::clear(&mut state.objects);
                    for object in listed {
                        object.store(&mut state.objects);
                    }
                    state.settled.insert(kind.clone());
                });
            }
            Change::Deleted(object) => shared.update(|state| object.forget(&mut state.objects)),
            Change::Absent => {
                relist = None;
                shared.update(|state| {
                    K::clear(&mut state.objects);
                    state.settled.insert(kind.clone());
                });
            }
            // Not allowed to read the kind: no status is written until it is.
            Change::Forbidden => relist = None,
        }
        std::future::ready(true)
    })
    .await;
}
