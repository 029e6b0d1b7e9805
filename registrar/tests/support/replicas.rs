//! Backend-generic active/active scenarios: two (or three) registrar replicas on one
//! shared store. A store's test file implements [`StoreFixture`] for its real server
//! (etcd here, moto for DynamoDB) and calls each scenario.

use std::collections::BTreeSet;
use std::future::Future;
use std::time::{Duration, Instant};

use aether_proto::registrar::v1::registrar_client::RegistrarClient;
use aether_proto::registrar::v1::{RegisterEndpointRequest, UnregisterEndpointRequest, WatchRequest};
use aether_proto::registry::v1::{Endpoint, Health};
use aether_proto::view::CatalogView;
use tonic::transport::Channel;

use super::*;

/// A store server a test can stop and start again (same data).
pub trait StoreFixture {
    fn name(&self) -> &'static str;
    /// Registrar flags that select this store (every replica gets the same).
    fn registrar_args(&self) -> Vec<String>;
    /// Environment variables every replica gets (e.g. dummy cloud credentials).
    fn env(&self) -> Vec<(String, String)> {
        Vec::new()
    }
    /// Makes the store unreachable (kill the server; data stays).
    fn stop(&mut self) -> impl Future<Output = ()>;
    /// Brings it back with the same data.
    fn resume(&mut self) -> impl Future<Output = ()>;
}

/// One registrar process on the shared store.
pub struct Replica {
    pub registrar: Registrar,
    _dir: tempfile::TempDir,
}

impl Drop for Replica {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "---- registrar {} log ----\n{}",
                self.registrar.grpc,
                self.registrar.logs()
            );
        }
    }
}

impl std::ops::Deref for Replica {
    type Target = Registrar;
    fn deref(&self) -> &Registrar {
        &self.registrar
    }
}

pub async fn start_replica(store: &impl StoreFixture, extra: &[&str]) -> Replica {
    let dir = tempfile::tempdir().unwrap();
    let mut args = store.registrar_args();
    args.extend(extra.iter().map(|s| s.to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let registrar = Registrar::start_with_env(&dir.path().join("data"), &args, &store.env()).await;
    Replica { registrar, _dir: dir }
}

pub fn node_endpoint(service: &str, address: &str, node: &str) -> Endpoint {
    let mut e = endpoint(service, address, 8080);
    e.node = node.into();
    e
}

/// The whole catalog as `client`'s replica lists it.
pub async fn listed(client: &mut RegistrarClient<Channel>, prefix: &str) -> CatalogView {
    catalog(client, |k| k.starts_with(prefix)).await.0
}

fn restrict(catalog: &CatalogView, prefix: &str) -> CatalogView {
    catalog.restricted(|k| k.starts_with(prefix))
}

/// Addresses per service of the services under `prefix`.
pub fn addresses(catalog: &CatalogView, prefix: &str) -> BTreeSet<(String, String)> {
    catalog
        .endpoints
        .iter()
        .filter(|(k, _)| k.starts_with(prefix))
        .flat_map(|(k, eps)| eps.keys().map(move |a| (k.clone(), a.clone())))
        .collect()
}

/// Reads `watcher` until its view (restricted to `prefix`) equals what `client`'s
/// replica lists, re-listing as it goes.
pub async fn converge(watcher: &mut Watcher, client: &mut RegistrarClient<Channel>, prefix: &str) -> CatalogView {
    let deadline = Instant::now() + TIMEOUT;
    loop {
        let expected = listed(client, prefix).await;
        while watcher.try_next().is_some() {}
        if restrict(&watcher.view.catalog, prefix) == expected {
            return expected;
        }
        assert!(
            Instant::now() < deadline,
            "the watcher did not converge:\nview: {:#?}\nlisted: {:#?}",
            addresses(&watcher.view.catalog, prefix),
            addresses(&expected, prefix)
        );
        let _ = tokio::time::timeout(Duration::from_millis(100), watcher.next()).await;
    }
}

/// Waits until both replicas list the same catalog under `prefix` (a store whose
/// feed is a periodic sync converges within a sync interval); returns it.
pub async fn agree(a: &mut RegistrarClient<Channel>, b: &mut RegistrarClient<Channel>, prefix: &str) -> CatalogView {
    let deadline = Instant::now() + TIMEOUT;
    loop {
        let (on_a, on_b) = (listed(a, prefix).await, listed(b, prefix).await);
        if on_a == on_b {
            return on_a;
        }
        assert!(
            Instant::now() < deadline,
            "the replicas disagree:\n{}",
            difference(&on_a, &on_b)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// What differs between two catalogs, for failure messages.
pub fn difference(a: &CatalogView, b: &CatalogView) -> String {
    let mut out = String::new();
    let keys: BTreeSet<&String> = a.services.keys().chain(b.services.keys()).collect();
    for key in keys {
        if a.services.get(key) != b.services.get(key) {
            out += &format!(
                "service {key}: A {:?} / B {:?}\n",
                a.services.get(key),
                b.services.get(key)
            );
        }
        let (ea, eb) = (a.endpoints.get(key), b.endpoints.get(key));
        if ea != eb {
            out += &format!("endpoints of {key}: A {ea:?}\n  / B {eb:?}\n");
        }
    }
    out
}

/// Waits until `f(view)` holds.
pub async fn wait_view(watcher: &mut Watcher, what: &str, f: impl Fn(&CatalogView) -> bool) {
    let deadline = Instant::now() + TIMEOUT;
    while !f(&watcher.view.catalog) {
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        let _ = tokio::time::timeout(Duration::from_millis(200), watcher.next()).await;
    }
}

/// A metric's value from a replica's /metrics (0 if absent).
pub async fn metric(admin: std::net::SocketAddr, name: &str) -> f64 {
    let (_, body) = http_get(admin, "/metrics").await.unwrap();
    body.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|v| v.strip_prefix(' ')))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0)
}

fn has(catalog: &CatalogView, service: &str, address: &str) -> bool {
    catalog.endpoints.get(service).is_some_and(|e| e.contains_key(address))
}

async fn unregister(client: &mut RegistrarClient<Channel>, service: &str, address: &str) {
    client
        .unregister_endpoint(UnregisterEndpointRequest {
            service: service.into(),
            address: address.into(),
        })
        .await
        .expect("unregister");
}

/// A registration on replica A reaches a watcher on replica B (adds, updates,
/// removals), with the VIP A allocated, and nothing else.
pub async fn registration_reaches_other_replica(store: &mut impl StoreFixture) {
    let a = start_replica(store, &[]).await;
    let b = start_replica(store, &[]).await;
    let (mut ca, mut cb) = (a.client().await, b.client().await);
    let mut watcher = Watcher::open(&mut cb, wildcard()).await.strict();
    watcher.until(0).await;
    // A's own watcher: the feed echoes A's writes back to A; they must not be
    // published twice.
    let mut own = Watcher::open(&mut ca, wildcard()).await.strict();
    own.until(0).await;

    let reply = ca
        .register_endpoint(RegisterEndpointRequest {
            endpoint: Some(node_endpoint("cross/web", "10.10.0.1", "n1")),
        })
        .await
        .unwrap()
        .into_inner();
    let vip = reply.service.unwrap().vip;
    wait_view(&mut watcher, "cross/web 10.10.0.1 on B", |c| {
        has(c, "cross/web", "10.10.0.1")
    })
    .await;
    assert_eq!(watcher.view.catalog.services["cross/web"].vip, vip, "B serves A's VIP");

    let mut draining = node_endpoint("cross/web", "10.10.0.1", "n1");
    draining.health = Health::Draining as i32;
    register(&mut ca, draining).await;
    register(&mut ca, node_endpoint("cross/web", "10.10.0.2", "n1")).await;
    wait_view(&mut watcher, "update and second endpoint on B", |c| {
        c.endpoints
            .get("cross/web")
            .is_some_and(|e| e.len() == 2 && e["10.10.0.1"].health == Health::Draining as i32)
    })
    .await;
    unregister(&mut ca, "cross/web", "10.10.0.1").await;
    let expected = converge(&mut watcher, &mut ca, "cross/").await;
    assert_eq!(
        addresses(&expected, "cross/"),
        BTreeSet::from([("cross/web".to_string(), "10.10.0.2".to_string())])
    );
    // Both replicas agree with each other, not just with the watcher.
    assert_eq!(agree(&mut ca, &mut cb, "cross/").await, expected);
    converge(&mut own, &mut ca, "cross/").await;
    // Give any echo time to arrive, then count: service added, endpoint added, updated,
    // second endpoint added, first removed — five changes, each exactly once.
    tokio::time::sleep(Duration::from_millis(500)).await;
    while own.try_next().is_some() {}
    let changes: usize = own
        .received
        .iter()
        .filter_map(|m| match &m.event {
            Some(aether_proto::registrar::v1::watch_response::Event::Delta(d)) => Some(d.changes.len()),
            _ => None,
        })
        .sum();
    assert_eq!(
        changes, 5,
        "A's watcher saw its own writes more than once: {:#?}",
        own.received
    );
}

/// Both replicas create the same new services at the same moment: each service ends
/// with one VIP, both callers were told that VIP, and both endpoints are kept.
pub async fn concurrent_creation_yields_one_vip(store: &mut impl StoreFixture) {
    let a = start_replica(store, &[]).await;
    let b = start_replica(store, &[]).await;
    let (ca, cb) = (a.client().await, b.client().await);
    let mut answers = Vec::new();
    for i in 0..20 {
        let service = format!("race/svc-{i}");
        let (mut x, mut y) = (ca.clone(), cb.clone());
        let (ea, eb) = (
            node_endpoint(&service, &format!("10.20.{i}.1"), "n1"),
            node_endpoint(&service, &format!("10.20.{i}.2"), "n2"),
        );
        let (ra, rb) = tokio::join!(
            x.register_endpoint(RegisterEndpointRequest { endpoint: Some(ea) }),
            y.register_endpoint(RegisterEndpointRequest { endpoint: Some(eb) }),
        );
        let (va, vb) = (
            ra.expect("register on A").into_inner().service.unwrap().vip,
            rb.expect("register on B").into_inner().service.unwrap().vip,
        );
        assert_eq!(va, vb, "{service}: the replicas handed out different VIPs");
        answers.push((service, va));
    }
    let mut watcher = Watcher::open(&mut cb.clone(), wildcard()).await.strict();
    watcher.until(0).await;
    converge(&mut watcher, &mut cb.clone(), "race/").await;
    let on_a = agree(&mut ca.clone(), &mut cb.clone(), "race/").await;
    let conflicts = metric(a.admin, "aether_registrar_store_conflicts_total").await
        + metric(b.admin, "aether_registrar_store_conflicts_total").await;
    println!(
        "{}: {conflicts} creation races lost and adopted out of 20",
        store.name()
    );
    assert!(
        conflicts >= 1.0,
        "no replica ever lost a race: the scenario did not test one"
    );
    let mut vips = BTreeSet::new();
    for (service, vip) in answers {
        assert_eq!(on_a.services[&service].vip, vip, "{service}");
        assert_eq!(
            on_a.endpoints[&service].len(),
            2,
            "{service}: an endpoint was lost in the race"
        );
        assert!(vips.insert(vip.clone()), "VIP {vip} given to two services");
    }
}

/// The store goes away mid-stream: writes keep being acknowledged (queued), watchers
/// keep being served, readiness and the metric say so; when the store returns every
/// acknowledged write reaches it and the other replica.
pub async fn store_outage_loses_nothing_acknowledged(store: &mut impl StoreFixture) {
    let a = start_replica(store, &[]).await;
    let b = start_replica(store, &[]).await;
    let (mut ca, mut cb) = (a.client().await, b.client().await);
    let mut on_b = Watcher::open(&mut cb, wildcard()).await.strict();
    on_b.until(0).await;
    let mut expected = BTreeSet::new();
    for i in 0..10 {
        let (service, address) = (format!("outage/old-{}", i % 3), format!("10.30.0.{i}"));
        register(&mut ca, node_endpoint(&service, &address, "n1")).await;
        expected.insert((service, address));
    }
    converge(&mut on_b, &mut ca, "outage/").await;

    store.stop().await;
    for i in 0..30 {
        let (service, address) = (format!("outage/new-{}", i % 5), format!("10.30.1.{i}"));
        // Acknowledged = this call returned OK.
        register(&mut ca, node_endpoint(&service, &address, "n1")).await;
        expected.insert((service, address));
    }
    for i in 0..3 {
        let (service, address) = (format!("outage/old-{}", i % 3), format!("10.30.0.{i}"));
        unregister(&mut ca, &service, &address).await;
        expected.remove(&(service, address));
    }
    let (status, body) = http_get(a.admin, "/ready").await.unwrap();
    assert_eq!(status, 503, "A must report not-ready while its store is away: {body}");
    let (_, metrics) = http_get(a.admin, "/metrics").await.unwrap();
    assert!(metrics.contains("aether_registrar_store_up 0"), "{metrics}");
    assert!(!metrics.contains("aether_registrar_write_behind_ops 0\n"), "{metrics}");
    // A keeps serving watchers its (queued) view.
    let mut on_a = Watcher::open(&mut ca, wildcard()).await.strict();
    on_a.until(0).await;
    assert_eq!(addresses(&on_a.view.catalog, "outage/"), expected);

    store.resume().await;
    let deadline = Instant::now() + TIMEOUT;
    while http_get(a.admin, "/ready").await.map(|r| r.0).unwrap_or(0) != 200 {
        assert!(Instant::now() < deadline, "A never became ready again:\n{}", a.logs());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (_, metrics) = http_get(a.admin, "/metrics").await.unwrap();
    assert!(metrics.contains("aether_registrar_store_up 1"), "{metrics}");
    wait_view(&mut on_b, "every acknowledged write on B", |c| {
        addresses(c, "outage/") == expected
    })
    .await;
    converge(&mut on_b, &mut cb, "outage/").await;
    // And in the store itself: a replica started now loads exactly that.
    let c = start_replica(store, &[]).await;
    assert_eq!(
        addresses(&listed(&mut c.client().await, "outage/").await, "outage/"),
        expected
    );
}

/// A replica dies under its watcher: the watcher moves to the other replica, which
/// cannot read the dead one's versions, so it reconciles what the watcher holds: a
/// snapshot that retains the view and carries only the services that changed
/// meanwhile, and the view converges with no duplicate or ghost endpoints.
pub async fn replica_death_watcher_converges(store: &mut impl StoreFixture) {
    let a = start_replica(store, &[]).await;
    let b = start_replica(store, &[]).await;
    let mut cb = b.client().await;
    let mut watcher = Watcher::open(&mut a.client().await, wildcard()).await.strict();
    watcher.until(0).await;
    for i in 0..2 {
        register(&mut cb, node_endpoint("death/still", &format!("10.41.0.{i}"), "n1")).await;
    }
    for i in 0..10 {
        register(
            &mut cb,
            node_endpoint(&format!("death/svc-{}", i % 2), &format!("10.40.0.{i}"), "n1"),
        )
        .await;
    }
    converge(&mut watcher, &mut cb, "death/").await;

    a.registrar.kill();
    for i in 0..3 {
        unregister(&mut cb, &format!("death/svc-{}", i % 2), &format!("10.40.0.{i}")).await;
    }
    for i in 10..15 {
        register(
            &mut cb,
            node_endpoint(&format!("death/svc-{}", i % 3), &format!("10.40.0.{i}"), "n1"),
        )
        .await;
    }
    let resume = WatchRequest {
        wildcard: true,
        resume_from: watcher.view.version.clone(),
        filter_id: watcher.view.filter_id,
        held: watcher.view.held(),
        ..Default::default()
    };
    let mut moved = Watcher::open(&mut cb, resume)
        .await
        .strict()
        .with_view(watcher.view.clone());
    let reconciled = moved.reconciled().await;
    let touched: BTreeSet<&str> = (reconciled.sent.iter())
        .filter_map(|key| key.strip_prefix("death/"))
        .collect();
    assert_eq!(touched, ["svc-0", "svc-1", "svc-2"].into(), "only what changed is sent");
    let expected = converge(&mut moved, &mut cb, "death/").await;
    assert_eq!(addresses(&expected, "death/").len(), 14);
    for i in 0..3 {
        assert!(
            !has(
                &moved.view.catalog,
                &format!("death/svc-{}", i % 2),
                &format!("10.40.0.{i}")
            ),
            "ghost endpoint 10.40.0.{i}"
        );
    }
}

/// An agent that stops refreshing loses its endpoints after the TTL, on every
/// replica; an agent that keeps refreshing keeps them.
pub async fn ttl_expires_vanished_agents(store: &mut impl StoreFixture) {
    let a = start_replica(store, &["--endpoint-ttl=3s"]).await;
    let b = start_replica(store, &["--endpoint-ttl=3s"]).await;
    let (mut ca, mut cb) = (a.client().await, b.client().await);
    let mut watcher = Watcher::open(&mut cb, wildcard()).await.strict();
    watcher.until(0).await;
    let alive = node_endpoint("ttl/svc", "10.50.0.1", "node-alive");
    let gone = node_endpoint("ttl/svc", "10.50.0.2", "node-gone");
    register(&mut ca, alive.clone()).await;
    register(&mut ca, gone.clone()).await;
    let registered = Instant::now();
    wait_view(&mut watcher, "both endpoints on B", |c| {
        has(c, "ttl/svc", "10.50.0.1") && has(c, "ttl/svc", "10.50.0.2")
    })
    .await;
    // The live agent refreshes (re-registers) every 500 ms, alternating replicas.
    let deadline = Instant::now() + TIMEOUT;
    let mut beat = 0;
    while has(&watcher.view.catalog, "ttl/svc", "10.50.0.2") {
        assert!(
            Instant::now() < deadline,
            "the vanished agent's endpoint was never removed"
        );
        let client = if beat % 2 == 0 { &mut ca } else { &mut cb };
        register(client, alive.clone()).await;
        beat += 1;
        let _ = tokio::time::timeout(Duration::from_millis(500), watcher.next()).await;
    }
    assert!(
        registered.elapsed() >= Duration::from_secs(2),
        "removed after {:?}, before its TTL",
        registered.elapsed()
    );
    // The live one survives several more TTLs.
    let until = Instant::now() + Duration::from_secs(7);
    while Instant::now() < until {
        register(&mut ca, alive.clone()).await;
        let _ = tokio::time::timeout(Duration::from_millis(500), watcher.next()).await;
        assert!(
            has(&watcher.view.catalog, "ttl/svc", "10.50.0.1"),
            "a refreshing agent lost its endpoint"
        );
    }
    let on_b = converge(&mut watcher, &mut cb, "ttl/").await;
    assert_eq!(agree(&mut ca, &mut cb, "ttl/").await, on_b);
}

/// With the store away, writes beyond `--write-behind-limit` queued operations are
/// refused with Unavailable (never silently dropped); the accepted ones all land.
pub async fn full_write_behind_queue_refuses(store: &mut impl StoreFixture) {
    let a = start_replica(store, &["--write-behind-limit=4"]).await;
    let mut ca = a.client().await;
    register(&mut ca, node_endpoint("full/svc", "10.60.0.1", "n1")).await;
    store.stop().await;
    let mut accepted = BTreeSet::from([("full/svc".to_string(), "10.60.0.1".to_string())]);
    let mut refused = Vec::new();
    for i in 2..10 {
        let address = format!("10.60.0.{i}");
        let reply = ca
            .register_endpoint(RegisterEndpointRequest {
                endpoint: Some(node_endpoint("full/svc", &address, "n1")),
            })
            .await;
        match reply {
            Ok(_) => {
                accepted.insert(("full/svc".to_string(), address));
            }
            Err(status) => {
                assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
                assert!(status.message().contains("write-behind queue is full"), "{status:?}");
                refused.push(address);
            }
        }
    }
    assert_eq!(accepted.len(), 5, "the first endpoint plus 4 queued operations");
    assert_eq!(refused.len(), 4);
    assert_eq!(
        metric(a.admin, "aether_registrar_write_behind_refused_total").await,
        4.0
    );
    assert_eq!(
        addresses(&listed(&mut ca, "full/").await, "full/"),
        accepted,
        "a refused write is not served"
    );
    store.resume().await;
    let deadline = Instant::now() + TIMEOUT;
    while metric(a.admin, "aether_registrar_write_behind_ops").await != 0.0
        || metric(a.admin, "aether_registrar_store_up").await != 1.0
    {
        assert!(Instant::now() < deadline, "the queue never drained:\n{}", a.logs());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let b = start_replica(store, &[]).await;
    assert_eq!(
        addresses(&listed(&mut b.client().await, "full/").await, "full/"),
        accepted
    );
}

/// An HTTPRoute on the Service `shop/cart`, in the shape a `--routes-dir` holds.
const CANARY_ROUTE: &str = r#"
apiVersion: gateway.networking.k8s.io/v1
kind: HTTPRoute
metadata: {name: canary, namespace: shop}
spec:
  parentRefs: [{group: "", kind: Service, name: cart}]
  rules:
  - matches: [{path: {type: PathPrefix, value: /items}}]
    backendRefs:
    - {name: cart-v1, port: 8080, weight: 90}
    - {name: cart-v2, port: 8080, weight: 10}
"#;

/// A route replica A reads from its `--routes-dir` is stored and streamed by replica B
/// to the watchers of its parent (and no one else's); deleting the file deletes it on B.
pub async fn route_reaches_other_replica(store: &mut impl StoreFixture) {
    const KEY: &str = "http/shop/canary";
    let b = start_replica(store, &[]).await;
    let mut cb = b.client().await;
    let mut cart = Watcher::open(&mut cb, filter(&["shop/cart"])).await.strict();
    let mut pay = Watcher::open(&mut cb, filter(&["shop/pay"])).await.strict();
    pay.until(0).await;

    let routes = tempfile::tempdir().unwrap();
    std::fs::write(routes.path().join("canary.yaml"), CANARY_ROUTE).unwrap();
    let a = start_replica(store, &["--routes-dir", routes.path().to_str().unwrap()]).await;
    wait_view(&mut cart, "B streams A's route to cart's watcher", |c| {
        c.routes.contains_key(KEY)
    })
    .await;
    let route = &cart.view.catalog.routes[KEY];
    assert_eq!(route.parents[0].service, "shop/cart");
    let weights: Vec<_> = route.rules[0]
        .backends
        .iter()
        .map(|b| (b.service.as_str(), b.weight))
        .collect();
    assert_eq!(weights, [("shop/cart-v1", 90), ("shop/cart-v2", 10)]);
    while pay.try_next().is_some() {}
    assert!(pay.view.catalog.routes.is_empty(), "pay's watcher got cart's route");

    std::fs::remove_file(routes.path().join("canary.yaml")).unwrap();
    wait_view(&mut cart, "B streams the route's deletion", |c| c.routes.is_empty()).await;
    drop(a);
}
