//! The status of our CRDs' objects on Kubernetes: each gets one condition, `Accepted`,
//! at the generation it was projected from: `True` (reason `Accepted`), or `False`
//! (reason `Invalid`) with the refusal naming the field. A refused edit of an accepted
//! object says so while its last accepted version stays in force.
//!
//! Written through the status subresource, once per object generation and outcome (this
//! process remembers what it wrote; a restart writes each once more). Failures are
//! logged and retried every [`RETRY`].

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Patch, PatchParams};
use kube::{Api, Client, Resource};
use serde_json::json;
use tokio_util::sync::CancellationToken;

use super::ObjectKind;
use super::crd::{CrdObject, CrdSet};
use crate::cluster::Sets;

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

/// The condition `object` should carry.
pub fn accepted<K>(kind: &K, object: &K::Object) -> Accepted
where
    K: ObjectKind,
    K::Object: CrdObject,
{
    Accepted {
        generation: object.meta().generation.unwrap_or(0),
        refusal: kind.project(object).err(),
    }
}

/// Keeps the `Accepted` condition of the cluster's objects of `K` current until
/// `shutdown`.
pub async fn run<K>(mut sets: Sets<CrdSet<K::Object>>, kind: K, client: Client, shutdown: CancellationToken)
where
    K: ObjectKind,
    K::Object: CrdObject,
{
    // What was written, by key and uid (a re-created object is written again).
    let mut written: HashMap<(String, Option<String>), Accepted> = HashMap::new();
    let mut current: Option<Arc<CrdSet<K::Object>>> = None;
    loop {
        if let Some(set) = &current {
            written.retain(|(key, _), _| set.objects.contains_key(key));
            for (key, object) in &set.objects {
                let id = (key.clone(), object.meta().uid.clone());
                let desired = accepted(&kind, object);
                if written.get(&id) != Some(&desired) && write(&client, object, &desired).await {
                    written.insert(id, desired);
                }
            }
        }
        tokio::select! {
            () = shutdown.cancelled() => return,
            next = sets.next() => match next {
                Some(set) => current = Some(set),
                None => return,
            },
            () = tokio::time::sleep(RETRY) => {}
        }
    }
}

/// Writes `accepted` into `object`'s status; false (logged) if that failed.
async fn write<O: CrdObject>(client: &Client, object: &O, accepted: &Accepted) -> bool {
    let (namespace, name) = (object.meta().namespace.as_deref(), object.meta().name.as_deref());
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
    let api = Api::<O>::namespaced(client.clone(), namespace);
    let params = PatchParams {
        field_manager: Some(FIELD_MANAGER.to_owned()),
        ..PatchParams::default()
    };
    match api.patch_status(name, &params, &Patch::Merge(&patch)).await {
        Ok(_) => true,
        Err(error) => {
            let kind = O::kind(&());
            tracing::warn!(%kind, object = %format!("{namespace}/{name}"), %error,
                "writing a {kind} status failed; retrying");
            false
        }
    }
}
