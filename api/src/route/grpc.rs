//! GRPCRoute rules → `RouteRule`s.

use std::collections::HashSet;

use aether_common::quote::quote;
use aether_proto::registry::v1::route_filter::Filter;
use aether_proto::registry::v1::{GrpcMethodMatch, MatchType, RouteFilter, RouteMatch, RouteRule};

use super::check;
use super::shared::{self, as_response};
use super::{Rejected, at};
use crate::gateway::{GrpcFilterType, GrpcRouteFilter, GrpcRouteMatch, GrpcRouteRule, MatchValueType};

pub fn rules(rules: &[GrpcRouteRule], namespace: &str) -> Result<Vec<RouteRule>, Rejected> {
    let size = |rule: &GrpcRouteRule| shared::RuleSize {
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
    rule: &GrpcRouteRule,
    namespace: &str,
    field: &str,
    names: &mut HashSet<String>,
) -> Result<RouteRule, Rejected> {
    let matches = (rule.matches.iter().enumerate())
        .map(|(i, m)| route_match(m, &format!("{field}.matches[{i}]")))
        .collect::<Result<Vec<_>, _>>()?;
    let mut seen = HashSet::new();
    let mut filters = Vec::new();
    for (i, f) in rule.filters.iter().enumerate() {
        let at_i = format!("{field}.filters[{i}]");
        if f.type_ != GrpcFilterType::RequestMirror && !seen.insert(f.type_.clone()) {
            let message = format!("{} appears twice in this rule", f.type_.as_str());
            return Err(Rejected::unsupported(format!("{at_i}.type"), message));
        }
        filters.push(RouteFilter {
            filter: Some(filter(f, namespace, &at_i)?),
        });
    }
    let backends = (rule.backend_refs.iter().enumerate())
        .map(|(i, b)| shared::weighted_backend(b, namespace, &format!("{field}.backendRefs[{i}]"), backend_filter))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(RouteRule {
        name: shared::rule_name(rule.name.as_deref(), names, &format!("{field}.name"))?,
        matches,
        filters,
        backends,
        ..Default::default()
    })
}

fn route_match(m: &GrpcRouteMatch, field: &str) -> Result<RouteMatch, Rejected> {
    Ok(RouteMatch {
        headers: shared::header_matches(&m.headers, &format!("{field}.headers"))?,
        grpc_method: m
            .method
            .as_ref()
            .map(|method| method_match(method, &format!("{field}.method")))
            .transpose()?,
        ..Default::default()
    })
}

/// Service and/or method, exact (names checked) or regular expressions.
fn method_match(m: &crate::gateway::GrpcMethodMatch, field: &str) -> Result<GrpcMethodMatch, Rejected> {
    if m.service.is_none() && m.method.is_none() {
        return Err(Rejected::unsupported(field, "set service, method or both"));
    }
    let service = m.service.clone().unwrap_or_default();
    let method = m.method.clone().unwrap_or_default();
    let type_ = match &m.type_ {
        MatchValueType::Exact => {
            if m.service.is_some() {
                at(format!("{field}.service"), check::grpc_service(&service))?;
            }
            if m.method.is_some() {
                at(format!("{field}.method"), check::grpc_method(&method))?;
            }
            MatchType::Exact
        }
        MatchValueType::RegularExpression => {
            at(format!("{field}.service"), check::regex(&service))?;
            at(format!("{field}.method"), check::regex(&method))?;
            MatchType::Regex
        }
        MatchValueType::Other(other) => {
            let message = format!("{} is not Exact or RegularExpression", quote(other));
            return Err(Rejected::unsupported(format!("{field}.type"), message));
        }
    };
    Ok(GrpcMethodMatch {
        r#type: type_.into(),
        service,
        method,
    })
}

fn filter(filter: &GrpcRouteFilter, namespace: &str, field: &str) -> Result<Filter, Rejected> {
    match &filter.type_ {
        GrpcFilterType::RequestHeaderModifier => shared::header_modifier(
            filter.request_header_modifier.as_ref(),
            &format!("{field}.requestHeaderModifier"),
        ),
        GrpcFilterType::ResponseHeaderModifier => {
            let field = format!("{field}.responseHeaderModifier");
            shared::header_modifier(filter.response_header_modifier.as_ref(), &field).map(as_response)
        }
        GrpcFilterType::RequestMirror => shared::mirror(
            filter.request_mirror.as_ref(),
            namespace,
            &format!("{field}.requestMirror"),
        ),
        other => {
            let message = format!("filter {} is not supported by the mesh", quote(other.as_str()));
            Err(Rejected::unsupported(format!("{field}.type"), message))
        }
    }
}

fn backend_filter(filter: &GrpcRouteFilter, field: &str) -> Result<RouteFilter, Rejected> {
    if filter.type_ != GrpcFilterType::RequestHeaderModifier {
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
