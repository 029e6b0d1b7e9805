//! Evaluates an xDS matcher of RBAC actions for one request, as Envoy does, for the
//! subset the indexed compile emits (anything else panics).

use aether_api::authorization::AuthzRequest;
use envoy_types::pb::envoy::config::rbac::v3::Action;
use envoy_types::pb::envoy::extensions::matching::input_matchers::ip::v3::Ip;
use envoy_types::pb::envoy::r#type::matcher::v3::HttpRequestHeaderMatchInput;
use envoy_types::pb::xds::core::v3::TypedExtensionConfig;
use envoy_types::pb::xds::r#type::matcher::v3::matcher::matcher_list::Predicate;
use envoy_types::pb::xds::r#type::matcher::v3::matcher::matcher_list::predicate::{MatchType, single_predicate};
use envoy_types::pb::xds::r#type::matcher::v3::matcher::{MatcherType, OnMatch, matcher_tree, on_match};
use envoy_types::pb::xds::r#type::matcher::v3::{Matcher, StringMatcher, string_matcher};
use ipnet::IpNet;
use prost::Message;

use crate::xds::resources::PORT_HEADER;
use crate::xds::resources::authorization::NO_MATCH;

/// Whether the matcher denies: a DENY action, named after its rule (`None`: no match).
pub fn denies(m: &Matcher, request: &AuthzRequest) -> Option<Option<String>> {
    let action = run(m, request);
    (action.action == 1).then(|| named(action))
}

/// The rule a match names (`None`: no rule matched).
pub fn first_match(m: &Matcher, request: &AuthzRequest) -> Option<String> {
    named(run(m, request))
}

/// Every rule an action of the matcher names, sorted, once each.
pub fn rule_names(m: &Matcher) -> Vec<String> {
    let mut names = std::collections::BTreeSet::new();
    collect_names(m, &mut names);
    names.into_iter().collect()
}

fn collect_names(m: &Matcher, names: &mut std::collections::BTreeSet<String>) {
    let mut nexts: Vec<&OnMatch> = m.on_no_match.as_deref().into_iter().collect();
    match m.matcher_type.as_ref() {
        Some(MatcherType::MatcherList(list)) => nexts.extend(list.matchers.iter().filter_map(|f| f.on_match.as_ref())),
        Some(MatcherType::MatcherTree(tree)) => match tree.tree_type.as_ref().unwrap() {
            matcher_tree::TreeType::ExactMatchMap(map) | matcher_tree::TreeType::PrefixMatchMap(map) => {
                nexts.extend(map.map.values())
            }
            other => panic!("{other:?} is not emitted"),
        },
        None => {}
    }
    for next in nexts {
        match next.on_match.as_ref().unwrap() {
            on_match::OnMatch::Matcher(m) => collect_names(m, names),
            on_match::OnMatch::Action(a) => {
                let action = Action::decode(&*a.typed_config.as_ref().unwrap().value).unwrap();
                names.extend(named(action));
            }
        }
    }
}

fn named(action: Action) -> Option<String> {
    (action.name != NO_MATCH).then_some(action.name)
}

/// The action the matcher ends in; every matcher we emit ends in one.
fn run(m: &Matcher, request: &AuthzRequest) -> Action {
    let found = match m.matcher_type.as_ref() {
        Some(MatcherType::MatcherList(list)) => list
            .matchers
            .iter()
            .find(|f| holds(f.predicate.as_ref().unwrap(), request))
            .map(|f| f.on_match.clone().unwrap()),
        Some(MatcherType::MatcherTree(tree)) => {
            let caller = input(tree.input.as_ref().unwrap(), request);
            match (tree.tree_type.as_ref().unwrap(), caller) {
                (_, None) => None,
                (matcher_tree::TreeType::ExactMatchMap(map), Some(id)) => map.map.get(&id).cloned(),
                // The longest key that begins the input.
                (matcher_tree::TreeType::PrefixMatchMap(map), Some(id)) => map
                    .map
                    .iter()
                    .filter(|(k, _)| id.starts_with(k.as_str()))
                    .max_by_key(|(k, _)| k.len())
                    .map(|(_, v)| v.clone()),
                (other, _) => panic!("{other:?} is not emitted"),
            }
        }
        None => None,
    };
    let next = found.or_else(|| m.on_no_match.as_deref().cloned());
    on(&next.expect("every matcher ends in an action"), request)
}

fn on(next: &OnMatch, request: &AuthzRequest) -> Action {
    match next.on_match.as_ref().unwrap() {
        on_match::OnMatch::Matcher(m) => run(m, request),
        on_match::OnMatch::Action(a) => Action::decode(&*a.typed_config.as_ref().unwrap().value).unwrap(),
    }
}

fn holds(p: &Predicate, request: &AuthzRequest) -> bool {
    match p.match_type.as_ref().unwrap() {
        MatchType::AndMatcher(list) => list.predicate.iter().all(|p| holds(p, request)),
        MatchType::OrMatcher(list) => list.predicate.iter().any(|p| holds(p, request)),
        MatchType::NotMatcher(p) => !holds(p, request),
        MatchType::SinglePredicate(single) => {
            let config = single.input.as_ref().unwrap();
            match single.matcher.as_ref().unwrap() {
                single_predicate::Matcher::ValueMatch(m) => input(config, request).is_some_and(|v| string(m, &v)),
                single_predicate::Matcher::CustomMatch(c) => {
                    assert_eq!(config.name, "direct_source_ip", "an IP match reads the peer address");
                    let ip = Ip::decode(&*c.typed_config.as_ref().unwrap().value).unwrap();
                    ip.cidr_ranges.iter().any(|r| {
                        let net: IpNet = format!("{}/{}", r.address_prefix, r.prefix_len.unwrap().value)
                            .parse()
                            .unwrap();
                        net.contains(&request.peer_ip)
                    })
                }
            }
        }
    }
}

/// What an input reads: the caller's URI SAN (none in plaintext), or a request header
/// as the inbound listener sees it (the caller's Envoy sets the port header).
fn input(config: &TypedExtensionConfig, request: &AuthzRequest) -> Option<String> {
    let any = config.typed_config.as_ref().unwrap();
    if any.type_url.ends_with(".UriSanInput") {
        return request.principal.clone();
    }
    assert!(
        any.type_url.ends_with(".HttpRequestHeaderMatchInput"),
        "{} is not emitted",
        any.type_url
    );
    let http = request.http.as_ref().unwrap();
    let name = HttpRequestHeaderMatchInput::decode(&*any.value).unwrap().header_name;
    Some(match name.as_str() {
        ":method" => http.method.clone(),
        ":authority" => http.host.clone(),
        ":path" => http.path.clone(),
        name if name == PORT_HEADER => request.port.to_string(),
        other => panic!("header {other} is not emitted"),
    })
}

fn string(m: &StringMatcher, value: &str) -> bool {
    let fold = |s: &str| match m.ignore_case {
        true => s.to_ascii_lowercase(),
        false => s.to_owned(),
    };
    match m.match_pattern.as_ref().unwrap() {
        string_matcher::MatchPattern::Exact(x) => fold(value) == fold(x),
        string_matcher::MatchPattern::Prefix(x) => fold(value).starts_with(&fold(x)),
        string_matcher::MatchPattern::Suffix(x) => fold(value).ends_with(&fold(x)),
        // Envoy matches a safe regex against the whole value.
        string_matcher::MatchPattern::SafeRegex(r) => regex::Regex::new(&format!("^(?:{})$", r.regex))
            .unwrap()
            .is_match(value),
        other => panic!("{other:?} is not emitted"),
    }
}
