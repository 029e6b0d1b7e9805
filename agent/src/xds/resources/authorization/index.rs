//! The HTTP chain's rules as an xDS matcher indexed by the caller's SPIFFE ID, then by
//! the path (proposals/013, Cost): a request pays for the rules that can match its
//! caller and path, not for every rule of every policy selecting the pod.
//!
//! Envoy's policy list walks every rule until one matches, and an identity check that
//! fails costs a certificate parse there: 100 policies added ~50 µs to a request. The
//! matcher looks the caller's URI SAN up once: an exact map (service accounts, exact
//! principals), then a longest-prefix map (namespaces, principal prefixes), each key
//! holding the rules that can match that caller in name order, then the rules no
//! identity keys (no `from`, negated or suffix identities, IP blocks alone); each of
//! those lists is indexed again by path prefix (rules naming no path, or a suffix, go
//! under every key). A rule under a key is still judged whole, so the index only skips
//! rules that cannot match: the verdict and the rule named are the policy list's.

use aether_api::authorization::{namespace_prefix, service_account_id};
use aether_proto::registry::v1::{
    AuthorizationOperation, AuthorizationPattern, AuthorizationRule, AuthorizationSource, PatternKind,
};
use envoy_types::pb::envoy::config::rbac::v3::{Action, rbac};
use envoy_types::pb::envoy::extensions::matching::common_inputs::network::v3::{DirectSourceIpInput, FilterStateInput};
use envoy_types::pb::envoy::extensions::matching::common_inputs::ssl::v3::UriSanInput;
use envoy_types::pb::envoy::extensions::matching::input_matchers::ip::v3::Ip;
use envoy_types::pb::envoy::r#type::matcher::v3::HttpRequestHeaderMatchInput;
use envoy_types::pb::google::protobuf::Any;
use envoy_types::pb::xds::core::v3::TypedExtensionConfig;
use envoy_types::pb::xds::r#type::matcher::v3::matcher::matcher_list::predicate::{
    MatchType, PredicateList, SinglePredicate, single_predicate,
};
use envoy_types::pb::xds::r#type::matcher::v3::matcher::matcher_list::{FieldMatcher, Predicate};
use envoy_types::pb::xds::r#type::matcher::v3::matcher::{MatcherList, OnMatch, on_match};
use envoy_types::pb::xds::r#type::matcher::v3::{RegexMatcher, StringMatcher, regex_matcher, string_matcher};
use prost::{Message, Name};

use super::NO_MATCH;
use super::compile::cidr;
use crate::xds::resources::PORT_HEADER;

/// An index whose lists would hold more than this many rules per rule compiled (rules
/// no identity keys are repeated under every key) is not built: the flat list is
/// judged instead, slower but bounded in Envoy's memory.
const MAX_REPEATS: usize = 8;

/// `xds.type.matcher.v3.Matcher` with its maps as lists sorted by key, so equal rules
/// give equal bytes (prost encodes the generated `HashMap` in a random order).
#[derive(Clone, PartialEq, prost::Message)]
pub struct IndexedMatcher {
    #[prost(message, optional, tag = "1")]
    pub matcher_list: Option<MatcherList>,
    #[prost(message, optional, tag = "2")]
    pub matcher_tree: Option<Tree>,
    #[prost(message, optional, boxed, tag = "3")]
    pub on_no_match: Option<Box<Next>>,
}

/// `Matcher.MatcherTree` with an exact or a prefix map.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Tree {
    #[prost(message, optional, tag = "1")]
    pub input: Option<TypedExtensionConfig>,
    #[prost(message, optional, tag = "2")]
    pub exact_match_map: Option<Map>,
    #[prost(message, optional, tag = "3")]
    pub prefix_match_map: Option<Map>,
}

/// `MatcherTree.MatchMap`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Map {
    #[prost(message, repeated, tag = "1")]
    pub entries: Vec<MapEntry>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct MapEntry {
    #[prost(string, tag = "1")]
    pub key: String,
    #[prost(message, optional, tag = "2")]
    pub value: Option<Next>,
}

/// `Matcher.OnMatch`: a nested matcher or an action.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Next {
    #[prost(message, optional, boxed, tag = "1")]
    pub matcher: Option<Box<IndexedMatcher>>,
    #[prost(message, optional, tag = "2")]
    pub action: Option<TypedExtensionConfig>,
}

/// The caller's identity as an index key.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Key {
    Exact(String),
    Prefix(String),
}

/// One rule to judge: its Envoy name (`<ns>/<name>#<rule>`), its predicate, and per
/// dimension the keys it can match (`None`: any value).
struct Entry {
    name: String,
    predicate: Predicate,
    callers: Option<Vec<Key>>,
    paths: Option<Vec<Key>>,
}

/// Where the caller's SPIFFE ID is read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CallerInput {
    /// The mTLS peer's URI SAN (a destination's inbound chain).
    PeerCertificate,
    /// The calling pod's identity its own outbound listener set in this filter state
    /// (the callers' side: the pod is the caller, no certificate is presented to us).
    FilterState(&'static str),
}

impl CallerInput {
    fn input(self) -> TypedExtensionConfig {
        match self {
            CallerInput::PeerCertificate => typed("uri_san", &UriSanInput {}),
            CallerInput::FilterState(key) => typed(
                "filter_state",
                &FilterStateInput {
                    key: key.to_owned(),
                    ..Default::default()
                },
            ),
        }
    }
}

/// What a level of the index looks up.
#[derive(Clone, Copy)]
enum Dimension {
    /// The caller's SPIFFE ID: exact IDs, then ID prefixes.
    Caller(CallerInput),
    /// `:path`: path prefixes (an exact path is its own prefix; the rule checks it).
    Path,
}

impl Dimension {
    fn keys(self, entry: &Entry) -> &Option<Vec<Key>> {
        match self {
            Dimension::Caller(_) => &entry.callers,
            Dimension::Path => &entry.paths,
        }
    }

    fn input(self) -> TypedExtensionConfig {
        match self {
            Dimension::Caller(caller) => caller.input(),
            Dimension::Path => typed(
                "path",
                &HttpRequestHeaderMatchInput {
                    header_name: ":path".to_owned(),
                },
            ),
        }
    }
}

/// The rules (name, rule; sorted by name) as a matcher: a match takes `action` and is
/// named after its rule; no match takes the other action, named [`NO_MATCH`] (Envoy's
/// own word for it in a policy list's denial).
pub fn matcher(
    action: i32,
    rules: &[(String, &AuthorizationRule)],
    http_ports: &[u16],
    trust_domain: &str,
    caller: CallerInput,
) -> IndexedMatcher {
    let entries: Vec<Entry> = rules
        .iter()
        .filter_map(|(name, rule)| {
            Some(Entry {
                name: name.clone(),
                predicate: predicate(rule, http_ports, trust_domain, caller)?,
                callers: caller_keys(rule, trust_domain),
                paths: path_keys(rule),
            })
        })
        .collect();
    let otherwise = match action {
        super::mirror::ALLOW => super::mirror::DENY,
        _ => super::mirror::ALLOW,
    };
    let chosen: Vec<&Entry> = entries.iter().collect();
    index(&chosen, &[Dimension::Caller(caller), Dimension::Path], &|e| {
        list(e, action, otherwise)
    })
}

/// `entries` looked up by the first of `dimensions` (each key holding the entries that
/// can match it, in order), the rest by the next; a plain `list` when none is left, or
/// when no entry has a key in this one, or when the entries no key bounds would be
/// repeated under too many keys.
fn index(entries: &[&Entry], dimensions: &[Dimension], list: &dyn Fn(&[&Entry]) -> IndexedMatcher) -> IndexedMatcher {
    let Some((&dimension, next)) = dimensions.split_first() else {
        return list(entries);
    };
    let exact = keys_of(entries, dimension, |k| matches!(k, Key::Exact(_)));
    let prefixes = keys_of(entries, dimension, |k| matches!(k, Key::Prefix(_)));
    let unkeyed: Vec<&Entry> = entries
        .iter()
        .copied()
        .filter(|e| dimension.keys(e).is_none())
        .collect();
    let repeats = (exact.len() + prefixes.len()) * unkeyed.len();
    if exact.is_empty() && prefixes.is_empty() || repeats > MAX_REPEATS * entries.len() {
        return index(entries, next, list);
    }
    let for_key = |key: &str, exact: bool| -> IndexedMatcher {
        let can_match = |e: &&&Entry| {
            dimension.keys(e).as_ref().is_none_or(|keys| {
                keys.iter().any(|k| match k {
                    Key::Exact(id) => exact && id == key,
                    Key::Prefix(p) => key.starts_with(p.as_str()),
                })
            })
        };
        let chosen: Vec<&Entry> = entries.iter().filter(can_match).copied().collect();
        index(&chosen, next, list)
    };
    let by_prefix = tree(
        dimension,
        false,
        prefixes.iter().map(|p| (p.clone(), for_key(p, false))).collect(),
        index(&unkeyed, next, list),
    );
    tree(
        dimension,
        true,
        exact.iter().map(|id| (id.clone(), for_key(id, true))).collect(),
        by_prefix,
    )
}

/// The distinct key strings of one kind in one dimension, sorted.
fn keys_of(entries: &[&Entry], dimension: Dimension, kind: impl Fn(&Key) -> bool) -> Vec<String> {
    let mut keys: Vec<String> = entries
        .iter()
        .flat_map(|e| dimension.keys(e).iter().flatten())
        .filter(|k| kind(k))
        .map(|k| match k {
            Key::Exact(s) | Key::Prefix(s) => s.clone(),
        })
        .collect();
    keys.sort();
    keys.dedup();
    keys
}

/// A map on the dimension's input (exact or longest prefix); no key: `otherwise`. An
/// empty map is just `otherwise`.
fn tree(
    dimension: Dimension,
    exact: bool,
    keyed: Vec<(String, IndexedMatcher)>,
    otherwise: IndexedMatcher,
) -> IndexedMatcher {
    if keyed.is_empty() {
        return otherwise;
    }
    let entries = keyed
        .into_iter()
        .map(|(key, matcher)| MapEntry {
            key,
            value: Some(nested(matcher)),
        })
        .collect();
    let map = Some(Map { entries });
    let (exact_match_map, prefix_match_map) = if exact { (map, None) } else { (None, map) };
    IndexedMatcher {
        matcher_list: None,
        matcher_tree: Some(Tree {
            input: Some(dimension.input()),
            exact_match_map,
            prefix_match_map,
        }),
        on_no_match: Some(Box::new(nested(otherwise))),
    }
}

fn nested(matcher: IndexedMatcher) -> Next {
    Next {
        matcher: Some(Box::new(matcher)),
        action: None,
    }
}

/// The entries in order, first match wins; none: `otherwise`, named [`NO_MATCH`].
fn list(entries: &[&Entry], action: i32, otherwise: i32) -> IndexedMatcher {
    let matchers: Vec<FieldMatcher> = entries
        .iter()
        .map(|e| FieldMatcher {
            predicate: Some(e.predicate.clone()),
            on_match: Some(OnMatch {
                keep_matching: false,
                on_match: Some(on_match::OnMatch::Action(rbac_action(&e.name, action))),
            }),
        })
        .collect();
    IndexedMatcher {
        matcher_list: (!matchers.is_empty()).then_some(MatcherList { matchers }),
        matcher_tree: None,
        on_no_match: Some(Box::new(Next {
            matcher: None,
            action: Some(rbac_action(NO_MATCH, otherwise)),
        })),
    }
}

fn rbac_action(name: &str, action: i32) -> TypedExtensionConfig {
    let action = Action {
        name: name.to_owned(),
        action: rbac::Action::try_from(action).unwrap_or(rbac::Action::Deny) as i32,
    };
    typed("action", &action)
}

// ---- Keys: the identities a rule can match, as exact IDs or ID prefixes.

/// `None` when some source of the rule can match a caller no key names.
fn caller_keys(rule: &AuthorizationRule, trust_domain: &str) -> Option<Vec<Key>> {
    if rule.from.is_empty() {
        return None;
    }
    let mut keys = Vec::new();
    for source in &rule.from {
        keys.extend(source_keys(source, trust_domain)?);
    }
    Some(keys)
}

/// The paths a rule can match as prefixes; `None` when some operation of it can match a
/// path no prefix names (no paths, a suffix, `*`).
fn path_keys(rule: &AuthorizationRule) -> Option<Vec<Key>> {
    if rule.to.is_empty() {
        return None;
    }
    let mut keys = Vec::new();
    for operation in &rule.to {
        if operation.paths.is_empty() {
            return None;
        }
        for path in &operation.paths {
            match path.kind() {
                PatternKind::Exact | PatternKind::Prefix => keys.push(Key::Prefix(path.value.clone())),
                _ => return None,
            }
        }
    }
    Some(keys)
}

/// One positive identity field of the source (they are ANDed, so any one bounds it).
fn source_keys(s: &AuthorizationSource, trust_domain: &str) -> Option<Vec<Key>> {
    let principal = |p: &AuthorizationPattern| match p.kind() {
        PatternKind::Exact => Some(Key::Exact(p.value.clone())),
        PatternKind::Prefix => Some(Key::Prefix(p.value.clone())),
        _ => None,
    };
    let principals: Option<Vec<Key>> = s.principals.iter().map(principal).collect();
    if let Some(keys) = principals.filter(|k| !k.is_empty()) {
        return Some(keys);
    }
    if !s.service_accounts.is_empty() {
        let id = |a: &String| Key::Exact(service_account_id(a, trust_domain));
        return Some(s.service_accounts.iter().map(id).collect());
    }
    if !s.namespaces.is_empty() {
        let prefix = |ns: &String| Key::Prefix(namespace_prefix(ns, trust_domain));
        return Some(s.namespaces.iter().map(prefix).collect());
    }
    None
}

// ---- Predicates: a rule judged whole, as the policy list's compile judges it.

/// `None` when the rule cannot match on this layer (a port no HTTP request here is for).
fn predicate(
    rule: &AuthorizationRule,
    http_ports: &[u16],
    trust_domain: &str,
    caller: CallerInput,
) -> Option<Predicate> {
    let mut all = Vec::new();
    if !rule.to.is_empty() {
        let operations: Vec<Predicate> = rule.to.iter().filter_map(|o| operation(o, http_ports)).collect();
        if operations.is_empty() {
            return None;
        }
        all.push(any_of(operations));
    }
    if !rule.from.is_empty() {
        all.push(any_of(
            rule.from.iter().map(|s| source(s, trust_domain, caller)).collect(),
        ));
    }
    Some(all_of(all))
}

/// Every field set holds (AND); a field holds when any value matches, a `not_*` one
/// when none does. Identity last: an operation rules a rule out for less.
fn source(s: &AuthorizationSource, trust_domain: &str, input: CallerInput) -> Predicate {
    let caller = |matcher| caller(input, matcher);
    let mut all = Vec::new();
    let mut field = |values: Vec<Predicate>, negated: bool| {
        if !values.is_empty() {
            all.push(negate_if(any_of(values), negated));
        }
    };
    let block = |b: &String| ip_in(b);
    field(s.ip_blocks.iter().map(block).collect(), false);
    field(s.not_ip_blocks.iter().map(block).collect(), true);
    let principal = |p: &AuthorizationPattern| match p.kind() {
        PatternKind::Any => caller(prefix("spiffe://")),
        _ => caller(pattern(p)),
    };
    field(s.principals.iter().map(principal).collect(), false);
    field(s.not_principals.iter().map(principal).collect(), true);
    let account = |a: &String| caller(exact(&service_account_id(a, trust_domain)));
    field(s.service_accounts.iter().map(account).collect(), false);
    field(s.not_service_accounts.iter().map(account).collect(), true);
    let namespace = |ns: &String| caller(prefix(&namespace_prefix(ns, trust_domain)));
    field(s.namespaces.iter().map(namespace).collect(), false);
    field(s.not_namespaces.iter().map(namespace).collect(), true);
    all_of(all)
}

/// An operation on the HTTP chain, to the pod's `http_ports`; `None` when it names only
/// ports no HTTP request here is delivered to.
fn operation(o: &AuthorizationOperation, http_ports: &[u16]) -> Option<Predicate> {
    let mut all = Vec::new();
    for (list, negated) in [(&o.ports, false), (&o.not_ports, true)] {
        if list.is_empty() {
            continue;
        }
        let routed: Vec<Predicate> = list.iter().filter_map(|p| delivered_to(*p, http_ports)).collect();
        // A port no HTTP request here is delivered to: never (or always, negated).
        match (routed.is_empty(), negated) {
            (true, false) => return None,
            (true, true) => {}
            (false, _) => all.push(negate_if(any_of(routed), negated)),
        }
    }
    let mut field = |values: Vec<Predicate>, negated: bool| {
        if !values.is_empty() {
            all.push(negate_if(any_of(values), negated));
        }
    };
    let method = |m: &String| header(":method", exact(m));
    field(o.methods.iter().map(method).collect(), false);
    field(o.not_methods.iter().map(method).collect(), true);
    field(o.paths.iter().map(path).collect(), false);
    field(o.not_paths.iter().map(path).collect(), true);
    field(o.hosts.iter().map(host).collect(), false);
    field(o.not_hosts.iter().map(host).collect(), true);
    Some(all_of(all))
}

/// A request on the HTTP chain is delivered to the port its port header names, if that
/// is one of the HTTP ports, else to the first: the inbound route table's choice.
fn delivered_to(port: u32, http_ports: &[u16]) -> Option<Predicate> {
    let names = |p: &u16| header(PORT_HEADER, exact(&p.to_string()));
    match http_ports.iter().position(|p| u32::from(*p) == port)? {
        0 if http_ports.len() == 1 => Some(always()),
        0 => Some(negate_if(any_of(http_ports[1..].iter().map(names).collect()), true)),
        i => Some(names(&http_ports[i])),
    }
}

/// The path without its query (patterns hold no `?`, validated): an exact path is the
/// whole `:path` or its part before `?`; a prefix is the same on both; a suffix ends
/// the part before the first `?`.
fn path(p: &AuthorizationPattern) -> Predicate {
    let value = &p.value;
    match p.kind() {
        PatternKind::Exact => any_of(vec![
            header(":path", exact(value)),
            header(":path", prefix(&format!("{value}?"))),
        ]),
        PatternKind::Prefix => header(":path", prefix(value)),
        PatternKind::Suffix => header(":path", regex(&format!("[^?]*{}(\\?.*)?", escape(value)))),
        _ => always(),
    }
}

/// `:authority` compared without its `:port`, ignoring case.
fn host(p: &AuthorizationPattern) -> Predicate {
    let port = "(:[0-9]+)?";
    let value = escape(&p.value);
    let matcher = match p.kind() {
        PatternKind::Exact => regex(&format!("(?i){value}{port}")),
        PatternKind::Suffix => regex(&format!("(?i).*{value}{port}")),
        // A host prefix ends in '.', so it never reaches into the port.
        PatternKind::Prefix => StringMatcher {
            ignore_case: true,
            ..prefix(&p.value)
        },
        _ => return always(),
    };
    header(":authority", matcher)
}

fn pattern(p: &AuthorizationPattern) -> StringMatcher {
    match p.kind() {
        PatternKind::Prefix => prefix(&p.value),
        PatternKind::Suffix => string(string_matcher::MatchPattern::Suffix(p.value.clone())),
        _ => exact(&p.value),
    }
}

// ---- Predicate builders.

fn caller(input: CallerInput, matcher: StringMatcher) -> Predicate {
    single(input.input(), single_predicate::Matcher::ValueMatch(matcher))
}

fn header(name: &str, matcher: StringMatcher) -> Predicate {
    let header = HttpRequestHeaderMatchInput {
        header_name: name.to_owned(),
    };
    single(typed("header", &header), single_predicate::Matcher::ValueMatch(matcher))
}

/// The connection's peer address (the direct one: no header can set it) in `block`.
fn ip_in(block: &str) -> Predicate {
    let ip = Ip {
        cidr_ranges: vec![cidr(block)],
        stat_prefix: "aether_authz_ip".to_owned(),
    };
    single(
        typed("direct_source_ip", &DirectSourceIpInput {}),
        single_predicate::Matcher::CustomMatch(typed("ip", &ip)),
    )
}

/// True for every request: `:method` is always there.
fn always() -> Predicate {
    header(":method", regex(".*"))
}

fn single(input: TypedExtensionConfig, matcher: single_predicate::Matcher) -> Predicate {
    Predicate {
        match_type: Some(MatchType::SinglePredicate(SinglePredicate {
            input: Some(input),
            matcher: Some(matcher),
        })),
    }
}

/// All of `predicates`; one as itself, none as [`always`].
fn all_of(mut predicates: Vec<Predicate>) -> Predicate {
    match predicates.len() {
        0 => always(),
        1 => predicates.remove(0),
        _ => Predicate {
            match_type: Some(MatchType::AndMatcher(PredicateList { predicate: predicates })),
        },
    }
}

/// Any of `predicates` (at least one); one as itself.
fn any_of(mut predicates: Vec<Predicate>) -> Predicate {
    match predicates.len() {
        1 => predicates.remove(0),
        _ => Predicate {
            match_type: Some(MatchType::OrMatcher(PredicateList { predicate: predicates })),
        },
    }
}

fn negate_if(predicate: Predicate, negated: bool) -> Predicate {
    match negated {
        false => predicate,
        true => Predicate {
            match_type: Some(MatchType::NotMatcher(Box::new(predicate))),
        },
    }
}

fn exact(value: &str) -> StringMatcher {
    string(string_matcher::MatchPattern::Exact(value.to_owned()))
}

fn prefix(value: &str) -> StringMatcher {
    string(string_matcher::MatchPattern::Prefix(value.to_owned()))
}

/// Envoy matches a safe regex against the whole value.
fn regex(regex: &str) -> StringMatcher {
    string(string_matcher::MatchPattern::SafeRegex(RegexMatcher {
        regex: regex.to_owned(),
        engine_type: Some(regex_matcher::EngineType::GoogleRe2(Default::default())),
    }))
}

fn escape(text: &str) -> String {
    regex_syntax::escape(text)
}

fn string(pattern: string_matcher::MatchPattern) -> StringMatcher {
    StringMatcher {
        match_pattern: Some(pattern),
        ..Default::default()
    }
}

fn typed<T: Message + Name>(name: &str, config: &T) -> TypedExtensionConfig {
    TypedExtensionConfig {
        name: name.to_owned(),
        typed_config: Some(Any {
            type_url: T::type_url(),
            value: config.encode_to_vec(),
        }),
    }
}
