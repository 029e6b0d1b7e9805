//! The snapshot cache: every resource Envoy may ask for, by type and name, with a
//! version that is a hash of its encoded bytes. A new snapshot is published only when
//! some resource's bytes changed, and streams push only the resources whose version
//! differs from what their Envoy holds. The cache also records what Envoy has ACKed,
//! so callers can wait until a change is live.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use aether_common::hash::{fnv1a, fnv1a_extend};
use envoy_types::pb::google::protobuf::Any;
use tokio::sync::watch;

/// One resource as served. Its version is computed once, when it is generated.
#[derive(Debug, PartialEq)]
pub struct Resource {
    pub name: String,
    pub version: String,
    pub body: Any,
}

impl Resource {
    pub fn new(name: String, body: Any) -> Arc<Self> {
        Arc::new(Self {
            version: version_of(&body),
            name,
            body,
        })
    }

    /// A resource whose version also covers `depends_on` (a version string), so it is
    /// re-sent whenever that changes even if its own bytes did not: Envoy re-creates an
    /// updated EDS cluster and waits for its endpoints again.
    pub fn depending_on(name: String, body: Any, depends_on: &str) -> Arc<Self> {
        let hash = fnv1a_extend(fnv1a(version_of(&body).as_bytes()), depends_on.as_bytes());
        Arc::new(Self {
            version: format!("{hash:016x}"),
            name,
            body,
        })
    }
}

/// Everything served at one moment: type URL → name → resource.
#[derive(Debug, Default)]
pub struct Snapshot {
    pub serial: u64,
    pub types: BTreeMap<String, BTreeMap<String, Arc<Resource>>>,
    /// Names being looked up on demand (type URL, name): not served yet, but not to be
    /// reported absent either until the lookup ends.
    pub pending: BTreeSet<(String, String)>,
}

impl Snapshot {
    pub fn get(&self, type_url: &str) -> Option<&BTreeMap<String, Arc<Resource>>> {
        self.types.get(type_url)
    }

    pub fn version_of(&self, type_url: &str, name: &str) -> Option<&str> {
        self.types.get(type_url)?.get(name).map(|r| r.version.as_str())
    }
}

/// Resources a response carried: name, and version (`None`: removed).
pub type Sent = Vec<(String, Option<String>)>;

/// What the connected Envoy has ACKed: type URL → name → version.
pub type Acked = HashMap<String, HashMap<String, String>>;

/// What Envoy rejected: (type URL, name) → (version, Envoy's error).
pub type Rejected = HashMap<(String, String), (String, String)>;

#[derive(Clone)]
pub struct Cache {
    snapshot: Arc<watch::Sender<Arc<Snapshot>>>,
    acked: Arc<watch::Sender<Acked>>,
    rejected: Arc<Mutex<Rejected>>,
    /// Serialises updates (generators may run from more than one task).
    update: Arc<Mutex<()>>,
}

impl Default for Cache {
    fn default() -> Self {
        Self {
            snapshot: Arc::new(watch::channel(Arc::new(Snapshot::default())).0),
            acked: Arc::new(watch::channel(Acked::default()).0),
            rejected: Arc::default(),
            update: Arc::default(),
        }
    }
}

pub fn version_of(body: &Any) -> String {
    let hash = fnv1a_extend(fnv1a(body.type_url.as_bytes()), &body.value);
    format!("{hash:016x}")
}

impl Cache {
    /// Replaces the served resources with `resources` (type URL → named bodies).
    /// Resources whose bytes did not change keep their `Arc` and version. Returns
    /// whether anything changed.
    pub fn set(&self, resources: BTreeMap<String, Vec<Arc<Resource>>>) -> bool {
        self.set_with_pending(resources, BTreeSet::new())
    }

    /// [`Cache::set`], with the names still being looked up on demand.
    pub fn set_with_pending(
        &self,
        resources: BTreeMap<String, Vec<Arc<Resource>>>,
        pending: BTreeSet<(String, String)>,
    ) -> bool {
        let _serial = self.update.lock().expect("cache update lock");
        let current = self.snapshot.borrow().clone();
        let mut types = BTreeMap::new();
        let mut changed = false;
        for (type_url, items) in resources {
            let old = current.types.get(&type_url);
            let mut named = BTreeMap::new();
            for resource in items {
                let resource = match old.and_then(|o| o.get(&resource.name)) {
                    Some(prev) if prev.version == resource.version => prev.clone(),
                    _ => {
                        changed = true;
                        resource
                    }
                };
                named.insert(resource.name.clone(), resource);
            }
            if old.map_or(0, BTreeMap::len) != named.len() {
                changed = true;
            }
            types.insert(type_url, named);
        }
        if current.types.keys().any(|t| !types.contains_key(t)) || current.pending != pending {
            changed = true;
        }
        if changed {
            self.snapshot.send_replace(Arc::new(Snapshot {
                serial: current.serial + 1,
                types,
                pending,
            }));
        }
        changed
    }

    /// Marks names as being looked up on demand, publishing at once.
    pub fn add_pending(&self, items: impl IntoIterator<Item = (String, String)>) {
        let _serial = self.update.lock().expect("cache update lock");
        let current = self.snapshot.borrow().clone();
        let mut pending = current.pending.clone();
        pending.extend(items);
        if pending != current.pending {
            self.snapshot.send_replace(Arc::new(Snapshot {
                serial: current.serial + 1,
                types: current.types.clone(),
                pending,
            }));
        }
    }

    pub fn snapshot(&self) -> Arc<Snapshot> {
        self.snapshot.borrow().clone()
    }

    pub fn subscribe(&self) -> watch::Receiver<Arc<Snapshot>> {
        self.snapshot.subscribe()
    }

    /// Records that Envoy ACKed these versions (`None` version: the resource was removed).
    pub fn record_ack(&self, type_url: &str, resources: &[(String, Option<String>)]) {
        self.acked.send_modify(|acked| {
            let by_name = acked.entry(type_url.to_owned()).or_default();
            for (name, version) in resources {
                match version {
                    Some(v) => by_name.insert(name.clone(), v.clone()),
                    None => by_name.remove(name),
                };
            }
        });
    }

    /// Records that Envoy rejected these versions, with its error.
    pub fn record_nack(&self, type_url: &str, resources: &Sent, error: &str) {
        {
            let mut rejected = self.rejected.lock().expect("rejected lock");
            for (name, version) in resources {
                if let Some(version) = version {
                    rejected.insert((type_url.to_owned(), name.clone()), (version.clone(), error.to_owned()));
                }
            }
        }
        // Wake waiters so they see the rejection.
        self.acked.send_modify(|_| {});
    }

    /// Forgets everything acked (the Envoy stream ended).
    pub fn clear_acks(&self) {
        self.acked.send_replace(Acked::default());
    }

    pub fn acked(&self) -> Acked {
        self.acked.borrow().clone()
    }

    /// Waits until Envoy no longer holds any of the named resources (their removal was
    /// ACKed, or no Envoy is connected).
    pub async fn wait_removed(&self, names: &[(&str, String)], timeout: Duration) -> Result<(), String> {
        let mut acks = self.acked.subscribe();
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let held: Vec<String> = {
                let acked = acks.borrow_and_update();
                names
                    .iter()
                    .filter(|(type_url, name)| acked.get(*type_url).is_some_and(|m| m.contains_key(name)))
                    .map(|(_, name)| name.clone())
                    .collect()
            };
            if held.is_empty() {
                return Ok(());
            }
            if tokio::time::timeout_at(deadline, acks.changed()).await.is_err() {
                return Err(format!("Envoy still holds {}", held.join(", ")));
            }
        }
    }

    /// Waits until Envoy has ACKed the current version of every named resource; fails
    /// at once if Envoy rejected one of them.
    pub async fn wait_acked(&self, wanted: &[(&str, String)], timeout: Duration) -> Result<(), String> {
        let mut acks = self.acked.subscribe();
        let mut snapshots = self.snapshot.subscribe();
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let missing: Vec<String> = {
                let snapshot = snapshots.borrow_and_update().clone();
                let acked = acks.borrow_and_update();
                wanted
                    .iter()
                    .filter(|(type_url, name)| {
                        let served = snapshot.version_of(type_url, name);
                        let have = acked.get(*type_url).and_then(|m| m.get(name)).map(String::as_str);
                        served.is_none() || served != have
                    })
                    .map(|(_, name)| name.clone())
                    .collect()
            };
            if missing.is_empty() {
                return Ok(());
            }
            {
                let snapshot = snapshots.borrow().clone();
                let rejected = self.rejected.lock().expect("rejected lock");
                for (type_url, name) in wanted {
                    let key = ((*type_url).to_owned(), name.clone());
                    if let Some((version, error)) = rejected.get(&key)
                        && snapshot.version_of(type_url, name) == Some(version.as_str())
                    {
                        return Err(format!("Envoy rejected {name}: {error}"));
                    }
                }
            }
            tokio::select! {
                _ = tokio::time::sleep_until(deadline) => {
                    return Err(format!("Envoy has not acknowledged {}", missing.join(", ")));
                }
                _ = acks.changed() => {}
                _ = snapshots.changed() => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn any(value: &[u8]) -> Any {
        Any {
            type_url: "t".into(),
            value: value.to_vec(),
        }
    }

    #[test]
    fn only_byte_changes_make_a_new_snapshot_and_unchanged_resources_are_shared() {
        let cache = Cache::default();
        let set = |a: &[u8], b: &[u8]| {
            cache.set(BTreeMap::from([(
                "t".to_string(),
                vec![Resource::new("a".into(), any(a)), Resource::new("b".into(), any(b))],
            )]))
        };
        assert!(set(b"1", b"2"));
        let first = cache.snapshot();
        assert!(!set(b"1", b"2"), "identical bytes published a new snapshot");
        assert!(set(b"1", b"3"));
        let second = cache.snapshot();
        assert_eq!(second.serial, first.serial + 1);
        assert!(Arc::ptr_eq(&first.types["t"]["a"], &second.types["t"]["a"]));
        assert_ne!(first.types["t"]["b"].version, second.types["t"]["b"].version);
        assert!(cache.set(BTreeMap::from([(
            "t".to_string(),
            vec![Resource::new("a".into(), any(b"1"))]
        )])));
        assert_eq!(cache.snapshot().types["t"].len(), 1, "a dropped resource stayed");
    }

    #[tokio::test(start_paused = true)]
    async fn waiting_for_an_ack_sees_the_ack_or_times_out() {
        let cache = Cache::default();
        cache.set(BTreeMap::from([(
            "t".to_string(),
            vec![Resource::new("a".into(), any(b"1"))],
        )]));
        let version = cache.snapshot().types["t"]["a"].version.clone();
        let err = cache.wait_acked(&[("t", "a".into())], Duration::from_secs(1)).await;
        assert_eq!(err, Err("Envoy has not acknowledged a".into()));
        let waiter = {
            let cache = cache.clone();
            tokio::spawn(async move { cache.wait_acked(&[("t", "a".into())], Duration::from_secs(5)).await })
        };
        tokio::task::yield_now().await;
        cache.record_ack("t", &[("a".into(), Some(version))]);
        assert_eq!(waiter.await.unwrap(), Ok(()));
    }
}
