//! A running `aether-controller` (the real binary) serving a certificate from a test CA,
//! and an HTTPS client that calls it as kube-apiserver does: the CA bundle of the webhook
//! configuration, the Service's DNS name, HTTP/1.1, one AdmissionReview per POST.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, ServerName};

use crate::identity::TestCa;
use crate::{ChildGuard, binary, free_port};

/// The name kube-apiserver dials: the controller's Service.
pub const SERVICE_NAME: &str = "aether-controller.aether-system.svc";

pub struct Controller {
    pub child: ChildGuard,
    pub webhook: SocketAddr,
    pub admin: SocketAddr,
    /// The CA bundle that verifies its serving certificate (DER).
    ca: Vec<u8>,
    _dir: tempfile::TempDir,
}

impl Controller {
    /// Starts the controller with `args` added, serving a certificate from a fresh test
    /// CA, and waits until it is ready.
    pub async fn start(args: &[&str]) -> Controller {
        Self::start_with(args, &[]).await
    }

    /// [`Controller::start`] with environment variables set (e.g. `KUBECONFIG`).
    pub async fn start_with(args: &[&str], env: &[(&str, &str)]) -> Controller {
        let ca = TestCa::new("aether-controller test CA");
        let leaf = ca.issue_server(SERVICE_NAME, Duration::from_secs(3600));
        Self::serving(&leaf.cert_pem, &leaf.key_pem, &ca.cert_pem, args, env).await
    }

    /// Starts the controller serving `cert_pem`/`key_pem`, verified by `ca_pem` (e.g. the
    /// material a Helm chart generated).
    pub async fn serving(
        cert_pem: &str,
        key_pem: &str,
        ca_pem: &str,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> Controller {
        let dir = tempfile::tempdir().unwrap();
        let (cert, key) = (dir.path().join("tls.crt"), dir.path().join("tls.key"));
        std::fs::write(&cert, cert_pem).unwrap();
        std::fs::write(&key, key_pem).unwrap();
        let ca = CertificateDer::from_pem_slice(ca_pem.as_bytes())
            .expect("a CA certificate")
            .to_vec();
        let webhook: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
        let admin: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
        let mut cmd = std::process::Command::new(binary("aether-controller"));
        cmd.args(["--listen", &webhook.to_string(), "--admin", &admin.to_string()])
            .arg("--tls-cert")
            .arg(&cert)
            .arg("--tls-key")
            .arg(&key)
            .args(args)
            .envs(env.iter().copied());
        let child = ChildGuard::spawn("aether-controller", cmd);
        crate::mesh::wait_ready(admin, &child).await;
        Controller {
            child,
            webhook,
            admin,
            ca,
            _dir: dir,
        }
    }

    /// A kept-alive HTTPS connection, verified as kube-apiserver verifies it.
    pub async fn connect(&self) -> WebhookConnection {
        let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(self.tls().await))
            .await
            .unwrap();
        tokio::spawn(connection);
        WebhookConnection { sender }
    }

    /// The TLS stream alone (for a request written by hand).
    pub async fn tls(&self) -> tokio_rustls::client::TlsStream<tokio::net::TcpStream> {
        let mut roots = rustls::RootCertStore::empty();
        roots.add(CertificateDer::from(self.ca.clone())).unwrap();
        let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
        let mut config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        let tcp = tokio::net::TcpStream::connect(self.webhook).await.unwrap();
        tcp.set_nodelay(true).unwrap();
        let name = ServerName::try_from(SERVICE_NAME).unwrap();
        tokio_rustls::TlsConnector::from(Arc::new(config))
            .connect(name, tcp)
            .await
            .expect("a TLS handshake verified against the CA bundle")
    }
}

pub struct WebhookConnection {
    sender: hyper::client::conn::http1::SendRequest<Full<Bytes>>,
}

impl WebhookConnection {
    /// `method path` with `body` as JSON; the status and the body of the answer.
    pub async fn send(&mut self, method: &str, path: &str, body: Vec<u8>) -> (u16, Vec<u8>) {
        let request = hyper::Request::builder()
            .method(method)
            .uri(path)
            .header("host", SERVICE_NAME)
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body)))
            .unwrap();
        // An HTTP/1.1 connection takes the next request once the last exchange is done.
        self.sender.ready().await.expect("the connection is open");
        let response = self.sender.send_request(request).await.expect("an answer");
        let status = response.status().as_u16();
        let body = response.into_body().collect().await.unwrap().to_bytes().to_vec();
        (status, body)
    }

    /// POSTs one AdmissionReview.
    pub async fn review(&mut self, path: &str, review: &serde_json::Value) -> serde_json::Value {
        let (status, body) = self.send("POST", path, serde_json::to_vec(review).unwrap()).await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
        serde_json::from_slice(&body).unwrap()
    }
}

/// The AdmissionReview kube-apiserver sends for an `operation` on `object` (`kind` as
/// group/version/kind, e.g. `("", "v1", "Pod")`).
pub fn admission_review(
    operation: &str,
    (group, version, kind): (&str, &str, &str),
    object: &serde_json::Value,
) -> serde_json::Value {
    let namespace = object["metadata"]["namespace"].as_str().unwrap_or("default");
    serde_json::json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": uuid(),
            "kind": {"group": group, "version": version, "kind": kind},
            "resource": {"group": group, "version": version, "resource": format!("{}s", kind.to_lowercase())},
            "requestKind": {"group": group, "version": version, "kind": kind},
            "requestResource": {"group": group, "version": version, "resource": format!("{}s", kind.to_lowercase())},
            "name": object["metadata"]["name"].as_str().unwrap_or_default(),
            "namespace": namespace,
            "operation": operation,
            "userInfo": {"username": "system:serviceaccount:kube-system:replicaset-controller", "uid": "2f1a", "groups": ["system:serviceaccounts", "system:authenticated"]},
            "object": object,
            "oldObject": null,
            "dryRun": false,
            "options": {"apiVersion": "meta.k8s.io/v1", "kind": format!("{}Options", operation[..1].to_owned() + &operation[1..].to_lowercase())}
        }
    })
}

/// A request uid, as kube-apiserver makes one per call.
fn uuid() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(1);
    format!("00000000-0000-4000-8000-{:012x}", NEXT.fetch_add(1, Ordering::Relaxed))
}
