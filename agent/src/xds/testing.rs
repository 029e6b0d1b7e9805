//! Snapshots and one-line summaries for the stream state machines' tests.

use std::collections::BTreeMap;

use envoy_types::pb::google::protobuf::Any;

use super::cache::{Resource, Sent, Snapshot, version_of};
use super::short;
use super::stream::{Protocol, Record};

/// A body whose bytes read back as its `name` and `version`: `a` at `1` is `a1`.
pub fn body(name: &str, version: &str) -> Any {
    Any {
        type_url: "test".into(),
        value: format!("{name}{version}").into_bytes(),
    }
}

/// The version string the cache gives `name` at `version`.
pub fn version(name: &str, version: &str) -> String {
    version_of(&body(name, version))
}

/// Snapshot `serial` serving, per type, resources written `name=version`: `"a=1 b=2"`.
pub fn serving(serial: u64, types: &[(&str, &str)]) -> Snapshot {
    let types = types.iter().map(|(type_url, spec)| {
        let resources = spec.split_whitespace().map(|item| {
            let (name, v) = item.split_once('=').expect("name=version");
            (name.to_owned(), Resource::new(name.into(), body(name, v)))
        });
        (type_url.to_string(), resources.collect())
    });
    Snapshot {
        serial,
        types: types.collect::<BTreeMap<_, _>>(),
        pending: Default::default(),
    }
}

/// `+a -b`: a resource sent (or held), a resource removed.
fn names(sent: &Sent) -> String {
    let names = sent.iter().map(|(name, version)| match version {
        Some(_) => format!(" +{name}"),
        None => format!(" -{name}"),
    });
    names.collect()
}

/// `ack Cluster +a -b`, `nack Listener +l (bad)`, `forget Cluster b`…
pub fn record(record: &Record) -> String {
    match record {
        Record::Acked(push) => format!("ack {}{}", short(&push.type_url), names(&push.resources)),
        Record::AckedAll(push) => format!("ack all {}{}", short(&push.type_url), names(&push.resources)),
        Record::Rejected(push, error) => {
            format!("nack {}{} ({error})", short(&push.type_url), names(&push.resources))
        }
        Record::Running { type_url, resources } => {
            let mut resources = resources.clone();
            resources.sort();
            format!("running {}{}", short(type_url), names(&resources))
        }
        Record::Forgotten { type_url, names } => format!("forget {} {}", short(type_url), names.join(" ")),
    }
}

/// A body as written by [`body`]: `a1`.
pub fn read(body: &Any) -> String {
    String::from_utf8_lossy(&body.value).into_owned()
}

/// One step of a stream test: a snapshot published, or a request from Envoy.
pub enum Step<P: Protocol> {
    Publish(Snapshot),
    Request(Box<P::Request>),
}

/// Runs `steps` through one new stream, checking what each puts out: the ACK-state
/// records, then the responses as `response` summarises them, comma-separated.
pub fn run<P: Protocol>(steps: Vec<(Step<P>, &str)>, response: fn(&P::Response) -> String) {
    let mut stream = P::default();
    let mut snapshot = Snapshot::default();
    let now = std::time::Instant::now();
    for (i, (step, expected)) in steps.into_iter().enumerate() {
        let mut out: Vec<String> = Vec::new();
        match step {
            Step::Publish(published) => snapshot = published,
            Step::Request(request) => out.extend(stream.request(&request).iter().map(record)),
        }
        out.extend(stream.push(&snapshot, now).iter().map(response));
        assert_eq!(out.join(", "), expected, "step {i}");
    }
}
