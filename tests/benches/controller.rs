//! `aether-controller`'s webhooks under load: 200 kept-alive HTTPS connections (kube-apiserver
//! keeps a pool to each webhook), a third pod mutations, a third valid AuthorizationPolicies,
//! a third refused ones. Two loads:
//!
//! - **burst**: 200 AdmissionReviews arrive at once (one per connection: a 200-replica
//!   scale-up, a `kubectl apply` of a large manifest), then the next burst once all are
//!   answered. Goal (issue 20): p99 < 5 ms per review at 200 concurrent reviews.
//! - **sustained**: each connection sends its next review as soon as the last is answered,
//!   so 200 are always in flight: the controller's saturation throughput. Latency there is
//!   200 / throughput by Little's law, whatever the code does; it is printed, not judged.
//!
//! Prints each load's latency as the client sees it (p50/p90/p99/max), the throughput, the
//! controller's CPU per review and its RSS. Bodies are encoded before the clock starts, so
//! the client's own JSON work is not counted. The controller runs on the first core and
//! this client on the others: in a cluster kube-apiserver runs on other machines, and a
//! client preempting the controller on a 2-core machine measures the scheduler too (burst
//! p99 from 4.2 to 8 ms between runs of one build, proposals/015).
//!
//! Knobs: `AETHER_BENCH_CONNECTIONS` (200), `AETHER_BENCH_REVIEWS` (per connection, 50),
//! `AETHER_BENCH_PIN` (1; 0 lets the client and the controller share every core).

// The stand-in for kube-apiserver shares the machine's cores with the controller: it
// allocates as little as it can (mimalloc, bodies encoded once) so that what is measured
// is the webhook, not the client.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::sync::Arc;
use std::time::{Duration, Instant};

use aether_tests::bench::{cpu_time, knob, percentile, proc_status};
use aether_tests::controller::{Controller, WebhookConnection, admission_review};
use nix::sched::{CpuSet, sched_getaffinity, sched_setaffinity};
use nix::unistd::Pid;
use serde_json::{Value, json};
use tokio::sync::Barrier;

fn reviews() -> [(&'static str, Value); 3] {
    let pod = json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"generateName": "web-", "namespace": "shop", "labels": {"app": "web"},
                     "annotations": {"config.aether.io/upstreams": "cart, pay/api, search"}},
        "spec": {"containers": [{"name": "web", "image": "web:1", "ports": [{"name": "http", "containerPort": 8080}]}]}});
    let policy = |paths: Value| {
        json!({"apiVersion": "security.aether.io/v1alpha1", "kind": "AuthorizationPolicy",
            "metadata": {"name": "orders", "namespace": "shop"},
            "spec": {"action": "ALLOW", "selector": {"matchLabels": {"app": "orders"}},
                     "rules": [{"from": [{"source": {"serviceAccounts": ["shop/web"]}}],
                                "to": [{"operation": {"methods": ["GET", "POST"], "paths": paths}}]}]}})
    };
    let kind = ("security.aether.io", "v1alpha1", "AuthorizationPolicy");
    [
        ("/mutate/pods", admission_review("CREATE", ("", "v1", "Pod"), &pod)),
        (
            "/validate",
            admission_review("CREATE", kind, &policy(json!(["/orders/*", "/health"]))),
        ),
        (
            "/validate",
            admission_review("UPDATE", kind, &policy(json!(["no-slash"]))),
        ),
    ]
}

/// Each review kind's path and body, encoded once.
fn encoded() -> Vec<(&'static str, Vec<u8>)> {
    (reviews().into_iter())
        .map(|(path, review)| (path, serde_json::to_vec(&review).unwrap()))
        .collect()
}

/// One review: how long until its answer arrived. The answer is checked after the clock,
/// cheaply (the webhook e2e tests check answers field by field): it is a response to a
/// review with its verdict.
async fn timed(client: &mut WebhookConnection, path: &str, body: &[u8]) -> Duration {
    let sent = Instant::now();
    let (status, answer) = client.send("POST", path, body.to_vec()).await;
    let took = sent.elapsed();
    let text = String::from_utf8_lossy(&answer);
    assert_eq!(status, 200, "{text}");
    assert!(
        text.contains("\"response\":{\"uid\":") && text.contains("\"allowed\":"),
        "{text}"
    );
    took
}

/// What one load measured.
struct Load {
    took: Vec<Duration>,
    wall: Duration,
    cpu: Duration,
}

impl Load {
    fn print(mut self, name: &str, connections: usize, pid: u32) -> Duration {
        self.took.sort();
        let n = self.took.len();
        let p99 = percentile(&self.took, 0.99);
        println!(
            "webhook {name}: {n} reviews over {connections} connections: p50 {:?}, p90 {:?}, p99 {p99:?}, max {:?}; {:.0} reviews/s",
            percentile(&self.took, 0.50),
            percentile(&self.took, 0.90),
            self.took[n - 1],
            n as f64 / self.wall.as_secs_f64()
        );
        println!(
            "controller ({name}): {:.1} µs CPU per review, VmRSS {:.1} MiB (peak {:.1} MiB)",
            self.cpu.as_secs_f64() * 1e6 / n as f64,
            proc_status(pid, "VmRSS:") as f64 / (1 << 20) as f64,
            proc_status(pid, "VmHWM:") as f64 / (1 << 20) as f64
        );
        p99
    }
}

/// `rounds` bursts: every connection sends one review at the same moment, and the next
/// burst starts when all are answered.
async fn burst(clients: Vec<WebhookConnection>, rounds: usize, pid: u32) -> (Load, Vec<WebhookConnection>) {
    let barrier = Arc::new(Barrier::new(clients.len()));
    let (cpu_before, started) = (cpu_time(pid), Instant::now());
    let tasks: Vec<_> = (clients.into_iter().enumerate())
        .map(|(c, mut client)| {
            let barrier = barrier.clone();
            tokio::spawn(async move {
                let reviews = encoded();
                let mut took = Vec::with_capacity(rounds);
                for round in 0..rounds {
                    let (path, body) = &reviews[(c + round) % reviews.len()];
                    barrier.wait().await;
                    took.push(timed(&mut client, path, body).await);
                }
                (took, client)
            })
        })
        .collect();
    let mut load = Load {
        took: Vec::new(),
        wall: Duration::ZERO,
        cpu: Duration::ZERO,
    };
    let mut clients = Vec::new();
    for task in tasks {
        let (took, client) = task.await.unwrap();
        load.took.extend(took);
        clients.push(client);
    }
    (load.wall, load.cpu) = (started.elapsed(), cpu_time(pid) - cpu_before);
    (load, clients)
}

/// Every connection sends `per_connection` reviews back to back.
async fn sustained(clients: Vec<WebhookConnection>, per_connection: usize, pid: u32) -> Load {
    let (cpu_before, started) = (cpu_time(pid), Instant::now());
    let tasks: Vec<_> = (clients.into_iter().enumerate())
        .map(|(c, mut client)| {
            tokio::spawn(async move {
                let reviews = encoded();
                let mut took = Vec::with_capacity(per_connection);
                for i in 0..per_connection {
                    let (path, body) = &reviews[(c + i) % reviews.len()];
                    took.push(timed(&mut client, path, body).await);
                }
                took
            })
        })
        .collect();
    let mut took = Vec::new();
    for task in tasks {
        took.extend(task.await.unwrap());
    }
    Load {
        took,
        wall: started.elapsed(),
        cpu: cpu_time(pid) - cpu_before,
    }
}

/// The cores this process may use: the first for the controller, the rest for this client
/// (the one core for both where there is only one); every core for both unless `pin`.
fn split_cores(pin: bool) -> (Vec<usize>, Vec<usize>) {
    let allowed = sched_getaffinity(Pid::from_raw(0)).expect("this process's cores");
    let cores: Vec<usize> = (0..CpuSet::count())
        .filter(|&c| allowed.is_set(c).unwrap_or(false))
        .collect();
    match cores.split_first() {
        Some(_) if !pin => (cores.clone(), cores),
        Some((&first, [])) => (vec![first], vec![first]),
        Some((&first, rest)) => (vec![first], rest.to_vec()),
        None => panic!("no core to run on"),
    }
}

fn cpu_set(cores: &[usize]) -> CpuSet {
    let mut set = CpuSet::new();
    cores
        .iter()
        .for_each(|&core| set.set(core).expect("a core of this machine"));
    set
}

/// Every thread of `pid` on `cores` (threads it starts later inherit them).
fn pin(pid: u32, cores: &CpuSet) {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).expect("the controller's threads");
    for task in tasks {
        let tid: i32 = task.unwrap().file_name().to_string_lossy().parse().unwrap();
        sched_setaffinity(Pid::from_raw(tid), cores).expect("pinning a controller thread");
    }
}

fn main() {
    let connections = knob("AETHER_BENCH_CONNECTIONS", 200);
    let per_connection = knob("AETHER_BENCH_REVIEWS", 50);
    let (controller_cores, client_cores) = split_cores(knob("AETHER_BENCH_PIN", 1) != 0);
    // Before the runtime starts, so that its threads inherit the client's cores.
    sched_setaffinity(Pid::from_raw(0), &cpu_set(&client_cores)).expect("pinning the client");
    let rt = match client_cores.len() {
        1 => tokio::runtime::Builder::new_current_thread().enable_all().build(),
        n => (tokio::runtime::Builder::new_multi_thread()
            .worker_threads(n)
            .enable_all())
        .build(),
    };
    rt.unwrap().block_on(async move {
        let controller = Controller::start(&[]).await;
        let pid = controller.child.pid();
        pin(pid, &cpu_set(&controller_cores));
        println!("controller on core(s) {controller_cores:?}, this client on {client_cores:?}");
        let mut clients = Vec::new();
        for _ in 0..connections {
            clients.push(controller.connect().await);
        }
        let (load, clients) = burst(clients, per_connection, pid).await;
        let p99 = load.print("burst", connections, pid);
        sustained(clients, per_connection, pid)
            .await
            .print("sustained", connections, pid);
        if p99 > Duration::from_millis(5) {
            println!("PRODUCT PROBLEM: burst p99 {p99:?} is over the 5 ms goal");
        }
    });
}
