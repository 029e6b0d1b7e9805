//! A Gateway's listeners, each checked on its own (protocol, port, hostname, TLS, which
//! routes it takes, its certificates), then against the others on its port (conflicts).

use std::collections::BTreeMap;

use aether_common::quote::quote;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;

use super::certificate::certificate;
use super::{AttachedRoute, Certificate, EdgeInputs, ListenerProtocol, Problem, hostname, reason};
use crate::gateway::{
    FromNamespaces, GROUP, Listener, ListenerTls, ProtocolType, ReferenceGrant, RouteGroupKind, TlsMode,
};
use crate::route::{DEFAULT_NAMESPACE, check};

/// The most certificateRefs a listener holds (the API's own bound).
const MAX_CERTIFICATE_REFS: usize = 64;
/// The label Kubernetes sets on every namespace to its name.
pub const NAMESPACE_NAME_LABEL: &str = "kubernetes.io/metadata.name";

/// Which namespaces' routes a listener takes.
#[derive(Clone, Copy, Debug)]
pub enum Namespaces<'a> {
    Same,
    All,
    Selector(&'a LabelSelector),
    None,
}

/// One listener after its checks.
#[derive(Debug)]
pub struct Checked<'a> {
    pub spec: &'a Listener,
    /// None: a protocol the edge does not serve.
    pub protocol: Option<ListenerProtocol>,
    /// Lower-case; None when unset or for TCP (which has no hostnames).
    pub hostname: Option<String>,
    /// The route kinds it takes.
    pub kinds: Vec<RouteGroupKind>,
    /// None: `allowedRoutes.namespaces` is invalid, so no route attaches.
    pub namespaces: Option<Namespaces<'a>>,
    pub accepted: Result<(), Problem>,
    pub resolved: Result<(), Problem>,
    pub conflict: Option<Problem>,
    /// HTTPS: the certificates of `tls.certificateRefs`, in order.
    pub certificates: Vec<(String, Certificate)>,
    /// Routes attached and accepted.
    pub attached: i32,
    /// Those of them that project (a route whose backends are all refused attaches and
    /// serves nothing).
    pub routes: Vec<AttachedRoute>,
}

impl Checked<'_> {
    /// Accepted, free of conflicts, every reference resolved.
    pub fn programmed(&self) -> bool {
        self.valid() && self.resolved.is_ok()
    }

    /// Accepted and free of conflicts (what makes a Gateway accepted).
    pub fn valid(&self) -> bool {
        self.accepted.is_ok() && self.conflict.is_none()
    }

    /// Why it is not programmed, if it is not.
    pub fn problem(&self) -> Option<&Problem> {
        let accepted = self.accepted.as_ref().err();
        accepted.or(self.conflict.as_ref()).or(self.resolved.as_ref().err())
    }
}

/// The route kinds a protocol carries.
pub fn kinds_of(protocol: ListenerProtocol) -> &'static [&'static str] {
    match protocol {
        ListenerProtocol::Http | ListenerProtocol::Https => &["HTTPRoute", "GRPCRoute"],
        ListenerProtocol::Tls => &["TLSRoute"],
        ListenerProtocol::Tcp => &["TCPRoute"],
    }
}

/// Checks one listener of the Gateway in `namespace`.
pub fn check<'a>(listener: &'a Listener, namespace: &str, inputs: &EdgeInputs) -> Checked<'a> {
    let protocol = match &listener.protocol {
        ProtocolType::Http => Some(ListenerProtocol::Http),
        ProtocolType::Https => Some(ListenerProtocol::Https),
        ProtocolType::Tls => Some(ListenerProtocol::Tls),
        ProtocolType::Tcp => Some(ListenerProtocol::Tcp),
        ProtocolType::Udp | ProtocolType::Other(_) => None,
    };
    let hostname = match protocol {
        Some(ListenerProtocol::Tcp) => None,
        _ => listener.hostname.as_deref().map(str::to_ascii_lowercase),
    };
    let allowed = listener.allowed_routes.clone().unwrap_or_default();
    let namespaces = namespaces(listener);
    let (kinds, resolved_kinds) = match protocol {
        Some(protocol) => kinds(&allowed.kinds, protocol),
        None => (Vec::new(), Ok(())),
    };
    let accepted = accepted(listener, protocol, hostname.as_deref()).and_then(|()| namespaces.clone().map(drop));
    let (certificates, resolved_certificates) = match (protocol, &listener.tls) {
        (Some(ListenerProtocol::Https), Some(tls)) if tls.mode == TlsMode::Terminate => {
            certificates(tls, namespace, inputs)
        }
        _ => (Vec::new(), Ok(())),
    };
    Checked {
        spec: listener,
        protocol,
        hostname,
        kinds,
        namespaces: namespaces.ok(),
        accepted,
        // A certificate problem first: it is what keeps the listener from serving.
        resolved: resolved_certificates.and(resolved_kinds),
        conflict: None,
        certificates,
        attached: 0,
        routes: Vec::new(),
    }
}

fn unsupported(message: String) -> Problem {
    Problem::new(reason::UNSUPPORTED_VALUE, message)
}

/// The listener's own fields: name, protocol, port, hostname, TLS settings.
fn accepted(listener: &Listener, protocol: Option<ListenerProtocol>, hostname: Option<&str>) -> Result<(), Problem> {
    if let Err(message) = check::subdomain(&listener.name) {
        return Err(unsupported(format!("name: {message}")));
    }
    let Some(protocol) = protocol else {
        let message = format!(
            "protocol: {} is not served by the edge (HTTP, HTTPS, TLS or TCP)",
            quote(listener.protocol.as_str())
        );
        return Err(Problem::new(reason::UNSUPPORTED_PROTOCOL, message));
    };
    if let Err(message) = check::port(listener.port) {
        return Err(Problem::new(reason::PORT_UNAVAILABLE, format!("port: {message}")));
    }
    if let Some(hostname) = hostname {
        hostname::check(hostname).map_err(|message| unsupported(format!("hostname: {message}")))?;
    }
    let name = listener.protocol.as_str();
    match (protocol, &listener.tls) {
        (ListenerProtocol::Http | ListenerProtocol::Tcp, None) => Ok(()),
        (ListenerProtocol::Http | ListenerProtocol::Tcp, Some(_)) => {
            Err(unsupported(format!("tls: must not be set on a {name} listener")))
        }
        (ListenerProtocol::Https | ListenerProtocol::Tls, None) => {
            Err(unsupported(format!("tls: is required on a {name} listener")))
        }
        (_, Some(tls)) => tls_settings(protocol, tls),
    }
}

/// HTTPS terminates with certificates; TLS passes through (termination on a TLS
/// listener, for TLSRoutes to plain backends, is not supported yet).
fn tls_settings(protocol: ListenerProtocol, tls: &ListenerTls) -> Result<(), Problem> {
    if !tls.options.is_empty() {
        let keys: Vec<String> = tls.options.keys().take(4).map(|k| quote(k).to_string()).collect();
        let message = format!("tls.options: the edge supports no TLS options ({})", keys.join(", "));
        return Err(unsupported(message));
    }
    match (protocol, &tls.mode) {
        (ListenerProtocol::Https, TlsMode::Terminate) => match tls.certificate_refs.len() {
            0 => Err(unsupported(
                "tls.certificateRefs: an HTTPS listener needs at least one".to_owned(),
            )),
            n if n > MAX_CERTIFICATE_REFS => Err(unsupported(format!(
                "tls.certificateRefs: {n} references (at most {MAX_CERTIFICATE_REFS})"
            ))),
            _ => Ok(()),
        },
        (ListenerProtocol::Https, TlsMode::Passthrough) => Err(unsupported(
            "tls.mode: an HTTPS listener terminates TLS (use a TLS listener and TLSRoutes for Passthrough)".to_owned(),
        )),
        (ListenerProtocol::Tls, TlsMode::Passthrough) => Ok(()),
        (ListenerProtocol::Tls, TlsMode::Terminate) => Err(unsupported(
            "tls.mode: Terminate on a TLS listener is not supported (use HTTPS, or Passthrough)".to_owned(),
        )),
        (_, mode) => Err(unsupported(format!(
            "tls.mode: {} is not Terminate or Passthrough",
            quote(mode.as_str())
        ))),
    }
}

/// `allowedRoutes.namespaces`, its selector checked.
fn namespaces(listener: &Listener) -> Result<Namespaces<'_>, Problem> {
    let Some(allowed) = &listener.allowed_routes else {
        return Ok(Namespaces::Same);
    };
    let field = "allowedRoutes.namespaces";
    match (&allowed.namespaces.from, &allowed.namespaces.selector) {
        (FromNamespaces::Same, _) => Ok(Namespaces::Same),
        (FromNamespaces::All, _) => Ok(Namespaces::All),
        (FromNamespaces::None, _) => Ok(Namespaces::None),
        (FromNamespaces::Selector, None) => Err(unsupported(format!(
            "{field}.selector: is required when from is Selector"
        ))),
        (FromNamespaces::Selector, Some(selector)) => match check_selector(selector) {
            Ok(()) => Ok(Namespaces::Selector(selector)),
            Err(message) => Err(unsupported(format!("{field}.selector.{message}"))),
        },
        (FromNamespaces::Other(other), _) => Err(unsupported(format!(
            "{field}.from: {} is not All, Selector, Same or None",
            quote(other)
        ))),
    }
}

/// The kinds a listener takes, and whether every kind it asks for is one its protocol
/// carries (`ResolvedRefs=False, InvalidRouteKinds` names the first that is not).
fn kinds(asked: &[RouteGroupKind], protocol: ListenerProtocol) -> (Vec<RouteGroupKind>, Result<(), Problem>) {
    let carried = kinds_of(protocol);
    if asked.is_empty() {
        return (carried.iter().map(|k| RouteGroupKind::gateway(k)).collect(), Ok(()));
    }
    let mut kinds: Vec<RouteGroupKind> = Vec::new();
    let mut invalid = Ok(());
    for (i, kind) in asked.iter().enumerate() {
        if kind.group == GROUP && carried.contains(&kind.kind.as_str()) {
            if !kinds.contains(kind) {
                kinds.push(kind.clone());
            }
        } else if invalid.is_ok() {
            let message = format!(
                "allowedRoutes.kinds[{i}]: {}/{} is not a route kind a {} listener takes ({})",
                quote(&kind.group),
                quote(&kind.kind),
                protocol.as_str(),
                carried.join(", ")
            );
            invalid = Err(Problem::new(reason::INVALID_ROUTE_KINDS, message));
        }
    }
    (kinds, invalid)
}

/// The certificates of an HTTPS listener, each a core Secret (in another namespace only
/// with a ReferenceGrant) holding a certificate that [`certificate`] accepts.
fn certificates(
    tls: &ListenerTls,
    namespace: &str,
    inputs: &EdgeInputs,
) -> (Vec<(String, Certificate)>, Result<(), Problem>) {
    let mut certificates: Vec<(String, Certificate)> = Vec::new();
    for (i, reference) in tls.certificate_refs.iter().enumerate().take(MAX_CERTIFICATE_REFS) {
        let field = format!("tls.certificateRefs[{i}]");
        let invalid = |message: String| Problem::new(reason::INVALID_CERTIFICATE_REF, format!("{field}: {message}"));
        if !is_core(&reference.group) || reference.kind != "Secret" {
            let message = format!(
                "{}/{} is not a core Secret",
                quote(&reference.group),
                quote(&reference.kind)
            );
            return (Vec::new(), Err(invalid(message)));
        }
        let secret_namespace = reference.namespace.as_deref().unwrap_or(namespace);
        let key = format!("{secret_namespace}/{}", reference.name);
        let from = (GROUP, "Gateway", namespace);
        if secret_namespace != namespace
            && !granted(inputs.grants, secret_namespace, from, ("", "Secret", &reference.name))
        {
            let message = format!(
                "{field}: no ReferenceGrant in namespace {} lets Gateways of namespace {} use Secret {}",
                quote(secret_namespace),
                quote(namespace),
                quote(&reference.name)
            );
            return (Vec::new(), Err(Problem::new(reason::REF_NOT_PERMITTED, message)));
        }
        let Some(secret) = inputs
            .secrets
            .get(&(secret_namespace.to_owned(), reference.name.clone()))
        else {
            return (
                Vec::new(),
                Err(invalid(format!("Secret {} does not exist", quote(&key)))),
            );
        };
        match certificate(secret) {
            Ok(certificate) => {
                if !certificates.iter().any(|(k, _)| *k == key) {
                    certificates.push((key, certificate));
                }
            }
            Err(message) => return (Vec::new(), Err(invalid(format!("Secret {}: {message}", quote(&key))))),
        }
    }
    (certificates, Ok(()))
}

/// Whether a ReferenceGrant in `namespace` lets objects `from` (group, kind, namespace)
/// refer to the object `to` (group, kind, name) there.
pub fn granted(grants: &[ReferenceGrant], namespace: &str, from: (&str, &str, &str), to: (&str, &str, &str)) -> bool {
    let same_group = |a: &str, b: &str| a == b || (is_core(a) && is_core(b));
    (grants.iter())
        .filter(|g| g.metadata.namespace.as_deref().unwrap_or(DEFAULT_NAMESPACE) == namespace)
        .any(|g| {
            let from_ok =
                (g.spec.from.iter()).any(|f| same_group(&f.group, from.0) && f.kind == from.1 && f.namespace == from.2);
            let to_ok = (g.spec.to.iter())
                .any(|t| same_group(&t.group, to.0) && t.kind == to.1 && t.name.as_deref().is_none_or(|n| n == to.2));
            from_ok && to_ok
        })
}

/// The core API group: written empty, or `core`.
pub fn is_core(group: &str) -> bool {
    group.is_empty() || group == "core"
}

/// Marks listeners that cannot be told apart: different protocols on one port
/// (`ProtocolConflict`: the edge serves one protocol per port, so HTTPS and TLS do not
/// share one either), or one protocol, one port and the same hostname
/// (`HostnameConflict`; TCP listeners have no hostname, so two on one port conflict).
/// Every listener of a conflict is marked; none wins.
pub fn mark_conflicts(listeners: &mut [Checked]) {
    let eligible = |l: &Checked| l.accepted.is_ok() && l.protocol.is_some();
    let mut conflicts: Vec<Option<Problem>> = Vec::with_capacity(listeners.len());
    for (i, listener) in listeners.iter().enumerate() {
        let conflict = eligible(listener).then(|| {
            let others = (listeners.iter().enumerate())
                .filter(|(j, other)| *j != i && eligible(other) && other.spec.port == listener.spec.port)
                .map(|(_, other)| other);
            let mut hostname_conflict = None;
            for other in others {
                if other.protocol != listener.protocol {
                    let message = format!(
                        "port {} also carries {} (listener {}): one port serves one protocol",
                        listener.spec.port,
                        other.spec.protocol.as_str(),
                        quote(&other.spec.name)
                    );
                    return Some(Problem::new(reason::PROTOCOL_CONFLICT, message));
                }
                if hostname_conflict.is_none() && other.hostname == listener.hostname {
                    let host = listener
                        .hostname
                        .as_deref()
                        .map_or("any host".to_owned(), |h| quote(h).to_string());
                    let message = format!(
                        "listener {} also takes {host} on port {}",
                        quote(&other.spec.name),
                        listener.spec.port
                    );
                    hostname_conflict = Some(Problem::new(reason::HOSTNAME_CONFLICT, message));
                }
            }
            hostname_conflict
        });
        conflicts.push(conflict.flatten());
    }
    for (listener, conflict) in listeners.iter_mut().zip(conflicts) {
        listener.conflict = conflict;
    }
}

/// Whether a listener takes routes from `namespace` (of a Gateway in `gateway_namespace`).
pub fn takes_namespace(
    namespaces: Namespaces,
    namespace: &str,
    gateway_namespace: &str,
    labels: &BTreeMap<String, BTreeMap<String, String>>,
) -> bool {
    match namespaces {
        Namespaces::Same => namespace == gateway_namespace,
        Namespaces::All => true,
        Namespaces::None => false,
        Namespaces::Selector(selector) => {
            let mut labels = labels.get(namespace).cloned().unwrap_or_default();
            labels
                .entry(NAMESPACE_NAME_LABEL.to_owned())
                .or_insert_with(|| namespace.to_owned());
            selects(selector, &labels)
        }
    }
}

/// A label selector's rules (Kubernetes): `In` and `NotIn` need values, `Exists` and
/// `DoesNotExist` take none. The error starts with the field under the selector.
pub fn check_selector(selector: &LabelSelector) -> Result<(), String> {
    for (i, requirement) in selector.match_expressions.iter().flatten().enumerate() {
        let values = requirement.values.as_deref().unwrap_or_default();
        let field = format!("matchExpressions[{i}]");
        match requirement.operator.as_str() {
            "In" | "NotIn" if values.is_empty() => return Err(format!("{field}.values: In and NotIn need values")),
            "Exists" | "DoesNotExist" if !values.is_empty() => {
                return Err(format!("{field}.values: Exists and DoesNotExist take none"));
            }
            "In" | "NotIn" | "Exists" | "DoesNotExist" => {}
            other => {
                return Err(format!(
                    "{field}.operator: {} is not In, NotIn, Exists or DoesNotExist",
                    quote(other)
                ));
            }
        }
    }
    Ok(())
}

/// Whether a (checked) selector selects `labels`: every matchLabels entry and every
/// expression holds; an empty selector selects everything.
pub fn selects(selector: &LabelSelector, labels: &BTreeMap<String, String>) -> bool {
    let by_labels = (selector.match_labels.iter().flatten()).all(|(k, v)| labels.get(k) == Some(v));
    by_labels
        && selector.match_expressions.iter().flatten().all(|r| {
            let value = labels.get(&r.key);
            let values = r.values.as_deref().unwrap_or_default();
            match r.operator.as_str() {
                "In" => value.is_some_and(|v| values.contains(v)),
                "NotIn" => value.is_none_or(|v| !values.contains(v)),
                "Exists" => value.is_some(),
                "DoesNotExist" => value.is_none(),
                _ => false,
            }
        })
}
