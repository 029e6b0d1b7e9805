//! Configuration sources: where the registrar reads users' objects (Gateway API routes,
//! AuthorizationPolicies, HTTPFilters), projects them with `aether-api` (the one projector per API),
//! and makes the catalog's records of each kind exactly the accepted set, so they are
//! stored and streamed like every other change.
//!
//! - [`directory`]: `--config-dir`, YAML files holding objects of every kind.
//! - [`crd`]: the watch of one of our CRDs (AuthorizationPolicy, HTTPFilter) in all
//!   namespaces, and [`accepted`], the `Accepted` condition written back to each object.
//! - [`run`]: a cluster watch feeding a writable store (`--from-kubernetes`); the
//!   Kubernetes store derives its records from the same watches itself.
//!
//! A source delivers its whole set of objects of a kind each time something changes.
//! An object the projector refuses is reported (log line naming the field, metric, and
//! on Kubernetes its status) and never half-applied: if an earlier version of it was
//! accepted, that version stays in force until the object is fixed or deleted.
//!
//! What differs per kind is an [`ObjectKind`]: `routes::Routes`, `policies::Policies`,
//! `http_filters::HttpFilters`.

pub mod accepted;
pub mod crd;
pub mod directory;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use aether_api::{Document, ParseError};
use aether_common::quote::quote;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use tokio_util::sync::CancellationToken;

use crate::catalog::Catalog;
use crate::cluster::Sets;
use crate::metrics::{Labels, Metrics};
use crate::records::Record;
use aether_proto::registrar::v1::Version;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use tonic::Status;

/// How refusals and metrics name the Kubernetes sources.
pub const KUBERNETES: &str = "kubernetes";
/// Pause before storing a kind's records again after the catalog could not.
const RETRY: Duration = Duration::from_secs(1);

/// Where the projections of a kind of users' object go in the catalog: a configuration
/// record of its kind (every [`Record`]), or an external service (`External`, a catalog
/// service of its own, see `crate::external_services`).
pub trait Destination: Clone + PartialEq + Send + Sync + 'static {
    /// How logs name one (`route`, `external service`).
    fn noun() -> &'static str;
    /// The users' objects it comes from, for messages.
    fn objects() -> &'static str;
    /// What the catalog holds now, by key: a restarted source resumes from it.
    fn held(catalog: &Catalog) -> Vec<(String, Self)>;
    /// The gauge of objects refused, by source.
    fn refused_gauge(metrics: &Metrics) -> &Family<Labels, Gauge>;
    /// Makes the catalog's set exactly `desired`; the version that holds it, and the keys
    /// the catalog itself would not take, with why.
    fn store(
        catalog: &Catalog,
        desired: BTreeMap<String, Self>,
    ) -> impl Future<Output = Result<(Version, Vec<(String, String)>), Status>> + Send;
}

impl<T: Record> Destination for T {
    fn noun() -> &'static str {
        T::KIND.noun()
    }
    fn objects() -> &'static str {
        T::KIND.objects()
    }
    fn held(catalog: &Catalog) -> Vec<(String, Self)> {
        let state = catalog.read();
        state.records::<T>().map(|r| (r.key(), T::clone(r))).collect()
    }
    fn refused_gauge(metrics: &Metrics) -> &Family<Labels, Gauge> {
        metrics.refused(T::KIND)
    }
    async fn store(
        catalog: &Catalog,
        desired: BTreeMap<String, Self>,
    ) -> Result<(Version, Vec<(String, String)>), Status> {
        catalog.set_records(desired).await.map(|version| (version, Vec::new()))
    }
}

/// A kind of users' object, and how it becomes a catalog record.
pub trait ObjectKind: Clone + Send + Sync + 'static {
    /// The object as a source reads it.
    type Object: Send + Sync + 'static;
    /// What it is projected into.
    type Record: Destination;
    /// The key its record is stored under, known before projecting.
    fn key(object: &Self::Object) -> String;
    /// Its record (`None`: not the mesh's), or why it is refused, naming the field.
    fn project(&self, object: &Self::Object) -> Result<Option<Self::Record>, String>;
    /// The objects of this kind among a YAML text's documents (other kinds are skipped).
    fn pick(documents: &[Document]) -> Vec<Result<Self::Object, ParseError>>;
}

/// The whole set of one kind's objects, as a cluster watch publishes it.
pub trait ObjectSet: Send + Sync + 'static {
    type Object;
    /// Moves when an object was added, removed or changed its spec; not when only a
    /// status did (the registrar's own writes), so nothing is projected again.
    fn spec_version(&self) -> u64;
    /// The objects with the origin refusals name them by.
    fn origins(&self) -> impl Iterator<Item = (String, &Self::Object)>;
}

/// The key `<namespace>/<name>` of a namespaced object's record (no namespace: the
/// projectors' default).
pub fn namespaced_key(meta: &ObjectMeta) -> String {
    let namespace = meta
        .namespace
        .as_deref()
        .unwrap_or(aether_api::route::DEFAULT_NAMESPACE);
    format!("{namespace}/{}", meta.name.as_deref().unwrap_or_default())
}

/// Why one object of a source is not (or not in its latest version) in the catalog.
#[derive(Clone, Debug, PartialEq)]
pub struct Refusal {
    /// Where it came from, e.g. `routes.yaml#2` or `http/ns/name`.
    pub origin: String,
    pub reason: String,
}

/// Projects a source's objects of one kind, remembering the last accepted version of each.
pub struct Projector<K: ObjectKind> {
    kind: K,
    last_good: HashMap<String, K::Record>,
}

/// A source's objects after projection: what the catalog should hold, and what was
/// refused.
#[derive(Debug)]
pub struct Projection<T> {
    pub records: BTreeMap<String, T>,
    pub refused: Vec<Refusal>,
}

impl<K: ObjectKind> Projector<K> {
    /// A projector that has accepted nothing yet.
    pub fn new(kind: K) -> Self {
        Projector {
            kind,
            last_good: HashMap::new(),
        }
    }

    /// A projector whose last accepted versions are the records the catalog stores:
    /// after a restart, an object refused now keeps what was accepted before.
    pub fn resuming(catalog: &Catalog, kind: K) -> Self {
        Projector {
            kind,
            last_good: K::Record::held(catalog).into_iter().collect(),
        }
    }

    /// Projects `objects` (each with the origin to name it by). Objects that are gone
    /// are forgotten, unless `held` (keys of objects the source could not read this
    /// time); a refused object keeps its last accepted version.
    pub fn project_holding<'a>(
        &mut self,
        objects: impl IntoIterator<Item = (String, &'a K::Object)>,
        held: &HashSet<String>,
    ) -> Projection<K::Record> {
        let mut refused = Vec::new();
        let mut seen = HashSet::new();
        for (origin, object) in objects {
            let key = K::key(object);
            match self.kind.project(object) {
                Ok(Some(record)) => {
                    self.last_good.insert(key.clone(), record);
                }
                // Not the mesh's (a route without a Service parent): none of ours.
                Ok(None) => {
                    self.last_good.remove(&key);
                    continue;
                }
                Err(reason) => refused.push(Refusal { origin, reason }),
            }
            seen.insert(key);
        }
        self.last_good.retain(|key, _| seen.contains(key) || held.contains(key));
        let records = (self.last_good.iter()).map(|(k, r)| (k.clone(), r.clone())).collect();
        Projection { records, refused }
    }
}

/// Logs `refused` if it differs from what was `reported` last (then remembers it).
pub fn report<T: Destination>(source: &'static str, refused: &[Refusal], reported: &mut Vec<Refusal>) {
    if refused == reported.as_slice() {
        return;
    }
    let noun = T::noun();
    for refusal in refused {
        tracing::warn!(%source, origin = %quote(&refusal.origin), reason = %refusal.reason,
            "{noun} refused; its last accepted version (if any) stays in force");
    }
    *reported = refused.to_vec();
}

/// Hands a projection to the catalog, reporting refusals (logged when they change,
/// counted by source); false if the catalog could not store it.
pub async fn apply<T: Destination>(
    catalog: &Catalog,
    metrics: &Metrics,
    source: &'static str,
    projection: Projection<T>,
    reported: &mut Vec<Refusal>,
) -> bool {
    let (count, noun) = (projection.records.len(), T::noun());
    let (stored, mut refused) = match T::store(catalog, projection.records).await {
        Ok((version, not_taken)) => {
            tracing::debug!(%source, kind = noun, count, seq = version.seq, "configuration applied");
            let not_taken = not_taken.into_iter().map(|(origin, reason)| Refusal { origin, reason });
            (true, not_taken.collect())
        }
        Err(status) => {
            tracing::error!(%source, kind = noun, error = %status.message(), "storing configuration failed; retrying");
            (false, Vec::new())
        }
    };
    refused.splice(0..0, projection.refused);
    report::<T>(source, &refused, reported);
    (T::refused_gauge(metrics).get_or_create(&[("source", source)])).set(refused.len() as i64);
    stored
}

/// Keeps the catalog's records of one kind equal to the cluster's accepted objects
/// until `shutdown` (a writable store with `--from-kubernetes`). Every replica may run
/// it: they write the same records, and unchanged ones are not written again.
pub async fn run<K, S>(mut sets: Sets<S>, kind: K, catalog: Catalog, shutdown: CancellationToken)
where
    K: ObjectKind,
    S: ObjectSet<Object = K::Object>,
{
    let metrics = catalog.metrics().clone();
    let mut projector = Projector::resuming(&catalog, kind);
    let mut reported = Vec::new();
    let mut current: Option<Arc<S>> = None;
    // The spec_version last stored.
    let mut stored = None;
    loop {
        if let Some(set) = current.as_ref().filter(|s| stored != Some(s.spec_version())) {
            // The watch delivers whole sets: nothing is held back.
            let projection = projector.project_holding(set.origins(), &HashSet::new());
            if apply(&catalog, &metrics, KUBERNETES, projection, &mut reported).await {
                stored = Some(set.spec_version());
            }
        }
        let retry = current.as_ref().is_some_and(|s| stored != Some(s.spec_version()));
        tokio::select! {
            () = shutdown.cancelled() => return,
            next = sets.next() => match next {
                Some(set) => current = Some(set),
                None => return,
            },
            () = tokio::time::sleep(RETRY), if retry => {}
        }
    }
}
