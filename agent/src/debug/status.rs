//! `/debug/status`: the node at a glance — agent, Envoy, xDS, the registrar stream, the
//! mesh-dns record file, and every local pod (captured, inbound mTLS mode, served by
//! Envoy, SVID expiry).

use std::time::SystemTime;

use aether_proto::registrar::v1::{ListServicesRequest, Version};
use futures::StreamExt;
use serde_json::{Value, json};

use super::Inspector;
use crate::node::NodeView;
use crate::pod::LocalPod;
use crate::xds;
use crate::xds::resources;

/// How many pods' capture rules are checked at once (one `nsenter nft` each).
const CAPTURE_CHECKS: usize = 8;

pub async fn status(inspector: &Inspector) -> Value {
    let view = inspector.node.view();
    let envoy = envoy(inspector).await;
    // The futures are made first: a closure inside the stream would not be Send (rust#64552).
    let rows: Vec<_> = view.pods.iter().map(|pod| pod_row(inspector, &view, pod)).collect();
    let pods: Vec<Value> = futures::stream::iter(rows).buffered(CAPTURE_CHECKS).collect().await;
    json!({
        "node": inspector.node_name,
        "agent": { "version": env!("CARGO_PKG_VERSION") },
        "envoy": envoy,
        "xds": xds_state(&view),
        "registrar": registrar(inspector, &view).await,
        "mesh_configs": mesh_configs(&view),
        "dns": dns(inspector),
        "errors": errors(&inspector.errors),
        "pods": pods,
    })
}

/// The catalog watch: up, synced, the version its view is at, and how far the registrar's
/// head is ahead of it. Changes outside the node's filter are not sent, only confirmed
/// by a progress note every few seconds (`PROGRESS_INTERVAL`), so `behind` > 0 is normal
/// for that long after the view last moved; longer, the stream lags.
async fn registrar(inspector: &Inspector, view: &NodeView) -> Value {
    let watched = &view.watched;
    let head = head(inspector).await;
    let behind = match (&watched.version, &head) {
        (Some(ours), Ok(head)) if ours.instance == head.instance => json!(head.seq.saturating_sub(ours.seq)),
        _ => Value::Null,
    };
    json!({
        "connected": inspector.registrar_connected.get() == 1,
        // The registrar has answered for every service the node depends on.
        "synced": view.wanted.is_subset(&watched.filter),
        "watched": watched.filter.len(),
        "services": watched.catalog.services.len(),
        "version": watched.version.as_ref().map(version),
        "updated_seconds_ago": watched.updated.map(|t| t.elapsed().unwrap_or_default().as_secs()),
        "head": head.as_ref().map_or_else(|e| json!({ "error": e }), |v| json!(version(v))),
        // Changes the registrar holds that the view has not reached (null: no common instance).
        "behind": behind,
    })
}

/// The MeshConfigs the node holds (proposals/016): the mesh-wide one and those of its pods'
/// and dependencies' namespaces, with the generation in force; one that fails validation
/// is listed with why (its namespace runs on the mesh's settings).
fn mesh_configs(view: &NodeView) -> Value {
    let configs = view.watched.catalog.mesh_configs.values();
    let row = |c: &std::sync::Arc<aether_proto::registry::v1::MeshConfig>| {
        json!({
            "key": aether_proto::view::mesh_config_key(c),
            "mesh_wide": c.mesh_wide,
            "generation": c.generation,
            "mesh_domain": Some(&c.mesh_domain).filter(|d| !d.is_empty()),
            "invalid": aether_api::mesh_config::validate(c).err().map(|r| r.to_string()),
        })
    };
    Value::Array(configs.map(row).collect())
}

/// The agent's error counts since start (NACKs are under `xds`).
fn errors(e: &super::ErrorCounters) -> Value {
    json!({
        "cni_calls_failed": e.cni.failed(),
        "identity": e.identity.get(),
        "dns_record_writes": e.dns_records.get(),
        "envoy_stats_reads": e.envoy_stats.get(),
    })
}

/// How long `status` waits for the registrar's head version.
const HEAD_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(1);

/// The registrar's current version, asked on the watch's own connection.
async fn head(inspector: &Inspector) -> Result<Version, String> {
    let mut client = inspector.registrar.client();
    let ask = client.list_services(ListServicesRequest {});
    match tokio::time::timeout(HEAD_TIMEOUT, ask).await {
        Ok(Ok(answer)) => answer
            .into_inner()
            .version
            .ok_or_else(|| "no version in the answer".to_owned()),
        Ok(Err(status)) => Err(format!("ListServices: {}", status.message())),
        Err(_) => Err(format!("no answer within {HEAD_TIMEOUT:?}")),
    }
}

fn version(v: &Version) -> String {
    format!("{}:{}", v.instance, v.seq)
}

pub async fn envoy(inspector: &Inspector) -> Value {
    match inspector.envoy.get("/server_info").await {
        Ok(body) => match super::envoy::server(&body) {
            Some(server) => json!({ "reachable": true, "server": server }),
            None => json!({ "reachable": true, "error": "unexpected /server_info answer" }),
        },
        Err(e) => json!({ "reachable": false, "error": e.to_string() }),
    }
}

pub fn xds_state(view: &NodeView) -> Value {
    let served: usize = view.snapshot.types.values().map(|r| r.len()).sum();
    let newest = view.streams.newest();
    let acked: usize = newest.map_or(0, |s| {
        s.acked
            .iter()
            .map(|(t, names)| {
                names
                    .iter()
                    .filter(|(n, v)| view.snapshot.version_of(t, n) == Some(v.as_str()))
                    .count()
            })
            .sum()
    });
    let nacks: Vec<Value> = newest
        .into_iter()
        .flat_map(|s| s.rejected.iter())
        .map(|((type_url, name), (_, error))| {
            json!({ "type": type_url.rsplit('.').next(), "name": name, "error": error })
        })
        .collect();
    json!({ "streams": view.streams.live.len(), "served": served, "acked": acked, "nacks": nacks })
}

pub fn dns(inspector: &Inspector) -> Value {
    let connected = inspector.dns_connected.get() == 1;
    match super::facts::read_records(&inspector.records) {
        Ok(file) => json!({
            "watch_connected": connected,
            "records": file.records.len(),
            "generation": file.generation,
            "age_seconds": file.age(SystemTime::now()).as_secs(),
        }),
        Err(error) => json!({ "watch_connected": connected, "error": error }),
    }
}

async fn pod_row(inspector: &Inspector, view: &NodeView, pod: &LocalPod) -> Value {
    let (capture, counters) = match crate::capture::check(&inspector.capture, &pod.container_id, &pod.netns).await {
        Ok(crate::capture::Verdict::Intact(counters)) => ("intact".to_owned(), Some(counters)),
        Ok(verdict) => (format!("{verdict:?}").to_lowercase(), None),
        Err(e) => (format!("error: {e}"), None),
    };
    let inbound_mtls = match crate::capture::applied(&inspector.capture, &pod.container_id) {
        Ok(applied) => json!(applied.map(|capture| capture.inbound_mtls)),
        Err(e) => json!(format!("error: {e}")),
    };
    let listeners: Vec<String> = resources::pod_listener_names(pod).into_iter().collect();
    let svid = view.identities.as_ref().and_then(|i| i.svids.get(&pod.id()));
    let endpoints = view.watched.catalog.endpoints.get(&pod.info.service());
    let registered = endpoints.map(|e| pod.ips.iter().any(|ip| e.contains_key(&ip.to_string())));
    json!({
        "pod": pod.id(),
        "ips": pod.ips,
        "service": pod.info.service(),
        "capture": capture,
        // Since the rules were last applied (null: not intact).
        "captured_connections": counters.map(|c| c.captured),
        // As applied in the pod's netns (null: not captured), and what STRICT refused.
        "inbound_mtls": inbound_mtls,
        "refused_plaintext": counters.and_then(|c| c.refused_plaintext),
        "served": super::facts::resource(view, xds::LISTENER, &listeners).acked,
        // Known only when the node watches the pod's own service.
        "registered": registered,
        "svid_expires_in_seconds": svid.map(|s| expires_in(s.not_after)),
        "config_errors": pod.info.config_errors().len(),
    })
}

/// Seconds until `t` (negative once past).
pub fn expires_in(t: SystemTime) -> i64 {
    match t.duration_since(SystemTime::now()) {
        Ok(left) => left.as_secs() as i64,
        Err(past) => -(past.duration().as_secs() as i64),
    }
}
