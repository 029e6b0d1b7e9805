//! Routes from the Kubernetes API through the registrar binary, against the shared fake
//! API server: HTTPRoute/GRPCRoute/TCPRoute objects reach the Watch streams of their parents'
//! watchers (a writable store with `--routes-from-kubernetes`, and `--store kubernetes`),
//! their `status.parents[]` say Accepted / ResolvedRefs through the status subresource,
//! an invalid edit keeps the last accepted version serving, deletion removes the route,
//! and a cluster without the CRDs leaves the registrar ready and serving.

mod support;

use std::time::{Duration, Instant};

use aether_api::gateway::{GrpcRoute, HttpRoute, TcpRoute};
use aether_fakes::kube::ApiServer;
use k8s_openapi::api::core::v1::{Node, Pod};
use serde_json::{Value, json};
use support::sources::*;
use support::*;

const CANARY: &str = "http/shop/canary";

fn canary(path_regex: &str, backends: &[&str]) -> Value {
    let backends: Vec<Value> = backends.iter().map(|b| json!({"name": b, "port": 8080})).collect();
    json!({
        "metadata": {"name": "canary", "namespace": "shop"},
        "spec": {"parentRefs": [{"group": "", "kind": "Service", "name": "cart"}],
                 "rules": [{"matches": [{"path": {"type": "RegularExpression", "value": path_regex}}],
                            "backendRefs": backends}]},
    })
}

fn grpc_route(name: &str, parent: &str) -> Value {
    json!({
        "metadata": {"name": name, "namespace": "shop"},
        "spec": {"parentRefs": [{"group": "", "kind": "Service", "name": parent}],
                 "rules": [{"matches": [{"method": {"service": "shop.Cart"}}],
                            "backendRefs": [{"name": parent, "port": 9090}]}]},
    })
}

fn regex_of(watcher: &Watcher) -> Option<String> {
    let route = watcher.view.catalog.routes.get(CANARY)?;
    let path = route.rules[0].matches[0].path.as_ref()?;
    Some(path.value.clone())
}

/// Our `(type, status, reason, message, observedGeneration)` conditions on the canary.
fn conditions(cluster: &ApiServer) -> Vec<(String, String, String, String, i64)> {
    let Some(route) = cluster.get::<HttpRoute>("shop", "canary") else {
        return Vec::new();
    };
    let parents = route["status"]["parents"].as_array().cloned().unwrap_or_default();
    let ours = parents.iter().find(|p| p["controllerName"] == "aether.io/mesh");
    let text = |c: &Value, f: &str| c[f].as_str().unwrap_or_default().to_owned();
    ours.and_then(|p| p["conditions"].as_array().cloned())
        .unwrap_or_default()
        .iter()
        .map(|c| {
            let generation = c["observedGeneration"].as_i64().unwrap_or(0);
            (
                text(c, "type"),
                text(c, "status"),
                text(c, "reason"),
                text(c, "message"),
                generation,
            )
        })
        .collect()
}

/// Waits until the canary's conditions say `(Accepted, ResolvedRefs)` statuses and reasons.
async fn until_status(cluster: &ApiServer, registrar: &Registrar, accepted: (&str, &str), resolved: (&str, &str)) {
    let deadline = Instant::now() + TIMEOUT;
    loop {
        let now = conditions(cluster);
        let summary: Vec<(&str, &str)> = now.iter().map(|c| (c.1.as_str(), c.2.as_str())).collect();
        if summary == [accepted, resolved] {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "status {now:?}, want {accepted:?} {resolved:?}:\n{}",
            registrar.logs()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn status_writes(cluster: &ApiServer) -> Vec<String> {
    let writes = cluster.requests().into_iter();
    writes
        .filter(|r| !r.starts_with("GET ") && r.contains("routes"))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_routes_reach_watchers_and_say_why_in_their_status() {
    let cluster = ApiServer::start();
    cluster.apply::<HttpRoute>(canary("^/items/[0-9]+$", &["cart-v1", "cart-v2"]));
    let dir = tempfile::tempdir().unwrap();
    let registrar = registrar(&cluster, dir.path(), &["--routes-from-kubernetes"]).await;
    let mut client = registrar.client().await;
    register(&mut client, endpoint("shop/cart-v1", "10.0.0.1", 8080)).await;
    let mut cart = Watcher::open(&mut client, filter(&["shop/cart"])).await.strict();
    until(&mut cart, "the canary reaches cart's watcher", |w| {
        regex_of(w).is_some()
    })
    .await;

    // cart-v2 is not in the catalog yet; once it is, its reference resolves.
    until_status(&cluster, &registrar, ("True", "Accepted"), ("False", "BackendNotFound")).await;
    assert!(
        conditions(&cluster)[1].3.contains("shop/cart-v2"),
        "{:?}",
        conditions(&cluster)
    );
    register(&mut client, endpoint("shop/cart-v2", "10.0.0.2", 8080)).await;
    until_status(&cluster, &registrar, ("True", "Accepted"), ("True", "ResolvedRefs")).await;
    assert_eq!(conditions(&cluster)[0].4, 1, "observedGeneration");

    // Settled: replicas and rechecks write nothing more.
    let writes = status_writes(&cluster);
    assert!(
        writes
            .iter()
            .all(|w| w.starts_with("PATCH ") && w.contains("/httproutes/canary/status")),
        "only the status subresource is written: {writes:?}"
    );
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(
        status_writes(&cluster),
        writes,
        "an unchanged status is not written again"
    );

    // An invalid edit: refused, naming the field; the last accepted version keeps serving.
    cluster.apply::<HttpRoute>(canary("^/items/[0-9+$", &["cart-v1", "cart-v2"]));
    until_status(
        &cluster,
        &registrar,
        ("False", "UnsupportedValue"),
        ("True", "ResolvedRefs"),
    )
    .await;
    let refused = &conditions(&cluster)[0];
    assert!(
        refused.3.starts_with("spec.rules[0].matches[0].path.value"),
        "{refused:?}"
    );
    assert_eq!(refused.4, 2, "observedGeneration of the refused edit");
    tokio::time::sleep(Duration::from_millis(300)).await;
    while cart.try_next().is_some() {}
    assert_eq!(regex_of(&cart).as_deref(), Some("^/items/[0-9]+$"));

    // Fixed, then deleted.
    cluster.apply::<HttpRoute>(canary("^/carts/[0-9]+$", &["cart-v1"]));
    until(&mut cart, "the fixed canary serves", |w| {
        regex_of(w).as_deref() == Some("^/carts/[0-9]+$")
    })
    .await;
    until_status(&cluster, &registrar, ("True", "Accepted"), ("True", "ResolvedRefs")).await;
    cluster.delete::<HttpRoute>("shop", "canary");
    until(&mut cart, "the deleted canary is gone", |w| {
        w.view.catalog.routes.is_empty()
    })
    .await;
}

/// `--store kubernetes` derives routes from the same watch and writes their status too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kubernetes_store_serves_the_cluster_routes() {
    let cluster = ApiServer::start();
    cluster.apply::<Node>(json!({"metadata": {"name": "n1"}}));
    cluster.apply::<HttpRoute>(canary("^/a$", &["cart-v1"]));
    let dir = tempfile::tempdir().unwrap();
    let registrar = registrar(&cluster, dir.path(), &["--store", "kubernetes"]).await;
    let mut client = registrar.client().await;
    let mut cart = Watcher::open(&mut client, filter(&["shop/cart"])).await.strict();
    until(&mut cart, "the canary is served from the store", |w| {
        regex_of(w).is_some()
    })
    .await;
    until_status(&cluster, &registrar, ("True", "Accepted"), ("False", "BackendNotFound")).await;

    // A managed pod brings the backend into the catalog.
    cluster.apply::<Pod>(json!({
        "metadata": {"name": "cart-v1-0", "namespace": "shop", "labels": {"aether.io/managed": "true"}},
        "spec": {"serviceAccountName": "cart-v1", "nodeName": "n1",
                 "containers": [{"name": "app", "ports": [{"name": "http", "containerPort": 8080}]}]},
        "status": {"phase": "Running", "podIP": "10.0.1.1", "conditions": [{"type": "Ready", "status": "True"}]},
    }));
    until_status(&cluster, &registrar, ("True", "Accepted"), ("True", "ResolvedRefs")).await;

    cluster.apply::<GrpcRoute>(grpc_route("methods", "cart"));
    until(&mut cart, "the GRPCRoute joins", |w| {
        w.view.catalog.routes.contains_key("grpc/shop/methods")
    })
    .await;
    cluster.delete::<HttpRoute>("shop", "canary");
    until(&mut cart, "the deleted canary is gone", |w| {
        !w.view.catalog.routes.contains_key(CANARY) && w.view.catalog.routes.len() == 1
    })
    .await;

    // A TCPRoute (experimental channel) on cart's TCP port: served, and its status says so.
    cluster.apply::<TcpRoute>(json!({
        "metadata": {"name": "sessions", "namespace": "shop"},
        "spec": {"parentRefs": [{"group": "", "kind": "Service", "name": "cart", "port": 6379}],
                 "rules": [{"backendRefs": [{"name": "cart-v1", "port": 6379}]}]},
    }));
    until(&mut cart, "the TCPRoute joins", |w| {
        w.view.catalog.routes.contains_key("tcp/shop/sessions")
    })
    .await;
    let deadline = Instant::now() + TIMEOUT;
    loop {
        let route = cluster.get::<TcpRoute>("shop", "sessions").unwrap_or_default();
        let conditions = route["status"]["parents"][0]["conditions"].clone();
        let accepted = conditions
            .as_array()
            .into_iter()
            .flatten()
            .any(|c| c["type"] == "Accepted" && c["status"] == "True");
        if accepted {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "TCPRoute status {conditions}:\n{}",
            registrar.logs()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Without the HTTPRoute CRD, the registrar is ready, says why once, and serves the rest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_crd_leaves_the_registrar_ready_and_serving() {
    let cluster = ApiServer::start();
    cluster.uninstall::<HttpRoute>();
    // The experimental channel (TCPRoute) is often not installed either.
    cluster.uninstall::<TcpRoute>();
    cluster.apply::<GrpcRoute>(grpc_route("methods", "cart"));
    let dir = tempfile::tempdir().unwrap();
    let registrar = registrar(&cluster, dir.path(), &["--routes-from-kubernetes"]).await;
    let mut client = registrar.client().await;
    let mut cart = Watcher::open(&mut client, filter(&["shop/cart"])).await.strict();
    until(&mut cart, "the GRPCRoute is served", |w| {
        w.view.catalog.routes.contains_key("grpc/shop/methods")
    })
    .await;
    register(&mut client, endpoint("shop/cart", "10.0.0.1", 9090)).await;
    let (code, _) = http_get(registrar.admin, "/ready").await.unwrap();
    assert_eq!(code, 200);
    let logs = registrar.logs();
    let missing = logs
        .lines()
        .filter(|l| l.contains("HTTPRoute is not installed"))
        .count();
    assert_eq!(missing, 1, "said once:\n{logs}");
}
