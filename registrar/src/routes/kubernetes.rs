//! The Kubernetes route source: Gateway API HTTPRoute, GRPCRoute, TCPRoute and TLSRoute objects watched in
//! all namespaces ([`ClusterRoutes`], one watch per registrar), projected by the one
//! projector, and their `status.parents[]` written back ([`status`]).
//!
//! - With a writable store (`--from-kubernetes`), `crate::sources::run` makes the
//!   catalog's routes the cluster's accepted ones, through the store like every other
//!   change.
//! - The Kubernetes store derives its routes from the same watch
//!   (`crate::store::kubernetes`).
//!
//! A cluster without the Gateway API CRDs has no routes: the registrar says so once,
//! serves without them, and looks again every 30 s.

mod objects;
pub mod status;

pub use self::objects::{ABSENT_RETRY, ClusterRoutes, DEBOUNCE, Outcome, RouteSet, Watched};
