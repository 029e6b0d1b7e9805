//! The real Envoy accepts what the compiler makes: a node's generated listeners,
//! clusters and route tables (every route feature, a consumer table) written into a
//! static bootstrap, each listener's RDS table inlined as RDS would deliver it, and
//! checked by `envoy --mode validate`. Fails when Envoy is missing.

use envoy_types::pb::envoy::config::bootstrap::v3::{Bootstrap, bootstrap};
use envoy_types::pb::envoy::config::cluster::v3::Cluster;
use envoy_types::pb::envoy::config::core::v3::{ApiConfigSource, GrpcService, Node, api_config_source, grpc_service};
use envoy_types::pb::envoy::config::listener::v3::{FilterChain, filter};
use envoy_types::pb::google::protobuf::BoolValue;

use super::*;
use crate::proxy::envoy::{EnvoyBinary, test_envoy_bin};
use crate::xds::resources::util::any;

/// Routes using every feature the compiler maps, on echo's HTTP and gRPC ports.
fn every_feature() -> Vec<Route> {
    let header_mod = |set: &str| HeaderModifier {
        set: vec![Header {
            name: set.into(),
            value: "1".into(),
        }],
        add: vec![Header {
            name: "x-added".into(),
            value: "2".into(),
        }],
        remove: vec!["x-removed".into()],
    };
    let mut canary = backend("gamma/echo-v2", 10);
    canary.filters = vec![filter(route_filter::Filter::RequestHeaderModifier(header_mod(
        "x-backend",
    )))];
    let matched = RouteMatch {
        path: Some(PathMatch {
            r#type: MatchType::Regex as i32,
            value: "/v[0-9]+/.*".into(),
        }),
        headers: vec![
            value("x-env", "canary"),
            ValueMatch {
                r#type: MatchType::Regex as i32,
                ..value("x-user", "a.*")
            },
        ],
        query_params: vec![ValueMatch {
            r#type: MatchType::Regex as i32,
            ..value("debug", "[01]")
        }],
        method: "GET".into(),
        ..Default::default()
    };
    let split = RouteRule {
        name: "split".into(),
        matches: vec![matched, path(MatchType::PathPrefix, "/split/")],
        filters: vec![
            filter(route_filter::Filter::RequestHeaderModifier(header_mod("x-rule"))),
            filter(route_filter::Filter::ResponseHeaderModifier(header_mod("x-resp"))),
            filter(route_filter::Filter::RequestMirror(Mirror {
                backend: Some(backend("gamma/echo-v1", 1)),
                percent: 42,
            })),
        ],
        backends: vec![backend("gamma/echo-v1", 90), canary, backend("gamma/nowhere", 5)],
        request_timeout_ms: 5000,
        backend_request_timeout_ms: 1500,
        retry: Some(RouteRetry {
            codes: vec![500, 503],
            attempts: 3,
            backoff_ms: 50,
        }),
    };
    let mut rules = vec![split, rule(vec![path(MatchType::Exact, "/none")], &[])];
    rules.extend(redirects());
    rules.extend(rewrites());
    let mut routes = vec![http_route("features", rules), grpc_route(), consumer_route()];
    routes.extend(connection_routes());
    routes
}

/// On db's TCP ports: a TCP split (one backend missing), and TLS routes by server name on
/// every port (so the TLS inspector is enabled on two ports).
fn connection_routes() -> Vec<Route> {
    let on_db = |kind: RouteKind, name: &str, port: u32, hostnames: &[&str], backends: &[(&str, u32)]| {
        let mut route = http_route(name, vec![rule(Vec::new(), backends)]);
        route.kind = kind as i32;
        route.parents[0] = RouteParent {
            service: "gamma/db".into(),
            port,
        };
        for backend in &mut route.rules[0].backends {
            backend.port = 5432;
        }
        route.hostnames = hostnames.iter().map(|h| (*h).to_owned()).collect();
        route
    };
    vec![
        on_db(
            RouteKind::Tcp,
            "db-split",
            5432,
            &[],
            &[("gamma/db", 9), ("gamma/nowhere", 1)],
        ),
        on_db(
            RouteKind::Tls,
            "db-sni",
            0,
            &["a.example.com", "*.b.example.com"],
            &[("gamma/db", 1)],
        ),
    ]
}

fn redirects() -> Vec<RouteRule> {
    let modifier = |m| Some(PathModifier { modifier: Some(m) });
    let redirects = [
        ("https", 0, 301, None),
        (
            "http",
            8080,
            302,
            modifier(path_modifier::Modifier::ReplaceFullPath("/full".into())),
        ),
        (
            "",
            0,
            303,
            modifier(path_modifier::Modifier::ReplacePrefixMatch("/new".into())),
        ),
        (
            "",
            443,
            307,
            modifier(path_modifier::Modifier::ReplacePrefixMatch(String::new())),
        ),
        ("https", 443, 308, None),
    ];
    redirects
        .into_iter()
        .enumerate()
        .map(|(i, (scheme, port, status_code, path_modifier))| RouteRule {
            matches: vec![path(MatchType::PathPrefix, &format!("/redirect/{i}"))],
            filters: vec![filter(route_filter::Filter::RequestRedirect(Redirect {
                scheme: scheme.into(),
                hostname: if i == 0 { String::new() } else { "moved.example".into() },
                path: path_modifier,
                port,
                status_code,
            }))],
            ..Default::default()
        })
        .collect()
}

fn rewrites() -> Vec<RouteRule> {
    let rewrite = |at: &str, hostname: &str, m| {
        let mut rule = rule(vec![path(MatchType::PathPrefix, at)], &[("gamma/echo-v1", 1)]);
        rule.filters = vec![filter(route_filter::Filter::UrlRewrite(UrlRewrite {
            hostname: hostname.into(),
            path: Some(PathModifier { modifier: Some(m) }),
        }))];
        rule
    };
    vec![
        rewrite(
            "/rw/prefix",
            "v1.example",
            path_modifier::Modifier::ReplacePrefixMatch("/x/".into()),
        ),
        rewrite("/rw/strip", "", path_modifier::Modifier::ReplacePrefixMatch("/".into())),
        rewrite(
            "/rw/full",
            "",
            path_modifier::Modifier::ReplaceFullPath("/full/path".into()),
        ),
        rewrite("/", "", path_modifier::Modifier::ReplacePrefixMatch("/root".into())),
    ]
}

fn grpc_route() -> Route {
    let method = |kind: MatchType, service: &str, method: &str| RouteMatch {
        grpc_method: Some(aether_proto::registry::v1::GrpcMethodMatch {
            r#type: kind as i32,
            service: service.into(),
            method: method.into(),
        }),
        headers: vec![value("x-grpc", "yes")],
        ..Default::default()
    };
    let matches = vec![
        method(MatchType::Exact, "pkg.Echo", "Say"),
        method(MatchType::Exact, "pkg.Echo", ""),
        method(MatchType::Exact, "", "Say"),
        method(MatchType::Regex, "pkg\\..*", "S.*"),
    ];
    let mut route = http_route(
        "grpc",
        vec![rule(matches, &[("gamma/echo-v1", 1), ("gamma/echo-v2", 1)])],
    );
    route.kind = RouteKind::Grpc as i32;
    route.parents[0].port = 9000;
    route
}

fn consumer_route() -> Route {
    let mut route = http_route("pin", vec![rule(Vec::new(), &[("gamma/echo-v2", 1)])]);
    route.namespace = "web".into();
    route
}

/// One callers-side HTTP filter of every kind on echo, and one on the `features` route:
/// Envoy must take each disabled in the HCMs and enabled in the tables.
fn callers_side_filters() -> BTreeMap<String, Arc<aether_proto::registry::v1::HttpFilter>> {
    use aether_proto::registry::v1::http_filter::Filter as Kind;
    use aether_proto::registry::v1::{
        AuthorizationAction, AuthorizationOperation, AuthorizationRule, ExtAuthz, ExtAuthzProtocol, HeaderToMetadata,
        HeaderToMetadataRule, HttpFilter, HttpFilterAttachment, LocalRateLimit, RbacFilter,
    };
    let kinds = [
        Kind::ExtAuthz(ExtAuthz {
            host: "authz.gamma.svc.cluster.local".into(),
            port: 9000,
            protocol: ExtAuthzProtocol::Grpc as i32,
            ..Default::default()
        }),
        Kind::ExtAuthz(ExtAuthz {
            host: "10.0.0.9".into(),
            port: 8000,
            protocol: ExtAuthzProtocol::Http as i32,
            path_prefix: "/check".into(),
            allowed_headers: vec!["x-user".into()],
            ..Default::default()
        }),
        Kind::LocalRateLimit(LocalRateLimit {
            max_tokens: 10,
            fill_interval_ms: 1000,
            ..Default::default()
        }),
        Kind::Rbac(RbacFilter {
            action: AuthorizationAction::Deny as i32,
            rules: vec![AuthorizationRule {
                to: vec![AuthorizationOperation {
                    methods: vec!["DELETE".into()],
                    ..Default::default()
                }],
                ..Default::default()
            }],
        }),
        Kind::HeaderToMetadata(HeaderToMetadata {
            rules: vec![HeaderToMetadataRule {
                header: "x-tenant".into(),
                key: "tenant".into(),
                ..Default::default()
            }],
        }),
    ];
    let filters = kinds.into_iter().enumerate().map(|(i, kind)| {
        let on_route = matches!(kind, Kind::HeaderToMetadata(_));
        HttpFilter {
            namespace: "gamma".into(),
            name: format!("f{i}"),
            services: vec!["gamma/echo".into()],
            attach: if on_route {
                HttpFilterAttachment::Route
            } else {
                HttpFilterAttachment::Callers
            } as i32,
            route: if on_route {
                "http/gamma/features".into()
            } else {
                String::new()
            },
            filter: Some(kind),
            ..Default::default()
        }
    });
    filters
        .map(|f| (aether_proto::view::http_filter_key(&f), Arc::new(f)))
        .collect()
}

/// A static bootstrap holding the node's resources, RDS tables inlined (each changed by
/// `edit` first).
fn bootstrap(generated: &Generated, edit: impl Fn(&mut RouteConfiguration)) -> Bootstrap {
    let tables: BTreeMap<String, RouteConfiguration> = served_tables(generated)
        .into_iter()
        .map(|(name, mut table)| {
            // As over RDS (the default there): clusters may arrive after the table.
            table.validate_clusters = Some(BoolValue { value: false });
            edit(&mut table);
            (name, table)
        })
        .collect();
    let mut listeners = Vec::new();
    for resource in &generated[crate::xds::LISTENER] {
        let mut listener = Listener::decode(&*resource.body.value).unwrap();
        for chain in listener
            .filter_chains
            .iter_mut()
            .chain(listener.default_filter_chain.as_mut())
        {
            inline_routes(chain, &tables);
        }
        listeners.push(listener);
    }
    let mut clusters: Vec<Cluster> = generated[crate::xds::CLUSTER]
        .iter()
        .map(|r| Cluster::decode(&*r.body.value).unwrap())
        .collect();
    clusters.push(Cluster {
        name: crate::access_log::AGENT_CLUSTER.into(),
        connect_timeout: crate::xds::resources::util::millis(1000),
        load_assignment: None,
        ..Default::default()
    });
    Bootstrap {
        node: Some(Node {
            id: "validate".into(),
            cluster: "validate".into(),
            ..Default::default()
        }),
        static_resources: Some(bootstrap::StaticResources {
            listeners,
            clusters,
            ..Default::default()
        }),
        dynamic_resources: Some(bootstrap::DynamicResources {
            ads_config: Some(ApiConfigSource {
                api_type: api_config_source::ApiType::Grpc as i32,
                transport_api_version: envoy_types::pb::envoy::config::core::v3::ApiVersion::V3 as i32,
                grpc_services: vec![GrpcService {
                    target_specifier: Some(grpc_service::TargetSpecifier::EnvoyGrpc(grpc_service::EnvoyGrpc {
                        cluster_name: crate::access_log::AGENT_CLUSTER.into(),
                        ..Default::default()
                    })),
                    ..Default::default()
                }],
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn inline_routes(chain: &mut FilterChain, tables: &BTreeMap<String, RouteConfiguration>) {
    for network_filter in &mut chain.filters {
        let Some(filter::ConfigType::TypedConfig(config)) = &mut network_filter.config_type else {
            continue;
        };
        if !config.type_url.ends_with("HttpConnectionManager") {
            continue;
        }
        let mut hcm = HttpConnectionManager::decode(&*config.value).unwrap();
        if let Some(http_connection_manager::RouteSpecifier::Rds(rds)) = &hcm.route_specifier {
            let table = tables[&rds.route_config_name].clone();
            hcm.route_specifier = Some(http_connection_manager::RouteSpecifier::RouteConfig(table));
            *config = any(&hcm);
        }
    }
}

#[tokio::test]
async fn envoy_accepts_the_compiled_routes_of_every_feature() {
    let envoy = EnvoyBinary::new(test_envoy_bin());
    let mut pods = [pod("web", "client"), pod("gamma", "server")];
    pods[1]
        .info
        .annotations
        .insert("config.aether.io/upstreams".into(), "gamma/echo,gamma/db".into());
    let mut catalog = catalog(every_feature());
    // db serves a second TCP port.
    let db = catalog.endpoints.get_mut("gamma/db").unwrap();
    let mut endpoints = (**db).clone();
    for endpoint in endpoints.values_mut() {
        let mut second = endpoint.ports[0].clone();
        second.port = 5433;
        endpoint.ports.push(second);
    }
    *db = Arc::new(endpoints);
    // ClusterIPs (v4 and v6) and Kubernetes names in the tables, ClusterIPs in the TCP chains.
    for key in ["gamma/echo-v1", "gamma/db"] {
        catalog.services.get_mut(key).unwrap().kubernetes = Some(aether_proto::registry::v1::KubernetesService {
            cluster_ips: vec![format!("10.96.0.{}", key.len()), format!("fd00::{}", key.len())],
            traffic_distribution: 0,
            ports: Vec::new(),
        });
    }
    catalog.http_filters = callers_side_filters();
    let generated = generated(&catalog, &pods);
    let tables: Vec<&str> = generated[crate::xds::ROUTE].iter().map(|r| r.name.as_str()).collect();
    assert_eq!(tables, ["outbound", "outbound~web"]);
    let routes = served_tables(&generated)
        .values()
        .map(|t| vhost(t, "echo.gamma.aether.internal:80").routes.len())
        .collect::<Vec<_>>();
    // Every rule compiled (the https redirect once per authority with a port), and 404.
    assert_eq!(routes, [15, 2]);
    // The server's TLS inspector is limited to db's two ports, which route by server name.
    let outbound = generated[crate::xds::LISTENER]
        .iter()
        .find(|r| r.name == "outbound|gamma/server")
        .map(|r| Listener::decode(&*r.body.value).unwrap())
        .unwrap();
    let inspector = format!("{:?}", outbound.listener_filters[1].filter_disabled);
    assert!(
        inspector.contains("OrMatch") && inspector.contains("start: 5433"),
        "{inspector}"
    );
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bootstrap.pb");
    std::fs::write(&path, bootstrap(&generated, |_| {}).encode_to_vec()).unwrap();
    envoy
        .validate(&path)
        .await
        .unwrap_or_else(|e| panic!("Envoy refuses the compiled routes: {e}"));

    // The check is real: a regex RE2 cannot compile is refused.
    let poisoned = bootstrap(&generated, |table| {
        let routes = &mut table.virtual_hosts[0].routes;
        routes[0].r#match.as_mut().unwrap().path_specifier = Some(
            envoy_types::pb::envoy::config::route::v3::route_match::PathSpecifier::SafeRegex(
                super::super::matching::regex_matcher("(unclosed"),
            ),
        );
    });
    std::fs::write(&path, poisoned.encode_to_vec()).unwrap();
    let refused = envoy.validate(&path).await.unwrap_err().to_string();
    assert!(refused.contains("unclosed"), "{refused}");
}
