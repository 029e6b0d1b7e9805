//! A fake SPIFFE Workload API (what a SPIRE agent serves to workloads on its public
//! socket), for the agent's own identity (`--node-identity spire`): `FetchX509SVID` as a
//! server stream on a Unix socket, answering at once and pushing a new message on every
//! open stream when the test rotates the SVID, as SPIRE does. Calls without the
//! `workload.spiffe.io: true` metadata are refused with INVALID_ARGUMENT, as SPIRE does.
//! The server is generated from `proto/spiffe/workload.proto`.
//!
//! One workload, one SVID at a time: real certificates from a [`TestCa`], its bundle the
//! CA certificate.

use parking_lot::Mutex;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::UnixListener;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_stream::wrappers::{ReceiverStream, UnixListenerStream};
use tonic::{Request, Response, Status};

use crate::identity::{Leaf, TRUST_DOMAIN, TestCa};

#[allow(clippy::all, clippy::pedantic)]
pub mod pb {
    // workload.proto has no package (its methods are `/SpiffeWorkloadAPI/…`).
    tonic::include_proto!("_");
}

use pb::spiffe_workload_api_server::{SpiffeWorkloadApi, SpiffeWorkloadApiServer};
use pb::{X509BundlesRequest, X509BundlesResponse, X509svid, X509svidRequest, X509svidResponse};

/// The metadata every Workload API call must carry.
pub const SECURITY_HEADER: &str = "workload.spiffe.io";

type Sender<T> = mpsc::Sender<Result<T, Status>>;

struct State {
    svid: Leaf,
    streams: Vec<Sender<X509svidResponse>>,
    bundle_streams: Vec<Sender<X509BundlesResponse>>,
    /// Calls that carried the header (FetchX509SVID) / that were refused without it.
    fetch_calls: u64,
    refused: u64,
    /// Every SVID served, in order.
    issued: Vec<Leaf>,
}

struct Shared {
    ca: Arc<TestCa>,
    state: Mutex<State>,
}

impl Shared {
    fn svid_response(&self, leaf: &Leaf) -> X509svidResponse {
        X509svidResponse {
            svids: vec![X509svid {
                spiffe_id: leaf.spiffe_id.clone(),
                x509_svid: leaf.cert_der.clone(),
                x509_svid_key: leaf.key_der.clone(),
                bundle: self.ca.cert_der.clone(),
                hint: String::new(),
            }],
            crl: Vec::new(),
            federated_bundles: HashMap::new(),
        }
    }

    fn bundles_response(&self) -> X509BundlesResponse {
        X509BundlesResponse {
            crl: Vec::new(),
            bundles: HashMap::from([(format!("spiffe://{TRUST_DOMAIN}"), self.ca.cert_der.clone())]),
        }
    }

    /// As SPIRE's Workload API handler: the security header or INVALID_ARGUMENT.
    fn check_header<T>(&self, request: &Request<T>) -> Result<(), Status> {
        let ok = request
            .metadata()
            .get(SECURITY_HEADER)
            .is_some_and(|value| value.as_bytes() == b"true");
        if ok {
            return Ok(());
        }
        self.state.lock().refused += 1;
        Err(Status::invalid_argument("security header missing from request"))
    }
}

struct Service(Arc<Shared>);

type Stream<T> = Pin<Box<dyn tokio_stream::Stream<Item = Result<T, Status>> + Send>>;

#[tonic::async_trait]
impl SpiffeWorkloadApi for Service {
    type FetchX509SVIDStream = Stream<X509svidResponse>;
    type FetchX509BundlesStream = Stream<X509BundlesResponse>;

    async fn fetch_x509svid(
        &self,
        request: Request<X509svidRequest>,
    ) -> Result<Response<Self::FetchX509SVIDStream>, Status> {
        self.0.check_header(&request)?;
        let (tx, rx) = mpsc::channel(16);
        let mut state = self.0.state.lock();
        state.fetch_calls += 1;
        tx.try_send(Ok(self.0.svid_response(&state.svid)))
            .expect("fresh channel");
        state.streams.push(tx);
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn fetch_x509_bundles(
        &self,
        request: Request<X509BundlesRequest>,
    ) -> Result<Response<Self::FetchX509BundlesStream>, Status> {
        self.0.check_header(&request)?;
        let (tx, rx) = mpsc::channel(16);
        tx.try_send(Ok(self.0.bundles_response())).expect("fresh channel");
        self.0.state.lock().bundle_streams.push(tx);
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

pub struct FakeWorkloadApi {
    pub socket: PathBuf,
    shared: Arc<Shared>,
    server: JoinHandle<()>,
}

impl FakeWorkloadApi {
    /// Serves on `socket`, the workload's SVID naming `spiffe_id`, signed by `ca`, valid
    /// for `ttl`.
    pub fn start(socket: &Path, ca: Arc<TestCa>, spiffe_id: &str, ttl: Duration) -> Self {
        let svid = ca.issue(spiffe_id, ttl);
        let shared = Arc::new(Shared {
            ca,
            state: Mutex::new(State {
                svid: svid.clone(),
                streams: Vec::new(),
                bundle_streams: Vec::new(),
                fetch_calls: 0,
                refused: 0,
                issued: vec![svid],
            }),
        });
        let _ = std::fs::remove_file(socket);
        let listener = UnixListener::bind(socket).expect("binding the fake Workload API socket");
        let service = SpiffeWorkloadApiServer::new(Service(shared.clone()));
        let server = tokio::spawn(async move {
            let _ = tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming(UnixListenerStream::new(listener))
                .await;
        });
        Self {
            socket: socket.to_owned(),
            shared,
            server,
        }
    }

    pub fn ca(&self) -> &TestCa {
        &self.shared.ca
    }

    /// The SVID served now.
    pub fn current(&self) -> Leaf {
        self.shared.state.lock().svid.clone()
    }

    /// Every SVID served so far, in order.
    pub fn issued(&self) -> Vec<Leaf> {
        self.shared.state.lock().issued.clone()
    }

    /// A new SVID naming `spiffe_id`, valid for `ttl`, pushed on every open stream (a
    /// rotation; with another ID, a changed registration entry). Returns it.
    pub fn rotate_to(&self, spiffe_id: &str, ttl: Duration) -> Leaf {
        let leaf = self.shared.ca.issue(spiffe_id, ttl);
        let response = self.shared.svid_response(&leaf);
        let mut state = self.shared.state.lock();
        state.svid = leaf.clone();
        state.issued.push(leaf.clone());
        state.streams.retain(|tx| tx.try_send(Ok(response.clone())).is_ok());
        leaf
    }

    /// Ends every open stream with UNAVAILABLE (the SPIRE agent restarting); new calls
    /// are served as before.
    pub fn break_streams(&self) {
        let mut state = self.shared.state.lock();
        for tx in state.streams.drain(..) {
            let _ = tx.try_send(Err(Status::unavailable("fake Workload API restarting")));
        }
        for tx in state.bundle_streams.drain(..) {
            let _ = tx.try_send(Err(Status::unavailable("fake Workload API restarting")));
        }
    }

    /// Open `FetchX509SVID` streams.
    pub fn streams(&self) -> usize {
        let mut state = self.shared.state.lock();
        state.streams.retain(|tx| !tx.is_closed());
        state.streams.len()
    }

    /// `FetchX509SVID` calls served (reconnects count).
    pub fn fetch_calls(&self) -> u64 {
        self.shared.state.lock().fetch_calls
    }

    /// Calls refused for lacking the security header.
    pub fn refused(&self) -> u64 {
        self.shared.state.lock().refused
    }
}

impl Drop for FakeWorkloadApi {
    fn drop(&mut self) {
        self.server.abort();
        let _ = std::fs::remove_file(&self.socket);
    }
}
