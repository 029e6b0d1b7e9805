//! MeshConfigs from the Kubernetes API through the registrar binary, against the shared
//! fake API server: the mesh-wide one reaches every watcher, a namespace's one the
//! watchers hosting pods of it or calling one of its services and no other; an
//! `Accepted` condition says True or False with the field, an invalid edit keeps the last
//! accepted version, deletion removes it; `--store kubernetes` serves them too.

mod support;

use aether_api::mesh_config::MeshConfig;
use aether_fakes::kube::ApiServer;
use aether_proto::registrar::v1::WatchRequest;
use aether_proto::registry::v1::InboundMtlsMode;
use serde_json::{Value, json};
use support::sources::*;
use support::*;

const SHOP: &str = "shop/default";
const MESH: &str = "aether-system/default";

fn config(namespace: &str, spec: Value) -> Value {
    json!({"metadata": {"name": "default", "namespace": namespace}, "spec": spec})
}

fn retries(attempts: i64) -> Value {
    config("shop", json!({"resilience": {"retries": {"attempts": attempts}}}))
}

fn attempts(watcher: &Watcher) -> Option<u32> {
    let config = watcher.view.catalog.mesh_configs.get(SHOP)?;
    config.resilience.as_ref()?.retry_attempts
}

fn keys(watcher: &Watcher) -> Vec<&str> {
    watcher.view.catalog.mesh_configs.keys().map(String::as_str).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn configs_reach_the_watchers_of_their_namespace_and_say_why_in_their_status() {
    let cluster = ApiServer::start();
    cluster.apply::<MeshConfig>(config("aether-system", json!({"mtls": {"mode": "PERMISSIVE"}})));
    cluster.apply::<MeshConfig>(retries(1));
    let dir = tempfile::tempdir().unwrap();
    let registrar = registrar(&cluster, dir.path(), &["--from-kubernetes"]).await;
    let mut client = registrar.client().await;
    // Calls shop/orders: the callers' side of shop's resilience defaults.
    let mut caller = Watcher::open(&mut client, filter(&["shop/orders"])).await.strict();
    // Hosts pods of shop: its mTLS mode and authorization stance.
    let host = WatchRequest {
        policy_namespaces: vec!["shop".into()],
        ..Default::default()
    };
    let mut host = Watcher::open(&mut client, host).await.strict();
    // Neither: only the mesh-wide one.
    let mut other = Watcher::open(&mut client, filter(&["billing/ledger"])).await.strict();
    // A node's DNS records: the mesh-wide one too (its mesh domain is a domain DNS answers).
    let dns = WatchRequest {
        services_only: true,
        policy_namespaces: vec!["shop".into()],
        ..Default::default()
    };
    let mut dns = Watcher::open(&mut client, dns).await.strict();
    for watcher in [&mut caller, &mut host] {
        until(watcher, "both configs are served", |w| keys(w) == [MESH, SHOP]).await;
    }
    for watcher in [&mut other, &mut dns] {
        until(watcher, "the mesh-wide config is served", |w| keys(w) == [MESH]).await;
    }
    let mesh = &other.view.catalog.mesh_configs[MESH];
    assert!(mesh.mesh_wide);
    assert_eq!(mesh.inbound_mtls(), InboundMtlsMode::Permissive);
    assert_eq!(attempts(&caller), Some(1));
    until_accepted::<MeshConfig>(&cluster, &registrar, SHOP, ("True", 1)).await;

    // An invalid edit: False with the field; the last accepted version stays served.
    cluster.apply::<MeshConfig>(retries(50));
    let message = until_accepted::<MeshConfig>(&cluster, &registrar, SHOP, ("False", 2)).await;
    assert!(message.contains("spec.resilience.retries.attempts"), "{message}");
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    while caller.try_next().is_some() {}
    assert_eq!(attempts(&caller), Some(1), "the last accepted version must stay");

    // A fix is served; deletion removes it from the watchers that held it.
    cluster.apply::<MeshConfig>(retries(0));
    until(&mut caller, "the fix is served", |w| attempts(w) == Some(0)).await;
    cluster.delete::<MeshConfig>("shop", "default");
    for watcher in [&mut caller, &mut host] {
        until(watcher, "the deleted config is gone", |w| keys(w) == [MESH]).await;
    }
}

/// `--store kubernetes` derives the configs from the same watch and writes their status.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kubernetes_store_serves_the_cluster_configs() {
    let cluster = ApiServer::start();
    cluster.apply::<k8s_openapi::api::core::v1::Node>(json!({"metadata": {"name": "n1"}}));
    cluster.apply::<MeshConfig>(retries(3));
    let dir = tempfile::tempdir().unwrap();
    let registrar = registrar(&cluster, dir.path(), &["--store", "kubernetes"]).await;
    let mut client = registrar.client().await;
    let mut caller = Watcher::open(&mut client, filter(&["shop/orders"])).await.strict();
    until(&mut caller, "the config is served from the store", |w| {
        attempts(w) == Some(3)
    })
    .await;
    until_accepted::<MeshConfig>(&cluster, &registrar, SHOP, ("True", 1)).await;
    cluster.delete::<MeshConfig>("shop", "default");
    until(&mut caller, "the deleted config is gone", |w| keys(w).is_empty()).await;
}
