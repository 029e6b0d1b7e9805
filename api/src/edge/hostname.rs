//! Gateway API hostnames: exact (`foo.example.com`) or a leading wildcard label
//! (`*.example.com`, a suffix match over one or more labels: it matches
//! `a.example.com` and `a.b.example.com`, never `example.com`).

use crate::route::check;

/// Whether `host` is one of the hosts `pattern` names. Both are compared ASCII
/// case-insensitively, and a `:port` after `host` is ignored (as the API asks of Host
/// headers). `host` may itself be a wildcard: `*.a.example.com` is named by
/// `*.example.com` (every host it names is), and `*.example.com` by itself.
pub fn host_matches(pattern: &str, host: &str) -> bool {
    let host = strip_port(host);
    match pattern.strip_prefix("*.") {
        None => pattern.eq_ignore_ascii_case(host),
        Some(suffix) => {
            // `host` = one or more characters, '.', `suffix`.
            let Some(cut) = host.len().checked_sub(suffix.len() + 1) else {
                return false;
            };
            cut > 0
                && host.is_char_boundary(cut)
                && host[cut..].starts_with('.')
                && host[cut + 1..].eq_ignore_ascii_case(suffix)
        }
    }
}

/// The hosts a route serves on a listener: the Gateway API's intersection of the
/// listener's hostname and the route's `hostnames`, lower-cased, deduplicated, in the
/// route's order.
///
/// - Neither sets one: empty (every host).
/// - Only the listener: the listener's. Only the route: the route's.
/// - Both: each route hostname the listener's names (an exact host under a wildcard
///   listener, a narrower or equal wildcard), and the listener's own where a route
///   wildcard names it (`*.example.com` on a `foo.example.com` listener serves
///   `foo.example.com` only). Empty when nothing intersects: the route does not attach.
///
/// For one hostname on each side the result does not depend on which side is which.
pub fn intersect(listener: Option<&str>, route: &[String]) -> Vec<String> {
    let mut hosts: Vec<String> = Vec::new();
    let mut push = |host: &str| {
        let host = host.to_ascii_lowercase();
        if !hosts.contains(&host) {
            hosts.push(host);
        }
    };
    match listener {
        None => route.iter().for_each(|h| push(h)),
        Some(listener) if route.is_empty() => push(listener),
        Some(listener) => {
            for hostname in route {
                if host_matches(listener, hostname) {
                    push(hostname);
                } else if host_matches(hostname, listener) {
                    push(listener);
                }
            }
        }
    }
    hosts
}

/// A listener's hostname: a lower-case DNS name with a dot, or `*.` and one; never an IP
/// (the rule the mesh applies to TLSRoute server names, so both sides agree).
pub fn check(hostname: &str) -> Result<(), String> {
    check::server_name(hostname)
}

fn strip_port(host: &str) -> &str {
    match host.rsplit_once(':') {
        Some((name, port)) if !port.is_empty() && port.bytes().all(|b| b.is_ascii_digit()) => name,
        _ => host,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(hosts: &[&str]) -> Vec<String> {
        hosts.iter().map(|h| (*h).to_owned()).collect()
    }

    #[test]
    fn exact_patterns_match_only_themselves() {
        assert!(host_matches("shop.example.org", "shop.example.org"));
        assert!(host_matches("shop.example.org", "SHOP.Example.org"));
        assert!(host_matches("shop.example.org", "shop.example.org:8443"));
        assert!(!host_matches("shop.example.org", "cart.shop.example.org"));
        assert!(!host_matches("shop.example.org", "example.org"));
        assert!(!host_matches("shop.example.org", "*.example.org"));
        assert!(!host_matches("shop.example.org", ""));
    }

    #[test]
    fn wildcards_match_one_or_more_labels_in_front_of_the_suffix() {
        assert!(host_matches("*.example.org", "a.example.org"));
        assert!(host_matches("*.example.org", "a.b.example.org"));
        assert!(host_matches("*.example.org", "A.EXAMPLE.ORG:80"));
        assert!(!host_matches("*.example.org", "example.org"));
        assert!(!host_matches("*.example.org", ".example.org"));
        assert!(!host_matches("*.example.org", "aexample.org"));
        assert!(!host_matches("*.example.org", "a.example.org.evil"));
        assert!(!host_matches("*.example.org", "org"));
        // A wildcard host is named by an equal or broader wildcard.
        assert!(host_matches("*.example.org", "*.example.org"));
        assert!(host_matches("*.example.org", "*.a.example.org"));
        assert!(!host_matches("*.a.example.org", "*.example.org"));
        // Multi-byte input never splits a character.
        assert!(!host_matches("*.é.org", "xé.org"));
        assert!(host_matches("*.é.org", "x.é.org"));
    }

    #[test]
    fn a_port_is_ignored_only_when_it_is_digits() {
        assert!(host_matches("a.example.org", "a.example.org:1"));
        assert!(!host_matches("a.example.org", "a.example.org:"));
        assert!(!host_matches("a.example.org", "a.example.org:x"));
    }

    #[test]
    fn intersection_when_one_side_is_unset() {
        assert_eq!(intersect(None, &[]), Vec::<String>::new());
        assert_eq!(
            intersect(None, &strings(&["b.example.org", "B.example.org", "a.example.org"])),
            strings(&["b.example.org", "a.example.org"])
        );
        assert_eq!(intersect(Some("*.example.org"), &[]), strings(&["*.example.org"]));
        assert_eq!(intersect(Some("a.example.org"), &[]), strings(&["a.example.org"]));
    }

    #[test]
    fn intersection_of_an_exact_listener() {
        let listener = Some("api.example.org");
        let route = strings(&[
            "other.example.net",
            "*.example.org",
            "api.example.org",
            "*.api.example.org",
        ]);
        // The wildcard names the listener's host; the exact host is the same one.
        assert_eq!(intersect(listener, &route), strings(&["api.example.org"]));
        assert!(intersect(listener, &strings(&["*.api.example.org", "example.org"])).is_empty());
    }

    #[test]
    fn intersection_of_a_wildcard_listener() {
        let listener = Some("*.example.org");
        let route = strings(&[
            "example.org",
            "a.example.org",
            "b.c.example.org",
            "*.d.example.org",
            "*.example.org",
            "*.org",
            "a.example.net",
        ]);
        assert_eq!(
            intersect(listener, &route),
            strings(&["a.example.org", "b.c.example.org", "*.d.example.org", "*.example.org"])
        );
        assert!(intersect(listener, &strings(&["example.org", "*.net"])).is_empty());
    }

    #[test]
    fn intersection_of_single_hostnames_does_not_depend_on_the_side() {
        let names = [
            "a.example.org",
            "*.example.org",
            "*.a.example.org",
            "*.org",
            "b.example.net",
            "example.org",
        ];
        for a in names {
            for b in names {
                let one = intersect(Some(a), &strings(&[b]));
                let other = intersect(Some(b), &strings(&[a]));
                assert_eq!(one, other, "{a} × {b}");
            }
        }
    }

    #[test]
    fn listener_hostnames_are_dns_names_or_wildcards() {
        for ok in ["a.example.org", "*.example.org", "x-1.y"] {
            assert_eq!(check(ok), Ok(()), "{ok}");
        }
        for bad in [
            "",
            "*",
            "*.",
            "a.*.org",
            "10.0.0.1",
            "A.example.org",
            "a..org",
            "localhost",
            "a_b.org",
        ] {
            assert!(check(bad).is_err(), "{bad}");
        }
    }
}
