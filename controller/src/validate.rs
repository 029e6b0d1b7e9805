//! The validating webhook: every mesh object is judged by the function that projects it
//! at run time, so an object the API server accepts is one the registrar and the agents
//! take, and an object refused here names the field and the rule exactly as the
//! registrar's status and the agent's log would:
//!
//! - Pods: their mesh annotations (`aether_api::pod::config_errors`, what the agent reads);
//! - AuthorizationPolicy: `aether_api::authorization::project` (with the mesh root namespace);
//! - HTTPFilter: `aether_api::http_filter::project`;
//! - MeshConfig: `aether_api::mesh_config::project` (with the mesh root namespace);
//! - HTTPRoute, GRPCRoute, TCPRoute and TLSRoute: `aether_api::project` — routes with Service parents (GAMMA);
//!   a route attached only to Gateways is not the mesh's and passes.

use std::collections::BTreeMap;

use aether_api::authorization::ProjectOptions;
use aether_api::{MeshObject, mesh_object};
use serde_json::Value;

use crate::admission::{Operation, Request, Verdict, bounded};

/// What validation needs to know of the mesh.
#[derive(Clone, Debug, Default)]
pub struct Validator {
    pub options: ProjectOptions,
}

impl Validator {
    pub fn decide(&self, request: Request) -> Verdict {
        if !matches!(request.operation, Operation::Create | Operation::Update) {
            return Verdict::Allow;
        }
        let Some(object) = request.object else {
            return Verdict::Deny("object: missing".into());
        };
        let object = with_namespace(object, request.namespace.as_deref());
        match (request.kind.group.as_str(), request.kind.kind.as_str()) {
            ("", "Pod") => pod(&object),
            _ => self.mesh_object(object, &request.kind.kind),
        }
    }

    fn mesh_object(&self, object: Value, kind: &str) -> Verdict {
        // The request's kind, as sent: quoted bounded like any input.
        let kind = bounded(kind);
        let refused = |field: &str, message: &str| Verdict::Deny(refusal(&kind, field, message));
        let object = match mesh_object(&object) {
            None => {
                return Verdict::Deny(format!(
                    "{kind}: not a kind aether-controller validates (check the webhook configuration's rules)"
                ));
            }
            Some(Err((field, message))) => return refused(&field, &message),
            Some(Ok(object)) => object,
        };
        let result = match &object {
            MeshObject::Route(route) => aether_api::project(route).map(drop).map_err(|r| (r.field, r.message)),
            MeshObject::Policy(policy) => aether_api::authorization::project(policy, &self.options)
                .map(drop)
                .map_err(|r| (r.field, r.message)),
            MeshObject::Filter(filter) => aether_api::http_filter::project(filter)
                .map(drop)
                .map_err(|r| (r.field, r.message)),
            MeshObject::MeshConfig(config) => aether_api::mesh_config::project(config, &self.options)
                .map(drop)
                .map_err(|r| (r.field, r.message)),
            MeshObject::ExternalService(external) => aether_api::external_service::project(external)
                .map(drop)
                .map_err(|r| (r.field, r.message)),
        };
        match result {
            Ok(()) => Verdict::Allow,
            Err((field, message)) => refused(&field, &message),
        }
    }
}

/// `<Kind> refused: <field>: <message>`.
fn refusal(kind: &str, field: &str, message: &str) -> String {
    match field.is_empty() {
        true => format!("{kind} refused: {message}"),
        false => format!("{kind} refused: {field}: {message}"),
    }
}

/// The request's namespace on the object, where the object has none yet (a CREATE
/// without `metadata.namespace` is admitted into the request's namespace).
fn with_namespace(mut object: Value, namespace: Option<&str>) -> Value {
    if let (Some(ns), Some(metadata)) = (namespace, object.get_mut("metadata").and_then(Value::as_object_mut))
        && metadata
            .get("namespace")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .is_empty()
    {
        metadata.insert("namespace".into(), Value::String(ns.to_owned()));
    }
    object
}

/// A pod's mesh annotations, as the agent will read them.
fn pod(object: &Value) -> Verdict {
    let metadata = &object["metadata"];
    let namespace = metadata["namespace"].as_str().unwrap_or_default();
    let annotations: BTreeMap<String, String> = metadata["annotations"]
        .as_object()
        .into_iter()
        .flatten()
        .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_owned())))
        .collect();
    let errors = aether_api::pod::config_errors(namespace, &annotations);
    match errors.is_empty() {
        true => Verdict::Allow,
        false => Verdict::Deny(format!("Pod refused: {}", errors.join("; "))),
    }
}
