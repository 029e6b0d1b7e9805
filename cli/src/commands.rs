//! The four commands: ask the agent, judge, render.

use std::path::Path;

use serde_json::{Value, json};

use crate::client::{Agent, ClientError, encode};
use crate::{Code, Output, Section, checks, table};

type Answer = Result<(Code, String), ClientError>;

fn json_out(value: &Value) -> String {
    format!("{}\n", serde_json::to_string_pretty(value).expect("JSON serialises"))
}

fn text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Null => "-".into(),
        other => other.to_string(),
    }
}

/// The request `explain` judges at the route hop: `-X` and `-H`.
pub struct Call<'a> {
    pub method: Option<&'a str>,
    /// `name:value` each.
    pub headers: &'a [String],
}

pub fn explain(agent: &Agent, pod: &str, target: &str, call: &Call, output: Output) -> Answer {
    let (ns, name) = pod.split_once('/').unwrap_or(("default", pod));
    let mut path = format!("/debug/explain/{}/{}/{}", encode(ns), encode(name), encode(target));
    // The method and headers follow the target as segments (the admin API sees paths only).
    if call.method.is_some() || !call.headers.is_empty() {
        path.push_str(&format!("/{}", encode(call.method.unwrap_or("GET"))));
        for header in call.headers {
            path.push_str(&format!("/{}", encode(header)));
        }
    }
    let answer = agent.get(&path)?;
    let code = match answer["verdict"].as_str() {
        Some("ok") => Code::Ok,
        Some("warn") => Code::Warn,
        _ => Code::Fail,
    };
    if output == Output::Json {
        return Ok((code, json_out(&answer)));
    }
    let service = answer["service"]
        .as_str()
        .map(|s| format!(" ({s})"))
        .unwrap_or_default();
    let mut out = format!("{pod} → {target}{service}\n\n");
    let hops = answer["hops"].as_array().cloned().unwrap_or_default();
    // The hops up to the first failure: the later ones were not judged.
    let shown = hops
        .iter()
        .position(|h| h["status"] == "fail")
        .map_or(hops.len(), |i| i + 1);
    let rows: Vec<Vec<String>> = hops[..shown]
        .iter()
        .map(|h| vec![text(&h["hop"]), text(&h["status"]).to_uppercase(), text(&h["why"])])
        .collect();
    out.push_str(&table::render(&["HOP", "STATUS", "WHY"], &rows));
    if shown < hops.len() {
        let rest: Vec<String> = hops[shown..].iter().map(|h| text(&h["hop"])).collect();
        out.push_str(&format!("(not checked after the failure: {})\n", rest.join(", ")));
    }
    let first = &answer["first"];
    out.push_str(&match code {
        Code::Ok => "\nverdict: ok: every hop is ok\n".to_owned(),
        _ => format!(
            "\nverdict: {} at {}: {}\nfix: {}\n",
            text(&first["status"]).to_uppercase(),
            text(&first["hop"]),
            text(&first["why"]),
            text(&first["fix"])
        ),
    });
    out.push_str(&recent_failures(&answer["recent_failures"]));
    Ok((code, out))
}

/// The pod's last failed calls to the target, as Envoy logged them (newest first).
fn recent_failures(failures: &Value) -> String {
    let failures = failures.as_array().cloned().unwrap_or_default();
    if failures.is_empty() {
        return String::new();
    }
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let rows: Vec<Vec<String>> = failures
        .iter()
        .map(|f| {
            let ago = now_ms.saturating_sub(f["at_ms"].as_u64().unwrap_or(now_ms)) / 1000;
            let request = format!("{} {}{}", text(&f["method"]), text(&f["authority"]), text(&f["path"]));
            let why = [&f["details"], &f["upstream_failure"]]
                .map(text)
                .into_iter()
                .filter(|s| !s.is_empty())
                .collect::<Vec<_>>()
                .join(": ");
            let flags = Some(text(&f["flags"])).filter(|s| !s.is_empty()).unwrap_or("-".into());
            vec![format!("{ago}s ago"), request, text(&f["status"]), flags, why]
        })
        .collect();
    let table = table::render(&["WHEN", "REQUEST", "STATUS", "FLAGS", "WHY"], &rows);
    format!("\nlast failed calls to the target (Envoy's access log):\n{table}")
}

pub fn status(agent: &Agent, cni_conf_dir: &Path, output: Output) -> Answer {
    let mut status = agent.get("/debug/status")?;
    status["agent"]["ready"] = json!(ready(agent)?);
    // Read here, on the node: the agent's admin API does not serve files.
    status["cni"] = checks::cni_conflist(cni_conf_dir);
    let (code, problems) = checks::judge_status(&status);
    if output == Output::Json {
        return Ok((code, json_out(&status)));
    }
    let mut out = status_lines(&status);
    let rows: Vec<Vec<String>> = status["pods"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|p| {
            let svid = p["svid_expires_in_seconds"]
                .as_i64()
                .map_or("-".into(), |s| format!("{s}s"));
            let ips = p["ips"]
                .as_array()
                .into_iter()
                .flatten()
                .map(text)
                .collect::<Vec<_>>()
                .join(",");
            let cells = [&p["pod"], &p["service"]].map(text);
            let rest = [&p["served"], &p["registered"]].map(text);
            vec![
                cells[0].clone(),
                cells[1].clone(),
                ips,
                capture(p),
                inbound_mtls(p),
                rest[0].clone(),
                rest[1].clone(),
                svid,
            ]
        })
        .collect();
    out.push('\n');
    out.push_str(&table::render(
        &[
            "POD",
            "SERVICE",
            "IPS",
            "CAPTURE",
            "INBOUND MTLS",
            "SERVED",
            "REGISTERED",
            "SVID EXPIRES IN",
        ],
        &rows,
    ));
    if !problems.is_empty() {
        out.push_str(&format!("\nproblems:\n  {}\n", problems.join("\n  ")));
    }
    Ok((code, out))
}

/// A pod's capture rules, with the connections they captured: `intact (12 captured)`.
fn capture(pod: &Value) -> String {
    match pod["captured_connections"].as_u64() {
        Some(captured) => format!("{} ({captured} captured)", text(&pod["capture"])),
        None => text(&pod["capture"]),
    }
}

/// A pod's inbound mTLS mode, with what STRICT refused: `strict (2 refused)`.
fn inbound_mtls(pod: &Value) -> String {
    match pod["refused_plaintext"].as_u64() {
        Some(refused) => format!("{} ({refused} refused)", text(&pod["inbound_mtls"])),
        None => text(&pod["inbound_mtls"]),
    }
}

/// The agent's `/ready`: `true`, or the reason it is not.
fn ready(agent: &Agent) -> Result<Value, ClientError> {
    let (status, body) = agent.get_raw("/ready")?;
    Ok(match status {
        200 => json!(true),
        _ => json!(body.trim()),
    })
}

fn status_lines(s: &Value) -> String {
    let ready = match &s["agent"]["ready"] {
        Value::Bool(true) => "ready".to_owned(),
        other => text(other),
    };
    let envoy = match &s["envoy"]["server"] {
        Value::Object(e) => format!(
            "{}  {}  epoch {}  up {}s",
            text(&e["state"]),
            text(&e["version"]),
            text(&e["epoch"]),
            text(&e["uptime_seconds"])
        ),
        _ => format!("unreachable: {}", text(&s["envoy"]["error"])),
    };
    let x = &s["xds"];
    let nacks = x["nacks"].as_array().map_or(0, Vec::len);
    let r = &s["registrar"];
    let d = &s["dns"];
    let dns = match d.get("error") {
        Some(e) => format!("record file: {}", text(e)),
        None => format!(
            "{} records  generation {}  age {}s",
            text(&d["records"]),
            text(&d["generation"]),
            text(&d["age_seconds"])
        ),
    };
    let up = |v: &Value| if v.as_bool() == Some(true) { "up" } else { "DOWN" };
    let version = match r["behind"].as_u64() {
        Some(behind) => format!("version {}  {behind} behind head", text(&r["version"])),
        None => format!("version {}  head {}", text(&r["version"]), text(&r["head"])),
    };
    format!(
        "node       {}\nagent      {}  {}\nenvoy      {envoy}\nxds        {} stream(s)  {}/{} acked  {nacks} NACK(s)\nregistrar  watch {}  {}  {version}  updated {}s ago  {} services in the node's slice\nmesh       {}\nmesh-dns   watch {}  {dns}\ncni        {} {}\nerrors     {}\n",
        text(&s["node"]),
        text(&s["agent"]["version"]),
        ready,
        text(&x["streams"]),
        text(&x["acked"]),
        text(&x["served"]),
        up(&r["connected"]),
        if r["synced"] == true { "synced" } else { "NOT SYNCED" },
        text(&r["updated_seconds_ago"]),
        text(&r["services"]),
        mesh_configs(&s["mesh_configs"]),
        up(&d["watch_connected"]),
        text(&s["cni"]["status"]),
        text(&s["cni"]["detail"]),
        errors(&s["errors"]),
    )
}

/// The MeshConfigs in force on the node: `aether-system/default (mesh-wide, domain
/// corp.internal, generation 3)  …`.
fn mesh_configs(configs: &Value) -> String {
    let rows: Vec<String> = (configs.as_array().into_iter().flatten())
        .map(|c| {
            let scope = match (c["mesh_wide"] == true, c["mesh_domain"].as_str()) {
                (true, Some(domain)) => format!("mesh-wide, domain {domain}, "),
                (true, None) => "mesh-wide, ".to_owned(),
                (false, _) => String::new(),
            };
            let invalid = match c["invalid"].as_str() {
                Some(why) => format!(", INVALID: {why}"),
                None => String::new(),
            };
            format!(
                "{} ({scope}generation {}{invalid})",
                text(&c["key"]),
                text(&c["generation"])
            )
        })
        .collect();
    match rows.is_empty() {
        true => "no MeshConfig: built-in defaults".to_owned(),
        false => rows.join("  "),
    }
}

/// The agent's error counts since start: `cni calls 0  identity 0  …`.
fn errors(e: &Value) -> String {
    let counts = [
        ("cni calls", "cni_calls_failed"),
        ("identity", "identity"),
        ("record writes", "dns_record_writes"),
        ("envoy stats reads", "envoy_stats_reads"),
    ];
    let counts: Vec<String> = counts
        .iter()
        .map(|(label, key)| format!("{label} {}", text(&e[key])))
        .collect();
    format!("{}  (since the agent started)", counts.join("  "))
}

pub fn check(agent: &Agent, cni_conf_dir: &Path, output: Output) -> Answer {
    let answer = agent.get("/debug/check")?;
    let mut all = vec![checks::agent_ready(&ready(agent)?)];
    all.extend(answer["checks"].as_array().cloned().unwrap_or_default());
    all.push(checks::cni_conflist(cni_conf_dir));
    let code = all.iter().fold(Code::Ok, |code, c| code.worst(checks::code_of(c)));
    if output == Output::Json {
        return Ok((code, json_out(&json!({ "checks": all }))));
    }
    let rows: Vec<Vec<String>> = all
        .iter()
        .map(|c| {
            let fix = c["fix"]
                .as_str()
                .filter(|f| !f.is_empty())
                .map(|f| format!(" (fix: {f})"));
            vec![
                text(&c["status"]),
                text(&c["check"]),
                format!("{}{}", text(&c["detail"]), fix.unwrap_or_default()),
            ]
        })
        .collect();
    Ok((code, table::render(&["STATUS", "CHECK", "DETAIL"], &rows)))
}

pub fn proxy_config(agent: &Agent, pod: &str, section: Section, output: Output) -> Answer {
    let (ns, name) = pod.split_once('/').unwrap_or(("default", pod));
    let section = format!("{section:?}").to_lowercase();
    let path = format!("/debug/proxy-config/{}/{}/{section}", encode(ns), encode(name));
    let answer = match agent.get(&path) {
        Err(ClientError::Status { status: 404, body, .. }) => return Ok((Code::Fail, format!("{body}\n"))),
        other => other?,
    };
    if output == Output::Json {
        return Ok((Code::Ok, json_out(&answer)));
    }
    let columns: Vec<String> = answer["columns"].as_array().into_iter().flatten().map(text).collect();
    let columns: Vec<&str> = columns.iter().map(String::as_str).collect();
    let rows: Vec<Vec<String>> = answer["rows"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|r| r.as_array().into_iter().flatten().map(text).collect())
        .collect();
    Ok((Code::Ok, table::render(&columns, &rows)))
}
