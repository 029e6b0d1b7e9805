//! The `aether-cni` binary executed as a runtime does (environment + stdin), for every
//! error the spec defines: exact code, a message naming what was wrong, nothing on
//! stdout but the CNI answer, logs in the log file. Needs root (netns) for a few cases.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde_json::{Value, json};

struct Run {
    success: bool,
    stdout: String,
}

impl Run {
    fn json(&self) -> Value {
        serde_json::from_str(self.stdout.trim())
            .unwrap_or_else(|e| panic!("stdout is not one JSON value ({e}): {:?}", self.stdout))
    }
    fn code(&self) -> u64 {
        assert!(!self.success, "succeeded: {}", self.stdout);
        self.json()["code"].as_u64().expect("code")
    }
    fn msg(&self) -> String {
        self.json()["msg"].as_str().unwrap().to_owned()
    }
}

fn plugin(command: Option<&str>, env: &[(&str, &str)], stdin: &str) -> Run {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_aether-cni"));
    cmd.env_clear()
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if let Some(c) = command {
        cmd.env("CNI_COMMAND", c);
    }
    cmd.envs(env.iter().copied());
    let mut child = cmd.spawn().expect("spawn aether-cni");
    child.stdin.take().unwrap().write_all(stdin.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    Run {
        success: out.status.success(),
        stdout: String::from_utf8(out.stdout).unwrap(),
    }
}

struct Fixture {
    dir: tempfile::TempDir,
}

impl Fixture {
    fn new() -> Fixture {
        Fixture {
            dir: tempfile::tempdir().unwrap(),
        }
    }
    fn log(&self) -> PathBuf {
        self.dir.path().join("log/cni.log")
    }
    /// A config whose agent socket nobody listens on.
    fn conf(&self, version: &str, extra: Value) -> String {
        let mut c = json!({
            "cniVersion": version, "name": "test", "type": "aether-cni",
            "agentSocket": self.dir.path().join("no-agent.sock"),
            "stateDir": self.dir.path().join("state"),
            "logFile": self.log(),
            "agentAttempts": 2,
            "agentTimeoutMs": 1000,
        });
        for (k, v) in extra.as_object().unwrap() {
            c[k] = v.clone();
        }
        c.to_string()
    }
}

fn prev_result(netns: &str) -> Value {
    json!({
        "cniVersion": "1.0.0",
        "interfaces": [{"name": "eth0", "mac": "0a:58:0a:00:00:05", "sandbox": netns}],
        "ips": [{"address": "10.99.0.5/24", "gateway": "10.99.0.1", "interface": 0}]
    })
}

const POD_ARGS: &str = "K8S_POD_NAMESPACE=demo;K8S_POD_NAME=web;K8S_POD_UID=u1";

fn sandbox_env(netns: &str) -> Vec<(&str, &str)> {
    vec![
        ("CNI_CONTAINERID", "c1"),
        ("CNI_NETNS", netns),
        ("CNI_IFNAME", "eth0"),
        ("CNI_ARGS", POD_ARGS),
        ("CNI_PATH", "/usr/lib/cni"),
    ]
}

/// A netns made with `ip netns add`, deleted on drop.
struct Netns(String);

impl Netns {
    fn new() -> Netns {
        assert!(
            nix::unistd::geteuid().is_root(),
            "this test needs root (network namespaces)"
        );
        let name = format!("aecni-{}-{}", std::process::id(), rand_suffix());
        let ok = Command::new("ip")
            .args(["netns", "add", &name])
            .status()
            .unwrap()
            .success();
        assert!(ok, "ip netns add {name}");
        Netns(name)
    }
    fn path(&self) -> String {
        format!("/var/run/netns/{}", self.0)
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
    }
}

fn rand_suffix() -> u32 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos(),
    );
    (h.finish() & 0x00ff_ffff) as u32
}

#[test]
fn version_lists_every_supported_version() {
    let run = plugin(Some("VERSION"), &[], r#"{"cniVersion":"1.0.0"}"#);
    assert!(run.success);
    assert_eq!(
        run.json(),
        json!({"cniVersion": "1.0.0", "supportedVersions": ["0.1.0","0.2.0","0.3.0","0.3.1","0.4.0","1.0.0","1.1.0"]})
    );
    // An empty stdin still gets an answer.
    assert_eq!(plugin(Some("VERSION"), &[], "").json()["cniVersion"], "1.1.0");
}

#[test]
fn every_error_case_has_its_spec_code_and_names_the_cause() {
    let f = Fixture::new();
    let ns = Netns::new();
    let netns = ns.path();
    let case = ErrorCases {
        f: &f,
        netns: &netns,
        env: sandbox_env(&netns),
    };
    case.environment_errors_are_4();
    case.bad_stdin_is_6_and_bad_config_7();
    case.unsupported_values_are_2_and_versions_1();
    case.a_gone_netns_is_3_and_a_down_agent_11_then_50();
    // GC without the runtime's list.
    let r = plugin(Some("GC"), &[], &f.conf("1.1.0", json!({})));
    assert_eq!(
        (r.code(), r.msg()),
        (7, "cni.dev/valid-attachments: missing".to_string())
    );

    // Logs went to the log file, never to stdout.
    let log = std::fs::read_to_string(f.log()).expect("log file");
    assert!(log.contains("CNI call failed"), "{log}");
}

/// The error cases' sandbox: a fixture (nobody listens on its agent socket), a real netns and the runtime's
/// environment for it.
struct ErrorCases<'a> {
    f: &'a Fixture,
    netns: &'a str,
    env: Vec<(&'a str, &'a str)>,
}

impl ErrorCases<'_> {
    fn add(&self, stdin: &str, env: &[(&str, &str)]) -> Run {
        plugin(Some("ADD"), env, stdin)
    }

    /// A config at `version` with `extra` fields and a valid prevResult.
    fn with_prev(&self, version: &str, extra: Value) -> String {
        let mut c: Value = serde_json::from_str(&self.f.conf(version, extra)).unwrap();
        c["prevResult"] = prev_result(self.netns);
        c.to_string()
    }

    fn good(&self) -> String {
        self.with_prev("1.0.0", json!({}))
    }

    /// The environment without `key`.
    fn without(&self, key: &str) -> Vec<(&str, &str)> {
        self.env.iter().copied().filter(|(k, _)| *k != key).collect()
    }

    /// 4: the environment.
    fn environment_errors_are_4(&self) {
        let good = self.good();
        let r = plugin(None, &self.env, &good);
        assert_eq!((r.code(), r.msg()), (4, "CNI_COMMAND: missing".to_string()));
        let r = plugin(Some("BOGUS"), &self.env, &good);
        assert_eq!(r.code(), 4);
        assert!(
            r.msg().starts_with("CNI_COMMAND: \"BOGUS\" is not a CNI command"),
            "{}",
            r.msg()
        );
        for key in ["CNI_NETNS", "CNI_CONTAINERID", "CNI_IFNAME"] {
            let r = self.add(&good, &self.without(key));
            assert_eq!((r.code(), r.msg()), (4, format!("{key}: missing")));
        }
        let mut bad_args = self.without("CNI_ARGS");
        bad_args.push(("CNI_ARGS", "K8S_POD_NAME"));
        let r = self.add(&good, &bad_args);
        assert_eq!(
            (r.code(), r.msg()),
            (4, "CNI_ARGS: \"K8S_POD_NAME\" is not KEY=VALUE".to_string())
        );
    }

    /// 6: stdin is not a JSON object. 7: invalid network config, field named.
    fn bad_stdin_is_6_and_bad_config_7(&self) {
        let env = &self.env;
        let r = self.add("{not json", env);
        assert_eq!(r.code(), 6);
        assert!(
            r.msg().starts_with("network configuration on stdin is not JSON"),
            "{}",
            r.msg()
        );
        assert_eq!(self.add("[]", env).code(), 6);

        let r = self.add(r#"{"name":"x"}"#, env);
        assert_eq!((r.code(), r.msg()), (7, "cniVersion: missing".to_string()));
        let r = self.add(&self.f.conf("1.0.0", json!({})), env);
        assert_eq!(r.code(), 7);
        assert!(r.msg().starts_with("prevResult: missing"), "{}", r.msg());
        let cases = [
            (
                json!({"meshDns": "dns.local"}),
                "meshDns: \"dns.local\" is not an ip or ip:port address",
            ),
            (
                json!({"agentSocket": "cni.sock"}),
                "agentSocket: \"cni.sock\" is not an absolute path",
            ),
            (
                json!({"excludedCidrs": ["10.0.0.0/40"]}),
                "excludedCidrs[0]: \"10.0.0.0/40\" is not a CIDR",
            ),
        ];
        for (extra, message) in cases {
            let r = self.add(&self.with_prev("1.0.0", extra), env);
            assert_eq!((r.code(), r.msg()), (7, message.to_string()));
        }
        let mut bad_prev: Value = serde_json::from_str(&self.good()).unwrap();
        bad_prev["prevResult"]["ips"][0]["address"] = json!("10.99.0.5");
        let r = self.add(&bad_prev.to_string(), env);
        assert_eq!(
            (r.code(), r.msg()),
            (
                7,
                "prevResult.ips[0].address: \"10.99.0.5\" is not an address/prefix".to_string()
            )
        );
    }

    /// 2: a value we do not support. 1: incompatible versions.
    fn unsupported_values_are_2_and_versions_1(&self) {
        let env = &self.env;
        let r = self.add(&self.with_prev("1.0.0", json!({"captureMode": "redirect-all"})), env);
        assert_eq!(
            (r.code(), r.msg()),
            (
                2,
                "captureMode: \"redirect-all\" is not supported (use \"vip\" or \"none\")".to_string()
            )
        );

        let r = self.add(&self.with_prev("0.4.0", json!({})), env);
        assert_eq!(
            (r.code(), r.msg()),
            (
                1,
                "cniVersion: \"0.4.0\" is not supported for ADD (supported: 1.0.0, 1.1.0)".to_string()
            )
        );
        assert_eq!(r.json()["cniVersion"], "0.4.0");
        assert_eq!(self.add(&self.with_prev("9.9.9", json!({})), env).code(), 1);
        let r = plugin(
            Some("GC"),
            &[],
            &self.f.conf("1.0.0", json!({"cni.dev/valid-attachments": []})),
        );
        assert_eq!(
            (r.code(), r.msg()),
            (
                1,
                "cniVersion: \"1.0.0\" is not supported for GC (supported: 1.1.0)".to_string()
            )
        );
        let r = plugin(Some("STATUS"), &[], &self.f.conf("1.0.0", json!({})));
        assert_eq!(r.code(), 1);
    }

    /// 3: the netns is gone. 11: the agent is down (fail closed) — and the pin made for it is gone again. 50:
    /// STATUS while the agent does not answer.
    fn a_gone_netns_is_3_and_a_down_agent_11_then_50(&self) {
        let good = self.good();
        let mut gone = self.without("CNI_NETNS");
        gone.push(("CNI_NETNS", "/var/run/netns/aether-no-such-netns"));
        let r = self.add(&good, &gone);
        assert_eq!(
            (r.code(), r.msg()),
            (
                3,
                "CNI_NETNS: \"/var/run/netns/aether-no-such-netns\" does not exist".to_string()
            )
        );

        let r = self.add(&good, &self.env);
        assert_eq!(r.code(), 11, "{}", r.stdout);
        let expected = format!(
            "the aether agent at {} is unavailable (2 attempts): ",
            self.f.dir.path().join("no-agent.sock").display()
        );
        assert!(r.msg().starts_with(&expected), "{}", r.msg());
        assert!(
            !self.f.dir.path().join("state/netns/c1").exists(),
            "a failed ADD left its pin"
        );

        let r = plugin(Some("STATUS"), &[], &self.f.conf("1.1.0", json!({})));
        assert_eq!(r.code(), 50);
        assert!(
            r.msg().starts_with("plugin not available: the aether agent at"),
            "{}",
            r.msg()
        );
    }
}

#[test]
fn pods_outside_the_mesh_pass_through_without_the_agent() {
    let f = Fixture::new();
    let ns = Netns::new();
    let netns = ns.path();
    let mut conf: Value = serde_json::from_str(&f.conf("1.1.0", json!({}))).unwrap();
    conf["prevResult"] = prev_result(&netns);
    // kube-system is excluded by default; no CNI_ARGS means not a Kubernetes pod.
    let mut env = sandbox_env(&netns);
    env.retain(|(k, _)| *k != "CNI_ARGS");
    for args in [Some("K8S_POD_NAMESPACE=kube-system;K8S_POD_NAME=coredns"), None] {
        let mut env = env.clone();
        if let Some(a) = args {
            env.push(("CNI_ARGS", a));
        }
        let r = plugin(Some("ADD"), &env, &conf.to_string());
        assert!(r.success, "{}", r.stdout);
        assert_eq!(r.json(), prev_result(&netns), "ADD must print prevResult unchanged");
        assert!(!Path::new(&f.dir.path().join("state/netns/c1")).exists());
    }
    // DEL of something never added, with the netns gone and the agent down: success, no output.
    let mut del_env = env.clone();
    del_env.retain(|(k, _)| *k != "CNI_NETNS");
    del_env.push(("CNI_ARGS", POD_ARGS));
    for version in ["0.3.1", "0.4.0", "1.0.0", "1.1.0"] {
        let r = plugin(Some("DEL"), &del_env, &f.conf(version, json!({})));
        assert!(r.success, "DEL {version}: {}", r.stdout);
        assert_eq!(r.stdout, "");
    }
}
