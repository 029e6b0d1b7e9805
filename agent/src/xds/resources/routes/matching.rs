//! A route match, as Envoy matches it: the path (Gateway API's segment-aware prefix is
//! Envoy's `path_separated_prefix`; a gRPC method is a path), headers, query
//! parameters and the method.

use aether_proto::registry::v1::{GrpcMethodMatch, MatchType, RouteKind, RouteMatch, ValueMatch};
use envoy_types::pb::envoy::config::route::v3::{
    HeaderMatcher, QueryParameterMatcher, RouteMatch as EnvoyMatch, header_matcher, query_parameter_matcher,
    route_match,
};
use envoy_types::pb::envoy::r#type::matcher::v3::{RegexMatcher, StringMatcher, string_matcher};

/// The path part of a match, normalized: what precedence ranks and rewrites build on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PathSpec {
    Exact(String),
    /// Whole segments; no trailing `/` (Gateway API ignores it), `/` alone for everything.
    Prefix(String),
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

    fn specifier(&self) -> route_match::PathSpecifier {
        match self {
            PathSpec::Exact(path) => route_match::PathSpecifier::Path(path.clone()),
            PathSpec::Prefix(prefix) if prefix == "/" => route_match::PathSpecifier::Prefix(prefix.clone()),
            PathSpec::Prefix(prefix) => route_match::PathSpecifier::PathSeparatedPrefix(prefix.clone()),
            PathSpec::Regex(regex) => route_match::PathSpecifier::SafeRegex(regex_matcher(regex)),
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

/// Envoy's match for `path` and the rest of `matched`.
pub fn route_match(path: &PathSpec, matched: Option<&RouteMatch>) -> EnvoyMatch {
    let mut headers: Vec<HeaderMatcher> = Vec::new();
    let mut query_parameters = Vec::new();
    if let Some(matched) = matched {
        if !matched.method.is_empty() {
            headers.push(header(":method", string(MatchType::Exact, &matched.method)));
        }
        headers.extend(matched.headers.iter().map(|h| header(&h.name, value(h))));
        query_parameters.extend(matched.query_params.iter().map(|q| QueryParameterMatcher {
            name: q.name.clone(),
            query_parameter_match_specifier: Some(query_parameter_matcher::QueryParameterMatchSpecifier::StringMatch(
                value(q),
            )),
        }));
    }
    EnvoyMatch {
        path_specifier: Some(path.specifier()),
        headers,
        query_parameters,
        ..Default::default()
    }
}

pub fn exact_header(name: &str, value: &str) -> HeaderMatcher {
    header(name, string(MatchType::Exact, value))
}

fn header(name: &str, matcher: StringMatcher) -> HeaderMatcher {
    HeaderMatcher {
        name: name.to_owned(),
        header_match_specifier: Some(header_matcher::HeaderMatchSpecifier::StringMatch(matcher)),
        ..Default::default()
    }
}

fn value(matched: &ValueMatch) -> StringMatcher {
    string(matched.r#type(), &matched.value)
}

fn string(kind: MatchType, value: &str) -> StringMatcher {
    let pattern = match kind {
        MatchType::Regex => string_matcher::MatchPattern::SafeRegex(regex_matcher(value)),
        _ => string_matcher::MatchPattern::Exact(value.to_owned()),
    };
    StringMatcher {
        match_pattern: Some(pattern),
        ..Default::default()
    }
}

pub fn regex_matcher(regex: &str) -> RegexMatcher {
    RegexMatcher {
        regex: regex.to_owned(),
        ..Default::default()
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

#[cfg(test)]
mod tests {
    use super::*;
    use aether_proto::registry::v1::PathMatch;

    fn path(kind: MatchType, value: &str) -> RouteMatch {
        RouteMatch {
            path: Some(PathMatch {
                r#type: kind as i32,
                value: value.into(),
            }),
            ..Default::default()
        }
    }

    fn grpc(kind: MatchType, service: &str, method: &str) -> PathSpec {
        let matched = RouteMatch {
            grpc_method: Some(GrpcMethodMatch {
                r#type: kind as i32,
                service: service.into(),
                method: method.into(),
            }),
            ..Default::default()
        };
        PathSpec::of(RouteKind::Grpc, Some(&matched))
    }

    #[test]
    fn paths_are_normalized_as_gateway_api_defines_them() {
        let http = |kind, value| PathSpec::of(RouteKind::Http, Some(&path(kind, value)));
        assert_eq!(http(MatchType::PathPrefix, "/foo/"), PathSpec::Prefix("/foo".into()));
        assert_eq!(http(MatchType::PathPrefix, "/"), PathSpec::Prefix("/".into()));
        assert_eq!(http(MatchType::Exact, "/foo/"), PathSpec::Exact("/foo/".into()));
        assert_eq!(http(MatchType::Regex, "/v[0-9]+"), PathSpec::Regex("/v[0-9]+".into()));
        assert_eq!(PathSpec::of(RouteKind::Http, None), PathSpec::Prefix("/".into()));
        assert_eq!(
            PathSpec::of(RouteKind::Http, Some(&RouteMatch::default())),
            PathSpec::Prefix("/".into())
        );
    }

    #[test]
    fn a_prefix_is_segment_aware_in_envoy() {
        let specifier = |spec: PathSpec| route_match(&spec, None).path_specifier.unwrap();
        assert_eq!(
            specifier(PathSpec::Prefix("/foo".into())),
            route_match::PathSpecifier::PathSeparatedPrefix("/foo".into())
        );
        // Envoy refuses a separated prefix of "/": everything is a plain prefix.
        assert_eq!(
            specifier(PathSpec::Prefix("/".into())),
            route_match::PathSpecifier::Prefix("/".into())
        );
        assert_eq!(
            specifier(PathSpec::Exact("/a".into())),
            route_match::PathSpecifier::Path("/a".into())
        );
    }

    #[test]
    fn grpc_methods_become_paths() {
        assert_eq!(
            grpc(MatchType::Exact, "pkg.Echo", "Say"),
            PathSpec::Exact("/pkg.Echo/Say".into())
        );
        assert_eq!(
            grpc(MatchType::Exact, "pkg.Echo", ""),
            PathSpec::Prefix("/pkg.Echo".into())
        );
        assert_eq!(
            grpc(MatchType::Exact, "", "Say.It"),
            PathSpec::Regex("/[^/]+/Say\\.It".into())
        );
        assert_eq!(grpc(MatchType::Exact, "", ""), PathSpec::Prefix("/".into()));
        assert_eq!(
            grpc(MatchType::Regex, "pkg\\..*", ""),
            PathSpec::Regex("/pkg\\..*/[^/]+".into())
        );
    }

    #[test]
    fn headers_queries_and_method_all_must_match() {
        let matched = RouteMatch {
            headers: vec![ValueMatch {
                name: "x-env".into(),
                r#type: MatchType::Regex as i32,
                value: "canary|beta".into(),
            }],
            query_params: vec![ValueMatch {
                name: "Debug".into(),
                r#type: MatchType::Exact as i32,
                value: "1".into(),
            }],
            method: "POST".into(),
            ..Default::default()
        };
        let envoy = route_match(&PathSpec::Prefix("/".into()), Some(&matched));
        let names: Vec<&str> = envoy.headers.iter().map(|h| h.name.as_str()).collect();
        assert_eq!(names, [":method", "x-env"]);
        assert_eq!(
            envoy.headers[0].header_match_specifier,
            Some(header_matcher::HeaderMatchSpecifier::StringMatch(string(
                MatchType::Exact,
                "POST"
            )))
        );
        let Some(header_matcher::HeaderMatchSpecifier::StringMatch(regex)) = &envoy.headers[1].header_match_specifier
        else {
            panic!("{envoy:?}")
        };
        assert_eq!(
            regex.match_pattern,
            Some(string_matcher::MatchPattern::SafeRegex(regex_matcher("canary|beta")))
        );
        assert_eq!(envoy.query_parameters[0].name, "Debug");
        assert_eq!(
            envoy.query_parameters[0].query_parameter_match_specifier,
            Some(query_parameter_matcher::QueryParameterMatchSpecifier::StringMatch(
                string(MatchType::Exact, "1")
            ))
        );
    }

    #[test]
    fn literals_are_escaped_for_re2() {
        assert_eq!(escape("a.b*c(d)"), "a\\.b\\*c\\(d\\)");
        assert_eq!(escape("plain"), "plain");
    }
}
