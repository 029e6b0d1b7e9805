//! What the CLI judges itself: the node's health from `/debug/status`, and the checks only
//! the node's filesystem can answer (the CNI conflist chain).

use std::path::Path;

use serde_json::{Value, json};

use crate::Code;

/// The node's health: the worst finding, and each problem in one line.
pub fn judge_status(s: &Value) -> (Code, Vec<String>) {
    let mut fails = Vec::new();
    if s["agent"]["ready"] != json!(true) {
        fails.push(format!("agent not ready: {}", s["agent"]["ready"]));
    }
    match s["envoy"]["server"]["state"].as_str() {
        Some("LIVE") => {}
        Some(state) => fails.push(format!("Envoy is {state}")),
        None => fails.push(format!("Envoy unreachable: {}", s["envoy"]["error"])),
    }
    if s["xds"]["streams"].as_u64() == Some(0) {
        fails.push("no Envoy connected to the xDS socket".into());
    }
    if s["registrar"]["connected"] != json!(true) {
        fails.push("the registrar watch is down".into());
    }
    if s["cni"]["status"] == "FAIL" {
        fails.push(format!("CNI: {}", s["cni"]["detail"]));
    }
    for pod in s["pods"].as_array().into_iter().flatten() {
        let capture = pod["capture"].as_str().unwrap_or_default();
        if capture != "intact" && capture != "notcaptured" {
            fails.push(format!("{}: capture {capture}", pod["pod"]));
        }
        if pod["svid_expires_in_seconds"].as_i64().is_some_and(|s| s <= 0) {
            fails.push(format!("{}: SVID expired", pod["pod"]));
        }
    }
    let warns = warnings(s);
    let code = match (fails.is_empty(), warns.is_empty()) {
        (false, _) => Code::Fail,
        (true, false) => Code::Warn,
        (true, true) => Code::Ok,
    };
    (code, fails.into_iter().chain(warns).collect())
}

fn warnings(s: &Value) -> Vec<String> {
    let mut warns = Vec::new();
    if s["registrar"]["connected"] == json!(true) && s["registrar"]["synced"] == json!(false) {
        warns.push("the registrar has not answered for every dependency yet".into());
    }
    if let Some(lag) = lag(&s["registrar"]) {
        warns.push(lag);
    }
    if s["cni"]["status"] == "WARN" {
        warns.push(format!("CNI: {}", s["cni"]["detail"]));
    }
    if let Some(nacks) = s["xds"]["nacks"].as_array().filter(|n| !n.is_empty()) {
        warns.push(format!("{} resource(s) NACKed by Envoy", nacks.len()));
    }
    if s["dns"]["watch_connected"] != json!(true) || s["dns"].get("error").is_some() {
        warns.push("mesh-dns records may be stale (DNS watch down or file unreadable)".into());
    }
    warns
}

/// The registrar confirms changes outside the node's filter every 5 s; a view behind its
/// head and unmoved for twice that lags.
const LAG_AFTER_SECONDS: u64 = 10;

/// The watch lags: the registrar holds changes the view has not reached for too long.
fn lag(registrar: &Value) -> Option<String> {
    let behind = registrar["behind"].as_u64().filter(|b| *b > 0)?;
    let unmoved = registrar["updated_seconds_ago"].as_u64()?;
    (unmoved > LAG_AFTER_SECONDS).then(|| {
        format!("the registrar watch lags: {behind} change(s) behind the registrar's head, unmoved for {unmoved}s")
    })
}

fn check(name: &str, status: &str, detail: impl Into<String>, fix: &str) -> Value {
    json!({ "check": name, "status": status, "detail": detail.into(), "fix": fix })
}

pub fn code_of(check: &Value) -> Code {
    match check["status"].as_str() {
        Some("FAIL") => Code::Fail,
        Some("WARN") => Code::Warn,
        _ => Code::Ok,
    }
}

/// `/ready` as a check: `true`, or the reason.
pub fn agent_ready(ready: &Value) -> Value {
    match ready {
        Value::Bool(true) => check("agent ready", "PASS", "the agent serves", ""),
        other => check(
            "agent ready",
            "FAIL",
            other.as_str().unwrap_or("not ready"),
            "see the agent's log",
        ),
    }
}

/// The node's CNI config chains aether-cni last in the first (alphabetical) conflist,
/// the one the runtime uses.
pub fn cni_conflist(dir: &Path) -> Value {
    let name = "cni conflist chain";
    let fix = "run `aether-cni install` (the agent DaemonSet's init container does)";
    let mut files: Vec<_> = match std::fs::read_dir(dir) {
        Ok(entries) => entries.filter_map(|e| e.ok()).map(|e| e.path()).collect(),
        Err(e) => {
            return check(
                name,
                "WARN",
                format!(
                    "{}: {e} (run aether where the node's CNI config is mounted)",
                    dir.display()
                ),
                "",
            );
        }
    };
    files.retain(|p| matches!(p.extension().and_then(|e| e.to_str()), Some("conflist" | "conf")));
    files.sort();
    let Some(first) = files.first() else {
        return check(name, "FAIL", format!("no CNI config in {}", dir.display()), fix);
    };
    let config: Value = std::fs::read(first)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default();
    let types: Vec<&str> = config["plugins"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|p| p["type"].as_str())
        .collect();
    match types.iter().position(|t| *t == "aether-cni") {
        Some(i) if i + 1 == types.len() => {
            check(name, "PASS", format!("{}: {}", first.display(), types.join(" → ")), "")
        }
        Some(_) => check(
            name,
            "WARN",
            format!("{}: aether-cni is not last: {}", first.display(), types.join(" → ")),
            fix,
        ),
        None => check(
            name,
            "FAIL",
            format!("{} does not chain aether-cni: {}", first.display(), types.join(" → ")),
            fix,
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn healthy() -> Value {
        json!({
            "agent": {"ready": true},
            "envoy": {"reachable": true, "server": {"state": "LIVE"}},
            "xds": {"streams": 1, "nacks": []},
            "registrar": {"connected": true, "synced": true, "behind": 2, "updated_seconds_ago": 3},
            "dns": {"watch_connected": true, "records": 3},
            "cni": {"check": "cni conflist chain", "status": "PASS", "detail": "/etc/cni/net.d/10.conflist: bridge → aether-cni"},
            "pods": [{"pod": "demo/a", "capture": "intact", "svid_expires_in_seconds": 100}],
        })
    }

    #[test]
    fn status_names_each_component_down() {
        assert_eq!(judge_status(&healthy()), (Code::Ok, vec![]));
        let cases: [(&str, Value, Code, &str); 8] = [
            (
                "/envoy",
                json!({"reachable": false, "error": "connect refused"}),
                Code::Fail,
                "Envoy unreachable",
            ),
            (
                "/registrar/connected",
                json!(false),
                Code::Fail,
                "registrar watch is down",
            ),
            (
                "/agent/ready",
                json!("not ready: starting"),
                Code::Fail,
                "agent not ready",
            ),
            ("/pods/0/capture", json!("drifted"), Code::Fail, "capture drifted"),
            ("/xds/nacks", json!([{"name": "x"}]), Code::Warn, "NACKed"),
            ("/cni/status", json!("FAIL"), Code::Fail, "CNI: "),
            ("/dns/watch_connected", json!(false), Code::Warn, "stale"),
            (
                "/registrar/synced",
                json!(false),
                Code::Warn,
                "not answered for every dependency",
            ),
        ];
        for (pointer, value, code, words) in cases {
            let mut s = healthy();
            *s.pointer_mut(pointer).unwrap() = value;
            let (got, problems) = judge_status(&s);
            assert_eq!(got, code, "{pointer}");
            assert!(problems.iter().any(|p| p.contains(words)), "{pointer}: {problems:?}");
        }
    }

    #[test]
    fn a_watch_behind_its_head_lags_only_once_the_progress_note_is_overdue() {
        let lagging = |behind: Value, ago: u64| {
            let mut s = healthy();
            s["registrar"]["behind"] = behind;
            s["registrar"]["updated_seconds_ago"] = json!(ago);
            judge_status(&s)
        };
        // Behind for 3 s: changes outside the filter, confirmed within 5 s.
        assert_eq!(lagging(json!(2), 3), (Code::Ok, vec![]));
        assert_eq!(lagging(json!(0), 60), (Code::Ok, vec![]));
        assert_eq!(lagging(Value::Null, 60), (Code::Ok, vec![]), "no common instance");
        let (code, problems) = lagging(json!(2), 11);
        assert_eq!(code, Code::Warn);
        assert_eq!(
            problems,
            ["the registrar watch lags: 2 change(s) behind the registrar's head, unmoved for 11s"]
        );
    }

    #[test]
    fn the_conflist_must_chain_aether_cni_last() {
        let dir = tempdir();
        std::fs::write(
            dir.join("10-bridge.conflist"),
            r#"{"plugins":[{"type":"bridge"},{"type":"aether-cni"}]}"#,
        )
        .unwrap();
        assert_eq!(cni_conflist(&dir)["status"], "PASS");
        std::fs::write(dir.join("05-first.conflist"), r#"{"plugins":[{"type":"bridge"}]}"#).unwrap();
        assert_eq!(cni_conflist(&dir)["status"], "FAIL");
        assert_eq!(cni_conflist(&dir.join("absent"))["status"], "WARN");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    fn tempdir() -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("aether-cli-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }
}
