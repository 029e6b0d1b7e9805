//! The mesh's conventions for reading a Kubernetes Pod, shared by the agent (which
//! registers its node's pods) and the registrar's Kubernetes store (which derives
//! endpoints from every managed pod), so both see the same service, ports and
//! protocols for one pod. Plain strings in, no Kubernetes types: neither crate has to
//! pull in the other.

/// Label that puts a pod in the mesh.
pub const MANAGED_LABEL: &str = "aether.io/managed";
/// The taint a node carries until its agent can take pods in: the agent removes it from its
/// own Node once ready, the controller puts it back when the agent is gone (effect NoSchedule).
pub const READINESS_TAINT: &str = "aether.io/agent-not-ready";
/// Annotation overriding the pod's service name (default: its service account).
pub const SERVICE_ANNOTATION: &str = "config.aether.io/service";
/// The service account Kubernetes assigns when a pod names none.
pub const DEFAULT_SERVICE_ACCOUNT: &str = "default";
/// Node labels giving the locality of the node's pods (well-known Kubernetes topology labels).
pub const REGION_LABEL: &str = "topology.kubernetes.io/region";
pub const ZONE_LABEL: &str = "topology.kubernetes.io/zone";

/// A node's place in the topology, from its labels. No sub-zone: Kubernetes has no
/// well-known label for one.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeLocality {
    pub region: String,
    pub zone: String,
}

/// The node's region and zone from its labels; a missing label is empty.
pub fn locality_from_labels<'a>(labels: impl Iterator<Item = (&'a str, &'a str)>) -> NodeLocality {
    let mut locality = NodeLocality::default();
    for (key, value) in labels {
        match key {
            REGION_LABEL => locality.region = value.to_owned(),
            ZONE_LABEL => locality.zone = value.to_owned(),
            _ => {}
        }
    }
    locality
}

/// How the mesh carries a port, from its name (`http`, `http-*`, `grpc*`, `h2*`), as
/// Kubernetes port-naming conventions do; anything else is plain TCP.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
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

/// `aether.io/managed: "true"` is set.
pub fn is_managed<'a>(mut labels: impl Iterator<Item = (&'a str, &'a str)>) -> bool {
    labels.any(|(k, v)| k == MANAGED_LABEL && v == "true")
}

/// The pod's service name: the (trimmed, non-empty) annotation, else the service
/// account, else `default`.
pub fn service_name<'a>(annotation: Option<&'a str>, service_account: &'a str) -> &'a str {
    annotation
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .unwrap_or(if service_account.is_empty() {
            DEFAULT_SERVICE_ACCOUNT
        } else {
            service_account
        })
}

/// The ports a pod serves in the mesh: its TCP container ports (`protocol` empty means
/// TCP, as in Kubernetes), sorted by number, a number listed twice counted once.
pub fn mesh_ports<'a>(ports: impl Iterator<Item = (u16, &'a str, &'a str)>) -> Vec<(u16, AppProtocol)> {
    let mut out: Vec<_> = ports
        .filter(|(_, _, protocol)| protocol.is_empty() || protocol.eq_ignore_ascii_case("TCP"))
        .map(|(port, name, _)| (port, AppProtocol::from_port_name(name)))
        .collect();
    out.sort();
    out.dedup_by_key(|p| p.0);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn service_name_prefers_the_annotation_then_the_service_account() {
        assert_eq!(service_name(Some(" basket "), "cart"), "basket");
        assert_eq!(service_name(Some("  "), "cart"), "cart");
        assert_eq!(service_name(None, "cart"), "cart");
        assert_eq!(service_name(None, ""), "default");
    }

    #[test]
    fn mesh_ports_keep_tcp_sorted_and_deduplicated() {
        let ports = mesh_ports(
            [
                (9090, "grpc-api", "TCP"),
                (53, "dns", "UDP"),
                (8080, "http", ""),
                (8080, "other", "TCP"),
                (7000, "h2c", "tcp"),
                (6379, "redis", "TCP"),
            ]
            .into_iter(),
        );
        assert_eq!(
            ports,
            [
                (6379, AppProtocol::Tcp),
                (7000, AppProtocol::Http2),
                // A number listed twice keeps one entry (the agent's rule: the lowest protocol).
                (8080, AppProtocol::Tcp),
                (9090, AppProtocol::Grpc)
            ]
        );
    }

    #[test]
    fn locality_reads_the_topology_labels() {
        let locality = locality_from_labels(
            [
                ("kubernetes.io/hostname", "n1"),
                ("topology.kubernetes.io/zone", "eu-west-1b"),
                ("topology.kubernetes.io/region", "eu-west-1"),
            ]
            .into_iter(),
        );
        assert_eq!(locality.region, "eu-west-1");
        assert_eq!(locality.zone, "eu-west-1b");
        assert_eq!(
            locality_from_labels([("failure-domain.beta.kubernetes.io/zone", "a")].into_iter()),
            NodeLocality::default()
        );
    }

    #[test]
    fn managed_needs_the_exact_value() {
        assert!(is_managed([("aether.io/managed", "true")].into_iter()));
        assert!(!is_managed([("aether.io/managed", "True")].into_iter()));
        assert!(!is_managed([("app", "x")].into_iter()));
    }
}
