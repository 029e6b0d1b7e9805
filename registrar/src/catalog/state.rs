//! The in-memory state: every service with its VIP and endpoints, the catalog
//! version, the history of recent batches and the broadcast that feeds watchers.
//! Only the writer changes it (under the write lock); everyone else reads.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Instant;

use aether_proto::digest::{self, EndpointSum};
use aether_proto::registrar::v1::{Change, EndpointRef, Version, change};
use aether_proto::registry::v1::{Endpoint, KubernetesService, Service};
use tokio::sync::broadcast;

use super::plan::Plan;
use crate::metrics::Metrics;
use crate::model::{ServiceKey, ValidEndpoint};
use crate::records::{ConfigKind, ConfigRecord, ConfigRecords, Record, config_change};

/// A committed group of changes, as published to watchers.
#[derive(Debug)]
pub struct Batch {
    pub seq: u64,
    pub changes: Vec<KeyedChange>,
}

/// A committed change to one service. Endpoint data is shared with the catalog and
/// the history (not copied), and turned into its wire form only when sent. A
/// configuration record's change is published once, under the record's own key:
/// watchers select it by what it holds (see `watch::Filter::wants`), not by service.
#[derive(Clone, Debug)]
pub struct KeyedChange {
    pub service: ServiceKey,
    pub event: Event,
}

#[derive(Clone, Debug)]
pub enum Event {
    ServiceAdded(Service),
    ServiceRemoved,
    EndpointAdded(Arc<Endpoint>),
    EndpointUpdated(Arc<Endpoint>),
    EndpointRemoved(IpAddr),
    /// A configuration record changed.
    Config(ConfigChange),
}

/// A configuration record of `kind` going from `old` to `new` (`None`: absent). Both
/// are carried so a watcher that held the old version learns it is gone for it.
#[derive(Clone, Debug)]
pub struct ConfigChange {
    pub kind: ConfigKind,
    pub old: Option<ConfigRecord>,
    pub new: Option<ConfigRecord>,
}

impl KeyedChange {
    pub fn to_proto(&self) -> Change {
        let change = match &self.event {
            Event::ServiceAdded(service) => change::Change::ServiceAdded(service.clone()),
            Event::ServiceRemoved => change::Change::ServiceRemoved(self.service.to_string()),
            Event::EndpointAdded(e) => change::Change::EndpointAdded(Endpoint::clone(e)),
            Event::EndpointUpdated(e) => change::Change::EndpointUpdated(Endpoint::clone(e)),
            Event::EndpointRemoved(address) => change::Change::EndpointRemoved(EndpointRef {
                service: self.service.to_string(),
                address: address.to_string(),
            }),
            Event::Config(c) => config_change(c.kind, self.service.as_str(), c.new.as_ref()),
        };
        Change { change: Some(change) }
    }
}

#[derive(Clone, Debug)]
pub struct Entry {
    pub service: Service,
    pub endpoints: Endpoints,
    pub(super) empty_since: Option<Instant>,
}

impl Entry {
    /// The service's digest as a watcher holding it would compute it (without endpoints
    /// for a services-only watcher).
    pub fn digest(&self, with_endpoints: bool) -> u64 {
        let endpoints = if with_endpoints {
            self.endpoints.sum
        } else {
            EndpointSum::default()
        };
        digest::service(&self.service, endpoints)
    }
}

/// A service's endpoints by address, with the sum of their digests kept as they come
/// and go, so a reconnecting watcher's holdings are checked without encoding them.
#[derive(Clone, Debug, Default)]
pub struct Endpoints {
    by_address: BTreeMap<IpAddr, Arc<Endpoint>>,
    sum: EndpointSum,
}

impl Endpoints {
    pub(super) fn insert(&mut self, address: IpAddr, endpoint: Arc<Endpoint>) -> Option<Arc<Endpoint>> {
        // An agent's periodic re-registration puts the same endpoint again: nothing to hash.
        if self.by_address.get(&address).is_some_and(|old| **old == *endpoint) {
            return self.by_address.insert(address, endpoint);
        }
        self.sum.add(digest::of(&*endpoint));
        let old = self.by_address.insert(address, endpoint);
        if let Some(old) = &old {
            self.sum.remove(digest::of(&**old));
        }
        old
    }

    pub(super) fn remove(&mut self, address: &IpAddr) -> Option<Arc<Endpoint>> {
        let old = self.by_address.remove(address);
        if let Some(old) = &old {
            self.sum.remove(digest::of(&**old));
        }
        old
    }
}

impl std::ops::Deref for Endpoints {
    type Target = BTreeMap<IpAddr, Arc<Endpoint>>;

    fn deref(&self) -> &Self::Target {
        &self.by_address
    }
}

pub struct State {
    instance: Arc<str>,
    pub(super) seq: u64,
    pub(super) services: BTreeMap<ServiceKey, Entry>,
    /// Which service holds each VIP.
    pub(super) vips: HashMap<IpAddr, ServiceKey>,
    pub(super) endpoint_count: usize,
    /// Projected configuration records by kind and key.
    pub(super) configs: ConfigRecords,
    /// The Kubernetes Services' attributes as the cluster last gave them (see
    /// `Catalog::set_service_attributes`): not published, but a service created from
    /// now on starts with its own.
    pub(super) kubernetes: BTreeMap<ServiceKey, KubernetesService>,
    history: VecDeque<Arc<Batch>>,
    history_changes: usize,
    history_limit: usize,
    events: broadcast::Sender<Arc<Batch>>,
}

impl State {
    /// A state at version 0 of a fresh instance, holding what was loaded.
    pub(super) fn new(
        services: BTreeMap<ServiceKey, Entry>,
        vips: HashMap<IpAddr, ServiceKey>,
        endpoint_count: usize,
        configs: ConfigRecords,
        history_limit: usize,
        watch_buffer: usize,
    ) -> State {
        let (events, _) = broadcast::channel(watch_buffer.max(1));
        State {
            instance: uuid::Uuid::new_v4().simple().to_string().into(),
            seq: 0,
            services,
            vips,
            endpoint_count,
            configs,
            kubernetes: BTreeMap::new(),
            history: VecDeque::new(),
            history_changes: 0,
            history_limit,
            events,
        }
    }

    pub fn version(&self) -> Version {
        Version {
            instance: self.instance.to_string(),
            seq: self.seq,
        }
    }

    pub fn instance(&self) -> &str {
        &self.instance
    }

    pub fn seq(&self) -> u64 {
        self.seq
    }

    /// A receiver of every batch published after this call.
    pub fn subscribe(&self) -> broadcast::Receiver<Arc<Batch>> {
        self.events.subscribe()
    }

    /// The batches after `seq`, if the history still holds all of them.
    pub fn history_after(&self, seq: u64) -> Option<Vec<Arc<Batch>>> {
        if seq > self.seq {
            return None;
        }
        if seq == self.seq {
            return Some(Vec::new());
        }
        let oldest = self.history.front()?.seq;
        if oldest > seq + 1 {
            return None;
        }
        Some(self.history.iter().filter(|b| b.seq > seq).cloned().collect())
    }

    pub fn services(&self) -> impl Iterator<Item = (&ServiceKey, &Entry)> {
        self.services.iter()
    }

    pub fn service(&self, key: &str) -> Option<&Entry> {
        self.services.get(key)
    }

    /// The configuration records of every kind.
    pub fn configs(&self) -> &ConfigRecords {
        &self.configs
    }

    /// The configuration records of `T`'s kind.
    pub fn records<T: Record>(&self) -> impl Iterator<Item = &Arc<T>> {
        self.configs.typed()
    }

    pub(super) fn apply(&mut self, plan: Plan) -> u64 {
        let now = Instant::now();
        for (key, service) in plan.new_services {
            let vip = service.vip.parse().expect("planned VIPs are valid addresses");
            self.vips.insert(vip, key.clone());
            self.services.insert(
                key,
                Entry {
                    service,
                    endpoints: Endpoints::default(),
                    empty_since: None,
                },
            );
        }
        let mut touched = HashSet::new();
        for ((key, address), value) in plan.endpoints {
            let entry = self.services.get_mut(&key).expect("planned against this state");
            let had = match value {
                Some(endpoint) => entry.endpoints.insert(address, endpoint).is_some(),
                None => entry.endpoints.remove(&address).is_some(),
            };
            let has = entry.endpoints.contains_key(&address);
            self.endpoint_count = self.endpoint_count + usize::from(has) - usize::from(had);
            touched.insert(key);
        }
        for key in touched {
            if let Some(entry) = self.services.get_mut(&key) {
                entry.empty_since = match (entry.endpoints.is_empty(), entry.empty_since) {
                    (false, _) => None,
                    (true, since) => since.or(Some(now)),
                };
            }
        }
        for (key, service) in plan.updated_services {
            if let Some(entry) = self.services.get_mut(&key) {
                entry.service = service;
            }
        }
        for (key, vip) in plan.removed_services {
            self.services.remove(&key);
            self.vips.remove(&vip);
        }
        for (kind, key, record) in plan.configs {
            self.configs.set(kind, key, record);
        }
        self.publish(plan.changes)
    }

    /// Puts a service as another replica stored it.
    pub(super) fn put_service(
        &mut self,
        key: ServiceKey,
        vip: IpAddr,
        service: Service,
        now: Instant,
        out: &mut Vec<KeyedChange>,
    ) {
        if let Some(owner) = self.vips.get(&vip)
            && *owner != key
        {
            tracing::warn!(%vip, service = %key, previous = %owner, "the store gave a VIP this replica held for another service to this one");
        }
        match self.services.get_mut(&key) {
            Some(entry) if entry.service == service => return,
            Some(entry) => {
                if let Ok(old) = entry.service.vip.parse::<IpAddr>()
                    && self.vips.get(&old) == Some(&key)
                {
                    self.vips.remove(&old);
                }
                entry.service = service.clone();
            }
            None => {
                self.services.insert(
                    key.clone(),
                    Entry {
                        service: service.clone(),
                        endpoints: Endpoints::default(),
                        empty_since: Some(now),
                    },
                );
            }
        }
        self.vips.insert(vip, key.clone());
        out.push(KeyedChange {
            service: key,
            event: Event::ServiceAdded(service),
        });
    }

    pub(super) fn remove_service(&mut self, key: &ServiceKey, out: &mut Vec<KeyedChange>) {
        let Some(entry) = self.services.remove(key) else { return };
        self.endpoint_count -= entry.endpoints.len();
        if let Ok(vip) = entry.service.vip.parse::<IpAddr>()
            && self.vips.get(&vip) == Some(key)
        {
            self.vips.remove(&vip);
        }
        out.push(KeyedChange {
            service: key.clone(),
            event: Event::ServiceRemoved,
        });
    }

    /// Puts an endpoint of a service this replica holds.
    pub(super) fn put_endpoint(&mut self, valid: ValidEndpoint, out: &mut Vec<KeyedChange>) {
        let Some(entry) = self.services.get_mut(&valid.service) else {
            return;
        };
        let endpoint = Arc::new(valid.endpoint);
        let event = match entry.endpoints.insert(valid.address, endpoint.clone()) {
            Some(old) if *old == *endpoint => return,
            Some(_) => Event::EndpointUpdated(endpoint),
            None => {
                self.endpoint_count += 1;
                Event::EndpointAdded(endpoint)
            }
        };
        entry.empty_since = None;
        out.push(KeyedChange {
            service: valid.service,
            event,
        });
    }

    pub(super) fn remove_endpoint(
        &mut self,
        key: &ServiceKey,
        address: IpAddr,
        now: Instant,
        out: &mut Vec<KeyedChange>,
    ) {
        let Some(entry) = self.services.get_mut(key) else {
            return;
        };
        if entry.endpoints.remove(&address).is_none() {
            return;
        }
        self.endpoint_count -= 1;
        if entry.endpoints.is_empty() {
            entry.empty_since = Some(now);
        }
        out.push(KeyedChange {
            service: key.clone(),
            event: Event::EndpointRemoved(address),
        });
    }

    /// Puts (`Some`) or deletes a configuration record as another replica stored it.
    pub(super) fn put_config(
        &mut self,
        kind: ConfigKind,
        key: String,
        record: Option<ConfigRecord>,
        out: &mut Vec<KeyedChange>,
    ) {
        let old = self.configs.of(kind).get(&key).cloned();
        if old == record {
            return;
        }
        out.push(config_changed(kind, &key, old, record.clone()));
        self.configs.set(kind, key, record);
    }

    /// Exports the catalog's version and size.
    pub(super) fn report(&self, metrics: &Metrics) {
        metrics.catalog_version.set(self.seq as i64);
        metrics.services.set(self.services.len() as i64);
        metrics.endpoints.set(self.endpoint_count as i64);
        for kind in ConfigKind::ALL {
            metrics.records(kind).set(self.configs.of(kind).len() as i64);
        }
    }

    pub(super) fn publish(&mut self, changes: Vec<KeyedChange>) -> u64 {
        self.seq += 1;
        let batch = Arc::new(Batch { seq: self.seq, changes });
        self.history_changes += batch.changes.len();
        self.history.push_back(batch.clone());
        while self.history_changes > self.history_limit && self.history.len() > 1 {
            let dropped = self.history.pop_front().expect("history is not empty");
            self.history_changes -= dropped.changes.len();
        }
        // No receivers is fine: nobody is watching.
        let _ = self.events.send(batch);
        self.seq
    }
}

/// The change that publishes the record `key` of `kind` going from `old` to `new`.
pub(super) fn config_changed(
    kind: ConfigKind,
    key: &str,
    old: Option<ConfigRecord>,
    new: Option<ConfigRecord>,
) -> KeyedChange {
    KeyedChange {
        service: ServiceKey::of_config(key),
        event: Event::Config(ConfigChange { kind, old, new }),
    }
}
