//! SIGTERM: drain and stop our Envoy, or, when a successor owns it, only wait for its retirement.

use super::super::epoch::Epoch;
use super::super::state::Phase;
use super::{Host, STOP_TIMEOUT, Supervisor};

impl<H: Host> Supervisor<H> {
    /// The successor's epoch retires ours (Envoy's parent shutdown); just wait for that.
    pub(super) async fn await_retirement(&mut self) {
        if let Some(mut current) = self.current.take() {
            let _ = tokio::time::timeout(self.cfg.parent_shutdown_time + STOP_TIMEOUT, current.exit()).await;
        }
    }

    /// Drains our running epoch's listeners for the drain time, then stops every epoch we started.
    pub(super) async fn drain(&mut self) {
        if let Some(current) = self.current.take() {
            self.drain_current(current).await;
        }
        for epoch in &mut self.retiring {
            epoch.stop(&self.host, STOP_TIMEOUT).await;
        }
        self.metrics.live.set(0);
        // Envoy leaves its hot-restart shared memory behind; nothing of this base id runs any more.
        if let Some(base_id) = self.base_id {
            self.host.remove_shared_memory(base_id);
        }
        tracing::info!("Envoy stopped");
    }

    async fn drain_current(&mut self, mut current: Epoch) {
        let me = self.id.clone();
        // Draining: nobody takes this Envoy over any more.
        let draining = self.state(&current, Phase::Draining);
        let _ = self.states.update(|state| match state {
            Some(state) if state.owner != me => (None, ()),
            _ => (Some(Some(draining)), ()),
        });
        let admin = self.cfg.envoy_admin;
        if let Err(error) = self.host.fail_health_checks(admin).await {
            tracing::warn!(%error, "could not fail Envoy's health checks");
        }
        match self.host.drain_listeners_gracefully(admin).await {
            Ok(()) => {
                tracing::info!(drain = ?self.cfg.drain_time, "draining Envoy's listeners");
                let _ = tokio::time::timeout(self.cfg.drain_time, current.exit()).await;
            }
            Err(error) => tracing::warn!(%error, "could not start Envoy's drain; stopping it"),
        }
        current.stop(&self.host, STOP_TIMEOUT).await;
        let _ = self.states.update(|state| match state {
            Some(state) if state.owner == me => (Some(None), ()),
            _ => (None, ()),
        });
    }
}
