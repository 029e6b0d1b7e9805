//! The agent's read-only debug API for the `aether` CLI, beside `/debug/{pods,dependencies,xds}`
//! on the loopback admin address:
//!
//! - `/debug/status`: the node (agent, Envoy, xDS, registrar stream, DNS records, pods);
//! - `/debug/check`: pre-flight and post-install checks, each PASS/WARN/FAIL with a fix;
//! - `/debug/proxy-config/<ns>/<pod>/<section>`: what Envoy holds for a pod, as a table;
//! - `/debug/explain/<ns>/<pod>/<target>[/<method>[/<name>:<value>…]]`: the hops of a
//!   call and the first failing one (each segment percent-encoded; `<target>` a service
//!   name or URL, then the request's method and headers for the route hop).
//!
//! Envoy's admin is read here, by the agent, and never exposed further. Nothing here writes.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use aether_common::admin::{Pages, answered};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;

use crate::capture::CaptureConfig;
use crate::node::Node;
use crate::proxy::admin::EnvoyAdmin;

mod check;
mod envoy;
mod facts;
mod mesh_dns;
mod proxy_config;
mod status;

/// What the debug API reads: the node, and the agent's view of its neighbours. (The
/// agent's own readiness is its `/ready`, which the CLI reads beside these pages.)
#[derive(Clone)]
pub struct Inspector {
    pub node: Node,
    pub node_name: String,
    pub capture: CaptureConfig,
    pub envoy: EnvoyAdmin,
    /// mesh-dns's record file (written by the agent).
    pub records: PathBuf,
    /// mesh-dns on this node, if configured: `check` asks it a question.
    pub mesh_dns: Option<SocketAddr>,
    pub sockets: Vec<PathBuf>,
    pub netns_pin_dir: PathBuf,
    /// The registrar connection: `status` asks it for its head version.
    pub registrar: crate::registrar_link::RegistrarLink,
    /// 1 while the catalog watch is up.
    pub registrar_connected: Gauge,
    /// 1 while the DNS (services-only) watch is up.
    pub dns_connected: Gauge,
    /// Each local pod's last failed calls, from Envoy's access logs.
    pub failures: crate::access_log::RecentFailures,
    /// The last authorization decisions on calls to local pods.
    pub decisions: crate::access_log::Decisions,
    pub errors: ErrorCounters,
}

/// The agent's error counters since start, as `status` shows them.
#[derive(Clone, Default)]
pub struct ErrorCounters {
    pub cni: crate::cni::CniMetrics,
    /// Identity provider failures.
    pub identity: Counter,
    /// Failed writes of mesh-dns's record file.
    pub dns_records: Counter,
    /// Failed reads of Envoy's request stats.
    pub envoy_stats: Counter,
}

impl Inspector {
    /// `connected` and `dns` are the gauges the catalog watch and the DNS watch keep at 1 while up.
    pub fn new(
        config: &crate::config::Config,
        node: Node,
        registrar: crate::registrar_link::RegistrarLink,
        connected: &Gauge,
        dns: &Gauge,
        failures: crate::access_log::RecentFailures,
        decisions: crate::access_log::Decisions,
    ) -> Self {
        Self {
            node,
            node_name: config.node_name.clone(),
            capture: CaptureConfig::new(
                &config.state_dir,
                config.mesh_vip_cidr,
                config.mesh_dns,
                config.proxy_mark,
            ),
            envoy: EnvoyAdmin::new(config.envoy_admin),
            records: crate::dns_records::path(&config.state_dir),
            mesh_dns: config.mesh_dns,
            sockets: vec![config.xds_socket.clone(), config.cni_socket.clone()],
            netns_pin_dir: config.netns_pin_dir.clone(),
            registrar,
            registrar_connected: connected.clone(),
            dns_connected: dns.clone(),
            failures,
            decisions,
            errors: ErrorCounters::default(),
        }
    }

    pub fn with_errors(self, errors: ErrorCounters) -> Self {
        Self { errors, ..self }
    }
}

/// `base` (the node's own pages) plus the CLI's; each answer is JSON.
pub fn pages(base: Pages, inspector: Inspector) -> Pages {
    let inspector = Arc::new(inspector);
    Arc::new(move |path: &str| match Route::parse(path) {
        None => answered(None),
        Some(Route::Other) => base(path),
        Some(Route::Cli(request)) => {
            let inspector = inspector.clone();
            Box::pin(async move { Some(answer(&inspector, request).await) })
        }
    })
}

/// One CLI request, parsed from its path.
#[derive(Debug, PartialEq, Eq)]
enum Request {
    Status,
    Check,
    ProxyConfig { pod: String, section: String },
    Explain(facts::Question),
}

#[derive(Debug, PartialEq, Eq)]
enum Route {
    Cli(Request),
    Other,
}

impl Route {
    /// `None`: a CLI path with the wrong shape (served as not found).
    fn parse(path: &str) -> Option<Route> {
        let parts: Vec<&str> = path.trim_start_matches('/').split('/').collect();
        let pod = |ns: &str, name: &str| format!("{}/{}", decode(ns), decode(name));
        let request = match parts.as_slice() {
            ["debug", "status"] => Request::Status,
            ["debug", "check"] => Request::Check,
            ["debug", "proxy-config", ns, name, section] => Request::ProxyConfig {
                pod: pod(ns, name),
                section: decode(section),
            },
            ["debug", "explain", ns, name, target, request @ ..] => {
                let (method, headers) = match request {
                    [] => (None, Vec::new()),
                    [method, headers @ ..] => (
                        Some(decode(method)),
                        headers.iter().copied().map(header).collect::<Option<_>>()?,
                    ),
                };
                Request::Explain(facts::Question {
                    pod: pod(ns, name),
                    target: decode(target),
                    method,
                    headers,
                })
            }
            ["debug", "status" | "check" | "proxy-config" | "explain", ..] => return None,
            _ => return Some(Route::Other),
        };
        Some(Route::Cli(request))
    }
}

async fn answer(inspector: &Inspector, request: Request) -> (u16, String) {
    let body = match request {
        Request::Status => status::status(inspector).await,
        Request::Check => check::page(inspector).await,
        Request::ProxyConfig { pod, section } => match proxy_config::table(inspector, &pod, &section).await {
            Ok(table) => table,
            Err(e) => return error(404, &e.to_string()),
        },
        Request::Explain(question) => {
            let facts = facts::gather(inspector, &question).await;
            serde_json::to_value(crate::explain::explain(&facts)).expect("an explanation serialises")
        }
    };
    (200, serde_json::to_string_pretty(&body).expect("JSON serialises"))
}

fn error(status: u16, message: &str) -> (u16, String) {
    (status, serde_json::json!({ "error": message }).to_string())
}

/// A `<name>:<value>` header segment, the name lower-cased (`None`: no colon).
fn header(segment: &str) -> Option<(String, String)> {
    let decoded = decode(segment);
    let (name, value) = decoded.split_once(':')?;
    Some((name.trim().to_ascii_lowercase(), value.trim().to_owned()))
}

/// Percent-decoding of one path segment (the CLI encodes the target URL).
fn decode(segment: &str) -> String {
    percent_encoding::percent_decode_str(segment)
        .decode_utf8_lossy()
        .into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cli_paths_are_parsed_and_the_rest_left_to_the_node() {
        let explain = Route::parse("/debug/explain/demo/frontend/http%3A%2F%2Fbackend.demo%3A8080%2Fx").unwrap();
        assert_eq!(
            explain,
            Route::Cli(Request::Explain(facts::Question {
                pod: "demo/frontend".into(),
                target: "http://backend.demo:8080/x".into(),
                ..Default::default()
            }))
        );
        let with_request = Route::parse("/debug/explain/demo/frontend/backend/POST/X-Env%3A%20canary").unwrap();
        assert_eq!(
            with_request,
            Route::Cli(Request::Explain(facts::Question {
                pod: "demo/frontend".into(),
                target: "backend".into(),
                method: Some("POST".into()),
                headers: vec![("x-env".into(), "canary".into())],
            }))
        );
        assert_eq!(Route::parse("/debug/explain/demo/frontend/backend/GET/no-colon"), None);
        assert_eq!(Route::parse("/debug/status"), Some(Route::Cli(Request::Status)));
        assert_eq!(
            Route::parse("/debug/proxy-config/demo/a/clusters"),
            Some(Route::Cli(Request::ProxyConfig {
                pod: "demo/a".into(),
                section: "clusters".into()
            }))
        );
        assert_eq!(Route::parse("/debug/pods"), Some(Route::Other));
        assert_eq!(Route::parse("/debug/explain/demo"), None);
        assert_eq!(decode("a%2"), "a%2");
    }
}
