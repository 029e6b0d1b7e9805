//! The edge gateway (proposals/018) end to end: `aether-agent edge` and its own real Envoy next to a mesh node
//! whose echo backends are pods in network namespaces, called from the root netns (outside the mesh).
//!
//! Our own GATEWAY-HTTP conformance suite (`tests/fixtures/edge/conformance/`, restating gateway-api's tests; its
//! README maps each file to the upstream test) runs on the GAMMA runner in `Setup::Edge`. Set
//! `AETHER_GAMMA_CASE=<part of a name>` to run only matching cases.

use std::path::Path;

use aether_tests::gamma::{Setup, run_suite, table_path};

/// The restated gateway-api GATEWAY-HTTP tests (core and the extended features of issue 23).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn edge_conformance_cases_pass() {
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/edge/conformance");
    let table = table_path(env!("CARGO_TARGET_TMPDIR"), "edge-conformance");
    run_suite(&fixtures, &table, Setup::Edge).await;
}
