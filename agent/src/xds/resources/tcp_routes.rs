//! TCP routes (TCPRoute with a Service parent): the backend clusters, with their weights,
//! that a pod's connections to a declared service's TCP port are split over. Envoy's
//! `tcp_proxy` picks one per connection; with mTLS each backend cluster still leaves
//! through the pod's own originate cluster, so the split changes nothing about identity.
//!
//! Consumer routes depend on the caller's namespace, so the splits are computed per pod
//! and kept in its memo: a route change rebuilds only the listeners of the pods it shapes.

use std::collections::{BTreeMap, HashMap};

use aether_api::route::order::winner;

use super::routes::Attached;
use super::{MeshService, is_http};

/// A service port's cluster → the clusters its connections go to, with their weights.
/// A port without a TCP route is absent (its own cluster serves it).
pub type Splits = BTreeMap<String, Vec<(String, u32)>>;

/// Names no cluster: a connection sent here is closed (a backend that is missing, or a
/// route whose backends all weigh 0), as Gateway API rejects such connections.
pub const NO_BACKEND: &str = "tcp-route|no-backend";

/// The splits of the TCP ports of `declared` for a caller in `namespace`.
pub fn splits(
    namespace: &str,
    declared: &[&MeshService],
    attached: &Attached,
    by_key: &HashMap<&str, &MeshService>,
) -> Splits {
    let mut splits = Splits::new();
    if attached.is_empty() {
        return splits;
    }
    for service in declared {
        for (port, _) in service.ports.iter().filter(|(_, p)| !is_http(**p)) {
            let routes = attached.on(service, *port, Some(namespace));
            let Some(route) = winner(&routes) else { continue };
            let backends = route.rules.first().map_or(&[][..], |r| &r.backends[..]);
            let weighted: Vec<(String, u32)> = backends
                .iter()
                .filter(|b| b.weight > 0)
                .map(|b| {
                    let cluster = by_key.get(b.service.as_str()).map_or_else(
                        || NO_BACKEND.to_owned(),
                        |backend| backend.cluster(backend.endpoint_port(b.port)),
                    );
                    (cluster, b.weight)
                })
                .collect();
            splits.insert(service.cluster(*port), weighted);
        }
    }
    splits
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use aether_proto::registry::v1::{
        Endpoint, Port, Protocol, Route, RouteBackend, RouteKind, RouteParent, RouteRule, Service,
    };
    use aether_proto::view::CatalogView;
    use envoy_types::pb::envoy::config::listener::v3::{Listener, filter};
    use envoy_types::pb::envoy::extensions::filters::network::tcp_proxy::v3::{TcpProxy, tcp_proxy};
    use prost::Message;

    use super::NO_BACKEND;
    use crate::pod::LocalPod;
    use crate::xds::resources::routes::tests::{catalog, generated, pod};

    const DB: &str = "db.gamma.aether.internal:5432";
    const DB_V2: &str = "db-v2.gamma.aether.internal:5432";

    fn tcp_route(namespace: &str, name: &str, backends: &[(&str, u32)]) -> Route {
        Route {
            kind: RouteKind::Tcp as i32,
            namespace: namespace.into(),
            name: name.into(),
            parents: vec![RouteParent {
                service: "gamma/db".into(),
                port: 5432,
            }],
            rules: vec![RouteRule {
                backends: backends
                    .iter()
                    .map(|(service, weight)| RouteBackend {
                        service: (*service).into(),
                        port: 5432,
                        weight: *weight,
                        ..Default::default()
                    })
                    .collect(),
                ..Default::default()
            }],
            created_unix_seconds: 1_700_000_000,
            generation: 1,
        }
    }

    /// The test catalog with `gamma/db-v2` (TCP 5432) beside `gamma/db`.
    fn with_db_v2(routes: Vec<Route>) -> CatalogView {
        let mut catalog = catalog(routes);
        let endpoint = Endpoint {
            service: "gamma/db-v2".into(),
            address: "10.1.0.9".into(),
            ports: vec![Port {
                name: String::new(),
                port: 5432,
                protocol: Protocol::Tcp as i32,
            }],
            weight: 1,
            ..Default::default()
        };
        let service = Service {
            namespace: "gamma".into(),
            name: "db-v2".into(),
            vip: "240.240.0.9".into(),
            kubernetes: None,
        };
        catalog.services.insert("gamma/db-v2".into(), service);
        let endpoints = [("10.1.0.9".to_owned(), endpoint)].into_iter().collect();
        catalog.endpoints.insert("gamma/db-v2".into(), Arc::new(endpoints));
        catalog
    }

    fn caller(namespace: &str, name: &str) -> LocalPod {
        let mut pod = pod(namespace, name);
        pod.info
            .annotations
            .insert("config.aether.io/upstreams".into(), "gamma/db".into());
        pod
    }

    /// Where the pod's chain for the db VIP's port sends connections: one cluster, or
    /// the weighted ones.
    fn db_chain(catalog: &CatalogView, pods: &[LocalPod], pod: &LocalPod) -> Vec<(String, u32)> {
        let generated = generated(catalog, pods);
        let name = format!("outbound|{}", pod.id());
        let resource = generated[crate::xds::LISTENER].iter().find(|r| r.name == name).unwrap();
        let listener = Listener::decode(&*resource.body.value).unwrap();
        let chain = (listener.filter_chains.iter())
            .find(|c| {
                let m = c.filter_chain_match.as_ref().unwrap();
                m.destination_port.as_ref().map(|p| p.value) == Some(5432)
            })
            .expect("a chain for the db port");
        let proxy = (chain.filters.iter())
            .find(|f| f.name == "envoy.filters.network.tcp_proxy")
            .and_then(|f| match &f.config_type {
                Some(filter::ConfigType::TypedConfig(any)) => TcpProxy::decode(&*any.value).ok(),
                _ => None,
            })
            .expect("a tcp_proxy");
        match proxy.cluster_specifier.unwrap() {
            tcp_proxy::ClusterSpecifier::Cluster(cluster) => vec![(cluster, 0)],
            tcp_proxy::ClusterSpecifier::WeightedClusters(weighted) => {
                weighted.clusters.into_iter().map(|c| (c.name, c.weight)).collect()
            }
        }
    }

    fn split(pairs: &[(&str, u32)]) -> Vec<(String, u32)> {
        pairs.iter().map(|(c, w)| ((*c).to_owned(), *w)).collect()
    }

    #[test]
    fn a_tcp_route_splits_a_declared_ports_connections_by_weight() {
        let web = caller("gamma", "web-1");
        let pods = [web.clone()];
        assert_eq!(db_chain(&with_db_v2(Vec::new()), &pods, &web), split(&[(DB, 0)]));
        let route = tcp_route("gamma", "split", &[("gamma/db", 80), ("gamma/db-v2", 20)]);
        let catalog = with_db_v2(vec![route]);
        assert_eq!(db_chain(&catalog, &pods, &web), split(&[(DB, 80), (DB_V2, 20)]));
    }

    #[test]
    fn a_consumer_tcp_route_applies_to_its_namespace_only() {
        let (web, shop) = (caller("gamma", "web-1"), caller("shop", "cart-1"));
        let pods = [web.clone(), shop.clone()];
        let producer = tcp_route("gamma", "split", &[("gamma/db", 50), ("gamma/db-v2", 50)]);
        let consumer = tcp_route("shop", "pin-v2", &[("gamma/db-v2", 1)]);
        let catalog = with_db_v2(vec![producer, consumer]);
        assert_eq!(db_chain(&catalog, &pods, &web), split(&[(DB, 50), (DB_V2, 50)]));
        assert_eq!(db_chain(&catalog, &pods, &shop), split(&[(DB_V2, 0)]));
    }

    #[test]
    fn missing_and_zero_weight_backends_reject_their_share() {
        let web = caller("gamma", "web-1");
        let pods = [web.clone()];
        let route = tcp_route(
            "gamma",
            "split",
            &[("gamma/db", 3), ("gamma/gone", 1), ("gamma/db-v2", 0)],
        );
        let catalog = with_db_v2(vec![route]);
        assert_eq!(db_chain(&catalog, &pods, &web), split(&[(DB, 3), (NO_BACKEND, 1)]));
        let nothing = tcp_route("gamma", "split", &[("gamma/db-v2", 0)]);
        assert_eq!(
            db_chain(&with_db_v2(vec![nothing]), &pods, &web),
            split(&[(NO_BACKEND, 0)])
        );
    }

    #[test]
    fn the_oldest_of_two_tcp_routes_on_a_port_wins() {
        let web = caller("gamma", "web-1");
        let pods = [web.clone()];
        let mut newer = tcp_route("gamma", "a-newer", &[("gamma/db", 1)]);
        newer.created_unix_seconds += 60;
        let older = tcp_route("gamma", "z-older", &[("gamma/db-v2", 1)]);
        let catalog = with_db_v2(vec![newer, older]);
        assert_eq!(db_chain(&catalog, &pods, &web), split(&[(DB_V2, 0)]));
    }

    #[test]
    fn tcp_routes_leave_the_http_route_tables_alone() {
        let pods = [caller("gamma", "web-1")];
        let tables = |catalog: &CatalogView| {
            let generated = generated(catalog, &pods);
            let bodies = |kind: &str| -> Vec<(String, Vec<u8>)> {
                (generated[kind].iter())
                    .map(|r| (r.name.clone(), r.body.value.clone()))
                    .collect()
            };
            (bodies(crate::xds::ROUTE), bodies(crate::xds::VIRTUAL_HOST))
        };
        let mut all_ports = tcp_route("gamma", "split", &[("gamma/db-v2", 1)]);
        all_ports.parents[0] = RouteParent {
            service: "gamma/echo".into(),
            port: 0,
        };
        assert_eq!(tables(&with_db_v2(vec![all_ports])), tables(&with_db_v2(Vec::new())));
    }
}
