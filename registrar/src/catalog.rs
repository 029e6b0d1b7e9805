//! The in-memory catalog: every service with its VIP and endpoints, the history of
//! recent changes, and the broadcast that feeds watchers.
//!
//! One writer task owns all mutation. It takes queued writes in groups (group
//! commit: one durable store transaction for many concurrent registrations), plans
//! their effect against the current state without changing it, commits the plan to
//! the store, and only then applies it, bumps the version and publishes the batch of
//! changes. Readers therefore never see an uncommitted change, and a failed commit
//! leaves memory untouched. Publishing happens under the write lock, so a watcher
//! that subscribes and reads a snapshot under the read lock gets every later batch
//! exactly once.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::net::IpAddr;
use std::sync::{Arc, RwLock, RwLockReadGuard};
use std::time::{Duration, Instant};

use aether_common::admin::Readiness;
use aether_common::quote::quote;
use aether_proto::registrar::v1::{Change, EndpointRef, Version, change};
use aether_proto::registry::v1::{Endpoint, Service};
use futures::StreamExt;
use tokio::sync::{broadcast, mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tonic::Status;

use crate::metrics::Metrics;
use crate::model::{ServiceKey, ValidEndpoint, parse_address, validate_endpoint};
use crate::store::{
    Conflict, Contents, FeedChangeKind, FeedEvent, Revision, Store, StoreError, StoreOp, UnreadableRecord,
};
use crate::vip::VipAllocator;

/// Most writes folded into one store transaction.
const MAX_GROUP_COMMIT: usize = 512;
/// Writes waiting for the writer before callers are slowed down.
const WRITE_QUEUE: usize = 4096;

#[derive(Clone, Debug)]
pub struct CatalogConfig {
    pub vips: VipAllocator,
    /// How many changes of history are kept for resuming watchers.
    pub history_changes: usize,
    /// How many change batches a watcher may fall behind before it is resynced.
    pub watch_buffer: usize,
    /// How long a service without endpoints keeps its VIP before it is removed.
    pub empty_service_ttl: Duration,
    /// Endpoints whose node has not refreshed for this long are removed.
    pub endpoint_ttl: Duration,
    /// Most store ops held in the write-behind queue while the store is unreachable.
    pub write_behind_limit: usize,
}

#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error("loading the catalog from the {kind} store: {source}")]
    Load { kind: &'static str, source: StoreError },
}

/// A committed group of changes, as published to watchers.
#[derive(Debug)]
pub struct Batch {
    pub seq: u64,
    pub changes: Vec<KeyedChange>,
}

/// A committed change to one service. Endpoint data is shared with the catalog and
/// the history (not copied), and turned into its wire form only when sent.
#[derive(Clone, Debug)]
pub struct KeyedChange {
    pub service: ServiceKey,
    pub event: Event,
}

#[derive(Clone, Debug)]
pub enum Event {
    ServiceAdded(Service),
    ServiceRemoved,
    EndpointAdded(Arc<Endpoint>),
    EndpointUpdated(Arc<Endpoint>),
    EndpointRemoved(IpAddr),
}

impl KeyedChange {
    pub fn to_proto(&self) -> Change {
        let change = match &self.event {
            Event::ServiceAdded(service) => change::Change::ServiceAdded(service.clone()),
            Event::ServiceRemoved => change::Change::ServiceRemoved(self.service.to_string()),
            Event::EndpointAdded(e) => change::Change::EndpointAdded(Endpoint::clone(e)),
            Event::EndpointUpdated(e) => change::Change::EndpointUpdated(Endpoint::clone(e)),
            Event::EndpointRemoved(address) => change::Change::EndpointRemoved(EndpointRef {
                service: self.service.to_string(),
                address: address.to_string(),
            }),
        };
        Change { change: Some(change) }
    }
}

#[derive(Clone, Debug)]
pub struct Entry {
    pub service: Service,
    pub endpoints: BTreeMap<IpAddr, Arc<Endpoint>>,
    empty_since: Option<Instant>,
}

pub struct State {
    instance: Arc<str>,
    seq: u64,
    services: BTreeMap<ServiceKey, Entry>,
    vips: HashMap<IpAddr, ServiceKey>,
    endpoint_count: usize,
    history: VecDeque<Arc<Batch>>,
    history_changes: usize,
    history_limit: usize,
    events: broadcast::Sender<Arc<Batch>>,
}

impl State {
    pub fn version(&self) -> Version {
        Version {
            instance: self.instance.to_string(),
            seq: self.seq,
        }
    }

    pub fn instance(&self) -> &str {
        &self.instance
    }

    pub fn seq(&self) -> u64 {
        self.seq
    }

    /// A receiver of every batch published after this call.
    pub fn subscribe(&self) -> broadcast::Receiver<Arc<Batch>> {
        self.events.subscribe()
    }

    /// The batches after `seq`, if the history still holds all of them.
    pub fn history_after(&self, seq: u64) -> Option<Vec<Arc<Batch>>> {
        if seq > self.seq {
            return None;
        }
        if seq == self.seq {
            return Some(Vec::new());
        }
        let oldest = self.history.front()?.seq;
        if oldest > seq + 1 {
            return None;
        }
        Some(self.history.iter().filter(|b| b.seq > seq).cloned().collect())
    }

    pub fn services(&self) -> impl Iterator<Item = (&ServiceKey, &Entry)> {
        self.services.iter()
    }

    pub fn service(&self, key: &str) -> Option<&Entry> {
        self.services.get(key)
    }

    fn apply(&mut self, plan: Plan) -> u64 {
        let now = Instant::now();
        for (key, service) in plan.new_services {
            let vip = service.vip.parse().expect("planned VIPs are valid addresses");
            self.vips.insert(vip, key.clone());
            self.services.insert(
                key,
                Entry {
                    service,
                    endpoints: BTreeMap::new(),
                    empty_since: None,
                },
            );
        }
        let mut touched = HashSet::new();
        for ((key, address), value) in plan.endpoints {
            let entry = self.services.get_mut(&key).expect("planned against this state");
            let had = match value {
                Some(endpoint) => entry.endpoints.insert(address, endpoint).is_some(),
                None => entry.endpoints.remove(&address).is_some(),
            };
            let has = entry.endpoints.contains_key(&address);
            self.endpoint_count = self.endpoint_count + usize::from(has) - usize::from(had);
            touched.insert(key);
        }
        for key in touched {
            if let Some(entry) = self.services.get_mut(&key) {
                entry.empty_since = match (entry.endpoints.is_empty(), entry.empty_since) {
                    (false, _) => None,
                    (true, since) => since.or(Some(now)),
                };
            }
        }
        for (key, vip) in plan.removed_services {
            self.services.remove(&key);
            self.vips.remove(&vip);
        }
        self.publish(plan.changes)
    }

    /// Puts a service as another replica stored it.
    fn put_service(
        &mut self,
        key: ServiceKey,
        vip: IpAddr,
        service: Service,
        now: Instant,
        out: &mut Vec<KeyedChange>,
    ) {
        if let Some(owner) = self.vips.get(&vip)
            && *owner != key
        {
            tracing::warn!(%vip, service = %key, previous = %owner, "the store gave a VIP this replica held for another service to this one");
        }
        match self.services.get_mut(&key) {
            Some(entry) if entry.service == service => return,
            Some(entry) => {
                if let Ok(old) = entry.service.vip.parse::<IpAddr>()
                    && self.vips.get(&old) == Some(&key)
                {
                    self.vips.remove(&old);
                }
                entry.service = service.clone();
            }
            None => {
                self.services.insert(
                    key.clone(),
                    Entry {
                        service: service.clone(),
                        endpoints: BTreeMap::new(),
                        empty_since: Some(now),
                    },
                );
            }
        }
        self.vips.insert(vip, key.clone());
        out.push(KeyedChange {
            service: key,
            event: Event::ServiceAdded(service),
        });
    }

    fn remove_service(&mut self, key: &ServiceKey, out: &mut Vec<KeyedChange>) {
        let Some(entry) = self.services.remove(key) else { return };
        self.endpoint_count -= entry.endpoints.len();
        if let Ok(vip) = entry.service.vip.parse::<IpAddr>()
            && self.vips.get(&vip) == Some(key)
        {
            self.vips.remove(&vip);
        }
        out.push(KeyedChange {
            service: key.clone(),
            event: Event::ServiceRemoved,
        });
    }

    /// Puts an endpoint of a service this replica holds.
    fn put_endpoint(&mut self, valid: ValidEndpoint, out: &mut Vec<KeyedChange>) {
        let Some(entry) = self.services.get_mut(&valid.service) else {
            return;
        };
        let endpoint = Arc::new(valid.endpoint);
        let event = match entry.endpoints.insert(valid.address, endpoint.clone()) {
            Some(old) if *old == *endpoint => return,
            Some(_) => Event::EndpointUpdated(endpoint),
            None => {
                self.endpoint_count += 1;
                Event::EndpointAdded(endpoint)
            }
        };
        entry.empty_since = None;
        out.push(KeyedChange {
            service: valid.service,
            event,
        });
    }

    fn remove_endpoint(&mut self, key: &ServiceKey, address: IpAddr, now: Instant, out: &mut Vec<KeyedChange>) {
        let Some(entry) = self.services.get_mut(key) else {
            return;
        };
        if entry.endpoints.remove(&address).is_none() {
            return;
        }
        self.endpoint_count -= 1;
        if entry.endpoints.is_empty() {
            entry.empty_since = Some(now);
        }
        out.push(KeyedChange {
            service: key.clone(),
            event: Event::EndpointRemoved(address),
        });
    }

    fn publish(&mut self, changes: Vec<KeyedChange>) -> u64 {
        self.seq += 1;
        let batch = Arc::new(Batch { seq: self.seq, changes });
        self.history_changes += batch.changes.len();
        self.history.push_back(batch.clone());
        while self.history_changes > self.history_limit && self.history.len() > 1 {
            let dropped = self.history.pop_front().expect("history is not empty");
            self.history_changes -= dropped.changes.len();
        }
        // No receivers is fine: nobody is watching.
        let _ = self.events.send(batch);
        self.seq
    }
}

/// The effect of a group of writes, computed against the state before it.
#[derive(Default)]
struct Plan {
    new_services: HashMap<ServiceKey, Service>,
    new_vips: HashSet<IpAddr>,
    endpoints: HashMap<(ServiceKey, IpAddr), Option<Arc<Endpoint>>>,
    removed_services: Vec<(ServiceKey, IpAddr)>,
    ops: Vec<StoreOp>,
    changes: Vec<KeyedChange>,
}

impl Plan {
    fn service(&self, state: &State, key: &ServiceKey) -> Option<Service> {
        self.new_services
            .get(key)
            .or_else(|| state.services.get(key).map(|e| &e.service))
            .cloned()
    }

    fn endpoint<'a>(&'a self, state: &'a State, key: &ServiceKey, address: IpAddr) -> Option<&'a Endpoint> {
        match self.endpoints.get(&(key.clone(), address)) {
            Some(staged) => staged.as_deref(),
            None => state
                .services
                .get(key)
                .and_then(|e| e.endpoints.get(&address))
                .map(|e| &**e),
        }
    }

    fn change(&mut self, service: &ServiceKey, event: Event) {
        self.changes.push(KeyedChange {
            service: service.clone(),
            event,
        });
    }

    fn register(
        &mut self,
        state: &State,
        vips: &VipAllocator,
        valid: ValidEndpoint,
        owner: Option<&str>,
    ) -> Result<Service, Status> {
        let key = valid.service;
        if let Some(old) = self.endpoint(state, &key, valid.address) {
            check_owner(old, owner)?;
        }
        let service = match self.service(state, &key) {
            Some(service) => service,
            None => {
                let vip = vips
                    .allocate(&key, |ip| state.vips.contains_key(&ip) || self.new_vips.contains(&ip))
                    .map_err(|e| Status::resource_exhausted(format!("allocating a VIP for {key}: {e}")))?;
                let service = Service {
                    namespace: key.namespace().to_owned(),
                    name: key.name().to_owned(),
                    vip: vip.to_string(),
                };
                self.new_vips.insert(vip);
                self.new_services.insert(key.clone(), service.clone());
                self.ops.push(StoreOp::CreateService(service.clone()));
                self.change(&key, Event::ServiceAdded(service.clone()));
                service
            }
        };
        let endpoint = Arc::new(valid.endpoint);
        let event = match self.endpoint(state, &key, valid.address) {
            Some(old) if *old == *endpoint => return Ok(service),
            Some(_) => Event::EndpointUpdated(endpoint.clone()),
            None => Event::EndpointAdded(endpoint.clone()),
        };
        self.ops.push(StoreOp::PutEndpoint(endpoint.clone()));
        self.change(&key, event);
        self.endpoints.insert((key, valid.address), Some(endpoint));
        Ok(service)
    }

    fn unregister(
        &mut self,
        state: &State,
        key: ServiceKey,
        address: IpAddr,
        owner: Option<&str>,
    ) -> Result<bool, Status> {
        let Some(old) = self.endpoint(state, &key, address) else {
            return Ok(false);
        };
        check_owner(old, owner)?;
        self.ops.push(StoreOp::DeleteEndpoint {
            service: key.clone(),
            address: address.to_string(),
        });
        self.change(&key, Event::EndpointRemoved(address));
        self.endpoints.insert((key, address), None);
        Ok(true)
    }

    /// Removes services that have had no endpoints for longer than `ttl` (at most
    /// `most` of them: the rest next time).
    fn reap(&mut self, state: &State, now: Instant, ttl: Duration, most: usize) {
        for (key, entry) in &state.services {
            if self.ops.len() >= most {
                break;
            }
            let expired = entry
                .empty_since
                .is_some_and(|since| now.saturating_duration_since(since) >= ttl);
            if !expired {
                continue;
            }
            let vip: IpAddr = entry.service.vip.parse().expect("catalog VIPs are valid addresses");
            self.ops.push(StoreOp::DeleteService {
                key: key.clone(),
                vip: entry.service.vip.clone(),
            });
            self.change(key, Event::ServiceRemoved);
            self.removed_services.push((key.clone(), vip));
        }
    }
}

/// An agent (`owner`, its authenticated node) may change only endpoints of its node.
/// An endpoint registered without a node (by an `--insecure` client) has no owner.
fn check_owner(existing: &Endpoint, owner: Option<&str>) -> Result<(), Status> {
    match owner {
        Some(owner) if !existing.node.is_empty() && existing.node != owner => Err(Status::permission_denied(format!(
            "rule own-node: the endpoint {} of {} belongs to node {:?}; the agent of node {owner:?} may not change it",
            existing.address, existing.service, existing.node
        ))),
        _ => Ok(()),
    }
}

enum Write {
    Register {
        endpoint: Box<ValidEndpoint>,
        owner: Option<String>,
        reply: oneshot::Sender<Result<(Service, Version), Status>>,
    },
    Unregister {
        service: ServiceKey,
        address: IpAddr,
        owner: Option<String>,
        reply: oneshot::Sender<Result<(bool, Version), Status>>,
    },
    /// Remove expired empty services; always planned alone.
    Reap,
    /// Remove the endpoints of nodes whose liveness lapsed; always planned alone.
    Expire,
}

/// A cheap, cloneable handle to the catalog.
#[derive(Clone)]
pub struct Catalog {
    state: Arc<RwLock<State>>,
    writes: mpsc::Sender<Write>,
    config: Arc<CatalogConfig>,
    metrics: Metrics,
    read_only: bool,
    /// Endpoints whose ignored registration was already logged at info (read-only
    /// stores: agents re-register every few seconds).
    ignored: Arc<std::sync::Mutex<HashSet<(ServiceKey, IpAddr)>>>,
}

/// A record's identity, for revision bookkeeping.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum RecordKey {
    Service(ServiceKey),
    Endpoint(ServiceKey, IpAddr),
}

/// The revision of a record written to memory and queued, not yet in the store:
/// nothing from the feed may override it.
const PENDING: Revision = Revision::MAX;

/// A batch accepted while the store was unreachable, waiting to be committed.
struct Queued {
    ops: Vec<StoreOp>,
    attempts: u32,
}

/// The writer task; run it with [`Writer::run`].
pub struct Writer {
    state: Arc<RwLock<State>>,
    writes: mpsc::Receiver<Write>,
    store: Arc<dyn Store>,
    config: Arc<CatalogConfig>,
    metrics: Metrics,
    /// Last revision known per record (deletions kept as tombstones until the feed
    /// has passed them), so feed echoes and stale events are skipped.
    revs: HashMap<RecordKey, Revision>,
    tombstones: BTreeMap<Revision, Vec<RecordKey>>,
    /// Records this replica wrote recently (put, not deleted), and when: a resync does
    /// not delete them for [`LOCAL_GRACE`], because a store whose snapshot horizon is
    /// approximate (a scan racing a commit) may not show them yet.
    recent_local: HashMap<RecordKey, Instant>,
    recent_order: VecDeque<(Instant, RecordKey)>,
    /// When each tombstone revision was added, oldest first, to forget tombstones
    /// after [`TOMBSTONE_MAX_AGE`] even without feed progress (stores with no feed).
    tombstone_ages: VecDeque<(Instant, Revision)>,
    /// Feed progress: every change at or below it has been seen.
    feed_revision: Revision,
    /// The write-behind queue, oldest first, and how many ops it holds.
    queue: VecDeque<Queued>,
    queued_ops: usize,
    /// How many queued batches touch each record.
    pending: HashMap<RecordKey, usize>,
    /// Why the store is considered down (None: up).
    down: Option<String>,
    retry_at: Instant,
    backoff: Duration,
    last_refresh: HashMap<String, Instant>,
    readiness: Option<(Readiness, CancellationToken)>,
}

/// How a plan's commit went.
enum Outcome {
    /// In the store (or queued); the version that includes it.
    Done(Version),
    Conflict(Conflict),
    Refused(Status),
}

impl Catalog {
    /// Loads the catalog from `store`. Records that fail validation are logged,
    /// counted and left in the store untouched; the rest is served.
    pub async fn open(
        store: Arc<dyn Store>,
        config: CatalogConfig,
        metrics: Metrics,
    ) -> Result<(Catalog, Writer), OpenError> {
        let contents = store.load().await.map_err(|source| OpenError::Load {
            kind: store.kind(),
            source,
        })?;
        let mut unreadable = contents.unreadable;
        let now = Instant::now();
        let mut services = BTreeMap::new();
        let mut vips = HashMap::new();
        let mut revs = HashMap::new();
        for stored in contents.services {
            let service = stored.value;
            let record = format!("services/{}/{}", service.namespace, service.name);
            let checked = ServiceKey::from_parts("service", &service.namespace, &service.name)
                .map_err(|e| e.to_string())
                .and_then(|key| {
                    let vip = parse_address("vip", &service.vip).map_err(|e| e.to_string())?;
                    match vips.get(&vip) {
                        Some(owner) => Err(format!("VIP {vip} is also held by {owner}")),
                        None => Ok((key, vip)),
                    }
                });
            match checked {
                Ok((key, vip)) => {
                    if !config.vips.contains(vip) {
                        tracing::warn!(service = %key, %vip, range = %config.vips.net(),
                            "stored VIP is outside the configured range; keeping it so the service's address stays stable");
                    }
                    vips.insert(vip, key.clone());
                    revs.insert(RecordKey::Service(key.clone()), stored.revision);
                    services.insert(
                        key,
                        Entry {
                            service,
                            endpoints: BTreeMap::new(),
                            empty_since: Some(now),
                        },
                    );
                }
                Err(reason) => unreadable.push(UnreadableRecord { key: record, reason }),
            }
        }
        let mut endpoint_count = 0;
        for stored in contents.endpoints {
            let endpoint = stored.value;
            let record = format!("endpoints/{}/{}", endpoint.service, endpoint.address);
            match validate_endpoint("endpoint", Some(endpoint)) {
                Ok(valid) => match services.get_mut(&valid.service) {
                    Some(entry) => {
                        entry.empty_since = None;
                        revs.insert(
                            RecordKey::Endpoint(valid.service.clone(), valid.address),
                            stored.revision,
                        );
                        entry.endpoints.insert(valid.address, Arc::new(valid.endpoint));
                        endpoint_count += 1;
                    }
                    None => unreadable.push(UnreadableRecord {
                        key: record,
                        reason: format!("its service {} is not in the store", valid.service),
                    }),
                },
                Err(e) => unreadable.push(UnreadableRecord {
                    key: record,
                    reason: e.to_string(),
                }),
            }
        }
        for record in &unreadable {
            tracing::error!(record = %quote(&record.key), reason = %record.reason,
                "skipping an unusable store record (left in the store untouched)");
        }
        metrics.store_unreadable_records.set(unreadable.len() as i64);
        metrics.services.set(services.len() as i64);
        metrics.endpoints.set(endpoint_count as i64);
        metrics.store_up.set(1);

        let (events, _) = broadcast::channel(config.watch_buffer.max(1));
        let state = Arc::new(RwLock::new(State {
            instance: uuid::Uuid::new_v4().simple().to_string().into(),
            seq: 0,
            services,
            vips,
            endpoint_count,
            history: VecDeque::new(),
            history_changes: 0,
            history_limit: config.history_changes,
            events,
        }));
        let config = Arc::new(config);
        let (tx, rx) = mpsc::channel(WRITE_QUEUE);
        let catalog = Catalog {
            state: state.clone(),
            writes: tx,
            config: config.clone(),
            metrics: metrics.clone(),
            read_only: !store.accepts_writes(),
            ignored: Arc::default(),
        };
        let writer = Writer {
            state,
            writes: rx,
            store,
            config,
            metrics,
            revs,
            tombstones: BTreeMap::new(),
            tombstone_ages: VecDeque::new(),
            recent_local: HashMap::new(),
            recent_order: VecDeque::new(),
            feed_revision: contents.revision,
            queue: VecDeque::new(),
            queued_ops: 0,
            pending: HashMap::new(),
            down: None,
            retry_at: now,
            backoff: RETRY_MIN,
            last_refresh: HashMap::new(),
            readiness: None,
        };
        Ok((catalog, writer))
    }

    pub fn read(&self) -> RwLockReadGuard<'_, State> {
        self.state.read().expect("catalog lock poisoned")
    }

    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// Adds or replaces `endpoint`. With an `owner` (the caller's authenticated node),
    /// an endpoint another node holds is not replaced: PERMISSION_DENIED.
    pub async fn register(&self, endpoint: ValidEndpoint, owner: Option<String>) -> Result<(Service, Version), Status> {
        if self.read_only {
            let first = (self.ignored.lock().expect("ignored set poisoned"))
                .insert((endpoint.service.clone(), endpoint.address));
            if first {
                tracing::info!(service = %endpoint.service, address = %endpoint.address,
                    "ignoring Register: this registrar's store is read-only (endpoints come from the store)");
            } else {
                tracing::debug!(service = %endpoint.service, address = %endpoint.address, "ignoring Register again");
            }
            let state = self.read();
            let service = state.service(endpoint.service.as_str()).map(|e| e.service.clone());
            let service = service.unwrap_or_else(|| Service {
                namespace: endpoint.service.namespace().to_owned(),
                name: endpoint.service.name().to_owned(),
                vip: String::new(),
            });
            return Ok((service, state.version()));
        }
        let (reply, response) = oneshot::channel();
        self.submit(Write::Register {
            endpoint: Box::new(endpoint),
            owner,
            reply,
        })
        .await?;
        response.await.map_err(|_| shutting_down())?
    }

    /// Removes an endpoint. With an `owner`, one that another node holds is not
    /// removed: PERMISSION_DENIED.
    pub async fn unregister(
        &self,
        service: ServiceKey,
        address: IpAddr,
        owner: Option<String>,
    ) -> Result<(bool, Version), Status> {
        if self.read_only {
            (self.ignored.lock().expect("ignored set poisoned")).remove(&(service.clone(), address));
            tracing::info!(%service, %address,
                "ignoring Unregister: this registrar's store is read-only (endpoints come from the store)");
            return Ok((false, self.read().version()));
        }
        let (reply, response) = oneshot::channel();
        self.submit(Write::Unregister {
            service,
            address,
            owner,
            reply,
        })
        .await?;
        response.await.map_err(|_| shutting_down())?
    }

    async fn submit(&self, write: Write) -> Result<(), Status> {
        self.writes.send(write).await.map_err(|_| shutting_down())
    }

    /// Periodically asks the writer to remove services that stayed empty past their
    /// TTL, and endpoints whose node stopped refreshing.
    pub async fn run_reaper(self, shutdown: CancellationToken) {
        let period = (self.config.empty_service_ttl / 4).clamp(Duration::from_millis(100), Duration::from_secs(60));
        let mut tick = tokio::time::interval(period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let period = (self.config.endpoint_ttl / 4).clamp(Duration::from_millis(100), Duration::from_secs(15));
        let mut expire = tokio::time::interval(period);
        expire.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            // A full queue means the writer is busy; try again next tick.
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tick.tick() => {
                    let _ = self.writes.try_send(Write::Reap);
                }
                _ = expire.tick() => {
                    let _ = self.writes.try_send(Write::Expire);
                }
            }
        }
    }
}

fn shutting_down() -> Status {
    Status::unavailable("the registrar is shutting down; retry against another replica")
}

const RETRY_MIN: Duration = Duration::from_millis(100);
const RETRY_MAX: Duration = Duration::from_secs(2);
/// Attempts at one queued batch whose conditions keep failing before it is dropped.
const MAX_QUEUED_ATTEMPTS: u32 = 5;
/// Conflicts (lost races with other replicas) a group of writes is re-planned after.
const MAX_CONFLICT_RETRIES: usize = 4;
/// How long a deletion's revision is remembered at most (see `Writer::age_tombstones`).
const TOMBSTONE_MAX_AGE: Duration = Duration::from_secs(600);
/// How long a record this replica wrote is protected from resync deletion.
const LOCAL_GRACE: Duration = Duration::from_secs(30);
/// How long shutdown waits for an unreachable store to flush the write-behind queue.
const FLUSH_ON_SHUTDOWN: Duration = Duration::from_secs(10);

fn op_keys(op: &StoreOp) -> Option<RecordKey> {
    match op {
        StoreOp::CreateService(s) => ServiceKey::from_parts("service", &s.namespace, &s.name)
            .ok()
            .map(RecordKey::Service),
        StoreOp::DeleteService { key, .. } => Some(RecordKey::Service(key.clone())),
        StoreOp::PutEndpoint(e) => {
            let service = ServiceKey::parse("service", &e.service).ok()?;
            Some(RecordKey::Endpoint(service, e.address.parse().ok()?))
        }
        StoreOp::DeleteEndpoint { service, address } => {
            Some(RecordKey::Endpoint(service.clone(), address.parse().ok()?))
        }
        StoreOp::ForgetNode(_) => None,
    }
}

fn is_delete(op: &StoreOp) -> bool {
    matches!(op, StoreOp::DeleteService { .. } | StoreOp::DeleteEndpoint { .. })
}

impl Writer {
    /// Lets the writer report the store's health on the readiness endpoint (until
    /// `serving` is cancelled: shutdown owns readiness then).
    pub fn with_readiness(mut self, readiness: Readiness, serving: CancellationToken) -> Self {
        self.readiness = Some((readiness, serving));
        self
    }

    /// Applies writes and other replicas' changes until `shutdown`; writes already
    /// queued are still applied, and the write-behind queue is flushed if the store
    /// allows.
    pub async fn run(mut self, shutdown: CancellationToken) {
        let mut feed = self.store.feed(self.feed_revision);
        let mut tick = tokio::time::interval(Duration::from_millis(50));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                biased;
                write = self.writes.recv() => match write {
                    Some(write) => self.process(write).await,
                    None => break,
                },
                _ = shutdown.cancelled() => break,
                event = feed.next() => match event {
                    Some(event) => self.on_feed(event),
                    None => {
                        tracing::error!(store = self.store.kind(), "the store's change feed ended; reopening it");
                        feed = self.store.feed(self.feed_revision);
                    }
                },
                _ = tick.tick() => self.on_tick().await,
            }
        }
        self.writes.close();
        while let Some(write) = self.writes.recv().await {
            self.process(write).await;
        }
        let deadline = Instant::now() + FLUSH_ON_SHUTDOWN;
        while !self.queue.is_empty() && Instant::now() < deadline {
            self.drain_queue().await;
            if !self.queue.is_empty() {
                tokio::time::sleep(self.backoff).await;
            }
        }
        if self.queue.is_empty() {
            tracing::info!("catalog writer stopped; every acknowledged write is in the store");
        } else {
            tracing::error!(
                ops = self.queued_ops,
                "catalog writer stopped with writes still queued for an unreachable store; agents re-register them on their next refresh"
            );
        }
    }

    async fn process(&mut self, first: Write) {
        let most = (self.store.max_batch_ops() / 2).clamp(1, MAX_GROUP_COMMIT);
        let mut group = vec![first];
        while group.len() < most {
            match self.writes.try_recv() {
                Ok(write) => group.push(write),
                Err(_) => break,
            }
        }
        let mut reap = false;
        let mut expire = false;
        group.retain(|w| match w {
            Write::Reap => {
                reap = true;
                false
            }
            Write::Expire => {
                expire = true;
                false
            }
            _ => true,
        });
        if !group.is_empty() {
            self.commit_group(group).await;
        }
        if !self.store.accepts_writes() {
            // A read-only store decides what exists; nothing to reap or expire here.
            return;
        }
        if reap {
            self.reap().await;
        }
        if expire {
            self.expire().await;
        }
    }

    async fn commit_group(&mut self, group: Vec<Write>) {
        enum Item {
            Register(
                Box<ValidEndpoint>,
                Option<String>,
                oneshot::Sender<Result<(Service, Version), Status>>,
            ),
            Unregister(
                ServiceKey,
                IpAddr,
                Option<String>,
                oneshot::Sender<Result<(bool, Version), Status>>,
            ),
        }
        let items: Vec<Item> = group
            .into_iter()
            .filter_map(|w| match w {
                Write::Register { endpoint, owner, reply } => Some(Item::Register(endpoint, owner, reply)),
                Write::Unregister {
                    service,
                    address,
                    owner,
                    reply,
                } => Some(Item::Unregister(service, address, owner, reply)),
                Write::Reap | Write::Expire => None,
            })
            .collect();
        self.refresh_nodes(items.iter().filter_map(|i| match i {
            Item::Register(e, ..) => Some(e.endpoint.node.as_str()),
            Item::Unregister(..) => None,
        }));
        let mut attempt = 0;
        let (outcome, results) = loop {
            let mut plan = Plan::default();
            let results: Vec<Result<Service, Status>> = {
                let state = self.state.read().expect("catalog lock poisoned");
                items
                    .iter()
                    .map(|item| match item {
                        Item::Register(endpoint, owner, _) => {
                            plan.register(&state, &self.config.vips, (**endpoint).clone(), owner.as_deref())
                        }
                        Item::Unregister(service, address, owner, _) => {
                            // Ok: the endpoint existed; NOT_FOUND: it did not (read back below).
                            match plan.unregister(&state, service.clone(), *address, owner.as_deref()) {
                                Ok(true) => Ok(Service::default()),
                                Ok(false) => Err(Status::not_found("")),
                                Err(denied) => Err(denied),
                            }
                        }
                    })
                    .collect()
            };
            match self.commit(plan).await {
                Outcome::Conflict(conflict) if attempt < MAX_CONFLICT_RETRIES => {
                    attempt += 1;
                    tracing::info!(detail = %conflict.detail, "lost a race with another replica; adopting its records and retrying");
                    self.adopt(conflict);
                }
                Outcome::Conflict(conflict) => {
                    break (
                        Err(Status::aborted(format!(
                            "the store kept refusing the write after {attempt} retries: {}",
                            conflict.detail
                        ))),
                        results,
                    );
                }
                Outcome::Refused(status) => break (Err(status), results),
                Outcome::Done(version) => break (Ok(version), results),
            }
        };
        for (item, result) in items.into_iter().zip(results) {
            match item {
                Item::Register(.., reply) => {
                    let _ = reply.send(result.and_then(|s| Ok((s, outcome.clone()?))));
                }
                Item::Unregister(.., reply) => {
                    let _ = reply.send(match result {
                        Err(denied) if denied.code() == tonic::Code::PermissionDenied => Err(denied),
                        result => outcome.clone().map(|v| (result.is_ok(), v)),
                    });
                }
            }
        }
    }

    /// Tells the store that the agents of `nodes` are alive, at most once per node
    /// per quarter TTL, without holding up the writer.
    fn refresh_nodes<'a>(&mut self, nodes: impl Iterator<Item = &'a str>) {
        let now = Instant::now();
        let every = self.config.endpoint_ttl / 4;
        let mut due = Vec::new();
        for node in nodes.filter(|n| !n.is_empty()) {
            let fresh = self
                .last_refresh
                .get(node)
                .is_some_and(|at| now.saturating_duration_since(*at) < every);
            if !fresh {
                self.last_refresh.insert(node.to_owned(), now);
                due.push(node.to_owned());
            }
        }
        if due.is_empty() {
            return;
        }
        let store = self.store.clone();
        tokio::spawn(async move {
            if let Err(error) = store.refresh(due).await {
                tracing::warn!(%error, "refreshing node liveness failed; the next registration retries");
            }
        });
    }

    async fn reap(&mut self) {
        let mut plan = Plan::default();
        {
            let state = self.state.read().expect("catalog lock poisoned");
            plan.reap(
                &state,
                Instant::now(),
                self.config.empty_service_ttl,
                self.store.max_batch_ops(),
            );
        }
        let removed: Vec<String> = plan.removed_services.iter().map(|(k, _)| k.to_string()).collect();
        if matches!(self.commit(plan).await, Outcome::Done(_)) && !removed.is_empty() {
            tracing::info!(services = ?removed, "removed services that had no endpoints for longer than the TTL");
        }
    }

    /// Removes the endpoints of nodes the store says stopped refreshing.
    async fn expire(&mut self) {
        let nodes = match self.store.expired_nodes().await {
            Ok(nodes) => nodes,
            Err(error) => {
                tracing::warn!(%error, "could not list expired nodes; retrying later");
                return;
            }
        };
        let most = self.store.max_batch_ops().max(2);
        for node in nodes {
            let doomed: Vec<(ServiceKey, IpAddr)> = {
                let state = self.state.read().expect("catalog lock poisoned");
                state
                    .services
                    .iter()
                    .flat_map(|(key, entry)| {
                        entry
                            .endpoints
                            .iter()
                            .filter(|(_, e)| e.node == node)
                            .map(move |(address, _)| (key.clone(), *address))
                    })
                    .collect()
            };
            tracing::warn!(%node, endpoints = doomed.len(), ttl = ?self.config.endpoint_ttl,
                "removing the endpoints of a node whose agent stopped refreshing");
            let mut chunks = doomed.chunks(most - 1).peekable();
            let mut failed = false;
            while let Some(chunk) = chunks.next() {
                let mut plan = Plan::default();
                {
                    let state = self.state.read().expect("catalog lock poisoned");
                    for (key, address) in chunk {
                        // The reaper acts for no node: no owner check.
                        let _ = plan.unregister(&state, key.clone(), *address, None);
                    }
                }
                if chunks.peek().is_none() {
                    plan.ops.push(StoreOp::ForgetNode(node.clone()));
                }
                let count = chunk.len() as u64;
                if matches!(self.commit(plan).await, Outcome::Done(_)) {
                    self.metrics.expired_endpoints.inc_by(count);
                } else {
                    failed = true;
                    break;
                }
            }
            if doomed.is_empty() && !failed {
                let plan = Plan {
                    ops: vec![StoreOp::ForgetNode(node.clone())],
                    ..Default::default()
                };
                let _ = self.commit(plan).await;
            }
            self.last_refresh.remove(&node);
        }
    }

    fn set_down(&mut self, reason: String) {
        if self.down.is_none() {
            tracing::error!(store = self.store.kind(), %reason,
                "the catalog store is unreachable: serving the last snapshot, queueing writes");
            if let Some((readiness, serving)) = &self.readiness
                && !serving.is_cancelled()
            {
                readiness.set_not_ready(format!("the {} store is unreachable: {reason}", self.store.kind()));
            }
        }
        self.metrics.store_up.set(0);
        self.down = Some(reason);
    }

    fn set_up(&mut self) {
        if self.down.take().is_some() {
            tracing::info!(store = self.store.kind(), "the catalog store is reachable again");
            if let Some((readiness, serving)) = &self.readiness
                && !serving.is_cancelled()
            {
                readiness.set_ready();
            }
        }
        self.metrics.store_up.set(1);
        self.backoff = RETRY_MIN;
    }

    async fn on_tick(&mut self) {
        self.age_tombstones();
        self.age_recent_local();
        if Instant::now() < self.retry_at {
            return;
        }
        if !self.queue.is_empty() {
            self.drain_queue().await;
        } else if self.down.is_some() {
            match self.store.ping().await {
                Ok(()) => self.set_up(),
                Err(error) => {
                    self.set_down(error.to_string());
                    self.schedule_retry();
                }
            }
        }
    }

    fn schedule_retry(&mut self) {
        self.retry_at = Instant::now() + self.backoff;
        self.backoff = (self.backoff * 2).min(RETRY_MAX);
    }

    /// Commits `plan` to the store (or the write-behind queue), then to memory;
    /// returns the catalog version that includes it.
    async fn commit(&mut self, mut plan: Plan) -> Outcome {
        if plan.ops.is_empty() {
            return Outcome::Done(self.state.read().expect("catalog lock poisoned").version());
        }
        if !self.queue.is_empty() {
            // Keep order: nothing overtakes what is already queued.
            return self.enqueue(plan);
        }
        let started = Instant::now();
        let result = self.store.commit(plan.ops.clone()).await;
        self.metrics
            .store_commit_seconds
            .observe(started.elapsed().as_secs_f64());
        match result {
            Ok(revision) => {
                self.set_up();
                for op in &plan.ops {
                    if let Some(key) = op_keys(op) {
                        self.set_rev(key, revision, is_delete(op));
                    }
                }
                plan.ops.clear();
                Outcome::Done(self.apply(plan))
            }
            Err(StoreError::Conflict(conflict)) => {
                self.metrics.store_conflicts.inc();
                Outcome::Conflict(conflict)
            }
            Err(StoreError::Unavailable(reason)) => {
                self.metrics.store_commit_failures.inc();
                self.set_down(reason);
                self.schedule_retry();
                self.enqueue(plan)
            }
            Err(error) => {
                self.metrics.store_commit_failures.inc();
                tracing::error!(%error, "store commit failed; the writes in it were refused");
                Outcome::Refused(Status::unavailable(format!(
                    "the catalog store refused the write: {error}"
                )))
            }
        }
    }

    /// Accepts `plan` into memory and the write-behind queue, if it fits.
    fn enqueue(&mut self, mut plan: Plan) -> Outcome {
        let limit = self.config.write_behind_limit;
        if limit == 0 {
            let reason = self.down.clone().unwrap_or_default();
            return Outcome::Refused(Status::unavailable(format!(
                "the catalog store is unreachable ({reason}) and writes are not queued \
                 (--write-behind-limit 0); retry later or against another replica"
            )));
        }
        if self.queued_ops + plan.ops.len() > limit {
            self.metrics.write_behind_refused.inc();
            let reason = self.down.clone().unwrap_or_else(|| "catching up".into());
            return Outcome::Refused(Status::unavailable(format!(
                "the catalog store is unreachable ({reason}) and the write-behind queue is full \
                 ({} of {limit} operations); retry later or against another replica",
                self.queued_ops
            )));
        }
        for op in &plan.ops {
            if let Some(key) = op_keys(op) {
                *self.pending.entry(key.clone()).or_default() += 1;
                self.revs.insert(key, PENDING);
            }
        }
        let ops = std::mem::take(&mut plan.ops);
        self.queued_ops += ops.len();
        self.metrics.write_behind_ops.set(self.queued_ops as i64);
        self.queue.push_back(Queued { ops, attempts: 0 });
        Outcome::Done(self.apply(plan))
    }

    /// Commits queued batches in order until the queue is empty or the store fails.
    async fn drain_queue(&mut self) {
        while let Some(front) = self.queue.front() {
            let ops = front.ops.clone();
            if ops.is_empty() {
                self.queue.pop_front();
                continue;
            }
            match self.store.commit(ops.clone()).await {
                Ok(revision) => {
                    self.queue.pop_front();
                    self.finish_queued(&ops, Some(revision));
                }
                Err(StoreError::Unavailable(reason)) => {
                    self.set_down(reason);
                    self.schedule_retry();
                    return;
                }
                Err(StoreError::Conflict(conflict)) => {
                    self.metrics.store_conflicts.inc();
                    let mut entry = self.queue.pop_front().expect("front exists");
                    entry.attempts += 1;
                    if entry.attempts > MAX_QUEUED_ATTEMPTS {
                        tracing::error!(detail = %conflict.detail, ops = entry.ops.len(),
                            "dropping a queued batch whose conditions keep failing");
                        self.metrics.write_behind_dropped.inc_by(entry.ops.len() as u64);
                        self.finish_queued(&entry.ops, None);
                        continue;
                    }
                    tracing::info!(detail = %conflict.detail,
                        "a queued batch raced another replica; adopting its records and retrying");
                    let before = entry.ops.len();
                    self.rewrite_queued(&mut entry.ops, conflict);
                    self.queued_ops = self.queued_ops + entry.ops.len() - before;
                    self.queue.push_front(entry);
                }
                Err(error) => {
                    let entry = self.queue.pop_front().expect("front exists");
                    tracing::error!(%error, ops = entry.ops.len(), "the store refused a queued batch; dropping it");
                    self.metrics.write_behind_dropped.inc_by(entry.ops.len() as u64);
                    self.finish_queued(&entry.ops, None);
                }
            }
        }
        self.set_up();
    }

    /// Bookkeeping once a queued batch left the queue (`None`: dropped).
    fn finish_queued(&mut self, ops: &[StoreOp], revision: Option<Revision>) {
        self.queued_ops -= ops.len().min(self.queued_ops);
        self.metrics.write_behind_ops.set(self.queued_ops as i64);
        for op in ops {
            let Some(key) = op_keys(op) else { continue };
            let left = match self.pending.get_mut(&key) {
                Some(n) => {
                    *n -= 1;
                    *n
                }
                None => 0,
            };
            if left == 0 {
                self.pending.remove(&key);
                match revision {
                    Some(revision) => self.set_rev(key, revision, is_delete(op)),
                    // Unknown: let the feed or the next resync decide.
                    None => {
                        self.revs.remove(&key);
                    }
                }
            }
        }
    }

    /// Makes a queued batch that lost a race committable: adopt the winners, give a
    /// service whose VIP was taken meanwhile a new one, recreate services another
    /// replica deleted.
    fn rewrite_queued(&mut self, ops: &mut Vec<StoreOp>, conflict: Conflict) {
        let winners: HashMap<String, Service> = conflict
            .existing
            .iter()
            .map(|s| (format!("{}/{}", s.namespace, s.name), s.clone()))
            .collect();
        let taken: HashSet<String> = conflict.existing.iter().map(|s| s.vip.clone()).collect();
        self.apply_remote(
            conflict
                .existing
                .into_iter()
                .map(|s| (None, FeedChangeKind::ServicePut(s)))
                .collect(),
        );
        ops.retain(|op| match op {
            StoreOp::CreateService(service) => {
                !winners.contains_key(&format!("{}/{}", service.namespace, service.name))
            }
            _ => true,
        });
        for op in ops.iter_mut() {
            let StoreOp::CreateService(service) = op else { continue };
            if !taken.contains(&service.vip) {
                continue;
            }
            let Ok(key) = ServiceKey::from_parts("service", &service.namespace, &service.name) else {
                continue;
            };
            let fresh = {
                let state = self.state.read().expect("catalog lock poisoned");
                self.config.vips.allocate(&key, |ip| state.vips.contains_key(&ip))
            };
            match fresh {
                Ok(vip) => {
                    service.vip = vip.to_string();
                    self.apply_remote(vec![(None, FeedChangeKind::ServicePut(service.clone()))]);
                }
                Err(error) => tracing::error!(%key, %error, "no VIP left for a queued service"),
            }
        }
        let mut recreate = Vec::new();
        {
            let state = self.state.read().expect("catalog lock poisoned");
            for key in conflict.missing {
                if let Some(entry) = state.services.get(&key) {
                    recreate.push(StoreOp::CreateService(entry.service.clone()));
                }
            }
        }
        for op in recreate.into_iter().rev() {
            ops.insert(0, op);
        }
    }

    /// Takes in what a lost race revealed, so the next plan is made against it.
    fn adopt(&mut self, conflict: Conflict) {
        let mut changes: Vec<(Option<Revision>, FeedChangeKind)> = conflict
            .existing
            .into_iter()
            .map(|s| (None, FeedChangeKind::ServicePut(s)))
            .collect();
        changes.extend(
            conflict
                .missing
                .into_iter()
                .map(|key| (None, FeedChangeKind::ServiceDeleted { key: key.to_string() })),
        );
        self.apply_remote(changes);
    }

    fn set_rev(&mut self, key: RecordKey, revision: Revision, deleted: bool) {
        if self.pending.contains_key(&key) {
            // A queued write to the same record is newer than this one.
            return;
        }
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

    fn add_tombstone(&mut self, revision: Revision, key: RecordKey) {
        self.tombstones.entry(revision).or_default().push(key);
        if self.tombstone_ages.back().is_none_or(|(_, r)| *r != revision) {
            self.tombstone_ages.push_back((Instant::now(), revision));
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
    fn prune_tombstones(&mut self, upto: Revision) {
        let keep = self.tombstones.split_off(&(upto.saturating_add(1)));
        for (revision, keys) in std::mem::replace(&mut self.tombstones, keep) {
            for key in keys {
                if self.revs.get(&key) == Some(&revision) {
                    self.revs.remove(&key);
                }
            }
        }
    }

    fn on_feed(&mut self, event: FeedEvent) {
        match event {
            FeedEvent::Changes { revision, changes } => {
                if self.down.is_some() && self.queue.is_empty() {
                    self.set_up();
                }
                let changes = changes.into_iter().map(|c| (Some(c.revision), c.kind)).collect();
                self.apply_remote(changes);
                self.feed_revision = self.feed_revision.max(revision);
                self.prune_tombstones(revision);
            }
            FeedEvent::Resync(contents) => {
                self.metrics.feed_resyncs.inc();
                tracing::info!(
                    revision = contents.revision,
                    "resyncing the catalog from a fresh store snapshot"
                );
                self.resync(contents);
            }
            FeedEvent::Down(reason) => {
                self.set_down(reason);
                self.schedule_retry();
            }
        }
    }

    /// Replaces memory by `contents`, except records written here after it was read.
    fn resync(&mut self, contents: Contents) {
        let horizon = contents.revision;
        let mut services = HashSet::new();
        let mut endpoints = HashSet::new();
        for s in &contents.services {
            if let Ok(key) = ServiceKey::from_parts("service", &s.value.namespace, &s.value.name) {
                services.insert(key);
            }
        }
        for e in &contents.endpoints {
            if let (Ok(key), Ok(address)) = (
                ServiceKey::parse("service", &e.value.service),
                e.value.address.parse::<IpAddr>(),
            ) {
                endpoints.insert((key, address));
            }
        }
        let recent = &self.recent_local;
        let stale = |revs: &HashMap<RecordKey, Revision>, key: &RecordKey| {
            revs.get(key).copied().unwrap_or(0) <= horizon && !recent.contains_key(key)
        };
        let mut changes = Vec::new();
        let mut forgotten = Vec::new();
        {
            let state = self.state.read().expect("catalog lock poisoned");
            for (key, entry) in &state.services {
                for address in entry.endpoints.keys() {
                    let record = RecordKey::Endpoint(key.clone(), *address);
                    if !endpoints.contains(&(key.clone(), *address)) && stale(&self.revs, &record) {
                        forgotten.push(record);
                        changes.push((
                            None,
                            FeedChangeKind::EndpointDeleted {
                                service: key.to_string(),
                                address: address.to_string(),
                            },
                        ));
                    }
                }
            }
            for key in state.services.keys() {
                if !services.contains(key) && stale(&self.revs, &RecordKey::Service(key.clone())) {
                    forgotten.push(RecordKey::Service(key.clone()));
                    if let Some(entry) = state.services.get(key) {
                        forgotten.extend(entry.endpoints.keys().map(|a| RecordKey::Endpoint(key.clone(), *a)));
                    }
                    changes.push((None, FeedChangeKind::ServiceDeleted { key: key.to_string() }));
                }
            }
        }
        // Gone from the store as far as we know: if a later snapshot shows them again
        // (at any revision), they are real and come back.
        for key in forgotten {
            self.revs.remove(&key);
        }
        changes.extend(
            contents
                .services
                .into_iter()
                .map(|s| (Some(s.revision), FeedChangeKind::ServicePut(s.value))),
        );
        changes.extend(
            contents
                .endpoints
                .into_iter()
                .map(|e| (Some(e.revision), FeedChangeKind::EndpointPut(e.value))),
        );
        for record in contents.unreadable {
            changes.push((None, FeedChangeKind::Unreadable(record)));
        }
        self.apply_remote(changes);
        self.feed_revision = self.feed_revision.max(horizon);
        self.prune_tombstones(horizon);
    }

    /// Applies changes made elsewhere (or revealed by a conflict) to memory and
    /// publishes them as one batch. A change with a revision is skipped unless it is
    /// newer than what memory holds for that record; `None` means "apply anyway".
    fn apply_remote(&mut self, changes: Vec<(Option<Revision>, FeedChangeKind)>) {
        let now = Instant::now();
        let mut out = Vec::new();
        let shared = self.state.clone();
        let mut state = shared.write().expect("catalog lock poisoned");
        for (revision, kind) in changes {
            match kind {
                FeedChangeKind::ServicePut(service) => {
                    let key = match ServiceKey::from_parts("service", &service.namespace, &service.name) {
                        Ok(key) => key,
                        Err(e) => {
                            self.metrics.feed_unusable.inc();
                            tracing::error!(error = %e, "skipping an unusable service from the store feed");
                            continue;
                        }
                    };
                    let vip = match parse_address("vip", &service.vip) {
                        Ok(vip) => vip,
                        Err(e) => {
                            self.metrics.feed_unusable.inc();
                            tracing::error!(service = %key, error = %e, "skipping an unusable service from the store feed");
                            continue;
                        }
                    };
                    let record = RecordKey::Service(key.clone());
                    if !newer(&mut self.revs, &record, revision) {
                        continue;
                    }
                    state.put_service(key, vip, service, now, &mut out);
                }
                FeedChangeKind::ServiceDeleted { key } => {
                    let Some(key) = state.services.get_key_value(key.as_str()).map(|(k, _)| k.clone()) else {
                        if let (Some(revision), Ok(key)) = (revision, ServiceKey::parse("service", &key)) {
                            newer(&mut self.revs, &RecordKey::Service(key), Some(revision));
                        }
                        continue;
                    };
                    let record = RecordKey::Service(key.clone());
                    if !newer(&mut self.revs, &record, revision) {
                        continue;
                    }
                    if let Some(revision) = revision {
                        self.add_tombstone(revision, record);
                    }
                    state.remove_service(&key, &mut out);
                }
                FeedChangeKind::EndpointPut(endpoint) => {
                    let valid = match validate_endpoint("endpoint", Some(endpoint)) {
                        Ok(valid) => valid,
                        Err(e) => {
                            self.metrics.feed_unusable.inc();
                            tracing::error!(error = %e, "skipping an unusable endpoint from the store feed");
                            continue;
                        }
                    };
                    if !state.services.contains_key(&valid.service) {
                        // Its service's deletion came first: the endpoint went with it.
                        tracing::debug!(service = %valid.service, address = %valid.address,
                            "ignoring an endpoint of a service this replica does not hold");
                        continue;
                    }
                    let record = RecordKey::Endpoint(valid.service.clone(), valid.address);
                    if !newer(&mut self.revs, &record, revision) {
                        continue;
                    }
                    state.put_endpoint(valid, &mut out);
                }
                FeedChangeKind::EndpointDeleted { service, address } => {
                    let (Ok(key), Ok(address)) = (ServiceKey::parse("service", &service), address.parse::<IpAddr>())
                    else {
                        continue;
                    };
                    let record = RecordKey::Endpoint(key.clone(), address);
                    if !newer(&mut self.revs, &record, revision) {
                        continue;
                    }
                    if let Some(revision) = revision {
                        self.add_tombstone(revision, record);
                    }
                    state.remove_endpoint(&key, address, now, &mut out);
                }
                FeedChangeKind::Unreadable(record) => {
                    self.metrics.feed_unusable.inc();
                    tracing::error!(record = %quote(&record.key), reason = %record.reason,
                        "skipping an unusable store record (left in the store untouched)");
                }
            }
        }
        if out.is_empty() {
            return;
        }
        self.metrics.feed_changes.inc_by(out.len() as u64);
        self.metrics.changes.inc_by(out.len() as u64);
        state.publish(out);
        self.metrics.catalog_version.set(state.seq as i64);
        self.metrics.services.set(state.services.len() as i64);
        self.metrics.endpoints.set(state.endpoint_count as i64);
    }

    /// Applies a committed (or queued) plan to memory and publishes it.
    fn apply(&mut self, plan: Plan) -> Version {
        let changes = plan.changes.len() as u64;
        let mut state = self.state.write().expect("catalog lock poisoned");
        state.apply(plan);
        self.metrics.changes.inc_by(changes);
        self.metrics.catalog_version.set(state.seq as i64);
        self.metrics.services.set(state.services.len() as i64);
        self.metrics.endpoints.set(state.endpoint_count as i64);
        state.version()
    }
}

/// Whether a change at `revision` is newer than what is known of `record` (and if
/// so, records it). `None` always applies.
fn newer(revs: &mut HashMap<RecordKey, Revision>, record: &RecordKey, revision: Option<Revision>) -> bool {
    let Some(revision) = revision else { return true };
    match revs.get(record) {
        Some(&known) if known >= revision => false,
        _ => {
            revs.insert(record.clone(), revision);
            true
        }
    }
}
