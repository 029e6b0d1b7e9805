//! The fake against kube's own client: what it answers is what the real client parses.

use std::time::Duration;

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use kube::api::{Api, ListParams, PostParams, WatchEvent, WatchParams};
use serde_json::json;

use super::*;

const WAIT: Duration = Duration::from_secs(10);

fn pod(name: &str, app: &str) -> Value {
    json!({"metadata": {"name": name, "namespace": "shop", "labels": {"app": app}},
           "spec": {"containers": [{"name": "app", "image": "app:1"}]}})
}

#[tokio::test]
async fn a_watch_from_a_list_sees_what_changed_after_it_selected() {
    let server = ApiServer::start();
    server.apply::<Pod>(pod("web-1", "web"));
    server.apply::<Pod>(pod("db-1", "db"));
    let pods: Api<Pod> = Api::namespaced(server.client(), "shop");

    let list = pods.list(&ListParams::default().labels("app=web")).await.unwrap();
    let names: Vec<_> = list.items.iter().map(|p| p.metadata.name.clone().unwrap()).collect();
    assert_eq!(names, ["web-1"]);
    let from = list.metadata.resource_version.unwrap();
    assert_eq!(from, "2");

    server.apply::<Pod>(pod("db-2", "db"));
    server.apply::<Pod>(pod("web-2", "web"));
    let watch = pods
        .watch(&WatchParams::default().labels("app=web"), &from)
        .await
        .unwrap();
    let mut watch = Box::pin(watch);
    server.delete::<Pod>("shop", "web-1");
    let mut seen = Vec::new();
    while seen.len() < 2 {
        match tokio::time::timeout(WAIT, watch.try_next())
            .await
            .unwrap()
            .unwrap()
            .unwrap()
        {
            WatchEvent::Added(p) => seen.push(("ADDED", p.metadata.name.unwrap(), p.metadata.resource_version)),
            WatchEvent::Deleted(p) => seen.push(("DELETED", p.metadata.name.unwrap(), p.metadata.resource_version)),
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(
        seen,
        [
            ("ADDED", "web-2".to_owned(), Some("4".to_owned())),
            ("DELETED", "web-1".to_owned(), Some("5".to_owned()))
        ]
    );
    let watched = &server.requests()[1];
    assert!(
        watched.contains("watch=true") && watched.contains("resourceVersion=2"),
        "{watched}"
    );
}

#[tokio::test]
async fn writes_meet_the_real_refusals() {
    let server = ApiServer::start();
    let maps: Api<ConfigMap> = Api::namespaced(server.client(), "system");
    let created = maps
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": "vips"}})).unwrap(),
        )
        .await
        .unwrap();
    let again = maps.create(&PostParams::default(), &created).await.unwrap_err();
    assert!(
        matches!(again, kube::Error::Api(ref s) if s.code == 409 && s.reason == "AlreadyExists"),
        "{again}"
    );
    let mut current = created.clone();
    current.data = Some([("a".to_owned(), "1".to_owned())].into());
    maps.replace("vips", &PostParams::default(), &current).await.unwrap();
    let stale = maps
        .replace("vips", &PostParams::default(), &created)
        .await
        .unwrap_err();
    assert!(
        matches!(stale, kube::Error::Api(ref s) if s.code == 409 && s.reason == "Conflict"),
        "{stale}"
    );
    let missing = maps.get("other").await.unwrap_err();
    assert!(matches!(missing, kube::Error::Api(ref s) if s.code == 404), "{missing}");
    assert_eq!(server.get::<ConfigMap>("system", "vips").unwrap()["data"]["a"], "1");
}

#[tokio::test]
async fn a_scripted_watch_is_fed_by_the_test_and_a_stranger_is_refused() {
    let server = ApiServer::start();
    let mut calls = server.script();
    let pods: Api<Pod> = Api::all(server.client());
    let watching = tokio::spawn(async move {
        let events = pods.watch(&WatchParams::default(), "7").await.unwrap();
        events
            .map(|e| format!("{:?}", e.unwrap()))
            .take(2)
            .collect::<Vec<_>>()
            .await
    });
    let call = tokio::time::timeout(WAIT, calls.next()).await.unwrap().unwrap();
    assert!(
        call.is_watch() && call.query()["resourceVersion"] == "7",
        "{}",
        call.uri()
    );
    let feed = call.watch();
    feed.bookmark("9");
    feed.expired("9");
    let events = tokio::time::timeout(WAIT, watching).await.unwrap().unwrap();
    assert!(
        events[0].starts_with("Bookmark") && events[1].contains("410"),
        "{events:?}"
    );

    let stranger = kube::Client::try_from(kube::Config::new(server.url().parse().unwrap())).unwrap();
    let refused = Api::<Pod>::all(stranger)
        .list(&ListParams::default())
        .await
        .unwrap_err();
    assert!(matches!(refused, kube::Error::Api(ref s) if s.code == 401), "{refused}");
}

#[test]
fn a_token_review_authenticates_a_minted_token_for_its_audiences_only() {
    let tokens = Tokens::default();
    let token = tokens.mint(TokenInfo {
        username: "system:serviceaccount:ns:agent".into(),
        node: Some("n1".into()),
        audiences: vec!["registrar".into()],
    });
    let review =
        |token: &str, audience: &str| tokens.review(&json!({"spec": {"token": token, "audiences": [audience]}}));
    let granted = review(&token, "registrar");
    assert_eq!(granted["status"]["authenticated"], true);
    assert_eq!(
        granted["status"]["user"]["extra"]["authentication.kubernetes.io/node-name"][0],
        "n1"
    );
    assert_eq!(review(&token, "other")["status"]["authenticated"], false);
    tokens.revoke(&token);
    assert_eq!(review(&token, "registrar")["status"]["authenticated"], false);
    assert_eq!(tokens.reviewed().len(), 3);
}

fn route() -> Value {
    json!({"metadata": {"name": "canary", "namespace": "shop"},
           "spec": {"parentRefs": [{"group": "", "kind": "Service", "name": "cart"}]}})
}

/// A CRD with the status subresource: the object's writes keep its status, `/status` writes
/// change only the status, generation follows the spec, a stale resourceVersion is refused.
#[tokio::test]
async fn a_route_status_is_a_subresource() {
    use aether_api::gateway::HttpRoute;
    use kube::api::{Patch, PatchParams};

    let server = ApiServer::start();
    let stored = server.apply::<HttpRoute>(route());
    assert_eq!(stored["metadata"]["generation"], 1);
    assert!(stored["metadata"]["uid"].is_string() && stored["metadata"]["creationTimestamp"].is_string());
    let routes: Api<HttpRoute> = Api::namespaced(server.client(), "shop");
    let rv = stored["metadata"]["resourceVersion"].clone();
    let status = json!({"parents": [{"parentRef": {"group": "", "kind": "Service", "name": "cart"},
                                     "controllerName": "aether.io/mesh", "conditions": []}]});
    let patch = json!({"metadata": {"resourceVersion": rv}, "status": status, "spec": {"hostnames": ["x"]}});
    let patched = routes
        .patch_status("canary", &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap();
    assert_eq!(patched.status.unwrap().parents[0].controller_name, "aether.io/mesh");
    assert!(patched.spec.hostnames.is_empty(), "a status write ignores the spec");
    assert_eq!(patched.metadata.generation, Some(1));
    let stale = routes
        .patch_status("canary", &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap_err();
    assert!(matches!(stale, kube::Error::Api(ref s) if s.code == 409), "{stale}");

    let mut edited = routes.get("canary").await.unwrap();
    edited.spec.hostnames = vec!["cart.shop".into()];
    edited.status = None;
    let replaced = routes.replace("canary", &PostParams::default(), &edited).await.unwrap();
    assert_eq!(
        replaced.metadata.generation,
        Some(2),
        "a spec change moves the generation"
    );
    assert!(replaced.status.is_some(), "an object write keeps the status");

    server.uninstall::<HttpRoute>();
    let missing = routes.list(&ListParams::default()).await.unwrap_err();
    assert!(matches!(missing, kube::Error::Api(ref s) if s.code == 404), "{missing}");
    server.install::<HttpRoute>();
    assert_eq!(routes.list(&ListParams::default()).await.unwrap().items.len(), 1);
}

/// core/v1 Services: listed across namespaces and watched as kube's typed client reads them.
#[tokio::test]
async fn services_are_served_with_their_spec() {
    use k8s_openapi::api::core::v1::Service;

    let server = ApiServer::start();
    server.apply::<Service>(json!({"metadata": {"name": "cart", "namespace": "shop"},
        "spec": {"clusterIP": "10.96.0.7", "clusterIPs": ["10.96.0.7", "fd00::7"],
                 "trafficDistribution": "PreferSameZone", "ports": [{"port": 80}]}}));
    let services: Api<Service> = Api::all(server.client());
    let list = services.list(&ListParams::default()).await.unwrap();
    let spec = list.items[0].spec.clone().unwrap();
    assert_eq!(spec.cluster_ips.unwrap(), ["10.96.0.7", "fd00::7"]);
    assert_eq!(spec.traffic_distribution.as_deref(), Some("PreferSameZone"));
    let from = list.metadata.resource_version.unwrap();
    let mut watch = Box::pin(services.watch(&WatchParams::default(), &from).await.unwrap());
    server.delete::<Service>("shop", "cart");
    match tokio::time::timeout(WAIT, watch.try_next())
        .await
        .unwrap()
        .unwrap()
        .unwrap()
    {
        WatchEvent::Deleted(s) => assert_eq!(s.metadata.name.as_deref(), Some("cart")),
        other => panic!("unexpected {other:?}"),
    }
}

/// What the edge gateway reads: a cluster-scoped GatewayClass, one Gateway by a
/// `metadata.name` field selector, v1beta1 ReferenceGrants, Namespaces, and Secrets of one
/// namespace selected by their `type`.
#[tokio::test]
async fn the_edge_kinds_are_served_with_their_selectors() {
    use aether_api::gateway::{Gateway, GatewayClass, ReferenceGrant};
    use k8s_openapi::api::core::v1::{Namespace, Secret};

    let server = ApiServer::start();
    server.apply::<GatewayClass>(json!({"metadata": {"name": "aether"}, "spec": {"controllerName": "aether.io/edge"}}));
    for name in ["edge", "other"] {
        server.apply::<Gateway>(json!({"metadata": {"name": name, "namespace": "edge"},
            "spec": {"gatewayClassName": "aether", "listeners": [{"name": "http", "port": 80, "protocol": "HTTP"}]}}));
    }
    server.apply::<ReferenceGrant>(json!({"metadata": {"name": "certs", "namespace": "certs"},
        "spec": {"from": [{"group": "gateway.networking.k8s.io", "kind": "Gateway", "namespace": "edge"}],
                 "to": [{"group": "", "kind": "Secret"}]}}));
    server.apply::<Namespace>(json!({"metadata": {"name": "shop", "labels": {"edge": "yes"}}}));
    server.apply::<Secret>(
        json!({"metadata": {"name": "cert", "namespace": "edge"}, "type": "kubernetes.io/tls",
        "data": {"tls.crt": "Y2hhaW4=", "tls.key": "a2V5"}}),
    );
    server.apply::<Secret>(json!({"metadata": {"name": "token", "namespace": "edge"}, "type": "Opaque"}));

    let client = server.client();
    let classes = Api::<GatewayClass>::all(client.clone())
        .list(&ListParams::default())
        .await
        .unwrap();
    assert_eq!(classes.items[0].spec.controller_name, "aether.io/edge");
    let gateways = Api::<Gateway>::namespaced(client.clone(), "edge")
        .list(&ListParams::default().fields("metadata.name=edge"))
        .await
        .unwrap();
    assert_eq!(gateways.items.len(), 1);
    assert_eq!(gateways.items[0].spec.listeners[0].port, 80);
    let grants = Api::<ReferenceGrant>::all(client.clone())
        .list(&ListParams::default())
        .await
        .unwrap();
    assert_eq!(grants.items[0].spec.from[0].namespace, "edge");
    let namespaces = Api::<Namespace>::all(client.clone())
        .list(&ListParams::default())
        .await
        .unwrap();
    assert_eq!(namespaces.items[0].metadata.labels.as_ref().unwrap()["edge"], "yes");
    let secrets = Api::<Secret>::namespaced(client, "edge")
        .list(&ListParams::default().fields("type=kubernetes.io/tls"))
        .await
        .unwrap();
    assert_eq!(secrets.items.len(), 1);
    assert_eq!(secrets.items[0].data.as_ref().unwrap()["tls.key"].0, b"key");
    let paths: Vec<String> = server.requests();
    assert!(
        paths
            .iter()
            .any(|r| r.starts_with("GET /apis/gateway.networking.k8s.io/v1beta1/referencegrants")),
        "{paths:?}"
    );
}
