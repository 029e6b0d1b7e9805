//! The Kubernetes policy source: `security.aether.io/v1alpha1` AuthorizationPolicy
//! objects watched in all namespaces ([`ClusterPolicies`], one watch per registrar),
//! projected by the one projector, and an `Accepted` condition written back to each
//! ([`status`]).
//!
//! - With a writable store (`--from-kubernetes`), [`run`] makes the catalog's policies
//!   the cluster's accepted ones, through the store like routes.
//! - The Kubernetes store derives its policies from the same watch.
//!
//! A cluster without the CRD has no policies: the registrar says so once, serves
//! without them, and looks again every [`ABSENT_RETRY`].

pub mod status;

use std::collections::{BTreeMap, HashSet};
use std::pin::pin;
use std::sync::Arc;
use std::time::Duration;

use aether_api::authorization::{AuthorizationPolicy as PolicyObject, ProjectOptions};
use futures::StreamExt;
use kube::runtime::watcher::{self, Event};
use kube::{Api, Client};
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

use super::{Projector, apply, object_key};
use crate::catalog::Catalog;

/// How refusals and metrics name this source.
pub const SOURCE: &str = "kubernetes";
/// Events arriving within this window are published as one set.
pub const DEBOUNCE: Duration = Duration::from_millis(100);
/// How often a missing CRD is looked for again.
pub const ABSENT_RETRY: Duration = Duration::from_secs(30);
/// The longest pause after any other watch failure.
const BACKOFF_MAX: Duration = Duration::from_secs(30);
/// Pause before storing the policies again after the catalog could not.
const RETRY: Duration = Duration::from_secs(1);

/// Every policy object of the cluster.
#[derive(Clone, Debug, Default)]
pub struct PolicySet {
    /// Moves when an object was added, removed or changed its spec (uid or
    /// generation); not when only its status did (the registrar's own writes).
    pub spec_version: u64,
    /// By key, `<namespace>/<name>`.
    pub objects: BTreeMap<String, PolicyObject>,
}

impl PolicySet {
    /// The objects with the origin refusals name them by (their key).
    pub fn origins(&self) -> impl Iterator<Item = (String, &PolicyObject)> {
        self.objects.iter().map(|(key, object)| (key.clone(), object))
    }
}

/// A handle on the policy watch; the watch runs while any handle lives.
pub struct ClusterPolicies {
    sets: watch::Receiver<Option<Arc<PolicySet>>>,
}

impl Clone for ClusterPolicies {
    /// A clone starts with the current set unseen, so its first `next` returns it.
    fn clone(&self) -> Self {
        let mut sets = self.sets.clone();
        sets.mark_changed();
        ClusterPolicies { sets }
    }
}

impl ClusterPolicies {
    pub fn start(client: Client) -> ClusterPolicies {
        let (tx, sets) = watch::channel(None);
        tokio::spawn(collect(Api::all(client), tx));
        ClusterPolicies { sets }
    }

    /// The current set if this handle has not seen it, else the next one. The first
    /// comes once the objects were listed or the CRD found missing. `None`: the watch
    /// is gone.
    pub async fn next(&mut self) -> Option<Arc<PolicySet>> {
        loop {
            self.sets.changed().await.ok()?;
            if let Some(set) = self.sets.borrow_and_update().clone() {
                return Some(set);
            }
        }
    }
}

/// Keeps the catalog's policies equal to the cluster's accepted ones until `shutdown`.
pub async fn run(
    mut policies: ClusterPolicies,
    options: ProjectOptions,
    catalog: Catalog,
    shutdown: CancellationToken,
) {
    let metrics = catalog.metrics().clone();
    let mut projector = Projector::resuming(&catalog, options);
    let mut reported = Vec::new();
    let mut current: Option<Arc<PolicySet>> = None;
    // The spec_version last stored.
    let mut stored = None;
    loop {
        if let Some(set) = current.as_ref().filter(|s| stored != Some(s.spec_version)) {
            // The watch delivers whole sets: nothing is held back.
            let projection = projector.project_holding(set.origins(), &HashSet::new());
            if apply(&catalog, &metrics, SOURCE, projection, &mut reported).await {
                stored = Some(set.spec_version);
            }
        }
        let retry = current.as_ref().is_some_and(|s| stored != Some(s.spec_version));
        tokio::select! {
            () = shutdown.cancelled() => return,
            next = policies.next() => match next {
                Some(set) => current = Some(set),
                None => return,
            },
            () = tokio::time::sleep(RETRY), if retry => {}
        }
    }
}

/// What the watch reports, in order.
enum Input {
    /// A (re)list starts: the objects until `Listed` replace the set.
    Relist,
    Applied(PolicyObject),
    Listed,
    Deleted(PolicyObject),
    /// The CRD is not installed: no policies.
    Absent,
}

async fn collect(api: Api<PolicyObject>, tx: watch::Sender<Option<Arc<PolicySet>>>) {
    let (inputs_tx, mut inputs) = mpsc::channel(1024);
    let task = tokio::spawn(follow(api, inputs_tx));
    let mut collected = Collected::default();
    loop {
        let first = tokio::select! {
            input = inputs.recv() => input,
            () = tx.closed() => None,
        };
        let Some(first) = first else { break };
        let deadline = tokio::time::Instant::now() + DEBOUNCE;
        let mut changed = collected.apply(first);
        while let Ok(Some(input)) = tokio::time::timeout_at(deadline, inputs.recv()).await {
            changed |= collected.apply(input);
        }
        if changed && collected.settled {
            tx.send_replace(Some(Arc::new(collected.set.clone())));
        }
    }
    task.abort();
}

/// Forwards the watch, pausing after failures (a missing CRD: [`ABSENT_RETRY`]).
async fn follow(api: Api<PolicyObject>, tx: mpsc::Sender<Input>) {
    let mut stream = pin!(watcher::watcher(api, watcher::Config::default()));
    let (mut failing, mut pause) = (None::<String>, Duration::ZERO);
    while let Some(next) = stream.next().await {
        let input = match next {
            Ok(event) => {
                if failing.take().is_some() {
                    tracing::info!("watching AuthorizationPolicies again");
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
                        true => tracing::warn!(
                            "the AuthorizationPolicy CRD (security.aether.io) is not installed (404): serving no \
                             policies from the cluster; looking again every {}s",
                            ABSENT_RETRY.as_secs()
                        ),
                        false => {
                            tracing::warn!(%error, "watching AuthorizationPolicies failed; retrying with backoff (serving the last set)")
                        }
                    }
                }
                failing = Some(text);
                pause = if absent {
                    ABSENT_RETRY
                } else {
                    (pause * 2).clamp(DEBOUNCE * 5, BACKOFF_MAX)
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
#[derive(Default)]
struct Collected {
    set: PolicySet,
    relist: Option<BTreeMap<String, PolicyObject>>,
    settled: bool,
}

impl Collected {
    /// Applies one input; true if the set (or what is known of it) changed.
    fn apply(&mut self, input: Input) -> bool {
        match input {
            Input::Relist => {
                self.relist = Some(BTreeMap::new());
                return false;
            }
            Input::Applied(object) => {
                let key = object_key(&object);
                if let Some(relist) = &mut self.relist {
                    relist.insert(key, object);
                    return false;
                }
                let same_spec = self.set.objects.get(&key).is_some_and(|old| {
                    let (old, new) = (&old.metadata, &object.metadata);
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
                self.set.objects.remove(&object_key(&object));
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

    fn policy(name: &str, generation: i64) -> PolicyObject {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "namespace": "shop", "uid": format!("u-{name}"), "generation": generation},
            "spec": {"action": "DENY"}
        }))
        .unwrap()
    }

    #[test]
    fn a_relist_replaces_the_set_and_status_only_changes_keep_the_spec_version() {
        let mut collected = Collected::default();
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
