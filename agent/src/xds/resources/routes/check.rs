//! The last guard before Envoy: what Envoy would refuse in a route table (and so NACK
//! the whole table for), checked per route so one bad route is skipped, never pushed.
//! The projector validates the Gateway API rules; this checks Envoy's own limits on
//! the fields the compiler copies.

use aether_common::quote::quote;
use aether_proto::registry::v1::{
    HeaderModifier, MatchType, PathModifier, Route, RouteFilter, path_modifier, route_filter,
};

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RouteError {
    #[error("{field}: {} is not a header name Envoy may modify", quote(.value))]
    HeaderName { field: String, value: String },
    #[error("{field}: {} holds a character Envoy refuses in a header", quote(.value))]
    HeaderValue { field: String, value: String },
    #[error("{field}: {} is not a path Envoy matches (it must start with '/' and hold no '?' or '#')", quote(.value))]
    Path { field: String, value: String },
    #[error("{field}: an empty regular expression")]
    EmptyRegex { field: String },
    #[error("{field}: {} is not a service key <namespace>/<name>", quote(.value))]
    Service { field: String, value: String },
}

/// Whether Envoy accepts what `route` compiles to.
pub fn check(route: &Route) -> Result<(), RouteError> {
    for (r, rule) in route.rules.iter().enumerate() {
        for (m, matched) in rule.matches.iter().enumerate() {
            let field = |what: &str| format!("rules[{r}].matches[{m}].{what}");
            if let Some(path) = &matched.path {
                let bad = match path.r#type() {
                    MatchType::Regex => path.value.is_empty(),
                    _ => !path.value.starts_with('/') || path.value.contains(['?', '#']),
                };
                if bad {
                    return Err(RouteError::Path {
                        field: field("path.value"),
                        value: path.value.clone(),
                    });
                }
            }
            for (h, header) in matched.headers.iter().enumerate() {
                header_name(&field(&format!("headers[{h}].name")), &header.name, false)?;
            }
            let regexes = matched.headers.iter().chain(&matched.query_params);
            if regexes
                .into_iter()
                .any(|v| v.r#type() == MatchType::Regex && v.value.is_empty())
            {
                return Err(RouteError::EmptyRegex { field: field("value") });
            }
        }
        filters(&format!("rules[{r}]"), &rule.filters)?;
        for (b, backend) in rule.backends.iter().enumerate() {
            service(&format!("rules[{r}].backends[{b}].service"), &backend.service)?;
            filters(&format!("rules[{r}].backends[{b}]"), &backend.filters)?;
        }
    }
    Ok(())
}

fn filters(field: &str, filters: &[RouteFilter]) -> Result<(), RouteError> {
    for (f, filter) in filters.iter().enumerate() {
        let field = format!("{field}.filters[{f}]");
        match filter.filter.as_ref() {
            Some(route_filter::Filter::RequestHeaderModifier(m)) => modifier(&field, m)?,
            Some(route_filter::Filter::ResponseHeaderModifier(m)) => modifier(&field, m)?,
            Some(route_filter::Filter::RequestMirror(mirror)) => {
                if let Some(backend) = &mirror.backend {
                    service(&format!("{field}.backend.service"), &backend.service)?;
                }
            }
            Some(route_filter::Filter::RequestRedirect(r)) => {
                for (what, value) in [("hostname", &r.hostname), ("scheme", &r.scheme)] {
                    header_value(&format!("{field}.{what}"), value)?;
                }
                path_modifier(&field, r.path.as_ref())?;
            }
            Some(route_filter::Filter::UrlRewrite(r)) => {
                header_value(&format!("{field}.hostname"), &r.hostname)?;
                path_modifier(&field, r.path.as_ref())?;
            }
            None => {}
        }
    }
    Ok(())
}

fn path_modifier(field: &str, modifier: Option<&PathModifier>) -> Result<(), RouteError> {
    match modifier.and_then(|m| m.modifier.as_ref()) {
        Some(path_modifier::Modifier::ReplaceFullPath(p) | path_modifier::Modifier::ReplacePrefixMatch(p)) => {
            header_value(&format!("{field}.path"), p)
        }
        None => Ok(()),
    }
}

/// Envoy refuses NUL, CR and LF wherever a value becomes a header.
fn header_value(field: &str, value: &str) -> Result<(), RouteError> {
    if value.contains(['\0', '\r', '\n']) {
        return Err(RouteError::HeaderValue {
            field: field.to_owned(),
            value: value.to_owned(),
        });
    }
    Ok(())
}

fn modifier(field: &str, modifier: &HeaderModifier) -> Result<(), RouteError> {
    for (kind, headers) in [("set", &modifier.set), ("add", &modifier.add)] {
        for (i, header) in headers.iter().enumerate() {
            header_name(&format!("{field}.{kind}[{i}].name"), &header.name, true)?;
            header_value(&format!("{field}.{kind}[{i}].value"), &header.value)?;
        }
    }
    for (i, name) in modifier.remove.iter().enumerate() {
        header_name(&format!("{field}.remove[{i}]"), name, true)?;
    }
    Ok(())
}

/// A lower-case token; a modifier may not touch pseudo-headers or `host` (Envoy refuses
/// the table), a matcher may match `:authority` and the like.
fn header_name(field: &str, name: &str, modified: bool) -> Result<(), RouteError> {
    let token = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit() || "!#$%&'*+-.^_`|~".contains(c);
    let body = if modified {
        name
    } else {
        name.strip_prefix(':').unwrap_or(name)
    };
    let forbidden = modified && (name == "host" || name.starts_with(':'));
    if body.is_empty() || !body.chars().all(token) || forbidden {
        return Err(RouteError::HeaderName {
            field: field.to_owned(),
            value: name.to_owned(),
        });
    }
    Ok(())
}

fn service(field: &str, key: &str) -> Result<(), RouteError> {
    let label = |s: &str| {
        !s.is_empty()
            && s.chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
    };
    match key.split_once('/') {
        Some((ns, name)) if label(ns) && label(name) => Ok(()),
        _ => Err(RouteError::Service {
            field: field.to_owned(),
            value: key.to_owned(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use aether_proto::registry::v1::{Header, PathMatch, RouteBackend, RouteMatch, RouteRule};

    fn with_rule(rule: RouteRule) -> Route {
        Route {
            rules: vec![rule],
            ..Default::default()
        }
    }

    fn setting(name: &str, value: &str) -> RouteFilter {
        RouteFilter {
            filter: Some(route_filter::Filter::RequestHeaderModifier(HeaderModifier {
                set: vec![Header {
                    name: name.into(),
                    value: value.into(),
                }],
                ..Default::default()
            })),
        }
    }

    #[test]
    fn what_envoy_refuses_is_caught_and_named() {
        let path = |kind: MatchType, value: &str| {
            with_rule(RouteRule {
                matches: vec![RouteMatch {
                    path: Some(PathMatch {
                        r#type: kind as i32,
                        value: value.into(),
                    }),
                    ..Default::default()
                }],
                ..Default::default()
            })
        };
        let err = check(&path(MatchType::PathPrefix, "/a?b")).unwrap_err();
        assert_eq!(
            err.to_string(),
            "rules[0].matches[0].path.value: \"/a?b\" is not a path Envoy matches (it must start with '/' and hold no '?' or '#')"
        );
        assert!(check(&path(MatchType::Exact, "relative")).is_err());
        assert!(check(&path(MatchType::Regex, "")).is_err());
        assert_eq!(check(&path(MatchType::Regex, "/v[0-9]+")), Ok(()));

        let host = with_rule(RouteRule {
            filters: vec![setting("host", "x")],
            ..Default::default()
        });
        assert!(
            matches!(check(&host), Err(RouteError::HeaderName { field, .. }) if field == "rules[0].filters[0].set[0].name")
        );
        let crlf = with_rule(RouteRule {
            filters: vec![setting("x-a", "a\r\nb")],
            ..Default::default()
        });
        assert!(matches!(check(&crlf), Err(RouteError::HeaderValue { .. })));
        let upper = with_rule(RouteRule {
            filters: vec![setting("X-A", "a")],
            ..Default::default()
        });
        assert!(check(&upper).is_err());
        let backend = with_rule(RouteRule {
            backends: vec![RouteBackend {
                service: "no-namespace".into(),
                ..Default::default()
            }],
            ..Default::default()
        });
        assert!(matches!(check(&backend), Err(RouteError::Service { .. })));
        assert_eq!(
            check(&with_rule(RouteRule {
                filters: vec![setting("x-a", "b")],
                ..Default::default()
            })),
            Ok(())
        );
    }
}
