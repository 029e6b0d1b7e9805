//! `aether-controller`, the real binary over HTTPS, called as kube-apiserver calls its
//! webhooks: the mutating pod webhook's JSON Patch (base64, applied idempotently), the
//! validating webhook's refusal naming the field, what is not a review, and the counts on
//! its admin address.

use aether_tests::controller::{Controller, admission_review};
use aether_tests::http_get;
use base64::Engine;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const POD: (&str, &str, &str) = ("", "v1", "Pod");
const POLICY: (&str, &str, &str) = ("security.aether.io", "v1alpha1", "AuthorizationPolicy");
const FILTER: (&str, &str, &str) = ("networking.aether.io", "v1alpha1", "HTTPFilter");
const MESH_CONFIG: (&str, &str, &str) = ("mesh.aether.io", "v1alpha1", "MeshConfig");

fn patch_of(answer: &Value) -> Value {
    let encoded = answer["response"]["patch"].as_str().expect("a base64 patch");
    let bytes = base64::engine::general_purpose::STANDARD.decode(encoded).unwrap();
    serde_json::from_slice(&bytes).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_pod_in_a_mesh_namespace_is_labelled_managed_and_gets_the_mesh_dns() {
    let controller = Controller::start(&["--mesh-domain", "mesh.test"]).await;
    let mut connection = controller.connect().await;
    let pod = json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"generateName": "web-", "namespace": "shop", "labels": {"app": "web"}},
        "spec": {"containers": [{"name": "web", "image": "web:1"}]}
    });
    let review = admission_review("CREATE", POD, &pod);
    let answer = connection.review("/mutate/pods", &review).await;
    assert_eq!(answer["apiVersion"], "admission.k8s.io/v1");
    assert_eq!(answer["response"]["uid"], review["request"]["uid"]);
    assert_eq!(answer["response"]["allowed"], true);
    assert_eq!(answer["response"]["patchType"], "JSONPatch");
    assert_eq!(
        patch_of(&answer),
        json!([
            {"op": "add", "path": "/metadata/labels/aether.io~1managed", "value": "true"},
            {"op": "add", "path": "/spec/dnsConfig", "value": {
                "searches": ["shop.mesh.test", "mesh.test"],
                "options": [{"name": "ndots", "value": "3"}]
            }}
        ])
    );
    // The pod as stored after the patch: asked again, nothing to add.
    let mut mutated = pod.clone();
    mutated["metadata"]["labels"]["aether.io/managed"] = json!("true");
    mutated["spec"]["dnsConfig"] =
        json!({"searches": ["shop.mesh.test", "mesh.test"], "options": [{"name": "ndots", "value": "3"}]});
    let again = connection
        .review("/mutate/pods", &admission_review("CREATE", POD, &mutated))
        .await;
    assert_eq!(again["response"]["allowed"], true);
    assert!(again["response"].get("patch").is_none(), "{again}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn objects_are_validated_with_the_projectors_verdicts_and_counted() {
    let controller = Controller::start(&[]).await;
    let mut connection = controller.connect().await;
    let policy = json!({
        "apiVersion": "security.aether.io/v1alpha1", "kind": "AuthorizationPolicy",
        "metadata": {"name": "p", "namespace": "shop"},
        "spec": {"action": "AUDIT", "dryRun": true}
    });
    let answer = connection
        .review("/validate", &admission_review("CREATE", POLICY, &policy))
        .await;
    assert_eq!(answer["response"]["allowed"], false, "{answer}");
    assert_eq!(answer["response"]["status"]["code"], 403);
    let message = answer["response"]["status"]["message"].as_str().unwrap();
    assert!(
        message.starts_with("AuthorizationPolicy refused: spec.dryRun: "),
        "{message}"
    );

    let filter = json!({
        "apiVersion": "networking.aether.io/v1alpha1", "kind": "HTTPFilter",
        "metadata": {"name": "limit", "namespace": "shop"},
        "spec": {"targetRefs": [{"kind": "Service", "name": "orders"}],
                 "localRateLimit": {"maxTokens": 100, "fillInterval": "1s"}}
    });
    let answer = connection
        .review("/validate", &admission_review("UPDATE", FILTER, &filter))
        .await;
    assert_eq!(answer["response"]["allowed"], true, "{answer}");

    let pod = json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "web", "namespace": "shop",
        "annotations": {"config.aether.io/upstreams": "Cart"}}, "spec": {}});
    let answer = connection
        .review("/validate", &admission_review("CREATE", POD, &pod))
        .await;
    let message = answer["response"]["status"]["message"].as_str().unwrap();
    assert!(
        message.starts_with("Pod refused: config.aether.io/upstreams[0]: "),
        "{message}"
    );

    // MeshConfig: a namespace's override passes; a mesh domain there is refused with why.
    let config = |spec: serde_json::Value| {
        json!({"apiVersion": "mesh.aether.io/v1alpha1", "kind": "MeshConfig",
               "metadata": {"name": "default", "namespace": "shop"}, "spec": spec})
    };
    let review = admission_review(
        "CREATE",
        MESH_CONFIG,
        &config(json!({"authorization": {"defaultAction": "DENY"}})),
    );
    let answer = connection.review("/validate", &review).await;
    assert_eq!(answer["response"]["allowed"], true, "{answer}");
    let review = admission_review("UPDATE", MESH_CONFIG, &config(json!({"meshDomain": "corp.internal"})));
    let answer = connection.review("/validate", &review).await;
    let message = answer["response"]["status"]["message"].as_str().unwrap();
    assert!(
        message.starts_with("MeshConfig refused: spec.meshDomain: is mesh-wide: set it in the MeshConfig of the mesh root namespace \"aether-system\""),
        "{message}"
    );

    let metrics = http_get(&format!("http://{}/metrics", controller.admin), None)
        .await
        .unwrap();
    let text = metrics.body;
    for line in [
        "aether_controller_admission_reviews_total{webhook=\"validate\",verdict=\"deny\"} 3",
        "aether_controller_admission_reviews_total{webhook=\"validate\",verdict=\"allow\"} 2",
    ] {
        assert!(text.contains(line), "{line} in:\n{text}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_is_not_a_review_is_answered_plainly_and_the_server_keeps_serving() {
    let controller = Controller::start(&[]).await;
    let mut connection = controller.connect().await;
    assert_eq!(connection.send("GET", "/validate", Vec::new()).await.0, 405);
    assert_eq!(connection.send("POST", "/elsewhere", Vec::new()).await.0, 404);
    let (status, body) = connection.send("POST", "/validate", b"{\"kind\": 7}".to_vec()).await;
    assert_eq!(status, 200);
    let answer: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(answer["response"]["allowed"], false);
    let message = answer["response"]["status"]["message"].as_str().unwrap();
    assert!(
        message.contains("is not an AdmissionReview: kind: invalid type"),
        "{message}"
    );
    // A body declared larger than 8 MiB is refused before it is read.
    let mut tls = controller.tls().await;
    let head =
        "POST /validate HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 9437184\r\n\r\n";
    tls.write_all(head.as_bytes()).await.unwrap();
    let mut answer = vec![0; 64];
    let read = tls.read(&mut answer).await.unwrap();
    let answer = String::from_utf8_lossy(&answer[..read]);
    assert!(answer.starts_with("HTTP/1.1 413 "), "{answer}");
    // Still serving.
    let pod = json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "web", "namespace": "shop"}, "spec": {}});
    let answer = controller
        .connect()
        .await
        .review("/validate", &admission_review("CREATE", POD, &pod))
        .await;
    assert_eq!(answer["response"]["allowed"], true);
}

/// With `--follow-mesh-config`, new pods search the mesh-wide MeshConfig's mesh domain: the
/// install-time one until it sets one, the new one once it does, the last accepted one while
/// an edit is refused, the install-time one again once it is deleted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_pods_search_the_mesh_domain_the_mesh_wide_mesh_config_sets() {
    use aether_api::mesh_config::MeshConfig;
    let api = aether_fakes::kube::ApiServer::start();
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = api.write_kubeconfig(dir.path());
    let env = [("KUBECONFIG", kubeconfig.to_str().unwrap())];
    let controller = Controller::start_with(&["--follow-mesh-config"], &env).await;
    let mut connection = controller.connect().await;
    let pod = json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "web", "namespace": "shop", "labels": {"aether.io/managed": "true"}}, "spec": {}});
    let review = admission_review("CREATE", POD, &pod);
    let mut searches = async || {
        let answer = connection.review("/mutate/pods", &review).await;
        patch_of(&answer)[0]["value"]["searches"].clone()
    };
    assert_eq!(searches().await, json!(["shop.aether.internal", "aether.internal"]));

    let mesh = |domain: &str| {
        json!({"apiVersion": "mesh.aether.io/v1alpha1", "kind": "MeshConfig",
               "metadata": {"name": "default", "namespace": "aether-system"}, "spec": {"meshDomain": domain}})
    };
    // Another namespace's MeshConfig never sets it.
    api.apply::<MeshConfig>(json!({"apiVersion": "mesh.aether.io/v1alpha1", "kind": "MeshConfig",
        "metadata": {"name": "default", "namespace": "shop"}, "spec": {"meshDomain": "shop.internal"}}));
    api.apply::<MeshConfig>(mesh("corp.internal"));
    until("new pods search corp.internal", async || {
        searches().await == json!(["shop.corp.internal", "corp.internal"])
    })
    .await;
    // Refused (one label): the last accepted domain stays.
    api.apply::<MeshConfig>(mesh("corp"));
    until("the refusal logged", async || {
        controller.child.logs().contains("the mesh-wide MeshConfig is refused")
    })
    .await;
    assert!(
        controller.child.logs().contains("\"corp\" has one label"),
        "{}",
        controller.child.logs()
    );
    assert_eq!(searches().await, json!(["shop.corp.internal", "corp.internal"]));
    api.delete::<MeshConfig>("aether-system", "default");
    until("back to the install-time domain", async || {
        searches().await == json!(["shop.aether.internal", "aether.internal"])
    })
    .await;
    let watches = api
        .requests()
        .iter()
        .filter(|r| r.contains("meshconfigs"))
        .cloned()
        .collect::<Vec<_>>();
    assert!(
        watches
            .iter()
            .all(|r| r.contains("/namespaces/aether-system/meshconfigs")),
        "the controller reads the root namespace's MeshConfig alone: {watches:?}"
    );
}

/// A Node named `name`, with the readiness taint or not.
fn node(name: &str, tainted: bool) -> Value {
    let taints = match tainted {
        true => json!([{"key": "dedicated", "value": "gpu", "effect": "NoSchedule"},
                       {"key": "aether.io/agent-not-ready", "effect": "NoSchedule"}]),
        false => json!([{"key": "dedicated", "value": "gpu", "effect": "NoSchedule"}]),
    };
    json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}, "spec": {"taints": taints}})
}

/// The agent pod on `node`, Ready or not.
fn agent_pod(node: &str, ready: bool) -> Value {
    json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": format!("aether-agent-{node}"), "namespace": "aether-system",
                     "labels": {"app.kubernetes.io/component": "agent"}},
        "spec": {"nodeName": node, "containers": [{"name": "agent", "image": "aether"}]},
        "status": {"conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}]}})
}

/// Waits until `check` holds (15 s at most), naming `what` on failure.
async fn until(what: &str, mut check: impl AsyncFnMut() -> bool) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(15);
    while !check().await {
        assert!(std::time::Instant::now() < deadline, "never: {what}");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

/// Two controllers on one Lease: exactly one leads; it taints the node whose agent is gone past
/// the grace (once: no double writes) and untaints it when the agent is back; killed, the other
/// takes the Lease over within its duration and carries on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_leader_keeps_the_node_readiness_taint_and_a_successor_takes_over() {
    use k8s_openapi::api::coordination::v1::Lease;
    use k8s_openapi::api::core::v1::{Node, Pod};
    let api = aether_fakes::kube::ApiServer::start();
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = api.write_kubeconfig(dir.path());
    for name in ["node-a", "node-b"] {
        api.apply::<Node>(node(name, false));
    }
    api.apply::<Pod>(agent_pod("node-a", true));
    let env = [("KUBECONFIG", kubeconfig.to_str().unwrap())];
    let args = |me: &'static str| {
        [
            "--node-taints",
            "--namespace",
            "aether-system",
            "--lease-duration",
            "3s",
        ]
        .into_iter()
        .chain(["--node-taint-grace", "1s", "--identity", me])
        .collect::<Vec<_>>()
    };
    let mut controllers = vec![
        Controller::start_with(&args("one"), &env).await,
        Controller::start_with(&args("two"), &env).await,
    ];
    let client = api.client();
    let (leases, nodes) = (
        kube::Api::<Lease>::namespaced(client.clone(), "aether-system"),
        kube::Api::<Node>::all(client),
    );
    let tainted = async |name: &str| {
        let node = nodes.get(name).await.unwrap();
        let taints = node.spec.unwrap().taints.unwrap_or_default();
        assert!(taints.iter().any(|t| t.key == "dedicated"), "other taints are kept");
        taints.iter().any(|t| t.key == "aether.io/agent-not-ready")
    };
    until("node-b (no agent) tainted", async || tainted("node-b").await).await;
    assert!(!tainted("node-a").await, "node-a's agent is Ready");
    let holder = async || {
        leases
            .get("aether-controller")
            .await
            .unwrap()
            .spec
            .unwrap()
            .holder_identity
            .unwrap()
    };
    let leader = holder().await;
    assert!(leader == "one" || leader == "two", "{leader}");
    let patches = |name: &str| {
        api.requests()
            .iter()
            .filter(|r| r.starts_with("PATCH") && r.contains(name))
            .count()
    };
    tokio::time::sleep(std::time::Duration::from_secs(3)).await;
    assert_eq!(patches("/nodes/node-b"), 1, "one write, by one leader");
    assert_eq!(holder().await, leader, "the leader renews");

    api.apply::<Pod>(agent_pod("node-b", true));
    until("node-b untainted once its agent is Ready", async || {
        !tainted("node-b").await
    })
    .await;

    // The leader dies: the other takes the Lease over, and keeps the taints.
    let index = if leader == "one" { 0 } else { 1 };
    drop(controllers.remove(index));
    let killed = std::time::Instant::now();
    let successor = if leader == "one" { "two" } else { "one" };
    until("the successor holds the Lease", async || holder().await == successor).await;
    // Bounded by the lease (3 s) since its last renewal, plus the successor's look every third of it (1 s),
    // plus slack for a loaded machine.
    let failover = killed.elapsed();
    assert!(
        failover < std::time::Duration::from_secs(6),
        "failover took {failover:?}"
    );
    api.apply::<Pod>(agent_pod("node-a", false));
    until("node-a tainted by the successor", async || tainted("node-a").await).await;
}
