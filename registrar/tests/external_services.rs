//! External services through the registrar binary: an ExternalService (from `--config-dir`
//! or the Kubernetes API) becomes a catalog service of its own, with a VIP, the declaration
//! and no endpoints, streamed to the watchers that name it (and to every services-only one,
//! for DNS), kept across restarts and never reaped while declared; a bad declaration is
//! refused naming the field, a name a mesh service holds is not taken, pods cannot register
//! into one, and a withdrawn declaration takes its service away.

mod support;

use std::time::Duration;

use aether_api::external_service::ExternalService;
use aether_fakes::kube::ApiServer;
use aether_proto::registrar::v1::{RegisterEndpointRequest, WatchRequest};
use serde_json::json;
use support::sources::*;
use support::*;

const PAYMENTS: &str = "shop/payments";

fn declaration(name: &str, host: &str, port: u32) -> String {
    format!(
        "apiVersion: networking.aether.io/v1alpha1\nkind: ExternalService\n\
         metadata: {{name: {name}, namespace: shop}}\n\
         spec: {{hosts: [{host}], ports: [{{number: {port}, protocol: HTTP}}]}}\n---\n"
    )
}

fn host_of(watcher: &Watcher, key: &str) -> Option<String> {
    let service = watcher.view.catalog.services.get(key)?;
    Some(service.external.as_ref()?.hosts.first()?.clone())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_declared_external_service_is_a_catalog_service_with_a_vip_until_withdrawn() {
    let data = tempfile::tempdir().unwrap();
    let config = tempfile::tempdir().unwrap();
    // `cart` is also a mesh service (its pods register it): its declaration is not taken.
    let bad = declaration("broken", "localhost", 80);
    let files = format!(
        "{}{}{bad}",
        declaration("payments", "api.payments.example", 443),
        declaration("cart", "cart.example", 80)
    );
    let dir = config.path().to_str().unwrap();
    let flags = ["--routes-dir", dir, "--empty-service-ttl", "200ms"];
    let registrar = Registrar::start(data.path(), &flags).await;
    let mut client = registrar.client().await;
    register(&mut client, endpoint("shop/cart", "10.0.0.7", 8080)).await;
    write(config.path(), "external.yaml", &files);

    let mut caller = Watcher::open(&mut client, filter(&[PAYMENTS])).await.strict();
    let dns = WatchRequest {
        services_only: true,
        ..Default::default()
    };
    let mut dns = Watcher::open(&mut client, dns).await.strict();
    for watcher in [&mut caller, &mut dns] {
        until(watcher, "payments is served", |w| {
            host_of(w, PAYMENTS).as_deref() == Some("api.payments.example")
        })
        .await;
    }
    let vip = caller.view.catalog.services[PAYMENTS].vip.clone();
    assert!(vip.starts_with("240.240."), "{vip}");
    let endpoints = caller.view.catalog.endpoints.get(PAYMENTS);
    assert!(endpoints.is_none_or(|e| e.is_empty()), "no endpoints: {endpoints:?}");
    // The bad one and the taken name are refused, counted, the rest served.
    assert!(
        metric(
            &registrar,
            "aether_registrar_external_services_refused{source=\"directory\"} 2"
        )
        .await,
        "{}",
        registrar.logs()
    );
    let logs = registrar.logs();
    assert!(
        logs.contains("spec.hosts[0]") && logs.contains("shop/cart is a mesh service"),
        "{logs}"
    );
    until(&mut dns, "cart stays the mesh's", |w| {
        w.view
            .catalog
            .services
            .get("shop/cart")
            .is_some_and(|s| s.external.is_none())
    })
    .await;

    // A policy guarding calls to it reaches its callers (not only the nodes of its namespace).
    let guard = "apiVersion: security.aether.io/v1alpha1\nkind: AuthorizationPolicy\n\
        metadata: {name: guard, namespace: shop}\n\
        spec: {targetRefs: [{group: networking.aether.io, kind: ExternalService, name: payments}], action: DENY}\n";
    write(config.path(), "guard.yaml", guard);
    until(&mut caller, "the guarding policy reaches the caller", |w| {
        w.view.catalog.policies.contains_key("shop/guard")
    })
    .await;
    let mut bystander = Watcher::open(&mut client, filter(&["shop/cart"])).await.strict();
    until(&mut bystander, "cart's watcher is current", |w| {
        w.view.catalog.services.contains_key("shop/cart")
    })
    .await;
    assert!(
        !bystander.view.catalog.policies.contains_key("shop/guard"),
        "sent to a node that never calls it"
    );

    // Pods cannot join it; an empty-service TTL never reaps it.
    let refused = client
        .register_endpoint(RegisterEndpointRequest {
            endpoint: Some(endpoint(PAYMENTS, "10.0.0.9", 443)),
        })
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::FailedPrecondition, "{refused:?}");
    assert!(refused.message().contains("ExternalService"), "{refused:?}");
    tokio::time::sleep(Duration::from_millis(800)).await;
    while caller.try_next().is_some() {}
    assert!(
        caller.view.catalog.services.contains_key(PAYMENTS),
        "reaped while declared"
    );

    // A restart keeps it, with its VIP.
    registrar.terminate().await;
    let registrar = Registrar::start(data.path(), &flags).await;
    let mut client = registrar.client().await;
    let mut caller = Watcher::open(&mut client, filter(&[PAYMENTS])).await.strict();
    until(&mut caller, "payments is back", |w| host_of(w, PAYMENTS).is_some()).await;
    assert_eq!(caller.view.catalog.services[PAYMENTS].vip, vip);

    // An edit reaches the watchers; withdrawing it removes the service.
    write(
        config.path(),
        "external.yaml",
        &declaration("payments", "api2.payments.example", 443),
    );
    until(&mut caller, "the edit is served", |w| {
        host_of(w, PAYMENTS).as_deref() == Some("api2.payments.example")
    })
    .await;
    assert_eq!(caller.view.catalog.services[PAYMENTS].vip, vip, "an edit keeps the VIP");
    write(config.path(), "external.yaml", "");
    until(&mut caller, "payments is gone", |w| {
        !w.view.catalog.services.contains_key(PAYMENTS)
    })
    .await;
}

/// `--store kubernetes` derives external services from the ExternalService objects (their
/// VIPs kept in the ConfigMap like every service's) and writes their `Accepted` condition.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kubernetes_store_serves_the_clusters_external_services() {
    let cluster = ApiServer::start();
    cluster.apply::<k8s_openapi::api::core::v1::Node>(json!({"metadata": {"name": "n1"}}));
    let object = |host: &str| {
        json!({"metadata": {"name": "payments", "namespace": "shop"},
               "spec": {"hosts": [host], "ports": [{"number": 443, "protocol": "TLS"}]}})
    };
    cluster.apply::<ExternalService>(object("api.payments.example"));
    let dir = tempfile::tempdir().unwrap();
    let registrar = registrar(&cluster, dir.path(), &["--store", "kubernetes"]).await;
    let mut client = registrar.client().await;
    let mut caller = Watcher::open(&mut client, filter(&[PAYMENTS])).await.strict();
    until(&mut caller, "payments is served from the store", |w| {
        host_of(w, PAYMENTS).as_deref() == Some("api.payments.example")
    })
    .await;
    until_accepted::<ExternalService>(&cluster, &registrar, PAYMENTS, ("True", 1)).await;
    let vip = caller.view.catalog.services[PAYMENTS].vip.clone();
    let configmap = cluster
        .get::<k8s_openapi::api::core::v1::ConfigMap>("aether-system", "aether-registrar-vips")
        .expect("the VIP ConfigMap");
    assert_eq!(configmap["data"]["shop.payments"], vip.as_str(), "{configmap}");

    // An invalid edit: False naming the field, the last accepted version still served.
    cluster.apply::<ExternalService>(object("*.payments.example"));
    let message = until_accepted::<ExternalService>(&cluster, &registrar, PAYMENTS, ("False", 2)).await;
    assert!(message.starts_with("spec.hosts[0]"), "{message}");
    assert_eq!(host_of(&caller, PAYMENTS).as_deref(), Some("api.payments.example"));
    cluster.delete::<ExternalService>("shop", "payments");
    until(&mut caller, "payments is gone", |w| {
        !w.view.catalog.services.contains_key(PAYMENTS)
    })
    .await;
}
