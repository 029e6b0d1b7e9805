//! The `kubernetes` pod source against the shared fake API server, scripted request by
//! request: the test sees every request the watcher sends, checks its query, and answers
//! with a list, a status, or a watch stream it then feeds event by event (or cuts).

use std::time::Duration;

use aether_agent::pod_source::PodDirectory;
use aether_agent::pod_source::kubernetes;
use aether_fakes::kube::{ApiServer, Call, Calls, WatchFeed};
use hyper::StatusCode;
use serde_json::{Value, json};
use tokio::task::JoinHandle;
use tokio::time::{Instant, timeout, timeout_at};
use tokio_util::sync::CancellationToken;

const NODE: &str = "node-a";
/// Bound on every wait: kube's first backoff step is under 2s.
const WAIT: Duration = Duration::from_secs(15);

// ---------------------------------------------------------------- the requests, checked

/// The API server's requests, checked as the pod source and the agent must send them.
struct Requests(Calls);

impl Requests {
    fn of(api: &ApiServer) -> Requests {
        Requests(api.script())
    }

    async fn next(&mut self, what: &str) -> Call {
        match timeout(WAIT, self.0.next()).await {
            Ok(Some(call)) => call,
            _ => panic!("no {what} request within {WAIT:?}"),
        }
    }

    /// Expects a list of the node's pods and answers it.
    async fn expect_list(&mut self, resource_version: &str, items: Vec<Value>) {
        let call = self.expect_list_call().await;
        call.list(resource_version, items);
    }

    async fn expect_list_call(&mut self) -> Call {
        let call = self.next("list").await;
        assert_eq!(call.path(), "/api/v1/pods", "{}", call.uri());
        assert!(
            !call.query().contains_key("watch"),
            "expected a list, got {}",
            call.uri()
        );
        assert_node_selector(&call);
        call
    }

    /// Expects a watch from `resource_version` and returns the stream's controls.
    async fn expect_watch(&mut self, resource_version: &str) -> WatchFeed {
        let call = self.expect_watch_call(resource_version).await;
        call.watch()
    }

    async fn expect_watch_call(&mut self, resource_version: &str) -> Call {
        let call = self.next("watch").await;
        let query = call.query();
        assert_eq!(call.path(), "/api/v1/pods", "{}", call.uri());
        assert!(call.is_watch(), "expected a watch, got {}", call.uri());
        assert_eq!(
            query.get("resourceVersion").map(String::as_str),
            Some(resource_version),
            "{}",
            call.uri()
        );
        assert_eq!(query.get("allowWatchBookmarks").map(String::as_str), Some("true"));
        assert_node_selector(&call);
        call
    }

    /// Expects a read of the agent's Node.
    async fn expect_node_call(&mut self) -> Call {
        let call = self.next("node").await;
        assert_eq!(call.path(), format!("/api/v1/nodes/{NODE}"), "{}", call.uri());
        call
    }
}

fn assert_node_selector(call: &Call) {
    let raw = call.uri().query().unwrap_or_default();
    assert!(
        raw.contains("fieldSelector=spec.nodeName%3Dnode-a"),
        "no node field selector in {raw}"
    );
    assert_eq!(call.query()["fieldSelector"], format!("spec.nodeName={NODE}"));
}

// ---------------------------------------------------------------- helpers

/// A Pod as the API server sends it in a watch event.
fn pod(name: &str, resource_version: &str, port: i64) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {
            "name": name, "namespace": "shop", "uid": format!("uid-{name}"),
            "resourceVersion": resource_version,
            "labels": {"aether.io/managed": "true", "app": name},
            "annotations": {"config.aether.io/upstreams": "cart"},
        },
        "spec": {
            "nodeName": NODE, "serviceAccountName": "web",
            "containers": [{"name": "app", "image": "app:1",
                            "ports": [{"name": "http", "containerPort": port}]}],
        },
        "status": {"phase": "Running"},
    })
}

fn terminating(mut pod: Value, resource_version: &str) -> Value {
    pod["metadata"]["deletionTimestamp"] = json!("2025-06-01T12:00:00Z");
    pod["metadata"]["resourceVersion"] = json!(resource_version);
    pod
}

/// Waits (bounded) until `check` holds for the directory.
async fn eventually(pods: &PodDirectory, what: &str, check: impl Fn(&PodDirectory) -> bool) {
    let mut changes = pods.subscribe();
    let deadline = Instant::now() + WAIT;
    loop {
        if check(pods) {
            return;
        }
        if timeout_at(deadline, changes.changed()).await.is_err() {
            panic!("timed out after {WAIT:?} waiting until {what}");
        }
    }
}

fn has(pods: &PodDirectory, name: &str) -> bool {
    pods.get(&format!("shop/{name}")).is_some()
}

struct Running {
    pods: PodDirectory,
    shutdown: CancellationToken,
    task: JoinHandle<()>,
}

fn start(api: &ApiServer) -> Running {
    let pods = PodDirectory::default();
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(kubernetes::run(
        api.client(),
        NODE.into(),
        pods.clone(),
        shutdown.clone(),
    ));
    Running { pods, shutdown, task }
}

impl Running {
    async fn stop(self) {
        assert!(!self.task.is_finished(), "the pod source exited before shutdown");
        self.shutdown.cancel();
        timeout(WAIT, self.task)
            .await
            .expect("the pod source stops on shutdown")
            .unwrap();
    }
}

// ---------------------------------------------------------------- tests

#[tokio::test]
async fn lists_then_follows_the_watch_across_cut_and_ended_streams() {
    let api = ApiServer::start();
    let mut requests = Requests::of(&api);
    let run = start(&api);
    let pods = &run.pods;

    // Initial list: two good pods and one whose port is out of range.
    requests
        .expect_list(
            "1",
            vec![pod("a", "1", 8080), pod("b", "1", 8081), pod("bad", "1", 70000)],
        )
        .await;
    eventually(pods, "the initial list is served", |p| has(p, "a") && has(p, "b")).await;
    assert!(!has(pods, "bad"), "a pod with an out-of-range port is skipped");
    let a = pods.get("shop/a").unwrap();
    assert_eq!(a.uid, "uid-a");
    assert_eq!(a.service(), "shop/web");
    assert!(a.is_managed());
    assert_eq!(a.annotations["config.aether.io/upstreams"], "cart");
    assert_eq!(
        (a.ports[0].name.as_str(), a.ports[0].port, a.ports[0].protocol.as_str()),
        ("http", 8080, "TCP")
    );
    assert!(!a.terminating);

    // Watch from the list's resourceVersion.
    let watch = requests.expect_watch("1").await;
    watch.send("ADDED", pod("c", "2", 8082));
    eventually(pods, "ADDED c is served", |p| has(p, "c")).await;
    watch.send("MODIFIED", terminating(pod("a", "3", 8080), "3"));
    eventually(pods, "a is terminating", |p| {
        p.get("shop/a").is_some_and(|a| a.terminating)
    })
    .await;
    watch.send("DELETED", terminating(pod("a", "4", 8080), "4"));
    eventually(pods, "DELETED a is gone", |p| !has(p, "a")).await;
    assert!(has(pods, "b") && has(pods, "c"));
    watch.bookmark("10");
    // The server ends the response cleanly (timeoutSeconds): the watcher resumes from the bookmark.
    watch.end();

    let watch = requests.expect_watch("10").await;
    // What happened while away, plus a pod that does not convert.
    watch.send("DELETED", pod("b", "11", 8081));
    watch.send("ADDED", pod("bad2", "12", 0));
    watch.send("ADDED", pod("e", "13", 8083));
    eventually(pods, "the resumed watch converges", |p| has(p, "e") && !has(p, "b")).await;
    assert!(!has(pods, "bad2"), "a pod with port 0 is skipped");
    assert!(has(pods, "c"), "other pods still served");
    // The connection drops mid-stream: the watcher resumes from the last event it saw.
    watch.cut();

    let watch = requests.expect_watch("13").await;
    // What happened while away: c went, and the bad pod was fixed.
    watch.send("DELETED", pod("c", "14", 8082));
    watch.send("MODIFIED", pod("bad2", "15", 8084));
    eventually(pods, "the re-watch converges", |p| has(p, "bad2") && !has(p, "c")).await;
    assert_eq!(pods.get("shop/bad2").unwrap().ports[0].port, 8084);
    assert!(has(pods, "e") && !has(pods, "a") && !has(pods, "b"));

    run.stop().await;
}

#[tokio::test]
async fn an_expired_resource_version_in_the_watch_relists() {
    let api = ApiServer::start();
    let mut requests = Requests::of(&api);
    let run = start(&api);
    let pods = &run.pods;

    requests
        .expect_list("1", vec![pod("a", "1", 8080), pod("b", "1", 8081)])
        .await;
    eventually(pods, "the initial list is served", |p| has(p, "a") && has(p, "b")).await;

    let watch = requests.expect_watch("1").await;
    watch.expired("1");

    // A fresh list, no resourceVersion: the most recent state.
    let list = requests.expect_list_call().await;
    assert!(!list.query().contains_key("resourceVersion"), "{}", list.uri());
    // Until the re-list completes the last good set stays served.
    assert!(has(pods, "a") && has(pods, "b"));
    list.list(
        "50",
        vec![terminating(pod("a", "45", 8080), "45"), pod("c", "48", 8082)],
    );
    eventually(pods, "the re-list replaces the set", |p| has(p, "c") && !has(p, "b")).await;
    assert!(pods.get("shop/a").unwrap().terminating);

    let watch = requests.expect_watch("50").await;
    watch.send("ADDED", pod("d", "51", 8083));
    eventually(pods, "the new watch is followed", |p| has(p, "d")).await;

    run.stop().await;
}

#[tokio::test]
async fn a_410_answering_the_watch_request_relists() {
    let api = ApiServer::start();
    let mut requests = Requests::of(&api);
    let run = start(&api);
    let pods = &run.pods;

    requests.expect_list("1", vec![pod("a", "1", 8080)]).await;
    eventually(pods, "the initial list is served", |p| has(p, "a")).await;

    requests
        .expect_watch_call("1")
        .await
        .status(StatusCode::GONE, "Expired", "too old resource version: 1 (60)");

    requests.expect_list("60", vec![pod("b", "60", 8081)]).await;
    eventually(pods, "the re-list replaces the set", |p| has(p, "b") && !has(p, "a")).await;
    let watch = requests.expect_watch("60").await;
    watch.send("ADDED", pod("c", "61", 8082));
    eventually(pods, "the new watch is followed", |p| has(p, "c")).await;

    run.stop().await;
}

#[tokio::test]
async fn failing_requests_are_retried_with_backoff() {
    let api = ApiServer::start();
    let mut requests = Requests::of(&api);
    let run = start(&api);
    let pods = &run.pods;

    // No RBAC yet: the list is refused, then retried after a backoff.
    let refused = Instant::now();
    requests
        .expect_list_call()
        .await
        .status(StatusCode::FORBIDDEN, "Forbidden", "pods is forbidden");
    requests.expect_list("1", vec![pod("a", "1", 8080)]).await;
    assert!(
        refused.elapsed() >= Duration::from_millis(300),
        "retried without backoff"
    );
    eventually(pods, "the list is served once allowed", |p| has(p, "a")).await;

    // A watch that fails to start is retried from the same resourceVersion; pods stay served.
    requests
        .expect_watch_call("1")
        .await
        .status(StatusCode::INTERNAL_SERVER_ERROR, "InternalError", "etcd is down");
    assert!(has(pods, "a"));
    let watch = requests.expect_watch("1").await;
    watch.send("DELETED", pod("a", "2", 8080));
    eventually(pods, "the retried watch is followed", |p| !has(p, "a")).await;

    run.stop().await;
}

// ---------------------------------------------------------------- the agent's locality from its Node

/// `aether-agent run --pod-source kubernetes` against the fake API and a real registrar
/// (embedded store): the registrar, the agent process (killed on drop), its log file.
struct Agent {
    registrar: aether_registrar::Running,
    registrar_stop: CancellationToken,
    pki: Pki,
    child: tokio::process::Child,
    admin: std::net::SocketAddr,
    log: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

/// The control plane's mTLS for these tests: the registrar's certificate, a node CA, this
/// node's certificate from it (the agent's `--node-identity files`) and a reader's.
struct Pki {
    dir: std::path::PathBuf,
    registrar_ca: Vec<u8>,
    reader: (Vec<u8>, Vec<u8>),
}

impl Pki {
    const REGISTRAR: &str = "registrar.test";
    const READER: &str = "spiffe://cluster.local/ns/test/sa/reader";

    fn write(dir: &std::path::Path) -> Pki {
        let dir = dir.join("pki");
        std::fs::create_dir_all(&dir).unwrap();
        let ca = |name: &str| {
            let key = rcgen::KeyPair::generate().unwrap();
            let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
            params.distinguished_name.push(rcgen::DnType::CommonName, name);
            params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
            let cert = params.self_signed(&key).unwrap();
            (cert, rcgen::Issuer::new(params, key))
        };
        let leaf = |issuer: &rcgen::Issuer<'_, rcgen::KeyPair>, san: rcgen::SanType| {
            let key = rcgen::KeyPair::generate().unwrap();
            let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
            params.subject_alt_names = vec![san];
            (params.signed_by(&key, issuer).unwrap(), key)
        };
        let uri = |id: &str| rcgen::SanType::URI(id.to_owned().try_into().unwrap());
        let (registrar_ca, registrar_issuer) = ca("registrar CA");
        let (node_ca, node_issuer) = ca("node CA");
        let (server, server_key) = leaf(
            &registrar_issuer,
            rcgen::SanType::DnsName(Self::REGISTRAR.try_into().unwrap()),
        );
        let (node, node_key) = leaf(&node_issuer, uri(&format!("spiffe://cluster.local/aether/node/{NODE}")));
        let (reader, reader_key) = leaf(&node_issuer, uri(Self::READER));
        for (file, pem) in [
            ("registrar-ca.crt", registrar_ca.pem()),
            ("registrar.crt", server.pem()),
            ("registrar.key", server_key.serialize_pem()),
            ("node-ca.crt", node_ca.pem()),
            ("node.crt", node.pem()),
            ("node.key", node_key.serialize_pem()),
        ] {
            std::fs::write(dir.join(file), pem).unwrap();
        }
        Pki {
            dir,
            registrar_ca: registrar_ca.der().to_vec(),
            reader: (reader.der().to_vec(), reader_key.serialize_der()),
        }
    }

    fn path(&self, file: &str) -> String {
        self.dir.join(file).display().to_string()
    }

    fn registrar_flags(&self) -> Vec<String> {
        vec![
            format!("--tls-cert={}", self.path("registrar.crt")),
            format!("--tls-key={}", self.path("registrar.key")),
            format!("--node-ca-cert={}", self.path("node-ca.crt")),
            "--trust-domain=cluster.local".into(),
            format!("--reader-ids={}", Self::READER),
        ]
    }

    /// The agent presents a node certificate from files.
    fn agent_flags(&self) -> Vec<String> {
        vec![
            format!("--registrar-ca={}", self.path("registrar-ca.crt")),
            format!("--registrar-identity={}", Self::REGISTRAR),
            "--node-identity=files".into(),
            format!("--node-cert={}", self.path("node.crt")),
            format!("--node-key={}", self.path("node.key")),
        ]
    }

    async fn reader(
        &self,
        addr: std::net::SocketAddr,
    ) -> aether_proto::registrar::v1::registrar_client::RegistrarClient<tonic::transport::Channel> {
        use aether_common::tls;
        let slot = tls::CertSlot::new(
            tls::certified_key(
                vec![self.reader.0.clone().into()],
                rustls::pki_types::PrivateKeyDer::Pkcs8(self.reader.1.clone().into()),
            )
            .unwrap(),
        );
        let roots = tls::roots("registrar CA", vec![self.registrar_ca.clone().into()]).unwrap();
        let config = tls::client_config(roots, Self::REGISTRAR.parse().unwrap(), slot).unwrap();
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect_with_connector(tls::Connector::new(config))
            .await
            .unwrap();
        aether_proto::registrar::v1::registrar_client::RegistrarClient::new(channel)
    }
}

/// The pod the agent's state dir holds from a previous run (re-registered at start).
const RECOVERED: &str = "a";
const RECOVERED_IP: &str = "10.77.0.5";

/// The registrar in this process, on its embedded store, with the control plane's mTLS.
async fn start_registrar(dir: &std::path::Path, pki: &Pki, stop: CancellationToken) -> aether_registrar::Running {
    let mut flags = vec![
        "aether-registrar".to_owned(),
        "--listen=127.0.0.1:0".into(),
        "--admin=127.0.0.1:0".into(),
        "--store=embedded".into(),
        format!("--data-dir={}", dir.join("registrar").display()),
    ];
    flags.extend(pki.registrar_flags());
    aether_registrar::start(<aether_registrar::Config as clap::Parser>::parse_from(flags), stop)
        .await
        .expect("the registrar starts")
}

/// An agent state dir holding pod [`RECOVERED`] from a previous run.
async fn recovered_state(dir: &std::path::Path) -> std::path::PathBuf {
    // A sandbox path that exists but is no netns: capture repair fails harmlessly on it.
    let sandbox = dir.join("sandbox");
    std::fs::write(&sandbox, b"").unwrap();
    let state = dir.join("state");
    let pods = aether_agent::pod_store::PodStore::open(&state).unwrap();
    let info = kubernetes::pod_info(&serde_json::from_value(pod(RECOVERED, "1", 8080)).unwrap()).unwrap();
    std::fs::create_dir_all(&state).unwrap();
    pods.put(aether_agent::pod::LocalPod {
        container_id: "c-recovered".into(),
        listener_sockets: Default::default(),
        netns: sandbox,
        ips: vec![RECOVERED_IP.parse().unwrap()],
        info,
    })
    .await
    .unwrap();
    state
}

impl Agent {
    /// Starts the registrar and the agent. The agent's state dir holds pod
    /// [`RECOVERED`] (as the pod source describes it), so the agent registers it at
    /// start, before any CNI call: with the locality it settled on.
    async fn start(api: &ApiServer, flags: &[&str]) -> Agent {
        let dir = tempfile::tempdir().unwrap();
        let registrar_stop = CancellationToken::new();
        let pki = Pki::write(dir.path());
        let registrar = start_registrar(dir.path(), &pki, registrar_stop.clone()).await;
        let state = recovered_state(dir.path()).await;
        let kubeconfig = api.write_kubeconfig(dir.path());
        let admin = {
            let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            probe.local_addr().unwrap()
        };
        let log = dir.path().join("agent.log");
        let child = tokio::process::Command::new(env!("CARGO_BIN_EXE_aether-agent"))
            .arg("run")
            .args(["--node-name", NODE, "--pod-source", "kubernetes", "--identity", "none"])
            .arg(format!("--registrar=https://{}", registrar.grpc_addr))
            .args(pki.agent_flags())
            .arg(format!("--state-dir={}", state.display()))
            .arg(format!("--cni-socket={}", dir.path().join("cni.sock").display()))
            .arg(format!("--xds-socket={}", dir.path().join("xds.sock").display()))
            .arg(format!("--netns-pin-dir={}", dir.path().join("netns").display()))
            .arg(format!("--admin={admin}"))
            // Nothing listens there: no Envoy in these tests.
            .arg("--envoy-admin=127.0.0.1:9")
            .args(flags)
            .env("KUBECONFIG", &kubeconfig)
            .env("RUST_LOG", "info")
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .kill_on_drop(true)
            .spawn()
            .expect("aether-agent starts");
        Agent {
            registrar,
            registrar_stop,
            pki,
            child,
            admin,
            log,
            _dir: dir,
        }
    }

    fn logs(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The registrar's endpoints of `shop/web` once the recovered pod's is there.
    async fn registered(&self) -> aether_proto::registry::v1::Endpoint {
        let mut client = self.pki.reader(self.registrar.grpc_addr).await;
        let deadline = Instant::now() + WAIT;
        loop {
            let endpoints = client
                .list_endpoints(aether_proto::registrar::v1::ListEndpointsRequest {
                    service: "shop/web".into(),
                })
                .await
                .map(|r| r.into_inner().endpoints)
                .unwrap_or_default();
            if let Some(endpoint) = endpoints.into_iter().find(|e| e.address == RECOVERED_IP) {
                return endpoint;
            }
            assert!(
                Instant::now() < deadline,
                "the agent never registered {RECOVERED_IP}\nagent:\n{}",
                self.logs()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The agent answers `/ready` with 200.
    async fn assert_ready(&self) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut stream = tokio::net::TcpStream::connect(self.admin).await.unwrap();
        stream
            .write_all(b"GET /ready HTTP/1.1\r\nHost: agent\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        let mut reply = String::new();
        stream.read_to_string(&mut reply).await.unwrap();
        assert!(reply.starts_with("HTTP/1.1 200"), "{reply}\nagent:\n{}", self.logs());
    }

    async fn stop(mut self) {
        assert!(
            self.child.try_wait().unwrap().is_none(),
            "the agent exited\n{}",
            self.logs()
        );
        self.child.kill().await.unwrap();
        self.registrar_stop.cancel();
        timeout(WAIT, self.registrar.wait())
            .await
            .expect("the registrar stops")
            .expect("a clean stop");
    }
}

/// Serves the agent's pod list and opens its watch (the agent's pod source starting).
async fn serve_pods(requests: &mut Requests) -> WatchFeed {
    requests.expect_list("1", vec![pod(RECOVERED, "1", 8080)]).await;
    requests.expect_watch("1").await
}

fn node(labels: Value) -> Value {
    json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE, "resourceVersion": "7", "labels": labels}})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_registers_its_pods_with_its_nodes_region_and_zone() {
    let api = ApiServer::start();
    let mut requests = Requests::of(&api);
    let agent = Agent::start(&api, &[]).await;

    requests.expect_node_call().await.object(node(json!({
        "kubernetes.io/hostname": NODE,
        "topology.kubernetes.io/region": "eu-west-1",
        "topology.kubernetes.io/zone": "eu-west-1b",
    })));
    let _watch = serve_pods(&mut requests).await;

    let endpoint = agent.registered().await;
    let locality = endpoint.locality.clone().expect("a locality");
    assert_eq!(
        (
            locality.region.as_str(),
            locality.zone.as_str(),
            locality.subzone.as_str()
        ),
        ("eu-west-1", "eu-west-1b", ""),
        "{endpoint:?}"
    );
    assert_eq!(endpoint.node, NODE);
    assert!(agent.logs().contains("locality from the node's topology labels"));
    agent.assert_ready().await;
    agent.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explicit_locality_flags_win_over_the_nodes_labels() {
    let api = ApiServer::start();
    let mut requests = Requests::of(&api);
    let agent = Agent::start(&api, &["--zone", "rack-9", "--subzone", "row-2"]).await;

    // The region is not given: it still comes from the Node; the zone flag wins.
    requests.expect_node_call().await.object(node(json!({
        "topology.kubernetes.io/region": "eu-west-1",
        "topology.kubernetes.io/zone": "eu-west-1b",
    })));
    let _watch = serve_pods(&mut requests).await;

    let locality = agent.registered().await.locality.expect("a locality");
    assert_eq!(
        (
            locality.region.as_str(),
            locality.zone.as_str(),
            locality.subzone.as_str()
        ),
        ("eu-west-1", "rack-9", "row-2")
    );
    agent.stop().await;

    // Region and zone both given: the Node is not read at all (the first request is the pod list).
    let api = ApiServer::start();
    let mut requests = Requests::of(&api);
    let agent = Agent::start(&api, &["--region", "r", "--zone", "z"]).await;
    let _watch = serve_pods(&mut requests).await;
    let locality = agent.registered().await.locality.expect("a locality");
    assert_eq!((locality.region.as_str(), locality.zone.as_str()), ("r", "z"));
    agent.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_its_node_the_agent_warns_once_and_registers_without_a_locality() {
    let api = ApiServer::start();
    let mut requests = Requests::of(&api);
    let agent = Agent::start(&api, &[]).await;

    // A transient failure is retried (after a pause); a 404 is final. (A 500: kube's
    // own retry layer only covers 429/503/504.)
    let failed = Instant::now();
    requests
        .expect_node_call()
        .await
        .status(StatusCode::INTERNAL_SERVER_ERROR, "InternalError", "etcd is down");
    requests.expect_node_call().await.status(
        StatusCode::NOT_FOUND,
        "NotFound",
        &format!("nodes \"{NODE}\" not found"),
    );
    assert!(
        failed.elapsed() >= Duration::from_millis(300),
        "retried without a pause"
    );
    // Start-up goes on: the next request is the pod source's list, not another Node read.
    let _watch = serve_pods(&mut requests).await;

    let endpoint = agent.registered().await;
    assert_eq!(
        endpoint.locality.unwrap_or_default(),
        aether_proto::registry::v1::Locality::default(),
        "{:?}",
        endpoint.address
    );
    agent.assert_ready().await;
    let logs = agent.logs();
    assert_eq!(
        logs.matches("the node's locality is unknown").count(),
        1,
        "one warning expected:\n{logs}"
    );
    assert!(logs.contains("not found"), "the warning says why:\n{logs}");
    agent.stop().await;
}
