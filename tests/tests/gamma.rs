//! Our GAMMA conformance suite (`tests/fixtures/gamma/`, run by `aether_tests::gamma`): each fixture's routes are
//! written into the registrar's routes directory and its request table is checked through real Envoy, from pods in
//! network namespaces, against echo backends. One mesh per suite; set `AETHER_GAMMA_CASE=<part of a name>` to run
//! only matching cases.

use std::path::Path;

use aether_tests::gamma::{load_cases, run_suite, table_path};

fn fixtures(suite: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/gamma").join(suite)
}

/// The restated gateway-api mesh conformance tests (MESH-HTTP core and extended, MESH-GRPC).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gamma_conformance_cases_pass() {
    let table = table_path(env!("CARGO_TARGET_TMPDIR"), "conformance");
    run_suite(&fixtures("conformance"), &table).await;
}

/// Beyond conformance: timeouts, retries, consumer versus producer routes, route removal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gamma_resilience_cases_pass() {
    let table = table_path(env!("CARGO_TARGET_TMPDIR"), "resilience");
    run_suite(&fixtures("resilience"), &table).await;
}

/// Outlier ejection on a mesh of its own: an ejection lasts 30 s and more, and would change which replica
/// answers in the cases after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gamma_ejection_cases_pass() {
    let table = table_path(env!("CARGO_TARGET_TMPDIR"), "ejection");
    run_suite(&fixtures("ejection"), &table).await;
}

/// Every fixture parses, and its routes pass the one projector (aether-api) and become mesh routes: a fixture that
/// the registrar would refuse tests nothing. Needs no mesh.
#[test]
fn every_fixture_route_projects() {
    for suite in ["conformance", "resilience", "ejection"] {
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
