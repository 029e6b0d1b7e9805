//! The clusters of an external service (proposals/017): one per declared port, reaching
//! the outside directly from the node. Its hosts are resolved by Envoy (STRICT_DNS, every
//! address of every host), or its static addresses are used (STATIC). No mesh mTLS: the
//! outside knows nothing of the mesh's identities. A port that asks for it gets TLS
//! originated by Envoy, with the declared server name sent and verified.
//!
//! Pods reach these clusters through their own outbound listeners like any mesh service
//! (the VIP, the mesh name and the hosts route to them), so callers' metrics, routes and
//! timeouts apply; the clusters are shared by the node's pods, a constant number per
//! external service port.

use std::net::SocketAddr;

use aether_api::mesh_config::ResilienceSettings;
use aether_proto::registry::v1::{External, ExternalPort};
use envoy_types::pb::envoy::config::cluster::v3::{Cluster, cluster};
use envoy_types::pb::envoy::config::core::v3::HealthStatus;
use envoy_types::pb::envoy::config::core::v3::{
    DataSource, TransportSocket, TypedExtensionConfig, data_source, transport_socket,
};
use envoy_types::pb::envoy::config::endpoint::v3::{ClusterLoadAssignment, LocalityLbEndpoints};
use envoy_types::pb::envoy::extensions::clusters::common::dns::v3::DnsLookupFamily;
use envoy_types::pb::envoy::extensions::clusters::dns::v3::{DnsCluster, dns_cluster};
use envoy_types::pb::envoy::extensions::network::dns_resolver::cares::v3::CaresDnsResolverConfig;
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::{
    CertificateValidationContext, CommonTlsContext, SubjectAltNameMatcher, UpstreamTlsContext, common_tls_context,
    subject_alt_name_matcher,
};
use envoy_types::pb::envoy::r#type::matcher::v3::{StringMatcher, string_matcher};
use envoy_types::pb::google::protobuf::Any;

use super::clusters::{circuit_breakers, lb_endpoint_at};
use super::util::{address, any, millis};

/// Where Envoy finds the node's CA certificates when a declaration brings none (Debian's
/// `ca-certificates`, which the proxy image installs).
pub const SYSTEM_ROOTS: &str = "/etc/ssl/certs/ca-certificates.crt";
/// How often Envoy resolves a host again; a shorter DNS TTL wins (`respect_dns_ttl`).
const DNS_REFRESH_MS: u64 = 30_000;
/// After a failed resolution, Envoy retries from this, backing off to [`DNS_REFRESH_MS`].
const DNS_FAILURE_RETRY_MS: u64 = 1_000;

/// How the node resolves external hosts: its system resolver, or `--external-dns` servers.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ExternalDns {
    pub servers: Vec<SocketAddr>,
}

/// The clusters of an external service, named `cluster_name(port)` (the names its routes
/// and TCP chains use), with the cluster of its default port under `bare_name` too when set.
pub fn clusters(
    external: &External,
    named: &[(String, u32)],
    resilience: &ResilienceSettings,
    dns: &ExternalDns,
) -> Vec<(String, Any)> {
    named
        .iter()
        .filter_map(|(name, number)| {
            let port = external.ports.iter().find(|p| p.number == *number)?;
            Some((name.clone(), any(&cluster(name, port, external, resilience, dns))))
        })
        .collect()
}

fn cluster(
    name: &str,
    port: &ExternalPort,
    external: &External,
    resilience: &ResilienceSettings,
    dns: &ExternalDns,
) -> Cluster {
    let resolved = external.addresses.is_empty();
    let targets = if resolved { &external.hosts } else { &external.addresses };
    let endpoints = (targets.iter())
        .map(|target| lb_endpoint_at(address(target, port.target_port, None), HealthStatus::Unknown, 1))
        .collect();
    let discovery = match resolved {
        // Envoy's DNS cluster: every address of every host is an endpoint (STRICT_DNS).
        true => cluster::ClusterDiscoveryType::ClusterType(cluster::CustomClusterType {
            name: "envoy.cluster.dns".to_owned(),
            typed_config: Some(any(&dns_cluster(dns))),
        }),
        false => cluster::ClusterDiscoveryType::Type(cluster::DiscoveryType::Static as i32),
    };
    Cluster {
        name: name.to_owned(),
        // Request metrics name the destination like a mesh service's (crate::request_metrics).
        alt_stat_name: crate::request_metrics::authority_stat_name(name, port.number),
        cluster_discovery_type: Some(discovery),
        load_assignment: Some(ClusterLoadAssignment {
            cluster_name: name.to_owned(),
            endpoints: vec![LocalityLbEndpoints {
                lb_endpoints: endpoints,
                ..Default::default()
            }],
            ..Default::default()
        }),
        connect_timeout: millis(u64::from(resilience.connect_timeout_ms)),
        circuit_breakers: Some(circuit_breakers(resilience)),
        transport_socket: port.originate_tls.then(|| originate_tls(external)),
        ..Default::default()
    }
}

/// Resolution every [`DNS_REFRESH_MS`] or the answer's TTL if shorter, retried with backoff
/// after a failure, IPv4 first, through `--external-dns` when set.
fn dns_cluster(dns: &ExternalDns) -> DnsCluster {
    DnsCluster {
        dns_refresh_rate: millis(DNS_REFRESH_MS),
        respect_dns_ttl: true,
        dns_failure_refresh_rate: Some(dns_cluster::RefreshRate {
            base_interval: millis(DNS_FAILURE_RETRY_MS),
            max_interval: millis(DNS_REFRESH_MS),
        }),
        typed_dns_resolver_config: resolver(dns),
        dns_lookup_family: DnsLookupFamily::V4Preferred as i32,
        ..Default::default()
    }
}

/// `--external-dns` as c-ares resolvers that replace the system's; `None`: the system's.
fn resolver(dns: &ExternalDns) -> Option<TypedExtensionConfig> {
    if dns.servers.is_empty() {
        return None;
    }
    let config = CaresDnsResolverConfig {
        resolvers: (dns.servers.iter())
            .map(|s| address(&s.ip().to_string(), u32::from(s.port()), None))
            .collect(),
        ..Default::default()
    };
    Some(TypedExtensionConfig {
        name: "envoy.network.dns_resolver.cares".to_owned(),
        typed_config: Some(any(&config)),
    })
}

/// TLS to the outside: SNI the declared server name (default the first host), the server's
/// certificate verified against the declared CA certificates (default the node's roots)
/// and that name. No client certificate.
fn originate_tls(external: &External) -> TransportSocket {
    let tls = external.tls.clone().unwrap_or_default();
    let server_name = match tls.server_name.is_empty() {
        true => external.hosts.first().cloned().unwrap_or_default(),
        false => tls.server_name,
    };
    let trusted_ca = match tls.ca_certificates.is_empty() {
        true => data_source::Specifier::Filename(SYSTEM_ROOTS.to_owned()),
        false => data_source::Specifier::InlineString(tls.ca_certificates),
    };
    let validation = CertificateValidationContext {
        trusted_ca: Some(DataSource {
            specifier: Some(trusted_ca),
            ..Default::default()
        }),
        match_typed_subject_alt_names: vec![SubjectAltNameMatcher {
            san_type: subject_alt_name_matcher::SanType::Dns as i32,
            matcher: Some(StringMatcher {
                match_pattern: Some(string_matcher::MatchPattern::Exact(server_name.clone())),
                ..Default::default()
            }),
            ..Default::default()
        }],
        ..Default::default()
    };
    let context = UpstreamTlsContext {
        sni: server_name,
        common_tls_context: Some(CommonTlsContext {
            validation_context_type: Some(common_tls_context::ValidationContextType::ValidationContext(validation)),
            ..Default::default()
        }),
        ..Default::default()
    };
    TransportSocket {
        name: "envoy.transport_sockets.tls".into(),
        config_type: Some(transport_socket::ConfigType::TypedConfig(any(&context))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use aether_proto::registry::v1::{ExternalTls, Protocol};
    use prost::Message;

    fn declared(addresses: &[&str], tls: Option<ExternalTls>) -> External {
        External {
            hosts: vec!["api.payments.example".into()],
            ports: vec![
                ExternalPort {
                    number: 80,
                    protocol: Protocol::Http.into(),
                    target_port: 443,
                    originate_tls: true,
                    name: String::new(),
                },
                ExternalPort {
                    number: 5432,
                    protocol: Protocol::Tcp.into(),
                    target_port: 5432,
                    originate_tls: false,
                    name: String::new(),
                },
            ],
            addresses: addresses.iter().map(|a| a.to_string()).collect(),
            tls,
            generation: 1,
        }
    }

    fn built(external: &External, dns: &ExternalDns) -> Vec<Cluster> {
        let named = [
            ("payments.shop.mesh:80".to_owned(), 80),
            ("payments.shop.mesh:5432".to_owned(), 5432),
        ];
        (clusters(external, &named, &ResilienceSettings::default(), dns).into_iter())
            .map(|(_, any)| Cluster::decode(any.value.as_slice()).unwrap())
            .collect()
    }

    fn tls_of(cluster: &Cluster) -> UpstreamTlsContext {
        let Some(transport_socket::ConfigType::TypedConfig(any)) =
            &cluster.transport_socket.as_ref().unwrap().config_type
        else {
            panic!("a typed TLS config")
        };
        UpstreamTlsContext::decode(any.value.as_slice()).unwrap()
    }

    #[test]
    fn hosts_are_resolved_by_envoy_and_tls_is_originated_where_asked() {
        let dns = ExternalDns {
            servers: vec!["10.0.0.53:53".parse().unwrap()],
        };
        let [http, tcp] = <[Cluster; 2]>::try_from(built(&declared(&[], None), &dns)).unwrap();
        assert_eq!(http.alt_stat_name, "shop/payments|80", "metrics name the destination");
        let Some(cluster::ClusterDiscoveryType::ClusterType(custom)) = &http.cluster_discovery_type else {
            panic!("a DNS cluster")
        };
        let resolution = DnsCluster::decode(custom.typed_config.as_ref().unwrap().value.as_slice()).unwrap();
        assert!(resolution.respect_dns_ttl);
        assert_eq!(resolution.dns_refresh_rate, millis(DNS_REFRESH_MS));
        let resolver = resolution.typed_dns_resolver_config.unwrap();
        let cares = CaresDnsResolverConfig::decode(resolver.typed_config.unwrap().value.as_slice()).unwrap();
        assert_eq!(cares.resolvers, vec![address("10.0.0.53", 53, None)]);
        // The host on the target port; TLS with SNI and verification for it, system roots.
        let endpoint = &http.load_assignment.as_ref().unwrap().endpoints[0].lb_endpoints[0];
        assert_eq!(format!("{endpoint:?}").matches("api.payments.example").count(), 1);
        assert!(format!("{endpoint:?}").contains("PortValue(443)"));
        let tls = tls_of(&http);
        assert_eq!(tls.sni, "api.payments.example");
        let context = format!("{:?}", tls.common_tls_context);
        assert!(
            context.contains(SYSTEM_ROOTS) && context.contains("Exact(\"api.payments.example\")"),
            "{context}"
        );
        assert!(
            tls.common_tls_context.unwrap().tls_certificates.is_empty(),
            "no client certificate"
        );
        // Plain TCP: no TLS, the system's resolver when --external-dns is not set.
        assert!(tcp.transport_socket.is_none());
        let [http, _] = <[Cluster; 2]>::try_from(built(&declared(&[], None), &ExternalDns::default())).unwrap();
        let Some(cluster::ClusterDiscoveryType::ClusterType(custom)) = &http.cluster_discovery_type else {
            panic!("a DNS cluster")
        };
        let resolution = DnsCluster::decode(custom.typed_config.as_ref().unwrap().value.as_slice()).unwrap();
        assert!(resolution.typed_dns_resolver_config.is_none());
    }

    #[test]
    fn static_addresses_and_a_declared_ca_and_server_name_are_used() {
        let tls = ExternalTls {
            server_name: "pay.internal.example".into(),
            ca_certificates: "PEM".into(),
        };
        let [http, _] =
            <[Cluster; 2]>::try_from(built(&declared(&["203.0.113.7"], Some(tls)), &ExternalDns::default())).unwrap();
        assert_eq!(
            http.cluster_discovery_type,
            Some(cluster::ClusterDiscoveryType::Type(
                cluster::DiscoveryType::Static as i32
            ))
        );
        let endpoint = format!("{:?}", http.load_assignment.as_ref().unwrap().endpoints[0].lb_endpoints);
        assert!(
            endpoint.contains("203.0.113.7") && !endpoint.contains("api.payments.example"),
            "{endpoint}"
        );
        let tls = tls_of(&http);
        assert_eq!(tls.sni, "pay.internal.example");
        let context = format!("{:?}", tls.common_tls_context);
        assert!(
            context.contains("InlineString(\"PEM\")") && context.contains("pay.internal.example"),
            "{context}"
        );
    }
}
