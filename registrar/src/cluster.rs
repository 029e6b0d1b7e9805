//! The registrar's one connection to the Kubernetes API, when `--store kubernetes` or
//! `--from-kubernetes` asks for it: one client, one watch of the Gateway API routes
//! (`crate::routes::kubernetes`), one of the AuthorizationPolicies and one of the
//! HTTPFilters (`crate::sources::crd`), and one of the core/v1 Services ([`services`]), shared by
//! the Kubernetes store and the sources that feed a writable store. Each watch publishes
//! the whole current set of its objects after each burst of changes, through [`Sets`].

pub mod services;

use std::sync::Arc;
use std::time::Duration;

use kube::Client;
use tokio::sync::{mpsc, watch};

use self::services::ClusterServices;
use crate::config::{Config, StoreKind};
use crate::external_services::{ClusterExternalServices, ExternalServices};
use crate::http_filters::{ClusterHttpFilters, HttpFilters};
use crate::mesh_configs::{ClusterMeshConfigs, MeshConfigs};
use crate::policies::{ClusterPolicies, Policies};
use crate::routes::kubernetes::ClusterRoutes;
use crate::store::StoreError;

/// The Kubernetes API and the registrar's watches of it.
#[derive(Clone)]
pub struct ClusterAccess {
    pub client: Client,
    pub routes: ClusterRoutes,
    pub policies: ClusterPolicies,
    pub http_filters: ClusterHttpFilters,
    pub mesh_configs: ClusterMeshConfigs,
    pub external_services: ClusterExternalServices,
    pub services: ClusterServices,
}

/// A handle on one of the registrar's watches, which publishes the whole current set of
/// its objects; the watch runs while any handle lives.
pub struct Sets<S> {
    sets: watch::Receiver<Option<Arc<S>>>,
}

impl<S> Clone for Sets<S> {
    /// A clone starts with the current set unseen, so its first `next` returns it.
    fn clone(&self) -> Self {
        let mut sets = self.sets.clone();
        sets.mark_changed();
        Sets { sets }
    }
}

impl<S> Sets<S> {
    /// A handle on what the watch publishes through `sets` (`None` until it has a set).
    pub fn new(sets: watch::Receiver<Option<Arc<S>>>) -> Self {
        Sets { sets }
    }

    /// The current set if this handle has not seen it, else the next one. The first
    /// comes once the objects were listed (or found not installed). `None`: the watch
    /// is gone.
    pub async fn next(&mut self) -> Option<Arc<S>> {
        loop {
            self.sets.changed().await.ok()?;
            if let Some(set) = self.sets.borrow_and_update().clone() {
                return Some(set);
            }
        }
    }
}

/// What a watch makes of its inputs: the set it publishes.
pub trait Collect {
    type Input;
    type Set: Clone;
    /// Applies one input; true if the set (or what is known of it) changed.
    fn apply(&mut self, input: Self::Input) -> bool;
    /// The set, once it is known (every kind listed, or found not installed).
    fn known(&self) -> Option<&Self::Set>;
}

/// Publishes what `collected` makes of `inputs` until no handle is left: the inputs of a
/// burst (those within `window` of the first) are applied together, and the set is
/// published once after them if they changed it.
pub async fn publish<C: Collect>(
    mut collected: C,
    mut inputs: mpsc::Receiver<C::Input>,
    window: Duration,
    tx: watch::Sender<Option<Arc<C::Set>>>,
) {
    loop {
        let first = tokio::select! {
            input = inputs.recv() => input,
            () = tx.closed() => None,
        };
        let Some(first) = first else { return };
        let deadline = tokio::time::Instant::now() + window;
        let mut changed = collected.apply(first);
        while let Ok(Some(input)) = tokio::time::timeout_at(deadline, inputs.recv()).await {
            changed |= collected.apply(input);
        }
        if let Some(set) = collected.known().filter(|_| changed) {
            tx.send_replace(Some(Arc::new(set.clone())));
        }
    }
}

/// Connects to the cluster if `--store kubernetes` or `--from-kubernetes` asks to, and
/// starts the watches.
pub async fn connect(config: &Config) -> Result<Option<ClusterAccess>, StoreError> {
    let why = match (config.store, config.from_kubernetes) {
        (StoreKind::Kubernetes, _) => "--store kubernetes",
        (_, true) => "--from-kubernetes",
        _ => return Ok(None),
    };
    let client = Client::try_default().await.map_err(|e| {
        StoreError::Config(format!(
            "{why}: cannot build a Kubernetes client (tried KUBECONFIG, ~/.kube/config and the in-cluster \
             service account): {e}"
        ))
    })?;
    Ok(Some(ClusterAccess {
        routes: ClusterRoutes::start(client.clone()),
        policies: crate::sources::crd::start::<Policies>(client.clone()),
        http_filters: crate::sources::crd::start::<HttpFilters>(client.clone()),
        mesh_configs: crate::sources::crd::start::<MeshConfigs>(client.clone()),
        external_services: crate::sources::crd::start::<ExternalServices>(client.clone()),
        services: ClusterServices::start(client.clone()),
        client,
    }))
}
