//! The API server's side of HTTP: what a path names, query strings, JSON and `Status`
//! bodies, and watch responses (one JSON event per line, for as long as the watch lasts).

use std::collections::HashMap;

use bytes::Bytes;
use futures::{Stream, StreamExt};
use http_body_util::{BodyExt, Full, StreamBody, combinators::UnsyncBoxBody};
use hyper::body::Frame;
use hyper::{Response, StatusCode};
use serde_json::{Value, json};

use super::cluster::{Kind, Subresource};

pub(super) type Body = UnsyncBoxBody<Bytes, std::io::Error>;

pub(super) fn json(code: StatusCode, body: Value) -> Response<Body> {
    Response::builder()
        .status(code)
        .header("content-type", "application/json")
        .body(
            Full::new(Bytes::from(body.to_string()))
                .map_err(|e| match e {})
                .boxed_unsync(),
        )
        .expect("a valid response")
}

/// A `Status` object, as the API server answers a refusal (and reports a watch error).
pub(super) fn status_object(code: StatusCode, reason: &str, message: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Failure",
           "message": message, "reason": reason, "code": code.as_u16()})
}

pub(super) fn status(code: StatusCode, reason: &str, message: &str) -> Response<Body> {
    json(code, status_object(code, reason, message))
}

/// A watch response: each event one line; an `Err` aborts the connection mid-stream.
pub(super) fn watch(events: impl Stream<Item = Result<Value, std::io::Error>> + Send + 'static) -> Response<Body> {
    let frames = events.map(|event| event.map(|event| Frame::data(Bytes::from(format!("{event}\n")))));
    Response::builder()
        .header("content-type", "application/json")
        .body(StreamBody::new(frames).boxed_unsync())
        .expect("a valid response")
}

/// A list of `kind` at `resource_version`; items carry no apiVersion or kind, as from a real server.
pub(super) fn list(kind: Kind, resource_version: &str, items: impl IntoIterator<Item = Value>) -> Value {
    let items: Vec<Value> = items
        .into_iter()
        .map(|mut item| {
            if let Some(object) = item.as_object_mut() {
                object.remove("apiVersion");
                object.remove("kind");
            }
            item
        })
        .collect();
    json!({"apiVersion": kind.api_version, "kind": format!("{}List", kind.kind),
           "metadata": {"resourceVersion": resource_version}, "items": items})
}

/// What a request path names: a served kind's collection (in one namespace or all), one
/// object of it, or an object's status subresource.
#[derive(Clone, Debug)]
pub(super) struct Target {
    pub kind: Kind,
    pub namespace: Option<String>,
    pub name: Option<String>,
    pub subresource: Subresource,
}

impl Target {
    /// `/api/v1/[namespaces/<ns>/]<plural>[/<name>[/status]]` or the same under
    /// `/apis/<group>/<version>`.
    pub fn parse(path: &str) -> Option<Target> {
        let segments: Vec<&str> = path.trim_start_matches('/').split('/').collect();
        let (api_version, rest) = match segments.as_slice() {
            ["api", version, rest @ ..] => ((*version).to_owned(), rest),
            ["apis", group, version, rest @ ..] => (format!("{group}/{version}"), rest),
            _ => return None,
        };
        let (namespace, plural, name) = match rest {
            ["namespaces", ns, plural, name @ ..] => (Some((*ns).to_owned()), *plural, name),
            [plural, name @ ..] => (None, *plural, name),
            [] => return None,
        };
        let kind = Kind::served(&api_version, plural)?;
        let (name, subresource) = match name {
            [] => (None, Subresource::None),
            [name] => (Some((*name).to_owned()), Subresource::None),
            [name, "status"] if kind.status => (Some((*name).to_owned()), Subresource::Status),
            _ => return None,
        };
        Some(Target {
            kind,
            namespace,
            name,
            subresource,
        })
    }
}

/// A query string's pairs, percent-decoded.
pub(super) fn query(query: Option<&str>) -> HashMap<String, String> {
    query
        .unwrap_or_default()
        .split('&')
        .filter(|pair| !pair.is_empty())
        .map(|pair| {
            let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
            (percent_decode(key), percent_decode(value))
        })
        .collect()
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes
            .get(i + 1..i + 3)
            .and_then(|h| u8::from_str_radix(std::str::from_utf8(h).ok()?, 16).ok());
        match (bytes[i], hex) {
            (b'%', Some(byte)) => {
                out.push(byte);
                i += 3;
            }
            (b'+', _) => {
                out.push(b' ');
                i += 1;
            }
            (byte, _) => {
                out.push(byte);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}
