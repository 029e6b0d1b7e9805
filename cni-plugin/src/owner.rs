//! Uninstall or rollout? When the installer's container stops, the DaemonSet it runs in tells: gone or being
//! deleted means the mesh is being uninstalled and the plugin must leave the node's CNI config (or no pod could
//! start there any more); still there means a rollout or a restart, and the plugin stays so that no pod starts
//! without capture meanwhile.

use k8s_openapi::api::apps::v1::DaemonSet;
use kube::Api;

use crate::install::Owner;

/// How long the API server gets to answer.
const ANSWER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// What the API server says about the owner DaemonSet.
#[derive(Debug, PartialEq, Eq)]
pub enum OwnerState {
    /// Present and not being deleted.
    Present,
    /// Not found, or carrying a deletion timestamp.
    Going,
}

/// Asks the API server (in-cluster credentials, or `KUBECONFIG`).
///
/// 401 and 403 count as going too: `helm uninstall` deletes the DaemonSet and then, within milliseconds, the
/// RoleBinding, Role and ServiceAccount this check runs with, while the pod's containers are still stopping. In a
/// rollout all of them stay. Any other failure (API server unreachable) is an error: the caller keeps the plugin.
pub async fn owner_state(owner: &Owner) -> Result<OwnerState, kube::Error> {
    let client = kube::Client::try_default().await?;
    let api: Api<DaemonSet> = Api::namespaced(client, &owner.namespace);
    // Well within a pod's termination grace period.
    let answer = tokio::time::timeout(ANSWER_TIMEOUT, api.get_opt(&owner.name))
        .await
        .map_err(|_| kube::Error::Service(format!("no answer within {ANSWER_TIMEOUT:?}").into()))?;
    match answer {
        Ok(Some(ds)) if ds.metadata.deletion_timestamp.is_none() => Ok(OwnerState::Present),
        Ok(_) => Ok(OwnerState::Going),
        Err(kube::Error::Api(status)) if status.code == 401 || status.code == 403 => Ok(OwnerState::Going),
        Err(error) => Err(error),
    }
}
