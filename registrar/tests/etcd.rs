//! The etcd store against a real etcd 3.4 (Debian `etcd-server`), one per test: the
//! replica scenarios shared with the other distributed stores, the key layout, the
//! feed's recovery from compacted history, route records, and the credentials: etcd
//! auth (user/password) and mTLS.

mod support;

use std::sync::Arc;
use std::time::Duration;

use aether_proto::registry::v1::{Endpoint, Route, RouteBackend, RouteKind, RouteParent, RouteRule, Service};
use aether_registrar::catalog::{Catalog, CatalogConfig, ConfigChange, Event};
use aether_registrar::config::{
    ETCD_CA_FILE_ENV, ETCD_CERT_FILE_ENV, ETCD_KEY_FILE_ENV, ETCD_PASSWORD_ENV, ETCD_USERNAME_ENV,
};
use aether_registrar::metrics::Metrics;
use aether_registrar::records::ConfigKind;
use aether_registrar::store::etcd::{EtcdConfig, EtcdStore};
use aether_registrar::store::{
    Contents, Feed, FeedChange, FeedChangeKind, FeedEvent, Revision, Store, StoreError, StoreOp, StoreSettings,
};
use aether_registrar::vip::VipAllocator;
use async_trait::async_trait;
use futures::StreamExt;
use prost::Message;
use support::etcd::{Etcd, REGISTRAR_USER};
use support::register;
use support::replicas::{self, StoreFixture, node_endpoint, start_replica};
use tokio_util::sync::CancellationToken;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registration_on_one_replica_reaches_a_watcher_on_the_other() {
    let mut etcd = Etcd::start().await;
    replicas::registration_reaches_other_replica(&mut etcd).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_creation_of_a_service_on_two_replicas_yields_one_vip() {
    let mut etcd = Etcd::start().await;
    replicas::concurrent_creation_yields_one_vip(&mut etcd).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_killed_and_restarted_loses_nothing_acknowledged() {
    let mut etcd = Etcd::start().await;
    replicas::store_outage_loses_nothing_acknowledged(&mut etcd).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watcher_whose_replica_dies_converges_on_the_other() {
    let mut etcd = Etcd::start().await;
    replicas::replica_death_watcher_converges(&mut etcd).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endpoints_of_an_agent_that_stops_refreshing_expire_with_its_lease() {
    let mut etcd = Etcd::start().await;
    replicas::ttl_expires_vanished_agents(&mut etcd).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_write_behind_queue_refuses_with_unavailable() {
    let mut etcd = Etcd::start().await;
    replicas::full_write_behind_queue_refuses(&mut etcd).await;
}

fn etcd_config(etcd: &Etcd) -> EtcdConfig {
    EtcdConfig::new(vec![etcd.endpoint()], etcd.prefix.clone(), Duration::from_secs(2))
}

fn settings() -> StoreSettings {
    StoreSettings {
        endpoint_ttl: Duration::from_secs(60),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_service_update_lands_on_the_existing_service_only_and_reaches_the_feed() {
    let etcd = Etcd::start().await;
    let a = EtcdStore::connect(etcd_config(&etcd), settings()).await.unwrap();
    let b = EtcdStore::connect(etcd_config(&etcd), settings()).await.unwrap();
    let feed = b.feed(b.load().await.unwrap().revision);
    support::updates::service_updates(&a, &b, feed).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_follow_the_documented_layout_with_protobuf_values_and_node_leases() {
    let etcd = Etcd::start().await;
    let replica = start_replica(&etcd, &[]).await;
    let mut client = replica.client().await;
    register(&mut client, node_endpoint("shop/cart", "10.0.0.1", "node-7")).await;

    let mut kv = etcd.client().await;
    let p = &etcd.prefix;
    let get = |key: String| {
        let mut kv = kv.clone();
        async move {
            kv.get(key.clone(), None)
                .await
                .unwrap()
                .take_kvs()
                .into_iter()
                .next()
                .unwrap_or_else(|| panic!("{key} is missing"))
        }
    };
    let service = Service::decode(get(format!("{p}/services/shop/cart")).await.value()).unwrap();
    assert_eq!((service.namespace.as_str(), service.name.as_str()), ("shop", "cart"));
    let vip = get(format!("{p}/vips/{}", service.vip)).await;
    assert_eq!(vip.value(), b"shop/cart");
    let endpoint_kv = get(format!("{p}/endpoints/shop/cart/10.0.0.1")).await;
    let endpoint = Endpoint::decode(endpoint_kv.value()).unwrap();
    assert_eq!(endpoint.node, "node-7");
    let node = get(format!("{p}/nodes/node-7")).await;
    let lease: i64 = std::str::from_utf8(node.value()).unwrap().parse().unwrap();
    assert_eq!(endpoint_kv.lease(), lease, "the endpoint hangs off its node's lease");
    assert_eq!(node.lease(), lease);
    let everything = kv
        .get(
            format!("{p}/"),
            Some(etcd_client::GetOptions::new().with_prefix().with_keys_only()),
        )
        .await
        .unwrap();
    assert_eq!(
        everything.kvs().len(),
        4,
        "services, vips, endpoints, nodes: nothing else"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_loser_of_a_creation_race_learns_the_winners_vip() {
    let etcd = Etcd::start().await;
    let a = EtcdStore::connect(etcd_config(&etcd), settings()).await.unwrap();
    let b = EtcdStore::connect(etcd_config(&etcd), settings()).await.unwrap();
    let service = |vip: &str| Service {
        namespace: "ns".into(),
        name: "web".into(),
        vip: vip.into(),
        kubernetes: None,
        external: None,
    };
    a.commit(vec![StoreOp::CreateService(service("240.240.0.1"))])
        .await
        .unwrap();
    let err = b
        .commit(vec![StoreOp::CreateService(service("240.240.0.2"))])
        .await
        .unwrap_err();
    let StoreError::Conflict(conflict) = err else {
        panic!("{err}")
    };
    assert_eq!(conflict.existing, vec![service("240.240.0.1")]);
    // Another service wanting a taken VIP learns who holds it.
    let other = Service {
        namespace: "ns".into(),
        name: "api".into(),
        vip: "240.240.0.1".into(),
        kubernetes: None,
        external: None,
    };
    let StoreError::Conflict(conflict) = b.commit(vec![StoreOp::CreateService(other)]).await.unwrap_err() else {
        panic!("expected a conflict")
    };
    assert_eq!(conflict.existing, vec![service("240.240.0.1")]);
    // An endpoint of a service nobody stored is refused, and nothing of its batch lands.
    let orphan = Arc::new(Endpoint {
        service: "ns/ghost".into(),
        address: "10.0.0.9".into(),
        ..Default::default()
    });
    let StoreError::Conflict(conflict) = a.commit(vec![StoreOp::PutEndpoint(orphan)]).await.unwrap_err() else {
        panic!("expected a conflict")
    };
    assert_eq!(conflict.missing.len(), 1);
    assert_eq!(conflict.missing[0].as_str(), "ns/ghost");
    let contents = a.load().await.unwrap();
    assert_eq!(contents.services.len(), 1);
    assert!(contents.endpoints.is_empty());
}

/// A store whose feed starts only when the test says so: lets history be compacted
/// between the catalog's load and its first watch.
struct GatedFeed {
    inner: Arc<EtcdStore>,
    gate: parking_lot::Mutex<Option<tokio::sync::oneshot::Receiver<()>>>,
}

#[async_trait]
impl Store for GatedFeed {
    fn kind(&self) -> &'static str {
        "etcd"
    }
    async fn load(&self) -> Result<Contents, StoreError> {
        self.inner.load().await
    }
    async fn commit(&self, ops: Vec<StoreOp>) -> Result<Revision, StoreError> {
        self.inner.commit(ops).await
    }
    fn feed(&self, after: Revision) -> Feed {
        let gate = self.gate.lock().take().expect("the feed is opened once");
        let inner = self.inner.clone();
        Box::pin(futures::stream::once(gate).flat_map(move |_| inner.feed(after)))
    }
    async fn refresh(&self, nodes: Vec<String>) -> Result<(), StoreError> {
        self.inner.refresh(nodes).await
    }
    async fn expired_nodes(&self) -> Result<Vec<String>, StoreError> {
        self.inner.expired_nodes().await
    }
    async fn ping(&self) -> Result<(), StoreError> {
        self.inner.ping().await
    }
    fn max_batch_ops(&self) -> usize {
        self.inner.max_batch_ops()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_feed_behind_compacted_history_resyncs_without_duplicates_or_ghosts() {
    let etcd = Etcd::start().await;
    let other = EtcdStore::connect(etcd_config(&etcd), settings()).await.unwrap();
    other
        .commit(vec![
            StoreOp::CreateService(svc("a", "240.240.0.10")),
            StoreOp::PutEndpoint(ep("ns/a", "10.0.0.1")),
            StoreOp::PutEndpoint(ep("ns/a", "10.0.0.2")),
            StoreOp::CreateService(svc("b", "240.240.0.11")),
            put_route("gone", "ns/a", 1),
            put_route("kept", "ns/a", 1),
            put_policy("gone", 1),
            put_policy("kept", 1),
            put_http_filter("gone", 1),
            put_http_filter("kept", 1),
        ])
        .await
        .unwrap();
    let (catalog, writer, open) = catalog_with_a_gated_feed(&etcd).await;
    let mut batches = catalog.read().subscribe();
    let stop = CancellationToken::new();
    let writer = tokio::spawn(writer.run(stop.clone()));

    // While this replica is not watching: changes, then the history is compacted away.
    change_a_b_and_c(&other).await;
    etcd.compact().await;
    open.send(()).unwrap();

    let batch = tokio::time::timeout(support::TIMEOUT, batches.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        described(&batch),
        [
            "+endpoint ns/a/10.0.0.3",
            "+endpoint ns/c/10.0.1.1",
            "+http_filter ns/kept 2",
            "+policy ns/kept 2",
            "+route http/ns/kept 2",
            "+service ns/c 240.240.0.12",
            "-endpoint ns/a/10.0.0.1",
            "-http_filter ns/gone",
            "-policy ns/gone",
            "-route http/ns/gone",
            "-service ns/b",
        ],
        "one resync batch with exactly the differences"
    );
    assert_eq!(catalog.metrics().feed_resyncs.get(), 1);
    assert_holds_the_changes_of_a_b_and_c(&catalog);
    // The watch continues after the resync.
    other
        .commit(vec![StoreOp::PutEndpoint(ep("ns/c", "10.0.1.2"))])
        .await
        .unwrap();
    let batch = tokio::time::timeout(support::TIMEOUT, batches.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(batch.changes.len(), 1);
    assert!(matches!(&batch.changes[0].event, Event::EndpointAdded(e) if e.address == "10.0.1.2"));
    stop.cancel();
    writer.await.unwrap();
}

fn svc(name: &str, vip: &str) -> Service {
    Service {
        namespace: "ns".into(),
        name: name.into(),
        vip: vip.into(),
        kubernetes: None,
        external: None,
    }
}

fn ep(service: &str, address: &str) -> Arc<Endpoint> {
    Arc::new(Endpoint {
        service: service.into(),
        address: address.into(),
        ports: vec![aether_proto::registry::v1::Port {
            name: "http".into(),
            port: 80,
            protocol: aether_proto::registry::v1::Protocol::Http as i32,
        }],
        weight: 1,
        health: aether_proto::registry::v1::Health::Healthy as i32,
        ..Default::default()
    })
}

/// Service attributes written by a replica that missed a deletion: the update of the
/// deleted service is a conflict, adopted (the service leaves memory, never recreated),
/// and the rest lands.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attributes_for_a_service_another_replica_deleted_land_on_the_rest() {
    use aether_proto::registry::v1::KubernetesService;
    use std::collections::BTreeMap;
    let etcd = Etcd::start().await;
    let other = EtcdStore::connect(etcd_config(&etcd), settings()).await.unwrap();
    (other.commit(vec![
        StoreOp::CreateService(svc("a", "240.240.0.10")),
        StoreOp::CreateService(svc("b", "240.240.0.11")),
    ]))
    .await
    .unwrap();
    let (catalog, writer, _closed) = catalog_with_a_gated_feed(&etcd).await;
    let stop = CancellationToken::new();
    let writer = tokio::spawn(writer.run(stop.clone()));
    let key = |k: &str| aether_registrar::model::ServiceKey::parse("s", k).unwrap();
    other
        .commit(vec![StoreOp::DeleteService {
            key: key("ns/a"),
            vip: "240.240.0.10".into(),
        }])
        .await
        .unwrap();

    let attributes = KubernetesService {
        cluster_ips: vec!["10.96.0.11".into()],
        traffic_distribution: 1,
        ports: Vec::new(),
    };
    let desired = BTreeMap::from([(key("ns/a"), attributes.clone()), (key("ns/b"), attributes.clone())]);
    catalog.set_service_attributes(desired).await.unwrap();
    let held: Vec<_> = catalog
        .read()
        .services()
        .map(|(k, e)| (k.to_string(), e.service.kubernetes.clone()))
        .collect();
    assert_eq!(held, [("ns/b".to_owned(), Some(attributes.clone()))]);
    let stored = other.load().await.unwrap().services;
    let stored: Vec<_> = stored.into_iter().map(|s| (s.value.name, s.value.kubernetes)).collect();
    assert_eq!(stored, [("b".to_owned(), Some(attributes))], "ns/a stays deleted");
    stop.cancel();
    writer.await.unwrap();
}

/// An external service is a service record like any other in etcd: another replica's store
/// loads it whole (VIP and declaration), and a replica that lost the creation race to it
/// adopts it and does not take its key again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn external_services_are_stored_as_services_and_seen_by_other_replicas() {
    use aether_proto::registry::v1::{External, ExternalPort, Protocol};
    use std::collections::BTreeMap;
    let etcd = Etcd::start().await;
    let other = EtcdStore::connect(etcd_config(&etcd), settings()).await.unwrap();
    let (catalog, writer, open) = catalog_with_a_gated_feed(&etcd).await;
    let _ = open.send(());
    let stop = CancellationToken::new();
    let writer = tokio::spawn(writer.run(stop.clone()));
    let declared = External {
        hosts: vec!["api.payments.example".into()],
        ports: vec![ExternalPort {
            number: 443,
            protocol: Protocol::Tls.into(),
            target_port: 443,
            ..Default::default()
        }],
        ..Default::default()
    };
    let key = aether_registrar::model::ServiceKey::parse("s", "shop/payments").unwrap();
    let applied = catalog
        .set_external_services(BTreeMap::from([(key.clone(), declared.clone())]))
        .await
        .unwrap();
    assert!(applied.refused.is_empty(), "{:?}", applied.refused);
    let stored = other.load().await.unwrap().services;
    let [service] = &stored[..] else {
        panic!("one service: {stored:?}")
    };
    assert_eq!(service.value.external.as_deref(), Some(&declared));
    assert!(service.value.vip.starts_with("240.240."), "{:?}", service.value);
    // Idempotent: the same set again writes nothing.
    let again = catalog
        .set_external_services(BTreeMap::from([(key, declared)]))
        .await
        .unwrap();
    assert_eq!(again.version.seq, applied.version.seq);
    catalog.set_external_services(BTreeMap::new()).await.unwrap();
    assert!(
        other.load().await.unwrap().services.is_empty(),
        "withdrawn: deleted from the store"
    );
    stop.cancel();
    writer.await.unwrap();
}

/// A catalog on `etcd` whose feed opens only when the returned sender fires.
async fn catalog_with_a_gated_feed(
    etcd: &Etcd,
) -> (
    Catalog,
    aether_registrar::catalog::Writer,
    tokio::sync::oneshot::Sender<()>,
) {
    let (open, gate) = tokio::sync::oneshot::channel();
    let store = GatedFeed {
        inner: Arc::new(EtcdStore::connect(etcd_config(etcd), settings()).await.unwrap()),
        gate: parking_lot::Mutex::new(Some(gate)),
    };
    let mut registry = prometheus_client::registry::Registry::default();
    let (catalog, writer) = Catalog::open(
        Arc::new(store),
        CatalogConfig {
            vips: VipAllocator::new("240.240.0.0/16".parse().unwrap()).unwrap(),
            history_changes: 1000,
            watch_buffer: 64,
            empty_service_ttl: Duration::from_secs(3600),
            endpoint_ttl: Duration::from_secs(60),
            write_behind_limit: 100,
        },
        Metrics::new(&mut registry),
    )
    .await
    .unwrap();
    (catalog, writer, open)
}

/// The catalog holds what [`change_a_b_and_c`] left.
fn assert_holds_the_changes_of_a_b_and_c(catalog: &Catalog) {
    let state = catalog.read();
    let a: Vec<String> = state
        .service("ns/a")
        .unwrap()
        .endpoints
        .keys()
        .map(|a| a.to_string())
        .collect();
    assert_eq!(a, ["10.0.0.2", "10.0.0.3"]);
    assert!(state.service("ns/b").is_none());
    assert_eq!(state.service("ns/c").unwrap().service.vip, "240.240.0.12");
    let records = state
        .configs()
        .all()
        .map(|r| format!("{} {}", r.key(), support::generation(r)));
    assert_eq!(
        records.collect::<Vec<_>>(),
        ["http/ns/kept 2", "ns/kept 2", "ns/kept 2"]
    );
}

/// From `other`, in five commits: ns/a loses 10.0.0.1 and gains 10.0.0.3, ns/b goes, ns/c comes with
/// 10.0.1.1, the route, policy and HTTP filter "gone" go, those "kept" get generation 2.
async fn change_a_b_and_c(other: &EtcdStore) {
    let key = |k: &str| aether_registrar::model::ServiceKey::parse("s", k).unwrap();
    let commits = [
        vec![StoreOp::DeleteEndpoint {
            service: key("ns/a"),
            address: "10.0.0.1".into(),
        }],
        vec![StoreOp::PutEndpoint(ep("ns/a", "10.0.0.3"))],
        vec![StoreOp::DeleteService {
            key: key("ns/b"),
            vip: "240.240.0.11".into(),
        }],
        vec![
            StoreOp::CreateService(svc("c", "240.240.0.12")),
            StoreOp::PutEndpoint(ep("ns/c", "10.0.1.1")),
        ],
        vec![
            delete(ConfigKind::Route, "http/ns/gone"),
            put_route("kept", "ns/a", 2),
            delete(ConfigKind::Policy, "ns/gone"),
            put_policy("kept", 2),
            delete(ConfigKind::HttpFilter, "ns/gone"),
            put_http_filter("kept", 2),
        ],
    ];
    for ops in commits {
        other.commit(ops).await.unwrap();
    }
}

/// A batch's changes, one sorted line each.
fn described(batch: &aether_registrar::catalog::Batch) -> Vec<String> {
    let mut seen: Vec<String> = batch
        .changes
        .iter()
        .map(|c| match &c.event {
            Event::ServiceAdded(s) => format!("+service {}/{} {}", s.namespace, s.name, s.vip),
            Event::ServiceRemoved => format!("-service {}", c.service),
            Event::EndpointAdded(e) => format!("+endpoint {}/{}", e.service, e.address),
            Event::EndpointUpdated(e) => format!("~endpoint {}/{}", e.service, e.address),
            Event::EndpointRemoved(a) => format!("-endpoint {}/{a}", c.service),
            Event::Config(ConfigChange { kind, new: Some(r), .. }) => {
                format!("+{} {} {}", kind.tag(), r.key(), support::generation(r))
            }
            Event::Config(ConfigChange { kind, new: None, .. }) => format!("-{} {}", kind.tag(), c.service),
        })
        .collect();
    seen.sort();
    seen
}

/// Runs the binary expecting it to refuse to start; returns what it said.
fn refused(args: &[&str]) -> String {
    refused_with_env(args, &[])
}

fn refused_with_env(args: &[&str], env: &[(&str, &str)]) -> String {
    let dir = tempfile::tempdir().unwrap();
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_aether-registrar"))
        .args([
            "--insecure",
            "--listen=127.0.0.1:0",
            "--admin=127.0.0.1:0",
            "--data-dir",
        ])
        .arg(dir.path())
        .args(args)
        .envs(env.iter().copied())
        .env("RUST_LOG", "debug")
        .output()
        .unwrap();
    assert!(!output.status.success(), "the registrar started with {args:?}");
    String::from_utf8_lossy(&output.stderr).into_owned()
}

#[test]
fn bad_etcd_flags_and_an_unreachable_etcd_are_refused_clearly() {
    let err = refused(&["--store=etcd", "--etcd-prefix=aether"]);
    assert!(err.contains("--etcd-prefix \"aether\": must start with '/'"), "{err}");
    let err = refused(&["--store=etcd", "--etcd-prefix=/aether/"]);
    assert!(err.contains("not end with '/'"), "{err}");
    let dead = format!("http://127.0.0.1:{}", support::free_port());
    let err = refused(&["--store=etcd", &format!("--etcd-endpoints={dead}"), "--etcd-timeout=1s"]);
    assert!(err.contains("etcd"), "{err}");
}

#[test]
fn half_given_credentials_and_bad_pem_files_are_refused_naming_the_flag() {
    // Empty environment values (a chart's unset values) mean unset: the registrar gets
    // as far as dialling the (dead) etcd.
    let dead = format!("--etcd-endpoints=http://127.0.0.1:{}", support::free_port());
    let empty = [
        ETCD_USERNAME_ENV,
        ETCD_PASSWORD_ENV,
        ETCD_CA_FILE_ENV,
        ETCD_CERT_FILE_ENV,
        ETCD_KEY_FILE_ENV,
    ]
    .map(|k| (k, ""));
    let err = refused_with_env(&["--store=etcd", &dead, "--etcd-timeout=1s"], &empty);
    assert!(err.contains("store unavailable: etcd"), "{err}");

    let err = refused_with_env(&["--store=etcd"], &[(ETCD_PASSWORD_ENV, "lonely-secret-31")]);
    assert!(
        err.contains("--etcd-password is set but --etcd-username is not"),
        "{err}"
    );
    assert!(!err.contains("lonely-secret-31"), "the password leaked: {err}");

    let dir = tempfile::tempdir().unwrap();
    for (args, expected) in bad_etcd_credentials(dir.path()) {
        let mut all = vec!["--store=etcd"];
        all.extend(args.iter().map(String::as_str));
        let err = refused(&all);
        assert!(err.contains(&expected), "{err}");
    }
}

/// Flags (after `--store=etcd`) that give half the credentials or unusable PEM files, each with the message
/// naming the flag; the files are made in `dir`.
fn bad_etcd_credentials(dir: &std::path::Path) -> Vec<(Vec<String>, String)> {
    let garbage = dir.join("garbage.pem");
    std::fs::write(&garbage, "not a certificate\n").unwrap();
    let garbage = garbage.to_str().unwrap();
    let missing = dir.join("missing.pem");
    let missing = missing.to_str().unwrap();
    // A real certificate, given where the key belongs.
    let cert = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).unwrap();
    let cert_path = dir.join("cert.pem");
    std::fs::write(&cert_path, cert.cert.pem()).unwrap();
    let cert_path = cert_path.to_str().unwrap();
    let https = "--etcd-endpoints=https://127.0.0.1:2379";
    let case = |args: &[&str], expected: &str| (args.iter().map(|a| a.to_string()).collect(), expected.to_owned());
    vec![
        case(
            &["--etcd-username=aether"],
            "--etcd-username is set but --etcd-password is not",
        ),
        case(
            &[https, &format!("--etcd-cert-file={garbage}")],
            "--etcd-cert-file is set but --etcd-key-file is not",
        ),
        case(
            &[https, &format!("--etcd-key-file={garbage}")],
            "--etcd-key-file is set but --etcd-cert-file is not",
        ),
        case(
            &[https],
            "--etcd-endpoints https://127.0.0.1:2379: https:// needs --etcd-ca-file",
        ),
        case(
            &[https, &format!("--etcd-ca-file={missing}")],
            &format!("--etcd-ca-file {missing}: cannot read it"),
        ),
        case(
            &[https, &format!("--etcd-ca-file={garbage}")],
            &format!("--etcd-ca-file {garbage}: holds no PEM certificate"),
        ),
        case(
            &[
                https,
                &format!("--etcd-ca-file={cert_path}"),
                &format!("--etcd-cert-file={cert_path}"),
                &format!("--etcd-key-file={cert_path}"),
            ],
            &format!("--etcd-key-file {cert_path}: holds no valid PEM private key"),
        ),
        case(
            &[
                "--etcd-endpoints=http://127.0.0.1:2379",
                &format!("--etcd-ca-file={cert_path}"),
            ],
            "--etcd-endpoints http://127.0.0.1:2379: --etcd-ca-file is set, so every endpoint must be https://",
        ),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_with_auth_serves_the_registrars_user_and_refuses_a_wrong_password() {
    const ROOT_PASSWORD: &str = "root-pw-7f3a91";
    const PASSWORD: &str = "registrar-pw-c41d07";
    const WRONG: &str = "wrong-pw-9e2b55";
    let mut etcd = Etcd::start().await;
    etcd.enable_auth(ROOT_PASSWORD, PASSWORD);
    // Auth is really on: anonymous requests are refused.
    let mut anonymous = etcd_client::Client::connect([etcd.endpoint()], None).await.unwrap();
    let err = anonymous.get(format!("{}/", etcd.prefix), None).await.unwrap_err();
    assert!(err.to_string().contains("user name is empty"), "{err}");

    // Two replicas as the least-privilege user: register on one, watch on the other.
    replicas::registration_reaches_other_replica(&mut etcd).await;

    let replica = start_replica(&etcd, &[]).await;
    let mut client = replica.client().await;
    register(&mut client, node_endpoint("auth/web", "10.20.0.1", "n-auth")).await;
    let stored = etcd
        .client()
        .await
        .get(format!("{}/endpoints/auth/web/10.20.0.1", etcd.prefix), None)
        .await
        .unwrap();
    assert_eq!(stored.kvs().len(), 1, "the endpoint reached etcd as {REGISTRAR_USER}");
    let logs = replica.logs();
    assert!(!logs.is_empty());
    assert!(
        !logs.contains(PASSWORD),
        "the password is in the registrar's log:\n{logs}"
    );

    // A wrong password: the registrar refuses to start and says which user was refused.
    let args = etcd.registrar_args();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let err = refused_with_env(&args, &[(ETCD_PASSWORD_ENV, WRONG)]);
    assert!(
        err.contains(&format!(
            "--etcd-username \"{REGISTRAR_USER}\": etcd refused to authenticate it (check --etcd-password)"
        )),
        "{err}"
    );
    assert!(err.contains("authentication failed"), "{err}");
    assert!(
        !err.contains(WRONG) && !err.contains(PASSWORD),
        "a password leaked: {err}"
    );

    // The user may only touch its prefix: another prefix is refused.
    let elsewhere: Vec<&str> = args
        .iter()
        .map(|a| {
            if a.starts_with("--etcd-prefix=") {
                "--etcd-prefix=/elsewhere"
            } else {
                a
            }
        })
        .collect();
    let err = refused_with_env(&elsewhere, &[(ETCD_PASSWORD_ENV, PASSWORD)]);
    assert!(err.contains("etcdserver: permission denied"), "{err}");
    assert!(!err.contains(PASSWORD), "the password leaked: {err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_over_mtls_needs_the_right_ca_and_a_client_certificate() {
    let mut etcd = Etcd::start_mtls().await;
    assert!(etcd.endpoint().starts_with("https://"));
    // CA + client certificate: two replicas register and watch over https://.
    replicas::registration_reaches_other_replica(&mut etcd).await;

    let tls = etcd.tls.as_ref().unwrap();
    let endpoint = format!("--etcd-endpoints={}", etcd.endpoint());
    let prefix = format!("--etcd-prefix={}", etcd.prefix);
    let ca = format!("--etcd-ca-file={}", tls.ca.display());
    let cert = format!("--etcd-cert-file={}", tls.client_cert.display());
    let key = format!("--etcd-key-file={}", tls.client_key.display());

    // No client certificate: etcd (--client-cert-auth) ends the handshake.
    let err = refused(&["--store=etcd", &endpoint, &prefix, "--etcd-timeout=2s", &ca]);
    assert!(err.contains("loading the catalog from the etcd store"), "{err}");
    // TLS 1.3: the client may write before etcd's alert arrives, so it sees the alert,
    // a transport error or the connection closed under its request; etcd's log says why.
    assert!(
        err.contains("received fatal alert: BadCertificate")
            || err.contains("transport error")
            || err.contains("connection closed"),
        "{err}"
    );
    let logs = etcd.logs();
    assert!(
        logs.contains("client didn't provide a certificate"),
        "etcd did not refuse for want of a client certificate:\n{logs}"
    );

    // A CA that did not sign etcd's certificate: the registrar refuses etcd.
    let other = format!("--etcd-ca-file={}", tls.other_ca.display());
    let err = refused(&[
        "--store=etcd",
        &endpoint,
        &prefix,
        "--etcd-timeout=2s",
        &other,
        &cert,
        &key,
    ]);
    assert!(err.contains("loading the catalog from the etcd store"), "{err}");
    assert!(err.contains("invalid peer certificate: UnknownIssuer"), "{err}");

    // Plaintext to the TLS port gets nowhere either.
    let plain = format!("--etcd-endpoints=http://127.0.0.1:{}", etcd.client_port);
    let err = refused(&["--store=etcd", &plain, &prefix, "--etcd-timeout=2s"]);
    assert!(
        err.contains("loading the catalog from the etcd store: store unavailable: etcd get:"),
        "{err}"
    );
    let logs = etcd.logs();
    assert!(
        logs.contains("first record does not look like a TLS handshake"),
        "etcd did not see a plaintext client:\n{logs}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_auth_token_is_renewed_without_the_registrar_noticing() {
    // etcd drops a simple token after this many idle seconds.
    let mut etcd = Etcd::start_with(&["--auth-token-ttl=1"]).await;
    etcd.enable_auth("root-pw-0b8e", "registrar-pw-5d2f");
    let a = start_replica(&etcd, &[]).await;
    let b = start_replica(&etcd, &[]).await;
    let (mut ca, mut cb) = (a.client().await, b.client().await);
    let mut watcher = support::Watcher::open(&mut cb, support::wildcard()).await;
    register(&mut ca, node_endpoint("ttl/web", "10.30.0.1", "n-ttl")).await;
    replicas::wait_view(&mut watcher, "the first endpoint on B", |c| {
        c.endpoints.get("ttl/web").is_some_and(|e| e.contains_key("10.30.0.1"))
    })
    .await;
    // Idle past the token's TTL: A's next write carries an expired token.
    tokio::time::sleep(Duration::from_secs(3)).await;
    register(&mut ca, node_endpoint("ttl/web", "10.30.0.2", "n-ttl")).await;
    replicas::wait_view(&mut watcher, "the second endpoint on B", |c| {
        c.endpoints.get("ttl/web").is_some_and(|e| e.contains_key("10.30.0.2"))
    })
    .await;
    let stored = etcd
        .client()
        .await
        .get(format!("{}/endpoints/ttl/web/10.30.0.2", etcd.prefix), None)
        .await
        .unwrap();
    assert_eq!(stored.kvs().len(), 1);
    let logs = etcd.logs();
    // etcd refused the expired token at least once: the renewal was exercised.
    assert!(
        logs.contains("invalid auth token"),
        "etcd never refused an expired token, so this test proved nothing:\n{logs}"
    );
}

// ------------------------------------------------------------- routes

fn route(name: &str, parent: &str, generation: i64) -> Route {
    Route {
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
    }
}

fn put_route(name: &str, parent: &str, generation: i64) -> StoreOp {
    StoreOp::PutConfig(Arc::new(route(name, parent, generation)).into())
}

fn put_policy(name: &str, generation: i64) -> StoreOp {
    StoreOp::PutConfig(Arc::new(support::policy("ns", name, generation, false)).into())
}

fn put_http_filter(name: &str, generation: i64) -> StoreOp {
    StoreOp::PutConfig(Arc::new(support::http_filter("ns", name, generation, &["ns/web"])).into())
}

fn delete(kind: ConfigKind, key: &str) -> StoreOp {
    StoreOp::DeleteConfig(kind, key.into())
}

/// Each stored route as `key generation @revision`.
fn routes_of(contents: &Contents) -> Vec<String> {
    support::records_of(contents, ConfigKind::Route)
}

/// A feed's change of a record as `@revision +key generation` / `@revision -key`.
fn described_record(change: FeedChange) -> String {
    match change.kind {
        FeedChangeKind::ConfigPut(r) => {
            format!("@{} +{} {}", change.revision, r.key(), support::generation(&r))
        }
        FeedChangeKind::ConfigDeleted { key, .. } => format!("@{} -{key}", change.revision),
        other => panic!("only configuration records were written, got {other:?}"),
    }
}

/// The route changes a feed delivers up to `until`, as `@revision +key generation` / `@revision -key`.
async fn route_changes(feed: &mut Feed, until: Revision) -> Vec<String> {
    let mut seen = Vec::new();
    loop {
        let event = tokio::time::timeout(support::TIMEOUT, feed.next())
            .await
            .expect("the feed brought nothing in time")
            .expect("feeds never end");
        let FeedEvent::Changes { revision, changes } = event else {
            panic!("expected changes, got {event:?}");
        };
        seen.extend(changes.into_iter().map(described_record));
        if revision >= until {
            return seen;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routes_are_put_replaced_and_deleted_durably_and_reach_another_replicas_feed() {
    let etcd = Etcd::start().await;
    let a = EtcdStore::connect(etcd_config(&etcd), settings()).await.unwrap();
    let b = EtcdStore::connect(etcd_config(&etcd), settings()).await.unwrap();
    let mut feed = b.feed(b.load().await.unwrap().revision);
    let reopened = || async { EtcdStore::connect(etcd_config(&etcd), settings()).await.unwrap() };

    let r1 = a
        .commit(vec![put_route("canary", "ns/web", 1), put_route("stable", "ns/web", 1)])
        .await
        .unwrap();
    let r2 = a.commit(vec![put_route("canary", "ns/web", 2)]).await.unwrap();
    assert_eq!(
        routes_of(&reopened().await.load().await.unwrap()),
        [format!("http/ns/canary 2 @{r2}"), format!("http/ns/stable 1 @{r1}")]
    );
    let r3 = a
        .commit(vec![delete(ConfigKind::Route, "http/ns/canary")])
        .await
        .unwrap();
    a.commit(vec![delete(ConfigKind::Route, "http/ns/never-stored")])
        .await
        .expect("deleting an absent route succeeds");
    assert_eq!(
        routes_of(&reopened().await.load().await.unwrap()),
        [format!("http/ns/stable 1 @{r1}")]
    );
    assert!(r1 < r2 && r2 < r3, "{r1} {r2} {r3}");
    assert_eq!(
        route_changes(&mut feed, r3).await,
        [
            format!("@{r1} +http/ns/canary 1"),
            format!("@{r1} +http/ns/stable 1"),
            format!("@{r2} +http/ns/canary 2"),
            format!("@{r3} -http/ns/canary"),
        ]
    );
    // Routes come from configuration, not agents: no lease ever expires them.
    let stored = etcd
        .client()
        .await
        .get(format!("{}/routes/http/ns/stable", etcd.prefix), None)
        .await
        .unwrap();
    assert_eq!(stored.kvs()[0].lease(), 0, "a route is attached to a lease");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn policies_are_put_replaced_and_deleted_durably_and_reach_another_replicas_feed() {
    records_are_put_replaced_and_deleted(ConfigKind::Policy, put_policy).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_filters_are_put_replaced_and_deleted_durably_and_reach_another_replicas_feed() {
    records_are_put_replaced_and_deleted(ConfigKind::HttpFilter, put_http_filter).await;
}

/// Records of `kind` keyed `ns/<name>` (made by `put`) are put, replaced and deleted
/// durably under `P/<plural>/`, without a lease, and reach another replica's feed.
async fn records_are_put_replaced_and_deleted(kind: ConfigKind, put: fn(&str, i64) -> StoreOp) {
    let etcd = Etcd::start().await;
    let a = EtcdStore::connect(etcd_config(&etcd), settings()).await.unwrap();
    let b = EtcdStore::connect(etcd_config(&etcd), settings()).await.unwrap();
    let mut feed = b.feed(b.load().await.unwrap().revision);
    let r1 = a.commit(vec![put("deny", 1), put("allow", 1)]).await.unwrap();
    let r2 = a.commit(vec![put("deny", 2)]).await.unwrap();
    let r3 = a.commit(vec![delete(kind, "ns/allow")]).await.unwrap();
    a.commit(vec![delete(kind, "ns/never-stored")])
        .await
        .expect("deleting an absent record succeeds");
    let reopened = EtcdStore::connect(etcd_config(&etcd), settings()).await.unwrap();
    let stored = support::records_of(&reopened.load().await.unwrap(), kind);
    assert_eq!(stored, [format!("ns/deny 2 @{r2}")]);
    let mut seen = Vec::new();
    while seen.len() < 4 {
        let event = tokio::time::timeout(support::TIMEOUT, feed.next())
            .await
            .unwrap()
            .unwrap();
        let FeedEvent::Changes { changes, .. } = event else {
            panic!("expected changes, got {event:?}");
        };
        seen.extend(changes.into_iter().map(described_record));
    }
    seen.sort();
    let mut expected = [
        format!("@{r1} +ns/allow 1"),
        format!("@{r1} +ns/deny 1"),
        format!("@{r2} +ns/deny 2"),
        format!("@{r3} -ns/allow"),
    ];
    expected.sort();
    assert_eq!(seen, expected);
    let key = format!("{}/{}/ns/deny", etcd.prefix, kind.plural());
    let kv = etcd.client().await.get(key, None).await.unwrap();
    assert_eq!(kv.kvs()[0].lease(), 0, "a {kind:?} is attached to a lease");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_undecodable_route_is_reported_unreadable_and_left_untouched() {
    let etcd = Etcd::start().await;
    let store = EtcdStore::connect(etcd_config(&etcd), settings()).await.unwrap();
    store.commit(vec![put_route("good", "ns/web", 1)]).await.unwrap();
    let mut feed = store.feed(store.load().await.unwrap().revision);
    let bad = format!("{}/routes/http/ns/bad", etcd.prefix);
    let garbage = b"\xff\xff not a protobuf".to_vec();
    let mut kv = etcd.client().await;
    kv.put(bad.clone(), garbage.clone(), None).await.unwrap();

    let contents = store.load().await.unwrap();
    assert_eq!(routes_of(&contents).len(), 1, "the good route is still read");
    assert_eq!(contents.unreadable.len(), 1);
    assert_eq!(contents.unreadable[0].key, bad);
    assert!(
        contents.unreadable[0].reason.contains("not a Route protobuf"),
        "{}",
        contents.unreadable[0].reason
    );
    let event = tokio::time::timeout(support::TIMEOUT, feed.next())
        .await
        .unwrap()
        .unwrap();
    let FeedEvent::Changes { changes, .. } = event else {
        panic!("expected changes, got {event:?}");
    };
    assert!(
        matches!(&changes[..], [FeedChange { kind: FeedChangeKind::Unreadable(r), .. }] if r.key == bad),
        "{changes:?}"
    );
    let stored = kv.get(bad, None).await.unwrap();
    assert_eq!(stored.kvs()[0].value(), garbage, "the unreadable record was changed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endpoints_and_routes_of_one_batch_land_together_or_not_at_all() {
    let etcd = Etcd::start().await;
    let store = EtcdStore::connect(etcd_config(&etcd), settings()).await.unwrap();
    let revision = store
        .commit(vec![
            StoreOp::CreateService(svc("web", "240.240.0.20")),
            StoreOp::PutEndpoint(ep("ns/web", "10.0.2.1")),
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

    // An endpoint of a missing service fails the batch: its route does not land either.
    let err = store
        .commit(vec![
            put_route("stray", "ns/ghost", 1),
            StoreOp::PutEndpoint(ep("ns/ghost", "10.0.2.2")),
        ])
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::Conflict(_)), "{err}");
    assert_eq!(routes_of(&store.load().await.unwrap()).len(), 1);

    // Route ops count against etcd's --max-txn-ops like any other.
    let mut config = etcd_config(&etcd);
    config.max_txn_ops = 8;
    let small = EtcdStore::connect(config, settings()).await.unwrap();
    let ops: Vec<StoreOp> = (0..9).map(|i| put_route(&format!("r{i}"), "ns/web", 1)).collect();
    let err = small.commit(ops).await.unwrap_err();
    assert!(err.to_string().contains("--max-txn-ops 8"), "{err}");
    assert_eq!(
        routes_of(&store.load().await.unwrap()).len(),
        1,
        "a refused batch left routes"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_route_read_by_one_replica_is_streamed_by_the_other() {
    let mut etcd = Etcd::start().await;
    replicas::route_reaches_other_replica(&mut etcd).await;
}
