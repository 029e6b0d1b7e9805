//! A fake [`Host`] for the supervisor's tests: Envoy processes that are only bookkeeping, an admin that answers for
//! the newest of them, and a binary whose version, validity and identity a test sets. Envoy's own rules are kept
//! where the supervisor relies on them: the newest Envoy owns the admin address and is LIVE once started, and a new
//! LIVE epoch's parent exits after the parent-shutdown time. What the supervisor does is recorded with its time.

use parking_lot::Mutex;
use std::net::SocketAddr;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::sync::Arc;
use std::time::Duration;

use nix::sys::signal::Signal;
use tokio::sync::watch;
use tokio::time::Instant;

use super::admin::{AdminError, ServerInfo};
use super::envoy::{BaseId, EnvoyError, Fingerprint, Launch};
use super::host::{Host, Process};

/// The base id the fake Envoy "picks" with `--use-dynamic-base-id`, plus the number of Envoys started before.
pub const DYNAMIC_BASE_ID: u32 = 4242;
/// The base id of a predecessor's Envoy ([`FakeHost::adopt`]).
pub const PREDECESSOR_BASE_ID: u32 = 7;
pub const VERSION: &str = "11.104";

#[derive(Clone, Default)]
pub struct FakeHost(Arc<Mutex<World>>);

/// One fake Envoy process.
#[derive(Clone, Debug)]
pub struct Spawned {
    pub pid: u32,
    pub epoch: u32,
    pub args: Vec<String>,
    pub at: Instant,
    /// Whether it ever answers LIVE.
    pub goes_live: bool,
    pub exited_at: Option<Instant>,
}

#[derive(Default)]
struct World {
    processes: Vec<(Spawned, watch::Sender<Option<ExitStatus>>)>,
    signals: Vec<(u32, Signal, Instant)>,
    admin_posts: Vec<(&'static str, Instant)>,
    validations: usize,
    shared_memory_removed: Vec<u32>,
    /// Set by tests.
    version: Option<String>,
    binary: u64,
    invalid: bool,
    ignore_sigterm: bool,
    never_live: bool,
}

impl FakeHost {
    pub fn spawned(&self) -> Vec<Spawned> {
        self.0.lock().processes.iter().map(|(p, _)| p.clone()).collect()
    }

    pub fn signals(&self) -> Vec<(u32, Signal, Instant)> {
        self.0.lock().signals.clone()
    }

    pub fn admin_posts(&self) -> Vec<(&'static str, Instant)> {
        self.0.lock().admin_posts.clone()
    }

    pub fn validations(&self) -> usize {
        self.0.lock().validations
    }

    pub fn shared_memory_removed(&self) -> Vec<u32> {
        self.0.lock().shared_memory_removed.clone()
    }

    /// Envoy refuses every bootstrap from now on (or accepts them again).
    pub fn set_invalid(&self, invalid: bool) {
        self.0.lock().invalid = invalid;
    }

    /// A new binary with this hot-restart version.
    pub fn replace_binary(&self, version: &str) {
        let mut world = self.0.lock();
        world.version = Some(version.to_owned());
        world.binary += 1;
    }

    pub fn ignore_sigterm(&self) {
        self.0.lock().ignore_sigterm = true;
    }

    /// Epochs started from now on never become LIVE.
    pub fn never_live(&self) {
        self.0.lock().never_live = true;
    }

    /// A process that is not the supervisor's: a predecessor's Envoy at `epoch`, up since `up_for` ago.
    pub fn adopt(&self, epoch: u32, up_for: Duration, hot_restart_socket: Option<PathBuf>) -> u32 {
        let launch = Launch {
            epoch,
            base_id: BaseId::Fixed(PREDECESSOR_BASE_ID),
            bootstrap: "/predecessor/bootstrap.yaml".into(),
            drain_time: Duration::ZERO,
            parent_shutdown_time: Duration::ZERO,
            concurrency: 1,
            hot_restart_socket,
            log_level: "info".into(),
            log_format: aether_common::telemetry::LogFormat::Text,
        };
        let pid = self.spawn(&launch).expect("fake spawn").pid;
        let mut world = self.0.lock();
        let (process, _) = world.processes.last_mut().expect("just spawned");
        process.at = Instant::now() - up_for;
        pid
    }

    /// The process `pid` exits with `status`, as if Envoy crashed or was told to go.
    pub fn exit(&self, pid: u32, status: ExitStatus) {
        let mut world = self.0.lock();
        if let Some((process, exited)) = world.processes.iter_mut().find(|(p, _)| p.pid == pid)
            && process.exited_at.is_none()
        {
            process.exited_at = Some(Instant::now());
            let _ = exited.send(Some(status));
        }
    }

    /// `kill -9`.
    pub fn crash(&self, pid: u32) {
        self.exit(pid, ExitStatus::from_raw(Signal::SIGKILL as i32));
    }

    /// The newest process still running: the one that owns the admin address.
    fn newest(&self) -> Option<Spawned> {
        let world = self.0.lock();
        let running = world.processes.iter().filter(|(p, _)| p.exited_at.is_none());
        running.map(|(p, _)| p.clone()).max_by_key(|p| p.pid)
    }

    /// Envoy's parent shutdown: a new epoch that is LIVE tells its parent to exit after the parent-shutdown time.
    fn retire_parent(&self, launch: &Launch, child: u32) {
        let Some(parent) = self.newest().filter(|p| p.epoch + 1 == launch.epoch) else {
            return;
        };
        let (host, after) = (self.clone(), launch.parent_shutdown_time);
        tokio::spawn(async move {
            tokio::time::sleep(after).await;
            let child_live = host
                .spawned()
                .iter()
                .any(|p| p.pid == child && p.exited_at.is_none() && p.goes_live);
            if child_live {
                host.exit(parent.pid, ExitStatus::from_raw(0));
            }
        });
    }
}

impl Host for FakeHost {
    fn spawn(&self, launch: &Launch) -> std::io::Result<Process> {
        let started = self.0.lock().processes.len() as u32;
        if let BaseId::Dynamic(path) = &launch.base_id {
            std::fs::write(path, (DYNAMIC_BASE_ID + started).to_string())?;
        }
        let pid = 1000 + started;
        self.retire_parent(launch, pid);
        let mut world = self.0.lock();
        let (tx, exited) = watch::channel(None);
        let spawned = Spawned {
            pid,
            epoch: launch.epoch,
            args: launch.args(),
            at: Instant::now(),
            goes_live: !world.never_live,
            exited_at: None,
        };
        world.processes.push((spawned, tx));
        Ok(Process { pid, exited })
    }

    fn signal(&self, pid: u32, signal: Signal) {
        let ignore_sigterm = {
            let mut world = self.0.lock();
            world.signals.push((pid, signal, Instant::now()));
            world.ignore_sigterm
        };
        match signal {
            Signal::SIGTERM if !ignore_sigterm => self.exit(pid, ExitStatus::from_raw(0)),
            Signal::SIGKILL => self.crash(pid),
            _ => {}
        }
    }

    fn is_alive(&self, _pid: u32) -> bool {
        false
    }

    async fn server_info(&self, admin: SocketAddr) -> Result<ServerInfo, AdminError> {
        let Some(newest) = self.newest() else {
            return Err(AdminError::Request {
                addr: admin,
                path: "/server_info".into(),
                reason: "connect: connection refused".into(),
            });
        };
        let now = Instant::now();
        let socket = newest.args.iter().skip_while(|a| *a != "--socket-path").nth(1);
        Ok(ServerInfo {
            state: if newest.goes_live { "LIVE" } else { "INITIALIZING" }.into(),
            restart_epoch: newest.epoch,
            base_id: 0,
            use_dynamic_base_id: false,
            hot_restart_version: self.0.lock().version.clone().unwrap_or(VERSION.into()),
            socket_path: socket.cloned().unwrap_or("@envoy_domain_socket".into()),
            uptime_current_epoch: now.saturating_duration_since(newest.at),
        })
    }

    async fn fail_health_checks(&self, _admin: SocketAddr) -> Result<(), AdminError> {
        self.0.lock().admin_posts.push(("/healthcheck/fail", Instant::now()));
        Ok(())
    }

    async fn drain_listeners_gracefully(&self, _admin: SocketAddr) -> Result<(), AdminError> {
        self.0
            .lock()
            .admin_posts
            .push(("/drain_listeners?graceful", Instant::now()));
        Ok(())
    }

    async fn validate(&self, bootstrap: &Path) -> Result<(), EnvoyError> {
        let mut world = self.0.lock();
        world.validations += 1;
        if world.invalid {
            return Err(EnvoyError::Invalid {
                bootstrap: bootstrap.to_owned(),
                output: "fake Envoy refuses it".into(),
            });
        }
        Ok(())
    }

    async fn hot_restart_version(&self) -> Result<String, EnvoyError> {
        Ok(self.0.lock().version.clone().unwrap_or(VERSION.into()))
    }

    fn fingerprint(&self) -> Result<Fingerprint, EnvoyError> {
        Ok(Fingerprint {
            len: 1,
            mtime_ns: 0,
            inode: self.0.lock().binary,
        })
    }

    fn remove_shared_memory(&self, base_id: u32) {
        self.0.lock().shared_memory_removed.push(base_id);
    }
}
