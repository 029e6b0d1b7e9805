//! Registrar → agent → record file → mesh-dns → dig: every service's VIP reaches DNS,
//! including services outside the node's dependency set (the agent's services-only watch).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use aether_proto::registrar::v1::{RegisterEndpointRequest, SnapshotReason, WatchRequest, change, watch_response};
use aether_proto::registry::v1::{Endpoint, Port, Protocol};
use aether_tests::mesh::Mesh;
use aether_tests::mesh_dns::MeshDns;
use tokio_stream::wrappers::ReceiverStream;

fn endpoint(service: &str, address: &str) -> Endpoint {
    Endpoint {
        service: service.into(),
        address: address.into(),
        ports: vec![Port {
            name: "http".into(),
            port: 8080,
            protocol: Protocol::Http as i32,
        }],
        node: "elsewhere".into(),
        weight: 1,
        ..Default::default()
    }
}

async fn register(mesh: &Mesh, service: &str, address: &str) {
    mesh.registrar_as("elsewhere")
        .await
        .register_endpoint(RegisterEndpointRequest {
            endpoint: Some(endpoint(service, address)),
        })
        .await
        .unwrap_or_else(|s| panic!("register {service} {address}: {s}"));
}

async fn vip_of(mesh: &Mesh, service: &str) -> String {
    mesh.registrar()
        .await
        .list_endpoints(aether_proto::registrar::v1::ListEndpointsRequest {
            service: service.into(),
        })
        .await
        .expect("list endpoints")
        .into_inner()
        .service
        .expect("service")
        .vip
}

/// The record file as JSON: (generation, "<ns>/<svc>" → v4).
fn read_records(mesh: &Mesh) -> Option<(u64, BTreeMap<String, String>)> {
    let bytes = std::fs::read(mesh.path("state/mesh-dns/records")).ok()?;
    let json: serde_json::Value = serde_json::from_slice(&bytes).expect("the record file is JSON");
    assert_eq!(json["version"], 1, "{json}");
    assert!(json["written_at_unix_ms"].as_u64().is_some(), "{json}");
    let records = json["records"]
        .as_object()
        .expect("records")
        .iter()
        .map(|(k, v)| (k.clone(), v["v4"].as_str().unwrap_or_default().to_owned()))
        .collect();
    Some((json["generation"].as_u64().expect("generation"), records))
}

async fn wait_records(
    mesh: &Mesh,
    what: &str,
    ok: impl Fn(&(u64, BTreeMap<String, String>)) -> bool,
) -> (u64, BTreeMap<String, String>) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(records) = read_records(mesh)
            && ok(&records)
        {
            return records;
        }
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {what}: {:?}",
            read_records(mesh)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_writes_every_service_vip_and_mesh_dns_answers_them() {
    let mesh = Mesh::start_plaintext().await;
    // Services on no pod of this node: outside its dependency set.
    register(&mesh, "shop/cart", "10.9.0.1").await;
    register(&mesh, "shop/pay", "10.9.0.2").await;
    register(&mesh, "web/front", "10.9.0.3").await;
    let mut vips = BTreeMap::new();
    for s in ["shop/cart", "shop/pay", "web/front"] {
        vips.insert(s.to_owned(), vip_of(&mesh, s).await);
    }
    let (generation, records) = wait_records(&mesh, "all three services", |(_, r)| {
        vips.iter().all(|(k, v)| r.get(k) == Some(v))
    })
    .await;
    assert_eq!(records.len(), 3, "{records:?}");
    let path = mesh.path("state/mesh-dns/records");
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o644);
    let debug = mesh.agent_get("/debug/dependencies").await;
    assert!(
        !debug.contains("shop/cart"),
        "cart must not be a dependency of this node: {debug}"
    );

    // The real mesh-dns on that file answers with the VIPs.
    let dns = MeshDns::start(&path);
    let deadline = Instant::now() + Duration::from_secs(20);
    while dns.dig_a("cart.shop.aether.internal") != vec![vips["shop/cart"].clone()] {
        assert!(
            Instant::now() < deadline,
            "mesh-dns never answered:\n{}",
            dns.child.logs()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(dns.dig_a("front.web.aether.internal"), vec![vips["web/front"].clone()]);

    // A new service: a new generation, and mesh-dns picks it up.
    register(&mesh, "shop/ship", "10.9.0.4").await;
    let ship = vip_of(&mesh, "shop/ship").await;
    let (next, _) = wait_records(&mesh, "the new service", |(_, r)| r.get("shop/ship") == Some(&ship)).await;
    assert!(next > generation, "generation {next} after {generation}");
    let deadline = Instant::now() + Duration::from_secs(20);
    while dns.dig_a("ship.shop.aether.internal") != vec![ship.clone()] {
        assert!(
            Instant::now() < deadline,
            "mesh-dns never picked up the new service:\n{}",
            dns.child.logs()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let metrics = mesh.agent_get("/metrics").await;
    assert!(metrics.contains("aether_agent_dns_records_services 4"), "{metrics}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_services_only_watch_carries_every_service_and_no_endpoint() {
    let mesh = Mesh::start_plaintext().await;
    register(&mesh, "shop/cart", "10.9.0.1").await;
    register(&mesh, "shop/cart", "10.9.0.5").await;
    register(&mesh, "web/front", "10.9.0.3").await;
    let (requests, outbox) = tokio::sync::mpsc::channel(4);
    requests
        .send(WatchRequest {
            services_only: true,
            filter_id: 7,
            ..Default::default()
        })
        .await
        .unwrap();
    let mut stream = mesh
        .registrar()
        .await
        .watch(ReceiverStream::new(outbox))
        .await
        .expect("watch")
        .into_inner();
    let (mut services, endpoints) = snapshot_of(&mut stream, (None, 7), "a snapshot in time", |chunk| {
        assert!(
            chunk.endpoints.is_empty(),
            "endpoints in a services-only snapshot: {chunk:?}"
        );
    })
    .await;
    assert!(endpoints.is_empty());
    services.sort();
    assert_eq!(services, vec!["shop/cart", "web/front"]);

    // A new endpoint of a known service sends nothing; a new service sends only itself.
    register(&mesh, "web/front", "10.9.0.6").await;
    register(&mesh, "web/back", "10.9.0.7").await;
    only_the_new_service_is_sent(&mut stream).await;

    // Switching to an ordinary filter on the same stream: a fresh snapshot, with endpoints.
    requests
        .send(WatchRequest {
            services: vec!["shop/cart".into()],
            filter_id: 8,
            ..Default::default()
        })
        .await
        .unwrap();
    let (services, mut endpoints) = snapshot_of(&mut stream, (Some(7), 8), "the resync in time", |chunk| {
        assert_eq!(chunk.reason, SnapshotReason::FilterChanged as i32);
    })
    .await;
    endpoints.sort();
    assert_eq!(
        (services, endpoints),
        (
            vec!["shop/cart".to_owned()],
            vec!["10.9.0.1".to_owned(), "10.9.0.5".to_owned()]
        )
    );
}

type WatchStream = tonic::Streaming<aether_proto::registrar::v1::WatchResponse>;

/// Reads a snapshot up to its completion for `filter_id` (each chunk checked by `check_chunk`): the services'
/// keys and the endpoints' addresses. Deltas still in flight under the `earlier` filter may come first; nothing
/// else may.
async fn snapshot_of(
    stream: &mut WatchStream,
    (earlier, filter_id): (Option<u64>, u64),
    what: &str,
    check_chunk: impl Fn(&aether_proto::registrar::v1::Snapshot),
) -> (Vec<String>, Vec<String>) {
    let (mut services, mut endpoints) = (Vec::new(), Vec::new());
    loop {
        let message = tokio::time::timeout(Duration::from_secs(10), stream.message())
            .await
            .expect(what)
            .expect("stream")
            .expect("message");
        match message.event.expect("event") {
            watch_response::Event::Snapshot(chunk) => {
                check_chunk(&chunk);
                services.extend(
                    chunk
                        .services
                        .into_iter()
                        .map(|s| format!("{}/{}", s.namespace, s.name)),
                );
                endpoints.extend(chunk.endpoints.into_iter().map(|e| e.address));
            }
            watch_response::Event::SnapshotComplete(c) => {
                assert_eq!(c.filter_id, filter_id);
                return (services, endpoints);
            }
            watch_response::Event::Delta(d) if earlier.is_some() => assert_eq!(Some(d.filter_id), earlier),
            other => panic!("unexpected before the snapshot completes: {other:?}"),
        }
    }
}

/// After web/front's new endpoint and the new web/back: deltas carrying nothing but web/back's addition.
async fn only_the_new_service_is_sent(stream: &mut WatchStream) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let message = tokio::time::timeout(deadline - Instant::now(), stream.message())
            .await
            .expect("the new service in time")
            .expect("stream")
            .expect("message");
        let watch_response::Event::Delta(delta) = message.event.expect("event") else {
            panic!("only deltas after the snapshot");
        };
        let mut added = Vec::new();
        for c in delta.changes {
            match c.change.expect("change") {
                change::Change::ServiceAdded(s) => added.push(format!("{}/{}", s.namespace, s.name)),
                other => panic!("a services-only watch got {other:?}"),
            }
        }
        if !added.is_empty() {
            assert_eq!(added, vec!["web/back"]);
            break;
        }
    }
}
