//! The `kubernetes` pod source against a fake API server speaking real list and watch
//! JSON over plain HTTP. Each test scripts the server request by request: it sees every
//! request the watcher sends, checks its query, and answers with a list, a status, or a
//! watch stream it then feeds event by event (or cuts).

use std::collections::HashMap;
use std::convert::Infallible;
use std::time::Duration;

use aether_agent::pod_source::PodDirectory;
use aether_agent::pod_source::kubernetes;
use bytes::Bytes;
use http_body_util::{BodyExt, Full, StreamBody, combinators::BoxBody};
use hyper::body::{Frame, Incoming};
use hyper::{Request, Response, StatusCode, Uri};
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio::time::{Instant, timeout, timeout_at};
use tokio_util::sync::CancellationToken;

const NODE: &str = "node-a";
/// Bound on every wait: kube's first backoff step is under 2s.
const WAIT: Duration = Duration::from_secs(15);

// ---------------------------------------------------------------- the fake API server

type Body = BoxBody<Bytes, std::io::Error>;

/// One request the watcher sent, waiting for the test to answer it.
struct Call {
    uri: Uri,
    reply: oneshot::Sender<Reply>,
}

enum Reply {
    Json(StatusCode, Value),
    Watch(mpsc::UnboundedReceiver<Chunk>),
}

enum Chunk {
    Line(Value),
    /// Abort the connection mid-stream (no final chunk).
    Cut,
}

struct FakeApi {
    url: String,
    calls: mpsc::UnboundedReceiver<Call>,
}

impl FakeApi {
    async fn start() -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let (calls_tx, calls) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                let calls_tx = calls_tx.clone();
                let service = hyper::service::service_fn(move |req: Request<Incoming>| {
                    let calls_tx = calls_tx.clone();
                    async move { Ok::<_, Infallible>(answer(req, calls_tx).await) }
                });
                tokio::spawn(async move {
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        Self { url, calls }
    }

    fn client(&self) -> kube::Client {
        let config = kube::Config::new(self.url.parse().unwrap());
        kube::Client::try_from(config).unwrap()
    }

    async fn next(&mut self, what: &str) -> Call {
        match timeout(WAIT, self.calls.recv()).await {
            Ok(Some(call)) => call,
            _ => panic!("no {what} request within {WAIT:?}"),
        }
    }

    /// Expects a list of the node's pods and answers it.
    async fn expect_list(&mut self, resource_version: &str, items: Vec<Value>) {
        let call = self.expect_list_call().await;
        call.list(resource_version, items);
    }

    async fn expect_list_call(&mut self) -> Call {
        let call = self.next("list").await;
        let query = call.query();
        assert_eq!(call.uri.path(), "/api/v1/pods", "{}", call.uri);
        assert!(!query.contains_key("watch"), "expected a list, got {}", call.uri);
        call.assert_node_selector();
        call
    }

    /// Expects a watch from `resource_version` and returns the stream's controls.
    async fn expect_watch(&mut self, resource_version: &str) -> Watch {
        let call = self.expect_watch_call(resource_version).await;
        call.watch()
    }

    async fn expect_watch_call(&mut self, resource_version: &str) -> Call {
        let call = self.next("watch").await;
        let query = call.query();
        assert_eq!(call.uri.path(), "/api/v1/pods", "{}", call.uri);
        assert_eq!(
            query.get("watch").map(String::as_str),
            Some("true"),
            "expected a watch, got {}",
            call.uri
        );
        assert_eq!(
            query.get("resourceVersion").map(String::as_str),
            Some(resource_version),
            "{}",
            call.uri
        );
        assert_eq!(query.get("allowWatchBookmarks").map(String::as_str), Some("true"));
        call.assert_node_selector();
        call
    }
}

impl Call {
    fn query(&self) -> HashMap<String, String> {
        self.uri
            .query()
            .unwrap_or_default()
            .split('&')
            .filter(|p| !p.is_empty())
            .map(|pair| {
                let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
                (percent_decode(k), percent_decode(v))
            })
            .collect()
    }

    fn assert_node_selector(&self) {
        let raw = self.uri.query().unwrap_or_default();
        assert!(
            raw.contains("fieldSelector=spec.nodeName%3Dnode-a"),
            "no node field selector in {raw}"
        );
        assert_eq!(self.query()["fieldSelector"], format!("spec.nodeName={NODE}"));
    }

    fn list(self, resource_version: &str, items: Vec<Value>) {
        // List items come without apiVersion/kind, as from a real API server.
        let items: Vec<Value> = items
            .into_iter()
            .map(|mut pod| {
                let object = pod.as_object_mut().unwrap();
                object.remove("apiVersion");
                object.remove("kind");
                pod
            })
            .collect();
        let list = json!({
            "apiVersion": "v1", "kind": "PodList",
            "metadata": {"resourceVersion": resource_version},
            "items": items,
        });
        self.reply.send(Reply::Json(StatusCode::OK, list)).ok().unwrap();
    }

    fn status(self, code: StatusCode, reason: &str, message: &str) {
        let status = json!({
            "apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code.as_u16(),
        });
        self.reply.send(Reply::Json(code, status)).ok().unwrap();
    }

    fn watch(self) -> Watch {
        let (tx, rx) = mpsc::unbounded_channel();
        self.reply.send(Reply::Watch(rx)).ok().unwrap();
        Watch(tx)
    }
}

/// The test's end of one watch response.
struct Watch(mpsc::UnboundedSender<Chunk>);

impl Watch {
    fn send(&self, kind: &str, object: Value) {
        self.0
            .send(Chunk::Line(json!({"type": kind, "object": object})))
            .unwrap();
    }

    fn bookmark(&self, resource_version: &str) {
        self.send(
            "BOOKMARK",
            json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"resourceVersion": resource_version}}),
        );
    }

    fn expired(&self, resource_version: &str) {
        self.send(
            "ERROR",
            json!({"apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Failure",
                   "message": format!("too old resource version: {resource_version} (50)"),
                   "reason": "Expired", "code": 410}),
        );
    }

    /// The connection is dropped mid-stream.
    fn cut(self) {
        let _ = self.0.send(Chunk::Cut);
    }

    /// The server ends the response cleanly (as at the end of `timeoutSeconds`).
    fn end(self) {}
}

async fn answer(req: Request<Incoming>, calls: mpsc::UnboundedSender<Call>) -> Response<Body> {
    let (reply, replied) = oneshot::channel();
    if calls
        .send(Call {
            uri: req.uri().clone(),
            reply,
        })
        .is_err()
    {
        return json_response(StatusCode::SERVICE_UNAVAILABLE, json!({}));
    }
    match replied.await {
        Ok(Reply::Json(code, body)) => json_response(code, body),
        Ok(Reply::Watch(chunks)) => {
            let frames = futures::stream::unfold(Some(chunks), |chunks| async move {
                let mut chunks = chunks?;
                match chunks.recv().await? {
                    Chunk::Line(event) => {
                        let line = format!("{event}\n");
                        Some((Ok(Frame::data(Bytes::from(line))), Some(chunks)))
                    }
                    Chunk::Cut => Some((Err(std::io::Error::other("cut")), None)),
                }
            });
            Response::builder()
                .header("content-type", "application/json")
                .body(BodyExt::boxed(StreamBody::new(frames)))
                .unwrap()
        }
        // The test is over.
        Err(_) => json_response(StatusCode::SERVICE_UNAVAILABLE, json!({})),
    }
}

fn json_response(code: StatusCode, body: Value) -> Response<Body> {
    Response::builder()
        .status(code)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())).map_err(|e| match e {}).boxed())
        .unwrap()
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' if i + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).unwrap();
                out.push(u8::from_str_radix(hex, 16).unwrap());
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

// ---------------------------------------------------------------- helpers

/// A Pod as the API server sends it in a watch event.
fn pod(name: &str, resource_version: &str, port: i64) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {
            "name": name, "namespace": "shop", "uid": format!("uid-{name}"),
            "resourceVersion": resource_version,
            "labels": {"aether.io/managed": "true", "app": name},
            "annotations": {"config.aether.io/upstreams": "cart"},
        },
        "spec": {
            "nodeName": NODE, "serviceAccountName": "web",
            "containers": [{"name": "app", "image": "app:1",
                            "ports": [{"name": "http", "containerPort": port}]}],
        },
        "status": {"phase": "Running"},
    })
}

fn terminating(mut pod: Value, resource_version: &str) -> Value {
    pod["metadata"]["deletionTimestamp"] = json!("2025-06-01T12:00:00Z");
    pod["metadata"]["resourceVersion"] = json!(resource_version);
    pod
}

/// Waits (bounded) until `check` holds for the directory.
async fn eventually(pods: &PodDirectory, what: &str, check: impl Fn(&PodDirectory) -> bool) {
    let mut changes = pods.subscribe();
    let deadline = Instant::now() + WAIT;
    loop {
        if check(pods) {
            return;
        }
        if timeout_at(deadline, changes.changed()).await.is_err() {
            panic!("timed out after {WAIT:?} waiting until {what}");
        }
    }
}

fn has(pods: &PodDirectory, name: &str) -> bool {
    pods.get(&format!("shop/{name}")).is_some()
}

struct Running {
    pods: PodDirectory,
    shutdown: CancellationToken,
    task: JoinHandle<()>,
}

fn start(api: &FakeApi) -> Running {
    let pods = PodDirectory::default();
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(kubernetes::run(
        api.client(),
        NODE.into(),
        pods.clone(),
        shutdown.clone(),
    ));
    Running { pods, shutdown, task }
}

impl Running {
    async fn stop(self) {
        assert!(!self.task.is_finished(), "the pod source exited before shutdown");
        self.shutdown.cancel();
        timeout(WAIT, self.task)
            .await
            .expect("the pod source stops on shutdown")
            .unwrap();
    }
}

// ---------------------------------------------------------------- tests

#[tokio::test]
async fn lists_then_follows_the_watch_across_cut_and_ended_streams() {
    let mut api = FakeApi::start().await;
    let run = start(&api);
    let pods = &run.pods;

    // Initial list: two good pods and one whose port is out of range.
    api.expect_list(
        "1",
        vec![pod("a", "1", 8080), pod("b", "1", 8081), pod("bad", "1", 70000)],
    )
    .await;
    eventually(pods, "the initial list is served", |p| has(p, "a") && has(p, "b")).await;
    assert!(!has(pods, "bad"), "a pod with an out-of-range port is skipped");
    let a = pods.get("shop/a").unwrap();
    assert_eq!(a.uid, "uid-a");
    assert_eq!(a.service(), "shop/web");
    assert!(a.is_managed());
    assert_eq!(a.annotations["config.aether.io/upstreams"], "cart");
    assert_eq!(
        (a.ports[0].name.as_str(), a.ports[0].port, a.ports[0].protocol.as_str()),
        ("http", 8080, "TCP")
    );
    assert!(!a.terminating);

    // Watch from the list's resourceVersion.
    let watch = api.expect_watch("1").await;
    watch.send("ADDED", pod("c", "2", 8082));
    eventually(pods, "ADDED c is served", |p| has(p, "c")).await;
    watch.send("MODIFIED", terminating(pod("a", "3", 8080), "3"));
    eventually(pods, "a is terminating", |p| {
        p.get("shop/a").is_some_and(|a| a.terminating)
    })
    .await;
    watch.send("DELETED", terminating(pod("a", "4", 8080), "4"));
    eventually(pods, "DELETED a is gone", |p| !has(p, "a")).await;
    assert!(has(pods, "b") && has(pods, "c"));
    watch.bookmark("10");
    // The server ends the response cleanly (timeoutSeconds): the watcher resumes from the bookmark.
    watch.end();

    let watch = api.expect_watch("10").await;
    // What happened while away, plus a pod that does not convert.
    watch.send("DELETED", pod("b", "11", 8081));
    watch.send("ADDED", pod("bad2", "12", 0));
    watch.send("ADDED", pod("e", "13", 8083));
    eventually(pods, "the resumed watch converges", |p| has(p, "e") && !has(p, "b")).await;
    assert!(!has(pods, "bad2"), "a pod with port 0 is skipped");
    assert!(has(pods, "c"), "other pods still served");
    // The connection drops mid-stream: the watcher resumes from the last event it saw.
    watch.cut();

    let watch = api.expect_watch("13").await;
    // What happened while away: c went, and the bad pod was fixed.
    watch.send("DELETED", pod("c", "14", 8082));
    watch.send("MODIFIED", pod("bad2", "15", 8084));
    eventually(pods, "the re-watch converges", |p| has(p, "bad2") && !has(p, "c")).await;
    assert_eq!(pods.get("shop/bad2").unwrap().ports[0].port, 8084);
    assert!(has(pods, "e") && !has(pods, "a") && !has(pods, "b"));

    run.stop().await;
}

#[tokio::test]
async fn an_expired_resource_version_in_the_watch_relists() {
    let mut api = FakeApi::start().await;
    let run = start(&api);
    let pods = &run.pods;

    api.expect_list("1", vec![pod("a", "1", 8080), pod("b", "1", 8081)])
        .await;
    eventually(pods, "the initial list is served", |p| has(p, "a") && has(p, "b")).await;

    let watch = api.expect_watch("1").await;
    watch.expired("1");

    // A fresh list, no resourceVersion: the most recent state.
    let list = api.expect_list_call().await;
    assert!(!list.query().contains_key("resourceVersion"), "{}", list.uri);
    // Until the re-list completes the last good set stays served.
    assert!(has(pods, "a") && has(pods, "b"));
    list.list(
        "50",
        vec![terminating(pod("a", "45", 8080), "45"), pod("c", "48", 8082)],
    );
    eventually(pods, "the re-list replaces the set", |p| has(p, "c") && !has(p, "b")).await;
    assert!(pods.get("shop/a").unwrap().terminating);

    let watch = api.expect_watch("50").await;
    watch.send("ADDED", pod("d", "51", 8083));
    eventually(pods, "the new watch is followed", |p| has(p, "d")).await;

    run.stop().await;
}

#[tokio::test]
async fn a_410_answering_the_watch_request_relists() {
    let mut api = FakeApi::start().await;
    let run = start(&api);
    let pods = &run.pods;

    api.expect_list("1", vec![pod("a", "1", 8080)]).await;
    eventually(pods, "the initial list is served", |p| has(p, "a")).await;

    api.expect_watch_call("1")
        .await
        .status(StatusCode::GONE, "Expired", "too old resource version: 1 (60)");

    api.expect_list("60", vec![pod("b", "60", 8081)]).await;
    eventually(pods, "the re-list replaces the set", |p| has(p, "b") && !has(p, "a")).await;
    let watch = api.expect_watch("60").await;
    watch.send("ADDED", pod("c", "61", 8082));
    eventually(pods, "the new watch is followed", |p| has(p, "c")).await;

    run.stop().await;
}

#[tokio::test]
async fn failing_requests_are_retried_with_backoff() {
    let mut api = FakeApi::start().await;
    let run = start(&api);
    let pods = &run.pods;

    // No RBAC yet: the list is refused, then retried after a backoff.
    let refused = Instant::now();
    api.expect_list_call()
        .await
        .status(StatusCode::FORBIDDEN, "Forbidden", "pods is forbidden");
    api.expect_list("1", vec![pod("a", "1", 8080)]).await;
    assert!(
        refused.elapsed() >= Duration::from_millis(300),
        "retried without backoff"
    );
    eventually(pods, "the list is served once allowed", |p| has(p, "a")).await;

    // A watch that fails to start is retried from the same resourceVersion; pods stay served.
    api.expect_watch_call("1")
        .await
        .status(StatusCode::INTERNAL_SERVER_ERROR, "InternalError", "etcd is down");
    assert!(has(pods, "a"));
    let watch = api.expect_watch("1").await;
    watch.send("DELETED", pod("a", "2", 8080));
    eventually(pods, "the retried watch is followed", |p| !has(p, "a")).await;

    run.stop().await;
}

// ---------------------------------------------------------------- the agent's locality from its Node

/// `aether-agent run --pod-source kubernetes` against the fake API and a real registrar
/// (embedded store): the registrar, the agent process (killed on drop), its log file.
struct Agent {
    registrar: aether_registrar::Running,
    registrar_stop: CancellationToken,
    pki: Pki,
    child: tokio::process::Child,
    admin: std::net::SocketAddr,
    log: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

/// The control plane's mTLS for these tests: the registrar's certificate, a node CA, this
/// node's certificate from it (the agent's `--node-identity files`) and a reader's.
struct Pki {
    dir: std::path::PathBuf,
    registrar_ca: Vec<u8>,
    reader: (Vec<u8>, Vec<u8>),
}

impl Pki {
    const REGISTRAR: &str = "registrar.test";
    const READER: &str = "spiffe://cluster.local/ns/test/sa/reader";

    fn write(dir: &std::path::Path) -> Pki {
        let dir = dir.join("pki");
        std::fs::create_dir_all(&dir).unwrap();
        let ca = |name: &str| {
            let key = rcgen::KeyPair::generate().unwrap();
            let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
            params.distinguished_name.push(rcgen::DnType::CommonName, name);
            params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
            let cert = params.self_signed(&key).unwrap();
            (cert, rcgen::Issuer::new(params, key))
        };
        let leaf = |issuer: &rcgen::Issuer<'_, rcgen::KeyPair>, san: rcgen::SanType| {
            let key = rcgen::KeyPair::generate().unwrap();
            let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
            params.subject_alt_names = vec![san];
            (params.signed_by(&key, issuer).unwrap(), key)
        };
        let uri = |id: &str| rcgen::SanType::URI(id.to_owned().try_into().unwrap());
        let (registrar_ca, registrar_issuer) = ca("registrar CA");
        let (node_ca, node_issuer) = ca("node CA");
        let (server, server_key) = leaf(
            &registrar_issuer,
            rcgen::SanType::DnsName(Self::REGISTRAR.try_into().unwrap()),
        );
        let (node, node_key) = leaf(&node_issuer, uri(&format!("spiffe://cluster.local/aether/node/{NODE}")));
        let (reader, reader_key) = leaf(&node_issuer, uri(Self::READER));
        for (file, pem) in [
            ("registrar-ca.crt", registrar_ca.pem()),
            ("registrar.crt", server.pem()),
            ("registrar.key", server_key.serialize_pem()),
            ("node-ca.crt", node_ca.pem()),
            ("node.crt", node.pem()),
            ("node.key", node_key.serialize_pem()),
        ] {
            std::fs::write(dir.join(file), pem).unwrap();
        }
        Pki {
            dir,
            registrar_ca: registrar_ca.der().to_vec(),
            reader: (reader.der().to_vec(), reader_key.serialize_der()),
        }
    }

    fn path(&self, file: &str) -> String {
        self.dir.join(file).display().to_string()
    }

    fn registrar_flags(&self) -> Vec<String> {
        vec![
            format!("--tls-cert={}", self.path("registrar.crt")),
            format!("--tls-key={}", self.path("registrar.key")),
            format!("--node-ca-cert={}", self.path("node-ca.crt")),
            "--trust-domain=cluster.local".into(),
            format!("--reader-ids={}", Self::READER),
        ]
    }

    /// The agent presents a node certificate from files.
    fn agent_flags(&self) -> Vec<String> {
        vec![
            format!("--registrar-ca={}", self.path("registrar-ca.crt")),
            format!("--registrar-identity={}", Self::REGISTRAR),
            "--node-identity=files".into(),
            format!("--node-cert={}", self.path("node.crt")),
            format!("--node-key={}", self.path("node.key")),
        ]
    }

    async fn reader(
        &self,
        addr: std::net::SocketAddr,
    ) -> aether_proto::registrar::v1::registrar_client::RegistrarClient<tonic::transport::Channel> {
        use aether_common::tls;
        let slot = tls::CertSlot::new(
            tls::certified_key(
                vec![self.reader.0.clone().into()],
                rustls::pki_types::PrivateKeyDer::Pkcs8(self.reader.1.clone().into()),
            )
            .unwrap(),
        );
        let roots = tls::roots("registrar CA", vec![self.registrar_ca.clone().into()]).unwrap();
        let config = tls::client_config(roots, Self::REGISTRAR.parse().unwrap(), slot).unwrap();
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect_with_connector(tls::Connector::new(config))
            .await
            .unwrap();
        aether_proto::registrar::v1::registrar_client::RegistrarClient::new(channel)
    }
}

/// The pod the agent's state dir holds from a previous run (re-registered at start).
const RECOVERED: &str = "a";
const RECOVERED_IP: &str = "10.77.0.5";

impl Agent {
    /// Starts the registrar and the agent. The agent's state dir holds pod
    /// [`RECOVERED`] (as the pod source describes it), so the agent registers it at
    /// start, before any CNI call: with the locality it settled on.
    async fn start(api: &FakeApi, flags: &[&str]) -> Agent {
        let dir = tempfile::tempdir().unwrap();
        let registrar_stop = CancellationToken::new();
        let pki = Pki::write(dir.path());
        let mut registrar_flags = vec![
            "aether-registrar".to_owned(),
            "--listen=127.0.0.1:0".into(),
            "--admin=127.0.0.1:0".into(),
            "--store=embedded".into(),
            format!("--data-dir={}", dir.path().join("registrar").display()),
        ];
        registrar_flags.extend(pki.registrar_flags());
        let registrar = aether_registrar::start(
            <aether_registrar::Config as clap::Parser>::parse_from(registrar_flags),
            registrar_stop.clone(),
        )
        .await
        .expect("the registrar starts");

        // A sandbox path that exists but is no netns: capture repair fails harmlessly on it.
        let sandbox = dir.path().join("sandbox");
        std::fs::write(&sandbox, b"").unwrap();
        let state = dir.path().join("state");
        let pods = aether_agent::pod_store::PodStore::open(&state).unwrap();
        let info = kubernetes::pod_info(&serde_json::from_value(pod(RECOVERED, "1", 8080)).unwrap()).unwrap();
        std::fs::create_dir_all(&state).unwrap();
        pods.put(aether_agent::pod::LocalPod {
            container_id: "c-recovered".into(),
            netns: sandbox,
            ips: vec![RECOVERED_IP.parse().unwrap()],
            info,
        })
        .await
        .unwrap();

        let kubeconfig = dir.path().join("kubeconfig");
        std::fs::write(
            &kubeconfig,
            format!(
                "apiVersion: v1\nkind: Config\ncurrent-context: fake\n\
                 clusters: [{{name: fake, cluster: {{server: \"{}\"}}}}]\n\
                 users: [{{name: fake, user: {{}}}}]\n\
                 contexts: [{{name: fake, context: {{cluster: fake, user: fake}}}}]\n",
                api.url
            ),
        )
        .unwrap();
        let admin = {
            let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            probe.local_addr().unwrap()
        };
        let log = dir.path().join("agent.log");
        let child = tokio::process::Command::new(env!("CARGO_BIN_EXE_aether-agent"))
            .arg("run")
            .args(["--node-name", NODE, "--pod-source", "kubernetes", "--identity", "none"])
            .arg(format!("--registrar=https://{}", registrar.grpc_addr))
            .args(pki.agent_flags())
            .arg(format!("--state-dir={}", state.display()))
            .arg(format!("--cni-socket={}", dir.path().join("cni.sock").display()))
            .arg(format!("--xds-socket={}", dir.path().join("xds.sock").display()))
            .arg(format!("--netns-pin-dir={}", dir.path().join("netns").display()))
            .arg(format!("--admin={admin}"))
            // Nothing listens there: no Envoy in these tests.
            .arg("--envoy-admin=127.0.0.1:9")
            .args(flags)
            .env("KUBECONFIG", &kubeconfig)
            .env("RUST_LOG", "info")
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .kill_on_drop(true)
            .spawn()
            .expect("aether-agent starts");
        Agent {
            registrar,
            registrar_stop,
            pki,
            child,
            admin,
            log,
            _dir: dir,
        }
    }

    fn logs(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The registrar's endpoints of `shop/web` once the recovered pod's is there.
    async fn registered(&self) -> aether_proto::registry::v1::Endpoint {
        let mut client = self.pki.reader(self.registrar.grpc_addr).await;
        let deadline = Instant::now() + WAIT;
        loop {
            let endpoints = client
                .list_endpoints(aether_proto::registrar::v1::ListEndpointsRequest {
                    service: "shop/web".into(),
                })
                .await
                .map(|r| r.into_inner().endpoints)
                .unwrap_or_default();
            if let Some(endpoint) = endpoints.into_iter().find(|e| e.address == RECOVERED_IP) {
                return endpoint;
            }
            assert!(
                Instant::now() < deadline,
                "the agent never registered {RECOVERED_IP}\nagent:\n{}",
                self.logs()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The agent answers `/ready` with 200.
    async fn assert_ready(&self) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut stream = tokio::net::TcpStream::connect(self.admin).await.unwrap();
        stream
            .write_all(b"GET /ready HTTP/1.1\r\nHost: agent\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        let mut reply = String::new();
        stream.read_to_string(&mut reply).await.unwrap();
        assert!(reply.starts_with("HTTP/1.1 200"), "{reply}\nagent:\n{}", self.logs());
    }

    async fn stop(mut self) {
        assert!(
            self.child.try_wait().unwrap().is_none(),
            "the agent exited\n{}",
            self.logs()
        );
        self.child.kill().await.unwrap();
        self.registrar_stop.cancel();
        timeout(WAIT, self.registrar.wait())
            .await
            .expect("the registrar stops")
            .expect("a clean stop");
    }
}

/// Serves the agent's pod list and opens its watch (the agent's pod source starting).
async fn serve_pods(api: &mut FakeApi) -> Watch {
    api.expect_list("1", vec![pod(RECOVERED, "1", 8080)]).await;
    api.expect_watch("1").await
}

fn node(labels: Value) -> Value {
    json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE, "resourceVersion": "7", "labels": labels}})
}

impl FakeApi {
    /// Expects a read of the agent's Node.
    async fn expect_node_call(&mut self) -> Call {
        let call = self.next("node").await;
        assert_eq!(call.uri.path(), format!("/api/v1/nodes/{NODE}"), "{}", call.uri);
        call
    }
}

impl Call {
    fn object(self, object: Value) {
        self.reply.send(Reply::Json(StatusCode::OK, object)).ok().unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_registers_its_pods_with_its_nodes_region_and_zone() {
    let mut api = FakeApi::start().await;
    let agent = Agent::start(&api, &[]).await;

    api.expect_node_call().await.object(node(json!({
        "kubernetes.io/hostname": NODE,
        "topology.kubernetes.io/region": "eu-west-1",
        "topology.kubernetes.io/zone": "eu-west-1b",
    })));
    let _watch = serve_pods(&mut api).await;

    let endpoint = agent.registered().await;
    let locality = endpoint.locality.clone().expect("a locality");
    assert_eq!(
        (
            locality.region.as_str(),
            locality.zone.as_str(),
            locality.subzone.as_str()
        ),
        ("eu-west-1", "eu-west-1b", ""),
        "{endpoint:?}"
    );
    assert_eq!(endpoint.node, NODE);
    assert!(agent.logs().contains("locality from the node's topology labels"));
    agent.assert_ready().await;
    agent.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explicit_locality_flags_win_over_the_nodes_labels() {
    let mut api = FakeApi::start().await;
    let agent = Agent::start(&api, &["--zone", "rack-9", "--subzone", "row-2"]).await;

    // The region is not given: it still comes from the Node; the zone flag wins.
    api.expect_node_call().await.object(node(json!({
        "topology.kubernetes.io/region": "eu-west-1",
        "topology.kubernetes.io/zone": "eu-west-1b",
    })));
    let _watch = serve_pods(&mut api).await;

    let locality = agent.registered().await.locality.expect("a locality");
    assert_eq!(
        (
            locality.region.as_str(),
            locality.zone.as_str(),
            locality.subzone.as_str()
        ),
        ("eu-west-1", "rack-9", "row-2")
    );
    agent.stop().await;

    // Region and zone both given: the Node is not read at all (the first request is the pod list).
    let mut api = FakeApi::start().await;
    let agent = Agent::start(&api, &["--region", "r", "--zone", "z"]).await;
    let _watch = serve_pods(&mut api).await;
    let locality = agent.registered().await.locality.expect("a locality");
    assert_eq!((locality.region.as_str(), locality.zone.as_str()), ("r", "z"));
    agent.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_its_node_the_agent_warns_once_and_registers_without_a_locality() {
    let mut api = FakeApi::start().await;
    let agent = Agent::start(&api, &[]).await;

    // A transient failure is retried (after a pause); a 404 is final. (A 500: kube's
    // own retry layer only covers 429/503/504.)
    let failed = Instant::now();
    api.expect_node_call()
        .await
        .status(StatusCode::INTERNAL_SERVER_ERROR, "InternalError", "etcd is down");
    api.expect_node_call().await.status(
        StatusCode::NOT_FOUND,
        "NotFound",
        &format!("nodes \"{NODE}\" not found"),
    );
    assert!(
        failed.elapsed() >= Duration::from_millis(300),
        "retried without a pause"
    );
    // Start-up goes on: the next request is the pod source's list, not another Node read.
    let _watch = serve_pods(&mut api).await;

    let endpoint = agent.registered().await;
    assert_eq!(
        endpoint.locality.unwrap_or_default(),
        aether_proto::registry::v1::Locality::default(),
        "{:?}",
        endpoint.address
    );
    agent.assert_ready().await;
    let logs = agent.logs();
    assert_eq!(
        logs.matches("the node's locality is unknown").count(),
        1,
        "one warning expected:\n{logs}"
    );
    assert!(logs.contains("not found"), "the warning says why:\n{logs}");
    agent.stop().await;
}
