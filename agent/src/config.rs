//! `aether-agent run` configuration, from flags or the environment.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::PathBuf;

use aether_common::telemetry::LogFormat;

/// Where pod metadata comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum PodSourceKind {
    /// A directory of Pod manifests (JSON), for local runs and tests.
    Static,
    /// A watch of this node's Pods on the Kubernetes API (in-cluster config or kubeconfig).
    Kubernetes,
}

#[derive(Clone, Debug, clap::Args)]
pub struct Config {
    /// This node's name (the xDS node id, and the node on registered endpoints).
    #[arg(long, env = "NODE_NAME")]
    pub node_name: String,

    /// The registrar's gRPC URL (https://: mTLS; http:// only for a test, in plaintext).
    #[arg(
        long,
        env = "AETHER_REGISTRAR",
        default_value = "https://aether-registrar.aether-system.svc:18090"
    )]
    pub registrar: String,

    /// How the agent proves itself to the registrar and checks it (proposals/010).
    #[command(flatten)]
    pub registrar_link: crate::registrar_link::LinkConfig,

    /// Where the agent keeps its state (the local pod store).
    #[arg(long, env = "AETHER_STATE_DIR", default_value = "/var/lib/aether")]
    pub state_dir: PathBuf,

    /// The CNI plugin's socket (mode 0600).
    #[arg(long, env = "AETHER_CNI_SOCKET", default_value = "/run/aether/cni.sock")]
    pub cni_socket: PathBuf,

    /// The xDS socket Envoy connects to (mode 0600).
    #[arg(long, env = "AETHER_XDS_SOCKET", default_value = "/run/aether/xds.sock")]
    pub xds_socket: PathBuf,

    /// Admin HTTP address: /healthz, /ready, /metrics, /debug/*. Loopback only.
    #[arg(long, env = "AETHER_AGENT_ADMIN", default_value = "127.0.0.1:18092")]
    pub admin: SocketAddr,

    /// Where pod metadata comes from.
    #[arg(long, env = "AETHER_POD_SOURCE", value_enum, default_value = "static")]
    pub pod_source: PodSourceKind,

    /// The static pod source's directory of Pod manifests.
    #[arg(long, env = "AETHER_POD_DIR", default_value = "/etc/aether/pods")]
    pub pod_dir: PathBuf,

    /// The mesh's DNS domain: services are `<svc>.<ns>.<domain>`.
    #[arg(long, env = "AETHER_MESH_DOMAIN", default_value = "aether.internal")]
    pub mesh_domain: String,

    /// Kubernetes' cluster DNS domain: a mesh service with a Kubernetes Service also
    /// answers to `<svc>.<ns>.svc.<cluster domain>` (and its ClusterIPs are captured).
    #[arg(long, env = "AETHER_CLUSTER_DOMAIN", default_value = crate::xds::resources::DEFAULT_CLUSTER_DOMAIN)]
    pub cluster_domain: String,

    /// This node's locality (topology.kubernetes.io/region, zone, subzone). With
    /// `--pod-source kubernetes`, region and zone left empty are read once from the Node's
    /// topology labels (a flag given wins).
    #[arg(long, env = "AETHER_REGION", default_value = "")]
    pub region: String,
    #[arg(long, env = "AETHER_ZONE", default_value = "")]
    pub zone: String,
    #[arg(long, env = "AETHER_SUBZONE", default_value = "")]
    pub subzone: String,

    /// Namespaces never put in the mesh.
    #[arg(
        long,
        env = "AETHER_EXCLUDED_NAMESPACES",
        value_delimiter = ',',
        default_value = "kube-system"
    )]
    pub excluded_namespaces: Vec<String>,

    /// How long a CNI ADD waits for the pod source to report a pod it has not seen.
    #[arg(long, env = "AETHER_POD_LOOKUP_TIMEOUT", default_value = "5s", value_parser = aether_common::duration::parse)]
    pub pod_lookup_timeout: std::time::Duration,

    /// How often the mesh-dns record file is re-stamped when nothing changed (so mesh-dns
    /// can tell a stale file from a quiet mesh).
    #[arg(long, env = "AETHER_DNS_RECORDS_RESTAMP", default_value = "60s", value_parser = aether_common::duration::parse)]
    pub dns_records_restamp: std::time::Duration,

    /// Where the CNI plugin pins pod netns (bind mounts); the agent owns and removes
    /// the pins under it on RemovePod and GC.
    #[arg(long, env = "AETHER_NETNS_PIN_DIR", default_value = "/var/run/aether/netns")]
    pub netns_pin_dir: PathBuf,

    /// Where the agent links pods' volumes for UDS delivery (`endpoint.aether.io/uds-socket`):
    /// Envoy connects to `<dir>/<pod uid>/<file>`.
    #[arg(long, env = "AETHER_UDS_LINK_DIR", default_value = "/run/aether/uds")]
    pub uds_link_dir: PathBuf,

    /// DNS servers (`ip:port`, comma-separated) Envoy resolves external services' hosts
    /// with, instead of the node's resolv.conf (e.g. a node-local cache).
    #[arg(long, env = "AETHER_EXTERNAL_DNS", value_delimiter = ',')]
    pub external_dns: Vec<std::net::SocketAddr>,

    /// kubelet's root directory (`--root-dir`), where pods' volumes are.
    #[arg(long, env = "AETHER_KUBELET_ROOT_DIR", default_value = "/var/lib/kubelet")]
    pub kubelet_root_dir: PathBuf,

    /// The mesh VIP range: TCP to it is captured inside managed pods.
    #[arg(long, env = "AETHER_MESH_VIP_CIDR", default_value = crate::capture::DEFAULT_VIP_CIDR)]
    pub mesh_vip_cidr: ipnet::IpNet,

    /// mesh-dns on this node (ip:port): DNS from managed pods is sent there. Unset: no
    /// DNS capture unless the CNI config names an address.
    #[arg(long, env = "AETHER_MESH_DNS")]
    pub mesh_dns: Option<SocketAddr>,

    /// The socket mark of Envoy's own upstream connections (never captured); decimal or 0x hex.
    #[arg(long, env = "AETHER_PROXY_MARK", default_value = "0x4145", value_parser = parse_mark)]
    pub proxy_mark: u32,

    /// Inbound mTLS of this node's pods unless their `security.aether.io/inbound-mtls`
    /// annotation says otherwise: strict (app ports reachable only through the mesh and
    /// from the node, for probes) or permissive (plaintext too, for migration).
    #[arg(long, env = "AETHER_INBOUND_MTLS", default_value = "strict", value_parser = crate::capture::InboundMtls::parse)]
    pub inbound_mtls: crate::capture::InboundMtls,

    /// Workload identity: SVIDs for local pods, mTLS between pods.
    #[command(flatten)]
    pub identity: crate::identity::IdentityConfig,

    /// Envoy's admin address (loopback): the agent reads Envoy's request metrics there and re-exposes them at its
    /// /metrics.
    #[arg(long, env = "AETHER_ENVOY_ADMIN", default_value = "127.0.0.1:15000")]
    pub envoy_admin: SocketAddr,

    /// Envoy's OTLP access log of the pods' HTTP requests, to --otlp-endpoint (one log record per request).
    #[arg(long, env = "AETHER_ENVOY_ACCESS_LOG")]
    pub envoy_access_log: bool,

    /// OpenTelemetry export (metrics, traces).
    #[command(flatten)]
    pub telemetry: aether_common::telemetry::TelemetryConfig,

    /// Log format: text or json.
    #[arg(long, env = "AETHER_LOG_FORMAT", default_value = "text")]
    pub log_format: LogFormat,
}

impl Config {
    pub fn excluded(&self) -> BTreeSet<String> {
        self.excluded_namespaces
            .iter()
            .map(|s| s.trim().to_owned())
            .filter(|s| !s.is_empty())
            .collect()
    }
}

fn parse_mark(text: &str) -> Result<u32, String> {
    let t = text.trim();
    let parsed = match t.strip_prefix("0x").or_else(|| t.strip_prefix("0X")) {
        Some(hex) => u32::from_str_radix(hex, 16),
        None => t.parse(),
    };
    parsed.map_err(|_| format!("{text:?} is not a 32-bit mark"))
}
