//! A policy change on a live Envoy: the pod's inbound listener is replaced through LDS
//! (from a watched file here; over ADS it is the same filter-chain-only update). New
//! connections get the new rules at once; a long-lived TCP connection the new rules deny
//! is closed when Envoy's drain time (`--drain-time-s`) has passed. Fails without Envoy.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use aether_api::authorization::{AuthzRequest, Verdict};
use envoy_types::pb::envoy::config::bootstrap::v3::{Bootstrap, bootstrap};
use envoy_types::pb::envoy::config::core::v3::{
    ApiVersion, ConfigSource, PathConfigSource, WatchedDirectory, config_source,
};
use envoy_types::pb::envoy::service::discovery::v3::DiscoveryResponse;
use prost::Name;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpSocket, TcpStream};

use super::data_path::{app, call, envoy, loopback_clusters, loopback_listener, node};
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
    let response = DiscoveryResponse {
        version_info: version.into(),
        resources: vec![any(&listener)],
        type_url: Listener::type_url(),
        ..Default::default()
    };
    let staged = dir.join("lds.pb.new");
    std::fs::write(&staged, response.encode_to_vec()).unwrap();
    std::fs::rename(staged, dir.join("lds.pb")).unwrap();
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
    let mut apps = BTreeMap::new();
    for port in [5432, 8080, 9090] {
        apps.insert(port, app().await);
    }
    let listen = TcpListener::bind("127.0.0.1:0").await.unwrap().local_addr().unwrap();
    let mut generator = Generator::default();
    let pods = std::slice::from_ref(&pod);
    let open = generate(&mut generator, &catalog(&[]), pods);
    let xds = tempfile::tempdir().unwrap();
    serve(xds.path(), loopback_listener(&open, &pod, listen.port()), "1");
    let lds = ConfigSource {
        config_source_specifier: Some(config_source::ConfigSourceSpecifier::PathConfigSource(
            PathConfigSource {
                path: xds.path().join("lds.pb").to_string_lossy().into_owned(),
                watched_directory: Some(WatchedDirectory {
                    path: xds.path().to_string_lossy().into_owned(),
                    ..Default::default()
                }),
                ..Default::default()
            },
        )),
        resource_api_version: ApiVersion::V3 as i32,
        ..Default::default()
    };
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
