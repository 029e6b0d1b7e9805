//! OTLP metrics push of a prometheus-client registry.
//!
//! Every `interval` the registry is encoded (the very bytes `/metrics` serves), parsed back
//! ([`super::exposition`]) and sent as one OTLP `ExportMetricsServiceRequest` over gRPC. Counters are monotonic
//! cumulative sums, gauges gauges, histograms explicit-bucket histograms; an OTLP metric's name is the OpenMetrics
//! family name (a Prometheus-side OTLP translator appends `_total` to monotonic sums again, giving back the
//! `/metrics` sample names).
//!
//! One export is in flight at most, bounded by the timeout; a failed export is dropped (the next one carries the
//! cumulative values), counted and logged at most once per [`LOG_EVERY`].

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use opentelemetry_proto::tonic::collector::metrics::v1::ExportMetricsServiceRequest;
use opentelemetry_proto::tonic::collector::metrics::v1::metrics_service_client::MetricsServiceClient;
use opentelemetry_proto::tonic::common::v1::{AnyValue, InstrumentationScope, KeyValue, any_value};
use opentelemetry_proto::tonic::metrics::v1::{
    AggregationTemporality, Gauge, Histogram, HistogramDataPoint, Metric, NumberDataPoint, ResourceMetrics,
    ScopeMetrics, Sum, metric, number_data_point,
};
use opentelemetry_proto::tonic::resource::v1::Resource;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family as CounterFamily;
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;
use tonic::transport::{Channel, Endpoint};

use super::exposition::{self, Family, Format, Kind};
use crate::quote::{clip, quote};

/// Failed exports are logged at most this often (the counter has them all).
pub const LOG_EVERY: Duration = Duration::from_secs(60);

/// Something the exporter refreshes before each export (e.g. the agent's copy of Envoy's stats).
pub type Refresh = Arc<dyn Fn() -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>> + Send + Sync>;

/// `aether_<component>_otlp_exports_total` and `_otlp_export_failures_total`, by signal.
#[derive(Clone, Debug, Default)]
pub struct ExportMetrics {
    pub exports: CounterFamily<[(&'static str, &'static str); 1], Counter>,
    pub failures: CounterFamily<[(&'static str, &'static str); 1], Counter>,
}

impl ExportMetrics {
    pub fn attempted(&self, signal: &'static str) {
        self.exports.get_or_create(&[("signal", signal)]).inc();
    }

    pub fn failed(&self, signal: &'static str) {
        self.failures.get_or_create(&[("signal", signal)]).inc();
    }
}

/// Logs a failure now and then, with how many were not logged.
#[derive(Debug)]
pub struct RateLimitedLog {
    last: Option<Instant>,
    suppressed: u64,
    every: Duration,
}

impl RateLimitedLog {
    pub fn new(every: Duration) -> Self {
        Self {
            last: None,
            suppressed: 0,
            every,
        }
    }

    /// Returns `Some(suppressed since the last logged one)` when this one should be logged.
    pub fn admit(&mut self) -> Option<u64> {
        let now = Instant::now();
        if self.last.is_some_and(|at| now.duration_since(at) < self.every) {
            self.suppressed += 1;
            return None;
        }
        self.last = Some(now);
        Some(std::mem::take(&mut self.suppressed))
    }
}

/// A string attribute.
pub fn string_attr(key: &str, value: &str) -> KeyValue {
    KeyValue {
        key: key.to_owned(),
        value: Some(AnyValue {
            value: Some(any_value::Value::StringValue(value.to_owned())),
        }),
        ..Default::default()
    }
}

fn nanos(at: SystemTime) -> u64 {
    at.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
}

fn attributes(labels: &[(String, String)]) -> Vec<KeyValue> {
    labels.iter().map(|(k, v)| string_attr(k, v)).collect()
}

fn number(value: f64) -> number_data_point::Value {
    if value.fract() == 0.0 && value.abs() < 9.0e15 {
        number_data_point::Value::AsInt(value as i64)
    } else {
        number_data_point::Value::AsDouble(value)
    }
}

/// Families (parsed exposition) → OTLP metrics with cumulative points since `start`.
pub fn to_otlp(families: &[Family], start: SystemTime, now: SystemTime) -> Vec<Metric> {
    let (start, now) = (nanos(start), nanos(now));
    let point = |labels: &[(String, String)], value: f64| NumberDataPoint {
        attributes: attributes(labels),
        start_time_unix_nano: start,
        time_unix_nano: now,
        value: Some(number(value)),
        ..Default::default()
    };
    let mut out = Vec::new();
    for family in families {
        let data = match family.kind {
            Kind::Counter => metric::Data::Sum(Sum {
                data_points: family
                    .samples
                    .iter()
                    .filter(|s| !s.name.ends_with("_created"))
                    .map(|s| point(&s.labels, s.value))
                    .collect(),
                aggregation_temporality: AggregationTemporality::Cumulative as i32,
                is_monotonic: true,
            }),
            Kind::Histogram => metric::Data::Histogram(Histogram {
                data_points: exposition::histogram_series(family)
                    .into_iter()
                    .map(|series| {
                        let mut previous = 0.0;
                        let bucket_counts = series
                            .buckets
                            .iter()
                            .map(|(_, cumulative)| {
                                let count = (cumulative - previous).max(0.0) as u64;
                                previous = *cumulative;
                                count
                            })
                            .collect();
                        HistogramDataPoint {
                            attributes: attributes(&series.labels),
                            start_time_unix_nano: start,
                            time_unix_nano: now,
                            count: series.count.unwrap_or(previous) as u64,
                            sum: series.sum,
                            bucket_counts,
                            explicit_bounds: series
                                .buckets
                                .iter()
                                .map(|(le, _)| *le)
                                .filter(|le| le.is_finite())
                                .collect(),
                            ..Default::default()
                        }
                    })
                    .collect(),
                aggregation_temporality: AggregationTemporality::Cumulative as i32,
            }),
            // Summaries are not used by Aether; the rest are point-in-time values.
            Kind::Summary => continue,
            _ => metric::Data::Gauge(Gauge {
                data_points: family.samples.iter().map(|s| point(&s.labels, s.value)).collect(),
            }),
        };
        out.push(Metric {
            name: family.name.clone(),
            description: family.help.clone(),
            unit: family.unit.clone(),
            data: Some(data),
            ..Default::default()
        });
    }
    out
}

#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    #[error("encoding the registry: {0}")]
    Encode(std::fmt::Error),
    #[error("the registry's own exposition is invalid: {0}")]
    Exposition(#[from] exposition::ExpositionError),
    #[error("OTLP export: {0}")]
    Rpc(#[from] tonic::Status),
    #[error("OTLP export timed out after {0:?}")]
    Timeout(Duration),
    #[error("--otlp-endpoint {}: {}", quote(.endpoint), clip(.message))]
    Endpoint { endpoint: String, message: String },
}

/// Builds the request for the registry's current values.
pub fn request(
    registry: &Registry,
    resource: &[KeyValue],
    start: SystemTime,
) -> Result<ExportMetricsServiceRequest, ExportError> {
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, registry).map_err(ExportError::Encode)?;
    let families = exposition::parse(&text, Format::OpenMetrics)?;
    Ok(ExportMetricsServiceRequest {
        resource_metrics: vec![ResourceMetrics {
            resource: Some(Resource {
                attributes: resource.to_vec(),
                ..Default::default()
            }),
            scope_metrics: vec![ScopeMetrics {
                scope: Some(InstrumentationScope {
                    name: "aether".into(),
                    version: env!("CARGO_PKG_VERSION").into(),
                    ..Default::default()
                }),
                metrics: to_otlp(&families, start, SystemTime::now()),
                ..Default::default()
            }],
            ..Default::default()
        }],
    })
}

/// A lazily connected channel: nothing here waits for the collector.
pub fn channel(endpoint: &str, timeout: Duration) -> Result<Channel, ExportError> {
    let bad = |message: String| ExportError::Endpoint {
        endpoint: endpoint.to_owned(),
        message,
    };
    let uri = if endpoint.contains("://") {
        endpoint.to_owned()
    } else {
        format!("http://{endpoint}")
    };
    if uri.starts_with("https://") {
        return Err(bad(
            "TLS to the collector is not implemented; use a local collector over http://".into(),
        ));
    }
    Ok(Endpoint::from_shared(uri)
        .map_err(|e| bad(e.to_string()))?
        .connect_timeout(timeout)
        .timeout(timeout)
        .connect_lazy())
}

/// The periodic push; see the module docs.
pub struct MetricsExporter {
    pub client: MetricsServiceClient<Channel>,
    pub registry: Arc<Registry>,
    pub resource: Vec<KeyValue>,
    pub interval: Duration,
    pub timeout: Duration,
    pub metrics: ExportMetrics,
    pub refresh: Option<Refresh>,
}

impl MetricsExporter {
    /// Exports every `interval` until `shutdown`, then once more (bounded) so the last values are not lost.
    pub async fn run(mut self, shutdown: CancellationToken) {
        let start = SystemTime::now();
        let mut log = RateLimitedLog::new(LOG_EVERY);
        let mut ticker = tokio::time::interval(self.interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        loop {
            let last = tokio::select! {
                _ = shutdown.cancelled() => true,
                _ = ticker.tick() => false,
            };
            if let Err(error) = self.export_once(start).await {
                self.metrics.failed("metrics");
                if let Some(suppressed) = log.admit() {
                    tracing::warn!(%error, suppressed, "OTLP metrics export failed (dropped; the next carries the totals)");
                }
            }
            if last {
                return;
            }
        }
    }

    pub async fn export_once(&mut self, start: SystemTime) -> Result<(), ExportError> {
        self.metrics.attempted("metrics");
        if let Some(refresh) = &self.refresh {
            let _ = tokio::time::timeout(self.timeout, refresh()).await;
        }
        let request = request(&self.registry, &self.resource, start)?;
        match tokio::time::timeout(self.timeout, self.client.export(request)).await {
            Err(_) => Err(ExportError::Timeout(self.timeout)),
            Ok(Err(status)) => Err(status.into()),
            Ok(Ok(response)) => {
                if let Some(partial) = response.into_inner().partial_success
                    && partial.rejected_data_points > 0
                {
                    tracing::debug!(rejected = partial.rejected_data_points, message = %partial.error_message,
                        "the collector rejected some data points");
                }
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::metrics::gauge::Gauge as PGauge;
    use prometheus_client::metrics::histogram::Histogram as PHistogram;

    #[test]
    fn registry_maps_to_otlp_kinds() {
        let mut registry = Registry::with_prefix("aether_test");
        let counter = CounterFamily::<[(&'static str, &'static str); 1], Counter>::default();
        counter.get_or_create(&[("type", "cds")]).inc_by(4);
        registry.register("pushes", "Pushes", counter);
        let gauge = PGauge::<i64>::default();
        gauge.set(-3);
        registry.register("pods", "Pods", gauge);
        let histogram = PHistogram::new([1.0, 2.0]);
        for v in [0.5, 1.5, 1.5, 9.0] {
            histogram.observe(v);
        }
        registry.register("lag_seconds", "Lag", histogram);
        let request = request(&registry, &[string_attr("service.name", "t")], SystemTime::now()).unwrap();
        let metrics = &request.resource_metrics[0].scope_metrics[0].metrics;
        assert_eq!(metrics.len(), 3);
        let Some(metric::Data::Sum(sum)) = &metrics[0].data else {
            panic!("{:?}", metrics[0])
        };
        assert_eq!(metrics[0].name, "aether_test_pushes");
        assert!(sum.is_monotonic);
        assert_eq!(sum.data_points[0].value, Some(number_data_point::Value::AsInt(4)));
        assert_eq!(sum.data_points[0].attributes, vec![string_attr("type", "cds")]);
        let Some(metric::Data::Gauge(g)) = &metrics[1].data else {
            panic!()
        };
        assert_eq!(g.data_points[0].value, Some(number_data_point::Value::AsInt(-3)));
        let Some(metric::Data::Histogram(h)) = &metrics[2].data else {
            panic!()
        };
        let p = &h.data_points[0];
        assert_eq!(p.explicit_bounds, vec![1.0, 2.0]);
        assert_eq!(p.bucket_counts, vec![1, 2, 1]);
        assert_eq!(p.count, 4);
        assert_eq!(p.sum, Some(12.5));
    }

    #[test]
    fn rate_limited_log_admits_then_counts() {
        let mut log = RateLimitedLog::new(Duration::from_secs(3600));
        assert_eq!(log.admit(), Some(0));
        assert_eq!(log.admit(), None);
        assert_eq!(log.admit(), None);
        log.last = Some(Instant::now() - Duration::from_secs(7200));
        assert_eq!(log.admit(), Some(2));
    }

    #[test]
    fn https_endpoints_are_refused_clearly() {
        let error = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(async { channel("https://collector:4317", Duration::from_secs(1)).unwrap_err() });
        assert!(error.to_string().contains("not implemented"), "{error}");
    }
}
