//! Tiny test servers and an HTTP client that live inside pods.
//!
//! [`TestPod::serve_http`] answers every request (HTTP/1.1 or h2c) with 200 and a JSON description of the request,
//! so a test sees which pod served it and what arrived there; [`TestPod::serve_tcp_echo`] greets with its name and
//! echoes. [`TestPod::http_get`] and [`TestPod::http_request`] are clients whose socket lives in the pod; the free
//! functions [`http_get`] and [`http_request`] do the same from the caller's own (root) netns.
//!
//! Servers run on the current tokio runtime: create them from inside one. They stop when their guard is dropped.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper::{Request, Response, Uri};
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::task::{JoinHandle, JoinSet};

use crate::netns::TestPod;
use rustls_pki_types::pem::PemObject;

/// How long a client request may take, connect included.
pub const CLIENT_TIMEOUT: Duration = Duration::from_secs(5);

/// A running HTTP server; dropping it stops the accept loop and every open connection.
pub struct HttpServer {
    addr: SocketAddr,
    requests: Arc<AtomicU64>,
    task: JoinHandle<()>,
}

impl HttpServer {
    /// The bound address (useful when bound to port 0).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// How many requests the server has answered.
    pub fn requests(&self) -> u64 {
        self.requests.load(Ordering::SeqCst)
    }
}

impl Drop for HttpServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A running TCP echo server; dropping it stops the accept loop and every open connection.
pub struct TcpServer {
    addr: SocketAddr,
    connections: Arc<AtomicU64>,
    task: JoinHandle<()>,
}

impl TcpServer {
    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// How many connections the server has accepted.
    pub fn connections(&self) -> u64 {
        self.connections.load(Ordering::SeqCst)
    }
}

impl Drop for TcpServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A response as the client saw it.
#[derive(Debug, Clone)]
pub struct HttpReply {
    pub status: u16,
    /// Lower-case header names; repeated headers joined with ", ".
    pub headers: BTreeMap<String, String>,
    pub body: String,
}

impl HttpReply {
    /// The body parsed as JSON (what [`TestPod::serve_http`] answers); panics with the body if it is not JSON.
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body)
            .unwrap_or_else(|e| panic!("body is not JSON ({e}); status {}: {}", self.status, self.body))
    }
}

impl TestPod {
    /// Serves HTTP/1.1 and h2c (prior knowledge) on `addr` inside the pod. Every request gets 200 and
    /// `{"pod": name, "method", "path", "query", "version", "host", "headers": {lower-case name: value}}` where `host`
    /// is the Host header, else the `:authority`. Must be called from within a tokio runtime; panics if it cannot
    /// bind.
    pub fn serve_http(&self, addr: SocketAddr, name: &str) -> HttpServer {
        self.serve_described(addr, name, None)
    }

    /// [`TestPod::serve_http`] behind TLS (HTTP/1.1 only) with `certificate`: a server outside the mesh that
    /// speaks TLS itself, as an external service's origination reaches. Panics if it cannot bind.
    pub fn serve_https(&self, addr: SocketAddr, name: &str, certificate: &crate::identity::Leaf) -> HttpServer {
        let chain = vec![rustls_pki_types::CertificateDer::from(certificate.cert_der.clone())];
        let key = rustls_pki_types::PrivateKeyDer::Pkcs8(certificate.key_der.clone().into());
        let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
        let config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .expect("TLS versions")
            .with_no_client_auth()
            .with_single_cert(chain, key)
            .expect("the test certificate and key");
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        self.serve_described(addr, name, Some(acceptor))
    }

    /// The server of [`TestPod::serve_http`], in plaintext (HTTP/1.1 and h2c) or behind `tls` (HTTP/1.1).
    fn serve_described(&self, addr: SocketAddr, name: &str, tls: Option<tokio_rustls::TlsAcceptor>) -> HttpServer {
        let listener = self.listen(addr);
        let addr = listener.local_addr().expect("local_addr");
        let requests = Arc::new(AtomicU64::new(0));
        let name: Arc<str> = Arc::from(name);
        let counter = Arc::clone(&requests);
        let task = tokio::spawn(async move {
            // Dropping the accept task drops the set, which aborts every connection.
            let mut connections = JoinSet::new();
            loop {
                tokio::select! {
                    accepted = listener.accept() => {
                        let Ok((stream, _)) = accepted else { continue };
                        let (name, counter, tls) = (Arc::clone(&name), Arc::clone(&counter), tls.clone());
                        connections.spawn(async move {
                            let service = service_fn(move |req| {
                                counter.fetch_add(1, Ordering::SeqCst);
                                describe(Arc::clone(&name), req)
                            });
                            let _ = match tls {
                                None => auto::Builder::new(TokioExecutor::new())
                                    .serve_connection(TokioIo::new(stream), service)
                                    .await,
                                Some(tls) => {
                                    let Ok(stream) = tls.accept(stream).await else { return };
                                    hyper::server::conn::http1::Builder::new()
                                        .serve_connection(TokioIo::new(stream), service)
                                        .await
                                        .map_err(Into::into)
                                }
                            };
                        });
                    }
                    Some(_) = connections.join_next(), if !connections.is_empty() => {}
                }
            }
        });
        HttpServer { addr, requests, task }
    }

    /// A raw TCP server on `addr` inside the pod that writes `"<name>\n"` to every connection and then echoes what it
    /// reads. Must be called from within a tokio runtime; panics if it cannot bind.
    pub fn serve_tcp_echo(&self, addr: SocketAddr) -> TcpServer {
        let listener = self.listen(addr);
        let addr = listener.local_addr().expect("local_addr");
        let connections = Arc::new(AtomicU64::new(0));
        let counter = Arc::clone(&connections);
        let greeting = Bytes::from(format!("{}\n", self.name()));
        let task = tokio::spawn(async move {
            let mut conns = JoinSet::new();
            loop {
                tokio::select! {
                    accepted = listener.accept() => {
                        let Ok((mut stream, _)) = accepted else { continue };
                        counter.fetch_add(1, Ordering::SeqCst);
                        let greeting = greeting.clone();
                        conns.spawn(async move {
                            if stream.write_all(&greeting).await.is_err() {
                                return;
                            }
                            let mut buf = [0u8; 16 * 1024];
                            loop {
                                match stream.read(&mut buf).await {
                                    Ok(0) | Err(_) => return,
                                    Ok(n) => {
                                        if stream.write_all(&buf[..n]).await.is_err() {
                                            return;
                                        }
                                    }
                                }
                            }
                        });
                    }
                    Some(_) = conns.join_next(), if !conns.is_empty() => {}
                }
            }
        });
        TcpServer {
            addr,
            connections,
            task,
        }
    }

    /// An HTTP/1.1 GET of `url` (`http://<ip>[:port]/path?query`) from inside the pod, with `host` as the Host
    /// header (default: the URL's authority). Err on connect/protocol failure or after [`CLIENT_TIMEOUT`].
    pub async fn http_get(&self, url: &str, host: Option<&str>) -> Result<HttpReply, String> {
        self.http_request("GET", url, host, &[], "").await
    }

    /// Like [`TestPod::http_get`] with any method, extra headers and a body.
    pub async fn http_request(
        &self,
        method: &str,
        url: &str,
        host: Option<&str>,
        headers: &[(&str, &str)],
        body: &str,
    ) -> Result<HttpReply, String> {
        let target = Target::parse(url)?;
        let socket = self.run(|| match target.addr.ip() {
            IpAddr::V4(_) => TcpSocket::new_v4(),
            IpAddr::V6(_) => TcpSocket::new_v6(),
        });
        let socket = socket.map_err(|e| format!("socket in pod {}: {e}", self.name()))?;
        request(socket, target, method, host, headers, body).await
    }

    fn listen(&self, addr: SocketAddr) -> TcpListener {
        let runtime = tokio::runtime::Handle::try_current();
        assert!(
            runtime.is_ok(),
            "pod {}: test servers must be started from within a tokio runtime",
            self.name()
        );
        let listener = self
            .run(move || std::net::TcpListener::bind(addr))
            .unwrap_or_else(|e| panic!("pod {} ({}): bind {addr}: {e}", self.name(), self.netns_name()));
        listener.set_nonblocking(true).expect("set_nonblocking");
        TcpListener::from_std(listener).expect("tokio TcpListener::from_std")
    }
}

/// An HTTP/1.1 GET from the caller's own network namespace (normally the root netns); see [`TestPod::http_get`].
pub async fn http_get(url: &str, host: Option<&str>) -> Result<HttpReply, String> {
    http_request("GET", url, host, &[], "").await
}

/// An HTTP/1.1 request from the caller's own network namespace; see [`TestPod::http_request`].
pub async fn http_request(
    method: &str,
    url: &str,
    host: Option<&str>,
    headers: &[(&str, &str)],
    body: &str,
) -> Result<HttpReply, String> {
    let target = Target::parse(url)?;
    let socket = match target.addr.ip() {
        IpAddr::V4(_) => TcpSocket::new_v4(),
        IpAddr::V6(_) => TcpSocket::new_v6(),
    };
    let socket = socket.map_err(|e| format!("socket: {e}"))?;
    request(socket, target, method, host, headers, body).await
}

struct Target {
    addr: SocketAddr,
    authority: String,
    path_and_query: String,
    url: String,
}

impl Target {
    /// `http://<ip literal>[:port][/path]`; names are not resolved (pods have no resolver of their own).
    fn parse(url: &str) -> Result<Target, String> {
        let uri: Uri = url.parse().map_err(|e| format!("bad URL {url:?}: {e}"))?;
        if uri.scheme_str() != Some("http") {
            return Err(format!("bad URL {url:?}: only http:// is supported"));
        }
        let authority = uri.authority().ok_or_else(|| format!("bad URL {url:?}: no host"))?;
        let host = authority.host().trim_start_matches('[').trim_end_matches(']');
        let ip: IpAddr = host
            .parse()
            .map_err(|_| format!("bad URL {url:?}: the host must be an IP address"))?;
        Ok(Target {
            addr: SocketAddr::new(ip, authority.port_u16().unwrap_or(80)),
            authority: authority.to_string(),
            path_and_query: uri.path_and_query().map_or("/".to_string(), |p| p.to_string()),
            url: url.to_string(),
        })
    }
}

async fn request(
    socket: TcpSocket,
    target: Target,
    method: &str,
    host: Option<&str>,
    headers: &[(&str, &str)],
    body: &str,
) -> Result<HttpReply, String> {
    let url = target.url.clone();
    let exchange = async move {
        let stream: TcpStream = socket.connect(target.addr).await.map_err(|e| format!("connect: {e}"))?;
        let authority = host.unwrap_or(&target.authority);
        exchange(stream, method, &target.path_and_query, authority, headers, body).await
    };
    match tokio::time::timeout(CLIENT_TIMEOUT, exchange).await {
        Ok(result) => result.map_err(|e| format!("{method} {url}: {e}")),
        Err(_) => Err(format!("{method} {url}: timed out after {CLIENT_TIMEOUT:?}")),
    }
}

/// An HTTP/1.1 request over HTTPS from the caller's own network namespace to `addr`, with `server_name` as SNI,
/// trusting only `ca_pem`. Also returns the DER certificates the server presented (leaf first).
#[allow(clippy::too_many_arguments)]
pub async fn https_request(
    addr: SocketAddr,
    server_name: &str,
    ca_pem: &str,
    method: &str,
    path: &str,
    host: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Result<(HttpReply, Vec<Vec<u8>>), String> {
    let exchange = async {
        let mut roots = rustls::RootCertStore::empty();
        for cert in rustls_pki_types::CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
            roots
                .add(cert.map_err(|e| format!("CA PEM: {e}"))?)
                .map_err(|e| format!("CA: {e}"))?;
        }
        let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
        let config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| format!("TLS config: {e}"))?
            .with_root_certificates(roots)
            .with_no_client_auth();
        let name = rustls_pki_types::ServerName::try_from(server_name.to_owned()).map_err(|e| format!("SNI: {e}"))?;
        let tcp = TcpStream::connect(addr).await.map_err(|e| format!("connect: {e}"))?;
        let tls = tokio_rustls::TlsConnector::from(Arc::new(config))
            .connect(name, tcp)
            .await
            .map_err(|e| format!("TLS handshake: {e}"))?;
        let presented: Vec<Vec<u8>> = (tls.get_ref().1.peer_certificates().unwrap_or_default())
            .iter()
            .map(|c| c.to_vec())
            .collect();
        let reply = exchange(tls, method, path, host, headers, body).await?;
        Ok((reply, presented))
    };
    match tokio::time::timeout(CLIENT_TIMEOUT, exchange).await {
        Ok(result) => result.map_err(|e: String| format!("{method} https://{server_name}{path} at {addr}: {e}")),
        Err(_) => Err(format!(
            "{method} https://{server_name}{path}: timed out after {CLIENT_TIMEOUT:?}"
        )),
    }
}

/// One HTTP/1.1 request and its whole answer over `stream`.
async fn exchange<S>(
    stream: S,
    method: &str,
    path_and_query: &str,
    authority: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Result<HttpReply, String>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| format!("handshake: {e}"))?;
    let driver = tokio::spawn(conn);
    let mut req = Request::builder()
        .method(method)
        .uri(path_and_query)
        .header(hyper::header::HOST, authority);
    for (name, value) in headers {
        req = req.header(*name, *value);
    }
    let req = req
        .body(Full::new(Bytes::copy_from_slice(body.as_bytes())))
        .map_err(|e| format!("request: {e}"))?;
    let result: Result<HttpReply, String> = async {
        let resp = sender.send_request(req).await.map_err(|e| format!("send: {e}"))?;
        let status = resp.status().as_u16();
        let mut headers = BTreeMap::<String, String>::new();
        for (name, value) in resp.headers() {
            let value = String::from_utf8_lossy(value.as_bytes()).into_owned();
            headers
                .entry(name.as_str().to_string())
                .and_modify(|v| {
                    v.push_str(", ");
                    v.push_str(&value)
                })
                .or_insert(value);
        }
        let body = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| format!("body: {e}"))?
            .to_bytes();
        Ok(HttpReply {
            status,
            headers,
            body: String::from_utf8_lossy(&body).into_owned(),
        })
    }
    .await;
    driver.abort();
    result
}

async fn describe(pod: Arc<str>, req: Request<Incoming>) -> Result<Response<Full<Bytes>>, Infallible> {
    let mut headers = serde_json::Map::new();
    for (name, value) in req.headers() {
        let value = String::from_utf8_lossy(value.as_bytes()).into_owned();
        match headers.get_mut(name.as_str()) {
            Some(serde_json::Value::String(v)) => {
                v.push_str(", ");
                v.push_str(&value);
            }
            _ => {
                headers.insert(name.as_str().to_string(), value.into());
            }
        }
    }
    let host = req
        .headers()
        .get(hyper::header::HOST)
        .map(|h| String::from_utf8_lossy(h.as_bytes()).into_owned())
        .or_else(|| req.uri().authority().map(|a| a.to_string()));
    let json = serde_json::json!({
        "pod": &*pod,
        "method": req.method().as_str(),
        "path": req.uri().path(),
        "query": req.uri().query(),
        "version": format!("{:?}", req.version()),
        "host": host,
        "headers": headers,
    });
    let body = Bytes::from(json.to_string());
    let resp = Response::builder()
        .status(200)
        .header(hyper::header::CONTENT_TYPE, "application/json")
        .body(Full::new(body))
        .expect("response");
    Ok(resp)
}
