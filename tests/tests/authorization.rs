//! Authorization end to end (as root): AuthorizationPolicy YAML in the registrar's config
//! directory is projected, stored and streamed to the agent, which compiles it into RBAC
//! on the destination pod's inbound listener of a real Envoy. Callers are pods in network
//! namespaces presenting their own SVIDs.

use std::path::Path;
use std::time::{Duration, Instant};

use aether_tests::TestPod;
use aether_tests::mesh::{APP, Mesh, MeshIdentity, NodeIdentity, put_config};

/// frontend and other both call backend; only frontend's identity is allowed by the policy.
const ALLOW_FRONTEND: &str = "\
apiVersion: security.aether.io/v1alpha1
kind: AuthorizationPolicy
metadata: {name: backend-api, namespace: demo}
spec:
  targetRefs: [{kind: Service, name: backend}]
  action: ALLOW
  rules:
    - from: [{source: {serviceAccounts: [demo/frontend]}}]
      to: [{operation: {methods: [GET], paths: [/api/*]}}]
";

/// A DENY wins over the ALLOW above for one path.
const DENY_SECRET: &str = "\
apiVersion: security.aether.io/v1alpha1
kind: AuthorizationPolicy
metadata: {name: no-secrets, namespace: demo}
spec:
  targetRefs: [{kind: Service, name: backend}]
  action: DENY
  rules:
    - to: [{operation: {paths: [/api/secret]}}]
";

/// Logs requests for items, changing nothing.
const AUDIT_ITEMS: &str = "\
apiVersion: security.aether.io/v1alpha1
kind: AuthorizationPolicy
metadata: {name: watch-items, namespace: demo}
spec:
  targetRefs: [{kind: Service, name: backend}]
  action: AUDIT
  rules:
    - to: [{operation: {paths: [/api/items]}}]
";

/// A DENY being tried out: logged as what it would deny, enforced never.
const DRY_RUN_DENY_ITEMS: &str = "\
apiVersion: security.aether.io/v1alpha1
kind: AuthorizationPolicy
metadata: {name: next-deny, namespace: demo}
spec:
  targetRefs: [{kind: Service, name: backend}]
  action: DENY
  dryRun: true
  rules:
    - from: [{source: {serviceAccounts: [demo/frontend]}}]
      to: [{operation: {paths: [/api/items]}}]
";

struct Callers {
    frontend: TestPod,
    other: TestPod,
    _pods: Vec<TestPod>,
    _apps: Vec<aether_tests::HttpServer>,
}

async fn callers(mesh: &Mesh) -> Callers {
    let mut pods = Vec::new();
    let mut apps = Vec::new();
    for (name, upstreams) in [("backend", ""), ("frontend", "backend"), ("other", "backend")] {
        let pod = mesh.node.add_pod(name);
        apps.push(pod.serve_http(APP.parse().unwrap(), name));
        mesh.describe_pod(&pod, name, name, upstreams, &[("http", 8080)]);
        mesh.add_pod_ok(&pod, name).await;
        pods.push(pod);
    }
    let other = pods.pop().unwrap();
    let frontend = pods.pop().unwrap();
    Callers {
        frontend,
        other,
        _pods: pods,
        _apps: apps,
    }
}

/// `method path` from `pod` to backend through the mesh, until Envoy answers `status`
/// (a policy change takes effect asynchronously).
async fn until(mesh: &Mesh, pod: &TestPod, method: &str, path: &str, status: u16) {
    let url = format!("http://{}:8080{path}", mesh.vip("backend").await);
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let reply = pod.http_request(method, &url, None, &[], "").await;
        match &reply {
            Ok(r) if r.status == status => return,
            _ => assert!(
                Instant::now() < deadline,
                "{} {method} {path}: never {status}: {reply:?}",
                pod.name()
            ),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// AUDIT and dry-run never change the answer; both are logged.
async fn audit_and_dry_run_change_nothing_and_are_logged(mesh: &Mesh, config: &Path, frontend: &TestPod) {
    put_config(config, "audit.yaml", Some(AUDIT_ITEMS));
    put_config(config, "dry-run.yaml", Some(DRY_RUN_DENY_ITEMS));
    let seen = [
        ["verdict=\"audit\"", "policy=demo/watch-items rule=0"],
        ["verdict=\"dry_run_deny\"", "policy=demo/next-deny rule=0"],
    ];
    for parts in seen {
        let deadline = Instant::now() + Duration::from_secs(15);
        while !has_line(mesh, &parts) {
            assert_eq!(now(mesh, frontend, "GET", "/api/items").await, 200);
            assert!(Instant::now() < deadline, "never logged: {parts:?}");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    put_config(config, "audit.yaml", None);
    put_config(config, "dry-run.yaml", None);
}

/// Waits (up to 5 s: Envoy ships its log every 100 ms) for an agent log line with all of `parts`.
async fn logged(mesh: &Mesh, parts: &[&str]) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        if has_line(mesh, parts) {
            return;
        }
        let logs = mesh.agent.as_ref().unwrap().logs();
        let decisions: Vec<&str> = logs.lines().filter(|l| l.contains("authorization:")).collect();
        assert!(
            Instant::now() < deadline,
            "no agent log line with {parts:?}; decisions logged: {decisions:#?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn has_line(mesh: &Mesh, parts: &[&str]) -> bool {
    let logs = mesh.agent.as_ref().unwrap().logs();
    logs.lines().any(|line| parts.iter().all(|p| line.contains(p)))
}

/// Answered `status` now (after `until` has seen the policy in force).
async fn now(mesh: &Mesh, pod: &TestPod, method: &str, path: &str) -> u16 {
    let url = format!("http://{}:8080{path}", mesh.vip("backend").await);
    let reply = pod.http_request(method, &url, None, &[], "").await;
    reply
        .unwrap_or_else(|e| panic!("{} {method} {path}: {e}", pod.name()))
        .status
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allow_and_deny_policies_are_enforced_at_the_destination_by_identity_method_and_path() {
    let config = tempfile::tempdir().unwrap();
    let dir = config.path().display().to_string();
    let mesh = Mesh::start_with_registrar(&[], &["--config-dir", &dir]).await;
    let c = callers(&mesh).await;
    // No policy selects backend: everyone is allowed.
    until(&mesh, &c.frontend, "GET", "/api/items", 200).await;
    until(&mesh, &c.other, "POST", "/anything", 200).await;

    // ALLOW: only frontend's identity, only GET under /api/.
    put_config(config.path(), "allow.yaml", Some(ALLOW_FRONTEND));
    until(&mesh, &c.other, "GET", "/api/items", 403).await;
    until(&mesh, &c.frontend, "POST", "/api/items", 403).await;
    assert_eq!(now(&mesh, &c.frontend, "GET", "/api/items").await, 200);
    assert_eq!(now(&mesh, &c.frontend, "GET", "/admin").await, 403);
    assert_eq!(now(&mesh, &c.other, "POST", "/anything").await, 403);
    // The agent logs the denial with the caller's identity, the pod and the port.
    logged(
        &mesh,
        &[
            "authorization: no ALLOW policy selecting the pod matched",
            "verdict=\"deny\"",
            "source=spiffe://aether.test/ns/demo/sa/other",
            "pod=demo/backend",
            "port=8080",
            "method=POST path=/anything",
        ],
    )
    .await;

    // DENY wins over a matching ALLOW; the line and the counter name the policy and rule.
    put_config(config.path(), "deny.yaml", Some(DENY_SECRET));
    until(&mesh, &c.frontend, "GET", "/api/secret", 403).await;
    assert_eq!(now(&mesh, &c.frontend, "GET", "/api/items").await, 200);
    logged(
        &mesh,
        &[
            "authorization: policy demo/no-secrets rule 0",
            "source=spiffe://aether.test/ns/demo/sa/frontend",
        ],
    )
    .await;
    let metrics = mesh.agent_get("/metrics").await;
    let denied = r#"aether_agent_authorization_decisions_total{pod="demo/backend",policy="demo/no-secrets",rule="0",decision="deny"}"#;
    assert!(metrics.contains(denied), "{metrics}");
    // `aether explain` stops at the authorization hop and names the policy and rule.
    let explained = mesh
        .explain("demo/frontend", "http://backend.demo.aether.internal:8080/api/secret")
        .await;
    assert_eq!(explained["first"]["hop"], "authorization", "{explained:#}");
    assert_eq!(explained["first"]["status"], "fail", "{explained:#}");
    let why = explained["first"]["why"].as_str().unwrap();
    assert!(why.contains("policy demo/no-secrets rule 0"), "{why}");

    audit_and_dry_run_change_nothing_and_are_logged(&mesh, config.path(), &c.frontend).await;

    // Policies removed: allowed again.
    put_config(config.path(), "allow.yaml", None);
    put_config(config.path(), "deny.yaml", None);
    until(&mesh, &c.other, "GET", "/api/items", 200).await;
    until(&mesh, &c.frontend, "GET", "/api/secret", 200).await;
}

/// Only the client's identity may open connections to cache's TCP port.
const CACHE_CLIENT_ONLY: &str = "\
apiVersion: security.aether.io/v1alpha1
kind: AuthorizationPolicy
metadata: {name: cache-clients, namespace: demo}
spec:
  targetRefs: [{kind: Service, name: cache}]
  rules:
    - from: [{source: {serviceAccounts: [demo/client]}}]
";

/// A greeting and one echo over plain TCP to `target` from `pod`, or the error.
fn tcp_round_trip(pod: &TestPod, target: std::net::SocketAddr) -> std::io::Result<String> {
    pod.run(move || {
        use std::io::{BufRead, BufReader, Write};
        let stream = std::net::TcpStream::connect_timeout(&target, Duration::from_secs(5))?;
        stream.set_read_timeout(Some(Duration::from_secs(5)))?;
        let mut reader = BufReader::new(stream.try_clone()?);
        (&stream).write_all(b"ping\n")?;
        let mut greeting = String::new();
        reader.read_line(&mut greeting)?;
        let mut echo = String::new();
        reader.read_line(&mut echo)?;
        match echo.as_str() {
            "" => Err(std::io::ErrorKind::ConnectionAborted.into()),
            _ => Ok(format!("{greeting}{echo}")),
        }
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tcp_policy_closes_denied_connections_and_the_agent_names_the_policy() {
    let config = tempfile::tempdir().unwrap();
    let dir = config.path().display().to_string();
    let mesh = Mesh::start_with_registrar(&[], &["--config-dir", &dir]).await;
    let cache = mesh.node.add_pod("cache");
    let _app = cache.serve_tcp_echo("127.0.0.1:6379".parse().unwrap());
    mesh.describe_pod(&cache, "cache", "cache", "", &[("redis", 6379)]);
    mesh.add_pod_ok(&cache, "cache").await;
    let mut callers = Vec::new();
    for name in ["client", "intruder"] {
        let pod = mesh.node.add_pod(name);
        mesh.describe_pod(&pod, name, name, "cache", &[]);
        mesh.add_pod_ok(&pod, name).await;
        callers.push(pod);
    }
    let target: std::net::SocketAddr = format!("{}:6379", mesh.vip("cache").await).parse().unwrap();
    let (client, intruder) = (&callers[0], &callers[1]);
    assert_eq!(tcp_round_trip(intruder, target).unwrap(), "cache\nping\n");

    put_config(config.path(), "cache.yaml", Some(CACHE_CLIENT_ONLY));
    let deadline = Instant::now() + Duration::from_secs(15);
    while tcp_round_trip(intruder, target).is_ok() {
        assert!(Instant::now() < deadline, "the intruder's connections are never closed");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(tcp_round_trip(client, target).unwrap(), "cache\nping\n");
    logged(
        &mesh,
        &[
            "authorization: no ALLOW policy selecting the pod matched",
            "source=spiffe://aether.test/ns/demo/sa/intruder",
            "pod=demo/cache",
            "port=6379",
            "method=TCP",
        ],
    )
    .await;
}

/// Mesh-wide (in the mesh root namespace): nobody may call anything with DELETE.
const MESH_NO_DELETE: &str = "\
apiVersion: security.aether.io/v1alpha1
kind: AuthorizationPolicy
metadata: {name: no-delete, namespace: aether-system}
spec:
  action: DENY
  rules: [{to: [{operation: {methods: [DELETE]}}]}]
";

/// Namespace-wide (no target): every workload of demo refuses other's identity.
const DEMO_NOT_FROM_OTHER: &str = "\
apiVersion: security.aether.io/v1alpha1
kind: AuthorizationPolicy
metadata: {name: not-from-other, namespace: demo}
spec:
  action: DENY
  rules: [{from: [{source: {serviceAccounts: [demo/other]}}]}]
";

/// The same, in another namespace: it selects no workload of demo.
const SHOP_NOT_FROM_OTHER: &str = "\
apiVersion: security.aether.io/v1alpha1
kind: AuthorizationPolicy
metadata: {name: not-from-other, namespace: shop}
spec:
  action: DENY
  rules: [{from: [{source: {serviceAccounts: [demo/other]}}]}]
";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mesh_wide_and_namespace_wide_policies_select_by_namespace() {
    let config = tempfile::tempdir().unwrap();
    let dir = config.path().display().to_string();
    let mesh = Mesh::start_with_registrar(&[], &["--config-dir", &dir]).await;
    let c = callers(&mesh).await;
    until(&mesh, &c.other, "GET", "/x", 200).await;

    // Another namespace's policy never selects demo's workloads.
    put_config(config.path(), "shop.yaml", Some(SHOP_NOT_FROM_OTHER));
    put_config(config.path(), "mesh.yaml", Some(MESH_NO_DELETE));
    until(&mesh, &c.frontend, "DELETE", "/x", 403).await;
    assert_eq!(now(&mesh, &c.other, "GET", "/x").await, 200);
    logged(
        &mesh,
        &["authorization: policy aether-system/no-delete rule 0", "method=DELETE"],
    )
    .await;

    put_config(config.path(), "demo.yaml", Some(DEMO_NOT_FROM_OTHER));
    until(&mesh, &c.other, "GET", "/x", 403).await;
    assert_eq!(now(&mesh, &c.frontend, "GET", "/x").await, 200);
    logged(&mesh, &["authorization: policy demo/not-from-other rule 0", "sa/other"]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn policy_flips_under_load_answer_only_200_or_403_with_spire_identities() {
    let config = tempfile::tempdir().unwrap();
    let dir = config.path().display().to_string();
    let spire = MeshIdentity::Spire {
        ttl: Duration::from_secs(3600),
    };
    let mesh = Mesh::start_node_identity(spire, NodeIdentity::Bootstrap, &[], &["--config-dir", &dir]).await;
    let c = callers(&mesh).await;
    until(&mesh, &c.other, "GET", "/api/items", 200).await;
    let url = format!("http://{}:8080/api/items", mesh.vip("backend").await);
    let stop = std::sync::atomic::AtomicBool::new(false);
    let flips = async {
        for _ in 0..4 {
            put_config(config.path(), "demo.yaml", Some(DEMO_NOT_FROM_OTHER));
            tokio::time::sleep(Duration::from_millis(400)).await;
            put_config(config.path(), "demo.yaml", None);
            tokio::time::sleep(Duration::from_millis(400)).await;
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
    };
    let (frontend, other, ()) = tokio::join!(load(&c.frontend, &url, &stop), load(&c.other, &url, &stop), flips);
    eprintln!("under 8 policy changes: frontend {frontend:?}, other {other:?}");
    // The policy never selects frontend's calls: every one succeeds while it flips.
    assert_eq!(frontend.keys().collect::<Vec<_>>(), [&200], "{frontend:?}");
    // other's calls are allowed or refused by the policy, never failed by its changes.
    assert_eq!(other.keys().collect::<Vec<_>>(), [&200, &403], "{other:?}");
}

/// GETs `url` from `pod` one after another until `stop`; how many got each status (0: no answer).
async fn load(pod: &TestPod, url: &str, stop: &std::sync::atomic::AtomicBool) -> std::collections::BTreeMap<u16, u32> {
    let mut statuses = std::collections::BTreeMap::new();
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        let reply = pod.http_request("GET", url, None, &[], "").await;
        *statuses.entry(reply.map_or(0, |r| r.status)).or_default() += 1;
    }
    statuses
}
