//! The edge gateway (proposals/018) end to end: `aether-agent edge` and its own real Envoy next to a mesh node
//! whose echo backends are pods in network namespaces, called from the root netns (outside the mesh).
//!
//! Our own GATEWAY-HTTP conformance suite (`tests/fixtures/edge/conformance/`, restating gateway-api's tests; its
//! README maps each file to the upstream test) runs on the GAMMA runner in `Setup::Edge`. Set
//! `AETHER_GAMMA_CASE=<part of a name>` to run only matching cases.

use std::path::Path;

use aether_tests::gamma::{Setup, run_suite, table_path};

/// The restated gateway-api GATEWAY-HTTP tests (core and the extended features of issue 23).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn edge_conformance_cases_pass() {
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/edge/conformance");
    let table = table_path(env!("CARGO_TARGET_TMPDIR"), "edge-conformance");
    run_suite(&fixtures, &table, Setup::Edge).await;
}

// ---- Beyond conformance: identity, upgrades, rotation, changes under load, TLS passthrough and TCP. ----

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use aether_tests::edge::{GATEWAY_NAMESPACE, SERVICE_ACCOUNT, WORLD_FILE, secret};
use aether_tests::gamma::Suite;
use aether_tests::http::https_request;
use aether_tests::identity::spiffe_id;
use aether_tests::load::{Load, LoadSpec, Protocol};
use aether_tests::supervisor::LIVE_TIMEOUT;
use nix::sys::signal::Signal;

/// An HTTPRoute sending `www.example.com` to `service` (port 80).
fn front_route(service: &str) -> String {
    format!(
        r#"apiVersion: gateway.networking.k8s.io/v1
kind: HTTPRoute
metadata: {{name: front, namespace: demo}}
spec:
  parentRefs: [{{name: edge, namespace: edge}}]
  hostnames: [www.example.com]
  rules: [{{backendRefs: [{{name: {service}, port: 80}}]}}]
"#
    )
}

/// A GET through the edge's HTTP listener as a client outside the mesh.
async fn edge_get(suite: &Suite, host: &str, path: &str) -> Result<aether_tests::HttpReply, String> {
    let url = format!("http://{}{path}", suite.edge().addr(80));
    aether_tests::http_get(&url, Some(host)).await
}

/// Polls until `www.example.com` is answered by `service` through the edge.
async fn until_served_by(suite: &Suite, service: &str) -> serde_json::Value {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Ok(reply) = edge_get(suite, "www.example.com", "/").await
            && let Ok(echo) = serde_json::from_str::<serde_json::Value>(&reply.body)
            && reply.status == 200
            && echo["service"] == service
        {
            return echo;
        }
        assert!(
            Instant::now() < deadline,
            "the edge never served www.example.com from {service}\n{}",
            suite.registrar_logs()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn edge_load(suite: &Suite, protocol: Protocol, connections: usize, streams: usize) -> Load {
    Load::start(LoadSpec {
        target: suite.edge().addr(80),
        host: "www.example.com".into(),
        path: "/load".into(),
        protocol,
        connections,
        streams,
        netns: None,
    })
}

/// The mesh sees the gateway as a workload of its own: the backend is told its SPIFFE ID, and an authorization
/// policy that admits only the gateway lets the edge in and keeps a mesh pod out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_backend_sees_the_gateways_own_identity_and_policies_can_name_it() {
    let suite = Suite::start_as(Setup::Edge).await;
    let _route = suite.write_routes("front", &front_route("echo-v1"));
    let echo = until_served_by(&suite, "echo-v1").await;
    let gateway = spiffe_id(GATEWAY_NAMESPACE, SERVICE_ACCOUNT);
    let xfcc = echo["headers"]["x-forwarded-client-cert"].as_str().unwrap_or_default();
    assert!(xfcc.contains(&format!("URI={gateway}")), "the backend saw {echo:#}");

    let policy = format!(
        r#"apiVersion: security.aether.io/v1alpha1
kind: AuthorizationPolicy
metadata: {{name: only-the-edge, namespace: demo}}
spec:
  rules: [{{from: [{{source: {{principals: ["{gateway}"]}}}}]}}]
"#
    );
    let _policy = suite.write_routes("only-the-edge", &policy);
    // The mesh client is refused once the policy is live; the edge still gets through.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if suite.refused_from_client("echo-v1").await {
            break;
        }
        assert!(Instant::now() < deadline, "the policy never refused the mesh client");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let reply = edge_get(&suite, "www.example.com", "/").await.expect("the edge");
    assert_eq!(reply.status, 200, "the gateway is admitted: {reply:?}");
}

/// Hot restarts of the edge's Envoy (the supervisor's, as on an upgrade) under HTTP/1.1 and HTTP/2 load from
/// outside: no request fails, no connection is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hot_restarts_of_the_edge_under_load_lose_no_request() {
    let mut suite = Suite::start_as(Setup::Edge).await;
    let _route = suite.write_routes("front", &front_route("echo"));
    until_served_by(&suite, "echo").await;
    let h1 = edge_load(&suite, Protocol::Http1, 4, 1);
    let h2 = edge_load(&suite, Protocol::Http2, 2, 4);
    h1.wait_ok(100, Duration::from_secs(10)).await;
    h2.wait_ok(100, Duration::from_secs(10)).await;
    for epoch in 1..=5u64 {
        let proxy = &mut suite.edge_mut().proxy;
        proxy.signal(Signal::SIGHUP);
        proxy.wait_epoch_live(epoch, LIVE_TIMEOUT).await;
        h1.wait_ok(50, Duration::from_secs(10)).await;
        h2.wait_ok(50, Duration::from_secs(10)).await;
    }
    let (h1, h2) = (h1.stop().await, h2.stop().await);
    eprintln!("edge hot restarts: HTTP/1.1 {h1:?}\nHTTP/2 {h2:?}");
    h1.assert_clean(500);
    h2.assert_clean(500);
    assert!(h1.connects >= 4 * 5, "every epoch took the clients over: {h1:#?}");
}

/// A route changed under load moves the traffic to the new backend without a failed request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_route_change_under_load_loses_no_request() {
    let suite = Suite::start_as(Setup::Edge).await;
    let _route = suite.write_routes("front", &front_route("echo-v1"));
    until_served_by(&suite, "echo-v1").await;
    let load = edge_load(&suite, Protocol::Http1, 4, 1);
    load.wait_ok(200, Duration::from_secs(10)).await;
    let _route = suite.write_routes("front", &front_route("echo-v2"));
    until_served_by(&suite, "echo-v2").await;
    load.wait_ok(200, Duration::from_secs(10)).await;
    let report = load.stop().await;
    eprintln!("route change under load: {report:?}");
    report.assert_clean(400);
}

/// A Secret updated with a new certificate is served to new connections, and no handshake fails meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rotated_certificate_is_served_without_a_failed_handshake() {
    let suite = Suite::start_as(Setup::Edge).await;
    let _route = suite.write_routes("front", &front_route("echo-v1"));
    until_served_by(&suite, "echo-v1").await;
    let world = suite.edge_world();
    let addr = suite.edge().addr(443);
    let ca = world.ca.cert_pem.clone();
    let https = move || {
        let ca = ca.clone();
        async move { https_request(addr, "www.example.com", &ca, "GET", "/", "www.example.com", &[], "").await }
    };
    let (reply, served) = https().await.expect("HTTPS through the edge");
    assert_eq!(reply.status, 200, "{reply:?}");
    assert_eq!(served[0], world.example_com.cert_der, "the first certificate");

    let rotated = world
        .ca
        .issue_server_names(&["example.com", "*.example.com"], Duration::from_secs(7200));
    // A later file wins a name clash: the Secret's new contents, as an update of the object would be.
    let _rotation = suite.write_routes("zz-rotated", &secret("edge-cert", &rotated));
    let deadline = Instant::now() + Duration::from_secs(20);
    let (mut before, mut after) = (0, 0);
    loop {
        let (reply, served) = https()
            .await
            .unwrap_or_else(|e| panic!("a handshake or request failed during the rotation: {e}"));
        assert_eq!(reply.status, 200, "{reply:?}");
        if served[0] == rotated.cert_der {
            after += 1;
            if after == 20 {
                break;
            }
        } else {
            assert_eq!(after, 0, "the old certificate came back after the new one was served");
            before += 1;
        }
        assert!(Instant::now() < deadline, "the rotated certificate was never served");
    }
    eprintln!("rotation: {before} handshakes with the old certificate, then 20 with the new one");
}

/// A TLS listener passes the client's TLS through to the backend chosen by SNI (TLSRoute), and a TCP listener
/// proxies bytes (TCPRoute); both cross the mesh in its mTLS.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_passthrough_by_sni_and_tcp_routes_reach_their_backends() {
    let suite = Suite::start_as(Setup::Edge).await;
    let world = suite.edge_world();
    let mesh = suite.mesh();
    let pod = mesh.node.add_pod("secure");
    let backend_cert = world
        .ca
        .issue_server_names(&["secure.example.com"], Duration::from_secs(3600));
    let _https = pod.serve_https(SocketAddr::from(([0, 0, 0, 0], 9443)), "secure", &backend_cert);
    let _tcp = pod.serve_tcp_echo(SocketAddr::from(([0, 0, 0, 0], 9000)));
    mesh.describe_pod(&pod, "secure", "secure", "", &[("tls-web", 9443), ("tcp-echo", 9000)]);
    mesh.add_pod_ok(&pod, "secure").await;

    let listeners = r#"
- name: http
  port: 80
  protocol: HTTP
  allowedRoutes: {namespaces: {from: All}}
- name: tls
  port: 8443
  protocol: TLS
  tls: {mode: Passthrough}
  allowedRoutes: {namespaces: {from: All}}
- name: tcp
  port: 9000
  protocol: TCP
  allowedRoutes: {namespaces: {from: All}}
"#;
    let _world = suite.write_routes(WORLD_FILE.trim_end_matches(".yaml"), &world.yaml(listeners));
    let routes = r#"apiVersion: gateway.networking.k8s.io/v1alpha2
kind: TLSRoute
metadata: {name: secure, namespace: demo}
spec:
  parentRefs: [{name: edge, namespace: edge, sectionName: tls}]
  hostnames: [secure.example.com]
  rules: [{backendRefs: [{name: secure, port: 9443}]}]
---
apiVersion: gateway.networking.k8s.io/v1alpha2
kind: TCPRoute
metadata: {name: raw, namespace: demo}
spec:
  parentRefs: [{name: edge, namespace: edge, sectionName: tcp}]
  rules: [{backendRefs: [{name: secure, port: 9000}]}]
"#;
    let _routes = suite.write_routes("streams", routes);

    let edge = suite.edge();
    let deadline = Instant::now() + Duration::from_secs(20);
    let ca = world.ca.cert_pem.clone();
    let (reply, served) = loop {
        match https_request(
            edge.addr(8443),
            "secure.example.com",
            &ca,
            "GET",
            "/",
            "secure.example.com",
            &[],
            "",
        )
        .await
        {
            Ok(answer) => break answer,
            Err(e) => assert!(Instant::now() < deadline, "no passthrough: {e}\n{}", edge.logs()),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(reply.status, 200, "{reply:?}");
    assert_eq!(
        served[0], backend_cert.cert_der,
        "the backend's own certificate: the edge never terminated it"
    );

    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match tcp_greeting(edge.addr(9000)).await {
            Ok(greeting) => {
                assert_eq!(greeting, "secure", "the TCP backend greets with its pod name");
                break;
            }
            Err(e) => assert!(Instant::now() < deadline, "no TCP route: {e}\n{}", edge.logs()),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Connects, reads the TCP echo's greeting line, and checks it echoes.
async fn tcp_greeting(addr: SocketAddr) -> Result<String, String> {
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
    let exchange = async {
        let stream = tokio::net::TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
        let mut stream = BufReader::new(stream);
        let mut greeting = String::new();
        stream.read_line(&mut greeting).await.map_err(|e| e.to_string())?;
        stream.get_mut().write_all(b"ping\n").await.map_err(|e| e.to_string())?;
        let mut echoed = String::new();
        stream.read_line(&mut echoed).await.map_err(|e| e.to_string())?;
        if echoed != "ping\n" {
            return Err(format!("echoed {echoed:?}"));
        }
        Ok(greeting.trim_end().to_owned())
    };
    tokio::time::timeout(Duration::from_secs(5), exchange)
        .await
        .map_err(|_| "timed out".to_owned())?
}

/// Bad input on one listener (a Secret that holds no certificate) is reported on that listener, with the API's
/// reason, and the rest of the Gateway keeps serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_secret_fails_its_listener_alone_and_the_rest_keeps_serving() {
    let suite = Suite::start_as(Setup::Edge).await;
    let _route = suite.write_routes("front", &front_route("echo-v1"));
    until_served_by(&suite, "echo-v1").await;
    let listeners = r#"
- name: http
  port: 80
  protocol: HTTP
  allowedRoutes: {namespaces: {from: All}}
- name: https
  port: 443
  protocol: HTTPS
  hostname: www.example.com
  tls: {mode: Terminate, certificateRefs: [{name: edge-cert}]}
  allowedRoutes: {namespaces: {from: All}}
- name: broken
  port: 443
  protocol: HTTPS
  hostname: broken.example.com
  tls: {mode: Terminate, certificateRefs: [{name: not-a-certificate}]}
  allowedRoutes: {namespaces: {from: All}}
"#;
    let bad = "apiVersion: v1\nkind: Secret\nmetadata: {name: not-a-certificate, namespace: edge}\ntype: kubernetes.io/tls\nstringData: {tls.crt: \"hello\", tls.key: \"world\"}\n";
    let _bad = suite.write_routes("bad-secret", bad);
    let world = suite.edge_world();
    let _world = suite.write_routes(WORLD_FILE.trim_end_matches(".yaml"), &world.yaml(listeners));
    let edge = suite.edge();
    edge.wait_status("the broken listener refused", Duration::from_secs(20), |status| {
        let listeners = status["listeners"].as_array().cloned().unwrap_or_default();
        listeners.iter().any(|l| {
            l["name"] == "broken"
                && l["conditions"].as_array().is_some_and(|c| {
                    c.iter().any(|c| {
                        c["type"] == "ResolvedRefs" && c["status"] == "False" && c["reason"] == "InvalidCertificateRef"
                    })
                })
        })
    })
    .await;
    let (reply, _) = https_request(
        edge.addr(443),
        "www.example.com",
        &world.ca.cert_pem,
        "GET",
        "/",
        "www.example.com",
        &[],
        "",
    )
    .await
    .expect("the good HTTPS listener still serves");
    assert_eq!(reply.status, 200, "{reply:?}");
    let plain = edge_get(&suite, "www.example.com", "/")
        .await
        .expect("the HTTP listener");
    assert_eq!(plain.status, 200, "{plain:?}");
    let broken = https_request(
        edge.addr(443),
        "broken.example.com",
        &world.ca.cert_pem,
        "GET",
        "/",
        "broken.example.com",
        &[],
        "",
    )
    .await;
    assert!(
        broken.is_err(),
        "no certificate is served for the broken listener: {broken:?}"
    );
}
