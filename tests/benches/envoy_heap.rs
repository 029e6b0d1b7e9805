//! Envoy's heap for the agent's real output with mTLS on (`cargo bench -p aether-tests --bench envoy_heap`, as
//! root, after `cargo build --workspace --bins --release`): a real registrar, `aether-agent run` with the built-in
//! CA (the production default: one SVID, one SDS secret per pod) and Envoy 1.40, over a grid of local pods P ×
//! dependency clusters C (issue 16).
//!
//! Each grid point is a fresh node (the `aether_tests::mesh::Mesh` fixture): C services `bench/svc-NNNN`, two
//! endpoints each (fake 10.64.x.y addresses on other nodes, one HTTP port 8080), registered straight at the
//! registrar; then P pods (network namespaces, no app, one HTTP port) whose `config.aether.io/upstreams` lists all
//! C services, added through the CNI API a few at a time. Each pod is its own workload by default (its own service
//! account, so its own SPIFFE ID and its own service `demo/bench-NNN`): the agent's dependency set is a node's local
//! pods' upstreams *and their own services*, so the node depends on the C services plus one service per workload;
//! no pod calls another's service, so the own services get virtual hosts but no cluster.
//! Once every AddPod succeeded, the node settled (dependency set = exactly those, every served resource ACKed,
//! Envoy's active clusters and listeners = the served ones, nothing warming) and a second passed, it reads `/memory`
//! (`allocated` = heap) and prints one row. Then the least-squares fit heap = a + b·P + c·C + d·P·C over the grid,
//! next to the goals (≤ 0.5 KiB per pod×cluster; ≤ 40 MiB at 100 pods × 200 clusters).
//!
//! Envoy runs from the fixture's bootstrap (ADS over the agent's socket, the internal-listener extension) but with
//! the production worker count (`aether-agent proxy --concurrency` and the chart default: 2), since per-worker copies
//! of each cluster are part of its cost; the fixture's own Envoy runs 1 worker.
//!
//! Knobs (env): AETHER_BENCH_GRID_PODS ("10,50,100"), AETHER_BENCH_GRID_CLUSTERS ("50,200"),
//! AETHER_BENCH_ENVOY_CONCURRENCY (2), AETHER_BENCH_POD_WORKLOADS (0: every pod its own workload; N: the pods are
//! replicas of N workloads, pod p of workload p mod N).

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::process::Command;
use std::time::{Duration, Instant};

use aether_proto::cni::v1::Outcome;
use aether_proto::registry::v1::Endpoint;
use aether_tests::bench::{
    NAMESPACE, PORT, catalog_address, cluster_name, endpoint, knob, proc_status, register_all, service_key, tail,
};
use aether_tests::mesh::{MESH_DOMAIN, Mesh};
use aether_tests::{ChildGuard, TestPod, envoy_bin, free_port, http_get};
use futures::StreamExt;

const ENDPOINTS_PER_SERVICE: usize = 2;
/// AddPod calls in flight.
const ADD_CONCURRENCY: usize = 8;
const LOAD_CONCURRENCY: usize = 32;
const READY_TIMEOUT: Duration = Duration::from_secs(30);
const SETTLE_TIMEOUT: Duration = Duration::from_secs(120);
/// Quiet time between the settled node and the heap reading.
const QUIET: Duration = Duration::from_secs(1);
const CLUSTER_TYPE: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
const LISTENER_TYPE: &str = "type.googleapis.com/envoy.config.listener.v3.Listener";
const KIB: f64 = 1024.0;
const MIB: f64 = 1024.0 * 1024.0;
/// Issue 16's goals.
const GOAL_KIB_PER_POD_CLUSTER: f64 = 0.5;
const GOAL_MIB_AT_100X200: f64 = 40.0;

/// A comma-separated list of counts; panics on anything else.
fn list_knob(name: &str, default: &str) -> Vec<usize> {
    let raw = std::env::var(name).unwrap_or_else(|_| default.to_owned());
    let values: BTreeSet<usize> = raw
        .split(',')
        .map(|v| {
            v.trim()
                .parse()
                .unwrap_or_else(|e| panic!("{name}={raw:?}: {v:?} is not a count ({e})"))
        })
        .collect();
    values.into_iter().collect()
}

/// Pod `p`'s workload (service account, hence SPIFFE ID and own service `demo/<workload>`).
fn workload(p: usize, workloads: usize) -> String {
    if workloads == 0 {
        format!("bench-{p:03}")
    } else {
        format!("app-{:03}", p % workloads)
    }
}

fn ms(d: Duration) -> String {
    format!("{:.0} ms", d.as_secs_f64() * 1e3)
}

/// Envoy run from the mesh's bootstrap with `--concurrency <workers>` (the fixture's [`aether_tests::Envoy`] fixes
/// 1 worker). No hot restart, so nothing is left in /dev/shm; killed with its process group on drop.
struct BenchEnvoy {
    child: ChildGuard,
    admin: SocketAddr,
}

impl BenchEnvoy {
    async fn start(mesh: &Mesh, workers: usize) -> BenchEnvoy {
        let port = free_port();
        let bootstrap = mesh.envoy_bootstrap(port);
        let path = mesh.path("bench-envoy-bootstrap.json");
        std::fs::write(&path, serde_json::to_vec_pretty(&bootstrap).unwrap())
            .unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
        let mut cmd = Command::new(envoy_bin());
        cmd.arg("-c")
            .arg(&path)
            .args(["--concurrency", &workers.to_string()])
            .args(["--disable-hot-restart", "--log-level", "info"]);
        let mut envoy = BenchEnvoy {
            child: ChildGuard::spawn("envoy", cmd),
            admin: format!("127.0.0.1:{port}").parse().unwrap(),
        };
        let started = Instant::now();
        loop {
            if let Some(status) = envoy.child.try_wait() {
                panic!(
                    "Envoy exited before it was ready ({status}); logs:\n{}",
                    envoy.child.logs()
                );
            }
            let last = envoy.get("/ready").await;
            if last.is_ok() {
                return envoy;
            }
            assert!(
                started.elapsed() < READY_TIMEOUT,
                "Envoy not ready within {READY_TIMEOUT:?} ({last:?}); logs:\n{}",
                envoy.child.logs()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// An admin GET: the body of a 200, else what went wrong.
    async fn get(&self, path: &str) -> Result<String, String> {
        let reply = http_get(&format!("http://{}{path}", self.admin), None).await?;
        if reply.status == 200 {
            Ok(reply.body)
        } else {
            Err(format!("{path}: status {}: {}", reply.status, tail(&reply.body, 5)))
        }
    }

    async fn get_json(&self, path: &str) -> serde_json::Value {
        let body = self
            .get(path)
            .await
            .unwrap_or_else(|e| panic!("Envoy admin {e}; logs:\n{}", tail(&self.child.logs(), 30)));
        serde_json::from_str(&body).unwrap_or_else(|e| panic!("Envoy admin {path} is not JSON ({e}): {body}"))
    }

    /// `/memory`'s `allocated` (bytes in use by the application: Envoy's heap).
    async fn allocated(&self) -> u64 {
        let memory = self.get_json("/memory").await;
        memory["allocated"]
            .as_str()
            .and_then(|s| s.parse().ok())
            .or_else(|| memory["allocated"].as_u64())
            .unwrap_or_else(|| panic!("Envoy /memory has no numeric \"allocated\": {memory}"))
    }
}

/// AddPod through the CNI API; its latency, or what went wrong (with the tails of the agent's and Envoy's logs).
async fn try_add_pod(mesh: &Mesh, envoy: &BenchEnvoy, pod: &TestPod, name: &str) -> Result<Duration, String> {
    let started = Instant::now();
    let result = mesh.add_pod(pod, name).await;
    let took = started.elapsed();
    match result {
        Ok(r) if r.outcome == Outcome::Success as i32 => Ok(took),
        other => Err(format!(
            "AddPod {name} failed after {}: {other:?}\n--- agent log tail ---\n{}\n--- Envoy log tail ---\n{}",
            ms(took),
            tail(&mesh.agent.as_ref().unwrap().logs(), 20),
            tail(&envoy.child.logs(), 10)
        )),
    }
}

/// What Envoy holds, from its config dump.
#[derive(Default)]
struct Held {
    /// The clusters of the C catalog services.
    service_clusters: BTreeSet<String>,
    /// The clusters of the local pods' own services (`<workload>.demo.…`).
    own_service_clusters: usize,
    originate_clusters: usize,
    delivery_clusters: usize,
    other_clusters: usize,
    listeners: BTreeSet<String>,
    secrets: usize,
    /// Upstream TLS transport sockets over all clusters (a cluster's own plus its transport_socket_matches).
    tls_sockets: usize,
    warming: usize,
}

impl Held {
    fn clusters(&self) -> usize {
        self.service_clusters.len()
            + self.own_service_clusters
            + self.originate_clusters
            + self.delivery_clusters
            + self.other_clusters
    }
}

/// The names of Envoy's active dynamic clusters.
fn cluster_names(dump: &serde_json::Value) -> BTreeSet<String> {
    sections(dump, "dynamic_active_clusters")
        .filter_map(|c| c["cluster"]["name"].as_str().map(str::to_owned))
        .collect()
}

fn sections<'a>(dump: &'a serde_json::Value, key: &'a str) -> impl Iterator<Item = &'a serde_json::Value> {
    dump["configs"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(move |config| config[key].as_array().into_iter().flatten())
}

fn is_tls(socket: &serde_json::Value) -> bool {
    socket["name"].as_str().is_some_and(|n| n.ends_with(".tls"))
        || socket["typed_config"]["@type"]
            .as_str()
            .is_some_and(|t| t.ends_with("UpstreamTlsContext"))
}

fn held(dump: &serde_json::Value) -> Held {
    let mut h = Held::default();
    for c in sections(dump, "dynamic_active_clusters") {
        let cluster = &c["cluster"];
        let name = cluster["name"].as_str().unwrap_or_default();
        if name.starts_with("originate|") {
            h.originate_clusters += 1;
        } else if name.starts_with("local|") {
            h.delivery_clusters += 1;
        } else if name.ends_with(&format!(".{NAMESPACE}.{MESH_DOMAIN}:{PORT}")) {
            h.service_clusters.insert(name.to_owned());
        } else if name.ends_with(&format!(".{}.{MESH_DOMAIN}:{PORT}", aether_tests::mesh::NAMESPACE)) {
            h.own_service_clusters += 1;
        } else {
            h.other_clusters += 1;
        }
        h.tls_sockets += usize::from(is_tls(&cluster["transport_socket"]));
        h.tls_sockets += cluster["transport_socket_matches"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|m| is_tls(&m["transport_socket"]))
            .count();
    }
    for l in sections(dump, "dynamic_listeners") {
        if l.get("warming_state").is_some() {
            h.warming += 1;
        }
        if l.get("active_state").is_some() {
            h.listeners.insert(l["name"].as_str().unwrap_or_default().to_owned());
        }
    }
    h.secrets = sections(dump, "dynamic_active_secrets").count();
    h.warming += sections(dump, "dynamic_warming_clusters").count() + sections(dump, "dynamic_warming_secrets").count();
    h
}

/// The names the agent serves of one type, and how many of all its resources Envoy has not ACKed.
fn served(xds: &serde_json::Value, type_url: &str) -> BTreeSet<String> {
    xds["types"][type_url]
        .as_object()
        .map(|m| m.keys().cloned().collect())
        .unwrap_or_default()
}

fn unacked(xds: &serde_json::Value) -> usize {
    xds["types"]
        .as_object()
        .into_iter()
        .flat_map(|m| m.values())
        .flat_map(|resources| resources.as_object().into_iter().flat_map(|m| m.values()))
        .filter(|r| r["served"] != r["acked"])
        .count()
}

/// Waits until the agent watches exactly `want` (the C services and the pods' own services) and knows them all,
/// Envoy has ACKed every served resource, holds exactly the served clusters and listeners, and nothing warms.
/// Returns Envoy's config dump then.
async fn settle(mesh: &Mesh, envoy: &BenchEnvoy, want: &BTreeSet<String>) -> serde_json::Value {
    let started = Instant::now();
    loop {
        let last;
        let aether_tests::bench::Dependencies {
            wanted, watched, known, ..
        } = aether_tests::bench::dependencies(mesh).await;
        if &wanted != want || &watched != want || &known != want {
            last = format!(
                "dependencies {} (the {} expected: {}), watched {}, known {}",
                wanted.len(),
                want.len(),
                &wanted == want,
                watched.len(),
                known.len()
            );
        } else {
            let xds: serde_json::Value = serde_json::from_str(&mesh.agent_get("/debug/xds").await).unwrap();
            let dump = envoy.get_json("/config_dump").await;
            let h = held(&dump);
            let (clusters, listeners) = (served(&xds, CLUSTER_TYPE), served(&xds, LISTENER_TYPE));
            let pending = unacked(&xds);
            if pending == 0 && h.warming == 0 && cluster_names(&dump) == clusters && h.listeners == listeners {
                return dump;
            }
            last = format!(
                "{pending} resources not ACKed, {} warming, Envoy {} clusters / {} listeners of {} / {} served",
                h.warming,
                h.clusters() - h.other_clusters,
                h.listeners.len(),
                clusters.len(),
                listeners.len()
            );
        }
        if started.elapsed() > SETTLE_TIMEOUT {
            panic!(
                "the node did not settle within {SETTLE_TIMEOUT:?} ({last}); agent log tail:\n{}",
                tail(&mesh.agent.as_ref().unwrap().logs(), 60)
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// One grid point, measured.
struct Row {
    pods: usize,
    services: usize,
    held: Held,
    idle_heap: u64,
    heap: u64,
    rss: u64,
    adds: Duration,
    add_p50: Duration,
    add_max: Duration,
    settle: Duration,
}

async fn measure(pods: usize, services: usize, workers: usize, workloads: usize) -> Row {
    let (mesh, envoy) = mesh_with_bench_envoy(workers).await;
    let idle_heap = envoy.allocated().await;
    let endpoints: Vec<Endpoint> = (0..services * ENDPOINTS_PER_SERVICE)
        .map(|n| endpoint(n % services, catalog_address(n), n))
        .collect();
    register_all(&mesh, endpoints, LOAD_CONCURRENCY).await;
    let upstreams: Vec<String> = (0..services).map(service_key).collect();
    let upstreams = upstreams.join(",");
    let test_pods: Vec<(TestPod, String)> = (0..pods)
        .map(|p| {
            let name = format!("bench-{p:03}");
            let pod = mesh.node.add_pod(&name);
            mesh.describe_pod(&pod, &name, &workload(p, workloads), &upstreams, &[("http", 8080)]);
            (pod, name)
        })
        .collect();
    // The static pod source polls its directory every 200 ms.
    tokio::time::sleep(Duration::from_millis(600)).await;
    let started = Instant::now();
    let latencies = add_all(&mesh, &envoy, &test_pods, services).await;
    let adds = started.elapsed();

    let own: BTreeSet<String> = (0..pods)
        .map(|p| format!("{}/{}", aether_tests::mesh::NAMESPACE, workload(p, workloads)))
        .collect();
    let want: BTreeSet<String> = (0..services).map(service_key).chain(own.iter().cloned()).collect();
    let started = Instant::now();
    settle(&mesh, &envoy, &want).await;
    let settle_took = started.elapsed();
    tokio::time::sleep(QUIET).await;
    let heap = envoy.allocated().await;
    let rss = proc_status(envoy.child.pid(), "VmRSS:");
    let h = held(&envoy.get_json("/config_dump").await);
    assert_the_row_holds_what_it_claims(&h, pods, services);
    drop(envoy);
    drop(mesh);
    drop(test_pods);
    Row {
        pods,
        services,
        held: h,
        idle_heap,
        heap,
        rss,
        adds,
        add_p50: latencies[latencies.len() / 2],
        add_max: *latencies.last().unwrap(),
        settle: settle_took,
    }
}

/// A fresh mesh whose fixture Envoy (1 worker) is swapped for one with the production worker count.
async fn mesh_with_bench_envoy(workers: usize) -> (Mesh, BenchEnvoy) {
    let mut mesh = Mesh::start().await;
    // The fixture's default identity is the built-in CA (mTLS); make sure this agent runs with it.
    assert!(
        mesh.agent_args
            .windows(2)
            .any(|a| a[0] == "--identity" && a[1] == "builtin"),
        "the mesh's agent does not run with the built-in CA (mTLS): {:?}",
        mesh.agent_args
    );
    mesh.envoy = None;
    let envoy = BenchEnvoy::start(&mesh, workers).await;
    (mesh, envoy)
}

/// Adds every pod, [`ADD_CONCURRENCY`] at a time; each AddPod's latency, sorted (panics on any failure).
async fn add_all(mesh: &Mesh, envoy: &BenchEnvoy, test_pods: &[(TestPod, String)], services: usize) -> Vec<Duration> {
    let pods = test_pods.len();
    let results: Vec<Result<Duration, String>> = futures::stream::iter(test_pods.iter())
        .map(|(pod, name)| async move { try_add_pod(mesh, envoy, pod, name).await })
        .buffer_unordered(ADD_CONCURRENCY)
        .collect()
        .await;
    let mut latencies = Vec::new();
    let mut failures = Vec::new();
    for r in results {
        match r {
            Ok(d) => latencies.push(d),
            Err(e) => failures.push(e),
        }
    }
    if let Some(first) = failures.first() {
        panic!(
            "P={pods} C={services}: {} of {pods} AddPods failed; the first:\n{first}",
            failures.len()
        );
    }
    latencies.sort();
    latencies
}

/// What the row claims: the C service clusters, one cluster per local workload, one originate cluster per pod,
/// mTLS on.
fn assert_the_row_holds_what_it_claims(h: &Held, pods: usize, services: usize) {
    let expected: BTreeSet<String> = (0..services).map(cluster_name).collect();
    assert_eq!(
        h.service_clusters, expected,
        "P={pods} C={services}: Envoy's service clusters are not the C services' clusters"
    );
    assert_eq!(
        h.own_service_clusters, 0,
        "P={pods} C={services}: Envoy holds clusters of local workloads' own services no local pod calls"
    );
    assert_eq!(
        h.originate_clusters, pods,
        "P={pods} C={services}: Envoy does not hold one originate cluster per pod"
    );
    assert!(
        h.secrets >= pods && h.tls_sockets >= pods,
        "P={pods} C={services}: mTLS is not on in Envoy ({} secrets, {} upstream TLS sockets for {pods} pods)",
        h.secrets,
        h.tls_sockets
    );
}

/// Least squares of heap = a + b·P + c·C + d·P·C (bytes) over the rows: [a, b, c, d].
fn fit(rows: &[Row]) -> [f64; 4] {
    // Normal equations XᵀX β = Xᵀy, solved by Gauss-Jordan elimination with partial pivoting.
    let mut m = [[0.0f64; 5]; 4];
    for r in rows {
        let (p, c) = (r.pods as f64, r.services as f64);
        let x = [1.0, p, c, p * c];
        for (i, xi) in x.iter().enumerate() {
            for (j, xj) in x.iter().enumerate() {
                m[i][j] += xi * xj;
            }
            m[i][4] += xi * r.heap as f64;
        }
    }
    for col in 0..4 {
        let pivot = (col..4)
            .max_by(|&a, &b| m[a][col].abs().total_cmp(&m[b][col].abs()))
            .unwrap();
        m.swap(col, pivot);
        assert!(
            m[col][col].abs() > 1e-9,
            "the grid does not determine the 4 fitted costs (singular normal equations)"
        );
        let row = m[col];
        for (r, line) in m.iter_mut().enumerate() {
            if r != col {
                let f = line[col] / row[col];
                for (x, y) in line.iter_mut().zip(row).skip(col) {
                    *x -= f * y;
                }
            }
        }
    }
    [0, 1, 2, 3].map(|i| m[i][4] / m[i][i])
}

/// The grid and the node's shape (see the module doc's knobs).
struct Grid {
    pods: Vec<usize>,
    clusters: Vec<usize>,
    workers: usize,
    workloads: usize,
}

impl Grid {
    fn from_env() -> Grid {
        let pod_grid = list_knob("AETHER_BENCH_GRID_PODS", "10,50,100");
        let cluster_grid = list_knob("AETHER_BENCH_GRID_CLUSTERS", "50,200");
        let workers = knob("AETHER_BENCH_ENVOY_CONCURRENCY", 2);
        let workloads = knob("AETHER_BENCH_POD_WORKLOADS", 0);
        assert!(
            pod_grid.len() >= 2 && cluster_grid.len() >= 2,
            "fitting a + b·P + c·C + d·P·C needs at least 2 pod counts and 2 cluster counts \
             (AETHER_BENCH_GRID_PODS={pod_grid:?}, AETHER_BENCH_GRID_CLUSTERS={cluster_grid:?})"
        );
        assert!(
            pod_grid[0] >= 1 && *pod_grid.last().unwrap() <= 250,
            "pods per point must be 1..=250 (one /24 per node): {pod_grid:?}"
        );
        assert!(cluster_grid[0] >= 1, "clusters per point must be ≥ 1: {cluster_grid:?}");
        assert!(workers >= 1, "AETHER_BENCH_ENVOY_CONCURRENCY must be ≥ 1");
        Grid {
            pods: pod_grid,
            clusters: cluster_grid,
            workers,
            workloads,
        }
    }
}

fn main() {
    aether_tests::require_root();
    let grid = Grid::from_env();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let bench_started = Instant::now();
    print_header(&grid);
    let mut rows = Vec::new();
    for &services in &grid.clusters {
        for &pods in &grid.pods {
            let r = rt.block_on(measure(pods, services, grid.workers, grid.workloads));
            print_row(&r);
            rows.push(r);
        }
    }
    print_fit_and_goals(&rows);
    println!(
        "earlier measurement, NOT re-measured by this bench (proposal notes; measured 2026-12-01 with a static config \
         of the old layout, one TLS socket per pod in every cluster): 5.8 MiB + 2.2 KiB/pod + 63 KiB/cluster + 16.7 \
         KiB/(pod×cluster)"
    );
    println!("total bench time {:.0} s", bench_started.elapsed().as_secs_f64());
}

fn print_header(grid: &Grid) {
    let (workers, workloads) = (grid.workers, grid.workloads);
    println!(
        "Envoy heap grid: the agent's real output, mTLS on (built-in CA, one SVID / SDS secret per pod), Envoy 1.40 \
         --concurrency {workers}; C services × {ENDPOINTS_PER_SERVICE} endpoints (HTTP :{PORT}); P pods ({}) all \
         declaring the C services as upstreams; AddPod {ADD_CONCURRENCY} at a time; a fresh node per point; heap = \
         /memory allocated, {}s after the node settled",
        if workloads == 0 {
            "each its own workload: own service account, SPIFFE ID and service".to_owned()
        } else {
            format!("replicas of {workloads} workloads")
        },
        QUIET.as_secs()
    );
    println!(
        "{:>5} {:>5} | {:>8} {:>5} {:>5} {:>9} {:>8} {:>9} {:>7} {:>8} | {:>9} {:>9} {:>10} | {:>9} {:>7} {:>7} {:>7}",
        "pods",
        "C",
        "clusters",
        "svc",
        "own",
        "originate",
        "delivery",
        "listeners",
        "secrets",
        "TLS sock",
        "idle heap",
        "heap",
        "Envoy RSS",
        "AddPod×P",
        "p50",
        "max",
        "settle"
    );
    println!(
        "  (svc: clusters of the C services; own: of the local workloads' own services; originate: originate|<ns>/<pod>; \
         delivery: local|<pod>|<port>; TLS sock: upstream TLS sockets over all clusters; AddPod×P: wall time of all \
         AddPods, p50/max of one; settle: after the last AddPod until everything was ACKed)"
    );
}

fn print_row(r: &Row) {
    println!(
        "{:>5} {:>5} | {:>8} {:>5} {:>5} {:>9} {:>8} {:>9} {:>7} {:>8} | {:>5.1} MiB {:>5.1} MiB {:>6.1} MiB | {:>7.2} s \
         {:>7} {:>7} {:>7}",
        r.pods,
        r.services,
        r.held.clusters(),
        r.held.service_clusters.len(),
        r.held.own_service_clusters,
        r.held.originate_clusters,
        r.held.delivery_clusters,
        r.held.listeners.len(),
        r.held.secrets,
        r.held.tls_sockets,
        r.idle_heap as f64 / MIB,
        r.heap as f64 / MIB,
        r.rss as f64 / MIB,
        r.adds.as_secs_f64(),
        ms(r.add_p50),
        ms(r.add_max),
        ms(r.settle)
    );
}

/// The fitted model, its per-pod×cluster goal and the heap at 100 pods × 200 clusters against its goal.
fn print_fit_and_goals(rows: &[Row]) {
    let [a, b, c, d] = fit(rows);
    let predict = |p: f64, cl: f64| a + b * p + c * cl + d * p * cl;
    let worst = rows
        .iter()
        .map(|r| (r.heap as f64 - predict(r.pods as f64, r.services as f64)).abs())
        .fold(0.0f64, f64::max);
    println!(
        "fitted (least squares over {} points): heap = {:.2} MiB {:+.2} KiB/pod {:+.2} KiB/cluster {:+.3} \
         KiB/(pod×cluster); largest residual {:.0} KiB",
        rows.len(),
        a / MIB,
        b / KIB,
        c / KIB,
        d / KIB,
        worst / KIB
    );
    let per_pair = d / KIB;
    println!(
        "goal ≤ {GOAL_KIB_PER_POD_CLUSTER} KiB per pod×cluster: {per_pair:.3} KiB → {}",
        if per_pair <= GOAL_KIB_PER_POD_CLUSTER {
            "MET"
        } else {
            "MISSED"
        }
    );
    println!(
        "  at 100 pods × 200 clusters the fit gives {:.1} MiB: base {:.1} MiB, pods {:.1} MiB, clusters {:.1} MiB, \
         pod×cluster {:.2} MiB",
        predict(100.0, 200.0) / MIB,
        a / MIB,
        100.0 * b / MIB,
        200.0 * c / MIB,
        20_000.0 * d / MIB
    );
    match rows.iter().find(|r| r.pods == 100 && r.services == 200) {
        Some(r) => {
            let heap = r.heap as f64 / MIB;
            println!(
                "goal Envoy heap ≤ {GOAL_MIB_AT_100X200} MiB at 100 pods × 200 clusters: measured {heap:.1} MiB → {}",
                if heap <= GOAL_MIB_AT_100X200 { "MET" } else { "MISSED" }
            );
        }
        None => {
            let heap = predict(100.0, 200.0) / MIB;
            println!(
                "goal Envoy heap ≤ {GOAL_MIB_AT_100X200} MiB at 100 pods × 200 clusters: not a grid point; the fit \
                 predicts {heap:.1} MiB → {} (extrapolated)",
                if heap <= GOAL_MIB_AT_100X200 { "MET" } else { "MISSED" }
            );
        }
    }
}
