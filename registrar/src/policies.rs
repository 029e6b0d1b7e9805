//! Authorization policy sources: where the registrar reads users'
//! `security.aether.io/v1alpha1` AuthorizationPolicy objects, projects them with
//! `aether-api` (the one projector, with the mesh root namespace as its option) and
//! makes the catalog's policies exactly the accepted set, so they are stored and
//! streamed like routes (proposals/013, "Distribution").
//!
//! Refusals work as for routes: an object the projector refuses is reported (log line
//! naming the field, metric) and never half-applied; an earlier accepted version of it
//! keeps being served, hence enforced, until the object is fixed or deleted.

pub mod kubernetes;

use std::collections::{BTreeMap, HashMap, HashSet};

use aether_api::authorization::{self as projector, AuthorizationPolicy as PolicyObject, ProjectOptions};
use aether_common::quote::quote;
use aether_proto::registry::v1::AuthorizationPolicy;
use aether_proto::view::policy_key;

use crate::catalog::Catalog;
use crate::metrics::Metrics;
use crate::routes::Refusal;

/// The key `<namespace>/<name>` an object will be stored under.
pub fn object_key(object: &PolicyObject) -> String {
    let namespace = object.metadata.namespace.as_deref();
    let namespace = namespace.unwrap_or(aether_api::route::DEFAULT_NAMESPACE);
    format!("{namespace}/{}", object.metadata.name.as_deref().unwrap_or_default())
}

/// Projects a source's policy objects, remembering the last accepted version of each.
pub struct Projector {
    options: ProjectOptions,
    last_good: HashMap<String, AuthorizationPolicy>,
}

/// A source's policies after projection: what the catalog should hold, and what was
/// refused.
#[derive(Debug, Default)]
pub struct Projection {
    pub policies: BTreeMap<String, AuthorizationPolicy>,
    pub refused: Vec<Refusal>,
}

impl Projector {
    /// A projector that has accepted nothing yet.
    pub fn new(options: ProjectOptions) -> Projector {
        Projector {
            options,
            last_good: HashMap::new(),
        }
    }

    /// A projector whose last accepted versions are the policies the catalog stores:
    /// after a restart, an object refused now keeps what was accepted before.
    pub fn resuming(catalog: &Catalog, options: ProjectOptions) -> Projector {
        let state = catalog.read();
        let last_good = (state.policies()).map(|p| (policy_key(p), AuthorizationPolicy::clone(p)));
        Projector {
            options,
            last_good: last_good.collect(),
        }
    }

    /// Projects `objects` (each with the origin to name it by). Objects that are gone
    /// are forgotten, unless `held` (keys of objects the source could not read this
    /// time); a refused object keeps its last accepted version.
    pub fn project_holding<'a>(
        &mut self,
        objects: impl IntoIterator<Item = (String, &'a PolicyObject)>,
        held: &HashSet<String>,
    ) -> Projection {
        let mut projection = Projection::default();
        let mut seen = HashSet::new();
        for (origin, object) in objects {
            let key = object_key(object);
            match projector::project(object, &self.options) {
                Ok(policy) => {
                    self.last_good.insert(key.clone(), policy);
                }
                Err(refusal) => projection.refused.push(Refusal {
                    origin,
                    reason: refusal.to_string(),
                }),
            }
            seen.insert(key);
        }
        self.last_good.retain(|key, _| seen.contains(key) || held.contains(key));
        projection.policies = (self.last_good.iter()).map(|(k, p)| (k.clone(), p.clone())).collect();
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
                "authorization policy refused; its last accepted version (if any) stays enforced");
        }
        *reported = projection.refused.clone();
    }
    let refused = projection.refused.len() as i64;
    metrics
        .policies_refused
        .get_or_create(&[("source", source)])
        .set(refused);
    let count = projection.policies.len();
    match catalog.set_policies(projection.policies).await {
        Ok(version) => {
            tracing::debug!(%source, policies = count, seq = version.seq, "authorization policies applied");
            true
        }
        Err(status) => {
            tracing::error!(%source, error = %status.message(), "storing authorization policies failed; retrying");
            false
        }
    }
}
