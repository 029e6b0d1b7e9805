//! The pods the CNI plugin added on this node, persisted under the state dir so an
//! agent restart knows every pod again without any CNI call.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use tokio::sync::watch;

use crate::pod::LocalPod;

const FILE: &str = "pods.json";

#[derive(Debug, thiserror::Error)]
pub enum PodStoreError {
    #[error("reading {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("{path} is not a pod store: {reason}")]
    Corrupt { path: PathBuf, reason: String },
    #[error("writing {path}: {source}")]
    Write { path: PathBuf, source: std::io::Error },
}

#[derive(Clone)]
pub struct PodStore {
    path: PathBuf,
    pods: Arc<Mutex<BTreeMap<String, LocalPod>>>,
    changed: Arc<watch::Sender<u64>>,
}

impl PodStore {
    /// Opens the store in `state_dir`, reading what a previous run left.
    pub fn open(state_dir: &Path) -> Result<Self, PodStoreError> {
        let path = state_dir.join(FILE);
        let pods = match std::fs::read(&path) {
            Ok(bytes) => {
                let list: Vec<LocalPod> = serde_json::from_slice(&bytes).map_err(|e| PodStoreError::Corrupt {
                    path: path.clone(),
                    reason: e.to_string(),
                })?;
                list.into_iter().map(|p| (p.id(), p)).collect()
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => BTreeMap::new(),
            Err(source) => return Err(PodStoreError::Read { path, source }),
        };
        Ok(Self {
            path,
            pods: Arc::new(Mutex::new(pods)),
            changed: Arc::new(watch::channel(0).0),
        })
    }

    pub fn all(&self) -> Vec<LocalPod> {
        self.pods.lock().expect("pod store lock").values().cloned().collect()
    }

    pub fn by_container(&self, container_id: &str) -> Option<LocalPod> {
        let pods = self.pods.lock().expect("pod store lock");
        pods.values().find(|p| p.container_id == container_id).cloned()
    }

    /// Adds or replaces a pod, durably, then tells watchers.
    pub fn put(&self, pod: LocalPod) -> Result<(), PodStoreError> {
        self.change(|pods| {
            pods.insert(pod.id(), pod);
            true
        })
    }

    /// Removes a pod; returns it if it was there.
    pub fn remove(&self, id: &str) -> Result<Option<LocalPod>, PodStoreError> {
        let mut removed = None;
        self.change(|pods| {
            removed = pods.remove(id);
            removed.is_some()
        })?;
        Ok(removed)
    }

    /// Applies `f`; when it reports a change, persists and notifies.
    pub fn change(&self, f: impl FnOnce(&mut BTreeMap<String, LocalPod>) -> bool) -> Result<(), PodStoreError> {
        let mut pods = self.pods.lock().expect("pod store lock");
        let mut next = pods.clone();
        if !f(&mut next) {
            return Ok(());
        }
        let list: Vec<&LocalPod> = next.values().collect();
        let bytes = serde_json::to_vec_pretty(&list).expect("pods serialise");
        aether_common::fs::write_atomic(&self.path, &bytes, 0o600).map_err(|source| PodStoreError::Write {
            path: self.path.clone(),
            source,
        })?;
        *pods = next;
        drop(pods);
        self.changed.send_modify(|n| *n += 1);
        Ok(())
    }

    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.changed.subscribe()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pod::PodInfo;

    fn pod(name: &str) -> LocalPod {
        LocalPod {
            container_id: format!("c-{name}"),
            netns: "/run/aether/netns/x".into(),
            ips: vec!["10.0.0.1".parse().unwrap()],
            info: PodInfo {
                namespace: "ns".into(),
                name: name.into(),
                ..Default::default()
            },
        }
    }

    #[test]
    fn pods_survive_a_restart_and_a_corrupt_file_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let store = PodStore::open(dir.path()).unwrap();
        store.put(pod("a")).unwrap();
        store.put(pod("b")).unwrap();
        assert_eq!(store.remove("ns/a").unwrap().map(|p| p.id()), Some("ns/a".into()));
        let reopened = PodStore::open(dir.path()).unwrap();
        assert_eq!(reopened.all(), vec![pod("b")]);
        assert_eq!(reopened.by_container("c-b").map(|p| p.id()), Some("ns/b".into()));

        std::fs::write(dir.path().join(FILE), b"[{").unwrap();
        let err = PodStore::open(dir.path()).err().unwrap().to_string();
        assert!(err.contains("is not a pod store"), "{err}");
    }
}
