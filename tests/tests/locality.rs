//! Locality end to end: a Service's `trafficDistribution: PreferSameNode` (applied to the fake Kubernetes API
//! server, read by the registrar's `--from-kubernetes` into the mesh service) keeps a pod's calls on its own
//! node's endpoint while that one can answer, fails over to another node's when the local pod is removed or stops
//! answering, and comes back.
//!
//! The other node is a stand-in: an endpoint registered at the registrar as node `node-b`'s agent, at a real pod
//! netns on this machine whose port 18008 (where a node's Envoy accepts mesh traffic) an echo serves directly. That
//! needs plaintext between pods (`--identity none`): with mTLS the stand-in would have to terminate the mesh's TLS
//! with an SVID of its own.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use aether_proto::registrar::v1::RegisterEndpointRequest;
use aether_proto::registry::v1::{Endpoint, Health, Locality, PodInfo, Port, Protocol};
use aether_tests::echo::{EchoIdentity, EchoLedger, EchoServer, serve_echo};
use aether_tests::gamma::kubernetes_service;
use aether_tests::mesh::{MESH_DOMAIN, Mesh, MeshIdentity, NAMESPACE, NodeIdentity};
use aether_tests::netns::TestPod;
use k8s_openapi::api::core::v1::Service;

const OTHER_NODE: &str = "node-b";
const CLUSTER_IP: &str = "10.96.9.10";
/// Where a node's Envoy accepts mesh traffic (the stand-in's echo listens there instead).
const INBOUND_PORT: u16 = 18008;
/// Answers in a row from one pod that make a preference settled.
const IN_A_ROW: usize = 20;

/// One node with a client and a local echo pod, and an echo pod of `node-b` registered directly.
struct TwoNodes {
    local_echo: Option<EchoServer>,
    _remote_echo: EchoServer,
    client: TestPod,
    local: TestPod,
    _remote: TestPod,
    vip: String,
    mesh: Mesh,
}

impl TwoNodes {
    async fn start() -> TwoNodes {
        let mesh = Mesh::start_node_identity(
            MeshIdentity::Plaintext,
            NodeIdentity::Bootstrap,
            &[],
            &["--from-kubernetes"],
        )
        .await;
        mesh.control_plane
            .kube
            .apply::<Service>(kubernetes_service("echo", CLUSTER_IP, None));
        let local = mesh.node.add_pod("echo-local");
        let local_echo = serve_echo(
            &local,
            ([0, 0, 0, 0], 80).into(),
            who("echo-local"),
            EchoLedger::default(),
        );
        mesh.describe_pod(&local, "echo-local", "echo", "", &[("http", 80)]);
        mesh.add_pod_ok(&local, "echo-local").await;
        let remote = mesh.node.add_pod("echo-remote");
        let remote_addr = SocketAddr::from(([0, 0, 0, 0], INBOUND_PORT));
        let remote_echo = serve_echo(&remote, remote_addr, who("echo-remote"), EchoLedger::default());
        register_on_other_node(&mesh, &remote).await;
        let client = mesh.node.add_pod("client");
        mesh.describe_pod(&client, "client", "client", "echo", &[("http", 8080)]);
        mesh.add_pod_ok(&client, "client").await;
        let vip = mesh.vip("echo").await;
        TwoNodes {
            local_echo: Some(local_echo),
            _remote_echo: remote_echo,
            client,
            local,
            _remote: remote,
            vip,
            mesh,
        }
    }

    /// The pod that answered one GET to echo's VIP, or why none did.
    async fn answer(&self) -> String {
        let url = format!("http://{}:80/", self.vip);
        let host = format!("echo.{NAMESPACE}.{MESH_DOMAIN}");
        match self.client.http_request("GET", &url, Some(&host), &[], "").await {
            Ok(reply) if reply.status == 200 => {
                let body: serde_json::Value = serde_json::from_str(&reply.body).unwrap_or_default();
                body["pod"].as_str().unwrap_or("no pod in the answer").to_owned()
            }
            Ok(reply) => format!("status {}", reply.status),
            Err(e) => format!("no answer: {e}"),
        }
    }

    /// Answers to `n` requests, counted by pod.
    async fn count(&self, n: usize) -> BTreeMap<String, usize> {
        let mut counts = BTreeMap::new();
        for _ in 0..n {
            *counts.entry(self.answer().await).or_default() += 1;
        }
        counts
    }

    /// Waits until [`IN_A_ROW`] answers in a row come from `pod`, within `deadline`.
    async fn settle_on(&self, pod: &str, deadline: Duration, what: &str) {
        self.settle(pod, deadline, what, false).await;
    }

    /// As [`TwoNodes::settle_on`], and meanwhile every call is answered by one of echo's pods: none is lost.
    async fn settle_on_losing_none(&self, pod: &str, deadline: Duration, what: &str) {
        self.settle(pod, deadline, what, true).await;
    }

    async fn settle(&self, pod: &str, deadline: Duration, what: &str, losing_none: bool) {
        let until = Instant::now() + deadline;
        let (mut in_a_row, mut calls) = (0, 0);
        while in_a_row < IN_A_ROW {
            let got = self.answer().await;
            calls += 1;
            in_a_row = if got == pod { in_a_row + 1 } else { 0 };
            let logs = || self.mesh.agent.as_ref().map(|a| a.logs()).unwrap_or_default();
            assert!(
                !losing_none || got == "echo-local" || got == "echo-remote",
                "{what}: call {calls} lost ({got})\n{}",
                logs()
            );
            assert!(
                Instant::now() < until,
                "{what}: no {IN_A_ROW} answers in a row from {pod} within {deadline:?} (last: {got})\n{}",
                logs()
            );
        }
    }

    fn set_traffic_distribution(&self, traffic: Option<&str>) {
        let service = kubernetes_service("echo", CLUSTER_IP, traffic);
        self.mesh.control_plane.kube.apply::<Service>(service);
    }
}

fn who(pod: &str) -> EchoIdentity {
    EchoIdentity {
        pod: pod.into(),
        namespace: NAMESPACE.into(),
        service: "echo".into(),
    }
}

/// Registers `pod` as an endpoint of echo on node `node-b`, in this node's zone, as that node's agent would.
async fn register_on_other_node(mesh: &Mesh, pod: &TestPod) {
    let endpoint = Endpoint {
        service: format!("{NAMESPACE}/echo"),
        address: pod.ip().to_string(),
        ports: vec![Port {
            name: "http".into(),
            port: 80,
            protocol: Protocol::Http as i32,
        }],
        locality: Some(Locality {
            region: "r1".into(),
            zone: "z1".into(),
            subzone: String::new(),
        }),
        weight: 1,
        health: Health::Healthy as i32,
        metadata: Default::default(),
        pod: Some(PodInfo {
            namespace: NAMESPACE.into(),
            name: "echo-remote".into(),
            uid: "uid-echo-remote".into(),
            service_account: "echo".into(),
        }),
        node: OTHER_NODE.into(),
    };
    let mut client = mesh.registrar_as(OTHER_NODE).await;
    let request = RegisterEndpointRequest {
        endpoint: Some(endpoint),
    };
    client
        .register_endpoint(request)
        .await
        .expect("RegisterEndpoint as node-b");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefer_same_node_keeps_calls_local_and_fails_over_to_another_node_and_back() {
    let mut node = TwoNodes::start().await;
    // Without a preference both nodes' endpoints share the calls (same zone: one priority).
    let until = Instant::now() + Duration::from_secs(20);
    loop {
        let counts = node.count(40).await;
        if counts.contains_key("echo-local") && counts.contains_key("echo-remote") {
            break;
        }
        assert!(Instant::now() < until, "no spread over both nodes: {counts:?}");
    }
    node.set_traffic_distribution(Some("PreferSameNode"));
    node.settle_on("echo-local", Duration::from_secs(20), "PreferSameNode")
        .await;
    assert_eq!(node.count(40).await, BTreeMap::from([("echo-local".to_owned(), 40)]));

    removed_and_back(&node).await;
    failing_and_back(&mut node).await;
}

/// The local pod leaves the mesh (CNI DEL): every call goes to node-b, none lost; it rejoins: calls come back.
async fn removed_and_back(node: &TwoNodes) {
    let removed = node.mesh.remove_pod(&node.local, "echo-local").await;
    removed.expect("RemovePod echo-local");
    node.settle_on_losing_none("echo-remote", Duration::from_secs(20), "local pod removed")
        .await;
    assert_eq!(node.count(20).await, BTreeMap::from([("echo-remote".to_owned(), 20)]));
    node.mesh.add_pod_ok(&node.local, "echo-local").await;
    node.settle_on("echo-local", Duration::from_secs(20), "local pod back")
        .await;
}

/// The local app stops answering: its endpoint is ejected and calls go to node-b, none lost; once it answers again
/// and its ejection (30 s) ends, calls come back. (Until the ejection and Envoy's workers see it — the cluster update
/// merge window, 1 s — a call's first attempt still goes to the local endpoint; its retry leaves that priority for
/// node-b's.)
async fn failing_and_back(node: &mut TwoNodes) {
    node.local_echo = None;
    node.settle_on_losing_none("echo-remote", Duration::from_secs(10), "local app down")
        .await;
    assert_eq!(node.count(40).await, BTreeMap::from([("echo-remote".to_owned(), 40)]));
    let addr = SocketAddr::from(([0, 0, 0, 0], 80));
    node.local_echo = Some(serve_echo(&node.local, addr, who("echo-local"), EchoLedger::default()));
    node.settle_on("echo-local", Duration::from_secs(60), "local app back")
        .await;
}
