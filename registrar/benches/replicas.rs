//! Cross-replica convergence (`make bench`): two registrar replicas (release binary)
//! on one shared store; registrations sent to replica A at a steady rate, each timed
//! until a wildcard watcher on replica B sees it. Prints p50/p99/max over
//! AETHER_BENCH_REPLICA_REGISTRATIONS (default 1,000) per store.
//!
//! Goals: etcd p99 < 200 ms; DynamoDB API with a 1 s sync p99 < 1.5 s.
//!
//! Knobs (env): AETHER_BENCH_REPLICA_STORES (comma-separated, default "etcd,dynamodb"; each
//! store below is one [`BenchStore`]), AETHER_BENCH_REPLICA_REGISTRATIONS,
//! AETHER_BENCH_REPLICA_RATE (registrations per second, default 100),
//! AETHER_ETCD_BIN (default /usr/bin/etcd), AETHER_MOTO_BIN (default the venv's moto_server).

use parking_lot::Mutex;
use std::collections::HashMap;
use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use aether_proto::registrar::v1::registrar_client::RegistrarClient;
use aether_proto::registrar::v1::{RegisterEndpointRequest, WatchRequest, change, watch_response};
use aether_proto::registry::v1::{Endpoint, Port, Protocol};
use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;

fn knob(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// A child in its own process group, killed (group and all) on drop.
struct Process(Child);
impl Drop for Process {
    fn drop(&mut self) {
        let _ = killpg(Pid::from_raw(self.0.id() as i32), Signal::SIGKILL);
        let _ = self.0.wait();
    }
}

fn spawn(mut command: Command) -> Process {
    let child = command
        .process_group(0)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("spawning {command:?}: {e}"));
    Process(child)
}

/// A store server for the bench: etcd or moto's DynamoDB API.
trait BenchStore {
    /// Registrar flags selecting this store.
    fn registrar_args(&self) -> Vec<String>;
    /// Environment the registrars need for it (e.g. dummy AWS credentials for moto).
    fn env(&self) -> Vec<(String, String)> {
        Vec::new()
    }
}

struct EtcdServer {
    _process: Process,
    _dir: tempfile::TempDir,
    endpoint: String,
}

impl EtcdServer {
    async fn start() -> EtcdServer {
        let bin = std::env::var("AETHER_ETCD_BIN").unwrap_or_else(|_| "/usr/bin/etcd".into());
        let dir = tempfile::tempdir().unwrap();
        let (client, peer) = (free_port(), free_port());
        let endpoint = format!("http://127.0.0.1:{client}");
        let peer_url = format!("http://127.0.0.1:{peer}");
        let mut command = Command::new(&bin);
        command
            .arg("--name=bench")
            .arg(format!("--data-dir={}", dir.path().join("data").display()))
            .arg(format!("--listen-client-urls={endpoint}"))
            .arg(format!("--advertise-client-urls={endpoint}"))
            .arg(format!("--listen-peer-urls={peer_url}"))
            .arg(format!("--initial-advertise-peer-urls={peer_url}"))
            .arg(format!("--initial-cluster=bench={peer_url}"));
        let process = spawn(command);
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok(mut c) = etcd_client::Client::connect([&endpoint], None).await
                && c.get("/probe", None).await.is_ok()
            {
                break;
            }
            assert!(Instant::now() < deadline, "etcd ({bin}) did not come up");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        EtcdServer {
            _process: process,
            _dir: dir,
            endpoint,
        }
    }
}

impl BenchStore for EtcdServer {
    fn registrar_args(&self) -> Vec<String> {
        vec![
            "--store=etcd".into(),
            format!("--etcd-endpoints={}", self.endpoint),
            "--etcd-prefix=/aether-bench".into(),
        ]
    }
}

/// moto_server (the project venv's, or AETHER_MOTO_BIN) serving the DynamoDB API.
struct MotoServer {
    _process: Process,
    endpoint: String,
}

impl MotoServer {
    async fn start() -> MotoServer {
        let bin = std::env::var("AETHER_MOTO_BIN")
            .or_else(|_| std::env::var("AETHER_VENV").map(|v| format!("{v}/bin/moto_server")))
            .unwrap_or_else(|_| concat!(env!("CARGO_MANIFEST_DIR"), "/../.venv/bin/moto_server").into());
        let port = free_port();
        let mut command = Command::new(&bin);
        command.args(["-H", "127.0.0.1", "-p", &port.to_string()]);
        let process = spawn(command);
        let endpoint = format!("http://127.0.0.1:{port}");
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "moto_server ({bin}) did not come up");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        MotoServer {
            _process: process,
            endpoint,
        }
    }
}

impl BenchStore for MotoServer {
    fn registrar_args(&self) -> Vec<String> {
        vec![
            "--store=dynamodb".into(),
            format!("--dynamodb-endpoint-url={}", self.endpoint),
            "--dynamodb-region=us-east-1".into(),
            "--dynamodb-table=aether-bench".into(),
            "--dynamodb-sync-interval=1s".into(),
        ]
    }

    fn env(&self) -> Vec<(String, String)> {
        vec![
            ("AWS_ACCESS_KEY_ID".into(), "test".into()),
            ("AWS_SECRET_ACCESS_KEY".into(), "test".into()),
            ("AWS_EC2_METADATA_DISABLED".into(), "true".into()),
        ]
    }
}

struct Replica {
    _process: Process,
    _dir: tempfile::TempDir,
    client: RegistrarClient<Channel>,
}

async fn replica(store: &dyn BenchStore) -> Replica {
    let dir = tempfile::tempdir().unwrap();
    let grpc = format!("127.0.0.1:{}", free_port());
    let admin = format!("127.0.0.1:{}", free_port());
    let mut command = Command::new(env!("CARGO_BIN_EXE_aether-registrar"));
    command
        .args(["--insecure", "--listen", &grpc, "--admin", &admin, "--data-dir"])
        .arg(dir.path())
        .args(store.registrar_args())
        .envs(store.env())
        .env("RUST_LOG", "warn");
    let process = spawn(command);
    let deadline = Instant::now() + Duration::from_secs(20);
    let client = loop {
        match RegistrarClient::connect(format!("http://{grpc}")).await {
            Ok(c) => break c,
            Err(_) if Instant::now() < deadline => tokio::time::sleep(Duration::from_millis(50)).await,
            Err(e) => panic!("registrar did not come up: {e}"),
        }
    };
    Replica {
        _process: process,
        _dir: dir,
        client,
    }
}

fn endpoint(i: usize) -> Endpoint {
    Endpoint {
        service: format!("bench/svc-{}", i % 50),
        address: format!("10.{}.{}.{}", (i >> 16) & 0xff, (i >> 8) & 0xff, i & 0xff),
        ports: vec![Port {
            name: "http".into(),
            port: 8080,
            protocol: Protocol::Http as i32,
        }],
        node: format!("node-{}", i % 20),
        weight: 1,
        health: 1,
        ..Default::default()
    }
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

/// Register on A → seen by a watcher on B, for `n` registrations at `rate`/s.
async fn measure(name: &str, store: &dyn BenchStore, n: usize, rate: usize) {
    let a = replica(store).await;
    let mut b = replica(store).await;
    let sent: Arc<SentAt> = Arc::default();
    let mut seen = watch_additions(&mut b).await;
    let started = Instant::now();
    let mut acks = register_at_rate(&a, n, rate, &sent).await;
    let mut latencies = Vec::with_capacity(n);
    let deadline = Instant::now() + Duration::from_secs(120);
    while latencies.len() < n {
        let remaining = deadline.saturating_duration_since(Instant::now());
        let Ok(Some((address, at))) = tokio::time::timeout(remaining, seen.recv()).await else {
            panic!(
                "{name}: only {} of {n} registrations reached replica B",
                latencies.len()
            );
        };
        if let Some(t0) = sent.lock().get(&address) {
            latencies.push(at.saturating_duration_since(*t0));
        }
    }
    let total = started.elapsed();
    let mut acked = Vec::with_capacity(n);
    while let Some(ack) = acks.recv().await {
        acked.push(ack);
    }
    latencies.sort();
    acked.sort();
    print_results(name, n, rate, total, &latencies, &acked);
}

/// When the bench sent each registration, by address.
type SentAt = Mutex<HashMap<String, Instant>>;

/// A wildcard watcher on `b`: yields every added endpoint's address and when it was
/// seen, once the watcher's snapshot is complete.
async fn watch_additions(b: &mut Replica) -> mpsc::UnboundedReceiver<(String, Instant)> {
    let (seen_tx, seen_rx) = mpsc::unbounded_channel::<(String, Instant)>();
    let (requests, outbox) = mpsc::channel(1);
    requests
        .send(WatchRequest {
            wildcard: true,
            ..Default::default()
        })
        .await
        .unwrap();
    let mut stream = b.client.watch(ReceiverStream::new(outbox)).await.unwrap().into_inner();
    let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
    tokio::spawn(async move {
        let _requests = requests;
        let mut ready = Some(ready_tx);
        while let Ok(Some(message)) = stream.message().await {
            let now = Instant::now();
            match message.event {
                Some(watch_response::Event::SnapshotComplete(_)) => {
                    if let Some(ready) = ready.take() {
                        let _ = ready.send(());
                    }
                }
                Some(watch_response::Event::Delta(delta)) => {
                    for c in delta.changes {
                        if let Some(change::Change::EndpointAdded(e)) = c.change {
                            let _ = seen_tx.send((e.address, now));
                        }
                    }
                }
                _ => {}
            }
        }
    });
    ready_rx.await.expect("the watcher on B got its snapshot");
    seen_rx
}

/// Sends `n` registrations to `a` at `rate`/s, each in its own task, noting in `sent`
/// when each left; yields how long each took to be acknowledged.
async fn register_at_rate(a: &Replica, n: usize, rate: usize, sent: &Arc<SentAt>) -> mpsc::UnboundedReceiver<Duration> {
    let (ack_tx, ack_rx) = mpsc::unbounded_channel();
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / rate.max(1) as f64));
    for i in 0..n {
        tick.tick().await;
        let e = endpoint(i);
        let mut client = a.client.clone();
        let sent = sent.clone();
        let ack_tx = ack_tx.clone();
        tokio::spawn(async move {
            let t0 = Instant::now();
            sent.lock().insert(e.address.clone(), t0);
            client
                .register_endpoint(RegisterEndpointRequest { endpoint: Some(e) })
                .await
                .expect("register on A");
            let _ = ack_tx.send(t0.elapsed());
        });
    }
    ack_rx
}

fn print_results(name: &str, n: usize, rate: usize, total: Duration, latencies: &[Duration], acks: &[Duration]) {
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    println!(
        "  {name:<8} register on A -> watcher on B: p50 {:>7.1} ms  p99 {:>7.1} ms  max {:>7.1} ms  ({n} registrations at {rate}/s, {:.1} s)",
        ms(percentile(latencies, 0.50)),
        ms(percentile(latencies, 0.99)),
        ms(*latencies.last().unwrap()),
        total.as_secs_f64()
    );
    println!(
        "  {name:<8} Register acknowledged on A:   p50 {:>7.1} ms  p99 {:>7.1} ms",
        ms(percentile(acks, 0.50)),
        ms(percentile(acks, 0.99))
    );
}

#[tokio::main]
async fn main() {
    let n = knob("AETHER_BENCH_REPLICA_REGISTRATIONS", 1_000);
    let rate = knob("AETHER_BENCH_REPLICA_RATE", 100);
    let stores = std::env::var("AETHER_BENCH_REPLICA_STORES").unwrap_or_else(|_| "etcd,dynamodb".into());
    println!("replica convergence bench: 2 replicas on one store, {n} registrations at {rate}/s");
    for name in stores.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        match name {
            "etcd" => {
                let etcd = EtcdServer::start().await;
                measure("etcd", &etcd, n, rate).await;
            }
            "dynamodb" => {
                let moto = MotoServer::start().await;
                measure("dynamodb", &moto, n, rate).await;
            }
            other => panic!("AETHER_BENCH_REPLICA_STORES: unknown store {other:?} (known: etcd, dynamodb)"),
        }
    }
}
