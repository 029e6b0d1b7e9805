//! A Kubernetes API server for tests, on loopback over plain HTTP, speaking the real JSON.
//!
//! By default it is a small cluster: objects of the kinds the project uses, each write a
//! new resourceVersion; lists and watches with label and field selectors, a watch
//! replaying what came after its resourceVersion then streaming live; get, create and
//! replace with the real refusals (404, 409 on a name taken or a stale resourceVersion);
//! JSON merge patches; the status subresource of the kinds that have one (writes to the
//! object keep its status, writes to `<object>/status` change only the status); the
//! server-maintained metadata (uid, creationTimestamp, a generation that moves with the
//! desired state); TokenReview of the tokens it minted. [`ApiServer::uninstall`] takes a
//! CRD's kind away (404 on every request, as when the CRD is not installed). The test changes the cluster with [`ApiServer::apply`]
//! and [`ApiServer::delete`] as a controller or the kubelet would.
//!
//! [`ApiServer::script`] hands every later request to the test instead, to check it and
//! answer it by hand: any `Status`, a watch fed event by event, cut or ended.
//!
//! Callers must present the server's bearer token ([`ApiServer::write_kubeconfig`] and
//! [`ApiServer::client`] do). The server runs on its own thread and runtime, so sync
//! tests can use it too; it stops when dropped.

mod cluster;
mod script;
mod select;
mod tokens;
mod wire;

use std::collections::HashSet;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode, Uri};
use hyper_util::rt::TokioIo;
use parking_lot::Mutex;
use serde_json::{Value, json};
use tokio::sync::{mpsc, oneshot};

use cluster::{Cluster, Kind, Refusal, Subresource};
pub use script::{Call, Calls, WatchFeed};
use select::{Selection, Unsupported};
pub use tokens::TokenInfo;
use tokens::Tokens;
use wire::{Body, Target};

/// The bearer token callers present (no `token-` in it: tests check minted tokens never reach a log).
pub const CALLER_TOKEN: &str = "the-callers-service-account-credential";
const TOKEN_REVIEWS: &str = "/apis/authentication.k8s.io/v1/tokenreviews";

pub struct ApiServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

#[derive(Default)]
struct Shared {
    cluster: Cluster,
    tokens: Tokens,
    /// `METHOD uri` of every request, in order.
    requests: Mutex<Vec<String>>,
    /// Set by [`ApiServer::script`]: requests go to the test.
    script: Mutex<Option<mpsc::UnboundedSender<Call>>>,
    forbidden: AtomicBool,
    /// Kinds whose CRD is not installed: every request about them is 404.
    absent: Mutex<HashSet<Kind>>,
}

impl ApiServer {
    pub fn start() -> ApiServer {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("binding loopback");
        listener.set_nonblocking(true).expect("a non-blocking listener");
        let addr = listener.local_addr().expect("a bound address");
        let shared = Arc::new(Shared::default());
        let (stop, stopped) = oneshot::channel();
        let serving = shared.clone();
        let thread = std::thread::Builder::new()
            .name("fake-kube-api".into())
            .spawn(move || {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("a runtime for the fake API server");
                runtime.block_on(async move {
                    let listener = tokio::net::TcpListener::from_std(listener).expect("a tokio listener");
                    tokio::select! {
                        _ = stopped => {}
                        _ = serve(listener, serving) => {}
                    }
                });
            })
            .expect("spawning the fake API server");
        ApiServer {
            addr,
            shared,
            stop: Some(stop),
            thread: Some(thread),
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// A client in this process, presenting the caller's token.
    pub fn client(&self) -> kube::Client {
        let mut config = kube::Config::new(self.url().parse().expect("the server's URL"));
        config.auth_info.token = Some(CALLER_TOKEN.to_owned().into());
        kube::Client::try_from(config).expect("a client of the fake API server")
    }

    /// Writes `dir/kubeconfig` for a process under test (`KUBECONFIG`) and returns its path.
    pub fn write_kubeconfig(&self, dir: &Path) -> PathBuf {
        let path = dir.join("kubeconfig");
        let config = format!(
            "apiVersion: v1\nkind: Config\ncurrent-context: fake\n\
             clusters: [{{name: fake, cluster: {{server: \"{}\"}}}}]\n\
             users: [{{name: fake, user: {{token: {CALLER_TOKEN}}}}}]\n\
             contexts: [{{name: fake, context: {{cluster: fake, user: fake}}}}]\n",
            self.url()
        );
        std::fs::write(&path, config).expect("writing the kubeconfig");
        path
    }

    /// Creates or replaces an object of kind `K` whole, status included, as whoever owns each
    /// part would (the server sets apiVersion, kind, resourceVersion and generation; uid and
    /// creationTimestamp unless given). Returns it as stored.
    pub fn apply<K: kube::Resource<DynamicType = ()>>(&self, object: Value) -> Value {
        self.shared.cluster.put(Kind::find::<K>(), object)
    }

    /// Deletes an object (`namespace` empty for a cluster-scoped kind); panics if there is none.
    pub fn delete<K: kube::Resource<DynamicType = ()>>(&self, namespace: &str, name: &str) {
        let kind = Kind::find::<K>();
        if let Err(refusal) = self.shared.cluster.remove(kind, namespace, name) {
            panic!("deleting {} {namespace}/{name}: {refusal:?}", kind.kind);
        }
    }

    pub fn get<K: kube::Resource<DynamicType = ()>>(&self, namespace: &str, name: &str) -> Option<Value> {
        self.shared.cluster.get(Kind::find::<K>(), namespace, name).ok()
    }

    /// From now on kind `K` is not served (404 on lists, watches and objects), as when its
    /// CRD is not installed; [`ApiServer::install`] brings it back with the objects it had.
    pub fn uninstall<K: kube::Resource<DynamicType = ()>>(&self) {
        self.shared.absent.lock().insert(Kind::find::<K>());
    }

    pub fn install<K: kube::Resource<DynamicType = ()>>(&self) {
        self.shared.absent.lock().remove(&Kind::find::<K>());
    }

    /// `METHOD uri` of every request so far, in order.
    pub fn requests(&self) -> Vec<String> {
        self.shared.requests.lock().clone()
    }

    /// From now on every request is refused `403`, as when the caller's RBAC is gone.
    pub fn forbid(&self) {
        self.shared.forbidden.store(true, Ordering::Relaxed);
    }

    /// From now on every request is handed to the test (see [`Calls`]) instead of the cluster.
    pub fn script(&self) -> Calls {
        let (calls, received) = mpsc::unbounded_channel();
        *self.shared.script.lock() = Some(calls);
        Calls(received)
    }

    /// Mints a ServiceAccount token, as kubelet does for a pod's projected volume.
    pub fn mint(&self, info: TokenInfo) -> String {
        self.shared.tokens.mint(info)
    }

    /// Forgets a token: its pod is gone.
    pub fn revoke(&self, token: &str) {
        self.shared.tokens.revoke(token);
    }

    /// The tokens TokenReviews asked about, in order.
    pub fn reviews(&self) -> Vec<String> {
        self.shared.tokens.reviewed()
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

async fn serve(listener: tokio::net::TcpListener, shared: Arc<Shared>) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let shared = shared.clone();
        let service = hyper::service::service_fn(move |request| {
            let shared = shared.clone();
            async move { Ok::<_, Infallible>(answer(&shared, request).await) }
        });
        tokio::spawn(async move {
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

async fn answer(shared: &Shared, request: Request<Incoming>) -> Response<Body> {
    let (parts, body) = request.into_parts();
    shared.requests.lock().push(format!("{} {}", parts.method, parts.uri));
    let bearer = parts.headers.get("authorization").and_then(|v| v.to_str().ok());
    if bearer != Some(&format!("Bearer {CALLER_TOKEN}")) {
        return wire::status(StatusCode::UNAUTHORIZED, "Unauthorized", "Unauthorized");
    }
    if shared.forbidden.load(Ordering::Relaxed) {
        let message = format!("{} {} is forbidden", parts.method, parts.uri.path());
        return wire::status(StatusCode::FORBIDDEN, "Forbidden", &message);
    }
    let script = shared.script.lock().clone();
    if let Some(calls) = script {
        return script::hand_over(&calls, parts.method, parts.uri).await;
    }
    let content_type = parts.headers.get("content-type").and_then(|v| v.to_str().ok());
    let merge_patch = content_type.is_some_and(|t| t.starts_with("application/merge-patch+json"));
    if parts.method == Method::PATCH && !merge_patch {
        let message = format!("the fake API server speaks only JSON merge patches, not {content_type:?}");
        return wire::status(StatusCode::UNSUPPORTED_MEDIA_TYPE, "UnsupportedMediaType", &message);
    }
    let body = body.collect().await.map(|b| b.to_bytes()).unwrap_or_default();
    let body: Value = match body.is_empty() {
        true => Value::Null,
        false => match serde_json::from_slice(&body) {
            Ok(body) => body,
            Err(e) => return wire::status(StatusCode::BAD_REQUEST, "BadRequest", &e.to_string()),
        },
    };
    route(shared, &parts.method, &parts.uri, body)
}

fn route(shared: &Shared, method: &Method, uri: &Uri, body: Value) -> Response<Body> {
    match (method, uri.path()) {
        (&Method::GET, "/version") => wire::json(
            StatusCode::OK,
            json!({"major": "1", "minor": "33", "gitVersion": "v1.33.0-fake", "gitCommit": "",
                   "gitTreeState": "clean", "buildDate": "2025-01-01T00:00:00Z", "goVersion": "go1.24",
                   "compiler": "gc", "platform": "linux/amd64"}),
        ),
        (&Method::POST, TOKEN_REVIEWS) => wire::json(StatusCode::CREATED, shared.tokens.review(&body)),
        (method, path) => match Target::parse(path).filter(|t| !shared.absent.lock().contains(&t.kind)) {
            Some(target) => resource(&shared.cluster, method, uri, target, body),
            None => wire::status(
                StatusCode::NOT_FOUND,
                "NotFound",
                "the server could not find the requested resource",
            ),
        },
    }
}

/// A request about a served kind's collection or one of its objects.
fn resource(cluster: &Cluster, method: &Method, uri: &Uri, target: Target, body: Value) -> Response<Body> {
    let Target {
        kind,
        namespace,
        name,
        subresource,
    } = target;
    if *method == Method::GET && name.is_none() {
        return collection(cluster, kind, namespace, uri);
    }
    let ns = namespace.as_deref().unwrap_or_default();
    let named = name
        .clone()
        .or_else(|| body["metadata"]["name"].as_str().map(str::to_owned));
    let answered = match (method, name.as_deref(), subresource) {
        (&Method::GET, Some(name), _) => cluster.get(kind, ns, name).map(|o| (StatusCode::OK, o)),
        (&Method::POST, None, _) => cluster
            .create(kind, namespace.as_deref(), body)
            .map(|o| (StatusCode::CREATED, o)),
        (&Method::PUT, Some(name), Subresource::None) => {
            cluster.replace(kind, ns, name, body).map(|o| (StatusCode::OK, o))
        }
        (&Method::PUT, Some(name), Subresource::Status) => cluster
            .replace_status(kind, ns, name, body)
            .map(|o| (StatusCode::OK, o)),
        (&Method::PATCH, Some(name), subresource) => cluster
            .merge_patch((kind, ns, name), subresource, &body)
            .map(|o| (StatusCode::OK, o)),
        _ => {
            let message = "the server does not allow this method on the requested resource";
            return wire::status(StatusCode::METHOD_NOT_ALLOWED, "MethodNotAllowed", message);
        }
    };
    match answered {
        Ok((code, object)) => wire::json(code, object),
        Err(refusal) => refused(kind, &named.unwrap_or_default(), refusal),
    }
}

/// A list, or a watch with `watch=true`.
fn collection(cluster: &Cluster, kind: Kind, namespace: Option<String>, uri: &Uri) -> Response<Body> {
    let query = wire::query(uri.query());
    let selection = match Selection::new(namespace, &query) {
        Ok(selection) => selection,
        Err(Unsupported(message)) => return wire::status(StatusCode::BAD_REQUEST, "BadRequest", &message),
    };
    if query.get("watch").map(String::as_str) != Some("true") {
        let (resource_version, items) = cluster.list(kind, &selection);
        return wire::json(StatusCode::OK, wire::list(kind, &resource_version, items));
    }
    let from = query.get("resourceVersion").and_then(|v| v.parse().ok()).unwrap_or(0);
    let events = futures::StreamExt::map(cluster.watch(kind, selection, from), |change| Ok(change.event()));
    wire::watch(events)
}

fn refused(kind: Kind, name: &str, refusal: Refusal) -> Response<Body> {
    let resource = kind.resource();
    let (code, reason, message) = match refusal {
        Refusal::NotFound => (
            StatusCode::NOT_FOUND,
            "NotFound",
            format!("{resource} \"{name}\" not found"),
        ),
        Refusal::AlreadyExists => (
            StatusCode::CONFLICT,
            "AlreadyExists",
            format!("{resource} \"{name}\" already exists"),
        ),
        Refusal::Conflict => (
            StatusCode::CONFLICT,
            "Conflict",
            format!(
                "Operation cannot be fulfilled on {resource} \"{name}\": the object has been modified; \
                 please apply your changes to the latest version and try again"
            ),
        ),
        Refusal::BadRequest(message) => (StatusCode::BAD_REQUEST, "BadRequest", message),
    };
    wire::status(code, reason, &message)
}

#[cfg(test)]
mod tests;
