//! Whether a route match accepts a request, as Envoy decides it from what the agent
//! compiles: the path without its query (exact; a prefix of whole segments; a regex
//! matching all of it), the method, every header (names without case; several values
//! joined by `,`) and every query parameter (its first value, percent-decoded). Regexes
//! match whole values. `aether explain` asks this to name the rule a request takes.

use std::fmt;

use aether_common::quote::clip;

use aether_proto::registry::v1::{MatchType, RouteMatch, ValueMatch};
use serde::Serialize;

use super::order::PathSpec;

/// An HTTP request, as far as route matching sees it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Request {
    /// Upper-case, e.g. `GET`.
    pub method: String,
    /// The path with its query string, e.g. `/a/b?x=1`.
    pub path: String,
    /// `(name, value)` as sent, in order.
    pub headers: Vec<(String, String)>,
}

impl Request {
    /// `GET path` without headers.
    pub fn get(path: &str) -> Request {
        Request {
            method: "GET".into(),
            path: path.into(),
            headers: Vec::new(),
        }
    }

    fn path_only(&self) -> &str {
        self.path.split(['?', '#']).next().unwrap_or_default()
    }

    /// Every value of the header, joined by `,` as Envoy matches them; `None`: absent.
    fn header(&self, name: &str) -> Option<String> {
        let values: Vec<&str> = self
            .headers
            .iter()
            .filter(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
            .collect();
        (!values.is_empty()).then(|| values.join(","))
    }

    /// The first value of the query parameter `name`, percent-decoded.
    fn query(&self, name: &str) -> Option<String> {
        let query = self.path.split_once('?')?.1.split('#').next().unwrap_or_default();
        let decode = |s: &str| percent_encoding::percent_decode_str(s).decode_utf8_lossy().into_owned();
        query
            .split('&')
            .map(|pair| pair.split_once('=').unwrap_or((pair, "")))
            .find(|(n, _)| decode(n) == name)
            .map(|(_, v)| decode(v))
    }
}

/// Shown in explanations; every part bounded (a request is the user's input).
impl fmt::Display for Request {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "{} {}", clip(&self.method), clip(&self.path))?;
        for (name, value) in &self.headers {
            write!(f, " [{}: {}]", clip(name), clip(value))?;
        }
        Ok(())
    }
}

/// Whether the match with path `path` and the rest of `matched` (`None`: a rule without
/// matches) accepts `request`.
pub fn matches(request: &Request, path: &PathSpec, matched: Option<&RouteMatch>) -> bool {
    if !path_matches(path, request.path_only()) {
        return false;
    }
    let Some(matched) = matched else { return true };
    (matched.method.is_empty() || matched.method == request.method)
        && matched
            .headers
            .iter()
            .all(|h| value_matches(h, request.header(&h.name)))
        && matched
            .query_params
            .iter()
            .all(|q| value_matches(q, request.query(&q.name)))
}

fn path_matches(spec: &PathSpec, path: &str) -> bool {
    match spec {
        PathSpec::Exact(exact) => path == exact,
        PathSpec::Prefix(prefix) if prefix == "/" => true,
        PathSpec::Prefix(prefix) => path
            .strip_prefix(prefix.as_str())
            .is_some_and(|rest| rest.is_empty() || rest.starts_with('/')),
        PathSpec::Regex(regex) => whole(regex, path),
    }
}

fn value_matches(m: &ValueMatch, value: Option<String>) -> bool {
    let Some(value) = value else { return false };
    match m.r#type() {
        MatchType::Regex => whole(&m.value, &value),
        _ => value == m.value,
    }
}

/// Whether `regex` matches all of `text` (a regex that does not compile matches nothing:
/// validation refuses it before it gets here).
fn whole(regex: &str, text: &str) -> bool {
    regex::Regex::new(&format!("^(?:{regex})$")).is_ok_and(|r| r.is_match(text))
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_request_is_shown_bounded() {
        let mut request = super::Request::get(&format!("/{}", "p".repeat(1 << 20)));
        request.headers.push(("x-big".into(), "v".repeat(1 << 16)));
        let shown = request.to_string();
        assert!(shown.len() < 1024, "{} bytes", shown.len());
        assert!(shown.starts_with("GET /ppp"), "{shown}");
        assert_eq!(super::Request::get("/short").to_string(), "GET /short");
    }

    use super::*;

    fn value(name: &str, kind: MatchType, value: &str) -> ValueMatch {
        ValueMatch {
            name: name.into(),
            r#type: kind as i32,
            value: value.into(),
        }
    }

    fn with(method: &str, path: &str, headers: &[(&str, &str)]) -> Request {
        Request {
            method: method.into(),
            path: path.into(),
            headers: headers.iter().map(|(n, v)| ((*n).into(), (*v).into())).collect(),
        }
    }

    #[test]
    fn paths_match_without_their_query_and_prefixes_by_whole_segments() {
        let accepts = |spec: PathSpec, path: &str| matches(&Request::get(path), &spec, None);
        assert!(accepts(PathSpec::Exact("/a".into()), "/a?x=1"));
        assert!(!accepts(PathSpec::Exact("/a".into()), "/a/"));
        assert!(accepts(PathSpec::Prefix("/a".into()), "/a"));
        assert!(accepts(PathSpec::Prefix("/a".into()), "/a/b#frag"));
        assert!(!accepts(PathSpec::Prefix("/a".into()), "/ab"));
        assert!(accepts(PathSpec::Prefix("/".into()), "/anything"));
        assert!(accepts(PathSpec::Regex("/v[0-9]+".into()), "/v12?q"));
        assert!(!accepts(PathSpec::Regex("/v[0-9]+".into()), "/v12/x"));
    }

    #[test]
    fn method_headers_and_queries_must_all_match() {
        let matched = RouteMatch {
            method: "POST".into(),
            headers: vec![value("x-env", MatchType::Regex, "canary|beta")],
            query_params: vec![value("Debug", MatchType::Exact, "on off")],
            ..Default::default()
        };
        let all = PathSpec::Prefix("/".into());
        let accepts = |request: &Request| matches(request, &all, Some(&matched));
        assert!(accepts(&with("POST", "/?Debug=on%20off&Debug=2", &[("X-Env", "beta")])));
        assert!(!accepts(&with("GET", "/?Debug=on%20off", &[("x-env", "beta")])));
        assert!(!accepts(&with("POST", "/?debug=on%20off", &[("x-env", "beta")])));
        assert!(!accepts(&with(
            "POST",
            "/?Debug=2&Debug=on%20off",
            &[("x-env", "beta")]
        )));
        assert!(!accepts(&with("POST", "/?Debug=on%20off", &[("x-env", "betamax")])));
        assert!(!accepts(&with("POST", "/?Debug=on%20off", &[])));
    }

    #[test]
    fn repeated_headers_match_as_one_joined_value() {
        let matched = RouteMatch {
            headers: vec![value("x-tag", MatchType::Exact, "a,b")],
            ..Default::default()
        };
        let request = with("GET", "/", &[("x-tag", "a"), ("x-tag", "b")]);
        assert!(matches(&request, &PathSpec::Prefix("/".into()), Some(&matched)));
        assert_eq!(request.to_string(), "GET / [x-tag: a] [x-tag: b]");
    }
}
