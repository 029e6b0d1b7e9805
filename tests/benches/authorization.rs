//! Authorization at work (`cargo bench -p aether-tests --bench authorization`, as root, after
//! `cargo build --workspace --bins --release`): the real registrar reading AuthorizationPolicy YAML from its
//! `--config-dir` (inotify), `aether-agent run` with the built-in CA (mTLS, the production default) and Envoy 1.40 at
//! the production worker count (2); `frontend` calls `backend` (service accounts `demo/frontend`, `demo/backend`),
//! both pods in network namespaces. Issue 19's three figures:
//!
//! 1. Added latency of 0, 10 and 100 policies selecting backend (`targetRefs`). `GET /bench/items` frontend →
//!    backend's VIP (captured: frontend's outbound listener → mTLS → backend's inbound listener and its RBAC → app),
//!    timed per request after a warm-up. Each policy has two rules on service accounts or SPIFFE prefixes, methods
//!    and paths; every fifth is a DENY (other namespaces on `/admin/*`, `DELETE` on its orders); the request is
//!    allowed only by the second rule of the last ALLOW policy, so every rule that can match is evaluated.
//!    **Paired:** a `control` pod, the same app on the same node and Envoy with no policy selecting it, is called
//!    in alternation with backend (a keep-alive connection to each, one request to one then one to the other; five
//!    fresh pairs of connections per run, so both sides sample both Envoy workers), so both see the same moment of
//!    the machine; the added latency is backend's percentile minus control's, and the
//!    0-policy row (the same path twice) shows what is left of the noise. Rounds alternate between the counts. Also
//!    printed: Envoy's CPU time per request (from `/proc`) while 8 keep-alive connections load backend with the
//!    same GETs.
//! 2. Policy write → enforced: with the largest count of part 1 in place, `flip.yaml` is renamed into place holding
//!    a DENY of frontend on `/bench/*` (allowed → denied), then the same DENY as a dry run (denied → allowed). The
//!    clock stops when a request on a keep-alive connection opened before the first change gets 403 (200); one
//!    request every 1 ms.
//! 3. Envoy heap per policy: `/memory` `allocated` 1 s after the node settled with 0, 100 and 1,000 policies
//!    selecting backend, and after removing them; per policy against none.
//!
//! Knobs (env): AETHER_BENCH_AUTHZ_PARTS ("1,2,3"), AETHER_BENCH_AUTHZ_POLICIES ("0,10,100"), AETHER_BENCH_AUTHZ_HEAP
//! ("0,100,1000"), AETHER_BENCH_AUTHZ_REQUESTS (20000 timed per count, split over the rounds), AETHER_BENCH_ROUNDS (4),
//! AETHER_BENCH_AUTHZ_CHANGES (30), AETHER_BENCH_ENVOY_CONCURRENCY (2).

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use aether_api::authorization::{ProjectOptions, parse_documents, project};
use aether_tests::bench::{cpu_time, envoy_allocated, knob, knob_list, percentile, tail};
use aether_tests::mesh::{Mesh, NAMESPACE};
use aether_tests::{Envoy, HttpServer, TestPod, free_port, http_get, unique_base_id};
use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::TokioIo;

/// What frontend asks for: allowed by the last ALLOW policy of every set.
const BENCH_PATH: &str = "/bench/items";
/// A path no policy allows: 403 whenever an ALLOW policy selects backend.
const UNLISTED_PATH: &str = "/elsewhere";
/// Envoy counters read around part 2: LDS updates, and connections accepted by backend's inbound listener.
const LISTENER_UPDATES: &str = "listener_manager.listener_modified";
const INBOUND_CONNECTIONS: &str = "listener.inbound.demo.backend.downstream_cx_total";
const POLICIES_FILE: &str = "policies.yaml";
const FLIP_FILE: &str = "flip.yaml";
const RULES_PER_POLICY: usize = 2;
/// Every fifth policy of a set is a DENY.
const DENY_EVERY: usize = 5;
/// Keep-alive connections at once when measuring Envoy's CPU per request under load.
const LOADED_CONNECTIONS: usize = 8;
/// Requests on a fresh connection before the timed ones (connections up, caches hot).
const WARM_UP_REQUESTS: usize = 200;
/// Fresh connection pairs (one to backend, one to control) per run of part 1.
const CONNECTION_PAIRS: usize = 5;
const SETTLE_TIMEOUT: Duration = Duration::from_secs(120);
const FLIP_TIMEOUT: Duration = Duration::from_secs(10);
const POLL_EVERY: Duration = Duration::from_millis(1);
/// Quiet time between two policy writes, so each is its own change.
const CHANGE_GAP: Duration = Duration::from_millis(200);
/// Quiet time between a settled node and a heap reading.
const QUIET: Duration = Duration::from_secs(1);
const GOAL_ADDED_P99: Duration = Duration::from_micros(50);
/// The policy count the latency goal is stated for.
const GOAL_AT: usize = 100;
const GOAL_ENFORCED_P99: Duration = Duration::from_secs(1);
const AIM_ENFORCED_P99: Duration = Duration::from_millis(100);
const KIB: f64 = 1024.0;
const MIB: f64 = 1024.0 * 1024.0;

struct Knobs {
    parts: BTreeSet<usize>,
    counts: Vec<usize>,
    heap_counts: Vec<usize>,
    requests: usize,
    rounds: usize,
    changes: usize,
    workers: usize,
}

impl Knobs {
    fn from_env() -> Knobs {
        let k = Knobs {
            parts: knob_list("AETHER_BENCH_AUTHZ_PARTS", "1,2,3").into_iter().collect(),
            counts: knob_list("AETHER_BENCH_AUTHZ_POLICIES", "0,10,100"),
            heap_counts: knob_list("AETHER_BENCH_AUTHZ_HEAP", "0,100,1000"),
            requests: knob("AETHER_BENCH_AUTHZ_REQUESTS", 20_000),
            rounds: knob("AETHER_BENCH_ROUNDS", 4),
            changes: knob("AETHER_BENCH_AUTHZ_CHANGES", 30),
            workers: knob("AETHER_BENCH_ENVOY_CONCURRENCY", 2),
        };
        assert!(k.rounds >= 1 && k.requests >= k.rounds, "requests ≥ rounds ≥ 1");
        assert!(k.changes >= 2, "AETHER_BENCH_AUTHZ_CHANGES must be ≥ 2 (one each way)");
        k
    }

    /// Every policy set the bench writes: none of the others may linger in Envoy when one is in force.
    fn sets(&self) -> BTreeSet<usize> {
        self.counts.iter().chain(&self.heap_counts).copied().collect()
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
        "authorization bench: real registrar (--config-dir), agent with mTLS (built-in CA), Envoy 1.40 --concurrency \
         {}; {} CPUs, load average {}",
        k.workers,
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        load_average()
    );
    rt.block_on(async {
        let node = Node::start(&k).await;
        if k.parts.contains(&1) {
            added_latency(&node, &k).await;
        }
        if k.parts.contains(&2) {
            write_to_enforced(&node, &k).await;
        }
        if k.parts.contains(&3) {
            heap_per_policy(&node, &k).await;
        }
    });
    println!("total bench time {:.0} s", started.elapsed().as_secs_f64());
}

// ---- The node.

/// One node: frontend and backend pods, the registrar's config directory, and every policy set the bench writes.
struct Node {
    mesh: Mesh,
    config: tempfile::TempDir,
    frontend: TestPod,
    _pods: Vec<TestPod>,
    _apps: Vec<HttpServer>,
    /// backend's VIP and port, which frontend calls.
    target: SocketAddr,
    /// control's: the same app, no policy selects it.
    control: SocketAddr,
    sets: BTreeSet<usize>,
}

impl Node {
    async fn start(k: &Knobs) -> Node {
        let config = tempfile::tempdir().unwrap();
        let dir = config.path().display().to_string();
        let mut mesh = Mesh::start_with_registrar(&[], &["--config-dir", &dir]).await;
        assert!(
            mesh.agent_args
                .windows(2)
                .any(|a| a[0] == "--identity" && a[1] == "builtin"),
            "the mesh's agent does not run with the built-in CA (mTLS): {:?}",
            mesh.agent_args
        );
        production_envoy(&mut mesh, k.workers);
        let (mut pods, mut apps) = (Vec::new(), Vec::new());
        for (name, upstreams) in [("backend", ""), ("control", ""), ("frontend", "backend, control")] {
            let pod = mesh.node.add_pod(name);
            apps.push(pod.serve_http(aether_tests::mesh::APP.parse().unwrap(), name));
            mesh.describe_pod(&pod, name, name, upstreams, &[("http", 8080)]);
            mesh.add_pod_ok(&pod, name).await;
            pods.push(pod);
        }
        let frontend = pods.pop().unwrap();
        let target = vip_port(&mesh, "backend").await;
        let control = vip_port(&mesh, "control").await;
        let node = Node {
            mesh,
            config,
            frontend,
            _pods: pods,
            _apps: apps,
            target,
            control,
            sets: k.sets(),
        };
        node.apply(0).await;
        node
    }

    /// Puts the set of `n` policies in the config directory (none: removes it) and waits until Envoy enforces it.
    async fn apply(&self, n: usize) -> Duration {
        let started = Instant::now();
        match n {
            0 => remove(self.config.path(), POLICIES_FILE),
            n => put(self.config.path(), POLICIES_FILE, &projected(policy_set(n), n)),
        }
        self.wait_enforced(n).await;
        started.elapsed()
    }

    /// Until Envoy holds the set of `n` (and no other set) and requests show it; then checks nothing was refused.
    async fn wait_enforced(&self, n: usize) {
        let started = Instant::now();
        let unlisted = if n == 0 { 200 } else { 403 };
        loop {
            let tables = self.route_tables().await;
            let holds = n == 0 || tables.contains(&format!("\"{NAMESPACE}/{}#1\"", policy_name(n, n - 1)));
            let stale: Vec<usize> = self
                .sets
                .iter()
                .copied()
                .filter(|m| *m != n && tables.contains(&format!("\"{NAMESPACE}/bench{m}-")))
                .collect();
            if holds && stale.is_empty() {
                let (bench, other) = (self.status(BENCH_PATH).await, self.status(UNLISTED_PATH).await);
                if bench == 200 && other == unlisted {
                    return self.assert_nothing_refused().await;
                }
            }
            assert!(
                started.elapsed() < SETTLE_TIMEOUT,
                "the set of {n} policies is not in force after {SETTLE_TIMEOUT:?} (in Envoy: {holds}, other sets \
                 still there: {stale:?}); agent log tail:\n{}\nregistrar log tail:\n{}",
                self.agent_tail(30),
                tail(&self.mesh.registrar.logs(), 20)
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// A policy the agent refuses, or a table Envoy rejects, would leave the bench measuring less than it says.
    async fn assert_nothing_refused(&self) {
        let metrics = self.mesh.agent_get("/metrics").await;
        for name in ["aether_agent_refused_authorization_policies", "aether_agent_xds_nacks"] {
            let total = metric_sum(&metrics, name);
            assert!(
                total == 0.0,
                "{name} is {total}; agent log tail:\n{}",
                self.agent_tail(30)
            );
        }
    }

    /// Envoy's route tables (the pods' inbound tables carry the RBAC rules) as JSON text.
    async fn route_tables(&self) -> String {
        let admin = self.mesh.envoy().admin_addr();
        let reply = http_get(
            &format!("http://{admin}/config_dump?resource=dynamic_route_configs"),
            None,
        )
        .await
        .unwrap_or_else(|e| panic!("Envoy admin {admin}: {e}"));
        assert_eq!(reply.status, 200, "Envoy /config_dump: {}", tail(&reply.body, 5));
        reply.body
    }

    /// The status of one `GET path` frontend → backend on a connection of its own (0 if it failed).
    async fn status(&self, path: &str) -> u16 {
        let url = format!("http://{}{path}", self.target);
        match self.frontend.http_request("GET", &url, None, &[], "").await {
            Ok(reply) => reply.status,
            Err(_) => 0,
        }
    }

    /// An Envoy counter; panics if Envoy has none of that name.
    /// CPU time of the node's Envoy.
    fn envoy_cpu(&self) -> Duration {
        let envoy = self.mesh.envoy.as_ref().expect("the mesh runs an Envoy");
        cpu_time(envoy.child().pid())
    }

    async fn envoy_counter(&self, name: &str) -> u64 {
        let admin = self.mesh.envoy().admin_addr();
        let reply = http_get(&format!("http://{admin}/stats?filter={name}"), None)
            .await
            .unwrap_or_else(|e| panic!("Envoy admin {admin}: {e}"));
        reply
            .body
            .lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(": ")?.trim().parse().ok())
            .unwrap_or_else(|| panic!("Envoy /stats has no {name}: {}", tail(&reply.body, 5)))
    }

    fn agent_tail(&self, lines: usize) -> String {
        tail(&self.mesh.agent.as_ref().map(|a| a.logs()).unwrap_or_default(), lines)
    }
}

/// A service's VIP on port 8080.
async fn vip_port(mesh: &Mesh, service: &str) -> SocketAddr {
    let vip = mesh.vip(service).await;
    format!("{vip}:8080")
        .parse()
        .unwrap_or_else(|e| panic!("{service}'s VIP {vip:?}: {e}"))
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

/// The sum of a Prometheus text's samples of `name` (0 when it has none).
fn metric_sum(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| l.split(['{', ' ']).next() == Some(name))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Writes a file whole (rename into place: the registrar never reads half of it).
fn put(dir: &Path, file: &str, yaml: &str) {
    let partial = dir.join(format!(".{file}.partial"));
    std::fs::write(&partial, yaml).unwrap_or_else(|e| panic!("writing {}: {e}", partial.display()));
    std::fs::rename(&partial, dir.join(file)).unwrap_or_else(|e| panic!("renaming into {file}: {e}"));
}

fn remove(dir: &Path, file: &str) {
    let path = dir.join(file);
    if path.exists() {
        std::fs::remove_file(&path).unwrap_or_else(|e| panic!("removing {}: {e}", path.display()));
    }
}

// ---- The policies.

/// Policy `i` of the set of `n`: the set is in the name, so a lingering set shows in Envoy's tables.
fn policy_name(n: usize, i: usize) -> String {
    format!("bench{n}-{i:04}")
}

/// The set of `n` policies selecting backend, as one multi-document file.
fn policy_set(n: usize) -> String {
    (0..n).map(|i| policy(n, i)).collect()
}

/// Two rules each. The last policy is the ALLOW whose second rule lets frontend `GET /bench/*`; every fifth of the
/// others is a DENY matching none of frontend's requests; the rest ALLOW other callers.
fn policy(n: usize, i: usize) -> String {
    let name = policy_name(n, i);
    let orders = format!("/api/v1/orders-{i:04}/*");
    let rules = if i + 1 == n {
        format!(
            r#"  action: ALLOW
  rules:
    - from: [{{source: {{serviceAccounts: [{NAMESPACE}/caller-{i:04}]}}}}]
      to: [{{operation: {{methods: [GET, POST], paths: [{orders}]}}}}]
    - from: [{{source: {{serviceAccounts: [{NAMESPACE}/frontend]}}}}]
      to: [{{operation: {{methods: [GET], paths: [/bench/*]}}}}]
"#
        )
    } else if i % DENY_EVERY == 2 {
        format!(
            r#"  action: DENY
  rules:
    - from: [{{source: {{notNamespaces: [{NAMESPACE}]}}}}]
      to: [{{operation: {{paths: [/admin/*]}}}}]
    - to: [{{operation: {{methods: [DELETE], paths: [{orders}]}}}}]
"#
        )
    } else {
        format!(
            r#"  action: ALLOW
  rules:
    - from: [{{source: {{serviceAccounts: [{NAMESPACE}/caller-{i:04}, {NAMESPACE}/worker-{i:04}]}}}}]
      to: [{{operation: {{methods: [GET, POST], paths: [{orders}, /healthz]}}}}]
    - from: [{{source: {{principals: ["spiffe://aether.test/ns/team-{i:04}/*"]}}}}]
      to: [{{operation: {{methods: [GET], paths: [/metrics]}}}}]
"#
        )
    };
    format!(
        r#"---
apiVersion: security.aether.io/v1alpha1
kind: AuthorizationPolicy
metadata: {{name: {name}, namespace: {NAMESPACE}}}
spec:
  targetRefs: [{{kind: Service, name: backend}}]
{rules}"#
    )
}

/// `yaml`, once the projector the registrar runs accepts its `count` policies: a bench policy refused would leave
/// the bench measuring less than it says.
fn projected(yaml: String, count: usize) -> String {
    let parsed = parse_documents(&yaml);
    assert_eq!(parsed.len(), count, "policies in the bench's YAML");
    for policy in parsed {
        let policy = policy.unwrap_or_else(|e| panic!("a bench policy does not parse: {e:?}"));
        project(&policy, &ProjectOptions::default()).unwrap_or_else(|e| panic!("a bench policy is refused: {e}"));
    }
    yaml
}

/// Part 2's policy: a DENY of frontend on `/bench/*`, enforced or as a dry run.
fn flip_policy(dry_run: bool) -> String {
    format!(
        r#"apiVersion: security.aether.io/v1alpha1
kind: AuthorizationPolicy
metadata: {{name: flip, namespace: {NAMESPACE}}}
spec:
  targetRefs: [{{kind: Service, name: backend}}]
  action: DENY
  dryRun: {dry_run}
  rules:
    - from: [{{source: {{serviceAccounts: [{NAMESPACE}/frontend]}}}}]
      to: [{{operation: {{paths: [/bench/*]}}}}]
"#
    )
}

// ---- The client.

/// One HTTP/1.1 keep-alive connection from inside a pod; a request on it fails once it is closed.
struct KeepAlive {
    sender: hyper::client::conn::http1::SendRequest<Empty<Bytes>>,
    /// The connection's own task: how it ended says why a request failed.
    driver: tokio::task::JoinHandle<hyper::Result<()>>,
    authority: String,
}

impl KeepAlive {
    async fn open(pod: &TestPod, target: SocketAddr) -> KeepAlive {
        let socket = pod
            .run(tokio::net::TcpSocket::new_v4)
            .unwrap_or_else(|e| panic!("a socket in pod {}: {e}", pod.name()));
        let stream = socket
            .connect(target)
            .await
            .unwrap_or_else(|e| panic!("pod {} connecting to {target}: {e}", pod.name()));
        stream.set_nodelay(true).expect("TCP_NODELAY");
        let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .unwrap_or_else(|e| panic!("HTTP/1.1 handshake with {target}: {e}"));
        KeepAlive {
            sender,
            driver: tokio::spawn(conn),
            authority: target.to_string(),
        }
    }

    /// `GET path`: the status and how long the exchange took, body included.
    async fn get(&mut self, path: &str) -> Result<(u16, Duration), String> {
        let request = hyper::Request::get(path)
            .header(hyper::header::HOST, &self.authority)
            .body(Empty::<Bytes>::new())
            .expect("request");
        let sent = Instant::now();
        // The connection takes the next request only once it has finished with the last response.
        let sender = &mut self.sender;
        let answer = async move {
            sender.ready().await?;
            sender.send_request(request).await
        };
        let response = match answer.await {
            Ok(response) => response,
            Err(e) => {
                return Err(format!("request: {e}; the connection: {}", self.ended().await));
            }
        };
        let status = response.status().as_u16();
        response.into_body().collect().await.map_err(|e| format!("body: {e}"))?;
        Ok((status, sent.elapsed()))
    }

    /// How the connection ended (waits briefly for its task to say).
    async fn ended(&mut self) -> String {
        match tokio::time::timeout(Duration::from_secs(1), &mut self.driver).await {
            Ok(Ok(Ok(()))) => "closed by the peer".into(),
            Ok(Ok(Err(e))) => format!("failed: {e}"),
            Ok(Err(e)) => format!("task failed: {e}"),
            Err(_) => "still open".into(),
        }
    }
}

// ---- 1. Added latency.

async fn added_latency(node: &Node, k: &Knobs) {
    let per_run = k.requests / k.rounds;
    println!(
        "1. added latency of N AuthorizationPolicies selecting backend ({RULES_PER_POLICY} rules each, every \
         {DENY_EVERY}th a DENY; the \
         request allowed by the last rule Envoy tries): GET {BENCH_PATH} frontend → backend's VIP (mTLS), paired \
         with the same GET to control (no policy), alternating on a keep-alive connection to each, \
         {CONNECTION_PAIRS} connection pairs × ({WARM_UP_REQUESTS} warm-up + {} timed) per run, {} rounds \
         alternating {:?}",
        per_run.div_ceil(CONNECTION_PAIRS),
        k.rounds,
        k.counts
    );
    let mut runs = Vec::new();
    let mut cpu: Vec<(usize, Duration)> = Vec::new();
    for round in 1..=k.rounds {
        for &n in &k.counts {
            let applied = node.apply(n).await;
            let pair = timed_pairs(node, per_run).await;
            let envoy_cpu = loaded_cpu(node, per_run).await;
            let note = format!(
                "set in force in {}; loaded, Envoy CPU {:.1} µs per request",
                ms(applied),
                envoy_cpu.as_secs_f64() * 1e6 / per_run as f64
            );
            print_pair(&format!("round {round}, {n} policies"), &pair, &note);
            runs.push((n, pair));
            cpu.push((n, envoy_cpu));
        }
    }
    print_added_latency(&k.counts, &runs);
    print_added_cpu(&k.counts, &cpu, per_run * k.rounds);
}

/// Envoy's CPU time per request under load (both sides: frontend's outbound and backend's inbound listener), pooled
/// per count, and the difference to none: the policies' own cost, free of the wake-up noise that blurs a sequential
/// latency on a small machine.
fn print_added_cpu(counts: &[usize], cpu: &[(usize, Duration)], requests: usize) {
    let per_request = |n: usize| {
        let total: Duration = cpu.iter().filter(|(m, _)| *m == n).map(|(_, c)| *c).sum();
        total.as_secs_f64() * 1e6 / requests as f64
    };
    let none = per_request(0);
    let goal = us(GOAL_ADDED_P99);
    for &n in counts.iter().filter(|n| **n != 0) {
        let added = per_request(n) - none;
        println!(
            "  {n} policies: Envoy CPU {:.1} µs per request, {added:+.1} µs over none ({none:.1})",
            per_request(n),
        );
        // The RBAC filters run on the request's worker and wait for nothing: what they add to a request's latency
        // is the CPU time they take, the bound the sequential latency's noise cannot blur.
        match (n == GOAL_AT, added > goal) {
            (false, _) => {}
            (true, true) => println!(
                "PRODUCT PROBLEM: {n} policies take {added:.1} µs of Envoy CPU per request, over the {goal:.0} µs goal"
            ),
            (true, false) => println!(
                "  goal met: {n} policies take {added:.1} µs of Envoy CPU per request, within the {goal:.0} µs the filters may add"
            ),
        }
    }
}

/// `requests` GETs over [`LOADED_CONNECTIONS`] keep-alive connections at once: Envoy's CPU time over them.
/// Panics on anything but 200.
async fn loaded_cpu(node: &Node, requests: usize) -> Duration {
    let mut connections = Vec::new();
    for _ in 0..LOADED_CONNECTIONS {
        connections.push(KeepAlive::open(&node.frontend, node.target).await);
    }
    let before = node.envoy_cpu();
    let each = requests / LOADED_CONNECTIONS;
    let runs = connections.iter_mut().map(|conn| async move {
        for i in 0..each {
            match conn.get(BENCH_PATH).await {
                Ok((200, _)) => {}
                answer => panic!("loaded GET {BENCH_PATH} #{i}: {answer:?}"),
            }
        }
    });
    futures::future::join_all(runs).await;
    node.envoy_cpu().saturating_sub(before)
}

/// Latencies of one run: backend's (its policies judged) and control's (none), sorted.
struct Pair {
    backend: Vec<Duration>,
    control: Vec<Duration>,
}

/// `requests` timed GETs to backend and as many to control, alternating (backend then control, control then
/// backend, …), over
/// [`CONNECTION_PAIRS`] fresh keep-alive connections to each in turn, each after a warm-up. Envoy gives each
/// connection to one of its workers, and a worker busier than the other makes every request on its connections
/// slower: a new pair of connections every few thousand requests lets both sides sample both workers alike.
/// Panics on anything but 200.
async fn timed_pairs(node: &Node, requests: usize) -> Pair {
    let mut pair = Pair {
        backend: Vec::with_capacity(requests),
        control: Vec::with_capacity(requests),
    };
    let per_pair = requests.div_ceil(CONNECTION_PAIRS);
    for _ in 0..CONNECTION_PAIRS {
        let mut backend = KeepAlive::open(&node.frontend, node.target).await;
        let mut control = KeepAlive::open(&node.frontend, node.control).await;
        for i in 0..WARM_UP_REQUESTS + per_pair {
            let mut both = [
                (&mut backend, &mut pair.backend, "backend"),
                (&mut control, &mut pair.control, "control"),
            ];
            // Which goes first alternates: the second of two back-to-back requests is not timed alike.
            if i % 2 == 1 {
                both.reverse();
            }
            for (conn, samples, name) in both {
                match conn.get(BENCH_PATH).await {
                    Ok((200, took)) if i >= WARM_UP_REQUESTS => samples.push(took),
                    Ok((200, _)) => {}
                    answer => panic!(
                        "GET {BENCH_PATH} #{i} to {name} on the keep-alive connection: {answer:?}; agent log tail:\n{}",
                        node.agent_tail(20)
                    ),
                }
            }
        }
    }
    pair.backend.sort();
    pair.control.sort();
    pair
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// backend's percentile `p` minus control's, in µs.
fn added(pair: &Pair, p: f64) -> f64 {
    us(percentile(&pair.backend, p)) - us(percentile(&pair.control, p))
}

fn print_pair(label: &str, pair: &Pair, note: &str) {
    print_latency(&format!("{label}: backend"), &pair.backend, note);
    print_latency(&format!("{label}: control"), &pair.control, "no policy");
    println!(
        "  {label}: added p50 {:+.0} µs, p99 {:+.0} µs",
        added(pair, 0.5),
        added(pair, 0.99)
    );
}

/// Every count's pairs pooled: backend over control at p50 and p99, and how far the rounds' differences spread.
fn print_added_latency(counts: &[usize], runs: &[(usize, Pair)]) {
    let goal = us(GOAL_ADDED_P99);
    let mut residual = None;
    for &n in counts {
        let mine: Vec<&Pair> = runs.iter().filter(|(m, _)| *m == n).map(|(_, p)| p).collect();
        let p99s: Vec<f64> = mine.iter().map(|p| added(p, 0.99)).collect();
        let spread = p99s.iter().cloned().fold(f64::MIN, f64::max) - p99s.iter().cloned().fold(f64::MAX, f64::min);
        let pool = |f: fn(&Pair) -> &Vec<Duration>| {
            let mut all: Vec<Duration> = mine.iter().flat_map(|p| f(p)).copied().collect();
            all.sort();
            all
        };
        let pooled = Pair {
            backend: pool(|p| &p.backend),
            control: pool(|p| &p.control),
        };
        let (added_p50, added_p99) = (added(&pooled, 0.5), added(&pooled, 0.99));
        print_pair(
            &format!("all rounds, {n} policies"),
            &pooled,
            &format!("added p99 per round {p99s:.0?} µs, spread {spread:.0} µs"),
        );
        if n == 0 {
            // The same path twice: what the pairing leaves of the machine's noise.
            residual = Some(added_p99);
            continue;
        }
        println!("  {n} policies add p50 {added_p50:+.0} µs, p99 {added_p99:+.0} µs over control");
        if n != GOAL_AT {
            continue;
        }
        let residual = residual.map_or(String::new(), |r| format!("; the 0-policy pair differs by {r:+.0} µs"));
        if added_p50 > goal || added_p99 > goal {
            println!(
                "PRODUCT PROBLEM: {n} policies add p50 {added_p50:.0} µs, p99 {added_p99:.0} µs, over the {goal:.0} µs \
                 p99 goal{residual}"
            );
        } else {
            println!("  goal met: {n} policies add at most {goal:.0} µs at p99{residual}");
        }
    }
}

fn print_latency(label: &str, sorted: &[Duration], note: &str) {
    println!(
        "  {label:<24} {:>6} requests  p50 {:.3} ms  p99 {:.3} ms  max {:.3} ms  ({note}; load average {})",
        sorted.len(),
        percentile(sorted, 0.5).as_secs_f64() * 1e3,
        percentile(sorted, 0.99).as_secs_f64() * 1e3,
        sorted.last().copied().unwrap_or_default().as_secs_f64() * 1e3,
        load_average()
    );
}

// ---- 2. Policy write → enforced on an open connection.

async fn write_to_enforced(node: &Node, k: &Knobs) {
    let background = k.counts.iter().max().copied().unwrap_or(0);
    node.apply(background).await;
    let mut conn = KeepAlive::open(&node.frontend, node.target).await;
    let first = conn.get(BENCH_PATH).await;
    assert!(
        matches!(first, Ok((200, _))),
        "GET {BENCH_PATH} before any change: {first:?}"
    );
    let updates = node.envoy_counter(LISTENER_UPDATES).await;
    let connections = node.envoy_counter(INBOUND_CONNECTIONS).await;
    let (mut denied, mut allowed) = (Vec::new(), Vec::new());
    for change in 0..k.changes {
        tokio::time::sleep(CHANGE_GAP).await;
        let deny = change % 2 == 0;
        let started = Instant::now();
        put(node.config.path(), FLIP_FILE, &projected(flip_policy(!deny), 1));
        let took = until_status(node, &mut conn, if deny { 403 } else { 200 }, started).await;
        let samples = if deny { &mut denied } else { &mut allowed };
        samples.push(took);
    }
    let updates = node.envoy_counter(LISTENER_UPDATES).await - updates;
    let connections = node.envoy_counter(INBOUND_CONNECTIONS).await - connections;
    remove(node.config.path(), FLIP_FILE);
    until_status(node, &mut conn, 200, Instant::now()).await;
    println!(
        "2. policy write → enforced on an open keep-alive connection ({} changes with {background} other policies \
         selecting backend; a DENY of frontend written, then made a dry run; one request every {} ms):",
        k.changes,
        POLL_EVERY.as_millis()
    );
    denied.sort();
    allowed.sort();
    print_enforced("allowed → denied (403)", &denied);
    print_enforced("denied → allowed (200)", &allowed);
    let mut all: Vec<Duration> = denied.into_iter().chain(allowed).collect();
    all.sort();
    print_enforced("both", &all);
    let judged = if connections == 0 {
        "every request was judged on connections open before the first change"
    } else {
        "some requests went over connections opened after a change"
    };
    println!(
        "  connections into backend's inbound listener opened meanwhile: {connections} ({judged}); listener updates \
         (LDS) meanwhile: {updates}"
    );
    let p99 = percentile(&all, 0.99);
    if p99 >= GOAL_ENFORCED_P99 {
        println!(
            "PRODUCT PROBLEM: write → enforced p99 {} is over the goal of 1 s",
            ms(p99)
        );
    } else if p99 >= AIM_ENFORCED_P99 {
        println!("  (p99 {} meets the 1 s goal, not the 100 ms aim)", ms(p99));
    }
}

/// Requests on `conn` until one gets `want`; the time since `started`. Panics if the connection fails, or after
/// [`FLIP_TIMEOUT`].
async fn until_status(node: &Node, conn: &mut KeepAlive, want: u16, started: Instant) -> Duration {
    loop {
        let answer = conn.get(BENCH_PATH).await;
        match answer {
            Ok((status, _)) if status == want => return started.elapsed(),
            Ok((200 | 403, _)) => {}
            _ => panic!("GET {BENCH_PATH} on the open connection, waiting for {want}: {answer:?}"),
        }
        assert!(
            started.elapsed() < FLIP_TIMEOUT,
            "the open connection never got {want} within {FLIP_TIMEOUT:?}; agent log tail:\n{}",
            node.agent_tail(30)
        );
        tokio::time::sleep(POLL_EVERY).await;
    }
}

fn print_enforced(label: &str, sorted: &[Duration]) {
    println!(
        "  {label:<24} {:>3} changes  p50 {}  p99 {}  max {}",
        sorted.len(),
        ms(percentile(sorted, 0.5)),
        ms(percentile(sorted, 0.99)),
        ms(sorted.last().copied().unwrap_or_default())
    );
}

// ---- 3. Envoy heap per policy.

async fn heap_per_policy(node: &Node, k: &Knobs) {
    node.apply(0).await;
    let none = quiet_heap(node).await;
    println!(
        "3. Envoy heap (/memory allocated, {} s after the set is in force), policies selecting backend \
         ({RULES_PER_POLICY} rules each):",
        QUIET.as_secs()
    );
    println!("  0 policies: {:.2} MiB", none as f64 / MIB);
    for &n in k.heap_counts.iter().filter(|n| **n != 0) {
        let applied = node.apply(n).await;
        let heap = quiet_heap(node).await;
        let table = inbound_table_bytes(&node.route_tables().await);
        println!(
            "  {n} policies: {:.2} MiB  →  {:.2} KiB per policy ({:.2} KiB per rule) over none; set in force in {}; \
             backend's inbound route table {:.1} KiB as JSON in /config_dump",
            heap as f64 / MIB,
            (heap as f64 - none as f64) / n as f64 / KIB,
            (heap as f64 - none as f64) / (n * RULES_PER_POLICY) as f64 / KIB,
            ms(applied),
            table as f64 / KIB
        );
    }
    node.apply(0).await;
    let after = quiet_heap(node).await;
    println!("  policies removed: {:.2} MiB", after as f64 / MIB);
}

async fn quiet_heap(node: &Node) -> u64 {
    tokio::time::sleep(QUIET).await;
    envoy_allocated(node.mesh.envoy().admin_addr()).await
}

/// The size of the largest inbound route table in `/config_dump?resource=dynamic_route_configs` (backend's, which
/// carries the rules).
fn inbound_table_bytes(dump: &str) -> usize {
    let dump: serde_json::Value =
        serde_json::from_str(dump).unwrap_or_else(|e| panic!("Envoy /config_dump is not JSON ({e})"));
    dump["configs"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|c| &c["route_config"])
        .filter(|r| r["name"].as_str().is_some_and(|n| n.starts_with("inbound|")))
        .map(|r| r.to_string().len())
        .max()
        .unwrap_or_else(|| panic!("Envoy holds no inbound route table"))
}

// ---- Shared.

/// The machine's load average (other work on it moves latencies).
fn load_average() -> String {
    let raw = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    raw.split_whitespace().take(3).collect::<Vec<_>>().join(" ")
}

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1e3)
}
