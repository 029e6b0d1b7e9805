//! Strict inbound mTLS: in STRICT, the pod's table gets an input chain that lets TCP
//! into the pod only through the mesh — Envoy's mTLS listener (`:18008`), Envoy's
//! delivery over loopback, and the node's own addresses (kubelet's probes come from the
//! host side) — and answers any other TCP with a reset, counted. PERMISSIVE adds no
//! chain. UDP, ICMP and other protocols are not the mesh's business and pass untouched.
//!
//! The node's addresses are those of the agent's own netns (it runs with the host's
//! network), read on every apply: a bridge's gateway appears with the node's first pod.

use std::net::IpAddr;
use std::path::Path;

use super::CaptureError;
use crate::pod::PodInfo;

/// The input chain of [`super::TABLE`] in STRICT.
pub const CHAIN: &str = "inbound";
/// The named counter of refused plaintext connections (one packet per refused SYN).
pub const REFUSED_COUNTER: &str = "refused_plaintext";
/// Envoy's inbound (mTLS) listener on the pod's IP.
const INBOUND_PORT: u32 = crate::xds::resources::INBOUND_PORT;

pub use aether_api::pod::{InboundError, InboundMtls};

/// The pod's effective mode: its own annotation, else its namespace's (its MeshConfig's,
/// else the mesh-wide one's: `crate::mesh_settings`), else the node's default. This is
/// the one place the mode is decided. An invalid annotation counts as absent: it is one
/// of the pod's config errors (logged, and in `pod_config_errors`).
pub fn effective(node_default: InboundMtls, namespace: Option<InboundMtls>, pod: &PodInfo) -> InboundMtls {
    match pod.inbound_mtls() {
        Ok(Some(mode)) => mode,
        Ok(None) | Err(_) => namespace.unwrap_or(node_default),
    }
}

/// The input chain's rules, one statement per line; `node` are the node's addresses.
pub fn rules(node: &[IpAddr]) -> Vec<String> {
    let mut rules = vec![
        "ct state established,related accept".to_owned(),
        // Envoy delivers to 127.0.0.1:<port> inside the netns, and the pod calls itself.
        "iif lo accept".to_owned(),
        format!("tcp dport {INBOUND_PORT} accept"),
    ];
    let (v4, v6): (Vec<&IpAddr>, Vec<&IpAddr>) = node.iter().partition(|ip| ip.is_ipv4());
    for (family, ips) in [("ip", v4), ("ip6", v6)] {
        if !ips.is_empty() {
            let list: Vec<String> = ips.iter().map(|ip| ip.to_string()).collect();
            rules.push(format!("{family} saddr {{ {} }} accept", list.join(", ")));
        }
    }
    // A reset, not a drop: a plaintext caller fails at once instead of timing out.
    rules.push(format!(
        "meta l4proto tcp counter name {REFUSED_COUNTER} reject with tcp reset"
    ));
    rules
}

/// The chain and its counter as they sit inside the table's block.
pub fn render(rules: &[String]) -> String {
    let mut out = format!("  counter {REFUSED_COUNTER} {{\n  }}\n  chain {CHAIN} {{\n");
    out.push_str("    type filter hook input priority 0\n    policy accept\n");
    for rule in rules {
        out.push_str(&format!("    {rule}\n"));
    }
    out.push_str("  }\n");
    out
}

/// The node's addresses: the agent's own netns is the host's.
pub async fn node_addresses() -> Result<Vec<IpAddr>, CaptureError> {
    super::pod_addresses(Path::new("/proc/self/ns/net")).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pod::INBOUND_MTLS_ANNOTATION;

    #[test]
    fn the_chain_admits_the_mesh_loopback_and_the_node_and_resets_other_tcp() {
        let node: Vec<IpAddr> = ["10.200.1.1", "fd00::1", "192.0.2.10"]
            .iter()
            .map(|ip| ip.parse().unwrap())
            .collect();
        assert_eq!(
            rules(&node),
            [
                "ct state established,related accept",
                "iif lo accept",
                "tcp dport 18008 accept",
                "ip saddr { 10.200.1.1, 192.0.2.10 } accept",
                "ip6 saddr { fd00::1 } accept",
                "meta l4proto tcp counter name refused_plaintext reject with tcp reset",
            ]
        );
        let text = render(&rules(&[]));
        assert!(text.starts_with("  counter refused_plaintext {\n  }\n  chain inbound {\n"));
        assert!(text.contains("    type filter hook input priority 0\n    policy accept\n"));
        assert!(!text.contains("saddr"), "no node addresses, no empty set: {text}");
        assert!(text.ends_with("reject with tcp reset\n  }\n"));
    }

    #[test]
    fn the_annotation_overrides_the_namespace_which_overrides_the_node_unless_invalid() {
        use InboundMtls::{Permissive, Strict};
        let mut pod = PodInfo::default();
        assert_eq!(effective(Strict, None, &pod), Strict);
        assert_eq!(effective(Permissive, None, &pod), Permissive);
        assert_eq!(effective(Strict, Some(Permissive), &pod), Permissive, "the namespace's");
        pod.annotations
            .insert(INBOUND_MTLS_ANNOTATION.into(), "permissive".into());
        assert_eq!(effective(Strict, Some(Strict), &pod), Permissive, "the pod's own");
        pod.annotations.insert(INBOUND_MTLS_ANNOTATION.into(), "Strict".into());
        assert_eq!(effective(Permissive, Some(Permissive), &pod), Strict);
        pod.annotations.insert(INBOUND_MTLS_ANNOTATION.into(), "mtls".into());
        assert_eq!(effective(Permissive, None, &pod), Permissive);
        assert_eq!(effective(Permissive, Some(Strict), &pod), Strict);
        assert_eq!(
            pod.config_errors(),
            ["security.aether.io/inbound-mtls: \"mtls\" is not strict or permissive"]
        );
    }
}
