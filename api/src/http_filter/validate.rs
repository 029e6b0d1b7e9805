//! Re-checks a projected filter (from a store or a stream, which could carry anything):
//! what the agent compiles must never make Envoy NACK, and must mean what the projector
//! meant. Every invariant the proto's comments state; field paths are the proto's.

use aether_proto::registry::v1::{
    AuthorizationAction, ExtAuthz, ExtAuthzProtocol, HeaderToMetadata, HttpFilter, HttpFilterAttachment,
    LocalRateLimit, RbacFilter, http_filter::Filter,
};

use super::check::{self, limits};
use super::{Refusal, at};

fn ensure(ok: bool, field: impl Into<String>, message: &str) -> Result<(), Refusal> {
    if ok { Ok(()) } else { Err(Refusal::new(field, message)) }
}

/// Checks the invariants every projection holds.
pub fn validate(filter: &HttpFilter) -> Result<(), Refusal> {
    at("namespace", crate::route::check::label(&filter.namespace))?;
    at("name", crate::route::check::subdomain(&filter.name))?;
    ensure(!filter.services.is_empty(), "services", "is empty")?;
    ensure(
        filter.services.len() <= limits::TARGET_REFS,
        "services",
        "holds more than 16",
    )?;
    for (i, service) in filter.services.iter().enumerate() {
        let field = format!("services[{i}]");
        at(&field, crate::route::check::service_key(service))?;
        let own = service.split_once('/').is_some_and(|(ns, _)| ns == filter.namespace);
        ensure(own, &field, "is not in the filter's namespace")?;
        ensure(!filter.services[..i].contains(service), field, "is listed twice")?;
    }
    attachment(filter)?;
    at("order", check::order(i64::from(filter.order)))?;
    if let (Some(Filter::Rbac(r)), false) = (&filter.filter, filter.attach() == HttpFilterAttachment::Inbound)
        && let Some((i, j, field)) = check::identity_in_rules(&r.rules)
    {
        let at = format!("rbac.rules[{i}].from[{j}].{field}");
        return Err(Refusal::new(at, check::IDENTITY_OFF_INBOUND));
    }
    match &filter.filter {
        None => Err(Refusal::new("filter", "is unset")),
        Some(Filter::ExtAuthz(e)) => ext_authz(e),
        Some(Filter::LocalRateLimit(l)) => local_rate_limit(l),
        Some(Filter::HeaderToMetadata(h)) => header_to_metadata(h),
        Some(Filter::Rbac(r)) => rbac(r),
    }
}

/// `route` is set exactly for ATTACH_ROUTE: `<http|grpc>/<the filter's namespace>/<name>`.
fn attachment(filter: &HttpFilter) -> Result<(), Refusal> {
    let attach = filter.attach();
    ensure(attach != HttpFilterAttachment::Unspecified, "attach", "is unspecified")?;
    if attach != HttpFilterAttachment::Route {
        return ensure(filter.route.is_empty(), "route", "is set without ATTACH_ROUTE");
    }
    let parts = filter.route.splitn(3, '/').collect::<Vec<_>>();
    let ok = match parts[..] {
        [kind, namespace, name] => {
            ["http", "grpc"].contains(&kind)
                && namespace == filter.namespace
                && crate::route::check::subdomain(name).is_ok()
        }
        _ => false,
    };
    ensure(
        ok,
        "route",
        "is not a route key <http|grpc>/<namespace>/<name> in the filter's namespace",
    )
}

fn ext_authz(e: &ExtAuthz) -> Result<(), Refusal> {
    at("ext_authz.host", check::canonical_host(&e.host))?;
    at("ext_authz.port", crate::authorization::check::port(i64::from(e.port)))?;
    let protocol = e.protocol();
    ensure(
        protocol != ExtAuthzProtocol::Unspecified,
        "ext_authz.protocol",
        "is unspecified",
    )?;
    let http = protocol == ExtAuthzProtocol::Http;
    if !e.path_prefix.is_empty() {
        ensure(http, "ext_authz.path_prefix", "is set on a gRPC check")?;
        at("ext_authz.path_prefix", check::path_prefix(&e.path_prefix))?;
    }
    ensure(
        http || e.allowed_headers.is_empty(),
        "ext_authz.allowed_headers",
        "is set on a gRPC check",
    )?;
    ensure(
        e.allowed_headers.len() <= limits::ALLOWED_HEADERS,
        "ext_authz.allowed_headers",
        "holds more than 64",
    )?;
    for (i, header) in e.allowed_headers.iter().enumerate() {
        at(format!("ext_authz.allowed_headers[{i}]"), check::header(header))?;
    }
    if e.timeout_ms != 0 {
        at("ext_authz.timeout_ms", check::millis(e.timeout_ms, limits::TIMEOUT_MS))?;
    }
    at("ext_authz.status_on_error", check::status_or_default(e.status_on_error))?;
    at(
        "ext_authz.max_request_bytes",
        check::max_request_bytes(i64::from(e.max_request_bytes)),
    )
    .map(drop)
}

fn local_rate_limit(l: &LocalRateLimit) -> Result<(), Refusal> {
    at("local_rate_limit.max_tokens", check::tokens(i64::from(l.max_tokens)))?;
    ensure(
        l.tokens_per_fill <= l.max_tokens,
        "local_rate_limit.tokens_per_fill",
        "is more than max_tokens",
    )?;
    let interval = check::millis(l.fill_interval_ms, limits::FILL_INTERVAL_MS);
    at("local_rate_limit.fill_interval_ms", interval)?;
    at("local_rate_limit.status", check::status_or_default(l.status))
}

fn header_to_metadata(h: &HeaderToMetadata) -> Result<(), Refusal> {
    ensure(!h.rules.is_empty(), "header_to_metadata.rules", "is empty")?;
    ensure(
        h.rules.len() <= limits::HEADER_RULES,
        "header_to_metadata.rules",
        "holds more than 32",
    )?;
    for (i, rule) in h.rules.iter().enumerate() {
        let field = format!("header_to_metadata.rules[{i}]");
        at(format!("{field}.header"), check::header(&rule.header))?;
        at(format!("{field}.key"), check::metadata_name(&rule.key))?;
        if !rule.metadata_namespace.is_empty() {
            let namespace = check::metadata_name(&rule.metadata_namespace);
            at(format!("{field}.metadata_namespace"), namespace)?;
        }
    }
    Ok(())
}

fn rbac(r: &RbacFilter) -> Result<(), Refusal> {
    let action = r.action();
    ensure(
        matches!(action, AuthorizationAction::Allow | AuthorizationAction::Deny),
        "rbac.action",
        "is not ALLOW or DENY",
    )?;
    crate::authorization::validate_rules(&r.rules, "rbac.rules")?;
    match check::ports_in_rules(&r.rules) {
        None => Ok(()),
        Some((i, j, not)) => {
            let name = if not { "not_ports" } else { "ports" };
            Err(Refusal::new(
                format!("rbac.rules[{i}].to[{j}].{name}"),
                check::PORTS_IN_RULES,
            ))
        }
    }
}
