//! `aether-controller` flags.

use std::net::SocketAddr;
use std::path::PathBuf;

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

    /// The mesh root namespace: an AuthorizationPolicy there applies to every namespace
    /// (the registrar's flag of the same name; the two must agree).
    #[arg(long, env = "AETHER_MESH_ROOT_NAMESPACE", default_value = aether_api::authorization::DEFAULT_ROOT_NAMESPACE)]
    pub mesh_root_namespace: String,

    /// Log format: text or json.
    #[arg(long, env = "AETHER_LOG_FORMAT", default_value = "text")]
    pub log_format: LogFormat,

    #[command(flatten)]
    pub telemetry: TelemetryConfig,
}
