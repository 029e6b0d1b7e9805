use std::collections::HashMap;

use envoy_types::pb::envoy::config::core::v3::{Metadata, RequestMethod};
use envoy_types::pb::envoy::data::accesslog::v3::tls_properties::CertificateProperties;
use envoy_types::pb::envoy::data::accesslog::v3::tls_properties::certificate_properties::SubjectAltName;
use envoy_types::pb::envoy::data::accesslog::v3::{AccessLogCommon, HttpRequestProperties, TlsProperties};
use envoy_types::pb::google::protobuf::Value;

use super::*;

/// An inbound entry to shop/cart-1 port 8080 from frontend, with these RBAC results.
fn entry(results: &[(&str, &str)]) -> HttpAccessLogEntry {
    let fields = results.iter().map(|(k, v)| {
        let value = Value {
            kind: Some(value::Kind::StringValue((*v).into())),
        };
        ((*k).to_owned(), value)
    });
    let metadata = Struct {
        fields: fields.collect(),
    };
    HttpAccessLogEntry {
        common_properties: Some(AccessLogCommon {
            custom_tags: HashMap::from([(DESTINATION_TAG.into(), "shop/cart-1".into())]),
            metadata: Some(Metadata {
                filter_metadata: HashMap::from([(HTTP_METADATA.into(), metadata)]),
                ..Default::default()
            }),
            route_name: "port-8080".into(),
            tls_properties: Some(TlsProperties {
                peer_certificate_properties: Some(CertificateProperties {
                    subject_alt_name: vec![SubjectAltName {
                        san: Some(subject_alt_name::San::Uri(
                            "spiffe://cluster.local/ns/shop/sa/frontend".into(),
                        )),
                    }],
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        }),
        request: Some(HttpRequestProperties {
            request_method: RequestMethod::Post as i32,
            path: "/admin".into(),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn summary(decisions: &[Decision]) -> Vec<String> {
    let line = |d: &Decision| format!("{} {} {:?}", d.verdict.as_str(), d.policy, d.rule);
    decisions.iter().map(line).collect()
}

#[test]
fn a_deny_policy_names_its_policy_rule_source_pod_and_port() {
    let decisions = decisions_of(&entry(&[
        ("deny.enforced_engine_result", "denied"),
        ("deny.enforced_effective_policy_id", "shop/no-admin#2"),
    ]))
    .unwrap();
    assert_eq!(summary(&decisions), ["deny shop/no-admin Some(2)"]);
    let d = &decisions[0];
    assert_eq!(d.source, "spiffe://cluster.local/ns/shop/sa/frontend");
    assert_eq!((d.pod.as_str(), d.port), ("shop/cart-1", 8080));
    assert_eq!((d.method.as_str(), d.path.as_str()), ("POST", "/admin"));
    assert_eq!(d.decided_by(), "policy shop/no-admin rule 2");
}

#[test]
fn a_request_no_allow_policy_matched_names_no_policy() {
    let decisions = decisions_of(&entry(&[
        ("deny.enforced_engine_result", "allowed"),
        ("allow.enforced_engine_result", "denied"),
    ]))
    .unwrap();
    assert_eq!(summary(&decisions), ["deny  None"]);
    assert_eq!(decisions[0].decided_by(), "no ALLOW policy selecting the pod matched");
}

#[test]
fn audit_matches_are_kept_next_to_a_denial_and_dry_run_only_without_one() {
    let audit = [
        ("audit.0.shadow_engine_result", "denied"),
        ("audit.0.shadow_effective_policy_id", "shop/watch#0"),
        ("audit.1.shadow_engine_result", "allowed"),
        ("dry_run.deny.shadow_engine_result", "denied"),
        ("dry_run.deny.shadow_effective_policy_id", "shop/next#1"),
    ];
    let allowed = decisions_of(&entry(&audit)).unwrap();
    assert_eq!(
        summary(&allowed),
        ["audit shop/watch Some(0)", "dry_run_deny shop/next Some(1)"]
    );
    let mut denied = audit.to_vec();
    denied.extend([
        ("deny.enforced_engine_result", "denied"),
        ("deny.enforced_effective_policy_id", "shop/no-admin#0"),
    ]);
    let denied = decisions_of(&entry(&denied)).unwrap();
    assert_eq!(
        summary(&denied),
        ["deny shop/no-admin Some(0)", "audit shop/watch Some(0)"]
    );
}

/// An outbound entry of shop/web-1 calling the external service shop/payments on 443,
/// with these egress RBAC results; the caller's identity from the filter state.
fn egress_entry(results: &[(&str, &str)]) -> HttpAccessLogEntry {
    let mut entry = entry(results);
    let common = entry.common_properties.as_mut().unwrap();
    common.custom_tags = HashMap::from([
        (EGRESS_TAG.into(), "shop/web-1".into()),
        (EGRESS_DESTINATION_TAG.into(), "shop/payments|443".into()),
    ]);
    common.tls_properties = None;
    common.route_name = String::new();
    let identity = envoy_types::pb::google::protobuf::StringValue {
        value: "spiffe://cluster.local/ns/shop/sa/web".into(),
    };
    let identity = Any {
        type_url: "type.googleapis.com/google.protobuf.StringValue".into(),
        value: prost::Message::encode_to_vec(&identity),
    };
    common.filter_state_objects = HashMap::from([(SOURCE_IDENTITY.to_owned(), identity)]);
    entry
}

#[test]
fn a_call_to_an_external_service_names_the_caller_the_service_and_its_port() {
    let decisions = decisions_of(&egress_entry(&[
        ("egress.allow.enforced_engine_result", "denied"),
        ("egress.audit.0.shadow_engine_result", "denied"),
        ("egress.audit.0.shadow_effective_policy_id", "shop/watch#1"),
        // An inbound layer's keys are not this layer's.
        ("deny.enforced_engine_result", "denied"),
    ]))
    .unwrap();
    assert_eq!(summary(&decisions), ["deny  None", "audit shop/watch Some(1)"]);
    let d = &decisions[0];
    assert_eq!(d.source, "spiffe://cluster.local/ns/shop/sa/web");
    assert_eq!(
        (d.pod.as_str(), d.service.as_str(), d.port),
        ("shop/web-1", "shop/payments", 443)
    );
    assert_eq!(d.decided_by(), "no ALLOW policy guarding shop/payments matched");
    let dry = decisions_of(&egress_entry(&[
        ("egress.dry_run.deny.shadow_engine_result", "denied"),
        ("egress.dry_run.deny.shadow_effective_policy_id", "shop/next#0"),
    ]))
    .unwrap();
    assert_eq!(summary(&dry), ["dry_run_deny shop/next Some(0)"]);
    // Kept apart from the decisions on calls to the pod.
    let kept = Decisions::default();
    decisions.into_iter().for_each(|d| kept.record(d));
    assert!(kept.of("shop/web-1").is_empty());
    assert_eq!(kept.of_egress("shop/web-1", "shop/payments").len(), 2);
}

#[test]
fn a_connection_to_an_external_stream_port_carries_what_its_chain_was_compiled_with() {
    let logger = egress_tcp_logger(
        "shop/web-1",
        "shop/db",
        5432,
        &[
            (Verdict::Deny, "shop/no-db#0".into()),
            (Verdict::Audit, "shop/watch#1".into()),
        ],
    );
    let Some(access_log::ConfigType::TypedConfig(config)) = logger.config_type else {
        panic!("typed config")
    };
    let config: TcpGrpcAccessLogConfig = prost::Message::decode(&*config.value).unwrap();
    let common = config.common_config.unwrap();
    let tag = |name: &str| {
        common
            .custom_tags
            .iter()
            .find(|t| t.tag == name)
            .map(|t| t.r#type.clone())
    };
    assert!(
        tag(EGRESS_VERDICTS_TAG).is_some() && logger.filter.is_none(),
        "every connection, tagged"
    );
    let connection = TcpAccessLogEntry {
        common_properties: Some(AccessLogCommon {
            custom_tags: HashMap::from([
                (EGRESS_TAG.into(), "shop/web-1".into()),
                (EGRESS_DESTINATION_TAG.into(), "shop/db|5432".into()),
                (
                    EGRESS_VERDICTS_TAG.into(),
                    "deny=shop/no-db#0,audit=shop/watch#1,bogus=x".into(),
                ),
            ]),
            ..Default::default()
        }),
        ..Default::default()
    };
    let decisions = tcp_decisions_of(&connection).unwrap();
    assert_eq!(
        summary(&decisions),
        ["deny shop/no-db Some(0)", "audit shop/watch Some(1)"]
    );
    let d = &decisions[0];
    assert_eq!(
        (d.pod.as_str(), d.service.as_str(), d.port),
        ("shop/web-1", "shop/db", 5432)
    );
    assert_eq!((d.source.as_str(), d.method.as_str()), ("pod shop/web-1", "TCP"));
}

#[test]
fn an_entry_of_another_logger_is_not_a_decision() {
    let mut other = entry(&[]);
    other.common_properties.as_mut().unwrap().custom_tags.clear();
    assert!(decisions_of(&other).is_none());
}

#[test]
fn decisions_are_counted_by_pod_policy_rule_and_kept_newest_first() {
    let decisions = Decisions::default();
    let denied = decisions_of(&entry(&[
        ("deny.enforced_engine_result", "denied"),
        ("deny.enforced_effective_policy_id", "shop/no-admin#2"),
    ]))
    .unwrap();
    for _ in 0..3 {
        decisions.record(denied[0].clone());
    }
    let mut registry = prometheus_client::registry::Registry::default();
    decisions.register(&mut registry);
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
    assert!(
        text.contains(
            r#"authorization_decisions_total{pod="shop/cart-1",policy="shop/no-admin",rule="2",decision="deny"} 3"#
        ),
        "{text}"
    );
    assert_eq!(decisions.of("shop/cart-1").len(), 3);
    assert!(decisions.of("shop/other").is_empty());
}

#[test]
fn the_logger_ships_a_request_when_any_listed_result_is_denied() {
    let keys = [
        "deny.enforced_engine_result".to_owned(),
        "allow.enforced_engine_result".to_owned(),
    ];
    let log = logger("shop/cart-1", &keys);
    let Some(access_log_filter::FilterSpecifier::OrFilter(or)) = log.filter.unwrap().filter_specifier else {
        panic!("an OR of the results");
    };
    let keys: Vec<String> = or
        .filters
        .iter()
        .map(|f| match &f.filter_specifier {
            Some(access_log_filter::FilterSpecifier::MetadataFilter(m)) => {
                let matcher = m.matcher.as_ref().unwrap();
                assert_eq!(matcher.filter, HTTP_METADATA);
                format!("{:?}", matcher.path[0].segment)
            }
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(keys.len(), 2);
    assert!(keys[0].contains("deny.enforced_engine_result"), "{keys:?}");
}

/// An inbound connection to shop/cart-1's TCP chain (port 5432), closed as Envoy says.
fn connection(termination: &str, results: &[(&str, &str)]) -> TcpAccessLogEntry {
    let mut common = entry(results).common_properties.unwrap();
    let metadata = common.metadata.as_mut().unwrap();
    let shadow = metadata.filter_metadata.remove(HTTP_METADATA).unwrap();
    metadata.filter_metadata.insert(NETWORK_METADATA.into(), shadow);
    common.custom_tags.insert(PORT_TAG.into(), "5432".into());
    common.connection_termination_details = termination.into();
    TcpAccessLogEntry {
        common_properties: Some(common),
        ..Default::default()
    }
}

#[test]
fn a_closed_connection_names_the_policy_from_its_termination_details() {
    let denied = tcp_decisions_of(&connection("rbac_access_denied_matched_policy[shop/no-db#1]", &[])).unwrap();
    assert_eq!(summary(&denied), ["deny shop/no-db Some(1)"]);
    assert_eq!((denied[0].port, denied[0].method.as_str()), (5432, "TCP"));
    assert_eq!(denied[0].source, "spiffe://cluster.local/ns/shop/sa/frontend");
    let unlisted = tcp_decisions_of(&connection("rbac_access_denied_matched_policy[none]", &[])).unwrap();
    assert_eq!(summary(&unlisted), ["deny  None"]);
    let audited = [
        ("audit.0.shadow_engine_result", "denied"),
        ("audit.0.shadow_effective_policy_id", "shop/watch#0"),
    ];
    let open = tcp_decisions_of(&connection("", &audited)).unwrap();
    assert_eq!(summary(&open), ["audit shop/watch Some(0)"]);
}

#[test]
fn the_tcp_logger_ships_rbac_closes_and_shadow_denials_tagged_with_pod_and_port() {
    let keys = [
        "deny.enforced_engine_result".to_owned(),
        "dry_run.deny.shadow_engine_result".to_owned(),
    ];
    let log = tcp_logger("shop/cart-1", 5432, &keys);
    let Some(access_log_filter::FilterSpecifier::OrFilter(or)) = log.filter.unwrap().filter_specifier else {
        panic!("an OR");
    };
    // The CEL close filter, and the one shadow key (enforced results are never metadata on TCP).
    assert_eq!(or.filters.len(), 2);
    let Some(access_log::ConfigType::TypedConfig(any)) = log.config_type else {
        panic!("typed");
    };
    let config = <TcpGrpcAccessLogConfig as prost::Message>::decode(&*any.value).unwrap();
    let tags: Vec<String> = config
        .common_config
        .unwrap()
        .custom_tags
        .into_iter()
        .map(|t| t.tag)
        .collect();
    assert_eq!(tags, [DESTINATION_TAG, PORT_TAG]);
}
