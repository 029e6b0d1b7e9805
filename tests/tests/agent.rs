//! `aether-agent run` end to end: real registrar, real Envoy fed over the agent's xDS
//! socket, pods as network namespaces added through the CNI gRPC API.

use std::collections::BTreeSet;
use std::time::Duration;

use aether_tests::mesh::{Mesh, fqdn};
use aether_tests::{HttpReply, TestPod};

const APP: &str = "127.0.0.1:8080";

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

    for (pod, name) in [(&backend1, "backend-1"), (&frontend, "frontend")] {
        let added = mesh
            .add_pod(pod, name)
            .await
            .unwrap_or_else(|s| panic!("AddPod {name}: {s:?}\nagent:\n{}", mesh.agent.as_ref().unwrap().logs()));
        assert_eq!(
            added.outcome,
            aether_proto::cni::v1::Outcome::Success as i32,
            "{added:?}"
        );
    }

    // By name through the explicit outbound listener, from inside the frontend pod.
    let host = format!("{}:8080", fqdn("backend"));
    let reply = eventually(&frontend, "http://127.0.0.1:18081/hello", Some(&host), |r| {
        r.status == 200
    })
    .await;
    assert_eq!(served_by(&reply), "backend-1");
    assert_eq!(reply.json()["path"], "/hello");
    assert!(
        reply.json()["headers"].get("x-aether-port").is_none(),
        "the port header leaked to the app"
    );

    // Envoy holds clusters for exactly the dependency set (backend and frontend's own service).
    let mesh_clusters = || -> BTreeSet<String> {
        mesh.envoy_clusters()
            .into_iter()
            .filter(|c| !c.starts_with("local|"))
            .collect()
    };
    let expected: BTreeSet<String> = [
        fqdn("backend"),
        format!("{}:8080", fqdn("backend")),
        fqdn("frontend"),
        format!("{}:8080", fqdn("frontend")),
    ]
    .into();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while mesh_clusters() != expected && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(mesh_clusters(), expected);

    // A second replica gets traffic too.
    let added = mesh.add_pod(&backend2, "backend-2").await.unwrap();
    assert_eq!(added.outcome, aether_proto::cni::v1::Outcome::Success as i32);
    let mut seen = BTreeSet::new();
    for _ in 0..40 {
        let reply = eventually(&frontend, "http://127.0.0.1:18081/", Some(&host), |r| r.status == 200).await;
        seen.insert(served_by(&reply));
        if seen.len() == 2 {
            break;
        }
    }
    assert_eq!(seen, BTreeSet::from(["backend-1".to_string(), "backend-2".to_string()]));

    // Removing it takes it out of rotation.
    mesh.remove_pod(&backend2, "backend-2").await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    for _ in 0..10 {
        let reply = eventually(&frontend, "http://127.0.0.1:18081/", Some(&host), |r| r.status == 200).await;
        assert_eq!(served_by(&reply), "backend-1");
    }

    // The VIP, captured inside the frontend's netns, reaches the service too.
    let services = mesh.agent_get("/debug/dependencies").await;
    assert!(services.contains("demo/backend"), "{services}");
    let catalog: serde_json::Value = serde_json::from_str(&mesh.agent_get("/debug/xds").await).unwrap();
    assert!(catalog["serial"].as_u64().unwrap() > 0);
}
