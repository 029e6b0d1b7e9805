//! Our GAMMA conformance suite (`tests/fixtures/gamma/`, run by `aether_tests::gamma`): each fixture's routes are
//! written into the registrar's routes directory and its request table is checked through real Envoy, from pods in
//! network namespaces, against echo backends. One mesh per suite; set `AETHER_GAMMA_CASE=<part of a name>` to run
//! only matching cases.

use std::path::Path;

use std::time::Duration;

use aether_tests::gamma::{Setup, Suite, load_cases, run_suite, table_path};
use aether_tests::load::{Load, Protocol};

fn fixtures(suite: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/gamma").join(suite)
}

/// The restated gateway-api mesh conformance tests (MESH-HTTP core and extended, MESH-GRPC).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gamma_conformance_cases_pass() {
    let table = table_path(env!("CARGO_TARGET_TMPDIR"), "conformance");
    run_suite(&fixtures("conformance"), &table, Setup::RoutesDir).await;
}

/// The cases that need Kubernetes Services (ClusterIP matching): the registrar reads routes and Services from the
/// fake API server, and rows call the echo services by ClusterIP.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gamma_kubernetes_cases_pass() {
    let table = table_path(env!("CARGO_TARGET_TMPDIR"), "kubernetes");
    run_suite(&fixtures("kubernetes"), &table, Setup::Kubernetes).await;
}

/// Beyond conformance: timeouts, retries, consumer versus producer routes, route removal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gamma_resilience_cases_pass() {
    let table = table_path(env!("CARGO_TARGET_TMPDIR"), "resilience");
    run_suite(&fixtures("resilience"), &table, Setup::RoutesDir).await;
}

/// Outlier ejection on a mesh of its own: an ejection lasts 30 s and more, and would change which replica
/// answers in the cases after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gamma_ejection_cases_pass() {
    let table = table_path(env!("CARGO_TARGET_TMPDIR"), "ejection");
    run_suite(&fixtures("ejection"), &table, Setup::RoutesDir).await;
}

/// A route changed again and again under steady load (HTTP/1.1 and HTTP/2 keep-alive connections from a client
/// pod to echo): every request is answered 200, and each version of the route takes effect before the next.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn route_changes_under_load_lose_no_request() {
    let suite = Suite::start().await;
    let loads = [
        Load::start(suite.load_to_echo(Protocol::Http1, 4)),
        Load::start(suite.load_to_echo(Protocol::Http2, 2)),
    ];
    for load in &loads {
        load.wait_ok(200, Duration::from_secs(10)).await;
    }
    for (step, (v1, v2), answers) in [
        (0, (100, 0), "echo-v1"),
        (1, (50, 50), ""),
        (2, (0, 100), "echo-v2"),
        (3, (100, 0), "echo-v1"),
    ] {
        suite.write_routes("under-load", &split(v1, v2));
        if !answers.is_empty() {
            let settled = suite.settle_to(answers).await;
            settled.unwrap_or_else(|e| panic!("step {step}: {e}\n{}", suite.registrar_logs()));
        }
        for load in &loads {
            load.wait_ok(200, Duration::from_secs(10)).await;
        }
    }
    suite.remove_routes(suite.write_routes("under-load", &split(100, 0)));
    let settled = suite.settle_to("echo").await;
    settled.unwrap_or_else(|e| panic!("after removal: {e}\n{}", suite.registrar_logs()));
    for load in loads {
        load.stop().await.assert_clean(1_000);
    }
}

/// An HTTPRoute on echo splitting its traffic between echo-v1 and echo-v2.
fn split(v1: u32, v2: u32) -> String {
    format!(
        r#"apiVersion: gateway.networking.k8s.io/v1
kind: HTTPRoute
metadata: {{name: under-load, namespace: demo}}
spec:
  parentRefs: [{{group: "", kind: Service, name: echo, port: 80}}]
  rules:
  - backendRefs:
    - {{name: echo-v1, port: 80, weight: {v1}}}
    - {{name: echo-v2, port: 80, weight: {v2}}}
"#
    )
}

/// Every fixture parses, and its routes pass the one projector (aether-api) and become mesh routes: a fixture that
/// the registrar would refuse tests nothing. Needs no mesh.
#[test]
fn every_fixture_route_projects() {
    for suite in ["conformance", "resilience", "ejection", "kubernetes"] {
        let cases = load_cases(&fixtures(suite)).unwrap_or_else(|e| panic!("{e}"));
        assert!(!cases.is_empty(), "no cases in {suite}");
        for case in cases.iter().filter(|c| !c.routes.is_empty()) {
            for (i, object) in aether_api::parse_documents(&case.routes).into_iter().enumerate() {
                let object = object.unwrap_or_else(|e| panic!("{suite}/{}: document {i}: {e}", case.name));
                let route = aether_api::project(&object);
                let route = route.unwrap_or_else(|e| panic!("{suite}/{}: document {i}: {e}", case.name));
                assert!(
                    route.is_some(),
                    "{suite}/{}: document {i} has no Service parent",
                    case.name
                );
            }
        }
    }
}
