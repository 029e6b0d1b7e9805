//! Who may call what (proposals/010): an agent, named by its node certificate
//! `spiffe://<td>/aether/node/<node>`, may write only endpoints of its own node and may
//! read; a reader identity (controller, CLI, listed in `--reader-ids`) and an edge
//! gateway (`spiffe://<td>/aether/edge/<namespace>/<service account>`, proposals/018)
//! may only read; nobody else gets anything but the bootstrap. Refusals are PERMISSION_DENIED (or UNAUTHENTICATED without an
//! identity) naming the rule, logged with the caller and counted.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::SystemTime;

use aether_common::tls::{PeerIdentity, PeerInfo};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use tonic::{Request, Status};

/// The path under the trust domain that names agents.
pub const NODE_ID_PATH: &str = "/aether/node/";
/// The path under the trust domain that names edge gateways (readers):
/// `<namespace>/<service account>` follows it.
pub const EDGE_ID_PATH: &str = "/aether/edge/";

/// The authenticated caller of one request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Caller {
    /// `--insecure`: no TLS, everything allowed.
    Anyone,
    Agent {
        node: String,
    },
    /// A `--reader-ids` identity or an edge gateway: reads only.
    Reader {
        id: String,
    },
}

/// The rules, as configured.
#[derive(Clone)]
pub struct Policy {
    insecure: bool,
    /// `spiffe://<td>/aether/node/`.
    node_prefix: String,
    /// `spiffe://<td>/aether/edge/`.
    edge_prefix: String,
    readers: Arc<BTreeSet<String>>,
    denied: Family<[(&'static str, &'static str); 2], Counter>,
}

/// A rule a request broke, for the status, the log and the metric label.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rule {
    /// The method needs a client certificate.
    Authenticated,
    /// The certificate expired while its connection stayed open.
    CertificateValid,
    /// The caller is neither an agent, an edge nor an allowed reader.
    KnownIdentity,
    /// Writes come from agents only.
    AgentWrites,
    /// An agent writes only endpoints of its own node.
    OwnNode,
}

impl Rule {
    pub fn as_str(self) -> &'static str {
        match self {
            Rule::Authenticated => "authenticated",
            Rule::CertificateValid => "certificate-valid",
            Rule::KnownIdentity => "known-identity",
            Rule::AgentWrites => "agent-writes",
            Rule::OwnNode => "own-node",
        }
    }
}

impl Policy {
    pub fn new(insecure: bool, trust_domain: &str, readers: impl IntoIterator<Item = String>) -> Self {
        Self {
            insecure,
            node_prefix: node_id_prefix(trust_domain),
            edge_prefix: edge_id_prefix(trust_domain),
            readers: Arc::new(readers.into_iter().filter(|r| !r.is_empty()).collect()),
            denied: Family::default(),
        }
    }

    /// Registers `requests_denied{method, rule}` under the registrar's registry.
    pub fn register(&self, registrar: &mut prometheus_client::registry::Registry) {
        registrar.register(
            "requests_denied",
            "Requests refused by the access rules, by method and rule",
            self.denied.clone(),
        );
    }

    /// The caller of `request`, if it may call `method` at all (a reader, an edge or an
    /// agent). An edge is a [`Caller::Reader`]: it never writes.
    pub fn reader<T>(&self, method: &'static str, request: &Request<T>) -> Result<Caller, Status> {
        if self.insecure {
            return Ok(Caller::Anyone);
        }
        let identity = self.identity(method, request)?;
        let id = identity.spiffe_id.as_deref().unwrap_or_default();
        if let Some(node) = id
            .strip_prefix(&self.node_prefix)
            .filter(|n| !n.is_empty() && !n.contains('/'))
        {
            return Ok(Caller::Agent { node: node.to_owned() });
        }
        if self.readers.contains(id) || self.is_edge(id) {
            return Ok(Caller::Reader { id: id.to_owned() });
        }
        Err(self.deny(
            method,
            Rule::KnownIdentity,
            identity.name(),
            format!(
                "{} is neither an agent ({}<node>), an edge ({}<namespace>/<service account>) nor a reader in \
                 --reader-ids",
                identity.name(),
                self.node_prefix,
                self.edge_prefix
            ),
        ))
    }

    /// Whether `id` names an edge gateway: `spiffe://<td>/aether/edge/<namespace>/<name>`.
    fn is_edge(&self, id: &str) -> bool {
        id.strip_prefix(&self.edge_prefix)
            .and_then(|rest| rest.split_once('/'))
            .is_some_and(|(namespace, name)| !namespace.is_empty() && !name.is_empty() && !name.contains('/'))
    }

    /// The node of the agent calling `method` (None with `--insecure`): only agents
    /// write, and only their own node's endpoints (checked by [`Policy::writer`] against
    /// the request, and by the catalog against what it holds).
    pub fn agent<T>(&self, method: &'static str, request: &Request<T>) -> Result<Option<String>, Status> {
        match self.reader(method, request)? {
            Caller::Anyone => Ok(None),
            Caller::Agent { node } => Ok(Some(node)),
            Caller::Reader { id } => Err(self.deny(
                method,
                Rule::AgentWrites,
                &id,
                format!("{id} is a reader; only agents write endpoints"),
            )),
        }
    }

    /// The node of the agent calling `method` if it may write an endpoint of `node`.
    pub fn writer<T>(&self, method: &'static str, request: &Request<T>, node: &str) -> Result<Option<String>, Status> {
        match self.agent(method, request)? {
            Some(own) if own != node => Err(self.deny(
                method,
                Rule::OwnNode,
                &self.node_id(&own),
                format!(
                    "the agent of node {own:?} may only write endpoints of its own node, not of {}",
                    aether_common::quote::quote(node)
                ),
            )),
            owner => Ok(owner),
        }
    }

    /// Counts and logs a write the catalog refused (an endpoint another node holds).
    pub fn denied_by_catalog(&self, method: &'static str, caller: &str, detail: &str) {
        self.count(method, Rule::OwnNode);
        tracing::warn!(method, caller = %self.node_id(caller), rule = Rule::OwnNode.as_str(), detail, "refused");
    }

    pub fn node_id(&self, node: &str) -> String {
        format!("{}{node}", self.node_prefix)
    }

    fn identity<'r, T>(&self, method: &'static str, request: &'r Request<T>) -> Result<&'r Arc<PeerIdentity>, Status> {
        let Some(identity) = request
            .extensions()
            .get::<PeerInfo>()
            .and_then(|info| info.identity.as_ref())
        else {
            self.count(method, Rule::Authenticated);
            tracing::warn!(method, remote = ?remote(request), rule = Rule::Authenticated.as_str(), "refused a request without a client certificate");
            return Err(Status::unauthenticated(format!(
                "rule {}: {method} needs a client certificate (an agent's node certificate or a reader's SVID)",
                Rule::Authenticated.as_str()
            )));
        };
        if identity.not_after <= SystemTime::now() {
            self.count(method, Rule::CertificateValid);
            tracing::warn!(
                method,
                caller = identity.name(),
                rule = Rule::CertificateValid.as_str(),
                "refused a request on a connection whose certificate expired"
            );
            return Err(Status::unauthenticated(format!(
                "rule {}: the client certificate of this connection ({}) has expired; reconnect with a fresh one",
                Rule::CertificateValid.as_str(),
                identity.name()
            )));
        }
        Ok(identity)
    }

    fn deny(&self, method: &'static str, rule: Rule, caller: &str, detail: String) -> Status {
        self.count(method, rule);
        tracing::warn!(method, caller = %caller, rule = rule.as_str(), %detail, "refused");
        Status::permission_denied(format!("rule {}: {detail}", rule.as_str()))
    }

    fn count(&self, method: &'static str, rule: Rule) {
        self.denied
            .get_or_create(&[("method", method), ("rule", rule.as_str())])
            .inc();
    }
}

/// When the certificate of `request`'s connection expires (None: no TLS).
pub fn expiry<T>(request: &Request<T>) -> Option<SystemTime> {
    request
        .extensions()
        .get::<PeerInfo>()
        .and_then(|info| info.identity.as_ref())
        .map(|identity| identity.not_after)
}

fn remote<T>(request: &Request<T>) -> Option<std::net::SocketAddr> {
    request.extensions().get::<PeerInfo>().and_then(|info| info.remote)
}

pub fn node_id_prefix(trust_domain: &str) -> String {
    format!("spiffe://{trust_domain}{NODE_ID_PATH}")
}

pub fn edge_id_prefix(trust_domain: &str) -> String {
    format!("spiffe://{trust_domain}{EDGE_ID_PATH}")
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn request(spiffe_id: Option<&str>, expires_in: Duration) -> Request<()> {
        let mut request = Request::new(());
        let identity = spiffe_id.map(|id| {
            Arc::new(PeerIdentity {
                spiffe_id: Some(id.to_owned()),
                dns_names: Vec::new(),
                not_after: SystemTime::now() + expires_in,
            })
        });
        request.extensions_mut().insert(PeerInfo { remote: None, identity });
        request
    }

    fn policy() -> Policy {
        Policy::new(
            false,
            "td",
            ["spiffe://td/ns/aether-system/sa/aether-controller".to_owned()],
        )
    }

    const HOUR: Duration = Duration::from_secs(3600);

    #[test]
    fn an_agent_writes_only_its_own_node() {
        let p = policy();
        let a = request(Some("spiffe://td/aether/node/a"), HOUR);
        assert_eq!(p.writer("RegisterEndpoint", &a, "a").unwrap(), Some("a".into()));
        let denied = p.writer("RegisterEndpoint", &a, "b").unwrap_err();
        assert_eq!(denied.code(), tonic::Code::PermissionDenied);
        assert!(
            denied.message().starts_with("rule own-node: the agent of node \"a\""),
            "{}",
            denied.message()
        );
        assert_eq!(
            p.denied
                .get_or_create(&[("method", "RegisterEndpoint"), ("rule", "own-node")])
                .get(),
            1
        );
    }

    #[test]
    fn readers_read_and_never_write() {
        let p = policy();
        let reader = request(Some("spiffe://td/ns/aether-system/sa/aether-controller"), HOUR);
        assert!(matches!(p.reader("Watch", &reader), Ok(Caller::Reader { .. })));
        let denied = p.writer("RegisterEndpoint", &reader, "a").unwrap_err();
        assert!(
            denied.message().starts_with("rule agent-writes:"),
            "{}",
            denied.message()
        );
    }

    #[test]
    fn edges_read_and_never_write() {
        let p = policy();
        let edge = request(Some("spiffe://td/aether/edge/aether-system/aether-edge-public"), HOUR);
        assert!(matches!(p.reader("Watch", &edge), Ok(Caller::Reader { .. })));
        assert!(matches!(p.reader("ListEndpoints", &edge), Ok(Caller::Reader { .. })));
        for method in ["RegisterEndpoint", "UnregisterEndpoint"] {
            let denied = p.writer(method, &edge, "a").unwrap_err();
            assert_eq!(denied.code(), tonic::Code::PermissionDenied);
            assert!(
                denied
                    .message()
                    .starts_with("rule agent-writes: spiffe://td/aether/edge/"),
                "{}",
                denied.message()
            );
            let denied = p.agent(method, &edge).unwrap_err();
            assert!(
                denied.message().starts_with("rule agent-writes:"),
                "{}",
                denied.message()
            );
        }
        assert_eq!(
            p.denied
                .get_or_create(&[("method", "RegisterEndpoint"), ("rule", "agent-writes")])
                .get(),
            2
        );
    }

    #[test]
    fn strangers_anonymous_callers_and_expired_connections_are_refused() {
        let p = policy();
        let cases = [
            (
                request(Some("spiffe://td/ns/shop/sa/cart"), HOUR),
                tonic::Code::PermissionDenied,
                "known-identity",
            ),
            (
                request(Some("spiffe://other/aether/node/a"), HOUR),
                tonic::Code::PermissionDenied,
                "known-identity",
            ),
            (
                request(Some("spiffe://td/aether/node/"), HOUR),
                tonic::Code::PermissionDenied,
                "known-identity",
            ),
            // Edge IDs are `<namespace>/<name>` in this trust domain, nothing else.
            (
                request(Some("spiffe://other/aether/edge/ns/edge"), HOUR),
                tonic::Code::PermissionDenied,
                "known-identity",
            ),
            (
                request(Some("spiffe://td/aether/edge/ns"), HOUR),
                tonic::Code::PermissionDenied,
                "known-identity",
            ),
            (
                request(Some("spiffe://td/aether/edge/ns/"), HOUR),
                tonic::Code::PermissionDenied,
                "known-identity",
            ),
            (
                request(Some("spiffe://td/aether/edge//edge"), HOUR),
                tonic::Code::PermissionDenied,
                "known-identity",
            ),
            (
                request(Some("spiffe://td/aether/edge/ns/edge/x"), HOUR),
                tonic::Code::PermissionDenied,
                "known-identity",
            ),
            (request(None, HOUR), tonic::Code::Unauthenticated, "authenticated"),
            (
                request(Some("spiffe://td/aether/node/a"), Duration::ZERO),
                tonic::Code::Unauthenticated,
                "certificate-valid",
            ),
        ];
        for (request, code, rule) in cases {
            let denied = p.reader("Watch", &request).unwrap_err();
            assert_eq!(denied.code(), code, "{}", denied.message());
            assert!(
                denied.message().starts_with(&format!("rule {rule}:")),
                "{}",
                denied.message()
            );
        }
    }

    #[test]
    fn insecure_allows_anyone() {
        let p = Policy::new(true, "td", []);
        assert_eq!(p.writer("RegisterEndpoint", &Request::new(()), "b").unwrap(), None);
    }
}
