//! SPIRE: the SPIRE agent's Delegated Identity API on its admin socket. One
//! `SubscribeToX509SVIDs` stream per local pod, by the pod's Kubernetes selectors, and
//! one `SubscribeToX509Bundles` stream for the trust bundles (federated ones too).
//! Streams reconnect with backoff; while one is down, the SVIDs already received keep
//! serving (until they expire) and new ones flow once it is back.
//!
//! SPIRE authorizes a delegate by attesting the calling process (its SPIFFE ID must be
//! in the agent's `authorized_delegates`): the agent fetches its own SVID from the
//! Workload API at start-up to report which identity it runs as.
//!
//! The high-level `spire_api::DelegatedIdentityClient` keeps only the first SVID of
//! each response; the raw generated client gets them all, so we pick the pod's.

use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use spire_api::pb::spire::api::agent::delegatedidentity::v1::delegated_identity_client::DelegatedIdentityClient;
use spire_api::pb::spire::api::agent::delegatedidentity::v1::{
    SubscribeToX509BundlesRequest, SubscribeToX509BundlesResponse, SubscribeToX509sviDsRequest,
    SubscribeToX509sviDsResponse,
};
use spire_api::pb::spire::api::types::Selector;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tonic::transport::{Channel, Endpoint};

use super::{Identities, IdentityConfig, IdentityError, IdentityMetrics, Svid, pem_encode, spiffe_id};
use crate::pod::{LocalPod, PodInfo};

/// Reconnect backoff: doubles from the first to the last.
pub const BACKOFF_MIN: Duration = Duration::from_millis(100);
pub const BACKOFF_MAX: Duration = Duration::from_secs(5);

pub struct Spire {
    inner: Arc<Inner>,
}

struct Inner {
    trust_domain: String,
    channel: Channel,
    state: Arc<watch::Sender<Arc<Identities>>>,
    metrics: IdentityMetrics,
    /// Local pods with a running subscription: pod id → (what it was started for, stop).
    subscriptions: Mutex<BTreeMap<String, (PodInfo, CancellationToken)>>,
    shutdown: CancellationToken,
}

/// The selectors SPIRE's k8s workload attestor produces for a pod.
pub fn selectors(pod: &PodInfo) -> Vec<Selector> {
    let selector = |value: String| Selector {
        r#type: "k8s".into(),
        value,
    };
    let mut out = vec![selector(format!("ns:{}", pod.namespace))];
    let sa = if pod.service_account.is_empty() {
        "default"
    } else {
        &pod.service_account
    };
    out.push(selector(format!("sa:{sa}")));
    if !pod.uid.is_empty() {
        out.push(selector(format!("pod-uid:{}", pod.uid)));
    }
    out.push(selector(format!("pod-name:{}", pod.name)));
    out
}

/// A channel to a gRPC server on a Unix socket, connected on first use (and again
/// after a failure).
pub fn unix_channel(path: &Path) -> Result<Channel, IdentityError> {
    let endpoint = Endpoint::from_shared(format!("unix:{}", path.display())).map_err(|e| IdentityError::Flag {
        flag: "--spire-admin-socket",
        reason: e.to_string(),
    })?;
    Ok(endpoint.connect_timeout(Duration::from_secs(2)).connect_lazy())
}

impl Spire {
    pub fn start(
        config: &IdentityConfig,
        state: Arc<watch::Sender<Arc<Identities>>>,
        metrics: IdentityMetrics,
        shutdown: CancellationToken,
    ) -> Result<Self, IdentityError> {
        let channel = unix_channel(&config.spire_admin_socket)?;
        let inner = Arc::new(Inner {
            trust_domain: config.trust_domain.clone(),
            channel,
            state,
            metrics,
            subscriptions: Mutex::default(),
            shutdown: shutdown.clone(),
        });
        tokio::spawn(bundles(inner.clone()));
        if !config.spire_workload_socket.is_empty() {
            tokio::spawn(own_identity(config.spire_workload_socket.clone(), shutdown));
        }
        tracing::info!(socket = %config.spire_admin_socket.display(), trust_domain = %config.trust_domain,
            "SPIRE Delegated Identity API client started");
        Ok(Self { inner })
    }

    pub fn sync(&self, pods: &[LocalPod]) {
        let mut subscriptions = self.inner.subscriptions.lock();
        let wanted: BTreeMap<String, &PodInfo> = pods.iter().map(|p| (p.id(), &p.info)).collect();
        let mut gone = Vec::new();
        subscriptions.retain(|id, (info, stop)| {
            let keep = wanted.get(id).is_some_and(|w| same_identity(w, info));
            if !keep {
                stop.cancel();
                gone.push(id.clone());
            }
            keep
        });
        for (id, info) in wanted {
            if subscriptions.contains_key(&id) {
                continue;
            }
            let stop = self.inner.shutdown.child_token();
            subscriptions.insert(id.clone(), (info.clone(), stop.clone()));
            tokio::spawn(subscribe(self.inner.clone(), id, info.clone(), stop));
        }
        drop(subscriptions);
        if !gone.is_empty() {
            self.inner.metrics.withdrawn.inc_by(gone.len() as u64);
            self.inner.update(|ids| {
                for id in &gone {
                    ids.svids.remove(id);
                }
            });
        }
    }
}

fn same_identity(a: &PodInfo, b: &PodInfo) -> bool {
    a.uid == b.uid && a.namespace == b.namespace && a.service_account == b.service_account
}

impl Inner {
    fn update(&self, change: impl FnOnce(&mut Identities)) {
        self.state.send_modify(|ids| {
            let mut next = (**ids).clone();
            change(&mut next);
            self.metrics.svids.set(next.svids.len() as i64);
            *ids = Arc::new(next);
        });
    }

    /// A response for `pod`: its SVID (the one naming the pod's expected SPIFFE ID if
    /// there are several), or none: the identity was revoked.
    fn apply(&self, pod_id: &str, info: &PodInfo, response: SubscribeToX509sviDsResponse) {
        let expected = spiffe_id(&self.trust_domain, info);
        let mut parsed = Vec::new();
        for item in response.x509_svids {
            let chain: Vec<Vec<u8>> = item
                .x509_svid
                .map(|s| s.cert_chain.into_iter().map(|c| c.to_vec()).collect())
                .unwrap_or_default();
            match Svid::from_der(&chain, &item.x509_svid_key) {
                Ok(svid) => parsed.push(svid),
                Err(error) => {
                    self.metrics.errors.inc();
                    tracing::warn!(pod = %pod_id, %error, "SPIRE sent an unusable SVID; skipped");
                }
            }
        }
        let chosen = match parsed.iter().position(|s| s.spiffe_id == expected) {
            Some(i) => Some(parsed.swap_remove(i)),
            None => {
                if let Some(s) = parsed.first() {
                    tracing::warn!(pod = %pod_id, got = %s.spiffe_id, %expected,
                        "SPIRE issued an unexpected SPIFFE ID: peers pinning the service account will refuse it");
                }
                parsed.into_iter().next()
            }
        };
        match chosen {
            Some(svid) => {
                tracing::info!(pod = %pod_id, spiffe_id = %svid.spiffe_id, serial = %svid.serial, "SVID received");
                self.metrics.issued.inc();
                let svid = Arc::new(svid);
                self.update(|ids| {
                    ids.svids.insert(pod_id.to_owned(), svid);
                });
            }
            None => {
                tracing::warn!(pod = %pod_id, "SPIRE returned no SVID for the pod: identity withdrawn");
                self.metrics.withdrawn.inc();
                self.update(|ids| {
                    ids.svids.remove(pod_id);
                });
            }
        }
    }
}

/// Counts an open stream while alive.
struct Open(prometheus_client::metrics::gauge::Gauge);

impl Open {
    fn new(gauge: &prometheus_client::metrics::gauge::Gauge) -> Self {
        gauge.inc();
        Self(gauge.clone())
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        self.0.dec();
    }
}

async fn subscribe(inner: Arc<Inner>, pod_id: String, info: PodInfo, stop: CancellationToken) {
    let request = SubscribeToX509sviDsRequest {
        selectors: selectors(&info),
        pid: 0,
    };
    let mut backoff = BACKOFF_MIN;
    loop {
        let run = async {
            let mut client = DelegatedIdentityClient::new(inner.channel.clone());
            let mut stream = client.subscribe_to_x509svi_ds(request.clone()).await?.into_inner();
            let _open = Open::new(&inner.metrics.spire_streams);
            while let Some(response) = stream.message().await? {
                backoff = BACKOFF_MIN;
                inner.apply(&pod_id, &info, response);
            }
            Ok::<_, tonic::Status>(())
        };
        let result = tokio::select! {
            _ = stop.cancelled() => return,
            result = run => result,
        };
        inner.metrics.errors.inc();
        match result {
            Ok(()) => tracing::warn!(pod = %pod_id, "SPIRE closed the SVID stream; reconnecting"),
            Err(status) => tracing::warn!(pod = %pod_id, code = ?status.code(), message = %status.message(),
                "SPIRE SVID stream failed; reconnecting (SVIDs already received keep serving)"),
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(backoff) => {}
        }
        backoff = (backoff * 2).min(BACKOFF_MAX);
    }
}

/// DER certificates concatenated (how SPIRE sends a trust domain's CAs) → PEM.
pub fn der_certs_to_pem(mut der: &[u8]) -> Result<String, String> {
    let mut pem = String::new();
    while !der.is_empty() {
        let (rest, _) = x509_parser::parse_x509_certificate(der).map_err(|e| e.to_string())?;
        let used = der.len() - rest.len();
        pem.push_str(&pem_encode("CERTIFICATE", &der[..used]));
        der = rest;
    }
    Ok(pem)
}

fn apply_bundles(inner: &Inner, response: SubscribeToX509BundlesResponse) {
    let mut bundles = BTreeMap::new();
    for (td, der) in response.ca_certificates {
        let td = td.strip_prefix("spiffe://").unwrap_or(&td).to_owned();
        match der_certs_to_pem(&der) {
            Ok(pem) if !pem.is_empty() => {
                bundles.insert(td, pem);
            }
            Ok(_) => tracing::warn!(trust_domain = %td, "SPIRE sent an empty bundle; skipped"),
            Err(error) => {
                inner.metrics.errors.inc();
                tracing::warn!(trust_domain = %td, %error, "SPIRE sent an unparsable bundle; skipped");
            }
        }
    }
    tracing::info!(trust_domains = ?bundles.keys().collect::<Vec<_>>(), "trust bundles received");
    inner.update(|ids| ids.bundles = bundles);
}

async fn bundles(inner: Arc<Inner>) {
    let mut backoff = BACKOFF_MIN;
    loop {
        let run = async {
            let mut client = DelegatedIdentityClient::new(inner.channel.clone());
            let mut stream = client
                .subscribe_to_x509_bundles(SubscribeToX509BundlesRequest {})
                .await?
                .into_inner();
            let _open = Open::new(&inner.metrics.spire_streams);
            while let Some(response) = stream.message().await? {
                backoff = BACKOFF_MIN;
                apply_bundles(&inner, response);
            }
            Ok::<_, tonic::Status>(())
        };
        let result = tokio::select! {
            _ = inner.shutdown.cancelled() => return,
            result = run => result,
        };
        inner.metrics.errors.inc();
        match result {
            Ok(()) => tracing::warn!("SPIRE closed the bundle stream; reconnecting"),
            Err(status) => tracing::warn!(code = ?status.code(), message = %status.message(),
                "SPIRE bundle stream failed; reconnecting (the bundles already received keep serving)"),
        }
        tokio::select! {
            _ = inner.shutdown.cancelled() => return,
            _ = tokio::time::sleep(backoff) => {}
        }
        backoff = (backoff * 2).min(BACKOFF_MAX);
    }
}

/// Fetches the agent's own SVID from the Workload API (retrying), and logs it: the
/// identity SPIRE must list among its authorized delegates.
async fn own_identity(socket: String, shutdown: CancellationToken) {
    let endpoint = if socket.starts_with("unix:") || socket.starts_with("tcp:") {
        socket
    } else {
        format!("unix:{socket}")
    };
    let mut backoff = BACKOFF_MIN;
    loop {
        let attempt = async {
            let client = spiffe::workload_api::client::WorkloadApiClient::connect_to(&endpoint).await?;
            client.fetch_x509_svid().await
        };
        let result = tokio::select! {
            _ = shutdown.cancelled() => return,
            result = attempt => result,
        };
        match result {
            Ok(svid) => {
                tracing::info!(spiffe_id = %svid.spiffe_id(), "the agent's own SVID (its delegate identity)");
                return;
            }
            Err(error) => tracing::warn!(%error, %endpoint, "fetching the agent's own SVID failed; retrying"),
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(backoff) => {}
        }
        backoff = (backoff * 2).min(BACKOFF_MAX * 6);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn selectors_name_the_pod() {
        let pod = PodInfo {
            namespace: "shop".into(),
            name: "cart-1".into(),
            uid: "u1".into(),
            service_account: "cart".into(),
            ..Default::default()
        };
        let values: Vec<String> = selectors(&pod)
            .into_iter()
            .map(|s| format!("{}:{}", s.r#type, s.value))
            .collect();
        assert_eq!(
            values,
            ["k8s:ns:shop", "k8s:sa:cart", "k8s:pod-uid:u1", "k8s:pod-name:cart-1"]
        );
    }
}
