//! The simulated agents: each the agent of one node, with its own mTLS HTTP/2
//! connection to a registrar replica (node certificate, so its writes pass the
//! own-node rule), its pods' registrations, and one Watch stream filtered to the
//! services its pods depend on. A stream that breaks moves to a live replica and
//! resumes from the last version it applied, saying what its view holds, as the real
//! agent does.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use aether_common::tls::Connector;
use aether_proto::registrar::v1::registrar_client::RegistrarClient;
use aether_proto::registrar::v1::{
    RegisterEndpointRequest, SnapshotReason, Version, WatchRequest, WatchResponse, watch_response,
};
use aether_proto::registry::v1::Endpoint;
use aether_proto::view::WatchView;
use parking_lot::Mutex;
use rustls::ClientConfig;
use tokio::sync::{Semaphore, mpsc};
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;

use crate::holdings::{Digests, States};
use crate::ledger::{Ledger, wire_bytes};

/// Connections being set up at once (TLS handshakes compete for the same cores).
const CONNECT_CONCURRENCY: usize = 256;
/// How long an agent keeps retrying before it gives up.
const RETRY_FOR: Duration = Duration::from_secs(120);
/// The filter id every simulated agent uses (its filter never changes).
const FILTER_ID: u64 = 1;

/// What an agent tells the run about its progress.
#[derive(Clone, Copy, Debug)]
pub enum Progress {
    /// A snapshot was complete: its size on the wire (the agent's full state).
    Synced { node: u32, bytes: usize, at: Instant },
    /// A moved stream went on without a full snapshot: it resumed with deltas, or its
    /// holdings were reconciled. What that cost on the wire: its `held` sent, and the
    /// first Delta or the reconciling snapshot received.
    Resumed {
        node: u32,
        held: usize,
        bytes: usize,
        at: Instant,
    },
    /// The agent's stream broke (its replica died, or closed the connection).
    Broken { node: u32 },
}

/// One agent's connection and, when kept, the view its stream built.
pub struct Link {
    tls: Arc<ClientConfig>,
    client: Mutex<Option<RegistrarClient<Channel>>>,
    pub view: Mutex<Option<WatchView>>,
}

impl Link {
    /// The agent's current connection (after `connect`).
    pub fn client(&self) -> RegistrarClient<Channel> {
        self.client.lock().clone().expect("the agent is connected")
    }
}

/// The agents and what they share.
pub struct Fleet {
    urls: [String; 2],
    dead: [AtomicBool; 2],
    pub links: Vec<Link>,
    /// Whether a moved stream says what its view holds (`held`); without, it gets a
    /// snapshot (agents from before holdings, for comparison).
    holdings: bool,
    /// The service states the agents' digests share.
    states: Arc<States>,
    pub ledger: Ledger,
    gate: Semaphore,
    progress: mpsc::UnboundedSender<Progress>,
    /// Why streams broke (the status they ended with), and how often.
    pub breaks: Mutex<std::collections::BTreeMap<String, usize>>,
}

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("the agent of node-{node} could not reach a registrar for {RETRY_FOR:?}: {last}")]
    Unreachable { node: u32, last: String },
    #[error("the agent of node-{node}: registering {address}: {status}")]
    Register {
        node: u32,
        address: String,
        status: tonic::Status,
    },
}

impl Fleet {
    /// Agents for `tls.len()` nodes; agent `n` starts on replica `n % 2`.
    pub fn new(
        urls: [String; 2],
        tls: Vec<Arc<ClientConfig>>,
        keep_views: bool,
        holdings: bool,
    ) -> (Fleet, mpsc::UnboundedReceiver<Progress>) {
        let (progress, rx) = mpsc::unbounded_channel();
        let links = tls
            .into_iter()
            .map(|tls| Link {
                tls,
                client: Mutex::new(None),
                view: Mutex::new(keep_views.then(WatchView::default)),
            })
            .collect();
        let fleet = Fleet {
            urls,
            dead: [AtomicBool::new(false), AtomicBool::new(false)],
            links,
            holdings,
            states: Arc::default(),
            ledger: Ledger::default(),
            gate: Semaphore::new(CONNECT_CONCURRENCY),
            progress,
            breaks: Mutex::default(),
        };
        (fleet, rx)
    }

    /// From now on agents avoid `replica` (it is about to be killed).
    pub fn mark_dead(&self, replica: usize) {
        self.dead[replica].store(true, Ordering::SeqCst);
    }

    /// The replica the agent of `node` should use: its own unless that one is dead.
    fn replica_for(&self, node: u32) -> usize {
        let own = node as usize % 2;
        if self.dead[own].load(Ordering::SeqCst) {
            1 - own
        } else {
            own
        }
    }

    /// (Re)connects the agent of `node` to its replica; returns how many attempts failed.
    pub async fn connect(&self, node: u32) -> Result<usize, AgentError> {
        let link = &self.links[node as usize];
        let deadline = Instant::now() + RETRY_FOR;
        let mut failed = 0;
        loop {
            let url = &self.urls[self.replica_for(node)];
            let attempt = {
                let _permit = self.gate.acquire().await.expect("the gate stays open");
                tonic::transport::Endpoint::from_shared(url.clone())
                    .expect("a registrar URL")
                    .connect_timeout(Duration::from_secs(10))
                    .connect_with_connector(Connector::new(link.tls.clone()))
                    .await
            };
            match attempt {
                Ok(channel) => {
                    *link.client.lock() = Some(RegistrarClient::new(channel));
                    return Ok(failed);
                }
                Err(e) if Instant::now() > deadline => {
                    return Err(AgentError::Unreachable {
                        node,
                        last: format!("{e:?}"),
                    });
                }
                Err(_) => failed += 1,
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Registers `endpoints` (the node's pods) one after the other, as an agent does.
    pub async fn register(&self, node: u32, endpoints: Vec<Endpoint>) -> Result<(), AgentError> {
        let mut client = self.links[node as usize].client();
        for endpoint in endpoints {
            let address = endpoint.address.clone();
            let request = RegisterEndpointRequest {
                endpoint: Some(endpoint),
            };
            client
                .register_endpoint(request)
                .await
                .map_err(|status| AgentError::Register { node, address, status })?;
        }
        Ok(())
    }

    /// Follows the agent's Watch stream until the run ends, moving to the live
    /// replica (and resuming) whenever the stream breaks.
    pub async fn follow(self: Arc<Self>, node: u32, services: Vec<String>) -> Result<(), AgentError> {
        let mut version: Option<Version> = None;
        let mut digests = Digests::new(self.states.clone());
        loop {
            let moved = version.is_some();
            let request = WatchRequest {
                services: services.clone(),
                filter_id: FILTER_ID,
                resume_from: version.clone(),
                held: (moved && self.holdings).then(|| digests.held()),
                ..Default::default()
            };
            let held = request.held.as_ref().map_or(0, prost::Message::encoded_len);
            if let Ok(stream) = self.open(node, request).await {
                let moved = moved.then_some(held);
                self.read(node, stream, moved, &mut version, &mut digests).await;
            }
            let _ = self.progress.send(Progress::Broken { node });
            // The stream broke: the replica died (or the run ended and dropped us).
            tokio::time::sleep(Duration::from_millis(50)).await;
            self.connect(node).await?;
        }
    }

    async fn open(&self, node: u32, first: WatchRequest) -> Result<tonic::Streaming<WatchResponse>, tonic::Status> {
        let (requests, rx) = mpsc::channel(1);
        requests.send(first).await.expect("the receiver is held below");
        let mut client = self.links[node as usize].client();
        let stream = client.watch(ReceiverStream::new(rx)).await?.into_inner();
        // Keep the request side open for as long as the stream lives.
        tokio::spawn(async move { requests.closed().await });
        Ok(stream)
    }

    fn broke(&self, why: String) {
        let why: String = why.chars().take(120).collect();
        *self.breaks.lock().entry(why).or_default() += 1;
    }

    /// Applies the stream's messages until it breaks.
    async fn read(
        &self,
        node: u32,
        mut stream: tonic::Streaming<WatchResponse>,
        mut moved: Option<usize>,
        version: &mut Option<Version>,
        digests: &mut Digests,
    ) {
        let link = &self.links[node as usize];
        let mut snapshot_bytes = 0;
        // Whether the snapshot streaming in reconciles what the agent held.
        let mut reconciling = false;
        loop {
            let message = match stream.message().await {
                Ok(Some(message)) => message,
                Ok(None) => break self.broke("the stream ended".into()),
                Err(status) => break self.broke(format!("{:?}: {}", status.code(), status.message())),
            };
            let (at, bytes) = (Instant::now(), wire_bytes(&message));
            match &message.event {
                Some(watch_response::Event::Snapshot(chunk)) => {
                    if chunk.reset {
                        reconciling = chunk.reason == SnapshotReason::Reconciled as i32;
                    }
                    snapshot_bytes += bytes;
                }
                Some(watch_response::Event::SnapshotComplete(complete)) => {
                    *version = complete.version.clone();
                    let bytes = std::mem::take(&mut snapshot_bytes) + bytes;
                    let _ = match moved.take() {
                        Some(held) if reconciling => self.progress.send(Progress::Resumed { node, held, bytes, at }),
                        _ => self.progress.send(Progress::Synced { node, bytes, at }),
                    };
                }
                Some(watch_response::Event::Delta(delta)) => {
                    *version = delta.version.clone();
                    if let Some(held) = moved.take() {
                        let _ = self.progress.send(Progress::Resumed { node, held, bytes, at });
                    }
                    self.ledger.delivered(delta, bytes, at);
                }
                None => {}
            }
            if self.holdings {
                digests.apply(&message);
            }
            if let Some(view) = link.view.lock().as_mut() {
                view.apply(message).expect("a well-formed watch stream");
            }
        }
    }
}
