//! Policy status on Kubernetes: each AuthorizationPolicy gets one condition, `Accepted`,
//! at the generation it was projected from: `True` (reason `Accepted`), or `False`
//! (reason `Invalid`) with the refusal naming the field. A refused edit of an accepted
//! policy says so while its last accepted version stays enforced.
//!
//! Written through the status subresource, once per object generation and outcome (this
//! process remembers what it wrote; a restart writes each once more). Failures are
//! logged and retried every [`RETRY`].

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use aether_api::authorization::{self as projector, AuthorizationPolicy as PolicyObject, ProjectOptions};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Patch, PatchParams};
use kube::{Api, Client};
use serde_json::json;
use tokio_util::sync::CancellationToken;

use super::{ClusterPolicies, PolicySet};

/// How often failed status writes are tried again.
pub const RETRY: Duration = Duration::from_secs(2);
/// The field manager of the registrar's status writes.
const FIELD_MANAGER: &str = "aether-registrar";

/// What an object's `Accepted` condition says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Accepted {
    pub generation: i64,
    /// `None` when accepted, else the refusal (`field: message`).
    pub refusal: Option<String>,
}

/// The condition `object` should carry under `options`.
pub fn accepted(object: &PolicyObject, options: &ProjectOptions) -> Accepted {
    Accepted {
        generation: object.metadata.generation.unwrap_or(0),
        refusal: projector::project(object, options).err().map(|r| r.to_string()),
    }
}

/// Keeps the `Accepted` condition of the cluster's policies current until `shutdown`.
pub async fn run(mut policies: ClusterPolicies, options: ProjectOptions, client: Client, shutdown: CancellationToken) {
    // What was written, by key and uid (a re-created object is written again).
    let mut written: HashMap<(String, Option<String>), Accepted> = HashMap::new();
    let mut current: Option<Arc<PolicySet>> = None;
    loop {
        if let Some(set) = &current {
            written.retain(|(key, _), _| set.objects.contains_key(key));
            for (key, object) in &set.objects {
                let id = (key.clone(), object.metadata.uid.clone());
                let desired = accepted(object, &options);
                if written.get(&id) != Some(&desired) && write(&client, object, &desired).await {
                    written.insert(id, desired);
                }
            }
        }
        tokio::select! {
            () = shutdown.cancelled() => return,
            next = policies.next() => match next {
                Some(set) => current = Some(set),
                None => return,
            },
            () = tokio::time::sleep(RETRY) => {}
        }
    }
}

/// Writes `accepted` into `object`'s status; false (logged) if that failed.
async fn write(client: &Client, object: &PolicyObject, accepted: &Accepted) -> bool {
    let (namespace, name) = (object.metadata.namespace.as_deref(), object.metadata.name.as_deref());
    let (Some(namespace), Some(name)) = (namespace, name) else {
        return true;
    };
    let (status, reason, message) = match &accepted.refusal {
        None => ("True", "Accepted", "accepted: enforced as written".to_owned()),
        Some(refusal) => (
            "False",
            "Invalid",
            format!("{refusal}; the last accepted version (if any) stays enforced"),
        ),
    };
    let condition = json!({
        "type": "Accepted", "status": status, "reason": reason, "message": message,
        "observedGeneration": accepted.generation, "lastTransitionTime": Time(Timestamp::now()),
    });
    let patch = json!({"status": {"observedGeneration": accepted.generation, "conditions": [condition]}});
    let api = Api::<PolicyObject>::namespaced(client.clone(), namespace);
    let params = PatchParams {
        field_manager: Some(FIELD_MANAGER.to_owned()),
        ..PatchParams::default()
    };
    match api.patch_status(name, &params, &Patch::Merge(&patch)).await {
        Ok(_) => true,
        Err(error) => {
            tracing::warn!(policy = %format!("{namespace}/{name}"), %error, "writing an AuthorizationPolicy status failed; retrying");
            false
        }
    }
}
