//! AuthorizationPolicies from the Kubernetes API through the registrar binary, against
//! the shared fake API server: objects reach the Watch streams of the watchers of their
//! namespace (a writable store with `--from-kubernetes`, and `--store kubernetes`), an
//! `Accepted` condition says True or False with the field, an invalid edit keeps the
//! last accepted version, deletion removes the policy, and a cluster without the CRD
//! leaves the registrar ready.

mod support;

use std::time::{Duration, Instant};

use aether_api::authorization::AuthorizationPolicy;
use aether_fakes::kube::ApiServer;
use aether_proto::registrar::v1::WatchRequest;
use serde_json::{Value, json};
use support::sources::*;
use support::*;

const KEY: &str = "shop/cart-api";

fn cart_api(path: &str) -> Value {
    json!({
        "metadata": {"name": "cart-api", "namespace": "shop"},
        "spec": {"selector": {"matchLabels": {"app": "cart"}},
                 "rules": [{"to": [{"operation": {"paths": [path]}}]}]},
    })
}

async fn shop_watcher(registrar: &Registrar) -> Watcher {
    let mut client = registrar.client().await;
    let request = WatchRequest {
        policy_namespaces: vec!["shop".into()],
        ..filter(&["shop/cart"])
    };
    Watcher::open(&mut client, request).await.strict()
}

fn path_of(watcher: &Watcher) -> Option<String> {
    let policy = watcher.view.catalog.policies.get(KEY)?;
    Some(policy.rules[0].to[0].paths[0].value.clone())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_policies_reach_the_watchers_of_their_namespace_and_say_why_in_their_status() {
    let cluster = ApiServer::start();
    cluster.apply::<AuthorizationPolicy>(cart_api("/api/*"));
    let dir = tempfile::tempdir().unwrap();
    let registrar = registrar(&cluster, dir.path(), &["--from-kubernetes"]).await;
    let mut shop = shop_watcher(&registrar).await;
    until(&mut shop, "the policy is served", |w| {
        path_of(w).as_deref() == Some("/api/")
    })
    .await;
    let generation = cluster.get::<AuthorizationPolicy>("shop", "cart-api").unwrap()["metadata"]["generation"]
        .as_i64()
        .unwrap();
    until_accepted::<AuthorizationPolicy>(&cluster, &registrar, KEY, ("True", generation)).await;

    // An invalid edit: False with the field; the last accepted version stays served.
    cluster.apply::<AuthorizationPolicy>(cart_api("admin"));
    let message = until_accepted::<AuthorizationPolicy>(&cluster, &registrar, KEY, ("False", generation + 1)).await;
    assert!(message.contains("spec.rules[0].to[0].operation.paths[0]"), "{message}");
    assert_eq!(accepted::<AuthorizationPolicy>(&cluster, KEY).unwrap().1, "Invalid");
    tokio::time::sleep(Duration::from_millis(300)).await;
    while shop.try_next().is_some() {}
    assert_eq!(
        path_of(&shop).as_deref(),
        Some("/api/"),
        "the last accepted version must stay"
    );

    // A fix is served; deletion removes it.
    cluster.apply::<AuthorizationPolicy>(cart_api("/v2/*"));
    until(&mut shop, "the fix is served", |w| {
        path_of(w).as_deref() == Some("/v2/")
    })
    .await;
    until_accepted::<AuthorizationPolicy>(&cluster, &registrar, KEY, ("True", generation + 2)).await;
    cluster.delete::<AuthorizationPolicy>("shop", "cart-api");
    until(&mut shop, "the deleted policy is gone", |w| {
        w.view.catalog.policies.is_empty()
    })
    .await;
}

/// `--store kubernetes` derives the policies from the same watch and writes their status.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kubernetes_store_serves_the_cluster_policies() {
    let cluster = ApiServer::start();
    cluster.apply::<k8s_openapi::api::core::v1::Node>(json!({"metadata": {"name": "n1"}}));
    cluster.apply::<AuthorizationPolicy>(cart_api("/api/*"));
    let mesh_wide = json!({"metadata": {"name": "audit-all", "namespace": "mesh-root"},
                           "spec": {"action": "AUDIT", "rules": [{}]}});
    cluster.apply::<AuthorizationPolicy>(mesh_wide);
    let dir = tempfile::tempdir().unwrap();
    let flags = ["--store", "kubernetes", "--mesh-root-namespace", "mesh-root"];
    let registrar = registrar(&cluster, dir.path(), &flags).await;
    let mut shop = shop_watcher(&registrar).await;
    until(&mut shop, "the policies are served from the store", |w| {
        w.view.catalog.policies.keys().collect::<Vec<_>>() == ["mesh-root/audit-all", KEY]
    })
    .await;
    assert!(
        shop.view.catalog.policies["mesh-root/audit-all"]
            .target
            .as_ref()
            .unwrap()
            .mesh_wide
    );
    until_accepted::<AuthorizationPolicy>(&cluster, &registrar, KEY, ("True", 1)).await;
    cluster.delete::<AuthorizationPolicy>("shop", "cart-api");
    until(&mut shop, "the deleted policy is gone", |w| {
        !w.view.catalog.policies.contains_key(KEY)
    })
    .await;
}

/// Without the CRD, the registrar is ready, says why once, and serves the rest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_crd_leaves_the_registrar_ready_and_serving() {
    let cluster = ApiServer::start();
    cluster.uninstall::<AuthorizationPolicy>();
    let dir = tempfile::tempdir().unwrap();
    let registrar = registrar(&cluster, dir.path(), &["--from-kubernetes"]).await;
    let mut client = registrar.client().await;
    register(&mut client, endpoint("shop/cart", "10.0.0.1", 9090)).await;
    let (code, _) = http_get(registrar.admin, "/ready").await.unwrap();
    assert_eq!(code, 200);
    let deadline = Instant::now() + TIMEOUT;
    while !registrar
        .logs()
        .contains("AuthorizationPolicy CRD (security.aether.io) is not installed")
    {
        assert!(Instant::now() < deadline, "{}", registrar.logs());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let logs = registrar.logs();
    assert_eq!(logs.matches("AuthorizationPolicy CRD").count(), 1, "said once:\n{logs}");
}
