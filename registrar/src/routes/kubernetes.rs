//! The Kubernetes route source: Gateway API HTTPRoute and GRPCRoute objects watched in
//! all namespaces ([`ClusterRoutes`], one watch per registrar), projected by the one
//! projector, and their `status.parents[]` written back ([`status`]).
//!
//! - With a writable store (`--from-kubernetes`), [`run`] makes the catalog's
//!   routes the cluster's accepted ones, through the store like every other change.
//!   Every replica may run it: they write the same routes, and unchanged routes are not
//!   written again.
//! - The Kubernetes store derives its routes from the same watch
//!   (`crate::store::kubernetes`).
//!
//! A cluster without the Gateway API CRDs has no routes: the registrar says so once,
//! serves without them, and looks again every 30 s.

mod objects;
pub mod status;

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

pub use self::objects::{ABSENT_RETRY, ClusterRoutes, DEBOUNCE, Outcome, RouteSet, Watched};
use super::{Projector, apply};
use crate::catalog::Catalog;

/// How refusals and metrics name this source.
pub const SOURCE: &str = "kubernetes";
/// Pause before storing the routes again after the catalog could not.
const RETRY: Duration = Duration::from_secs(1);

/// Keeps the catalog's routes equal to the cluster's accepted ones until `shutdown`.
pub async fn run(mut routes: ClusterRoutes, catalog: Catalog, shutdown: CancellationToken) {
    let metrics = catalog.metrics().clone();
    let mut projector = Projector::resuming(&catalog);
    let mut reported = Vec::new();
    let mut current: Option<Arc<RouteSet>> = None;
    // The spec_version last stored.
    let mut stored = None;
    loop {
        if let Some(set) = current.as_ref().filter(|s| stored != Some(s.spec_version)) {
            // The watch delivers whole sets: nothing is held back.
            let projection = projector.project_holding(set.origins(), &HashSet::new());
            if apply(&catalog, &metrics, SOURCE, projection, &mut reported).await {
                stored = Some(set.spec_version);
            }
        }
        let retry = current.as_ref().is_some_and(|s| stored != Some(s.spec_version));
        tokio::select! {
            () = shutdown.cancelled() => return,
            next = routes.next() => match next {
                Some(set) => current = Some(set),
                None => return,
            },
            () = tokio::time::sleep(RETRY), if retry => {}
        }
    }
}
