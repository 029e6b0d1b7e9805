//! The agent's connection to the registrar (proposals/010): mTLS, the agent presenting
//! its node certificate (`spiffe://<td>/aether/node/<node>`) and checking that the
//! server is the registrar it was told to expect.
//!
//! The node certificate comes from the registrar's bootstrap (a projected, audience-bound
//! ServiceAccount token exchanged for a short-lived certificate, renewed at half-life)
//! or from files (cert-manager, an operator). Each new certificate opens a new
//! connection: the registrar authenticates a connection once, at its handshake, and
//! ends streams whose certificate expires, so callers take [`RegistrarLink::client`]
//! afresh for each call and Watch loops resume on [`RegistrarLink::rotated`].

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use aether_common::tls::{self, CertFiles, CertSlot, Connector, ServerIdentity, TlsError};
use aether_proto::registrar::v1::IssueNodeCertificateRequest;
use aether_proto::registrar::v1::node_bootstrap_client::NodeBootstrapClient;
use aether_proto::registrar::v1::registrar_client::RegistrarClient;
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tonic::transport::{Channel, Endpoint};

/// Retry bounds of the bootstrap while the registrar is away or refuses.
const BOOTSTRAP_BACKOFF_MIN: Duration = Duration::from_millis(200);
const BOOTSTRAP_BACKOFF_MAX: Duration = Duration::from_secs(30);

/// Where the node certificate comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum NodeIdentityKind {
    /// Exchange the projected ServiceAccount token (--bootstrap-token) at the registrar.
    Bootstrap,
    /// --node-cert and --node-key files, reloaded when they change.
    Files,
}

#[derive(Clone, Debug, clap::Args)]
pub struct LinkConfig {
    /// CA certificates (PEM) that verify the registrar's certificate.
    #[arg(long, env = "AETHER_REGISTRAR_CA", default_value = "/etc/aether/registrar-ca/ca.crt")]
    pub registrar_ca: PathBuf,

    /// Who the registrar must be: a DNS name its certificate carries, or its SPIFFE ID
    /// (`spiffe://…`). Unset: the host of --registrar.
    #[arg(long, env = "AETHER_REGISTRAR_IDENTITY")]
    pub registrar_identity: Option<ServerIdentity>,

    /// Where the agent's node certificate comes from.
    #[arg(long, env = "AETHER_NODE_IDENTITY", value_enum, default_value = "bootstrap")]
    pub node_identity: NodeIdentityKind,

    /// The projected ServiceAccount token the bootstrap presents (re-read at each
    /// renewal: kubelet rotates it).
    #[arg(
        long,
        env = "AETHER_BOOTSTRAP_TOKEN",
        default_value = "/var/run/secrets/aether/registrar-token/token"
    )]
    pub bootstrap_token: PathBuf,

    /// The node certificate (PEM, leaf first) with --node-identity files.
    #[arg(long, env = "AETHER_NODE_CERT", default_value = "/etc/aether/node-tls/tls.crt")]
    pub node_cert: PathBuf,

    /// Its private key.
    #[arg(long, env = "AETHER_NODE_KEY", default_value = "/etc/aether/node-tls/tls.key")]
    pub node_key: PathBuf,
}

impl Default for LinkConfig {
    /// The flags' defaults.
    fn default() -> Self {
        use clap::Parser;
        #[derive(clap::Parser)]
        struct Flags {
            #[command(flatten)]
            link: LinkConfig,
        }
        Flags::parse_from(["aether-agent"]).link
    }
}

#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    #[error("--registrar {url:?}: {reason}")]
    Url { url: String, reason: String },
    #[error(transparent)]
    Tls(#[from] TlsError),
}

/// The current connection to the registrar; cheap to clone.
#[derive(Clone)]
pub struct RegistrarLink {
    channel: watch::Receiver<Channel>,
}

impl RegistrarLink {
    /// Connects to `url`: `https://` with mTLS (the default), `http://` in plaintext
    /// (tests of the agent alone; logged loudly). Connections are lazy: the agent serves
    /// its pods while the registrar is away.
    pub fn start(url: &str, config: &LinkConfig, shutdown: CancellationToken) -> Result<Self, LinkError> {
        let url_error = |reason: String| LinkError::Url {
            url: aether_common::quote::clip(url).to_string(),
            reason,
        };
        let uri: http::Uri = url.parse().map_err(|e| url_error(format!("{e}")))?;
        let host = uri.host().ok_or_else(|| url_error("no host".into()))?.to_owned();
        match uri.scheme_str() {
            Some("http") => {
                tracing::warn!(%url, "the registrar link is PLAINTEXT (an http:// --registrar): no identity either \
                    way. For tests only; use https:// in a cluster.");
                let (_, channel) = watch::channel(endpoint(url).map_err(url_error)?.connect_lazy());
                return Ok(Self { channel });
            }
            Some("https") => {}
            _ => return Err(url_error("the scheme must be https:// (or http:// for a test)".into())),
        }
        // tonic would try TLS itself on an https URI; our connector does it instead.
        let plain_url = format!(
            "http://{}",
            uri.authority().expect("a URI with a host has an authority")
        );
        let endpoint = endpoint(&plain_url).map_err(url_error)?;
        let roots = tls::roots(
            "--registrar-ca",
            tls::read_certs("--registrar-ca", &config.registrar_ca)?,
        )?;
        let expected = match &config.registrar_identity {
            Some(identity) => identity.clone(),
            None => host
                .trim_start_matches('[')
                .trim_end_matches(']')
                .parse()
                .map_err(|e: String| url_error(e))?,
        };
        let slot = match config.node_identity {
            NodeIdentityKind::Files => CertSlot::from_files(
                CertFiles {
                    cert_flag: "--node-cert",
                    cert: config.node_cert.clone(),
                    key_flag: "--node-key",
                    key: config.node_key.clone(),
                },
                shutdown.clone(),
            )?,
            NodeIdentityKind::Bootstrap => CertSlot::default(),
        };
        let client_config = tls::client_config(roots.clone(), expected.clone(), slot.clone())?;
        let connector = Connector::new(client_config).when_certified(slot.clone());
        let dial = move || endpoint.connect_with_connector_lazy(connector.clone());
        let (current, channel) = watch::channel(dial());
        if config.node_identity == NodeIdentityKind::Bootstrap {
            // The bootstrap call itself presents no certificate (it has none yet).
            let anonymous = tls::client_config(roots, expected, CertSlot::default())?;
            let bootstrap = endpoint_for_bootstrap(&plain_url, anonymous).map_err(url_error)?;
            tokio::spawn(renew(
                bootstrap,
                config.bootstrap_token.clone(),
                slot.clone(),
                shutdown.clone(),
            ));
        }
        tokio::spawn(redial_on_rotation(slot, current, dial, shutdown));
        Ok(Self { channel })
    }

    /// A client on the current connection (take one per call: it changes on rotation).
    pub fn client(&self) -> RegistrarClient<Channel> {
        RegistrarClient::new(self.channel.borrow().clone())
    }

    /// Changes when the connection is replaced (a new node certificate): a long-lived
    /// stream resumes on the new one.
    pub fn rotated(&self) -> watch::Receiver<Channel> {
        let mut rotated = self.channel.clone();
        rotated.mark_unchanged();
        rotated
    }
}

fn endpoint(url: &str) -> Result<Endpoint, String> {
    Ok(Endpoint::from_shared(url.to_owned())
        .map_err(|e| e.to_string())?
        .connect_timeout(Duration::from_secs(2))
        .http2_keep_alive_interval(Duration::from_secs(20))
        .keep_alive_timeout(Duration::from_secs(10)))
}

fn endpoint_for_bootstrap(
    url: &str,
    config: Arc<rustls::ClientConfig>,
) -> Result<NodeBootstrapClient<Channel>, String> {
    let channel = endpoint(url)?
        .timeout(Duration::from_secs(10))
        .connect_with_connector_lazy(Connector::new(config));
    Ok(NodeBootstrapClient::new(channel))
}

/// Opens a new connection each time the certificate changes, so the registrar sees it.
async fn redial_on_rotation(
    slot: CertSlot,
    current: watch::Sender<Channel>,
    dial: impl Fn() -> Channel,
    shutdown: CancellationToken,
) {
    let mut changed = slot.changed();
    // The first certificate needs no new connection: none was made without it.
    let mut first = slot.current().is_none();
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            result = changed.changed() => if result.is_err() { return },
        }
        if std::mem::take(&mut first) {
            continue;
        }
        tracing::info!(identity = ?slot.identity(), "node certificate changed; new registrar connection");
        current.send_replace(dial());
    }
}

/// Keeps the slot holding a valid node certificate from the bootstrap: one at start
/// (retried with backoff), then a new key and certificate at each half-life.
async fn renew(
    mut bootstrap: NodeBootstrapClient<Channel>,
    token_path: PathBuf,
    slot: CertSlot,
    shutdown: CancellationToken,
) {
    let mut backoff = BOOTSTRAP_BACKOFF_MIN;
    loop {
        let wait = match issue(&mut bootstrap, &token_path).await {
            Ok((key, not_before, not_after)) => {
                backoff = BOOTSTRAP_BACKOFF_MIN;
                slot.set(key);
                let half = not_after.duration_since(not_before).unwrap_or_default() / 2;
                let renew_at = not_before + half;
                tracing::info!(identity = ?slot.identity(), renew_in = ?renew_at.duration_since(SystemTime::now()).unwrap_or_default(),
                    "got a node certificate from the registrar");
                renew_at.duration_since(SystemTime::now()).unwrap_or_default()
            }
            Err(error) => {
                tracing::warn!(%error, retry_in = ?backoff, "node certificate bootstrap failed");
                let wait = backoff;
                backoff = (backoff * 2).min(BOOTSTRAP_BACKOFF_MAX);
                wait
            }
        };
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(wait) => {}
        }
    }
}

/// One bootstrap exchange: a fresh key, its CSR and the token in; the certified key out.
async fn issue(
    bootstrap: &mut NodeBootstrapClient<Channel>,
    token_path: &std::path::Path,
) -> Result<(Arc<rustls::sign::CertifiedKey>, SystemTime, SystemTime), String> {
    let token = tokio::fs::read_to_string(token_path)
        .await
        .map_err(|e| format!("--bootstrap-token {}: {e}", token_path.display()))?;
    let key = rcgen::KeyPair::generate().map_err(|e| format!("generating a key: {e}"))?;
    let csr = rcgen::CertificateParams::default()
        .serialize_request(&key)
        .map_err(|e| format!("building the CSR: {e}"))?;
    let response = bootstrap
        .issue_node_certificate(IssueNodeCertificateRequest {
            token: token.trim().to_owned(),
            csr_der: csr.der().to_vec(),
        })
        .await
        .map_err(|status| format!("{:?}: {}", status.code(), status.message()))?
        .into_inner();
    let chain = CertificateDer::pem_slice_iter(response.cert_chain_pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("the registrar's certificate chain: {e}"))?;
    let leaf = chain.first().ok_or("the registrar sent no certificate")?;
    let validity = x509_parser::parse_x509_certificate(leaf)
        .map_err(|e| format!("the node certificate: {e}"))?
        .1
        .validity()
        .clone();
    let at = |t: x509_parser::time::ASN1Time| {
        SystemTime::UNIX_EPOCH + Duration::from_secs(u64::try_from(t.timestamp()).unwrap_or_default())
    };
    let der = rustls::pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into());
    let certified = tls::certified_key(chain, der).map_err(|e| e.to_string())?;
    Ok((certified, at(validity.not_before), at(validity.not_after)))
}
