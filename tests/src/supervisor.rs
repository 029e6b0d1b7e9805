//! `aether-agent proxy` (the Envoy supervisor) run by a test, from the shipped `proxy/bootstrap.yaml`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use crate::{ChildGuard, binary, envoy_bin, free_port, http_get, http_request};

/// How long a test waits for an epoch to become LIVE.
pub const LIVE_TIMEOUT: Duration = Duration::from_secs(30);

/// The shipped bootstrap template.
pub fn shipped_template() -> PathBuf {
    crate::envoy::workspace_root().join("proxy/bootstrap.yaml")
}

/// How to run one supervisor. Two supervisors handing over share `state_dir` and `envoy_admin`.
#[derive(Clone, Debug)]
pub struct ProxyOptions {
    pub node_name: String,
    pub xds_socket: PathBuf,
    pub state_dir: PathBuf,
    /// The bootstrap template (tests copy the shipped one so they can change it).
    pub template: PathBuf,
    pub envoy_bin: PathBuf,
    pub envoy_admin: SocketAddr,
    /// The supervisor's own admin (/metrics, /debug/proxy).
    pub admin: SocketAddr,
    /// `--ready-file`: exists while the supervisor is ready.
    pub ready_file: PathBuf,
    pub drain_time: String,
    pub parent_shutdown_time: String,
    /// `delta` or `sotw`.
    pub ads: String,
    pub extra_args: Vec<String>,
}

impl ProxyOptions {
    /// Options with fresh ports; `dir` holds the state dir and a copy of the shipped template.
    pub fn new(dir: &Path, node_name: &str, xds_socket: &Path) -> ProxyOptions {
        let template = dir.join("bootstrap.yaml");
        if !template.exists() {
            std::fs::create_dir_all(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
            std::fs::copy(shipped_template(), &template)
                .unwrap_or_else(|e| panic!("copy {} to {}: {e}", shipped_template().display(), template.display()));
        }
        ProxyOptions {
            node_name: node_name.to_owned(),
            xds_socket: xds_socket.to_owned(),
            state_dir: dir.join("state"),
            template,
            envoy_bin: envoy_bin(),
            envoy_admin: format!("127.0.0.1:{}", free_port()).parse().unwrap(),
            admin: format!("127.0.0.1:{}", free_port()).parse().unwrap(),
            ready_file: dir.join("ready"),
            drain_time: "1s".into(),
            parent_shutdown_time: "2s".into(),
            ads: "delta".into(),
            extra_args: Vec::new(),
        }
    }

    /// A successor's options, as a surge rollout on the host network gives them: the same Envoy (state dir, Envoy
    /// admin) and the same supervisor admin address (held by the predecessor until it steps aside), but a ready
    /// file of its own (the pod's own volume).
    pub fn successor(&self) -> ProxyOptions {
        ProxyOptions {
            ready_file: self.ready_file.with_extension("successor"),
            ..self.clone()
        }
    }
}

/// A running `aether-agent proxy`; dropping it kills its process group (it and the Envoys it started).
pub struct ProxySupervisor {
    pub child: ChildGuard,
    pub options: ProxyOptions,
    /// Envoy's base id once seen (the state dir may be gone by the time the guard drops).
    base_id: Option<u64>,
}

impl ProxySupervisor {
    /// Spawns the supervisor; does not wait for anything.
    pub fn spawn(options: &ProxyOptions) -> ProxySupervisor {
        let mut cmd = Command::new(binary("aether-agent"));
        cmd.arg("proxy")
            .args(["--node-name", &options.node_name])
            .arg("--envoy-bin")
            .arg(&options.envoy_bin)
            .arg("--bootstrap-template")
            .arg(&options.template)
            .arg("--state-dir")
            .arg(&options.state_dir)
            .arg("--xds-socket")
            .arg(&options.xds_socket)
            .args(["--ads", &options.ads])
            .args(["--envoy-admin", &options.envoy_admin.to_string()])
            .args(["--admin", &options.admin.to_string()])
            .arg("--ready-file")
            .arg(&options.ready_file)
            .args(["--drain-time", &options.drain_time])
            .args(["--parent-shutdown-time", &options.parent_shutdown_time])
            .args(["--concurrency", "1", "--watch-interval", "200ms"])
            .args(&options.extra_args)
            .env("RUST_LOG", "info,aether_agent=debug");
        ProxySupervisor {
            child: ChildGuard::spawn("proxy", cmd),
            options: options.clone(),
            base_id: None,
        }
    }

    /// Spawns and waits until Envoy is LIVE at `epoch`.
    pub async fn start(options: &ProxyOptions, epoch: u64) -> ProxySupervisor {
        let mut proxy = Self::spawn(options);
        proxy.wait_epoch_live(epoch, LIVE_TIMEOUT).await;
        proxy
    }

    pub fn pid(&self) -> u32 {
        self.child.pid()
    }

    /// A signal to the supervisor alone (not its Envoys): SIGHUP hot-restarts, SIGTERM drains.
    pub fn signal(&self, signal: Signal) {
        kill(Pid::from_raw(self.pid() as i32), signal).unwrap_or_else(|e| panic!("kill {signal}: {e}"));
    }

    /// Envoy's `/server_info`, or Err when its admin does not answer.
    pub async fn server_info(&self) -> Result<serde_json::Value, String> {
        let reply = http_get(&format!("http://{}/server_info", self.options.envoy_admin), None).await?;
        if reply.status != 200 {
            return Err(format!("status {}: {}", reply.status, reply.body));
        }
        serde_json::from_str(&reply.body).map_err(|e| format!("server_info is not JSON: {e}"))
    }

    /// `(state, restart_epoch)` of the Envoy answering on the admin address.
    pub async fn envoy_epoch(&self) -> Result<(String, u64), String> {
        let info = self.server_info().await?;
        Ok((
            info["state"].as_str().unwrap_or_default().to_owned(),
            info["command_line_options"]["restart_epoch"]
                .as_u64()
                .unwrap_or(u64::MAX),
        ))
    }

    /// Waits until Envoy answers LIVE at `epoch` and the supervisor has seen it (its `/debug/proxy` says so, so its
    /// metrics are current); returns how long Envoy took. Panics with the supervisor's logs after `timeout`.
    pub async fn wait_epoch_live(&mut self, epoch: u64, timeout: Duration) -> Duration {
        let started = Instant::now();
        let mut envoy_live = None;
        loop {
            let last = self.envoy_epoch().await;
            if let Ok((state, e)) = &last
                && state == "LIVE"
                && *e == epoch
            {
                let took = *envoy_live.get_or_insert(started.elapsed());
                let seen = http_get(&format!("http://{}/debug/proxy", self.options.admin), None)
                    .await
                    .ok()
                    .and_then(|reply| serde_json::from_str::<serde_json::Value>(&reply.body).ok())
                    .is_some_and(|status| status["epoch"] == epoch && status["live"] == true);
                if seen {
                    self.base_id = self.base_id.or_else(|| self.read_base_id());
                    return took;
                }
            }
            if let Some(status) = self.child.try_wait() {
                panic!(
                    "the supervisor exited ({status}) before epoch {epoch} was LIVE; logs:\n{}",
                    self.child.logs()
                );
            }
            assert!(
                started.elapsed() < timeout,
                "Envoy not LIVE at epoch {epoch} within {timeout:?} (last: {last:?}); supervisor logs:\n{}",
                self.child.logs()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// GET an Envoy admin path; panics unless 200.
    pub async fn envoy_get(&self, path: &str) -> String {
        let reply = http_get(&format!("http://{}{path}", self.options.envoy_admin), None)
            .await
            .unwrap_or_else(|e| panic!("Envoy admin {path}: {e}"));
        assert_eq!(reply.status, 200, "Envoy admin {path}: {}", reply.body);
        reply.body
    }

    /// POST an Envoy admin path; panics unless 200.
    pub async fn envoy_post(&self, path: &str) -> String {
        let url = format!("http://{}{path}", self.options.envoy_admin);
        let reply = http_request("POST", &url, None, &[], "")
            .await
            .unwrap_or_else(|e| panic!("Envoy admin POST {path}: {e}"));
        assert_eq!(reply.status, 200, "Envoy admin POST {path}: {}", reply.body);
        reply.body
    }

    /// The supervisor's `/metrics` text.
    pub async fn metrics(&self) -> String {
        let reply = http_get(&format!("http://{}/metrics", self.options.admin), None)
            .await
            .unwrap_or_else(|e| panic!("supervisor /metrics: {e}; logs:\n{}", self.child.logs()));
        reply.body
    }

    /// The sum of every sample of metric `name` (all label sets), 0 if absent.
    pub async fn metric(&self, name: &str) -> f64 {
        metric_sum(&self.metrics().await, name)
    }

    /// The supervisor's `/debug/proxy`.
    pub async fn status(&self) -> serde_json::Value {
        let reply = http_get(&format!("http://{}/debug/proxy", self.options.admin), None)
            .await
            .unwrap_or_else(|e| panic!("supervisor /debug/proxy: {e}"));
        serde_json::from_str(&reply.body).unwrap_or_else(|e| panic!("/debug/proxy is not JSON ({e}): {}", reply.body))
    }

    fn read_base_id(&self) -> Option<u64> {
        std::fs::read_to_string(self.options.state_dir.join("base-id"))
            .ok()
            .and_then(|id| id.trim().parse().ok())
    }

    /// The pids of every running Envoy started from this supervisor (its process group).
    pub fn envoy_pids(&self) -> Vec<u32> {
        let pgid = self.pid();
        let mut pids: Vec<u32> = crate::process::processes()
            .into_iter()
            .filter(|p| p.pgid == pgid && p.pid != pgid && !p.zombie)
            .map(|p| p.pid)
            .collect();
        pids.sort();
        pids
    }
}

impl Drop for ProxySupervisor {
    /// Kills the supervisor's process group, then removes Envoy's hot-restart shared memory unless another process
    /// (a successor's Envoy) still maps it.
    fn drop(&mut self) {
        self.child.kill();
        let Some(base_id) = self.base_id.or_else(|| self.read_base_id()) else {
            return;
        };
        let shm = format!("/dev/shm/envoy_shared_memory_{}", base_id * 10);
        let in_use = std::fs::read_dir("/proc")
            .into_iter()
            .flatten()
            .flatten()
            .any(|entry| std::fs::read_to_string(entry.path().join("maps")).is_ok_and(|maps| maps.contains(&shm)));
        if !in_use {
            let _ = std::fs::remove_file(&shm);
        }
    }
}

/// The sum of every sample of `name` in Prometheus text (`name` or `name{…}` lines).
pub fn metric_sum(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (key, value) = l.rsplit_once(' ')?;
            let metric = key.split('{').next()?;
            (metric == name).then(|| value.parse::<f64>().ok()).flatten()
        })
        .fold(0.0, |sum, v| sum + v)
}
