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

/// What a port speaks. HTTP, HTTP/2 and gRPC the mesh carries as HTTP (routes, retries,
/// request metrics); the others are TCP streams to the mesh's transport, their protocol
/// named for what the node's proxy can do with it (TLS: routed by server name).
/// The order puts the stream protocols first: a port listed twice keeps the lower one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum AppProtocol {
    Tcp,
    Tls,
    Redis,
    Thrift,
    Dubbo,
    Http,
    Http2,
    Grpc,
}

/// Port name prefixes, the first that matches wins (`https` before `http`).
const PORT_NAME_PREFIXES: [(&str, AppProtocol); 10] = [
    ("grpc", AppProtocol::Grpc),
    ("http2", AppProtocol::Http2),
    ("h2", AppProtocol::Http2),
    ("https", AppProtocol::Tls),
    ("http", AppProtocol::Http),
    ("tls", AppProtocol::Tls),
    ("redis", AppProtocol::Redis),
    ("thrift", AppProtocol::Thrift),
    ("dubbo", AppProtocol::Dubbo),
    ("tcp", AppProtocol::Tcp),
];

impl AppProtocol {
    /// From a port's name, by prefix, case-insensitive (`http-web`, `grpc-api`, `redis`,
    /// `h2c`, `https`); anything else is plain TCP.
    pub fn from_port_name(name: &str) -> Self {
        let name = name.to_ascii_lowercase();
        (PORT_NAME_PREFIXES.iter())
            .find(|(prefix, _)| name.starts_with(prefix))
            .map_or(Self::Tcp, |(_, protocol)| *protocol)
    }

    /// From a Kubernetes Service port's `appProtocol` (IANA service names, the
    /// `kubernetes.io/` ones, and the mesh's own), case-insensitive; `None` for a value the
    /// mesh does not know.
    pub fn from_app_protocol(value: &str) -> Option<Self> {
        let protocol = match value.to_ascii_lowercase().as_str() {
            "tcp" => Self::Tcp,
            "tls" | "https" | "kubernetes.io/wss" => Self::Tls,
            "redis" => Self::Redis,
            "thrift" => Self::Thrift,
            "dubbo" => Self::Dubbo,
            "http" | "kubernetes.io/ws" => Self::Http,
            "http2" | "h2c" | "kubernetes.io/h2c" => Self::Http2,
            "grpc" => Self::Grpc,
            _ => return None,
        };
        Some(protocol)
    }

    pub fn is_http(self) -> bool {
        matches!(self, Self::Http | Self::Http2 | Self::Grpc)
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
                (6379, AppProtocol::Redis),
                (7000, AppProtocol::Http2),
                // A number listed twice keeps one entry (the agent's rule: the lowest protocol).
                (8080, AppProtocol::Tcp),
                (9090, AppProtocol::Grpc)
            ]
        );
    }

    #[test]
    fn port_names_and_app_protocols_name_the_protocol() {
        use AppProtocol::*;
        let names = [
            ("http", Http),
            ("HTTP-web", Http),
            ("https", Tls),
            ("https-admin", Tls),
            ("http2", Http2),
            ("h2c", Http2),
            ("grpc-api", Grpc),
            ("tls", Tls),
            ("redis-main", Redis),
            ("thrift", Thrift),
            ("dubbo-rpc", Dubbo),
            ("tcp-db", Tcp),
            ("postgres", Tcp),
            ("", Tcp),
        ];
        for (name, protocol) in names {
            assert_eq!(AppProtocol::from_port_name(name), protocol, "{name:?}");
        }
        let values = [
            ("kubernetes.io/h2c", Some(Http2)),
            ("kubernetes.io/ws", Some(Http)),
            ("kubernetes.io/wss", Some(Tls)),
            ("HTTPS", Some(Tls)),
            ("Redis", Some(Redis)),
            ("thrift", Some(Thrift)),
            ("dubbo", Some(Dubbo)),
            ("tcp", Some(Tcp)),
            ("example.com/custom", None),
            ("", None),
        ];
        for (value, protocol) in values {
            assert_eq!(AppProtocol::from_app_protocol(value), protocol, "{value:?}");
        }
        assert!(Grpc.is_http() && Http2.is_http() && !Tls.is_http() && !Redis.is_http());
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
