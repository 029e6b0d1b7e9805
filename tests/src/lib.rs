//! The shared harness for Aether's end-to-end tests: a test node whose pods are network namespaces on a Linux
//! bridge, small HTTP/TCP servers and an HTTP client that live inside those pods, child processes that never
//! outlive their test, and a real Envoy.
//!
//! Everything here needs root and real network namespaces; a test that cannot get them fails loudly
//! ([`require_root`]), it never silently passes. Every resource is owned by a guard whose `Drop` removes it, so a
//! panicking test cleans up too.

pub mod bench;
pub mod bins;
pub mod cni;
pub mod control_plane;
pub mod controller;
pub mod echo;
pub mod edge;
pub mod envoy;
pub mod gamma;
pub mod http;
pub mod identity;
pub mod load;
pub mod mesh;
pub mod mesh_dns;
pub mod netns;
pub mod otlp;
pub mod outside_dns;
pub mod process;
pub mod spire;
pub mod spire_workload;
pub mod supervisor;

pub use bins::binary;
pub use envoy::{Envoy, admin_address_json, envoy_bin, shared_memory_path, unique_base_id};
pub use http::{HttpReply, HttpServer, TcpServer, http_get, http_request};
pub use netns::{TestNode, TestPod, require_root, sweep_stale};
pub use process::{ChildGuard, free_port};
