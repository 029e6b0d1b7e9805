//! Whatever the input, parsing and projecting never panic, and what the projector
//! accepts always passes `validate` (the agent's re-check before Envoy).

use aether_api::{parse_documents, project, validate};
use proptest::prelude::*;
use proptest::sample::select;

/// Mostly a valid value, sometimes an invalid one, so both paths are exercised.
fn mostly(valid: Vec<&'static str>, invalid: Vec<&'static str>) -> impl Strategy<Value = &'static str> {
    prop_oneof![6 => select(valid), 1 => select(invalid)]
}

fn path() -> impl Strategy<Value = &'static str> {
    mostly(
        vec![
            "{type: PathPrefix, value: '/a/'}",
            "{type: Exact, value: /a}",
            "{type: RegularExpression, value: '^/v[0-9]+$'}",
            "{value: /}",
        ],
        vec![
            "{type: Glob, value: /}",
            "{value: x}",
            "{type: Exact, value: '/a//b'}",
            "{type: RegularExpression, value: '('}",
        ],
    )
}

fn header() -> impl Strategy<Value = &'static str> {
    mostly(
        vec![
            "{name: X-A, value: v}",
            "{type: RegularExpression, name: x-b, value: '.*'}",
        ],
        vec![
            "{name: 'bad name', value: v}",
            "{name: x, value: ''}",
            "{type: RegularExpression, name: x, value: '[a&&b]'}",
        ],
    )
}

fn filter() -> impl Strategy<Value = &'static str> {
    mostly(
        vec![
            "{type: RequestHeaderModifier, requestHeaderModifier: {set: [{name: X-S, value: s}], remove: [x-r]}}",
            "{type: ResponseHeaderModifier, responseHeaderModifier: {set: [{name: a, value: b}], add: [{name: C, value: c}]}}",
            "{type: URLRewrite, urlRewrite: {hostname: h.example, path: {type: ReplaceFullPath, replaceFullPath: /x}}}",
            "{type: RequestMirror, requestMirror: {backendRef: {name: m, namespace: other, port: 9}, fraction: {numerator: 2, denominator: 3}}}",
        ],
        vec![
            "{type: RequestHeaderModifier, requestHeaderModifier: {add: [{name: Host, value: h}]}}",
            "{type: RequestRedirect, requestRedirect: {scheme: https, statusCode: 308, port: 443}}",
            "{type: URLRewrite, urlRewrite: {path: {type: ReplacePrefixMatch, replacePrefixMatch: /y}}}",
            "{type: ExtensionRef}",
        ],
    )
}

fn backend() -> impl Strategy<Value = String> {
    let name = mostly(vec!["v1", "v-2"], vec!["V1"]);
    let port = prop_oneof![9 => 1..65536i32, 1 => 65536..70_000i32];
    let weight = prop_oneof![9 => 0..1_000_001i32, 1 => Just(-1)];
    (name, port, weight).prop_map(|(n, port, w)| format!("{{name: {n}, port: {port}, weight: {w}}}"))
}

fn rule() -> impl Strategy<Value = String> {
    let method = mostly(vec!["GET", "get", "patch"], vec!["BREW"]);
    let timeouts = mostly(
        vec![
            "",
            "timeouts: {request: 1s, backendRequest: 500ms},",
            "timeouts: {request: 0s, backendRequest: 1h},",
        ],
        vec!["timeouts: {request: 1s, backendRequest: 2s},"],
    );
    let retry = mostly(
        vec!["", "retry: {codes: [500, 503], attempts: 3, backoff: 10ms},"],
        vec!["retry: {attempts: 11},", "retry: {codes: [600]},"],
    );
    let redirect =
        "{type: RequestRedirect, requestRedirect: {path: {type: ReplacePrefixMatch, replacePrefixMatch: ''}}}";
    let redirect = prop_oneof![8 => Just(""), 1 => Just(redirect)];
    let filters = prop::collection::vec(filter(), 0..3);
    let backends = prop::collection::vec(backend(), 0..3);
    (path(), header(), method, filters, backends, timeouts, retry, redirect).prop_map(
        |(path, header, method, filters, backends, timeouts, retry, redirect)| {
            // A redirect rule has no backends (else it is refused, which is exercised too).
            let (filters, backends) = match redirect {
                "" => (filters.join(", "), backends.join(", ")),
                redirect => (redirect.to_owned(), String::new()),
            };
            format!(
                "{{matches: [{{path: {path}, headers: [{header}], method: {method}}}], \
                 filters: [{filters}], backendRefs: [{backends}], {timeouts} {retry}}}"
            )
        },
    )
}

/// A TCPRoute or TLSRoute (with server names, mostly valid) whose rules are of backends.
fn connection_route() -> impl Strategy<Value = String> {
    let hostname = mostly(
        vec!["a.example.com", "*.example.com", "A.Example.COM", "x-1.y.z"],
        vec!["*", "10.0.0.1", "localhost", "a.*.b", "-a.b", "a..b"],
    );
    let hostnames = prop::collection::vec(hostname, 0..4);
    let rules = prop::collection::vec(prop::collection::vec(backend(), 0..3), 0..3);
    (any::<bool>(), hostnames, rules).prop_map(|(tls, hostnames, rules)| {
        let rules: Vec<String> = rules
            .iter()
            .map(|b| format!("{{backendRefs: [{}]}}", b.join(", ")))
            .collect();
        let (kind, hostnames) = match tls {
            true => (
                "TLSRoute",
                format!(
                    "hostnames: [{}], ",
                    hostnames
                        .iter()
                        .map(|h| format!("'{h}'"))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            ),
            false => ("TCPRoute", String::new()),
        };
        format!(
            "apiVersion: gateway.networking.k8s.io/v1alpha2\nkind: {kind}\nmetadata: {{name: r, namespace: shop}}\n\
             spec: {{parentRefs: [{{group: '', kind: Service, name: db, port: 5432}}], {hostnames}rules: [{}]}}\n",
            rules.join(", ")
        )
    })
}

fn route(rules: Vec<String>) -> String {
    format!(
        "apiVersion: gateway.networking.k8s.io/v1\nkind: HTTPRoute\nmetadata: {{name: r, namespace: shop}}\n\
         spec: {{parentRefs: [{{group: '', kind: Service, name: cart, port: 80}}], rules: [{}]}}\n",
        rules.join(", ")
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn accepted_projections_always_validate(rules in prop::collection::vec(rule(), 1..4)) {
        let text = route(rules);
        for object in parse_documents(&text) {
            let Ok(object) = object else { continue };
            if let Ok(Some(projected)) = project(&object) {
                prop_assert!(validate(&projected).is_ok(), "{:?}\n{text}", validate(&projected));
            }
        }
    }

    #[test]
    fn accepted_connection_routes_always_validate(text in connection_route()) {
        let objects = parse_documents(&text);
        prop_assert_eq!(objects.len(), 1);
        let Ok(object) = &objects[0] else { return Ok(()) };
        match project(object) {
            Ok(Some(projected)) => {
                prop_assert!(validate(&projected).is_ok(), "{:?}\n{text}", validate(&projected));
                prop_assert_eq!(projected.rules.len(), 1);
            }
            Ok(None) => prop_assert!(false, "a Service parent makes a mesh route: {text}"),
            Err(refused) => prop_assert!(refused.field.starts_with("spec."), "{refused}"),
        }
    }

    #[test]
    fn parsing_arbitrary_text_never_panics(text in "(?s).{0,400}") {
        for object in parse_documents(&text).into_iter().flatten() {
            let _ = project(&object);
        }
    }

    #[test]
    fn parsing_yaml_shaped_text_never_panics(parts in prop::collection::vec(select(vec![
        "apiVersion: gateway.networking.k8s.io/v1\n", "kind: HTTPRoute\n", "kind: GRPCRoute\n", "---\n",
        "apiVersion: gateway.networking.k8s.io/v1alpha2\n", "kind: TCPRoute\n", "kind: TLSRoute\n",
        "  hostnames: ['*.a.b', 7]\n",
        "metadata: {name: r}\n", "spec:\n", "  parentRefs: [{group: '', kind: Service, name: s}]\n",
        "  rules: [{backendRefs: [{name: b, port: 1}]}]\n", "  rules: 7\n", "  - x\n", "&a [*a]\n", ": :\n",
    ]), 0..16)) {
        let text = parts.concat();
        for object in parse_documents(&text).into_iter().flatten() {
            if let Ok(Some(projected)) = project(&object) {
                prop_assert!(validate(&projected).is_ok());
            }
        }
    }
}

#[test]
fn the_generator_reaches_accepted_routes() {
    use proptest::strategy::ValueTree;
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let accepted = (0..400)
        .filter(|_| {
            let text = route(vec![rule().new_tree(&mut runner).unwrap().current()]);
            parse_documents(&text)
                .into_iter()
                .flatten()
                .any(|o| matches!(project(&o), Ok(Some(_))))
        })
        .count();
    // Both refusals and acceptances are exercised.
    assert!((20..380).contains(&accepted), "{accepted} of 400 accepted");
}
