//! Non-HTTP traffic through real Envoy, pods in network namespaces, mTLS on (the
//! production default): TCPRoute splits of a service's TCP port.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use aether_tests::TestPod;
use aether_tests::mesh::{Mesh, put_config};

const DB_PORT: u16 = 5432;

/// Connects from `client` to `target` `count` times, one after the other, and counts
/// which server greeted each connection (the echo servers greet with their pod's name).
fn greeters(client: &TestPod, target: SocketAddr, count: usize) -> BTreeMap<String, usize> {
    let greetings = client.run(move || {
        let mut seen = BTreeMap::new();
        for _ in 0..count {
            let stream = TcpStream::connect_timeout(&target, Duration::from_secs(5))?;
            stream.set_read_timeout(Some(Duration::from_secs(5)))?;
            let mut greeting = String::new();
            BufReader::new(stream).read_line(&mut greeting)?;
            *seen.entry(greeting.trim().to_owned()).or_insert(0) += 1;
        }
        Ok::<_, std::io::Error>(seen)
    });
    greetings.unwrap_or_else(|e| panic!("connecting to {target}: {e}"))
}

/// Polls until every one of a few connections is greeted by one of `servers`.
async fn until_served_by(client: &TestPod, target: SocketAddr, servers: &[&str]) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let seen = greeters(client, target, 10);
        if seen.keys().all(|s| servers.contains(&s.as_str())) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "still served by {seen:?}, waiting for {servers:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A node whose registrar reads routes from `routes`, a pod `client` calling `servers[0]`,
/// and each of `servers` a pod of its own service greeting with its name on `port` (named
/// `port_name`); the client is added last, so its listeners know every server.
struct Streams {
    mesh: Mesh,
    client: TestPod,
    _servers: Vec<(TestPod, aether_tests::TcpServer)>,
}

impl Streams {
    async fn start(routes: &std::path::Path, servers: &[&str], port: u16, port_name: &str) -> Streams {
        let dir = routes.display().to_string();
        let mesh = Mesh::start_with_registrar(&[], &["--routes-dir", &dir]).await;
        let client = mesh.node.add_pod("client");
        mesh.describe_pod(&client, "client", "client", servers[0], &[]);
        let mut running = Vec::new();
        for name in servers {
            let pod = mesh.node.add_pod(name);
            let app = pod.serve_tcp_echo(SocketAddr::from(([127, 0, 0, 1], port)));
            mesh.describe_pod(&pod, name, name, "", &[(port_name, port)]);
            mesh.add_pod_ok(&pod, name).await;
            running.push((pod, app));
        }
        mesh.add_pod_ok(&client, "client").await;
        Streams {
            mesh,
            client,
            _servers: running,
        }
    }

    async fn target(&self, service: &str, port: u16) -> SocketAddr {
        format!("{}:{port}", self.mesh.vip(service).await).parse().unwrap()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tcp_route_splits_connections_by_weight_within_five_percent() {
    let routes = tempfile::tempdir().unwrap();
    let streams = Streams::start(routes.path(), &["db", "db-v1", "db-v2"], DB_PORT, "postgres").await;
    let (client, target) = (&streams.client, streams.target("db", DB_PORT).await);
    assert_eq!(greeters(client, target, 5), BTreeMap::from([("db".to_owned(), 5)]));

    let split = "apiVersion: gateway.networking.k8s.io/v1alpha2\nkind: TCPRoute\n\
        metadata: {name: db-split, namespace: demo}\n\
        spec:\n  parentRefs: [{group: '', kind: Service, name: db, port: 5432}]\n  \
        rules: [{backendRefs: [{name: db-v1, port: 5432, weight: 70}, {name: db-v2, port: 5432, weight: 30}]}]\n";
    put_config(routes.path(), "db-split.yaml", Some(split));
    until_served_by(client, target, &["db-v1", "db-v2"]).await;
    const CONNECTIONS: usize = 500;
    let seen = greeters(client, target, CONNECTIONS);
    let share = |name: &str| seen.get(name).copied().unwrap_or(0) as f64 / CONNECTIONS as f64;
    eprintln!("TCPRoute 70/30 over {CONNECTIONS} connections: {seen:?}");
    assert_eq!(seen.values().sum::<usize>(), CONNECTIONS, "{seen:?}");
    assert!(
        (share("db-v1") - 0.70).abs() <= 0.05,
        "db-v1 took {:.3}: {seen:?}",
        share("db-v1")
    );
    assert!(
        (share("db-v2") - 0.30).abs() <= 0.05,
        "db-v2 took {:.3}: {seen:?}",
        share("db-v2")
    );

    // Removed: the service's own endpoints serve its port again.
    put_config(routes.path(), "db-split.yaml", None);
    until_served_by(client, target, &["db"]).await;
}

/// The first flight of a real TLS client naming `server_name` (rustls' ClientHello).
fn client_hello(server_name: &str) -> Vec<u8> {
    let provider = std::sync::Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(rustls::RootCertStore::empty())
        .with_no_client_auth();
    let name = rustls_pki_types::ServerName::try_from(server_name.to_owned()).unwrap();
    let mut connection = rustls::ClientConnection::new(std::sync::Arc::new(config), name).unwrap();
    let mut hello = Vec::new();
    connection.write_tls(&mut hello).unwrap();
    hello
}

/// Which server greets a connection from `client` to `target` that opens with a TLS
/// ClientHello for `server_name` (`None`: a client that waits for the server to speak).
fn greeted_by(client: &TestPod, target: SocketAddr, server_name: Option<&str>) -> String {
    let hello = server_name.map(client_hello);
    let greeting = client.run(move || {
        use std::io::Write;
        let stream = TcpStream::connect_timeout(&target, Duration::from_secs(5))?;
        stream.set_read_timeout(Some(Duration::from_secs(5)))?;
        if let Some(hello) = &hello {
            (&stream).write_all(hello)?;
        }
        let mut greeting = String::new();
        BufReader::new(stream).read_line(&mut greeting)?;
        Ok::<_, std::io::Error>(greeting.trim().to_owned())
    });
    greeting.unwrap_or_else(|e| panic!("connecting to {target} ({server_name:?}): {e}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_route_passes_the_apps_own_tls_through_by_server_name() {
    const PAY_PORT: u16 = 8443;
    let routes = tempfile::tempdir().unwrap();
    let streams = Streams::start(routes.path(), &["payments", "pay-v1", "pay-v2"], PAY_PORT, "tls").await;
    let (client, target) = (&streams.client, streams.target("payments", PAY_PORT).await);
    assert_eq!(greeted_by(client, target, Some("v1.pay.example.com")), "payments");

    let by_sni = "apiVersion: gateway.networking.k8s.io/v1alpha2\nkind: TLSRoute\n\
        metadata: {name: by-sni, namespace: demo}\n\
        spec:\n  parentRefs: [{group: '', kind: Service, name: payments, port: 8443}]\n  \
        hostnames: [v1.pay.example.com]\n  rules: [{backendRefs: [{name: pay-v1, port: 8443}]}]\n\
        ---\n\
        apiVersion: gateway.networking.k8s.io/v1alpha2\nkind: TLSRoute\n\
        metadata: {name: eu-by-sni, namespace: demo}\n\
        spec:\n  parentRefs: [{group: '', kind: Service, name: payments, port: 8443}]\n  \
        hostnames: ['*.eu.example.com']\n  rules: [{backendRefs: [{name: pay-v2, port: 8443}]}]\n";
    put_config(routes.path(), "by-sni.yaml", Some(by_sni));
    let deadline = Instant::now() + Duration::from_secs(20);
    while greeted_by(client, target, Some("v1.pay.example.com")) != "pay-v1" {
        assert!(Instant::now() < deadline, "the TLSRoute never took v1.pay.example.com");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    for _ in 0..3 {
        assert_eq!(greeted_by(client, target, Some("v1.pay.example.com")), "pay-v1");
        assert_eq!(greeted_by(client, target, Some("shop.eu.example.com")), "pay-v2");
        // A name no route takes, and a client that waits for the server: the service itself.
        assert_eq!(greeted_by(client, target, Some("other.example.com")), "payments");
    }
    assert_eq!(greeted_by(client, target, None), "payments");
}

/// Answers every HTTP/1.1 request on `listener` with `who`, one request per connection.
fn serve_http_on_unix_socket(listener: tokio::net::UnixListener, who: &'static str) -> tokio::task::JoinHandle<()> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    tokio::spawn(async move {
        loop {
            let Ok((mut stream, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let mut request = Vec::new();
                let mut buf = [0u8; 4096];
                while !request.windows(4).any(|w| w == b"\r\n\r\n") {
                    match stream.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => request.extend_from_slice(&buf[..n]),
                    }
                }
                let reply = format!(
                    "HTTP/1.1 200 OK\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{who}",
                    who.len()
                );
                let _ = stream.write_all(reply.as_bytes()).await;
            });
        }
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inbound_traffic_is_delivered_to_the_pods_unix_socket() {
    let dir = tempfile::tempdir().unwrap();
    let (links, kubelet) = (dir.path().join("uds"), dir.path().join("kubelet"));
    let agent_args = [
        "--uds-link-dir",
        links.to_str().unwrap(),
        "--kubelet-root-dir",
        kubelet.to_str().unwrap(),
    ];
    let mesh = Mesh::start_with(&agent_args).await;
    let (client, server) = (mesh.node.add_pod("client"), mesh.node.add_pod("server"));
    // The app listens on a socket in its emptyDir volume "sockets", as kubelet lays it out.
    let volume = kubelet
        .join("pods")
        .join(Mesh::pod_uid(&server))
        .join("volumes/kubernetes.io~empty-dir/sockets");
    std::fs::create_dir_all(&volume).unwrap();
    let app = serve_http_on_unix_socket(
        tokio::net::UnixListener::bind(volume.join("app.sock")).unwrap(),
        "uds-app",
    );
    mesh.describe_pod(&client, "client", "client", "server", &[]);
    let uds = [("endpoint.aether.io/uds-socket", "sockets/app.sock")];
    mesh.describe_pod_annotated(&server, "server", "server", &[("http", 8080)], &uds);
    mesh.add_pod_ok(&server, "server").await;
    mesh.add_pod_ok(&client, "client").await;
    assert!(links.join(Mesh::pod_uid(&server)).exists(), "the volume is linked");

    // Through the mesh, with mTLS, to the socket: nothing listens on the pod's port 8080.
    let url = format!("http://{}:8080/hello", mesh.vip("server").await);
    let deadline = Instant::now() + Duration::from_secs(20);
    let reply = loop {
        match client.http_get(&url, None).await {
            Ok(reply) if reply.status == 200 => break reply,
            other => assert!(Instant::now() < deadline, "no answer from the socket: {other:?}"),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(reply.body, "uds-app");

    mesh.remove_pod(&server, "server").await.unwrap();
    assert!(
        !links.join(Mesh::pod_uid(&server)).exists(),
        "the link goes with the pod"
    );
    app.abort();
}

/// A TCP server on `127.0.0.1:<port>` in `pod` that greets every connection with
/// `"<greeting>\n"`.
fn serve_greeting(pod: &TestPod, port: u16, greeting: &'static str) -> tokio::task::JoinHandle<()> {
    use tokio::io::AsyncWriteExt;
    let listener = pod
        .run(move || {
            let listener = std::net::TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], port)))?;
            listener.set_nonblocking(true)?;
            Ok::<_, std::io::Error>(listener)
        })
        .unwrap_or_else(|e| panic!("binding {port} in the pod: {e}"));
    let listener = tokio::net::TcpListener::from_std(listener).unwrap();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let _ = stream.write_all(format!("{greeting}\n").as_bytes()).await;
        }
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_tcp_port_of_a_pod_gets_its_own_connections() {
    let mesh = Mesh::start().await;
    let (client, cache) = (mesh.node.add_pod("client"), mesh.node.add_pod("cache"));
    let _apps = [
        serve_greeting(&cache, 6379, "redis port"),
        serve_greeting(&cache, 9121, "exporter port"),
    ];
    mesh.describe_pod(&client, "client", "client", "cache", &[]);
    mesh.describe_pod(&cache, "cache", "cache", "", &[("redis", 6379), ("tcp-metrics", 9121)]);
    mesh.add_pod_ok(&cache, "cache").await;
    mesh.add_pod_ok(&client, "client").await;
    let vip = mesh.vip("cache").await;
    for (port, greeting) in [(6379, "redis port"), (9121, "exporter port")] {
        let target: SocketAddr = format!("{vip}:{port}").parse().unwrap();
        // Over mTLS, each stream says which app port it is for; none lands on another.
        assert_eq!(
            greeters(&client, target, 5),
            BTreeMap::from([(greeting.to_owned(), 5)]),
            "port {port}"
        );
    }
}
