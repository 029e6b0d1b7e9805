//! Routes: users' Gateway API HTTPRoute, GRPCRoute, TCPRoute and TLSRoute objects whose parents are
//! Services, projected by `aether-api` into `aether.registry.v1.Route`s that travel
//! with the catalog (proposals/012). [`Routes`] is their kind for the sources
//! (`crate::sources`); [`kubernetes`] watches them in the cluster and writes their
//! `status.parents[]`.

pub mod kubernetes;

use aether_api::{Document, ParseError, RouteObject};
use aether_proto::registry::v1::Route;

use crate::sources::ObjectKind;

/// The route kind: objects keyed `<kind>/<namespace>/<name>`; one without a Service
/// parent is not the mesh's.
#[derive(Clone, Copy, Debug, Default)]
pub struct Routes;

impl ObjectKind for Routes {
    type Object = RouteObject;
    type Record = Route;

    fn key(object: &RouteObject) -> String {
        object.key()
    }

    fn project(&self, object: &RouteObject) -> Result<Option<Route>, String> {
        aether_api::project(object).map_err(|rejected| rejected.to_string())
    }

    fn pick(documents: &[Document]) -> Vec<Result<RouteObject, ParseError>> {
        aether_api::route_objects(documents)
    }
}
