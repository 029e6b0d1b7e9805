//! Workload identity end to end: real Envoy, pods as network namespaces, SVIDs from the
//! built-in CA or from a fake SPIRE agent (Delegated Identity API) issuing real
//! certificates. The provider-independent suite runs once per provider.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use aether_tests::identity::{TestCa, spiffe_id};
use aether_tests::mesh::{Mesh, MeshIdentity, NAMESPACE, fqdn};
use aether_tests::{HttpReply, HttpServer, TestPod};

const APP: &str = "127.0.0.1:8080";

async fn eventually(pod: &TestPod, url: &str, host: Option<&str>, ok: impl Fn(&HttpReply) -> bool) -> HttpReply {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let reply = pod.http_get(url, host).await;
        if let Ok(reply) = &reply
            && ok(reply)
        {
            return reply.clone();
        }
        assert!(
            Instant::now() < deadline,
            "no good answer from {url} (host {host:?}): {reply:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn xfcc(reply: &HttpReply) -> String {
    reply.json()["headers"]["x-forwarded-client-cert"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

/// The peer URIs an XFCC header names (`URI=` elements; `By=` is the server itself).
fn peer_uris(xfcc: &str) -> Vec<String> {
    xfcc.split([';', ','])
        .filter_map(|kv| kv.trim().strip_prefix("URI="))
        .map(|v| v.trim_matches('"').to_owned())
        .collect()
}

struct Pods {
    pods: Vec<(TestPod, String)>,
    _apps: Vec<HttpServer>,
}

impl Pods {
    fn get(&self, name: &str) -> &TestPod {
        &self.pods.iter().find(|(_, n)| n == name).expect("pod").0
    }
}

/// Pods `(name, service account, upstreams)`, each serving HTTP on 8080, all added.
async fn add_pods(mesh: &Mesh, specs: &[(&str, &str, &str)]) -> Pods {
    let mut pods = Vec::new();
    let mut apps = Vec::new();
    for (name, sa, upstreams) in specs {
        let pod = mesh.node.add_pod(name);
        apps.push(pod.serve_http(APP.parse().unwrap(), name));
        mesh.describe_pod(&pod, name, sa, upstreams, &[("http", 8080)]);
        pods.push((pod, name.to_string()));
    }
    for (pod, name) in &pods {
        let added = mesh.add_pod(pod, name).await.unwrap_or_else(|s| {
            let warming = mesh.envoy().admin_get("/config_dump?resource=dynamic_warming_clusters");
            let acked = mesh.envoy().admin_get("/config_dump?resource=dynamic_active_clusters");
            panic!(
                "AddPod {name}: {s:?}\n{}\nwarming: {}\nactive: {}",
                diagnose(mesh),
                warming.len(),
                acked.len()
            )
        });
        assert_eq!(
            added.outcome,
            aether_proto::cni::v1::Outcome::Success as i32,
            "{added:?}"
        );
    }
    Pods { pods, _apps: apps }
}

fn backend_host() -> String {
    format!("{}:8080", fqdn("backend"))
}

/// Envoy's active SDS secrets: name → certificate chain (PEM; keys are redacted by Envoy).
fn envoy_secrets(mesh: &Mesh) -> std::collections::BTreeMap<String, String> {
    let dump = mesh.envoy().config_dump();
    let mut out = std::collections::BTreeMap::new();
    for config in dump["configs"].as_array().into_iter().flatten() {
        for s in config["dynamic_active_secrets"].as_array().into_iter().flatten() {
            let name = s["name"].as_str().unwrap_or_default().to_owned();
            let chain = s["secret"]["tls_certificate"]["certificate_chain"]["inline_string"]
                .as_str()
                .or_else(|| s["secret"]["tls_certificate"]["certificate_chain"]["inline_bytes"].as_str())
                .unwrap_or_default()
                .to_owned();
            out.insert(name, chain);
        }
    }
    out
}

/// Runs `curl` inside `pod` against `url` with extra args; (exit success, stdout).
fn curl(pod: &TestPod, args: &[&str]) -> (bool, String, String) {
    let mut cmd = vec!["curl", "-sS", "--max-time", "5"];
    cmd.extend_from_slice(args);
    let out = pod.exec(&cmd);
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// What Envoy holds of identities and what its TLS stats say (for failure messages).
fn diagnose(mesh: &Mesh) -> String {
    let secrets: Vec<String> = envoy_secrets(mesh).into_keys().collect();
    let stats: Vec<String> = mesh
        .envoy()
        .admin_get("/stats")
        .lines()
        .filter(|l| (l.contains("ssl") || l.contains("sds") || l.contains("secret")) && !l.ends_with(": 0"))
        .map(str::to_owned)
        .collect();
    format!("secrets: {secrets:?}\nstats:\n{}", stats.join("\n"))
}

// ---- the provider-independent suite ----

/// A → B over the mesh: B's app sees A's SPIFFE ID (XFCC), and nothing A claimed itself.
async fn peer_identity_reaches_the_app(identity: MeshIdentity) {
    let mesh = Mesh::start_identity(identity, &[]).await;
    let pods = add_pods(
        &mesh,
        &[("backend", "backend", ""), ("frontend", "frontend", "backend")],
    )
    .await;
    let frontend = pods.get("frontend");
    let reply = frontend
        .http_request(
            "GET",
            "http://127.0.0.1:18081/who",
            Some(&backend_host()),
            &[("x-forwarded-client-cert", "URI=spiffe://aether.test/ns/demo/sa/admin")],
            "",
        )
        .await
        .unwrap();
    assert_eq!(reply.status, 200, "{reply:?}\n{}", diagnose(&mesh));
    assert_eq!(reply.json()["pod"], "backend");
    assert_eq!(
        peer_uris(&xfcc(&reply)),
        [spiffe_id(NAMESPACE, "frontend")],
        "{}",
        xfcc(&reply)
    );

    // The trust bundle and each pod's SVID are in Envoy, each pod's secret its own.
    let secrets = envoy_secrets(&mesh);
    assert!(secrets.contains_key("spiffe://aether.test"), "{secrets:?}");
    assert!(secrets.contains_key("svid|demo/frontend") && secrets.contains_key("svid|demo/backend"));
    assert_ne!(secrets["svid|demo/frontend"], secrets["svid|demo/backend"]);
}

/// B's `:18008` refuses plaintext, clients without a certificate and certificates from
/// another CA; a certificate from the mesh's CA gets through (the control).
async fn inbound_refuses_plaintext_and_foreign_certificates(identity: MeshIdentity) {
    let mesh = Mesh::start_identity(identity, &[]).await;
    let pods = add_pods(&mesh, &[("backend", "backend", ""), ("client", "client", "")]).await;
    let client = pods.get("client");
    let backend = pods.get("backend");
    let target = format!("https://{}:18008/direct", backend.ip());
    let dir = tempfile::tempdir().unwrap();

    // Plaintext HTTP to the mTLS port.
    let (ok, out, err) = curl(client, &[&format!("http://{}:18008/plain", backend.ip())]);
    assert!(!ok || !out.contains("\"pod\""), "plaintext got through: {out} {err}");
    // TLS without a client certificate.
    let (ok, out, err) = curl(client, &["-k", "--http2", &target]);
    assert!(!ok, "no client certificate got through: {out} {err}");
    // A client certificate for a mesh identity, signed by someone else.
    let rogue = TestCa::new("rogue CA").issue(&spiffe_id(NAMESPACE, "client"), Duration::from_secs(600));
    let (cert, key) = rogue.write(dir.path(), "rogue");
    let (ok, out, err) = curl(
        client,
        &[
            "-k",
            "--http2",
            "--cert",
            &cert.to_string_lossy(),
            "--key",
            &key.to_string_lossy(),
            &target,
        ],
    );
    assert!(!ok, "a foreign CA's certificate got through: {out} {err}");
    // Control: the same identity from the mesh's CA is accepted, and reaches the app.
    let good = mesh.ca.issue(&spiffe_id(NAMESPACE, "client"), Duration::from_secs(600));
    let (cert, key) = good.write(dir.path(), "good");
    let (ok, out, err) = curl(
        client,
        &[
            "-k",
            "--http2",
            "--cert",
            &cert.to_string_lossy(),
            "--key",
            &key.to_string_lossy(),
            &target,
        ],
    );
    assert!(ok, "a mesh certificate was refused: {err}");
    let reply: serde_json::Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
    assert_eq!(reply["pod"], "backend");
    let seen = reply["headers"]["x-forwarded-client-cert"].as_str().unwrap_or_default();
    assert_eq!(peer_uris(seen), [spiffe_id(NAMESPACE, "client")]);
}

/// Pods on one node never travel on each other's certificate, even through the same
/// (shared) cluster, and two pods of one service account hold different keys.
async fn pods_never_use_each_others_certificates(identity: MeshIdentity) {
    let mesh = Mesh::start_identity(identity, &[]).await;
    let pods = add_pods(
        &mesh,
        &[
            ("backend", "backend", ""),
            ("a", "alpha", "backend"),
            ("c", "gamma", "backend"),
            ("a2", "alpha", "backend"),
        ],
    )
    .await;
    for round in 0..20 {
        for (name, sa) in [("a", "alpha"), ("c", "gamma"), ("a2", "alpha")] {
            let reply = pods
                .get(name)
                .http_get(&format!("http://127.0.0.1:18081/{round}"), Some(&backend_host()))
                .await
                .unwrap();
            assert_eq!(reply.status, 200, "{name}: {reply:?}");
            assert_eq!(
                peer_uris(&xfcc(&reply)),
                [spiffe_id(NAMESPACE, sa)],
                "request from {name}"
            );
        }
    }
    let secrets = envoy_secrets(&mesh);
    assert_ne!(
        secrets["svid|demo/a"], secrets["svid|demo/a2"],
        "two pods share a certificate"
    );
    assert!(!secrets.keys().any(|k| k.contains("node")), "{secrets:?}");
}

/// Rotation under load: every SVID rotates twice while requests flow; none fails.
/// `rotate` makes one rotation of every SVID happen (and returns when it has been issued).
async fn rotation_under_load_fails_no_request(identity: MeshIdentity) {
    let mesh = Mesh::start_identity(identity, &[]).await;
    let pods = add_pods(
        &mesh,
        &[("backend", "backend", ""), ("frontend", "frontend", "backend")],
    )
    .await;
    let frontend = pods.get("frontend");
    let chains = |mesh: &Mesh| {
        let s = envoy_secrets(mesh);
        (s["svid|demo/frontend"].clone(), s["svid|demo/backend"].clone())
    };
    let mut seen = vec![chains(&mesh)];
    let (mut ok, mut failed) = (0u64, Vec::new());
    let deadline = Instant::now() + Duration::from_secs(40);
    while seen.len() < 3 {
        assert!(
            Instant::now() < deadline,
            "SVIDs did not rotate twice: {} distinct",
            seen.len()
        );
        if let Some(spire) = &mesh.spire
            && ok % 150 == 149
        {
            spire.rotate_all();
        }
        match frontend
            .http_get("http://127.0.0.1:18081/load", Some(&backend_host()))
            .await
        {
            Ok(reply) if reply.status == 200 => ok += 1,
            other => failed.push(format!("{other:?}")),
        }
        if ok % 20 == 0 {
            let now = chains(&mesh);
            let last = seen.last().unwrap();
            // Both pods' certificates changed since the last rotation seen.
            if now.0 != last.0 && now.1 != last.1 {
                seen.push(now);
            }
        }
    }
    // And a little more after the second rotation.
    for _ in 0..50 {
        match frontend
            .http_get("http://127.0.0.1:18081/after", Some(&backend_host()))
            .await
        {
            Ok(reply) if reply.status == 200 => ok += 1,
            other => failed.push(format!("{other:?}")),
        }
    }
    assert!(
        failed.is_empty(),
        "{} of {} requests failed during rotation: {:?}",
        failed.len(),
        ok + failed.len() as u64,
        &failed[..failed.len().min(5)]
    );
    assert!(ok > 100, "too little load: {ok}");
}

/// The secrets the agent serves (its xDS snapshot).
async fn served_secrets(mesh: &Mesh) -> BTreeSet<String> {
    let xds: serde_json::Value = serde_json::from_str(&mesh.agent_get("/debug/xds").await).unwrap();
    xds["types"]["type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret"]
        .as_object()
        .map(|m| m.keys().cloned().collect())
        .unwrap_or_default()
}

/// Until `gone` holds for the agent's served secrets (10 s).
async fn wait_served(mesh: &Mesh, what: &str, ok: impl Fn(&BTreeSet<String>) -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let served = served_secrets(mesh).await;
        if ok(&served) {
            return;
        }
        assert!(Instant::now() < deadline, "{what}: {served:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A deleted pod's secret is withdrawn with it (Envoy keeps an SDS secret only while a
/// live resource refers to it: the pod's listeners and the clusters' per-pod sockets go).
async fn a_deleted_pods_secret_is_withdrawn(identity: MeshIdentity) {
    let mesh = Mesh::start_identity(identity, &[]).await;
    let pods = add_pods(&mesh, &[("backend", "backend", ""), ("gone", "gone", "backend")]).await;
    assert!(envoy_secrets(&mesh).contains_key("svid|demo/gone"));
    mesh.remove_pod(pods.get("gone"), "gone").await.unwrap();
    wait_served(&mesh, "the deleted pod's secret is still served", |s| {
        !s.contains("svid|demo/gone")
    })
    .await;
    assert!(served_secrets(&mesh).await.contains("svid|demo/backend"));
    let clusters = mesh.envoy().admin_get("/config_dump?resource=dynamic_active_clusters");
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut clusters = clusters;
    while clusters.contains("svid|demo/gone") {
        assert!(
            Instant::now() < deadline,
            "a cluster still carries the deleted pod's certificate"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
        clusters = mesh.envoy().admin_get("/config_dump?resource=dynamic_active_clusters");
    }
    let debug = mesh.agent_get("/metrics").await;
    assert!(debug.contains("aether_agent_identity_svids"), "{debug}");
}

macro_rules! suite {
    ($provider:ident, $identity:expr) => {
        mod $provider {
            use super::*;

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn peer_identity_reaches_the_app() {
                super::peer_identity_reaches_the_app($identity).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn inbound_refuses_plaintext_and_foreign_certificates() {
                super::inbound_refuses_plaintext_and_foreign_certificates($identity).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn pods_never_use_each_others_certificates() {
                super::pods_never_use_each_others_certificates($identity).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn rotation_under_load_fails_no_request() {
                super::rotation_under_load_fails_no_request($identity).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_deleted_pods_secret_is_withdrawn() {
                super::a_deleted_pods_secret_is_withdrawn($identity).await;
            }
        }
    };
}

// Builtin: 4 s SVIDs rotate every 2 s on their own. SPIRE: the test rotates.
suite!(
    builtin,
    MeshIdentity::Builtin {
        ttl: Duration::from_secs(4)
    }
);
suite!(
    spire,
    MeshIdentity::Spire {
        ttl: Duration::from_secs(600)
    }
);

// ---- SPIRE-specific ----

fn spire_mesh_identity() -> MeshIdentity {
    MeshIdentity::Spire {
        ttl: Duration::from_secs(600),
    }
}

fn uid(pod: &TestPod) -> String {
    format!("uid-{}", pod.netns_name())
}

/// B presenting an SVID with a SPIFFE ID its callers do not expect is refused by the
/// caller's side (the server SAN is pinned at every handshake; a caller with a fresh
/// connection pool shows it); with the right one back, traffic flows again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_presenting_the_wrong_san_is_refused() {
    let mesh = Mesh::start_identity(spire_mesh_identity(), &[]).await;
    let pods = add_pods(
        &mesh,
        &[("backend", "backend", ""), ("frontend", "frontend", "backend")],
    )
    .await;
    let spire = mesh.spire.as_ref().unwrap();
    eventually(
        pods.get("frontend"),
        "http://127.0.0.1:18081/",
        Some(&backend_host()),
        |r| r.status == 200,
    )
    .await;

    spire.issue_as(&uid(pods.get("backend")), &spiffe_id(NAMESPACE, "impostor"));
    let deadline = Instant::now() + Duration::from_secs(10);
    while served_id_is_backend(&mesh) {
        assert!(Instant::now() < deadline, "the impostor SVID did not reach Envoy");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // A caller that opens new connections now: refused, every time.
    let callers = add_pods(&mesh, &[("caller", "caller", "backend")]).await;
    let caller = callers.get("caller");
    for _ in 0..5 {
        let reply = caller
            .http_get("http://127.0.0.1:18081/", Some(&backend_host()))
            .await
            .unwrap();
        assert_eq!(reply.status, 503, "an impostor served: {reply:?}");
    }
    spire.issue_as(&uid(pods.get("backend")), &spiffe_id(NAMESPACE, "backend"));
    let reply = eventually(caller, "http://127.0.0.1:18081/", Some(&backend_host()), |r| {
        r.status == 200
    })
    .await;
    assert_eq!(peer_uris(&xfcc(&reply)), [spiffe_id(NAMESPACE, "caller")]);
}

/// Whether Envoy's inbound listener of the backend serves a certificate for `sa/backend`.
fn served_id_is_backend(mesh: &Mesh) -> bool {
    let certs = mesh.envoy().admin_get("/certs");
    certs.contains(&spiffe_id(NAMESPACE, "backend")) && !certs.contains(&spiffe_id(NAMESPACE, "impostor"))
}

/// A revoked identity is withdrawn from Envoy: the pod stops being reachable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_svid_is_withdrawn() {
    let mesh = Mesh::start_identity(spire_mesh_identity(), &[]).await;
    let pods = add_pods(
        &mesh,
        &[("backend", "backend", ""), ("frontend", "frontend", "backend")],
    )
    .await;
    let frontend = pods.get("frontend");
    eventually(frontend, "http://127.0.0.1:18081/", Some(&backend_host()), |r| {
        r.status == 200
    })
    .await;
    mesh.spire.as_ref().unwrap().revoke(&uid(pods.get("backend")));
    wait_served(&mesh, "the revoked SVID is still served", |s| {
        !s.contains("svid|demo/backend")
    })
    .await;
    let reply = eventually(frontend, "http://127.0.0.1:18081/", Some(&backend_host()), |r| {
        r.status != 200
    })
    .await;
    assert_eq!(reply.status, 503, "{reply:?}");
}

/// The SPIRE agent goes away: certificates already received keep serving; a pod added
/// meanwhile gets its SVID once the streams reconnect, and so do rotations.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spire_streams_break_and_recover() {
    let mesh = Mesh::start_identity(spire_mesh_identity(), &[]).await;
    let pods = add_pods(
        &mesh,
        &[("backend", "backend", ""), ("frontend", "frontend", "backend")],
    )
    .await;
    let frontend = pods.get("frontend");
    let spire = mesh.spire.as_ref().unwrap();
    eventually(frontend, "http://127.0.0.1:18081/", Some(&backend_host()), |r| {
        r.status == 200
    })
    .await;
    wait_until_no_svid_arrives(spire).await;
    let before = envoy_secrets(&mesh);
    let calls = spire.subscribe_calls();

    spire.break_streams();
    for i in 0..20 {
        let reply = frontend
            .http_get(&format!("http://127.0.0.1:18081/outage/{i}"), Some(&backend_host()))
            .await
            .unwrap();
        assert_eq!(reply.status, 200, "existing certificates stopped serving: {reply:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(envoy_secrets(&mesh)["svid|demo/backend"], before["svid|demo/backend"]);

    let _late = a_pod_added_in_the_outage_gets_its_identity_once_spire_is_back(&mesh).await;
    // Every pod's stream reconnects (each within its backoff, at most 5 s).
    let deadline = Instant::now() + Duration::from_secs(10);
    while spire.subscriptions() < 3 || spire.subscribe_calls() < calls + 3 {
        assert!(
            Instant::now() < deadline,
            "streams did not reconnect: {} live",
            spire.subscriptions()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // Rotations flow again on the reconnected streams.
    spire.rotate_all();
    let deadline = Instant::now() + Duration::from_secs(10);
    while envoy_secrets(&mesh)["svid|demo/backend"] == before["svid|demo/backend"] {
        assert!(Instant::now() < deadline, "no new SVID after reconnecting");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eventually(frontend, "http://127.0.0.1:18081/", Some(&backend_host()), |r| {
        r.status == 200
    })
    .await;
}

/// Settled: no SVID arrived for a while.
async fn wait_until_no_svid_arrives(spire: &aether_tests::spire::FakeSpire) {
    let mut issued = spire.issued().len();
    loop {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let now = spire.issued().len();
        if now == issued {
            break;
        }
        issued = now;
    }
}

/// A pod added during the outage waits for its identity, and gets it once SPIRE is back. The pod and its app, kept
/// for the rest of the test.
async fn a_pod_added_in_the_outage_gets_its_identity_once_spire_is_back(mesh: &Mesh) -> (TestPod, HttpServer) {
    let late = mesh.node.add_pod("late");
    let late_app = late.serve_http(APP.parse().unwrap(), "late");
    mesh.describe_pod(&late, "late", "late", "backend", &[("http", 8080)]);
    let adding = {
        let mut cni = mesh.cni().await;
        let request = aether_proto::cni::v1::AddPodRequest {
            container_id: format!("sandbox-{}", late.netns_name()),
            netns_path: late.netns_path().to_string_lossy().into(),
            interface_name: "eth0".into(),
            pod: Some(aether_proto::cni::v1::PodRef {
                namespace: NAMESPACE.into(),
                name: "late".into(),
                uid: uid(&late),
            }),
            ips: vec![late.ip().to_string()],
            ..Default::default()
        };
        tokio::spawn(async move { cni.add_pod(request).await })
    };
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(!envoy_secrets(mesh).contains_key("svid|demo/late"));

    mesh.spire.as_ref().unwrap().restore();
    let added = adding.await.unwrap().expect("AddPod after SPIRE came back");
    assert_eq!(
        added.into_inner().outcome,
        aether_proto::cni::v1::Outcome::Success as i32
    );
    let reply = eventually(&late, "http://127.0.0.1:18081/", Some(&backend_host()), |r| {
        r.status == 200
    })
    .await;
    assert_eq!(peer_uris(&xfcc(&reply)), [spiffe_id(NAMESPACE, "late")]);
    (late, late_app)
}

/// Federated trust domains travel in the validation context.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn federated_bundles_reach_envoy() {
    let mesh = Mesh::start_identity(spire_mesh_identity(), &[]).await;
    let _pods = add_pods(&mesh, &[("backend", "backend", "")]).await;
    let partner = TestCa::new("partner CA");
    mesh.spire
        .as_ref()
        .unwrap()
        .federate("partner.test", partner.cert_der.clone());
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let dump = mesh.envoy().admin_get("/config_dump?resource=dynamic_active_secrets");
        if dump.contains("partner.test") && dump.contains("aether.test") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the federated bundle did not reach Envoy: {dump}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// With `--identity none` (not for production) pods talk plaintext, and nothing
/// identity-related is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plaintext_mode_serves_no_secrets() {
    let mesh = Mesh::start_plaintext().await;
    let pods = add_pods(
        &mesh,
        &[("backend", "backend", ""), ("frontend", "frontend", "backend")],
    )
    .await;
    let reply = eventually(
        pods.get("frontend"),
        "http://127.0.0.1:18081/",
        Some(&backend_host()),
        |r| r.status == 200,
    )
    .await;
    assert!(peer_uris(&xfcc(&reply)).is_empty());
    assert!(envoy_secrets(&mesh).is_empty());
    let names: BTreeSet<String> = envoy_secrets(&mesh).into_keys().collect();
    assert!(names.is_empty());
}

/// Two pods calling the same upstream at once, over several connections each: every request presents its own
/// pod's SVID at the destination (a shared upstream connection would show the other pod's), and each pod's
/// connections leave through its own originate cluster.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_callers_of_one_upstream_each_present_their_own_svid() {
    let mesh = Mesh::start_identity(
        MeshIdentity::Builtin {
            ttl: Duration::from_secs(3600),
        },
        &[],
    )
    .await;
    let pods = add_pods(
        &mesh,
        &[
            ("backend", "backend", ""),
            ("a", "alpha", "backend"),
            ("c", "gamma", "backend"),
        ],
    )
    .await;
    let callers = [("a", "alpha"), ("c", "gamma")];
    let chains = callers.iter().flat_map(|(name, sa)| {
        let pod = pods.get(name);
        (0..4).map(move |chain| async move {
            let mut seen = Vec::new();
            for i in 0..25 {
                let reply = pod
                    .http_get(&format!("http://127.0.0.1:18081/{chain}/{i}"), Some(&backend_host()))
                    .await
                    .unwrap();
                assert_eq!(reply.status, 200, "{name}: {reply:?}");
                seen.push(peer_uris(&xfcc(&reply)));
            }
            (name, sa, seen)
        })
    });
    let mut requests = 0;
    for (name, sa, seen) in futures::future::join_all(chains).await {
        for identities in seen {
            assert_eq!(identities, [spiffe_id(NAMESPACE, sa)], "a request from {name}");
            requests += 1;
        }
    }
    assert_eq!(requests, 200);
    let stats = mesh
        .envoy()
        .admin_get("/stats?filter=^cluster\\.originate_.*upstream_cx_total$");
    let counts: Vec<u64> = stats
        .lines()
        .filter_map(|l| l.rsplit_once(": ")?.1.parse().ok())
        .collect();
    eprintln!("per-pod originate clusters' upstream connections: {stats}");
    // a's and c's own clusters both carried connections (stats of a cluster that never carried one, like
    // backend's, are created on first use).
    assert_eq!(counts.iter().filter(|c| **c > 0).count(), 2, "{stats}");
}
