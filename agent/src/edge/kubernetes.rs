//! The Kubernetes source of the edge's [`Objects`] (`aether-agent edge --from-kubernetes`),
//! the same shape as the registrar's route watch (`registrar/src/routes/kubernetes`):
//! kube-runtime watches, their events applied to one collection, the whole [`Objects`]
//! published after each burst.
//!
//! What is watched (one watch each, through the edge's own service account):
//!
//! | objects | scope | why |
//! |---|---|---|
//! | GatewayClasses | cluster | the served Gateway's class (a handful of objects) |
//! | the served Gateway | its namespace, `fieldSelector=metadata.name=<name>` | only the one the edge serves |
//! | HTTPRoutes, GRPCRoutes (v1), TLSRoutes, TCPRoutes (v1alpha2) | all namespaces | routes attach from any namespace `allowedRoutes` lets in |
//! | ReferenceGrants (v1beta1) | all namespaces | cross-namespace backends and certificates |
//! | Namespaces | cluster | their labels only, for `allowedRoutes` selectors |
//! | Secrets | each `--certificate-namespaces` namespace (default: the Gateway's), `fieldSelector=type=kubernetes.io/tls` | listeners' certificates |
//!
//! **Secrets, least privilege.** The edge never lists or watches Secrets cluster-wide:
//! one namespaced watch per certificate namespace, selecting only `kubernetes.io/tls`
//! Secrets (so other Secrets' data never reaches the edge), and the published [`Objects`]
//! hold only those a `certificateRef` of the served Gateway names; their annotations
//! (`kubectl apply` copies the data into one) are dropped, and their data is never logged
//! (a Secret that does not decode is reported without the decoder's message). The chart
//! grants `get`/`list`/`watch` on `secrets` by a Role in each of those namespaces only. A
//! certificateRef to a namespace outside the list, or to a Secret of another type (the
//! directory source also takes an `Opaque` one), is simply absent here: the projector
//! reports the listener `ResolvedRefs: False` with `InvalidCertificateRef` ("Secret … does
//! not exist").
//!
//! **Publishing.** Events arriving within [`DEBOUNCE`] of the first of a burst are applied
//! together; then, once every watch has listed (or found its kind missing or forbidden),
//! the whole [`Objects`] is built and published if it differs from the last
//! (`send_if_modified`). Until then nothing is published (the edge serves nothing rather
//! than a Gateway without its routes). Objects are kept without their `status`,
//! `resourceVersion` and `managedFields`: the projector reads none of them, so a status
//! write (the status writer's own) publishes nothing.
//!
//! **Failures.** A kind whose CRD is not installed (404) holds no objects: logged once,
//! looked for again every [`ABSENT_RETRY`]; the other watches keep working and the edge's
//! readiness does not wait for it. A watch the edge may not read (403: RBAC) is logged once,
//! counts as listed with what it had (nothing at start), and is retried with backoff. Any
//! other failure keeps the last objects and is retried with backoff (to 30 s). Errors
//! quote input bounded ([`aether_common::quote`]).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use aether_api::edge::TLS_SECRET_TYPE;
use aether_api::gateway::{Gateway, GatewayClass, GrpcRoute, HttpRoute, ReferenceGrant, TcpRoute, TlsRoute};
use aether_api::route::RouteObject;
use aether_common::kube_watch::{Change, Follow, follow_into};
use aether_common::quote::quote;
use k8s_openapi::api::core::v1::{Namespace, Secret};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::runtime::watcher;
use kube::{Api, Client, Resource};
use serde::de::DeserializeOwned;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::objects::Objects;

/// Events arriving within this window of the first are published as one [`Objects`].
pub const DEBOUNCE: Duration = Duration::from_millis(100);
/// How often a kind whose CRD is missing is looked for again.
pub const ABSENT_RETRY: Duration = Duration::from_secs(30);
/// The first and the longest pause after any other watch failure.
const BACKOFF: (Duration, Duration) = (Duration::from_millis(500), Duration::from_secs(30));

/// What the edge reads from the cluster.
#[derive(Clone, Debug)]
pub struct Watches {
    /// The served Gateway: (namespace, name).
    pub gateway: (String, String),
    /// The namespaces whose TLS Secrets the edge reads; empty: the Gateway's own.
    pub certificate_namespaces: Vec<String>,
    /// How often a missing CRD is looked for ([`ABSENT_RETRY`]; shorter in tests).
    absent_retry: Duration,
}

impl Watches {
    pub fn new(gateway: (String, String), certificate_namespaces: Vec<String>) -> Watches {
        Watches {
            gateway,
            certificate_namespaces,
            absent_retry: ABSENT_RETRY,
        }
    }

    /// The namespaces whose Secrets are watched, sorted, each once.
    pub fn secret_namespaces(&self) -> BTreeSet<String> {
        match self.certificate_namespaces.is_empty() {
            true => BTreeSet::from([self.gateway.0.clone()]),
            false => self.certificate_namespaces.iter().cloned().collect(),
        }
    }
}

/// Publishes the cluster's Gateway API objects to `objects` whenever they change, until
/// `shutdown`.
pub async fn follow(
    client: Client,
    watches: Watches,
    objects: watch::Sender<Arc<Objects>>,
    shutdown: CancellationToken,
) {
    let (tx, mut inputs) = mpsc::channel(1024);
    let (gateway_namespace, gateway_name) = watches.gateway.clone();
    let all = watcher::Config::default;
    let mut started = Started {
        tasks: JoinSet::new(),
        sources: Vec::new(),
        absent_retry: watches.absent_retry,
        tx,
    };
    started.watch(Api::all(client.clone()), all(), Source::all("GatewayClass"), class);
    started.watch(
        Api::namespaced(client.clone(), &gateway_namespace),
        all().fields(&format!("metadata.name={gateway_name}")),
        Source::namespaced("Gateway", &gateway_namespace),
        gateway,
    );
    started.watch(Api::all(client.clone()), all(), Source::all("HTTPRoute"), http_route);
    started.watch(Api::all(client.clone()), all(), Source::all("GRPCRoute"), grpc_route);
    started.watch(Api::all(client.clone()), all(), Source::all("TLSRoute"), tls_route);
    started.watch(Api::all(client.clone()), all(), Source::all("TCPRoute"), tcp_route);
    started.watch(Api::all(client.clone()), all(), Source::all("ReferenceGrant"), grant);
    started.watch(
        Api::all(client.clone()),
        all(),
        Source::all("Namespace"),
        namespace_labels,
    );
    for namespace in watches.secret_namespaces() {
        started.watch(
            Api::namespaced(client.clone(), &namespace),
            all().fields(&format!("type={TLS_SECRET_TYPE}")),
            Source::namespaced("Secret", &namespace),
            tls_secret,
        );
    }
    // `_watches` is dropped on return: every watch stops with it.
    let Started {
        tasks: _watches,
        sources,
        tx,
        ..
    } = started;
    drop(tx);
    tracing::info!(gateway = %format!("{gateway_namespace}/{gateway_name}"),
        certificate_namespaces = ?watches.secret_namespaces(), "watching the cluster's Gateway API objects");

    let mut collected = Collected::new(watches.gateway.clone(), sources);
    loop {
        let first = tokio::select! {
            _ = shutdown.cancelled() => return,
            input = inputs.recv() => input,
        };
        let Some(first) = first else { return };
        let deadline = tokio::time::Instant::now() + DEBOUNCE;
        collected.apply(first);
        while let Ok(Some(input)) = tokio::time::timeout_at(deadline, inputs.recv()).await {
            collected.apply(input);
        }
        let Some(now) = collected.objects() else { continue };
        let published = objects.send_if_modified(|current| {
            let changed = **current != now;
            if changed {
                *current = Arc::new(now);
            }
            changed
        });
        if published {
            let current = objects.borrow().clone();
            tracing::debug!(
                classes = current.classes.len(),
                gateways = current.gateways.len(),
                routes = current.routes.len(),
                grants = current.grants.len(),
                secrets = current.secrets.len(),
                "the cluster's Gateway API objects changed"
            );
        }
    }
}

/// The watches started, feeding one channel.
struct Started {
    tasks: JoinSet<()>,
    sources: Vec<Source>,
    absent_retry: Duration,
    tx: mpsc::Sender<Input>,
}

impl Started {
    fn watch<K>(&mut self, api: Api<K>, config: watcher::Config, source: Source, keep: fn(K) -> Item)
    where
        K: Resource<DynamicType = ()> + Clone + DeserializeOwned + fmt::Debug + Send + 'static,
    {
        self.sources.push(source.clone());
        (self.tasks).spawn(run(api, config, source, self.absent_retry, self.tx.clone(), keep));
    }
}

/// One watch: a kind, cluster-wide (`namespace: None`) or in one namespace.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
struct Source {
    kind: &'static str,
    namespace: Option<String>,
}

impl Source {
    fn all(kind: &'static str) -> Source {
        Source { kind, namespace: None }
    }

    fn namespaced(kind: &'static str, namespace: &str) -> Source {
        Source {
            kind,
            namespace: Some(namespace.to_owned()),
        }
    }
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.namespace {
            None => write!(f, "{}s", self.kind),
            Some(namespace) => write!(f, "{}s of namespace {}", self.kind, quote(namespace)),
        }
    }
}

/// An object as kept: what the projector reads of it.
#[derive(Clone)]
enum Item {
    Class(GatewayClass),
    Gateway(Gateway),
    Route(RouteObject),
    Grant(ReferenceGrant),
    /// A Namespace's labels.
    Labels(BTreeMap<String, String>),
    Secret(Secret),
}

/// An object's (namespace, name); the namespace is empty for a cluster-scoped kind.
type Key = (String, String);

/// What a watch reports, in order.
enum Input {
    /// A (re)list starts: the objects until `Listed` replace the source's.
    Relist(Source),
    Applied(Source, Key, Box<Item>),
    Listed(Source),
    Deleted(Source, Key),
    /// The kind's CRD is not installed: no objects.
    Absent(Source),
    /// The edge may not read these (403): what it had stays, and the source counts as known.
    Unreadable(Source),
}

/// Forwards one watch as [`Input`]s (`aether_common::kube_watch`: a missing CRD is
/// `Absent`, a 403 `Unreadable`, other failures retry with backoff). A Secret that fails to
/// decode is logged without its content.
async fn run<K>(
    api: Api<K>,
    config: watcher::Config,
    source: Source,
    absent_retry: Duration,
    tx: mpsc::Sender<Input>,
    keep: fn(K) -> Item,
) where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + fmt::Debug + Send + 'static,
{
    let settings = Follow {
        what: format!("the {} kind (the edge's watch of {source})", source.kind),
        absent_retry,
        backoff: BACKOFF,
        quiet_decoding: source.kind == "Secret",
    };
    follow_into(api, config, settings, tx, |change| match change {
        Change::Relist => Input::Relist(source.clone()),
        Change::Applied(object) => Input::Applied(source.clone(), key(object.meta()), Box::new(keep(object))),
        Change::Listed => Input::Listed(source.clone()),
        Change::Deleted(object) => Input::Deleted(source.clone(), key(object.meta())),
        Change::Absent => Input::Absent(source.clone()),
        Change::Forbidden => Input::Unreadable(source.clone()),
    })
    .await;
}

fn key(meta: &ObjectMeta) -> Key {
    (
        meta.namespace.clone().unwrap_or_default(),
        meta.name.clone().unwrap_or_default(),
    )
}

/// Drops what the projector never reads and what moves on every write (so a status
/// write changes nothing the edge publishes).
fn trim(meta: &mut ObjectMeta) {
    meta.resource_version = None;
    meta.managed_fields = None;
}

fn class(mut object: GatewayClass) -> Item {
    trim(&mut object.metadata);
    object.status = None;
    Item::Class(object)
}

fn gateway(mut object: Gateway) -> Item {
    trim(&mut object.metadata);
    object.status = None;
    Item::Gateway(object)
}

fn http_route(mut object: HttpRoute) -> Item {
    trim(&mut object.metadata);
    object.status = None;
    Item::Route(RouteObject::Http(object))
}

fn grpc_route(mut object: GrpcRoute) -> Item {
    trim(&mut object.metadata);
    object.status = None;
    Item::Route(RouteObject::Grpc(object))
}

fn tls_route(mut object: TlsRoute) -> Item {
    trim(&mut object.metadata);
    object.status = None;
    Item::Route(RouteObject::Tls(object))
}

fn tcp_route(mut object: TcpRoute) -> Item {
    trim(&mut object.metadata);
    object.status = None;
    Item::Route(RouteObject::Tcp(object))
}

fn grant(mut object: ReferenceGrant) -> Item {
    trim(&mut object.metadata);
    Item::Grant(object)
}

fn namespace_labels(object: Namespace) -> Item {
    Item::Labels(object.metadata.labels.unwrap_or_default())
}

fn tls_secret(mut object: Secret) -> Item {
    trim(&mut object.metadata);
    // `kubectl apply` keeps the whole object, data included, in an annotation.
    object.metadata.annotations = None;
    Item::Secret(object)
}

/// The objects seen so far, per watch, and which watches are known (listed, missing or
/// forbidden).
struct Collected {
    /// The served Gateway: (namespace, name).
    gateway: Key,
    sources: BTreeSet<Source>,
    stores: BTreeMap<Source, BTreeMap<Key, Item>>,
    relists: HashMap<Source, BTreeMap<Key, Item>>,
    settled: BTreeSet<Source>,
}

impl Collected {
    fn new(gateway: Key, sources: impl IntoIterator<Item = Source>) -> Collected {
        Collected {
            gateway,
            sources: sources.into_iter().collect(),
            stores: BTreeMap::new(),
            relists: HashMap::new(),
            settled: BTreeSet::new(),
        }
    }

    fn apply(&mut self, input: Input) {
        match input {
            Input::Relist(source) => {
                self.relists.insert(source, BTreeMap::new());
            }
            Input::Applied(source, key, item) => match self.relists.get_mut(&source) {
                Some(relist) => {
                    relist.insert(key, *item);
                }
                None => {
                    self.stores.entry(source).or_default().insert(key, *item);
                }
            },
            Input::Listed(source) => {
                let listed = self.relists.remove(&source).unwrap_or_default();
                self.stores.insert(source.clone(), listed);
                self.settled.insert(source);
            }
            Input::Deleted(source, key) => {
                if let Some(relist) = self.relists.get_mut(&source) {
                    relist.remove(&key);
                }
                if let Some(store) = self.stores.get_mut(&source) {
                    store.remove(&key);
                }
            }
            Input::Absent(source) => {
                self.relists.remove(&source);
                self.stores.remove(&source);
                self.settled.insert(source);
            }
            Input::Unreadable(source) => {
                self.relists.remove(&source);
                self.settled.insert(source);
            }
        }
    }

    /// Every object the projection reads, once every watch is known.
    fn objects(&self) -> Option<Objects> {
        if !self.sources.is_subset(&self.settled) {
            return None;
        }
        let mut objects = Objects::default();
        let mut secrets = Vec::new();
        for ((namespace, name), item) in self.stores.values().flatten() {
            match item {
                Item::Class(class) => {
                    objects.classes.insert(name.clone(), class.clone());
                }
                Item::Gateway(gateway) => {
                    objects.gateways.insert(format!("{namespace}/{name}"), gateway.clone());
                }
                Item::Route(route) => objects.routes.push(route.clone()),
                Item::Grant(grant) => objects.grants.push(grant.clone()),
                Item::Labels(labels) => {
                    objects.namespace_labels.insert(name.clone(), labels.clone());
                }
                Item::Secret(secret) => secrets.push(((namespace.clone(), name.clone()), secret)),
            }
        }
        let (namespace, name) = &self.gateway;
        let referenced = certificate_refs(objects.gateways.get(&format!("{namespace}/{name}")));
        objects.secrets = (secrets.into_iter())
            .filter(|(key, _)| referenced.contains(key))
            .map(|(key, secret)| (key, secret.clone()))
            .collect();
        Some(objects)
    }
}

/// (namespace, name) of every Secret a listener of `gateway` names.
fn certificate_refs(gateway: Option<&Gateway>) -> BTreeSet<Key> {
    let Some(gateway) = gateway else {
        return BTreeSet::new();
    };
    let namespace = gateway.metadata.namespace.as_deref().unwrap_or_default();
    let references = (gateway.spec.listeners.iter())
        .filter_map(|listener| listener.tls.as_ref())
        .flat_map(|tls| tls.certificate_refs.iter());
    references
        .filter(|r| (r.group.is_empty() || r.group == "core") && r.kind == "Secret")
        .map(|r| (r.namespace.as_deref().unwrap_or(namespace).to_owned(), r.name.clone()))
        .collect()
}

#[cfg(test)]
mod tests {
    use aether_fakes::kube::ApiServer;
    use serde_json::{Value, json};

    use super::*;

    const WAIT: Duration = Duration::from_secs(10);

    fn class() -> Value {
        json!({"metadata": {"name": "aether"}, "spec": {"controllerName": aether_api::edge::CONTROLLER_NAME}})
    }

    /// The served Gateway `edge/edge`: HTTP from every namespace, and HTTPS listeners whose
    /// certificates are `edge/cert`, `other/far` and `edge/opaque`.
    fn served_gateway() -> Value {
        let https = |name: &str, port: u16, reference: Value| {
            json!({"name": name, "port": port, "protocol": "HTTPS", "hostname": format!("{name}.example.com"),
                   "tls": {"certificateRefs": [reference]}})
        };
        json!({"metadata": {"name": "edge", "namespace": "edge"},
        "spec": {"gatewayClassName": "aether", "listeners": [
            {"name": "http", "port": 80, "protocol": "HTTP", "allowedRoutes": {"namespaces": {"from": "All"}}},
            https("https", 443, json!({"name": "cert"})),
            https("far", 443, json!({"name": "far", "namespace": "other"})),
            https("opaque", 443, json!({"name": "opaque"})),
        ]}})
    }

    fn http_route(name: &str, host: &str) -> Value {
        json!({"metadata": {"name": name, "namespace": "shop"},
               "spec": {"parentRefs": [{"name": "edge", "namespace": "edge"}], "hostnames": [host],
                        "rules": [{"backendRefs": [{"name": "cart", "port": 80}]}]}})
    }

    fn tcp_like(name: &str) -> Value {
        json!({"metadata": {"name": name, "namespace": "shop"},
               "spec": {"parentRefs": [{"name": "edge", "namespace": "edge"}],
                        "rules": [{"backendRefs": [{"name": "db", "port": 5432}]}]}})
    }

    fn tls_secret(namespace: &str, name: &str, kind: &str) -> Value {
        json!({"metadata": {"name": name, "namespace": namespace,
                            "annotations": {"kubectl.kubernetes.io/last-applied-configuration": "SECRET-MATERIAL"}},
               "type": kind, "data": {"tls.crt": "Y2hhaW4=", "tls.key": "a2V5"}})
    }

    fn start(server: &ApiServer, watches: Watches) -> (watch::Receiver<Arc<Objects>>, CancellationToken) {
        let (tx, rx) = watch::channel(Arc::new(Objects::default()));
        let shutdown = CancellationToken::new();
        tokio::spawn(follow(server.client(), watches, tx, shutdown.clone()));
        (rx, shutdown)
    }

    fn served() -> Watches {
        Watches::new(("edge".into(), "edge".into()), Vec::new())
    }

    /// The published objects once `done` holds of them (panics after [`WAIT`]).
    async fn until(rx: &mut watch::Receiver<Arc<Objects>>, done: impl Fn(&Objects) -> bool) -> Arc<Objects> {
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            let current = rx.borrow_and_update().clone();
            if done(&current) {
                return current;
            }
            match tokio::time::timeout_at(deadline, rx.changed()).await {
                Ok(changed) => changed.expect("the source stopped"),
                Err(_) => panic!("not published within {WAIT:?}; last: {current:?}"),
            }
        }
    }

    fn route_keys(objects: &Objects) -> Vec<String> {
        objects.routes.iter().map(RouteObject::key).collect()
    }

    #[tokio::test]
    async fn the_cluster_objects_are_published_and_follow_updates_and_deletes() {
        let server = ApiServer::start();
        server.apply::<GatewayClass>(class());
        server.apply::<Gateway>(served_gateway());
        let mut other = served_gateway();
        other["metadata"]["name"] = json!("not-served");
        server.apply::<Gateway>(other);
        server.apply::<HttpRoute>(http_route("web", "web.example.com"));
        server.apply::<GrpcRoute>(http_route("rpc", "rpc.example.com"));
        server.apply::<TcpRoute>(tcp_like("db"));
        server.apply::<TlsRoute>(tcp_like("sni"));
        server.apply::<ReferenceGrant>(json!({"metadata": {"name": "certs", "namespace": "other"},
            "spec": {"from": [{"group": "gateway.networking.k8s.io", "kind": "Gateway", "namespace": "edge"}],
                     "to": [{"group": "", "kind": "Secret"}]}}));
        server.apply::<Namespace>(json!({"metadata": {"name": "shop", "labels": {"edge-access": "allowed"}}}));

        let (mut rx, shutdown) = start(&server, served());
        let objects = until(&mut rx, |o| o.routes.len() == 4).await;
        assert_eq!(objects.classes.keys().collect::<Vec<_>>(), ["aether"]);
        assert_eq!(
            objects.gateways.keys().collect::<Vec<_>>(),
            ["edge/edge"],
            "only the served Gateway"
        );
        assert_eq!(
            route_keys(&objects),
            ["grpc/shop/rpc", "http/shop/web", "tcp/shop/db", "tls/shop/sni"]
        );
        assert_eq!(objects.grants[0].metadata.name.as_deref(), Some("certs"));
        assert_eq!(objects.namespace_labels["shop"]["edge-access"], "allowed");
        assert!(objects.gateways["edge/edge"].metadata.resource_version.is_none());

        // An update is reflected.
        server.apply::<HttpRoute>(http_route("web", "shop.example.com"));
        let objects = until(&mut rx, |o| {
            (o.routes.iter()).any(|r| matches!(r, RouteObject::Http(h) if h.spec.hostnames == ["shop.example.com"]))
        })
        .await;
        assert_eq!(objects.routes.len(), 4);

        // A status write (the status writer's own) publishes nothing.
        let mut with_status = server.get::<HttpRoute>("shop", "web").unwrap();
        with_status["status"] = json!({"parents": [{"parentRef": {"name": "edge", "namespace": "edge"},
            "controllerName": aether_api::edge::CONTROLLER_NAME, "conditions": []}]});
        server.apply::<HttpRoute>(with_status);
        tokio::time::sleep(DEBOUNCE * 5).await;
        assert!(!rx.has_changed().unwrap(), "a status-only change was published");

        // A delete is reflected, a new Namespace label too.
        server.delete::<GrpcRoute>("shop", "rpc");
        server.apply::<Namespace>(json!({"metadata": {"name": "shop", "labels": {"edge-access": "denied"}}}));
        let objects = until(&mut rx, |o| {
            o.routes.len() == 3 && o.namespace_labels["shop"]["edge-access"] == "denied"
        })
        .await;
        assert_eq!(route_keys(&objects), ["http/shop/web", "tcp/shop/db", "tls/shop/sni"]);
        shutdown.cancel();
    }

    #[tokio::test]
    async fn secrets_are_read_only_in_the_certificate_namespaces_and_only_when_referenced() {
        let server = ApiServer::start();
        server.apply::<GatewayClass>(class());
        server.apply::<Gateway>(served_gateway());
        server.apply::<Secret>(tls_secret("edge", "cert", TLS_SECRET_TYPE));
        server.apply::<Secret>(tls_secret("edge", "unreferenced", TLS_SECRET_TYPE));
        server.apply::<Secret>(tls_secret("edge", "opaque", "Opaque"));
        server.apply::<Secret>(tls_secret("other", "far", TLS_SECRET_TYPE));
        server.apply::<ReferenceGrant>(json!({"metadata": {"name": "certs", "namespace": "other"},
            "spec": {"from": [{"group": "gateway.networking.k8s.io", "kind": "Gateway", "namespace": "edge"}],
                     "to": [{"group": "", "kind": "Secret"}]}}));

        let (mut rx, shutdown) = start(&server, served());
        let objects = until(&mut rx, |o| !o.secrets.is_empty()).await;
        assert_eq!(
            objects.secrets.keys().collect::<Vec<_>>(),
            [&("edge".to_owned(), "cert".to_owned())]
        );
        let secret = &objects.secrets[&("edge".to_owned(), "cert".to_owned())];
        assert_eq!(secret.data.as_ref().unwrap()["tls.key"].0, b"key");
        assert!(
            secret.metadata.annotations.is_none(),
            "kubectl's copy of the data is dropped"
        );

        // Secrets change in both namespaces: only the listed one is ever asked for.
        server.apply::<Secret>(tls_secret("edge", "cert", TLS_SECRET_TYPE));
        server.apply::<Secret>(tls_secret("other", "far", TLS_SECRET_TYPE));
        tokio::time::sleep(DEBOUNCE * 5).await;
        let requests = server.requests();
        let secrets: Vec<&String> = requests.iter().filter(|r| r.contains("secrets")).collect();
        assert!(!secrets.is_empty());
        for request in &secrets {
            assert!(
                request.starts_with("GET /api/v1/namespaces/edge/secrets?") && request.contains("fieldSelector=type"),
                "{request}"
            );
        }

        // The projector reports the certificate outside the namespaces as not there.
        let gateway = &objects.gateways["edge/edge"];
        let edge = aether_api::edge::project(
            &aether_api::edge::EdgeInputs {
                class: objects.classes.get("aether"),
                gateway,
                routes: &objects.routes,
                grants: &objects.grants,
                namespace_labels: &objects.namespace_labels,
                secrets: &objects.secrets,
                service_exists: &|_| true,
            },
            &k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(k8s_openapi::jiff::Timestamp::now()),
        );
        for listener in ["far", "opaque"] {
            let status = edge.status.listeners.iter().find(|l| l.name == listener).unwrap();
            let resolved = status.conditions.iter().find(|c| c.type_ == "ResolvedRefs").unwrap();
            assert_eq!(
                (resolved.status.as_str(), resolved.reason.as_str()),
                ("False", aether_api::edge::reason::INVALID_CERTIFICATE_REF),
                "{listener}: {}",
                resolved.message
            );
        }
        shutdown.cancel();

        // Named namespaces replace the default.
        let server = ApiServer::start();
        server.apply::<Gateway>(served_gateway());
        server.apply::<Secret>(tls_secret("edge", "cert", TLS_SECRET_TYPE));
        server.apply::<Secret>(tls_secret("other", "far", TLS_SECRET_TYPE));
        let watches = Watches::new(("edge".into(), "edge".into()), vec!["other".into()]);
        let (mut rx, shutdown) = start(&server, watches);
        let objects = until(&mut rx, |o| !o.secrets.is_empty()).await;
        assert_eq!(
            objects.secrets.keys().collect::<Vec<_>>(),
            [&("other".to_owned(), "far".to_owned())]
        );
        assert!(!server.requests().iter().any(|r| r.contains("/namespaces/edge/secrets")));
        shutdown.cancel();
    }

    #[tokio::test]
    async fn a_missing_crd_does_not_stop_the_others_and_is_picked_up_once_installed() {
        let server = ApiServer::start();
        server.uninstall::<TlsRoute>();
        server.uninstall::<ReferenceGrant>();
        server.apply::<GatewayClass>(class());
        server.apply::<Gateway>(served_gateway());
        server.apply::<HttpRoute>(http_route("web", "web.example.com"));
        server.apply::<TlsRoute>(tcp_like("sni"));

        let mut watches = served();
        watches.absent_retry = Duration::from_millis(300);
        let (mut rx, shutdown) = start(&server, watches);
        let objects = until(&mut rx, |o| !o.routes.is_empty()).await;
        assert_eq!(route_keys(&objects), ["http/shop/web"]);
        assert!(objects.gateways.contains_key("edge/edge"));

        // The others keep following the cluster meanwhile.
        server.apply::<TcpRoute>(tcp_like("db"));
        until(&mut rx, |o| o.routes.len() == 2).await;

        server.install::<TlsRoute>();
        let objects = until(&mut rx, |o| o.routes.len() == 3).await;
        assert_eq!(route_keys(&objects), ["http/shop/web", "tcp/shop/db", "tls/shop/sni"]);
        let deadline = tokio::time::Instant::now() + WAIT;
        let grant_lists = || {
            (server.requests().iter())
                .filter(|r| r.starts_with("GET /apis/gateway.networking.k8s.io/v1beta1/referencegrants?"))
                .count()
        };
        while grant_lists() < 2 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the missing ReferenceGrant CRD is not looked for again"
            );
            tokio::time::sleep(DEBOUNCE).await;
        }
        assert!(objects.grants.is_empty());

        // A CRD removed later empties its kind.
        server.uninstall::<TlsRoute>();
        server.delete::<TcpRoute>("shop", "db");
        let objects = until(&mut rx, |o| o.routes.len() == 2).await;
        assert_eq!(route_keys(&objects)[0], "http/shop/web");
        shutdown.cancel();
    }

    fn applied(source: &Source, name: &str) -> Input {
        let route = RouteObject::Http(serde_json::from_value(http_route(name, "a.example.com")).unwrap());
        Input::Applied(
            source.clone(),
            ("shop".into(), name.into()),
            Box::new(Item::Route(route)),
        )
    }

    #[test]
    fn nothing_is_published_until_every_watch_is_known_and_a_relist_replaces_its_source() {
        let (http, grpc, labels) = (
            Source::all("HTTPRoute"),
            Source::all("GRPCRoute"),
            Source::all("Namespace"),
        );
        let mut collected = Collected::new(
            ("edge".into(), "edge".into()),
            [http.clone(), grpc.clone(), labels.clone()],
        );
        collected.apply(Input::Relist(http.clone()));
        collected.apply(applied(&http, "a"));
        collected.apply(Input::Listed(http.clone()));
        collected.apply(Input::Absent(grpc.clone()));
        assert!(collected.objects().is_none(), "the Namespaces are not listed yet");
        collected.apply(Input::Unreadable(labels.clone()));
        assert_eq!(route_keys(&collected.objects().unwrap()), ["http/shop/a"]);

        // A relist keeps serving the old objects until done, then drops what is gone.
        collected.apply(Input::Relist(http.clone()));
        collected.apply(applied(&http, "b"));
        assert_eq!(route_keys(&collected.objects().unwrap()), ["http/shop/a"]);
        collected.apply(Input::Listed(http.clone()));
        assert_eq!(route_keys(&collected.objects().unwrap()), ["http/shop/b"]);
        collected.apply(Input::Deleted(http.clone(), ("shop".into(), "b".into())));
        assert!(collected.objects().unwrap().routes.is_empty());

        // A forbidden watch keeps what it had; a missing CRD holds nothing.
        collected.apply(applied(&http, "c"));
        collected.apply(Input::Unreadable(http.clone()));
        assert_eq!(route_keys(&collected.objects().unwrap()), ["http/shop/c"]);
        collected.apply(Input::Absent(http));
        assert!(collected.objects().unwrap().routes.is_empty());
    }

    /// The flags: exactly one source of objects; certificate namespaces with the cluster.
    #[test]
    fn the_objects_come_from_exactly_one_source() {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            edge: crate::edge::EdgeConfig,
        }
        let source = |args: &[&str]| {
            let args = ["edge", "--gateway", "edge/edge"].iter().chain(args);
            let cli = <Cli as clap::Parser>::try_parse_from(args).unwrap();
            let gateway = crate::edge::check_gateway(&cli.edge.gateway).unwrap();
            crate::edge::objects_source(&cli.edge, &gateway)
        };
        let error = |args: &[&str]| source(args).unwrap_err().to_string();
        assert!(matches!(
            source(&["--config-dir", "/etc/edge"]),
            Ok(crate::edge::ObjectsSource::Dir(_))
        ));
        match source(&["--from-kubernetes"]) {
            Ok(crate::edge::ObjectsSource::Kubernetes(watches)) => {
                assert_eq!(watches.secret_namespaces().into_iter().collect::<Vec<_>>(), ["edge"]);
            }
            other => panic!("{other:?}"),
        }
        match source(&["--from-kubernetes", "--certificate-namespaces", "certs,edge,certs"]) {
            Ok(crate::edge::ObjectsSource::Kubernetes(watches)) => {
                assert_eq!(
                    watches.secret_namespaces().into_iter().collect::<Vec<_>>(),
                    ["certs", "edge"]
                );
            }
            other => panic!("{other:?}"),
        }
        assert!(
            error(&[]).contains("exactly one of --config-dir and --from-kubernetes"),
            "{}",
            error(&[])
        );
        assert!(error(&["--config-dir", "/etc/edge", "--from-kubernetes"]).contains("(given: both)"));
        let bad = error(&["--from-kubernetes", "--certificate-namespaces", "Not_A_Namespace"]);
        assert!(bad.contains("--certificate-namespaces: \"Not_A_Namespace\""), "{bad}");
    }
}
