//! TCP and TLS routes (TCPRoute and TLSRoute with a Service parent): where a pod's
//! connections to a declared service's TCP port go. A TLS route with hostnames takes the
//! connections whose ClientHello names one of them (Envoy's `server_names` chain match, the
//! TLS inspector reading the app's own TLS, never terminating it); every other connection
//! takes the oldest TCP route (or TLS route without hostnames), else the service's own
//! cluster. Envoy's `tcp_proxy` picks a backend per connection by weight; with mTLS each
//! backend cluster still leaves through the pod's own originate cluster, so routing
//! changes nothing about identity.
//!
//! Consumer routes depend on the caller's namespace, so the routes are resolved per pod
//! and kept in its memo: a route change rebuilds only the listeners of the pods it shapes.

use std::collections::{BTreeMap, HashMap};

use aether_api::route::order::oldest_first;
use aether_proto::registry::v1::{Route, RouteKind};

use super::routes::Attached;
use super::{MeshService, is_http};

/// Backend clusters with their weights.
pub type Backends = Vec<(String, u32)>;

/// How routes shape one service port's connections.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PortRoutes {
    /// By server name: each name once, taken by the oldest route that lists it.
    pub by_server_name: Vec<(Vec<String>, Backends)>,
    /// Every other connection; `None`: the service port's own cluster.
    pub otherwise: Option<Backends>,
}

/// A service port's cluster → how routes shape its connections. A port no route shapes
/// is absent.
pub type Splits = BTreeMap<String, PortRoutes>;

/// Names no cluster: a connection sent here is closed (a backend that is missing, or a
/// route whose backends all weigh 0), as Gateway API rejects such connections.
pub const NO_BACKEND: &str = "tcp-route|no-backend";

/// The routes of the TCP ports of `declared` for a caller in `namespace`.
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
            let mut routes = attached.on(service, *port, Some(namespace));
            if routes.is_empty() {
                continue;
            }
            oldest_first(&mut routes);
            let mut shaped = PortRoutes::default();
            let mut claimed: Vec<&str> = Vec::new();
            for route in routes {
                let sni = route.kind() == RouteKind::Tls && !route.hostnames.is_empty();
                if !sni {
                    shaped.otherwise.get_or_insert_with(|| backends(route, by_key));
                    continue;
                }
                let names: Vec<String> = (route.hostnames.iter())
                    .filter(|h| !claimed.contains(&h.as_str()))
                    .cloned()
                    .collect();
                if !names.is_empty() {
                    claimed.extend(route.hostnames.iter().map(String::as_str));
                    shaped.by_server_name.push((names, backends(route, by_key)));
                }
            }
            splits.insert(service.cluster(*port), shaped);
        }
    }
    splits
}

/// The route's live backends as clusters (a missing one as [`NO_BACKEND`]).
fn backends(route: &Route, by_key: &HashMap<&str, &MeshService>) -> Backends {
    let backends = route.rules.first().map_or(&[][..], |r| &r.backends[..]);
    (backends.iter())
        .filter(|b| b.weight > 0)
        .map(|b| {
            let cluster = by_key.get(b.service.as_str()).map_or_else(
                || NO_BACKEND.to_owned(),
                |backend| backend.cluster(backend.endpoint_port(b.port)),
            );
            (cluster, b.weight)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use aether_proto::registry::v1::{
        Endpoint, Port, Protocol, Route, RouteBackend, RouteKind, RouteParent, RouteRule, Service,
    };
    use aether_proto::view::CatalogView;
    use envoy_types::pb::envoy::config::listener::v3::{FilterChain, Listener, filter};
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
            hostnames: Vec::new(),
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
            external: None,
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

    fn outbound(catalog: &CatalogView, pods: &[LocalPod], pod: &LocalPod) -> Listener {
        let generated = generated(catalog, pods);
        let name = format!("outbound|{}", pod.id());
        let resource = generated[crate::xds::LISTENER].iter().find(|r| r.name == name).unwrap();
        Listener::decode(&*resource.body.value).unwrap()
    }

    /// The pod's chains for the db VIP's port: their server names and where each sends
    /// connections (one cluster, or the weighted ones).
    fn db_chains(listener: &Listener) -> Vec<(Vec<String>, super::Backends)> {
        (listener.filter_chains.iter())
            .filter(|c| {
                let m = c.filter_chain_match.as_ref().unwrap();
                m.destination_port.as_ref().map(|p| p.value) == Some(5432)
            })
            .map(|c| (c.filter_chain_match.clone().unwrap().server_names, proxied(c)))
            .collect()
    }

    /// Where the pod's chain for the db VIP's port without a server name sends connections.
    fn db_chain(catalog: &CatalogView, pods: &[LocalPod], pod: &LocalPod) -> Vec<(String, u32)> {
        let chains = db_chains(&outbound(catalog, pods, pod));
        let (_, otherwise) = chains.into_iter().find(|(names, _)| names.is_empty()).unwrap();
        otherwise
    }

    fn proxied(chain: &FilterChain) -> Vec<(String, u32)> {
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

    fn tls_route(name: &str, created: i64, hostnames: &[&str], backend: &str) -> Route {
        let mut route = tcp_route("gamma", name, &[(backend, 1)]);
        route.kind = RouteKind::Tls as i32;
        route.created_unix_seconds = created;
        route.hostnames = hostnames.iter().map(|h| (*h).to_owned()).collect();
        route
    }

    #[test]
    fn tls_routes_choose_by_server_name_and_the_rest_keeps_its_route() {
        let web = caller("gamma", "web-1");
        let pods = [web.clone()];
        let by_sni = tls_route("by-sni", 10, &["v2.example.com", "*.eu.example.com"], "gamma/db-v2");
        // Younger, and its first name is taken: it keeps the one that is not.
        let later = tls_route("later", 20, &["v2.example.com", "v1.example.com"], "gamma/db");
        let tcp = tcp_route("gamma", "rest", &[("gamma/db", 1), ("gamma/db-v2", 1)]);
        let listener = outbound(&with_db_v2(vec![by_sni, later, tcp]), &pods, &web);
        let names = |n: &[&str]| n.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
        assert_eq!(
            db_chains(&listener),
            [
                (names(&["v2.example.com", "*.eu.example.com"]), split(&[(DB_V2, 0)])),
                (names(&["v1.example.com"]), split(&[(DB, 0)])),
                (Vec::new(), split(&[(DB, 1), (DB_V2, 1)])),
            ]
        );
        // The TLS inspector runs after the original destination is restored, and only on
        // the port that routes by server name.
        let filters: Vec<&str> = listener.listener_filters.iter().map(|f| f.name.as_str()).collect();
        assert_eq!(
            filters,
            [
                "envoy.filters.listener.original_dst",
                "envoy.filters.listener.tls_inspector"
            ]
        );
        let disabled = format!("{:?}", listener.listener_filters[1].filter_disabled);
        assert!(
            disabled.contains("NotMatch") && disabled.contains("start: 5432, end: 5433"),
            "{disabled}"
        );
        // Without a TLS route, no inspector.
        let plain = outbound(&with_db_v2(Vec::new()), &pods, &web);
        assert_eq!(plain.listener_filters.len(), 1);
    }
}
