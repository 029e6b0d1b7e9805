//! Authorization policies end to end through the registrar binary: a `--config-dir` of
//! AuthorizationPolicy YAML → projected policies in the store → each Watch stream gets
//! the policies of its `policy_namespaces` and every mesh-wide one, as versioned
//! deltas, in and out with filter changes; a refused edit keeps the last accepted
//! version; the store keeps policies across restarts; a resumed stream gets only what
//! it missed.

mod support;

use std::path::Path;
use std::time::{Duration, Instant};

use aether_proto::registrar::v1::{WatchRequest, change, watch_response};
use support::sources::*;
use support::*;

/// Policies of namespaces `shop` and `pay`, and a mesh-wide one; `paths` is the
/// shop policy's path pattern (a bad one is refused).
fn policies(paths: &str, generation_hint: &str) -> String {
    format!(
        r#"
apiVersion: security.aether.io/v1alpha1
kind: AuthorizationPolicy
metadata: {{name: cart-api, namespace: shop, generation: {generation_hint}}}
spec:
  selector: {{matchLabels: {{app: cart}}}}
  rules:
  - to: [{{operation: {{paths: ["{paths}"]}}}}]
---
apiVersion: security.aether.io/v1alpha1
kind: AuthorizationPolicy
metadata: {{name: deny-legacy, namespace: pay}}
spec:
  action: DENY
  rules: [{{from: [{{source: {{namespaces: [legacy]}}}}]}}]
---
apiVersion: security.aether.io/v1alpha1
kind: AuthorizationPolicy
metadata: {{name: baseline, namespace: aether-system}}
spec:
  action: AUDIT
  rules: [{{}}]
---
apiVersion: v1
kind: Service
metadata: {{name: ignored, namespace: shop}}
"#
    )
}

/// Whether the watcher's `shop/cart-api` has `path` as its first pattern.
fn has_path(watcher: &Watcher, path: &str) -> bool {
    let policy = watcher.view.catalog.policies.get("shop/cart-api");
    policy.is_some_and(|p| p.rules[0].to[0].paths[0].value == path)
}

fn keys(watcher: &Watcher) -> Vec<&str> {
    watcher.view.catalog.policies.keys().map(String::as_str).collect()
}

fn watching(policy_namespaces: &[&str]) -> WatchRequest {
    WatchRequest {
        policy_namespaces: policy_namespaces.iter().map(|s| s.to_string()).collect(),
        ..filter(&["shop/cart"])
    }
}

/// A registrar serving [`policies`] from a config directory at `config`.
async fn serving_policies(data: &Path, config: &Path) -> Registrar {
    write(config, "policies.yaml", &policies("/api/*", "1"));
    Registrar::start(data, &["--config-dir", config.to_str().unwrap()]).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn policies_reach_the_watchers_of_their_namespaces_and_mesh_wide_ones_reach_all() {
    let (data, config) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let registrar = serving_policies(data.path(), config.path()).await;
    let mut client = registrar.client().await;

    let mut shop = Watcher::open(&mut client, watching(&["shop"])).await.strict();
    let mut none = Watcher::open(&mut client, watching(&[])).await.strict();
    let dns = WatchRequest {
        services_only: true,
        policy_namespaces: vec!["shop".into()],
        ..Default::default()
    };
    let mut records = Watcher::open(&mut client, dns).await.strict();
    let both = ["aether-system/baseline", "shop/cart-api"];
    until(&mut shop, "shop's watcher has its policy and the mesh-wide one", |w| {
        keys(w) == both
    })
    .await;
    until(&mut none, "a watcher of no namespace has the mesh-wide one", |w| {
        keys(w) == ["aether-system/baseline"]
    })
    .await;
    let cart = &shop.view.catalog.policies["shop/cart-api"];
    assert_eq!(cart.rules[0].to[0].paths[0].value, "/api/", "projected, typed pattern");
    assert!(
        shop.view.catalog.policies["aether-system/baseline"]
            .target
            .as_ref()
            .unwrap()
            .mesh_wide
    );
    assert!(metric(&registrar, "aether_registrar_policies_refused{source=\"directory\"} 0").await);

    // A filter change moves policies in and out in-stream, without a snapshot.
    let snapshots = snapshot_count(&shop);
    shop.send(WatchRequest {
        filter_id: 7,
        ..watching(&["pay"])
    })
    .await;
    until(&mut shop, "the new namespaces' policies replaced the old", |w| {
        keys(w) == ["aether-system/baseline", "pay/deny-legacy"]
    })
    .await;
    assert_eq!(
        snapshot_count(&shop),
        snapshots,
        "a filter change answered with a snapshot"
    );

    refused_edit_keeps_the_last_accepted_version(&registrar, config.path(), &mut none).await;

    // DNS watchers never get policies.
    while records.try_next().is_some() {}
    assert!(records.view.catalog.policies.is_empty());

    drop(registrar);
    policies_are_stored_resumed_and_follow_the_file(data.path(), config.path()).await;
}

/// A refused edit keeps the last accepted version, logs the field and counts it; the
/// other policies of the file are still applied (one bad object is refused alone).
async fn refused_edit_keeps_the_last_accepted_version(registrar: &Registrar, config: &Path, none: &mut Watcher) {
    let mut client = registrar.client().await;
    let mut shop = Watcher::open(&mut client, watching(&["shop"])).await.strict();
    until(&mut shop, "shop's watcher has its policy", |w| {
        w.view.catalog.policies.len() == 2
    })
    .await;
    let before = shop.view.catalog.policies["shop/cart-api"].clone();
    write(config, "policies.yaml", &policies("admin", "2"));
    let deadline = Instant::now() + TIMEOUT;
    while !metric(registrar, "aether_registrar_policies_refused{source=\"directory\"} 1").await {
        assert!(
            Instant::now() < deadline,
            "the bad path was not refused:\n{}",
            registrar.logs()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let logs = registrar.logs();
    assert!(logs.contains("spec.rules[0].to[0].operation.paths[0]"), "{logs}");
    assert!(logs.contains("authorization policy refused"), "{logs}");
    tokio::time::sleep(Duration::from_millis(600)).await;
    while shop.try_next().is_some() {}
    assert_eq!(
        shop.view.catalog.policies["shop/cart-api"], before,
        "the last accepted version must stay"
    );
    while none.try_next().is_some() {}
    assert_eq!(keys(none), ["aether-system/baseline"]);
}

/// Policies are stored: a restart without the source serves them, and a stream resumed
/// across a policy change gets that change as one delta; deleting the file deletes them.
async fn policies_are_stored_resumed_and_follow_the_file(data: &Path, config: &Path) {
    let dir = config.to_str().unwrap();
    let registrar = Registrar::start(data, &["--config-dir", dir]).await;
    let mut client = registrar.client().await;
    let mut shop = Watcher::open(&mut client, watching(&["shop"])).await.strict();
    until(&mut shop, "the stored policies are served", |w| {
        w.view.catalog.policies.len() == 2
    })
    .await;
    let view = shop.view.clone();
    drop(shop);

    // A fixed edit while the watcher is away: its resumed stream gets one PolicyPut.
    write(config, "policies.yaml", &policies("/v2/*", "3"));
    let mut probe = Watcher::open(&mut client, watching(&["shop"])).await;
    until(&mut probe, "the fixed edit is served", |w| has_path(w, "/v2/")).await;
    let resume = WatchRequest {
        resume_from: view.version.clone(),
        ..watching(&["shop"])
    };
    let mut resumed = Watcher::open(&mut client, resume).await.strict().with_view(view);
    until(&mut resumed, "the resumed stream has the edit", |w| has_path(w, "/v2/")).await;
    let changes: Vec<_> = (resumed.received.iter())
        .flat_map(|m| match &m.event {
            Some(watch_response::Event::Delta(d)) => d.changes.clone(),
            other => panic!("a resumed stream got {other:?}"),
        })
        .collect();
    assert!(
        matches!(&changes[..], [c] if matches!(&c.change, Some(change::Change::PolicyPut(p)) if p.name == "cart-api")),
        "{changes:?}"
    );

    std::fs::remove_file(config.join("policies.yaml")).unwrap();
    until(&mut resumed, "the deleted policies are gone", |w| {
        w.view.catalog.policies.is_empty()
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_root_namespace_that_is_not_a_namespace_name_is_refused_at_start() {
    let data = tempfile::tempdir().unwrap();
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_aether-registrar"))
        .args(["--insecure", "--listen=127.0.0.1:0", "--admin=127.0.0.1:0"])
        .arg(format!("--data-dir={}", data.path().display()))
        .arg("--mesh-root-namespace=Not_A_Label")
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("--mesh-root-namespace: \"Not_A_Label\""), "{stderr}");
}

/// A stream moved from another replica is reconciled record by record: a policy held in
/// another version is sent again, one held that is gone is removed, one missing is
/// sent, and one held exactly is not sent again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_moved_stream_is_reconciled_policy_by_policy() {
    use std::sync::Arc;
    let (data, config) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let registrar = serving_policies(data.path(), config.path()).await;
    let mut client = registrar.client().await;
    let mut pay = Watcher::open(&mut client, watching(&["shop", "pay"])).await;
    let all = ["aether-system/baseline", "pay/deny-legacy", "shop/cart-api"];
    until(&mut pay, "the policies are served", |w| keys(w) == all).await;
    let mut view = pay.view.clone();
    drop(pay);

    // What another replica had sent: an older cart-api, a policy since deleted, no baseline.
    let policies = &mut view.catalog.policies;
    policies.insert("shop/cart-api".into(), Arc::new(policy("shop", "cart-api", 0, false)));
    policies.insert("shop/gone".into(), Arc::new(policy("shop", "gone", 1, false)));
    policies.remove("aether-system/baseline");
    view.version = Some(aether_proto::registrar::v1::Version {
        instance: "another-replica".into(),
        seq: 1,
    });
    let moved = WatchRequest {
        resume_from: view.version.clone(),
        held: view.held(),
        ..watching(&["shop", "pay"])
    };
    let mut moved = Watcher::open(&mut client, moved).await.with_view(view);
    let reconciled = moved.reconciled().await;
    assert_eq!(reconciled.removed, ["policy shop/gone".to_owned()].into());
    let sent = ["policy aether-system/baseline", "policy shop/cart-api"].map(String::from);
    assert_eq!(reconciled.sent, sent.into(), "pay/deny-legacy was held exactly");
    assert_eq!(keys(&moved), all);
    assert!(has_path(&moved, "/api/"), "the served cart-api replaced the held one");
}
