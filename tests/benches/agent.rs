//! The node agent at scale (`cargo bench -p aether-tests --bench agent`, as root, after
//! `cargo build --workspace --bins --release`): a real registrar, `aether-agent run` and
//! Envoy 1.40 (the `aether_tests::mesh::Mesh` fixture), mTLS on.
//!
//! Node A, once per shape, each a fresh node: a catalog of 2,000 services / 20,000 endpoints
//! (`bench/svc-NNNN`, fake 10.64.x.y addresses, one HTTP port 8080) registered straight at the
//! registrar, 64 calls in flight; then 100 pods (network namespaces, no app) added one after the
//! other through the CNI API, each declaring 20 upstreams drawn uniformly from the catalog. The
//! shapes (issue 16): every pod its own draw (100 workloads), then 10 workloads whose replicas
//! share one drawn list.
//!
//! Prints for each shape, one line each:
//! - AddPod latency (p50/p99: each AddPod returns once Envoy ACKed the pod's listeners), the time
//!   until the whole node config is ACKed, and what each AddPod pushed;
//! - endpoint change → applied by Envoy: RegisterEndpoint of a new address in a service
//!   of the node's dependency set, until Envoy's admin (EDS config dump of that cluster,
//!   which Envoy builds from the cluster's live host set) shows the address, polled every
//!   1 ms from a dedicated thread;
//! - the agent's VmRSS / VmHWM after setup and after the changes;
//! - the node's footprint: the xDS resources Envoy holds (clusters, endpoint assignments,
//!   listeners, RDS tables as compact JSON from `/config_dump?include_eds`, each once), the
//!   whole dump by section, counts, and Envoy's `/memory`.
//!
//! Then node B, the same node without demand scoping: a second agent + Envoy on the last node
//! A's registrar whose 100 pods (of that shape's workloads) each declare all 2,000 services; its
//! footprint against each shape of node A is demand scoping's effect.
//!
//! An AddPod that fails is reported (with log tails) and the rest is measured on the
//! pods added so far.
//!
//! Knobs (env): AETHER_BENCH_SERVICES (2000), AETHER_BENCH_ENDPOINTS_PER_SERVICE (10),
//! AETHER_BENCH_PODS (100), AETHER_BENCH_UPSTREAMS (20), AETHER_BENCH_UPSTREAM_SETS ("100,10":
//! node A's shapes as workload counts; N = pods: every pod draws its own upstreams),
//! AETHER_BENCH_CHANGES (200), AETHER_BENCH_SKIP_FULL (1: no node B).

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use aether_proto::cni::v1::Outcome;
use aether_proto::registrar::v1::RegisterEndpointRequest;
use aether_proto::registry::v1::Endpoint;
use aether_tests::TestPod;
use aether_tests::bench::{
    StandInAgents, catalog_address, cluster_name, endpoint, knob, percentile, proc_status, register_all, service_key,
    tail, xds_ack_means,
};
use aether_tests::mesh::Mesh;

const LOAD_CONCURRENCY: usize = 64;
const SETTLE_TIMEOUT: Duration = Duration::from_secs(180);
const CHANGE_TIMEOUT: Duration = Duration::from_secs(10);
const POLL_EVERY: Duration = Duration::from_millis(1);
/// Quiet time between two measured changes, so each is its own push.
const CHANGE_GAP: Duration = Duration::from_millis(20);
const CLUSTER_TYPE: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";

/// xorshift64*: reproducible draws without a dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    /// `k` distinct values of `0..n`, sorted.
    fn distinct(&mut self, k: usize, n: usize) -> BTreeSet<usize> {
        let mut out = BTreeSet::new();
        while out.len() < k.min(n) {
            out.insert(self.below(n));
        }
        out
    }
}

/// Addresses of the measured changes, apart from the catalog's.
fn change_address(i: usize) -> String {
    format!("10.250.{}.{}", i / 250, i % 250 + 1)
}

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1e3)
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1024.0 * 1024.0))
}

fn agent_pid(mesh: &Mesh) -> u32 {
    mesh.agent.as_ref().expect("agent running").pid()
}

/// Waits until the agent watches exactly its dependency set, knows every service of
/// it, and Envoy has ACKed every resource served (and holds as many active clusters).
/// Returns the time it took.
async fn settle(mesh: &Mesh, what: &str) -> Duration {
    let started = Instant::now();
    let mut last;
    loop {
        let aether_tests::bench::Dependencies {
            wanted,
            watched,
            known,
            own_only,
        } = aether_tests::bench::dependencies(mesh).await;
        if wanted != watched || known != wanted {
            last = format!(
                "dependencies {}, watched {}, known {}",
                wanted.len(),
                watched.len(),
                known.len()
            );
        } else {
            let xds: serde_json::Value = serde_json::from_str(&mesh.agent_get("/debug/xds").await).unwrap();
            let mut unacked = 0;
            for resources in xds["types"].as_object().into_iter().flat_map(|m| m.values()) {
                for r in resources.as_object().into_iter().flat_map(|m| m.values()) {
                    if r["served"] != r["acked"] {
                        unacked += 1;
                    }
                }
            }
            // Every known service (all have endpoints on one port) but the pods' own ones no
            // pod here calls is one cluster (its port's; the bare name is served only on
            // demand); each local pod adds its own (delivery, and with mTLS its originate
            // cluster), which are not counted here.
            let clusters = xds["types"][CLUSTER_TYPE].as_object();
            let served_clusters = clusters.map_or(0, |m| m.len());
            let service_clusters = clusters.map_or(0, |m| {
                m.keys()
                    .filter(|n| !n.starts_with("local|") && !n.starts_with("originate|"))
                    .count()
            });
            let expected = known.difference(&own_only).count();
            if unacked == 0 && service_clusters == expected && envoy_active_clusters(mesh) == Some(served_clusters) {
                return started.elapsed();
            }
            last = format!("{unacked} resources not ACKed, {service_clusters} service clusters served of {expected}");
        }
        if started.elapsed() > SETTLE_TIMEOUT {
            panic!(
                "{what}: the node did not settle within {SETTLE_TIMEOUT:?} ({last}); agent log tail:\n{}",
                tail(&mesh.agent.as_ref().unwrap().logs(), 60)
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// How many dynamic clusters Envoy has active; `None` while its admin does not answer
/// (its main thread, which also applies xDS, may be busy for seconds).
fn envoy_active_clusters(mesh: &Mesh) -> Option<usize> {
    match mesh
        .envoy()
        .admin_request("GET", "/config_dump?resource=dynamic_active_clusters")
    {
        Ok((200, body)) => serde_json::from_str::<serde_json::Value>(&body)
            .ok()
            .map(|dump| dump["configs"].as_array().map_or(0, Vec::len)),
        _ => None,
    }
}

/// AddPod through the CNI API; its latency, or what went wrong (with the tails of the
/// agent's and Envoy's logs).
async fn try_add_pod(mesh: &Mesh, pod: &TestPod, name: &str) -> Result<Duration, String> {
    let started = Instant::now();
    let result = mesh.add_pod(pod, name).await;
    let took = started.elapsed();
    match result {
        Ok(r) if r.outcome == Outcome::Success as i32 => Ok(took),
        other => {
            let envoy_logs = mesh.envoy().logs();
            let lds: Vec<&str> = envoy_logs.lines().filter(|l| l.contains("lds:")).collect();
            Err(format!(
                "AddPod {name} failed after {}: {other:?}\n--- agent log tail ---\n{}\n--- Envoy: {} LDS log lines, the last ones ---\n{}",
                ms(took),
                tail(&mesh.agent.as_ref().unwrap().logs(), 15),
                lds.len(),
                lds[lds.len().saturating_sub(6)..].join("\n")
            ))
        }
    }
}

/// What the node's Envoy holds and what it costs.
struct Footprint {
    dump_body: usize,
    /// The xDS-delivered resources only, each once (compact JSON): active clusters,
    /// endpoint assignments, active listeners and RDS route tables. The dump's
    /// static_route_configs repeat the route tables inlined in listeners.
    xds_bytes: usize,
    sections: BTreeMap<String, usize>,
    clusters: usize,
    endpoints: usize,
    listeners: usize,
    filter_chains: usize,
    allocated: u64,
    heap: u64,
    envoy_rss: u64,
    agent_rss: u64,
    agent_hwm: u64,
}

fn footprint(mesh: &Mesh) -> Footprint {
    let envoy = mesh.envoy();
    let body = envoy.admin_get("/config_dump?include_eds");
    let dump: serde_json::Value = serde_json::from_str(&body).expect("config dump JSON");
    let mut f = Footprint {
        dump_body: body.len(),
        xds_bytes: 0,
        sections: BTreeMap::new(),
        clusters: 0,
        endpoints: 0,
        listeners: 0,
        filter_chains: 0,
        allocated: 0,
        heap: 0,
        envoy_rss: proc_status(envoy.child().pid(), "VmRSS:"),
        agent_rss: proc_status(agent_pid(mesh), "VmRSS:"),
        agent_hwm: proc_status(agent_pid(mesh), "VmHWM:"),
    };
    for config in dump["configs"].as_array().into_iter().flatten() {
        let kind = config["@type"]
            .as_str()
            .unwrap_or("?")
            .rsplit('.')
            .next()
            .unwrap_or("?")
            .trim_end_matches("ConfigDump")
            .to_owned();
        *f.sections.entry(kind).or_default() += serde_json::to_string(config).unwrap().len();
        let size = |v: &serde_json::Value| serde_json::to_string(v).unwrap().len();
        for c in config["dynamic_active_clusters"].as_array().into_iter().flatten() {
            f.clusters += 1;
            f.xds_bytes += size(&c["cluster"]);
        }
        for e in config["dynamic_endpoint_configs"].as_array().into_iter().flatten() {
            f.xds_bytes += size(&e["endpoint_config"]);
            for locality in e["endpoint_config"]["endpoints"].as_array().into_iter().flatten() {
                f.endpoints += locality["lb_endpoints"].as_array().map_or(0, Vec::len);
            }
        }
        for l in config["dynamic_listeners"].as_array().into_iter().flatten() {
            if let Some(active) = l.get("active_state") {
                f.listeners += 1;
                f.filter_chains += active["listener"]["filter_chains"].as_array().map_or(0, Vec::len);
                f.xds_bytes += size(&active["listener"]);
            }
        }
        for r in config["dynamic_route_configs"].as_array().into_iter().flatten() {
            f.xds_bytes += size(&r["route_config"]);
        }
    }
    let memory: serde_json::Value = serde_json::from_str(&envoy.admin_get("/memory")).expect("/memory JSON");
    let number = |v: &serde_json::Value| -> u64 {
        v.as_str()
            .and_then(|s| s.parse().ok())
            .or_else(|| v.as_u64())
            .unwrap_or(0)
    };
    f.allocated = number(&memory["allocated"]);
    f.heap = number(&memory["heap_size"]);
    f
}

fn print_footprint(label: &str, f: &Footprint) {
    let total: usize = f.sections.values().sum();
    let sections: Vec<String> = f
        .sections
        .iter()
        .map(|(k, v)| format!("{k} {:.2} MB", *v as f64 / 1e6))
        .collect();
    println!(
        "{label}: xDS resources {:.2} MB (compact JSON from config_dump?include_eds, each once); whole dump {:.2} MB \
         compact ({:.2} MB as served; {}) | {} clusters, {} endpoints, {} listeners / {} filter chains",
        f.xds_bytes as f64 / 1e6,
        total as f64 / 1e6,
        f.dump_body as f64 / 1e6,
        sections.join(", "),
        f.clusters,
        f.endpoints,
        f.listeners,
        f.filter_chains
    );
    println!(
        "{label}: Envoy memory allocated {} (heap {}, VmRSS {}); agent VmRSS {} (VmHWM {})",
        mib(f.allocated),
        mib(f.heap),
        mib(f.envoy_rss),
        mib(f.agent_rss),
        mib(f.agent_hwm)
    );
}

/// Envoy's EDS dump of one cluster (built from its live host set), as a poll path.
fn eds_probe(cluster: &str) -> String {
    // `^`/`$` percent-encoded; the dots of the name match themselves (and anything).
    format!("/config_dump?resource=dynamic_endpoint_configs&include_eds&name_regex=%5E{cluster}%24")
}

/// The bench's knobs (see the module doc).
struct Knobs {
    services: usize,
    per_service: usize,
    pods: usize,
    upstreams: usize,
    /// The shapes of node A, each a number of workloads (distinct upstream lists) the pods are replicas of.
    shapes: Vec<usize>,
    changes: usize,
    skip_full: bool,
}

impl Knobs {
    fn from_env() -> Knobs {
        let pods = knob("AETHER_BENCH_PODS", 100);
        Knobs {
            services: knob("AETHER_BENCH_SERVICES", 2000),
            per_service: knob("AETHER_BENCH_ENDPOINTS_PER_SERVICE", 10),
            pods,
            upstreams: knob("AETHER_BENCH_UPSTREAMS", 20),
            shapes: shapes_knob(pods),
            changes: knob("AETHER_BENCH_CHANGES", 200),
            skip_full: knob("AETHER_BENCH_SKIP_FULL", 0) == 1,
        }
    }

    fn catalog_size(&self) -> usize {
        self.services * self.per_service
    }
}

/// AETHER_BENCH_UPSTREAM_SETS: comma-separated workload counts, one node A per shape (default: every pod its
/// own draw, then 10 workloads sharing upstream lists, the shape node B repeats); panics on anything else.
fn shapes_knob(pods: usize) -> Vec<usize> {
    let default = format!("{pods},{}", pods.min(10));
    let raw = std::env::var("AETHER_BENCH_UPSTREAM_SETS").unwrap_or(default);
    let shapes: Vec<usize> = raw
        .split(',')
        .map(|v| match v.trim().parse::<usize>() {
            Ok(n) if n > 0 => n.min(pods.max(1)),
            _ => panic!("AETHER_BENCH_UPSTREAM_SETS={raw:?}: expected comma-separated workload counts > 0"),
        })
        .collect();
    shapes
}

/// How a shape reads in the report.
fn shape_label(sets: usize, pods: usize) -> String {
    if sets >= pods {
        format!("{pods} pods, each its own upstream draw")
    } else {
        format!("{pods} pods of {sets} workloads sharing upstream lists")
    }
}

/// Node A's pods: each with its name and the workload (upstream list) it belongs to.
type BenchPods = Vec<(TestPod, String, usize)>;

/// Node A once filled: how many pods were added, the catalog services they depend on, and the AddPod that failed.
struct Filled {
    added: usize,
    deps: BTreeSet<usize>,
    failure: Option<String>,
}

fn main() {
    aether_tests::require_root();
    let k = Knobs::from_env();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let bench_started = Instant::now();
    let mut rng = Rng(0x5eed_a37e_0000_0001);
    // Each shape is a fresh node A (registrar, agent, Envoy) with the catalog; node B shares the last one's
    // registrar.
    let mut scoped = Vec::new();
    let mut last = None;
    for (i, &sets) in k.shapes.iter().enumerate() {
        let label = shape_label(sets, k.pods);
        println!("==== node A: {label}");
        let mesh = rt.block_on(Mesh::start());
        load_catalog(&rt, &mesh, &k);
        let (footprint, pods) = measure_node_a(&rt, &mesh, &k, sets, &mut rng);
        scoped.push((label, footprint));
        if i + 1 == k.shapes.len() {
            last = Some((mesh, pods));
        }
    }
    if !k.skip_full
        && let Some((mesh, _pods)) = &last
    {
        let full = compare_with_the_node_given_everything(&rt, mesh, &k, &scoped);
        drop(full);
    }
    println!("total bench time {:.0} s", bench_started.elapsed().as_secs_f64());
    drop(last);
}

/// Node A in one shape: its pods added in turn, the pushes, the endpoint changes, the agent's memory and the
/// node's footprint. Returns the footprint and the pods (kept alive with the node).
fn measure_node_a(
    rt: &tokio::runtime::Runtime,
    mesh: &Mesh,
    k: &Knobs,
    sets: usize,
    rng: &mut Rng,
) -> (Footprint, BenchPods) {
    let workload_upstreams: Vec<BTreeSet<usize>> = (0..sets).map(|_| rng.distinct(k.upstreams, k.services)).collect();
    let test_pods = create_pods(mesh, k, &workload_upstreams);
    let before = xds_pushed(rt, mesh);
    let filled = add_pods_in_turn(rt, mesh, k, &test_pods, &workload_upstreams);
    print_pushed("AddPod", &before, &xds_pushed(rt, mesh), filled.added);
    let metrics = rt.block_on(mesh.agent_get("/metrics"));
    println!(
        "xDS response → Envoy's ACK while the node filled, mean by type: {}",
        xds_ack_means(&metrics)
    );
    let pid = agent_pid(mesh);
    print_agent_memory("after setup", pid);

    // Endpoint change at the registrar → applied by Envoy.
    let before = xds_pushed(rt, mesh);
    measure_endpoint_changes(rt, mesh, k, &shuffled(&filled.deps, rng));
    print_pushed("endpoint change", &before, &xds_pushed(rt, mesh), k.changes);
    print_agent_memory("after the changes", pid);

    // What the scoped node holds, for the comparison with node B.
    rt.block_on(settle(mesh, "node A after the changes"));
    let scoped = footprint(mesh);
    print_footprint(&format!("node A (scoped, {} pods)", filled.added), &scoped);
    if filled.failure.is_some() {
        println!(
            "(node A has only {} of {} pods: see PRODUCT PROBLEM above)",
            filled.added, k.pods
        );
    }
    (scoped, test_pods)
}

fn load_catalog(rt: &tokio::runtime::Runtime, mesh: &Mesh, k: &Knobs) {
    let endpoints: Vec<Endpoint> = (0..k.catalog_size())
        .map(|n| endpoint(n % k.services, catalog_address(n), n))
        .collect();
    let took = rt.block_on(register_all(mesh, endpoints, LOAD_CONCURRENCY));
    println!(
        "catalog: {} services / {} endpoints registered in {:.2} s ({:.0} endpoints/s, {LOAD_CONCURRENCY} in flight)",
        k.services,
        k.catalog_size(),
        took.as_secs_f64(),
        k.catalog_size() as f64 / took.as_secs_f64()
    );
}

/// Creates and describes a node's pods (network namespaces, no app), pod `p` a replica of workload
/// `p % workloads`, each workload with its upstream list.
fn create_pods(mesh: &Mesh, k: &Knobs, workload_upstreams: &[BTreeSet<usize>]) -> BenchPods {
    let sets = workload_upstreams.len();
    let mut drawn = BTreeSet::new();
    let mut test_pods = Vec::new();
    let started = Instant::now();
    for p in 0..k.pods {
        let workload = p % sets;
        let name = format!("bench-{p:03}");
        let pod = mesh.node.add_pod(&name);
        let list: Vec<String> = workload_upstreams[workload].iter().map(|s| service_key(*s)).collect();
        drawn.extend(workload_upstreams[workload].iter().copied());
        mesh.describe_pod(
            &pod,
            &name,
            &format!("app-{workload:03}"),
            &list.join(","),
            &[("http", 8080)],
        );
        test_pods.push((pod, name, workload));
    }
    // The static pod source polls its directory every 200 ms.
    std::thread::sleep(Duration::from_millis(600));
    println!(
        "{} pods (netns) created in {:.2} s; {sets} workloads with upstream lists of {} → all pods together \
         depend on {} catalog services (+ {} pod services)",
        k.pods,
        started.elapsed().as_secs_f64(),
        workload_upstreams.first().map_or(0, BTreeSet::len),
        drawn.len(),
        sets.min(k.pods)
    );
    test_pods
}

/// Adds the pods one after the other; stops at the first failure and measures the node as it is then.
fn add_pods_in_turn(
    rt: &tokio::runtime::Runtime,
    mesh: &Mesh,
    k: &Knobs,
    test_pods: &BenchPods,
    workload_upstreams: &[BTreeSet<usize>],
) -> Filled {
    let mut add_latencies = Vec::new();
    let mut deps = BTreeSet::new();
    let mut failure = None;
    let started = Instant::now();
    for (pod, name, workload) in test_pods {
        match rt.block_on(try_add_pod(mesh, pod, name)) {
            Ok(took) => {
                add_latencies.push(took);
                deps.extend(workload_upstreams[*workload].iter().copied());
            }
            Err(e) => {
                failure = Some(e);
                break;
            }
        }
    }
    let adds_took = started.elapsed();
    let added = add_latencies.len();
    let progression: Vec<String> = add_latencies
        .iter()
        .enumerate()
        .filter(|(i, _)| *i == 0 || (i + 1) % 10 == 0 || i + 1 == added)
        .map(|(i, d)| format!("#{} {}", i + 1, ms(*d)))
        .collect();
    println!("AddPod latency as the node fills: {}", progression.join(", "));
    if let Some(failure) = &failure {
        println!(
            "PRODUCT PROBLEM: AddPod #{} failed; the rest of the bench measures the node with its {added} pods\n{failure}",
            added + 1
        );
    }
    let settle_took = rt.block_on(settle(mesh, "node A"));
    add_latencies.sort();
    println!(
        "AddPod ({added} of {} sequential, each until Envoy ACKed the pod's listeners): p50 {}, p99 {}, max {}, \
         total {:.2} s; whole config ACKed {} after the last AddPod; node dependency set {} catalog services",
        k.pods,
        ms(percentile(&add_latencies, 0.5)),
        ms(percentile(&add_latencies, 0.99)),
        ms(add_latencies.last().copied().unwrap_or_default()),
        adds_took.as_secs_f64(),
        ms(settle_took),
        deps.len()
    );
    Filled { added, deps, failure }
}

/// Resources and encoded bytes sent to Envoy so far, by resource type.
type Pushed = BTreeMap<String, (u64, u64)>;

/// The agent's xDS push counters.
fn xds_pushed(rt: &tokio::runtime::Runtime, mesh: &Mesh) -> Pushed {
    let metrics = rt.block_on(mesh.agent_get("/metrics"));
    let mut pushed = Pushed::new();
    for line in metrics.lines() {
        let Some(rest) = line.strip_prefix("aether_agent_xds_") else {
            continue;
        };
        let (bytes, series) = if let Some(series) = rest.strip_prefix("resources_pushed_total{type=\"") {
            (false, series)
        } else if let Some(series) = rest.strip_prefix("pushed_bytes_total{type=\"") {
            (true, series)
        } else {
            continue;
        };
        let Some((kind, value)) = series.split_once("\"} ") else {
            continue;
        };
        let entry = pushed.entry(kind.to_owned()).or_default();
        let slot = if bytes { &mut entry.1 } else { &mut entry.0 };
        *slot = value.trim().parse().unwrap_or(0);
    }
    assert!(
        !pushed.is_empty(),
        "no aether_agent_xds_*pushed* series in the agent's /metrics"
    );
    pushed
}

/// What one of `count` events pushed to Envoy on average, from two readings of [`xds_pushed`].
fn print_pushed(what: &str, before: &Pushed, after: &Pushed, count: usize) {
    let count = count.max(1) as f64;
    let mut total = (0.0, 0.0);
    let by_type: Vec<String> = after
        .iter()
        .filter_map(|(kind, (resources, bytes))| {
            let (r0, b0) = before.get(kind).copied().unwrap_or_default();
            let (r, b) = ((resources - r0) as f64 / count, (bytes - b0) as f64 / count);
            total = (total.0 + r, total.1 + b);
            (r > 0.0).then(|| format!("{kind} {r:.1} ({:.1} KB)", b / 1e3))
        })
        .collect();
    println!(
        "pushed to Envoy per {what}: {:.1} resources, {:.1} KB ({})",
        total.0,
        total.1 / 1e3,
        by_type.join(", ")
    );
}

fn print_agent_memory(when: &str, pid: u32) {
    let (rss, hwm) = (proc_status(pid, "VmRSS:"), proc_status(pid, "VmHWM:"));
    let (anon, file) = (proc_status(pid, "RssAnon:"), proc_status(pid, "RssFile:"));
    let (code, rodata, other) = aether_tests::bench::file_rss_by_kind(pid);
    println!(
        "agent {when}: VmRSS {} (anonymous {}, file-backed {}: the binary's code {}, its read-only data {}, \
         the rest {}), VmHWM {} (goal < 30 MiB)",
        mib(rss),
        mib(anon),
        mib(file),
        mib(code),
        mib(rodata),
        mib(other),
        mib(hwm)
    );
}

/// The node's dependency set in a fixed, shuffled order, to spread the changes over it.
fn shuffled(deps: &BTreeSet<usize>, rng: &mut Rng) -> Vec<usize> {
    let mut v: Vec<usize> = deps.iter().copied().collect();
    for i in (1..v.len()).rev() {
        v.swap(i, rng.below(i + 1));
    }
    v
}

/// What the endpoint-change phase measured.
#[derive(Default)]
struct ChangeTimes {
    /// Registration → the address in Envoy's EDS dump.
    applied: Vec<Duration>,
    /// The RegisterEndpoint RPC alone.
    rpc: Vec<Duration>,
    /// One admin poll of Envoy.
    probe: Vec<Duration>,
    /// The changes not applied within [`CHANGE_TIMEOUT`].
    timeouts: Vec<String>,
}

/// Registers `changes` new addresses in services of the node's dependency set, one at a time, each timed until
/// Envoy's admin shows it; prints the distribution.
fn measure_endpoint_changes(rt: &tokio::runtime::Runtime, mesh: &Mesh, k: &Knobs, dep_list: &[usize]) {
    let mut agents = StandInAgents::default();
    // The probe sees the catalog's endpoints (at the inbound port of each; with mTLS as the
    // internal address `ip:18008` of the origination hop).
    let probe = eds_probe(&cluster_name(dep_list[0]));
    let body = mesh.envoy().admin_get(&probe);
    assert!(
        body.contains("\"port_value\": 18008") || body.contains(":18008\""),
        "the EDS probe {probe} does not show the cluster's endpoints: {body}"
    );
    let mut times = ChangeTimes::default();
    for i in 0..k.changes {
        let s = dep_list[i % dep_list.len()];
        let e = endpoint(s, change_address(i), k.catalog_size() + i);
        let client = rt.block_on(agents.client(mesh, &e.node));
        time_one_change(rt, mesh, client, e, s, &mut times);
        std::thread::sleep(CHANGE_GAP);
    }
    print_change_times(mesh, dep_list.len().min(k.changes), times);
}

/// Registers `e` (a new address of catalog service `s`) and polls Envoy's EDS dump until it shows it.
fn time_one_change(
    rt: &tokio::runtime::Runtime,
    mesh: &Mesh,
    mut client: aether_proto::registrar::v1::registrar_client::RegistrarClient<tonic::transport::Channel>,
    e: Endpoint,
    s: usize,
    times: &mut ChangeTimes,
) {
    let envoy = mesh.envoy();
    let address = e.address.clone();
    // The origination hop's endpoint id (`ip:18008`; the bench runs with mTLS, the default).
    let needle = format!("\"{address}:18008\"");
    let probe = eds_probe(&cluster_name(s));
    assert!(
        !envoy.admin_get(&probe).contains(&needle),
        "{address} is already in {}",
        cluster_name(s)
    );
    let t0 = Instant::now();
    let rpc = rt.spawn(async move {
        client
            .register_endpoint(RegisterEndpointRequest { endpoint: Some(e) })
            .await
            .expect("RegisterEndpoint");
        t0.elapsed()
    });
    loop {
        let asked = Instant::now();
        let answer = envoy.admin_request("GET", &probe);
        times.probe.push(asked.elapsed());
        if let Ok((200, body)) = answer
            && body.contains(&needle)
        {
            times.applied.push(t0.elapsed());
            break;
        }
        if t0.elapsed() > CHANGE_TIMEOUT {
            times.timeouts.push(format!("{address} in {}", service_key(s)));
            break;
        }
        std::thread::sleep(POLL_EVERY);
    }
    times.rpc.push(rt.block_on(rpc).unwrap());
}

fn print_change_times(mesh: &Mesh, services: usize, mut times: ChangeTimes) {
    times.applied.sort();
    times.rpc.sort();
    times.probe.sort();
    let (latencies, rpc_latencies, probe_costs) = (&times.applied, &times.rpc, &times.probe);
    println!(
        "endpoint change → applied in Envoy ({} changes over {} services, probe every {} + admin poll p50 {} / p99 {}): \
         p50 {}, p99 {}, max {} (goal p99 < 100 ms); RegisterEndpoint RPC alone p50 {}, p99 {}; {} not applied within {:?}",
        latencies.len(),
        services,
        ms(POLL_EVERY),
        ms(percentile(probe_costs, 0.5)),
        ms(percentile(probe_costs, 0.99)),
        ms(percentile(latencies, 0.5)),
        ms(percentile(latencies, 0.99)),
        ms(latencies.last().copied().unwrap_or_default()),
        ms(percentile(rpc_latencies, 0.5)),
        ms(percentile(rpc_latencies, 0.99)),
        times.timeouts.len(),
        CHANGE_TIMEOUT
    );
    if !times.timeouts.is_empty() {
        println!(
            "  not applied: {}; agent log tail:\n{}",
            times.timeouts.join(", "),
            tail(&mesh.agent.as_ref().unwrap().logs(), 40)
        );
    }
}

/// Node B, the same node without demand scoping: a second node on the same registrar (a whole Mesh whose own
/// registrar is dropped and whose agent is restarted against node A's) whose pods, as many as node A's, each
/// declare every service; prints its footprint against each shape of node A.
fn compare_with_the_node_given_everything(
    rt: &tokio::runtime::Runtime,
    mesh: &Mesh,
    k: &Knobs,
    scoped: &[(String, Footprint)],
) -> (Mesh, BenchPods) {
    println!(
        "==== node B: {} pods, each declaring all {} services",
        k.pods, k.services
    );
    let mut full = rt.block_on(Mesh::start());
    full.agent = None;
    full.registrar.kill();
    full.use_registrar_of(mesh);
    rt.block_on(full.start_agent());
    // The last shape of node A's workloads (10 by default), each declaring everything.
    let workloads = k.shapes.last().copied().unwrap_or(1);
    let everything = vec![(0..k.services).collect::<BTreeSet<usize>>(); workloads];
    let pods = create_pods(&full, k, &everything);
    let filled = add_pods_in_turn(rt, &full, k, &pods, &everything);
    let unscoped = footprint(&full);
    print_footprint(&format!("node B ({} pods, all services)", filled.added), &unscoped);
    let ratio = |a: f64, b: f64| if a > 0.0 { b / a } else { f64::NAN };
    for (label, scoped) in scoped {
        println!(
            "scoping effect (node B / node A, {label}): xDS resource bytes {:.1}x, whole config dump {:.1}x, \
             Envoy memory allocated {:.1}x, clusters {:.1}x, endpoints {:.1}x (goal ≥ 10x for 10 workloads)",
            ratio(scoped.xds_bytes as f64, unscoped.xds_bytes as f64),
            ratio(
                scoped.sections.values().sum::<usize>() as f64,
                unscoped.sections.values().sum::<usize>() as f64
            ),
            ratio(scoped.allocated as f64, unscoped.allocated as f64),
            ratio(scoped.clusters as f64, unscoped.clusters as f64),
            ratio(scoped.endpoints as f64, unscoped.endpoints as f64),
        );
    }
    (full, pods)
}
