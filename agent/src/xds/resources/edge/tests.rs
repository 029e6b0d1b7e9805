//! The edge's resources as the generator makes them from a projected Gateway.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::SystemTime;

use aether_api::edge::{AttachedRoute, Certificate, Edge, EdgeListener, EdgePort, ListenerProtocol};
use aether_proto::registry::v1::{MatchType, Route, RouteKind};
use envoy_types::pb::envoy::config::cluster::v3::Cluster;
use envoy_types::pb::envoy::config::listener::v3::Listener;
use envoy_types::pb::envoy::config::route::v3::RouteConfiguration;
use envoy_types::pb::envoy::extensions::filters::network::tcp_proxy::v3::{TcpProxy, tcp_proxy};
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::{DownstreamTlsContext, UpstreamTlsContext};
use prost::Message;

use super::{EdgeInputs, backend_services, generate};
use crate::identity::{Identities, PrivateKey, Svid};
use crate::xds::resources::Generated;
use crate::xds::resources::routes::tests::{DOMAIN, catalog, http_route, path, rule};
use crate::xds::resources::transport::Mtls;

const EDGE_ID: &str = "edge/test-edge";

fn attached(route: Route, hostnames: &[&str]) -> AttachedRoute {
    AttachedRoute {
        route: Route {
            parents: Vec::new(),
            ..route
        },
        hostnames: hostnames.iter().map(|h| h.to_string()).collect(),
    }
}

fn listener(name: &str, hostname: Option<&str>, routes: Vec<AttachedRoute>) -> EdgeListener {
    EdgeListener {
        name: name.into(),
        hostname: hostname.map(str::to_owned),
        certificates: Vec::new(),
        routes,
    }
}

fn edge(ports: Vec<EdgePort>) -> Edge {
    Edge {
        gateway: "edge/edge".into(),
        generation: 1,
        ports,
        status: Default::default(),
    }
}

fn identities(with_svid: bool) -> Identities {
    let svid = Svid {
        spiffe_id: "spiffe://td/ns/edge/sa/edge".into(),
        cert_chain_pem: "CHAIN".into(),
        key: PrivateKey::new("KEY".into()),
        not_before: SystemTime::UNIX_EPOCH,
        not_after: SystemTime::UNIX_EPOCH,
        serial: "01".into(),
    };
    let mut svids = BTreeMap::new();
    if with_svid {
        svids.insert(EDGE_ID.to_owned(), Arc::new(svid.clone()));
    }
    // Another identity the process may hold must never reach the edge's Envoy.
    svids.insert("demo/someone-else".to_owned(), Arc::new(svid));
    Identities {
        trust_domain: "td".into(),
        svids,
        bundles: BTreeMap::from([("td".to_owned(), "BUNDLE".to_owned())]),
    }
}

fn build(edge: &Edge, with_svid: bool) -> Generated {
    let catalog = catalog(Vec::new());
    let mtls = Mtls {
        trust_domain: "td".into(),
    };
    generate(&EdgeInputs {
        edge,
        catalog: &catalog,
        mesh_domain: DOMAIN,
        bind_address: "127.0.0.9",
        port_offset: 10000,
        mtls: Some(&mtls),
        identities: &identities(with_svid),
        identity_id: EDGE_ID,
    })
}

fn decoded<T: Message + Default>(generated: &Generated, type_url: &str, name: &str) -> T {
    let resource = generated[type_url]
        .iter()
        .find(|r| r.name == name)
        .unwrap_or_else(|| panic!("no {name} among {:?}", names(generated, type_url)));
    T::decode(&*resource.body.value).unwrap()
}

fn names(generated: &Generated, type_url: &str) -> Vec<String> {
    generated[type_url].iter().map(|r| r.name.clone()).collect()
}

fn http_port(listeners: Vec<EdgeListener>) -> EdgePort {
    EdgePort {
        port: 80,
        protocol: ListenerProtocol::Http,
        listeners,
    }
}

#[test]
fn an_http_port_is_one_listener_and_one_table_routing_to_mesh_clusters_with_the_gateways_identity() {
    let mut to_v1 = rule(vec![path(MatchType::PathPrefix, "/v1")], &[("gamma/echo-v1", 1)]);
    to_v1.backends[0].port = 80;
    let mut to_missing = rule(vec![path(MatchType::PathPrefix, "/gone")], &[("gamma/missing", 1)]);
    to_missing.backends[0].port = 80;
    let route = http_route("web", vec![to_v1, to_missing]);
    let edge = edge(vec![http_port(vec![listener(
        "http",
        None,
        vec![attached(route, &["www.example.com"])],
    )])]);
    let generated = build(&edge, true);

    let listener: Listener = decoded(&generated, crate::xds::LISTENER, "edge|80");
    let bound = format!("{:?}", listener.address);
    assert!(bound.contains("127.0.0.9") && bound.contains("10080"), "{bound}");
    let table: RouteConfiguration = decoded(&generated, crate::xds::ROUTE, "edge|80");
    let domains: Vec<&str> = table.virtual_hosts.iter().map(|v| v.domains[0].as_str()).collect();
    assert_eq!(domains, ["*", "www.example.com"]);
    let www = &table.virtual_hosts[1];
    assert_eq!(www.routes.len(), 3, "two rules and the 404: {www:?}");

    // Only the backend the catalog holds has a cluster; the other answers 500 (cluster not found).
    assert_eq!(
        names(&generated, crate::xds::CLUSTER),
        ["echo-v1.gamma.aether.internal:80"]
    );
    let cluster: Cluster = decoded(&generated, crate::xds::CLUSTER, "echo-v1.gamma.aether.internal:80");
    let socket = cluster.transport_socket.expect("mTLS to the mesh");
    let tls = UpstreamTlsContext::decode(&*socket_config(&socket)).unwrap();
    let common = tls.common_tls_context.unwrap();
    assert_eq!(common.alpn_protocols, ["h2"]);
    assert_eq!(
        common.tls_certificate_sds_secret_configs[0].name,
        format!("svid|{EDGE_ID}")
    );
    let pinned = format!("{:?}", common.validation_context_type);
    assert!(pinned.contains("spiffe://td/ns/gamma/sa/echo-v1"), "{pinned}");
    assert_eq!(
        names(&generated, crate::xds::ENDPOINT),
        ["echo-v1.gamma.aether.internal:80"]
    );

    // Its own SVID and the bundle; no other identity of the process.
    assert_eq!(
        names(&generated, crate::xds::SECRET),
        ["spiffe://td", "svid|edge/test-edge"]
    );
    assert_eq!(
        backend_services(&edge).into_iter().collect::<Vec<_>>(),
        ["gamma/echo-v1", "gamma/missing"]
    );
}

#[test]
fn without_its_svid_the_edge_opens_no_connection_into_the_mesh() {
    let mut to_v1 = rule(Vec::new(), &[("gamma/echo-v1", 1)]);
    to_v1.backends[0].port = 80;
    let edge = edge(vec![http_port(vec![listener(
        "http",
        None,
        vec![attached(http_route("web", vec![to_v1]), &[])],
    )])]);
    let generated = build(&edge, false);
    assert!(names(&generated, crate::xds::CLUSTER).is_empty());
    assert_eq!(names(&generated, crate::xds::LISTENER), ["edge|80"]);
}

#[test]
fn an_https_port_has_a_chain_per_listener_picked_by_sni_with_its_certificates() {
    let certificate = |name: &str| Certificate {
        chain_pem: format!("CHAIN-{name}"),
        key_pem: format!("KEY-{name}"),
        dns_names: vec![format!("*.{name}")],
        not_after_unix: 0,
    };
    let mut com = listener("com", Some("*.example.com"), Vec::new());
    com.certificates = vec![("edge/com".into(), certificate("example.com"))];
    let mut any = listener("any", None, Vec::new());
    any.certificates = vec![
        ("edge/com".into(), certificate("example.com")),
        ("edge/org".into(), certificate("example.org")),
    ];
    let edge = edge(vec![EdgePort {
        port: 443,
        protocol: ListenerProtocol::Https,
        listeners: vec![com, any],
    }]);
    let generated = build(&edge, true);
    let listener: Listener = decoded(&generated, crate::xds::LISTENER, "edge|443");
    assert_eq!(
        listener.listener_filters[0].name,
        "envoy.filters.listener.tls_inspector"
    );
    let chains: Vec<(Vec<String>, String)> = listener
        .filter_chains
        .iter()
        .map(|c| {
            let names = c
                .filter_chain_match
                .as_ref()
                .map(|m| m.server_names.clone())
                .unwrap_or_default();
            (names, c.name.clone())
        })
        .collect();
    assert_eq!(
        chains,
        [
            (vec!["*.example.com".to_owned()], "https|com".to_owned()),
            (Vec::new(), "https|any".to_owned())
        ]
    );
    let tls = DownstreamTlsContext::decode(&*socket_config(
        listener.filter_chains[1].transport_socket.as_ref().unwrap(),
    ))
    .unwrap();
    let secrets: Vec<String> = (tls
        .common_tls_context
        .unwrap()
        .tls_certificate_sds_secret_configs
        .into_iter())
    .map(|s| s.name)
    .collect();
    assert_eq!(secrets, ["edge-cert|edge/com", "edge-cert|edge/org"]);
    assert_eq!(
        names(&generated, crate::xds::SECRET),
        [
            "edge-cert|edge/com",
            "edge-cert|edge/org",
            "spiffe://td",
            "svid|edge/test-edge"
        ]
    );
    assert_eq!(names(&generated, crate::xds::ROUTE), ["edge|443|any", "edge|443|com"]);
}

#[test]
fn tls_passthrough_routes_pick_their_chain_by_sni_and_split_connections() {
    let mut route = http_route("db", vec![rule(Vec::new(), &[("gamma/db", 3), ("gamma/echo", 1)])]);
    route.kind = RouteKind::Tls as i32;
    for backend in &mut route.rules[0].backends {
        backend.port = 5432;
    }
    let edge = edge(vec![EdgePort {
        port: 8443,
        protocol: ListenerProtocol::Tls,
        listeners: vec![listener("tls", None, vec![attached(route, &["db.example.com"])])],
    }]);
    let generated = build(&edge, true);
    let listener: Listener = decoded(&generated, crate::xds::LISTENER, "edge|8443");
    let chain = &listener.filter_chains[0];
    assert_eq!(
        chain.filter_chain_match.as_ref().unwrap().server_names,
        ["db.example.com"]
    );
    assert!(
        chain.transport_socket.is_none(),
        "passthrough: the edge never terminates it"
    );
    let proxy = TcpProxy::decode(&*filter_config(&chain.filters[0])).unwrap();
    let Some(tcp_proxy::ClusterSpecifier::WeightedClusters(split)) = proxy.cluster_specifier else {
        panic!("{proxy:?}");
    };
    let weights: Vec<(String, u32)> = split.clusters.into_iter().map(|c| (c.name, c.weight)).collect();
    assert_eq!(
        weights,
        [
            ("db.gamma.aether.internal:5432".to_owned(), 3),
            ("echo.gamma.aether.internal:5432".to_owned(), 1)
        ]
    );
    // The TCP cluster names the app port to the peer by SNI.
    let cluster: Cluster = decoded(&generated, crate::xds::CLUSTER, "db.gamma.aether.internal:5432");
    let tls = UpstreamTlsContext::decode(&*socket_config(cluster.transport_socket.as_ref().unwrap())).unwrap();
    assert_eq!(tls.sni, "port-5432.aether");
}

fn socket_config(socket: &envoy_types::pb::envoy::config::core::v3::TransportSocket) -> Vec<u8> {
    match &socket.config_type {
        Some(envoy_types::pb::envoy::config::core::v3::transport_socket::ConfigType::TypedConfig(any)) => {
            any.value.clone()
        }
        None => Vec::new(),
    }
}

fn filter_config(filter: &envoy_types::pb::envoy::config::listener::v3::Filter) -> Vec<u8> {
    match &filter.config_type {
        Some(envoy_types::pb::envoy::config::listener::v3::filter::ConfigType::TypedConfig(any)) => any.value.clone(),
        _ => Vec::new(),
    }
}
