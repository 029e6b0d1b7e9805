//! Registrar at scale (`make bench`): 10,000 services / 100,000 endpoints and 1,000
//! concurrent watchers each filtered to 50 services, against the release binary on
//! loopback, run twice — plaintext (`--insecure`) and mTLS — and compared side by side:
//! load rate, the watchers' connect + snapshot time, a new wildcard watcher's full
//! snapshot time, Register → every affected watcher latency (p50/p99), sustained change
//! rate with all watchers connected, and the registrar's RSS; then the mTLS/plaintext
//! ratio of the fan-out p99 against the goal (within 10 %).
//!
//! Both runs have the same shape: each watcher has its own connection, as each node's
//! agent does, and registrations go through one connection per node (the agent of the
//! endpoint's node). With mTLS each of those connections presents its node's
//! certificate (`spiffe://<td>/aether/node/<node>`), so the registrar checks every
//! write against the caller's node, as in a cluster. The certificates are made once
//! per run.
//!
//! The bench and the registrar share the machine: with mTLS the bench's side of every
//! connection (1,000 watchers decrypting their deltas) competes with the registrar for
//! the same cores, which a cluster spreads over its nodes.
//!
//! Knobs (env): AETHER_BENCH_SERVICES, AETHER_BENCH_ENDPOINTS_PER_SERVICE,
//! AETHER_BENCH_WATCHERS, AETHER_BENCH_FILTER, AETHER_BENCH_MODES (`plaintext,tls`,
//! the runs and their order).

use parking_lot::Mutex;
use std::collections::HashMap;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use aether_common::tls::{self, CertSlot, Connector, ServerIdentity};
use aether_proto::registrar::v1::registrar_client::RegistrarClient;
use aether_proto::registrar::v1::{RegisterEndpointRequest, WatchRequest, change, watch_response};
use aether_proto::registry::v1::{Endpoint, Locality, PodInfo, Port, Protocol};
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType,
};
use rustls::RootCertStore;
use rustls::sign::CertifiedKey;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio::sync::{Semaphore, mpsc};
use tokio::task::JoinHandle;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;

/// Endpoint `i` lives on node `i % NODES`; that node's agent registers it.
const NODES: usize = 500;
const LOAD_CONCURRENCY: usize = 256;
/// Registrations that probe fan-out latency, sent one at a time.
const PROBES: usize = 2_000;
/// Connections being set up at once: every watcher, as every agent does after a
/// registrar restart. (With tokio's default listen backlog of 128 this stampede reset
/// ~170 of 1,000 connections; the registrar now listens with 4,096. Failed connects are
/// retried and counted, so a regression shows as "retried connections".)
const CONNECT_CONCURRENCY: usize = 1024;
/// How long a watcher keeps retrying its connection before the bench gives up.
const WATCHER_DEADLINE: Duration = Duration::from_secs(120);
/// The DNS name the registrar's certificate carries and clients verify.
const REGISTRAR_NAME: &str = "aether-registrar.aether-system.svc";
const TRUST_DOMAIN: &str = "aether.bench";

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

fn rss_mib(pid: u32, field: &str) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let kib: u64 = status
        .lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    kib as f64 / 1024.0
}

fn address(i: usize) -> String {
    format!("10.{}.{}.{}", (i >> 16) & 0xff, (i >> 8) & 0xff, i & 0xff)
}

fn service_key(s: usize) -> String {
    format!("ns{}/svc{}", s % 100, s)
}

fn node_name(node: usize) -> String {
    format!("node-{node}")
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
        node: node_name(i % NODES),
    }
}

/// The connection of the agent of `e`'s node.
fn writer_for<'a>(writers: &'a [RegistrarClient<Channel>], e: &Endpoint) -> &'a RegistrarClient<Channel> {
    let node: usize = e
        .node
        .strip_prefix("node-")
        .and_then(|n| n.parse().ok())
        .expect("a bench node name");
    &writers[node]
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

// ---------------------------------------------------------------------------------------
// Certificates

/// The run's PKI: a CA for the registrar's serving certificate and a node CA for the
/// agents' certificates, written where the registrar's flags point.
struct Pki {
    _dir: tempfile::TempDir,
    server_cert: PathBuf,
    server_key: PathBuf,
    node_ca_cert: PathBuf,
    registrar_roots: Arc<RootCertStore>,
    /// The certificate of the agent of node `k`, at `k`.
    nodes: Vec<Arc<CertifiedKey>>,
}

fn ca(name: &str) -> (Issuer<'static, KeyPair>, String, CertificateDer<'static>) {
    let key = KeyPair::generate().unwrap();
    let mut params = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, name);
    params.distinguished_name = dn;
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::DigitalSignature];
    params.not_before = (SystemTime::now() - Duration::from_secs(3600)).into();
    params.not_after = (SystemTime::now() + Duration::from_secs(86400)).into();
    let cert = params.self_signed(&key).unwrap();
    (Issuer::new(params, key), cert.pem(), cert.der().clone())
}

/// A leaf (client and server auth) naming `san`, valid for a day.
fn leaf(issuer: &Issuer<'static, KeyPair>, san: SanType) -> (rcgen::Certificate, KeyPair) {
    let key = KeyPair::generate().unwrap();
    let mut params = CertificateParams::default();
    params.subject_alt_names = vec![san];
    params.is_ca = IsCa::ExplicitNoCa;
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
    params.use_authority_key_identifier_extension = true;
    params.not_before = (SystemTime::now() - Duration::from_secs(60)).into();
    params.not_after = (SystemTime::now() + Duration::from_secs(86400)).into();
    let cert = params.signed_by(&key, issuer).unwrap();
    (cert, key)
}

impl Pki {
    fn new(nodes: usize) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let write = |name: &str, pem: &str| -> PathBuf {
            let path = dir.path().join(name);
            std::fs::write(&path, pem).unwrap();
            path
        };
        let (registrar_ca, _, registrar_ca_der) = ca("aether bench registrar CA");
        let (server, server_key) = leaf(
            &registrar_ca,
            SanType::DnsName(REGISTRAR_NAME.to_owned().try_into().unwrap()),
        );
        let (node_ca, node_ca_pem, _) = ca("aether bench node CA");
        let nodes = (0..nodes)
            .map(|k| {
                let id = format!("spiffe://{TRUST_DOMAIN}/aether/node/{}", node_name(k));
                let (cert, key) = leaf(&node_ca, SanType::URI(id.try_into().unwrap()));
                tls::certified_key(
                    vec![cert.der().clone()],
                    PrivateKeyDer::Pkcs8(key.serialize_der().into()),
                )
                .unwrap()
            })
            .collect();
        Self {
            server_cert: write("registrar.crt", &server.pem()),
            server_key: write("registrar.key", &server_key.serialize_pem()),
            node_ca_cert: write("node-ca.crt", &node_ca_pem),
            registrar_roots: tls::roots("registrar CA", vec![registrar_ca_der]).unwrap(),
            nodes,
            _dir: dir,
        }
    }
}

// ---------------------------------------------------------------------------------------
// The two ways of talking to the registrar

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Plaintext,
    Tls,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Plaintext => "plaintext",
            Mode::Tls => "mTLS",
        }
    }
}

/// Opens connections to the registrar as the agent of a given node.
#[derive(Clone)]
enum Dialer {
    Plain {
        url: String,
    },
    Tls {
        url: String,
        roots: Arc<RootCertStore>,
        nodes: Arc<Vec<Arc<CertifiedKey>>>,
    },
}

impl Dialer {
    /// A new connection of the agent of `node` (with mTLS, presenting its certificate).
    async fn connect(&self, node: usize) -> Result<RegistrarClient<Channel>, tonic::transport::Error> {
        let channel = match self {
            Dialer::Plain { url } => {
                tonic::transport::Endpoint::from_shared(url.clone())
                    .unwrap()
                    .connect_timeout(Duration::from_secs(10))
                    .connect()
                    .await?
            }
            Dialer::Tls { url, roots, nodes } => {
                let config = tls::client_config(
                    roots.clone(),
                    ServerIdentity::Dns(REGISTRAR_NAME.into()),
                    CertSlot::new(nodes[node % nodes.len()].clone()),
                )
                .unwrap();
                // tonic would do its own TLS on https://; the connector does ours.
                tonic::transport::Endpoint::from_shared(url.clone())
                    .unwrap()
                    .connect_timeout(Duration::from_secs(10))
                    .connect_with_connector(Connector::new(config))
                    .await?
            }
        };
        Ok(RegistrarClient::new(channel))
    }
}

// ---------------------------------------------------------------------------------------
// Load and watchers

type SentAt = Mutex<HashMap<String, Instant>>;

/// Registers `endpoints`, each through its node's connection, with LOAD_CONCURRENCY in
/// flight; returns the elapsed time.
async fn register_all(
    writers: &[RegistrarClient<Channel>],
    endpoints: Vec<Endpoint>,
    sent: Option<&SentAt>,
) -> Duration {
    let started = Instant::now();
    let mut in_flight = FuturesUnordered::new();
    for e in endpoints {
        if in_flight.len() >= LOAD_CONCURRENCY {
            in_flight.next().await;
        }
        let mut client = writer_for(writers, &e).clone();
        if let Some(sent) = sent {
            sent.lock().insert(e.address.clone(), Instant::now());
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

/// Follows one watch stream on its own connection as the agent of `node`; records the
/// latency of every endpoint it is told about that the bench registered with a
/// timestamp. Sends the number of connection attempts it retried once its snapshot is
/// complete.
async fn follow(
    dialer: Dialer,
    node: usize,
    services: Vec<String>,
    sent: Arc<SentAt>,
    latencies: Arc<Mutex<Vec<Duration>>>,
    ready: mpsc::Sender<usize>,
    gate: Arc<Semaphore>,
) {
    let deadline = Instant::now() + WATCHER_DEADLINE;
    let mut retries = 0;
    let (_requests, mut stream) = loop {
        let permit = gate.acquire().await.unwrap();
        let attempt = async {
            let mut client = dialer.connect(node).await.map_err(|e| format!("connect: {e:?}"))?;
            let (tx, rx) = mpsc::channel(1);
            tx.send(WatchRequest {
                services: services.clone(),
                ..Default::default()
            })
            .await
            .unwrap();
            let stream = client
                .watch(ReceiverStream::new(rx))
                .await
                .map_err(|e| format!("watch: {e:?}"))?
                .into_inner();
            Ok::<_, String>((tx, stream))
        };
        match attempt.await {
            Ok(watching) => break watching,
            Err(error) if Instant::now() < deadline => {
                drop(permit);
                retries += 1;
                if retries == 1 {
                    eprintln!("  watcher of {}: {error}; retrying", node_name(node));
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(error) => panic!("watcher of {} gave up: {error}", node_name(node)),
        }
    };
    let mut ready = Some(ready);
    while let Ok(Some(message)) = stream.message().await {
        match message.event {
            Some(watch_response::Event::SnapshotComplete(_)) => {
                if let Some(ready) = ready.take() {
                    let _ = ready.send(retries).await;
                }
            }
            Some(watch_response::Event::Delta(delta)) => {
                let now = Instant::now();
                let sent = sent.lock();
                let mut lat = latencies.lock();
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
}

// ---------------------------------------------------------------------------------------
// One run

struct Shape {
    services: usize,
    per_service: usize,
    watchers: usize,
    filter_size: usize,
}

/// What one run measured.
#[derive(Default)]
struct Figures {
    load: Duration,
    rss_after_load: f64,
    connect: Duration,
    reconnects: usize,
    rss_with_watchers: f64,
    wildcard_median: Duration,
    wildcard_min: Duration,
    fan_out: Vec<Duration>,
    fan_out_expected: usize,
    burst: usize,
    burst_took: Duration,
    burst_delivered: usize,
    burst_expected: usize,
    burst_p99: Duration,
    rss_end: f64,
    rss_peak: f64,
}

async fn run(mode: Mode, pki: &Pki, shape: &Shape) -> Figures {
    let registrar = start_registrar(mode, pki);
    let writers = connect_writers(&registrar.dialer, mode.name()).await;
    let mut run = Run {
        tag: mode.name(),
        total: shape.services * shape.per_service,
        registrar,
        writers,
        figures: Figures::default(),
    };
    run.load(shape.services).await;
    let watchers = run.connect_watchers(shape).await;
    run.wildcard_snapshots().await;
    let watched = Watched::new(&watchers.filters);
    run.fan_out_latency(&watchers, &watched).await;
    run.sustained_rate(&watchers, &watched).await;
    run.memory_and_metrics().await;
    run.finish(watchers).await
}

/// The registrar of one run, and how the bench dials it.
struct Registrar {
    process: Process,
    _dir: tempfile::TempDir,
    pid: u32,
    admin: String,
    dialer: Dialer,
}

/// Starts the release registrar in `mode` on fresh ports and a fresh data directory.
fn start_registrar(mode: Mode, pki: &Pki) -> Registrar {
    let dir = tempfile::tempdir().unwrap();
    let grpc = format!("127.0.0.1:{}", free_port());
    let admin = format!("127.0.0.1:{}", free_port());
    let mut command = Command::new(env!("CARGO_BIN_EXE_aether-registrar"));
    command
        .args(["--listen", &grpc, "--admin", &admin])
        // The bench registers once and never refreshes: endpoints must outlive the run.
        .args(["--endpoint-ttl", "1h", "--data-dir"])
        .arg(dir.path())
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null());
    let dialer = match mode {
        Mode::Plaintext => {
            command.arg("--insecure");
            Dialer::Plain {
                url: format!("http://{grpc}"),
            }
        }
        Mode::Tls => {
            let path = |p: &Path| p.display().to_string();
            command.args([
                "--tls-cert",
                &path(&pki.server_cert),
                "--tls-key",
                &path(&pki.server_key),
                "--node-ca-cert",
                &path(&pki.node_ca_cert),
                "--trust-domain",
                TRUST_DOMAIN,
            ]);
            Dialer::Tls {
                url: format!("http://{grpc}"),
                roots: pki.registrar_roots.clone(),
                nodes: Arc::new(pki.nodes.clone()),
            }
        }
    };
    let child = command.spawn().expect("spawning aether-registrar");
    Registrar {
        pid: child.id(),
        process: Process(child),
        _dir: dir,
        admin,
        dialer,
    }
}

/// The agents' connections, one per node: the first once the registrar is up.
async fn connect_writers(dialer: &Dialer, tag: &str) -> Vec<RegistrarClient<Channel>> {
    let deadline = Instant::now() + Duration::from_secs(20);
    let first = loop {
        match dialer.connect(0).await {
            Ok(c) => break c,
            Err(_) if Instant::now() < deadline => tokio::time::sleep(Duration::from_millis(50)).await,
            Err(e) => panic!("registrar ({tag}) did not come up: {e:?}"),
        }
    };
    let mut writers = vec![first];
    let rest: Vec<_> = futures::stream::iter(1..NODES)
        .map(|node| {
            let dialer = dialer.clone();
            async move { dialer.connect(node).await.expect("an agent's connection") }
        })
        .buffered(CONNECT_CONCURRENCY)
        .collect()
        .await;
    writers.extend(rest);
    writers
}

/// One run's shared state: its registrar, the agents' connections, what it measured.
struct Run {
    tag: &'static str,
    /// Endpoints in the loaded catalog.
    total: usize,
    registrar: Registrar,
    writers: Vec<RegistrarClient<Channel>>,
    figures: Figures,
}

/// The watchers of a run and what they record.
struct Watchers {
    /// The services each watcher watches, by watcher.
    filters: Vec<Vec<usize>>,
    sent: Arc<SentAt>,
    latencies: Arc<Mutex<Vec<Duration>>>,
    followers: Vec<JoinHandle<()>>,
}

/// The watched services: each once per watcher watching it (`services`), and how many
/// watchers watch it (`fan_out`).
struct Watched {
    services: Vec<usize>,
    fan_out: HashMap<usize, usize>,
}

impl Watched {
    fn new(filters: &[Vec<usize>]) -> Self {
        let mut services = Vec::new();
        for f in filters {
            services.extend_from_slice(f);
        }
        let mut fan_out: HashMap<usize, usize> = HashMap::new();
        for f in filters {
            for s in f {
                *fan_out.entry(*s).or_default() += 1;
            }
        }
        Self { services, fan_out }
    }
}

impl Run {
    /// 1. Load the catalog.
    async fn load(&mut self, services: usize) {
        let (tag, total) = (self.tag, self.total);
        let endpoints: Vec<_> = (0..total).map(|i| endpoint(i % services, i)).collect();
        self.figures.load = register_all(&self.writers, endpoints, None).await;
        self.figures.rss_after_load = rss_mib(self.registrar.pid, "VmRSS:");
        println!(
            "  [{tag}] load {total} endpoints: {:.2} s ({:.0} registrations/s)",
            self.figures.load.as_secs_f64(),
            total as f64 / self.figures.load.as_secs_f64()
        );
    }

    /// 2. Watchers, each on 50 pseudo-random services, each the agent of its own node.
    async fn connect_watchers(&mut self, shape: &Shape) -> Watchers {
        let (tag, watchers) = (self.tag, shape.watchers);
        let sent: Arc<SentAt> = Arc::default();
        let latencies: Arc<Mutex<Vec<Duration>>> = Arc::default();
        let (ready_tx, mut ready_rx) = mpsc::channel(watchers.max(1));
        let gate = Arc::new(Semaphore::new(CONNECT_CONCURRENCY));
        let started = Instant::now();
        let mut filters = Vec::new();
        let mut followers: Vec<JoinHandle<()>> = Vec::new();
        for w in 0..watchers {
            let filter: Vec<usize> = (0..shape.filter_size)
                .map(|k| (w * 7919 + k * 104_729) % shape.services)
                .collect();
            filters.push(filter.clone());
            followers.push(tokio::spawn(follow(
                self.registrar.dialer.clone(),
                w,
                filter.into_iter().map(service_key).collect(),
                sent.clone(),
                latencies.clone(),
                ready_tx.clone(),
                gate.clone(),
            )));
        }
        drop(ready_tx);
        let ready_by = Instant::now() + WATCHER_DEADLINE + Duration::from_secs(30);
        for n in 0..watchers {
            match tokio::time::timeout_at(ready_by.into(), ready_rx.recv()).await {
                Ok(Some(retries)) => self.figures.reconnects += retries,
                _ => panic!("[{tag}] only {n} of {watchers} watchers got their snapshot (see the errors above)"),
            }
        }
        self.figures.connect = started.elapsed();
        println!(
            "  [{tag}] {watchers} watchers connected + snapshots: {:.2} s ({} retried connections)",
            self.figures.connect.as_secs_f64(),
            self.figures.reconnects
        );
        tokio::time::sleep(Duration::from_secs(2)).await;
        self.figures.rss_with_watchers = rss_mib(self.registrar.pid, "VmRSS:");
        Watchers {
            filters,
            sent,
            latencies,
            followers,
        }
    }

    /// 3. A new wildcard watcher's full snapshot, three times.
    async fn wildcard_snapshots(&mut self) {
        let mut snapshot_times = Vec::new();
        for _ in 0..3 {
            let mut client = self.writers[0].clone();
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
            assert_eq!(count, self.total, "the wildcard snapshot is incomplete");
            snapshot_times.push(started.elapsed());
        }
        snapshot_times.sort();
        self.figures.wildcard_median = snapshot_times[1];
        self.figures.wildcard_min = snapshot_times[0];
    }

    /// 4. Fan-out latency: one registration at a time, on services that watchers watch.
    async fn fan_out_latency(&mut self, watchers: &Watchers, watched: &Watched) {
        let tag = self.tag;
        let mut expected = 0;
        for p in 0..PROBES {
            let service = watched.services[(p * 31) % watched.services.len()];
            expected += watched.fan_out[&service];
            let e = endpoint(service, self.total + p);
            let mut client = writer_for(&self.writers, &e).clone();
            watchers.sent.lock().insert(e.address.clone(), Instant::now());
            client
                .register_endpoint(RegisterEndpointRequest { endpoint: Some(e) })
                .await
                .unwrap();
        }
        let lat = watchers.deliveries(expected, Duration::from_secs(30)).await;
        println!(
            "  [{tag}] Register -> affected watcher ({} deliveries of {expected}): p50 {:.2} ms, p99 {:.2} ms",
            lat.len(),
            ms(percentile(&lat, 0.50)),
            ms(percentile(&lat, 0.99)),
        );
        self.figures.fan_out = lat;
        self.figures.fan_out_expected = expected;
    }

    /// 5. Sustained change rate with every watcher connected.
    async fn sustained_rate(&mut self, watchers: &Watchers, watched: &Watched) {
        let tag = self.tag;
        let burst = 20_000;
        let endpoints: Vec<_> = (0..burst)
            .map(|i| {
                endpoint(
                    watched.services[(i * 17) % watched.services.len()],
                    self.total + PROBES + i,
                )
            })
            .collect();
        let expected: usize = endpoints
            .iter()
            .map(|e| {
                let s: usize = e.service.rsplit("svc").next().unwrap().parse().unwrap();
                watched.fan_out[&s]
            })
            .sum();
        let figures = &mut self.figures;
        figures.burst = burst;
        figures.burst_took = register_all(&self.writers, endpoints, Some(&watchers.sent)).await;
        let lat = watchers.deliveries(expected, Duration::from_secs(60)).await;
        figures.burst_delivered = lat.len();
        figures.burst_expected = expected;
        figures.burst_p99 = percentile(&lat, 0.99);
        println!(
            "  [{tag}] sustained: {burst} registrations in {:.2} s; {}/{expected} deliveries, p99 {:.1} ms",
            figures.burst_took.as_secs_f64(),
            figures.burst_delivered,
            ms(figures.burst_p99),
        );
    }

    /// 6. Memory, and what the registrar counted.
    async fn memory_and_metrics(&mut self) {
        self.figures.rss_end = rss_mib(self.registrar.pid, "VmRSS:");
        self.figures.rss_peak = rss_mib(self.registrar.pid, "VmHWM:");
        let metrics = scrape_metrics(&self.registrar.admin).await;
        for line in metrics.lines().filter(|l| {
            l.starts_with("aether_registrar_watch_snapshots_total")
                || l.starts_with("aether_registrar_requests_denied_total")
        }) {
            println!("  [{}] {line}", self.tag);
        }
    }

    /// Stops the watchers, then the agents' connections, then the registrar.
    async fn finish(self, watchers: Watchers) -> Figures {
        for follower in &watchers.followers {
            follower.abort();
        }
        for follower in watchers.followers {
            let _ = follower.await;
        }
        drop(self.writers);
        drop(self.registrar.process);
        self.figures
    }
}

impl Watchers {
    /// Waits up to `patience` for `expected` deliveries; takes (and sorts) what arrived.
    async fn deliveries(&self, expected: usize, patience: Duration) -> Vec<Duration> {
        let deadline = Instant::now() + patience;
        while self.latencies.lock().len() < expected && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let mut lat = std::mem::take(&mut *self.latencies.lock());
        lat.sort();
        lat
    }
}

async fn scrape_metrics(admin: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(admin).await.unwrap();
    stream.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").await.unwrap();
    let mut body = String::new();
    stream.read_to_string(&mut body).await.unwrap();
    body
}

// ---------------------------------------------------------------------------------------
// The comparison

fn modes() -> Vec<Mode> {
    let spec = std::env::var("AETHER_BENCH_MODES").unwrap_or_else(|_| "plaintext,tls".into());
    let modes: Vec<Mode> = spec
        .split(',')
        .map(str::trim)
        .filter(|m| !m.is_empty())
        .map(|m| match m.to_ascii_lowercase().as_str() {
            "plaintext" | "plain" | "insecure" => Mode::Plaintext,
            "tls" | "mtls" => Mode::Tls,
            other => panic!("AETHER_BENCH_MODES: {other:?} is neither plaintext nor tls"),
        })
        .collect();
    assert!(!modes.is_empty(), "AETHER_BENCH_MODES names no run");
    modes
}

/// A figure of one run, as the table shows it.
type Value = Box<dyn Fn(&Figures) -> f64>;

/// The table's rows: label, figure, decimals.
fn rows(shape: &Shape) -> Vec<(String, Value, usize)> {
    let total = shape.services * shape.per_service;
    let row = |label: &str, value: Value, decimals: usize| (label.to_owned(), value, decimals);
    vec![
        row(
            &format!("load {total} endpoints (s)"),
            Box::new(|f| f.load.as_secs_f64()),
            2,
        ),
        row(
            "  registrations/s (durable, group-committed)",
            Box::new(move |f| total as f64 / f.load.as_secs_f64()),
            0,
        ),
        row(
            &format!("{} watchers connect + snapshot (s)", shape.watchers),
            Box::new(|f| f.connect.as_secs_f64()),
            2,
        ),
        row("  retried connections", Box::new(|f| f.reconnects as f64), 0),
        row(
            &format!("wildcard snapshot, {total} endpoints (ms)"),
            Box::new(|f| ms(f.wildcard_median)),
            1,
        ),
        row("  min of 3 (ms)", Box::new(|f| ms(f.wildcard_min)), 1),
        row(
            "fan-out Register -> watcher p50 (ms)",
            Box::new(|f| ms(percentile(&f.fan_out, 0.50))),
            2,
        ),
        row(
            "fan-out Register -> watcher p99 (ms)",
            Box::new(|f| ms(percentile(&f.fan_out, 0.99))),
            2,
        ),
        row(
            "fan-out Register -> watcher max (ms)",
            Box::new(|f| ms(percentile(&f.fan_out, 1.0))),
            2,
        ),
        row("  deliveries seen", Box::new(|f| f.fan_out.len() as f64), 0),
        row("  deliveries expected", Box::new(|f| f.fan_out_expected as f64), 0),
        row(
            "sustained registrations/s, watchers connected",
            Box::new(|f| f.burst as f64 / f.burst_took.as_secs_f64()),
            0,
        ),
        row("  delivery p99 under load (ms)", Box::new(|f| ms(f.burst_p99)), 1),
        row("  deliveries seen", Box::new(|f| f.burst_delivered as f64), 0),
        row("  deliveries expected", Box::new(|f| f.burst_expected as f64), 0),
        row("registrar RSS after load (MiB)", Box::new(|f| f.rss_after_load), 1),
        row(
            "registrar RSS with watchers (MiB)",
            Box::new(|f| f.rss_with_watchers),
            1,
        ),
        row("registrar RSS at the end (MiB)", Box::new(|f| f.rss_end), 1),
        row("registrar RSS peak (MiB)", Box::new(|f| f.rss_peak), 1),
    ]
}

fn print_table(runs: &[(Mode, Figures)], shape: &Shape) {
    let figures_of = |mode| runs.iter().find(|(m, _)| *m == mode).map(|(_, f)| f);
    // (plaintext, mTLS), when both ran: the table then has a ratio column.
    let both = figures_of(Mode::Plaintext).zip(figures_of(Mode::Tls));
    let mut header = format!("  {:<46}", "");
    for (mode, _) in runs {
        header.push_str(&format!(" {:>12}", mode.name()));
    }
    if both.is_some() {
        header.push_str(&format!(" {:>12}", "mTLS/plain"));
    }
    println!("{header}");
    for (label, value, decimals) in rows(shape) {
        let mut line = format!("  {label:<46}");
        for (_, f) in runs {
            line.push_str(&format!(" {:>12.*}", decimals, value(f)));
        }
        if let Some((p, t)) = both {
            let (p, t) = (value(p), value(t));
            if p > 0.0 {
                line.push_str(&format!(" {:>11.2}x", t / p));
            }
        }
        println!("{line}");
    }
    if let Some((p, t)) = both {
        print_goal(p, t);
    }
}

/// The fan-out p99 of mTLS against plaintext, and whether it is within the goal's 10 %.
fn print_goal(plain: &Figures, secure: &Figures) {
    let (p99_plain, p99_tls) = (percentile(&plain.fan_out, 0.99), percentile(&secure.fan_out, 0.99));
    let ratio = p99_tls.as_secs_f64() / p99_plain.as_secs_f64();
    println!(
        "  fan-out p99 mTLS/plaintext: {:.2} ms / {:.2} ms = {ratio:.3} ({:+.1} %): goal (within 10 %) {}",
        ms(p99_tls),
        ms(p99_plain),
        (ratio - 1.0) * 100.0,
        if ratio <= 1.10 { "MET" } else { "NOT MET" }
    );
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let shape = Shape {
        services: knob("AETHER_BENCH_SERVICES", 10_000),
        per_service: knob("AETHER_BENCH_ENDPOINTS_PER_SERVICE", 10),
        watchers: knob("AETHER_BENCH_WATCHERS", 1_000),
        filter_size: knob("AETHER_BENCH_FILTER", 50),
    };
    let modes = modes();
    println!(
        "registrar bench: {} services x {} endpoints on {NODES} nodes, {} watchers x {} services; runs: {}",
        shape.services,
        shape.per_service,
        shape.watchers,
        shape.filter_size,
        modes.iter().map(|m| m.name()).collect::<Vec<_>>().join(", ")
    );

    // Certificates once per run: the registrar's, and one per agent (node-0 .. node-N).
    let started = Instant::now();
    let pki = Pki::new(NODES.max(shape.watchers));
    println!(
        "  certificates: {} node certificates + the registrar's in {:.2} s",
        pki.nodes.len(),
        started.elapsed().as_secs_f64()
    );

    let mut runs = Vec::new();
    for mode in modes {
        let figures = run(mode, &pki, &shape).await;
        runs.push((mode, figures));
    }
    println!();
    print_table(&runs, &shape);
}
