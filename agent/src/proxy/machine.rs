//! The supervisor's decisions, apart from its I/O: which epoch is ours, when a trigger may become a hot restart, how
//! long a crashed Envoy waits before it starts again, and when our Envoy belongs to a successor. [`Machine::on`]
//! takes an [`Event`] and answers [`Action`]s; the supervisor performs them and reports their outcomes as further
//! events. Time comes in with each event, so tests drive it with a paused clock.

use std::time::Duration;

use tokio::time::Instant;

use super::envoy::Fingerprint;

/// The first crash restart waits this long, each further one twice as long as the one before, up to [`MAX_BACKOFF`].
pub const FIRST_BACKOFF: Duration = Duration::from_millis(100);
pub const MAX_BACKOFF: Duration = Duration::from_secs(10);
/// An epoch that lived this long resets the crash backoff.
pub const STABLE_AFTER: Duration = Duration::from_secs(60);

/// The inputs an epoch was started from; a change to either triggers a hot restart.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Inputs {
    pub template: u64,
    pub binary: Fingerprint,
}

/// Why a new epoch starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Trigger {
    Start,
    Takeover,
    Crash,
    Sighup,
    BinaryChanged,
    BootstrapChanged,
}

impl Trigger {
    /// The `trigger` label of `aether_proxy_hot_restarts_total`, and `why` in the logs.
    pub fn label(self) -> &'static str {
        match self {
            Trigger::Start => "start",
            Trigger::Takeover => "takeover",
            Trigger::Crash => "crash",
            Trigger::Sighup => "sighup",
            Trigger::BinaryChanged => "binary_changed",
            Trigger::BootstrapChanged => "bootstrap_changed",
        }
    }
}

/// Who the state file says owns the Envoy, at which epoch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    pub owner: String,
    pub epoch: u32,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// SIGHUP: a hot restart that also retries inputs refused before.
    Hangup,
    /// The periodic tick. `watch` ticks (every watch interval) heartbeat and compare `inputs`, the template's and
    /// the binary's as they are now (None when unreadable, or on other ticks).
    Tick {
        watch: bool,
        inputs: Option<Inputs>,
        record: Option<Record>,
    },
    /// Our running epoch exited.
    Exited { status: String, record: Option<Record> },
    /// An old epoch exited: Envoy's parent shutdown retired it.
    Retired { epoch: u32 },
    /// The crash-restart deadline ([`Machine::restart_at`]) passed.
    RestartDue,
    /// SIGTERM.
    Shutdown { record: Option<Record> },
    /// The answer to [`Action::Probe`].
    Probed { live: bool },
    /// A new epoch of ours is LIVE: the first one, a takeover, [`Action::StartFresh`] or [`Action::HotRestart`].
    Live {
        epoch: u32,
        pid: u32,
        spawned: Instant,
        inputs: Inputs,
    },
    /// [`Action::HotRestart`] refused the new bootstrap or binary, seen as `inputs`: not retried until they change.
    Refused { inputs: Option<Inputs> },
    /// [`Action::HotRestart`]'s new epoch did not become LIVE; the running one serves on.
    RestartFailed,
    /// [`Action::StartFresh`] did not bring an epoch up.
    StartFailed,
    /// The answer to [`Action::CheckSuccessor`].
    SuccessorChecked { successor_alive: bool, ours_live: bool },
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Ask Envoy's admin whether our `epoch` is LIVE: Envoy refuses to hot-restart from an initializing parent.
    Probe { epoch: u32, why: Trigger },
    /// Validate the inputs and start `epoch` (ours + 1) from the running one; the handoff counts from `since`.
    HotRestart { epoch: u32, why: Trigger, since: Instant },
    /// Stop the old epochs still retiring: with a fixed base id a new epoch 0 would collide with them.
    StopRetiring,
    /// Start a fresh epoch 0 after a crash, from the crashed epoch's bootstrap if the inputs are still `reuse`.
    StartFresh { reuse: Option<Inputs> },
    /// Write the state file's heartbeat.
    Heartbeat,
    /// A successor's claim names our Envoy: report not ready until it retires our epoch.
    Superseded { by: String, epoch: u32 },
    /// The successor's epoch retired ours: supervising is over.
    HandOff,
    /// Our epoch crashed: report not ready; it starts again in `restart_in`.
    Crashed {
        epoch: u32,
        status: String,
        restart_in: Duration,
    },
    /// Is the successor that claimed our Envoy still there, and is our `epoch` still LIVE?
    CheckSuccessor { successor: String, epoch: u32 },
    /// The successor vanished without taking over: our epoch is ours again.
    Reclaim,
    /// SIGTERM while superseded: wait until the successor's epoch retires ours.
    AwaitRetirement,
    /// SIGTERM: drain and stop our running `epoch` (None while a crash restart waits), then the retiring ones.
    Drain { epoch: Option<u32> },
}

/// What the decisions depend on besides events.
#[derive(Clone, Debug)]
pub struct Rules {
    /// This supervisor's owner id in the state file.
    pub me: String,
    /// Every epoch uses one fixed base id (`--base-id fixed`).
    pub fixed_base_id: bool,
    /// How long a successor's claim may stand without its epoch retiring ours before we look for the successor.
    pub successor_grace: Duration,
}

#[derive(Clone, Copy, Debug)]
struct Running {
    epoch: u32,
    pid: u32,
    spawned: Instant,
}

/// A hot restart asked for `why`, first asked for at `since`.
#[derive(Clone, Copy, Debug)]
struct Request {
    why: Trigger,
    since: Instant,
}

#[derive(Clone, Debug)]
struct Superseded {
    by: String,
    since: Instant,
}

pub struct Machine {
    rules: Rules,
    current: Option<Running>,
    /// Old epochs of ours that Envoy's parent shutdown has not retired yet, oldest first.
    retiring: Vec<u32>,
    /// The inputs the running epoch was started from.
    running_inputs: Option<Inputs>,
    /// Inputs a restart was refused for: not retried until they change again (or SIGHUP).
    rejected: Option<Inputs>,
    /// A hot restart that could not run yet (an old epoch still retiring, or ours not LIVE).
    pending: Option<Request>,
    /// The hot restart in progress, from its probe to its outcome.
    in_progress: Option<Request>,
    superseded: Option<Superseded>,
    restart_at: Option<Instant>,
    backoff: Duration,
}

impl Machine {
    pub fn new(rules: Rules) -> Self {
        Self {
            rules,
            current: None,
            retiring: Vec::new(),
            running_inputs: None,
            rejected: None,
            pending: None,
            in_progress: None,
            superseded: None,
            restart_at: None,
            backoff: FIRST_BACKOFF,
        }
    }

    /// When a crashed Envoy starts again ([`Event::RestartDue`]).
    pub fn restart_at(&self) -> Option<Instant> {
        self.restart_at
    }

    /// How long the next crash restart would wait.
    pub fn backoff(&self) -> Duration {
        self.backoff
    }

    pub fn on(&mut self, now: Instant, event: Event) -> Vec<Action> {
        match event {
            Event::Hangup => {
                // An explicit request retries what was refused before.
                self.rejected = None;
                self.request(now, Trigger::Sighup)
            }
            Event::Tick { watch, inputs, record } => self.tick(now, watch, inputs, record),
            Event::Exited { status, record } => self.exited(now, status, record),
            Event::Retired { epoch } => {
                self.retiring.retain(|old| *old != epoch);
                Vec::new()
            }
            Event::RestartDue => self.restart_due(),
            Event::Shutdown { record } => self.shutdown(now, record),
            Event::Probed { live } => self.probed(live),
            Event::Live {
                epoch,
                pid,
                spawned,
                inputs,
            } => {
                self.live(Running { epoch, pid, spawned }, inputs);
                Vec::new()
            }
            Event::Refused { inputs } => {
                self.in_progress = None;
                self.rejected = inputs;
                Vec::new()
            }
            Event::RestartFailed => {
                self.in_progress = None;
                Vec::new()
            }
            Event::StartFailed => {
                self.schedule_restart(now);
                Vec::new()
            }
            Event::SuccessorChecked {
                successor_alive,
                ours_live,
            } => self.successor_checked(successor_alive, ours_live),
        }
    }

    /// A hot restart from our running epoch, now or once nothing stands in its way.
    fn request(&mut self, now: Instant, why: Trigger) -> Vec<Action> {
        if self.superseded.is_some() {
            tracing::info!(why = why.label(), "superseded by a successor: not restarting");
            return Vec::new();
        }
        let Some(current) = self.current else {
            tracing::info!(
                why = why.label(),
                "no running Envoy to hot-restart from; a crash restart is pending"
            );
            return Vec::new();
        };
        let request = Request {
            why,
            since: self.pending.map_or(now, |pending| pending.since),
        };
        // Envoy terminates a parent at once when its child becomes a parent itself: a new epoch must wait until
        // the previous one has retired, or that one's in-flight requests die with it.
        if let Some(&old) = self.retiring.first() {
            if self.pending.is_none() {
                tracing::info!(
                    why = why.label(),
                    retiring = old,
                    "hot restart waits for the previous epoch to retire"
                );
            }
            self.pending = Some(request);
            return Vec::new();
        }
        // One restart at a time: this one follows the one in progress.
        if self.in_progress.is_some() {
            self.pending = Some(request);
            return Vec::new();
        }
        self.pending = None;
        self.in_progress = Some(request);
        vec![Action::Probe {
            epoch: current.epoch,
            why,
        }]
    }

    fn probed(&mut self, live: bool) -> Vec<Action> {
        let (Some(request), Some(current)) = (self.in_progress, self.current) else {
            return Vec::new();
        };
        if !live {
            // Kept and retried on the next tick.
            self.in_progress = None;
            self.pending = Some(request);
            return Vec::new();
        }
        vec![Action::HotRestart {
            epoch: current.epoch + 1,
            why: request.why,
            since: request.since,
        }]
    }

    fn live(&mut self, epoch: Running, inputs: Inputs) {
        if let Some(old) = self.current.replace(epoch) {
            // A hot restart: Envoy's parent shutdown retires the old epoch.
            self.retiring.push(old.epoch);
            self.rejected = None;
        }
        self.running_inputs = Some(inputs);
        self.in_progress = None;
    }

    fn tick(&mut self, now: Instant, watch: bool, inputs: Option<Inputs>, record: Option<Record>) -> Vec<Action> {
        if self.restart_at.is_some() {
            return Vec::new();
        }
        let Some(ours) = self.current.map(|c| c.epoch) else {
            return Vec::new();
        };
        if let Some(superseded) = &self.superseded {
            if now.duration_since(superseded.since) < self.rules.successor_grace {
                return Vec::new();
            }
            return vec![Action::CheckSuccessor {
                successor: superseded.by.clone(),
                epoch: ours,
            }];
        }
        if let Some(superseded) = self.supersede(now, ours, record) {
            return vec![superseded];
        }
        if let Some(pending) = self.pending
            && self.retiring.is_empty()
        {
            return self.request(now, pending.why);
        }
        if !watch {
            return Vec::new();
        }
        let mut actions = vec![Action::Heartbeat];
        if let (Some(inputs), Some(running)) = (inputs, self.running_inputs)
            && inputs != running
            && Some(inputs) != self.rejected
        {
            let why = if inputs.binary != running.binary {
                Trigger::BinaryChanged
            } else {
                Trigger::BootstrapChanged
            };
            tracing::info!(why = why.label(), "inputs changed: hot restart");
            actions.extend(self.request(now, why));
        }
        actions
    }

    /// A claim in the state file by another owner at a later epoch than `ours` means a successor is taking our
    /// Envoy over.
    fn supersede(&mut self, now: Instant, ours: u32, record: Option<Record>) -> Option<Action> {
        let claim = record.filter(|r| r.owner != self.rules.me && r.epoch > ours)?;
        tracing::info!(successor = %claim.owner, epoch = claim.epoch,
            "a successor supervisor is taking over our Envoy");
        self.superseded = Some(Superseded {
            by: claim.owner.clone(),
            since: now,
        });
        Some(Action::Superseded {
            by: claim.owner,
            epoch: claim.epoch,
        })
    }

    fn exited(&mut self, now: Instant, status: String, record: Option<Record>) -> Vec<Action> {
        let Some(gone) = self.current.take() else {
            return Vec::new();
        };
        if let Some(superseded) = &self.superseded {
            tracing::info!(epoch = gone.epoch, %status, successor = %superseded.by,
                "our Envoy was retired by the successor's epoch");
            return vec![Action::HandOff];
        }
        // Did a successor claim it between two ticks?
        if let Some(superseded) = self.supersede(now, gone.epoch, record) {
            tracing::info!(epoch = gone.epoch, %status, "our Envoy was retired by a successor");
            return vec![superseded, Action::HandOff];
        }
        if now.duration_since(gone.spawned) >= STABLE_AFTER {
            self.backoff = FIRST_BACKOFF;
        }
        let restart_in = self.backoff;
        tracing::error!(epoch = gone.epoch, pid = gone.pid, %status, backoff = ?restart_in,
            "Envoy exited unexpectedly; restarting");
        self.schedule_restart(now);
        vec![Action::Crashed {
            epoch: gone.epoch,
            status,
            restart_in,
        }]
    }

    fn schedule_restart(&mut self, now: Instant) {
        self.restart_at = Some(now + self.backoff);
        self.backoff = (self.backoff * 2).min(MAX_BACKOFF);
    }

    fn restart_due(&mut self) -> Vec<Action> {
        self.restart_at = None;
        let mut actions = Vec::new();
        if self.rules.fixed_base_id && !self.retiring.is_empty() {
            actions.push(Action::StopRetiring);
        }
        actions.push(Action::StartFresh {
            reuse: self.running_inputs,
        });
        actions
    }

    fn successor_checked(&mut self, successor_alive: bool, ours_live: bool) -> Vec<Action> {
        if successor_alive || !ours_live {
            return Vec::new();
        }
        let Some(superseded) = self.superseded.take() else {
            return Vec::new();
        };
        tracing::warn!(successor = %superseded.by, "the successor never took over and is gone; serving on");
        vec![Action::Reclaim]
    }

    fn shutdown(&mut self, now: Instant, record: Option<Record>) -> Vec<Action> {
        let Some(current) = self.current.take() else {
            return vec![Action::Drain { epoch: None }];
        };
        if self.superseded.is_some() {
            return vec![Action::AwaitRetirement];
        }
        match self.supersede(now, current.epoch, record) {
            Some(superseded) => vec![superseded, Action::AwaitRetirement],
            None => vec![Action::Drain {
                epoch: Some(current.epoch),
            }],
        }
    }
}

#[cfg(test)]
mod tests;
