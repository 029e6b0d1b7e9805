//! Small builders shared by the generators.

use envoy_types::pb::envoy::config::core::v3::{
    Address, AggregatedConfigSource, ApiVersion, ConfigSource, DataSource, SocketAddress, SubstitutionFormatString,
    address, config_source, data_source, socket_address, substitution_format_string,
};
use envoy_types::pb::envoy::extensions::filters::http::on_demand::v3::{OnDemand, OnDemandCds};
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::{HttpFilter, http_filter};
use envoy_types::pb::google::protobuf::{Any, Duration, UInt32Value};
use prost::Name;

/// The pod's inbound mTLS listener port (DESIGN: pod_ip:18008).
pub const INBOUND_PORT: u32 = 18008;
/// The explicit outbound HTTP listener, on the pod's loopback.
pub const OUTBOUND_PORT: u32 = 18081;
/// Where the pod's capture rules redirect mesh VIP traffic.
pub const CAPTURE_PORT: u32 = 18001;
/// Tells the destination's inbound listener which app port a request is for (the
/// plaintext seam; with mTLS the port travels as SNI).
pub const PORT_HEADER: &str = "x-aether-port";

pub fn any<T: Name>(message: &T) -> Any {
    envoy_types::pb::google::protobuf::Any {
        type_url: T::type_url(),
        value: prost::Message::encode_to_vec(message),
    }
}

pub fn socket(ip: &str, port: u32, netns: Option<&str>) -> SocketAddress {
    SocketAddress {
        address: ip.to_owned(),
        port_specifier: Some(socket_address::PortSpecifier::PortValue(port)),
        network_namespace_filepath: netns.unwrap_or_default().to_owned(),
        ..Default::default()
    }
}

pub fn address(ip: &str, port: u32, netns: Option<&str>) -> Address {
    Address {
        address: Some(address::Address::SocketAddress(socket(ip, port, netns))),
    }
}

pub fn millis(ms: u64) -> Option<Duration> {
    Some(Duration {
        seconds: (ms / 1000) as i64,
        nanos: ((ms % 1000) * 1_000_000) as i32,
    })
}

pub fn u32v(value: u32) -> Option<UInt32Value> {
    Some(UInt32Value { value })
}

pub fn ads() -> Option<ConfigSource> {
    Some(ConfigSource {
        resource_api_version: ApiVersion::V3 as i32,
        config_source_specifier: Some(config_source::ConfigSourceSpecifier::Ads(AggregatedConfigSource {})),
        ..Default::default()
    })
}

/// The `on_demand` HTTP filter: a request whose route names a cluster Envoy does not hold
/// (or holds still warming) waits up to 2 s for it over ADS instead of failing at once.
pub fn on_demand_filter() -> HttpFilter {
    let on_demand = OnDemand {
        odcds: Some(OnDemandCds {
            source: ads(),
            timeout: millis(2000),
            ..Default::default()
        }),
    };
    HttpFilter {
        name: "envoy.filters.http.on_demand".into(),
        config_type: Some(http_filter::ConfigType::TypedConfig(any(&on_demand))),
        ..Default::default()
    }
}

/// A substitution format string (`%…%` operators expanded; a literal `%` is `%%`).
pub fn format_string(text: String) -> SubstitutionFormatString {
    SubstitutionFormatString {
        format: Some(substitution_format_string::Format::TextFormatSource(DataSource {
            specifier: Some(data_source::Specifier::InlineString(text)),
            ..Default::default()
        })),
        ..Default::default()
    }
}
