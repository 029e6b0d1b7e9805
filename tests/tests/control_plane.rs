//! The control plane's security end to end (proposals/010): the registrar binary
//! serving mTLS, real TLS clients with certificates from test CAs, the node bootstrap
//! against the fake Kubernetes API server's TokenReviews, and a real agent rotating its
//! node certificate under a live Watch.

use std::net::SocketAddr;
use std::time::{Duration, Instant, SystemTime};

use aether_fakes::kube::{ApiServer, TokenInfo};
use aether_proto::registrar::v1::node_bootstrap_client::NodeBootstrapClient;
use aether_proto::registrar::v1::registrar_client::RegistrarClient;
use aether_proto::registrar::v1::{
    IssueNodeCertificateRequest, ListEndpointsRequest, ListServicesRequest, RegisterEndpointRequest,
    UnregisterEndpointRequest, WatchRequest,
};
use aether_proto::registry::v1::{Endpoint, Port, Protocol};
use aether_tests::bench::dependencies;
use aether_tests::control_plane::{AGENT_USER, AUDIENCE, ControlPlane, READER_ID, node_id};
use aether_tests::identity::{TRUST_DOMAIN, TestCa};
use aether_tests::mesh::{APP, Mesh};
use aether_tests::supervisor::metric_sum;
use aether_tests::{ChildGuard, http_get};
use rustls_pki_types::pem::PemObject;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Code;
use tonic::transport::Channel;

/// A registrar serving mTLS with the control plane's certificates.
struct Registrar {
    child: ChildGuard,
    url: String,
    admin: SocketAddr,
    cp: ControlPlane,
    _dir: tempfile::TempDir,
}

impl Registrar {
    async fn start() -> Registrar {
        let dir = tempfile::tempdir().unwrap();
        let cp = ControlPlane::new(dir.path());
        let running = cp.spawn_registrar(&dir.path().join("data"), &[]).await;
        Registrar {
            child: running.child,
            url: running.url,
            admin: running.admin,
            cp,
            _dir: dir,
        }
    }

    async fn agent(&self, node: &str) -> RegistrarClient<Channel> {
        self.cp.client_as(&self.url, node).await
    }

    async fn reader(&self) -> RegistrarClient<Channel> {
        self.cp.reader(&self.url).await
    }

    /// The registrar's log once a line contains `needle` (it may be written just after
    /// the client saw the outcome).
    async fn log_line(&self, needle: &str) -> String {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let logs = self.child.logs();
            if logs.contains(needle) {
                return logs;
            }
            assert!(
                Instant::now() < deadline,
                "no {needle:?} in the registrar's log:\n{logs}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn metrics(&self) -> String {
        http_get(&format!("http://{}/metrics", self.admin), None)
            .await
            .unwrap()
            .body
    }

    /// The endpoints of `service` the catalog holds, as `address@node`.
    async fn endpoints(&self, service: &str) -> Vec<String> {
        match self
            .reader()
            .await
            .list_endpoints(ListEndpointsRequest {
                service: service.into(),
            })
            .await
        {
            Ok(r) => (r.into_inner().endpoints.iter())
                .map(|e| format!("{}@{}", e.address, e.node))
                .collect(),
            Err(s) if s.code() == Code::NotFound => Vec::new(),
            Err(s) => panic!("listing {service}: {s}"),
        }
    }
}

fn endpoint(service: &str, address: &str, node: &str) -> Endpoint {
    Endpoint {
        service: service.into(),
        address: address.into(),
        ports: vec![Port {
            name: "http".into(),
            port: 8080,
            protocol: Protocol::Http as i32,
        }],
        node: node.into(),
        weight: 1,
        ..Default::default()
    }
}

async fn register(client: &mut RegistrarClient<Channel>, e: Endpoint) -> Result<(), tonic::Status> {
    client
        .register_endpoint(RegisterEndpointRequest { endpoint: Some(e) })
        .await
        .map(|_| ())
}

fn assert_denied(result: Result<(), tonic::Status>, code: Code, rule: &str) {
    let status = result.expect_err("refused");
    assert_eq!(status.code(), code, "{status:?}");
    assert!(
        status.message().starts_with(&format!("rule {rule}:")),
        "the refusal names the rule {rule}: {status:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_writes_only_its_own_nodes_endpoints_and_nothing_else_changes() {
    let r = Registrar::start().await;
    let mut a = r.agent("node-a").await;
    let mut b = r.agent("node-b").await;

    register(&mut a, endpoint("shop/cart", "10.1.0.1", "node-a"))
        .await
        .unwrap();
    register(&mut b, endpoint("shop/cart", "10.2.0.1", "node-b"))
        .await
        .unwrap();
    let before = r.endpoints("shop/cart").await;
    assert_eq!(before, ["10.1.0.1@node-a", "10.2.0.1@node-b"]);

    writes_to_another_nodes_endpoints_are_denied(&r, &mut a).await;
    assert_eq!(
        r.endpoints("shop/cart").await,
        before,
        "a refused write changed the catalog"
    );

    // Its own endpoints an agent updates and removes as before.
    let mut draining = endpoint("shop/cart", "10.1.0.1", "node-a");
    draining.weight = 5;
    register(&mut a, draining).await.unwrap();
    let existed = unregister(&mut a, "10.1.0.1").await.unwrap().into_inner().existed;
    assert!(existed);
    assert_eq!(r.endpoints("shop/cart").await, ["10.2.0.1@node-b"]);

    every_refusal_is_counted_and_logged_with_the_caller(&r).await;
}

async fn unregister(
    client: &mut RegistrarClient<Channel>,
    address: &str,
) -> Result<tonic::Response<aether_proto::registrar::v1::UnregisterEndpointResponse>, tonic::Status> {
    client
        .unregister_endpoint(UnregisterEndpointRequest {
            service: "shop/cart".into(),
            address: address.into(),
        })
        .await
}

/// Node A claiming an endpoint of node B, new or existing, or taking one over, or removing it; a reader writing.
async fn writes_to_another_nodes_endpoints_are_denied(r: &Registrar, a: &mut RegistrarClient<Channel>) {
    for (address, node) in [("10.2.0.9", "node-b"), ("10.2.0.1", "node-b"), ("10.2.0.1", "node-a")] {
        assert_denied(
            register(a, endpoint("shop/cart", address, node)).await,
            Code::PermissionDenied,
            "own-node",
        );
    }
    // ... or removing it: the outage the rule exists for.
    let removed = unregister(a, "10.2.0.1").await.map(|_| ());
    assert_denied(removed, Code::PermissionDenied, "own-node");
    // A reader may look, never write.
    let mut reader = r.reader().await;
    assert_denied(
        register(&mut reader, endpoint("shop/cart", "10.3.0.1", "node-a")).await,
        Code::PermissionDenied,
        "agent-writes",
    );
}

/// Every refusal is counted by method and rule, and logged with the caller.
async fn every_refusal_is_counted_and_logged_with_the_caller(r: &Registrar) {
    let metrics = r.metrics().await;
    let denied = |method: &str, rule: &str| {
        metrics
            .lines()
            .find(|l| {
                l.starts_with("aether_registrar_requests_denied_total{")
                    && l.contains(&format!("method=\"{method}\""))
                    && l.contains(&format!("rule=\"{rule}\""))
            })
            .and_then(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
            .unwrap_or_default()
    };
    assert_eq!(denied("RegisterEndpoint", "own-node"), 3.0, "{metrics}");
    assert_eq!(denied("UnregisterEndpoint", "own-node"), 1.0, "{metrics}");
    assert_eq!(denied("RegisterEndpoint", "agent-writes"), 1.0, "{metrics}");
    let logs = r.child.logs();
    assert!(
        !logs.contains('\u{1b}'),
        "terminal colour codes in a log file: {logs:?}"
    );
    assert!(
        logs.lines().any(|l| l.contains("refused")
            && l.contains("spiffe://aether.test/aether/node/node-a")
            && l.contains("own-node")),
        "{logs}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_without_a_known_identity_get_nothing() {
    let r = Registrar::start().await;
    register(
        &mut r.agent("node-a").await,
        endpoint("shop/cart", "10.1.0.1", "node-a"),
    )
    .await
    .unwrap();

    // No certificate: the TLS handshake succeeds (the bootstrap needs that), every method refuses.
    let mut anonymous = r.cp.client_with(&r.url, None).await.unwrap();
    let list = anonymous.list_services(ListServicesRequest {}).await.map(|_| ());
    assert_denied(list, Code::Unauthenticated, "authenticated");
    let (requests, outbox) = tokio::sync::mpsc::channel(1);
    requests
        .send(WatchRequest {
            wildcard: true,
            ..Default::default()
        })
        .await
        .unwrap();
    let watch = anonymous.watch(ReceiverStream::new(outbox)).await.map(|_| ());
    assert_denied(watch, Code::Unauthenticated, "authenticated");
    assert_denied(
        register(&mut anonymous, endpoint("shop/cart", "10.1.0.9", "node-a")).await,
        Code::Unauthenticated,
        "authenticated",
    );

    // A certificate the node CA signed for a workload, not an agent or a reader.
    let stranger = r.cp.node_ca.issue(
        &format!("spiffe://{TRUST_DOMAIN}/ns/shop/sa/cart"),
        Duration::from_secs(600),
    );
    let mut stranger = r.cp.client_with(&r.url, Some(&stranger)).await.unwrap();
    let list = stranger.list_services(ListServicesRequest {}).await.map(|_| ());
    assert_denied(list, Code::PermissionDenied, "known-identity");

    // A node certificate from a CA the registrar does not trust: the handshake fails.
    let foreign = TestCa::new("someone else's CA").issue(&node_id("node-a"), Duration::from_secs(600));
    let refused = r.cp.client_with(&r.url, Some(&foreign)).await;
    let refused = match refused {
        Err(error) => format!("{error:?}"),
        // TLS 1.3: the client may finish before the server rejects its certificate.
        Ok(mut client) => format!("{:?}", client.list_services(ListServicesRequest {}).await.unwrap_err()),
    };
    assert!(!refused.is_empty());
    let logs = r.log_line("TLS handshake refused").await;
    assert!(logs.to_lowercase().contains("issuer"), "the registrar logs why: {logs}");
    assert_eq!(r.endpoints("shop/cart").await, ["10.1.0.1@node-a"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_certificate_is_refused_and_a_stream_ends_when_its_certificate_does() {
    let r = Registrar::start().await;
    let now = SystemTime::now();
    let expired = r.cp.node_ca.issue_between(
        &node_id("node-a"),
        now - Duration::from_secs(7200),
        now - Duration::from_secs(3600),
    );
    let refused = match r.cp.client_with(&r.url, Some(&expired)).await {
        Err(error) => format!("{error:?}"),
        Ok(mut client) => format!("{:?}", client.list_services(ListServicesRequest {}).await.unwrap_err()),
    };
    assert!(!refused.is_empty());
    let logs = r.log_line("TLS handshake refused").await;
    assert!(
        logs.to_lowercase().contains("expired"),
        "the registrar logs the expired certificate: {logs}"
    );

    // A reader whose certificate expires in a few seconds: its Watch is served, then ended.
    // (6 s: long enough for the snapshot to arrive on a busy machine.)
    let short =
        r.cp.node_ca
            .issue_between(READER_ID, now - Duration::from_secs(5), now + Duration::from_secs(6));
    let mut client = r.cp.client_with(&r.url, Some(&short)).await.unwrap();
    let (requests, outbox) = tokio::sync::mpsc::channel(1);
    requests
        .send(WatchRequest {
            wildcard: true,
            filter_id: 1,
            ..Default::default()
        })
        .await
        .unwrap();
    let mut stream = client.watch(ReceiverStream::new(outbox)).await.unwrap().into_inner();
    let first = stream.message().await.unwrap();
    assert!(first.is_some(), "the snapshot arrives while the certificate is valid");
    let ended = loop {
        match tokio::time::timeout(Duration::from_secs(15), stream.message()).await {
            Err(_) => panic!("the stream outlived its certificate"),
            Ok(Ok(Some(_))) => continue,
            Ok(Ok(None)) => panic!("the stream ended without saying why"),
            Ok(Err(status)) => break status,
        }
    };
    assert_eq!(ended.code(), Code::Unauthenticated, "{ended:?}");
    assert!(ended.message().starts_with("rule certificate-valid:"), "{ended:?}");
    drop(requests);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bootstrap_issues_a_node_certificate_only_for_an_agent_token_bound_to_a_node() {
    let r = Registrar::start().await;
    let bootstrap = NodeBootstrapClient::new(anonymous_channel(&r).await);
    let key = rcgen::KeyPair::generate().unwrap();
    // The request asks for another node's name: only the token decides.
    let csr = rcgen::CertificateParams::new(vec!["node-b".to_owned()])
        .unwrap()
        .serialize_request(&key)
        .unwrap()
        .der()
        .to_vec();
    let issue = |token: String, csr: Vec<u8>| {
        let mut bootstrap = bootstrap.clone();
        async move {
            bootstrap
                .issue_node_certificate(IssueNodeCertificateRequest { token, csr_der: csr })
                .await
                .map(|r| r.into_inner())
        }
    };

    let issued = issue(r.cp.agent_token("node-a"), csr.clone()).await.unwrap();
    assert_eq!(issued.spiffe_id, node_id("node-a"));
    let der = rustls_pki_types::CertificateDer::from_pem_slice(issued.cert_chain_pem.as_bytes()).unwrap();
    let identity = aether_common::tls::PeerIdentity::from_leaf(&der).unwrap();
    assert_eq!(identity.spiffe_id.as_deref(), Some(node_id("node-a").as_str()));
    assert!(
        identity.dns_names.is_empty(),
        "the CSR's names are ignored: {identity:?}"
    );
    // It works as node A's identity, and as nothing more.
    let leaf = issued_leaf(&issued, &key);
    let mut as_a = r.cp.client_with(&r.url, Some(&leaf)).await.unwrap();
    register(&mut as_a, endpoint("shop/cart", "10.1.0.1", "node-a"))
        .await
        .unwrap();
    assert_denied(
        register(&mut as_a, endpoint("shop/cart", "10.2.0.1", "node-b")).await,
        Code::PermissionDenied,
        "own-node",
    );

    let kube = &r.cp.kube;
    for (what, token, reason) in refused_tokens(kube) {
        let status = issue(token, csr.clone()).await.expect_err(what);
        assert_eq!(status.code(), Code::PermissionDenied, "{what}: {status:?}");
        assert!(status.message().contains(reason), "{what}: {status:?}");
    }
    let revoked = r.cp.agent_token("node-a");
    kube.revoke(&revoked);
    assert_eq!(
        issue(revoked, csr.clone()).await.unwrap_err().code(),
        Code::PermissionDenied
    );

    let garbage = issue(r.cp.agent_token("node-a"), b"not a CSR".to_vec())
        .await
        .unwrap_err();
    assert_eq!(garbage.code(), Code::InvalidArgument, "{garbage:?}");
    assert!(garbage.message().starts_with("csr_der:"), "{garbage:?}");
    let empty = issue(String::new(), csr).await.unwrap_err();
    assert_eq!(empty.code(), Code::InvalidArgument, "{empty:?}");
    assert!(empty.message().starts_with("token:"), "{empty:?}");

    // Every token was reviewed with Kubernetes (the fake refuses callers without the registrar's credentials).
    // All but the empty one: 1 issued, 4 refused, 1 revoked, 1 with a bad CSR.
    assert_eq!(kube.reviews().len(), 7);
    let metrics = r.metrics().await;
    assert_eq!(
        metric_sum(&metrics, "aether_registrar_node_certificates_total"),
        8.0,
        "{metrics}"
    );
    let logs = r.child.logs();
    assert!(!logs.contains("token-"), "a token reached the logs: {logs}");
}

/// Tokens the bootstrap refuses, what each is, and what the refusal says.
fn refused_tokens(kube: &ApiServer) -> [(&'static str, String, &'static str); 4] {
    [
        (
            "an unknown token",
            "token-nobody-issued".to_owned(),
            "did not authenticate",
        ),
        (
            "another workload's token",
            kube.mint(TokenInfo {
                username: "system:serviceaccount:shop:cart".into(),
                node: Some("node-a".into()),
                audiences: vec![AUDIENCE.into()],
            }),
            "not to the agents' service account",
        ),
        (
            "an agent token for another audience",
            kube.mint(TokenInfo {
                username: AGENT_USER.into(),
                node: Some("node-a".into()),
                audiences: vec!["https://kubernetes.default.svc".into()],
            }),
            "did not authenticate",
        ),
        (
            "an agent token not bound to a pod",
            kube.mint(TokenInfo {
                username: AGENT_USER.into(),
                node: None,
                audiences: vec![AUDIENCE.into()],
            }),
            "not bound to a pod on a node",
        ),
    ]
}

/// The node certificate `issued` for `key`, as a client leaf.
fn issued_leaf(
    issued: &aether_proto::registrar::v1::IssueNodeCertificateResponse,
    key: &rcgen::KeyPair,
) -> aether_tests::identity::Leaf {
    let der = rustls_pki_types::CertificateDer::from_pem_slice(issued.cert_chain_pem.as_bytes()).unwrap();
    let identity = aether_common::tls::PeerIdentity::from_leaf(&der).unwrap();
    aether_tests::identity::Leaf {
        spiffe_id: issued.spiffe_id.clone(),
        cert_der: der.to_vec(),
        cert_pem: issued.cert_chain_pem.clone(),
        key_der: key.serialize_der(),
        key_pem: key.serialize_pem(),
        not_after: identity.not_after,
    }
}

/// A TLS channel to the registrar presenting no certificate.
async fn anonymous_channel(r: &Registrar) -> Channel {
    let roots = aether_common::tls::roots("ca", vec![r.cp.registrar_ca.cert_der.clone().into()]).unwrap();
    let config = aether_common::tls::client_config(
        roots,
        aether_common::tls::ServerIdentity::Dns(aether_tests::control_plane::REGISTRAR_NAME.into()),
        aether_common::tls::CertSlot::default(),
    )
    .unwrap();
    tonic::transport::Endpoint::from_shared(r.url.replacen("https://", "http://", 1))
        .unwrap()
        .connect_with_connector(aether_common::tls::Connector::new(config))
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_renews_its_node_certificate_and_its_watch_resumes_without_a_snapshot() {
    // Node certificates valid for 4 s: the agent renews every ~2 s, the registrar ends any
    // stream whose certificate expires.
    let mesh = Mesh::start_with_registrar(&[], &["--node-cert-ttl", "4s"]).await;
    let frontend = mesh.node.add_pod("frontend");
    let _app = frontend.serve_http(APP.parse().unwrap(), "frontend");
    mesh.describe_pod(&frontend, "frontend", "frontend", "late", &[("http", 8080)]);
    mesh.add_pod_ok(&frontend, "frontend").await;

    let registrar_metrics = || async {
        http_get(&format!("http://{}/metrics", mesh.registrar_admin), None)
            .await
            .unwrap()
            .body
    };
    let issued = || mesh.registrar.logs().matches("issued a node certificate").count();
    let deadline = Instant::now() + Duration::from_secs(30);
    while issued() < 4 {
        assert!(Instant::now() < deadline, "no renewals:\n{}", mesh.registrar.logs());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let snapshots = metric_sum(&registrar_metrics().await, "aether_registrar_watch_snapshots_total");

    // A service that appears after the renewals still reaches the agent: its Watch lives on.
    register(
        &mut mesh.registrar_as("other-node").await,
        endpoint("demo/late", "10.77.0.1", "other-node"),
    )
    .await
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !dependencies(&mesh).await.known.contains("demo/late") {
        assert!(
            Instant::now() < deadline,
            "demo/late never reached the agent:\n{}",
            mesh.agent
                .as_ref()
                .map(aether_tests::ChildGuard::logs)
                .unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The frontend's own registration kept being refreshed under each new certificate.
    assert!(
        mesh.registrar
            .logs()
            .lines()
            .all(|l| !(l.contains("refused") && l.contains("node/test-node"))),
        "a request of the agent was refused:\n{}",
        mesh.registrar.logs()
    );
    let agent_logs = mesh
        .agent
        .as_ref()
        .map(aether_tests::ChildGuard::logs)
        .unwrap_or_default();
    assert!(agent_logs.contains("resuming the registrar watch"), "{agent_logs}");
    // Resumed from its version on each new connection: no new snapshot.
    assert_eq!(
        metric_sum(&registrar_metrics().await, "aether_registrar_watch_snapshots_total"),
        snapshots,
        "a renewal restarted a watch from scratch"
    );
    assert!(!agent_logs.contains("PRIVATE KEY"), "a key reached the logs");
}
