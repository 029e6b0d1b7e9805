//! aether-registrar: the mesh-wide endpoint catalog on a durable store, served over
//! gRPC (`aether.registrar.v1`) to every node agent.

pub mod api;
pub mod auth;
pub mod bootstrap;
pub mod catalog;
pub mod cluster;
pub mod config;
pub mod external_services;
pub mod http_filters;
pub mod mesh_configs;
pub mod metrics;
pub mod model;
pub mod policies;
pub mod records;
pub mod routes;
pub mod server;
pub mod sources;
pub mod store;
pub mod vip;
pub mod watch;

pub use config::Config;
pub use server::{Running, StartError, Stopped, TELEMETRY, start};
