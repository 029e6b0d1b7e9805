//! Keeps the record table current: an inotify watch on the record file's directory,
//! a poll of the file's identity every `--poll-interval` (the only signal while the
//! watch is down, and a safety net while it is up), and the snapshot-age gauges.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime};

use notify::{RecursiveMode, Watcher};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::metrics::Metrics;
use crate::ratelimit::RateLimited;
use crate::records::{MAX_FILE_BYTES, RecordFile, RecordsError};
use crate::table::{CurrentTable, Table};

/// At most one log line per this period for record-file errors (the rest are counted).
pub const FILE_ERROR_LOG_PERIOD: Duration = Duration::from_secs(1);

#[derive(Debug, thiserror::Error)]
pub enum ReloadError {
    #[error("reading {path}: {source}")]
    Read { path: String, source: std::io::Error },
    #[error("{path}: {source}")]
    Malformed { path: String, source: RecordsError },
}

/// What identifies one version of the file on disk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Signature {
    dev: u64,
    ino: u64,
    size: u64,
    mtime_ns: i64,
}

fn signature(path: &Path) -> std::io::Result<Signature> {
    let m = std::fs::metadata(path)?;
    Ok(Signature {
        dev: m.dev(),
        ino: m.ino(),
        size: m.size(),
        mtime_ns: m.mtime() * 1_000_000_000 + m.mtime_nsec(),
    })
}

fn dir_identity(dir: &Path) -> Option<(u64, u64)> {
    std::fs::metadata(dir).ok().map(|m| (m.dev(), m.ino()))
}

pub struct Reloader {
    pub path: PathBuf,
    pub store: Arc<CurrentTable>,
    pub metrics: Metrics,
    pub poll_interval: Duration,
    pub stale_after: Duration,
    /// The file version `load_now` installed.
    pub initial: Option<Signature>,
}

struct State {
    loaded: Option<Signature>,
    missing_logged: bool,
    stale: bool,
    errors: RateLimited,
}

impl Reloader {
    fn dir(&self) -> PathBuf {
        match self.path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
            _ => PathBuf::from("."),
        }
    }

    /// Loads the file now (blocking): used at start so the first query already has a table.
    pub fn load_now(&mut self) -> Result<(), ReloadError> {
        let sig = signature(&self.path).ok();
        let table = read_table(&self.path)?;
        self.install(table);
        self.initial = sig;
        Ok(())
    }

    fn install(&self, table: Table) {
        let previous = self.store.load().map(|t| t.generation);
        let aliases: Vec<String> = table.aliases.iter().map(|a| a.name().to_string()).collect();
        tracing::info!(
            path = %self.path.display(),
            generation = table.generation,
            records = table.len(),
            ?aliases,
            ?previous,
            "record table loaded"
        );
        if previous.is_some_and(|p| p > table.generation) {
            tracing::warn!(
                generation = table.generation,
                ?previous,
                "record file generation went backwards; serving it anyway (the writer is the authority)"
            );
        }
        self.metrics.generation.set(table.generation as i64);
        self.metrics.records.set(table.len() as i64);
        self.metrics.reloads_ok.inc();
        self.store.replace(table);
    }

    pub async fn run(self, shutdown: CancellationToken) {
        let wake = Arc::new(Notify::new());
        let watch_failed = Arc::new(AtomicBool::new(false));
        let dir = self.dir();
        let file_name = self.path.file_name().map(|n| n.to_os_string());
        let mut watcher: Option<(notify::RecommendedWatcher, Option<(u64, u64)>)> = None;
        let mut state = State {
            loaded: self.initial,
            missing_logged: false,
            stale: false,
            errors: RateLimited::new(FILE_ERROR_LOG_PERIOD),
        };
        let mut poll = tokio::time::interval(self.poll_interval);
        poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut age = tokio::time::interval(Duration::from_secs(1));
        age.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut check = true;
        loop {
            if check {
                // (Re-)establish the watch when it is down or the directory was replaced.
                let identity = dir_identity(&dir);
                let healthy = watcher
                    .as_ref()
                    .is_some_and(|(_, id)| *id == identity && identity.is_some())
                    && !watch_failed.load(Ordering::Relaxed);
                if !healthy {
                    watcher = None;
                    watch_failed.store(false, Ordering::Relaxed);
                    match self.watch(&dir, file_name.clone(), wake.clone(), watch_failed.clone()) {
                        Ok(w) => {
                            tracing::info!(dir = %dir.display(), "watching the record directory");
                            watcher = Some((w, identity));
                            self.metrics.watch_up.set(1);
                        }
                        Err(error) => {
                            if state.errors.allow() {
                                tracing::warn!(dir = %dir.display(), %error, poll = ?self.poll_interval,
                                "cannot watch the record directory; polling");
                            }
                            self.metrics.watch_up.set(0);
                        }
                    }
                }
                self.check(&mut state).await;
            }
            check = tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = wake.notified() => true,
                _ = poll.tick() => true,
                _ = age.tick() => {
                    // Only the gauges: the file is looked at on events and polls.
                    self.update_age(&mut state);
                    false
                }
            };
        }
    }

    fn watch(
        &self,
        dir: &Path,
        file_name: Option<std::ffi::OsString>,
        wake: Arc<Notify>,
        failed: Arc<AtomicBool>,
    ) -> notify::Result<notify::RecommendedWatcher> {
        let dir_owned = dir.to_path_buf();
        let mut watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| match event {
            Ok(event) => {
                let relevant = event.need_rescan()
                    || event.paths.iter().any(|p| {
                        p.file_name().map(|n| n.to_os_string()) == file_name || p.as_path() == dir_owned.as_path()
                    });
                if event.paths.iter().any(|p| p.as_path() == dir_owned.as_path()) && event.kind.is_remove() {
                    failed.store(true, Ordering::Relaxed);
                }
                if relevant {
                    wake.notify_one();
                }
            }
            Err(_) => {
                failed.store(true, Ordering::Relaxed);
                wake.notify_one();
            }
        })?;
        watcher.watch(dir, RecursiveMode::NonRecursive)?;
        Ok(watcher)
    }

    /// Reloads if the file on disk is not the one loaded.
    async fn check(&self, state: &mut State) {
        let sig = match signature(&self.path) {
            Ok(sig) => sig,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                if !state.missing_logged {
                    state.missing_logged = true;
                    if self.store.load().is_some() {
                        tracing::warn!(path = %self.path.display(), "the record file is gone; serving the last table");
                    } else {
                        tracing::info!(path = %self.path.display(), "no record file yet; mesh names get SERVFAIL until one appears");
                    }
                }
                state.loaded = None;
                return;
            }
            Err(source) => {
                self.metrics.reloads_error.inc();
                if state.errors.allow() {
                    tracing::warn!(path = %self.path.display(), error = %source, "cannot stat the record file");
                }
                return;
            }
        };
        state.missing_logged = false;
        if state.loaded == Some(sig) {
            return;
        }
        state.loaded = Some(sig);
        let path = self.path.clone();
        let result = tokio::task::spawn_blocking(move || read_table(&path))
            .await
            .unwrap_or_else(|e| {
                Err(ReloadError::Read {
                    path: self.path.display().to_string(),
                    source: std::io::Error::other(e.to_string()),
                })
            });
        match result {
            Ok(table) => {
                self.install(table);
                self.update_age(state);
            }
            Err(error) => {
                self.metrics.reloads_error.inc();
                if matches!(error, ReloadError::Malformed { .. }) {
                    self.metrics.malformed_files.inc();
                }
                if state.errors.allow() {
                    let kept = self.store.load().map(|t| t.generation);
                    tracing::error!(%error, kept_generation = ?kept, suppressed = state.errors.take_suppressed(),
                        "record file rejected; keeping the last good table");
                }
            }
        }
    }

    fn update_age(&self, state: &mut State) {
        let Some(table) = self.store.load() else { return };
        let age = SystemTime::now().duration_since(table.written_at).unwrap_or_default();
        self.metrics.snapshot_age_seconds.set(age.as_secs_f64());
        let stale = age > self.stale_after;
        if stale != state.stale {
            state.stale = stale;
            if stale {
                tracing::warn!(age = ?age, generation = table.generation, "the record file is stale (its writer stopped re-stamping it); still serving it");
            } else {
                tracing::info!(generation = table.generation, "the record file is fresh again");
            }
        }
        self.metrics.snapshot_stale.set(i64::from(stale));
    }
}

fn read_table(path: &Path) -> Result<Table, ReloadError> {
    use std::io::Read;
    let read = |source| ReloadError::Read {
        path: path.display().to_string(),
        source,
    };
    let file = std::fs::File::open(path).map_err(read)?;
    let mut bytes = Vec::new();
    // One byte over the limit is enough to know it is too large.
    file.take(MAX_FILE_BYTES + 1).read_to_end(&mut bytes).map_err(read)?;
    let parsed = RecordFile::parse(&bytes).map_err(|source| ReloadError::Malformed {
        path: path.display().to_string(),
        source,
    })?;
    Ok(Table::new(&parsed))
}
