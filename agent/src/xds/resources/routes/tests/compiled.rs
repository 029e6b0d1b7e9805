use envoy_types::pb::envoy::config::core::v3::header_value_option::HeaderAppendAction;
use envoy_types::pb::envoy::config::route::v3::{Route as EnvoyRoute, redirect_action, route_match};

use super::super::{direct, retries};
use super::*;

fn names_of(routes: &[EnvoyRoute]) -> Vec<&str> {
    names(routes)
}

#[test]
fn without_routes_the_tables_are_what_they_were() {
    let pods = [pod("web", "client")];
    let tables = tables(Vec::new(), &pods);
    assert_eq!(tables.keys().collect::<Vec<_>>(), ["outbound"]);
    let outbound = &tables["outbound"];
    // The one difference: the first route must not change the table (and re-send its hosts).
    assert!(outbound.most_specific_header_mutations_wins);
    let echo = vhost(outbound, "echo.gamma.aether.internal:80");
    let default = EnvoyRoute {
        r#match: Some(super::super::prefix_match("/")),
        action: Some(route::Action::Route(RouteAction {
            cluster_specifier: Some(route_action::ClusterSpecifier::Cluster(
                "echo.gamma.aether.internal:80".into(),
            )),
            // The built-in request timeout (Envoy's own default, written out) and retries.
            timeout: crate::xds::resources::util::millis(15_000),
            retry_policy: Some(retries()),
            ..Default::default()
        })),
        ..Default::default()
    };
    assert_eq!(echo.routes, [default]);
    assert_eq!(
        echo.domains,
        [
            "echo.gamma.aether.internal:80",
            "240.240.0.1:80",
            "echo.gamma.aether.internal",
            "240.240.0.1"
        ]
    );
    assert_eq!(vhost(outbound, "mesh-on-demand").routes.len(), 2);
    assert_eq!(rds_name(&pods[0]), "outbound");
}

/// The RDS name of the pod's outbound listener.
fn rds_name(pod: &LocalPod) -> String {
    rds_names(&[], std::slice::from_ref(pod))[&pod.id()].clone()
}

/// The RDS name of each pod's explicit (18081) chain, which its captured default chain
/// shares.
fn rds_names(routes: &[Route], pods: &[LocalPod]) -> BTreeMap<String, String> {
    let generated = generated(&catalog(routes.to_vec()), pods);
    generated[crate::xds::LISTENER]
        .iter()
        .filter(|r| r.name.starts_with("outbound|"))
        .map(|r| {
            let listener = Listener::decode(&*r.body.value).unwrap();
            let explicit = listener.filter_chains.last().unwrap();
            let table = super::rds_of(explicit);
            let captured = super::rds_of(listener.default_filter_chain.as_ref().unwrap());
            assert_eq!(captured, table);
            (r.name.trim_start_matches("outbound|").to_owned(), table)
        })
        .collect()
}

#[test]
fn rules_are_ordered_by_gateway_api_precedence() {
    let prefix = |p: &str| path(MatchType::PathPrefix, p);
    let with = |mut m: RouteMatch, f: &dyn Fn(&mut RouteMatch)| {
        f(&mut m);
        m
    };
    let v1 = &[("gamma/echo-v1", 1)];
    let b = http_route(
        "b",
        vec![
            rule(vec![prefix("/")], v1),
            rule(vec![prefix("/api")], v1),
            rule(vec![prefix("/api/v1/")], v1),
            rule(vec![path(MatchType::Exact, "/api")], v1),
            rule(vec![path(MatchType::Regex, "/api/[0-9]+")], v1),
            rule(vec![with(prefix("/api"), &|m| m.method = "GET".into())], v1),
            rule(
                vec![with(prefix("/api"), &|m| {
                    m.headers = vec![value("a", "1"), value("b", "2")]
                })],
                v1,
            ),
            rule(vec![with(prefix("/api"), &|m| m.headers = vec![value("a", "1")])], v1),
            rule(
                vec![with(prefix("/api"), &|m| m.query_params = vec![value("q", "1")])],
                v1,
            ),
        ],
    );
    // Ties on the match: the older route first, then by name.
    let mut a = http_route("a", vec![rule(vec![prefix("/api/v1")], v1)]);
    a.created_unix_seconds += 10;
    let c = http_route("c", vec![rule(vec![prefix("/api/v1")], v1)]);
    let routes = echo_routes(vec![a, b, c]);
    assert_eq!(
        names_of(&routes),
        [
            "http/gamma/b/3",
            "http/gamma/b/4",
            "http/gamma/b/2",
            "http/gamma/c/0",
            "http/gamma/a/0",
            "http/gamma/b/5",
            "http/gamma/b/6",
            "http/gamma/b/7",
            "http/gamma/b/8",
            "http/gamma/b/1",
            "http/gamma/b/0",
            "",
        ]
    );
    // Segment-aware prefixes, and what no rule matches is a 404.
    assert_eq!(
        routes[2].r#match.as_ref().unwrap().path_specifier,
        Some(route_match::PathSpecifier::PathSeparatedPrefix("/api/v1".into()))
    );
    assert_eq!(
        routes.last().unwrap(),
        &direct(404, "no route rule matches this request\n")
    );
}

#[test]
fn each_match_of_a_rule_is_ranked_on_its_own() {
    let v1 = &[("gamma/echo-v1", 1)];
    let either = rule(
        vec![path(MatchType::PathPrefix, "/a"), path(MatchType::Exact, "/b")],
        v1,
    );
    let other = rule(vec![path(MatchType::PathPrefix, "/aa")], v1);
    let routes = echo_routes(vec![http_route("r", vec![either, other])]);
    assert_eq!(
        names_of(&routes),
        ["http/gamma/r/0", "http/gamma/r/1", "http/gamma/r/0", ""]
    );
}

#[test]
fn backends_are_weighted_clusters_and_a_missing_one_answers_500() {
    let mut pinned = backend("gamma/echo-v2", 1);
    pinned.port = 9000;
    let mut split = rule(
        Vec::new(),
        &[("gamma/echo-v1", 90), ("gamma/nowhere", 10), ("gamma/echo-v2", 0)],
    );
    split.backends.push(pinned);
    let single = rule(vec![path(MatchType::Exact, "/one")], &[("gamma/echo-v2", 5)]);
    let zero = rule(vec![path(MatchType::Exact, "/zero")], &[("gamma/echo-v2", 0)]);
    let none = rule(vec![path(MatchType::Exact, "/none")], &[]);
    let routes = echo_routes(vec![http_route("r", vec![split, single, zero, none])]);
    // Exact paths, longer first, then the catch-all split.
    let [zero, none, one, split, _not_found] = routes.as_slice() else {
        panic!("{routes:?}")
    };
    assert_eq!(
        forward(one),
        &route_action::ClusterSpecifier::Cluster("echo-v2.gamma.aether.internal:80".into())
    );
    let route_action::ClusterSpecifier::WeightedClusters(weighted) = forward(split) else {
        panic!("{split:?}")
    };
    let shares: Vec<(&str, u32)> = weighted
        .clusters
        .iter()
        .map(|c| (c.name.as_str(), c.weight.unwrap().value))
        .collect();
    assert_eq!(
        shares,
        [
            ("echo-v1.gamma.aether.internal:80", 90),
            ("nowhere.gamma.aether.internal:80", 10),
            ("echo-v2.gamma.aether.internal:9000", 1),
        ]
    );
    assert_eq!(
        route_action_of(split).cluster_not_found_response_code,
        route_action::ClusterNotFoundResponseCode::InternalServerError as i32
    );
    for no_backend in [zero, none] {
        assert_eq!(
            no_backend.action,
            Some(super::super::direct_action(500, "this route rule has no backend\n"))
        );
    }
}

#[test]
fn a_route_on_every_port_sends_each_port_to_the_same_port_and_tcp_stays_l4() {
    let mut route = http_route("r", vec![rule(Vec::new(), &[("gamma/echo-v1", 1)])]);
    route.parents.push(RouteParent {
        service: "gamma/db".into(),
        port: 0,
    });
    let tables = tables(vec![route], &[]);
    let grpc = &vhost(&tables["outbound"], "echo.gamma.aether.internal:9000").routes;
    assert_eq!(
        forward(&grpc[0]),
        &route_action::ClusterSpecifier::Cluster("echo-v1.gamma.aether.internal:9000".into())
    );
    let db = &vhost(&tables["outbound"], "db.gamma.aether.internal:5432").routes;
    assert_eq!(
        forward(&db[0]),
        &route_action::ClusterSpecifier::Cluster("db.gamma.aether.internal:5432".into())
    );
    assert_eq!(db.len(), 1);
}

fn modifier(set: &[(&str, &str)], add: &[(&str, &str)], remove: &[&str]) -> HeaderModifier {
    let headers = |h: &[(&str, &str)]| {
        h.iter()
            .map(|(name, value)| Header {
                name: (*name).into(),
                value: (*value).into(),
            })
            .collect()
    };
    HeaderModifier {
        set: headers(set),
        add: headers(add),
        remove: remove.iter().map(|r| (*r).into()).collect(),
    }
}

#[test]
fn header_modifiers_apply_per_rule_and_per_backend() {
    let mut v2 = backend("gamma/echo-v2", 1);
    v2.filters = vec![filter(route_filter::Filter::RequestHeaderModifier(modifier(
        &[("x-backend", "v2")],
        &[],
        &["x-drop"],
    )))];
    let mut rule = rule(Vec::new(), &[("gamma/echo-v1", 1)]);
    rule.backends.push(v2);
    rule.filters = vec![
        filter(route_filter::Filter::RequestHeaderModifier(modifier(
            &[("x-set", "1")],
            &[("x-add", "2")],
            &["x-gone"],
        ))),
        filter(route_filter::Filter::ResponseHeaderModifier(modifier(
            &[("x-resp", "3")],
            &[],
            &["server"],
        ))),
    ];
    let tables = tables(vec![http_route("r", vec![rule])], &[]);
    assert!(tables["outbound"].most_specific_header_mutations_wins);
    let routes = &vhost(&tables["outbound"], "echo.gamma.aether.internal:80").routes;
    let edits =
        |options: &[envoy_types::pb::envoy::config::core::v3::HeaderValueOption]| -> Vec<(String, String, i32)> {
            options
                .iter()
                .map(|o| {
                    let h = o.header.as_ref().unwrap();
                    (h.key.clone(), h.value.clone(), o.append_action)
                })
                .collect()
        };
    let overwrite = HeaderAppendAction::OverwriteIfExistsOrAdd as i32;
    let append = HeaderAppendAction::AppendIfExistsOrAdd as i32;
    assert_eq!(
        edits(&routes[0].request_headers_to_add),
        [
            ("x-set".into(), "1".into(), overwrite),
            ("x-add".into(), "2".into(), append)
        ]
    );
    assert_eq!(routes[0].request_headers_to_remove, ["x-gone"]);
    assert_eq!(
        edits(&routes[0].response_headers_to_add),
        [("x-resp".into(), "3".into(), overwrite)]
    );
    assert_eq!(routes[0].response_headers_to_remove, ["server"]);
    let route_action::ClusterSpecifier::WeightedClusters(weighted) = forward(&routes[0]) else {
        panic!()
    };
    assert!(weighted.clusters[0].request_headers_to_add.is_empty());
    assert_eq!(
        edits(&weighted.clusters[1].request_headers_to_add),
        [("x-backend".into(), "v2".into(), overwrite)]
    );
    assert_eq!(weighted.clusters[1].request_headers_to_remove, ["x-drop"]);
}

fn redirect_rule(at: &str, redirect: Redirect) -> RouteRule {
    RouteRule {
        matches: vec![path(MatchType::PathPrefix, at)],
        filters: vec![filter(route_filter::Filter::RequestRedirect(redirect))],
        ..Default::default()
    }
}

fn redirect_of(route: &EnvoyRoute) -> &envoy_types::pb::envoy::config::route::v3::RedirectAction {
    match &route.action {
        Some(route::Action::Redirect(redirect)) => redirect,
        other => panic!("not a redirect: {other:?}"),
    }
}

#[test]
fn redirect_status_codes_map_to_envoys_and_303_exists() {
    use redirect_action::RedirectResponseCode as Code;
    let cases = [
        (0, Code::Found),
        (301, Code::MovedPermanently),
        (302, Code::Found),
        (303, Code::SeeOther),
        (307, Code::TemporaryRedirect),
        (308, Code::PermanentRedirect),
    ];
    for (status_code, expected) in cases {
        let redirect = Redirect {
            hostname: "elsewhere.example".into(),
            status_code,
            ..Default::default()
        };
        let routes = echo_routes(vec![http_route("r", vec![redirect_rule("/", redirect)])]);
        assert_eq!(redirect_of(&routes[0]).response_code, expected as i32, "{status_code}");
        assert_eq!(redirect_of(&routes[0]).host_redirect, "elsewhere.example");
    }
}

/// The authority a route matches exactly, if it matches one.
fn exact_authority(route: &EnvoyRoute) -> Option<&str> {
    use envoy_types::pb::envoy::config::route::v3::header_matcher::HeaderMatchSpecifier;
    use envoy_types::pb::envoy::r#type::matcher::v3::string_matcher::MatchPattern;
    let header = route
        .r#match
        .as_ref()?
        .headers
        .iter()
        .find(|h| h.name == ":authority")?;
    match &header.header_match_specifier {
        Some(HeaderMatchSpecifier::StringMatch(m)) => match &m.match_pattern {
            Some(MatchPattern::Exact(value)) => Some(value),
            _ => None,
        },
        _ => None,
    }
}

#[test]
fn redirect_ports_follow_gateway_api() {
    let https = Redirect {
        scheme: "https".into(),
        ..Default::default()
    };
    let other_port = Redirect {
        port: 8443,
        ..Default::default()
    };
    let full = Redirect {
        path: Some(PathModifier {
            modifier: Some(path_modifier::Modifier::ReplaceFullPath("/new".into())),
        }),
        ..Default::default()
    };
    let prefix = Redirect {
        path: Some(PathModifier {
            modifier: Some(path_modifier::Modifier::ReplacePrefixMatch("/v2".into())),
        }),
        ..Default::default()
    };
    let rules = vec![
        redirect_rule("/https", https),
        redirect_rule("/other-port", other_port),
        redirect_rule("/full", full),
        redirect_rule("/prefix", prefix),
    ];
    let routes = echo_routes(vec![http_route("r", rules)]);
    let rule = |n: usize| -> Vec<&EnvoyRoute> {
        routes
            .iter()
            .filter(|r| r.name == format!("http/gamma/r/{n}"))
            .collect()
    };
    // https without a port: port 443, left out of the Location, so each authority with
    // a port redirects to its host alone; an authority without one keeps its host.
    let https: Vec<(Option<&str>, String, u32)> = rule(0)
        .into_iter()
        .map(|r| {
            let redirect = redirect_of(r);
            assert_eq!(
                redirect.scheme_rewrite_specifier,
                Some(redirect_action::SchemeRewriteSpecifier::SchemeRedirect("https".into()))
            );
            let exact = exact_authority(r);
            (exact, redirect.host_redirect.clone(), redirect.port_redirect)
        })
        .collect();
    assert_eq!(
        https,
        [
            (
                Some("echo.gamma.aether.internal:80"),
                "echo.gamma.aether.internal".into(),
                0
            ),
            (Some("240.240.0.1:80"), "240.240.0.1".into(), 0),
            (None, String::new(), 0),
        ]
    );
    assert_eq!(redirect_of(rule(1)[0]).port_redirect, 8443);
    assert_eq!(
        redirect_of(rule(2)[0]).path_rewrite_specifier,
        Some(redirect_action::PathRewriteSpecifier::PathRedirect("/new".into()))
    );
    assert_eq!(
        redirect_of(rule(3)[0]).path_rewrite_specifier,
        Some(redirect_action::PathRewriteSpecifier::PrefixRewrite("/v2".into()))
    );
}

#[test]
fn url_rewrites_set_the_host_and_the_path() {
    let rewrite = |hostname: &str, modifier: path_modifier::Modifier| UrlRewrite {
        hostname: hostname.into(),
        path: Some(PathModifier {
            modifier: Some(modifier),
        }),
    };
    let mut prefix = rule(vec![path(MatchType::PathPrefix, "/old")], &[("gamma/echo-v1", 1)]);
    prefix.filters = vec![filter(route_filter::Filter::UrlRewrite(rewrite(
        "v1.example",
        path_modifier::Modifier::ReplacePrefixMatch("/new".into()),
    )))];
    let mut full = rule(vec![path(MatchType::Exact, "/x")], &[("gamma/echo-v1", 1)]);
    full.filters = vec![filter(route_filter::Filter::UrlRewrite(rewrite(
        "",
        path_modifier::Modifier::ReplaceFullPath("/y".into()),
    )))];
    let routes = echo_routes(vec![http_route("r", vec![prefix, full])]);
    let full = route_action_of(&routes[0]);
    assert_eq!(full.host_rewrite_specifier, None);
    assert_eq!(
        full.regex_rewrite,
        Some(super::super::rewrite::PathRewrite::regex("^.*$", "/y"))
    );
    let prefix = route_action_of(&routes[1]);
    assert_eq!(
        prefix.host_rewrite_specifier,
        Some(route_action::HostRewriteSpecifier::HostRewriteLiteral(
            "v1.example".into()
        ))
    );
    assert_eq!(prefix.prefix_rewrite, "/new");
}

#[test]
fn mirrors_send_a_share_of_requests_to_another_service() {
    let mirror = |percent| {
        filter(route_filter::Filter::RequestMirror(Mirror {
            backend: Some(backend("gamma/echo-v2", 1)),
            percent,
        }))
    };
    let mut rule = rule(Vec::new(), &[("gamma/echo-v1", 1)]);
    rule.filters = vec![mirror(100), mirror(25)];
    let routes = echo_routes(vec![http_route("r", vec![rule])]);
    let mirrors = &route_action_of(&routes[0]).request_mirror_policies;
    assert_eq!(mirrors.len(), 2);
    assert_eq!(mirrors[0].cluster, "echo-v2.gamma.aether.internal:80");
    assert_eq!(mirrors[0].runtime_fraction, None);
    let fraction = mirrors[1].runtime_fraction.as_ref().unwrap().default_value.unwrap();
    assert_eq!((fraction.numerator, fraction.denominator), (25, 0));
}

#[test]
fn named_rules_name_their_routes_and_stats() {
    let mut named = rule(vec![path(MatchType::Exact, "/named")], &[("gamma/echo-v1", 1)]);
    named.name = "canary".into();
    let unnamed = rule(Vec::new(), &[("gamma/echo-v1", 1)]);
    let routes = echo_routes(vec![http_route("r", vec![named, unnamed])]);
    assert_eq!(routes[0].name, "http/gamma/r/canary");
    assert_eq!(routes[0].stat_prefix, "gamma.r.canary");
    assert_eq!(routes[1].name, "http/gamma/r/1");
    assert_eq!(routes[1].stat_prefix, "");
}

fn timed(request_ms: u64, backend_ms: u64, retry: Option<RouteRetry>) -> RouteAction {
    let mut rule = rule(Vec::new(), &[("gamma/echo-v1", 1)]);
    rule.request_timeout_ms = request_ms;
    rule.backend_request_timeout_ms = backend_ms;
    rule.retry = retry;
    let routes = echo_routes(vec![http_route("r", vec![rule])]);
    route_action_of(&routes[0]).clone()
}

#[test]
fn timeouts_bound_the_request_and_each_attempt() {
    let ms = crate::xds::resources::util::millis;
    let request = timed(3000, 0, None);
    assert_eq!(request.timeout, ms(3000));
    assert_eq!(request.retry_policy, Some(retries()), "unset: the mesh's retries");
    let backend = timed(0, 500, None);
    assert_eq!(
        backend.timeout,
        ms(500),
        "GEP-1742: backend alone bounds the request too"
    );
    assert_eq!(backend.retry_policy.as_ref().unwrap().per_try_timeout, ms(500));
    let both = timed(3000, 500, None);
    assert_eq!(both.timeout, ms(3000));
    assert_eq!(both.retry_policy.unwrap().per_try_timeout, ms(500));
    assert_eq!(timed(0, 0, None).timeout, ms(15_000), "the mesh's default");
}

/// The parent service's namespace's MeshConfig sets what a rule leaves unset: its
/// request timeout (0: none) and its retries (0: none); a rule's own still win.
#[test]
fn the_destination_namespace_mesh_config_sets_the_defaults() {
    use aether_proto::registry::v1::{MeshConfig, Resilience};
    let ms = crate::xds::resources::util::millis;
    let mut timed_rule = rule(Vec::new(), &[("gamma/echo-v1", 1)]);
    timed_rule.request_timeout_ms = 3000;
    let plain_rule = rule(Vec::new(), &[("gamma/echo-v2", 1)]);
    let with_mesh = |attempts: u32, timeout_ms: u32, routes: Vec<Route>| {
        let mut catalog = catalog(routes);
        let config = MeshConfig {
            namespace: "gamma".into(),
            name: "default".into(),
            resilience: Some(Resilience {
                retry_attempts: Some(attempts),
                request_timeout_ms: Some(timeout_ms),
                ..Default::default()
            }),
            ..Default::default()
        };
        catalog
            .mesh_configs
            .insert("gamma/default".into(), std::sync::Arc::new(config));
        let generated = generated(&catalog, &[]);
        let tables = served_tables(&generated);
        vhost(&tables["outbound"], "echo.gamma.aether.internal:80")
            .routes
            .clone()
    };
    let plain = with_mesh(0, 0, Vec::new());
    let action = route_action_of(&plain[0]);
    assert_eq!((action.timeout, action.retry_policy.clone()), (ms(0), None));
    let routed = with_mesh(5, 2000, vec![http_route("r", vec![timed_rule, plain_rule])]);
    let (own, unset) = (route_action_of(&routed[0]), route_action_of(&routed[1]));
    assert_eq!(own.timeout, ms(3000), "the rule's own");
    assert_eq!(unset.timeout, ms(2000), "the namespace's");
    assert_eq!(unset.retry_policy.as_ref().unwrap().num_retries.unwrap().value, 5);
}

#[test]
fn mesh_retries_leave_the_priority_that_failed() {
    use envoy_types::pb::envoy::config::route::v3::retry_policy::retry_priority::ConfigType;
    use envoy_types::pb::envoy::extensions::retry::priority::previous_priorities::v3::PreviousPrioritiesConfig;
    let priority = retries().retry_priority.unwrap();
    assert_eq!(priority.name, "envoy.retry_priorities.previous_priorities");
    let Some(ConfigType::TypedConfig(config)) = priority.config_type else {
        panic!("no config")
    };
    let config = PreviousPrioritiesConfig::decode(&*config.value).unwrap();
    assert_eq!(config.update_frequency, 1, "the first retry already leaves");
    // A port without routes and a rule without its own retries use the mesh's.
    let plain = route_action_of(&echo_routes(Vec::new())[0]).retry_policy.clone();
    assert_eq!(plain, Some(retries()));
    assert_eq!(timed(0, 0, None).retry_policy, Some(retries()));
}

#[test]
fn retries_follow_gep_1731_and_zero_attempts_turn_them_off() {
    let retry = RouteRetry {
        codes: vec![503, 502],
        attempts: 3,
        backoff_ms: 100,
    };
    let policy = timed(0, 0, Some(retry)).retry_policy.unwrap();
    assert_eq!(
        policy.retry_on,
        "retriable-status-codes,connect-failure,refused-stream,reset"
    );
    assert_eq!(policy.retriable_status_codes, [503, 502]);
    assert_eq!(policy.num_retries.unwrap().value, 3);
    let backoff = policy.retry_back_off.unwrap();
    let ms = crate::xds::resources::util::millis;
    assert_eq!((backoff.base_interval, backoff.max_interval), (ms(100), ms(1000)));
    assert_eq!(
        policy.retry_host_predicate,
        retries().retry_host_predicate,
        "on another host"
    );
    assert_eq!(policy.retry_priority, retries().retry_priority, "at another priority");

    let resets_only = RouteRetry {
        attempts: 2,
        ..Default::default()
    };
    let policy = timed(0, 0, Some(resets_only)).retry_policy.unwrap();
    assert_eq!(policy.retry_on, "connect-failure,refused-stream,reset");
    assert_eq!(policy.retry_back_off, None, "Envoy's default backoff");

    let off = RouteRetry::default();
    assert_eq!(timed(0, 0, Some(off.clone())).retry_policy, None);
    let per_try_only = timed(0, 200, Some(off)).retry_policy.unwrap();
    assert_eq!(per_try_only.num_retries.unwrap().value, 0);
    assert_eq!(per_try_only.per_try_timeout, ms(200));
}

#[test]
fn grpc_routes_match_service_method_and_headers() {
    let matched = RouteMatch {
        grpc_method: Some(aether_proto::registry::v1::GrpcMethodMatch {
            r#type: MatchType::Exact as i32,
            service: "pkg.Echo".into(),
            method: "Say".into(),
        }),
        headers: vec![value("x-env", "canary")],
        ..Default::default()
    };
    let mut route = http_route("g", vec![rule(vec![matched], &[("gamma/echo-v2", 1)])]);
    route.kind = RouteKind::Grpc as i32;
    route.parents[0].port = 9000;
    let tables = tables(vec![route], &[]);
    let outbound = &tables["outbound"];
    let grpc = &vhost(outbound, "echo.gamma.aether.internal:9000").routes;
    assert_eq!(grpc[0].name, "grpc/gamma/g/0");
    let m = grpc[0].r#match.as_ref().unwrap();
    assert_eq!(
        m.path_specifier,
        Some(route_match::PathSpecifier::Path("/pkg.Echo/Say".into()))
    );
    assert_eq!(m.headers[0].name, "x-env");
    assert_eq!(
        forward(&grpc[0]),
        &route_action::ClusterSpecifier::Cluster("echo-v2.gamma.aether.internal:9000".into())
    );
    // Attached to port 9000 only: port 80 keeps its default route.
    assert_eq!(vhost(outbound, "echo.gamma.aether.internal:80").routes.len(), 1);
}

#[test]
fn consumer_routes_get_a_table_per_namespace_with_callers_here() {
    let producer = http_route("canary", vec![rule(Vec::new(), &[("gamma/echo-v1", 1)])]);
    let mut consumer = http_route("pin", vec![rule(Vec::new(), &[("gamma/echo-v2", 1)])]);
    consumer.namespace = "web".into();
    let mut elsewhere = consumer.clone();
    elsewhere.namespace = "batch".into();
    let routes = vec![producer, consumer, elsewhere];
    let pods = [pod("web", "a"), pod("web", "b"), pod("gamma", "c"), pod("other", "d")];
    let tables = tables(routes.clone(), &pods);
    // "batch" has no pods on this node: no table for it.
    assert_eq!(tables.keys().collect::<Vec<_>>(), ["outbound", "outbound~web"]);
    let target = |table: &str| forward(&vhost(&tables[table], "echo.gamma.aether.internal:80").routes[0]).clone();
    let cluster = |c: &str| route_action::ClusterSpecifier::Cluster(c.into());
    assert_eq!(target("outbound"), cluster("echo-v1.gamma.aether.internal:80"));
    assert_eq!(target("outbound~web"), cluster("echo-v2.gamma.aether.internal:80"));
    // Other services are the same in both tables (but for their names).
    let unnamed = |table: &str| VirtualHost {
        name: String::new(),
        ..vhost(&tables[table], "echo-v1.gamma.aether.internal:80").clone()
    };
    assert_eq!(unnamed("outbound"), unnamed("outbound~web"));
    let rds = rds_names(&routes, &pods);
    let expected = [
        ("gamma/c", "outbound"),
        ("other/d", "outbound"),
        ("web/a", "outbound~web"),
        ("web/b", "outbound~web"),
    ];
    let expected: BTreeMap<String, String> = expected.iter().map(|(p, t)| ((*p).into(), (*t).into())).collect();
    assert_eq!(rds, expected);
}

#[test]
fn an_invalid_route_is_skipped_and_counted() {
    let mut bad = rule(Vec::new(), &[("gamma/echo-v1", 1)]);
    bad.filters = vec![filter(route_filter::Filter::RequestHeaderModifier(modifier(
        &[("host", "x")],
        &[],
        &[],
    )))];
    let good = http_route(
        "good",
        vec![rule(vec![path(MatchType::Exact, "/good")], &[("gamma/echo-v2", 1)])],
    );
    let catalog = catalog(vec![http_route("bad", vec![bad]), good]);
    let mut generator = crate::xds::resources::Generator::default();
    let locality = Locality::default();
    let on_demand = BTreeMap::new();
    let generated = generator.generate(&Inputs {
        pods: &[],
        catalog: &catalog,
        mesh_domain: DOMAIN,
        locality: &locality,
        on_demand: &on_demand,
        own_only: &Default::default(),
    });
    assert_eq!(generator.invalid_routes(), 1);
    let table = &served_tables(&generated)["outbound"];
    let routes = &vhost(table, "echo.gamma.aether.internal:80").routes;
    assert_eq!(names_of(routes), ["http/gamma/good/0", ""]);
}
