//! Properties of the edge projector: it never panics whatever the Gateway and routes
//! hold, it does not depend on the order routes arrive in, and `intersect` is the
//! Gateway API's intersection (independent of the side, and exactly the hosts both
//! sides match).

mod edge_support;

use aether_api::edge::{host_matches, intersect};
use edge_support::World;
use proptest::prelude::*;
use serde_json::json;

/// A hostname from a small alphabet (so sides often overlap), wildcard or not.
fn hostname() -> impl Strategy<Value = String> {
    (
        any::<bool>(),
        prop::collection::vec(prop::sample::select(vec!["a", "b", "c"]), 1..4),
    )
        .prop_map(|(wildcard, labels)| {
            let name = labels.join(".");
            if wildcard { format!("*.{name}") } else { name }
        })
}

/// A concrete host (what a request carries).
fn host() -> impl Strategy<Value = String> {
    prop::collection::vec(prop::sample::select(vec!["a", "b", "c"]), 1..5).prop_map(|l| l.join("."))
}

/// Any text, often hostname-like.
fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        hostname(),
        "[a-zA-Z0-9.*:_-]{0,20}",
        any::<String>(),
        Just(String::new()),
    ]
}

fn protocol() -> impl Strategy<Value = String> {
    prop_oneof![
        prop::sample::select(vec!["HTTP", "HTTPS", "TLS", "TCP", "UDP"]).prop_map(str::to_owned),
        text(),
    ]
}

fn port() -> impl Strategy<Value = i32> {
    prop_oneof![prop::sample::select(vec![80, 443, 8080]), any::<i32>()]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn intersecting_single_hostnames_does_not_depend_on_the_side(a in hostname(), b in hostname()) {
        prop_assert_eq!(intersect(Some(&a), std::slice::from_ref(&b)), intersect(Some(&b), std::slice::from_ref(&a)));
    }

    #[test]
    fn the_intersection_is_exactly_the_hosts_both_sides_match(
        listener in prop::option::of(hostname()),
        route in prop::collection::vec(hostname(), 0..4),
        host in host(),
    ) {
        let both = listener.as_deref().is_none_or(|l| host_matches(l, &host))
            && (route.is_empty() || route.iter().any(|r| host_matches(r, &host)));
        let hosts = intersect(listener.as_deref(), &route);
        let served = match hosts.is_empty() {
            // Empty means any host only when neither side sets one.
            true => listener.is_none() && route.is_empty(),
            false => hosts.iter().any(|h| host_matches(h, &host)),
        };
        prop_assert_eq!(served, both, "{:?} {:?} {} → {:?}", listener, route, host, hosts);
    }

    #[test]
    fn host_matches_never_panics(pattern in text(), host in text()) {
        let _ = host_matches(&pattern, &host);
        let _ = intersect(Some(&pattern), &[host]);
    }

    #[test]
    fn projecting_never_panics_and_ignores_route_order(
        listeners in prop::collection::vec((text(), protocol(), port(), prop::option::of(text()), any::<bool>()), 0..5),
        routes in prop::collection::vec(
            (
                prop::collection::vec(text(), 0..3),
                prop::option::of(text()),
                prop::option::of(port()),
                text(),
                prop::sample::select(vec!["HTTPRoute", "GRPCRoute", "TLSRoute", "TCPRoute"]),
            ),
            0..5,
        ),
    ) {
        let listeners: Vec<serde_json::Value> = (listeners.iter().enumerate())
            .map(|(i, (name, protocol, port, hostname, tls))| {
                let mut listener = json!({
                    "name": if i % 2 == 0 { format!("l{i}") } else { name.clone() },
                    "protocol": protocol,
                    "port": port,
                    "allowedRoutes": {"namespaces": {"from": "All"}},
                });
                if let Some(hostname) = hostname {
                    listener["hostname"] = json!(hostname);
                }
                if *tls {
                    listener["tls"] = json!({"mode": if i % 3 == 0 { "Passthrough" } else { "Terminate" },
                                             "certificateRefs": [{"name": "cert"}]});
                }
                listener
            })
            .collect();
        let gateway = json!({
            "metadata": {"name": "g", "namespace": "edge", "generation": 2},
            "spec": {"gatewayClassName": "aether", "listeners": listeners},
        });
        let mut world = World::new().secret(edge_support::tls_secret("edge", "cert", &["a.example.org"]));
        world.gateways.push(serde_json::from_value(gateway).unwrap());
        for (i, (hostnames, section, port, backend_namespace, kind)) in routes.iter().enumerate() {
            let (version, hostnames) = match *kind {
                "TCPRoute" => ("v1alpha2", json!([])),
                "TLSRoute" => ("v1alpha2", json!(hostnames)),
                _ => ("v1", json!(hostnames)),
            };
            let mut parent = json!({"name": "g", "namespace": "edge"});
            if let Some(section) = section {
                parent["sectionName"] = json!(section);
            }
            if let Some(port) = port {
                parent["port"] = json!(port);
            }
            let route = json!({
                "apiVersion": format!("gateway.networking.k8s.io/{version}"),
                "kind": kind,
                "metadata": {"name": format!("r{i}"), "namespace": if i % 2 == 0 { "edge" } else { "shop" }},
                "spec": {
                    "parentRefs": [parent],
                    "hostnames": hostnames,
                    "rules": [{"backendRefs": [{"name": "svc", "namespace": backend_namespace, "port": 80}]}],
                },
            });
            let parsed = aether_api::route_objects(&[Ok(route)]);
            if let Some(Ok(object)) = parsed.into_iter().next() {
                world.routes.push(object);
            }
        }
        world.services.insert("edge/svc".to_owned());
        let edge = world.project("edge/g");
        let ports: Vec<u32> = edge.ports.iter().map(|p| p.port).collect();
        prop_assert!(ports.windows(2).all(|w| w[0] < w[1]), "{:?}", ports);
        prop_assert!(edge.status.routes.iter().all(|(_, s)| s.conditions.len() == 2));
        prop_assert!(edge.status.listeners.iter().all(|l| l.conditions.len() == 4));
        let attached: i32 = edge.status.listeners.iter().map(|l| l.attached_routes).sum();
        let served: usize = edge.ports.iter().flat_map(|p| &p.listeners).map(|l| l.routes.len()).sum();
        prop_assert!(served <= usize::try_from(attached).unwrap());

        let mut reversed = world.clone();
        reversed.routes.reverse();
        prop_assert_eq!(reversed.project("edge/g"), edge);
    }
}
