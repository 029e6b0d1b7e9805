//! The `aether` CLI end to end (as root): registrar, agent, a real Envoy and pods in network
//! namespaces. Each fault `explain` knows is injected for real and the verdict must name it;
//! `status` and `check` on a healthy node and with a component stopped.

use std::process::Output;
use std::time::{Duration, Instant};

use aether_tests::mesh::{APP, Mesh, MeshIdentity};
use aether_tests::{ChildGuard, Envoy, HttpReply, TestPod, binary, free_port, unique_base_id};
use serde_json::{Value, json};

/// A mesh whose agent knows where Envoy's admin is (the harness picks a free port).
async fn mesh() -> Mesh {
    mesh_with(MeshIdentity::DEFAULT).await
}

async fn mesh_with(identity: MeshIdentity) -> Mesh {
    let port = free_port();
    let admin = format!("127.0.0.1:{port}");
    with_envoy_admin(Mesh::start_identity(identity, &["--envoy-admin", &admin]).await, port)
}

/// A mesh whose registrar reads routes from `routes_dir`.
async fn mesh_with_routes(routes_dir: &std::path::Path) -> Mesh {
    let port = free_port();
    let admin = format!("127.0.0.1:{port}");
    let dir = routes_dir.display().to_string();
    let mesh = Mesh::start_with_registrar(&["--envoy-admin", &admin], &["--routes-dir", &dir]).await;
    with_envoy_admin(mesh, port)
}

/// Restarts the mesh's Envoy with its admin on `port`, where the agent reads it.
fn with_envoy_admin(mut mesh: Mesh, port: u16) -> Mesh {
    mesh.envoy = None;
    mesh.envoy = Some(Envoy::start(&mesh.envoy_bootstrap(port), unique_base_id()));
    mesh
}

/// `aether <args>` against the mesh's agent, on a node whose CNI config chains aether-cni.
async fn aether(mesh: &Mesh, args: &[&str]) -> (i32, String) {
    let out: Output = tokio::process::Command::new(binary("aether"))
        .args(["--agent", &mesh.agent_admin.to_string()])
        .args(["--cni-conf-dir", &cni_conf_dir(mesh)])
        .args(args)
        .output()
        .await
        .expect("running aether");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    (out.status.code().unwrap_or(-1), format!("{stdout}{stderr}"))
}

async fn explain(mesh: &Mesh, pod: &str, target: &str) -> (i32, Value) {
    explain_args(mesh, &[pod, target]).await
}

/// `aether -o json explain <args>`.
async fn explain_args(mesh: &Mesh, args: &[&str]) -> (i32, Value) {
    let (code, out) = aether(mesh, &[&["-o", "json", "explain"], args].concat()).await;
    let json = serde_json::from_str(&out).unwrap_or_else(|e| panic!("explain {args:?}: {e}: {out}"));
    (code, json)
}

/// Explains until the verdict names `want` (hop, status), or is ok for `None` (faults land
/// asynchronously).
async fn explain_until(mesh: &Mesh, pod: &str, target: &str, want: Option<(&str, &str)>) -> (i32, Value) {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let (code, e) = explain(mesh, pod, target).await;
        let named = match want {
            Some((hop, status)) => e["first"]["hop"] == hop && e["first"]["status"] == status,
            None => e["verdict"] == "ok",
        };
        if named {
            return (code, e);
        }
        assert!(
            Instant::now() < deadline,
            "explain {pod} {target} never named {want:?}: {e:#}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn why(e: &Value) -> &str {
    e["first"]["why"].as_str().unwrap_or_default()
}

/// backend and lonely (both serving), frontend calling both (it has called backend once),
/// other calling nothing and not called by anyone.
async fn pods(mesh: &Mesh) -> Vec<(TestPod, aether_tests::HttpServer)> {
    let mut pods = Vec::new();
    for (name, upstreams) in [
        ("backend", ""),
        ("lonely", ""),
        ("other", ""),
        ("frontend", "backend, lonely"),
    ] {
        let pod = mesh.node.add_pod(name);
        let app = pod.serve_http(APP.parse().unwrap(), name);
        mesh.describe_pod(&pod, name, name, upstreams, &[("http", 8080)]);
        mesh.add_pod_ok(&pod, name).await;
        pods.push((pod, app));
    }
    call_until(mesh, &pods[3].0, "/", 200).await;
    pods
}

/// Registers `service` at `pod`'s IP as another node's agent would (a pod elsewhere, running
/// as service account `account`).
async fn stand_in(mesh: &Mesh, service: &str, pod: &TestPod, account: &str) {
    use aether_proto::registry::v1::{Endpoint, PodInfo, Port, Protocol};
    let endpoint = Endpoint {
        service: format!("demo/{service}"),
        address: pod.ip().to_string(),
        ports: vec![Port {
            name: "http".into(),
            port: 8080,
            protocol: Protocol::Http as i32,
        }],
        node: "other-node".into(),
        pod: Some(PodInfo {
            namespace: "demo".into(),
            name: format!("{service}-elsewhere"),
            uid: String::new(),
            service_account: account.into(),
        }),
        ..Default::default()
    };
    let request = aether_proto::registrar::v1::RegisterEndpointRequest {
        endpoint: Some(endpoint),
    };
    mesh.registrar_as("other-node")
        .await
        .register_endpoint(request)
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_healthy_call_is_ok_at_every_hop() {
    let mesh = mesh().await;
    let _pods = pods(&mesh).await;
    // other has never called anything: its capture rules have counted nothing, a warning.
    let (code, e) = explain_until(&mesh, "demo/other", "backend", Some(("capture", "warn"))).await;
    assert_eq!(code, 4);
    assert!(why(&e).contains("captured no connection yet"), "{e:#}");
    let (code, e) = explain_until(
        &mesh,
        "demo/frontend",
        "http://backend.demo.aether.internal:8080/",
        None,
    )
    .await;
    assert_eq!((code, e["verdict"].as_str()), (0, Some("ok")), "{e:#}");
    for hop in e["hops"].as_array().unwrap() {
        assert_eq!(hop["status"], "ok", "{hop}");
    }
    assert_eq!(e["hops"][11]["why"], "no ALLOW policy selects the target");
    assert!(e["hops"][4]["why"].as_str().unwrap().contains("they captured"), "{e:#}");
    assert_eq!(
        e["hops"][7]["why"],
        "no route attached: default routing (retries, outlier ejection)"
    );
    let (code, text) = aether(&mesh, &["explain", "frontend", "-n", "demo", "backend:8080"]).await;
    assert_eq!(code, 0, "{text}");
    assert!(text.contains("verdict: ok: every hop is ok"), "{text}");
    assert!(text.contains("backend.demo.aether.internal resolves to 240."), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_names_each_fault_injected_on_a_live_node() {
    let mut mesh = mesh().await;
    let pods = pods(&mesh).await;
    let (frontend, lonely) = (&pods[3].0, &pods[1].0);

    let (code, e) = explain(&mesh, "demo/nobody", "backend").await;
    assert_eq!((code, e["first"]["hop"].as_str()), (1, Some("pod")), "{e:#}");
    assert!(why(&e).contains("not a pod this node's agent manages"));

    // No upstreams declaration: reachable on demand, and explain says so (exit 4: a warning).
    stand_in(&mesh, "remote", &pods[2].0, "remote").await;
    let (code, e) = explain_until(&mesh, "demo/frontend", "remote", Some(("upstreams", "warn"))).await;
    assert_eq!(code, 4);
    assert!(why(&e).contains("reachable on demand"), "{e:#}");

    // A service with no endpoints: its only pod is gone.
    mesh.remove_pod(lonely, "lonely").await.expect("RemovePod");
    let (code, e) = explain_until(&mesh, "demo/frontend", "lonely", Some(("endpoints", "fail"))).await;
    assert_eq!(code, 1);
    assert!(why(&e).contains("has no endpoints"), "{e:#}");

    // The mesh-dns record missing from the record file mesh-dns serves.
    let records = mesh.path("state/mesh-dns/records");
    let original = std::fs::read(&records).unwrap();
    let mut file: Value = serde_json::from_slice(&original).unwrap();
    file["records"].as_object_mut().unwrap().remove("demo/backend");
    std::fs::write(&records, serde_json::to_vec(&file).unwrap()).unwrap();
    let (_, e) = explain_until(&mesh, "demo/frontend", "backend", Some(("dns", "fail"))).await;
    assert!(why(&e).contains("no record for backend.demo.aether.internal"), "{e:#}");
    std::fs::write(&records, original).unwrap();

    // The capture rule removed from the pod's netns.
    frontend.exec_ok(&["nft", "delete", "table", "inet", "aether"]);
    let (_, e) = explain_until(&mesh, "demo/frontend", "backend", Some(("capture", "fail"))).await;
    assert!(
        why(&e).contains("capture rules in the pod's netns are missing or changed"),
        "{e:#}"
    );
    let desired = mesh.path(&format!("state/capture/sandbox-{}.nft", frontend.netns_name()));
    frontend.exec_ok(&["nft", "-f", desired.to_str().unwrap()]);
    // Restored, its counter starts again from zero, and counts the next call.
    explain_until(&mesh, "demo/frontend", "backend", Some(("capture", "warn"))).await;
    call_until(&mesh, frontend, "/", 200).await;
    explain_until(&mesh, "demo/frontend", "backend", None).await;

    // A SAN mismatch: an endpoint of backend is a pod (other's IP) that runs as another
    // service account than the registration says.
    stand_in(&mesh, "backend", &pods[2].0, "backend").await;
    let (_, e) = explain_until(&mesh, "demo/frontend", "backend", Some(("identity", "fail"))).await;
    assert!(
        why(&e).contains("SAN mismatch: destination pod demo/other presents spiffe://aether.test/ns/demo/sa/other"),
        "{e:#}"
    );

    let request = aether_proto::registrar::v1::UnregisterEndpointRequest {
        service: "demo/backend".into(),
        address: pods[2].0.ip().to_string(),
    };
    mesh.registrar_as("other-node")
        .await
        .unregister_endpoint(request)
        .await
        .unwrap();
    explain_until(&mesh, "demo/frontend", "backend", None).await;

    registrar_down_is_named(&mut mesh).await;
}

/// The registrar stream down: named by explain (and an on-demand lookup can no longer be
/// answered), by status and by check.
async fn registrar_down_is_named(mesh: &mut Mesh) {
    mesh.registrar.terminate();
    let (code, e) = explain_until(mesh, "demo/frontend", "backend", Some(("registrar", "warn"))).await;
    assert_eq!(code, 4);
    assert!(why(&e).contains("catalog watch on the registrar is down"), "{e:#}");
    let (code, e) = explain_until(mesh, "demo/frontend", "remote", Some(("upstreams", "fail"))).await;
    assert_eq!(code, 1);
    assert!(why(&e).contains("registrar is unreachable"), "{e:#}");
    let (code, text) = aether(mesh, &["status"]).await;
    assert_eq!(code, 1, "{text}");
    assert!(text.contains("the registrar watch is down"), "{text}");
    let (code, text) = aether(mesh, &["check"]).await;
    assert_eq!(code, 1, "{text}");
    assert!(
        text.lines()
            .any(|l| l.starts_with("FAIL") && l.contains("registrar reachable")),
        "{text}"
    );
}

/// A CNI config dir whose conflist chains aether-cni last, as `aether-cni install` leaves it (written once: a
/// test may break it).
fn cni_conf_dir(mesh: &Mesh) -> String {
    let dir = mesh.path("net.d");
    std::fs::create_dir_all(&dir).unwrap();
    let conflist = r#"{"cniVersion":"1.0.0","name":"k8s","plugins":[{"type":"bridge"},{"type":"aether-cni"}]}"#;
    let file = dir.join("10-k8s.conflist");
    if !file.exists() {
        std::fs::write(file, conflist).unwrap();
    }
    dir.display().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_and_check_on_a_healthy_node_then_with_envoy_then_the_agent_stopped() {
    let mut mesh = mesh().await;
    let _pods = pods(&mesh).await;
    let net_d = cni_conf_dir(&mesh);

    let (code, text) = aether(&mesh, &["status"]).await;
    assert_eq!(code, 0, "{text}");
    assert!(text.contains("LIVE  1.40"), "{text}");
    assert!(text.contains("cni        PASS "), "{text}");
    assert!(text.contains("10-k8s.conflist: bridge → aether-cni"), "{text}");
    let (_, json) = aether(&mesh, &["status", "-o", "json"]).await;
    let status: Value = serde_json::from_str(&json).unwrap();
    let pods = status["pods"].as_array().unwrap();
    assert_eq!(pods.len(), 4, "{status:#}");
    assert!(
        pods.iter().all(|p| p["capture"] == "intact" && p["served"] == true),
        "{status:#}"
    );
    assert!(
        pods.iter().all(|p| p["svid_expires_in_seconds"].as_i64() > Some(0)),
        "{status:#}"
    );
    let frontend = pods.iter().find(|p| p["pod"] == "demo/frontend").unwrap();
    assert!(frontend["captured_connections"].as_u64() >= Some(1), "{status:#}");
    registrar_version_reaches_the_head(&mesh).await;
    errors_are_counted(&mesh).await;

    let (code, text) = aether(&mesh, &["check"]).await;
    assert_eq!(code, 0, "{text}");
    for name in [
        "agent ready",
        "kernel nftables",
        "envoy live",
        "envoy version",
        "registrar reachable",
        "ca/svid validity",
        "cni conflist chain",
    ] {
        assert!(
            text.lines().any(|l| l.starts_with("PASS") && l.contains(name)),
            "{name}: {text}"
        );
    }

    let (code, text) = aether(&mesh, &["proxy-config", "demo/frontend", "clusters"]).await;
    assert_eq!(code, 0, "{text}");
    assert!(text.contains("backend.demo.aether.internal:8080"), "{text}");
    let (_, text) = aether(&mesh, &["proxy-config", "demo/frontend", "secrets"]).await;
    assert!(text.contains("spiffe://aether.test/ns/demo/sa/frontend"), "{text}");
    let (_, text) = aether(&mesh, &["proxy-config", "demo/frontend", "endpoints"]).await;
    assert!(text.contains("true"), "{text}");

    an_unchained_cni_is_named(&mesh, &net_d).await;

    mesh.envoy = None;
    let (code, text) = aether(&mesh, &["status"]).await;
    assert_eq!(code, 1, "{text}");
    assert!(text.contains("Envoy unreachable"), "{text}");
    let (code, text) = aether(&mesh, &["check"]).await;
    assert_eq!(code, 1, "{text}");
    assert!(
        text.lines().any(|l| l.starts_with("FAIL") && l.contains("envoy live")),
        "{text}"
    );

    mesh.agent = None;
    let (code, text) = aether(&mesh, &["status"]).await;
    assert_eq!(code, 3, "{text}");
    assert!(text.contains("cannot reach the agent's admin API"), "{text}");
}

/// The conflist no longer chains aether-cni: status names it (pods would start uncaptured).
async fn an_unchained_cni_is_named(mesh: &Mesh, net_d: &str) {
    let conflist = std::path::Path::new(net_d).join("10-k8s.conflist");
    let chained = std::fs::read(&conflist).unwrap();
    let unchained = r#"{"cniVersion":"1.0.0","name":"k8s","plugins":[{"type":"bridge"}]}"#;
    std::fs::write(&conflist, unchained).unwrap();
    let (code, text) = aether(mesh, &["status"]).await;
    assert_eq!(code, 1, "{text}");
    assert!(text.contains("CNI: ") && text.contains("aether-cni"), "{text}");
    std::fs::write(&conflist, chained).unwrap();
}

/// The watch's version catches up with the registrar's head: changes outside the node's
/// filter (other pods' registrations) are confirmed by the registrar's progress note.
async fn registrar_version_reaches_the_head(mesh: &Mesh) {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let (_, json) = aether(mesh, &["status", "-o", "json"]).await;
        let status: Value = serde_json::from_str(&json).unwrap();
        let r = &status["registrar"];
        let (version, head) = (r["version"].as_str().unwrap(), r["head"].as_str().unwrap());
        if r["behind"] == 0 {
            assert_eq!(version, head, "{r}");
            break;
        }
        assert!(r["behind"].as_u64() > Some(0), "{r}");
        assert!(Instant::now() < deadline, "the watch never reached the head: {r}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let (_, text) = aether(mesh, &["status"]).await;
    assert!(text.contains(" 0 behind head  updated "), "{text}");
}

/// A destination pod on another node presenting an identity its registration does not
/// name: explain asks it (a TLS handshake as frontend) and names the mismatch; stopped,
/// it cannot be asked, a warning.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_asks_destination_pods_on_other_nodes_who_they_are() {
    let mesh = mesh().await;
    let pods = pods(&mesh).await;
    // Not managed by this node's agent: stands for a pod elsewhere, its inbound listener
    // (:18008) presenting an SVID of service account impostor from the mesh's CA.
    let elsewhere = mesh.node.add_pod("elsewhere");
    let dir = tempfile::tempdir().unwrap();
    let (cert, key) = mesh
        .ca
        .issue("spiffe://aether.test/ns/demo/sa/impostor", Duration::from_secs(600))
        .write(dir.path(), "impostor");
    let (ca, _) = mesh.ca.write(&dir.path().join("ca"));
    let mut server = elsewhere.command("openssl");
    server
        .arg("s_server")
        .args(["-accept", "18008", "-alpn", "h2", "-Verify", "1", "-quiet"]);
    server
        .arg("-cert")
        .arg(&cert)
        .arg("-key")
        .arg(&key)
        .arg("-CAfile")
        .arg(&ca);
    let tls_server = ChildGuard::spawn("openssl s_server", server);
    stand_in(&mesh, "backend", &elsewhere, "backend").await;

    let (_, e) = explain_until(&mesh, "demo/frontend", "backend", Some(("identity", "fail"))).await;
    let mismatch = format!(
        "SAN mismatch: destination pod {} on node other-node presents spiffe://aether.test/ns/demo/sa/impostor, but callers pin spiffe://aether.test/ns/demo/sa/backend",
        elsewhere.ip()
    );
    assert_eq!(why(&e), mismatch, "{e:#}");

    drop(tls_server);
    let (code, e) = explain_until(&mesh, "demo/frontend", "backend", Some(("identity", "warn"))).await;
    assert_eq!(code, 4);
    let unasked = format!(
        "destination pod {} on node other-node could not be asked who it is",
        elsewhere.ip()
    );
    assert!(why(&e).starts_with(&unasked), "{e:#}");
    drop(pods);
}

/// A refused CNI call shows in status's error counts.
async fn errors_are_counted(mesh: &Mesh) {
    let status = |text: String| serde_json::from_str::<Value>(&text).unwrap();
    let before = status(aether(mesh, &["status", "-o", "json"]).await.1);
    assert_eq!(
        before["errors"],
        json!({"cni_calls_failed": 0, "identity": 0, "dns_record_writes": 0, "envoy_stats_reads": 0}),
        "{before:#}"
    );
    let bad = aether_proto::cni::v1::AddPodRequest {
        container_id: "../not-a-container".into(),
        ..Default::default()
    };
    let refused = mesh.cni().await.add_pod(bad).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused}");
    let after = status(aether(mesh, &["status", "-o", "json"]).await.1);
    assert_eq!(after["errors"]["cni_calls_failed"], 1, "{after:#}");
    let (_, text) = aether(mesh, &["status"]).await;
    assert!(text.contains("errors     cni calls 1  identity 0"), "{text}");
}

fn uid(pod: &TestPod) -> String {
    format!("uid-{}", pod.netns_name())
}

/// SVID faults with SPIRE as the provider: a destination presenting an identity its callers
/// do not pin, the source's SVID expired while SPIRE is away, and revoked (missing).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_names_svid_faults() {
    let mesh = mesh_with(MeshIdentity::Spire {
        ttl: Duration::from_secs(600),
    })
    .await;
    let (frontend, backend, _apps) = mesh.frontend_and_backend().await;
    let spire = mesh.spire.as_ref().unwrap();
    call_until(&mesh, &frontend, "/", 200).await;
    explain_until(&mesh, "demo/frontend", "backend", None).await;

    spire.issue_as(&uid(&backend), "spiffe://aether.test/ns/demo/sa/impostor");
    let (_, e) = explain_until(&mesh, "demo/frontend", "backend", Some(("identity", "fail"))).await;
    assert!(
        why(&e)
            .contains("SAN mismatch: destination pod demo/backend presents spiffe://aether.test/ns/demo/sa/impostor"),
        "{e:#}"
    );
    spire.issue_as(&uid(&backend), "spiffe://aether.test/ns/demo/sa/backend");
    explain_until(&mesh, "demo/frontend", "backend", None).await;

    spire.set_ttl(Duration::from_secs(2));
    spire.rotate_all();
    tokio::time::sleep(Duration::from_millis(500)).await;
    spire.break_streams();
    let (_, e) = explain_until(&mesh, "demo/frontend", "backend", Some(("identity", "fail"))).await;
    assert!(
        why(&e).contains("demo/frontend's SVID spiffe://aether.test/ns/demo/sa/frontend expired"),
        "{e:#}"
    );

    spire.set_ttl(Duration::from_secs(600));
    spire.restore();
    explain_until(&mesh, "demo/frontend", "backend", None).await;
    // Revoked: the agent withdraws the pod's listeners, and the listener hop names why.
    spire.revoke(&uid(&frontend));
    let (_, e) = explain_until(&mesh, "demo/frontend", "backend", Some(("listener", "fail"))).await;
    assert!(
        why(&e).contains("the agent withholds the pod's listeners: demo/frontend has no SVID"),
        "{e:#}"
    );
}

/// With mesh-dns on the node, explain asks it: its answer, a record it lacks, its silence.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_asks_mesh_dns() {
    let mut mesh = mesh().await;
    let dns_addr = format!("{}:{}", mesh.node.gateway(), free_port());
    mesh.agent = None;
    mesh.agent_args.extend(["--mesh-dns".into(), dns_addr.clone()]);
    mesh.start_agent().await;
    let records = mesh.path("state/mesh-dns/records");
    let mut cmd = std::process::Command::new(binary("aether-mesh-dns"));
    cmd.args(["--listen", &dns_addr, "--admin", &format!("127.0.0.1:{}", free_port())])
        .arg("--records")
        .arg(&records)
        .args(["--upstream", "127.0.0.1:9"]);
    let dns = ChildGuard::spawn("mesh-dns", cmd);
    let (frontend, _backend, _apps) = mesh.frontend_and_backend().await;
    call_until(&mesh, &frontend, "/", 200).await;

    let (_, e) = explain_until(&mesh, "demo/frontend", "backend", None).await;
    let answered = format!("mesh-dns at {dns_addr} answers backend.demo.aether.internal with 240.");
    assert!(e["hops"][3]["why"].as_str().unwrap().starts_with(&answered), "{e:#}");

    let mut file: Value = serde_json::from_slice(&std::fs::read(&records).unwrap()).unwrap();
    file["records"].as_object_mut().unwrap().remove("demo/backend");
    std::fs::write(&records, serde_json::to_vec(&file).unwrap()).unwrap();
    let (_, e) = explain_until(&mesh, "demo/frontend", "backend", Some(("dns", "fail"))).await;
    assert!(
        why(&e).contains(&format!("mesh-dns at {dns_addr} has no record for backend.demo")),
        "{e:#}"
    );

    drop(dns);
    let (_, e) = explain_until(&mesh, "demo/frontend", "backend", Some(("dns", "fail"))).await;
    assert!(why(&e).contains("did not answer"), "{e:#}");
    let (code, text) = aether(&mesh, &["check"]).await;
    assert_eq!(code, 1, "{text}");
    assert!(
        text.lines()
            .any(|l| l.starts_with("FAIL") && l.contains("mesh-dns answering")),
        "{text}"
    );
}

/// backend's `/api` goes to lonely (rule "api"); `x-env: canary` stays on backend.
const BACKEND_ROUTE: &str = r#"
apiVersion: gateway.networking.k8s.io/v1
kind: HTTPRoute
metadata:
  name: backend-api
  namespace: demo
spec:
  parentRefs:
  - {group: "", kind: Service, name: backend, port: 8080}
  rules:
  - name: api
    matches:
    - path: {type: PathPrefix, value: /api}
    backendRefs:
    - {name: lonely, port: 8080}
  - matches:
    - headers:
      - {name: x-env, value: canary}
    backendRefs:
    - {name: backend, port: 8080}
"#;

/// Explains until the route hop's why contains `words` (routes land asynchronously).
async fn explain_route_until(mesh: &Mesh, args: &[&str], words: &str) -> (i32, Value) {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let (code, e) = explain_args(mesh, args).await;
        if e["hops"][7]["why"].as_str().is_some_and(|why| why.contains(words)) {
            return (code, e);
        }
        assert!(
            Instant::now() < deadline,
            "explain {args:?} never said {words:?}: {e:#}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The newest failed call explain reports from `pod` to `target`, once Envoy logged one.
async fn failure_until(mesh: &Mesh, pod: &str, target: &str) -> Value {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let (_, e) = explain(mesh, pod, target).await;
        if let Some(failure) = e["recent_failures"].get(0) {
            return failure.clone();
        }
        assert!(Instant::now() < deadline, "no failed call reported: {e:#}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// GET `path` on backend from `pod`, once Envoy answers it with `status`.
async fn call_until(mesh: &Mesh, pod: &TestPod, path: &str, status: u16) -> HttpReply {
    let url = format!("http://{}:8080{path}", mesh.vip("backend").await);
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        match pod.http_get(&url, Some("backend.demo.aether.internal:8080")).await {
            Ok(reply) if reply.status == status => return reply,
            other => assert!(
                Instant::now() < deadline,
                "GET {path} never answered {status}: {other:?}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// With a route on backend: explain names the rule a URL takes (and Envoy sends the call
/// there), the rule a header selects, and the 404 of a URL no rule matches.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_names_the_route_rule_a_url_takes() {
    let routes = tempfile::tempdir().unwrap();
    let mesh = mesh_with_routes(routes.path()).await;
    let pods = pods(&mesh).await;
    let frontend = &pods[3].0;
    explain_until(&mesh, "demo/frontend", "backend", None).await;
    let partial = routes.path().join(".backend-api.yaml.partial");
    std::fs::write(&partial, BACKEND_ROUTE).unwrap();
    std::fs::rename(&partial, routes.path().join("backend-api.yaml")).unwrap();

    let url = "http://backend.demo.aether.internal:8080";
    let api = format!("{url}/api/items?page=2");
    let (code, e) = explain_route_until(&mesh, &["demo/frontend", &api], "takes route").await;
    assert_eq!((code, e["verdict"].as_str()), (0, Some("ok")), "{e:#}");
    assert_eq!(
        e["hops"][7]["why"],
        "GET /api/items?page=2 takes route http/demo/backend-api rule 0 (api): demo/lonely:8080"
    );
    assert_eq!(e["route"]["matched"]["rule_name"], "api", "{e:#}");
    assert_eq!(
        call_until(&mesh, frontend, "/api/items", 200).await.json()["pod"],
        "lonely"
    );

    let other = format!("{url}/other");
    let canary = ["demo/frontend", &other, "-H", "x-env: canary"];
    let (code, e) = explain_args(&mesh, &canary).await;
    assert_eq!(code, 0, "{e:#}");
    assert_eq!(
        e["hops"][7]["why"],
        "GET /other [x-env: canary] takes route http/demo/backend-api rule 1: demo/backend:8080"
    );

    let (code, e) = explain(&mesh, "demo/frontend", &other).await;
    assert_eq!((code, e["first"]["hop"].as_str()), (1, Some("route")), "{e:#}");
    assert_eq!(why(&e), "404: no rule of http/demo/backend-api matches GET /other");
    call_until(&mesh, frontend, "/other", 404).await;
    // Envoy logged the failed call to the agent: explain shows it beside the hops (the
    // compiled table's own 404, so no response flag).
    let failure = failure_until(&mesh, "demo/frontend", &other).await;
    assert_eq!(
        (&failure["status"], &failure["flags"], &failure["details"]),
        (&json!(404), &json!(""), &json!("direct_response")),
        "{failure:#}"
    );
    assert_eq!(
        (&failure["method"], &failure["authority"], &failure["path"]),
        (
            &json!("GET"),
            &json!("backend.demo.aether.internal:8080"),
            &json!("/other")
        ),
    );
    let (code, text) = aether(&mesh, &["explain", "frontend", "-n", "demo", &other, "-X", "post"]).await;
    assert_eq!(code, 1, "{text}");
    assert!(
        text.contains("last failed calls to the target (Envoy's access log):"),
        "{text}"
    );
    let logged = |l: &&str| {
        [
            "GET backend.demo.aether.internal:8080/other",
            " 404 ",
            " - ",
            "direct_response",
        ]
        .iter()
        .all(|w| l.contains(w))
    };
    assert!(text.lines().any(|l| logged(&l)), "{text}");
    assert!(
        text.contains("verdict: FAIL at route: 404: no rule of http/demo/backend-api matches POST /other"),
        "{text}"
    );
    assert!(text.contains("fix: add a rule or a PathPrefix / match"), "{text}");
}
