//! L7 for stream protocols at the destination (proposal 017): a pod port named `thrift*`
//! is parsed by Envoy's `thrift_proxy`, one named `redis*` by its `redis_proxy` and one
//! named `dubbo*` by its `dubbo_proxy` where the pod opts in (`protocol.aether.io/l7`,
//! [`aether_api::pod::l7_protocols`]). They run in
//! the pod's inbound chain for that port, after mTLS is terminated and the port's policies
//! judged the caller, and deliver to the pod's own local cluster, so the caller's
//! identity hop is untouched (an L7 proxy on the caller's side would open its upstream
//! connections without the pod's mark, see the proposal).
//!
//! What it buys: Envoy counts every Thrift and Dubbo message by type and outcome and every
//! Redis command by name and outcome, under [`STAT_SEGMENT`]`.<ns>/<svc>|<port>` (the serving
//! pod's service; `request_metrics::STATS_TAGS` make the service and port tags, re-exposed at the
//! agent's `/metrics`), and a frame it cannot decode closes that connection and is counted
//! (`request_decoding_error`, `downstream_cx_protocol_error`) before it reaches the app.

use envoy_types::pb::envoy::config::listener::v3::Filter;
use envoy_types::pb::envoy::extensions::filters::network::dubbo_proxy::v3 as dubbo;
use envoy_types::pb::envoy::extensions::filters::network::redis_proxy::v3::{RedisProxy, redis_proxy};
use envoy_types::pb::envoy::extensions::filters::network::thrift_proxy::v3::{
    ProtocolType, Route, RouteAction, RouteConfiguration, RouteMatch, ThriftProxy, TransportType, route_action,
    route_match,
};

use envoy_types::pb::envoy::r#type::matcher::v3::{RegexMatcher, StringMatcher, string_matcher};

use super::util::{any, millis};
use crate::pod::{AppProtocol, LocalPod};

/// The stats segment after the protocol's own (`thrift.`, `redis.`) that marks the mesh's
/// L7 trees.
pub const STAT_SEGMENT: &str = "l7";

/// How long Envoy waits for the app's answer to one Redis command before it reconnects.
const REDIS_OP_TIMEOUT_MS: u64 = 30_000;

/// The protocol the pod's `port` is parsed as on the way in, if any.
pub fn parsed(pod: &LocalPod, protocol: AppProtocol) -> Option<AppProtocol> {
    let wanted = aether_api::pod::l7_protocols(&pod.info.annotations).unwrap_or_default();
    wanted.contains(&protocol).then_some(protocol)
}

/// The stats prefix of the L7 tree of `pod`'s `port`: `l7.<ns>/<svc>|<port>`.
pub fn stat_prefix(pod: &LocalPod, port: u16) -> String {
    let service = pod.info.service();
    format!(
        "{STAT_SEGMENT}.{}",
        crate::request_metrics::cluster_stat_name(&service, u32::from(port))
    )
}

/// The terminal filter delivering `pod`'s `port`, parsed as `protocol`, to `cluster`; `None`
/// for a protocol carried as plain TCP.
pub fn inbound_proxy(pod: &LocalPod, port: u16, protocol: AppProtocol, cluster: &str) -> Option<Filter> {
    let stat_prefix = stat_prefix(pod, port);
    let config = match protocol {
        AppProtocol::Thrift => any(&ThriftProxy {
            stat_prefix,
            // Framed, unframed or header transport; binary or compact protocol: Envoy
            // tells from the first bytes, as the app's own server library would.
            transport: TransportType::AutoTransport as i32,
            protocol: ProtocolType::AutoProtocol as i32,
            route_config: Some(RouteConfiguration {
                name: cluster.to_owned(),
                routes: vec![Route {
                    // The empty service name matches every call.
                    r#match: Some(RouteMatch {
                        match_specifier: Some(route_match::MatchSpecifier::ServiceName(String::new())),
                        ..Default::default()
                    }),
                    route: Some(RouteAction {
                        cluster_specifier: Some(route_action::ClusterSpecifier::Cluster(cluster.to_owned())),
                        ..Default::default()
                    }),
                }],
                ..Default::default()
            }),
            ..Default::default()
        }),
        AppProtocol::Redis => any(&RedisProxy {
            stat_prefix,
            settings: Some(redis_proxy::ConnPoolSettings {
                op_timeout: millis(REDIS_OP_TIMEOUT_MS),
                ..Default::default()
            }),
            prefix_routes: Some(redis_proxy::PrefixRoutes {
                catch_all_route: Some(redis_proxy::prefix_routes::Route {
                    cluster: cluster.to_owned(),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        }),
        AppProtocol::Dubbo => any(&dubbo::DubboProxy {
            stat_prefix,
            // The Dubbo protocol with Hessian2 bodies: the only pair Envoy decodes.
            protocol_type: dubbo::ProtocolType::Dubbo as i32,
            serialization_type: dubbo::SerializationType::Hessian2 as i32,
            route_specifier: Some(dubbo::dubbo_proxy::RouteSpecifier::MultipleRouteConfig(
                dubbo::MultipleRouteConfiguration {
                    name: cluster.to_owned(),
                    route_config: vec![dubbo::RouteConfiguration {
                        name: cluster.to_owned(),
                        interface: "*".into(),
                        routes: vec![dubbo::Route {
                            r#match: Some(dubbo::RouteMatch {
                                method: Some(dubbo::MethodMatch {
                                    name: Some(every_name()),
                                    ..Default::default()
                                }),
                                ..Default::default()
                            }),
                            route: Some(dubbo::RouteAction {
                                cluster_specifier: Some(dubbo::route_action::ClusterSpecifier::Cluster(
                                    cluster.to_owned(),
                                )),
                                ..Default::default()
                            }),
                        }],
                        ..Default::default()
                    }],
                },
            )),
            ..Default::default()
        }),
        _ => return None,
    };
    let name = match protocol {
        AppProtocol::Thrift => "envoy.filters.network.thrift_proxy",
        AppProtocol::Dubbo => "envoy.filters.network.dubbo_proxy",
        _ => "envoy.filters.network.redis_proxy",
    };
    Some(Filter {
        name: name.into(),
        config_type: Some(envoy_types::pb::envoy::config::listener::v3::filter::ConfigType::TypedConfig(config)),
    })
}

/// A string matcher for any method name (Envoy wants a non-empty prefix, so a regex).
fn every_name() -> StringMatcher {
    StringMatcher {
        match_pattern: Some(string_matcher::MatchPattern::SafeRegex(RegexMatcher {
            regex: ".*".into(),
            ..Default::default()
        })),
        ..Default::default()
    }
}
