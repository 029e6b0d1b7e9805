//! A mesh service's ports as the catalog describes them: the ports its endpoints serve,
//! each with its protocol, and the endpoint port each Kubernetes Service port reaches.
//! The agent builds its clusters and chains from this and the registrar judges a route's
//! parent ports by it, so both read a Service port the same way. An external service's
//! ports are the ones it declares.

use std::collections::BTreeMap;

use aether_common::pod_endpoint::registry_protocol;
use aether_common::pod_meta::AppProtocol;
use aether_proto::registry::v1::{Endpoint, Protocol, Service, ServicePort};

#[derive(Clone, Debug, Default, PartialEq)]
pub struct ServicePorts {
    /// Each endpoint port with its protocol (the first endpoint to name a port decides).
    pub endpoint: BTreeMap<u32, Protocol>,
    /// Each Kubernetes Service port with the endpoint port it reaches (a named target
    /// resolved by the endpoints' port names; one no endpoint names is left out). `None`
    /// while the Service's ports are unknown.
    pub targets: Option<BTreeMap<u32, u32>>,
}

impl ServicePorts {
    pub fn of<'a>(service: &Service, endpoints: impl Iterator<Item = &'a Endpoint>) -> Self {
        if let Some(external) = &service.external {
            // Outside the mesh: the declared ports are what pods call (none if the
            // declaration breaks the projector's rules: a store can hold anything).
            let valid = crate::external_service::validate(external).is_ok();
            let endpoint = (external.ports.iter().filter(|_| valid))
                .map(|p| (p.number, Protocol::try_from(p.protocol).unwrap_or(Protocol::Tcp)))
                .collect();
            return ServicePorts {
                endpoint,
                targets: None,
            };
        }
        let mut endpoint = BTreeMap::new();
        let mut named = BTreeMap::new();
        for port in endpoints.flat_map(|e| &e.ports) {
            let protocol = Protocol::try_from(port.protocol).unwrap_or(Protocol::Tcp);
            endpoint.entry(port.port).or_insert(protocol);
            if !port.name.is_empty() {
                named.entry(port.name.clone()).or_insert(port.port);
            }
        }
        let kubernetes = service.kubernetes.as_ref();
        let targets = kubernetes.and_then(|k| target_ports(&k.ports, &named));
        let mut ports = ServicePorts { endpoint, targets };
        if let Some(kubernetes) = kubernetes {
            ports.refine_stream_protocols(&kubernetes.ports);
        }
        ports
    }

    /// The endpoint port a Gateway API port reaches (a parentRef's or backendRef's, which
    /// name Service ports): the one the Service port targets; a port the Service does not
    /// map (or any, while its ports are unknown) is taken as an endpoint port itself.
    pub fn endpoint_port(&self, service_port: u32) -> u32 {
        endpoint_port(self.targets.as_ref(), service_port)
    }

    /// The protocol a Gateway API port reaches, if an endpoint serves it.
    pub fn protocol_at(&self, service_port: u32) -> Option<Protocol> {
        self.endpoint.get(&self.endpoint_port(service_port)).copied()
    }

    /// A Service port's `appProtocol` names the protocol of the TCP stream port it targets
    /// (e.g. `redis` on a port named `cache`). It never turns a stream into HTTP or back:
    /// the serving node sees only the pod, whose port names decide that.
    fn refine_stream_protocols(&mut self, service_ports: &[ServicePort]) {
        let Some(targets) = &self.targets else { return };
        for service_port in service_ports {
            let named = AppProtocol::from_app_protocol(&service_port.app_protocol).filter(|p| !p.is_http());
            let target = targets.get(&service_port.port);
            let (Some(named), Some(target)) = (named, target) else {
                continue;
            };
            if let Some(protocol) = self.endpoint.get_mut(target).filter(|p| !is_http(**p)) {
                *protocol = registry_protocol(named);
            }
        }
    }
}

/// [`ServicePorts::endpoint_port`] over a Service's targets (`None`: unknown).
pub fn endpoint_port(targets: Option<&BTreeMap<u32, u32>>, service_port: u32) -> u32 {
    let target = targets.and_then(|t| t.get(&service_port));
    target.copied().unwrap_or(service_port)
}

/// Whether the mesh carries `protocol` as HTTP.
pub fn is_http(protocol: Protocol) -> bool {
    matches!(protocol, Protocol::Http | Protocol::Http2 | Protocol::Grpc)
}

/// Each Service port's endpoint port; a named target is the port the endpoints give that
/// name (the first by address if they differ). `None` when the Service lists no ports.
fn target_ports(ports: &[ServicePort], named: &BTreeMap<String, u32>) -> Option<BTreeMap<u32, u32>> {
    if ports.is_empty() {
        return None;
    }
    let target = |p: &ServicePort| match p.target_port {
        0 => named.get(&p.target_port_name).copied(),
        target => Some(target),
    };
    Some(ports.iter().filter_map(|p| Some((p.port, target(p)?))).collect())
}

#[cfg(test)]
mod tests {
    use aether_proto::registry::v1::{KubernetesService, Port};

    use super::*;

    #[test]
    fn service_ports_reach_endpoint_ports_and_app_protocols_name_streams_only() {
        let port = |name: &str, port: u32, protocol: Protocol| Port {
            name: name.into(),
            port,
            protocol: protocol as i32,
        };
        let endpoint = Endpoint {
            ports: vec![
                port("", 6379, Protocol::Tcp),
                port("web", 8080, Protocol::Http),
                port("", 9000, Protocol::Tcp),
            ],
            ..Default::default()
        };
        let service_port = |port: u32, target_port: u32, name: &str, app_protocol: &str| ServicePort {
            port,
            target_port,
            target_port_name: name.into(),
            app_protocol: app_protocol.into(),
            ..Default::default()
        };
        let service = Service {
            kubernetes: Some(KubernetesService {
                ports: vec![
                    service_port(6379, 6379, "", "redis"),
                    service_port(80, 0, "web", "thrift"),
                    service_port(9000, 9000, "", "kubernetes.io/h2c"),
                    service_port(1, 0, "nobody", ""),
                ],
                ..Default::default()
            }),
            ..Default::default()
        };
        let ports = ServicePorts::of(&service, [&endpoint].into_iter());
        assert_eq!(
            ports.endpoint,
            BTreeMap::from([
                (6379, Protocol::Redis),
                // Never HTTP into a stream, nor a stream out of HTTP: the pod's names decide.
                (8080, Protocol::Http),
                (9000, Protocol::Tcp),
            ])
        );
        assert_eq!(
            ports.targets,
            Some(BTreeMap::from([(6379, 6379), (80, 8080), (9000, 9000)]))
        );
        assert_eq!(
            (ports.endpoint_port(80), ports.protocol_at(80)),
            (8080, Some(Protocol::Http))
        );
        assert_eq!(ports.protocol_at(1), None);
        assert_eq!(ports.protocol_at(7), None);
        let unknown = ServicePorts::of(&Service::default(), [&endpoint].into_iter());
        assert_eq!((unknown.targets.clone(), unknown.endpoint_port(9000)), (None, 9000));
    }
}
