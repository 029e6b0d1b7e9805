//! The writer task, the only one that changes the catalog: it takes queued writes
//! in groups, plans them, commits the plan (re-planning after a lost race with
//! another replica), then applies it to memory; between writes it follows the
//! store's feed and retries the store while it is down.

use parking_lot::RwLock;
use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use aether_common::readiness::Gate;
use aether_proto::registrar::v1::Version;
use aether_proto::registry::v1::{External, KubernetesService, Service};
use futures::StreamExt;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tonic::Status;

use super::CatalogConfig;
use super::health::StoreHealth;
use super::plan::Plan;
use super::revisions::{RecordKey, Revisions, is_delete};
use super::state::State;
use super::write_behind::WriteBehind;
use crate::metrics::Metrics;
use crate::model::{ServiceKey, ValidEndpoint};
use crate::records::{ConfigKind, ConfigRecord};
use crate::store::{Revision, Store, StoreError};
use crate::vip::VipAllocator;

/// Most writes folded into one store transaction.
const MAX_GROUP_COMMIT: usize = 512;
/// Conflicts (lost races with other replicas) a group of writes is re-planned after.
const MAX_CONFLICT_RETRIES: usize = 4;
/// How long shutdown waits for an unreachable store to flush the write-behind queue.
const FLUSH_ON_SHUTDOWN: Duration = Duration::from_secs(10);

pub(super) enum Write {
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
    /// Make the stored records of `kind` exactly these (a source's whole set of them);
    /// planned alone.
    Configs {
        kind: ConfigKind,
        desired: BTreeMap<String, ConfigRecord>,
        reply: oneshot::Sender<Result<Version, Status>>,
    },
    /// Give services their Kubernetes Services' attributes (the cluster's whole set);
    /// planned alone.
    ServiceAttributes {
        desired: BTreeMap<ServiceKey, KubernetesService>,
        reply: oneshot::Sender<Result<Version, Status>>,
    },
    /// Make the external services exactly these (the sources' whole set); planned alone.
    ExternalServices {
        desired: BTreeMap<ServiceKey, External>,
        reply: ExternalsReply,
    },
    /// Remove expired empty services; always planned alone.
    Reap,
    /// Remove the endpoints of nodes whose liveness lapsed; always planned alone.
    Expire,
}

/// The writer task; run it with [`Writer::run`].
pub struct Writer {
    pub(super) state: Arc<RwLock<State>>,
    writes: mpsc::Receiver<Write>,
    pub(super) store: Arc<dyn Store>,
    pub(super) config: Arc<CatalogConfig>,
    pub(super) metrics: Metrics,
    /// What revision each record is known at, and how far the feed got.
    pub(super) revisions: Revisions,
    /// Writes accepted while the store is unreachable.
    pub(super) behind: WriteBehind,
    pub(super) health: StoreHealth,
    /// When each node's liveness was last refreshed in the store.
    pub(super) last_refresh: HashMap<String, Instant>,
}

/// How a plan's commit went.
pub(super) enum Outcome {
    /// In the store (or queued); the version that includes it.
    Done(Version),
    Conflict(crate::store::Conflict),
    Refused(Status),
}

/// The writes of a group that are planned alone, taken out of it.
#[derive(Default)]
struct Alone {
    reap: bool,
    expire: bool,
    configs: Vec<(ConfigKind, BTreeMap<String, ConfigRecord>, VersionReply)>,
    /// The last set of Service attributes (it replaces the earlier ones), and every
    /// caller to answer once it is applied.
    attributes: Option<BTreeMap<ServiceKey, KubernetesService>>,
    attribute_replies: Vec<VersionReply>,
    externals: Vec<(BTreeMap<ServiceKey, External>, ExternalsReply)>,
}

type VersionReply = oneshot::Sender<Result<Version, Status>>;
type ExternalsReply = oneshot::Sender<Result<ExternalsApplied, Status>>;

/// What became of a set of external services.
#[derive(Clone, Debug)]
pub struct ExternalsApplied {
    /// The catalog version that includes them.
    pub version: Version,
    /// The ones not taken, with why (their key is a mesh service's).
    pub refused: Vec<(ServiceKey, String)>,
}

impl Alone {
    fn take(group: &mut Vec<Write>) -> Alone {
        let mut alone = Alone::default();
        let closed = || oneshot::channel().0;
        group.retain_mut(|w| match w {
            Write::Reap => {
                alone.reap = true;
                false
            }
            Write::Expire => {
                alone.expire = true;
                false
            }
            Write::Configs { kind, desired, reply } => {
                let taken = (*kind, std::mem::take(desired), std::mem::replace(reply, closed()));
                alone.configs.push(taken);
                false
            }
            Write::ServiceAttributes { desired, reply } => {
                alone.attributes = Some(std::mem::take(desired));
                (alone.attribute_replies).push(std::mem::replace(reply, closed()));
                false
            }
            Write::ExternalServices { desired, reply } => {
                let reply = std::mem::replace(reply, oneshot::channel().0);
                alone.externals.push((std::mem::take(desired), reply));
                false
            }
            _ => true,
        });
        alone
    }
}

/// One register or unregister of a group, with where its answer goes.
enum Request {
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

impl Request {
    fn from_write(write: Write) -> Option<Request> {
        match write {
            Write::Register { endpoint, owner, reply } => Some(Request::Register(endpoint, owner, reply)),
            Write::Unregister {
                service,
                address,
                owner,
                reply,
            } => Some(Request::Unregister(service, address, owner, reply)),
            Write::Configs { .. }
            | Write::ServiceAttributes { .. }
            | Write::ExternalServices { .. }
            | Write::Reap
            | Write::Expire => None,
        }
    }

    /// The node a registration refreshes.
    fn node(&self) -> Option<&str> {
        match self {
            Request::Register(e, ..) => Some(e.endpoint.node.as_str()),
            Request::Unregister(..) => None,
        }
    }

    /// Adds this request to `plan`. An unregistration is Ok if the endpoint
    /// existed and NOT_FOUND if it did not (read back in [`Request::answer`]).
    fn plan(&self, plan: &mut Plan, state: &State, vips: &VipAllocator) -> Result<Service, Status> {
        match self {
            Request::Register(endpoint, owner, _) => plan.register(state, vips, (**endpoint).clone(), owner.as_deref()),
            Request::Unregister(service, address, owner, _) => {
                match plan.unregister(state, service.clone(), *address, owner.as_deref()) {
                    Ok(true) => Ok(Service::default()),
                    Ok(false) => Err(Status::not_found("")),
                    Err(denied) => Err(denied),
                }
            }
        }
    }

    /// Answers the caller: its planned `result` and the group's commit `outcome`.
    fn answer(self, result: Result<Service, Status>, outcome: &Result<Version, Status>) {
        match self {
            Request::Register(.., reply) => {
                let _ = reply.send(result.and_then(|s| Ok((s, outcome.clone()?))));
            }
            Request::Unregister(.., reply) => {
                let _ = reply.send(match result {
                    Err(denied) if denied.code() == tonic::Code::PermissionDenied => Err(denied),
                    result => outcome.clone().map(|v| (result.is_ok(), v)),
                });
            }
        }
    }
}

impl Writer {
    pub(super) fn new(
        state: Arc<RwLock<State>>,
        writes: mpsc::Receiver<Write>,
        store: Arc<dyn Store>,
        config: Arc<CatalogConfig>,
        metrics: Metrics,
        revs: HashMap<RecordKey, Revision>,
        feed_revision: Revision,
    ) -> Writer {
        let health = StoreHealth::new(store.kind(), metrics.clone());
        Writer {
            state,
            writes,
            store,
            config,
            metrics,
            revisions: Revisions::new(revs, feed_revision),
            behind: WriteBehind::default(),
            health,
            last_refresh: HashMap::new(),
        }
    }

    /// Lets the writer report the store's health as the `readiness` gate: open
    /// now (the catalog was just loaded from it), closed while it is unreachable.
    pub fn with_readiness(mut self, readiness: Gate) -> Self {
        readiness.set_ready();
        self.health.readiness = Some(readiness);
        self
    }

    /// Applies writes and other replicas' changes until `shutdown`; writes already
    /// queued are still applied, and the write-behind queue is flushed if the store
    /// allows.
    pub async fn run(mut self, shutdown: CancellationToken) {
        let mut feed = self.store.feed(self.revisions.feed);
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
                        feed = self.store.feed(self.revisions.feed);
                    }
                },
                _ = tick.tick() => self.on_tick().await,
            }
        }
        self.finish().await;
    }

    /// Applies the writes still queued for the writer, then flushes the write-behind
    /// queue if the store allows before [`FLUSH_ON_SHUTDOWN`].
    async fn finish(&mut self) {
        self.writes.close();
        while let Some(write) = self.writes.recv().await {
            self.process(write).await;
        }
        self.flush_queue(Instant::now() + FLUSH_ON_SHUTDOWN).await;
        if self.behind.is_empty() {
            tracing::info!("catalog writer stopped; every acknowledged write is in the store");
        } else {
            tracing::error!(
                ops = self.behind.ops,
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
        let Alone {
            reap,
            expire,
            configs,
            attributes,
            attribute_replies,
            externals,
        } = Alone::take(&mut group);
        if let Some(desired) = attributes {
            // Before the group: services it creates start with them.
            self.state.write().kubernetes = desired;
        }
        if !group.is_empty() {
            self.commit_group(group).await;
        }
        for (kind, desired, reply) in configs {
            let _ = reply.send(self.set_configs(kind, desired).await);
        }
        if !attribute_replies.is_empty() {
            let applied = self.set_service_attributes().await;
            for reply in attribute_replies {
                let _ = reply.send(applied.clone());
            }
        }
        for (desired, reply) in externals {
            let _ = reply.send(self.set_external_services(&desired).await);
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

    /// Plans, commits and answers a group of registrations and unregistrations.
    async fn commit_group(&mut self, group: Vec<Write>) {
        let requests: Vec<Request> = group.into_iter().filter_map(Request::from_write).collect();
        self.refresh_nodes(requests.iter().filter_map(Request::node));
        let (outcome, results) = self.commit_with_retries(&requests).await;
        for (request, result) in requests.into_iter().zip(results) {
            request.answer(result, &outcome);
        }
    }

    /// Plans `requests` and commits the plan, planning again after each lost race
    /// (up to [`MAX_CONFLICT_RETRIES`]); returns the outcome and each request's
    /// planned result.
    async fn commit_with_retries(
        &mut self,
        requests: &[Request],
    ) -> (Result<Version, Status>, Vec<Result<Service, Status>>) {
        let mut attempt = 0;
        loop {
            let mut plan = Plan::default();
            let results: Vec<Result<Service, Status>> = {
                let state = self.state.read();
                requests
                    .iter()
                    .map(|request| request.plan(&mut plan, &state, &self.config.vips))
                    .collect()
            };
            match self.commit(plan).await {
                Outcome::Conflict(conflict) if attempt < MAX_CONFLICT_RETRIES => {
                    attempt += 1;
                    tracing::info!(detail = %conflict.detail, "lost a race with another replica; adopting its records and retrying");
                    self.adopt(conflict);
                }
                Outcome::Conflict(conflict) => {
                    let refused = Status::aborted(format!(
                        "the store kept refusing the write after {attempt} retries: {}",
                        conflict.detail
                    ));
                    return (Err(refused), results);
                }
                Outcome::Refused(status) => return (Err(status), results),
                Outcome::Done(version) => return (Ok(version), results),
            }
        }
    }

    /// Commits a source's whole set of records of `kind` (records never conflict: no
    /// retries needed).
    async fn set_configs(
        &mut self,
        kind: ConfigKind,
        desired: BTreeMap<String, ConfigRecord>,
    ) -> Result<Version, Status> {
        let mut plan = Plan::default();
        plan.set_configs(&self.state.read(), kind, desired);
        match self.commit(plan).await {
            Outcome::Done(version) => Ok(version),
            Outcome::Refused(status) => Err(status),
            Outcome::Conflict(conflict) => Err(Status::aborted(conflict.detail)),
        }
    }

    /// Gives services the attributes last set (`State::kubernetes`), planning again
    /// after a conflict (a service another replica deleted meanwhile).
    async fn set_service_attributes(&mut self) -> Result<Version, Status> {
        for _ in 0..=MAX_CONFLICT_RETRIES {
            let mut plan = Plan::default();
            {
                let state = self.state.read();
                plan.set_service_attributes(&state, &state.kubernetes);
            }
            match self.commit(plan).await {
                Outcome::Done(version) => return Ok(version),
                Outcome::Refused(status) => return Err(status),
                Outcome::Conflict(conflict) => self.adopt(conflict),
            }
        }
        Err(Status::aborted("services kept changing under their attribute updates"))
    }

    /// Makes the external services exactly `desired`, planning again after a conflict
    /// (another replica created or removed one meanwhile).
    async fn set_external_services(
        &mut self,
        desired: &BTreeMap<ServiceKey, External>,
    ) -> Result<ExternalsApplied, Status> {
        for _ in 0..=MAX_CONFLICT_RETRIES {
            let mut plan = Plan::default();
            let refused = plan.set_external_services(&self.state.read(), &self.config.vips, desired);
            match self.commit(plan).await {
                Outcome::Done(version) => return Ok(ExternalsApplied { version, refused }),
                Outcome::Refused(status) => return Err(status),
                Outcome::Conflict(conflict) => self.adopt(conflict),
            }
        }
        Err(Status::aborted(
            "services kept changing under the external services' update",
        ))
    }

    async fn on_tick(&mut self) {
        self.revisions.age();
        if !self.health.retry_due() {
            return;
        }
        if !self.behind.is_empty() {
            self.drain_queue().await;
        } else if self.health.is_down() {
            match self.store.ping().await {
                Ok(()) => self.health.set_up(),
                Err(error) => self.health.failed(error.to_string()),
            }
        }
    }

    /// Commits `plan` to the store (or the write-behind queue), then to memory;
    /// returns the catalog version that includes it.
    pub(super) async fn commit(&mut self, mut plan: Plan) -> Outcome {
        if plan.ops.is_empty() {
            return Outcome::Done(self.state.read().version());
        }
        if !self.behind.is_empty() {
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
                self.health.set_up();
                for op in &plan.ops {
                    if let Some(key) = RecordKey::of_op(op) {
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
                self.health.failed(reason);
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

    /// Records that `key` is in the store at `revision`, unless a queued write to it
    /// is newer.
    pub(super) fn set_rev(&mut self, key: RecordKey, revision: Revision, deleted: bool) {
        if self.behind.touches(&key) {
            return;
        }
        self.revisions.committed(key, revision, deleted);
    }

    /// Applies a committed (or queued) plan to memory and publishes it.
    pub(super) fn apply(&mut self, plan: Plan) -> Version {
        let changes = plan.changes.len() as u64;
        let mut state = self.state.write();
        state.apply(plan);
        self.metrics.changes.inc_by(changes);
        state.report(&self.metrics);
        state.version()
    }
}
