//! What the agent knows about a pod: its Kubernetes metadata (from the pod source)
//! and, once the CNI plugin has added it, its sandbox (netns, IPs).

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::PathBuf;

use aether_common::pod_endpoint::{self, PortOutOfRange};
use aether_common::pod_meta;
use serde::{Deserialize, Serialize};

use crate::capture::inbound::{InboundError, InboundMtls};
use crate::upstreams::{self, BadName, Upstreams};

// The conventions are shared with the registrar's Kubernetes store, so both read a pod the same way.
/// A workload's own inbound mTLS mode (`strict` or `permissive`), over the node's default.
pub use aether_api::pod::INBOUND_MTLS_ANNOTATION;
pub use aether_common::pod_meta::{AppProtocol, MANAGED_LABEL, SERVICE_ANNOTATION};

/// A pod's metadata as the pod source reports it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PodInfo {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    pub service_account: String,
    pub labels: BTreeMap<String, String>,
    pub annotations: BTreeMap<String, String>,
    pub ports: Vec<ContainerPort>,
    /// The pod has a deletionTimestamp: its endpoint drains.
    pub terminating: bool,
}

#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ContainerPort {
    pub name: String,
    pub port: u16,
    /// Kubernetes protocol: TCP, UDP or SCTP. Only TCP ports join the mesh.
    pub protocol: String,
}

impl ContainerPort {
    /// A container port as a Pod spec states it; `field` names it in the error
    /// (`spec.containers[0].ports[1]`). Name and protocol default as Kubernetes does.
    pub fn from_spec(
        field: &str,
        number: i64,
        name: Option<&str>,
        protocol: Option<&str>,
    ) -> Result<Self, PortOutOfRange> {
        Ok(Self {
            name: name.unwrap_or_default().to_owned(),
            port: pod_endpoint::container_port(field, number)?,
            protocol: protocol.unwrap_or("TCP").to_owned(),
        })
    }
}

/// Why a Pod (a manifest, an API object) is not read as a [`PodInfo`], naming the field.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PodError {
    /// The parser's message, clipped.
    #[error("not a Pod manifest: {0}")]
    NotAManifest(String),
    /// The kind given, quoted (bounded).
    #[error("kind: {0} is not Pod")]
    Kind(String),
    #[error("{0}: missing")]
    Missing(&'static str),
    #[error("metadata.namespace: {0}")]
    Namespace(BadName),
    #[error(transparent)]
    Port(#[from] PortOutOfRange),
}

impl PodInfo {
    pub fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }

    pub fn is_managed(&self) -> bool {
        pod_meta::is_managed(self.labels.iter().map(|(k, v)| (k.as_str(), v.as_str())))
    }

    /// The service this pod serves: `<ns>/<annotation or service account>`.
    pub fn service(&self) -> String {
        let annotation = self.annotations.get(SERVICE_ANNOTATION).map(String::as_str);
        format!(
            "{}/{}",
            self.namespace,
            pod_meta::service_name(annotation, &self.service_account)
        )
    }

    pub fn upstreams(&self) -> Upstreams {
        self.annotations
            .get(upstreams::ANNOTATION)
            .map(|v| upstreams::parse(&self.namespace, v))
            .unwrap_or_default()
    }

    /// The TCP ports the pod serves in the mesh, sorted.
    pub fn mesh_ports(&self) -> Vec<(u16, AppProtocol)> {
        pod_meta::mesh_ports(
            self.ports
                .iter()
                .map(|p| (p.port, p.name.as_str(), p.protocol.as_str())),
        )
    }

    /// The inbound mTLS mode the pod's annotation asks for, if it has one.
    pub fn inbound_mtls(&self) -> Result<Option<InboundMtls>, InboundError> {
        aether_api::pod::inbound_mtls(&self.annotations)
    }

    /// Problems with the pod's own mesh configuration, each naming its field (the rule
    /// the pod webhook applies too).
    pub fn config_errors(&self) -> Vec<String> {
        aether_api::pod::config_errors(&self.namespace, &self.annotations)
    }
}

/// A pod the CNI plugin added on this node.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LocalPod {
    pub container_id: String,
    /// The pinned netns path Envoy binds this pod's listeners in.
    pub netns: PathBuf,
    pub ips: Vec<IpAddr>,
    pub info: PodInfo,
    /// How Envoy binds the pod's listeners, fixed when they are first made.
    #[serde(default = "ListenerSockets::per_worker")]
    pub listener_sockets: ListenerSockets,
}

/// Envoy refuses to change a listener's `enable_reuse_port` once it holds the listener
/// (checked with Envoy 1.40), so the choice is the pod's: pods recorded before the shared
/// socket existed (no field in the pod store) keep a socket per worker, new pods share one.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ListenerSockets {
    /// One socket per Envoy worker (`SO_REUSEPORT`, Envoy's default).
    PerWorker,
    /// One socket the workers share: half the sockets made in the pod's netns, and
    /// ~0.7 ms less of Envoy's CPU per pod added (a pod's own traffic is far below what
    /// one accept queue serves).
    #[default]
    Shared,
}

impl ListenerSockets {
    fn per_worker() -> Self {
        ListenerSockets::PerWorker
    }
}

impl LocalPod {
    /// A short, stable id for resource names: `<ns>/<name>`.
    pub fn id(&self) -> String {
        self.info.key()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn service_name_defaults_to_the_service_account_and_can_be_overridden() {
        let mut pod = PodInfo {
            namespace: "shop".into(),
            service_account: "cart".into(),
            ..Default::default()
        };
        assert_eq!(pod.service(), "shop/cart");
        pod.annotations.insert(SERVICE_ANNOTATION.into(), "basket".into());
        assert_eq!(pod.service(), "shop/basket");
        pod.annotations.insert(SERVICE_ANNOTATION.into(), "Bad".into());
        assert_eq!(
            pod.config_errors(),
            ["config.aether.io/service: \"Bad\" is not a DNS-1123 label (lowercase letters, digits and '-')"]
        );
    }

    #[test]
    fn port_protocols_follow_the_naming_convention() {
        assert_eq!(AppProtocol::from_port_name("http"), AppProtocol::Http);
        assert_eq!(AppProtocol::from_port_name("http-web"), AppProtocol::Http);
        assert_eq!(AppProtocol::from_port_name("grpc-api"), AppProtocol::Grpc);
        assert_eq!(AppProtocol::from_port_name("h2c"), AppProtocol::Http2);
        assert_eq!(AppProtocol::from_port_name("redis"), AppProtocol::Redis);
    }
}
