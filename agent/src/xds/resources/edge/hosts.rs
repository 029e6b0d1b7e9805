//! Which virtual hosts an edge route table holds and which routes each one serves, so
//! that a request reaches only the routes of the Gateway listener its host belongs to
//! (the most specific listener hostname that matches it: listener isolation, GEP-1713),
//! and among those the routes of its most specific hostname first (Gateway API
//! precedence: hostname before path).
//!
//! Envoy picks a virtual host by the most specific domain (exact, then the longest
//! `*.` suffix, then `*`), and never falls back to a less specific one when no route of
//! the chosen one matches. So a virtual host carries, after its own hostname's routes,
//! the routes of its listener's wider hostnames that cover it, and every listener
//! hostname gets a virtual host even with no route of its own (a request for it must
//! not reach a wider listener's routes).

use std::collections::BTreeMap;

use aether_api::edge::EdgeListener;
use aether_proto::registry::v1::Route;

/// One virtual host.
#[derive(Debug, PartialEq)]
pub struct Host<'a> {
    /// The Gateway listener it belongs to.
    pub listener: &'a str,
    /// An exact host, a `*.` wildcard or `*`.
    pub domain: String,
    /// The routes it serves, by hostname, the most specific hostname first.
    pub groups: Vec<Vec<&'a Route>>,
}

/// Orders hostnames the most specific first.
type Precedence = std::cmp::Reverse<(u8, usize)>;

/// Any host a listener without a hostname takes.
const ANY: &str = "*";

/// The virtual hosts of a table serving `listeners` (all on one port), sorted by domain.
pub fn plan<'a>(listeners: &[&'a EdgeListener]) -> Vec<Host<'a>> {
    let patterns: Vec<&str> = listeners.iter().map(|l| pattern(l)).collect();
    let mut hosts: BTreeMap<String, Host<'a>> = BTreeMap::new();
    for (listener, own) in listeners.iter().zip(&patterns) {
        // (hostname, route) for every route of the listener.
        let served: Vec<(&str, &'a Route)> = (listener.routes.iter())
            .flat_map(|a| {
                let names: Vec<&str> = match a.hostnames.is_empty() {
                    true => vec![*own],
                    false => a.hostnames.iter().map(String::as_str).collect(),
                };
                names.into_iter().map(move |h| (h, &a.route))
            })
            .collect();
        let mut domains: Vec<&str> = served.iter().map(|(h, _)| *h).chain([*own]).collect();
        domains.sort_unstable();
        domains.dedup();
        for domain in domains {
            if owner(&patterns, domain) != Some(*own) || hosts.contains_key(domain) {
                continue;
            }
            let mut groups: BTreeMap<(Precedence, &str), Vec<&'a Route>> = BTreeMap::new();
            for (hostname, route) in served.iter().filter(|(h, _)| covers(h, domain)) {
                let group = groups
                    .entry((std::cmp::Reverse(specificity(hostname)), hostname))
                    .or_default();
                if !group.iter().any(|r| std::ptr::eq(*r, *route)) {
                    group.push(route);
                }
            }
            let host = Host {
                listener: &listener.name,
                domain: domain.to_owned(),
                groups: groups.into_values().collect(),
            };
            hosts.insert(domain.to_owned(), host);
        }
    }
    hosts.into_values().collect()
}

/// A listener's hostname, or `*`.
fn pattern(listener: &EdgeListener) -> &str {
    listener.hostname.as_deref().unwrap_or(ANY)
}

/// The most specific listener pattern covering `domain`.
fn owner<'p>(patterns: &[&'p str], domain: &str) -> Option<&'p str> {
    (patterns.iter().copied())
        .filter(|p| covers(p, domain))
        .max_by_key(|p| specificity(p))
}

/// Whether every host `domain` stands for is one `pattern` takes (`domain` may itself be
/// a wildcard).
pub fn covers(pattern: &str, domain: &str) -> bool {
    if pattern == ANY || pattern == domain {
        return true;
    }
    match pattern.strip_prefix('*') {
        // `*.example.com` takes `a.example.com` and `*.a.example.com`, not `example.com`.
        Some(suffix) => domain.len() > suffix.len() && domain.ends_with(suffix) && domain != ANY,
        None => false,
    }
}

/// Exact names first, then wildcards by the length of their suffix, then `*`.
fn specificity(pattern: &str) -> (u8, usize) {
    match pattern {
        ANY => (0, 0),
        p if p.starts_with("*.") => (1, p.len()),
        p => (2, p.len()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use aether_api::edge::AttachedRoute;

    fn route(name: &str) -> Route {
        Route {
            namespace: "demo".into(),
            name: name.into(),
            ..Default::default()
        }
    }

    fn listener(name: &str, hostname: Option<&str>, routes: &[(&str, &[&str])]) -> EdgeListener {
        EdgeListener {
            name: name.into(),
            hostname: hostname.map(str::to_owned),
            certificates: Vec::new(),
            routes: routes
                .iter()
                .map(|(name, hostnames)| AttachedRoute {
                    route: route(name),
                    hostnames: hostnames.iter().map(|h| h.to_string()).collect(),
                })
                .collect(),
        }
    }

    fn layout(hosts: &[Host]) -> Vec<(String, String, Vec<Vec<String>>)> {
        hosts
            .iter()
            .map(|h| {
                let groups = h
                    .groups
                    .iter()
                    .map(|g| g.iter().map(|r| r.name.clone()).collect())
                    .collect();
                (h.listener.to_owned(), h.domain.clone(), groups)
            })
            .collect()
    }

    fn names(groups: &[&[&str]]) -> Vec<Vec<String>> {
        groups
            .iter()
            .map(|g| g.iter().map(|n| n.to_string()).collect())
            .collect()
    }

    #[test]
    fn a_listener_without_hostname_serves_any_host_and_its_routes_hostnames_first() {
        let l = listener(
            "http",
            None,
            &[
                ("all", &[]),
                ("foo", &["foo.example.com"]),
                ("wild", &["*.example.com"]),
            ],
        );
        let hosts = plan(&[&l]);
        assert_eq!(
            layout(&hosts),
            vec![
                ("http".into(), "*".into(), names(&[&["all"]])),
                ("http".into(), "*.example.com".into(), names(&[&["wild"], &["all"]])),
                (
                    "http".into(),
                    "foo.example.com".into(),
                    names(&[&["foo"], &["wild"], &["all"]])
                ),
            ]
        );
    }

    #[test]
    fn a_host_belongs_to_its_most_specific_listener_only() {
        // Listener isolation: `*.example.com`'s routes never answer for a host that a
        // more specific listener owns, even when that listener has no route for it.
        let wide = listener("wide", Some("*.example.com"), &[("wide-route", &[])]);
        let foo = listener("foo", Some("foo.example.com"), &[]);
        let deeper = listener("deeper", Some("*.bar.example.com"), &[("deeper-route", &[])]);
        let hosts = plan(&[&wide, &foo, &deeper]);
        assert_eq!(
            layout(&hosts),
            vec![
                ("deeper".into(), "*.bar.example.com".into(), names(&[&["deeper-route"]])),
                ("wide".into(), "*.example.com".into(), names(&[&["wide-route"]])),
                ("foo".into(), "foo.example.com".into(), names(&[])),
            ]
        );
    }

    #[test]
    fn a_route_hostname_another_listener_owns_is_left_to_that_listener() {
        let wide = listener("wide", Some("*.example.com"), &[("narrow", &["foo.example.com"])]);
        let foo = listener("foo", Some("foo.example.com"), &[("foo-route", &[])]);
        let hosts = plan(&[&wide, &foo]);
        let foo_host = hosts.iter().find(|h| h.domain == "foo.example.com").unwrap();
        assert_eq!(foo_host.listener, "foo");
        assert_eq!(layout(std::slice::from_ref(foo_host))[0].2, names(&[&["foo-route"]]));
    }

    #[test]
    fn wildcards_cover_deeper_names_but_not_their_own_suffix() {
        assert!(covers("*.example.com", "a.example.com"));
        assert!(covers("*.example.com", "a.b.example.com"));
        assert!(covers("*.example.com", "*.b.example.com"));
        assert!(covers("*.example.com", "*.example.com"));
        assert!(!covers("*.example.com", "example.com"));
        assert!(!covers("*.example.com", "*"));
        assert!(!covers("a.example.com", "b.example.com"));
        assert!(covers("*", "anything"));
    }
}
