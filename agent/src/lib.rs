//! aether-agent: the node agent.

pub mod cni;
pub mod config;
pub mod node;
pub mod pod;
pub mod pod_source;
pub mod pod_store;
pub mod registrar;
pub mod server;
pub mod upstreams;
pub mod xds;
