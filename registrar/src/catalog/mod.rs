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
//!
//! The module's rooms: `state` holds the catalog in memory, `load` reads it from
//! the store at startup, `plan` computes a group's effect (and the own-node rule),
//! `writer` runs the writer task and commits, `write_behind` queues writes while
//! the store is down, `feed` takes in other replicas' changes (with `revisions`
//! telling new from stale), `health` tracks whether the store is reachable, and
//! `ttl` reaps empty services and expires dead nodes' endpoints.

mod feed;
mod health;
mod load;
mod plan;
mod revisions;
mod state;
mod ttl;
mod write_behind;
mod writer;

use parking_lot::{RwLock, RwLockReadGuard};
use std::collections::{BTreeMap, HashSet};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use aether_proto::registrar::v1::Version;
use aether_proto::registry::v1::{External, KubernetesService, Service};
use tokio::sync::{mpsc, oneshot};
use tonic::Status;

use self::load::Loaded;
pub use self::state::{Batch, ConfigChange, Entry, Event, KeyedChange, State};
use self::writer::Write;
pub use self::writer::{ExternalsApplied, Writer};
use crate::metrics::Metrics;
use crate::model::{ServiceKey, ValidEndpoint};
use crate::records::{ConfigRecord, Record};
use crate::store::{Store, StoreError};
use crate::vip::VipAllocator;

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
    ignored: Arc<parking_lot::Mutex<HashSet<(ServiceKey, IpAddr)>>>,
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
        let feed_revision = contents.revision;
        let loaded = Loaded::from_contents(contents, &config.vips);
        loaded.report(&metrics);
        let state = Arc::new(RwLock::new(State::new(
            loaded.services,
            loaded.vips,
            loaded.endpoint_count,
            loaded.configs,
            config.history_changes,
            config.watch_buffer,
        )));
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
        let writer = Writer::new(state, rx, store, config, metrics, loaded.revs, feed_revision);
        Ok((catalog, writer))
    }

    pub fn read(&self) -> RwLockReadGuard<'_, State> {
        self.state.read()
    }

    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// Adds or replaces `endpoint`. With an `owner` (the caller's authenticated node),
    /// an endpoint another node holds is not replaced: PERMISSION_DENIED.
    pub async fn register(&self, endpoint: ValidEndpoint, owner: Option<String>) -> Result<(Service, Version), Status> {
        if self.read_only {
            let first = (self.ignored.lock()).insert((endpoint.service.clone(), endpoint.address));
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
                kubernetes: None,
                external: None,
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
            (self.ignored.lock()).remove(&(service.clone(), address));
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

    /// Makes the catalog's records of `T`'s kind (routes, policies) exactly `desired`
    /// (by key), as one versioned batch; what is unchanged is not written.
    pub async fn set_records<T: Record>(&self, desired: BTreeMap<String, T>) -> Result<Version, Status> {
        let kind = T::KIND;
        if self.read_only {
            return Err(Status::failed_precondition(format!(
                "this registrar's store is read-only: its {} come from the store itself",
                kind.plural()
            )));
        }
        let desired: BTreeMap<String, ConfigRecord> = (desired.into_iter())
            .map(|(key, record)| (key, ConfigRecord::from(Arc::new(record))))
            .collect();
        let (reply, response) = oneshot::channel();
        self.submit(Write::Configs { kind, desired, reply }).await?;
        response.await.map_err(|_| shutting_down())?
    }

    /// Gives each service the attributes of the Kubernetes Service of the same key in
    /// `desired` (the cluster's whole set; a service without one gets none), as one
    /// versioned batch of the services that differ. Services created later start with
    /// the latest `desired`. Identical calls write nothing, so every replica may make them.
    pub async fn set_service_attributes(
        &self,
        desired: BTreeMap<ServiceKey, KubernetesService>,
    ) -> Result<Version, Status> {
        if self.read_only {
            return Err(Status::failed_precondition(
                "this registrar's store is read-only: its services come from the store itself",
            ));
        }
        let (reply, response) = oneshot::channel();
        self.submit(Write::ServiceAttributes { desired, reply }).await?;
        response.await.map_err(|_| shutting_down())?
    }

    /// Makes the catalog's external services exactly `desired` (the sources' whole set of
    /// ExternalService declarations, projected), as one versioned batch: each is a service
    /// with a VIP and no endpoints, kept while it is declared. A key a mesh service holds
    /// is refused (in the answer), never taken over.
    pub async fn set_external_services(
        &self,
        desired: BTreeMap<ServiceKey, External>,
    ) -> Result<ExternalsApplied, Status> {
        if self.read_only {
            return Err(Status::failed_precondition(
                "this registrar's store is read-only: its external services come from the store itself",
            ));
        }
        let (reply, response) = oneshot::channel();
        self.submit(Write::ExternalServices { desired, reply }).await?;
        response.await.map_err(|_| shutting_down())?
    }

    async fn submit(&self, write: Write) -> Result<(), Status> {
        self.writes.send(write).await.map_err(|_| shutting_down())
    }
}

fn shutting_down() -> Status {
    Status::unavailable("the registrar is shutting down; retry against another replica")
}
