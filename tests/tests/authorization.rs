//! Authorization end to end (as root): AuthorizationPolicy YAML in the registrar's config
//! directory is projected, stored and streamed to the agent, which compiles it into RBAC
//! on the destination pod's inbound listener of a real Envoy. Callers are pods in network
//! namespaces presenting their own SVIDs.

use std::path::Path;
use std::time::{Duration, Instant};

use aether_tests::mesh::{APP, Mesh};
use aether_tests::{Envoy, TestPod, free_port, unique_base_id};

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

/// Writes a policy file the way an editor would (a rename), or removes it.
fn put(dir: &Path, file: &str, yaml: Option<&str>) {
    let path = dir.join(file);
    match yaml {
        Some(yaml) => {
            let staged = dir.join(format!(".{file}.partial"));
            std::fs::write(&staged, yaml).unwrap();
            std::fs::rename(staged, path).unwrap();
        }
        None => std::fs::remove_file(path).unwrap(),
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
    let mut mesh = Mesh::start_with_registrar(&[], &["--config-dir", &dir]).await;
    // A policy change rebuilds the pod's inbound chains; connections opened before it keep
    // the old rules until Envoy's drain time ends (10 s in production, 2 s here; proposal
    // 013 names the gap). The checks below therefore wait for the new rules.
    mesh.envoy = None;
    let bootstrap = mesh.envoy_bootstrap(free_port());
    mesh.envoy = Some(Envoy::start_with_args(
        &bootstrap,
        unique_base_id(),
        &["--drain-time-s", "2"],
    ));
    let c = callers(&mesh).await;
    // No policy selects backend: everyone is allowed.
    until(&mesh, &c.frontend, "GET", "/api/items", 200).await;
    until(&mesh, &c.other, "POST", "/anything", 200).await;

    // ALLOW: only frontend's identity, only GET under /api/.
    put(config.path(), "allow.yaml", Some(ALLOW_FRONTEND));
    until(&mesh, &c.other, "GET", "/api/items", 403).await;
    until(&mesh, &c.frontend, "POST", "/api/items", 403).await;
    assert_eq!(now(&mesh, &c.frontend, "GET", "/api/items").await, 200);
    assert_eq!(now(&mesh, &c.frontend, "GET", "/admin").await, 403);
    assert_eq!(now(&mesh, &c.other, "POST", "/anything").await, 403);

    // DENY wins over a matching ALLOW.
    put(config.path(), "deny.yaml", Some(DENY_SECRET));
    until(&mesh, &c.frontend, "GET", "/api/secret", 403).await;
    assert_eq!(now(&mesh, &c.frontend, "GET", "/api/items").await, 200);

    // Policies removed: allowed again.
    put(config.path(), "allow.yaml", None);
    put(config.path(), "deny.yaml", None);
    until(&mesh, &c.other, "GET", "/api/items", 200).await;
    until(&mesh, &c.frontend, "GET", "/api/secret", 200).await;
}
