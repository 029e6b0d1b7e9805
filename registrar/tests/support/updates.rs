//! Backend-generic checks of `StoreOp::UpdateService` on a store shared by two
//! replicas: the update lands with its own revision, keeps the VIP, never creates a
//! service, refuses a VIP change, and reaches the other replica's feed.

use std::time::Instant;

use aether_proto::registry::v1::{KubernetesService, Service, TrafficDistribution};
use aether_registrar::model::ServiceKey;
use aether_registrar::store::{Feed, FeedChangeKind, FeedEvent, Revision, Store, StoreError, StoreOp};
use futures::StreamExt;

use super::TIMEOUT;

fn service(name: &str, vip: &str, kubernetes: Option<KubernetesService>) -> Service {
    Service {
        namespace: "upd".into(),
        name: name.into(),
        vip: vip.into(),
        kubernetes,
        external: None,
    }
}

fn attributes(traffic: TrafficDistribution) -> KubernetesService {
    KubernetesService {
        cluster_ips: vec!["10.96.7.1".into(), "fd00:96::7:1".into()],
        traffic_distribution: traffic as i32,
        ports: Vec::new(),
    }
}

/// `writer` and `reader` share one store; `feed` is `reader`'s, from before this runs.
pub async fn service_updates(writer: &dyn Store, reader: &dyn Store, mut feed: Feed) {
    let created = writer
        .commit(vec![StoreOp::CreateService(service("web", "240.240.9.1", None))])
        .await
        .unwrap();
    let updated = service(
        "web",
        "240.240.9.1",
        Some(attributes(TrafficDistribution::PreferSameNode)),
    );
    let revision = writer
        .commit(vec![StoreOp::UpdateService(updated.clone())])
        .await
        .unwrap();
    assert!(revision > created, "{revision} > {created}");
    let stored = reader.load().await.unwrap();
    let held: Vec<_> = (stored.services.iter())
        .filter(|s| s.value.namespace == "upd")
        .map(|s| (s.value.clone(), s.revision))
        .collect();
    assert_eq!(held, [(updated.clone(), revision)], "the update landed, VIP unchanged");
    assert_eq!(fed_service(&mut feed, "web", revision).await, updated);

    let gone = service(
        "gone",
        "240.240.9.2",
        Some(attributes(TrafficDistribution::PreferSameZone)),
    );
    let err = writer.commit(vec![StoreOp::UpdateService(gone)]).await.unwrap_err();
    let StoreError::Conflict(conflict) = err else {
        panic!("{err}")
    };
    assert_eq!(conflict.missing, [ServiceKey::parse("s", "upd/gone").unwrap()]);

    let moved = service("web", "240.240.9.3", None);
    let err = writer.commit(vec![StoreOp::UpdateService(moved)]).await.unwrap_err();
    assert!(
        matches!(&err, StoreError::Corrupt(m) if m.contains("240.240.9.3")),
        "{err}"
    );

    let after = reader.load().await.unwrap();
    let names: Vec<_> = (after.services.iter())
        .filter(|s| s.value.namespace == "upd")
        .map(|s| (s.value.clone(), s.revision))
        .collect();
    assert_eq!(
        names,
        [(updated, revision)],
        "refused updates change nothing, create nothing"
    );
}

/// The service `name` as the feed delivers it at `revision` (a change, or in a resync).
async fn fed_service(feed: &mut Feed, name: &str, revision: Revision) -> Service {
    let deadline = Instant::now() + TIMEOUT;
    loop {
        let event = tokio::time::timeout_at(deadline.into(), feed.next())
            .await
            .expect("the feed brought nothing in time")
            .expect("feeds never end");
        let found = match event {
            FeedEvent::Changes { changes, .. } => changes.into_iter().find_map(|c| match c.kind {
                FeedChangeKind::ServicePut(s) if s.name == name && c.revision == revision => Some(s),
                _ => None,
            }),
            FeedEvent::Resync(contents) => (contents.services.into_iter())
                .find(|s| s.value.name == name && s.revision == revision)
                .map(|s| s.value),
            FeedEvent::Down(_) => None,
        };
        if let Some(service) = found {
            return service;
        }
    }
}
