//! Route objects from YAML, as a route directory holds them: many documents per file,
//! documents of other kinds (Services, Deployments, …) skipped, each document's error
//! on its own so one bad object does not hide the others.

use std::fmt;

use aether_common::quote::{clip, quote};
use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::gateway::{EXPERIMENTAL_VERSION, GROUP, VERSION};
use crate::route::RouteObject;

/// Why one document is not a route object.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParseError {
    /// 1-based position among the text's non-empty documents.
    pub document: usize,
    /// The field at fault (e.g. `spec.rules[0].backendRefs[0].port`); empty for the
    /// document as a whole (YAML syntax).
    pub field: String,
    pub message: String,
}

impl fmt::Display for ParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "document {}: ", self.document)?;
        if !self.field.is_empty() {
            write!(f, "{}: ", self.field)?;
        }
        f.write_str(&self.message)
    }
}

impl std::error::Error for ParseError {}

/// One document of a YAML text: its value, or why the text stops being YAML there (the
/// parser cannot find the next document reliably, so that is the last one).
pub type Document = Result<Value, ParseError>;

/// Parses `text` into its documents, once: every kind then picks its own objects out of
/// them (a config directory holds routes, policies, filters and MeshConfigs side by side).
pub fn documents(text: &str) -> Vec<Document> {
    let mut input = text.as_bytes();
    (serde_saphyr::read::<_, Value>(&mut input).enumerate())
        .map(|(i, document)| {
            document.map_err(|e| ParseError {
                document: i + 1,
                field: String::new(),
                message: format!("not YAML: {}", clip(&e.to_string())),
            })
        })
        .collect()
}

/// Every document `take` recognizes (`None`: another kind, skipped), or why not, with
/// errors numbered by document; a YAML syntax error is every kind's.
pub(crate) fn pick<T>(
    documents: &[Document],
    take: impl Fn(&Value) -> Option<Result<T, (String, String)>>,
) -> Vec<Result<T, ParseError>> {
    (documents.iter().enumerate())
        .filter_map(|(i, document)| match document {
            Ok(value) => take(value).map(|r| {
                r.map_err(|(field, message)| ParseError {
                    document: i + 1,
                    field,
                    message,
                })
            }),
            Err(e) => Some(Err(e.clone())),
        })
        .collect()
}

/// Every HTTPRoute, GRPCRoute, TCPRoute and TLSRoute among `documents`: a route object, or why not.
pub fn route_objects(documents: &[Document]) -> Vec<Result<RouteObject, ParseError>> {
    pick(documents, route_object)
}

/// [`route_objects`] of `text`'s documents.
pub fn parse_documents(text: &str) -> Vec<Result<RouteObject, ParseError>> {
    route_objects(&documents(text))
}

/// `None` for another kind of object; the field and message of an error otherwise.
fn route_object(value: &Value) -> Option<Result<RouteObject, (String, String)>> {
    let Value::Object(fields) = value else {
        return Some(Err((
            String::new(),
            "is not a Kubernetes object (a mapping with apiVersion and kind)".to_owned(),
        )));
    };
    let text = |name: &str| fields.get(name).and_then(Value::as_str).unwrap_or_default().to_owned();
    let (api_version, kind) = (text("apiVersion"), text("kind"));
    let (group, version) = api_version.split_once('/').unwrap_or(("", &api_version));
    let served = match kind.as_str() {
        "HTTPRoute" | "GRPCRoute" => VERSION,
        "TCPRoute" | "TLSRoute" => EXPERIMENTAL_VERSION,
        _ => return None,
    };
    if group != GROUP {
        return None;
    }
    if version != served {
        let message = format!("{} is not served: use {GROUP}/{served}", quote(&api_version));
        return Some(Err(("apiVersion".to_owned(), message)));
    }
    Some(match kind.as_str() {
        "HTTPRoute" => typed(value).map(RouteObject::Http),
        "GRPCRoute" => typed(value).map(RouteObject::Grpc),
        "TCPRoute" => typed(value).map(RouteObject::Tcp),
        _ => typed(value).map(RouteObject::Tls),
    })
}

/// An object of one of the kinds the mesh projects.
#[derive(Clone, Debug)]
pub enum MeshObject {
    Route(Box<RouteObject>),
    Policy(Box<crate::authorization::AuthorizationPolicy>),
    Filter(Box<crate::http_filter::HttpFilter>),
    MeshConfig(Box<crate::mesh_config::MeshConfig>),
    ExternalService(Box<crate::external_service::ExternalService>),
}

/// An object as the API server sends it (JSON, e.g. in an AdmissionReview) as one of the
/// mesh's kinds: `None` for another kind, else the typed object or the field at fault —
/// the same reading a route, policy or filter file gets.
pub fn mesh_object(value: &Value) -> Option<Result<MeshObject, (String, String)>> {
    use crate::{authorization as policy, external_service as external, http_filter as filter, mesh_config as mesh};
    let kind = value.get("kind").and_then(Value::as_str).unwrap_or_default().to_owned();
    match kind.as_str() {
        "HTTPRoute" | "GRPCRoute" | "TCPRoute" | "TLSRoute" => {
            route_object(value).map(|r| r.map(|o| MeshObject::Route(Box::new(o))))
        }
        policy::KIND => of_kind(value, (policy::GROUP, policy::VERSION, policy::KIND))
            .map(|r| r.map(|o| MeshObject::Policy(Box::new(o)))),
        filter::KIND => of_kind(value, (filter::GROUP, filter::VERSION, filter::KIND))
            .map(|r| r.map(|o| MeshObject::Filter(Box::new(o)))),
        mesh::KIND => of_kind(value, (mesh::GROUP, mesh::VERSION, mesh::KIND))
            .map(|r| r.map(|o| MeshObject::MeshConfig(Box::new(o)))),
        external::KIND => of_kind(value, (external::GROUP, external::VERSION, external::KIND))
            .map(|r| r.map(|o| MeshObject::ExternalService(Box::new(o)))),
        _ => None,
    }
}

/// A document as one of our kinds: `None` for another group or kind, a refusal naming
/// `apiVersion` for a version we do not serve, else the typed object (or where it fails).
pub(crate) fn of_kind<T: DeserializeOwned>(
    value: &Value,
    (group, version, kind): (&str, &str, &str),
) -> Option<Result<T, (String, String)>> {
    let Value::Object(fields) = value else {
        let message = "is not a Kubernetes object (a mapping with apiVersion and kind)";
        return Some(Err((String::new(), message.to_owned())));
    };
    let text = |name: &str| fields.get(name).and_then(Value::as_str).unwrap_or_default().to_owned();
    let (api_version, found) = (text("apiVersion"), text("kind"));
    let (found_group, found_version) = api_version.split_once('/').unwrap_or(("", &api_version));
    if found_group != group || found != kind {
        return None;
    }
    if found_version != version {
        let message = format!(
            "{} is not served: use {group}/{version}",
            aether_common::quote::quote(&api_version)
        );
        return Some(Err(("apiVersion".to_owned(), message)));
    }
    Some(typed(value))
}

/// The typed object, or the path of the field at fault. Path tracking costs an allocation
/// per key, so it runs only once plain decoding has failed (the same impls decide both).
pub(crate) fn typed<T: DeserializeOwned>(value: &Value) -> Result<T, (String, String)> {
    if let Ok(typed) = T::deserialize(value) {
        return Ok(typed);
    }
    serde_path_to_error::deserialize(value)
        .map_err(|e| (e.path().to_string(), clip(&e.inner().to_string()).to_string()))
}
