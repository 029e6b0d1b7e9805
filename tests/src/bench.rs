//! What the benchmarks share: knobs from the environment, and a synthetic catalog of services
//! `bench/svc-NNNN` (one HTTP port, fake addresses never put on the wire) registered straight at the registrar.

use std::sync::Arc;
use std::time::{Duration, Instant};

use aether_proto::registrar::v1::RegisterEndpointRequest;
use aether_proto::registrar::v1::registrar_client::RegistrarClient;
use aether_proto::registry::v1::{Endpoint, Health, Locality, PodInfo, Port, Protocol};

use tonic::transport::Channel;

use crate::mesh::MESH_DOMAIN;

/// The catalog's namespace.
pub const NAMESPACE: &str = "bench";
/// Every catalog service's one (HTTP) port.
pub const PORT: u32 = 8080;

/// A count from the environment, `default` when unset; panics on anything else.
pub fn knob(name: &str, default: usize) -> usize {
    match std::env::var(name) {
        Ok(v) => v
            .trim()
            .parse()
            .unwrap_or_else(|e| panic!("{name}={v:?} is not a count ({e})")),
        Err(_) => default,
    }
}

pub fn service_name(s: usize) -> String {
    format!("svc-{s:04}")
}

pub fn service_key(s: usize) -> String {
    format!("{NAMESPACE}/{}", service_name(s))
}

/// The Envoy cluster of the service's port (named by its authority).
pub fn cluster_name(s: usize) -> String {
    format!("{}.{NAMESPACE}.{MESH_DOMAIN}:{PORT}", service_name(s))
}

/// Fake pod addresses 10.64.0.1 and up (never put on the wire).
pub fn catalog_address(n: usize) -> String {
    let n = n + 1;
    format!("10.{}.{}.{}", 64 + (n >> 16), (n >> 8) & 0xff, n & 0xff)
}

/// Endpoint `ordinal` of service `service`, in one of three zones of region r1.
pub fn endpoint(service: usize, address: String, ordinal: usize) -> Endpoint {
    Endpoint {
        service: service_key(service),
        address,
        ports: vec![Port {
            name: "http".into(),
            port: PORT,
            protocol: Protocol::Http as i32,
        }],
        locality: Some(Locality {
            region: "r1".into(),
            zone: format!("z{}", 1 + ordinal % 3),
            subzone: String::new(),
        }),
        weight: 1,
        health: Health::Healthy as i32,
        metadata: Default::default(),
        pod: Some(PodInfo {
            namespace: NAMESPACE.into(),
            name: format!("{}-{ordinal}", service_name(service)),
            uid: format!("00000000-0000-0000-0000-{ordinal:012}"),
            service_account: service_name(service),
        }),
        node: format!("node-{}", ordinal % 500),
    }
}

/// Registrar clients acting as the agents of stand-in nodes, one connection per node (as
/// each node's agent has), made on first use.
#[derive(Default)]
pub struct StandInAgents {
    clients: std::collections::BTreeMap<String, RegistrarClient<Channel>>,
}

impl StandInAgents {
    /// The client of `node`'s agent (connects on first use).
    pub async fn client(&mut self, mesh: &crate::mesh::Mesh, node: &str) -> RegistrarClient<Channel> {
        if !self.clients.contains_key(node) {
            let client = mesh.registrar_as(node).await;
            self.clients.insert(node.to_owned(), client);
        }
        self.clients[node].clone()
    }
}

/// Registers every endpoint, `in_flight` calls at a time, each as the agent of its node
/// (connected before the clock starts); returns the time taken.
pub async fn register_all(mesh: &crate::mesh::Mesh, endpoints: Vec<Endpoint>, in_flight: usize) -> Duration {
    let mut agents = StandInAgents::default();
    let mut calls = Vec::with_capacity(endpoints.len());
    for e in endpoints {
        calls.push((agents.client(mesh, &e.node).await, e));
    }
    let started = Instant::now();
    let permits = Arc::new(tokio::sync::Semaphore::new(in_flight));
    let mut tasks = tokio::task::JoinSet::new();
    for (mut client, e) in calls {
        let permit = permits.clone().acquire_owned().await.unwrap();
        tasks.spawn(async move {
            client
                .register_endpoint(RegisterEndpointRequest { endpoint: Some(e) })
                .await
                .expect("RegisterEndpoint");
            drop(permit);
        });
    }
    while let Some(done) = tasks.join_next().await {
        done.expect("register task");
    }
    started.elapsed()
}

/// The agent's view of its dependency set (`/debug/dependencies`): what its pods depend on, what its Watch filter
/// names, what the registrar answered with, and the pods' own services no local pod calls (no cluster in Envoy).
pub struct Dependencies {
    pub wanted: std::collections::BTreeSet<String>,
    pub watched: std::collections::BTreeSet<String>,
    pub known: std::collections::BTreeSet<String>,
    pub own_only: std::collections::BTreeSet<String>,
}

pub async fn dependencies(mesh: &crate::mesh::Mesh) -> Dependencies {
    let deps: serde_json::Value = serde_json::from_str(&mesh.agent_get("/debug/dependencies").await).unwrap();
    let set = |v: &serde_json::Value| {
        v.as_array()
            .into_iter()
            .flatten()
            .filter_map(|s| s.as_str().map(str::to_owned))
            .collect()
    };
    Dependencies {
        wanted: set(&deps["dependencies"]),
        watched: set(&deps["watched"]),
        known: set(&deps["known"]),
        own_only: set(&deps["own_only"]),
    }
}

/// A `/proc/<pid>/status` field in bytes (the kernel reports kB); panics if it cannot be read.
pub fn proc_status(pid: u32, field: &str) -> u64 {
    let status =
        std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_else(|e| panic!("/proc/{pid}/status: {e}"));
    status
        .lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or_else(|| panic!("no {field} in /proc/{pid}/status"))
        * 1024
}

/// A process's resident file-backed pages by what they map (`/proc/<pid>/smaps`): its own binary's code
/// (`r-xp`), its read-only data (`r--p`: constants and relocated tables), and everything else (shared
/// libraries, writable file data); bytes. Panics if it cannot be read.
pub fn file_rss_by_kind(pid: u32) -> (u64, u64, u64) {
    let smaps =
        std::fs::read_to_string(format!("/proc/{pid}/smaps")).unwrap_or_else(|e| panic!("/proc/{pid}/smaps: {e}"));
    let exe = std::fs::read_link(format!("/proc/{pid}/exe")).unwrap_or_else(|e| panic!("/proc/{pid}/exe: {e}"));
    let exe = exe.to_string_lossy().into_owned();
    let (mut code, mut rodata, mut other) = (0, 0, 0);
    // Each mapping: a header line (range perms offset dev inode [path]), then "Key: value kB" lines.
    let mut current: Option<(String, bool)> = None;
    for line in smaps.lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        if fields.first().is_some_and(|f| f.contains('-') && !f.ends_with(':')) {
            let path = fields.get(5).copied().unwrap_or_default();
            // Anonymous mappings and pseudo-files ([heap], [stack]) are not file-backed.
            current = path.starts_with('/').then(|| (fields[1].to_owned(), path == exe));
            continue;
        }
        let (Some((perms, own)), ["Rss:", kb, ..]) = (&current, fields.as_slice()) else {
            continue;
        };
        let bytes = kb.parse::<u64>().unwrap_or(0) * 1024;
        match (*own, perms.as_str()) {
            (true, "r-xp") => code += bytes,
            (true, "r--p") => rodata += bytes,
            _ => other += bytes,
        }
    }
    (code, rodata, other)
}

/// CPU time (user + system) a process has used, from `/proc/<pid>/stat` (clock ticks of
/// 10 ms); panics if it cannot be read.
pub fn cpu_time(pid: u32) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_else(|e| panic!("/proc/{pid}/stat: {e}"));
    // pid (comm) state …: comm may hold spaces, so count from the last ')'; utime and stime are fields 14 and 15.
    let after_comm = stat.rfind(')').map_or("", |i| &stat[i + 2..]);
    let fields: Vec<u64> = after_comm
        .split_whitespace()
        .skip(11)
        .take(2)
        .filter_map(|f| f.parse().ok())
        .collect();
    assert_eq!(fields.len(), 2, "utime and stime in /proc/{pid}/stat: {stat}");
    const TICKS_PER_SECOND: u64 = 100;
    Duration::from_millis((fields[0] + fields[1]) * 1000 / TICKS_PER_SECOND)
}

/// The last `lines` lines of a log.
/// From the agent's `/metrics`: the mean time from an xDS response to Envoy's ACK, by type
/// (`Cluster 12.1 ms (n 273), …`; types never pushed are left out).
pub fn xds_ack_means(metrics: &str) -> String {
    const TYPES: [&str; 6] = [
        "Cluster",
        "ClusterLoadAssignment",
        "Secret",
        "Listener",
        "RouteConfiguration",
        "VirtualHost",
    ];
    let means: Vec<String> = TYPES
        .iter()
        .filter_map(|kind| {
            let value = |suffix: &str| {
                let prefix = format!("aether_agent_xds_push_duration_seconds_{suffix}{{type=\"{kind}\"}} ");
                metrics
                    .lines()
                    .find_map(|l| l.strip_prefix(prefix.as_str()))
                    .and_then(|v| v.trim().parse::<f64>().ok())
            };
            let (sum, count) = (value("sum")?, value("count")?);
            (count > 0.0).then(|| format!("{kind} {:.1} ms (n {count})", 1e3 * sum / count))
        })
        .collect();
    means.join(", ")
}

pub fn tail(logs: &str, lines: usize) -> String {
    let all: Vec<&str> = logs.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// A comma-separated list of counts from the environment (`AETHER_BENCH_X=0,10,100`), `default` when unset; panics
/// on anything else.
pub fn knob_list(name: &str, default: &str) -> Vec<usize> {
    let raw = std::env::var(name).unwrap_or_else(|_| default.to_owned());
    raw.split(',')
        .map(|v| {
            v.trim()
                .parse()
                .unwrap_or_else(|e| panic!("{name}={raw:?}: {v:?} is not a count ({e})"))
        })
        .collect()
}

/// Envoy's heap: `/memory`'s `allocated` (bytes in use by the application) from the admin at `admin`; panics if
/// Envoy does not say.
pub async fn envoy_allocated(admin: std::net::SocketAddr) -> u64 {
    let reply = crate::http_get(&format!("http://{admin}/memory"), None)
        .await
        .unwrap_or_else(|e| panic!("Envoy admin {admin}/memory: {e}"));
    let memory: serde_json::Value =
        serde_json::from_str(&reply.body).unwrap_or_else(|e| panic!("Envoy /memory is not JSON ({e}): {}", reply.body));
    memory["allocated"]
        .as_str()
        .and_then(|s| s.parse().ok())
        .or_else(|| memory["allocated"].as_u64())
        .unwrap_or_else(|| panic!("Envoy /memory has no numeric \"allocated\": {memory}"))
}

/// The nearest-rank `p` quantile (0..=1) of `sorted` samples; zero when there are none.
pub fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    sorted[((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1]
}

/// What `wrk --latency` printed: requests/s, the p50 and p99 lines as printed, and its error lines ("none").
pub struct Wrk {
    pub rps: f64,
    pub p50: String,
    pub p99: String,
    pub errors: String,
}

/// Reads `wrk --latency` output.
pub fn parse_wrk(out: &str) -> Wrk {
    let find = |prefix: &str| {
        out.lines()
            .map(str::trim)
            .find(|l| l.starts_with(prefix))
            .map(|l| l[prefix.len()..].trim().to_owned())
            .unwrap_or_else(|| format!("? ({out})"))
    };
    let errors = out
        .lines()
        .filter(|l| l.contains("Non-2xx") || l.contains("Socket errors"))
        .collect::<Vec<_>>()
        .join("; ");
    Wrk {
        rps: find("Requests/sec:").parse().unwrap_or(0.0),
        p50: find("50%"),
        p99: find("99%"),
        errors: if errors.is_empty() { "none".into() } else { errors },
    }
}

/// The p50 and p99 (ms) `hey` printed; panics naming `url` when it saw errors or printed no such line.
pub fn parse_hey(out: &str, url: &str) -> (f64, f64) {
    let at = |pct: &str| {
        out.lines()
            .map(str::trim)
            .find_map(|l| {
                l.strip_prefix(&format!("{pct}% in "))?
                    .strip_suffix(" secs")?
                    .parse::<f64>()
                    .ok()
            })
            .unwrap_or_else(|| panic!("hey printed no {pct}% line:\n{out}"))
            * 1e3
    };
    assert!(
        !out.contains("Error distribution"),
        "hey saw errors against {url}:\n{out}"
    );
    (at("50"), at("99"))
}
