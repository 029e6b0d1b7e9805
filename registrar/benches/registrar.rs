//! Registrar at scale (`make bench`): 10,000 services / 100,000 endpoints and 1,000
//! concurrent watchers each filtered to 50 services, against the release binary on
//! loopback. Prints: load rate, a new wildcard watcher's full snapshot time,
//! Register → every affected watcher latency (p50/p99), sustained change rate with
//! all watchers connected, and the registrar's RSS.
//!
//! Each watcher has its own connection, as each node's agent does.
//!
//! Knobs (env): AETHER_BENCH_SERVICES, AETHER_BENCH_ENDPOINTS_PER_SERVICE,
//! AETHER_BENCH_WATCHERS, AETHER_BENCH_FILTER.

use std::collections::HashMap;
use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use aether_proto::registrar::v1::registrar_client::RegistrarClient;
use aether_proto::registrar::v1::{RegisterEndpointRequest, WatchRequest, change, watch_response};
use aether_proto::registry::v1::{Endpoint, Locality, PodInfo, Port, Protocol};
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;

const CONNECTIONS: usize = 8;
const LOAD_CONCURRENCY: usize = 256;

fn knob(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

struct Process(Child);
impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn rss_kib(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

fn address(i: usize) -> String {
    format!("10.{}.{}.{}", (i >> 16) & 0xff, (i >> 8) & 0xff, i & 0xff)
}

fn service_key(s: usize) -> String {
    format!("ns{}/svc{}", s % 100, s)
}

fn endpoint(service: usize, i: usize) -> Endpoint {
    Endpoint {
        service: service_key(service),
        address: address(i),
        ports: vec![Port {
            name: "http".into(),
            port: 8080,
            protocol: Protocol::Http as i32,
        }],
        locality: Some(Locality {
            region: "eu-west-1".into(),
            zone: format!("eu-west-1{}", ["a", "b", "c"][i % 3]),
            subzone: String::new(),
        }),
        weight: 1,
        health: 1,
        metadata: Default::default(),
        pod: Some(PodInfo {
            namespace: format!("ns{}", service % 100),
            name: format!("svc{service}-{i}"),
            uid: format!("00000000-0000-0000-0000-{i:012}"),
            service_account: format!("svc{service}"),
        }),
        node: format!("node-{}", i % 500),
    }
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

/// Registers `endpoints` with LOAD_CONCURRENCY in flight; returns the elapsed time.
async fn register_all(
    clients: &[RegistrarClient<Channel>],
    endpoints: Vec<Endpoint>,
    sent: Option<&SentAt>,
) -> Duration {
    let started = Instant::now();
    let mut in_flight = FuturesUnordered::new();
    for (n, e) in endpoints.into_iter().enumerate() {
        if in_flight.len() >= LOAD_CONCURRENCY {
            in_flight.next().await;
        }
        let mut client = clients[n % clients.len()].clone();
        if let Some(sent) = sent {
            sent.lock().unwrap().insert(e.address.clone(), Instant::now());
        }
        in_flight.push(async move {
            client
                .register_endpoint(RegisterEndpointRequest { endpoint: Some(e) })
                .await
                .expect("register");
        });
    }
    while in_flight.next().await.is_some() {}
    started.elapsed()
}

type SentAt = Mutex<HashMap<String, Instant>>;

/// Follows one watch stream; records the latency of every endpoint it is told about
/// that the bench registered with a timestamp.
async fn follow(
    grpc: String,
    services: Vec<String>,
    sent: Arc<SentAt>,
    latencies: Arc<Mutex<Vec<Duration>>>,
    ready: mpsc::Sender<()>,
) {
    let (tx, rx) = mpsc::channel(1);
    tx.send(WatchRequest {
        services,
        ..Default::default()
    })
    .await
    .unwrap();
    // Its own connection, as each node's agent has.
    let mut client = RegistrarClient::connect(format!("http://{grpc}"))
        .await
        .expect("connect");
    let mut stream = client.watch(ReceiverStream::new(rx)).await.expect("watch").into_inner();
    let mut ready = Some(ready);
    while let Ok(Some(message)) = stream.message().await {
        match message.event {
            Some(watch_response::Event::SnapshotComplete(_)) => {
                if let Some(ready) = ready.take() {
                    let _ = ready.send(()).await;
                }
            }
            Some(watch_response::Event::Delta(delta)) => {
                let now = Instant::now();
                let sent = sent.lock().unwrap();
                let mut lat = latencies.lock().unwrap();
                for c in delta.changes {
                    if let Some(change::Change::EndpointAdded(e)) = c.change
                        && let Some(at) = sent.get(&e.address)
                    {
                        lat.push(now - *at);
                    }
                }
            }
            _ => {}
        }
    }
    drop(tx);
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let services = knob("AETHER_BENCH_SERVICES", 10_000);
    let per_service = knob("AETHER_BENCH_ENDPOINTS_PER_SERVICE", 10);
    let watchers = knob("AETHER_BENCH_WATCHERS", 1_000);
    let filter_size = knob("AETHER_BENCH_FILTER", 50);
    let total = services * per_service;

    let dir = tempfile::tempdir().unwrap();
    let grpc = format!("127.0.0.1:{}", free_port());
    let admin = format!("127.0.0.1:{}", free_port());
    let child = Command::new(env!("CARGO_BIN_EXE_aether-registrar"))
        .args(["--insecure", "--listen", &grpc, "--admin", &admin, "--data-dir"])
        .arg(dir.path())
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .spawn()
        .expect("spawning aether-registrar");
    let pid = child.id();
    let _registrar = Process(child);
    let mut clients = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    while clients.len() < CONNECTIONS {
        match RegistrarClient::connect(format!("http://{grpc}")).await {
            Ok(c) => clients.push(c),
            Err(_) if Instant::now() < deadline => tokio::time::sleep(Duration::from_millis(50)).await,
            Err(e) => panic!("registrar did not come up: {e}"),
        }
    }
    println!(
        "registrar bench: {services} services x {per_service} endpoints, {watchers} watchers x {filter_size} services"
    );

    // 1. Load the catalog.
    let endpoints: Vec<_> = (0..total).map(|i| endpoint(i % services, i)).collect();
    let took = register_all(&clients, endpoints, None).await;
    println!(
        "  load {total} endpoints:                 {:>8.2} s  ({:.0} registrations/s, durable, group-committed)",
        took.as_secs_f64(),
        total as f64 / took.as_secs_f64()
    );
    println!(
        "  registrar RSS after load: {:.1} MiB",
        rss_kib(pid, "VmRSS:") as f64 / 1024.0
    );

    // 2. Watchers, each on 50 pseudo-random services.
    let sent: Arc<SentAt> = Arc::default();
    let latencies: Arc<Mutex<Vec<Duration>>> = Arc::default();
    let (ready_tx, mut ready_rx) = mpsc::channel(watchers.max(1));
    let started = Instant::now();
    let mut filters = Vec::new();
    for w in 0..watchers {
        let filter: Vec<usize> = (0..filter_size).map(|k| (w * 7919 + k * 104_729) % services).collect();
        filters.push(filter.clone());
        tokio::spawn(follow(
            grpc.clone(),
            filter.into_iter().map(service_key).collect(),
            sent.clone(),
            latencies.clone(),
            ready_tx.clone(),
        ));
    }
    for _ in 0..watchers {
        ready_rx.recv().await.unwrap();
    }
    println!(
        "  {watchers} watchers connected + snapshots:  {:>8.2} s",
        started.elapsed().as_secs_f64()
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    println!(
        "  registrar RSS with watchers: {:.1} MiB",
        rss_kib(pid, "VmRSS:") as f64 / 1024.0
    );

    // 3. A new wildcard watcher's full snapshot.
    let mut snapshot_times = Vec::new();
    for _ in 0..3 {
        let mut client = clients[0].clone();
        let (tx, rx) = mpsc::channel(1);
        tx.send(WatchRequest {
            wildcard: true,
            ..Default::default()
        })
        .await
        .unwrap();
        let started = Instant::now();
        let mut stream = client.watch(ReceiverStream::new(rx)).await.unwrap().into_inner();
        let mut count = 0;
        while let Some(message) = stream.message().await.unwrap() {
            match message.event {
                Some(watch_response::Event::Snapshot(s)) => count += s.endpoints.len(),
                Some(watch_response::Event::SnapshotComplete(_)) => break,
                _ => {}
            }
        }
        assert_eq!(count, total, "the wildcard snapshot is incomplete");
        snapshot_times.push(started.elapsed());
    }
    snapshot_times.sort();
    println!(
        "  wildcard snapshot of {total} endpoints:  {:>8.1} ms (median of 3; min {:.1} ms)",
        snapshot_times[1].as_secs_f64() * 1e3,
        snapshot_times[0].as_secs_f64() * 1e3
    );

    // 4. Fan-out latency: one registration at a time, on services that watchers watch.
    let probes = 2_000;
    let mut watched = Vec::new();
    for f in &filters {
        watched.extend_from_slice(f);
    }
    let mut expected = 0;
    let mut fan_out: HashMap<usize, usize> = HashMap::new();
    for f in &filters {
        for s in f {
            *fan_out.entry(*s).or_default() += 1;
        }
    }
    for p in 0..probes {
        let service = watched[(p * 31) % watched.len()];
        expected += fan_out[&service];
        let e = endpoint(service, total + p);
        let mut client = clients[p % CONNECTIONS].clone();
        sent.lock().unwrap().insert(e.address.clone(), Instant::now());
        client
            .register_endpoint(RegisterEndpointRequest { endpoint: Some(e) })
            .await
            .unwrap();
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while latencies.lock().unwrap().len() < expected && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let mut lat = std::mem::take(&mut *latencies.lock().unwrap());
    lat.sort();
    println!(
        "  Register -> affected watcher ({} deliveries of {expected}): p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
        lat.len(),
        percentile(&lat, 0.50).as_secs_f64() * 1e3,
        percentile(&lat, 0.99).as_secs_f64() * 1e3,
        percentile(&lat, 1.0).as_secs_f64() * 1e3,
    );

    // 5. Sustained change rate with every watcher connected.
    let burst = 20_000;
    let endpoints: Vec<_> = (0..burst)
        .map(|i| endpoint(watched[(i * 17) % watched.len()], total + probes + i))
        .collect();
    let expected: usize = endpoints
        .iter()
        .map(|e| {
            let s: usize = e.service.rsplit("svc").next().unwrap().parse().unwrap();
            fan_out[&s]
        })
        .sum();
    let took = register_all(&clients, endpoints, Some(&sent)).await;
    let deadline = Instant::now() + Duration::from_secs(60);
    while latencies.lock().unwrap().len() < expected && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let delivered_after = latencies.lock().unwrap().len();
    let mut lat = std::mem::take(&mut *latencies.lock().unwrap());
    lat.sort();
    println!(
        "  sustained: {burst} registrations in {:.2} s = {:.0} changes/s committed; {delivered_after}/{expected} deliveries, p99 {:.1} ms under load",
        took.as_secs_f64(),
        burst as f64 / took.as_secs_f64(),
        percentile(&lat, 0.99).as_secs_f64() * 1e3,
    );

    // 6. Memory.
    println!(
        "  registrar RSS: {:.1} MiB now, {:.1} MiB peak",
        rss_kib(pid, "VmRSS:") as f64 / 1024.0,
        rss_kib(pid, "VmHWM:") as f64 / 1024.0
    );
    let metrics = reqwest_metrics(&admin).await;
    for line in metrics
        .lines()
        .filter(|l| l.starts_with("aether_registrar_watch_snapshots_total"))
    {
        println!("  {line}");
    }
}

async fn reqwest_metrics(admin: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(admin).await.unwrap();
    stream.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").await.unwrap();
    let mut body = String::new();
    stream.read_to_string(&mut body).await.unwrap();
    body
}
