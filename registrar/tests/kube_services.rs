//! Kubernetes Services' attributes through the registrar binary, against the shared fake
//! API server: a Service's clusterIPs and trafficDistribution reach the Watch streams of
//! the mesh service of the same name (`Service.kubernetes`), follow its edits, and go
//! with its deletion — derived by `--store kubernetes`, and stored by a writable store
//! with `--from-kubernetes`.

mod support;

use aether_fakes::kube::ApiServer;
use aether_proto::registry::v1::{KubernetesService, ServicePort, TrafficDistribution};
use k8s_openapi::api::core::v1::{Pod, Service};
use serde_json::{Value, json};
use support::replicas::wait_view;
use support::sources::*;
use support::*;

fn service(name: &str, cluster_ips: &[&str], traffic: Option<&str>) -> Value {
    json!({
        "metadata": {"name": name, "namespace": "shop"},
        "spec": {"clusterIP": cluster_ips.first(), "clusterIPs": cluster_ips,
                 "trafficDistribution": traffic, "ports": [{"name": "http", "port": 8080}]},
    })
}

fn managed_pod(name: &str, service_account: &str, ip: &str) -> Value {
    json!({
        "metadata": {"name": name, "namespace": "shop", "labels": {"aether.io/managed": "true"}},
        "spec": {"serviceAccountName": service_account, "nodeName": "n1",
                 "containers": [{"name": "app", "ports": [{"name": "http", "containerPort": 8080}]}]},
        "status": {"phase": "Running", "podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]},
    })
}

fn attributes(cluster_ips: &[&str], traffic: TrafficDistribution) -> Option<KubernetesService> {
    Some(KubernetesService {
        cluster_ips: cluster_ips.iter().map(|ip| (*ip).to_owned()).collect(),
        traffic_distribution: traffic as i32,
        // service()'s one port; no targetPort means the port itself.
        ports: vec![ServicePort {
            name: "http".into(),
            port: 8080,
            target_port: 8080,
            ..Default::default()
        }],
    })
}

/// Waits until the watcher's view of `key` carries `want`.
async fn until_carried(watcher: &mut Watcher, key: &str, want: Option<KubernetesService>) {
    let what = format!("{key} carries {want:?}");
    wait_view(watcher, &what, |v| {
        v.services.get(key).is_some_and(|s| s.kubernetes == want)
    })
    .await;
}

/// With `cart` in the mesh and a watcher of it: an edit of its Service follows, its
/// deletion clears it, and its return brings it back.
async fn edits_follow(cluster: &ApiServer, cart: &mut Watcher) {
    let dual = ["10.96.0.7", "fd00:96::7"];
    until_carried(
        cart,
        "shop/cart",
        attributes(&dual, TrafficDistribution::PreferSameNode),
    )
    .await;
    cluster.apply::<Service>(service("cart", &dual, Some("PreferClose")));
    until_carried(
        cart,
        "shop/cart",
        attributes(&dual, TrafficDistribution::PreferSameZone),
    )
    .await;
    cluster.delete::<Service>("shop", "cart");
    until_carried(cart, "shop/cart", None).await;
    cluster.apply::<Service>(service("cart", &["None"], None));
    until_carried(cart, "shop/cart", attributes(&[], TrafficDistribution::Unspecified)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kubernetes_store_derives_service_attributes() {
    let cluster = ApiServer::start();
    cluster.apply::<Service>(service("cart", &["10.96.0.7", "fd00:96::7"], Some("PreferSameNode")));
    cluster.apply::<Pod>(managed_pod("cart-0", "cart", "10.0.1.1"));
    let dir = tempfile::tempdir().unwrap();
    let registrar = registrar(&cluster, dir.path(), &["--store", "kubernetes"]).await;
    let mut client = registrar.client().await;
    let mut cart = Watcher::open(&mut client, filter(&["shop/cart"])).await.strict();
    edits_follow(&cluster, &mut cart).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writable_store_stores_service_attributes_from_the_cluster() {
    let cluster = ApiServer::start();
    cluster.apply::<Service>(service("cart", &["10.96.0.7", "fd00:96::7"], Some("PreferSameNode")));
    cluster.apply::<Service>(service("pay", &["10.96.0.9"], Some("PreferSameZone")));
    let dir = tempfile::tempdir().unwrap();
    let registrar = registrar(&cluster, dir.path(), &["--from-kubernetes"]).await;
    let mut client = registrar.client().await;
    register(&mut client, endpoint("shop/cart", "10.0.0.1", 8080)).await;
    let mut cart = Watcher::open(&mut client, filter(&["shop/cart", "shop/pay"]))
        .await
        .strict();
    edits_follow(&cluster, &mut cart).await;

    // A service created once the attributes are known starts with them: its first record
    // already carries them.
    register(&mut client, endpoint("shop/pay", "10.0.0.2", 8080)).await;
    let first = loop {
        let message = cart.next().await;
        if let Some(pay) = cart.view.catalog.services.get("shop/pay") {
            break (pay.clone(), message);
        }
    };
    let want = attributes(&["10.96.0.9"], TrafficDistribution::PreferSameZone);
    assert_eq!(first.0.kubernetes, want, "{:?}", first.1);
}
