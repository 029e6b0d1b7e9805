//! The etcd v3 store: every replica reads and writes one etcd cluster and follows
//! the other replicas' writes through an etcd Watch.
//!
//! Key layout under `--etcd-prefix` P (default `/aether/v1`; values are protobuf):
//! - `P/services/<ns>/<name>` → `aether.registry.v1.Service`
//! - `P/vips/<vip>` → `<ns>/<name>` (text): the VIP uniqueness index
//! - `P/endpoints/<ns>/<name>/<address>` → `aether.registry.v1.Endpoint`, attached to
//!   the lease of the endpoint's node (no lease when `node` is empty)
//! - `P/nodes/<node>` → lease id (decimal text), attached to that same lease
//! - `P/<plural>/<key>` → a configuration record of the kind of that plural
//!   (`P/routes/<kind>/<ns>/<name>` → `aether.registry.v1.Route`, `P/policies/<ns>/<name>`
//!   → `aether.registry.v1.AuthorizationPolicy`), without a lease: records come from
//!   configuration, not from agents, and never expire
//!
//! Revisions are etcd's: a record's revision is its `mod_revision`, a commit's is
//! the transaction's header revision. Service creation is one transaction comparing
//! `create_revision == 0` on the service key and on the VIP key, so of two replicas
//! creating the same service one wins and the other reads the winner's record back.
//! A service update compares `create_revision > 0` on the service key and the VIP
//! key's value with the service's key: it lands only on the service it read, VIP
//! unchanged. Configuration record writes are plain puts and deletes
//! in the same transaction as the rest of the batch, with no conditions.
//! Endpoint TTL uses leases: one per node, granted on its first endpoint and kept
//! alive by every re-registration; when it lapses etcd deletes the node's endpoints
//! and every replica sees the deletions on its Watch.
//!
//! Credentials: `--etcd-username`/`--etcd-password` authenticate with etcd's token
//! auth (the token is refreshed when etcd expires it); `--etcd-ca-file` verifies an
//! https:// etcd, and `--etcd-cert-file`/`--etcd-key-file` present a client
//! certificate to an etcd run with `--client-cert-auth`. Bad combinations and
//! unreadable PEM files are config errors naming the flag, found before dialling.

use parking_lot::Mutex;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use aether_common::quote::quote;
use aether_proto::registry::v1::{Endpoint, Service};
use async_trait::async_trait;
use etcd_client::{
    Certificate, Client, Compare, CompareOp, ConnectOptions, EventType, GetOptions, Identity, KeyValue, PutOptions,
    TlsOptions, Txn, TxnOp, TxnOpResponse, WatchOptions,
};
use prost::Message;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use super::{
    Conflict, Contents, Feed, FeedChange, FeedChangeKind, FeedEvent, Revision, Store, StoreError, StoreOp,
    StoreSettings, Stored, UnreadableRecord, vip_change,
};
use crate::config::Secret;
use crate::model::ServiceKey;
use crate::records::ConfigKind;

/// Keys read per page while loading.
const PAGE: i64 = 2_000;
/// etcd's default `--max-txn-ops`.
pub const DEFAULT_MAX_TXN_OPS: usize = 128;
const FEED_BUFFER: usize = 256;
const LEASE_NOT_FOUND: &str = "requested lease not found";

/// Debug redacts the password (see [`Secret`]).
#[derive(Clone, Debug)]
pub struct EtcdConfig {
    pub endpoints: Vec<String>,
    /// Key prefix without a trailing slash.
    pub prefix: String,
    /// Timeout of one request.
    pub timeout: Duration,
    /// The cluster's `--max-txn-ops`.
    pub max_txn_ops: usize,
    /// `--etcd-username` / `--etcd-password`: both or neither.
    pub username: Option<String>,
    pub password: Option<Secret>,
    pub tls: EtcdTlsFiles,
}

impl EtcdConfig {
    /// A config without credentials or TLS.
    pub fn new(endpoints: Vec<String>, prefix: impl Into<String>, timeout: Duration) -> Self {
        Self {
            endpoints,
            prefix: prefix.into(),
            timeout,
            max_txn_ops: DEFAULT_MAX_TXN_OPS,
            username: None,
            password: None,
            tls: EtcdTlsFiles::default(),
        }
    }
}

/// PEM files of the client's TLS (all optional; https:// endpoints need `ca_file`).
#[derive(Clone, Debug, Default)]
pub struct EtcdTlsFiles {
    /// `--etcd-ca-file`: CA bundle verifying etcd's server certificate.
    pub ca_file: Option<PathBuf>,
    /// `--etcd-cert-file`: client certificate chain (mTLS); with `key_file`.
    pub cert_file: Option<PathBuf>,
    /// `--etcd-key-file`: the client certificate's private key.
    pub key_file: Option<PathBuf>,
}

impl EtcdTlsFiles {
    fn any(&self) -> bool {
        self.ca_file.is_some() || self.cert_file.is_some() || self.key_file.is_some()
    }
}

pub struct EtcdStore {
    client: Client,
    keys: Keys,
    timeout: Duration,
    max_txn_ops: usize,
    lease_ttl: i64,
    /// node → its lease, as last seen.
    leases: Mutex<HashMap<String, i64>>,
}

#[derive(Clone, Debug)]
struct Keys {
    prefix: String,
}

/// What a key under the prefix is.
enum Record<'a> {
    Service(&'a str),
    Endpoint {
        service: &'a str,
        address: &'a str,
    },
    /// A configuration record's kind and key.
    Config(ConfigKind, &'a str),
    Other,
}

impl Keys {
    fn all(&self) -> String {
        format!("{}/", self.prefix)
    }
    fn service(&self, key: &str) -> String {
        format!("{}/services/{key}", self.prefix)
    }
    fn vip(&self, vip: &str) -> String {
        format!("{}/vips/{vip}", self.prefix)
    }
    fn endpoint(&self, service: &str, address: &str) -> String {
        format!("{}/endpoints/{service}/{address}", self.prefix)
    }
    fn endpoints_of(&self, service: &str) -> String {
        format!("{}/endpoints/{service}/", self.prefix)
    }
    fn node(&self, node: &str) -> String {
        format!("{}/nodes/{node}", self.prefix)
    }
    fn config(&self, kind: ConfigKind, key: &str) -> String {
        format!("{}/{}/{key}", self.prefix, kind.plural())
    }

    fn classify<'a>(&self, key: &'a str) -> Record<'a> {
        let Some(rest) = key.strip_prefix(self.prefix.as_str()).and_then(|k| k.strip_prefix('/')) else {
            return Record::Other;
        };
        if let Some(service) = rest.strip_prefix("services/") {
            return Record::Service(service);
        }
        if let Some(rest) = rest.strip_prefix("endpoints/") {
            // <ns>/<name>/<address>: addresses never contain '/'.
            if let Some((service, address)) = rest.rsplit_once('/') {
                return Record::Endpoint { service, address };
            }
        }
        for kind in ConfigKind::ALL {
            if let Some(key) = rest.strip_prefix(kind.plural()).and_then(|r| r.strip_prefix('/')) {
                return Record::Config(kind, key);
            }
        }
        Record::Other
    }
}

#[derive(Debug, thiserror::Error)]
pub enum EtcdError {
    #[error("--etcd-prefix {0:?}: must start with '/' and not end with '/'")]
    Prefix(String),
    #[error("--etcd-endpoints: at least one endpoint is needed")]
    NoEndpoints,
    #[error("--etcd-username is set but --etcd-password is not: give both or neither")]
    UsernameWithoutPassword,
    #[error("--etcd-password is set but --etcd-username is not: give both or neither")]
    PasswordWithoutUsername,
    #[error("{given} is set but {missing} is not: the client certificate needs both")]
    HalfIdentity { given: &'static str, missing: &'static str },
    #[error("--etcd-endpoints {0}: https:// needs --etcd-ca-file (the CA that signed etcd's certificate)")]
    HttpsWithoutCa(String),
    #[error(
        "--etcd-endpoints {endpoint}: {flag} is set, so every endpoint must be https:// (etcd-client does not mix \
         TLS and plaintext endpoints)"
    )]
    TlsOnPlaintext { endpoint: String, flag: &'static str },
    #[error("{flag} {path}: cannot read it: {source}")]
    ReadPem {
        flag: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{flag} {path}: {reason}")]
    BadPem {
        flag: &'static str,
        path: PathBuf,
        reason: String,
    },
    #[error("--etcd-username {user:?}: etcd refused to authenticate it (check --etcd-password): {reason}")]
    AuthRefused { user: String, reason: String },
}

/// The error and its causes: tonic's transport errors keep the TLS detail in `source()`.
fn chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        let said = cause.to_string();
        if !text.contains(&said) {
            text.push_str(": ");
            text.push_str(&said);
        }
        source = cause.source();
    }
    text
}

fn read_pem(flag: &'static str, path: &Path) -> Result<Vec<u8>, EtcdError> {
    std::fs::read(path).map_err(|source| EtcdError::ReadPem {
        flag,
        path: path.to_owned(),
        source,
    })
}

/// Reads a PEM file of certificates, checking it holds at least one.
fn read_certificates(flag: &'static str, path: &Path) -> Result<Vec<u8>, EtcdError> {
    let pem = read_pem(flag, path)?;
    let bad = |reason: String| EtcdError::BadPem {
        flag,
        path: path.to_owned(),
        reason,
    };
    let mut count = 0;
    for cert in CertificateDer::pem_slice_iter(&pem) {
        cert.map_err(|e| bad(format!("not a valid PEM certificate file: {e}")))?;
        count += 1;
    }
    if count == 0 {
        return Err(bad("holds no PEM certificate (-----BEGIN CERTIFICATE-----)".into()));
    }
    Ok(pem)
}

/// Reads a PEM private key (PKCS#8, PKCS#1 or SEC1).
fn read_private_key(flag: &'static str, path: &Path) -> Result<Vec<u8>, EtcdError> {
    let pem = read_pem(flag, path)?;
    PrivateKeyDer::from_pem_slice(&pem).map_err(|e| EtcdError::BadPem {
        flag,
        path: path.to_owned(),
        reason: format!("holds no valid PEM private key: {e}"),
    })?;
    Ok(pem)
}

/// Checks the credential flags and builds etcd-client's options from them.
fn connect_options(config: &EtcdConfig) -> Result<ConnectOptions, EtcdError> {
    // Empty values (unset chart values rendered as "") mean unset.
    let username = config.username.as_ref().filter(|u| !u.is_empty());
    let password = config.password.as_ref().filter(|p| !p.expose().is_empty());
    let set = |p: &Option<PathBuf>| p.clone().filter(|p| !p.as_os_str().is_empty());
    let files = EtcdTlsFiles {
        ca_file: set(&config.tls.ca_file),
        cert_file: set(&config.tls.cert_file),
        key_file: set(&config.tls.key_file),
    };
    let mut options = ConnectOptions::new()
        .with_connect_timeout(config.timeout)
        .with_keep_alive(Duration::from_secs(5), Duration::from_secs(3))
        .with_keep_alive_while_idle(true);
    match (username, password) {
        (Some(user), Some(password)) => {
            // etcd's simple tokens expire (--auth-token-ttl): re-authenticate on "invalid auth token".
            options = options
                .with_user(user.clone(), password.expose())
                .with_auto_token_refresh(true);
        }
        (Some(_), None) => return Err(EtcdError::UsernameWithoutPassword),
        (None, Some(_)) => return Err(EtcdError::PasswordWithoutUsername),
        (None, None) => {}
    }
    let identity = match (&files.cert_file, &files.key_file) {
        (Some(cert), Some(key)) => Some(Identity::from_pem(
            read_certificates("--etcd-cert-file", cert)?,
            read_private_key("--etcd-key-file", key)?,
        )),
        (Some(_), None) => {
            return Err(EtcdError::HalfIdentity {
                given: "--etcd-cert-file",
                missing: "--etcd-key-file",
            });
        }
        (None, Some(_)) => {
            return Err(EtcdError::HalfIdentity {
                given: "--etcd-key-file",
                missing: "--etcd-cert-file",
            });
        }
        (None, None) => None,
    };
    if files.any() {
        let flag = if files.ca_file.is_some() {
            "--etcd-ca-file"
        } else {
            "--etcd-cert-file"
        };
        if let Some(endpoint) = config.endpoints.iter().find(|e| !e.starts_with("https://")) {
            return Err(EtcdError::TlsOnPlaintext {
                endpoint: endpoint.clone(),
                flag,
            });
        }
    }
    let https = config.endpoints.iter().find(|e| e.starts_with("https://"));
    match (&files.ca_file, https) {
        (Some(ca), _) => {
            let mut tls =
                TlsOptions::new().ca_certificate(Certificate::from_pem(read_certificates("--etcd-ca-file", ca)?));
            if let Some(identity) = identity {
                tls = tls.identity(identity);
            }
            options = options.with_tls(tls);
        }
        (None, Some(endpoint)) => return Err(EtcdError::HttpsWithoutCa(endpoint.clone())),
        (None, None) => {}
    }
    if username.is_some() && https.is_none() {
        tracing::warn!("--etcd-username over plaintext http://: the password crosses the network unencrypted");
    }
    Ok(options)
}

fn unavailable(what: &str, e: impl std::fmt::Display) -> StoreError {
    StoreError::Unavailable(format!("etcd {what}: {e}"))
}

/// etcd's answers to bad credentials (`rpctypes.ErrAuthFailed` is InvalidArgument) or to
/// a username when auth is off.
fn auth_refusal(status: &tonic::Status) -> bool {
    matches!(
        status.code(),
        tonic::Code::InvalidArgument | tonic::Code::Unauthenticated | tonic::Code::PermissionDenied
    ) || status.message().contains("authentication")
}

impl EtcdStore {
    /// Connects to etcd (fails if no endpoint answers within the timeout).
    pub async fn connect(config: EtcdConfig, settings: StoreSettings) -> Result<Self, StoreError> {
        let prefix = config.prefix.clone();
        if !prefix.starts_with('/') || prefix.ends_with('/') || prefix.len() < 2 {
            return Err(StoreError::Config(EtcdError::Prefix(prefix).to_string()));
        }
        if config.endpoints.is_empty() {
            return Err(StoreError::Config(EtcdError::NoEndpoints.to_string()));
        }
        let options = connect_options(&config).map_err(|e| StoreError::Config(e.to_string()))?;
        // With credentials, connect authenticates: a refusal is a config error, not an outage.
        let client = tokio::time::timeout(config.timeout, Client::connect(&config.endpoints, Some(options)))
            .await
            .map_err(|_| unavailable("connect", format!("no answer from {:?} in time", config.endpoints)))?
            .map_err(|e| match (&e, &config.username) {
                (etcd_client::Error::GRpcStatus(status), Some(user)) if auth_refusal(status) => StoreError::Config(
                    EtcdError::AuthRefused {
                        user: user.clone(),
                        reason: status.message().to_owned(),
                    }
                    .to_string(),
                ),
                _ => unavailable("connect", chain(&e)),
            })?;
        let lease_ttl = settings.endpoint_ttl.as_secs_f64().ceil().max(1.0) as i64;
        Ok(Self {
            client,
            keys: Keys { prefix },
            timeout: config.timeout,
            max_txn_ops: config.max_txn_ops.max(8),
            lease_ttl,
            leases: Mutex::new(HashMap::new()),
        })
    }

    async fn timed<T, F>(&self, what: &str, f: F) -> Result<T, StoreError>
    where
        F: std::future::Future<Output = Result<T, etcd_client::Error>>,
    {
        match tokio::time::timeout(self.timeout, f).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(unavailable(what, chain(&e))),
            Err(_) => Err(unavailable(what, format!("no answer within {:?}", self.timeout))),
        }
    }

    async fn get_one(&self, key: String) -> Result<Option<KeyValue>, StoreError> {
        let mut client = self.client.clone();
        let mut response = self.timed("get", client.get(key, None)).await?;
        Ok(response.take_kvs().into_iter().next())
    }

    async fn get_service(&self, key: &str) -> Result<Option<Service>, StoreError> {
        match self.get_one(self.keys.service(key)).await? {
            Some(kv) => Service::decode(kv.value())
                .map(Some)
                .map_err(|e| StoreError::Corrupt(format!("{}: not a Service protobuf: {e}", self.keys.service(key)))),
            None => Ok(None),
        }
    }

    /// The lease of `node`, granted (once, across replicas) if it has none.
    async fn lease_of(&self, node: &str) -> Result<i64, StoreError> {
        if let Some(id) = self.leases.lock().get(node) {
            return Ok(*id);
        }
        let key = self.keys.node(node);
        if let Some(kv) = self.get_one(key.clone()).await? {
            let id = parse_lease(&kv)?;
            self.leases.lock().insert(node.to_owned(), id);
            return Ok(id);
        }
        let mut client = self.client.clone();
        let granted = self
            .timed("lease grant", client.lease_grant(self.lease_ttl, None))
            .await?
            .id();
        let txn = Txn::new()
            .when([Compare::create_revision(key.clone(), CompareOp::Equal, 0)])
            .and_then([TxnOp::put(
                key.clone(),
                granted.to_string(),
                Some(PutOptions::new().with_lease(granted)),
            )])
            .or_else([TxnOp::get(key.clone(), None)]);
        let response = self.timed("lease txn", client.txn(txn)).await?;
        let id = if response.succeeded() {
            granted
        } else {
            // Another replica granted one first: use theirs, drop ours.
            let _ = self.timed("lease revoke", client.lease_revoke(granted)).await;
            let winner = response.op_responses().into_iter().find_map(|r| match r {
                TxnOpResponse::Get(mut get) => get.take_kvs().into_iter().next(),
                _ => None,
            });
            match winner {
                Some(kv) => parse_lease(&kv)?,
                None => {
                    return Err(unavailable(
                        "lease txn",
                        format!("{key} vanished while granting; retry"),
                    ));
                }
            }
        };
        self.leases.lock().insert(node.to_owned(), id);
        Ok(id)
    }

    fn forget_leases<'a>(&self, nodes: impl Iterator<Item = &'a str>) {
        let mut leases = self.leases.lock();
        for node in nodes {
            leases.remove(node);
        }
    }

    async fn try_commit(&self, ops: &[StoreOp]) -> Result<Revision, StoreError> {
        let mut txn = TxnPlan::default();
        for op in ops {
            self.add_op(&mut txn, op).await?;
        }
        let needs_service = txn.services_needed();
        for service in &needs_service {
            txn.compares.push(Compare::create_revision(
                self.keys.service(service),
                CompareOp::Greater,
                0,
            ));
        }
        let compares = txn.compares;
        let txn_ops: Vec<TxnOp> = txn.ops.into_iter().flatten().collect();
        if txn_ops.len() > self.max_txn_ops || compares.len() > self.max_txn_ops {
            return Err(StoreError::Corrupt(format!(
                "a batch of {} operations and {} conditions exceeds etcd's --max-txn-ops {}",
                txn_ops.len(),
                compares.len(),
                self.max_txn_ops
            )));
        }
        let mut client = self.client.clone();
        let response = self
            .timed("txn", client.txn(Txn::new().when(compares).and_then(txn_ops)))
            .await?;
        let revision = response.header().map(|h| h.revision()).unwrap_or_default();
        if response.succeeded() {
            return Ok(revision as Revision);
        }
        Err(self.explain_conflict(txn.created, txn.updated, needs_service).await?)
    }

    /// Adds `op` to the transaction: its writes, and the conditions it needs.
    async fn add_op<'a>(&self, txn: &mut TxnPlan<'a>, op: &'a StoreOp) -> Result<(), StoreError> {
        match op {
            StoreOp::CreateService(service) => {
                let key = key_of(service);
                let skey = self.keys.service(&key);
                let vkey = self.keys.vip(&service.vip);
                txn.compares
                    .push(Compare::create_revision(skey.clone(), CompareOp::Equal, 0));
                txn.compares
                    .push(Compare::create_revision(vkey.clone(), CompareOp::Equal, 0));
                txn.put(skey.clone(), TxnOp::put(skey, service.encode_to_vec(), None));
                txn.put(vkey.clone(), TxnOp::put(vkey, key.into_bytes(), None));
                txn.created.push(service);
                txn.created_keys.push(key_of(service));
            }
            StoreOp::UpdateService(service) => {
                let key = key_of(service);
                let skey = self.keys.service(&key);
                if !txn.created_keys.contains(&key) {
                    // It exists, and the VIP it names is its own (a value compare on a
                    // missing key fails).
                    txn.compares
                        .push(Compare::create_revision(skey.clone(), CompareOp::Greater, 0));
                    let vkey = self.keys.vip(&service.vip);
                    txn.compares
                        .push(Compare::value(vkey, CompareOp::Equal, key.into_bytes()));
                    txn.updated.push(service);
                }
                txn.put(skey.clone(), TxnOp::put(skey, service.encode_to_vec(), None));
            }
            StoreOp::DeleteService { key, vip } => {
                let skey = self.keys.service(key.as_str());
                let vkey = self.keys.vip(vip);
                let prefix = self.keys.endpoints_of(key.as_str());
                // Earlier puts of its endpoints in this batch would overlap the range delete.
                txn.cancel_under(&prefix);
                txn.put(skey.clone(), TxnOp::delete(skey, None));
                txn.put(vkey.clone(), TxnOp::delete(vkey, None));
                let range = TxnOp::delete(prefix.clone(), Some(etcd_client::DeleteOptions::new().with_prefix()));
                txn.put(prefix, range);
            }
            StoreOp::PutEndpoint(endpoint) => {
                let key = self.keys.endpoint(&endpoint.service, &endpoint.address);
                let options = if endpoint.node.is_empty() {
                    None
                } else {
                    Some(PutOptions::new().with_lease(self.lease_of(&endpoint.node).await?))
                };
                txn.put(key.clone(), TxnOp::put(key, endpoint.encode_to_vec(), options));
                txn.needs_service.push(&endpoint.service);
            }
            StoreOp::DeleteEndpoint { service, address } => {
                let key = self.keys.endpoint(service.as_str(), address);
                txn.put(key.clone(), TxnOp::delete(key, None));
            }
            StoreOp::ForgetNode(node) => {
                let key = self.keys.node(node);
                txn.put(key.clone(), TxnOp::delete(key, None));
                self.forget_leases(std::iter::once(node.as_str()));
            }
            StoreOp::PutConfig(record) => {
                let key = self.keys.config(record.kind(), &record.key());
                txn.put(key.clone(), TxnOp::put(key, record.encode(), None));
            }
            StoreOp::DeleteConfig(kind, key) => {
                let key = self.keys.config(*kind, key);
                txn.put(key.clone(), TxnOp::delete(key, None));
            }
        }
        Ok(())
    }

    /// After a transaction's conditions failed: which condition, and who won. An
    /// error other than a conflict if that cannot be told (`Corrupt` for an update
    /// that would move a VIP).
    async fn explain_conflict(
        &self,
        created: Vec<&Service>,
        updated: Vec<&Service>,
        needs_service: Vec<&str>,
    ) -> Result<StoreError, StoreError> {
        let mut gone = Vec::new();
        for service in &updated {
            let key = key_of(service);
            match self.get_service(&key).await? {
                Some(stored) if stored.vip != service.vip => return Err(vip_change(&key, &stored.vip, &service.vip)),
                Some(_) => {}
                None => gone.push(key),
            }
        }

        let mut conflict = Conflict::default();
        let mut details = Vec::new();
        for service in created {
            let key = format!("{}/{}", service.namespace, service.name);
            if let Some(existing) = self.get_service(&key).await? {
                details.push(format!("service {key} already exists with VIP {}", existing.vip));
                conflict.existing.push(existing);
                continue;
            }
            if let Some(owner) = self.get_one(self.keys.vip(&service.vip)).await? {
                let owner = String::from_utf8_lossy(owner.value()).into_owned();
                details.push(format!("VIP {} already belongs to {owner}", service.vip));
                if let Some(existing) = self.get_service(&owner).await? {
                    conflict.existing.push(existing);
                }
            }
        }
        for service in needs_service.into_iter().chain(gone.iter().map(String::as_str)) {
            if self.get_service(service).await?.is_none() {
                details.push(format!("service {service} is not in the store"));
                let key = ServiceKey::parse("service", service).map_err(|e| StoreError::Corrupt(e.to_string()))?;
                conflict.missing.push(key);
            }
        }
        if conflict.existing.is_empty() && conflict.missing.is_empty() {
            return Err(unavailable(
                "txn",
                "its conditions failed but the conflicting records changed again; retry",
            ));
        }
        conflict.detail = details.join("; ");
        Ok(StoreError::Conflict(conflict))
    }
}

/// A transaction being built from a batch of ops.
#[derive(Default)]
struct TxnPlan<'a> {
    /// etcd refuses a transaction that writes one key twice, so each key has one
    /// slot and the last op on a key wins (the catalog plans each key's final state
    /// anyway); `None`: cancelled by a later range delete.
    ops: Vec<Option<TxnOp>>,
    slots: HashMap<String, usize>,
    compares: Vec<Compare>,
    /// Services the batch creates, and their keys.
    created: Vec<&'a Service>,
    /// Services the batch updates (not created by it).
    updated: Vec<&'a Service>,
    created_keys: Vec<String>,
    /// Services the batch puts endpoints into.
    needs_service: Vec<&'a str>,
}

impl<'a> TxnPlan<'a> {
    /// Writes `key` with `op`, replacing an earlier op on the same key.
    fn put(&mut self, key: String, op: TxnOp) {
        match self.slots.get(&key) {
            Some(&i) => self.ops[i] = Some(op),
            None => {
                self.slots.insert(key, self.ops.len());
                self.ops.push(Some(op));
            }
        }
    }

    /// Cancels the ops on keys under `prefix` so far.
    fn cancel_under(&mut self, prefix: &str) {
        for (k, &i) in self.slots.iter() {
            if k.starts_with(prefix) {
                self.ops[i] = None;
            }
        }
    }

    /// The services the batch's endpoints need and does not create, each once.
    fn services_needed(&mut self) -> Vec<&'a str> {
        let mut needs: Vec<&'a str> = std::mem::take(&mut self.needs_service);
        needs.sort_unstable();
        needs.dedup();
        needs.retain(|s| !self.created_keys.iter().any(|c| c == s));
        needs
    }
}

fn key_of(service: &Service) -> String {
    format!("{}/{}", service.namespace, service.name)
}

fn parse_lease(kv: &KeyValue) -> Result<i64, StoreError> {
    std::str::from_utf8(kv.value())
        .ok()
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| StoreError::Corrupt(format!("{}: not a lease id", quote(&String::from_utf8_lossy(kv.key())))))
}

/// Reads everything under the prefix at one revision, page by page.
async fn load(client: &Client, keys: &Keys, timeout: Duration) -> Result<Contents, StoreError> {
    let start = keys.all();
    // The end of the prefix range: '/' + 1 == '0'.
    let end = format!("{}0", keys.prefix);
    let mut contents = Contents::default();
    let mut revision = 0i64;
    let mut from = start.into_bytes();
    loop {
        let mut options = GetOptions::new().with_range(end.clone()).with_limit(PAGE);
        if revision > 0 {
            options = options.with_revision(revision);
        }
        let mut c = client.clone();
        let mut response = tokio::time::timeout(timeout, c.get(from.clone(), Some(options)))
            .await
            .map_err(|_| unavailable("get", format!("no answer within {timeout:?}")))?
            .map_err(|e| unavailable("get", chain(&e)))?;
        if revision == 0 {
            revision = response.header().map(|h| h.revision()).unwrap_or_default();
        }
        let more = response.more();
        let kvs = response.take_kvs();
        for kv in &kvs {
            match decode(keys, kv) {
                Some(FeedChangeKind::ServicePut(value)) => contents.services.push(Stored {
                    value,
                    revision: kv.mod_revision() as Revision,
                }),
                Some(FeedChangeKind::EndpointPut(value)) => contents.endpoints.push(Stored {
                    value,
                    revision: kv.mod_revision() as Revision,
                }),
                Some(FeedChangeKind::ConfigPut(value)) => contents.configs.push(Stored {
                    value,
                    revision: kv.mod_revision() as Revision,
                }),
                Some(FeedChangeKind::Unreadable(record)) => contents.unreadable.push(record),
                _ => {}
            }
        }
        match (more, kvs.last()) {
            (true, Some(last)) => {
                from = last.key().to_vec();
                from.push(0);
            }
            _ => break,
        }
    }
    contents.revision = revision as Revision;
    Ok(contents)
}

/// A put's record, or None for keys the catalog does not hold (VIP index, nodes).
fn decode(keys: &Keys, kv: &KeyValue) -> Option<FeedChangeKind> {
    let key = String::from_utf8_lossy(kv.key());
    let unreadable = |reason: String| {
        Some(FeedChangeKind::Unreadable(UnreadableRecord {
            key: key.to_string(),
            reason,
        }))
    };
    match keys.classify(&key) {
        Record::Service(_) => match Service::decode(kv.value()) {
            Ok(s) => Some(FeedChangeKind::ServicePut(s)),
            Err(e) => unreadable(format!("not a Service protobuf: {e}")),
        },
        Record::Endpoint { .. } => match Endpoint::decode(kv.value()) {
            Ok(e) => Some(FeedChangeKind::EndpointPut(e)),
            Err(e) => unreadable(format!("not an Endpoint protobuf: {e}")),
        },
        Record::Config(kind, _) => match kind.decode(kv.value()) {
            Ok(record) => Some(FeedChangeKind::ConfigPut(record)),
            Err(reason) => unreadable(reason),
        },
        Record::Other => None,
    }
}

enum WatchEnd {
    /// The feed's reader is gone.
    Closed,
    /// The start revision was compacted away.
    Compacted(i64),
    Failed(String),
}

/// The largest etcd watch response the feed accepts. etcd hands a watcher that is
/// catching up many revisions in one response: with 5,000 nodes registering at once one
/// was 4.5 MiB, past tonic's 4 MiB default, and the feed failed on it again and again
/// (proposals/011). The limit only bounds a response; nothing is allocated up front.
const FEED_MESSAGE_LIMIT: usize = 256 << 20;

/// Follows the prefix from `next` until the stream breaks.
async fn watch(client: &Client, keys: &Keys, next: &mut i64, tx: &mpsc::Sender<FeedEvent>) -> WatchEnd {
    let options = WatchOptions::new()
        .with_prefix()
        .with_start_revision(*next)
        .with_progress_notify();
    let mut c = client.watch_client().max_decoding_message_size(FEED_MESSAGE_LIMIT);
    let mut stream = match c.watch(keys.all(), Some(options)).await {
        Ok(stream) => stream,
        Err(e) => return WatchEnd::Failed(chain(&e)),
    };
    loop {
        let response = match stream.message().await {
            Ok(Some(response)) => response,
            Ok(None) => return WatchEnd::Failed("watch stream ended".into()),
            Err(e) => return WatchEnd::Failed(chain(&e)),
        };
        if response.compact_revision() > 0 {
            return WatchEnd::Compacted(response.compact_revision());
        }
        if response.canceled() {
            return WatchEnd::Failed(format!("watch canceled: {}", response.cancel_reason()));
        }
        let mut changes = Vec::with_capacity(response.events().len());
        let mut progress = None;
        for event in response.events() {
            let Some(kv) = event.kv() else { continue };
            let revision = kv.mod_revision();
            progress = Some(revision);
            let key = String::from_utf8_lossy(kv.key());
            let kind = match event.event_type() {
                EventType::Put => decode(keys, kv),
                EventType::Delete => match keys.classify(&key) {
                    Record::Service(key) => Some(FeedChangeKind::ServiceDeleted { key: key.to_owned() }),
                    Record::Endpoint { service, address } => Some(FeedChangeKind::EndpointDeleted {
                        service: service.to_owned(),
                        address: address.to_owned(),
                    }),
                    Record::Config(kind, key) => Some(FeedChangeKind::ConfigDeleted {
                        kind,
                        key: key.to_owned(),
                    }),
                    Record::Other => None,
                },
            };
            if let Some(kind) = kind {
                changes.push(FeedChange {
                    revision: revision as Revision,
                    kind,
                });
            }
        }
        if progress.is_none() && !response.created() {
            // A progress notification: everything up to the header's revision was sent.
            progress = response.header().map(|h| h.revision()).filter(|r| *r >= *next);
        }
        let Some(progress) = progress else { continue };
        *next = progress + 1;
        let event = FeedEvent::Changes {
            revision: progress as Revision,
            changes,
        };
        if tx.send(event).await.is_err() {
            return WatchEnd::Closed;
        }
    }
}

async fn run_feed(client: Client, keys: Keys, timeout: Duration, after: Revision, tx: mpsc::Sender<FeedEvent>) {
    let mut next = after as i64 + 1;
    let mut backoff = Duration::from_millis(100);
    loop {
        let reason = match watch(&client, &keys, &mut next, &tx).await {
            WatchEnd::Closed => return,
            WatchEnd::Compacted(at) => {
                tracing::warn!(
                    from = next,
                    compacted = at,
                    "etcd compacted the history the watch needed; reloading"
                );
                match load(&client, &keys, timeout).await {
                    Ok(contents) => {
                        next = contents.revision as i64 + 1;
                        backoff = Duration::from_millis(100);
                        if tx.send(FeedEvent::Resync(contents)).await.is_err() {
                            return;
                        }
                        continue;
                    }
                    Err(e) => e.to_string(),
                }
            }
            WatchEnd::Failed(reason) => reason,
        };
        if tx.send(FeedEvent::Down(reason)).await.is_err() {
            return;
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
}

#[async_trait]
impl Store for EtcdStore {
    fn kind(&self) -> &'static str {
        "etcd"
    }

    async fn load(&self) -> Result<Contents, StoreError> {
        load(&self.client, &self.keys, self.timeout).await
    }

    async fn commit(&self, ops: Vec<StoreOp>) -> Result<Revision, StoreError> {
        match self.try_commit(&ops).await {
            // A node's lease lapsed since we cached it: grant a new one and retry once.
            Err(StoreError::Unavailable(m)) if m.contains(LEASE_NOT_FOUND) => {
                self.forget_leases(ops.iter().filter_map(|op| match op {
                    StoreOp::PutEndpoint(e) => Some(e.node.as_str()),
                    _ => None,
                }));
                self.try_commit(&ops).await
            }
            other => other,
        }
    }

    fn feed(&self, after: Revision) -> Feed {
        let (tx, rx) = mpsc::channel(FEED_BUFFER);
        tokio::spawn(run_feed(
            self.client.clone(),
            self.keys.clone(),
            self.timeout,
            after,
            tx,
        ));
        Box::pin(ReceiverStream::new(rx))
    }

    async fn refresh(&self, nodes: Vec<String>) -> Result<(), StoreError> {
        for node in nodes.iter().filter(|n| !n.is_empty()) {
            let cached = self.leases.lock().get(node).copied();
            let id = match cached {
                Some(id) => id,
                None => match self.get_one(self.keys.node(node)).await? {
                    Some(kv) => parse_lease(&kv)?,
                    // No lease: its endpoints expired; the agent's registrations recreate them.
                    None => continue,
                },
            };
            let mut client = self.client.clone();
            let (mut keeper, mut responses) = self.timed("lease keep-alive", client.lease_keep_alive(id)).await?;
            self.timed("lease keep-alive", keeper.keep_alive()).await?;
            let alive = self
                .timed("lease keep-alive", responses.message())
                .await?
                .is_some_and(|r| r.ttl() > 0);
            if alive {
                self.leases.lock().insert(node.clone(), id);
            } else {
                self.forget_leases(std::iter::once(node.as_str()));
            }
        }
        Ok(())
    }

    async fn expired_nodes(&self) -> Result<Vec<String>, StoreError> {
        // Leases expire the endpoints; the deletions arrive on the feed.
        Ok(Vec::new())
    }

    async fn ping(&self) -> Result<(), StoreError> {
        self.get_one(self.keys.node("")).await.map(|_| ())
    }

    fn max_batch_ops(&self) -> usize {
        // A DeleteService is three etcd operations.
        self.max_txn_ops / 3
    }
}

/// Shared by tests: the key of a service record under `prefix`.
pub fn service_key(prefix: &str, service: &str) -> String {
    Keys {
        prefix: prefix.to_owned(),
    }
    .service(service)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn keys() -> Keys {
        Keys {
            prefix: "/aether/v1".into(),
        }
    }

    proptest! {
        #[test]
        fn record_keys_round_trip(
            ns in "[a-z]([a-z0-9-]{0,20}[a-z0-9])?",
            name in "[a-z]([a-z0-9-]{0,20}[a-z0-9])?",
            address in prop_oneof![
                any::<std::net::Ipv4Addr>().prop_map(|a| a.to_string()),
                any::<std::net::Ipv6Addr>().prop_map(|a| a.to_string()),
            ],
        ) {
            let keys = keys();
            let service = format!("{ns}/{name}");
            match keys.classify(&keys.endpoint(&service, &address)) {
                Record::Endpoint { service: s, address: a } => {
                    prop_assert_eq!(s, service.as_str());
                    prop_assert_eq!(a, address.as_str());
                }
                _ => prop_assert!(false, "an endpoint key was not classified as one"),
            }
            match keys.classify(&keys.service(&service)) {
                Record::Service(s) => prop_assert_eq!(s, service.as_str()),
                _ => prop_assert!(false, "a service key was not classified as one"),
            }
            for route_kind in ["http", "grpc"] {
                let route = format!("{route_kind}/{ns}/{name}");
                match keys.classify(&keys.config(ConfigKind::Route, &route)) {
                    Record::Config(ConfigKind::Route, r) => prop_assert_eq!(r, route.as_str()),
                    _ => prop_assert!(false, "a route key was not classified as one"),
                }
            }
            for kind in ConfigKind::ALL {
                match keys.classify(&keys.config(kind, &service)) {
                    Record::Config(k, key) => prop_assert_eq!((k, key), (kind, service.as_str())),
                    _ => prop_assert!(false, "a {:?} key was not classified as one", kind),
                }
            }
            prop_assert!(matches!(keys.classify(&keys.vip(&address)), Record::Other));
            prop_assert!(matches!(keys.classify(&keys.node(&name)), Record::Other));
        }

        #[test]
        fn any_key_is_classified_without_panicking(key in ".{0,80}") {
            let _ = keys().classify(&key);
            let _ = keys().classify(&format!("/aether/v1/{key}"));
        }
    }

    #[test]
    fn keys_outside_the_prefix_are_not_records() {
        let keys = keys();
        assert!(matches!(keys.classify("/aether/v10/services/a/b"), Record::Other));
        assert!(matches!(keys.classify("/other/services/a/b"), Record::Other));
        assert!(matches!(keys.classify("/aether/v1/endpoints/no-slash"), Record::Other));
    }
}
