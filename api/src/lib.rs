//! Aether's user-facing API objects, validated and projected in one place ("one projector
//! per API"): Gateway API HTTPRoute, GRPCRoute, TCPRoute and TLSRoute with Service parents (GAMMA) become
//! `aether.registry.v1.Route`; AuthorizationPolicy becomes
//! `aether.registry.v1.AuthorizationPolicy`. The registrar's sources (Kubernetes watch, YAML directory),
//! the agent (re-validation before compiling to Envoy) and the admission webhooks call
//! these same functions.
//!
//! - [`gateway`]: the typed objects (`kube::Api::<HttpRoute>` works on them), routes and
//!   the edge's GatewayClass, Gateway and ReferenceGrant.
//! - [`edge`]: the edge gateway's projector: one Gateway validated, its routes attached
//!   (projected by [`route::project_detached`]), its status computed.
//! - [`route`]: [`project`], [`validate`], [`backend_services`], [`unresolved_backends`];
//!   [`route::order`]: the precedence of the rules on a service port and which one a
//!   request takes ([`route::request`]), for the agent's compile and `aether explain`.
//! - [`yaml`]: [`parse_documents`] for route files.
//! - [`status`]: the `status.parents[]` entries the registrar writes.
//! - [`duration`]: Gateway API durations (GEP-2257).
//! - [`authorization`]: our `security.aether.io/v1alpha1` AuthorizationPolicy, its projector
//!   into `aether.registry.v1.AuthorizationPolicy`, and [`authorization::decide`], what a
//!   policy set decides for one request.
//! - [`http_filter`]: our `networking.aether.io/v1alpha1` HTTPFilter (a few stock Envoy HTTP
//!   filters, typed) and its projector into `aether.registry.v1.HttpFilter`.
//! - [`mesh_config`]: our `mesh.aether.io/v1alpha1` MeshConfig (mesh-wide and per-namespace
//!   defaults), its projector and [`mesh_config::effective`], a namespace's settings.
//! - [`external_service`]: our `networking.aether.io/v1alpha1` ExternalService (a destination
//!   outside the mesh with a mesh VIP) and its projector into `aether.registry.v1.External`.
//! - [`service_ports`]: a mesh service's ports (Service port → endpoint port → protocol),
//!   read the same way by the agent and the registrar.
//! - [`pod`]: a pod's mesh annotations (`config.aether.io/*`, `security.aether.io/inbound-mtls`).

pub mod authorization;
pub mod duration;
pub mod edge;
pub mod external_service;
pub mod gateway;
pub mod http_filter;
pub mod mesh_config;
pub mod pod;
mod refusal;
mod resource;
pub mod route;
pub mod service_ports;
pub mod status;
pub mod yaml;

pub use refusal::Refusal;
pub use route::{
    ConditionType, InvalidRoute, Rejected, RouteObject, backend_services, mismatched_ports, project,
    unresolved_backends, validate,
};
pub use status::parent_status;
pub use yaml::{Document, MeshObject, ParseError, documents, mesh_object, parse_documents, route_objects};
