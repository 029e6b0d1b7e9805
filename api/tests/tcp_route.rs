//! TCPRoute with Service parents: one rule of weighted backends, projected as a
//! `ROUTE_KIND_TCP` route; what a TCP route cannot hold is refused at apply time and by
//! `validate` wherever a projected route arrives.

use aether_api::{RouteObject, backend_services, parse_documents, project, validate};
use aether_proto::registry::v1::{RouteKind, RouteMatch, RouteParent};

/// A TCPRoute on Service shop/db port 5432 whose `spec.rules` is `rules` (YAML flow).
fn tcp(api_version: &str, rules: &str) -> Result<RouteObject, String> {
    let yaml = format!(
        "apiVersion: gateway.networking.k8s.io/{api_version}\nkind: TCPRoute\n\
         metadata: {{name: db-split, namespace: shop}}\n\
         spec: {{parentRefs: [{{group: '', kind: Service, name: db, port: 5432}}], rules: {rules}}}\n"
    );
    let mut documents = parse_documents(&yaml);
    assert_eq!(documents.len(), 1, "{yaml}");
    documents.remove(0).map_err(|e| e.to_string())
}

#[test]
fn a_tcp_route_projects_one_rule_of_weighted_backends() {
    let object = tcp(
        "v1alpha2",
        "[{name: split, backendRefs: [{name: db-v1, port: 5432, weight: 80}, {name: db-v2, namespace: data, port: 6432, weight: 20}]}]",
    )
    .unwrap();
    assert_eq!(object.key(), "tcp/shop/db-split");
    let route = project(&object).unwrap().expect("a Service parent makes a mesh route");
    assert_eq!(route.kind(), RouteKind::Tcp);
    assert_eq!(
        route.parents,
        [RouteParent {
            service: "shop/db".into(),
            port: 5432
        }]
    );
    assert_eq!(route.rules.len(), 1);
    let rule = &route.rules[0];
    assert_eq!(rule.name, "split");
    let backends: Vec<(&str, u32, u32)> = rule
        .backends
        .iter()
        .map(|b| (b.service.as_str(), b.port, b.weight))
        .collect();
    assert_eq!(backends, [("shop/db-v1", 5432, 80), ("data/db-v2", 6432, 20)]);
    assert!(rule.matches.is_empty() && rule.filters.is_empty() && rule.retry.is_none());
    assert_eq!(
        backend_services(&route).collect::<Vec<_>>(),
        ["shop/db-v1", "data/db-v2"]
    );
    validate(&route).unwrap();
}

#[test]
fn what_a_tcp_route_cannot_hold_is_refused_naming_the_field() {
    let cases = [
        ("[]", "spec.rules", "needs one rule"),
        (
            "[{backendRefs: [{name: a, port: 1}]}, {backendRefs: [{name: b, port: 1}]}]",
            "spec.rules",
            "2 rules",
        ),
        ("[{name: x}]", "spec.rules[0].backendRefs", "at least one backend"),
        ("[{backendRefs: [{name: a}]}]", "spec.rules[0].backendRefs[0].port", ""),
        (
            "[{backendRefs: [{name: a, port: 1, filters: [{type: RequestHeaderModifier}]}]}]",
            "spec.rules[0].backendRefs[0].filters[0]",
            "has no filters",
        ),
        (
            "[{backendRefs: [{name: a, port: 1, weight: -1}]}]",
            "spec.rules[0].backendRefs[0].weight",
            "-1",
        ),
    ];
    for (rules, field, message) in cases {
        let object = tcp("v1alpha2", rules).unwrap();
        let refused = project(&object).expect_err(rules);
        assert_eq!(refused.field, field, "{rules}: {refused}");
        assert_eq!(refused.reason, "UnsupportedValue", "{rules}: {refused}");
        assert!(refused.message.contains(message), "{rules}: {refused}");
    }
}

#[test]
fn only_the_experimental_version_is_served() {
    let error = tcp("v1", "[{backendRefs: [{name: a, port: 1}]}]").unwrap_err();
    assert!(error.contains("apiVersion") && error.contains("v1alpha2"), "{error}");
}

#[test]
fn validate_refuses_request_fields_in_a_projected_tcp_route() {
    let object = tcp("v1alpha2", "[{backendRefs: [{name: a, port: 1}]}]").unwrap();
    let good = project(&object).unwrap().unwrap();
    let mut matched = good.clone();
    matched.rules[0].matches.push(RouteMatch::default());
    let mut timed = good.clone();
    timed.rules[0].request_timeout_ms = 1000;
    let mut two = good.clone();
    two.rules.push(good.rules[0].clone());
    let mut empty = good.clone();
    empty.rules[0].backends.clear();
    for (route, field) in [
        (matched, "rules[0]"),
        (timed, "rules[0]"),
        (two, "rules"),
        (empty, "rules[0].backends"),
    ] {
        let invalid = validate(&route).expect_err(field);
        assert_eq!(invalid.field, field, "{invalid}");
    }
}

/// A TLSRoute on Service shop/payments port 443 with `hostnames` (YAML flow).
fn tls(hostnames: &str) -> RouteObject {
    let yaml = format!(
        "apiVersion: gateway.networking.k8s.io/v1alpha2\nkind: TLSRoute\n\
         metadata: {{name: by-sni, namespace: shop}}\n\
         spec: {{parentRefs: [{{group: '', kind: Service, name: payments, port: 443}}], hostnames: {hostnames}, \
         rules: [{{backendRefs: [{{name: payments-eu, port: 443}}]}}]}}\n"
    );
    parse_documents(&yaml).remove(0).unwrap()
}

#[test]
fn a_tls_route_takes_server_names_lower_cased_and_deduplicated() {
    let route = project(&tls("[Pay.Example.com, '*.eu.example.com', pay.example.com]"))
        .unwrap()
        .unwrap();
    assert_eq!(route.kind(), RouteKind::Tls);
    assert_eq!(aether_proto::view::route_key(&route), "tls/shop/by-sni");
    assert_eq!(route.hostnames, ["pay.example.com", "*.eu.example.com"]);
    assert_eq!(route.rules[0].backends[0].service, "shop/payments-eu");
    validate(&route).unwrap();
    // Without hostnames it takes every connection, like a TCP route.
    assert!(project(&tls("[]")).unwrap().unwrap().hostnames.is_empty());
}

#[test]
fn a_server_name_that_is_no_dns_name_is_refused_naming_it() {
    for (hostnames, field) in [
        ("[ok.example.com, '10.0.0.1']", "spec.hostnames[1]"),
        ("['*']", "spec.hostnames[0]"),
        ("['a.*.example.com']", "spec.hostnames[0]"),
        ("[localhost]", "spec.hostnames[0]"),
        ("['under_score.example.com']", "spec.hostnames[0]"),
    ] {
        let refused = project(&tls(hostnames)).expect_err(hostnames);
        assert_eq!(refused.field, field, "{hostnames}: {refused}");
        assert!(refused.message.contains("is not a server name"), "{refused}");
    }
    let many: Vec<String> = (0..17).map(|i| format!("h{i}.example.com")).collect();
    let refused = project(&tls(&format!("[{}]", many.join(", ")))).unwrap_err();
    assert_eq!(refused.field, "spec.hostnames");
    // Only a TLS route carries server names.
    let mut tcp_route = project(&tcp("v1alpha2", "[{backendRefs: [{name: a, port: 1}]}]").unwrap())
        .unwrap()
        .unwrap();
    tcp_route.hostnames.push("a.example.com".into());
    assert_eq!(validate(&tcp_route).unwrap_err().field, "hostnames");
}

#[test]
fn a_parent_port_of_the_other_kind_of_traffic_is_named() {
    use aether_api::mismatched_ports;
    use aether_proto::registry::v1::Protocol;
    let tcp = project(&tcp("v1alpha2", "[{backendRefs: [{name: a, port: 1}]}]").unwrap())
        .unwrap()
        .unwrap();
    let carries = |protocol: Protocol| move |_: &str, _: u32| Some(protocol);
    assert!(mismatched_ports(&tcp, carries(Protocol::Redis)).is_ok());
    assert!(
        mismatched_ports(&tcp, |_, _| None).is_ok(),
        "unknown ports are not judged"
    );
    let refused = mismatched_ports(&tcp, carries(Protocol::Grpc)).unwrap_err();
    assert_eq!(
        (refused.field.as_str(), refused.reason),
        ("spec.parentRefs", "UnsupportedValue")
    );
    assert!(
        refused
            .message
            .contains("port 5432 of service \"shop/db\" carries HTTP"),
        "{refused}"
    );
    let mut http = tcp.clone();
    http.kind = RouteKind::Http as i32;
    let refused = mismatched_ports(&http, carries(Protocol::Tcp)).unwrap_err();
    assert!(refused.message.contains("carries a TCP stream"), "{refused}");
    assert!(mismatched_ports(&http, carries(Protocol::Http2)).is_ok());
}
