//! The generators: local pods + the node's slice of the catalog → Envoy resources.
//! One function per resource type; every output is sorted so equal inputs give equal
//! bytes (and so equal versions, and no push).
//!
//! Names: a service port's cluster is named by its authority, `<svc>.<ns>.<domain>:<port>`
//! (so on-demand CDS can ask for what a request's authority names); the bare
//! `<svc>.<ns>.<domain>` cluster serves the service's default port. Per pod:
//! `outbound|<ns>/<pod>`, `inbound|<ns>/<pod>`, `capture|<ns>/<pod>` listeners and
//! `local|<ns>/<pod>|<port>` delivery clusters.

mod clusters;
mod listeners;
mod routes;
pub mod transport;
mod util;

use std::collections::{BTreeMap, BTreeSet};

use aether_proto::registry::v1::{Locality, Protocol};
use aether_proto::view::Catalog;
use envoy_types::pb::google::protobuf::Any;

use crate::pod::LocalPod;

pub use util::{CAPTURE_PORT, INBOUND_PORT, OUTBOUND_PORT, PORT_HEADER};

/// Everything the generators read.
pub struct Inputs<'a> {
    pub pods: &'a [LocalPod],
    /// The catalog, already filtered to the node's dependency set.
    pub catalog: &'a Catalog,
    pub mesh_domain: &'a str,
    pub locality: &'a Locality,
    /// Cluster names Envoy asked for on demand, with their service key.
    pub on_demand: &'a BTreeMap<String, String>,
}

/// A service in the node's dependency set, as the generators see it.
pub struct MeshService<'a> {
    pub key: &'a str,
    pub fqdn: String,
    pub vip: &'a str,
    /// The ports its endpoints serve, with their protocol.
    pub ports: BTreeMap<u32, Protocol>,
}

impl MeshService<'_> {
    /// The port a request without one in its authority goes to: 80 if served, else the
    /// lowest HTTP port, else the lowest port.
    pub fn default_port(&self) -> Option<u32> {
        if self.ports.contains_key(&80) {
            return Some(80);
        }
        self.ports
            .iter()
            .find(|(_, p)| is_http(**p))
            .or_else(|| self.ports.iter().next())
            .map(|(port, _)| *port)
    }

    pub fn cluster(&self, port: u32) -> String {
        format!("{}:{port}", self.fqdn)
    }
}

pub fn is_http(protocol: Protocol) -> bool {
    matches!(protocol, Protocol::Http | Protocol::Http2 | Protocol::Grpc)
}

pub fn fqdn(key: &str, mesh_domain: &str) -> String {
    let (ns, name) = key.split_once('/').unwrap_or(("", key));
    format!("{name}.{ns}.{mesh_domain}")
}

/// The inverse of [`fqdn`] for an authority (`<svc>.<ns>.<domain>[:port]`): the
/// service key and port, if it names a mesh service.
pub fn parse_authority(authority: &str, mesh_domain: &str) -> Option<(String, Option<u32>)> {
    let (host, port) = match authority.rsplit_once(':') {
        Some((host, port)) => (host, Some(port.parse().ok()?)),
        None => (authority, None),
    };
    let rest = host.strip_suffix(mesh_domain)?.strip_suffix('.')?;
    let (name, ns) = rest.split_once('.')?;
    if ns.contains('.') || crate::upstreams::check(ns).is_err() || crate::upstreams::check(name).is_err() {
        return None;
    }
    Some((format!("{ns}/{name}"), port))
}

pub fn services<'a>(catalog: &'a Catalog, mesh_domain: &str) -> Vec<MeshService<'a>> {
    catalog
        .services
        .iter()
        .map(|(key, service)| {
            let mut ports = BTreeMap::new();
            for endpoint in catalog.endpoints.get(key).into_iter().flat_map(|e| e.values()) {
                for port in &endpoint.ports {
                    let protocol = Protocol::try_from(port.protocol).unwrap_or(Protocol::Tcp);
                    ports.entry(port.port).or_insert(protocol);
                }
            }
            MeshService {
                key,
                fqdn: fqdn(key, mesh_domain),
                vip: &service.vip,
                ports,
            }
        })
        .collect()
}

/// All resources for the node, by type URL.
pub fn generate(inputs: &Inputs) -> BTreeMap<String, Vec<(String, Any)>> {
    let services = services(inputs.catalog, inputs.mesh_domain);
    let mut out = BTreeMap::new();
    let mut cluster_list = clusters::clusters(inputs, &services);
    let mut endpoint_list = clusters::endpoints(inputs, &services);
    // Asked for on demand, known, but with nothing serving that port: serve the cluster
    // empty, so callers get a retryable 503 instead of a 404.
    let served: BTreeSet<String> = cluster_list.iter().map(|(n, _)| n.clone()).collect();
    for (name, service) in inputs.on_demand {
        if served.contains(name) || !inputs.catalog.services.contains_key(service) {
            continue;
        }
        cluster_list.push((name.clone(), clusters::empty_cluster(name)));
        endpoint_list.push((name.clone(), clusters::empty_assignment(name)));
    }
    cluster_list.sort_by(|a, b| a.0.cmp(&b.0));
    endpoint_list.sort_by(|a, b| a.0.cmp(&b.0));
    out.insert(super::CLUSTER.to_owned(), cluster_list);
    out.insert(super::ENDPOINT.to_owned(), endpoint_list);
    out.insert(super::LISTENER.to_owned(), listeners::listeners(inputs, &services));
    out.insert(super::ROUTE.to_owned(), routes::route_configs(inputs, &services));
    out
}

/// The names of a pod's listeners (what AddPod waits for Envoy to ACK).
pub fn pod_listener_names(pod: &LocalPod) -> BTreeSet<String> {
    let mut names = BTreeSet::from([listeners::outbound_name(pod), listeners::capture_name(pod)]);
    if !pod.info.mesh_ports().is_empty() {
        names.insert(listeners::inbound_name(pod));
    }
    names
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn authorities_map_back_to_services() {
        let d = "aether.internal";
        assert_eq!(
            parse_authority("cart.shop.aether.internal", d),
            Some(("shop/cart".into(), None))
        );
        assert_eq!(
            parse_authority("cart.shop.aether.internal:8080", d),
            Some(("shop/cart".into(), Some(8080)))
        );
        assert_eq!(parse_authority("cart.shop.example.com", d), None);
        assert_eq!(parse_authority("a.b.c.aether.internal", d), None);
        assert_eq!(parse_authority("cart.shop.aether.internal:x", d), None);
        assert_eq!(fqdn("shop/cart", d), "cart.shop.aether.internal");
    }
}
