//! What the main plugin reported (`prevResult`, CNI 1.x result format): the pod's
//! interface and its addresses.

use std::net::IpAddr;

use aether_common::quote::quote;
use serde_json::Value;

use crate::error::{CniError, invalid_config};

/// An address with its prefix length, as in `ips[].address` ("10.1.2.3/24").
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Cidr {
    pub ip: IpAddr,
    pub prefix: u8,
}

impl std::fmt::Display for Cidr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.ip, self.prefix)
    }
}

fn parse_cidr(text: &str) -> Option<Cidr> {
    let (ip, prefix) = text.split_once('/')?;
    let ip: IpAddr = ip.parse().ok()?;
    let prefix: u8 = prefix.parse().ok()?;
    let max = if ip.is_ipv4() { 32 } else { 128 };
    (prefix <= max).then_some(Cidr { ip, prefix })
}

/// The addresses prevResult assigns to the pod's interface `ifname`: `ips` entries whose
/// `interface` index points at an interface named `ifname` inside a sandbox, or that
/// name no interface. Field errors are code 7 with the path named.
pub fn pod_addresses(prev: &Value, ifname: &str) -> Result<Vec<Cidr>, CniError> {
    let interfaces = match prev.get("interfaces") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(items)) => items.clone(),
        Some(_) => return Err(invalid_config("prevResult.interfaces: is not a list")),
    };
    let ips = match prev.get("ips") {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(items)) => items,
        Some(_) => return Err(invalid_config("prevResult.ips: is not a list")),
    };
    let mut out = Vec::new();
    for (i, entry) in ips.iter().enumerate() {
        let address = entry
            .get("address")
            .and_then(Value::as_str)
            .ok_or_else(|| invalid_config(format!("prevResult.ips[{i}].address: missing")))?;
        let cidr = parse_cidr(address).ok_or_else(|| {
            invalid_config(format!(
                "prevResult.ips[{i}].address: {} is not an address/prefix",
                quote(address)
            ))
        })?;
        let belongs = match entry.get("interface") {
            None | Some(Value::Null) => true,
            Some(index) => {
                let index = index
                    .as_u64()
                    .ok_or_else(|| invalid_config(format!("prevResult.ips[{i}].interface: is not an index")))?;
                let iface = interfaces.get(index as usize).ok_or_else(|| {
                    invalid_config(format!(
                        "prevResult.ips[{i}].interface: {index} is out of range ({} interfaces)",
                        interfaces.len()
                    ))
                })?;
                let in_sandbox = iface
                    .get("sandbox")
                    .and_then(Value::as_str)
                    .is_some_and(|s| !s.is_empty());
                in_sandbox && iface.get("name").and_then(Value::as_str) == Some(ifname)
            }
        };
        if belongs {
            out.push(cidr);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bridge_results_give_the_sandbox_interface_addresses() {
        let prev = serde_json::json!({
            "cniVersion": "1.0.0",
            "interfaces": [
                {"name": "cni0", "mac": "aa"},
                {"name": "veth1", "mac": "bb"},
                {"name": "eth0", "mac": "cc", "sandbox": "/var/run/netns/x"}
            ],
            "ips": [{"address": "10.22.0.5/16", "gateway": "10.22.0.1", "interface": 2}]
        });
        let ips = pod_addresses(&prev, "eth0").unwrap();
        assert_eq!(ips.len(), 1);
        assert_eq!(ips[0].to_string(), "10.22.0.5/16");
        assert!(pod_addresses(&prev, "net1").unwrap().is_empty());
        let bad = serde_json::json!({"ips": [{"address": "10.0.0.1"}]});
        assert_eq!(
            pod_addresses(&bad, "eth0").unwrap_err().message,
            "prevResult.ips[0].address: \"10.0.0.1\" is not an address/prefix"
        );
        let bad = serde_json::json!({"ips": [{"address": "10.0.0.1/8", "interface": 3}]});
        assert_eq!(
            pod_addresses(&bad, "eth0").unwrap_err().message,
            "prevResult.ips[0].interface: 3 is out of range (0 interfaces)"
        );
    }

    proptest::proptest! {
        #[test]
        fn addresses_never_panic(s in "\\PC{0,40}", idx in proptest::option::of(0u64..4)) {
            let prev = serde_json::json!({"interfaces": [{"name": "eth0", "sandbox": "/x"}], "ips": [{"address": s, "interface": idx}]});
            let _ = pod_addresses(&prev, "eth0");
        }
    }
}
