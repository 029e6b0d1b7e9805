//! Properties of the HTTPFilter projector over generated filters of every kind, each
//! assembled from parts known good or bad: a filter projects exactly when all its parts
//! are good and exactly one kind is set; what projects passes `validate` and holds the
//! kind written; every refusal is bounded and names a field of the object.

use aether_api::http_filter::{key, parse_documents, project, validate};
use aether_proto::registry::v1::http_filter::Filter;
use proptest::prelude::*;
use proptest::sample::select;

/// A part of a spec and whether the projector accepts it.
type Part = (&'static str, bool);

const ATTACH: [Part; 6] = [
    ("", true),
    ("attach: Callers, ", true),
    ("attach: Route, routeRef: {kind: HTTPRoute, name: r}, ", true),
    ("attach: Route, routeRef: {kind: GRPCRoute, name: r.v1}, ", true),
    ("attach: Route, ", false),
    ("routeRef: {kind: HTTPRoute, name: r}, ", false),
];
const ORDER: [Part; 4] = [
    ("", true),
    ("order: -1000, ", true),
    ("order: 1000, ", true),
    ("order: 1001, ", false),
];
const SERVICE: [Part; 6] = [
    ("grpc: {host: authz.shop, port: 9000}", true),
    (
        "http: {host: 10.0.0.1, port: 80, pathPrefix: /auth, allowedHeaders: [x-user]}",
        true,
    ),
    ("http: {host: authz, port: 8000}", true),
    ("grpc: {host: Authz, port: 9000}", false),
    ("grpc: {host: authz, port: 0}", false),
    ("http: {host: authz, port: 80, allowedHeaders: [X-User]}", false),
];
const EXT_AUTHZ_EXTRA: [Part; 7] = [
    ("", true),
    (", timeout: 10s, failOpen: true", true),
    (", statusOnError: 503, maxRequestBytes: 1048576", true),
    (", timeout: 1ms", true),
    (", timeout: 0s", false),
    (", statusOnError: 418", false),
    (", maxRequestBytes: 1048577", false),
];
const RATE: [Part; 7] = [
    ("maxTokens: 1, fillInterval: 50ms", true),
    ("maxTokens: 100, tokensPerFill: 100, fillInterval: 1h", true),
    ("maxTokens: 10, fillInterval: 1s, status: 503", true),
    ("maxTokens: 0, fillInterval: 1s", false),
    ("maxTokens: 10, tokensPerFill: 11, fillInterval: 1s", false),
    ("maxTokens: 10, fillInterval: 49ms", false),
    ("maxTokens: 10, fillInterval: 1s, status: 302", false),
];
const HEADER_RULES: [Part; 5] = [
    ("{header: x-tenant, key: tenant}", true),
    (
        "{header: x-b, key: b.c, metadataNamespace: aether.t, remove: true}",
        true,
    ),
    ("{header: X-Tenant, key: tenant}", false),
    ("{header: x-a, key: 'a b'}", false),
    ("{header: x-a, key: a, metadataNamespace: ''}", false),
];
const RBAC_ACTION: [Part; 4] = [
    ("", true),
    ("action: DENY, ", true),
    ("action: AUDIT, ", false),
    ("action: CUSTOM, ", false),
];
const RBAC_RULES: [Part; 5] = [
    ("{to: [{operation: {methods: [DELETE]}}]}", true),
    ("{from: [{source: {principals: ['spiffe://td/ns/a/*']}}]}", true),
    ("{to: [{operation: {paths: [admin]}}]}", false),
    ("{from: [{source: {ipBlocks: [10.0.0.1/8]}}]}", false),
    ("{to: [{operation: {ports: [8080]}}]}", false),
];

fn all_good(parts: &[Part]) -> bool {
    parts.iter().all(|(_, good)| *good)
}

/// Each filter kind's YAML, its name in the spec and whether it is good.
fn kind() -> impl Strategy<Value = (&'static str, String, bool)> {
    let ext_authz = (select(&SERVICE[..]), select(&EXT_AUTHZ_EXTRA[..]))
        .prop_map(|(s, e)| ("extAuthz", format!("extAuthz: {{{}{}}}", s.0, e.0), all_good(&[s, e])));
    let rate = select(&RATE[..]).prop_map(|r| ("localRateLimit", format!("localRateLimit: {{{}}}", r.0), r.1));
    let headers = prop::collection::vec(select(&HEADER_RULES[..]), 0..3).prop_map(|rules| {
        let text: Vec<_> = rules.iter().map(|r| r.0).collect();
        let good = !rules.is_empty() && all_good(&rules);
        (
            "headerToMetadata",
            format!("headerToMetadata: {{rules: [{}]}}", text.join(", ")),
            good,
        )
    });
    let rbac = (
        select(&RBAC_ACTION[..]),
        prop::collection::vec(select(&RBAC_RULES[..]), 0..3),
    )
        .prop_map(|(a, rules)| {
            let text: Vec<_> = rules.iter().map(|r| r.0).collect();
            let good = a.1 && all_good(&rules);
            ("rbac", format!("rbac: {{{}rules: [{}]}}", a.0, text.join(", ")), good)
        });
    prop_oneof![ext_authz, rate, headers, rbac]
}

/// A filter's YAML, whether it should project, and the kinds it sets.
fn filter() -> impl Strategy<Value = (String, bool, Vec<&'static str>)> {
    let kinds = prop::collection::vec(kind(), 0..3);
    (select(&ATTACH[..]), select(&ORDER[..]), kinds).prop_map(|(attach, order, kinds)| {
        let names: Vec<_> = kinds.iter().map(|k| k.0).collect();
        let bodies: Vec<_> = kinds.iter().map(|k| k.1.as_str()).collect();
        let yaml = format!(
            "apiVersion: networking.aether.io/v1alpha1\nkind: HTTPFilter\nmetadata: {{name: f, namespace: shop}}\n\
             spec: {{targetRefs: [{{kind: Service, name: orders}}], {}{}{}}}\n",
            attach.0,
            order.0,
            bodies.join(", ")
        );
        // Callers named by identity: only an Inbound filter (attach unset) can judge them.
        let by_identity = kinds.iter().any(|k| k.0 == "rbac" && k.1.contains("principals"));
        let judged = !by_identity || attach.0.is_empty();
        let good = all_good(&[attach, order]) && kinds.len() == 1 && kinds[0].2 && judged;
        (yaml, good, names)
    })
}

fn kind_name(filter: &Filter) -> &'static str {
    match filter {
        Filter::ExtAuthz(_) => "extAuthz",
        Filter::LocalRateLimit(_) => "localRateLimit",
        Filter::HeaderToMetadata(_) => "headerToMetadata",
        Filter::Rbac(_) => "rbac",
    }
}

proptest! {
    #[test]
    fn a_filter_projects_exactly_when_every_part_is_good((yaml, good, kinds) in filter()) {
        // Two of one kind is a duplicate YAML key: the document does not decode.
        prop_assume!(kinds.len() == kinds.iter().collect::<std::collections::BTreeSet<_>>().len());
        let object = parse_documents(&yaml).remove(0).expect("decodes");
        match project(&object) {
            Ok(projected) => {
                prop_assert!(good, "accepted {yaml}");
                prop_assert_eq!(validate(&projected), Ok(()));
                prop_assert_eq!(key(&projected), "shop/f");
                prop_assert_eq!(kind_name(projected.filter.as_ref().unwrap()), kinds[0]);
            }
            Err(refusal) => {
                prop_assert!(!good, "refused {yaml}: {refusal}");
                prop_assert!(refusal.field.starts_with("spec"), "{refusal}");
                prop_assert!(refusal.to_string().len() < 1024);
            }
        }
    }
}
