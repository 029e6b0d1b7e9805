//! One policy rule → one Envoy RBAC policy, for one chain of the inbound listener.
//!
//! Sources become principals (the mTLS peer's URI SAN, the connection's peer address);
//! operations become permissions. The port is the app port the chain delivers to, not
//! the listener's 18008: on the TCP chain it is the pod's primary port, known when
//! compiling, so port conditions are settled here; on the HTTP chain it is the port the
//! inbound route table picks by the port header, so they become that header's matchers.

use aether_api::authorization::{namespace_prefix, service_account_id};
use aether_proto::registry::v1::{
    AuthorizationOperation, AuthorizationPattern, AuthorizationRule, AuthorizationSource, PatternKind,
};
use envoy_types::pb::envoy::config::core::v3::CidrRange;
use envoy_types::pb::envoy::config::rbac::v3::{Permission, Policy, Principal, permission, principal};
use envoy_types::pb::envoy::config::route::v3::{HeaderMatcher, header_matcher};
use envoy_types::pb::envoy::r#type::matcher::v3::{
    PathMatcher, RegexMatcher, StringMatcher, path_matcher, string_matcher,
};
use envoy_types::pb::google::protobuf::UInt32Value;

use super::super::util::PORT_HEADER;

/// The chain a rule is compiled for.
pub enum Layer<'a> {
    /// Raw TCP, delivered to `port`; no HTTP fields can match.
    Tcp { port: u16 },
    /// HTTP to the pod's HTTP ports (the first takes requests naming no other).
    Http { ports: &'a [u16] },
}

/// The rule as an Envoy policy; `None` when it can never match on this layer. Envoy
/// tries the permissions first and the principals only when they match, which suits
/// us: an identity check that fails costs a certificate parse in Envoy 1.40 (it
/// re-reads the DNS SANs a SVID does not have, every time).
pub fn rule(rule: &AuthorizationRule, layer: &Layer, trust_domain: &str) -> Option<Policy> {
    let principals = match rule.from.is_empty() {
        true => vec![any_id()],
        false => rule.from.iter().map(|s| source(s, trust_domain)).collect(),
    };
    let permissions: Vec<Permission> = match rule.to.is_empty() {
        true => vec![any_rule()],
        false => rule.to.iter().filter_map(|o| operation(o, layer)).collect(),
    };
    (!permissions.is_empty()).then(|| Policy {
        permissions,
        principals,
        ..Default::default()
    })
}

/// Every field set holds (AND); a field holds when any value matches, a `not_*` one
/// when none does.
fn source(s: &AuthorizationSource, trust_domain: &str) -> Principal {
    let mut all = Vec::new();
    let mut field = |values: Vec<Principal>, negated: bool| {
        if values.is_empty() {
            return;
        }
        let any_of = id(principal::Identifier::OrIds(principal::Set { ids: values }));
        all.push(match negated {
            false => any_of,
            true => id(principal::Identifier::NotId(Box::new(any_of))),
        });
    };
    for (list, negated) in [(&s.principals, false), (&s.not_principals, true)] {
        field(list.iter().map(|p| peer(principal_matcher(p))).collect(), negated);
    }
    let account = |a: &String| peer(exact(&service_account_id(a, trust_domain)));
    for (list, negated) in [(&s.service_accounts, false), (&s.not_service_accounts, true)] {
        field(list.iter().map(account).collect(), negated);
    }
    let namespace = |ns: &String| peer(prefix(&namespace_prefix(ns, trust_domain)));
    for (list, negated) in [(&s.namespaces, false), (&s.not_namespaces, true)] {
        field(list.iter().map(namespace).collect(), negated);
    }
    let block = |b: &String| id(principal::Identifier::DirectRemoteIp(cidr(b)));
    for (list, negated) in [(&s.ip_blocks, false), (&s.not_ip_blocks, true)] {
        field(list.iter().map(block).collect(), negated);
    }
    match all.len() {
        0 => any_id(),
        _ => id(principal::Identifier::AndIds(principal::Set { ids: all })),
    }
}

/// Same logic as [`source`]; `None` when the operation cannot match on this layer.
fn operation(o: &AuthorizationOperation, layer: &Layer) -> Option<Permission> {
    let mut all = Vec::new();
    let mut field = |values: Vec<Permission>, negated: bool| {
        let any_of = or_rules(values);
        all.push(match negated {
            false => any_of,
            true => perm(permission::Rule::NotRule(Box::new(any_of))),
        });
    };
    let l7 = [&o.methods, &o.not_methods].iter().any(|l| !l.is_empty())
        || [&o.paths, &o.not_paths, &o.hosts, &o.not_hosts]
            .iter()
            .any(|l| !l.is_empty());
    match layer {
        Layer::Tcp { port } => {
            let port = u32::from(*port);
            let ports = o.ports.is_empty() || o.ports.contains(&port);
            if l7 || !ports || o.not_ports.contains(&port) {
                return None;
            }
        }
        Layer::Http { ports } => {
            for (list, negated) in [(&o.ports, false), (&o.not_ports, true)] {
                if !list.is_empty() {
                    let routed: Vec<Permission> = list.iter().filter_map(|p| delivered_to(*p, ports)).collect();
                    // A port no HTTP request here is delivered to: never (or always, negated).
                    if routed.is_empty() && !negated {
                        return None;
                    }
                    if !routed.is_empty() {
                        field(routed, negated);
                    }
                }
            }
        }
    }
    let methods =
        |list: &Vec<String>| -> Vec<Permission> { list.iter().map(|m| header(":method", exact(m))).collect() };
    let paths = |list: &Vec<AuthorizationPattern>| -> Vec<Permission> { list.iter().map(path).collect() };
    let hosts = |list: &Vec<AuthorizationPattern>| -> Vec<Permission> { list.iter().map(host).collect() };
    for (values, negated) in [
        (methods(&o.methods), false),
        (methods(&o.not_methods), true),
        (paths(&o.paths), false),
        (paths(&o.not_paths), true),
        (hosts(&o.hosts), false),
        (hosts(&o.not_hosts), true),
    ] {
        if !values.is_empty() {
            field(values, negated);
        }
    }
    Some(match all.len() {
        0 => any_rule(),
        _ => perm(permission::Rule::AndRules(permission::Set { rules: all })),
    })
}

/// A request on the HTTP chain is delivered to the port its port header names, if that
/// is one of the HTTP ports, else to the first: the inbound route table's choice.
fn delivered_to(port: u32, http_ports: &[u16]) -> Option<Permission> {
    let header_names = |p: &u16| header(PORT_HEADER, exact(&p.to_string()));
    match http_ports.iter().position(|p| u32::from(*p) == port)? {
        0 if http_ports.len() == 1 => Some(any_rule()),
        0 => {
            let others = or_rules(http_ports[1..].iter().map(header_names).collect());
            Some(perm(permission::Rule::NotRule(Box::new(others))))
        }
        i => Some(header_names(&http_ports[i])),
    }
}

/// The caller's verified SPIFFE ID. `*` means "any verified caller".
fn principal_matcher(p: &AuthorizationPattern) -> StringMatcher {
    match p.kind() {
        PatternKind::Any => string(string_matcher::MatchPattern::Prefix("spiffe://".to_owned())),
        _ => pattern(p),
    }
}

fn pattern(p: &AuthorizationPattern) -> StringMatcher {
    let value = p.value.clone();
    string(match p.kind() {
        PatternKind::Exact => string_matcher::MatchPattern::Exact(value),
        PatternKind::Prefix => string_matcher::MatchPattern::Prefix(value),
        PatternKind::Suffix => string_matcher::MatchPattern::Suffix(value),
        // validate() refuses an unspecified kind; never reached for a checked policy.
        PatternKind::Any | PatternKind::Unspecified => string_matcher::MatchPattern::SafeRegex(RegexMatcher {
            regex: ".*".to_owned(),
            ..Default::default()
        }),
    })
}

/// `url_path`: the path without the query.
fn path(p: &AuthorizationPattern) -> Permission {
    if p.kind() == PatternKind::Any {
        return any_rule();
    }
    perm(permission::Rule::UrlPath(PathMatcher {
        rule: Some(path_matcher::Rule::Path(pattern(p))),
    }))
}

/// `:authority` compared without its `:port`, ignoring case.
fn host(p: &AuthorizationPattern) -> Permission {
    let port = "(:[0-9]+)?";
    let mut matcher = match p.kind() {
        PatternKind::Any => return any_rule(),
        PatternKind::Exact => regex(&format!("(?i){}{port}", escape(&p.value))),
        PatternKind::Suffix => regex(&format!("(?i).*{}{port}", escape(&p.value))),
        // A host prefix ends in '.', so it never reaches into the port.
        _ => pattern(p),
    };
    matcher.ignore_case = matches!(p.kind(), PatternKind::Prefix);
    header(":authority", matcher)
}

fn peer(matcher: StringMatcher) -> Principal {
    id(principal::Identifier::Authenticated(principal::Authenticated {
        principal_name: Some(matcher),
    }))
}

/// A canonical CIDR (validated); the address alone is a host route.
fn cidr(block: &str) -> CidrRange {
    let (address, len) = block.split_once('/').unwrap_or((block, ""));
    let host = if address.contains(':') { 128 } else { 32 };
    CidrRange {
        address_prefix: address.to_owned(),
        prefix_len: Some(UInt32Value {
            value: len.parse().unwrap_or(host),
        }),
    }
}

fn header(name: &str, matcher: StringMatcher) -> Permission {
    perm(permission::Rule::Header(HeaderMatcher {
        name: name.to_owned(),
        header_match_specifier: Some(header_matcher::HeaderMatchSpecifier::StringMatch(matcher)),
        ..Default::default()
    }))
}

fn exact(value: &str) -> StringMatcher {
    string(string_matcher::MatchPattern::Exact(value.to_owned()))
}

fn prefix(value: &str) -> StringMatcher {
    string(string_matcher::MatchPattern::Prefix(value.to_owned()))
}

/// Envoy matches a safe regex against the whole value.
fn regex(regex: &str) -> StringMatcher {
    string(string_matcher::MatchPattern::SafeRegex(RegexMatcher {
        regex: regex.to_owned(),
        ..Default::default()
    }))
}

fn escape(text: &str) -> String {
    regex_syntax::escape(text)
}

fn string(pattern: string_matcher::MatchPattern) -> StringMatcher {
    StringMatcher {
        match_pattern: Some(pattern),
        ..Default::default()
    }
}

fn or_rules(rules: Vec<Permission>) -> Permission {
    perm(permission::Rule::OrRules(permission::Set { rules }))
}

fn perm(rule: permission::Rule) -> Permission {
    Permission { rule: Some(rule) }
}

fn any_rule() -> Permission {
    perm(permission::Rule::Any(true))
}

fn id(identifier: principal::Identifier) -> Principal {
    Principal {
        identifier: Some(identifier),
    }
}

fn any_id() -> Principal {
    id(principal::Identifier::Any(true))
}
