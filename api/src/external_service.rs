//! THE ExternalService projector: our `networking.aether.io/v1alpha1` ExternalService, a
//! destination outside the mesh given a mesh service of its own (proposals/017), validated
//! and projected once into `aether.registry.v1.External`. The registrar's sources (which
//! make it a catalog service with a VIP), the agent (which re-validates what the catalog
//! streams) and the admission webhook call these functions, so they agree.
//!
//! ```yaml
//! apiVersion: networking.aether.io/v1alpha1
//! kind: ExternalService
//! metadata: {name: payments, namespace: shop}
//! spec:
//!   hosts: [api.payments.example]
//!   ports:
//!   - {number: 443, protocol: TLS}
//!   - {number: 80, protocol: HTTP, targetPort: 443, originateTls: true}
//!   addresses: [203.0.113.7]      # optional: no DNS, these serve every host
//!   tls: {serverName: api.payments.example, caCertificates: "-----BEGIN CERTIFICATE-----…"}
//! ```

use std::collections::{BTreeMap, HashSet};
use std::net::IpAddr;

use aether_common::quote::quote;
use aether_proto::registry::v1::{External, ExternalPort, ExternalTls, Protocol};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::{Deserialize, Serialize};

use crate::authorization::Unsupported;
use crate::gateway::string_enum;
pub use crate::refusal::Refusal;
use crate::refusal::at;
use crate::route::check;
use crate::yaml::{Document, ParseError, documents, of_kind, pick};

/// The API group of [`ExternalService`] (HTTPFilter's).
pub const GROUP: &str = "networking.aether.io";
/// The one version served.
pub const VERSION: &str = "v1alpha1";
pub const KIND: &str = "ExternalService";

/// The bounds that keep one declaration from bloating every node's Envoy and DNS.
pub mod limits {
    pub const HOSTS: usize = 16;
    pub const PORTS: usize = 16;
    pub const ADDRESSES: usize = 16;
    /// `spec.tls.caCertificates`, in bytes.
    pub const CA_BYTES: usize = 64 * 1024;
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ExternalService {
    #[serde(default)]
    pub metadata: ObjectMeta,
    #[serde(default)]
    pub spec: ExternalServiceSpec,
}

/// Decoding is lenient (numbers as `i64`, unknown enum values kept) so the projector
/// refuses a bad value with its field named; an unknown field lands in `unsupported`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ExternalServiceSpec {
    #[serde(default)]
    pub hosts: Vec<String>,
    #[serde(default)]
    pub ports: Vec<Port>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub addresses: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<Tls>,
    #[serde(flatten, skip_serializing_if = "BTreeMap::is_empty")]
    pub unsupported: Unsupported,
}

string_enum! {
    /// `spec.ports[].protocol`: what pods speak on the port.
    PortProtocol {
        Tcp = "TCP",
        Tls = "TLS",
        Http = "HTTP",
    }
}

/// `spec.ports[]`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Port {
    #[serde(default)]
    pub number: i64,
    /// TCP when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub protocol: Option<PortProtocol>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_port: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub originate_tls: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(flatten, skip_serializing_if = "BTreeMap::is_empty")]
    pub unsupported: Unsupported,
}

/// `spec.tls`: how TLS is originated on the ports that ask for it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Tls {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_certificates: Option<String>,
    #[serde(flatten, skip_serializing_if = "BTreeMap::is_empty")]
    pub unsupported: Unsupported,
}

crate::resource::namespaced_resource!(ExternalService, GROUP, VERSION, KIND, "externalservices");

/// The catalog service key `<namespace>/<name>` the object declares.
pub fn key(object: &ExternalService) -> String {
    let namespace = (object.metadata.namespace.as_deref()).unwrap_or(crate::route::DEFAULT_NAMESPACE);
    format!("{namespace}/{}", object.metadata.name.as_deref().unwrap_or_default())
}

/// Validates an ExternalService and projects it; a refusal names the first field at
/// fault. Never half-projected. Hosts are lower-cased (DNS names are case-blind).
pub fn project(object: &ExternalService) -> Result<External, Refusal> {
    let meta = &object.metadata;
    let namespace = meta.namespace.as_deref().unwrap_or(crate::route::DEFAULT_NAMESPACE);
    at("metadata.namespace", check::label(namespace))?;
    at("metadata.name", check::label(meta.name.as_deref().unwrap_or_default()))?;
    let spec = &object.spec;
    unsupported("spec", &spec.unsupported)?;
    let mut ports = Vec::with_capacity(spec.ports.len());
    for (i, port) in spec.ports.iter().enumerate() {
        let field = format!("spec.ports[{i}]");
        unsupported(&field, &port.unsupported)?;
        let protocol = match &port.protocol {
            None | Some(PortProtocol::Tcp) => Protocol::Tcp,
            Some(PortProtocol::Tls) => Protocol::Tls,
            Some(PortProtocol::Http) => Protocol::Http,
            Some(PortProtocol::Other(other)) => {
                let message = format!("{} is not TCP, TLS or HTTP", quote(other));
                return Err(Refusal::new(format!("{field}.protocol"), message));
            }
        };
        let number = at(format!("{field}.number"), port_number(port.number))?;
        let target_port = match port.target_port {
            None => number,
            Some(target) => at(format!("{field}.targetPort"), port_number(target))?,
        };
        ports.push(ExternalPort {
            number,
            protocol: protocol.into(),
            target_port,
            originate_tls: port.originate_tls.unwrap_or(false),
            name: port.name.clone().unwrap_or_default(),
        });
    }
    let tls = match &spec.tls {
        None => None,
        Some(tls) => {
            unsupported("spec.tls", &tls.unsupported)?;
            Some(ExternalTls {
                server_name: tls
                    .server_name
                    .as_deref()
                    .map(str::to_ascii_lowercase)
                    .unwrap_or_default(),
                ca_certificates: tls.ca_certificates.clone().unwrap_or_default(),
            })
        }
    };
    let projected = External {
        hosts: spec.hosts.iter().map(|h| h.to_ascii_lowercase()).collect(),
        ports,
        addresses: spec.addresses.clone(),
        tls,
        generation: meta.generation.unwrap_or(0),
    };
    check_external(&projected, &Names::OBJECT)?;
    Ok(projected)
}

/// Checks a projected declaration (from a store or a stream) with the projector's rules;
/// the field named is the proto's.
pub fn validate(external: &External) -> Result<(), Refusal> {
    check_external(external, &Names::PROTO)
}

/// How the object and the proto name the fields the shared checks refuse.
struct Names {
    ports: &'static str,
    number: &'static str,
    target_port: &'static str,
    originate_tls: &'static str,
    protocol: &'static str,
    tls: &'static str,
    server_name: &'static str,
    ca: &'static str,
}

impl Names {
    const OBJECT: Names = Names {
        ports: "spec.ports",
        number: "number",
        target_port: "targetPort",
        originate_tls: "originateTls",
        protocol: "protocol",
        tls: "spec.tls",
        server_name: "serverName",
        ca: "caCertificates",
    };
    const PROTO: Names = Names {
        ports: "ports",
        number: "number",
        target_port: "target_port",
        originate_tls: "originate_tls",
        protocol: "protocol",
        tls: "tls",
        server_name: "server_name",
        ca: "ca_certificates",
    };
}

/// The rules both sides share. Object and proto field names differ only in case and
/// the `spec.` prefix, which `names` supplies.
fn check_external(external: &External, names: &Names) -> Result<(), Refusal> {
    let spec = if names.ports.starts_with("spec.") { "spec." } else { "" };
    let hosts_field = format!("{spec}hosts");
    if external.hosts.is_empty() {
        return Err(Refusal::new(hosts_field, "needs at least one host"));
    }
    bounded(&hosts_field, external.hosts.len(), limits::HOSTS)?;
    let mut seen = HashSet::new();
    for (i, host) in external.hosts.iter().enumerate() {
        let field = format!("{hosts_field}[{i}]");
        at(&field, external_host(host))?;
        if !seen.insert(host.as_str()) {
            return Err(Refusal::new(field, format!("{} is listed twice", quote(host))));
        }
    }
    if external.ports.is_empty() {
        return Err(Refusal::new(names.ports, "needs at least one port"));
    }
    bounded(names.ports, external.ports.len(), limits::PORTS)?;
    let (mut numbers, mut port_names) = (HashSet::new(), HashSet::new());
    for (i, port) in external.ports.iter().enumerate() {
        let field = format!("{}[{i}]", names.ports);
        if !(1..=65_535).contains(&port.number) {
            let message = format!("{} is not a port (1 to 65535)", port.number);
            return Err(Refusal::new(format!("{field}.{}", names.number), message));
        }
        if !numbers.insert(port.number) {
            let message = format!("{} is declared twice", port.number);
            return Err(Refusal::new(format!("{field}.{}", names.number), message));
        }
        if !(1..=65_535).contains(&port.target_port) {
            let message = format!("{} is not a port (1 to 65535)", port.target_port);
            return Err(Refusal::new(format!("{field}.{}", names.target_port), message));
        }
        let protocol = Protocol::try_from(port.protocol).ok();
        if !matches!(protocol, Some(Protocol::Tcp | Protocol::Tls | Protocol::Http)) {
            let message = format!("{} is not TCP, TLS or HTTP", port.protocol);
            return Err(Refusal::new(format!("{field}.{}", names.protocol), message));
        }
        if port.originate_tls && protocol == Some(Protocol::Tls) {
            let message = "is for plaintext ports: on a TLS port the pod's own TLS passes through";
            return Err(Refusal::new(format!("{field}.{}", names.originate_tls), message));
        }
        if !port.name.is_empty() {
            at(format!("{field}.name"), check::label(&port.name))?;
            if !port_names.insert(port.name.as_str()) {
                let message = format!("{} is used twice", quote(&port.name));
                return Err(Refusal::new(format!("{field}.name"), message));
            }
        }
    }
    let addresses_field = format!("{spec}addresses");
    bounded(&addresses_field, external.addresses.len(), limits::ADDRESSES)?;
    for (i, address) in external.addresses.iter().enumerate() {
        let canonical = address.parse::<IpAddr>().ok().filter(|ip| ip.to_string() == *address);
        if canonical.is_none() {
            let message = format!("{} is not an IP address in canonical form", quote(address));
            return Err(Refusal::new(format!("{addresses_field}[{i}]"), message));
        }
    }
    if let Some(tls) = &external.tls {
        if !tls.server_name.is_empty() {
            at(
                format!("{}.{}", names.tls, names.server_name),
                external_host(&tls.server_name),
            )?;
        }
        at(
            format!("{}.{}", names.tls, names.ca),
            ca_certificates(&tls.ca_certificates),
        )?;
    }
    Ok(())
}

/// A host Envoy resolves and mesh-dns answers: a lowercase DNS name with a dot, no
/// wildcard, no IP literal.
pub fn external_host(host: &str) -> Result<(), String> {
    let not_ip = host.parse::<IpAddr>().is_err();
    match check::subdomain(host) {
        Ok(()) if not_ip && host.contains('.') && !host.ends_with('.') => Ok(()),
        _ => Err(format!(
            "{} is not a host (a lowercase DNS name with a dot; no wildcard, no IP address)",
            quote(host)
        )),
    }
}

/// PEM CA certificates: empty (the system roots), or at most [`limits::CA_BYTES`] holding
/// only `CERTIFICATE` blocks whose bodies are base64, at least one.
fn ca_certificates(pem: &str) -> Result<(), String> {
    if pem.is_empty() {
        return Ok(());
    }
    if pem.len() > limits::CA_BYTES {
        return Err(format!("is {} bytes (at most {})", pem.len(), limits::CA_BYTES));
    }
    let (mut blocks, mut inside) = (0, false);
    for line in pem.lines().map(str::trim).filter(|l| !l.is_empty()) {
        match (inside, line) {
            (false, "-----BEGIN CERTIFICATE-----") => inside = true,
            (true, "-----END CERTIFICATE-----") => {
                inside = false;
                blocks += 1;
            }
            (true, body) if body.bytes().all(|b| b.is_ascii_alphanumeric() || b"+/=".contains(&b)) => {}
            _ => {
                return Err(format!(
                    "is not PEM CA certificates: {} is not part of a CERTIFICATE block",
                    quote(line)
                ));
            }
        }
    }
    match (blocks, inside) {
        (_, true) => Err("ends inside a CERTIFICATE block".to_owned()),
        (0, _) => Err("holds no CERTIFICATE block".to_owned()),
        _ => Ok(()),
    }
}

fn port_number(value: i64) -> Result<u32, String> {
    u32::try_from(value)
        .ok()
        .filter(|p| (1..=65_535).contains(p))
        .ok_or_else(|| format!("{value} is not a port (1 to 65535)"))
}

fn bounded(field: &str, count: usize, most: usize) -> Result<(), Refusal> {
    match count > most {
        true => Err(Refusal::new(field, format!("has {count} entries (at most {most})"))),
        false => Ok(()),
    }
}

fn unsupported(field: &str, extra: &Unsupported) -> Result<(), Refusal> {
    let Some(key) = extra.keys().next() else { return Ok(()) };
    let message = "is not a field of networking.aether.io/v1alpha1 ExternalService";
    Err(Refusal::new(format!("{field}.{key}"), message))
}

/// Every ExternalService of [`GROUP`] among `documents`, or why not; nothing for other documents.
pub fn from_documents(documents: &[Document]) -> Vec<Result<ExternalService, ParseError>> {
    pick(documents, |value| of_kind(value, (GROUP, VERSION, KIND)))
}

/// [`from_documents`] of `text`'s documents.
pub fn parse_documents(text: &str) -> Vec<Result<ExternalService, ParseError>> {
    from_documents(&documents(text))
}
