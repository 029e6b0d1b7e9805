//! Loading the catalog from a store snapshot at startup. Records that fail
//! validation are logged, counted and left in the store untouched; the rest is
//! served.

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Instant;

use aether_common::quote::quote;
use aether_proto::registry::v1::{Endpoint, Service};

use super::revisions::RecordKey;
use super::state::Entry;
use crate::metrics::Metrics;
use crate::model::{InvalidField, ServiceKey, parse_address, validate_endpoint};
use crate::records::{ConfigRecord, ConfigRecords};
use crate::store::{Contents, Revision, Stored, UnreadableRecord};
use crate::vip::VipAllocator;

/// What a snapshot held that is usable, with the revision of each record.
/// Why a stored service is skipped at load.
#[derive(Debug, thiserror::Error)]
enum UnreadableService {
    #[error(transparent)]
    Invalid(#[from] InvalidField),
    #[error("VIP {vip} is also held by {owner}")]
    VipTaken { vip: IpAddr, owner: ServiceKey },
}

#[derive(Default)]
pub(super) struct Loaded {
    pub(super) services: BTreeMap<ServiceKey, Entry>,
    pub(super) vips: HashMap<IpAddr, ServiceKey>,
    pub(super) endpoint_count: usize,
    pub(super) configs: ConfigRecords,
    pub(super) revs: HashMap<RecordKey, Revision>,
    pub(super) unreadable: Vec<UnreadableRecord>,
}

impl Loaded {
    /// Takes the usable records of `contents`; a stored VIP outside `range` is kept.
    pub(super) fn from_contents(contents: Contents, range: &VipAllocator) -> Loaded {
        let mut loaded = Loaded {
            unreadable: contents.unreadable,
            ..Loaded::default()
        };
        let now = Instant::now();
        for stored in contents.services {
            loaded.add_service(stored, range, now);
        }
        for stored in contents.endpoints {
            loaded.add_endpoint(stored);
        }
        for stored in contents.configs {
            loaded.add_config(stored);
        }
        loaded
    }

    fn add_service(&mut self, stored: Stored<Service>, range: &VipAllocator, now: Instant) {
        let service = stored.value;
        let (key, vip) = match self.check_service(&service) {
            Ok(checked) => checked,
            Err(error) => {
                let record = format!("services/{}/{}", service.namespace, service.name);
                let reason = error.to_string();
                self.unreadable.push(UnreadableRecord { key: record, reason });
                return;
            }
        };
        if !range.contains(vip) {
            tracing::warn!(service = %key, %vip, range = %range.net(),
                "stored VIP is outside the configured range; keeping it so the service's address stays stable");
        }
        self.vips.insert(vip, key.clone());
        self.revs.insert(RecordKey::Service(key.clone()), stored.revision);
        self.services.insert(
            key,
            Entry {
                service,
                endpoints: Default::default(),
                empty_since: Some(now),
            },
        );
    }

    /// The key and VIP of a stored service, if it is valid and its VIP is not taken.
    fn check_service(&self, service: &Service) -> Result<(ServiceKey, IpAddr), UnreadableService> {
        let key = ServiceKey::from_parts("service", &service.namespace, &service.name)?;
        let vip = parse_address("vip", &service.vip)?;
        if let Some(external) = &service.external {
            aether_api::external_service::validate(external)
                .map_err(|r| InvalidField::new(format!("external.{}", r.field), r.message))?;
        }
        match self.vips.get(&vip) {
            Some(owner) => Err(UnreadableService::VipTaken {
                vip,
                owner: owner.clone(),
            }),
            None => Ok((key, vip)),
        }
    }

    fn add_endpoint(&mut self, stored: Stored<Endpoint>) {
        let endpoint = stored.value;
        let record = format!("endpoints/{}/{}", endpoint.service, endpoint.address);
        let valid = match validate_endpoint("endpoint", Some(endpoint)) {
            Ok(valid) => valid,
            Err(e) => {
                let reason = e.to_string();
                self.unreadable.push(UnreadableRecord { key: record, reason });
                return;
            }
        };
        let Some(entry) = self.services.get_mut(&valid.service) else {
            let reason = format!("its service {} is not in the store", valid.service);
            self.unreadable.push(UnreadableRecord { key: record, reason });
            return;
        };
        entry.empty_since = None;
        self.revs.insert(
            RecordKey::Endpoint(valid.service.clone(), valid.address),
            stored.revision,
        );
        entry.endpoints.insert(valid.address, Arc::new(valid.endpoint));
        self.endpoint_count += 1;
    }

    fn add_config(&mut self, stored: Stored<ConfigRecord>) {
        let record = stored.value;
        let (kind, key) = (record.kind(), record.key());
        match record.validate() {
            Ok(()) => {
                self.revs.insert(RecordKey::Config(kind, key.clone()), stored.revision);
                self.configs.set(kind, key, Some(record));
            }
            Err(reason) => self.unreadable.push(UnreadableRecord {
                key: format!("{}/{key}", kind.plural()),
                reason,
            }),
        }
    }

    /// Logs the records that were skipped and exports what was loaded.
    pub(super) fn report(&self, metrics: &Metrics) {
        for record in &self.unreadable {
            tracing::error!(record = %quote(&record.key), reason = %record.reason,
                "skipping an unusable store record (left in the store untouched)");
        }
        metrics.store_unreadable_records.set(self.unreadable.len() as i64);
        metrics.services.set(self.services.len() as i64);
        metrics.endpoints.set(self.endpoint_count as i64);
        metrics.store_up.set(1);
    }
}
