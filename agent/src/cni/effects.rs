//! What a CNI call does outside the agent's memory, behind one small trait each, so
//! the service's decisions (validation, ordering, rollback) run in unit tests against
//! fakes while production uses the registrar, nftables and the node's Envoy.

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tonic::Status;

use crate::capture::{self, CaptureConfig, CaptureError, PodCapture, Verdict};
use crate::node::{Node, ServeError};
use crate::pod::LocalPod;
use crate::registrar::Registrar;
use crate::xds::cache::WaitError;

/// Registering a pod's endpoints with the registrar.
#[tonic::async_trait]
pub trait Registration: Send + Sync {
    async fn register(&self, pod: &LocalPod) -> Result<(), Status>;
    async fn unregister(&self, service: &str, ips: &[IpAddr]) -> Result<(), Status>;
}

/// What the agent does in pods' network namespaces (root only in production): reading
/// a pod's addresses, its nftables capture, and the netns pins the CNI plugin makes.
#[tonic::async_trait]
pub trait Capture: Send + Sync {
    /// The pod's global addresses.
    async fn addresses(&self, netns: &Path) -> Result<Vec<IpAddr>, CaptureError>;
    /// Applies the pod's capture and records it as its desired state.
    async fn apply(&self, container_id: &str, netns: &Path, capture: &PodCapture) -> Result<(), CaptureError>;
    /// Removes the pod's capture and its desired state. Idempotent.
    async fn remove(&self, container_id: &str, netns: &Path) -> Result<(), CaptureError>;
    async fn check(&self, container_id: &str, netns: &Path) -> Result<Verdict, CaptureError>;
    /// Sandboxes with a desired state that are not in `known`.
    fn orphans(&self, known: &[String]) -> Vec<String>;
    /// Where the CNI plugin pins sandbox `container_id`'s netns.
    fn pin(&self, container_id: &str) -> PathBuf;
    /// The sandboxes with a pin.
    fn pinned(&self) -> Vec<String>;
    /// Removes the pin `netns` if it is one of ours. Idempotent.
    fn unpin(&self, netns: &Path) -> std::io::Result<bool>;
}

/// Waiting for the node's Envoy to take up or let go of a pod.
#[tonic::async_trait]
pub trait EnvoyWaits: Send + Sync {
    /// Until Envoy serves `pod` from pod-store `generation` on (see [`Node::wait_served`]).
    async fn served(&self, pod: &LocalPod, generation: u64) -> Result<(), ServeError>;
    /// Until no Envoy holds the pod's listeners.
    async fn unserved(&self, pod: &LocalPod) -> Result<(), WaitError>;
    /// Whether Envoy holds the pod's listeners now (a short wait).
    async fn serving(&self, pod: &LocalPod) -> Result<(), WaitError>;
}

/// How long ADD waits for Envoy to ACK the pod's listeners.
pub const ACK_TIMEOUT: Duration = Duration::from_secs(10);
/// How long DEL waits for Envoy to drop the pod's listeners (it succeeds either way).
pub const REMOVE_TIMEOUT: Duration = Duration::from_secs(5);
/// How long CHECK gives Envoy to show the pod's listeners ACKed.
const CHECK_TIMEOUT: Duration = Duration::from_millis(200);

/// The effects a [`CniService`](super::CniService) has.
#[derive(Clone)]
pub struct Effects {
    pub registration: Arc<dyn Registration>,
    pub capture: Arc<dyn Capture>,
    pub envoy: Arc<dyn EnvoyWaits>,
}

impl Effects {
    /// The registrar, nftables with the CNI plugin's pins under `pin_dir`, and the
    /// node's Envoy.
    pub fn production(registrar: Registrar, capture: CaptureConfig, pin_dir: PathBuf, node: Node) -> Self {
        Self {
            registration: Arc::new(registrar),
            capture: Arc::new(Nftables {
                config: capture,
                pin_dir,
            }),
            envoy: Arc::new(node),
        }
    }
}

#[tonic::async_trait]
impl Registration for Registrar {
    async fn register(&self, pod: &LocalPod) -> Result<(), Status> {
        Registrar::register(self, pod).await
    }

    async fn unregister(&self, service: &str, ips: &[IpAddr]) -> Result<(), Status> {
        Registrar::unregister(self, service, ips).await
    }
}

/// Capture with `nft` in the pods' netns ([`crate::capture`]).
struct Nftables {
    config: CaptureConfig,
    /// The CNI plugin's netns pins; the agent removes those under it.
    pin_dir: PathBuf,
}

#[tonic::async_trait]
impl Capture for Nftables {
    async fn addresses(&self, netns: &Path) -> Result<Vec<IpAddr>, CaptureError> {
        capture::pod_addresses(netns).await
    }

    async fn apply(&self, container_id: &str, netns: &Path, capture: &PodCapture) -> Result<(), CaptureError> {
        capture::apply(&self.config, container_id, netns, capture).await
    }

    async fn remove(&self, container_id: &str, netns: &Path) -> Result<(), CaptureError> {
        capture::remove(&self.config, container_id, netns).await
    }

    async fn check(&self, container_id: &str, netns: &Path) -> Result<Verdict, CaptureError> {
        capture::check(&self.config, container_id, netns).await
    }

    fn orphans(&self, known: &[String]) -> Vec<String> {
        capture::orphans(&self.config, known)
    }

    fn pin(&self, container_id: &str) -> PathBuf {
        self.pin_dir.join(container_id)
    }

    fn pinned(&self) -> Vec<String> {
        let Ok(entries) = std::fs::read_dir(&self.pin_dir) else {
            return Vec::new();
        };
        entries.filter_map(|e| e.ok()?.file_name().into_string().ok()).collect()
    }

    fn unpin(&self, netns: &Path) -> std::io::Result<bool> {
        capture::unpin(&self.pin_dir, netns)
    }
}

#[tonic::async_trait]
impl EnvoyWaits for Node {
    async fn served(&self, pod: &LocalPod, generation: u64) -> Result<(), ServeError> {
        self.wait_served(pod, generation, ACK_TIMEOUT).await
    }

    async fn unserved(&self, pod: &LocalPod) -> Result<(), WaitError> {
        self.wait_unserved(pod, REMOVE_TIMEOUT).await
    }

    async fn serving(&self, pod: &LocalPod) -> Result<(), WaitError> {
        self.wait_listeners(pod, CHECK_TIMEOUT).await
    }
}
