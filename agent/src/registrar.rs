//! The agent's side of the registrar: registering this node's endpoints (the Watch
//! that follows the catalog is `catalog_watch`).
//!
//! Registrations are leases, not facts: the registrar removes the endpoints of a node
//! whose agent has not re-registered within its `--endpoint-ttl`, so a vanished node
//! leaves no ghosts. The agent therefore re-registers every endpoint it holds every
//! [`REFRESH_INTERVAL`] (an identical re-registration is a no-op for watchers).

use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::{Arc, Weak};
use std::time::Duration;

use aether_common::pod_endpoint::{self, PodEndpoints};
use aether_proto::registrar::v1::{RegisterEndpointRequest, UnregisterEndpointRequest};
use aether_proto::registry::v1::{Endpoint, Locality, PodInfo as PodRef};
use backon::{ExponentialBuilder, Retryable};
use tonic::{Code, Status};

use crate::pod::LocalPod;
use crate::registrar_link::RegistrarLink;

/// How often every registered endpoint is registered again (the registrar's default
/// endpoint TTL is 60 s, so three refreshes can be missed before anything expires).
pub const REFRESH_INTERVAL: Duration = Duration::from_secs(15);

/// How long an unregistration is repeated by the refresher: if the replica that took
/// it died before its store had it, another replica gets it within one interval.
const UNREGISTER_REPEAT: Duration = Duration::from_secs(120);

/// What this agent has registered, by (service, address), and what it recently
/// unregistered (with when).
#[derive(Default)]
struct Book {
    registered: BTreeMap<(String, String), Endpoint>,
    unregistered: BTreeMap<(String, String), std::time::Instant>,
}

type Registered = Mutex<Book>;
/// (service, address).
type Key = (String, String);

#[derive(Clone)]
pub struct Registrar {
    link: RegistrarLink,
    node: String,
    locality: Locality,
    registered: Arc<Registered>,
    /// Held by each refresh call and by unregistration, so a refresh never
    /// re-registers an endpoint just unregistered.
    gate: Arc<tokio::sync::Mutex<()>>,
}

impl Registrar {
    /// A lazily connected client: the agent serves its pods even while the registrar
    /// is away, and catches up when it returns.
    /// Must be called within a tokio runtime: it starts the refresher, which stops
    /// when the last clone of the returned value is dropped.
    pub fn new(link: RegistrarLink, node: String, locality: Locality) -> Self {
        Self::with_refresh(link, node, locality, REFRESH_INTERVAL)
    }

    fn with_refresh(link: RegistrarLink, node: String, locality: Locality, every: Duration) -> Self {
        let registrar = Self {
            link,
            node,
            locality,
            registered: Arc::default(),
            gate: Arc::default(),
        };
        tokio::spawn(refresh(
            registrar.link.clone(),
            Arc::downgrade(&registrar.registered),
            registrar.gate.clone(),
            every,
        ));
        registrar
    }

    /// The endpoints a pod is registered as (one per pod IP), by the rule the
    /// registrar's Kubernetes store derives them with.
    pub fn endpoints(&self, pod: &LocalPod) -> Vec<Endpoint> {
        let info = &pod.info;
        PodEndpoints {
            service: info.service(),
            ports: info.mesh_ports(),
            // Registered at CNI ADD, before the pod's containers run: the agent knows no
            // readiness, so a pod is HEALTHY until it terminates.
            health: pod_endpoint::health(info.terminating, true),
            pod: PodRef {
                namespace: info.namespace.clone(),
                name: info.name.clone(),
                uid: info.uid.clone(),
                service_account: info.service_account.clone(),
            },
            node: self.node.clone(),
            locality: Some(self.locality.clone()),
        }
        .at(&pod.ips)
    }

    /// Registers (or updates) every endpoint of `pod`, retrying while the registrar is
    /// unavailable. A pod without mesh ports serves nothing and is not registered.
    pub async fn register(&self, pod: &LocalPod) -> Result<(), Status> {
        for endpoint in self.endpoints(pod) {
            if endpoint.ports.is_empty() {
                continue;
            }
            // Remembered first: if the registrar is away now, the refresher registers it
            // when it returns.
            {
                let mut book = self.registered.lock();
                let key = (endpoint.service.clone(), endpoint.address.clone());
                book.unregistered.remove(&key);
                book.registered.insert(key, endpoint.clone());
            }
            let call = || {
                let mut client = self.link.client();
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
        let _gate = self.gate.lock().await;
        for ip in ips {
            {
                let mut book = self.registered.lock();
                let key = (service.to_owned(), ip.to_string());
                book.registered.remove(&key);
                book.unregistered.insert(key, std::time::Instant::now());
            }
            let call = || {
                let mut client = self.link.client();
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
}

/// Re-registers every remembered endpoint every `every`, until the registrar handle
/// is gone. Failures are logged and retried at the next tick.
async fn refresh(
    link: RegistrarLink,
    registered: Weak<Registered>,
    gate: Arc<tokio::sync::Mutex<()>>,
    every: Duration,
) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tick.tick().await;
        let Some(registered) = registered.upgrade() else { return };
        let (keys, gone): (Vec<Key>, Vec<Key>) = {
            let mut book = registered.lock();
            book.unregistered.retain(|_, at| at.elapsed() < UNREGISTER_REPEAT);
            (
                book.registered.keys().cloned().collect(),
                book.unregistered.keys().cloned().collect(),
            )
        };
        let mut failed = 0usize;
        for (service, address) in gone {
            let _gate = gate.lock().await;
            let key = (service, address);
            if !registered.lock().unregistered.contains_key(&key) {
                continue;
            }
            let mut client = link.client();
            let request = UnregisterEndpointRequest {
                service: key.0,
                address: key.1,
            };
            if let Err(status) = client.unregister_endpoint(request).await {
                failed += 1;
                tracing::debug!(%status, "repeating an unregistration failed");
            }
        }
        for key in keys {
            let _gate = gate.lock().await;
            // Still registered? (It may have been unregistered since the pass began.)
            let Some(endpoint) = registered.lock().registered.get(&key).cloned() else {
                continue;
            };
            let mut client = link.client();
            let request = RegisterEndpointRequest {
                endpoint: Some(endpoint),
            };
            if let Err(status) = client.register_endpoint(request).await {
                failed += 1;
                tracing::debug!(%status, "refreshing a registration failed");
            }
        }
        if failed > 0 {
            tracing::warn!(failed, retry_in = ?every, "could not refresh some registrations with the registrar");
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
        // Unauthenticated: no node certificate yet (the bootstrap is under way) or one
        // that just expired (its successor is on the way).
        Code::Unavailable | Code::DeadlineExceeded | Code::Unknown | Code::Unauthenticated
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use aether_proto::registrar::v1::WatchRequest;
    use aether_proto::registrar::v1::registrar_server::{Registrar as RegistrarApi, RegistrarServer};
    use aether_proto::registrar::v1::{
        ListEndpointsRequest, ListEndpointsResponse, ListServicesRequest, ListServicesResponse,
        RegisterEndpointResponse, UnregisterEndpointResponse, WatchResponse,
    };
    use tokio_stream::wrappers::TcpListenerStream;
    use tokio_util::sync::CancellationToken;

    /// Records every Register and Unregister it gets.
    #[derive(Clone, Default)]
    struct Fake(Arc<Mutex<Vec<String>>>);

    #[tonic::async_trait]
    impl RegistrarApi for Fake {
        async fn register_endpoint(
            &self,
            request: tonic::Request<RegisterEndpointRequest>,
        ) -> Result<tonic::Response<RegisterEndpointResponse>, Status> {
            let e = request.into_inner().endpoint.unwrap();
            self.0.lock().push(format!("+{}/{}", e.service, e.address));
            Ok(tonic::Response::new(RegisterEndpointResponse::default()))
        }
        async fn unregister_endpoint(
            &self,
            request: tonic::Request<UnregisterEndpointRequest>,
        ) -> Result<tonic::Response<UnregisterEndpointResponse>, Status> {
            let r = request.into_inner();
            self.0.lock().push(format!("-{}/{}", r.service, r.address));
            Ok(tonic::Response::new(UnregisterEndpointResponse::default()))
        }
        async fn list_services(
            &self,
            _: tonic::Request<ListServicesRequest>,
        ) -> Result<tonic::Response<ListServicesResponse>, Status> {
            Err(Status::unimplemented("fake"))
        }
        async fn list_endpoints(
            &self,
            _: tonic::Request<ListEndpointsRequest>,
        ) -> Result<tonic::Response<ListEndpointsResponse>, Status> {
            Err(Status::unimplemented("fake"))
        }
        type WatchStream = futures::stream::Empty<Result<WatchResponse, Status>>;
        async fn watch(
            &self,
            _: tonic::Request<tonic::Streaming<WatchRequest>>,
        ) -> Result<tonic::Response<Self::WatchStream>, Status> {
            Err(Status::unimplemented("fake"))
        }
    }

    #[tokio::test]
    async fn a_pod_is_one_endpoint_per_ip_on_this_node_draining_once_it_terminates() {
        use crate::pod::{ContainerPort, PodInfo};
        use aether_proto::registry::v1::{Health, Protocol};
        // Never dialled: endpoints() is local.
        let link = RegistrarLink::start("http://127.0.0.1:9", &Default::default(), CancellationToken::new()).unwrap();
        let locality = Locality {
            region: "eu".into(),
            zone: "eu-1a".into(),
            subzone: String::new(),
        };
        let registrar = Registrar::new(link, "node-1".into(), locality.clone());
        let port = |n, name, protocol| ContainerPort::from_spec("p", n, Some(name), Some(protocol)).unwrap();
        let mut pod = LocalPod {
            container_id: "c-1".into(),
            listener_sockets: Default::default(),
            netns: "/run/netns/x".into(),
            ips: vec!["10.0.0.7".parse().unwrap(), "fd00::7".parse().unwrap()],
            info: PodInfo {
                namespace: "shop".into(),
                name: "web-1".into(),
                uid: "u-1".into(),
                service_account: "web".into(),
                ports: vec![port(8080, "http", "TCP"), port(53, "dns", "UDP")],
                ..Default::default()
            },
        };
        let endpoints = registrar.endpoints(&pod);
        let addresses: Vec<_> = endpoints.iter().map(|e| e.address.as_str()).collect();
        assert_eq!(addresses, ["10.0.0.7", "fd00::7"]);
        let e = &endpoints[0];
        assert_eq!((e.service.as_str(), e.node.as_str()), ("shop/web", "node-1"));
        assert_eq!(e.locality, Some(locality));
        assert_eq!(e.health, Health::Healthy as i32);
        let ports: Vec<_> = e.ports.iter().map(|p| (p.port, p.protocol)).collect();
        assert_eq!(ports, [(8080, Protocol::Http as i32)]);
        let pod_ref = e.pod.as_ref().unwrap();
        assert_eq!(
            (pod_ref.name.as_str(), pod_ref.service_account.as_str()),
            ("web-1", "web")
        );
        pod.info.terminating = true;
        assert_eq!(registrar.endpoints(&pod)[1].health, Health::Draining as i32);
    }

    #[tokio::test]
    async fn registrations_are_refreshed_until_unregistered_or_dropped() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = format!("http://{}", listener.local_addr().unwrap());
        let fake = Fake::default();
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(RegistrarServer::new(fake.clone()))
                .serve_with_incoming(TcpListenerStream::new(listener)),
        );
        let link = RegistrarLink::start(&address, &Default::default(), CancellationToken::new()).unwrap();
        let registrar = Registrar::with_refresh(link, "node-1".into(), Locality::default(), Duration::from_millis(50));
        for ip in ["10.0.0.1", "10.0.0.2"] {
            let endpoint = Endpoint {
                service: "ns/web".into(),
                address: ip.into(),
                ..Default::default()
            };
            registrar
                .registered
                .lock()
                .registered
                .insert(("ns/web".into(), ip.into()), endpoint);
        }
        let count = |what: &str| fake.0.lock().iter().filter(|c| *c == what).count();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        let until = |f: &dyn Fn() -> bool| {
            assert!(std::time::Instant::now() < deadline, "timed out: {:?}", fake.0.lock());
            !f()
        };
        // Both endpoints are registered again and again.
        while until(&|| count("+ns/web/10.0.0.1") >= 3 && count("+ns/web/10.0.0.2") >= 3) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // An unregistered one is never refreshed again.
        registrar
            .unregister("ns/web", &["10.0.0.1".parse().unwrap()])
            .await
            .unwrap();
        let after = count("+ns/web/10.0.0.1");
        let two = count("+ns/web/10.0.0.2");
        while until(&|| count("+ns/web/10.0.0.2") >= two + 3) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(count("+ns/web/10.0.0.1"), after, "refreshed after unregistering");
        // The unregistration itself is repeated (another replica may need it).
        assert!(count("-ns/web/10.0.0.1") >= 2, "{:?}", fake.0.lock());
        // Dropping the last handle stops the refresher.
        drop(registrar);
        tokio::time::sleep(Duration::from_millis(120)).await;
        let total = fake.0.lock().len();
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(
            fake.0.lock().len(),
            total,
            "refreshing went on after the handle was dropped"
        );
    }
}
