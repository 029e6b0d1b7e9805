//! The transport seam between pods: what the client side wraps upstream connections
//! in and what the inbound listener expects. Plaintext until workload identity lands;
//! that work replaces these two functions (and only these) with mTLS.

use envoy_types::pb::envoy::config::core::v3::TransportSocket;

/// The transport socket of mesh clusters (toward a peer's inbound listener).
pub fn upstream() -> Option<TransportSocket> {
    None
}

/// The transport socket of a pod's inbound listener chains.
pub fn downstream() -> Option<TransportSocket> {
    None
}
