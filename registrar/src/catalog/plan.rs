//! Planning: the effect of a group of writes, computed against the state without
//! changing it, as store ops to commit and changes to publish once committed.

use std::collections::{HashMap, HashSet};
use std::net::IpAddr;
use std::sync::Arc;

use std::collections::BTreeMap;

use aether_proto::registry::v1::{Endpoint, External, KubernetesService, Service};
use tonic::Status;

use super::state::{Event, KeyedChange, State, config_changed};
use crate::model::{ServiceKey, ValidEndpoint};
use crate::records::{ConfigKind, ConfigRecord};
use crate::store::StoreOp;
use crate::vip::VipAllocator;

/// The effect of a group of writes, computed against the state before it.
#[derive(Default)]
pub(super) struct Plan {
    pub(super) new_services: HashMap<ServiceKey, Service>,
    pub(super) new_vips: HashSet<IpAddr>,
    pub(super) endpoints: HashMap<(ServiceKey, IpAddr), Option<Arc<Endpoint>>>,
    pub(super) removed_services: Vec<(ServiceKey, IpAddr)>,
    /// Existing services whose record is replaced (same key and VIP).
    pub(super) updated_services: Vec<(ServiceKey, Service)>,
    /// Configuration records to put (`Some`) or delete, by kind and key.
    pub(super) configs: Vec<(ConfigKind, String, Option<ConfigRecord>)>,
    pub(super) ops: Vec<StoreOp>,
    pub(super) changes: Vec<KeyedChange>,
}

impl Plan {
    fn service(&self, state: &State, key: &ServiceKey) -> Option<Service> {
        self.new_services
            .get(key)
            .or_else(|| state.services.get(key).map(|e| &e.service))
            .cloned()
    }

    fn endpoint<'a>(&'a self, state: &'a State, key: &ServiceKey, address: IpAddr) -> Option<&'a Endpoint> {
        match self.endpoints.get(&(key.clone(), address)) {
            Some(staged) => staged.as_deref(),
            None => state
                .services
                .get(key)
                .and_then(|e| e.endpoints.get(&address))
                .map(|e| &**e),
        }
    }

    pub(super) fn change(&mut self, service: &ServiceKey, event: Event) {
        self.changes.push(KeyedChange {
            service: service.clone(),
            event,
        });
    }

    pub(super) fn register(
        &mut self,
        state: &State,
        vips: &VipAllocator,
        valid: ValidEndpoint,
        owner: Option<&str>,
    ) -> Result<Service, Status> {
        let key = valid.service;
        if let Some(old) = self.endpoint(state, &key, valid.address) {
            check_owner(old, owner)?;
        }
        let service = match self.service(state, &key) {
            Some(service) if service.external.is_some() => {
                return Err(Status::failed_precondition(format!(
                    "{key} is an ExternalService: pods cannot register endpoints in it (give the pods' service another name)"
                )));
            }
            Some(service) => service,
            None => {
                let vip = vips
                    .allocate(&key, |ip| state.vips.contains_key(&ip) || self.new_vips.contains(&ip))
                    .map_err(|e| Status::resource_exhausted(format!("allocating a VIP for {key}: {e}")))?;
                let service = Service {
                    namespace: key.namespace().to_owned(),
                    name: key.name().to_owned(),
                    vip: vip.to_string(),
                    kubernetes: state.kubernetes.get(&key).cloned(),
                    external: None,
                };
                self.new_vips.insert(vip);
                self.new_services.insert(key.clone(), service.clone());
                self.ops.push(StoreOp::CreateService(service.clone()));
                self.change(&key, Event::ServiceAdded(service.clone()));
                service
            }
        };
        let endpoint = Arc::new(valid.endpoint);
        let event = match self.endpoint(state, &key, valid.address) {
            Some(old) if *old == *endpoint => return Ok(service),
            Some(_) => Event::EndpointUpdated(endpoint.clone()),
            None => Event::EndpointAdded(endpoint.clone()),
        };
        self.ops.push(StoreOp::PutEndpoint(endpoint.clone()));
        self.change(&key, event);
        self.endpoints.insert((key, valid.address), Some(endpoint));
        Ok(service)
    }

    pub(super) fn unregister(
        &mut self,
        state: &State,
        key: ServiceKey,
        address: IpAddr,
        owner: Option<&str>,
    ) -> Result<bool, Status> {
        let Some(old) = self.endpoint(state, &key, address) else {
            return Ok(false);
        };
        check_owner(old, owner)?;
        self.ops.push(StoreOp::DeleteEndpoint {
            service: key.clone(),
            address: address.to_string(),
        });
        self.change(&key, Event::EndpointRemoved(address));
        self.endpoints.insert((key, address), None);
        Ok(true)
    }
}

impl Plan {
    /// Makes the stored records of `kind` exactly `desired` (a source's whole set of
    /// them): puts what is new or changed, deletes what the source no longer has.
    pub(super) fn set_configs(&mut self, state: &State, kind: ConfigKind, desired: BTreeMap<String, ConfigRecord>) {
        let held = state.configs.of(kind);
        for (key, old) in held {
            if !desired.contains_key(key) {
                self.ops.push(StoreOp::DeleteConfig(kind, key.clone()));
                self.changes.push(config_changed(kind, key, Some(old.clone()), None));
                self.configs.push((kind, key.clone(), None));
            }
        }
        for (key, record) in desired {
            let old = held.get(&key);
            if old == Some(&record) {
                continue;
            }
            self.ops.push(StoreOp::PutConfig(record.clone()));
            self.changes
                .push(config_changed(kind, &key, old.cloned(), Some(record.clone())));
            self.configs.push((kind, key, Some(record)));
        }
    }
}

impl Plan {
    /// Gives every service the attributes of its Kubernetes Service in `desired`
    /// (none without one): updates the services whose record differs, and nothing else.
    pub(super) fn set_service_attributes(&mut self, state: &State, desired: &BTreeMap<ServiceKey, KubernetesService>) {
        for (key, entry) in &state.services {
            if entry.service.external.is_some() {
                continue;
            }
            let kubernetes = desired.get(key);
            if entry.service.kubernetes.as_ref() == kubernetes {
                continue;
            }
            let service = Service {
                kubernetes: kubernetes.cloned(),
                ..entry.service.clone()
            };
            self.ops.push(StoreOp::UpdateService(service.clone()));
            self.change(key, Event::ServiceAdded(service.clone()));
            self.updated_services.push((key.clone(), service));
        }
    }
}

impl Plan {
    /// Removes `service` (stored under `key`) with its VIP and endpoints.
    pub(super) fn remove_service(&mut self, key: &ServiceKey, service: &Service) {
        let vip: IpAddr = service.vip.parse().expect("catalog VIPs are valid addresses");
        self.ops.push(StoreOp::DeleteService {
            key: key.clone(),
            vip: service.vip.clone(),
        });
        self.change(key, Event::ServiceRemoved);
        self.removed_services.push((key.clone(), vip));
    }

    /// Makes the external services exactly `desired` (the sources' whole set): creates
    /// the new ones with a VIP, updates the changed ones, removes those no longer
    /// declared. A key a mesh service already holds is not taken: it is returned, with
    /// why, for the source to report.
    pub(super) fn set_external_services(
        &mut self,
        state: &State,
        vips: &VipAllocator,
        desired: &BTreeMap<ServiceKey, External>,
    ) -> Vec<(ServiceKey, String)> {
        for (key, entry) in &state.services {
            if entry.service.external.is_some() && !desired.contains_key(key) {
                self.remove_service(key, &entry.service);
            }
        }
        let mut refused = Vec::new();
        for (key, external) in desired {
            match state.services.get(key) {
                Some(entry) if entry.service.external.is_none() => refused.push((
                    key.clone(),
                    format!(
                        "{key} is a mesh service (its pods register it): an ExternalService needs a name of its own"
                    ),
                )),
                Some(entry) if entry.service.external.as_deref() == Some(external) => {}
                Some(entry) => {
                    let service = Service {
                        external: Some(Box::new(external.clone())),
                        ..entry.service.clone()
                    };
                    self.ops.push(StoreOp::UpdateService(service.clone()));
                    self.change(key, Event::ServiceAdded(service.clone()));
                    self.updated_services.push((key.clone(), service));
                }
                None => {
                    let taken = |ip| state.vips.contains_key(&ip) || self.new_vips.contains(&ip);
                    let vip = match vips.allocate(key, taken) {
                        Ok(vip) => vip,
                        Err(error) => {
                            refused.push((key.clone(), format!("allocating a VIP: {error}")));
                            continue;
                        }
                    };
                    let service = Service {
                        namespace: key.namespace().to_owned(),
                        name: key.name().to_owned(),
                        vip: vip.to_string(),
                        kubernetes: None,
                        external: Some(Box::new(external.clone())),
                    };
                    self.new_vips.insert(vip);
                    self.new_services.insert(key.clone(), service.clone());
                    self.ops.push(StoreOp::CreateService(service.clone()));
                    self.change(key, Event::ServiceAdded(service));
                }
            }
        }
        refused
    }
}

/// An agent (`owner`, its authenticated node) may change only endpoints of its node.
/// An endpoint registered without a node (by an `--insecure` client) has no owner.
fn check_owner(existing: &Endpoint, owner: Option<&str>) -> Result<(), Status> {
    match owner {
        Some(owner) if !existing.node.is_empty() && existing.node != owner => Err(Status::permission_denied(format!(
            "rule own-node: the endpoint {} of {} belongs to node {:?}; the agent of node {owner:?} may not change it",
            existing.address, existing.service, existing.node
        ))),
        _ => Ok(()),
    }
}
