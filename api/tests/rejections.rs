//! Each refusal names its condition, the Gateway API reason and the field, and quotes the
//! input; YAML errors name the document and the field.

use aether_api::{ConditionType, RouteObject, parse_documents, project};

/// An HTTPRoute on Service shop/cart whose first rule is `rule` (YAML flow mapping).
fn http(rule: &str) -> RouteObject {
    grab(&format!(
        "apiVersion: gateway.networking.k8s.io/v1\nkind: HTTPRoute\nmetadata: {{name: r, namespace: shop}}\n\
         spec: {{parentRefs: [{{group: '', kind: Service, name: cart}}], rules: [{rule}]}}\n"
    ))
}

fn grpc(rule: &str) -> RouteObject {
    grab(&format!(
        "apiVersion: gateway.networking.k8s.io/v1\nkind: GRPCRoute\nmetadata: {{name: r, namespace: shop}}\n\
         spec: {{parentRefs: [{{group: '', kind: Service, name: cart}}], rules: [{rule}]}}\n"
    ))
}

fn grab(yaml: &str) -> RouteObject {
    let mut documents = parse_documents(yaml);
    assert_eq!(documents.len(), 1, "{yaml}");
    documents.remove(0).unwrap_or_else(|e| panic!("{e}\n{yaml}"))
}

/// Which kind of route a case's rule is in.
const HTTP: bool = true;
const GRPC: bool = false;

/// (kind, first rules (YAML), field refused, Gateway API reason, text the message quotes)
const CASES: &[(bool, &str, &str, &str, &str)] = &[
    (
        HTTP,
        "{matches: [{path: {value: nope}}]}",
        "spec.rules[0].matches[0].path.value",
        "UnsupportedValue",
        "\"nope\" must start with '/'",
    ),
    (
        HTTP,
        "{matches: [{path: {type: Exact, value: /a//b}}]}",
        "spec.rules[0].matches[0].path.value",
        "UnsupportedValue",
        "\"//\"",
    ),
    (
        HTTP,
        "{}, {matches: [{}, {path: {type: RegularExpression, value: '(['}}]}",
        "spec.rules[1].matches[1].path.value",
        "UnsupportedValue",
        "not a valid RE2",
    ),
    (
        HTTP,
        "{matches: [{path: {type: Glob, value: /x}}]}",
        "spec.rules[0].matches[0].path.type",
        "UnsupportedValue",
        "\"Glob\"",
    ),
    (
        HTTP,
        "{matches: [{headers: [{name: 'bad name', value: x}]}]}",
        "spec.rules[0].matches[0].headers[0].name",
        "UnsupportedValue",
        "\"bad name\"",
    ),
    (
        HTTP,
        "{matches: [{headers: [{type: RegularExpression, name: x, value: '[a-z&&b]'}]}]}",
        "spec.rules[0].matches[0].headers[0].value",
        "UnsupportedValue",
        "RE2",
    ),
    (
        HTTP,
        "{matches: [{queryParams: [{type: Prefix, name: q, value: x}]}]}",
        "spec.rules[0].matches[0].queryParams[0].type",
        "UnsupportedValue",
        "\"Prefix\"",
    ),
    (
        HTTP,
        "{matches: [{method: BREW}]}",
        "spec.rules[0].matches[0].method",
        "UnsupportedValue",
        "\"BREW\"",
    ),
    (
        HTTP,
        "{filters: [{type: RequestRedirect, requestRedirect: {}}], backendRefs: [{name: v1, port: 80}]}",
        "spec.rules[0].backendRefs",
        "IncompatibleFilters",
        "cannot have backendRefs",
    ),
    (
        HTTP,
        "{filters: [{type: RequestRedirect, requestRedirect: {statusCode: 304}}]}",
        "spec.rules[0].filters[0].requestRedirect.statusCode",
        "UnsupportedValue",
        "304",
    ),
    (
        HTTP,
        "{filters: [{type: RequestRedirect, requestRedirect: {scheme: ftp}}]}",
        "spec.rules[0].filters[0].requestRedirect.scheme",
        "UnsupportedValue",
        "\"ftp\"",
    ),
    (
        HTTP,
        "{filters: [{type: RequestRedirect, requestRedirect: {port: 70000}}]}",
        "spec.rules[0].filters[0].requestRedirect.port",
        "UnsupportedValue",
        "70000",
    ),
    (
        HTTP,
        "{filters: [{type: RequestRedirect, requestRedirect: {}}, {type: URLRewrite, urlRewrite: {}}]}",
        "spec.rules[0].filters",
        "IncompatibleFilters",
        "both",
    ),
    (
        HTTP,
        "{filters: [{type: URLRewrite, urlRewrite: {hostname: 'Not A Host'}}]}",
        "spec.rules[0].filters[0].urlRewrite.hostname",
        "UnsupportedValue",
        "\"Not A Host\"",
    ),
    (
        HTTP,
        "{filters: [{type: ExtensionRef, extensionRef: {group: x.io, kind: F, name: f}}]}",
        "spec.rules[0].filters[0].type",
        "UnsupportedValue",
        "\"ExtensionRef\"",
    ),
    (
        HTTP,
        "{filters: [{type: CORS}]}",
        "spec.rules[0].filters[0].type",
        "UnsupportedValue",
        "\"CORS\"",
    ),
    (
        HTTP,
        "{filters: [{type: RequestHeaderModifier}]}",
        "spec.rules[0].filters[0].requestHeaderModifier",
        "UnsupportedValue",
        "must be set",
    ),
    (
        HTTP,
        "{filters: [{type: RequestHeaderModifier, requestHeaderModifier: {set: [{name: Host, value: x}]}}]}",
        "spec.rules[0].filters[0].requestHeaderModifier.set[0].name",
        "UnsupportedValue",
        "host",
    ),
    (
        HTTP,
        "{filters: [{type: RequestMirror, requestMirror: {backendRef: {name: m, port: 80}, percent: 101}}]}",
        "spec.rules[0].filters[0].requestMirror",
        "UnsupportedValue",
        "0 to 100",
    ),
    (
        HTTP,
        "{backendRefs: [{name: v1}]}",
        "spec.rules[0].backendRefs[0].port",
        "UnsupportedValue",
        "required",
    ),
    (
        HTTP,
        "{backendRefs: [{name: v1, port: 80, weight: 1000001}]}",
        "spec.rules[0].backendRefs[0].weight",
        "UnsupportedValue",
        "1000001",
    ),
    (
        HTTP,
        "{backendRefs: [{name: v1, port: 80, weight: -1}]}",
        "spec.rules[0].backendRefs[0].weight",
        "UnsupportedValue",
        "-1",
    ),
    (
        HTTP,
        "{backendRefs: [{name: Bad_Name, port: 80}]}",
        "spec.rules[0].backendRefs[0].name",
        "UnsupportedValue",
        "\"Bad_Name\"",
    ),
    (
        HTTP,
        "{timeouts: {request: 1.5s}}",
        "spec.rules[0].timeouts.request",
        "UnsupportedValue",
        "\"1.5s\"",
    ),
    (
        HTTP,
        "{timeouts: {request: 1s, backendRequest: 2s}}",
        "spec.rules[0].timeouts.backendRequest",
        "UnsupportedValue",
        "longer than the request timeout",
    ),
    (
        HTTP,
        "{retry: {attempts: 11}}",
        "spec.rules[0].retry.attempts",
        "UnsupportedValue",
        "11",
    ),
    (
        HTTP,
        "{retry: {codes: [500, 600]}}",
        "spec.rules[0].retry.codes[1]",
        "UnsupportedValue",
        "600",
    ),
    (
        HTTP,
        "{retry: {backoff: 1d}}",
        "spec.rules[0].retry.backoff",
        "UnsupportedValue",
        "\"1d\"",
    ),
    (
        HTTP,
        "{sessionPersistence: {sessionName: s}}",
        "spec.rules[0].sessionPersistence",
        "UnsupportedValue",
        "not supported",
    ),
    (
        HTTP,
        "{name: a}, {name: a}",
        "spec.rules[1].name",
        "UnsupportedValue",
        "two rules",
    ),
    (
        GRPC,
        "{matches: [{method: {type: Exact}}]}",
        "spec.rules[0].matches[0].method",
        "UnsupportedValue",
        "service, method",
    ),
    (
        GRPC,
        "{matches: [{method: {service: 'not a service'}}]}",
        "spec.rules[0].matches[0].method.service",
        "UnsupportedValue",
        "gRPC service",
    ),
    (
        GRPC,
        "{matches: [{method: {type: RegularExpression, method: '('}}]}",
        "spec.rules[0].matches[0].method.method",
        "UnsupportedValue",
        "RE2",
    ),
    (
        GRPC,
        "{filters: [{type: ExtensionRef}]}",
        "spec.rules[0].filters[0].type",
        "UnsupportedValue",
        "\"ExtensionRef\"",
    ),
    (
        HTTP,
        "{matches: [{path: {type: Exact, value: /a}}], filters: [{type: URLRewrite, urlRewrite: {path: {type: ReplacePrefixMatch, replacePrefixMatch: /b}}}]}",
        "spec.rules[0].filters[0].urlRewrite.path",
        "UnsupportedValue",
        "PathPrefix",
    ),
    (
        HTTP,
        "{filters: [{type: RequestHeaderModifier, requestHeaderModifier: {set: [{name: A, value: x}], remove: [a]}}]}",
        "spec.rules[0].filters[0].requestHeaderModifier.remove[0]",
        "UnsupportedValue",
        "more than one action",
    ),
    (
        HTTP,
        "{filters: [{type: RequestHeaderModifier, requestHeaderModifier: {}}, {type: RequestHeaderModifier, requestHeaderModifier: {}}]}",
        "spec.rules[0].filters[1].type",
        "UnsupportedValue",
        "twice",
    ),
    (
        HTTP,
        "{filters: [{type: RequestMirror, requestMirror: {backendRef: {name: m, port: 80}, percent: 10, fraction: {numerator: 1}}}]}",
        "spec.rules[0].filters[0].requestMirror",
        "UnsupportedValue",
        "not both",
    ),
    (
        HTTP,
        "{backendRefs: [{name: v1, port: 80, filters: [{type: RequestMirror, requestMirror: {backendRef: {name: m, port: 1}}}]}]}",
        "spec.rules[0].backendRefs[0].filters[0].type",
        "UnsupportedValue",
        "on a backend",
    ),
];

#[test]
fn each_invalid_value_is_refused_on_its_field() {
    for (is_http, rule, field, reason, quoted) in CASES {
        let object = if *is_http { http(rule) } else { grpc(rule) };
        let refused = project(&object).expect_err(field);
        let got = (refused.condition, refused.reason, refused.field.as_str());
        assert_eq!(got, (ConditionType::Accepted, *reason, *field), "{refused}");
        assert!(refused.message.contains(quoted), "{refused} lacks {quoted}");
        assert_eq!(refused.to_string(), format!("{field}: {}", refused.message));
    }
}

#[test]
fn a_backend_that_is_not_a_service_is_an_invalid_kind() {
    let refused = project(&http(
        "{backendRefs: [{group: example.io, kind: Bucket, name: b, port: 1}]}",
    ))
    .unwrap_err();
    assert_eq!(
        (refused.condition, refused.reason),
        (ConditionType::ResolvedRefs, "InvalidKind")
    );
    assert_eq!(refused.field, "spec.rules[0].backendRefs[0]");
    assert!(refused.message.contains("\"Bucket\""), "{refused}");
}

#[test]
fn parents_and_metadata_are_checked() {
    let section = grab(
        "apiVersion: gateway.networking.k8s.io/v1\nkind: HTTPRoute\nmetadata: {name: r}\n\
         spec: {parentRefs: [{name: edge}, {group: core, kind: Service, name: cart, sectionName: http}]}\n",
    );
    let refused = project(&section).unwrap_err();
    assert_eq!(refused.field, "spec.parentRefs[1].sectionName");
    let bad_name = grab(
        "apiVersion: gateway.networking.k8s.io/v1\nkind: HTTPRoute\nmetadata: {name: Bad}\n\
         spec: {parentRefs: [{group: '', kind: Service, name: cart}]}\n",
    );
    assert_eq!(project(&bad_name).unwrap_err().field, "metadata.name");
}

#[test]
fn a_huge_value_is_quoted_bounded() {
    let long = "x".repeat(100_000);
    let refused = project(&http(&format!("{{matches: [{{path: {{value: {long}}}}}]}}"))).unwrap_err();
    assert!(refused.message.len() < 300, "{} bytes", refused.message.len());
    assert!(refused.message.contains("(100000 bytes)"), "{refused}");
}

#[test]
fn yaml_errors_name_the_document_and_the_field() {
    let text = "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: c}\n---\n\
                apiVersion: gateway.networking.k8s.io/v1\nkind: HTTPRoute\nmetadata: {name: r}\n\
                spec: {rules: [{backendRefs: [{name: v1, port: eighty}]}]}\n---\n\
                apiVersion: gateway.networking.k8s.io/v1beta1\nkind: GRPCRoute\nmetadata: {name: g}\n---\n\
                just a string\n---\n\
                apiVersion: gateway.networking.k8s.io/v1\nkind: GRPCRoute\nmetadata: {name: ok}\n";
    let results = parse_documents(text);
    assert_eq!(results.len(), 4, "the ConfigMap is skipped: {results:?}");
    let port = results[0].as_ref().unwrap_err();
    assert_eq!(
        (port.document, port.field.as_str()),
        (2, "spec.rules[0].backendRefs[0].port")
    );
    assert!(
        port.to_string()
            .starts_with("document 2: spec.rules[0].backendRefs[0].port: "),
        "{port}"
    );
    let version = results[1].as_ref().unwrap_err();
    assert_eq!((version.document, version.field.as_str()), (3, "apiVersion"));
    assert_eq!(results[2].as_ref().unwrap_err().document, 4);
    assert_eq!(results[3].as_ref().unwrap().key(), "grpc/default/ok");
    let broken = parse_documents("kind: HTTPRoute\n---\n[unclosed\n");
    assert!(
        broken
            .last()
            .unwrap()
            .as_ref()
            .unwrap_err()
            .message
            .starts_with("not YAML"),
        "{broken:?}"
    );
}
