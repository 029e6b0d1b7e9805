//! The edge gateway's generators: one Gateway as `aether_api::edge` projects it, and the
//! catalog slice of the services its routes name → the resources of the edge's own
//! Envoy (proposals/018).
//!
//! - One listener per Gateway port, `edge|<port>`, on the edge's bind address.
//!   - HTTP: one connection manager; its route table `edge|<port>` holds every Gateway
//!     listener of the port (see `hosts` for how requests find their listener).
//!   - HTTPS: one filter chain per Gateway listener, picked by SNI (its hostname), that
//!     terminates TLS with the listener's certificates (SDS `edge-cert|<ns>/<name>`) and
//!     routes by its own table `edge|<port>|<listener>`.
//!   - TLS (passthrough): one chain per attached TLSRoute, picked by SNI (the route's
//!     hostnames), proxying the bytes to the route's backends.
//!   - TCP: the attached TCPRoute's backends.
//! - Routes compile with the mesh's own compiler (`routes::compile`), so a rule means at
//!   the edge what it means between pods.
//! - One cluster per backend service port, named as the mesh names it
//!   (`<svc>.<ns>.<domain>:<port>`), reaching the endpoints' inbound mTLS port with the
//!   gateway's own SVID and the service's SPIFFE IDs pinned: an edge Envoy has one
//!   identity, so its clusters hold their TLS socket themselves.
//!
//! Cost: per Gateway listener one chain or a few virtual hosts; per backend service port
//! one cluster and its endpoints; per certificate one secret.

mod hosts;
#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use aether_api::edge::{AttachedRoute, Edge, EdgeListener, EdgePort, ListenerProtocol};
use aether_api::mesh_config::ResilienceSettings;
use aether_proto::registry::v1::{Route, RouteBackend, route_filter};
use aether_proto::view::CatalogView;
use envoy_types::pb::envoy::config::listener::v3::{
    Filter, FilterChain, FilterChainMatch, Listener, ListenerFilter, filter, listener_filter,
};
use envoy_types::pb::envoy::config::route::v3::{RouteConfiguration, VirtualHost};
use envoy_types::pb::envoy::extensions::filters::http::router::v3::Router;
use envoy_types::pb::envoy::extensions::filters::listener::tls_inspector::v3::TlsInspector;
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::{
    HttpConnectionManager, HttpFilter, Rds, http_connection_manager, http_filter,
};
use envoy_types::pb::envoy::extensions::filters::network::tcp_proxy::v3::{TcpProxy, tcp_proxy};
use envoy_types::pb::google::protobuf::{Any, BoolValue};

use super::routes::actions::Target;
use super::routes::compile::compile_rules;
use super::routes::direct;
use super::transport::{self, Mtls};
use super::util::{address, ads, any, on_demand_filter};
use super::{Generated, MeshService, clusters, is_http, services};
use crate::identity::{Identities, svid_secret};
use crate::mesh_settings::MeshSettings;
use crate::xds::cache::Resource;

/// Everything the edge's generator reads.
pub struct EdgeInputs<'a> {
    pub edge: &'a Edge,
    /// The catalog, filtered to the services the Gateway's routes name.
    pub catalog: &'a CatalogView,
    pub mesh_domain: &'a str,
    /// Where the listeners bind (`--bind-address`).
    pub bind_address: &'a str,
    /// Added to every Gateway port to get the port Envoy binds (`--port-offset`).
    pub port_offset: u32,
    /// mTLS to the mesh; `None` (`--identity none`): plaintext, NOT FOR PRODUCTION.
    pub mtls: Option<&'a Mtls>,
    pub identities: &'a Identities,
    /// The gateway's own id among `identities` (whose SVID it presents).
    pub identity_id: &'a str,
}

/// The listener of a Gateway port.
pub fn listener_name(port: u32) -> String {
    format!("edge|{port}")
}

/// The route table of an HTTP port, or of one HTTPS listener.
pub fn table_name(port: &EdgePort, listener: Option<&EdgeListener>) -> String {
    match listener {
        Some(listener) => format!("edge|{}|{}", port.port, listener.name),
        None => format!("edge|{}", port.port),
    }
}

/// The SDS secret of a certificate Secret `<ns>/<name>`.
pub fn certificate_secret_name(secret: &str) -> String {
    format!("edge-cert|{secret}")
}

/// All resources of the edge's Envoy, by type URL.
pub fn generate(inputs: &EdgeInputs) -> Generated {
    let edge = &servable(inputs.edge);
    let services = services(inputs.catalog, inputs.mesh_domain);
    let by_key: HashMap<&str, &MeshService> = services.iter().map(|s| (s.key, s)).collect();
    let mesh = MeshSettings::new(&inputs.catalog.mesh_configs);
    let svid = svid_secret(inputs.identity_id);
    // With mTLS, nothing reaches the mesh before the gateway holds its SVID: a request
    // until then finds no cluster (500), never a connection without an identity.
    let upstream = match inputs.mtls {
        Some(mtls) if inputs.identities.svids.contains_key(inputs.identity_id) => Some(Some((mtls, svid.as_str()))),
        Some(_) => None,
        None => Some(None),
    };
    let context = Context {
        mesh_domain: inputs.mesh_domain,
        services: &by_key,
        mesh: &mesh,
    };
    let mut listeners = Vec::new();
    let mut routes = Vec::new();
    let mut secrets = BTreeMap::new();
    for port in &edge.ports {
        let (listener, tables) = port_resources(port, inputs, &context, &mut secrets);
        listeners.push(Resource::new(listener_name(port.port), any(&listener)));
        routes.extend(tables.into_iter().map(|t| Resource::new(t.name.clone(), any(&t))));
    }
    let mut clusters_out = Vec::new();
    let mut assignments = Vec::new();
    if let Some(upstream) = upstream {
        for (name, (service, port)) in backend_clusters(edge, &context) {
            let (cluster, assignment) = backend(&name, service, port, upstream, &mesh);
            clusters_out.push(Resource::new(name.clone(), any(&cluster)));
            assignments.push(Resource::new(name, any(&assignment)));
        }
    }
    let mut secret_resources: Vec<Arc<Resource>> =
        secrets.into_iter().map(|(n, body)| Resource::new(n, body)).collect();
    if inputs.mtls.is_some() {
        let own = inputs
            .identities
            .svids
            .iter()
            .filter(|(id, _)| id.as_str() == inputs.identity_id);
        let identities = Identities {
            svids: own.map(|(id, svid)| (id.clone(), svid.clone())).collect(),
            ..inputs.identities.clone()
        };
        secret_resources.extend(
            transport::secrets(&identities)
                .into_iter()
                .map(|(n, b)| Resource::new(n, b)),
        );
    }
    for resources in [
        &mut clusters_out,
        &mut assignments,
        &mut listeners,
        &mut routes,
        &mut secret_resources,
    ] {
        resources.sort_by(|a, b| a.name.cmp(&b.name));
    }
    BTreeMap::from([
        (crate::xds::CLUSTER.to_owned(), clusters_out),
        (crate::xds::ENDPOINT.to_owned(), assignments),
        (crate::xds::LISTENER.to_owned(), listeners),
        (crate::xds::ROUTE.to_owned(), routes),
        (crate::xds::SECRET.to_owned(), secret_resources),
    ])
}

/// The Gateway as Envoy can serve it: a route with a regex over the RE2 budget is left
/// out (Envoy would refuse its whole table; `routes::regex_budget`), and a redirect that
/// names no scheme keeps the listener's, and its port too when it names none (Gateway
/// API; between pods the request's port is kept, but at the edge the listener's port is
/// what the client used, and the well-known port of its scheme is left out).
fn servable(edge: &Edge) -> Edge {
    let mut edge = edge.clone();
    for port in &mut edge.ports {
        let scheme = match port.protocol {
            ListenerProtocol::Https => "https",
            _ => "http",
        };
        for listener in &mut port.listeners {
            listener.routes.retain(|attached| match super::routes::regex_budget::check(&attached.route) {
                Ok(()) => true,
                Err(error) => {
                    let key = aether_proto::view::route_key(&attached.route);
                    tracing::warn!(route = %aether_common::quote::quote(&key), %error, "route left out of the edge");
                    false
                }
            });
            let redirects = (listener.routes.iter_mut())
                .flat_map(|a| &mut a.route.rules)
                .flat_map(|rule| &mut rule.filters)
                .filter_map(|f| match &mut f.filter {
                    Some(route_filter::Filter::RequestRedirect(redirect)) => Some(redirect),
                    _ => None,
                });
            for redirect in redirects.filter(|r| r.scheme.is_empty()) {
                if redirect.port == 0 {
                    redirect.port = port.port;
                }
                redirect.scheme = scheme.to_owned();
            }
        }
    }
    edge
}

/// What compiling a route needs besides the route.
struct Context<'a> {
    mesh_domain: &'a str,
    services: &'a HashMap<&'a str, &'a MeshService<'a>>,
    mesh: &'a MeshSettings,
}

impl Context<'_> {
    fn target<'b>(&'b self, domains: &'b [String], resilience: &'b ResilienceSettings) -> Target<'b> {
        static NO_FILTERS: std::sync::LazyLock<BTreeMap<&str, &[super::http_filters::Enabled]>> =
            std::sync::LazyLock::new(BTreeMap::new);
        Target {
            mesh_domain: self.mesh_domain,
            port: 0,
            domains,
            services: self.services,
            route_filters: &NO_FILTERS,
            resilience,
        }
    }
}

/// A Gateway port's listener and the route tables it names; certificates it uses are
/// added to `secrets`.
fn port_resources(
    port: &EdgePort,
    inputs: &EdgeInputs,
    context: &Context,
    secrets: &mut BTreeMap<String, Any>,
) -> (Listener, Vec<RouteConfiguration>) {
    let bind = address(inputs.bind_address, port.port + inputs.port_offset, None);
    let stat = format!("edge_{}", port.port);
    let mut tables = Vec::new();
    let mut chains = Vec::new();
    let mut inspect_tls = false;
    match port.protocol {
        ListenerProtocol::Http => {
            let listeners: Vec<&EdgeListener> = port.listeners.iter().collect();
            let table = route_table(table_name(port, None), &listeners, context);
            chains.push(chain(None, http_manager(&stat, &table.name)));
            tables.push(table);
        }
        ListenerProtocol::Https => {
            inspect_tls = true;
            for listener in &port.listeners {
                let table = route_table(table_name(port, Some(listener)), &[listener], context);
                let names: Vec<String> = (listener.certificates.iter())
                    .map(|(secret, certificate)| {
                        let name = certificate_secret_name(secret);
                        let body = transport::certificate_secret(&name, &certificate.chain_pem, &certificate.key_pem);
                        secrets.insert(name.clone(), body);
                        name
                    })
                    .collect();
                let mut https = chain(server_names(listener.hostname.iter()), http_manager(&stat, &table.name));
                https.name = format!("https|{}", listener.name);
                https.transport_socket = Some(transport::edge_terminate(&names));
                chains.push(https);
                tables.push(table);
            }
        }
        ListenerProtocol::Tls => {
            inspect_tls = true;
            for listener in &port.listeners {
                for attached in &listener.routes {
                    let names = if attached.hostnames.is_empty() {
                        server_names(listener.hostname.iter())
                    } else {
                        server_names(attached.hostnames.iter())
                    };
                    let mut passthrough = chain(names, stream_proxy(&stat, &attached.route, context));
                    passthrough.name = format!(
                        "tls|{}|{}",
                        listener.name,
                        aether_proto::view::route_key(&attached.route)
                    );
                    chains.push(passthrough);
                }
            }
        }
        ListenerProtocol::Tcp => {
            // A TCP listener has no way to tell two routes' connections apart: the
            // oldest attached route takes them (Gateway API leaves the choice open).
            let first = (port.listeners.iter().flat_map(|l| &l.routes))
                .min_by_key(|a| (a.route.created_unix_seconds, aether_proto::view::route_key(&a.route)));
            if let Some(attached) = first {
                chains.push(chain(None, stream_proxy(&stat, &attached.route, context)));
            }
        }
    }
    let listener = Listener {
        name: listener_name(port.port),
        address: Some(bind),
        filter_chains: chains,
        listener_filters: if inspect_tls { vec![tls_inspector()] } else { Vec::new() },
        // Listeners share a port between workers; a hot restart hands the sockets over.
        ..Default::default()
    };
    (listener, tables)
}

fn server_names<'a>(names: impl Iterator<Item = &'a String>) -> Option<FilterChainMatch> {
    let server_names: Vec<String> = names.cloned().collect();
    (!server_names.is_empty()).then(|| FilterChainMatch {
        server_names,
        ..Default::default()
    })
}

fn chain(filter_chain_match: Option<FilterChainMatch>, filter: Filter) -> FilterChain {
    FilterChain {
        filter_chain_match,
        filters: vec![filter],
        ..Default::default()
    }
}

fn tls_inspector() -> ListenerFilter {
    ListenerFilter {
        name: "envoy.filters.listener.tls_inspector".into(),
        config_type: Some(listener_filter::ConfigType::TypedConfig(any(&TlsInspector::default()))),
        ..Default::default()
    }
}

/// The connection manager of an HTTP or HTTPS listener: clients from outside, so their
/// address counts (`x-forwarded-for`), paths are normalized, and a Host's port does not
/// change which virtual host answers.
fn http_manager(stat: &str, table: &str) -> Filter {
    let router = HttpFilter {
        name: "envoy.filters.http.router".into(),
        config_type: Some(http_filter::ConfigType::TypedConfig(any(&Router::default()))),
        ..Default::default()
    };
    // A route can reach Envoy's workers before its new cluster has finished warming there
    // (the ACKs the builder waits for come first): the request waits for the cluster
    // instead of answering 500. A cluster the edge does not serve is refused at once.
    let on_demand = on_demand_filter();
    let manager = HttpConnectionManager {
        stat_prefix: stat.to_owned(),
        codec_type: http_connection_manager::CodecType::Auto as i32,
        route_specifier: Some(http_connection_manager::RouteSpecifier::Rds(Rds {
            config_source: ads(),
            route_config_name: table.to_owned(),
        })),
        http_filters: vec![on_demand, router],
        use_remote_address: Some(BoolValue { value: true }),
        normalize_path: Some(BoolValue { value: true }),
        merge_slashes: true,
        strip_port_mode: Some(http_connection_manager::StripPortMode::StripAnyHostPort(true)),
        ..Default::default()
    };
    Filter {
        name: "envoy.filters.network.http_connection_manager".into(),
        config_type: Some(filter::ConfigType::TypedConfig(any(&manager))),
    }
}

/// A route table: one virtual host per hostname a listener owns (see `hosts`).
fn route_table(name: String, listeners: &[&EdgeListener], context: &Context) -> RouteConfiguration {
    let virtual_hosts = hosts::plan(listeners)
        .into_iter()
        .map(|host| virtual_host(&host, context))
        .collect();
    RouteConfiguration {
        name,
        virtual_hosts,
        // Backends the catalog does not hold yet are named all the same (500 until then).
        validate_clusters: Some(BoolValue { value: false }),
        ..Default::default()
    }
}

fn virtual_host(host: &hosts::Host, context: &Context) -> VirtualHost {
    let domains = vec![host.domain.clone()];
    let mut routes = Vec::new();
    // Hostname first (Gateway API precedence), then the API's order within a hostname;
    // a rule without its own timeout or retries takes its namespace's defaults (the
    // first route's, for a hostname routes of several namespaces share).
    for group in &host.groups {
        let resilience = group
            .first()
            .map(|r| context.mesh.of(&r.namespace).resilience)
            .unwrap_or_default();
        routes.extend(compile_rules(group, &context.target(&domains, &resilience)));
    }
    routes.push(direct(404, "no route of the gateway matches this request\n"));
    VirtualHost {
        name: format!("{}|{}", host.listener, host.domain),
        domains,
        routes,
        ..Default::default()
    }
}

/// A TCP proxy to a stream route's backends (weighted; the first rule's).
fn stream_proxy(stat: &str, route: &Route, context: &Context) -> Filter {
    let domains: Vec<String> = Vec::new();
    let resilience = context.mesh.of(&route.namespace).resilience;
    let target = context.target(&domains, &resilience);
    let backends: Vec<&RouteBackend> = (route.rules.iter().take(1))
        .flat_map(|r| &r.backends)
        .filter(|b| b.weight > 0)
        .collect();
    let cluster_specifier = match backends.as_slice() {
        [only] => Some(tcp_proxy::ClusterSpecifier::Cluster(target.cluster(only))),
        // No backend: a cluster that never exists, so the connection is closed.
        [] => Some(tcp_proxy::ClusterSpecifier::Cluster("edge|no-backend".into())),
        many => Some(tcp_proxy::ClusterSpecifier::WeightedClusters(
            tcp_proxy::WeightedCluster {
                clusters: many
                    .iter()
                    .map(|b| tcp_proxy::weighted_cluster::ClusterWeight {
                        name: target.cluster(b),
                        weight: b.weight,
                        ..Default::default()
                    })
                    .collect(),
            },
        )),
    };
    let proxy = TcpProxy {
        stat_prefix: stat.to_owned(),
        cluster_specifier,
        ..Default::default()
    };
    Filter {
        name: "envoy.filters.network.tcp_proxy".into(),
        config_type: Some(filter::ConfigType::TypedConfig(any(&proxy))),
    }
}

/// Every backend (and mirror) cluster the Gateway's routes name that the catalog can
/// serve: cluster name → (service, endpoint port).
fn backend_clusters<'a>(edge: &Edge, context: &'a Context) -> BTreeMap<String, (&'a MeshService<'a>, u32)> {
    let mut out = BTreeMap::new();
    let attached = edge.ports.iter().flat_map(|p| &p.listeners).flat_map(|l| &l.routes);
    for AttachedRoute { route, .. } in attached {
        let domains: Vec<String> = Vec::new();
        let resilience = ResilienceSettings::default();
        let target = context.target(&domains, &resilience);
        for backend in route.rules.iter().flat_map(rule_backends) {
            let Some(service) = context.services.get(backend.service.as_str()) else {
                continue;
            };
            let port = service.endpoint_port(backend.port);
            if service.ports.contains_key(&port) {
                out.insert(target.cluster(backend), (*service, port));
            }
        }
    }
    out
}

/// A rule's backends, then its mirrors' (rule and backend filters).
fn rule_backends(rule: &aether_proto::registry::v1::RouteRule) -> impl Iterator<Item = &RouteBackend> {
    let filters = rule.filters.iter().chain(rule.backends.iter().flat_map(|b| &b.filters));
    let mirrors = filters.filter_map(|f| match &f.filter {
        Some(route_filter::Filter::RequestMirror(mirror)) => mirror.backend.as_ref(),
        _ => None,
    });
    rule.backends.iter().chain(mirrors)
}

/// A backend service port's cluster and endpoints: the mesh's cluster (HTTP/2 to the
/// peer's inbound listener, the port header, outlier detection, limits) with the
/// gateway's own TLS socket.
fn backend(
    name: &str,
    service: &MeshService,
    port: u32,
    upstream: Option<(&Mtls, &str)>,
    mesh: &MeshSettings,
) -> (
    envoy_types::pb::envoy::config::cluster::v3::Cluster,
    envoy_types::pb::envoy::config::endpoint::v3::ClusterLoadAssignment,
) {
    let protocol = service.ports[&port];
    let resilience = mesh.of(&service.service.namespace).resilience;
    let mut cluster = clusters::mesh_cluster(name, port, protocol, None, &[], &resilience);
    let endpoints: Vec<&aether_proto::registry::v1::Endpoint> = (service.endpoints.iter())
        .flat_map(|e| e.values())
        .filter(|e| e.ports.iter().any(|p| p.port == port))
        .collect();
    if let Some((mtls, svid)) = upstream {
        let sans = clusters::server_sans(mtls, service.key, &endpoints);
        let http = is_http(protocol);
        cluster.transport_socket = Some(transport::edge_upstream(
            mtls,
            svid,
            &sans,
            http,
            (!http).then_some(port),
        ));
    }
    // The edge is on no node of the mesh: every endpoint is as near as any other.
    let nowhere = aether_proto::registry::v1::Locality::default();
    let here = clusters::Here {
        locality: &nowhere,
        node: "",
    };
    let assignment = clusters::load_assignment(name, &endpoints, here, clusters::distribution(service), None);
    (cluster, assignment)
}

/// The services a Gateway's routes send traffic to (what the edge follows on the
/// registrar's Watch stream).
pub fn backend_services(edge: &Edge) -> BTreeSet<String> {
    (edge.ports.iter().flat_map(|p| &p.listeners).flat_map(|l| &l.routes))
        .flat_map(|a| a.route.rules.iter().flat_map(rule_backends))
        .map(|b| b.service.clone())
        .collect()
}
