//! Request metrics between workloads, from stock Envoy stats (see proposals/009).
//!
//! Names the agent gives Envoy:
//! - every mesh cluster has `alt_stat_name = "<ns>/<svc>|<port>"` (no dots, so Envoy's default `envoy.cluster_name`
//!   tag takes all of it);
//! - each local pod's outbound and capture HTTP connection managers stamp
//!   `x-envoy-upstream-alt-stat-name: mesh.<ns>/<svc>` (the source pod's service, overwriting whatever the app
//!   sent), so Envoy's router charges a second stats tree per request:
//!   `cluster.<dst>|<port>.mesh.<src>.upstream_rq_<code>`, `…_<class>xx`, `…_completed`, `…_time` (ms).
//!
//! The bootstrap's [`STATS_TAGS`] turn those names into tags (`source_workload`, `destination_service`,
//! `destination_port`; Envoy's defaults add `envoy_response_code[_class]`), so Envoy's own OTLP sink and
//! `/stats/prometheus` carry them as attributes/labels, and the names are re-derived on every hot-restart epoch.
//! The agent re-exposes them at its `/metrics` as `aether_proxy_requests_total` and
//! `aether_proxy_request_duration_seconds` ([`EnvoyRequestMetrics`], refreshed from Envoy's admin on every scrape
//! and before every OTLP push).

use parking_lot::Mutex;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use aether_common::telemetry::exposition::{self, Family, Format, Kind};
use envoy_types::pb::envoy::config::accesslog::v3::{AccessLog, access_log};
use envoy_types::pb::envoy::config::common::mutation_rules::v3::{HeaderMutation as MutationRule, header_mutation};
use envoy_types::pb::envoy::config::core::v3::{GrpcService, grpc_service};
use envoy_types::pb::envoy::config::core::v3::{HeaderValue, HeaderValueOption, header_value_option};
use envoy_types::pb::envoy::extensions::access_loggers::open_telemetry::v3::OpenTelemetryAccessLogConfig;
use envoy_types::pb::envoy::extensions::filters::http::header_mutation::v3::{HeaderMutation, Mutations};
use envoy_types::pb::google::protobuf::Any;
use envoy_types::pb::opentelemetry::proto::common::v1::{AnyValue, KeyValue, KeyValueList, any_value};
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric as _};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::registry::Unit;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The request header Envoy's router reads to charge a second stats tree.
pub const ALT_STAT_HEADER: &str = "x-envoy-upstream-alt-stat-name";
/// The stats-tree segment that marks request metrics between workloads.
pub const SOURCE_TREE: &str = "mesh";

/// `stats_config.stats_tags` for the bootstrap: (tag name, regex). The first capture group is removed from the
/// name, the second is the value.
/// The last two are the L7 trees of stream protocols at the destination
/// (`<protocol>.l7.<ns>/<svc>|<port>.…`, see `xds::resources::app_protocols`): their
/// destination and a Redis command's name.
pub const STATS_TAGS: [(&str, &str); 5] = [
    ("source_workload", r"^cluster\.[^.]+\.mesh\.(([^.]+)\.)"),
    ("destination_service", r"^cluster\.(([^.|]+)\|[^.]*\.)mesh\."),
    ("destination_port", r"^cluster\.([^.|]+\|([^.]*)\.)mesh\."),
    ("l7_destination", r"^(?:thrift|redis|dubbo)\.(l7\.([^.]+)\.)"),
    ("redis_command", r"^redis\.l7\.[^.]+\.command\.(([^.]+)\.)"),
];

/// Envoy admin filter selecting the request-metrics tree and the L7 trees.
const ENVOY_FILTER: &str = r"^(cluster\.[^.]+\.mesh|thrift\.l7|redis\.l7|dubbo\.l7)\.";
const REQUESTS: &str = "envoy_cluster_mesh_upstream_rq";
const REQUEST_TIME: &str = "envoy_cluster_mesh_upstream_rq_time";

/// A family of ours re-exposing Envoy's L7 counters: each Envoy family (by its
/// tag-extracted name) becomes one value of `label`.
struct L7Family {
    name: &'static str,
    help: &'static str,
    label: &'static str,
    from: &'static [(&'static str, &'static str)],
}

const L7_FAMILIES: [L7Family; 6] = [
    L7Family {
        name: "aether_proxy_thrift_requests",
        help: THRIFT_REQUESTS_HELP,
        label: "message_type",
        from: &[
            ("envoy_thrift_request_call", "call"),
            ("envoy_thrift_request_oneway", "oneway"),
            ("envoy_thrift_request_invalid_type", "invalid"),
        ],
    },
    L7Family {
        name: "aether_proxy_thrift_responses",
        help: THRIFT_RESPONSES_HELP,
        label: "outcome",
        from: &[
            ("envoy_thrift_response_success", "success"),
            ("envoy_thrift_response_error", "error"),
            ("envoy_thrift_response_exception", "exception"),
        ],
    },
    L7Family {
        name: "aether_proxy_dubbo_requests",
        help: DUBBO_REQUESTS_HELP,
        label: "message_type",
        from: &[
            ("envoy_dubbo_request_twoway", "twoway"),
            ("envoy_dubbo_request_oneway", "oneway"),
            ("envoy_dubbo_request_event", "event"),
        ],
    },
    L7Family {
        name: "aether_proxy_dubbo_responses",
        help: DUBBO_RESPONSES_HELP,
        label: "outcome",
        from: &[
            ("envoy_dubbo_response_success", "success"),
            ("envoy_dubbo_response_error", "error"),
            ("envoy_dubbo_response_business_exception", "exception"),
        ],
    },
    L7Family {
        name: "aether_proxy_redis_commands",
        help: REDIS_HELP,
        label: "outcome",
        from: &[
            ("envoy_redis_command_success", "success"),
            ("envoy_redis_command_error", "error"),
        ],
    },
    L7Family {
        name: "aether_proxy_protocol_errors",
        help: PROTOCOL_ERRORS_HELP,
        label: "protocol",
        from: &[
            ("envoy_thrift_request_decoding_error", "thrift"),
            ("envoy_dubbo_request_decoding_error", "dubbo"),
            ("envoy_redis_downstream_cx_protocol_error", "redis"),
        ],
    },
];

/// Whether Envoy's family `name` is one the L7 families re-expose.
fn is_l7(name: &str) -> bool {
    L7_FAMILIES
        .iter()
        .any(|f| f.from.iter().any(|(envoy, _)| *envoy == name))
}
const THRIFT_REQUESTS_HELP: &str =
    "Thrift messages a pod's port received through the node's Envoy (destination side), by message type";
const THRIFT_RESPONSES_HELP: &str =
    "Thrift replies a pod's port sent (destination side): success, error (a declared exception) or exception";
const DUBBO_REQUESTS_HELP: &str =
    "Dubbo messages a pod's port received through the node's Envoy (destination side), by type (event: heartbeat)";
const DUBBO_RESPONSES_HELP: &str = "Dubbo responses a pod's port sent (destination side): success (a value or an \
    exception the method threw; exception counts those), or error (a failed status)";
const REDIS_HELP: &str = "Redis commands sent to a pod's port through the node's Envoy (destination side), by command: \
    success (the app answered, an error reply included) or error (no answer: the app failed or timed out)";
const PROTOCOL_ERRORS_HELP: &str =
    "Frames the node's Envoy could not decode on a pod's L7 port; each closed its connection before the app";

/// A stat-name segment: no dots (they separate segments) and no colons (Envoy rewrites them).
fn segment(text: &str) -> String {
    text.replace(['.', ':'], "_")
}

/// A mesh cluster's `alt_stat_name`: `<ns>/<svc>|<port>`.
pub fn cluster_stat_name(service: &str, port: u32) -> String {
    format!("{}|{port}", segment(service))
}

/// The header value a source pod's connection managers stamp: `mesh.<ns>/<svc>`.
pub fn source_stat_value(service: &str) -> String {
    format!("{SOURCE_TREE}.{}", segment(service))
}

/// The `alt_stat_name` of the mesh cluster named by an authority `<svc>.<ns>.<domain>[:<port>]` serving `port`
/// (0: unknown): `<ns>/<svc>|<port>`, so the bare-name and `:port` clusters of one service port share a tree.
pub fn authority_stat_name(authority: &str, port: u32) -> String {
    let (host, named_port) = match authority.rsplit_once(':') {
        Some((host, p)) if p.parse::<u32>().is_ok() => (host, p.parse::<u32>().ok()),
        _ => (authority, None),
    };
    let port = named_port
        .or((port != 0).then_some(port))
        .map_or_else(|| "default".to_owned(), |p| p.to_string());
    let mut labels = host.split('.');
    match (labels.next(), labels.next()) {
        (Some(svc), Some(ns)) if !svc.is_empty() && !ns.is_empty() => {
            format!("{}|{port}", segment(&format!("{ns}/{svc}")))
        }
        _ => format!("{}|{port}", segment(host)),
    }
}

/// The HTTP filter config a source pod's connection managers run before the router: it stamps
/// [`ALT_STAT_HEADER`] with the pod's service, overwriting anything the app sent.
pub fn source_stamp(service: &str) -> HeaderMutation {
    HeaderMutation {
        mutations: Some(Mutations {
            request_mutations: vec![MutationRule {
                action: Some(header_mutation::Action::Append(HeaderValueOption {
                    header: Some(HeaderValue {
                        key: ALT_STAT_HEADER.to_owned(),
                        value: source_stat_value(service),
                        ..Default::default()
                    }),
                    append_action: header_value_option::HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
                    ..Default::default()
                })),
            }],
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// Where Envoy's OTLP access log of the pods' HTTP requests goes (`--envoy-access-log`); set once at start,
/// before the first xDS snapshot, and read by the listener generator. Unset: no access log (the default).
static ACCESS_LOG: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// Turns the OTLP access log on for every later snapshot (the first call wins).
pub fn enable_access_log(otlp_endpoint: &str) {
    let _ = ACCESS_LOG.set(
        otlp_endpoint
            .trim_start_matches("http://")
            .trim_end_matches('/')
            .to_owned(),
    );
}

/// The access log a source pod's HTTP connection managers carry, if enabled: one OTLP log record per request
/// with the same dimensions as the request metrics.
pub fn access_log(source: &str) -> Option<AccessLog> {
    let target = ACCESS_LOG.get()?;
    let text = |s: &str| AnyValue {
        value: Some(any_value::Value::StringValue(s.to_owned())),
    };
    let attribute = |key: &str, value: &str| KeyValue {
        key: key.to_owned(),
        value: Some(text(value)),
        ..Default::default()
    };
    let config = OpenTelemetryAccessLogConfig {
        grpc_service: Some(GrpcService {
            target_specifier: Some(grpc_service::TargetSpecifier::GoogleGrpc(grpc_service::GoogleGrpc {
                target_uri: target.clone(),
                stat_prefix: "otlp_access_log".into(),
                ..Default::default()
            })),
            ..Default::default()
        }),
        log_name: "aether".into(),
        body: Some(text(
            "%REQ(:METHOD)% %REQ(:AUTHORITY)%%REQ(X-ENVOY-ORIGINAL-PATH?:PATH)% %RESPONSE_CODE%",
        )),
        attributes: Some(KeyValueList {
            values: vec![
                attribute("source_workload", source),
                attribute("destination_cluster", "%UPSTREAM_CLUSTER%"),
                attribute("authority", "%REQ(:AUTHORITY)%"),
                attribute("response_code", "%RESPONSE_CODE%"),
                attribute("response_flags", "%RESPONSE_FLAGS%"),
                attribute("duration_ms", "%DURATION%"),
                attribute("upstream_host", "%UPSTREAM_HOST%"),
            ],
        }),
        ..Default::default()
    };
    Some(AccessLog {
        name: "envoy.access_loggers.open_telemetry".into(),
        config_type: Some(access_log::ConfigType::TypedConfig(Any {
            type_url: <OpenTelemetryAccessLogConfig as prost::Name>::type_url(),
            value: prost::Message::encode_to_vec(&config),
        })),
        ..Default::default()
    })
}

/// `stats_config` for the bootstrap, as JSON (valid YAML flow too).
pub fn stats_config_json() -> serde_json::Value {
    serde_json::json!({
        "use_all_default_tags": true,
        "stats_tags": STATS_TAGS
            .iter()
            .map(|(name, regex)| serde_json::json!({"tag_name": name, "regex": regex}))
            .collect::<Vec<_>>(),
    })
}

/// `stats_sinks` for the bootstrap: Envoy's own OTLP/gRPC stats sink to `endpoint` (host:port or http://host:port),
/// or none. Google gRPC needs no cluster in the bootstrap.
pub fn stats_sinks_json(endpoint: Option<&str>) -> serde_json::Value {
    let Some(endpoint) = endpoint else {
        return serde_json::json!([]);
    };
    let target = endpoint.trim_start_matches("http://").trim_end_matches('/');
    serde_json::json!([{
        "name": "envoy.stat_sinks.open_telemetry",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.stat_sinks.open_telemetry.v3.SinkConfig",
            "grpc_service": {
                "google_grpc": {"target_uri": target, "stat_prefix": "otlp_stats_sink"},
                "timeout": "5s"
            },
            "emit_tags_as_attributes": true,
            "use_tag_extracted_name": true,
            "report_counters_as_deltas": false,
            "report_histograms_as_deltas": false
        }
    }])
}

#[derive(Debug, thiserror::Error)]
pub enum ScrapeError {
    #[error("Envoy admin {addr}: {message}")]
    Admin { addr: SocketAddr, message: String },
    #[error("Envoy admin {addr}: answered {status}")]
    Status { addr: SocketAddr, status: u16 },
    #[error("Envoy's /stats/prometheus: {0}")]
    Exposition(#[from] exposition::ExpositionError),
}

/// The agent's copy of Envoy's request metrics, and a prometheus-client collector re-exposing them.
#[derive(Clone, Debug)]
pub struct EnvoyRequestMetrics {
    admin: SocketAddr,
    timeout: Duration,
    families: Arc<Mutex<Vec<Family>>>,
    /// `aether_agent_envoy_stats_failures_total`: Envoy's admin could not be read.
    pub failures: Counter,
}

impl EnvoyRequestMetrics {
    pub fn new(admin: SocketAddr, timeout: Duration) -> Self {
        Self {
            admin,
            timeout,
            families: Arc::default(),
            failures: Counter::default(),
        }
    }

    /// Reads Envoy's request metrics now (bounded by the timeout). On failure the last values stay (counters never
    /// go back) and the failure is counted.
    pub async fn refresh(&self) {
        match tokio::time::timeout(self.timeout, self.scrape()).await {
            Ok(Ok(families)) => *self.families.lock() = families,
            Ok(Err(error)) => {
                self.failures.inc();
                tracing::debug!(%error, "reading Envoy's request metrics failed");
            }
            Err(_) => {
                self.failures.inc();
                tracing::debug!(admin = %self.admin, "reading Envoy's request metrics timed out");
            }
        }
    }

    async fn scrape(&self) -> Result<Vec<Family>, ScrapeError> {
        let path = format!("/stats/prometheus?usedonly&filter={}", percent_encode(ENVOY_FILTER));
        let body = admin_get(self.admin, &path).await?;
        let families = exposition::parse(&body, Format::Prometheus)?;
        Ok(families
            .into_iter()
            .filter(|f| f.name == REQUESTS || f.name == REQUEST_TIME || is_l7(&f.name))
            .collect())
    }
}

fn percent_encode(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// `GET path` over HTTP/1.1 with `Connection: close`; returns the body.
async fn admin_get(addr: SocketAddr, path: &str) -> Result<String, ScrapeError> {
    let fail = |message: String| ScrapeError::Admin { addr, message };
    let mut stream = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| fail(format!("connect: {e}")))?;
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    stream
        .write_all(request.as_bytes())
        .await
        .map_err(|e| fail(format!("write: {e}")))?;
    let mut response = Vec::new();
    stream
        .read_to_end(&mut response)
        .await
        .map_err(|e| fail(format!("read: {e}")))?;
    let split = response
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| fail("malformed response".into()))?;
    let head = String::from_utf8_lossy(&response[..split]).to_ascii_lowercase();
    let status: u16 = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| fail("bad status line".into()))?;
    if status != 200 {
        return Err(ScrapeError::Status { addr, status });
    }
    let body = &response[split + 4..];
    let chunked = head
        .lines()
        .any(|l| l.starts_with("transfer-encoding:") && l.contains("chunked"));
    let body = if chunked {
        dechunk(body).ok_or_else(|| fail("bad chunked body".into()))?
    } else {
        body.to_vec()
    };
    String::from_utf8(body).map_err(|_| fail("body is not UTF-8".into()))
}

fn dechunk(mut input: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let end = input.windows(2).position(|w| w == b"\r\n")?;
        let size =
            usize::from_str_radix(std::str::from_utf8(&input[..end]).ok()?.split(';').next()?.trim(), 16).ok()?;
        input = &input[end + 2..];
        if size == 0 {
            return Some(out);
        }
        out.extend_from_slice(input.get(..size)?);
        input = input.get(size + 2..)?;
    }
}

/// Labels kept from Envoy's tags, renamed.
fn request_labels(sample_labels: &[(String, String)]) -> Vec<(String, String)> {
    let get = |k: &str| {
        sample_labels
            .iter()
            .find(|(name, _)| name == k)
            .map(|(_, v)| v.clone())
            .unwrap_or_default()
    };
    vec![
        ("source_workload".into(), get("source_workload")),
        ("destination_service".into(), get("destination_service")),
        ("destination_port".into(), get("destination_port")),
    ]
}

impl prometheus_client::collector::Collector for EnvoyRequestMetrics {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let families = self.families.lock().clone();
        if let Some(requests) = families.iter().find(|f| f.name == REQUESTS && f.kind == Kind::Counter) {
            let mut metric = encoder.encode_descriptor(
                "aether_proxy_requests",
                "Requests between mesh workloads seen by the node's Envoy (source side), by source workload, \
                 destination service and port, response code and class",
                None,
                MetricType::Counter,
            )?;
            for sample in &requests.samples {
                let code = sample.label("envoy_response_code").unwrap_or_default().to_owned();
                let class = code.chars().next().map(|c| format!("{c}xx")).unwrap_or_default();
                let mut labels = request_labels(&sample.labels);
                labels.push(("response_code".into(), code));
                labels.push(("response_code_class".into(), class));
                ConstCounter::new(sample.value as u64).encode(metric.encode_family(&labels)?)?;
            }
        }
        if let Some(time) = families
            .iter()
            .find(|f| f.name == REQUEST_TIME && f.kind == Kind::Histogram)
        {
            let unit = Unit::Seconds;
            let mut metric = encoder.encode_descriptor(
                "aether_proxy_request_duration",
                "Latency of requests between mesh workloads (source side, Envoy's upstream_rq_time), by source \
                 workload, destination service and port",
                Some(&unit),
                MetricType::Histogram,
            )?;
            for series in exposition::histogram_series(time) {
                let mut previous = 0.0;
                let buckets: Vec<(f64, u64)> = series
                    .buckets
                    .iter()
                    .map(|(le, cumulative)| {
                        let count = (cumulative - previous).max(0.0) as u64;
                        previous = *cumulative;
                        // Envoy records milliseconds.
                        (if le.is_finite() { le / 1000.0 } else { *le }, count)
                    })
                    .collect();
                let labels = request_labels(&series.labels);
                metric
                    .encode_family(&labels)?
                    .encode_histogram::<prometheus_client::encoding::NoLabelSet>(
                        series.sum.unwrap_or(0.0) / 1000.0,
                        series.count.unwrap_or(previous) as u64,
                        &buckets,
                        None,
                    )?;
            }
        }
        encode_l7(&families, &mut encoder)
    }
}

/// The L7 trees' counters ([`L7_FAMILIES`]); a family with no samples yet is left out.
fn encode_l7(families: &[Family], encoder: &mut DescriptorEncoder) -> Result<(), std::fmt::Error> {
    for ours in &L7_FAMILIES {
        let mut samples = Vec::new();
        for (envoy, value) in ours.from {
            let family = families.iter().find(|f| f.name == *envoy && f.kind == Kind::Counter);
            for sample in family.into_iter().flat_map(|f| &f.samples) {
                let destination = sample.label("l7_destination").unwrap_or_default();
                let (service, port) = destination.rsplit_once('|').unwrap_or((destination, ""));
                let mut labels = vec![
                    ("destination_service".to_owned(), service.to_owned()),
                    ("destination_port".to_owned(), port.to_owned()),
                ];
                if let Some(command) = sample.label("redis_command") {
                    labels.push(("command".into(), command.to_owned()));
                }
                labels.push((ours.label.to_owned(), (*value).to_owned()));
                samples.push((labels, sample.value as u64));
            }
        }
        if samples.is_empty() {
            continue;
        }
        let mut metric = encoder.encode_descriptor(ours.name, ours.help, None, MetricType::Counter)?;
        for (labels, value) in samples {
            ConstCounter::new(value).encode(metric.encode_family(&labels)?)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::registry::Registry;

    #[test]
    fn names_are_single_segments() {
        assert_eq!(cluster_stat_name("demo/b", 80), "demo/b|80");
        assert_eq!(cluster_stat_name("demo/b.x", 80), "demo/b_x|80");
        assert_eq!(source_stat_value("demo/a"), "mesh.demo/a");
        assert_eq!(authority_stat_name("b.demo.aether.internal:8080", 8080), "demo/b|8080");
        assert_eq!(authority_stat_name("b.demo.aether.internal", 80), "demo/b|80");
        assert_eq!(authority_stat_name("b.demo.aether.internal", 0), "demo/b|default");
        assert_eq!(authority_stat_name("weird", 0), "weird|default");
    }

    #[test]
    fn names_split_into_the_segments_the_tags_expect() {
        let name = format!(
            "cluster.{}.{}.upstream_rq_200",
            cluster_stat_name("demo/b", 80),
            source_stat_value("demo/a")
        );
        let parts: Vec<&str> = name.split('.').collect();
        assert_eq!(parts, ["cluster", "demo/b|80", "mesh", "demo/a", "upstream_rq_200"]);
        let json = stats_config_json();
        assert_eq!(json["stats_tags"].as_array().unwrap().len(), STATS_TAGS.len());
        assert_eq!(stats_sinks_json(None), serde_json::json!([]));
        assert_eq!(
            stats_sinks_json(Some("http://127.0.0.1:4317"))[0]["typed_config"]["grpc_service"]["google_grpc"]["target_uri"],
            "127.0.0.1:4317"
        );
    }

    #[test]
    fn the_shipped_bootstrap_carries_the_stats_tags() {
        let template = include_str!("../../proxy/bootstrap.yaml");
        for (name, regex) in STATS_TAGS {
            assert!(
                template.contains(&format!("- tag_name: {name}\n      regex: '{regex}'")),
                "{name}: {regex}"
            );
        }
    }

    #[test]
    fn envoy_request_metrics_are_re_exposed() {
        let text = "# TYPE envoy_cluster_mesh_upstream_rq counter\n\
            envoy_cluster_mesh_upstream_rq{envoy_response_code=\"200\",envoy_cluster_name=\"demo/b|80\",source_workload=\"demo/a\",destination_service=\"demo/b\",destination_port=\"80\"} 7\n\
            # TYPE envoy_cluster_mesh_upstream_rq_time histogram\n\
            envoy_cluster_mesh_upstream_rq_time_bucket{source_workload=\"demo/a\",destination_service=\"demo/b\",destination_port=\"80\",le=\"0.5\"} 1\n\
            envoy_cluster_mesh_upstream_rq_time_bucket{source_workload=\"demo/a\",destination_service=\"demo/b\",destination_port=\"80\",le=\"5\"} 7\n\
            envoy_cluster_mesh_upstream_rq_time_bucket{source_workload=\"demo/a\",destination_service=\"demo/b\",destination_port=\"80\",le=\"+Inf\"} 7\n\
            envoy_cluster_mesh_upstream_rq_time_sum{source_workload=\"demo/a\",destination_service=\"demo/b\",destination_port=\"80\"} 14\n\
            envoy_cluster_mesh_upstream_rq_time_count{source_workload=\"demo/a\",destination_service=\"demo/b\",destination_port=\"80\"} 7\n";
        let stats = EnvoyRequestMetrics::new("127.0.0.1:1".parse().unwrap(), Duration::from_secs(1));
        *stats.families.lock() = exposition::parse(text, Format::Prometheus).unwrap();
        let mut registry = Registry::default();
        registry.register_collector(Box::new(stats));
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &registry).unwrap();
        let families = exposition::parse(&out, Format::OpenMetrics).unwrap();
        assert!(
            out.contains(
                "aether_proxy_requests_total{source_workload=\"demo/a\",destination_service=\"demo/b\",\
             destination_port=\"80\",response_code=\"200\",response_code_class=\"2xx\"} 7"
            ),
            "{out}"
        );
        let series = exposition::histogram_series(&families[1]);
        assert_eq!(families[1].name, "aether_proxy_request_duration_seconds");
        assert_eq!(
            series[0].buckets,
            vec![(0.0005, 1.0), (0.005, 7.0), (f64::INFINITY, 7.0)]
        );
        assert_eq!(series[0].sum, Some(0.014));
    }

    #[test]
    fn envoy_l7_counters_are_re_exposed_by_destination() {
        let text = "# TYPE envoy_thrift_request_call counter\n\
            envoy_thrift_request_call{l7_destination=\"demo/calc|9090\"} 9\n\
            # TYPE envoy_redis_command_success counter\n\
            envoy_redis_command_success{l7_destination=\"demo/cache|6379\",redis_command=\"get\"} 2\n\
            # TYPE envoy_dubbo_request_decoding_error counter\n\
            envoy_dubbo_request_decoding_error{l7_destination=\"demo/rpc|20880\"} 1\n";
        let stats = EnvoyRequestMetrics::new("127.0.0.1:1".parse().unwrap(), Duration::from_secs(1));
        *stats.families.lock() = exposition::parse(text, Format::Prometheus).unwrap();
        let mut registry = Registry::default();
        registry.register_collector(Box::new(stats));
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &registry).unwrap();
        exposition::parse(&out, Format::OpenMetrics).unwrap();
        for line in [
            "aether_proxy_thrift_requests_total{destination_service=\"demo/calc\",destination_port=\"9090\",message_type=\"call\"} 9",
            "aether_proxy_redis_commands_total{destination_service=\"demo/cache\",destination_port=\"6379\",command=\"get\",outcome=\"success\"} 2",
            "aether_proxy_protocol_errors_total{destination_service=\"demo/rpc\",destination_port=\"20880\",protocol=\"dubbo\"} 1",
        ] {
            assert!(out.lines().any(|l| l == line), "{line}\n{out}");
        }
        assert!(
            !out.contains("aether_proxy_dubbo_requests"),
            "no samples, no family: {out}"
        );
    }
}
