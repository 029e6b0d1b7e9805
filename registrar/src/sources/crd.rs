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
use std::sync::Arc;
use std::time::Duration;

use aether_common::kube_watch::{Change, Follow, follow_into};
use kube::core::NamespaceResourceScope;
use kube::runtime::watcher;
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

async fn collect<K>(api: Api<K::Object>, tx: watch::Sender<Option<Arc<CrdSet<K::Object>>>>)
where
    K: ObjectKind,
    K::Object: CrdObject,
{
    let (inputs_tx, inputs) = mpsc::channel(1024);
    let settings = Follow {
        what: format!("the {} CRD ({})", K::Object::kind(&()), K::Object::group(&())),
        absent_retry: ABSENT_RETRY,
        backoff: (DEBOUNCE * 5, BACKOFF_MAX),
        quiet_decoding: false,
    };
    let task = tokio::spawn(follow_into(api, watcher::Config::default(), settings, inputs_tx, |c| c));
    publish(Collected::<K>::default(), inputs, DEBOUNCE, tx).await;
    task.abort();
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
    type Input = Change<K::Object>;
    type Set = CrdSet<K::Object>;

    fn known(&self) -> Option<&CrdSet<K::Object>> {
        self.settled.then_some(&self.set)
    }

    fn apply(&mut self, input: Change<K::Object>) -> bool {
        match input {
            Change::Relist => {
                self.relist = Some(BTreeMap::new());
                return false;
            }
            Change::Applied(object) => {
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
            Change::Listed => {
                self.set.objects = self.relist.take().unwrap_or_default();
                self.settled = true;
            }
            Change::Deleted(object) => {
                self.set.objects.remove(&K::key(&object));
            }
            Change::Absent => {
                self.relist = None;
                self.set.objects.clear();
                self.settled = true;
            }
            // Not allowed to read the kind: the last set serves on.
            Change::Forbidden => return false,
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
        collected.apply(Change::Relist);
        assert!(!collected.apply(Change::Applied(policy("a", 1))));
        assert!(!collected.settled, "not known before the list is done");
        assert!(collected.apply(Change::Listed));
        let version = collected.set.spec_version;
        assert_eq!(collected.set.objects.keys().collect::<Vec<_>>(), ["shop/a"]);

        // Same generation (a status write): nothing to project again.
        assert!(!collected.apply(Change::Applied(policy("a", 1))));
        assert_eq!(collected.set.spec_version, version);
        assert!(collected.apply(Change::Applied(policy("a", 2))));
        assert!(collected.set.spec_version > version);

        collected.apply(Change::Deleted(policy("a", 2)));
        assert!(collected.set.objects.is_empty());
        collected.apply(Change::Applied(policy("b", 1)));
        assert!(collected.apply(Change::Absent), "a removed CRD empties the set");
        assert!(collected.set.objects.is_empty());
    }
}
