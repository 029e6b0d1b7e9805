//! aether-agent: the node agent.

pub mod access_log;
pub mod capture;
pub mod catalog_watch;
pub mod cni;
pub mod config;
pub mod debug;
pub mod dns_records;
pub mod edge;
pub mod explain;
pub mod identity;
pub mod mesh_settings;
pub mod node;
pub mod node_taint;
pub mod pod;
pub mod pod_source;
pub mod pod_store;
pub mod proxy;
pub mod registrar;
pub mod registrar_link;
pub mod request_metrics;
pub mod server;
pub mod uds;
pub use aether_api::pod::upstreams;
pub mod xds;
