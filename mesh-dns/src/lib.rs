//! aether-mesh-dns: the node's DNS for mesh names.
//!
//! `records` is the record-file format shared with the agent (which writes it);
//! everything else is the server, behind the default `server` feature.

pub mod records;

#[cfg(feature = "server")]
pub mod app;
#[cfg(feature = "server")]
pub mod config;
#[cfg(feature = "server")]
pub mod forward;
#[cfg(feature = "server")]
pub mod handler;
#[cfg(feature = "server")]
pub mod metrics;
#[cfg(feature = "server")]
pub mod ratelimit;
#[cfg(feature = "server")]
pub mod reload;
#[cfg(feature = "server")]
pub mod server;
#[cfg(feature = "server")]
pub mod table;
#[cfg(feature = "server")]
pub mod zone;
