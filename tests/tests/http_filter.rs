//! HTTPFilter end to end (as root): HTTPFilter YAML in the registrar's config directory is
//! projected, stored, streamed to the agent and compiled into the node's real Envoy; pods
//! in network namespaces call each other over mTLS. Inbound: ext_authz with the fake
//! authorization server (Envoy's real gRPC API). Callers' side: a local rate limit
//! enabled only on calls to its target service.

use std::time::{Duration, Instant};

use aether_fakes::ext_authz::{DENIED_BODY, ExtAuthzServer};
use aether_tests::TestPod;
use aether_tests::mesh::{APP, ENVOY_DRAIN_TIME, Mesh, put_config};

/// GET `path` on `service`:8080 from `pod` with `headers`: the status and body.
async fn get(mesh: &Mesh, pod: &TestPod, service: &str, headers: &[(&str, &str)]) -> (u16, String) {
    let url = format!("http://{}:8080/", mesh.vip(service).await);
    match pod.http_request("GET", &url, None, headers, "").await {
        Ok(reply) => (reply.status, reply.body),
        Err(e) => (0, e.to_string()),
    }
}

/// Calls until the answer is `status`, within 15 s (a filter lands asynchronously).
async fn until(mesh: &Mesh, pod: &TestPod, service: &str, headers: &[(&str, &str)], status: u16) -> String {
    until_within(Duration::from_secs(15), mesh, pod, service, headers, status).await
}

/// [`until`] within `wait`.
async fn until_within(
    wait: Duration,
    mesh: &Mesh,
    pod: &TestPod,
    service: &str,
    headers: &[(&str, &str)],
    status: u16,
) -> String {
    let deadline = Instant::now() + wait;
    loop {
        let (got, body) = get(mesh, pod, service, headers).await;
        if got == status {
            return body;
        }
        assert!(
            Instant::now() < deadline,
            "{}: never {status}, last {got} {body}",
            pod.name()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// backend and search serve HTTP; frontend and other call both.
async fn pods(mesh: &Mesh) -> (Vec<TestPod>, Vec<aether_tests::HttpServer>) {
    let mut pods = Vec::new();
    let mut apps = Vec::new();
    for (name, upstreams) in [
        ("backend", ""),
        ("search", ""),
        ("frontend", "backend,search"),
        ("other", "backend,search"),
    ] {
        let pod = mesh.node.add_pod(name);
        apps.push(pod.serve_http(APP.parse().unwrap(), name));
        mesh.describe_pod(&pod, name, name, upstreams, &[("http", 8080)]);
        mesh.add_pod_ok(&pod, name).await;
        pods.push(pod);
    }
    (pods, apps)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inbound_ext_authz_and_a_callers_side_rate_limit_through_the_registrar() {
    let config = tempfile::tempdir().unwrap();
    let dir = config.path().display().to_string();
    let mesh = Mesh::start_with_registrar(&[], &["--config-dir", &dir]).await;
    let (pods, _apps) = pods(&mesh).await;
    let (frontend, other) = (&pods[2], &pods[3]);
    until(&mesh, frontend, "backend", &[], 200).await;

    // Inbound: backend's requests are checked by the authorization server first.
    let authz = ExtAuthzServer::start().await;
    let check = format!(
        "apiVersion: networking.aether.io/v1alpha1
kind: HTTPFilter
metadata: {{name: check-backend, namespace: demo}}
spec:
  targetRefs: [{{kind: Service, name: backend}}]
  attach: Inbound
  extAuthz:
    grpc: {{host: 127.0.0.1, port: {}}}
    timeout: 500ms
",
        authz.addr.port()
    );
    put_config(config.path(), "check.yaml", Some(&check));
    // A filter added inbound changes the chain: the node Envoy's pooled connection to backend
    // keeps the old chain until it drains (proposal 014's known limit).
    let body = until_within(
        ENVOY_DRAIN_TIME + Duration::from_secs(15),
        &mesh,
        frontend,
        "backend",
        &[],
        403,
    )
    .await;
    assert_eq!(body, DENIED_BODY);
    assert_eq!(get(&mesh, frontend, "backend", &[("x-allow", "yes")]).await.0, 200);
    // search has no such filter.
    assert_eq!(get(&mesh, frontend, "search", &[]).await.0, 200);
    assert!(authz.checks() >= 2, "the server decided: {} checks", authz.checks());
    put_config(config.path(), "check.yaml", None);
    until(&mesh, frontend, "backend", &[], 200).await;

    // Callers' side: this node's callers get 2 calls to search per hour, together (the
    // bucket is the route table's, shared by the node); calls to backend are not counted.
    put_config(
        config.path(),
        "limit.yaml",
        Some(
            "apiVersion: networking.aether.io/v1alpha1
kind: HTTPFilter
metadata: {name: limit-search, namespace: demo}
spec:
  targetRefs: [{kind: Service, name: search}]
  attach: Callers
  localRateLimit: {maxTokens: 2, fillInterval: 1h}
",
        ),
    );
    until(&mesh, frontend, "search", &[], 429).await;
    assert_eq!(
        get(&mesh, other, "search", &[]).await.0,
        429,
        "the node's bucket is spent"
    );
    assert_eq!(
        get(&mesh, frontend, "backend", &[]).await.0,
        200,
        "calls to backend are not limited"
    );
    assert_eq!(get(&mesh, other, "backend", &[]).await.0, 200);
}
