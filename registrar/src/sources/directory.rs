//! The directory source (`--config-dir`, formerly `--routes-dir`): every `*.yaml` /
//! `*.yml` file in one directory, read as multi-document YAML of HTTPRoute, GRPCRoute,
//! TCPRoute, TLSRoute, AuthorizationPolicy, HTTPFilter, MeshConfig and ExternalService objects (other kinds are skipped, so the directory
//! can hold a whole manifest). For clusters without Kubernetes, the demo and tests. Each kind is
//! projected and stored on its own: a refused policy never holds routes back, nor the
//! other way round.
//!
//! An inotify watch on the directory wakes the source at once; a poll every
//! [`POLL_INTERVAL`] is the safety net (and the only signal while the directory is
//! missing). Either way the source takes a cheap listing (names, sizes, modification
//! times) and reads the files only when it changed, so every way a file can change
//! (editors' renames, ConfigMap symlink swaps) is seen, and seen once.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use aether_api::Document;
use aether_api::authorization::ProjectOptions;
use notify::{RecursiveMode, Watcher};
use std::sync::Arc;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::{ObjectKind, Projector, Refusal, apply};
use crate::catalog::Catalog;
use crate::external_services::ExternalServices;
use crate::http_filters::HttpFilters;
use crate::mesh_configs::MeshConfigs;
use crate::metrics::Metrics;
use crate::policies::Policies;
use crate::routes::Routes;

/// How often the directory's listing is checked without an inotify event.
pub const POLL_INTERVAL: Duration = Duration::from_secs(2);
/// Events within this window are taken in together (an editor's write + rename).
const SETTLE: Duration = Duration::from_millis(20);
/// A file larger than this is refused whole (one object cannot bloat every node).
pub const MAX_FILE_BYTES: u64 = 4 << 20;

/// What a listing shows of each file: a change in any of it means read again.
type Fingerprint = Vec<(PathBuf, u64, Option<SystemTime>)>;

/// What the directory source needs besides the directory.
pub struct Settings {
    /// How policies and MeshConfigs are projected (the mesh root namespace).
    pub policy_options: ProjectOptions,
}

/// Keeps the catalog's routes, policies, HTTP filters and MeshConfigs equal to the directory's until
/// `shutdown`.
pub async fn run(dir: PathBuf, settings: Settings, catalog: Catalog, metrics: Metrics, shutdown: CancellationToken) {
    let mesh_configs = MeshConfigs {
        options: settings.policy_options.clone(),
    };
    let policies = Policies {
        options: settings.policy_options,
    };
    let mut source = Directory {
        dir,
        routes: Kind::new(Projector::resuming(&catalog, Routes)),
        policies: Kind::new(Projector::resuming(&catalog, policies)),
        http_filters: Kind::new(Projector::resuming(&catalog, HttpFilters)),
        mesh_configs: Kind::new(Projector::resuming(&catalog, mesh_configs)),
        external_services: Kind::new(Projector::resuming(&catalog, ExternalServices)),
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
    routes: Kind<Routes>,
    policies: Kind<Policies>,
    http_filters: Kind<HttpFilters>,
    mesh_configs: Kind<MeshConfigs>,
    external_services: Kind<ExternalServices>,
    /// The listing last applied; `None` forces a read.
    listed: Option<Fingerprint>,
}

/// One kind of object the directory holds (routes, policies, HTTP filters, MeshConfigs), projected on
/// its own.
struct Kind<K: ObjectKind> {
    projector: Projector<K>,
    /// The keys each file held when it last parsed: a file that stops parsing keeps
    /// serving them.
    keys_by_file: HashMap<PathBuf, Vec<String>>,
    reported: Vec<Refusal>,
}

/// A file of the listing: its path, its name for origins, and its YAML documents (parsed
/// once, every kind picks its own) or why it could not be read.
type File = (PathBuf, String, Result<Vec<Document>, String>);

/// A kind's objects read from the files: each with its origin, the keys to hold
/// (those of files that did not parse whole), and the documents refused.
struct Read<T> {
    objects: Vec<(String, T)>,
    held: HashSet<String>,
    refused: Vec<Refusal>,
}

impl Directory {
    async fn sync(&mut self, catalog: &Catalog, metrics: &Metrics) {
        let listing = match fingerprint(&self.dir) {
            Ok(listing) => listing,
            Err(error) => {
                // Never read "no directory" as "nothing": keep what is stored.
                if self.listed.is_some() {
                    tracing::error!(dir = %self.dir.display(), %error, "cannot list the routes directory; keeping what is stored");
                }
                self.listed = None;
                return;
            }
        };
        if self.listed.as_ref() == Some(&listing) {
            return;
        }
        let files: Vec<File> = (listing.iter())
            .map(|(path, size, _)| {
                let name = path
                    .file_name()
                    .map_or_else(String::new, |n| n.to_string_lossy().into_owned());
                let documents = read_file(path, *size).map(|text| aether_api::documents(&text));
                (path.clone(), name, documents)
            })
            .collect();
        // A file that cannot be read is refused once, with the routes.
        let unreadable = files.iter().filter_map(|(_, name, text)| {
            let reason = text.as_ref().err()?;
            Some(Refusal {
                origin: name.clone(),
                reason: reason.clone(),
            })
        });
        let unreadable = unreadable.collect();
        let routes_stored = self.routes.sync(&files, unreadable, catalog, metrics).await;
        let policies_stored = self.policies.sync(&files, Vec::new(), catalog, metrics).await;
        let filters_stored = self.http_filters.sync(&files, Vec::new(), catalog, metrics).await;
        let configs_stored = self.mesh_configs.sync(&files, Vec::new(), catalog, metrics).await;
        let externals_stored = self.external_services.sync(&files, Vec::new(), catalog, metrics).await;
        // A failed write is retried at the next poll.
        let stored = routes_stored && policies_stored && filters_stored && configs_stored && externals_stored;
        self.listed = stored.then_some(listing);
    }
}

impl<T> Read<T> {
    fn origins(&self) -> impl Iterator<Item = (String, &T)> {
        self.objects.iter().map(|(origin, object)| (origin.clone(), object))
    }
}

impl<K: ObjectKind> Kind<K> {
    fn new(projector: Projector<K>) -> Self {
        Kind {
            projector,
            keys_by_file: HashMap::new(),
            reported: Vec::new(),
        }
    }

    /// Projects this kind's objects of `files` and stores them, with `refused` (other
    /// refusals to report with them); false if the catalog could not store them.
    async fn sync(&mut self, files: &[File], refused: Vec<Refusal>, catalog: &Catalog, metrics: &Metrics) -> bool {
        let read = self.read(files);
        let mut projection = self.projector.project_holding(read.origins(), &read.held);
        projection.refused.extend(read.refused);
        projection.refused.extend(refused);
        apply(catalog, metrics, "directory", projection, &mut self.reported).await
    }

    /// Picks this kind's objects out of every file (one that cannot be read is
    /// refused once, by the caller).
    fn read(&mut self, files: &[File]) -> Read<K::Object> {
        let (mut objects, mut refused, mut unreadable) = (Vec::new(), Vec::new(), Vec::new());
        let mut keys_by_file = HashMap::new();
        for (path, name, documents) in files {
            let Ok(documents) = documents else {
                unreadable.push(path.clone());
                continue;
            };
            let (mut keys, mut whole) = (Vec::new(), true);
            for (i, document) in K::pick(documents).into_iter().enumerate() {
                let origin = format!("{name}#{i}");
                match document {
                    Ok(object) => {
                        keys.push(K::key(&object));
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
        let held = unreadable
            .iter()
            .flat_map(|file| keys_by_file.get(file).into_iter().flatten().cloned());
        let held = held.collect();
        self.keys_by_file = keys_by_file;
        Read { objects, held, refused }
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
