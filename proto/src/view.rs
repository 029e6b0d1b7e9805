//! The client side of `aether.registrar.v1.Registrar/Watch`: a view of the catalog
//! rebuilt from the stream, exactly as the protocol defines it. Agents keep one; the
//! registrar's tests use it to check what a watcher would believe.

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::digest::{self, EndpointSum};
use crate::registrar::v1::{Held, Holdings, Version, WatchResponse, change, watch_response};
use crate::registry::v1::{AuthorizationPolicy, Endpoint, HttpFilter, MeshConfig, Route, RouteKind, Service};

/// A service's endpoints by address. Shared: cloning a catalog is cheap, and a
/// service whose endpoints did not change keeps the same `Arc` (consumers can skip it).
pub type Endpoints = Arc<BTreeMap<String, Endpoint>>;

/// What a watcher holds of the catalog (the registrar's `Catalog` is the original):
/// services by key (`<ns>/<name>`), their endpoints by address, the routes
/// attached to them by route key (`<kind>/<ns>/<name>`, see [`route_key`]), and the
/// authorization policies of the watched namespaces by key (`<ns>/<name>`, see
/// [`policy_key`]), and the HTTP filters of those namespaces or of watched services by
/// key (`<ns>/<name>`, see [`http_filter_key`]), and the MeshConfigs of the mesh and of
/// those namespaces by key (`<ns>/<name>`, see [`mesh_config_key`]).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CatalogView {
    pub services: BTreeMap<String, Service>,
    pub endpoints: BTreeMap<String, Endpoints>,
    pub routes: BTreeMap<String, Arc<Route>>,
    pub policies: BTreeMap<String, Arc<AuthorizationPolicy>>,
    pub http_filters: BTreeMap<String, Arc<HttpFilter>>,
    pub mesh_configs: BTreeMap<String, Arc<MeshConfig>>,
}

/// What a client believes after the messages it has applied.
#[derive(Clone, Debug, Default)]
pub struct WatchView {
    /// The last consistent state; kept while a new snapshot streams in.
    pub catalog: CatalogView,
    /// The version `catalog` is at; what to send as `resume_from` on reconnect.
    pub version: Option<Version>,
    /// The id of the filter `catalog` was computed with.
    pub filter_id: u64,
    incoming: Option<CatalogView>,
}

/// What applying one message did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Applied {
    /// A snapshot chunk was staged; the view changes at SnapshotComplete.
    SnapshotChunk,
    /// The view was replaced by a complete snapshot.
    Snapshot,
    /// A delta was applied.
    Delta,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ViewError {
    #[error("watch response has no event")]
    Empty,
    #[error("snapshot chunk without a preceding reset chunk")]
    ChunkWithoutReset,
    #[error("snapshot complete without a snapshot")]
    CompleteWithoutSnapshot,
    #[error("delta received while a snapshot was streaming")]
    DeltaDuringSnapshot,
    #[error("{0} has no version")]
    NoVersion(&'static str),
    #[error("endpoint {address} names service {service}, which is not in the view")]
    UnknownService { service: String, address: String },
    #[error("change has no content")]
    EmptyChange,
    #[error("a snapshot's removals may only remove (got {0})")]
    NotARemoval(&'static str),
    #[error("snapshot removals outside its first chunk")]
    RemovalsWithoutReset,
}

pub fn service_key(service: &Service) -> String {
    format!("{}/{}", service.namespace, service.name)
}

/// A route's key, `<kind>/<namespace>/<name>` with kind `http` or `grpc`.
pub fn route_key(route: &Route) -> String {
    format!("{}/{}/{}", route_kind_name(route.kind()), route.namespace, route.name)
}

/// An HTTP filter's key, `<namespace>/<name>`.
pub fn http_filter_key(filter: &HttpFilter) -> String {
    format!("{}/{}", filter.namespace, filter.name)
}

/// A MeshConfig's key, `<namespace>/<name>`.
pub fn mesh_config_key(config: &MeshConfig) -> String {
    format!("{}/{}", config.namespace, config.name)
}

/// An authorization policy's key, `<namespace>/<name>`.
pub fn policy_key(policy: &AuthorizationPolicy) -> String {
    format!("{}/{}", policy.namespace, policy.name)
}

/// The short kind name used in route keys.
pub fn route_kind_name(kind: RouteKind) -> &'static str {
    match kind {
        RouteKind::Grpc => "grpc",
        RouteKind::Tcp => "tcp",
        RouteKind::Tls => "tls",
        RouteKind::Http | RouteKind::Unspecified => "http",
    }
}

impl CatalogView {
    fn add_service(&mut self, service: Service) {
        let key = service_key(&service);
        self.endpoints.entry(key.clone()).or_default();
        self.services.insert(key, service);
    }

    fn put_endpoint(&mut self, endpoint: Endpoint) -> Result<(), ViewError> {
        let Some(endpoints) = self.endpoints.get_mut(&endpoint.service) else {
            return Err(ViewError::UnknownService {
                service: endpoint.service,
                address: endpoint.address,
            });
        };
        Arc::make_mut(endpoints).insert(endpoint.address.clone(), endpoint);
        Ok(())
    }

    /// The part of the catalog about the services `keep` accepts: those services,
    /// their endpoints, and the routes with at least one of them as a parent.
    pub fn restricted(&self, keep: impl Fn(&str) -> bool) -> CatalogView {
        CatalogView {
            services: self
                .services
                .iter()
                .filter(|(k, _)| keep(k))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
            endpoints: self
                .endpoints
                .iter()
                .filter(|(k, _)| keep(k))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
            routes: self
                .routes
                .iter()
                .filter(|(_, route)| route.parents.iter().any(|p| keep(&p.service)))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
            // Policies are scoped by namespace, not by service: all are kept.
            policies: self.policies.clone(),
            // Filters of a dropped service may still be needed on the destination side.
            http_filters: self.http_filters.clone(),
            // Namespace-scoped too.
            mesh_configs: self.mesh_configs.clone(),
        }
    }

    /// Applies one of a retained snapshot's removals.
    fn apply_removal(&mut self, change: change::Change) -> Result<(), ViewError> {
        let added = match &change {
            change::Change::ServiceAdded(_) => "ServiceAdded",
            change::Change::EndpointAdded(_) => "EndpointAdded",
            change::Change::EndpointUpdated(_) => "EndpointUpdated",
            change::Change::RoutePut(_) => "RoutePut",
            change::Change::PolicyPut(_) => "PolicyPut",
            change::Change::HttpFilterPut(_) => "HttpFilterPut",
            change::Change::MeshConfigPut(_) => "MeshConfigPut",
            _ => return self.apply_change(change),
        };
        Err(ViewError::NotARemoval(added))
    }

    /// Applies one change of a Delta.
    fn apply_change(&mut self, change: change::Change) -> Result<(), ViewError> {
        match change {
            change::Change::ServiceAdded(service) => self.add_service(service),
            change::Change::ServiceRemoved(key) => {
                self.services.remove(&key);
                self.endpoints.remove(&key);
            }
            change::Change::EndpointAdded(endpoint) | change::Change::EndpointUpdated(endpoint) => {
                self.put_endpoint(endpoint)?
            }
            change::Change::EndpointRemoved(removed) => {
                if let Some(endpoints) = self.endpoints.get_mut(&removed.service) {
                    Arc::make_mut(endpoints).remove(&removed.address);
                }
            }
            change::Change::RoutePut(route) => {
                self.routes.insert(route_key(&route), Arc::new(route));
            }
            change::Change::RouteRemoved(key) => {
                self.routes.remove(&key);
            }
            change::Change::PolicyPut(policy) => {
                self.policies.insert(policy_key(&policy), Arc::new(policy));
            }
            change::Change::PolicyRemoved(key) => {
                self.policies.remove(&key);
            }
            change::Change::HttpFilterPut(filter) => {
                self.http_filters.insert(http_filter_key(&filter), Arc::new(filter));
            }
            change::Change::HttpFilterRemoved(key) => {
                self.http_filters.remove(&key);
            }
            change::Change::MeshConfigPut(config) => {
                let key = mesh_config_key(&config);
                self.mesh_configs.insert(key, Arc::new(config));
            }
            change::Change::MeshConfigRemoved(key) => {
                self.mesh_configs.remove(&key);
            }
        }
        Ok(())
    }

    /// What this view holds, for `WatchRequest.held`: every service and record by key,
    /// with its digest.
    pub fn holdings(&self) -> Holdings {
        fn held<'a, M: prost::Message + 'a>(records: impl Iterator<Item = (&'a String, &'a Arc<M>)>) -> Vec<Held> {
            records
                .map(|(key, record)| Held {
                    key: key.clone(),
                    digest: digest::of(&**record),
                })
                .collect()
        }
        let services = self.services.iter().map(|(key, service)| {
            let endpoints = self.endpoints.get(key).map(|e| EndpointSum::over(e.values()));
            Held {
                key: key.clone(),
                digest: digest::service(service, endpoints.unwrap_or_default()),
            }
        });
        Holdings {
            services: services.collect(),
            routes: held(self.routes.iter()),
            policies: held(self.policies.iter()),
            http_filters: held(self.http_filters.iter()),
            mesh_configs: held(self.mesh_configs.iter()),
        }
    }

    /// Every endpoint, in key then address order.
    pub fn all_endpoints(&self) -> impl Iterator<Item = &Endpoint> {
        self.endpoints.values().flat_map(|e| e.values())
    }
}

impl WatchView {
    /// What to send as `resume_from` when reconnecting with filter `filter_id`: the
    /// view's version if the view was built with that filter, else nothing (a
    /// snapshot), since resuming a view under another filter would corrupt it.
    pub fn resume_from(&self, filter_id: u64) -> Option<Version> {
        self.version
            .clone()
            .filter(|_| self.filter_id == filter_id && self.incoming.is_none())
    }

    /// What to send as `held` when reconnecting: the holdings of the last consistent
    /// view, whatever its filter; nothing before the first one.
    pub fn held(&self) -> Option<Holdings> {
        self.version.as_ref().map(|_| self.catalog.holdings())
    }

    /// Applies one message from the stream.
    pub fn apply(&mut self, response: WatchResponse) -> Result<Applied, ViewError> {
        match response.event.ok_or(ViewError::Empty)? {
            watch_response::Event::Snapshot(chunk) => {
                if chunk.reset {
                    let mut base = if chunk.retain {
                        self.catalog.clone()
                    } else {
                        CatalogView::default()
                    };
                    for removal in chunk.removals {
                        base.apply_removal(removal.change.ok_or(ViewError::EmptyChange)?)?;
                    }
                    self.incoming = Some(base);
                } else if !chunk.removals.is_empty() {
                    return Err(ViewError::RemovalsWithoutReset);
                }
                let incoming = self.incoming.as_mut().ok_or(ViewError::ChunkWithoutReset)?;
                for service in chunk.services {
                    incoming.add_service(service);
                }
                for endpoint in chunk.endpoints {
                    incoming.put_endpoint(endpoint)?;
                }
                for route in chunk.routes {
                    incoming.routes.insert(route_key(&route), Arc::new(route));
                }
                for policy in chunk.policies {
                    incoming.policies.insert(policy_key(&policy), Arc::new(policy));
                }
                for filter in chunk.http_filters {
                    incoming.http_filters.insert(http_filter_key(&filter), Arc::new(filter));
                }
                for config in chunk.mesh_configs {
                    incoming.mesh_configs.insert(mesh_config_key(&config), Arc::new(config));
                }
                Ok(Applied::SnapshotChunk)
            }
            watch_response::Event::SnapshotComplete(complete) => {
                let version = complete.version.ok_or(ViewError::NoVersion("snapshot complete"))?;
                self.catalog = self.incoming.take().ok_or(ViewError::CompleteWithoutSnapshot)?;
                self.version = Some(version);
                self.filter_id = complete.filter_id;
                Ok(Applied::Snapshot)
            }
            watch_response::Event::Delta(delta) => {
                if self.incoming.is_some() {
                    return Err(ViewError::DeltaDuringSnapshot);
                }
                let version = delta.version.ok_or(ViewError::NoVersion("delta"))?;
                for change in delta.changes {
                    self.catalog
                        .apply_change(change.change.ok_or(ViewError::EmptyChange)?)?;
                }
                self.version = Some(version);
                self.filter_id = delta.filter_id;
                Ok(Applied::Delta)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registrar::v1::{Change, Delta, EndpointRef, Snapshot, SnapshotComplete};

    fn service(name: &str) -> Service {
        Service {
            namespace: "ns".into(),
            name: name.into(),
            vip: "240.240.0.1".into(),
            kubernetes: None,
            external: None,
        }
    }

    fn endpoint(name: &str, address: &str) -> Endpoint {
        Endpoint {
            service: format!("ns/{name}"),
            address: address.into(),
            ..Default::default()
        }
    }

    fn version(seq: u64) -> Option<Version> {
        Some(Version {
            instance: "i".into(),
            seq,
        })
    }

    fn event(e: watch_response::Event) -> WatchResponse {
        WatchResponse { event: Some(e) }
    }

    #[test]
    fn a_snapshot_replaces_the_view_only_when_complete() {
        let mut view = WatchView::default();
        let chunk = Snapshot {
            reset: true,
            services: vec![service("a")],
            endpoints: vec![endpoint("a", "10.0.0.1")],
            ..Default::default()
        };
        assert_eq!(
            view.apply(event(watch_response::Event::Snapshot(chunk))),
            Ok(Applied::SnapshotChunk)
        );
        assert!(
            view.catalog.services.is_empty(),
            "a partial snapshot leaked into the view"
        );
        let complete = SnapshotComplete {
            version: version(3),
            filter_id: 7,
        };
        assert_eq!(
            view.apply(event(watch_response::Event::SnapshotComplete(complete))),
            Ok(Applied::Snapshot)
        );
        assert_eq!(view.catalog.all_endpoints().count(), 1);
        assert_eq!(view.version, version(3));
        assert_eq!(view.resume_from(7), version(3));
        assert_eq!(view.resume_from(8), None, "a view under another filter must not resume");

        let delta = Delta {
            filter_id: 7,
            version: version(4),
            changes: vec![
                Change {
                    change: Some(change::Change::EndpointRemoved(EndpointRef {
                        service: "ns/a".into(),
                        address: "10.0.0.1".into(),
                    })),
                },
                Change {
                    change: Some(change::Change::ServiceRemoved("ns/a".into())),
                },
            ],
        };
        assert_eq!(
            view.apply(event(watch_response::Event::Delta(delta))),
            Ok(Applied::Delta)
        );
        assert_eq!(view.catalog, CatalogView::default());
        assert_eq!(view.version, version(4));
    }

    #[test]
    fn policies_arrive_in_snapshots_and_are_put_and_removed_by_key() {
        let policy = |name: &str| AuthorizationPolicy {
            namespace: "demo".into(),
            name: name.into(),
            ..Default::default()
        };
        let mut view = WatchView::default();
        let chunk = Snapshot {
            reset: true,
            policies: vec![policy("deny-legacy")],
            ..Default::default()
        };
        view.apply(event(watch_response::Event::Snapshot(chunk))).unwrap();
        let complete = SnapshotComplete {
            version: version(1),
            filter_id: 1,
        };
        view.apply(event(watch_response::Event::SnapshotComplete(complete)))
            .unwrap();
        assert_eq!(view.catalog.policies.keys().collect::<Vec<_>>(), ["demo/deny-legacy"]);
        let put = |c| Change { change: Some(c) };
        let delta = Delta {
            filter_id: 1,
            version: version(2),
            changes: vec![
                put(change::Change::PolicyPut(policy("allow-frontend"))),
                put(change::Change::PolicyRemoved("demo/deny-legacy".into())),
            ],
        };
        view.apply(event(watch_response::Event::Delta(delta))).unwrap();
        assert_eq!(
            view.catalog.policies.keys().collect::<Vec<_>>(),
            ["demo/allow-frontend"]
        );
        // Scoped by namespace, not by service: restricting the view keeps them.
        assert_eq!(view.catalog.restricted(|_| false).policies.len(), 1);
    }

    #[test]
    fn a_retained_snapshot_keeps_the_view_but_its_removals_and_is_swapped_in_whole() {
        let mut view = WatchView::default();
        let chunk = Snapshot {
            reset: true,
            services: vec![service("a"), service("b")],
            endpoints: vec![endpoint("a", "10.0.0.1"), endpoint("b", "10.0.0.2")],
            ..Default::default()
        };
        view.apply(event(watch_response::Event::Snapshot(chunk))).unwrap();
        let complete = |seq| SnapshotComplete {
            version: version(seq),
            filter_id: 1,
        };
        view.apply(event(watch_response::Event::SnapshotComplete(complete(1))))
            .unwrap();

        // b changed: removed, then sent whole; a is kept as held.
        let removed = |key: &str| Change {
            change: Some(change::Change::ServiceRemoved(key.into())),
        };
        let reconciled = Snapshot {
            reset: true,
            retain: true,
            removals: vec![removed("ns/b")],
            services: vec![service("b")],
            endpoints: vec![endpoint("b", "10.0.0.3")],
            ..Default::default()
        };
        view.apply(event(watch_response::Event::Snapshot(reconciled))).unwrap();
        assert_eq!(view.catalog.all_endpoints().count(), 2, "staged, not applied yet");
        view.apply(event(watch_response::Event::SnapshotComplete(complete(9))))
            .unwrap();
        let addresses: Vec<_> = view.catalog.all_endpoints().map(|e| e.address.as_str()).collect();
        assert_eq!(addresses, ["10.0.0.1", "10.0.0.3"]);
        assert_eq!(view.version, version(9));

        // A removal that adds is refused, and so are removals after the first chunk.
        let adding = Snapshot {
            reset: true,
            retain: true,
            removals: vec![Change {
                change: Some(change::Change::ServiceAdded(service("c"))),
            }],
            ..Default::default()
        };
        assert_eq!(
            view.apply(event(watch_response::Event::Snapshot(adding))),
            Err(ViewError::NotARemoval("ServiceAdded"))
        );
        let late = Snapshot {
            removals: vec![removed("ns/a")],
            ..Default::default()
        };
        assert_eq!(
            view.apply(event(watch_response::Event::Snapshot(late))),
            Err(ViewError::RemovalsWithoutReset)
        );
    }

    #[test]
    fn protocol_violations_are_errors() {
        let mut view = WatchView::default();
        assert_eq!(view.apply(WatchResponse { event: None }), Err(ViewError::Empty));
        let chunk = Snapshot::default();
        assert_eq!(
            view.apply(event(watch_response::Event::Snapshot(chunk))),
            Err(ViewError::ChunkWithoutReset)
        );
        let delta = Delta {
            filter_id: 0,
            version: version(1),
            changes: vec![Change {
                change: Some(change::Change::EndpointAdded(endpoint("x", "10.0.0.1"))),
            }],
        };
        assert!(matches!(
            view.apply(event(watch_response::Event::Delta(delta))),
            Err(ViewError::UnknownService { .. })
        ));
    }
}
