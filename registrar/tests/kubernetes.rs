//! The Kubernetes store against the shared fake API server (no kube-apiserver can be
//! installed here): a small stateful cluster of pods, nodes and configmaps with
//! resourceVersions, label/field selectors, watches that replay history from a
//! resourceVersion then stream live events, and optimistic concurrency on PUT (409 on a
//! stale resourceVersion) so replicas racing on the VIP ConfigMap meet real conflicts.

mod support;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use aether_fakes::kube::ApiServer;
use aether_proto::registrar::v1::RegisterEndpointRequest;
use aether_proto::registrar::v1::registrar_client::RegistrarClient;
use aether_proto::registry::v1::Health;
use aether_registrar::cluster::services::ClusterServices;
use aether_registrar::external_services::ExternalServices;
use aether_registrar::http_filters::HttpFilters;
use aether_registrar::mesh_configs::MeshConfigs;
use aether_registrar::policies::Policies;
use aether_registrar::routes::kubernetes::ClusterRoutes;
use aether_registrar::store::kubernetes::{DEFAULT_VIP_CONFIGMAP, KubeConfig, KubeStore, vip_data_key};
use aether_registrar::store::{FeedEvent, Store};
use aether_registrar::vip::VipAllocator;
use futures::StreamExt;
use k8s_openapi::api::core::v1::{ConfigMap, Node, Pod};
use serde_json::{Value, json};
use support::replicas::wait_view;
use support::{Registrar, TIMEOUT, Watcher, endpoint, wildcard};
use tonic::transport::Channel;

// ---------------------------------------------------------------- objects

fn node(name: &str, region: &str, zone: &str) -> Value {
    json!({"metadata": {"name": name, "labels": {
        "topology.kubernetes.io/region": region, "topology.kubernetes.io/zone": zone}}})
}

fn pod(name: &str, sa: &str, node: &str, ip: &str, ready: bool) -> Value {
    json!({
        "metadata": {"name": name, "namespace": "shop", "uid": format!("uid-{name}"),
            "labels": {"aether.io/managed": "true", "app": sa}},
        "spec": {"serviceAccountName": sa, "nodeName": node, "containers": [
            {"name": "app", "image": "app:1", "ports": [{"name": "http", "containerPort": 8080}]}]},
        "status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}],
            "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}]},
    })
}

fn vip_configmap(cluster: &ApiServer) -> BTreeMap<String, String> {
    let (ns, name) = DEFAULT_VIP_CONFIGMAP.split_once('/').unwrap();
    cluster
        .get::<ConfigMap>(ns, name)
        .and_then(|cm| serde_json::from_value(cm["data"].clone()).ok())
        .unwrap_or_default()
}

fn store(cluster: &ApiServer) -> KubeStore {
    KubeStore::start(
        cluster.client(),
        KubeConfig {
            vip_configmap: DEFAULT_VIP_CONFIGMAP.into(),
            vips: VipAllocator::new("240.240.0.0/16".parse().unwrap()).unwrap(),
            routes: ClusterRoutes::start(cluster.client()),
            services: ClusterServices::start(cluster.client()),
            policies: aether_registrar::sources::crd::start::<Policies>(cluster.client()),
            policy_options: Default::default(),
            http_filters: aether_registrar::sources::crd::start::<HttpFilters>(cluster.client()),
            mesh_configs: aether_registrar::sources::crd::start::<MeshConfigs>(cluster.client()),
            external_services: aether_registrar::sources::crd::start::<ExternalServices>(cluster.client()),
        },
    )
    .unwrap()
}

// ---------------------------------------------------------------- tests

/// The registrar binary on `--store kubernetes`: managed pods appear with their node's
/// locality; Ready flips health; deletionTimestamp drains; deletion removes; agents'
/// Register is acknowledged, ignored and logged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_catalog_follows_managed_pods_and_their_nodes() {
    let cluster = ApiServer::start();
    cluster.apply::<Node>(node("n1", "eu-west-1", "eu-west-1a"));
    cluster.apply::<Node>(node("n2", "eu-west-1", "eu-west-1b"));
    cluster.apply::<Pod>(pod("web-1", "web", "n1", "10.0.1.1", true));
    let mut unmanaged = pod("batch-1", "batch", "n1", "10.0.1.9", true);
    unmanaged["metadata"]["labels"]["aether.io/managed"] = json!("false");
    cluster.apply::<Pod>(unmanaged);

    let dir = tempfile::tempdir().unwrap();
    let registrar = kube_registrar(&cluster, dir.path()).await;
    let mut client = registrar.client().await;
    let mut watcher = Watcher::open(&mut client, wildcard()).await;
    watcher.until(0).await;
    let vip = first_pod_served(&cluster, &mut watcher).await;

    // A second pod on another node, not ready yet; then ready.
    cluster.apply::<Pod>(pod("web-2", "web", "n2", "10.0.2.1", false));
    wait_view(&mut watcher, "web-2 unhealthy in zone b", |v| {
        endpoint_of(v, "shop/web", "10.0.2.1")
            .is_some_and(|e| e.health == Health::Unhealthy as i32 && e.locality.as_ref().unwrap().zone == "eu-west-1b")
    })
    .await;
    cluster.apply::<Pod>(pod("web-2", "web", "n2", "10.0.2.1", true));
    wait_view(&mut watcher, "web-2 healthy", |v| {
        endpoint_of(v, "shop/web", "10.0.2.1").is_some_and(|e| e.health == Health::Healthy as i32)
    })
    .await;

    // The node moves zone: its pods' locality follows.
    cluster.apply::<Node>(node("n2", "eu-west-1", "eu-west-1c"));
    wait_view(&mut watcher, "web-2 in zone c", |v| {
        endpoint_of(v, "shop/web", "10.0.2.1").is_some_and(|e| e.locality.as_ref().unwrap().zone == "eu-west-1c")
    })
    .await;

    // Terminating drains; deleted leaves.
    let mut terminating = pod("web-1", "web", "n1", "10.0.1.1", true);
    terminating["metadata"]["deletionTimestamp"] = json!("2025-06-01T12:00:00Z");
    cluster.apply::<Pod>(terminating);
    wait_view(&mut watcher, "web-1 draining", |v| {
        endpoint_of(v, "shop/web", "10.0.1.1").is_some_and(|e| e.health == Health::Draining as i32)
    })
    .await;
    cluster.delete::<Pod>("shop", "web-1");
    wait_view(&mut watcher, "web-1 gone", |v| {
        endpoint_of(v, "shop/web", "10.0.1.1").is_none()
    })
    .await;
    assert!(endpoint_of(&watcher.view.catalog, "shop/web", "10.0.2.1").is_some());

    register_is_ignored(&registrar, &mut client, &mut watcher).await;

    // The last pod goes: the service leaves the catalog, its VIP stays stored for its return.
    cluster.delete::<Pod>("shop", "web-2");
    wait_view(&mut watcher, "shop/web gone", |v| !v.services.contains_key("shop/web")).await;
    cluster.apply::<Pod>(pod("web-3", "web", "n1", "10.0.1.3", true));
    wait_view(&mut watcher, "shop/web back", |v| v.services.contains_key("shop/web")).await;
    assert_eq!(
        watcher.view.catalog.services["shop/web"].vip, vip,
        "a returning service keeps its VIP"
    );
}

/// `web-1` is served with its node's locality, the unmanaged pod is not, and the VIP is
/// stored; returns the VIP.
async fn first_pod_served(cluster: &ApiServer, watcher: &mut Watcher) -> String {
    wait_view(watcher, "web-1 served", |v| {
        endpoint_of(v, "shop/web", "10.0.1.1").is_some()
    })
    .await;
    let web1 = endpoint_of(&watcher.view.catalog, "shop/web", "10.0.1.1").unwrap();
    assert_eq!(web1.health, Health::Healthy as i32);
    let locality = web1.locality.clone().unwrap();
    assert_eq!(
        (locality.region.as_str(), locality.zone.as_str()),
        ("eu-west-1", "eu-west-1a")
    );
    assert_eq!(web1.node, "n1");
    assert_eq!(web1.pod.as_ref().unwrap().name, "web-1");
    assert!(
        !watcher.view.catalog.services.contains_key("shop/batch"),
        "an unmanaged pod is not in the mesh"
    );
    let vip = watcher.view.catalog.services["shop/web"].vip.clone();
    assert_eq!(
        vip_configmap(cluster)[&vip_data_key("shop/web")],
        vip,
        "the VIP is stored in the ConfigMap"
    );
    assert!(
        cluster
            .requests()
            .iter()
            .any(|r| r.starts_with("GET /api/v1/pods?") && r.contains("labelSelector=aether.io%2Fmanaged%3Dtrue")),
        "pods are listed by the managed label: {:?}",
        cluster.requests()
    );
    vip
}

/// An agent registering is answered OK and ignored, with a log line saying why.
async fn register_is_ignored(registrar: &Registrar, client: &mut RegistrarClient<Channel>, watcher: &mut Watcher) {
    client
        .register_endpoint(RegisterEndpointRequest {
            endpoint: Some(endpoint("shop/agent-made", "10.0.3.1", 8080)),
        })
        .await
        .expect("Register is accepted");
    tokio::time::sleep(Duration::from_millis(500)).await;
    while watcher.try_next().is_some() {}
    assert!(
        !watcher.view.catalog.services.contains_key("shop/agent-made"),
        "Register must be ignored"
    );
    let logs = registrar.logs();
    assert!(
        logs.lines()
            .any(|l| l.contains("ignoring Register") && l.contains("10.0.3.1")),
        "no log line for the ignored Register:\n{logs}"
    );
}

/// Two replicas derive the same catalog; the VIP ConfigMap is written once per service
/// even though both race to allocate (the loser gets 409 and re-reads).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_racing_for_vips_agree_through_the_configmap() {
    let cluster = ApiServer::start();
    cluster.apply::<Node>(node("n1", "r", "z"));
    let a = store(&cluster);
    let b = store(&cluster);
    let (ca, cb) = tokio::join!(a.load(), b.load());
    assert!(ca.unwrap().services.is_empty() && cb.unwrap().services.is_empty());
    let mut feed_a = a.feed(0);
    let mut feed_b = b.feed(0);
    for i in 0..20 {
        cluster.apply::<Pod>(pod(
            &format!("p{i}"),
            &format!("svc-{i}"),
            "n1",
            &format!("10.9.0.{i}"),
            true,
        ));
    }
    let deadline = Instant::now() + TIMEOUT;
    loop {
        let (la, lb) = (a.load().await.unwrap(), b.load().await.unwrap());
        if la.services.len() == 20 && lb.services.len() == 20 && la.endpoints.len() == 20 && lb.endpoints.len() == 20 {
            let vips = |c: &aether_registrar::store::Contents| {
                c.services
                    .iter()
                    .map(|s| (format!("{}/{}", s.value.namespace, s.value.name), s.value.vip.clone()))
                    .collect::<BTreeMap<_, _>>()
            };
            assert_eq!(vips(&la), vips(&lb), "the replicas disagree on VIPs");
            let stored: BTreeMap<String, String> = vip_configmap(&cluster);
            for (service, vip) in vips(&la) {
                assert_eq!(stored[&vip_data_key(&service)], vip);
            }
            let distinct: std::collections::BTreeSet<_> = stored.values().collect();
            assert_eq!(distinct.len(), 20, "a VIP was handed out twice");
            break;
        }
        assert!(Instant::now() < deadline, "the replicas did not converge");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Both feeds delivered the services and endpoints as changes, each with a higher revision.
    for feed in [&mut feed_a, &mut feed_b] {
        let mut seen = 0;
        let mut last = 0;
        while seen < 40 {
            match tokio::time::timeout(TIMEOUT, feed.next()).await.unwrap().unwrap() {
                FeedEvent::Changes { revision, changes } => {
                    for change in &changes {
                        assert!(change.revision > last, "revisions must increase");
                        last = change.revision;
                    }
                    assert!(revision >= last);
                    seen += changes.len();
                }
                other => panic!("expected changes, got {other:?}"),
            }
        }
    }
    assert!(
        cluster
            .requests()
            .iter()
            .any(|r| r.starts_with("PUT ") || r.starts_with("POST ")),
        "the ConfigMap was written"
    );
}

// ---------------------------------------------------------------- helpers

fn endpoint_of<'a>(
    view: &'a aether_proto::view::CatalogView,
    service: &str,
    address: &str,
) -> Option<&'a aether_proto::registry::v1::Endpoint> {
    view.endpoints.get(service).and_then(|e| e.get(address))
}

/// The registrar binary on `--store kubernetes`, with KUBECONFIG pointing at the fake.
async fn kube_registrar(cluster: &ApiServer, dir: &std::path::Path) -> Registrar {
    let kubeconfig = cluster.write_kubeconfig(dir);
    let env = [("KUBECONFIG".to_owned(), kubeconfig.display().to_string())];
    Registrar::start_with_env(&dir.join("data"), &["--store", "kubernetes"], &env).await
}
