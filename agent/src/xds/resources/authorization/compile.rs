//! One policy rule → one Envoy RBAC policy, for the TCP chain of the inbound listener
//! (the HTTP chain's rules are an indexed matcher, see `index`).
//!
//! Sources become principals (the mTLS peer's URI SAN, the connection's peer address).
//! The port is the app port the chain delivers to (the pod's primary port), known when
//! compiling, so an operation is settled here: it matches every connection when it names
//! no HTTP field and its ports hold for that port, else none.

use aether_api::authorization::{namespace_prefix, service_account_id};
use aether_proto::registry::v1::{
    AuthorizationOperation, AuthorizationPattern, AuthorizationRule, AuthorizationSource, PatternKind,
};
use envoy_types::pb::envoy::config::core::v3::CidrRange;
use envoy_types::pb::envoy::config::rbac::v3::{Permission, Policy, Principal, permission, principal};
use envoy_types::pb::envoy::r#type::matcher::v3::{StringMatcher, string_matcher};
use envoy_types::pb::google::protobuf::UInt32Value;

/// The rule as an Envoy policy for connections delivered to `port`; `None` when it can
/// never match there.
pub fn rule(rule: &AuthorizationRule, port: u16, trust_domain: &str) -> Option<Policy> {
    let matches_port = rule.to.is_empty() || rule.to.iter().any(|o| operation_holds(o, u32::from(port)));
    let principals = match rule.from.is_empty() {
        true => vec![any_id()],
        false => rule.from.iter().map(|s| source(s, trust_domain)).collect(),
    };
    matches_port.then(|| Policy {
        permissions: vec![Permission {
            rule: Some(permission::Rule::Any(true)),
        }],
        principals,
        ..Default::default()
    })
}

/// Whether the operation holds for every raw TCP connection to `port`: no HTTP field
/// (none can be judged there), and its ports hold.
fn operation_holds(o: &AuthorizationOperation, port: u32) -> bool {
    let l7 = [&o.methods, &o.not_methods].iter().any(|l| !l.is_empty())
        || [&o.paths, &o.not_paths, &o.hosts, &o.not_hosts]
            .iter()
            .any(|l| !l.is_empty());
    let ports = o.ports.is_empty() || o.ports.contains(&port);
    !l7 && ports && !o.not_ports.contains(&port)
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

/// The caller's verified SPIFFE ID. `*` means "any verified caller".
fn principal_matcher(p: &AuthorizationPattern) -> StringMatcher {
    match p.kind() {
        PatternKind::Prefix => prefix(&p.value),
        PatternKind::Suffix => string(string_matcher::MatchPattern::Suffix(p.value.clone())),
        PatternKind::Any => prefix("spiffe://"),
        // validate() refuses an unspecified kind; never reached for a checked policy.
        PatternKind::Exact | PatternKind::Unspecified => exact(&p.value),
    }
}

fn peer(matcher: StringMatcher) -> Principal {
    id(principal::Identifier::Authenticated(principal::Authenticated {
        principal_name: Some(matcher),
    }))
}

/// A canonical CIDR (validated); the address alone is a host route.
pub fn cidr(block: &str) -> CidrRange {
    let (address, len) = block.split_once('/').unwrap_or((block, ""));
    let host = if address.contains(':') { 128 } else { 32 };
    CidrRange {
        address_prefix: address.to_owned(),
        prefix_len: Some(UInt32Value {
            value: len.parse().unwrap_or(host),
        }),
    }
}

fn exact(value: &str) -> StringMatcher {
    string(string_matcher::MatchPattern::Exact(value.to_owned()))
}

fn prefix(value: &str) -> StringMatcher {
    string(string_matcher::MatchPattern::Prefix(value.to_owned()))
}

fn string(pattern: string_matcher::MatchPattern) -> StringMatcher {
    StringMatcher {
        match_pattern: Some(pattern),
        ..Default::default()
    }
}

fn id(identifier: principal::Identifier) -> Principal {
    Principal {
        identifier: Some(identifier),
    }
}

fn any_id() -> Principal {
    id(principal::Identifier::Any(true))
}
