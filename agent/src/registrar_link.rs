//! The agent's connection to the registrar (proposals/010): mTLS, the agent presenting
//! its node certificate (`spiffe://<td>/aether/node/<node>`) and checking that the
//! server is the registrar it was told to expect.
//!
//! The node certificate comes from the registrar's bootstrap (a projected, audience-bound
//! ServiceAccount token exchanged for a short-lived certificate, renewed at half-life),
//! from files (cert-manager, an operator) or from SPIRE (the agent's own X.509 SVID,
//! streamed from the SPIFFE Workload API as SPIRE rotates it). Each new certificate opens a new
//! connection: the registrar authenticates a connection once, at its handshake, and
//! ends streams whose certificate expires, so callers take [`RegistrarLink::client`]
//! afresh for each call and Watch loops resume on [`RegistrarLink::rotated`].
//!
//! The edge gateway (`aether-agent edge`) follows the Watch stream through the same link
//! as [`LinkRole::Edge`]: its bootstrap token is its own ServiceAccount's (listed in the
//! registrar's `--edge-service-accounts`) and the registrar answers with a read-only
//! certificate `spiffe://<td>/aether/edge/<namespace>/<service account>`; the link
//! refuses any other (a node certificate could write endpoints), and with SPIRE it picks
//! the SVID under `/aether/edge/`.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use aether_common::tls::{self, CertFiles, CertSlot, Connector, ServerIdentity, TlsError};
use aether_proto::registrar::v1::IssueNodeCertificateRequest;
use aether_proto::registrar::v1::node_bootstrap_client::NodeBootstrapClient;
use aether_proto::registrar::v1::registrar_client::RegistrarClient;
use futures::StreamExt;
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;
use spiffe::WorkloadApiError;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tonic::transport::{Channel, Endpoint};

use crate::identity::IdentityKind;

/// Retry bounds of the bootstrap while the registrar is away or refuses.
const BOOTSTRAP_BACKOFF_MIN: Duration = Duration::from_millis(200);
const BOOTSTRAP_BACKOFF_MAX: Duration = Duration::from_secs(30);
/// Reconnect bounds of the Workload API stream (`--node-identity spire`).
const SPIRE_BACKOFF_MIN: Duration = Duration::from_millis(100);
const SPIRE_BACKOFF_MAX: Duration = Duration::from_secs(30);
/// The path under the trust domain the registrar reads an agent's node from.
pub const NODE_ID_PATH: &str = "/aether/node/";
/// The path under the trust domain that names an edge gateway (a reader):
/// `<namespace>/<service account>` follows it.
pub const EDGE_ID_PATH: &str = "/aether/edge/";

/// Whom the link's certificate names, which the registrar reads its rights from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LinkRole {
    /// A node agent: `spiffe://<td>/aether/node/<node>`, may write its node's endpoints.
    #[default]
    Node,
    /// An edge gateway: `spiffe://<td>/aether/edge/<namespace>/<service account>`, reads
    /// only (Watch, List). A bootstrapped certificate naming anything else is refused.
    Edge,
}

/// Where the node certificate comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum NodeIdentityKind {
    /// Exchange the projected ServiceAccount token (--bootstrap-token) at the registrar.
    Bootstrap,
    /// --node-cert and --node-key files, reloaded when they change.
    Files,
    /// The agent's own X.509 SVID from the SPIFFE Workload API (--spire-workload-socket),
    /// followed as SPIRE rotates it; it must name `spiffe://<trust domain>/aether/node/<node name>`.
    Spire,
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

    /// Where the agent's node certificate comes from. Unset: `spire` with `--identity
    /// spire`, else `bootstrap`. With `spire` the agent presents its own SVID from the
    /// Workload API (--spire-workload-socket), which must name
    /// `spiffe://<trust domain>/aether/node/<node name>`: register the agent DaemonSet
    /// with a per-node SPIFFE ID, e.g. a spire-controller-manager ClusterSPIFFEID with
    /// `spiffeIDTemplate: "spiffe://{{ .TrustDomain }}/aether/node/{{ .PodSpec.NodeName }}"`,
    /// and give the registrar SPIRE's trust bundle with `--client-ca`.
    #[arg(long, env = "AETHER_NODE_IDENTITY", value_enum)]
    pub node_identity: Option<NodeIdentityKind>,

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

impl LinkConfig {
    /// `--node-identity`, or its default: `spire` when pods' identities come from SPIRE
    /// (`--identity spire`), else `bootstrap`.
    pub fn node_identity(&self, pods: Option<IdentityKind>) -> NodeIdentityKind {
        match (self.node_identity, pods) {
            (Some(kind), _) => kind,
            (None, Some(IdentityKind::Spire)) => NodeIdentityKind::Spire,
            (None, _) => NodeIdentityKind::Bootstrap,
        }
    }
}

/// What the link needs of the agent's other flags.
#[derive(Clone, Debug, Default)]
pub struct AgentContext {
    /// `--node-name`: the node a SPIRE-issued node certificate must name.
    pub node_name: String,
    /// `--identity`: the default of `--node-identity` follows it.
    pub pod_identity: Option<IdentityKind>,
    /// `--spire-workload-socket`: where `--node-identity spire` fetches the agent's SVID.
    pub spire_workload_socket: String,
}

impl AgentContext {
    /// From the agent's configuration.
    pub fn of(config: &crate::config::Config) -> Self {
        Self {
            node_name: config.node_name.clone(),
            pod_identity: Some(config.identity.kind),
            spire_workload_socket: config.identity.spire_workload_socket.clone(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    #[error("--registrar {url:?}: {reason}")]
    Url { url: String, reason: String },
    #[error(
        "--node-identity spire needs the Workload API socket: set --spire-workload-socket (or SPIFFE_ENDPOINT_SOCKET)"
    )]
    NoWorkloadSocket,
    #[error(transparent)]
    Tls(#[from] TlsError),
}

/// The current connection to the registrar; cheap to clone.
#[derive(Clone)]
pub struct RegistrarLink {
    channel: watch::Receiver<Channel>,
}

impl RegistrarLink {
    /// [`RegistrarLink::start_for`] without the rest of the agent's flags (a node
    /// identity from the bootstrap or files; tests).
    pub fn start(url: &str, config: &LinkConfig, shutdown: CancellationToken) -> Result<Self, LinkError> {
        Self::start_for(url, config, &AgentContext::default(), shutdown)
    }

    /// Connects to `url`: `https://` with mTLS (the default), `http://` in plaintext
    /// (tests of the agent alone; logged loudly). Connections are lazy: the agent serves
    /// its pods while the registrar is away.
    pub fn start_for(
        url: &str,
        config: &LinkConfig,
        agent: &AgentContext,
        shutdown: CancellationToken,
    ) -> Result<Self, LinkError> {
        Self::start_as(url, config, agent, LinkRole::Node, shutdown)
    }

    /// [`RegistrarLink::start_for`] as `role`: [`LinkRole::Edge`] for the edge gateway,
    /// whose certificate must name `spiffe://<td>/aether/edge/…` (read-only).
    pub fn start_as(
        url: &str,
        config: &LinkConfig,
        agent: &AgentContext,
        role: LinkRole,
        shutdown: CancellationToken,
    ) -> Result<Self, LinkError> {
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
        let node_identity = config.node_identity(agent.pod_identity);
        if node_identity == NodeIdentityKind::Spire && agent.spire_workload_socket.is_empty() {
            return Err(LinkError::NoWorkloadSocket);
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
        let slot = node_certificate(node_identity, config, agent, role, &shutdown)?;
        let client_config = tls::client_config(roots.clone(), expected.clone(), slot.clone())?;
        let connector = Connector::new(client_config).when_certified(slot.clone());
        let dial = move || endpoint.connect_with_connector_lazy(connector.clone());
        let (current, channel) = watch::channel(dial());
        if node_identity == NodeIdentityKind::Bootstrap {
            // The bootstrap call itself presents no certificate (it has none yet).
            let anonymous = tls::client_config(roots, expected, CertSlot::default())?;
            let bootstrap = endpoint_for_bootstrap(&plain_url, anonymous).map_err(url_error)?;
            tokio::spawn(renew(
                bootstrap,
                config.bootstrap_token.clone(),
                slot.clone(),
                role,
                shutdown.clone(),
            ));
        }
        tokio::spawn(redial_on_rotation(slot, current, dial, role, shutdown));
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

/// The slot the node certificate is kept in, filled from files (reloaded) or by SPIRE's
/// stream; the bootstrap fills it from `start_for`, which has the registrar's address.
fn node_certificate(
    kind: NodeIdentityKind,
    config: &LinkConfig,
    agent: &AgentContext,
    role: LinkRole,
    shutdown: &CancellationToken,
) -> Result<CertSlot, LinkError> {
    Ok(match kind {
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
        NodeIdentityKind::Spire => {
            let slot = CertSlot::default();
            tokio::spawn(follow_svid(
                agent.spire_workload_socket.clone(),
                agent.node_name.clone(),
                role,
                slot.clone(),
                shutdown.clone(),
            ));
            slot
        }
    })
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
    role: LinkRole,
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
        match role {
            LinkRole::Node => {
                tracing::info!(identity = ?slot.identity(), "node certificate changed; new registrar connection")
            }
            LinkRole::Edge => {
                tracing::info!(identity = ?slot.identity(), "edge certificate changed; new registrar connection")
            }
        }
        current.send_replace(dial());
    }
}

/// Keeps the slot holding a valid node certificate from the bootstrap: one at start
/// (retried with backoff), then a new key and certificate at each half-life.
async fn renew(
    mut bootstrap: NodeBootstrapClient<Channel>,
    token_path: PathBuf,
    slot: CertSlot,
    role: LinkRole,
    shutdown: CancellationToken,
) {
    let mut backoff = BOOTSTRAP_BACKOFF_MIN;
    loop {
        let wait = match issue(&mut bootstrap, &token_path, role).await {
            Ok((key, not_before, not_after)) => {
                backoff = BOOTSTRAP_BACKOFF_MIN;
                slot.set(key);
                let half = not_after.duration_since(not_before).unwrap_or_default() / 2;
                let renew_at = not_before + half;
                let renew_in = renew_at.duration_since(SystemTime::now()).unwrap_or_default();
                match role {
                    LinkRole::Node => tracing::info!(identity = ?slot.identity(), renew_in = ?renew_in,
                        "got a node certificate from the registrar"),
                    LinkRole::Edge => tracing::info!(identity = ?slot.identity(), renew_in = ?renew_in,
                        "got an edge certificate (read-only) from the registrar"),
                }
                renew_at.duration_since(SystemTime::now()).unwrap_or_default()
            }
            Err(error) => {
                match role {
                    LinkRole::Node => tracing::warn!(%error, retry_in = ?backoff, "node certificate bootstrap failed"),
                    LinkRole::Edge => tracing::warn!(%error, retry_in = ?backoff, "edge certificate bootstrap failed"),
                }
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
/// The exchange is the same for an edge (the registrar reads the role from the token);
/// an edge refuses a certificate that does not name an edge.
async fn issue(
    bootstrap: &mut NodeBootstrapClient<Channel>,
    token_path: &std::path::Path,
    role: LinkRole,
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
    if role == LinkRole::Edge {
        let id = tls::PeerIdentity::from_leaf(leaf)
            .map_err(|e| format!("the edge certificate: {e}"))?
            .spiffe_id
            .unwrap_or_default();
        check_edge_certificate(&id)?;
    }
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

/// Whether `id` names `node` the way the registrar reads it:
/// `spiffe://<trust domain>/aether/node/<node>`.
pub fn names_node(id: &str, node: &str) -> bool {
    id.strip_prefix("spiffe://")
        .and_then(|rest| rest.find('/').map(|slash| &rest[slash..]))
        .and_then(|path| path.strip_prefix(NODE_ID_PATH))
        .is_some_and(|named| !node.is_empty() && named == node)
}

/// Whether `id` names an edge gateway the way the registrar reads it:
/// `spiffe://<trust domain>/aether/edge/<namespace>/<service account>`.
pub fn names_edge(id: &str) -> bool {
    id.strip_prefix("spiffe://")
        .and_then(|rest| rest.find('/').map(|slash| &rest[slash..]))
        .and_then(|path| path.strip_prefix(EDGE_ID_PATH))
        .and_then(|rest| rest.split_once('/'))
        .is_some_and(|(namespace, name)| !namespace.is_empty() && !name.is_empty() && !name.contains('/'))
}

/// An edge takes only an edge certificate: a node certificate (its token was the agents')
/// would let it write endpoints.
fn check_edge_certificate(id: &str) -> Result<(), String> {
    if names_edge(id) {
        return Ok(());
    }
    Err(format!(
        "the registrar issued the edge {}, not an edge identity (spiffe://<trust domain>{EDGE_ID_PATH}<namespace>/<service \
         account>): the edge's --bootstrap-token must be its own ServiceAccount's, listed in the registrar's \
         --edge-service-accounts",
        aether_common::quote::quote(id)
    ))
}

/// A Workload API address as the `spiffe` crate takes it (`unix:`/`tcp:`; a bare path is
/// a Unix socket).
fn workload_endpoint(socket: &str) -> String {
    if socket.starts_with("unix:") || socket.starts_with("tcp:") {
        socket.to_owned()
    } else {
        format!("unix:{socket}")
    }
}

/// Of the SVIDs SPIRE issued the agent, the one naming `node` (SPIRE may issue several
/// when several registration entries match), else its default one (the first).
fn node_svid<'a>(svids: &'a [Arc<spiffe::X509Svid>], node: &str) -> Option<&'a spiffe::X509Svid> {
    svids
        .iter()
        .find(|svid| names_node(&svid.spiffe_id().to_string(), node))
        .or_else(|| svids.first())
        .map(Arc::as_ref)
}

/// An SVID as a rustls identity: its chain and its PKCS#8 key.
fn certified_svid(svid: &spiffe::X509Svid) -> Result<Arc<rustls::sign::CertifiedKey>, TlsError> {
    let chain = svid
        .cert_chain()
        .iter()
        .map(|cert| CertificateDer::from(cert.as_bytes().to_vec()))
        .collect();
    let key = rustls::pki_types::PrivateKeyDer::Pkcs8(svid.private_key().as_bytes().to_vec().into());
    tls::certified_key(chain, key)
}

/// Puts the SVID naming `node` (else the first) into `slot` unless it already holds it;
/// warns once per ID that does not name the node (the registrar will refuse it).
/// An edge ([`LinkRole::Edge`]) adopts only an SVID naming an edge (it keeps its current
/// certificate, or none, otherwise) and warns once per set of SVIDs it passed over.
fn adopt_svid(
    svids: &[Arc<spiffe::X509Svid>],
    node: &str,
    role: LinkRole,
    slot: &CertSlot,
    warned_for: &mut Option<String>,
) {
    if role == LinkRole::Edge {
        let Some(svid) = svids.iter().find(|svid| names_edge(&svid.spiffe_id().to_string())) else {
            let ids: Vec<String> = svids.iter().map(|svid| svid.spiffe_id().to_string()).collect();
            let ids = ids.join(", ");
            if warned_for.as_deref() != Some(ids.as_str()) {
                tracing::warn!(spiffe_ids = %aether_common::quote::clip(&ids),
                    expected = %format!("spiffe://<trust domain>{EDGE_ID_PATH}<namespace>/<service account>"),
                    "no SVID from the Workload API names an edge: keeping the current edge certificate. Register \
                     the edge with a SPIFFE ID such as spiffe://{{{{ .TrustDomain }}}}/aether/edge/\
                     {{{{ .PodMeta.Namespace }}}}/{{{{ .PodSpec.ServiceAccountName }}}}");
                *warned_for = Some(ids);
            }
            return;
        };
        return set_svid(svid, role, slot);
    }
    let Some(svid) = node_svid(svids, node) else {
        tracing::warn!("the Workload API sent no SVID; keeping the current node certificate");
        return;
    };
    let id = svid.spiffe_id().to_string();
    if !names_node(&id, node) && warned_for.as_deref() != Some(id.as_str()) {
        tracing::warn!(spiffe_id = %id, expected = %format!("spiffe://<trust domain>{NODE_ID_PATH}{node}"),
            "the agent's SVID does not name its node: the registrar will refuse its registrations. \
             Register the agent with a per-node SPIFFE ID (e.g. a ClusterSPIFFEID template \
             spiffe://{{{{ .TrustDomain }}}}/aether/node/{{{{ .PodSpec.NodeName }}}})");
        *warned_for = Some(id.clone());
    }
    set_svid(svid, role, slot)
}

/// Puts `svid` into `slot` unless it already holds it.
fn set_svid(svid: &spiffe::X509Svid, role: LinkRole, slot: &CertSlot) {
    let id = svid.spiffe_id().to_string();
    let unchanged = slot
        .current()
        .zip(svid.cert_chain().first())
        .is_some_and(|(current, leaf)| current.end_entity_cert().ok().map(|c| c.as_ref()) == Some(leaf.as_bytes()));
    if unchanged {
        return;
    }
    match certified_svid(svid) {
        Ok(key) => {
            slot.set(key);
            let not_after = slot.identity().map(|identity| identity.not_after);
            let expires_in = not_after.and_then(|t| t.duration_since(SystemTime::now()).ok());
            match role {
                LinkRole::Node => {
                    tracing::info!(spiffe_id = %id, ?expires_in, "node certificate: the agent's SVID from SPIRE")
                }
                LinkRole::Edge => {
                    tracing::info!(spiffe_id = %id, ?expires_in, "edge certificate: the edge's SVID from SPIRE")
                }
            }
        }
        Err(error) => match role {
            LinkRole::Node => {
                tracing::warn!(spiffe_id = %id, %error, "the agent's SVID is unusable; keeping the current node certificate")
            }
            LinkRole::Edge => {
                tracing::warn!(spiffe_id = %id, %error, "the edge's SVID is unusable; keeping the current edge certificate")
            }
        },
    }
}

/// Keeps the slot holding the agent's own SVID (`--node-identity spire`): follows the
/// Workload API's `FetchX509SVID` stream, on which SPIRE pushes every rotation, and
/// reconnects with backoff when it breaks (the last SVID keeps serving meanwhile, until
/// it expires).
async fn follow_svid(socket: String, node: String, role: LinkRole, slot: CertSlot, shutdown: CancellationToken) {
    let endpoint = workload_endpoint(&socket);
    let mut backoff = SPIRE_BACKOFF_MIN;
    let mut warned_for: Option<String> = None;
    loop {
        let run = async {
            let client = spiffe::WorkloadApiClient::connect_to(&endpoint).await?;
            let mut updates = client.stream_x509_contexts().await?;
            tracing::info!(%endpoint, "following the agent's own SVID on the SPIFFE Workload API");
            while let Some(update) = updates.next().await {
                let context = match update {
                    Ok(context) => context,
                    // The stream failed (it ends here): reconnect.
                    Err(
                        error @ (WorkloadApiError::Transport(_)
                        | WorkloadApiError::NoIdentityIssued
                        | WorkloadApiError::PermissionDenied(_)),
                    ) => return Err(error),
                    // An unusable response: keep the current SVID and wait for the next.
                    Err(error) => {
                        tracing::warn!(%error, "the Workload API sent an unusable update; keeping the current node certificate");
                        continue;
                    }
                };
                backoff = SPIRE_BACKOFF_MIN;
                adopt_svid(context.svids(), &node, role, &slot, &mut warned_for);
            }
            Ok::<_, WorkloadApiError>(())
        };
        let result = tokio::select! {
            _ = shutdown.cancelled() => return,
            result = run => result,
        };
        match result {
            Ok(()) => tracing::warn!(%endpoint, retry_in = ?backoff,
                "the Workload API stream ended; reconnecting (the current node certificate keeps serving)"),
            Err(error @ (WorkloadApiError::NoIdentityIssued | WorkloadApiError::PermissionDenied(_))) => match role {
                LinkRole::Node => {
                    tracing::warn!(%endpoint, %error, retry_in = ?backoff, expected = %format!("spiffe://<trust domain>{NODE_ID_PATH}{node}"),
                        "SPIRE issues the agent no SVID: register the agent DaemonSet with a per-node SPIFFE ID; retrying")
                }
                LinkRole::Edge => {
                    tracing::warn!(%endpoint, %error, retry_in = ?backoff,
                        expected = %format!("spiffe://<trust domain>{EDGE_ID_PATH}<namespace>/<service account>"),
                        "SPIRE issues the edge no SVID: register the edge Deployment with an edge SPIFFE ID; retrying")
                }
            },
            Err(error) => tracing::warn!(%endpoint, %error, retry_in = ?backoff,
                "the Workload API is unavailable or failed; retrying (the current node certificate, if any, keeps serving)"),
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(backoff) => {}
        }
        backoff = (backoff * 2).min(SPIRE_BACKOFF_MAX);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_ids_are_read_as_the_registrar_does() {
        assert!(names_node("spiffe://cluster.local/aether/node/n1", "n1"));
        assert!(names_node("spiffe://other.td/aether/node/n1", "n1"));
        assert!(!names_node("spiffe://cluster.local/aether/node/n2", "n1"));
        assert!(!names_node("spiffe://cluster.local/aether/node/n1/x", "n1"));
        assert!(!names_node(
            "spiffe://cluster.local/ns/aether-system/sa/aether-agent",
            "n1"
        ));
        assert!(!names_node("spiffe://cluster.local/x/aether/node/n1", "n1"));
        assert!(!names_node("https://cluster.local/aether/node/n1", "n1"));
        assert!(!names_node("spiffe://cluster.local/aether/node/", ""));
    }

    #[test]
    fn edge_ids_are_read_as_the_registrar_does() {
        assert!(names_edge(
            "spiffe://cluster.local/aether/edge/aether-system/aether-edge-public"
        ));
        assert!(names_edge("spiffe://other.td/aether/edge/ns/edge.v2"));
        for id in [
            "spiffe://cluster.local/aether/node/n1",
            "spiffe://cluster.local/aether/edge/ns",
            "spiffe://cluster.local/aether/edge/ns/",
            "spiffe://cluster.local/aether/edge//edge",
            "spiffe://cluster.local/aether/edge/ns/edge/x",
            "spiffe://cluster.local/ns/aether-system/sa/aether-edge-public",
            "spiffe://cluster.local/x/aether/edge/ns/edge",
            "https://cluster.local/aether/edge/ns/edge",
            "",
        ] {
            assert!(!names_edge(id), "{id}");
        }
    }

    #[test]
    fn an_edge_takes_only_an_edge_certificate_from_the_bootstrap() {
        check_edge_certificate("spiffe://cluster.local/aether/edge/aether-system/aether-edge-public").unwrap();
        let refused = check_edge_certificate("spiffe://cluster.local/aether/node/n1").unwrap_err();
        assert!(
            refused.starts_with("the registrar issued the edge \"spiffe://cluster.local/aether/node/n1\", not an edge"),
            "{refused}"
        );
        assert!(refused.contains("--edge-service-accounts"), "{refused}");
        let long = check_edge_certificate(&"x".repeat(100_000)).unwrap_err();
        assert!(long.len() < 1024, "quoted bounded: {long}");
    }

    /// A self-signed SVID naming `id`, as the Workload API would send it.
    fn svid(id: &str) -> Arc<spiffe::X509Svid> {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::default();
        params.subject_alt_names = vec![rcgen::SanType::URI(id.to_owned().try_into().unwrap())];
        params.is_ca = rcgen::IsCa::ExplicitNoCa;
        params.key_usages = vec![rcgen::KeyUsagePurpose::DigitalSignature];
        let cert = params.self_signed(&key).unwrap();
        Arc::new(spiffe::X509Svid::parse_from_der(cert.der(), &key.serialize_der()).unwrap())
    }

    fn held(slot: &CertSlot) -> Option<String> {
        slot.identity().and_then(|identity| identity.spiffe_id.clone())
    }

    #[test]
    fn an_edge_adopts_only_an_edge_svid_and_an_agent_its_nodes() {
        let workload = svid("spiffe://td/ns/aether-system/sa/aether-edge-public");
        let node = svid("spiffe://td/aether/node/n1");
        let edge = svid("spiffe://td/aether/edge/aether-system/aether-edge-public");
        let mut warned = None;

        let slot = CertSlot::default();
        let svids = [workload.clone(), node.clone(), edge.clone()];
        adopt_svid(&svids, "n1", LinkRole::Edge, &slot, &mut warned);
        assert_eq!(
            held(&slot).as_deref(),
            Some("spiffe://td/aether/edge/aether-system/aether-edge-public")
        );

        // No edge SVID: nothing adopted (never a node identity), warned once.
        let slot = CertSlot::default();
        adopt_svid(
            &[workload.clone(), node.clone()],
            "n1",
            LinkRole::Edge,
            &slot,
            &mut warned,
        );
        assert_eq!(held(&slot), None);
        assert!(warned.is_some());

        // An agent still takes the SVID naming its node, else the first.
        let slot = CertSlot::default();
        adopt_svid(&svids, "n1", LinkRole::Node, &slot, &mut None);
        assert_eq!(held(&slot).as_deref(), Some("spiffe://td/aether/node/n1"));
        let slot = CertSlot::default();
        adopt_svid(&[workload, edge], "n1", LinkRole::Node, &slot, &mut None);
        assert_eq!(
            held(&slot).as_deref(),
            Some("spiffe://td/ns/aether-system/sa/aether-edge-public")
        );
    }

    #[test]
    fn the_node_identity_follows_the_pod_identity_unless_set() {
        let mut config = LinkConfig::default();
        assert_eq!(config.node_identity(None), NodeIdentityKind::Bootstrap);
        assert_eq!(
            config.node_identity(Some(IdentityKind::Builtin)),
            NodeIdentityKind::Bootstrap
        );
        assert_eq!(config.node_identity(Some(IdentityKind::Spire)), NodeIdentityKind::Spire);
        config.node_identity = Some(NodeIdentityKind::Bootstrap);
        assert_eq!(
            config.node_identity(Some(IdentityKind::Spire)),
            NodeIdentityKind::Bootstrap
        );
        config.node_identity = Some(NodeIdentityKind::Spire);
        assert_eq!(config.node_identity(Some(IdentityKind::None)), NodeIdentityKind::Spire);
    }

    #[test]
    fn workload_sockets_are_unix_unless_a_scheme_says_otherwise() {
        assert_eq!(workload_endpoint("/run/spire/agent.sock"), "unix:/run/spire/agent.sock");
        assert_eq!(workload_endpoint("unix:///run/a.sock"), "unix:///run/a.sock");
        assert_eq!(workload_endpoint("tcp://127.0.0.1:8081"), "tcp://127.0.0.1:8081");
    }

    #[tokio::test]
    async fn spire_without_a_workload_socket_is_a_start_error() {
        let config = LinkConfig {
            node_identity: Some(NodeIdentityKind::Spire),
            ..LinkConfig::default()
        };
        let agent = AgentContext {
            node_name: "n1".into(),
            pod_identity: Some(IdentityKind::Spire),
            spire_workload_socket: String::new(),
        };
        match RegistrarLink::start_for("https://registrar:1", &config, &agent, CancellationToken::new()) {
            Err(LinkError::NoWorkloadSocket) => {}
            Err(other) => panic!("expected NoWorkloadSocket, got {other}"),
            Ok(_) => panic!("a spire node identity started without a Workload API socket"),
        }
    }
}
