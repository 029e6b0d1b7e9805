//! What the agent knows about a pod: its Kubernetes metadata (from the pod source)
//! and, once the CNI plugin has added it, its sandbox (netns, IPs).

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::upstreams::{self, Upstreams};

/// Label that puts a pod in the mesh.
pub const MANAGED_LABEL: &str = "aether.io/managed";
/// Annotation overriding the pod's service name (default: its service account).
pub const SERVICE_ANNOTATION: &str = "config.aether.io/service";

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
    pub fn from_spec(field: &str, number: i64, name: Option<&str>, protocol: Option<&str>) -> Result<Self, String> {
        let port = u16::try_from(number)
            .ok()
            .filter(|n| *n != 0)
            .ok_or_else(|| format!("{field}.containerPort: {number} is out of range (1..=65535)"))?;
        Ok(Self {
            name: name.unwrap_or_default().to_owned(),
            port,
            protocol: protocol.unwrap_or("TCP").to_owned(),
        })
    }
}

/// How the mesh carries a port, from its name (`http`, `http-*`, `grpc*`, `h2*`), as
/// Kubernetes port-naming conventions do; anything else is plain TCP.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum AppProtocol {
    Tcp,
    Http,
    Http2,
    Grpc,
}

impl AppProtocol {
    pub fn from_port_name(name: &str) -> Self {
        let name = name.to_ascii_lowercase();
        if name.starts_with("grpc") {
            Self::Grpc
        } else if name.starts_with("h2") || name.starts_with("http2") {
            Self::Http2
        } else if name.starts_with("http") {
            Self::Http
        } else {
            Self::Tcp
        }
    }

    pub fn is_http(self) -> bool {
        self != Self::Tcp
    }
}

impl PodInfo {
    pub fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }

    pub fn is_managed(&self) -> bool {
        self.labels.get(MANAGED_LABEL).is_some_and(|v| v == "true")
    }

    /// The service this pod serves: `<ns>/<annotation or service account>`.
    pub fn service(&self) -> String {
        let name = self
            .annotations
            .get(SERVICE_ANNOTATION)
            .map(|s| s.trim())
            .filter(|s| !s.is_empty())
            .unwrap_or(if self.service_account.is_empty() {
                "default"
            } else {
                &self.service_account
            });
        format!("{}/{}", self.namespace, name)
    }

    pub fn upstreams(&self) -> Upstreams {
        self.annotations
            .get(upstreams::ANNOTATION)
            .map(|v| upstreams::parse(&self.namespace, v))
            .unwrap_or_default()
    }

    /// The TCP ports the pod serves in the mesh, sorted.
    pub fn mesh_ports(&self) -> Vec<(u16, AppProtocol)> {
        let mut ports: Vec<_> = self
            .ports
            .iter()
            .filter(|p| p.protocol.is_empty() || p.protocol.eq_ignore_ascii_case("TCP"))
            .map(|p| (p.port, AppProtocol::from_port_name(&p.name)))
            .collect();
        ports.sort();
        ports.dedup_by_key(|p| p.0);
        ports
    }

    /// Problems with the pod's own mesh configuration, each naming its field.
    pub fn config_errors(&self) -> Vec<String> {
        let mut errors = self.upstreams().errors;
        if let Some(name) = self.annotations.get(SERVICE_ANNOTATION)
            && let Err(reason) = upstreams::check(name.trim())
        {
            errors.push(format!("{SERVICE_ANNOTATION}: {reason}"));
        }
        errors
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
        assert_eq!(AppProtocol::from_port_name("redis"), AppProtocol::Tcp);
    }
}
