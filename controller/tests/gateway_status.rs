//! The edge's Gateway API status, written by the controller's real status writer (and,
//! for leadership, its real leader election) against the one shared fake API server,
//! which speaks the real JSON: resourceVersions and their preconditions, the status
//! subresource, lists and watches. Timings are shortened; everything else is as run.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use aether_api::gateway::{Gateway, GatewayClass, HttpRoute};
use aether_controller::config::Config;
use aether_controller::gateway_status::{StatusWriter, Timing};
use aether_controller::leader::Election;
use aether_fakes::kube::ApiServer;
use clap::Parser;
use k8s_openapi::ByteString;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Namespace, Secret, Service};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use serde_json::{Value, json};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// Generous: two cores shared with other builds.
const TIMEOUT: Duration = Duration::from_secs(30);
const TIMING: Timing = Timing {
    debounce: Duration::from_millis(50),
    refresh: Duration::from_millis(300),
    absent_retry: Duration::from_millis(500),
};
const GATEWAY_NAME_LABEL: &str = "gateway.networking.k8s.io/gateway-name";

/// Stops the writer (and an election) when dropped.
struct Stop(CancellationToken);

impl Drop for Stop {
    fn drop(&mut self) {
        self.0.cancel();
    }
}

/// The status writer, told by `leading` whether it leads.
fn writer(server: &ApiServer, leading: watch::Receiver<bool>) -> Stop {
    let shutdown = CancellationToken::new();
    let writer = StatusWriter {
        client: server.client(),
        edges_namespace: "aether-system".into(),
        timing: TIMING,
    };
    tokio::spawn(writer.run(leading, shutdown.clone()));
    Stop(shutdown)
}

/// A writer that leads from the start; the sender keeps it leading.
fn leader(server: &ApiServer) -> (Stop, watch::Sender<bool>) {
    let (leading, follows) = watch::channel(true);
    (writer(server, follows), leading)
}

/// The edge's GatewayClass and the namespaces.
fn cluster() -> ApiServer {
    let server = ApiServer::start();
    server.apply::<GatewayClass>(json!({"metadata": {"name": "aether"}, "spec": {"controllerName": "aether.io/edge"}}));
    server.apply::<GatewayClass>(json!({"metadata": {"name": "theirs"}, "spec": {"controllerName": "example.io/gw"}}));
    for namespace in ["edge", "shop"] {
        server.apply::<Namespace>(json!({"metadata": {"name": namespace}}));
    }
    server
}

fn gateway(listeners: Value) -> Value {
    json!({"metadata": {"name": "web", "namespace": "edge"},
           "spec": {"gatewayClassName": "aether", "listeners": listeners}})
}

/// Takes routes from every namespace.
fn http_listener() -> Value {
    json!({"name": "http", "port": 80, "protocol": "HTTP", "allowedRoutes": {"namespaces": {"from": "All"}}})
}

/// A protocol the edge does not serve.
fn udp_listener() -> Value {
    json!({"name": "dns", "port": 53, "protocol": "UDP"})
}

fn https_listener() -> Value {
    json!({"name": "https", "port": 443, "protocol": "HTTPS", "hostname": "shop.example.com",
           "tls": {"certificateRefs": [{"name": "shop-cert"}]}})
}

/// The Service the chart creates for the Gateway, with `status`.
fn gateway_service(status: Value) -> Value {
    json!({"metadata": {"name": "web-edge", "namespace": "edge", "labels": {GATEWAY_NAME_LABEL: "web"}},
           "spec": {"type": "LoadBalancer", "clusterIP": "10.96.0.10", "ports": [{"port": 80}]},
           "status": status})
}

fn backend(name: &str) -> Value {
    json!({"metadata": {"name": name, "namespace": "shop"},
           "spec": {"clusterIP": "10.96.1.1", "ports": [{"port": 8080}]}})
}

/// The mesh's entry for a Service parent, as the registrar writes it.
fn mesh_entry() -> Value {
    json!({"parentRef": {"group": "", "kind": "Service", "name": "cart"},
           "controllerName": "aether.io/mesh",
           "conditions": [{"type": "Accepted", "status": "True", "reason": "Accepted", "message": "",
                           "observedGeneration": 1, "lastTransitionTime": "2025-01-01T00:00:00Z"}]})
}

fn route(name: &str, parent_refs: Value, backend: &str, status: Value) -> Value {
    json!({"metadata": {"name": name, "namespace": "shop"},
           "spec": {"parentRefs": parent_refs, "rules": [{"backendRefs": [{"name": backend, "port": 8080}]}]},
           "status": status})
}

fn to_web() -> Value {
    json!({"name": "web", "namespace": "edge", "sectionName": "http"})
}

/// `(type, status, reason)` of each condition.
fn conditions(conditions: &Value) -> Vec<(String, String, String)> {
    let text = |c: &Value, f: &str| c[f].as_str().unwrap_or_default().to_owned();
    let all = conditions.as_array().cloned().unwrap_or_default();
    all.iter()
        .map(|c| (text(c, "type"), text(c, "status"), text(c, "reason")))
        .collect()
}

fn expect(summary: &[(&str, &str, &str)]) -> Vec<(String, String, String)> {
    let owned = |s: &str| s.to_owned();
    summary.iter().map(|(a, b, c)| (owned(a), owned(b), owned(c))).collect()
}

fn listener<'a>(gateway: &'a Value, name: &str) -> &'a Value {
    let listeners = gateway["status"]["listeners"].as_array();
    let found = listeners.and_then(|l| l.iter().find(|l| l["name"] == name));
    found.unwrap_or(&Value::Null)
}

fn parents(route: &Value, controller: &str) -> Vec<Value> {
    let all = route["status"]["parents"].as_array().cloned().unwrap_or_default();
    all.into_iter().filter(|p| p["controllerName"] == controller).collect()
}

fn web(server: &ApiServer) -> Value {
    server.get::<Gateway>("edge", "web").unwrap_or_default()
}

fn http_route(server: &ApiServer, name: &str) -> Value {
    server.get::<HttpRoute>("shop", name).unwrap_or_default()
}

fn patches(server: &ApiServer) -> Vec<String> {
    let requests = server.requests().into_iter();
    requests.filter(|r| r.starts_with("PATCH ")).collect()
}

/// Polls `check` until it gives a value; panics with its last complaint at [`TIMEOUT`].
async fn until<T>(what: &str, mut check: impl FnMut() -> Result<T, String>) -> T {
    let deadline = Instant::now() + TIMEOUT;
    loop {
        match check() {
            Ok(value) => return value,
            Err(last) if Instant::now() > deadline => panic!("{what}: not within {TIMEOUT:?}; last: {last}"),
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
}

/// Until the Gateway's conditions are `want`; the Gateway.
async fn until_gateway(server: &ApiServer, want: &[(&str, &str, &str)]) -> Value {
    until("the Gateway's conditions", || {
        let gateway = web(server);
        match conditions(&gateway["status"]["conditions"]) == expect(want) {
            true => Ok(gateway),
            false => Err(format!("{:#}", gateway["status"])),
        }
    })
    .await
}

#[tokio::test]
async fn a_gateway_with_a_good_and_a_bad_listener_gets_its_conditions_listeners_and_addresses() {
    let server = cluster();
    server.apply::<Gateway>(gateway(json!([http_listener(), udp_listener()])));
    server.apply::<Service>(gateway_service(json!({})));
    let _writer = leader(&server);

    let accepted = [
        ("Accepted", "True", "ListenersNotValid"),
        ("Programmed", "True", "Programmed"),
    ];
    let gateway = until_gateway(&server, &accepted).await;
    let message = gateway["status"]["conditions"][0]["message"].as_str().unwrap();
    assert!(message.contains("listener \"dns\": UnsupportedProtocol"), "{message}");
    assert_eq!(gateway["status"]["conditions"][0]["observedGeneration"], 1);
    let http = listener(&gateway, "http");
    assert_eq!(
        conditions(&http["conditions"]),
        expect(&[
            ("Accepted", "True", "Accepted"),
            ("Programmed", "True", "Programmed"),
            ("ResolvedRefs", "True", "ResolvedRefs"),
            ("Conflicted", "False", "NoConflicts"),
        ])
    );
    let kinds = json!([{"group": "gateway.networking.k8s.io", "kind": "HTTPRoute"},
                       {"group": "gateway.networking.k8s.io", "kind": "GRPCRoute"}]);
    assert_eq!(http["supportedKinds"], kinds);
    assert_eq!(http["attachedRoutes"], 0);
    let dns = listener(&gateway, "dns");
    assert_eq!(
        conditions(&dns["conditions"]),
        expect(&[
            ("Accepted", "False", "UnsupportedProtocol"),
            ("Programmed", "False", "Invalid"),
            ("ResolvedRefs", "True", "ResolvedRefs"),
            ("Conflicted", "False", "NoConflicts"),
        ])
    );
    assert_eq!(dns["supportedKinds"], json!([]));
    // No load balancer yet: the Service's clusterIP.
    assert_eq!(
        gateway["status"]["addresses"],
        json!([{"type": "IPAddress", "value": "10.96.0.10"}])
    );

    let class = server.get::<GatewayClass>("", "aether").unwrap();
    assert_eq!(
        conditions(&class["status"]["conditions"]),
        expect(&[("Accepted", "True", "Accepted")])
    );
    let theirs = server.get::<GatewayClass>("", "theirs").unwrap();
    assert_eq!(
        theirs["status"],
        Value::Null,
        "another controller's class is not touched"
    );

    // The load balancer is provisioned: its addresses replace the clusterIP.
    let ingress = json!({"loadBalancer": {"ingress": [{"ip": "203.0.113.7"}, {"hostname": "web.example.net"}]}});
    server.apply::<Service>(gateway_service(ingress));
    let want = json!([{"type": "IPAddress", "value": "203.0.113.7"}, {"type": "Hostname", "value": "web.example.net"}]);
    until("the load balancer's addresses", || {
        let gateway = web(&server);
        match gateway["status"]["addresses"] == want {
            true => Ok(()),
            false => Err(gateway["status"]["addresses"].to_string()),
        }
    })
    .await;
    // Without its Service the Gateway has no address, and stays programmed.
    server.delete::<Service>("edge", "web-edge");
    let gateway = until("no address without the Service", || {
        let gateway = web(&server);
        match gateway["status"]["addresses"] == json!([]) {
            true => Ok(gateway),
            false => Err(gateway["status"]["addresses"].to_string()),
        }
    })
    .await;
    assert_eq!(conditions(&gateway["status"]["conditions"]), expect(&accepted));

    // The chart's layout: the edge's Service in the controller's namespace, naming the Gateway's.
    server.apply::<Service>(json!({
        "metadata": {"name": "aether-edge-web", "namespace": "aether-system",
                     "labels": {GATEWAY_NAME_LABEL: "web", "aether.io/gateway-namespace": "edge"}},
        "spec": {"type": "NodePort", "clusterIP": "10.96.0.20", "ports": [{"port": 80}]},
    }));
    until("the chart's Service's address", || {
        let gateway = web(&server);
        match gateway["status"]["addresses"] == json!([{"type": "IPAddress", "value": "10.96.0.20"}]) {
            true => Ok(()),
            false => Err(gateway["status"]["addresses"].to_string()),
        }
    })
    .await;
}

#[tokio::test]
async fn routes_get_their_parent_entries_merged_beside_another_controllers() {
    let server = cluster();
    server.apply::<Gateway>(gateway(json!([http_listener()])));
    server.apply::<Service>(backend("cart"));
    let service_parent = json!({"group": "", "kind": "Service", "name": "cart"});
    let cart = route(
        "cart",
        json!([to_web(), service_parent]),
        "cart",
        json!({"parents": [mesh_entry()]}),
    );
    server.apply::<HttpRoute>(cart);
    server.apply::<HttpRoute>(route("lost", json!([to_web()]), "nowhere", json!({})));
    // A route of another implementation's Gateway: not ours to write.
    let elsewhere = json!({"name": "elsewhere", "namespace": "edge"});
    let theirs = json!({"parents": [{"parentRef": elsewhere, "controllerName": "example.io/gw", "conditions": []}]});
    server.apply::<HttpRoute>(route("foreign", json!([elsewhere]), "cart", theirs.clone()));
    let _writer = leader(&server);

    let ours = until("the cart route's edge entry", || {
        let route = http_route(&server, "cart");
        match parents(&route, "aether.io/edge").as_slice() {
            [entry] => Ok(entry.clone()),
            _ => Err(format!("{:#}", route["status"])),
        }
    })
    .await;
    assert_eq!(
        conditions(&ours["conditions"]),
        expect(&[
            ("Accepted", "True", "Accepted"),
            ("ResolvedRefs", "True", "ResolvedRefs")
        ])
    );
    assert_eq!(
        ours["parentRef"],
        json!({"group": "gateway.networking.k8s.io", "kind": "Gateway", "namespace": "edge", "name": "web",
               "sectionName": "http"})
    );
    let cart = http_route(&server, "cart");
    assert_eq!(
        cart["status"]["parents"][0],
        mesh_entry(),
        "the mesh's entry is kept as it was, first"
    );

    let lost = until("the lost route's edge entry", || {
        let route = http_route(&server, "lost");
        match parents(&route, "aether.io/edge").as_slice() {
            [entry] => Ok(entry.clone()),
            _ => Err(format!("{:#}", route["status"])),
        }
    })
    .await;
    assert_eq!(
        conditions(&lost["conditions"]),
        expect(&[
            ("Accepted", "True", "Accepted"),
            ("ResolvedRefs", "False", "BackendNotFound")
        ])
    );
    let attached = until("both routes attached", || {
        let gateway = web(&server);
        match listener(&gateway, "http")["attachedRoutes"].as_i64() {
            Some(2) => Ok(()),
            other => Err(format!("{other:?}")),
        }
    });
    attached.await;
    assert_eq!(http_route(&server, "foreign")["status"], theirs);
    assert!(
        !patches(&server).iter().any(|p| p.contains("/httproutes/foreign")),
        "{:?}",
        patches(&server)
    );

    // The cart route leaves the Gateway: our entry goes, the mesh's stays.
    let mut moved = http_route(&server, "cart");
    moved["spec"]["parentRefs"] = json!([{"group": "", "kind": "Service", "name": "cart"}]);
    server.apply::<HttpRoute>(moved);
    until("the edge entry removed", || {
        let route = http_route(&server, "cart");
        match route["status"]["parents"] == json!([mesh_entry()]) {
            true => Ok(()),
            false => Err(format!("{:#}", route["status"])),
        }
    })
    .await;
    until("one route attached", || {
        let gateway = web(&server);
        match listener(&gateway, "http")["attachedRoutes"].as_i64() {
            Some(1) => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
}

fn tls_secret(crt: &[u8], key: &[u8]) -> Value {
    let secret = Secret {
        metadata: ObjectMeta {
            name: Some("shop-cert".into()),
            namespace: Some("edge".into()),
            ..ObjectMeta::default()
        },
        type_: Some("kubernetes.io/tls".into()),
        data: Some(BTreeMap::from([
            ("tls.crt".to_owned(), ByteString(crt.to_vec())),
            ("tls.key".to_owned(), ByteString(key.to_vec())),
        ])),
        ..Secret::default()
    };
    serde_json::to_value(secret).unwrap()
}

#[tokio::test]
async fn a_secret_fixed_later_flips_resolved_refs_and_only_that_secret_is_read() {
    let server = cluster();
    server.apply::<Gateway>(gateway(json!([http_listener(), https_listener()])));
    server.apply::<Secret>(tls_secret(b"not a certificate", b"nor a key"));
    let _writer = leader(&server);

    let https = until("the bad certificate reported", || {
        let gateway = web(&server);
        let https = listener(&gateway, "https").clone();
        match conditions(&https["conditions"]).get(2).map(|c| c.1.as_str()) {
            Some("False") => Ok(https),
            _ => Err(format!("{:#}", gateway["status"])),
        }
    })
    .await;
    assert_eq!(
        conditions(&https["conditions"]),
        expect(&[
            ("Accepted", "True", "Accepted"),
            ("Programmed", "False", "Invalid"),
            ("ResolvedRefs", "False", "InvalidCertificateRef"),
            ("Conflicted", "False", "NoConflicts"),
        ])
    );
    let message = https["conditions"][2]["message"].as_str().unwrap();
    assert!(message.contains("Secret \"edge/shop-cert\""), "{message}");
    assert!(
        !message.contains("nor a key"),
        "a Secret's content is never quoted: {message}"
    );
    let accepted_since = https["conditions"][0]["lastTransitionTime"].clone();

    // A new time would differ (times are in seconds).
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let key = rcgen::KeyPair::generate().unwrap();
    let certificate = rcgen::CertificateParams::new(vec!["shop.example.com".to_owned()])
        .unwrap()
        .self_signed(&key)
        .unwrap();
    server.apply::<Secret>(tls_secret(certificate.pem().as_bytes(), key.serialize_pem().as_bytes()));
    let https = until("the fixed certificate seen", || {
        let gateway = web(&server);
        let https = listener(&gateway, "https").clone();
        match conditions(&https["conditions"]).get(2).map(|c| c.1.as_str()) {
            Some("True") => Ok(https),
            _ => Err(format!("{:#}", gateway["status"])),
        }
    })
    .await;
    assert_eq!(conditions(&https["conditions"])[1].1, "True", "programmed");
    assert_eq!(
        https["conditions"][0]["lastTransitionTime"], accepted_since,
        "Accepted did not change: its time stays"
    );
    assert_ne!(https["conditions"][2]["lastTransitionTime"], accepted_since);

    // Least privilege: the one Secret named, by name; no Secret listed or watched.
    let reads: Vec<String> = (server.requests().into_iter())
        .filter(|r| r.contains("secrets"))
        .collect();
    assert!(reads.len() >= 2, "{reads:?}");
    assert!(
        reads
            .iter()
            .all(|r| r == "GET /api/v1/namespaces/edge/secrets/shop-cert"),
        "{reads:?}"
    );
}

fn lease_held_by(holder: &str, seconds: i32) -> Value {
    let now = serde_json::to_value(MicroTime(Timestamp::now())).unwrap();
    json!({"metadata": {"name": "aether-controller", "namespace": "aether-system"},
           "spec": {"holderIdentity": holder, "leaseDurationSeconds": seconds, "acquireTime": now, "renewTime": now}})
}

#[tokio::test]
async fn a_replica_that_does_not_lead_reads_and_writes_nothing_until_it_leads() {
    let server = cluster();
    server.apply::<Gateway>(gateway(json!([http_listener()])));
    // Another replica holds the Lease (and will stop renewing it).
    server.apply::<Lease>(lease_held_by("aether-controller-other", 4));
    let (leading, follows) = watch::channel(false);
    let election = Election {
        leases: kube::Api::namespaced(server.client(), "aether-system"),
        name: "aether-controller".into(),
        identity: "aether-controller-me".into(),
        duration: Duration::from_secs(3),
    };
    let stop = writer(&server, follows);
    tokio::spawn(election.run(leading, stop.0.clone()));

    tokio::time::sleep(Duration::from_secs(2)).await;
    let gateway_api: Vec<String> = (server.requests().into_iter())
        .filter(|r| r.contains("gateway.networking.k8s.io") || r.contains("secrets") || r.starts_with("PATCH "))
        .collect();
    assert_eq!(gateway_api, Vec::<String>::new(), "a follower neither reads nor writes");
    assert_eq!(web(&server)["status"], Value::Null);

    // The other's Lease runs out: this replica leads and writes.
    until_gateway(
        &server,
        &[("Accepted", "True", "Accepted"), ("Programmed", "True", "Programmed")],
    )
    .await;
    let lease = server.get::<Lease>("aether-system", "aether-controller").unwrap();
    assert_eq!(lease["spec"]["holderIdentity"], "aether-controller-me");
}

#[tokio::test]
async fn nothing_is_rewritten_when_unchanged() {
    let server = cluster();
    server.apply::<Gateway>(gateway(json!([http_listener(), udp_listener()])));
    server.apply::<Service>(gateway_service(json!({})));
    server.apply::<Service>(backend("cart"));
    let to_both = json!([to_web(), {"group": "", "kind": "Service", "name": "cart"}]);
    server.apply::<HttpRoute>(route("cart", to_both, "cart", json!({"parents": [mesh_entry()]})));
    let (first, _leading) = leader(&server);

    until("every status written", || {
        let route = http_route(&server, "cart");
        let gateway = web(&server);
        let class = server.get::<GatewayClass>("", "aether").unwrap_or_default();
        let written = parents(&route, "aether.io/edge").len() == 1
            && listener(&gateway, "http")["attachedRoutes"] == 1
            && gateway["status"]["addresses"] != Value::Null
            && class["status"]["conditions"] != Value::Null;
        written
            .then_some(())
            .ok_or_else(|| format!("{:#}\n{:#}", gateway["status"], route["status"]))
    })
    .await;
    // Several refresh periods, and changes that alter no status.
    tokio::time::sleep(TIMING.refresh * 3).await;
    server.apply::<Namespace>(json!({"metadata": {"name": "shop", "labels": {"team": "storefront"}}}));
    server.apply::<Service>(backend("unrelated"));
    tokio::time::sleep(TIMING.refresh * 3).await;
    // A new leader (a restart, a takeover) finds every status as it would write it.
    drop(first);
    let _second = leader(&server);
    tokio::time::sleep(TIMING.refresh * 3).await;

    let mut written = patches(&server);
    written
        .iter_mut()
        .for_each(|p| *p = p.split('?').next().unwrap_or_default().to_owned());
    written.sort();
    assert_eq!(
        written,
        [
            "PATCH /apis/gateway.networking.k8s.io/v1/gatewayclasses/aether/status",
            "PATCH /apis/gateway.networking.k8s.io/v1/namespaces/edge/gateways/web/status",
            "PATCH /apis/gateway.networking.k8s.io/v1/namespaces/shop/httproutes/cart/status",
        ],
        "each status written once, through the status subresource"
    );
}

#[tokio::test]
async fn a_leader_that_steps_down_stops_writing() {
    let server = cluster();
    server.apply::<Gateway>(gateway(json!([http_listener()])));
    let (_writer, leading) = leader(&server);
    let accepted = [("Accepted", "True", "Accepted"), ("Programmed", "True", "Programmed")];
    until_gateway(&server, &accepted).await;

    leading.send_replace(false);
    tokio::time::sleep(TIMING.refresh).await;
    let before = patches(&server);
    let mut changed = web(&server);
    changed["spec"]["listeners"] = json!([http_listener(), udp_listener()]);
    server.apply::<Gateway>(changed);
    tokio::time::sleep(TIMING.refresh * 3).await;
    assert_eq!(patches(&server), before, "a follower writes nothing");
    assert_eq!(web(&server)["status"]["conditions"][0]["observedGeneration"], 1);

    // Leading again: the new generation is written.
    leading.send_replace(true);
    let gateway = until_gateway(&server, &[("Accepted", "True", "ListenersNotValid"), accepted[1]]).await;
    assert_eq!(gateway["status"]["conditions"][0]["observedGeneration"], 2);
}

#[tokio::test]
async fn a_missing_gateway_crd_is_looked_for_again_and_holds_nothing_else_up() {
    let server = cluster();
    server.uninstall::<Gateway>();
    server.apply::<Gateway>(gateway(json!([http_listener()])));
    let _writer = leader(&server);

    until("the class accepted without Gateways", || {
        let class = server.get::<GatewayClass>("", "aether").unwrap_or_default();
        match conditions(&class["status"]["conditions"]).len() {
            1 => Ok(()),
            _ => Err(class.to_string()),
        }
    })
    .await;
    assert_eq!(web(&server)["status"], Value::Null);

    server.install::<Gateway>();
    until_gateway(
        &server,
        &[("Accepted", "True", "Accepted"), ("Programmed", "True", "Programmed")],
    )
    .await;
}

#[test]
fn gateway_status_is_on_unless_turned_off() {
    let parse = |extra: &[&str]| {
        let args = ["aether-controller", "--tls-cert", "c.pem", "--tls-key", "k.pem"];
        Config::try_parse_from(args.iter().chain(extra)).unwrap().gateway_status
    };
    assert!(parse(&[]));
    assert!(parse(&["--gateway-status"]));
    assert!(parse(&["--gateway-status=true"]));
    assert!(!parse(&["--gateway-status=false"]));
}
