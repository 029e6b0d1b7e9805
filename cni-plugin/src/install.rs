//! `aether-cni install` / `uninstall`: copy the binary into the CNI bin dir and chain
//! our plugin into the node's first CNI config (converting a single-plugin `.conf` into
//! a `.conflist`), idempotently; then watch the conf dir and put it back whenever the
//! primary CNI rewrites its file.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use aether_common::quote::{clip, quote};
use serde_json::{Value, json};

use crate::config::{DEFAULT_AGENT_SOCKET, DEFAULT_LOG_FILE, DEFAULT_STATE_DIR};

/// Our plugin's `type` (and binary name).
pub const PLUGIN_TYPE: &str = "aether-cni";
/// How often the watch loop looks at its stop flag.
const STOP_POLL: Duration = Duration::from_millis(200);
/// Extensions libcni loads, in its order (by file name).
const CONF_EXTENSIONS: &[&str] = &["conf", "conflist", "json"];

#[derive(Debug, thiserror::Error)]
pub enum InstallError {
    #[error("{path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("{path}: not a CNI config: {reason}")]
    BadConfig { path: String, reason: String },
    #[error("watching {path}: {reason}")]
    Watch { path: String, reason: String },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> InstallError + '_ {
    move |source| InstallError::Io {
        path: path.display().to_string(),
        source,
    }
}

#[derive(Clone, Debug, clap::Args)]
pub struct InstallConfig {
    /// Where the container runtime looks for CNI plugin binaries.
    #[arg(long, env = "AETHER_CNI_BIN_DIR", default_value = "/opt/cni/bin")]
    pub bin_dir: PathBuf,
    /// The CNI config directory; our plugin is chained into its first config.
    #[arg(long, env = "AETHER_CNI_CONF_DIR", default_value = "/etc/cni/net.d")]
    pub conf_dir: PathBuf,
    /// The binary to install (default: this executable).
    #[arg(long, env = "AETHER_CNI_SOURCE")]
    pub source: Option<PathBuf>,
    /// `agentSocket` of the plugin entry.
    #[arg(long, env = "AETHER_CNI_AGENT_SOCKET", default_value = DEFAULT_AGENT_SOCKET)]
    pub agent_socket: PathBuf,
    /// `meshDns` of the plugin entry (ip[:port]); empty: the agent's.
    #[arg(long, env = "AETHER_CNI_MESH_DNS", default_value = "")]
    pub mesh_dns: String,
    /// `logFile` of the plugin entry.
    #[arg(long, env = "AETHER_CNI_LOG_FILE", default_value = DEFAULT_LOG_FILE)]
    pub log_file: PathBuf,
    /// `stateDir` of the plugin entry (netns pins live in `<stateDir>/netns`).
    #[arg(long, env = "AETHER_CNI_STATE_DIR", default_value = DEFAULT_STATE_DIR)]
    pub state_dir: PathBuf,
    /// `excludedNamespaces` of the plugin entry.
    #[arg(
        long,
        env = "AETHER_CNI_EXCLUDED_NAMESPACES",
        value_delimiter = ',',
        default_value = "kube-system"
    )]
    pub excluded_namespaces: Vec<String>,
    /// Keep watching the conf dir and repair our entry (the init-container mode is `false`).
    #[arg(long, env = "AETHER_CNI_WATCH", default_value_t = true, action = clap::ArgAction::Set)]
    pub watch: bool,
    /// Re-check period while watching, in case an inotify event is missed (milliseconds).
    #[arg(long, env = "AETHER_CNI_RESYNC_MS", default_value_t = 5000)]
    pub resync_ms: u64,
    /// `<namespace>/<name>` of the DaemonSet this installer runs in. On SIGTERM the plugin is removed from the
    /// node if that DaemonSet is gone or being deleted (an uninstall), and kept otherwise (a rollout or restart:
    /// new pods wait, fail-closed, for the next agent). Unset: always kept.
    #[arg(long, env = "AETHER_CNI_OWNER_DAEMONSET", value_parser = parse_owner)]
    pub owner_daemonset: Option<Owner>,
}

/// A DaemonSet by namespace and name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Owner {
    pub namespace: String,
    pub name: String,
}

/// `--owner-daemonset` is not `<namespace>/<name>` (clap names the flag).
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error("{} is not <namespace>/<name>", quote(.0))]
pub struct BadOwner(String);

fn parse_owner(value: &str) -> Result<Owner, BadOwner> {
    let valid = |part: &str| {
        !part.is_empty()
            && part.len() <= 253
            && part
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
    };
    match value.split_once('/') {
        Some((namespace, name)) if valid(namespace) && valid(name) => Ok(Owner {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
        }),
        _ => Err(BadOwner(value.to_owned())),
    }
}

#[derive(Clone, Debug, clap::Args)]
pub struct UninstallConfig {
    #[arg(long, env = "AETHER_CNI_BIN_DIR", default_value = "/opt/cni/bin")]
    pub bin_dir: PathBuf,
    #[arg(long, env = "AETHER_CNI_CONF_DIR", default_value = "/etc/cni/net.d")]
    pub conf_dir: PathBuf,
}

/// What one pass did to the conf dir.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Change {
    /// No CNI config yet: the primary CNI has not written one.
    NoConfig,
    Unchanged(PathBuf),
    Written(PathBuf),
}

impl InstallConfig {
    /// Our entry in the conflist's `plugins`.
    pub fn plugin_entry(&self) -> Value {
        let mut entry = json!({
            "type": PLUGIN_TYPE,
            "agentSocket": self.agent_socket,
            "logFile": self.log_file,
            "stateDir": self.state_dir,
            "excludedNamespaces": self.excluded_namespaces.iter().map(|s| s.trim()).filter(|s| !s.is_empty()).collect::<Vec<_>>(),
        });
        if !self.mesh_dns.trim().is_empty() {
            entry["meshDns"] = json!(self.mesh_dns.trim());
        }
        entry
    }
}

/// Copies `source` to `<bin_dir>/aether-cni` atomically (temp + rename), mode 0755, so a
/// runtime executing the old binary is never handed a half-written file.
pub fn install_binary(source: &Path, bin_dir: &Path) -> Result<PathBuf, InstallError> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(bin_dir).map_err(io(bin_dir))?;
    let target = bin_dir.join(PLUGIN_TYPE);
    let tmp = bin_dir.join(format!(".{PLUGIN_TYPE}.tmp-{}", std::process::id()));
    std::fs::copy(source, &tmp).map_err(io(source))?;
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o755)).map_err(io(&tmp))?;
    std::fs::rename(&tmp, &target).map_err(io(&target))?;
    Ok(target)
}

/// CNI config files in libcni's order.
fn conf_files(conf_dir: &Path) -> Result<Vec<PathBuf>, InstallError> {
    let entries = match std::fs::read_dir(conf_dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io(conf_dir)(e)),
    };
    let mut files: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.is_file()
                && !p
                    .file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with('.'))
                && p.extension()
                    .and_then(|e| e.to_str())
                    .is_some_and(|e| CONF_EXTENSIONS.contains(&e))
        })
        .collect();
    files.sort();
    Ok(files)
}

fn read_json(path: &Path) -> Result<Value, InstallError> {
    let text = std::fs::read(path).map_err(io(path))?;
    let value: Value = serde_json::from_slice(&text).map_err(|e| InstallError::BadConfig {
        path: path.display().to_string(),
        reason: clip(&e.to_string()).to_string(),
    })?;
    if !value.is_object() {
        return Err(InstallError::BadConfig {
            path: path.display().to_string(),
            reason: "not a JSON object".into(),
        });
    }
    Ok(value)
}

fn write_json(path: &Path, value: &Value) -> Result<(), InstallError> {
    use std::io::Write;
    let dir = path.parent().unwrap_or(Path::new("."));
    let tmp = dir.join(format!(".aether-cni-write.tmp-{}", std::process::id()));
    let mut text = serde_json::to_vec_pretty(value).expect("JSON serialises");
    text.push(b'\n');
    let result = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(&text)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result.map_err(io(path))
}

fn is_ours(plugin: &Value) -> bool {
    plugin.get("type").and_then(Value::as_str) == Some(PLUGIN_TYPE)
}

/// Puts `entry` last in the first CNI config's plugin chain (or updates it in place).
pub fn ensure_entry(conf_dir: &Path, entry: &Value) -> Result<Change, InstallError> {
    let Some(first) = conf_files(conf_dir)?.into_iter().next() else {
        return Ok(Change::NoConfig);
    };
    let mut conf = read_json(&first)?;
    if let Some(plugins) = conf.get_mut("plugins") {
        let plugins = plugins.as_array_mut().ok_or_else(|| InstallError::BadConfig {
            path: first.display().to_string(),
            reason: "\"plugins\" is not a list".into(),
        })?;
        match plugins.iter().position(is_ours) {
            Some(i) if &plugins[i] == entry => return Ok(Change::Unchanged(first)),
            Some(i) => plugins[i] = entry.clone(),
            None => plugins.push(entry.clone()),
        }
        write_json(&first, &conf)?;
        return Ok(Change::Written(first));
    }
    // A single-plugin .conf: chain it in a .conflist that takes its place.
    let mut main = conf.clone();
    let obj = main.as_object_mut().expect("checked to be an object");
    let version = obj.remove("cniVersion").unwrap_or_else(|| json!("1.0.0"));
    let name = obj.remove("name").unwrap_or_else(|| json!("k8s-pod-network"));
    if is_ours(&main) {
        return Err(InstallError::BadConfig {
            path: first.display().to_string(),
            reason: "our plugin is the only one: aether-cni must be chained after a main plugin".into(),
        });
    }
    let list = json!({"cniVersion": version, "name": name, "plugins": [main, entry]});
    let target = first.with_extension("conflist");
    write_json(&target, &list)?;
    if target != first {
        std::fs::remove_file(&first).map_err(io(&first))?;
    }
    Ok(Change::Written(target))
}

/// Removes our entry from every CNI config in the dir. Returns the files changed.
pub fn remove_entries(conf_dir: &Path) -> Result<Vec<PathBuf>, InstallError> {
    let mut changed = Vec::new();
    for path in conf_files(conf_dir)? {
        let Ok(mut conf) = read_json(&path) else { continue };
        let Some(plugins) = conf.get_mut("plugins").and_then(Value::as_array_mut) else {
            continue;
        };
        let before = plugins.len();
        plugins.retain(|p| !is_ours(p));
        if plugins.len() != before {
            write_json(&path, &conf)?;
            changed.push(path);
        }
    }
    Ok(changed)
}

pub fn uninstall(config: &UninstallConfig) -> Result<Vec<PathBuf>, InstallError> {
    let changed = remove_entries(&config.conf_dir)?;
    let binary = config.bin_dir.join(PLUGIN_TYPE);
    match std::fs::remove_file(&binary) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io(&binary)(e)),
    }
    Ok(changed)
}

/// Installs, then (with `watch`) repairs our entry on every change of the conf dir
/// and every `resync_ms` until `stop` is set. Returns on an error, once `stop` is set,
/// or after one pass without `watch`.
pub fn install(
    config: &InstallConfig,
    stop: &AtomicBool,
    on_change: &mut dyn FnMut(&Change),
) -> Result<(), InstallError> {
    let source = match &config.source {
        Some(s) => s.clone(),
        None => std::env::current_exe().map_err(io(Path::new("/proc/self/exe")))?,
    };
    install_binary(&source, &config.bin_dir)?;
    let entry = config.plugin_entry();
    let change = ensure_entry(&config.conf_dir, &entry)?;
    on_change(&change);
    if !config.watch {
        return Ok(());
    }
    std::fs::create_dir_all(&config.conf_dir).map_err(io(&config.conf_dir))?;
    let (tx, rx) = mpsc::channel();
    let mut watcher = notify::recommended_watcher(move |event| {
        let _ = tx.send(event);
    })
    .map_err(|e| InstallError::Watch {
        path: config.conf_dir.display().to_string(),
        reason: e.to_string(),
    })?;
    notify::Watcher::watch(&mut watcher, &config.conf_dir, notify::RecursiveMode::NonRecursive).map_err(|e| {
        InstallError::Watch {
            path: config.conf_dir.display().to_string(),
            reason: e.to_string(),
        }
    })?;
    let resync = Duration::from_millis(config.resync_ms.max(100));
    let mut last_pass = Instant::now();
    loop {
        if stop.load(Ordering::Acquire) {
            return Ok(());
        }
        // Woken at least every STOP_POLL so a stop never waits for a whole resync period.
        match rx.recv_timeout(STOP_POLL) {
            Ok(_) => {}
            Err(mpsc::RecvTimeoutError::Timeout) if last_pass.elapsed() < resync => continue,
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                return Err(InstallError::Watch {
                    path: config.conf_dir.display().to_string(),
                    reason: "the watcher stopped".into(),
                });
            }
        }
        // Let a burst of writes (the primary CNI's temp + rename) settle.
        std::thread::sleep(Duration::from_millis(50));
        while rx.try_recv().is_ok() {}
        if stop.load(Ordering::Acquire) {
            return Ok(());
        }
        last_pass = Instant::now();
        // Another installer's uninstall on this node may have taken the binary.
        if !config.bin_dir.join(PLUGIN_TYPE).is_file()
            && let Err(error) = install_binary(&source, &config.bin_dir)
        {
            tracing::warn!(%error, "re-installing the plugin binary");
        }
        match ensure_entry(&config.conf_dir, &entry) {
            Ok(change) => on_change(&change),
            // A half-written file from the primary CNI: the next event retries.
            Err(error) => tracing::warn!(%error, "re-checking the CNI config"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(dir: &Path) -> InstallConfig {
        InstallConfig {
            bin_dir: dir.join("bin"),
            conf_dir: dir.join("net.d"),
            source: None,
            agent_socket: "/run/aether/cni.sock".into(),
            mesh_dns: String::new(),
            log_file: "/tmp/x.log".into(),
            state_dir: "/var/run/aether".into(),
            excluded_namespaces: vec!["kube-system".into()],
            watch: false,
            resync_ms: 5000,
            owner_daemonset: None,
        }
    }

    #[test]
    fn the_owner_is_namespace_slash_name() {
        assert_eq!(
            parse_owner("aether-system/aether-agent"),
            Ok(Owner {
                namespace: "aether-system".into(),
                name: "aether-agent".into()
            })
        );
        for bad in ["aether-agent", "/x", "x/", "a/b/c", "A/b", ""] {
            assert!(parse_owner(bad).is_err(), "{bad:?} accepted");
        }
        let refused = |value: &str| parse_owner(value).expect_err("refused").to_string();
        assert_eq!(refused("a/b/c"), r#""a/b/c" is not <namespace>/<name>"#);
        let huge = format!("ns/{}", "x".repeat(1 << 20));
        assert!(refused(&huge).ends_with("… (1048579 bytes) is not <namespace>/<name>"));
        assert!(refused(&huge).len() < 200);
    }

    #[test]
    fn entries_are_added_once_updated_in_place_and_removed() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = config(dir.path());
        std::fs::create_dir_all(&cfg.conf_dir).unwrap();
        assert_eq!(
            ensure_entry(&cfg.conf_dir, &cfg.plugin_entry()).unwrap(),
            Change::NoConfig
        );
        let list = cfg.conf_dir.join("10-bridge.conflist");
        std::fs::write(
            &list,
            r#"{"cniVersion":"1.0.0","name":"n","plugins":[{"type":"bridge"},{"type":"portmap"}]}"#,
        )
        .unwrap();
        std::fs::write(cfg.conf_dir.join("99-other.conflist"), r#"{"plugins":[]}"#).unwrap();
        assert_eq!(
            ensure_entry(&cfg.conf_dir, &cfg.plugin_entry()).unwrap(),
            Change::Written(list.clone())
        );
        assert_eq!(
            ensure_entry(&cfg.conf_dir, &cfg.plugin_entry()).unwrap(),
            Change::Unchanged(list.clone())
        );
        let v = read_json(&list).unwrap();
        let types: Vec<&str> = v["plugins"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["type"].as_str().unwrap())
            .collect();
        assert_eq!(types, ["bridge", "portmap", "aether-cni"]);
        let mut other = cfg.clone();
        other.mesh_dns = "10.0.0.1:18054".into();
        assert_eq!(
            ensure_entry(&cfg.conf_dir, &other.plugin_entry()).unwrap(),
            Change::Written(list.clone())
        );
        assert_eq!(read_json(&list).unwrap()["plugins"].as_array().unwrap().len(), 3);
        assert_eq!(remove_entries(&cfg.conf_dir).unwrap(), vec![list.clone()]);
        assert_eq!(
            read_json(&list).unwrap(),
            serde_json::from_str::<Value>(
                r#"{"cniVersion":"1.0.0","name":"n","plugins":[{"type":"bridge"},{"type":"portmap"}]}"#
            )
            .unwrap()
        );
    }

    #[test]
    fn a_single_plugin_conf_becomes_a_conflist() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = config(dir.path());
        std::fs::create_dir_all(&cfg.conf_dir).unwrap();
        let conf = cfg.conf_dir.join("10-main.conf");
        std::fs::write(
            &conf,
            r#"{"cniVersion":"1.0.0","name":"pods","type":"bridge","bridge":"cni0"}"#,
        )
        .unwrap();
        let change = ensure_entry(&cfg.conf_dir, &cfg.plugin_entry()).unwrap();
        let list = cfg.conf_dir.join("10-main.conflist");
        assert_eq!(change, Change::Written(list.clone()));
        assert!(!conf.exists());
        let v = read_json(&list).unwrap();
        assert_eq!(v["name"], "pods");
        assert_eq!(v["plugins"][0], json!({"type": "bridge", "bridge": "cni0"}));
        assert_eq!(v["plugins"][1]["type"], "aether-cni");
    }

    #[test]
    fn a_broken_config_is_an_error_naming_the_file() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("10-x.conflist"), "{nope").unwrap();
        let e = ensure_entry(dir.path(), &json!({"type": "aether-cni"}))
            .unwrap_err()
            .to_string();
        assert!(e.contains("10-x.conflist: not a CNI config"), "{e}");
    }
}
