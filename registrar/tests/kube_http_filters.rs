//! HTTPFilters from the Kubernetes API through the registrar binary, against the shared
//! fake API server: objects reach the Watch streams of the watchers of their namespace
//! or of a service they name (a writable store with `--from-kubernetes`, and `--store
//! kubernetes`), an `Accepted` condition says True or False with the field, an invalid
//! edit keeps the last accepted version, deletion removes the filter, and a cluster
//! without the CRD leaves the registrar ready.

mod support;

use std::time::{Duration, Instant};

use aether_api::http_filter::HttpFilter;
use aether_fakes::kube::ApiServer;
use aether_proto::registrar::v1::WatchRequest;
use aether_proto::registry::v1::http_filter::Filter;
use serde_json::{Value, json};
use support::sources::*;
use support::*;

const KEY: &str = "shop/limit-orders";

fn limit_orders(max_tokens: i64) -> Value {
    json!({
        "metadata": {"name": "limit-orders", "namespace": "shop"},
        "spec": {"targetRefs": [{"kind": "Service", "name": "orders"}],
                 "localRateLimit": {"maxTokens": max_tokens, "fillInterval": "1s"}},
    })
}

/// A watcher of the callers' side: it calls `shop/orders`, hosts nothing of `shop`.
async fn caller(registrar: &Registrar) -> Watcher {
    let mut client = registrar.client().await;
    Watcher::open(&mut client, filter(&["shop/orders"])).await.strict()
}

fn tokens_of(watcher: &Watcher) -> Option<u32> {
    match &watcher.view.catalog.http_filters.get(KEY)?.filter {
        Some(Filter::LocalRateLimit(limit)) => Some(limit.max_tokens),
        _ => None,
    }
}

fn generation(cluster: &ApiServer) -> i64 {
    let filter = cluster.get::<HttpFilter>("shop", "limit-orders").unwrap();
    filter["metadata"]["generation"].as_i64().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_filters_reach_the_callers_of_their_services_and_say_why_in_their_status() {
    let cluster = ApiServer::start();
    cluster.apply::<HttpFilter>(limit_orders(10));
    let dir = tempfile::tempdir().unwrap();
    let registrar = registrar(&cluster, dir.path(), &["--from-kubernetes"]).await;
    let mut caller = caller(&registrar).await;
    until(&mut caller, "the filter is served", |w| tokens_of(w) == Some(10)).await;
    let generation = generation(&cluster);
    until_accepted::<HttpFilter>(&cluster, &registrar, KEY, ("True", generation)).await;

    // An invalid edit: False with the field; the last accepted version stays served.
    cluster.apply::<HttpFilter>(limit_orders(0));
    let message = until_accepted::<HttpFilter>(&cluster, &registrar, KEY, ("False", generation + 1)).await;
    assert!(message.contains("spec.localRateLimit.maxTokens"), "{message}");
    assert_eq!(accepted::<HttpFilter>(&cluster, KEY).unwrap().1, "Invalid");
    tokio::time::sleep(Duration::from_millis(300)).await;
    while caller.try_next().is_some() {}
    assert_eq!(tokens_of(&caller), Some(10), "the last accepted version must stay");

    // A fix is served; deletion removes it.
    cluster.apply::<HttpFilter>(limit_orders(20));
    until(&mut caller, "the fix is served", |w| tokens_of(w) == Some(20)).await;
    until_accepted::<HttpFilter>(&cluster, &registrar, KEY, ("True", generation + 2)).await;
    cluster.delete::<HttpFilter>("shop", "limit-orders");
    until(&mut caller, "the deleted filter is gone", |w| {
        w.view.catalog.http_filters.is_empty()
    })
    .await;
}

/// `--store kubernetes` derives the filters from the same watch and writes their status.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kubernetes_store_serves_the_cluster_filters() {
    let cluster = ApiServer::start();
    cluster.apply::<k8s_openapi::api::core::v1::Node>(json!({"metadata": {"name": "n1"}}));
    cluster.apply::<HttpFilter>(limit_orders(10));
    let dir = tempfile::tempdir().unwrap();
    let registrar = registrar(&cluster, dir.path(), &["--store", "kubernetes"]).await;
    let mut client = registrar.client().await;
    let destination = WatchRequest {
        policy_namespaces: vec!["shop".into()],
        ..Default::default()
    };
    let mut shop = Watcher::open(&mut client, destination).await.strict();
    until(&mut shop, "the filter is served from the store", |w| {
        tokens_of(w) == Some(10)
    })
    .await;
    until_accepted::<HttpFilter>(&cluster, &registrar, KEY, ("True", 1)).await;
    cluster.delete::<HttpFilter>("shop", "limit-orders");
    until(&mut shop, "the deleted filter is gone", |w| {
        !w.view.catalog.http_filters.contains_key(KEY)
    })
    .await;
}

/// Without the CRD, the registrar is ready, says why once, and serves the rest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_crd_leaves_the_registrar_ready_and_serving() {
    let cluster = ApiServer::start();
    cluster.uninstall::<HttpFilter>();
    let dir = tempfile::tempdir().unwrap();
    let registrar = registrar(&cluster, dir.path(), &["--from-kubernetes"]).await;
    let mut client = registrar.client().await;
    register(&mut client, endpoint("shop/orders", "10.0.0.1", 9090)).await;
    let (code, _) = http_get(registrar.admin, "/ready").await.unwrap();
    assert_eq!(code, 200);
    let deadline = Instant::now() + TIMEOUT;
    while !registrar
        .logs()
        .contains("HTTPFilter CRD (networking.aether.io) is not installed")
    {
        assert!(Instant::now() < deadline, "{}", registrar.logs());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let logs = registrar.logs();
    assert_eq!(logs.matches("HTTPFilter CRD").count(), 1, "said once:\n{logs}");
}
