//! The cluster's state: objects with resourceVersions and the history of their changes,
//! so a watch from a resourceVersion replays what came after it, then streams live.

use std::collections::BTreeMap;

use futures::{Stream, StreamExt};
use k8s_openapi::Resource;
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{ConfigMap, Node, Pod};
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
}

/// What the project's clients read and write: pods and nodes (the agent's pod source and
/// locality, the registrar's Kubernetes store), the registrar's VIP ConfigMap, and the
/// CNI installer's owner DaemonSet.
const SERVED: [Kind; 4] = [
    Kind::of::<Pod>(),
    Kind::of::<Node>(),
    Kind::of::<ConfigMap>(),
    Kind::of::<DaemonSet>(),
];

impl Kind {
    pub const fn of<K: Resource>() -> Kind {
        Kind {
            api_version: K::API_VERSION,
            kind: K::KIND,
            plural: K::URL_PATH_SEGMENT,
        }
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
    /// A replace carrying a resourceVersion that is no longer current.
    Conflict,
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
    /// Stores `object` under a new resourceVersion (ADDED or MODIFIED) and returns it as stored.
    pub fn put(&self, kind: Kind, object: Value) -> Value {
        self.write(kind, object, |_| Ok(())).expect("an unconditional write")
    }

    /// Stores `object` if `allowed` accepts what is stored under its name now (one lock: no race).
    fn write(
        &self,
        kind: Kind,
        mut object: Value,
        allowed: impl FnOnce(Option<&Value>) -> Result<(), Refusal>,
    ) -> Result<Value, Refusal> {
        let metadata = &object["metadata"];
        let name = metadata["name"].as_str().unwrap_or_default();
        let key = key(kind, metadata["namespace"].as_str().unwrap_or_default(), name);
        let mut state = self.state.lock();
        allowed(state.objects.get(&key))?;
        state.rv += 1;
        object["apiVersion"] = json!(kind.api_version);
        object["kind"] = json!(kind.kind);
        object["metadata"]["resourceVersion"] = json!(state.rv.to_string());
        let event = if state.objects.contains_key(&key) {
            "MODIFIED"
        } else {
            "ADDED"
        };
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
        self.write(kind, object, |current| match current {
            Some(_) => Err(Refusal::AlreadyExists),
            None => Ok(()),
        })
    }

    /// Replaces an object; a resourceVersion in `object` must be the current one.
    pub fn replace(
        &self,
        kind: Kind,
        namespace: Option<&str>,
        name: &str,
        mut object: Value,
    ) -> Result<Value, Refusal> {
        if let Some(namespace) = namespace {
            object["metadata"]["namespace"] = json!(namespace);
        }
        object["metadata"]["name"] = json!(name);
        let expected = object["metadata"]["resourceVersion"].clone();
        self.write(kind, object, |current| {
            let current = current.ok_or(Refusal::NotFound)?;
            match expected.is_null() || expected == current["metadata"]["resourceVersion"] {
                true => Ok(()),
                false => Err(Refusal::Conflict),
            }
        })
    }
}
