//! The pods the CNI plugin added on this node, persisted under the state dir so an
//! agent restart knows every pod again without any CNI call.

use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use tokio::sync::watch;

use crate::pod::{LocalPod, PodInfo};

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

#[derive(Default)]
struct Pods {
    by_id: BTreeMap<String, LocalPod>,
    /// Bumped by every change; the file holds the state of some generation.
    generation: u64,
}

#[derive(Clone)]
pub struct PodStore {
    path: PathBuf,
    pods: Arc<Mutex<Pods>>,
    /// The generation last written to disk. Held while writing, so concurrent changes
    /// share one write (group commit): a change already covered by the last write
    /// returns at once.
    written: Arc<tokio::sync::Mutex<u64>>,
    changed: Arc<watch::Sender<u64>>,
}

impl PodStore {
    /// Opens the store in `state_dir`, reading what a previous run left.
    pub fn open(state_dir: &Path) -> Result<Self, PodStoreError> {
        let path = state_dir.join(FILE);
        let by_id = match std::fs::read(&path) {
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
            pods: Arc::new(Mutex::new(Pods { by_id, generation: 0 })),
            written: Arc::default(),
            changed: Arc::new(watch::channel(0).0),
        })
    }

    pub fn all(&self) -> Vec<LocalPod> {
        self.pods.lock().by_id.values().cloned().collect()
    }

    pub fn by_container(&self, container_id: &str) -> Option<LocalPod> {
        let pods = self.pods.lock();
        pods.by_id.values().find(|p| p.container_id == container_id).cloned()
    }

    /// The pods and the generation they are at.
    pub fn snapshot(&self) -> (Vec<LocalPod>, u64) {
        let pods = self.pods.lock();
        (pods.by_id.values().cloned().collect(), pods.generation)
    }

    /// Adds or replaces a pod; see [`PodStore::change`].
    pub async fn put(&self, pod: LocalPod) -> Result<(), PodStoreError> {
        let generation = self.stage(pod);
        self.persist(generation).await
    }

    /// Adds or replaces a pod in memory and tells watchers; returns the generation that
    /// holds it, for [`PodStore::persist`].
    pub fn stage(&self, pod: LocalPod) -> u64 {
        self.apply(|pods| {
            pods.insert(pod.id(), pod);
            true
        })
        .expect("an insert is always a change")
    }

    /// Removes the pod `id` if it is still sandbox `container_id` (a newer sandbox of the
    /// same pod stays); returns it if it was removed. See [`PodStore::change`].
    pub async fn remove_sandbox(&self, id: &str, container_id: &str) -> Result<Option<LocalPod>, PodStoreError> {
        let mut removed = None;
        self.change(|pods| {
            if pods.get(id).is_some_and(|p| p.container_id == container_id) {
                removed = pods.remove(id);
            }
            removed.is_some()
        })
        .await?;
        Ok(removed)
    }

    /// Replaces the metadata of pod `id` if it is still sandbox `container_id` (a DEL or
    /// a newer sandbox in the meantime wins); returns the updated pod if it was applied.
    /// See [`PodStore::change`].
    pub async fn update_info(
        &self,
        id: &str,
        container_id: &str,
        info: PodInfo,
    ) -> Result<Option<LocalPod>, PodStoreError> {
        let mut updated = None;
        self.change(|pods| match pods.get_mut(id) {
            Some(current) if current.container_id == container_id => {
                current.info = info;
                updated = Some(current.clone());
                true
            }
            _ => false,
        })
        .await?;
        Ok(updated)
    }

    /// Applies `f`; when it reports a change, watchers are told at once (the node
    /// starts rebuilding while the change is written) and the call returns once the
    /// change is on disk. On a write error the change stays in memory: the caller
    /// decides (an ADD undoes it), and the next write carries it.
    async fn change(&self, f: impl FnOnce(&mut BTreeMap<String, LocalPod>) -> bool) -> Result<(), PodStoreError> {
        match self.apply(f) {
            Some(generation) => self.persist(generation).await,
            None => Ok(()),
        }
    }

    /// Applies `f` in memory; when it reports a change, bumps the generation, tells
    /// watchers and returns the new generation.
    fn apply(&self, f: impl FnOnce(&mut BTreeMap<String, LocalPod>) -> bool) -> Option<u64> {
        let generation = {
            let mut pods = self.pods.lock();
            if !f(&mut pods.by_id) {
                return None;
            }
            pods.generation += 1;
            pods.generation
        };
        self.changed.send_modify(|n| *n += 1);
        Some(generation)
    }

    /// Returns once the file holds `generation` or a later one. Concurrent callers share
    /// one write. The write holds the lock until it ends even if this future is dropped
    /// (a cancelled RPC), so two writes never overlap and the file never goes back.
    pub async fn persist(&self, generation: u64) -> Result<(), PodStoreError> {
        let mut written = self.written.clone().lock_owned().await;
        if *written >= generation {
            return Ok(());
        }
        let (latest, bytes) = {
            let pods = self.pods.lock();
            let list: Vec<&LocalPod> = pods.by_id.values().collect();
            (
                pods.generation,
                serde_json::to_vec_pretty(&list).expect("pods serialise"),
            )
        };
        let path = self.path.clone();
        tokio::task::spawn_blocking(move || {
            aether_common::fs::write_atomic(&path, &bytes, 0o600)?;
            *written = latest;
            Ok(())
        })
        .await
        .unwrap_or_else(|e| Err(std::io::Error::other(e)))
        .map_err(|source| PodStoreError::Write {
            path: self.path.clone(),
            source,
        })
    }

    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.changed.subscribe()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pod::ListenerSockets;

    fn pod(name: &str) -> LocalPod {
        LocalPod {
            container_id: format!("c-{name}"),
            listener_sockets: Default::default(),
            netns: "/run/aether/netns/x".into(),
            ips: vec!["10.0.0.1".parse().unwrap()],
            info: PodInfo {
                namespace: "ns".into(),
                name: name.into(),
                ..Default::default()
            },
        }
    }

    #[tokio::test]
    async fn changes_survive_a_restart_and_a_corrupt_file_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let store = PodStore::open(dir.path()).unwrap();
        store.put(pod("a")).await.unwrap();
        store.put(pod("b")).await.unwrap();
        // Another sandbox's removal leaves the pod alone.
        assert_eq!(store.remove_sandbox("ns/a", "c-other").await.unwrap(), None);
        assert_eq!(
            store.remove_sandbox("ns/a", "c-a").await.unwrap().map(|p| p.id()),
            Some("ns/a".into())
        );
        // New metadata lands on the same sandbox only.
        let mut info = pod("b").info;
        info.terminating = true;
        assert_eq!(store.update_info("ns/b", "c-other", info.clone()).await.unwrap(), None);
        let updated = store.update_info("ns/b", "c-b", info).await.unwrap().unwrap();
        assert!(updated.info.terminating);
        let reopened = PodStore::open(dir.path()).unwrap();
        assert_eq!(reopened.all(), vec![updated]);
        assert_eq!(reopened.by_container("c-b").map(|p| p.id()), Some("ns/b".into()));

        std::fs::write(dir.path().join(FILE), b"[{").unwrap();
        let err = PodStore::open(dir.path()).err().unwrap().to_string();
        assert!(err.contains("is not a pod store"), "{err}");
    }

    #[test]
    fn pods_recorded_before_the_shared_socket_keep_a_socket_per_worker() {
        let mut recorded = serde_json::to_value(pod("a")).unwrap();
        assert_eq!(recorded["listener_sockets"], "shared");
        recorded.as_object_mut().unwrap().remove("listener_sockets");
        let old: LocalPod = serde_json::from_value(recorded).unwrap();
        assert_eq!(old.listener_sockets, ListenerSockets::PerWorker);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_changes_all_reach_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let store = PodStore::open(dir.path()).unwrap();
        let puts = (0..50).map(|i| {
            let store = store.clone();
            tokio::spawn(async move { store.put(pod(&format!("p{i:02}"))).await })
        });
        for put in puts {
            put.await.unwrap().unwrap();
        }
        let reopened = PodStore::open(dir.path()).unwrap();
        let names: Vec<String> = reopened.all().into_iter().map(|p| p.info.name).collect();
        let expected: Vec<String> = (0..50).map(|i| format!("p{i:02}")).collect();
        assert_eq!(names, expected);
    }
}
