//! The in-memory state: every service with its VIP and endpoints, the catalog
//! version, the history of recent batches and the broadcast that feeds watchers.
//! Only the writer changes it (under the write lock); everyone else reads.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Instant;

use aether_proto::registrar::v1::{Change, EndpointRef, Version, change};
use aether_proto::registry::v1::{AuthorizationPolicy, Endpoint, KubernetesService, Route, Service};
use tokio::sync::broadcast;

use super::plan::Plan;
use crate::metrics::Metrics;
use crate::model::{ServiceKey, ValidEndpoint};

/// A committed group of changes, as published to watchers.
#[derive(Debug)]
pub struct Batch {
    pub seq: u64,
    pub changes: Vec<KeyedChange>,
}

/// A committed change to one service. Endpoint data is shared with the catalog and
/// the history (not copied), and turned into its wire form only when sent. A route
/// change is published once per parent it had or has, so filtering by service finds
/// every watcher that holds or now wants it (watchers send it once per batch). A
/// policy change is published once, under the policy's own key (`<ns>/<name>`, the
/// same shape): watchers select it by namespace, not by service.
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
    /// A route was put (`Some`) or deleted (`None`).
    Route {
        key: Arc<str>,
        route: Option<Arc<Route>>,
    },
    /// A policy went from `old` to `new` (`None`: absent). Both are carried so a
    /// watcher that held the old version learns it is gone for it.
    Policy {
        old: Option<Arc<AuthorizationPolicy>>,
        new: Option<Arc<AuthorizationPolicy>>,
    },
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
            Event::Route { key, route } => route_change(key, route.as_deref()),
            Event::Policy { new, .. } => policy_change(self.service.as_str(), new.as_deref()),
        };
        Change { change: Some(change) }
    }
}

/// A route put, or its removal when `route` is `None`.
pub fn route_change(key: &str, route: Option<&Route>) -> change::Change {
    match route {
        Some(route) => change::Change::RoutePut(route.clone()),
        None => change::Change::RouteRemoved(key.to_owned()),
    }
}

/// A policy put, or its removal when `policy` is `None`.
pub fn policy_change(key: &str, policy: Option<&AuthorizationPolicy>) -> change::Change {
    match policy {
        Some(policy) => change::Change::PolicyPut(policy.clone()),
        None => change::Change::PolicyRemoved(key.to_owned()),
    }
}

#[derive(Clone, Debug)]
pub struct Entry {
    pub service: Service,
    pub endpoints: BTreeMap<IpAddr, Arc<Endpoint>>,
    pub(super) empty_since: Option<Instant>,
}

pub struct State {
    instance: Arc<str>,
    pub(super) seq: u64,
    pub(super) services: BTreeMap<ServiceKey, Entry>,
    /// Which service holds each VIP.
    pub(super) vips: HashMap<IpAddr, ServiceKey>,
    pub(super) endpoint_count: usize,
    /// Projected routes by key (`<kind>/<namespace>/<name>`).
    pub(super) routes: BTreeMap<String, Arc<Route>>,
    /// Projected authorization policies by key (`<namespace>/<name>`).
    pub(super) policies: BTreeMap<String, Arc<AuthorizationPolicy>>,
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
        records: ConfigRecords,
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
            routes: records.routes,
            policies: records.policies,
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

    pub fn routes(&self) -> impl Iterator<Item = &Arc<Route>> {
        self.routes.values()
    }

    pub fn policies(&self) -> impl Iterator<Item = &Arc<AuthorizationPolicy>> {
        self.policies.values()
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
                    endpoints: BTreeMap::new(),
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
        for (key, route) in plan.routes {
            match route {
                Some(route) => self.routes.insert(key, route),
                None => self.routes.remove(&key),
            };
        }
        for (key, policy) in plan.policies {
            match policy {
                Some(policy) => self.policies.insert(key, policy),
                None => self.policies.remove(&key),
            };
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
                        endpoints: BTreeMap::new(),
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

    /// Puts (`Some`) or deletes a route as another replica stored it.
    pub(super) fn put_route(&mut self, key: String, route: Option<Arc<Route>>, out: &mut Vec<KeyedChange>) {
        let old = self.routes.get(&key).cloned();
        if old == route {
            return;
        }
        out.extend(route_changes(&key, old.as_deref(), route.clone()));
        match route {
            Some(route) => self.routes.insert(key, route),
            None => self.routes.remove(&key),
        };
    }

    /// Puts (`Some`) or deletes a policy as another replica stored it.
    pub(super) fn put_policy(
        &mut self,
        key: String,
        policy: Option<Arc<AuthorizationPolicy>>,
        out: &mut Vec<KeyedChange>,
    ) {
        let old = self.policies.get(&key).cloned();
        if old == policy {
            return;
        }
        out.push(policy_changes(&key, old, policy.clone()));
        match policy {
            Some(policy) => self.policies.insert(key, policy),
            None => self.policies.remove(&key),
        };
    }

    /// Exports the catalog's version and size.
    pub(super) fn report(&self, metrics: &Metrics) {
        metrics.catalog_version.set(self.seq as i64);
        metrics.services.set(self.services.len() as i64);
        metrics.endpoints.set(self.endpoint_count as i64);
        metrics.routes.set(self.routes.len() as i64);
        metrics.policies.set(self.policies.len() as i64);
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

/// The changes that publish a route going from `old` to `new`: one per parent of
/// either (see [`KeyedChange`]).
pub(super) fn route_changes(key: &str, old: Option<&Route>, new: Option<Arc<Route>>) -> Vec<KeyedChange> {
    let key: Arc<str> = key.into();
    let mut parents: Vec<ServiceKey> = old
        .into_iter()
        .chain(new.as_deref())
        .flat_map(|route| &route.parents)
        .filter_map(|parent| ServiceKey::parse("parent", &parent.service).ok())
        .collect();
    parents.sort();
    parents.dedup();
    parents
        .into_iter()
        .map(|service| KeyedChange {
            service,
            event: Event::Route {
                key: key.clone(),
                route: new.clone(),
            },
        })
        .collect()
}

/// The change that publishes a policy going from `old` to `new`.
pub(super) fn policy_changes(
    key: &str,
    old: Option<Arc<AuthorizationPolicy>>,
    new: Option<Arc<AuthorizationPolicy>>,
) -> KeyedChange {
    KeyedChange {
        service: ServiceKey::of_policy(key),
        event: Event::Policy { old, new },
    }
}

/// The configuration records a catalog starts with (routes and policies, by key).
#[derive(Debug, Default)]
pub(super) struct ConfigRecords {
    pub(super) routes: BTreeMap<String, Arc<Route>>,
    pub(super) policies: BTreeMap<String, Arc<AuthorizationPolicy>>,
}
