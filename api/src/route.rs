//! THE route projector: a Gateway API HTTPRoute, GRPCRoute, TCPRoute or TLSRoute whose parentRefs name mesh
//! Services (GAMMA), validated and projected once into `aether.registry.v1.Route`. The
//! registrar's sources, the agent (re-validating what it received) and the admission
//! webhooks all call these functions, so they agree on what a route means.
//!
//! Refusals follow the Gateway API's status model: each names the condition it sets to
//! False (`Accepted` or `ResolvedRefs`), the API's reason, and the field, with the input
//! quoted bounded.

use std::fmt;

use aether_proto::registry::v1::route_filter::Filter;
use aether_proto::registry::v1::{Protocol, Route, RouteKind, RouteParent, RouteRule};
use aether_proto::view::route_kind_name;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use crate::gateway::{GrpcRoute, HttpRoute, ParentReference, TcpRoute, TlsRoute};

pub mod check;
mod grpc;
mod http;
pub mod order;
pub mod request;
mod shared;
mod tcp;
mod validate;

use check::limits;
pub use validate::{InvalidRoute, validate};

/// A route object of any kind, as a source delivers it.
#[derive(Clone, Debug, PartialEq)]
pub enum RouteObject {
    Http(HttpRoute),
    Grpc(GrpcRoute),
    Tcp(TcpRoute),
    Tls(TlsRoute),
}

/// The Gateway API condition a refusal sets to False.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ConditionType {
    /// The route is invalid or uses what the mesh does not support.
    Accepted,
    /// A reference (a backend) cannot be resolved.
    ResolvedRefs,
}

impl ConditionType {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Accepted => "Accepted",
            Self::ResolvedRefs => "ResolvedRefs",
        }
    }
}

/// The Gateway API reasons the projector and the registrar use.
pub mod reason {
    pub const ACCEPTED: &str = "Accepted";
    pub const RESOLVED_REFS: &str = "ResolvedRefs";
    /// A value the API allows but the mesh does not implement, or an invalid value.
    pub const UNSUPPORTED_VALUE: &str = "UnsupportedValue";
    pub const INCOMPATIBLE_FILTERS: &str = "IncompatibleFilters";
    /// A backend of a kind other than a core Service.
    pub const INVALID_KIND: &str = "InvalidKind";
    /// A backend Service that is not in the catalog.
    pub const BACKEND_NOT_FOUND: &str = "BackendNotFound";
}

/// Why a route object is refused. Display: `field: message`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct Rejected {
    pub condition: ConditionType,
    pub reason: &'static str,
    /// The object's field, e.g. `spec.rules[1].matches[0].path.value`.
    pub field: String,
    pub message: String,
}

impl Rejected {
    /// Invalid, or valid but not implemented by the mesh: `Accepted=False, UnsupportedValue`.
    pub(crate) fn unsupported(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self::accepted(reason::UNSUPPORTED_VALUE, field, message)
    }

    pub(crate) fn accepted(reason: &'static str, field: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            condition: ConditionType::Accepted,
            reason,
            field: field.into(),
            message: message.into(),
        }
    }

    pub(crate) fn invalid_kind(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            condition: ConditionType::ResolvedRefs,
            reason: reason::INVALID_KIND,
            field: field.into(),
            message: message.into(),
        }
    }
}

/// A value check's refusal, as `Accepted=False, UnsupportedValue` on `field`.
pub(crate) fn at<T>(field: impl fmt::Display, result: Result<T, String>) -> Result<T, Rejected> {
    result.map_err(|message| Rejected::unsupported(field.to_string(), message))
}

/// The namespace of an object that does not say (a file without `metadata.namespace`).
pub const DEFAULT_NAMESPACE: &str = "default";

impl RouteObject {
    pub fn kind(&self) -> RouteKind {
        match self {
            Self::Http(_) => RouteKind::Http,
            Self::Grpc(_) => RouteKind::Grpc,
            Self::Tcp(_) => RouteKind::Tcp,
            Self::Tls(_) => RouteKind::Tls,
        }
    }

    pub fn metadata(&self) -> &ObjectMeta {
        match self {
            Self::Http(route) => &route.metadata,
            Self::Grpc(route) => &route.metadata,
            Self::Tcp(route) => &route.metadata,
            Self::Tls(route) => &route.metadata,
        }
    }

    pub fn parent_refs(&self) -> &[ParentReference] {
        match self {
            Self::Http(route) => &route.spec.parent_refs,
            Self::Grpc(route) => &route.spec.parent_refs,
            Self::Tcp(route) => &route.spec.parent_refs,
            Self::Tls(route) => &route.spec.parent_refs,
        }
    }

    /// The object's namespace, `default` when unset.
    pub fn namespace(&self) -> &str {
        self.metadata().namespace.as_deref().unwrap_or(DEFAULT_NAMESPACE)
    }

    pub fn name(&self) -> &str {
        self.metadata().name.as_deref().unwrap_or_default()
    }

    /// `<kind>/<namespace>/<name>`, the key of its projection
    /// (`aether_proto::view::route_key`).
    pub fn key(&self) -> String {
        format!("{}/{}/{}", route_kind_name(self.kind()), self.namespace(), self.name())
    }
}

/// Whether a parentRef names a Service (the mesh's parents); others (Gateways) are the
/// edge's business.
pub fn is_service_parent(parent: &ParentReference) -> bool {
    (parent.group.is_empty() || parent.group == "core") && parent.kind == "Service"
}

/// Validates a route object and projects it. `Ok(None)`: no parentRef is a Service, so it
/// is not a mesh route and is ignored.
pub fn project(object: &RouteObject) -> Result<Option<Route>, Rejected> {
    if !object.parent_refs().iter().any(is_service_parent) {
        return Ok(None);
    }
    // The mesh takes server names from TLS routes only: a Service parent already names
    // the host, so an HTTPRoute's or GRPCRoute's hostnames are not read (nor refused).
    let mut route = detached(object, matches!(object, RouteObject::Tls(_)))?;
    route.parents = parents(object.parent_refs(), object.namespace())?;
    Ok(Some(route))
}

/// Validates a route object and projects it whatever its parents (the edge's Gateways
/// attach it themselves): `parents` is empty; `hostnames` holds the route's own
/// `spec.hostnames` (HTTPRoute, GRPCRoute, TLSRoute), lower-cased and deduplicated. The
/// rules are projected exactly as [`project`] projects them for the mesh.
pub fn project_detached(object: &RouteObject) -> Result<Route, Rejected> {
    detached(object, true)
}

/// The projection without parents; `with_hostnames`: read and check `spec.hostnames`.
fn detached(object: &RouteObject, with_hostnames: bool) -> Result<Route, Rejected> {
    let namespace = object.namespace();
    at("metadata.namespace", check::label(namespace))?;
    at("metadata.name", check::subdomain(object.name()))?;
    let meta = object.metadata();
    let rules = match object {
        RouteObject::Http(route) => http::rules(&route.spec.rules, namespace)?,
        RouteObject::Grpc(route) => grpc::rules(&route.spec.rules, namespace)?,
        RouteObject::Tcp(route) => tcp::rules(&route.spec.rules, namespace)?,
        RouteObject::Tls(route) => tcp::rules(&route.spec.rules, namespace)?,
    };
    let hostnames = match object {
        _ if !with_hostnames => Vec::new(),
        RouteObject::Http(route) => tcp::hostnames(&route.spec.hostnames)?,
        RouteObject::Grpc(route) => tcp::hostnames(&route.spec.hostnames)?,
        RouteObject::Tls(route) => tcp::hostnames(&route.spec.hostnames)?,
        RouteObject::Tcp(_) => Vec::new(),
    };
    Ok(Route {
        kind: object.kind().into(),
        namespace: namespace.to_owned(),
        name: object.name().to_owned(),
        parents: Vec::new(),
        rules,
        created_unix_seconds: meta.creation_timestamp.as_ref().map_or(0, |t| t.0.as_second()),
        generation: meta.generation.unwrap_or(0),
        hostnames,
    })
}

/// The Service parents, deduplicated, in order.
fn parents(refs: &[ParentReference], namespace: &str) -> Result<Vec<RouteParent>, Rejected> {
    if refs.len() > limits::PARENTS {
        return Err(Rejected::unsupported(
            "spec.parentRefs",
            format!("{} parents (at most 32)", refs.len()),
        ));
    }
    let mut parents: Vec<RouteParent> = Vec::new();
    for (i, parent) in refs.iter().enumerate().filter(|(_, p)| is_service_parent(p)) {
        let field = format!("spec.parentRefs[{i}]");
        let parent_namespace = parent.namespace.as_deref().unwrap_or(namespace);
        at(format!("{field}.namespace"), check::label(parent_namespace))?;
        at(format!("{field}.name"), check::label(&parent.name))?;
        if parent.section_name.is_some() {
            // The proto selects a port by number only; a name would need the Service's spec.
            return Err(Rejected::unsupported(
                format!("{field}.sectionName"),
                "a Service port by name is not supported; use port",
            ));
        }
        let port = parent.port.map(check::port).transpose();
        let parent = RouteParent {
            service: format!("{parent_namespace}/{}", parent.name),
            port: at(format!("{field}.port"), port)?.unwrap_or(0),
        };
        if !parents.contains(&parent) {
            parents.push(parent);
        }
    }
    Ok(parents)
}

/// The services a route sends traffic to: its backends and mirror backends. They join the
/// dependency set of every node that receives the route.
pub fn backend_services(route: &Route) -> impl Iterator<Item = &str> {
    route.rules.iter().flat_map(rule_backends)
}

/// The first backend service `known` does not hold, as a `ResolvedRefs=False,
/// BackendNotFound` refusal (the route still serves: Gateway API sends that backend's
/// share of requests a 500).
pub fn unresolved_backends(route: &Route, known: impl Fn(&str) -> bool) -> Result<(), Rejected> {
    for (i, rule) in route.rules.iter().enumerate() {
        if let Some(service) = rule_backends(rule).find(|service| !known(service)) {
            return Err(Rejected {
                condition: ConditionType::ResolvedRefs,
                reason: reason::BACKEND_NOT_FOUND,
                field: format!("spec.rules[{i}].backendRefs"),
                message: format!("service {} is not in the mesh", aether_common::quote::quote(service)),
            });
        }
    }
    Ok(())
}

/// A parent port that carries the other kind of traffic (an HTTPRoute or GRPCRoute on a
/// TCP stream port, a TCPRoute or TLSRoute on an HTTP port) is shaped by nothing there: the
/// agent leaves the route out on that port, and this says so as `Accepted=False,
/// UnsupportedValue`. `protocol_at(service, port)`: what the service's port carries, if
/// the catalog knows (see [`crate::service_ports`]).
pub fn mismatched_ports(route: &Route, protocol_at: impl Fn(&str, u32) -> Option<Protocol>) -> Result<(), Rejected> {
    let connections = matches!(route.kind(), RouteKind::Tcp | RouteKind::Tls);
    for parent in route.parents.iter().filter(|p| p.port != 0) {
        let Some(protocol) = protocol_at(&parent.service, parent.port) else {
            continue;
        };
        if crate::service_ports::is_http(protocol) != connections {
            continue;
        }
        let (carries, instead) = match connections {
            true => ("HTTP", "an HTTPRoute or GRPCRoute"),
            false => ("a TCP stream", "a TCPRoute or TLSRoute"),
        };
        let message = format!(
            "port {} of service {} carries {carries}: a {} route does not shape it (use {instead})",
            parent.port,
            aether_common::quote::quote(&parent.service),
            route_kind_name(route.kind()),
        );
        return Err(Rejected::unsupported("spec.parentRefs", message));
    }
    Ok(())
}

/// A rule's backends, then its mirror backends (rule and backend filters).
fn rule_backends(rule: &RouteRule) -> impl Iterator<Item = &str> {
    let mirrors = rule
        .filters
        .iter()
        .chain(rule.backends.iter().flat_map(|b| &b.filters))
        .filter_map(|f| match &f.filter {
            Some(Filter::RequestMirror(mirror)) => mirror.backend.as_ref().map(|b| b.service.as_str()),
            _ => None,
        });
    rule.backends.iter().map(|b| b.service.as_str()).chain(mirrors)
}
