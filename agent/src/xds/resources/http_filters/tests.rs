//! HTTP filters where the generator puts them (inbound chains, callers' HCMs, enabled per
//! service in the route table, ext_authz clusters), and on a real Envoy: ext_authz with a
//! gRPC authorization server of our own (allow, deny, server down → the failure mode),
//! an rbac filter, and a local rate limit. The Envoy tests fail when Envoy is missing.

use std::net::SocketAddr;
use std::time::Duration;

use aether_fakes::ext_authz::{DENIED_BODY, ExtAuthzServer};
use aether_proto::registry::v1::{ExtAuthz, ExtAuthzProtocol, HeaderToMetadataRule};
use aether_proto::view::CatalogView;
use envoy_types::pb::envoy::config::bootstrap::v3::{Bootstrap, bootstrap};
use envoy_types::pb::envoy::config::cluster::v3::Cluster;
use envoy_types::pb::envoy::config::listener::v3::{Listener, filter};
use envoy_types::pb::envoy::config::route::v3::RouteConfiguration;
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::HttpConnectionManager;
use prost::Message;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::*;
use crate::pod::{ContainerPort, PodInfo};
use crate::xds::resources::authorization::tests::data_path::{
    cart_apps, envoy, loopback_clusters, loopback_listener, node,
};
use crate::xds::resources::authorization::tests::{cart, generate};
use crate::xds::resources::{Generated, Generator, routes};

fn filter(name: &str, service: &str, attach: HttpFilterAttachment, order: i32, kind: Kind) -> Arc<HttpFilter> {
    let (namespace, _) = service.split_once('/').unwrap();
    Arc::new(HttpFilter {
        namespace: namespace.into(),
        name: name.into(),
        generation: 1,
        services: vec![service.into()],
        attach: attach as i32,
        order,
        filter: Some(kind),
        ..Default::default()
    })
}

fn ext_authz(port: u16, fail_open: bool) -> Kind {
    Kind::ExtAuthz(ExtAuthz {
        host: "127.0.0.1".into(),
        port: port.into(),
        protocol: ExtAuthzProtocol::Grpc as i32,
        timeout_ms: 500,
        fail_open,
        ..Default::default()
    })
}

fn with_filters(mut catalog: CatalogView, filters: &[Arc<HttpFilter>]) -> CatalogView {
    catalog.http_filters = filters.iter().map(|f| (http_filter_key(f), f.clone())).collect();
    catalog
}

/// `gamma/echo-1`, an endpoint of gamma/echo serving HTTP on 80.
fn echo_pod() -> LocalPod {
    LocalPod {
        container_id: "c-echo".into(),
        listener_sockets: Default::default(),
        netns: "/run/aether/netns/echo".into(),
        ips: vec!["10.2.0.9".parse().unwrap()],
        info: PodInfo {
            namespace: "gamma".into(),
            name: "echo-1".into(),
            service_account: "echo".into(),
            ports: vec![ContainerPort {
                name: "http".into(),
                port: 80,
                protocol: "TCP".into(),
            }],
            ..Default::default()
        },
    }
}

fn hcm_filters(generated: &Generated, listener: &str, chain: usize) -> Vec<(String, bool)> {
    let resource = generated[crate::xds::LISTENER]
        .iter()
        .find(|r| r.name == listener)
        .unwrap();
    let listener = Listener::decode(&*resource.body.value).unwrap();
    let chain = match chain {
        usize::MAX => listener.default_filter_chain.unwrap(),
        i => listener.filter_chains[i].clone(),
    };
    let hcm = chain
        .filters
        .iter()
        .find(|f| f.name == "envoy.filters.network.http_connection_manager")
        .unwrap();
    let Some(filter::ConfigType::TypedConfig(any)) = &hcm.config_type else {
        panic!("untyped HCM")
    };
    let hcm = HttpConnectionManager::decode(&*any.value).unwrap();
    hcm.http_filters.into_iter().map(|f| (f.name, f.disabled)).collect()
}

/// echo-1's inbound chain: authorization, then its filters by order (disabled there),
/// each enabled by the pod's inbound route table.
fn inbound_in_order_enabled_by_the_table(generated: &Generated) {
    let inbound = hcm_filters(generated, "inbound|gamma/echo-1", 0);
    let names: Vec<&str> = inbound.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        [
            "aether.authz.audit.0",
            "aether.authz.deny",
            "aether.authz.allow",
            "aether.filter.gamma/tag",
            "aether.filter.gamma/check",
            "envoy.filters.http.router"
        ]
    );
    // Disabled in the HCM, enabled by the pod's inbound route table (RDS).
    let ours = inbound.iter().filter(|(n, _)| n.starts_with("aether.filter."));
    assert!(
        ours.clone().count() == 2 && ours.clone().all(|(_, disabled)| *disabled),
        "{inbound:?}"
    );
    let table = generated[crate::xds::ROUTE]
        .iter()
        .find(|r| r.name == "inbound|gamma/echo-1")
        .unwrap();
    let table = RouteConfiguration::decode(&*table.body.value).unwrap();
    let mut enabled: Vec<&String> = table
        .typed_per_filter_config
        .keys()
        .filter(|k| k.starts_with("aether.filter."))
        .collect();
    enabled.sort();
    assert_eq!(enabled, ["aether.filter.gamma/check", "aether.filter.gamma/tag"]);
}

#[test]
fn each_filter_is_where_it_attaches_in_order_and_callers_ones_are_enabled_per_service() {
    let tenant = Kind::HeaderToMetadata(HeaderToMetadata {
        rules: vec![HeaderToMetadataRule {
            header: "x-tenant".into(),
            key: "tenant".into(),
            ..Default::default()
        }],
    });
    let limit = Kind::LocalRateLimit(LocalRateLimit {
        max_tokens: 10,
        fill_interval_ms: 1000,
        ..Default::default()
    });
    let filters = [
        filter(
            "check",
            "gamma/echo",
            HttpFilterAttachment::Inbound,
            10,
            ext_authz(9, false),
        ),
        filter("tag", "gamma/echo", HttpFilterAttachment::Inbound, -5, tenant.clone()),
        filter("limit", "gamma/echo", HttpFilterAttachment::Callers, 0, limit),
        // Not a dependency of this node: nowhere.
        filter("other", "gamma/absent", HttpFilterAttachment::Callers, 0, tenant),
    ];
    let catalog = with_filters(routes::tests::catalog(Vec::new()), &filters);
    let web = routes::tests::pod("gamma", "web");
    let generated = routes::tests::generated(&catalog, &[web, echo_pod()]);

    inbound_in_order_enabled_by_the_table(&generated);

    let outbound = hcm_filters(&generated, "outbound|gamma/web", usize::MAX);
    let callers: Vec<&(String, bool)> = outbound
        .iter()
        .filter(|(n, _)| n.starts_with("aether.filter."))
        .collect();
    assert_eq!(
        callers,
        [&("aether.filter.gamma/limit".to_owned(), true)],
        "{outbound:?}"
    );

    let tables = crate::xds::resources::routes::tests::served_tables(&generated);
    let enabled_on = |vhost: &str| -> Vec<String> {
        let vhost = crate::xds::resources::routes::tests::vhost(&tables["outbound"], vhost);
        vhost.typed_per_filter_config.keys().cloned().collect()
    };
    assert_eq!(
        enabled_on("echo.gamma.aether.internal:80"),
        ["aether.filter.gamma/limit"]
    );
    assert!(enabled_on("echo.gamma.aether.internal:9000").len() == 1);

    let clusters: Vec<&str> = generated[crate::xds::CLUSTER].iter().map(|r| r.name.as_str()).collect();
    assert!(clusters.contains(&"ext_authz|127.0.0.1:9|grpc"), "{clusters:?}");
}

#[test]
fn an_rbac_filter_naming_ports_is_skipped_not_compiled_into_a_rule_that_cannot_match() {
    let rules = vec![aether_proto::registry::v1::AuthorizationRule {
        to: vec![aether_proto::registry::v1::AuthorizationOperation {
            ports: vec![80],
            ..Default::default()
        }],
        ..Default::default()
    }];
    let rbac = Kind::Rbac(RbacFilter {
        action: AuthorizationAction::Deny as i32,
        rules,
    });
    let filters = [filter("ports", "gamma/echo", HttpFilterAttachment::Inbound, 0, rbac)];
    let catalog = with_filters(routes::tests::catalog(Vec::new()), &filters);
    let generated = routes::tests::generated(&catalog, &[echo_pod()]);
    let inbound = hcm_filters(&generated, "inbound|gamma/echo-1", 0);
    assert!(
        inbound.iter().all(|(n, _)| !n.starts_with("aether.filter.")),
        "{inbound:?}"
    );
}

/// cart-1 with `filters` behind a real Envoy on 127.0.0.1:`listen`, the ext_authz cluster included.
async fn cart_envoy(filters: &[Arc<HttpFilter>], dir: &std::path::Path) -> (SocketAddr, tokio::process::Child) {
    let pod = cart();
    let apps = cart_apps().await;
    let listen = TcpListener::bind("127.0.0.1:0").await.unwrap().local_addr().unwrap();
    let generated = generate(
        &mut Generator::default(),
        &with_filters(CatalogView::default(), filters),
        std::slice::from_ref(&pod),
    );
    let mut clusters = loopback_clusters(&generated, &apps);
    let authz = generated[crate::xds::CLUSTER]
        .iter()
        .filter(|r| r.name.starts_with("ext_authz|"));
    clusters.extend(authz.map(|r| Cluster::decode(&*r.body.value).unwrap()));
    let bootstrap = Bootstrap {
        static_resources: Some(bootstrap::StaticResources {
            listeners: vec![loopback_listener(&generated, &pod, listen.port())],
            clusters,
            ..Default::default()
        }),
        ..node()
    };
    (listen, envoy(&bootstrap, &[], dir, listen).await)
}

/// One GET / to cart's HTTP port with `headers`: the status and the body's start.
async fn get(listen: SocketAddr, headers: &str) -> (u16, String) {
    get_path(listen, "/", headers).await
}

/// One GET `path` to cart's HTTP port with `headers`: the status and the body's start.
async fn get_path(listen: SocketAddr, path: &str, headers: &str) -> (u16, String) {
    let mut stream = TcpStream::connect(listen).await.unwrap();
    let request =
        format!("GET {path} HTTP/1.1\r\nhost: cart\r\nx-aether-port: 8080\r\n{headers}connection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut reply = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut reply)).await;
    read.expect("an answer within 5 s").unwrap();
    let reply = String::from_utf8_lossy(&reply).into_owned();
    let status = reply.get(9..12).and_then(|s| s.parse().ok()).unwrap_or(0);
    let body = reply
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (status, body)
}

#[tokio::test]
async fn ext_authz_allows_denies_and_applies_its_failure_mode_when_the_server_is_down() {
    let server = ExtAuthzServer::start().await;
    let port = server.addr.port();
    let dir = tempfile::tempdir().unwrap();
    let closed = [filter(
        "check",
        "shop/cart",
        HttpFilterAttachment::Inbound,
        0,
        ext_authz(port, false),
    )];
    let (listen, _envoy) = cart_envoy(&closed, dir.path()).await;
    let allowed = get(listen, "x-allow: yes\r\n").await;
    assert_eq!(allowed.0, 200, "{allowed:?}, {} checks", server.checks());
    let (status, body) = get(listen, "").await;
    assert_eq!((status, body.as_str()), (403, DENIED_BODY));
    assert_eq!(server.checks(), 2, "each request checked once");

    drop(server);

    // Down (nothing listens on its port): fail closed refuses with 403, fail open lets
    // the request through.
    let dead = TcpListener::bind("127.0.0.1:0")
        .await
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    for (fail_open, status) in [(false, 403), (true, 200)] {
        let dir = tempfile::tempdir().unwrap();
        let down = [filter(
            "check",
            "shop/cart",
            HttpFilterAttachment::Inbound,
            0,
            ext_authz(dead, fail_open),
        )];
        let (listen, _envoy) = cart_envoy(&down, dir.path()).await;
        assert_eq!(
            get(listen, "x-allow: yes\r\n").await.0,
            status,
            "fail open: {fail_open}"
        );
    }
}

#[tokio::test]
async fn an_inbound_rbac_filter_denies_what_its_rules_match_and_nothing_else() {
    let rules = vec![aether_proto::registry::v1::AuthorizationRule {
        to: vec![aether_proto::registry::v1::AuthorizationOperation {
            paths: vec![aether_api::authorization::check::pattern("/admin/*").unwrap()],
            ..Default::default()
        }],
        ..Default::default()
    }];
    let rbac = Kind::Rbac(RbacFilter {
        action: AuthorizationAction::Deny as i32,
        rules,
    });
    let dir = tempfile::tempdir().unwrap();
    let filters = [filter("no-admin", "shop/cart", HttpFilterAttachment::Inbound, 0, rbac)];
    let (listen, _envoy) = cart_envoy(&filters, dir.path()).await;
    let mut statuses = Vec::new();
    for path in ["/", "/admin/users?x=1", "/administer"] {
        statuses.push(get_path(listen, path, "").await.0);
    }
    assert_eq!(statuses, [200, 403, 200]);
}

#[tokio::test]
async fn a_local_rate_limit_answers_429_past_its_bucket() {
    let limit = Kind::LocalRateLimit(LocalRateLimit {
        max_tokens: 2,
        fill_interval_ms: 60_000,
        ..Default::default()
    });
    let dir = tempfile::tempdir().unwrap();
    let filters = [filter("limit", "shop/cart", HttpFilterAttachment::Inbound, 0, limit)];
    let (listen, _envoy) = cart_envoy(&filters, dir.path()).await;
    let mut statuses = Vec::new();
    for _ in 0..3 {
        statuses.push(get(listen, "").await.0);
    }
    assert_eq!(statuses, [200, 200, 429]);
}
