//! Where the catalog lives durably, shared by every registrar replica.
//!
//! Each replica keeps the whole catalog in memory and writes every change through a
//! [`Store`] before acknowledging it (or, while the store is unreachable, into its
//! bounded write-behind queue: see `catalog.rs`). Other replicas' changes reach it
//! through the store's change feed ([`Store::feed`]).
//!
//! # The contract every backend keeps (see proposals/003)
//!
//! **Revisions.** Every stored record carries a [`Revision`]: a number that strictly
//! increases each time *that record* is written (etcd: the key's `mod_revision`; other
//! stores: a per-item counter or a table-wide counter). [`Store::commit`] returns the
//! revision its writes got (all records of one batch share it), [`Contents::revision`]
//! says how far a snapshot is complete, and every [`FeedChange`] carries the revision it
//! was written at. The catalog compares revisions per record, so an echo of an older
//! write never overrides a newer one and a replayed change is recognised as already
//! applied.
//!
//! **Snapshot** ([`Store::load`]): every record, each with its revision, plus a
//! `revision` R such that every commit that returned a revision ≤ R is reflected.
//! Records written after R may or may not be in it (they carry their own revision).
//!
//! **Commit** ([`Store::commit`]): atomic (all ops or none) and durable. Conditions:
//! - [`StoreOp::CreateService`] fails the batch with [`StoreError::Conflict`] when the
//!   service key exists or its VIP belongs to another service. The conflict carries the
//!   *current* records of those services ([`Conflict::existing`]), so a replica that
//!   lost a race learns the winner's VIP without another read.
//! - [`StoreOp::PutEndpoint`] fails the batch with `Conflict` when its service is not
//!   in the store (deleted by another replica); listed in [`Conflict::missing`].
//! - [`StoreOp::DeleteService`] removes the service, its VIP and *all* its endpoints;
//!   deletes of absent records succeed (several replicas may reap the same thing).
//! - A `PutEndpoint` counts as a liveness refresh of the endpoint's node (see TTL).
//! - [`StoreOp::UpdateService`] replaces the record of a service that exists, keeping
//!   its key and VIP (only its other attributes change, e.g. `kubernetes`). It fails
//!   the batch with `Conflict` when the service is not in the store (listed in
//!   [`Conflict::missing`]); it never creates one. A VIP other than the stored one is
//!   a programming error: [`StoreError::Corrupt`]. The record gets the batch's
//!   revision and shows up on the feed as a `ServicePut`.
//! - [`StoreOp::PutConfig`] / [`StoreOp::DeleteConfig`] write a configuration record
//!   (a projected route or authorization policy, see `crate::records`) by its kind and
//!   key, unconditionally: records reference services by name and may exist before or
//!   after them.
//!
//! **Feed** ([`Store::feed`]): every change committed after a revision, by any replica
//! (echoes of this replica's own commits may be included; the catalog skips them by
//! revision), in revision order; within one revision a service's put comes before
//! its endpoints' (an endpoint of a service the catalog does not hold is ignored). The stream reconnects by itself; when it cannot
//! continue where it stopped (etcd `ErrCompacted`, a periodic full scan), it yields
//! [`FeedEvent::Resync`] with a fresh snapshot and the catalog diffs it against memory.
//! A store without other replicas returns a stream that never yields (embedded).
//!
//! **TTL liveness.** The unit of liveness is the endpoint's `node` (the agent that
//! registered it); endpoints with an empty `node` never expire. Agents re-register
//! periodically; the catalog turns that into [`Store::refresh`] (rate-limited per node).
//! A backend either expires a node's endpoints by itself (etcd: every endpoint key is
//! attached to its node's lease; expiry shows up in the feed as deletions, and
//! [`Store::expired_nodes`] returns nothing), or records refresh timestamps and lists
//! nodes not refreshed within the TTL in [`Store::expired_nodes`]; the catalog then
//! deletes their endpoints with ordinary commits plus [`StoreOp::ForgetNode`].

pub mod dynamodb;
pub mod embedded;
pub mod etcd;
pub mod kubernetes;

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use aether_proto::registry::v1::{Endpoint, Service};
use async_trait::async_trait;
use futures::Stream;

use crate::model::ServiceKey;
use crate::records::{ConfigKind, ConfigRecord};

/// A record's position in the store's history (see the module docs).
pub type Revision = u64;

/// One durable change.
#[derive(Clone, Debug, PartialEq)]
pub enum StoreOp {
    /// Creates a service with its VIP; fails the batch with `Conflict` if the service
    /// key or the VIP already exists.
    CreateService(Service),
    /// Replaces the record of an existing service with this one (same key, same VIP);
    /// fails the batch with `Conflict` (in `missing`) if the service does not exist,
    /// and with `Corrupt` if the VIP differs from the stored one.
    UpdateService(Service),
    /// Deletes a service, releases its VIP and deletes all its endpoints.
    DeleteService {
        key: ServiceKey,
        vip: String,
    },
    /// Creates or replaces an endpoint; fails the batch with `Conflict` if its service
    /// does not exist. Refreshes the liveness of `endpoint.node`.
    PutEndpoint(Arc<Endpoint>),
    DeleteEndpoint {
        service: ServiceKey,
        address: String,
    },
    /// Drops the liveness record of a node whose endpoints were just expired (only
    /// issued for nodes that [`Store::expired_nodes`] returned).
    ForgetNode(String),
    /// Creates or replaces a configuration record (by its kind and key).
    PutConfig(ConfigRecord),
    /// Deletes a configuration record by kind and key; deleting an absent one succeeds.
    DeleteConfig(ConfigKind, String),
}

/// A record with the revision it was last written at.
#[derive(Clone, Debug, PartialEq)]
pub struct Stored<T> {
    pub value: T,
    pub revision: Revision,
}

/// Everything a store holds. Records that could not be decoded are reported, not
/// dropped silently: they stay in the store untouched.
#[derive(Debug, Default, Clone)]
pub struct Contents {
    /// Every commit that returned a revision ≤ this is reflected.
    pub revision: Revision,
    pub services: Vec<Stored<Service>>,
    pub endpoints: Vec<Stored<Endpoint>>,
    /// Configuration records of every kind.
    pub configs: Vec<Stored<ConfigRecord>>,
    pub unreadable: Vec<UnreadableRecord>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct UnreadableRecord {
    pub key: String,
    pub reason: String,
}

/// One change seen on the feed.
#[derive(Clone, Debug, PartialEq)]
pub struct FeedChange {
    pub revision: Revision,
    pub kind: FeedChangeKind,
}

// Changes are moved straight into the catalog; boxing the endpoint would cost an
// allocation per change for no saving.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug, PartialEq)]
pub enum FeedChangeKind {
    ServicePut(Service),
    /// The service is gone; so are its endpoints (the backend may or may not also
    /// report each endpoint's deletion).
    ServiceDeleted {
        key: String,
    },
    EndpointPut(Endpoint),
    /// `service` is `<ns>/<name>`, `address` the endpoint's address text.
    EndpointDeleted {
        service: String,
        address: String,
    },
    ConfigPut(ConfigRecord),
    ConfigDeleted {
        kind: ConfigKind,
        key: String,
    },
    /// A record that could not be decoded (logged and counted, not applied).
    Unreadable(UnreadableRecord),
}

#[derive(Debug)]
pub enum FeedEvent {
    /// Changes in revision order. `revision` is the feed's progress: every change at
    /// or below it has now been delivered (it may be higher than the last change's).
    Changes {
        revision: Revision,
        changes: Vec<FeedChange>,
    },
    /// Continuity was lost; this is the whole store now. Replaces memory, except for
    /// records this replica wrote at a revision above `Contents::revision`.
    Resync(Contents),
    /// The feed broke and is reconnecting (informational: health and logs).
    Down(String),
}

pub type Feed = Pin<Box<dyn Stream<Item = FeedEvent> + Send>>;

/// Why a commit's conditions failed; nothing in the batch was applied.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Conflict {
    /// The current stored records of the services this batch collided with: same key,
    /// or holding a VIP the batch wanted. These are the winners.
    pub existing: Vec<Service>,
    /// Services the batch wrote endpoints into that are not in the store.
    pub missing: Vec<ServiceKey>,
    /// Human-readable detail for logs.
    pub detail: String,
}

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("store conflict: {}", .0.detail)]
    Conflict(Conflict),
    #[error("store unavailable: {0}")]
    Unavailable(String),
    #[error("store data is not usable: {0}")]
    Corrupt(String),
    #[error("{0}")]
    Config(String),
}

/// The refusal of an [`StoreOp::UpdateService`] that would move a service's VIP.
pub fn vip_change(service: &str, stored: &str, update: &str) -> StoreError {
    StoreError::Corrupt(format!(
        "an update of service {service} would move its VIP from {stored} to {update}; VIPs never change"
    ))
}

/// Settings every backend gets.
#[derive(Clone, Debug)]
pub struct StoreSettings {
    /// Endpoints whose node has not refreshed for this long are removed.
    pub endpoint_ttl: Duration,
}

#[async_trait]
pub trait Store: Send + Sync + 'static {
    /// A short name for logs and metrics, e.g. "embedded".
    fn kind(&self) -> &'static str;

    /// Reads everything stored (see the module docs for the revision rule).
    async fn load(&self) -> Result<Contents, StoreError>;

    /// Applies `ops` atomically and durably, returning the revision they were written
    /// at: once this returns `Ok`, a crash loses none of them; on `Err`, none happened.
    /// `Unavailable` means "try again later" (the catalog may queue the batch).
    async fn commit(&self, ops: Vec<StoreOp>) -> Result<Revision, StoreError>;

    /// Changes after revision `after` (normally the snapshot's `revision`), forever.
    fn feed(&self, after: Revision) -> Feed;

    /// Marks `nodes` alive now (their agents re-registered).
    async fn refresh(&self, nodes: Vec<String>) -> Result<(), StoreError>;

    /// Nodes not refreshed within the endpoint TTL, whose endpoints the catalog must
    /// delete. Stores that expire records themselves (etcd leases) return none.
    async fn expired_nodes(&self) -> Result<Vec<String>, StoreError>;

    /// A cheap round trip, used to notice the store is back.
    async fn ping(&self) -> Result<(), StoreError>;

    /// Most ops one `commit` may carry (the catalog splits bigger plans).
    fn max_batch_ops(&self) -> usize {
        usize::MAX
    }

    /// False for stores derived from elsewhere (Kubernetes): agents' Register and
    /// Unregister are then accepted and ignored (logged), and nothing is committed.
    fn accepts_writes(&self) -> bool {
        true
    }
}

/// A feed that never yields: for stores no other replica writes to.
pub fn no_feed() -> Feed {
    Box::pin(futures::stream::pending())
}
