//! Epoch + 1 from our own running epoch, which serves on whatever happens to the new one.

use tokio::time::Instant;

use super::super::envoy::BaseId;
use super::super::machine::{Event, Trigger};
use super::super::state::Phase;
use super::{Host, STOP_TIMEOUT, Supervisor, SupervisorError, bootstrap_path_of};

impl<H: Host> Supervisor<H> {
    /// Whether our running `epoch` answers LIVE: Envoy refuses to hot-restart from a parent still initializing.
    pub(super) async fn probe(&self, epoch: u32, why: Trigger) -> Event {
        let last = match self.host.server_info(self.cfg.envoy_admin).await {
            Ok(info) if info.is_live() && info.restart_epoch == epoch => return Event::Probed { live: true },
            Ok(info) => format!("state {} at epoch {}", info.state, info.restart_epoch),
            Err(error) => error.to_string(),
        };
        let error = SupervisorError::CurrentNotLive { epoch, last };
        tracing::warn!(%error, why = why.label(), "hot restart deferred");
        Event::Probed { live: false }
    }

    /// Validates the inputs, starts `number` with our base id and waits until it is LIVE; the handoff counts from
    /// `since`, when the restart was first asked for.
    pub(super) async fn hot_restart(&mut self, number: u32, why: Trigger, since: Instant) -> Event {
        // Both run the new binary; neither depends on the other.
        let (prepared, version) = tokio::join!(self.prepare(number), self.host.hot_restart_version());
        let (bootstrap, inputs) = match prepared {
            Ok(prepared) => prepared,
            Err(error) => {
                self.refused(&error);
                let inputs = self.current_inputs();
                return Event::Refused { inputs };
            }
        };
        let refusal = match version {
            Ok(version) if version == self.hot_restart_version => None,
            Ok(version) => Some(SupervisorError::IncompatibleBinary {
                new: version,
                running: self.hot_restart_version.clone(),
            }),
            Err(error) => Some(error.into()),
        };
        if let Some(error) = refusal {
            self.refused(&error);
            return Event::Refused { inputs: Some(inputs) };
        }
        let base_id = self.base_id.unwrap_or(self.cfg.base_id_value);
        let mut epoch = match self.spawn(&self.launch(number, BaseId::Fixed(base_id), bootstrap)) {
            Ok(epoch) => epoch,
            Err(error) => return self.restart_failed(why, &error),
        };
        if let Err(error) = self.store(self.state(&epoch, Phase::Starting)) {
            tracing::warn!(%error, "recording the new epoch failed");
        }
        if let Err(error) = self.wait_live(&mut epoch).await {
            epoch.stop(&self.host, STOP_TIMEOUT).await;
            let failed = self.restart_failed(why, &error);
            // The state file names the running epoch again.
            if let Some(current) = self.current.as_ref() {
                let _ = self.store(self.state(current, Phase::Live));
            }
            return failed;
        }
        if let Err(error) = self.store(self.state(&epoch, Phase::Live)) {
            tracing::warn!(%error, "recording the new epoch failed");
        }
        self.running_bootstrap = Some(bootstrap_path_of(&self.states, number));
        self.metrics
            .hot_restarts
            .get_or_create(&[("trigger", why.label())])
            .inc();
        self.status.lock().hot_restarts += 1;
        self.became_live(epoch, since, why, inputs)
    }

    fn restart_failed(&self, why: Trigger, error: &SupervisorError) -> Event {
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
        tracing::error!(%error, why = why.label(), "hot restart failed; the running epoch keeps serving");
        Event::RestartFailed
    }
}
