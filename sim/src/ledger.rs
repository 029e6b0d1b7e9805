//! What the agents saw of each change: when it was sent, how many agents it
//! reached and when, and the bytes its deltas cost on the wire.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use aether_proto::registrar::v1::{Delta, WatchResponse, change};
use parking_lot::Mutex;
use prost::Message;

/// What a message costs beyond its protobuf encoding: the gRPC length prefix (5)
/// and one HTTP/2 DATA frame header (9). TLS records (~22 bytes each) are not counted.
pub const FRAMING_BYTES: usize = 5 + 9;

/// A Watch message's size on the wire (above TLS).
pub fn wire_bytes(message: &WatchResponse) -> usize {
    message.encoded_len() + FRAMING_BYTES
}

/// The address each change of `delta` is about.
pub fn changed_addresses(delta: &Delta) -> impl Iterator<Item = &str> {
    delta.changes.iter().filter_map(|c| match c.change.as_ref()? {
        change::Change::EndpointAdded(e) | change::Change::EndpointUpdated(e) => Some(e.address.as_str()),
        change::Change::EndpointRemoved(r) => Some(r.address.as_str()),
        change::Change::ServiceAdded(_)
        | change::Change::ServiceRemoved(_)
        | change::Change::RoutePut(_)
        | change::Change::RouteRemoved(_)
        | change::Change::PolicyPut(_)
        | change::Change::PolicyRemoved(_)
        | change::Change::HttpFilterPut(_)
        | change::Change::HttpFilterRemoved(_)
        | change::Change::MeshConfigPut(_)
        | change::Change::MeshConfigRemoved(_) => None,
    })
}

/// A change still reaching its agents.
struct Pending {
    sent: Instant,
    affected: u32,
    delivered: u32,
    bytes: f64,
}

/// A change every affected agent has seen.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Completed {
    /// Until the last affected agent had it.
    pub every: Duration,
    pub deliveries: u32,
    /// Its share of the deltas that carried it, summed over its deliveries.
    pub bytes: f64,
}

#[derive(Default)]
struct Books {
    pending: HashMap<String, Pending>,
    deliveries: Vec<Duration>,
    completed: Vec<Completed>,
    /// Deliveries of addresses with no change pending (e.g. echoes of the load).
    untracked: u64,
}

/// The shared books: the churn driver records what it sends, agents what they get.
#[derive(Default)]
pub struct Ledger(Mutex<Books>);

/// Everything the ledger recorded, taken at the end of a phase.
#[derive(Debug, Default)]
pub struct Outcome {
    pub deliveries: Vec<Duration>,
    pub completed: Vec<Completed>,
    /// Changes not seen by every affected agent when the phase ended.
    pub incomplete: usize,
    pub untracked: u64,
}

impl Ledger {
    /// A change of `address` goes out now and should reach `affected` agents.
    /// Changes no agent depends on are not tracked.
    pub fn sent(&self, address: String, affected: u32, at: Instant) {
        if affected == 0 {
            return;
        }
        let pending = Pending {
            sent: at,
            affected,
            delivered: 0,
            bytes: 0.0,
        };
        self.0.lock().pending.insert(address, pending);
    }

    /// Whether a change of `address` is still reaching its agents (the driver then
    /// leaves that pod alone, so every delivery is attributed to one change).
    pub fn busy(&self, address: &str) -> bool {
        self.0.lock().pending.contains_key(address)
    }

    pub fn pending(&self) -> usize {
        self.0.lock().pending.len()
    }

    /// One agent received `delta` at `at`.
    pub fn delivered(&self, delta: &Delta, bytes: usize, at: Instant) {
        let share = bytes as f64 / delta.changes.len().max(1) as f64;
        let mut books = self.0.lock();
        for address in changed_addresses(delta) {
            let Some(pending) = books.pending.get_mut(address) else {
                books.untracked += 1;
                continue;
            };
            let latency = at.saturating_duration_since(pending.sent);
            pending.delivered += 1;
            pending.bytes += share;
            let done = pending.delivered >= pending.affected;
            books.deliveries.push(latency);
            if done {
                let pending = books.pending.remove(address).expect("just seen");
                books.completed.push(Completed {
                    every: latency,
                    deliveries: pending.delivered,
                    bytes: pending.bytes,
                });
            }
        }
    }

    /// Takes what was recorded; changes still pending count as incomplete.
    pub fn take(&self) -> Outcome {
        let mut books = std::mem::take(&mut *self.0.lock());
        books.deliveries.sort();
        books.completed.sort_by_key(|c| c.every);
        Outcome {
            deliveries: books.deliveries,
            completed: books.completed,
            incomplete: books.pending.len(),
            untracked: books.untracked,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use aether_proto::registrar::v1::{Change, EndpointRef, watch_response};
    use aether_proto::registry::v1::Endpoint;

    fn added(address: &str) -> Change {
        Change {
            change: Some(change::Change::EndpointAdded(Endpoint {
                service: "ns/a".into(),
                address: address.into(),
                ..Default::default()
            })),
        }
    }

    fn removed(address: &str) -> Change {
        Change {
            change: Some(change::Change::EndpointRemoved(EndpointRef {
                service: "ns/a".into(),
                address: address.into(),
            })),
        }
    }

    #[test]
    fn a_change_completes_when_every_affected_agent_has_it() {
        let ledger = Ledger::default();
        let t0 = Instant::now();
        ledger.sent("10.0.0.1".into(), 2, t0);
        let delta = Delta {
            changes: vec![added("10.0.0.1")],
            ..Default::default()
        };
        ledger.delivered(&delta, 100, t0 + Duration::from_millis(3));
        assert!(ledger.busy("10.0.0.1"));
        ledger.delivered(&delta, 100, t0 + Duration::from_millis(7));
        assert!(!ledger.busy("10.0.0.1"));
        let outcome = ledger.take();
        assert_eq!(outcome.deliveries, [Duration::from_millis(3), Duration::from_millis(7)]);
        assert_eq!(
            outcome.completed,
            [Completed {
                every: Duration::from_millis(7),
                deliveries: 2,
                bytes: 200.0
            }]
        );
        assert_eq!(outcome.incomplete, 0);
    }

    #[test]
    fn a_delta_carrying_several_changes_splits_its_bytes_between_them() {
        let ledger = Ledger::default();
        let t0 = Instant::now();
        ledger.sent("10.0.0.1".into(), 1, t0);
        ledger.sent("10.0.0.2".into(), 3, t0);
        ledger.sent("10.0.0.9".into(), 0, t0);
        assert!(!ledger.busy("10.0.0.9"), "a change nobody depends on is not tracked");
        let delta = Delta {
            changes: vec![added("10.0.0.1"), removed("10.0.0.2"), added("10.0.0.3")],
            ..Default::default()
        };
        ledger.delivered(&delta, 300, t0);
        let outcome = ledger.take();
        assert_eq!(outcome.completed.len(), 1);
        assert_eq!(outcome.completed[0].bytes, 100.0);
        assert_eq!(outcome.incomplete, 1, "10.0.0.2 reached 1 of 3 agents");
        assert_eq!(outcome.untracked, 1, "10.0.0.3 was never sent by the driver");
    }

    #[test]
    fn wire_bytes_add_grpc_and_http2_framing_to_the_encoding() {
        let message = WatchResponse {
            event: Some(watch_response::Event::Delta(Delta {
                changes: vec![removed("10.0.0.2")],
                ..Default::default()
            })),
        };
        assert_eq!(wire_bytes(&message), message.encode_to_vec().len() + 14);
    }
}
