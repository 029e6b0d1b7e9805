//! GAMMA routes at work (`cargo bench -p aether-tests --bench routes`, as root, after
//! `cargo build --workspace --bins --release`): the real registrar reading Gateway API YAML from its
//! `--routes-dir` (inotify), `aether-agent run` with the built-in CA (mTLS, the production default) and Envoy 1.40
//! at the production worker count (`aether-agent proxy --concurrency` and the chart default: 2), issue 18's three
//! figures:
//!
//! 1. Route write → served in every affected node's Envoy (goal p99 < 100 ms). N nodes (whole `Mesh` fixtures: the
//!    first runs the registrar, the others' agents join it) each with a pod depending on `bench/svc-0000`; each
//!    sample renames into place an HTTPRoute on that service whose header match carries a fresh marker, and per node
//!    times (a) the agent serving new virtual hosts of the `outbound` table (their `/debug/xds` versions: registrar
//!    inotify + 20 ms settle + projection + store + Watch + agent compile) and (b) Envoy's `/config_dump` holding the marker, both
//!    polled every 1 ms (the admin poll's own cost is printed). A sample is the slowest node. A reader's Watch on
//!    the registrar times the registrar's part alone (write → the route streamed).
//! 2. Envoy heap with 1,000 HTTPRoutes over 200 services vs none, on one node: 200 services × 2 stand-in endpoints
//!    registered at the registrar, one pod whose upstreams are all 200; 5 routes per service, each one rule of 3
//!    matches (path prefix; exact path + header; prefix + header + query) with a 90/10 split to another of the 200.
//!    Heap = `/memory` `allocated` 1 s after the node settled (dependency set known, every served resource ACKed,
//!    Envoy holding all 3,000 compiled matches), before, with and after removing the routes; per HTTPRoute and per
//!    Envoy route entry (over every table: one per consumer namespace); the RDS and VHDS bytes pushed (the agent's
//!    `xds_pushed` counter) and the route tables' size in Envoy. Asserts no NACK and no route skipped.
//! 3. Added latency of a 20-rule route table vs none: client pod → echo pod through both pods' node Envoy hops
//!    (mTLS), HTTP/1.1 keep-alive GETs at a fixed rate over a few connections, timed per request (µs resolution;
//!    `hey` prints 0.1 ms). The table is two HTTPRoutes on the echo port (16 + 4 rules: the CRD allows 16 per
//!    route); the first 19 rules match `/bench` plus a header the request lacks (higher precedence, so Envoy tries
//!    them all first); the 20th, plain `/bench`, is the one that matches. Runs alternate none / routed (the rule
//!    order in Envoy is checked each time); the first second of each run is warm-up and not counted. The run-to-run
//!    spread is printed next to the difference: on a busy machine it is the noise.
//!
//! Knobs (env): AETHER_BENCH_ROUTE_PARTS ("1,2,3"), AETHER_BENCH_ROUTE_NODES (3), AETHER_BENCH_ROUTE_WRITES (100),
//! AETHER_BENCH_ROUTE_SERVICES (200), AETHER_BENCH_ROUTES_PER_SERVICE (5), AETHER_BENCH_RATE (1000 req/s),
//! AETHER_BENCH_CONNECTIONS (8), AETHER_BENCH_DURATION (10 s per run), AETHER_BENCH_ROUNDS (3),
//! AETHER_BENCH_ENVOY_CONCURRENCY (2).

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use aether_proto::registrar::v1::{WatchRequest, change, watch_response};
use aether_tests::bench::{
    catalog_address, cluster_name, endpoint, knob, percentile, register_all, service_key, service_name, tail,
};
use aether_tests::echo::{EchoIdentity, EchoLedger, serve_echo};
use aether_tests::mesh::{Mesh, NAMESPACE, fqdn};
use aether_tests::{Envoy, TestPod, free_port, http_get, unique_base_id};
use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::TokioIo;

const VIRTUAL_HOST_TYPE: &str = "type.googleapis.com/envoy.config.route.v3.VirtualHost";
const OUTBOUND: &str = "outbound";
/// Envoy's dump of the shared outbound table only.
const OUTBOUND_PROBE: &str = "/config_dump?resource=dynamic_route_configs&name_regex=%5Eoutbound%24";
const POLL_EVERY: Duration = Duration::from_millis(1);
const ARRIVAL_TIMEOUT: Duration = Duration::from_secs(10);
const SETTLE_TIMEOUT: Duration = Duration::from_secs(180);
/// Quiet time between two writes, so each is its own change.
const WRITE_GAP: Duration = Duration::from_millis(50);
/// Quiet time between a settled node and a heap reading.
const QUIET: Duration = Duration::from_secs(1);
const WARM_UP: Duration = Duration::from_secs(1);
/// Compiled matches per route of part 2 (each becomes one Envoy route).
const MATCHES_PER_ROUTE: usize = 3;
const GOAL_P99: Duration = Duration::from_millis(100);
/// Part 3's route: rules in all, and where the client goes.
const RULES: usize = 20;
const BENCH_PATH: &str = "/bench";
const KIB: f64 = 1024.0;
const MIB: f64 = 1024.0 * 1024.0;

struct Knobs {
    parts: BTreeSet<usize>,
    nodes: usize,
    writes: usize,
    services: usize,
    per_service: usize,
    rate: usize,
    connections: usize,
    seconds: u64,
    rounds: usize,
    workers: usize,
}

impl Knobs {
    fn from_env() -> Knobs {
        let raw = std::env::var("AETHER_BENCH_ROUTE_PARTS").unwrap_or_else(|_| "1,2,3".into());
        let parts = raw
            .split(',')
            .map(|p| {
                p.trim()
                    .parse()
                    .unwrap_or_else(|e| panic!("AETHER_BENCH_ROUTE_PARTS={raw:?}: {p:?} ({e})"))
            })
            .collect();
        let k = Knobs {
            parts,
            nodes: knob("AETHER_BENCH_ROUTE_NODES", 3),
            writes: knob("AETHER_BENCH_ROUTE_WRITES", 100),
            services: knob("AETHER_BENCH_ROUTE_SERVICES", 200),
            per_service: knob("AETHER_BENCH_ROUTES_PER_SERVICE", 5),
            rate: knob("AETHER_BENCH_RATE", 1000),
            connections: knob("AETHER_BENCH_CONNECTIONS", 8),
            seconds: knob("AETHER_BENCH_DURATION", 10) as u64,
            rounds: knob("AETHER_BENCH_ROUNDS", 3),
            workers: knob("AETHER_BENCH_ENVOY_CONCURRENCY", 2),
        };
        assert!(
            k.nodes >= 1 && k.writes >= 1 && k.rounds >= 1,
            "nodes, writes and rounds must be ≥ 1"
        );
        assert!(
            k.services >= 2,
            "part 2 splits between two services: AETHER_BENCH_ROUTE_SERVICES ≥ 2"
        );
        assert!(k.connections >= 1 && k.rate >= k.connections, "rate ≥ connections ≥ 1");
        assert!(
            k.seconds > WARM_UP.as_secs(),
            "AETHER_BENCH_DURATION must exceed the warm-up"
        );
        k
    }
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return; // `cargo test --benches` probes harness=false benches with --list.
    }
    aether_tests::require_root();
    let k = Knobs::from_env();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let started = Instant::now();
    println!(
        "routes bench: real registrar (--routes-dir), agent with mTLS (built-in CA), Envoy 1.40 --concurrency {}; \
         {} CPUs, load average {}",
        k.workers,
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        load_average()
    );
    if k.parts.contains(&1) {
        rt.block_on(route_write_to_envoy(&k));
    }
    if k.parts.contains(&2) {
        rt.block_on(heap_per_route(&k));
    }
    if k.parts.contains(&3) {
        rt.block_on(added_latency(&k));
    }
    println!("total bench time {:.0} s", started.elapsed().as_secs_f64());
}

// ---- Nodes.

/// The node that runs the registrar, reading routes from `routes`; Envoy at `workers` workers.
async fn first_node(routes: &Path, workers: usize) -> Mesh {
    let dir = routes.display().to_string();
    let mut mesh = Mesh::start_with_registrar(&[], &["--routes-dir", &dir]).await;
    assert!(
        mesh.agent_args
            .windows(2)
            .any(|a| a[0] == "--identity" && a[1] == "builtin"),
        "the mesh's agent does not run with the built-in CA (mTLS): {:?}",
        mesh.agent_args
    );
    production_envoy(&mut mesh, workers);
    mesh
}

/// Another node whose agent uses `first`'s registrar (its own registrar is stopped).
async fn joining_node(first: &Mesh, workers: usize) -> Mesh {
    let mut mesh = Mesh::start().await;
    mesh.envoy = None;
    mesh.agent = None;
    mesh.registrar.kill();
    mesh.use_registrar_of(first);
    mesh.start_agent().await;
    production_envoy(&mut mesh, workers);
    mesh
}

/// Swaps the fixture's Envoy (1 worker) for one with the production worker count.
fn production_envoy(mesh: &mut Mesh, workers: usize) {
    mesh.envoy = None;
    let bootstrap = mesh.envoy_bootstrap(free_port());
    let workers = workers.to_string();
    mesh.envoy = Some(Envoy::start_with_args(
        &bootstrap,
        unique_base_id(),
        &["--concurrency", &workers],
    ));
}

/// Describes and adds a pod `name` (service account `account`) whose upstreams are `upstreams`.
async fn add_caller(mesh: &Mesh, name: &str, account: &str, upstreams: &str) -> TestPod {
    let pod = mesh.node.add_pod(name);
    mesh.describe_pod(&pod, name, account, upstreams, &[("http", 8080)]);
    // The static pod source polls its directory every 200 ms.
    tokio::time::sleep(Duration::from_millis(600)).await;
    mesh.add_pod_ok(&pod, name).await;
    pod
}

/// Writes a routes file whole (rename into place: the registrar never reads half of it).
fn put_routes(dir: &Path, file: &str, yaml: &str) {
    let partial = dir.join(format!(".{file}.partial"));
    std::fs::write(&partial, yaml).unwrap_or_else(|e| panic!("writing {}: {e}", partial.display()));
    std::fs::rename(&partial, dir.join(file)).unwrap_or_else(|e| panic!("renaming into {file}: {e}"));
}

fn agent_tail(mesh: &Mesh, lines: usize) -> String {
    tail(&mesh.agent.as_ref().map(|a| a.logs()).unwrap_or_default(), lines)
}

async fn admin_get(addr: SocketAddr, path: &str) -> Result<String, String> {
    let reply = http_get(&format!("http://{addr}{path}"), None).await?;
    match reply.status {
        200 => Ok(reply.body),
        status => Err(format!("{addr}{path}: status {status}: {}", tail(&reply.body, 5))),
    }
}

async fn agent_json(mesh: &Mesh, path: &str) -> serde_json::Value {
    let body = admin_get(mesh.agent_admin, path)
        .await
        .unwrap_or_else(|e| panic!("agent admin {e}; agent log tail:\n{}", agent_tail(mesh, 30)));
    serde_json::from_str(&body).unwrap_or_else(|e| panic!("agent {path} is not JSON ({e}): {body}"))
}

async fn envoy_json(mesh: &Mesh, path: &str) -> serde_json::Value {
    let envoy = mesh.envoy();
    let body = admin_get(envoy.admin_addr(), path)
        .await
        .unwrap_or_else(|e| panic!("Envoy admin {e}; Envoy log tail:\n{}", tail(&envoy.logs(), 20)));
    serde_json::from_str(&body).unwrap_or_else(|e| panic!("Envoy {path} is not JSON ({e})"))
}

/// What the agent serves of the shared outbound table: the versions of its virtual hosts (VHDS).
async fn served_outbound(mesh: &Mesh) -> Option<String> {
    let xds = agent_json(mesh, "/debug/xds").await;
    let prefix = format!("{OUTBOUND}/");
    let vhosts = xds["types"][VIRTUAL_HOST_TYPE].as_object()?;
    let versions: Vec<&str> = (vhosts.iter())
        .filter(|(name, _)| name.starts_with(&prefix))
        .filter_map(|(_, v)| v["served"].as_str())
        .collect();
    (!versions.is_empty()).then(|| versions.join(","))
}

/// The sum of the agent's metric samples whose name contains `name` and whose line contains `label`.
async fn agent_metric(mesh: &Mesh, name: &str, label: &str) -> Option<f64> {
    let text = admin_get(mesh.agent_admin, "/metrics").await.ok()?;
    let values: Vec<f64> = text
        .lines()
        .filter(|l| !l.starts_with('#') && l.contains(label))
        .filter(|l| l.split(['{', ' ']).next().is_some_and(|n| n.contains(name)))
        .filter_map(|l| l.rsplit(' ').next()?.parse().ok())
        .collect();
    (!values.is_empty()).then(|| values.iter().sum())
}

/// The machine's load average (other work on it moves latencies).
fn load_average() -> String {
    let raw = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    raw.split_whitespace().take(3).collect::<Vec<_>>().join(" ")
}

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1e3)
}

// ---- 1. Route write → served in every node's Envoy.

/// The route of part 1: requests carrying the marker go to svc-0001, the rest to svc-0000.
fn marker_route(marker: &str) -> String {
    format!(
        r#"apiVersion: gateway.networking.k8s.io/v1
kind: HTTPRoute
metadata: {{name: marker, namespace: bench}}
spec:
  parentRefs:
  - {{group: "", kind: Service, name: svc-0000, port: 8080}}
  rules:
  - matches:
    - headers:
      - {{name: x-bench-marker, value: "{marker}"}}
    backendRefs:
    - {{name: svc-0001, port: 8080}}
  - backendRefs:
    - {{name: svc-0000, port: 8080}}
"#
    )
}

/// When one node had a write: the agent serving a new outbound table, and Envoy holding the marker.
struct Arrival {
    served: Duration,
    in_envoy: Duration,
}

/// A reader's Watch of `bench/svc-0000` at the registrar: when each route put arrives, with the route as text.
struct RegistrarTap {
    _requests: tokio::sync::mpsc::Sender<WatchRequest>,
    puts: tokio::sync::mpsc::UnboundedReceiver<(Instant, String)>,
}

impl RegistrarTap {
    async fn start(first: &Mesh) -> RegistrarTap {
        let (requests, outbox) = tokio::sync::mpsc::channel(1);
        let watch = WatchRequest {
            services: vec![service_key(0)],
            filter_id: 1,
            ..Default::default()
        };
        requests.send(watch).await.unwrap();
        let mut stream = first
            .registrar()
            .await
            .watch(tokio_stream::wrappers::ReceiverStream::new(outbox))
            .await
            .expect("a reader's Watch")
            .into_inner();
        let (tx, puts) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(async move {
            while let Ok(Some(response)) = stream.message().await {
                let Some(watch_response::Event::Delta(delta)) = response.event else {
                    continue;
                };
                for change in delta.changes {
                    if let Some(change::Change::RoutePut(route)) = change.change {
                        let _ = tx.send((Instant::now(), format!("{route:?}")));
                    }
                }
            }
        });
        RegistrarTap {
            _requests: requests,
            puts,
        }
    }

    /// When the registrar streamed the route carrying `marker`, after `t0` (None if it did not within a second).
    async fn streamed(&mut self, marker: &str, t0: Instant) -> Option<Duration> {
        loop {
            let (at, route) = tokio::time::timeout(Duration::from_secs(1), self.puts.recv())
                .await
                .ok()??;
            if route.contains(marker) {
                return Some(at - t0);
            }
        }
    }
}

/// Part 1's measurements.
#[derive(Default)]
struct Times {
    /// Write → in Envoy on the slowest node: the samples.
    slowest: Vec<Duration>,
    /// Write → the registrar streaming the route to a reader.
    streamed: Vec<Duration>,
    /// Samples whose route the reader did not see (none expected).
    untapped: usize,
    /// Per node: write → the agent serving the table's new virtual hosts.
    served: Vec<Duration>,
    /// Per node: the agent serving it → in Envoy.
    envoy: Vec<Duration>,
    /// Every Envoy admin poll's own time.
    polls: Vec<Duration>,
}

async fn route_write_to_envoy(k: &Knobs) {
    let routes = tempfile::tempdir().unwrap();
    let first = first_node(routes.path(), k.workers).await;
    let stand_ins = (0..2).map(|n| endpoint(n, catalog_address(n), n)).collect();
    register_all(&first, stand_ins, 2).await;
    let mut nodes = vec![first];
    while nodes.len() < k.nodes {
        let node = joining_node(&nodes[0], k.workers).await;
        nodes.push(node);
    }
    let mut pods = Vec::new();
    for (i, node) in nodes.iter().enumerate() {
        pods.push(add_caller(node, &format!("caller-{i}"), "caller", &service_key(0)).await);
    }
    let mut tap = RegistrarTap::start(&nodes[0]).await;
    // The first write pulls svc-0001 into every node's dependency set: not a sample.
    let mut t = Times::default();
    write_and_wait(routes.path(), "warm-up", &nodes, &mut t.polls).await;
    for i in 0..k.writes {
        tokio::time::sleep(WRITE_GAP).await;
        let marker = format!("marker-{i:05}");
        let (t0, arrivals) = write_and_wait(routes.path(), &marker, &nodes, &mut t.polls).await;
        t.slowest.push(arrivals.iter().map(|a| a.in_envoy).max().unwrap());
        t.served.extend(arrivals.iter().map(|a| a.served));
        t.envoy.extend(arrivals.iter().map(|a| a.in_envoy - a.served));
        match tap.streamed(&marker, t0).await {
            Some(d) => t.streamed.push(d),
            None => t.untapped += 1,
        }
    }
    print_route_writes(k, t);
    drop(pods);
}

/// Writes the marker route and waits until every node's Envoy holds it (panics with log tails after
/// [`ARRIVAL_TIMEOUT`]); when it wrote and each node's arrival, and every Envoy poll's own time into `polls`.
async fn write_and_wait(
    dir: &Path,
    marker: &str,
    nodes: &[Mesh],
    polls: &mut Vec<Duration>,
) -> (Instant, Vec<Arrival>) {
    let before = futures::future::join_all(nodes.iter().map(served_outbound)).await;
    let t0 = Instant::now();
    put_routes(dir, "marker.yaml", &marker_route(marker));
    let waits = nodes.iter().zip(before).map(|(node, v0)| arrival(node, v0, marker, t0));
    let results = futures::future::join_all(waits).await;
    let mut arrivals = Vec::new();
    for (i, result) in results.into_iter().enumerate() {
        match result {
            Ok((a, p)) => {
                arrivals.push(a);
                polls.extend(p);
            }
            Err(e) => panic!(
                "node {i}: {e}\n--- agent log tail ---\n{}\n--- registrar log tail ---\n{}",
                agent_tail(&nodes[i], 40),
                tail(&nodes[0].registrar.logs(), 30)
            ),
        }
    }
    (t0, arrivals)
}

/// One node: polls its agent until it serves a new outbound table, then its Envoy until the table holds `marker`.
async fn arrival(
    node: &Mesh,
    before: Option<String>,
    marker: &str,
    t0: Instant,
) -> Result<(Arrival, Vec<Duration>), String> {
    let served = loop {
        if served_outbound(node).await.is_some_and(|v| Some(&v) != before.as_ref()) {
            break t0.elapsed();
        }
        if t0.elapsed() > ARRIVAL_TIMEOUT {
            return Err(format!(
                "the agent served no new outbound table within {ARRIVAL_TIMEOUT:?} ({marker})"
            ));
        }
        tokio::time::sleep(POLL_EVERY).await;
    };
    let needle = format!("\"{marker}\"");
    let mut polls = Vec::new();
    loop {
        let asked = Instant::now();
        let body = admin_get(node.envoy().admin_addr(), OUTBOUND_PROBE).await;
        polls.push(asked.elapsed());
        if body.as_ref().is_ok_and(|b| b.contains(&needle)) {
            let arrival = Arrival {
                served,
                in_envoy: t0.elapsed(),
            };
            return Ok((arrival, polls));
        }
        if t0.elapsed() > ARRIVAL_TIMEOUT {
            return Err(format!(
                "Envoy did not hold {marker} within {ARRIVAL_TIMEOUT:?} (served {}); last probe: {:?}",
                ms(served),
                body.map(|b| tail(&b, 40))
            ));
        }
        tokio::time::sleep(POLL_EVERY).await;
    }
}

fn print_route_writes(k: &Knobs, mut t: Times) {
    for v in [
        &mut t.slowest,
        &mut t.streamed,
        &mut t.served,
        &mut t.envoy,
        &mut t.polls,
    ] {
        v.sort();
    }
    let row = |label: &str, v: &[Duration]| {
        println!(
            "  {label:<62} p50 {:>8}  p99 {:>8}  max {:>8}",
            ms(percentile(v, 0.5)),
            ms(percentile(v, 0.99)),
            ms(v.last().copied().unwrap_or_default())
        );
    };
    println!(
        "1. route write (rename into --routes-dir) → served in every node's Envoy: {} node(s) sharing one registrar, \
         {} writes, polls every {} (one Envoy admin poll itself: p50 {}, p99 {})",
        k.nodes,
        t.slowest.len(),
        ms(POLL_EVERY),
        ms(percentile(&t.polls, 0.5)),
        ms(percentile(&t.polls, 0.99))
    );
    row("write → in Envoy on the slowest node (the sample)", &t.slowest);
    row(
        "  write → registrar streams it (a reader's Watch, 20 ms settle incl.)",
        &t.streamed,
    );
    row("  write → agent serving the new virtual hosts (per node)", &t.served);
    row("  agent serving → in Envoy's config dump (per node)", &t.envoy);
    if t.untapped > 0 {
        println!("  ({} writes not seen on the reader's Watch)", t.untapped);
    }
    let p99 = percentile(&t.slowest, 0.99);
    println!(
        "  goal p99 < {}: {} → {}",
        ms(GOAL_P99),
        ms(p99),
        if p99 < GOAL_P99 { "MET" } else { "MISSED" }
    );
}

// ---- 2. Envoy heap per route.

/// `per_service` HTTPRoutes on each of `services` services, each one rule of [`MATCHES_PER_ROUTE`] matches and a
/// 90/10 split to another service; one multi-document file.
fn many_routes(services: usize, per_service: usize) -> String {
    let mut yaml = String::new();
    for s in 0..services {
        for j in 0..per_service {
            let canary = service_name((s + 1 + j) % services);
            yaml += &format!(
                r#"---
apiVersion: gateway.networking.k8s.io/v1
kind: HTTPRoute
metadata: {{name: r-{s:04}-{j}, namespace: bench}}
spec:
  parentRefs:
  - {{group: "", kind: Service, name: {svc}, port: 8080}}
  rules:
  - matches:
    - path: {{type: PathPrefix, value: /api/v{j}/items}}
    - path: {{type: Exact, value: /r{j}/exact}}
      headers:
      - {{name: x-tenant, value: t{j}}}
    - path: {{type: PathPrefix, value: /r{j}}}
      headers:
      - {{name: x-tenant, value: t{j}}}
      queryParams:
      - {{name: shard, value: "{j}"}}
    backendRefs:
    - {{name: {svc}, port: 8080, weight: 90}}
    - {{name: {canary}, port: 8080, weight: 10}}
"#,
                svc = service_name(s),
            );
        }
    }
    yaml
}

/// Envoy's outbound tables: the compiled routes of bench routes in the shared table and in all tables, and
/// each table's size as compact JSON.
async fn envoy_tables(mesh: &Mesh) -> (usize, usize, BTreeMap<String, usize>) {
    let dump = envoy_json(mesh, "/config_dump?resource=dynamic_route_configs").await;
    let (mut shared, mut all, mut sizes) = (0, 0, BTreeMap::new());
    for entry in dump["configs"].as_array().into_iter().flatten() {
        let table = &entry["route_config"];
        let name = table["name"].as_str().unwrap_or_default().to_owned();
        let compiled = table["virtual_hosts"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|v| v["routes"].as_array().into_iter().flatten())
            .filter(|r| r["name"].as_str().is_some_and(|n| n.starts_with("http/bench/")))
            .count();
        if name == OUTBOUND {
            shared = compiled;
        }
        all += compiled;
        sizes.insert(name, serde_json::to_string(table).unwrap().len());
    }
    (shared, all, sizes)
}

/// Waits until the agent watches and knows its dependency set (all of `services` and more), Envoy has ACKed every
/// served resource, holds every service's cluster, and its shared table has `compiled` bench routes.
async fn settle(mesh: &Mesh, services: &BTreeSet<String>, compiled: usize) -> Duration {
    let started = Instant::now();
    loop {
        let deps = aether_tests::bench::dependencies(mesh).await;
        let xds = agent_json(mesh, "/debug/xds").await;
        let unacked = xds["types"]
            .as_object()
            .into_iter()
            .flat_map(|m| m.values())
            .flat_map(|resources| resources.as_object().into_iter().flat_map(|m| m.values()))
            .filter(|r| r["served"] != r["acked"])
            .count();
        let clusters: BTreeSet<String> = mesh.envoy_clusters().into_iter().collect();
        let missing = (0..services.len())
            .filter(|s| !clusters.contains(&cluster_name(*s)))
            .count();
        let (held, _, _) = envoy_tables(mesh).await;
        let known = deps.wanted == deps.watched && deps.wanted == deps.known && deps.wanted.is_superset(services);
        if known && unacked == 0 && missing == 0 && held == compiled {
            return started.elapsed();
        }
        assert!(
            started.elapsed() < SETTLE_TIMEOUT,
            "the node did not settle within {SETTLE_TIMEOUT:?} (dependencies known: {known}, {unacked} resources \
             not ACKed, {missing} service clusters missing, {held} of {compiled} compiled routes in Envoy); agent \
             log tail:\n{}",
            agent_tail(mesh, 60)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// `/memory`'s `allocated` (bytes in use: Envoy's heap), [`QUIET`] after the node settled.
async fn quiet_heap(mesh: &Mesh) -> u64 {
    tokio::time::sleep(QUIET).await;
    let memory = envoy_json(mesh, "/memory").await;
    memory["allocated"]
        .as_str()
        .and_then(|s| s.parse().ok())
        .or_else(|| memory["allocated"].as_u64())
        .unwrap_or_else(|| panic!("Envoy /memory has no numeric \"allocated\": {memory}"))
}

/// Route bytes pushed so far (tables and their VHDS virtual hosts), and routes NACKed so far, by the agent's
/// counters.
async fn route_pushes(mesh: &Mesh) -> (f64, f64) {
    let (mut pushed, mut nacks) = (None, 0.0);
    // (An Envoy on SotW ADS is sent no VirtualHost.)
    for kind in ["RouteConfiguration", "VirtualHost"] {
        let label = format!("type=\"{kind}\"");
        if let Some(bytes) = agent_metric(mesh, "xds_pushed", &label).await {
            pushed = Some(pushed.unwrap_or(0.0) + bytes);
        }
        nacks += agent_metric(mesh, "xds_nacks", &label).await.unwrap_or(0.0);
    }
    let pushed = pushed.unwrap_or_else(|| panic!("the agent's /metrics has no xds_pushed for route tables"));
    (pushed, nacks)
}

async fn heap_per_route(k: &Knobs) {
    let routes = tempfile::tempdir().unwrap();
    let mesh = first_node(routes.path(), k.workers).await;
    let stand_ins = (0..k.services * 2)
        .map(|n| endpoint(n % k.services, catalog_address(n), n))
        .collect();
    register_all(&mesh, stand_ins, 32).await;
    let services: BTreeSet<String> = (0..k.services).map(service_key).collect();
    let upstreams: Vec<&str> = services.iter().map(String::as_str).collect();
    let pod = add_caller(&mesh, "caller", "caller", &upstreams.join(",")).await;
    settle(&mesh, &services, 0).await;
    let none = quiet_heap(&mesh).await;
    let (pushed_before, _) = route_pushes(&mesh).await;

    let count = k.services * k.per_service;
    let t0 = Instant::now();
    put_routes(routes.path(), "routes.yaml", &many_routes(k.services, k.per_service));
    settle(&mesh, &services, count * MATCHES_PER_ROUTE).await;
    let applied = t0.elapsed();
    let with = quiet_heap(&mesh).await;
    let (pushed_after, nacks) = route_pushes(&mesh).await;
    let (_, entries, sizes) = envoy_tables(&mesh).await;
    let invalid = agent_metric(&mesh, "invalid_routes", "").await.unwrap_or(0.0);
    assert!(
        nacks == 0.0,
        "Envoy NACKed route tables ({nacks}); agent log tail:\n{}",
        agent_tail(&mesh, 40)
    );
    assert!(
        invalid == 0.0,
        "the agent skipped {invalid} routes; agent log tail:\n{}",
        agent_tail(&mesh, 40)
    );

    std::fs::remove_file(routes.path().join("routes.yaml")).unwrap();
    settle(&mesh, &services, 0).await;
    let removed = quiet_heap(&mesh).await;
    println!(
        "2. Envoy heap (/memory allocated, {}s after settling), 1 node, 1 pod depending on {} services × 2 endpoints; \
         {count} HTTPRoutes ({} per service, 1 rule × {MATCHES_PER_ROUTE} matches, 90/10 split) = {} Envoy routes \
         per outbound table, applied in {}",
        QUIET.as_secs(),
        k.services,
        k.per_service,
        count * MATCHES_PER_ROUTE,
        ms(applied)
    );
    println!(
        "  no routes {:.2} MiB | {count} routes {:.2} MiB | routes removed {:.2} MiB  →  {:.2} KiB per HTTPRoute \
         ({:.2} KiB per Envoy route entry: {entries} over all tables)",
        none as f64 / MIB,
        with as f64 / MIB,
        removed as f64 / MIB,
        (with as f64 - none as f64) / count as f64 / KIB,
        (with as f64 - none as f64) / entries.max(1) as f64 / KIB
    );
    let tables: Vec<String> = sizes
        .iter()
        .map(|(name, bytes)| format!("{name} {:.2} MB", *bytes as f64 / 1e6))
        .collect();
    println!(
        "  RDS + VHDS pushed for the change: {:.2} MB (agent xds_pushed, encoded protobuf); tables in Envoy as compact JSON: \
         {}; 0 NACKs, 0 invalid routes",
        (pushed_after - pushed_before) / 1e6,
        tables.join(", ")
    );
    drop(pod);
}

// ---- 3. Added latency of a 20-rule table.

/// Part 3's routes on `echo`, two HTTPRoutes since one holds at most 16 rules: rules 1–19 need a header the client
/// does not send (and go to a service that does not exist: a 500 shows they are served); rule 20, `/bench` alone,
/// ranks last (fewer header matches) and is the one the client's requests take.
fn twenty_rules() -> String {
    let header_rule = |r: usize| {
        format!(
            "  - matches:\n    - path: {{type: PathPrefix, value: {BENCH_PATH}}}\n      headers:\n      - {{name: \
             x-bench-rule, value: r{r}}}\n    backendRefs:\n    - {{name: echo-absent, port: 8080}}\n"
        )
    };
    let route = |name: &str, rules: String| {
        format!(
            "---\napiVersion: gateway.networking.k8s.io/v1\nkind: HTTPRoute\nmetadata: {{name: {name}, namespace: \
             {NAMESPACE}}}\nspec:\n  parentRefs:\n  - {{group: \"\", kind: Service, name: echo, port: 8080}}\n  rules:\n\
             {rules}"
        )
    };
    let first: String = (1..=16).map(header_rule).collect();
    let mut second: String = (17..RULES).map(header_rule).collect();
    second += &format!(
        "  - matches:\n    - path: {{type: PathPrefix, value: {BENCH_PATH}}}\n    backendRefs:\n    - {{name: echo, \
         port: 8080}}\n"
    );
    route("rules-1-16", first) + &route("rules-17-20", second)
}

/// Where Envoy's shared table puts the rule the client's requests take, among the echo port's routes (0-based) and
/// how many there are: it must come after the 19 others.
async fn matched_rule_position(mesh: &Mesh) -> Option<(usize, usize)> {
    let dump = envoy_json(mesh, OUTBOUND_PROBE).await;
    let matched = "http/demo/rules-17-20/3";
    let hosts = dump["configs"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|c| c["route_config"]["virtual_hosts"].as_array().into_iter().flatten());
    for host in hosts {
        let names: Vec<&str> = host["routes"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|r| r["name"].as_str().unwrap_or_default())
            .collect();
        if let Some(at) = names.iter().position(|n| *n == matched) {
            return Some((at, names.len()));
        }
    }
    None
}

/// The client's request through its outbound listener, with `headers`; the status.
async fn status_of(client: &TestPod, headers: &[(&str, &str)]) -> u16 {
    let url = format!("http://127.0.0.1:18081{BENCH_PATH}");
    let host = format!("{}:8080", fqdn("echo"));
    match client.http_request("GET", &url, Some(&host), headers, "").await {
        Ok(reply) => reply.status,
        Err(_) => 0,
    }
}

/// Waits until a plain request gets 200, and one with rule 1's and one with rule 19's header (one in each route)
/// `headed` (500 with the routes, 200 without).
async fn wait_for(mesh: &Mesh, client: &TestPod, headed: u16) {
    let started = Instant::now();
    loop {
        let plain = status_of(client, &[]).await;
        let first = status_of(client, &[("x-bench-rule", "r1")]).await;
        let last = status_of(client, &[("x-bench-rule", &format!("r{}", RULES - 1))]).await;
        if plain == 200 && first == headed && last == headed {
            return;
        }
        assert!(
            started.elapsed() < ARRIVAL_TIMEOUT * 3,
            "routing did not settle (plain {plain}, with rule 1's header {first}, rule 19's {last}; want 200, \
             {headed}, {headed}); agent log tail:\n{}\nregistrar log tail:\n{}",
            agent_tail(mesh, 40),
            tail(&mesh.registrar.logs(), 20)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn added_latency(k: &Knobs) {
    let routes = tempfile::tempdir().unwrap();
    let mesh = first_node(routes.path(), k.workers).await;
    let echo = mesh.node.add_pod("echo");
    let who = EchoIdentity {
        pod: "echo".into(),
        namespace: NAMESPACE.into(),
        service: "echo".into(),
    };
    let server = serve_echo(&echo, "0.0.0.0:8080".parse().unwrap(), who, EchoLedger::default());
    mesh.describe_pod(&echo, "echo", "echo", "", &[("http", 8080)]);
    mesh.add_pod_ok(&echo, "echo").await;
    let client = add_caller(&mesh, "client", "client", "echo").await;
    wait_for(&mesh, &client, 200).await;
    println!(
        "3. added latency of a {RULES}-rule route table (the request matches the last rule) vs none: client pod → echo \
         pod through the node Envoy (mTLS), HTTP/1.1 GET at {} req/s over {} keep-alive connections, {} s per run \
         ({} s warm-up not counted), runs alternating",
        k.rate,
        k.connections,
        k.seconds,
        WARM_UP.as_secs()
    );
    let mut runs = Vec::new();
    for round in 0..k.rounds {
        for with_route in [false, true] {
            set_twenty_rules(&mesh, &client, routes.path(), with_route).await;
            let mut samples = fixed_rate(&client, k);
            samples.sort();
            let label = if with_route { "20 rules" } else { "no route" };
            print_latency(&format!("round {} {label}", round + 1), &samples);
            runs.push((with_route, samples));
        }
    }
    print_added_latency(&runs);
    drop((server, client, echo));
}

/// Writes or removes part 3's routes and waits until the client's requests show it.
async fn set_twenty_rules(mesh: &Mesh, client: &TestPod, dir: &Path, on: bool) {
    let file = dir.join("twenty-rules.yaml");
    if on {
        put_routes(dir, "twenty-rules.yaml", &twenty_rules());
        wait_for(mesh, client, 500).await;
        let position = matched_rule_position(mesh).await;
        assert!(
            position.is_some_and(|(at, _)| at == RULES - 1),
            "the rule the requests take is not the {RULES}th in Envoy's table: (position, routes) = {position:?}"
        );
    } else if file.exists() {
        std::fs::remove_file(&file).unwrap();
        wait_for(mesh, client, 200).await;
    }
}

/// All runs of each kind pooled, the difference, and how far runs of one kind differ among themselves (the noise
/// the difference must stand out from).
fn print_added_latency(runs: &[(bool, Vec<Duration>)]) {
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    let mut pooled = [Vec::new(), Vec::new()];
    let mut spread = [(f64::MAX, f64::MIN, f64::MAX, f64::MIN); 2];
    for (with_route, samples) in runs {
        let i = usize::from(*with_route);
        pooled[i].extend_from_slice(samples);
        let (p50, p99) = (us(percentile(samples, 0.5)), us(percentile(samples, 0.99)));
        let s = &mut spread[i];
        *s = (s.0.min(p50), s.1.max(p50), s.2.min(p99), s.3.max(p99));
    }
    for v in &mut pooled {
        v.sort();
    }
    let [none, routed] = &pooled;
    print_latency("all rounds, no route", none);
    print_latency(&format!("all rounds, {RULES} rules"), routed);
    println!(
        "  the {RULES}-rule table adds p50 {:+.0} µs, p99 {:+.0} µs; run-to-run spread of the same kind: p50 {:.0} / \
         {:.0} µs, p99 {:.0} / {:.0} µs (no route / {RULES} rules)",
        us(percentile(routed, 0.5)) - us(percentile(none, 0.5)),
        us(percentile(routed, 0.99)) - us(percentile(none, 0.99)),
        spread[0].1 - spread[0].0,
        spread[1].1 - spread[1].0,
        spread[0].3 - spread[0].2,
        spread[1].3 - spread[1].2
    );
}

fn print_latency(label: &str, sorted: &[Duration]) {
    println!(
        "  {label:<28} {:>7} requests  p50 {:.3} ms  p99 {:.3} ms  max {:.3} ms  (load average {})",
        sorted.len(),
        percentile(sorted, 0.5).as_secs_f64() * 1e3,
        percentile(sorted, 0.99).as_secs_f64() * 1e3,
        sorted.last().copied().unwrap_or_default().as_secs_f64() * 1e3,
        load_average()
    );
}

/// GETs at `k.rate` req/s over `k.connections` keep-alive connections from inside `client` (a thread of its own in
/// the pod's netns, with its own runtime) for `k.seconds`; the latency of each sent after the warm-up. Panics on any
/// failed request.
fn fixed_rate(client: &TestPod, k: &Knobs) -> Vec<Duration> {
    let host = format!("{}:8080", fqdn("echo"));
    let (connections, every) = (
        k.connections,
        Duration::from_secs_f64(k.connections as f64 / k.rate as f64),
    );
    let seconds = k.seconds;
    client.run(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let start = tokio::time::Instant::now();
            let workers = (0..connections).map(|c| {
                // Staggered, so the requests are spread over each period.
                let first = start + every.mul_f64(c as f64 / connections as f64);
                paced(
                    host.clone(),
                    first,
                    every,
                    start + Duration::from_secs(seconds),
                    start + WARM_UP,
                )
            });
            let results = futures::future::join_all(workers).await;
            results
                .into_iter()
                .flat_map(|r| r.unwrap_or_else(|e| panic!("fixed-rate load: {e}")))
                .collect()
        })
    })
}

/// One connection: a GET every `every` from `first` until `end`; the latencies of those sent after `counted`.
async fn paced(
    host: String,
    first: tokio::time::Instant,
    every: Duration,
    end: tokio::time::Instant,
    counted: tokio::time::Instant,
) -> Result<Vec<Duration>, String> {
    let stream = tokio::net::TcpStream::connect("127.0.0.1:18081")
        .await
        .map_err(|e| format!("connect: {e}"))?;
    stream.set_nodelay(true).map_err(|e| e.to_string())?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| format!("handshake: {e}"))?;
    tokio::spawn(conn);
    let mut tick = tokio::time::interval_at(first, every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut latencies = Vec::new();
    loop {
        let at = tick.tick().await;
        if at >= end {
            return Ok(latencies);
        }
        let request = hyper::Request::get(BENCH_PATH)
            .header(hyper::header::HOST, &host)
            .body(Empty::<Bytes>::new())
            .expect("request");
        let sent = Instant::now();
        let response = sender
            .send_request(request)
            .await
            .map_err(|e| format!("request: {e}"))?;
        let status = response.status();
        let body = response.into_body().collect().await.map_err(|e| format!("body: {e}"))?;
        let took = sent.elapsed();
        if status != 200 {
            return Err(format!(
                "status {status}: {:?}",
                String::from_utf8_lossy(&body.to_bytes())
            ));
        }
        if at >= counted {
            latencies.push(took);
        }
    }
}
