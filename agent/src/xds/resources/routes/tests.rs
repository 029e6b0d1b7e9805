//! The route tables as the generator makes them from a catalog with routes: precedence,
//! every match, filter, timeout and retry mapping, consumer tables, and the table
//! without routes unchanged.

mod captured;
mod compiled;
mod envoy;
mod service_ports;

use std::collections::BTreeMap;
use std::sync::Arc;

use aether_proto::registry::v1::{
    Endpoint, Header, HeaderModifier, Locality, MatchType, Mirror, PathMatch, PathModifier, Port, Protocol, Redirect,
    Route, RouteBackend, RouteFilter, RouteKind, RouteMatch, RouteParent, RouteRetry, RouteRule, Service, UrlRewrite,
    ValueMatch, path_modifier, route_filter,
};
use aether_proto::view::CatalogView;
use envoy_types::pb::envoy::config::listener::v3::Listener;
use envoy_types::pb::envoy::config::route::v3::{RouteAction, RouteConfiguration, VirtualHost, route, route_action};
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::{
    HttpConnectionManager, http_connection_manager,
};
use prost::Message;

use crate::pod::{LocalPod, PodInfo};
use crate::xds::resources::{Generated, Inputs, generate};

pub const DOMAIN: &str = "aether.internal";

/// `echo`, `echo-v1`, `echo-v2` in `gamma` (HTTP 80 and gRPC 9000), `db` (TCP 5432).
pub fn catalog(routes: Vec<Route>) -> CatalogView {
    let mut catalog = CatalogView::default();
    let services: [(&str, &[(u32, Protocol)]); 4] = [
        ("gamma/echo", &[(80, Protocol::Http), (9000, Protocol::Grpc)]),
        ("gamma/echo-v1", &[(80, Protocol::Http), (9000, Protocol::Grpc)]),
        ("gamma/echo-v2", &[(80, Protocol::Http), (9000, Protocol::Grpc)]),
        ("gamma/db", &[(5432, Protocol::Tcp)]),
    ];
    for (i, (key, ports)) in services.into_iter().enumerate() {
        let (namespace, name) = key.split_once('/').unwrap();
        let service = Service {
            namespace: namespace.into(),
            name: name.into(),
            vip: format!("240.240.0.{}", i + 1),
            kubernetes: None,
            external: None,
        };
        let address = format!("10.1.0.{}", i + 1);
        let endpoint = Endpoint {
            service: key.into(),
            address: address.clone(),
            ports: ports
                .iter()
                .map(|(port, protocol)| Port {
                    name: String::new(),
                    port: *port,
                    protocol: *protocol as i32,
                })
                .collect(),
            weight: 1,
            ..Default::default()
        };
        catalog.services.insert(key.into(), service);
        catalog
            .endpoints
            .insert(key.into(), Arc::new(BTreeMap::from([(address, endpoint)])));
    }
    for route in routes {
        catalog
            .routes
            .insert(aether_proto::view::route_key(&route), Arc::new(route));
    }
    catalog
}

pub fn pod(namespace: &str, name: &str) -> LocalPod {
    LocalPod {
        container_id: format!("c-{name}"),
        listener_sockets: Default::default(),
        netns: format!("/run/aether/netns/{name}").into(),
        ips: vec!["10.2.0.1".parse().unwrap()],
        info: PodInfo {
            namespace: namespace.into(),
            name: name.into(),
            annotations: BTreeMap::from([("config.aether.io/upstreams".into(), "gamma/echo".into())]),
            ..Default::default()
        },
    }
}

pub fn generated(catalog: &CatalogView, pods: &[LocalPod]) -> Generated {
    let locality = Locality::default();
    let on_demand = BTreeMap::new();
    generate(&Inputs {
        pods,
        catalog,
        mesh_domain: DOMAIN,
        locality: &locality,
        on_demand: &on_demand,
        own_only: &Default::default(),
    })
}

/// The route tables generated for `routes`, by name.
fn tables(routes: Vec<Route>, pods: &[LocalPod]) -> BTreeMap<String, RouteConfiguration> {
    served_tables(&generated(&catalog(routes), pods))
}

/// The route tables as Envoy runs them, by name: an outbound table with its VHDS
/// virtual hosts inline (as a state-of-the-world Envoy is sent it).
pub(crate) fn served_tables(generated: &Generated) -> BTreeMap<String, RouteConfiguration> {
    let vhosts = &generated[crate::xds::VIRTUAL_HOST];
    (generated[crate::xds::ROUTE].iter())
        .map(|table| {
            let prefix = format!("{}/", table.name);
            let own = vhosts.iter().filter(|v| v.name.starts_with(&prefix)).map(|v| &v.body);
            let served = super::with_virtual_hosts_inline(&table.body, own);
            (table.name.clone(), RouteConfiguration::decode(&*served.value).unwrap())
        })
        .collect()
}

/// The virtual host `name` in `table`: a service port's (`<svc>.<ns>.<domain>:<port>`,
/// served as `<table>/<svc>.<ns>.<domain>:<port>`) or one of the table's own.
pub(crate) fn vhost<'a>(table: &'a RouteConfiguration, name: &str) -> &'a VirtualHost {
    let served = format!("{}/{name}", table.name);
    table
        .virtual_hosts
        .iter()
        .find(|v| v.name == served || v.name == name)
        .unwrap_or_else(|| panic!("no virtual host {name}"))
}

/// The routes of echo:80 in the shared table.
fn echo_routes(routes: Vec<Route>) -> Vec<envoy_types::pb::envoy::config::route::v3::Route> {
    let tables = tables(routes, &[]);
    vhost(&tables["outbound"], "echo.gamma.aether.internal:80")
        .routes
        .clone()
}

pub fn http_route(name: &str, rules: Vec<RouteRule>) -> Route {
    Route {
        kind: RouteKind::Http as i32,
        namespace: "gamma".into(),
        name: name.into(),
        parents: vec![RouteParent {
            service: "gamma/echo".into(),
            port: 0,
        }],
        rules,
        created_unix_seconds: 1_700_000_000,
        generation: 1,
        hostnames: Vec::new(),
    }
}

pub fn rule(matches: Vec<RouteMatch>, backends: &[(&str, u32)]) -> RouteRule {
    RouteRule {
        matches,
        backends: backends.iter().map(|(s, w)| backend(s, *w)).collect(),
        ..Default::default()
    }
}

pub fn backend(service: &str, weight: u32) -> RouteBackend {
    RouteBackend {
        service: service.into(),
        port: 0,
        weight,
        filters: Vec::new(),
    }
}

pub fn path(kind: MatchType, value: &str) -> RouteMatch {
    RouteMatch {
        path: Some(PathMatch {
            r#type: kind as i32,
            value: value.into(),
        }),
        ..Default::default()
    }
}

pub fn value(name: &str, value: &str) -> ValueMatch {
    ValueMatch {
        name: name.into(),
        r#type: MatchType::Exact as i32,
        value: value.into(),
    }
}

pub fn filter(filter: route_filter::Filter) -> RouteFilter {
    RouteFilter { filter: Some(filter) }
}

fn names(routes: &[envoy_types::pb::envoy::config::route::v3::Route]) -> Vec<&str> {
    routes.iter().map(|r| r.name.as_str()).collect()
}

fn forward(route: &envoy_types::pb::envoy::config::route::v3::Route) -> &route_action::ClusterSpecifier {
    match &route.action {
        Some(route::Action::Route(action)) => action.cluster_specifier.as_ref().unwrap(),
        other => panic!("not forwarded: {other:?}"),
    }
}

fn route_action_of(route: &envoy_types::pb::envoy::config::route::v3::Route) -> &RouteAction {
    match &route.action {
        Some(route::Action::Route(action)) => action,
        other => panic!("not forwarded: {other:?}"),
    }
}

/// The HTTP connection manager of a listener chain.
fn hcm_of(chain: &envoy_types::pb::envoy::config::listener::v3::FilterChain) -> HttpConnectionManager {
    let filter = chain.filters.last().unwrap();
    let Some(envoy_types::pb::envoy::config::listener::v3::filter::ConfigType::TypedConfig(any)) = &filter.config_type
    else {
        panic!("{filter:?}")
    };
    HttpConnectionManager::decode(&*any.value).unwrap()
}

/// The RDS table a listener chain's HTTP goes through.
fn rds_of(chain: &envoy_types::pb::envoy::config::listener::v3::FilterChain) -> String {
    let Some(http_connection_manager::RouteSpecifier::Rds(rds)) = hcm_of(chain).route_specifier else {
        panic!("no RDS")
    };
    rds.route_config_name
}

/// A node's generator builds a service's virtual hosts once: a new dependency builds its
/// own and reuses the others' resources (not re-encoded), a changed one is rebuilt, and
/// the tables are what a fresh build makes.
#[test]
fn a_new_dependency_builds_only_its_own_virtual_hosts() {
    let locality = Locality::default();
    let on_demand = BTreeMap::new();
    let mut generator = crate::xds::resources::Generator::default();
    let mut generate = |catalog: &CatalogView| {
        generator.generate(&Inputs {
            pods: &[],
            catalog,
            mesh_domain: DOMAIN,
            locality: &locality,
            on_demand: &on_demand,
            own_only: &Default::default(),
        })[crate::xds::VIRTUAL_HOST]
            .clone()
    };
    let by_name = |vhosts: &[Arc<crate::xds::cache::Resource>]| -> BTreeMap<String, Arc<crate::xds::cache::Resource>> {
        vhosts.iter().map(|v| (v.name.clone(), v.clone())).collect()
    };
    let mut catalog = catalog(Vec::new());
    let before = by_name(&generate(&catalog));

    // A new service whose VIP is echo's: the address stays with echo (the first by key).
    let mut newcomer = catalog.services["gamma/echo"].clone();
    newcomer.name = "zeta".into();
    catalog.services.insert("gamma/zeta".into(), newcomer);
    let mut endpoints = (*catalog.endpoints["gamma/echo"]).clone();
    for endpoint in endpoints.values_mut() {
        endpoint.service = "gamma/zeta".into();
    }
    catalog.endpoints.insert("gamma/zeta".into(), Arc::new(endpoints));
    let after = by_name(&generate(&catalog));
    // (The catch-all is built with its table.)
    let services_hosts =
        |m: &BTreeMap<String, Arc<crate::xds::cache::Resource>>| -> Vec<(String, Arc<crate::xds::cache::Resource>)> {
            m.iter()
                .filter(|(n, _)| !n.ends_with("/mesh-on-demand"))
                .map(|(n, v)| (n.clone(), v.clone()))
                .collect()
        };
    for (name, vhost) in services_hosts(&before) {
        assert!(Arc::ptr_eq(&vhost, &after[&name]), "{name} was built again");
    }
    let zeta: Vec<&String> = after.keys().filter(|n| n.contains("zeta")).collect();
    assert_eq!(
        zeta,
        [
            "outbound/zeta.gamma.aether.internal:80",
            "outbound/zeta.gamma.aether.internal:9000"
        ]
    );
    let fresh = by_name(&generated(&catalog, &[])[crate::xds::VIRTUAL_HOST]);
    let versions = |m: &BTreeMap<String, Arc<crate::xds::cache::Resource>>| -> Vec<(String, String)> {
        m.values().map(|v| (v.name.clone(), v.version.clone())).collect()
    };
    assert_eq!(versions(&after), versions(&fresh), "the memo changed the tables");
    let table = &served_tables(&generated(&catalog, &[]))["outbound"];
    let zeta_domains = &vhost(table, "zeta.gamma.aether.internal:80").domains;
    assert!(!zeta_domains.contains(&"240.240.0.1:80".to_owned()), "{zeta_domains:?}");

    // A service that changed (its VIP) is built again; the others are not.
    catalog.services.get_mut("gamma/echo-v1").unwrap().vip = "240.240.9.9".into();
    let changed = by_name(&generate(&catalog));
    for (name, vhost) in services_hosts(&after) {
        let rebuilt = name.contains("echo-v1.");
        assert_eq!(vhost.version == changed[&name].version, !rebuilt, "{name}");
        // (zeta loses echo's address again in each build: not the memo's.)
        if !name.contains("zeta") {
            assert_eq!(Arc::ptr_eq(&vhost, &changed[&name]), !rebuilt, "{name}");
        }
    }
}
