//! The directory source (`--routes-dir`): every `*.yaml` / `*.yml` file in one
//! directory, read as multi-document YAML of HTTPRoute and GRPCRoute objects (other
//! kinds are skipped, so the directory can hold a whole manifest). For clusters
//! without Kubernetes, the demo and tests.
//!
//! An inotify watch on the directory wakes the source at once; a poll every
//! [`POLL_INTERVAL`] is the safety net (and the only signal while the directory is
//! missing). Either way the source takes a cheap listing (names, sizes, modification
//! times) and reads the files only when it changed, so every way a file can change
//! (editors' renames, ConfigMap symlink swaps) is seen, and seen once.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use aether_api::{RouteObject, parse_documents};
use notify::{RecursiveMode, Watcher};
use std::sync::Arc;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::{Projector, Refusal, apply};
use crate::catalog::Catalog;
use crate::metrics::Metrics;

/// How often the directory's listing is checked without an inotify event.
pub const POLL_INTERVAL: Duration = Duration::from_secs(2);
/// Events within this window are taken in together (an editor's write + rename).
const SETTLE: Duration = Duration::from_millis(20);
/// A file larger than this is refused whole (one object cannot bloat every node).
pub const MAX_FILE_BYTES: u64 = 4 << 20;

/// What a listing shows of each file: a change in any of it means read again.
type Fingerprint = Vec<(PathBuf, u64, Option<SystemTime>)>;

/// Keeps the catalog's routes equal to the directory's until `shutdown`.
pub async fn run(dir: PathBuf, catalog: Catalog, metrics: Metrics, shutdown: CancellationToken) {
    let mut source = Directory {
        dir,
        projector: Projector::resuming(&catalog),
        keys_by_file: HashMap::new(),
        reported: Vec::new(),
        listed: None,
    };
    let wake = Arc::new(Notify::new());
    let mut watch = None;
    loop {
        if watch.is_none() {
            watch = watch_dir(&source.dir, wake.clone());
        }
        source.sync(&catalog, &metrics).await;
        if source.listed.is_none() {
            // The directory may have been replaced: watch it afresh next time.
            watch = None;
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = wake.notified() => tokio::time::sleep(SETTLE).await,
            _ = tokio::time::sleep(POLL_INTERVAL) => {}
        }
    }
}

/// An inotify watch on `dir` that wakes the source; `None` if it cannot be set up
/// (the poll covers until the next attempt).
fn watch_dir(dir: &Path, wake: Arc<Notify>) -> Option<notify::RecommendedWatcher> {
    let mut watcher = notify::recommended_watcher(move |_: notify::Result<notify::Event>| wake.notify_one()).ok()?;
    watcher.watch(dir, RecursiveMode::NonRecursive).ok()?;
    Some(watcher)
}

struct Directory {
    dir: PathBuf,
    projector: Projector,
    /// The route keys each file held when it last parsed: a file that stops parsing
    /// keeps serving them.
    keys_by_file: HashMap<PathBuf, Vec<String>>,
    reported: Vec<Refusal>,
    /// The listing last applied; `None` forces a read.
    listed: Option<Fingerprint>,
}

impl Directory {
    async fn sync(&mut self, catalog: &Catalog, metrics: &Metrics) {
        let listing = match fingerprint(&self.dir) {
            Ok(listing) => listing,
            Err(error) => {
                // Never read "no directory" as "no routes": keep what is stored.
                if self.listed.is_some() {
                    tracing::error!(dir = %self.dir.display(), %error, "cannot list the routes directory; keeping the current routes");
                }
                self.listed = None;
                return;
            }
        };
        if self.listed.as_ref() == Some(&listing) {
            return;
        }
        let (objects, unreadable, mut refused) = self.read(&listing);
        let held: HashSet<String> = unreadable
            .iter()
            .flat_map(|file| self.keys_by_file.get(file).into_iter().flatten().cloned())
            .collect();
        let mut projection = self
            .projector
            .project_holding(objects.iter().map(|(o, obj)| (o.clone(), obj)), &held);
        projection.refused.append(&mut refused);
        let stored = apply(catalog, metrics, "directory", projection, &mut self.reported).await;
        // A failed write is retried at the next poll.
        self.listed = stored.then_some(listing);
    }

    /// Reads every file of `listing`: the objects with their origins, the files
    /// that could not be read whole, and the documents refused while parsing.
    fn read(&mut self, listing: &Fingerprint) -> (Vec<(String, RouteObject)>, Vec<PathBuf>, Vec<Refusal>) {
        let mut objects = Vec::new();
        let mut unreadable = Vec::new();
        let mut refused = Vec::new();
        let mut keys_by_file = HashMap::new();
        for (path, size, _) in listing {
            let name = path
                .file_name()
                .map_or_else(String::new, |n| n.to_string_lossy().into_owned());
            let text = match read_file(path, *size) {
                Ok(text) => text,
                Err(reason) => {
                    refused.push(Refusal { origin: name, reason });
                    unreadable.push(path.clone());
                    continue;
                }
            };
            let mut keys = Vec::new();
            let mut whole = true;
            for (i, document) in parse_documents(&text).into_iter().enumerate() {
                let origin = format!("{name}#{i}");
                match document {
                    Ok(object) => {
                        keys.push(object.key());
                        objects.push((origin, object));
                    }
                    Err(error) => {
                        whole = false;
                        refused.push(Refusal {
                            origin,
                            reason: error.to_string(),
                        });
                    }
                }
            }
            if !whole {
                unreadable.push(path.clone());
            }
            keys_by_file.insert(path.clone(), keys);
        }
        // Files that did not parse whole keep the keys they had before.
        for path in &unreadable {
            if let Some(old) = self.keys_by_file.remove(path) {
                keys_by_file.entry(path.clone()).or_insert_with(Vec::new).extend(old);
            }
        }
        self.keys_by_file = keys_by_file;
        (objects, unreadable, refused)
    }
}

fn read_file(path: &Path, size: u64) -> Result<String, String> {
    if size > MAX_FILE_BYTES {
        return Err(format!("{size} bytes is over the limit of {MAX_FILE_BYTES}"));
    }
    std::fs::read_to_string(path).map_err(|e| format!("reading it: {e}"))
}

/// The YAML files of `dir`, sorted, with what may reveal a change.
fn fingerprint(dir: &Path) -> std::io::Result<Fingerprint> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        let yaml = path
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("yaml") || e.eq_ignore_ascii_case("yml"));
        // Follows symlinks (ConfigMap volumes); a dangling one is skipped.
        let Ok(meta) = std::fs::metadata(&path) else { continue };
        if yaml && meta.is_file() {
            files.push((path, meta.len(), meta.modified().ok()));
        }
    }
    files.sort();
    Ok(files)
}
