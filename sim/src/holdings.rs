//! What a simulated agent's view holds, as digests only: enough to tell another replica
//! what it has (`WatchRequest.held`) when its stream moves there. A real agent keeps the
//! whole view (`aether_proto::view::WatchView`, whose `held()` this matches); thousands
//! of those would not fit in one process.

use std::collections::HashMap;

use aether_proto::digest::{self, EndpointSum};
use aether_proto::registrar::v1::{Held, Holdings, WatchResponse, change, watch_response};
use aether_proto::registry::v1;

/// A service's record and its endpoints' digests.
#[derive(Clone, Debug, Default)]
struct Service {
    record: v1::Service,
    /// Each endpoint's digest by address, to take it out of the sum when it goes.
    endpoints: HashMap<String, u64>,
    sum: EndpointSum,
}

impl Service {
    fn put(&mut self, address: String, digest: u64) {
        self.sum.add(digest);
        if let Some(old) = self.endpoints.insert(address, digest) {
            self.sum.remove(old);
        }
    }
}

/// The digests of a view, built from the same stream.
#[derive(Clone, Debug, Default)]
pub struct Digests {
    services: HashMap<String, Service>,
    /// A snapshot being received; replaces `services` when complete.
    incoming: Option<HashMap<String, Service>>,
}

impl Digests {
    /// Applies one message (a stream that passed the view's own checks).
    pub fn apply(&mut self, response: &WatchResponse) {
        match &response.event {
            Some(watch_response::Event::Snapshot(chunk)) => {
                if chunk.reset {
                    self.incoming = Some(HashMap::new());
                }
                let Some(incoming) = self.incoming.as_mut() else { return };
                for service in &chunk.services {
                    let key = aether_proto::view::service_key(service);
                    incoming.entry(key).or_default().record = service.clone();
                }
                for endpoint in &chunk.endpoints {
                    let service = incoming.entry(endpoint.service.clone()).or_default();
                    service.put(endpoint.address.clone(), digest::of(endpoint));
                }
            }
            Some(watch_response::Event::SnapshotComplete(_)) => {
                if let Some(incoming) = self.incoming.take() {
                    self.services = incoming;
                }
            }
            Some(watch_response::Event::Delta(delta)) => {
                for change in delta.changes.iter().filter_map(|c| c.change.as_ref()) {
                    self.apply_change(change);
                }
            }
            None => {}
        }
    }

    fn apply_change(&mut self, change: &change::Change) {
        match change {
            change::Change::ServiceAdded(service) => {
                let key = aether_proto::view::service_key(service);
                self.services.entry(key).or_default().record = service.clone();
            }
            change::Change::ServiceRemoved(key) => {
                self.services.remove(key);
            }
            change::Change::EndpointAdded(endpoint) | change::Change::EndpointUpdated(endpoint) => {
                if let Some(service) = self.services.get_mut(&endpoint.service) {
                    service.put(endpoint.address.clone(), digest::of(endpoint));
                }
            }
            change::Change::EndpointRemoved(removed) => {
                let service = self.services.get_mut(&removed.service);
                if let Some(service) = service
                    && let Some(old) = service.endpoints.remove(&removed.address)
                {
                    service.sum.remove(old);
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
            WatchResponse {
                event: Some(Event::SnapshotComplete(SnapshotComplete {
                    version: Some(Version {
                        instance: "i".into(),
                        seq: 1,
                    }),
                    filter_id: 1,
                })),
            },
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
        ];
        let (mut view, mut digests) = (WatchView::default(), Digests::default());
        for (i, message) in stream.into_iter().enumerate() {
            digests.apply(&message);
            view.apply(message).unwrap();
            let Some(expected) = view.held() else { continue };
            let mut held = digests.held();
            held.services.sort_by(|x, y| x.key.cmp(&y.key));
            assert_eq!(held, expected, "after message {i}");
        }
        assert_eq!(view.catalog.services.len(), 2, "the stream was applied");
    }
}
