//! HTTP filters end to end through the registrar binary: a `--config-dir` of HTTPFilter
//! YAML → projected filters in the store → each Watch stream gets the filters of its
//! `policy_namespaces` (the destination side) and those naming one of its services (the
//! callers' side), none for DNS watchers; a filter change on a live stream moves filters
//! in and out in one Delta; a refused edit keeps the last accepted version; the store
//! keeps filters across restarts; a resumed stream gets only what it missed.

mod support;

use std::path::Path;
use std::time::{Duration, Instant};

use aether_proto::registrar::v1::{WatchRequest, change, watch_response};
use aether_proto::registry::v1::http_filter::Filter;
use support::sources::*;
use support::*;

/// A rate limit on `shop/orders` filling every `interval`, and one on `pay/ledger`.
fn filters(interval: &str) -> String {
    format!(
        r#"
apiVersion: networking.aether.io/v1alpha1
kind: HTTPFilter
metadata: {{name: limit-orders, namespace: shop}}
spec:
  targetRefs: [{{kind: Service, name: orders}}]
  localRateLimit: {{maxTokens: 10, fillInterval: {interval}}}
---
apiVersion: networking.aether.io/v1alpha1
kind: HTTPFilter
metadata: {{name: limit-ledger, namespace: pay}}
spec:
  targetRefs: [{{kind: Service, name: ledger}}]
  attach: Callers
  localRateLimit: {{maxTokens: 5, fillInterval: 1s}}
---
apiVersion: v1
kind: Service
metadata: {{name: ignored, namespace: shop}}
"#
    )
}

fn keys(watcher: &Watcher) -> Vec<&str> {
    watcher.view.catalog.http_filters.keys().map(String::as_str).collect()
}

/// The fill interval of `shop/limit-orders` as the watcher holds it.
fn interval(watcher: &Watcher) -> Option<u32> {
    match &watcher.view.catalog.http_filters.get("shop/limit-orders")?.filter {
        Some(Filter::LocalRateLimit(limit)) => Some(limit.fill_interval_ms),
        _ => None,
    }
}

fn watching(services: &[&str], policy_namespaces: &[&str]) -> WatchRequest {
    WatchRequest {
        policy_namespaces: policy_namespaces.iter().map(|s| s.to_string()).collect(),
        ..filter(services)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn filters_reach_the_watchers_of_their_namespace_or_of_a_service_they_name() {
    let data = tempfile::tempdir().unwrap();
    let config = tempfile::tempdir().unwrap();
    write(config.path(), "filters.yaml", &filters("1s"));
    let dir = config.path().to_str().unwrap();
    let registrar = Registrar::start(data.path(), &["--config-dir", dir]).await;
    let mut client = registrar.client().await;

    let mut destination = Watcher::open(&mut client, watching(&["pay/wallet"], &["shop"]))
        .await
        .strict();
    let mut caller = Watcher::open(&mut client, watching(&["pay/ledger"], &[]))
        .await
        .strict();
    let mut neither = Watcher::open(&mut client, watching(&["shop/cart"], &["billing"]))
        .await
        .strict();
    let dns = WatchRequest {
        services_only: true,
        policy_namespaces: vec!["shop".into()],
        ..Default::default()
    };
    let mut records = Watcher::open(&mut client, dns).await.strict();
    until(&mut destination, "the namespace's filter is served", |w| {
        keys(w) == ["shop/limit-orders"]
    })
    .await;
    until(&mut caller, "the filter naming the service is served", |w| {
        keys(w) == ["pay/limit-ledger"]
    })
    .await;
    assert_eq!(interval(&destination), Some(1000), "projected, typed");
    assert!(
        metric(
            &registrar,
            "aether_registrar_http_filters_refused{source=\"directory\"} 0"
        )
        .await
    );
    assert!(metric(&registrar, "aether_registrar_http_filters 2").await);

    filter_changes_move_filters_in_one_delta(&mut caller).await;
    refused_edit_keeps_the_last_accepted_version(&registrar, config.path(), &mut destination).await;

    // Watchers of neither side, and DNS watchers, never get filters.
    while neither.try_next().is_some() {}
    assert!(neither.view.catalog.http_filters.is_empty());
    while records.try_next().is_some() {}
    assert!(records.view.catalog.http_filters.is_empty());

    drop(registrar);
    filters_are_stored_resumed_and_follow_the_file(data.path(), config.path()).await;
}

/// A new filter on a live stream: one Delta takes the filters of the services it drops
/// away and brings those of the services and namespaces it adds, without a snapshot.
async fn filter_changes_move_filters_in_one_delta(caller: &mut Watcher) {
    let snapshots = snapshot_count(caller);
    let seen = caller.received.len();
    caller
        .send(WatchRequest {
            filter_id: 7,
            ..watching(&["shop/orders"], &[])
        })
        .await;
    until(caller, "the filters of the new services replaced the old", |w| {
        keys(w) == ["shop/limit-orders"]
    })
    .await;
    assert_eq!(
        snapshot_count(caller),
        snapshots,
        "a filter change answered with a snapshot"
    );
    let delta = (caller.received[seen..].iter()).find_map(|m| match &m.event {
        Some(watch_response::Event::Delta(d)) if d.filter_id == 7 => Some(d),
        _ => None,
    });
    let changes: Vec<_> = delta.expect("a Delta for the new filter").changes.iter().collect();
    let put = |c: &&aether_proto::registrar::v1::Change| matches!(&c.change, Some(change::Change::HttpFilterPut(f)) if f.name == "limit-orders");
    let removed = |c: &&aether_proto::registrar::v1::Change| matches!(&c.change, Some(change::Change::HttpFilterRemoved(k)) if k == "pay/limit-ledger");
    assert!(changes.iter().any(put) && changes.iter().any(removed), "{changes:?}");
}

/// A refused edit keeps the last accepted version, logs the field and counts it; the
/// other filter of the file is still applied.
async fn refused_edit_keeps_the_last_accepted_version(registrar: &Registrar, config: &Path, shop: &mut Watcher) {
    write(config, "filters.yaml", &filters("1d"));
    let deadline = Instant::now() + TIMEOUT;
    while !metric(
        registrar,
        "aether_registrar_http_filters_refused{source=\"directory\"} 1",
    )
    .await
    {
        assert!(
            Instant::now() < deadline,
            "the bad interval was not refused:\n{}",
            registrar.logs()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let logs = registrar.logs();
    assert!(logs.contains("spec.localRateLimit.fillInterval"), "{logs}");
    assert!(logs.contains("HTTP filter refused"), "{logs}");
    tokio::time::sleep(Duration::from_millis(600)).await;
    while shop.try_next().is_some() {}
    assert_eq!(interval(shop), Some(1000), "the last accepted version must stay");
    assert!(metric(registrar, "aether_registrar_http_filters 2").await);
}

/// Filters are stored: a restart serves them, and a stream resumed across an edit gets
/// that edit as one delta; deleting the file deletes them.
async fn filters_are_stored_resumed_and_follow_the_file(data: &Path, config: &Path) {
    let dir = config.to_str().unwrap();
    let registrar = Registrar::start(data, &["--config-dir", dir]).await;
    let mut client = registrar.client().await;
    let mut shop = Watcher::open(&mut client, watching(&[], &["shop"])).await.strict();
    until(&mut shop, "the stored filter is served", |w| interval(w) == Some(1000)).await;
    let view = shop.view.clone();
    drop(shop);

    // A fixed edit while the watcher is away: its resumed stream gets one HttpFilterPut.
    write(config, "filters.yaml", &filters("250ms"));
    let mut probe = Watcher::open(&mut client, watching(&[], &["shop"])).await;
    until(&mut probe, "the fixed edit is served", |w| interval(w) == Some(250)).await;
    let resume = WatchRequest {
        resume_from: view.version.clone(),
        ..watching(&[], &["shop"])
    };
    let mut resumed = Watcher::open(&mut client, resume).await.strict().with_view(view);
    until(&mut resumed, "the resumed stream has the edit", |w| {
        interval(w) == Some(250)
    })
    .await;
    let changes: Vec<_> = (resumed.received.iter())
        .flat_map(|m| match &m.event {
            Some(watch_response::Event::Delta(d)) => d.changes.clone(),
            other => panic!("a resumed stream got {other:?}"),
        })
        .collect();
    let edit = |c: &aether_proto::registrar::v1::Change| matches!(&c.change, Some(change::Change::HttpFilterPut(f)) if f.name == "limit-orders");
    assert!(matches!(&changes[..], [c] if edit(c)), "{changes:?}");

    std::fs::remove_file(config.join("filters.yaml")).unwrap();
    until(&mut resumed, "the deleted filters are gone", |w| {
        w.view.catalog.http_filters.is_empty()
    })
    .await;
}
