//! What the edge tests share (`mod edge_support;` in each): a small world of
//! Kubernetes objects written as YAML, projected for one Gateway, and readers of the
//! result. Test certificates are generated here at test time (rcgen); no key material is
//! committed.
#![allow(dead_code)]

use std::collections::{BTreeMap, BTreeSet};

use aether_api::edge::{self, CONTROLLER_NAME, Edge, EdgeInputs, ListenerStatus};
use aether_api::gateway::{Gateway, GatewayClass, ReferenceGrant, RouteParentStatus};
use aether_api::{RouteObject, documents, route_objects};
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, ObjectMeta, Time};
use k8s_openapi::jiff::Timestamp;

/// The class every test Gateway names.
pub const CLASS: &str = "aether";

/// The time every projection is made at.
pub fn now() -> Time {
    Time(Timestamp::from_second(1_700_000_000).unwrap())
}

/// A self-signed certificate for `hosts` and its key, PEM (ECDSA P-256).
pub fn tls_pair(hosts: &[&str]) -> (String, String) {
    let key = rcgen::KeyPair::generate().unwrap();
    let names: Vec<String> = hosts.iter().map(|h| (*h).to_owned()).collect();
    let cert = rcgen::CertificateParams::new(names).unwrap().self_signed(&key).unwrap();
    (cert.pem(), key.serialize_pem())
}

/// A Secret with the given type and data.
pub fn secret(namespace: &str, name: &str, type_: Option<&str>, data: &[(&str, &[u8])]) -> Secret {
    Secret {
        metadata: ObjectMeta {
            namespace: Some(namespace.to_owned()),
            name: Some(name.to_owned()),
            ..Default::default()
        },
        type_: type_.map(str::to_owned),
        data: Some(
            data.iter()
                .map(|(k, v)| ((*k).to_owned(), ByteString(v.to_vec())))
                .collect(),
        ),
        ..Default::default()
    }
}

/// A `kubernetes.io/tls` Secret holding a fresh certificate for `hosts`.
pub fn tls_secret(namespace: &str, name: &str, hosts: &[&str]) -> Secret {
    let (cert, key) = tls_pair(hosts);
    secret(
        namespace,
        name,
        Some("kubernetes.io/tls"),
        &[("tls.crt", cert.as_bytes()), ("tls.key", key.as_bytes())],
    )
}

/// The objects one projection reads.
#[derive(Clone)]
pub struct World {
    pub class: Option<GatewayClass>,
    pub gateways: Vec<Gateway>,
    pub routes: Vec<RouteObject>,
    pub grants: Vec<ReferenceGrant>,
    pub namespaces: BTreeMap<String, BTreeMap<String, String>>,
    pub secrets: BTreeMap<(String, String), Secret>,
    /// "<ns>/<name>" of the Services that exist.
    pub services: BTreeSet<String>,
}

impl Default for World {
    fn default() -> Self {
        Self::new()
    }
}

impl World {
    /// Our class, no objects, and no Services.
    pub fn new() -> Self {
        let class = serde_json::json!({
            "metadata": {"name": CLASS, "generation": 1},
            "spec": {"controllerName": CONTROLLER_NAME},
        });
        Self {
            class: Some(serde_json::from_value(class).unwrap()),
            gateways: Vec::new(),
            routes: Vec::new(),
            grants: Vec::new(),
            namespaces: BTreeMap::new(),
            secrets: BTreeMap::new(),
            services: BTreeSet::new(),
        }
    }

    /// Adds every object of a YAML text: Gateway, GatewayClass (replaces ours),
    /// ReferenceGrant, Namespace (its labels), Service (that it exists) and routes.
    pub fn with(mut self, yaml: &str) -> Self {
        for document in documents(yaml) {
            let value = document.unwrap();
            let kind = value["kind"].as_str().unwrap_or_default().to_owned();
            match kind.as_str() {
                "Gateway" => self.gateways.push(serde_json::from_value(value).unwrap()),
                "GatewayClass" => self.class = Some(serde_json::from_value(value).unwrap()),
                "ReferenceGrant" => self.grants.push(serde_json::from_value(value).unwrap()),
                "Namespace" => {
                    let name = value["metadata"]["name"].as_str().unwrap().to_owned();
                    let labels = serde_json::from_value(value["metadata"]["labels"].clone()).unwrap_or_default();
                    self.namespaces.insert(name, labels);
                }
                "Service" => {
                    let namespace = value["metadata"]["namespace"].as_str().unwrap_or("default");
                    let name = value["metadata"]["name"].as_str().unwrap();
                    self.services.insert(format!("{namespace}/{name}"));
                }
                _ => {
                    let routes = route_objects(&[Ok(value)]);
                    assert_eq!(routes.len(), 1, "unknown kind {kind}");
                    self.routes.push(routes.into_iter().next().unwrap().unwrap());
                }
            }
        }
        self
    }

    pub fn secret(mut self, secret: Secret) -> Self {
        let namespace = secret.metadata.namespace.clone().unwrap();
        let name = secret.metadata.name.clone().unwrap();
        self.secrets.insert((namespace, name), secret);
        self
    }

    pub fn services(mut self, keys: &[&str]) -> Self {
        self.services.extend(keys.iter().map(|k| (*k).to_owned()));
        self
    }

    pub fn gateway(&self, key: &str) -> &Gateway {
        let (namespace, name) = key.split_once('/').unwrap();
        (self.gateways.iter())
            .find(|g| g.metadata.namespace.as_deref() == Some(namespace) && g.metadata.name.as_deref() == Some(name))
            .unwrap_or_else(|| panic!("no Gateway {key}"))
    }

    /// Projects the Gateway "<ns>/<name>".
    pub fn project(&self, key: &str) -> Edge {
        let services = self.services.clone();
        let exists = move |service: &str| services.contains(service);
        let inputs = EdgeInputs {
            class: self.class.as_ref(),
            gateway: self.gateway(key),
            routes: &self.routes,
            grants: &self.grants,
            namespace_labels: &self.namespaces,
            secrets: &self.secrets,
            service_exists: &exists,
        };
        edge::project(&inputs, &now())
    }
}

/// (status, reason) of the condition `type_`.
pub fn condition<'a>(conditions: &'a [Condition], type_: &str) -> (&'a str, &'a str) {
    let found = conditions.iter().find(|c| c.type_ == type_);
    let found = found.unwrap_or_else(|| panic!("no {type_} condition in {conditions:?}"));
    (found.status.as_str(), found.reason.as_str())
}

pub fn listener<'a>(edge: &'a Edge, name: &str) -> &'a ListenerStatus {
    (edge.status.listeners.iter())
        .find(|l| l.name == name)
        .unwrap_or_else(|| panic!("no status for listener {name}: {:?}", edge.status.listeners))
}

/// (Accepted, ResolvedRefs) status and reason of one listener.
pub fn listener_summary<'a>(edge: &'a Edge, name: &str) -> [(&'a str, &'a str); 4] {
    let c = &listener(edge, name).conditions;
    [
        condition(c, "Accepted"),
        condition(c, "Programmed"),
        condition(c, "ResolvedRefs"),
        condition(c, "Conflicted"),
    ]
}

/// The kinds a listener reports as supported.
pub fn kinds(edge: &Edge, name: &str) -> Vec<String> {
    let listener = listener(edge, name);
    listener.supported_kinds.iter().map(|k| k.kind.clone()).collect()
}

/// The status entries of a route (by key, e.g. "http/shop/cart").
pub fn route_statuses<'a>(edge: &'a Edge, key: &str) -> Vec<&'a RouteParentStatus> {
    edge.status
        .routes
        .iter()
        .filter(|(k, _)| k == key)
        .map(|(_, s)| s)
        .collect()
}

/// (Accepted, ResolvedRefs) of a route's only status entry.
pub fn route_summary<'a>(edge: &'a Edge, key: &str) -> [(&'a str, &'a str); 2] {
    let statuses = route_statuses(edge, key);
    assert_eq!(statuses.len(), 1, "{key}: {statuses:?}");
    let c = &statuses[0].conditions;
    [condition(c, "Accepted"), condition(c, "ResolvedRefs")]
}

/// A served route: its key and the hosts it serves on a listener.
pub type RouteHosts = (String, Vec<String>);

/// What is served: (port, listener, [(route key, hosts)]).
pub fn served(edge: &Edge) -> Vec<(u32, String, Vec<RouteHosts>)> {
    let mut out = Vec::new();
    for port in &edge.ports {
        for listener in &port.listeners {
            let routes = (listener.routes.iter())
                .map(|a| (aether_proto::view::route_key(&a.route), a.hostnames.clone()))
                .collect();
            out.push((port.port, listener.name.clone(), routes));
        }
    }
    out
}

/// The services a served route sends to, rule by rule.
pub fn backends(edge: &Edge, key: &str) -> Vec<Vec<String>> {
    let attached = (edge.ports.iter().flat_map(|p| &p.listeners).flat_map(|l| &l.routes))
        .find(|a| aether_proto::view::route_key(&a.route) == key)
        .unwrap_or_else(|| panic!("{key} is not served"));
    (attached.route.rules.iter())
        .map(|r| r.backends.iter().map(|b| b.service.clone()).collect())
        .collect()
}
