//! A fake SPIRE agent: the Delegated Identity API (server generated from the proto the
//! `spire-api` crate ships) on a Unix socket, issuing real X.509 SVIDs made with rcgen.
//! Scriptable per test: rotate, revoke, issue a different SPIFFE ID, break every stream
//! and refuse connections, come back.
//!
//! Subscriptions are answered from the `k8s:ns:` and `k8s:sa:` selectors (the SVID names
//! `spiffe://<td>/ns/<ns>/sa/<sa>`); `k8s:pod-uid:` identifies the pod for revocation.

use parking_lot::Mutex;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use spire_api::pb::spire::api::agent::delegatedidentity::v1::{
    FetchJwtsviDsRequest, FetchJwtsviDsResponse, SubscribeToJwtBundlesRequest, SubscribeToJwtBundlesResponse,
    SubscribeToX509BundlesRequest, SubscribeToX509BundlesResponse, SubscribeToX509sviDsRequest,
    SubscribeToX509sviDsResponse, X509svidWithKey,
};
use spire_api::pb::spire::api::types::{Spiffeid, X509svid};
use tokio::net::UnixListener;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_stream::wrappers::{ReceiverStream, UnixListenerStream};
use tonic::{Request, Response, Status};

use crate::identity::{Leaf, TRUST_DOMAIN, TestCa};

#[allow(clippy::all, clippy::pedantic)]
mod pb {
    tonic::include_proto!("spire.api.agent.delegatedidentity.v1");
}

use pb::delegated_identity_server::{DelegatedIdentity, DelegatedIdentityServer};

type Sender<T> = mpsc::Sender<Result<T, Status>>;

struct Subscriber {
    uid: String,
    ns: String,
    sa: String,
    tx: Sender<SubscribeToX509sviDsResponse>,
}

#[derive(Default)]
struct State {
    subscribers: Vec<Subscriber>,
    bundle_subscribers: Vec<Sender<SubscribeToX509BundlesResponse>>,
    /// Pod uid → the SPIFFE ID to issue instead of the selectors' one.
    overrides: HashMap<String, String>,
    revoked: BTreeSet<String>,
    /// Extra trust domains' CA certificates (federation), DER.
    federated: BTreeMap<String, Vec<u8>>,
    /// Every SVID sent: (SPIFFE ID, leaf DER, when).
    issued: Vec<(String, Vec<u8>, Instant)>,
    subscribe_calls: u64,
}

struct Shared {
    /// While set, every call fails with UNAVAILABLE (the agent is "down").
    down: std::sync::atomic::AtomicBool,
    ca: Arc<TestCa>,
    ttl: Mutex<Duration>,
    state: Mutex<State>,
}

pub struct FakeSpire {
    pub socket: PathBuf,
    shared: Arc<Shared>,
    server: Mutex<Option<JoinHandle<()>>>,
}

impl Shared {
    fn leaf_for(&self, sub_uid: &str, ns: &str, sa: &str, state: &State) -> Option<Leaf> {
        if state.revoked.contains(sub_uid) {
            return None;
        }
        let id = state
            .overrides
            .get(sub_uid)
            .cloned()
            .unwrap_or_else(|| crate::identity::spiffe_id(ns, sa));
        Some(self.ca.issue(&id, *self.ttl.lock()))
    }

    fn response(&self, leaf: Option<Leaf>, state: &mut State) -> SubscribeToX509sviDsResponse {
        let Some(leaf) = leaf else {
            return SubscribeToX509sviDsResponse::default();
        };
        state
            .issued
            .push((leaf.spiffe_id.clone(), leaf.cert_der.clone(), Instant::now()));
        let path = leaf
            .spiffe_id
            .strip_prefix(&format!("spiffe://{TRUST_DOMAIN}"))
            .unwrap_or_default()
            .to_owned();
        SubscribeToX509sviDsResponse {
            x509_svids: vec![X509svidWithKey {
                x509_svid: Some(X509svid {
                    cert_chain: vec![leaf.cert_der.clone().into()],
                    id: Some(Spiffeid {
                        trust_domain: TRUST_DOMAIN.into(),
                        path,
                    }),
                    expires_at: leaf.not_after.duration_since(std::time::UNIX_EPOCH).unwrap().as_secs() as i64,
                    hint: String::new(),
                }),
                x509_svid_key: leaf.key_der.clone().into(),
            }],
            federates_with: Vec::new(),
        }
    }

    fn bundles(&self, state: &State) -> SubscribeToX509BundlesResponse {
        let mut ca_certificates = std::collections::HashMap::new();
        ca_certificates.insert(format!("spiffe://{TRUST_DOMAIN}"), self.ca.cert_der.clone().into());
        for (td, der) in &state.federated {
            ca_certificates.insert(format!("spiffe://{td}"), der.clone().into());
        }
        SubscribeToX509BundlesResponse { ca_certificates }
    }

    /// Sends each live subscriber matching `which` a fresh answer.
    fn push(&self, which: impl Fn(&Subscriber) -> bool) {
        let mut state = self.state.lock();
        state.subscribers.retain(|s| !s.tx.is_closed());
        let targets: Vec<(usize, String, String, String)> = state
            .subscribers
            .iter()
            .enumerate()
            .filter(|(_, s)| which(s))
            .map(|(i, s)| (i, s.uid.clone(), s.ns.clone(), s.sa.clone()))
            .collect();
        for (i, uid, ns, sa) in targets {
            let leaf = self.leaf_for(&uid, &ns, &sa, &state);
            let response = self.response(leaf, &mut state);
            let _ = state.subscribers[i].tx.try_send(Ok(response));
        }
    }
}

struct Service(Arc<Shared>);

type Stream<T> = Pin<Box<dyn tokio_stream::Stream<Item = Result<T, Status>> + Send>>;

#[tonic::async_trait]
impl DelegatedIdentity for Service {
    type SubscribeToX509SVIDsStream = Stream<SubscribeToX509sviDsResponse>;
    type SubscribeToX509BundlesStream = Stream<SubscribeToX509BundlesResponse>;
    type SubscribeToJWTBundlesStream = Stream<SubscribeToJwtBundlesResponse>;

    async fn subscribe_to_x509svi_ds(
        &self,
        request: Request<SubscribeToX509sviDsRequest>,
    ) -> Result<Response<Self::SubscribeToX509SVIDsStream>, Status> {
        if self.0.down.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(Status::unavailable("fake SPIRE agent is down"));
        }
        let request = request.into_inner();
        let selector = |prefix: &str| {
            request
                .selectors
                .iter()
                .find(|s| s.r#type == "k8s" && s.value.starts_with(prefix))
                .map(|s| s.value[prefix.len()..].to_owned())
        };
        let (Some(ns), Some(sa)) = (selector("ns:"), selector("sa:")) else {
            return Err(Status::invalid_argument("k8s:ns and k8s:sa selectors are required"));
        };
        let uid = selector("pod-uid:").unwrap_or_default();
        let (tx, rx) = mpsc::channel(16);
        let mut state = self.0.state.lock();
        state.subscribe_calls += 1;
        let leaf = self.0.leaf_for(&uid, &ns, &sa, &state);
        let first = self.0.response(leaf, &mut state);
        tx.try_send(Ok(first)).expect("fresh channel");
        state.subscribers.push(Subscriber { uid, ns, sa, tx });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn subscribe_to_x509_bundles(
        &self,
        _: Request<SubscribeToX509BundlesRequest>,
    ) -> Result<Response<Self::SubscribeToX509BundlesStream>, Status> {
        if self.0.down.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(Status::unavailable("fake SPIRE agent is down"));
        }
        let (tx, rx) = mpsc::channel(16);
        let mut state = self.0.state.lock();
        tx.try_send(Ok(self.0.bundles(&state))).expect("fresh channel");
        state.bundle_subscribers.push(tx);
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn fetch_jwtsvi_ds(
        &self,
        _: Request<FetchJwtsviDsRequest>,
    ) -> Result<Response<FetchJwtsviDsResponse>, Status> {
        Err(Status::unimplemented("the fake SPIRE agent issues X.509 SVIDs only"))
    }

    async fn subscribe_to_jwt_bundles(
        &self,
        _: Request<SubscribeToJwtBundlesRequest>,
    ) -> Result<Response<Self::SubscribeToJWTBundlesStream>, Status> {
        Err(Status::unimplemented("the fake SPIRE agent issues X.509 SVIDs only"))
    }
}

impl FakeSpire {
    /// Serves on `<dir>/spire-admin.sock`, issuing SVIDs valid for `ttl` signed by `ca`.
    pub fn start(dir: &Path, ca: Arc<TestCa>, ttl: Duration) -> Self {
        let spire = Self {
            socket: dir.join("spire-admin.sock"),
            shared: Arc::new(Shared {
                down: std::sync::atomic::AtomicBool::new(false),
                ca,
                ttl: Mutex::new(ttl),
                state: Mutex::default(),
            }),
            server: Mutex::new(None),
        };
        spire.serve();
        spire
    }

    fn serve(&self) {
        let _ = std::fs::remove_file(&self.socket);
        let listener = UnixListener::bind(&self.socket).expect("binding the fake SPIRE socket");
        let service = DelegatedIdentityServer::new(Service(self.shared.clone()));
        let task = tokio::spawn(async move {
            let _ = tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming(UnixListenerStream::new(listener))
                .await;
        });
        *self.server.lock() = Some(task);
    }

    pub fn ca(&self) -> &TestCa {
        &self.shared.ca
    }

    pub fn set_ttl(&self, ttl: Duration) {
        *self.shared.ttl.lock() = ttl;
    }

    /// Re-issues every live subscription (a rotation).
    pub fn rotate_all(&self) {
        self.shared.push(|_| true);
    }

    /// Revokes the pod's identity: its subscriptions get an empty answer.
    pub fn revoke(&self, pod_uid: &str) {
        self.shared.state.lock().revoked.insert(pod_uid.to_owned());
        self.shared.push(|s| s.uid == pod_uid);
    }

    /// From now on the pod gets `spiffe_id` (e.g. one its peers do not expect).
    pub fn issue_as(&self, pod_uid: &str, spiffe_id: &str) {
        self.shared
            .state
            .lock()
            .overrides
            .insert(pod_uid.to_owned(), spiffe_id.to_owned());
        self.shared.push(|s| s.uid == pod_uid);
    }

    /// Adds a federated trust domain's CA to the bundles.
    pub fn federate(&self, trust_domain: &str, ca_der: Vec<u8>) {
        let mut state = self.shared.state.lock();
        state.federated.insert(trust_domain.to_owned(), ca_der);
        let bundles = self.shared.bundles(&state);
        state
            .bundle_subscribers
            .retain(|tx| tx.try_send(Ok(bundles.clone())).is_ok());
    }

    /// Breaks every stream (with UNAVAILABLE) and stops serving: connecting fails until
    /// [`FakeSpire::restore`].
    pub fn break_streams(&self) {
        self.shared.down.store(true, std::sync::atomic::Ordering::SeqCst);
        if let Some(task) = self.server.lock().take() {
            task.abort();
        }
        let _ = std::fs::remove_file(&self.socket);
        {
            let mut state = self.shared.state.lock();
            for s in state.subscribers.drain(..) {
                let _ = s.tx.try_send(Err(Status::unavailable("fake SPIRE agent going away")));
            }
            for tx in state.bundle_subscribers.drain(..) {
                let _ = tx.try_send(Err(Status::unavailable("fake SPIRE agent going away")));
            }
        }
        if let Some(task) = self.server.lock().take() {
            task.abort();
        }
        let _ = std::fs::remove_file(&self.socket);
    }

    /// Serves again on the same socket.
    pub fn restore(&self) {
        self.shared.down.store(false, std::sync::atomic::Ordering::SeqCst);
        self.serve();
    }

    /// Live SVID subscriptions.
    pub fn subscriptions(&self) -> usize {
        let mut state = self.shared.state.lock();
        state.subscribers.retain(|s| !s.tx.is_closed());
        state.subscribers.len()
    }

    /// How many SVID subscriptions were ever opened (reconnects count).
    pub fn subscribe_calls(&self) -> u64 {
        self.shared.state.lock().subscribe_calls
    }

    /// Every SVID sent so far: (SPIFFE ID, leaf DER, when).
    pub fn issued(&self) -> Vec<(String, Vec<u8>, Instant)> {
        self.shared.state.lock().issued.clone()
    }
}

impl Drop for FakeSpire {
    fn drop(&mut self) {
        if let Some(task) = self.server.lock().take() {
            task.abort();
        }
        let _ = std::fs::remove_file(&self.socket);
    }
}
