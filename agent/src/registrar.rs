//! The agent's side of the registrar: registering this node's endpoints, and one
//! Watch stream whose filter is the node's dependency set, resumed across reconnects.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use aether_proto::registrar::v1::registrar_client::RegistrarClient;
use aether_proto::registrar::v1::{RegisterEndpointRequest, UnregisterEndpointRequest, WatchRequest};
use aether_proto::registry::v1::{Endpoint, Health, Locality, PodInfo as PodRef, Port, Protocol};
use aether_proto::view::WatchView;
use backon::{ExponentialBuilder, Retryable};
use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::transport::{Channel, Endpoint as GrpcEndpoint};
use tonic::{Code, Status};

use crate::node::WatchedCatalog;
use crate::pod::{AppProtocol, LocalPod};

#[derive(Clone)]
pub struct Registrar {
    client: RegistrarClient<Channel>,
    node: String,
    locality: Locality,
}

impl Registrar {
    /// A lazily connected client: the agent serves its pods even while the registrar
    /// is away, and catches up when it returns.
    pub fn new(address: &str, node: String, locality: Locality) -> Result<Self, String> {
        let endpoint = GrpcEndpoint::from_shared(address.to_owned())
            .map_err(|e| format!("--registrar {address:?}: {e}"))?
            .connect_timeout(Duration::from_secs(2))
            .http2_keep_alive_interval(Duration::from_secs(20))
            .keep_alive_timeout(Duration::from_secs(10));
        Ok(Self {
            client: RegistrarClient::new(endpoint.connect_lazy()),
            node,
            locality,
        })
    }

    /// The endpoints a pod is registered as (one per pod IP).
    pub fn endpoints(&self, pod: &LocalPod) -> Vec<Endpoint> {
        let ports: Vec<Port> = pod
            .info
            .mesh_ports()
            .into_iter()
            .map(|(port, protocol)| Port {
                name: String::new(),
                port: u32::from(port),
                protocol: match protocol {
                    AppProtocol::Tcp => Protocol::Tcp,
                    AppProtocol::Http => Protocol::Http,
                    AppProtocol::Http2 => Protocol::Http2,
                    AppProtocol::Grpc => Protocol::Grpc,
                } as i32,
            })
            .collect();
        let health = if pod.info.terminating {
            Health::Draining
        } else {
            Health::Healthy
        };
        pod.ips
            .iter()
            .map(|ip| Endpoint {
                service: pod.info.service(),
                address: ip.to_string(),
                ports: ports.clone(),
                locality: Some(self.locality.clone()),
                weight: 1,
                health: health as i32,
                metadata: Default::default(),
                pod: Some(PodRef {
                    namespace: pod.info.namespace.clone(),
                    name: pod.info.name.clone(),
                    uid: pod.info.uid.clone(),
                    service_account: pod.info.service_account.clone(),
                }),
                node: self.node.clone(),
            })
            .collect()
    }

    /// Registers (or updates) every endpoint of `pod`, retrying while the registrar is
    /// unavailable. A pod without mesh ports serves nothing and is not registered.
    pub async fn register(&self, pod: &LocalPod) -> Result<(), Status> {
        for endpoint in self.endpoints(pod) {
            if endpoint.ports.is_empty() {
                continue;
            }
            let call = || {
                let mut client = self.client.clone();
                let endpoint = endpoint.clone();
                async move {
                    client
                        .register_endpoint(RegisterEndpointRequest {
                            endpoint: Some(endpoint),
                        })
                        .await
                }
            };
            call.retry(retry_policy()).when(retryable).await?;
        }
        Ok(())
    }

    pub async fn unregister(&self, service: &str, ips: &[IpAddr]) -> Result<(), Status> {
        for ip in ips {
            let call = || {
                let mut client = self.client.clone();
                let request = UnregisterEndpointRequest {
                    service: service.to_owned(),
                    address: ip.to_string(),
                };
                async move { client.unregister_endpoint(request).await }
            };
            call.retry(retry_policy()).when(retryable).await?;
        }
        Ok(())
    }

    /// Follows the catalog for the services in `filter` until `shutdown`, publishing
    /// each consistent view. Reconnects with backoff and resumes by version.
    pub async fn watch(
        self,
        mut filter: watch::Receiver<BTreeSet<String>>,
        catalog: watch::Sender<Arc<WatchedCatalog>>,
        connected: Gauge,
        shutdown: CancellationToken,
    ) {
        let mut view = WatchView::default();
        // The filters sent, by id, to know which one the view reflects.
        let mut sent: BTreeMap<u64, BTreeSet<String>> = BTreeMap::new();
        let mut next_id = 1u64;
        let mut backoff = Duration::from_millis(100);
        loop {
            let services = filter.borrow_and_update().clone();
            // Resume only a view built under this very filter; otherwise a snapshot.
            let resume = sent.get(&view.filter_id) == Some(&services);
            let filter_id = if resume { view.filter_id } else { next_id };
            next_id += 1;
            sent.insert(filter_id, services.clone());
            let (requests, outbox) = mpsc::channel(4);
            let first = WatchRequest {
                services: services.into_iter().collect(),
                wildcard: false,
                resume_from: if resume { view.resume_from(filter_id) } else { None },
                filter_id,
            };
            let _ = requests.send(first).await;
            let mut client = self.client.clone();
            let opened = tokio::select! {
                _ = shutdown.cancelled() => return,
                opened = client.watch(ReceiverStream::new(outbox)) => opened,
            };
            let mut stream = match opened {
                Ok(response) => response.into_inner(),
                Err(status) => {
                    tracing::warn!(%status, retry_in = ?backoff, "cannot open the registrar watch");
                    tokio::select! {
                        _ = shutdown.cancelled() => return,
                        _ = tokio::time::sleep(backoff) => {}
                    }
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                    continue;
                }
            };
            connected.set(1);
            loop {
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    changed = filter.changed() => {
                        if changed.is_err() {
                            return;
                        }
                        let services = filter.borrow_and_update().clone();
                        let filter_id = next_id;
                        next_id += 1;
                        sent.insert(filter_id, services.clone());
                        // Only ids the view may still reflect are worth keeping.
                        sent.retain(|id, _| *id >= view.filter_id);
                        let request = WatchRequest {
                            services: services.into_iter().collect(),
                            filter_id,
                            ..Default::default()
                        };
                        if requests.send(request).await.is_err() {
                            break;
                        }
                    }
                    message = stream.message() => match message {
                        Ok(Some(message)) => match view.apply(message) {
                            Ok(aether_proto::view::Applied::SnapshotChunk) => {}
                            Ok(_) => {
                                backoff = Duration::from_millis(100);
                                catalog.send_replace(Arc::new(WatchedCatalog {
                                    catalog: view.catalog.clone(),
                                    filter: sent.get(&view.filter_id).cloned().unwrap_or_default(),
                                }));
                            }
                            Err(error) => {
                                tracing::error!(%error, "the registrar sent an invalid watch message; reconnecting");
                                view = WatchView::default();
                                break;
                            }
                        },
                        Ok(None) => break,
                        Err(status) => {
                            tracing::warn!(%status, "registrar watch ended; reconnecting");
                            break;
                        }
                    },
                }
            }
            connected.set(0);
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(backoff) => {}
            }
            backoff = (backoff * 2).min(Duration::from_secs(5));
        }
    }
}

fn retry_policy() -> ExponentialBuilder {
    ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(100))
        .with_max_delay(Duration::from_secs(1))
        .with_max_times(5)
}

fn retryable(status: &Status) -> bool {
    matches!(
        status.code(),
        Code::Unavailable | Code::DeadlineExceeded | Code::Unknown
    )
}
