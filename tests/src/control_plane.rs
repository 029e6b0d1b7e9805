//! The control plane's security for tests (proposals/010): a registrar serving
//! certificate and a node CA, the registrar and agent flags that use them, a fake
//! Kubernetes API server answering TokenReviews for the node bootstrap, and mTLS clients
//! of the registrar acting as an agent of a given node or as a reader.
//!
//! Every harness that runs the registrar with an agent (the mesh, the demo, the benches)
//! runs it through this: TLS on, the bootstrap as in a cluster.

use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use aether_common::tls::{self, CertSlot, Connector, ServerIdentity};
use aether_proto::registrar::v1::registrar_client::RegistrarClient;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::{Value, json};
use tonic::transport::{Channel, Endpoint};

use crate::identity::{Leaf, TRUST_DOMAIN, TestCa};
use crate::{ChildGuard, binary, free_port, http_get};

/// The DNS name the registrar's certificate carries and agents expect.
pub const REGISTRAR_NAME: &str = "aether-registrar.aether-system.svc";
/// The audience bootstrap tokens are bound to.
pub const AUDIENCE: &str = "aether-registrar";
/// The agents' ServiceAccount, as TokenReview names it.
pub const AGENT_USER: &str = "system:serviceaccount:aether-system:aether-agent";
/// The reader identity tests use to list and watch.
pub const READER_ID: &str = "spiffe://aether.test/ns/aether-system/sa/aether-test";
/// The bearer token the registrar presents to the fake API server.
const REGISTRAR_KUBE_TOKEN: &str = "registrar-service-account-token";

/// `spiffe://aether.test/aether/node/<node>`.
pub fn node_id(node: &str) -> String {
    format!("spiffe://{TRUST_DOMAIN}/aether/node/{node}")
}

pub struct ControlPlane {
    dir: PathBuf,
    pub registrar_ca: TestCa,
    pub node_ca: TestCa,
    pub kube: FakeKubeApi,
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
        let kube = FakeKubeApi::start();
        std::fs::write(dir.join("kubeconfig"), kube.kubeconfig()).unwrap();
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
        std::fs::write(&token, self.kube.token_for(node)).unwrap();
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

/// What the fake API server knows of a token.
#[derive(Clone, Debug)]
pub struct TokenInfo {
    pub username: String,
    pub node: Option<String>,
    pub audiences: Vec<String>,
}

/// A Kubernetes API server that answers only `POST
/// /apis/authentication.k8s.io/v1/tokenreviews`, as the real one does: the caller must
/// present a bearer token; a token is authenticated only for audiences it was issued
/// for; a pod-bound token carries its node in `user.extra`. Runs on its own thread.
pub struct FakeKubeApi {
    pub addr: SocketAddr,
    tokens: Arc<Mutex<BTreeMap<String, TokenInfo>>>,
    reviews: Arc<Mutex<Vec<String>>>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl FakeKubeApi {
    pub fn start() -> Self {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let addr = listener.local_addr().unwrap();
        let tokens: Arc<Mutex<BTreeMap<String, TokenInfo>>> = Arc::default();
        let reviews: Arc<Mutex<Vec<String>>> = Arc::default();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let state = (tokens.clone(), reviews.clone());
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(listener).unwrap();
                let serve = async {
                    loop {
                        let Ok((stream, _)) = listener.accept().await else {
                            continue;
                        };
                        let state = state.clone();
                        tokio::spawn(async move {
                            let service = service_fn(move |request| {
                                let state = state.clone();
                                async move { Ok::<_, Infallible>(answer(request, &state.0, &state.1).await) }
                            });
                            let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                                .serve_connection(TokioIo::new(stream), service)
                                .await;
                        });
                    }
                };
                tokio::select! {
                    _ = stopped => {}
                    _ = serve => {}
                }
            });
        });
        Self {
            addr,
            tokens,
            reviews,
            stop: Some(stop),
            thread: Some(thread),
        }
    }

    pub fn kubeconfig(&self) -> String {
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: http://{}\nusers:\n- name: \
             registrar\n  user:\n    token: {REGISTRAR_KUBE_TOKEN}\ncontexts:\n- name: fake\n  context:\n    cluster: \
             fake\n    user: registrar\ncurrent-context: fake\n",
            self.addr
        )
    }

    /// Mints a token as kubelet would for the agent pod on `node`.
    pub fn token_for(&self, node: &str) -> String {
        self.mint(TokenInfo {
            username: AGENT_USER.into(),
            node: Some(node.into()),
            audiences: vec![AUDIENCE.into()],
        })
    }

    /// Mints any token.
    pub fn mint(&self, info: TokenInfo) -> String {
        let token = format!("token-{}", uuid_like());
        self.tokens.lock().insert(token.clone(), info);
        token
    }

    /// Forgets a token: its pod is gone (the API server no longer authenticates it).
    pub fn revoke(&self, token: &str) {
        self.tokens.lock().remove(token);
    }

    /// The tokens reviewed so far, in order.
    pub fn reviews(&self) -> Vec<String> {
        self.reviews.lock().clone()
    }
}

impl Drop for FakeKubeApi {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn uuid_like() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    format!(
        "{}-{}-{:x}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    )
}

async fn answer(
    request: Request<hyper::body::Incoming>,
    tokens: &Mutex<BTreeMap<String, TokenInfo>>,
    reviews: &Mutex<Vec<String>>,
) -> Response<Full<Bytes>> {
    let reply = |status: u16, body: Value| {
        Response::builder()
            .status(status)
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body.to_string())))
            .unwrap()
    };
    let status_body = |code: u16, reason: &str, message: &str| json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message, "reason": reason, "code": code});
    let bearer = request
        .headers()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    if bearer.as_deref() != Some(&format!("Bearer {REGISTRAR_KUBE_TOKEN}")) {
        return reply(401, status_body(401, "Unauthorized", "Unauthorized"));
    }
    if request.method() != hyper::Method::POST || request.uri().path() != "/apis/authentication.k8s.io/v1/tokenreviews"
    {
        return reply(
            404,
            status_body(
                404,
                "NotFound",
                &format!("the fake serves only TokenReviews, not {}", request.uri()),
            ),
        );
    }
    let Ok(body) = request.into_body().collect().await else {
        return reply(400, status_body(400, "BadRequest", "unreadable body"));
    };
    let Ok(review) = serde_json::from_slice::<Value>(&body.to_bytes()) else {
        return reply(400, status_body(400, "BadRequest", "not JSON"));
    };
    let token = review["spec"]["token"].as_str().unwrap_or_default().to_owned();
    let wanted: Vec<String> = review["spec"]["audiences"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|a| a.as_str().map(str::to_owned))
        .collect();
    reviews.lock().push(token.clone());
    let info = tokens.lock().get(&token).cloned();
    let status = match info {
        None => json!({"authenticated": false, "error": "invalid bearer token, token lookup failed"}),
        Some(info) => {
            let granted: Vec<&String> = if wanted.is_empty() {
                info.audiences.iter().collect()
            } else {
                wanted.iter().filter(|a| info.audiences.contains(a)).collect()
            };
            if granted.is_empty() {
                json!({"authenticated": false, "error": "token audiences are invalid for the target audiences"})
            } else {
                let mut user = json!({"username": info.username, "uid": "uid-of-the-service-account", "groups": ["system:serviceaccounts"]});
                if let Some(node) = info.node {
                    user["extra"] = json!({"authentication.kubernetes.io/node-name": [node], "authentication.kubernetes.io/pod-name": ["aether-agent-x"]});
                }
                json!({"authenticated": true, "user": user, "audiences": granted})
            }
        }
    };
    reply(
        201,
        json!({"kind": "TokenReview", "apiVersion": "authentication.k8s.io/v1", "metadata": {"creationTimestamp": null}, "spec": review["spec"], "status": status}),
    )
}
