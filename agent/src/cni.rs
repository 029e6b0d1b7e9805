//! `aether.cni.v1.CniPlugin` on the agent's Unix socket: the CNI plugin's ADD, DEL
//! and CHECK. `AddPod` is synchronous: SUCCESS means the pod's endpoint is
//! registered, Envoy has ACKed the pod's listeners and upstream clusters, and the
//! capture rules are in its netns. Those three are independent (the pod's containers
//! have not started yet, so nothing flows before all are done) and run concurrently:
//! ADD takes the slowest of them, not their sum. A failed ADD leaves nothing behind
//! (the pod is forgotten, unregistered and uncaptured), so kubelet's retry starts clean.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
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
use tonic::{Request, Response, Status};

use crate::capture::{self, CaptureConfig, Verdict};
use crate::node::Node;
use crate::pod::LocalPod;
use crate::pod_source::PodDirectory;
use crate::registrar::Registrar;
use crate::xds;

/// How long ADD waits for Envoy to ACK the pod's listeners.
pub const ACK_TIMEOUT: Duration = Duration::from_secs(10);
/// How long DEL waits for Envoy to drop the pod's listeners (it succeeds either way).
pub const REMOVE_TIMEOUT: Duration = Duration::from_secs(5);

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
pub type Labels = [(&'static str, &'static str); 2];
type PhaseLabels = [(&'static str, &'static str); 1];

/// Seconds an `AddPod` spent in each of its phases (`register`, `envoy`, `capture`)
/// and in `total`, successful ones only.
pub type AddPhases = Family<PhaseLabels, Histogram>;

pub fn add_phases() -> AddPhases {
    // 0.5 ms to ~16 s.
    Family::new_with_constructor(|| Histogram::new(exponential_buckets(0.000_5, 2.0, 16)))
}

#[derive(Clone)]
pub struct CniService {
    pub node: Node,
    pub directory: PodDirectory,
    pub registrar: Registrar,
    pub excluded_namespaces: BTreeSet<String>,
    /// How long ADD waits for the pod source to report a pod it has not seen yet.
    pub pod_lookup_timeout: Duration,
    pub calls: Family<Labels, Counter>,
    pub add_phases: AddPhases,
    /// How pods' traffic is captured (nftables in their netns).
    pub capture: CaptureConfig,
    /// The CNI plugin's netns pins; the agent removes those under it.
    pub pin_dir: PathBuf,
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

impl CniService {
    fn count(&self, method: &'static str, result: &'static str) {
        self.calls
            .get_or_create(&[("method", method), ("result", result)])
            .inc();
    }

    async fn add(&self, request: AddPodRequest) -> Result<AddPodResponse, Status> {
        check_container_id(&request.container_id)?;
        check_netns(&request.netns_path)?;
        let pod_ref = check_pod_ref(request.pod.as_ref())?;
        let mut ips = Vec::new();
        for (i, ip) in request.ips.iter().enumerate() {
            let parsed: IpAddr = ip
                .parse()
                .map_err(|_| invalid(&format!("ips[{i}]"), format!("{} is not an IP address", quote(ip))))?;
            ips.push(parsed);
        }
        if ips.is_empty() {
            // The plugin had no prevResult IPs: read them from the pod's netns.
            ips = capture::pod_addresses(Path::new(&request.netns_path))
                .await
                .map_err(|e| Status::failed_precondition(format!("ips: none given and {e}")))?;
        }
        if ips.is_empty() {
            return Err(invalid("ips", "none given and the netns has no address"));
        }
        let capture = capture::pod_capture(&self.capture, request.capture.as_ref())
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
        let key = format!("{}/{}", pod_ref.namespace, pod_ref.name);
        if self.excluded_namespaces.contains(&pod_ref.namespace) {
            return Ok(outcome(
                Outcome::Ignored,
                format!("namespace {} is excluded from the mesh", pod_ref.namespace),
            ));
        }
        let info = self
            .directory
            .wait_for(&key, self.pod_lookup_timeout)
            .await
            .ok_or_else(|| Status::unavailable(format!("pod {key} is not known to the pod source yet; retry")))?;
        if !pod_ref.uid.is_empty() && !info.uid.is_empty() && pod_ref.uid != info.uid {
            return Err(Status::failed_precondition(format!(
                "pod.uid: {} does not match the pod source's {} for {key}",
                quote(&pod_ref.uid),
                info.uid
            )));
        }
        if !info.is_managed() {
            return Ok(outcome(
                Outcome::Ignored,
                format!("pod {key} is not managed (label {}=true)", crate::pod::MANAGED_LABEL),
            ));
        }
        for error in info.config_errors() {
            tracing::warn!(pod = %key, %error, "pod annotation entry skipped");
        }
        let pod = LocalPod {
            container_id: request.container_id,
            netns: request.netns_path.into(),
            ips,
            info,
        };
        let started = Instant::now();
        // The node builds the pod's config while the pod is written to disk.
        let generation = self.node.pods.stage(pod.clone());
        let (saved, registered, envoy, captured) = tokio::join!(
            self.node.pods.persist(generation),
            timed(self.register(&pod)),
            timed(self.wait_for_envoy(&pod, generation)),
            timed(self.capture(&pod, capture.as_ref())),
        );
        let saved = saved.map_err(|e| Status::internal(format!("saving pod {key}: {e}")));
        if let Err(error) = saved.and(registered.0).and(envoy.0).and(captured.0) {
            // Leave nothing half-configured (fail closed): the retried ADD starts clean.
            let _ = self.node.pods.remove_sandbox(&pod.id(), &pod.container_id).await;
            let _ = self.registrar.unregister(&pod.info.service(), &pod.ips).await;
            if capture.is_some()
                && let Err(e) = capture::remove(&self.capture, &pod.container_id, &pod.netns).await
            {
                tracing::warn!(pod = %key, error = %e, "removing the capture rules of a failed ADD failed");
            }
            self.node.poke();
            return Err(error);
        }
        let total = started.elapsed();
        let phases = [
            Some(("register", registered.1)),
            Some(("envoy", envoy.1)),
            capture.is_some().then_some(("capture", captured.1)),
            Some(("total", total)),
        ];
        for (phase, took) in phases.into_iter().flatten() {
            self.add_phases
                .get_or_create(&[("phase", phase)])
                .observe(took.as_secs_f64());
        }
        tracing::info!(pod = %key, service = %pod.info.service(), captured = capture.is_some(),
            took_ms = total.as_millis() as u64, register_ms = registered.1.as_millis() as u64,
            envoy_ms = envoy.1.as_millis() as u64, capture_ms = captured.1.as_millis() as u64,
            "pod added to the mesh");
        Ok(outcome(Outcome::Success, String::new()))
    }

    async fn register(&self, pod: &LocalPod) -> Result<(), Status> {
        self.registrar
            .register(pod)
            .await
            .map_err(|s| Status::unavailable(format!("registering {} with the registrar: {}", pod.id(), s.message())))
    }

    async fn capture(&self, pod: &LocalPod, capture: Option<&capture::PodCapture>) -> Result<(), Status> {
        let Some(capture) = capture else { return Ok(()) };
        capture::apply(&self.capture, &pod.container_id, &pod.netns, capture)
            .await
            .map_err(|error| Status::internal(format!("programming the capture rules of {}: {error}", pod.id())))
    }

    /// Waits until Envoy can serve the pod: a snapshot built from pod-store `generation`
    /// (or later) is out, so a previous sandbox's ACKed listeners of the same name do not
    /// count, and its listeners and its upstreams' clusters (with endpoints) are ACKed.
    async fn wait_for_envoy(&self, pod: &LocalPod, generation: u64) -> Result<(), Status> {
        let deadline = tokio::time::Instant::now() + ACK_TIMEOUT;
        let mut built = self.node.built_generation();
        if tokio::time::timeout_at(deadline, built.wait_for(|built| *built >= generation))
            .await
            .is_err()
        {
            return Err(Status::deadline_exceeded(format!(
                "the node has not rebuilt its config with {}; retry",
                pod.id()
            )));
        }
        // The pod's upstreams must be usable when ADD returns: wait until the registrar
        // has answered for a watch filter that includes them...
        let upstreams = pod.info.upstreams().services;
        let mut catalog = self.node.catalog.clone();
        let watched = loop {
            let watched = catalog.borrow_and_update().clone();
            if upstreams.iter().all(|u| watched.filter.contains(u)) {
                break watched;
            }
            if tokio::time::timeout_at(deadline, catalog.changed()).await.is_err() {
                return Err(Status::deadline_exceeded(format!(
                    "the registrar has not answered for {}'s upstreams; retry",
                    pod.id()
                )));
            }
        };
        // ...then until Envoy has ACKed the pod's listeners and those upstreams' clusters.
        let mut wanted: Vec<(&str, String)> = xds::resources::pod_listener_names(pod)
            .into_iter()
            .map(|n| (xds::LISTENER, n))
            .collect();
        if self.node.identity.is_some() {
            wanted.extend(xds::resources::pod_identity_names(pod));
        }
        for upstream in &upstreams {
            for name in xds::resources::cluster_names(&watched.catalog, upstream, &self.node.mesh_domain) {
                wanted.push((xds::CLUSTER, name.clone()));
                wanted.push((xds::ENDPOINT, name));
            }
        }
        let remaining = deadline.saturating_duration_since(tokio::time::Instant::now());
        self.node
            .cache
            .wait_acked(&wanted, remaining)
            .await
            .map_err(|e| Status::deadline_exceeded(e.to_string()))
    }

    async fn remove(&self, request: RemovePodRequest) -> Result<RemovePodResponse, Status> {
        check_container_id(&request.container_id)?;
        let Some(pod) = self.node.pods.by_container(&request.container_id) else {
            // Nothing registered, but a pin or capture state may be left from a failed ADD.
            let pin = self.pin_dir.join(&request.container_id);
            if let Err(error) = capture::remove(&self.capture, &request.container_id, &pin).await {
                tracing::warn!(container = %request.container_id, %error, "removing leftover capture rules failed");
            }
            if let Err(error) = capture::unpin(&self.pin_dir, &pin) {
                tracing::warn!(container = %request.container_id, %error, "removing a leftover netns pin failed");
            }
            return Ok(RemovePodResponse {
                outcome: Outcome::Success as i32,
                message: "unknown sandbox; nothing to do".into(),
            });
        };
        self.node
            .pods
            .remove_sandbox(&pod.id(), &pod.container_id)
            .await
            .map_err(|e| Status::internal(format!("forgetting pod {}: {e}", pod.id())))?;
        if let Err(status) = self.registrar.unregister(&pod.info.service(), &pod.ips).await {
            // DEL must not fail on a registrar outage; the endpoint's TTL reaps it.
            tracing::error!(pod = %pod.id(), %status, "could not unregister a removed pod's endpoints");
        }
        // Let Envoy close the pod's listeners before the runtime tears the netns down.
        self.node.poke();
        let names: Vec<(&str, String)> = xds::resources::pod_listener_names(&pod)
            .into_iter()
            .map(|n| (xds::LISTENER, n))
            .collect();
        if let Err(error) = self.node.cache.wait_removed(&names, REMOVE_TIMEOUT).await {
            tracing::warn!(pod = %pod.id(), %error, "the pod's listeners outlived its removal");
        }
        // The listeners are gone: drop the capture and the pin (ours from AddPod on).
        if let Err(error) = capture::remove(&self.capture, &pod.container_id, &pod.netns).await {
            tracing::warn!(pod = %pod.id(), %error, "removing the pod's capture rules failed");
        }
        if let Err(error) = capture::unpin(&self.pin_dir, &pod.netns) {
            tracing::warn!(pod = %pod.id(), netns = %pod.netns.display(), %error, "removing the netns pin failed");
        }
        tracing::info!(pod = %pod.id(), "pod removed from the mesh");
        Ok(RemovePodResponse {
            outcome: Outcome::Success as i32,
            message: String::new(),
        })
    }

    async fn check(&self, request: CheckPodRequest) -> Result<CheckPodResponse, Status> {
        check_container_id(&request.container_id)?;
        let pod = self.node.pods.by_container(&request.container_id).ok_or_else(|| {
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
        let names: Vec<(&str, String)> = xds::resources::pod_listener_names(&pod)
            .into_iter()
            .map(|n| (xds::LISTENER, n))
            .collect();
        self.node
            .cache
            .wait_acked(&names, Duration::from_millis(200))
            .await
            .map_err(|e| Status::failed_precondition(e.to_string()))?;
        match capture::check(&self.capture, &pod.container_id, &pod.netns).await {
            Ok(Verdict::Intact | Verdict::NotCaptured) => {}
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
}

impl CniService {
    async fn garbage_collect(&self, request: GarbageCollectRequest) -> Result<GarbageCollectResponse, Status> {
        for (i, id) in request.valid_container_ids.iter().enumerate() {
            check_container_id(id).map_err(|s| invalid(&format!("valid_container_ids[{i}]"), s.message()))?;
        }
        let valid: BTreeSet<&str> = request.valid_container_ids.iter().map(String::as_str).collect();
        let mut removed = BTreeSet::new();
        for pod in self.node.pods.all() {
            if !valid.contains(pod.container_id.as_str()) {
                self.remove(RemovePodRequest {
                    container_id: pod.container_id.clone(),
                    pod: None,
                })
                .await?;
                removed.insert(pod.container_id);
            }
        }
        // Pins and capture state without a pod (a failed or interrupted ADD).
        let known: Vec<String> = self.node.pods.all().into_iter().map(|p| p.container_id).collect();
        let mut leftovers = capture::orphans(&self.capture, &known);
        if let Ok(entries) = std::fs::read_dir(&self.pin_dir) {
            leftovers.extend(entries.filter_map(|e| e.ok()?.file_name().into_string().ok()));
        }
        for id in leftovers {
            if valid.contains(id.as_str()) || known.contains(&id) || check_container_id(&id).is_err() {
                continue;
            }
            let pin = self.pin_dir.join(&id);
            if let Err(error) = capture::remove(&self.capture, &id, &pin).await {
                tracing::warn!(container = %id, %error, "GC: removing leftover capture rules failed");
            }
            match capture::unpin(&self.pin_dir, &pin) {
                Ok(_) => {}
                Err(error) => tracing::warn!(container = %id, %error, "GC: removing a leftover pin failed"),
            }
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

/// Start-up: every known pod's capture is checked and repaired; desired state left by
/// pods that are gone is dropped.
pub async fn reconcile_capture(config: &CaptureConfig, pods: &[LocalPod]) {
    let mut repaired = 0;
    for pod in pods {
        match capture::repair(config, &pod.container_id, &pod.netns).await {
            Ok(true) => {
                repaired += 1;
                tracing::warn!(pod = %pod.id(), "capture rules were missing or changed; repaired");
            }
            Ok(false) => {}
            Err(error) => tracing::error!(pod = %pod.id(), %error, "checking the pod's capture rules failed"),
        }
    }
    let known: Vec<String> = pods.iter().map(|p| p.container_id.clone()).collect();
    for id in capture::orphans(config, &known) {
        let _ = capture::forget(config, &id);
    }
    tracing::info!(pods = pods.len(), repaired, "capture rules reconciled");
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
            pods: self.node.pods.all().len() as u32,
        }))
    }
}
