//! The scripted mode: every request is handed to the test, which checks it and answers
//! it with a list, an object, a `Status`, or a watch it then feeds event by event (or cuts).

use std::collections::HashMap;

use hyper::{Method, Response, StatusCode, Uri};
use serde_json::{Value, json};
use tokio::sync::{mpsc, oneshot};

use super::cluster::Kind;
use super::wire::{self, Body, Target};

/// The requests the server received since [`super::ApiServer::script`], in order.
pub struct Calls(pub(super) mpsc::UnboundedReceiver<Call>);

impl Calls {
    /// The next request; `None` once the server is gone.
    pub async fn next(&mut self) -> Option<Call> {
        self.0.recv().await
    }
}

/// One request, waiting for the test's answer (dropped unanswered: `503`).
pub struct Call {
    method: Method,
    uri: Uri,
    reply: oneshot::Sender<Response<Body>>,
}

/// Hands a request to the test and waits for its answer.
pub(super) async fn hand_over(calls: &mpsc::UnboundedSender<Call>, method: Method, uri: Uri) -> Response<Body> {
    let (reply, replied) = oneshot::channel();
    let unanswered = || {
        wire::status(
            StatusCode::SERVICE_UNAVAILABLE,
            "ServiceUnavailable",
            "the test did not answer",
        )
    };
    if calls.send(Call { method, uri, reply }).is_err() {
        return unanswered();
    }
    replied.await.unwrap_or_else(|_| unanswered())
}

impl Call {
    pub fn method(&self) -> &Method {
        &self.method
    }

    pub fn uri(&self) -> &Uri {
        &self.uri
    }

    pub fn path(&self) -> &str {
        self.uri.path()
    }

    /// The query's pairs, percent-decoded.
    pub fn query(&self) -> HashMap<String, String> {
        wire::query(self.uri.query())
    }

    pub fn is_watch(&self) -> bool {
        self.query().get("watch").map(String::as_str) == Some("true")
    }

    fn kind(&self) -> Kind {
        match Target::parse(self.path()) {
            Some(target) => target.kind,
            None => panic!("{} names no kind the fake serves", self.uri),
        }
    }

    /// Answers with a list of `items` at `resource_version`.
    pub fn list(self, resource_version: &str, items: Vec<Value>) {
        let list = wire::list(self.kind(), resource_version, items);
        self.answer(wire::json(StatusCode::OK, list));
    }

    pub fn object(self, object: Value) {
        self.answer(wire::json(StatusCode::OK, object));
    }

    /// Answers with a `Status` refusal.
    pub fn status(self, code: StatusCode, reason: &str, message: &str) {
        self.answer(wire::status(code, reason, message));
    }

    /// Answers with a watch response and returns the test's end of it.
    pub fn watch(self) -> WatchFeed {
        let (lines, fed) = mpsc::unbounded_channel();
        let events = futures::stream::unfold(fed, |mut fed| async move {
            match fed.recv().await? {
                Line::Event(event) => Some((Ok(event), fed)),
                // Nothing follows the error: the body ends abruptly.
                Line::Cut => Some((Err(std::io::Error::other("cut")), fed)),
            }
        });
        let kind = self.kind();
        self.answer(wire::watch(events));
        WatchFeed { lines, kind }
    }

    fn answer(self, response: Response<Body>) {
        // The client may have given up on the request already.
        let _ = self.reply.send(response);
    }
}

enum Line {
    Event(Value),
    Cut,
}

/// The test's end of one watch response.
pub struct WatchFeed {
    lines: mpsc::UnboundedSender<Line>,
    kind: Kind,
}

impl WatchFeed {
    /// Sends an event: `ADDED`, `MODIFIED`, `DELETED`.
    pub fn send(&self, event: &str, object: Value) {
        self.lines
            .send(Line::Event(json!({"type": event, "object": object})))
            .unwrap_or_else(|_| panic!("the client stopped watching before {event}"));
    }

    pub fn bookmark(&self, resource_version: &str) {
        let object = json!({"apiVersion": self.kind.api_version, "kind": self.kind.kind,
                            "metadata": {"resourceVersion": resource_version}});
        self.send("BOOKMARK", object);
    }

    /// The watch's resourceVersion is too old (compacted away): an `ERROR` event with a 410 `Status`.
    pub fn expired(&self, resource_version: &str) {
        let message = format!("too old resource version: {resource_version} (50)");
        self.send("ERROR", wire::status_object(StatusCode::GONE, "Expired", &message));
    }

    /// The connection drops mid-stream.
    pub fn cut(self) {
        let _ = self.lines.send(Line::Cut);
    }

    /// The server ends the response cleanly (as at the end of `timeoutSeconds`).
    pub fn end(self) {}
}
