//! xDS for the node's Envoy: our own snapshot cache, the delta and state-of-the-world
//! ADS servers on a Unix socket, and the generators that turn pods and catalog into
//! Envoy resources.

pub mod cache;
pub mod delta;
pub mod resources;
pub mod sotw;
pub mod stream;
#[cfg(test)]
mod testing;

use std::pin::Pin;
use std::sync::Arc;

use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_server::AggregatedDiscoveryService;
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
};
use futures::Stream;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::{Registry, Unit};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use cache::Cache;
use delta::DeltaStream;
use sotw::SotwStream;

/// Type URLs.
pub const CLUSTER: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
pub const ENDPOINT: &str = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";
pub const LISTENER: &str = "type.googleapis.com/envoy.config.listener.v3.Listener";
pub const ROUTE: &str = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration";
pub const SECRET: &str = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret";
/// VHDS: an outbound table's virtual hosts, named `<table>/<virtual host>` (see
/// `delta` for when they are sent).
pub const VIRTUAL_HOST: &str = "type.googleapis.com/envoy.config.route.v3.VirtualHost";

/// Push order: clusters before their endpoints, secrets before the listeners that use
/// them, listeners before the routes they name (Envoy warms what waits on a dependency),
/// a table before its virtual hosts.
pub const PUSH_ORDER: [&str; 6] = [CLUSTER, ENDPOINT, SECRET, LISTENER, ROUTE, VIRTUAL_HOST];

type Labels = [(&'static str, &'static str); 1];
type Histograms = Family<Labels, Histogram, fn() -> Histogram>;

/// The ADS server's instruments, `aether_agent_xds_*`.
#[derive(Clone)]
pub struct XdsMetrics {
    pub streams: Gauge,
    pub pushes: Family<Labels, Counter>,
    /// Resources (added, updated or removed) and their encoded bytes in those responses.
    pub resources_pushed: Family<Labels, Counter>,
    pub bytes_pushed: Family<Labels, Counter>,
    pub acks: Family<Labels, Counter>,
    pub nacks: Family<Labels, Counter>,
    /// From sending a response to Envoy's ACK or NACK of it, by type.
    pub push_duration: Histograms,
}

fn push_histogram() -> Histogram {
    // 0.25 ms to ~8 s.
    Histogram::new(exponential_buckets(0.000_25, 2.0, 16))
}

impl Default for XdsMetrics {
    fn default() -> Self {
        Self {
            streams: Gauge::default(),
            pushes: Family::default(),
            resources_pushed: Family::default(),
            bytes_pushed: Family::default(),
            acks: Family::default(),
            nacks: Family::default(),
            push_duration: Family::new_with_constructor(push_histogram),
        }
    }
}

impl XdsMetrics {
    pub fn register(&self, registry: &mut Registry) {
        registry.register("xds_streams", "Connected ADS streams", self.streams.clone());
        registry.register("xds_pushes", "xDS responses sent, by type", self.pushes.clone());
        registry.register(
            "xds_resources_pushed",
            "Resources sent to Envoy (added, updated or removed), by type",
            self.resources_pushed.clone(),
        );
        registry.register_with_unit(
            "xds_pushed",
            "Encoded bytes of the resources sent to Envoy, by type",
            Unit::Bytes,
            self.bytes_pushed.clone(),
        );
        registry.register("xds_acks", "xDS responses Envoy accepted, by type", self.acks.clone());
        registry.register("xds_nacks", "xDS responses Envoy rejected, by type", self.nacks.clone());
        registry.register_with_unit(
            "xds_push_duration",
            "Time from sending an xDS response to Envoy's ACK or NACK of it, by type",
            Unit::Seconds,
            self.push_duration.clone(),
        );
    }

    /// A response of `type_url` carrying `resources` resources of `bytes` encoded bytes was sent.
    pub fn pushed(&self, type_url: &str, resources: usize, bytes: usize) {
        let labels = [("type", short(type_url))];
        self.pushes.get_or_create(&labels).inc();
        self.resources_pushed.get_or_create(&labels).inc_by(resources as u64);
        self.bytes_pushed.get_or_create(&labels).inc_by(bytes as u64);
    }

    /// Envoy answered a response sent `elapsed` ago.
    pub fn answered(&self, type_url: &str, elapsed: std::time::Duration, accepted: bool) {
        let labels = [("type", short(type_url))];
        if accepted {
            self.acks.get_or_create(&labels).inc();
        } else {
            self.nacks.get_or_create(&labels).inc();
        }
        self.push_duration.get_or_create(&labels).observe(elapsed.as_secs_f64());
    }
}

/// Called with the names a stream asked for that the snapshot does not serve (e.g. an
/// on-demand cluster), so the agent can look them up.
pub type OnDemand = Arc<dyn Fn(&str, &[String]) + Send + Sync>;

#[derive(Clone)]
pub struct Hooks {
    pub metrics: XdsMetrics,
    pub on_demand: OnDemand,
}

/// The ADS gRPC service (delta and state of the world) over one cache.
pub struct AdsServer {
    cache: Cache,
    hooks: Hooks,
}

impl AdsServer {
    pub fn new(cache: Cache, hooks: Hooks) -> Self {
        Self { cache, hooks }
    }
}

type BoxStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

/// Responses buffered per stream between its task and the transport.
const OUTBOX: usize = 16;

#[tonic::async_trait]
impl AggregatedDiscoveryService for AdsServer {
    type StreamAggregatedResourcesStream = BoxStream<DiscoveryResponse>;
    type DeltaAggregatedResourcesStream = BoxStream<DeltaDiscoveryResponse>;

    async fn stream_aggregated_resources(
        &self,
        request: Request<Streaming<DiscoveryRequest>>,
    ) -> Result<Response<Self::StreamAggregatedResourcesStream>, Status> {
        let (out, outbox) = mpsc::channel(OUTBOX);
        tokio::spawn(stream::serve::<SotwStream, _>(
            self.cache.clone(),
            self.hooks.clone(),
            request.into_inner(),
            out,
        ));
        Ok(Response::new(Box::pin(ReceiverStream::new(outbox))))
    }

    async fn delta_aggregated_resources(
        &self,
        request: Request<Streaming<DeltaDiscoveryRequest>>,
    ) -> Result<Response<Self::DeltaAggregatedResourcesStream>, Status> {
        let (out, outbox) = mpsc::channel(OUTBOX);
        tokio::spawn(stream::serve::<DeltaStream, _>(
            self.cache.clone(),
            self.hooks.clone(),
            request.into_inner(),
            out,
        ));
        Ok(Response::new(Box::pin(ReceiverStream::new(outbox))))
    }
}

/// `Cluster` from a type URL, for metric labels.
pub fn short(type_url: &str) -> &'static str {
    match type_url {
        CLUSTER => "Cluster",
        ENDPOINT => "ClusterLoadAssignment",
        LISTENER => "Listener",
        ROUTE => "RouteConfiguration",
        SECRET => "Secret",
        VIRTUAL_HOST => "VirtualHost",
        _ => "other",
    }
}
