//! Projection of the parts HTTPRoute and GRPCRoute share: header matches, header
//! modifiers, backends, mirrors, rule names.

use std::collections::HashSet;

use aether_common::quote::quote;
use aether_proto::registry::v1::route_filter::Filter;
use aether_proto::registry::v1::{
    Header, HeaderModifier, MatchType, Mirror, RouteBackend, RouteFilter, RouteRule, ValueMatch,
};

use super::check::{self, limits};
use super::{Rejected, at};
use crate::gateway::{BackendObjectReference, BackendRef, HeaderFilter, HttpHeaderMatch, MatchValueType};

/// Header matches: names lower-cased; of equal names only the first counts (Gateway API).
pub fn header_matches(matches: &[HttpHeaderMatch], field: &str) -> Result<Vec<ValueMatch>, Rejected> {
    value_matches(matches, field, true)
}

/// Query parameter matches: names as written; of equal names only the first counts.
pub fn query_matches(matches: &[HttpHeaderMatch], field: &str) -> Result<Vec<ValueMatch>, Rejected> {
    value_matches(matches, field, false)
}

fn value_matches(matches: &[HttpHeaderMatch], field: &str, header: bool) -> Result<Vec<ValueMatch>, Rejected> {
    if matches.len() > limits::VALUE_MATCHES {
        return Err(Rejected::unsupported(
            field,
            format!("{} matches (at most 16)", matches.len()),
        ));
    }
    let mut seen = HashSet::new();
    let mut projected = Vec::new();
    for (i, m) in matches.iter().enumerate() {
        let at_i = format!("{field}[{i}]");
        at(format!("{at_i}.name"), check::header_name(&m.name))?;
        let name = if header {
            m.name.to_ascii_lowercase()
        } else {
            m.name.clone()
        };
        let max = if header {
            limits::HEADER_VALUE_LEN
        } else {
            limits::QUERY_VALUE_LEN
        };
        let type_ = match_type(&m.type_, &m.value, &format!("{at_i}.type"), &format!("{at_i}.value"))?;
        if type_ == MatchType::Exact {
            at(format!("{at_i}.value"), check::header_value(&m.value, max))?;
        }
        if seen.insert(name.clone()) {
            projected.push(ValueMatch {
                name,
                r#type: type_.into(),
                value: m.value.clone(),
            });
        }
    }
    Ok(projected)
}

/// Exact or RegularExpression (compiled); any other type is unsupported.
pub fn match_type(
    type_: &MatchValueType,
    value: &str,
    type_field: &str,
    value_field: &str,
) -> Result<MatchType, Rejected> {
    match type_ {
        MatchValueType::Exact => Ok(MatchType::Exact),
        MatchValueType::RegularExpression => {
            at(value_field, check::regex(value))?;
            Ok(MatchType::Regex)
        }
        MatchValueType::Other(other) => Err(Rejected::unsupported(
            type_field,
            format!("{} is not Exact or RegularExpression", quote(other)),
        )),
    }
}

/// A request or response header modifier: names lower-cased, one action per name.
pub fn header_modifier(filter: Option<&HeaderFilter>, field: &str) -> Result<Filter, Rejected> {
    let Some(filter) = filter else {
        return Err(Rejected::unsupported(field, "must be set for this filter type"));
    };
    let mut names = HashSet::new();
    let mut once = |name: &str, at_i: &str| {
        at(at_i, check::modifiable_header(name))?;
        let lower = name.to_ascii_lowercase();
        if !names.insert(lower.clone()) {
            return Err(Rejected::unsupported(
                at_i,
                format!("{} has more than one action in this filter", quote(name)),
            ));
        }
        Ok(lower)
    };
    let mut headers = |list: &[crate::gateway::HttpHeader], part: &str| -> Result<Vec<Header>, Rejected> {
        if list.len() > limits::HEADER_EDITS {
            return Err(Rejected::unsupported(format!("{field}.{part}"), "at most 16 headers"));
        }
        let mut out = Vec::new();
        for (i, h) in list.iter().enumerate() {
            let name = once(&h.name, &format!("{field}.{part}[{i}].name"))?;
            at(
                format!("{field}.{part}[{i}].value"),
                check::header_value(&h.value, limits::HEADER_VALUE_LEN),
            )?;
            out.push(Header {
                name,
                value: h.value.clone(),
            });
        }
        Ok(out)
    };
    let set = headers(&filter.set, "set")?;
    let add = headers(&filter.add, "add")?;
    if filter.remove.len() > limits::HEADER_EDITS {
        return Err(Rejected::unsupported(format!("{field}.remove"), "at most 16 headers"));
    }
    let mut remove = Vec::new();
    for (i, name) in filter.remove.iter().enumerate() {
        remove.push(once(name, &format!("{field}.remove[{i}]"))?);
    }
    Ok(Filter::RequestHeaderModifier(HeaderModifier { set, add, remove }))
}

/// A backend: a core Service in the mesh, with its port (required, as the API's CRD
/// requires it for Services). Cross-namespace references need no ReferenceGrant in the mesh.
pub fn backend(reference: &BackendObjectReference, namespace: &str, field: &str) -> Result<RouteBackend, Rejected> {
    if !(reference.group.is_empty() || reference.group == "core") || reference.kind != "Service" {
        return Err(Rejected::invalid_kind(
            field,
            format!(
                "backend {}/{} is not a Service: only core Services are mesh backends",
                quote(&reference.group),
                quote(&reference.kind)
            ),
        ));
    }
    let backend_namespace = reference.namespace.as_deref().unwrap_or(namespace);
    at(format!("{field}.namespace"), check::label(backend_namespace))?;
    at(format!("{field}.name"), check::label(&reference.name))?;
    let Some(port) = reference.port else {
        return Err(Rejected::unsupported(
            format!("{field}.port"),
            "is required for a Service backend",
        ));
    };
    Ok(RouteBackend {
        service: format!("{backend_namespace}/{}", reference.name),
        port: at(format!("{field}.port"), check::port(port))?,
        weight: 1,
        filters: Vec::new(),
    })
}

/// A weighted backend; `filter` projects its filters (the route type's own).
pub fn weighted_backend<F>(
    reference: &BackendRef<F>,
    namespace: &str,
    field: &str,
    filter: impl Fn(&F, &str) -> Result<RouteFilter, Rejected>,
) -> Result<RouteBackend, Rejected> {
    let mut backend = backend(&reference.object(), namespace, field)?;
    backend.weight = match u32::try_from(reference.weight) {
        Ok(weight) if weight <= limits::WEIGHT => weight,
        _ => {
            let message = format!("{} is not a weight (0 to 1000000)", reference.weight);
            return Err(Rejected::unsupported(format!("{field}.weight"), message));
        }
    };
    if reference.filters.len() > limits::FILTERS {
        return Err(Rejected::unsupported(format!("{field}.filters"), "at most 16 filters"));
    }
    backend.filters = (reference.filters.iter().enumerate())
        .map(|(i, f)| filter(f, &format!("{field}.filters[{i}]")))
        .collect::<Result<_, _>>()?;
    Ok(backend)
}

/// A mirror: its backend (a Service with a port) and the share mirrored, rounded to a
/// percent (100 when neither percent nor fraction is set).
pub fn mirror(
    mirror: Option<&crate::gateway::RequestMirrorFilter>,
    namespace: &str,
    field: &str,
) -> Result<Filter, Rejected> {
    let Some(mirror) = mirror else {
        return Err(Rejected::unsupported(field, "must be set for this filter type"));
    };
    let backend = backend(&mirror.backend_ref, namespace, &format!("{field}.backendRef"))?;
    let percent = match (mirror.percent, &mirror.fraction) {
        (Some(_), Some(_)) => return Err(Rejected::unsupported(field, "set percent or fraction, not both")),
        (Some(percent), None) => u32::try_from(percent).ok().filter(|p| *p <= 100),
        (None, Some(f)) if f.denominator > 0 && (0..=f.denominator).contains(&f.numerator) => {
            Some(((i64::from(f.numerator) * 100 + i64::from(f.denominator) / 2) / i64::from(f.denominator)) as u32)
        }
        (None, Some(_)) => None,
        (None, None) => Some(100),
    };
    let Some(percent) = percent else {
        return Err(Rejected::unsupported(
            field,
            "the share mirrored must be 0 to 100 percent (numerator ≤ denominator)",
        ));
    };
    Ok(Filter::RequestMirror(Mirror {
        backend: Some(backend),
        percent,
    }))
}

/// A rule name: a DNS subdomain, unique in the route.
pub fn rule_name(name: Option<&str>, seen: &mut HashSet<String>, field: &str) -> Result<String, Rejected> {
    let Some(name) = name else { return Ok(String::new()) };
    at(field, check::subdomain(name))?;
    if !seen.insert(name.to_owned()) {
        return Err(Rejected::unsupported(
            field,
            format!("{} names two rules of this route", quote(name)),
        ));
    }
    Ok(name.to_owned())
}

/// How big a rule is, for the limits both route kinds share.
pub struct RuleSize {
    pub session_persistence: bool,
    pub matches: usize,
    pub filters: usize,
    pub backends: usize,
}

/// Projects every rule with `project_rule(rule, field, names)`, or the API's default
/// rule when there is none, within the limits both kinds share: 16 rules, 128 matches in
/// all, and per rule 64 matches, 16 filters and 16 backends; session persistence is
/// refused. `names` collects the rule names (they must be unique).
pub fn project_rules<R: Default + Clone>(
    rules: &[R],
    size: impl Fn(&R) -> RuleSize,
    mut project_rule: impl FnMut(&R, &str, &mut HashSet<String>) -> Result<RouteRule, Rejected>,
) -> Result<Vec<RouteRule>, Rejected> {
    if rules.len() > limits::RULES {
        return Err(Rejected::unsupported(
            "spec.rules",
            format!("{} rules (at most 16)", rules.len()),
        ));
    }
    let rules = if rules.is_empty() {
        vec![R::default()]
    } else {
        rules.to_vec()
    };
    let total: usize = rules.iter().map(|r| size(r).matches).sum();
    if total > limits::MATCHES_PER_ROUTE {
        return Err(Rejected::unsupported(
            "spec.rules",
            format!("{total} matches in all (at most 128)"),
        ));
    }
    let mut names = HashSet::new();
    (rules.iter().enumerate())
        .map(|(i, rule)| {
            let field = format!("spec.rules[{i}]");
            check_size(&size(rule), &field)?;
            project_rule(rule, &field, &mut names)
        })
        .collect()
}

fn check_size(size: &RuleSize, field: &str) -> Result<(), Rejected> {
    if size.session_persistence {
        return Err(Rejected::unsupported(
            format!("{field}.sessionPersistence"),
            "session persistence is not supported",
        ));
    }
    let over = |list: &str, what: &str, n: usize, most: usize| {
        (n > most).then(|| Rejected::unsupported(format!("{field}.{list}"), format!("at most {most} {what}")))
    };
    let over = over("matches", "matches", size.matches, limits::MATCHES_PER_RULE)
        .or_else(|| over("filters", "filters", size.filters, limits::FILTERS))
        .or_else(|| over("backendRefs", "backends", size.backends, limits::BACKENDS));
    match over {
        Some(rejected) => Err(rejected),
        None => Ok(()),
    }
}

/// The filter of a header modifier as a response modifier.
pub fn as_response(filter: Filter) -> Filter {
    match filter {
        Filter::RequestHeaderModifier(m) => Filter::ResponseHeaderModifier(m),
        other => other,
    }
}
