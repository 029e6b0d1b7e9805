//! Redis and Thrift through the mesh, parsed at the destination (proposal 017), against
//! the same server reached directly (`cargo bench -p aether-tests --bench protocols`, as
//! root, after `cargo build --workspace --bins --release`): a real registrar,
//! `aether-agent run` with the built-in CA (mTLS, the production default) and Envoy 1.40,
//! pods in network namespaces.
//!
//! 1. Redis: `redis-benchmark` in a client pod, GET and SET, fixed connections and pipeline
//!    1, against (a) a `redis-server` in a pod that opts in to L7 (`protocol.aether.io/l7:
//!    redis`), through its VIP, (b) the same in a pod that does not (a TCP stream, mTLS),
//!    and (c) a second `redis-server` in the first pod on its own address, no mesh.
//!    Requests/s and p99, and the ratios to direct.
//! 2. Thrift: a framed binary `add(2, 3)` call (client and server written here from the
//!    protocol, so the server is never the bottleneck), fixed connections each calling in
//!    a loop, through the mesh (parsed by `thrift_proxy`) and direct: calls/s, p50, p99.
//!
//! Knobs (env): AETHER_BENCH_DURATION (10 s per Thrift run), AETHER_BENCH_CONNECTIONS (8),
//! AETHER_BENCH_REDIS_REQUESTS (100000 per redis-benchmark test).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use aether_api::pod::INBOUND_MTLS_ANNOTATION;
use aether_tests::bench::{knob, percentile};
use aether_tests::mesh::Mesh;
use aether_tests::{ChildGuard, TestPod};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const REDIS_PORT: u16 = 6379;
const REDIS_DIRECT_PORT: u16 = 7379;
const THRIFT_PORT: u16 = 9090;
const THRIFT_DIRECT_PORT: u16 = 9190;

/// Thrift's binary protocol, strict: version 1 and the message type.
const CALL: u32 = 0x8001_0001;
const REPLY: u32 = 0x8001_0002;

/// A framed `add(2, 3)` call with sequence id `seq`.
fn call_frame(seq: i32) -> Vec<u8> {
    let mut body = Vec::with_capacity(40);
    body.extend(CALL.to_be_bytes());
    body.extend(3i32.to_be_bytes());
    body.extend(b"add");
    body.extend(seq.to_be_bytes());
    // Arguments: field 1 (i32) = 2, field 2 (i32) = 3, stop.
    body.extend([8, 0, 1]);
    body.extend(2i32.to_be_bytes());
    body.extend([8, 0, 2]);
    body.extend(3i32.to_be_bytes());
    body.push(0);
    framed(body)
}

/// The framed reply to `add` with sequence id `seq`: the result struct's field 0 = 5.
fn reply_frame(seq: i32) -> Vec<u8> {
    let mut body = Vec::with_capacity(32);
    body.extend(REPLY.to_be_bytes());
    body.extend(3i32.to_be_bytes());
    body.extend(b"add");
    body.extend(seq.to_be_bytes());
    body.extend([8, 0, 0]);
    body.extend(5i32.to_be_bytes());
    body.push(0);
    framed(body)
}

fn framed(body: Vec<u8>) -> Vec<u8> {
    let mut frame = (body.len() as u32).to_be_bytes().to_vec();
    frame.extend(body);
    frame
}

/// Reads one frame; returns its body.
async fn read_frame(stream: &mut TcpStream) -> std::io::Result<Vec<u8>> {
    let mut length = [0u8; 4];
    stream.read_exact(&mut length).await?;
    let mut body = vec![0u8; u32::from_be_bytes(length) as usize];
    stream.read_exact(&mut body).await?;
    Ok(body)
}

/// The sequence id of a message body (after the version word and the method name).
fn sequence_id(body: &[u8]) -> Option<i32> {
    let name_len = i32::from_be_bytes(body.get(4..8)?.try_into().ok()?) as usize;
    let at = 8 + name_len;
    Some(i32::from_be_bytes(body.get(at..at + 4)?.try_into().ok()?))
}

/// Answers every framed call on `addr` inside `pod` with the reply to `add`.
fn serve_thrift(pod: &TestPod, addr: SocketAddr) -> tokio::task::JoinHandle<()> {
    let listener = pod
        .run(move || std::net::TcpListener::bind(addr))
        .unwrap_or_else(|e| panic!("bind {addr} in {}: {e}", pod.name()));
    listener.set_nonblocking(true).unwrap();
    let listener = TcpListener::from_std(listener).unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((mut stream, _)) = listener.accept().await else {
                continue;
            };
            stream.set_nodelay(true).ok();
            tokio::spawn(async move {
                while let Ok(body) = read_frame(&mut stream).await {
                    let Some(seq) = sequence_id(&body) else { return };
                    if stream.write_all(&reply_frame(seq)).await.is_err() {
                        return;
                    }
                }
            });
        }
    })
}

struct Run {
    calls: usize,
    seconds: f64,
    p50: Duration,
    p99: Duration,
}

/// `connections` connections from `client` to `target`, each calling in a loop for
/// `duration`; every reply's sequence id is checked.
async fn thrift_load(client: &TestPod, target: SocketAddr, connections: usize, duration: Duration) -> Run {
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for _ in 0..connections {
        let socket = client
            .run(tokio::net::TcpSocket::new_v4)
            .expect("socket in the client pod");
        let mut stream = socket.connect(target).await.unwrap_or_else(|e| panic!("{target}: {e}"));
        stream.set_nodelay(true).ok();
        let stop = Arc::clone(&stop);
        tasks.push(tokio::spawn(async move {
            let mut times = Vec::new();
            let mut seq = 0i32;
            while !stop.load(Ordering::Relaxed) {
                seq = seq.wrapping_add(1);
                let started = Instant::now();
                stream.write_all(&call_frame(seq)).await.expect("call");
                let body = read_frame(&mut stream).await.expect("reply");
                assert_eq!(sequence_id(&body), Some(seq), "a reply to another call");
                assert_eq!(&body[..4], &REPLY.to_be_bytes(), "not a reply: {body:?}");
                times.push(started.elapsed());
            }
            times
        }));
    }
    let started = Instant::now();
    tokio::time::sleep(duration).await;
    stop.store(true, Ordering::Relaxed);
    let mut times = Vec::new();
    for task in tasks {
        times.extend(task.await.expect("a caller panicked"));
    }
    let seconds = started.elapsed().as_secs_f64();
    times.sort();
    Run {
        calls: times.len(),
        seconds,
        p50: percentile(&times, 0.50),
        p99: percentile(&times, 0.99),
    }
}

/// `redis-benchmark` from `client`: (test, requests/s, p99 ms) for GET and SET.
fn redis_benchmark(
    client: &TestPod,
    host: &str,
    port: u16,
    connections: usize,
    requests: usize,
) -> Vec<(String, f64, f64)> {
    let ping = client.exec(&["timeout", "5", "redis-cli", "-h", host, "-p", &port.to_string(), "PING"]);
    let pong = String::from_utf8_lossy(&ping.stdout);
    assert_eq!(pong.trim(), "PONG", "{host}:{port} {ping:?}");
    let out = client.exec_ok(&[
        "timeout",
        "300",
        "redis-benchmark",
        "-h",
        host,
        "-p",
        &port.to_string(),
        "-c",
        &connections.to_string(),
        "-n",
        &requests.to_string(),
        "-t",
        "get,set",
        "--csv",
    ]);
    // "test","rps","avg_latency_ms","min_latency_ms","p50_latency_ms","p95_latency_ms","p99_latency_ms","max_latency_ms"
    out.lines()
        .skip(1)
        .filter_map(|line| {
            let fields: Vec<&str> = line.split(',').map(|f| f.trim_matches('"')).collect();
            Some((
                fields.first()?.to_string(),
                fields.get(1)?.parse().ok()?,
                fields.get(6)?.parse().ok()?,
            ))
        })
        .collect()
}

fn redis_server(pod: &TestPod, name: &str, bind: &str, port: u16) -> ChildGuard {
    let mut command = pod.command("redis-server");
    command.args([
        "--port",
        &port.to_string(),
        "--bind",
        bind,
        "--save",
        "",
        "--protected-mode",
        "no",
    ]);
    let server = ChildGuard::spawn(name, command);
    let addr: SocketAddr = format!("{bind}:{port}").parse().unwrap();
    let deadline = Instant::now() + Duration::from_secs(15);
    while pod
        .run(move || std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(200)))
        .is_err()
    {
        assert!(Instant::now() < deadline, "{name} never listened on {addr}");
        std::thread::sleep(Duration::from_millis(100));
    }
    server
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    if std::env::args().any(|a| a == "--list") {
        return; // `cargo test --benches` probes harness=false benches with --list.
    }
    aether_tests::require_root();
    let seconds = knob("AETHER_BENCH_DURATION", 10) as u64;
    let connections = knob("AETHER_BENCH_CONNECTIONS", 8);
    let requests = knob("AETHER_BENCH_REDIS_REQUESTS", 100_000);
    let mesh = Mesh::start().await;

    // Servers: Redis parsed (with a direct twin), Redis as a stream, Thrift parsed.
    let cache = mesh.node.add_pod("cache");
    let _cache = redis_server(&cache, "redis-l7", "127.0.0.1", REDIS_PORT);
    let _direct = redis_server(&cache, "redis-direct", &cache.ip().to_string(), REDIS_DIRECT_PORT);
    mesh.describe_pod_annotated(
        &cache,
        "cache",
        "cache",
        &[("redis", REDIS_PORT)],
        // Permissive: the direct twin takes plaintext from the client pod (mesh callers
        // still arrive over mTLS).
        &[
            ("protocol.aether.io/l7", "redis"),
            (INBOUND_MTLS_ANNOTATION, "permissive"),
        ],
    );
    mesh.add_pod_ok(&cache, "cache").await;
    let stream = mesh.node.add_pod("stream-cache");
    let _stream = redis_server(&stream, "redis-tcp", "127.0.0.1", REDIS_PORT);
    mesh.describe_pod(&stream, "stream-cache", "stream-cache", "", &[("redis", REDIS_PORT)]);
    mesh.add_pod_ok(&stream, "stream-cache").await;
    let calc = mesh.node.add_pod("calc");
    let _thrift = serve_thrift(&calc, SocketAddr::from(([127, 0, 0, 1], THRIFT_PORT)));
    let _thrift_direct = serve_thrift(&calc, SocketAddr::new(calc.ip().into(), THRIFT_DIRECT_PORT));
    mesh.describe_pod_annotated(
        &calc,
        "calc",
        "calc",
        &[("thrift", THRIFT_PORT)],
        &[(INBOUND_MTLS_ANNOTATION, "permissive")],
    );
    mesh.add_pod_ok(&calc, "calc").await;
    let client = mesh.node.add_pod("client");
    mesh.describe_pod(&client, "client", "client", "cache, stream-cache, calc", &[]);
    mesh.add_pod_ok(&client, "client").await;

    println!("Redis: redis-benchmark -c {connections} -n {requests}, pipeline 1 (mTLS on)");
    let cache_vip = mesh.vip("cache").await;
    let stream_vip = mesh.vip("stream-cache").await;
    let direct_ip = cache.ip().to_string();
    let runs = [
        ("direct (pod -> pod, no mesh)", direct_ip.as_str(), REDIS_DIRECT_PORT),
        ("mesh, Redis as TCP stream", stream_vip.as_str(), REDIS_PORT),
        ("mesh, Redis parsed (L7)", cache_vip.as_str(), REDIS_PORT),
    ];
    let mut results = Vec::new();
    for (label, host, port) in runs {
        let figures = redis_benchmark(&client, host, port, connections, requests);
        assert_eq!(figures.len(), 2, "{label}: redis-benchmark printed {figures:?}");
        for (test, rps, p99) in &figures {
            println!("  {label:<30} {test:<4} {rps:>10.0} req/s  p99 {p99:.3} ms");
        }
        results.push(figures);
    }
    for test in ["SET", "GET"] {
        let of = |run: usize| results[run].iter().find(|f| f.0 == test).map(|f| (f.1, f.2));
        if let (Some(direct), Some(tcp), Some(l7)) = (of(0), of(1), of(2)) {
            println!(
                "  {test}: L7 / direct: {:.2}x req/s, {:.2}x p99; TCP stream / direct: {:.2}x req/s, {:.2}x p99",
                l7.0 / direct.0,
                l7.1 / direct.1,
                tcp.0 / direct.0,
                tcp.1 / direct.1
            );
        }
    }
    let counted = mesh
        .envoy()
        .admin_get("/stats?filter=^redis\\.l7\\..*command\\.(get|set)\\.total$");
    println!("  Envoy counted: {}", counted.trim().replace('\n', "; "));

    println!("Thrift: framed binary add(2, 3), {connections} connections, {seconds} s per run (mTLS on)");
    let calc_vip = mesh.vip("calc").await;
    let targets = [
        (
            "direct (pod -> pod, no mesh)",
            SocketAddr::new(calc.ip().into(), THRIFT_DIRECT_PORT),
        ),
        (
            "mesh, Thrift parsed (L7)",
            format!("{calc_vip}:{THRIFT_PORT}").parse().unwrap(),
        ),
    ];
    let mut rates = Vec::new();
    for (label, target) in targets {
        let run = thrift_load(&client, target, connections, Duration::from_secs(seconds)).await;
        let rate = run.calls as f64 / run.seconds;
        println!(
            "  {label:<30} {rate:>10.0} calls/s  p50 {:.3} ms  p99 {:.3} ms",
            run.p50.as_secs_f64() * 1e3,
            run.p99.as_secs_f64() * 1e3
        );
        rates.push((rate, run.p99));
    }
    println!(
        "  mesh / direct: {:.2}x calls/s, {:.2}x p99",
        rates[1].0 / rates[0].0,
        rates[1].1.as_secs_f64() / rates[0].1.as_secs_f64()
    );
    let counted = mesh.envoy().admin_get("/stats?filter=^thrift\\.l7\\..*request_call$");
    println!("  Envoy counted: {}", counted.trim().replace('\n', "; "));
}
