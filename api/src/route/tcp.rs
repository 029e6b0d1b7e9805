//! TCPRoute and TLSRoute rules → the one `RouteRule` of a TCP or TLS route; a TLSRoute's
//! hostnames → the server names it takes.
//!
//! A TCPRoute rule matches nothing of its own, so on a Service parent the mesh takes
//! exactly one rule (more could never be told apart); its backends split connections by
//! weight. The API requires at least one rule and one backend per rule.

use std::collections::HashSet;

use aether_common::quote::quote;
use aether_proto::registry::v1::{RouteFilter, RouteRule};

use super::check::{self, limits};
use super::{Rejected, at, shared};
use crate::gateway::TcpRouteRule;

pub fn rules(rules: &[TcpRouteRule], namespace: &str) -> Result<Vec<RouteRule>, Rejected> {
    let rule = match rules {
        [rule] => rule,
        [] => {
            return Err(Rejected::unsupported(
                "spec.rules",
                "a TCPRoute or TLSRoute needs one rule",
            ));
        }
        more => {
            let message = format!(
                "{} rules; a TCPRoute or TLSRoute rule matches nothing, so a Service parent takes exactly one",
                more.len()
            );
            return Err(Rejected::unsupported("spec.rules", message));
        }
    };
    let field = "spec.rules[0]";
    let name = shared::rule_name(rule.name.as_deref(), &mut HashSet::new(), &format!("{field}.name"))?;
    if rule.backend_refs.is_empty() {
        return Err(Rejected::unsupported(
            format!("{field}.backendRefs"),
            "a TCPRoute or TLSRoute rule needs at least one backend",
        ));
    }
    if rule.backend_refs.len() > limits::BACKENDS {
        let message = format!("{} backends (at most 16)", rule.backend_refs.len());
        return Err(Rejected::unsupported(format!("{field}.backendRefs"), message));
    }
    let backends = (rule.backend_refs.iter().enumerate())
        .map(|(i, b)| shared::weighted_backend(b, namespace, &format!("{field}.backendRefs[{i}]"), no_filter))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(vec![RouteRule {
        name,
        backends,
        ..Default::default()
    }])
}

/// TCPRoute and TLSRoute backends have no filters.
fn no_filter(filter: &serde_json::Value, field: &str) -> Result<RouteFilter, Rejected> {
    let text = filter.to_string();
    let message = format!("{} : a TCPRoute or TLSRoute backend has no filters", quote(&text));
    Err(Rejected::unsupported(field, message))
}

/// A TLSRoute's server names, lower-cased and deduplicated: each a hostname or `*.`
/// followed by one (the API's wildcard form), at most 16.
pub fn hostnames(hostnames: &[String]) -> Result<Vec<String>, Rejected> {
    if hostnames.len() > limits::HOSTNAMES {
        let message = format!("{} hostnames (at most 16)", hostnames.len());
        return Err(Rejected::unsupported("spec.hostnames", message));
    }
    let mut projected: Vec<String> = Vec::new();
    for (i, hostname) in hostnames.iter().enumerate() {
        let lower = hostname.to_ascii_lowercase();
        at(format!("spec.hostnames[{i}]"), check::server_name(&lower))?;
        if !projected.contains(&lower) {
            projected.push(lower);
        }
    }
    Ok(projected)
}
