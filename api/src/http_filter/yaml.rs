//! HTTPFilter objects from YAML, as a config directory holds them: many documents per
//! file, other kinds skipped, each document's error on its own (see [`crate::yaml`]).

use aether_common::quote::quote;
use serde_json::Value;

use super::object::{GROUP, HttpFilter, KIND, VERSION};
use crate::yaml::{ParseError, read_documents, typed};

/// Parses every document of `text`: a filter, or why not, for each HTTPFilter of
/// [`GROUP`]; nothing for other documents (Envoy Gateway's `gateway.envoyproxy.io`
/// filters included: their shape differs, so they are not read as ours).
pub fn parse_documents(text: &str) -> Vec<Result<HttpFilter, ParseError>> {
    read_documents(text, filter)
}

fn filter(value: Value) -> Option<Result<HttpFilter, (String, String)>> {
    let Value::Object(fields) = &value else {
        let message = "is not a Kubernetes object (a mapping with apiVersion and kind)";
        return Some(Err((String::new(), message.to_owned())));
    };
    let text = |name: &str| fields.get(name).and_then(Value::as_str).unwrap_or_default().to_owned();
    let (api_version, kind) = (text("apiVersion"), text("kind"));
    let (group, version) = api_version.split_once('/').unwrap_or(("", &api_version));
    if group != GROUP || kind != KIND {
        return None;
    }
    if version != VERSION {
        let message = format!("{} is not served: use {GROUP}/{VERSION}", quote(&api_version));
        return Some(Err(("apiVersion".to_owned(), message)));
    }
    Some(typed(value))
}
