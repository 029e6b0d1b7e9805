//! A route match, as Envoy matches it: the path (Gateway API's segment-aware prefix is
//! Envoy's `path_separated_prefix`; a gRPC method is a path), headers, query
//! parameters and the method.

use aether_proto::registry::v1::{MatchType, RouteMatch, ValueMatch};
use envoy_types::pb::envoy::config::route::v3::{
    HeaderMatcher, QueryParameterMatcher, RouteMatch as EnvoyMatch, header_matcher, query_parameter_matcher,
    route_match,
};
use envoy_types::pb::envoy::r#type::matcher::v3::{RegexMatcher, StringMatcher, string_matcher};

// The normalized path lives with the precedence that ranks it (one order for the
// compile and `aether explain`).
pub use aether_api::route::order::{PathSpec, escape};

fn specifier(path: &PathSpec) -> route_match::PathSpecifier {
    match path {
        PathSpec::Exact(path) => route_match::PathSpecifier::Path(path.clone()),
        PathSpec::Prefix(prefix) if prefix == "/" => route_match::PathSpecifier::Prefix(prefix.clone()),
        PathSpec::Prefix(prefix) => route_match::PathSpecifier::PathSeparatedPrefix(prefix.clone()),
        PathSpec::Regex(regex) => route_match::PathSpecifier::SafeRegex(regex_matcher(regex)),
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
        path_specifier: Some(specifier(path)),
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
