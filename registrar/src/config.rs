//! The registrar's configuration, from flags or the environment.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use aether_common::duration;
use aether_common::telemetry::LogFormat;
use ipnet::IpNet;

pub const ETCD_USERNAME_ENV: &str = "AETHER_ETCD_USERNAME";
pub const ETCD_PASSWORD_ENV: &str = "AETHER_ETCD_PASSWORD";
pub const ETCD_CA_FILE_ENV: &str = "AETHER_ETCD_CA_FILE";
pub const ETCD_CERT_FILE_ENV: &str = "AETHER_ETCD_CERT_FILE";
pub const ETCD_KEY_FILE_ENV: &str = "AETHER_ETCD_KEY_FILE";

/// A credential: its Debug and Display print `<redacted>`, so logging a config never leaks it.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    pub fn new(value: impl Into<String>) -> Self {
        Self(value.into())
    }

    /// The value, for the one place that sends it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<redacted>")
    }
}

impl std::fmt::Display for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<redacted>")
    }
}

impl std::str::FromStr for Secret {
    type Err = std::convert::Infallible;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(Self(s.to_owned()))
    }
}

/// A path whose empty value means unset (a chart renders an unset value as ""); the
/// etcd store drops empty credentials and paths.
fn path_or_empty(s: &str) -> Result<PathBuf, std::convert::Infallible> {
    Ok(PathBuf::from(s))
}

/// Where the registrar keeps the catalog.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum StoreKind {
    /// A redb file under --data-dir (one replica).
    Embedded,
    /// etcd v3 (--etcd-endpoints, --etcd-prefix); active/active replicas.
    Etcd,
    /// A DynamoDB table (or any DynamoDB-API endpoint); active/active replicas.
    Dynamodb,
    /// Read-only, derived from managed Pods and Nodes.
    Kubernetes,
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

    /// Directory of YAML files (`*.yaml`, `*.yml`) holding the mesh's configuration:
    /// HTTPRoute/GRPCRoute objects served as its routes, AuthorizationPolicy objects as
    /// its policies and HTTPFilter objects as its HTTP filters, re-read when it changes
    /// (clusters without Kubernetes, demos). `--routes-dir` is its former name.
    #[arg(long = "config-dir", alias = "routes-dir", env = "AETHER_REGISTRAR_CONFIG_DIR")]
    pub routes_dir: Option<PathBuf>,

    /// The mesh root namespace: an AuthorizationPolicy there applies to every namespace.
    #[arg(long, env = "AETHER_MESH_ROOT_NAMESPACE", default_value = aether_api::authorization::DEFAULT_ROOT_NAMESPACE)]
    pub mesh_root_namespace: String,

    /// Read the mesh's configuration from the cluster into a writable store (the
    /// kubernetes store always does): the Gateway API HTTPRoutes and GRPCRoutes with
    /// Service parents as the mesh's routes, the AuthorizationPolicies and HTTPFilters
    /// (their status written back), and each Service's clusterIPs and
    /// trafficDistribution into the mesh service of the same name. Uses the in-cluster or KUBECONFIG client. `--routes-from-kubernetes` is its
    /// former name.
    #[arg(
        long,
        alias = "routes-from-kubernetes",
        env = "AETHER_REGISTRAR_FROM_KUBERNETES",
        conflicts_with = "routes_dir"
    )]
    pub from_kubernetes: bool,

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

    /// Endpoints whose agent (node) has not re-registered for this long are removed.
    /// Agents refresh every 15 s, so keep this well above that.
    #[arg(long, env = "AETHER_REGISTRAR_ENDPOINT_TTL", default_value = "60s", value_parser = duration::parse)]
    pub endpoint_ttl: Duration,

    /// Writes accepted while the store is unreachable are queued (in order, in memory)
    /// up to this many store operations; beyond it writes are refused with
    /// Unavailable. 0 disables the queue (every write needs the store).
    #[arg(long, env = "AETHER_REGISTRAR_WRITE_BEHIND_LIMIT", default_value_t = 10_000)]
    pub write_behind_limit: usize,

    /// etcd client URLs, comma-separated (--store etcd).
    #[arg(
        long,
        env = "AETHER_REGISTRAR_ETCD_ENDPOINTS",
        value_delimiter = ',',
        default_value = "http://127.0.0.1:2379"
    )]
    pub etcd_endpoints: Vec<String>,

    /// Key prefix of the catalog in etcd (--store etcd); see proposals/003 for the layout.
    #[arg(long, env = "AETHER_REGISTRAR_ETCD_PREFIX", default_value = "/aether/v1")]
    pub etcd_prefix: String,

    /// Timeout of one etcd request (--store etcd).
    #[arg(long, env = "AETHER_REGISTRAR_ETCD_TIMEOUT", default_value = "5s", value_parser = duration::parse)]
    pub etcd_timeout: Duration,

    /// etcd user (--store etcd, etcd auth enabled); needs --etcd-password.
    #[arg(long, env = ETCD_USERNAME_ENV)]
    pub etcd_username: Option<String>,

    /// Password of --etcd-username; prefer the environment variable over the flag
    /// (flags show in `ps`). Never logged.
    #[arg(long, env = ETCD_PASSWORD_ENV, hide_env_values = true)]
    pub etcd_password: Option<Secret>,

    /// PEM CA bundle that verifies etcd's server certificate; needed by https:// endpoints.
    #[arg(long, env = ETCD_CA_FILE_ENV, value_parser = path_or_empty)]
    pub etcd_ca_file: Option<PathBuf>,

    /// PEM client certificate (chain) for etcd mTLS (--client-cert-auth); needs --etcd-key-file.
    #[arg(long, env = ETCD_CERT_FILE_ENV, value_parser = path_or_empty)]
    pub etcd_cert_file: Option<PathBuf>,

    /// PEM private key of --etcd-cert-file.
    #[arg(long, env = ETCD_KEY_FILE_ENV, value_parser = path_or_empty)]
    pub etcd_key_file: Option<PathBuf>,

    // ---- DynamoDB and Kubernetes stores ----
    /// DynamoDB table of the catalog (--store dynamodb); see proposals/004 for its layout.
    #[arg(long, env = "AETHER_REGISTRAR_DYNAMODB_TABLE", default_value = crate::store::dynamodb::DEFAULT_TABLE)]
    pub dynamodb_table: String,

    /// DynamoDB-API endpoint URL (--store dynamodb); unset means AWS's endpoint for the region.
    #[arg(long, env = "AETHER_REGISTRAR_DYNAMODB_ENDPOINT_URL")]
    pub dynamodb_endpoint_url: Option<String>,

    /// AWS region (--store dynamodb); unset means AWS_REGION or the AWS profile's.
    #[arg(long, env = "AETHER_REGISTRAR_DYNAMODB_REGION")]
    pub dynamodb_region: Option<String>,

    /// How often a replica syncs other replicas' changes from DynamoDB (--store dynamodb).
    #[arg(long, env = "AETHER_REGISTRAR_DYNAMODB_SYNC_INTERVAL", default_value = "1s", value_parser = duration::parse)]
    pub dynamodb_sync_interval: Duration,

    /// Create the DynamoDB table (on-demand billing) if it does not exist (--store dynamodb).
    #[arg(long, env = "AETHER_REGISTRAR_DYNAMODB_CREATE_TABLE", default_value_t = true, action = clap::ArgAction::Set)]
    pub dynamodb_create_table: bool,

    /// Timeout of one DynamoDB request attempt (--store dynamodb).
    #[arg(long, env = "AETHER_REGISTRAR_DYNAMODB_TIMEOUT", default_value = "5s", value_parser = duration::parse)]
    pub dynamodb_timeout: Duration,

    /// Items per DynamoDB Scan/Query page (--store dynamodb); unset means DynamoDB's 1 MB pages.
    #[arg(long, env = "AETHER_REGISTRAR_DYNAMODB_PAGE_SIZE", value_parser = clap::value_parser!(i32).range(1..))]
    pub dynamodb_page_size: Option<i32>,

    /// ConfigMap `<namespace>/<name>` holding the mesh VIPs (--store kubernetes): the
    /// endpoints come from Pods, but VIPs must be stored to stay stable.
    #[arg(long, env = "AETHER_REGISTRAR_KUBE_VIP_CONFIGMAP", default_value = crate::store::kubernetes::DEFAULT_VIP_CONFIGMAP)]
    pub kube_vip_configmap: String,

    // ---- end of DynamoDB / Kubernetes store flags ----
    /// Control-plane security (proposals/010).
    #[command(flatten)]
    pub security: SecurityConfig,

    /// OpenTelemetry export (metrics, traces).
    #[command(flatten)]
    pub telemetry: aether_common::telemetry::TelemetryConfig,

    /// Log format: text or json.
    #[arg(long, env = "AETHER_LOG_FORMAT", default_value = "text")]
    pub log_format: LogFormat,
}

/// Who may talk to the registrar, and how they prove it (proposals/010).
#[derive(Clone, Debug, clap::Args)]
pub struct SecurityConfig {
    /// NOT FOR PRODUCTION: serve gRPC in plaintext and let anyone read and write the
    /// catalog. For the registrar's own catalog tests only; logged loudly at start.
    #[arg(long, env = "AETHER_REGISTRAR_INSECURE")]
    pub insecure: bool,

    /// The registrar's serving certificate (PEM, leaf first); reloaded when it changes.
    #[arg(
        long,
        env = "AETHER_REGISTRAR_TLS_CERT",
        default_value = "/etc/aether/registrar-tls/tls.crt"
    )]
    pub tls_cert: PathBuf,

    /// The private key of --tls-cert.
    #[arg(
        long,
        env = "AETHER_REGISTRAR_TLS_KEY",
        default_value = "/etc/aether/registrar-tls/tls.key"
    )]
    pub tls_key: PathBuf,

    /// CA certificates (PEM) that verify client certificates besides the node CA: e.g.
    /// SPIRE's trust bundle when agents present their SPIRE SVIDs.
    #[arg(long, env = "AETHER_REGISTRAR_CLIENT_CA", value_parser = path_or_empty)]
    pub client_ca: Option<PathBuf>,

    /// Trust domain of the identities: an agent is `spiffe://<td>/aether/node/<node>`, an
    /// edge gateway `spiffe://<td>/aether/edge/<namespace>/<service account>` (a reader).
    #[arg(long, env = "AETHER_TRUST_DOMAIN", default_value = "cluster.local")]
    pub trust_domain: String,

    /// SPIFFE IDs that may Watch and List besides agents and edges (the controller, the
    /// CLI, an operator), comma-separated. They can never write.
    #[arg(long, env = "AETHER_REGISTRAR_READER_IDS", value_delimiter = ',')]
    pub reader_ids: Vec<String>,

    /// The node CA's certificate (PEM): with --node-ca-key, the registrar issues node
    /// certificates to agents that prove their node (NodeBootstrap), and trusts them.
    #[arg(long, env = "AETHER_REGISTRAR_NODE_CA_CERT", value_parser = path_or_empty)]
    pub node_ca_cert: Option<PathBuf>,

    /// The node CA's private key (PEM).
    #[arg(long, env = "AETHER_REGISTRAR_NODE_CA_KEY", value_parser = path_or_empty)]
    pub node_ca_key: Option<PathBuf>,

    /// Lifetime of an issued node certificate; agents renew at half-life.
    #[arg(long, env = "AETHER_REGISTRAR_NODE_CERT_TTL", default_value = "12h", value_parser = duration::parse)]
    pub node_cert_ttl: Duration,

    /// The audience a bootstrap token must be bound to.
    #[arg(
        long,
        env = "AETHER_REGISTRAR_BOOTSTRAP_AUDIENCE",
        default_value = "aether-registrar"
    )]
    pub bootstrap_audience: String,

    /// The ServiceAccount `<namespace>/<name>` agents run as: only its tokens get node
    /// certificates.
    #[arg(
        long,
        env = "AETHER_REGISTRAR_AGENT_SERVICE_ACCOUNT",
        default_value = "aether-system/aether-agent"
    )]
    pub agent_service_account: String,

    /// The ServiceAccounts `<namespace>/<name>` edge gateways (`aether-agent edge`) run
    /// as, comma-separated: a pod-bound token of one of them (from a pod on any node) gets
    /// a read-only edge certificate `spiffe://<td>/aether/edge/<namespace>/<name>`, which
    /// may Watch and List, never write. Exact names only, no wildcards: list each edge's.
    #[arg(long, env = "AETHER_REGISTRAR_EDGE_SERVICE_ACCOUNTS", value_delimiter = ',')]
    pub edge_service_accounts: Vec<String>,
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[test]
    fn the_etcd_password_never_shows_in_debug_output() {
        let config = Config::try_parse_from([
            "aether-registrar",
            "--store=etcd",
            "--etcd-username=aether",
            "--etcd-password=hunter2-s3cret",
        ])
        .unwrap();
        assert_eq!(config.etcd_username.as_deref(), Some("aether"));
        assert_eq!(
            config.etcd_password.as_ref().map(Secret::expose),
            Some("hunter2-s3cret")
        );
        let debug = format!("{config:?}");
        assert!(!debug.contains("hunter2-s3cret"), "{debug}");
        assert!(debug.contains("etcd_password: Some(<redacted>)"), "{debug}");
        assert_eq!(Secret::new("x").to_string(), "<redacted>");
    }

    #[test]
    fn edge_service_accounts_are_a_comma_separated_list() {
        let config = Config::try_parse_from([
            "aether-registrar",
            "--edge-service-accounts=aether-system/aether-edge-public,aether-system/aether-edge-internal",
        ])
        .unwrap();
        assert_eq!(
            config.security.edge_service_accounts,
            ["aether-system/aether-edge-public", "aether-system/aether-edge-internal"]
        );
        let none = Config::try_parse_from(["aether-registrar"]).unwrap();
        assert!(none.security.edge_service_accounts.is_empty());
    }
}
