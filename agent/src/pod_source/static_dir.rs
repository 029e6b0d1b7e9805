//! The `static` pod source: a directory of Pod manifests (`*.json`), re-read when it
//! changes. A manifest that does not parse is logged with its file and skipped; the
//! others are served.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use tokio_util::sync::CancellationToken;

use super::{PodDirectory, manifest};
use crate::pod::PodInfo;

const POLL: Duration = Duration::from_millis(200);

/// Reads `dir` into `pods` now and then whenever a file in it changes, until `shutdown`.
pub async fn run(dir: PathBuf, pods: PodDirectory, shutdown: CancellationToken) {
    let mut seen = None;
    loop {
        let stamp = fingerprint(&dir);
        if seen.as_ref() != Some(&stamp) {
            pods.replace_all(read_dir(&dir));
            seen = Some(stamp);
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(POLL) => {}
        }
    }
}

/// Names, sizes and modification times: enough to notice any edit.
fn fingerprint(dir: &Path) -> Vec<(PathBuf, u64, Option<SystemTime>)> {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let meta = e.metadata().ok()?;
            Some((e.path(), meta.len(), meta.modified().ok()))
        })
        .collect();
    entries.sort();
    entries
}

pub fn read_dir(dir: &Path) -> HashMap<String, PodInfo> {
    let mut pods = HashMap::new();
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(error) => {
            tracing::warn!(dir = %dir.display(), %error, "cannot read the static pod directory");
            return pods;
        }
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.extension().is_none_or(|e| e != "json") {
            continue;
        }
        let bytes = match std::fs::read(&path) {
            Ok(bytes) => bytes,
            Err(error) => {
                tracing::warn!(file = %path.display(), %error, "skipping a pod manifest");
                continue;
            }
        };
        match manifest::parse(&bytes) {
            Ok(pod) => {
                pods.insert(pod.key(), pod);
            }
            Err(error) => tracing::warn!(file = %path.display(), %error, "skipping a pod manifest"),
        }
    }
    pods
}
