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

use aether_proto::registrar::v1::{Change, EndpointRef, Version, change};
use aether_proto::registry::v1::{Endpoint, Service};
use tokio::sync::{broadcast, mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tonic::Status;

use crate::metrics::Metrics;
use crate::model::{ServiceKey, ValidEndpoint, parse_address, validate_endpoint};
use crate::store::{Store, StoreError, StoreOp, UnreadableRecord};
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

    fn register(&mut self, state: &State, vips: &VipAllocator, valid: ValidEndpoint) -> Result<Service, Status> {
        let key = valid.service;
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

    fn unregister(&mut self, state: &State, key: ServiceKey, address: IpAddr) -> bool {
        if self.endpoint(state, &key, address).is_none() {
            return false;
        }
        self.ops.push(StoreOp::DeleteEndpoint {
            service: key.clone(),
            address: address.to_string(),
        });
        self.change(&key, Event::EndpointRemoved(address));
        self.endpoints.insert((key, address), None);
        true
    }

    /// Removes services that have had no endpoints for longer than `ttl`.
    fn reap(&mut self, state: &State, now: Instant, ttl: Duration) {
        for (key, entry) in &state.services {
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

enum Write {
    Register {
        endpoint: Box<ValidEndpoint>,
        reply: oneshot::Sender<Result<(Service, Version), Status>>,
    },
    Unregister {
        service: ServiceKey,
        address: IpAddr,
        reply: oneshot::Sender<Result<(bool, Version), Status>>,
    },
    /// Remove expired empty services; always planned alone.
    Reap,
}

/// A cheap, cloneable handle to the catalog.
#[derive(Clone)]
pub struct Catalog {
    state: Arc<RwLock<State>>,
    writes: mpsc::Sender<Write>,
    config: Arc<CatalogConfig>,
    metrics: Metrics,
}

/// The writer task; run it with [`Writer::run`].
pub struct Writer {
    state: Arc<RwLock<State>>,
    writes: mpsc::Receiver<Write>,
    store: Arc<dyn Store>,
    config: Arc<CatalogConfig>,
    metrics: Metrics,
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
        for service in contents.services {
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
        for endpoint in contents.endpoints {
            let record = format!("endpoints/{}/{}", endpoint.service, endpoint.address);
            match validate_endpoint("endpoint", Some(endpoint)) {
                Ok(valid) => match services.get_mut(&valid.service) {
                    Some(entry) => {
                        entry.empty_since = None;
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
            tracing::error!(record = %record.key, reason = %record.reason,
                "skipping an unusable store record (left in the store untouched)");
        }
        metrics.store_unreadable_records.set(unreadable.len() as i64);
        metrics.services.set(services.len() as i64);
        metrics.endpoints.set(endpoint_count as i64);

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
        };
        let writer = Writer {
            state,
            writes: rx,
            store,
            config,
            metrics,
        };
        Ok((catalog, writer))
    }

    pub fn read(&self) -> RwLockReadGuard<'_, State> {
        self.state.read().expect("catalog lock poisoned")
    }

    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    pub async fn register(&self, endpoint: ValidEndpoint) -> Result<(Service, Version), Status> {
        let (reply, response) = oneshot::channel();
        self.submit(Write::Register {
            endpoint: Box::new(endpoint),
            reply,
        })
        .await?;
        response.await.map_err(|_| shutting_down())?
    }

    pub async fn unregister(&self, service: ServiceKey, address: IpAddr) -> Result<(bool, Version), Status> {
        let (reply, response) = oneshot::channel();
        self.submit(Write::Unregister {
            service,
            address,
            reply,
        })
        .await?;
        response.await.map_err(|_| shutting_down())?
    }

    async fn submit(&self, write: Write) -> Result<(), Status> {
        self.writes.send(write).await.map_err(|_| shutting_down())
    }

    /// Periodically asks the writer to remove services that stayed empty past the TTL.
    pub async fn run_reaper(self, shutdown: CancellationToken) {
        let period = (self.config.empty_service_ttl / 4).clamp(Duration::from_millis(100), Duration::from_secs(60));
        let mut tick = tokio::time::interval(period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tick.tick() => {
                    // A full queue means the writer is busy; try again next tick.
                    let _ = self.writes.try_send(Write::Reap);
                }
            }
        }
    }
}

fn shutting_down() -> Status {
    Status::unavailable("the registrar is shutting down; retry against another replica")
}

impl Writer {
    /// Applies writes until `shutdown`; writes already queued are still applied.
    pub async fn run(mut self, shutdown: CancellationToken) {
        loop {
            let first = tokio::select! {
                biased;
                write = self.writes.recv() => write,
                _ = shutdown.cancelled() => None,
            };
            let Some(first) = first else { break };
            self.process(first).await;
        }
        self.writes.close();
        while let Some(write) = self.writes.recv().await {
            self.process(write).await;
        }
        tracing::info!("catalog writer stopped; every acknowledged write is in the store");
    }

    async fn process(&mut self, first: Write) {
        let mut group = vec![first];
        while group.len() < MAX_GROUP_COMMIT {
            match self.writes.try_recv() {
                Ok(write) => group.push(write),
                Err(_) => break,
            }
        }
        let (reaps, group): (Vec<_>, Vec<_>) = group.into_iter().partition(|w| matches!(w, Write::Reap));
        if !group.is_empty() {
            self.commit_group(group).await;
        }
        if !reaps.is_empty() {
            self.reap().await;
        }
    }

    async fn commit_group(&mut self, group: Vec<Write>) {
        enum Pending {
            Register(
                oneshot::Sender<Result<(Service, Version), Status>>,
                Result<Service, Status>,
            ),
            Unregister(oneshot::Sender<Result<(bool, Version), Status>>, bool),
        }
        let mut plan = Plan::default();
        let pending: Vec<Pending> = {
            let state = self.state.read().expect("catalog lock poisoned");
            group
                .into_iter()
                .filter_map(|write| match write {
                    Write::Register { endpoint, reply } => {
                        let outcome = plan.register(&state, &self.config.vips, *endpoint);
                        Some(Pending::Register(reply, outcome))
                    }
                    Write::Unregister {
                        service,
                        address,
                        reply,
                    } => Some(Pending::Unregister(reply, plan.unregister(&state, service, address))),
                    Write::Reap => None,
                })
                .collect()
        };
        let version = self.commit(plan).await;
        for p in pending {
            match p {
                Pending::Register(reply, outcome) => {
                    let _ = reply.send(outcome.and_then(|s| Ok((s, version.clone()?))));
                }
                Pending::Unregister(reply, existed) => {
                    let _ = reply.send(version.clone().map(|v| (existed, v)));
                }
            }
        }
    }

    async fn reap(&mut self) {
        let mut plan = Plan::default();
        {
            let state = self.state.read().expect("catalog lock poisoned");
            plan.reap(&state, Instant::now(), self.config.empty_service_ttl);
        }
        let removed: Vec<String> = plan.removed_services.iter().map(|(k, _)| k.to_string()).collect();
        if self.commit(plan).await.is_ok() && !removed.is_empty() {
            tracing::info!(services = ?removed, "removed services that had no endpoints for longer than the TTL");
        }
    }

    /// Commits `plan` to the store, then to memory; returns the catalog version that
    /// includes it.
    async fn commit(&mut self, mut plan: Plan) -> Result<Version, Status> {
        if plan.ops.is_empty() {
            return Ok(self.state.read().expect("catalog lock poisoned").version());
        }
        let started = Instant::now();
        let result = self.store.commit(std::mem::take(&mut plan.ops)).await;
        self.metrics
            .store_commit_seconds
            .observe(started.elapsed().as_secs_f64());
        if let Err(error) = result {
            self.metrics.store_commit_failures.inc();
            tracing::error!(%error, "store commit failed; the writes in it were refused");
            return Err(Status::unavailable(format!(
                "the catalog store refused the write: {error}"
            )));
        }
        let changes = plan.changes.len() as u64;
        let mut state = self.state.write().expect("catalog lock poisoned");
        state.apply(plan);
        self.metrics.changes.inc_by(changes);
        self.metrics.catalog_version.set(state.seq as i64);
        self.metrics.services.set(state.services.len() as i64);
        self.metrics.endpoints.set(state.endpoint_count as i64);
        Ok(state.version())
    }
}
