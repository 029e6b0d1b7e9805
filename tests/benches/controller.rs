//! `aether-controller`'s webhooks under load: 200 kept-alive HTTPS connections (kube-apiserver
//! keeps a pool to each webhook) send AdmissionReviews at once, each connection one after
//! another: a third pod mutations, a third valid AuthorizationPolicies, a third refused
//! ones. Prints the latency of a review as the client sees it (p50/p90/p99/max), the
//! throughput, the controller's CPU per review and its RSS. Goal (issue 20): p99 < 5 ms
//! per review at 200 concurrent reviews on this machine.
//!
//! Knobs: `AETHER_BENCH_CONNECTIONS` (200), `AETHER_BENCH_REVIEWS` (per connection, 50).

use std::time::{Duration, Instant};

use aether_tests::bench::{cpu_time, knob, percentile, proc_status};
use aether_tests::controller::{Controller, admission_review};
use serde_json::{Value, json};

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

fn main() {
    let connections = knob("AETHER_BENCH_CONNECTIONS", 200);
    let per_connection = knob("AETHER_BENCH_REVIEWS", 50);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        let controller = Controller::start(&[]).await;
        let pid = controller.child.pid();
        let mut clients = Vec::new();
        for _ in 0..connections {
            clients.push(controller.connect().await);
        }
        let cpu_before = cpu_time(pid);
        let started = Instant::now();
        let tasks: Vec<_> = clients
            .into_iter()
            .enumerate()
            .map(|(c, mut client)| {
                tokio::spawn(async move {
                    let reviews = reviews();
                    let mut took = Vec::with_capacity(per_connection);
                    for i in 0..per_connection {
                        let (path, review) = &reviews[(c + i) % reviews.len()];
                        let sent = Instant::now();
                        let answer = client.review(path, review).await;
                        took.push(sent.elapsed());
                        assert_eq!(answer["response"]["uid"], review["request"]["uid"]);
                    }
                    took
                })
            })
            .collect();
        let mut all = Vec::new();
        for task in tasks {
            all.extend(task.await.unwrap());
        }
        let wall = started.elapsed();
        let cpu = cpu_time(pid) - cpu_before;
        all.sort();
        let n = all.len();
        println!(
            "webhook reviews: {n} over {connections} concurrent connections: p50 {:?}, p90 {:?}, p99 {:?}, max {:?}; {:.0} reviews/s",
            percentile(&all, 0.50),
            percentile(&all, 0.90),
            percentile(&all, 0.99),
            all[n - 1],
            n as f64 / wall.as_secs_f64()
        );
        println!(
            "controller: {:.1} µs CPU per review, VmRSS {:.1} MiB (peak {:.1} MiB)",
            cpu.as_secs_f64() * 1e6 / n as f64,
            proc_status(pid, "VmRSS:") as f64 / (1 << 20) as f64,
            proc_status(pid, "VmHWM:") as f64 / (1 << 20) as f64
        );
        let p99 = percentile(&all, 0.99);
        if p99 > Duration::from_millis(5) {
            println!("PRODUCT PROBLEM: p99 {p99:?} is over the 5 ms goal");
        }
    });
}
