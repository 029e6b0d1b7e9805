//! What delta and state-of-the-world ADS streams share: the I/O loop that drives a
//! stream's state machine ([`Protocol`]), the nonces, and the bookkeeping a request
//! implies for the cache's ACK state ([`Record`]).
//!
//! The machines ([`super::delta::DeltaStream`], [`super::sotw::SotwStream`]) make every
//! decision without I/O: a request in → records out; a snapshot in → responses out.
//! [`serve`] reads requests and cache changes, applies the records to the stream's
//! [`AckRecorder`] and metrics, and writes the responses.

use std::sync::Arc;
use std::time::Instant;

use envoy_types::pb::google::rpc;
use futures::{Stream, StreamExt};
use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::mpsc;
use tonic::Status;

use super::cache::{AckRecorder, Cache, Sent, Snapshot};
use super::{Hooks, XdsMetrics};

/// A response sent and not yet answered: its type, what it carried, and when.
#[derive(Debug, Clone, PartialEq)]
pub struct Push {
    pub type_url: String,
    pub resources: Sent,
    pub at: Instant,
}

/// What a request tells about what its Envoy holds, for the cache's ACK state.
#[derive(Debug, Clone, PartialEq)]
pub enum Record {
    /// Envoy accepted a delta response: it now runs these versions (and not the removed).
    Acked(Push),
    /// Envoy accepted a state-of-the-world response: it holds exactly these of the type.
    AckedAll(Push),
    /// Envoy rejected a response, with its error; it keeps its last good config.
    Rejected(Push, String),
    /// A reconnecting Envoy already runs these versions.
    Running { type_url: String, resources: Sent },
    /// Envoy unsubscribed from these names: it no longer holds them.
    Forgotten { type_url: String, names: Vec<String> },
}

/// Envoy's answer to `push`: a request carrying its nonce is a NACK with `error_detail`,
/// an ACK without.
pub fn verdict(push: Push, error_detail: Option<&rpc::Status>, accepted: fn(Push) -> Record) -> Record {
    match error_detail {
        Some(error) => Record::Rejected(push, error.message.clone()),
        None => accepted(push),
    }
}

impl Record {
    fn apply(self, acks: &AckRecorder, metrics: &XdsMetrics) {
        match self {
            Record::Acked(push) => {
                metrics.answered(&push.type_url, push.at.elapsed(), true);
                acks.record_ack(&push.type_url, &push.resources);
            }
            Record::AckedAll(push) => {
                metrics.answered(&push.type_url, push.at.elapsed(), true);
                acks.record_ack_all(&push.type_url, &push.resources);
            }
            Record::Rejected(push, error) => {
                metrics.answered(&push.type_url, push.at.elapsed(), false);
                acks.record_nack(&push.type_url, &push.resources, &error);
                tracing::warn!(type_url = %push.type_url, %error,
                    "Envoy rejected a config push; it keeps its last good config");
            }
            Record::Running { type_url, resources } => acks.record_ack(&type_url, &resources),
            Record::Forgotten { type_url, names } => acks.forget(&type_url, &names),
        }
    }
}

/// A stream's response nonces: "1", "2", … (never empty, which is "no nonce").
#[derive(Debug, Default)]
pub struct Nonces(u64);

impl Nonces {
    pub fn issue(&mut self) -> String {
        self.0 += 1;
        self.0.to_string()
    }
}

/// What a response adds to the push metrics.
pub struct Size<'a> {
    pub type_url: &'a str,
    /// Resources added, updated or removed.
    pub resources: usize,
    /// Their encoded bytes.
    pub bytes: usize,
}

/// The decisions of one ADS stream, without I/O.
pub trait Protocol: Default {
    type Request;
    type Response;

    /// Takes in a request: Envoy's answer to an earlier response and its subscription.
    fn request(&mut self, request: &Self::Request) -> Vec<Record>;

    /// The names a request asks for that `snapshot` does not serve, by type, for the
    /// agent to look up on demand.
    fn on_demand<'r>(_request: &'r Self::Request, _snapshot: &Snapshot) -> Option<(&'r str, Vec<String>)> {
        None
    }

    /// The responses that bring what Envoy holds up to `snapshot`, in push order.
    fn push(&mut self, snapshot: &Snapshot, now: Instant) -> Vec<Self::Response>;

    fn size(response: &Self::Response) -> Size<'_>;
}

/// Serves one ADS stream until Envoy or the cache goes away.
pub async fn serve<P, S>(cache: Cache, hooks: Hooks, mut inbound: S, out: mpsc::Sender<Result<P::Response, Status>>)
where
    P: Protocol,
    S: Stream<Item = Result<P::Request, Status>> + Unpin,
{
    let mut machine = P::default();
    let mut snapshots = cache.subscribe();
    let acks = cache.open_stream();
    hooks.metrics.streams.inc();
    let _streams = Decrement(hooks.metrics.streams.clone());
    loop {
        let snapshot = tokio::select! {
            request = inbound.next() => match request {
                Some(Ok(request)) => {
                    for record in machine.request(&request) {
                        record.apply(&acks, &hooks.metrics);
                    }
                    snapshot_for::<P>(&cache, &hooks, &request)
                }
                Some(Err(status)) => {
                    tracing::debug!(%status, "xDS stream ended");
                    break;
                }
                None => break,
            },
            changed = snapshots.changed() => {
                if changed.is_err() {
                    break;
                }
                snapshots.borrow_and_update().clone()
            }
        };
        for response in machine.push(&snapshot, Instant::now()) {
            let size = P::size(&response);
            hooks.metrics.pushed(size.type_url, size.resources, size.bytes);
            if out.send(Ok(response)).await.is_err() {
                return;
            }
        }
    }
}

/// The snapshot to answer `request` from, once the names it asks for that are not
/// served are being looked up (the hook marks them pending before it returns).
fn snapshot_for<P: Protocol>(cache: &Cache, hooks: &Hooks, request: &P::Request) -> Arc<Snapshot> {
    let snapshot = cache.snapshot();
    match P::on_demand(request, &snapshot) {
        Some((type_url, missing)) => {
            (hooks.on_demand)(type_url, &missing);
            cache.snapshot()
        }
        None => snapshot,
    }
}

/// Decrements a gauge when dropped (a stream ended).
struct Decrement(Gauge);

impl Drop for Decrement {
    fn drop(&mut self) {
        self.0.dec();
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::time::Duration;

    use envoy_types::pb::envoy::service::discovery::v3::{DeltaDiscoveryRequest, DeltaDiscoveryResponse};
    use parking_lot::Mutex;
    use tokio_stream::wrappers::ReceiverStream;

    use super::*;
    use crate::xds::cache::{Resource, WaitError};
    use crate::xds::delta::DeltaStream;
    use crate::xds::testing::body;
    use crate::xds::{CLUSTER, OnDemand};

    fn serve_clusters(cache: &Cache, names: &[&str]) {
        let resources = names.iter().map(|n| Resource::new(n.to_string(), body(n, "1")));
        cache.set(BTreeMap::from([(CLUSTER.to_owned(), resources.collect())]));
    }

    fn request(subscribe: &[&str], nonce: &str) -> DeltaDiscoveryRequest {
        DeltaDiscoveryRequest {
            type_url: CLUSTER.into(),
            resource_names_subscribe: subscribe.iter().map(|n| n.to_string()).collect(),
            response_nonce: nonce.into(),
            ..Default::default()
        }
    }

    async fn next(out: &mut mpsc::Receiver<Result<DeltaDiscoveryResponse, Status>>) -> DeltaDiscoveryResponse {
        let response = tokio::time::timeout(Duration::from_secs(5), out.recv()).await;
        response
            .expect("a response")
            .expect("the stream is open")
            .expect("not an error")
    }

    /// The loop around the machine: on-demand lookups through the hook, records into the
    /// cache's ACK state, cache changes pushed, and the stream's state gone with it.
    #[tokio::test]
    async fn serve_drives_a_delta_stream_against_the_cache() {
        let cache = Cache::default();
        serve_clusters(&cache, &["a"]);
        let looked_up = Arc::new(Mutex::new(Vec::new()));
        let on_demand: OnDemand = {
            let (cache, looked_up) = (cache.clone(), looked_up.clone());
            Arc::new(move |type_url, names| {
                looked_up.lock().push((type_url.to_owned(), names.to_vec()));
                cache.add_pending(names.iter().map(|n| (type_url.to_owned(), n.clone())));
            })
        };
        let hooks = Hooks {
            metrics: XdsMetrics::default(),
            on_demand,
        };
        let (requests, inbound) = mpsc::channel(4);
        let (out, mut responses) = mpsc::channel(4);
        let task = tokio::spawn(serve::<DeltaStream, _>(
            cache.clone(),
            hooks.clone(),
            ReceiverStream::new(inbound),
            out,
        ));

        requests.send(Ok(request(&["a", "x"], ""))).await.unwrap();
        let first = next(&mut responses).await;
        assert_eq!(
            first.resources.iter().map(|r| r.name.as_str()).collect::<Vec<_>>(),
            ["a"]
        );
        assert!(
            first.removed_resources.is_empty(),
            "a name being looked up was reported absent"
        );
        assert_eq!(*looked_up.lock(), [(CLUSTER.to_owned(), vec!["x".to_owned()])]);

        requests.send(Ok(request(&[], &first.nonce))).await.unwrap();
        let wanted = [(CLUSTER, "a".to_owned())];
        assert_eq!(cache.wait_acked(&wanted, Duration::from_secs(5)).await, Ok(()));

        serve_clusters(&cache, &["a", "x"]);
        let found = next(&mut responses).await;
        assert_eq!(found.resources[0].name, "x");
        let mut nack = request(&[], &found.nonce);
        nack.error_detail = Some(rpc::Status {
            message: "bad".into(),
            ..Default::default()
        });
        requests.send(Ok(nack)).await.unwrap();
        let rejected = WaitError::Rejected {
            name: "x".into(),
            error: "bad".into(),
        };
        let wanted = [(CLUSTER, "x".to_owned())];
        assert_eq!(cache.wait_acked(&wanted, Duration::from_secs(5)).await, Err(rejected));
        assert_eq!(hooks.metrics.streams.get(), 1);

        drop(requests);
        task.await.unwrap();
        assert!(cache.streams().live.is_empty(), "the ended stream's ACK state stayed");
        assert_eq!(hooks.metrics.streams.get(), 0);
    }

    #[test]
    fn nonces_are_never_empty_and_never_repeat() {
        let mut nonces = Nonces::default();
        assert_eq!([nonces.issue(), nonces.issue()], ["1", "2"]);
    }
}
