//! The caller index: which rules a caller's key holds, and the bound that falls back to
//! the flat list.

use aether_proto::registry::v1::{AuthorizationRule, AuthorizationSource};

use super::super::index::{IndexedMatcher, matcher};
use super::super::mirror;

const TD: &str = "cluster.local";

fn from(source: AuthorizationSource) -> AuthorizationRule {
    AuthorizationRule {
        from: vec![source],
        ..Default::default()
    }
}

fn accounts(list: &[&str]) -> AuthorizationSource {
    AuthorizationSource {
        service_accounts: list.iter().map(|a| a.to_string()).collect(),
        ..Default::default()
    }
}

fn namespaces(list: &[&str]) -> AuthorizationSource {
    AuthorizationSource {
        namespaces: list.iter().map(|n| n.to_string()).collect(),
        ..Default::default()
    }
}

fn build(rules: &[(&str, AuthorizationRule)]) -> IndexedMatcher {
    let named: Vec<(String, &AuthorizationRule)> = rules.iter().map(|(n, r)| (n.to_string(), r)).collect();
    matcher(
        mirror::ALLOW,
        &named,
        &[8080],
        TD,
        super::super::index::CallerInput::PeerCertificate,
    )
}

/// The rule names under each key of a map level, and the level that takes the rest.
fn level(m: &IndexedMatcher) -> (Vec<(String, Vec<String>)>, IndexedMatcher) {
    let tree = m.matcher_tree.as_ref().expect("a map level");
    let map = tree
        .exact_match_map
        .as_ref()
        .or(tree.prefix_match_map.as_ref())
        .unwrap();
    let keyed = map.entries.iter().map(|e| {
        let nested = e.value.as_ref().unwrap().matcher.as_deref().unwrap();
        (e.key.clone(), names(nested))
    });
    let rest = m.on_no_match.as_ref().unwrap().matcher.as_deref().unwrap().clone();
    (keyed.collect(), rest)
}

/// The rules of a list level, in order.
fn names(list: &IndexedMatcher) -> Vec<String> {
    let matchers = list.matcher_list.iter().flat_map(|l| &l.matchers);
    let action = |f: &envoy_types::pb::xds::r#type::matcher::v3::matcher::matcher_list::FieldMatcher| {
        use prost::Message;
        let Some(envoy_types::pb::xds::r#type::matcher::v3::matcher::on_match::OnMatch::Action(a)) =
            &f.on_match.as_ref().unwrap().on_match
        else {
            panic!("a list level ends in actions")
        };
        let action = envoy_types::pb::envoy::config::rbac::v3::Action::decode(&*a.typed_config.as_ref().unwrap().value);
        action.unwrap().name
    };
    matchers.map(action).collect()
}

#[test]
fn a_callers_key_holds_its_rules_its_namespaces_and_the_unkeyed_ones_in_name_order() {
    let id = |ns: &str, sa: &str| format!("spiffe://{TD}/ns/{ns}/sa/{sa}");
    let m = build(&[
        ("a/one#0", from(accounts(&["shop/web"]))),
        ("a/one#1", from(namespaces(&["shop"]))),
        ("a/two#0", AuthorizationRule::default()),
        ("a/two#1", from(accounts(&["ops/batch", "shop/web"]))),
    ]);
    let (exact, by_prefix) = level(&m);
    assert_eq!(
        exact,
        [
            (id("ops", "batch"), vec!["a/two#0".into(), "a/two#1".into()]),
            (
                id("shop", "web"),
                vec!["a/one#0".into(), "a/one#1".into(), "a/two#0".into(), "a/two#1".into()]
            ),
        ]
    );
    let (prefixes, unkeyed) = level(&by_prefix);
    let shop = format!("spiffe://{TD}/ns/shop/sa/");
    assert_eq!(prefixes, [(shop, vec!["a/one#1".to_string(), "a/two#0".into()])]);
    assert_eq!(names(&unkeyed), ["a/two#0"]);
}

#[test]
fn too_many_unkeyed_rules_under_every_key_fall_back_to_the_flat_list() {
    let mut rules: Vec<(String, AuthorizationRule)> = (0..20)
        .map(|i| (format!("a/keyed#{i:02}"), from(accounts(&[&format!("shop/sa-{i}")]))))
        .collect();
    rules.extend((0..20).map(|i| (format!("b/open#{i:02}"), AuthorizationRule::default())));
    let refs: Vec<(&str, AuthorizationRule)> = rules.iter().map(|(n, r)| (n.as_str(), r.clone())).collect();
    let m = build(&refs);
    assert!(m.matcher_tree.is_none(), "20 keys × 20 unkeyed rules is over the bound");
    assert_eq!(names(&m).len(), 40);
    // Fewer keys: indexed.
    assert!(build(&refs[15..]).matcher_tree.is_some());
}

#[test]
fn rules_no_identity_keys_are_looked_up_by_path_prefix() {
    let paths = |list: &[&str]| AuthorizationRule {
        to: vec![aether_proto::registry::v1::AuthorizationOperation {
            paths: list
                .iter()
                .map(|p| aether_api::authorization::check::pattern(p).unwrap())
                .collect(),
            ..Default::default()
        }],
        ..Default::default()
    };
    let m = build(&[
        ("a/deny#0", paths(&["/admin/*"])),
        ("a/deny#1", paths(&["/api/orders", "/a*"])),
        ("a/deny#2", paths(&["*.secret"])),
    ]);
    let (prefixes, unkeyed) = level(&m);
    assert_eq!(
        prefixes,
        [
            ("/a".to_string(), vec!["a/deny#1".to_string(), "a/deny#2".into()]),
            (
                "/admin/".into(),
                vec!["a/deny#0".into(), "a/deny#1".into(), "a/deny#2".into()]
            ),
            ("/api/orders".into(), vec!["a/deny#1".into(), "a/deny#2".into()]),
        ]
    );
    assert_eq!(names(&unkeyed), ["a/deny#2"]);
}
