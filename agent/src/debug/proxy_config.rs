//! `/debug/proxy-config/<ns>/<pod>/<section>`: what the node's Envoy holds for one pod, as
//! a table (`columns`, `rows`): its listeners, the route tables, its clusters and their
//! endpoints' health, its SVID. Envoy's config comes from its admin (`/config_dump`,
//! `/clusters`), whether Envoy ACKed it from the agent's xDS state.

use serde_json::{Value, json};

use super::Inspector;
use super::facts::resource;
use crate::node::NodeView;
use crate::pod::LocalPod;
use crate::xds;
use crate::xds::resources;

#[derive(Debug, thiserror::Error)]
pub enum ProxyConfigError {
    #[error("{0} is not a pod this node's agent manages")]
    UnknownPod(String),
    #[error("unknown section {0:?}: listeners, routes, clusters, endpoints or secrets")]
    Section(String),
    #[error(transparent)]
    Envoy(#[from] crate::proxy::admin::AdminError),
}

pub async fn table(inspector: &Inspector, pod_id: &str, section: &str) -> Result<Value, ProxyConfigError> {
    let view = inspector.node.view();
    let pod = view
        .pods
        .iter()
        .find(|p| p.id() == pod_id)
        .ok_or_else(|| ProxyConfigError::UnknownPod(pod_id.to_owned()))?;
    let (columns, rows): (&[&str], Vec<Vec<String>>) = match section {
        "listeners" => {
            let dump = config_dump(inspector).await?;
            let names = resources::pod_listener_names(pod);
            let rows = dynamic(&dump, "dynamic_listeners", |l| names.contains(name_of(l, "name")))
                .map(|l| listener_row(&view, l))
                .collect();
            (&["NAME", "ADDRESS", "VERSION", "ACKED"], rows)
        }
        "routes" => {
            let dump = config_dump(inspector).await?;
            let rows = dynamic(&dump, "dynamic_route_configs", |_| true)
                .map(route_row)
                .collect();
            (&["NAME", "VIRTUAL HOSTS", "DOMAINS"], rows)
        }
        "clusters" => {
            let dump = config_dump(inspector).await?;
            let names = pod_clusters(&view, pod);
            let rows = dynamic(&dump, "dynamic_active_clusters", |c| {
                names.contains(&name_of(&c["cluster"], "name").to_owned())
            })
            .map(|c| cluster_row(&view, c))
            .collect();
            (&["NAME", "TYPE", "VERSION", "ACKED"], rows)
        }
        "endpoints" => (
            &["CLUSTER", "ADDRESS", "HEALTHY", "EJECTED"],
            endpoint_rows(inspector, &view, pod).await?,
        ),
        "secrets" => (
            &["NAME", "SPIFFE ID", "SERIAL", "EXPIRES IN", "ACKED"],
            secret_rows(&view, pod),
        ),
        other => return Err(ProxyConfigError::Section(other.to_owned())),
    };
    Ok(json!({ "pod": pod_id, "section": section, "columns": columns, "rows": rows }))
}

async fn config_dump(inspector: &Inspector) -> Result<Value, ProxyConfigError> {
    let body = inspector.envoy.get("/config_dump").await?;
    Ok(serde_json::from_str(&body).unwrap_or(Value::Null))
}

/// The entries of `key` across the dump's configs that `keep` accepts.
fn dynamic<'a>(
    dump: &'a Value,
    key: &'a str,
    keep: impl Fn(&Value) -> bool + 'a,
) -> impl Iterator<Item = &'a Value> + 'a {
    let configs = dump["configs"].as_array().into_iter().flatten();
    configs
        .flat_map(move |c| c[key].as_array().into_iter().flatten())
        .filter(move |v| keep(v))
}

fn name_of<'a>(v: &'a Value, key: &str) -> &'a str {
    v[key].as_str().unwrap_or_default()
}

fn acked(view: &NodeView, type_url: &str, name: &str) -> String {
    let r = resource(view, type_url, &[name.to_owned()]);
    match (r.acked, r.rejected) {
        (_, Some(error)) => format!("NACK: {error}"),
        (true, None) => "yes".into(),
        (false, None) => "no".into(),
    }
}

fn listener_row(view: &NodeView, l: &Value) -> Vec<String> {
    let name = name_of(l, "name");
    let state = &l["active_state"];
    let socket = &state["listener"]["address"]["socket_address"];
    vec![
        name.to_owned(),
        format!(
            "{}:{}",
            name_of(socket, "address"),
            socket["port_value"].as_u64().unwrap_or_default()
        ),
        name_of(state, "version_info").to_owned(),
        acked(view, xds::LISTENER, name),
    ]
}

fn route_row(r: &Value) -> Vec<String> {
    let config = &r["route_config"];
    let hosts = config["virtual_hosts"].as_array().cloned().unwrap_or_default();
    let domains: Vec<&str> = hosts
        .iter()
        .flat_map(|h| h["domains"].as_array().into_iter().flatten())
        .filter_map(Value::as_str)
        .collect();
    let shown = domains.iter().take(3).copied().collect::<Vec<_>>().join(" ");
    let more = domains.len().saturating_sub(3);
    vec![
        name_of(config, "name").to_owned(),
        hosts.len().to_string(),
        if more > 0 { format!("{shown} (+{more})") } else { shown },
    ]
}

fn cluster_row(view: &NodeView, c: &Value) -> Vec<String> {
    let name = name_of(&c["cluster"], "name");
    vec![
        name.to_owned(),
        name_of(&c["cluster"], "type").to_owned(),
        name_of(c, "version_info").to_owned(),
        acked(view, xds::CLUSTER, name),
    ]
}

/// The pod's clusters: its upstreams' (declared or looked up on demand), its own local
/// delivery clusters and, with mTLS, its originate cluster.
fn pod_clusters(view: &NodeView, pod: &LocalPod) -> Vec<String> {
    let catalog = &view.watched.catalog;
    let mut services = pod.info.upstreams().services;
    services.extend(view.on_demand.iter().cloned());
    let mut names: Vec<String> = services
        .iter()
        .flat_map(|s| resources::cluster_names(catalog, s, &view.mesh_domain))
        .collect();
    let local = format!("local|{}|", pod.id());
    let own = view.snapshot.get(xds::CLUSTER).into_iter().flat_map(|m| m.keys());
    names.extend(own.filter(|n| n.starts_with(&local)).cloned());
    if view.identities.is_some() {
        let identity = resources::pod_identity_names(pod).into_iter();
        names.extend(identity.filter(|(t, _)| *t == xds::CLUSTER).map(|(_, n)| n));
    }
    names
}

async fn endpoint_rows(
    inspector: &Inspector,
    view: &NodeView,
    pod: &LocalPod,
) -> Result<Vec<Vec<String>>, ProxyConfigError> {
    let body = inspector.envoy.get("/clusters?format=json").await?;
    let mut hosts = super::envoy::hosts(&body);
    let rows = pod_clusters(view, pod)
        .into_iter()
        .flat_map(|name| {
            let list = hosts.remove(&name).unwrap_or_default();
            list.into_iter()
                .map(move |h| vec![name.clone(), h.address, h.healthy.to_string(), h.ejected.to_string()])
        })
        .collect();
    Ok(rows)
}

fn secret_rows(view: &NodeView, pod: &LocalPod) -> Vec<Vec<String>> {
    let Some(identities) = &view.identities else {
        return Vec::new();
    };
    let mut rows = Vec::new();
    if let Some(svid) = identities.svids.get(&pod.id()) {
        let name = crate::identity::svid_secret(&pod.id());
        rows.push(vec![
            name.clone(),
            svid.spiffe_id.clone(),
            svid.serial.clone(),
            format!("{}s", super::status::expires_in(svid.not_after)),
            acked(view, xds::SECRET, &name),
        ]);
    }
    for td in identities.bundles.keys() {
        let name = crate::identity::bundle_secret(td);
        rows.push(vec![
            name.clone(),
            format!("trust bundle of {td}"),
            String::new(),
            String::new(),
            acked(view, xds::SECRET, &name),
        ]);
    }
    rows
}
