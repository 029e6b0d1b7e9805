//! The control plane's security for tests (proposals/010): a registrar serving
//! certificate and a node CA, the registrar and agent flags that use them, the shared fake
//! Kubernetes API server answering TokenReviews for the node bootstrap, and mTLS clients
//! of the registrar acting as an agent of a given node or as a reader.
//!
//! Every harness that runs the registrar with an agent (the mesh, the demo, the benches)
//! runs it through this: TLS on, the bootstrap as in a cluster.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use aether_common::tls::{self, CertSlot, Connector, ServerIdentity};
use aether_fakes::kube::{ApiServer, TokenInfo};
use aether_proto::registrar::v1::registrar_client::RegistrarClient;
use tonic::transport::{Channel, Endpoint};

use crate::identity::{Leaf, TRUST_DOMAIN, TestCa};
use crate::{ChildGuard, binary, free_port, http_get};

/// The DNS name the registrar's certificate carries and agents expect.
pub const REGISTRAR_NAME: &str = "aether-registrar.aether-system.svc";
/// The audience bootstrap tokens are bound to.
pub const AUDIENCE: &str = "aether-registrar";
/// The agents' ServiceAccount, as TokenReview names it.
pub const AGENT_USER: &str = "system:serviceaccount:aether-system:aether-agent";
/// The edge gateways' ServiceAccounts the registrar bootstraps as readers: the tests' (`edge/edge-gateway`) and
/// the demo's (`demo/edge-gateway`).
pub const EDGE_SERVICE_ACCOUNTS: [&str; 2] = ["edge/edge-gateway", "demo/edge-gateway"];
/// The reader identity tests use to list and watch.
pub const READER_ID: &str = "spiffe://aether.test/ns/aether-system/sa/aether-test";

/// `spiffe://aether.test/aether/node/<node>`.
pub fn node_id(node: &str) -> String {
    format!("spiffe://{TRUST_DOMAIN}/aether/node/{node}")
}

pub struct ControlPlane {
    dir: PathBuf,
    pub registrar_ca: TestCa,
    pub node_ca: TestCa,
    /// The API server the registrar reviews bootstrap tokens with.
    pub kube: ApiServer,
}

impl ControlPlane {
    /// Writes the PKI into `dir` and starts the fake API server.
    pub fn new(dir: &Path) -> Self {
        let dir = dir.join("control-plane");
        std::fs::create_dir_all(&dir).unwrap();
        let registrar_ca = TestCa::new("aether registrar CA");
        let node_ca = TestCa::new("aether node CA");
        std::fs::write(dir.join("registrar-ca.crt"), &registrar_ca.cert_pem).unwrap();
        registrar_ca
            .issue_server(REGISTRAR_NAME, Duration::from_secs(86400))
            .write(&dir, "registrar");
        node_ca.write(&dir.join("node-ca"));
        let kube = ApiServer::start();
        kube.write_kubeconfig(&dir);
        Self {
            dir,
            registrar_ca,
            node_ca,
            kube,
        }
    }

    /// The registrar's flags: its certificate, the node CA (bootstrap and trust), the
    /// trust domain and the tests' reader identity.
    pub fn registrar_args(&self) -> Vec<String> {
        let path = |p: &str| self.dir.join(p).display().to_string();
        [
            ("--tls-cert", path("registrar.crt")),
            ("--tls-key", path("registrar.key")),
            ("--node-ca-cert", path("node-ca/ca.crt")),
            ("--node-ca-key", path("node-ca/ca.key")),
            ("--trust-domain", TRUST_DOMAIN.to_owned()),
            ("--reader-ids", READER_ID.to_owned()),
            ("--edge-service-accounts", EDGE_SERVICE_ACCOUNTS.join(",")),
        ]
        .into_iter()
        .flat_map(|(flag, value)| [flag.to_owned(), value])
        .collect()
    }

    /// The registrar's environment: the fake API server's kubeconfig (TokenReviews).
    pub fn registrar_env(&self) -> Vec<(String, String)> {
        vec![("KUBECONFIG".into(), self.dir.join("kubeconfig").display().to_string())]
    }

    /// The agent's flags for `node`: the registrar's CA and name, and a bootstrap token
    /// the fake API server binds to `node`.
    pub fn agent_args(&self, node: &str) -> Vec<String> {
        let token = self.dir.join(format!("token-{node}"));
        std::fs::write(&token, self.agent_token(node)).unwrap();
        self.link_args(&token)
    }

    /// The registrar link's flags with the bootstrap token at `token`: the registrar's CA and name.
    fn link_args(&self, token: &Path) -> Vec<String> {
        [
            (
                "--registrar-ca",
                self.dir.join("registrar-ca.crt").display().to_string(),
            ),
            ("--registrar-identity", REGISTRAR_NAME.to_owned()),
            ("--node-identity", "bootstrap".to_owned()),
            ("--bootstrap-token", token.display().to_string()),
        ]
        .into_iter()
        .flat_map(|(flag, value)| [flag.to_owned(), value])
        .collect()
    }

    /// An edge gateway's flags: the registrar's CA and name, and a bootstrap token of its ServiceAccount
    /// (`<namespace>/<service account>`, one of [`EDGE_SERVICE_ACCOUNTS`]) bound to its pod.
    pub fn edge_args(&self, namespace: &str, service_account: &str) -> Vec<String> {
        let token = self.dir.join(format!("token-edge-{namespace}-{service_account}"));
        let minted = self.kube.mint(TokenInfo {
            username: format!("system:serviceaccount:{namespace}:{service_account}"),
            // Pod-bound, as kubelet projects it; an edge may run on any node.
            node: Some("any-node".into()),
            audiences: vec![AUDIENCE.into()],
        });
        std::fs::write(&token, minted).unwrap();
        self.link_args(&token)
    }

    /// A bootstrap token as kubelet projects it for the agent pod on `node`.
    pub fn agent_token(&self, node: &str) -> String {
        self.kube.mint(TokenInfo {
            username: AGENT_USER.into(),
            node: Some(node.into()),
            audiences: vec![AUDIENCE.into()],
        })
    }

    /// A client presenting `leaf` (or nothing), verifying the registrar at `url`
    /// (`https://host:port`). Connects now, so a refused handshake is an error here.
    pub async fn client_with(
        &self,
        url: &str,
        leaf: Option<&Leaf>,
    ) -> Result<RegistrarClient<Channel>, tonic::transport::Error> {
        let slot = CertSlot::default();
        if let Some(leaf) = leaf {
            slot.set(
                tls::certified_key(
                    vec![leaf.cert_der.clone().into()],
                    rustls_pki_types::PrivateKeyDer::Pkcs8(leaf.key_der.clone().into()),
                )
                .unwrap(),
            );
        }
        let roots = tls::roots("registrar CA", vec![self.registrar_ca.cert_der.clone().into()]).unwrap();
        let config = tls::client_config(roots, ServerIdentity::Dns(REGISTRAR_NAME.into()), slot).unwrap();
        let plain = url.replacen("https://", "http://", 1);
        let channel = Endpoint::from_shared(plain)
            .unwrap()
            .connect_timeout(Duration::from_secs(5))
            .connect_with_connector(Connector::new(config))
            .await?;
        Ok(RegistrarClient::new(channel))
    }

    /// A client acting as the agent of `node` (a node certificate from the node CA).
    pub async fn client_as(&self, url: &str, node: &str) -> RegistrarClient<Channel> {
        let leaf = self.node_ca.issue(&node_id(node), Duration::from_secs(3600));
        self.client_with(url, Some(&leaf))
            .await
            .expect("connecting as an agent")
    }

    /// A client with the tests' reader identity (List and Watch only).
    pub async fn reader(&self, url: &str) -> RegistrarClient<Channel> {
        let leaf = self.node_ca.issue(READER_ID, Duration::from_secs(3600));
        self.client_with(url, Some(&leaf))
            .await
            .expect("connecting as a reader")
    }
}

/// A registrar binary serving mTLS with a [`ControlPlane`]'s certificates; killed when dropped.
pub struct RunningRegistrar {
    pub child: ChildGuard,
    /// `https://127.0.0.1:<port>`.
    pub url: String,
    pub admin: SocketAddr,
}

impl ControlPlane {
    /// Starts the registrar binary on `data_dir` with this control plane's flags and
    /// `extra`, and waits until its /ready says so.
    pub async fn spawn_registrar(&self, data_dir: &Path, extra: &[&str]) -> RunningRegistrar {
        let grpc = format!("127.0.0.1:{}", free_port());
        let admin: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
        let mut cmd = Command::new(binary("aether-registrar"));
        cmd.args(["--listen", &grpc, "--admin", &admin.to_string()])
            .arg("--data-dir")
            .arg(data_dir)
            .args(self.registrar_args())
            .args(extra)
            .envs(self.registrar_env());
        let child = ChildGuard::spawn("registrar", cmd);
        let deadline = Instant::now() + Duration::from_secs(20);
        while !http_get(&format!("http://{admin}/ready"), None)
            .await
            .is_ok_and(|r| r.status == 200)
        {
            assert!(Instant::now() < deadline, "registrar not ready:\n{}", child.logs());
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        RunningRegistrar {
            child,
            url: format!("https://{grpc}"),
            admin,
        }
    }
}
