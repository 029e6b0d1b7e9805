//! A pod → its registry `Endpoint`s: the one rule of the agent (which registers the
//! pods of its node) and of the registrar's Kubernetes store (which derives endpoints
//! from every managed Pod). Each reads a pod its own way (a pod source's metadata, a
//! Pod object) with [`pod_meta`](crate::pod_meta)'s conventions; what its endpoints
//! then say is decided here, once.

use aether_proto::registry::v1::{Endpoint, Health, Locality, PodInfo as PodRef, Port, Protocol};

use crate::pod_meta::AppProtocol;

/// A container port outside 1..=65535, naming the port (`spec.containers[0].ports[1]`).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{field}.containerPort: {number} is out of range (1..=65535)")]
pub struct PortOutOfRange {
    pub field: String,
    pub number: i64,
}

/// A Pod spec's `containerPort` as a port number; `field` names the port.
pub fn container_port(field: &str, number: i64) -> Result<u16, PortOutOfRange> {
    u16::try_from(number)
        .ok()
        .filter(|n| *n != 0)
        .ok_or_else(|| PortOutOfRange {
            field: field.to_owned(),
            number,
        })
}

/// A pod's health in the registry: DRAINING once it is being deleted (whatever its
/// readiness), else HEALTHY while ready, else UNHEALTHY.
pub fn health(terminating: bool, ready: bool) -> Health {
    if terminating {
        Health::Draining
    } else if ready {
        Health::Healthy
    } else {
        Health::Unhealthy
    }
}

/// What every endpoint of one pod says.
#[derive(Clone, Debug, PartialEq)]
pub struct PodEndpoints {
    /// The service key, `<namespace>/<name>` ([`pod_meta::service_name`](crate::pod_meta::service_name)).
    pub service: String,
    /// The ports the pod serves in the mesh ([`pod_meta::mesh_ports`](crate::pod_meta::mesh_ports)).
    pub ports: Vec<(u16, AppProtocol)>,
    pub health: Health,
    pub pod: PodRef,
    /// The node the pod runs on.
    pub node: String,
    /// `None` when the caller fills it in later (the registrar's store, from the pod's Node).
    pub locality: Option<Locality>,
}

impl PodEndpoints {
    /// One endpoint per pod address, each of weight 1 with the pod's ports.
    pub fn at<A: ToString>(&self, addresses: impl IntoIterator<Item = A>) -> Vec<Endpoint> {
        let ports: Vec<Port> = self
            .ports
            .iter()
            .map(|&(port, protocol)| mesh_port(port, protocol))
            .collect();
        addresses
            .into_iter()
            .map(|address| Endpoint {
                service: self.service.clone(),
                address: address.to_string(),
                ports: ports.clone(),
                locality: self.locality.clone(),
                weight: 1,
                health: self.health as i32,
                metadata: Default::default(),
                pod: Some(self.pod.clone()),
                node: self.node.clone(),
            })
            .collect()
    }
}

/// A mesh port as the registry carries it (unnamed: the protocol is what the mesh uses).
fn mesh_port(port: u16, protocol: AppProtocol) -> Port {
    Port {
        name: String::new(),
        port: u32::from(port),
        protocol: registry_protocol(protocol) as i32,
    }
}

/// The catalog's name for a protocol.
pub fn registry_protocol(protocol: AppProtocol) -> Protocol {
    match protocol {
        AppProtocol::Tcp => Protocol::Tcp,
        AppProtocol::Tls => Protocol::Tls,
        AppProtocol::Redis => Protocol::Redis,
        AppProtocol::Thrift => Protocol::Thrift,
        AppProtocol::Dubbo => Protocol::Dubbo,
        AppProtocol::Http => Protocol::Http,
        AppProtocol::Http2 => Protocol::Http2,
        AppProtocol::Grpc => Protocol::Grpc,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_endpoint_per_address_with_the_pods_ports() {
        let pod = PodEndpoints {
            service: "shop/web".into(),
            ports: vec![(8080, AppProtocol::Http), (9090, AppProtocol::Grpc)],
            health: Health::Healthy,
            pod: PodRef {
                namespace: "shop".into(),
                name: "web-1".into(),
                uid: "u-1".into(),
                service_account: "web".into(),
            },
            node: "n1".into(),
            locality: None,
        };
        let endpoints = pod.at(["10.0.0.7", "fd00::7"]);
        let addresses: Vec<_> = endpoints.iter().map(|e| e.address.as_str()).collect();
        assert_eq!(addresses, ["10.0.0.7", "fd00::7"]);
        let e = &endpoints[1];
        assert_eq!((e.service.as_str(), e.node.as_str(), e.weight), ("shop/web", "n1", 1));
        assert_eq!(e.health, Health::Healthy as i32);
        let ports: Vec<_> = e.ports.iter().map(|p| (p.name.as_str(), p.port, p.protocol)).collect();
        assert_eq!(
            ports,
            [("", 8080, Protocol::Http as i32), ("", 9090, Protocol::Grpc as i32)]
        );
        assert_eq!(e.pod.as_ref().unwrap().uid, "u-1");
    }

    #[test]
    fn draining_wins_over_readiness() {
        assert_eq!(health(true, true), Health::Draining);
        assert_eq!(health(true, false), Health::Draining);
        assert_eq!(health(false, true), Health::Healthy);
        assert_eq!(health(false, false), Health::Unhealthy);
    }

    #[test]
    fn container_ports_are_1_to_65535() {
        assert_eq!(container_port("p", 1), Ok(1));
        assert_eq!(container_port("p", 65535), Ok(65535));
        for bad in [0, -1, 65536] {
            assert_eq!(
                container_port("spec.containers[0].ports[1]", bad)
                    .unwrap_err()
                    .to_string(),
                format!("spec.containers[0].ports[1].containerPort: {bad} is out of range (1..=65535)")
            );
        }
    }
}
