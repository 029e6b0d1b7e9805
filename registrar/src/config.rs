//! The registrar's configuration, from flags or the environment.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use aether_common::duration;
use aether_common::telemetry::LogFormat;
use ipnet::IpNet;

/// Where the registrar keeps the catalog.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum StoreKind {
    /// A redb file under --data-dir (one replica).
    Embedded,
}

#[derive(Clone, Debug, clap::Parser)]
#[command(name = "aether-registrar", version, about = "Aether's mesh-wide endpoint catalog")]
pub struct Config {
    /// gRPC address agents connect to.
    #[arg(long, env = "AETHER_REGISTRAR_LISTEN", default_value = "0.0.0.0:18090")]
    pub listen: SocketAddr,

    /// Admin HTTP address: /healthz, /ready, /metrics.
    #[arg(long, env = "AETHER_REGISTRAR_ADMIN", default_value = "127.0.0.1:18091")]
    pub admin: SocketAddr,

    /// The catalog's store.
    #[arg(long, env = "AETHER_REGISTRAR_STORE", value_enum, default_value = "embedded")]
    pub store: StoreKind,

    /// Directory of the embedded store's file.
    #[arg(long, env = "AETHER_REGISTRAR_DATA_DIR", default_value = "/var/lib/aether/registrar")]
    pub data_dir: PathBuf,

    /// Range mesh VIPs are allocated from (IPv4 or IPv6).
    #[arg(long, env = "AETHER_VIP_CIDR", default_value = crate::vip::DEFAULT_VIP_CIDR)]
    pub vip_cidr: IpNet,

    /// Changes of history kept so reconnecting watchers resume without a snapshot.
    #[arg(long, env = "AETHER_REGISTRAR_HISTORY_CHANGES", default_value_t = 100_000)]
    pub history_changes: usize,

    /// Change batches a watcher may fall behind before it is resynced with a snapshot.
    #[arg(long, env = "AETHER_REGISTRAR_WATCH_BUFFER", default_value_t = 1024)]
    pub watch_buffer: usize,

    /// How long a service with no endpoints keeps its VIP before it is removed.
    #[arg(long, env = "AETHER_REGISTRAR_EMPTY_SERVICE_TTL", default_value = "1h", value_parser = duration::parse)]
    pub empty_service_ttl: Duration,

    /// Log format: text or json.
    #[arg(long, env = "AETHER_LOG_FORMAT", default_value = "text")]
    pub log_format: LogFormat,
}
