//! Gateway API ports are Service ports: with a Kubernetes Service, a parentRef's port
//! attaches to the endpoint port it targets and a backendRef's names the cluster of its
//! target; without one (or for a port the Service does not map) a port is the endpoint
//! port, as before.

use aether_proto::registry::v1::Mirror;

use super::captured::{generated_with, tables_of, with_cluster_ips, with_service_ports};
use super::*;

/// `echo` with Service port 8000 → 80 and `echo-v1` with 9080 → 80 (`echo-v2`: no Service).
fn catalog_with_service_ports(routes: Vec<Route>) -> CatalogView {
    let ips: [(&str, &[&str]); 2] = [("gamma/echo", &["10.96.0.10"]), ("gamma/echo-v1", &["10.96.0.11"])];
    let mut catalog = with_cluster_ips(routes, &ips);
    with_service_ports(
        &mut catalog,
        "gamma/echo",
        &[("web", 8000, 80, ""), ("grpc", 7070, 0, "grpc")],
    );
    with_service_ports(&mut catalog, "gamma/echo-v1", &[("alt", 9080, 80, "")]);
    catalog
}

fn on_port(route: &mut Route, port: u32) {
    route.parents[0].port = port;
}

fn with_port(service: &str, port: u32) -> RouteBackend {
    RouteBackend {
        port,
        ..backend(service, 1)
    }
}

#[test]
fn a_parent_port_attaches_to_the_endpoint_port_its_service_port_targets() {
    let mut pin = http_route("pin", vec![rule(Vec::new(), &[("gamma/echo-v1", 1)])]);
    on_port(&mut pin, 8000);
    let tables = tables_of(&generated_with(&catalog_with_service_ports(vec![pin]), &[]));
    let table = &tables["outbound"];
    let http = vhost(table, "echo.gamma.aether.internal:80");
    assert!(
        http.domains.contains(&"10.96.0.10:8000".to_owned()),
        "{:?}",
        http.domains
    );
    assert_eq!(names(&http.routes)[0], "http/gamma/pin/0");
    // Port 9000 (Service port 7070) keeps its default route.
    let grpc = vhost(table, "echo.gamma.aether.internal:9000");
    assert!(names(&grpc.routes).iter().all(|n| n.is_empty()), "{:?}", grpc.routes);
}

#[test]
fn a_parent_port_the_service_does_not_map_is_the_endpoint_port() {
    let mut pin = http_route("pin", vec![rule(Vec::new(), &[("gamma/echo-v1", 1)])]);
    on_port(&mut pin, 80);
    let tables = tables_of(&generated_with(&catalog_with_service_ports(vec![pin]), &[]));
    let http = vhost(&tables["outbound"], "echo.gamma.aether.internal:80");
    assert_eq!(names(&http.routes)[0], "http/gamma/pin/0");
}

#[test]
fn backend_ports_name_the_cluster_of_the_endpoint_port_their_service_port_targets() {
    let mut split = rule(Vec::new(), &[]);
    // echo-v1's 9080 targets 80; echo-v2 has no Service: its 80 is the endpoint port.
    split.backends = vec![with_port("gamma/echo-v1", 9080), with_port("gamma/echo-v2", 80)];
    split.filters = vec![filter(route_filter::Filter::RequestMirror(Mirror {
        backend: Some(with_port("gamma/echo-v1", 9080)),
        percent: 100,
    }))];
    let mut only = rule(vec![path(MatchType::PathPrefix, "/only")], &[]);
    // A port echo-v1's Service does not map stays as written.
    only.backends = vec![with_port("gamma/echo-v1", 9000)];
    let route = http_route("split", vec![only, split]);
    let tables = tables_of(&generated_with(&catalog_with_service_ports(vec![route]), &[]));
    let routes = &vhost(&tables["outbound"], "echo.gamma.aether.internal:80").routes;
    let route_action::ClusterSpecifier::Cluster(only) = forward(&routes[0]) else {
        panic!("{:?}", routes[0])
    };
    assert_eq!(only, "echo-v1.gamma.aether.internal:9000");
    let route_action::ClusterSpecifier::WeightedClusters(weighted) = forward(&routes[1]) else {
        panic!("{:?}", routes[1])
    };
    let clusters: Vec<&str> = weighted.clusters.iter().map(|c| c.name.as_str()).collect();
    assert_eq!(
        clusters,
        ["echo-v1.gamma.aether.internal:80", "echo-v2.gamma.aether.internal:80"]
    );
    let mirrors = &route_action_of(&routes[1]).request_mirror_policies;
    assert_eq!(mirrors[0].cluster, "echo-v1.gamma.aether.internal:80");
}

#[test]
fn backend_ports_stay_as_written_while_the_backend_is_no_dependency() {
    let mut to_unknown = rule(Vec::new(), &[]);
    to_unknown.backends = vec![with_port("gamma/elsewhere", 9080)];
    let route = http_route("away", vec![to_unknown]);
    let tables = tables_of(&generated_with(&catalog_with_service_ports(vec![route]), &[]));
    let routes = &vhost(&tables["outbound"], "echo.gamma.aether.internal:80").routes;
    let route_action::ClusterSpecifier::Cluster(cluster) = forward(&routes[0]) else {
        panic!("{:?}", routes[0])
    };
    assert_eq!(cluster, "elsewhere.gamma.aether.internal:9080");
}
