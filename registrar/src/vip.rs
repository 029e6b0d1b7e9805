//! Mesh VIP allocation.
//!
//! A service's first-choice VIP is a stable hash of its key into the CIDR, probing
//! linearly past addresses already taken. So the same service tends to get the same
//! VIP even after its record is lost, a freed VIP is reused only when another key
//! happens to hash onto it, and allocation is O(1) until the range fills up.

use std::net::IpAddr;

use aether_common::hash::fnv1a;
use ipnet::IpNet;

use crate::model::ServiceKey;

/// The default range: the one Istio uses for auto-allocated VIPs (class E, never routed).
pub const DEFAULT_VIP_CIDR: &str = "240.240.0.0/16";

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum VipError {
    #[error("VIP range {0} is exhausted")]
    Exhausted(IpNet),
    #[error("VIP range {0} has fewer than 4 usable addresses")]
    TooSmall(IpNet),
}

#[derive(Clone, Debug)]
pub struct VipAllocator {
    net: IpNet,
    /// Usable addresses: the range minus its network and broadcast addresses.
    usable: u128,
}

impl VipAllocator {
    pub fn new(net: IpNet) -> Result<Self, VipError> {
        let net = net.trunc();
        let host_bits = u32::from(net.max_prefix_len() - net.prefix_len());
        let size: u128 = if host_bits >= 128 {
            u128::MAX
        } else {
            1u128 << host_bits
        };
        let usable = size.saturating_sub(2);
        if usable < 4 {
            return Err(VipError::TooSmall(net));
        }
        Ok(Self { net, usable })
    }

    pub fn net(&self) -> IpNet {
        self.net
    }

    pub fn contains(&self, ip: IpAddr) -> bool {
        self.net.contains(&ip)
    }

    /// The VIP for `key`: its hash slot, or the next free one after it.
    pub fn allocate(&self, key: &ServiceKey, taken: impl Fn(IpAddr) -> bool) -> Result<IpAddr, VipError> {
        let start = u128::from(fnv1a(key.as_str().as_bytes())) % self.usable;
        // Probe at most the whole range; stop early in practice.
        let mut offset = 0u128;
        while offset < self.usable {
            let candidate = self.nth((start + offset) % self.usable);
            if !taken(candidate) {
                return Ok(candidate);
            }
            offset += 1;
        }
        Err(VipError::Exhausted(self.net))
    }

    /// The `index`-th usable address (index 0 is the address after the network address).
    fn nth(&self, index: u128) -> IpAddr {
        match self.net {
            IpNet::V4(net) => {
                let base = u32::from(net.network());
                IpAddr::from(std::net::Ipv4Addr::from(base + 1 + index as u32))
            }
            IpNet::V6(net) => {
                let base = u128::from(net.network());
                IpAddr::from(std::net::Ipv6Addr::from(base + 1 + index))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    fn key(s: &str) -> ServiceKey {
        ServiceKey::parse("service", s).unwrap()
    }

    #[test]
    fn allocation_is_stable_and_inside_the_range() {
        let alloc = VipAllocator::new(DEFAULT_VIP_CIDR.parse().unwrap()).unwrap();
        let a = alloc.allocate(&key("shop/cart"), |_| false).unwrap();
        assert_eq!(a, alloc.allocate(&key("shop/cart"), |_| false).unwrap());
        assert!(alloc.contains(a));
        assert_ne!(a, "240.240.0.0".parse::<IpAddr>().unwrap());
        assert_ne!(a, "240.240.255.255".parse::<IpAddr>().unwrap());
    }

    #[test]
    fn a_small_range_fills_exactly_then_reports_exhaustion() {
        let alloc = VipAllocator::new("10.0.0.0/29".parse().unwrap()).unwrap();
        let mut taken = HashSet::new();
        for i in 0..6 {
            let ip = alloc
                .allocate(&key(&format!("ns/s{i}")), |ip| taken.contains(&ip))
                .unwrap();
            assert!(taken.insert(ip), "{ip} handed out twice");
            assert!(alloc.contains(ip));
        }
        let full = alloc.allocate(&key("ns/late"), |ip| taken.contains(&ip));
        assert_eq!(full, Err(VipError::Exhausted("10.0.0.0/29".parse().unwrap())));
    }

    #[test]
    fn ipv6_ranges_work() {
        let alloc = VipAllocator::new("fd00:aa::/64".parse().unwrap()).unwrap();
        let ip = alloc.allocate(&key("shop/cart"), |_| false).unwrap();
        assert!(ip.is_ipv6() && alloc.contains(ip));
    }

    #[test]
    fn tiny_ranges_are_refused() {
        assert!(VipAllocator::new("10.0.0.0/31".parse().unwrap()).is_err());
    }
}
