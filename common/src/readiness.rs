//! Readiness of a process as the conjunction of gates (after ztunnel's `readiness.rs` and Kubernetes'
//! readiness gates): each part that must be up before the process may take work adds a gate, which starts
//! closed ("starting"), and opens or closes it as its state changes. `/ready` answers 200 only while every
//! gate is open, and otherwise names each closed one with its reason.
//!
//! With [`Readiness::with_file`] the verdict is mirrored to a file that exists exactly while ready.
//! Host-network pods rolled with a surge share their loopback ports with their predecessor, so an HTTP probe
//! may be answered by the old pod; a probe that tests a file in the pod's own volume cannot be.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use parking_lot::Mutex;

/// The readiness of the whole process. Cheap to clone and share.
#[derive(Clone, Debug, Default)]
pub struct Readiness(Arc<Shared>);

#[derive(Debug, Default)]
struct Shared {
    /// Gate → `None` when open, else why it is closed.
    gates: Mutex<BTreeMap<&'static str, Option<String>>>,
    file: Option<PathBuf>,
}

/// One part of the process's readiness: closed ("starting") when added.
#[derive(Clone, Debug)]
pub struct Gate {
    readiness: Readiness,
    name: &'static str,
}

/// Why the process is not ready: every closed gate, with its reason.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{}", .0.iter().map(|(name, reason)| format!("{name}: {reason}")).collect::<Vec<_>>().join("; "))]
pub struct NotReady(pub Vec<(&'static str, String)>);

impl Readiness {
    /// No gate yet: not ready until one is added and opened.
    pub fn new() -> Self {
        Self::default()
    }

    /// Mirrors readiness to `path` (present while ready); a stale file from an earlier run is removed now.
    /// Call before cloning.
    pub fn with_file(self, path: &Path) -> Self {
        remove_ready_file(path);
        let gates = std::mem::take(&mut *self.0.gates.lock());
        Self(Arc::new(Shared {
            gates: Mutex::new(gates),
            file: Some(path.to_owned()),
        }))
    }

    /// Adds the gate `name` (not ready: "starting"); adding a name again returns the same gate.
    pub fn gate(&self, name: &'static str) -> Gate {
        self.update(|gates| {
            gates.entry(name).or_insert_with(|| Some("starting".into()));
        });
        Gate {
            readiness: self.clone(),
            name,
        }
    }

    /// `Ok` while every gate is open (and there is at least one).
    pub fn get(&self) -> Result<(), NotReady> {
        verdict(&self.0.gates.lock())
    }

    fn update(&self, change: impl FnOnce(&mut BTreeMap<&'static str, Option<String>>)) {
        let mut gates = self.0.gates.lock();
        let before = verdict(&gates).is_ok();
        change(&mut gates);
        let after = verdict(&gates).is_ok();
        if let Some(path) = &self.0.file
            && before != after
        {
            match after {
                true => write_ready_file(path),
                false => remove_ready_file(path),
            }
        }
    }
}

impl Gate {
    pub fn set_ready(&self) {
        self.readiness.update(|gates| {
            gates.insert(self.name, None);
        });
    }

    pub fn set_not_ready(&self, reason: impl Into<String>) {
        let reason = reason.into();
        self.readiness.update(|gates| {
            gates.insert(self.name, Some(reason));
        });
    }
}

fn verdict(gates: &BTreeMap<&'static str, Option<String>>) -> Result<(), NotReady> {
    if gates.is_empty() {
        return Err(NotReady(vec![("process", "starting".into())]));
    }
    let waiting: Vec<_> = gates
        .iter()
        .filter_map(|(name, reason)| reason.clone().map(|reason| (*name, reason)))
        .collect();
    match waiting.is_empty() {
        true => Ok(()),
        false => Err(NotReady(waiting)),
    }
}

fn write_ready_file(path: &Path) {
    if let Err(error) = std::fs::write(path, b"ready\n") {
        tracing::warn!(path = %path.display(), %error, "writing the ready file failed");
    }
}

fn remove_ready_file(path: &Path) {
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(error) => tracing::warn!(path = %path.display(), %error, "removing the ready file failed"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_only_when_every_registered_component_is() {
        let readiness = Readiness::new();
        assert_eq!(readiness.get(), Err(NotReady(vec![("process", "starting".into())])));
        let envoy = readiness.gate("envoy");
        let catalog = readiness.gate("catalog");
        envoy.set_ready();
        assert_eq!(readiness.get(), Err(NotReady(vec![("catalog", "starting".into())])));
        catalog.set_ready();
        assert_eq!(readiness.get(), Ok(()));
        envoy.set_not_ready("draining");
        catalog.set_not_ready("registrar unreachable");
        let not_ready = readiness.get().unwrap_err();
        assert_eq!(not_ready.to_string(), "catalog: registrar unreachable; envoy: draining");
    }

    #[test]
    fn adding_a_name_again_is_the_same_gate() {
        let readiness = Readiness::new();
        readiness.gate("store").set_ready();
        let again = readiness.gate("store");
        assert_eq!(readiness.get(), Ok(()), "registering again must not reset the state");
        again.set_not_ready("unreachable");
        assert!(readiness.get().is_err());
    }

    #[test]
    fn the_file_exists_exactly_while_ready() {
        let path = std::env::temp_dir().join(format!("aether-ready-{}", std::process::id()));
        std::fs::write(&path, "stale").unwrap();
        let readiness = Readiness::new().with_file(&path);
        assert!(!path.exists(), "a stale file from an earlier run is removed");
        let envoy = readiness.gate("envoy");
        let tasks = readiness.gate("tasks");
        envoy.set_ready();
        assert!(!path.exists());
        tasks.set_ready();
        assert!(path.exists());
        tasks.set_not_ready("watch stopped");
        assert!(!path.exists());
        drop(readiness);
        let _ = std::fs::remove_file(&path);
    }
}
