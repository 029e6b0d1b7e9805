//! Our own GAMMA conformance suite, as data. A fixture (`tests/fixtures/gamma/<suite>/<case>.yaml`) is a case: the
//! features it exercises, Gateway API routes (HTTPRoute/GRPCRoute with Service parents, written as they would be
//! applied) and a table of requests with what must come of each. The runner ([`run_suite`]) starts one node of the
//! mesh whose registrar reads routes from a directory (or, with [`Setup::Kubernetes`], from the fake Kubernetes API
//! server, where the echo services also have Services with ClusterIPs), pods for the echo services
//! ([`crate::echo`]) and two clients, and for every case:
//!
//! 1. sends each request once with no route applied: the rows that already hold there do not show the route
//!    working, so they are checked only after one that does;
//! 2. writes the routes where the registrar reads them and polls each row until it holds three times in a row
//!    (routes reach Envoy asynchronously), within a deadline; then checks the weighted splits;
//! 3. removes the routes and polls until every row that the routes changed is back to its answer without them.
//!
//! Failures name the case, the row and the last answer; a feature table (feature → cases → pass) is printed and
//! written beside the test binary's scratch files.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

mod case;
mod kubernetes;
mod report;
mod suite;

pub use case::{Case, Expect, Redirect, Row, Split, Via, load_cases};
pub use kubernetes::{CLUSTER_DOMAIN, kubernetes_service};
pub use report::feature_table;
pub use suite::{Observed, Setup, Suite};

/// How long a row may take to hold after its routes were written (or to revert after they were removed).
pub const SETTLE_DEADLINE: Duration = Duration::from_secs(20);
/// Upstream's definition of "settled": this many passes in a row.
pub const CONSECUTIVE_PASSES: usize = 3;

/// Runs every case of `dir` against one mesh set up as `setup` says, prints the feature table and writes it to
/// `table`, and panics naming every failed case and row.
pub async fn run_suite(dir: &Path, table: &Path, setup: Setup) {
    let cases = load_cases(dir).unwrap_or_else(|e| panic!("{e}"));
    let only = std::env::var("AETHER_GAMMA_CASE").ok();
    let suite = Suite::start_as(setup).await;
    let mut results = Vec::new();
    for case in cases
        .iter()
        .filter(|c| only.as_deref().is_none_or(|o| c.name.contains(o)))
    {
        let started = Instant::now();
        let result = suite.run_case(case).await;
        eprintln!(
            "gamma: {} {} in {:.1}s",
            case.name,
            if result.is_ok() { "passed" } else { "FAILED" },
            started.elapsed().as_secs_f64()
        );
        results.push((case, result));
    }
    let table_text = feature_table(&results);
    eprintln!("{table_text}");
    std::fs::write(table, &table_text).unwrap_or_else(|e| panic!("writing {}: {e}", table.display()));
    let failures: Vec<String> = results
        .iter()
        .filter_map(|(case, r)| r.as_ref().err().map(|e| format!("case {}: {e}", case.name)))
        .collect();
    assert!(
        failures.is_empty(),
        "{} of {} GAMMA cases failed:\n{}\n\nregistrar:\n{}",
        failures.len(),
        results.len(),
        failures.join("\n"),
        suite.registrar_logs()
    );
}

/// A per-request token: `{nonce}` in a header value becomes a fresh one (keys for the echo's fail-first counters).
fn nonce() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    format!("n{}-{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed))
}

/// Where a suite's table goes: beside the test binary's scratch files.
pub fn table_path(scratch: &str, suite: &str) -> PathBuf {
    Path::new(scratch).join(format!("gamma-{suite}.md"))
}

/// Two maps' differences, for messages: `name: want "x", got "y"`.
fn compare_headers(
    what: &str,
    want: &BTreeMap<String, String>,
    absent: &[String],
    got: &BTreeMap<String, String>,
    errors: &mut Vec<String>,
) {
    for (name, value) in want {
        let seen = got.get(&name.to_ascii_lowercase());
        if seen != Some(value) {
            errors.push(format!("{what} {name}: want {value:?}, got {seen:?}"));
        }
    }
    for name in absent {
        if let Some(seen) = got.get(&name.to_ascii_lowercase()) {
            errors.push(format!("{what} {name}: want absent, got {seen:?}"));
        }
    }
}
