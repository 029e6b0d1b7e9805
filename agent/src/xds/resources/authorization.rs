//! Authorization enforcement (proposals/013, Enforcement): the policies that select a
//! local pod become Envoy RBAC filters on that pod's inbound listener, so a request is
//! judged at its destination in the same hop that delivers it.
//!
//! - Each TCP chain (one per TCP port with mTLS, and the one for streams that name no
//!   port, delivered to the primary port) gets `envoy.filters.network.rbac`, judged with
//!   that chain's port: a denied connection is closed. A change replaces the
//!   chain: new connections get it at once, open ones are closed when Envoy's drain ends.
//! - The HTTP chain gets HTTP RBAC filters before the router: a denied request gets 403
//!   naming the policy and rule (`rbac_access_denied_matched_policy[<ns>/<name>#<rule>]`).
//!   Every field (identity, peer address, port, method, path, host) is judged per request
//!   there; a network filter on that chain would turn the 403 into a reset the caller's
//!   Envoy reports as 503. The filters pass everything by themselves; their rules come
//!   with the pod's inbound route table (RDS, `RBACPerRoute`), which Envoy applies to the
//!   next request, open connections included.
//!
//! Per layer, in order: one shadow-only filter per AUDIT policy (first, so it sees the
//! requests denied too), the DENY filter, then the ALLOW filter (enforcing only when an
//! enforced ALLOW policy selects the pod). Dry-run policies join the shadow rules of
//! their action's filter, next to the enforced ones, so the shadow verdict is `decide`'s
//! `dry_run`. The result must equal `aether_api::authorization::decide`; the tests hold
//! the two side by side.

mod compile;
pub mod egress;
mod index;
mod mirror;
#[cfg(test)]
pub(crate) mod tests;

use std::collections::BTreeMap;
use std::sync::Arc;

use aether_api::authorization::{Refusal, Workload, l7_on_non_http, selects, validate};
use aether_common::quote::quote;
use aether_proto::registry::v1::{AuthorizationAction, AuthorizationPolicy};
use aether_proto::view::policy_key;
use envoy_types::pb::envoy::config::listener::v3::{Filter, filter};
use envoy_types::pb::envoy::config::route::v3::RouteConfiguration;
use envoy_types::pb::envoy::extensions::filters::http::rbac::v3::{Rbac as HttpRbac, RbacPerRoute as HttpRbacPerRoute};
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::{HttpFilter, http_filter};
use envoy_types::pb::envoy::extensions::filters::network::rbac::v3::Rbac as NetworkRbac;
use envoy_types::pb::google::protobuf::Any;
use prost::{Message, Name};

use crate::pod::LocalPod;
use mirror::{HttpRbacConfig, NetworkRbacConfig, Rules};

/// Why a policy is not enforced (on one pod, or at all). Logged and counted.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    /// It fails `aether_api::authorization::validate` (it came from a store or a stream).
    #[error("policy {}: {refusal}", quote(policy))]
    Invalid { policy: String, refusal: Refusal },
    /// It has HTTP fields for a port of this pod that is not HTTP.
    #[error("policy {} on pod {}: {refusal}", quote(policy), quote(pod))]
    L7OnNonHttp {
        policy: String,
        pod: String,
        refusal: Refusal,
    },
}

impl Refused {
    /// The policy's key, `<ns>/<name>`.
    pub fn policy(&self) -> &str {
        match self {
            Refused::Invalid { policy, .. } | Refused::L7OnNonHttp { policy, .. } => policy,
        }
    }

    /// The proto field at fault (`rules[1].to[0].paths`).
    pub fn field(&self) -> &str {
        match self {
            Refused::Invalid { refusal, .. } | Refused::L7OnNonHttp { refusal, .. } => &refusal.field,
        }
    }
}

/// The catalog's policies, each validated once per version. A policy that fails keeps
/// its last valid version enforced: a bad edit never opens or closes a workload.
#[derive(Default)]
pub struct Checked {
    seen: Vec<Arc<AuthorizationPolicy>>,
    /// By key: the current version if valid, else the last valid one.
    valid: BTreeMap<String, Arc<AuthorizationPolicy>>,
    invalid: Vec<Refused>,
}

impl Checked {
    pub fn refresh(&mut self, policies: &BTreeMap<String, Arc<AuthorizationPolicy>>) {
        let current: Vec<_> = policies.values().cloned().collect();
        let same = current.len() == self.seen.len() && current.iter().zip(&self.seen).all(|(a, b)| Arc::ptr_eq(a, b));
        if same {
            return;
        }
        let mut valid = BTreeMap::new();
        self.invalid.clear();
        for (key, policy) in policies {
            match validate(policy) {
                Ok(()) => {
                    valid.insert(key.clone(), policy.clone());
                }
                Err(refusal) => {
                    let error = Refused::Invalid {
                        policy: key.clone(),
                        refusal,
                    };
                    tracing::warn!(%error, "authorization policy refused; its last valid version stays enforced");
                    self.invalid.push(error);
                    if let Some(last) = self.valid.get(key) {
                        valid.insert(key.clone(), last.clone());
                    }
                }
            }
        }
        self.valid = valid;
        self.seen = current;
    }

    /// The policies guarding calls to external services (valid, or their last valid version).
    pub fn egress(&self) -> Vec<Arc<AuthorizationPolicy>> {
        let guards = |p: &&Arc<AuthorizationPolicy>| p.target.as_ref().is_some_and(|t| !t.external_services.is_empty());
        self.valid.values().filter(guards).cloned().collect()
    }

    /// Policies in the catalog that fail validation.
    pub fn invalid(&self) -> &[Refused] {
        &self.invalid
    }

    /// The policies enforced on `pod` (by key order) and the ones refused for it (the
    /// caller logs them). A policy refused here that was enforced before (`last`) stays
    /// at that version. With `default_deny` (its namespace's MeshConfig), the ALLOW
    /// policy that allows nothing stands for it (`aether_api::mesh_config::default_deny`).
    pub fn for_pod(
        &self,
        pod: &LocalPod,
        last: &[Arc<AuthorizationPolicy>],
        default_deny: bool,
    ) -> (Vec<Arc<AuthorizationPolicy>>, Vec<Refused>) {
        let workload = workload(pod);
        let ports = pod.info.mesh_ports();
        let served: Vec<u32> = ports.iter().map(|(p, _)| u32::from(*p)).collect();
        // A port the pod does not serve is never called here, so HTTP fields on it are moot.
        let is_http = |port: u32| {
            ports
                .iter()
                .find(|(p, _)| u32::from(*p) == port)
                .is_none_or(|(_, p)| p.is_http())
        };
        let mut enforced = Vec::new();
        let mut refused = Vec::new();
        for (key, policy) in &self.valid {
            if !selects(policy, &workload) {
                continue;
            }
            match l7_on_non_http(policy, &served, is_http) {
                None => enforced.push(policy.clone()),
                Some(refusal) => {
                    refused.push(Refused::L7OnNonHttp {
                        policy: key.clone(),
                        pod: pod.id(),
                        refusal,
                    });
                    let previous = last.iter().find(|p| policy_key(p) == *key);
                    enforced.extend(previous.cloned());
                }
            }
        }
        if default_deny {
            // The same one as last time while it holds: the pod's config is not rebuilt.
            let policy = (last.iter())
                .find(|p| p.name == aether_api::mesh_config::DEFAULT_DENY_POLICY)
                .cloned()
                .unwrap_or_else(|| Arc::new(aether_api::mesh_config::default_deny(&pod.info.namespace)));
            enforced.push(policy);
        }
        (enforced, refused)
    }
}

/// The pod as a policy target.
pub fn workload(pod: &LocalPod) -> Workload {
    Workload {
        namespace: pod.info.namespace.clone(),
        labels: pod.info.labels.clone(),
        services: vec![pod.info.service()],
    }
}

/// A pod's inbound authorization: the TCP chain's filters, and for the HTTP chain its
/// filters (in the listener) with their rules (in the pod's inbound route table).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Filters {
    /// Per TCP port of the pod, its chain's network filters (before the TCP proxy) and
    /// their logged keys (see `logged`, under `envoy.filters.network.rbac`).
    pub tcp: BTreeMap<u16, TcpFilters>,
    /// The HTTP chain's RBAC filters, before the router, each passing everything unless
    /// the route table configures it: AUDIT slots (one per AUDIT policy selecting the pod,
    /// their number rounded up to a power of two), then [`DENY_FILTER`] and
    /// [`ALLOW_FILTER`], always there so that a policy edit (short of outgrowing the
    /// AUDIT slots) never changes the listener (which would leave open connections on the old rules until
    /// the drain ends) but only the route table, which Envoy applies to the next request.
    pub http: Vec<HttpFilter>,
    /// Per HTTP filter name, its rules (`RBACPerRoute`), for the route table.
    pub per_route: Vec<(String, Any)>,
    /// The dynamic-metadata keys (under `envoy.filters.http.rbac`) whose value `denied`
    /// marks a request worth a log line: a denial, an AUDIT match, a dry-run denial.
    pub logged: Vec<String>,
}

/// The RBAC network filters of one TCP port's chain.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TcpFilters {
    pub filters: Vec<Filter>,
    pub logged: Vec<String>,
}

/// The HTTP filter of the enforced and dry-run DENY policies.
pub const DENY_FILTER: &str = "aether.authz.deny";
/// The HTTP filter of the enforced and dry-run ALLOW policies.
pub const ALLOW_FILTER: &str = "aether.authz.allow";
/// The name prefix of an AUDIT slot's filter (`aether.authz.audit.<slot>`); the slot's
/// metadata and counters are under `audit.<slot>.`, its matches name the rule.
pub const AUDIT_FILTER: &str = "aether.authz.audit.";
/// Where one layer of RBAC filters sits: the pod's inbound listener ([`INBOUND`]) or its
/// outbound HCM for calls to external services (`egress::EGRESS`). `prefix` begins every
/// stat and metadata key of the layer's results.
pub struct Layer {
    pub deny: &'static str,
    pub allow: &'static str,
    pub audit: &'static str,
    pub prefix: &'static str,
}

/// The layer judging calls to a local pod.
pub const INBOUND: Layer = Layer {
    deny: DENY_FILTER,
    allow: ALLOW_FILTER,
    audit: AUDIT_FILTER,
    prefix: "",
};

/// The policy id of "no rule matched" (Envoy names a policy list's miss so too).
pub const NO_MATCH: &str = "none";
/// Where Envoy's HTTP RBAC filter writes its verdicts (dynamic metadata namespace).
pub const HTTP_METADATA: &str = "envoy.filters.http.rbac";

/// Compiles `policies` (all selecting the pod, valid and checked against its ports);
/// their service accounts and namespaces are the ones of `trust_domain`.
pub fn filters(pod: &LocalPod, policies: &[Arc<AuthorizationPolicy>], trust_domain: &str) -> Filters {
    let ports = pod.info.mesh_ports();
    let Some((primary, _)) = ports.first() else {
        return Filters::default();
    };
    let http_ports: Vec<u16> = ports.iter().filter(|(_, p)| p.is_http()).map(|(p, _)| *p).collect();
    let prefix = format!("authz.{}.{}.", pod.info.namespace, pod.info.name);
    // Every TCP port's chain judges with that port; the primary port's chain also takes
    // connections that name no port.
    let tcp_ports = ports.iter().filter(|(p, protocol)| p == primary || !protocol.is_http());
    let tcp = tcp_ports
        .map(|(port, _)| {
            let stages = stages(&INBOUND, policies, false, |action, of| {
                Rules::of(action, of, *port, trust_domain)
            });
            let logged = stages.iter().flat_map(Stage::logged_keys).collect();
            let filters = stages.into_iter().map(|s| s.network(&prefix)).collect();
            (*port, TcpFilters { filters, logged })
        })
        .collect();
    let mut filters = Filters {
        tcp,
        ..Default::default()
    };
    if http_ports.is_empty() {
        return filters;
    }
    let http = stages(&INBOUND, policies, true, |action, of| {
        index::matcher(
            action,
            &mirror::named_rules(of),
            &http_ports,
            trust_domain,
            index::CallerInput::PeerCertificate,
        )
    });
    for stage in http {
        filters.http.push(pass_through(&stage.filter));
        filters.logged.extend(stage.logged_keys());
        if stage.rules.is_some() || stage.shadow.is_some() {
            filters.per_route.push((stage.filter.clone(), stage.per_route()));
        }
    }
    filters
}

/// One RBAC filter: enforced rules and/or shadow rules, each with its stat prefix.
/// `R`: the rules compiled, as a policy list (TCP) or an indexed matcher (HTTP).
struct Stage<R> {
    /// The HTTP filter's name.
    filter: String,
    rules: Option<R>,
    rules_stat_prefix: String,
    shadow: Option<R>,
    shadow_stat_prefix: String,
}

/// The filters of one layer, in order: one per AUDIT policy (a slot), DENY, ALLOW; `compile`
/// turns an action and its policies into rules. With `always`, the DENY and ALLOW
/// stages are there even without rules (HTTP: their rules come with the route table).
fn stages<R>(
    layer: &Layer,
    policies: &[Arc<AuthorizationPolicy>],
    always: bool,
    compile: impl Fn(i32, &[&AuthorizationPolicy]) -> R,
) -> Vec<Stage<R>> {
    let of = |action: AuthorizationAction, dry_run: bool| -> Vec<&AuthorizationPolicy> {
        let matching = policies.iter().filter(|p| p.action() == action);
        matching.filter(|p| p.dry_run == dry_run).map(|p| &**p).collect()
    };
    // AUDIT first: shadow-only filters never deny, and so they see every request. One
    // slot each, by key order; with `always`, the slots are rounded up to a power of two
    // (at least one), so that most AUDIT edits change only the route table too.
    let audits = of(AuthorizationAction::Audit, false);
    let slots = match always {
        true => audits.len().max(1).next_power_of_two(),
        false => audits.len(),
    };
    let mut stages: Vec<Stage<R>> = (0..slots)
        .map(|slot| Stage {
            filter: format!("{}{slot}", layer.audit),
            rules: None,
            rules_stat_prefix: String::new(),
            // A match of the audit engine counts as its `shadow_denied` and names the rule.
            shadow: audits.get(slot).map(|audit| compile(mirror::DENY, &[audit])),
            shadow_stat_prefix: format!("{}audit.{slot}.", layer.prefix),
        })
        .collect();
    for (action, rbac_action, filter, name) in [
        (AuthorizationAction::Deny, mirror::DENY, layer.deny, "deny."),
        (AuthorizationAction::Allow, mirror::ALLOW, layer.allow, "allow."),
    ] {
        let enforced = of(action, false);
        let dry = of(action, true);
        // Without an enforced ALLOW policy nothing is allow-listed (decide's step 3).
        let enforce = !enforced.is_empty();
        let shadow = !dry.is_empty();
        if !enforce && !shadow && !always {
            continue;
        }
        stages.push(Stage {
            filter: filter.to_owned(),
            rules: enforce.then(|| compile(rbac_action, &enforced)),
            rules_stat_prefix: format!("{}{name}", layer.prefix),
            shadow: shadow.then(|| compile(rbac_action, &[enforced, dry].concat())),
            shadow_stat_prefix: format!("{}dry_run.{name}", layer.prefix),
        });
    }
    stages
}

/// An HTTP RBAC filter that passes everything until the route table configures it.
fn pass_through(name: &str) -> HttpFilter {
    HttpFilter {
        name: name.to_owned(),
        config_type: Some(http_filter::ConfigType::TypedConfig(typed::<HttpRbac>(
            &HttpRbacConfig::default(),
        ))),
        ..Default::default()
    }
}

impl<R> Stage<R> {
    /// The metadata results that are worth a log line: an enforced denial, and the
    /// shadow engine's "denied" (an AUDIT match, or a denial were dry-run policies enforced).
    fn logged_keys(&self) -> Vec<String> {
        let enforced =
            (!self.rules_stat_prefix.is_empty()).then(|| format!("{}enforced_engine_result", self.rules_stat_prefix));
        let shadow = format!("{}shadow_engine_result", self.shadow_stat_prefix);
        enforced.into_iter().chain([shadow]).collect()
    }
}

impl Stage<Rules> {
    fn network(self, pod_prefix: &str) -> Filter {
        let config = NetworkRbacConfig {
            stat_prefix: format!("{pod_prefix}{}", self.rules_stat_prefix),
            rules: self.rules,
            shadow_rules: self.shadow,
            shadow_rules_stat_prefix: self.shadow_stat_prefix,
            // Judged once per connection, on its first bytes (identity and port are known by then).
            enforcement_type: 0,
        };
        Filter {
            name: "envoy.filters.network.rbac".to_owned(),
            config_type: Some(filter::ConfigType::TypedConfig(typed::<NetworkRbac>(&config))),
        }
    }
}

impl Stage<index::IndexedMatcher> {
    /// The filter's rules for the route table. Per-rule counters on: Envoy counts each
    /// `<ns>/<name>#<rule>` allowed and denied.
    fn per_route(self) -> Any {
        let rbac = HttpRbacConfig {
            matcher: self.rules,
            rules_stat_prefix: self.rules_stat_prefix,
            shadow_matcher: self.shadow,
            shadow_rules_stat_prefix: self.shadow_stat_prefix,
            track_per_rule_stats: true,
        };
        typed::<HttpRbacPerRoute>(&mirror::HttpRbacPerRouteConfig { rbac: Some(rbac) })
    }
}

/// An HTTP RBAC filter config enforcing `policy`'s rules with its action (ALLOW or DENY),
/// for an HTTPFilter's rbac (proposals/014): no port conditions (the caller checks).
pub fn compiled_rules(policy: &AuthorizationPolicy, stat_prefix: &str, trust_domain: &str) -> Any {
    typed::<HttpRbac>(&rules_config(policy, stat_prefix, trust_domain))
}

/// The same, as a per-route config (`RBACPerRoute`).
pub fn compiled_rules_per_route(policy: &AuthorizationPolicy, stat_prefix: &str, trust_domain: &str) -> Any {
    let rbac = Some(rules_config(policy, stat_prefix, trust_domain));
    typed::<HttpRbacPerRoute>(&mirror::HttpRbacPerRouteConfig { rbac })
}

fn rules_config(policy: &AuthorizationPolicy, stat_prefix: &str, trust_domain: &str) -> HttpRbacConfig {
    let action = match policy.action() {
        AuthorizationAction::Deny => mirror::DENY,
        _ => mirror::ALLOW,
    };
    HttpRbacConfig {
        matcher: Some(index::matcher(
            action,
            &mirror::named_rules(&[policy]),
            &[],
            trust_domain,
            index::CallerInput::PeerCertificate,
        )),
        rules_stat_prefix: stat_prefix.to_owned(),
        track_per_rule_stats: true,
        ..Default::default()
    }
}

/// The pod's inbound route table with each HTTP RBAC filter's rules set on it (so they
/// apply to every route of the table).
/// `enabled`: the pod's inbound HTTP filters (proposals/014), enabled there.
pub fn route_table(routes: &RouteConfiguration, filters: &Filters, enabled: &[super::http_filters::Enabled]) -> Any {
    let entries = filters
        .per_route
        .iter()
        .cloned()
        .chain(super::http_filters::enabling(enabled));
    let mut entries: Vec<mirror::AnyEntry> = entries
        .map(|(name, config)| mirror::AnyEntry {
            name,
            config: Some(config),
        })
        .collect();
    entries.sort_by(|a, b| a.name.cmp(&b.name));
    let mut value = routes.encode_to_vec();
    value.extend(mirror::PerFilterConfig { entries }.encode_to_vec());
    Any {
        type_url: RouteConfiguration::type_url(),
        value,
    }
}

/// `mirror` encoded under the type URL of the Envoy message it mirrors.
fn typed<T: Name>(mirror: &impl Message) -> Any {
    Any {
        type_url: T::type_url(),
        value: mirror.encode_to_vec(),
    }
}
