//! Where pod metadata comes from. Every source feeds one [`PodDirectory`]: the
//! `static` source reads Pod manifests (Kubernetes JSON) from a directory, for local
//! runs and tests; the `kubernetes` source watches this node's Pods.

pub mod kubernetes;
pub mod manifest;
pub mod static_dir;

use parking_lot::RwLock;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use crate::pod::PodInfo;

/// The pods a source currently reports, by `<ns>/<name>`, with a change counter.
#[derive(Clone)]
pub struct PodDirectory {
    pods: Arc<RwLock<HashMap<String, PodInfo>>>,
    changed: Arc<watch::Sender<u64>>,
}

impl Default for PodDirectory {
    fn default() -> Self {
        Self {
            pods: Arc::default(),
            changed: Arc::new(watch::channel(0).0),
        }
    }
}

impl PodDirectory {
    pub fn get(&self, key: &str) -> Option<PodInfo> {
        self.pods.read().get(key).cloned()
    }

    /// Replaces the whole set (a source's full listing); notifies only on a change.
    pub fn replace_all(&self, pods: HashMap<String, PodInfo>) {
        let mut current = self.pods.write();
        if *current != pods {
            *current = pods;
            self.changed.send_modify(|n| *n += 1);
        }
    }

    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.changed.subscribe()
    }

    /// Waits up to `timeout` for `key` to appear (a CNI ADD can race the pod watch).
    pub async fn wait_for(&self, key: &str, timeout: Duration) -> Option<PodInfo> {
        let mut changes = self.subscribe();
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if let Some(pod) = self.get(key) {
                return Some(pod);
            }
            if tokio::time::timeout_at(deadline, changes.changed()).await.is_err() {
                return None;
            }
        }
    }
}
