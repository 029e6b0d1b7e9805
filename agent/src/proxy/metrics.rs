//! The supervisor's Prometheus instruments (`aether_proxy_*`).

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::{Registry, Unit};

type Labels = [(&'static str, &'static str); 1];

#[derive(Clone)]
pub struct ProxyMetrics {
    /// The restart epoch of the Envoy this supervisor owns.
    pub epoch: Gauge,
    /// 1 while the owned epoch is LIVE.
    pub live: Gauge,
    pub hot_restarts: Family<Labels, Counter>,
    pub hot_restart_failures: Family<Labels, Counter>,
    pub validation_failures: Family<Labels, Counter>,
    pub crashes: Counter,
    pub restarts: Counter,
    pub takeovers: Counter,
    pub handoff_seconds: Histogram,
}

impl Default for ProxyMetrics {
    fn default() -> Self {
        Self {
            epoch: Gauge::default(),
            live: Gauge::default(),
            hot_restarts: Family::default(),
            hot_restart_failures: Family::default(),
            validation_failures: Family::default(),
            crashes: Counter::default(),
            restarts: Counter::default(),
            takeovers: Counter::default(),
            // 10 ms … ~80 s.
            handoff_seconds: Histogram::new(exponential_buckets(0.01, 2.0, 14)),
        }
    }
}

impl ProxyMetrics {
    /// Registers under `registry` (give it the `aether_proxy` prefix).
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "epoch",
            "Restart epoch of the Envoy this supervisor owns",
            self.epoch.clone(),
        );
        registry.register("live", "1 while the owned Envoy epoch is LIVE", self.live.clone());
        registry.register(
            "hot_restarts",
            "Hot restarts that reached LIVE, by trigger",
            self.hot_restarts.clone(),
        );
        registry.register(
            "hot_restart_failures",
            "Hot restarts abandoned (the old epoch kept serving), by reason",
            self.hot_restart_failures.clone(),
        );
        registry.register(
            "validation_failures",
            "New bootstraps or binaries refused before any restart, by reason",
            self.validation_failures.clone(),
        );
        registry.register(
            "envoy_crashes",
            "Unexpected exits of the owned Envoy",
            self.crashes.clone(),
        );
        registry.register(
            "envoy_restarts",
            "Envoys started again after a crash",
            self.restarts.clone(),
        );
        registry.register(
            "takeovers",
            "Predecessor supervisors' Envoys taken over by hot restart",
            self.takeovers.clone(),
        );
        registry.register_with_unit(
            "handoff_duration",
            "From a restart's trigger to the new epoch LIVE",
            Unit::Seconds,
            self.handoff_seconds.clone(),
        );
    }
}
