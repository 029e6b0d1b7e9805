//! One state-of-the-world ADS stream (`StreamAggregatedResources`) as a state machine:
//! per type, the whole set the Envoy asked for, sent whenever its combined version
//! differs from what was last sent. A request carrying the type's last nonce answers
//! that response (a NACK with `error_detail`); an older nonce answers nothing.
//!
//! VHDS is delta-only, so a route table goes out with its virtual hosts inline, and its
//! ACK counts for them too.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Instant;

use aether_common::hash::{fnv1a, fnv1a_extend};
use envoy_types::pb::envoy::service::discovery::v3::{DiscoveryRequest, DiscoveryResponse};

use super::cache::{Resource, Snapshot};
use super::resources::with_virtual_hosts_inline;
use super::stream::{Nonces, Protocol, Push, Record, Size, verdict};
use super::{PUSH_ORDER, ROUTE, VIRTUAL_HOST};

#[derive(Debug, Default)]
struct TypeState {
    /// The names asked for; none asks for every resource of the type.
    names: BTreeSet<String>,
    sent_version: Option<String>,
    /// The nonce of the last response, and what it carried (of its own type and of
    /// the virtual hosts inline), until Envoy answers it.
    unanswered: Option<(String, Vec<Push>)>,
}

/// One state-of-the-world ADS stream: per type, what Envoy asked for and was last sent.
#[derive(Debug, Default)]
pub struct SotwStream {
    types: HashMap<String, TypeState>,
    nonces: Nonces,
}

impl Protocol for SotwStream {
    type Request = DiscoveryRequest;
    type Response = DiscoveryResponse;

    fn request(&mut self, request: &DiscoveryRequest) -> Vec<Record> {
        let state = self.types.entry(request.type_url.clone()).or_default();
        let answered = state.unanswered.take_if(|(nonce, _)| *nonce == request.response_nonce);
        state.names = request.resource_names.iter().cloned().collect();
        let pushes = answered.map(|(_, pushes)| pushes).unwrap_or_default();
        (pushes.into_iter())
            .map(|push| verdict(push, request.error_detail.as_ref(), Record::AckedAll))
            .collect()
    }

    fn push(&mut self, snapshot: &Snapshot, now: Instant) -> Vec<DiscoveryResponse> {
        PUSH_ORDER
            .iter()
            .filter_map(|type_url| self.respond(type_url, snapshot, now))
            .collect()
    }

    fn size(response: &DiscoveryResponse) -> Size<'_> {
        Size {
            type_url: &response.type_url,
            resources: response.resources.len(),
            bytes: response.resources.iter().map(|body| body.value.len()).sum(),
        }
    }
}

impl SotwStream {
    /// The type's whole selection at `snapshot`, if its version differs from the last sent.
    fn respond(&mut self, type_url: &str, snapshot: &Snapshot, now: Instant) -> Option<DiscoveryResponse> {
        let state = self.types.get_mut(type_url)?;
        let empty = Default::default();
        let served = snapshot.get(type_url).unwrap_or(&empty);
        let selected: Vec<_> = served
            .values()
            .filter(|r| state.names.is_empty() || state.names.contains(&r.name))
            .collect();
        let inline: Vec<Vec<&Arc<Resource>>> = (selected.iter())
            .map(|table| match type_url {
                ROUTE => virtual_hosts_of(snapshot, &table.name),
                _ => Vec::new(),
            })
            .collect();
        let hash = (selected.iter().chain(inline.iter().flatten())).fold(fnv1a(type_url.as_bytes()), |h, r| {
            fnv1a_extend(fnv1a_extend(h, r.name.as_bytes()), r.version.as_bytes())
        });
        let version = format!("{hash:016x}");
        if state.sent_version.as_deref() == Some(version.as_str()) {
            return None;
        }
        let nonce = self.nonces.issue();
        state.sent_version = Some(version.clone());
        let push = |type_url: &str, resources: &[&Arc<Resource>]| Push {
            type_url: type_url.to_owned(),
            resources: (resources.iter())
                .map(|r| (r.name.clone(), Some(r.version.clone())))
                .collect(),
            at: now,
        };
        let mut pushes = vec![push(type_url, &selected)];
        if type_url == ROUTE {
            pushes.push(push(VIRTUAL_HOST, &inline.concat()));
        }
        state.unanswered = Some((nonce.clone(), pushes));
        let bodies = selected.iter().zip(&inline).map(|(r, vhosts)| match type_url {
            ROUTE => with_virtual_hosts_inline(&r.body, vhosts.iter().map(|v| &v.body)),
            _ => r.body.clone(),
        });
        Some(DiscoveryResponse {
            version_info: version,
            resources: bodies.collect(),
            type_url: type_url.to_owned(),
            nonce,
            ..Default::default()
        })
    }
}

/// The virtual hosts of route table `table` (named `table/…`).
fn virtual_hosts_of<'s>(snapshot: &'s Snapshot, table: &str) -> Vec<&'s Arc<Resource>> {
    let prefix = format!("{table}/");
    let Some(vhosts) = snapshot.get(VIRTUAL_HOST) else {
        return Vec::new();
    };
    (vhosts.range(prefix.clone()..))
        .take_while(|(name, _)| name.starts_with(&prefix))
        .map(|(_, vhost)| vhost)
        .collect()
}

#[cfg(test)]
mod tests;
