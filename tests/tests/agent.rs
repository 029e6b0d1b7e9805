//! `aether-agent run` end to end: real registrar, real Envoy fed over the agent's xDS
//! socket, pods as network namespaces added through the CNI gRPC API.

use std::collections::BTreeSet;
use std::time::Duration;

use aether_proto::cni::v1::{AddPodRequest, CheckPodRequest, Outcome, PodRef, RemovePodRequest};
use aether_tests::mesh::{APP, Mesh, fqdn};
use aether_tests::{HttpReply, TestPod};

/// GETs `url` from inside `pod` with `host` until `ok` holds (config propagates
/// asynchronously), failing with the last answer after a deadline.
async fn eventually(pod: &TestPod, url: &str, host: Option<&str>, ok: impl Fn(&HttpReply) -> bool) -> HttpReply {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let reply = pod.http_get(url, host).await;
        if let Ok(reply) = &reply
            && ok(reply)
        {
            return reply.clone();
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no good answer from {url} (host {host:?}): {reply:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn served_by(reply: &HttpReply) -> String {
    reply.json()["pod"].as_str().unwrap_or_default().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pods_reach_their_upstreams_through_the_node_envoy() {
    let mesh = Mesh::start().await;
    let frontend = mesh.node.add_pod("frontend");
    let backend1 = mesh.node.add_pod("backend-1");
    let backend2 = mesh.node.add_pod("backend-2");
    let _apps = [
        frontend.serve_http(APP.parse().unwrap(), "frontend"),
        backend1.serve_http(APP.parse().unwrap(), "backend-1"),
        backend2.serve_http(APP.parse().unwrap(), "backend-2"),
    ];
    mesh.describe_pod(&frontend, "frontend", "frontend", "backend", &[("http", 8080)]);
    mesh.describe_pod(&backend1, "backend-1", "backend", "", &[("http", 8080)]);
    mesh.describe_pod(&backend2, "backend-2", "backend", "", &[("http", 8080)]);
    mesh.add_pod_ok(&backend1, "backend-1").await;
    mesh.add_pod_ok(&frontend, "frontend").await;

    the_first_request_is_served_without_waiting(&frontend).await;
    envoy_holds_clusters_for_exactly_the_dependencies(&mesh).await;
    // A second replica gets traffic too.
    mesh.add_pod_ok(&backend2, "backend-2").await;
    assert_eq!(
        served_by_within(&frontend, 40, 2).await,
        BTreeSet::from(["backend-1".to_string(), "backend-2".to_string()])
    );

    // Removing it takes it out of rotation; DEL returns once Envoy dropped its listeners.
    mesh.remove_pod(&backend2, "backend-2").await.unwrap();
    assert!(!mesh.envoy().admin_get("/listeners").contains("demo/backend-2"));
    tokio::time::sleep(Duration::from_millis(300)).await;
    for _ in 0..10 {
        let reply = eventually(&frontend, "http://127.0.0.1:18081/", Some(&backend_host()), |r| {
            r.status == 200
        })
        .await;
        assert_eq!(served_by(&reply), "backend-1");
    }

    // The VIP, captured inside the frontend's netns, reaches the service too.
    let services = mesh.agent_get("/debug/dependencies").await;
    assert!(services.contains("demo/backend"), "{services}");
    let catalog: serde_json::Value = serde_json::from_str(&mesh.agent_get("/debug/xds").await).unwrap();
    assert!(catalog["serial"].as_u64().unwrap() > 0);
}

/// The backend's address as the frontend names it.
fn backend_host() -> String {
    format!("{}:8080", fqdn("backend"))
}

/// By name through the explicit outbound listener, from inside the frontend pod. No waiting: when AddPod
/// returned, the pod's upstreams were already live in Envoy.
async fn the_first_request_is_served_without_waiting(frontend: &TestPod) {
    let reply = frontend
        .http_get("http://127.0.0.1:18081/hello", Some(&backend_host()))
        .await
        .unwrap();
    assert_eq!(reply.status, 200, "{reply:?}");
    assert_eq!(served_by(&reply), "backend-1");
    assert_eq!(reply.json()["path"], "/hello");
    assert!(
        reply.json()["headers"].get("x-aether-port").is_none(),
        "the port header leaked to the app"
    );
}

/// Envoy holds clusters for exactly the services local pods call (backend; the pods' own services are known but
/// no one here calls them), besides each local pod's own (delivery `local|…`, and with mTLS `originate|<pod>`,
/// which its connections leave through).
async fn envoy_holds_clusters_for_exactly_the_dependencies(mesh: &Mesh) {
    let mesh_clusters = || -> BTreeSet<String> {
        mesh.envoy_clusters()
            .into_iter()
            .filter(|c| !c.starts_with("local|") && !c.starts_with("originate|"))
            .collect()
    };
    let expected: BTreeSet<String> = [backend_host()].into();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while mesh_clusters() != expected && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(mesh_clusters(), expected);
    let originate: Vec<String> = mesh
        .envoy_clusters()
        .into_iter()
        .filter(|c| c.starts_with("originate|"))
        .collect();
    assert_eq!(originate, ["originate|demo/backend-1", "originate|demo/frontend"]);
}

/// The pods that served the frontend's requests to the backend, over at most `tries` requests or until `enough`
/// distinct ones answered.
async fn served_by_within(frontend: &TestPod, tries: usize, enough: usize) -> BTreeSet<String> {
    let mut seen = BTreeSet::new();
    for _ in 0..tries {
        let reply = eventually(frontend, "http://127.0.0.1:18081/", Some(&backend_host()), |r| {
            r.status == 200
        })
        .await;
        seen.insert(served_by(&reply));
        if seen.len() == enough {
            break;
        }
    }
    seen
}

/// The agent programmed the capture inside `pod` on AddPod (its nftables table `inet aether`
/// redirects TCP to the mesh VIP range to the capture port): check it is there.
fn capture_vips(pod: &TestPod) {
    let rules = pod.exec_ok(&["nft", "list", "table", "inet", "aether"]);
    assert!(
        rules.contains("ip daddr 240.240.0.0/16 meta l4proto tcp counter name \"captured\" redirect to :18001"),
        "{rules}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_to_a_service_vip_is_captured_and_served() {
    let mesh = Mesh::start().await;
    let (frontend, _backend, _apps) = mesh.frontend_and_backend().await;
    capture_vips(&frontend);
    let vip = mesh.vip("backend").await;
    let reply = eventually(&frontend, &format!("http://{vip}:8080/by-vip"), None, |r| {
        r.status == 200
    })
    .await;
    assert_eq!(served_by(&reply), "backend");
    assert_eq!(reply.json()["path"], "/by-vip");
    // A captured connection that matches no declared VIP:port is HTTP routed by its
    // authority: a mesh name works, anything else is a clear 404.
    let reply = frontend.http_get(&format!("http://{vip}:9999/"), None).await.unwrap();
    assert_eq!((reply.status, reply.body.as_str()), (404, "not a mesh service\n"));
    let reply = frontend
        .http_get(
            &format!("http://{vip}:9999/"),
            Some(&format!("{}:8080", fqdn("backend"))),
        )
        .await
        .unwrap();
    assert_eq!(served_by(&reply), "backend");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn undeclared_services_are_reached_on_demand_and_unknown_names_get_404() {
    // The stand-in for a remote node's inbound listener speaks plaintext: no mTLS here.
    let mesh = Mesh::start_plaintext().await;
    let (frontend, _backend, _apps) = mesh.frontend_and_backend().await;
    // "remote" runs on another node: its endpoint is in the catalog, its inbound
    // listener (here a stand-in server on :18008) answers for it.
    let remote = mesh.node.add_pod("remote");
    let _remote_app = remote.serve_http(format!("{}:18008", remote.ip()).parse().unwrap(), "remote");
    let mut registrar = mesh.registrar_as("other-node").await;
    let mut endpoint = remote_endpoint(&remote, "demo/remote");
    register(&mut registrar, &endpoint).await;
    assert!(
        !mesh.envoy_clusters().iter().any(|c| c.contains("remote")),
        "remote was configured before use"
    );

    an_undeclared_service_is_configured_on_first_use(&mesh, &frontend).await;
    // Not in the catalog: 404, quickly; not a mesh name at all: 404 too.
    let reply = via_envoy(&frontend, &fqdn("nothing-here")).await;
    assert_eq!(reply.status, 404, "{reply:?}");
    let reply = via_envoy(&frontend, "example.com").await;
    assert_eq!((reply.status, reply.body.as_str()), (404, "not a mesh service\n"));

    // Known but with no endpoints: a retryable 503, not a 404.
    endpoint.service = "demo/drained".into();
    register(&mut registrar, &endpoint).await;
    registrar
        .unregister_endpoint(aether_proto::registrar::v1::UnregisterEndpointRequest {
            service: "demo/drained".into(),
            address: endpoint.address.clone(),
        })
        .await
        .unwrap();
    let reply = via_envoy(&frontend, &format!("{}:8080", fqdn("drained"))).await;
    assert_eq!(reply.status, 503, "{reply:?}");
}

/// GET / from `frontend` through its outbound listener, for `host`.
async fn via_envoy(frontend: &TestPod, host: &str) -> HttpReply {
    frontend.http_get("http://127.0.0.1:18081/", Some(host)).await.unwrap()
}

/// `remote`'s endpoint of `service` on other-node, with an HTTP port 8080.
fn remote_endpoint(remote: &TestPod, service: &str) -> aether_proto::registry::v1::Endpoint {
    aether_proto::registry::v1::Endpoint {
        service: service.into(),
        address: remote.ip().to_string(),
        ports: vec![aether_proto::registry::v1::Port {
            name: "http".into(),
            port: 8080,
            protocol: aether_proto::registry::v1::Protocol::Http as i32,
        }],
        node: "other-node".into(),
        ..Default::default()
    }
}

async fn register(
    registrar: &mut aether_proto::registrar::v1::registrar_client::RegistrarClient<tonic::transport::Channel>,
    endpoint: &aether_proto::registry::v1::Endpoint,
) {
    registrar
        .register_endpoint(aether_proto::registrar::v1::RegisterEndpointRequest {
            endpoint: Some(endpoint.clone()),
        })
        .await
        .unwrap();
}

/// The first request to an undeclared service configures it on demand, by host:port and by the bare name.
async fn an_undeclared_service_is_configured_on_first_use(mesh: &Mesh, frontend: &TestPod) {
    let host = format!("{}:8080", fqdn("remote"));
    let reply = frontend
        .http_get("http://127.0.0.1:18081/cold", Some(&host))
        .await
        .unwrap();
    assert_eq!(reply.status, 200, "{reply:?}");
    assert_eq!(served_by(&reply), "remote");
    assert_eq!(reply.json()["headers"]["x-aether-port"], "8080");
    assert!(mesh.envoy_clusters().contains(&host));
    // An authority without a port asks for the bare name: the default port, on demand too.
    let reply = frontend
        .http_get("http://127.0.0.1:18081/bare", Some(&fqdn("remote")))
        .await
        .unwrap();
    assert_eq!(
        (reply.status, served_by(&reply)),
        (200, "remote".to_string()),
        "{reply:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_config_envoy_rejects_is_nacked_counted_and_the_last_good_one_keeps_serving() {
    let mesh = Mesh::start().await;
    let (frontend, _backend, _apps) = mesh.frontend_and_backend().await;
    let host = format!("{}:8080", fqdn("backend"));
    eventually(&frontend, "http://127.0.0.1:18081/", Some(&host), |r| r.status == 200).await;

    // A second pod record claiming the frontend's netns: its listeners collide with
    // the frontend's addresses there, and Envoy rejects them.
    let twin = mesh.node.add_pod("twin");
    mesh.describe_pod(&twin, "twin", "twin", "", &[("http", 8080)]);
    let mut cni = mesh.cni().await;
    let status = cni
        .add_pod(aether_proto::cni::v1::AddPodRequest {
            container_id: "sandbox-twin".into(),
            netns_path: frontend.netns_path().to_string_lossy().into(),
            interface_name: "eth0".into(),
            pod: Some(aether_proto::cni::v1::PodRef {
                namespace: "demo".into(),
                name: "twin".into(),
                uid: String::new(),
            }),
            ips: vec![twin.ip().to_string()],
            capture: None,
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::DeadlineExceeded, "{status:?}");
    assert!(status.message().contains("Envoy rejected"), "{status:?}");

    let metrics = mesh.agent_get("/metrics").await;
    let nacks: u64 = metrics
        .lines()
        .find(|l| l.starts_with("aether_agent_xds_nacks_total{type=\"Listener\"}"))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    assert!(nacks >= 1, "no NACK counted:\n{metrics}");
    assert!(
        mesh.agent
            .as_ref()
            .unwrap()
            .logs()
            .contains("Envoy rejected a config push"),
        "the NACK was not logged"
    );
    // The failed pod left nothing behind, and the frontend still reaches its backend.
    assert!(!mesh.agent_get("/debug/pods").await.contains("demo/twin"));
    let reply = eventually(&frontend, "http://127.0.0.1:18081/", Some(&host), |r| r.status == 200).await;
    assert_eq!(served_by(&reply), "backend");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_keeps_serving_while_the_agent_restarts_and_the_agent_recovers_its_pods() {
    let mut mesh = Mesh::start().await;
    let (frontend, _backend, _apps) = mesh.frontend_and_backend().await;
    let host = format!("{}:8080", fqdn("backend"));
    eventually(&frontend, "http://127.0.0.1:18081/", Some(&host), |r| r.status == 200).await;

    mesh.agent.take().unwrap().kill();
    for _ in 0..20 {
        let reply = frontend.http_get("http://127.0.0.1:18081/", Some(&host)).await.unwrap();
        assert_eq!(
            reply.status, 200,
            "a request failed while the agent was down: {reply:?}"
        );
    }

    mesh.start_agent().await;
    let pods = mesh.agent_get("/debug/pods").await;
    assert!(
        pods.contains("demo/frontend") && pods.contains("demo/backend"),
        "{pods}"
    );
    // Envoy reconnects and is served the same config (nothing churns), then changes flow again.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let xds: serde_json::Value = serde_json::from_str(&mesh.agent_get("/debug/xds").await).unwrap();
        let listener = &xds["types"]["type.googleapis.com/envoy.config.listener.v3.Listener"]["outbound|demo/frontend"];
        if listener["acked"] == listener["served"] && !listener["served"].is_null() {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "Envoy did not resync with the restarted agent: {xds}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for _ in 0..10 {
        let reply = frontend.http_get("http://127.0.0.1:18081/", Some(&host)).await.unwrap();
        assert_eq!(reply.status, 200, "{reply:?}");
    }
}

type Cni = aether_proto::cni::v1::cni_plugin_client::CniPluginClient<tonic::transport::Channel>;

/// Asserts `result` is an error with `code` and exactly `message`.
fn assert_refused<T: std::fmt::Debug>(result: Result<T, tonic::Status>, code: tonic::Code, message: &str) {
    let status = result.unwrap_err();
    assert_eq!((status.code(), status.message()), (code, message));
}

/// A change that makes a good ADD bad.
type RequestEdit = fn(&mut AddPodRequest);

/// A valid ADD of `pod` as demo/p in sandbox-1.
fn good_add(pod: &TestPod) -> AddPodRequest {
    AddPodRequest {
        container_id: "sandbox-1".into(),
        netns_path: pod.netns_path().to_string_lossy().into(),
        interface_name: "eth0".into(),
        pod: pod_ref("demo", "p"),
        ips: vec![pod.ip().to_string()],
        capture: None,
    }
}

fn pod_ref(namespace: &str, name: &str) -> Option<PodRef> {
    Some(PodRef {
        namespace: namespace.into(),
        name: name.into(),
        uid: String::new(),
    })
}

fn capture(mesh_dns: String, cidr: String) -> Option<aether_proto::cni::v1::CaptureOptions> {
    Some(aether_proto::cni::v1::CaptureOptions {
        mesh_dns,
        excluded_cidrs: vec![cidr],
        ..Default::default()
    })
}

/// A 1 MiB field value.
fn huge() -> String {
    "a".repeat(1 << 20)
}

/// How a refused huge value is quoted: its first 64 characters.
fn huge_start() -> String {
    format!("{:?}", &huge()[..64])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_cni_call_answers_bad_input_with_the_field_named() {
    let mesh = Mesh::start_with(&["--pod-lookup-timeout", "200ms", "--excluded-namespaces", "kube-system"]).await;
    let pod = mesh.node.add_pod("p");
    let good = good_add(&pod);
    let mut cni = mesh.cni().await;
    bad_adds_are_refused_naming_the_field(&mut cni, &good).await;
    huge_fields_are_refused_with_a_short_message(&mut cni, &good).await;
    unmanaged_and_excluded_pods_are_ignored(&mesh, &mut cni, &good).await;
    a_malformed_upstream_is_reported_and_skipped(&mesh, &mut cni, &good).await;
    check_and_del_name_the_sandbox_and_del_is_idempotent(&mesh, &mut cni).await;
}

async fn bad_adds_are_refused_naming_the_field(cni: &mut Cni, good: &AddPodRequest) {
    use tonic::Code::{InvalidArgument, Unavailable};
    let cases: [(RequestEdit, tonic::Code, &str); 11] = [
        (
            |r| r.container_id = "".into(),
            InvalidArgument,
            "container_id: must be set",
        ),
        (
            |r| r.container_id = "a b".into(),
            InvalidArgument,
            "container_id: \"a b\" is not a container id",
        ),
        (|r| r.netns_path = "".into(), InvalidArgument, "netns_path: must be set"),
        (
            |r| r.netns_path = "relative/ns".into(),
            InvalidArgument,
            "netns_path: \"relative/ns\" is not an absolute path",
        ),
        (
            |r| r.netns_path = "/nonexistent/ns".into(),
            InvalidArgument,
            "netns_path: \"/nonexistent/ns\" does not exist",
        ),
        (|r| r.pod = None, InvalidArgument, "pod: must be set"),
        (
            |r| r.pod = pod_ref("Bad_NS", "p"),
            InvalidArgument,
            "pod.namespace: \"Bad_NS\" is not a DNS-1123 label (lowercase letters, digits and '-')",
        ),
        (
            |r| r.pod = pod_ref("demo", ""),
            InvalidArgument,
            "pod.name: must be 1..=253 characters",
        ),
        (
            |r| r.ips.push("10.0.0.300".into()),
            InvalidArgument,
            "ips[1]: \"10.0.0.300\" is not an IP address",
        ),
        // No IPs given: the agent reads them from the netns (with netlink), so this gets as
        // far as the pod lookup.
        (
            |r| r.ips.clear(),
            Unavailable,
            "pod demo/p is not known to the pod source yet; retry",
        ),
        // Not (yet) known to the pod source: retryable.
        (
            |_| {},
            Unavailable,
            "pod demo/p is not known to the pod source yet; retry",
        ),
    ];
    for (edit, code, message) in cases {
        let mut request = good.clone();
        edit(&mut request);
        assert_refused(cni.add_pod(request).await, code, message);
    }
}

/// 1 MiB fields: refused naming the field, the value quoted by its start and its size,
/// so the status fits in the trailers a default client accepts (16 KiB).
async fn huge_fields_are_refused_with_a_short_message(cni: &mut Cni, good: &AddPodRequest) {
    let start = huge_start();
    let cases: [(RequestEdit, String); 8] = [
        (
            |r| r.container_id = huge(),
            format!("container_id: {start}… (1048576 bytes) is not a container id"),
        ),
        (
            |r| r.netns_path = huge(),
            format!("netns_path: {start}… (1048576 bytes) is not an absolute path"),
        ),
        (
            |r| r.netns_path = format!("/{}", huge()),
            format!(
                "netns_path: {:?}… (1048577 bytes) does not exist",
                &format!("/{}", huge())[..64]
            ),
        ),
        (
            |r| r.pod = pod_ref(&huge(), "p"),
            format!("pod.namespace: {start}… (1048576 bytes) is longer than 63 characters"),
        ),
        (
            |r| r.pod = pod_ref("demo", &huge()),
            "pod.name: must be 1..=253 characters".into(),
        ),
        (
            |r| r.ips = vec![huge()],
            format!("ips[0]: {start}… (1048576 bytes) is not an IP address"),
        ),
        (
            |r| r.capture = capture(huge(), "10.0.0.0/8".into()),
            format!("capture.mesh_dns: {start}… (1048576 bytes) is not an ip:port address"),
        ),
        (
            |r| r.capture = capture("".into(), huge()),
            format!("capture.excluded_cidrs[0]: {start}… (1048576 bytes) is not a CIDR"),
        ),
    ];
    for (edit, message) in cases {
        let mut request = good.clone();
        edit(&mut request);
        let status = cni.add_pod(request).await.unwrap_err();
        assert_eq!(
            (status.code(), status.message()),
            (tonic::Code::InvalidArgument, message.as_str())
        );
        assert!(status.message().len() < 1024);
    }
    huge_container_ids_are_refused_by_del_check_and_gc(cni).await;
}

async fn huge_container_ids_are_refused_by_del_check_and_gc(cni: &mut Cni) {
    let huge_id = format!("container_id: {}… (1048576 bytes) is not a container id", huge_start());
    let del = RemovePodRequest {
        container_id: huge(),
        pod: None,
    };
    assert_refused(cni.remove_pod(del).await, tonic::Code::InvalidArgument, &huge_id);
    let check = CheckPodRequest {
        container_id: huge(),
        ..Default::default()
    };
    assert_refused(cni.check_pod(check).await, tonic::Code::InvalidArgument, &huge_id);
    let gc = aether_proto::cni::v1::GarbageCollectRequest {
        valid_container_ids: vec!["sandbox-1".into(), huge()],
    };
    assert_refused(
        cni.garbage_collect(gc).await,
        tonic::Code::InvalidArgument,
        &format!("valid_container_ids[1]: {huge_id}"),
    );
}

/// demo/p's manifest, unmanaged (no labels) until a test adds them.
fn p_manifest() -> serde_json::Value {
    serde_json::json!({
        "kind": "Pod",
        "metadata": {"name": "p", "namespace": "demo", "labels": {}},
        "spec": {"containers": [{"ports": [{"name": "http", "containerPort": 8080}]}]}
    })
}

/// Unmanaged and excluded pods are IGNORED, not errors.
async fn unmanaged_and_excluded_pods_are_ignored(mesh: &Mesh, cni: &mut Cni, good: &AddPodRequest) {
    std::fs::write(mesh.path("pods/p.json"), p_manifest().to_string()).unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let ignored = loop {
        match cni.add_pod(good.clone()).await {
            Ok(reply) => break reply.into_inner(),
            Err(s) if s.code() == tonic::Code::Unavailable && std::time::Instant::now() < deadline => continue,
            Err(s) => panic!("{s:?}"),
        }
    };
    assert_eq!(ignored.outcome, Outcome::Ignored as i32);
    assert_eq!(
        ignored.message,
        "pod demo/p is not managed (label aether.io/managed=true)"
    );
    let excluded = cni
        .add_pod(AddPodRequest {
            pod: pod_ref("kube-system", "dns"),
            ..good.clone()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(excluded.outcome, Outcome::Ignored as i32);
}

/// A malformed upstream entry is reported and skipped; the pod still joins.
async fn a_malformed_upstream_is_reported_and_skipped(mesh: &Mesh, cni: &mut Cni, good: &AddPodRequest) {
    let mut manifest = p_manifest();
    manifest["metadata"]["labels"] = serde_json::json!({"aether.io/managed": "true"});
    // Also one of 1 MiB: reported by its start and its size.
    manifest["metadata"]["annotations"] =
        serde_json::json!({"config.aether.io/upstreams": format!("backend, Not_Valid, {}", huge())});
    std::fs::write(mesh.path("pods/p.json"), manifest.to_string()).unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        match cni.add_pod(good.clone()).await {
            Ok(reply) if reply.get_ref().outcome == Outcome::Success as i32 => break,
            Ok(_) if std::time::Instant::now() < deadline => tokio::time::sleep(Duration::from_millis(50)).await,
            other => panic!("{other:?}"),
        }
    }
    let pods: serde_json::Value = serde_json::from_str(&mesh.agent_get("/debug/pods").await).unwrap();
    let p = &pods["pods"][0];
    assert_eq!(p["upstreams"], serde_json::json!(["demo/backend"]));
    let start = huge_start();
    assert_eq!(
        p["config_errors"],
        serde_json::json!([
            "config.aether.io/upstreams[1]: \"Not_Valid\": \"Not_Valid\" is not a DNS-1123 label (lowercase letters, digits and '-')",
            format!(
                "config.aether.io/upstreams[2]: {start}… (1048576 bytes): {start}… (1048576 bytes) is longer than 63 characters"
            ),
        ])
    );

    let metrics = mesh.agent_get("/metrics").await;
    assert!(
        metrics.lines().any(|l| l == "aether_agent_pod_config_errors 2"),
        "{metrics}"
    );
}

/// CHECK and DEL.
async fn check_and_del_name_the_sandbox_and_del_is_idempotent(mesh: &Mesh, cni: &mut Cni) {
    let check = |container_id: &str| CheckPodRequest {
        container_id: container_id.into(),
        ..Default::default()
    };
    cni.check_pod(check("sandbox-1")).await.unwrap();
    assert_refused(
        cni.check_pod(check("missing")).await,
        tonic::Code::NotFound,
        "container_id: sandbox missing is not in the mesh",
    );
    assert_refused(
        cni.remove_pod(RemovePodRequest::default()).await,
        tonic::Code::InvalidArgument,
        "container_id: must be set",
    );
    for _ in 0..2 {
        let removed = cni
            .remove_pod(RemovePodRequest {
                container_id: "sandbox-1".into(),
                pod: None,
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(removed.outcome, Outcome::Success as i32, "DEL must be idempotent");
    }
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&mesh.agent_get("/debug/pods").await).unwrap()["pods"],
        serde_json::json!([])
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn state_of_the_world_ads_serves_the_same_mesh() {
    let mesh = Mesh::start_sotw().await;
    let (frontend, _backend, _apps) = mesh.frontend_and_backend().await;
    let host = format!("{}:8080", fqdn("backend"));
    let reply = eventually(&frontend, "http://127.0.0.1:18081/sotw", Some(&host), |r| {
        r.status == 200
    })
    .await;
    assert_eq!(served_by(&reply), "backend");
    let dump = mesh.envoy().admin_get("/config_dump");
    assert!(dump.contains("outbound|demo/frontend"), "listeners missing over SotW");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_terminating_pod_drains_then_leaves_the_catalog() {
    let mesh = Mesh::start().await;
    let (_frontend, backend, _apps) = mesh.frontend_and_backend().await;
    let health = || async {
        let mut registrar = mesh.registrar().await;
        registrar
            .list_endpoints(aether_proto::registrar::v1::ListEndpointsRequest {
                service: "demo/backend".into(),
            })
            .await
            .unwrap()
            .into_inner()
            .endpoints
            .iter()
            .map(|e| e.health)
            .collect::<Vec<_>>()
    };
    assert_eq!(health().await, [aether_proto::registry::v1::Health::Healthy as i32]);
    mesh.describe_terminating_pod(&backend, "backend", "backend", &[("http", 8080)]);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while health().await != [aether_proto::registry::v1::Health::Draining as i32] {
        assert!(
            std::time::Instant::now() < deadline,
            "the endpoint never drained: {:?}",
            health().await
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    mesh.remove_pod(&backend, "backend").await.unwrap();
    assert_eq!(health().await, Vec::<i32>::new());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_tcp_to_a_declared_service_vip_is_captured_and_delivered() {
    let mesh = Mesh::start().await;
    let client = mesh.node.add_pod("client");
    let cache = mesh.node.add_pod("cache");
    let _app = cache.serve_tcp_echo("127.0.0.1:6379".parse().unwrap());
    mesh.describe_pod(&client, "client", "client", "cache", &[]);
    mesh.describe_pod(&cache, "cache", "cache", "", &[("redis", 6379)]);
    for (pod, name) in [(&cache, "cache"), (&client, "client")] {
        let added = mesh
            .add_pod(pod, name)
            .await
            .unwrap_or_else(|s| panic!("AddPod {name}: {s:?}"));
        assert_eq!(added.outcome, aether_proto::cni::v1::Outcome::Success as i32);
    }
    capture_vips(&client);
    let vip = mesh.vip("cache").await;
    let target: std::net::SocketAddr = format!("{vip}:6379").parse().unwrap();
    let echoed = client.run(move || {
        use std::io::{BufRead, BufReader, Write};
        let stream = std::net::TcpStream::connect_timeout(&target, Duration::from_secs(5))?;
        stream.set_read_timeout(Some(Duration::from_secs(5)))?;
        let mut reader = BufReader::new(stream.try_clone()?);
        let mut greeting = String::new();
        reader.read_line(&mut greeting)?;
        (&stream).write_all(b"ping\n")?;
        let mut echo = String::new();
        reader.read_line(&mut echo)?;
        Ok::<_, std::io::Error>((greeting, echo))
    });
    let (greeting, echo) = echoed.expect("TCP through the mesh");
    // The cache pod's own server answered, inside its netns, on its loopback port.
    assert_eq!(greeting, "cache\n");
    assert_eq!(echo, "ping\n");
}

/// Resources and encoded bytes the agent has pushed to Envoy so far, by xDS type.
async fn pushed(mesh: &Mesh) -> std::collections::BTreeMap<String, (u64, u64)> {
    let text = mesh.agent_get("/metrics").await;
    let mut by_type = std::collections::BTreeMap::<String, (u64, u64)>::new();
    for line in text.lines() {
        for (metric, bytes) in [
            ("aether_agent_xds_resources_pushed_total{type=\"", false),
            ("aether_agent_xds_pushed_bytes_total{type=\"", true),
        ] {
            if let Some(rest) = line.strip_prefix(metric) {
                let (kind, value) = rest.split_once("\"} ").expect("a counter sample");
                let entry = by_type.entry(kind.to_owned()).or_default();
                let value: u64 = value.parse().expect("a counter value");
                if bytes { entry.1 = value } else { entry.0 = value }
            }
        }
    }
    by_type
}

/// Envoy's dynamic clusters with the version it holds of each.
fn cluster_versions(mesh: &Mesh) -> std::collections::BTreeMap<String, String> {
    let dump = mesh.envoy().config_dump();
    let mut versions = std::collections::BTreeMap::new();
    for config in dump["configs"].as_array().into_iter().flatten() {
        for c in config["dynamic_active_clusters"].as_array().into_iter().flatten() {
            versions.insert(
                c["cluster"]["name"].as_str().unwrap_or_default().to_owned(),
                c["version_info"].as_str().unwrap_or_default().to_owned(),
            );
        }
    }
    versions
}

fn print_pushed(
    what: &str,
    before: &std::collections::BTreeMap<String, (u64, u64)>,
    after: &std::collections::BTreeMap<String, (u64, u64)>,
) {
    let mut line = format!("{what}:");
    for (kind, (resources, bytes)) in after {
        let (r0, b0) = before.get(kind).copied().unwrap_or_default();
        if resources > &r0 {
            line += &format!(" {kind} {} ({} B)", resources - r0, bytes - b0);
        }
    }
    eprintln!("{line}");
}

/// Node cost O(pods + dependencies): a pod whose upstreams already exist brings its own resources and changes no
/// cluster Envoy already holds; removing it leaves no trace of it in anything Envoy is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_with_existing_upstreams_pushes_only_its_own_resources_and_leaves_no_trace() {
    let mesh = Mesh::start().await;
    let (frontend, _backend, _apps) = mesh.frontend_and_backend().await;
    // Settled: the frontend's own service is known once its registration came back from the registrar. No one
    // here calls it, so Envoy holds no cluster of it (and its endpoints' changes push nothing).
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let deps: serde_json::Value = serde_json::from_str(&mesh.agent_get("/debug/dependencies").await).unwrap();
        let has = |field: &str| {
            deps[field]
                .as_array()
                .is_some_and(|a| a.iter().any(|s| s == "demo/frontend"))
        };
        if has("known") {
            assert!(has("own_only"), "demo/frontend is not own-only: {deps}");
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "demo/frontend never known: {deps}"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let own = format!("{}:8080", fqdn("frontend"));
    assert!(
        !cluster_versions(&mesh).contains_key(&own),
        "{own} is served though no one calls it"
    );
    let clusters_before = cluster_versions(&mesh);
    let before = pushed(&mesh).await;

    let extra = mesh.node.add_pod("frontend-2");
    let _app = extra.serve_http(APP.parse().unwrap(), "frontend-2");
    mesh.describe_pod(&extra, "frontend-2", "frontend", "backend", &[("http", 8080)]);
    mesh.add_pod_ok(&extra, "frontend-2").await;
    let after = pushed(&mesh).await;
    print_pushed("AddPod with existing upstreams pushed", &before, &after);
    let clusters_after = cluster_versions(&mesh);
    for (name, version) in &clusters_before {
        assert_eq!(
            clusters_after.get(name),
            Some(version),
            "AddPod re-pushed the existing cluster {name}"
        );
    }
    let added: Vec<&String> = clusters_after
        .keys()
        .filter(|n| !clusters_before.contains_key(*n))
        .collect();
    assert_eq!(added, ["local|demo/frontend-2|8080", "originate|demo/frontend-2"]);
    // Only those two clusters travelled: per pod a constant number of resources.
    assert_eq!(after["Cluster"].0 - before["Cluster"].0, 2, "{before:?} → {after:?}");

    // Removal withdraws those two and changes no other cluster.
    let before = pushed(&mesh).await;
    let removed = mesh.remove_pod(&extra, "frontend-2").await.expect("RemovePod");
    assert_eq!(removed.outcome, aether_proto::cni::v1::Outcome::Success as i32);
    let after = pushed(&mesh).await;
    print_pushed("RemovePod pushed", &before, &after);
    assert_eq!(after["Cluster"].0 - before["Cluster"].0, 2, "{before:?} → {after:?}");
    assert_eq!(
        cluster_versions(&mesh),
        clusters_before,
        "RemovePod changed another cluster"
    );
    let xds = mesh.agent_get("/debug/xds").await;
    assert!(
        !xds.contains("frontend-2"),
        "the agent still serves a resource of the removed pod: {xds}"
    );
    let ip = extra.ip().to_string();
    let dump = mesh.envoy().config_dump();
    for config in dump["configs"].as_array().into_iter().flatten() {
        // (Its secret stays in Envoy while its removed listeners drain; the agent serves it no more.)
        for key in ["dynamic_active_clusters", "dynamic_endpoint_configs"] {
            let text = config[key].to_string();
            assert!(
                !text.contains("frontend-2") && !text.contains(&format!("\"{ip}\"")),
                "Envoy still holds {key} of the removed pod"
            );
        }
        for listener in config["dynamic_listeners"].as_array().into_iter().flatten() {
            if listener.get("active_state").is_some() {
                assert!(!listener["name"].as_str().unwrap_or_default().contains("frontend-2"));
            }
        }
    }

    // The frontend calling its own service, undeclared, by its VIP (captured): its virtual host routes and
    // the cluster is looked up on demand, with mTLS as any other.
    let url = format!("http://{}:8080/", mesh.vip("frontend").await);
    let reply = frontend
        .http_request("GET", &url, None, &[], "")
        .await
        .expect("own service by VIP");
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert!(reply.body.contains("\"pod\":\"frontend\""), "{}", reply.body);
    assert!(
        cluster_versions(&mesh).contains_key(&own),
        "{own} was not looked up on demand"
    );
}
