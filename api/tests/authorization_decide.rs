//! `decide`, the reference semantics of authorization (proposals/013), rule by rule: which
//! policies select a workload, DENY before ALLOW, no ALLOW policy means allow, each
//! source and operation field and its negation, AUDIT and dry run reported but never
//! enforced, and the policy and rule a decision names.

use std::collections::BTreeMap;

use aether_api::authorization::{
    AuthzRequest, Cause, HttpRequest, PolicyRule, ProjectOptions, Verdict, Workload, decide, parse_documents, project,
};
use aether_proto::registry::v1::AuthorizationPolicy;

/// A policy `name` in `namespace` with `spec` (YAML flow mapping).
fn policy(namespace: &str, name: &str, spec: &str) -> AuthorizationPolicy {
    let yaml = format!(
        "apiVersion: security.aether.io/v1alpha1\nkind: AuthorizationPolicy\n\
         metadata: {{name: {name}, namespace: {namespace}}}\nspec: {spec}\n"
    );
    let object = parse_documents(&yaml)
        .remove(0)
        .unwrap_or_else(|e| panic!("{e}\n{yaml}"));
    project(&object, &ProjectOptions::default()).unwrap_or_else(|e| panic!("{e}\n{yaml}"))
}

/// A GET of `path` on shop/cart's port 8080 by `principal` from 10.0.0.5.
fn get(principal: Option<&str>, path: &str) -> AuthzRequest {
    AuthzRequest {
        workload: Workload {
            namespace: "shop".into(),
            labels: BTreeMap::from([("app".into(), "cart".into()), ("version".into(), "v1".into())]),
            services: vec!["shop/cart".into()],
        },
        principal: principal.map(str::to_owned),
        trust_domain: "cluster.local".into(),
        peer_ip: "10.0.0.5".parse().unwrap(),
        port: 8080,
        http: Some(HttpRequest {
            method: "GET".into(),
            path: path.into(),
            host: "cart.shop.aether.internal:8080".into(),
        }),
    }
}

const WEB: Option<&str> = Some("spiffe://cluster.local/ns/shop/sa/web");
const BATCH: Option<&str> = Some("spiffe://cluster.local/ns/ops/sa/batch");

fn verdict(policies: &[AuthorizationPolicy], request: &AuthzRequest) -> Verdict {
    decide(&policies.iter().collect::<Vec<_>>(), request).verdict
}

fn rule(policy: &str, rule: usize) -> PolicyRule {
    PolicyRule {
        policy: policy.into(),
        rule,
    }
}

#[test]
fn precedence_deny_then_allow_then_default() {
    let allow_web = policy(
        "shop",
        "allow-web",
        "{rules: [{from: [{source: {serviceAccounts: [shop/web]}}]}]}",
    );
    let deny_admin = policy(
        "shop",
        "deny-admin",
        "{action: DENY, rules: [{to: [{operation: {paths: [/admin*]}}]}]}",
    );
    let none: [AuthorizationPolicy; 0] = [];
    let decision = decide(&[], &get(BATCH, "/"));
    assert_eq!(
        (decision.verdict, decision.cause),
        (Verdict::Allow, Cause::NoAllowPolicy)
    );
    assert_eq!(verdict(&none, &get(None, "/")), Verdict::Allow);
    let both = [allow_web.clone(), deny_admin.clone()];
    let d = decide(&both.iter().collect::<Vec<_>>(), &get(WEB, "/admin/x"));
    assert_eq!(
        (d.verdict, d.cause),
        (Verdict::Deny, Cause::Denied(rule("shop/deny-admin", 0)))
    );
    let d = decide(&both.iter().collect::<Vec<_>>(), &get(WEB, "/cart"));
    assert_eq!(
        (d.verdict, d.cause),
        (Verdict::Allow, Cause::Allowed(rule("shop/allow-web", 0)))
    );
    let d = decide(&both.iter().collect::<Vec<_>>(), &get(BATCH, "/cart"));
    assert_eq!((d.verdict, d.cause), (Verdict::Deny, Cause::NoAllowMatched));
    // A DENY alone does not turn the default into deny.
    assert_eq!(verdict(&[deny_admin], &get(BATCH, "/cart")), Verdict::Allow);
}

#[test]
fn empty_rules_and_empty_rule() {
    let allow_nothing = policy("shop", "deny-all", "{}");
    let deny_nothing = policy("shop", "d", "{action: DENY}");
    let allow_all = policy("shop", "allow-all", "{rules: [{}]}");
    let d = decide(&[&allow_nothing], &get(WEB, "/"));
    assert_eq!((d.verdict, d.cause), (Verdict::Deny, Cause::NoAllowMatched));
    assert_eq!(verdict(&[deny_nothing], &get(WEB, "/")), Verdict::Allow);
    let d = decide(&[&allow_nothing, &allow_all], &get(None, "/"));
    assert_eq!(
        (d.verdict, d.cause),
        (Verdict::Allow, Cause::Allowed(rule("shop/allow-all", 0)))
    );
    let deny_everything = policy("shop", "d", "{action: DENY, rules: [{}]}");
    assert_eq!(verdict(&[allow_all, deny_everything], &get(WEB, "/")), Verdict::Deny);
}

#[test]
fn targets_select_by_namespace_labels_services_and_mesh_wide() {
    let deny = "action: DENY, rules: [{}]";
    let cases = [
        (policy("shop", "p", &format!("{{{deny}}}")), true),
        (policy("ops", "p", &format!("{{{deny}}}")), false),
        (policy("aether-system", "p", &format!("{{{deny}}}")), true),
        (
            policy(
                "aether-system",
                "p",
                &format!("{{selector: {{matchLabels: {{app: db}}}}, {deny}}}"),
            ),
            false,
        ),
        (
            policy(
                "shop",
                "p",
                &format!("{{selector: {{matchLabels: {{app: cart}}}}, {deny}}}"),
            ),
            true,
        ),
        (
            policy(
                "shop",
                "p",
                &format!("{{selector: {{matchLabels: {{app: cart, version: v2}}}}, {deny}}}"),
            ),
            false,
        ),
        (
            policy(
                "shop",
                "p",
                &format!("{{targetRefs: [{{kind: Service, name: cart}}], {deny}}}"),
            ),
            true,
        ),
        (
            policy(
                "shop",
                "p",
                &format!("{{targetRefs: [{{kind: Service, name: pay}}], {deny}}}"),
            ),
            false,
        ),
    ];
    for (i, (policy, selects)) in cases.into_iter().enumerate() {
        let expected = if selects { Verdict::Deny } else { Verdict::Allow };
        assert_eq!(verdict(&[policy], &get(WEB, "/")), expected, "case {i}");
    }
}

/// (source or operation of one ALLOW rule, request, allowed)
fn field_cases() -> Vec<(&'static str, AuthzRequest, bool)> {
    source_cases().into_iter().chain(operation_cases()).collect()
}

fn source_cases() -> Vec<(&'static str, AuthzRequest, bool)> {
    vec![
        (
            "from: [{source: {principals: ['spiffe://cluster.local/ns/shop/*']}}]",
            get(WEB, "/"),
            true,
        ),
        (
            "from: [{source: {principals: ['spiffe://cluster.local/ns/shop/*']}}]",
            get(BATCH, "/"),
            false,
        ),
        ("from: [{source: {principals: ['*/sa/web']}}]", get(WEB, "/"), true),
        ("from: [{source: {principals: ['*']}}]", get(None, "/"), false),
        ("from: [{source: {notPrincipals: ['*']}}]", get(None, "/"), true),
        ("from: [{source: {notPrincipals: ['*']}}]", get(WEB, "/"), false),
        (
            "from: [{source: {serviceAccounts: [ops/batch]}}]",
            get(BATCH, "/"),
            true,
        ),
        (
            "from: [{source: {notServiceAccounts: [ops/batch]}}]",
            get(BATCH, "/"),
            false,
        ),
        (
            "from: [{source: {notServiceAccounts: [ops/batch]}}]",
            get(None, "/"),
            true,
        ),
        ("from: [{source: {namespaces: [shop]}}]", get(WEB, "/"), true),
        ("from: [{source: {namespaces: [shop]}}]", get(None, "/"), false),
        ("from: [{source: {notNamespaces: [shop]}}]", get(BATCH, "/"), true),
        ("from: [{source: {ipBlocks: [10.0.0.0/24]}}]", get(None, "/"), true),
        (
            "from: [{source: {ipBlocks: ['fd00::/8', 10.1.0.0/16]}}]",
            get(WEB, "/"),
            false,
        ),
        ("from: [{source: {notIpBlocks: [10.0.0.5]}}]", get(WEB, "/"), false),
        // Fields of one source AND, sources OR.
        (
            "from: [{source: {namespaces: [shop], ipBlocks: [10.9.0.0/16]}}]",
            get(WEB, "/"),
            false,
        ),
        (
            "from: [{source: {namespaces: [ops]}}, {source: {ipBlocks: [10.0.0.0/8]}}]",
            get(WEB, "/"),
            true,
        ),
    ]
}

fn operation_cases() -> Vec<(&'static str, AuthzRequest, bool)> {
    let mut tcp = get(WEB, "/");
    tcp.http = None;
    let mut other_port = get(WEB, "/");
    other_port.port = 9090;
    let mut post = get(WEB, "/");
    post.http.as_mut().unwrap().method = "POST".into();
    vec![
        ("to: [{operation: {ports: [8080]}}]", tcp.clone(), true),
        ("to: [{operation: {ports: [8080]}}]", other_port.clone(), false),
        ("to: [{operation: {notPorts: [9090]}}]", other_port, false),
        ("to: [{operation: {methods: [GET, HEAD]}}]", get(WEB, "/"), true),
        ("to: [{operation: {notMethods: [POST]}}]", post.clone(), false),
        ("to: [{operation: {methods: [GET]}}]", tcp.clone(), false),
        ("to: [{operation: {notMethods: [GET]}}]", tcp, false),
        ("to: [{operation: {paths: [/api/v1]}}]", get(WEB, "/api/v1?x=1"), true),
        ("to: [{operation: {paths: [/api/v1]}}]", get(WEB, "/api/v1/"), false),
        ("to: [{operation: {paths: ['/api/*']}}]", get(WEB, "/api/x"), true),
        ("to: [{operation: {paths: ['*.css']}}]", get(WEB, "/s/a.css"), true),
        ("to: [{operation: {notPaths: ['/admin*']}}]", get(WEB, "/admin"), false),
        (
            "to: [{operation: {hosts: ['*.shop.aether.internal']}}]",
            get(WEB, "/"),
            true,
        ),
        (
            "to: [{operation: {hosts: [CART.shop.aether.internal]}}]",
            get(WEB, "/"),
            true,
        ),
        ("to: [{operation: {notHosts: ['cart.*']}}]", get(WEB, "/"), false),
        // Fields of one operation AND, operations OR; from and to AND.
        (
            "to: [{operation: {methods: [POST], paths: ['/api/*']}}]",
            post.clone(),
            false,
        ),
        (
            "to: [{operation: {methods: [PUT]}}, {operation: {paths: ['*']}}]",
            post,
            true,
        ),
        (
            "from: [{source: {namespaces: [ops]}}], to: [{operation: {ports: [8080]}}]",
            get(WEB, "/"),
            false,
        ),
    ]
}

#[test]
fn each_field_and_its_negation() {
    for (rule, request, allowed) in field_cases() {
        let allow = policy("shop", "p", &format!("{{rules: [{{{rule}}}]}}"));
        let expected = if allowed { Verdict::Allow } else { Verdict::Deny };
        assert_eq!(verdict(&[allow], &request), expected, "{rule} for {request:?}");
    }
}

#[test]
fn audit_and_dry_run_are_reported_never_enforced() {
    let audit = policy(
        "shop",
        "audit-admin",
        "{action: AUDIT, rules: [{to: [{operation: {paths: [/x]}}]}, {}]}",
    );
    let dry_deny = policy("shop", "dry-deny", "{action: DENY, dryRun: true, rules: [{}]}");
    let dry_allow = policy(
        "shop",
        "dry-allow",
        "{dryRun: true, rules: [{from: [{source: {namespaces: [ops]}}]}]}",
    );
    let d = decide(&[&audit], &get(WEB, "/"));
    assert_eq!((d.verdict, d.cause.clone()), (Verdict::Allow, Cause::NoAllowPolicy));
    assert_eq!((d.audited, d.dry_run), (vec![rule("shop/audit-admin", 1)], None));
    let d = decide(&[&dry_deny, &audit], &get(WEB, "/x"));
    assert_eq!(d.verdict, Verdict::Allow);
    assert_eq!(d.audited, [rule("shop/audit-admin", 0)]);
    assert_eq!(
        d.dry_run,
        Some((Verdict::Deny, Cause::Denied(rule("shop/dry-deny", 0))))
    );
    // A dry-run ALLOW does not make the workload "selected by an ALLOW policy".
    let d = decide(&[&dry_allow], &get(WEB, "/"));
    assert_eq!((d.verdict, d.cause), (Verdict::Allow, Cause::NoAllowPolicy));
    assert_eq!(d.dry_run, Some((Verdict::Deny, Cause::NoAllowMatched)));
    let d = decide(&[&dry_allow], &get(BATCH, "/"));
    assert_eq!(
        d.dry_run,
        Some((Verdict::Allow, Cause::Allowed(rule("shop/dry-allow", 0))))
    );
}

#[test]
fn the_decision_names_the_first_policy_by_key_and_its_first_rule() {
    let b = policy(
        "shop",
        "b",
        "{action: DENY, rules: [{from: [{source: {namespaces: [ops]}}]}, {}]}",
    );
    let a = policy(
        "shop",
        "a",
        "{action: DENY, rules: [{to: [{operation: {ports: [1]}}]}, {}]}",
    );
    let mesh = policy("aether-system", "z", "{action: DENY, rules: [{}]}");
    for order in [[&a, &b, &mesh], [&mesh, &b, &a]] {
        let d = decide(&order, &get(BATCH, "/"));
        assert_eq!(d.cause, Cause::Denied(rule("aether-system/z", 0)));
    }
    for order in [[&a, &b], [&b, &a]] {
        let d = decide(&order, &get(BATCH, "/"));
        assert_eq!(d.cause, Cause::Denied(rule("shop/a", 1)));
    }
}
