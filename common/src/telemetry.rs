//! Logging and OpenTelemetry export shared by every binary.
//!
//! Every binary flattens [`TelemetryConfig`] into its Config, calls [`init`] first in `main` (logging, and the
//! OpenTelemetry tracing layer when traces are on), registers [`MetricsPush`] in its prometheus-client registry and
//! spawns it once the registry is complete. The registry stays the single definition of every instrument: the OTLP
//! push encodes it exactly as `/metrics` does and converts the result ([`otlp`]).

pub mod exposition;
pub mod otlp;

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{Sampler, SdkTracerProvider, SpanData, SpanExporter};
use prometheus_client::registry::Registry;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing_subscriber::EnvFilter;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

use crate::quote::quote;
use otlp::{ExportMetrics, MetricsExporter, Refresh};

pub const ENV_OTEL_ENABLED: &str = "AETHER_OTEL_ENABLED";
pub const ENV_OTLP_ENDPOINT: &str = "AETHER_OTLP_ENDPOINT";
pub const ENV_OTLP_EXPORT_INTERVAL: &str = "AETHER_OTLP_EXPORT_INTERVAL";
pub const ENV_OTLP_TIMEOUT: &str = "AETHER_OTLP_TIMEOUT";
pub const ENV_TRACE_SAMPLE_RATE: &str = "AETHER_TRACE_SAMPLE_RATE";
/// The OpenTelemetry standard variable for the service name.
pub const ENV_SERVICE_NAME: &str = "OTEL_SERVICE_NAME";
pub const ENV_NODE_NAME: &str = "NODE_NAME";
/// A collector on the node (the usual DaemonSet), OTLP/gRPC port.
pub const DEFAULT_OTLP_ENDPOINT: &str = "http://127.0.0.1:4317";

/// How log lines are written to stderr.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

impl std::str::FromStr for LogFormat {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "text" => Ok(Self::Text),
            "json" => Ok(Self::Json),
            other => Err(format!("unknown log format {} (expected text or json)", quote(other))),
        }
    }
}

/// OpenTelemetry flags, the same in every binary (`#[command(flatten)]`).
#[derive(Clone, Debug, clap::Args)]
pub struct TelemetryConfig {
    /// Push metrics (and traces, when --trace-sample-rate > 0) to --otlp-endpoint over OTLP/gRPC.
    #[arg(long, env = ENV_OTEL_ENABLED)]
    pub otel_enabled: bool,

    /// The OTLP/gRPC collector (http://host:port).
    #[arg(long, env = ENV_OTLP_ENDPOINT, default_value = DEFAULT_OTLP_ENDPOINT)]
    pub otlp_endpoint: String,

    /// How often metrics are pushed.
    #[arg(long, env = ENV_OTLP_EXPORT_INTERVAL, default_value = "15s", value_parser = crate::duration::parse)]
    pub otlp_export_interval: Duration,

    /// Longest one export may take (connect included) before it is dropped and counted as failed.
    #[arg(long, env = ENV_OTLP_TIMEOUT, default_value = "5s", value_parser = crate::duration::parse)]
    pub otlp_timeout: Duration,

    /// Fraction of new traces sampled (0 to 1; parents' decisions are followed). 0 exports no traces.
    #[arg(long, env = ENV_TRACE_SAMPLE_RATE, default_value_t = 0.0, value_parser = parse_sample_rate)]
    pub trace_sample_rate: f64,

    /// Resource attribute service.name (default: the binary's name).
    #[arg(long, env = ENV_SERVICE_NAME)]
    pub otel_service_name: Option<String>,

    /// Resource attribute k8s.node.name.
    #[arg(long, env = ENV_NODE_NAME)]
    pub otel_node_name: Option<String>,
}

impl Default for TelemetryConfig {
    fn default() -> Self {
        Self {
            otel_enabled: false,
            otlp_endpoint: DEFAULT_OTLP_ENDPOINT.into(),
            otlp_export_interval: Duration::from_secs(15),
            otlp_timeout: Duration::from_secs(5),
            trace_sample_rate: 0.0,
            otel_service_name: None,
            otel_node_name: None,
        }
    }
}

/// `--trace-sample-rate`: a number in [0, 1].
pub fn parse_sample_rate(text: &str) -> Result<f64, String> {
    let rate: f64 = text
        .trim()
        .parse()
        .map_err(|_| format!("{} is not a number (expected 0 to 1)", quote(text)))?;
    if !(0.0..=1.0).contains(&rate) {
        return Err(format!("{rate} is outside 0 to 1"));
    }
    Ok(rate)
}

/// Who is reporting: `component` names the instruments (`aether_<component>_…`), `binary` is the default
/// service.name.
#[derive(Clone, Copy, Debug)]
pub struct Component {
    pub component: &'static str,
    pub binary: &'static str,
    pub version: &'static str,
}

impl Component {
    /// The OTLP resource attributes of this process.
    pub fn resource(&self, config: &TelemetryConfig) -> Vec<opentelemetry_proto::tonic::common::v1::KeyValue> {
        let mut out = vec![
            otlp::string_attr(
                "service.name",
                config.otel_service_name.as_deref().unwrap_or(self.binary),
            ),
            otlp::string_attr("service.namespace", "aether"),
            otlp::string_attr("service.version", self.version),
            otlp::string_attr("aether.component", self.component),
        ];
        if let Some(node) = config.otel_node_name.as_deref().filter(|n| !n.is_empty()) {
            out.push(otlp::string_attr("k8s.node.name", node));
        }
        out
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    #[error("building the OTLP trace exporter for {endpoint}: {message}")]
    Traces { endpoint: String, message: String },
    #[error(transparent)]
    Export(#[from] otlp::ExportError),
}

/// The process's export counters (one process is one component); [`MetricsPush::register`] puts them in the registry.
pub fn export_metrics() -> &'static ExportMetrics {
    static METRICS: OnceLock<ExportMetrics> = OnceLock::new();
    METRICS.get_or_init(ExportMetrics::default)
}

/// Installs the global tracing subscriber. The filter comes from `RUST_LOG` (default `info`). Calling it twice is
/// harmless (the second call is ignored).
pub fn init_logging(format: LogFormat) {
    install(format, None::<tracing_subscriber::layer::Identity>);
}

fn install<L>(format: LogFormat, extra: Option<L>)
where
    L: tracing_subscriber::Layer<tracing_subscriber::Registry> + Send + Sync + 'static,
{
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let registry = tracing_subscriber::registry().with(extra);
    let _ = match format {
        LogFormat::Text => registry
            // Colours only on a terminal: a container's log (a pipe) gets plain text.
            .with(
                tracing_subscriber::fmt::layer()
                    .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
                    .with_writer(std::io::stderr),
            )
            .with(filter)
            .try_init(),
        LogFormat::Json => registry
            .with(tracing_subscriber::fmt::layer().json().with_writer(std::io::stderr))
            .with(filter)
            .try_init(),
    };
}

/// Shuts the trace pipeline down (bounded flush) when dropped.
#[derive(Default)]
pub struct TraceGuard(Option<SdkTracerProvider>);

impl Drop for TraceGuard {
    fn drop(&mut self) {
        if let Some(provider) = self.0.take() {
            let _ = provider.shutdown_with_timeout(Duration::from_secs(2));
        }
    }
}

/// Logging, plus spans exported over OTLP when `--otel-enabled` and `--trace-sample-rate` > 0. Call from within
/// the tokio runtime (the gRPC channel lives on it); nothing here waits for the collector.
pub fn init(format: LogFormat, config: &TelemetryConfig, component: &Component) -> Result<TraceGuard, TelemetryError> {
    if !config.otel_enabled || config.trace_sample_rate <= 0.0 {
        init_logging(format);
        return Ok(TraceGuard(None));
    }
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_tonic()
        .with_endpoint(config.otlp_endpoint.clone())
        .with_timeout(config.otlp_timeout)
        .build()
        .map_err(|e| TelemetryError::Traces {
            endpoint: config.otlp_endpoint.clone(),
            message: e.to_string(),
        })?;
    let resource = opentelemetry_sdk::Resource::builder()
        .with_service_name(
            config
                .otel_service_name
                .clone()
                .unwrap_or_else(|| component.binary.to_owned()),
        )
        .with_attributes(
            [
                ("service.namespace", "aether".to_owned()),
                ("service.version", component.version.to_owned()),
                ("aether.component", component.component.to_owned()),
            ]
            .into_iter()
            .chain(config.otel_node_name.clone().map(|n| ("k8s.node.name", n)))
            .map(|(k, v)| opentelemetry::KeyValue::new(k, v)),
        )
        .build();
    let provider = SdkTracerProvider::builder()
        .with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(
            config.trace_sample_rate,
        ))))
        .with_resource(resource)
        .with_batch_exporter(CountingExporter {
            inner: exporter,
            log: parking_lot::Mutex::new(otlp::RateLimitedLog::new(otlp::LOG_EVERY)),
        })
        .build();
    let tracer = provider.tracer(component.binary);
    install(format, Some(tracing_opentelemetry::layer().with_tracer(tracer)));
    Ok(TraceGuard(Some(provider)))
}

/// Counts and rate-limit-logs span export outcomes (the SDK drops what fails; its queue is bounded).
#[derive(Debug)]
struct CountingExporter<E> {
    inner: E,
    log: parking_lot::Mutex<otlp::RateLimitedLog>,
}

impl<E: SpanExporter> SpanExporter for CountingExporter<E> {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        export_metrics().attempted("traces");
        let result = self.inner.export(batch).await;
        if let Err(error) = &result {
            export_metrics().failed("traces");
            let admitted = self.log.lock().admit();
            if let Some(suppressed) = admitted {
                // Not through tracing: a span export error must not make spans.
                eprintln!("OTLP trace export failed ({suppressed} not logged since): {error}");
            }
        }
        result
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn set_resource(&mut self, resource: &opentelemetry_sdk::Resource) {
        self.inner.set_resource(resource);
    }
}

/// The OTLP metrics push of one registry: [`MetricsPush::register`] before the registry is shared,
/// [`MetricsPush::spawn`] after.
pub struct MetricsPush {
    config: TelemetryConfig,
    component: Component,
}

impl MetricsPush {
    /// Registers `aether_<component>_otlp_exports_total` / `_otlp_export_failures_total`.
    pub fn register(config: &TelemetryConfig, component: Component, registry: &mut Registry) -> Self {
        let metrics = export_metrics();
        let r = registry.sub_registry_with_prefix(format!("aether_{}", component.component));
        r.register(
            "otlp_exports",
            "OTLP exports attempted, by signal (metrics, traces)",
            metrics.exports.clone(),
        );
        r.register(
            "otlp_export_failures",
            "OTLP exports that failed or timed out, by signal (their data was dropped)",
            metrics.failures.clone(),
        );
        Self {
            config: config.clone(),
            component,
        }
    }

    /// Starts pushing when `--otel-enabled` (returns `None` otherwise). `refresh` runs (bounded) before each export.
    pub fn spawn(
        self,
        registry: Arc<Registry>,
        refresh: Option<Refresh>,
        shutdown: CancellationToken,
    ) -> Result<Option<JoinHandle<()>>, TelemetryError> {
        if !self.config.otel_enabled {
            return Ok(None);
        }
        let channel = otlp::channel(&self.config.otlp_endpoint, self.config.otlp_timeout)?;
        let exporter = MetricsExporter {
            client:
                opentelemetry_proto::tonic::collector::metrics::v1::metrics_service_client::MetricsServiceClient::new(
                    channel,
                ),
            registry,
            resource: self.component.resource(&self.config),
            interval: self.config.otlp_export_interval,
            timeout: self.config.otlp_timeout,
            metrics: export_metrics().clone(),
            refresh,
        };
        tracing::info!(endpoint = %self.config.otlp_endpoint, interval = ?self.config.otlp_export_interval,
            "pushing metrics over OTLP");
        Ok(Some(tokio::spawn(exporter.run(shutdown))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        telemetry: TelemetryConfig,
    }

    #[test]
    fn flags_parse_and_bad_rates_name_the_flag() {
        let cli = Cli::try_parse_from([
            "x",
            "--otel-enabled",
            "--otlp-endpoint",
            "http://10.0.0.1:4317",
            "--trace-sample-rate",
            "0.25",
            "--otlp-export-interval",
            "2s",
        ])
        .unwrap();
        assert!(cli.telemetry.otel_enabled);
        assert_eq!(cli.telemetry.trace_sample_rate, 0.25);
        assert_eq!(cli.telemetry.otlp_export_interval, Duration::from_secs(2));
        for bad in ["1.5", "-0.1", "lots"] {
            let error = Cli::try_parse_from(["x", &format!("--trace-sample-rate={bad}")])
                .err()
                .unwrap()
                .to_string();
            assert!(error.contains("--trace-sample-rate"), "{error}");
        }
    }

    #[test]
    fn resource_names_the_process() {
        let config = TelemetryConfig {
            otel_node_name: Some("n1".into()),
            ..Default::default()
        };
        let component = Component {
            component: "agent",
            binary: "aether-agent",
            version: "1.2.3",
        };
        let resource = component.resource(&config);
        let get = |k: &str| {
            resource.iter().find(|kv| kv.key == k).and_then(|kv| match &kv.value {
                Some(opentelemetry_proto::tonic::common::v1::AnyValue {
                    value: Some(opentelemetry_proto::tonic::common::v1::any_value::Value::StringValue(s)),
                }) => Some(s.clone()),
                _ => None,
            })
        };
        assert_eq!(get("service.name").as_deref(), Some("aether-agent"));
        assert_eq!(get("service.version").as_deref(), Some("1.2.3"));
        assert_eq!(get("k8s.node.name").as_deref(), Some("n1"));
    }
}
