//! Taking in other replicas' changes: events from the store's change feed, resyncs
//! from a fresh snapshot, and the records a lost race revealed. Each is applied to
//! memory only if it is newer than what memory holds, and published as one batch.

use std::collections::HashSet;
use std::net::IpAddr;
use std::time::Instant;

use aether_common::quote::quote;
use aether_proto::registry::v1::{Endpoint, Service};

use super::revisions::RecordKey;
use super::state::{KeyedChange, State};
use super::writer::Writer;
use crate::model::{ServiceKey, parse_address, validate_endpoint};
use crate::records::{ConfigKind, ConfigRecord};
use crate::store::{Conflict, Contents, FeedChangeKind, FeedEvent, Revision, UnreadableRecord};

/// A change to apply, with the store revision it was made at (`None`: apply anyway).
type RemoteChange = (Option<Revision>, FeedChangeKind);

impl Writer {
    pub(super) fn on_feed(&mut self, event: FeedEvent) {
        match event {
            FeedEvent::Changes { revision, changes } => {
                if self.health.is_down() && self.behind.is_empty() {
                    self.health.set_up();
                }
                let changes = changes.into_iter().map(|c| (Some(c.revision), c.kind)).collect();
                self.apply_remote(changes);
                self.revisions.feed = self.revisions.feed.max(revision);
                self.revisions.prune_tombstones(revision);
            }
            FeedEvent::Resync(contents) => {
                self.metrics.feed_resyncs.inc();
                tracing::info!(
                    revision = contents.revision,
                    "resyncing the catalog from a fresh store snapshot"
                );
                self.resync(contents);
            }
            FeedEvent::Down(reason) => self.health.failed(reason),
        }
    }

    /// Replaces memory by `contents`, except records written here after it was read.
    fn resync(&mut self, contents: Contents) {
        let horizon = contents.revision;
        let mut changes = self.vanished(&contents);
        changes.extend(
            contents
                .services
                .into_iter()
                .map(|s| (Some(s.revision), FeedChangeKind::ServicePut(s.value))),
        );
        changes.extend(
            contents
                .endpoints
                .into_iter()
                .map(|e| (Some(e.revision), FeedChangeKind::EndpointPut(e.value))),
        );
        changes.extend(
            contents
                .configs
                .into_iter()
                .map(|r| (Some(r.revision), FeedChangeKind::ConfigPut(r.value))),
        );
        for record in contents.unreadable {
            changes.push((None, FeedChangeKind::Unreadable(record)));
        }
        self.apply_remote(changes);
        self.revisions.feed = self.revisions.feed.max(horizon);
        self.revisions.prune_tombstones(horizon);
    }

    /// Deletions of what memory holds but the snapshot `contents` shows gone (not
    /// written here since). Their revisions are forgotten: if a later snapshot shows
    /// them again (at any revision), they are real and come back.
    fn vanished(&mut self, contents: &Contents) -> Vec<RemoteChange> {
        let (services, endpoints) = snapshot_keys(contents);
        let horizon = contents.revision;
        let mut changes = Vec::new();
        let mut forgotten = Vec::new();
        {
            let state = self.state.read();
            for (key, entry) in &state.services {
                for address in entry.endpoints.keys() {
                    let record = RecordKey::Endpoint(key.clone(), *address);
                    if !endpoints.contains(&(key.clone(), *address)) && self.revisions.gone_at(&record, horizon) {
                        forgotten.push(record);
                        changes.push((
                            None,
                            FeedChangeKind::EndpointDeleted {
                                service: key.to_string(),
                                address: address.to_string(),
                            },
                        ));
                    }
                }
            }
            for (key, entry) in &state.services {
                if !services.contains(key) && self.revisions.gone_at(&RecordKey::Service(key.clone()), horizon) {
                    forgotten.push(RecordKey::Service(key.clone()));
                    forgotten.extend(entry.endpoints.keys().map(|a| RecordKey::Endpoint(key.clone(), *a)));
                    changes.push((None, FeedChangeKind::ServiceDeleted { key: key.to_string() }));
                }
            }
        }
        changes.extend(self.vanished_configs(contents, &mut forgotten));
        for key in forgotten {
            self.revisions.forget(&key);
        }
        changes
    }

    /// Deletions of the configuration records memory holds but the snapshot `contents`
    /// shows gone.
    fn vanished_configs(&self, contents: &Contents, forgotten: &mut Vec<RecordKey>) -> Vec<RemoteChange> {
        let stored: HashSet<(ConfigKind, String)> = (contents.configs.iter())
            .map(|r| (r.value.kind(), r.value.key()))
            .collect();
        let state = self.state.read();
        let mut changes = Vec::new();
        for kind in ConfigKind::ALL {
            for key in state.configs.of(kind).keys() {
                let record = RecordKey::Config(kind, key.clone());
                if !stored.contains(&(kind, key.clone())) && self.revisions.gone_at(&record, contents.revision) {
                    forgotten.push(record);
                    changes.push((None, FeedChangeKind::ConfigDeleted { kind, key: key.clone() }));
                }
            }
        }
        changes
    }

    /// Takes in what a lost race revealed, so the next plan is made against it.
    pub(super) fn adopt(&mut self, conflict: Conflict) {
        let mut changes: Vec<RemoteChange> = conflict
            .existing
            .into_iter()
            .map(|s| (None, FeedChangeKind::ServicePut(s)))
            .collect();
        changes.extend(
            conflict
                .missing
                .into_iter()
                .map(|key| (None, FeedChangeKind::ServiceDeleted { key: key.to_string() })),
        );
        self.apply_remote(changes);
    }

    /// Applies changes made elsewhere (or revealed by a conflict) to memory and
    /// publishes them as one batch. A change with a revision is skipped unless it is
    /// newer than what memory holds for that record; `None` means "apply anyway".
    pub(super) fn apply_remote(&mut self, changes: Vec<RemoteChange>) {
        let now = Instant::now();
        let mut out = Vec::new();
        let shared = self.state.clone();
        let mut state = shared.write();
        for (revision, kind) in changes {
            match kind {
                FeedChangeKind::ServicePut(service) => {
                    self.remote_service_put(&mut state, service, revision, now, &mut out)
                }
                FeedChangeKind::ServiceDeleted { key } => {
                    self.remote_service_deleted(&mut state, key, revision, &mut out)
                }
                FeedChangeKind::EndpointPut(endpoint) => {
                    self.remote_endpoint_put(&mut state, endpoint, revision, &mut out)
                }
                FeedChangeKind::EndpointDeleted { service, address } => {
                    self.remote_endpoint_deleted(&mut state, &service, &address, revision, now, &mut out)
                }
                FeedChangeKind::ConfigPut(record) => self.remote_config_put(&mut state, record, revision, &mut out),
                FeedChangeKind::ConfigDeleted { kind, key } => {
                    self.remote_config_deleted(&mut state, kind, key, revision, &mut out)
                }
                FeedChangeKind::Unreadable(record) => self.skip_unreadable(record),
            }
        }
        if out.is_empty() {
            return;
        }
        self.metrics.feed_changes.inc_by(out.len() as u64);
        self.metrics.changes.inc_by(out.len() as u64);
        state.publish(out);
        state.report(&self.metrics);
    }

    fn remote_service_put(
        &mut self,
        state: &mut State,
        service: Service,
        revision: Option<Revision>,
        now: Instant,
        out: &mut Vec<KeyedChange>,
    ) {
        let key = match ServiceKey::from_parts("service", &service.namespace, &service.name) {
            Ok(key) => key,
            Err(e) => {
                self.metrics.feed_unusable.inc();
                tracing::error!(error = %e, "skipping an unusable service from the store feed");
                return;
            }
        };
        let vip = match parse_address("vip", &service.vip) {
            Ok(vip) => vip,
            Err(e) => {
                self.metrics.feed_unusable.inc();
                tracing::error!(service = %key, error = %e, "skipping an unusable service from the store feed");
                return;
            }
        };
        if let Some(Err(e)) = service.external.as_deref().map(aether_api::external_service::validate) {
            self.metrics.feed_unusable.inc();
            tracing::error!(service = %key, error = %format!("external.{e}"), "skipping an unusable service from the store feed");
            return;
        }
        if self.revisions.newer(&RecordKey::Service(key.clone()), revision) {
            state.put_service(key, vip, service, now, out);
        }
    }

    fn remote_service_deleted(
        &mut self,
        state: &mut State,
        key: String,
        revision: Option<Revision>,
        out: &mut Vec<KeyedChange>,
    ) {
        let Some(key) = state.services.get_key_value(key.as_str()).map(|(k, _)| k.clone()) else {
            // Not held here: still remember the deletion, so an older put is skipped.
            if let (Some(revision), Ok(key)) = (revision, ServiceKey::parse("service", &key)) {
                self.revisions.newer(&RecordKey::Service(key), Some(revision));
            }
            return;
        };
        let record = RecordKey::Service(key.clone());
        if !self.revisions.newer(&record, revision) {
            return;
        }
        if let Some(revision) = revision {
            self.revisions.add_tombstone(revision, record);
        }
        state.remove_service(&key, out);
    }

    fn remote_endpoint_put(
        &mut self,
        state: &mut State,
        endpoint: Endpoint,
        revision: Option<Revision>,
        out: &mut Vec<KeyedChange>,
    ) {
        let valid = match validate_endpoint("endpoint", Some(endpoint)) {
            Ok(valid) => valid,
            Err(e) => {
                self.metrics.feed_unusable.inc();
                tracing::error!(error = %e, "skipping an unusable endpoint from the store feed");
                return;
            }
        };
        if !state.services.contains_key(&valid.service) {
            // Its service's deletion came first: the endpoint went with it.
            tracing::debug!(service = %valid.service, address = %valid.address,
                "ignoring an endpoint of a service this replica does not hold");
            return;
        }
        let record = RecordKey::Endpoint(valid.service.clone(), valid.address);
        if self.revisions.newer(&record, revision) {
            state.put_endpoint(valid, out);
        }
    }

    fn remote_endpoint_deleted(
        &mut self,
        state: &mut State,
        service: &str,
        address: &str,
        revision: Option<Revision>,
        now: Instant,
        out: &mut Vec<KeyedChange>,
    ) {
        let (Ok(key), Ok(address)) = (ServiceKey::parse("service", service), address.parse::<IpAddr>()) else {
            return;
        };
        let record = RecordKey::Endpoint(key.clone(), address);
        if !self.revisions.newer(&record, revision) {
            return;
        }
        if let Some(revision) = revision {
            self.revisions.add_tombstone(revision, record);
        }
        state.remove_endpoint(&key, address, now, out);
    }

    fn remote_config_put(
        &mut self,
        state: &mut State,
        record: ConfigRecord,
        revision: Option<Revision>,
        out: &mut Vec<KeyedChange>,
    ) {
        let (kind, key) = (record.kind(), record.key());
        if let Err(error) = record.validate() {
            self.metrics.feed_unusable.inc();
            tracing::error!(kind = kind.noun(), key = %quote(&key), %error,
                "skipping an unusable configuration record from the store feed");
            return;
        }
        if self.revisions.newer(&RecordKey::Config(kind, key.clone()), revision) {
            state.put_config(kind, key, Some(record), out);
        }
    }

    fn remote_config_deleted(
        &mut self,
        state: &mut State,
        kind: ConfigKind,
        key: String,
        revision: Option<Revision>,
        out: &mut Vec<KeyedChange>,
    ) {
        let record = RecordKey::Config(kind, key.clone());
        if !self.revisions.newer(&record, revision) {
            return;
        }
        if let Some(revision) = revision {
            self.revisions.add_tombstone(revision, record);
        }
        state.put_config(kind, key, None, out);
    }

    fn skip_unreadable(&self, record: UnreadableRecord) {
        self.metrics.feed_unusable.inc();
        tracing::error!(record = %quote(&record.key), reason = %record.reason,
            "skipping an unusable store record (left in the store untouched)");
    }
}

/// The services and endpoints a snapshot holds.
fn snapshot_keys(contents: &Contents) -> (HashSet<ServiceKey>, HashSet<(ServiceKey, IpAddr)>) {
    let services = contents
        .services
        .iter()
        .filter_map(|s| ServiceKey::from_parts("service", &s.value.namespace, &s.value.name).ok())
        .collect();
    let endpoints = contents
        .endpoints
        .iter()
        .filter_map(|e| {
            let key = ServiceKey::parse("service", &e.value.service).ok()?;
            let address = e.value.address.parse::<IpAddr>().ok()?;
            Some((key, address))
        })
        .collect();
    (services, endpoints)
}
