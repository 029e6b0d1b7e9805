//! Strict inbound mTLS end to end (real registrar, agent, Envoy; pods in network
//! namespaces): in STRICT a pod's app port answers only through the mesh and to the node
//! (kubelet-style probes from the root netns), plaintext from an unmanaged pod is reset
//! at once and counted; PERMISSIVE lets it through; the pod's annotation overrides the
//! node's `--inbound-mtls` and a change of it applies without re-adding the pod.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use aether_tests::echo::{EchoIdentity, EchoLedger, EchoServer, serve_echo};
use aether_tests::http::CLIENT_TIMEOUT;
use aether_tests::mesh::{Mesh, NAMESPACE};
use aether_tests::{HttpReply, TestPod, http_get};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::Value;

const ANNOTATION: &str = "security.aether.io/inbound-mtls";
/// The backend's app port; it listens on every address of its pod.
const PORT: u16 = 8080;

/// A managed `backend` serving on all its addresses, a managed `frontend` that calls it,
/// and an `outsider` pod the mesh does not manage.
struct Pods {
    frontend: TestPod,
    backend: TestPod,
    outsider: TestPod,
    _app: EchoServer,
}

impl Pods {
    async fn start(mesh: &Mesh) -> Pods {
        let backend = mesh.node.add_pod("backend");
        let who = EchoIdentity {
            pod: "backend".into(),
            namespace: NAMESPACE.into(),
            service: "backend".into(),
        };
        let app = serve_echo(&backend, ([0, 0, 0, 0], PORT).into(), who, EchoLedger::default());
        mesh.describe_pod(&backend, "backend", "backend", "", &[("http", PORT)]);
        mesh.add_pod_ok(&backend, "backend").await;
        let frontend = mesh.node.add_pod("frontend");
        mesh.describe_pod(&frontend, "frontend", "frontend", "backend", &[("http", PORT)]);
        mesh.add_pod_ok(&frontend, "frontend").await;
        let outsider = mesh.node.add_pod("outsider");
        Pods {
            frontend,
            backend,
            outsider,
            _app: app,
        }
    }

    fn app(&self) -> String {
        format!("http://{}:{PORT}/direct", self.backend.ip())
    }

    /// The outsider's plaintext GET straight to the backend's app port.
    async fn direct(&self) -> Result<HttpReply, String> {
        self.outsider.http_get(&self.app(), None).await
    }

    /// Until the outsider's direct call is answered (`true`) or refused (`false`).
    async fn direct_until(&self, answered: bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let reply = self.direct().await;
            if reply.is_ok() == answered {
                return;
            }
            assert!(Instant::now() < deadline, "direct call still {reply:?}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// Sets (or with `None` drops) the backend's inbound mTLS annotation, the way a
/// `kubectl annotate` reaches the static pod source: its manifest is replaced.
fn annotate(mesh: &Mesh, pod: &str, value: Option<&str>) {
    let path = mesh.path(&format!("pods/{pod}.json"));
    let mut manifest: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let annotations = manifest["metadata"]["annotations"].as_object_mut().unwrap();
    match value {
        Some(v) => annotations.insert(ANNOTATION.into(), v.into()),
        None => annotations.remove(ANNOTATION),
    };
    let staged = mesh.path(&format!("pods/.{pod}.staged"));
    std::fs::write(&staged, serde_json::to_vec(&manifest).unwrap()).unwrap();
    std::fs::rename(staged, path).unwrap();
}

/// The pod's row of the agent's `/debug/status`.
async fn status_of(mesh: &Mesh, pod: &str) -> Value {
    let status: Value = serde_json::from_str(&mesh.agent_get("/debug/status").await).unwrap();
    let id = format!("{NAMESPACE}/{pod}");
    let rows = status["pods"].as_array().unwrap();
    rows.iter()
        .find(|row| row["pod"] == id.as_str())
        .cloned()
        .unwrap_or_else(|| panic!("{id} not in {status}"))
}

/// A refused plaintext call fails on the reset (`connection refused`), well before the
/// client's timeout (what a dropped SYN would cost); the margin absorbs a loaded machine.
fn assert_reset(reply: Result<HttpReply, String>, took: Duration) {
    let error = reply.expect_err("a plaintext call to an app port is refused in STRICT");
    assert!(error.contains("refused"), "{error}");
    assert!(took < CLIENT_TIMEOUT / 2, "refused after {took:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strict_resets_plaintext_from_an_unmanaged_pod_and_counts_it_while_the_mesh_gets_through() {
    let mesh = Mesh::start().await;
    let pods = Pods::start(&mesh).await;
    for _ in 0..3 {
        let started = Instant::now();
        let reply = pods.direct().await;
        assert_reset(reply, started.elapsed());
    }
    let vip = mesh.vip("backend").await;
    let deadline = Instant::now() + Duration::from_secs(10);
    let reply = loop {
        let reply = pods.frontend.http_get(&format!("http://{vip}:{PORT}/mesh"), None).await;
        match reply {
            Ok(reply) if reply.status == 200 => break reply,
            _ if Instant::now() < deadline => tokio::time::sleep(Duration::from_millis(50)).await,
            other => panic!("the mesh call through the VIP failed: {other:?}"),
        }
    };
    assert_eq!(reply.json()["pod"], "backend");
    let row = status_of(&mesh, "backend").await;
    assert_eq!(row["inbound_mtls"], "strict", "{row}");
    assert_eq!(row["refused_plaintext"], 3, "one per refused connection: {row}");
    let status = mesh.aether(&["status"]).await;
    let line = status
        .lines()
        .find(|l| l.starts_with("demo/backend "))
        .unwrap_or_default();
    assert!(line.contains("strict (3 refused)"), "{status}");
    assert!(status.contains("INBOUND MTLS"), "{status}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strict_keeps_kubelet_style_probes_from_the_node_working() {
    let mesh = Mesh::start().await;
    let pods = Pods::start(&mesh).await;
    let app = SocketAddr::from((pods.backend.ip(), PORT));
    // HTTP GET, as an httpGet probe.
    let reply = http_get(&format!("http://{app}/healthz"), None)
        .await
        .expect("HTTP probe");
    assert_eq!(reply.status, 200);
    // TCP connect, as a tcpSocket probe.
    let connected = tokio::net::TcpStream::connect(app).await;
    assert!(connected.is_ok(), "TCP probe: {connected:?}");
    // The gRPC health check, as a grpc probe.
    assert_eq!(grpc_health_check(app).await, Some("0".to_owned()));
    let row = status_of(&mesh, "backend").await;
    assert_eq!(row["inbound_mtls"], "strict", "{row}");
    assert_eq!(row["refused_plaintext"], 0, "{row}");
}

/// `grpc.health.v1.Health/Check` over h2c from the root netns (where kubelet runs); the
/// answer's `grpc-status`.
async fn grpc_health_check(addr: SocketAddr) -> Option<String> {
    let stream = tokio::net::TcpStream::connect(addr).await.expect("gRPC probe connects");
    let (mut sender, conn) = hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
        .await
        .expect("h2c handshake");
    let driver = tokio::spawn(conn);
    let request = hyper::Request::post(format!("http://{addr}/grpc.health.v1.Health/Check"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(Full::new(aether_tests::echo::grpc_frame(b"")))
        .unwrap();
    let response = sender.send_request(request).await.expect("gRPC probe answered");
    let headers = response.headers().clone();
    let body = response.into_body().collect().await.expect("gRPC probe body");
    driver.abort();
    let status = body
        .trailers()
        .and_then(|t| t.get("grpc-status"))
        .or(headers.get("grpc-status"));
    status.map(|s| s.to_str().unwrap().to_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permissive_lets_plaintext_through() {
    let mesh = Mesh::start_with(&["--inbound-mtls", "permissive"]).await;
    let pods = Pods::start(&mesh).await;
    let reply = pods.direct().await.expect("PERMISSIVE answers plaintext");
    assert_eq!((reply.status, reply.json()["pod"].clone()), (200, "backend".into()));
    let row = status_of(&mesh, "backend").await;
    assert_eq!(row["inbound_mtls"], "permissive", "{row}");
    assert_eq!(row["refused_plaintext"], Value::Null, "{row}");
    let table = pods.backend.exec_ok(&["nft", "list", "table", "inet", "aether"]);
    assert!(!table.contains("chain inbound"), "{table}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pods_annotation_overrides_the_node_and_a_change_applies_without_re_adding_it() {
    let mesh = Mesh::start_with(&["--inbound-mtls", "permissive"]).await;
    let pods = Pods::start(&mesh).await;
    pods.direct_until(true).await;

    annotate(&mesh, "backend", Some("STRICT"));
    pods.direct_until(false).await;
    let started = Instant::now();
    let reply = pods.direct().await;
    assert_reset(reply, started.elapsed());
    assert_eq!(status_of(&mesh, "backend").await["inbound_mtls"], "strict");

    annotate(&mesh, "backend", Some("permissive"));
    pods.direct_until(true).await;

    // An invalid value is a config error, and the node's default holds.
    annotate(&mesh, "backend", Some("strict"));
    pods.direct_until(false).await;
    annotate(&mesh, "backend", Some("mtls-please"));
    pods.direct_until(true).await;
    let row = status_of(&mesh, "backend").await;
    assert_eq!(
        (row["inbound_mtls"].clone(), row["config_errors"].clone()),
        ("permissive".into(), 1.into()),
        "{row}"
    );
}
