//! Envoy hot restarts under the supervisor (`cargo bench -p aether-tests --bench hot_restart`, as root, after
//! `cargo build --workspace --bins --release`): a real registrar and `aether-agent run`, and Envoy 1.40 run by
//! `aether-agent proxy` from the shipped bootstrap (the `aether_tests::mesh::Mesh` fixture), drain 1 s and parent
//! shutdown 2 s.
//!
//! Steady load from a frontend pod to a backend pod through Envoy's outbound listener (bound in the frontend's
//! netns): HTTP/1.1 keep-alive (4 connections) and h2c (2 connections × 4 streams), from the reconnecting client in
//! `aether_tests::load`. Then AETHER_BENCH_RESTARTS (200) hot restarts, each triggered by SIGHUP to the supervisor
//! once traffic flows through the current epoch and the previous one has retired (Envoy kills a draining parent
//! when its child becomes a parent; the supervisor defers such a trigger, which would add up to the parent-shutdown
//! time to the measured handoff).
//!
//! Prints: requests ok / failed / unsent-and-resent / connects per protocol over all restarts (goal: 0 failed); the
//! handoff time from SIGHUP to Envoy's admin answering LIVE at the new epoch (polled every 2 ms), p50/p90/p99/max;
//! and the supervisor's own trigger → LIVE histogram (mean).

use std::time::{Duration, Instant};

use aether_tests::bench::percentile;
use aether_tests::load::{Load, LoadSpec, Protocol};
use aether_tests::mesh::{Mesh, fqdn};
use aether_tests::supervisor::{ProxySupervisor, metric_sum};
use nix::sys::signal::Signal;

const OUTBOUND: &str = "127.0.0.1:18081";
const LIVE_TIMEOUT: Duration = Duration::from_secs(30);

fn knob(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

async fn wait_live(proxy: &mut ProxySupervisor, epoch: u64) -> Duration {
    let started = Instant::now();
    loop {
        if let Ok((state, e)) = proxy.envoy_epoch().await
            && state == "LIVE"
            && e == epoch
        {
            return started.elapsed();
        }
        assert!(
            started.elapsed() < LIVE_TIMEOUT,
            "epoch {epoch} not LIVE within {LIVE_TIMEOUT:?}; supervisor logs:\n{}",
            proxy.child.logs()
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    if std::env::args().any(|a| a == "--list") {
        return; // `cargo bench -- --list` / nextest discovery: nothing to list.
    }
    let restarts = knob("AETHER_BENCH_RESTARTS", 200) as u64;
    let mut mesh = Mesh::start_with_proxy(&[]).await;
    let (frontend, _backend, _apps) = mesh.frontend_and_backend().await;
    let host = format!("{}:8080", fqdn("backend"));
    let spec = |protocol, connections, streams| LoadSpec {
        target: OUTBOUND.parse().unwrap(),
        host: host.clone(),
        path: "/bench".into(),
        protocol,
        connections,
        streams,
        netns: Some(frontend.netns_path()),
    };
    let h1 = Load::start(spec(Protocol::Http1, 4, 1));
    let h2 = Load::start(spec(Protocol::Http2, 2, 4));
    h1.wait_ok(200, Duration::from_secs(20)).await;
    h2.wait_ok(200, Duration::from_secs(20)).await;

    let proxy = mesh.proxy.as_mut().expect("supervisor");
    let started = Instant::now();
    let handoffs = restart_under_load(proxy, restarts, &h1, &h2).await;
    let restarting = started.elapsed();
    // The last old epoch drains and exits under load as well.
    while proxy.envoy_pids().len() > 1 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    h1.wait_ok(20, Duration::from_secs(10)).await;
    let (h1, h2) = (h1.stop().await, h2.stop().await);
    let metrics = proxy.metrics().await;

    println!(
        "hot_restart: {restarts} hot restarts in {restarting:.1?} under steady load (drain 1s, parent shutdown 2s)"
    );
    for (name, r) in [("HTTP/1.1 keep-alive x4", &h1), ("h2c 2 conns x 4 streams", &h2)] {
        println!(
            "hot_restart: {name}: {} ok, {} FAILED, {} unsent-and-resent, {} connects, {} connect failures ({:.0} req/s)",
            r.ok,
            r.failed,
            r.retried_unsent,
            r.connects,
            r.connect_failures,
            r.ok as f64 / r.elapsed.as_secs_f64()
        );
        for e in &r.errors {
            println!("hot_restart:   failure: {e}");
        }
    }
    print_handoffs(handoffs, &metrics);
}

/// `restarts` SIGHUPs, each once the previous old epoch retired, while both loads keep succeeding: how long each
/// new epoch took to go LIVE.
async fn restart_under_load(proxy: &mut ProxySupervisor, restarts: u64, h1: &Load, h2: &Load) -> Vec<Duration> {
    let mut handoffs = Vec::new();
    for epoch in 1..=restarts {
        let deadline = Instant::now() + Duration::from_secs(20);
        while proxy.envoy_pids().len() > 1 {
            assert!(Instant::now() < deadline, "epoch {} did not retire", epoch - 1);
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        proxy.signal(Signal::SIGHUP);
        handoffs.push(wait_live(proxy, epoch).await);
        h1.wait_ok(20, Duration::from_secs(10)).await;
        h2.wait_ok(20, Duration::from_secs(10)).await;
    }
    handoffs
}

fn print_handoffs(mut handoffs: Vec<Duration>, metrics: &str) {
    handoffs.sort();
    println!(
        "hot_restart: SIGHUP -> new epoch LIVE (admin polled every 2 ms): p50 {:.1?} p90 {:.1?} p99 {:.1?} max {:.1?}",
        percentile(&handoffs, 0.50),
        percentile(&handoffs, 0.90),
        percentile(&handoffs, 0.99),
        handoffs.last().copied().unwrap_or_default()
    );
    let (sum, count) = (
        metric_sum(metrics, "aether_proxy_handoff_duration_seconds_sum"),
        metric_sum(metrics, "aether_proxy_handoff_duration_seconds_count"),
    );
    println!(
        "hot_restart: supervisor trigger -> LIVE (its histogram, incl. epoch 0): mean {:.1} ms over {count} handoffs; \
         hot restarts {} crashes {} validation failures {}",
        1000.0 * sum / count.max(1.0),
        metric_sum(metrics, "aether_proxy_hot_restarts_total"),
        metric_sum(metrics, "aether_proxy_envoy_crashes_total"),
        metric_sum(metrics, "aether_proxy_validation_failures_total"),
    );
}
