//! The registrar binary over loopback gRPC: the catalog API, the Watch stream and its
//! resume and resync rules, durability across restarts, and every bad-input answer.

mod support;

use std::collections::BTreeSet;
use std::net::IpAddr;

use aether_proto::registrar::v1::registrar_client::RegistrarClient;
use aether_proto::registrar::v1::{
    ListEndpointsRequest, ListServicesRequest, RegisterEndpointRequest, SnapshotReason, UnregisterEndpointRequest,
    Version, WatchRequest, change, watch_response,
};
use aether_proto::registry::v1::{Endpoint, Health, Port, Protocol};
use support::*;
use tonic::Code;
use tonic::transport::Channel;

fn snapshot_reason(message: &aether_proto::registrar::v1::WatchResponse) -> Option<SnapshotReason> {
    match &message.event {
        Some(watch_response::Event::Snapshot(s)) if s.reset => s.reason.try_into().ok(),
        _ => None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn register_list_and_watch_a_filtered_catalog() {
    let dir = tempfile::tempdir().unwrap();
    let registrar = Registrar::start(dir.path(), &[]).await;
    let mut client = registrar.client().await;
    let seq = a_catalog_registered_is_listed_with_a_vip_per_service(&mut client).await;

    // A watcher of shop/cart gets exactly cart's part of the catalog...
    let mut watcher = Watcher::open(&mut client, filter(&["shop/cart"])).await;
    let first = watcher.next().await;
    assert_eq!(snapshot_reason(&first), Some(SnapshotReason::Initial));
    watcher.until(seq).await;
    let (expected, _) = catalog(&mut client, |k| k == "shop/cart").await;
    assert_eq!(watcher.view.catalog, expected);

    // ...and then only cart's changes, each batch versioned.
    register(&mut client, endpoint("shop/pay", "10.0.0.4", 9090)).await;
    let mut updated = endpoint("shop/cart", "10.0.0.1", 8080);
    updated.health = Health::Draining as i32;
    let version = register(&mut client, updated).await;
    let message = watcher.next().await;
    let Some(watch_response::Event::Delta(delta)) = message.event else {
        panic!("expected a delta, got {message:?}");
    };
    assert_eq!(delta.version.as_ref(), Some(&version));
    assert_eq!(delta.changes.len(), 1);
    let Some(change::Change::EndpointUpdated(e)) = &delta.changes[0].change else {
        panic!("expected an endpoint update, got {:?}", delta.changes[0]);
    };
    assert_eq!((e.address.as_str(), e.health), ("10.0.0.1", Health::Draining as i32));

    // Unregistering is idempotent and reported.
    let unregister = || UnregisterEndpointRequest {
        service: "shop/cart".into(),
        address: "10.0.0.2".into(),
    };
    let gone = client.unregister_endpoint(unregister()).await.unwrap().into_inner();
    assert!(gone.existed);
    let again = client.unregister_endpoint(unregister()).await.unwrap().into_inner();
    assert!(!again.existed);
    assert_eq!(again.version, gone.version, "a no-op does not advance the version");
    watcher.until(gone.version.unwrap().seq).await;
    let (expected, _) = catalog(&mut client, |k| k == "shop/cart").await;
    assert_eq!(watcher.view.catalog, expected);
}

/// shop/cart (two endpoints) and shop/pay registered: each service has its own VIP from the mesh range, and its
/// endpoints list with the defaults filled in. The catalog's version then.
async fn a_catalog_registered_is_listed_with_a_vip_per_service(client: &mut RegistrarClient<Channel>) -> u64 {
    let reply = client
        .register_endpoint(RegisterEndpointRequest {
            endpoint: Some(endpoint("shop/cart", "10.0.0.1", 8080)),
        })
        .await
        .unwrap()
        .into_inner();
    let cart = reply.service.unwrap();
    let vip: IpAddr = cart.vip.parse().unwrap();
    assert!(
        "240.240.0.0/16".parse::<ipnet::IpNet>().unwrap().contains(&vip),
        "{vip}"
    );
    register(client, endpoint("shop/cart", "10.0.0.2", 8080)).await;
    register(client, endpoint("shop/pay", "10.0.0.3", 9090)).await;

    let services = client.list_services(ListServicesRequest {}).await.unwrap().into_inner();
    let keys: Vec<_> = services
        .services
        .iter()
        .map(|s| format!("{}/{}", s.namespace, s.name))
        .collect();
    assert_eq!(keys, ["shop/cart", "shop/pay"]);
    assert_ne!(services.services[0].vip, services.services[1].vip);
    let endpoints = client
        .list_endpoints(ListEndpointsRequest {
            service: "shop/cart".into(),
        })
        .await
        .unwrap()
        .into_inner();
    let addresses: Vec<_> = endpoints.endpoints.iter().map(|e| e.address.as_str()).collect();
    assert_eq!(addresses, ["10.0.0.1", "10.0.0.2"]);
    assert_eq!(endpoints.endpoints[0].weight, 1, "weight 0 is stored as the default 1");
    assert_eq!(endpoints.endpoints[0].health, Health::Healthy as i32);
    services.version.unwrap().seq
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_filter_changes_on_a_live_stream() {
    let dir = tempfile::tempdir().unwrap();
    let registrar = Registrar::start(dir.path(), &[]).await;
    let mut client = registrar.client().await;
    for (service, address) in [("a/one", "10.0.1.1"), ("a/two", "10.0.1.2"), ("b/three", "10.0.1.3")] {
        register(&mut client, endpoint(service, address, 80)).await;
    }

    // Empty filter: nothing.
    let mut watcher = Watcher::open(&mut client, WatchRequest::default()).await;
    watcher.next().await;
    watcher.next().await;
    assert!(watcher.view.catalog.services.is_empty());

    // Widen: the services come in with their endpoints, in one delta.
    watcher.send(filter(&["a/one", "b/three", "c/not-yet"])).await;
    let message = watcher.next().await;
    assert!(
        matches!(message.event, Some(watch_response::Event::Delta(_))),
        "{message:?}"
    );
    let keys: BTreeSet<_> = watcher.view.catalog.services.keys().cloned().collect();
    assert_eq!(keys, BTreeSet::from(["a/one".to_string(), "b/three".to_string()]));
    assert_eq!(watcher.view.catalog.all_endpoints().count(), 2);

    // A filtered-in service that appears later arrives as it is created.
    let version = register(&mut client, endpoint("c/not-yet", "10.0.1.4", 80)).await;
    watcher.until(version.seq).await;
    assert!(watcher.view.catalog.services.contains_key("c/not-yet"));

    // Narrow: dropped services are removed.
    watcher.send(filter(&["b/three"])).await;
    watcher.next().await;
    let keys: Vec<_> = watcher.view.catalog.services.keys().cloned().collect();
    assert_eq!(keys, ["b/three"]);

    // Wildcard, and back.
    watcher.send(wildcard()).await;
    watcher.next().await;
    let (everything, _) = catalog(&mut client, |_| true).await;
    assert_eq!(watcher.view.catalog, everything);
    watcher.send(filter(&["a/two"])).await;
    watcher.next().await;
    let (two, _) = catalog(&mut client, |k| k == "a/two").await;
    assert_eq!(watcher.view.catalog, two);

    // Changes to services the filter dropped no longer arrive; others still do.
    register(&mut client, endpoint("b/three", "10.0.1.9", 80)).await;
    let version = register(&mut client, endpoint("a/two", "10.0.1.8", 80)).await;
    let message = watcher.next().await;
    let Some(watch_response::Event::Delta(delta)) = message.event else {
        panic!("{message:?}")
    };
    assert_eq!(delta.version, Some(version));
    assert!(delta.changes.iter().all(|c| matches!(&c.change,
        Some(change::Change::EndpointAdded(e)) if e.service == "a/two")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reconnecting_watcher_resumes_with_only_the_missed_deltas() {
    let dir = tempfile::tempdir().unwrap();
    let registrar = Registrar::start(dir.path(), &[]).await;
    let mut client = registrar.client().await;
    let v = register(&mut client, endpoint("ns/a", "10.0.2.1", 80)).await;

    let mut watcher = Watcher::open(&mut client, filter(&["ns/a"])).await;
    watcher.until(v.seq).await;
    let view = watcher.view.clone();
    drop(watcher);

    register(&mut client, endpoint("ns/a", "10.0.2.2", 80)).await;
    register(&mut client, endpoint("ns/other", "10.0.2.3", 80)).await;
    let last = register(&mut client, endpoint("ns/a", "10.0.2.4", 80)).await;

    let mut resumed = Watcher::open(
        &mut client,
        WatchRequest {
            resume_from: view.version.clone(),
            ..filter(&["ns/a"])
        },
    )
    .await;
    resumed.view = view;
    resumed.until(last.seq).await;
    assert!(
        resumed
            .received
            .iter()
            .all(|m| matches!(m.event, Some(watch_response::Event::Delta(_)))),
        "a resumable watcher got a snapshot: {:?}",
        resumed.received
    );
    let added: Vec<_> = resumed
        .received
        .iter()
        .flat_map(|m| match &m.event {
            Some(watch_response::Event::Delta(d)) => d.changes.clone(),
            _ => vec![],
        })
        .map(|c| match c.change {
            Some(change::Change::EndpointAdded(e)) => e.address,
            other => panic!("unexpected change {other:?}"),
        })
        .collect();
    assert_eq!(added, ["10.0.2.2", "10.0.2.4"]);
    let (expected, _) = catalog(&mut client, |k| k == "ns/a").await;
    assert_eq!(resumed.view.catalog, expected);
}

/// A resumed Watch sends what a live one does: a Delta for each change in its filter,
/// nothing for the changes outside it; both then tell the latest version with one
/// progress Delta (no changes) within the progress interval.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resumed_watch_sends_no_empty_delta_for_changes_outside_its_filter() {
    use aether_registrar::watch::PROGRESS_INTERVAL;
    use std::time::Duration;

    let dir = tempfile::tempdir().unwrap();
    let registrar = Registrar::start(dir.path(), &[]).await;
    let mut client = registrar.client().await;
    let v = register(&mut client, endpoint("ns/a", "10.0.7.1", 80)).await;
    let mut live = Watcher::open(&mut client, filter(&["ns/a"])).await;
    live.until(v.seq).await;
    let view = live.view.clone();

    let inside = register(&mut client, endpoint("ns/a", "10.0.7.2", 80)).await;
    let mut last = inside.clone();
    for i in 3..6 {
        last = register(&mut client, endpoint("ns/other", &format!("10.0.7.{i}"), 80)).await;
    }
    let mut resumed = Watcher::open(
        &mut client,
        WatchRequest {
            resume_from: view.version.clone(),
            ..filter(&["ns/a"])
        },
    )
    .await
    .with_view(view);

    for (path, watcher) in [("live", &mut live), ("resumed", &mut resumed)] {
        let message = watcher.next().await;
        let Some(watch_response::Event::Delta(delta)) = &message.event else {
            panic!("{path}: expected a Delta, got {message:?}");
        };
        assert_eq!(delta.version.as_ref(), Some(&inside), "{path}");
        assert_eq!(delta.changes.len(), 1, "{path}: {delta:?}");
        // The changes outside the filter: nothing, not an empty Delta each (nor one at once).
        if let Ok(message) = tokio::time::timeout(Duration::from_secs(1), watcher.next()).await {
            panic!("{path}: sent {message:?} for changes outside its filter");
        }
    }
    // Each stream then moves its client to the latest version with one progress Delta.
    for (path, watcher) in [("live", &mut live), ("resumed", &mut resumed)] {
        let message = tokio::time::timeout(PROGRESS_INTERVAL + Duration::from_secs(2), watcher.next())
            .await
            .unwrap_or_else(|_| panic!("{path}: no progress within {PROGRESS_INTERVAL:?}"));
        let Some(watch_response::Event::Delta(delta)) = &message.event else {
            panic!("{path}: expected a progress Delta, got {message:?}");
        };
        assert!(delta.changes.is_empty(), "{path}: {delta:?}");
        assert_eq!(delta.version.as_ref(), Some(&last), "{path}");
        assert_eq!(watcher.view.version.as_ref(), Some(&last), "{path}");
    }
    let (expected, _) = catalog(&mut client, |k| k == "ns/a").await;
    assert_eq!(live.view.catalog, expected);
    assert_eq!(resumed.view.catalog, expected);
}

/// A watcher coming from another replica (a version this one never issued) is sent
/// what its holdings lack or hold wrongly, in a snapshot that retains the rest of its
/// view, whatever filter the view was built under; services it holds exactly are not
/// sent again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watcher_from_another_replica_is_reconciled_from_its_holdings() {
    let dir = tempfile::tempdir().unwrap();
    let registrar = Registrar::start(dir.path(), &[]).await;
    let mut client = registrar.client().await;
    for (service, address) in [
        ("ns/same", "10.0.9.1"),
        ("ns/same", "10.0.9.2"),
        ("ns/stale", "10.0.9.3"),
    ] {
        register(&mut client, endpoint(service, address, 80)).await;
    }
    let v = register(&mut client, endpoint("ns/dropped", "10.0.9.4", 80)).await;
    let mut watcher = Watcher::open(&mut client, filter(&["ns/same", "ns/stale", "ns/dropped"])).await;
    watcher.until(v.seq).await;
    let mut view = watcher.view.clone();
    drop(watcher);
    // What the other replica had told it and this one never held.
    let ghost = aether_proto::registry::v1::Service {
        namespace: "ns".into(),
        name: "ghost".into(),
        vip: "240.240.9.9".into(),
        kubernetes: None,
        external: None,
    };
    view.catalog.services.insert("ns/ghost".into(), ghost);
    view.catalog.endpoints.insert("ns/ghost".into(), Default::default());
    view.version = Some(Version {
        instance: "another-replica".into(),
        seq: v.seq + 1_000,
    });

    register(&mut client, endpoint("ns/stale", "10.0.9.5", 80)).await;
    register(&mut client, endpoint("ns/new", "10.0.9.6", 80)).await;
    let moved = WatchRequest {
        resume_from: view.version.clone(),
        held: view.held(),
        ..filter(&["ns/same", "ns/stale", "ns/new"])
    };
    let mut moved = Watcher::open(&mut client, moved).await.with_view(view);
    let reconciled = moved.reconciled().await;
    assert_eq!(
        reconciled.removed,
        ["ns/dropped", "ns/ghost", "ns/stale"].map(String::from).into()
    );
    assert_eq!(reconciled.sent, ["ns/new", "ns/stale"].map(String::from).into());
    let (expected, _) = catalog(&mut client, |k| ["ns/same", "ns/stale", "ns/new"].contains(&k)).await;
    assert_eq!(moved.view.catalog, expected);
}

/// A reconciliation larger than one message streams in chunks like a snapshot: the
/// client's view changes only when it is whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_reconciliation_is_staged_and_swapped_in_whole() {
    use aether_registrar::watch::SNAPSHOT_CHUNK_ENDPOINTS;
    let dir = tempfile::tempdir().unwrap();
    let registrar = Registrar::start(dir.path(), &[]).await;
    let mut client = registrar.client().await;
    let v = register(&mut client, endpoint("ns/kept", "10.0.20.1", 80)).await;
    let mut watcher = Watcher::open(&mut client, filter(&["ns/kept", "ns/many"])).await;
    watcher.until(v.seq).await;
    let mut view = watcher.view.clone();
    drop(watcher);
    view.version = Some(Version {
        instance: "another-replica".into(),
        seq: 1,
    });
    for i in 0..SNAPSHOT_CHUNK_ENDPOINTS * 2 + 10 {
        register(
            &mut client,
            endpoint("ns/many", &format!("10.0.{}.{}", 21 + i / 250, 1 + i % 250), 80),
        )
        .await;
    }
    let moved = WatchRequest {
        resume_from: view.version.clone(),
        held: view.held(),
        ..filter(&["ns/kept", "ns/many"])
    };
    let mut moved = Watcher::open(&mut client, moved).await.with_view(view);
    let reconciled = moved.reconciled().await;
    assert_eq!(reconciled.chunks, 3);
    assert!(reconciled.removed.is_empty(), "{:?}", reconciled.removed);
    assert_eq!(
        reconciled.sent,
        ["ns/many".to_owned()].into(),
        "ns/kept was held exactly"
    );
    let (expected, _) = catalog(&mut client, |k| k == "ns/kept" || k == "ns/many").await;
    assert_eq!(moved.view.catalog, expected);
}

/// Holdings are bounded like filters: a key past the limit is refused, naming it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holdings_with_a_huge_key_are_refused_naming_the_field() {
    use aether_proto::registrar::v1::{Held, Holdings};
    let dir = tempfile::tempdir().unwrap();
    let registrar = Registrar::start(dir.path(), &[]).await;
    let mut client = registrar.client().await;
    let held = Holdings {
        policies: vec![
            Held {
                key: "ns/fine".into(),
                digest: 1,
            },
            Held {
                key: "k".repeat(100_000),
                digest: 2,
            },
        ],
        ..Default::default()
    };
    let request = WatchRequest {
        held: Some(held),
        ..filter(&["ns/a"])
    };
    let status = Watcher::open(&mut client, request).await.end().await;
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(
        status.message().starts_with("held.policies[1].key: \"kkkk"),
        "{}",
        status.message()
    );
    assert!(status.message().len() < 300, "{}", status.message());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_or_expired_version_gets_a_fresh_snapshot() {
    let dir = tempfile::tempdir().unwrap();
    let registrar = Registrar::start(dir.path(), &["--history-changes", "2"]).await;
    let mut client = registrar.client().await;
    let first = register(&mut client, endpoint("ns/a", "10.0.3.1", 80)).await;

    // Another instance's version is never misread as ours, even with a plausible seq.
    let foreign = Version {
        instance: "some-other-registrar".into(),
        seq: first.seq,
    };
    let mut watcher = Watcher::open(
        &mut client,
        WatchRequest {
            resume_from: Some(foreign),
            ..filter(&["ns/a"])
        },
    )
    .await;
    assert_eq!(
        snapshot_reason(&watcher.next().await),
        Some(SnapshotReason::ResumeUnavailable)
    );
    watcher.until(first.seq).await;
    assert_eq!(watcher.view.catalog.all_endpoints().count(), 1);

    // History holds only two changes: resuming from further back needs a snapshot.
    for i in 2..6 {
        register(&mut client, endpoint("ns/a", &format!("10.0.3.{i}"), 80)).await;
    }
    let mut stale = Watcher::open(
        &mut client,
        WatchRequest {
            resume_from: Some(first),
            ..filter(&["ns/a"])
        },
    )
    .await;
    assert_eq!(
        snapshot_reason(&stale.next().await),
        Some(SnapshotReason::ResumeUnavailable)
    );
    let (expected, version) = catalog(&mut client, |k| k == "ns/a").await;
    stale.until(version.seq).await;
    assert_eq!(stale.view.catalog, expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_keeps_every_service_endpoint_and_vip() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let registrar = Registrar::start(&data, &[]).await;
    let mut client = registrar.client().await;
    for i in 0..50 {
        let mut e = endpoint(&format!("ns{}/svc{}", i % 3, i % 7), &format!("10.0.4.{i}"), 8000 + i);
        e.metadata.insert("version".into(), format!("v{i}"));
        register(&mut client, e).await;
    }
    client
        .unregister_endpoint(UnregisterEndpointRequest {
            service: "ns0/svc0".into(),
            address: "10.0.4.0".into(),
        })
        .await
        .unwrap();
    let (before, old_version) = catalog(&mut client, |_| true).await;
    let mut watcher = Watcher::open(&mut client, wildcard()).await;
    watcher.until(old_version.seq).await;

    let status = registrar.terminate().await;
    assert!(status.success(), "graceful shutdown exited with {status}");
    let ended = watcher.end().await;
    assert_eq!(ended.code(), Code::Unavailable, "{ended:?}");
    assert!(ended.message().contains("shutting down"), "{ended:?}");

    let registrar = Registrar::start(&data, &[]).await;
    let mut client = registrar.client().await;
    let (after, new_version) = catalog(&mut client, |_| true).await;
    assert_eq!(after, before, "the catalog changed across a restart");
    assert_ne!(new_version.instance, old_version.instance);

    // The old instance's version resumes nothing: a snapshot, equal to the catalog.
    let mut watcher = Watcher::open(
        &mut client,
        WatchRequest {
            resume_from: Some(old_version),
            wildcard: true,
            ..Default::default()
        },
    )
    .await;
    assert_eq!(
        snapshot_reason(&watcher.next().await),
        Some(SnapshotReason::ResumeUnavailable)
    );
    watcher.until(new_version.seq).await;
    assert_eq!(watcher.view.catalog, after);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_watcher_is_resynced_while_a_fast_one_keeps_up() {
    let dir = tempfile::tempdir().unwrap();
    let registrar = Registrar::start(dir.path(), &["--watch-buffer", "8"]).await;
    let mut client = registrar.client().await;

    let mut fast = Watcher::open(&mut client, wildcard()).await;
    let mut slow = Watcher::open(&mut client, wildcard()).await;
    fast.until(0).await;
    slow.until(0).await;

    // The slow watcher stops reading; big endpoints fill its transport quickly.
    let mut last = None;
    for i in 0..400u32 {
        let mut e = endpoint(
            &format!("ns/svc{}", i % 10),
            &format!("10.1.{}.{}", i / 250, i % 250 + 1),
            80,
        );
        e.metadata.insert("blob".into(), "x".repeat(8 * 1024));
        last = Some(register(&mut client, e).await);
        // The fast one keeps up, batch by batch, without snapshots.
        fast.next().await;
    }
    let last = last.unwrap();
    fast.until(last.seq).await;
    assert_eq!(
        fast.received.iter().filter(|m| snapshot_reason(m).is_some()).count(),
        1,
        "the fast watcher was resynced"
    );

    // The slow one, reading again, is told to resync and converges.
    slow.until(last.seq).await;
    assert!(
        slow.received
            .iter()
            .any(|m| snapshot_reason(m) == Some(SnapshotReason::Lagged)),
        "the slow watcher was never resynced"
    );
    let (expected, _) = catalog(&mut client, |_| true).await;
    assert_eq!(slow.view.catalog, expected);
    assert_eq!(fast.view.catalog, expected);
    let (_, metrics) = http_get(registrar.admin, "/metrics").await.unwrap();
    assert!(
        metrics.contains("aether_registrar_watch_snapshots_total{reason=\"SNAPSHOT_REASON_LAGGED\"} 1"),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_refused_naming_the_field_and_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let registrar = Registrar::start(dir.path(), &[]).await;
    let mut client = registrar.client().await;
    register(&mut client, endpoint("ns/a", "10.0.5.1", 80)).await;
    let (before, version) = catalog(&mut client, |_| true).await;

    let mut cases = vec![(None, "endpoint: must be set")];
    cases.extend(BAD_ENDPOINTS.iter().map(|(edit, expected)| {
        let mut e = endpoint("ns/a", "10.0.5.1", 8080);
        edit(&mut e);
        (Some(e), *expected)
    }));
    for (endpoint, expected) in cases {
        let status = client
            .register_endpoint(RegisterEndpointRequest { endpoint })
            .await
            .expect_err(expected);
        assert_eq!(status.code(), Code::InvalidArgument, "{expected}: {status:?}");
        assert!(
            status.message().starts_with(expected),
            "expected {expected:?}, got {:?}",
            status.message()
        );
    }
    bad_unregisters_and_lists_are_refused(&mut client).await;
    bad_filters_end_the_stream_naming_the_field(&mut client, version.seq).await;

    // Nothing changed, and the registrar still serves.
    let (after, after_version) = catalog(&mut client, |_| true).await;
    assert_eq!(after, before);
    assert_eq!(after_version, version);
    let (_, metrics) = http_get(registrar.admin, "/metrics").await.unwrap();
    assert!(
        metrics.contains("aether_registrar_invalid_requests_total{method=\"RegisterEndpoint\"} 17"),
        "{metrics}"
    );
}

/// Edits that make a good endpoint bad, and the start of the message naming what is wrong.
type EndpointEdit = fn(&mut Endpoint);
const BAD_ENDPOINTS: [(EndpointEdit, &str); 16] = [
    (
        |e| e.service.clear(),
        "endpoint.service: must be set to \"<namespace>/<name>\"",
    ),
    (
        |e| e.service = "ns".into(),
        "endpoint.service: \"ns\": expected \"<namespace>/<name>\"",
    ),
    (
        |e| e.service = "ns/Bad_Name".into(),
        "endpoint.service: \"ns/Bad_Name\": name must be a DNS-1123 label",
    ),
    (
        |e| e.service = "/a".into(),
        "endpoint.service: \"/a\": namespace is empty",
    ),
    (
        |e| e.address.clear(),
        "endpoint.address: must be set to the pod's IP address",
    ),
    (
        |e| e.address = "10.0.5".into(),
        "endpoint.address: \"10.0.5\" is not an IP address",
    ),
    (
        |e| e.address = "0.0.0.0".into(),
        "endpoint.address: \"0.0.0.0\" is not a unicast pod address",
    ),
    (|e| e.ports.clear(), "endpoint.ports: at least one port is required"),
    (
        |e| e.ports[0].port = 0,
        "endpoint.ports[0].port: 0 is out of range (1..=65535)",
    ),
    (
        |e| e.ports[0].port = 65_536,
        "endpoint.ports[0].port: 65536 is out of range (1..=65535)",
    ),
    (
        |e| e.ports[0].protocol = 99,
        "endpoint.ports[0].protocol: unknown protocol 99",
    ),
    (
        |e| e.ports[0].protocol = Protocol::Unspecified as i32,
        "endpoint.ports[0].protocol: must be set (TCP, HTTP, HTTP2 or GRPC)",
    ),
    (
        |e| {
            e.ports.push(Port {
                name: "other".into(),
                port: 8080,
                protocol: Protocol::Tcp as i32,
            })
        },
        "endpoint.ports[1].port: 8080 is listed twice",
    ),
    (
        |e| {
            e.metadata.insert("big".into(), "x".repeat(20_000));
        },
        "endpoint.metadata: 20003 bytes (at most 16384)",
    ),
    (|e| e.health = 7, "endpoint.health: unknown health 7"),
    (
        |e| e.weight = 70_000,
        "endpoint.weight: 70000 is out of range (0..=65535; 0 means 1)",
    ),
];

async fn bad_unregisters_and_lists_are_refused(client: &mut RegistrarClient<Channel>) {
    let unregister = |service: &str, address: &str| UnregisterEndpointRequest {
        service: service.into(),
        address: address.into(),
    };
    let status = client
        .unregister_endpoint(unregister("ns/a", "nope"))
        .await
        .unwrap_err();
    assert_eq!(
        (status.code(), status.message()),
        (Code::InvalidArgument, "address: \"nope\" is not an IP address")
    );
    let status = client
        .unregister_endpoint(unregister("", "10.0.5.1"))
        .await
        .unwrap_err();
    assert_eq!(
        (status.code(), status.message()),
        (Code::InvalidArgument, "service: must be set to \"<namespace>/<name>\"")
    );
    let status = client
        .list_endpoints(ListEndpointsRequest {
            service: "ns/missing".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(
        (status.code(), status.message()),
        (Code::NotFound, "service: ns/missing is not in the catalog")
    );
}

/// A bad filter ends that stream with the field named; the first one or a later one.
async fn bad_filters_end_the_stream_naming_the_field(client: &mut RegistrarClient<Channel>, seq: u64) {
    let mut watcher = Watcher::open(client, filter(&["ns/a", "NOT A KEY"])).await;
    let status = watcher.end().await;
    assert_eq!(status.code(), Code::InvalidArgument);
    assert_eq!(
        status.message(),
        "services[1]: \"NOT A KEY\": expected \"<namespace>/<name>\""
    );
    let mut watcher = Watcher::open(client, filter(&["ns/a"])).await;
    watcher.until(seq).await;
    watcher.send(filter(&["ns/"])).await;
    let status = watcher.end().await;
    assert_eq!(
        (status.code(), status.message()),
        (Code::InvalidArgument, "services[0]: \"ns/\": name is empty")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_service_keeps_its_vip_until_the_ttl_then_goes() {
    let dir = tempfile::tempdir().unwrap();
    let registrar = Registrar::start(dir.path(), &["--empty-service-ttl", "1s"]).await;
    let mut client = registrar.client().await;
    let reply = client
        .register_endpoint(RegisterEndpointRequest {
            endpoint: Some(endpoint("ns/brief", "10.0.6.1", 80)),
        })
        .await
        .unwrap()
        .into_inner();
    let vip = reply.service.unwrap().vip;
    let mut watcher = Watcher::open(&mut client, filter(&["ns/brief"])).await;
    watcher.until(reply.version.unwrap().seq).await;

    client
        .unregister_endpoint(UnregisterEndpointRequest {
            service: "ns/brief".into(),
            address: "10.0.6.1".into(),
        })
        .await
        .unwrap();
    // Still there with its VIP right after the last endpoint left...
    let listed = client
        .list_endpoints(ListEndpointsRequest {
            service: "ns/brief".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(listed.service.unwrap().vip, vip);
    assert!(listed.endpoints.is_empty());
    // ...and removed, with a service_removed to watchers, once the TTL passed.
    loop {
        let message = watcher.next().await;
        let removed = match &message.event {
            Some(watch_response::Event::Delta(d)) => d
                .changes
                .iter()
                .any(|c| matches!(&c.change, Some(change::Change::ServiceRemoved(k)) if k == "ns/brief")),
            _ => false,
        };
        if removed {
            break;
        }
    }
    assert!(watcher.view.catalog.services.is_empty());
    let status = client
        .list_endpoints(ListEndpointsRequest {
            service: "ns/brief".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::NotFound);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_readiness_and_metrics_are_served() {
    let dir = tempfile::tempdir().unwrap();
    let registrar = Registrar::start(dir.path(), &[]).await;
    let mut client = registrar.client().await;
    register(&mut client, endpoint("ns/a", "10.0.7.1", 80)).await;
    let mut watcher = Watcher::open(&mut client, wildcard()).await;
    watcher.until(1).await;

    assert_eq!(
        http_get(registrar.admin, "/healthz").await.unwrap(),
        (200, "ok\n".into())
    );
    assert_eq!(
        http_get(registrar.admin, "/ready").await.unwrap(),
        (200, "ready\n".into())
    );
    assert_eq!(http_get(registrar.admin, "/nope").await.unwrap().0, 404);
    let (status, metrics) = http_get(registrar.admin, "/metrics").await.unwrap();
    assert_eq!(status, 200);
    for line in [
        "aether_registrar_services 1",
        "aether_registrar_endpoints 1",
        "aether_registrar_catalog_version 1",
        "aether_registrar_changes_total 2",
        "aether_registrar_store_commit_duration_seconds_count 1",
    ] {
        assert!(metrics.lines().any(|l| l == line), "missing {line:?} in\n{metrics}");
    }
    assert!(
        metrics.trim_end().ends_with("# EOF"),
        "not OpenMetrics text:\n{metrics}"
    );
    assert!(metrics.lines().any(|l| l == "aether_registrar_watchers 1"), "{metrics}");

    // A watcher whose client left is cleaned up even when nothing is sent to it.
    drop(watcher);
    let deadline = std::time::Instant::now() + TIMEOUT;
    loop {
        let (_, metrics) = http_get(registrar.admin, "/metrics").await.unwrap();
        if metrics.lines().any(|l| l == "aether_registrar_watchers 0") {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the watcher outlived its client:\n{metrics}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_registrar_on_the_same_data_dir_refuses_to_start() {
    let dir = tempfile::tempdir().unwrap();
    let _first = Registrar::start(dir.path(), &[]).await;
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_aether-registrar"))
        .args(["--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0", "--data-dir"])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("catalog.redb"), "{stderr}");
}

/// A 1 MiB value in any field the registrar quotes: refused naming the field with a
/// short message (it travels in trailers, which a standard client caps at 16 KiB), and
/// nothing changes. The client has tonic's default limits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn huge_fields_are_refused_with_a_short_message_naming_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let registrar = Registrar::start(dir.path(), &[]).await;
    let mut client = registrar.client().await;
    register(&mut client, endpoint("ns/a", "10.0.6.1", 80)).await;
    let mut watcher = Watcher::open(&mut client, filter(&["ns/a"])).await;
    let (before, version) = catalog(&mut client, |_| true).await;
    watcher.until(version.seq).await;

    huge_registrations_are_refused(&mut client).await;
    huge_unregisters_and_lists_are_refused(&mut client).await;
    // A Watch whose first message names a huge service, and one that changes to it.
    let huge = "a".repeat(MIB);
    let mut bad = Watcher::open(&mut client, filter(&["ns/a", &huge])).await;
    assert_huge_refused("watch", bad.end().await, "services[1]");
    watcher.send(filter(&["ns/a", "ns/b", &huge])).await;
    assert_huge_refused("watch filter change", watcher.end().await, "services[2]");

    // Over the registrar's decoding limit: refused by the transport from the message's
    // length prefix, before it is read.
    let status = client
        .list_endpoints(ListEndpointsRequest {
            service: "x".repeat(17 * MIB),
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::OutOfRange, "{status:?}");
    assert!(
        status.message().contains("decoded message length too large") && status.message().len() < 1024,
        "{status:?}"
    );

    // Nothing changed, and the registrar still serves.
    let (after, after_version) = catalog(&mut client, |_| true).await;
    assert_eq!(after, before);
    assert_eq!(after_version, version);
}

const MIB: usize = 1 << 20;

/// `status` refuses a 1 MiB value of `field` (in `what`): named, quoted by its start and its size, briefly.
fn assert_huge_refused(what: &str, status: tonic::Status, field: &str) {
    assert_eq!(status.code(), Code::InvalidArgument, "{what}: {status:?}");
    let message = status.message();
    assert!(message.starts_with(&format!("{field}: ")), "{what}: {message}");
    // The value is quoted by its start and its size.
    assert!(message.contains("aaaa\"… (10485"), "{what}: {message}");
    assert!(message.len() < 1024, "{what}: {} bytes: {message}", message.len());
}

/// A registration of ns/a at 10.0.6.2 changed by `edit`.
fn huge_endpoint(edit: impl Fn(&mut Endpoint)) -> RegisterEndpointRequest {
    let mut e = endpoint("ns/a", "10.0.6.2", 80);
    edit(&mut e);
    RegisterEndpointRequest { endpoint: Some(e) }
}

async fn huge_registrations_are_refused(client: &mut RegistrarClient<Channel>) {
    let huge = "a".repeat(MIB);
    let registrations = [
        (
            "service",
            huge_endpoint(|e| e.service = huge.clone()),
            "endpoint.service",
        ),
        (
            "service name",
            huge_endpoint(|e| e.service = format!("ns/{huge}")),
            "endpoint.service",
        ),
        (
            "address",
            huge_endpoint(|e| e.address = huge.clone()),
            "endpoint.address",
        ),
        (
            "port name",
            huge_endpoint(|e| e.ports[0].name = huge.clone()),
            "endpoint.ports[0].name",
        ),
        (
            "metadata key",
            huge_endpoint(|e| {
                e.metadata.insert(huge.clone(), "v".into());
            }),
            "endpoint.metadata",
        ),
    ];
    for (what, request, field) in registrations {
        let status = client.register_endpoint(request).await.expect_err(what);
        assert_huge_refused(what, status, field);
    }
    // A label over 253 bytes is refused by its size alone.
    let status = client
        .register_endpoint(huge_endpoint(|e| e.node = huge.clone()))
        .await
        .unwrap_err();
    assert_eq!(
        (status.code(), status.message()),
        (Code::InvalidArgument, "endpoint.node: 1048576 bytes (at most 253)")
    );
}

async fn huge_unregisters_and_lists_are_refused(client: &mut RegistrarClient<Channel>) {
    let huge = "a".repeat(MIB);
    let status = client
        .unregister_endpoint(UnregisterEndpointRequest {
            service: huge.clone(),
            address: "10.0.6.1".into(),
        })
        .await
        .unwrap_err();
    assert_huge_refused("unregister service", status, "service");
    let status = client
        .unregister_endpoint(UnregisterEndpointRequest {
            service: "ns/a".into(),
            address: huge.clone(),
        })
        .await
        .unwrap_err();
    assert_huge_refused("unregister address", status, "address");
    let status = client
        .list_endpoints(ListEndpointsRequest { service: huge.clone() })
        .await
        .unwrap_err();
    assert_huge_refused("list", status, "service");
}
