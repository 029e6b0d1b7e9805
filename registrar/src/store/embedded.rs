//! The default store: a redb file under the data dir. One registrar process owns it
//! (redb locks the file), and every commit is fsynced before it returns.
//!
//! Tables (values are protobuf):
//! - `services`: `<ns>/<name>` → `aether.registry.v1.Service`
//! - `vips`: VIP text → service key (the uniqueness index for VIPs)
//! - `endpoints`: `<ns>/<name>/<address>` → `aether.registry.v1.Endpoint`
//! - one table per configuration record kind, named by its plural (`routes`,
//!   `policies`): its key → the record (`aether.registry.v1.Route`, …)
//! - `meta`: `schema` → format version, `revision` → revision of the last commit
//!
//! No other replica writes here, so the feed is empty; node liveness (for the
//! endpoint TTL) is kept in memory, and every node found at start-up counts as
//! refreshed then, so a registrar that was down does not expire the whole catalog.

use parking_lot::Mutex;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use aether_proto::registry::v1::{Endpoint, Service};
use async_trait::async_trait;
use prost::Message;
use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};

use super::{
    Conflict, Contents, Feed, Revision, Store, StoreError, StoreOp, StoreSettings, Stored, UnreadableRecord, no_feed,
    vip_change,
};
use crate::model::ServiceKey;
use crate::records::ConfigKind;

const SERVICES: TableDefinition<&str, &[u8]> = TableDefinition::new("services");
const VIPS: TableDefinition<&str, &str> = TableDefinition::new("vips");
const ENDPOINTS: TableDefinition<&str, &[u8]> = TableDefinition::new("endpoints");
const META: TableDefinition<&str, u64> = TableDefinition::new("meta");
const SCHEMA_VERSION: u64 = 1;

const CACHE_BYTES: usize = 8 * 1024 * 1024;

/// The catalog file's name inside `--data-dir`.
pub const FILE_NAME: &str = "catalog.redb";

pub struct EmbeddedStore {
    db: Arc<Database>,
    path: PathBuf,
    settings: StoreSettings,
    /// Last refresh of each node with endpoints.
    nodes: Mutex<HashMap<String, Instant>>,
}

impl EmbeddedStore {
    /// Opens (or creates) the catalog file in `data_dir`.
    pub fn open(data_dir: &Path, settings: StoreSettings) -> Result<Self, StoreError> {
        std::fs::create_dir_all(data_dir)
            .map_err(|e| StoreError::Unavailable(format!("creating data dir {}: {e}", data_dir.display())))?;
        let path = data_dir.join(FILE_NAME);
        let db =
            // The catalog lives in memory; the file is read once at start-up and then only
            // written, so a small page cache is enough.
            redb::Builder::new()
                .set_cache_size(CACHE_BYTES)
                .create(&path)
                .map_err(|e| StoreError::Unavailable(format!("opening {}: {e}", path.display())))?;
        let store = Self {
            db: Arc::new(db),
            path,
            settings,
            nodes: Mutex::new(HashMap::new()),
        };
        store.init_schema()?;
        Ok(store)
    }

    fn init_schema(&self) -> Result<(), StoreError> {
        let txn = self.db.begin_write().map_err(|e| self.unavailable(e))?;
        {
            let mut meta = txn.open_table(META).map_err(|e| self.unavailable(e))?;
            let found = meta.get("schema").map_err(|e| self.unavailable(e))?.map(|v| v.value());
            match found {
                None => {
                    meta.insert("schema", SCHEMA_VERSION).map_err(|e| self.unavailable(e))?;
                }
                Some(SCHEMA_VERSION) => {}
                Some(other) => {
                    return Err(StoreError::Corrupt(format!(
                        "{} has schema version {other}; this registrar reads version {SCHEMA_VERSION}",
                        self.path.display()
                    )));
                }
            }
            // Create the other tables so reads never meet a missing one.
            txn.open_table(SERVICES).map_err(|e| self.unavailable(e))?;
            txn.open_table(VIPS).map_err(|e| self.unavailable(e))?;
            txn.open_table(ENDPOINTS).map_err(|e| self.unavailable(e))?;
            for kind in ConfigKind::ALL {
                txn.open_table(config_table(kind)).map_err(|e| self.unavailable(e))?;
            }
        }
        txn.commit().map_err(|e| self.unavailable(e))
    }

    fn unavailable(&self, e: impl std::fmt::Display) -> StoreError {
        StoreError::Unavailable(format!("{}: {e}", self.path.display()))
    }
}

/// The table of the configuration records of `kind`.
fn config_table(kind: ConfigKind) -> TableDefinition<'static, &'static str, &'static [u8]> {
    TableDefinition::new(kind.plural())
}

fn endpoint_key(service: &str, address: &str) -> String {
    format!("{service}/{address}")
}

fn fail(e: &dyn std::fmt::Display) -> StoreError {
    StoreError::Unavailable(e.to_string())
}

/// Applies `ops` in one write transaction and bumps the revision; returns the new
/// revision. Dropping an uncommitted transaction aborts it, so an op that fails
/// leaves the store untouched.
fn write_ops(db: &Database, ops: &[StoreOp]) -> Result<Revision, StoreError> {
    let txn = db.begin_write().map_err(|e| fail(&e))?;
    let revision = {
        let mut tables = Tables::open(&txn)?;
        for op in ops {
            tables.apply(op)?;
        }
        tables.bump_revision()?
    };
    txn.commit().map_err(|e| fail(&e))?;
    Ok(revision)
}

/// The tables of one write transaction.
struct Tables<'txn> {
    services: redb::Table<'txn, &'static str, &'static [u8]>,
    vips: redb::Table<'txn, &'static str, &'static str>,
    endpoints: redb::Table<'txn, &'static str, &'static [u8]>,
    /// One per configuration record kind, at its index.
    configs: Vec<redb::Table<'txn, &'static str, &'static [u8]>>,
    meta: redb::Table<'txn, &'static str, u64>,
}

impl<'txn> Tables<'txn> {
    fn open(txn: &'txn redb::WriteTransaction) -> Result<Tables<'txn>, StoreError> {
        Ok(Tables {
            services: txn.open_table(SERVICES).map_err(|e| fail(&e))?,
            vips: txn.open_table(VIPS).map_err(|e| fail(&e))?,
            endpoints: txn.open_table(ENDPOINTS).map_err(|e| fail(&e))?,
            configs: (ConfigKind::ALL.iter())
                .map(|kind| txn.open_table(config_table(*kind)).map_err(|e| fail(&e)))
                .collect::<Result<_, _>>()?,
            meta: txn.open_table(META).map_err(|e| fail(&e))?,
        })
    }

    fn apply(&mut self, op: &StoreOp) -> Result<(), StoreError> {
        match op {
            StoreOp::CreateService(service) => self.create_service(service),
            StoreOp::UpdateService(service) => self.update_service(service),
            StoreOp::DeleteService { key, vip } => self.delete_service(key.as_str(), vip),
            StoreOp::PutEndpoint(endpoint) => self.put_endpoint(endpoint),
            StoreOp::DeleteEndpoint { service, address } => {
                let key = endpoint_key(service.as_str(), address);
                self.endpoints.remove(key.as_str()).map_err(|e| fail(&e))?;
                Ok(())
            }
            StoreOp::ForgetNode(_) => Ok(()),
            StoreOp::PutConfig(record) => {
                let table = &mut self.configs[record.kind().index()];
                let key = record.key();
                table
                    .insert(key.as_str(), record.encode().as_slice())
                    .map_err(|e| fail(&e))?;
                Ok(())
            }
            StoreOp::DeleteConfig(kind, key) => {
                self.configs[kind.index()].remove(key.as_str()).map_err(|e| fail(&e))?;
                Ok(())
            }
        }
    }

    fn stored_service(&self, key: &str) -> Result<Option<Service>, StoreError> {
        match self.services.get(key).map_err(|e| fail(&e))? {
            Some(v) => Service::decode(v.value())
                .map(Some)
                .map_err(|e| StoreError::Corrupt(format!("services/{key}: {e}"))),
            None => Ok(None),
        }
    }

    /// Creates a service and its VIP; a conflict if either is taken.
    fn create_service(&mut self, service: &Service) -> Result<(), StoreError> {
        let key = format!("{}/{}", service.namespace, service.name);
        if let Some(existing) = self.stored_service(&key)? {
            return Err(StoreError::Conflict(Conflict {
                existing: vec![existing],
                missing: vec![],
                detail: format!("service {key} already exists"),
            }));
        }
        let owner = self
            .vips
            .get(service.vip.as_str())
            .map_err(|e| fail(&e))?
            .map(|o| o.value().to_owned());
        if let Some(owner) = owner {
            let existing = self.stored_service(&owner)?;
            return Err(StoreError::Conflict(Conflict {
                existing: existing.into_iter().collect(),
                missing: vec![],
                detail: format!("VIP {} already belongs to {owner}", service.vip),
            }));
        }
        self.services
            .insert(key.as_str(), service.encode_to_vec().as_slice())
            .map_err(|e| fail(&e))?;
        self.vips
            .insert(service.vip.as_str(), key.as_str())
            .map_err(|e| fail(&e))?;
        Ok(())
    }

    /// Replaces an existing service's record; a conflict if it is gone, `Corrupt` if
    /// the update would move its VIP.
    fn update_service(&mut self, service: &Service) -> Result<(), StoreError> {
        let key = format!("{}/{}", service.namespace, service.name);
        let Some(stored) = self.stored_service(&key)? else {
            let missing = ServiceKey::parse("service", &key).map_err(|e| StoreError::Corrupt(e.to_string()))?;
            return Err(StoreError::Conflict(Conflict {
                existing: vec![],
                missing: vec![missing],
                detail: format!("service {key} is not in the store"),
            }));
        };
        if stored.vip != service.vip {
            return Err(vip_change(&key, &stored.vip, &service.vip));
        }
        self.services
            .insert(key.as_str(), service.encode_to_vec().as_slice())
            .map_err(|e| fail(&e))?;
        Ok(())
    }

    /// Deletes a service, its VIP and its endpoints.
    fn delete_service(&mut self, key: &str, vip: &str) -> Result<(), StoreError> {
        self.services.remove(key).map_err(|e| fail(&e))?;
        self.vips.remove(vip).map_err(|e| fail(&e))?;
        // Its endpoints: keys "<ns>/<name>/<address>"; '0' follows '/'.
        let start = format!("{key}/");
        let end = format!("{key}0");
        self.endpoints
            .retain_in(start.as_str()..end.as_str(), |_, _| false)
            .map_err(|e| fail(&e))?;
        Ok(())
    }

    /// Puts an endpoint; a conflict if its service is not in the store.
    fn put_endpoint(&mut self, endpoint: &Endpoint) -> Result<(), StoreError> {
        if self
            .services
            .get(endpoint.service.as_str())
            .map_err(|e| fail(&e))?
            .is_none()
        {
            let missing =
                ServiceKey::parse("service", &endpoint.service).map_err(|e| StoreError::Corrupt(e.to_string()))?;
            return Err(StoreError::Conflict(Conflict {
                existing: vec![],
                missing: vec![missing],
                detail: format!("service {} is not in the store", endpoint.service),
            }));
        }
        let key = endpoint_key(&endpoint.service, &endpoint.address);
        self.endpoints
            .insert(key.as_str(), endpoint.encode_to_vec().as_slice())
            .map_err(|e| fail(&e))?;
        Ok(())
    }

    fn bump_revision(&mut self) -> Result<Revision, StoreError> {
        let revision = self
            .meta
            .get("revision")
            .map_err(|e| fail(&e))?
            .map(|v| v.value())
            .unwrap_or(0)
            + 1;
        self.meta.insert("revision", revision).map_err(|e| fail(&e))?;
        Ok(revision)
    }
}

/// Every record of `table` decoded as a `T`; those that do not decode are reported
/// under `<what>/<key>`.
fn read_records<T: Message + Default>(
    txn: &redb::ReadTransaction,
    table: TableDefinition<&str, &[u8]>,
    what: &str,
    revision: Revision,
    unreadable: &mut Vec<UnreadableRecord>,
) -> Result<Vec<Stored<T>>, redb::Error> {
    let mut records = Vec::new();
    for row in txn.open_table(table)?.iter()? {
        let (key, value) = row?;
        match T::decode(value.value()) {
            Ok(value) => records.push(Stored { value, revision }),
            Err(e) => unreadable.push(UnreadableRecord {
                key: format!("{what}/{}", key.value()),
                reason: format!("does not decode as protobuf {}: {e}", short_type_name::<T>()),
            }),
        }
    }
    Ok(records)
}

/// Every configuration record of `kind`; those that do not decode are reported under
/// `<plural>/<key>`.
fn read_configs(
    txn: &redb::ReadTransaction,
    kind: ConfigKind,
    revision: Revision,
    contents: &mut Contents,
) -> Result<(), redb::Error> {
    for row in txn.open_table(config_table(kind))?.iter()? {
        let (key, value) = row?;
        match kind.decode(value.value()) {
            Ok(value) => contents.configs.push(Stored { value, revision }),
            Err(reason) => contents.unreadable.push(UnreadableRecord {
                key: format!("{}/{}", kind.plural(), key.value()),
                reason,
            }),
        }
    }
    Ok(())
}

/// `Service` for `aether_proto::registry::v1::Service`.
fn short_type_name<T>() -> &'static str {
    let name = std::any::type_name::<T>();
    name.rsplit("::").next().unwrap_or(name)
}

fn touch_nodes<'a>(nodes: &Mutex<HashMap<String, Instant>>, names: impl Iterator<Item = &'a str>) {
    let now = Instant::now();
    let mut nodes = nodes.lock();
    for name in names.filter(|n| !n.is_empty()) {
        nodes.insert(name.to_owned(), now);
    }
}

#[async_trait]
impl Store for EmbeddedStore {
    fn kind(&self) -> &'static str {
        "embedded"
    }

    async fn load(&self) -> Result<Contents, StoreError> {
        let db = self.db.clone();
        let path = self.path.clone();
        let read = move || -> Result<Contents, redb::Error> {
            let txn = db.begin_read()?;
            let mut contents = Contents::default();
            // One writer: every record is as new as the last commit.
            let revision = txn.open_table(META)?.get("revision")?.map(|v| v.value()).unwrap_or(0);
            contents.revision = revision;
            contents.services = read_records(&txn, SERVICES, "services", revision, &mut contents.unreadable)?;
            contents.endpoints = read_records(&txn, ENDPOINTS, "endpoints", revision, &mut contents.unreadable)?;
            for kind in ConfigKind::ALL {
                read_configs(&txn, kind, revision, &mut contents)?;
            }
            Ok(contents)
        };
        let contents = tokio::task::spawn_blocking(read)
            .await
            .map_err(|e| StoreError::Unavailable(format!("load task failed: {e}")))?
            .map_err(|e| StoreError::Unavailable(format!("reading {}: {e}", path.display())))?;
        touch_nodes(&self.nodes, contents.endpoints.iter().map(|e| e.value.node.as_str()));
        Ok(contents)
    }

    async fn commit(&self, ops: Vec<StoreOp>) -> Result<Revision, StoreError> {
        let db = self.db.clone();
        let live: Vec<String> = ops
            .iter()
            .filter_map(|op| match op {
                StoreOp::PutEndpoint(e) => Some(e.node.clone()),
                _ => None,
            })
            .collect();
        let forgotten: Vec<String> = ops
            .iter()
            .filter_map(|op| match op {
                StoreOp::ForgetNode(node) => Some(node.clone()),
                _ => None,
            })
            .collect();
        let revision = tokio::task::spawn_blocking(move || write_ops(&db, &ops))
            .await
            .map_err(|e| StoreError::Unavailable(format!("commit task failed: {e}")))??;
        touch_nodes(&self.nodes, live.iter().map(String::as_str));
        let mut nodes = self.nodes.lock();
        for node in forgotten {
            nodes.remove(&node);
        }
        Ok(revision)
    }

    fn feed(&self, _after: Revision) -> Feed {
        no_feed()
    }

    async fn refresh(&self, nodes: Vec<String>) -> Result<(), StoreError> {
        touch_nodes(&self.nodes, nodes.iter().map(String::as_str));
        Ok(())
    }

    async fn expired_nodes(&self) -> Result<Vec<String>, StoreError> {
        let ttl = self.settings.endpoint_ttl;
        let nodes = self.nodes.lock();
        Ok(nodes
            .iter()
            .filter(|(_, at)| at.elapsed() >= ttl)
            .map(|(node, _)| node.clone())
            .collect())
    }

    async fn ping(&self) -> Result<(), StoreError> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ServiceKey;
    use std::sync::Arc;

    fn settings() -> StoreSettings {
        StoreSettings {
            endpoint_ttl: std::time::Duration::from_secs(60),
        }
    }

    fn service(name: &str, vip: &str) -> Service {
        Service {
            namespace: "ns".into(),
            name: name.into(),
            vip: vip.into(),
            kubernetes: None,
            external: None,
        }
    }

    fn endpoint(service: &str, address: &str) -> Endpoint {
        Endpoint {
            service: service.into(),
            address: address.into(),
            ..Default::default()
        }
    }

    #[tokio::test]
    async fn commits_survive_reopening() {
        let dir = tempfile::tempdir().unwrap();
        {
            let store = EmbeddedStore::open(dir.path(), settings()).unwrap();
            store
                .commit(vec![
                    StoreOp::CreateService(service("a", "240.240.0.1")),
                    StoreOp::PutEndpoint(Arc::new(endpoint("ns/a", "10.0.0.1"))),
                    StoreOp::PutEndpoint(Arc::new(endpoint("ns/a", "10.0.0.2"))),
                ])
                .await
                .unwrap();
            store
                .commit(vec![StoreOp::DeleteEndpoint {
                    service: ServiceKey::parse("s", "ns/a").unwrap(),
                    address: "10.0.0.1".into(),
                }])
                .await
                .unwrap();
        }
        let store = EmbeddedStore::open(dir.path(), settings()).unwrap();
        let contents = store.load().await.unwrap();
        let services: Vec<_> = contents.services.into_iter().map(|s| s.value).collect();
        let endpoints: Vec<_> = contents.endpoints.into_iter().map(|e| e.value).collect();
        assert_eq!(services, vec![service("a", "240.240.0.1")]);
        assert_eq!(endpoints, vec![endpoint("ns/a", "10.0.0.2")]);
        assert_eq!(contents.revision, 2, "two commits");
        assert!(contents.unreadable.is_empty());
    }

    #[tokio::test]
    async fn a_conflicting_batch_changes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let store = EmbeddedStore::open(dir.path(), settings()).unwrap();
        store
            .commit(vec![StoreOp::CreateService(service("a", "240.240.0.1"))])
            .await
            .unwrap();
        let err = store
            .commit(vec![
                StoreOp::PutEndpoint(Arc::new(endpoint("ns/a", "10.0.0.9"))),
                StoreOp::CreateService(service("b", "240.240.0.1")),
            ])
            .await
            .unwrap_err();
        assert!(
            matches!(&err, StoreError::Conflict(c) if c.detail.contains("VIP 240.240.0.1 already belongs to ns/a")
                && c.existing == vec![service("a", "240.240.0.1")]),
            "{err}"
        );
        let err = store
            .commit(vec![StoreOp::CreateService(service("a", "240.240.0.7"))])
            .await
            .unwrap_err();
        assert!(
            matches!(&err, StoreError::Conflict(c) if c.detail.contains("service ns/a already exists")
                && c.existing == vec![service("a", "240.240.0.1")]),
            "{err}"
        );
        let contents = store.load().await.unwrap();
        assert!(
            contents.endpoints.is_empty(),
            "the aborted batch left an endpoint behind"
        );
        assert_eq!(contents.services.len(), 1);
    }

    #[tokio::test]
    async fn undecodable_records_are_reported_and_kept() {
        let dir = tempfile::tempdir().unwrap();
        let store = EmbeddedStore::open(dir.path(), settings()).unwrap();
        {
            let txn = store.db.begin_write().unwrap();
            txn.open_table(ENDPOINTS)
                .unwrap()
                .insert("ns/a/10.0.0.1", [0xff, 0xff, 0xff].as_slice())
                .unwrap();
            txn.commit().unwrap();
        }
        let contents = store.load().await.unwrap();
        assert_eq!(contents.unreadable.len(), 1);
        assert_eq!(contents.unreadable[0].key, "endpoints/ns/a/10.0.0.1");
        // Still there for an operator to inspect.
        let contents = store.load().await.unwrap();
        assert_eq!(contents.unreadable.len(), 1);
    }

    #[test]
    fn a_second_process_cannot_open_the_same_file() {
        let dir = tempfile::tempdir().unwrap();
        let _first = EmbeddedStore::open(dir.path(), settings()).unwrap();
        let second = EmbeddedStore::open(dir.path(), settings());
        assert!(second.is_err(), "two registrars shared one catalog file");
    }

    #[tokio::test]
    async fn an_endpoint_of_a_missing_service_is_a_conflict_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let store = EmbeddedStore::open(dir.path(), settings()).unwrap();
        let err = store
            .commit(vec![StoreOp::PutEndpoint(Arc::new(endpoint("ns/gone", "10.0.0.1")))])
            .await
            .unwrap_err();
        let StoreError::Conflict(conflict) = err else {
            panic!("{err}")
        };
        assert_eq!(conflict.missing, vec![ServiceKey::parse("s", "ns/gone").unwrap()]);
        assert!(store.load().await.unwrap().endpoints.is_empty());
    }

    #[tokio::test]
    async fn an_update_replaces_an_existing_service_and_never_creates_or_moves_one() {
        use aether_proto::registry::v1::{KubernetesService, TrafficDistribution};
        let dir = tempfile::tempdir().unwrap();
        let store = EmbeddedStore::open(dir.path(), settings()).unwrap();
        store
            .commit(vec![StoreOp::CreateService(service("a", "240.240.0.1"))])
            .await
            .unwrap();
        let mut updated = service("a", "240.240.0.1");
        updated.kubernetes = Some(KubernetesService {
            cluster_ips: vec!["10.96.0.10".into()],
            traffic_distribution: TrafficDistribution::PreferSameZone as i32,
            ports: Vec::new(),
        });
        let revision = store
            .commit(vec![StoreOp::UpdateService(updated.clone())])
            .await
            .unwrap();
        let contents = store.load().await.unwrap();
        let stored: Vec<_> = contents.services.iter().map(|s| (&s.value, s.revision)).collect();
        assert_eq!(stored, [(&updated, revision)]);

        let err = store
            .commit(vec![StoreOp::UpdateService(service("gone", "240.240.0.2"))])
            .await
            .unwrap_err();
        let StoreError::Conflict(conflict) = err else {
            panic!("{err}")
        };
        assert_eq!(conflict.missing, vec![ServiceKey::parse("s", "ns/gone").unwrap()]);

        let err = store
            .commit(vec![StoreOp::UpdateService(service("a", "240.240.0.9"))])
            .await
            .unwrap_err();
        assert!(
            matches!(&err, StoreError::Corrupt(m) if m.contains("240.240.0.9")),
            "{err}"
        );
        let contents = store.load().await.unwrap();
        assert_eq!(contents.services.len(), 1, "an update never creates a service");
        assert_eq!(contents.services[0].value, updated, "refused updates change nothing");
    }

    #[tokio::test]
    async fn deleting_a_service_deletes_its_endpoints_and_only_its() {
        let dir = tempfile::tempdir().unwrap();
        let store = EmbeddedStore::open(dir.path(), settings()).unwrap();
        store
            .commit(vec![
                StoreOp::CreateService(service("a", "240.240.0.1")),
                StoreOp::CreateService(service("ab", "240.240.0.2")),
                StoreOp::PutEndpoint(Arc::new(endpoint("ns/a", "10.0.0.1"))),
                StoreOp::PutEndpoint(Arc::new(endpoint("ns/ab", "10.0.0.2"))),
            ])
            .await
            .unwrap();
        let revision = store
            .commit(vec![StoreOp::DeleteService {
                key: ServiceKey::parse("s", "ns/a").unwrap(),
                vip: "240.240.0.1".into(),
            }])
            .await
            .unwrap();
        let contents = store.load().await.unwrap();
        assert_eq!(contents.revision, revision);
        let endpoints: Vec<_> = contents.endpoints.iter().map(|e| e.value.address.as_str()).collect();
        assert_eq!(endpoints, ["10.0.0.2"]);
        // The VIP is free again.
        store
            .commit(vec![StoreOp::CreateService(service("c", "240.240.0.1"))])
            .await
            .unwrap();
    }

    #[tokio::test]
    async fn nodes_expire_unless_refreshed_and_are_forgotten_on_request() {
        let dir = tempfile::tempdir().unwrap();
        let store = EmbeddedStore::open(
            dir.path(),
            StoreSettings {
                endpoint_ttl: std::time::Duration::from_millis(200),
            },
        )
        .unwrap();
        let mut a = endpoint("ns/a", "10.0.0.1");
        a.node = "n1".into();
        let mut b = endpoint("ns/a", "10.0.0.2");
        b.node = "n2".into();
        store
            .commit(vec![
                StoreOp::CreateService(service("a", "240.240.0.1")),
                StoreOp::PutEndpoint(Arc::new(a)),
                StoreOp::PutEndpoint(Arc::new(b)),
            ])
            .await
            .unwrap();
        assert!(store.expired_nodes().await.unwrap().is_empty());
        for _ in 0..4 {
            tokio::time::sleep(std::time::Duration::from_millis(80)).await;
            store.refresh(vec!["n1".into()]).await.unwrap();
        }
        assert_eq!(store.expired_nodes().await.unwrap(), ["n2"]);
        store.commit(vec![StoreOp::ForgetNode("n2".into())]).await.unwrap();
        assert!(store.expired_nodes().await.unwrap().is_empty());
    }
}
