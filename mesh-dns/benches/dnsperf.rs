//! mesh-dns against unbound (`make bench`): the same 10,000 names, mesh-dns from its
//! record file, unbound from `local-data`, both on loopback with the same number of
//! threads, loaded by `dnsperf` with the same client settings.
//!
//! - throughput: `dnsperf -c CLIENTS -q OUTSTANDING -l 10` → QPS (dnsperf's own figure),
//!   alternating the two servers for ROUNDS rounds and keeping each one's best (the
//!   machine is shared; alternating spreads its noise over both);
//! - latency: a 10 s run at a fixed rate (`-Q`, default 20,000 QPS — CoreDNS's per-core
//!   figure) with `-v`, which prints every query's latency; p50/p99 are nearest-rank
//!   percentiles of those (dnsperf itself prints only average and standard deviation).
//!   At saturation latency is just queueing (Little's law: outstanding / QPS), so the
//!   latency goal is measured below it. Also alternated for ROUNDS rounds; each server
//!   keeps its run with the lowest p99.
//!
//! Then mesh-dns's RSS (VmRSS and peak VmHWM from /proc/PID/status) with the 10,000 records loaded.
//!
//! Knobs (env): AETHER_BENCH_DNS_RECORDS (10000), AETHER_BENCH_DNS_SECONDS (10),
//! AETHER_BENCH_DNS_THREADS (server threads, 2), AETHER_BENCH_DNS_CLIENTS (dnsperf -c, 4),
//! AETHER_BENCH_DNS_OUTSTANDING (dnsperf -q, 100), AETHER_BENCH_DNS_ROUNDS (2),
//! AETHER_BENCH_DNS_LATENCY_QPS (20000).

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{Ipv4Addr, TcpListener, UdpSocket};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime};

use aether_mesh_dns::records::{Addresses, RecordFile};

const MESH_DNS: &str = env!("CARGO_BIN_EXE_aether-mesh-dns");

fn knob(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn free_port() -> u16 {
    loop {
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        if UdpSocket::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
}

struct Process(Child);
impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn need(bin: &str) -> String {
    for dir in ["/usr/sbin", "/usr/bin", "/sbin", "/bin"] {
        let p = Path::new(dir).join(bin);
        if p.exists() {
            return p.display().to_string();
        }
    }
    panic!("{bin} is not installed (scripts/setup.sh installs it); the benchmark needs it");
}

fn name(i: usize) -> (String, String) {
    (format!("ns-{}", i % 100), format!("svc-{i}"))
}

fn vip(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(240, 240, (i >> 8) as u8, (i & 0xff) as u8)
}

/// Waits until `port` answers `probe` over UDP.
fn wait_answering(port: u16, probe: &str, child: &mut Child) {
    let deadline = Instant::now() + Duration::from_secs(30);
    let socket = UdpSocket::bind("127.0.0.1:0").unwrap();
    socket.set_read_timeout(Some(Duration::from_millis(200))).unwrap();
    let mut q = vec![0x12, 0x34, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0];
    for l in probe.trim_end_matches('.').split('.') {
        q.push(l.len() as u8);
        q.extend_from_slice(l.as_bytes());
    }
    q.extend_from_slice(&[0, 0, 1, 0, 1]);
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            panic!("the server exited ({status}) before answering");
        }
        let _ = socket.send_to(&q, ("127.0.0.1", port));
        let mut buf = [0u8; 512];
        if let Ok((n, _)) = socket.recv_from(&mut buf)
            && n > 12
            && buf[3] & 0x0f == 0
            && buf[7] == 1
        {
            return;
        }
        assert!(Instant::now() < deadline, "no answer from port {port}");
    }
}

struct Figures {
    qps: f64,
    lost: f64,
    p50_us: f64,
    p99_us: f64,
    avg_us: f64,
}

struct Dnsperf<'a> {
    queries: &'a Path,
    seconds: usize,
    clients: usize,
    outstanding: usize,
}

impl Dnsperf<'_> {
    fn command(&self, port: u16) -> Command {
        let mut cmd = Command::new(need("dnsperf"));
        cmd.args(["-s", "127.0.0.1", "-p", &port.to_string(), "-d"])
            .arg(self.queries)
            .args([
                "-l",
                &self.seconds.to_string(),
                "-c",
                &self.clients.to_string(),
                "-T",
                "1",
            ])
            .args(["-q", &self.outstanding.to_string(), "-t", "2"])
            .stdout(Stdio::piped())
            .stderr(Stdio::null());
        cmd
    }

    /// Saturating run: (QPS, fraction lost).
    fn throughput(&self, port: u16) -> (f64, f64) {
        let out = self.command(port).output().expect("run dnsperf");
        let text = String::from_utf8_lossy(&out.stdout);
        let field = |label: &str| -> f64 {
            text.lines()
                .find_map(|l| l.trim().strip_prefix(label))
                .and_then(|rest| rest.split_whitespace().next())
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("dnsperf printed no {label:?}:\n{text}"))
        };
        let codes = text
            .lines()
            .find(|l| l.trim().starts_with("Response codes:"))
            .unwrap_or("")
            .to_owned();
        assert!(
            codes.contains("NOERROR") && !codes.contains("SERVFAIL") && !codes.contains("NXDOMAIN"),
            "not every answer was NOERROR: {codes}"
        );
        let sent = field("Queries sent:");
        let lost = field("Queries lost:");
        (field("Queries per second:"), if sent > 0.0 { lost / sent } else { 0.0 })
    }

    /// Fixed-rate run with `-v` (every query's latency): (p50, p99, avg) in µs.
    fn latency(&self, port: u16, rate: usize) -> (f64, f64, f64) {
        let mut cmd = self.command(port);
        cmd.args(["-v", "-Q", &rate.to_string()]);
        let mut child = cmd.spawn().expect("run dnsperf -v");
        let stdout = child.stdout.take().unwrap();
        let mut latencies: Vec<f64> = Vec::with_capacity(1 << 20);
        for line in BufReader::new(stdout).lines() {
            let line = line.unwrap();
            if let Some(rest) = line.strip_prefix("> ")
                && let Some(last) = rest.split_whitespace().last()
                && let Ok(seconds) = last.parse::<f64>()
            {
                latencies.push(seconds * 1e6);
            }
        }
        let _ = child.wait();
        assert!(!latencies.is_empty(), "dnsperf -v printed no latencies");
        latencies.sort_by(|a, b| a.partial_cmp(b).unwrap());
        let rank = |p: f64| latencies[((p * latencies.len() as f64).ceil() as usize).clamp(1, latencies.len()) - 1];
        let avg = latencies.iter().sum::<f64>() / latencies.len() as f64;
        (rank(0.50), rank(0.99), avg)
    }
}

/// The packet handler alone, in process: ns per query for `packets` (hits, fast path)
/// and for the same names asked as MX (NODATA, the general hickory-proto path).
fn handler_cost(file: &RecordFile, packets: &[Vec<u8>]) -> (f64, f64) {
    use aether_mesh_dns::handler::{Handler, Outcome};
    use aether_mesh_dns::table::{CurrentTable, Table};
    let store = std::sync::Arc::new(CurrentTable::default());
    store.replace(Table::new(file));
    let handler = Handler::new(store, "aether.internal", "cluster.local", &[]).unwrap();
    let time = |packets: &[Vec<u8>]| {
        let rounds = 20;
        let start = Instant::now();
        let mut bytes = 0usize;
        for _ in 0..rounds {
            for p in packets {
                if let Outcome::Reply(answer, _) = handler.handle(std::hint::black_box(p)) {
                    bytes += answer.len();
                }
            }
        }
        assert!(bytes > 0);
        start.elapsed().as_nanos() as f64 / (rounds * packets.len()) as f64
    };
    let mx: Vec<Vec<u8>> = packets
        .iter()
        .map(|p| {
            let mut p = p.clone();
            let n = p.len();
            p[n - 3] = 15;
            p
        })
        .collect();
    (time(packets), time(&mx))
}

fn status_kib(pid: u32, key: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// The bench's knobs (see the module doc).
struct Knobs {
    records: usize,
    seconds: usize,
    threads: usize,
    clients: usize,
    outstanding: usize,
    rounds: usize,
    rate: usize,
}

impl Knobs {
    fn from_env() -> Knobs {
        Knobs {
            records: knob("AETHER_BENCH_DNS_RECORDS", 10_000),
            seconds: knob("AETHER_BENCH_DNS_SECONDS", 10),
            threads: knob("AETHER_BENCH_DNS_THREADS", 2),
            clients: knob("AETHER_BENCH_DNS_CLIENTS", 4),
            outstanding: knob("AETHER_BENCH_DNS_OUTSTANDING", 100),
            rounds: knob("AETHER_BENCH_DNS_ROUNDS", 2).max(1),
            rate: knob("AETHER_BENCH_DNS_LATENCY_QPS", 20_000),
        }
    }
}

/// The same names for both servers: mesh-dns's record file, unbound's `local-data` lines, a dnsperf query file of
/// every name (type A) and the same queries as packets for the in-process handler.
struct Names {
    file: RecordFile,
    local_data: String,
    query_file: std::path::PathBuf,
    records_path: std::path::PathBuf,
    packets: Vec<Vec<u8>>,
    /// A name both answer, to know they are up.
    probe: String,
}

impl Names {
    fn write(records: usize, dir: &Path) -> Names {
        let mut file = RecordFile {
            generation: 1,
            written_at: SystemTime::now(),
            records: BTreeMap::new(),
            aliases: Vec::new(),
            hosts: BTreeMap::new(),
        };
        let mut queries = String::new();
        let mut local_data = String::new();
        for i in 0..records {
            let (ns, svc) = name(i);
            let addresses = Addresses {
                v4: Some(vip(i)),
                v6: None,
            };
            file.records.insert((ns.clone(), svc.clone()), addresses);
            queries.push_str(&format!("{svc}.{ns}.aether.internal A\n"));
            local_data.push_str(&format!(
                "  local-data: \"{svc}.{ns}.aether.internal. 30 IN A {}\"\n",
                vip(i)
            ));
        }
        let query_file = dir.join("queries.txt");
        std::fs::write(&query_file, queries).unwrap();
        let records_path = dir.join("mesh-dns").join("records");
        std::fs::create_dir_all(records_path.parent().unwrap()).unwrap();
        std::fs::write(&records_path, file.to_json()).unwrap();
        let (probe_ns, probe_svc) = name(0);
        Names {
            file,
            local_data,
            query_file,
            records_path,
            packets: (0..records).map(query_packet).collect(),
            probe: format!("{probe_svc}.{probe_ns}.aether.internal"),
        }
    }
}

/// A DNS query (id 0x1234, RD) for name `i`, type A.
fn query_packet(i: usize) -> Vec<u8> {
    let (ns, svc) = name(i);
    let mut p = vec![0x12, 0x34, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0];
    for l in [svc.as_str(), ns.as_str(), "aether", "internal"] {
        p.push(l.len() as u8);
        p.extend_from_slice(l.as_bytes());
    }
    p.extend_from_slice(&[0, 0, 1, 0, 1]);
    p
}

/// A running server and the loopback port it answers on.
struct Server {
    process: Process,
    port: u16,
}

/// unbound, the reference: the same names as local data, never recursing.
fn start_unbound(k: &Knobs, names: &Names, dir: &Path) -> Server {
    let port = free_port();
    let unbound_conf = dir.join("unbound.conf");
    let mut conf = std::fs::File::create(&unbound_conf).unwrap();
    write!(
        conf,
        "server:\n  interface: 127.0.0.1@{port}\n  port: {port}\n  do-daemonize: no\n  use-syslog: no\n  \
         logfile: \"\"\n  username: \"\"\n  chroot: \"\"\n  directory: \"{d}\"\n  pidfile: \"{d}/unbound.pid\"\n  \
         access-control: 127.0.0.0/8 allow\n  do-ip6: no\n  verbosity: 0\n  module-config: \"iterator\"\n  \
         auto-trust-anchor-file: \"\"\n  num-threads: {threads}\n  so-reuseport: yes\n  \
         local-zone: \"aether.internal.\" static\n{local_data}remote-control:\n  control-enable: no\n",
        d = dir.display(),
        threads = k.threads,
        local_data = names.local_data,
    )
    .unwrap();
    drop(conf);
    let mut unbound = Command::new(need("unbound"));
    unbound
        .arg("-d")
        .arg("-c")
        .arg(&unbound_conf)
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let mut process = Process(unbound.spawn().expect("start unbound"));
    wait_answering(port, &names.probe, &mut process.0);
    Server { process, port }
}

fn start_mesh_dns(k: &Knobs, names: &Names) -> Server {
    let port = free_port();
    let admin = free_port();
    let mut mesh = Command::new(MESH_DNS);
    mesh.args([
        "--listen",
        &format!("127.0.0.1:{port}"),
        "--admin",
        &format!("127.0.0.1:{admin}"),
    ])
    .arg("--records")
    .arg(&names.records_path)
    .args(["--upstream", "127.0.0.1:9", "--workers", &k.threads.to_string()])
    .env("RUST_LOG", "warn")
    .stdout(Stdio::null())
    .stderr(Stdio::null());
    let mut process = Process(mesh.spawn().expect("start mesh-dns"));
    wait_answering(port, &names.probe, &mut process.0);
    Server { process, port }
}

/// Alternates the two so machine noise hits both alike: each one's best throughput run and its run with the
/// lowest p99 at the fixed rate, as (mesh-dns, unbound).
fn measure_both(k: &Knobs, names: &Names, ours: &Server, reference: &Server) -> (Figures, Figures) {
    let perf = Dnsperf {
        queries: &names.query_file,
        seconds: k.seconds,
        clients: k.clients,
        outstanding: k.outstanding,
    };
    let (mut ours_qps, mut reference_qps) = ((0.0f64, 0.0f64), (0.0f64, 0.0f64));
    for _ in 0..k.rounds {
        let r = perf.throughput(reference.port);
        if r.0 > reference_qps.0 {
            reference_qps = r;
        }
        let o = perf.throughput(ours.port);
        if o.0 > ours_qps.0 {
            ours_qps = o;
        }
    }
    let better = |a: (f64, f64, f64), b: (f64, f64, f64)| if b.1 < a.1 { b } else { a };
    let inf = (f64::INFINITY, f64::INFINITY, f64::INFINITY);
    let (mut reference_latency, mut ours_latency) = (inf, inf);
    for _ in 0..k.rounds {
        reference_latency = better(reference_latency, perf.latency(reference.port, k.rate));
        ours_latency = better(ours_latency, perf.latency(ours.port, k.rate));
    }
    (
        Figures::new(ours_qps, ours_latency),
        Figures::new(reference_qps, reference_latency),
    )
}

impl Figures {
    fn new((qps, lost): (f64, f64), (p50_us, p99_us, avg_us): (f64, f64, f64)) -> Figures {
        Figures {
            qps,
            lost,
            p50_us,
            p99_us,
            avg_us,
        }
    }

    fn print_row(&self, who: &str) {
        println!(
            "  {who:<9} QPS {:>9.0} (lost {:.3}%)  latency p50 {:>5.0} µs  p99 {:>5.0} µs  avg {:>5.0} µs",
            self.qps,
            self.lost * 100.0,
            self.p50_us,
            self.p99_us,
            self.avg_us,
        )
    }
}

/// Resident memory in KiB: mesh-dns once loaded, after the runs and at its peak, and unbound after the runs.
struct Memory {
    loaded: u64,
    after: u64,
    peak: u64,
    unbound: u64,
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let k = Knobs::from_env();
    let dir = tempfile::Builder::new().prefix("mesh-dns-bench-").tempdir().unwrap();
    let names = Names::write(k.records, dir.path());
    println!(
        "mesh-dns vs unbound: {} records, {} server threads, dnsperf -c {} -q {} -l {} \
         (UDP, loopback); QPS = best of {} alternating saturating runs; latency at a fixed {} QPS with -v \
         (best p99 of {} alternating runs)",
        k.records, k.threads, k.clients, k.outstanding, k.seconds, k.rounds, k.rate, k.rounds
    );
    let unbound = start_unbound(&k, &names, dir.path());
    let mesh = start_mesh_dns(&k, &names);
    let pid = mesh.process.0.id();
    let loaded = status_kib(pid, "VmRSS:");
    let (ours, reference) = measure_both(&k, &names, &mesh, &unbound);
    let memory = Memory {
        loaded,
        unbound: status_kib(unbound.process.0.id(), "VmRSS:"),
        after: status_kib(pid, "VmRSS:"),
        peak: status_kib(pid, "VmHWM:"),
    };
    drop(mesh);
    drop(unbound);
    print_results(&k, &names, &ours, &reference, &memory);
}

fn print_results(k: &Knobs, names: &Names, ours: &Figures, reference: &Figures, memory: &Memory) {
    ours.print_row("mesh-dns");
    reference.print_row("unbound");
    println!(
        "  ratio mesh-dns/unbound: QPS {:.2}x, p50 {:.2}x, p99 {:.2}x (goal: QPS >= 1.00x, p99 < 1000 µs)",
        ours.qps / reference.qps,
        ours.p50_us / reference.p50_us,
        ours.p99_us / reference.p99_us
    );
    let (hit_ns, nodata_ns) = handler_cost(&names.file, &names.packets);
    println!(
        "  mesh-dns handler alone (in process): {hit_ns:.0} ns per A hit (fast path), {nodata_ns:.0} ns per NODATA (hickory-proto path)"
    );
    println!(
        "  mesh-dns RSS with {} records: {:.1} MiB loaded idle, {:.1} MiB after the runs, peak {:.1} MiB \
         (goal < 20 MB); unbound {:.1} MiB",
        k.records,
        memory.loaded as f64 / 1024.0,
        memory.after as f64 / 1024.0,
        memory.peak as f64 / 1024.0,
        memory.unbound as f64 / 1024.0
    );
}
