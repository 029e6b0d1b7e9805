//! What a simulated agent's view holds, as digests only: enough to tell another replica
//! what it has (`WatchRequest.held`) when its stream moves there. A real agent keeps the
//! whole view (`aether_proto::view::WatchView`, whose `held()` this matches); thousands
//! of those would not fit in one process, nor would one map of endpoint digests per agent
//! (10,000 agents × ~45,000 endpoints). So a service's endpoint digests are shared
//! between the agents that hold it in the same state ([`States`]).

use std::collections::HashMap;
use std::sync::{Arc, Weak};

use aether_proto::digest::{self, EndpointSum};
use aether_proto::registrar::v1::{Held, Holdings, WatchResponse, change, watch_response};
use aether_proto::registry::v1;
use parking_lot::Mutex;

/// A service's endpoint digests by address.
type Members = HashMap<String, u64>;

/// Every service state some agent holds, by service and digest sum (equal sums mean equal
/// states but for a 64-bit collision): the first agent to reach a state builds it, the
/// others share it.
#[derive(Default)]
pub struct States {
    by_sum: Mutex<HashMap<(String, EndpointSum), Weak<Members>>>,
}

impl States {
    fn intern(&self, service: &str, sum: EndpointSum, build: impl FnOnce() -> Members) -> Arc<Members> {
        let mut by_sum = self.by_sum.lock();
        if let Some(shared) = by_sum.get(&(service.to_owned(), sum)).and_then(Weak::upgrade) {
            return shared;
        }
        // States no agent holds any more go before the table doubles.
        if by_sum.len() >= 1024 && by_sum.len().is_power_of_two() {
            by_sum.retain(|_, state| state.strong_count() > 0);
        }
        let state = Arc::new(build());
        by_sum.insert((service.to_owned(), sum), Arc::downgrade(&state));
        state
    }
}

/// A service as one agent holds it.
#[derive(Clone, Debug)]
struct Service {
    record: v1::Service,
    endpoints: Arc<Members>,
    sum: EndpointSum,
}

/// Changes to one service's endpoints within one message, applied when it is whole.
struct Edit {
    base: Arc<Members>,
    puts: Vec<(String, Option<u64>)>,
    sum: EndpointSum,
}

impl Edit {
    fn current(&self, address: &str) -> Option<u64> {
        match self.puts.iter().rev().find(|(a, _)| a == address) {
            Some((_, digest)) => *digest,
            None => self.base.get(address).copied(),
        }
    }

    fn set(&mut self, address: &str, digest: Option<u64>) {
        if let Some(old) = self.current(address) {
            self.sum.remove(old);
        }
        if let Some(new) = digest {
            self.sum.add(new);
        }
        self.puts.push((address.to_owned(), digest));
    }

    fn build(self) -> impl FnOnce() -> Members {
        move || {
            let mut members = Members::clone(&self.base);
            for (address, digest) in self.puts {
                match digest {
                    Some(digest) => members.insert(address, digest),
                    None => members.remove(&address),
                };
            }
            members
        }
    }
}

/// The edit of `service` in this message, if the agent holds it.
fn edit<'a>(
    services: &HashMap<String, Service>,
    edits: &'a mut HashMap<String, Edit>,
    service: &str,
) -> Option<&'a mut Edit> {
    let held = services.get(service)?;
    let edit = edits.entry(service.to_owned()).or_insert_with(|| Edit {
        base: held.endpoints.clone(),
        puts: Vec::new(),
        sum: held.sum,
    });
    Some(edit)
}

/// A service of a snapshot being received: as held (a retained one), or new.
enum Staged {
    Held(Service),
    New(v1::Service, Members),
}

/// The digests of one agent's view, built from the same stream.
pub struct Digests {
    states: Arc<States>,
    services: HashMap<String, Service>,
    /// A snapshot being received; replaces `services` when complete.
    incoming: Option<HashMap<String, Staged>>,
}

impl Digests {
    pub fn new(states: Arc<States>) -> Digests {
        Digests {
            states,
            services: HashMap::new(),
            incoming: None,
        }
    }

    /// Applies one message (a stream that passed the view's own checks).
    pub fn apply(&mut self, response: &WatchResponse) {
        match &response.event {
            Some(watch_response::Event::Snapshot(chunk)) => {
                if chunk.reset {
                    let retained = self.services.iter().filter(|_| chunk.retain);
                    let mut staged: HashMap<_, _> =
                        retained.map(|(k, s)| (k.clone(), Staged::Held(s.clone()))).collect();
                    for removal in chunk.removals.iter().filter_map(|c| c.change.as_ref()) {
                        if let change::Change::ServiceRemoved(key) = removal {
                            staged.remove(key);
                        }
                    }
                    self.incoming = Some(staged);
                }
                let Some(incoming) = self.incoming.as_mut() else { return };
                for service in &chunk.services {
                    let key = aether_proto::view::service_key(service);
                    incoming.insert(key, Staged::New(service.clone(), Members::new()));
                }
                for endpoint in &chunk.endpoints {
                    // A service arrives whole, so its endpoints follow it.
                    if let Some(Staged::New(_, members)) = incoming.get_mut(&endpoint.service) {
                        members.insert(endpoint.address.clone(), digest::of(endpoint));
                    }
                }
            }
            Some(watch_response::Event::SnapshotComplete(_)) => {
                let Some(incoming) = self.incoming.take() else { return };
                self.services = (incoming.into_iter())
                    .map(|(key, staged)| match staged {
                        Staged::Held(service) => (key, service),
                        Staged::New(record, members) => {
                            let mut sum = EndpointSum::default();
                            members.values().for_each(|d| sum.add(*d));
                            let endpoints = self.states.intern(&key, sum, || members);
                            (key, Service { record, endpoints, sum })
                        }
                    })
                    .collect();
            }
            Some(watch_response::Event::Delta(delta)) => {
                let mut edits: HashMap<String, Edit> = HashMap::new();
                for change in delta.changes.iter().filter_map(|c| c.change.as_ref()) {
                    self.apply_change(change, &mut edits);
                }
                for (key, edit) in edits {
                    if let Some(service) = self.services.get_mut(&key) {
                        service.sum = edit.sum;
                        service.endpoints = self.states.intern(&key, edit.sum, edit.build());
                    }
                }
            }
            None => {}
        }
    }

    fn apply_change(&mut self, change: &change::Change, edits: &mut HashMap<String, Edit>) {
        match change {
            change::Change::ServiceAdded(record) => {
                let key = aether_proto::view::service_key(record);
                match self.services.get_mut(&key) {
                    Some(held) => held.record = record.clone(),
                    None => {
                        let empty = EndpointSum::default();
                        let endpoints = self.states.intern(&key, empty, Members::new);
                        let (record, sum) = (record.clone(), empty);
                        self.services.insert(key, Service { record, endpoints, sum });
                    }
                }
            }
            change::Change::ServiceRemoved(key) => {
                self.services.remove(key);
                edits.remove(key);
            }
            change::Change::EndpointAdded(endpoint) | change::Change::EndpointUpdated(endpoint) => {
                if let Some(edit) = edit(&self.services, edits, &endpoint.service) {
                    edit.set(&endpoint.address, Some(digest::of(endpoint)));
                }
            }
            change::Change::EndpointRemoved(removed) => {
                if let Some(edit) = edit(&self.services, edits, &removed.service) {
                    edit.set(&removed.address, None);
                }
            }
            // The simulated agents watch no configuration records.
            _ => {}
        }
    }

    /// What to send as `held`.
    pub fn held(&self) -> Holdings {
        let services = self.services.iter().map(|(key, service)| Held {
            key: key.clone(),
            digest: digest::service(&service.record, service.sum),
        });
        Holdings {
            services: services.collect(),
            ..Default::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use aether_proto::registrar::v1::{
        Change, Delta, EndpointRef, Snapshot, SnapshotComplete, Version, WatchResponse, watch_response::Event,
    };
    use aether_proto::registry::v1::{Endpoint, Service};
    use aether_proto::view::WatchView;

    use super::*;

    fn service(name: &str, vip: &str) -> Service {
        Service {
            namespace: "sim".into(),
            name: name.into(),
            vip: vip.into(),
            kubernetes: None,
            external: None,
        }
    }

    fn endpoint(name: &str, address: &str, weight: u32) -> Endpoint {
        Endpoint {
            service: format!("sim/{name}"),
            address: address.into(),
            weight,
            ..Default::default()
        }
    }

    fn delta(seq: u64, changes: Vec<change::Change>) -> WatchResponse {
        let changes = changes.into_iter().map(|c| Change { change: Some(c) }).collect();
        let version = Some(Version {
            instance: "i".into(),
            seq,
        });
        WatchResponse {
            event: Some(Event::Delta(Delta {
                version,
                changes,
                filter_id: 1,
            })),
        }
    }

    fn complete(instance: &str, seq: u64) -> WatchResponse {
        let version = Some(Version {
            instance: instance.into(),
            seq,
        });
        WatchResponse {
            event: Some(Event::SnapshotComplete(SnapshotComplete { version, filter_id: 1 })),
        }
    }

    #[test]
    fn the_digests_say_what_the_whole_view_would() {
        let stream = [
            WatchResponse {
                event: Some(Event::Snapshot(Snapshot {
                    reset: true,
                    services: vec![service("a", "240.240.0.1"), service("b", "240.240.0.2")],
                    endpoints: vec![endpoint("a", "10.0.0.1", 1), endpoint("b", "10.0.0.2", 1)],
                    ..Default::default()
                })),
            },
            complete("i", 1),
            delta(
                2,
                vec![
                    change::Change::EndpointUpdated(endpoint("a", "10.0.0.1", 5)),
                    change::Change::EndpointAdded(endpoint("a", "10.0.0.3", 1)),
                    change::Change::EndpointRemoved(EndpointRef {
                        service: "sim/b".into(),
                        address: "10.0.0.2".into(),
                    }),
                    change::Change::ServiceAdded(service("c", "240.240.0.3")),
                ],
            ),
            delta(3, vec![change::Change::ServiceRemoved("sim/c".into())]),
            // Another replica reconciles: b changed, a is kept as held.
            WatchResponse {
                event: Some(Event::Snapshot(Snapshot {
                    reset: true,
                    retain: true,
                    removals: vec![Change {
                        change: Some(change::Change::ServiceRemoved("sim/b".into())),
                    }],
                    services: vec![service("b", "240.240.0.2")],
                    endpoints: vec![endpoint("b", "10.0.0.4", 1)],
                    ..Default::default()
                })),
            },
            complete("j", 7),
        ];
        let states = Arc::new(States::default());
        let (mut view, mut digests) = (WatchView::default(), Digests::new(states.clone()));
        let mut twin = Digests::new(states.clone());
        for (i, message) in stream.into_iter().enumerate() {
            digests.apply(&message);
            twin.apply(&message);
            view.apply(message).unwrap();
            let Some(expected) = view.held() else { continue };
            let mut held = digests.held();
            held.services.sort_by(|x, y| x.key.cmp(&y.key));
            assert_eq!(held, expected, "after message {i}");
        }
        assert_eq!(view.catalog.services.len(), 2, "the stream was applied");
        let (a, twin_a) = (&digests.services["sim/a"], &twin.services["sim/a"]);
        assert!(
            Arc::ptr_eq(&a.endpoints, &twin_a.endpoints),
            "two agents share one state"
        );
        assert_eq!(a.endpoints.len(), 2);
    }
}
