use envoy_types::pb::envoy::config::core::v3::{RequestMethod, SocketAddress, socket_address};
use envoy_types::pb::envoy::data::accesslog::v3::{AccessLogCommon, HttpRequestProperties, HttpResponseProperties};
use envoy_types::pb::google::protobuf::{Timestamp, UInt32Value};

use super::*;

fn failure(authority: &str, status: u32) -> Failure {
    Failure {
        at_ms: 1,
        method: "GET".into(),
        authority: authority.into(),
        path: "/".into(),
        status,
        flags: String::new(),
        details: String::new(),
        route: String::new(),
        upstream_cluster: String::new(),
        upstream_host: String::new(),
        upstream_failure: String::new(),
        duration_ms: 0,
    }
}

fn names(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| (*s).to_owned()).collect()
}

#[test]
fn a_ring_keeps_the_newest_failures_of_a_pod_newest_first() {
    let recent = RecentFailures::default();
    for status in 0..(PER_POD as u32 + 5) {
        recent.record("demo/a", failure("echo.demo.aether.internal", 500 + status));
    }
    let kept = recent.of("demo/a", &names(&["echo.demo.aether.internal"]));
    assert_eq!(kept.len(), PER_POD);
    assert_eq!(kept[0].status, 500 + PER_POD as u32 + 4);
    assert_eq!(kept.last().unwrap().status, 505);
    assert!(recent.of("demo/b", &names(&["echo.demo.aether.internal"])).is_empty());
}

#[test]
fn the_pod_that_failed_least_recently_is_evicted_first() {
    let recent = RecentFailures::default();
    let echo = names(&["echo.demo.aether.internal"]);
    for pod in 0..MAX_PODS {
        recent.record(&format!("demo/p{pod}"), failure("echo.demo.aether.internal", 503));
    }
    // p0 fails again, so p1 is now the oldest.
    recent.record("demo/p0", failure("echo.demo.aether.internal", 503));
    recent.record("demo/new", failure("echo.demo.aether.internal", 503));
    assert_eq!(recent.of("demo/p0", &echo).len(), 2);
    assert!(recent.of("demo/p1", &echo).is_empty());
    assert_eq!(recent.of("demo/new", &echo).len(), 1);
}

#[test]
fn a_failure_is_to_a_target_by_authority_or_cluster_in_any_of_its_names() {
    let target = names(&["echo.demo.aether.internal", "echo.demo.svc", "240.240.0.9"]);
    let to = |authority: &str, cluster: &str| {
        let mut f = failure(authority, 503);
        f.upstream_cluster = cluster.into();
        f.is_to(&target)
    };
    assert!(to("echo.demo.aether.internal", ""));
    assert!(to("echo.demo.aether.internal:8080", ""));
    assert!(to("echo.demo.svc.cluster.local:80", ""));
    assert!(to("240.240.0.9:80", ""));
    // A split to another service is still a call to the target's name.
    assert!(to("anything", "echo.demo.aether.internal:80"));
    assert!(!to("echo-v2.demo.aether.internal", "echo-v2.demo.aether.internal:80"));
    assert!(!to("echo.demo.aether.internal.evil", ""));
}

#[test]
fn an_envoy_entry_becomes_a_failure_of_the_tagged_pod() {
    let entry = HttpAccessLogEntry {
        common_properties: Some(AccessLogCommon {
            start_time: Some(Timestamp {
                seconds: 1_700_000_000,
                nanos: 5_000_000,
            }),
            duration: Some(ProtoDuration {
                seconds: 2,
                nanos: 500_000_000,
            }),
            upstream_cluster: "echo.demo.aether.internal:80".into(),
            upstream_remote_address: Some(Address {
                address: Some(address::Address::SocketAddress(SocketAddress {
                    address: "10.1.0.7".into(),
                    port_specifier: Some(socket_address::PortSpecifier::PortValue(18008)),
                    ..Default::default()
                })),
            }),
            upstream_transport_failure_reason: "TLS_error: SAN mismatch".into(),
            route_name: "http/demo/canary/1".into(),
            response_flags: Some(ResponseFlags {
                upstream_connection_failure: true,
                upstream_retry_limit_exceeded: true,
                ..Default::default()
            }),
            custom_tags: [(SOURCE_TAG.to_owned(), "demo/frontend".to_owned())].into(),
            ..Default::default()
        }),
        request: Some(HttpRequestProperties {
            request_method: RequestMethod::Post as i32,
            authority: "echo.demo.aether.internal".into(),
            path: "/orders".into(),
            ..Default::default()
        }),
        response: Some(HttpResponseProperties {
            response_code: Some(UInt32Value { value: 503 }),
            response_code_details: "upstream_reset_before_response_started".into(),
            ..Default::default()
        }),
        ..Default::default()
    };
    let (pod, f) = failure_of(entry.clone()).unwrap();
    assert_eq!(pod, "demo/frontend");
    assert_eq!(
        (f.method.as_str(), f.path.as_str(), f.status, f.flags.as_str()),
        ("POST", "/orders", 503, "UF,URX")
    );
    assert_eq!((f.at_ms, f.duration_ms), (1_700_000_000_005, 2500));
    assert_eq!(f.upstream_host, "10.1.0.7:18008");
    assert_eq!(f.route, "http/demo/canary/1");
    assert_eq!(f.upstream_failure, "TLS_error: SAN mismatch");
    assert_eq!(f.details, "upstream_reset_before_response_started");
    // Not ours (no tag): ignored. A reset: status 0.
    let mut untagged = entry.clone();
    untagged.common_properties.as_mut().unwrap().custom_tags.clear();
    assert!(failure_of(untagged).is_none());
    let mut reset = entry.clone();
    reset.response = None;
    assert_eq!(failure_of(reset).unwrap().1.status, 0);
    // Shipped for an authorization decision only (an audited call that went well): no failure.
    let mut audited = entry.clone();
    audited.common_properties.as_mut().unwrap().response_flags = None;
    audited.response.as_mut().unwrap().response_code =
        Some(envoy_types::pb::google::protobuf::UInt32Value { value: 200 });
    assert!(failure_of(audited).is_none());
    // A client's long path is kept bounded, with its size.
    let mut long = entry;
    long.request.as_mut().unwrap().path = format!("/{}", "a".repeat(100_000));
    let path = failure_of(long).unwrap().1.path;
    assert!(path.len() < 1024 && path.ends_with("(100001 bytes)"), "{path}");
}

#[test]
fn the_logger_ships_failures_and_egress_decisions_tagged_with_the_pod() {
    let log = logger("demo/frontend", &["egress.deny.enforced_engine_result".to_owned()]);
    let Some(access_log_filter::FilterSpecifier::OrFilter(or)) = log.filter.unwrap().filter_specifier else {
        panic!("not an or filter")
    };
    assert_eq!(or.filters.len(), 3, "status, flags, the egress result");
    let Some(access_log::ConfigType::TypedConfig(any)) = log.config_type else {
        panic!()
    };
    let config: HttpGrpcAccessLogConfig = prost::Message::decode(&*any.value).unwrap();
    let common = config.common_config.unwrap();
    assert_eq!(common.custom_tags[0].tag, SOURCE_TAG);
    let Some(grpc_service::TargetSpecifier::EnvoyGrpc(target)) = common.grpc_service.unwrap().target_specifier else {
        panic!()
    };
    assert_eq!(target.cluster_name, AGENT_CLUSTER);
}
