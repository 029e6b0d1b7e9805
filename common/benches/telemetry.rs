//! What one OTLP metrics push costs the process: encoding a registry the size of a busy agent's (OpenMetrics text),
//! parsing it back and building the OTLP request. Prints figures; `harness = false`.

use std::time::{Duration, Instant, SystemTime};

use aether_common::telemetry::otlp;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

fn registry(series: usize) -> Registry {
    let mut registry = Registry::with_prefix("aether_agent");
    let counters = Family::<Vec<(String, String)>, Counter>::default();
    let histograms = Family::<Vec<(String, String)>, Histogram>::new_with_constructor(|| {
        Histogram::new(exponential_buckets(0.000_25, 2.0, 16))
    });
    for i in 0..series {
        let labels = vec![
            ("source_workload".to_owned(), format!("demo/src-{}", i % 20)),
            ("destination_service".to_owned(), format!("demo/dst-{i}")),
            ("response_code".to_owned(), "200".to_owned()),
        ];
        counters.get_or_create(&labels).inc_by(i as u64);
        histograms.get_or_create(&labels).observe(0.001 * i as f64);
    }
    registry.register("requests", "Requests", counters);
    registry.register("request_duration_seconds", "Latency", histograms);
    for name in ["pods", "clusters", "dependencies", "xds_streams"] {
        let gauge = Gauge::<i64>::default();
        gauge.set(42);
        registry.register(name, "A gauge", gauge);
    }
    registry
}

fn main() {
    let resource = [otlp::string_attr("service.name", "bench")];
    for series in [10, 100, 1_000] {
        let registry = registry(series);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        let rounds = (20_000 / series).max(20);
        let start = Instant::now();
        let mut points = 0;
        for _ in 0..rounds {
            let request = otlp::request(&registry, &resource, SystemTime::now()).unwrap();
            points += request.resource_metrics[0].scope_metrics[0].metrics.len();
        }
        let per: Duration = start.elapsed() / rounds as u32;
        println!(
            "otlp push of {series:>5} labelled series ({:>7} bytes of exposition, {} metrics): {per:?} per push (encode + parse + convert)",
            text.len(),
            points / rounds
        );
    }
}
