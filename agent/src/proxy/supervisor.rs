//! The supervisor: performs what its [`Machine`] decides — one owned Envoy epoch at a time, hot restarts onto
//! validated bootstraps, takeover of a predecessor's Envoy, crash restarts with backoff, drain on SIGTERM — through a
//! [`Host`], and reports back what happened. Starting epochs is in `start`, stopping them in `stop`.

mod hot_restart;
mod launch;
mod start;
mod stop;
#[cfg(test)]
mod tests;

use parking_lot::Mutex;
use std::collections::VecDeque;
use std::path::PathBuf;
use std::process::ExitStatus;
use std::sync::Arc;
use std::time::Duration;

use aether_common::readiness::Gate;
use futures::{Stream, StreamExt};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::config::{BaseIdMode, ProxyConfig};
use super::epoch::{Epoch, exit_of};
use super::host::{Host, LocalHost};
use super::machine::{Action, Event, Machine, Record, Rules};
use super::metrics::ProxyMetrics;
use super::state::{Phase, ProxyState, StateDir, now_unix_ms};

/// Envoy writes the base id it picked here (`--base-id-path`).
pub const BASE_ID_FILE: &str = "base-id";
/// How long Envoy gets after SIGTERM before SIGKILL.
const STOP_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a successor's claim may stand beyond a handoff's own time before we look for the successor.
const SUCCESSOR_MARGIN: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub enum SupervisorError {
    #[error("bootstrap template {path}: {source}")]
    ReadTemplate { path: PathBuf, source: std::io::Error },
    #[error(transparent)]
    Render(#[from] super::bootstrap::BootstrapError),
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
    #[error("reading the base id Envoy picked from {path}: Envoy exited first ({status})")]
    BaseIdExited { path: PathBuf, status: ExitStatus },
    #[error("reading the base id Envoy picked from {path}: Envoy did not write it within {timeout:?}")]
    BaseIdTimeout { path: PathBuf, timeout: Duration },
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

/// Why [`Supervisor::run`] returned.
#[derive(Debug, PartialEq, Eq)]
pub enum Ended {
    /// SIGTERM: our Envoy drained and stopped (or, if a successor had claimed it, left to the successor).
    Stopped,
    /// A successor took our Envoy over and our last epoch has exited.
    HandedOff,
}

/// What performing one action led to.
enum Outcome {
    Done,
    Then(Event),
    End(Ended),
}

pub struct Supervisor<H: Host = LocalHost> {
    cfg: ProxyConfig,
    host: H,
    states: StateDir,
    metrics: ProxyMetrics,
    /// The `envoy` readiness gate: open while our Envoy is LIVE and not draining.
    readiness: Gate,
    status: Arc<Mutex<Status>>,
    id: String,
    machine: Machine,
    /// The processes of the epochs the machine counts as ours: running, and old ones not retired yet.
    current: Option<Epoch>,
    retiring: Vec<Epoch>,
    base_id: Option<u32>,
    /// Of the running epoch's binary.
    hot_restart_version: String,
    /// The rendered, validated bootstrap the owned epoch runs.
    running_bootstrap: Option<PathBuf>,
}

impl Supervisor<LocalHost> {
    pub fn new(
        cfg: ProxyConfig,
        metrics: ProxyMetrics,
        readiness: Gate,
        status: Arc<Mutex<Status>>,
    ) -> Result<Self, SupervisorError> {
        let host = LocalHost::new(cfg.envoy_bin.clone());
        Self::with_host(cfg, host, metrics, readiness, status)
    }
}

impl<H: Host> Supervisor<H> {
    pub fn with_host(
        cfg: ProxyConfig,
        host: H,
        metrics: ProxyMetrics,
        readiness: Gate,
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
        let machine = Machine::new(Rules {
            me: id.clone(),
            fixed_base_id: cfg.base_id == BaseIdMode::Fixed,
            successor_grace: cfg.live_timeout + cfg.parent_shutdown_time + SUCCESSOR_MARGIN,
        });
        Ok(Self {
            host,
            states,
            metrics,
            readiness,
            status,
            id,
            machine,
            current: None,
            retiring: Vec::new(),
            base_id: None,
            hot_restart_version: String::new(),
            running_bootstrap: None,
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
        let hangups = futures::stream::poll_fn(move |cx| hangup.poll_recv(cx));
        Ok(self.supervise(shutdown, hangups).await)
    }

    /// Turns what happens into events for the machine, one at a time.
    async fn supervise(mut self, shutdown: CancellationToken, mut hangups: impl Stream<Item = ()> + Unpin) -> Ended {
        let mut tick = tokio::time::interval(self.cfg.watch_interval.min(Duration::from_millis(500)));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last_watch = Instant::now();
        loop {
            let mut exited = self.current.as_ref().map(|e| e.exited.clone());
            let events = tokio::select! {
                _ = shutdown.cancelled() => {
                    self.readiness.set_not_ready("draining");
                    vec![Event::Shutdown { record: self.record() }]
                }
                Some(()) = hangups.next() => {
                    tracing::info!("SIGHUP: hot restart");
                    vec![Event::Hangup]
                }
                status = exit_of(&mut exited) => vec![self.exited(status)],
                _ = sleep_until(self.machine.restart_at()) => vec![Event::RestartDue],
                _ = tick.tick() => {
                    let watch = last_watch.elapsed() >= self.cfg.watch_interval;
                    if watch {
                        last_watch = Instant::now();
                    }
                    let mut events = self.reap_retiring();
                    events.push(self.tick(watch));
                    events
                }
            };
            for event in events {
                if let Some(ended) = self.handle(event).await {
                    return ended;
                }
            }
        }
    }

    /// Performs the machine's answer to `event`, feeding outcomes back, until nothing is left to do.
    async fn handle(&mut self, event: Event) -> Option<Ended> {
        let mut actions = VecDeque::from(self.machine.on(Instant::now(), event));
        while let Some(action) = actions.pop_front() {
            match self.perform(action).await {
                Outcome::Done => {}
                Outcome::Then(event) => {
                    for next in self.machine.on(Instant::now(), event).into_iter().rev() {
                        actions.push_front(next);
                    }
                }
                Outcome::End(ended) => return Some(ended),
            }
        }
        None
    }

    async fn perform(&mut self, action: Action) -> Outcome {
        match action {
            Action::Probe { epoch, why } => Outcome::Then(self.probe(epoch, why).await),
            Action::HotRestart { epoch, why, since } => Outcome::Then(self.hot_restart(epoch, why, since).await),
            Action::StopRetiring => {
                for epoch in &mut self.retiring {
                    epoch.stop(&self.host, STOP_TIMEOUT).await;
                }
                Outcome::Done
            }
            Action::StartFresh { reuse } => Outcome::Then(self.crash_restart(reuse).await),
            Action::Heartbeat => {
                self.heartbeat();
                Outcome::Done
            }
            Action::Superseded { by, epoch } => {
                self.readiness
                    .set_not_ready(format!("superseded by {by} (epoch {epoch})"));
                self.metrics.live.set(0);
                self.status.lock().superseded_by = Some(by);
                Outcome::Done
            }
            Action::HandOff => Outcome::End(Ended::HandedOff),
            Action::Crashed { epoch, status, .. } => {
                self.metrics.crashes.inc();
                self.status.lock().crashes += 1;
                self.readiness
                    .set_not_ready(format!("Envoy epoch {epoch} exited ({status}); restarting"));
                Outcome::Done
            }
            Action::CheckSuccessor { successor, epoch } => Outcome::Then(self.check_successor(&successor, epoch).await),
            Action::Reclaim => {
                self.reclaim();
                Outcome::Done
            }
            Action::AwaitRetirement => {
                self.await_retirement().await;
                Outcome::End(Ended::Stopped)
            }
            Action::Drain { .. } => {
                self.drain().await;
                Outcome::End(Ended::Stopped)
            }
        }
    }

    /// Who the state file says owns the Envoy now.
    fn record(&self) -> Option<Record> {
        let state = self.states.read().ok().flatten()?;
        Some(Record {
            owner: state.owner,
            epoch: state.epoch,
        })
    }

    fn exited(&mut self, status: Option<ExitStatus>) -> Event {
        self.current = None;
        self.metrics.live.set(0);
        {
            let mut s = self.status.lock();
            s.live = false;
            s.envoy_pid = None;
        }
        Event::Exited {
            status: status.map_or_else(|| "unknown".to_owned(), |s| s.to_string()),
            record: self.record(),
        }
    }

    /// The template and the binary are read only every watch interval.
    fn tick(&self, watch: bool) -> Event {
        Event::Tick {
            watch,
            inputs: if watch { self.current_inputs() } else { None },
            record: self.record(),
        }
    }

    fn reap_retiring(&mut self) -> Vec<Event> {
        let mut retired = Vec::new();
        self.retiring.retain(|epoch| match epoch.exit_status() {
            Some(status) => {
                tracing::info!(epoch = epoch.number, pid = epoch.pid, %status, "old epoch retired");
                retired.push(Event::Retired { epoch: epoch.number });
                false
            }
            None => true,
        });
        if !retired.is_empty() {
            self.status.lock().retiring_pids = self.retiring.iter().map(|e| e.pid).collect();
        }
        retired
    }

    fn heartbeat(&self) {
        let Some(current) = self.current.as_ref() else { return };
        let (me, ours) = (self.id.clone(), current.number);
        let fresh = self.state(current, Phase::Live);
        let result = self.states.update(|state| match state {
            Some(state) if state.owner != me && state.epoch > ours => (None, ()),
            _ => (Some(Some(fresh)), ()),
        });
        if let Err(error) = result {
            tracing::warn!(%error, "writing the state heartbeat failed");
        }
    }

    /// Is the successor that claimed our Envoy still there, and does our `epoch` still answer LIVE?
    async fn check_successor(&self, successor: &str, epoch: u32) -> Event {
        let successor_alive = match self.states.read() {
            Ok(Some(state)) if state.owner == successor => self.host.is_alive(state.owner_pid),
            _ => false,
        };
        let ours_live = matches!(self.host.server_info(self.cfg.envoy_admin).await,
            Ok(info) if info.is_live() && info.restart_epoch == epoch);
        Event::SuccessorChecked {
            successor_alive,
            ours_live,
        }
    }

    fn reclaim(&self) {
        self.status.lock().superseded_by = None;
        if let Some(current) = self.current.as_ref() {
            let _ = self.store(self.state(current, Phase::Live));
        }
        self.metrics.live.set(1);
        self.readiness.set_ready();
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
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

fn bootstrap_path_of(states: &StateDir, epoch: u32) -> PathBuf {
    states.path(&format!("bootstrap-epoch-{epoch}.yaml"))
}
