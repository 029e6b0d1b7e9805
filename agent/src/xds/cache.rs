//! The snapshot cache: every resource Envoy may ask for, by type and name, with a
//! version that is a hash of its encoded bytes. A new snapshot is published only when
//! some resource's bytes changed, and streams push only the resources whose version
//! differs from what their Envoy holds. The cache also records, per ADS stream (one
//! connected Envoy), what that Envoy has ACKed, so callers can wait until a change is
//! live or gone.

use parking_lot::Mutex;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
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

/// What one connected Envoy has ACKed: type URL → name → version.
pub type Acked = HashMap<String, HashMap<String, String>>;

/// What one connected Envoy rejected: (type URL, name) → (version, Envoy's error).
pub type Rejected = HashMap<(String, String), (String, String)>;

/// What one ADS stream's Envoy holds and refused.
#[derive(Debug, Default, Clone)]
pub struct StreamAcks {
    pub acked: Acked,
    pub rejected: Rejected,
}

/// Every live ADS stream by the order it connected (the last is the newest).
///
/// Two streams are live at once during a hot restart (the old and the new Envoy), or
/// briefly when an Envoy reconnects before its old stream is seen to end. The newest
/// is the Envoy that serves from now on, so a change is live once *it* has ACKed it;
/// a resource is gone once *no* live Envoy holds it. Each stream's state lives exactly
/// as long as the stream ([`AckRecorder`] removes it on drop), so one stream ending
/// never touches what another has ACKed.
#[derive(Debug, Default, Clone)]
pub struct Streams {
    next_id: u64,
    pub live: BTreeMap<u64, StreamAcks>,
}

impl Streams {
    /// The newest live stream's state, if any Envoy is connected.
    pub fn newest(&self) -> Option<&StreamAcks> {
        self.live.values().next_back()
    }
}

#[derive(Clone)]
pub struct Cache {
    snapshot: Arc<watch::Sender<Arc<Snapshot>>>,
    streams: Arc<watch::Sender<Streams>>,
    /// Serialises updates (generators may run from more than one task).
    update: Arc<Mutex<()>>,
}

impl Default for Cache {
    fn default() -> Self {
        Self {
            snapshot: Arc::new(watch::channel(Arc::new(Snapshot::default())).0),
            streams: Arc::new(watch::channel(Streams::default()).0),
            update: Arc::default(),
        }
    }
}

pub fn version_of(body: &Any) -> String {
    let hash = fnv1a_extend(fnv1a(body.type_url.as_bytes()), &body.value);
    format!("{hash:016x}")
}

/// Why waiting for Envoy to hold (or let go of) resources failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum WaitError {
    #[error("Envoy has not acknowledged {}{}", .missing.join(", "), if *.connected { "" } else { " (no Envoy is connected)" })]
    NotAcked { missing: Vec<String>, connected: bool },
    #[error("Envoy rejected {name}: {error}")]
    Rejected { name: String, error: String },
    #[error("Envoy still holds {}", .names.join(", "))]
    StillHeld { names: Vec<String> },
}

/// One ADS stream's handle on its own ACK state; dropping it (the stream ended) forgets
/// that state and wakes waiters.
pub struct AckRecorder {
    id: u64,
    streams: Arc<watch::Sender<Streams>>,
}

impl AckRecorder {
    fn modify(&self, f: impl FnOnce(&mut StreamAcks)) {
        self.streams.send_modify(|streams| {
            if let Some(state) = streams.live.get_mut(&self.id) {
                f(state);
            }
        });
    }

    /// Envoy ACKed these versions (`None` version: the resource was removed).
    pub fn record_ack(&self, type_url: &str, resources: &[(String, Option<String>)]) {
        self.modify(|state| {
            let by_name = state.acked.entry(type_url.to_owned()).or_default();
            for (name, version) in resources {
                match version {
                    Some(v) => by_name.insert(name.clone(), v.clone()),
                    None => by_name.remove(name),
                };
            }
        });
    }

    /// Envoy ACKed a state-of-the-world response: it now holds exactly these of the type.
    pub fn record_ack_all(&self, type_url: &str, resources: &Sent) {
        self.modify(|state| {
            let by_name = resources
                .iter()
                .filter_map(|(name, version)| Some((name.clone(), version.clone()?)))
                .collect();
            state.acked.insert(type_url.to_owned(), by_name);
        });
    }

    /// Envoy rejected these versions, with its error.
    pub fn record_nack(&self, type_url: &str, resources: &Sent, error: &str) {
        self.modify(|state| {
            for (name, version) in resources {
                if let Some(version) = version {
                    state
                        .rejected
                        .insert((type_url.to_owned(), name.clone()), (version.clone(), error.to_owned()));
                }
            }
        });
    }

    /// Envoy unsubscribed from these names: it no longer holds them.
    pub fn forget(&self, type_url: &str, names: &[String]) {
        self.modify(|state| {
            if let Some(by_name) = state.acked.get_mut(type_url) {
                for name in names {
                    by_name.remove(name);
                }
            }
        });
    }
}

impl Drop for AckRecorder {
    fn drop(&mut self) {
        self.streams.send_modify(|streams| {
            streams.live.remove(&self.id);
        });
    }
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
        let _serial = self.update.lock();
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
        let _serial = self.update.lock();
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

    /// A new ADS stream: its ACKs are recorded through the returned handle and live
    /// until it is dropped.
    pub fn open_stream(&self) -> AckRecorder {
        let mut id = 0;
        self.streams.send_modify(|streams| {
            id = streams.next_id;
            streams.next_id += 1;
            streams.live.insert(id, StreamAcks::default());
        });
        AckRecorder {
            id,
            streams: self.streams.clone(),
        }
    }

    /// Every live stream's ACK state (for the debug page).
    pub fn streams(&self) -> Streams {
        self.streams.borrow().clone()
    }

    /// Waits until no live Envoy holds any of the named resources (their removal was
    /// ACKed by every stream, or no Envoy is connected).
    pub async fn wait_removed(&self, names: &[(&str, String)], timeout: Duration) -> Result<(), WaitError> {
        let mut streams = self.streams.subscribe();
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let held: BTreeSet<String> = {
                let streams = streams.borrow_and_update();
                names
                    .iter()
                    .filter(|(type_url, name)| {
                        streams
                            .live
                            .values()
                            .any(|s| s.acked.get(*type_url).is_some_and(|m| m.contains_key(name)))
                    })
                    .map(|(_, name)| name.clone())
                    .collect()
            };
            if held.is_empty() {
                return Ok(());
            }
            if tokio::time::timeout_at(deadline, streams.changed()).await.is_err() {
                let names = held.into_iter().collect();
                return Err(WaitError::StillHeld { names });
            }
        }
    }

    /// Waits until the newest connected Envoy has ACKed the current version of every
    /// named resource; fails at once if it rejected one of them.
    pub async fn wait_acked(&self, wanted: &[(&str, String)], timeout: Duration) -> Result<(), WaitError> {
        let mut streams = self.streams.subscribe();
        let mut snapshots = self.snapshot.subscribe();
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let (missing, rejected) = {
                let snapshot = snapshots.borrow_and_update().clone();
                let streams = streams.borrow_and_update();
                let empty = StreamAcks::default();
                let newest = streams.newest().unwrap_or(&empty);
                let mut missing = Vec::new();
                let mut rejected = None;
                for (type_url, name) in wanted {
                    let served = snapshot.version_of(type_url, name);
                    let have = newest
                        .acked
                        .get(*type_url)
                        .and_then(|m| m.get(name))
                        .map(String::as_str);
                    if served.is_none() || served != have {
                        missing.push(name.clone());
                    }
                    if let Some((version, error)) = newest.rejected.get(&((*type_url).to_owned(), name.clone()))
                        && served == Some(version.as_str())
                    {
                        rejected = Some(WaitError::Rejected {
                            name: name.clone(),
                            error: error.clone(),
                        });
                    }
                }
                (missing, rejected)
            };
            if missing.is_empty() {
                return Ok(());
            }
            if let Some(rejected) = rejected {
                return Err(rejected);
            }
            tokio::select! {
                _ = tokio::time::sleep_until(deadline) => {
                    let connected = !streams.borrow().live.is_empty();
                    return Err(WaitError::NotAcked { missing, connected });
                }
                _ = streams.changed() => {}
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

    fn served(cache: &Cache, name: &str, body: &[u8]) -> String {
        cache.set(BTreeMap::from([(
            "t".to_string(),
            vec![Resource::new(name.into(), any(body))],
        )]));
        cache.snapshot().types["t"][name].version.clone()
    }

    #[tokio::test(start_paused = true)]
    async fn waiting_for_an_ack_sees_the_ack_or_times_out() {
        let cache = Cache::default();
        let version = served(&cache, "a", b"1");
        let err = cache.wait_acked(&[("t", "a".into())], Duration::from_secs(1)).await;
        assert_eq!(
            err.unwrap_err().to_string(),
            "Envoy has not acknowledged a (no Envoy is connected)"
        );
        let stream = cache.open_stream();
        let err = cache.wait_acked(&[("t", "a".into())], Duration::from_secs(1)).await;
        assert_eq!(err.unwrap_err().to_string(), "Envoy has not acknowledged a");
        let waiter = {
            let cache = cache.clone();
            tokio::spawn(async move { cache.wait_acked(&[("t", "a".into())], Duration::from_secs(5)).await })
        };
        tokio::task::yield_now().await;
        stream.record_ack("t", &[("a".into(), Some(version))]);
        assert_eq!(waiter.await.unwrap(), Ok(()));
    }

    /// A hot restart: the new Envoy's stream ACKs, then the old one's ends. The old
    /// stream's end must not erase what the new one holds.
    #[tokio::test(start_paused = true)]
    async fn an_old_stream_ending_keeps_the_new_streams_acks() {
        let cache = Cache::default();
        let version = served(&cache, "a", b"1");
        let old = cache.open_stream();
        old.record_ack("t", &[("a".into(), Some(version.clone()))]);
        let new = cache.open_stream();
        new.record_ack("t", &[("a".into(), Some(version))]);
        drop(old);
        assert_eq!(
            cache.wait_acked(&[("t", "a".into())], Duration::from_secs(1)).await,
            Ok(())
        );
        assert_eq!(cache.streams().live.len(), 1);
    }

    /// The newest stream answers waits: an old Envoy's ACK does not make a change live
    /// on the new one, and a stream opened later takes over.
    #[tokio::test(start_paused = true)]
    async fn the_newest_stream_answers_ack_waits() {
        let cache = Cache::default();
        let version = served(&cache, "a", b"1");
        let old = cache.open_stream();
        old.record_ack("t", &[("a".into(), Some(version.clone()))]);
        let new = cache.open_stream();
        let err = cache.wait_acked(&[("t", "a".into())], Duration::from_millis(100)).await;
        assert_eq!(err.unwrap_err().to_string(), "Envoy has not acknowledged a");
        // The new Envoy dies before it ACKs: the old one serves again.
        drop(new);
        assert_eq!(
            cache.wait_acked(&[("t", "a".into())], Duration::from_secs(1)).await,
            Ok(())
        );
        // Nobody connected: nothing is live.
        drop(old);
        let err = cache.wait_acked(&[("t", "a".into())], Duration::from_millis(100)).await;
        assert_eq!(
            err.unwrap_err().to_string(),
            "Envoy has not acknowledged a (no Envoy is connected)"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_removal_waits_for_every_live_stream_and_a_stream_that_ends_holds_nothing() {
        let cache = Cache::default();
        let version = served(&cache, "a", b"1");
        let old = cache.open_stream();
        let new = cache.open_stream();
        old.record_ack("t", &[("a".into(), Some(version.clone()))]);
        new.record_ack("t", &[("a".into(), Some(version))]);
        new.record_ack("t", &[("a".into(), None)]);
        let err = cache
            .wait_removed(&[("t", "a".into())], Duration::from_millis(100))
            .await;
        assert_eq!(err.unwrap_err().to_string(), "Envoy still holds a");
        let waiter = {
            let cache = cache.clone();
            tokio::spawn(async move { cache.wait_removed(&[("t", "a".into())], Duration::from_secs(5)).await })
        };
        tokio::task::yield_now().await;
        drop(old);
        assert_eq!(waiter.await.unwrap(), Ok(()));
    }

    #[tokio::test(start_paused = true)]
    async fn a_rejection_by_the_newest_stream_fails_the_wait_at_once_and_unsubscribing_forgets() {
        let cache = Cache::default();
        let version = served(&cache, "a", b"1");
        let stream = cache.open_stream();
        stream.record_nack("t", &vec![("a".into(), Some(version.clone()))], "bad field");
        let err = cache.wait_acked(&[("t", "a".into())], Duration::from_secs(5)).await;
        assert_eq!(err.unwrap_err().to_string(), "Envoy rejected a: bad field");
        stream.record_ack("t", &[("a".into(), Some(version))]);
        stream.forget("t", &["a".into()]);
        assert_eq!(
            cache
                .wait_removed(&[("t", "a".into())], Duration::from_millis(10))
                .await,
            Ok(())
        );
    }
}
