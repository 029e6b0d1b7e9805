//! A small OTLP/gRPC collector for tests: it serves the metrics and trace export services on a free loopback port
//! and keeps every request, so a test can assert on names, attributes and values that a binary or Envoy pushed.

use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use opentelemetry_proto::tonic::collector::logs::v1::logs_service_server::{LogsService, LogsServiceServer};
use opentelemetry_proto::tonic::collector::logs::v1::{ExportLogsServiceRequest, ExportLogsServiceResponse};
use opentelemetry_proto::tonic::collector::metrics::v1::metrics_service_server::{
    MetricsService, MetricsServiceServer,
};
use opentelemetry_proto::tonic::collector::metrics::v1::{ExportMetricsServiceRequest, ExportMetricsServiceResponse};
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{TraceService, TraceServiceServer};
use opentelemetry_proto::tonic::collector::trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse};
use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue, any_value};
use opentelemetry_proto::tonic::metrics::v1::{metric, number_data_point};
use tokio::task::JoinHandle;
use tokio_stream::wrappers::TcpListenerStream;

#[derive(Default)]
struct Received {
    metrics: Vec<ExportMetricsServiceRequest>,
    traces: Vec<ExportTraceServiceRequest>,
    logs: Vec<ExportLogsServiceRequest>,
}

#[derive(Clone, Default)]
struct Sink(Arc<Mutex<Received>>);

#[tonic::async_trait]
impl MetricsService for Sink {
    async fn export(
        &self,
        request: tonic::Request<ExportMetricsServiceRequest>,
    ) -> Result<tonic::Response<ExportMetricsServiceResponse>, tonic::Status> {
        self.0.lock().metrics.push(request.into_inner());
        Ok(tonic::Response::new(ExportMetricsServiceResponse::default()))
    }
}

#[tonic::async_trait]
impl TraceService for Sink {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        self.0.lock().traces.push(request.into_inner());
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

#[tonic::async_trait]
impl LogsService for Sink {
    async fn export(
        &self,
        request: tonic::Request<ExportLogsServiceRequest>,
    ) -> Result<tonic::Response<ExportLogsServiceResponse>, tonic::Status> {
        self.0.lock().logs.push(request.into_inner());
        Ok(tonic::Response::new(ExportLogsServiceResponse::default()))
    }
}

/// One log record as received: its body (a string) and attributes.
#[derive(Clone, Debug, PartialEq)]
pub struct LogRecord {
    pub body: String,
    pub attributes: BTreeMap<String, String>,
}

/// One data point as received: the resource's and the point's attributes (strings; other values rendered), and its
/// value (sums and gauges: the number; histograms: the count, with `sum` and `buckets`).
#[derive(Clone, Debug, PartialEq)]
pub struct Point {
    pub metric: String,
    pub resource: BTreeMap<String, String>,
    pub attributes: BTreeMap<String, String>,
    pub value: f64,
    pub sum: Option<f64>,
    pub monotonic: bool,
}

/// The running receiver; dropping it stops serving (the port then refuses connections).
pub struct OtlpReceiver {
    addr: SocketAddr,
    sink: Sink,
    task: JoinHandle<()>,
}

fn render(value: &Option<AnyValue>) -> String {
    match value.as_ref().and_then(|v| v.value.as_ref()) {
        Some(any_value::Value::StringValue(s)) => s.clone(),
        Some(any_value::Value::IntValue(i)) => i.to_string(),
        Some(any_value::Value::DoubleValue(d)) => d.to_string(),
        Some(any_value::Value::BoolValue(b)) => b.to_string(),
        other => format!("{other:?}"),
    }
}

fn attributes(kvs: &[KeyValue]) -> BTreeMap<String, String> {
    kvs.iter().map(|kv| (kv.key.clone(), render(&kv.value))).collect()
}

impl OtlpReceiver {
    /// Serves on 127.0.0.1:<free port> until dropped.
    pub async fn start() -> OtlpReceiver {
        Self::start_on("127.0.0.1:0".parse().unwrap()).await
    }

    /// Serves on `addr` (e.g. the port a collector that was down comes back on).
    pub async fn start_on(addr: SocketAddr) -> OtlpReceiver {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .unwrap_or_else(|e| panic!("binding the OTLP receiver to {addr}: {e}"));
        let addr = listener.local_addr().unwrap();
        let sink = Sink::default();
        let server = tonic::transport::Server::builder()
            .add_service(MetricsServiceServer::new(sink.clone()))
            .add_service(TraceServiceServer::new(sink.clone()))
            .add_service(LogsServiceServer::new(sink.clone()))
            .serve_with_incoming(TcpListenerStream::new(listener));
        let task = tokio::spawn(async move {
            if let Err(error) = server.await {
                eprintln!("OTLP receiver failed: {error}");
            }
        });
        OtlpReceiver { addr, sink, task }
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://127.0.0.1:<port>`, for `--otlp-endpoint`.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// How many metric export requests arrived.
    pub fn metric_requests(&self) -> usize {
        self.sink.0.lock().metrics.len()
    }

    /// Every log record received, oldest first.
    pub fn logs(&self) -> Vec<LogRecord> {
        let received = self.sink.0.lock();
        received
            .logs
            .iter()
            .flat_map(|r| &r.resource_logs)
            .flat_map(|rl| &rl.scope_logs)
            .flat_map(|sl| &sl.log_records)
            .map(|record| LogRecord {
                body: render(&record.body),
                attributes: attributes(&record.attributes),
            })
            .collect()
    }

    /// Every span received, as (resource service.name, span name).
    pub fn spans(&self) -> Vec<(String, String)> {
        let received = self.sink.0.lock();
        let mut out = Vec::new();
        for request in &received.traces {
            for rs in &request.resource_spans {
                let resource = rs
                    .resource
                    .as_ref()
                    .map(|r| attributes(&r.attributes))
                    .unwrap_or_default();
                let service = resource.get("service.name").cloned().unwrap_or_default();
                for ss in &rs.scope_spans {
                    for span in &ss.spans {
                        out.push((service.clone(), span.name.clone()));
                    }
                }
            }
        }
        out
    }

    /// Every data point of `metric` received, oldest first.
    pub fn points(&self, metric: &str) -> Vec<Point> {
        let received = self.sink.0.lock();
        let mut out = Vec::new();
        for request in &received.metrics {
            for rm in &request.resource_metrics {
                let resource = rm
                    .resource
                    .as_ref()
                    .map(|r| attributes(&r.attributes))
                    .unwrap_or_default();
                for sm in &rm.scope_metrics {
                    for m in sm.metrics.iter().filter(|m| m.name == metric) {
                        let number = |v: &Option<number_data_point::Value>| match v {
                            Some(number_data_point::Value::AsInt(i)) => *i as f64,
                            Some(number_data_point::Value::AsDouble(d)) => *d,
                            None => f64::NAN,
                        };
                        let point = |attrs: &[KeyValue], value: f64, sum: Option<f64>, monotonic: bool| Point {
                            metric: m.name.clone(),
                            resource: resource.clone(),
                            attributes: attributes(attrs),
                            value,
                            sum,
                            monotonic,
                        };
                        match &m.data {
                            Some(metric::Data::Sum(s)) => out.extend(
                                s.data_points
                                    .iter()
                                    .map(|p| point(&p.attributes, number(&p.value), None, s.is_monotonic)),
                            ),
                            Some(metric::Data::Gauge(g)) => out.extend(
                                g.data_points
                                    .iter()
                                    .map(|p| point(&p.attributes, number(&p.value), None, false)),
                            ),
                            Some(metric::Data::Histogram(h)) => out.extend(
                                h.data_points
                                    .iter()
                                    .map(|p| point(&p.attributes, p.count as f64, p.sum, false)),
                            ),
                            _ => {}
                        }
                    }
                }
            }
        }
        out
    }

    /// The latest point of `metric` whose attributes include all of `attrs`.
    pub fn latest(&self, metric: &str, attrs: &[(&str, &str)]) -> Option<Point> {
        self.points(metric).into_iter().rev().find(|p| {
            attrs
                .iter()
                .all(|(k, v)| p.attributes.get(*k).map(String::as_str) == Some(*v))
        })
    }

    /// Every metric name received.
    pub fn metric_names(&self) -> Vec<String> {
        let received = self.sink.0.lock();
        let mut names: Vec<String> = received
            .metrics
            .iter()
            .flat_map(|r| &r.resource_metrics)
            .flat_map(|rm| &rm.scope_metrics)
            .flat_map(|sm| &sm.metrics)
            .map(|m| m.name.clone())
            .collect();
        names.sort();
        names.dedup();
        names
    }

    /// Polls until `check` returns `Some`, or panics after `timeout` with `what` and the names received.
    pub async fn wait_for<T>(&self, timeout: Duration, what: &str, mut check: impl FnMut(&Self) -> Option<T>) -> T {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(found) = check(self) {
                return found;
            }
            assert!(
                Instant::now() < deadline,
                "OTLP receiver: no {what} within {timeout:?}; {} metric requests, names: {:?}",
                self.metric_requests(),
                self.metric_names()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

impl Drop for OtlpReceiver {
    fn drop(&mut self) {
        self.task.abort();
    }
}
