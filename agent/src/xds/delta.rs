//! One delta ADS stream (`DeltaAggregatedResources`) as a state machine.
//!
//! Per type the stream tracks what its Envoy subscribed to (wildcard and/or names) and
//! the version it holds of each resource (seeded from `initial_resource_versions`, so a
//! reconnecting Envoy is not sent what it already has). On every request and every new
//! snapshot it sends only the difference, in push order. A response is a NACK when the
//! next request carries its nonce with `error_detail`: recorded, and not resent (Envoy
//! keeps its last good config until the resource changes again).
//!
//! VHDS: Envoy subscribes to virtual hosts without naming a table (its watch for a
//! table matches `<table>/…` names) and drops those that arrive before that watch
//! exists. The watch exists once Envoy has taken the table, so a table's virtual hosts
//! are sent only after Envoy ACKs the table, and all again after each new version of it
//! (which may have restarted the watch).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Instant;

use envoy_types::pb::envoy::service::discovery::v3::{DeltaDiscoveryRequest, DeltaDiscoveryResponse, Resource};

use super::cache::{Sent, Snapshot};
use super::stream::{Nonces, Protocol, Push, Record, Size, verdict};
use super::{PUSH_ORDER, ROUTE, VIRTUAL_HOST};

#[derive(Debug, Default)]
struct TypeState {
    wildcard: bool,
    names: BTreeSet<String>,
    /// What Envoy holds: name → version. Names it asked for that do not exist are
    /// kept with an empty version once reported removed, so they are reported once.
    held: BTreeMap<String, String>,
    started: bool,
    /// Envoy's initial fetch for a type completes only with a response, even an
    /// empty one.
    answered: bool,
}

/// One delta ADS stream's subscriptions, what its Envoy holds, and its unanswered pushes.
#[derive(Debug, Default)]
pub struct DeltaStream {
    types: HashMap<String, TypeState>,
    unanswered: HashMap<String, Push>,
    nonces: Nonces,
    /// The route tables this Envoy holds: each has its VHDS watch.
    tables: BTreeSet<String>,
}

impl Protocol for DeltaStream {
    type Request = DeltaDiscoveryRequest;
    type Response = DeltaDiscoveryResponse;

    fn request(&mut self, request: &DeltaDiscoveryRequest) -> Vec<Record> {
        let mut records = Vec::new();
        if let Some(push) = self.unanswered.remove(&request.response_nonce) {
            let record = verdict(push, request.error_detail.as_ref(), Record::Acked);
            if let Record::Acked(push) = &record
                && push.type_url == ROUTE
            {
                self.tables_taken(&push.resources);
            }
            records.push(record);
        }
        let state = self.types.entry(request.type_url.clone()).or_default();
        if !state.started {
            let running = state.start(request);
            if let Some(Record::Running { type_url, resources }) = &running
                && type_url == ROUTE
            {
                // A reconnecting Envoy's tables have their watches, and their hosts.
                self.tables.extend(resources.iter().map(|(name, _)| name.clone()));
            }
            records.extend(running);
        }
        state.subscribe(&request.resource_names_subscribe, &request.resource_names_unsubscribe);
        if !request.resource_names_unsubscribe.is_empty() {
            records.push(Record::Forgotten {
                type_url: request.type_url.clone(),
                names: request.resource_names_unsubscribe.clone(),
            });
        }
        records
    }

    fn on_demand<'r>(request: &'r DeltaDiscoveryRequest, snapshot: &Snapshot) -> Option<(&'r str, Vec<String>)> {
        let type_url = request.type_url.as_str();
        if type_url == VIRTUAL_HOST {
            return None;
        }
        let missing: Vec<String> = (request.resource_names_subscribe.iter())
            .filter(|name| *name != "*" && snapshot.version_of(type_url, name).is_none())
            .cloned()
            .collect();
        (!missing.is_empty()).then_some((type_url, missing))
    }

    fn push(&mut self, snapshot: &Snapshot, now: Instant) -> Vec<DeltaDiscoveryResponse> {
        PUSH_ORDER
            .iter()
            .filter_map(|type_url| self.respond(type_url, snapshot, now))
            .collect()
    }

    fn size(response: &DeltaDiscoveryResponse) -> Size<'_> {
        let bodies = response.resources.iter().filter_map(|r| r.resource.as_ref());
        Size {
            type_url: &response.type_url,
            resources: response.resources.len() + response.removed_resources.len(),
            bytes: bodies.map(|body| body.value.len()).sum(),
        }
    }
}

impl DeltaStream {
    /// The response that brings this type up to `snapshot`, if anything differs (or
    /// Envoy's initial fetch of the type is still unanswered).
    fn respond(&mut self, type_url: &str, snapshot: &Snapshot, now: Instant) -> Option<DeltaDiscoveryResponse> {
        let state = self.types.get_mut(type_url).filter(|state| state.started)?;
        let (resources, removed) = match type_url {
            VIRTUAL_HOST => state.diff_virtual_hosts(&self.tables, snapshot),
            _ => state.diff(type_url, snapshot),
        };
        if resources.is_empty() && removed.is_empty() && state.answered {
            return None;
        }
        let sent = state.sent(&resources, &removed);
        let nonce = self.nonces.issue();
        let push = Push {
            type_url: type_url.to_owned(),
            resources: sent,
            at: now,
        };
        self.unanswered.insert(nonce.clone(), push);
        Some(DeltaDiscoveryResponse {
            system_version_info: snapshot.serial.to_string(),
            type_url: type_url.to_owned(),
            resources,
            removed_resources: removed,
            nonce,
            ..Default::default()
        })
    }

    /// Envoy ACKed these route tables (`None`: removed): send each taken table's virtual
    /// hosts (again), for the watch it may have just started.
    fn tables_taken(&mut self, tables: &Sent) {
        let vhosts = self.types.entry(VIRTUAL_HOST.to_owned()).or_default();
        for (table, version) in tables {
            vhosts.held.retain(|name, _| namespace_of(name) != Some(table.as_str()));
            match version {
                Some(_) => self.tables.insert(table.clone()),
                None => self.tables.remove(table),
            };
        }
    }
}

impl TypeState {
    /// The type's first request: what a reconnecting Envoy already runs, and whether
    /// it subscribes to everything.
    fn start(&mut self, request: &DeltaDiscoveryRequest) -> Option<Record> {
        self.started = true;
        // A first request naming nothing is a wildcard subscription (legacy form).
        self.wildcard = request.resource_names_subscribe.is_empty();
        let running = &request.initial_resource_versions;
        self.held.extend(running.clone());
        let resources = running.iter().map(|(name, v)| (name.clone(), Some(v.clone())));
        (!running.is_empty()).then(|| Record::Running {
            type_url: request.type_url.clone(),
            resources: resources.collect(),
        })
    }

    fn subscribe(&mut self, subscribe: &[String], unsubscribe: &[String]) {
        for name in subscribe {
            if name == "*" {
                self.wildcard = true;
            } else {
                self.names.insert(name.clone());
            }
        }
        for name in unsubscribe {
            if name == "*" {
                self.wildcard = false;
            } else {
                self.names.remove(name);
                self.held.remove(name);
            }
        }
    }

    /// What Envoy lacks of this type at `snapshot`: resources to add or update (in name
    /// order), and names to report removed.
    fn diff(&self, type_url: &str, snapshot: &Snapshot) -> (Vec<Resource>, Vec<String>) {
        let empty = BTreeMap::new();
        let served = snapshot.get(type_url).unwrap_or(&empty);
        let by_wildcard = served.keys().filter(|_| self.wildcard);
        let wanted: BTreeSet<&String> = by_wildcard.chain(&self.names).collect();
        let mut resources = Vec::new();
        let mut removed = Vec::new();
        for name in wanted {
            let held = self.held.get(name);
            match served.get(name) {
                Some(resource) if held != Some(&resource.version) => resources.push(Resource {
                    name: name.clone(),
                    version: resource.version.clone(),
                    resource: Some(resource.body.clone()),
                    ..Default::default()
                }),
                Some(_) => {}
                // Asked for by name but not served: once any on-demand lookup has ended,
                // say so (once), so Envoy stops waiting.
                None if held.is_none_or(|v| !v.is_empty())
                    && !snapshot.pending.contains(&(type_url.to_owned(), name.clone())) =>
                {
                    removed.push(name.clone())
                }
                None => {}
            }
        }
        // Held by wildcard alone, and gone from the snapshot.
        let gone = self
            .held
            .keys()
            .filter(|name| self.wildcard && !served.contains_key(*name) && !self.names.contains(*name));
        removed.extend(gone.cloned());
        (resources, removed)
    }

    /// [`TypeState::diff`] for VHDS: every virtual host of the tables Envoy holds, and
    /// removals of those it holds that are gone.
    fn diff_virtual_hosts(&self, tables: &BTreeSet<String>, snapshot: &Snapshot) -> (Vec<Resource>, Vec<String>) {
        let empty = BTreeMap::new();
        let served = snapshot.get(VIRTUAL_HOST).unwrap_or(&empty);
        let resources = (served.values())
            .filter(|vhost| namespace_of(&vhost.name).is_some_and(|table| tables.contains(table)))
            .filter(|vhost| self.held.get(&vhost.name) != Some(&vhost.version))
            .map(|vhost| Resource {
                name: vhost.name.clone(),
                version: vhost.version.clone(),
                resource: Some(vhost.body.clone()),
                ..Default::default()
            })
            .collect();
        let removed = (self.held.keys())
            .filter(|name| !served.contains_key(*name))
            .cloned()
            .collect();
        (resources, removed)
    }

    /// Envoy is sent these: it will hold them. Returns what the response carried.
    fn sent(&mut self, resources: &[Resource], removed: &[String]) -> Sent {
        self.answered = true;
        let mut sent = Sent::new();
        for resource in resources {
            self.held.insert(resource.name.clone(), resource.version.clone());
            sent.push((resource.name.clone(), Some(resource.version.clone())));
        }
        for name in removed {
            // Remembered as reported, so an absent name asked for is reported once.
            if self.names.contains(name) {
                self.held.insert(name.clone(), String::new());
            } else {
                self.held.remove(name);
            }
            sent.push((name.clone(), None));
        }
        sent
    }
}

/// The table of a virtual host's name `<table>/<host>` (up to the last `/`, as Envoy
/// reads it).
fn namespace_of(name: &str) -> Option<&str> {
    name.rsplit_once('/').map(|(table, _)| table)
}

#[cfg(test)]
mod tests;
