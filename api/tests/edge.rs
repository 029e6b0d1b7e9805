//! The edge projector at the status level: the Gateway API conformance cases a pure
//! function can show, restated in our own words and data (each test names the upstream
//! test it restates), and the edge's own choices where the API leaves room.

mod edge_support;

use aether_api::edge::{ListenerProtocol, intersect};
use aether_api::route::project_detached;
use edge_support::*;

/// The namespaces of these tests: the gateway's own ("edge"), an app's ("shop"), a
/// payment team's ("pay").
const NAMESPACES: &str = "
kind: Namespace
metadata: {name: edge, labels: {team: platform}}
---
kind: Namespace
metadata: {name: shop, labels: {team: retail, exposed: 'yes'}}
---
kind: Namespace
metadata: {name: pay, labels: {team: payments}}
";

fn world() -> World {
    World::new().with(NAMESPACES)
}

/// An HTTPRoute `name` in `namespace` whose parentRefs and rules are YAML flow text.
fn http_route(namespace: &str, name: &str, extra: &str) -> String {
    format!(
        "apiVersion: gateway.networking.k8s.io/v1\nkind: HTTPRoute\n\
         metadata: {{name: {name}, namespace: {namespace}, generation: 3}}\nspec: {extra}\n---\n"
    )
}

/// Restates GatewayInvalidRouteKind: a listener asking only for a kind no HTTP
/// listener carries supports none and does not resolve; one asking for that kind and
/// HTTPRoute keeps HTTPRoute in supportedKinds but does not resolve either.
#[test]
fn a_listener_asking_for_a_route_kind_its_protocol_does_not_carry_is_unresolved() {
    let w = world().with(
        "
kind: Gateway
metadata: {name: odd-kinds, namespace: edge}
spec:
  gatewayClassName: aether
  listeners:
  - {name: web, port: 80, protocol: HTTP, allowedRoutes: {namespaces: {from: All}, kinds: [{kind: FancyRoute}]}}
---
kind: Gateway
metadata: {name: some-kinds, namespace: edge}
spec:
  gatewayClassName: aether
  listeners:
  - name: web
    port: 80
    protocol: HTTP
    allowedRoutes: {namespaces: {from: All}, kinds: [{kind: FancyRoute}, {kind: HTTPRoute}, {kind: TCPRoute}]}
",
    );
    let only_unknown = w.project("edge/odd-kinds");
    assert_eq!(kinds(&only_unknown, "web"), Vec::<String>::new());
    assert_eq!(
        listener_summary(&only_unknown, "web")[2],
        ("False", "InvalidRouteKinds")
    );
    assert_eq!(listener(&only_unknown, "web").attached_routes, 0);
    assert!(only_unknown.ports.is_empty());

    let mixed = w.project("edge/some-kinds");
    assert_eq!(kinds(&mixed, "web"), ["HTTPRoute"]);
    let group = &listener(&mixed, "web").supported_kinds[0].group;
    assert_eq!(group, "gateway.networking.k8s.io");
    let [accepted, programmed, resolved, _] = listener_summary(&mixed, "web");
    assert_eq!(
        (accepted, programmed, resolved),
        (
            ("True", "Accepted"),
            ("False", "Invalid"),
            ("False", "InvalidRouteKinds")
        )
    );
    let message = &listener(&mixed, "web").conditions[2].message;
    assert!(
        message.contains("allowedRoutes.kinds[0]") && message.contains("FancyRoute"),
        "{message}"
    );
}

/// Restates GatewayInvalidTLSConfiguration: an HTTPS listener whose certificateRef is
/// a missing Secret, another group, another kind, or a Secret that is not a certificate
/// (and, beyond upstream, one whose key belongs to another certificate) reports
/// `ResolvedRefs=False, InvalidCertificateRef`, keeps HTTPRoute among its kinds, and is
/// not served.
#[test]
fn https_listeners_with_unusable_certificates_are_not_served() {
    let (cert, _) = tls_pair(&["secure.example.org"]);
    let (_, other_key) = tls_pair(&["secure.example.org"]);
    let w = world()
        .secret(secret(
            "edge",
            "garbage",
            Some("kubernetes.io/tls"),
            &[("tls.crt", b"Hello world\n"), ("tls.key", b"Hello world\n")],
        ))
        .secret(secret(
            "edge",
            "mismatched",
            Some("kubernetes.io/tls"),
            &[("tls.crt", cert.as_bytes()), ("tls.key", other_key.as_bytes())],
        ))
        .secret(tls_secret("edge", "good", &["secure.example.org"]));
    let cases = [
        ("missing", "{group: '', kind: Secret, name: nowhere}", "does not exist"),
        (
            "group",
            "{group: certs.example.org, kind: Secret, name: good}",
            "is not a core Secret",
        ),
        ("kind", "{group: '', kind: Vault, name: good}", "is not a core Secret"),
        ("malformed", "{name: garbage}", "tls.crt"),
        ("mismatched", "{name: mismatched}", "does not match"),
    ];
    for (name, reference, message) in cases {
        let yaml = format!(
            "kind: Gateway\nmetadata: {{name: {name}, namespace: edge}}\nspec:\n  gatewayClassName: aether\n  listeners:\n  \
             - {{name: https, port: 443, protocol: HTTPS, allowedRoutes: {{namespaces: {{from: All}}}}, \
             tls: {{certificateRefs: [{reference}]}}}}\n"
        );
        let edge = w.clone().with(&yaml).project(&format!("edge/{name}"));
        assert!(kinds(&edge, "https").contains(&"HTTPRoute".to_owned()), "{name}");
        let [_, programmed, resolved, _] = listener_summary(&edge, "https");
        assert_eq!(
            (programmed.0, resolved),
            ("False", ("False", "InvalidCertificateRef")),
            "{name}"
        );
        let text = &listener(&edge, "https").conditions[2].message;
        assert!(
            text.contains("tls.certificateRefs[0]") && text.contains(message),
            "{name}: {text}"
        );
        assert_eq!(listener(&edge, "https").attached_routes, 0);
        assert!(edge.ports.is_empty(), "{name}");
        // Accepted with a listener that resolves nothing: nothing is programmed.
        assert_eq!(
            condition(&edge.status.gateway, "Programmed"),
            ("False", "Invalid"),
            "{name}"
        );
    }
}

/// A Gateway whose HTTPS listener takes its certificate from `pay/wallet-cert`.
fn cross_namespace_certificate(grants: &str) -> World {
    world()
        .secret(tls_secret("pay", "wallet-cert", &["wallet.example.org"]))
        .with(
            "
kind: Gateway
metadata: {name: wallet, namespace: edge}
spec:
  gatewayClassName: aether
  listeners:
  - name: https
    port: 443
    protocol: HTTPS
    allowedRoutes: {namespaces: {from: All}}
    tls: {certificateRefs: [{group: '', kind: Secret, name: wallet-cert, namespace: pay}]}
",
        )
        .with(grants)
}

/// Restates GatewaySecretMissingReferenceGrant and GatewaySecretInvalidReferenceGrant: a
/// certificate in another namespace with no grant, or only grants that miss by grant
/// namespace, from group, from kind, from namespace, to group, to kind or to name, is
/// `ResolvedRefs=False, RefNotPermitted`.
#[test]
fn a_certificate_in_another_namespace_without_a_matching_grant_is_not_permitted() {
    let grant = |namespace: &str, from: &str, to: &str| {
        format!(
            "kind: ReferenceGrant\nmetadata: {{name: g, namespace: {namespace}}}\nspec: {{from: [{from}], to: [{to}]}}\n"
        )
    };
    let from = "{group: gateway.networking.k8s.io, kind: Gateway, namespace: edge}";
    let to = "{group: '', kind: Secret, name: wallet-cert}";
    let misses = [
        ("none", String::new()),
        ("grant in another namespace", grant("shop", from, to)),
        (
            "from another group",
            grant("pay", "{group: other.example.org, kind: Gateway, namespace: edge}", to),
        ),
        (
            "from another kind",
            grant(
                "pay",
                "{group: gateway.networking.k8s.io, kind: HTTPRoute, namespace: edge}",
                to,
            ),
        ),
        (
            "from another namespace",
            grant(
                "pay",
                "{group: gateway.networking.k8s.io, kind: Gateway, namespace: shop}",
                to,
            ),
        ),
        (
            "to another group",
            grant(
                "pay",
                from,
                "{group: other.example.org, kind: Secret, name: wallet-cert}",
            ),
        ),
        (
            "to another kind",
            grant("pay", from, "{group: '', kind: ConfigMap, name: wallet-cert}"),
        ),
        (
            "to another name",
            grant("pay", from, "{group: '', kind: Secret, name: other-cert}"),
        ),
    ];
    for (case, grants) in misses {
        let edge = cross_namespace_certificate(&grants).project("edge/wallet");
        let [_, programmed, resolved, _] = listener_summary(&edge, "https");
        assert_eq!(
            (programmed.0, resolved),
            ("False", ("False", "RefNotPermitted")),
            "{case}"
        );
        assert_eq!(kinds(&edge, "https"), ["HTTPRoute", "GRPCRoute"], "{case}");
        assert!(edge.ports.is_empty(), "{case}");
    }
}

/// Restates GatewaySecretReferenceGrantAllInNamespace and
/// GatewaySecretReferenceGrantSpecific: a grant for every Secret of the namespace, or for
/// that one, lets the listener resolve and be programmed with the certificate.
#[test]
fn a_reference_grant_lets_a_listener_use_a_certificate_of_another_namespace() {
    let grants = [
        "{group: '', kind: Secret}",
        "{group: '', kind: Secret, name: wallet-cert}",
        "{group: core, kind: Secret, name: wallet-cert}",
    ];
    for to in grants {
        let yaml = format!(
            "kind: ReferenceGrant\nmetadata: {{name: g, namespace: pay}}\nspec:\n  from: \
             [{{group: gateway.networking.k8s.io, kind: Gateway, namespace: edge}}]\n  to: [{to}]\n"
        );
        let edge = cross_namespace_certificate(&yaml).project("edge/wallet");
        let [accepted, programmed, resolved, conflicted] = listener_summary(&edge, "https");
        assert_eq!(
            [accepted, programmed, resolved, conflicted],
            [
                ("True", "Accepted"),
                ("True", "Programmed"),
                ("True", "ResolvedRefs"),
                ("False", "NoConflicts")
            ],
            "{to}"
        );
        assert_eq!(edge.ports.len(), 1);
        let port = &edge.ports[0];
        assert_eq!((port.port, port.protocol), (443, ListenerProtocol::Https));
        let certificates = &port.listeners[0].certificates;
        assert_eq!(certificates.len(), 1);
        assert_eq!(certificates[0].0, "pay/wallet-cert");
        assert_eq!(certificates[0].1.dns_names, ["wallet.example.org"]);
    }
}

const ATTACHED_ROUTES: &str = "
kind: Gateway
metadata: {name: one-route, namespace: edge}
spec:
  gatewayClassName: aether
  listeners:
  - name: web
    port: 80
    protocol: HTTP
    allowedRoutes:
      kinds: [{kind: HTTPRoute}]
      namespaces: {from: Selector, selector: {matchLabels: {kubernetes.io/metadata.name: shop}}}
---
kind: Gateway
metadata: {name: two-routes, namespace: edge}
spec:
  gatewayClassName: aether
  listeners:
  - name: web
    port: 80
    protocol: HTTP
    hostname: store.example.org
    allowedRoutes:
      kinds: [{kind: HTTPRoute}]
      namespaces: {from: Selector, selector: {matchExpressions: [{key: team, operator: In, values: [retail]}]}}
---
kind: Gateway
metadata: {name: unresolved, namespace: edge}
spec:
  gatewayClassName: aether
  listeners:
  - name: secure
    port: 443
    protocol: HTTPS
    allowedRoutes:
      kinds: [{kind: HTTPRoute}]
      namespaces: {from: Selector, selector: {matchLabels: {exposed: 'yes'}}}
    tls: {mode: Terminate, certificateRefs: [{name: not-there}]}
";

/// Restates GatewayWithAttachedRoutes: `attachedRoutes` counts the routes a listener
/// takes (namespace selector, kinds, hostnames); a route whose hostnames miss the
/// listener's is `NoMatchingListenerHostname` and not counted; a listener that does not
/// resolve still counts the route attached to it, and that route's missing backend is
/// `ResolvedRefs=False`.
#[test]
fn attached_routes_count_what_each_listener_takes() {
    let mut yaml = ATTACHED_ROUTES.to_owned();
    let to_cart = "rules: [{backendRefs: [{name: cart, port: 8080}]}]";
    for (name, gateway, hostnames) in [
        ("first", "one-route", ""),
        ("second", "two-routes", ""),
        ("third", "two-routes", ""),
        ("elsewhere", "two-routes", "hostnames: [other.example.net], "),
    ] {
        let spec =
            format!("{{{hostnames}parentRefs: [{{kind: Gateway, name: {gateway}, namespace: edge}}], {to_cart}}}");
        yaml.push_str(&format!("---\n{}", http_route("shop", name, &spec)));
    }
    let spec = "{parentRefs: [{name: unresolved, namespace: edge, sectionName: secure}], \
                rules: [{backendRefs: [{name: gone, port: 8080}]}]}";
    yaml.push_str(&format!("---\n{}", http_route("shop", "fourth", spec)));
    let w = world().with(&yaml).services(&["shop/cart"]);

    let one = w.project("edge/one-route");
    assert_eq!(listener(&one, "web").attached_routes, 1);
    assert_eq!(listener_summary(&one, "web")[0], ("True", "Accepted"));
    assert_eq!(listener_summary(&one, "web")[2], ("True", "ResolvedRefs"));
    assert_eq!(
        served(&one),
        [(80, "web".to_owned(), vec![("http/shop/first".to_owned(), vec![])])]
    );

    let two = w.project("edge/two-routes");
    assert_eq!(listener(&two, "web").attached_routes, 2);
    assert_eq!(
        route_summary(&two, "http/shop/elsewhere")[0],
        ("False", "NoMatchingListenerHostname")
    );
    assert_eq!(
        route_summary(&two, "http/shop/second"),
        [("True", "Accepted"), ("True", "ResolvedRefs")]
    );
    let hosts = vec!["store.example.org".to_owned()];
    let routes = vec![
        ("http/shop/second".to_owned(), hosts.clone()),
        ("http/shop/third".to_owned(), hosts),
    ];
    assert_eq!(served(&two), [(80, "web".to_owned(), routes)]);

    let unresolved = w.project("edge/unresolved");
    assert_eq!(listener(&unresolved, "secure").attached_routes, 1);
    let [_, programmed, resolved, _] = listener_summary(&unresolved, "secure");
    assert_eq!((programmed.0, resolved.0), ("False", "False"));
    assert_eq!(
        route_summary(&unresolved, "http/shop/fourth"),
        [("True", "Accepted"), ("False", "BackendNotFound")]
    );
    assert!(unresolved.ports.is_empty());
}

const MODIFY_LISTENERS: &str = "
kind: Gateway
metadata: {name: growing, namespace: edge, generation: 1}
spec:
  gatewayClassName: aether
  listeners:
  - name: https
    port: 443
    protocol: HTTPS
    hostname: secure.example.org
    allowedRoutes: {namespaces: {from: All}}
    tls: {certificateRefs: [{name: secure-cert, namespace: edge}]}
";

/// Restates GatewayModifyListeners: a listener added to a Gateway is accepted, resolved
/// and takes the route that names the whole Gateway; removed, it is gone from status and
/// from what is served, and the one left keeps its route.
#[test]
fn adding_and_removing_a_listener_changes_what_is_served() {
    let route = http_route(
        "shop",
        "front",
        "{parentRefs: [{name: growing, namespace: edge}], rules: [{backendRefs: [{name: cart, port: 8080}]}]}",
    );
    let w = world()
        .secret(tls_secret("edge", "secure-cert", &["secure.example.org"]))
        .services(&["shop/cart"])
        .with(MODIFY_LISTENERS)
        .with(&route);
    let before = w.project("edge/growing");
    assert_eq!(before.status.listeners.len(), 1);
    assert_eq!(listener(&before, "https").attached_routes, 1);

    let mut grown = w.clone();
    let gateway = &mut grown.gateways[0];
    gateway.metadata.generation = Some(2);
    let plain: aether_api::gateway::Listener = serde_json::from_value(serde_json::json!({
        "name": "http", "port": 80, "protocol": "HTTP", "hostname": "data.example.org",
        "allowedRoutes": {"namespaces": {"from": "All"}},
    }))
    .unwrap();
    gateway.spec.listeners.push(plain);
    let after = grown.project("edge/growing");
    for name in ["https", "http"] {
        let [accepted, _, resolved, _] = listener_summary(&after, name);
        assert_eq!((accepted.0, resolved.0), ("True", "True"), "{name}");
        assert_eq!(listener(&after, name).attached_routes, 1, "{name}");
        assert!(kinds(&after, name).contains(&"HTTPRoute".to_owned()));
    }
    let ports: Vec<(u32, ListenerProtocol)> = after.ports.iter().map(|p| (p.port, p.protocol)).collect();
    assert_eq!(ports, [(80, ListenerProtocol::Http), (443, ListenerProtocol::Https)]);
    assert!(after.status.gateway.iter().all(|c| c.observed_generation == Some(2)));

    let mut shrunk = grown.clone();
    let gateway = &mut shrunk.gateways[0];
    gateway.metadata.generation = Some(3);
    gateway.spec.listeners.retain(|l| l.name == "http");
    let last = shrunk.project("edge/growing");
    assert_eq!(last.status.listeners.len(), 1);
    assert_eq!(listener(&last, "http").attached_routes, 1);
    let hosts = vec!["data.example.org".to_owned()];
    assert_eq!(
        served(&last),
        [(80, "http".to_owned(), vec![("http/shop/front".to_owned(), hosts)])]
    );
}

const HOSTNAME_INTERSECTION: &str = "
kind: Gateway
metadata: {name: hosts, namespace: edge}
spec:
  gatewayClassName: aether
  listeners:
  - {name: exact, port: 80, protocol: HTTP, hostname: api.example.org}
  - {name: wild, port: 80, protocol: HTTP, hostname: '*.shop.example.net'}
  - {name: other-wild, port: 80, protocol: HTTP, hostname: '*.pay.example.net'}
---
kind: Gateway
metadata: {name: any-host, namespace: edge}
spec:
  gatewayClassName: aether
  listeners:
  - {name: web, port: 80, protocol: HTTP}
";

/// Restates HTTPRouteHostnameIntersection: a route attaches to each listener it shares
/// hosts with and serves only the shared ones (its exact host under a wildcard listener,
/// the listener's exact host under its wildcard, a narrower or equal wildcard); a route
/// sharing none is `NoMatchingListenerHostname`; `attachedRoutes` counts accepted routes
/// per listener; a listener with no hostname serves the route's own.
#[test]
fn routes_serve_the_hosts_they_share_with_each_listener() {
    let route = |name: &str, hostnames: &str, gateway: &str| {
        let spec = format!(
            "{{parentRefs: [{{name: {gateway}}}], hostnames: {hostnames}, rules: [{{backendRefs: [{{name: cart, port: 80}}]}}]}}"
        );
        http_route("edge", name, &spec)
    };
    let yaml = [
        route(
            "exact-on-exact",
            "[nope.example.com, '*.nope.example.io', api.example.org]",
            "hosts",
        ),
        route(
            "exact-on-wild",
            "[nope.example.com, shop.example.net, a.shop.example.net, b.c.shop.example.net]",
            "hosts",
        ),
        route("wild-on-exact", "[nope.example.com, '*.example.org']", "hosts"),
        route("wild-on-wild", "['*.pay.example.net']", "hosts"),
        route(
            "disjoint",
            "[wrong.example.org, shop.example.net, '*.example.com']",
            "hosts",
        ),
        route("everything", "[one.example.com, two.example.com]", "any-host"),
    ]
    .concat();
    let w = world().with(HOSTNAME_INTERSECTION).with(&yaml).services(&["edge/cart"]);
    let edge = w.project("edge/hosts");
    for name in ["exact-on-exact", "exact-on-wild", "wild-on-exact", "wild-on-wild"] {
        let key = format!("http/edge/{name}");
        assert_eq!(
            route_summary(&edge, &key),
            [("True", "Accepted"), ("True", "ResolvedRefs")],
            "{name}"
        );
    }
    assert_eq!(
        route_summary(&edge, "http/edge/disjoint")[0],
        ("False", "NoMatchingListenerHostname")
    );
    let expected = |routes: &[(&str, &[&str])]| -> Vec<(String, Vec<String>)> {
        (routes.iter())
            .map(|(k, hosts)| {
                (
                    format!("http/edge/{k}"),
                    hosts.iter().map(|h| (*h).to_owned()).collect(),
                )
            })
            .collect()
    };
    let on_hosts = served(&edge);
    assert_eq!(on_hosts.len(), 3);
    // Routes of one listener come oldest first, then by name (all are equally old here).
    assert_eq!(
        on_hosts[0].2,
        expected(&[
            ("exact-on-exact", &["api.example.org"]),
            ("wild-on-exact", &["api.example.org"])
        ])
    );
    assert_eq!(
        on_hosts[1].2,
        expected(&[("exact-on-wild", &["a.shop.example.net", "b.c.shop.example.net"])])
    );
    assert_eq!(on_hosts[2].2, expected(&[("wild-on-wild", &["*.pay.example.net"])]));
    let attached: Vec<i32> = edge.status.listeners.iter().map(|l| l.attached_routes).collect();
    assert_eq!(attached, [2, 1, 1]);

    let any = w.project("edge/any-host");
    let hosts: &[&str] = &["one.example.com", "two.example.com"];
    assert_eq!(served(&any)[0].2, expected(&[("everything", hosts)]));
    // The same answer `intersect` gives.
    assert_eq!(intersect(None, &["one.example.com".to_owned()]), ["one.example.com"]);
}

/// Restates HTTPRouteListenerHostnameMatching: four HTTP listeners on one port told
/// apart by hostname, each route attached by sectionName to its own (one route to two);
/// each listener serves its own hostname only.
#[test]
fn listeners_on_one_port_are_told_apart_by_hostname() {
    let gateway = "
kind: Gateway
metadata: {name: by-host, namespace: edge}
spec:
  gatewayClassName: aether
  listeners:
  - {name: l1, port: 80, protocol: HTTP, hostname: example.org}
  - {name: l2, port: 80, protocol: HTTP, hostname: www.example.org}
  - {name: l3, port: 80, protocol: HTTP, hostname: '*.example.org'}
  - {name: l4, port: 80, protocol: HTTP, hostname: '*.example.com'}
";
    let rule = "rules: [{backendRefs: [{name: cart, port: 80}]}]";
    let routes = [
        http_route(
            "edge",
            "v1",
            &format!("{{parentRefs: [{{name: by-host, sectionName: l1}}], {rule}}}"),
        ),
        http_route(
            "edge",
            "v2",
            &format!("{{parentRefs: [{{name: by-host, sectionName: l2}}], {rule}}}"),
        ),
        http_route(
            "edge",
            "v3",
            &format!(
                "{{parentRefs: [{{name: by-host, sectionName: l3}}, {{name: by-host, sectionName: l4}}], {rule}}}"
            ),
        ),
    ]
    .concat();
    let edge = world()
        .with(gateway)
        .with(&routes)
        .services(&["edge/cart"])
        .project("edge/by-host");
    assert_eq!(edge.ports.len(), 1);
    let by_listener: Vec<(String, Option<String>, Vec<String>)> = (edge.ports[0].listeners.iter())
        .map(|l| {
            let keys = l
                .routes
                .iter()
                .map(|a| aether_proto::view::route_key(&a.route))
                .collect();
            (l.name.clone(), l.hostname.clone(), keys)
        })
        .collect();
    let row = |name: &str, host: &str, route: &str| (name.to_owned(), Some(host.to_owned()), vec![route.to_owned()]);
    assert_eq!(
        by_listener,
        [
            row("l1", "example.org", "http/edge/v1"),
            row("l2", "www.example.org", "http/edge/v2"),
            row("l3", "*.example.org", "http/edge/v3"),
            row("l4", "*.example.com", "http/edge/v3"),
        ]
    );
    // One status per parentRef: v3 has two, both accepted.
    let v3 = route_statuses(&edge, "http/edge/v3");
    assert_eq!(v3.len(), 2);
    assert!(
        v3.iter()
            .all(|s| condition(&s.conditions, "Accepted") == ("True", "Accepted"))
    );
    assert!(v3.iter().all(|s| s.controller_name == "aether.io/edge"));
    assert_eq!(v3[1].parent_ref.section_name.as_deref(), Some("l4"));
}

/// The Gateway most parentRef tests use: one HTTP listener "web" on port 80 taking routes
/// from its own namespace.
const SAME_NAMESPACE: &str = "
kind: Gateway
metadata: {name: same-ns, namespace: edge}
spec:
  gatewayClassName: aether
  listeners:
  - {name: web, port: 80, protocol: HTTP, allowedRoutes: {namespaces: {from: Same}}}
";

fn same_namespace_with(route: &str) -> aether_api::edge::Edge {
    world()
        .with(SAME_NAMESPACE)
        .with(route)
        .services(&["edge/cart", "shop/cart"])
        .project("edge/same-ns")
}

/// Restates HTTPRouteInvalidParentRefNotMatchingListenerPort and
/// HTTPRouteInvalidParentRefNotMatchingSectionName: a parentRef whose port or
/// sectionName selects no listener is `Accepted=False, NoMatchingParent` (references
/// still resolve) and attaches nowhere.
#[test]
fn a_parent_ref_selecting_no_listener_matches_no_parent() {
    for parent in [
        "{name: same-ns, namespace: edge, port: 81}",
        "{name: same-ns, namespace: edge, port: 80, sectionName: web2}",
        "{name: same-ns, port: 81, sectionName: web}",
    ] {
        let route = http_route(
            "edge",
            "lost",
            &format!(
                "{{parentRefs: [{parent}], rules: [{{backendRefs: [{{name: cart, kind: Service, port: 8080}}]}}]}}"
            ),
        );
        let edge = same_namespace_with(&route);
        assert_eq!(
            route_summary(&edge, "http/edge/lost"),
            [("False", "NoMatchingParent"), ("True", "ResolvedRefs")],
            "{parent}"
        );
        assert_eq!(listener(&edge, "web").attached_routes, 0);
        assert!(served(&edge)[0].2.is_empty());
    }
}

/// Restates HTTPRouteDisallowedKind: an HTTPRoute naming a Gateway whose only listener
/// takes TLSRoutes is `NotAllowedByListeners` and not counted.
#[test]
fn a_route_kind_no_listener_takes_is_not_allowed() {
    let yaml = "
kind: Gateway
metadata: {name: passthrough-only, namespace: edge}
spec:
  gatewayClassName: aether
  listeners:
  - {name: tls, port: 443, protocol: TLS, tls: {mode: Passthrough}, allowedRoutes: {kinds: [{kind: TLSRoute}]}}
";
    let route = http_route(
        "edge",
        "plain",
        "{parentRefs: [{name: passthrough-only}], rules: [{backendRefs: [{name: cart, port: 8080}]}]}",
    );
    let edge = world()
        .with(yaml)
        .with(&route)
        .services(&["edge/cart"])
        .project("edge/passthrough-only");
    assert_eq!(
        route_summary(&edge, "http/edge/plain"),
        [("False", "NotAllowedByListeners"), ("True", "ResolvedRefs")]
    );
    assert_eq!(listener(&edge, "tls").attached_routes, 0);
    assert_eq!(kinds(&edge, "tls"), ["TLSRoute"]);
}

/// Restates HTTPRouteInvalidCrossNamespaceParentRef: a route in another namespace naming
/// a Gateway whose listener takes routes from its own namespace only is
/// `NotAllowedByListeners`.
#[test]
fn a_route_from_a_namespace_the_listener_does_not_take_is_not_allowed() {
    let route = http_route(
        "shop",
        "intruder",
        "{parentRefs: [{name: same-ns, namespace: edge}], rules: [{backendRefs: [{name: cart, port: 8080}]}]}",
    );
    let edge = same_namespace_with(&route);
    assert_eq!(
        route_summary(&edge, "http/shop/intruder"),
        [("False", "NotAllowedByListeners"), ("True", "ResolvedRefs")]
    );
    assert_eq!(listener(&edge, "web").attached_routes, 0);
}

/// Restates HTTPRouteInvalidCrossNamespaceBackendRef: a backend in another namespace
/// without a grant is `ResolvedRefs=False, RefNotPermitted`; the route stays attached
/// and the edge never sends to that backend (the rule is left with none: 500).
#[test]
fn a_backend_in_another_namespace_without_a_grant_is_never_sent_to() {
    let route = http_route(
        "edge",
        "reach-out",
        "{parentRefs: [{name: same-ns}], rules: [{backendRefs: [{name: cart, namespace: shop, port: 8080}]}]}",
    );
    let edge = same_namespace_with(&route);
    let [accepted, resolved] = route_summary(&edge, "http/edge/reach-out");
    assert_eq!(
        (accepted, resolved),
        (("True", "Accepted"), ("False", "RefNotPermitted"))
    );
    let message = &route_statuses(&edge, "http/edge/reach-out")[0].conditions[1].message;
    assert!(
        message.starts_with("spec.rules[0].backendRefs[0]: no ReferenceGrant"),
        "{message}"
    );
    assert_eq!(listener(&edge, "web").attached_routes, 1);
    assert_eq!(backends(&edge, "http/edge/reach-out"), [Vec::<String>::new()]);
}

/// Restates HTTPRouteInvalidNonExistentBackendRef: a backend Service that does not
/// exist is `ResolvedRefs=False, BackendNotFound`; the route stays attached with the
/// backend (the edge answers 500 for it).
#[test]
fn a_backend_that_does_not_exist_stays_and_is_reported() {
    let route = http_route(
        "edge",
        "ghost",
        "{parentRefs: [{name: same-ns}], rules: [{backendRefs: [{name: nowhere, namespace: edge, port: 8080}]}]}",
    );
    let edge = same_namespace_with(&route);
    assert_eq!(
        route_summary(&edge, "http/edge/ghost"),
        [("True", "Accepted"), ("False", "BackendNotFound")]
    );
    assert_eq!(backends(&edge, "http/edge/ghost"), [vec!["edge/nowhere".to_owned()]]);
}

/// Restates HTTPRouteInvalidBackendRefUnknownKind: a backend of an unknown kind is
/// `ResolvedRefs=False, InvalidKind`; the route stays accepted and attached, and the
/// rule is left with no backend (500).
#[test]
fn a_backend_of_an_unknown_kind_is_left_out() {
    let route = http_route(
        "edge",
        "odd-backend",
        "{parentRefs: [{name: same-ns}], rules: [{backendRefs: [{group: things.example.org, kind: Thing, name: cart, port: 8080}, \
         {name: cart, port: 8080, weight: 3}]}]}",
    );
    let edge = same_namespace_with(&route);
    let [accepted, resolved] = route_summary(&edge, "http/edge/odd-backend");
    assert_eq!((accepted, resolved), (("True", "Accepted"), ("False", "InvalidKind")));
    // The Service backend keeps its weight; the other is gone.
    assert_eq!(backends(&edge, "http/edge/odd-backend"), [vec!["edge/cart".to_owned()]]);
}

/// Restates HTTPRouteReferenceGrant: with a grant from HTTPRoutes of the route's
/// namespace to that Service, the cross-namespace backend resolves and is served;
/// without the grant it is not permitted and dropped.
#[test]
fn a_reference_grant_lets_a_route_send_to_another_namespace() {
    let route = http_route(
        "edge",
        "granted",
        "{parentRefs: [{name: same-ns}], rules: [{backendRefs: [{name: cart, namespace: shop, port: 8080}]}]}",
    );
    let grant = "
kind: ReferenceGrant
metadata: {name: edge-to-cart, namespace: shop}
spec:
  from: [{group: gateway.networking.k8s.io, kind: HTTPRoute, namespace: edge}]
  to: [{group: '', kind: Service, name: cart}]
";
    let with_grant = world()
        .with(SAME_NAMESPACE)
        .with(&route)
        .with(grant)
        .services(&["shop/cart"]);
    let edge = with_grant.project("edge/same-ns");
    assert_eq!(
        route_summary(&edge, "http/edge/granted"),
        [("True", "Accepted"), ("True", "ResolvedRefs")]
    );
    assert_eq!(backends(&edge, "http/edge/granted"), [vec!["shop/cart".to_owned()]]);

    let mut revoked = with_grant.clone();
    revoked.grants.clear();
    let edge = revoked.project("edge/same-ns");
    assert_eq!(
        route_summary(&edge, "http/edge/granted")[1],
        ("False", "RefNotPermitted")
    );
    assert_eq!(backends(&edge, "http/edge/granted"), [Vec::<String>::new()]);
}

/// Restates GatewayObservedGenerationBump (and GatewayClassObservedGenerationBump for
/// the class): every condition carries the generation of its object, so a spec change
/// moves them all; times are the projection's.
#[test]
fn every_condition_observes_its_objects_generation() {
    let yaml = "
kind: Gateway
metadata: {name: bump, namespace: edge, generation: 4}
spec:
  gatewayClassName: aether
  listeners:
  - {name: web, port: 80, protocol: HTTP, hostname: bar.example.org, allowedRoutes: {namespaces: {from: All}}}
";
    let route = http_route("shop", "r", "{parentRefs: [{name: bump, namespace: edge}]}");
    let w = world().with(yaml).with(&route);
    let edge = w.project("edge/bump");
    assert_eq!(edge.generation, 4);
    let gateway_conditions = edge
        .status
        .gateway
        .iter()
        .chain(edge.status.listeners.iter().flat_map(|l| &l.conditions));
    for c in gateway_conditions {
        assert_eq!(
            (c.observed_generation, &c.last_transition_time),
            (Some(4), &now()),
            "{c:?}"
        );
    }
    let class = edge.status.class.as_ref().unwrap();
    assert_eq!(
        (class[0].observed_generation, class[0].status.as_str()),
        (Some(1), "True")
    );
    let route_conditions = &route_statuses(&edge, "http/shop/r")[0].conditions;
    assert!(route_conditions.iter().all(|c| c.observed_generation == Some(3)));

    let mut bumped = w.clone();
    let gateway = &mut bumped.gateways[0];
    gateway.metadata.generation = Some(5);
    let alternate =
        serde_json::json!({"name": "alternate", "port": 80, "protocol": "HTTP", "hostname": "foo.example.org"});
    gateway.spec.listeners.push(serde_json::from_value(alternate).unwrap());
    let edge = bumped.project("edge/bump");
    let all = edge
        .status
        .gateway
        .iter()
        .chain(edge.status.listeners.iter().flat_map(|l| &l.conditions));
    assert!(all.clone().all(|c| c.observed_generation == Some(5)));
    assert_eq!(condition(&edge.status.gateway, "Accepted"), ("True", "Accepted"));
    assert_eq!(edge.status.listeners.len(), 2);
}

/// Only our class's Gateways are projected: another controller's class, a missing
/// class, or a class of another name gives nothing to serve and no status at all.
#[test]
fn gateways_of_other_classes_are_left_alone() {
    let gateway = "
kind: Gateway
metadata: {name: theirs, namespace: edge}
spec:
  gatewayClassName: aether
  listeners: [{name: web, port: 80, protocol: HTTP}]
";
    let route = http_route("edge", "r", "{parentRefs: [{name: theirs}]}");
    let ours = world().with(gateway).with(&route);
    assert_eq!(ours.project("edge/theirs").status.routes.len(), 1);
    let other_controller = ours
        .clone()
        .with("kind: GatewayClass\nmetadata: {name: aether}\nspec: {controllerName: example.org/gw}\n");
    let mut missing = ours.clone();
    missing.class = None;
    let other_name = ours.clone().with(&format!(
        "kind: GatewayClass\nmetadata: {{name: not-aether}}\nspec: {{controllerName: {}}}\n",
        aether_api::edge::CONTROLLER_NAME
    ));
    for w in [other_controller, missing, other_name] {
        let edge = w.project("edge/theirs");
        assert_eq!(edge.gateway, "edge/theirs");
        assert!(edge.ports.is_empty() && edge.status.class.is_none());
        assert!(edge.status.gateway.is_empty() && edge.status.listeners.is_empty() && edge.status.routes.is_empty());
    }
}

/// The edge takes no class parameters: such a class is not accepted, and neither are its
/// Gateways; their routes match no parent.
#[test]
fn a_class_with_parameters_is_not_accepted() {
    let w = world()
        .with(
            "kind: GatewayClass\nmetadata: {name: aether, generation: 2}\n\
             spec: {controllerName: aether.io/edge, parametersRef: {group: '', kind: ConfigMap, name: tuning, namespace: edge}}\n",
        )
        .with("kind: Gateway\nmetadata: {name: g, namespace: edge}\nspec: {gatewayClassName: aether, listeners: [{name: web, port: 80, protocol: HTTP}]}\n")
        .with(&http_route("edge", "r", "{parentRefs: [{name: g}]}"));
    let edge = w.project("edge/g");
    let class = edge.status.class.clone().unwrap();
    assert_eq!(
        (class[0].status.as_str(), class[0].reason.as_str()),
        ("False", "InvalidParameters")
    );
    assert_eq!(condition(&edge.status.gateway, "Accepted"), ("False", "Invalid"));
    assert_eq!(condition(&edge.status.gateway, "Programmed"), ("False", "Invalid"));
    assert_eq!(route_summary(&edge, "http/edge/r")[0], ("False", "NoMatchingParent"));
    assert!(edge.ports.is_empty());
}

/// Each listener is checked on its own: what the edge does not serve is not accepted
/// with the API's reason, and the others still serve (the Gateway reports
/// `ListenersNotValid` while accepted).
#[test]
fn listeners_the_edge_cannot_serve_are_refused_one_by_one() {
    let yaml = "
kind: Gateway
metadata: {name: mixed, namespace: edge}
spec:
  gatewayClassName: aether
  listeners:
  - {name: ok, port: 80, protocol: HTTP}
  - {name: udp, port: 53, protocol: UDP}
  - {name: custom, port: 54, protocol: example.org/quic}
  - {name: https-passthrough, port: 443, protocol: HTTPS, tls: {mode: Passthrough}}
  - {name: tls-terminate, port: 8443, protocol: TLS, tls: {certificateRefs: [{name: c}]}}
  - {name: tls-without, port: 8444, protocol: TLS}
  - {name: http-with-tls, port: 81, protocol: HTTP, tls: {certificateRefs: [{name: c}]}}
  - {name: https-without-refs, port: 444, protocol: HTTPS, tls: {mode: Terminate}}
  - {name: bad-host, port: 82, protocol: HTTP, hostname: 10.0.0.1}
  - {name: bad-port, port: 70000, protocol: HTTP}
  - {name: Bad_Name, port: 83, protocol: HTTP}
  - {name: options, port: 445, protocol: HTTPS, tls: {certificateRefs: [{name: c}], options: {example.org/x: fast}}}
  - {name: bad-selector, port: 84, protocol: HTTP, allowedRoutes: {namespaces: {from: Selector}}}
  - {name: bad-operator, port: 85, protocol: HTTP,
     allowedRoutes: {namespaces: {from: Selector, selector: {matchExpressions: [{key: a, operator: Near}]}}}}
  - {name: from-elsewhere, port: 86, protocol: HTTP, allowedRoutes: {namespaces: {from: Somewhere}}}
";
    let edge = world().with(yaml).project("edge/mixed");
    let expected = [
        ("udp", "UnsupportedProtocol"),
        ("custom", "UnsupportedProtocol"),
        ("https-passthrough", "UnsupportedValue"),
        ("tls-terminate", "UnsupportedValue"),
        ("tls-without", "UnsupportedValue"),
        ("http-with-tls", "UnsupportedValue"),
        ("https-without-refs", "UnsupportedValue"),
        ("bad-host", "UnsupportedValue"),
        ("bad-port", "PortUnavailable"),
        ("Bad_Name", "UnsupportedValue"),
        ("options", "UnsupportedValue"),
        ("bad-selector", "UnsupportedValue"),
        ("bad-operator", "UnsupportedValue"),
        ("from-elsewhere", "UnsupportedValue"),
    ];
    for (name, reason) in expected {
        let [accepted, programmed, ..] = listener_summary(&edge, name);
        assert_eq!((accepted, programmed.0), (("False", reason), "False"), "{name}");
    }
    assert_eq!(kinds(&edge, "udp"), Vec::<String>::new());
    assert_eq!(listener_summary(&edge, "ok")[1], ("True", "Programmed"));
    assert_eq!(
        condition(&edge.status.gateway, "Accepted"),
        ("True", "ListenersNotValid")
    );
    assert_eq!(condition(&edge.status.gateway, "Programmed"), ("True", "Programmed"));
    let message = &edge.status.gateway[0].message;
    assert!(
        message.contains("\"udp\"") && message.contains("and 6 more"),
        "{message}"
    );
    assert_eq!(served(&edge), [(80, "ok".to_owned(), vec![])]);
}

/// Listeners that cannot be told apart are all conflicted, none wins: two protocols on
/// one port, one hostname twice on a port, two TCP listeners on a port. The rest serve.
#[test]
fn conflicting_listeners_are_all_refused() {
    let yaml = "
kind: Gateway
metadata: {name: crowded, namespace: edge}
spec:
  gatewayClassName: aether
  listeners:
  - {name: plain, port: 8080, protocol: HTTP}
  - {name: tcp, port: 8080, protocol: TCP}
  - {name: a, port: 80, protocol: HTTP, hostname: a.example.org}
  - {name: a-again, port: 80, protocol: HTTP, hostname: a.example.org}
  - {name: b, port: 80, protocol: HTTP, hostname: b.example.org}
  - {name: db1, port: 5432, protocol: TCP}
  - {name: db2, port: 5432, protocol: TCP}
  - {name: pass, port: 443, protocol: TLS, tls: {mode: Passthrough}}
  - {name: https, port: 443, protocol: HTTPS, tls: {certificateRefs: [{name: cert}]}}
";
    let edge = world()
        .secret(tls_secret("edge", "cert", &["x.example.org"]))
        .with(yaml)
        .project("edge/crowded");
    let conflicted = |name: &str| listener_summary(&edge, name)[3];
    for name in ["plain", "tcp", "pass", "https"] {
        assert_eq!(conflicted(name), ("True", "ProtocolConflict"), "{name}");
        assert_eq!(
            listener_summary(&edge, name)[0],
            ("False", "ProtocolConflict"),
            "{name}"
        );
    }
    for name in ["a", "a-again", "db1", "db2"] {
        assert_eq!(conflicted(name), ("True", "HostnameConflict"), "{name}");
    }
    assert_eq!(conflicted("b"), ("False", "NoConflicts"));
    assert_eq!(served(&edge), [(80, "b".to_owned(), vec![])]);
}

/// What refuses a Gateway as a whole: requested addresses, no listeners, two
/// listeners of one name.
#[test]
fn gateways_the_edge_cannot_take_are_not_accepted() {
    let cases = [
        (
            "{gatewayClassName: aether, addresses: [{value: 10.1.2.3}], listeners: [{name: web, port: 80, protocol: HTTP}]}",
            "UnsupportedAddress",
            1,
        ),
        ("{gatewayClassName: aether}", "ListenersNotValid", 0),
        (
            "{gatewayClassName: aether, listeners: [{name: web, port: 80, protocol: HTTP}, {name: web, port: 81, protocol: HTTP}]}",
            "ListenersNotValid",
            0,
        ),
        (
            "{gatewayClassName: aether, listeners: [{name: web, port: 80, protocol: UDP}]}",
            "ListenersNotValid",
            1,
        ),
    ];
    for (spec, reason, listeners) in cases {
        let yaml = format!("kind: Gateway\nmetadata: {{name: g, namespace: edge}}\nspec: {spec}\n");
        let route = http_route("edge", "r", "{parentRefs: [{name: g}]}");
        let edge = world().with(&yaml).with(&route).project("edge/g");
        assert_eq!(condition(&edge.status.gateway, "Accepted"), ("False", reason), "{spec}");
        assert_eq!(
            condition(&edge.status.gateway, "Programmed"),
            ("False", "Invalid"),
            "{spec}"
        );
        assert_eq!(edge.status.listeners.len(), listeners, "{spec}");
        assert!(edge.ports.is_empty(), "{spec}");
        assert_eq!(
            route_summary(&edge, "http/edge/r")[0],
            ("False", "NoMatchingParent"),
            "{spec}"
        );
    }
}

/// A route the mesh's projector refuses is refused here with the same reason, attaches
/// nowhere and is not counted; a route that projects is the mesh's projection, detached.
#[test]
fn routes_are_projected_by_the_mesh_projector() {
    let good = http_route(
        "edge",
        "good",
        "{parentRefs: [{name: same-ns}], hostnames: [Shop.Example.org], rules: [{matches: [{path: {type: PathPrefix, value: /cart/}}], \
         backendRefs: [{name: cart, port: 8080}]}]}",
    );
    let bad = http_route(
        "edge",
        "bad",
        "{parentRefs: [{name: same-ns}], rules: [{matches: [{path: {type: Fuzzy, value: /x}}]}]}",
    );
    let w = world()
        .with(SAME_NAMESPACE)
        .with(&good)
        .with(&bad)
        .services(&["edge/cart"]);
    let edge = w.project("edge/same-ns");
    let [accepted, _] = route_summary(&edge, "http/edge/bad");
    assert_eq!(accepted, ("False", "UnsupportedValue"));
    assert!(
        route_statuses(&edge, "http/edge/bad")[0].conditions[0]
            .message
            .starts_with("spec.rules[0].matches[0].path.type")
    );
    assert_eq!(listener(&edge, "web").attached_routes, 1);
    let attached = &edge.ports[0].listeners[0].routes[0];
    let object = w.routes.iter().find(|r| r.name() == "good").unwrap();
    assert_eq!(attached.route, project_detached(object).unwrap());
    assert!(attached.route.parents.is_empty());
    assert_eq!(attached.route.hostnames, ["shop.example.org"]);
    assert_eq!(attached.route.rules[0].matches[0].path.as_ref().unwrap().value, "/cart");
    assert_eq!(attached.hostnames, ["shop.example.org"]);
}

/// A route naming one listener twice (the whole Gateway and the listener by name) is
/// attached and counted once; routes come oldest first.
#[test]
fn a_route_is_attached_to_a_listener_once_and_routes_are_ordered_by_age() {
    let older = "apiVersion: gateway.networking.k8s.io/v1\nkind: HTTPRoute\n\
                 metadata: {name: zz-old, namespace: edge, creationTimestamp: '2024-01-01T00:00:00Z'}\n\
                 spec: {parentRefs: [{name: same-ns}, {name: same-ns, sectionName: web}]}\n---\n";
    let newer = "apiVersion: gateway.networking.k8s.io/v1\nkind: HTTPRoute\n\
                 metadata: {name: aa-new, namespace: edge, creationTimestamp: '2025-01-01T00:00:00Z'}\n\
                 spec: {parentRefs: [{name: same-ns}]}\n";
    let edge = same_namespace_with(&format!("{older}{newer}"));
    assert_eq!(listener(&edge, "web").attached_routes, 2);
    assert_eq!(route_statuses(&edge, "http/edge/zz-old").len(), 2);
    let keys: Vec<String> = served(&edge)[0].2.iter().map(|(k, _)| k.clone()).collect();
    assert_eq!(keys, ["http/edge/zz-old", "http/edge/aa-new"]);
}

/// TLS passthrough with TLSRoutes (server names intersected like HTTP hosts), and TCP
/// with TCPRoutes (no hostnames); a TCPRoute whose only backend is not permitted
/// attaches, is counted, and serves nothing.
#[test]
fn tls_and_tcp_listeners_take_their_route_kinds() {
    let yaml = "
kind: Gateway
metadata: {name: streams, namespace: edge}
spec:
  gatewayClassName: aether
  listeners:
  - {name: sni, port: 443, protocol: TLS, hostname: '*.example.org', tls: {mode: Passthrough}}
  - {name: db, port: 5432, protocol: TCP, hostname: ignored.example.org}
---
apiVersion: gateway.networking.k8s.io/v1alpha2
kind: TLSRoute
metadata: {name: vault, namespace: edge}
spec: {parentRefs: [{name: streams}], hostnames: [vault.example.org, vault.example.net], rules: [{backendRefs: [{name: vault, port: 8200}]}]}
---
apiVersion: gateway.networking.k8s.io/v1alpha2
kind: TCPRoute
metadata: {name: pg, namespace: edge}
spec: {parentRefs: [{name: streams, sectionName: db}], rules: [{backendRefs: [{name: pg, port: 5432}]}]}
---
apiVersion: gateway.networking.k8s.io/v1alpha2
kind: TCPRoute
metadata: {name: pg-elsewhere, namespace: edge}
spec: {parentRefs: [{name: streams, port: 5432}], rules: [{backendRefs: [{name: pg, namespace: pay, port: 5432}]}]}
";
    let edge = world()
        .with(yaml)
        .services(&["edge/vault", "edge/pg"])
        .project("edge/streams");
    let to = |k: &str, hosts: &[&str]| (k.to_owned(), hosts.iter().map(|h| (*h).to_owned()).collect::<Vec<_>>());
    assert_eq!(
        served(&edge),
        [
            (
                443,
                "sni".to_owned(),
                vec![to("tls/edge/vault", &["vault.example.org"])]
            ),
            (5432, "db".to_owned(), vec![to("tcp/edge/pg", &[])]),
        ]
    );
    assert_eq!(edge.ports[1].listeners[0].hostname, None);
    assert_eq!(
        route_summary(&edge, "tcp/edge/pg-elsewhere"),
        [("True", "Accepted"), ("False", "RefNotPermitted")]
    );
    assert_eq!(listener(&edge, "db").attached_routes, 2);
    assert_eq!(kinds(&edge, "sni"), ["TLSRoute"]);
    assert_eq!(kinds(&edge, "db"), ["TCPRoute"]);
}

/// An HTTPS listener with two certificates keeps them in certificateRefs order, once
/// each.
#[test]
fn an_https_listener_holds_its_certificates_in_order() {
    let yaml = "
kind: Gateway
metadata: {name: certs, namespace: edge}
spec:
  gatewayClassName: aether
  listeners:
  - {name: https, port: 443, protocol: HTTPS, tls: {certificateRefs: [{name: rsa-ish}, {name: ec}, {name: rsa-ish}]}}
";
    let edge = world()
        .secret(tls_secret("edge", "rsa-ish", &["A.example.org", "b.example.org"]))
        .secret(tls_secret("edge", "ec", &["c.example.org"]))
        .with(yaml)
        .project("edge/certs");
    let certificates = &edge.ports[0].listeners[0].certificates;
    let names: Vec<(&str, &[String])> = certificates
        .iter()
        .map(|(k, c)| (k.as_str(), c.dns_names.as_slice()))
        .collect();
    let ab = ["a.example.org".to_owned(), "b.example.org".to_owned()];
    let c = ["c.example.org".to_owned()];
    assert_eq!(names, [("edge/rsa-ish", &ab[..]), ("edge/ec", &c[..])]);
}
