//! The last failed calls of each local pod, for `aether explain`: every outbound HTTP
//! chain ships the requests that failed (status ≥ 400, or any Envoy response flag) to
//! the agent with Envoy's gRPC access logger over the xDS socket's cluster, and the
//! agent keeps a short ring per pod. Successful requests are never shipped, so the happy
//! path costs nothing; a node under a storm of failures costs one small gRPC message per
//! failure, batched by Envoy every 100 ms.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use envoy_types::pb::envoy::config::accesslog::v3::{
    AccessLog, AccessLogFilter, ComparisonFilter, OrFilter, ResponseFlagFilter, StatusCodeFilter, access_log,
    access_log_filter, comparison_filter,
};
use envoy_types::pb::envoy::config::core::v3::{ApiVersion, GrpcService, RuntimeUInt32, grpc_service};
use envoy_types::pb::envoy::data::accesslog::v3::{HttpAccessLogEntry, ResponseFlags};
use envoy_types::pb::envoy::extensions::access_loggers::grpc::v3::{
    CommonGrpcAccessLogConfig, HttpGrpcAccessLogConfig,
};
use envoy_types::pb::envoy::service::accesslog::v3::access_log_service_server::{
    AccessLogService, AccessLogServiceServer,
};
use envoy_types::pb::envoy::service::accesslog::v3::{
    StreamAccessLogsMessage, StreamAccessLogsResponse, stream_access_logs_message,
};
use envoy_types::pb::envoy::r#type::tracing::v3::{CustomTag, custom_tag};
use parking_lot::Mutex;
use serde::Serialize;
use tokio_stream::StreamExt;
use tonic::{Request, Response, Status, Streaming};

use envoy_types::pb::envoy::config::core::v3::{Address, address};
use envoy_types::pb::google::protobuf::{Any, Duration as ProtoDuration};

pub mod decisions;
pub use decisions::Decisions;

/// The bootstrap's cluster of the agent's xDS socket (`proxy/bootstrap.yaml`).
pub const AGENT_CLUSTER: &str = "aether_xds";
/// The custom tag naming the calling pod (`<ns>/<name>`).
pub(crate) const SOURCE_TAG: &str = "source_pod";
/// Failures kept per pod, newest last.
const PER_POD: usize = 32;
/// Pods with a ring; a pod beyond that evicts the one that failed least recently.
const MAX_PODS: usize = 1024;

/// One failed call as Envoy logged it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Failure {
    /// When the request started, in milliseconds since the Unix epoch.
    pub at_ms: u64,
    pub method: String,
    pub authority: String,
    pub path: String,
    /// 0 when no response was sent (a reset).
    pub status: u32,
    /// Envoy's response flags in their short form (`UH`, `UF`, `URX`, …), comma-separated.
    pub flags: String,
    /// Envoy's one-word reason for the response (`route_not_found`, `via_upstream`, …).
    pub details: String,
    /// The route rule's name (`http/<ns>/<route>/<rule>`) when one matched.
    pub route: String,
    pub upstream_cluster: String,
    pub upstream_host: String,
    /// Why the upstream connection failed, e.g. a TLS SAN mismatch.
    pub upstream_failure: String,
    pub duration_ms: u64,
}

impl Failure {
    /// Whether the call was to one of `names`, by its authority or its cluster (a host
    /// with or without port; `<svc>.<ns>.svc` also stands for its longer forms).
    pub fn is_to(&self, names: &[String]) -> bool {
        let host = |s: &str| s.rsplit_once(':').map_or(s, |(h, _)| h).to_owned();
        let longer = |h: &str, n: &str| n.ends_with(".svc") && h.starts_with(&format!("{n}."));
        let named = |h: String| names.iter().any(|n| h == *n || longer(&h, n));
        named(host(&self.authority)) || named(host(&self.upstream_cluster))
    }
}

/// The rings of recent failures, shared by the access-log sink and the debug pages.
#[derive(Clone, Default)]
pub struct RecentFailures(Arc<Mutex<Rings>>);

#[derive(Default)]
struct Rings {
    by_pod: HashMap<String, VecDeque<Failure>>,
    /// Pods by last failure, oldest first (eviction order).
    order: VecDeque<String>,
}

impl RecentFailures {
    pub fn record(&self, pod: &str, failure: Failure) {
        let mut rings = self.0.lock();
        rings.order.retain(|p| p != pod);
        rings.order.push_back(pod.to_owned());
        if rings.order.len() > MAX_PODS
            && let Some(oldest) = rings.order.pop_front()
        {
            rings.by_pod.remove(&oldest);
        }
        let ring = rings.by_pod.entry(pod.to_owned()).or_default();
        if ring.len() == PER_POD {
            ring.pop_front();
        }
        ring.push_back(failure);
    }

    /// The pod's recent failures to `names`, newest first.
    pub fn of(&self, pod: &str, names: &[String]) -> Vec<Failure> {
        let rings = self.0.lock();
        let ring = rings.by_pod.get(pod).into_iter().flatten();
        ring.rev().filter(|f| f.is_to(names)).cloned().collect()
    }
}

/// The logger of a pod's outbound HTTP chains, tagged with the pod: failures, and the
/// authorization decisions on its calls to external services (the egress RBAC results
/// `egress_logged`, see `decisions::egress_shipping`).
pub fn logger(pod_id: &str, egress_logged: &[String]) -> AccessLog {
    let mut common = common_config("aether_outbound", &[(SOURCE_TAG, pod_id)]);
    let egress = decisions::egress_shipping(egress_logged, &mut common);
    let shipped = AccessLogFilter {
        filter_specifier: Some(access_log_filter::FilterSpecifier::OrFilter(OrFilter {
            filters: [
                AccessLogFilter {
                    filter_specifier: Some(access_log_filter::FilterSpecifier::StatusCodeFilter(StatusCodeFilter {
                        comparison: Some(ComparisonFilter {
                            op: comparison_filter::Op::Ge as i32,
                            value: Some(RuntimeUInt32 {
                                default_value: 400,
                                runtime_key: "aether.failure_log.min_status".into(),
                            }),
                        }),
                    })),
                },
                // No flags listed: any response flag.
                AccessLogFilter {
                    filter_specifier: Some(access_log_filter::FilterSpecifier::ResponseFlagFilter(
                        ResponseFlagFilter::default(),
                    )),
                },
            ]
            .into_iter()
            .chain(egress)
            .collect(),
        })),
    };
    let config = HttpGrpcAccessLogConfig {
        common_config: Some(common),
        ..Default::default()
    };
    AccessLog {
        name: "envoy.access_loggers.http_grpc".into(),
        filter: Some(shipped),
        config_type: Some(access_log::ConfigType::TypedConfig(Any {
            type_url: <HttpGrpcAccessLogConfig as prost::Name>::type_url(),
            value: prost::Message::encode_to_vec(&config),
        })),
    }
}

/// Envoy's gRPC logger config: to the agent over the xDS socket's cluster, batched
/// every 100 ms, each entry with the custom `tags` (name, value).
fn common_config(log_name: &str, tags: &[(&str, &str)]) -> CommonGrpcAccessLogConfig {
    CommonGrpcAccessLogConfig {
        log_name: log_name.into(),
        grpc_service: Some(GrpcService {
            target_specifier: Some(grpc_service::TargetSpecifier::EnvoyGrpc(grpc_service::EnvoyGrpc {
                cluster_name: AGENT_CLUSTER.into(),
                ..Default::default()
            })),
            ..Default::default()
        }),
        transport_api_version: ApiVersion::V3 as i32,
        buffer_flush_interval: Some(ProtoDuration {
            seconds: 0,
            nanos: 100_000_000,
        }),
        custom_tags: tags
            .iter()
            .map(|(tag, value)| CustomTag {
                tag: (*tag).into(),
                r#type: Some(custom_tag::Type::Literal(custom_tag::Literal {
                    value: (*value).into(),
                })),
            })
            .collect(),
        ..Default::default()
    }
}

/// Receives Envoy's access-log streams: failed calls into the rings, authorization
/// decisions into their log and counters.
pub struct Sink {
    failures: RecentFailures,
    decisions: Decisions,
}

/// The gRPC service Envoy's access loggers stream to.
pub fn service(failures: RecentFailures, decisions: Decisions) -> AccessLogServiceServer<Sink> {
    AccessLogServiceServer::new(Sink { failures, decisions })
}

#[tonic::async_trait]
impl AccessLogService for Sink {
    async fn stream_access_logs(
        &self,
        request: Request<Streaming<StreamAccessLogsMessage>>,
    ) -> Result<Response<StreamAccessLogsResponse>, Status> {
        let mut stream = request.into_inner();
        while let Some(message) = stream.next().await {
            match message?.log_entries {
                Some(stream_access_logs_message::LogEntries::HttpLogs(logs)) => {
                    for entry in logs.log_entry {
                        // An outbound entry may be both: a call to an external service
                        // that its policies denied.
                        if let Some(decisions) = decisions::decisions_of(&entry) {
                            decisions.into_iter().for_each(|d| self.decisions.record(d));
                        }
                        if let Some((pod, failure)) = failure_of(entry) {
                            self.failures.record(&pod, failure);
                        }
                    }
                }
                Some(stream_access_logs_message::LogEntries::TcpLogs(logs)) => {
                    let decisions = logs.log_entry.iter().filter_map(decisions::tcp_decisions_of);
                    decisions.flatten().for_each(|d| self.decisions.record(d));
                }
                None => {}
            }
        }
        Ok(Response::new(StreamAccessLogsResponse {}))
    }
}

/// The calling pod and the failure, from one entry; `None` for an entry without our tag.
fn failure_of(entry: HttpAccessLogEntry) -> Option<(String, Failure)> {
    let common = entry.common_properties.unwrap_or_default();
    let pod = common.custom_tags.get(SOURCE_TAG)?.clone();
    let request = entry.request.unwrap_or_default();
    let response = entry.response.unwrap_or_default();
    let at = common.start_time.map_or(UNIX_EPOCH, |t| {
        UNIX_EPOCH + Duration::new(t.seconds.max(0) as u64, t.nanos.max(0) as u32)
    });
    let duration = common.duration.map_or(Duration::ZERO, |d| {
        Duration::new(d.seconds.max(0) as u64, d.nanos.max(0) as u32)
    });
    let method = envoy_types::pb::envoy::config::core::v3::RequestMethod::try_from(request.request_method)
        .map_or_else(|_| "?".into(), |m| m.as_str_name().to_owned());
    let failure = Failure {
        at_ms: at.duration_since(UNIX_EPOCH).unwrap_or_default().as_millis() as u64,
        method,
        authority: bounded(&request.authority),
        path: bounded(&request.path),
        status: response.response_code.map_or(0, |c| c.value),
        flags: short_flags(&common.response_flags.unwrap_or_default()),
        details: bounded(&response.response_code_details),
        route: bounded(&common.route_name),
        upstream_cluster: common.upstream_cluster,
        upstream_host: common.upstream_remote_address.map(|a| ip_port(&a)).unwrap_or_default(),
        upstream_failure: bounded(&common.upstream_transport_failure_reason),
        duration_ms: duration.as_millis() as u64,
    };
    // Shipped for a decision only (an audited or dry-run-denied call that went well).
    let failed = failure.status >= 400 || !failure.flags.is_empty();
    failed.then_some((pod, failure))
}

/// What a client sent (or Envoy said of it), kept and shown bounded: a ring of long URLs
/// would hold their whole size per pod.
fn bounded(text: &str) -> String {
    aether_common::quote::clip(text).to_string()
}

fn ip_port(address: &Address) -> String {
    match &address.address {
        Some(address::Address::SocketAddress(s)) => match &s.port_specifier {
            Some(envoy_types::pb::envoy::config::core::v3::socket_address::PortSpecifier::PortValue(port)) => {
                format!("{}:{port}", s.address)
            }
            _ => s.address.clone(),
        },
        _ => String::new(),
    }
}

/// The flags in Envoy's access-log short form (as `%RESPONSE_FLAGS%` prints them).
fn short_flags(f: &ResponseFlags) -> String {
    let flags = [
        (f.failed_local_healthcheck, "LH"),
        (f.no_healthy_upstream, "UH"),
        (f.upstream_request_timeout, "UT"),
        (f.local_reset, "LR"),
        (f.upstream_remote_reset, "UR"),
        (f.upstream_connection_failure, "UF"),
        (f.upstream_connection_termination, "UC"),
        (f.upstream_overflow, "UO"),
        (f.no_route_found, "NR"),
        (f.delay_injected, "DI"),
        (f.fault_injected, "FI"),
        (f.rate_limited, "RL"),
        (f.unauthorized_details.is_some(), "UAEX"),
        (f.rate_limit_service_error, "RLSE"),
        (f.downstream_connection_termination, "DC"),
        (f.upstream_retry_limit_exceeded, "URX"),
        (f.stream_idle_timeout, "SI"),
        (f.invalid_envoy_request_headers, "IH"),
        (f.downstream_protocol_error, "DPE"),
        (f.upstream_max_stream_duration_reached, "UMSDR"),
        (f.response_from_cache_filter, "RFCF"),
        (f.no_filter_config_found, "NFCF"),
        (f.duration_timeout, "DT"),
        (f.upstream_protocol_error, "UPE"),
        (f.no_cluster_found, "NC"),
        (f.overload_manager, "OM"),
        (f.dns_resolution_failure, "DF"),
        (f.downstream_remote_reset, "DR"),
    ];
    let set: Vec<&str> = flags.iter().filter(|(on, _)| *on).map(|(_, name)| *name).collect();
    set.join(",")
}

/// Seconds since `at_ms`, for humans.
pub fn age(at_ms: u64, now: SystemTime) -> Duration {
    let at = UNIX_EPOCH + Duration::from_millis(at_ms);
    now.duration_since(at).unwrap_or_default()
}

#[cfg(test)]
mod tests;
