//! Routes attached to a Gateway's listeners: which parentRefs name the Gateway, which
//! listeners each one selects and takes it, on which hosts; the route projected once by
//! the mesh's own projector ([`crate::route::project_detached`]) with the backends the
//! Gateway API forbids it taken out.

use std::collections::BTreeSet;

use aether_common::quote::quote;
use aether_proto::registry::v1::Route;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

use super::listeners::{Checked, granted, is_core, takes_namespace};
use super::{AttachedRoute, CONTROLLER_NAME, EdgeInputs, ListenerProtocol, Problem, condition, intersect, reason};
use crate::gateway::{
    BackendObjectReference, BackendRef, GROUP, GrpcFilterType, GrpcRouteFilter, HttpFilterType, HttpRouteFilter,
    ParentReference, RouteGroupKind, RouteParentStatus,
};
use crate::route::{self, ConditionType, Rejected, RouteObject, project_detached, unresolved_backends};

/// The Gateway API kind of a route object.
pub fn kind_name(object: &RouteObject) -> &'static str {
    match object {
        RouteObject::Http(_) => "HTTPRoute",
        RouteObject::Grpc(_) => "GRPCRoute",
        RouteObject::Tcp(_) => "TCPRoute",
        RouteObject::Tls(_) => "TLSRoute",
    }
}

/// Whether a parentRef of a route in `namespace` names the Gateway `gateway_namespace/name`.
fn names_gateway(parent: &ParentReference, namespace: &str, gateway_namespace: &str, name: &str) -> bool {
    parent.group == GROUP
        && parent.kind == "Gateway"
        && parent.name == name
        && parent.namespace.as_deref().unwrap_or(namespace) == gateway_namespace
}

/// Attaches every route naming the Gateway to its listeners (counting them and filling
/// `routes` of each), and returns one status per (route, parentRef naming the Gateway),
/// routes in key order.
pub fn attach(
    inputs: &EdgeInputs,
    gateway_namespace: &str,
    gateway_name: &str,
    gateway_accepted: bool,
    listeners: &mut [Checked],
    now: &Time,
) -> Vec<(String, RouteParentStatus)> {
    let mut objects: Vec<(String, &RouteObject)> = inputs.routes.iter().map(|o| (o.key(), o)).collect();
    objects.sort_by(|a, b| a.0.cmp(&b.0));
    objects.dedup_by(|a, b| a.0 == b.0);
    let mut statuses = Vec::new();
    for (key, object) in objects {
        let namespace = object.namespace();
        let refs: Vec<&ParentReference> = (object.parent_refs().iter())
            .filter(|p| names_gateway(p, namespace, gateway_namespace, gateway_name))
            .collect();
        if refs.is_empty() {
            continue;
        }
        let prepared = prepare(object, inputs);
        let generation = object.metadata().generation.unwrap_or(0);
        let kind = RouteGroupKind::gateway(kind_name(object));
        let hostnames = match &prepared.route {
            Ok(route) => route.hostnames.clone(),
            Err(_) => raw_hostnames(object),
        };
        let mut attached_to: BTreeSet<usize> = BTreeSet::new();
        for parent in refs {
            let selected = match &prepared.route {
                Err(refused) if refused.condition == ConditionType::Accepted => {
                    Err(Problem::new(refused.reason, refused.to_string()))
                }
                _ if !gateway_accepted => Err(Problem::new(
                    reason::NO_MATCHING_PARENT,
                    format!(
                        "Gateway {}/{} is not accepted",
                        quote(gateway_namespace),
                        quote(gateway_name)
                    ),
                )),
                _ => select(
                    listeners,
                    parent,
                    &kind,
                    namespace,
                    &hostnames,
                    gateway_namespace,
                    inputs,
                ),
            };
            let conditions = parent_conditions(&selected, prepared.unresolved.as_ref(), generation, now);
            if let Ok(selected) = selected {
                attach_to(listeners, selected, &prepared.route, &mut attached_to);
            }
            let status = RouteParentStatus {
                parent_ref: parent.clone(),
                controller_name: CONTROLLER_NAME.to_owned(),
                conditions,
            };
            statuses.push((key.clone(), status));
        }
    }
    statuses
}

/// A parent entry's conditions: Accepted as the parentRef was (or was not) attached,
/// ResolvedRefs as the route's references resolved.
fn parent_conditions<T>(
    selected: &Result<T, Problem>,
    unresolved: Option<&Problem>,
    generation: i64,
    now: &Time,
) -> Vec<Condition> {
    let judged = |type_: &str, ok: &'static str, problem: Option<&Problem>| match problem {
        None => condition(type_, true, ok, String::new(), generation, now),
        Some(problem) => condition(type_, false, problem.reason, problem.message.clone(), generation, now),
    };
    vec![
        judged("Accepted", reason::ACCEPTED, selected.as_ref().err()),
        judged("ResolvedRefs", reason::RESOLVED_REFS, unresolved),
    ]
}

/// Attaches the route to each selected listener (by index) once, with the hosts it
/// serves there; a refused route counts as attached but serves nothing.
fn attach_to(
    listeners: &mut [Checked],
    selected: Vec<(usize, Vec<String>)>,
    route: &Result<Route, Rejected>,
    attached_to: &mut BTreeSet<usize>,
) {
    for (index, hosts) in selected {
        if !attached_to.insert(index) {
            continue;
        }
        let Some(listener) = listeners.get_mut(index) else {
            continue;
        };
        listener.attached = listener.attached.saturating_add(1);
        if let Ok(route) = route {
            listener.routes.push(AttachedRoute {
                route: route.clone(),
                hostnames: hosts,
            });
        }
    }
}

/// The listeners a parentRef attaches the route to, each with the hosts it serves there;
/// or why none: `NoMatchingParent` (sectionName and port select no listener),
/// `NotAllowedByListeners` (none selected takes this kind from this namespace),
/// `NoMatchingListenerHostname` (no hostname in common with any that does).
fn select(
    listeners: &[Checked],
    parent: &ParentReference,
    kind: &RouteGroupKind,
    namespace: &str,
    hostnames: &[String],
    gateway_namespace: &str,
    inputs: &EdgeInputs,
) -> Result<Vec<(usize, Vec<String>)>, Problem> {
    let selected: Vec<(usize, &Checked)> = (listeners.iter().enumerate())
        .filter(|(_, l)| parent.section_name.as_deref().is_none_or(|s| s == l.spec.name))
        .filter(|(_, l)| parent.port.is_none_or(|p| p == l.spec.port))
        .collect();
    if selected.is_empty() {
        let mut wanted = Vec::new();
        if let Some(section) = &parent.section_name {
            wanted.push(format!("named {}", quote(section)));
        }
        if let Some(port) = parent.port {
            wanted.push(format!("on port {port}"));
        }
        let message = format!("the Gateway has no listener {}", wanted.join(" and "));
        return Err(Problem::new(reason::NO_MATCHING_PARENT, message));
    }
    let allowed: Vec<(usize, &Checked)> = (selected.into_iter())
        .filter(|(_, l)| l.kinds.contains(kind))
        .filter(|(_, l)| {
            l.namespaces
                .is_some_and(|n| takes_namespace(n, namespace, gateway_namespace, inputs.namespace_labels))
        })
        .collect();
    if allowed.is_empty() {
        let message = format!(
            "no listener it selects takes a {} from namespace {}",
            kind.kind,
            quote(namespace)
        );
        return Err(Problem::new(reason::NOT_ALLOWED_BY_LISTENERS, message));
    }
    let matched: Vec<(usize, Vec<String>)> = (allowed.into_iter())
        .filter_map(|(i, l)| {
            if l.protocol == Some(ListenerProtocol::Tcp) {
                return Some((i, Vec::new()));
            }
            let hosts = intersect(l.hostname.as_deref(), hostnames);
            let disjoint = l.hostname.is_some() && !hostnames.is_empty() && hosts.is_empty();
            (!disjoint).then_some((i, hosts))
        })
        .collect();
    if matched.is_empty() {
        let message = "no listener it selects has a hostname in common with the route's hostnames".to_owned();
        return Err(Problem::new(reason::NO_MATCHING_LISTENER_HOSTNAME, message));
    }
    Ok(matched)
}

/// A route object as the edge serves it.
struct Prepared {
    /// The projection, or why the route is refused as a whole. A refusal of the
    /// `ResolvedRefs` kind (every backend of a TCPRoute or TLSRoute refused) leaves the
    /// route attached and accepted, serving nothing.
    route: Result<Route, Rejected>,
    /// The first reference that does not resolve (`ResolvedRefs=False`), if any.
    unresolved: Option<Problem>,
}

/// Takes out the backends the Gateway API forbids, projects the rest with the mesh's
/// projector, and finds the backends that do not exist.
///
/// A backend that is not a core Service (`InvalidKind`) or in another namespace without a
/// ReferenceGrant from this route kind (`RefNotPermitted`) is removed from its rule, and a
/// mirror to one is removed from its filters: the rule's other backends keep their
/// weights, and a rule left with none answers 500 (the projection's meaning of no
/// backend). A TCPRoute or TLSRoute left with no backend serves nothing. A missing
/// Service (`BackendNotFound`) stays in the route: the edge answers 500 for its share.
fn prepare(object: &RouteObject, inputs: &EdgeInputs) -> Prepared {
    let namespace = object.namespace();
    let kind = kind_name(object);
    let mut refused: Vec<Rejected> = Vec::new();
    let mut keep =
        |reference: &BackendObjectReference, field: String| match refusal(reference, namespace, kind, inputs, field) {
            Some(rejected) => {
                refused.push(rejected);
                false
            }
            None => true,
        };
    let mut object = object.clone();
    let mut emptied = false;
    match &mut object {
        RouteObject::Http(route) => {
            for (i, rule) in route.spec.rules.iter_mut().enumerate() {
                strip(
                    &mut rule.filters,
                    &mut rule.backend_refs,
                    &format!("spec.rules[{i}]"),
                    &mut keep,
                );
            }
        }
        RouteObject::Grpc(route) => {
            for (i, rule) in route.spec.rules.iter_mut().enumerate() {
                strip(
                    &mut rule.filters,
                    &mut rule.backend_refs,
                    &format!("spec.rules[{i}]"),
                    &mut keep,
                );
            }
        }
        RouteObject::Tcp(route) => {
            for (i, rule) in route.spec.rules.iter_mut().enumerate() {
                let had = !rule.backend_refs.is_empty();
                strip(
                    &mut Vec::new(),
                    &mut rule.backend_refs,
                    &format!("spec.rules[{i}]"),
                    &mut keep,
                );
                emptied |= had && rule.backend_refs.is_empty();
            }
        }
        RouteObject::Tls(route) => {
            for (i, rule) in route.spec.rules.iter_mut().enumerate() {
                let had = !rule.backend_refs.is_empty();
                strip(
                    &mut Vec::new(),
                    &mut rule.backend_refs,
                    &format!("spec.rules[{i}]"),
                    &mut keep,
                );
                emptied |= had && rule.backend_refs.is_empty();
            }
        }
    }
    let route = match refused.first() {
        Some(first) if emptied => Err(first.clone()),
        _ => project_detached(&object),
    };
    let missing = match &route {
        Ok(route) => unresolved_backends(route, |service| (inputs.service_exists)(service)).err(),
        Err(_) => None,
    };
    let mut problems = refused.into_iter().chain(missing);
    let unresolved = match &route {
        // The projector's own ResolvedRefs refusal (a backend kind it does not take).
        Err(rejected) if rejected.condition == ConditionType::ResolvedRefs && !emptied => {
            Some(Problem::new(rejected.reason, rejected.to_string()))
        }
        _ => problems.next().map(|first| {
            let more = problems.count();
            let mut message = first.to_string();
            if more > 0 {
                message.push_str(&format!(" (and {more} more unresolved reference(s))"));
            }
            Problem::new(first.reason, message)
        }),
    };
    Prepared { route, unresolved }
}

/// Why the edge cannot send to a backend or mirror, if it cannot.
fn refusal(
    reference: &BackendObjectReference,
    namespace: &str,
    kind: &str,
    inputs: &EdgeInputs,
    field: String,
) -> Option<Rejected> {
    if !is_core(&reference.group) || reference.kind != "Service" {
        let message = format!(
            "backend {}/{} is not a Service: only core Services are edge backends",
            quote(&reference.group),
            quote(&reference.kind)
        );
        return Some(Rejected {
            condition: ConditionType::ResolvedRefs,
            reason: route::reason::INVALID_KIND,
            field,
            message,
        });
    }
    let backend_namespace = reference.namespace.as_deref().unwrap_or(namespace);
    let from = (GROUP, kind, namespace);
    if backend_namespace != namespace
        && !granted(inputs.grants, backend_namespace, from, ("", "Service", &reference.name))
    {
        let message = format!(
            "no ReferenceGrant in namespace {} lets {kind}s of namespace {} use Service {}",
            quote(backend_namespace),
            quote(namespace),
            quote(&reference.name)
        );
        return Some(Rejected {
            condition: ConditionType::ResolvedRefs,
            reason: reason::REF_NOT_PERMITTED,
            field,
            message,
        });
    }
    None
}

/// A filter that may mirror to a backend.
trait Mirror {
    fn mirror(&self) -> Option<&BackendObjectReference>;
}

impl Mirror for HttpRouteFilter {
    fn mirror(&self) -> Option<&BackendObjectReference> {
        match self.type_ {
            HttpFilterType::RequestMirror => self.request_mirror.as_ref().map(|m| &m.backend_ref),
            _ => None,
        }
    }
}

impl Mirror for GrpcRouteFilter {
    fn mirror(&self) -> Option<&BackendObjectReference> {
        match self.type_ {
            GrpcFilterType::RequestMirror => self.request_mirror.as_ref().map(|m| &m.backend_ref),
            _ => None,
        }
    }
}

impl Mirror for serde_json::Value {
    fn mirror(&self) -> Option<&BackendObjectReference> {
        None
    }
}

/// Removes the mirrors (of the rule and of its backends) and the backends of one rule
/// that `keep` refuses, `keep` being given each one's field.
fn strip<F: Mirror>(
    filters: &mut Vec<F>,
    backends: &mut Vec<BackendRef<F>>,
    field: &str,
    keep: &mut impl FnMut(&BackendObjectReference, String) -> bool,
) {
    let mut mirrors = |filters: &mut Vec<F>, field: &str| {
        let mut k = 0;
        filters.retain(|filter| {
            let at = format!("{field}.filters[{k}].requestMirror.backendRef");
            k += 1;
            filter.mirror().is_none_or(|reference| keep(reference, at))
        });
    };
    mirrors(filters, field);
    for (j, backend) in backends.iter_mut().enumerate() {
        mirrors(&mut backend.filters, &format!("{field}.backendRefs[{j}]"));
    }
    let mut j = 0;
    backends.retain(|backend| {
        let at = format!("{field}.backendRefs[{j}]");
        j += 1;
        keep(&backend.object(), at)
    });
}

/// A route's hostnames as written, lower-cased (for a route refused before they were
/// checked; they only decide where it attaches).
fn raw_hostnames(object: &RouteObject) -> Vec<String> {
    let hostnames: &[String] = match object {
        RouteObject::Http(route) => &route.spec.hostnames,
        RouteObject::Grpc(route) => &route.spec.hostnames,
        RouteObject::Tls(route) => &route.spec.hostnames,
        RouteObject::Tcp(_) => &[],
    };
    hostnames.iter().map(|h| h.to_ascii_lowercase()).collect()
}
