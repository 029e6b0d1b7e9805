//! Re-checks a projected `Route` (from a store or a stream, which could carry anything):
//! what the agent compiles must never make Envoy NACK. Field paths are the proto's.

use aether_proto::registry::v1::route_filter::Filter;
use aether_proto::registry::v1::{
    HeaderModifier, MatchType, PathModifier, Route, RouteBackend, RouteFilter, RouteKind, RouteMatch, RouteRule,
    path_modifier::Modifier,
};

use super::check::{self, limits};

/// Why a projected route cannot be used. Display: `field: message`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct InvalidRoute {
    /// The proto's field, e.g. `rules[1].matches[0].path.value`.
    pub field: String,
    pub message: String,
}

fn at(field: impl Into<String>, result: Result<(), String>) -> Result<(), InvalidRoute> {
    result.map_err(|message| InvalidRoute {
        field: field.into(),
        message,
    })
}

fn ensure(ok: bool, field: impl Into<String>, message: &str) -> Result<(), InvalidRoute> {
    at(field, if ok { Ok(()) } else { Err(message.to_owned()) })
}

/// Checks the invariants every projection holds.
pub fn validate(route: &Route) -> Result<(), InvalidRoute> {
    let kind = route.kind();
    ensure(kind != RouteKind::Unspecified, "kind", "is unspecified")?;
    at("namespace", check::label(&route.namespace))?;
    at("name", check::subdomain(&route.name))?;
    ensure(!route.parents.is_empty(), "parents", "is empty")?;
    ensure(route.parents.len() <= limits::PARENTS, "parents", "holds more than 32")?;
    for (i, parent) in route.parents.iter().enumerate() {
        at(format!("parents[{i}].service"), check::service_key(&parent.service))?;
        ensure(parent.port <= 65535, format!("parents[{i}].port"), "is not a port")?;
    }
    ensure(!route.rules.is_empty(), "rules", "is empty")?;
    ensure(route.rules.len() <= limits::RULES, "rules", "holds more than 16")?;
    let total: usize = route.rules.iter().map(|r| r.matches.len()).sum();
    ensure(
        total <= limits::MATCHES_PER_ROUTE,
        "rules",
        "hold more than 128 matches in all",
    )?;
    let connections = matches!(kind, RouteKind::Tcp | RouteKind::Tls);
    if connections {
        ensure(
            route.rules.len() == 1,
            "rules",
            "a TCP or TLS route holds exactly one rule",
        )?;
        tcp_rule(&route.rules[0], "rules[0]")?;
    }
    ensure(
        kind == RouteKind::Tls || route.hostnames.is_empty(),
        "hostnames",
        "is set in a route that is not TLS",
    )?;
    ensure(
        route.hostnames.len() <= limits::HOSTNAMES,
        "hostnames",
        "holds more than 16",
    )?;
    for (i, hostname) in route.hostnames.iter().enumerate() {
        at(format!("hostnames[{i}]"), check::server_name(hostname))?;
    }
    for (i, rule) in route.rules.iter().enumerate() {
        self::rule(rule, kind, &format!("rules[{i}]"))?;
    }
    Ok(())
}

/// A TCP or TLS route's rule splits connections: weighted backends and nothing a request has.
fn tcp_rule(rule: &RouteRule, field: &str) -> Result<(), InvalidRoute> {
    let request_only = !rule.matches.is_empty()
        || !rule.filters.is_empty()
        || rule.request_timeout_ms != 0
        || rule.backend_request_timeout_ms != 0
        || rule.retry.is_some()
        || rule.backends.iter().any(|b| !b.filters.is_empty());
    ensure(
        !request_only,
        field,
        "a TCP or TLS route has no matches, filters, timeouts or retry",
    )?;
    ensure(!rule.backends.is_empty(), format!("{field}.backends"), "is empty")
}

fn rule(rule: &RouteRule, kind: RouteKind, field: &str) -> Result<(), InvalidRoute> {
    if !rule.name.is_empty() {
        at(format!("{field}.name"), check::subdomain(&rule.name))?;
    }
    ensure(
        rule.matches.len() <= limits::MATCHES_PER_RULE,
        format!("{field}.matches"),
        "holds more than 64",
    )?;
    for (i, m) in rule.matches.iter().enumerate() {
        route_match(m, kind, &format!("{field}.matches[{i}]"))?;
    }
    ensure(
        rule.filters.len() <= limits::FILTERS,
        format!("{field}.filters"),
        "holds more than 16",
    )?;
    for (i, f) in rule.filters.iter().enumerate() {
        filter(f, rule, kind, &format!("{field}.filters[{i}]"))?;
    }
    ensure(
        rule.backends.len() <= limits::BACKENDS,
        format!("{field}.backends"),
        "holds more than 16",
    )?;
    for (i, b) in rule.backends.iter().enumerate() {
        let at_i = format!("{field}.backends[{i}]");
        backend(b, &at_i)?;
        ensure(
            b.filters.len() <= limits::FILTERS,
            format!("{at_i}.filters"),
            "holds more than 16",
        )?;
        for (j, f) in b.filters.iter().enumerate() {
            let request_modifier = matches!(&f.filter, Some(Filter::RequestHeaderModifier(_)));
            ensure(
                request_modifier,
                format!("{at_i}.filters[{j}]"),
                "is not a request header modifier",
            )?;
            filter(f, rule, kind, &format!("{at_i}.filters[{j}]"))?;
        }
    }
    let redirect = rule
        .filters
        .iter()
        .any(|f| matches!(f.filter, Some(Filter::RequestRedirect(_))));
    ensure(
        !redirect || rule.backends.is_empty(),
        format!("{field}.backends"),
        "is set with a redirect",
    )?;
    let (request, backend) = (rule.request_timeout_ms, rule.backend_request_timeout_ms);
    let fits = request == 0 || backend <= request;
    ensure(
        fits,
        format!("{field}.backend_request_timeout_ms"),
        "is longer than the request timeout",
    )?;
    if let Some(retry) = &rule.retry {
        ensure(
            retry.attempts <= limits::RETRY_ATTEMPTS,
            format!("{field}.retry.attempts"),
            "is more than 10",
        )?;
        ensure(
            retry.codes.len() <= limits::RETRY_CODES,
            format!("{field}.retry.codes"),
            "holds more than 32",
        )?;
        let codes_ok = retry.codes.iter().all(|c| (400..=599).contains(c));
        ensure(
            codes_ok,
            format!("{field}.retry.codes"),
            "holds a code outside 400 to 599",
        )?;
    }
    Ok(())
}

fn route_match(m: &RouteMatch, kind: RouteKind, field: &str) -> Result<(), InvalidRoute> {
    let http = kind == RouteKind::Http;
    let http_only = m.path.is_some() || !m.query_params.is_empty() || !m.method.is_empty();
    ensure(
        http || !http_only,
        field,
        "a gRPC route matches no path, query or method",
    )?;
    ensure(
        !http || m.grpc_method.is_none(),
        format!("{field}.grpc_method"),
        "is set in an HTTP route",
    )?;
    if let Some(path) = &m.path {
        let value = format!("{field}.path.value");
        match path.r#type() {
            MatchType::Exact | MatchType::PathPrefix => at(value, check::path(&path.value))?,
            MatchType::Regex => at(value, check::regex(&path.value))?,
            MatchType::Unspecified => ensure(false, format!("{field}.path.type"), "is unspecified")?,
        }
    }
    if !m.method.is_empty() {
        ensure(
            check::METHODS.contains(&m.method.as_str()),
            format!("{field}.method"),
            "is not an upper-case method",
        )?;
    }
    for (list, name, header) in [(&m.headers, "headers", true), (&m.query_params, "query_params", false)] {
        ensure(
            list.len() <= limits::VALUE_MATCHES,
            format!("{field}.{name}"),
            "holds more than 16",
        )?;
        for (i, v) in list.iter().enumerate() {
            let at_i = format!("{field}.{name}[{i}]");
            at(format!("{at_i}.name"), check::header_name(&v.name))?;
            let lower = !header || !v.name.bytes().any(|b| b.is_ascii_uppercase());
            ensure(lower, format!("{at_i}.name"), "is not lower-case")?;
            value_match(v.r#type(), &v.value, &at_i)?;
        }
    }
    if let Some(method) = &m.grpc_method {
        value_match(
            method.r#type(),
            &method.service,
            &format!("{field}.grpc_method.service"),
        )?;
        value_match(method.r#type(), &method.method, &format!("{field}.grpc_method.method"))?;
    }
    Ok(())
}

fn value_match(type_: MatchType, value: &str, field: &str) -> Result<(), InvalidRoute> {
    match type_ {
        MatchType::Exact => Ok(()),
        MatchType::Regex => at(field, check::regex(value)),
        _ => ensure(false, field, "match type is not EXACT or REGEX"),
    }
}

fn filter(filter: &RouteFilter, rule: &RouteRule, kind: RouteKind, field: &str) -> Result<(), InvalidRoute> {
    let http = kind == RouteKind::Http;
    match &filter.filter {
        None => ensure(false, field, "is empty"),
        Some(Filter::RequestHeaderModifier(m) | Filter::ResponseHeaderModifier(m)) => header_modifier(m, field),
        Some(Filter::RequestMirror(mirror)) => {
            ensure(mirror.percent <= 100, format!("{field}.percent"), "is more than 100")?;
            match &mirror.backend {
                Some(b) => backend(b, &format!("{field}.backend")),
                None => ensure(false, format!("{field}.backend"), "is unset"),
            }
        }
        Some(Filter::RequestRedirect(r)) => {
            ensure(http, field, "a gRPC route cannot redirect")?;
            ensure(
                ["", "http", "https"].contains(&r.scheme.as_str()),
                format!("{field}.scheme"),
                "is not http or https",
            )?;
            let code_ok = r.status_code == 0 || check::REDIRECT_CODES.contains(&r.status_code);
            ensure(
                code_ok,
                format!("{field}.status_code"),
                "is not 301, 302, 303, 307 or 308",
            )?;
            ensure(r.port <= 65535, format!("{field}.port"), "is not a port")?;
            if !r.hostname.is_empty() {
                at(format!("{field}.hostname"), check::hostname(&r.hostname))?;
            }
            path_modifier(r.path.as_ref(), rule, &format!("{field}.path"))
        }
        Some(Filter::UrlRewrite(r)) => {
            ensure(http, field, "a gRPC route cannot rewrite")?;
            if !r.hostname.is_empty() {
                at(format!("{field}.hostname"), check::hostname(&r.hostname))?;
            }
            path_modifier(r.path.as_ref(), rule, &format!("{field}.path"))
        }
    }
}

fn header_modifier(m: &HeaderModifier, field: &str) -> Result<(), InvalidRoute> {
    let mut seen = std::collections::HashSet::new();
    let edited = m.set.iter().chain(&m.add).map(|h| h.name.as_str());
    for name in edited.chain(m.remove.iter().map(String::as_str)) {
        at(field, check::modifiable_header(name))?;
        ensure(
            !name.bytes().any(|b| b.is_ascii_uppercase()),
            field,
            "holds a header name not lower-case",
        )?;
        ensure(seen.insert(name), field, "names one header twice")?;
    }
    for h in m.set.iter().chain(&m.add) {
        at(field, check::header_value(&h.value, limits::HEADER_VALUE_LEN))?;
    }
    Ok(())
}

fn path_modifier(path: Option<&PathModifier>, rule: &RouteRule, field: &str) -> Result<(), InvalidRoute> {
    match path.map(|p| &p.modifier) {
        None => Ok(()),
        Some(None) => ensure(false, field, "is empty"),
        Some(Some(Modifier::ReplaceFullPath(full))) => at(field, check::replacement_path(full, false)),
        Some(Some(Modifier::ReplacePrefixMatch(prefix))) => {
            at(field, check::replacement_path(prefix, true))?;
            let prefix_match = match rule.matches.as_slice() {
                [] => true,
                [only] => only.path.as_ref().is_none_or(|p| p.r#type() == MatchType::PathPrefix),
                _ => false,
            };
            ensure(
                prefix_match,
                field,
                "replaces a prefix but the rule has not exactly one PATH_PREFIX match",
            )
        }
    }
}

fn backend(b: &RouteBackend, field: &str) -> Result<(), InvalidRoute> {
    at(format!("{field}.service"), check::service_key(&b.service))?;
    ensure(b.port <= 65535, format!("{field}.port"), "is not a port")?;
    ensure(
        b.weight <= limits::WEIGHT,
        format!("{field}.weight"),
        "is more than 1000000",
    )
}
