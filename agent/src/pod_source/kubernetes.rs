//! The `kubernetes` pod source: watches this node's Pods (`spec.nodeName=<node>`, all
//! namespaces) through the API server and reports them to a [`PodDirectory`].
//!
//! The mapping is the one [`manifest`](super::manifest) uses for static manifests. A pod
//! that does not convert is logged with the field at fault and skipped; the others are
//! served. Watch failures are logged (at most one warning per [`WARN_EVERY`]) and retried
//! with kube's default backoff until `shutdown`: the last good set of pods stays served
//! in the meantime, and a re-list replaces it atomically once complete.

use std::collections::HashMap;
use std::pin::pin;
use std::time::Duration;

use aether_common::pod_meta::{NodeLocality, locality_from_labels};
use aether_proto::registry::v1::Locality;
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::runtime::WatchStreamExt;
use kube::runtime::utils::Backoff;
use kube::runtime::watcher::{self, DefaultBackoff, Event};
use kube::{Api, Client};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::PodDirectory;
use crate::pod::{ContainerPort, PodError, PodInfo};

/// At most one warning about a failing watch per this interval; the rest go to debug.
pub const WARN_EVERY: Duration = Duration::from_secs(30);

/// No Kubernetes client could be built.
#[derive(Debug, thiserror::Error)]
#[error("cannot build a Kubernetes client (tried KUBECONFIG, ~/.kube/config and the in-cluster service account): {0}")]
pub struct ClientError(#[source] kube::Error);

/// A Kubernetes client from `KUBECONFIG` / `~/.kube/config`, else the in-cluster
/// service account.
pub async fn client_from_env() -> Result<Client, ClientError> {
    Client::try_default().await.map_err(ClientError)
}

/// Why the agent's Node could not be read.
#[derive(Debug, thiserror::Error)]
pub enum NodeReadError {
    /// The API server refused (no RBAC, no such Node): not retried.
    #[error("reading Node {node}: {status}")]
    Refused {
        node: String,
        status: Box<kube::core::Status>,
    },
    /// Still failing after [`NODE_ATTEMPTS`]; the last error.
    #[error("reading Node {node} ({attempts} attempts): {last}")]
    Failed { node: String, attempts: u32, last: String },
}

/// Attempts at reading the agent's Node before going on without its locality.
pub const NODE_ATTEMPTS: u32 = 3;
/// Bound on one read of the Node (an API server that accepts but never answers).
pub const NODE_READ_TIMEOUT: Duration = Duration::from_secs(5);
/// Pause before the first retry; doubled after each.
const NODE_RETRY: Duration = Duration::from_millis(500);

/// The locality of the Node `node_name` from its topology labels (as the registrar's
/// Kubernetes store reads them). A transient failure (transport, timeout, 5xx, 429) is
/// retried a few times; a refusal (403: no RBAC, 404: no such Node) is not. On failure
/// the error names what went wrong; the caller goes on without a locality.
pub async fn node_locality(client: Client, node_name: &str) -> Result<NodeLocality, NodeReadError> {
    let api: Api<Node> = Api::all(client);
    let mut delay = NODE_RETRY;
    let mut attempt = 1;
    loop {
        let error = match tokio::time::timeout(NODE_READ_TIMEOUT, api.get(node_name)).await {
            Ok(Ok(node)) => {
                let labels = node.metadata.labels.iter().flatten();
                return Ok(locality_from_labels(labels.map(|(k, v)| (k.as_str(), v.as_str()))));
            }
            Ok(Err(kube::Error::Api(status))) if status.code < 500 && status.code != 429 => {
                return Err(NodeReadError::Refused {
                    node: node_name.to_owned(),
                    status,
                });
            }
            Ok(Err(error)) => error.to_string(),
            Err(_) => format!("no answer within {NODE_READ_TIMEOUT:?}"),
        };
        if attempt >= NODE_ATTEMPTS {
            return Err(NodeReadError::Failed {
                node: node_name.to_owned(),
                attempts: attempt,
                last: error,
            });
        }
        tracing::debug!(node = %node_name, %error, attempt, "reading the node failed; retrying");
        tokio::time::sleep(delay).await;
        delay *= 2;
        attempt += 1;
    }
}

/// The agent's locality: each of `flags` given (non-empty) wins; region and zone not
/// given come from the Node's topology labels. A Node that cannot be read is logged
/// once and leaves them empty: start-up goes on (bounded by [`node_locality`]'s retries).
pub async fn locality(flags: Locality, client: Client, node_name: &str) -> Locality {
    let mut locality = flags;
    if !locality.region.is_empty() && !locality.zone.is_empty() {
        return locality;
    }
    match node_locality(client, node_name).await {
        Ok(labels) => {
            if locality.region.is_empty() {
                locality.region = labels.region;
            }
            if locality.zone.is_empty() {
                locality.zone = labels.zone;
            }
            tracing::info!(node = %node_name, region = %locality.region, zone = %locality.zone,
                subzone = %locality.subzone, "locality from the node's topology labels");
        }
        Err(error) => tracing::warn!(%error, region = %locality.region, zone = %locality.zone,
            "the node's locality is unknown: its endpoints register without it, so locality-aware routing \
             cannot prefer them (the agent needs `get` on `nodes`)"),
    }
    locality
}

/// Watches the Pods scheduled on `node_name` and keeps `directory` equal to them (keyed
/// `<ns>/<name>`): after the initial list and after every change. Returns only on `shutdown`.
pub async fn run(client: Client, node_name: String, directory: PodDirectory, shutdown: CancellationToken) {
    let api: Api<Pod> = Api::all(client);
    let config = watcher::Config::default().fields(&format!("spec.nodeName={node_name}"));
    let mut pods = NodePods::default();
    let mut errors = ErrorLog::default();
    // Between whole-watcher restarts (see `must_restart`); kube's own backoff covers the rest.
    let mut restart_backoff = DefaultBackoff::default();
    tracing::info!(node = %node_name, "watching the node's pods");
    loop {
        let mut events = pin!(watcher::watcher(api.clone(), config.clone()).default_backoff());
        loop {
            let next = tokio::select! {
                _ = shutdown.cancelled() => return,
                next = events.next() => next,
            };
            match next {
                Some(Ok(event)) => {
                    if matches!(event, Event::Apply(_) | Event::Delete(_)) {
                        restart_backoff.reset();
                    }
                    errors.ok();
                    if let Some(all) = pods.apply(event) {
                        directory.replace_all(all);
                    }
                }
                Some(Err(error)) => {
                    errors.error(&error);
                    if must_restart(&error) {
                        break;
                    }
                }
                // The watcher stream never ends; if it does, start over.
                None => break,
            }
        }
        let delay = restart_backoff.next().unwrap_or(Duration::from_secs(30));
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(delay) => {}
        }
    }
}

/// An HTTP 410 answering the watch request itself: kube keeps re-watching from the same
/// expired resourceVersion, so start a new watcher, which re-lists. (A 410 `ERROR` event
/// inside the watch stream, the API server's usual answer, already makes kube re-list.)
fn must_restart(error: &watcher::Error) -> bool {
    matches!(error, watcher::Error::WatchStartFailed(kube::Error::Api(status)) if status.code == 410)
}

fn is_gone(error: &watcher::Error) -> bool {
    match error {
        watcher::Error::WatchError(status) => status.code == 410,
        watcher::Error::WatchStartFailed(kube::Error::Api(status)) => status.code == 410,
        _ => false,
    }
}

/// Converts one Pod. Errors name the field at fault.
pub fn pod_info(pod: &Pod) -> Result<PodInfo, PodError> {
    let metadata = &pod.metadata;
    let name = metadata
        .name
        .clone()
        .filter(|n| !n.is_empty())
        .ok_or(PodError::Missing("metadata.name"))?;
    let namespace = metadata.namespace.clone().unwrap_or_else(|| "default".into());
    crate::upstreams::check(&namespace).map_err(PodError::Namespace)?;
    let spec = pod.spec.as_ref().ok_or(PodError::Missing("spec"))?;
    let mut ports = Vec::new();
    for (c, container) in spec.containers.iter().enumerate() {
        for (p, port) in container.ports.iter().flatten().enumerate() {
            ports.push(ContainerPort::from_spec(
                &format!("spec.containers[{c}].ports[{p}]"),
                i64::from(port.container_port),
                port.name.as_deref(),
                port.protocol.as_deref(),
            )?);
        }
    }
    Ok(PodInfo {
        uid: metadata.uid.clone().unwrap_or_default(),
        service_account: spec.service_account_name.clone().unwrap_or_else(|| "default".into()),
        labels: metadata.labels.clone().unwrap_or_default(),
        annotations: metadata.annotations.clone().unwrap_or_default(),
        terminating: metadata.deletion_timestamp.is_some(),
        ports,
        namespace,
        name,
    })
}

/// `<ns>/<name>`, also for a pod that does not convert.
fn key(pod: &Pod) -> String {
    format!(
        "{}/{}",
        pod.metadata.namespace.as_deref().unwrap_or("default"),
        pod.metadata.name.as_deref().unwrap_or_default()
    )
}

/// The node's pods as the watch reports them, converted.
#[derive(Default)]
struct NodePods {
    served: HashMap<String, PodInfo>,
    /// Pods that did not convert, with the error last logged (to log each error once).
    rejected: HashMap<String, PodError>,
    /// A re-list in progress: replaces `served` at `InitDone`.
    relist: Option<HashMap<String, PodInfo>>,
}

impl NodePods {
    /// Applies one watch event; returns the full set when it is to be published.
    fn apply(&mut self, event: Event<Pod>) -> Option<HashMap<String, PodInfo>> {
        match event {
            Event::Init => {
                self.relist = Some(HashMap::new());
                None
            }
            Event::InitApply(pod) => {
                let (key, info) = self.convert(&pod);
                if let Some(info) = info {
                    self.relist.get_or_insert_default().insert(key, info);
                }
                None
            }
            Event::InitDone => {
                self.served = self.relist.take().unwrap_or_default();
                self.rejected.retain(|key, _| !self.served.contains_key(key));
                tracing::debug!(pods = self.served.len(), "pod list complete");
                Some(self.served.clone())
            }
            Event::Apply(pod) => {
                let (key, info) = self.convert(&pod);
                match info {
                    Some(info) => self.served.insert(key, info),
                    None => self.served.remove(&key),
                };
                Some(self.served.clone())
            }
            Event::Delete(pod) => {
                let key = key(&pod);
                self.rejected.remove(&key);
                self.served.remove(&key);
                Some(self.served.clone())
            }
        }
    }

    fn convert(&mut self, pod: &Pod) -> (String, Option<PodInfo>) {
        let key = key(pod);
        match pod_info(pod) {
            Ok(info) => {
                self.rejected.remove(&key);
                (key, Some(info))
            }
            Err(error) => {
                if self.rejected.get(&key) != Some(&error) {
                    tracing::warn!(pod = %key, %error, "skipping a pod");
                    self.rejected.insert(key.clone(), error);
                }
                (key, None)
            }
        }
    }
}

/// Rate-limits watch error logs: a warning, then at most one per [`WARN_EVERY`].
#[derive(Default)]
struct ErrorLog {
    last_warning: Option<Instant>,
    suppressed: u64,
    failing: bool,
}

impl ErrorLog {
    fn error(&mut self, error: &watcher::Error) {
        if is_gone(error) {
            tracing::info!(%error, "pod watch resourceVersion expired; re-listing");
            return;
        }
        self.failing = true;
        let now = Instant::now();
        if self.last_warning.is_none_or(|at| now.duration_since(at) >= WARN_EVERY) {
            tracing::warn!(%error, suppressed = self.suppressed, "pod watch failed; retrying with backoff");
            self.last_warning = Some(now);
            self.suppressed = 0;
        } else {
            self.suppressed += 1;
            tracing::debug!(%error, "pod watch failed; retrying with backoff");
        }
    }

    fn ok(&mut self) {
        if std::mem::take(&mut self.failing) {
            tracing::info!("pod watch recovered");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(json: serde_json::Value) -> Pod {
        serde_json::from_value(json).expect("a Pod")
    }

    #[test]
    fn maps_the_fields_like_a_manifest() {
        let info = pod_info(&pod(serde_json::json!({
            "metadata": {"name": "web-1", "namespace": "shop", "uid": "u-1",
                "labels": {"aether.io/managed": "true"},
                "annotations": {"config.aether.io/upstreams": "cart"},
                "deletionTimestamp": "2025-01-01T00:00:00Z"},
            "spec": {"serviceAccountName": "web", "containers": [
                {"name": "app", "ports": [{"name": "http", "containerPort": 8080},
                                          {"containerPort": 53, "protocol": "UDP"}]},
                {"name": "side", "ports": [{"name": "grpc", "containerPort": 9090}]}]}
        })))
        .unwrap();
        assert_eq!(info.key(), "shop/web-1");
        assert_eq!(info.uid, "u-1");
        assert_eq!(info.service(), "shop/web");
        assert!(info.is_managed());
        assert_eq!(info.annotations["config.aether.io/upstreams"], "cart");
        assert!(info.terminating);
        let ports: Vec<_> = info
            .ports
            .iter()
            .map(|p| (p.name.as_str(), p.port, p.protocol.as_str()))
            .collect();
        assert_eq!(ports, [("http", 8080, "TCP"), ("", 53, "UDP"), ("grpc", 9090, "TCP")]);
    }

    #[test]
    fn applies_the_defaults() {
        let info = pod_info(&pod(serde_json::json!({
            "metadata": {"name": "a"},
            "spec": {"containers": [{"name": "app"}]}
        })))
        .unwrap();
        assert_eq!(info.key(), "default/a");
        assert_eq!(info.service_account, "default");
        assert!(info.ports.is_empty() && info.labels.is_empty() && info.uid.is_empty());
        assert!(!info.terminating);
    }

    #[test]
    fn errors_name_the_field() {
        let bad_port = |port: i64| {
            pod_info(&pod(serde_json::json!({
                "metadata": {"name": "a"},
                "spec": {"containers": [{"name": "app", "ports": [{"containerPort": 80}, {"containerPort": port}]}]}
            })))
            .unwrap_err()
            .to_string()
        };
        assert_eq!(
            bad_port(70000),
            "spec.containers[0].ports[1].containerPort: 70000 is out of range (1..=65535)"
        );
        assert_eq!(
            bad_port(0),
            "spec.containers[0].ports[1].containerPort: 0 is out of range (1..=65535)"
        );
        assert_eq!(
            bad_port(-1),
            "spec.containers[0].ports[1].containerPort: -1 is out of range (1..=65535)"
        );
        assert_eq!(
            pod_info(&Pod::default()).unwrap_err().to_string(),
            "metadata.name: missing"
        );
        assert_eq!(
            pod_info(&pod(serde_json::json!({"metadata": {"name": "a"}}))).unwrap_err(),
            PodError::Missing("spec")
        );
        assert!(
            pod_info(&pod(
                serde_json::json!({"metadata": {"name": "a", "namespace": "Shop"}, "spec": {"containers": []}})
            ))
            .unwrap_err()
            .to_string()
            .starts_with("metadata.namespace: ")
        );
    }

    #[test]
    fn a_relist_replaces_the_set_and_a_bad_pod_is_skipped() {
        let named = |name: &str, port: i64| {
            pod(serde_json::json!({
                "metadata": {"name": name, "namespace": "ns"},
                "spec": {"containers": [{"name": "app", "ports": [{"containerPort": port}]}]}
            }))
        };
        let mut pods = NodePods::default();
        assert!(pods.apply(Event::Init).is_none());
        assert!(pods.apply(Event::InitApply(named("a", 80))).is_none());
        assert!(pods.apply(Event::InitApply(named("bad", 70000))).is_none());
        let all = pods.apply(Event::InitDone).unwrap();
        assert_eq!(all.keys().collect::<Vec<_>>(), ["ns/a"]);
        assert!(pods.rejected.contains_key("ns/bad"));

        // A served pod turning bad leaves; a bad one fixed joins.
        let all = pods.apply(Event::Apply(named("a", 0))).unwrap();
        assert!(all.is_empty());
        let all = pods.apply(Event::Apply(named("bad", 81))).unwrap();
        assert_eq!(all["ns/bad"].ports[0].port, 81);

        // The re-list keeps serving the old set until done, then drops what is gone.
        pods.apply(Event::Init);
        pods.apply(Event::InitApply(named("c", 82)));
        assert!(pods.served.contains_key("ns/bad"));
        let all = pods.apply(Event::InitDone).unwrap();
        assert_eq!(all.keys().collect::<Vec<_>>(), ["ns/c"]);
        assert!(pods.apply(Event::Delete(named("c", 82))).unwrap().is_empty());
    }
}
