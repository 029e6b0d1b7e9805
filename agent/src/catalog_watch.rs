//! The agent's one way of following the registrar's catalog: a Watch stream that
//! reconnects with backoff, resumes from its version (no snapshot when the registrar
//! still holds the history) or else from what its view holds (another replica sends
//! only what differs), moves to a new connection when the node certificate
//! rotates, and publishes each consistent view. The node follows its dependency set
//! and the authorization policies of its pods' namespaces with it (the filter changes
//! in-stream); the DNS record writer follows every service's record (`services_only`).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use aether_proto::registrar::v1::{Version, WatchRequest};
use aether_proto::view::{Applied, CatalogView, WatchView};
use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;

use crate::registrar_link::RegistrarLink;

const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(5);

/// What to follow.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Interest {
    /// These services with their endpoints, and the authorization policies of these
    /// namespaces (the mesh-wide ones come with any); a change is sent on the live
    /// stream.
    Services {
        services: BTreeSet<String>,
        policy_namespaces: BTreeSet<String>,
    },
    /// Every service's record and no endpoints (nor policies).
    ServicesOnly,
}

impl Interest {
    /// What a node follows: the services it depends on, and the policies of the
    /// namespaces its pods are in (`namespaces` may repeat).
    pub fn node<'a>(services: BTreeSet<String>, namespaces: impl IntoIterator<Item = &'a str>) -> Interest {
        Interest::Services {
            services,
            policy_namespaces: namespaces.into_iter().map(str::to_owned).collect(),
        }
    }
}

impl Default for Interest {
    /// Nothing yet: no service, no namespace.
    fn default() -> Self {
        Interest::Services {
            services: BTreeSet::new(),
            policy_namespaces: BTreeSet::new(),
        }
    }
}

/// A consistent view of the catalog, and the service filter it reflects (empty for
/// [`Interest::ServicesOnly`]).
#[derive(Debug, Default)]
pub struct WatchedCatalog {
    pub catalog: CatalogView,
    pub filter: BTreeSet<String>,
    /// The registrar's version the view is at, and when the stream last moved it (a
    /// change, or the registrar's progress note every few seconds).
    pub version: Option<Version>,
    pub updated: Option<SystemTime>,
}

/// Follows `interest` until `shutdown`, publishing every consistent view to `views`;
/// `connected` is 1 while a stream is up.
pub async fn follow(
    link: RegistrarLink,
    interest: watch::Receiver<Interest>,
    views: watch::Sender<Arc<WatchedCatalog>>,
    connected: Gauge,
    shutdown: CancellationToken,
) {
    let rotated = link.rotated();
    let mut follower = Follower {
        link,
        interest,
        views,
        connected,
        stream: Stream::default(),
        backoff: BACKOFF_MIN,
        rotated,
        interest_open: true,
        rotation_open: true,
    };
    loop {
        let end = tokio::select! {
            _ = shutdown.cancelled() => return,
            end = follower.one_stream() => end,
        };
        if end == End::Rotated {
            tracing::info!("resuming the registrar watch on a new connection (new node certificate)");
            continue;
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(follower.backoff) => {}
            // A (new) node certificate: try again at once.
            changed = follower.rotated.changed(), if follower.rotation_open => follower.rotation_open = changed.is_ok(),
        }
        follower.backoff = (follower.backoff * 2).min(BACKOFF_MAX);
    }
}

/// [`follow`]'s state across streams.
struct Follower {
    link: RegistrarLink,
    interest: watch::Receiver<Interest>,
    views: watch::Sender<Arc<WatchedCatalog>>,
    connected: Gauge,
    stream: Stream,
    backoff: Duration,
    rotated: watch::Receiver<tonic::transport::Channel>,
    /// A closed interest channel means the interest is fixed from now on; a closed
    /// rotation channel, that the connection never changes (a plaintext test link).
    interest_open: bool,
    rotation_open: bool,
}

impl Follower {
    /// Opens one stream (resuming when it can) and follows it until it ends.
    async fn one_stream(&mut self) -> End {
        self.rotated.mark_unchanged();
        let wanted = self.interest.borrow_and_update().clone();
        let (requests, outbox) = mpsc::channel(4);
        let _ = requests.send(self.stream.first_request(wanted)).await;
        let mut client = self.link.client();
        match client.watch(ReceiverStream::new(outbox)).await {
            Ok(response) => {
                self.connected.set(1);
                let end = self.messages(response.into_inner(), requests).await;
                self.connected.set(0);
                end
            }
            Err(status) => {
                tracing::warn!(%status, retry_in = ?self.backoff, "cannot open the registrar watch");
                End::Failed
            }
        }
    }

    /// Applies the stream's messages and sends filter changes on it, until it ends or
    /// the connection is replaced.
    async fn messages(
        &mut self,
        mut messages: tonic::Streaming<aether_proto::registrar::v1::WatchResponse>,
        requests: mpsc::Sender<WatchRequest>,
    ) -> End {
        loop {
            tokio::select! {
                changed = self.rotated.changed(), if self.rotation_open => {
                    if changed.is_err() {
                        self.rotation_open = false;
                        continue;
                    }
                    return End::Rotated;
                }
                changed = self.interest.changed(), if self.interest_open => {
                    if changed.is_err() {
                        self.interest_open = false;
                        continue;
                    }
                    let interest = self.interest.borrow_and_update().clone();
                    if interest == Interest::ServicesOnly {
                        // Switching to services-only needs a new stream.
                        return End::Rotated;
                    }
                    if requests.send(self.stream.filter_change(interest)).await.is_err() {
                        return End::Failed;
                    }
                }
                message = messages.message() => match message {
                    Ok(Some(message)) => match self.stream.view.apply(message) {
                        Ok(Applied::SnapshotChunk) => {}
                        Ok(_) => {
                            self.backoff = BACKOFF_MIN;
                            self.views.send_replace(Arc::new(self.stream.published()));
                        }
                        Err(error) => {
                            tracing::error!(%error, "the registrar sent an invalid watch message; starting over");
                            self.stream = Stream::default();
                            return End::Failed;
                        }
                    },
                    Ok(None) => return End::Failed,
                    Err(status) => {
                        tracing::warn!(%status, "registrar watch ended; resuming");
                        return End::Failed;
                    }
                },
            }
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum End {
    /// The connection was replaced: resume at once.
    Rotated,
    /// The stream failed or could not open: resume after a backoff.
    Failed,
}

/// What one logical watch keeps across streams: the view and the filters sent, by id,
/// to know which one the view reflects and whether it may be resumed.
#[derive(Default)]
struct Stream {
    view: WatchView,
    sent: BTreeMap<u64, Interest>,
    next_id: u64,
}

impl Stream {
    fn next_id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    /// The request opening a stream: resume the view from its version only if it was
    /// built under this very interest; in every case say what the view holds, so a
    /// replica that cannot resume it (another one, or one whose history moved on) sends
    /// what differs instead of a snapshot.
    fn first_request(&mut self, interest: Interest) -> WatchRequest {
        let resume = self.sent.get(&self.view.filter_id) == Some(&interest);
        let filter_id = if resume { self.view.filter_id } else { self.next_id() };
        self.sent.insert(filter_id, interest.clone());
        let resume_from = if resume { self.view.resume_from(filter_id) } else { None };
        WatchRequest {
            resume_from,
            held: self.view.held(),
            ..request(interest, filter_id)
        }
    }

    /// The in-stream request changing the filter.
    fn filter_change(&mut self, interest: Interest) -> WatchRequest {
        let filter_id = self.next_id();
        self.sent.insert(filter_id, interest.clone());
        // Only ids the view may still reflect are worth keeping.
        let current = self.view.filter_id;
        self.sent.retain(|id, _| *id >= current);
        request(interest, filter_id)
    }

    fn published(&self) -> WatchedCatalog {
        let filter = match self.sent.get(&self.view.filter_id) {
            Some(Interest::Services { services, .. }) => services.clone(),
            _ => BTreeSet::new(),
        };
        WatchedCatalog {
            catalog: self.view.catalog.clone(),
            filter,
            version: self.view.version.clone(),
            updated: Some(SystemTime::now()),
        }
    }
}

/// The request asking for `interest` under `filter_id`.
fn request(interest: Interest, filter_id: u64) -> WatchRequest {
    match interest {
        Interest::Services {
            services,
            policy_namespaces,
        } => WatchRequest {
            services: services.into_iter().collect(),
            policy_namespaces: policy_namespaces.into_iter().collect(),
            filter_id,
            ..Default::default()
        },
        Interest::ServicesOnly => WatchRequest {
            services_only: true,
            filter_id,
            ..Default::default()
        },
    }
}

#[cfg(test)]
mod tests {
    use aether_proto::registrar::v1::registrar_server::{Registrar, RegistrarServer};
    use aether_proto::registrar::v1::{
        Delta, ListEndpointsRequest, ListEndpointsResponse, ListServicesRequest, ListServicesResponse,
        RegisterEndpointRequest, RegisterEndpointResponse, Snapshot, SnapshotComplete, UnregisterEndpointRequest,
        UnregisterEndpointResponse, Version, WatchResponse, watch_response,
    };
    use aether_proto::registry::v1::Service;
    use tokio_stream::wrappers::TcpListenerStream;
    use tonic::{Request, Response, Status, Streaming};

    use super::*;

    /// One opened Watch as the test sees it: the client's requests, and where its
    /// responses go.
    type OpenedStream = (Streaming<WatchRequest>, mpsc::Sender<Result<WatchResponse, Status>>);

    /// A registrar whose Watch streams the test drives.
    #[derive(Clone)]
    struct Fake(mpsc::Sender<OpenedStream>);

    #[tonic::async_trait]
    impl Registrar for Fake {
        async fn register_endpoint(
            &self,
            _: Request<RegisterEndpointRequest>,
        ) -> Result<Response<RegisterEndpointResponse>, Status> {
            Err(Status::unimplemented("fake"))
        }
        async fn unregister_endpoint(
            &self,
            _: Request<UnregisterEndpointRequest>,
        ) -> Result<Response<UnregisterEndpointResponse>, Status> {
            Err(Status::unimplemented("fake"))
        }
        async fn list_services(
            &self,
            _: Request<ListServicesRequest>,
        ) -> Result<Response<ListServicesResponse>, Status> {
            Err(Status::unimplemented("fake"))
        }
        async fn list_endpoints(
            &self,
            _: Request<ListEndpointsRequest>,
        ) -> Result<Response<ListEndpointsResponse>, Status> {
            Err(Status::unimplemented("fake"))
        }
        type WatchStream = ReceiverStream<Result<WatchResponse, Status>>;
        async fn watch(
            &self,
            request: Request<Streaming<WatchRequest>>,
        ) -> Result<Response<Self::WatchStream>, Status> {
            let (out, outbox) = mpsc::channel(16);
            self.0.send((request.into_inner(), out)).await.unwrap();
            Ok(Response::new(ReceiverStream::new(outbox)))
        }
    }

    type Opened = mpsc::Receiver<OpenedStream>;

    async fn fake_registrar() -> (RegistrarLink, Opened) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let (opened, streams) = mpsc::channel(4);
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(RegistrarServer::new(Fake(opened)))
                .serve_with_incoming(TcpListenerStream::new(listener)),
        );
        let link = RegistrarLink::start(&url, &Default::default(), CancellationToken::new()).unwrap();
        (link, streams)
    }

    fn version(seq: u64) -> Option<Version> {
        Some(Version {
            instance: "i1".into(),
            seq,
        })
    }

    fn snapshot(services: &[&str], seq: u64, filter_id: u64) -> Vec<WatchResponse> {
        let services = services
            .iter()
            .map(|key| {
                let (namespace, name) = key.split_once('/').unwrap();
                Service {
                    namespace: namespace.into(),
                    name: name.into(),
                    vip: "240.240.0.1".into(),
                    kubernetes: None,
                    external: None,
                }
            })
            .collect();
        vec![
            WatchResponse {
                event: Some(watch_response::Event::Snapshot(Snapshot {
                    reset: true,
                    services,
                    ..Default::default()
                })),
            },
            WatchResponse {
                event: Some(watch_response::Event::SnapshotComplete(SnapshotComplete {
                    version: version(seq),
                    filter_id,
                })),
            },
        ]
    }

    fn services(services: &BTreeSet<String>, namespaces: &[&str]) -> Interest {
        Interest::Services {
            services: services.clone(),
            policy_namespaces: namespaces.iter().map(|n| n.to_string()).collect(),
        }
    }

    async fn next_view(views: &mut watch::Receiver<Arc<WatchedCatalog>>) -> Arc<WatchedCatalog> {
        tokio::time::timeout(Duration::from_secs(10), views.changed())
            .await
            .expect("a view in time")
            .unwrap();
        views.borrow_and_update().clone()
    }

    #[tokio::test]
    async fn a_view_follows_the_filter_and_a_broken_stream_resumes_from_its_version() {
        let (link, mut streams) = fake_registrar().await;
        let deps: BTreeSet<String> = ["shop/cart".to_owned()].into();
        let (interest_tx, interest) = watch::channel(services(&deps, &["shop"]));
        let (views_tx, mut views) = watch::channel(Arc::new(WatchedCatalog::default()));
        let connected = Gauge::default();
        let shutdown = CancellationToken::new();
        tokio::spawn(follow(link, interest, views_tx, connected.clone(), shutdown.clone()));

        // First stream: a snapshot for the filter.
        let (mut requests, out) = streams.recv().await.unwrap();
        let first = requests.message().await.unwrap().unwrap();
        assert_eq!(first.services, ["shop/cart"]);
        assert_eq!(first.policy_namespaces, ["shop"]);
        assert_eq!(first.resume_from, None, "nothing to resume yet");
        assert_eq!(first.held, None, "nothing held yet");
        for m in snapshot(&["shop/cart"], 7, first.filter_id) {
            out.send(Ok(m)).await.unwrap();
        }
        let view = next_view(&mut views).await;
        assert!(view.catalog.services.contains_key("shop/cart"));
        assert_eq!(view.filter, deps);
        assert_eq!(connected.get(), 1);

        // The filter grows: sent on the live stream with a new id, published once answered.
        let more: BTreeSet<String> = ["shop/cart".to_owned(), "shop/pay".to_owned()].into();
        interest_tx.send(services(&more, &["shop", "pay"])).unwrap();
        let change = requests.message().await.unwrap().unwrap();
        assert_eq!(change.services, ["shop/cart", "shop/pay"]);
        assert_eq!(change.policy_namespaces, ["pay", "shop"]);
        assert_ne!(change.filter_id, first.filter_id);
        out.send(Ok(WatchResponse {
            event: Some(watch_response::Event::Delta(Delta {
                version: version(8),
                changes: Vec::new(),
                filter_id: change.filter_id,
            })),
        }))
        .await
        .unwrap();
        assert_eq!(next_view(&mut views).await.filter, more);

        // The stream breaks: the next one resumes the same filter from version 8.
        out.send(Err(Status::unavailable("registrar restarting")))
            .await
            .unwrap();
        drop(out);
        let (mut requests, _out) = streams.recv().await.unwrap();
        let resumed = requests.message().await.unwrap().unwrap();
        assert_eq!(resumed.services, ["shop/cart", "shop/pay"]);
        assert_eq!(resumed.policy_namespaces, ["pay", "shop"]);
        assert_eq!(resumed.filter_id, change.filter_id);
        assert_eq!(resumed.resume_from, version(8));
        let held = resumed.held.expect("a reconnect says what the view holds");
        let held: Vec<_> = held.services.iter().map(|h| h.key.as_str()).collect();
        assert_eq!(held, ["shop/cart"], "what the view holds, not what the filter names");
        shutdown.cancel();
    }

    #[tokio::test]
    async fn a_services_only_watch_asks_for_every_record_and_resumes_the_same_way() {
        let (link, mut streams) = fake_registrar().await;
        let (_interest, interest) = watch::channel(Interest::ServicesOnly);
        let (views_tx, mut views) = watch::channel(Arc::new(WatchedCatalog::default()));
        let shutdown = CancellationToken::new();
        tokio::spawn(follow(link, interest, views_tx, Gauge::default(), shutdown.clone()));

        let (mut requests, out) = streams.recv().await.unwrap();
        let first = requests.message().await.unwrap().unwrap();
        assert!(first.services_only && first.services.is_empty() && first.policy_namespaces.is_empty());
        for m in snapshot(&["a/x", "b/y"], 3, first.filter_id) {
            out.send(Ok(m)).await.unwrap();
        }
        let view = next_view(&mut views).await;
        assert_eq!(view.catalog.services.len(), 2);
        assert!(view.filter.is_empty());

        drop(out);
        let (mut requests, _out) = streams.recv().await.unwrap();
        let resumed = requests.message().await.unwrap().unwrap();
        assert!(resumed.services_only);
        assert_eq!(resumed.resume_from, version(3));
        shutdown.cancel();
    }

    #[tokio::test]
    async fn a_change_of_policy_namespaces_alone_is_a_filter_change_on_the_live_stream() {
        let (link, mut streams) = fake_registrar().await;
        let deps: BTreeSet<String> = ["shop/cart".to_owned()].into();
        let (interest_tx, interest) = watch::channel(services(&deps, &["shop"]));
        let (views_tx, mut views) = watch::channel(Arc::new(WatchedCatalog::default()));
        let shutdown = CancellationToken::new();
        tokio::spawn(follow(link, interest, views_tx, Gauge::default(), shutdown.clone()));
        let (mut requests, out) = streams.recv().await.unwrap();
        let first = requests.message().await.unwrap().unwrap();
        for m in snapshot(&["shop/cart"], 4, first.filter_id) {
            out.send(Ok(m)).await.unwrap();
        }
        next_view(&mut views).await;

        // The last pod of `shop` left, one of `pay` came: same services, new namespaces.
        interest_tx.send(services(&deps, &["pay"])).unwrap();
        let change = requests.message().await.unwrap().unwrap();
        assert_eq!(change.services, ["shop/cart"]);
        assert_eq!(change.policy_namespaces, ["pay"]);
        assert_ne!(
            change.filter_id, first.filter_id,
            "a new filter, so the view says which it reflects"
        );
        // No pod left: no namespace, so only mesh-wide policies are sent.
        interest_tx.send(services(&deps, &[])).unwrap();
        let last = requests.message().await.unwrap().unwrap();
        assert!(last.policy_namespaces.is_empty());
        assert_ne!(last.filter_id, change.filter_id);
        shutdown.cancel();
    }
}
