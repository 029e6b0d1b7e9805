//! The watch of one of our CRDs (AuthorizationPolicy, HTTPFilter) in all namespaces, one
//! per registrar and kind, published as the whole current set of objects after each
//! burst of events ([`CrdSet`]). Status-only changes (the registrar's own `Accepted`
//! writes, see [`super::accepted`]) do not move the set's spec version, so nothing is
//! projected again for them.
//!
//! A cluster without the CRD has none of its objects: the registrar says so once,
//! serves without them, and looks again every [`ABSENT_RETRY`].

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::marker::PhantomData;
use std::pin::pin;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use kube::core::NamespaceResourceScope;
use kube::runtime::watcher::{self, Event};
use kube::{Api, Client, Resource};
use serde::de::DeserializeOwned;
use tokio::sync::{mpsc, watch};

use super::{ObjectKind, ObjectSet};
use crate::cluster::{Collect, Sets, publish};

/// Events arriving within this window are published as one set.
pub const DEBOUNCE: Duration = Duration::from_millis(100);
/// How often a missing CRD is looked for again.
pub const ABSENT_RETRY: Duration = Duration::from_secs(30);
/// The longest pause after any other watch failure.
const BACKOFF_MAX: Duration = Duration::from_secs(30);

/// What a CRD kind's objects need to be watched.
pub trait CrdObject:
    Resource<DynamicType = (), Scope = NamespaceResourceScope> + Clone + Debug + DeserializeOwned + Send + Sync + 'static
{
}

impl<T> CrdObject for T where
    T: Resource<DynamicType = (), Scope = NamespaceResourceScope>
        + Clone
        + Debug
        + DeserializeOwned
        + Send
        + Sync
        + 'static
{
}

/// Every object of one CRD kind in the cluster.
#[derive(Clone, Debug)]
pub struct CrdSet<O> {
    /// Moves when an object was added, removed or changed its spec (uid or
    /// generation); not when only its status did.
    pub spec_version: u64,
    /// By the key of the record it projects into.
    pub objects: BTreeMap<String, O>,
}

impl<O> Default for CrdSet<O> {
    fn default() -> Self {
        CrdSet {
            spec_version: 0,
            objects: BTreeMap::new(),
        }
    }
}

impl<O: Send + Sync + 'static> ObjectSet for CrdSet<O> {
    type Object = O;
    fn spec_version(&self) -> u64 {
        self.spec_version
    }
    fn origins(&self) -> impl Iterator<Item = (String, &O)> {
        self.objects.iter().map(|(key, object)| (key.clone(), object))
    }
}

/// Starts watching the objects of `K` through `client`.
pub fn start<K>(client: Client) -> Sets<CrdSet<K::Object>>
where
    K: ObjectKind,
    K::Object: CrdObject,
{
    let (tx, sets) = watch::channel(None);
    tokio::spawn(collect::<K>(Api::all(client), tx));
    Sets::new(sets)
}

/// What the watch reports, in order.
enum Input<O> {
    /// A (re)list starts: the objects until `Listed` replace the set.
    Relist,
    Applied(O),
    Listed,
    Deleted(O),
    /// The CRD is not installed: no objects.
    Absent,
}

async fn collect<K>(api: Api<K::Object>, tx: watch::Sender<Option<Arc<CrdSet<K::Object>>>>)
where
    K: ObjectKind,
    K::Object: CrdObject,
{
    let (inputs_tx, inputs) = mpsc::channel(1024);
    let task = tokio::spawn(follow(api, inputs_tx));
    publish(Collected::<K>::default(), inputs, DEBOUNCE, tx).await;
    task.abort();
}

/// Forwards the watch, pausing after failures (a missing CRD: [`ABSENT_RETRY`]).
async fn follow<O: CrdObject>(api: Api<O>, tx: mpsc::Sender<Input<O>>) {
    let (kind, group) = (O::kind(&()), O::group(&()));
    let mut stream = pin!(watcher::watcher(api, watcher::Config::default()));
    let (mut failing, mut pause) = (None::<String>, Duration::ZERO);
    while let Some(next) = stream.next().await {
        let input = match next {
            Ok(event) => {
                if failing.take().is_some() {
                    tracing::info!(%kind, "watching {kind} objects again");
                }
                pause = Duration::ZERO;
                match event {
                    Event::Init => Input::Relist,
                    Event::InitApply(object) | Event::Apply(object) => Input::Applied(object),
                    Event::InitDone => Input::Listed,
                    Event::Delete(object) => Input::Deleted(object),
                }
            }
            Err(error) => {
                let absent = matches!(&error,
                    watcher::Error::InitialListFailed(kube::Error::Api(s))
                    | watcher::Error::WatchStartFailed(kube::Error::Api(s)) if s.code == 404);
                let text = error.to_string();
                if failing.as_ref() != Some(&text) {
                    match absent {
                        true => tracing::warn!(%kind,
                            "the {kind} CRD ({group}) is not installed (404): serving none from the cluster; looking \
                             again every {}s",
                            ABSENT_RETRY.as_secs()
                        ),
                        false => tracing::warn!(%kind, %error,
                            "watching {kind} objects failed; retrying with backoff (serving the last set)"),
                    }
                }
                failing = Some(text);
                pause = match absent {
                    true => ABSENT_RETRY,
                    false => (pause * 2).clamp(DEBOUNCE * 5, BACKOFF_MAX),
                };
                if absent && tx.send(Input::Absent).await.is_err() {
                    return;
                }
                tokio::time::sleep(pause).await;
                continue;
            }
        };
        if tx.send(input).await.is_err() {
            return;
        }
    }
}

/// The objects seen so far, and whether the set is known (listed, or no CRD).
struct Collected<K: ObjectKind> {
    set: CrdSet<K::Object>,
    relist: Option<BTreeMap<String, K::Object>>,
    settled: bool,
    kind: PhantomData<K>,
}

impl<K: ObjectKind> Default for Collected<K> {
    fn default() -> Self {
        Collected {
            set: CrdSet::default(),
            relist: None,
            settled: false,
            kind: PhantomData,
        }
    }
}

impl<K> Collect for Collected<K>
where
    K: ObjectKind,
    K::Object: CrdObject,
{
    type Input = Input<K::Object>;
    type Set = CrdSet<K::Object>;

    fn known(&self) -> Option<&CrdSet<K::Object>> {
        self.settled.then_some(&self.set)
    }

    fn apply(&mut self, input: Input<K::Object>) -> bool {
        match input {
            Input::Relist => {
                self.relist = Some(BTreeMap::new());
                return false;
            }
            Input::Applied(object) => {
                let key = K::key(&object);
                if let Some(relist) = &mut self.relist {
                    relist.insert(key, object);
                    return false;
                }
                let same_spec = self.set.objects.get(&key).is_some_and(|old| {
                    let (old, new) = (old.meta(), object.meta());
                    new.generation.is_some() && old.uid == new.uid && old.generation == new.generation
                });
                self.set.objects.insert(key, object);
                if same_spec {
                    return false;
                }
            }
            Input::Listed => {
                self.set.objects = self.relist.take().unwrap_or_default();
                self.settled = true;
            }
            Input::Deleted(object) => {
                self.set.objects.remove(&K::key(&object));
            }
            Input::Absent => {
                self.relist = None;
                self.set.objects.clear();
                self.settled = true;
            }
        }
        self.set.spec_version += 1;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policies::Policies;
    use aether_api::authorization::AuthorizationPolicy as PolicyObject;

    fn policy(name: &str, generation: i64) -> PolicyObject {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "namespace": "shop", "uid": format!("u-{name}"), "generation": generation},
            "spec": {"action": "DENY"}
        }))
        .unwrap()
    }

    #[test]
    fn a_relist_replaces_the_set_and_status_only_changes_keep_the_spec_version() {
        let mut collected = Collected::<Policies>::default();
        collected.apply(Input::Relist);
        assert!(!collected.apply(Input::Applied(policy("a", 1))));
        assert!(!collected.settled, "not known before the list is done");
        assert!(collected.apply(Input::Listed));
        let version = collected.set.spec_version;
        assert_eq!(collected.set.objects.keys().collect::<Vec<_>>(), ["shop/a"]);

        // Same generation (a status write): nothing to project again.
        assert!(!collected.apply(Input::Applied(policy("a", 1))));
        assert_eq!(collected.set.spec_version, version);
        assert!(collected.apply(Input::Applied(policy("a", 2))));
        assert!(collected.set.spec_version > version);

        collected.apply(Input::Deleted(policy("a", 2)));
        assert!(collected.set.objects.is_empty());
        collected.apply(Input::Applied(policy("b", 1)));
        assert!(collected.apply(Input::Absent), "a removed CRD empties the set");
        assert!(collected.set.objects.is_empty());
    }
}
