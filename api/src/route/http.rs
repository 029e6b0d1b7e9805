//! HTTPRoute rules → `RouteRule`s.

use std::collections::HashSet;

use aether_common::quote::quote;
use aether_proto::registry::v1::route_filter::Filter;
use aether_proto::registry::v1::{
    MatchType, PathMatch, PathModifier, Redirect, RouteFilter, RouteMatch, RouteRetry, RouteRule, UrlRewrite,
    path_modifier,
};

use super::check::{self, limits};
use super::shared::{self, as_response};
use super::{Rejected, at, reason};
use crate::duration;
use crate::gateway::{
    HttpFilterType, HttpPathMatch, HttpPathModifier, HttpRouteFilter, HttpRouteMatch, HttpRouteRetry, HttpRouteRule,
    HttpRouteTimeouts, PathMatchType, PathModifierType, RequestRedirectFilter,
};

pub fn rules(rules: &[HttpRouteRule], namespace: &str) -> Result<Vec<RouteRule>, Rejected> {
    let size = |rule: &HttpRouteRule| shared::RuleSize {
        session_persistence: rule.session_persistence.is_some(),
        matches: rule.matches.len(),
        filters: rule.filters.len(),
        backends: rule.backend_refs.len(),
    };
    shared::project_rules(rules, size, |rule, field, names| {
        self::rule(rule, namespace, field, names)
    })
}

fn rule(
    rule: &HttpRouteRule,
    namespace: &str,
    field: &str,
    names: &mut HashSet<String>,
) -> Result<RouteRule, Rejected> {
    let matches = (rule.matches.iter().enumerate())
        .map(|(i, m)| route_match(m, &format!("{field}.matches[{i}]")))
        .collect::<Result<Vec<_>, _>>()?;
    let filters = filters(rule, namespace, field)?;
    let backends = (rule.backend_refs.iter().enumerate())
        .map(|(i, b)| {
            let at_i = format!("{field}.backendRefs[{i}]");
            shared::weighted_backend(b, namespace, &at_i, backend_filter)
        })
        .collect::<Result<Vec<_>, _>>()?;
    let (request_timeout_ms, backend_request_timeout_ms) = timeouts(rule.timeouts.as_ref(), field)?;
    Ok(RouteRule {
        name: shared::rule_name(rule.name.as_deref(), names, &format!("{field}.name"))?,
        matches,
        filters,
        backends,
        request_timeout_ms,
        backend_request_timeout_ms,
        retry: rule
            .retry
            .as_ref()
            .map(|r| retry(r, &format!("{field}.retry")))
            .transpose()?,
    })
}

fn route_match(m: &HttpRouteMatch, field: &str) -> Result<RouteMatch, Rejected> {
    let method = match &m.method {
        None => String::new(),
        Some(method) => {
            let upper = method.to_ascii_uppercase();
            if !check::METHODS.contains(&upper.as_str()) {
                let message = format!("{} is not an HTTP method the API allows", quote(method));
                return Err(Rejected::unsupported(format!("{field}.method"), message));
            }
            upper
        }
    };
    Ok(RouteMatch {
        path: m
            .path
            .as_ref()
            .map(|p| path_match(p, &format!("{field}.path")))
            .transpose()?,
        headers: shared::header_matches(&m.headers, &format!("{field}.headers"))?,
        query_params: shared::query_matches(&m.query_params, &format!("{field}.queryParams"))?,
        method,
        grpc_method: None,
    })
}

/// A path match; a PathPrefix's trailing '/' is dropped (the API ignores it: "/abc/"
/// matches "/abc"), so the agent compiles one form.
fn path_match(path: &HttpPathMatch, field: &str) -> Result<PathMatch, Rejected> {
    let value_field = format!("{field}.value");
    let (type_, value) = match &path.type_ {
        PathMatchType::Exact => (MatchType::Exact, path.value.clone()),
        PathMatchType::PathPrefix => {
            at(&value_field, check::path(&path.value))?;
            let trimmed = path.value.trim_end_matches('/');
            (
                MatchType::PathPrefix,
                if trimmed.is_empty() {
                    "/".to_owned()
                } else {
                    trimmed.to_owned()
                },
            )
        }
        PathMatchType::RegularExpression => (MatchType::Regex, path.value.clone()),
        PathMatchType::Other(other) => {
            let message = format!("{} is not Exact, PathPrefix or RegularExpression", quote(other));
            return Err(Rejected::unsupported(format!("{field}.type"), message));
        }
    };
    match type_ {
        MatchType::Regex => at(&value_field, check::regex(&value))?,
        _ => at(&value_field, check::path(&value))?,
    }
    Ok(PathMatch {
        r#type: type_.into(),
        value,
    })
}

fn filters(rule: &HttpRouteRule, namespace: &str, field: &str) -> Result<Vec<RouteFilter>, Rejected> {
    let mut seen = HashSet::new();
    let mut projected = Vec::new();
    for (i, filter) in rule.filters.iter().enumerate() {
        let at_i = format!("{field}.filters[{i}]");
        // Only mirrors may repeat (Gateway API).
        if filter.type_ != HttpFilterType::RequestMirror && !seen.insert(filter.type_.clone()) {
            let message = format!("{} appears twice in this rule", filter.type_.as_str());
            return Err(Rejected::unsupported(format!("{at_i}.type"), message));
        }
        projected.push(RouteFilter {
            filter: Some(self::filter(filter, rule, namespace, &at_i)?),
        });
    }
    let redirect = seen.contains(&HttpFilterType::RequestRedirect);
    if redirect && seen.contains(&HttpFilterType::UrlRewrite) {
        let message = "RequestRedirect and URLRewrite cannot both be used in one rule";
        return Err(Rejected::accepted(
            reason::INCOMPATIBLE_FILTERS,
            format!("{field}.filters"),
            message,
        ));
    }
    if redirect && !rule.backend_refs.is_empty() {
        let message = "a rule with a RequestRedirect filter answers itself: it cannot have backendRefs";
        return Err(Rejected::accepted(
            reason::INCOMPATIBLE_FILTERS,
            format!("{field}.backendRefs"),
            message,
        ));
    }
    Ok(projected)
}

fn filter(filter: &HttpRouteFilter, rule: &HttpRouteRule, namespace: &str, field: &str) -> Result<Filter, Rejected> {
    match &filter.type_ {
        HttpFilterType::RequestHeaderModifier => shared::header_modifier(
            filter.request_header_modifier.as_ref(),
            &format!("{field}.requestHeaderModifier"),
        ),
        HttpFilterType::ResponseHeaderModifier => {
            let field = format!("{field}.responseHeaderModifier");
            shared::header_modifier(filter.response_header_modifier.as_ref(), &field).map(as_response)
        }
        HttpFilterType::RequestMirror => shared::mirror(
            filter.request_mirror.as_ref(),
            namespace,
            &format!("{field}.requestMirror"),
        ),
        HttpFilterType::RequestRedirect => redirect(
            filter.request_redirect.as_ref(),
            rule,
            &format!("{field}.requestRedirect"),
        ),
        HttpFilterType::UrlRewrite => rewrite(filter, rule, &format!("{field}.urlRewrite")),
        other => Err(unsupported_filter(other.as_str(), field)),
    }
}

fn unsupported_filter(type_: &str, field: &str) -> Rejected {
    Rejected::unsupported(
        format!("{field}.type"),
        format!("filter {} is not supported by the mesh", quote(type_)),
    )
}

/// Filters of one backend: only request header modifiers (Envoy applies them per
/// weighted cluster).
fn backend_filter(filter: &HttpRouteFilter, field: &str) -> Result<RouteFilter, Rejected> {
    if filter.type_ != HttpFilterType::RequestHeaderModifier {
        let message = format!(
            "{} is not supported on a backend (RequestHeaderModifier is)",
            quote(filter.type_.as_str())
        );
        return Err(Rejected::unsupported(format!("{field}.type"), message));
    }
    let modifier = shared::header_modifier(
        filter.request_header_modifier.as_ref(),
        &format!("{field}.requestHeaderModifier"),
    )?;
    Ok(RouteFilter { filter: Some(modifier) })
}

fn redirect(redirect: Option<&RequestRedirectFilter>, rule: &HttpRouteRule, field: &str) -> Result<Filter, Rejected> {
    let Some(redirect) = redirect else {
        return Err(Rejected::unsupported(field, "must be set for this filter type"));
    };
    let scheme = redirect.scheme.clone().unwrap_or_default();
    if !["", "http", "https"].contains(&scheme.as_str()) {
        return Err(Rejected::unsupported(
            format!("{field}.scheme"),
            format!("{} is not http or https", quote(&scheme)),
        ));
    }
    let status_code = match redirect.status_code {
        None => 302,
        Some(code) => match u32::try_from(code) {
            Ok(code) if check::REDIRECT_CODES.contains(&code) => code,
            _ => {
                let message = format!("{code} is not a redirect status (301, 302, 303, 307 or 308)");
                return Err(Rejected::unsupported(format!("{field}.statusCode"), message));
            }
        },
    };
    Ok(Filter::RequestRedirect(Redirect {
        scheme,
        hostname: hostname(redirect.hostname.as_deref(), &format!("{field}.hostname"))?,
        path: path_modifier(redirect.path.as_ref(), rule, &format!("{field}.path"))?,
        port: redirect
            .port
            .map(check::port)
            .transpose()
            .or_else(|m| at(format!("{field}.port"), Err(m)))?
            .unwrap_or(0),
        status_code,
    }))
}

fn rewrite(filter: &HttpRouteFilter, rule: &HttpRouteRule, field: &str) -> Result<Filter, Rejected> {
    let Some(rewrite) = &filter.url_rewrite else {
        return Err(Rejected::unsupported(field, "must be set for this filter type"));
    };
    Ok(Filter::UrlRewrite(UrlRewrite {
        hostname: hostname(rewrite.hostname.as_deref(), &format!("{field}.hostname"))?,
        path: path_modifier(rewrite.path.as_ref(), rule, &format!("{field}.path"))?,
    }))
}

fn hostname(hostname: Option<&str>, field: &str) -> Result<String, Rejected> {
    hostname
        .map(|h| at(field, check::hostname(h)).map(|()| h.to_owned()))
        .transpose()
        .map(Option::unwrap_or_default)
}

/// A path modifier. ReplacePrefixMatch needs the rule's one match to be a PathPrefix
/// (Gateway API): the prefix it replaces.
fn path_modifier(
    path: Option<&HttpPathModifier>,
    rule: &HttpRouteRule,
    field: &str,
) -> Result<Option<PathModifier>, Rejected> {
    let Some(path) = path else { return Ok(None) };
    let modifier = match (&path.type_, &path.replace_full_path, &path.replace_prefix_match) {
        (PathModifierType::ReplaceFullPath, Some(full), None) => {
            at(format!("{field}.replaceFullPath"), check::replacement_path(full, false))?;
            path_modifier::Modifier::ReplaceFullPath(full.clone())
        }
        (PathModifierType::ReplacePrefixMatch, None, Some(prefix)) => {
            at(
                format!("{field}.replacePrefixMatch"),
                check::replacement_path(prefix, true),
            )?;
            if !single_prefix_match(rule) {
                let message = "ReplacePrefixMatch needs exactly one match in the rule, with a PathPrefix path";
                return Err(Rejected::unsupported(field, message));
            }
            path_modifier::Modifier::ReplacePrefixMatch(prefix.clone())
        }
        (PathModifierType::Other(other), ..) => {
            let message = format!("{} is not ReplaceFullPath or ReplacePrefixMatch", quote(other));
            return Err(Rejected::unsupported(format!("{field}.type"), message));
        }
        (type_, ..) => {
            let message = format!("type {} needs its own field set, and only it", type_.as_str());
            return Err(Rejected::unsupported(field, message));
        }
    };
    Ok(Some(PathModifier {
        modifier: Some(modifier),
    }))
}

/// No match is the API's default match, a PathPrefix "/".
fn single_prefix_match(rule: &HttpRouteRule) -> bool {
    match rule.matches.as_slice() {
        [] => true,
        [only] => only.path.as_ref().is_none_or(|p| p.type_ == PathMatchType::PathPrefix),
        _ => false,
    }
}

/// Request and backend-request timeouts in milliseconds (0: none). A backend request
/// cannot outlast the request it serves, unless the request has none.
fn timeouts(timeouts: Option<&HttpRouteTimeouts>, field: &str) -> Result<(u64, u64), Rejected> {
    let Some(timeouts) = timeouts else { return Ok((0, 0)) };
    let parse = |value: &Option<String>, name: &str| {
        let parsed = value.as_deref().map(duration::parse_millis).transpose();
        parsed
            .map(Option::unwrap_or_default)
            .map_err(|e| Rejected::unsupported(format!("{field}.timeouts.{name}"), e.to_string()))
    };
    let request = parse(&timeouts.request, "request")?;
    let backend = parse(&timeouts.backend_request, "backendRequest")?;
    if request > 0 && backend > request {
        let message = format!("{backend} ms is longer than the request timeout ({request} ms)");
        return Err(Rejected::unsupported(
            format!("{field}.timeouts.backendRequest"),
            message,
        ));
    }
    Ok((request, backend))
}

/// GEP-1731 retries; attempts default to 1 when the stanza is there without them.
fn retry(retry: &HttpRouteRetry, field: &str) -> Result<RouteRetry, Rejected> {
    if retry.codes.len() > limits::RETRY_CODES {
        return Err(Rejected::unsupported(format!("{field}.codes"), "at most 32 codes"));
    }
    let mut codes = Vec::new();
    for (i, code) in retry.codes.iter().enumerate() {
        match u32::try_from(*code) {
            Ok(code @ 400..=599) if !codes.contains(&code) => codes.push(code),
            Ok(400..=599) => {}
            _ => {
                let message = format!("{code} is not a status code to retry (400 to 599)");
                return Err(Rejected::unsupported(format!("{field}.codes[{i}]"), message));
            }
        }
    }
    let attempts = match u32::try_from(retry.attempts.unwrap_or(1)) {
        Ok(attempts) if attempts <= limits::RETRY_ATTEMPTS => attempts,
        _ => {
            let message = format!("{} retries (0 to 10)", retry.attempts.unwrap_or_default());
            return Err(Rejected::unsupported(format!("{field}.attempts"), message));
        }
    };
    let backoff = retry.backoff.as_deref().map(duration::parse_millis).transpose();
    let backoff_ms = backoff.map_err(|e| Rejected::unsupported(format!("{field}.backoff"), e.to_string()))?;
    Ok(RouteRetry {
        codes,
        attempts,
        backoff_ms: backoff_ms.unwrap_or(0),
    })
}
