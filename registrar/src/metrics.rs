//! The registrar's Prometheus instruments: `aether_registrar_<what>[_<unit>]` (counters get `_total` at
//! /metrics). The same instruments are pushed over OTLP (aether_common::telemetry).

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::{Registry, Unit};

use crate::records::ConfigKind;

pub type Labels = [(&'static str, &'static str); 1];

#[derive(Clone)]
pub struct Metrics {
    pub watchers: Gauge,
    pub services: Gauge,
    pub endpoints: Gauge,
    pub catalog_version: Gauge,
    pub changes: Counter,
    pub store_commit_seconds: Histogram,
    pub store_commit_failures: Counter,
    pub store_unreadable_records: Gauge,
    pub watch_snapshots: Family<Labels, Counter>,
    pub watch_resumes: Family<Labels, Counter>,
    pub invalid_requests: Family<Labels, Counter>,
    pub store_up: Gauge,
    pub write_behind_ops: Gauge,
    pub write_behind_refused: Counter,
    pub write_behind_dropped: Counter,
    pub feed_changes: Counter,
    pub feed_resyncs: Counter,
    pub feed_unusable: Counter,
    pub expired_endpoints: Counter,
    pub store_conflicts: Counter,
    /// Per configuration record kind (see [`Metrics::records`]).
    records: [Gauge; ConfigKind::ALL.len()],
    refused: [Family<Labels, Gauge>; ConfigKind::ALL.len()],
    /// ExternalService objects a source holds that were refused, by source.
    pub external_services_refused: Family<Labels, Gauge>,
}

impl Metrics {
    pub fn new(registry: &mut Registry) -> Self {
        let metrics = Self {
            watchers: Gauge::default(),
            services: Gauge::default(),
            endpoints: Gauge::default(),
            catalog_version: Gauge::default(),
            changes: Counter::default(),
            store_commit_seconds: Histogram::new(exponential_buckets(0.000_25, 2.0, 16)),
            store_commit_failures: Counter::default(),
            store_unreadable_records: Gauge::default(),
            watch_snapshots: Family::default(),
            watch_resumes: Family::default(),
            invalid_requests: Family::default(),
            store_up: Gauge::default(),
            write_behind_ops: Gauge::default(),
            write_behind_refused: Counter::default(),
            write_behind_dropped: Counter::default(),
            feed_changes: Counter::default(),
            feed_resyncs: Counter::default(),
            feed_unusable: Counter::default(),
            expired_endpoints: Counter::default(),
            store_conflicts: Counter::default(),
            records: Default::default(),
            refused: Default::default(),
            external_services_refused: Family::default(),
        };
        let r = registry.sub_registry_with_prefix("aether_registrar");
        metrics.register_catalog(r);
        metrics.register_store_commits(r);
        metrics.register_requests(r);
        metrics.register_write_behind(r);
        metrics.register_replication(r);
        metrics
    }

    /// The catalog's size and version, and its watchers.
    fn register_catalog(&self, r: &mut Registry) {
        r.register("watchers", "Open Watch streams", self.watchers.clone());
        r.register("services", "Services in the catalog", self.services.clone());
        r.register("endpoints", "Endpoints in the catalog", self.endpoints.clone());
        r.register(
            "catalog_version",
            "Sequence number of the latest catalog change",
            self.catalog_version.clone(),
        );
        r.register("changes", "Catalog changes committed", self.changes.clone());
        for kind in ConfigKind::ALL {
            let (plural, objects) = (kind.plural(), kind.objects());
            let help = format!("Projected {objects} objects in the catalog");
            r.register(plural, help, self.records(kind).clone());
            let help = format!(
                "{objects} objects a source holds that the projector refused (their last accepted version, if any, stays in force)"
            );
            r.register(format!("{plural}_refused"), help, self.refused(kind).clone());
        }
        r.register(
            "external_services_refused",
            "ExternalService objects a source holds that were refused (by the projector, or for a name a mesh service holds)",
            self.external_services_refused.clone(),
        );
    }

    /// How many records of `kind` the catalog holds: `aether_registrar_<plural>`.
    pub fn records(&self, kind: ConfigKind) -> &Gauge {
        &self.records[kind.index()]
    }

    /// How many objects of `kind` a source holds that were refused, by source:
    /// `aether_registrar_<plural>_refused`.
    pub fn refused(&self, kind: ConfigKind) -> &Family<Labels, Gauge> {
        &self.refused[kind.index()]
    }

    /// Commits to the store and what it held at start-up.
    fn register_store_commits(&self, r: &mut Registry) {
        r.register_with_unit(
            "store_commit_duration",
            "Time to commit one batch of writes to the store",
            Unit::Seconds,
            self.store_commit_seconds.clone(),
        );
        r.register(
            "store_commit_failures",
            "Store commits that failed (their requests were refused)",
            self.store_commit_failures.clone(),
        );
        r.register(
            "store_unreadable_records",
            "Records found in the store at start-up that could not be used (left untouched)",
            self.store_unreadable_records.clone(),
        );
    }

    /// What watchers and callers were sent or refused.
    fn register_requests(&self, r: &mut Registry) {
        r.register(
            "watch_snapshots",
            "Snapshots sent to watchers, by reason",
            self.watch_snapshots.clone(),
        );
        r.register(
            "watch_resumes",
            "Watch streams resumed without a full snapshot, by what they resumed from: history (this \
             replica's own versions) or holdings (the digests of what the client's view holds; answered \
             with a RECONCILED snapshot of what differs)",
            self.watch_resumes.clone(),
        );
        r.register(
            "invalid_requests",
            "Requests refused as invalid, by method",
            self.invalid_requests.clone(),
        );
    }

    /// Whether the store is reachable, and the write-behind queue.
    fn register_write_behind(&self, r: &mut Registry) {
        r.register(
            "store_up",
            "1 while the catalog store is reachable (writes go straight to it), 0 while writes are queued",
            self.store_up.clone(),
        );
        r.register(
            "write_behind_ops",
            "Store operations accepted and waiting in the write-behind queue",
            self.write_behind_ops.clone(),
        );
        r.register(
            "write_behind_refused",
            "Writes refused with Unavailable because the write-behind queue was full",
            self.write_behind_refused.clone(),
        );
        r.register(
            "write_behind_dropped",
            "Queued store operations dropped because the store kept refusing them",
            self.write_behind_dropped.clone(),
        );
    }

    /// Changes from other replicas and expired nodes.
    fn register_replication(&self, r: &mut Registry) {
        r.register(
            "feed_changes",
            "Changes made by other replicas applied from the store's feed",
            self.feed_changes.clone(),
        );
        r.register(
            "feed_resyncs",
            "Full resyncs from the store (feed continuity lost)",
            self.feed_resyncs.clone(),
        );
        r.register(
            "feed_unusable_records",
            "Records on the store's feed that could not be used",
            self.feed_unusable.clone(),
        );
        r.register(
            "expired_endpoints",
            "Endpoints removed because their node stopped refreshing (timestamp stores)",
            self.expired_endpoints.clone(),
        );
        r.register(
            "store_conflicts",
            "Commits refused because another replica won a race (the records were adopted and the writes re-planned)",
            self.store_conflicts.clone(),
        );
    }
}
