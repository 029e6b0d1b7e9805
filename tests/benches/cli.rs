//! `aether explain` wall time on a node with 100 pods (as root): registrar, agent, a real
//! Envoy, 100 pods in netns each declaring 10 of 200 catalog services (5 endpoints each).
//! Each sample is one `aether -o json explain <pod> <upstream>` process, start to exit, as
//! an operator runs it. The goal (issue 21): p99 < 2 s, aim < 200 ms.
//!
//! Knobs: `AETHER_BENCH_PODS` (100), `AETHER_BENCH_EXPLAINS` (200).

use std::process::Command;
use std::time::{Duration, Instant};

use aether_tests::bench::{catalog_address, endpoint, knob, percentile, register_all, service_key, service_name};
use aether_tests::mesh::Mesh;
use aether_tests::{Envoy, binary, free_port, unique_base_id};

const SERVICES: usize = 200;
const ENDPOINTS_PER_SERVICE: usize = 5;
const UPSTREAMS: usize = 10;

/// A mesh whose agent knows where Envoy's admin is.
async fn mesh() -> Mesh {
    let port = free_port();
    let mut mesh = Mesh::start_with(&["--envoy-admin", &format!("127.0.0.1:{port}")]).await;
    mesh.envoy = None;
    mesh.envoy = Some(Envoy::start(&mesh.envoy_bootstrap(port), unique_base_id()));
    mesh
}

/// Pod `p`'s upstreams: 10 services spread over the catalog.
fn upstreams(p: usize) -> Vec<usize> {
    (0..UPSTREAMS).map(|u| (p * 7 + u * 19) % SERVICES).collect()
}

/// One `aether explain`, start to exit, and its exit code.
fn explain(mesh: &Mesh, pod: &str, target: &str) -> (Duration, i32) {
    let started = Instant::now();
    let out = Command::new(binary("aether"))
        .args([
            "--agent",
            &mesh.agent_admin.to_string(),
            "-o",
            "json",
            "explain",
            pod,
            target,
        ])
        .output()
        .expect("running aether");
    (started.elapsed(), out.status.code().unwrap_or(-1))
}

fn main() {
    aether_tests::require_root();
    let pods = knob("AETHER_BENCH_PODS", 100);
    let samples = knob("AETHER_BENCH_EXPLAINS", 200);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let mesh = rt.block_on(mesh());
    let endpoints = (0..SERVICES * ENDPOINTS_PER_SERVICE)
        .map(|n| endpoint(n % SERVICES, catalog_address(n), n))
        .collect();
    rt.block_on(register_all(&mesh, endpoints, 64));
    let mut guards = Vec::new();
    for p in 0..pods {
        let name = format!("bench-{p:03}");
        let pod = mesh.node.add_pod(&name);
        let list: Vec<String> = upstreams(p).into_iter().map(service_key).collect();
        mesh.describe_pod(&pod, &name, &name, &list.join(","), &[("http", 8080)]);
        guards.push((pod, name));
    }
    // The static pod source polls its directory every 200 ms.
    std::thread::sleep(Duration::from_millis(600));
    let started = Instant::now();
    for (pod, name) in &guards {
        rt.block_on(mesh.add_pod_ok(pod, name));
    }
    println!(
        "node: {pods} pods added in {:.1} s, each declaring {UPSTREAMS} of {SERVICES} services",
        started.elapsed().as_secs_f64()
    );

    let mut times = Vec::new();
    let mut codes = std::collections::BTreeMap::new();
    for i in 0..samples {
        let p = i % pods;
        let target = format!("{}.bench:8080", service_name(upstreams(p)[i % UPSTREAMS]));
        let (took, code) = explain(&mesh, &format!("demo/bench-{p:03}"), &target);
        times.push(took);
        *codes.entry(code).or_insert(0) += 1;
    }
    times.sort();
    let ms = |d: Duration| format!("{:.1} ms", d.as_secs_f64() * 1000.0);
    println!(
        "aether explain, {samples} runs on {pods} pods: p50 {}, p90 {}, p99 {}, max {} (exit codes {codes:?})",
        ms(percentile(&times, 0.50)),
        ms(percentile(&times, 0.90)),
        ms(percentile(&times, 0.99)),
        ms(*times.last().unwrap())
    );
    let p99 = percentile(&times, 0.99);
    if p99 > Duration::from_secs(2) {
        println!("PRODUCT PROBLEM: p99 {} is over the 2 s budget", ms(p99));
    }
    let started = Instant::now();
    let status = Command::new(binary("aether"))
        .args(["--agent", &mesh.agent_admin.to_string(), "-o", "json", "status"])
        .output()
        .unwrap();
    println!(
        "aether status on {pods} pods: {} (exit {:?})",
        ms(started.elapsed()),
        status.status.code()
    );
}
