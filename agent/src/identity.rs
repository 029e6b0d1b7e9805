//! Workload identity: an X.509 SVID per local pod and the trust bundles to verify
//! peers with, from a provider (`--identity builtin|spire`), handed to the xDS
//! generators as SDS secrets.
//!
//! The SPIFFE ID is per service account, `spiffe://<td>/ns/<ns>/sa/<sa>` (what SPIRE's
//! Kubernetes registration issues and what an RBAC policy can name); the service name
//! (which defaults to the service account) is a routing name, not an identity. Each pod
//! still gets its *own* key and certificate: two pods sharing a service account share a
//! SPIFFE ID, never a private key, and Envoy holds one secret per pod (`svid|<ns>/<pod>`).
//!
//! Private keys live only in memory: [`Svid`]'s `Debug` redacts them, nothing here
//! writes them to disk, and they reach Envoy only over the agent's 0600 xDS socket.

pub mod builtin;
pub mod spire;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::pod::{LocalPod, PodInfo};

/// `--identity`: where pods' SVIDs come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum IdentityKind {
    /// A CA certificate and key from files sign short-lived per-pod SVIDs.
    Builtin,
    /// The SPIRE agent's Delegated Identity API.
    Spire,
    /// NOT FOR PRODUCTION: plaintext between pods (benchmarks and debugging only).
    None,
}

#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    #[error("--trust-domain {0:?}: must be a lowercase DNS-like name (letters, digits, '.', '-', '_')")]
    TrustDomain(String),
    #[error("{flag} {path}: {source}")]
    Read {
        flag: &'static str,
        path: String,
        source: std::io::Error,
    },
    #[error("{flag}: {reason}")]
    Flag { flag: &'static str, reason: String },
    #[error("issuing an SVID for {spiffe_id}: {reason}")]
    Issue { spiffe_id: String, reason: String },
    #[error("{0}")]
    Svid(String),
}

/// A private key in PEM form. Never printed.
#[derive(Clone, PartialEq, Eq)]
pub struct PrivateKey(String);

impl PrivateKey {
    pub fn new(pem: String) -> Self {
        Self(pem)
    }

    /// The PEM text: for the SDS secret, and for `explain`'s SAN probe (which presents
    /// the pod's SVID as the pod's own calls do).
    pub fn pem(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for PrivateKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PrivateKey(<redacted>)")
    }
}

/// One pod's X.509 SVID.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Svid {
    pub spiffe_id: String,
    /// Leaf first, then intermediates (PEM).
    pub cert_chain_pem: String,
    pub key: PrivateKey,
    pub not_before: SystemTime,
    pub not_after: SystemTime,
    /// The issuer's serial of the leaf (hex), to tell rotations apart.
    pub serial: String,
}

impl Svid {
    /// Builds an SVID from DER (what SPIRE hands out), checking that the leaf names
    /// `expected` as its URI SAN.
    pub fn from_der(chain: &[Vec<u8>], key_pkcs8: &[u8]) -> Result<Self, IdentityError> {
        let leaf = chain
            .first()
            .ok_or_else(|| IdentityError::Svid("empty certificate chain".into()))?;
        let (_, cert) = x509_parser::parse_x509_certificate(leaf)
            .map_err(|e| IdentityError::Svid(format!("parsing the leaf certificate: {e}")))?;
        let spiffe_id = uri_sans(&cert)
            .into_iter()
            .find(|u| u.starts_with("spiffe://"))
            .ok_or_else(|| IdentityError::Svid("the leaf certificate has no spiffe:// URI SAN".into()))?;
        let validity = cert.validity();
        let at = |t: x509_parser::time::ASN1Time| {
            SystemTime::UNIX_EPOCH + Duration::from_secs(u64::try_from(t.timestamp()).unwrap_or_default())
        };
        let pem_of = |tag: &str, der: &[u8]| pem_encode(tag, der);
        Ok(Self {
            spiffe_id,
            cert_chain_pem: chain.iter().map(|der| pem_of("CERTIFICATE", der)).collect(),
            key: PrivateKey::new(pem_of("PRIVATE KEY", key_pkcs8)),
            not_before: at(validity.not_before),
            not_after: at(validity.not_after),
            serial: cert.raw_serial_as_string(),
        })
    }

    /// When a rotation is due: half-way through its validity.
    pub fn half_life(&self) -> SystemTime {
        let lifetime = self.not_after.duration_since(self.not_before).unwrap_or_default();
        self.not_before + lifetime / 2
    }
}

fn uri_sans(cert: &x509_parser::certificate::X509Certificate) -> Vec<String> {
    let Ok(Some(san)) = cert.subject_alternative_name() else {
        return Vec::new();
    };
    san.value
        .general_names
        .iter()
        .filter_map(|n| match n {
            x509_parser::extensions::GeneralName::URI(u) => Some((*u).to_owned()),
            _ => None,
        })
        .collect()
}

/// PEM armour for DER bytes (64-column base64).
pub fn pem_encode(tag: &str, der: &[u8]) -> String {
    const TABLE: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut b64 = String::with_capacity(der.len().div_ceil(3) * 4);
    for chunk in der.chunks(3) {
        let n = (u32::from(chunk[0]) << 16)
            | (u32::from(*chunk.get(1).unwrap_or(&0)) << 8)
            | u32::from(*chunk.get(2).unwrap_or(&0));
        for i in 0..4 {
            if i <= chunk.len() {
                b64.push(TABLE[((n >> (18 - 6 * i)) & 63) as usize] as char);
            } else {
                b64.push('=');
            }
        }
    }
    let mut out = format!("-----BEGIN {tag}-----\n");
    for line in b64.as_bytes().chunks(64) {
        out.push_str(std::str::from_utf8(line).expect("base64 is ASCII"));
        out.push('\n');
    }
    out.push_str(&format!("-----END {tag}-----\n"));
    out
}

/// Everything the generators need: the node's trust domain, each local pod's SVID
/// (by pod id `<ns>/<name>`), and the CA certificates of every trust domain the node
/// accepts peers from (its own and federated ones), PEM, by trust domain name.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Identities {
    pub trust_domain: String,
    pub svids: BTreeMap<String, Arc<Svid>>,
    pub bundles: BTreeMap<String, String>,
}

/// The SPIFFE ID a pod is entitled to.
pub fn spiffe_id(trust_domain: &str, pod: &PodInfo) -> String {
    let sa = if pod.service_account.is_empty() {
        "default"
    } else {
        &pod.service_account
    };
    format!("spiffe://{trust_domain}/ns/{}/sa/{sa}", pod.namespace)
}

/// The secret name of a pod's SVID in Envoy.
pub fn svid_secret(pod_id: &str) -> String {
    format!("svid|{pod_id}")
}

/// The secret name of the node's validation context (the trust bundles).
pub fn bundle_secret(trust_domain: &str) -> String {
    format!("spiffe://{trust_domain}")
}

/// A trust domain name as SPIFFE allows it.
pub fn check_trust_domain(td: &str) -> Result<(), IdentityError> {
    let ok = !td.is_empty()
        && td.len() <= 255
        && td
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'.' | b'-' | b'_'));
    if ok {
        Ok(())
    } else {
        Err(IdentityError::TrustDomain(td.to_owned()))
    }
}

/// Identity flags of `aether-agent run`.
#[derive(Clone, Debug, clap::Args)]
pub struct IdentityConfig {
    /// Where pods' SVIDs come from. `none` is plaintext between pods: NOT FOR PRODUCTION.
    #[arg(
        id = "identity",
        long = "identity",
        env = "AETHER_IDENTITY",
        value_enum,
        default_value = "builtin"
    )]
    pub kind: IdentityKind,

    /// The SPIFFE trust domain of this mesh.
    #[arg(long, env = "AETHER_TRUST_DOMAIN", default_value = "cluster.local")]
    pub trust_domain: String,

    /// builtin: the CA certificate (PEM) that signs pods' SVIDs.
    #[arg(long, env = "AETHER_CA_CERT", default_value = "/etc/aether/ca/tls.crt")]
    pub ca_cert: PathBuf,

    /// builtin: the CA's private key (PEM, PKCS#8).
    #[arg(long, env = "AETHER_CA_KEY", default_value = "/etc/aether/ca/tls.key")]
    pub ca_key: PathBuf,

    /// builtin: SVID lifetime; SVIDs rotate at half-life.
    #[arg(long, env = "AETHER_SVID_TTL", default_value = "1h", value_parser = aether_common::duration::parse)]
    pub svid_ttl: Duration,

    /// spire: the SPIRE agent's admin socket (Delegated Identity API).
    #[arg(
        long,
        env = "SPIRE_ADMIN_ENDPOINT_SOCKET",
        default_value = "/run/spire/admin/admin.sock"
    )]
    pub spire_admin_socket: PathBuf,

    /// spire: the Workload API socket the agent fetches its own SVID from (its identity
    /// as an authorized delegate); empty to skip.
    #[arg(long, env = "SPIFFE_ENDPOINT_SOCKET", default_value = "")]
    pub spire_workload_socket: String,
}

#[derive(Clone, Default)]
pub struct IdentityMetrics {
    pub svids: Gauge,
    pub issued: Counter,
    pub withdrawn: Counter,
    pub errors: Counter,
    pub spire_streams: Gauge,
}

impl IdentityMetrics {
    pub fn register(&self, registry: &mut Registry) {
        registry.register("identity_svids", "Local pods holding an SVID", self.svids.clone());
        registry.register(
            "identity_svids_issued",
            "SVIDs received or issued (first and rotations)",
            self.issued.clone(),
        );
        registry.register(
            "identity_svids_withdrawn",
            "SVIDs withdrawn (pod gone or identity revoked)",
            self.withdrawn.clone(),
        );
        registry.register(
            "identity_errors",
            "Identity provider failures (issue errors, broken streams)",
            self.errors.clone(),
        );
        registry.register(
            "identity_spire_streams",
            "Open Delegated Identity API streams",
            self.spire_streams.clone(),
        );
    }
}

enum Provider {
    Builtin(builtin::Builtin),
    Spire(spire::Spire),
}

/// The node's identity source. Cheap to clone.
#[derive(Clone)]
pub struct Identity {
    provider: Arc<Provider>,
    state: Arc<watch::Sender<Arc<Identities>>>,
}

impl Identity {
    /// The provider `config` names; `None` for `--identity none`.
    pub fn start(
        config: &IdentityConfig,
        metrics: IdentityMetrics,
        shutdown: CancellationToken,
    ) -> Result<Option<Self>, IdentityError> {
        check_trust_domain(&config.trust_domain)?;
        let state = Arc::new(
            watch::channel(Arc::new(Identities {
                trust_domain: config.trust_domain.clone(),
                ..Default::default()
            }))
            .0,
        );
        let provider = match config.kind {
            IdentityKind::None => {
                tracing::warn!("--identity none: pod-to-pod traffic is PLAINTEXT; not for production");
                return Ok(None);
            }
            IdentityKind::Builtin => {
                Provider::Builtin(builtin::Builtin::start(config, state.clone(), metrics, shutdown)?)
            }
            IdentityKind::Spire => Provider::Spire(spire::Spire::start(config, state.clone(), metrics, shutdown)?),
        };
        Ok(Some(Self {
            provider: Arc::new(provider),
            state,
        }))
    }

    pub fn current(&self) -> Arc<Identities> {
        self.state.borrow().clone()
    }

    pub fn subscribe(&self) -> watch::Receiver<Arc<Identities>> {
        self.state.subscribe()
    }

    /// Tells the provider which pods are local: new ones get an SVID (the builtin CA
    /// issues at once; SPIRE subscriptions start), gone ones lose theirs.
    pub fn sync(&self, pods: &[LocalPod]) {
        match &*self.provider {
            Provider::Builtin(b) => b.sync(pods),
            Provider::Spire(s) => s.sync(pods),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_never_print() {
        let key = PrivateKey::new("-----BEGIN PRIVATE KEY-----\nsecret\n".into());
        assert_eq!(format!("{key:?}"), "PrivateKey(<redacted>)");
        let svid = Svid {
            spiffe_id: "spiffe://td/ns/a/sa/b".into(),
            cert_chain_pem: String::new(),
            key,
            not_before: SystemTime::UNIX_EPOCH,
            not_after: SystemTime::UNIX_EPOCH,
            serial: "01".into(),
        };
        assert!(!format!("{svid:?}").contains("secret"));
    }

    #[test]
    fn pem_matches_a_reference_encoder() {
        assert_eq!(
            pem_encode("X", b"hello world"),
            "-----BEGIN X-----\naGVsbG8gd29ybGQ=\n-----END X-----\n"
        );
        assert_eq!(pem_encode("X", b"ab"), "-----BEGIN X-----\nYWI=\n-----END X-----\n");
        assert_eq!(pem_encode("X", b"abc"), "-----BEGIN X-----\nYWJj\n-----END X-----\n");
    }

    #[test]
    fn trust_domains_are_checked() {
        assert!(check_trust_domain("cluster.local").is_ok());
        assert!(check_trust_domain("").is_err());
        assert!(check_trust_domain("Bad/TD").is_err());
    }

    #[test]
    fn spiffe_ids_are_per_service_account() {
        let pod = PodInfo {
            namespace: "shop".into(),
            service_account: "cart".into(),
            ..Default::default()
        };
        assert_eq!(spiffe_id("td", &pod), "spiffe://td/ns/shop/sa/cart");
    }
}
