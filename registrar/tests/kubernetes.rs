//! The Kubernetes store against a fake API server speaking real list and watch JSON
//! over plain HTTP (no kube-apiserver can be installed here). Unlike the agent's
//! scripted fake, this one is a small stateful cluster: pods, nodes and configmaps
//! with resourceVersions, label/field selectors, watches that replay history from a
//! resourceVersion then stream live events, and optimistic concurrency on PUT (409 on
//! a stale resourceVersion) so replicas racing on the VIP ConfigMap meet real conflicts.

mod support;

use parking_lot::Mutex;
use std::collections::{BTreeMap, HashMap};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use aether_proto::registrar::v1::RegisterEndpointRequest;
use aether_proto::registry::v1::Health;
use aether_registrar::store::kubernetes::{DEFAULT_VIP_CONFIGMAP, KubeConfig, KubeStore, vip_data_key};
use aether_registrar::store::{FeedEvent, Store};
use aether_registrar::vip::VipAllocator;
use bytes::Bytes;
use futures::StreamExt;
use http_body_util::{BodyExt, Full, StreamBody, combinators::BoxBody};
use hyper::body::{Frame, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use support::{TIMEOUT, Watcher, endpoint, free_port, http_get, wildcard};
use tokio::sync::broadcast;

// ---------------------------------------------------------------- the fake cluster

type Body = BoxBody<Bytes, std::io::Error>;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Kind {
    Pod,
    Node,
    ConfigMap,
}

impl Kind {
    fn list_kind(self) -> &'static str {
        match self {
            Kind::Pod => "PodList",
            Kind::Node => "NodeList",
            Kind::ConfigMap => "ConfigMapList",
        }
    }
    fn kind(self) -> &'static str {
        match self {
            Kind::Pod => "Pod",
            Kind::Node => "Node",
            Kind::ConfigMap => "ConfigMap",
        }
    }
}

/// One change, as a watch reports it.
#[derive(Clone, Debug)]
struct Change {
    rv: u64,
    kind: Kind,
    kind_of_event: &'static str,
    object: Value,
}

#[derive(Default)]
struct State {
    rv: u64,
    /// (kind, namespace, name) → object.
    objects: BTreeMap<(Kind, String, String), Value>,
    history: Vec<Change>,
    /// Every request line, to check what the store asked for.
    requests: Vec<String>,
}

#[derive(Clone)]
struct FakeCluster {
    state: Arc<Mutex<State>>,
    events: broadcast::Sender<Change>,
    addr: SocketAddr,
}

impl FakeCluster {
    async fn start() -> FakeCluster {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let (events, _) = broadcast::channel(4096);
        let cluster = FakeCluster {
            state: Arc::default(),
            events,
            addr: listener.local_addr().unwrap(),
        };
        let serving = cluster.clone();
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                let cluster = serving.clone();
                let service = hyper::service::service_fn(move |req: Request<Incoming>| {
                    let cluster = cluster.clone();
                    async move { Ok::<_, Infallible>(cluster.answer(req).await) }
                });
                tokio::spawn(async move {
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        cluster
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn client(&self) -> kube::Client {
        kube::Client::try_from(kube::Config::new(self.url().parse().unwrap())).unwrap()
    }

    /// A kubeconfig file pointing at this server, for the registrar binary.
    fn kubeconfig(&self, dir: &std::path::Path) -> std::path::PathBuf {
        let path = dir.join("kubeconfig");
        let config = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: {}\n\
             users:\n- name: fake\n  user: {{}}\ncontexts:\n- name: fake\n  context:\n    cluster: fake\n    user: fake\n\
             current-context: fake\n",
            self.url()
        );
        std::fs::write(&path, config).unwrap();
        path
    }

    /// Creates or replaces an object, as a controller or the kubelet would.
    fn apply(&self, kind: Kind, mut object: Value) -> u64 {
        let mut state = self.state.lock();
        state.rv += 1;
        let rv = state.rv;
        object["apiVersion"] = json!("v1");
        object["kind"] = json!(kind.kind());
        object["metadata"]["resourceVersion"] = json!(rv.to_string());
        let id = (
            kind,
            object["metadata"]["namespace"].as_str().unwrap_or_default().to_owned(),
            object["metadata"]["name"].as_str().unwrap().to_owned(),
        );
        let kind_of_event = if state.objects.contains_key(&id) {
            "MODIFIED"
        } else {
            "ADDED"
        };
        state.objects.insert(id, object.clone());
        let change = Change {
            rv,
            kind,
            kind_of_event,
            object,
        };
        state.history.push(change.clone());
        let _ = self.events.send(change);
        rv
    }

    fn delete(&self, kind: Kind, namespace: &str, name: &str) {
        let mut state = self.state.lock();
        let Some(mut object) = state.objects.remove(&(kind, namespace.to_owned(), name.to_owned())) else {
            panic!("deleting {namespace}/{name}: not there");
        };
        state.rv += 1;
        object["metadata"]["resourceVersion"] = json!(state.rv.to_string());
        let change = Change {
            rv: state.rv,
            kind,
            kind_of_event: "DELETED",
            object,
        };
        state.history.push(change.clone());
        let _ = self.events.send(change);
    }

    fn get(&self, kind: Kind, namespace: &str, name: &str) -> Option<Value> {
        let state = self.state.lock();
        state
            .objects
            .get(&(kind, namespace.to_owned(), name.to_owned()))
            .cloned()
    }

    fn requests(&self) -> Vec<String> {
        self.state.lock().requests.clone()
    }

    async fn answer(&self, req: Request<Incoming>) -> Response<Body> {
        let method = req.method().clone();
        let path = req.uri().path().to_owned();
        let query = parse_query(req.uri().query().unwrap_or_default());
        self.state.lock().requests.push(format!("{method} {}", req.uri()));
        let body = req
            .into_body()
            .collect()
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        let segments: Vec<&str> = path.trim_start_matches('/').split('/').collect();
        match (method, segments.as_slice()) {
            (Method::GET, ["version"]) => json_response(
                StatusCode::OK,
                json!({"major": "1", "minor": "33", "gitVersion": "v1.33.0-fake", "gitCommit": "",
                       "gitTreeState": "clean", "buildDate": "2025-01-01T00:00:00Z", "goVersion": "go1.24",
                       "compiler": "gc", "platform": "linux/amd64"}),
            ),
            (Method::GET, ["api", "v1", "pods"]) => self.list_or_watch(Kind::Pod, None, &query),
            (Method::GET, ["api", "v1", "nodes"]) => self.list_or_watch(Kind::Node, None, &query),
            (Method::GET, ["api", "v1", "namespaces", ns, "configmaps"]) => {
                self.list_or_watch(Kind::ConfigMap, Some(ns), &query)
            }
            (Method::GET, ["api", "v1", "namespaces", ns, "configmaps", name]) => {
                match self.get(Kind::ConfigMap, ns, name) {
                    Some(cm) => json_response(StatusCode::OK, cm),
                    None => status(
                        StatusCode::NOT_FOUND,
                        "NotFound",
                        &format!("configmaps \"{name}\" not found"),
                    ),
                }
            }
            (Method::POST, ["api", "v1", "namespaces", ns, "configmaps"]) => {
                let mut cm: Value = serde_json::from_slice(&body).unwrap();
                let name = cm["metadata"]["name"].as_str().unwrap().to_owned();
                if self.get(Kind::ConfigMap, ns, &name).is_some() {
                    return status(
                        StatusCode::CONFLICT,
                        "AlreadyExists",
                        &format!("configmaps \"{name}\" already exists"),
                    );
                }
                cm["metadata"]["namespace"] = json!(ns);
                self.apply(Kind::ConfigMap, cm);
                json_response(StatusCode::CREATED, self.get(Kind::ConfigMap, ns, &name).unwrap())
            }
            (Method::PUT, ["api", "v1", "namespaces", ns, "configmaps", name]) => {
                let mut cm: Value = serde_json::from_slice(&body).unwrap();
                let Some(current) = self.get(Kind::ConfigMap, ns, name) else {
                    return status(
                        StatusCode::NOT_FOUND,
                        "NotFound",
                        &format!("configmaps \"{name}\" not found"),
                    );
                };
                if cm["metadata"]["resourceVersion"] != current["metadata"]["resourceVersion"] {
                    return status(
                        StatusCode::CONFLICT,
                        "Conflict",
                        &format!(
                            "Operation cannot be fulfilled on configmaps \"{name}\": the object has been modified; \
                             please apply your changes to the latest version and try again"
                        ),
                    );
                }
                cm["metadata"]["namespace"] = json!(ns);
                self.apply(Kind::ConfigMap, cm);
                json_response(StatusCode::OK, self.get(Kind::ConfigMap, ns, name).unwrap())
            }
            (method, _) => status(
                StatusCode::NOT_FOUND,
                "NotFound",
                &format!("no route for {method} {path}"),
            ),
        }
    }

    fn list_or_watch(&self, kind: Kind, namespace: Option<&str>, query: &HashMap<String, String>) -> Response<Body> {
        let labels = query.get("labelSelector").cloned();
        let fields = query.get("fieldSelector").cloned();
        let selects = move |change_kind: Kind, object: &Value| {
            change_kind == kind
                && namespace.is_none_or(|ns| object["metadata"]["namespace"] == ns)
                && labels.as_deref().is_none_or(|sel| matches_labels(object, sel))
                && fields.as_deref().is_none_or(|sel| matches_fields(object, sel))
        };
        if query.get("watch").map(String::as_str) != Some("true") {
            let state = self.state.lock();
            let items: Vec<Value> = state
                .objects
                .iter()
                .filter(|((k, _, _), object)| selects(*k, object))
                .map(|(_, object)| {
                    let mut item = object.clone();
                    let map = item.as_object_mut().unwrap();
                    map.remove("apiVersion");
                    map.remove("kind");
                    item
                })
                .collect();
            return json_response(
                StatusCode::OK,
                json!({"apiVersion": "v1", "kind": kind.list_kind(),
                       "metadata": {"resourceVersion": state.rv.to_string()}, "items": items}),
            );
        }
        let from: u64 = query.get("resourceVersion").and_then(|v| v.parse().ok()).unwrap_or(0);
        let namespace = namespace.map(str::to_owned);
        let labels = query.get("labelSelector").cloned();
        let fields = query.get("fieldSelector").cloned();
        let selects = move |change: &Change| {
            change.kind == kind
                && namespace
                    .as_deref()
                    .is_none_or(|ns| change.object["metadata"]["namespace"] == ns)
                && labels.as_deref().is_none_or(|sel| matches_labels(&change.object, sel))
                && fields.as_deref().is_none_or(|sel| matches_fields(&change.object, sel))
        };
        // History after `from`, then live changes (subscribed under the same lock: none lost).
        let (backlog, live) = {
            let state = self.state.lock();
            let backlog: Vec<Change> = state.history.iter().filter(|c| c.rv > from).cloned().collect();
            (backlog, self.events.subscribe())
        };
        let selects = Arc::new(selects);
        let backlog_selects = selects.clone();
        let backlog = futures::stream::iter(backlog.into_iter().filter(move |c| backlog_selects(c)));
        let live = futures::stream::unfold(live, |mut live| async move {
            loop {
                match live.recv().await {
                    Ok(change) => return Some((change, live)),
                    Err(broadcast::error::RecvError::Lagged(_)) => continue,
                    Err(broadcast::error::RecvError::Closed) => return None,
                }
            }
        })
        .filter(move |c| futures::future::ready(selects(c)));
        let frames = backlog.chain(live).map(|change| {
            let line = format!("{}\n", json!({"type": change.kind_of_event, "object": change.object}));
            Ok::<_, std::io::Error>(Frame::data(Bytes::from(line)))
        });
        Response::builder()
            .header("content-type", "application/json")
            .body(BodyExt::boxed(StreamBody::new(frames)))
            .unwrap()
    }
}

fn matches_labels(object: &Value, selector: &str) -> bool {
    selector.split(',').filter(|s| !s.is_empty()).all(|term| {
        let (k, v) = term.split_once('=').unwrap_or((term, ""));
        object["metadata"]["labels"][k].as_str() == Some(v)
    })
}

fn matches_fields(object: &Value, selector: &str) -> bool {
    selector.split(',').filter(|s| !s.is_empty()).all(|term| {
        let (k, v) = term.split_once('=').unwrap_or((term, ""));
        match k {
            "metadata.name" => object["metadata"]["name"].as_str() == Some(v),
            "metadata.namespace" => object["metadata"]["namespace"].as_str() == Some(v),
            other => panic!("the fake API server does not know field selector {other}"),
        }
    })
}

fn parse_query(query: &str) -> HashMap<String, String> {
    query
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|pair| {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            (percent_decode(k), percent_decode(v))
        })
        .collect()
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' if i + 2 < bytes.len() => {
                out.push(u8::from_str_radix(std::str::from_utf8(&bytes[i + 1..i + 3]).unwrap(), 16).unwrap());
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8(out).unwrap()
}

fn json_response(code: StatusCode, body: Value) -> Response<Body> {
    Response::builder()
        .status(code)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())).map_err(|e| match e {}).boxed())
        .unwrap()
}

fn status(code: StatusCode, reason: &str, message: &str) -> Response<Body> {
    json_response(
        code,
        json!({"apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Failure",
               "message": message, "reason": reason, "code": code.as_u16()}),
    )
}

// ---------------------------------------------------------------- objects

fn node(name: &str, region: &str, zone: &str) -> Value {
    json!({"metadata": {"name": name, "labels": {
        "topology.kubernetes.io/region": region, "topology.kubernetes.io/zone": zone}}})
}

fn pod(name: &str, sa: &str, node: &str, ip: &str, ready: bool) -> Value {
    json!({
        "metadata": {"name": name, "namespace": "shop", "uid": format!("uid-{name}"),
            "labels": {"aether.io/managed": "true", "app": sa}},
        "spec": {"serviceAccountName": sa, "nodeName": node, "containers": [
            {"name": "app", "image": "app:1", "ports": [{"name": "http", "containerPort": 8080}]}]},
        "status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}],
            "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}]},
    })
}

fn vip_configmap(cluster: &FakeCluster) -> BTreeMap<String, String> {
    let (ns, name) = DEFAULT_VIP_CONFIGMAP.split_once('/').unwrap();
    cluster
        .get(Kind::ConfigMap, ns, name)
        .and_then(|cm| serde_json::from_value(cm["data"].clone()).ok())
        .unwrap_or_default()
}

fn store(cluster: &FakeCluster) -> KubeStore {
    KubeStore::start(
        cluster.client(),
        KubeConfig {
            vip_configmap: DEFAULT_VIP_CONFIGMAP.into(),
            vips: VipAllocator::new("240.240.0.0/16".parse().unwrap()).unwrap(),
        },
    )
    .unwrap()
}

// ---------------------------------------------------------------- tests

/// The registrar binary on `--store kubernetes`: managed pods appear with their node's
/// locality; Ready flips health; deletionTimestamp drains; deletion removes; agents'
/// Register is acknowledged, ignored and logged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_catalog_follows_managed_pods_and_their_nodes() {
    let cluster = FakeCluster::start().await;
    cluster.apply(Kind::Node, node("n1", "eu-west-1", "eu-west-1a"));
    cluster.apply(Kind::Node, node("n2", "eu-west-1", "eu-west-1b"));
    cluster.apply(Kind::Pod, pod("web-1", "web", "n1", "10.0.1.1", true));
    let mut unmanaged = pod("batch-1", "batch", "n1", "10.0.1.9", true);
    unmanaged["metadata"]["labels"]["aether.io/managed"] = json!("false");
    cluster.apply(Kind::Pod, unmanaged);

    let dir = tempfile::tempdir().unwrap();
    let registrar = KubeRegistrar::start(&cluster, dir.path()).await;
    let mut client = registrar.client().await;
    let mut watcher = Watcher::open(&mut client, wildcard()).await;
    watcher.until(0).await;
    wait_view(&mut watcher, "web-1 served", |v| {
        endpoint_of(v, "shop/web", "10.0.1.1").is_some()
    })
    .await;
    let web1 = endpoint_of(&watcher.view.catalog, "shop/web", "10.0.1.1").unwrap();
    assert_eq!(web1.health, Health::Healthy as i32);
    let locality = web1.locality.clone().unwrap();
    assert_eq!(
        (locality.region.as_str(), locality.zone.as_str()),
        ("eu-west-1", "eu-west-1a")
    );
    assert_eq!(web1.node, "n1");
    assert_eq!(web1.pod.as_ref().unwrap().name, "web-1");
    assert!(
        !watcher.view.catalog.services.contains_key("shop/batch"),
        "an unmanaged pod is not in the mesh"
    );
    let vip = watcher.view.catalog.services["shop/web"].vip.clone();
    assert_eq!(
        vip_configmap(&cluster)[&vip_data_key("shop/web")],
        vip,
        "the VIP is stored in the ConfigMap"
    );
    assert!(
        cluster
            .requests()
            .iter()
            .any(|r| r.starts_with("GET /api/v1/pods?") && r.contains("labelSelector=aether.io%2Fmanaged%3Dtrue")),
        "pods are listed by the managed label: {:?}",
        cluster.requests()
    );

    // A second pod on another node, not ready yet; then ready.
    cluster.apply(Kind::Pod, pod("web-2", "web", "n2", "10.0.2.1", false));
    wait_view(&mut watcher, "web-2 unhealthy in zone b", |v| {
        endpoint_of(v, "shop/web", "10.0.2.1")
            .is_some_and(|e| e.health == Health::Unhealthy as i32 && e.locality.as_ref().unwrap().zone == "eu-west-1b")
    })
    .await;
    cluster.apply(Kind::Pod, pod("web-2", "web", "n2", "10.0.2.1", true));
    wait_view(&mut watcher, "web-2 healthy", |v| {
        endpoint_of(v, "shop/web", "10.0.2.1").is_some_and(|e| e.health == Health::Healthy as i32)
    })
    .await;

    // The node moves zone: its pods' locality follows.
    cluster.apply(Kind::Node, node("n2", "eu-west-1", "eu-west-1c"));
    wait_view(&mut watcher, "web-2 in zone c", |v| {
        endpoint_of(v, "shop/web", "10.0.2.1").is_some_and(|e| e.locality.as_ref().unwrap().zone == "eu-west-1c")
    })
    .await;

    // Terminating drains; deleted leaves.
    let mut terminating = pod("web-1", "web", "n1", "10.0.1.1", true);
    terminating["metadata"]["deletionTimestamp"] = json!("2025-06-01T12:00:00Z");
    cluster.apply(Kind::Pod, terminating);
    wait_view(&mut watcher, "web-1 draining", |v| {
        endpoint_of(v, "shop/web", "10.0.1.1").is_some_and(|e| e.health == Health::Draining as i32)
    })
    .await;
    cluster.delete(Kind::Pod, "shop", "web-1");
    wait_view(&mut watcher, "web-1 gone", |v| {
        endpoint_of(v, "shop/web", "10.0.1.1").is_none()
    })
    .await;
    assert!(endpoint_of(&watcher.view.catalog, "shop/web", "10.0.2.1").is_some());

    // An agent registering is answered OK and ignored, with a log line saying why.
    client
        .register_endpoint(RegisterEndpointRequest {
            endpoint: Some(endpoint("shop/agent-made", "10.0.3.1", 8080)),
        })
        .await
        .expect("Register is accepted");
    tokio::time::sleep(Duration::from_millis(500)).await;
    while watcher.try_next().is_some() {}
    assert!(
        !watcher.view.catalog.services.contains_key("shop/agent-made"),
        "Register must be ignored"
    );
    let logs = registrar.logs();
    assert!(
        logs.lines()
            .any(|l| l.contains("ignoring Register") && l.contains("10.0.3.1")),
        "no log line for the ignored Register:\n{logs}"
    );

    // The last pod goes: the service leaves the catalog, its VIP stays stored for its return.
    cluster.delete(Kind::Pod, "shop", "web-2");
    wait_view(&mut watcher, "shop/web gone", |v| !v.services.contains_key("shop/web")).await;
    cluster.apply(Kind::Pod, pod("web-3", "web", "n1", "10.0.1.3", true));
    wait_view(&mut watcher, "shop/web back", |v| v.services.contains_key("shop/web")).await;
    assert_eq!(
        watcher.view.catalog.services["shop/web"].vip, vip,
        "a returning service keeps its VIP"
    );
}

/// Two replicas derive the same catalog; the VIP ConfigMap is written once per service
/// even though both race to allocate (the loser gets 409 and re-reads).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_racing_for_vips_agree_through_the_configmap() {
    let cluster = FakeCluster::start().await;
    cluster.apply(Kind::Node, node("n1", "r", "z"));
    let a = store(&cluster);
    let b = store(&cluster);
    let (ca, cb) = tokio::join!(a.load(), b.load());
    assert!(ca.unwrap().services.is_empty() && cb.unwrap().services.is_empty());
    let mut feed_a = a.feed(0);
    let mut feed_b = b.feed(0);
    for i in 0..20 {
        cluster.apply(
            Kind::Pod,
            pod(
                &format!("p{i}"),
                &format!("svc-{i}"),
                "n1",
                &format!("10.9.0.{i}"),
                true,
            ),
        );
    }
    let deadline = Instant::now() + TIMEOUT;
    loop {
        let (la, lb) = (a.load().await.unwrap(), b.load().await.unwrap());
        if la.services.len() == 20 && lb.services.len() == 20 && la.endpoints.len() == 20 && lb.endpoints.len() == 20 {
            let vips = |c: &aether_registrar::store::Contents| {
                c.services
                    .iter()
                    .map(|s| (format!("{}/{}", s.value.namespace, s.value.name), s.value.vip.clone()))
                    .collect::<BTreeMap<_, _>>()
            };
            assert_eq!(vips(&la), vips(&lb), "the replicas disagree on VIPs");
            let stored: BTreeMap<String, String> = vip_configmap(&cluster);
            for (service, vip) in vips(&la) {
                assert_eq!(stored[&vip_data_key(&service)], vip);
            }
            let distinct: std::collections::BTreeSet<_> = stored.values().collect();
            assert_eq!(distinct.len(), 20, "a VIP was handed out twice");
            break;
        }
        assert!(Instant::now() < deadline, "the replicas did not converge");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Both feeds delivered the services and endpoints as changes, each with a higher revision.
    for feed in [&mut feed_a, &mut feed_b] {
        let mut seen = 0;
        let mut last = 0;
        while seen < 40 {
            match tokio::time::timeout(TIMEOUT, feed.next()).await.unwrap().unwrap() {
                FeedEvent::Changes { revision, changes } => {
                    for change in &changes {
                        assert!(change.revision > last, "revisions must increase");
                        last = change.revision;
                    }
                    assert!(revision >= last);
                    seen += changes.len();
                }
                other => panic!("expected changes, got {other:?}"),
            }
        }
    }
    assert!(
        cluster
            .requests()
            .iter()
            .any(|r| r.starts_with("PUT ") || r.starts_with("POST ")),
        "the ConfigMap was written"
    );
}

// ---------------------------------------------------------------- helpers

fn endpoint_of<'a>(
    view: &'a aether_proto::view::Catalog,
    service: &str,
    address: &str,
) -> Option<&'a aether_proto::registry::v1::Endpoint> {
    view.endpoints.get(service).and_then(|e| e.get(address))
}

async fn wait_view(watcher: &mut Watcher, what: &str, f: impl Fn(&aether_proto::view::Catalog) -> bool) {
    let deadline = Instant::now() + TIMEOUT;
    while !f(&watcher.view.catalog) {
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        let _ = tokio::time::timeout(Duration::from_millis(200), watcher.next()).await;
    }
}

/// The registrar binary on `--store kubernetes`, with KUBECONFIG pointing at the fake.
struct KubeRegistrar {
    child: std::process::Child,
    grpc: SocketAddr,
    log: std::path::PathBuf,
}

impl KubeRegistrar {
    async fn start(cluster: &FakeCluster, dir: &std::path::Path) -> KubeRegistrar {
        let grpc: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
        let admin: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
        let log = dir.join("registrar.log");
        let child = Command::new(env!("CARGO_BIN_EXE_aether-registrar"))
            .args([
                "--insecure",
                "--store",
                "kubernetes",
                "--listen",
                &grpc.to_string(),
                "--admin",
                &admin.to_string(),
            ])
            .arg("--data-dir")
            .arg(dir.join("data"))
            .env("KUBECONFIG", cluster.kubeconfig(dir))
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("spawning aether-registrar");
        let mut registrar = KubeRegistrar { child, grpc, log };
        let deadline = Instant::now() + TIMEOUT;
        loop {
            if let Ok((200, _)) = http_get(admin, "/ready").await {
                return registrar;
            }
            if let Some(status) = registrar.child.try_wait().unwrap() {
                panic!("aether-registrar exited with {status}:\n{}", registrar.logs());
            }
            assert!(
                Instant::now() < deadline,
                "aether-registrar not ready in time:\n{}",
                registrar.logs()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn logs(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    async fn client(
        &self,
    ) -> aether_proto::registrar::v1::registrar_client::RegistrarClient<tonic::transport::Channel> {
        aether_proto::registrar::v1::registrar_client::RegistrarClient::connect(format!("http://{}", self.grpc))
            .await
            .expect("connecting to the registrar")
    }
}

impl Drop for KubeRegistrar {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
