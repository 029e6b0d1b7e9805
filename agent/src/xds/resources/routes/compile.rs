//! One service port's routes, compiled: every match of every rule of the routes
//! attached to it becomes one Envoy route, ordered by Gateway API precedence, and a
//! request no rule matches gets 404 (GAMMA).
//!
//! Precedence, first difference wins: the path match (exact, then regex, then
//! prefix; a longer value first within each: Gateway API orders exact before
//! prefixes and leaves regexes to the implementation, and above the prefixes a rule's
//! implicit `/` never hides them), a method match, more header matches, more query
//! matches; then the older route, then `<namespace>/<name>`, then rule order. For a
//! gRPC method the path stands in for service and method (longer is more specific).

use std::cmp::Reverse;

use aether_proto::registry::v1::{Route, RouteMatch, RouteRule};
use envoy_types::pb::envoy::config::route::v3::{Route as EnvoyRoute, route};

use super::actions::{self, Target, header_edits};
use super::direct;
use super::matching::{self, PathSpec};

/// One match of one rule, with what orders it.
struct Entry<'a> {
    route: &'a Route,
    rule_index: usize,
    rule: &'a RouteRule,
    matched: Option<&'a RouteMatch>,
    path: PathSpec,
    rank: Rank<'a>,
}

#[derive(PartialEq, Eq, PartialOrd, Ord)]
struct Rank<'a> {
    path_kind: u8,
    path_len: Reverse<usize>,
    method: Reverse<bool>,
    headers: Reverse<usize>,
    queries: Reverse<usize>,
    created: i64,
    namespace: &'a str,
    name: &'a str,
    kind: i32,
    rule: usize,
    matched: usize,
}

impl<'a> Entry<'a> {
    fn new(route: &'a Route, rule_index: usize, matched: Option<(usize, &'a RouteMatch)>) -> Self {
        let rule = &route.rules[rule_index];
        let path = PathSpec::of(route.kind(), matched.map(|(_, m)| m));
        let (path_kind, path_len) = match &path {
            PathSpec::Exact(p) => (0, p.len()),
            PathSpec::Regex(p) => (1, p.len()),
            PathSpec::Prefix(p) => (2, p.len()),
        };
        let m = matched.map(|(_, m)| m);
        let rank = Rank {
            path_kind,
            path_len: Reverse(path_len),
            method: Reverse(m.is_some_and(|m| !m.method.is_empty())),
            headers: Reverse(m.map_or(0, |m| m.headers.len())),
            queries: Reverse(m.map_or(0, |m| m.query_params.len())),
            created: route.created_unix_seconds,
            namespace: &route.namespace,
            name: &route.name,
            kind: route.kind,
            rule: rule_index,
            matched: matched.map_or(0, |(i, _)| i),
        };
        Entry {
            route,
            rule_index,
            rule,
            matched: m,
            path,
            rank,
        }
    }
}

/// The Envoy routes of one service port, from the routes attached to it.
pub fn compile(routes: &[&Route], target: &Target) -> Vec<EnvoyRoute> {
    let mut entries: Vec<Entry> = Vec::new();
    for route in routes {
        for (rule_index, rule) in route.rules.iter().enumerate() {
            if rule.matches.is_empty() {
                entries.push(Entry::new(route, rule_index, None));
            }
            for matched in rule.matches.iter().enumerate() {
                entries.push(Entry::new(route, rule_index, Some(matched)));
            }
        }
    }
    entries.sort_by(|a, b| a.rank.cmp(&b.rank));
    let mut compiled: Vec<EnvoyRoute> = Vec::new();
    for entry in &entries {
        let route = envoy_route(entry, target);
        if actions::port_dropping_redirect(entry.rule).is_some() {
            compiled.extend(per_authority(&route, target.domains));
        }
        compiled.push(route);
    }
    compiled.push(direct(404, "no route rule matches this request\n"));
    compiled
}

/// Copies of a redirect route, one per authority with a port, each redirecting to the
/// host without the port (the route itself stays, last, for authorities without one).
fn per_authority(route: &EnvoyRoute, domains: &[String]) -> Vec<EnvoyRoute> {
    let with_port = domains.iter().filter_map(|d| {
        let (host, port) = d.rsplit_once(':')?;
        (!port.is_empty() && port.bytes().all(|b| b.is_ascii_digit())).then_some((d, host))
    });
    with_port
        .map(|(authority, host)| {
            let mut copy = route.clone();
            if let Some(m) = copy.r#match.as_mut() {
                m.headers.push(matching::exact_header(":authority", authority));
            }
            if let Some(route::Action::Redirect(redirect)) = copy.action.as_mut() {
                redirect.host_redirect = host.to_owned();
            }
            copy
        })
        .collect()
}

fn envoy_route(entry: &Entry, target: &Target) -> EnvoyRoute {
    let Entry { route, rule, .. } = entry;
    let (request, response) = header_edits(&rule.filters);
    let rule_label = if rule.name.is_empty() {
        entry.rule_index.to_string()
    } else {
        rule.name.clone()
    };
    EnvoyRoute {
        // The route key and rule: what access logs and config dumps show.
        name: format!("{}/{rule_label}", aether_proto::view::route_key(route)),
        r#match: Some(matching::route_match(&entry.path, entry.matched)),
        action: Some(actions::action(rule, &entry.path, target)),
        request_headers_to_add: request.add,
        request_headers_to_remove: request.remove,
        response_headers_to_add: response.add,
        response_headers_to_remove: response.remove,
        // Named rules get their own stats: vhost.<vhost>.route.<ns>.<route>.<rule>.*
        stat_prefix: if rule.name.is_empty() {
            String::new()
        } else {
            format!("{}.{}.{}", route.namespace, route.name, rule.name)
        },
        ..Default::default()
    }
}
