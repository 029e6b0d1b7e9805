//! Real Envoy on the data path: the generated inbound listener (plaintext, moved from the
//! pod's netns to loopback) in front of small apps on loopback, called over HTTP and raw
//! TCP; every answer (200 or 403, echoed or closed) is what `decide` says. Principals need
//! mTLS and so are the table test's; here ports, methods, paths, hosts and the peer
//! address go through Envoy's own matchers. Fails when Envoy is missing.

use std::net::SocketAddr;
use std::time::Duration;

use aether_api::authorization::{AuthzRequest, HttpRequest, Verdict, decide};
use envoy_types::pb::envoy::config::bootstrap::v3::{Bootstrap, bootstrap};
use envoy_types::pb::envoy::config::cluster::v3::Cluster;
use envoy_types::pb::envoy::config::core::v3::{Node, address, socket_address};
use envoy_types::pb::envoy::config::endpoint::v3::lb_endpoint;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::*;
use crate::proxy::envoy::test_envoy_bin;

const POLICIES: &str = "apiVersion: security.aether.io/v1alpha1
kind: AuthorizationPolicy
metadata: {name: api, namespace: shop}
spec:
  rules:
    - to: [{operation: {ports: [8080], methods: [GET], paths: ['/api/*'], hosts: [cart.shop.aether.internal]}}]
    - to: [{operation: {ports: [9090], notPaths: ['*.secret']}}]
    - from: [{source: {ipBlocks: [127.0.0.1/32]}}]
      to: [{operation: {ports: [5432]}}]
---
apiVersion: security.aether.io/v1alpha1
kind: AuthorizationPolicy
metadata: {name: no-delete, namespace: shop}
spec:
  action: DENY
  rules: [{to: [{operation: {ports: [8080, 9090], methods: [DELETE]}}]}]
";

/// An app on loopback: answers HTTP with 200 (and closes), echoes anything else for as
/// long as the connection lasts.
pub async fn app() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = vec![0; 4096];
                while let Ok(n @ 1..) = stream.read(&mut buf).await {
                    if buf[..n].contains(&b'\n') {
                        let ok = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok";
                        let _ = stream.write_all(ok).await;
                        return;
                    }
                    if stream.write_all(&buf[..n]).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    port
}

/// An app per port of `cart` (pod port → app port on loopback).
pub async fn cart_apps() -> BTreeMap<u16, u16> {
    let mut apps = BTreeMap::new();
    for port in [5432, 8080, 9090] {
        apps.insert(port, app().await);
    }
    apps
}

/// The pod's inbound listener, moved out of its netns to 127.0.0.1:`listen`.
pub fn loopback_listener(generated: &Generated, pod: &LocalPod, listen: u16) -> Listener {
    let mut listener = inbound(generated, pod);
    let Some(address::Address::SocketAddress(socket)) = &mut listener.address.as_mut().unwrap().address else {
        panic!("no socket address")
    };
    socket.network_namespace_filepath.clear();
    socket.address = "127.0.0.1".into();
    socket.port_specifier = Some(socket_address::PortSpecifier::PortValue(listen.into()));
    listener
}

/// The pod's delivery clusters, to the apps (pod port → app port) on the host's loopback.
pub fn loopback_clusters(generated: &Generated, apps: &BTreeMap<u16, u16>) -> Vec<Cluster> {
    let clusters = generated[crate::xds::CLUSTER].iter();
    let clusters = clusters.filter(|r| r.name.starts_with("local|"));
    let clusters = clusters.map(|r| {
        let mut cluster = Cluster::decode(&*r.body.value).unwrap();
        let pod_port: u16 = r.name.rsplit('|').next().unwrap().parse().unwrap();
        cluster.upstream_bind_config = None;
        let endpoint = &mut cluster.load_assignment.as_mut().unwrap().endpoints[0].lb_endpoints[0];
        let Some(lb_endpoint::HostIdentifier::Endpoint(endpoint)) = &mut endpoint.host_identifier else {
            panic!("no endpoint")
        };
        let Some(address::Address::SocketAddress(socket)) = &mut endpoint.address.as_mut().unwrap().address else {
            panic!("no socket address")
        };
        socket.port_specifier = Some(socket_address::PortSpecifier::PortValue(apps[&pod_port].into()));
        cluster
    });
    clusters.collect()
}

fn bootstrap(generated: &Generated, pod: &LocalPod, listen: u16, apps: &BTreeMap<u16, u16>) -> Bootstrap {
    Bootstrap {
        static_resources: Some(bootstrap::StaticResources {
            listeners: vec![loopback_listener(generated, pod, listen)],
            clusters: loopback_clusters(generated, apps),
            ..Default::default()
        }),
        ..node()
    }
}

pub fn node() -> Bootstrap {
    Bootstrap {
        node: Some(Node {
            id: "data-path".into(),
            cluster: "data-path".into(),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// What the inbound listener answers: an HTTP status, or for raw TCP whether the app's
/// echo came back.
pub async fn call(listen: SocketAddr, request: &AuthzRequest) -> Verdict {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind(SocketAddr::new(request.peer_ip, 0)).unwrap();
    let mut stream = socket.connect(listen).await.unwrap();
    let bytes = match &request.http {
        Some(http) => format!(
            "{} {} HTTP/1.1\r\nhost: {}\r\n{}: {}\r\nconnection: close\r\n\r\n",
            http.method,
            http.path,
            http.host,
            crate::xds::resources::PORT_HEADER,
            request.port
        ),
        // Not HTTP from the first byte, so the HTTP inspector gives up at once.
        None => "\0raw bytes".to_owned(),
    };
    stream.write_all(bytes.as_bytes()).await.unwrap();
    // Read the status line (or the echo), not to EOF: Envoy delays closing after a local reply.
    let mut reply = Vec::new();
    let mut buf = [0; 1024];
    let enough = |reply: &[u8]| reply.len() >= bytes.len().min(12);
    while !enough(&reply) {
        let read = tokio::time::timeout(Duration::from_secs(5), stream.read(&mut buf)).await;
        match read.expect("an answer within 5 s") {
            Ok(0) | Err(_) => break,
            Ok(n) => reply.extend_from_slice(&buf[..n]),
        }
    }
    let reply = String::from_utf8_lossy(&reply);
    let allowed = match &request.http {
        Some(_) if reply.starts_with("HTTP/1.1 403") => false,
        Some(_) if reply.starts_with("HTTP/1.1 200") => true,
        Some(_) => panic!("unexpected answer to {request:?}: {reply}"),
        None => reply.starts_with("\0raw"),
    };
    if allowed { Verdict::Allow } else { Verdict::Deny }
}

/// Envoy serving `bootstrap` (with `args`) until dropped, once its listener accepts.
pub async fn envoy(
    bootstrap: &Bootstrap,
    args: &[&str],
    dir: &std::path::Path,
    listen: SocketAddr,
) -> tokio::process::Child {
    let path = dir.join("bootstrap.pb");
    std::fs::write(&path, bootstrap.encode_to_vec()).unwrap();
    let child = tokio::process::Command::new(test_envoy_bin())
        .args([
            "-c",
            &path.to_string_lossy(),
            "--disable-hot-restart",
            "--concurrency",
            "1",
        ])
        .args(["--log-level", "warn"])
        .args(args)
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    for _ in 0..200 {
        if TcpStream::connect(listen).await.is_ok() {
            return child;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("Envoy did not listen on {listen}");
}

#[tokio::test]
async fn envoy_answers_as_decide_does() {
    let pod = cart();
    let apps = cart_apps().await;
    let listen = TcpListener::bind("127.0.0.1:0").await.unwrap().local_addr().unwrap();
    let policies = policies(POLICIES);
    let generated = generate(
        &mut Generator::default(),
        &catalog(&policies),
        std::slice::from_ref(&pod),
    );
    let dir = tempfile::tempdir().unwrap();
    let _envoy = envoy(
        &bootstrap(&generated, &pod, listen.port(), &apps),
        &[],
        dir.path(),
        listen,
    )
    .await;
    let refs: Vec<&AuthorizationPolicy> = policies.iter().map(|p| &**p).collect();
    let request = |peer: &str, port: u32, http: Option<(&str, &str, &str)>| AuthzRequest {
        workload: super::super::workload(&pod),
        principal: None,
        trust_domain: "cluster.local".into(),
        peer_ip: peer.parse().unwrap(),
        port,
        http: http.map(|(method, path, host)| HttpRequest {
            method: method.into(),
            path: path.into(),
            host: host.into(),
        }),
    };
    let mut requests = Vec::new();
    // Loopback answers every 127/8 address: two peers.
    for peer in ["127.0.0.1", "127.0.0.2"] {
        requests.push(request(peer, 5432, None));
        for port in [8080, 9090] {
            for method in ["GET", "DELETE"] {
                for path in ["/api/x?y=1", "/key.secret", "/"] {
                    for host in [
                        "cart.shop.aether.internal:8080",
                        "Cart.Shop.Aether.Internal",
                        "other.example",
                    ] {
                        requests.push(request(peer, port, Some((method, path, host))));
                    }
                }
            }
        }
    }
    let mut seen = std::collections::BTreeSet::new();
    for request in &requests {
        let expected = decide(&refs, request).verdict;
        assert_eq!(call(listen, request).await, expected, "{request:?}");
        seen.insert(format!("{expected:?}"));
    }
    assert_eq!(seen.len(), 2, "both verdicts occur: {seen:?}");
}
