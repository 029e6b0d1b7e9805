//! The DynamoDB store against a real DynamoDB-API server: `moto_server` from the
//! project venv on a free loopback port with dummy credentials, one per test.
//!
//! moto keeps its data in memory, so a killed moto loses everything. To test what a
//! real DynamoDB outage is (the service unreachable, its data intact), the fixture runs
//! moto with its request recorder on and puts a TCP proxy in front: "stop" closes the
//! proxy and kills moto; "resume" starts a new moto, replays the recording into it
//! directly (moto's own way to rebuild state) and only then reopens the proxy. The
//! in-memory case itself (moto restarted empty) is tested separately: the table is
//! recreated and revisions never go backwards.
//!
//! moto_server serves requests on parallel threads without isolating them: a cancelled
//! TransactWriteItems rolls back by restoring a copy of the whole table taken when it
//! began, erasing every write other requests made (and were told succeeded) meanwhile,
//! the revision counter included. Real DynamoDB never does that (a cancelled
//! transaction writes nothing, and transactions are serializable), but a replica that
//! loses a creation race cancels one by design, so the concurrent-creation scenario
//! lost acknowledged endpoints about one run in four. The fixture therefore runs moto
//! through [`MOTO_LAUNCHER`], which serves DynamoDB requests one at a time.

mod support;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use aether_proto::registry::v1::{Endpoint, Route, RouteBackend, RouteKind, RouteParent, RouteRule, Service};
use aether_registrar::model::ServiceKey;
use aether_registrar::records::{ConfigKind, ConfigRecord};
use aether_registrar::store::dynamodb::{DynamoConfig, DynamoStore};
use aether_registrar::store::{Contents, Feed, FeedEvent, Store, StoreError, StoreOp, StoreSettings};
use aws_sdk_dynamodb::primitives::Blob;
use aws_sdk_dynamodb::types::AttributeValue;
use futures::StreamExt;
use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use support::replicas::{self, StoreFixture};
use support::{TIMEOUT, free_port, http_get};
use tokio::task::JoinHandle;

/// Where tests find moto_server; override with `AETHER_MOTO_BIN`.
const MOTO_BIN_ENV: &str = "AETHER_MOTO_BIN";
const REGION: &str = "us-east-1";

fn moto_bin() -> PathBuf {
    let bin = std::env::var_os(MOTO_BIN_ENV)
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("AETHER_VENV").map(|v| PathBuf::from(v).join("bin/moto_server")))
        .unwrap_or_else(|| PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../.venv/bin/moto_server")));
    assert!(
        bin.exists(),
        "moto_server not found at {} (run scripts/setup.sh, or set {MOTO_BIN_ENV})",
        bin.display()
    );
    bin
}

/// Runs moto_server (`main`, same flags) with its DynamoDB requests served one at a
/// time, which gives every request the isolation DynamoDB guarantees (see the module
/// doc). Scans stay paginated, so a snapshot still interleaves with other writes page
/// by page, as on DynamoDB. `/moto-api/` stays unserialized: replaying a recording
/// sends its requests back to this server while that request is open.
const MOTO_LAUNCHER: &str = r#"
import sys, threading
import moto.server as server

lock = threading.Lock()
run_simple = server.run_simple

def serialized(app):
    def call(environ, start_response):
        if environ.get("PATH_INFO", "").startswith("/moto-api/"):
            return app(environ, start_response)
        with lock:
            body = app(environ, start_response)
            try:
                return [b"".join(body)]
            finally:
                if hasattr(body, "close"):
                    body.close()
    return call

server.run_simple = lambda host, port, app, **kw: run_simple(host, port, serialized(app), **kw)
sys.exit(server.main(sys.argv[1:]))
"#;

/// The interpreter moto_server runs on (its `#!` line), to run [`MOTO_LAUNCHER`] with.
fn moto_python() -> (PathBuf, Vec<String>) {
    let bin = moto_bin();
    let script = std::fs::read(&bin).unwrap_or_else(|e| panic!("reading {}: {e}", bin.display()));
    let first = String::from_utf8_lossy(script.split(|b| *b == b'\n').next().unwrap_or_default()).into_owned();
    let mut words = first
        .strip_prefix("#!")
        .unwrap_or_else(|| {
            panic!(
                "{} is not a Python script with a #! line (set {MOTO_BIN_ENV} to the moto_server script)",
                bin.display()
            )
        })
        .split_whitespace()
        .map(str::to_owned);
    let interpreter = words
        .next()
        .unwrap_or_else(|| panic!("{}: empty #! line", bin.display()));
    (PathBuf::from(interpreter), words.collect())
}

/// A TCP proxy the registrars reach moto through; closing it makes the store unreachable.
struct Proxy {
    addr: SocketAddr,
    target: SocketAddr,
    task: Option<JoinHandle<()>>,
}

impl Proxy {
    fn new(target: SocketAddr) -> Proxy {
        Proxy {
            addr: format!("127.0.0.1:{}", free_port()).parse().unwrap(),
            target,
            task: None,
        }
    }

    fn open(&mut self) {
        assert!(self.task.is_none(), "proxy already open");
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.set_reuseaddr(true).unwrap();
        socket.bind(self.addr).expect("binding the proxy port again");
        let listener = socket.listen(128).unwrap();
        let target = self.target;
        self.task = Some(tokio::spawn(async move {
            // Dropping the set (when this task is aborted) cuts every connection.
            let mut connections = tokio::task::JoinSet::new();
            loop {
                let Ok((mut inbound, _)) = listener.accept().await else {
                    return;
                };
                connections.spawn(async move {
                    if let Ok(mut outbound) = tokio::net::TcpStream::connect(target).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    }
                });
                while connections.try_join_next().is_some() {}
            }
        }));
    }

    fn close(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.close();
    }
}

/// moto_server in its own process group, recording every request.
struct Moto {
    child: Option<Child>,
    port: u16,
    proxy: Proxy,
    dir: tempfile::TempDir,
    pub table: String,
}

impl Moto {
    async fn start() -> Moto {
        let port = free_port();
        let mut moto = Moto {
            child: None,
            port,
            proxy: Proxy::new(format!("127.0.0.1:{port}").parse().unwrap()),
            dir: tempfile::Builder::new().prefix("aether-moto-").tempdir().unwrap(),
            table: format!("aether-test-{}", std::process::id()),
        };
        moto.spawn().await;
        moto.proxy.open();
        moto
    }

    /// What the registrars use (through the proxy).
    fn url(&self) -> String {
        format!("http://{}", self.proxy.addr)
    }

    fn direct(&self) -> SocketAddr {
        format!("127.0.0.1:{}", self.port).parse().unwrap()
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("moto.log")
    }

    fn logs(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    async fn spawn(&mut self) {
        assert!(self.child.is_none(), "moto already running");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path())
            .unwrap();
        let (python, python_args) = moto_python();
        let child = Command::new(python)
            .args(python_args)
            .args(["-c", MOTO_LAUNCHER, "-H", "127.0.0.1", "-p", &self.port.to_string()])
            .env("MOTO_ENABLE_RECORDING", "True")
            .env("MOTO_RECORDER_FILEPATH", self.dir.path().join("recording.jsonl"))
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(Stdio::from(log.try_clone().unwrap()))
            .stderr(Stdio::from(log))
            .spawn()
            .expect("spawning moto_server");
        self.child = Some(child);
        let deadline = Instant::now() + TIMEOUT;
        loop {
            if let Ok((200, _)) = http_get(self.direct(), "/moto-api/").await {
                return;
            }
            if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                panic!("moto_server exited with {status} before answering:\n{}", self.logs());
            }
            assert!(
                Instant::now() < deadline,
                "moto_server did not answer in time:\n{}",
                self.logs()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = killpg(Pid::from_raw(child.id() as i32), Signal::SIGKILL);
            let _ = child.wait();
        }
    }

    /// Kills moto; a new one starts empty (what a restarted in-memory store is).
    async fn restart_empty(&mut self) {
        self.kill();
        std::fs::remove_file(self.dir.path().join("recording.jsonl")).ok();
        self.spawn().await;
    }

    /// Rebuilds the killed moto's state from its recording, with nobody else connected.
    async fn replay(&self) {
        let mut stream = tokio::net::TcpStream::connect(self.direct()).await.unwrap();
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        // moto replays to the host this request names: moto itself, not the proxy.
        let request = format!(
            "POST /moto-api/recorder/replay-recording HTTP/1.0\r\nHost: {}\r\nContent-Length: 0\r\n\r\n",
            self.direct()
        );
        stream.write_all(request.as_bytes()).await.unwrap();
        let mut response = String::new();
        stream.read_to_string(&mut response).await.unwrap();
        assert!(
            response.starts_with("HTTP/1.1 200") || response.starts_with("HTTP/1.0 200"),
            "replaying moto's recording failed: {response}\n{}",
            self.logs()
        );
    }

    fn config(&self, sync: Duration) -> DynamoConfig {
        DynamoConfig {
            table: self.table.clone(),
            endpoint_url: Some(self.url()),
            region: Some(REGION.into()),
            sync_interval: sync,
            create_table: true,
            page_size: None,
            request_timeout: Duration::from_secs(2),
            static_credentials: Some(aws_sdk_dynamodb::config::Credentials::new(
                "test", "test", None, None, "tests",
            )),
            settings: StoreSettings {
                endpoint_ttl: Duration::from_secs(60),
            },
        }
    }
}

impl Drop for Moto {
    fn drop(&mut self) {
        self.kill();
    }
}

impl StoreFixture for Moto {
    fn name(&self) -> &'static str {
        "dynamodb (moto)"
    }

    fn registrar_args(&self) -> Vec<String> {
        vec![
            "--store=dynamodb".into(),
            format!("--dynamodb-endpoint-url={}", self.url()),
            format!("--dynamodb-region={REGION}"),
            format!("--dynamodb-table={}", self.table),
            "--dynamodb-sync-interval=1s".into(),
            "--dynamodb-timeout=2s".into(),
        ]
    }

    fn env(&self) -> Vec<(String, String)> {
        vec![
            ("AWS_ACCESS_KEY_ID".into(), "test".into()),
            ("AWS_SECRET_ACCESS_KEY".into(), "test".into()),
            // No profile files or instance metadata lookups in tests.
            ("AWS_EC2_METADATA_DISABLED".into(), "true".into()),
        ]
    }

    async fn stop(&mut self) {
        self.proxy.close();
        self.kill();
    }

    async fn resume(&mut self) {
        self.spawn().await;
        self.replay().await;
        self.proxy.open();
    }
}

// ------------------------------------------------------------- replica scenarios

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registration_on_one_replica_reaches_a_watcher_on_the_other() {
    let mut moto = Moto::start().await;
    replicas::registration_reaches_other_replica(&mut moto).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_creation_of_a_service_on_two_replicas_yields_one_vip() {
    let mut moto = Moto::start().await;
    replicas::concurrent_creation_yields_one_vip(&mut moto).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dynamodb_unreachable_then_back_loses_nothing_acknowledged() {
    let mut moto = Moto::start().await;
    replicas::store_outage_loses_nothing_acknowledged(&mut moto).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watcher_whose_replica_dies_converges_on_the_other() {
    let mut moto = Moto::start().await;
    replicas::replica_death_watcher_converges(&mut moto).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endpoints_of_an_agent_that_stops_refreshing_expire_by_timestamp() {
    let mut moto = Moto::start().await;
    replicas::ttl_expires_vanished_agents(&mut moto).await;
}

// ------------------------------------------------------------- the store itself

fn service(name: &str, vip: &str) -> Service {
    Service {
        namespace: "ns".into(),
        name: name.into(),
        vip: vip.into(),
        kubernetes: None,
        external: None,
    }
}

fn endpoint(service: &str, address: &str, node: &str) -> Arc<Endpoint> {
    Arc::new(Endpoint {
        service: service.into(),
        address: address.into(),
        node: node.into(),
        ..Default::default()
    })
}

fn key(k: &str) -> ServiceKey {
    ServiceKey::parse("service", k).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_every_page_and_splits_batches_bigger_than_one_transaction() {
    let moto = Moto::start().await;
    let mut config = moto.config(Duration::from_secs(1));
    config.page_size = Some(7);
    let store = DynamoStore::connect(config).await.unwrap();
    assert_eq!(store.max_batch_ops(), 50);
    let mut ops = Vec::new();
    for s in 0..4 {
        ops.push(StoreOp::CreateService(service(
            &format!("s{s}"),
            &format!("240.240.0.{}", s + 1),
        )));
    }
    store.commit(ops).await.unwrap();
    // 160 endpoints in one commit: two transactions' worth, plus their condition checks.
    let ops: Vec<_> = (0..160)
        .map(|i| {
            StoreOp::PutEndpoint(endpoint(
                &format!("ns/s{}", i % 4),
                &format!("10.0.{}.{}", i / 100, i % 100),
                "n1",
            ))
        })
        .collect();
    let revision = store.commit(ops).await.unwrap();
    let contents = store.load().await.unwrap();
    assert!(contents.revision >= revision);
    assert_eq!(contents.services.len(), 4);
    assert_eq!(contents.endpoints.len(), 160, "a page was lost (7 items per page)");
    assert!(contents.endpoints.iter().all(|e| e.revision == revision));
    assert!(contents.unreadable.is_empty());

    // Deleting a service takes its endpoints (found with a paginated Query) and frees its VIP.
    store
        .commit(vec![StoreOp::DeleteService {
            key: key("ns/s0"),
            vip: "240.240.0.1".into(),
        }])
        .await
        .unwrap();
    let contents = store.load().await.unwrap();
    assert_eq!(contents.services.len(), 3);
    assert_eq!(contents.endpoints.len(), 120);
    store
        .commit(vec![StoreOp::CreateService(service("reuse", "240.240.0.1"))])
        .await
        .expect("a freed VIP can be allocated again");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conditional_writes_make_one_winner_and_tell_the_loser() {
    let moto = Moto::start().await;
    let a = DynamoStore::connect(moto.config(Duration::from_secs(1))).await.unwrap();
    let b = DynamoStore::connect(moto.config(Duration::from_secs(1))).await.unwrap();

    // Both replicas create the same service at once, with the same hash-chosen VIP.
    let create = || vec![StoreOp::CreateService(service("web", "240.240.1.1"))];
    let (ra, rb) = tokio::join!(a.commit(create()), b.commit(create()));
    let (won, lost) = match (ra, rb) {
        (Ok(r), Err(e)) | (Err(e), Ok(r)) => (r, e),
        other => panic!("expected exactly one winner: {other:?}"),
    };
    assert!(won > 0);
    let StoreError::Conflict(conflict) = lost else {
        panic!("the loser gets a conflict: {lost}");
    };
    assert_eq!(
        conflict.existing,
        vec![service("web", "240.240.1.1")],
        "{}",
        conflict.detail
    );

    // Another service wanting the same VIP learns its owner; the batch leaves nothing behind.
    let err = b
        .commit(vec![
            StoreOp::PutEndpoint(endpoint("ns/web", "10.1.0.1", "n1")),
            StoreOp::CreateService(service("other", "240.240.1.1")),
        ])
        .await
        .unwrap_err();
    let StoreError::Conflict(conflict) = err else {
        panic!("expected a conflict: {err}");
    };
    assert_eq!(conflict.existing, vec![service("web", "240.240.1.1")]);
    assert!(
        conflict.detail.contains("VIP 240.240.1.1 already belongs to ns/web"),
        "{}",
        conflict.detail
    );
    let contents = a.load().await.unwrap();
    assert!(
        contents.endpoints.is_empty(),
        "the cancelled transaction wrote an endpoint"
    );

    // An endpoint of a service nobody created is refused, naming the service.
    let err = a
        .commit(vec![StoreOp::PutEndpoint(endpoint("ns/ghost", "10.1.0.2", "n1"))])
        .await
        .unwrap_err();
    let StoreError::Conflict(conflict) = err else {
        panic!("expected a conflict: {err}");
    };
    assert_eq!(conflict.missing, vec![key("ns/ghost")]);

    // Revisions grow with every commit, on either replica.
    let r1 = a
        .commit(vec![StoreOp::PutEndpoint(endpoint("ns/web", "10.1.0.3", "n1"))])
        .await
        .unwrap();
    let r2 = b
        .commit(vec![StoreOp::DeleteEndpoint {
            service: key("ns/web"),
            address: "10.1.0.3".into(),
        }])
        .await
        .unwrap();
    assert!(won < r1 && r1 < r2, "{won} {r1} {r2}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_service_update_lands_on_the_existing_service_only_and_reaches_the_feed() {
    let moto = Moto::start().await;
    let sync = Duration::from_millis(200);
    let a = DynamoStore::connect(moto.config(sync)).await.unwrap();
    let b = DynamoStore::connect(moto.config(sync)).await.unwrap();
    let feed = b.feed(b.load().await.unwrap().revision);
    support::updates::service_updates(&a, &b, feed).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_feed_brings_another_replicas_writes_with_their_revisions() {
    let moto = Moto::start().await;
    let sync = Duration::from_millis(200);
    let a = DynamoStore::connect(moto.config(sync)).await.unwrap();
    let b = DynamoStore::connect(moto.config(sync)).await.unwrap();
    let start = b.load().await.unwrap().revision;
    let mut feed = b.feed(start);
    let revision = a
        .commit(vec![
            StoreOp::CreateService(service("fed", "240.240.2.1")),
            StoreOp::PutEndpoint(endpoint("ns/fed", "10.2.0.1", "n1")),
        ])
        .await
        .unwrap();
    let deadline = Instant::now() + TIMEOUT;
    loop {
        let event = tokio::time::timeout_at(deadline.into(), feed.next())
            .await
            .expect("the feed brought nothing in time")
            .expect("feeds never end");
        if let FeedEvent::Resync(contents) = event
            && contents.endpoints.iter().any(|e| e.value.address == "10.2.0.1")
        {
            assert!(contents.revision >= revision);
            let stored = contents
                .endpoints
                .iter()
                .find(|e| e.value.address == "10.2.0.1")
                .unwrap();
            assert_eq!(stored.revision, revision);
            break;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_liveness_is_a_timestamp_that_expires() {
    let moto = Moto::start().await;
    let mut config = moto.config(Duration::from_secs(1));
    config.settings.endpoint_ttl = Duration::from_millis(1500);
    let store = DynamoStore::connect(config).await.unwrap();
    store
        .commit(vec![
            StoreOp::CreateService(service("ttl", "240.240.3.1")),
            StoreOp::PutEndpoint(endpoint("ns/ttl", "10.3.0.1", "quiet")),
            StoreOp::PutEndpoint(endpoint("ns/ttl", "10.3.0.2", "chatty")),
        ])
        .await
        .unwrap();
    assert!(store.expired_nodes().await.unwrap().is_empty());
    let deadline = Instant::now() + TIMEOUT;
    loop {
        store.refresh(vec!["chatty".into()]).await.unwrap();
        let expired = store.expired_nodes().await.unwrap();
        if !expired.is_empty() {
            assert_eq!(expired, ["quiet"]);
            break;
        }
        assert!(Instant::now() < deadline, "the quiet node never expired");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    store.commit(vec![StoreOp::ForgetNode("quiet".into())]).await.unwrap();
    assert!(store.expired_nodes().await.unwrap().is_empty());
}

/// moto is in-memory: killed and restarted, it comes back empty. The store recreates
/// the table for the writes that follow, and never hands out a revision at or below
/// one it has already seen (the counter starts again from zero in the new table).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_that_lost_its_data_is_recreated_and_revisions_never_go_back() {
    let mut moto = Moto::start().await;
    let store = DynamoStore::connect(moto.config(Duration::from_secs(1))).await.unwrap();
    let mut last = 0;
    for i in 0..5 {
        last = store
            .commit(vec![StoreOp::CreateService(service(
                &format!("old-{i}"),
                &format!("240.240.4.{}", i + 1),
            ))])
            .await
            .unwrap();
    }
    moto.restart_empty().await;
    let revision = store
        .commit(vec![
            StoreOp::CreateService(service("new", "240.240.4.100")),
            StoreOp::PutEndpoint(endpoint("ns/new", "10.4.0.1", "n1")),
        ])
        .await
        .expect("the table is recreated and the commit lands");
    assert!(
        revision > last,
        "revision {revision} reused after the reset (last {last})"
    );
    let contents = store.load().await.unwrap();
    let names: BTreeSet<_> = contents.services.iter().map(|s| s.value.name.clone()).collect();
    assert_eq!(
        names,
        BTreeSet::from(["new".to_owned()]),
        "an empty moto keeps nothing from before"
    );
    assert!(contents.revision >= revision);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_configuration_is_refused_naming_the_flag() {
    let moto = Moto::start().await;
    let mut config = moto.config(Duration::from_secs(1));
    config.table = String::new();
    let err = DynamoStore::connect(config)
        .await
        .err()
        .expect("an empty table name is refused");
    assert!(err.to_string().contains("--dynamodb-table"), "{err}");
    let mut config = moto.config(Duration::from_secs(1));
    config.create_table = false;
    config.table = "no-such-table".into();
    let err = DynamoStore::connect(config)
        .await
        .err()
        .expect("a missing table is refused");
    assert!(err.to_string().contains("--dynamodb-create-table"), "{err}");
}

/// The snapshot rule the catalog relies on: every commit *of this replica* that returns
/// a revision at or below a snapshot's revision is in that snapshot, even when its
/// commits and snapshots overlap. Another replica's commit may reserve a revision
/// before the snapshot reads the counter and land after the scan (no replica can see
/// another's in-flight transactions); it is in the next snapshot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_holds_every_commit_at_or_below_its_revision() {
    let moto = Moto::start().await;
    let a = Arc::new(DynamoStore::connect(moto.config(Duration::from_secs(1))).await.unwrap());
    let b = Arc::new(DynamoStore::connect(moto.config(Duration::from_secs(1))).await.unwrap());
    a.commit(vec![StoreOp::CreateService(service("snap", "240.240.5.1"))])
        .await
        .unwrap();
    let writer = |store: Arc<DynamoStore>, base: u8| {
        tokio::spawn(async move {
            let mut committed = Vec::new();
            for i in 0..60u8 {
                let address = format!("10.5.{base}.{i}");
                let r = store
                    .commit(vec![StoreOp::PutEndpoint(endpoint("ns/snap", &address, "n1"))])
                    .await
                    .unwrap();
                committed.push((r, address));
            }
            committed
        })
    };
    let (wa, wb) = (writer(a.clone(), 1), writer(b.clone(), 2));
    let mut snapshots = Vec::new();
    while !(wa.is_finished() && wb.is_finished()) {
        let contents = a.load().await.unwrap();
        let addresses: BTreeSet<String> = contents.endpoints.iter().map(|e| e.value.address.clone()).collect();
        snapshots.push((contents.revision, addresses));
    }
    let own = wa.await.unwrap();
    let others = wb.await.unwrap();
    assert!(snapshots.len() > 3, "the snapshots did not overlap the commits");
    for (horizon, addresses) in &snapshots {
        for (r, address) in &own {
            assert!(
                r > horizon || addresses.contains(address),
                "commit of {address} returned revision {r} but the snapshot at {horizon} lacks it"
            );
        }
    }
    let last = a.load().await.unwrap();
    let addresses: BTreeSet<String> = last.endpoints.iter().map(|e| e.value.address.clone()).collect();
    for (r, address) in own.iter().chain(&others) {
        assert!(addresses.contains(address), "{address} (revision {r}) is missing");
        assert!(*r <= last.revision);
    }
}

// ------------------------------------------------------------- routes

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_route_read_by_one_replica_is_streamed_by_the_other() {
    let mut moto = Moto::start().await;
    replicas::route_reaches_other_replica(&mut moto).await;
}

fn put_route(name: &str, parent: &str, generation: i64) -> StoreOp {
    StoreOp::PutConfig(ConfigRecord::from(Arc::new(Route {
        kind: RouteKind::Http as i32,
        namespace: "ns".into(),
        name: name.into(),
        parents: vec![RouteParent {
            service: parent.into(),
            port: 0,
        }],
        rules: vec![RouteRule {
            backends: vec![RouteBackend {
                service: parent.into(),
                port: 8080,
                weight: 1,
                ..Default::default()
            }],
            ..Default::default()
        }],
        generation,
        ..Default::default()
    })))
}

/// Each stored route as `key generation @revision`.
fn routes_of(contents: &Contents) -> Vec<String> {
    support::records_of(contents, ConfigKind::Route)
}

fn delete(kind: ConfigKind, key: &str) -> StoreOp {
    StoreOp::DeleteConfig(kind, key.into())
}

/// Reads the feed until a sync shows exactly `expected` routes; returns that snapshot.
async fn synced(feed: &mut Feed, expected: &[String]) -> Contents {
    let deadline = Instant::now() + TIMEOUT;
    loop {
        let event = tokio::time::timeout_at(deadline.into(), feed.next())
            .await
            .unwrap_or_else(|_| panic!("no sync showed the routes {expected:?} in time"))
            .expect("feeds never end");
        if let FeedEvent::Resync(contents) = event
            && routes_of(&contents) == expected
        {
            return contents;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routes_are_put_replaced_and_deleted_durably_and_each_sync_shows_them() {
    let moto = Moto::start().await;
    let sync = Duration::from_millis(200);
    let a = DynamoStore::connect(moto.config(sync)).await.unwrap();
    let b = DynamoStore::connect(moto.config(sync)).await.unwrap();
    let mut feed = b.feed(b.load().await.unwrap().revision);
    let reopened = || async { DynamoStore::connect(moto.config(sync)).await.unwrap() };

    let r1 = a
        .commit(vec![put_route("canary", "ns/web", 1), put_route("stable", "ns/web", 1)])
        .await
        .unwrap();
    let both = [format!("http/ns/canary 1 @{r1}"), format!("http/ns/stable 1 @{r1}")];
    synced(&mut feed, &both).await;
    let r2 = a.commit(vec![put_route("canary", "ns/web", 2)]).await.unwrap();
    let replaced = [format!("http/ns/canary 2 @{r2}"), format!("http/ns/stable 1 @{r1}")];
    assert_eq!(routes_of(&reopened().await.load().await.unwrap()), replaced);
    synced(&mut feed, &replaced).await;

    let r3 = a
        .commit(vec![delete(ConfigKind::Route, "http/ns/canary")])
        .await
        .unwrap();
    a.commit(vec![delete(ConfigKind::Route, "http/ns/never-stored")])
        .await
        .expect("deleting an absent route succeeds");
    assert!(r1 < r2 && r2 < r3, "{r1} {r2} {r3}");
    let left = [format!("http/ns/stable 1 @{r1}")];
    assert_eq!(routes_of(&reopened().await.load().await.unwrap()), left);
    let contents = synced(&mut feed, &left).await;
    assert!(
        contents.revision >= r3,
        "the sync that lost the route is at {}",
        contents.revision
    );
}

// ------------------------------------------------- policies and HTTP filters

fn put_policy(name: &str, generation: i64) -> StoreOp {
    StoreOp::PutConfig(Arc::new(support::policy("ns", name, generation, false)).into())
}

fn put_http_filter(name: &str, generation: i64) -> StoreOp {
    StoreOp::PutConfig(Arc::new(support::http_filter("ns", name, generation, &["ns/web"])).into())
}

/// Reads the feed until a sync shows exactly `expected` records of `kind`.
async fn synced_records(feed: &mut Feed, kind: ConfigKind, expected: &[String]) {
    let deadline = Instant::now() + TIMEOUT;
    loop {
        let event = tokio::time::timeout_at(deadline.into(), feed.next())
            .await
            .unwrap_or_else(|_| panic!("no sync showed the {kind:?} records {expected:?} in time"))
            .expect("feeds never end");
        if let FeedEvent::Resync(contents) = event
            && support::records_of(&contents, kind) == expected
        {
            return;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn policies_are_put_replaced_and_deleted_durably_and_each_sync_shows_them() {
    records_are_put_replaced_and_deleted(ConfigKind::Policy, put_policy).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_filters_are_put_replaced_and_deleted_durably_and_each_sync_shows_them() {
    records_are_put_replaced_and_deleted(ConfigKind::HttpFilter, put_http_filter).await;
}

/// Records of `kind` keyed `ns/<name>` (made by `put`) are put, replaced and deleted
/// durably, each sync shows them, and each is its own item `<tag>#<key>` / `<tag>`.
async fn records_are_put_replaced_and_deleted(kind: ConfigKind, put: fn(&str, i64) -> StoreOp) {
    let moto = Moto::start().await;
    let sync = Duration::from_millis(200);
    let a = DynamoStore::connect(moto.config(sync)).await.unwrap();
    let b = DynamoStore::connect(moto.config(sync)).await.unwrap();
    let mut feed = b.feed(b.load().await.unwrap().revision);
    let reopened = || async { DynamoStore::connect(moto.config(sync)).await.unwrap() };

    let r1 = a.commit(vec![put("deny", 1), put("allow", 1)]).await.unwrap();
    synced_records(
        &mut feed,
        kind,
        &[format!("ns/allow 1 @{r1}"), format!("ns/deny 1 @{r1}")],
    )
    .await;
    let r2 = a.commit(vec![put("deny", 2), delete(kind, "ns/allow")]).await.unwrap();
    a.commit(vec![delete(kind, "ns/never-stored")])
        .await
        .expect("deleting an absent record succeeds");
    let left = [format!("ns/deny 2 @{r2}")];
    assert_eq!(support::records_of(&reopened().await.load().await.unwrap(), kind), left);
    synced_records(&mut feed, kind, &left).await;
    a_misplaced_record_is_reported(&moto, &a, kind, &left).await;
}

/// A record under another record's key is reported, not served (it could never be
/// deleted by its key); `left` is what the store holds.
async fn a_misplaced_record_is_reported(moto: &Moto, store: &DynamoStore, kind: ConfigKind, left: &[String]) {
    let tag = kind.tag();
    let raw = raw_client(moto);
    let get = raw.get_item().table_name(&moto.table);
    let get = get.key("PK", AttributeValue::S(format!("{tag}#ns/deny")));
    let stored = get.key("SK", AttributeValue::S(tag.into())).send().await.unwrap();
    let mut misplaced = stored.item.expect("records are stored as <tag>#<key> / <tag>");
    misplaced.insert("PK".into(), AttributeValue::S(format!("{tag}#ns/elsewhere")));
    raw.put_item()
        .table_name(&moto.table)
        .set_item(Some(misplaced))
        .send()
        .await
        .unwrap();
    let contents = store.load().await.unwrap();
    assert_eq!(support::records_of(&contents, kind), left);
    let unreadable: Vec<_> = contents
        .unreadable
        .iter()
        .map(|u| (u.key.clone(), u.reason.clone()))
        .collect();
    let expected = (format!("{tag}#ns/elsewhere/{tag}"), format!("holds {tag} \"ns/deny\""));
    assert_eq!(unreadable, [expected]);
}

/// A client of moto's table that bypasses the store.
fn raw_client(moto: &Moto) -> aws_sdk_dynamodb::Client {
    let config = aws_sdk_dynamodb::Config::builder()
        .behavior_version(aws_sdk_dynamodb::config::BehaviorVersion::latest())
        .region(aws_sdk_dynamodb::config::Region::new(REGION))
        .endpoint_url(moto.url())
        .credentials_provider(aws_sdk_dynamodb::config::Credentials::new(
            "test", "test", None, None, "tests",
        ))
        .build();
    aws_sdk_dynamodb::Client::from_conf(config)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn undecodable_and_misplaced_routes_are_reported_unreadable_and_left_untouched() {
    let moto = Moto::start().await;
    let store = DynamoStore::connect(moto.config(Duration::from_millis(200)))
        .await
        .unwrap();
    let revision = store.commit(vec![put_route("good", "ns/web", 1)]).await.unwrap();
    let raw = raw_client(&moto);
    let good = raw
        .get_item()
        .table_name(&moto.table)
        .key("PK", AttributeValue::S("route#http/ns/good".into()))
        .key("SK", AttributeValue::S("route".into()))
        .send()
        .await
        .unwrap()
        .item
        .expect("routes are stored as route#<key> / route");
    // Garbage, and a readable route under another route's key.
    let garbage = AttributeValue::B(Blob::new(b"\xff\xff not a protobuf".to_vec()));
    let mut planted = Vec::new();
    for (pk, data) in [
        ("route#http/ns/bad", garbage),
        ("route#http/ns/elsewhere", good["D"].clone()),
    ] {
        let mut item = good.clone();
        item.insert("PK".into(), AttributeValue::S(pk.into()));
        item.insert("D".into(), data);
        raw.put_item()
            .table_name(&moto.table)
            .set_item(Some(item.clone()))
            .send()
            .await
            .unwrap();
        planted.push(item);
    }

    let mut feed = store.feed(0);
    let FeedEvent::Resync(contents) = tokio::time::timeout(TIMEOUT, feed.next()).await.unwrap().unwrap() else {
        panic!("the first sync is a full scan");
    };
    for contents in [store.load().await.unwrap(), contents] {
        assert_eq!(routes_of(&contents), [format!("http/ns/good 1 @{revision}")]);
        let mut unreadable: Vec<(String, String)> =
            contents.unreadable.into_iter().map(|u| (u.key, u.reason)).collect();
        unreadable.sort();
        assert_eq!(unreadable.len(), 2, "{unreadable:?}");
        assert_eq!(unreadable[0].0, "route#http/ns/bad/route");
        assert!(unreadable[0].1.contains("not a Route protobuf"), "{}", unreadable[0].1);
        assert_eq!(unreadable[1].0, "route#http/ns/elsewhere/route");
        assert!(
            unreadable[1].1.contains("holds route \"http/ns/good\""),
            "{}",
            unreadable[1].1
        );
    }
    for item in planted {
        let stored = raw
            .get_item()
            .table_name(&moto.table)
            .key("PK", item["PK"].clone())
            .key("SK", item["SK"].clone())
            .send()
            .await
            .unwrap()
            .item;
        assert_eq!(stored, Some(item), "an unreadable record was changed");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endpoints_and_routes_of_one_batch_land_together_or_not_at_all() {
    let moto = Moto::start().await;
    let store = DynamoStore::connect(moto.config(Duration::from_secs(1))).await.unwrap();
    let revision = store
        .commit(vec![
            StoreOp::CreateService(service("web", "240.240.6.1")),
            StoreOp::PutEndpoint(endpoint("ns/web", "10.6.0.1", "n1")),
            put_route("canary", "ns/web", 1),
            delete(ConfigKind::Route, "http/ns/absent"),
        ])
        .await
        .unwrap();
    let contents = store.load().await.unwrap();
    assert_eq!(routes_of(&contents), [format!("http/ns/canary 1 @{revision}")]);
    assert_eq!(
        contents.endpoints[0].revision, revision,
        "one transaction, one revision"
    );

    // An endpoint of a missing service cancels the transaction: its route does not land.
    let err = store
        .commit(vec![
            put_route("stray", "ns/ghost", 1),
            put_route("canary", "ns/web", 2),
            StoreOp::PutEndpoint(endpoint("ns/ghost", "10.6.0.2", "n1")),
        ])
        .await
        .unwrap_err();
    let StoreError::Conflict(conflict) = err else {
        panic!("expected a conflict: {err}");
    };
    assert_eq!(conflict.missing, vec![key("ns/ghost")]);
    assert_eq!(
        routes_of(&store.load().await.unwrap()),
        [format!("http/ns/canary 1 @{revision}")]
    );
}
