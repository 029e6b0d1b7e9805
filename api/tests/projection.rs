//! The fixtures (our own restatement of the Gateway API's mesh routes) parse and project
//! to what route.proto says they mean; every projection passes `validate`.

use aether_api::gateway::HttpRoute;
use aether_api::{RouteObject, backend_services, parse_documents, project, unresolved_backends, validate};
use aether_proto::registry::v1::path_modifier::Modifier;
use aether_proto::registry::v1::route_filter::Filter;
use aether_proto::registry::v1::{MatchType, Route, RouteKind, RouteParent};

const FIXTURES: &str = include_str!("fixtures/mesh-routes.yaml");

fn fixtures() -> Vec<(String, Option<Route>)> {
    parse_documents(FIXTURES)
        .into_iter()
        .map(|object| {
            let object = object.expect("every fixture parses");
            let projected = project(&object).unwrap_or_else(|e| panic!("{}: {e}", object.key()));
            (object.key(), projected)
        })
        .collect()
}

fn route(name: &str) -> Route {
    let (_, route) = fixtures()
        .into_iter()
        .find(|(key, _)| key.ends_with(&format!("/{name}")))
        .expect(name);
    route.expect("a mesh route")
}

fn filter(route: &Route, rule: usize, index: usize) -> Filter {
    route.rules[rule].filters[index].filter.clone().expect("a filter")
}

#[test]
fn every_fixture_parses_projects_and_validates() {
    let all = fixtures();
    let keys: Vec<&str> = all.iter().map(|(key, _)| key.as_str()).collect();
    // The Service document is skipped; the Gateway-parented route is not the mesh's.
    assert_eq!(keys.len(), 10, "{keys:?}");
    assert_eq!(all.iter().filter(|(_, route)| route.is_none()).count(), 1);
    assert!(keys.contains(&"http/shop/storefront") && keys.contains(&"grpc/shop/pricing"));
    assert!(keys.contains(&"tcp/shop/sessions-split") && keys.contains(&"tls/shop/payments-by-sni"));
    for (key, route) in all.iter().filter_map(|(k, r)| Some((k, r.as_ref()?))) {
        validate(route).unwrap_or_else(|e| panic!("{key}: {e}"));
        assert_eq!(&aether_proto::view::route_key(route), key);
    }
}

#[test]
fn a_weighted_split_names_its_parent_and_backends() {
    let route = route("cart-canary");
    assert_eq!(
        (route.kind(), route.namespace.as_str(), route.generation),
        (RouteKind::Http, "shop", 3)
    );
    assert_eq!(
        route.parents,
        vec![RouteParent {
            service: "shop/cart".into(),
            port: 80
        }]
    );
    let backends: Vec<_> = route.rules[0]
        .backends
        .iter()
        .map(|b| (b.service.as_str(), b.port, b.weight))
        .collect();
    assert_eq!(backends, vec![("shop/cart-v1", 8080, 90), ("shop/cart-v2", 8080, 10)]);
    assert!(route.rules[0].matches.is_empty(), "no match: every request");
}

#[test]
fn matches_are_normalised() {
    let route = route("cart-matching");
    let rule = &route.rules[0];
    assert_eq!(rule.name, "pinned-to-v2");
    assert_eq!(route.parents[0].port, 0, "no port: every port of the service");
    let path = rule.matches[0].path.as_ref().unwrap();
    assert_eq!(
        (path.r#type(), path.value.as_str()),
        (MatchType::PathPrefix, "/api"),
        "trailing '/' dropped"
    );
    assert_eq!(rule.matches[0].headers[0].name, "x-version", "header names lower-cased");
    assert_eq!(
        rule.matches[1].query_params[0].name, "Flavour",
        "query names as written"
    );
    assert_eq!(rule.matches[1].method, "POST");
    assert_eq!(rule.matches[2].path.as_ref().unwrap().r#type(), MatchType::Regex);
    assert_eq!(rule.matches[3].headers[0].r#type(), MatchType::Regex);
}

#[test]
fn redirects_carry_scheme_host_port_path_and_status() {
    let route = route("cart-redirects");
    let redirect = |rule| match filter(&route, rule, 0) {
        Filter::RequestRedirect(r) => r,
        other => panic!("{other:?}"),
    };
    let prefix = redirect(0);
    assert_eq!(prefix.status_code, 301);
    assert_eq!(
        prefix.path.unwrap().modifier,
        Some(Modifier::ReplacePrefixMatch("/new".into()))
    );
    let secure = redirect(1);
    assert_eq!(
        (
            secure.scheme.as_str(),
            secure.hostname.as_str(),
            secure.port,
            secure.status_code
        ),
        ("https", "shop.example.org", 8443, 308)
    );
    assert_eq!(
        redirect(2).path.unwrap().modifier,
        Some(Modifier::ReplaceFullPath("/elsewhere".into()))
    );
    assert_eq!(redirect(3).status_code, 307);
    assert_eq!(redirect(4).status_code, 302, "unset: 302");
    assert!(route.rules.iter().all(|r| r.backends.is_empty()));
}

#[test]
fn rewrites_and_header_modifiers_on_rules_and_backends() {
    let route = route("cart-rewrites");
    let Filter::UrlRewrite(rewrite) = filter(&route, 0, 0) else {
        panic!()
    };
    assert_eq!(rewrite.hostname, "cart.internal");
    assert_eq!(
        rewrite.path.unwrap().modifier,
        Some(Modifier::ReplacePrefixMatch("/".into()))
    );
    let Filter::RequestHeaderModifier(request) = filter(&route, 0, 1) else {
        panic!()
    };
    assert_eq!(
        (request.set[0].name.as_str(), request.add[0].name.as_str()),
        ("x-set", "x-add")
    );
    assert_eq!(request.remove, vec!["x-drop"]);
    let Filter::ResponseHeaderModifier(response) = filter(&route, 0, 2) else {
        panic!()
    };
    assert_eq!(response.set[0].value, "cart");
    let backend_filter = route.rules[0].backends[0].filters[0].filter.clone();
    let Some(Filter::RequestHeaderModifier(per_backend)) = backend_filter else {
        panic!()
    };
    assert_eq!(per_backend.add[0].name, "x-backend");
}

#[test]
fn timeouts_retries_and_mirrors() {
    let route = route("cart-resilience");
    let rule = &route.rules[0];
    assert_eq!(
        (rule.request_timeout_ms, rule.backend_request_timeout_ms),
        (10_000, 2_500)
    );
    let retry = rule.retry.as_ref().unwrap();
    assert_eq!(
        (retry.codes.clone(), retry.attempts, retry.backoff_ms),
        (vec![503, 502], 3, 100)
    );
    let Filter::RequestMirror(mirror) = filter(&route, 0, 0) else {
        panic!()
    };
    assert_eq!(mirror.percent, 33, "1/3 rounded");
    assert_eq!(
        mirror.backend.unwrap().service,
        "qa/cart-shadow",
        "cross-namespace allowed"
    );
    let services: Vec<&str> = backend_services(&route).collect();
    assert_eq!(services, vec!["shop/cart-v1", "qa/cart-shadow"]);
    let known = |s: &str| s != "qa/cart-shadow";
    let missing = unresolved_backends(&route, known).unwrap_err();
    assert_eq!(
        (missing.reason, missing.field.as_str()),
        ("BackendNotFound", "spec.rules[0].backendRefs")
    );
    assert!(missing.message.contains("qa/cart-shadow"), "{missing}");
    assert_eq!(unresolved_backends(&route, |_| true), Ok(()));
}

#[test]
fn a_consumer_route_keeps_its_namespace_and_names_the_producer_parent() {
    let route = route("cart-from-checkout");
    assert_eq!(route.namespace, "checkout");
    assert_eq!(route.parents[0].service, "shop/cart");
    assert_eq!(route.rules[0].backends[0].service, "shop/cart-v1");
}

#[test]
fn grpc_routes_match_methods_and_keep_zero_weights() {
    let route = route("pricing");
    assert_eq!(route.kind(), RouteKind::Grpc);
    let method = route.rules[0].matches[0].grpc_method.as_ref().unwrap();
    assert_eq!(
        (method.r#type(), method.service.as_str(), method.method.as_str()),
        (MatchType::Exact, "shop.Pricing", "Quote")
    );
    assert_eq!(route.rules[0].matches[0].headers[0].name, "x-tenant");
    assert_eq!(
        route.rules[0].matches[1].grpc_method.as_ref().unwrap().r#type(),
        MatchType::Regex
    );
    let weights: Vec<u32> = route.rules[0].backends.iter().map(|b| b.weight).collect();
    assert_eq!(weights, vec![70, 30, 0]);
}

#[test]
fn a_route_without_rules_gets_the_api_default_rule() {
    let mut object = HttpRoute::default();
    object.metadata.name = Some("bare".into());
    object.spec.parent_refs = serde_json::from_str(r#"[{"group": "", "kind": "Service", "name": "cart"}]"#).unwrap();
    let route = project(&RouteObject::Http(object)).unwrap().unwrap();
    assert_eq!(route.namespace, "default", "no namespace: default");
    assert_eq!(route.rules.len(), 1);
    assert!(route.rules[0].matches.is_empty() && route.rules[0].backends.is_empty());
    validate(&route).unwrap();
}

#[test]
fn the_typed_objects_round_trip_through_json() {
    for object in parse_documents(FIXTURES).into_iter().map(Result::unwrap) {
        let again = match &object {
            RouteObject::Http(r) => {
                RouteObject::Http(serde_json::from_value(serde_json::to_value(r).unwrap()).unwrap())
            }
            RouteObject::Grpc(r) => {
                RouteObject::Grpc(serde_json::from_value(serde_json::to_value(r).unwrap()).unwrap())
            }
            RouteObject::Tcp(r) => RouteObject::Tcp(serde_json::from_value(serde_json::to_value(r).unwrap()).unwrap()),
            RouteObject::Tls(r) => RouteObject::Tls(serde_json::from_value(serde_json::to_value(r).unwrap()).unwrap()),
        };
        assert_eq!(again, object);
    }
}

#[test]
fn the_kube_resource_names_the_gateway_api() {
    use kube_core::Resource;
    assert_eq!(HttpRoute::api_version(&()), "gateway.networking.k8s.io/v1");
    assert_eq!(
        (HttpRoute::kind(&()), HttpRoute::plural(&())),
        ("HTTPRoute".into(), "httproutes".into())
    );
    let grpc = (
        aether_api::gateway::GrpcRoute::kind(&()),
        aether_api::gateway::GrpcRoute::plural(&()),
    );
    assert_eq!(grpc, ("GRPCRoute".into(), "grpcroutes".into()));
    assert_eq!(
        HttpRoute::url_path(&(), Some("shop")),
        "/apis/gateway.networking.k8s.io/v1/namespaces/shop/httproutes"
    );
    assert_eq!(
        aether_api::gateway::TcpRoute::url_path(&(), Some("shop")),
        "/apis/gateway.networking.k8s.io/v1alpha2/namespaces/shop/tcproutes"
    );
}
