//! THE edge projector: one Gateway (Gateway API, north-south) validated, its routes
//! attached, and what to serve and what to report computed in one pure function,
//! [`project`], which the edge's xDS server and the status writer both call so they
//! agree. Routes are projected by the mesh's own projector
//! ([`crate::route::project_detached`]): a rule means the same thing east-west and
//! north-south.
//!
//! Where the Gateway API leaves room, the edge decides:
//! - **Class.** Only Gateways whose GatewayClass exists and names [`CONTROLLER_NAME`] are
//!   ours. A missing class or another controller's: nothing is served and no status is
//!   computed (empty conditions, `class` None), so another controller's status is never
//!   touched. The edge takes no parameters: a class with `parametersRef` is
//!   `Accepted=False, InvalidParameters`, and its Gateways `Accepted=False, Invalid`.
//! - **Gateway.** `spec.addresses` is not supported (`Accepted=False,
//!   UnsupportedAddress`); no listeners, more than 64, or two with one name:
//!   `Accepted=False, ListenersNotValid` (and no listener status: names would clash).
//!   Otherwise accepted when at least one listener is valid (accepted and not
//!   conflicted), reason `ListenersNotValid` when some are not; `Programmed` when at
//!   least one listener is programmed.
//! - **Listeners.** HTTP, HTTPS (Terminate, at least one certificateRef), TLS
//!   (Passthrough only: Terminate on TLS is refused for now) and TCP; UDP and others are
//!   `UnsupportedProtocol`. Hostnames must be DNS names with a dot, or `*.` and one (the
//!   rule the mesh applies to TLSRoute server names), no IPs; TCP ignores them. TLS
//!   options are refused (none is supported). One protocol per port: HTTP, HTTPS, TLS
//!   and TCP never share a port (`ProtocolConflict`, every listener of the port); on one
//!   port, one hostname per listener (`HostnameConflict`; two TCP listeners on one port
//!   conflict). A conflicted listener is also `Accepted=False` with the conflict's
//!   reason. A certificate problem (`InvalidCertificateRef`, `RefNotPermitted`) or a
//!   route kind the protocol does not carry (`InvalidRouteKinds`) sets `ResolvedRefs=False`.
//!   Only a listener that is accepted, free of conflicts and resolved is programmed and
//!   served; any listener still takes the routes its `allowedRoutes` let in (they count
//!   in `attachedRoutes`, as the API asks), unless that field itself is invalid.
//! - **Routes.** A parentRef names the Gateway by group, kind `Gateway`, name and
//!   namespace (the route's when unset). A route refused by the projector is
//!   `Accepted=False` with the projector's reason on every parentRef and attaches nowhere;
//!   a parentRef to a Gateway that is not accepted is `Accepted=False,
//!   NoMatchingParent`. Backends the API forbids (not a core Service: `InvalidKind`;
//!   another namespace without a ReferenceGrant: `RefNotPermitted`) are taken out of
//!   their rule before projecting, so the edge can never send to them: the route stays
//!   attached, the rule's other backends keep their weights (the API would answer 500
//!   for the removed share instead), and a rule left with no backend answers 500. A
//!   TCPRoute or TLSRoute left with no backend attaches (and counts) but serves
//!   nothing. A missing Service (`BackendNotFound`) stays in the route: the edge
//!   answers 500 for its share. `ResolvedRefs` reports the first problem and how many
//!   more.
//! - **Times.** Every condition takes `now` as its `lastTransitionTime` and the
//!   object's generation as `observedGeneration`; the status writer keeps older times
//!   where a condition's status did not change.

use std::collections::BTreeMap;

use aether_common::quote::quote;
use aether_proto::registry::v1::Route;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

use crate::gateway::{Gateway, GatewayClass, ReferenceGrant, RouteParentStatus};
use crate::route::{DEFAULT_NAMESPACE, RouteObject};

mod certificate;
mod hostname;
mod listeners;
mod routes;

pub use certificate::{CERT_KEY, Certificate, KEY_KEY, TLS_SECRET_TYPE, certificate};
pub use hostname::{host_matches, intersect};
pub use listeners::{NAMESPACE_NAME_LABEL, kinds_of};

pub use crate::gateway::{ListenerStatus, RouteGroupKind};

/// The controller name of the edge: GatewayClasses naming it are ours.
pub const CONTROLLER_NAME: &str = "aether.io/edge";
/// The most listeners a Gateway holds (the API's own bound).
pub const MAX_LISTENERS: usize = 64;
/// How many listeners a Gateway condition's message names at most.
const NAMED_IN_MESSAGES: usize = 8;

/// The Gateway API reasons the edge reports.
pub mod reason {
    pub const ACCEPTED: &str = "Accepted";
    pub const PROGRAMMED: &str = "Programmed";
    pub const RESOLVED_REFS: &str = "ResolvedRefs";
    /// GatewayClass: its parametersRef cannot be used.
    pub const INVALID_PARAMETERS: &str = "InvalidParameters";
    /// Gateway, listener: not programmed (and a Gateway whose class is not accepted).
    pub const INVALID: &str = "Invalid";
    pub const LISTENERS_NOT_VALID: &str = "ListenersNotValid";
    pub const UNSUPPORTED_ADDRESS: &str = "UnsupportedAddress";
    pub const UNSUPPORTED_PROTOCOL: &str = "UnsupportedProtocol";
    pub const UNSUPPORTED_VALUE: &str = "UnsupportedValue";
    pub const PORT_UNAVAILABLE: &str = "PortUnavailable";
    pub const INVALID_CERTIFICATE_REF: &str = "InvalidCertificateRef";
    pub const INVALID_ROUTE_KINDS: &str = "InvalidRouteKinds";
    /// Listener (certificate) and route (backend): a cross-namespace reference no
    /// ReferenceGrant allows.
    pub const REF_NOT_PERMITTED: &str = "RefNotPermitted";
    pub const NO_CONFLICTS: &str = "NoConflicts";
    pub const HOSTNAME_CONFLICT: &str = "HostnameConflict";
    pub const PROTOCOL_CONFLICT: &str = "ProtocolConflict";
    pub const NO_MATCHING_PARENT: &str = "NoMatchingParent";
    pub const NOT_ALLOWED_BY_LISTENERS: &str = "NotAllowedByListeners";
    pub const NO_MATCHING_LISTENER_HOSTNAME: &str = "NoMatchingListenerHostname";
}

/// The protocols the edge serves on a listener.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ListenerProtocol {
    Http,
    Https,
    Tls,
    Tcp,
}

impl ListenerProtocol {
    /// The API's name: `HTTP`, `HTTPS`, `TLS`, `TCP`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Http => "HTTP",
            Self::Https => "HTTPS",
            Self::Tls => "TLS",
            Self::Tcp => "TCP",
        }
    }
}

/// Everything one Gateway's projection reads.
pub struct EdgeInputs<'a> {
    /// The Gateway's class, if it exists.
    pub class: Option<&'a GatewayClass>,
    pub gateway: &'a Gateway,
    /// Every route object known (any namespace); only those with a parentRef to this
    /// Gateway matter.
    pub routes: &'a [RouteObject],
    pub grants: &'a [ReferenceGrant],
    /// Namespace name → its labels (`kubernetes.io/metadata.name` is implied).
    pub namespace_labels: &'a BTreeMap<String, BTreeMap<String, String>>,
    /// (namespace, name) → Secret.
    pub secrets: &'a BTreeMap<(String, String), Secret>,
    /// Whether a backend service "<ns>/<name>" exists (for ResolvedRefs BackendNotFound).
    pub service_exists: &'a dyn Fn(&str) -> bool,
}

/// One Gateway, projected: what to serve and what to report.
#[derive(Clone, Debug, PartialEq)]
pub struct Edge {
    /// "<namespace>/<name>".
    pub gateway: String,
    pub generation: i64,
    /// Only programmed listeners, grouped by port, sorted by port. Empty when the
    /// Gateway is not accepted.
    pub ports: Vec<EdgePort>,
    pub status: EdgeStatus,
}

/// The listeners of one port (all of one protocol).
#[derive(Clone, Debug, PartialEq)]
pub struct EdgePort {
    pub port: u32,
    pub protocol: ListenerProtocol,
    /// In the Gateway's order.
    pub listeners: Vec<EdgeListener>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct EdgeListener {
    pub name: String,
    /// Lower-case; None for any host (and always for TCP).
    pub hostname: Option<String>,
    /// ("<ns>/<name>" of the Secret, certificate): HTTPS only, in certificateRefs order.
    pub certificates: Vec<(String, Certificate)>,
    /// Oldest first, then by namespace/name (the Gateway API's precedence).
    pub routes: Vec<AttachedRoute>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct AttachedRoute {
    /// The route projected with the same rule projection as the mesh: `parents` empty;
    /// `hostnames` the route's own `spec.hostnames` (lower-case).
    pub route: Route,
    /// The hosts it serves on this listener ([`intersect`]); empty: any host.
    pub hostnames: Vec<String>,
}

#[derive(Clone, Debug, PartialEq, Default)]
pub struct EdgeStatus {
    /// GatewayClass conditions (Accepted) when the class is ours; None when not ours or
    /// missing.
    pub class: Option<Vec<Condition>>,
    /// Accepted, Programmed; empty when the class is not ours or missing.
    pub gateway: Vec<Condition>,
    /// `status.listeners[]`, in the Gateway's order.
    pub listeners: Vec<ListenerStatus>,
    /// (route key as [`RouteObject::key`], status): one per parentRef naming this
    /// Gateway, with controllerName [`CONTROLLER_NAME`]; routes in key order.
    pub routes: Vec<(String, RouteParentStatus)>,
}

/// Why something is refused: a Gateway API reason and a message.
#[derive(Clone, Debug, PartialEq)]
struct Problem {
    reason: &'static str,
    message: String,
}

impl Problem {
    fn new(reason: &'static str, message: impl Into<String>) -> Self {
        Self {
            reason,
            message: message.into(),
        }
    }
}

fn condition(type_: &str, status: bool, reason: &str, message: String, generation: i64, now: &Time) -> Condition {
    Condition {
        type_: type_.to_owned(),
        status: if status { "True" } else { "False" }.to_owned(),
        reason: reason.to_owned(),
        message,
        observed_generation: Some(generation),
        last_transition_time: now.clone(),
    }
}

/// Projects one Gateway: validates its class and listeners, attaches the routes that
/// name it, and computes every status entry. Pure; never panics.
pub fn project(inputs: &EdgeInputs, now: &Time) -> Edge {
    let gateway = inputs.gateway;
    let namespace = gateway.metadata.namespace.as_deref().unwrap_or(DEFAULT_NAMESPACE);
    let name = gateway.metadata.name.as_deref().unwrap_or_default();
    let generation = gateway.metadata.generation.unwrap_or(0);
    let mut edge = Edge {
        gateway: format!("{namespace}/{name}"),
        generation,
        ports: Vec::new(),
        status: EdgeStatus::default(),
    };
    let ours = |class: &&GatewayClass| {
        class.metadata.name.as_deref() == Some(gateway.spec.gateway_class_name.as_str())
            && class.spec.controller_name == CONTROLLER_NAME
    };
    let Some(class) = inputs.class.filter(ours) else {
        return edge;
    };
    let class_accepted = class.spec.parameters_ref.is_none();
    edge.status.class = Some(vec![class_condition(class, now)]);
    let gateway_condition = |type_: &str, status: bool, reason: &str, message: String| {
        condition(type_, status, reason, message, generation, now)
    };

    let specs = &gateway.spec.listeners;
    let listener_refusal = listener_set_refusal(specs);
    let mut listeners: Vec<listeners::Checked> = match listener_refusal {
        Some(_) => Vec::new(),
        None => specs.iter().map(|l| listeners::check(l, namespace, inputs)).collect(),
    };
    listeners::mark_conflicts(&mut listeners);
    let invalid: Vec<&listeners::Checked> = listeners.iter().filter(|l| !l.valid()).collect();
    let accepted = acceptance(gateway, class_accepted, listener_refusal, &invalid, listeners.len());
    let gateway_accepted = accepted.is_ok();
    let accepted_condition = match &accepted {
        Ok(reason) if *reason == reason::LISTENERS_NOT_VALID => {
            let message = format!("listeners not valid (the others serve): {}", name_problems(&invalid));
            gateway_condition("Accepted", true, reason, message)
        }
        Ok(reason) => gateway_condition("Accepted", true, reason, String::new()),
        Err(problem) => gateway_condition("Accepted", false, problem.reason, problem.message.clone()),
    };

    edge.status.routes = routes::attach(inputs, namespace, name, gateway_accepted, &mut listeners, now);

    let programmed = gateway_accepted && listeners.iter().any(|l| l.programmed());
    let programmed_condition = match (&accepted, programmed) {
        (_, true) => gateway_condition("Programmed", true, reason::PROGRAMMED, String::new()),
        (Err(problem), false) => gateway_condition(
            "Programmed",
            false,
            reason::INVALID,
            format!("the Gateway is not accepted: {}", problem.message),
        ),
        (Ok(_), false) => {
            let unprogrammed: Vec<&listeners::Checked> = listeners.iter().collect();
            let message = format!("no listener is programmed: {}", name_problems(&unprogrammed));
            gateway_condition("Programmed", false, reason::INVALID, message)
        }
    };
    edge.status.gateway = vec![accepted_condition, programmed_condition];
    edge.status.listeners = (listeners.iter())
        .map(|l| listener_status(l, gateway_accepted, generation, now))
        .collect();
    if gateway_accepted {
        edge.ports = ports(listeners);
    }
    edge
}

/// A class of ours is accepted unless it asks for parameters (the edge takes none).
fn class_condition(class: &GatewayClass, now: &Time) -> Condition {
    let generation = class.metadata.generation.unwrap_or(0);
    match class.spec.parameters_ref {
        None => condition("Accepted", true, reason::ACCEPTED, String::new(), generation, now),
        Some(_) => {
            let message = "parametersRef: the edge takes no parameters".to_owned();
            condition("Accepted", false, reason::INVALID_PARAMETERS, message, generation, now)
        }
    }
}

/// Whether the Gateway is accepted: `Ok(reason)` (`LISTENERS_NOT_VALID` when some of its
/// `listeners` are `invalid` but not all), or why not.
fn acceptance(
    gateway: &Gateway,
    class_accepted: bool,
    listener_refusal: Option<String>,
    invalid: &[&listeners::Checked],
    listeners: usize,
) -> Result<&'static str, Problem> {
    if !class_accepted {
        let message = format!(
            "GatewayClass {} is not accepted",
            quote(&gateway.spec.gateway_class_name)
        );
        Err(Problem::new(reason::INVALID, message))
    } else if !gateway.spec.addresses.is_empty() {
        let message = "spec.addresses: the edge assigns its own addresses; requesting some is not supported";
        Err(Problem::new(reason::UNSUPPORTED_ADDRESS, message))
    } else if let Some(message) = listener_refusal {
        Err(Problem::new(reason::LISTENERS_NOT_VALID, message))
    } else if invalid.len() == listeners {
        let message = format!("no listener is valid: {}", name_problems(invalid));
        Err(Problem::new(reason::LISTENERS_NOT_VALID, message))
    } else if !invalid.is_empty() {
        Ok(reason::LISTENERS_NOT_VALID)
    } else {
        Ok(reason::ACCEPTED)
    }
}

/// Why the listener list as a whole is refused, if it is.
fn listener_set_refusal(specs: &[crate::gateway::Listener]) -> Option<String> {
    if specs.is_empty() {
        return Some("spec.listeners: the Gateway has none".to_owned());
    }
    if specs.len() > MAX_LISTENERS {
        return Some(format!(
            "spec.listeners: {} listeners (at most {MAX_LISTENERS})",
            specs.len()
        ));
    }
    let mut names: Vec<&str> = specs.iter().map(|l| l.name.as_str()).collect();
    names.sort_unstable();
    let twice = names.windows(2).find(|w| w[0] == w[1]).map(|w| w[0]);
    twice.map(|name| format!("spec.listeners: two listeners are named {}", quote(name)))
}

/// "listener "a": reason: message; …" for the first few listeners with a problem.
fn name_problems(listeners: &[&listeners::Checked]) -> String {
    let mut parts: Vec<String> = (listeners.iter())
        .filter_map(|l| l.problem().map(|p| (l, p)))
        .take(NAMED_IN_MESSAGES)
        .map(|(l, p)| format!("listener {}: {}: {}", quote(&l.spec.name), p.reason, p.message))
        .collect();
    let with_problems = listeners.iter().filter(|l| l.problem().is_some()).count();
    if with_problems > NAMED_IN_MESSAGES {
        parts.push(format!("and {} more", with_problems - NAMED_IN_MESSAGES));
    }
    parts.join("; ")
}

fn listener_status(
    listener: &listeners::Checked,
    gateway_accepted: bool,
    generation: i64,
    now: &Time,
) -> ListenerStatus {
    let c = |type_: &str, status: bool, reason: &str, message: String| {
        condition(type_, status, reason, message, generation, now)
    };
    let accepted = match (&listener.accepted, &listener.conflict) {
        (Err(problem), _) | (Ok(()), Some(problem)) => c("Accepted", false, problem.reason, problem.message.clone()),
        (Ok(()), None) => c("Accepted", true, reason::ACCEPTED, String::new()),
    };
    let programmed = match (listener.problem(), gateway_accepted) {
        (Some(problem), _) => c("Programmed", false, reason::INVALID, problem.message.clone()),
        (None, false) => c(
            "Programmed",
            false,
            reason::INVALID,
            "the Gateway is not accepted".to_owned(),
        ),
        (None, true) => c("Programmed", true, reason::PROGRAMMED, String::new()),
    };
    let resolved = match &listener.resolved {
        Ok(()) => c("ResolvedRefs", true, reason::RESOLVED_REFS, String::new()),
        Err(problem) => c("ResolvedRefs", false, problem.reason, problem.message.clone()),
    };
    let conflicted = match &listener.conflict {
        None => c("Conflicted", false, reason::NO_CONFLICTS, String::new()),
        Some(problem) => c("Conflicted", true, problem.reason, problem.message.clone()),
    };
    ListenerStatus {
        name: listener.spec.name.clone(),
        supported_kinds: listener.kinds.clone(),
        attached_routes: listener.attached,
        conditions: vec![accepted, programmed, resolved, conflicted],
    }
}

/// The programmed listeners grouped by port, ports sorted, routes in precedence order.
fn ports(listeners: Vec<listeners::Checked>) -> Vec<EdgePort> {
    let mut ports: BTreeMap<u32, EdgePort> = BTreeMap::new();
    for listener in listeners.into_iter().filter(|l| l.programmed()) {
        let (Some(protocol), Ok(port)) = (listener.protocol, u32::try_from(listener.spec.port)) else {
            continue;
        };
        let mut routes = listener.routes;
        routes.sort_by(|a, b| {
            let key = |r: &AttachedRoute| {
                let route = &r.route;
                (
                    route.created_unix_seconds,
                    route.namespace.clone(),
                    route.name.clone(),
                    route.kind,
                )
            };
            key(a).cmp(&key(b))
        });
        let edge_port = ports.entry(port).or_insert_with(|| EdgePort {
            port,
            protocol,
            listeners: Vec::new(),
        });
        edge_port.listeners.push(EdgeListener {
            name: listener.spec.name.clone(),
            hostname: listener.hostname,
            certificates: listener.certificates,
            routes,
        });
    }
    ports.into_values().collect()
}

/// A projection as JSON for a debug page: the status entries, and what is served (ports,
/// listeners, certificates by Secret with their names and expiry, routes by key with
/// their hosts). Never holds key material.
pub fn status_json(edge: &Edge) -> serde_json::Value {
    let ports: Vec<serde_json::Value> = (edge.ports.iter())
        .map(|port| {
            let listeners: Vec<serde_json::Value> = (port.listeners.iter())
                .map(|listener| {
                    let certificates: Vec<serde_json::Value> = (listener.certificates.iter())
                        .map(|(secret, c)| {
                            serde_json::json!({
                                "secret": secret,
                                "dnsNames": c.dns_names,
                                "notAfterUnix": c.not_after_unix,
                            })
                        })
                        .collect();
                    let routes: Vec<serde_json::Value> = (listener.routes.iter())
                        .map(|a| {
                            serde_json::json!({
                                "route": aether_proto::view::route_key(&a.route),
                                "generation": a.route.generation,
                                "hostnames": a.hostnames,
                            })
                        })
                        .collect();
                    serde_json::json!({
                        "name": listener.name,
                        "hostname": listener.hostname,
                        "certificates": certificates,
                        "routes": routes,
                    })
                })
                .collect();
            serde_json::json!({"port": port.port, "protocol": port.protocol.as_str(), "listeners": listeners})
        })
        .collect();
    let routes: Vec<serde_json::Value> = (edge.status.routes.iter())
        .map(|(key, status)| serde_json::json!({"route": key, "status": status}))
        .collect();
    serde_json::json!({
        "gateway": edge.gateway,
        "generation": edge.generation,
        "classConditions": edge.status.class,
        "conditions": edge.status.gateway,
        "listeners": edge.status.listeners,
        "routes": routes,
        "ports": ports,
    })
}
