//! mTLS for the control plane (agents, readers ↔ registrar): PEM loading, a
//! certificate slot that rotates without a restart, the peer's identity, the server's
//! accept stream and the client's connector for tonic.
//!
//! One crypto provider, aws-lc-rs (rust-notes.md). Identities are X.509 certificates
//! with a SPIFFE URI SAN (what SPIRE issues and what the registrar's bootstrap issues);
//! a server may instead be named by a DNS SAN.

use parking_lot::RwLock;
use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime};

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::{ResolvesClientCert, verify_server_cert_signed_by_trust_anchor, verify_server_name};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::server::{ClientHello, ParsedCertificate, ResolvesServerCert, WebPkiClientVerifier};
use rustls::sign::CertifiedKey;
use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, ServerConfig, SignatureScheme};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
use tonic::transport::server::Connected;

/// How long a TLS handshake may take before the connection is dropped.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// How often certificate files are checked for a rotation.
pub const RELOAD_INTERVAL: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{flag} {path}: {reason}")]
    File {
        flag: &'static str,
        path: String,
        reason: String,
    },
    #[error("{0}")]
    Config(String),
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::aws_lc_rs::default_provider())
}

/// Splits PEM text into its blocks, each with its armour (what rcgen's `from_*_pem`
/// take one at a time).
pub fn pem_blocks(text: &str) -> Vec<String> {
    let mut blocks = Vec::new();
    let mut current = String::new();
    for line in text.lines() {
        if line.starts_with("-----BEGIN ") {
            current.clear();
        }
        current.push_str(line.trim_end());
        current.push('\n');
        if line.starts_with("-----END ") {
            blocks.push(std::mem::take(&mut current));
        }
    }
    blocks
}

/// Every certificate of a PEM file (`flag` names it in errors).
pub fn read_certs(flag: &'static str, path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let file_error = |reason: String| TlsError::File {
        flag,
        path: path.display().to_string(),
        reason,
    };
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| file_error(e.to_string()))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| file_error(e.to_string()))?;
    if certs.is_empty() {
        return Err(file_error("no PEM CERTIFICATE block".into()));
    }
    Ok(certs)
}

/// The private key of a PEM file (PKCS#8, SEC1 or PKCS#1).
pub fn read_key(flag: &'static str, path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    PrivateKeyDer::from_pem_file(path).map_err(|e| TlsError::File {
        flag,
        path: path.display().to_string(),
        reason: e.to_string(),
    })
}

/// A trust store from PEM certificates.
pub fn roots(flag: &'static str, certs: Vec<CertificateDer<'static>>) -> Result<Arc<RootCertStore>, TlsError> {
    let mut store = RootCertStore::empty();
    for cert in certs {
        store
            .add(cert)
            .map_err(|e| TlsError::Config(format!("{flag}: not a usable CA certificate: {e}")))?;
    }
    Ok(Arc::new(store))
}

/// A certificate chain and its key, checked to belong together.
pub fn certified_key(
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
) -> Result<Arc<CertifiedKey>, TlsError> {
    let certified = CertifiedKey::from_der(chain, key, &provider())
        .map_err(|e| TlsError::Config(format!("the certificate and key do not form an identity: {e}")))?;
    Ok(Arc::new(certified))
}

/// The certificate this process presents; replaced on rotation, read at each handshake.
/// Empty until the first certificate arrives (a client then presents none).
#[derive(Clone)]
pub struct CertSlot(Arc<SlotInner>);

struct SlotInner {
    key: RwLock<Option<Arc<CertifiedKey>>>,
    /// Bumped by every [`CertSlot::set`].
    generation: watch::Sender<u64>,
}

impl Default for CertSlot {
    fn default() -> Self {
        Self(Arc::new(SlotInner {
            key: RwLock::new(None),
            generation: watch::Sender::new(0),
        }))
    }
}

impl std::fmt::Debug for CertSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The key is never printed; the identity is enough to tell slots apart.
        f.debug_tuple("CertSlot").field(&self.identity()).finish()
    }
}

impl CertSlot {
    pub fn new(key: Arc<CertifiedKey>) -> Self {
        let slot = Self::default();
        *slot.0.key.write() = Some(key);
        slot
    }

    /// Replaces the certificate: the next handshake presents it.
    pub fn set(&self, key: Arc<CertifiedKey>) {
        *self.0.key.write() = Some(key);
        self.0.generation.send_modify(|g| *g += 1);
    }

    pub fn current(&self) -> Option<Arc<CertifiedKey>> {
        self.0.key.read().clone()
    }

    /// Changes after every [`CertSlot::set`].
    pub fn changed(&self) -> watch::Receiver<u64> {
        self.0.generation.subscribe()
    }

    /// The identity of the current certificate.
    pub fn identity(&self) -> Option<PeerIdentity> {
        let key = self.current()?;
        PeerIdentity::from_leaf(key.end_entity_cert().ok()?).ok()
    }

    /// A slot loaded from `cert`/`key` files and reloaded when they change (a mounted
    /// Secret is rewritten in place by kubelet), until `shutdown`.
    pub fn from_files(files: CertFiles, shutdown: CancellationToken) -> Result<Self, TlsError> {
        let (key, mut seen) = files.load()?;
        let slot = Self::new(key);
        let reloaded = slot.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(RELOAD_INTERVAL);
            tick.tick().await;
            loop {
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tick.tick() => {}
                }
                let Ok(bytes) = files.bytes() else { continue };
                if bytes == seen {
                    continue;
                }
                match files.load() {
                    Ok((key, now)) => {
                        reloaded.set(key);
                        seen = now;
                        tracing::info!(cert = %files.cert.display(), identity = ?reloaded.identity(),
                            "reloaded the TLS certificate");
                    }
                    // Mid-rewrite (cert new, key old) or broken: keep serving the old one.
                    Err(error) => {
                        tracing::warn!(%error, "the TLS certificate files changed but do not load; keeping the previous one")
                    }
                }
            }
        });
        Ok(slot)
    }
}

impl ResolvesServerCert for CertSlot {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        self.current()
    }
}

impl ResolvesClientCert for CertSlot {
    fn resolve(&self, _hints: &[&[u8]], _schemes: &[SignatureScheme]) -> Option<Arc<CertifiedKey>> {
        self.current()
    }

    fn has_certs(&self) -> bool {
        self.current().is_some()
    }
}

/// A certificate chain file and its key file, with the flags that named them.
#[derive(Clone, Debug)]
pub struct CertFiles {
    pub cert_flag: &'static str,
    pub cert: PathBuf,
    pub key_flag: &'static str,
    pub key: PathBuf,
}

/// The raw bytes of a cert file and its key file, to notice a rewrite.
type FileBytes = (Vec<u8>, Vec<u8>);

impl CertFiles {
    fn bytes(&self) -> io::Result<FileBytes> {
        Ok((std::fs::read(&self.cert)?, std::fs::read(&self.key)?))
    }

    fn load(&self) -> Result<(Arc<CertifiedKey>, FileBytes), TlsError> {
        let bytes = self.bytes().map_err(|e| TlsError::File {
            flag: self.cert_flag,
            path: self.cert.display().to_string(),
            reason: e.to_string(),
        })?;
        let key = certified_key(
            read_certs(self.cert_flag, &self.cert)?,
            read_key(self.key_flag, &self.key)?,
        )?;
        Ok((key, bytes))
    }
}

/// Who is at the other end of a connection, from its verified leaf certificate.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerIdentity {
    /// The URI SAN starting with `spiffe://`, if any.
    pub spiffe_id: Option<String>,
    pub dns_names: Vec<String>,
    pub not_after: SystemTime,
}

/// A leaf certificate that is not X.509 DER.
#[derive(Debug, thiserror::Error)]
#[error("parsing the leaf certificate ({size} bytes): {reason}")]
pub struct BadLeaf {
    size: usize,
    reason: String,
}

impl PeerIdentity {
    pub fn from_leaf(der: &CertificateDer<'_>) -> Result<Self, BadLeaf> {
        let (_, cert) = x509_parser::parse_x509_certificate(der).map_err(|e| BadLeaf {
            size: der.len(),
            reason: e.to_string(),
        })?;
        let mut identity = Self {
            spiffe_id: None,
            dns_names: Vec::new(),
            not_after: SystemTime::UNIX_EPOCH
                + Duration::from_secs(u64::try_from(cert.validity().not_after.timestamp()).unwrap_or_default()),
        };
        if let Ok(Some(san)) = cert.subject_alternative_name() {
            for name in &san.value.general_names {
                match name {
                    x509_parser::extensions::GeneralName::URI(uri) if uri.starts_with("spiffe://") => {
                        identity.spiffe_id.get_or_insert_with(|| (*uri).to_owned());
                    }
                    x509_parser::extensions::GeneralName::DNSName(dns) => identity.dns_names.push((*dns).to_owned()),
                    _ => {}
                }
            }
        }
        Ok(identity)
    }

    /// For logs and refusals: the SPIFFE ID, else the first DNS name.
    pub fn name(&self) -> &str {
        self.spiffe_id
            .as_deref()
            .or(self.dns_names.first().map(String::as_str))
            .unwrap_or("<no SAN>")
    }
}

// ---------------------------------------------------------------------------------------
// Server side

/// What a request handler learns of its connection (a tonic request extension).
#[derive(Clone, Debug)]
pub struct PeerInfo {
    pub remote: Option<SocketAddr>,
    /// The verified client certificate's identity; `None` without TLS or when the
    /// client presented no certificate.
    pub identity: Option<Arc<PeerIdentity>>,
}

/// An accepted connection, TLS or (with `--insecure`) plain.
pub enum Conn {
    Tls(Box<tokio_rustls::server::TlsStream<TcpStream>>, PeerInfo),
    Plain(TcpStream, PeerInfo),
}

impl Connected for Conn {
    type ConnectInfo = PeerInfo;
    fn connect_info(&self) -> PeerInfo {
        match self {
            Conn::Tls(_, info) | Conn::Plain(_, info) => info.clone(),
        }
    }
}

impl AsyncRead for Conn {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Conn::Tls(s, _) => Pin::new(s.as_mut()).poll_read(cx, buf),
            Conn::Plain(s, _) => Pin::new(s).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Conn {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Conn::Tls(s, _) => Pin::new(s.as_mut()).poll_write(cx, buf),
            Conn::Plain(s, _) => Pin::new(s).poll_write(cx, buf),
        }
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Conn::Tls(s, _) => Pin::new(s.as_mut()).poll_flush(cx),
            Conn::Plain(s, _) => Pin::new(s).poll_flush(cx),
        }
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Conn::Tls(s, _) => Pin::new(s.as_mut()).poll_shutdown(cx),
            Conn::Plain(s, _) => Pin::new(s).poll_shutdown(cx),
        }
    }
}

/// A server TLS config: presents `cert`; verifies a client certificate against
/// `client_roots` when one is presented (a client without one is anonymous, and each
/// method decides whether that is enough: only the bootstrap accepts it).
pub fn server_config(cert: CertSlot, client_roots: Arc<RootCertStore>) -> Result<Arc<ServerConfig>, TlsError> {
    let provider = provider();
    let verifier = WebPkiClientVerifier::builder_with_provider(client_roots, provider.clone())
        .allow_unauthenticated()
        .build()
        .map_err(|e| TlsError::Config(format!("client certificate verifier: {e}")))?;
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Config(e.to_string()))?
        .with_client_cert_verifier(verifier)
        .with_cert_resolver(Arc::new(cert));
    config.alpn_protocols = vec![b"h2".to_vec()];
    // No resumption: a resumed session carries the identity of the one it resumes (none,
    // for an agent's first connection before its bootstrap), and every connection should
    // show the certificate it holds now. Connections are long-lived; full handshakes are rare.
    config.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
    config.send_tls13_tickets = 0;
    Ok(Arc::new(config))
}

/// Accepted connections for `tonic::transport::Server::serve_with_incoming*`: TCP with
/// NODELAY and keepalive, then (with `tls`) a handshake on its own task, so a slow or
/// hostile client never holds up the next accept. A failed handshake is logged (with
/// rustls' reason: unknown CA, expired, no certificate…) and dropped.
pub fn incoming(
    listener: TcpListener,
    tls: Option<Arc<ServerConfig>>,
    keepalive: Duration,
    shutdown: CancellationToken,
) -> impl futures_core::Stream<Item = io::Result<Conn>> {
    let (accepted, stream) = mpsc::channel(64);
    let acceptor = tls.map(tokio_rustls::TlsAcceptor::from);
    tokio::spawn(async move {
        loop {
            let (tcp, remote) = tokio::select! {
                _ = shutdown.cancelled() => return,
                result = listener.accept() => match result {
                    Ok(accepted) => accepted,
                    Err(error) => {
                        tracing::warn!(%error, "accepting a connection failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                },
            };
            let _ = tcp.set_nodelay(true);
            let _ = socket2::SockRef::from(&tcp).set_tcp_keepalive(&socket2::TcpKeepalive::new().with_time(keepalive));
            let Some(acceptor) = acceptor.clone() else {
                let info = PeerInfo {
                    remote: Some(remote),
                    identity: None,
                };
                if accepted.send(Ok(Conn::Plain(tcp, info))).await.is_err() {
                    return;
                }
                continue;
            };
            let accepted = accepted.clone();
            tokio::spawn(async move {
                let handshake = tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await;
                let tls = match handshake {
                    Ok(Ok(tls)) => tls,
                    Ok(Err(error)) => {
                        tracing::warn!(%remote, %error, "TLS handshake refused");
                        return;
                    }
                    Err(_) => {
                        tracing::warn!(%remote, "TLS handshake timed out");
                        return;
                    }
                };
                let identity = tls
                    .get_ref()
                    .1
                    .peer_certificates()
                    .and_then(|chain| chain.first())
                    .and_then(|leaf| PeerIdentity::from_leaf(leaf).ok())
                    .map(Arc::new);
                let info = PeerInfo {
                    remote: Some(remote),
                    identity,
                };
                let _ = accepted.send(Ok(Conn::Tls(Box::new(tls), info))).await;
            });
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(stream)
}

// ---------------------------------------------------------------------------------------
// Client side

/// Who the client expects the server to be.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ServerIdentity {
    /// A DNS SAN (e.g. `aether-registrar.aether-system.svc`).
    Dns(String),
    /// A SPIFFE URI SAN (e.g. `spiffe://cluster.local/ns/aether-system/sa/aether-registrar`).
    Spiffe(String),
    /// Whoever the roots vouch for: the caller reads the identity off the connection
    /// (a diagnostic probe asking who a server is; never parsed from a flag).
    Trusted,
}

impl std::str::FromStr for ServerIdentity {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if s.starts_with("spiffe://") {
            return Ok(Self::Spiffe(s.to_owned()));
        }
        ServerName::try_from(s.to_owned()).map_err(|e| {
            format!(
                "{}: neither a spiffe:// ID nor a DNS name ({e})",
                crate::quote::quote(s)
            )
        })?;
        Ok(Self::Dns(s.to_owned()))
    }
}

impl std::fmt::Display for ServerIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Dns(name) | Self::Spiffe(name) => f.write_str(name),
            Self::Trusted => f.write_str("<any trusted identity>"),
        }
    }
}

/// Verifies the server's chain against our roots, then its name: a DNS SAN the usual
/// way, or an exact SPIFFE URI SAN (what a SPIRE-issued registrar certificate carries).
#[derive(Debug)]
struct PinnedServer {
    roots: Arc<RootCertStore>,
    expected: ServerIdentity,
    provider: Arc<CryptoProvider>,
}

impl ServerCertVerifier for PinnedServer {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let cert = ParsedCertificate::try_from(end_entity)?;
        verify_server_cert_signed_by_trust_anchor(
            &cert,
            &self.roots,
            intermediates,
            now,
            self.provider.signature_verification_algorithms.all,
        )?;
        match &self.expected {
            ServerIdentity::Dns(name) => {
                let name = ServerName::try_from(name.as_str())
                    .map_err(|e| rustls::Error::General(format!("expected server name: {e}")))?;
                verify_server_name(&cert, &name)?;
            }
            ServerIdentity::Spiffe(id) => {
                let identity =
                    PeerIdentity::from_leaf(end_entity).map_err(|e| rustls::Error::General(e.to_string()))?;
                if identity.spiffe_id.as_deref() != Some(id.as_str()) {
                    return Err(rustls::Error::General(format!(
                        "the server is {}, not the expected {id}",
                        identity.name()
                    )));
                }
            }
            ServerIdentity::Trusted => {}
        }
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.provider.signature_verification_algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.provider.signature_verification_algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider.signature_verification_algorithms.supported_schemes()
    }
}

/// A client TLS config: verifies the server as `expected` against `roots`, presents
/// whatever `cert` holds at each handshake (nothing while it is empty).
pub fn client_config(
    roots: Arc<RootCertStore>,
    expected: ServerIdentity,
    cert: CertSlot,
) -> Result<Arc<ClientConfig>, TlsError> {
    let provider = provider();
    let verifier = Arc::new(PinnedServer {
        roots,
        expected,
        provider: provider.clone(),
    });
    let mut config = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Config(e.to_string()))?
        .dangerous()
        .with_custom_certificate_verifier(verifier)
        .with_client_cert_resolver(Arc::new(cert));
    config.alpn_protocols = vec![b"h2".to_vec()];
    // See `server_config`: each connection presents the current certificate in full.
    config.resumption = rustls::client::Resumption::disabled();
    Ok(Arc::new(config))
}

/// A tonic connector: TCP (NODELAY) to the URI's host and port, then TLS with `config`.
/// Each new connection presents the slot's current certificate.
#[derive(Clone)]
pub struct Connector {
    config: Arc<ClientConfig>,
    /// Connect only once this slot holds a certificate (an anonymous connection would be
    /// refused for everything but the bootstrap).
    wait_for: Option<CertSlot>,
}

impl Connector {
    pub fn new(config: Arc<ClientConfig>) -> Self {
        Self { config, wait_for: None }
    }

    /// Holds each connection attempt until `slot` has a certificate (bounded by the
    /// channel's connect timeout).
    pub fn when_certified(mut self, slot: CertSlot) -> Self {
        self.wait_for = Some(slot);
        self
    }
}

type BoxFuture<T> = Pin<Box<dyn std::future::Future<Output = T> + Send>>;

impl tower_service::Service<http::Uri> for Connector {
    type Response = hyper_util::rt::TokioIo<tokio_rustls::client::TlsStream<TcpStream>>;
    type Error = io::Error;
    type Future = BoxFuture<io::Result<Self::Response>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: http::Uri) -> Self::Future {
        let connector = tokio_rustls::TlsConnector::from(self.config.clone());
        let wait_for = self.wait_for.clone();
        Box::pin(async move {
            if let Some(slot) = wait_for {
                let mut changed = slot.changed();
                while slot.current().is_none() {
                    changed
                        .changed()
                        .await
                        .map_err(|_| io::Error::other("the certificate source stopped"))?;
                }
            }
            let host = uri
                .host()
                .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, format!("{uri}: no host")))?;
            let host = host.trim_start_matches('[').trim_end_matches(']').to_owned();
            let port = uri.port_u16().unwrap_or(443);
            let tcp = TcpStream::connect((host.as_str(), port)).await?;
            tcp.set_nodelay(true)?;
            // The name is only used for SNI: the verifier checks the expected identity.
            let name =
                ServerName::try_from(host).map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e.to_string()))?;
            let tls = connector.connect(name, tcp).await?;
            Ok(hyper_util::rt::TokioIo::new(tls))
        })
    }
}

#[cfg(test)]
mod tests {
    use std::time::SystemTime;

    use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair, SanType};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    struct Ca(Issuer<'static, KeyPair>, CertificateDer<'static>);

    impl Ca {
        fn new() -> Self {
            let key = KeyPair::generate().unwrap();
            let mut params = CertificateParams::default();
            params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
            let cert = params.self_signed(&key).unwrap();
            Self(Issuer::new(params, key), cert.der().clone())
        }

        /// (cert PEM, key PEM) naming `san`.
        fn leaf(&self, san: SanType) -> (String, String) {
            let key = KeyPair::generate().unwrap();
            let mut params = CertificateParams::default();
            params.subject_alt_names = vec![san];
            params.not_before = (SystemTime::now() - Duration::from_secs(60)).into();
            params.not_after = (SystemTime::now() + Duration::from_secs(3600)).into();
            let cert = params.signed_by(&key, &self.0).unwrap();
            (cert.pem(), key.serialize_pem())
        }

        fn slot(&self, san: SanType) -> CertSlot {
            let (cert, key) = self.leaf(san);
            let chain = CertificateDer::pem_slice_iter(cert.as_bytes())
                .collect::<Result<Vec<_>, _>>()
                .unwrap();
            CertSlot::new(certified_key(chain, PrivateKeyDer::from_pem_slice(key.as_bytes()).unwrap()).unwrap())
        }

        fn roots(&self) -> Arc<RootCertStore> {
            roots("test", vec![self.1.clone()]).unwrap()
        }
    }

    fn spiffe(id: &str) -> SanType {
        SanType::URI(id.to_owned().try_into().unwrap())
    }

    /// Serves one TLS echo per connection; returns its address and each connection's peer.
    async fn echo_server(config: Arc<ServerConfig>) -> (SocketAddr, mpsc::Receiver<PeerInfo>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (peers, seen) = mpsc::channel(8);
        let mut incoming = Box::pin(incoming(
            listener,
            Some(config),
            RELOAD_INTERVAL,
            CancellationToken::new(),
        ));
        tokio::spawn(async move {
            use futures_core::Stream;
            while let Some(Ok(mut conn)) = std::future::poll_fn(|cx| incoming.as_mut().poll_next(cx)).await {
                let _ = peers.send(conn.connect_info()).await;
                tokio::spawn(async move {
                    let mut buf = [0u8; 4];
                    if conn.read_exact(&mut buf).await.is_ok() {
                        let _ = conn.write_all(&buf).await;
                    }
                });
            }
        });
        (addr, seen)
    }

    async fn echo(addr: SocketAddr, config: Arc<ClientConfig>) -> io::Result<()> {
        let mut connector = Connector::new(config);
        let uri: http::Uri = format!("http://{addr}").parse().unwrap();
        let io = tower_service::Service::call(&mut connector, uri).await?;
        let mut tls = io.into_inner();
        tls.write_all(b"ping").await?;
        let mut buf = [0u8; 4];
        tls.read_exact(&mut buf).await?;
        assert_eq!(&buf, b"ping");
        Ok(())
    }

    #[tokio::test]
    async fn a_client_pinned_to_a_spiffe_id_or_dns_name_accepts_only_that_server() {
        let ca = Ca::new();
        let server = ca.slot(spiffe("spiffe://td/ns/sys/sa/registrar"));
        let (addr, mut peers) = echo_server(server_config(server, ca.roots()).unwrap()).await;
        let client_cert = ca.slot(spiffe("spiffe://td/aether/node/n1"));
        let expect = |id: &str| client_config(ca.roots(), id.parse().unwrap(), client_cert.clone()).unwrap();
        echo(addr, expect("spiffe://td/ns/sys/sa/registrar")).await.unwrap();
        let peer = peers.recv().await.unwrap();
        let identity = peer.identity.expect("the client presented its certificate");
        assert_eq!(identity.spiffe_id.as_deref(), Some("spiffe://td/aether/node/n1"));

        for wrong in ["spiffe://td/ns/sys/sa/impostor", "registrar.example"] {
            let error = echo(addr, expect(wrong)).await.unwrap_err();
            assert!(
                error.to_string().contains("not the expected") || error.to_string().contains("name"),
                "{wrong}: {error}"
            );
        }
        // A server from another CA is refused whatever it is called.
        let other = Ca::new();
        let config = client_config(
            other.roots(),
            "spiffe://td/ns/sys/sa/registrar".parse().unwrap(),
            CertSlot::default(),
        )
        .unwrap();
        assert!(echo(addr, config).await.is_err());
    }

    #[tokio::test]
    async fn an_empty_slot_presents_nothing_and_a_set_one_is_used_by_the_next_connection() {
        let ca = Ca::new();
        let server = ca.slot(SanType::DnsName("registrar.test".try_into().unwrap()));
        let (addr, mut peers) = echo_server(server_config(server, ca.roots()).unwrap()).await;
        let slot = CertSlot::default();
        let mut changed = slot.changed();
        let config = client_config(ca.roots(), "registrar.test".parse().unwrap(), slot.clone()).unwrap();
        echo(addr, config.clone()).await.unwrap();
        assert!(
            peers.recv().await.unwrap().identity.is_none(),
            "an empty slot presented a certificate"
        );

        slot.set(ca.slot(spiffe("spiffe://td/aether/node/n2")).current().unwrap());
        changed.changed().await.unwrap();
        echo(addr, config).await.unwrap();
        let identity = peers.recv().await.unwrap().identity.unwrap();
        assert_eq!(identity.spiffe_id.as_deref(), Some("spiffe://td/aether/node/n2"));
    }

    #[tokio::test(start_paused = true)]
    async fn certificate_files_are_reloaded_when_they_change_and_kept_when_broken() {
        let ca = Ca::new();
        let dir = std::env::temp_dir().join(format!("aether-tls-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let files = CertFiles {
            cert_flag: "--cert",
            cert: dir.join("tls.crt"),
            key_flag: "--key",
            key: dir.join("tls.key"),
        };
        let write = |id: &str| {
            let (cert, key) = ca.leaf(spiffe(id));
            std::fs::write(&files.cert, cert).unwrap();
            std::fs::write(&files.key, key).unwrap();
        };
        write("spiffe://td/one");
        let shutdown = CancellationToken::new();
        let slot = CertSlot::from_files(files.clone(), shutdown.clone()).unwrap();
        let id = |slot: &CertSlot| slot.identity().unwrap().spiffe_id.unwrap();
        assert_eq!(id(&slot), "spiffe://td/one");

        write("spiffe://td/two");
        tokio::time::sleep(RELOAD_INTERVAL * 2).await;
        assert_eq!(id(&slot), "spiffe://td/two");

        // A half-written pair (a certificate without its key) keeps the previous identity.
        std::fs::write(
            &files.key,
            "-----BEGIN PRIVATE KEY-----\nbroken\n-----END PRIVATE KEY-----\n",
        )
        .unwrap();
        tokio::time::sleep(RELOAD_INTERVAL * 2).await;
        assert_eq!(id(&slot), "spiffe://td/two");
        shutdown.cancel();
        let _ = std::fs::remove_dir_all(&dir);

        let missing = CertSlot::from_files(files, CancellationToken::new()).unwrap_err();
        assert!(missing.to_string().starts_with("--cert "), "{missing}");
    }
}
