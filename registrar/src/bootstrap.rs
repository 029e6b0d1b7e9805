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

use crate::auth::node_id_prefix;

/// The TokenReview `user.extra` key naming the node a pod-bound token's pod runs on.
pub const NODE_NAME_EXTRA: &str = "authentication.kubernetes.io/node-name";
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
    ttl: Duration,
    audience: String,
    /// `system:serviceaccount:<ns>:<name>`.
    agent_user: String,
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
            ttl: config.ttl,
            audience: config.audience,
            agent_user: format!("system:serviceaccount:{namespace}:{name}"),
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

    /// Asks Kubernetes whose `token` is; the node its pod is bound to if it is an agent's.
    async fn node_of(&self, token: &str) -> Result<String, Status> {
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
        node_of(reviewed.status.unwrap_or_default(), &self.audience, &self.agent_user)
            .map_err(|reason| Status::permission_denied(format!("rule agent-token: {reason}")))
    }

    fn issue(&self, node: &str, csr_der: &[u8]) -> Result<(String, String), Status> {
        let csr = CertificateSigningRequestParams::from_der(&csr_der.to_vec().into())
            .map_err(|e| Status::invalid_argument(format!("csr_der: not a signed PKCS#10 request ({e})")))?;
        let spiffe_id = format!("{}{node}", self.node_prefix);
        let uri = spiffe_id
            .clone()
            .try_into()
            .map_err(|e: rcgen::Error| Status::internal(format!("naming {spiffe_id}: {e}")))?;
        let mut params = CertificateParams::default();
        params.subject_alt_names = vec![SanType::URI(uri)];
        let mut dn = DistinguishedName::new();
        dn.push(DnType::OrganizationName, "aether");
        dn.push(DnType::CommonName, format!("aether-agent {node}"));
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
    #[error("the token belongs to {}, not to the agents' service account {agent_user}", quote(.user))]
    NotTheAgents { user: String, agent_user: String },
    #[error(
        "the token is not bound to a pod on a node (user.extra[{NODE_NAME_EXTRA:?}] is {}): use a projected \
         ServiceAccount token (Kubernetes 1.30 or later)",
        quote(.0)
    )]
    NotBoundToNode(String),
}

fn clipped(error: &str) -> String {
    match error {
        "" => String::new(),
        error => format!(": {}", aether_common::quote::clip(error)),
    }
}

/// The node a reviewed token is bound to, if the review says it is a valid token of
/// `agent_user` for `audience`.
pub fn node_of(status: TokenReviewStatus, audience: &str, agent_user: &str) -> Result<String, TokenRejected> {
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
    if username != agent_user {
        return Err(TokenRejected::NotTheAgents {
            user: username,
            agent_user: agent_user.to_owned(),
        });
    }
    let node = user
        .extra
        .as_ref()
        .and_then(|extra| extra.get(NODE_NAME_EXTRA))
        .and_then(|values| values.first())
        .cloned()
        .unwrap_or_default();
    let valid = !node.is_empty()
        && node.len() <= 253
        && node
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.');
    match valid {
        true => Ok(node),
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
            let node = self.node_of(&request.token).await?;
            self.issue(&node, &request.csr_der)
        }
        .await;
        match result {
            Ok((cert_chain_pem, spiffe_id)) => {
                self.issued.get_or_create(&[("result", "issued")]).inc();
                tracing::info!(%spiffe_id, ?remote, ttl = ?self.ttl, "issued a node certificate");
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
        assert_eq!(node_of(reviewed, "aether-registrar", AGENT).unwrap(), "node-a");
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
        ];
        for (reviewed, reason) in cases {
            let error = node_of(reviewed, "aether-registrar", AGENT).unwrap_err().to_string();
            assert!(error.contains(reason), "{error}");
        }
    }
}
