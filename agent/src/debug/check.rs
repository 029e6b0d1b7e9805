//! `/debug/check`: pre-flight and post-install checks in the spirit of `linkerd check`,
//! each PASS, WARN, FAIL (or SKIP when not applicable) with a fix.

use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::Path;
use std::time::{Duration, SystemTime};

use serde::Serialize;
use serde_json::Value;

use super::Inspector;
use crate::node::NodeView;

/// The Envoy release the project pins (what the proxy image ships).
const PINNED_ENVOY: &str = include_str!("../../../proxy/ENVOY_VERSION");
/// A record file older than this is stale (the agent re-stamps it every minute by default).
const RECORDS_STALE: Duration = Duration::from_secs(300);

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum Level {
    Pass,
    Warn,
    Fail,
    Skip,
}

#[derive(Debug, Serialize)]
pub struct Check {
    pub check: &'static str,
    pub status: Level,
    pub detail: String,
    pub fix: String,
}

fn check(name: &'static str, status: Level, detail: impl Into<String>, fix: impl Into<String>) -> Check {
    Check {
        check: name,
        status,
        detail: detail.into(),
        fix: fix.into(),
    }
}

pub async fn check_all(inspector: &Inspector) -> Vec<Check> {
    let view = inspector.node.view();
    let envoy = super::status::envoy(inspector).await;
    let mut checks = vec![
        nftables().await,
        namespaces(&inspector.netns_pin_dir),
        sockets(&inspector.sockets),
    ];
    checks.extend(envoy_checks(&envoy));
    checks.push(xds(&view));
    checks.push(registrar(inspector));
    checks.push(records(inspector));
    checks.push(super::mesh_dns::answering(inspector).await);
    checks.push(svids(&view, SystemTime::now()));
    checks
}

pub async fn page(inspector: &Inspector) -> Value {
    serde_json::json!({ "checks": check_all(inspector).await })
}

async fn nftables() -> Check {
    let out = tokio::process::Command::new("nft")
        .args(["list", "tables"])
        .output()
        .await;
    match out {
        Ok(o) if o.status.success() => check("kernel nftables", Level::Pass, "`nft list tables` works", ""),
        Ok(o) => check(
            "kernel nftables",
            Level::Fail,
            String::from_utf8_lossy(&o.stderr).trim().to_owned(),
            "the agent needs NET_ADMIN and a kernel with nf_tables (nft_nat, nft_redir)",
        ),
        Err(e) => check(
            "kernel nftables",
            Level::Fail,
            format!("running nft: {e}"),
            "install nftables in the agent's image",
        ),
    }
}

fn namespaces(pin_dir: &Path) -> Check {
    if !Path::new("/proc/self/ns/net").exists() {
        return check(
            "network namespaces",
            Level::Fail,
            "no /proc/self/ns/net",
            "a kernel with network namespaces is required",
        );
    }
    let detail = match pin_dir.is_dir() {
        true => format!("pins under {}", pin_dir.display()),
        false => format!(
            "{} does not exist yet (created by the first pod's CNI ADD)",
            pin_dir.display()
        ),
    };
    check("network namespaces", Level::Pass, detail, "")
}

fn sockets(paths: &[std::path::PathBuf]) -> Check {
    for path in paths {
        let bad = match std::fs::metadata(path) {
            Err(e) => Some(format!("{}: {e}", path.display())),
            Ok(m) if !m.file_type().is_socket() => Some(format!("{} is not a socket", path.display())),
            Ok(m) if m.permissions().mode() & 0o077 != 0 => Some(format!(
                "{} has mode {:o}: others may talk to the agent",
                path.display(),
                m.permissions().mode() & 0o777
            )),
            Ok(_) => None,
        };
        if let Some(detail) = bad {
            return check(
                "socket permissions",
                Level::Fail,
                detail,
                "restart the agent: it binds its sockets 0600",
            );
        }
    }
    check("socket permissions", Level::Pass, "xDS and CNI sockets are 0600", "")
}

fn envoy_checks(envoy: &Value) -> Vec<Check> {
    let pinned = PINNED_ENVOY.trim();
    let Some(state) = envoy["server"]["state"].as_str() else {
        let error = envoy["error"].as_str().unwrap_or("no answer");
        return vec![check(
            "envoy live",
            Level::Fail,
            error,
            "check the proxy container (aether-agent proxy) and its log",
        )];
    };
    let live = match state {
        "LIVE" => check("envoy live", Level::Pass, "Envoy is LIVE", ""),
        other => check(
            "envoy live",
            Level::Fail,
            format!("Envoy is {other}"),
            "wait for it to initialise, or see its log",
        ),
    };
    let version = envoy["server"]["version"].as_str().unwrap_or_default();
    let pin = match version == pinned {
        true => check("envoy version", Level::Pass, format!("{version}, as pinned"), ""),
        false => check(
            "envoy version",
            Level::Warn,
            format!("{version}, but {pinned} is pinned"),
            "run the proxy image this release ships",
        ),
    };
    vec![live, pin]
}

fn xds(view: &NodeView) -> Check {
    let Some(newest) = view.streams.newest() else {
        return check(
            "xds stream",
            Level::Fail,
            "no Envoy is connected to the xDS socket",
            "check the proxy container and its bootstrap",
        );
    };
    match newest.rejected.iter().next() {
        None => check("xds stream", Level::Pass, "Envoy connected, no NACKs", ""),
        Some(((type_url, name), (_, error))) => check(
            "xds stream",
            Level::Fail,
            format!(
                "Envoy rejected {} {name}: {error}",
                type_url.rsplit('.').next().unwrap_or(type_url)
            ),
            "report it: the agent generated config Envoy refuses",
        ),
    }
}

fn registrar(inspector: &Inspector) -> Check {
    match inspector.registrar_connected.get() == 1 {
        true => check("registrar reachable", Level::Pass, "the catalog watch is up", ""),
        false => check(
            "registrar reachable",
            Level::Fail,
            "the catalog watch is down",
            "check the registrar's /ready, the agent's log (TLS, token) and the network",
        ),
    }
}

fn records(inspector: &Inspector) -> Check {
    let fix = "check the agent's DNS catalog watch and state dir";
    match super::facts::read_records(&inspector.records) {
        Err(e) => check("dns records", Level::Fail, e, fix),
        Ok(file) if file.age(SystemTime::now()) > RECORDS_STALE => check(
            "dns records",
            Level::Warn,
            format!("the record file is {}s old", file.age(SystemTime::now()).as_secs()),
            fix,
        ),
        Ok(_) if inspector.dns_connected.get() != 1 => check(
            "dns records",
            Level::Warn,
            "the DNS catalog watch is down: records may be stale",
            fix,
        ),
        Ok(file) => check(
            "dns records",
            Level::Pass,
            format!("{} records, fresh", file.records.len()),
            "",
        ),
    }
}

/// Every local pod's SVID is valid now (not expired, not from the future: clock skew).
pub fn svids(view: &NodeView, now: SystemTime) -> Check {
    let Some(identities) = &view.identities else {
        return check("ca/svid validity", Level::Skip, "mTLS is off (--identity none)", "");
    };
    let fix = "check the identity provider (built-in CA files, or SPIRE) and the node's clock";
    for pod in &view.pods {
        let Some(svid) = identities.svids.get(&pod.id()) else {
            return check(
                "ca/svid validity",
                Level::Fail,
                format!("{} has no SVID", pod.id()),
                fix,
            );
        };
        if svid.not_after <= now {
            return check(
                "ca/svid validity",
                Level::Fail,
                format!("{}'s SVID expired", pod.id()),
                fix,
            );
        }
        if svid.not_before > now {
            return check(
                "ca/svid validity",
                Level::Fail,
                format!("{}'s SVID is not yet valid: clock skew", pod.id()),
                fix,
            );
        }
    }
    if identities.bundles.is_empty() {
        return check("ca/svid validity", Level::Fail, "no trust bundle", fix);
    }
    check(
        "ca/svid validity",
        Level::Pass,
        format!(
            "{} SVID(s) valid, {} trust bundle(s)",
            identities.svids.len(),
            identities.bundles.len()
        ),
        "",
    )
}
