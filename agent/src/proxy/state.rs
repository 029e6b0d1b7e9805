//! The state file a supervisor shares with its successor (`<state dir>/proxy-state.json`): which Envoy epoch is
//! live, with which base id and admin address, and which supervisor owns it. Every read-modify-write holds an
//! exclusive lock on `<state dir>/proxy-state.lock`, so two supervisors never interleave.

use std::fs::File;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

pub const STATE_FILE: &str = "proxy-state.json";
const LOCK_FILE: &str = "proxy-state.lock";

#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path} is not a proxy state file: {source}")]
    Corrupt { path: PathBuf, source: serde_json::Error },
}

/// What a successor reads to continue the epochs.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProxyState {
    /// The supervisor that owns the Envoy (`<pid>-<start time ns>`: pids are reused, this is not).
    pub owner: String,
    pub owner_pid: u32,
    /// The newest epoch: starting or live.
    pub epoch: u32,
    pub phase: Phase,
    pub base_id: u32,
    pub envoy_pid: u32,
    pub envoy_admin: SocketAddr,
    pub hot_restart_version: String,
    /// Envoy's hot-restart socket (`None`: abstract).
    pub hot_restart_socket: Option<PathBuf>,
    /// Last time the owner saw its epoch LIVE (ms since the Unix epoch).
    pub heartbeat_unix_ms: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// The epoch was started and is not LIVE yet.
    Starting,
    Live,
    /// SIGTERM: the owner drains and stops Envoy; nobody may take it over.
    Draining,
}

pub fn now_unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// The state dir: the file and its lock.
#[derive(Clone, Debug)]
pub struct StateDir {
    dir: PathBuf,
}

impl StateDir {
    /// Creates the directory (0700) if needed.
    pub fn open(dir: &Path) -> Result<Self, StateError> {
        use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
        let io = |source| StateError::Io {
            path: dir.to_owned(),
            source,
        };
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(io)?;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)).map_err(io)?;
        Ok(Self { dir: dir.to_owned() })
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// Runs `f` on the current state (None when there is none) while holding the lock; `f` returns what to store
    /// (`Some(None)` removes the file, `None` leaves it) and a result.
    pub fn update<R>(
        &self,
        f: impl FnOnce(Option<ProxyState>) -> (Option<Option<ProxyState>>, R),
    ) -> Result<R, StateError> {
        let lock_path = self.path(LOCK_FILE);
        let lock = File::options()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(|source| StateError::Io {
                path: lock_path.clone(),
                source,
            })?;
        lock.lock().map_err(|source| StateError::Io {
            path: lock_path,
            source,
        })?;
        let current = self.read()?;
        let (store, result) = f(current);
        let path = self.path(STATE_FILE);
        match store {
            None => {}
            Some(Some(state)) => {
                let bytes = serde_json::to_vec_pretty(&state).expect("state serializes");
                aether_common::fs::write_atomic(&path, &bytes, 0o600).map_err(|source| StateError::Io {
                    path: path.clone(),
                    source,
                })?;
            }
            Some(None) => match std::fs::remove_file(&path) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(source) => return Err(StateError::Io { path, source }),
            },
        }
        drop(lock);
        Ok(result)
    }

    /// The current state without locking (a snapshot for reading).
    pub fn read(&self) -> Result<Option<ProxyState>, StateError> {
        let path = self.path(STATE_FILE);
        match std::fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes)
                .map(Some)
                .map_err(|source| StateError::Corrupt { path, source }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(source) => Err(StateError::Io { path, source }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(owner: &str, epoch: u32) -> ProxyState {
        ProxyState {
            owner: owner.into(),
            owner_pid: 1,
            epoch,
            phase: Phase::Live,
            base_id: 7,
            envoy_pid: 2,
            envoy_admin: "127.0.0.1:15000".parse().unwrap(),
            hot_restart_version: "11.104".into(),
            hot_restart_socket: Some("/s/hot-restart".into()),
            heartbeat_unix_ms: now_unix_ms(),
        }
    }

    #[test]
    fn stored_states_read_back_and_corrupt_ones_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let states = StateDir::open(&dir.path().join("proxy")).unwrap();
        assert_eq!(states.read().unwrap(), None);
        let stored = state("a", 3);
        states.update(|_| (Some(Some(stored.clone())), ())).unwrap();
        assert_eq!(states.read().unwrap(), Some(stored));
        let seen = states.update(|s| (None, s.map(|s| s.epoch))).unwrap();
        assert_eq!(seen, Some(3));
        states.update(|_| (Some(None), ())).unwrap();
        assert_eq!(states.read().unwrap(), None);
        std::fs::write(states.path(STATE_FILE), b"{").unwrap();
        let err = states.read().unwrap_err().to_string();
        assert!(err.contains(STATE_FILE), "{err}");
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(dir.path().join("proxy"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o700);
    }
}
