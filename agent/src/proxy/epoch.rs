//! One Envoy epoch the supervisor started: its process, waiting for it and stopping it.

use std::path::Path;
use std::process::ExitStatus;
use std::time::Duration;

use nix::sys::signal::Signal;
use tokio::sync::watch;
use tokio::time::Instant;

use super::host::{Host, Process};
use super::supervisor::SupervisorError;

/// How long Envoy has to write the base id it picked.
const BASE_ID_TIMEOUT: Duration = Duration::from_secs(30);

pub struct Epoch {
    pub number: u32,
    pub pid: u32,
    pub exited: watch::Receiver<Option<ExitStatus>>,
    pub started: Instant,
}

impl Epoch {
    pub fn new(number: u32, process: Process) -> Self {
        Self {
            number,
            pid: process.pid,
            exited: process.exited,
            started: Instant::now(),
        }
    }

    pub fn exit_status(&self) -> Option<ExitStatus> {
        *self.exited.borrow()
    }

    /// Until the process has exited.
    pub async fn exit(&mut self) {
        let _ = self.exited.wait_for(Option::is_some).await;
    }

    fn signal(&self, host: &impl Host, signal: Signal) {
        if self.exit_status().is_none() {
            host.signal(self.pid, signal);
        }
    }

    /// SIGTERM, and SIGKILL if it has not exited `timeout` later.
    pub async fn stop(&mut self, host: &impl Host, timeout: Duration) {
        self.signal(host, Signal::SIGTERM);
        if tokio::time::timeout(timeout, self.exit()).await.is_err() {
            tracing::warn!(epoch = self.number, pid = self.pid, "Envoy ignored SIGTERM; killing it");
            self.signal(host, Signal::SIGKILL);
            self.exit().await;
        }
    }
}

/// The exit status of the epoch watched by `exited`; never, without one.
pub async fn exit_of(exited: &mut Option<watch::Receiver<Option<ExitStatus>>>) -> Option<ExitStatus> {
    match exited {
        Some(rx) => match rx.wait_for(Option::is_some).await {
            Ok(status) => *status,
            Err(_) => None,
        },
        None => std::future::pending().await,
    }
}

/// Envoy writes the base id it picked early in its start; waits for it (or for Envoy to die).
pub async fn read_base_id(path: &Path, epoch: &Epoch) -> Result<u32, SupervisorError> {
    let deadline = Instant::now() + BASE_ID_TIMEOUT;
    loop {
        if let Ok(text) = std::fs::read_to_string(path)
            && let Ok(id) = text.trim().parse()
        {
            return Ok(id);
        }
        if let Some(status) = epoch.exit_status() {
            return Err(SupervisorError::BaseIdExited {
                path: path.to_owned(),
                status,
            });
        }
        if Instant::now() >= deadline {
            return Err(SupervisorError::BaseIdTimeout {
                path: path.to_owned(),
                timeout: BASE_ID_TIMEOUT,
            });
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
