//! The route hop: each verdict, from the routes attached to backend's port 8080 and the
//! request the CLI describes.

use aether_proto::registry::v1::{
    MatchType, PathMatch, Redirect, Route, RouteBackend, RouteFilter, RouteKind, RouteMatch, RouteParent, RouteRule,
    ValueMatch, route_filter,
};

use super::*;

fn prefix(value: &str) -> RouteMatch {
    RouteMatch {
        path: Some(PathMatch {
            r#type: MatchType::PathPrefix as i32,
            value: value.into(),
        }),
        ..Default::default()
    }
}

fn to(service: &str, weight: u32) -> RouteBackend {
    RouteBackend {
        service: service.into(),
        port: 0,
        weight,
        filters: Vec::new(),
    }
}

fn rule(name: &str, matches: Vec<RouteMatch>, backends: Vec<RouteBackend>) -> RouteRule {
    RouteRule {
        name: name.into(),
        matches,
        backends,
        ..Default::default()
    }
}

fn route(namespace: &str, name: &str, rules: Vec<RouteRule>) -> Route {
    Route {
        kind: RouteKind::Http as i32,
        namespace: namespace.into(),
        name: name.into(),
        parents: vec![RouteParent {
            service: "demo/backend".into(),
            port: 0,
        }],
        rules,
        ..Default::default()
    }
}

/// `/api` split 90/10 between backend and backend-v2 (rule 0, "api"), `x-version: v2`
/// pinned to backend-v2 (rule 1).
fn canary() -> Route {
    let pinned = RouteMatch {
        headers: vec![ValueMatch {
            name: "x-version".into(),
            r#type: MatchType::Exact as i32,
            value: "v2".into(),
        }],
        ..Default::default()
    };
    route(
        "demo",
        "canary",
        vec![
            rule(
                "api",
                vec![prefix("/api")],
                vec![to("demo/backend", 90), to("demo/backend-v2", 10)],
            ),
            rule("", vec![pinned], vec![to("demo/backend-v2", 1)]),
        ],
    )
}

/// `method path` with `headers`, as the CLI describes it.
type Call<'a> = (&'a str, &'a str, &'a [(&'a str, &'a str)]);

/// healthy() with `routes` on port 8080 (backend and backend-v2 in the catalog) and the
/// request, or no URL.
fn with_routes(routes: Vec<Route>, request: Option<Call>) -> Facts {
    let mut facts = healthy();
    facts.route = Some(RouteFacts {
        port: 8080,
        http: true,
        routes,
        skipped: Vec::new(),
        known_backends: ["demo/backend".into(), "demo/backend-v2".into()].into(),
    });
    facts.request = request.map(|(method, path, headers)| Request {
        method: method.into(),
        path: path.into(),
        headers: headers.iter().map(|(n, v)| ((*n).into(), (*v).into())).collect(),
    });
    facts
}

fn route_hop(facts: &Facts) -> Hop {
    explain(facts).hops.into_iter().find(|h| h.hop == "route").unwrap()
}

#[test]
fn a_url_takes_the_first_rule_in_precedence_and_names_its_backends() {
    let facts = with_routes(vec![canary()], Some(("GET", "/api/items?page=2", &[])));
    let e = explain(&facts);
    assert_eq!(e.verdict, Status::Ok, "{e:#?}");
    assert_eq!(
        e.hops[7].why,
        "GET /api/items?page=2 takes route http/demo/canary rule 0 (api): demo/backend:8080 (weight 90 of 100), \
         demo/backend-v2:8080 (weight 10 of 100)"
    );
    let pinned = with_routes(vec![canary()], Some(("GET", "/", &[("X-Version", "v2")])));
    assert_eq!(
        route_hop(&pinned).why,
        "GET / [X-Version: v2] takes route http/demo/canary rule 1: demo/backend-v2:8080"
    );
    // The JSON names the rule and its action.
    let json = serde_json::to_value(&e).unwrap();
    let matched = &json["route"]["matched"];
    assert_eq!(matched["route"], "http/demo/canary");
    assert_eq!(
        (matched["rule_index"].as_u64(), matched["rule_name"].as_str()),
        (Some(0), Some("api"))
    );
    assert_eq!(matched["action"]["kind"], "backends");
    assert_eq!(matched["action"]["backends"][1]["weight"], 10);
    assert_eq!(json["route"]["attached"][0], "http/demo/canary");
}

#[test]
fn a_more_specific_match_of_a_later_route_wins() {
    let exact = RouteMatch {
        path: Some(PathMatch {
            r#type: MatchType::Exact as i32,
            value: "/api/health".into(),
        }),
        ..Default::default()
    };
    let health = route(
        "demo",
        "health",
        vec![rule("", vec![exact], vec![to("demo/backend", 1)])],
    );
    let facts = with_routes(vec![canary(), health], Some(("GET", "/api/health", &[])));
    assert!(
        route_hop(&facts).why.contains("takes route http/demo/health rule 0"),
        "{:?}",
        route_hop(&facts)
    );
}

#[test]
fn no_matching_rule_is_a_404_and_stops_the_walk() {
    let facts = with_routes(vec![canary()], Some(("POST", "/other", &[])));
    let e = explain(&facts);
    let first = e.first.as_ref().unwrap();
    assert_eq!((first.hop, first.status), ("route", Status::Fail), "{e:#?}");
    assert_eq!(first.why, "404: no rule of http/demo/canary matches POST /other");
    assert!(first.fix.contains("PathPrefix /"), "{first:?}");
    assert!(e.hops[8..].iter().all(|h| h.status == Status::Skip));
    let json = serde_json::to_value(&e).unwrap();
    assert!(json["route"]["matched"].is_null());
}

#[test]
fn backends_missing_from_the_catalog_answer_500() {
    let ghost = route(
        "demo",
        "ghost",
        vec![rule("", vec![], vec![to("demo/ghost", 1), to("demo/backend", 0)])],
    );
    let e = explain(&with_routes(vec![ghost], Some(("GET", "/", &[]))));
    let first = e.first.unwrap();
    assert_eq!((first.hop, first.status), ("route", Status::Fail));
    assert!(
        first
            .why
            .ends_with("whose backend(s) demo/ghost:8080 are not in the mesh catalog: Envoy answers 500"),
        "{first:?}"
    );
    assert!(!first.fix.is_empty());

    let partly = route(
        "demo",
        "partly",
        vec![rule("", vec![], vec![to("demo/ghost", 1), to("demo/backend", 3)])],
    );
    let hop = route_hop(&with_routes(vec![partly], Some(("GET", "/", &[]))));
    assert_eq!(hop.status, Status::Warn);
    assert!(
        hop.why
            .contains("demo/ghost:8080 not in the mesh catalog: that share answers 500"),
        "{hop:?}"
    );
}

#[test]
fn a_rule_without_backends_answers_500() {
    let nowhere = route(
        "demo",
        "nowhere",
        vec![rule("void", vec![], vec![to("demo/backend", 0)])],
    );
    let hop = route_hop(&with_routes(vec![nowhere], Some(("GET", "/x", &[]))));
    assert_eq!(hop.status, Status::Fail);
    assert_eq!(
        hop.why,
        "GET /x takes route http/demo/nowhere rule 0 (void), which has no backend: Envoy answers 500"
    );
}

#[test]
fn a_redirect_calls_no_upstream() {
    let mut moved = rule("", vec![prefix("/old")], vec![]);
    moved.filters.push(RouteFilter {
        filter: Some(route_filter::Filter::RequestRedirect(Redirect {
            scheme: "https".into(),
            status_code: 301,
            ..Default::default()
        })),
    });
    let facts = with_routes(vec![route("demo", "moved", vec![moved])], Some(("GET", "/old/a", &[])));
    let e = explain(&facts);
    assert_eq!(e.verdict, Status::Ok, "{e:#?}");
    assert_eq!(
        e.hops[7].why,
        "GET /old/a takes route http/demo/moved rule 0: redirect 301 (scheme https)"
    );
    for h in &e.hops[8..10] {
        assert_eq!(h.status, Status::Skip, "{h:?}");
        assert!(h.why.contains("redirected"), "{h:?}");
    }
}

#[test]
fn a_service_without_url_lists_its_routes_and_judges_a_plain_get() {
    let hop = route_hop(&with_routes(vec![canary()], None));
    assert_eq!(hop.status, Status::Warn);
    assert!(
        hop.why
            .starts_with("404: no rule of http/demo/canary matches GET /; give a URL"),
        "{hop:?}"
    );
    let catch_all = route("demo", "all", vec![rule("", vec![], vec![to("demo/backend", 1)])]);
    let hop = route_hop(&with_routes(vec![canary(), catch_all], None));
    assert_eq!(hop.status, Status::Ok);
    assert_eq!(
        hop.why,
        "http/demo/canary, http/demo/all attached; a plain GET / takes route http/demo/all rule 0: demo/backend:8080"
    );
}

#[test]
fn a_consumer_route_is_named_as_such() {
    let mut facts = with_routes(
        vec![route(
            "demo",
            "pin",
            vec![rule("", vec![], vec![to("demo/backend", 1)])],
        )],
        None,
    );
    facts.target.as_mut().unwrap().service = "shop/backend".into();
    let hop = route_hop(&facts);
    assert!(hop.why.contains("a consumer route of the pod's namespace"), "{hop:?}");
}

#[test]
fn skipped_routes_non_http_ports_and_unserved_ports() {
    let mut facts = with_routes(vec![], Some(("GET", "/", &[])));
    let r = facts.route.as_mut().unwrap();
    r.skipped
        .push(("http/demo/bad".into(), "rules[0].matches[0].path.value: bad".into()));
    let hop = route_hop(&facts);
    assert_eq!(hop.status, Status::Warn);
    assert!(
        hop.why
            .starts_with("route http/demo/bad names demo/backend but the agent skips it"),
        "{hop:?}"
    );

    facts.route.as_mut().unwrap().http = false;
    let hop = route_hop(&facts);
    assert_eq!(
        (hop.status, hop.why.as_str()),
        (
            Status::Skip,
            "port 8080 is not HTTP and no TCP or TLS route shapes it: default routing"
        )
    );
    let mut split = route(
        "demo",
        "db-split",
        vec![rule("", Vec::new(), vec![to("demo/backend-v2", 1)])],
    );
    split.kind = aether_proto::registry::v1::RouteKind::Tls as i32;
    split.hostnames = vec!["db.example.com".into()];
    facts.route.as_mut().unwrap().routes = vec![split];
    let hop = route_hop(&facts);
    assert_eq!(
        (hop.status, hop.why.as_str()),
        (
            Status::Ok,
            "port 8080 is a TCP stream; tls/demo/db-split attached: connections chosen by the TLS server name, then split by weight"
        )
    );

    facts.route = None;
    target(&mut facts).loaded = false;
    assert!(route_hop(&facts).why.contains("not loaded yet"));
}
