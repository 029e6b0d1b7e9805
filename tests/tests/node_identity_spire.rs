//! `--node-identity spire` end to end: the agent's node certificate is its own X.509
//! SVID from a fake SPIFFE Workload API (`aether_tests::spire_workload`), the registrar
//! (mTLS, the control plane's serving certificate) trusts the fake SPIRE CA through
//! `--client-ca`. Registrations reach the registrar; a rotation pushed on the open
//! stream makes the agent reconnect with the new SVID (shown by the first SVID expiring
//! with writes and the Watch still working); an SVID naming another node gets the
//! agent's writes refused by the registrar.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use aether_proto::registrar::v1::{ListEndpointsRequest, RegisterEndpointRequest};
use aether_proto::registry::v1::{Endpoint, Port, Protocol};
use aether_tests::bench::dependencies;
use aether_tests::control_plane::node_id;
use aether_tests::identity::TestCa;
use aether_tests::mesh::{Mesh, MeshIdentity, NAMESPACE, NodeIdentity};
use aether_tests::spire_workload::pb::X509svidRequest;
use aether_tests::spire_workload::pb::spiffe_workload_api_client::SpiffeWorkloadApiClient;
use aether_tests::spire_workload::{FakeWorkloadApi, SECURITY_HEADER};
use aether_tests::supervisor::metric_sum;
use aether_tests::{ChildGuard, TestPod, http_get};

const NODE: &str = "test-node";
/// What the agent logs for each SVID it takes as its node certificate.
const TOOK_SVID: &str = "node certificate: the agent's SVID from SPIRE";
/// What the agent logs when a new node certificate opens a new registrar connection.
const REDIALED: &str = "node certificate changed; new registrar connection";

/// A fake SPIRE (its CA's bundle written for the registrar's `--client-ca`, the
/// Workload API issuing `spiffe_id` valid for `ttl`) and a mesh whose agent takes its
/// node certificate from it.
async fn start(dir: &Path, spiffe_id: &str, ttl: Duration) -> (FakeWorkloadApi, Mesh) {
    let ca = Arc::new(TestCa::new("fake SPIRE CA"));
    let bundle = dir.join("spire-bundle.crt");
    std::fs::write(&bundle, &ca.cert_pem).unwrap();
    let workload = FakeWorkloadApi::start(&dir.join("workload.sock"), ca, spiffe_id, ttl);
    let mesh = Mesh::start_node_identity(
        MeshIdentity::DEFAULT,
        NodeIdentity::Spire {
            workload_socket: workload.socket.clone(),
        },
        &[],
        &["--client-ca", &bundle.display().to_string()],
    )
    .await;
    (workload, mesh)
}

fn agent(mesh: &Mesh) -> &ChildGuard {
    mesh.agent.as_ref().expect("agent running")
}

/// Waits until `ok` holds (15 s), else panics with `what` and the agent's and the
/// registrar's logs.
async fn until(mesh: &Mesh, what: &str, mut ok: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(15);
    while !ok().await {
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {what}\n--- agent ---\n{}\n--- registrar ---\n{}",
            agent(mesh).logs(),
            mesh.registrar.logs()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The endpoints of `demo/<service>` in the catalog, as `address@node`.
async fn endpoints(mesh: &Mesh, service: &str) -> Vec<String> {
    match mesh
        .registrar()
        .await
        .list_endpoints(ListEndpointsRequest {
            service: format!("{NAMESPACE}/{service}"),
        })
        .await
    {
        Ok(reply) => reply
            .into_inner()
            .endpoints
            .iter()
            .map(|e| format!("{}@{}", e.address, e.node))
            .collect(),
        Err(status) if status.code() == tonic::Code::NotFound => Vec::new(),
        Err(status) => panic!("listing {service}: {status}"),
    }
}

async fn registrar_metrics(mesh: &Mesh) -> String {
    http_get(&format!("http://{}/metrics", mesh.registrar_admin), None)
        .await
        .unwrap()
        .body
}

/// `demo/<service>` at `address` on another node (a stand-in registered directly).
fn remote_endpoint(service: &str, address: &str) -> Endpoint {
    Endpoint {
        service: format!("{NAMESPACE}/{service}"),
        address: address.into(),
        ports: vec![Port {
            name: "http".into(),
            port: 8080,
            protocol: Protocol::Http as i32,
        }],
        node: "other-node".into(),
        weight: 1,
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agents_spire_svid_is_its_node_certificate_across_rotations() {
    // Short enough to wait out: once it has expired, the registrar would refuse anything
    // still sent on a connection that presented it (rule certificate-valid).
    const FIRST_TTL: Duration = Duration::from_secs(30);
    let dir = tempfile::tempdir().unwrap();
    let (workload, mesh) = start(dir.path(), &node_id(NODE), FIRST_TTL).await;
    let first = workload.current();
    let _frontend = the_first_svid_is_the_node_certificate(&mesh, &workload).await;
    assert!(
        first.not_after > SystemTime::now() + Duration::from_secs(2),
        "the mesh took most of the first SVID's {FIRST_TTL:?} to start: the rotation below would come too late"
    );

    // A rotation pushed on the open stream: the agent takes it and opens a new connection.
    workload.rotate_to(&node_id(NODE), Duration::from_secs(3600));
    until(&mesh, "the agent to redial with the rotated SVID", async || {
        agent(&mesh).logs().matches(REDIALED).count() == 1
    })
    .await;
    // Wait out the first SVID: from now on only a connection presenting the new one works.
    if let Ok(left) = first.not_after.duration_since(SystemTime::now()) {
        tokio::time::sleep(left + Duration::from_millis(1500)).await;
    }
    let (_remote, backend) = watch_and_writes_work_on_the_new_connection(&mesh).await;

    // The Workload API stream breaks (SPIRE restarting): the agent reconnects, keeping its
    // certificate meanwhile, and the next rotation still arrives.
    let calls = workload.fetch_calls();
    workload.break_streams();
    until(&mesh, "the agent to reopen the Workload API stream", async || {
        workload.fetch_calls() > calls && workload.streams() == 1
    })
    .await;
    // The reconnect re-sends the same SVID: no new connection for it.
    assert_eq!(agent(&mesh).logs().matches(REDIALED).count(), 1);
    workload.rotate_to(&node_id(NODE), Duration::from_secs(3600));
    until(&mesh, "the agent to redial with the second rotation", async || {
        agent(&mesh).logs().matches(REDIALED).count() == 2
    })
    .await;
    let backend2 = add_backend(&mesh, "backend2").await;
    let mut expected = vec![format!("{}@{NODE}", backend.ip()), format!("{}@{NODE}", backend2.ip())];
    expected.sort();
    let mut got = endpoints(&mesh, "backend").await;
    got.sort();
    assert_eq!(got, expected);
}

/// The first SVID is the node certificate: the pod's endpoint reaches the registrar, with no bootstrap at all.
/// The pod, kept for the rest of the test.
async fn the_first_svid_is_the_node_certificate(mesh: &Mesh, workload: &FakeWorkloadApi) -> TestPod {
    let frontend = mesh.node.add_pod("frontend");
    mesh.describe_pod(&frontend, "frontend", "frontend", "remote", &[("http", 8080)]);
    mesh.add_pod_ok(&frontend, "frontend").await;
    assert_eq!(endpoints(mesh, "frontend").await, [format!("{}@{NODE}", frontend.ip())]);
    assert!(
        mesh.control_plane.kube.reviews().is_empty(),
        "the agent used the bootstrap"
    );
    assert!(workload.fetch_calls() >= 1);
    assert_eq!(workload.refused(), 0, "the agent called without the security header");
    let logs = agent(mesh).logs();
    assert!(logs.contains(TOOK_SVID) && logs.contains(&node_id(NODE)), "{logs}");
    assert!(!logs.contains("does not name its node"), "{logs}");
    assert!(!logs.contains("BEGIN PRIVATE KEY"), "a key in the logs");
    frontend
}

/// A pod `name` of service backend, added.
async fn add_backend(mesh: &Mesh, name: &str) -> TestPod {
    let backend = mesh.node.add_pod(name);
    mesh.describe_pod(&backend, name, "backend", "", &[("http", 8080)]);
    mesh.add_pod_ok(&backend, name).await;
    backend
}

/// The Watch resumed on the new connection (an endpoint registered elsewhere arrives) and writes work on it too,
/// none refused. The remote and backend pods.
async fn watch_and_writes_work_on_the_new_connection(mesh: &Mesh) -> (TestPod, TestPod) {
    let remote = mesh.node.add_pod("remote");
    mesh.registrar_as("other-node")
        .await
        .register_endpoint(RegisterEndpointRequest {
            endpoint: Some(remote_endpoint("remote", &remote.ip().to_string())),
        })
        .await
        .unwrap();
    until(mesh, "demo/remote in the agent's watched catalog", async || {
        dependencies(mesh).await.known.contains("demo/remote")
    })
    .await;
    let backend = add_backend(mesh, "backend").await;
    assert_eq!(endpoints(mesh, "backend").await, [format!("{}@{NODE}", backend.ip())]);
    let metrics = registrar_metrics(mesh).await;
    assert_eq!(
        metric_sum(&metrics, "aether_registrar_requests_denied_total"),
        0.0,
        "the registrar refused something (an expired certificate still in use?):\n{}",
        mesh.registrar.logs()
    );
    (remote, backend)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_svid_naming_another_node_gets_the_agents_writes_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (workload, mesh) = start(dir.path(), &node_id(NODE), Duration::from_secs(3600)).await;
    let backend = mesh.node.add_pod("backend");
    mesh.describe_pod(&backend, "backend", "backend", "", &[("http", 8080)]);
    mesh.add_pod_ok(&backend, "backend").await;

    // SPIRE now issues the agent an SVID naming another node (a wrong registration entry).
    workload.rotate_to(&node_id("other-node"), Duration::from_secs(3600));
    until(&mesh, "the agent's warning about the SVID", async || {
        let logs = agent(&mesh).logs();
        logs.contains("does not name its node") && logs.contains(REDIALED)
    })
    .await;
    let logs = agent(&mesh).logs();
    assert!(
        logs.contains(&format!("spiffe://<trust domain>/aether/node/{NODE}")),
        "the warning names the expected form:\n{logs}"
    );

    // The registrar reads the node from the SVID: this node's pods are not its to write.
    let frontend = mesh.node.add_pod("frontend");
    mesh.describe_pod(&frontend, "frontend", "frontend", "", &[("http", 8080)]);
    let status = mesh
        .add_pod(&frontend, "frontend")
        .await
        .expect_err("AddPod registered a pod under another node's identity");
    assert!(status.message().contains("rule own-node"), "{status:?}");
    assert!(endpoints(&mesh, "frontend").await.is_empty());
    let metrics = registrar_metrics(&mesh).await;
    let own_node: f64 = metrics
        .lines()
        .filter(|l| {
            l.starts_with("aether_registrar_requests_denied_total{")
                && l.contains("method=\"RegisterEndpoint\"")
                && l.contains("rule=\"own-node\"")
        })
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum();
    assert!(own_node >= 1.0, "{metrics}");
    let registrar_logs = mesh.registrar.logs();
    assert!(
        registrar_logs.contains("refused") && registrar_logs.contains(&node_id("other-node")),
        "{registrar_logs}"
    );
}

/// The fake is faithful where it matters to a client: the security header is required
/// (INVALID_ARGUMENT without it, as SPIRE answers), and a rotation arrives on the open
/// stream. No root needed.
#[tokio::test]
async fn the_fake_workload_api_requires_the_header_and_streams_rotations() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Arc::new(TestCa::new("fake SPIRE CA"));
    let workload = FakeWorkloadApi::start(
        &dir.path().join("workload.sock"),
        ca.clone(),
        &node_id(NODE),
        Duration::from_secs(3600),
    );
    let channel = tonic::transport::Endpoint::from_shared(format!("unix:{}", workload.socket.display()))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut client = SpiffeWorkloadApiClient::new(channel);

    let refused = client
        .fetch_x509svid(X509svidRequest {})
        .await
        .expect_err("served without the security header");
    assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused:?}");
    assert_eq!(workload.refused(), 1);

    let mut request = tonic::Request::new(X509svidRequest {});
    request.metadata_mut().insert(SECURITY_HEADER, "true".parse().unwrap());
    let mut stream = client.fetch_x509svid(request).await.unwrap().into_inner();
    let first = stream.message().await.unwrap().expect("a first response");
    assert_eq!(first.svids.len(), 1);
    assert_eq!(first.svids[0].spiffe_id, node_id(NODE));
    assert_eq!(&first.svids[0].x509_svid[..], workload.current().cert_der.as_slice());
    assert_eq!(&first.svids[0].bundle[..], ca.cert_der.as_slice());
    assert!(!first.svids[0].x509_svid_key.is_empty());

    let rotated = workload.rotate_to(&node_id(NODE), Duration::from_secs(3600));
    let second = tokio::time::timeout(Duration::from_secs(5), stream.message())
        .await
        .expect("the rotation on the open stream")
        .unwrap()
        .expect("a second response");
    assert_eq!(&second.svids[0].x509_svid[..], rotated.cert_der.as_slice());
    assert_ne!(rotated.cert_der, first.svids[0].x509_svid[..].to_vec());
    assert_eq!(workload.issued().len(), 2);
}
