//! NodeBootstrap: an agent without SPIRE proves which node it runs on and gets a
//! short-lived node certificate, `spiffe://<td>/aether/node/<node>`, from the node CA
//! only the registrar holds (proposals/010).
//!
//! The proof is the agent pod's projected ServiceAccount token, bound to the audience
//! `--bootstrap-audience`, which the registrar checks with a TokenReview: Kubernetes
//! says whether the token is valid and unexpired, whose it is (only
//! `--agent-service-account` qualifies) and which node its pod is bound to
//! (`authentication.kubernetes.io/node-name`, set by kubelet-issued tokens since
//! Kubernetes 1.30). A token stolen off one node therefore yields only that node's
//! identity, and only while the pod it was issued to exists.
//!
//! Edge gateways (`aether-agent edge`) follow the Watch stream through the same
//! exchange but never write: a token of a ServiceAccount listed in
//! `--edge-service-accounts` (exact `<namespace>/<name>` entries, no wildcards) gets a
//! *reader* certificate `spiffe://<td>/aether/edge/<namespace>/<name>`. An edge pod runs
//! on any node, so no node binding is required, but the token must still be bound to a
//! pod (`authentication.kubernetes.io/pod-name`), so it dies with the pod.

use std::time::{Duration, SystemTime};

use aether_proto::registrar::v1::node_bootstrap_server::NodeBootstrap;
use aether_proto::registrar::v1::{IssueNodeCertificateRequest, IssueNodeCertificateResponse};
use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec, TokenReviewStatus};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use rcgen::{
    CertificateParams, CertificateSigningRequestParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType,
};
use tonic::{Request, Response, Status};

use aether_common::quote::quote;

use crate::auth::{edge_id_prefix, node_id_prefix};

/// The TokenReview `user.extra` key naming the node a pod-bound token's pod runs on.
pub const NODE_NAME_EXTRA: &str = "authentication.kubernetes.io/node-name";
/// The TokenReview `user.extra` key naming the pod a pod-bound token is bound to.
pub const POD_NAME_EXTRA: &str = "authentication.kubernetes.io/pod-name";
/// The longest ServiceAccount name (a DNS-1123 subdomain).
const MAX_SERVICE_ACCOUNT_NAME: usize = 253;
/// Longest token and CSR accepted (a projected token is ~1 KiB, a CSR ~0.5 KiB).
const MAX_TOKEN_BYTES: usize = 16 * 1024;
const MAX_CSR_BYTES: usize = 16 * 1024;
/// Certificates are valid from a little before issue, for clocks a little behind ours.
const BACKDATE: Duration = Duration::from_secs(60);
/// TokenReviews in flight at once: anyone may call the bootstrap, and each call costs
/// the API server a review, so a flood queues here (then is refused) instead of there.
const MAX_REVIEWS_IN_FLIGHT: usize = 16;
/// How long a bootstrap call waits for a review slot.
const REVIEW_QUEUE_WAIT: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub enum BootstrapError {
    #[error("{flag} {path}: {reason}")]
    File {
        flag: &'static str,
        path: String,
        reason: String,
    },
    #[error("--agent-service-account {0:?}: expected <namespace>/<name>")]
    ServiceAccount(String),
    #[error("--edge-service-accounts entry {}: {reason}", quote(.entry))]
    EdgeServiceAccount { entry: String, reason: String },
    #[error(
        "the node bootstrap needs a Kubernetes client for TokenReviews (tried KUBECONFIG, ~/.kube/config and the in-cluster service account): {0}"
    )]
    Kube(String),
}

pub struct Bootstrap {
    issuer: Issuer<'static, KeyPair>,
    /// Intermediates sent after each leaf (PEM); empty when the node CA is a root.
    intermediates_pem: String,
    node_prefix: String,
    /// `spiffe://<td>/aether/edge/`.
    edge_prefix: String,
    ttl: Duration,
    audience: String,
    /// `system:serviceaccount:<ns>:<name>`.
    agent_user: String,
    /// `--edge-service-accounts`, by TokenReview user name.
    edge_users: EdgeUsers,
    kube: kube::Client,
    reviews: tokio::sync::Semaphore,
    issued: Family<[(&'static str, &'static str); 1], Counter>,
}

/// Where the bootstrap's settings come from.
pub struct BootstrapConfig<'a> {
    pub ca_cert: &'a std::path::Path,
    pub ca_key: &'a std::path::Path,
    pub trust_domain: &'a str,
    pub ttl: Duration,
    pub audience: String,
    pub agent_service_account: &'a str,
    /// `--edge-service-accounts`: `<namespace>/<name>` entries (empty ones skipped).
    pub edge_service_accounts: &'a [String],
}

/// The edges' ServiceAccounts: `system:serviceaccount:<ns>:<name>` to `(ns, name)`.
pub type EdgeUsers = std::collections::BTreeMap<String, (String, String)>;

/// `--edge-service-accounts` checked: exact `<namespace>/<name>` entries (a namespace is a
/// DNS-1123 label, a name a DNS-1123 subdomain), none of them the agents' own.
///
/// Wildcards (`aether-edge-*`) are refused on purpose: whoever may create a ServiceAccount
/// and a pod in that namespace would get to read the whole catalog; the chart knows its
/// gateways and lists each one's ServiceAccount.
pub fn edge_users(entries: &[String], agent_user: &str) -> Result<EdgeUsers, BootstrapError> {
    let mut users = EdgeUsers::new();
    for entry in entries.iter().map(|e| e.trim()).filter(|e| !e.is_empty()) {
        let refuse = |reason: String| BootstrapError::EdgeServiceAccount {
            entry: entry.to_owned(),
            reason,
        };
        if entry.contains('*') {
            return Err(refuse(
                "wildcards are not accepted: list each edge's ServiceAccount by its exact name".into(),
            ));
        }
        let (namespace, name) = entry
            .split_once('/')
            .ok_or_else(|| refuse("expected <namespace>/<name>".into()))?;
        aether_common::names::dns_label(namespace).map_err(|e| refuse(format!("the namespace {e}")))?;
        service_account_name(name).map_err(|e| refuse(format!("the name {e}")))?;
        let user = format!("system:serviceaccount:{namespace}:{name}");
        if user == agent_user {
            return Err(refuse(
                "is the agents' service account (--agent-service-account): an edge needs its own".into(),
            ));
        }
        users.insert(user, (namespace.to_owned(), name.to_owned()));
    }
    Ok(users)
}

/// Checks a ServiceAccount name: a DNS-1123 subdomain (dot-separated labels, at most 253 characters).
fn service_account_name(name: &str) -> Result<(), String> {
    if name.len() > MAX_SERVICE_ACCOUNT_NAME {
        return Err(format!(
            "is {} characters long (at most {MAX_SERVICE_ACCOUNT_NAME})",
            name.len()
        ));
    }
    name.split('.')
        .try_for_each(aether_common::names::dns_label)
        .map_err(|e| format!("must be a DNS-1123 subdomain: a part of it {e}"))
}

/// Whom a reviewed token may be certified as.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Subject {
    /// The agent on this node: `spiffe://<td>/aether/node/<node>`.
    Node(String),
    /// An edge gateway, by its ServiceAccount: `spiffe://<td>/aether/edge/<namespace>/<name>`, a reader.
    Edge { namespace: String, name: String },
}

impl Bootstrap {
    pub async fn new(config: BootstrapConfig<'_>) -> Result<Self, BootstrapError> {
        let read = |flag, path: &std::path::Path| {
            std::fs::read_to_string(path).map_err(|e| BootstrapError::File {
                flag,
                path: path.display().to_string(),
                reason: e.to_string(),
            })
        };
        let cert_text = read("--node-ca-cert", config.ca_cert)?;
        let key_text = read("--node-ca-key", config.ca_key)?;
        let file_error = |flag, path: &std::path::Path, reason: String| BootstrapError::File {
            flag,
            path: path.display().to_string(),
            reason,
        };
        let key = KeyPair::from_pem(&key_text)
            .map_err(|e| file_error("--node-ca-key", config.ca_key, format!("not a PEM private key: {e}")))?;
        let blocks: Vec<String> = aether_common::tls::pem_blocks(&cert_text)
            .into_iter()
            .filter(|b| b.starts_with("-----BEGIN CERTIFICATE-----"))
            .collect();
        let signing = blocks
            .first()
            .ok_or_else(|| file_error("--node-ca-cert", config.ca_cert, "no PEM CERTIFICATE block".into()))?;
        let issuer = Issuer::from_ca_cert_pem(signing, key)
            .map_err(|e| file_error("--node-ca-cert", config.ca_cert, format!("not a usable CA: {e}")))?;
        let (namespace, name) = config
            .agent_service_account
            .split_once('/')
            .filter(|(ns, name)| !ns.is_empty() && !name.is_empty())
            .ok_or_else(|| BootstrapError::ServiceAccount(config.agent_service_account.to_owned()))?;
        let agent_user = format!("system:serviceaccount:{namespace}:{name}");
        let edge_users = edge_users(config.edge_service_accounts, &agent_user)?;
        let kube = kube::Client::try_default()
            .await
            .map_err(|e| BootstrapError::Kube(e.to_string()))?;
        Ok(Self {
            issuer,
            // Everything after the signing CA but its last (the anchor the registrar trusts).
            intermediates_pem: blocks
                .get(1..blocks.len().saturating_sub(1))
                .unwrap_or_default()
                .concat(),
            node_prefix: node_id_prefix(config.trust_domain),
            edge_prefix: edge_id_prefix(config.trust_domain),
            ttl: config.ttl,
            audience: config.audience,
            agent_user,
            edge_users,
            kube,
            reviews: tokio::sync::Semaphore::new(MAX_REVIEWS_IN_FLIGHT),
            issued: Family::default(),
        })
    }

    /// Registers `node_certificates{result}` under the registrar's registry.
    pub fn register(&self, registrar: &mut prometheus_client::registry::Registry) {
        registrar.register(
            "node_certificates",
            "Node certificate requests (NodeBootstrap), by result",
            self.issued.clone(),
        );
    }

    /// Asks Kubernetes whose `token` is: the node its pod is bound to if it is an agent's,
    /// the edge's ServiceAccount if it is a listed edge's.
    async fn subject_of(&self, token: &str) -> Result<Subject, Status> {
        let _slot = tokio::time::timeout(REVIEW_QUEUE_WAIT, self.reviews.acquire())
            .await
            .map_err(|_| Status::unavailable("too many node certificate requests at once; retry shortly"))?
            .map_err(|_| Status::unavailable("shutting down"))?;
        let review = TokenReview {
            spec: TokenReviewSpec {
                token: Some(token.to_owned()),
                audiences: Some(vec![self.audience.clone()]),
            },
            ..Default::default()
        };
        let reviews: kube::Api<TokenReview> = kube::Api::all(self.kube.clone());
        let reviewed = reviews
            .create(&kube::api::PostParams::default(), &review)
            .await
            .map_err(|e| {
                tracing::warn!(error = %e, "TokenReview failed");
                Status::unavailable(format!(
                    "the registrar could not review the token with Kubernetes: {}",
                    aether_common::quote::clip(&e.to_string())
                ))
            })?;
        subject_of(
            reviewed.status.unwrap_or_default(),
            &self.audience,
            &self.agent_user,
            &self.edge_users,
        )
        .map_err(|reason| Status::permission_denied(format!("rule agent-token: {reason}")))
    }

    fn issue(&self, subject: &Subject, csr_der: &[u8]) -> Result<(String, String), Status> {
        let csr = CertificateSigningRequestParams::from_der(&csr_der.to_vec().into())
            .map_err(|e| Status::invalid_argument(format!("csr_der: not a signed PKCS#10 request ({e})")))?;
        let (spiffe_id, common_name) = match subject {
            Subject::Node(node) => (format!("{}{node}", self.node_prefix), format!("aether-agent {node}")),
            Subject::Edge { namespace, name } => (
                format!("{}{namespace}/{name}", self.edge_prefix),
                format!("aether-edge {namespace}/{name}"),
            ),
        };
        let uri = spiffe_id
            .clone()
            .try_into()
            .map_err(|e: rcgen::Error| Status::internal(format!("naming {spiffe_id}: {e}")))?;
        let mut params = CertificateParams::default();
        params.subject_alt_names = vec![SanType::URI(uri)];
        let mut dn = DistinguishedName::new();
        dn.push(DnType::OrganizationName, "aether");
        dn.push(DnType::CommonName, common_name);
        params.distinguished_name = dn;
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature, KeyUsagePurpose::KeyAgreement];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        params.use_authority_key_identifier_extension = true;
        let now = SystemTime::now();
        params.not_before = (now - BACKDATE.min(self.ttl / 8)).into();
        params.not_after = (now + self.ttl).into();
        let cert = params
            .signed_by(&csr.public_key, &self.issuer)
            .map_err(|e| Status::internal(format!("signing the node certificate: {e}")))?;
        Ok((format!("{}{}", cert.pem(), self.intermediates_pem), spiffe_id))
    }
}

/// Why a reviewed token does not make its bearer an agent on a node.
#[derive(Debug, thiserror::Error)]
pub enum TokenRejected {
    #[error("Kubernetes did not authenticate the token{}", clipped(.0))]
    NotAuthenticated(String),
    #[error("the token is not bound to the audience {0:?}")]
    WrongAudience(String),
    #[error(
        "the token belongs to {}, not to the agents' service account {agent_user} nor to an edge's in \
         --edge-service-accounts",
        quote(.user)
    )]
    NotTheAgents { user: String, agent_user: String },
    #[error(
        "the token is not bound to a pod on a node (user.extra[{NODE_NAME_EXTRA:?}] is {}): use a projected \
         ServiceAccount token (Kubernetes 1.30 or later)",
        quote(.0)
    )]
    NotBoundToNode(String),
    #[error(
        "the edge's token is not bound to a pod (user.extra[{POD_NAME_EXTRA:?}] is {}): use a projected \
         ServiceAccount token",
        quote(.0)
    )]
    NotBoundToPod(String),
}

fn clipped(error: &str) -> String {
    match error {
        "" => String::new(),
        error => format!(": {}", aether_common::quote::clip(error)),
    }
}

/// Whom a reviewed token may be certified as, if the review says it is a valid token for
/// `audience`: of `agent_user` bound to a node (the agent there), or of one of
/// `edge_users` bound to a pod on any node (that edge).
pub fn subject_of(
    status: TokenReviewStatus,
    audience: &str,
    agent_user: &str,
    edge_users: &EdgeUsers,
) -> Result<Subject, TokenRejected> {
    if status.authenticated != Some(true) {
        return Err(TokenRejected::NotAuthenticated(status.error.unwrap_or_default()));
    }
    // An API server that does not echo audiences checked the one we asked for.
    if let Some(audiences) = &status.audiences
        && !audiences.iter().any(|a| a == audience)
    {
        return Err(TokenRejected::WrongAudience(audience.to_owned()));
    }
    let user = status.user.unwrap_or_default();
    let username = user.username.unwrap_or_default();
    let extra = |key: &str| {
        user.extra
            .as_ref()
            .and_then(|extra| extra.get(key))
            .and_then(|values| values.first())
            .cloned()
            .unwrap_or_default()
    };
    if username != agent_user {
        let Some((namespace, name)) = edge_users.get(&username) else {
            return Err(TokenRejected::NotTheAgents {
                user: username,
                agent_user: agent_user.to_owned(),
            });
        };
        // Any node will do, but the token must die with its pod.
        let pod = extra(POD_NAME_EXTRA);
        if pod.is_empty() {
            return Err(TokenRejected::NotBoundToPod(pod));
        }
        return Ok(Subject::Edge {
            namespace: namespace.clone(),
            name: name.clone(),
        });
    }
    let node = extra(NODE_NAME_EXTRA);
    let valid = !node.is_empty()
        && node.len() <= 253
        && node
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.');
    match valid {
        true => Ok(Subject::Node(node)),
        false => Err(TokenRejected::NotBoundToNode(node)),
    }
}

#[tonic::async_trait]
impl NodeBootstrap for Bootstrap {
    async fn issue_node_certificate(
        &self,
        request: Request<IssueNodeCertificateRequest>,
    ) -> Result<Response<IssueNodeCertificateResponse>, Status> {
        let remote = request
            .extensions()
            .get::<aether_common::tls::PeerInfo>()
            .and_then(|p| p.remote);
        let request = request.into_inner();
        let result = async {
            if request.token.is_empty() || request.token.len() > MAX_TOKEN_BYTES {
                return Err(Status::invalid_argument(format!(
                    "token: {} bytes (a projected ServiceAccount token, 1 to {MAX_TOKEN_BYTES} bytes)",
                    request.token.len()
                )));
            }
            if request.csr_der.is_empty() || request.csr_der.len() > MAX_CSR_BYTES {
                return Err(Status::invalid_argument(format!(
                    "csr_der: {} bytes (1 to {MAX_CSR_BYTES})",
                    request.csr_der.len()
                )));
            }
            let subject = self.subject_of(&request.token).await?;
            let (chain, spiffe_id) = self.issue(&subject, &request.csr_der)?;
            Ok((chain, spiffe_id, subject))
        }
        .await;
        match result {
            Ok((cert_chain_pem, spiffe_id, subject)) => {
                self.issued.get_or_create(&[("result", "issued")]).inc();
                match subject {
                    Subject::Node(_) => {
                        tracing::info!(%spiffe_id, ?remote, ttl = ?self.ttl, "issued a node certificate")
                    }
                    Subject::Edge { .. } => {
                        tracing::info!(%spiffe_id, ?remote, ttl = ?self.ttl, "issued an edge certificate (read-only)")
                    }
                }
                Ok(Response::new(IssueNodeCertificateResponse {
                    cert_chain_pem,
                    spiffe_id,
                }))
            }
            Err(status) => {
                self.issued.get_or_create(&[("result", "refused")]).inc();
                tracing::warn!(?remote, code = ?status.code(), message = status.message(), "refused a node certificate");
                Err(status)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use k8s_openapi::api::authentication::v1::UserInfo;

    use super::*;

    const AGENT: &str = "system:serviceaccount:aether-system:aether-agent";
    const EDGE: &str = "system:serviceaccount:aether-system:aether-edge-public";

    fn edges() -> EdgeUsers {
        edge_users(&["aether-system/aether-edge-public".to_owned()], AGENT).unwrap()
    }

    fn node_of(status: TokenReviewStatus, audience: &str, agent_user: &str) -> Result<Subject, TokenRejected> {
        subject_of(status, audience, agent_user, &edges())
    }

    fn status(username: &str, node: Option<&str>, audiences: Option<&[&str]>) -> TokenReviewStatus {
        TokenReviewStatus {
            authenticated: Some(true),
            audiences: audiences.map(|a| a.iter().map(|s| s.to_string()).collect()),
            user: Some(UserInfo {
                username: Some(username.into()),
                extra: node.map(|n| BTreeMap::from([(NODE_NAME_EXTRA.to_owned(), vec![n.to_owned()])])),
                ..Default::default()
            }),
            error: None,
        }
    }

    #[test]
    fn a_valid_agent_token_names_its_node() {
        let reviewed = status(AGENT, Some("node-a"), Some(&["aether-registrar"]));
        assert_eq!(
            node_of(reviewed, "aether-registrar", AGENT).unwrap(),
            Subject::Node("node-a".into())
        );
    }

    #[test]
    fn a_listed_edge_token_bound_to_a_pod_on_any_node_names_its_service_account() {
        let mut reviewed = status(EDGE, Some("node-z"), Some(&["aether-registrar"]));
        let edge = Subject::Edge {
            namespace: "aether-system".into(),
            name: "aether-edge-public".into(),
        };
        let extra = reviewed.user.as_mut().unwrap().extra.as_mut().unwrap();
        extra.insert(POD_NAME_EXTRA.to_owned(), vec!["aether-edge-public-7c9f".into()]);
        assert_eq!(node_of(reviewed.clone(), "aether-registrar", AGENT).unwrap(), edge);
        // No node binding needed: only the pod's.
        reviewed
            .user
            .as_mut()
            .unwrap()
            .extra
            .as_mut()
            .unwrap()
            .remove(NODE_NAME_EXTRA);
        assert_eq!(node_of(reviewed, "aether-registrar", AGENT).unwrap(), edge);
    }

    #[test]
    fn edge_service_accounts_are_exact_names() {
        let users = edge_users(
            &["ns-a/edge-1".to_owned(), String::new(), " ns-b/edge.two ".to_owned()],
            AGENT,
        )
        .unwrap();
        assert_eq!(
            users.get("system:serviceaccount:ns-b:edge.two"),
            Some(&("ns-b".to_owned(), "edge.two".to_owned()))
        );
        assert_eq!(users.len(), 2);
        let long = format!("ns/{}", "x".repeat(300));
        for (entry, reason) in [
            ("aether-system/aether-edge-*", "wildcards are not accepted"),
            ("aether-edge", "expected <namespace>/<name>"),
            ("Aether/edge", "the namespace must be a DNS-1123 label"),
            ("ns/", "the name must be a DNS-1123 subdomain: a part of it is empty"),
            ("ns/a/b", "the name must be a DNS-1123 subdomain"),
            (long.as_str(), "the name is 300 characters long"),
            ("aether-system/aether-agent", "is the agents' service account"),
        ] {
            let error = edge_users(&[entry.to_owned()], AGENT).unwrap_err().to_string();
            assert!(error.starts_with("--edge-service-accounts entry \""), "{error}");
            assert!(error.contains(reason), "{entry}: {error}");
            assert!(error.len() < 400, "the entry is quoted bounded: {error}");
        }
    }

    #[test]
    fn other_tokens_are_refused_with_the_reason() {
        let cases = [
            (
                TokenReviewStatus {
                    authenticated: Some(false),
                    error: Some("token has expired".into()),
                    ..Default::default()
                },
                "did not authenticate the token: token has expired",
            ),
            (
                status(AGENT, Some("node-a"), Some(&["api"])),
                "not bound to the audience",
            ),
            (
                status("system:serviceaccount:shop:cart", Some("node-a"), None),
                "not to the agents' service account",
            ),
            (status(AGENT, None, None), "not bound to a pod on a node"),
            (status(AGENT, Some("Node/../x"), None), "not bound to a pod on a node"),
            // An edge's token not bound to a pod.
            (status(EDGE, None, None), "the edge's token is not bound to a pod"),
            // An edge token from a ServiceAccount not listed.
            (
                status(
                    "system:serviceaccount:aether-system:aether-edge-other",
                    Some("node-a"),
                    None,
                ),
                "not to the agents' service account",
            ),
        ];
        for (reviewed, reason) in cases {
            let error = node_of(reviewed, "aether-registrar", AGENT).unwrap_err().to_string();
            assert!(error.contains(reason), "{error}");
        }
    }
}
