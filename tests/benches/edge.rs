//! The edge gateway (proposal 018) under load (`cargo bench -p aether-tests --bench edge`, as root, after `cargo
//! build --workspace --bins --release`): a real registrar, `aether-agent run` and `aether-agent edge` with the
//! built-in CA (mTLS into the mesh, the production default), each with its own Envoy 1.40, the backend a pod in a
//! network namespace, the client `wrk`/`hey` in the root netns (outside the mesh).
//!
//! 1. Added latency and throughput: GET through the edge's HTTP listener (edge → mTLS → the backend's node →
//!    app) and through its HTTPS listener (TLS terminated at the edge, keep-alive), next to a direct call to the
//!    backend pod's own address, flat out (`wrk`, fixed connections) and at a fixed rate (`hey -q`).
//! 2. TLS handshakes/s: `wrk` with `Connection: close` on the HTTPS listener, a new handshake per request.
//! 3. Envoy heap per route and per certificate: the edge Envoy's allocated bytes with R extra HTTPRoutes (each
//!    its own hostname), then with C HTTPS listeners (each its own hostname and certificate), against the
//!    standard Gateway; the difference divided by R (C).
//!
//! Knobs (env): AETHER_BENCH_DURATION (10 s), AETHER_BENCH_CONNECTIONS (8), AETHER_BENCH_RATE (1000 req/s),
//! AETHER_BENCH_ROUTES (200), AETHER_BENCH_CERTIFICATES (50).

use std::net::SocketAddr;
use std::process::Command;
use std::time::{Duration, Instant};

use aether_tests::bench::{Wrk, envoy_allocated, knob, parse_hey, parse_wrk};
use aether_tests::edge::{STANDARD_LISTENERS, WORLD_FILE, secret};
use aether_tests::gamma::{Setup, Suite};

const APP_PORT: u16 = 80;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    aether_tests::require_root();
    let seconds = knob("AETHER_BENCH_DURATION", 10) as u64;
    let connections = knob("AETHER_BENCH_CONNECTIONS", 8);
    let rate = knob("AETHER_BENCH_RATE", 1000) as u64;
    let suite = Suite::start_as(Setup::Edge).await;
    let mesh = suite.mesh();
    let app = mesh.node.add_pod("bench-app");
    let _server = app.serve_http(SocketAddr::from(([0, 0, 0, 0], APP_PORT)), "bench-app");
    mesh.describe_pod(&app, "bench-app", "bench-app", "", &[("http", APP_PORT)]);
    mesh.add_pod_ok(&app, "bench-app").await;
    let _route = suite.write_routes("bench", &route("bench", &["www.example.com"]));
    let edge = suite.edge();
    wait_served(edge.addr(80), "www.example.com").await;

    println!(
        "\n## Edge gateway: added latency (GET, {connections} connections, {seconds} s; fixed rate {rate} req/s)\n"
    );
    println!("| path | req/s (wrk) | p50 | p99 | fixed-rate p50 | fixed-rate p99 |");
    println!("| --- | --- | --- | --- | --- | --- |");
    let direct = format!("http://{}:{APP_PORT}/bench", app.ip());
    let via_http = format!("http://{}/bench", edge.addr(80));
    let via_https = format!("https://{}/bench", edge.addr(443));
    let mut p99s = Vec::new();
    for (name, url) in [
        ("direct (no edge, no mesh)", &direct),
        ("edge HTTP → mTLS → app", &via_http),
        ("edge HTTPS → mTLS → app", &via_https),
    ] {
        let flat = wrk(url, "www.example.com", seconds, connections, false);
        let (p50, p99) = hey_fixed(url, "www.example.com", seconds, rate);
        println!(
            "| {name} | {:.0} | {} | {} | {p50:.3} ms | {p99:.3} ms |",
            flat.rps, flat.p50, flat.p99
        );
        p99s.push(p99);
    }
    println!(
        "\nedge adds {:+.3} ms p99 (HTTP) and {:+.3} ms p99 (HTTPS) over direct at {rate} req/s",
        p99s[1] - p99s[0],
        p99s[2] - p99s[0]
    );

    let handshakes = wrk(&via_https, "www.example.com", seconds, connections, true);
    println!(
        "\nTLS handshakes/s at the edge (a new connection per request, {connections} connections): {:.0} (p99 {})",
        handshakes.rps, handshakes.p99
    );

    // Heap per route and per certificate.
    let admin = edge.proxy.options.envoy_admin;
    let base = settled_heap(admin).await;
    let routes = knob("AETHER_BENCH_ROUTES", 200);
    let many: String = (0..routes)
        .map(|i| route(&format!("bench-{i}"), &[&format!("r{i}.example.com")]))
        .collect::<Vec<_>>()
        .join("---\n");
    let _many = suite.write_routes("bench-many", &many);
    wait_served(edge.addr(80), &format!("r{}.example.com", routes - 1)).await;
    let with_routes = settled_heap(admin).await;

    let certificates = knob("AETHER_BENCH_CERTIFICATES", 50);
    let world = suite.edge_world();
    let mut listeners = STANDARD_LISTENERS.to_owned();
    let mut secrets = Vec::new();
    for i in 0..certificates {
        let host = format!("c{i}.example.net");
        listeners.push_str(&format!(
            "- name: tls-{i}\n  port: 443\n  protocol: HTTPS\n  hostname: {host}\n  tls: {{mode: Terminate, certificateRefs: [{{name: cert-{i}}}]}}\n  allowedRoutes: {{namespaces: {{from: All}}}}\n"
        ));
        let leaf = world.ca.issue_server_names(&[&host], Duration::from_secs(3600));
        secrets.push(secret(&format!("cert-{i}"), &leaf));
    }
    let _secrets = suite.write_routes("bench-secrets", &secrets.join("---\n"));
    let _world = suite.write_routes(WORLD_FILE.trim_end_matches(".yaml"), &world.yaml(&listeners));
    let last = format!("c{}.example.net", certificates - 1);
    wait_certificate(edge.addr(443), &last, &world.ca.cert_pem).await;
    let with_certificates = settled_heap(admin).await;

    let kib = |bytes: f64| bytes / 1024.0;
    println!("\n## Edge Envoy heap\n");
    println!("| configuration | Envoy heap |");
    println!("| --- | --- |");
    println!("| standard Gateway, 1 route | {:.1} MiB |", base as f64 / 1048576.0);
    println!("| + {routes} routes | {:.1} MiB |", with_routes as f64 / 1048576.0);
    println!(
        "| + {certificates} HTTPS listeners, a certificate each | {:.1} MiB |",
        with_certificates as f64 / 1048576.0
    );
    println!(
        "\nper route: {:.1} KiB; per certificate (listener + secret): {:.1} KiB",
        kib((with_routes as f64 - base as f64) / routes as f64),
        kib((with_certificates as f64 - with_routes as f64) / certificates as f64)
    );
}

/// An HTTPRoute `name` for `hostnames`, to the bench app.
fn route(name: &str, hostnames: &[&str]) -> String {
    format!(
        "apiVersion: gateway.networking.k8s.io/v1\nkind: HTTPRoute\nmetadata: {{name: {name}, namespace: demo}}\nspec:\n  parentRefs: [{{name: edge, namespace: edge}}]\n  hostnames: [{}]\n  rules: [{{backendRefs: [{{name: bench-app, port: {APP_PORT}}}]}}]\n",
        hostnames.join(", ")
    )
}

async fn wait_served(addr: SocketAddr, host: &str) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let reply = aether_tests::http_get(&format!("http://{addr}/"), Some(host)).await;
        if reply.as_ref().is_ok_and(|r| r.status == 200) {
            return;
        }
        assert!(Instant::now() < deadline, "the edge never served {host}: {reply:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn wait_certificate(addr: SocketAddr, host: &str, ca: &str) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let reply = aether_tests::http::https_request(addr, host, ca, "GET", "/", host, &[], "").await;
        if reply.is_ok() {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the edge never served a certificate for {host}: {reply:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Envoy's heap once it stops moving (two reads 1 s apart within 1 %).
async fn settled_heap(admin: SocketAddr) -> u64 {
    let mut last = envoy_allocated(admin).await;
    for _ in 0..20 {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let now = envoy_allocated(admin).await;
        if now.abs_diff(last) * 100 <= last {
            return now;
        }
        last = now;
    }
    last
}

fn wrk(url: &str, host: &str, seconds: u64, connections: usize, close: bool) -> Wrk {
    let mut cmd = Command::new("wrk");
    cmd.args([
        "-t1",
        &format!("-c{connections}"),
        &format!("-d{seconds}s"),
        "--latency",
    ])
    .args(["-H", &format!("Host: {host}")]);
    if close {
        cmd.args(["-H", "Connection: close"]);
    }
    let out = cmd.arg(url).output().unwrap_or_else(|e| panic!("wrk: {e}"));
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "wrk {url}: {text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let wrk = parse_wrk(&text);
    assert_eq!(wrk.errors, "none", "wrk saw errors against {url}:\n{text}");
    wrk
}

/// p50 and p99 (ms) at a fixed rate with `hey`.
fn hey_fixed(url: &str, host: &str, seconds: u64, rate: u64) -> (f64, f64) {
    let workers = 8;
    let out = Command::new("hey")
        .args(["-z", &format!("{seconds}s"), "-c", &workers.to_string()])
        .args(["-q", &(rate / workers).to_string(), "-host", host, url])
        .output()
        .unwrap_or_else(|e| panic!("hey: {e}"));
    parse_hey(&String::from_utf8_lossy(&out.stdout), url)
}
