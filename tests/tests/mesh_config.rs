//! MeshConfig end to end (as root; real registrar, agent and Envoy; pods in network
//! namespaces): MeshConfig YAML in the registrar's config directory is projected, stored
//! and streamed to the agent, which applies it to running pods without a restart or a
//! new ADD — the mesh-wide inbound mTLS mode, a namespace's override of it, a namespace's
//! default DENY (opened again by an ALLOW policy), and its request timeout; `aether status`
//! lists the MeshConfigs the node holds and `aether explain` names the default DENY; and
//! the mesh-wide mesh domain, answered by the real mesh-dns and Envoy next to the node's.

use std::time::{Duration, Instant};

use aether_tests::echo::{DELAY_HEADER, EchoIdentity, EchoLedger, EchoServer, serve_echo};
use aether_tests::mesh::{Mesh, NAMESPACE, put_config};
use aether_tests::mesh_dns::MeshDns;
use aether_tests::{HttpReply, TestPod};

const PORT: u16 = 8080;

const MESH_PERMISSIVE: &str = "\
apiVersion: mesh.aether.io/v1alpha1
kind: MeshConfig
metadata: {name: default, namespace: aether-system}
spec:
  mtls: {mode: PERMISSIVE}
";

/// The pods' namespace: STRICT again, deny by default, 300 ms per request.
const DEMO_LOCKED_DOWN: &str = "\
apiVersion: mesh.aether.io/v1alpha1
kind: MeshConfig
metadata: {name: default, namespace: demo}
spec:
  mtls: {mode: STRICT}
  authorization: {defaultAction: DENY}
  resilience: {requestTimeout: 300ms}
";

const ALLOW_FRONTEND: &str = "\
apiVersion: security.aether.io/v1alpha1
kind: AuthorizationPolicy
metadata: {name: frontend-in, namespace: demo}
spec:
  targetRefs: [{kind: Service, name: backend}]
  action: ALLOW
  rules:
    - from: [{source: {serviceAccounts: [demo/frontend]}}]
";

struct Pods {
    frontend: TestPod,
    backend: TestPod,
    outsider: TestPod,
    _app: EchoServer,
}

async fn pods(mesh: &Mesh) -> Pods {
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

/// Retries `probe` until `done` holds of its result (a change applies asynchronously).
async fn until<T: std::fmt::Debug, F: std::future::Future<Output = T>>(
    what: &str,
    mut probe: impl FnMut() -> F,
    done: impl Fn(&T) -> bool,
) {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let result = probe().await;
        if done(&result) {
            return;
        }
        assert!(Instant::now() < deadline, "{what}: still {result:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn status(reply: &Result<HttpReply, String>) -> Option<u16> {
    reply.as_ref().ok().map(|r| r.status)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mesh_configs_apply_to_running_pods_mesh_wide_and_per_namespace() {
    let config = tempfile::tempdir().unwrap();
    let dir = config.path().display().to_string();
    let mesh = Mesh::start_with_registrar(&[], &["--config-dir", &dir]).await;
    let p = pods(&mesh).await;
    let vip = mesh.vip("backend").await;
    let through_mesh = |delay: Option<&'static str>| {
        let url = format!("http://{vip}:{PORT}/api");
        let frontend = &p.frontend;
        async move {
            let headers: Vec<(&str, &str)> = delay.map(|d| (DELAY_HEADER, d)).into_iter().collect();
            frontend.http_request("GET", &url, None, &headers, "").await
        }
    };
    let app = format!("http://{}:{PORT}/direct", p.backend.ip());
    let direct = || p.outsider.http_get(&app, None);

    // The node's default: STRICT, allow, Envoy's 15 s per request.
    assert_eq!(status(&through_mesh(None).await), Some(200));
    assert!(direct().await.is_err(), "plaintext from outside the mesh is refused");
    assert_eq!(status(&through_mesh(Some("600")).await), Some(200));

    // Mesh-wide PERMISSIVE: the running backend's table follows, plaintext gets through.
    put_config(config.path(), "mesh.yaml", Some(MESH_PERMISSIVE));
    until("mesh-wide PERMISSIVE", direct, |r| r.is_ok()).await;

    // The namespace's own wins over the mesh's: STRICT again; and it denies by default,
    // and bounds requests to 300 ms.
    put_config(config.path(), "demo.yaml", Some(DEMO_LOCKED_DOWN));
    until("demo's default DENY", || through_mesh(None), |r| status(r) == Some(403)).await;
    until("demo's STRICT", direct, |r| r.is_err()).await;
    let status_page: serde_json::Value = serde_json::from_str(&mesh.agent_get("/debug/status").await).unwrap();
    let rows = status_page["pods"].as_array().unwrap();
    let backend = rows.iter().find(|r| r["pod"] == "demo/backend").unwrap();
    assert_eq!(backend["inbound_mtls"], "strict", "{backend}");
    let held: Vec<&str> = (status_page["mesh_configs"].as_array().unwrap().iter())
        .map(|c| c["key"].as_str().unwrap())
        .collect();
    assert_eq!(held, ["aether-system/default", "demo/default"]);
    let text = mesh.aether(&["status"]).await;
    assert!(
        text.contains("mesh       aether-system/default (mesh-wide, generation 0)  demo/default (generation 0)"),
        "{text}"
    );
    let explained = mesh
        .explain(
            "demo/frontend",
            &format!("http://backend.demo.aether.internal:{PORT}/api"),
        )
        .await;
    assert_eq!(explained["first"]["hop"], "authorization", "{explained:#}");
    let why = explained["first"]["why"].as_str().unwrap();
    assert!(
        why.contains("denies by default (MeshConfig defaultAction DENY)"),
        "{why}"
    );

    // An ALLOW policy for the frontend opens it again; the request timeout holds.
    put_config(config.path(), "allow.yaml", Some(ALLOW_FRONTEND));
    until("the ALLOW policy", || through_mesh(None), |r| status(r) == Some(200)).await;
    let slow = through_mesh(Some("1500")).await;
    assert_eq!(status(&slow), Some(504), "300 ms per request: {slow:?}");

    // Gone: the namespace falls back to the mesh-wide settings, then to the node's.
    put_config(config.path(), "demo.yaml", None);
    put_config(config.path(), "allow.yaml", None);
    until("demo's config removed", direct, |r| r.is_ok()).await;
    until(
        "the timeout removed",
        || through_mesh(Some("600")),
        |r| status(r) == Some(200),
    )
    .await;
    put_config(config.path(), "mesh.yaml", None);
    until("back to the node's STRICT", direct, |r| r.is_err()).await;
}

const MESH_DOMAIN: &str = "\
apiVersion: mesh.aether.io/v1alpha1
kind: MeshConfig
metadata: {name: default, namespace: aether-system}
spec:
  meshDomain: corp.internal
";

/// The mesh-wide MeshConfig's mesh domain: mesh-dns answers the same names under it and
/// Envoy routes them, next to the node's own domain, without a restart; removed, it is gone
/// and the node's own still answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_mesh_wide_mesh_domain_is_answered_next_to_the_nodes_own() {
    let config = tempfile::tempdir().unwrap();
    let dir = config.path().display().to_string();
    let mesh = Mesh::start_with_registrar(&[], &["--config-dir", &dir]).await;
    let p = pods(&mesh).await;
    let vip = mesh.vip("backend").await;
    let dns = MeshDns::start(&mesh.path("state/mesh-dns/records"));
    let by_name = |host: &'static str| {
        let frontend = &p.frontend;
        async move { frontend.http_get("http://127.0.0.1:18081/api", Some(host)).await }
    };
    let (own, alias) = ("backend.demo.aether.internal", "backend.demo.corp.internal");
    until(
        "the node's own domain",
        async || dns.dig_a(own),
        |a| *a == [vip.clone()],
    )
    .await;
    assert_eq!(dns.dig_a(alias), Vec::<String>::new(), "no alias yet");
    assert_eq!(status(&by_name("backend.demo.corp.internal:8080").await), Some(404));

    put_config(config.path(), "mesh.yaml", Some(MESH_DOMAIN));
    until(
        "mesh-dns answers the alias",
        async || dns.dig_a(alias),
        |a| *a == [vip.clone()],
    )
    .await;
    assert_eq!(
        dns.dig_a(own),
        std::slice::from_ref(&vip),
        "the node's own domain still answers"
    );
    let records: serde_json::Value =
        serde_json::from_slice(&std::fs::read(mesh.path("state/mesh-dns/records")).unwrap()).unwrap();
    assert_eq!(records["aliases"], serde_json::json!(["corp.internal"]), "{records}");
    until(
        "Envoy routes the alias name",
        || by_name("backend.demo.corp.internal:8080"),
        |r| status(r) == Some(200),
    )
    .await;
    assert_eq!(status(&by_name("backend.demo.aether.internal:8080").await), Some(200));
    let explained = mesh
        .explain("demo/frontend", "http://backend.demo.corp.internal:8080/api")
        .await;
    assert_eq!(explained["service"], "demo/backend", "{explained:#}");
    let text = mesh.aether(&["status"]).await;
    assert!(
        text.contains("aether-system/default (mesh-wide, domain corp.internal, generation 0)"),
        "{text}"
    );

    put_config(config.path(), "mesh.yaml", None);
    until(
        "the alias gone from mesh-dns",
        async || dns.dig_a(alias),
        |a| a.is_empty(),
    )
    .await;
    until(
        "the alias gone from Envoy",
        || by_name("backend.demo.corp.internal:8080"),
        |r| status(r) == Some(404),
    )
    .await;
    assert_eq!(dns.dig_a(own), [vip]);
}
