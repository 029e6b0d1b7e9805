//! The filters' place, order and names in the inbound listener; refusals that keep the
//! last good set; a policy change touching only the selected pods' inbound listeners.

use aether_proto::registry::v1::PatternKind;

use super::eval::stages;
use super::*;

const ALLOW_FRONTEND: &str = "apiVersion: security.aether.io/v1alpha1
kind: AuthorizationPolicy
metadata: {name: frontend, namespace: shop}
spec:
  rules:
    - from: [{source: {serviceAccounts: [shop/frontend]}}]
      to: [{operation: {ports: [8080], paths: ['/api/*']}}]
    - from: [{source: {namespaces: [ops]}}]
---
apiVersion: security.aether.io/v1alpha1
kind: AuthorizationPolicy
metadata: {name: no-plaintext, namespace: shop}
spec:
  action: DENY
  rules: [{from: [{source: {notPrincipals: ['*']}}]}]
";

/// The names of the filters of the HTTP chain (HTTP filters) and of the TCP chain.
fn filter_names(listener: &Listener) -> (Vec<String>, Vec<String>) {
    let http = &listener.filter_chains[0].filters[0];
    let Some(envoy_types::pb::envoy::config::listener::v3::filter::ConfigType::TypedConfig(any)) = &http.config_type
    else {
        panic!("untyped")
    };
    let hcm = envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::HttpConnectionManager::decode(&*any.value).unwrap();
    let tcp = listener.default_filter_chain.as_ref().unwrap();
    (
        hcm.http_filters.iter().map(|f| f.name.clone()).collect(),
        tcp.filters.iter().map(|f| f.name.clone()).collect(),
    )
}

fn policy_names(listener: &Listener, http: bool) -> Vec<Vec<String>> {
    let stages = stages(listener, http);
    // Stages without rules pass everything (the HTTP chain always has DENY and ALLOW).
    stages
        .iter()
        .filter_map(|s| s.rules.as_ref())
        .map(|rules| rules.rule_names())
        .collect()
}

#[test]
fn deny_then_allow_before_the_router_and_the_tcp_proxy_named_by_policy_and_rule() {
    let mut generator = Generator::default();
    let listener = inbound(&generate(&mut generator, &catalog(&[]), &[cart()]), &cart());
    let (http, tcp) = filter_names(&listener);
    // Always there on HTTP, so that a policy edit changes only the route table.
    let http_chain = [
        "aether.authz.audit.0",
        "aether.authz.deny",
        "aether.authz.allow",
        "envoy.filters.http.router",
    ];
    assert_eq!(http, http_chain);
    assert_eq!(tcp, ["envoy.filters.network.tcp_proxy"]);

    let generated = generate(&mut generator, &catalog(&policies(ALLOW_FRONTEND)), &[cart()]);
    let listener = inbound(&generated, &cart());
    let (http, tcp) = filter_names(&listener);
    assert_eq!(http, http_chain);
    let rbac = "envoy.filters.network.rbac";
    assert_eq!(tcp, [rbac, rbac, "envoy.filters.network.tcp_proxy"]);
    // DENY first; rule 0 of the ALLOW policy holds a path, so it cannot match raw TCP.
    let deny = vec!["shop/no-plaintext#0".to_owned()];
    assert_eq!(
        policy_names(&listener, true),
        [deny.clone(), vec!["shop/frontend#0".into(), "shop/frontend#1".into()]]
    );
    assert_eq!(
        policy_names(&listener, false),
        [deny, vec!["shop/frontend#1".to_owned()]]
    );
}

#[test]
fn http_fields_on_a_tcp_port_refuse_the_policy_for_the_pod_and_the_last_good_version_stays() {
    let mut generator = Generator::default();
    let good = policies(ALLOW_FRONTEND);
    let before = inbound(&generate(&mut generator, &catalog(&good), &[cart()]), &cart());
    // The edit drops the port: the path now also covers TCP 5432.
    let mut edited = (*good[0]).clone();
    edited.rules[0].to[0].ports.clear();
    let changed = vec![Arc::new(edited), good[1].clone()];
    let after = inbound(&generate(&mut generator, &catalog(&changed), &[cart()]), &cart());
    assert_eq!(after, before, "the last good version stays enforced");
    let refused: Vec<String> = generator
        .refused_policies()
        .map(|r| format!("{} {}", r.policy(), r.field()))
        .collect();
    assert_eq!(refused, ["shop/frontend rules[0].to[0].paths"]);

    // New to this pod, refused: not enforced at all (never silently a deny-all).
    let fresh = inbound(
        &generate(&mut Generator::default(), &catalog(&changed), &[cart()]),
        &cart(),
    );
    assert_eq!(policy_names(&fresh, true), [vec!["shop/no-plaintext#0".to_owned()]]);
}

#[test]
fn an_invalid_policy_keeps_its_last_valid_version() {
    let mut generator = Generator::default();
    let good = policies(ALLOW_FRONTEND);
    let before = inbound(&generate(&mut generator, &catalog(&good), &[cart()]), &cart());
    let mut broken = (*good[1]).clone();
    broken.rules[0].from[0].not_principals[0].kind = PatternKind::Unspecified as i32;
    let changed = vec![good[0].clone(), Arc::new(broken)];
    let after = inbound(&generate(&mut generator, &catalog(&changed), &[cart()]), &cart());
    assert_eq!(after, before);
    let refused: Vec<String> = generator.refused_policies().map(|r| r.to_string()).collect();
    assert_eq!(refused.len(), 1);
    assert!(
        refused[0].contains("shop/no-plaintext") && refused[0].contains("not_principals"),
        "{refused:?}"
    );
}

#[test]
fn a_policy_change_changes_only_the_selected_pods_inbound_listener() {
    let mut web = cart();
    web.info.namespace = "web".into();
    web.info.name = "web-1".into();
    web.netns = "/run/aether/netns/web".into();
    let pods = [cart(), web];
    let versions = |generated: &Generated| -> BTreeMap<String, String> {
        let all = generated.values().flatten();
        all.map(|r| (r.name.clone(), r.version.clone())).collect()
    };
    let mut generator = Generator::default();
    let before = versions(&generate(&mut generator, &catalog(&[]), &pods));
    let after = versions(&generate(&mut generator, &catalog(&policies(ALLOW_FRONTEND)), &pods));
    let changed: Vec<&String> = before.keys().filter(|k| before[*k] != after[*k]).collect();
    assert_eq!(changed, ["inbound|shop/cart-1"]);
    assert_eq!(before.len(), after.len());
    // Equal policies give equal bytes, whatever order Envoy's policy map iterates in.
    let again = versions(&generate(
        &mut Generator::default(),
        &catalog(&policies(ALLOW_FRONTEND)),
        &pods,
    ));
    assert_eq!(again, after);
}

const AUDIT: &str = "apiVersion: security.aether.io/v1alpha1
kind: AuthorizationPolicy
metadata: {name: watch, namespace: shop}
spec:
  action: AUDIT
  rules: [{to: [{operation: {ports: [8080], methods: [DELETE]}}]}]
";

#[test]
fn audit_policies_within_the_slots_change_the_route_table_not_the_http_chain_bytes() {
    let name = format!("inbound|{}", cart().id());
    // The HTTP chain as pushed (Envoy drains the connections of a chain whose bytes
    // change, and only those), the route table's version, and the HTTP chain's filters.
    let inbound_of = |generated: &Generated| {
        let resource = |type_url: &str| generated[type_url].iter().find(|r| r.name == name).unwrap().clone();
        let listener = Listener::decode(&*resource(crate::xds::LISTENER).body.value).unwrap();
        let (http, _) = filter_names(&inbound(generated, &cart()));
        let chain = listener.filter_chains[0].encode_to_vec();
        (chain, resource(crate::xds::ROUTE).version.clone(), http)
    };
    let mut generator = Generator::default();
    let (chain_none, table_none, _) = inbound_of(&generate(&mut generator, &catalog(&[]), &[cart()]));
    let one = policies(AUDIT);
    let (chain_one, table_one, _) = inbound_of(&generate(&mut generator, &catalog(&one), &[cart()]));
    assert!(
        chain_one == chain_none,
        "the first AUDIT policy takes the slot that is always there"
    );
    assert_ne!(table_one, table_none, "its rules come with the route table");
    // A second one outgrows the slots: two now (then four, eight, …).
    let mut two = one.clone();
    let mut other = (*one[0]).clone();
    other.name = "watch-more".into();
    two.push(Arc::new(other));
    let (chain_two, _, http) = inbound_of(&generate(&mut generator, &catalog(&two), &[cart()]));
    assert!(chain_two != chain_one);
    assert_eq!(&http[..2], ["aether.authz.audit.0", "aether.authz.audit.1"]);
}
