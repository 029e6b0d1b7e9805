//! What every new epoch goes through: a rendered and validated bootstrap, a process, LIVE at its admin, and then
//! being the one the supervisor reports.

use std::path::PathBuf;

use tokio::time::Instant;

use super::super::bootstrap::{self, BootstrapParams};
use super::super::envoy::{BaseId, Launch};
use super::super::machine::{Event, Inputs, Trigger};
use super::{Epoch, Host, Supervisor, SupervisorError, bootstrap_path_of};

/// How often a starting epoch's admin is asked whether it is LIVE.
pub(super) const POLL: std::time::Duration = std::time::Duration::from_millis(50);

impl<H: Host> Supervisor<H> {
    /// Reads the template and the binary's identity, renders, writes and validates the bootstrap of `epoch`.
    pub(super) async fn prepare(&self, epoch: u32) -> Result<(PathBuf, Inputs), SupervisorError> {
        let path = &self.cfg.bootstrap_template;
        let template = std::fs::read_to_string(path).map_err(|source| SupervisorError::ReadTemplate {
            path: path.clone(),
            source,
        })?;
        let inputs = Inputs {
            template: aether_common::hash::fnv1a(template.as_bytes()),
            binary: self.host.fingerprint()?,
        };
        let rendered = bootstrap::render(&template, &self.params())?;
        let out = bootstrap_path_of(&self.states, epoch);
        aether_common::fs::write_atomic(&out, rendered.as_bytes(), 0o600).map_err(|source| {
            SupervisorError::WriteBootstrap {
                path: out.clone(),
                source,
            }
        })?;
        self.host.validate(&out).await?;
        Ok((out, inputs))
    }

    /// The template and the binary as they are now (None when either is unreadable).
    pub(super) fn current_inputs(&self) -> Option<Inputs> {
        let template = std::fs::read(&self.cfg.bootstrap_template).ok()?;
        Some(Inputs {
            template: aether_common::hash::fnv1a(&template),
            binary: self.host.fingerprint().ok()?,
        })
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

    pub(super) fn launch(&self, epoch: u32, base_id: BaseId, bootstrap: PathBuf) -> Launch {
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

    pub(super) fn spawn(&self, launch: &Launch) -> Result<Epoch, SupervisorError> {
        let process = self.host.spawn(launch).map_err(|source| SupervisorError::Spawn {
            binary: self.cfg.envoy_bin.clone(),
            source,
        })?;
        tracing::info!(epoch = launch.epoch, pid = process.pid, args = ?launch.args(), "Envoy started");
        Ok(Epoch::new(launch.epoch, process))
    }

    /// Until the admin answers LIVE at `epoch` (the admin address moves to the newest epoch).
    pub(super) async fn wait_live(&self, epoch: &mut Epoch) -> Result<(), SupervisorError> {
        let deadline = Instant::now() + self.cfg.live_timeout;
        loop {
            if let Some(status) = epoch.exit_status() {
                return Err(SupervisorError::EpochExited {
                    epoch: epoch.number,
                    status: status.to_string(),
                });
            }
            let last = match self.host.server_info(self.cfg.envoy_admin).await {
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
                _ = epoch.exit() => {}
            }
        }
    }

    /// `epoch` is LIVE and ours: the running one, if any, retires. Reported to the machine as the returned event.
    pub(super) fn became_live(&mut self, epoch: Epoch, since: Instant, why: Trigger, inputs: Inputs) -> Event {
        let elapsed = since.elapsed();
        self.metrics.handoff_seconds.observe(elapsed.as_secs_f64());
        self.metrics.epoch.set(i64::from(epoch.number));
        self.metrics.live.set(1);
        tracing::info!(epoch = epoch.number, pid = epoch.pid, base_id = ?self.base_id, ?elapsed,
            why = why.label(), "Envoy epoch LIVE");
        let live = Event::Live {
            epoch: epoch.number,
            pid: epoch.pid,
            spawned: epoch.started,
            inputs,
        };
        if let Some(old) = self.current.replace(epoch) {
            self.retiring.push(old);
        }
        self.readiness.set_ready();
        self.remove_old_bootstraps();
        let mut status = self.status.lock();
        if let Some(current) = self.current.as_ref() {
            status.epoch = Some(current.number);
            status.envoy_pid = Some(current.pid);
        }
        status.base_id = self.base_id;
        status.live = true;
        status.retiring_pids = self.retiring.iter().map(|e| e.pid).collect();
        status.last_error = None;
        live
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

    /// A new bootstrap or binary is refused: counted and shown; the running Envoy never notices.
    pub(super) fn refused(&self, error: &SupervisorError) {
        let reason = match error {
            SupervisorError::Envoy(super::super::envoy::EnvoyError::Invalid { .. }) => "invalid_bootstrap",
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
}
