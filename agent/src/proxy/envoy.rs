//! The Envoy binary: validating a bootstrap, its hot-restart version, its identity on disk, and the command line of
//! one epoch.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use aether_common::telemetry::LogFormat;

/// How long `--mode validate` and `--hot-restart-version` may take.
const CHECK_TIMEOUT: Duration = Duration::from_secs(60);
/// How much of Envoy's output a validation error keeps.
const ERROR_TAIL: usize = 2048;
/// Envoy's log line format when the supervisor logs JSON (`%j`: the message, JSON-escaped).
const JSON_LOG_FORMAT: &str = r#"{"time":"%Y-%m-%dT%T.%fZ","level":"%l","logger":"%n","source":"envoy","msg":"%j"}"#;

#[derive(Debug, thiserror::Error)]
pub enum EnvoyError {
    #[error("running {binary} {what}: {source}")]
    Run {
        binary: PathBuf,
        what: &'static str,
        source: std::io::Error,
    },
    #[error("{binary} {what} did not finish within {CHECK_TIMEOUT:?}")]
    Timeout { binary: PathBuf, what: &'static str },
    #[error("Envoy rejects the bootstrap {bootstrap}: {output}")]
    Invalid { bootstrap: PathBuf, output: String },
    #[error("{binary} --hot-restart-version failed: {output}")]
    HotRestartVersion { binary: PathBuf, output: String },
    #[error("reading {path}: {source}")]
    Stat { path: PathBuf, source: std::io::Error },
}

/// What identifies the binary on disk: replacing it (a new image layer, a package update, a rename over it) changes
/// one of these.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fingerprint {
    pub len: u64,
    pub mtime_ns: i128,
    pub inode: u64,
}

#[derive(Clone, Debug)]
pub struct EnvoyBinary {
    path: PathBuf,
}

impl EnvoyBinary {
    pub fn new(path: PathBuf) -> Self {
        Self { path }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn fingerprint(&self) -> Result<Fingerprint, EnvoyError> {
        let meta = std::fs::metadata(&self.path).map_err(|source| EnvoyError::Stat {
            path: self.path.clone(),
            source,
        })?;
        Ok(Fingerprint {
            len: meta.len(),
            mtime_ns: i128::from(meta.mtime()) * 1_000_000_000 + i128::from(meta.mtime_nsec()),
            inode: meta.ino(),
        })
    }

    /// `envoy --mode validate -c <bootstrap>`: Err with Envoy's own words if it would not start from it.
    pub async fn validate(&self, bootstrap: &Path) -> Result<(), EnvoyError> {
        let mut cmd = tokio::process::Command::new(&self.path);
        cmd.args(["--mode", "validate", "--log-level", "error", "-c"])
            .arg(bootstrap);
        let output = self.run(cmd, "--mode validate").await?;
        if output.status.success() {
            return Ok(());
        }
        Err(EnvoyError::Invalid {
            bootstrap: bootstrap.to_owned(),
            output: tail(&output),
        })
    }

    /// `envoy --hot-restart-version`: epochs hot-restart into each other only when these are equal.
    pub async fn hot_restart_version(&self) -> Result<String, EnvoyError> {
        let mut cmd = tokio::process::Command::new(&self.path);
        cmd.arg("--hot-restart-version");
        let output = self.run(cmd, "--hot-restart-version").await?;
        // Envoy 1.40 prints it on stderr; accept either stream.
        let stdout = String::from_utf8_lossy(&output.stdout).trim().to_owned();
        let version = if stdout.is_empty() {
            String::from_utf8_lossy(&output.stderr).trim().to_owned()
        } else {
            stdout
        };
        if !output.status.success() || version.is_empty() {
            return Err(EnvoyError::HotRestartVersion {
                binary: self.path.clone(),
                output: tail(&output),
            });
        }
        Ok(version)
    }

    async fn run(
        &self,
        mut cmd: tokio::process::Command,
        what: &'static str,
    ) -> Result<std::process::Output, EnvoyError> {
        cmd.stdin(Stdio::null()).kill_on_drop(true);
        let output = tokio::time::timeout(CHECK_TIMEOUT, cmd.output())
            .await
            .map_err(|_| EnvoyError::Timeout {
                binary: self.path.clone(),
                what,
            })?;
        output.map_err(|source| EnvoyError::Run {
            binary: self.path.clone(),
            what,
            source,
        })
    }
}

fn tail(output: &std::process::Output) -> String {
    let mut text = String::from_utf8_lossy(&output.stderr).into_owned();
    text.push_str(&String::from_utf8_lossy(&output.stdout));
    let text = text.trim();
    let start = text.len().saturating_sub(ERROR_TAIL);
    let start = (start..text.len()).find(|i| text.is_char_boundary(*i)).unwrap_or(start);
    format!("{} ({})", &text[start..], output.status)
}

/// How an epoch gets its base id.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BaseId {
    /// Epoch 0 only: Envoy picks one and writes it to this file.
    Dynamic(PathBuf),
    Fixed(u32),
}

/// The command line of one epoch.
#[derive(Clone, Debug)]
pub struct Launch {
    pub epoch: u32,
    pub base_id: BaseId,
    pub bootstrap: PathBuf,
    pub drain_time: Duration,
    pub parent_shutdown_time: Duration,
    pub concurrency: u32,
    pub hot_restart_socket: Option<PathBuf>,
    pub log_level: String,
    pub log_format: LogFormat,
}

impl Launch {
    pub fn args(&self) -> Vec<String> {
        let mut args: Vec<String> = vec!["-c".into(), self.bootstrap.to_string_lossy().into_owned()];
        args.extend(["--restart-epoch".into(), self.epoch.to_string()]);
        match &self.base_id {
            BaseId::Dynamic(path) => {
                args.push("--use-dynamic-base-id".into());
                args.extend(["--base-id-path".into(), path.to_string_lossy().into_owned()]);
            }
            BaseId::Fixed(id) => args.extend(["--base-id".into(), id.to_string()]),
        }
        // Envoy takes whole seconds; round up so a 1.5s drain is not cut to 1s.
        let secs = |d: Duration| d.as_secs() + u64::from(d.subsec_nanos() > 0);
        args.extend(["--drain-time-s".into(), secs(self.drain_time).to_string()]);
        args.extend([
            "--parent-shutdown-time-s".into(),
            secs(self.parent_shutdown_time).to_string(),
        ]);
        if self.concurrency > 0 {
            args.extend(["--concurrency".into(), self.concurrency.to_string()]);
        }
        if let Some(socket) = &self.hot_restart_socket {
            args.extend(["--socket-path".into(), socket.to_string_lossy().into_owned()]);
            args.extend(["--socket-mode".into(), "600".into()]);
        }
        args.extend(["--log-level".into(), self.log_level.clone()]);
        if self.log_format == LogFormat::Json {
            args.extend(["--log-format".into(), JSON_LOG_FORMAT.into()]);
        }
        args
    }
}

/// The Envoy the agent's own tests run: `$AETHER_ENVOY_BIN`, else the project venv's (`make setup`).
#[cfg(test)]
pub(crate) fn test_envoy_bin() -> PathBuf {
    if let Some(path) = std::env::var_os("AETHER_ENVOY_BIN").filter(|p| !p.is_empty()) {
        return PathBuf::from(path);
    }
    let lib = Path::new(env!("CARGO_MANIFEST_DIR")).join("../.venv/lib");
    std::fs::read_dir(&lib)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path().join("site-packages/envoy/_bin/envoy"))
        .find(|p| p.is_file())
        .unwrap_or_else(|| panic!("Envoy not found: run `make setup` (nothing under {})", lib.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn epoch_command_lines() {
        let launch = Launch {
            epoch: 0,
            base_id: BaseId::Dynamic("/s/base-id".into()),
            bootstrap: "/s/bootstrap-0.yaml".into(),
            drain_time: Duration::from_millis(1500),
            parent_shutdown_time: Duration::from_secs(3),
            concurrency: 2,
            hot_restart_socket: Some("/s/hot-restart".into()),
            log_level: "info".into(),
            log_format: LogFormat::Text,
        };
        let args = launch.args().join(" ");
        assert_eq!(
            args,
            "-c /s/bootstrap-0.yaml --restart-epoch 0 --use-dynamic-base-id --base-id-path /s/base-id \
             --drain-time-s 2 --parent-shutdown-time-s 3 --concurrency 2 --socket-path /s/hot-restart \
             --socket-mode 600 --log-level info"
        );
        let next = Launch {
            epoch: 1,
            base_id: BaseId::Fixed(42),
            hot_restart_socket: None,
            log_format: LogFormat::Json,
            ..launch
        };
        let args = next.args();
        assert!(args.windows(2).any(|w| w == ["--base-id", "42"]), "{args:?}");
        assert!(
            !args
                .iter()
                .any(|a| a == "--socket-path" || a == "--use-dynamic-base-id")
        );
        assert!(args.iter().any(|a| a.contains("%j")));
    }

    #[tokio::test]
    async fn the_real_envoy_reports_its_hot_restart_version() {
        let envoy = EnvoyBinary::new(test_envoy_bin());
        let version = envoy.hot_restart_version().await.unwrap();
        assert!(version.contains('.'), "{version}");
        let missing = EnvoyBinary::new("/nonexistent/envoy".into());
        assert!(missing.hot_restart_version().await.is_err());
        assert!(missing.fingerprint().is_err());
    }
}
