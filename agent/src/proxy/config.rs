//! `aether-agent proxy` configuration, from flags or the environment.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use aether_common::telemetry::LogFormat;

/// Where the official Envoy image keeps its binary.
pub const DEFAULT_ENVOY_BIN: &str = "/usr/local/bin/envoy";
/// Where the image recipe installs the bootstrap template.
pub const DEFAULT_BOOTSTRAP_TEMPLATE: &str = "/etc/aether/proxy/bootstrap.yaml";
/// Shared between the supervisors of one node (hostPath): state file, base id, rendered bootstraps, hot-restart sockets.
pub const DEFAULT_STATE_DIR: &str = "/var/lib/aether/proxy";

/// How Envoy learns its base id (the key of its hot-restart shared memory and sockets).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum BaseIdMode {
    /// Envoy picks an unused one on the first epoch (`--use-dynamic-base-id`); it is kept in the state dir.
    Dynamic,
    /// Always `--base-id-value`.
    Fixed,
}

/// Which ADS flavour Envoy speaks to the agent.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum AdsApi {
    /// Incremental (delta) ADS.
    Delta,
    /// State-of-the-world ADS.
    Sotw,
}

impl AdsApi {
    /// The bootstrap's `ads_config.api_type`.
    pub fn api_type(self) -> &'static str {
        match self {
            AdsApi::Delta => "DELTA_GRPC",
            AdsApi::Sotw => "GRPC",
        }
    }
}

#[derive(Clone, Debug, clap::Args)]
pub struct ProxyConfig {
    /// This node's name (Envoy's xDS node id: the agent serves config for it).
    #[arg(long, env = "NODE_NAME")]
    pub node_name: String,

    /// Envoy's xDS node cluster.
    #[arg(long, env = "AETHER_PROXY_NODE_CLUSTER", default_value = "aether")]
    pub node_cluster: String,

    /// The Envoy binary. Replacing it (new mtime, size or inode) triggers a hot restart onto it.
    #[arg(long, env = "AETHER_ENVOY_BIN", default_value = DEFAULT_ENVOY_BIN)]
    pub envoy_bin: PathBuf,

    /// The bootstrap template (proxy/bootstrap.yaml). A change to it triggers a hot restart.
    #[arg(long, env = "AETHER_PROXY_BOOTSTRAP", default_value = DEFAULT_BOOTSTRAP_TEMPLATE)]
    pub bootstrap_template: PathBuf,

    /// State shared with a successor supervisor (mode 0700).
    #[arg(long, env = "AETHER_PROXY_STATE_DIR", default_value = DEFAULT_STATE_DIR)]
    pub state_dir: PathBuf,

    /// The agent's xDS socket.
    #[arg(long, env = "AETHER_XDS_SOCKET", default_value = "/run/aether/xds.sock")]
    pub xds_socket: PathBuf,

    /// ADS flavour.
    #[arg(long, env = "AETHER_PROXY_ADS", value_enum, default_value = "delta")]
    pub ads: AdsApi,

    /// Envoy's admin address: loopback only (pods never reach it).
    #[arg(long, env = "AETHER_ENVOY_ADMIN", default_value = "127.0.0.1:15000")]
    pub envoy_admin: SocketAddr,

    /// How long an old epoch drains its listeners after a hot restart, and how long SIGTERM drains.
    #[arg(long, env = "AETHER_PROXY_DRAIN_TIME", default_value = "10s", value_parser = aether_common::duration::parse)]
    pub drain_time: Duration,

    /// When Envoy's new epoch tells the old one to exit (longer than the drain time).
    #[arg(long, env = "AETHER_PROXY_PARENT_SHUTDOWN_TIME", default_value = "15s", value_parser = aether_common::duration::parse)]
    pub parent_shutdown_time: Duration,

    /// How the base id is chosen.
    #[arg(long, env = "AETHER_PROXY_BASE_ID", value_enum, default_value = "dynamic")]
    pub base_id: BaseIdMode,

    /// The base id when `--base-id fixed`.
    #[arg(long, env = "AETHER_PROXY_BASE_ID_VALUE", default_value_t = 0)]
    pub base_id_value: u32,

    /// Envoy's hot-restart socket: a path in the state dir by default, so supervisors in different pods (network
    /// namespaces) find each other; "abstract" uses Envoy's default abstract socket instead.
    #[arg(long, env = "AETHER_PROXY_HOT_RESTART_SOCKET")]
    pub hot_restart_socket: Option<String>,

    /// Envoy worker threads (0: one per core).
    #[arg(long, env = "AETHER_PROXY_CONCURRENCY", default_value_t = 2)]
    pub concurrency: u32,

    /// Overload manager: heap size at which Envoy sheds load.
    #[arg(long, env = "AETHER_PROXY_MAX_HEAP_BYTES", default_value_t = 1 << 30)]
    pub max_heap_bytes: u64,

    /// Overload manager: downstream connections Envoy accepts at most.
    #[arg(long, env = "AETHER_PROXY_MAX_DOWNSTREAM_CONNECTIONS", default_value_t = 50_000)]
    pub max_downstream_connections: u64,

    /// How long a new epoch may take to become LIVE before the attempt is abandoned.
    #[arg(long, env = "AETHER_PROXY_LIVE_TIMEOUT", default_value = "60s", value_parser = aether_common::duration::parse)]
    pub live_timeout: Duration,

    /// How often the template and the binary are checked for changes, and the state file heartbeat is written.
    #[arg(long, env = "AETHER_PROXY_WATCH_INTERVAL", default_value = "1s", value_parser = aether_common::duration::parse)]
    pub watch_interval: Duration,

    /// Envoy's log level.
    #[arg(long, env = "AETHER_PROXY_ENVOY_LOG_LEVEL", default_value = "info")]
    pub envoy_log_level: String,

    /// Supervisor admin HTTP address: /healthz, /ready, /metrics, /debug/proxy. Loopback only.
    #[arg(long, env = "AETHER_PROXY_ADMIN", default_value = "127.0.0.1:18093")]
    pub admin: SocketAddr,

    /// A file that exists exactly while /ready answers 200, for an exec readiness probe: on the host network a
    /// successor pod's HTTP probe would be answered by its predecessor until that one frees the admin address.
    #[arg(long, env = "AETHER_PROXY_READY_FILE")]
    pub ready_file: Option<PathBuf>,

    /// OpenTelemetry export of the supervisor's metrics (and traces), and Envoy's own OTLP stats sink to the same
    /// endpoint when --otel-enabled.
    #[command(flatten)]
    pub telemetry: aether_common::telemetry::TelemetryConfig,

    /// Log format: text or json (Envoy logs JSON lines too when json).
    #[arg(long, env = "AETHER_LOG_FORMAT", default_value = "text")]
    pub log_format: LogFormat,
}

impl ProxyConfig {
    /// The `--socket-path` for Envoy, or `None` for Envoy's abstract default.
    pub fn hot_restart_socket_path(&self) -> Option<PathBuf> {
        match self.hot_restart_socket.as_deref() {
            Some("abstract") => None,
            Some(path) if !path.is_empty() => Some(PathBuf::from(path)),
            _ => Some(self.state_dir.join("hot-restart")),
        }
    }
}
