//! The node bootstrap for edge gateways (proposals/010, 018): the registrar binary
//! serving mTLS with its node CA, bootstrap tokens minted and reviewed by the shared
//! fake Kubernetes API server. A listed edge ServiceAccount's pod-bound token gets a
//! read-only edge certificate (Watch and List, never a write); an unlisted one gets
//! nothing; an agent's token still gets its node certificate.

mod support;

use std::path::{Path, PathBuf};
use std::time::Duration;

use aether_common::tls::{self, CertSlot, Connector, ServerIdentity};
use aether_fakes::kube::{ApiServer, TokenInfo};
use aether_proto::registrar::v1::node_bootstrap_client::NodeBootstrapClient;
use aether_proto::registrar::v1::registrar_client::RegistrarClient;
use aether_proto::registrar::v1::watch_response::Event;
use aether_proto::registrar::v1::{
    IssueNodeCertificateRequest, IssueNodeCertificateResponse, ListEndpointsRequest, RegisterEndpointRequest,
    UnregisterEndpointRequest, WatchRequest,
};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use support::{Registrar, TIMEOUT, endpoint, http_get};
use tokio_stream::wrappers::ReceiverStream;
use tonic::Code;
use tonic::transport::{Channel, Endpoint};

const TRUST_DOMAIN: &str = "aether.test";
const REGISTRAR_NAME: &str = "aether-registrar.aether-system.svc";
const AUDIENCE: &str = "aether-registrar";
const AGENT_USER: &str = "system:serviceaccount:aether-system:aether-agent";
/// The edge listed in `--edge-service-accounts`.
const EDGE_SERVICE_ACCOUNT: &str = "aether-system/aether-edge-public";
const EDGE_USER: &str = "system:serviceaccount:aether-system:aether-edge-public";
const EDGE_ID: &str = "spiffe://aether.test/aether/edge/aether-system/aether-edge-public";

/// The registrar's serving certificate and its CA, and the node CA, as files.
struct Pki {
    dir: PathBuf,
    registrar_ca: Vec<u8>,
}

impl Pki {
    fn write(dir: &Path) -> Pki {
        let dir = dir.join("pki");
        std::fs::create_dir_all(&dir).unwrap();
        let ca = |name: &str| {
            let key = rcgen::KeyPair::generate().unwrap();
            let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
            params.distinguished_name.push(rcgen::DnType::CommonName, name);
            params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
            params.key_usages = vec![rcgen::KeyUsagePurpose::KeyCertSign, rcgen::KeyUsagePurpose::CrlSign];
            let cert = params.self_signed(&key).unwrap();
            let key_pem = key.serialize_pem();
            (cert, key_pem, rcgen::Issuer::new(params, key))
        };
        let (registrar_ca, _, registrar_issuer) = ca("registrar CA");
        let (node_ca, node_ca_key, _) = ca("node CA");
        let server_key = rcgen::KeyPair::generate().unwrap();
        let server = rcgen::CertificateParams::new(vec![REGISTRAR_NAME.to_owned()])
            .unwrap()
            .signed_by(&server_key, &registrar_issuer)
            .unwrap();
        for (file, pem) in [
            ("registrar.crt", server.pem()),
            ("registrar.key", server_key.serialize_pem()),
            ("node-ca.crt", node_ca.pem()),
            ("node-ca.key", node_ca_key),
        ] {
            std::fs::write(dir.join(file), pem).unwrap();
        }
        Pki {
            dir,
            registrar_ca: registrar_ca.der().to_vec(),
        }
    }

    fn flags(&self, edges: &str) -> Vec<String> {
        let path = |file: &str| self.dir.join(file).display().to_string();
        vec![
            format!("--tls-cert={}", path("registrar.crt")),
            format!("--tls-key={}", path("registrar.key")),
            format!("--node-ca-cert={}", path("node-ca.crt")),
            format!("--node-ca-key={}", path("node-ca.key")),
            format!("--trust-domain={TRUST_DOMAIN}"),
            format!("--edge-service-accounts={edges}"),
        ]
    }

    /// A channel to the registrar presenting `identity` (or no certificate: the bootstrap).
    async fn channel(&self, registrar: &Registrar, identity: Option<(&str, &rcgen::KeyPair)>) -> Channel {
        let slot = CertSlot::default();
        if let Some((chain_pem, key)) = identity {
            let chain = CertificateDer::pem_slice_iter(chain_pem.as_bytes())
                .collect::<Result<Vec<_>, _>>()
                .unwrap();
            slot.set(tls::certified_key(chain, PrivateKeyDer::Pkcs8(key.serialize_der().into())).unwrap());
        }
        let roots = tls::roots("registrar CA", vec![self.registrar_ca.clone().into()]).unwrap();
        let config = tls::client_config(roots, ServerIdentity::Dns(REGISTRAR_NAME.into()), slot).unwrap();
        Endpoint::from_shared(format!("http://{}", registrar.grpc))
            .unwrap()
            .connect_timeout(Duration::from_secs(5))
            .connect_with_connector(Connector::new(config))
            .await
            .unwrap()
    }
}

/// The registrar serving mTLS with the bootstrap on, reviewing tokens with `kube`.
async fn start(dir: &Path, pki: &Pki, kube: &ApiServer) -> Registrar {
    let kubeconfig = kube.write_kubeconfig(dir);
    let flags = pki.flags(&format!("{EDGE_SERVICE_ACCOUNT},aether-system/aether-edge-internal"));
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let env = [("KUBECONFIG".to_owned(), kubeconfig.display().to_string())];
    Registrar::start_secure(&dir.join("data"), &flags, &env).await
}

fn token(kube: &ApiServer, username: &str, node: Option<&str>) -> String {
    kube.mint(TokenInfo {
        username: username.into(),
        node: node.map(str::to_owned),
        audiences: vec![AUDIENCE.into()],
    })
}

async fn issue(
    bootstrap: &mut NodeBootstrapClient<Channel>,
    token: String,
    key: &rcgen::KeyPair,
) -> Result<IssueNodeCertificateResponse, tonic::Status> {
    // The CSR asks for a name of its own: only the token decides.
    let csr = rcgen::CertificateParams::new(vec!["node-z".to_owned()])
        .unwrap()
        .serialize_request(key)
        .unwrap();
    bootstrap
        .issue_node_certificate(IssueNodeCertificateRequest {
            token,
            csr_der: csr.der().to_vec(),
        })
        .await
        .map(tonic::Response::into_inner)
}

/// The SPIFFE ID the issued leaf carries.
fn leaf_id(issued: &IssueNodeCertificateResponse) -> Option<String> {
    let leaf = CertificateDer::from_pem_slice(issued.cert_chain_pem.as_bytes()).unwrap();
    tls::PeerIdentity::from_leaf(&leaf).unwrap().spiffe_id
}

fn assert_denied<T: std::fmt::Debug>(result: Result<T, tonic::Status>, code: Code, rule: &str) -> String {
    let status = result.expect_err("refused");
    assert_eq!(status.code(), code, "{status:?}");
    assert!(
        status.message().starts_with(&format!("rule {rule}:")),
        "the refusal names the rule {rule}: {status:?}"
    );
    status.message().to_owned()
}

/// The endpoints' addresses of the first snapshot a wildcard Watch gets.
async fn watched_snapshot(client: &mut RegistrarClient<Channel>) -> Vec<String> {
    let (requests, outbox) = tokio::sync::mpsc::channel(1);
    requests
        .send(WatchRequest {
            wildcard: true,
            filter_id: 1,
            ..Default::default()
        })
        .await
        .unwrap();
    let mut stream = client
        .watch(ReceiverStream::new(outbox))
        .await
        .expect("the edge may Watch")
        .into_inner();
    let mut addresses = Vec::new();
    loop {
        let message = tokio::time::timeout(TIMEOUT, stream.message())
            .await
            .expect("the snapshot in time")
            .expect("the stream stays up")
            .expect("a snapshot");
        match message.event {
            Some(Event::Snapshot(snapshot)) => {
                addresses.extend(snapshot.endpoints.into_iter().map(|e| e.address));
            }
            Some(Event::SnapshotComplete(_)) => return addresses,
            other => panic!("expected a snapshot, got {other:?}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_edge_token_gets_a_read_only_edge_certificate_and_an_agent_token_its_node_certificate() {
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::write(dir.path());
    let kube = ApiServer::start();
    let registrar = start(dir.path(), &pki, &kube).await;
    let mut bootstrap = NodeBootstrapClient::new(pki.channel(&registrar, None).await);

    // An agent's token still gets its node's certificate, which writes its node's endpoints.
    let agent_key = rcgen::KeyPair::generate().unwrap();
    let agent = issue(&mut bootstrap, token(&kube, AGENT_USER, Some("node-a")), &agent_key)
        .await
        .unwrap_or_else(|e| panic!("an agent's bootstrap: {e:?}\n{}", registrar.logs()));
    let node_a = format!("spiffe://{TRUST_DOMAIN}/aether/node/node-a");
    assert_eq!(agent.spiffe_id, node_a);
    assert_eq!(leaf_id(&agent).as_deref(), Some(node_a.as_str()));
    let mut as_agent = RegistrarClient::new(pki.channel(&registrar, Some((&agent.cert_chain_pem, &agent_key))).await);
    let mut cart = endpoint("shop/cart", "10.1.0.1", 8080);
    cart.node = "node-a".into();
    as_agent
        .register_endpoint(RegisterEndpointRequest {
            endpoint: Some(cart.clone()),
        })
        .await
        .expect("the agent writes its own node's endpoint");

    // A listed edge's token, its pod on another node: an edge certificate, whatever the CSR asks.
    let edge_key = rcgen::KeyPair::generate().unwrap();
    let edge = issue(&mut bootstrap, token(&kube, EDGE_USER, Some("node-b")), &edge_key)
        .await
        .unwrap_or_else(|e| panic!("an edge's bootstrap: {e:?}\n{}", registrar.logs()));
    assert_eq!(edge.spiffe_id, EDGE_ID);
    assert_eq!(leaf_id(&edge).as_deref(), Some(EDGE_ID));
    let mut as_edge = RegistrarClient::new(pki.channel(&registrar, Some((&edge.cert_chain_pem, &edge_key))).await);

    // It reads: Watch and List.
    assert_eq!(watched_snapshot(&mut as_edge).await, ["10.1.0.1"]);
    let listed = as_edge
        .list_endpoints(ListEndpointsRequest {
            service: "shop/cart".into(),
        })
        .await
        .expect("the edge may List")
        .into_inner();
    assert_eq!(listed.endpoints.len(), 1);

    // It never writes: not on any node, not even the one its pod runs on.
    for node in ["node-a", "node-b", ""] {
        let mut claim = endpoint("shop/cart", "10.2.0.1", 8080);
        claim.node = node.into();
        let written = as_edge
            .register_endpoint(RegisterEndpointRequest { endpoint: Some(claim) })
            .await;
        let message = assert_denied(written, Code::PermissionDenied, "agent-writes");
        assert!(message.contains(EDGE_ID), "{message}");
    }
    let removed = as_edge
        .unregister_endpoint(UnregisterEndpointRequest {
            service: "shop/cart".into(),
            address: "10.1.0.1".into(),
        })
        .await;
    assert_denied(removed, Code::PermissionDenied, "agent-writes");
    assert_eq!(
        watched_snapshot(&mut as_edge).await,
        ["10.1.0.1"],
        "a refused write changed the catalog"
    );

    // Every refusal is counted by method and rule.
    let (_, metrics) = http_get(registrar.admin, "/metrics").await.unwrap();
    let denied = |method: &str| {
        metrics
            .lines()
            .find(|l| {
                l.starts_with("aether_registrar_requests_denied_total{")
                    && l.contains(&format!("method=\"{method}\""))
                    && l.contains("rule=\"agent-writes\"")
            })
            .and_then(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
            .unwrap_or_default()
    };
    assert_eq!(denied("RegisterEndpoint"), 3.0, "{metrics}");
    assert_eq!(denied("UnregisterEndpoint"), 1.0, "{metrics}");

    let logs = registrar.logs();
    assert!(
        logs.lines()
            .any(|l| l.contains("issued an edge certificate") && l.contains(EDGE_ID)),
        "{logs}"
    );
    assert!(!logs.contains("token-"), "a token reached the logs: {logs}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn edge_tokens_not_listed_or_not_bound_to_a_pod_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::write(dir.path());
    let kube = ApiServer::start();
    let registrar = start(dir.path(), &pki, &kube).await;
    let mut bootstrap = NodeBootstrapClient::new(pki.channel(&registrar, None).await);
    let key = rcgen::KeyPair::generate().unwrap();

    let cases = [
        (
            "an edge ServiceAccount not listed",
            token(
                &kube,
                "system:serviceaccount:aether-system:aether-edge-other",
                Some("node-a"),
            ),
            "not to the agents' service account",
        ),
        (
            "a listed edge's ServiceAccount in another namespace",
            token(&kube, "system:serviceaccount:shop:aether-edge-public", Some("node-a")),
            "not to the agents' service account",
        ),
        (
            "a listed edge's token not bound to a pod",
            token(&kube, EDGE_USER, None),
            "the edge's token is not bound to a pod",
        ),
        (
            "a listed edge's token for another audience",
            kube.mint(TokenInfo {
                username: EDGE_USER.into(),
                node: Some("node-a".into()),
                audiences: vec!["https://kubernetes.default.svc".into()],
            }),
            "did not authenticate",
        ),
    ];
    for (what, token, reason) in cases {
        let refused = issue(&mut bootstrap, token, &key).await;
        let message = assert_denied(refused, Code::PermissionDenied, "agent-token");
        assert!(message.contains(reason), "{what}: {message}");
    }
    // A revoked edge token (its pod is gone) gets nothing more.
    let revoked = token(&kube, EDGE_USER, Some("node-a"));
    issue(&mut bootstrap, revoked.clone(), &key)
        .await
        .expect("the edge's token while its pod exists");
    kube.revoke(&revoked);
    assert_denied(
        issue(&mut bootstrap, revoked, &key).await,
        Code::PermissionDenied,
        "agent-token",
    );
    assert_eq!(kube.reviews().len(), 6);
    let logs = registrar.logs();
    assert!(!logs.contains("token-"), "a token reached the logs: {logs}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wildcard_edge_service_account_is_a_start_error() {
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::write(dir.path());
    let kube = ApiServer::start();
    let kubeconfig = kube.write_kubeconfig(dir.path());
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_aether-registrar"))
        .args(["--listen=127.0.0.1:0", "--admin=127.0.0.1:0"])
        .arg(format!("--data-dir={}", dir.path().join("data").display()))
        .args(pki.flags("aether-system/aether-edge-*"))
        .env("KUBECONFIG", kubeconfig)
        .kill_on_drop(true)
        .output();
    let output = tokio::time::timeout(TIMEOUT, output)
        .await
        .expect("the registrar exits")
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("--edge-service-accounts entry \"aether-system/aether-edge-*\": wildcards are not accepted"),
        "{stderr}"
    );
}
