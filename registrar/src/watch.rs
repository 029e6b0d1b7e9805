//! One Watch stream: the client's filter, what it has been sent, and the loop that
//! turns catalog batches into filtered deltas.
//!
//! Consistency rule: everything a watcher sends is derived from the catalog state at
//! a known version. The initial snapshot, a resync and a filter change are all read
//! under the catalog's read lock, during which no batch can be published, so the
//! watcher knows exactly which batches are already reflected and which are not.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use aether_proto::registrar::v1::{
    Change, Delta, Holdings, Snapshot, SnapshotComplete, SnapshotReason, Version, WatchRequest, WatchResponse, change,
    watch_response,
};
use aether_proto::registry::v1::{Endpoint, Service};
use futures::{Stream, StreamExt};
use tokio::sync::broadcast::{self, error::RecvError, error::TryRecvError};
use tokio::sync::{Semaphore, SemaphorePermit, mpsc};
use tokio_util::sync::CancellationToken;
use tonic::Status;

use crate::catalog::{Batch, Catalog, Event, KeyedChange, State};
use crate::model::{InvalidField, ServiceKey};
use crate::records::{ConfigKind, ConfigRecord, config_change};

/// Endpoints per snapshot message, so no message nears gRPC's 4 MiB default limit.
pub const SNAPSHOT_CHUNK_ENDPOINTS: usize = 100;
/// Most services one filter may name.
pub const MAX_FILTER_SERVICES: usize = 100_000;
/// Most policy namespaces one filter may name (a node hosts pods of far fewer).
pub const MAX_FILTER_POLICY_NAMESPACES: usize = 10_000;
/// How often a watcher with nothing to send tells its client how far it has read,
/// so a reconnect can resume from a recent version.
pub const PROGRESS_INTERVAL: Duration = Duration::from_secs(5);

/// Watch starts (snapshots, resumes) streamed at once in this process. Each one holds
/// its selection and fills its outbox, HTTP/2 and TLS buffers; thousands at once (every
/// agent after a replica died) left the registrar a few hundred KiB per agent
/// (proposals/011). The rest wait their turn: the total is bound by CPU anyway, and
/// each agent is current sooner.
pub const CONCURRENT_STARTS: usize = 32;
/// How long a start keeps its turn while its client does not read.
const TURN_LIMIT: Duration = Duration::from_secs(5);
static TURNS: Semaphore = Semaphore::const_new(CONCURRENT_STARTS);

/// A turn at streaming a start: given up when it is over or its client is too slow.
struct Turn {
    permit: Option<SemaphorePermit<'static>>,
    until: tokio::time::Instant,
}

impl Turn {
    async fn take() -> Turn {
        Turn {
            permit: Some(TURNS.acquire().await.expect("the turns are never closed")),
            until: tokio::time::Instant::now() + TURN_LIMIT,
        }
    }

    /// A turn, or `None` if the registrar shuts down first.
    async fn take_unless(shutdown: &CancellationToken) -> Option<Turn> {
        tokio::select! {
            _ = shutdown.cancelled() => None,
            turn = Turn::take() => Some(turn),
        }
    }

    /// Waits for room in `out`; past the limit, gives the turn to the next start.
    async fn room<T>(&mut self, out: &mpsc::Sender<T>) {
        if self.permit.is_some() && tokio::time::timeout_at(self.until, out.reserve()).await.is_err() {
            self.permit = None;
        }
    }
}

/// Which services a watcher wants.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Filter {
    /// The client's id for this filter, echoed in what is computed with it.
    id: u64,
    wildcard: bool,
    services: HashSet<ServiceKey>,
    /// Every service's record and no endpoints (what a node needs for DNS).
    services_only: bool,
    /// Namespaces whose authorization policies the client gets (mesh-wide ones too).
    policy_namespaces: BTreeSet<String>,
}

impl Filter {
    pub fn parse(request: &WatchRequest) -> Result<Self, InvalidField> {
        if request.services_only {
            return Ok(Self {
                id: request.filter_id,
                wildcard: true,
                services_only: true,
                ..Self::default()
            });
        }
        let policy_namespaces = policy_namespaces(&request.policy_namespaces)?;
        if request.wildcard {
            return Ok(Self {
                id: request.filter_id,
                wildcard: true,
                policy_namespaces,
                ..Self::default()
            });
        }
        if request.services.len() > MAX_FILTER_SERVICES {
            return Err(InvalidField::new(
                "services",
                format!("{} services (at most {MAX_FILTER_SERVICES})", request.services.len()),
            ));
        }
        let services = request
            .services
            .iter()
            .enumerate()
            .map(|(i, key)| ServiceKey::parse(&format!("services[{i}]"), key))
            .collect::<Result<_, _>>()?;
        Ok(Self {
            id: request.filter_id,
            wildcard: false,
            services,
            services_only: false,
            policy_namespaces,
        })
    }

    pub fn matches(&self, key: &str) -> bool {
        self.wildcard || self.services.contains(key)
    }

    /// Whether this filter sends `change`: a services-only filter drops endpoint
    /// changes; a configuration record's change passes when the client held or now
    /// wants the record.
    fn passes(&self, change: &KeyedChange) -> bool {
        if let Event::Config(c) = &change.event {
            let wants = |r: &Option<ConfigRecord>| r.as_ref().is_some_and(|r| self.wants(r));
            return wants(&c.old) || wants(&c.new);
        }
        let is_service = matches!(change.event, Event::ServiceAdded(_) | Event::ServiceRemoved);
        self.matches(change.service.as_str()) && (is_service || !self.services_only)
    }

    /// Whether the client holds `record`: a route when one of its parents is in the
    /// filter; a policy when it is mesh-wide or of one of the client's policy namespaces
    /// (the destination side), or guards calls to an external service in the filter (the
    /// callers' side); an HTTP filter when it is of one of those namespaces, or
    /// names a service in the filter (the callers' side); a MeshConfig when it is
    /// mesh-wide, of a policy namespace, or of a watched service's namespace (its
    /// resilience defaults apply to calls to that service). A services-only client (a
    /// node's DNS records) holds the mesh-wide MeshConfig alone: its mesh domain is a
    /// domain DNS answers.
    fn wants(&self, record: &ConfigRecord) -> bool {
        if self.services_only {
            return matches!(record, ConfigRecord::MeshConfig(config) if config.mesh_wide);
        }
        match record {
            ConfigRecord::Route(route) => route.parents.iter().any(|p| self.matches(&p.service)),
            ConfigRecord::Policy(policy) => {
                let target = policy.target.as_ref();
                let mesh_wide = target.is_some_and(|t| t.mesh_wide);
                // A policy guarding calls to external services is judged by their callers.
                let guards_watched = target.is_some_and(|t| t.external_services.iter().any(|s| self.matches(s)));
                mesh_wide || self.policy_namespaces.contains(&policy.namespace) || guards_watched
            }
            ConfigRecord::HttpFilter(filter) => {
                self.policy_namespaces.contains(&filter.namespace) || filter.services.iter().any(|s| self.matches(s))
            }
            ConfigRecord::MeshConfig(config) => {
                config.mesh_wide
                    || self.policy_namespaces.contains(&config.namespace)
                    || self.watches_namespace(&config.namespace)
            }
        }
    }

    /// Whether a service of `namespace` is in the filter (a wildcard holds them all).
    fn watches_namespace(&self, namespace: &str) -> bool {
        self.wildcard
            || (self.services.iter()).any(|key| key.as_str().split_once('/').is_some_and(|(ns, _)| ns == namespace))
    }

    /// The catalog's services this filter selects.
    fn selected<'a>(&'a self, state: &'a State) -> Box<dyn Iterator<Item = &'a ServiceKey> + 'a> {
        if self.wildcard {
            Box::new(state.services().map(|(key, _)| key))
        } else {
            Box::new(self.services.iter().filter(|key| state.service(key.as_str()).is_some()))
        }
    }
}

/// The `policy_namespaces` of a request, each a namespace name.
fn policy_namespaces(namespaces: &[String]) -> Result<BTreeSet<String>, InvalidField> {
    if namespaces.len() > MAX_FILTER_POLICY_NAMESPACES {
        let count = namespaces.len();
        let reason = format!("{count} namespaces (at most {MAX_FILTER_POLICY_NAMESPACES})");
        return Err(InvalidField::new("policy_namespaces", reason));
    }
    let check = |(i, namespace): (usize, &String)| {
        aether_common::names::dns_label(namespace).map_err(|reason| {
            let field = format!("policy_namespaces[{i}]");
            InvalidField::new(&field, format!("{}: {reason}", aether_common::quote::quote(namespace)))
        })?;
        Ok(namespace.clone())
    };
    namespaces.iter().enumerate().map(check).collect()
}

/// What a Watch stream's task hands to tonic. Boxed: the channel allocates its slots in
/// blocks of 32 whatever its bound, and unboxed, each watcher's two live blocks took
/// ~10 KiB (heaptrack at 500 simulated agents; a `Status` alone is ~180 bytes).
pub type Outgoing = Box<Result<WatchResponse, Status>>;

/// Serves one Watch stream until the client leaves, sends bad input, or `shutdown`.
pub async fn serve<S>(catalog: Catalog, mut inbound: S, out: mpsc::Sender<Outgoing>, shutdown: CancellationToken)
where
    S: Stream<Item = Result<WatchRequest, Status>> + Unpin,
{
    let metrics = catalog.metrics().clone();
    metrics.watchers.inc();
    let _gauge = scopeguard(move || {
        metrics.watchers.dec();
    });

    let first = tokio::select! {
        _ = shutdown.cancelled() => {
            let _ = out.try_send(Box::new(Err(shutting_down())));
            return;
        }
        first = inbound.next() => first,
    };
    let Some(Ok(first)) = first else { return };
    let filter = match Filter::parse(&first) {
        Ok(filter) => filter,
        Err(e) => return refuse(&catalog, &out, e).await,
    };
    if let Err(e) = check_holdings(first.held.as_ref()) {
        return refuse(&catalog, &out, e).await;
    }
    let Some(turn) = Turn::take_unless(&shutdown).await else {
        return;
    };
    let (rx, start) = {
        let state = catalog.read();
        let rx = state.subscribe();
        let resume = first.resume_from.as_ref().filter(|v| !v.instance.is_empty());
        let missed = resume
            .filter(|v| v.instance == state.instance())
            .and_then(|v| state.history_after(v.seq));
        let start = if let Some(batches) = missed {
            Start::Resume(batches, resume.map_or(0, |v| v.seq))
        } else if let Some(held) = &first.held {
            Start::Reconcile(reconcile(&state, &filter, held), state.version())
        } else {
            let reason = if resume.is_some() {
                SnapshotReason::ResumeUnavailable
            } else {
                SnapshotReason::Initial
            };
            Start::Snapshot(collect(&state, &filter), state.version(), reason)
        };
        (rx, start)
    };
    let instance = catalog.read().instance().to_owned();
    let mut watcher = Watcher {
        instance,
        catalog,
        out,
        filter,
        rx,
        processed: 0,
        sent: 0,
        turn: Some(turn),
    };
    // The start and the rare paths of `run` (resync, filter change) are boxed: a future
    // is as large as its largest state, and this task lives as long as its agent is
    // connected (5.4 KiB per watcher with them inline, heaptrack at 500 agents).
    let resumes = &watcher.catalog.metrics().watch_resumes;
    let started = match start {
        Start::Resume(batches, from) => {
            resumes.get_or_create(&[("from", "history")]).inc();
            watcher.processed = from;
            watcher.sent = from;
            Box::pin(watcher.send_batches(&batches)).await
        }
        Start::Reconcile(Reconciled { removals, missing }, version) => {
            resumes.get_or_create(&[("from", "holdings")]).inc();
            let reason = SnapshotReason::Reconciled;
            Box::pin(watcher.send_snapshot(missing, version, reason, removals)).await
        }
        Start::Snapshot(selection, version, reason) => {
            Box::pin(watcher.send_snapshot(selection, version, reason, Vec::new())).await
        }
    };
    if started.is_err() {
        return;
    }
    watcher.turn = None;
    let _ = watcher.run(inbound, shutdown).await;
}

enum Start {
    Resume(Vec<Arc<Batch>>, u64),
    Reconcile(Reconciled, Version),
    Snapshot(Selection, Version, SnapshotReason),
}

/// The client went away; nothing more to send.
struct Gone;

struct Watcher {
    /// The registrar instance every version this watcher sends belongs to.
    instance: String,
    catalog: Catalog,
    out: mpsc::Sender<Outgoing>,
    filter: Filter,
    rx: broadcast::Receiver<Arc<Batch>>,
    /// The last batch reflected in what the client has been sent (or filtered out).
    processed: u64,
    /// The last version the client was told.
    sent: u64,
    /// While streaming a start or a resync: its turn.
    turn: Option<Turn>,
}

impl Watcher {
    async fn run<S>(&mut self, mut inbound: S, shutdown: CancellationToken) -> Result<(), Gone>
    where
        S: Stream<Item = Result<WatchRequest, Status>> + Unpin,
    {
        // The first progress check comes a whole interval after the stream started, on
        // every path: a resumed stream whose last missed batches were all filtered out
        // must not answer with an empty Delta at once, when a live one that skipped the
        // same batches says nothing until its next tick. (`interval` would tick at once.)
        let mut progress = tokio::time::interval_at(tokio::time::Instant::now() + PROGRESS_INTERVAL, PROGRESS_INTERVAL);
        progress.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut inbound_open = true;
        loop {
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => {
                    let _ = self.out.try_send(Box::new(Err(shutting_down())));
                    return Ok(());
                }
                // The client is gone even if nothing was sent to notice it.
                _ = self.out.closed() => return Err(Gone),
                request = inbound.next(), if inbound_open => match request {
                    Some(Ok(request)) => match Filter::parse(&request) {
                        Ok(filter) => Box::pin(self.change_filter(filter)).await?,
                        Err(e) => {
                            refuse(&self.catalog, &self.out, e).await;
                            return Ok(());
                        }
                    },
                    // The client half-closed: no more filter changes, keep streaming.
                    None => inbound_open = false,
                    Some(Err(_)) => return Ok(()),
                },
                event = self.rx.recv() => match event {
                    Ok(batch) => self.send_batches(&[batch]).await?,
                    Err(RecvError::Lagged(missed)) => {
                        tracing::warn!(missed, "watcher fell behind; resyncing it with a snapshot");
                        Box::pin(self.resync(SnapshotReason::Lagged)).await?;
                    }
                    Err(RecvError::Closed) => return Ok(()),
                },
                _ = progress.tick() => {
                    if self.processed > self.sent {
                        let version = self.version(self.processed);
                        self.send(delta(version, Vec::new(), self.filter.id)).await?;
                    }
                }
            }
        }
    }

    fn version(&self, seq: u64) -> Version {
        Version {
            instance: self.instance.clone(),
            seq,
        }
    }

    async fn send(&mut self, event: watch_response::Event) -> Result<(), Gone> {
        let seq = match &event {
            watch_response::Event::Delta(d) => d.version.as_ref().map(|v| v.seq),
            watch_response::Event::SnapshotComplete(c) => c.version.as_ref().map(|v| v.seq),
            watch_response::Event::Snapshot(_) => None,
        };
        if let Some(turn) = &mut self.turn {
            turn.room(&self.out).await;
        }
        self.out
            .send(Box::new(Ok(WatchResponse { event: Some(event) })))
            .await
            .map_err(|_| Gone)?;
        if let Some(seq) = seq {
            self.sent = seq;
        }
        Ok(())
    }

    async fn send_batches(&mut self, batches: &[Arc<Batch>]) -> Result<(), Gone> {
        for batch in batches {
            let mut changes = Vec::new();
            for c in batch.changes.iter().filter(|c| self.filter.passes(c)) {
                match &c.event {
                    // A put if the client wants the new version, else its removal.
                    Event::Config(config) => {
                        let wanted = config.new.as_ref().filter(|r| self.filter.wants(r));
                        changes.push(Change {
                            change: Some(config_change(config.kind, c.service.as_str(), wanted)),
                        });
                    }
                    _ => changes.push(c.to_proto()),
                }
            }
            self.processed = batch.seq;
            if !changes.is_empty() {
                let version = self.version(batch.seq);
                self.send(delta(version, changes, self.filter.id)).await?;
            }
        }
        Ok(())
    }

    /// Streams `selection` as a snapshot; a RECONCILED one keeps the client's view but for
    /// `removals`.
    async fn send_snapshot(
        &mut self,
        selection: Selection,
        version: Version,
        reason: SnapshotReason,
        removals: Vec<Change>,
    ) -> Result<(), Gone> {
        let Selection { services, configs } = selection;
        self.catalog
            .metrics()
            .watch_snapshots
            .get_or_create(&[("reason", reason.as_str_name())])
            .inc();
        let mut chunk = Snapshot {
            reset: true,
            reason: reason as i32,
            retain: reason == SnapshotReason::Reconciled,
            removals,
            ..Default::default()
        };
        for (service, endpoints) in services {
            chunk.services.push(service);
            for endpoint in endpoints {
                chunk.endpoints.push(Endpoint::clone(&endpoint));
                if chunk.endpoints.len() >= SNAPSHOT_CHUNK_ENDPOINTS {
                    let next = Snapshot {
                        reason: reason as i32,
                        ..Default::default()
                    };
                    let full = std::mem::replace(&mut chunk, next);
                    self.send(watch_response::Event::Snapshot(full)).await?;
                }
            }
        }
        // Configuration records after the services, so many per chunk as endpoints.
        let mut records = 0;
        for record in configs {
            record.add_to(&mut chunk);
            records += 1;
            if records % SNAPSHOT_CHUNK_ENDPOINTS == 0 {
                let next = Snapshot {
                    reason: reason as i32,
                    ..Default::default()
                };
                let full = std::mem::replace(&mut chunk, next);
                self.send(watch_response::Event::Snapshot(full)).await?;
            }
        }
        let empty = Snapshot {
            reset: chunk.reset,
            reason: chunk.reason,
            ..Default::default()
        };
        if chunk.reset || chunk != empty {
            self.send(watch_response::Event::Snapshot(chunk)).await?;
        }
        self.processed = version.seq;
        self.send(watch_response::Event::SnapshotComplete(SnapshotComplete {
            version: Some(version),
            filter_id: self.filter.id,
        }))
        .await
    }

    async fn resync(&mut self, reason: SnapshotReason) -> Result<(), Gone> {
        self.turn = Some(Turn::take().await);
        let (selection, version) = {
            let state = self.catalog.read();
            self.rx = state.subscribe();
            (collect(&state, &self.filter), state.version())
        };
        let sent = self.send_snapshot(selection, version, reason, Vec::new()).await;
        self.turn = None;
        sent
    }

    /// Replaces the filter. Batches already published are first sent under the old
    /// filter, then one Delta (at the current version) removes the services the new
    /// filter drops and adds those it brings in, with their endpoints.
    async fn change_filter(&mut self, filter: Filter) -> Result<(), Gone> {
        if filter.services_only != self.filter.services_only {
            // Endpoints come or go for services the client already has: a fresh snapshot
            // is simpler and exact.
            self.filter = filter;
            return self.resync(SnapshotReason::FilterChanged).await;
        }
        let (pending, filter_delta) = {
            let state = self.catalog.read();
            let mut pending = Vec::new();
            loop {
                match self.rx.try_recv() {
                    Ok(batch) => pending.push(batch),
                    Err(TryRecvError::Empty | TryRecvError::Closed) => break,
                    Err(TryRecvError::Lagged(_)) => {
                        drop(state);
                        self.filter = filter;
                        return self.resync(SnapshotReason::Lagged).await;
                    }
                }
            }
            // The client's view is now the state at `state.seq()` under the old filter.
            let mut changes = Vec::new();
            for key in self.filter.selected(&state) {
                if !filter.matches(key.as_str()) {
                    changes.push(Change {
                        change: Some(change::Change::ServiceRemoved(key.to_string())),
                    });
                }
            }
            for key in filter.selected(&state) {
                if self.filter.matches(key.as_str()) {
                    continue;
                }
                let entry = state.service(key.as_str()).expect("selected services exist");
                changes.push(Change {
                    change: Some(change::Change::ServiceAdded(entry.service.clone())),
                });
                if filter.services_only {
                    continue;
                }
                changes.extend(entry.endpoints.values().map(|e| Change {
                    change: Some(change::Change::EndpointAdded(Endpoint::clone(e))),
                }));
            }
            changes.extend(self.configs_changed_by(&filter, &state));
            (pending, delta(state.version(), changes, filter.id))
        };
        self.send_batches(&pending).await?;
        self.filter = filter;
        if let watch_response::Event::Delta(d) = &filter_delta {
            self.processed = d.version.as_ref().map_or(self.processed, |v| v.seq);
        }
        self.send(filter_delta).await
    }
}

impl Watcher {
    /// The configuration records the client gains or loses when its filter becomes
    /// `filter`.
    fn configs_changed_by(&self, filter: &Filter, state: &State) -> Vec<Change> {
        let mut changes = Vec::new();
        for record in state.configs().all() {
            let (had, has) = (self.filter.wants(record), filter.wants(record));
            if had != has {
                let change = config_change(record.kind(), &record.key(), Some(record).filter(|_| has));
                changes.push(Change { change: Some(change) });
            }
        }
        changes
    }
}

/// The services a filter selects, with their endpoints, and the configuration records it
/// wants: shared, so reading it under the lock is cheap; wire messages are built after
/// the lock is released.
struct Selection {
    services: Vec<(Service, Vec<Arc<Endpoint>>)>,
    configs: Vec<ConfigRecord>,
}

fn collect(state: &State, filter: &Filter) -> Selection {
    let mut services: Vec<_> = filter
        .selected(state)
        .map(|key| {
            let entry = state.service(key.as_str()).expect("selected services exist");
            let endpoints = if filter.services_only {
                Vec::new()
            } else {
                entry.endpoints.values().cloned().collect()
            };
            (entry.service.clone(), endpoints)
        })
        .collect();
    services.sort_by(|a, b| (&a.0.namespace, &a.0.name).cmp(&(&b.0.namespace, &b.0.name)));
    let configs = state.configs().all().filter(|r| filter.wants(r)).cloned().collect();
    Selection { services, configs }
}

/// Longest key a client's holdings may name (a route key is `<kind>/<namespace>/<name>`).
const MAX_HELD_KEY_BYTES: usize = 512;

/// What takes a reconnecting client's view, as its holdings describe it, to the state:
/// read under the lock (shared data), streamed as a RECONCILED snapshot after it.
struct Reconciled {
    /// Services the client holds that the filter no longer selects or that differ, and
    /// records it holds that it no longer wants.
    removals: Vec<Change>,
    /// What the client lacks or held differently, sent whole.
    missing: Selection,
}

/// Compares `held` with what `filter` selects in `state`.
fn reconcile(state: &State, filter: &Filter, held: &Holdings) -> Reconciled {
    let removed = |key: &str| Change {
        change: Some(change::Change::ServiceRemoved(key.to_owned())),
    };
    let held_services: HashMap<&str, u64> = held.services.iter().map(|h| (h.key.as_str(), h.digest)).collect();
    let mut removals = Vec::new();
    for held in &held.services {
        let selected = filter.matches(&held.key) && state.service(&held.key).is_some();
        if !selected {
            removals.push(removed(&held.key));
        }
    }
    let mut services = Vec::new();
    for key in filter.selected(state) {
        let entry = state.service(key.as_str()).expect("selected services exist");
        match held_services.get(key.as_str()) {
            Some(held) if *held == entry.digest(!filter.services_only) => continue,
            Some(_) => removals.push(removed(key.as_str())),
            None => {}
        }
        let endpoints = if filter.services_only {
            Vec::new()
        } else {
            entry.endpoints.values().cloned().collect()
        };
        services.push((entry.service.clone(), endpoints));
    }
    let mut configs = Vec::new();
    for kind in ConfigKind::ALL {
        let records = state.configs().of(kind);
        // A record held in another version is replaced by its put.
        for held in kind.held(held) {
            if !records.get(&held.key).is_some_and(|r| filter.wants(r)) {
                removals.push(Change {
                    change: Some(kind.removed(&held.key)),
                });
            }
        }
        let held: HashMap<&str, u64> = kind.held(held).iter().map(|h| (h.key.as_str(), h.digest)).collect();
        let differs = |(key, record): &(&String, &ConfigRecord)| held.get(key.as_str()) != Some(&record.digest());
        let wanted = records.iter().filter(|(_, r)| filter.wants(r));
        configs.extend(wanted.filter(differs).map(|(_, r)| r.clone()));
    }
    Reconciled {
        removals,
        missing: Selection { services, configs },
    }
}

/// Checks a client's holdings: how many it lists and that every key is short; what it
/// names need not exist (it is removed from the client's view).
fn check_holdings(held: Option<&Holdings>) -> Result<(), InvalidField> {
    let Some(held) = held else { return Ok(()) };
    let lists = [
        ("held.services", &held.services),
        ("held.routes", &held.routes),
        ("held.policies", &held.policies),
        ("held.http_filters", &held.http_filters),
        ("held.mesh_configs", &held.mesh_configs),
    ];
    for (field, list) in lists {
        if list.len() > MAX_FILTER_SERVICES {
            let reason = format!("{} entries (at most {MAX_FILTER_SERVICES})", list.len());
            return Err(InvalidField::new(field, reason));
        }
        if let Some((i, held)) = list.iter().enumerate().find(|(_, h)| h.key.len() > MAX_HELD_KEY_BYTES) {
            let reason = format!(
                "{}: longer than {MAX_HELD_KEY_BYTES} bytes",
                aether_common::quote::quote(&held.key)
            );
            return Err(InvalidField::new(format!("{field}[{i}].key"), reason));
        }
    }
    Ok(())
}

fn delta(version: Version, changes: Vec<Change>, filter_id: u64) -> watch_response::Event {
    watch_response::Event::Delta(Delta {
        version: Some(version),
        changes,
        filter_id,
    })
}

/// Ends a stream whose request is invalid, naming the field.
async fn refuse(catalog: &Catalog, out: &mpsc::Sender<Outgoing>, e: InvalidField) {
    let metrics = catalog.metrics();
    metrics.invalid_requests.get_or_create(&[("method", "Watch")]).inc();
    let _ = out.send(Box::new(Err(e.into()))).await;
}

fn shutting_down() -> Status {
    Status::unavailable("the registrar is shutting down; reconnect to another replica and resume")
}

/// Runs `f` when dropped.
fn scopeguard(f: impl FnOnce()) -> impl Drop {
    struct Guard<F: FnOnce()>(Option<F>);
    impl<F: FnOnce()> Drop for Guard<F> {
        fn drop(&mut self) {
            if let Some(f) = self.0.take() {
                f();
            }
        }
    }
    Guard(Some(f))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::MAX_ERROR_BYTES;

    #[test]
    fn a_huge_service_in_a_filter_is_refused_with_a_short_message() {
        let huge = "a".repeat(1 << 20);
        let request = WatchRequest {
            services: vec!["ns/a".into(), huge.clone(), "ns/b".into()],
            ..Default::default()
        };
        let status = Status::from(Filter::parse(&request).unwrap_err());
        assert_eq!(status.code(), tonic::Code::InvalidArgument);
        assert_eq!(
            status.message(),
            format!(
                "services[1]: {:?}… (1048576 bytes): expected \"<namespace>/<name>\"",
                &huge[..64]
            )
        );
    }

    fn http_filter(services: &[&str]) -> ConfigRecord {
        let filter = aether_proto::registry::v1::HttpFilter {
            namespace: "shop".into(),
            name: "check".into(),
            services: services.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        };
        ConfigRecord::from(Arc::new(filter))
    }

    fn watching(services: &[&str], policy_namespaces: &[&str]) -> Filter {
        let strings = |list: &[&str]| list.iter().map(|s| s.to_string()).collect();
        let request = WatchRequest {
            services: strings(services),
            policy_namespaces: strings(policy_namespaces),
            ..Default::default()
        };
        Filter::parse(&request).unwrap()
    }

    #[test]
    fn an_http_filter_reaches_the_watchers_of_its_namespace_or_of_a_service_it_names() {
        let filter = http_filter(&["shop/orders"]);
        assert!(watching(&["pay/ledger"], &["shop"]).wants(&filter), "destination side");
        assert!(watching(&["shop/orders"], &[]).wants(&filter), "callers' side");
        assert!(!watching(&["shop/cart"], &["pay"]).wants(&filter), "neither");
        let everything = Filter::parse(&WatchRequest {
            wildcard: true,
            ..Default::default()
        });
        assert!(everything.unwrap().wants(&filter));
        let dns = Filter::parse(&WatchRequest {
            services_only: true,
            policy_namespaces: vec!["shop".into()],
            ..Default::default()
        });
        assert!(!dns.unwrap().wants(&filter), "services-only watchers get no filters");
    }

    #[test]
    fn a_filter_moving_to_another_service_leaves_its_old_callers_and_reaches_the_new() {
        let (old, new) = (http_filter(&["shop/orders"]), http_filter(&["shop/cart"]));
        let change = KeyedChange {
            service: ServiceKey::of_config("shop/check"),
            event: Event::Config(crate::catalog::ConfigChange {
                kind: crate::records::ConfigKind::HttpFilter,
                old: Some(old),
                new: Some(new.clone()),
            }),
        };
        let (was, now, other) = (
            watching(&["shop/orders"], &[]),
            watching(&["shop/cart"], &[]),
            watching(&["pay/ledger"], &[]),
        );
        assert!(was.passes(&change) && !was.wants(&new), "sent as a removal");
        assert!(now.passes(&change) && now.wants(&new), "sent as a put");
        assert!(!other.passes(&change), "not sent");
    }

    proptest::proptest! {
        #![proptest_config(proptest::test_runner::Config::with_cases(100))]

        #[test]
        fn no_filter_error_exceeds_the_bound(
            services in proptest::collection::vec("(?s).{0,80}", 0..4),
            at in 0..4usize,
            c in proptest::prelude::any::<char>(),
            len in 0..(1usize << 20),
        ) {
            let mut services = services;
            let at = at.min(services.len());
            services.insert(at, std::iter::repeat_n(c, len).collect());
            let request = WatchRequest { services, ..Default::default() };
            if let Err(e) = Filter::parse(&request) {
                let status = Status::from(e);
                proptest::prop_assert!(status.message().len() <= MAX_ERROR_BYTES, "{}", status.message());
            }
        }
    }
}
