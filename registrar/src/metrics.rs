//! The registrar's Prometheus instruments (`aether_registrar_*`).

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

type Labels = [(&'static str, &'static str); 1];

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
    pub invalid_requests: Family<Labels, Counter>,
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
            invalid_requests: Family::default(),
        };
        let r = registry.sub_registry_with_prefix("aether_registrar");
        r.register("watchers", "Open Watch streams", metrics.watchers.clone());
        r.register("services", "Services in the catalog", metrics.services.clone());
        r.register("endpoints", "Endpoints in the catalog", metrics.endpoints.clone());
        r.register(
            "catalog_version",
            "Sequence number of the latest catalog change",
            metrics.catalog_version.clone(),
        );
        r.register("changes", "Catalog changes committed", metrics.changes.clone());
        r.register(
            "store_commit_seconds",
            "Time to commit one batch of writes to the store",
            metrics.store_commit_seconds.clone(),
        );
        r.register(
            "store_commit_failures",
            "Store commits that failed (their requests were refused)",
            metrics.store_commit_failures.clone(),
        );
        r.register(
            "store_unreadable_records",
            "Records found in the store at start-up that could not be used (left untouched)",
            metrics.store_unreadable_records.clone(),
        );
        r.register(
            "watch_snapshots",
            "Snapshots sent to watchers, by reason",
            metrics.watch_snapshots.clone(),
        );
        r.register(
            "invalid_requests",
            "Requests refused as invalid, by method",
            metrics.invalid_requests.clone(),
        );
        metrics
    }
}
