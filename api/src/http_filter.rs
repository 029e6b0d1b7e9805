//! THE HTTPFilter projector: a `networking.aether.io/v1alpha1` HTTPFilter, validated and
//! projected once into `aether.registry.v1.HttpFilter` (proposals/014). The registrar's
//! sources, the agent (re-validating what it received) and the admission webhooks call
//! these functions, so they agree on what a filter is.
//!
//! Each supported Envoy filter has a typed spec of ours, checked here field by field, so
//! a filter Envoy would refuse (a NACK that stops every other update of the node) never
//! leaves the registrar. Defaults are not filled in: an unset value projects as 0 (or
//! empty) and the agent applies the default the proto states, so a stored filter says
//! what its author wrote. `spec.rbac` is AuthorizationPolicy's rule language, projected by
//! the AuthorizationPolicy projector.

use aether_common::quote::quote;
use aether_proto::registry::v1::{
    AuthorizationAction, ExtAuthz as ProjectedExtAuthz, ExtAuthzProtocol, HeaderToMetadata as ProjectedHeaders,
    HeaderToMetadataRule, HttpFilter as Projected, HttpFilterAttachment, LocalRateLimit as ProjectedRateLimit,
    RbacFilter, http_filter::Filter,
};

use crate::authorization::{self, Unsupported};

pub mod check;
mod object;
mod validate;
mod yaml;

use check::limits;
pub use object::*;
pub use validate::validate;
pub use yaml::{from_documents, parse_documents};

pub use crate::refusal::Refusal;
pub(crate) use crate::refusal::at;

/// `<namespace>/<name>`, the key of a projected filter.
pub fn key(filter: &Projected) -> String {
    format!("{}/{}", filter.namespace, filter.name)
}

/// Validates a filter object and projects it; a refusal names the first field at fault.
/// A filter is never half-projected: one bad value refuses all of it.
pub fn project(object: &HttpFilter) -> Result<Projected, Refusal> {
    let meta = &object.metadata;
    let namespace = meta.namespace.as_deref().unwrap_or(crate::route::DEFAULT_NAMESPACE);
    let name = meta.name.as_deref().unwrap_or_default();
    at("metadata.namespace", crate::route::check::label(namespace))?;
    at("metadata.name", crate::route::check::subdomain(name))?;
    let spec = &object.spec;
    unsupported("spec", &spec.unsupported)?;
    let services = services(&spec.target_refs, namespace)?;
    let (attach, route) = attachment(spec, namespace)?;
    let filter = filter(spec)?;
    if let (Filter::Rbac(r), false) = (&filter, attach == HttpFilterAttachment::Inbound)
        && let Some((i, j, field)) = check::identity_in_rules(&r.rules)
    {
        let at = format!("spec.rbac.rules[{i}].from[{j}].source.{}", check::yaml_name(field));
        return Err(Refusal::new(at, check::IDENTITY_OFF_INBOUND));
    }
    Ok(Projected {
        namespace: namespace.to_owned(),
        name: name.to_owned(),
        generation: meta.generation.unwrap_or(0),
        services,
        attach: attach.into(),
        route,
        order: at("spec.order", check::order(spec.order))?,
        filter: Some(filter),
    })
}

/// A field this version does not know: refused, never ignored (ignoring it would change
/// what the filter does).
fn unsupported(field: &str, extra: &Unsupported) -> Result<(), Refusal> {
    match extra.keys().next() {
        None => Ok(()),
        Some(key) => Err(Refusal::new(
            format!("{field}.{key}"),
            "is not a field of networking.aether.io/v1alpha1 HTTPFilter",
        )),
    }
}

fn bounded(field: &str, len: usize, max: usize) -> Result<(), Refusal> {
    if len > max {
        return Err(Refusal::new(field, format!("holds {len} (at most {max})")));
    }
    Ok(())
}

/// The targetRefs as service keys of the filter's namespace, duplicates dropped.
fn services(targets: &[authorization::TargetRef], namespace: &str) -> Result<Vec<String>, Refusal> {
    if targets.is_empty() {
        let message = "is empty: name the Services (of this namespace) whose traffic gets the filter";
        return Err(Refusal::new("spec.targetRefs", message));
    }
    bounded("spec.targetRefs", targets.len(), limits::TARGET_REFS)?;
    let mut services = Vec::new();
    for (i, target) in targets.iter().enumerate() {
        let field = format!("spec.targetRefs[{i}]");
        unsupported(&field, &target.unsupported)?;
        if !(target.group.is_empty() || target.group == "core") || target.kind != "Service" {
            let message = format!(
                "{}/{} is not a core Service (the only kind a filter targets)",
                quote(&target.group),
                quote(&target.kind)
            );
            return Err(Refusal::new(format!("{field}.kind"), message));
        }
        at(format!("{field}.name"), crate::route::check::label(&target.name))?;
        let service = format!("{namespace}/{}", target.name);
        if !services.contains(&service) {
            services.push(service);
        }
    }
    Ok(services)
}

/// Where the filter goes, and for `Route` the route key (`<http|grpc>/<ns>/<name>`).
fn attachment(spec: &HttpFilterSpec, namespace: &str) -> Result<(HttpFilterAttachment, String), Refusal> {
    let attach = match &spec.attach {
        Attach::Inbound => HttpFilterAttachment::Inbound,
        Attach::Callers => HttpFilterAttachment::Callers,
        Attach::Route => HttpFilterAttachment::Route,
        Attach::Other(other) => {
            let message = format!("{} is not Inbound, Callers or Route", quote(other));
            return Err(Refusal::new("spec.attach", message));
        }
    };
    match (attach, &spec.route_ref) {
        (HttpFilterAttachment::Route, Some(route)) => Ok((attach, route_key(route, namespace)?)),
        (HttpFilterAttachment::Route, None) => Err(Refusal::new(
            "spec.routeRef",
            "is required with attach: Route (the HTTPRoute or GRPCRoute whose rules get the filter)",
        )),
        (_, Some(_)) => Err(Refusal::new(
            "spec.routeRef",
            format!(
                "is set with attach: {}: a route is named only with attach: Route",
                spec.attach.as_str()
            ),
        )),
        (_, None) => Ok((attach, String::new())),
    }
}

fn route_key(route: &RouteRef, namespace: &str) -> Result<String, Refusal> {
    unsupported("spec.routeRef", &route.unsupported)?;
    if !(route.group.is_empty() || route.group == crate::gateway::GROUP) {
        let message = format!("{} is not {}", quote(&route.group), crate::gateway::GROUP);
        return Err(Refusal::new("spec.routeRef.group", message));
    }
    let kind = match route.kind.as_str() {
        "HTTPRoute" => "http",
        "GRPCRoute" => "grpc",
        other => {
            let message = format!("{} is not HTTPRoute or GRPCRoute", quote(other));
            return Err(Refusal::new("spec.routeRef.kind", message));
        }
    };
    at("spec.routeRef.name", crate::route::check::subdomain(&route.name))?;
    Ok(format!("{kind}/{namespace}/{}", route.name))
}

/// The one filter kind set, projected.
fn filter(spec: &HttpFilterSpec) -> Result<Filter, Refusal> {
    let kinds = [
        ("extAuthz", spec.ext_authz.is_some()),
        ("localRateLimit", spec.local_rate_limit.is_some()),
        ("headerToMetadata", spec.header_to_metadata.is_some()),
        ("rbac", spec.rbac.is_some()),
    ];
    let set: Vec<&str> = kinds
        .into_iter()
        .filter_map(|(name, set)| set.then_some(name))
        .collect();
    if let [first, second, ..] = set[..] {
        let message = format!("is set with spec.{first}: an HTTPFilter holds one filter (write one object per filter)");
        return Err(Refusal::new(format!("spec.{second}"), message));
    }
    if let Some(e) = &spec.ext_authz {
        return ext_authz(e).map(Filter::ExtAuthz);
    }
    if let Some(l) = &spec.local_rate_limit {
        return local_rate_limit(l).map(Filter::LocalRateLimit);
    }
    if let Some(h) = &spec.header_to_metadata {
        return header_to_metadata(h).map(Filter::HeaderToMetadata);
    }
    if let Some(r) = &spec.rbac {
        return rbac(r).map(Filter::Rbac);
    }
    let message = "sets no filter: set exactly one of extAuthz, localRateLimit, headerToMetadata or rbac";
    Err(Refusal::new("spec", message))
}

fn ext_authz(e: &ExtAuthz) -> Result<ProjectedExtAuthz, Refusal> {
    let field = "spec.extAuthz";
    unsupported(field, &e.unsupported)?;
    let mut projected = match (&e.grpc, &e.http) {
        (Some(grpc), None) => grpc_service(grpc)?,
        (None, Some(http)) => http_service(http)?,
        (Some(_), Some(_)) => {
            let message = "is set with spec.extAuthz.grpc: a check goes to one service";
            return Err(Refusal::new("spec.extAuthz.http", message));
        }
        (None, None) => return Err(Refusal::new(field, "names no service: set grpc or http")),
    };
    if let Some(timeout) = &e.timeout {
        let ms = check::duration_ms(timeout, limits::TIMEOUT_MS);
        projected.timeout_ms = at("spec.extAuthz.timeout", ms)?;
    }
    if let Some(status) = e.status_on_error {
        projected.status_on_error = at("spec.extAuthz.statusOnError", check::status(status))?;
    }
    let bytes = check::max_request_bytes(e.max_request_bytes);
    projected.max_request_bytes = at("spec.extAuthz.maxRequestBytes", bytes)?;
    projected.fail_open = e.fail_open;
    Ok(projected)
}

/// The address of a check service, as a projection with only it set.
fn service_address(
    field: &str,
    host: &str,
    port: i64,
    protocol: ExtAuthzProtocol,
) -> Result<ProjectedExtAuthz, Refusal> {
    Ok(ProjectedExtAuthz {
        host: at(format!("{field}.host"), check::host(host))?,
        port: at(format!("{field}.port"), authorization::check::port(port))?,
        protocol: protocol.into(),
        ..ProjectedExtAuthz::default()
    })
}

fn grpc_service(grpc: &GrpcService) -> Result<ProjectedExtAuthz, Refusal> {
    let field = "spec.extAuthz.grpc";
    unsupported(field, &grpc.unsupported)?;
    service_address(field, &grpc.host, grpc.port, ExtAuthzProtocol::Grpc)
}

fn http_service(http: &HttpService) -> Result<ProjectedExtAuthz, Refusal> {
    let field = "spec.extAuthz.http";
    unsupported(field, &http.unsupported)?;
    let mut projected = service_address(field, &http.host, http.port, ExtAuthzProtocol::Http)?;
    if !http.path_prefix.is_empty() {
        at(format!("{field}.pathPrefix"), check::path_prefix(&http.path_prefix))?;
        projected.path_prefix = http.path_prefix.clone();
    }
    let headers = format!("{field}.allowedHeaders");
    bounded(&headers, http.allowed_headers.len(), limits::ALLOWED_HEADERS)?;
    for (i, header) in http.allowed_headers.iter().enumerate() {
        at(format!("{headers}[{i}]"), check::header(header))?;
    }
    projected.allowed_headers = http.allowed_headers.clone();
    Ok(projected)
}

fn local_rate_limit(l: &LocalRateLimit) -> Result<ProjectedRateLimit, Refusal> {
    let field = "spec.localRateLimit";
    unsupported(field, &l.unsupported)?;
    let max_tokens = at(format!("{field}.maxTokens"), check::tokens(l.max_tokens))?;
    let tokens_per_fill = match l.tokens_per_fill {
        None => 0,
        Some(n) => at(format!("{field}.tokensPerFill"), check::tokens(n))?,
    };
    if tokens_per_fill > max_tokens {
        let message =
            format!("{tokens_per_fill} is more than maxTokens ({max_tokens}), which the bucket never exceeds");
        return Err(Refusal::new(format!("{field}.tokensPerFill"), message));
    }
    if l.fill_interval.is_empty() {
        return Err(Refusal::new(format!("{field}.fillInterval"), "is required (e.g. 1s)"));
    }
    let interval = check::duration_ms(&l.fill_interval, limits::FILL_INTERVAL_MS);
    Ok(ProjectedRateLimit {
        max_tokens,
        tokens_per_fill,
        fill_interval_ms: at(format!("{field}.fillInterval"), interval)?,
        status: match l.status {
            None => 0,
            Some(status) => at(format!("{field}.status"), check::status(status))?,
        },
    })
}

fn header_to_metadata(h: &HeaderToMetadata) -> Result<ProjectedHeaders, Refusal> {
    let field = "spec.headerToMetadata";
    unsupported(field, &h.unsupported)?;
    let rules_field = format!("{field}.rules");
    if h.rules.is_empty() {
        return Err(Refusal::new(rules_field, "is empty: name at least one header to copy"));
    }
    bounded(&rules_field, h.rules.len(), limits::HEADER_RULES)?;
    let rules = h.rules.iter().enumerate().map(|(i, rule)| {
        let field = format!("{rules_field}[{i}]");
        unsupported(&field, &rule.unsupported)?;
        at(format!("{field}.header"), check::header(&rule.header))?;
        at(format!("{field}.key"), check::metadata_name(&rule.key))?;
        if let Some(namespace) = &rule.metadata_namespace {
            at(format!("{field}.metadataNamespace"), check::metadata_name(namespace))?;
        }
        Ok(HeaderToMetadataRule {
            header: rule.header.clone(),
            metadata_namespace: rule.metadata_namespace.clone().unwrap_or_default(),
            key: rule.key.clone(),
            remove: rule.remove,
        })
    });
    Ok(ProjectedHeaders {
        rules: rules.collect::<Result<_, Refusal>>()?,
    })
}

fn rbac(r: &Rbac) -> Result<RbacFilter, Refusal> {
    let field = "spec.rbac";
    unsupported(field, &r.unsupported)?;
    let action = match &r.action {
        authorization::Action::Allow => AuthorizationAction::Allow,
        authorization::Action::Deny => AuthorizationAction::Deny,
        other => {
            let hint = if *other == authorization::Action::Audit {
                " (AUDIT is an AuthorizationPolicy's)"
            } else {
                ""
            };
            let message = format!("{} is not ALLOW or DENY{hint}", quote(other.as_str()));
            return Err(Refusal::new(format!("{field}.action"), message));
        }
    };
    let rules_field = format!("{field}.rules");
    bounded(&rules_field, r.rules.len(), authorization::check::limits::RULES)?;
    let rules = r.rules.iter().enumerate();
    let rules_at = crate::refusal::Field::root(&rules_field);
    let rules = rules.map(|(i, rule)| authorization::rule(rule, &rules_at.index(i)));
    let rules = rules.collect::<Result<Vec<_>, _>>()?;
    if let Some((i, j, not)) = check::ports_in_rules(&rules) {
        let name = if not { "notPorts" } else { "ports" };
        let at = format!("{rules_field}[{i}].to[{j}].operation.{name}");
        return Err(Refusal::new(at, check::PORTS_IN_RULES));
    }
    Ok(RbacFilter {
        action: action.into(),
        rules,
    })
}
