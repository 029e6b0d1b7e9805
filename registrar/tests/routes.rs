//! Routes end to end through the registrar binary: a `--routes-dir` of Gateway API
//! YAML → projected routes in the store → each Watch stream gets exactly the routes
//! with a parent in its filter, as versioned deltas; refused objects keep their last
//! accepted version; the store keeps routes across restarts.

mod support;

use std::path::Path;
use std::time::{Duration, Instant};

use aether_proto::registrar::v1::WatchRequest;
use support::sources::*;
use support::*;

const CANARY: &str = "http/shop/canary";

fn canary(parent: &str, path_regex: &str) -> String {
    format!(
        r#"
apiVersion: gateway.networking.k8s.io/v1
kind: HTTPRoute
metadata: {{name: canary, namespace: shop}}
spec:
  parentRefs: [{{group: "", kind: Service, name: {parent}}}]
  rules:
  - matches: [{{path: {{type: RegularExpression, value: "{path_regex}"}}}}]
    backendRefs:
    - {{name: cart-v1, port: 8080, weight: 90}}
    - {{name: cart-v2, port: 8080, weight: 10}}
---
apiVersion: v1
kind: Service
metadata: {{name: ignored, namespace: shop}}
"#
    )
}

fn has_canary(watcher: &Watcher, parent: &str) -> bool {
    watcher
        .view
        .catalog
        .routes
        .get(CANARY)
        .is_some_and(|r| r.parents[0].service == parent)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routes_reach_exactly_the_watchers_of_their_parents_and_follow_changes() {
    let data = tempfile::tempdir().unwrap();
    let routes = tempfile::tempdir().unwrap();
    write(routes.path(), "canary.yaml", &canary("cart", "^/items/[0-9]+$"));
    let dir = routes.path().to_str().unwrap();
    let registrar = Registrar::start(data.path(), &["--routes-dir", dir]).await;
    let mut client = registrar.client().await;

    let mut cart = Watcher::open(&mut client, filter(&["shop/cart"])).await.strict();
    let mut pay = Watcher::open(&mut client, filter(&["shop/pay"])).await.strict();
    let dns = WatchRequest {
        services_only: true,
        ..Default::default()
    };
    let mut records = Watcher::open(&mut client, dns).await.strict();
    until(&mut cart, "cart's watcher has the canary", |w| {
        has_canary(w, "shop/cart")
    })
    .await;
    let route = &cart.view.catalog.routes[CANARY];
    let weights: Vec<_> = route.rules[0]
        .backends
        .iter()
        .map(|b| (b.service.as_str(), b.weight))
        .collect();
    assert_eq!(weights, [("shop/cart-v1", 90), ("shop/cart-v2", 10)]);
    // The Service document in the same file is skipped, not refused.
    assert!(metric(&registrar, "aether_registrar_routes_refused{source=\"directory\"} 0").await);

    // Moving the route to another parent moves it between watchers.
    write(routes.path(), "canary.yaml", &canary("pay", "^/items/[0-9]+$"));
    until(&mut pay, "pay's watcher has the canary", |w| has_canary(w, "shop/pay")).await;
    until(&mut cart, "cart's watcher lost the canary", |w| {
        w.view.catalog.routes.is_empty()
    })
    .await;

    // A filter change brings routes in with the services.
    cart.send(WatchRequest {
        filter_id: 7,
        ..filter(&["shop/cart", "shop/pay"])
    })
    .await;
    until(&mut cart, "the new filter brought the canary", |w| {
        has_canary(w, "shop/pay")
    })
    .await;

    refused_edit_keeps_the_last_accepted_version(&registrar, routes.path(), &mut pay).await;

    // DNS watchers never get routes.
    while records.try_next().is_some() {}
    assert!(records.view.catalog.routes.is_empty());

    drop(registrar);
    routes_are_stored_and_follow_the_file(data.path(), routes.path()).await;
}

/// A refused edit keeps the last accepted version serving, and says why.
async fn refused_edit_keeps_the_last_accepted_version(registrar: &Registrar, routes: &Path, pay: &mut Watcher) {
    // A refused edit keeps the last accepted version serving, and says why.
    write(routes, "canary.yaml", &canary("cart", "^/items/[0-9+$"));
    let deadline = Instant::now() + TIMEOUT;
    while !metric(registrar, "aether_registrar_routes_refused{source=\"directory\"} 1").await {
        assert!(
            Instant::now() < deadline,
            "the bad regex was not refused:\n{}",
            registrar.logs()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        registrar.logs().contains("spec.rules[0].matches[0].path.value"),
        "{}",
        registrar.logs()
    );
    tokio::time::sleep(Duration::from_millis(600)).await;
    while pay.try_next().is_some() {}
    assert!(
        has_canary(pay, "shop/pay"),
        "the last accepted canary must keep serving"
    );
}

/// Routes are stored: a restart without the source still serves them; with the source back (still holding the
/// refused edit) the stored version is the last accepted one and keeps serving; deleting the file deletes it.
async fn routes_are_stored_and_follow_the_file(data: &Path, routes: &Path) {
    let dir = routes.to_str().unwrap();
    let registrar = Registrar::start(data, &[]).await;
    let mut client = registrar.client().await;
    let mut again = Watcher::open(&mut client, filter(&["shop/pay"])).await.strict();
    until(&mut again, "the stored canary is served after a restart", |w| {
        has_canary(w, "shop/pay")
    })
    .await;
    drop(registrar);

    // With the source back (still holding the refused edit), the stored version is
    // the last accepted one and keeps serving; deleting the file deletes the route.
    let registrar = Registrar::start(data, &["--routes-dir", dir]).await;
    let mut client = registrar.client().await;
    let mut last = Watcher::open(&mut client, filter(&["shop/pay"])).await.strict();
    until(&mut last, "the canary is served", |w| has_canary(w, "shop/pay")).await;
    std::fs::remove_file(routes.join("canary.yaml")).unwrap();
    until(&mut last, "the deleted canary is gone", |w| {
        w.view.catalog.routes.is_empty()
    })
    .await;
}
