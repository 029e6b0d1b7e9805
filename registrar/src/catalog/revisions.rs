//! Revision bookkeeping: the last store revision known per record (deletions kept
//! as tombstones until the feed has passed them), so feed echoes and stale events
//! are skipped, and which records this replica wrote recently, so a resync does not
//! delete them before the store shows them.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::net::IpAddr;
use std::time::{Duration, Instant};

use crate::model::ServiceKey;
use crate::records::ConfigKind;
use crate::store::{Revision, StoreOp};

/// How long a deletion's revision is remembered at most (see `Revisions::age`).
const TOMBSTONE_MAX_AGE: Duration = Duration::from_secs(600);
/// How long a record this replica wrote is protected from resync deletion.
const LOCAL_GRACE: Duration = Duration::from_secs(30);

/// The revision of a record written to memory and queued, not yet in the store:
/// nothing from the feed may override it.
pub(super) const PENDING: Revision = Revision::MAX;

/// A record's identity, for revision bookkeeping.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(super) enum RecordKey {
    Service(ServiceKey),
    Endpoint(ServiceKey, IpAddr),
    /// A configuration record, by its kind and key.
    Config(ConfigKind, String),
}

impl RecordKey {
    /// The record `op` writes, if it writes one.
    pub(super) fn of_op(op: &StoreOp) -> Option<RecordKey> {
        match op {
            StoreOp::CreateService(s) | StoreOp::UpdateService(s) => {
                ServiceKey::from_parts("service", &s.namespace, &s.name)
                    .ok()
                    .map(RecordKey::Service)
            }
            StoreOp::DeleteService { key, .. } => Some(RecordKey::Service(key.clone())),
            StoreOp::PutEndpoint(e) => {
                let service = ServiceKey::parse("service", &e.service).ok()?;
                Some(RecordKey::Endpoint(service, e.address.parse().ok()?))
            }
            StoreOp::DeleteEndpoint { service, address } => {
                Some(RecordKey::Endpoint(service.clone(), address.parse().ok()?))
            }
            StoreOp::ForgetNode(_) => None,
            StoreOp::PutConfig(record) => Some(RecordKey::Config(record.kind(), record.key())),
            StoreOp::DeleteConfig(kind, key) => Some(RecordKey::Config(*kind, key.clone())),
        }
    }
}

pub(super) fn is_delete(op: &StoreOp) -> bool {
    matches!(
        op,
        StoreOp::DeleteService { .. } | StoreOp::DeleteEndpoint { .. } | StoreOp::DeleteConfig(..)
    )
}

pub(super) struct Revisions {
    /// Last revision known per record (deletions kept as tombstones until the feed
    /// has passed them), so feed echoes and stale events are skipped.
    revs: HashMap<RecordKey, Revision>,
    tombstones: BTreeMap<Revision, Vec<RecordKey>>,
    /// When each tombstone revision was added, oldest first, to forget tombstones
    /// after [`TOMBSTONE_MAX_AGE`] even without feed progress (stores with no feed).
    tombstone_ages: VecDeque<(Instant, Revision)>,
    /// Records this replica wrote recently (put, not deleted), and when: a resync does
    /// not delete them for [`LOCAL_GRACE`], because a store whose snapshot horizon is
    /// approximate (a scan racing a commit) may not show them yet.
    recent_local: HashMap<RecordKey, Instant>,
    recent_order: VecDeque<(Instant, RecordKey)>,
    /// Feed progress: every change at or below it has been seen.
    pub(super) feed: Revision,
}

impl Revisions {
    /// Bookkeeping for records loaded at `revs`, from a snapshot at `feed`.
    pub(super) fn new(revs: HashMap<RecordKey, Revision>, feed: Revision) -> Revisions {
        Revisions {
            revs,
            tombstones: BTreeMap::new(),
            tombstone_ages: VecDeque::new(),
            recent_local: HashMap::new(),
            recent_order: VecDeque::new(),
            feed,
        }
    }

    /// Records that this replica committed `key` at `revision`.
    pub(super) fn committed(&mut self, key: RecordKey, revision: Revision, deleted: bool) {
        if deleted {
            self.add_tombstone(revision, key.clone());
            self.recent_local.remove(&key);
        } else {
            let now = Instant::now();
            self.recent_local.insert(key.clone(), now);
            self.recent_order.push_back((now, key.clone()));
        }
        self.revs.insert(key, revision);
    }

    /// Marks `key` as written to memory and queued for the store.
    pub(super) fn set_pending(&mut self, key: RecordKey) {
        self.revs.insert(key, PENDING);
    }

    /// Forgets what is known of `key`: the feed or the next resync decides.
    pub(super) fn forget(&mut self, key: &RecordKey) {
        self.revs.remove(key);
    }

    /// Whether a change at `revision` is newer than what is known of `record` (and if
    /// so, records it). `None` always applies.
    pub(super) fn newer(&mut self, record: &RecordKey, revision: Option<Revision>) -> bool {
        let Some(revision) = revision else { return true };
        match self.revs.get(record) {
            Some(&known) if known >= revision => false,
            _ => {
                self.revs.insert(record.clone(), revision);
                true
            }
        }
    }

    /// Whether a snapshot at `horizon` that lacks `key` shows it is gone: memory
    /// holds it at no later revision, and this replica did not write it recently.
    pub(super) fn gone_at(&self, key: &RecordKey, horizon: Revision) -> bool {
        self.revs.get(key).copied().unwrap_or(0) <= horizon && !self.recent_local.contains_key(key)
    }

    pub(super) fn add_tombstone(&mut self, revision: Revision, key: RecordKey) {
        self.tombstones.entry(revision).or_default().push(key);
        if self.tombstone_ages.back().is_none_or(|(_, r)| *r != revision) {
            self.tombstone_ages.push_back((Instant::now(), revision));
        }
    }

    /// Forgets old tombstones and ends the resync protection of old local writes.
    pub(super) fn age(&mut self) {
        self.age_tombstones();
        self.age_recent_local();
    }

    fn age_recent_local(&mut self) {
        while let Some((at, _)) = self.recent_order.front() {
            if at.elapsed() < LOCAL_GRACE {
                break;
            }
            let (at, key) = self.recent_order.pop_front().expect("front exists");
            if self.recent_local.get(&key) == Some(&at) {
                self.recent_local.remove(&key);
            }
        }
    }

    /// Forgets tombstones older than [`TOMBSTONE_MAX_AGE`]: no feed delivers a change
    /// that late, and a resync snapshot is never that old.
    fn age_tombstones(&mut self) {
        let mut upto = None;
        while let Some(&(at, revision)) = self.tombstone_ages.front() {
            if at.elapsed() < TOMBSTONE_MAX_AGE {
                break;
            }
            self.tombstone_ages.pop_front();
            upto = Some(upto.map_or(revision, |u: Revision| u.max(revision)));
        }
        if let Some(upto) = upto {
            self.prune_tombstones(upto);
        }
    }

    /// Forgets tombstones the feed has passed: no older event for them can come.
    pub(super) fn prune_tombstones(&mut self, upto: Revision) {
        let keep = self.tombstones.split_off(&(upto.saturating_add(1)));
        for (revision, keys) in std::mem::replace(&mut self.tombstones, keep) {
            for key in keys {
                if self.revs.get(&key) == Some(&revision) {
                    self.revs.remove(&key);
                }
            }
        }
    }
}
