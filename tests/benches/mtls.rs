//! What mTLS between pods costs (`cargo bench -p aether-tests --bench mtls`, as root, after
//! `cargo build --workspace --bins --release`): a real registrar, `aether-agent run`, Envoy 1.40.
//!
//! 1. Added latency: `wrk` inside a frontend pod POSTs 1 KB bodies to the backend service
//!    through the node Envoy (frontend's outbound listener → mesh cluster → backend's inbound
//!    listener → app), keep-alive, fixed concurrency; p50/p99 and throughput with
//!    `--identity none` (plaintext, NOT FOR PRODUCTION, the baseline) and with mTLS
//!    (`--identity builtin`).
//! 2. SVID issued → Envoy serving it: the fake SPIRE agent rotates the backend's SVID; the
//!    clock stops when Envoy's `/certs` lists the new serial for the backend's inbound listener
//!    (polled every 1 ms). Includes the agent's stream receive, parse, rebuild, SDS push and
//!    Envoy applying it.
//!
//! 3. Next to both, a direct call (frontend pod → backend pod's IP, no mesh; the node runs
//!    `--inbound-mtls permissive` so the plaintext call is admitted) in the same run, and all three
//!    at a fixed 1,000 req/s (`hey -q`, 8 workers) as well as flat out (`wrk`). Goal: the mesh, doing L7 with
//!    mTLS, adds ≤ 0.2 ms p99 over direct at 1,000 req/s.
//!
//! Knobs (env): AETHER_BENCH_DURATION (10 s), AETHER_BENCH_CONNECTIONS (8), AETHER_BENCH_ROTATIONS (20),
//! AETHER_BENCH_RATE (1000 req/s).

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use aether_tests::TestPod;
use aether_tests::bench::{Wrk, parse_hey, parse_wrk, percentile};
use aether_tests::mesh::{Mesh, MeshIdentity, fqdn};

fn knob(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn wrk(pod: &TestPod, url: &str, host: &str, seconds: u64, connections: u64, dir: &std::path::Path) -> Wrk {
    let script = dir.join("post1k.lua");
    std::fs::write(
        &script,
        "wrk.method = \"POST\"\nwrk.body = string.rep(\"x\", 1024)\nwrk.headers[\"Content-Type\"] = \"application/octet-stream\"\n",
    )
    .unwrap();
    let out = pod.exec_ok(&[
        "wrk",
        "-t1",
        &format!("-c{connections}"),
        &format!("-d{seconds}s"),
        "--latency",
        "-H",
        &format!("Host: {host}"),
        "-s",
        &script.to_string_lossy(),
        url,
    ]);
    parse_wrk(&out)
}

/// Latency at a fixed rate: `hey` with 8 workers of rate/8 req/s each, 1 KB POSTs, keep-alive. (p50, p99) in ms.
fn hey_fixed(pod: &TestPod, url: &str, host: &str, seconds: u64, rate: u64, dir: &std::path::Path) -> (f64, f64) {
    let body = dir.join("body1k");
    std::fs::write(&body, "x".repeat(1024)).unwrap();
    let workers = 8;
    let out = pod.exec_ok(&[
        "hey",
        "-z",
        &format!("{seconds}s"),
        "-c",
        &workers.to_string(),
        "-q",
        &(rate / workers).to_string(),
        "-m",
        "POST",
        "-D",
        &body.to_string_lossy(),
        "-host",
        host,
        url,
    ]);
    parse_hey(&out, url)
}

/// Serials of the certificates Envoy serves whose SAN names `spiffe_id`.
fn serving_serials(mesh: &Mesh, spiffe_id: &str) -> BTreeSet<String> {
    let certs: serde_json::Value = serde_json::from_str(&mesh.envoy().admin_get("/certs")).unwrap_or_default();
    let mut out = BTreeSet::new();
    for context in certs["certificates"].as_array().into_iter().flatten() {
        for cert in context["cert_chain"].as_array().into_iter().flatten() {
            let names = cert["subject_alt_names"].to_string();
            if names.contains(spiffe_id) {
                out.insert(cert["serial_number"].as_str().unwrap_or_default().to_owned());
            }
        }
    }
    out
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    if std::env::args().any(|a| a == "--list") {
        return; // `cargo test --benches` probes harness=false benches with --list.
    }
    let load = Load {
        seconds: knob("AETHER_BENCH_DURATION", 10),
        connections: knob("AETHER_BENCH_CONNECTIONS", 8),
        rate: knob("AETHER_BENCH_RATE", 1000),
        dir: tempfile::tempdir().unwrap(),
    };
    let rotations = knob("AETHER_BENCH_ROTATIONS", 20) as usize;
    println!(
        "mtls bench: 1 KB POST through the node Envoy, wrk -t1 -c{} -d{}s, keep-alive",
        load.connections, load.seconds
    );
    let mut results = Vec::new();
    let mut fixed = Vec::new();
    for (label, identity) in [
        (
            "plaintext (--identity none, NOT FOR PRODUCTION)",
            MeshIdentity::Plaintext,
        ),
        ("mTLS (--identity builtin)", MeshIdentity::DEFAULT),
    ] {
        measure_paths(&load, label, identity, &mut results, &mut fixed).await;
    }
    print_comparison(&load, &results, &fixed);
    measure_svid_to_envoy(rotations).await;
}

/// How hard and how long each path is loaded, and where the load tools write.
struct Load {
    seconds: u64,
    connections: u64,
    /// The fixed rate of the latency runs.
    rate: u64,
    dir: tempfile::TempDir,
}

/// A mesh with `identity`: the frontend → backend path through the node Envoy (and, with mTLS, the same backend
/// reached directly), each loaded by wrk then at the fixed rate; appends to `results` and `fixed`.
async fn measure_paths(
    load: &Load,
    label: &str,
    identity: MeshIdentity,
    results: &mut Vec<Wrk>,
    fixed: &mut Vec<(String, f64, f64)>,
) {
    // Permissive inbound: the direct path below calls the backend pod's own address in plaintext, which
    // STRICT (the default) answers with a reset. It changes only the pod's nft input chain: the mesh paths
    // measured are the same Envoy chains, and the frontend's calls still leave with its SVID.
    let mesh = Mesh::start_identity(identity, &["--inbound-mtls", "permissive"]).await;
    let (frontend, backend, mut apps) = mesh.frontend_and_backend().await;
    let host = format!("{}:8080", fqdn("backend"));
    let mut paths = vec![(label.to_owned(), "http://127.0.0.1:18081/bench".to_owned(), host)];
    if matches!(identity, MeshIdentity::Builtin { .. }) {
        // The same backend app, also on the pod's own address: reached directly, no mesh.
        let direct = format!("{}:9080", backend.ip());
        apps.push(backend.serve_http(direct.parse().unwrap(), "backend"));
        paths.insert(
            0,
            (
                "direct (pod -> pod, no mesh)".to_owned(),
                format!("http://{direct}/bench"),
                direct,
            ),
        );
    }
    let (seconds, connections, dir) = (load.seconds, load.connections, load.dir.path());
    for (label, url, host) in paths {
        // Warm-up: connections established, caches hot.
        let _ = wrk(&frontend, &url, &host, 2, connections, dir);
        let r = wrk(&frontend, &url, &host, seconds, connections, dir);
        println!(
            "  {label:<48} p50 {:>9}  p99 {:>9}  {:>9.0} req/s  errors: {}",
            r.p50, r.p99, r.rps, r.errors
        );
        let (p50, p99) = hey_fixed(&frontend, &url, &host, seconds, load.rate, dir);
        fixed.push((label, p50, p99));
        results.push(r);
    }
}

fn print_comparison(load: &Load, results: &[Wrk], fixed: &[(String, f64, f64)]) {
    let (rate, seconds) = (load.rate, load.seconds);
    if let [plain, _direct, mtls] = results {
        println!(
            "  throughput with mTLS: {:.1}% of plaintext",
            100.0 * mtls.rps / plain.rps.max(1.0)
        );
    }
    println!("at a fixed {rate} req/s (hey, 8 workers, {seconds} s, keep-alive):");
    for (label, p50, p99) in fixed {
        println!("  {label:<48} p50 {p50:>7.3} ms  p99 {p99:>7.3} ms");
    }
    let p99 = |prefix: &str| fixed.iter().find(|(l, _, _)| l.starts_with(prefix)).map(|(_, _, p)| *p);
    if let (Some(direct), Some(mtls)) = (p99("direct"), p99("mTLS")) {
        println!(
            "  mesh (L7 + mTLS) adds {:+.3} ms p99 over direct at {rate} req/s (goal: <= 0.2 ms)",
            mtls - direct
        );
    }
}

/// SVID issued → Envoy serving it, over `rotations` rotations of a fake SPIRE.
async fn measure_svid_to_envoy(rotations: usize) {
    let mesh = Mesh::start_identity(
        MeshIdentity::Spire {
            ttl: Duration::from_secs(3600),
        },
        &[],
    )
    .await;
    let (_frontend, _backend, _apps) = mesh.frontend_and_backend().await;
    let spire = mesh.spire.as_ref().unwrap();
    let backend_id = aether_tests::identity::spiffe_id("demo", "backend");
    let mut samples = Vec::new();
    for _ in 0..rotations {
        let before = serving_serials(&mesh, &backend_id);
        let issued_before = spire.issued().len();
        spire.rotate_all();
        let issued_at = spire.issued()[issued_before..]
            .iter()
            .find(|(id, _, _)| *id == backend_id)
            .map(|(_, _, at)| *at)
            .expect("the backend's SVID was issued");
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let now = serving_serials(&mesh, &backend_id);
            if now.iter().any(|s| !before.contains(s)) {
                samples.push(issued_at.elapsed());
                break;
            }
            assert!(Instant::now() < deadline, "Envoy never served the new SVID");
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    samples.sort();
    println!(
        "SVID issued (fake SPIRE) -> Envoy serving it (/certs), {} rotations: p50 {:.1} ms  p99 {:.1} ms  max {:.1} ms",
        samples.len(),
        percentile(&samples, 0.5).as_secs_f64() * 1e3,
        percentile(&samples, 0.99).as_secs_f64() * 1e3,
        samples.last().unwrap().as_secs_f64() * 1e3,
    );
}
