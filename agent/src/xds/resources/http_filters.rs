//! HTTPFilter enforcement (proposals/014): the catalog's HTTP filters become stock Envoy
//! HTTP filters where each asks to be.
//!
//! - Inbound: on the inbound HTTP chain of every local pod of a target service, after the
//!   authorization filters, in order.
//! - Callers and Route: every local pod's outbound HCM holds the node's callers-side
//!   filters, disabled, in order; the shared outbound route table enables each on its
//!   target services' virtual hosts (Callers) or on the routes compiled from its route
//!   (Route). So a filter is in each pod's HCM once, never per pod × service.
//! - ext_authz services are clusters by address (`STRICT_DNS` for a name), shared by
//!   every filter naming the same one.

#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use aether_proto::registry::v1::http_filter::Filter as Kind;
use aether_proto::registry::v1::{
    AuthorizationAction, AuthorizationPolicy, ExtAuthz, ExtAuthzProtocol, HeaderToMetadata, HttpFilter,
    HttpFilterAttachment, LocalRateLimit, RbacFilter,
};
use aether_proto::view::http_filter_key;
use envoy_types::pb::envoy::config::cluster::v3::{Cluster, cluster};
use envoy_types::pb::envoy::config::core::v3::{
    GrpcService, Http2ProtocolOptions, HttpUri, RuntimeFractionalPercent, grpc_service, http_uri,
};
use envoy_types::pb::envoy::config::endpoint::v3::{
    ClusterLoadAssignment, LbEndpoint, LocalityLbEndpoints, lb_endpoint,
};
use envoy_types::pb::envoy::config::route::v3::FilterConfig;
use envoy_types::pb::envoy::extensions::filters::http::ext_authz::v3::{
    BufferSettings, CheckSettings, ExtAuthz as EnvoyExtAuthz, ExtAuthzPerRoute, HttpService, ext_authz,
    ext_authz_per_route,
};
use envoy_types::pb::envoy::extensions::filters::http::header_to_metadata::v3::{
    Config as HeaderToMetadataConfig, config,
};
use envoy_types::pb::envoy::extensions::filters::http::local_ratelimit::v3::LocalRateLimit as EnvoyLocalRateLimit;
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::{
    HttpFilter as EnvoyHttpFilter, http_filter,
};
use envoy_types::pb::envoy::extensions::upstreams::http::v3::{HttpProtocolOptions, http_protocol_options};
use envoy_types::pb::envoy::r#type::matcher::v3::{ListStringMatcher, StringMatcher, string_matcher};
use envoy_types::pb::envoy::r#type::v3::{FractionalPercent, HttpStatus, TokenBucket, fractional_percent};
use envoy_types::pb::google::protobuf::{Any, UInt32Value};

use super::authorization::{compiled_rules, compiled_rules_per_route};
use super::util::{address, any, millis};
use crate::pod::LocalPod;

/// The Envoy name of a filter's HTTP filter (what the route table enables it by).
pub fn filter_name(filter: &HttpFilter) -> String {
    format!("aether.filter.{}", http_filter_key(filter))
}

/// The catalog's filters: the valid ones by key, and how many were refused.
#[derive(Default)]
pub struct Checked {
    seen: Vec<Arc<HttpFilter>>,
    /// In the order filters of one place run: ascending `order`, then key.
    valid: Vec<Arc<HttpFilter>>,
    invalid: usize,
    /// The mesh's trust domain, for the service accounts of rbac rules.
    trust_domain: String,
}

impl Checked {
    /// Re-checks the filters when any changed; an invalid one is logged and skipped.
    /// rbac rules name service accounts of `trust_domain`.
    pub fn refresh(&mut self, filters: &BTreeMap<String, Arc<HttpFilter>>, trust_domain: &str) {
        trust_domain.clone_into(&mut self.trust_domain);
        let current: Vec<_> = filters.values().cloned().collect();
        let same = current.len() == self.seen.len() && current.iter().zip(&self.seen).all(|(a, b)| Arc::ptr_eq(a, b));
        if same {
            return;
        }
        self.valid.clear();
        self.invalid = 0;
        for filter in &current {
            match aether_api::http_filter::validate(filter) {
                Ok(()) => self.valid.push(filter.clone()),
                Err(refusal) => {
                    self.invalid += 1;
                    let key = aether_common::quote::quote(&http_filter_key(filter)).to_string();
                    tracing::warn!(filter = %key, %refusal, "invalid HTTP filter skipped");
                }
            }
        }
        self.valid.sort_by_key(|f| (f.order, http_filter_key(f)));
        self.seen = current;
    }

    /// HTTP filters in the catalog that fail validation.
    pub fn invalid(&self) -> usize {
        self.invalid
    }

    fn attached(&self, attach: HttpFilterAttachment) -> impl Iterator<Item = &Arc<HttpFilter>> {
        self.valid.iter().filter(move |f| f.attach() == attach)
    }

    /// The pod's inbound filters, in order, disabled, and what enables each in the pod's
    /// inbound route table: a removal or an edit then reaches open connections with the
    /// table (their chain keeps the old filter list until it drains, disabled by the new
    /// table), never leaving them on a filter whose ext_authz cluster is gone.
    pub fn inbound(&self, pod: &LocalPod) -> (Vec<EnvoyHttpFilter>, Vec<Enabled>) {
        let service = pod.info.service();
        let mine = self
            .attached(HttpFilterAttachment::Inbound)
            .filter(|f| f.services.contains(&service));
        let compiled =
            mine.filter_map(|f| Some((envoy_filter(f, &self.trust_domain)?, per_route(f, &self.trust_domain)?)));
        compiled
            .map(|(envoy, config)| (envoy.clone(), (envoy.name, config)))
            .unzip()
    }

    /// The callers-side filters for calls to `services` (the node's dependencies).
    pub fn callers(&self, services: &BTreeSet<&str>) -> Callers {
        let on_node = |f: &&Arc<HttpFilter>| {
            f.attach() != HttpFilterAttachment::Inbound && f.services.iter().any(|s| services.contains(s.as_str()))
        };
        let mut callers = Callers::default();
        for filter in self.valid.iter().filter(on_node) {
            let (Some(envoy), Some(per_route)) = (
                envoy_filter(filter, &self.trust_domain),
                per_route(filter, &self.trust_domain),
            ) else {
                continue;
            };
            let enabled = (envoy.name.clone(), per_route);
            callers.filters.push(envoy);
            for service in &filter.services {
                let entry = match filter.attach() {
                    HttpFilterAttachment::Route => callers
                        .by_route
                        .entry((filter.route.clone(), service.clone()))
                        .or_default(),
                    _ => callers.by_service.entry(service.clone()).or_default(),
                };
                entry.push(enabled.clone());
            }
        }
        callers
    }

    /// The ext_authz clusters the filters in use call, given the pods and callers here.
    pub fn ext_authz_clusters(&self, pods: &[LocalPod], callers: &Callers) -> Vec<(String, Any)> {
        let local: BTreeSet<String> = pods.iter().map(|p| p.info.service()).collect();
        let inbound = self.attached(HttpFilterAttachment::Inbound);
        let inbound = inbound.filter(|f| f.services.iter().any(|s| local.contains(s)));
        let caller_names: BTreeSet<&str> = callers.filters.iter().map(|f| f.name.as_str()).collect();
        let outbound = self
            .valid
            .iter()
            .filter(|f| caller_names.contains(filter_name(f).as_str()));
        let services: BTreeSet<(String, u32, ExtAuthzProtocol)> = inbound
            .chain(outbound)
            .filter_map(|f| match &f.filter {
                Some(Kind::ExtAuthz(e)) => Some((e.host.clone(), e.port, e.protocol())),
                _ => None,
            })
            .collect();
        services
            .into_iter()
            .map(|(h, p, protocol)| ext_authz_cluster(&h, p, protocol))
            .collect()
    }
}

/// The node's callers-side filters: for each pod's outbound HCM (disabled), and where the
/// outbound route table enables them.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Callers {
    /// In order, disabled.
    pub filters: Vec<EnvoyHttpFilter>,
    /// Service key → the filters enabled on its virtual hosts, with their configs there.
    pub by_service: BTreeMap<String, Vec<Enabled>>,
    /// (route key, service key) → the filters enabled on that route's rules for that service.
    pub by_route: BTreeMap<(String, String), Vec<Enabled>>,
    /// Service key → port → the filters enabled on that service port's virtual host (the
    /// authorization of calls to external services, `authorization::egress`).
    pub by_service_port: BTreeMap<String, BTreeMap<u32, Vec<Enabled>>>,
}

/// A filter enabled in the route table: its name, and its per-route config (Envoy
/// refuses an entry without one).
pub type Enabled = (String, Any);

impl Callers {
    /// Route key → the filters enabled on its rules, for calls to `service`.
    pub fn by_route_of(&self, service: &str) -> BTreeMap<&str, &[Enabled]> {
        let of_service = self.by_route.iter().filter(|((_, s), _)| s == service);
        of_service
            .map(|((route, _), names)| (route.as_str(), &names[..]))
            .collect()
    }
}

/// `typed_per_filter_config` entries enabling `filters` (disabled in the HCM).
pub fn enabling(filters: &[Enabled]) -> impl Iterator<Item = (String, Any)> + '_ {
    filters.iter().map(|(name, config)| {
        let enabled = FilterConfig {
            config: Some(config.clone()),
            disabled: false,
            ..Default::default()
        };
        (name.clone(), any(&enabled))
    })
}

/// The filter as Envoy's, disabled (the route table enables it). `None` for an rbac
/// filter with rules that cannot be judged here.
fn envoy_filter(filter: &HttpFilter, trust_domain: &str) -> Option<EnvoyHttpFilter> {
    let prefix = format!("{}.{}.", filter.namespace, filter.name);
    let config = match filter.filter.as_ref()? {
        Kind::ExtAuthz(e) => any(&ext_authz_config(e, &prefix)),
        Kind::LocalRateLimit(l) => any(&local_rate_limit(l, &prefix)),
        Kind::HeaderToMetadata(h) => any(&header_to_metadata(h)),
        Kind::Rbac(r) => rbac(filter, r, trust_domain)?,
    };
    Some(EnvoyHttpFilter {
        name: filter_name(filter),
        config_type: Some(http_filter::ConfigType::TypedConfig(config)),
        disabled: true,
        ..Default::default()
    })
}

/// The cluster of an ext_authz service: `ext_authz|<host>:<port>|<grpc|http>`.
fn ext_authz_cluster_name(host: &str, port: u32, protocol: ExtAuthzProtocol) -> String {
    let kind = match protocol {
        ExtAuthzProtocol::Http => "http",
        _ => "grpc",
    };
    format!("ext_authz|{host}:{port}|{kind}")
}

fn ext_authz_config(e: &ExtAuthz, stat_prefix: &str) -> EnvoyExtAuthz {
    let cluster = ext_authz_cluster_name(&e.host, e.port, e.protocol());
    let timeout = millis(u64::from(if e.timeout_ms == 0 { 200 } else { e.timeout_ms }));
    let services = match e.protocol() {
        ExtAuthzProtocol::Http => ext_authz::Services::HttpService(HttpService {
            server_uri: Some(HttpUri {
                uri: format!("http://{}:{}", e.host, e.port),
                timeout,
                http_upstream_type: Some(http_uri::HttpUpstreamType::Cluster(cluster)),
            }),
            path_prefix: e.path_prefix.clone(),
            ..Default::default()
        }),
        _ => ext_authz::Services::GrpcService(GrpcService {
            target_specifier: Some(grpc_service::TargetSpecifier::EnvoyGrpc(grpc_service::EnvoyGrpc {
                cluster_name: cluster,
                // Else the cluster's name, which no HTTP/2 server takes as an authority.
                authority: format!("{}:{}", e.host, e.port),
                ..Default::default()
            })),
            timeout,
            ..Default::default()
        }),
    };
    EnvoyExtAuthz {
        services: Some(services),
        transport_api_version: envoy_types::pb::envoy::config::core::v3::ApiVersion::V3 as i32,
        failure_mode_allow: e.fail_open,
        status_on_error: Some(HttpStatus {
            code: if e.status_on_error == 0 {
                403
            } else {
                e.status_on_error as i32
            },
        }),
        with_request_body: (e.max_request_bytes > 0).then(|| BufferSettings {
            max_request_bytes: e.max_request_bytes,
            allow_partial_message: true,
            ..Default::default()
        }),
        // The request headers sent to an HTTP service besides Envoy's defaults.
        allowed_headers: (!e.allowed_headers.is_empty()).then(|| ListStringMatcher {
            patterns: e.allowed_headers.iter().map(|h| exact(h)).collect(),
        }),
        stat_prefix: stat_prefix.trim_end_matches('.').to_owned(),
        ..Default::default()
    }
}

fn exact(value: &str) -> StringMatcher {
    StringMatcher {
        match_pattern: Some(string_matcher::MatchPattern::Exact(value.to_owned())),
        ..Default::default()
    }
}

/// The bucket applies to every request the filter sees (enabled and enforced at 100%).
fn local_rate_limit(l: &LocalRateLimit, stat_prefix: &str) -> EnvoyLocalRateLimit {
    let all = |key: &str| RuntimeFractionalPercent {
        default_value: Some(FractionalPercent {
            numerator: 100,
            denominator: fractional_percent::DenominatorType::Hundred as i32,
        }),
        runtime_key: format!("aether.local_rate_limit.{key}"),
    };
    let fill = if l.tokens_per_fill == 0 {
        l.max_tokens
    } else {
        l.tokens_per_fill
    };
    EnvoyLocalRateLimit {
        stat_prefix: format!("{stat_prefix}local_rate_limit"),
        status: Some(HttpStatus {
            code: if l.status == 0 { 429 } else { l.status as i32 },
        }),
        token_bucket: Some(TokenBucket {
            max_tokens: l.max_tokens,
            tokens_per_fill: Some(UInt32Value { value: fill }),
            fill_interval: millis(u64::from(l.fill_interval_ms)),
        }),
        filter_enabled: Some(all("enabled")),
        filter_enforced: Some(all("enforced")),
        ..Default::default()
    }
}

fn header_to_metadata(h: &HeaderToMetadata) -> HeaderToMetadataConfig {
    let rules = h.rules.iter().map(|r| config::Rule {
        header: r.header.clone(),
        on_header_present: Some(config::KeyValuePair {
            metadata_namespace: r.metadata_namespace.clone(),
            key: r.key.clone(),
            ..Default::default()
        }),
        remove: r.remove,
        ..Default::default()
    });
    HeaderToMetadataConfig {
        request_rules: rules.collect(),
        ..Default::default()
    }
}

/// AuthorizationPolicy's compiler, for the rules of an rbac filter. An HTTP filter does
/// not know the app port a request is for (inbound, the port header is judged by the
/// authorization filters; on the callers' side there is none), so a filter whose rules
/// name ports is refused (logged), never compiled into a rule that cannot match.
fn rbac(filter: &HttpFilter, r: &RbacFilter, trust_domain: &str) -> Option<Any> {
    let to = r.rules.iter().flat_map(|rule| &rule.to);
    if to.clone().any(|to| !to.ports.is_empty() || !to.not_ports.is_empty()) {
        let key = http_filter_key(filter);
        tracing::warn!(filter = %key, "rbac rules of an HTTP filter cannot name ports; filter skipped");
        return None;
    }
    let policy = rbac_policy(filter, r);
    Some(compiled_rules(
        &policy,
        &format!("filter.{}.{}.", filter.namespace, filter.name),
        trust_domain,
    ))
}

/// The rbac filter's rules as an AuthorizationPolicy of its action, for the compiler.
fn rbac_policy(filter: &HttpFilter, r: &RbacFilter) -> AuthorizationPolicy {
    AuthorizationPolicy {
        namespace: filter.namespace.clone(),
        name: filter.name.clone(),
        action: match r.action() {
            AuthorizationAction::Deny => AuthorizationAction::Deny,
            _ => AuthorizationAction::Allow,
        } as i32,
        rules: r.rules.clone(),
        ..Default::default()
    }
}

/// What enables the filter in the route table: its per-route config. ext_authz: check
/// with the HCM's settings. local_ratelimit: the same bucket settings, so the bucket is
/// the route table's (one per service port, shared by the node's callers).
/// header_to_metadata and rbac: the same rules.
fn per_route(filter: &HttpFilter, trust_domain: &str) -> Option<Any> {
    let prefix = format!("{}.{}.", filter.namespace, filter.name);
    Some(match filter.filter.as_ref()? {
        Kind::ExtAuthz(_) => any(&ExtAuthzPerRoute {
            r#override: Some(ext_authz_per_route::Override::CheckSettings(CheckSettings::default())),
        }),
        Kind::LocalRateLimit(l) => any(&local_rate_limit(l, &prefix)),
        Kind::HeaderToMetadata(h) => any(&header_to_metadata(h)),
        Kind::Rbac(r) => compiled_rules_per_route(&rbac_policy(filter, r), &format!("filter.{prefix}"), trust_domain),
    })
}

/// The cluster of an ext_authz service: `STATIC` for an IP, `STRICT_DNS` for a name
/// (HTTP/2 for gRPC).
fn ext_authz_cluster(host: &str, port: u32, protocol: ExtAuthzProtocol) -> (String, Any) {
    let name = ext_authz_cluster_name(host, port, protocol);
    let endpoint = LbEndpoint {
        host_identifier: Some(lb_endpoint::HostIdentifier::Endpoint(
            envoy_types::pb::envoy::config::endpoint::v3::Endpoint {
                address: Some(address(host, port, None)),
                ..Default::default()
            },
        )),
        ..Default::default()
    };
    let mut cluster = Cluster {
        name: name.clone(),
        cluster_discovery_type: Some(cluster::ClusterDiscoveryType::Type(
            match host.parse::<std::net::IpAddr>() {
                Ok(_) => cluster::DiscoveryType::Static,
                Err(_) => cluster::DiscoveryType::StrictDns,
            } as i32,
        )),
        connect_timeout: millis(1000),
        load_assignment: Some(ClusterLoadAssignment {
            cluster_name: name.clone(),
            endpoints: vec![LocalityLbEndpoints {
                lb_endpoints: vec![endpoint],
                ..Default::default()
            }],
            ..Default::default()
        }),
        ..Default::default()
    };
    if protocol != ExtAuthzProtocol::Http {
        let options = HttpProtocolOptions {
            upstream_protocol_options: Some(http_protocol_options::UpstreamProtocolOptions::ExplicitHttpConfig(
                http_protocol_options::ExplicitHttpConfig {
                    protocol_config: Some(
                        http_protocol_options::explicit_http_config::ProtocolConfig::Http2ProtocolOptions(
                            Http2ProtocolOptions::default(),
                        ),
                    ),
                },
            )),
            ..Default::default()
        };
        let options = any(&options);
        cluster.typed_extension_protocol_options.insert(
            options.type_url.trim_start_matches("type.googleapis.com/").to_owned(),
            options,
        );
    }
    (name, any(&cluster))
}
