//! The supervisor's state machine: one owned Envoy epoch at a time, hot restarts onto validated bootstraps,
//! takeover of a predecessor's Envoy, crash restarts with backoff, drain on SIGTERM.

use parking_lot::Mutex;
use std::path::PathBuf;
use std::process::{ExitStatus, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use aether_common::admin::Readiness;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::admin::{EnvoyAdmin, ServerInfo};
use super::bootstrap::{self, BootstrapParams};
use super::config::{BaseIdMode, ProxyConfig};
use super::envoy::{BaseId, EnvoyBinary, Fingerprint, Launch};
use super::metrics::ProxyMetrics;
use super::state::{Phase, ProxyState, StateDir, now_unix_ms};

/// Envoy writes the base id it picked here (`--base-id-path`).
pub const BASE_ID_FILE: &str = "base-id";
const POLL: Duration = Duration::from_millis(50);
const FIRST_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(10);
/// An epoch that lived this long resets the crash backoff.
const STABLE_AFTER: Duration = Duration::from_secs(60);
/// How long Envoy gets after SIGTERM before SIGKILL.
const STOP_TIMEOUT: Duration = Duration::from_secs(10);
/// How long after its parent-shutdown time an old epoch may still take to exit.
const PARENT_EXIT_MARGIN: Duration = Duration::from_secs(1);

#[derive(Debug, thiserror::Error)]
pub enum SupervisorError {
    #[error("bootstrap template {path}: {source}")]
    ReadTemplate { path: PathBuf, source: std::io::Error },
    #[error(transparent)]
    Render(#[from] bootstrap::BootstrapError),
    #[error("writing {path}: {source}")]
    WriteBootstrap { path: PathBuf, source: std::io::Error },
    #[error(transparent)]
    Envoy(#[from] super::envoy::EnvoyError),
    #[error(transparent)]
    State(#[from] super::state::StateError),
    #[error(
        "the new Envoy binary's hot-restart version {new} differs from the running epoch's {running}: it cannot \
         hot-restart into it (the running Envoy keeps serving)"
    )]
    IncompatibleBinary { new: String, running: String },
    #[error("starting Envoy {binary}: {source}")]
    Spawn { binary: PathBuf, source: std::io::Error },
    #[error("Envoy epoch {epoch} exited before it was LIVE ({status})")]
    EpochExited { epoch: u32, status: String },
    #[error("Envoy epoch {epoch} was not LIVE within {timeout:?} (last: {last})")]
    NotLive {
        epoch: u32,
        timeout: Duration,
        last: String,
    },
    #[error("the running epoch {epoch} is not LIVE yet ({last}); Envoy cannot hot-restart from it")]
    CurrentNotLive { epoch: u32, last: String },
    #[error(
        "a predecessor's Envoy answers on {admin} but is not LIVE at epoch {epoch} within {timeout:?} ({last}); \
         refusing to start a second Envoy beside it"
    )]
    PredecessorNotLive {
        admin: std::net::SocketAddr,
        epoch: u32,
        timeout: Duration,
        last: String,
    },
    #[error("the predecessor's Envoy uses hot-restart socket {theirs:?} and this supervisor {ours:?}: set the same")]
    SocketMismatch { theirs: String, ours: String },
    #[error("reading the base id Envoy picked from {path}: {reason}")]
    BaseId { path: PathBuf, reason: String },
    #[error("--parent-shutdown-time ({parent:?}) must be longer than --drain-time ({drain:?})")]
    Times { drain: Duration, parent: Duration },
}

/// What a supervisor last heard of: shown on `/debug/proxy`.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Status {
    pub owner: String,
    pub epoch: Option<u32>,
    pub base_id: Option<u32>,
    pub envoy_pid: Option<u32>,
    pub live: bool,
    pub superseded_by: Option<String>,
    pub retiring_pids: Vec<u32>,
    pub hot_restarts: u64,
    pub crashes: u64,
    pub last_error: Option<String>,
}

/// The inputs an epoch was started from; a change to either triggers a hot restart.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Inputs {
    template: u64,
    binary: Fingerprint,
}

struct Epoch {
    number: u32,
    pid: u32,
    exited: watch::Receiver<Option<ExitStatus>>,
    started: Instant,
}

impl Epoch {
    fn exit_status(&self) -> Option<ExitStatus> {
        *self.exited.borrow()
    }

    fn signal(&self, signal: Signal) {
        if self.exit_status().is_none() {
            let _ = kill(Pid::from_raw(self.pid as i32), signal);
        }
    }

    async fn stop(&mut self, timeout: Duration) {
        self.signal(Signal::SIGTERM);
        if tokio::time::timeout(timeout, self.exited.wait_for(Option::is_some))
            .await
            .is_err()
        {
            tracing::warn!(epoch = self.number, pid = self.pid, "Envoy ignored SIGTERM; killing it");
            self.signal(Signal::SIGKILL);
            let _ = self.exited.wait_for(Option::is_some).await;
        }
    }
}

pub struct Supervisor {
    cfg: ProxyConfig,
    envoy: EnvoyBinary,
    admin: EnvoyAdmin,
    states: StateDir,
    metrics: ProxyMetrics,
    readiness: Readiness,
    status: Arc<Mutex<Status>>,
    id: String,
    current: Option<Epoch>,
    retiring: Vec<Epoch>,
    base_id: Option<u32>,
    /// Of the running epoch's binary.
    hot_restart_version: String,
    running_inputs: Option<Inputs>,
    /// The rendered, validated bootstrap the owned epoch runs.
    running_bootstrap: Option<PathBuf>,
    /// Inputs a restart was refused for: not retried until they change again (or SIGHUP).
    rejected: Option<Inputs>,
    /// A trigger that could not run yet (the running epoch was not LIVE).
    pending: Option<&'static str>,
    /// When the pending trigger happened (the handoff time counts from there).
    pending_since: Option<Instant>,
    superseded: Option<(String, Instant)>,
    restart_at: Option<Instant>,
    backoff: Duration,
}

enum Next {
    Continue,
    Exit,
}

/// Why [`Supervisor::run`] returned.
#[derive(Debug, PartialEq, Eq)]
pub enum Ended {
    /// SIGTERM: our Envoy drained and stopped (or, if a successor had claimed it, left to the successor).
    Stopped,
    /// A successor took our Envoy over and our last epoch has exited.
    HandedOff,
}

impl Supervisor {
    pub fn new(
        cfg: ProxyConfig,
        metrics: ProxyMetrics,
        readiness: Readiness,
        status: Arc<Mutex<Status>>,
    ) -> Result<Self, SupervisorError> {
        if cfg.parent_shutdown_time <= cfg.drain_time {
            return Err(SupervisorError::Times {
                drain: cfg.drain_time,
                parent: cfg.parent_shutdown_time,
            });
        }
        let states = StateDir::open(&cfg.state_dir)?;
        let start_ns = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let id = format!("{}-{start_ns}", std::process::id());
        status.lock().owner = id.clone();
        Ok(Self {
            envoy: EnvoyBinary::new(cfg.envoy_bin.clone()),
            admin: EnvoyAdmin::new(cfg.envoy_admin),
            states,
            metrics,
            readiness,
            status,
            id,
            current: None,
            retiring: Vec::new(),
            base_id: None,
            hot_restart_version: String::new(),
            running_inputs: None,
            running_bootstrap: None,
            rejected: None,
            pending: None,
            pending_since: None,
            superseded: None,
            restart_at: None,
            backoff: FIRST_BACKOFF,
            cfg,
        })
    }

    /// Starts (or takes over) Envoy, then supervises it until `shutdown` (drain) or until a successor took it over
    /// and the old epoch exited.
    pub async fn run(mut self, shutdown: CancellationToken) -> Result<Ended, SupervisorError> {
        self.start().await?;
        let mut hangup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()).map_err(|source| {
            SupervisorError::Spawn {
                binary: "SIGHUP handler".into(),
                source,
            }
        })?;
        let mut tick = tokio::time::interval(self.cfg.watch_interval.min(Duration::from_millis(500)));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last_watch = Instant::now();
        loop {
            let mut exited = self.current.as_ref().map(|e| e.exited.clone());
            let next = tokio::select! {
                _ = shutdown.cancelled() => {
                    self.stop().await;
                    return Ok(Ended::Stopped);
                }
                _ = hangup.recv() => {
                    tracing::info!("SIGHUP: hot restart");
                    // An explicit request retries what was refused before.
                    self.rejected = None;
                    self.hot_restart("sighup").await;
                    Next::Continue
                }
                status = wait_exit(&mut exited) => self.on_current_exit(status).await,
                _ = sleep_until(self.restart_at) => {
                    self.restart_at = None;
                    self.crash_restart().await;
                    Next::Continue
                }
                _ = tick.tick() => {
                    let watch = last_watch.elapsed() >= self.cfg.watch_interval;
                    if watch {
                        last_watch = Instant::now();
                    }
                    self.on_tick(watch).await
                }
            };
            if let Next::Exit = next {
                return Ok(Ended::HandedOff);
            }
        }
    }

    async fn start(&mut self) -> Result<(), SupervisorError> {
        if let Some(predecessor) = self.find_predecessor().await? {
            return self.take_over(predecessor).await;
        }
        self.start_fresh("start").await
    }

    /// A predecessor's live Envoy, verified through its admin, or None when nobody serves.
    async fn find_predecessor(&self) -> Result<Option<ProxyState>, SupervisorError> {
        let state = match self.states.read() {
            Ok(Some(state)) => state,
            Ok(None) => return Ok(None),
            Err(error) => {
                tracing::warn!(%error, "ignoring an unreadable state file");
                return Ok(None);
            }
        };
        if state.phase == Phase::Draining {
            tracing::info!(owner = %state.owner, "the predecessor is draining; starting a fresh Envoy");
            return Ok(None);
        }
        let admin = EnvoyAdmin::new(state.envoy_admin);
        let deadline = Instant::now() + self.cfg.live_timeout;
        let mut answered = false;
        loop {
            let last = match admin.server_info().await {
                Ok(info)
                    if info.is_live()
                        && info.restart_epoch == state.epoch
                        && info.restart_epoch > 0
                        && info.uptime_current_epoch <= self.cfg.parent_shutdown_time + PARENT_EXIT_MARGIN =>
                {
                    // Its parent may still be draining; Envoy would kill that one at once (see hot_restart).
                    answered = true;
                    "waiting for the predecessor's previous epoch to retire".to_owned()
                }
                Ok(info) if info.is_live() && info.restart_epoch == state.epoch => {
                    self.check_socket(&info)?;
                    tracing::info!(owner = %state.owner, epoch = state.epoch, base_id = state.base_id,
                        admin = %state.envoy_admin, "found the predecessor's live Envoy; taking it over");
                    return Ok(Some(state));
                }
                Ok(info) => {
                    answered = true;
                    format!("state {} at epoch {}", info.state, info.restart_epoch)
                }
                Err(error) if !answered => {
                    tracing::info!(%error, owner = %state.owner, "the state file's Envoy does not answer; starting fresh");
                    return Ok(None);
                }
                Err(error) => error.to_string(),
            };
            if Instant::now() >= deadline {
                return Err(SupervisorError::PredecessorNotLive {
                    admin: state.envoy_admin,
                    epoch: state.epoch,
                    timeout: self.cfg.live_timeout,
                    last,
                });
            }
            tokio::time::sleep(POLL * 4).await;
        }
    }

    fn check_socket(&self, info: &ServerInfo) -> Result<(), SupervisorError> {
        let ours = self
            .cfg
            .hot_restart_socket_path()
            .map(|p| p.to_string_lossy().into_owned())
            .unwrap_or_else(|| "@envoy_domain_socket".into());
        if info.socket_path != ours {
            return Err(SupervisorError::SocketMismatch {
                theirs: info.socket_path.clone(),
                ours,
            });
        }
        Ok(())
    }

    /// Reads the template and the binary's identity, renders, writes and validates the bootstrap of `epoch`.
    async fn prepare(&self, epoch: u32) -> Result<(PathBuf, Inputs), SupervisorError> {
        let path = &self.cfg.bootstrap_template;
        let template = std::fs::read_to_string(path).map_err(|source| SupervisorError::ReadTemplate {
            path: path.clone(),
            source,
        })?;
        let inputs = Inputs {
            template: aether_common::hash::fnv1a(template.as_bytes()),
            binary: self.envoy.fingerprint()?,
        };
        let rendered = bootstrap::render(&template, &self.params())?;
        let out = bootstrap_path_of(&self.states, epoch);
        aether_common::fs::write_atomic(&out, rendered.as_bytes(), 0o600).map_err(|source| {
            SupervisorError::WriteBootstrap {
                path: out.clone(),
                source,
            }
        })?;
        self.envoy.validate(&out).await?;
        Ok((out, inputs))
    }

    fn params(&self) -> BootstrapParams {
        BootstrapParams {
            node_id: self.cfg.node_name.clone(),
            node_cluster: self.cfg.node_cluster.clone(),
            xds_socket: self.cfg.xds_socket.clone(),
            ads_api_type: self.cfg.ads.api_type().to_owned(),
            admin: self.cfg.envoy_admin,
            max_heap_bytes: self.cfg.max_heap_bytes,
            max_downstream_connections: self.cfg.max_downstream_connections,
            // Envoy's own OTLP stats sink (request metrics between workloads) to the supervisor's collector.
            stats_sinks: match crate::request_metrics::stats_sinks_json(
                self.cfg
                    .telemetry
                    .otel_enabled
                    .then_some(self.cfg.telemetry.otlp_endpoint.as_str()),
            ) {
                serde_json::Value::Array(sinks) => sinks,
                _ => Vec::new(),
            },
        }
    }

    fn launch(&self, epoch: u32, base_id: BaseId, bootstrap: PathBuf) -> Launch {
        Launch {
            epoch,
            base_id,
            bootstrap,
            drain_time: self.cfg.drain_time,
            parent_shutdown_time: self.cfg.parent_shutdown_time,
            concurrency: self.cfg.concurrency,
            hot_restart_socket: self.cfg.hot_restart_socket_path(),
            log_level: self.cfg.envoy_log_level.clone(),
            log_format: self.cfg.log_format,
        }
    }

    fn spawn(&self, launch: &Launch) -> Result<Epoch, SupervisorError> {
        let mut cmd = tokio::process::Command::new(self.envoy.path());
        // Envoy's logs go where ours go (the container's stdout/stderr).
        cmd.args(launch.args())
            .stdin(Stdio::null())
            .stdout(Stdio::inherit())
            .stderr(Stdio::inherit());
        let mut child = cmd.spawn().map_err(|source| SupervisorError::Spawn {
            binary: self.envoy.path().to_owned(),
            source,
        })?;
        let pid = child.id().unwrap_or_default();
        let (tx, exited) = watch::channel(None);
        let number = launch.epoch;
        tokio::spawn(async move {
            match child.wait().await {
                Ok(status) => {
                    let _ = tx.send(Some(status));
                }
                Err(error) => tracing::error!(epoch = number, pid, %error, "waiting for Envoy failed"),
            }
        });
        tracing::info!(epoch = number, pid, args = ?launch.args(), "Envoy started");
        Ok(Epoch {
            number,
            pid,
            exited,
            started: Instant::now(),
        })
    }

    async fn wait_live(&self, epoch: &mut Epoch) -> Result<(), SupervisorError> {
        let deadline = Instant::now() + self.cfg.live_timeout;
        loop {
            if let Some(status) = epoch.exit_status() {
                return Err(SupervisorError::EpochExited {
                    epoch: epoch.number,
                    status: status.to_string(),
                });
            }
            let last = match self.admin.server_info().await {
                Ok(info) if info.is_live() && info.restart_epoch == epoch.number => return Ok(()),
                Ok(info) => format!("state {} at epoch {}", info.state, info.restart_epoch),
                Err(error) => error.to_string(),
            };
            if Instant::now() >= deadline {
                return Err(SupervisorError::NotLive {
                    epoch: epoch.number,
                    timeout: self.cfg.live_timeout,
                    last,
                });
            }
            tokio::select! {
                _ = tokio::time::sleep(POLL) => {}
                _ = epoch.exited.wait_for(Option::is_some) => {}
            }
        }
    }

    fn state(&self, epoch: &Epoch, phase: Phase) -> ProxyState {
        ProxyState {
            owner: self.id.clone(),
            owner_pid: std::process::id(),
            epoch: epoch.number,
            phase,
            base_id: self.base_id.unwrap_or_default(),
            envoy_pid: epoch.pid,
            envoy_admin: self.cfg.envoy_admin,
            hot_restart_version: self.hot_restart_version.clone(),
            hot_restart_socket: self.cfg.hot_restart_socket_path(),
            heartbeat_unix_ms: now_unix_ms(),
        }
    }

    fn store(&self, state: ProxyState) -> Result<(), SupervisorError> {
        self.states.update(|_| (Some(Some(state)), ()))?;
        Ok(())
    }

    /// Epoch 0: on start without a predecessor, and after a crash.
    async fn start_fresh(&mut self, why: &'static str) -> Result<(), SupervisorError> {
        let trigger = Instant::now();
        let (bootstrap, inputs) = match self.reuse_after_crash(why) {
            Some(reused) => reused,
            None => {
                let prepared = match self.prepare(0).await {
                    Ok(prepared) => prepared,
                    Err(error) => {
                        self.refused(&error);
                        return Err(error);
                    }
                };
                self.hot_restart_version = self.envoy.hot_restart_version().await?;
                prepared
            }
        };
        let base_id = match self.cfg.base_id {
            BaseIdMode::Fixed => BaseId::Fixed(self.cfg.base_id_value),
            BaseIdMode::Dynamic => {
                let path = self.states.path(BASE_ID_FILE);
                let _ = std::fs::remove_file(&path);
                BaseId::Dynamic(path)
            }
        };
        let mut epoch = self.spawn(&self.launch(0, base_id.clone(), bootstrap))?;
        self.base_id = match &base_id {
            BaseId::Fixed(id) => Some(*id),
            BaseId::Dynamic(path) => Some(read_base_id(path, &epoch).await?),
        };
        self.store(self.state(&epoch, Phase::Starting))?;
        if let Err(error) = self.wait_live(&mut epoch).await {
            epoch.stop(STOP_TIMEOUT).await;
            return Err(error);
        }
        self.store(self.state(&epoch, Phase::Live))?;
        self.running_inputs = Some(inputs);
        self.running_bootstrap = Some(bootstrap_path_of(&self.states, 0));
        self.became_live(epoch, trigger, why);
        Ok(())
    }

    /// After a crash with unchanged inputs, the crashed epoch's bootstrap (already validated, same binary) is
    /// reused as epoch 0's: serving again sooner matters more than re-checking what was checked.
    fn reuse_after_crash(&self, why: &str) -> Option<(PathBuf, Inputs)> {
        if why != "crash" {
            return None;
        }
        let (running, inputs) = (self.running_bootstrap.as_ref()?, self.running_inputs?);
        if self.current_inputs()? != inputs {
            return None;
        }
        let target = bootstrap_path_of(&self.states, 0);
        if running != &target {
            std::fs::copy(running, &target).ok()?;
        }
        Some((target, inputs))
    }

    /// Hot restart from a predecessor supervisor's live Envoy: same base id, its epoch + 1.
    async fn take_over(&mut self, predecessor: ProxyState) -> Result<(), SupervisorError> {
        let trigger = Instant::now();
        let number = predecessor.epoch + 1;
        let (bootstrap, inputs) = self.prepare(number).await?;
        let version = self.envoy.hot_restart_version().await?;
        if version != predecessor.hot_restart_version {
            return Err(SupervisorError::IncompatibleBinary {
                new: version,
                running: predecessor.hot_restart_version,
            });
        }
        self.hot_restart_version = version;
        self.base_id = Some(predecessor.base_id);
        let mut epoch = self.spawn(&self.launch(number, BaseId::Fixed(predecessor.base_id), bootstrap))?;
        // Claim it: from here the predecessor knows it has been superseded.
        self.store(self.state(&epoch, Phase::Starting))?;
        if let Err(error) = self.wait_live(&mut epoch).await {
            epoch.stop(STOP_TIMEOUT).await;
            // Hand it back: the predecessor's epoch still serves.
            let _ = self.store(ProxyState {
                heartbeat_unix_ms: now_unix_ms(),
                ..predecessor
            });
            return Err(error);
        }
        self.store(self.state(&epoch, Phase::Live))?;
        self.running_inputs = Some(inputs);
        self.running_bootstrap = Some(bootstrap_path_of(&self.states, number));
        self.metrics.takeovers.inc();
        tracing::info!(predecessor = %predecessor.owner, "took over the predecessor's Envoy");
        self.became_live(epoch, trigger, "takeover");
        Ok(())
    }

    fn became_live(&mut self, epoch: Epoch, trigger: Instant, why: &'static str) {
        let elapsed = trigger.elapsed();
        self.metrics.handoff_seconds.observe(elapsed.as_secs_f64());
        self.metrics.epoch.set(i64::from(epoch.number));
        self.metrics.live.set(1);
        tracing::info!(epoch = epoch.number, pid = epoch.pid, base_id = ?self.base_id, ?elapsed, why,
            "Envoy epoch LIVE");
        if let Some(old) = self.current.replace(epoch) {
            self.retiring.push(old);
        }
        self.readiness.set_ready();
        self.remove_old_bootstraps();
        let mut status = self.status.lock();
        let current = self.current.as_ref().expect("just set");
        status.epoch = Some(current.number);
        status.base_id = self.base_id;
        status.envoy_pid = Some(current.pid);
        status.live = true;
        status.retiring_pids = self.retiring.iter().map(|e| e.pid).collect();
        status.last_error = None;
    }

    /// Keeps the running and the previous epoch's bootstraps (the previous one may still be draining).
    fn remove_old_bootstraps(&self) {
        let Some(current) = self.current.as_ref().map(|e| e.number) else {
            return;
        };
        let Ok(entries) = std::fs::read_dir(self.states.path("")) else {
            return;
        };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let epoch = name
                .strip_prefix("bootstrap-epoch-")
                .and_then(|rest| rest.strip_suffix(".yaml"))
                .and_then(|n| n.parse::<u32>().ok());
            if epoch.is_some_and(|n| n + 1 < current || n > current) {
                let _ = std::fs::remove_file(entry.path());
            }
        }
    }

    fn refused(&mut self, error: &SupervisorError) {
        let reason = match error {
            SupervisorError::Envoy(super::envoy::EnvoyError::Invalid { .. }) => "invalid_bootstrap",
            SupervisorError::Render(_) => "template",
            SupervisorError::ReadTemplate { .. } => "template_unreadable",
            SupervisorError::IncompatibleBinary { .. } => "incompatible_binary",
            SupervisorError::Envoy(_) => "binary",
            _ => "other",
        };
        self.metrics
            .validation_failures
            .get_or_create(&[("reason", reason)])
            .inc();
        self.status.lock().last_error = Some(error.to_string());
        tracing::error!(%error, reason, "refusing the new bootstrap/binary; the running Envoy keeps serving");
    }

    /// Epoch + 1 from our own running epoch.
    async fn hot_restart(&mut self, why: &'static str) {
        if self.superseded.is_some() {
            tracing::info!(why, "superseded by a successor: not restarting");
            return;
        }
        let Some(current) = self.current.as_ref() else {
            tracing::info!(why, "no running Envoy to hot-restart from; a crash restart is pending");
            return;
        };
        let (running, trigger) = (current.number, Instant::now());
        // Envoy terminates a parent at once when its child becomes a parent itself: a new epoch must wait until
        // the previous one has retired, or that one's in-flight requests die with it.
        if let Some(old) = self.retiring.first() {
            if self.pending.is_none() {
                tracing::info!(
                    why,
                    retiring = old.number,
                    "hot restart waits for the previous epoch to retire"
                );
            }
            self.pending = Some(why);
            self.pending_since.get_or_insert(trigger);
            return;
        }
        let trigger = self.pending_since.take().unwrap_or(trigger);
        match self.admin.server_info().await {
            Ok(info) if info.is_live() && info.restart_epoch == running => {}
            other => {
                let last = match other {
                    Ok(info) => format!("state {} at epoch {}", info.state, info.restart_epoch),
                    Err(error) => error.to_string(),
                };
                let error = SupervisorError::CurrentNotLive { epoch: running, last };
                tracing::warn!(%error, why, "hot restart deferred");
                self.pending = Some(why);
                self.pending_since = Some(trigger);
                return;
            }
        }
        self.pending = None;
        let number = running + 1;
        // Both run the new binary; neither depends on the other.
        let (prepared, version) = tokio::join!(self.prepare(number), self.envoy.hot_restart_version());
        let (bootstrap, inputs) = match prepared {
            Ok(prepared) => prepared,
            Err(error) => {
                self.rejected = self.current_inputs();
                self.refused(&error);
                return;
            }
        };
        match version {
            Ok(version) if version == self.hot_restart_version => {}
            Ok(version) => {
                self.rejected = Some(inputs);
                self.refused(&SupervisorError::IncompatibleBinary {
                    new: version,
                    running: self.hot_restart_version.clone(),
                });
                return;
            }
            Err(error) => {
                self.rejected = Some(inputs);
                self.refused(&error.into());
                return;
            }
        }
        let base_id = self.base_id.unwrap_or(self.cfg.base_id_value);
        let mut epoch = match self.spawn(&self.launch(number, BaseId::Fixed(base_id), bootstrap)) {
            Ok(epoch) => epoch,
            Err(error) => {
                self.restart_failed(why, &error);
                return;
            }
        };
        if let Err(error) = self.store(self.state(&epoch, Phase::Starting)) {
            tracing::warn!(%error, "recording the new epoch failed");
        }
        if let Err(error) = self.wait_live(&mut epoch).await {
            epoch.stop(STOP_TIMEOUT).await;
            self.restart_failed(why, &error);
            if let Some(current) = self.current.as_ref() {
                let _ = self.store(self.state(current, Phase::Live));
            }
            return;
        }
        if let Err(error) = self.store(self.state(&epoch, Phase::Live)) {
            tracing::warn!(%error, "recording the new epoch failed");
        }
        self.running_inputs = Some(inputs);
        self.running_bootstrap = Some(bootstrap_path_of(&self.states, number));
        self.rejected = None;
        self.metrics.hot_restarts.get_or_create(&[("trigger", why)]).inc();
        self.status.lock().hot_restarts += 1;
        self.became_live(epoch, trigger, why);
    }

    fn current_inputs(&self) -> Option<Inputs> {
        let template = std::fs::read(&self.cfg.bootstrap_template).ok()?;
        Some(Inputs {
            template: aether_common::hash::fnv1a(&template),
            binary: self.envoy.fingerprint().ok()?,
        })
    }

    fn restart_failed(&mut self, why: &'static str, error: &SupervisorError) {
        let reason = match error {
            SupervisorError::EpochExited { .. } => "exited",
            SupervisorError::NotLive { .. } => "not_live",
            _ => "spawn",
        };
        self.metrics
            .hot_restart_failures
            .get_or_create(&[("reason", reason)])
            .inc();
        self.status.lock().last_error = Some(error.to_string());
        tracing::error!(%error, why, "hot restart failed; the running epoch keeps serving");
    }

    async fn on_current_exit(&mut self, status: Option<ExitStatus>) -> Next {
        let Some(epoch) = self.current.take() else {
            return Next::Continue;
        };
        let status = status.map_or_else(|| "unknown".to_owned(), |s| s.to_string());
        self.metrics.live.set(0);
        {
            let mut s = self.status.lock();
            s.live = false;
            s.envoy_pid = None;
        }
        if let Some((successor, _)) = &self.superseded {
            tracing::info!(epoch = epoch.number, %status, %successor,
                "our Envoy was retired by the successor's epoch");
            return Next::Exit;
        }
        // Did a successor claim it between two ticks?
        if self.check_superseded(epoch.number) {
            tracing::info!(epoch = epoch.number, %status, "our Envoy was retired by a successor");
            return Next::Exit;
        }
        self.metrics.crashes.inc();
        self.status.lock().crashes += 1;
        self.readiness
            .set_not_ready(format!("Envoy epoch {} exited ({status}); restarting", epoch.number));
        if epoch.started.elapsed() >= STABLE_AFTER {
            self.backoff = FIRST_BACKOFF;
        }
        tracing::error!(epoch = epoch.number, pid = epoch.pid, %status, backoff = ?self.backoff,
            "Envoy exited unexpectedly; restarting");
        self.restart_at = Some(Instant::now() + self.backoff);
        self.backoff = (self.backoff * 2).min(MAX_BACKOFF);
        Next::Continue
    }

    /// True (and remembered) when the state file names another owner at a later epoch than `ours`.
    fn check_superseded(&mut self, ours: u32) -> bool {
        let me = self.id.clone();
        match self.states.read() {
            Ok(Some(state)) if state.owner != me && state.epoch > ours => {
                if self.superseded.is_none() {
                    tracing::info!(successor = %state.owner, epoch = state.epoch,
                        "a successor supervisor is taking over our Envoy");
                    self.readiness
                        .set_not_ready(format!("superseded by {} (epoch {})", state.owner, state.epoch));
                    self.metrics.live.set(0);
                    self.status.lock().superseded_by = Some(state.owner.clone());
                    self.superseded = Some((state.owner, Instant::now()));
                }
                true
            }
            _ => false,
        }
    }

    async fn on_tick(&mut self, watch: bool) -> Next {
        self.reap_retiring();
        if self.restart_at.is_some() {
            return Next::Continue;
        }
        let Some(ours) = self.current.as_ref().map(|e| e.number) else {
            return Next::Continue;
        };
        if self.superseded.is_some() || self.check_superseded(ours) {
            return self.while_superseded().await;
        }
        if let Some(why) = self.pending
            && self.retiring.is_empty()
        {
            self.hot_restart(why).await;
            return Next::Continue;
        }
        if !watch {
            return Next::Continue;
        }
        self.heartbeat(ours);
        let Some(inputs) = self.current_inputs() else {
            return Next::Continue;
        };
        let Some(running) = self.running_inputs else {
            return Next::Continue;
        };
        if inputs != running && Some(inputs) != self.rejected {
            let why = if inputs.binary != running.binary {
                "binary_changed"
            } else {
                "bootstrap_changed"
            };
            tracing::info!(why, "inputs changed: hot restart");
            self.hot_restart(why).await;
        }
        Next::Continue
    }

    fn heartbeat(&self, ours: u32) {
        let me = self.id.clone();
        let Some(current) = self.current.as_ref() else { return };
        let fresh = self.state(current, Phase::Live);
        let result = self.states.update(|state| match state {
            Some(state) if state.owner != me && state.epoch > ours => (None, ()),
            _ => (Some(Some(fresh)), ()),
        });
        if let Err(error) = result {
            tracing::warn!(%error, "writing the state heartbeat failed");
        }
    }

    /// Waits for the successor's epoch to retire ours; if the successor vanished without taking over, serves on.
    async fn while_superseded(&mut self) -> Next {
        let Some((successor, since)) = self.superseded.clone() else {
            return Next::Continue;
        };
        let grace = self.cfg.live_timeout + self.cfg.parent_shutdown_time + Duration::from_secs(5);
        if since.elapsed() < grace {
            return Next::Continue;
        }
        let successor_alive = match self.states.read() {
            Ok(Some(state)) if state.owner == successor => kill(Pid::from_raw(state.owner_pid as i32), None).is_ok(),
            _ => false,
        };
        let ours = self.current.as_ref().map(|e| e.number);
        let live_ours =
            matches!(self.admin.server_info().await, Ok(info) if info.is_live() && Some(info.restart_epoch) == ours);
        if !successor_alive && live_ours {
            tracing::warn!(%successor, "the successor never took over and is gone; serving on");
            self.superseded = None;
            self.status.lock().superseded_by = None;
            if let Some(current) = self.current.as_ref() {
                let _ = self.store(self.state(current, Phase::Live));
            }
            self.metrics.live.set(1);
            self.readiness.set_ready();
        }
        Next::Continue
    }

    async fn crash_restart(&mut self) {
        // With a fixed base id the new epoch 0 would collide with still-draining epochs of that id.
        if self.cfg.base_id == BaseIdMode::Fixed {
            for epoch in &mut self.retiring {
                epoch.stop(STOP_TIMEOUT).await;
            }
        }
        let old_base_id = self.base_id;
        match self.start_fresh("crash").await {
            Ok(()) => {
                self.metrics.restarts.inc();
                if self.retiring.is_empty()
                    && let Some(old) = old_base_id.filter(|old| Some(*old) != self.base_id)
                {
                    // Envoy leaves its shared memory behind; nobody uses the old id any more.
                    let _ = std::fs::remove_file(shared_memory_path(old));
                }
            }
            Err(error) => {
                tracing::error!(%error, backoff = ?self.backoff, "restarting Envoy failed; retrying");
                self.status.lock().last_error = Some(error.to_string());
                self.restart_at = Some(Instant::now() + self.backoff);
                self.backoff = (self.backoff * 2).min(MAX_BACKOFF);
            }
        }
    }

    fn reap_retiring(&mut self) {
        let before = self.retiring.len();
        self.retiring.retain(|epoch| match epoch.exit_status() {
            Some(status) => {
                tracing::info!(epoch = epoch.number, pid = epoch.pid, %status, "old epoch retired");
                false
            }
            None => true,
        });
        if self.retiring.len() != before {
            self.status.lock().retiring_pids = self.retiring.iter().map(|e| e.pid).collect();
        }
    }

    /// SIGTERM: drain our Envoy's listeners for the drain time, then stop every epoch we started.
    async fn stop(&mut self) {
        self.readiness.set_not_ready("draining");
        if let Some(mut current) = self.current.take() {
            if self.superseded.is_some() || self.check_superseded(current.number) {
                // The successor's epoch retires ours; just wait for it.
                let _ = tokio::time::timeout(
                    self.cfg.parent_shutdown_time + STOP_TIMEOUT,
                    current.exited.wait_for(Option::is_some),
                )
                .await;
                return;
            }
            let me = self.id.clone();
            let draining = self.state(&current, Phase::Draining);
            let _ = self.states.update(|state| match state {
                Some(state) if state.owner != me => (None, ()),
                _ => (Some(Some(draining)), ()),
            });
            if let Err(error) = self.admin.fail_health_checks().await {
                tracing::warn!(%error, "could not fail Envoy's health checks");
            }
            match self.admin.drain_listeners_gracefully().await {
                Ok(()) => {
                    tracing::info!(drain = ?self.cfg.drain_time, "draining Envoy's listeners");
                    let _ = tokio::time::timeout(self.cfg.drain_time, current.exited.wait_for(Option::is_some)).await;
                }
                Err(error) => tracing::warn!(%error, "could not start Envoy's drain; stopping it"),
            }
            current.stop(STOP_TIMEOUT).await;
            let _ = self.states.update(|state| match state {
                Some(state) if state.owner == me => (Some(None), ()),
                _ => (None, ()),
            });
        }
        for epoch in &mut self.retiring {
            epoch.stop(STOP_TIMEOUT).await;
        }
        self.metrics.live.set(0);
        // Envoy leaves its hot-restart shared memory behind; nothing of this base id runs any more.
        if let Some(base_id) = self.base_id {
            let _ = std::fs::remove_file(shared_memory_path(base_id));
        }
        tracing::info!("Envoy stopped");
    }
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at.into()).await,
        None => std::future::pending().await,
    }
}

async fn wait_exit(exited: &mut Option<watch::Receiver<Option<ExitStatus>>>) -> Option<ExitStatus> {
    match exited {
        Some(rx) => match rx.wait_for(Option::is_some).await {
            Ok(status) => *status,
            Err(_) => None,
        },
        None => std::future::pending().await,
    }
}

/// Where Envoy keeps the hot-restart shared memory of `base_id` (it scales the id by 10).
fn shared_memory_path(base_id: u32) -> PathBuf {
    PathBuf::from(format!("/dev/shm/envoy_shared_memory_{}", u64::from(base_id) * 10))
}

fn bootstrap_path_of(states: &StateDir, epoch: u32) -> PathBuf {
    states.path(&format!("bootstrap-epoch-{epoch}.yaml"))
}

/// Envoy writes the base id it picked early in its start; wait for it (or for Envoy to die).
async fn read_base_id(path: &std::path::Path, epoch: &Epoch) -> Result<u32, SupervisorError> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(text) = std::fs::read_to_string(path)
            && let Ok(id) = text.trim().parse()
        {
            return Ok(id);
        }
        if let Some(status) = epoch.exit_status() {
            return Err(SupervisorError::BaseId {
                path: path.to_owned(),
                reason: format!("Envoy exited first ({status})"),
            });
        }
        if Instant::now() >= deadline {
            return Err(SupervisorError::BaseId {
                path: path.to_owned(),
                reason: "Envoy did not write it within 30s".into(),
            });
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
