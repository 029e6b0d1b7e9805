//! Authorization decisions worth a line (proposals/013, Observability): each pod's
//! inbound HTTP chain ships the requests its RBAC filters denied, and the ones an AUDIT
//! policy or a dry-run policy matched, to the agent with Envoy's gRPC access logger. The
//! agent logs one line per decision (policy `ns/name`, rule, source SPIFFE ID,
//! destination pod and port) and counts them per policy and rule. Allowed requests are
//! never shipped; Envoy counts them per rule itself (`track_per_rule_stats`).

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::UNIX_EPOCH;

use envoy_types::pb::envoy::config::accesslog::v3::{
    AccessLog, AccessLogFilter, AndFilter, ExtensionFilter, MetadataFilter, OrFilter, access_log, access_log_filter,
    extension_filter,
};
use envoy_types::pb::envoy::config::core::v3::Metadata;
use envoy_types::pb::envoy::data::accesslog::v3::tls_properties::certificate_properties::subject_alt_name;
use envoy_types::pb::envoy::data::accesslog::v3::{AccessLogCommon, HttpAccessLogEntry, TcpAccessLogEntry};
use envoy_types::pb::envoy::extensions::access_loggers::filters::cel::v3::ExpressionFilter;
use envoy_types::pb::envoy::extensions::access_loggers::grpc::v3::{HttpGrpcAccessLogConfig, TcpGrpcAccessLogConfig};
use envoy_types::pb::envoy::r#type::matcher::v3::{
    MetadataMatcher, StringMatcher, ValueMatcher, metadata_matcher, string_matcher, value_matcher,
};
use envoy_types::pb::envoy::r#type::metadata::v3::{MetadataKey, MetadataKind, metadata_key, metadata_kind};
use envoy_types::pb::envoy::r#type::tracing::v3::{CustomTag, custom_tag};
use envoy_types::pb::google::protobuf::{Any, BoolValue, Struct, Value, value};
use parking_lot::Mutex;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use serde::Serialize;

use super::{bounded, common_config, ip_port};
use crate::xds::resources::authorization::{HTTP_METADATA, NO_MATCH};
use crate::xds::resources::transport::SOURCE_IDENTITY;
use envoy_types::pb::envoy::extensions::access_loggers::grpc::v3::CommonGrpcAccessLogConfig;

/// The custom tag naming the destination pod (`<ns>/<name>`).
pub const DESTINATION_TAG: &str = "destination_pod";
/// The custom tag naming the calling pod of a call to an external service (the outbound
/// logger's).
const EGRESS_TAG: &str = super::SOURCE_TAG;
/// The custom tag naming the external service and port called (`<ns>/<name>|<port>`),
/// read from the route's metadata ([`egress_route_metadata`]).
const EGRESS_DESTINATION_TAG: &str = "egress_destination";
/// The custom tag of a chain to an external stream port: what was decided for its
/// connections, `<verdict>=<policy id>` comma-separated.
const EGRESS_VERDICTS_TAG: &str = "egress_verdicts";
const EGRESS_METADATA: &str = "aether";
const EGRESS_METADATA_KEY: &str = "egress";
/// The custom tag naming the app port a TCP chain delivers to.
const PORT_TAG: &str = "destination_port";
/// Where Envoy's network RBAC filter writes its shadow verdicts.
const NETWORK_METADATA: &str = "envoy.filters.network.rbac";
/// How Envoy's RBAC filters begin the details of a denial.
const RBAC_DENIED: &str = "rbac_access_denied";
/// Decisions kept for the debug pages, newest last.
const RECENT: usize = 256;

/// What a decision was.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    /// Refused (403).
    Deny,
    /// Allowed, and an AUDIT policy matched.
    Audit,
    /// Allowed, but it would be denied were the dry-run policies enforced.
    DryRunDeny,
}

impl Verdict {
    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::Deny => "deny",
            Verdict::Audit => "audit",
            Verdict::DryRunDeny => "dry_run_deny",
        }
    }
}

/// One decision as Envoy logged it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Decision {
    pub at_ms: u64,
    pub verdict: Verdict,
    /// `<ns>/<name>` of the policy that decided; empty when no ALLOW policy matched.
    pub policy: String,
    /// The rule's index in the policy, when one matched.
    pub rule: Option<u32>,
    /// The caller's SPIFFE ID, or its address without mTLS.
    pub source: String,
    /// The destination pod, `<ns>/<name>`; for a call to an external service, the calling pod.
    pub pod: String,
    /// For a call to an external service, that service (`<ns>/<name>`); empty otherwise.
    pub service: String,
    /// The app port the request was for (0: unknown).
    pub port: u16,
    pub method: String,
    pub path: String,
}

impl Decision {
    /// `policy ns/name rule 2`, or what stood in for a policy.
    pub fn decided_by(&self) -> String {
        match (self.policy.is_empty(), self.rule) {
            (true, _) if !self.service.is_empty() => format!("no ALLOW policy guarding {} matched", self.service),
            (true, _) => "no ALLOW policy selecting the pod matched".to_owned(),
            (false, Some(rule)) => format!("policy {} rule {rule}", self.policy),
            (false, None) => format!("policy {}", self.policy),
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Labels {
    pod: String,
    policy: String,
    rule: String,
    decision: String,
}

/// Decisions counted and the last ones kept, shared by the access-log sink, the metrics
/// and the debug pages.
#[derive(Clone, Default)]
pub struct Decisions {
    counts: Family<Labels, Counter>,
    recent: Arc<Mutex<VecDeque<Decision>>>,
}

impl Decisions {
    pub fn register(&self, metrics: &mut prometheus_client::registry::Registry) {
        metrics.register(
            "authorization_decisions",
            "Requests denied, audited, or denied were dry-run policies enforced, by destination pod, policy and rule (allowed ones are Envoy's per-rule RBAC counters)",
            self.counts.clone(),
        );
    }

    pub fn record(&self, decision: Decision) {
        let rule = decision.rule.map(|r| r.to_string()).unwrap_or_default();
        tracing::info!(
            verdict = decision.verdict.as_str(),
            policy = %decision.policy,
            rule = %rule,
            source = %decision.source,
            pod = %decision.pod,
            service = %decision.service,
            port = decision.port,
            method = %decision.method,
            path = %decision.path,
            "authorization: {}",
            decision.decided_by()
        );
        let labels = Labels {
            pod: decision.pod.clone(),
            policy: decision.policy.clone(),
            rule,
            decision: decision.verdict.as_str().to_owned(),
        };
        self.counts.get_or_create(&labels).inc();
        let mut recent = self.recent.lock();
        if recent.len() == RECENT {
            recent.pop_front();
        }
        recent.push_back(decision);
    }

    /// The decisions on requests to `pod`, newest first.
    pub fn of(&self, pod: &str) -> Vec<Decision> {
        let recent = self.recent.lock();
        let to_pod = |d: &&Decision| d.pod == pod && d.service.is_empty();
        recent.iter().rev().filter(to_pod).cloned().collect()
    }

    /// The decisions on `pod`'s calls to the external service `service`, newest first.
    pub fn of_egress(&self, pod: &str, service: &str) -> Vec<Decision> {
        let recent = self.recent.lock();
        let from_pod = |d: &&Decision| d.pod == pod && d.service == service;
        recent.iter().rev().filter(from_pod).cloned().collect()
    }
}

/// The logger of a pod's inbound HTTP chain: a request is shipped when one of the RBAC
/// results under `logged` (metadata keys, see `authorization::Filters::logged`) is `denied`.
pub fn logger(pod_id: &str, logged: &[String]) -> AccessLog {
    let filters = logged.iter().map(|key| denied(HTTP_METADATA, key)).collect();
    let config = HttpGrpcAccessLogConfig {
        common_config: Some(common_config("aether_authorization", &[(DESTINATION_TAG, pod_id)])),
        ..Default::default()
    };
    grpc_logger("envoy.access_loggers.http_grpc", any_of(filters), any(&config))
}

/// The logger of a pod's inbound listener for its TCP chain, which delivers to `port`: a
/// connection is shipped when the network RBAC closed it (Envoy names the policy in the
/// connection's termination details), or one of the shadow results under `logged` is
/// `denied` (an AUDIT match, a dry-run denial).
pub fn tcp_logger(pod_id: &str, port: u16, logged: &[String]) -> AccessLog {
    let closed = cel(&format!("connection.termination_details.startsWith('{RBAC_DENIED}')"));
    let shadow = logged.iter().filter(|k| k.ends_with("shadow_engine_result"));
    let filters = std::iter::once(closed).chain(shadow.map(|key| denied(NETWORK_METADATA, key)));
    let port = port.to_string();
    let tags = [(DESTINATION_TAG, pod_id), (PORT_TAG, port.as_str())];
    let config = TcpGrpcAccessLogConfig {
        common_config: Some(common_config("aether_authorization", &tags)),
    };
    grpc_logger("envoy.access_loggers.tcp_grpc", any_of(filters.collect()), any(&config))
}

/// [`tcp_logger`] for the listener itself, for a chain whose terminal filter has no access
/// log of its own (Redis): the listener logs every connection when it closes, so this one
/// keeps those of the chain named `chain`.
pub fn tcp_chain_logger(pod_id: &str, port: u16, logged: &[String], chain: &str) -> AccessLog {
    let mut logger = tcp_logger(pod_id, port, logged);
    let of_chain = cel(&format!("xds.filter_chain_name == '{chain}'"));
    logger.filter = Some(AccessLogFilter {
        filter_specifier: Some(access_log_filter::FilterSpecifier::AndFilter(AndFilter {
            filters: [Some(of_chain), logger.filter].into_iter().flatten().collect(),
        })),
    });
    logger
}

/// Envoy's CEL access-log filter.
fn cel(expression: &str) -> AccessLogFilter {
    let filter = ExpressionFilter {
        expression: expression.to_owned(),
        ..Default::default()
    };
    AccessLogFilter {
        filter_specifier: Some(access_log_filter::FilterSpecifier::ExtensionFilter(ExtensionFilter {
            name: "envoy.access_loggers.extension_filters.cel".into(),
            config_type: Some(extension_filter::ConfigType::TypedConfig(any(&filter))),
        })),
    }
}

fn grpc_logger(name: &str, filter: Option<AccessLogFilter>, config: Any) -> AccessLog {
    AccessLog {
        name: name.into(),
        filter,
        config_type: Some(access_log::ConfigType::TypedConfig(config)),
    }
}

/// One filter, or an OR of several (Envoy's OR takes two or more).
fn any_of(mut filters: Vec<AccessLogFilter>) -> Option<AccessLogFilter> {
    match filters.len() {
        0 | 1 => filters.pop(),
        _ => Some(AccessLogFilter {
            filter_specifier: Some(access_log_filter::FilterSpecifier::OrFilter(OrFilter { filters })),
        }),
    }
}

fn any<T: prost::Name>(message: &T) -> Any {
    Any {
        type_url: T::type_url(),
        value: prost::Message::encode_to_vec(message),
    }
}

/// Whether the RBAC result `key` (under the metadata namespace `filter`) is `denied`.
fn denied(filter: &str, key: &str) -> AccessLogFilter {
    let matcher = MetadataMatcher {
        filter: filter.into(),
        path: vec![metadata_matcher::PathSegment {
            segment: Some(metadata_matcher::path_segment::Segment::Key(key.into())),
        }],
        value: Some(ValueMatcher {
            match_pattern: Some(value_matcher::MatchPattern::StringMatch(StringMatcher {
                match_pattern: Some(string_matcher::MatchPattern::Exact("denied".into())),
                ..Default::default()
            })),
        }),
        invert: false,
    };
    AccessLogFilter {
        filter_specifier: Some(access_log_filter::FilterSpecifier::MetadataFilter(MetadataFilter {
            matcher: Some(matcher),
            match_if_key_not_found: Some(BoolValue { value: false }),
        })),
    }
}

/// What the outbound logger ([`super::logger`]) adds for calls to external services: it
/// also ships a request one of the egress RBAC results under `logged` says `denied` (the
/// filters, ORed with its own), names the caller's identity from the filter state its
/// listener set, and the external service from the route's metadata.
pub(super) fn egress_shipping(logged: &[String], common: &mut CommonGrpcAccessLogConfig) -> Vec<AccessLogFilter> {
    common.filter_state_objects_to_log = vec![SOURCE_IDENTITY.to_owned()];
    common.custom_tags.push(CustomTag {
        tag: EGRESS_DESTINATION_TAG.into(),
        r#type: Some(custom_tag::Type::Metadata(custom_tag::Metadata {
            kind: Some(MetadataKind {
                kind: Some(metadata_kind::Kind::Route(metadata_kind::Route {})),
            }),
            metadata_key: Some(MetadataKey {
                key: EGRESS_METADATA.into(),
                path: vec![metadata_key::PathSegment {
                    segment: Some(metadata_key::path_segment::Segment::Key(EGRESS_METADATA_KEY.into())),
                }],
            }),
            default_value: String::new(),
        })),
    });
    logged.iter().map(|key| denied(HTTP_METADATA, key)).collect()
}

/// The logger of a pod's chain to an external service's stream `port`: every connection
/// is shipped with what the policies decided for this pod there (`logged`, settled when
/// compiling: `authorization::egress::judge_streams`), as tags.
pub fn egress_tcp_logger(pod_id: &str, service: &str, port: u32, logged: &[(Verdict, String)]) -> AccessLog {
    let destination = format!("{service}|{port}");
    let verdicts: Vec<String> = logged.iter().map(|(v, id)| format!("{}={id}", v.as_str())).collect();
    let verdicts = verdicts.join(",");
    let tags = [
        (EGRESS_TAG, pod_id),
        (EGRESS_DESTINATION_TAG, destination.as_str()),
        (EGRESS_VERDICTS_TAG, verdicts.as_str()),
    ];
    let mut common = common_config("aether_authorization", &tags);
    common.filter_state_objects_to_log = vec![SOURCE_IDENTITY.to_owned()];
    let config = TcpGrpcAccessLogConfig {
        common_config: Some(common),
    };
    grpc_logger("envoy.access_loggers.tcp_grpc", None, any(&config))
}

/// The route metadata (filter `aether`, key `egress`) of an external service's routes,
/// `<ns>/<name>|<port>`, which [`egress_logger`] tags its entries with.
pub fn egress_route_metadata(service: &str, port: u32) -> Metadata {
    let destination = Value {
        kind: Some(value::Kind::StringValue(format!("{service}|{port}"))),
    };
    let fields = [(EGRESS_METADATA_KEY.to_owned(), destination)].into();
    Metadata {
        filter_metadata: [(EGRESS_METADATA.to_owned(), Struct { fields })].into(),
        ..Default::default()
    }
}

/// The decisions one HTTP entry carries: the enforced denial, AUDIT matches, and the
/// dry-run denial where there was no real one. `None` for an entry without our tag.
pub fn decisions_of(entry: &HttpAccessLogEntry) -> Option<Vec<Decision>> {
    let common = entry.common_properties.as_ref()?;
    if common.custom_tags.contains_key(EGRESS_TAG) {
        // The outbound logger's: decisions on calls to external services, if any.
        return egress_decisions_of(entry);
    }
    let request = entry.request.clone().unwrap_or_default();
    let base = Decision {
        port: common
            .route_name
            .strip_prefix("port-")
            .and_then(|p| p.parse().ok())
            .unwrap_or(0),
        method: envoy_types::pb::envoy::config::core::v3::RequestMethod::try_from(request.request_method)
            .map_or_else(|_| "?".into(), |m| m.as_str_name().to_owned()),
        path: bounded(&request.path),
        ..base(common)?
    };
    let results = Results::of(common, HTTP_METADATA, "");
    Some(judged(&base, &results, results.http_denial()))
}

/// The decisions of one call to an external service: as [`decisions_of`], the external
/// service and port from its route's metadata, the caller from its identity (or its pod
/// without one).
fn egress_decisions_of(entry: &HttpAccessLogEntry) -> Option<Vec<Decision>> {
    let common = entry.common_properties.as_ref()?;
    let request = entry.request.clone().unwrap_or_default();
    let base = Decision {
        method: envoy_types::pb::envoy::config::core::v3::RequestMethod::try_from(request.request_method)
            .map_or_else(|_| "?".into(), |m| m.as_str_name().to_owned()),
        path: bounded(&request.path),
        ..egress_base(common)?
    };
    let results = Results::of(common, HTTP_METADATA, EGRESS_PREFIX);
    Some(judged(&base, &results, results.http_denial()))
}

/// The decisions one TCP entry (a connection) carries, as for HTTP; the enforced denial
/// comes from the connection's termination details. `None` for an entry without our tag.
pub fn tcp_decisions_of(entry: &TcpAccessLogEntry) -> Option<Vec<Decision>> {
    let common = entry.common_properties.as_ref()?;
    if common.custom_tags.contains_key(EGRESS_TAG) {
        return egress_tcp_decisions_of(common);
    }
    let base = Decision {
        port: common
            .custom_tags
            .get(PORT_TAG)
            .and_then(|p| p.parse().ok())
            .unwrap_or(0),
        method: "TCP".into(),
        ..base(common)?
    };
    let results = Results::of(common, NETWORK_METADATA, "");
    let details = &common.connection_termination_details;
    let denial = details.strip_prefix(RBAC_DENIED).map(|rest| {
        let id = rest.strip_prefix("_matched_policy[").and_then(|r| r.strip_suffix(']'));
        id.unwrap_or_default().to_owned()
    });
    Some(judged(&base, &results, denial))
}

/// The decisions a connection to an external service's stream port carries: the ones its
/// chain was compiled with (the verdicts tag).
fn egress_tcp_decisions_of(common: &AccessLogCommon) -> Option<Vec<Decision>> {
    let base = Decision {
        method: "TCP".into(),
        ..egress_base(common)?
    };
    let verdicts = common.custom_tags.get(EGRESS_VERDICTS_TAG)?;
    let decisions = verdicts.split(',').filter_map(|entry| {
        let (verdict, id) = entry.split_once('=')?;
        let verdict = [Verdict::Deny, Verdict::Audit, Verdict::DryRunDeny]
            .into_iter()
            .find(|v| v.as_str() == verdict)?;
        let (policy, rule) = split_policy_id(id);
        Some(Decision {
            verdict,
            policy,
            rule,
            ..base.clone()
        })
    });
    Some(decisions.collect())
}

/// The fields of a decision on a call to an external service: the calling pod, its
/// identity (its pod without one), the service and port.
fn egress_base(common: &AccessLogCommon) -> Option<Decision> {
    let pod = common.custom_tags.get(EGRESS_TAG)?.clone();
    let destination = common
        .custom_tags
        .get(EGRESS_DESTINATION_TAG)
        .map_or("", String::as_str);
    let (service, port) = destination.rsplit_once('|').unwrap_or((destination, ""));
    let identity = common.filter_state_objects.get(SOURCE_IDENTITY).and_then(|any| {
        let value = <envoy_types::pb::google::protobuf::StringValue as prost::Message>::decode(&*any.value).ok()?;
        Some(bounded(&value.value))
    });
    Some(Decision {
        source: identity.unwrap_or_else(|| format!("pod {pod}")),
        pod,
        service: bounded(service),
        port: port.parse().unwrap_or(0),
        ..base_at(common)
    })
}

/// The decision fields every inbound entry of ours has: when, who called whom.
fn base(common: &AccessLogCommon) -> Option<Decision> {
    let pod = common.custom_tags.get(DESTINATION_TAG)?.clone();
    let peer = common
        .downstream_remote_address
        .as_ref()
        .map(ip_port)
        .unwrap_or_default();
    Some(Decision {
        source: spiffe_id(common).unwrap_or(peer),
        pod,
        ..base_at(common)
    })
}

/// A decision at the entry's start, its parties and request to be filled in.
fn base_at(common: &AccessLogCommon) -> Decision {
    Decision {
        at_ms: common.start_time.map_or(0, |t| {
            let at = UNIX_EPOCH + std::time::Duration::new(t.seconds.max(0) as u64, t.nanos.max(0) as u32);
            at.duration_since(UNIX_EPOCH).unwrap_or_default().as_millis() as u64
        }),
        verdict: Verdict::Deny,
        policy: String::new(),
        rule: None,
        source: String::new(),
        pod: String::new(),
        service: String::new(),
        port: 0,
        method: String::new(),
        path: String::new(),
    }
}

/// The denial (`Some(policy id)`; empty or [`NO_MATCH`] when no ALLOW matched), then each AUDIT match,
/// then the dry-run denial if there was no real one.
fn judged(base: &Decision, results: &Results, denial: Option<String>) -> Vec<Decision> {
    let of = |verdict, id: &str| {
        let (policy, rule) = split_policy_id(id);
        Decision {
            verdict,
            policy,
            rule,
            ..base.clone()
        }
    };
    let mut out: Vec<Decision> = denial.iter().map(|id| of(Verdict::Deny, id)).collect();
    for slot in results.audits() {
        out.push(of(Verdict::Audit, results.policy(&slot, "shadow").unwrap_or_default()));
    }
    // Dry-run policies matter where they would change the verdict.
    let dry_run = ["dry_run.deny.", "dry_run.allow."]
        .into_iter()
        .find(|p| results.denied(p, "shadow"));
    if let (None, Some(name)) = (&denial, dry_run) {
        out.push(of(
            Verdict::DryRunDeny,
            results.policy(name, "shadow").unwrap_or_default(),
        ));
    }
    out
}

/// The results of an egress layer's RBAC filters begin with this (`authorization::egress::EGRESS`).
const EGRESS_PREFIX: &str = "egress.";

/// The RBAC filters' results of one layer (its keys begin with the layer's prefix) in one
/// request's (or connection's) metadata.
struct Results<'a> {
    metadata: Option<&'a Struct>,
    layer: &'static str,
}

impl<'a> Results<'a> {
    fn of(common: &'a AccessLogCommon, namespace: &str, layer: &'static str) -> Self {
        let metadata = common.metadata.as_ref().and_then(|m| m.filter_metadata.get(namespace));
        Results { metadata, layer }
    }

    fn string(&self, key: &str) -> Option<&str> {
        match self
            .metadata?
            .fields
            .get(&format!("{}{key}", self.layer))?
            .kind
            .as_ref()?
        {
            value::Kind::StringValue(s) => Some(s),
            _ => None,
        }
    }

    fn denied(&self, name: &str, engine: &str) -> bool {
        self.string(&format!("{name}{engine}_engine_result")) == Some("denied")
    }

    fn policy(&self, name: &str, engine: &str) -> Option<&str> {
        self.string(&format!("{name}{engine}_effective_policy_id"))
    }

    /// The HTTP DENY or ALLOW filter's enforced denial, by the policy id it names.
    fn http_denial(&self) -> Option<String> {
        let denial = ["deny.", "allow."].into_iter().find(|p| self.denied(p, "enforced"));
        denial.map(|p| self.policy(p, "enforced").unwrap_or_default().to_owned())
    }

    /// The names (`audit.<slot>.`) of the AUDIT filters that matched.
    fn audits(&self) -> Vec<String> {
        let suffix = "shadow_engine_result";
        let keys = self.metadata.into_iter().flat_map(|s| s.fields.keys());
        let slots = keys.filter_map(|k| k.strip_prefix(self.layer)?.strip_prefix("audit.")?.strip_suffix(suffix));
        let audits: Vec<String> = slots.map(|slot| format!("audit.{slot}")).collect();
        audits.into_iter().filter(|name| self.denied(name, "shadow")).collect()
    }
}

/// `<ns>/<name>#<rule>` → (`<ns>/<name>`, rule).
fn split_policy_id(id: &str) -> (String, Option<u32>) {
    if id == NO_MATCH {
        return (String::new(), None);
    }
    match id.rsplit_once('#') {
        Some((policy, rule)) => (policy.to_owned(), rule.parse().ok()),
        None => (id.to_owned(), None),
    }
}

/// The caller's SPIFFE ID: the URI SAN of its client certificate.
fn spiffe_id(common: &AccessLogCommon) -> Option<String> {
    let tls = common.tls_properties.as_ref()?;
    let peer = tls.peer_certificate_properties.as_ref()?;
    peer.subject_alt_name.iter().find_map(|san| match &san.san {
        Some(subject_alt_name::San::Uri(uri)) => Some(bounded(uri)),
        _ => None,
    })
}

#[cfg(test)]
mod tests;
