//! CDS and EDS: one EDS cluster per (dependency service, port), plus the bare-name
//! cluster for the default port; one STATIC delivery cluster per local pod port,
//! connecting to the app on 127.0.0.1 inside the pod's netns.

use std::collections::BTreeMap;

use aether_api::mesh_config::ResilienceSettings;
use aether_proto::registry::v1::{
    Endpoint as MeshEndpoint, Health, Locality as MeshLocality, Protocol, TrafficDistribution,
};
use envoy_types::pb::envoy::config::cluster::v3::{
    CircuitBreakers, Cluster, OutlierDetection, circuit_breakers, cluster,
};
use envoy_types::pb::envoy::config::core::v3::{
    Address, BindConfig, HealthStatus, Http2ProtocolOptions, Locality, Pipe, address,
};
use envoy_types::pb::envoy::config::endpoint::v3::{
    ClusterLoadAssignment, Endpoint, LbEndpoint, LocalityLbEndpoints, cluster_load_assignment, lb_endpoint,
};
use envoy_types::pb::envoy::extensions::upstreams::http::v3::{HttpProtocolOptions, http_protocol_options};
use envoy_types::pb::envoy::r#type::v3::Percent;
use envoy_types::pb::google::protobuf::Any;

use envoy_types::pb::envoy::config::common::mutation_rules::v3::{HeaderMutation as MutationRule, header_mutation};
use envoy_types::pb::envoy::config::core::v3::{HeaderValue, HeaderValueOption, header_value_option};
use envoy_types::pb::envoy::extensions::filters::http::header_mutation::v3::{HeaderMutation, Mutations};
use envoy_types::pb::envoy::extensions::filters::http::upstream_codec::v3::UpstreamCodec;
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::{HttpFilter, http_filter};

use super::transport::Mtls;
use super::util::{INBOUND_PORT, PORT_HEADER, address, ads, any, millis, socket, u32v};
use super::{MeshService, Named, is_http};
use super::{external, origination};

const HTTP_OPTIONS: &str = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions";

pub fn local_name(pod: &crate::pod::LocalPod, port: u16) -> String {
    format!("local|{}|{port}", pod.id())
}

/// Every cluster name a service's clusters go by, with the port each serves.
pub fn service_clusters(service: &MeshService) -> Vec<(String, u32, Protocol)> {
    let mut names: Vec<_> = service
        .ports
        .iter()
        .map(|(port, protocol)| (service.cluster(*port), *port, *protocol))
        .collect();
    if let Some(port) = service.default_port().filter(|_| service.bare) {
        names.push((service.fqdn.clone(), port, service.ports[&port]));
    }
    names
}

/// A dependency service's clusters and their endpoint assignments, with the resilience
/// settings of the service's namespace. Returns (clusters, assignments).
pub fn service_resources(
    service: &MeshService,
    here: Here,
    mtls: Option<&Mtls>,
    resilience: &ResilienceSettings,
    dns: &external::ExternalDns,
) -> (Named, Named) {
    if let Some(declared) = &service.service.external {
        let named: Vec<(String, u32)> = (service_clusters(service).into_iter())
            .map(|(name, port, _)| (name, port))
            .collect();
        return (external::clusters(declared, &named, resilience, dns), Vec::new());
    }
    let endpoints: Vec<&MeshEndpoint> = service.endpoints.map(|e| e.values().collect()).unwrap_or_default();
    let sans = mtls
        .map(|m| server_sans(m, service.key, &endpoints))
        .unwrap_or_default();
    let mut clusters = Vec::new();
    let mut assignments = Vec::new();
    for (name, port, protocol) in service_clusters(service) {
        let cluster = mesh_cluster(&name, port, protocol, mtls, &sans, resilience);
        clusters.push((name.clone(), any(&cluster)));
        let serving: Vec<&MeshEndpoint> = endpoints
            .iter()
            .copied()
            .filter(|e| e.ports.iter().any(|p| p.port == port))
            .collect();
        let http = mtls.is_some().then_some(is_http(protocol));
        let assignment = load_assignment(&name, &serving, here, distribution(service), http);
        assignments.push((name.clone(), any(&assignment)));
    }
    (clusters, assignments)
}

/// The identities a service's endpoints may present: the SPIFFE IDs of the service
/// accounts its endpoints' pods run as (from the catalog), or, with none known, the
/// service account the service is named after (its name defaults to it). Sorted, so
/// the cluster's bytes change only when the set does.
pub fn server_sans(mtls: &Mtls, service_key: &str, endpoints: &[&MeshEndpoint]) -> Vec<String> {
    let (ns, name) = service_key.split_once('/').unwrap_or(("", service_key));
    let mut sans: Vec<String> = endpoints
        .iter()
        .filter_map(|e| e.pod.as_ref())
        .filter(|p| !p.service_account.is_empty())
        .map(|p| {
            mtls.spiffe_id(
                if p.namespace.is_empty() { ns } else { &p.namespace },
                &p.service_account,
            )
        })
        .collect();
    if sans.is_empty() {
        sans.push(mtls.spiffe_id(ns, name));
    }
    sans.sort();
    sans.dedup();
    sans
}

/// A local pod's delivery clusters, one per mesh port.
pub fn pod_clusters(pod: &crate::pod::LocalPod, uds_link_dir: &std::path::Path) -> Vec<(String, Any)> {
    let netns = pod.netns.to_string_lossy();
    let uds = crate::uds::socket_of(&pod.info)
        .filter(|_| !pod.info.uid.is_empty())
        .map(|socket| crate::uds::socket_path(uds_link_dir, &pod.info.uid, &socket));
    pod.info
        .mesh_ports()
        .into_iter()
        .map(|(port, _)| {
            let name = local_name(pod, port);
            let cluster = match &uds {
                Some(path) => uds_cluster(&name, path),
                None => local_cluster(&name, u32::from(port), &netns),
            };
            (name, any(&cluster))
        })
        .collect()
}

/// A pod port delivered to the pod's Unix socket (see `crate::uds`).
fn uds_cluster(name: &str, path: &std::path::Path) -> Cluster {
    let pipe = Address {
        address: Some(address::Address::Pipe(Pipe {
            path: path.to_string_lossy().into_owned(),
            mode: 0,
        })),
    };
    let mut cluster = local_cluster(name, 0, "");
    cluster.upstream_bind_config = None;
    if let Some(assignment) = &mut cluster.load_assignment {
        assignment.endpoints[0].lb_endpoints = vec![lb_endpoint_at(pipe, HealthStatus::Healthy, 1)];
    }
    cluster
}

/// A service port's cluster, shared by every local pod. With mTLS its endpoints are the
/// internal origination hop (see `origination`), which the cluster's metadata tells
/// whom to expect; without, the peers' inbound listeners in plaintext.
pub(super) fn mesh_cluster(
    name: &str,
    port: u32,
    protocol: Protocol,
    mtls: Option<&Mtls>,
    sans: &[String],
    resilience: &ResilienceSettings,
) -> Cluster {
    let mut typed_extension_protocol_options = std::collections::HashMap::new();
    if is_http(protocol) {
        // HTTP travels to the peer's inbound listener as HTTP/2 (over mTLS, ALPN h2).
        let options = HttpProtocolOptions {
            upstream_protocol_options: Some(http_protocol_options::UpstreamProtocolOptions::ExplicitHttpConfig(
                http_protocol_options::ExplicitHttpConfig {
                    protocol_config: Some(
                        http_protocol_options::explicit_http_config::ProtocolConfig::Http2ProtocolOptions(
                            Http2ProtocolOptions::default(),
                        ),
                    ),
                },
            )),
            // Every request on this cluster tells the peer's inbound listener its port.
            http_filters: vec![
                upstream_filter("envoy.filters.http.header_mutation", &stamp_port(port)),
                upstream_filter("envoy.filters.http.upstream_codec", &UpstreamCodec::default()),
            ],
            ..Default::default()
        };
        typed_extension_protocol_options.insert(HTTP_OPTIONS.to_owned(), any(&options));
    }
    Cluster {
        name: name.to_owned(),
        // Request metrics: a dot-free stats name the bootstrap's stats_tags read (crate::request_metrics).
        alt_stat_name: crate::request_metrics::authority_stat_name(name, port),
        cluster_discovery_type: Some(cluster::ClusterDiscoveryType::Type(cluster::DiscoveryType::Eds as i32)),
        eds_cluster_config: Some(cluster::EdsClusterConfig {
            eds_config: ads(),
            service_name: String::new(),
        }),
        connect_timeout: millis(u64::from(resilience.connect_timeout_ms)),
        typed_extension_protocol_options,
        common_lb_config: Some(cluster::CommonLbConfig {
            healthy_panic_threshold: Some(Percent {
                value: PANIC_THRESHOLD_PERCENT,
            }),
            // update_merge_window stays Envoy's 1 s: it batches health flips for every
            // worker, and the delay it puts on an ejection costs a call one retry at the
            // next priority (routes' retry_priority), not an error.
            ..Default::default()
        }),
        outlier_detection: Some(outlier_detection(resilience)),
        circuit_breakers: Some(circuit_breakers(resilience)),
        ignore_health_on_host_removal: true,
        close_connections_on_host_health_failure: true,
        transport_socket: mtls.map(|_| origination::service_socket()),
        // A stream names the app port it is for (HTTP says so in a header).
        metadata: mtls.map(|_| origination::service_metadata(sans, (!is_http(protocol)).then_some(port))),
        ..Default::default()
    }
}

/// Envoy's panic mode (balance over every endpoint, healthy or not) starts below this
/// share of healthy endpoints. Envoy's 50 % would send load to known-bad endpoints while
/// half of a service is healthy; 0 would turn a service with nothing healthy into
/// Envoy's own 503s — for a one-replica service, 30 s to 5 min of them after five 500s
/// (the outlier detector ejects a lone endpoint: its max_ejection_percent check runs
/// before the ejection). At 1 % panic starts only when (almost) nothing is healthy, and
/// then callers reach the service itself as Kubernetes would (it falls back to
/// terminating endpoints too) and see its own answers.
const PANIC_THRESHOLD_PERCENT: f64 = 1.0;

/// The mesh's ejection of misbehaving endpoints: 5 consecutive 5xx, 3 consecutive
/// gateway errors (502/503/504; MeshConfig's `consecutiveGatewayErrors`, 0: never) or 3
/// consecutive connect failures eject an endpoint for 30 s, longer each time it is
/// ejected again (Envoy multiplies the base by the ejection count, up to 5 minutes);
/// never more than half of a service at once (`maxEjectionPercent`), so a bad push
/// cannot empty it.
///
/// The node's Envoy is shared by all its pods, so an ejection is what every caller on
/// the node learned together, and it outlives the calls that caused it (a host that
/// recovers comes back after its ejection time; there is no active health check to
/// return it earlier). `always_eject_one_host` stays off: a small service is protected
/// by the max ejection percent and the panic threshold instead.
fn outlier_detection(resilience: &ResilienceSettings) -> OutlierDetection {
    let gateway_errors = resilience.consecutive_gateway_errors;
    OutlierDetection {
        consecutive_5xx: u32v(5),
        consecutive_gateway_failure: u32v(gateway_errors.max(1)),
        // Envoy counts gateway failures but ejects on them only when told to.
        enforcing_consecutive_gateway_failure: u32v(if gateway_errors == 0 { 0 } else { 100 }),
        consecutive_local_origin_failure: u32v(3),
        split_external_local_origin_errors: true,
        base_ejection_time: millis(30_000),
        max_ejection_time: millis(300_000),
        max_ejection_percent: u32v(resilience.max_ejection_percent),
        ..Default::default()
    }
}

/// Limits sized for one proxy shared by every pod of a node (the built-in
/// [`ResilienceSettings`]): Envoy's defaults (1,024 connections, pending and active
/// requests, 3 concurrent retries per cluster) are sized for one client and would
/// throttle a busy node long before its backends are. Retries are bounded by a budget
/// (a fifth of active requests, at least 32) instead of a fixed count, so they scale
/// with the traffic they protect.
pub(super) fn circuit_breakers(resilience: &ResilienceSettings) -> CircuitBreakers {
    let thresholds = circuit_breakers::Thresholds {
        max_connections: u32v(resilience.max_connections),
        max_pending_requests: u32v(resilience.max_pending_requests),
        max_requests: u32v(resilience.max_requests),
        retry_budget: Some(circuit_breakers::thresholds::RetryBudget {
            budget_percent: Some(Percent { value: 20.0 }),
            min_retry_concurrency: u32v(32),
            ..Default::default()
        }),
        ..Default::default()
    };
    CircuitBreakers {
        thresholds: vec![thresholds],
        ..Default::default()
    }
}

/// A mesh cluster with no endpoints (see `generate`): HTTP, since on-demand is.
pub fn empty_cluster(name: &str, service_key: &str, mtls: Option<&Mtls>, resilience: &ResilienceSettings) -> Any {
    let sans = mtls.map(|m| server_sans(m, service_key, &[])).unwrap_or_default();
    any(&mesh_cluster(name, 0, Protocol::Http, mtls, &sans, resilience))
}

pub fn empty_assignment(name: &str) -> Any {
    any(&ClusterLoadAssignment {
        cluster_name: name.to_owned(),
        ..Default::default()
    })
}

fn stamp_port(port: u32) -> HeaderMutation {
    HeaderMutation {
        mutations: Some(Mutations {
            request_mutations: vec![MutationRule {
                action: Some(header_mutation::Action::Append(HeaderValueOption {
                    header: Some(HeaderValue {
                        key: PORT_HEADER.to_owned(),
                        value: port.to_string(),
                        ..Default::default()
                    }),
                    append_action: header_value_option::HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
                    ..Default::default()
                })),
            }],
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn upstream_filter<T: prost::Name>(name: &str, config: &T) -> HttpFilter {
    HttpFilter {
        name: name.to_owned(),
        config_type: Some(http_filter::ConfigType::TypedConfig(any(config))),
        ..Default::default()
    }
}

fn local_cluster(name: &str, port: u32, netns: &str) -> Cluster {
    Cluster {
        name: name.to_owned(),
        cluster_discovery_type: Some(cluster::ClusterDiscoveryType::Type(
            cluster::DiscoveryType::Static as i32,
        )),
        connect_timeout: millis(1000),
        load_assignment: Some(ClusterLoadAssignment {
            cluster_name: name.to_owned(),
            endpoints: vec![LocalityLbEndpoints {
                lb_endpoints: vec![lb_endpoint_at(
                    address("127.0.0.1", port, None),
                    HealthStatus::Healthy,
                    1,
                )],
                ..Default::default()
            }],
            ..Default::default()
        }),
        // Connect from inside the pod's netns, where the app listens on loopback.
        upstream_bind_config: Some(BindConfig {
            source_address: Some(socket("127.0.0.1", 0, Some(netns))),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// Where this node is, which decides which endpoints are near.
#[derive(Clone, Copy)]
pub struct Here<'a> {
    pub locality: &'a MeshLocality,
    /// This node's name, as endpoints carry it (`Endpoint.node`).
    pub node: &'a str,
}

/// An endpoint's priority (0 first; Envoy moves to the next only when a level has too
/// few healthy endpoints). With the Service's `trafficDistribution`: PreferSameNode puts
/// this node's endpoints first, PreferSameZone this zone's, the rest at 1. Without (or
/// when this node does not know its node name or zone): 0 in this node's zone, 1 in its
/// region, 2 elsewhere, so traffic stays close while it can.
fn priority(endpoint: &MeshEndpoint, here: Here, distribution: TrafficDistribution) -> u32 {
    let locality = endpoint.locality.clone().unwrap_or_default();
    match distribution {
        TrafficDistribution::PreferSameNode if !here.node.is_empty() => u32::from(endpoint.node != here.node),
        TrafficDistribution::PreferSameZone if !here.locality.zone.is_empty() => {
            u32::from(locality.zone != here.locality.zone)
        }
        _ if locality.region == here.locality.region && locality.zone == here.locality.zone => 0,
        _ if locality.region == here.locality.region => 1,
        _ => 2,
    }
}

/// The Service's traffic distribution, if it has a Kubernetes Service.
pub fn distribution(service: &MeshService) -> TrafficDistribution {
    service
        .service
        .kubernetes
        .as_ref()
        .map_or(TrafficDistribution::Unspecified, |k| k.traffic_distribution())
}

/// Endpoints grouped by priority (see [`priority`]) and locality. `originate`: with
/// mTLS, whether the endpoints are reached through the HTTP (`true`) or TCP origination
/// hop.
pub(super) fn load_assignment(
    name: &str,
    endpoints: &[&MeshEndpoint],
    here: Here,
    distribution: TrafficDistribution,
    originate: Option<bool>,
) -> ClusterLoadAssignment {
    let mut groups: BTreeMap<(u32, String, String, String), Vec<LbEndpoint>> = BTreeMap::new();
    for endpoint in endpoints {
        let locality = endpoint.locality.clone().unwrap_or_default();
        let health = match Health::try_from(endpoint.health) {
            Ok(Health::Unhealthy) => HealthStatus::Unhealthy,
            Ok(Health::Draining) => HealthStatus::Draining,
            _ => HealthStatus::Healthy,
        };
        let weight = endpoint.weight.max(1);
        let lb_endpoint = match originate {
            Some(http) => {
                let (address, metadata) = origination::endpoint(&endpoint.address, INBOUND_PORT, http);
                let mut lb_endpoint = lb_endpoint_at(address, health, weight);
                lb_endpoint.metadata = Some(metadata);
                lb_endpoint
            }
            None => lb_endpoint_at(address(&endpoint.address, INBOUND_PORT, None), health, weight),
        };
        groups
            .entry((
                priority(endpoint, here, distribution),
                locality.region,
                locality.zone,
                locality.subzone,
            ))
            .or_default()
            .push(lb_endpoint);
    }
    let preferred = groups.iter().filter(|((p, ..), _)| *p == 0).map(|(_, e)| e.len()).sum();
    ClusterLoadAssignment {
        cluster_name: name.to_owned(),
        policy: all_or_nothing(distribution, preferred),
        endpoints: groups
            .into_iter()
            .map(
                |((priority, region, zone, sub_zone), lb_endpoints)| LocalityLbEndpoints {
                    locality: Some(Locality { region, zone, sub_zone }),
                    lb_endpoints,
                    priority,
                    ..Default::default()
                },
            )
            .collect(),
        ..Default::default()
    }
}

/// Kubernetes' trafficDistribution keeps every request on the preferred endpoints while
/// one of them is ready, and moves all of them when none is. Envoy instead spills a share
/// to the next priority once fewer than 1/1.4 of a level's endpoints are healthy (its
/// overprovisioning factor, default 140 %): a factor of 100 % × the level's endpoint
/// count makes one healthy endpoint enough to hold the whole load, and none (all
/// unhealthy, ejected, draining or gone) a clean failover. Unspecified keeps Envoy's
/// default, as before.
fn all_or_nothing(distribution: TrafficDistribution, preferred: usize) -> Option<cluster_load_assignment::Policy> {
    if distribution == TrafficDistribution::Unspecified {
        return None;
    }
    let factor = u32::try_from(preferred.max(1))
        .unwrap_or(u32::MAX / 100)
        .saturating_mul(100);
    Some(cluster_load_assignment::Policy {
        overprovisioning_factor: u32v(factor),
        ..Default::default()
    })
}

pub(super) fn lb_endpoint_at(
    address: envoy_types::pb::envoy::config::core::v3::Address,
    health: HealthStatus,
    weight: u32,
) -> LbEndpoint {
    LbEndpoint {
        host_identifier: Some(lb_endpoint::HostIdentifier::Endpoint(Endpoint {
            address: Some(address),
            ..Default::default()
        })),
        health_status: health as i32,
        load_balancing_weight: u32v(weight),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mesh_clusters_eject_bad_endpoints_and_are_sized_for_a_node() {
        let built_in = ResilienceSettings::default();
        let cluster = mesh_cluster(
            "echo.gamma.aether.internal:80",
            80,
            Protocol::Http,
            None,
            &[],
            &built_in,
        );
        let outlier = cluster.outlier_detection.unwrap();
        // Gateway errors count only when enforced (Envoy's default enforcement is 0).
        assert_eq!(outlier.consecutive_gateway_failure, u32v(3));
        assert_eq!(outlier.enforcing_consecutive_gateway_failure, u32v(100));
        assert_eq!(outlier.max_ejection_percent, u32v(50));
        // Panic (every endpoint) only when nothing is healthy: never Envoy's own 503s for a
        // service whose every replica was ejected, never load on bad ones while one is good.
        let panic = cluster.common_lb_config.unwrap().healthy_panic_threshold.unwrap();
        assert!(panic.value > 0.0 && panic.value <= 1.0, "{panic:?}");
        let seconds = |d: Option<envoy_types::pb::google::protobuf::Duration>| d.unwrap().seconds;
        assert!(
            seconds(outlier.max_ejection_time) > seconds(outlier.base_ejection_time),
            "ejections back off"
        );
        let limits = &cluster.circuit_breakers.unwrap().thresholds[0];
        assert!(
            limits.max_requests.unwrap().value > 1024,
            "above Envoy's per-client default"
        );
        assert!(limits.retry_budget.is_some() && limits.max_retries.is_none());
    }

    #[test]
    fn a_namespace_resilience_settings_shape_its_clusters() {
        let settings = ResilienceSettings {
            connect_timeout_ms: 250,
            consecutive_gateway_errors: 0,
            max_ejection_percent: 20,
            max_connections: 100,
            max_pending_requests: 10,
            max_requests: 1000,
            ..ResilienceSettings::default()
        };
        let cluster = mesh_cluster(
            "orders.shop.aether.internal:80",
            80,
            Protocol::Http,
            None,
            &[],
            &settings,
        );
        assert_eq!(cluster.connect_timeout, millis(250));
        let outlier = cluster.outlier_detection.unwrap();
        assert_eq!(
            outlier.enforcing_consecutive_gateway_failure,
            u32v(0),
            "0: never ejects on them"
        );
        assert_eq!(outlier.max_ejection_percent, u32v(20));
        let limits = &cluster.circuit_breakers.unwrap().thresholds[0];
        let values = [
            &limits.max_connections,
            &limits.max_pending_requests,
            &limits.max_requests,
        ];
        assert_eq!(values.map(|v| v.unwrap().value), [100, 10, 1000]);
    }

    fn endpoint(address: &str, node: &str, region: &str, zone: &str) -> MeshEndpoint {
        MeshEndpoint {
            address: address.into(),
            node: node.into(),
            locality: Some(MeshLocality {
                region: region.into(),
                zone: zone.into(),
                subzone: String::new(),
            }),
            ..Default::default()
        }
    }

    /// (priority, endpoint addresses) per group, and the overprovisioning factor.
    fn placed(here: Here, distribution: TrafficDistribution) -> (Vec<(u32, Vec<String>)>, Option<u32>) {
        let endpoints = [
            endpoint("10.0.0.1", "n1", "eu", "a"),
            endpoint("10.0.0.2", "n1", "eu", "a"),
            endpoint("10.0.0.3", "n2", "eu", "a"),
            endpoint("10.0.0.4", "n3", "eu", "b"),
            endpoint("10.0.0.5", "n4", "us", "c"),
        ];
        let refs: Vec<&MeshEndpoint> = endpoints.iter().collect();
        let assignment = load_assignment("svc", &refs, here, distribution, None);
        let mut groups: BTreeMap<u32, Vec<String>> = BTreeMap::new();
        for group in &assignment.endpoints {
            for e in &group.lb_endpoints {
                let Some(lb_endpoint::HostIdentifier::Endpoint(endpoint)) = &e.host_identifier else {
                    panic!()
                };
                let Some(envoy_types::pb::envoy::config::core::v3::address::Address::SocketAddress(socket)) =
                    endpoint.address.as_ref().unwrap().address.as_ref()
                else {
                    panic!()
                };
                groups.entry(group.priority).or_default().push(socket.address.clone());
            }
        }
        let factor = assignment
            .policy
            .and_then(|p| p.overprovisioning_factor)
            .map(|f| f.value);
        (groups.into_iter().collect(), factor)
    }

    fn ips(last: &[u8]) -> Vec<String> {
        last.iter().map(|i| format!("10.0.0.{i}")).collect()
    }

    #[test]
    fn prefer_same_node_puts_this_nodes_endpoints_first_and_holds_them_while_one_is_healthy() {
        let locality = MeshLocality {
            region: "eu".into(),
            zone: "a".into(),
            subzone: String::new(),
        };
        let here = Here {
            locality: &locality,
            node: "n1",
        };
        let (groups, factor) = placed(here, TrafficDistribution::PreferSameNode);
        assert_eq!(groups, [(0, ips(&[1, 2])), (1, ips(&[3, 4, 5]))]);
        // Two preferred endpoints: one healthy of two still carries everything.
        assert_eq!(factor, Some(200));

        let (groups, factor) = placed(here, TrafficDistribution::PreferSameZone);
        assert_eq!(groups, [(0, ips(&[1, 2, 3])), (1, ips(&[4, 5]))]);
        assert_eq!(factor, Some(300));

        // Unspecified: zone, then region, then the rest, with Envoy's default spill-over.
        let (groups, factor) = placed(here, TrafficDistribution::Unspecified);
        assert_eq!(groups, [(0, ips(&[1, 2, 3])), (1, ips(&[4])), (2, ips(&[5]))]);
        assert_eq!(factor, None);
    }

    #[test]
    fn a_node_that_does_not_know_where_it_is_keeps_the_default_order() {
        let locality = MeshLocality::default();
        let nowhere = Here {
            locality: &locality,
            node: "",
        };
        let (unspecified, _) = placed(nowhere, TrafficDistribution::Unspecified);
        assert_eq!(placed(nowhere, TrafficDistribution::PreferSameNode).0, unspecified);
        assert_eq!(placed(nowhere, TrafficDistribution::PreferSameZone).0, unspecified);
        // Still one group first and the rest after: the region is what endpoints lack too.
        assert_eq!(unspecified, [(2, ips(&[1, 2, 3, 4, 5]))]);
    }
}
