//! RDS: the node's shared `outbound` route table (one virtual host per dependency
//! service port, a catch-all that sends any other mesh authority to the cluster of
//! that name via on-demand CDS, and a 404 for the rest), one `outbound~<ns>` table per
//! namespace with consumer routes (see `attached`), and the per-pod inbound table that
//! picks the app port from the port header.
//!
//! An outbound table's virtual hosts travel over VHDS as resources of their own, so a
//! new dependency pushes its virtual hosts, not the table (an Envoy on
//! state-of-the-world ADS gets them inline: see [`with_virtual_hosts_inline`]).
//!
//! A table picks its virtual host by [`DESTINATION_HEADER`], which each outgoing chain
//! stamps before the lookup: the request's authority on the explicit port, the
//! connection's original destination (`vip:port`, `clusterip:port`, the latter on the
//! Kubernetes Service's ports, mapped to the endpoint ports they target) on captured
//! traffic, so a call to a service's address reaches that service whatever its Host
//! header says (GAMMA). One table serves both paths, so each service port's compiled
//! virtual host is held once per table, shared by the node (per consumer namespace).
//!
//! An HTTP port with routes attached serves their compiled rules (see `compile`); one
//! without serves everything to its own cluster, with the mesh's default retries.

pub(super) mod actions;
mod attached;
pub(super) mod compile;
mod matching;
pub mod regex_budget;
mod rewrite;
#[cfg(test)]
pub(crate) mod tests;

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::Arc;

use aether_api::mesh_config::ResilienceSettings;
use aether_proto::registry::v1::Route as MeshRoute;
use envoy_types::pb::envoy::config::core::v3::{DataSource, data_source};
use envoy_types::pb::envoy::config::route::v3::{
    DirectResponseAction, HeaderMatcher, RetryPolicy, Route, RouteAction, RouteConfiguration, RouteMatch, Vhds,
    VirtualHost, header_matcher, retry_policy, route, route_action, route_match,
};
use envoy_types::pb::envoy::extensions::retry::host::previous_hosts::v3::PreviousHostsPredicate;
use envoy_types::pb::envoy::extensions::retry::priority::previous_priorities::v3::PreviousPrioritiesConfig;
use envoy_types::pb::envoy::r#type::matcher::v3::{RegexMatcher, StringMatcher, string_matcher};
use envoy_types::pb::google::protobuf::Any;
use prost::Message;

use super::clusters::local_name;
use super::http_filters::{self, Callers};
use super::util::{PORT_HEADER, ads, any, millis, u32v};
use super::{MeshService, Named, RouteKey, is_http};
use crate::mesh_settings::MeshSettings;
use crate::pod::LocalPod;
use crate::xds::cache::Resource;
pub use attached::Attached;

pub const OUTBOUND_ROUTES: &str = "outbound";
/// The header an outgoing chain stamps before virtual-host selection (overwriting any
/// client value): the authority (explicit) or the original destination `ip:port`
/// (captured); never sent upstream.
pub const DESTINATION_HEADER: &str = "x-aether-destination";

/// The outbound table of callers in `namespace`: their own when their namespace has
/// consumer routes (`consumers`), else the shared one.
pub fn table_name(namespace: &str, consumers: &BTreeSet<String>) -> String {
    if consumers.contains(namespace) {
        consumer_table(namespace)
    } else {
        OUTBOUND_ROUTES.to_owned()
    }
}

/// The name of the table of its own a namespace with consumer routes gets.
pub fn consumer_table(namespace: &str) -> String {
    format!("{OUTBOUND_ROUTES}~{namespace}")
}

/// The outbound tables as served: each names VHDS for its virtual hosts, resources of
/// their own (`<table>/<service port>`, `<table>/mesh-on-demand`), so a dependency
/// added or changed pushes its virtual hosts, not the table.
#[derive(Clone, Debug, Default)]
pub struct Tables {
    pub tables: Named,
    pub virtual_hosts: Vec<Arc<Resource>>,
}

/// Each service's virtual hosts per table as last built, reused while the service is the
/// same and has no routes attached (whose compilation looks at other services); the
/// generator forgets them when anything else the tables are built from changed. So a
/// new dependency builds and encodes its own virtual hosts, not the node's.
#[derive(Default)]
pub struct Memo {
    built: HashMap<(String, String), (RouteKey, Vec<Built>)>,
}

/// One virtual host as served: the domains it answers to (each once) before they are
/// made unique across its table, and its resource.
struct Built {
    domains: Vec<String>,
    resource: Arc<Resource>,
}

/// One table per caller (the shared one, then one per namespace in `consumers`): each
/// service port's virtual host answers to its authorities and to its destinations.
pub fn route_configs(
    names: &Names,
    services: &[MeshService],
    attached: &Attached,
    consumers: &BTreeSet<String>,
    filters: &Callers,
    mesh: &MeshSettings,
    memo: &mut Memo,
) -> Tables {
    let callers = std::iter::once(None).chain(consumers.iter().map(|ns| Some(ns.as_str())));
    // The mesh-wide MeshConfig's domain: every service answers to its name there too.
    let alias = mesh.mesh().mesh_domain.filter(|d| d != names.mesh_domain);
    let hosts = Hosts {
        names,
        alias: alias.as_deref(),
    };
    let known: HashMap<&str, &MeshService> = services.iter().map(|s| (s.key, s)).collect();
    let mut built_now = HashMap::new();
    let mut out = Tables::default();
    for caller in callers {
        let name = caller.map_or(OUTBOUND_ROUTES.to_owned(), consumer_table);
        // Envoy refuses a table where two virtual hosts share a domain: the first
        // (services are sorted by key) keeps it, so a stale address two services claim
        // never NACKs.
        let mut claimed = HashSet::new();
        for service in services {
            let key = RouteKey::of(service);
            let reusable = !attached.has_routes(service.key);
            let memo_key = (name.clone(), service.key.to_owned());
            let built = match memo.built.remove(&memo_key) {
                Some((was, built)) if reusable && was == key => built,
                _ => {
                    let port_hosts = service_hosts(&hosts, service, &known, attached, caller, filters, mesh);
                    port_hosts.into_iter().map(|host| build(&name, host)).collect()
                }
            };
            for host in &built {
                if host.domains.iter().all(|d| !claimed.contains(d)) {
                    claimed.extend(host.domains.iter().cloned());
                    out.virtual_hosts.push(host.resource.clone());
                } else if let Some(resource) = unclaimed(host, &mut claimed) {
                    out.virtual_hosts.push(resource);
                }
            }
            built_now.insert(memo_key, (key, built));
        }
        // The catch-all too: every table then has a virtual host to send, which Envoy
        // waits for before it uses the table.
        let catch_all = catch_all(names.mesh_domain, &mesh.mesh().resilience);
        out.virtual_hosts
            .push(build(&name, PortHost::plain(catch_all)).resource);
        let config = RouteConfiguration {
            name,
            vhds: Some(Vhds { config_source: ads() }),
            vhost_header: DESTINATION_HEADER.to_owned(),
            request_headers_to_remove: vec![DESTINATION_HEADER.to_owned()],
            // A backend's own header edits win over its rule's (Gateway API applies them last).
            // Set with or without routes (no header edit but the table's own then): a new
            // table version re-sends its virtual hosts, so the first route must not make one.
            most_specific_header_mutations_wins: true,
            ..Default::default()
        };
        out.tables.push((config.name.clone(), any(&config)));
    }
    memo.built = built_now;
    out
}

/// A virtual host of `table` as served: it answers to its destinations too, each domain
/// once, and is named `<table>/<name>` (Envoy keys VHDS virtual hosts by name, and
/// removes them by resource name).
fn build(table: &str, host: PortHost) -> Built {
    let PortHost {
        mut vhost,
        destinations,
    } = host;
    vhost.domains.extend(destinations);
    let mut once = HashSet::new();
    vhost.domains.retain(|d| once.insert(d.clone()));
    vhost.name = format!("{table}/{}", vhost.name);
    Built {
        domains: vhost.domains.clone(),
        resource: Resource::new(vhost.name.clone(), any(&vhost)),
    }
}

/// `host` without the domains an earlier virtual host of its table claimed (rare: a
/// stale address two services claim), or nothing if none is left.
fn unclaimed(host: &Built, claimed: &mut HashSet<String>) -> Option<Arc<Resource>> {
    let mut vhost = VirtualHost::decode(&*host.resource.body.value).ok()?;
    vhost.domains.retain(|d| claimed.insert(d.clone()));
    (!vhost.domains.is_empty()).then(|| Resource::new(vhost.name.clone(), any(&vhost)))
}

/// The table `table` with its VHDS virtual hosts inline, for an Envoy on
/// state-of-the-world ADS (VHDS is delta-only): appended as encoded `virtual_hosts`
/// entries, so no virtual host is decoded again. A table without VHDS is as it was.
pub fn with_virtual_hosts_inline<'a>(table: &Any, vhosts: impl Iterator<Item = &'a Any>) -> Any {
    const VIRTUAL_HOSTS_FIELD: u32 = 2;
    let mut shell = match RouteConfiguration::decode(&*table.value) {
        Ok(shell) if shell.vhds.is_some() => shell,
        _ => return table.clone(),
    };
    shell.vhds = None;
    let mut value = shell.encode_to_vec();
    for vhost in vhosts {
        prost::encoding::encode_key(
            VIRTUAL_HOSTS_FIELD,
            prost::encoding::WireType::LengthDelimited,
            &mut value,
        );
        prost::encoding::encode_varint(vhost.value.len() as u64, &mut value);
        value.extend_from_slice(&vhost.value);
    }
    Any {
        type_url: table.type_url.clone(),
        value,
    }
}

/// The names the generators give services.
pub struct Names<'a> {
    pub mesh_domain: &'a str,
    /// Kubernetes' cluster DNS domain: a service with a Kubernetes Service also answers
    /// to `<svc>.<ns>.svc.<cluster domain>`.
    pub cluster_domain: &'a str,
}

/// The domains services answer to: the node's mesh domain, and the alias the mesh-wide
/// MeshConfig names (proposals/016), which DNS answers too.
struct Hosts<'a> {
    names: &'a Names<'a>,
    alias: Option<&'a str>,
}

impl Hosts<'_> {
    /// A service's names under the mesh domain and its alias.
    fn mesh_names(&self, service: &MeshService) -> Vec<String> {
        let alias = self.alias.map(|domain| super::fqdn(service.key, domain));
        std::iter::once(service.fqdn.clone()).chain(alias).collect()
    }
}

/// One service port's virtual host, compiled once: its domains are the authorities it
/// answers to; `destinations` the `ip:port` a captured connection to it has.
struct PortHost {
    vhost: VirtualHost,
    destinations: Vec<String>,
}

impl PortHost {
    /// A virtual host no captured connection reaches by its address.
    fn plain(vhost: VirtualHost) -> Self {
        PortHost {
            vhost,
            destinations: Vec::new(),
        }
    }
}

/// A dependency service's virtual hosts (one per port) as callers in `caller` (`None`:
/// any namespace without consumer routes) see them; `known`: the node's services, which
/// its routes may name as backends.
fn service_hosts(
    hosts_of: &Hosts,
    service: &MeshService,
    known: &HashMap<&str, &MeshService>,
    attached: &Attached,
    caller: Option<&str>,
    filters: &Callers,
    mesh: &MeshSettings,
) -> Vec<PortHost> {
    let names = hosts_of.names;
    let mut hosts = Vec::new();
    {
        let addresses: Vec<String> = std::iter::once(service.vip)
            .chain(service.cluster_ips.iter().map(String::as_str))
            .map(host_literal)
            .collect();
        let mesh_names = hosts_of.mesh_names(service);
        let kubernetes_names = service.kubernetes_names(names.cluster_domain);
        if service.ports.is_empty() {
            let hostnames: Vec<String> = mesh_names.into_iter().chain(kubernetes_names).collect();
            return vec![unserved(service, &hostnames, &addresses)];
        }
        let (default, kubernetes_default) = (service.default_port(), service.kubernetes_default_port());
        // The destination's namespace decides, as for its routes.
        let resilience = mesh.of(service.service.namespace.as_str()).resilience;
        let (vip, cluster_ips) = (&addresses[0], &addresses[1..]);
        for (port, protocol) in &service.ports {
            // The mesh names and VIP on the endpoint port; the Kubernetes names and the
            // ClusterIPs on each Service port that targets it (GAMMA: a call to
            // ClusterIP:80 of a Service whose port 80 targets 8080 is a call to 8080).
            let kubernetes_ports = service.kubernetes_ports_to(*port);
            let on_kubernetes_ports = |hosts: &[String]| -> Vec<String> { cross(hosts, &kubernetes_ports).collect() };
            let mut domains: Vec<String> = cross(&mesh_names, &[*port]).collect();
            domains.extend(on_kubernetes_ports(&kubernetes_names));
            domains.push(format!("{vip}:{port}"));
            if Some(*port) == default {
                domains.extend(mesh_names.iter().cloned());
                domains.push(vip.clone());
            }
            if Some(*port) == kubernetes_default {
                domains.extend(kubernetes_names.iter().cloned());
            }
            let routes = if is_http(*protocol) {
                attached.on(service, *port, caller)
            } else {
                Vec::new()
            };
            let route_filters = filters.by_route_of(service.key);
            let target = actions::Target {
                mesh_domain: names.mesh_domain,
                port: *port,
                domains: &domains,
                services: known,
                route_filters: &route_filters,
                resilience: &resilience,
            };
            let mut routes = service_routes(service, *port, &routes, &target);
            if service.service.external.is_some() {
                // The caller's decision log names the external service from its route.
                let destination = crate::access_log::decisions::egress_route_metadata(service.key, *port);
                routes.iter_mut().for_each(|r| r.metadata = Some(destination.clone()));
            }
            let on_service = filters.by_service.get(service.key).map_or(&[][..], |n| &n[..]);
            let on_port = (filters.by_service_port.get(service.key))
                .and_then(|ports| ports.get(port))
                .map_or(&[][..], |n| &n[..]);
            hosts.push(PortHost {
                vhost: VirtualHost {
                    name: service.cluster(*port),
                    domains,
                    routes,
                    // Callers-side HTTP filters for this service (disabled in the HCM).
                    typed_per_filter_config: http_filters::enabling(on_service)
                        .chain(http_filters::enabling(on_port))
                        .collect(),
                    // The mesh's own stamp never leaves it (Envoy's router drops its
                    // alt-stat header itself).
                    request_headers_to_remove: match service.service.external {
                        Some(_) => vec![DESTINATION_HEADER.to_owned()],
                        None => Vec::new(),
                    },
                    ..Default::default()
                },
                destinations: std::iter::once(format!("{vip}:{port}"))
                    .chain(on_kubernetes_ports(cluster_ips))
                    .collect(),
            });
        }
    }
    hosts
}

/// A service known but served by nothing right now: a retryable 503, not a 404.
fn unserved(service: &MeshService, hostnames: &[String], addresses: &[String]) -> PortHost {
    let any_port = |h: &String| [h.clone(), format!("{h}:*")];
    PortHost {
        vhost: VirtualHost {
            name: service.fqdn.clone(),
            domains: hostnames.iter().chain(&addresses[..1]).flat_map(any_port).collect(),
            routes: vec![direct(503, "no endpoints for this mesh service\n")],
            ..Default::default()
        },
        destinations: addresses.iter().map(|a| format!("{a}:*")).collect(),
    }
}

/// Every `host:port` of `hosts` and `ports`.
fn cross<'a>(hosts: &'a [String], ports: &'a [u32]) -> impl Iterator<Item = String> + 'a {
    ports
        .iter()
        .flat_map(move |port| hosts.iter().map(move |h| format!("{h}:{port}")))
}

/// A service port's routes: compiled from those attached, or with none everything to
/// the port's cluster.
fn service_routes(service: &MeshService, port: u32, routes: &[&MeshRoute], target: &actions::Target) -> Vec<Route> {
    if !routes.is_empty() {
        return compile::compile(routes, target);
    }
    vec![Route {
        r#match: Some(prefix_match("/")),
        action: Some(route::Action::Route(RouteAction {
            cluster_specifier: Some(route_action::ClusterSpecifier::Cluster(service.cluster(port))),
            timeout: millis(u64::from(target.resilience.request_timeout_ms)),
            retry_policy: mesh_retries(target.resilience.retry_attempts),
            ..Default::default()
        })),
        ..Default::default()
    }]
}

/// Any `<svc>.<ns>.<domain>[:port]` not declared: route by authority to the cluster
/// of that name, which the on_demand filter fetches (404 if the catalog has no such
/// service). Anything else: 404.
fn catch_all(mesh_domain: &str, resilience: &ResilienceSettings) -> VirtualHost {
    let pattern = format!(
        "^[a-z0-9-]+\\.[a-z0-9-]+\\.{}(:[0-9]+)?$",
        mesh_domain.replace('.', "\\.")
    );
    VirtualHost {
        name: "mesh-on-demand".to_owned(),
        domains: vec!["*".to_owned()],
        routes: vec![
            Route {
                r#match: Some(RouteMatch {
                    headers: vec![HeaderMatcher {
                        name: ":authority".to_owned(),
                        header_match_specifier: Some(header_matcher::HeaderMatchSpecifier::StringMatch(
                            StringMatcher {
                                match_pattern: Some(string_matcher::MatchPattern::SafeRegex(RegexMatcher {
                                    regex: pattern,
                                    ..Default::default()
                                })),
                                ..Default::default()
                            },
                        )),
                        ..Default::default()
                    }],
                    ..prefix_match("/")
                }),
                action: Some(route::Action::Route(RouteAction {
                    cluster_specifier: Some(route_action::ClusterSpecifier::ClusterHeader(":authority".to_owned())),
                    cluster_not_found_response_code: route_action::ClusterNotFoundResponseCode::NotFound as i32,
                    timeout: millis(u64::from(resilience.request_timeout_ms)),
                    retry_policy: mesh_retries(resilience.retry_attempts),
                    ..Default::default()
                })),
                ..Default::default()
            },
            direct(404, "not a mesh service\n"),
        ],
        ..Default::default()
    }
}

/// The name of a pod's inbound route table.
pub fn inbound_routes_name(pod: &LocalPod) -> String {
    format!("inbound|{}", pod.id())
}

/// The name of the inbound route to an app port (access logs name the port by it).
pub fn inbound_route_name(port: u16) -> String {
    format!("port-{port}")
}

/// The pod's inbound table: the port header picks the app port; no header means the
/// pod's first HTTP port. The header never reaches the app.
pub fn inbound_routes(pod: &LocalPod, http_ports: &[u16]) -> RouteConfiguration {
    let mut routes: Vec<Route> = http_ports
        .iter()
        .map(|port| Route {
            name: inbound_route_name(*port),
            r#match: Some(RouteMatch {
                headers: vec![HeaderMatcher {
                    name: PORT_HEADER.to_owned(),
                    header_match_specifier: Some(header_matcher::HeaderMatchSpecifier::StringMatch(StringMatcher {
                        match_pattern: Some(string_matcher::MatchPattern::Exact(port.to_string())),
                        ..Default::default()
                    })),
                    ..Default::default()
                }],
                ..prefix_match("/")
            }),
            action: Some(route::Action::Route(to_cluster(local_name(pod, *port)))),
            ..Default::default()
        })
        .collect();
    routes.push(Route {
        name: inbound_route_name(http_ports[0]),
        r#match: Some(prefix_match("/")),
        action: Some(route::Action::Route(to_cluster(local_name(pod, http_ports[0])))),
        ..Default::default()
    });
    RouteConfiguration {
        name: inbound_routes_name(pod),
        virtual_hosts: vec![VirtualHost {
            name: "app".to_owned(),
            domains: vec!["*".to_owned()],
            routes,
            ..Default::default()
        }],
        request_headers_to_remove: vec![PORT_HEADER.to_owned()],
        ..Default::default()
    }
}

/// An address as it appears in a Host header (IPv6 in brackets).
fn host_literal(ip: &str) -> String {
    if ip.contains(':') {
        format!("[{ip}]")
    } else {
        ip.to_owned()
    }
}

fn to_cluster(cluster: String) -> RouteAction {
    RouteAction {
        cluster_specifier: Some(route_action::ClusterSpecifier::Cluster(cluster)),
        ..Default::default()
    }
}

fn prefix_match(prefix: &str) -> RouteMatch {
    RouteMatch {
        path_specifier: Some(route_match::PathSpecifier::Prefix(prefix.to_owned())),
        ..Default::default()
    }
}

pub(super) fn direct(status: u32, body: &str) -> Route {
    Route {
        r#match: Some(prefix_match("/")),
        action: Some(direct_action(status, body)),
        ..Default::default()
    }
}

fn direct_action(status: u32, body: &str) -> route::Action {
    route::Action::DirectResponse(DirectResponseAction {
        status,
        body: Some(DataSource {
            specifier: Some(data_source::Specifier::InlineString(body.to_owned())),
            ..Default::default()
        }),
        ..Default::default()
    })
}

/// Each retry leaves the priorities already tried (until no healthy one is left, then
/// Envoy starts over). Until a failing endpoint is ejected (3 gateway errors) and the
/// node's Envoy workers see that (the cluster's update merge window, up to 1 s), calls
/// still pick it first; a retry at the same priority went back to it when it was the
/// only one there (PreferSameNode's local pod), and the caller got its 503. 1, not 2: a
/// rule with `attempts: 1` must cross too. A service with one priority keeps its retries
/// there, on another host (previous_hosts).
const RETRY_PRIORITY_UPDATE_FREQUENCY: i32 = 1;

/// The mesh's retries, `attempts` of them (MeshConfig's `retries.attempts`; 0: none).
fn mesh_retries(attempts: u32) -> Option<RetryPolicy> {
    (attempts > 0).then(|| RetryPolicy {
        num_retries: u32v(attempts),
        ..retries()
    })
}

/// Retry what is safe to retry: connection failures, refused streams, resets before
/// the request went out, and 503s; on another host, with a short backoff, and at
/// another priority when there is one (see [`RETRY_PRIORITY_UPDATE_FREQUENCY`]). Twice,
/// unless the destination's MeshConfig says otherwise ([`mesh_retries`]).
fn retries() -> RetryPolicy {
    RetryPolicy {
        retry_on: "connect-failure,refused-stream,reset-before-request,retriable-status-codes".to_owned(),
        retriable_status_codes: vec![503],
        num_retries: u32v(2),
        retry_host_predicate: vec![retry_policy::RetryHostPredicate {
            name: "envoy.retry_host_predicates.previous_hosts".to_owned(),
            config_type: Some(retry_policy::retry_host_predicate::ConfigType::TypedConfig(any(
                &PreviousHostsPredicate::default(),
            ))),
        }],
        host_selection_retry_max_attempts: 3,
        retry_priority: Some(retry_policy::RetryPriority {
            name: "envoy.retry_priorities.previous_priorities".to_owned(),
            config_type: Some(retry_policy::retry_priority::ConfigType::TypedConfig(any(
                &PreviousPrioritiesConfig {
                    update_frequency: RETRY_PRIORITY_UPDATE_FREQUENCY,
                },
            ))),
        }),
        retry_back_off: Some(retry_policy::RetryBackOff {
            base_interval: millis(25),
            max_interval: millis(250),
        }),
        ..Default::default()
    }
}
