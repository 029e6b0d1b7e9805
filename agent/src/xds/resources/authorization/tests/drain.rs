//! A policy change on a live Envoy, from watched files here (over ADS it is the same
//! update). TCP: the pod's inbound listener is replaced (a filter-chain-only update); new
//! connections get the new rules at once, and a long-lived connection the new rules deny
//! is closed when Envoy's drain time (`--drain-time-s`) has passed. HTTP: only the pod's
//! inbound route table changes, and the next request on an open connection gets the new
//! rules. Fails without Envoy.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use aether_api::authorization::{AuthzRequest, Verdict};
use envoy_types::pb::envoy::config::bootstrap::v3::{Bootstrap, bootstrap};
use envoy_types::pb::envoy::config::core::v3::{
    ApiVersion, ConfigSource, PathConfigSource, WatchedDirectory, config_source,
};
use envoy_types::pb::envoy::config::listener::v3::filter;
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::{
    HttpConnectionManager, http_connection_manager,
};
use envoy_types::pb::envoy::service::discovery::v3::DiscoveryResponse;
use envoy_types::pb::google::protobuf::Any;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpSocket, TcpStream};

use super::data_path::{call, cart_apps, envoy, loopback_clusters, loopback_listener, node};
use super::*;
use crate::xds::resources::util::any;

const DENY_PEER: &str = "apiVersion: security.aether.io/v1alpha1
kind: AuthorizationPolicy
metadata: {name: not-from-2, namespace: shop}
spec:
  action: DENY
  rules: [{from: [{source: {ipBlocks: [127.0.0.2/32]}}]}]
";

/// Serves `listener` as the only LDS resource, replacing the file atomically.
fn serve(dir: &std::path::Path, listener: Listener, version: &str) {
    serve_file(dir, "lds.pb", any(&listener), version);
}

/// Serves `resource` as the only resource of `file`, replacing it atomically.
fn serve_file(dir: &std::path::Path, file: &str, resource: Any, version: &str) {
    let response = DiscoveryResponse {
        version_info: version.into(),
        type_url: resource.type_url.clone(),
        resources: vec![resource],
        ..Default::default()
    };
    let staged = dir.join(format!("{file}.new"));
    std::fs::write(&staged, response.encode_to_vec()).unwrap();
    std::fs::rename(staged, dir.join(file)).unwrap();
}

/// A watched file as an xDS source.
fn file_source(dir: &std::path::Path, file: &str) -> ConfigSource {
    ConfigSource {
        config_source_specifier: Some(config_source::ConfigSourceSpecifier::PathConfigSource(
            PathConfigSource {
                path: dir.join(file).to_string_lossy().into_owned(),
                watched_directory: Some(WatchedDirectory {
                    path: dir.to_string_lossy().into_owned(),
                    ..Default::default()
                }),
                ..Default::default()
            },
        )),
        resource_api_version: ApiVersion::V3 as i32,
        ..Default::default()
    }
}

async fn connect_from(peer: &str, listen: SocketAddr) -> TcpStream {
    let socket = TcpSocket::new_v4().unwrap();
    socket.bind(SocketAddr::new(peer.parse().unwrap(), 0)).unwrap();
    socket.connect(listen).await.unwrap()
}

/// Whether the connection still carries data both ways.
async fn alive(stream: &mut TcpStream) -> bool {
    if stream.write_all(b"\0ping").await.is_err() {
        return false;
    }
    let mut buf = [0; 5];
    let read = tokio::time::timeout(Duration::from_secs(2), stream.read_exact(&mut buf)).await;
    matches!(read, Ok(Ok(_))) && &buf == b"\0ping"
}

#[tokio::test]
async fn a_policy_change_applies_to_new_connections_at_once_and_closes_denied_ones_after_the_drain() {
    let pod = cart();
    let apps = cart_apps().await;
    let listen = TcpListener::bind("127.0.0.1:0").await.unwrap().local_addr().unwrap();
    let mut generator = Generator::default();
    let pods = std::slice::from_ref(&pod);
    let open = generate(&mut generator, &catalog(&[]), pods);
    let xds = tempfile::tempdir().unwrap();
    serve(xds.path(), loopback_listener(&open, &pod, listen.port()), "1");
    let lds = file_source(xds.path(), "lds.pb");
    let bootstrap = Bootstrap {
        static_resources: Some(bootstrap::StaticResources {
            clusters: loopback_clusters(&open, &apps),
            ..Default::default()
        }),
        dynamic_resources: Some(bootstrap::DynamicResources {
            lds_config: Some(lds),
            ..Default::default()
        }),
        ..node()
    };
    let dir = tempfile::tempdir().unwrap();
    let _envoy = envoy(&bootstrap, &["--drain-time-s", "2"], dir.path(), listen).await;
    let mut long_lived = connect_from("127.0.0.2", listen).await;
    assert!(alive(&mut long_lived).await);

    let denied = generate(&mut generator, &catalog(&policies(DENY_PEER)), pods);
    let changed = Instant::now();
    serve(xds.path(), loopback_listener(&denied, &pod, listen.port()), "2");
    let tcp_from_2 = AuthzRequest {
        workload: super::super::workload(&pod),
        principal: None,
        trust_domain: "cluster.local".into(),
        peer_ip: "127.0.0.2".parse().unwrap(),
        port: 5432,
        http: None,
    };
    while call(listen, &tcp_from_2).await == Verdict::Allow {
        assert!(
            changed.elapsed() < Duration::from_secs(1),
            "new connections still allowed"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let enforced = changed.elapsed();
    while alive(&mut long_lived).await {
        assert!(
            changed.elapsed() < Duration::from_secs(6),
            "the denied connection stays open"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let closed = changed.elapsed();
    eprintln!("new connections denied after {enforced:?}, the old one closed after {closed:?} (drain time 2 s)");
    assert!(
        closed > Duration::from_secs(1),
        "closed by the drain, not at once: {closed:?}"
    );
}

/// The pod's inbound listener as generated (its route table from RDS), with the table
/// read from `rds.pb` in `dir` instead of ADS.
fn listener_with_file_rds(generated: &Generated, pod: &LocalPod, listen: u16, dir: &std::path::Path) -> Listener {
    let name = format!("inbound|{}", pod.id());
    let generated_listener = generated[crate::xds::LISTENER].iter().find(|r| r.name == name).unwrap();
    let mut listener = loopback_listener(generated, pod, listen);
    let original = Listener::decode(&*generated_listener.body.value).unwrap();
    listener.filter_chains[0] = original.filter_chains[0].clone();
    let Some(filter::ConfigType::TypedConfig(any)) = &mut listener.filter_chains[0].filters[0].config_type else {
        panic!("untyped HCM");
    };
    let mut hcm = HttpConnectionManager::decode(&*any.value).unwrap();
    let Some(http_connection_manager::RouteSpecifier::Rds(rds)) = &mut hcm.route_specifier else {
        panic!("the inbound table comes from RDS");
    };
    rds.config_source = Some(file_source(dir, "rds.pb"));
    // The decision log goes to the agent, which is not here.
    hcm.access_log.clear();
    any.value = hcm.encode_to_vec();
    listener
}

/// The pod's inbound route table as generated.
fn route_table(generated: &Generated, pod: &LocalPod) -> Any {
    let name = format!("inbound|{}", pod.id());
    let routes = generated[crate::xds::ROUTE].iter().find(|r| r.name == name).unwrap();
    routes.body.clone()
}

/// Sends one keep-alive GET on `stream` and returns the status code.
async fn get(stream: &mut TcpStream) -> u16 {
    let request = format!(
        "GET /api HTTP/1.1\r\nhost: cart\r\n{}: 8080\r\n\r\n",
        crate::xds::resources::PORT_HEADER
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut reply = Vec::new();
    let mut buf = [0; 1024];
    // Every answer here has a 2-byte or short body after its headers; read until the body is in.
    loop {
        let n = tokio::time::timeout(Duration::from_secs(5), stream.read(&mut buf))
            .await
            .unwrap()
            .unwrap();
        assert!(n > 0, "the connection closed: {}", String::from_utf8_lossy(&reply));
        reply.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&reply);
        if let Some((head, body)) = text.split_once("\r\n\r\n") {
            let length: usize = head
                .lines()
                .find_map(|l| {
                    l.to_ascii_lowercase()
                        .strip_prefix("content-length: ")
                        .map(|v| v.trim().parse().unwrap())
                })
                .unwrap_or(0);
            if body.len() >= length {
                return head[9..12].parse().unwrap();
            }
        }
    }
}

#[tokio::test]
async fn a_policy_change_reaches_the_next_request_on_an_open_http_connection() {
    let pod = cart();
    let apps = cart_apps().await;
    let listen = TcpListener::bind("127.0.0.1:0").await.unwrap().local_addr().unwrap();
    let mut generator = Generator::default();
    let pods = std::slice::from_ref(&pod);
    let open = generate(&mut generator, &catalog(&[]), pods);
    let xds = tempfile::tempdir().unwrap();
    serve_file(xds.path(), "rds.pb", route_table(&open, &pod), "1");
    let bootstrap = Bootstrap {
        static_resources: Some(bootstrap::StaticResources {
            listeners: vec![listener_with_file_rds(&open, &pod, listen.port(), xds.path())],
            clusters: loopback_clusters(&open, &apps),
            ..Default::default()
        }),
        ..node()
    };
    let dir = tempfile::tempdir().unwrap();
    let _envoy = envoy(&bootstrap, &[], dir.path(), listen).await;
    let mut open_connection = connect_from("127.0.0.2", listen).await;
    assert_eq!(get(&mut open_connection).await, 200);

    let denied = generate(&mut generator, &catalog(&policies(DENY_PEER)), pods);
    // The listener changes (its TCP chain), but not its HTTP chain: Envoy keeps that
    // chain's connections (a filter-chain-only update drains the changed chains alone).
    let http_chain = |g: &Generated| {
        let listeners = &g[crate::xds::LISTENER];
        let inbound = listeners.iter().find(|r| r.name.starts_with("inbound|")).unwrap();
        Listener::decode(&*inbound.body.value).unwrap().filter_chains[0].clone()
    };
    assert_eq!(
        http_chain(&open),
        http_chain(&denied),
        "a policy edit leaves the HTTP chain as it is"
    );
    let changed = Instant::now();
    serve_file(xds.path(), "rds.pb", route_table(&denied, &pod), "2");
    while get(&mut open_connection).await == 200 {
        assert!(
            changed.elapsed() < Duration::from_secs(1),
            "the open connection is still allowed"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    eprintln!(
        "the next request on the open connection was denied {:?} after the change",
        changed.elapsed()
    );
    assert_eq!(
        get(&mut open_connection).await,
        403,
        "same connection, denied from now on"
    );
}
