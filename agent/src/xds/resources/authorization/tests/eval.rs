//! Evaluates the RBAC filters of a generated inbound listener for one request, as Envoy
//! does, for the subset of matchers the compiler emits (anything else panics): so the
//! table test can hold the compiled structure against `decide`.

use aether_api::authorization::{AuthzRequest, Verdict};
use envoy_types::pb::envoy::config::listener::v3::{Listener, filter};
use envoy_types::pb::envoy::config::rbac::v3::{Permission, Policy, Principal, Rbac, permission, principal};
use envoy_types::pb::envoy::config::route::v3::{HeaderMatcher, header_matcher};
use envoy_types::pb::envoy::extensions::filters::http::rbac::v3::{Rbac as HttpRbac, RbacPerRoute as HttpRbacPerRoute};
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::{
    HttpConnectionManager, http_connection_manager, http_filter,
};
use envoy_types::pb::envoy::extensions::filters::network::rbac::v3::Rbac as NetworkRbac;
use envoy_types::pb::envoy::r#type::matcher::v3::{StringMatcher, path_matcher, string_matcher};
use envoy_types::pb::xds::r#type::matcher::v3::Matcher;
use ipnet::IpNet;
use prost::Message;

use crate::xds::resources::PORT_HEADER;

mod matcher;

/// One RBAC filter of a chain.
pub struct Stage {
    pub rules: Option<Engine>,
    pub shadow: Option<Engine>,
    pub shadow_prefix: String,
}

/// An RBAC engine: a policy list (TCP) or a matcher (HTTP).
pub enum Engine {
    Rules(Rbac),
    Matcher(Matcher),
}

/// What the listener's filters do with a request.
#[derive(Debug, PartialEq)]
pub struct Judged {
    pub verdict: Verdict,
    /// The DENY policy (`<ns>/<name>#<rule>`) that denied, as Envoy reports it.
    pub denied_by: Option<String>,
    /// The shadow verdict, when a dry-run policy is compiled in.
    pub dry_run: Option<Verdict>,
    /// The AUDIT policies whose shadow engine matched (`<ns>/<name>#<rule>`).
    pub audited: Vec<String>,
}

/// The RBAC filters of the chain the request lands on: HTTP (first chain) or TCP (default).
pub fn stages(listener: &Listener, http: bool) -> Vec<Stage> {
    let chain = match http {
        true => &listener.filter_chains[0],
        false => listener.default_filter_chain.as_ref().unwrap(),
    };
    let typed = chain.filters.iter().map(|f| match &f.config_type {
        Some(filter::ConfigType::TypedConfig(any)) => (f.name.as_str(), any),
        _ => panic!("untyped filter"),
    });
    let mut stages = Vec::new();
    for (name, any) in typed {
        if name == "envoy.filters.network.rbac" {
            let rbac = NetworkRbac::decode(&*any.value).unwrap();
            stages.push(Stage {
                rules: rbac.rules.map(Engine::Rules),
                shadow: rbac.shadow_rules.map(Engine::Rules),
                shadow_prefix: rbac.shadow_rules_stat_prefix,
            });
        } else if name == "envoy.filters.network.http_connection_manager" {
            let hcm = HttpConnectionManager::decode(&*any.value).unwrap();
            let Some(http_connection_manager::RouteSpecifier::RouteConfig(routes)) = &hcm.route_specifier else {
                panic!("the route table is inlined by `inbound`");
            };
            for f in hcm.http_filters.iter().filter(|f| f.name.starts_with("aether.authz.")) {
                let Some(http_filter::ConfigType::TypedConfig(base)) = &f.config_type else {
                    panic!("untyped http filter");
                };
                // The table's config for the filter, else its own (which passes everything).
                let rbac = match routes.typed_per_filter_config.get(&f.name) {
                    Some(any) => HttpRbacPerRoute::decode(&*any.value).unwrap().rbac.unwrap(),
                    None => HttpRbac::decode(&*base.value).unwrap(),
                };
                assert!(
                    rbac.rules.is_none() && rbac.shadow_rules.is_none(),
                    "HTTP rules are matchers"
                );
                stages.push(Stage {
                    rules: rbac.matcher.map(Engine::Matcher),
                    shadow: rbac.shadow_matcher.map(Engine::Matcher),
                    shadow_prefix: rbac.shadow_rules_stat_prefix,
                });
            }
        }
    }
    stages
}

pub fn judge(listener: &Listener, request: &AuthzRequest) -> Judged {
    let stages = stages(listener, request.http.is_some());
    let is_audit = |s: &&Stage| s.shadow_prefix.starts_with("audit.");
    // A filter after the one that denies never sees the request.
    let mut audited = Vec::new();
    let mut denial = None;
    for stage in &stages {
        if is_audit(&stage) {
            audited.extend(stage.shadow.as_ref().and_then(|s| first_match(s, request)));
        } else if let Some(rules) = &stage.rules {
            denial = denies(rules, request);
            if denial.is_some() {
                break;
            }
        }
    }
    let enforcing: Vec<&Stage> = stages.iter().filter(|s| !is_audit(s)).collect();
    let dry = enforcing.iter().any(|s| s.shadow.is_some());
    let engines = enforcing.iter().filter_map(|s| s.shadow.as_ref().or(s.rules.as_ref()));
    let dry_run = dry.then(|| match engines.into_iter().find_map(|e| denies(e, request)) {
        Some(_) => Verdict::Deny,
        None => Verdict::Allow,
    });
    Judged {
        verdict: if denial.is_some() {
            Verdict::Deny
        } else {
            Verdict::Allow
        },
        denied_by: denial.flatten(),
        dry_run,
        audited,
    }
}

impl Engine {
    /// The rules it can name, sorted.
    pub fn rule_names(&self) -> Vec<String> {
        match self {
            Engine::Rules(rbac) => {
                let mut names: Vec<String> = rbac.policies.keys().cloned().collect();
                names.sort();
                names
            }
            Engine::Matcher(m) => matcher::rule_names(m),
        }
    }
}

/// Whether an engine denies: a matching DENY (named), or an ALLOW without a match.
fn denies(engine: &Engine, request: &AuthzRequest) -> Option<Option<String>> {
    let action = match engine {
        Engine::Rules(rbac) => rbac.action,
        Engine::Matcher(m) => return matcher::denies(m, request),
    };
    match (action, first_match(engine, request)) {
        (1, Some(name)) => Some(Some(name)),
        (0, None) => Some(None),
        (0 | 1, _) => None,
        (action, _) => panic!("action {action} is not emitted"),
    }
}

/// The first rule by name that matches (Envoy keeps its policies ordered by name).
fn first_match(engine: &Engine, request: &AuthzRequest) -> Option<String> {
    let rbac = match engine {
        Engine::Rules(rbac) => rbac,
        Engine::Matcher(m) => return matcher::first_match(m, request),
    };
    let mut names: Vec<&String> = rbac.policies.keys().collect();
    names.sort();
    names.into_iter().find(|n| policy(&rbac.policies[*n], request)).cloned()
}

fn policy(p: &Policy, request: &AuthzRequest) -> bool {
    p.permissions.iter().any(|x| permits(x, request)) && p.principals.iter().any(|x| identifies(x, request))
}

fn permits(p: &Permission, request: &AuthzRequest) -> bool {
    match p.rule.as_ref().unwrap() {
        permission::Rule::AndRules(set) => set.rules.iter().all(|r| permits(r, request)),
        permission::Rule::OrRules(set) => set.rules.iter().any(|r| permits(r, request)),
        permission::Rule::NotRule(rule) => !permits(rule, request),
        permission::Rule::Any(any) => *any,
        permission::Rule::Header(h) => header(h, request),
        permission::Rule::UrlPath(path) => {
            let Some(path_matcher::Rule::Path(m)) = &path.rule else {
                panic!()
            };
            let http = request.http.as_ref().unwrap();
            string(m, http.path.split('?').next().unwrap())
        }
        other => panic!("{other:?} is not emitted"),
    }
}

/// The request's headers as the inbound listener sees them: the caller's Envoy sets the
/// port header to the app port called.
fn header(h: &HeaderMatcher, request: &AuthzRequest) -> bool {
    let http = request.http.as_ref().unwrap();
    let port = request.port.to_string();
    let value = match h.name.as_str() {
        ":method" => &http.method,
        ":authority" => &http.host,
        name if name == PORT_HEADER => &port,
        other => panic!("header {other} is not emitted"),
    };
    let Some(header_matcher::HeaderMatchSpecifier::StringMatch(m)) = &h.header_match_specifier else {
        panic!("{h:?} is not emitted")
    };
    string(m, value) != h.invert_match
}

fn identifies(p: &Principal, request: &AuthzRequest) -> bool {
    match p.identifier.as_ref().unwrap() {
        principal::Identifier::AndIds(set) => set.ids.iter().all(|i| identifies(i, request)),
        principal::Identifier::OrIds(set) => set.ids.iter().any(|i| identifies(i, request)),
        principal::Identifier::NotId(id) => !identifies(id, request),
        principal::Identifier::Any(any) => *any,
        principal::Identifier::Authenticated(a) => {
            let matcher = a.principal_name.as_ref().unwrap();
            request.principal.as_deref().is_some_and(|id| string(matcher, id))
        }
        principal::Identifier::DirectRemoteIp(cidr) => {
            let net: IpNet = format!("{}/{}", cidr.address_prefix, cidr.prefix_len.unwrap().value)
                .parse()
                .unwrap();
            net.contains(&request.peer_ip)
        }
        other => panic!("{other:?} is not emitted"),
    }
}

fn string(m: &StringMatcher, value: &str) -> bool {
    let fold = |s: &str| {
        if m.ignore_case {
            s.to_ascii_lowercase()
        } else {
            s.to_owned()
        }
    };
    match m.match_pattern.as_ref().unwrap() {
        string_matcher::MatchPattern::Exact(x) => fold(value) == fold(x),
        string_matcher::MatchPattern::Prefix(x) => fold(value).starts_with(&fold(x)),
        string_matcher::MatchPattern::Suffix(x) => fold(value).ends_with(&fold(x)),
        // Envoy matches a safe regex against the whole value.
        string_matcher::MatchPattern::SafeRegex(r) => regex::Regex::new(&format!("^(?:{})$", r.regex))
            .unwrap()
            .is_match(value),
        other => panic!("{other:?} is not emitted"),
    }
}
