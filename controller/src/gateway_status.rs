//! The edge's Gateway API status (proposals/018), written by the leader only
//! (`--gateway-status`, on by default): the verdict of the one projector,
//! `aether_api::edge::project`, which the edge serves from too, so what `kubectl get
//! gateway` says and what the edge serves never disagree.
//!
//! - GatewayClasses naming `aether.io/edge`: `status.conditions` (Accepted).
//! - Gateways of such a class: `status.conditions` (Accepted, Programmed),
//!   `status.listeners[]` (supportedKinds, attachedRoutes, conditions) and
//!   `status.addresses`, from the Service of the Gateway's edge
//!   ([`desired::addresses`]): its load balancer's IPs and hostnames, else its clusterIP.
//! - Routes (HTTP, GRPC, TLS, TCP): one `status.parents[]` entry with controllerName
//!   `aether.io/edge` per parentRef naming such a Gateway, beside other controllers'
//!   entries (the mesh's for Service parents), which are never touched.
//!
//! While leading, the controller watches the kinds the projector reads
//! ([`objects`]) and `get`s the Secrets the listeners name ([`secrets`]; never listed,
//! watched or logged). Each burst of changes, and every refresh period, makes one
//! pass: project every Gateway of the class, and write each status that differs from
//! what its object holds (a condition whose status did not change keeps its
//! lastTransitionTime) as a JSON merge patch of the status subresource carrying the
//! object's resourceVersion. A write that meets a newer object (409) is made again from
//! it on the next pass. A replica that stops leading stops watching and writing; a new
//! leader starts afresh. A missing Gateway API CRD is said once and looked for again
//! every 30 s; none of this gates readiness.

pub mod desired;
pub mod objects;
pub mod secrets;

use std::collections::HashMap;
use std::fmt::Debug;
use std::time::Duration;

use aether_api::gateway::{Gateway, GatewayClass, GrpcRoute, HttpRoute, TcpRoute, TlsRoute};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Patch, PatchParams};
use kube::{Api, Client, Resource};
use serde::de::DeserializeOwned;
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use desired::{RouteKind, Target, Write};
use objects::Watches;
use secrets::Secrets;

/// The field manager of the controller's status writes.
pub const FIELD_MANAGER: &str = "aether-controller";

/// How the writer paces itself.
#[derive(Clone, Copy, Debug)]
pub struct Timing {
    /// Changes arriving within this window make one pass.
    pub debounce: Duration,
    /// How often the Secrets are read again (and every status looked at) without a change.
    pub refresh: Duration,
    /// How often a kind whose CRD is not installed is looked for again.
    pub absent_retry: Duration,
}

impl Default for Timing {
    fn default() -> Self {
        Timing {
            debounce: Duration::from_millis(100),
            refresh: Duration::from_secs(30),
            absent_retry: Duration::from_secs(30),
        }
    }
}

pub struct StatusWriter {
    pub client: Client,
    /// The controller's namespace, where the chart creates the edges and their Services.
    pub edges_namespace: String,
    pub timing: Timing,
}

impl StatusWriter {
    /// Writes the edge's status while `leading` is true, until `shutdown`.
    pub async fn run(self, mut leading: watch::Receiver<bool>, shutdown: CancellationToken) {
        loop {
            while !*leading.borrow_and_update() {
                tokio::select! {
                    () = shutdown.cancelled() => return,
                    changed = leading.changed() => if changed.is_err() {
                        return shutdown.cancelled().await;
                    },
                }
            }
            tracing::info!("leading: writing the edge's Gateway API status");
            let mut watches = Watches::start(&self.client, self.timing.absent_retry);
            let mut term = Term::new(self.client.clone(), &self.edges_namespace);
            let mut refresh_at = Instant::now();
            loop {
                let refresh = Instant::now() >= refresh_at;
                if refresh {
                    refresh_at = Instant::now() + self.timing.refresh;
                }
                term.pass(&watches, refresh, &leading).await;
                tokio::select! {
                    () = shutdown.cancelled() => return,
                    changed = leading.changed() => {
                        if changed.is_err() {
                            return shutdown.cancelled().await;
                        }
                        if !*leading.borrow_and_update() {
                            break;
                        }
                    }
                    () = watches.changed() => tokio::time::sleep(self.timing.debounce).await,
                    () = tokio::time::sleep_until(refresh_at) => {}
                }
            }
            tracing::info!("no longer leading: the edge's Gateway API status is left to the leader");
        }
    }
}

/// What one leadership term remembers.
struct Term {
    client: Client,
    edges_namespace: String,
    secrets: Secrets,
    /// The resourceVersion each object's status was last written from: until the watch
    /// brings the newer version, there is nothing to recompute.
    written: HashMap<String, String>,
    /// The last failure per object, said once until it changes or clears.
    failing: HashMap<String, String>,
}

impl Term {
    fn new(client: Client, edges_namespace: &str) -> Term {
        Term {
            secrets: Secrets::new(client.clone()),
            client,
            edges_namespace: edges_namespace.to_owned(),
            written: HashMap::new(),
            failing: HashMap::new(),
        }
    }

    /// Reads what is needed and writes every status that differs (nothing before every
    /// kind is known). Stops writing the moment this replica stops leading.
    async fn pass(&mut self, watches: &Watches, refresh: bool, leading: &watch::Receiver<bool>) {
        let Some(wanted) = watches.read(secrets::wanted) else {
            return;
        };
        let held = self.secrets.update(&wanted, refresh).await;
        let now = Time(Timestamp::from_second(Timestamp::now().as_second()).unwrap_or(Timestamp::UNIX_EPOCH));
        let secrets = self.secrets.found();
        let Some(writes) =
            watches.read(|objects| desired::writes(objects, secrets, &held, &self.edges_namespace, &now))
        else {
            return;
        };
        let pending: HashMap<String, &Write> = writes.iter().map(|w| (w.target.key(), w)).collect();
        self.written.retain(|key, _| pending.contains_key(key));
        self.failing.retain(|key, _| pending.contains_key(key));
        for write in &writes {
            if self.written.get(&write.target.key()) == Some(&write.resource_version) {
                continue;
            }
            if !*leading.borrow() {
                return;
            }
            self.write(write).await;
        }
    }

    async fn write(&mut self, write: &Write) {
        let key = write.target.key();
        let patch = serde_json::json!({
            "metadata": {"resourceVersion": write.resource_version},
            "status": write.status,
        });
        let patch = Patch::Merge(&patch);
        let params = PatchParams {
            field_manager: Some(FIELD_MANAGER.to_owned()),
            ..PatchParams::default()
        };
        let client = self.client.clone();
        let written = match &write.target {
            Target::Class(name) => patch_status(Api::<GatewayClass>::all(client), name, &params, &patch).await,
            Target::Gateway { namespace, name } => {
                patch_status(Api::<Gateway>::namespaced(client, namespace), name, &params, &patch).await
            }
            Target::Route { kind, namespace, name } => match kind {
                RouteKind::Http => route_status::<HttpRoute>(client, namespace, name, &params, &patch).await,
                RouteKind::Grpc => route_status::<GrpcRoute>(client, namespace, name, &params, &patch).await,
                RouteKind::Tcp => route_status::<TcpRoute>(client, namespace, name, &params, &patch).await,
                RouteKind::Tls => route_status::<TlsRoute>(client, namespace, name, &params, &patch).await,
            },
        };
        match written {
            Ok(()) => {
                tracing::debug!(object = %key, "Gateway API status written");
                if self.failing.remove(&key).is_some() {
                    tracing::info!(object = %key, "Gateway API status written again");
                }
                self.written.insert(key, write.resource_version.clone());
            }
            // Changed (or gone) since it was read: the watch brings the newer version.
            Err(kube::Error::Api(status)) if matches!(status.code, 404 | 409) => {
                tracing::debug!(object = %key, code = status.code, "changed before its Gateway API status was written");
            }
            Err(error) => {
                let text = error.to_string();
                if self.failing.get(&key) != Some(&text) {
                    tracing::warn!(object = %key, %error,
                        "writing the Gateway API status failed (is the controller allowed to patch its /status?); \
                         retrying");
                    self.failing.insert(key, text);
                }
            }
        }
    }
}

/// A JSON merge patch of one object's status subresource.
async fn patch_status<K>(
    api: Api<K>,
    name: &str,
    params: &PatchParams,
    patch: &Patch<&serde_json::Value>,
) -> Result<(), kube::Error>
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug,
{
    api.patch_status(name, params, patch).await.map(drop)
}

/// [`patch_status`] of a route of kind `K`.
async fn route_status<K>(
    client: Client,
    namespace: &str,
    name: &str,
    params: &PatchParams,
    patch: &Patch<&serde_json::Value>,
) -> Result<(), kube::Error>
where
    K: Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope> + Clone + DeserializeOwned + Debug,
{
    patch_status(Api::<K>::namespaced(client, namespace), name, params, patch).await
}
