//! The default store: a redb file under the data dir. One registrar process owns it
//! (redb locks the file), and every commit is fsynced before it returns.
//!
//! Tables (values are protobuf):
//! - `services`: `<ns>/<name>` → `aether.registry.v1.Service`
//! - `vips`: VIP text → service key (the uniqueness index for VIPs)
//! - `endpoints`: `<ns>/<name>/<address>` → `aether.registry.v1.Endpoint`
//! - `meta`: `schema` → format version

use std::path::{Path, PathBuf};
use std::sync::Arc;

use aether_proto::registry::v1::{Endpoint, Service};
use async_trait::async_trait;
use prost::Message;
use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};

use super::{Contents, Store, StoreError, StoreOp, UnreadableRecord};

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
}

impl EmbeddedStore {
    /// Opens (or creates) the catalog file in `data_dir`.
    pub fn open(data_dir: &Path) -> Result<Self, StoreError> {
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
        let store = Self { db: Arc::new(db), path };
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
        }
        txn.commit().map_err(|e| self.unavailable(e))
    }

    fn unavailable(&self, e: impl std::fmt::Display) -> StoreError {
        StoreError::Unavailable(format!("{}: {e}", self.path.display()))
    }
}

fn endpoint_key(service: &str, address: &str) -> String {
    format!("{service}/{address}")
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
            for row in txn.open_table(SERVICES)?.iter()? {
                let (key, value) = row?;
                match Service::decode(value.value()) {
                    Ok(service) => contents.services.push(service),
                    Err(e) => contents.unreadable.push(UnreadableRecord {
                        key: format!("services/{}", key.value()),
                        reason: format!("not a Service protobuf: {e}"),
                    }),
                }
            }
            for row in txn.open_table(ENDPOINTS)?.iter()? {
                let (key, value) = row?;
                match Endpoint::decode(value.value()) {
                    Ok(endpoint) => contents.endpoints.push(endpoint),
                    Err(e) => contents.unreadable.push(UnreadableRecord {
                        key: format!("endpoints/{}", key.value()),
                        reason: format!("not an Endpoint protobuf: {e}"),
                    }),
                }
            }
            Ok(contents)
        };
        tokio::task::spawn_blocking(read)
            .await
            .map_err(|e| StoreError::Unavailable(format!("load task failed: {e}")))?
            .map_err(|e| StoreError::Unavailable(format!("reading {}: {e}", path.display())))
    }

    async fn commit(&self, ops: Vec<StoreOp>) -> Result<(), StoreError> {
        let db = self.db.clone();
        let write = move || -> Result<(), StoreError> {
            let fail = |e: &dyn std::fmt::Display| StoreError::Unavailable(e.to_string());
            let txn = db.begin_write().map_err(|e| fail(&e))?;
            {
                let mut services = txn.open_table(SERVICES).map_err(|e| fail(&e))?;
                let mut vips = txn.open_table(VIPS).map_err(|e| fail(&e))?;
                let mut endpoints = txn.open_table(ENDPOINTS).map_err(|e| fail(&e))?;
                for op in &ops {
                    match op {
                        StoreOp::CreateService(service) => {
                            let key = format!("{}/{}", service.namespace, service.name);
                            if services.get(key.as_str()).map_err(|e| fail(&e))?.is_some() {
                                return Err(StoreError::Conflict(format!("service {key} already exists")));
                            }
                            if let Some(owner) = vips.get(service.vip.as_str()).map_err(|e| fail(&e))? {
                                return Err(StoreError::Conflict(format!(
                                    "VIP {} already belongs to {}",
                                    service.vip,
                                    owner.value()
                                )));
                            }
                            services
                                .insert(key.as_str(), service.encode_to_vec().as_slice())
                                .map_err(|e| fail(&e))?;
                            vips.insert(service.vip.as_str(), key.as_str()).map_err(|e| fail(&e))?;
                        }
                        StoreOp::DeleteService { key, vip } => {
                            services.remove(key.as_str()).map_err(|e| fail(&e))?;
                            vips.remove(vip.as_str()).map_err(|e| fail(&e))?;
                        }
                        StoreOp::PutEndpoint(endpoint) => {
                            let key = endpoint_key(&endpoint.service, &endpoint.address);
                            endpoints
                                .insert(key.as_str(), endpoint.encode_to_vec().as_slice())
                                .map_err(|e| fail(&e))?;
                        }
                        StoreOp::DeleteEndpoint { service, address } => {
                            let key = endpoint_key(service.as_str(), address);
                            endpoints.remove(key.as_str()).map_err(|e| fail(&e))?;
                        }
                    }
                }
            }
            // Dropping an uncommitted transaction aborts it, so an early return above
            // leaves the store untouched.
            txn.commit().map_err(|e| fail(&e))
        };
        tokio::task::spawn_blocking(write)
            .await
            .map_err(|e| StoreError::Unavailable(format!("commit task failed: {e}")))?
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ServiceKey;
    use std::sync::Arc;

    fn service(name: &str, vip: &str) -> Service {
        Service {
            namespace: "ns".into(),
            name: name.into(),
            vip: vip.into(),
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
            let store = EmbeddedStore::open(dir.path()).unwrap();
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
        let store = EmbeddedStore::open(dir.path()).unwrap();
        let contents = store.load().await.unwrap();
        assert_eq!(contents.services, vec![service("a", "240.240.0.1")]);
        assert_eq!(contents.endpoints, vec![endpoint("ns/a", "10.0.0.2")]);
        assert!(contents.unreadable.is_empty());
    }

    #[tokio::test]
    async fn a_conflicting_batch_changes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let store = EmbeddedStore::open(dir.path()).unwrap();
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
            matches!(&err, StoreError::Conflict(m) if m.contains("VIP 240.240.0.1 already belongs to ns/a")),
            "{err}"
        );
        let err = store
            .commit(vec![StoreOp::CreateService(service("a", "240.240.0.7"))])
            .await
            .unwrap_err();
        assert!(
            matches!(&err, StoreError::Conflict(m) if m.contains("service ns/a already exists")),
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
        let store = EmbeddedStore::open(dir.path()).unwrap();
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
        let _first = EmbeddedStore::open(dir.path()).unwrap();
        let second = EmbeddedStore::open(dir.path());
        assert!(second.is_err(), "two registrars shared one catalog file");
    }
}
