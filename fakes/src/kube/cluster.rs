//! The cluster's state: objects with resourceVersions and the history of their changes,
//! so a watch from a resourceVersion replays what came after it, then streams live.

use std::collections::BTreeMap;

use futures::{Stream, StreamExt};
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Node, Pod, Secret, Service};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use parking_lot::Mutex;
use serde_json::{Value, json};
use tokio::sync::broadcast;

use super::select::Selection;

/// A kind the fake serves, named as its JSON and its URLs name it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(super) struct Kind {
    pub api_version: &'static str,
    pub kind: &'static str,
    pub plural: &'static str,
    /// Whether `status` is a subresource: writes to the object leave it alone, and only
    /// writes to `<object>/status` change it (and nothing else).
    pub status: bool,
}

/// What the project's clients read and write: pods and nodes (the agent's pod source and
/// locality, the registrar's Kubernetes store), Services (their clusterIPs and
/// trafficDistribution, which the registrar carries in the catalog), the registrar's VIP ConfigMap, the
/// CNI installer's owner DaemonSet, and the Gateway API routes the registrar watches and
/// writes the status of (CRDs with the status subresource, as gateway-api installs them),
/// the mesh's AuthorizationPolicies, HTTPFilters, MeshConfigs and ExternalServices (ours, with the status subresource too),
/// and what the edge gateway reads besides routes: GatewayClasses (cluster-scoped), Gateways,
/// ReferenceGrants (v1beta1), Namespaces (their labels) and TLS Secrets.
const SERVED: [Kind; 19] = [
    Kind::of::<Pod>().with_status(),
    Kind::of::<Node>().with_status(),
    Kind::of::<Service>().with_status(),
    Kind::of::<ConfigMap>(),
    Kind::of::<Namespace>().with_status(),
    Kind::of::<Secret>(),
    Kind::of::<DaemonSet>().with_status(),
    Kind::of::<Lease>(),
    Kind::route("HTTPRoute", "httproutes"),
    Kind::route("GRPCRoute", "grpcroutes"),
    Kind {
        api_version: "gateway.networking.k8s.io/v1alpha2",
        kind: "TCPRoute",
        plural: "tcproutes",
        status: true,
    },
    Kind {
        api_version: "gateway.networking.k8s.io/v1alpha2",
        kind: "TLSRoute",
        plural: "tlsroutes",
        status: true,
    },
    Kind::route("GatewayClass", "gatewayclasses"),
    Kind::route("Gateway", "gateways"),
    Kind {
        api_version: "gateway.networking.k8s.io/v1beta1",
        kind: "ReferenceGrant",
        plural: "referencegrants",
        status: false,
    },
    Kind {
        api_version: "security.aether.io/v1alpha1",
        kind: "AuthorizationPolicy",
        plural: "authorizationpolicies",
        status: true,
    },
    Kind {
        api_version: "networking.aether.io/v1alpha1",
        kind: "HTTPFilter",
        plural: "httpfilters",
        status: true,
    },
    Kind {
        api_version: "mesh.aether.io/v1alpha1",
        kind: "MeshConfig",
        plural: "meshconfigs",
        status: true,
    },
    Kind {
        api_version: "networking.aether.io/v1alpha1",
        kind: "ExternalService",
        plural: "externalservices",
        status: true,
    },
];

impl Kind {
    pub const fn of<K: k8s_openapi::Resource>() -> Kind {
        Kind {
            api_version: K::API_VERSION,
            kind: K::KIND,
            plural: K::URL_PATH_SEGMENT,
            status: false,
        }
    }

    const fn with_status(self) -> Kind {
        Kind { status: true, ..self }
    }

    /// A `gateway.networking.k8s.io/v1` kind, with the status subresource.
    const fn route(kind: &'static str, plural: &'static str) -> Kind {
        Kind {
            api_version: "gateway.networking.k8s.io/v1",
            kind,
            plural,
            status: true,
        }
    }

    /// The served kind of `K` (any `kube::Resource`, e.g. a CRD's type); panics if the fake does not serve it.
    pub fn find<K: kube::Resource<DynamicType = ()>>() -> Kind {
        let (api_version, plural) = (K::api_version(&()), K::plural(&()));
        Kind::served(&api_version, &plural)
            .unwrap_or_else(|| panic!("the fake API server does not serve {api_version} {plural}"))
    }

    pub fn served(api_version: &str, plural: &str) -> Option<Kind> {
        SERVED
            .into_iter()
            .find(|k| k.api_version == api_version && k.plural == plural)
    }

    /// How refusals name the resource: `configmaps`, `daemonsets.apps`.
    pub fn resource(self) -> String {
        match self.api_version.split_once('/') {
            Some((group, _)) => format!("{}.{group}", self.plural),
            None => self.plural.to_owned(),
        }
    }
}

/// One change, as a watch reports it.
#[derive(Clone, Debug)]
pub(super) struct Change {
    rv: u64,
    kind: Kind,
    event: &'static str,
    object: Value,
}

impl Change {
    pub fn event(&self) -> Value {
        json!({"type": self.event, "object": self.object})
    }
}

/// Why a read or write is refused.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Refusal {
    NotFound,
    AlreadyExists,
    /// A write carrying a resourceVersion that is no longer current.
    Conflict,
    /// A request body the server cannot use.
    BadRequest(String),
}

/// Which part of an object a write addresses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Subresource {
    None,
    Status,
}

type Key = (Kind, String, String);

#[derive(Default)]
struct State {
    rv: u64,
    objects: BTreeMap<Key, Value>,
    history: Vec<Change>,
}

pub(super) struct Cluster {
    state: Mutex<State>,
    /// Sent under the state lock, so a watch's backlog and live changes neither overlap nor miss one.
    changes: broadcast::Sender<Change>,
}

impl Default for Cluster {
    fn default() -> Self {
        Cluster {
            state: Mutex::default(),
            changes: broadcast::channel(4096).0,
        }
    }
}

fn key(kind: Kind, namespace: &str, name: &str) -> Key {
    (kind, namespace.to_owned(), name.to_owned())
}

impl Cluster {
    /// Stores `object` under a new resourceVersion (ADDED or MODIFIED) and returns it as
    /// stored: whole, status included (the test acts as whoever owns each part).
    pub fn put(&self, kind: Kind, object: Value) -> Value {
        let (namespace, name) = names(&object);
        self.write(kind, &namespace, &name, |_| Ok(object))
            .expect("an unconditional write")
    }

    /// Stores what `make` builds from what is stored under the name now (one lock: no race),
    /// with the fields the server maintains ([`stamp`]).
    fn write(
        &self,
        kind: Kind,
        namespace: &str,
        name: &str,
        make: impl FnOnce(Option<&Value>) -> Result<Value, Refusal>,
    ) -> Result<Value, Refusal> {
        let key = key(kind, namespace, name);
        let mut state = self.state.lock();
        let current = state.objects.get(&key).cloned();
        let mut object = make(current.as_ref())?;
        let rv = state.rv + 1;
        stamp(&mut object, kind, current.as_ref(), rv);
        state.rv = rv;
        let event = if current.is_some() { "MODIFIED" } else { "ADDED" };
        state.objects.insert(key, object.clone());
        self.record(&mut state, kind, event, object.clone());
        Ok(object)
    }

    pub fn remove(&self, kind: Kind, namespace: &str, name: &str) -> Result<Value, Refusal> {
        let mut state = self.state.lock();
        let mut object = state
            .objects
            .remove(&key(kind, namespace, name))
            .ok_or(Refusal::NotFound)?;
        state.rv += 1;
        object["metadata"]["resourceVersion"] = json!(state.rv.to_string());
        self.record(&mut state, kind, "DELETED", object.clone());
        Ok(object)
    }

    fn record(&self, state: &mut State, kind: Kind, event: &'static str, object: Value) {
        let change = Change {
            rv: state.rv,
            kind,
            event,
            object,
        };
        state.history.push(change.clone());
        let _ = self.changes.send(change);
    }

    pub fn get(&self, kind: Kind, namespace: &str, name: &str) -> Result<Value, Refusal> {
        let state = self.state.lock();
        state
            .objects
            .get(&key(kind, namespace, name))
            .cloned()
            .ok_or(Refusal::NotFound)
    }

    /// The selected objects and the resourceVersion they are current at.
    pub fn list(&self, kind: Kind, selection: &Selection) -> (String, Vec<Value>) {
        let state = self.state.lock();
        let items = state
            .objects
            .iter()
            .filter(|((k, _, _), object)| *k == kind && selection.selects(object))
            .map(|(_, object)| object.clone());
        (state.rv.to_string(), items.collect())
    }

    /// The selected changes after `from`, then live ones. Ends if it falls behind the live
    /// changes: the client resumes from the last one it saw.
    pub fn watch(&self, kind: Kind, selection: Selection, from: u64) -> impl Stream<Item = Change> + use<> {
        let (backlog, live) = {
            let state = self.state.lock();
            let backlog: Vec<Change> = state.history.iter().filter(|c| c.rv > from).cloned().collect();
            (backlog, self.changes.subscribe())
        };
        let live = futures::stream::unfold(live, |mut live| async move { Some((live.recv().await.ok()?, live)) });
        futures::stream::iter(backlog)
            .chain(live)
            .filter(move |c| std::future::ready(c.kind == kind && selection.selects(&c.object)))
    }

    pub fn create(&self, kind: Kind, namespace: Option<&str>, mut object: Value) -> Result<Value, Refusal> {
        if let Some(namespace) = namespace {
            object["metadata"]["namespace"] = json!(namespace);
        }
        let (namespace, name) = names(&object);
        self.write(kind, &namespace, &name, |current| match current {
            Some(_) => Err(Refusal::AlreadyExists),
            None => Ok(object),
        })
    }

    /// Replaces an object (`PUT`); a resourceVersion in `object` must be the current one.
    /// With a status subresource, the stored status stays: only `/status` writes it.
    pub fn replace(&self, kind: Kind, namespace: &str, name: &str, mut object: Value) -> Result<Value, Refusal> {
        if !namespace.is_empty() {
            object["metadata"]["namespace"] = json!(namespace);
        }
        object["metadata"]["name"] = json!(name);
        self.write(kind, namespace, name, |current| {
            let current = current.ok_or(Refusal::NotFound)?;
            precondition(&object, current)?;
            if kind.status {
                set_status(&mut object, current.get("status").cloned());
            }
            Ok(object)
        })
    }

    /// Replaces an object's status (`PUT <object>/status`); the rest of `object` is ignored.
    pub fn replace_status(&self, kind: Kind, namespace: &str, name: &str, object: Value) -> Result<Value, Refusal> {
        self.write(kind, namespace, name, |current| {
            let current = current.ok_or(Refusal::NotFound)?;
            precondition(&object, current)?;
            let mut updated = current.clone();
            set_status(&mut updated, object.get("status").cloned());
            Ok(updated)
        })
    }

    /// Applies a JSON merge patch (RFC 7386) to an object, or only to its status (`PATCH
    /// <object>/status`: anything else in the patch is ignored). A resourceVersion in the
    /// patch is a precondition, as on a real server.
    pub fn merge_patch(
        &self,
        target: (Kind, &str, &str),
        subresource: Subresource,
        patch: &Value,
    ) -> Result<Value, Refusal> {
        let (kind, namespace, name) = target;
        if !patch.is_object() {
            return Err(Refusal::BadRequest("a merge patch must be a JSON object".into()));
        }
        self.write(kind, namespace, name, |current| {
            let current = current.ok_or(Refusal::NotFound)?;
            precondition(patch, current)?;
            let mut merged = current.clone();
            merge(&mut merged, patch);
            let mut updated = current.clone();
            match subresource {
                Subresource::Status => set_status(&mut updated, merged.get("status").cloned()),
                Subresource::None => {
                    // Identity cannot be patched, nor a status-subresource kind's status.
                    merged["metadata"]["name"] = current["metadata"]["name"].clone();
                    merged["metadata"]["namespace"] = current["metadata"]["namespace"].clone();
                    if kind.status {
                        set_status(&mut merged, current.get("status").cloned());
                    }
                    updated = merged;
                }
            }
            Ok(updated)
        })
    }
}

/// `metadata.namespace` and `metadata.name` of an object.
fn names(object: &Value) -> (String, String) {
    let metadata = &object["metadata"];
    let text = |field: &str| metadata[field].as_str().unwrap_or_default().to_owned();
    (text("namespace"), text("name"))
}

/// A resourceVersion in a write must be the stored one (optimistic concurrency).
fn precondition(write: &Value, current: &Value) -> Result<(), Refusal> {
    let expected = &write["metadata"]["resourceVersion"];
    match expected.is_null() || *expected == current["metadata"]["resourceVersion"] {
        true => Ok(()),
        false => Err(Refusal::Conflict),
    }
}

fn set_status(object: &mut Value, status: Option<Value>) {
    if let Some(object) = object.as_object_mut() {
        match status {
            Some(status) => object.insert("status".into(), status),
            None => object.remove("status"),
        };
    }
}

/// RFC 7386: objects merge key by key, `null` deletes a key, anything else replaces.
fn merge(target: &mut Value, patch: &Value) {
    let Value::Object(patch) = patch else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = json!({});
    }
    if let Value::Object(target) = target {
        for (key, value) in patch {
            match value {
                Value::Null => {
                    target.remove(key);
                }
                value => merge(target.entry(key.clone()).or_insert(Value::Null), value),
            }
        }
    }
}

/// What the server maintains on every write: apiVersion and kind, a new resourceVersion,
/// uid and creationTimestamp (kept from the stored object, minted on create unless given),
/// and a generation that moves only when the desired state (all but metadata and status)
/// changes.
fn stamp(object: &mut Value, kind: Kind, current: Option<&Value>, rv: u64) {
    let generation = match current {
        None => 1,
        Some(current) => {
            let stored = current["metadata"]["generation"].as_i64().unwrap_or(1);
            stored + i64::from(desired_state(current) != desired_state(object))
        }
    };
    object["apiVersion"] = json!(kind.api_version);
    object["kind"] = json!(kind.kind);
    let metadata = &mut object["metadata"];
    metadata["resourceVersion"] = json!(rv.to_string());
    metadata["generation"] = json!(generation);
    let minted = |field: &str| match field {
        "uid" => json!(format!("fake-uid-{rv}")),
        _ => serde_json::to_value(Time(Timestamp::now())).unwrap_or_default(),
    };
    for field in ["uid", "creationTimestamp"] {
        if metadata[field].is_null() {
            metadata[field] = current.map_or_else(|| minted(field), |c| c["metadata"][field].clone());
        }
    }
}

fn desired_state(object: &Value) -> Vec<(&String, &Value)> {
    let fields = object.as_object().into_iter().flatten();
    fields
        .filter(|(key, _)| !matches!(key.as_str(), "apiVersion" | "kind" | "metadata" | "status"))
        .collect()
}
