//! LDS: two listeners per local pod, each bound inside the pod's netns:
//! - `outbound` on 127.0.0.1:18081 and 127.0.0.1:18001: the pod's outgoing traffic. On
//!   18081, HTTP the app sends explicitly, routed by authority (name or VIP; RDS
//!   `outbound`, or `outbound~<ns>` where the pod's namespace has consumer routes, with
//!   on-demand CDS for mesh names outside the dependency set); on 18001, connections the
//!   pod's nft rules redirected from a mesh VIP or ClusterIP, HTTP routed by that
//!   original destination (the same table, see `routes`); plain TCP by
//!   original destination VIP:port for the pod's declared upstreams. (One listener with
//!   two addresses: a listener costs Envoy far more than an address.)
//! - `inbound` on 0.0.0.0:18008: traffic from peers, delivered to the app on
//!   127.0.0.1:<port> (HTTP by the port header; with mTLS a TCP stream by the server name
//!   its originating node gave it, `port-<port>.aether`; anything else to the primary port).
//!
//! With mTLS, the inbound chains terminate TLS with the pod's SVID (HTTP chosen by ALPN
//! h2 through the TLS inspector) and the outgoing listeners mark connections with the
//! pod's identity (see `transport`).

use envoy_types::pb::envoy::config::accesslog::v3::AccessLog;
use envoy_types::pb::envoy::config::common::mutation_rules::v3::{HeaderMutation as MutationRule, header_mutation};
use envoy_types::pb::envoy::config::core::v3::{
    CidrRange, HeaderValue, HeaderValueOption, TypedExtensionConfig, header_value_option,
};
use std::collections::BTreeSet;

use envoy_types::pb::envoy::config::listener::v3::{
    AdditionalAddress, Filter, FilterChain, FilterChainMatch, Listener, ListenerFilter,
    ListenerFilterChainMatchPredicate, filter, listener_filter, listener_filter_chain_match_predicate as predicate,
};
use envoy_types::pb::envoy::extensions::filters::http::router::v3::Router;
use envoy_types::pb::envoy::extensions::filters::listener::http_inspector::v3::HttpInspector;
use envoy_types::pb::envoy::extensions::filters::listener::original_dst::v3::OriginalDst;
use envoy_types::pb::envoy::extensions::filters::listener::tls_inspector::v3::TlsInspector;
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::{
    HttpConnectionManager, HttpFilter, Rds, http_connection_manager, http_filter,
};
use envoy_types::pb::envoy::extensions::filters::network::tcp_proxy::v3::{TcpProxy, tcp_proxy};
use envoy_types::pb::envoy::extensions::http::early_header_mutation::header_mutation::v3::HeaderMutation as EarlyHeaderMutation;
use envoy_types::pb::envoy::r#type::v3::Int32Range;
use envoy_types::pb::google::protobuf::{Any, BoolValue, UInt32Value};

use super::app_protocols;
use super::authorization::{self, Filters};
use super::clusters::local_name;
use super::http_filters::Enabled;
use super::origination;
use super::routes::{DESTINATION_HEADER, inbound_routes, inbound_routes_name};
use super::tcp_routes::{Backends, NO_BACKEND};
use super::transport::{self, Mtls};
use super::util::{CAPTURE_PORT, INBOUND_PORT, OUTBOUND_PORT, address, ads, any, millis, on_demand_filter};
use super::{Declared, PodFilters, is_http};
use crate::access_log::decisions;
use crate::pod::{AppProtocol, ListenerSockets, LocalPod};

pub fn outbound_name(pod: &LocalPod) -> String {
    format!("outbound|{}", pod.id())
}

pub fn inbound_name(pod: &LocalPod) -> String {
    format!("inbound|{}", pod.id())
}

/// A local pod's listeners; `services` are the dependency services it declared, `table`
/// the outbound route table its HTTP goes through, `authz` the RBAC filters of its
/// inbound chains.
pub fn pod_listeners(
    pod: &LocalPod,
    declared: &Declared,
    table: &str,
    mtls: Option<&Mtls>,
    authz: &Filters,
    filters: &PodFilters,
) -> Vec<(String, Any)> {
    let netns = pod.netns.to_string_lossy();
    let outbound = outbound(pod, &netns, declared, table, mtls, &filters.callers);
    let mut out = vec![(outbound_name(pod), any(&outbound))];
    if let Some(inbound) = inbound(pod, &netns, mtls, authz, &filters.inbound) {
        out.push((inbound_name(pod), any(&inbound)));
    }
    out
}

/// The pod's inbound route table (RDS), with its authorization rules; `None` when the
/// pod serves no HTTP.
pub fn pod_inbound_routes(pod: &LocalPod, authz: &Filters, enabled: &[Enabled]) -> Option<(String, Any)> {
    let http_ports = http_ports(pod);
    if http_ports.is_empty() {
        return None;
    }
    let routes = inbound_routes(pod, &http_ports);
    Some((
        routes.name.clone(),
        super::authorization::route_table(&routes, authz, enabled),
    ))
}

fn http_ports(pod: &LocalPod) -> Vec<u16> {
    let ports = pod.info.mesh_ports();
    ports.iter().filter(|(_, p)| p.is_http()).map(|(p, _)| *p).collect()
}

/// A chain of a pod's outgoing listeners: the source marker (mTLS: which SVID the
/// upstream connection presents), then `filter`.
fn outgoing(
    pod: &LocalPod,
    mtls: Option<&Mtls>,
    filter_chain_match: Option<FilterChainMatch>,
    filter: Filter,
) -> FilterChain {
    let mut chain = chain(filter_chain_match, filter);
    if let Some(source) = transport::source_filter(mtls, pod) {
        chain.filters.insert(0, source);
    }
    chain
}

/// What an outgoing chain's HTTP picks its virtual host by: the value it stamps in
/// [`DESTINATION_HEADER`] before the node's outbound table looks it up.
enum RoutedBy {
    /// The request's authority (explicit calls to 18081).
    Authority,
    /// The connection's original destination (captured calls): the address called
    /// decides, whatever the Host header says.
    Destination,
}

/// The pod's HTTP routed through the outbound `table`, with on-demand CDS for mesh names
/// outside the dependency set. Requests are stamped with the pod's service for request
/// metrics (crate::request_metrics); failed ones are logged to the agent
/// (crate::access_log).
fn routed(pod: &LocalPod, table: &str, by: RoutedBy, callers: &[HttpFilter]) -> Filter {
    let source = pod.info.service();
    let hcm = HttpConnectionManager {
        stat_prefix: format!("outbound.{}", pod.id().replace('/', ".")),
        route_specifier: Some(http_connection_manager::RouteSpecifier::Rds(Rds {
            config_source: ads(),
            route_config_name: table.to_owned(),
        })),
        early_header_mutation_extensions: vec![stamp_destination(by)],
        http_filters: vec![
            on_demand_filter(),
            http_filter_of(
                "envoy.filters.http.header_mutation",
                &crate::request_metrics::source_stamp(&source),
            ),
        ]
        .into_iter()
        // Callers-side HTTP filters (the authorization of calls to external services
        // first), disabled until the route table enables them.
        .chain(callers.iter().cloned())
        .chain([http_filter_of("envoy.filters.http.router", &Router::default())])
        .collect(),
        access_log: crate::request_metrics::access_log(&source)
            .into_iter()
            .chain([crate::access_log::logger(&pod.id(), &egress_logged(callers))])
            .collect(),
        ..Default::default()
    };
    network_filter("envoy.filters.network.http_connection_manager", &hcm)
}

/// The egress RBAC results worth a decision log line, for the egress filters among `callers`.
fn egress_logged(callers: &[HttpFilter]) -> Vec<String> {
    let egress = &authorization::egress::EGRESS;
    let slots = callers.iter().filter(|f| f.name.starts_with(egress.audit)).count();
    authorization::egress::logged_keys(slots)
}

/// Sets the destination header before the route table picks a virtual host by it: to
/// the authority, or to the connection's local address (the original destination,
/// restored by the original_dst listener filter); whatever the client sent is overwritten.
fn stamp_destination(by: RoutedBy) -> TypedExtensionConfig {
    let value = match by {
        RoutedBy::Authority => "%REQ(:AUTHORITY)%",
        RoutedBy::Destination => "%DOWNSTREAM_LOCAL_ADDRESS%",
    };
    let mutation = EarlyHeaderMutation {
        mutations: vec![MutationRule {
            action: Some(header_mutation::Action::Append(HeaderValueOption {
                header: Some(HeaderValue {
                    key: DESTINATION_HEADER.to_owned(),
                    value: value.to_owned(),
                    ..Default::default()
                }),
                append_action: header_value_option::HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
                ..Default::default()
            })),
        }],
    };
    TypedExtensionConfig {
        name: "envoy.http.early_header_mutation.header_mutation".to_owned(),
        typed_config: Some(any(&mutation)),
    }
}

/// Authorization runs first in each chain (`authz`: RBAC, see `authorization`), so
/// nothing reaches the app before its policies allowed it.
fn inbound(
    pod: &LocalPod,
    netns: &str,
    mtls: Option<&Mtls>,
    authz: &Filters,
    filters: &[HttpFilter],
) -> Option<Listener> {
    let ports = pod.info.mesh_ports();
    let primary = *ports.first()?;
    let mut filter_chains = Vec::new();
    if !http_ports(pod).is_empty() {
        let hcm = inbound_hcm(pod, authz, filters);
        let mut matched = chain(
            None,
            network_filter("envoy.filters.network.http_connection_manager", &hcm),
        );
        matched.filter_chain_match = Some(FilterChainMatch {
            // mTLS: peers' HTTP clusters offer ALPN h2; plaintext: the HTTP inspector's guess.
            application_protocols: if mtls.is_some() {
                vec![transport::ALPN_H2.into()]
            } else {
                vec!["http/1.1".into(), "h2c".into()]
            },
            ..Default::default()
        });
        matched.transport_socket = transport::downstream(mtls, &pod.id(), true);
        filter_chains.push(matched);
    }
    // TCP: with mTLS a stream names its app port in the server name (see
    // `origination::port_server_name`), one chain per TCP port; one that names none (or
    // any stream in plaintext) goes to the primary port.
    let mut loggers = Vec::new();
    let mut tcp_chain = |(port, protocol): (u16, AppProtocol), server_names| {
        let (chain, logger) = inbound_tcp_chain(pod, port, protocol, server_names, mtls, authz);
        loggers.extend(logger);
        chain
    };
    if mtls.is_some() {
        for (port, protocol) in ports.iter().filter(|(_, p)| !p.is_http()) {
            let name = origination::port_server_name(u32::from(*port));
            filter_chains.push(tcp_chain((*port, *protocol), vec![name]));
        }
    }
    let default_chain = tcp_chain(primary, Vec::new());
    let inspector = if mtls.is_some() {
        listener_filter("envoy.filters.listener.tls_inspector", &TlsInspector::default())
    } else {
        listener_filter("envoy.filters.listener.http_inspector", &HttpInspector::default())
    };
    Some(Listener {
        name: inbound_name(pod),
        stat_prefix: stat_name(&inbound_name(pod)),
        address: Some(address("0.0.0.0", INBOUND_PORT, Some(netns))),
        listener_filters: vec![inspector],
        listener_filters_timeout: millis(1000),
        continue_on_listener_filters_timeout: true,
        enable_reuse_port: reuse_port(pod),
        filter_chains,
        default_filter_chain: Some(default_chain),
        access_log: loggers,
        ..Default::default()
    })
}

/// The inbound chain delivering TCP to the pod's `port`, taken by a stream that names it in
/// `server_names` (none: the default chain), its policies judged with that port. A port
/// the node parses at L7 (`app_protocols`) gets that protocol's proxy, and its decision
/// logger is the listener's (returned), since those proxies log no connections.
fn inbound_tcp_chain(
    pod: &LocalPod,
    port: u16,
    protocol: AppProtocol,
    server_names: Vec<String>,
    mtls: Option<&Mtls>,
    authz: &Filters,
) -> (FilterChain, Option<AccessLog>) {
    let no_filters = authorization::TcpFilters::default();
    let authz_here = authz.tcp.get(&port).unwrap_or(&no_filters);
    let cluster = local_name(pod, port);
    let parsed =
        app_protocols::parsed(pod, protocol).and_then(|p| app_protocols::inbound_proxy(pod, port, p, &cluster));
    let (mut chain, logger) = match parsed {
        Some(proxy) => {
            let name = format!("l7|{port}|{}", server_names.first().map_or("default", String::as_str));
            let logger = decisions::tcp_chain_logger(&pod.id(), port, &authz_here.logged, &name);
            let mut chain = chain(None, proxy);
            chain.name = name;
            (chain, Some(logger))
        }
        None => {
            let proxy = TcpProxy {
                stat_prefix: format!("inbound_tcp.{}", pod.id().replace('/', ".")),
                cluster_specifier: Some(tcp_proxy::ClusterSpecifier::Cluster(cluster)),
                // Connections the chain's policies closed, audited or would close (dry-run):
                // the proxy logs when its connection ends, closed before it or not.
                access_log: vec![decisions::tcp_logger(&pod.id(), port, &authz_here.logged)],
                ..Default::default()
            };
            (
                chain(None, network_filter("envoy.filters.network.tcp_proxy", &proxy)),
                None,
            )
        }
    };
    chain.filters.splice(0..0, authz_here.filters.iter().cloned());
    chain.transport_socket = transport::downstream(mtls, &pod.id(), false);
    if !server_names.is_empty() {
        chain.filter_chain_match = Some(FilterChainMatch {
            server_names,
            ..Default::default()
        });
    }
    (chain, logger)
}

/// A pod's listeners bind as the pod records ([`ListenerSockets`]): Envoy refuses to
/// change this on a listener it holds.
fn reuse_port(pod: &LocalPod) -> Option<BoolValue> {
    let per_worker = pod.listener_sockets == ListenerSockets::PerWorker;
    Some(BoolValue { value: per_worker })
}

/// The pod's outgoing traffic, explicit (18081) or captured (18001): plain TCP to a
/// VIP:port (or ClusterIP:port) of a service this pod declared goes to that service
/// port's cluster by original destination; HTTP sent to 127.0.0.1:18081 is routed by
/// authority through the node's `outbound` table, and every other connection (captured:
/// its original destination is a mesh address) by that destination through the same
/// table, falling back to the authority for destinations that are no declared
/// service (on demand for undeclared mesh names). Anything that is neither is closed.
fn outbound(
    pod: &LocalPod,
    netns: &str,
    declared: &Declared,
    table: &str,
    mtls: Option<&Mtls>,
    callers: &[HttpFilter],
) -> Listener {
    let mut filter_chains = tcp_chains(pod, declared, mtls);
    let sni_ports: BTreeSet<u32> = (filter_chains.iter())
        .filter_map(|c| c.filter_chain_match.as_ref())
        .filter(|m| !m.server_names.is_empty())
        .filter_map(|m| m.destination_port.as_ref().map(|p| p.value))
        .collect();
    filter_chains.push(outgoing(
        pod,
        mtls,
        Some(FilterChainMatch {
            destination_port: Some(UInt32Value { value: OUTBOUND_PORT }),
            prefix_ranges: vec![host_range("127.0.0.1")],
            ..Default::default()
        }),
        routed(pod, table, RoutedBy::Authority, callers),
    ));
    Listener {
        name: outbound_name(pod),
        stat_prefix: stat_name(&outbound_name(pod)),
        address: Some(address("127.0.0.1", OUTBOUND_PORT, Some(netns))),
        additional_addresses: vec![AdditionalAddress {
            address: Some(address("127.0.0.1", CAPTURE_PORT, Some(netns))),
            ..Default::default()
        }],
        // A redirected connection's original destination (the VIP) picks its chain; on
        // 18081 there is none and the local address stays. Then the server name, only on
        // the ports TLS routes choose by it.
        listener_filters: [listener_filter(
            "envoy.filters.listener.original_dst",
            &OriginalDst::default(),
        )]
        .into_iter()
        .chain(server_name_inspector(&sni_ports))
        .collect(),
        // A client that speaks first in plaintext on a port routed by server name
        // reaches the routes for connections without one after this, not never.
        listener_filters_timeout: millis(1000),
        continue_on_listener_filters_timeout: true,
        enable_reuse_port: reuse_port(pod),
        filter_chains,
        default_filter_chain: Some(outgoing(
            pod,
            mtls,
            None,
            routed(pod, table, RoutedBy::Destination, callers),
        )),
        ..Default::default()
    }
}

/// Plain TCP to a declared service's address and TCP port: per endpoint port one chain
/// for its VIP (with the ClusterIPs when a Service port is the same number), and one for
/// the ClusterIPs on each other Service port that targets it. Routes on the port (see
/// `tcp_routes`) add a chain per set of server names and split connections over their
/// backends.
fn tcp_chains(pod: &LocalPod, declared: &Declared, mtls: Option<&Mtls>) -> Vec<FilterChain> {
    let mut filter_chains = Vec::new();
    for service in declared.services {
        let cluster_ips: Vec<CidrRange> = service.cluster_ips.iter().map(|ip| host_range(ip)).collect();
        for (port, _) in service.ports.iter().filter(|(_, p)| !is_http(**p)) {
            let name = service.cluster(*port);
            let kubernetes_ports = service.kubernetes_ports_to(*port);
            let mut vip = vec![host_range(service.vip)];
            if kubernetes_ports.contains(port) {
                vip.extend(cluster_ips.iter().cloned());
            }
            let others = kubernetes_ports
                .iter()
                .filter(|p| *p != port && !cluster_ips.is_empty());
            let chains = std::iter::once((*port, vip)).chain(others.map(|p| (*p, cluster_ips.clone())));
            let stat_prefix = format!("capture.{}", name.replace(':', "_"));
            let routes = declared.splits.get(&name);
            let by_server_name = routes.map_or(&[][..], |r| &r.by_server_name[..]);
            let otherwise = routes.and_then(|r| r.otherwise.as_ref());
            // An external service's port: what the pod's policies decided, logged per connection.
            let logger = (declared.egress_logged.get(&name))
                .map(|logged| decisions::egress_tcp_logger(&pod.id(), service.key, *port, logged));
            for (destination_port, prefix_ranges) in chains {
                let chain_match = |server_names: &[String]| FilterChainMatch {
                    destination_port: Some(UInt32Value {
                        value: destination_port,
                    }),
                    prefix_ranges: prefix_ranges.clone(),
                    server_names: server_names.to_vec(),
                    ..Default::default()
                };
                for (server_names, backends) in by_server_name {
                    let proxy = tcp_proxy_split(&stat_prefix, &name, Some(backends), logger.clone());
                    filter_chains.push(outgoing(pod, mtls, Some(chain_match(server_names)), proxy));
                }
                let proxy = tcp_proxy_split(&stat_prefix, &name, otherwise, logger.clone());
                filter_chains.push(outgoing(pod, mtls, Some(chain_match(&[])), proxy));
            }
        }
    }
    filter_chains
}

/// The TLS inspector (which reads the ClientHello's server name), disabled on every
/// destination port but `ports`: a server-first protocol elsewhere must never wait for a
/// ClientHello that never comes.
fn server_name_inspector(ports: &BTreeSet<u32>) -> Option<ListenerFilter> {
    if ports.is_empty() {
        return None;
    }
    let port = |p: &u32| ListenerFilterChainMatchPredicate {
        rule: Some(predicate::Rule::DestinationPortRange(Int32Range {
            start: *p as i32,
            end: *p as i32 + 1,
        })),
    };
    // Envoy wants at least two rules in a set.
    let any_of = match ports.len() {
        1 => ports.iter().map(port).next().unwrap_or_default(),
        _ => ListenerFilterChainMatchPredicate {
            rule: Some(predicate::Rule::OrMatch(predicate::MatchSet {
                rules: ports.iter().map(port).collect(),
            })),
        },
    };
    let mut inspector = listener_filter("envoy.filters.listener.tls_inspector", &TlsInspector::default());
    inspector.filter_disabled = Some(ListenerFilterChainMatchPredicate {
        rule: Some(predicate::Rule::NotMatch(Box::new(any_of))),
    });
    Some(inspector)
}

/// One address as a CIDR range.
fn host_range(ip: &str) -> CidrRange {
    CidrRange {
        address_prefix: ip.to_owned(),
        prefix_len: Some(UInt32Value {
            value: if ip.contains(':') { 128 } else { 32 },
        }),
    }
}

/// Listeners with one address in different netns would share stats without a prefix.
fn stat_name(listener: &str) -> String {
    listener.replace(['|', '/'], ".")
}

/// The inbound HTTP: authorization then the router, with the pod's table from RDS
/// (`inbound|<ns>/<pod>`, carrying the authorization rules); requests the rules deny or
/// audit are logged to the agent (crate::access_log::decisions).
fn inbound_hcm(pod: &LocalPod, authz: &Filters, filters: &[HttpFilter]) -> HttpConnectionManager {
    let router = http_filter_of("envoy.filters.http.router", &Router::default());
    HttpConnectionManager {
        stat_prefix: format!("inbound.{}", pod.id().replace('/', ".")),
        route_specifier: Some(http_connection_manager::RouteSpecifier::Rds(Rds {
            config_source: ads(),
            route_config_name: inbound_routes_name(pod),
        })),
        // Authorization first, then the pod's HTTP filters (proposals/014), in order.
        http_filters: authz.http.iter().chain(filters).cloned().chain([router]).collect(),
        access_log: vec![crate::access_log::decisions::logger(&pod.id(), &authz.logged)],
        // The app learns its peer's SPIFFE ID from XFCC, and nothing a client sent in it.
        forward_client_cert_details: http_connection_manager::ForwardClientCertDetails::SanitizeSet as i32,
        set_current_client_cert_details: Some(http_connection_manager::SetCurrentClientCertDetails {
            uri: true,
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// To `cluster`, or over a TCP route's weighted backends (see `tcp_routes`).
fn tcp_proxy_split(stat_prefix: &str, cluster: &str, split: Option<&Backends>, logger: Option<AccessLog>) -> Filter {
    let specifier = match split.map(Vec::as_slice) {
        None => tcp_proxy::ClusterSpecifier::Cluster(cluster.to_owned()),
        Some([]) => tcp_proxy::ClusterSpecifier::Cluster(NO_BACKEND.to_owned()),
        Some([(only, _)]) => tcp_proxy::ClusterSpecifier::Cluster(only.clone()),
        Some(weighted) => tcp_proxy::ClusterSpecifier::WeightedClusters(tcp_proxy::WeightedCluster {
            clusters: weighted
                .iter()
                .map(|(name, weight)| tcp_proxy::weighted_cluster::ClusterWeight {
                    name: name.clone(),
                    weight: *weight,
                    ..Default::default()
                })
                .collect(),
        }),
    };
    let proxy = TcpProxy {
        stat_prefix: stat_prefix.to_owned(),
        cluster_specifier: Some(specifier),
        access_log: logger.into_iter().collect(),
        ..Default::default()
    };
    network_filter("envoy.filters.network.tcp_proxy", &proxy)
}

fn chain(filter_chain_match: Option<FilterChainMatch>, filter: Filter) -> FilterChain {
    FilterChain {
        filter_chain_match,
        filters: vec![filter],
        ..Default::default()
    }
}

fn network_filter<T: prost::Name>(name: &str, config: &T) -> Filter {
    Filter {
        name: name.to_owned(),
        config_type: Some(filter::ConfigType::TypedConfig(any(config))),
    }
}

fn listener_filter<T: prost::Name>(name: &str, config: &T) -> ListenerFilter {
    ListenerFilter {
        name: name.to_owned(),
        config_type: Some(listener_filter::ConfigType::TypedConfig(any(config))),
        ..Default::default()
    }
}

fn http_filter_of<T: prost::Name>(name: &str, config: &T) -> HttpFilter {
    HttpFilter {
        name: name.to_owned(),
        config_type: Some(http_filter::ConfigType::TypedConfig(any(config))),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use envoy_types::pb::envoy::config::listener::v3::Listener;
    use prost::Message;

    use super::*;
    use crate::pod::ContainerPort;
    use crate::xds::resources::routes::tests::{catalog, generated, pod};

    /// Each of the pod's listeners, as generated: its name and `enable_reuse_port`.
    fn reuse_port_of(pod: &LocalPod) -> Vec<(String, Option<bool>)> {
        let generated = generated(&catalog(Vec::new()), std::slice::from_ref(pod));
        generated[crate::xds::LISTENER]
            .iter()
            .filter(|r| r.name.ends_with(&pod.id()))
            .map(|r| {
                let listener = Listener::decode(&*r.body.value).unwrap();
                (r.name.clone(), listener.enable_reuse_port.map(|b| b.value))
            })
            .collect()
    }

    #[test]
    fn a_pods_listeners_bind_as_the_pod_records() {
        let mut pod = pod("gamma", "web-1");
        pod.info.ports = vec![ContainerPort {
            name: "http".into(),
            port: 8080,
            protocol: "TCP".into(),
        }];
        let names = vec![inbound_name(&pod), outbound_name(&pod)];
        let shared = reuse_port_of(&pod);
        assert_eq!(shared.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>(), names);
        assert!(shared.iter().all(|(_, reuse)| *reuse == Some(false)), "{shared:?}");
        pod.listener_sockets = ListenerSockets::PerWorker;
        let per_worker = reuse_port_of(&pod);
        assert_eq!(per_worker.len(), 2, "{per_worker:?}");
        assert!(
            per_worker.iter().all(|(_, reuse)| *reuse == Some(true)),
            "{per_worker:?}"
        );
    }

    /// The terminal filter of the pod's inbound default chain, its chain's name, and how
    /// many loggers the listener itself has.
    fn inbound_terminal(pod: &LocalPod) -> (String, String, usize) {
        let generated = generated(&catalog(Vec::new()), std::slice::from_ref(pod));
        let inbound = generated[crate::xds::LISTENER]
            .iter()
            .find(|r| r.name == inbound_name(pod))
            .expect("an inbound listener");
        let listener = Listener::decode(&*inbound.body.value).unwrap();
        let chain = listener.default_filter_chain.expect("a default chain");
        let terminal = chain.filters.last().expect("a filter").name.clone();
        (terminal, chain.name, listener.access_log.len())
    }

    #[test]
    fn thrift_ports_are_parsed_and_redis_and_dubbo_ports_only_where_the_pod_opts_in() {
        let serving = |name: &str, port_name: &str, port: u16, l7: Option<&str>| {
            let mut pod = pod("shop", name);
            pod.info.ports = vec![ContainerPort {
                name: port_name.into(),
                port,
                protocol: "TCP".into(),
            }];
            if let Some(value) = l7 {
                (pod.info.annotations).insert(aether_api::pod::L7_ANNOTATION.into(), value.into());
            }
            pod
        };
        let thrift = inbound_terminal(&serving("calc-1", "thrift-rpc", 9090, None));
        assert_eq!(
            thrift,
            ("envoy.filters.network.thrift_proxy".into(), "l7|9090|default".into(), 1),
            "parsed by default, its decisions logged by the listener"
        );
        let redis = inbound_terminal(&serving("cache-1", "redis", 6379, None));
        assert_eq!(redis, ("envoy.filters.network.tcp_proxy".into(), String::new(), 0));
        let redis = inbound_terminal(&serving("cache-2", "redis", 6379, Some("redis")));
        assert_eq!(redis.0, "envoy.filters.network.redis_proxy");
        let dubbo = inbound_terminal(&serving("rpc-1", "dubbo", 20880, None));
        assert_eq!(dubbo.0, "envoy.filters.network.tcp_proxy", "Dubbo is opt-in");
        let dubbo = inbound_terminal(&serving("rpc-2", "dubbo", 20880, Some("dubbo")));
        assert_eq!(dubbo.0, "envoy.filters.network.dubbo_proxy");
        let none = inbound_terminal(&serving("calc-2", "thrift", 9090, Some("none")));
        assert_eq!(none.0, "envoy.filters.network.tcp_proxy", "opted out");
        let tcp = inbound_terminal(&serving("db-1", "postgres", 5432, Some("redis, thrift")));
        assert_eq!(tcp.0, "envoy.filters.network.tcp_proxy", "a TCP port stays a stream");
    }
}
