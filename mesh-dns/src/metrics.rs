//! mesh-dns's Prometheus instruments (`aether_mesh_dns_*`).

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;

use crate::forward::{ForwardMetrics, Transport};
use crate::handler::QueryResult;

type Labels = Vec<(String, String)>;

#[derive(Clone, Default)]
pub struct Metrics {
    queries: Family<Labels, Counter>,
    /// The query counters, resolved once: the hot path never hashes labels.
    by_result: Vec<[Counter; 2]>,
    /// Record file loads, by result (ok, error).
    pub reloads: Family<Labels, Counter>,
    pub reloads_ok: Counter,
    pub reloads_error: Counter,
    pub malformed_packets: Counter,
    pub malformed_files: Counter,
    pub generation: Gauge,
    pub records: Gauge,
    pub snapshot_age_seconds: Gauge<f64, AtomicU64>,
    pub snapshot_stale: Gauge,
    pub watch_up: Gauge,
    pub forward: ForwardMetrics,
}

impl Metrics {
    pub fn new() -> Self {
        let mut metrics = Self::default();
        for result in QueryResult::ALL {
            let counter = |transport: Transport| {
                metrics
                    .queries
                    .get_or_create(&vec![
                        ("result".to_owned(), result.as_str().to_owned()),
                        ("transport".to_owned(), transport.as_str().to_owned()),
                    ])
                    .clone()
            };
            let pair = [counter(Transport::Udp), counter(Transport::Tcp)];
            metrics.by_result.push(pair);
        }
        metrics.reloads_ok = metrics
            .reloads
            .get_or_create(&vec![("result".into(), "ok".into())])
            .clone();
        metrics.reloads_error = metrics
            .reloads
            .get_or_create(&vec![("result".into(), "error".into())])
            .clone();
        metrics
    }

    pub fn query(&self, result: QueryResult, transport: Transport) {
        let i = match transport {
            Transport::Udp => 0,
            Transport::Tcp => 1,
        };
        self.by_result[result.index()][i].inc();
        if result == QueryResult::Malformed {
            self.malformed_packets.inc();
        }
    }

    pub fn register(&self, registry: &mut Registry) {
        let r = registry.sub_registry_with_prefix("aether_mesh_dns");
        r.register(
            "queries",
            "DNS queries answered, by result and transport",
            self.queries.clone(),
        );
        r.register("reloads", "Record file loads, by result", self.reloads.clone());
        r.register(
            "malformed_packets",
            "Packets that were not parseable DNS queries",
            self.malformed_packets.clone(),
        );
        r.register(
            "malformed_files",
            "Record files rejected as malformed (the last good table was kept)",
            self.malformed_files.clone(),
        );
        r.register(
            "generation",
            "Generation of the record table served",
            self.generation.clone(),
        );
        r.register("records", "Services in the record table served", self.records.clone());
        r.register(
            "snapshot_age_seconds",
            "Seconds since the writer stamped the record file served",
            self.snapshot_age_seconds.clone(),
        );
        r.register(
            "snapshot_stale",
            "1 while the record file's stamp is older than --stale-after",
            self.snapshot_stale.clone(),
        );
        r.register(
            "watch_up",
            "1 while the record directory's inotify watch is up (else polling)",
            self.watch_up.clone(),
        );
        r.register(
            "upstream_errors",
            "Failed upstream attempts, by upstream and reason",
            self.forward.upstream_errors.clone(),
        );
        r.register(
            "tcp_retries",
            "Truncated UDP upstream answers asked again over TCP",
            self.forward.tcp_retries.clone(),
        );
    }
}
