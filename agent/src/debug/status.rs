//! `/debug/status`: the node at a glance — agent, Envoy, xDS, the registrar stream, the
//! mesh-dns record file, and every local pod (captured, inbound mTLS mode, served by
//! Envoy, SVID expiry).

use std::time::SystemTime;

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
        "registrar": {
            "connected": inspector.registrar_connected.get() == 1,
            // The registrar has answered for every service the node depends on.
            "synced": view.wanted.is_subset(&view.watched.filter),
            "watched": view.watched.filter.len(),
            "services": view.watched.catalog.services.len(),
        },
        "dns": dns(inspector),
        "pods": pods,
    })
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
    let capture = match crate::capture::check(&inspector.capture, &pod.container_id, &pod.netns).await {
        Ok(verdict) => format!("{verdict:?}").to_lowercase(),
        Err(e) => format!("error: {e}"),
    };
    let (inbound_mtls, refused) = inbound_mtls(inspector, pod).await;
    let listeners: Vec<String> = resources::pod_listener_names(pod).into_iter().collect();
    let svid = view.identities.as_ref().and_then(|i| i.svids.get(&pod.id()));
    let endpoints = view.watched.catalog.endpoints.get(&pod.info.service());
    let registered = endpoints.map(|e| pod.ips.iter().any(|ip| e.contains_key(&ip.to_string())));
    json!({
        "pod": pod.id(),
        "ips": pod.ips,
        "service": pod.info.service(),
        "capture": capture,
        // As applied in the pod's netns (null: not captured), and what STRICT refused.
        "inbound_mtls": inbound_mtls,
        "refused_plaintext": refused,
        "served": super::facts::resource(view, xds::LISTENER, &listeners).acked,
        // Known only when the node watches the pod's own service.
        "registered": registered,
        "svid_expires_in_seconds": svid.map(|s| expires_in(s.not_after)),
        "config_errors": pod.info.config_errors().len(),
    })
}

/// The pod's applied inbound mTLS mode and its refused-connection count (STRICT only).
async fn inbound_mtls(inspector: &Inspector, pod: &LocalPod) -> (Value, Value) {
    let mode = match crate::capture::applied(&inspector.capture, &pod.container_id) {
        Ok(applied) => applied.map(|capture| capture.inbound_mtls),
        Err(e) => return (json!(format!("error: {e}")), Value::Null),
    };
    if mode != Some(crate::capture::InboundMtls::Strict) {
        return (json!(mode), Value::Null);
    }
    match crate::capture::inbound::refused(&inspector.capture, &pod.netns).await {
        Ok(refused) => (json!(mode), json!(refused)),
        Err(e) => (json!(mode), json!(format!("error: {e}"))),
    }
}

/// Seconds until `t` (negative once past).
pub fn expires_in(t: SystemTime) -> i64 {
    match t.duration_since(SystemTime::now()) {
        Ok(left) => left.as_secs() as i64,
        Err(past) => -(past.duration().as_secs() as i64),
    }
}
