//! Digests of catalog records that every process computes alike, so a watcher
//! reconnecting to another registrar replica can say what its view holds in a few bytes
//! per service (`WatchRequest.held`) and be sent only what differs.
//!
//! A record's digest is the first 8 bytes of the SHA-256 of its protobuf encoding
//! (maps are generated as sorted maps, so the encoding is canonical). A service's digest
//! is its record's plus its endpoints', added with wraparound: the order of a set does
//! not matter, and the registrar keeps each service's sum as endpoints come and go
//! instead of encoding them all again. A digest that differs only costs a resend; the
//! encoding of a field one side does not know yet (a rolling upgrade) makes it differ.

use prost::Message;
use sha2::{Digest as _, Sha256};

use crate::registry::v1::{Endpoint, Service};

/// A record's digest.
pub fn of<M: Message>(record: &M) -> u64 {
    let hash = Sha256::digest(record.encode_to_vec());
    u64::from_le_bytes(hash[..8].try_into().expect("SHA-256 is 32 bytes"))
}

/// The sum of a set of endpoints' digests, kept as the set changes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct EndpointSum(u64);

impl EndpointSum {
    /// Adds an endpoint by its digest ([`of`]).
    pub fn add(&mut self, digest: u64) {
        self.0 = self.0.wrapping_add(digest);
    }

    /// Takes away an endpoint added before, by its digest.
    pub fn remove(&mut self, digest: u64) {
        self.0 = self.0.wrapping_sub(digest);
    }

    /// The sum over `endpoints`.
    pub fn over<'a>(endpoints: impl IntoIterator<Item = &'a Endpoint>) -> EndpointSum {
        let mut sum = EndpointSum::default();
        endpoints.into_iter().for_each(|e| sum.add(of(e)));
        sum
    }
}

/// A service's digest: its record and its endpoints (none for a services-only view).
pub fn service(service: &Service, endpoints: EndpointSum) -> u64 {
    of(service).wrapping_add(endpoints.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn endpoint(address: &str, metadata: &[(&str, &str)]) -> Endpoint {
        Endpoint {
            service: "shop/cart".into(),
            address: address.into(),
            metadata: metadata.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
            ..Default::default()
        }
    }

    #[test]
    fn a_services_digest_does_not_depend_on_the_order_its_parts_came_in() {
        let (a, b) = (
            endpoint("10.0.0.1", &[("zone", "a"), ("app", "cart")]),
            endpoint("10.0.0.2", &[]),
        );
        let mut kept = EndpointSum::default();
        kept.add(of(&b));
        kept.add(of(&endpoint("10.0.0.3", &[])));
        kept.add(of(&a));
        kept.remove(of(&endpoint("10.0.0.3", &[])));
        assert_eq!(kept, EndpointSum::over([&a, &b]));
        let record = Service {
            namespace: "shop".into(),
            name: "cart".into(),
            ..Default::default()
        };
        assert_eq!(service(&record, kept), service(&record, EndpointSum::over([&b, &a])));
    }

    #[test]
    fn any_difference_in_a_service_changes_its_digest() {
        let record = Service {
            namespace: "shop".into(),
            name: "cart".into(),
            vip: "240.240.0.1".into(),
            kubernetes: None,
            external: None,
        };
        let base = service(&record, EndpointSum::over([&endpoint("10.0.0.1", &[("zone", "a")])]));
        let other_metadata = EndpointSum::over([&endpoint("10.0.0.1", &[("zone", "b")])]);
        assert_ne!(base, service(&record, other_metadata));
        assert_ne!(base, service(&record, EndpointSum::default()));
        let moved = Service {
            vip: "240.240.0.2".into(),
            ..record.clone()
        };
        assert_ne!(
            base,
            service(&moved, EndpointSum::over([&endpoint("10.0.0.1", &[("zone", "a")])]))
        );
    }
}
