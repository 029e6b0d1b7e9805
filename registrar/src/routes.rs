//! Route sources: where the registrar reads users' routes (Gateway API HTTPRoute and
//! GRPCRoute objects whose parents are Services), projects them with `aether-api`
//! (the one projector), and makes the catalog's routes exactly the accepted set, so
//! they are stored and streamed like every other change.
//!
//! A source delivers its whole set of objects each time something changes. An object
//! the projector refuses is reported (log line, metric, and on Kubernetes its status)
//! and never half-applied: if an earlier version of it was accepted, that version
//! keeps serving until the object is fixed or deleted.

pub mod directory;
pub mod kubernetes;

use std::collections::{BTreeMap, HashMap, HashSet};

use aether_api::{self as projector, RouteObject};
use aether_common::quote::quote;
use aether_proto::registry::v1::Route;
use aether_proto::view::route_key;

use crate::catalog::Catalog;
use crate::metrics::Metrics;

/// Why one object of a source is not (or not in its latest version) in the catalog.
#[derive(Clone, Debug, PartialEq)]
pub struct Refusal {
    /// Where it came from, e.g. `routes.yaml#2` or `http/ns/name`.
    pub origin: String,
    pub reason: String,
}

/// Projects a source's objects, remembering the last accepted version of each.
#[derive(Default)]
pub struct Projector {
    last_good: HashMap<String, Route>,
}

/// A source's objects after projection: what the catalog should hold, and what was
/// refused.
#[derive(Debug, Default)]
pub struct Projection {
    pub routes: BTreeMap<String, Route>,
    pub refused: Vec<Refusal>,
}

impl Projector {
    /// A projector whose last accepted versions are the routes the catalog already
    /// stores: after a restart, an object that is refused now keeps serving what was
    /// accepted before.
    pub fn resuming(catalog: &Catalog) -> Projector {
        let state = catalog.read();
        let last_good = state.routes().map(|r| (route_key(r), Route::clone(r))).collect();
        Projector { last_good }
    }

    /// Projects `objects` (each with the origin to name it by). Objects that are
    /// gone are forgotten, unless `held` (keys of objects the source could not read
    /// this time); a refused object keeps its last accepted version.
    pub fn project_holding<'a>(
        &mut self,
        objects: impl IntoIterator<Item = (String, &'a RouteObject)>,
        held: &HashSet<String>,
    ) -> Projection {
        let mut projection = Projection::default();
        let mut seen = HashSet::new();
        for (origin, object) in objects {
            let key = object.key();
            match projector::project(object) {
                Ok(Some(route)) => {
                    self.last_good.insert(key.clone(), route);
                }
                // Not a mesh route (no Service parent): none of ours.
                Ok(None) => {
                    self.last_good.remove(&key);
                    continue;
                }
                Err(rejected) => projection.refused.push(Refusal {
                    origin: origin.clone(),
                    reason: rejected.to_string(),
                }),
            }
            seen.insert(key);
        }
        self.last_good.retain(|key, _| seen.contains(key) || held.contains(key));
        projection.routes = self
            .last_good
            .values()
            .map(|route| (route_key(route), route.clone()))
            .collect();
        projection
    }
}

/// Hands a projection to the catalog, reporting refusals (logged when they change);
/// false if the catalog could not store it.
pub async fn apply(
    catalog: &Catalog,
    metrics: &Metrics,
    source: &'static str,
    projection: Projection,
    reported: &mut Vec<Refusal>,
) -> bool {
    if projection.refused != *reported {
        for refusal in &projection.refused {
            tracing::warn!(%source, origin = %quote(&refusal.origin), reason = %refusal.reason,
                "route refused; its last accepted version (if any) keeps serving");
        }
        *reported = projection.refused.clone();
    }
    metrics
        .routes_refused
        .get_or_create(&[("source", source)])
        .set(projection.refused.len() as i64);
    let count = projection.routes.len();
    match catalog.set_routes(projection.routes).await {
        Ok(version) => {
            tracing::debug!(%source, routes = count, seq = version.seq, "routes applied");
            true
        }
        Err(status) => {
            tracing::error!(%source, error = %status.message(), "storing routes failed; retrying");
            false
        }
    }
}
