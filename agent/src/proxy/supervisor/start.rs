//! Epochs that do not hot-restart from one of ours: the first one (a fresh epoch 0, or a takeover of a
//! predecessor's Envoy) and epoch 0 again after a crash.

use std::path::PathBuf;

use tokio::time::Instant;

use super::super::config::BaseIdMode;
use super::super::envoy::BaseId;
use super::super::epoch::read_base_id;
use super::super::machine::{Event, Inputs, Trigger};
use super::super::predecessor::{self, Verdict};
use super::super::state::{Phase, ProxyState, now_unix_ms};
use super::launch::POLL;
use super::{BASE_ID_FILE, Host, STOP_TIMEOUT, Supervisor, SupervisorError, bootstrap_path_of};

impl<H: Host> Supervisor<H> {
    /// Takes over a predecessor's live Envoy, or starts a fresh one.
    pub(super) async fn start(&mut self) -> Result<(), SupervisorError> {
        let live = match self.find_predecessor().await? {
            Some(predecessor) => self.take_over(predecessor).await?,
            None => self.start_fresh(Trigger::Start, None).await?,
        };
        self.handle(live).await;
        Ok(())
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
        let deadline = Instant::now() + self.cfg.live_timeout;
        let mut answered = false;
        loop {
            let answer = self.host.server_info(state.envoy_admin).await;
            let last = match predecessor::judge(&answer, state.epoch, answered, self.cfg.parent_shutdown_time) {
                Verdict::TakeOver => {
                    if let Ok(info) = &answer {
                        predecessor::check_socket(info, self.cfg.hot_restart_socket_path().as_deref())?;
                    }
                    tracing::info!(owner = %state.owner, epoch = state.epoch, base_id = state.base_id,
                        admin = %state.envoy_admin, "found the predecessor's live Envoy; taking it over");
                    return Ok(Some(state));
                }
                Verdict::StartFresh => {
                    let error = answer.err().map(|e| e.to_string()).unwrap_or_default();
                    tracing::info!(%error, owner = %state.owner, "the state file's Envoy does not answer; starting fresh");
                    return Ok(None);
                }
                Verdict::Wait(last) => last,
            };
            answered = true;
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

    /// Hot restart from a predecessor supervisor's live Envoy: same base id, its epoch + 1.
    async fn take_over(&mut self, predecessor: ProxyState) -> Result<Event, SupervisorError> {
        let trigger = Instant::now();
        let number = predecessor.epoch + 1;
        let (bootstrap, inputs) = self.prepare(number).await?;
        let version = self.host.hot_restart_version().await?;
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
            epoch.stop(&self.host, STOP_TIMEOUT).await;
            // Hand it back: the predecessor's epoch still serves.
            let _ = self.store(ProxyState {
                heartbeat_unix_ms: now_unix_ms(),
                ..predecessor
            });
            return Err(error);
        }
        self.store(self.state(&epoch, Phase::Live))?;
        self.running_bootstrap = Some(bootstrap_path_of(&self.states, number));
        self.metrics.takeovers.inc();
        tracing::info!(predecessor = %predecessor.owner, "took over the predecessor's Envoy");
        Ok(self.became_live(epoch, trigger, Trigger::Takeover, inputs))
    }

    /// Epoch 0: on start without a predecessor, and after a crash (from the crashed epoch's bootstrap while the
    /// inputs are still `reuse`).
    async fn start_fresh(&mut self, why: Trigger, reuse: Option<Inputs>) -> Result<Event, SupervisorError> {
        let trigger = Instant::now();
        let (bootstrap, inputs) = match self.reuse_bootstrap(reuse) {
            Some(reused) => reused,
            None => {
                let prepared = self.prepare(0).await.inspect_err(|error| self.refused(error))?;
                self.hot_restart_version = self.host.hot_restart_version().await?;
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
            epoch.stop(&self.host, STOP_TIMEOUT).await;
            return Err(error);
        }
        self.store(self.state(&epoch, Phase::Live))?;
        self.running_bootstrap = Some(bootstrap_path_of(&self.states, 0));
        Ok(self.became_live(epoch, trigger, why, inputs))
    }

    /// After a crash with unchanged inputs, the crashed epoch's bootstrap (already validated, same binary) is
    /// reused as epoch 0's: serving again sooner matters more than re-checking what was checked.
    fn reuse_bootstrap(&self, reuse: Option<Inputs>) -> Option<(PathBuf, Inputs)> {
        let (running, inputs) = (self.running_bootstrap.as_ref()?, reuse?);
        if self.current_inputs()? != inputs {
            return None;
        }
        let target = bootstrap_path_of(&self.states, 0);
        if running != &target {
            std::fs::copy(running, &target).ok()?;
        }
        Some((target, inputs))
    }

    /// A fresh epoch 0 (new dynamic base id) after a crash; the machine retries with backoff if it fails.
    pub(super) async fn crash_restart(&mut self, reuse: Option<Inputs>) -> Event {
        let old_base_id = self.base_id;
        match self.start_fresh(Trigger::Crash, reuse).await {
            Ok(live) => {
                self.metrics.restarts.inc();
                if self.retiring.is_empty()
                    && let Some(old) = old_base_id.filter(|old| Some(*old) != self.base_id)
                {
                    // Nobody uses the old id any more.
                    self.host.remove_shared_memory(old);
                }
                live
            }
            Err(error) => {
                tracing::error!(%error, backoff = ?self.machine.backoff(), "restarting Envoy failed; retrying");
                self.status.lock().last_error = Some(error.to_string());
                Event::StartFailed
            }
        }
    }
}
