//! Wire-compatible mirrors of Envoy's RBAC filter configs, with the policy map as a list
//! sorted by name. Envoy's generated `config.rbac.v3.RBAC.policies` is a `HashMap`, which
//! prost encodes in a random order: equal policies would give different bytes, so a new
//! listener version and a needless drain of the pod's connections. A map entry on the
//! wire is a message `{1: key, 2: value}`, so a repeated entry is the same encoding.

use aether_proto::registry::v1::{AuthorizationPolicy, AuthorizationRule};
use envoy_types::pb::envoy::config::rbac::v3::Policy;

use super::compile;
use super::index::IndexedMatcher;
use envoy_types::pb::google::protobuf::Any;

/// `config.rbac.v3.RBAC.Action`.
pub const ALLOW: i32 = 0;
pub const DENY: i32 = 1;

/// `envoy.config.rbac.v3.RBAC` (action and policies).
#[derive(Clone, PartialEq, prost::Message)]
pub struct Rules {
    #[prost(int32, tag = "1")]
    pub action: i32,
    #[prost(message, repeated, tag = "2")]
    pub policies: Vec<Entry>,
}

/// One entry of `RBAC.policies`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Entry {
    #[prost(string, tag = "1")]
    pub name: String,
    #[prost(message, optional, tag = "2")]
    pub policy: Option<Policy>,
}

impl Rules {
    /// One Envoy policy per rule that can match a connection to `port`, named
    /// `<ns>/<name>#<rule>`; service accounts and namespaces are in `trust_domain`.
    pub fn of(action: i32, policies: &[&AuthorizationPolicy], port: u16, trust_domain: &str) -> Self {
        let entries = named_rules(policies).into_iter().filter_map(|(name, rule)| {
            Some(Entry {
                name,
                policy: Some(compile::rule(rule, port, trust_domain)?),
            })
        });
        Rules {
            action,
            policies: entries.collect(),
        }
    }
}

/// The policies' rules named `<ns>/<name>#<rule>`, in name order: the order Envoy tries
/// them in, so the rule a match names.
pub fn named_rules<'a>(policies: &[&'a AuthorizationPolicy]) -> Vec<(String, &'a AuthorizationRule)> {
    let mut named: Vec<(String, &AuthorizationRule)> = policies
        .iter()
        .flat_map(|policy| {
            let key = format!("{}/{}", policy.namespace, policy.name);
            let rules = policy.rules.iter().enumerate();
            rules.map(move |(i, rule)| (format!("{key}#{i}"), rule))
        })
        .collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    named
}

/// `envoy.extensions.filters.network.rbac.v3.RBAC`, the fields we set.
#[derive(Clone, PartialEq, prost::Message)]
pub struct NetworkRbacConfig {
    #[prost(message, optional, tag = "1")]
    pub rules: Option<Rules>,
    #[prost(message, optional, tag = "2")]
    pub shadow_rules: Option<Rules>,
    #[prost(string, tag = "3")]
    pub stat_prefix: String,
    #[prost(int32, tag = "4")]
    pub enforcement_type: i32,
    #[prost(string, tag = "5")]
    pub shadow_rules_stat_prefix: String,
}

/// `envoy.extensions.filters.http.rbac.v3.RBAC`, the fields we set: the rules as an
/// indexed matcher.
#[derive(Clone, PartialEq, prost::Message)]
pub struct HttpRbacConfig {
    #[prost(message, optional, tag = "4")]
    pub matcher: Option<IndexedMatcher>,
    #[prost(message, optional, tag = "5")]
    pub shadow_matcher: Option<IndexedMatcher>,
    #[prost(string, tag = "3")]
    pub shadow_rules_stat_prefix: String,
    #[prost(string, tag = "6")]
    pub rules_stat_prefix: String,
    #[prost(bool, tag = "7")]
    pub track_per_rule_stats: bool,
}

/// `envoy.extensions.filters.http.rbac.v3.RBACPerRoute`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct HttpRbacPerRouteConfig {
    #[prost(message, optional, tag = "2")]
    pub rbac: Option<HttpRbacConfig>,
}

/// `typed_per_filter_config` entries of a `RouteConfiguration` (field 16), sorted by
/// filter name. Envoy's generated map is a `HashMap` (random order, so random bytes for
/// equal tables); these bytes appended to an encoded `RouteConfiguration` are the same
/// message with the map set.
#[derive(Clone, PartialEq, prost::Message)]
pub struct PerFilterConfig {
    #[prost(message, repeated, tag = "16")]
    pub entries: Vec<AnyEntry>,
}

/// One entry of a `map<string, google.protobuf.Any>`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct AnyEntry {
    #[prost(string, tag = "1")]
    pub name: String,
    #[prost(message, optional, tag = "2")]
    pub config: Option<Any>,
}
