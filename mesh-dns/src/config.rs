//! `aether-mesh-dns` configuration, from flags or the environment.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use aether_common::telemetry::LogFormat;

/// Where the default upstreams come from.
pub const RESOLV_CONF: &str = "/etc/resolv.conf";
/// The record file the agent writes under its default state dir.
pub const DEFAULT_RECORDS: &str = "/var/lib/aether/mesh-dns/records";

#[derive(Clone, Debug, clap::Parser)]
#[command(
    name = "aether-mesh-dns",
    version,
    about = "Aether's node DNS: mesh names from the agent's record file, the rest forwarded"
)]
pub struct Config {
    /// UDP and TCP address to serve DNS on (SO_REUSEPORT, so an old and a new instance can overlap).
    #[arg(long, env = "AETHER_MESH_DNS_LISTEN", default_value = "0.0.0.0:18054")]
    pub listen: SocketAddr,

    /// The record file the agent writes (its directory is watched).
    #[arg(long, env = "AETHER_MESH_DNS_RECORDS", default_value = DEFAULT_RECORDS)]
    pub records: PathBuf,

    /// The mesh's DNS domain: services are `<svc>.<ns>.<domain>`. Never forwarded.
    #[arg(long, env = "AETHER_MESH_DOMAIN", default_value = "aether.internal")]
    pub mesh_domain: String,

    /// The Kubernetes cluster domain, for recognising search-path expansions of mesh names.
    #[arg(long, env = "AETHER_CLUSTER_DOMAIN", default_value = "cluster.local")]
    pub cluster_domain: String,

    /// More search domains whose expansions of mesh names are answered NXDOMAIN locally
    /// (repeatable; the `search` line of /etc/resolv.conf is always included).
    #[arg(
        long = "search-domain",
        env = "AETHER_MESH_DNS_SEARCH_DOMAINS",
        value_delimiter = ','
    )]
    pub search_domains: Vec<String>,

    /// Upstream resolvers, `ip` or `ip:port` (repeatable). Default: the nameservers in /etc/resolv.conf.
    #[arg(long = "upstream", env = "AETHER_MESH_DNS_UPSTREAMS", value_delimiter = ',')]
    pub upstreams: Vec<String>,

    /// How long one upstream gets to answer before the next is tried.
    #[arg(long, env = "AETHER_MESH_DNS_UPSTREAM_TIMEOUT", default_value = "2s", value_parser = aether_common::duration::parse)]
    pub upstream_timeout: Duration,

    /// How long a client TCP connection may stay idle.
    #[arg(long, env = "AETHER_MESH_DNS_TCP_IDLE_TIMEOUT", default_value = "10s", value_parser = aether_common::duration::parse)]
    pub tcp_idle_timeout: Duration,

    /// How often the record file is re-read while the directory watch is down.
    #[arg(long, env = "AETHER_MESH_DNS_POLL_INTERVAL", default_value = "10s", value_parser = aether_common::duration::parse)]
    pub poll_interval: Duration,

    /// A record file stamped longer ago than this is reported stale (and still served).
    #[arg(long, env = "AETHER_MESH_DNS_STALE_AFTER", default_value = "5m", value_parser = aether_common::duration::parse)]
    pub stale_after: Duration,

    /// UDP sockets (and threads) serving queries; 0 = one per CPU.
    #[arg(long, env = "AETHER_MESH_DNS_WORKERS", default_value_t = 0)]
    pub workers: usize,

    /// Most forwarded queries in flight at once (beyond it, SERVFAIL).
    #[arg(long, env = "AETHER_MESH_DNS_MAX_INFLIGHT", default_value_t = 4096)]
    pub max_inflight: usize,

    /// Admin HTTP address: /healthz, /ready, /metrics, /debug/records. Loopback only.
    #[arg(long, env = "AETHER_MESH_DNS_ADMIN", default_value = "127.0.0.1:18094")]
    pub admin: SocketAddr,

    /// A file that exists exactly while /ready answers 200, for an exec readiness probe: on the host network a
    /// surge successor's HTTP probe would be answered by its predecessor, which holds the admin address.
    #[arg(long, env = "AETHER_MESH_DNS_READY_FILE")]
    pub ready_file: Option<PathBuf>,

    /// OpenTelemetry export (metrics, traces).
    #[command(flatten)]
    pub telemetry: aether_common::telemetry::TelemetryConfig,

    /// Log format: text or json.
    #[arg(long, env = "AETHER_LOG_FORMAT", default_value = "text")]
    pub log_format: LogFormat,
}

impl Config {
    /// The UDP sockets (and threads) to serve on: `--workers`, or one per CPU for 0.
    pub fn worker_count(&self) -> usize {
        match self.workers {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
            n => n,
        }
    }
}
