//! One service port's routes, compiled: every match of every rule of the routes
//! attached to it becomes one Envoy route, in Gateway API precedence
//! (`aether_api::route::order`, the order `aether explain` walks too), and a request
//! no rule matches gets 404 (GAMMA).

use aether_api::route::order::{MatchRef, ordered_matches};
use aether_proto::registry::v1::Route;
use envoy_types::pb::envoy::config::route::v3::{Route as EnvoyRoute, route};

use super::actions::{self, Target, header_edits};
use super::direct;
use super::matching;
use crate::xds::resources::http_filters;

/// The Envoy routes of one service port, from the routes attached to it.
pub fn compile(routes: &[&Route], target: &Target) -> Vec<EnvoyRoute> {
    let mut compiled = compile_rules(routes, target);
    compiled.push(direct(404, "no route rule matches this request\n"));
    compiled
}

/// The routes' rules in Gateway API precedence, without the final 404 (the edge chains
/// the rules of several hostnames in one virtual host).
pub fn compile_rules(routes: &[&Route], target: &Target) -> Vec<EnvoyRoute> {
    let mut compiled: Vec<EnvoyRoute> = Vec::new();
    for entry in &ordered_matches(routes) {
        let route = envoy_route(entry, target);
        if actions::port_dropping_redirect(entry.rule()).is_some() {
            compiled.extend(per_authority(&route, target.domains));
        }
        compiled.push(route);
    }
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

fn envoy_route(entry: &MatchRef, target: &Target) -> EnvoyRoute {
    let (route, rule) = (entry.route, entry.rule());
    let (request, response) = header_edits(&rule.filters);
    let key = aether_proto::view::route_key(route);
    let enabled = target.route_filters.get(key.as_str()).copied().unwrap_or_default();
    EnvoyRoute {
        // Callers-side HTTP filters attached to this route (disabled in the HCM).
        typed_per_filter_config: http_filters::enabling(enabled).collect(),
        // The route key and rule: what access logs and config dumps show.
        name: format!("{key}/{}", entry.rule_label()),
        r#match: Some(matching::route_match(&entry.path, entry.matched())),
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
