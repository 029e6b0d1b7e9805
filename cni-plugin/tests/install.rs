//! `aether-cni install` / `uninstall` as processes on a temp CNI conf dir: idempotent
//! chaining, repair after the primary CNI rewrites its conflist, clean removal.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use aether_fakes::kube::{ApiServer, CALLER_TOKEN};
use k8s_openapi::api::apps::v1::DaemonSet;
use serde_json::{Value, json};

const BIN: &str = env!("CARGO_BIN_EXE_aether-cni");

/// The installer in watch mode; killed when dropped.
struct Installer(Child);

impl Drop for Installer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn dirs(root: &Path) -> (PathBuf, PathBuf) {
    let (bin, conf) = (root.join("bin"), root.join("net.d"));
    std::fs::create_dir_all(&conf).unwrap();
    (bin, conf)
}

fn install_args(bin: &Path, conf: &Path) -> Vec<String> {
    vec![
        "install".into(),
        "--bin-dir".into(),
        bin.display().to_string(),
        "--conf-dir".into(),
        conf.display().to_string(),
        "--agent-socket".into(),
        "/run/test/cni.sock".into(),
        "--mesh-dns".into(),
        "10.0.0.10:18054".into(),
        "--resync-ms".into(),
        "200".into(),
    ]
}

fn plugin_types(path: &Path) -> Vec<String> {
    let Ok(text) = std::fs::read_to_string(path) else {
        return Vec::new();
    };
    let Ok(v) = serde_json::from_str::<Value>(&text) else {
        return Vec::new();
    };
    v["plugins"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|p| p["type"].as_str().unwrap_or_default().to_owned())
        .collect()
}

fn eventually(what: &str, mut ok: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !ok() {
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        std::thread::sleep(Duration::from_millis(25));
    }
}

/// The primary CNI writing its conflist the way such daemons do (temp file + rename).
fn primary_writes(conf: &Path, name: &str) {
    let list = json!({"cniVersion": "1.0.0", "name": "pods", "plugins": [
        {"type": "bridge", "bridge": "cni0", "ipam": {"type": "host-local", "subnet": "10.22.0.0/16"}},
        {"type": "portmap", "capabilities": {"portMappings": true}}
    ]});
    let tmp = conf.join(format!(".{name}.tmp"));
    std::fs::write(&tmp, serde_json::to_vec_pretty(&list).unwrap()).unwrap();
    std::fs::rename(&tmp, conf.join(name)).unwrap();
}

#[test]
fn install_chains_once_repairs_after_rewrites_and_uninstall_removes_it() {
    let root = tempfile::tempdir().unwrap();
    let (bin, conf) = dirs(root.path());
    // Started before the primary CNI has written anything: it waits.
    let installer = Installer(
        Command::new(BIN)
            .args(install_args(&bin, &conf))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let installed = bin.join("aether-cni");
    the_installed_binary_is_a_working_plugin(&installed);
    let list = conf.join("10-pods.conflist");
    primary_writes(&conf, "10-pods.conflist");
    our_plugin_is_chained_last_keeping_the_primarys_settings(&list);

    // The primary CNI rewrites its file (e.g. on reboot): we are put back, once.
    for _ in 0..3 {
        primary_writes(&conf, "10-pods.conflist");
        eventually("re-chained after a rewrite", || {
            plugin_types(&list) == ["bridge", "portmap", "aether-cni"]
        });
    }
    // A second installer run is a no-op on an already chained file.
    let before = std::fs::read(&list).unwrap();
    let once = Command::new(BIN)
        .args(install_args(&bin, &conf))
        .args(["--watch", "false"])
        .output()
        .unwrap();
    assert!(once.status.success(), "{}", String::from_utf8_lossy(&once.stderr));
    assert_eq!(std::fs::read(&list).unwrap(), before);
    // Other files in the dir are never touched.
    std::fs::write(
        conf.join("99-later.conflist"),
        r#"{"cniVersion":"1.0.0","name":"x","plugins":[{"type":"ptp"}]}"#,
    )
    .unwrap();
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(plugin_types(&conf.join("99-later.conflist")), ["ptp"]);

    drop(installer);
    let out = uninstall(&bin, &conf);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(plugin_types(&list), ["bridge", "portmap"]);
    assert!(!installed.exists());
    // Uninstalling again is fine.
    assert!(uninstall(&bin, &conf).status.success());
}

/// The binary lands executable, and the installed copy answers VERSION.
fn the_installed_binary_is_a_working_plugin(installed: &Path) {
    eventually("the binary is installed", || installed.is_file());
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(
        std::fs::metadata(installed).unwrap().permissions().mode() & 0o777,
        0o755
    );
    let out = Command::new(installed)
        .env("CNI_COMMAND", "VERSION")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stdout).contains("\"supportedVersions\""));
}

fn our_plugin_is_chained_last_keeping_the_primarys_settings(list: &Path) {
    eventually("our plugin is chained last", || {
        plugin_types(list) == ["bridge", "portmap", "aether-cni"]
    });
    let v: Value = serde_json::from_str(&std::fs::read_to_string(list).unwrap()).unwrap();
    assert_eq!(
        v["plugins"][2],
        json!({"type": "aether-cni", "agentSocket": "/run/test/cni.sock", "meshDns": "10.0.0.10:18054",
               "logFile": "/var/log/aether-cni.log", "stateDir": "/var/run/aether", "excludedNamespaces": ["kube-system"]})
    );
    // The primary CNI's own settings are kept verbatim.
    assert_eq!(
        v["plugins"][1],
        json!({"type": "portmap", "capabilities": {"portMappings": true}})
    );
}

fn uninstall(bin: &Path, conf: &Path) -> std::process::Output {
    Command::new(BIN)
        .args([
            "uninstall",
            "--bin-dir",
            &bin.display().to_string(),
            "--conf-dir",
            &conf.display().to_string(),
        ])
        .output()
        .unwrap()
}

#[test]
fn a_broken_conf_dir_is_a_clear_error() {
    let root = tempfile::tempdir().unwrap();
    let (bin, conf) = dirs(root.path());
    std::fs::write(conf.join("10-bad.conflist"), "{ this is not json").unwrap();
    let out = Command::new(BIN)
        .args(install_args(&bin, &conf))
        .args(["--watch", "false"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("10-bad.conflist: not a CNI config"), "{stderr}");
    let bad = Command::new(BIN).args(["install", "--bogus"]).output().unwrap();
    assert!(!bad.status.success());
}

/// What the fake API server answers for the owner DaemonSet.
#[derive(Clone, Copy, Debug)]
enum Owner {
    Present,
    Deleting,
    NotFound,
    /// The release's RBAC or ServiceAccount is already gone.
    Forbidden,
}

impl Owner {
    /// The shared fake API server holding the owner DaemonSet as `self` says.
    fn serve(self) -> ApiServer {
        let api = ApiServer::start();
        let mut daemonset = json!({"metadata": {"name": "aether-agent", "namespace": "aether-system", "uid": "u-1"}});
        match self {
            Owner::Present => {
                api.apply::<DaemonSet>(daemonset);
            }
            Owner::Deleting => {
                daemonset["metadata"]["deletionTimestamp"] = json!("2026-11-30T12:00:00Z");
                api.apply::<DaemonSet>(daemonset);
            }
            Owner::NotFound => {}
            Owner::Forbidden => api.forbid(),
        }
        api
    }
}

/// Runs a watching installer owned by `aether-system/aether-agent` with `kubeconfig`, sends it SIGTERM once our
/// plugin is chained, and returns its stderr after it exited 0.
fn stop_installer(root: &Path, kubeconfig: &Path) -> String {
    let (bin, conf) = dirs(root);
    primary_writes(&conf, "10-pods.conflist");
    let mut child = Command::new(BIN)
        .args(install_args(&bin, &conf))
        .args(["--owner-daemonset", "aether-system/aether-agent"])
        .env("KUBECONFIG", kubeconfig)
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let list = conf.join("10-pods.conflist");
    eventually("our plugin is chained", || {
        plugin_types(&list) == ["bridge", "portmap", "aether-cni"]
    });
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("the installer did not exit after SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(25));
    };
    let mut stderr = String::new();
    std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut stderr).unwrap();
    assert!(status.success(), "installer: {status}\n{stderr}");
    stderr
}

fn chained(root: &Path) -> bool {
    plugin_types(&root.join("net.d/10-pods.conflist")).contains(&"aether-cni".to_owned())
        && root.join("bin/aether-cni").exists()
}

/// On SIGTERM the installer asks the API server about its DaemonSet: present means a rollout (the plugin stays,
/// so no pod starts without capture), gone, being deleted or no longer readable with the release's RBAC means
/// `helm uninstall` (the plugin leaves the node, so pods can start again). An unreachable API server keeps it.
#[test]
fn on_sigterm_the_plugin_stays_for_a_rollout_and_leaves_on_an_uninstall() {
    for (owner, stays) in [
        (Owner::Present, true),
        (Owner::Deleting, false),
        (Owner::NotFound, false),
        (Owner::Forbidden, false),
    ] {
        let root = tempfile::tempdir().unwrap();
        let api = owner.serve();
        let stderr = stop_installer(root.path(), &api.write_kubeconfig(root.path()));
        assert_eq!(
            chained(root.path()),
            stays,
            "{owner:?}: plugin chained after SIGTERM\n{stderr}"
        );
        assert_eq!(
            api.requests().first().map(|r| r.split('?').next().unwrap().to_owned()),
            Some("GET /apis/apps/v1/namespaces/aether-system/daemonsets/aether-agent".to_owned()),
            "{owner:?}"
        );
        assert!(
            !stderr.contains(CALLER_TOKEN),
            "the token must never be logged:\n{stderr}"
        );
    }
    // The API server cannot be reached (it is gone): the plugin stays.
    let root = tempfile::tempdir().unwrap();
    let kubeconfig = ApiServer::start().write_kubeconfig(root.path());
    let stderr = stop_installer(root.path(), &kubeconfig);
    assert!(chained(root.path()), "{stderr}");
    assert!(stderr.contains("cannot tell an uninstall from a rollout"), "{stderr}");
}
