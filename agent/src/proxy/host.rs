//! What the supervisor does outside its decisions: Envoy processes and signals, Envoy's admin API, the Envoy binary,
//! the shared memory Envoy leaves behind. [`LocalHost`] is the real one; the supervisor's tests use a fake.

use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tokio::sync::watch;

use super::admin::{AdminError, EnvoyAdmin, ServerInfo};
use super::envoy::{EnvoyBinary, EnvoyError, Fingerprint, Launch};

/// A started Envoy: its pid and, once it has exited, its exit status.
pub struct Process {
    pub pid: u32,
    pub exited: watch::Receiver<Option<ExitStatus>>,
}

pub trait Host {
    /// Starts one epoch from `launch`'s command line.
    fn spawn(&self, launch: &Launch) -> std::io::Result<Process>;
    /// Sends `signal` to `pid`, which may have exited already.
    fn signal(&self, pid: u32, signal: Signal);
    /// Whether a process `pid` exists (another supervisor, seen through the state file).
    fn is_alive(&self, pid: u32) -> bool;
    /// `/server_info` of the Envoy that owns the admin address `admin`.
    fn server_info(&self, admin: SocketAddr) -> impl Future<Output = Result<ServerInfo, AdminError>> + Send;
    /// Envoy answers health checks (and `/server_info`) as DRAINING from then on.
    fn fail_health_checks(&self, admin: SocketAddr) -> impl Future<Output = Result<(), AdminError>> + Send;
    /// Starts a graceful drain of every listener (they close after Envoy's drain time).
    fn drain_listeners_gracefully(&self, admin: SocketAddr) -> impl Future<Output = Result<(), AdminError>> + Send;
    /// `envoy --mode validate`: Err with Envoy's own words if it would not start from `bootstrap`.
    fn validate(&self, bootstrap: &Path) -> impl Future<Output = Result<(), EnvoyError>> + Send;
    /// Epochs hot-restart into each other only when their binaries' versions are equal.
    fn hot_restart_version(&self) -> impl Future<Output = Result<String, EnvoyError>> + Send;
    /// The binary's identity on disk: replacing it changes this.
    fn fingerprint(&self) -> Result<Fingerprint, EnvoyError>;
    /// Removes the hot-restart shared memory Envoy leaves behind for `base_id`, once nothing of it runs.
    fn remove_shared_memory(&self, base_id: u32);
}

/// This machine's processes and the configured Envoy binary.
pub struct LocalHost {
    envoy: EnvoyBinary,
}

impl LocalHost {
    pub fn new(envoy_bin: PathBuf) -> Self {
        Self {
            envoy: EnvoyBinary::new(envoy_bin),
        }
    }
}

impl Host for LocalHost {
    fn spawn(&self, launch: &Launch) -> std::io::Result<Process> {
        let mut cmd = tokio::process::Command::new(self.envoy.path());
        // Envoy's logs go where ours go (the container's stdout/stderr).
        cmd.args(launch.args())
            .stdin(Stdio::null())
            .stdout(Stdio::inherit())
            .stderr(Stdio::inherit());
        let mut child = cmd.spawn()?;
        let pid = child.id().unwrap_or_default();
        let (tx, exited) = watch::channel(None);
        let epoch = launch.epoch;
        tokio::spawn(async move {
            match child.wait().await {
                Ok(status) => {
                    let _ = tx.send(Some(status));
                }
                Err(error) => tracing::error!(epoch, pid, %error, "waiting for Envoy failed"),
            }
        });
        Ok(Process { pid, exited })
    }

    fn signal(&self, pid: u32, signal: Signal) {
        let _ = kill(Pid::from_raw(pid as i32), signal);
    }

    fn is_alive(&self, pid: u32) -> bool {
        kill(Pid::from_raw(pid as i32), None).is_ok()
    }

    async fn server_info(&self, admin: SocketAddr) -> Result<ServerInfo, AdminError> {
        EnvoyAdmin::new(admin).server_info().await
    }

    async fn fail_health_checks(&self, admin: SocketAddr) -> Result<(), AdminError> {
        EnvoyAdmin::new(admin).fail_health_checks().await
    }

    async fn drain_listeners_gracefully(&self, admin: SocketAddr) -> Result<(), AdminError> {
        EnvoyAdmin::new(admin).drain_listeners_gracefully().await
    }

    async fn validate(&self, bootstrap: &Path) -> Result<(), EnvoyError> {
        self.envoy.validate(bootstrap).await
    }

    async fn hot_restart_version(&self) -> Result<String, EnvoyError> {
        self.envoy.hot_restart_version().await
    }

    fn fingerprint(&self) -> Result<Fingerprint, EnvoyError> {
        self.envoy.fingerprint()
    }

    fn remove_shared_memory(&self, base_id: u32) {
        // Envoy scales the base id by 10 for the name.
        let _ = std::fs::remove_file(format!("/dev/shm/envoy_shared_memory_{}", u64::from(base_id) * 10));
    }
}
