//! One delta ADS stream (`DeltaAggregatedResources`).
//!
//! Per type the stream tracks what its Envoy subscribed to (wildcard and/or names) and
//! the version it holds of each resource (seeded from `initial_resource_versions`, so a
//! reconnecting Envoy is not sent what it already has). On every request and every new
//! snapshot it sends only the difference, in push order. A response is a NACK when the
//! next request carries its nonce with `error_detail`: counted and logged, and Envoy
//! keeps its last good config.

use std::collections::{BTreeSet, HashMap};

use envoy_types::pb::envoy::service::discovery::v3::{DeltaDiscoveryRequest, DeltaDiscoveryResponse, Resource};
use futures::{Stream, StreamExt};
use tokio::sync::mpsc;
use tonic::Status;

use super::Hooks;
use super::cache::{Cache, Snapshot};
use super::{Decrement, PUSH_ORDER};

#[derive(Default)]
struct TypeState {
    wildcard: bool,
    names: BTreeSet<String>,
    /// What Envoy holds: name → version. Names it asked for that do not exist are
    /// kept with an empty version once reported removed, so they are reported once.
    held: HashMap<String, String>,
    started: bool,
    /// Envoy's initial fetch for a type completes only with a response, even an
    /// empty one.
    answered: bool,
}

struct Sent {
    type_url: String,
    resources: Vec<(String, Option<String>)>,
    at: std::time::Instant,
}

pub async fn serve<S>(
    cache: Cache,
    hooks: Hooks,
    mut inbound: S,
    out: mpsc::Sender<Result<DeltaDiscoveryResponse, Status>>,
) where
    S: Stream<Item = Result<DeltaDiscoveryRequest, Status>> + Unpin,
{
    let mut snapshots = cache.subscribe();
    let mut types: HashMap<String, TypeState> = HashMap::new();
    let mut pending: HashMap<String, Sent> = HashMap::new();
    let mut nonce = 0u64;
    let acks = cache.open_stream();
    hooks.metrics.streams.inc();
    let _streams = Decrement(hooks.metrics.streams.clone());
    loop {
        let snapshot = tokio::select! {
            request = inbound.next() => {
                let request = match request {
                    Some(Ok(request)) => request,
                    Some(Err(status)) => {
                        tracing::debug!(%status, "delta xDS stream ended");
                        break;
                    }
                    None => break,
                };
                if let Some(sent) = request_nonce(&request).and_then(|n| pending.remove(n)) {
                    hooks.metrics.answered(&sent.type_url, sent.at.elapsed(), request.error_detail.is_none());
                    match &request.error_detail {
                        Some(error) => {
                            acks.record_nack(&sent.type_url, &sent.resources, &error.message);
                            tracing::warn!(type_url = %sent.type_url, error = %error.message,
                                "Envoy rejected a config push; it keeps its last good config");
                        }
                        None => acks.record_ack(&sent.type_url, &sent.resources),
                    }
                }
                let state = types.entry(request.type_url.clone()).or_default();
                if !state.started {
                    state.started = true;
                    state.held.extend(request.initial_resource_versions.clone());
                    // A reconnecting Envoy already runs these versions.
                    let running: Vec<(String, Option<String>)> = request
                        .initial_resource_versions
                        .iter()
                        .map(|(name, version)| (name.clone(), Some(version.clone())))
                        .collect();
                    acks.record_ack(&request.type_url, &running);
                    // A first request naming nothing is a wildcard subscription (legacy form).
                    if request.resource_names_subscribe.is_empty() {
                        state.wildcard = true;
                    }
                }
                for name in &request.resource_names_subscribe {
                    if name == "*" {
                        state.wildcard = true;
                    } else {
                        state.names.insert(name.clone());
                    }
                }
                acks.forget(&request.type_url, &request.resource_names_unsubscribe);
                for name in &request.resource_names_unsubscribe {
                    if name == "*" {
                        state.wildcard = false;
                    } else {
                        state.names.remove(name);
                        state.held.remove(name);
                    }
                }
                let mut snapshot = cache.snapshot();
                if !request.resource_names_subscribe.is_empty() {
                    let missing: Vec<String> = request
                        .resource_names_subscribe
                        .iter()
                        .filter(|n| *n != "*" && snapshot.version_of(&request.type_url, n).is_none())
                        .cloned()
                        .collect();
                    if !missing.is_empty() {
                        // The hook marks what it will look up as pending before returning.
                        (hooks.on_demand)(&request.type_url, &missing);
                        snapshot = cache.snapshot();
                    }
                }
                snapshot
            }
            changed = snapshots.changed() => {
                if changed.is_err() {
                    break;
                }
                snapshots.borrow_and_update().clone()
            }
        };
        for type_url in PUSH_ORDER {
            let Some(state) = types.get_mut(type_url) else { continue };
            if let Some(response) = diff(type_url, state, &snapshot, &mut nonce, &mut pending) {
                let bytes: usize = response
                    .resources
                    .iter()
                    .filter_map(|r| r.resource.as_ref())
                    .map(|a| a.value.len())
                    .sum();
                let count = response.resources.len() + response.removed_resources.len();
                hooks.metrics.pushed(type_url, count, bytes);
                if out.send(Ok(response)).await.is_err() {
                    return;
                }
            }
        }
    }
}

fn request_nonce(request: &DeltaDiscoveryRequest) -> Option<&str> {
    Some(request.response_nonce.as_str()).filter(|n| !n.is_empty())
}

/// The response that brings this type up to `snapshot`, if anything differs.
fn diff(
    type_url: &str,
    state: &mut TypeState,
    snapshot: &Snapshot,
    nonce: &mut u64,
    pending: &mut HashMap<String, Sent>,
) -> Option<DeltaDiscoveryResponse> {
    let empty = Default::default();
    let served = snapshot.get(type_url).unwrap_or(&empty);
    let mut resources = Vec::new();
    let mut sent = Vec::new();
    let wanted = |name: &str| state.wildcard || state.names.contains(name);
    let candidates: Box<dyn Iterator<Item = &String>> = if state.wildcard {
        Box::new(served.keys().chain(state.names.iter()))
    } else {
        Box::new(state.names.iter())
    };
    let mut removed = Vec::new();
    let mut seen = BTreeSet::new();
    for name in candidates {
        if !seen.insert(name.clone()) {
            continue;
        }
        match served.get(name) {
            Some(resource) if state.held.get(name) != Some(&resource.version) => {
                resources.push(Resource {
                    name: name.clone(),
                    version: resource.version.clone(),
                    resource: Some(resource.body.clone()),
                    ..Default::default()
                });
                sent.push((name.clone(), Some(resource.version.clone())));
            }
            Some(_) => {}
            // Asked for by name but not served: once any on-demand lookup has ended, say
            // so (once), so Envoy stops waiting.
            None if state.held.get(name).is_none_or(|v| !v.is_empty())
                && !snapshot.pending.contains(&(type_url.to_owned(), name.clone())) =>
            {
                removed.push(name.clone());
                sent.push((name.clone(), None));
            }
            None => {}
        }
    }
    // Held resources that are gone from the snapshot (wildcard) or no longer wanted.
    for name in state.held.keys() {
        if !served.contains_key(name) && !seen.contains(name) && wanted(name) {
            removed.push(name.clone());
            sent.push((name.clone(), None));
        }
    }
    if resources.is_empty() && removed.is_empty() && state.answered {
        return None;
    }
    state.answered = true;
    for (name, version) in &sent {
        match version {
            Some(v) => state.held.insert(name.clone(), v.clone()),
            None if state.names.contains(name) => state.held.insert(name.clone(), String::new()),
            None => state.held.remove(name),
        };
    }
    *nonce += 1;
    let nonce = nonce.to_string();
    pending.insert(
        nonce.clone(),
        Sent {
            type_url: type_url.to_owned(),
            resources: sent,
            at: std::time::Instant::now(),
        },
    );
    Some(DeltaDiscoveryResponse {
        system_version_info: snapshot.serial.to_string(),
        type_url: type_url.to_owned(),
        resources,
        removed_resources: removed,
        nonce,
        ..Default::default()
    })
}

/// `Cluster` from a type URL, for metric labels.
pub fn short(type_url: &str) -> &'static str {
    match type_url {
        super::CLUSTER => "Cluster",
        super::ENDPOINT => "ClusterLoadAssignment",
        super::LISTENER => "Listener",
        super::ROUTE => "RouteConfiguration",
        super::SECRET => "Secret",
        _ => "other",
    }
}
