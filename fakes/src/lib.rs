//! Fakes shared by the tests of several crates, so each external system is faked once.
//!
//! No kube-apiserver can be installed where the tests run: [`kube::ApiServer`] stands in
//! for it, speaking the real JSON over HTTP. [`ext_authz::ExtAuthzServer`] is an external
//! authorization service speaking Envoy's real gRPC API.

pub mod ext_authz;
pub mod kube;
pub mod ports;
