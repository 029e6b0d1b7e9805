//! Precedence as Gateway API defines it, path normalization, and the first match a
//! request takes.

use aether_proto::registry::v1::{PathMatch, RouteRule, ValueMatch};

use super::*;

fn path(kind: MatchType, value: &str) -> RouteMatch {
    RouteMatch {
        path: Some(PathMatch {
            r#type: kind as i32,
            value: value.into(),
        }),
        ..Default::default()
    }
}

fn header(name: &str, value: &str) -> ValueMatch {
    ValueMatch {
        name: name.into(),
        r#type: MatchType::Exact as i32,
        value: value.into(),
    }
}

fn route(name: &str, created: i64, rules: Vec<Vec<RouteMatch>>) -> Route {
    Route {
        kind: RouteKind::Http as i32,
        namespace: "demo".into(),
        name: name.into(),
        created_unix_seconds: created,
        rules: rules
            .into_iter()
            .map(|matches| RouteRule {
                matches,
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    }
}

fn grpc(kind: MatchType, service: &str, method: &str) -> PathSpec {
    let matched = RouteMatch {
        grpc_method: Some(GrpcMethodMatch {
            r#type: kind as i32,
            service: service.into(),
            method: method.into(),
        }),
        ..Default::default()
    };
    PathSpec::of(RouteKind::Grpc, Some(&matched))
}

/// `<route>/<rule>/<match>` of each entry, in order.
fn order(routes: &[&Route]) -> Vec<String> {
    ordered_matches(routes)
        .iter()
        .map(|m| {
            let matched = m.match_index.map_or("-".into(), |i| i.to_string());
            format!("{}/{}/{matched}", m.route.name, m.rule_index)
        })
        .collect()
}

#[test]
fn paths_are_normalized_as_gateway_api_defines_them() {
    let http = |kind, value| PathSpec::of(RouteKind::Http, Some(&path(kind, value)));
    assert_eq!(http(MatchType::PathPrefix, "/foo/"), PathSpec::Prefix("/foo".into()));
    assert_eq!(http(MatchType::PathPrefix, "/"), PathSpec::Prefix("/".into()));
    assert_eq!(http(MatchType::Exact, "/foo/"), PathSpec::Exact("/foo/".into()));
    assert_eq!(http(MatchType::Regex, "/v[0-9]+"), PathSpec::Regex("/v[0-9]+".into()));
    assert_eq!(PathSpec::of(RouteKind::Http, None), PathSpec::Prefix("/".into()));
    assert_eq!(
        PathSpec::of(RouteKind::Http, Some(&RouteMatch::default())),
        PathSpec::Prefix("/".into())
    );
}

#[test]
fn grpc_methods_become_paths() {
    assert_eq!(
        grpc(MatchType::Exact, "pkg.Echo", "Say"),
        PathSpec::Exact("/pkg.Echo/Say".into())
    );
    assert_eq!(
        grpc(MatchType::Exact, "pkg.Echo", ""),
        PathSpec::Prefix("/pkg.Echo".into())
    );
    assert_eq!(
        grpc(MatchType::Exact, "", "Say.It"),
        PathSpec::Regex("/[^/]+/Say\\.It".into())
    );
    assert_eq!(grpc(MatchType::Exact, "", ""), PathSpec::Prefix("/".into()));
    assert_eq!(
        grpc(MatchType::Regex, "pkg\\..*", ""),
        PathSpec::Regex("/pkg\\..*/[^/]+".into())
    );
}

#[test]
fn literals_are_escaped_for_re2() {
    assert_eq!(escape("a.b*c(d)"), "a\\.b\\*c\\(d\\)");
    assert_eq!(escape("plain"), "plain");
}

#[test]
fn exact_then_regex_then_longer_prefixes_then_method_headers_queries() {
    let with_method = RouteMatch {
        method: "POST".into(),
        ..Default::default()
    };
    let with_headers = RouteMatch {
        headers: vec![header("a", "1"), header("b", "2")],
        ..Default::default()
    };
    let one_header = RouteMatch {
        headers: vec![header("a", "1")],
        ..Default::default()
    };
    let r = route(
        "r",
        0,
        vec![
            vec![],
            vec![one_header, with_headers, with_method],
            vec![path(MatchType::PathPrefix, "/a"), path(MatchType::PathPrefix, "/a/b")],
            vec![path(MatchType::Regex, "/x.*"), path(MatchType::Exact, "/a")],
        ],
    );
    assert_eq!(
        order(&[&r]),
        ["r/3/1", "r/3/0", "r/2/1", "r/2/0", "r/1/2", "r/1/1", "r/1/0", "r/0/-"]
    );
}

#[test]
fn ties_go_to_the_older_route_then_by_name_then_rule_order() {
    let young = route("a-young", 200, vec![vec![], vec![]]);
    let old = route("z-old", 100, vec![vec![]]);
    let twin = route("b-twin", 200, vec![vec![]]);
    assert_eq!(
        order(&[&young, &twin, &old]),
        ["z-old/0/-", "a-young/0/-", "a-young/1/-", "b-twin/0/-"]
    );
}

#[test]
fn the_first_entry_that_accepts_a_request_is_the_rule_taken() {
    let canary = RouteMatch {
        headers: vec![header("x-env", "canary")],
        ..Default::default()
    };
    let r = route(
        "r",
        0,
        vec![
            vec![path(MatchType::PathPrefix, "/")],
            vec![canary, path(MatchType::PathPrefix, "/beta")],
            vec![path(MatchType::Exact, "/beta/exact")],
        ],
    );
    let ordered = ordered_matches(&[&r]);
    let taken = |request: &Request| first_match(&ordered, request).map(|m| (m.rule_index, m.rule_label()));
    assert_eq!(taken(&Request::get("/")), Some((0, "0".into())));
    assert_eq!(taken(&Request::get("/beta/x?y=1")), Some((1, "1".into())));
    assert_eq!(taken(&Request::get("/betamax")), Some((0, "0".into())));
    assert_eq!(taken(&Request::get("/beta/exact")), Some((2, "2".into())));
    let mut pinned = Request::get("/");
    pinned.headers.push(("X-Env".into(), "canary".into()));
    assert_eq!(taken(&pinned), Some((1, "1".into())));

    let only_beta = route("b", 0, vec![vec![path(MatchType::PathPrefix, "/beta")]]);
    let ordered = ordered_matches(&[&only_beta]);
    assert!(first_match(&ordered, &Request::get("/")).is_none());
}
