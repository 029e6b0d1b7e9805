//! Properties of authorization over generated policies and requests: the projector never
//! panics and what it accepts passes `validate`; `decide` does not depend on the order of
//! policies; a matching DENY always wins; AUDIT and dry-run policies never change a verdict;
//! a negated field matches exactly when its positive form does not.

use std::collections::BTreeMap;

use aether_api::authorization::{
    AuthzRequest, HttpRequest, ProjectOptions, Verdict, Workload, decide, parse_documents, project, validate,
};
use aether_proto::registry::v1::{AuthorizationAction, AuthorizationPolicy};
use proptest::prelude::*;
use proptest::sample::select;

fn object(namespace: &str, name: &str, spec: &str) -> String {
    format!(
        "apiVersion: security.aether.io/v1alpha1\nkind: AuthorizationPolicy\n\
         metadata: {{name: {name}, namespace: {namespace}}}\nspec: {spec}\n"
    )
}

fn projected(yaml: &str) -> Option<AuthorizationPolicy> {
    let object = parse_documents(yaml).pop()?.ok()?;
    project(&object, &ProjectOptions::default()).ok()
}

const SOURCES: [&str; 9] = [
    "{source: {principals: ['spiffe://cluster.local/ns/shop/*']}}",
    "{source: {notPrincipals: ['*']}}",
    "{source: {serviceAccounts: [ops/batch]}}",
    "{source: {notServiceAccounts: [shop/web]}}",
    "{source: {namespaces: [shop], ipBlocks: [10.0.0.0/8]}}",
    "{source: {notNamespaces: [ops]}}",
    "{source: {notIpBlocks: [192.168.0.0/16]}}",
    "{source: {principals: ['*/sa/batch'], notIpBlocks: [10.0.0.5]}}",
    "{source: {ipBlocks: [10.0.0.300/8]}}",
];
const OPERATIONS: [&str; 8] = [
    "{operation: {ports: [8080]}}",
    "{operation: {notPorts: [9090]}}",
    "{operation: {methods: [GET], paths: ['/api/*']}}",
    "{operation: {notMethods: [POST]}}",
    "{operation: {paths: ['/admin*', '*.css']}}",
    "{operation: {notPaths: [/]}}",
    "{operation: {hosts: ['*.aether.internal'], ports: [8080]}}",
    "{operation: {paths: [admin]}}",
];

fn rule() -> impl Strategy<Value = String> {
    let from = prop::collection::vec(select(&SOURCES[..]), 0..3);
    let to = prop::collection::vec(select(&OPERATIONS[..]), 0..3);
    (from, to).prop_map(|(from, to)| format!("{{from: [{}], to: [{}]}}", from.join(", "), to.join(", ")))
}

/// A policy's YAML: some refused (an invalid CIDR or path, AUDIT with dryRun).
fn policy_yaml() -> impl Strategy<Value = String> {
    let namespace = select(vec!["shop", "ops", "aether-system"]);
    let selector = select(vec![
        "",
        "selector: {matchLabels: {app: cart}}, ",
        "selector: {matchLabels: {app: db}}, ",
    ]);
    let action = select(vec!["ALLOW", "DENY", "AUDIT"]);
    let rules = prop::collection::vec(rule(), 0..3);
    (namespace, any::<u16>(), selector, action, any::<bool>(), rules).prop_map(
        |(namespace, id, selector, action, dry_run, rules)| {
            let spec = format!(
                "{{{selector}action: {action}, dryRun: {dry_run}, rules: [{}]}}",
                rules.join(", ")
            );
            object(namespace, &format!("p{id}"), &spec)
        },
    )
}

fn policies() -> impl Strategy<Value = Vec<AuthorizationPolicy>> {
    prop::collection::vec(policy_yaml(), 0..6).prop_map(|yaml| yaml.iter().filter_map(|y| projected(y)).collect())
}

fn request() -> impl Strategy<Value = AuthzRequest> {
    let principal = select(vec![
        None,
        Some("spiffe://cluster.local/ns/shop/sa/web"),
        Some("spiffe://cluster.local/ns/ops/sa/batch"),
        Some("spiffe://other.domain/workload"),
    ]);
    let peer = select(vec!["10.0.0.5", "192.168.1.1", "fd00::1"]);
    let port = select(vec![8080u32, 9090]);
    let http = prop::option::of((
        select(vec!["GET", "POST"]),
        select(vec!["/", "/api/v1", "/admin/x", "/s/a.css"]),
    ));
    (principal, peer, port, http, select(vec!["cart", "db"])).prop_map(|(principal, peer, port, http, app)| {
        AuthzRequest {
            workload: Workload {
                namespace: "shop".into(),
                labels: BTreeMap::from([("app".into(), app.into())]),
                services: vec![format!("shop/{app}")],
            },
            principal: principal.map(str::to_owned),
            trust_domain: "cluster.local".into(),
            peer_ip: peer.parse().unwrap(),
            port,
            http: http.map(|(method, path)| HttpRequest {
                method: method.into(),
                path: path.into(),
                host: "cart.shop.aether.internal".into(),
            }),
        }
    })
}

proptest! {
    #[test]
    fn what_the_projector_accepts_validates(yaml in policy_yaml()) {
        let object = parse_documents(&yaml).remove(0).unwrap();
        if let Ok(policy) = project(&object, &ProjectOptions::default()) {
            prop_assert_eq!(validate(&policy), Ok(()));
        }
    }

    #[test]
    fn the_order_of_policies_does_not_matter(policies in policies(), request in request()) {
        let forward: Vec<_> = policies.iter().collect();
        let backward: Vec<_> = policies.iter().rev().collect();
        prop_assert_eq!(decide(&forward, &request), decide(&backward, &request));
    }

    #[test]
    fn a_matching_deny_wins(policies in policies(), request in request()) {
        let deny = projected(&object("shop", "deny-everything", "{action: DENY, rules: [{}]}")).unwrap();
        let mut all: Vec<_> = policies.iter().collect();
        all.push(&deny);
        prop_assert_eq!(decide(&all, &request).verdict, Verdict::Deny);
    }

    #[test]
    fn audit_and_dry_run_never_change_the_verdict(policies in policies(), request in request()) {
        let enforced: Vec<_> = policies.iter().filter(|p| !p.dry_run && p.action() != AuthorizationAction::Audit).collect();
        let all: Vec<_> = policies.iter().collect();
        let (with, without) = (decide(&all, &request), decide(&enforced, &request));
        prop_assert_eq!((with.verdict, with.cause), (without.verdict, without.cause));
    }
}

/// One ALLOW rule with a single field, and its negation.
const FIELDS: [(&str, &str); 7] = [
    ("principals", "['spiffe://cluster.local/ns/shop/*', '*/sa/batch']"),
    ("serviceAccounts", "[ops/batch]"),
    ("namespaces", "[shop]"),
    ("ipBlocks", "[10.0.0.0/8, 'fd00::/16']"),
    ("ports", "[8080]"),
    ("methods", "[POST]"),
    ("paths", "['/api/*', '*.css']"),
];

proptest! {
    #[test]
    fn a_negated_field_matches_when_its_positive_form_does_not(
        (field, values) in select(&FIELDS[..]),
        mut request in request(),
    ) {
        let (section, kind) = if ["ports", "methods", "paths"].contains(&field) { ("to", "operation") } else { ("from", "source") };
        if section == "to" && field != "ports" && request.http.is_none() {
            request.http = Some(HttpRequest { method: "GET".into(), path: "/".into(), host: "h".into() });
        }
        let negated = format!("not{}{}", field[..1].to_uppercase(), &field[1..]);
        let allow = |name: &str| {
            let spec = format!("{{rules: [{{{section}: [{{{kind}: {{{name}: {values}}}}}]}}]}}");
            projected(&object("shop", "p", &spec)).unwrap()
        };
        let (positive, negative) = (allow(field), allow(&negated));
        let allowed = |p: &AuthorizationPolicy| decide(&[p], &request).verdict == Verdict::Allow;
        prop_assert_ne!(allowed(&positive), allowed(&negative));
    }
}
