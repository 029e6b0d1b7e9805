//! `aether-controller` flags.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use aether_common::duration;

use aether_common::telemetry::{LogFormat, TelemetryConfig};

#[derive(Clone, Debug, clap::Parser)]
#[command(name = "aether-controller", version, about = "The mesh's admission webhooks")]
pub struct Config {
    /// The webhooks' HTTPS address (kube-apiserver calls it through the controller's Service).
    #[arg(long, env = "AETHER_CONTROLLER_LISTEN", default_value = "0.0.0.0:18443")]
    pub listen: SocketAddr,

    /// The serving certificate chain (PEM), reloaded when the file changes (a mounted
    /// Secret is rewritten in place).
    #[arg(long, env = "AETHER_CONTROLLER_TLS_CERT")]
    pub tls_cert: PathBuf,

    /// The serving certificate's key (PEM).
    #[arg(long, env = "AETHER_CONTROLLER_TLS_KEY")]
    pub tls_key: PathBuf,

    /// Admin HTTP address: /healthz, /ready, /metrics.
    #[arg(long, env = "AETHER_CONTROLLER_ADMIN", default_value = "127.0.0.1:18095")]
    pub admin: SocketAddr,

    /// The mesh's DNS domain: mesh pods get `<ns>.<domain>` and `<domain>` as search domains.
    #[arg(long, env = "AETHER_MESH_DOMAIN", default_value = "aether.internal")]
    pub mesh_domain: String,

    /// Watch the MeshConfig `default` of `--mesh-root-namespace`: when it sets `meshDomain`,
    /// new pods search that domain instead of `--mesh-domain` (proposals/016). Needs a
    /// Kubernetes client (in-cluster, or KUBECONFIG).
    #[arg(long, env = "AETHER_CONTROLLER_FOLLOW_MESH_CONFIG")]
    pub follow_mesh_config: bool,

    /// The mesh root namespace: an AuthorizationPolicy there applies to every namespace
    /// (the registrar's flag of the same name; the two must agree).
    #[arg(long, env = "AETHER_MESH_ROOT_NAMESPACE", default_value = aether_api::authorization::DEFAULT_ROOT_NAMESPACE)]
    pub mesh_root_namespace: String,

    /// Lead (a Lease in `--namespace`) and, while leading, keep the node readiness taint:
    /// put back on nodes whose agent pod has not been Ready for `--node-taint-grace`, taken
    /// off when it is Ready. Needs a Kubernetes client (in-cluster, or KUBECONFIG).
    #[arg(long, env = "AETHER_CONTROLLER_NODE_TAINTS")]
    pub node_taints: bool,

    /// Lead (a Lease in `--namespace`) and, while leading, write the Gateway API status of
    /// the edge's Gateways (GatewayClass `aether.io/edge`, proposals/018): the class's,
    /// each Gateway's (conditions, listeners, addresses) and their routes' parent entries.
    /// On by default; `--gateway-status=false` turns it off. Needs a Kubernetes client
    /// (in-cluster, or KUBECONFIG): without one it is off, and says so.
    #[arg(
        long,
        env = "AETHER_CONTROLLER_GATEWAY_STATUS",
        default_value_t = true,
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "true",
        action = clap::ArgAction::Set
    )]
    pub gateway_status: bool,

    /// The controller's namespace: its Lease and the agents' pods are there.
    #[arg(long, env = "POD_NAMESPACE", default_value = "aether-system")]
    pub namespace: String,

    /// This replica's name in the Lease (its pod name).
    #[arg(long, env = "POD_NAME", default_value = "aether-controller")]
    pub identity: String,

    /// The Lease's name.
    #[arg(long, env = "AETHER_CONTROLLER_LEASE", default_value = "aether-controller")]
    pub lease: String,

    /// How long a leader's Lease lasts without renewal (renewed every third of it).
    #[arg(long, env = "AETHER_CONTROLLER_LEASE_DURATION", default_value = "15s", value_parser = duration::parse)]
    pub lease_duration: Duration,

    /// The label selector of the agent pods (in `--namespace`).
    #[arg(
        long,
        env = "AETHER_CONTROLLER_AGENT_SELECTOR",
        default_value = "app.kubernetes.io/component=agent"
    )]
    pub agent_selector: String,

    /// How long a node's agent may be not Ready before the node is tainted again.
    #[arg(long, env = "AETHER_CONTROLLER_NODE_TAINT_GRACE", default_value = "60s", value_parser = duration::parse)]
    pub node_taint_grace: Duration,

    /// Log format: text or json.
    #[arg(long, env = "AETHER_LOG_FORMAT", default_value = "text")]
    pub log_format: LogFormat,

    #[command(flatten)]
    pub telemetry: TelemetryConfig,
}
