//! One state-of-the-world ADS stream (`StreamAggregatedResources`): per type, the whole
//! set the Envoy asked for, sent whenever its combined version differs from what was
//! last sent. A request carrying the last nonce with `error_detail` is a NACK.

use std::collections::{BTreeSet, HashMap};

use aether_common::hash::{fnv1a, fnv1a_extend};
use envoy_types::pb::envoy::service::discovery::v3::{DiscoveryRequest, DiscoveryResponse};
use futures::{Stream, StreamExt};
use tokio::sync::mpsc;
use tonic::Status;

use super::cache::{Cache, Sent, Snapshot};
use super::{Decrement, Hooks, PUSH_ORDER};

#[derive(Default)]
struct TypeState {
    names: BTreeSet<String>,
    sent_version: Option<String>,
    /// The nonce of the last response, and what it carried.
    pending: Option<(String, Sent)>,
    /// When the pending response was sent.
    sent_at: Option<std::time::Instant>,
}

pub async fn serve<S>(cache: Cache, hooks: Hooks, mut inbound: S, out: mpsc::Sender<Result<DiscoveryResponse, Status>>)
where
    S: Stream<Item = Result<DiscoveryRequest, Status>> + Unpin,
{
    let mut snapshots = cache.subscribe();
    let mut types: HashMap<String, TypeState> = HashMap::new();
    let mut nonce = 0u64;
    let acks = cache.open_stream();
    hooks.metrics.streams.inc();
    let _streams = Decrement(hooks.metrics.streams.clone());
    loop {
        let snapshot = tokio::select! {
            request = inbound.next() => {
                let Some(Ok(request)) = request else { break };
                let state = types.entry(request.type_url.clone()).or_default();
                if let Some((sent_nonce, resources)) = state.pending.take() {
                    if sent_nonce == request.response_nonce {
                        if let Some(at) = state.sent_at.take() {
                            hooks.metrics.answered(&request.type_url, at.elapsed(), request.error_detail.is_none());
                        }
                        match &request.error_detail {
                            Some(error) => {
                                acks.record_nack(&request.type_url, &resources, &error.message);
                                tracing::warn!(type_url = %request.type_url, error = %error.message,
                                    "Envoy rejected a config push; it keeps its last good config");
                            }
                            None => acks.record_ack_all(&request.type_url, &resources),
                        }
                    } else {
                        state.pending = Some((sent_nonce, resources));
                    }
                }
                state.names = request.resource_names.iter().cloned().collect();
                cache.snapshot()
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
            if let Some(response) = respond(type_url, state, &snapshot, &mut nonce) {
                let bytes: usize = response.resources.iter().map(|a| a.value.len()).sum();
                hooks.metrics.pushed(type_url, response.resources.len(), bytes);
                if out.send(Ok(response)).await.is_err() {
                    return;
                }
            }
        }
    }
}

fn respond(type_url: &str, state: &mut TypeState, snapshot: &Snapshot, nonce: &mut u64) -> Option<DiscoveryResponse> {
    let empty = Default::default();
    let served = snapshot.get(type_url).unwrap_or(&empty);
    // An empty name list asks for everything of the type.
    let selected: Vec<_> = served
        .values()
        .filter(|r| state.names.is_empty() || state.names.contains(&r.name))
        .collect();
    let hash = selected.iter().fold(fnv1a(type_url.as_bytes()), |h, r| {
        fnv1a_extend(fnv1a_extend(h, r.name.as_bytes()), r.version.as_bytes())
    });
    let version = format!("{hash:016x}");
    if state.sent_version.as_deref() == Some(version.as_str()) {
        return None;
    }
    *nonce += 1;
    let nonce = nonce.to_string();
    state.sent_version = Some(version.clone());
    state.sent_at = Some(std::time::Instant::now());
    state.pending = Some((
        nonce.clone(),
        selected
            .iter()
            .map(|r| (r.name.clone(), Some(r.version.clone())))
            .collect(),
    ));
    Some(DiscoveryResponse {
        version_info: version,
        resources: selected.iter().map(|r| r.body.clone()).collect(),
        type_url: type_url.to_owned(),
        nonce,
        ..Default::default()
    })
}
