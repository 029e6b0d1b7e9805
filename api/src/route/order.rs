//! Gateway API precedence between the rules of the routes attached to one service port:
//! the one order the agent compiles into Envoy and `aether explain` walks to say which
//! rule a request takes. Every match of every rule is one entry ([`MatchRef`]); the
//! first entry that accepts a request ([`super::request`]) is the rule Envoy applies.
//!
//! Precedence, first difference wins: the path match (exact, then regex, then prefix; a
//! longer value first within each: Gateway API orders exact before prefixes and leaves
//! regexes to the implementation, and above the prefixes a rule's implicit `/` never
//! hides them), a method match, more header matches, more query matches; then the older
//! route, then `<namespace>/<name>`, then rule order. For a gRPC method the path stands
//! in for service and method (longer is more specific).

use std::cmp::Reverse;

use aether_proto::registry::v1::{GrpcMethodMatch, MatchType, Route, RouteKind, RouteMatch, RouteRule};

use super::request::{Request, matches};

/// The path part of a match, normalized: what precedence ranks, Envoy matches and
/// rewrites build on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PathSpec {
    Exact(String),
    /// Whole segments; no trailing `/` (Gateway API ignores it), `/` alone for everything.
    Prefix(String),
    /// RE2, matching the whole path.
    Regex(String),
}

impl PathSpec {
    /// The path a match selects; a rule without matches selects every path.
    pub fn of(kind: RouteKind, matched: Option<&RouteMatch>) -> PathSpec {
        let Some(matched) = matched else {
            return PathSpec::Prefix("/".into());
        };
        if kind == RouteKind::Grpc {
            return matched
                .grpc_method
                .as_ref()
                .map_or(PathSpec::Prefix("/".into()), grpc_path);
        }
        match &matched.path {
            None => PathSpec::Prefix("/".into()),
            Some(path) => match path.r#type() {
                MatchType::Exact => PathSpec::Exact(path.value.clone()),
                MatchType::Regex => PathSpec::Regex(path.value.clone()),
                MatchType::PathPrefix | MatchType::Unspecified => prefix(&path.value),
            },
        }
    }
}

fn prefix(value: &str) -> PathSpec {
    let trimmed = value.trim_end_matches('/');
    PathSpec::Prefix(if trimmed.is_empty() { "/".into() } else { trimmed.into() })
}

/// A gRPC method is the path `/<service>/<method>`: both exact is an exact path, the
/// service alone a prefix, anything else a regex.
fn grpc_path(method: &GrpcMethodMatch) -> PathSpec {
    let any = "[^/]+";
    match (method.r#type(), method.service.as_str(), method.method.as_str()) {
        (MatchType::Regex, service, name) => PathSpec::Regex(format!(
            "/{}/{}",
            if service.is_empty() { any } else { service },
            if name.is_empty() { any } else { name }
        )),
        (_, "", "") => PathSpec::Prefix("/".into()),
        (_, service, "") => PathSpec::Prefix(format!("/{service}")),
        (_, "", name) => PathSpec::Regex(format!("/{any}/{}", escape(name))),
        (_, service, name) => PathSpec::Exact(format!("/{service}/{name}")),
    }
}

/// `text` as an RE2 literal.
pub fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if "\\.+*?()|[]{}^$".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// One match of one rule of one route, in precedence order among its port's.
#[derive(Clone, Debug)]
pub struct MatchRef<'a> {
    pub route: &'a Route,
    pub rule_index: usize,
    /// The match within the rule; `None`: the rule has no matches (every request).
    pub match_index: Option<usize>,
    pub path: PathSpec,
}

/// What orders two entries (module docs); the first difference wins.
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

impl<'a> MatchRef<'a> {
    fn new(route: &'a Route, rule_index: usize, match_index: Option<usize>) -> Self {
        let matched = match_index.map(|i| &route.rules[rule_index].matches[i]);
        MatchRef {
            route,
            rule_index,
            match_index,
            path: PathSpec::of(route.kind(), matched),
        }
    }

    pub fn rule(&self) -> &'a RouteRule {
        &self.route.rules[self.rule_index]
    }

    pub fn matched(&self) -> Option<&'a RouteMatch> {
        self.match_index.map(|i| &self.rule().matches[i])
    }

    /// The rule's name, or its index when it has none (what Envoy's route names show).
    pub fn rule_label(&self) -> String {
        match self.rule().name.as_str() {
            "" => self.rule_index.to_string(),
            name => name.to_owned(),
        }
    }

    /// Whether this match takes `request` (path, method, headers, query).
    pub fn accepts(&self, request: &Request) -> bool {
        matches(request, &self.path, self.matched())
    }

    fn rank(&self) -> Rank<'a> {
        let (path_kind, path_len) = match &self.path {
            PathSpec::Exact(p) => (0, p.len()),
            PathSpec::Regex(p) => (1, p.len()),
            PathSpec::Prefix(p) => (2, p.len()),
        };
        let m = self.matched();
        Rank {
            path_kind,
            path_len: Reverse(path_len),
            method: Reverse(m.is_some_and(|m| !m.method.is_empty())),
            headers: Reverse(m.map_or(0, |m| m.headers.len())),
            queries: Reverse(m.map_or(0, |m| m.query_params.len())),
            created: self.route.created_unix_seconds,
            namespace: &self.route.namespace,
            name: &self.route.name,
            kind: self.route.kind,
            rule: self.rule_index,
            matched: self.match_index.unwrap_or(0),
        }
    }
}

/// Orders routes that tie on everything they match (TCP and TLS routes match no
/// request) by Gateway API precedence: the oldest first, then by namespace and name.
pub fn oldest_first(routes: &mut [&Route]) {
    fn key(r: &Route) -> (i64, &str, &str) {
        (r.created_unix_seconds, &r.namespace, &r.name)
    }
    routes.sort_by(|a, b| key(a).cmp(&key(b)));
}

/// Every match of every rule of `routes` (a rule without matches once), most
/// specific first.
pub fn ordered_matches<'a>(routes: &[&'a Route]) -> Vec<MatchRef<'a>> {
    let mut entries = Vec::new();
    for route in routes {
        for (rule_index, rule) in route.rules.iter().enumerate() {
            if rule.matches.is_empty() {
                entries.push(MatchRef::new(route, rule_index, None));
            }
            entries.extend((0..rule.matches.len()).map(|i| MatchRef::new(route, rule_index, Some(i))));
        }
    }
    entries.sort_by_key(MatchRef::rank);
    entries
}

/// The entry Envoy applies to `request`: the first in precedence order that accepts it
/// (`None`: no rule does, and the mesh answers 404).
pub fn first_match<'r, 'a>(ordered: &'r [MatchRef<'a>], request: &Request) -> Option<&'r MatchRef<'a>> {
    ordered.iter().find(|m| m.accepts(request))
}

#[cfg(test)]
mod tests;
