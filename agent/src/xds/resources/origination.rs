//! The origination hop (with mTLS): how a pod's connection to a mesh service leaves
//! the node with that pod's own certificate, at a cost of O(pods + services) in Envoy
//! rather than O(pods × services) (proposal 007).
//!
//! 1. The pod's outgoing listeners mark each connection with the pod
//!    (`aether.source_pod`, hashable, shared with upstream transitively), so it keys
//!    every connection pool on the way: two pods never share an upstream connection.
//! 2. A service cluster (shared by all local pods, no TLS) balances over its endpoints,
//!    each an internal address on `originate|h2` or `originate|tcp` with the real
//!    destination in the endpoint's metadata; the cluster's metadata carries the SPIFFE
//!    IDs its endpoints may present. Its `internal_upstream` transport hands both on.
//! 3. The internal listener turns them into filter state (the original destination, the
//!    SANs to verify, ALPN h2 on the HTTP one, on the TCP one the server name that names
//!    the app port, `port-<port>.aether`) and proxies the bytes to the originate
//!    cluster of the source pod, `originate|<ns>/<pod>`, named from the pod marker.
//! 4. That `ORIGINAL_DST` cluster is the pod's own: its only TLS socket presents the
//!    pod's SVID and checks the server against the trust domain and the service's SANs.
//!    A connection without a pod marker names no cluster and is closed.
//!
//! So adding a pod adds its own cluster and changes no shared resource, there is no
//! selection among pods' sockets at all, and an SVID rotation is an SDS update only.
//! Two internal listeners, because the peer's inbound listener picks its HTTP chain by
//! ALPN.

use std::collections::HashMap;

use envoy_types::pb::envoy::config::cluster::v3::{CircuitBreakers, Cluster, circuit_breakers, cluster};
use envoy_types::pb::envoy::config::core::v3::{
    Address, EnvoyInternalAddress, Metadata, TransportSocket, address, envoy_internal_address, transport_socket,
};
use envoy_types::pb::envoy::config::listener::v3::{Filter, FilterChain, Listener, filter, listener};
use envoy_types::pb::envoy::extensions::filters::common::set_filter_state::v3::{FilterStateValue, filter_state_value};
use envoy_types::pb::envoy::extensions::filters::network::set_filter_state::v3::Config as SetFilterState;
use envoy_types::pb::envoy::extensions::filters::network::tcp_proxy::v3::{TcpProxy, tcp_proxy};
use envoy_types::pb::envoy::extensions::transport_sockets::internal_upstream::v3::{
    InternalUpstreamTransport, internal_upstream_transport,
};
use envoy_types::pb::envoy::extensions::transport_sockets::raw_buffer::v3::RawBuffer;
use envoy_types::pb::envoy::r#type::metadata::v3::{MetadataKind, metadata_kind};
use envoy_types::pb::google::protobuf::{Any, Struct, Value, value};

use super::transport::{self, Mtls};
use super::util::{any, format_string, millis, u32v};

/// Endpoint metadata namespace: `dst` is the real `ip:port`.
const ENDPOINT_METADATA: &str = "aether.ep";
/// Cluster metadata namespace: `san` is the comma-separated SPIFFE IDs to verify.
const SERVICE_METADATA: &str = "aether.svc";

/// The internal listener that HTTP (`true`) or TCP service clusters hand their
/// connections to.
pub fn name(http: bool) -> &'static str {
    if http { "originate|h2" } else { "originate|tcp" }
}

/// A local pod's originate cluster.
pub fn pod_cluster_name(pod_id: &str) -> String {
    format!("originate|{pod_id}")
}

/// The transport of a service cluster: an internal connection to `originate|…` that
/// carries the endpoint's destination and the cluster's SANs along.
pub fn service_socket() -> TransportSocket {
    let passthrough = |kind: metadata_kind::Kind, name: &str| internal_upstream_transport::MetadataValueSource {
        kind: Some(MetadataKind { kind: Some(kind) }),
        name: name.to_owned(),
    };
    let config = InternalUpstreamTransport {
        passthrough_metadata: vec![
            passthrough(metadata_kind::Kind::Host(metadata_kind::Host {}), ENDPOINT_METADATA),
            passthrough(
                metadata_kind::Kind::Cluster(metadata_kind::Cluster {}),
                SERVICE_METADATA,
            ),
        ],
        transport_socket: Some(TransportSocket {
            name: "envoy.transport_sockets.raw_buffer".into(),
            config_type: Some(transport_socket::ConfigType::TypedConfig(any(&RawBuffer {}))),
        }),
    };
    TransportSocket {
        name: "envoy.transport_sockets.internal_upstream".into(),
        config_type: Some(transport_socket::ConfigType::TypedConfig(any(&config))),
    }
}

fn metadata(namespace: &str, key: &str, text: String) -> Metadata {
    let fields = HashMap::from([(
        key.to_owned(),
        Value {
            kind: Some(value::Kind::StringValue(text)),
        },
    )]);
    Metadata {
        filter_metadata: HashMap::from([(namespace.to_owned(), Struct { fields })]),
        ..Default::default()
    }
}

/// A service cluster's metadata: the identities its endpoints may present, and for a TCP
/// stream the server name that tells the peer which app port it is for.
pub fn service_metadata(server_sans: &[String], stream_port: Option<u32>) -> Metadata {
    let mut metadata = metadata(SERVICE_METADATA, "san", server_sans.join(","));
    if let Some(port) = stream_port {
        let fields = &mut metadata
            .filter_metadata
            .get_mut(SERVICE_METADATA)
            .expect("just made")
            .fields;
        let sni = Value {
            kind: Some(value::Kind::StringValue(port_server_name(port))),
        };
        fields.insert("sni".to_owned(), sni);
    }
    metadata
}

/// The server name (SNI) a TCP stream to a pod's app `port` carries over mTLS: the
/// peer's inbound listener picks that port's chain by it (HTTP says the port in a header).
pub fn port_server_name(port: u32) -> String {
    format!("port-{port}.aether")
}

/// A service endpoint: its internal address (one host per destination) and metadata.
pub fn endpoint(ip: &str, port: u32, http: bool) -> (Address, Metadata) {
    let destination = match ip.parse::<std::net::Ipv6Addr>() {
        Ok(_) => format!("[{ip}]:{port}"),
        Err(_) => format!("{ip}:{port}"),
    };
    let address = Address {
        address: Some(address::Address::EnvoyInternalAddress(EnvoyInternalAddress {
            address_name_specifier: Some(envoy_internal_address::AddressNameSpecifier::ServerListenerName(
                name(http).to_owned(),
            )),
            endpoint_id: destination.clone(),
        })),
    };
    (address, metadata(ENDPOINT_METADATA, "dst", destination))
}

/// The two internal listeners (LDS).
pub fn listeners() -> Vec<(String, Any)> {
    [true, false]
        .into_iter()
        .map(|http| (name(http).to_owned(), any(&internal_listener(http))))
        .collect()
}

fn internal_listener(http: bool) -> Listener {
    let value = |key: &str, format: String, shared: filter_state_value::SharedWithUpstream| FilterStateValue {
        key: Some(filter_state_value::Key::ObjectKey(key.to_owned())),
        value: Some(filter_state_value::Value::FormatString(format_string(format))),
        shared_with_upstream: shared as i32,
        ..Default::default()
    };
    use filter_state_value::SharedWithUpstream::{None as Here, Once};
    let mut values = vec![
        value(
            "envoy.network.transport_socket.original_dst_address",
            format!("%DYNAMIC_METADATA({ENDPOINT_METADATA}:dst)%"),
            Here,
        ),
        value(
            "envoy.network.upstream_subject_alt_names",
            format!("%DYNAMIC_METADATA({SERVICE_METADATA}:san)%"),
            Once,
        ),
        // The source pod's own cluster; without a marker, "originate|-", which does not exist.
        value(
            "envoy.tcp_proxy.cluster",
            pod_cluster_name(&format!("%FILTER_STATE({}:PLAIN)%", transport::SOURCE_FILTER_STATE)),
            Here,
        ),
    ];
    if http {
        values.push(value(
            "envoy.network.application_protocols",
            transport::ALPN_H2.to_owned(),
            Once,
        ));
    } else {
        values.push(value(
            "envoy.network.upstream_server_name",
            format!("%DYNAMIC_METADATA({SERVICE_METADATA}:sni)%"),
            Once,
        ));
    }
    let set = SetFilterState {
        on_new_connection: values,
        ..Default::default()
    };
    let proxy = TcpProxy {
        stat_prefix: name(http).replace('|', "_"),
        // Used only when no cluster is named per connection, and never exists: closed.
        cluster_specifier: Some(tcp_proxy::ClusterSpecifier::Cluster(pod_cluster_name("-"))),
        ..Default::default()
    };
    let filter = |name: &str, config: Any| Filter {
        name: name.to_owned(),
        config_type: Some(filter::ConfigType::TypedConfig(config)),
    };
    Listener {
        name: name(http).to_owned(),
        listener_specifier: Some(listener::ListenerSpecifier::InternalListener(
            listener::InternalListenerConfig {},
        )),
        filter_chains: vec![FilterChain {
            filters: vec![
                filter("envoy.filters.network.set_filter_state", any(&set)),
                filter("envoy.filters.network.tcp_proxy", any(&proxy)),
            ],
            ..Default::default()
        }],
        ..Default::default()
    }
}

/// A local pod's originate cluster (CDS): original destination, the pod's SVID.
pub fn pod_cluster(mtls: &Mtls, pod_id: &str) -> (String, Any) {
    let name = pod_cluster_name(pod_id);
    let unlimited = u32v(u32::MAX);
    let cluster = Cluster {
        name: name.clone(),
        // Stats under a dot-free name (pod ids hold a slash).
        alt_stat_name: format!("originate_{:016x}", aether_common::hash::fnv1a(pod_id.as_bytes())),
        cluster_discovery_type: Some(cluster::ClusterDiscoveryType::Type(
            cluster::DiscoveryType::OriginalDst as i32,
        )),
        lb_policy: cluster::LbPolicy::ClusterProvided as i32,
        connect_timeout: millis(1000),
        // Every upstream connection of the pod passes here: the service clusters keep
        // their own limits, this one must not add a cap of its own.
        circuit_breakers: Some(CircuitBreakers {
            thresholds: vec![circuit_breakers::Thresholds {
                max_connections: unlimited,
                max_pending_requests: unlimited,
                max_requests: unlimited,
                max_retries: unlimited,
                ..Default::default()
            }],
            ..Default::default()
        }),
        transport_socket: Some(transport::pod_upstream(mtls, pod_id)),
        ..Default::default()
    };
    (name, any(&cluster))
}
