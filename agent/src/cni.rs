//! `aether.cni.v1.CniPlugin` on the agent's Unix socket: the CNI plugin's ADD, DEL
//! and CHECK. `AddPod` is synchronous: SUCCESS means the pod's endpoint is
//! registered, Envoy has ACKed the pod's listeners and upstream clusters, and the
//! capture rules are in its netns. Those three are independent (the pod's containers
//! have not started yet, so nothing flows before all are done) and run concurrently:
//! ADD takes the slowest of them, not their sum. A failed ADD leaves nothing behind
//! (the pod is forgotten, unregistered and uncaptured), so kubelet's retry starts clean.
//!
//! The service decides; its effects (registrar, capture, Envoy) are [`Effects`], faked
//! in the unit tests.

mod effects;
#[cfg(test)]
mod tests;

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use aether_common::names::ContainerIdError;
use aether_common::quote::quote;
use aether_proto::cni::v1::cni_plugin_server::{CniPlugin, CniPluginServer};
use aether_proto::cni::v1::{
    AddPodRequest, AddPodResponse, CheckPodRequest, CheckPodResponse, GarbageCollectRequest, GarbageCollectResponse,
    Outcome, PodRef, ReadyRequest, ReadyResponse, RemovePodRequest, RemovePodResponse,
};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use tonic::{Request, Response, Status};

pub use self::effects::{ACK_TIMEOUT, Capture, Effects, EnvoyWaits, REMOVE_TIMEOUT, Registration};
use crate::capture::{self, CaptureConfig, PodCapture, Verdict};
use crate::node::Node;
use crate::pod::{ListenerSockets, LocalPod, MANAGED_LABEL};
use crate::pod_source::PodDirectory;

/// The largest CNI message the agent decodes or encodes. The largest valid one is a
/// GarbageCollect listing every sandbox of the node (at most 256 bytes per id, so about
/// 8,000 ids); AddPod is a few KiB (a container id, a netns path, a pod reference, its
/// IPs and capture options). A bigger message is refused by the transport from its length
/// prefix, before it is buffered (OUT_OF_RANGE); a smaller one with an oversized field is
/// refused by validation, naming the field (INVALID_ARGUMENT).
pub const MAX_MESSAGE_BYTES: usize = 2 * 1024 * 1024;

/// The CNI service as the agent serves it on its Unix socket, with [`MAX_MESSAGE_BYTES`]
/// as both its decoding and encoding limit.
pub fn server(service: CniService) -> CniPluginServer<CniService> {
    CniPluginServer::new(service)
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES)
}

/// `cni_calls` labels: method and result.
type Labels = [(&'static str, &'static str); 2];
type PhaseLabels = [(&'static str, &'static str); 1];

/// The CNI service's instruments.
#[derive(Clone)]
pub struct CniMetrics {
    calls: Family<Labels, Counter>,
    /// Seconds an `AddPod` spent in each of its phases (`register`, `envoy`, `capture`)
    /// and in `total`, successful ones only.
    add_phases: Family<PhaseLabels, Histogram>,
}

impl Default for CniMetrics {
    fn default() -> Self {
        Self {
            calls: Family::default(),
            // 0.5 ms to ~16 s.
            add_phases: Family::new_with_constructor(|| Histogram::new(exponential_buckets(0.000_5, 2.0, 16))),
        }
    }
}

impl CniMetrics {
    /// Calls that failed (refused as invalid, or errors), every method, since start.
    pub fn failed(&self) -> u64 {
        let methods = ["AddPod", "RemovePod", "CheckPod", "GarbageCollect"];
        let results = ["invalid", "error"];
        methods
            .iter()
            .flat_map(|m| results.map(|r| self.calls.get(&[("method", m), ("result", r)]).map_or(0, |c| c.get())))
            .sum()
    }

    /// Registers under the agent's `aether_agent` registry.
    pub fn register(&self, metrics: &mut Registry) {
        metrics.register(
            "cni_calls",
            "CNI plugin calls, by method and result",
            self.calls.clone(),
        );
        metrics.register(
            "cni_add_phase_seconds",
            "Time successful AddPod calls spent registering, waiting for Envoy, programming capture, and in total",
            self.add_phases.clone(),
        );
    }
}

/// What the CNI service is configured with.
#[derive(Clone, Debug)]
pub struct CniSettings {
    /// Namespaces never put in the mesh.
    pub excluded_namespaces: BTreeSet<String>,
    /// How long ADD waits for the pod source to report a pod it has not seen yet.
    pub pod_lookup_timeout: Duration,
    /// How pods' traffic is captured; a request's capture options are checked against it.
    pub capture: CaptureConfig,
    /// Links to pods' volumes for UDS delivery.
    pub uds: crate::uds::UdsLinks,
}

#[derive(Clone)]
pub struct CniService {
    /// The owner of local pods.
    node: Node,
    directory: PodDirectory,
    settings: Arc<CniSettings>,
    effects: Effects,
    metrics: CniMetrics,
}

fn invalid(field: &str, reason: impl std::fmt::Display) -> Status {
    Status::invalid_argument(format!("{field}: {reason}"))
}

fn check_pod_ref(pod: Option<&PodRef>) -> Result<&PodRef, Status> {
    let pod = pod.ok_or_else(|| invalid("pod", "must be set"))?;
    crate::upstreams::check(&pod.namespace).map_err(|r| invalid("pod.namespace", r))?;
    if pod.name.is_empty() || pod.name.len() > 253 {
        return Err(invalid("pod.name", "must be 1..=253 characters"));
    }
    Ok(pod)
}

/// The rule is [`aether_common::names::container_id`], the one the CNI plugin checks.
fn check_container_id(id: &str) -> Result<(), Status> {
    aether_common::names::container_id(id).map_err(|e| match e {
        ContainerIdError::Empty => invalid("container_id", "must be set"),
        ContainerIdError::Invalid => invalid("container_id", format!("{} is not a container id", quote(id))),
    })
}

fn check_netns(path: &str) -> Result<(), Status> {
    if path.is_empty() {
        return Err(invalid("netns_path", "must be set"));
    }
    let p = Path::new(path);
    if !p.is_absolute() {
        return Err(invalid(
            "netns_path",
            format!("{} is not an absolute path", quote(path)),
        ));
    }
    if !p.exists() {
        return Err(invalid("netns_path", format!("{} does not exist", quote(path))));
    }
    Ok(())
}

fn parse_ips(ips: &[String]) -> Result<Vec<IpAddr>, Status> {
    ips.iter()
        .enumerate()
        .map(|(i, ip)| {
            ip.parse()
                .map_err(|_| invalid(&format!("ips[{i}]"), format!("{} is not an IP address", quote(ip))))
        })
        .collect()
}

/// An AddPod request whose fields are all valid, with the pod's IPs.
struct Sandbox {
    container_id: String,
    netns: PathBuf,
    pod: PodRef,
    ips: Vec<IpAddr>,
    capture: Option<PodCapture>,
}

/// Whether a pod is the mesh's.
enum Admission {
    Join(Box<LocalPod>, Option<PodCapture>),
    /// IGNORED, with why.
    Ignored(String),
}

/// How long each phase of a successful ADD took (`capture`: if the pod is captured).
struct Took {
    register: Duration,
    envoy: Duration,
    capture: Option<Duration>,
    total: Duration,
}

impl CniService {
    pub fn new(
        node: Node,
        directory: PodDirectory,
        settings: CniSettings,
        effects: Effects,
        metrics: CniMetrics,
    ) -> Self {
        Self {
            node,
            directory,
            settings: Arc::new(settings),
            effects,
            metrics,
        }
    }

    fn count(&self, method: &'static str, result: &'static str) {
        self.metrics
            .calls
            .get_or_create(&[("method", method), ("result", result)])
            .inc();
    }

    async fn add(&self, request: AddPodRequest) -> Result<AddPodResponse, Status> {
        let sandbox = self.validate(request).await?;
        let (pod, capture) = match self.admit(sandbox).await? {
            Admission::Join(pod, capture) => (*pod, capture),
            Admission::Ignored(why) => return Ok(outcome(Outcome::Ignored, why)),
        };
        let took = self.join(&pod, capture.as_ref()).await?;
        self.record_add(&pod, &took);
        Ok(outcome(Outcome::Success, String::new()))
    }

    /// Each field in turn; an error names the first that is wrong. Without IPs in the
    /// request, the pod's are read from its netns.
    async fn validate(&self, request: AddPodRequest) -> Result<Sandbox, Status> {
        check_container_id(&request.container_id)?;
        check_netns(&request.netns_path)?;
        let pod = check_pod_ref(request.pod.as_ref())?.clone();
        let mut ips = parse_ips(&request.ips)?;
        if ips.is_empty() {
            // The plugin had no prevResult IPs.
            ips = self
                .effects
                .capture
                .addresses(Path::new(&request.netns_path))
                .await
                .map_err(|e| Status::failed_precondition(format!("ips: none given and {e}")))?;
        }
        if ips.is_empty() {
            return Err(invalid("ips", "none given and the netns has no address"));
        }
        let capture = capture::pod_capture(&self.settings.capture, request.capture.as_ref())
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
        Ok(Sandbox {
            container_id: request.container_id,
            netns: request.netns_path.into(),
            pod,
            ips,
            capture,
        })
    }

    /// A pod joins unless its namespace is excluded or it is not managed; the pod source
    /// must know it (the same pod, if the runtime passed its uid).
    async fn admit(&self, sandbox: Sandbox) -> Result<Admission, Status> {
        let PodRef { namespace, name, uid } = &sandbox.pod;
        if self.settings.excluded_namespaces.contains(namespace) {
            let why = format!("namespace {namespace} is excluded from the mesh");
            return Ok(Admission::Ignored(why));
        }
        let key = format!("{namespace}/{name}");
        let info = self
            .directory
            .wait_for(&key, self.settings.pod_lookup_timeout)
            .await
            .ok_or_else(|| Status::unavailable(format!("pod {key} is not known to the pod source yet; retry")))?;
        if !uid.is_empty() && !info.uid.is_empty() && *uid != info.uid {
            return Err(Status::failed_precondition(format!(
                "pod.uid: {} does not match the pod source's {} for {key}",
                quote(uid),
                info.uid
            )));
        }
        if !info.is_managed() {
            let why = format!("pod {key} is not managed (label {MANAGED_LABEL}=true)");
            return Ok(Admission::Ignored(why));
        }
        for error in info.config_errors() {
            tracing::warn!(pod = %key, %error, "pod annotation entry skipped");
        }
        let node_default = self.settings.capture.inbound_mtls;
        let namespace_mode = self.node.mesh_settings().of(namespace).inbound_mtls;
        let capture = sandbox.capture.map(|capture| PodCapture {
            inbound_mtls: capture::inbound::effective(node_default, namespace_mode, &info),
            ..capture
        });
        let pod = LocalPod {
            container_id: sandbox.container_id,
            // Its listeners are made now: with the node's current choice.
            listener_sockets: ListenerSockets::Shared,
            netns: sandbox.netns,
            ips: sandbox.ips,
            info,
        };
        Ok(Admission::Join(Box::new(pod), capture))
    }

    /// The pod is saved, registered, served by Envoy and captured, concurrently. If any
    /// fails, all are undone (fail closed): the retried ADD starts clean.
    async fn join(&self, pod: &LocalPod, capture: Option<&PodCapture>) -> Result<Took, Status> {
        let started = Instant::now();
        self.settings.uds.link(&pod.info).map_err(|e| {
            Status::failed_precondition(format!("linking the volume of pod {}'s Unix socket: {e}", pod.id()))
        })?;
        // The node builds the pod's config while the pod is written to disk.
        let generation = self.node.add_pod(pod.clone());
        let (saved, registered, envoy, captured) = tokio::join!(
            self.node.saved(generation),
            timed(self.register(pod)),
            timed(self.wait_for_envoy(pod, generation)),
            timed(self.capture(pod, capture)),
        );
        let saved = saved.map_err(|e| Status::internal(format!("saving pod {}: {e}", pod.id())));
        if let Err(error) = saved.and(registered.0).and(envoy.0).and(captured.0) {
            self.roll_back(pod, capture.is_some()).await;
            return Err(error);
        }
        Ok(Took {
            register: registered.1,
            envoy: envoy.1,
            capture: capture.is_some().then_some(captured.1),
            total: started.elapsed(),
        })
    }

    /// Undoes all of a failed ADD, whichever part failed: the pod is forgotten and
    /// unregistered, and its capture (if it was to be captured) removed.
    async fn roll_back(&self, pod: &LocalPod, captured: bool) {
        let _ = self.node.remove_pod(pod).await;
        let _ = self.settings.uds.unlink(&pod.info);
        let _ = self
            .effects
            .registration
            .unregister(&pod.info.service(), &pod.ips)
            .await;
        if captured && let Err(e) = self.effects.capture.remove(&pod.container_id, &pod.netns).await {
            tracing::warn!(pod = %pod.id(), error = %e, "removing the capture rules of a failed ADD failed");
        }
        self.node.poke();
    }

    async fn register(&self, pod: &LocalPod) -> Result<(), Status> {
        self.effects
            .registration
            .register(pod)
            .await
            .map_err(|s| Status::unavailable(format!("registering {} with the registrar: {}", pod.id(), s.message())))
    }

    async fn wait_for_envoy(&self, pod: &LocalPod, generation: u64) -> Result<(), Status> {
        self.effects
            .envoy
            .served(pod, generation)
            .await
            .map_err(|e| Status::deadline_exceeded(e.to_string()))
    }

    async fn capture(&self, pod: &LocalPod, capture: Option<&PodCapture>) -> Result<(), Status> {
        let Some(capture) = capture else { return Ok(()) };
        self.effects
            .capture
            .apply(&pod.container_id, &pod.netns, capture)
            .await
            .map_err(|error| Status::internal(format!("programming the capture rules of {}: {error}", pod.id())))
    }

    fn record_add(&self, pod: &LocalPod, took: &Took) {
        let phases = [
            Some(("register", took.register)),
            Some(("envoy", took.envoy)),
            took.capture.map(|t| ("capture", t)),
            Some(("total", took.total)),
        ];
        for (phase, t) in phases.into_iter().flatten() {
            self.metrics
                .add_phases
                .get_or_create(&[("phase", phase)])
                .observe(t.as_secs_f64());
        }
        let ms = |t: Duration| t.as_millis() as u64;
        tracing::info!(pod = %pod.id(), service = %pod.info.service(), captured = took.capture.is_some(),
            took_ms = ms(took.total), register_ms = ms(took.register), envoy_ms = ms(took.envoy),
            capture_ms = ms(took.capture.unwrap_or_default()), "pod added to the mesh");
    }

    async fn remove(&self, request: RemovePodRequest) -> Result<RemovePodResponse, Status> {
        check_container_id(&request.container_id)?;
        let Some(pod) = self.node.pod_in(&request.container_id) else {
            // Nothing registered, but a pin or capture state may be left from a failed ADD.
            self.remove_leftovers(&request.container_id).await;
            return Ok(removed("unknown sandbox; nothing to do"));
        };
        self.node
            .remove_pod(&pod)
            .await
            .map_err(|e| Status::internal(format!("forgetting pod {}: {e}", pod.id())))?;
        if let Err(status) = self
            .effects
            .registration
            .unregister(&pod.info.service(), &pod.ips)
            .await
        {
            // DEL must not fail on a registrar outage; the endpoint's TTL reaps it.
            tracing::error!(pod = %pod.id(), %status, "could not unregister a removed pod's endpoints");
        }
        // Let Envoy close the pod's listeners before the runtime tears the netns down.
        self.node.poke();
        if let Err(error) = self.effects.envoy.unserved(&pod).await {
            tracing::warn!(pod = %pod.id(), %error, "the pod's listeners outlived its removal");
        }
        // The listeners are gone: drop the capture and the pin (ours from AddPod on).
        let capture = &self.effects.capture;
        if let Err(error) = capture.remove(&pod.container_id, &pod.netns).await {
            tracing::warn!(pod = %pod.id(), %error, "removing the pod's capture rules failed");
        }
        if let Err(error) = capture.unpin(&pod.netns) {
            tracing::warn!(pod = %pod.id(), netns = %pod.netns.display(), %error, "removing the netns pin failed");
        }
        if let Err(error) = self.settings.uds.unlink(&pod.info) {
            tracing::warn!(pod = %pod.id(), %error, "removing the link to the pod's socket volume failed");
        }
        tracing::info!(pod = %pod.id(), "pod removed from the mesh");
        Ok(removed(""))
    }

    /// Drops what a failed or interrupted ADD of sandbox `id` may have left: capture
    /// state and the netns pin.
    async fn remove_leftovers(&self, id: &str) {
        let capture = &self.effects.capture;
        let pin = capture.pin(id);
        if let Err(error) = capture.remove(id, &pin).await {
            tracing::warn!(container = %id, %error, "removing leftover capture rules failed");
        }
        if let Err(error) = capture.unpin(&pin) {
            tracing::warn!(container = %id, %error, "removing a leftover netns pin failed");
        }
    }

    async fn check(&self, request: CheckPodRequest) -> Result<CheckPodResponse, Status> {
        check_container_id(&request.container_id)?;
        let pod = self.node.pod_in(&request.container_id).ok_or_else(|| {
            Status::not_found(format!(
                "container_id: sandbox {} is not in the mesh",
                request.container_id
            ))
        })?;
        if !pod.netns.exists() {
            return Err(Status::failed_precondition(format!(
                "netns_path: {} no longer exists",
                pod.netns.display()
            )));
        }
        self.effects
            .envoy
            .serving(&pod)
            .await
            .map_err(|e| Status::failed_precondition(e.to_string()))?;
        match self.effects.capture.check(&pod.container_id, &pod.netns).await {
            Ok(Verdict::Intact(_) | Verdict::NotCaptured) => {}
            Ok(Verdict::Drifted) => {
                return Err(Status::failed_precondition(format!(
                    "capture: the nftables table {} in {} is missing or changed",
                    capture::TABLE,
                    pod.netns.display()
                )));
            }
            Err(error) => return Err(Status::internal(format!("capture: {error}"))),
        }
        Ok(CheckPodResponse {
            outcome: Outcome::Success as i32,
            message: String::new(),
        })
    }

    /// Removes every pod whose sandbox is not in the request, then what failed or
    /// interrupted ADDs left.
    async fn garbage_collect(&self, request: GarbageCollectRequest) -> Result<GarbageCollectResponse, Status> {
        for (i, id) in request.valid_container_ids.iter().enumerate() {
            check_container_id(id).map_err(|s| invalid(&format!("valid_container_ids[{i}]"), s.message()))?;
        }
        let valid: BTreeSet<&str> = request.valid_container_ids.iter().map(String::as_str).collect();
        let mut removed = BTreeSet::new();
        for pod in self.node.pods() {
            if !valid.contains(pod.container_id.as_str()) {
                self.remove(RemovePodRequest {
                    container_id: pod.container_id.clone(),
                    pod: None,
                })
                .await?;
                removed.insert(pod.container_id);
            }
        }
        // Pins and capture state without a pod.
        let known: Vec<String> = self.node.pods().into_iter().map(|p| p.container_id).collect();
        let mut leftovers = self.effects.capture.orphans(&known);
        leftovers.extend(self.effects.capture.pinned());
        for id in leftovers {
            if valid.contains(id.as_str()) || known.contains(&id) || check_container_id(&id).is_err() {
                continue;
            }
            self.remove_leftovers(&id).await;
            removed.insert(id);
        }
        if !removed.is_empty() {
            tracing::info!(removed = ?removed, "CNI GC removed stale sandboxes");
        }
        Ok(GarbageCollectResponse {
            removed: removed.into_iter().collect(),
        })
    }
}

/// Runs `f`, returning its result and how long it took.
async fn timed<T>(f: impl std::future::Future<Output = T>) -> (T, Duration) {
    let started = Instant::now();
    let out = f.await;
    (out, started.elapsed())
}

fn outcome(outcome: Outcome, message: String) -> AddPodResponse {
    AddPodResponse {
        outcome: outcome as i32,
        message,
    }
}

fn removed(message: &str) -> RemovePodResponse {
    RemovePodResponse {
        outcome: Outcome::Success as i32,
        message: message.into(),
    }
}

fn result_label<T>(result: &Result<T, Status>) -> &'static str {
    match result {
        Ok(_) => "ok",
        Err(s) if s.code() == tonic::Code::InvalidArgument => "invalid",
        Err(_) => "error",
    }
}

#[tonic::async_trait]
impl CniPlugin for CniService {
    async fn add_pod(&self, request: Request<AddPodRequest>) -> Result<Response<AddPodResponse>, Status> {
        // On its own task: a plugin that gives up (timeout, killed) drops this RPC, and an
        // ADD cut off half-way would skip its cleanup.
        let this = self.clone();
        let result = tokio::spawn(async move { this.add(request.into_inner()).await })
            .await
            .unwrap_or_else(|e| Err(Status::internal(format!("AddPod task failed: {e}"))));
        self.count("AddPod", result_label(&result));
        result.map(Response::new)
    }

    async fn remove_pod(&self, request: Request<RemovePodRequest>) -> Result<Response<RemovePodResponse>, Status> {
        let result = self.remove(request.into_inner()).await;
        self.count("RemovePod", result_label(&result));
        result.map(Response::new)
    }

    async fn check_pod(&self, request: Request<CheckPodRequest>) -> Result<Response<CheckPodResponse>, Status> {
        let result = self.check(request.into_inner()).await;
        self.count("CheckPod", result_label(&result));
        result.map(Response::new)
    }

    async fn garbage_collect(
        &self,
        request: Request<GarbageCollectRequest>,
    ) -> Result<Response<GarbageCollectResponse>, Status> {
        let result = CniService::garbage_collect(self, request.into_inner()).await;
        self.count("GarbageCollect", result_label(&result));
        result.map(Response::new)
    }

    async fn ready(&self, _request: Request<ReadyRequest>) -> Result<Response<ReadyResponse>, Status> {
        self.count("Ready", "ok");
        Ok(Response::new(ReadyResponse {
            pods: self.node.pods().len() as u32,
        }))
    }
}
