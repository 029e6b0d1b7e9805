//! The registrar's one connection to the Kubernetes API, when `--store kubernetes` or
//! `--from-kubernetes` asks for it: one client, one watch of the Gateway API routes
//! (`crate::routes::kubernetes`), one of the AuthorizationPolicies
//! (`crate::policies::kubernetes`) and one of the core/v1 Services ([`services`]),
//! shared by the Kubernetes store and the sources that feed a writable store.

pub mod services;

use kube::Client;

use self::services::ClusterServices;
use crate::config::{Config, StoreKind};
use crate::policies::kubernetes::ClusterPolicies;
use crate::routes::kubernetes::ClusterRoutes;
use crate::store::StoreError;

/// The Kubernetes API and the registrar's watches of it.
#[derive(Clone)]
pub struct ClusterAccess {
    pub client: Client,
    pub routes: ClusterRoutes,
    pub policies: ClusterPolicies,
    pub services: ClusterServices,
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
        policies: ClusterPolicies::start(client.clone()),
        services: ClusterServices::start(client.clone()),
        client,
    }))
}
