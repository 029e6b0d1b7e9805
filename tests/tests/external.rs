//! External services through real Envoy, mTLS on between pods (the production default): a
//! pod reaches a server outside the mesh (a netns the mesh does not manage, standing for
//! the outside) by the name an ExternalService declares, through its node's Envoy, which
//! resolves the name itself (`--external-dns`, a DNS server the test controls), originates
//! TLS where asked and verifies the outside's certificate, and counts the requests under
//! the external service's name.

use std::io::{BufRead, BufReader};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use aether_tests::identity::TestCa;
use aether_tests::mesh::{Mesh, put_config};
use aether_tests::outside_dns::OutsideDns;
use aether_tests::{HttpReply, TestPod};

const HOST: &str = "api.outside.test";
const DB_HOST: &str = "db.outside.test";

/// The declarations: `payments` (HTTP on 80 originated as TLS to 8443, verified with
/// `ca`; plain HTTP on 8080), `legacy-db` (TCP on 5432 at a static address) and
/// `impostor` (the same host, but TLS verified for a name its certificate does not have).
fn declarations(ca_pem: &str, outside: Ipv4Addr) -> String {
    let ca: String = ca_pem.lines().map(|l| format!("      {l}\n")).collect();
    format!(
        "apiVersion: networking.aether.io/v1alpha1\nkind: ExternalService\n\
         metadata: {{name: payments, namespace: demo}}\n\
         spec:\n  hosts: [{HOST}]\n  ports:\n  \
         - {{number: 80, protocol: HTTP, targetPort: 8443, originateTls: true}}\n  \
         - {{number: 8080, protocol: HTTP}}\n  \
         tls:\n    caCertificates: |\n{ca}\
         ---\n\
         apiVersion: networking.aether.io/v1alpha1\nkind: ExternalService\n\
         metadata: {{name: legacy-db, namespace: demo}}\n\
         spec:\n  hosts: [{DB_HOST}]\n  addresses: [\"{outside}\"]\n  ports: [{{number: 5432}}]\n\
         ---\n\
         apiVersion: networking.aether.io/v1alpha1\nkind: ExternalService\n\
         metadata: {{name: impostor, namespace: demo}}\n\
         spec:\n  hosts: [{HOST}]\n  ports: [{{number: 80, protocol: HTTP, targetPort: 8443, originateTls: true}}]\n  \
         tls:\n    serverName: not-the-outside.test\n    caCertificates: |\n{ca}"
    )
}

/// GETs `/hello` on `vip:port` from `client` with `Host: host` until it answers 200 (the
/// declarations take a moment to reach the node's Envoy, and its first DNS answer too).
async fn get_until_ok(client: &TestPod, vip: &str, port: u16, host: &str) -> HttpReply {
    let deadline = Instant::now() + Duration::from_secs(30);
    let url = format!("http://{vip}:{port}/hello");
    loop {
        match client.http_get(&url, Some(host)).await {
            Ok(reply) if reply.status == 200 => return reply,
            last => assert!(Instant::now() < deadline, "GET {url} (Host {host}): {last:?}"),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The first line a TCP server at `target` sends `client`.
fn greeting(client: &TestPod, target: SocketAddr) -> std::io::Result<String> {
    client.run(move || {
        let stream = TcpStream::connect_timeout(&target, Duration::from_secs(5))?;
        stream.set_read_timeout(Some(Duration::from_secs(5)))?;
        let mut line = String::new();
        BufReader::new(stream).read_line(&mut line)?;
        Ok(line.trim().to_owned())
    })
}

/// An Envoy counter's value (0 if it does not exist yet).
fn envoy_counter(mesh: &Mesh, name: &str) -> u64 {
    let stats = mesh
        .envoy()
        .admin_get(&format!("/stats?filter=^{}$", regex_escape(name)));
    stats
        .lines()
        .find_map(|line| line.strip_prefix(&format!("{name}: "))?.trim().parse().ok())
        .unwrap_or(0)
}

fn regex_escape(text: &str) -> String {
    text.chars()
        .flat_map(|c| match c {
            '.' | '|' | '/' => vec!['\\', c],
            c => vec![c],
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_reaches_an_external_service_by_its_host_through_envoy_with_dns_tls_origination_and_metrics() {
    let config = tempfile::tempdir().unwrap();
    let ca = TestCa::new("the outside's CA");
    let dns = OutsideDns::start(&[]).await;
    let (dns_flag, dir) = (dns.addr().to_string(), config.path().display().to_string());
    let mesh = Mesh::start_with_registrar(&["--external-dns", &dns_flag], &["--routes-dir", &dir]).await;
    // The outside: a netns on the node's network the mesh knows nothing of.
    let outside = mesh.node.add_pod("outside");
    dns.set(HOST, outside.ip());
    let _https = outside.serve_https(
        SocketAddr::from(([0, 0, 0, 0], 8443)),
        "outside-https",
        &ca.issue_server(HOST, Duration::from_secs(3600)),
    );
    let _http = outside.serve_http(SocketAddr::from(([0, 0, 0, 0], 8080)), "outside-http");
    let _db = outside.serve_tcp_echo(SocketAddr::from(([0, 0, 0, 0], 5432)));
    put_config(
        config.path(),
        "external.yaml",
        Some(&declarations(&ca.cert_pem, outside.ip())),
    );

    let client = mesh.node.add_pod("client");
    mesh.describe_pod(&client, "client", "client", "payments,legacy-db,impostor", &[]);
    mesh.add_pod_ok(&client, "client").await;
    let (payments, impostor) = (mesh.vip("payments").await, mesh.vip("impostor").await);

    // HTTP from the pod, TLS from the node's Envoy: the outside's certificate verified
    // against the declared CA for the host, which Envoy resolved through the outside DNS.
    let reply = get_until_ok(&client, &payments, 80, HOST).await;
    let seen = reply.json();
    assert_eq!(seen["pod"], "outside-https", "{seen}");
    assert_eq!(seen["host"], HOST, "the app's Host header reaches the outside: {seen}");
    let headers = seen["headers"].as_object().unwrap();
    for internal in ["x-aether-destination", "x-envoy-upstream-alt-stat-name"] {
        assert!(!headers.contains_key(internal), "{internal} left the mesh: {seen}");
    }
    assert!(dns.queries(HOST) > 0, "Envoy resolved {HOST} through --external-dns");
    // The plain port of the same service, by the service's mesh name this time.
    let by_name = format!("{}:8080", aether_tests::mesh::fqdn("payments"));
    let reply = get_until_ok(&client, &payments, 8080, &by_name).await;
    assert_eq!(reply.json()["pod"], "outside-http");

    // A certificate that does not name the declared server name fails the handshake:
    // nothing is sent to a server the declaration does not trust.
    let reply = client
        .http_get(&format!("http://{impostor}:80/hello"), Some(HOST))
        .await
        .unwrap();
    assert_eq!(reply.status, 503, "{reply:?}");

    // TCP to a static address.
    let db: SocketAddr = format!("{}:5432", mesh.vip("legacy-db").await).parse().unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match greeting(&client, db) {
            Ok(line) if line == "outside" => break,
            other => assert!(Instant::now() < deadline, "TCP to {db}: {other:?}"),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // Per-destination metrics: the requests are counted under the external service, with
    // the calling workload (the tree the agent re-exports as aether_proxy_requests_total).
    let counted = envoy_counter(&mesh, "cluster.demo/payments|80.mesh.demo/client.upstream_rq_200");
    assert!(counted >= 1, "requests to demo/payments|80 from demo/client: {counted}");
    let refused = envoy_counter(&mesh, "cluster.demo/impostor|80.ssl.fail_verify_san");
    assert!(refused >= 1, "handshakes refused for the server name: {refused}");

    // mesh-dns answers the hosts with the VIPs: an unchanged app calling the host is captured.
    let records: serde_json::Value =
        serde_json::from_slice(&std::fs::read(mesh.path("state/mesh-dns/records")).unwrap()).unwrap();
    assert_eq!(
        records["hosts"][DB_HOST]["v4"],
        mesh.vip("legacy-db").await,
        "{records}"
    );
    assert_eq!(records["records"]["demo/payments"]["v4"], payments, "{records}");

    // Withdrawn: the service, its VIP and its host leave the catalog and the node.
    put_config(config.path(), "external.yaml", None);
    let deadline = Instant::now() + Duration::from_secs(20);
    let url = format!("http://{payments}:80/hello");
    while client.http_get(&url, Some(HOST)).await.is_ok_and(|r| r.status == 200) {
        assert!(
            Instant::now() < deadline,
            "demo/payments still served after its declaration was removed"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// `payments` (HTTP on 8080) and `legacy-db` (TCP on 5432, static at `outside`).
fn destinations(outside: Ipv4Addr) -> String {
    format!(
        "apiVersion: networking.aether.io/v1alpha1\nkind: ExternalService\n\
         metadata: {{name: payments, namespace: demo}}\n\
         spec: {{hosts: [{HOST}], ports: [{{number: 8080, protocol: HTTP}}]}}\n---\n\
         apiVersion: networking.aether.io/v1alpha1\nkind: ExternalService\n\
         metadata: {{name: legacy-db, namespace: demo}}\n\
         spec: {{hosts: [{DB_HOST}], addresses: [\"{outside}\"], ports: [{{number: 5432}}]}}\n---\n"
    )
}

/// [`destinations`], with an ALLOW policy
/// letting only `demo/client` GET payments and a DENY policy closing legacy-db to
/// `demo/intruder`.
fn guarded(outside: Ipv4Addr) -> String {
    format!(
        "{}apiVersion: security.aether.io/v1alpha1\nkind: AuthorizationPolicy\n\
         metadata: {{name: payments-get, namespace: demo}}\n\
         spec:\n  targetRefs: [{{group: networking.aether.io, kind: ExternalService, name: payments}}]\n  \
         action: ALLOW\n  rules:\n  - from: [{{source: {{serviceAccounts: [demo/client]}}}}]\n    \
         to: [{{operation: {{methods: [GET]}}}}]\n---\n\
         apiVersion: security.aether.io/v1alpha1\nkind: AuthorizationPolicy\n\
         metadata: {{name: db-intruder, namespace: demo}}\n\
         spec:\n  targetRefs: [{{group: networking.aether.io, kind: ExternalService, name: legacy-db}}]\n  \
         action: DENY\n  rules:\n  - from: [{{source: {{serviceAccounts: [demo/intruder]}}}}]\n",
        destinations(outside)
    )
}

/// The outside (a DNS server naming it, an HTTP server on 8080 and a TCP echo on 5432),
/// the mesh serving the declarations and policies `yaml` gives for it, and the pods
/// `client` and `intruder` declaring payments and legacy-db.
struct Guarded {
    _config: tempfile::TempDir,
    _dns: OutsideDns,
    mesh: Mesh,
    _outside: TestPod,
    http: aether_tests::HttpServer,
    _db: aether_tests::TcpServer,
    callers: Vec<TestPod>,
}

impl Guarded {
    async fn start(yaml: fn(Ipv4Addr) -> String) -> Guarded {
        let config = tempfile::tempdir().unwrap();
        let dns = OutsideDns::start(&[]).await;
        let (dns_flag, dir) = (dns.addr().to_string(), config.path().display().to_string());
        let mesh = Mesh::start_with_registrar(&["--external-dns", &dns_flag], &["--routes-dir", &dir]).await;
        let outside = mesh.node.add_pod("outside");
        dns.set(HOST, outside.ip());
        let http = outside.serve_http(SocketAddr::from(([0, 0, 0, 0], 8080)), "outside-http");
        let db = outside.serve_tcp_echo(SocketAddr::from(([0, 0, 0, 0], 5432)));
        put_config(config.path(), "policies.yaml", Some(&yaml(outside.ip())));
        let mut callers = Vec::new();
        for name in ["client", "intruder"] {
            let pod = mesh.node.add_pod(name);
            mesh.describe_pod(&pod, name, name, "payments,legacy-db", &[]);
            mesh.add_pod_ok(&pod, name).await;
            callers.push(pod);
        }
        Guarded {
            _config: config,
            _dns: dns,
            mesh,
            _outside: outside,
            http,
            _db: db,
            callers,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_to_external_services_are_authorized_by_the_calling_pods_identity() {
    let world = Guarded::start(guarded).await;
    let (mesh, http, callers) = (&world.mesh, &world.http, &world.callers);
    let (client, intruder) = (&callers[0], &callers[1]);
    let payments = mesh.vip("payments").await;
    let url = format!("http://{payments}:8080/pay");

    // The client may GET: the policy reads its identity from its own listener.
    let reply = get_until_ok(client, &payments, 8080, HOST).await;
    assert_eq!(reply.json()["pod"], "outside-http");
    // Not POST, and the intruder not at all: 403 from the node's Envoy, nothing leaves.
    let served = http.requests();
    let post = client.http_request("POST", &url, Some(HOST), &[], "x").await.unwrap();
    assert_eq!(post.status, 403, "{post:?}");
    let denied = intruder.http_get(&url, Some(HOST)).await.unwrap();
    assert_eq!(denied.status, 403, "{denied:?}");
    assert_eq!(http.requests(), served, "a denied call reached the outside");
    // The caller's node logged both denials, naming the caller and the external service.
    let intruder_id = "source=spiffe://aether.test/ns/demo/sa/intruder";
    logged(
        mesh,
        &[
            "no ALLOW policy guarding demo/payments matched",
            intruder_id,
            "pod=demo/intruder",
            "service=demo/payments",
            "port=8080",
        ],
    )
    .await;
    logged(
        mesh,
        &[
            "verdict=\"deny\"",
            "source=spiffe://aether.test/ns/demo/sa/client",
            "method=POST",
        ],
    )
    .await;

    // TCP: the intruder's connections to legacy-db are closed, the client's go through.
    let db: SocketAddr = format!("{}:5432", mesh.vip("legacy-db").await).parse().unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match greeting(client, db) {
            Ok(line) if line == "outside" => break,
            other => assert!(Instant::now() < deadline, "client TCP to {db}: {other:?}"),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let closed = greeting(intruder, db);
    assert!(
        closed.as_ref().is_err() || closed.as_ref().is_ok_and(|l| l.is_empty()),
        "intruder got {closed:?}"
    );
    logged(
        mesh,
        &[
            "verdict=\"deny\"",
            "policy=demo/db-intruder",
            intruder_id,
            "service=demo/legacy-db",
            "port=5432",
            "method=TCP",
        ],
    )
    .await;
}

/// Waits (up to 10 s: Envoy ships its log every 100 ms) for an agent log line with all of `parts`.
async fn logged(mesh: &Mesh, parts: &[&str]) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let logs = mesh.agent.as_ref().unwrap().logs();
        if logs.lines().any(|line| parts.iter().all(|p| line.contains(p))) {
            return;
        }
        let decisions: Vec<&str> = logs.lines().filter(|l| l.contains("authorization:")).collect();
        assert!(
            Instant::now() < deadline,
            "no log line with {parts:?}; decisions: {decisions:#?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// `payments` (HTTP) and `legacy-db` (TCP), each with an AUDIT policy on the client's
/// calls and a dry-run DENY of the intruder's.
fn watched(outside: Ipv4Addr) -> String {
    format!(
        "{}apiVersion: security.aether.io/v1alpha1\nkind: AuthorizationPolicy\n\
         metadata: {{name: watch-payments, namespace: demo}}\n\
         spec:\n  targetRefs:\n  - {{group: networking.aether.io, kind: ExternalService, name: payments}}\n  \
         - {{group: networking.aether.io, kind: ExternalService, name: legacy-db}}\n  \
         action: AUDIT\n  rules:\n  - from: [{{source: {{serviceAccounts: [demo/client]}}}}]\n---\n\
         apiVersion: security.aether.io/v1alpha1\nkind: AuthorizationPolicy\n\
         metadata: {{name: next-deny, namespace: demo}}\n\
         spec:\n  targetRefs:\n  - {{group: networking.aether.io, kind: ExternalService, name: payments}}\n  \
         - {{group: networking.aether.io, kind: ExternalService, name: legacy-db}}\n  \
         action: DENY\n  dryRun: true\n  rules:\n  - from: [{{source: {{serviceAccounts: [demo/intruder]}}}}]\n",
        destinations(outside)
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dry_run_and_audit_policies_on_external_services_change_nothing_and_are_logged() {
    let world = Guarded::start(watched).await;
    let (mesh, http, callers) = (&world.mesh, &world.http, &world.callers);
    let payments = mesh.vip("payments").await;
    // Both are served: neither policy changes an answer.
    for caller in callers {
        let reply = get_until_ok(caller, &payments, 8080, HOST).await;
        assert_eq!(reply.json()["pod"], "outside-http");
    }
    assert!(http.requests() >= 2);
    logged(
        mesh,
        &[
            "verdict=\"audit\"",
            "policy=demo/watch-payments",
            "pod=demo/client",
            "service=demo/payments",
        ],
    )
    .await;
    logged(
        mesh,
        &[
            "verdict=\"dry_run_deny\"",
            "policy=demo/next-deny",
            "source=spiffe://aether.test/ns/demo/sa/intruder",
        ],
    )
    .await;
    // TCP: both connect; each connection logs what was decided for its pod.
    let db: SocketAddr = format!("{}:5432", mesh.vip("legacy-db").await).parse().unwrap();
    for caller in callers {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            match greeting(caller, db) {
                Ok(line) if line == "outside" => break,
                other => assert!(Instant::now() < deadline, "TCP to {db}: {other:?}"),
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    logged(
        mesh,
        &[
            "verdict=\"audit\"",
            "policy=demo/watch-payments",
            "pod=demo/client",
            "service=demo/legacy-db",
            "method=TCP",
        ],
    )
    .await;
    logged(
        mesh,
        &[
            "verdict=\"dry_run_deny\"",
            "pod=demo/intruder",
            "service=demo/legacy-db",
            "port=5432",
        ],
    )
    .await;
    let metrics = mesh.agent_get("/metrics").await;
    let audited = "aether_agent_authorization_decisions_total{pod=\"demo/client\",policy=\"demo/watch-payments\",rule=\"0\",decision=\"audit\"}";
    assert!(metrics.lines().any(|l| l.starts_with(audited)), "{metrics}");
}
