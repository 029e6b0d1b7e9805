//! Every fault [`explain`] knows, table-driven: a healthy call with one fact changed
//! must name that hop, with that status, in words a reader recognises.

use super::*;

mod routes;

const HOUR: Duration = Duration::from_secs(3600);

fn now() -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000)
}

fn acked() -> Resource {
    Resource {
        served: true,
        acked: true,
        rejected: None,
    }
}

fn host(healthy: bool, ejected: bool) -> Host {
    Host {
        address: "10.0.0.2:8080".into(),
        healthy,
        ejected,
    }
}

const BACKEND_ID: &str = "spiffe://cluster.local/ns/demo/sa/backend";

/// frontend → backend on a healthy node.
fn healthy() -> Facts {
    let vip: IpAddr = "240.240.0.1".parse().unwrap();
    Facts {
        pod_id: "demo/frontend".into(),
        pod: Some(PodFacts {
            upstreams: vec!["demo/backend".into()],
            ..Default::default()
        }),
        target_text: "backend".into(),
        target: Some(Target {
            service: "demo/backend".into(),
            fqdn: "backend.demo.aether.internal".into(),
            port: Some(8080),
            by_ip: false,
            vip: Some(vip),
            loaded: true,
            ports: vec![8080],
            endpoints: 2,
        }),
        registrar_connected: true,
        dns: DnsFacts {
            record: Some(vec![vip]),
            file_error: None,
            answer: None,
        },
        capture: Capture::Intact { captured: 3 },
        envoy: EnvoyFacts {
            connected: true,
            listener: acked(),
            cluster: Some(("backend.demo.aether.internal:8080".into(), acked())),
            hosts: Some(vec![host(true, false), host(true, false)]),
        },
        identity: Some(IdentityFacts {
            svid: Some(Svid {
                spiffe_id: "spiffe://cluster.local/ns/demo/sa/frontend".into(),
                not_before: now() - HOUR,
                not_after: now() + HOUR,
            }),
            secret_acked: true,
            expected_sans: vec![BACKEND_ID.into()],
            local_destinations: vec![("demo/backend".into(), BACKEND_ID.into())],
            remote_destinations: vec![RemoteDestination {
                address: "10.1.2.3".into(),
                node: "node-b".into(),
                presented: Ok(BACKEND_ID.into()),
            }],
        }),
        request: None,
        route: Some(RouteFacts {
            port: 8080,
            http: true,
            ..Default::default()
        }),
        // The node holds the target's namespace's policies, and none selects it.
        authorization: Some(AuthzFacts {
            decided: Some(aether_api::authorization::decide(&[], &call())),
            ..Default::default()
        }),
        recent_failures: Vec::new(),
        now: Some(now()),
    }
}

/// frontend's GET / to backend:8080, as `decide` takes it.
fn call() -> aether_api::authorization::AuthzRequest {
    aether_api::authorization::AuthzRequest {
        workload: aether_api::authorization::Workload {
            namespace: "demo".into(),
            services: vec!["demo/backend".into()],
            ..Default::default()
        },
        principal: Some("spiffe://cluster.local/ns/demo/sa/frontend".into()),
        trust_domain: "cluster.local".into(),
        peer_ip: [10, 0, 0, 1].into(),
        port: 8080,
        http: None,
    }
}

fn authz(f: &mut Facts) -> &mut AuthzFacts {
    f.authorization.as_mut().unwrap()
}

/// A DENY policy in demo naming frontend's service account.
fn deny_frontend() -> aether_proto::registry::v1::AuthorizationPolicy {
    let yaml = "apiVersion: security.aether.io/v1alpha1
kind: AuthorizationPolicy
metadata: {name: no-frontend, namespace: demo}
spec:
  action: DENY
  rules: [{from: [{source: {serviceAccounts: [demo/frontend]}}]}]
";
    let object = aether_api::authorization::parse_documents(yaml).remove(0).unwrap();
    aether_api::authorization::project(&object, &Default::default()).unwrap()
}

fn target(f: &mut Facts) -> &mut Target {
    f.target.as_mut().unwrap()
}

type Fault = fn(&mut Facts);

/// (fault, the hop named, its status, words the why must contain).
const CASES: &[(&str, Fault, &str, Status, &str)] = &[
    (
        "a denial logged by the destination on this node",
        |f| {
            authz(f).recent_denial = Some(crate::access_log::decisions::Decision {
                at_ms: 1,
                verdict: crate::access_log::decisions::Verdict::Deny,
                policy: "demo/backend-api".into(),
                rule: Some(1),
                source: "spiffe://cluster.local/ns/demo/sa/frontend".into(),
                pod: "demo/backend-1".into(),
                service: String::new(),
                port: 8080,
                method: "POST".into(),
                path: "/admin".into(),
            })
        },
        "authorization",
        Status::Fail,
        "demo/backend-1 denied POST /admin from spiffe://cluster.local/ns/demo/sa/frontend: policy demo/backend-api rule 1",
    ),
    (
        "a DENY policy the node holds",
        |f| {
            let policy = deny_frontend();
            authz(f).decided = Some(aether_api::authorization::decide(&[&policy], &call()));
        },
        "authorization",
        Status::Fail,
        "denied by policy demo/no-frontend rule 0",
    ),
    (
        "a logged denial in a namespace that denies by default",
        |f| {
            authz(f).default_deny = true;
            authz(f).recent_denial = Some(crate::access_log::decisions::Decision {
                at_ms: 1,
                verdict: crate::access_log::decisions::Verdict::Deny,
                policy: String::new(),
                rule: None,
                source: "spiffe://cluster.local/ns/demo/sa/frontend".into(),
                pod: "demo/backend-1".into(),
                service: String::new(),
                port: 8080,
                method: "GET".into(),
                path: "/".into(),
            })
        },
        "authorization",
        Status::Fail,
        "no ALLOW policy selecting the pod matched; the target's namespace denies by default (MeshConfig defaultAction DENY)",
    ),
    (
        "a namespace that denies by default",
        |f| {
            let policy = aether_api::mesh_config::default_deny("demo");
            authz(f).decided = Some(aether_api::authorization::decide(&[&policy], &call()));
            authz(f).default_deny = true;
        },
        "authorization",
        Status::Fail,
        "the target's namespace denies by default (MeshConfig defaultAction DENY)",
    ),
    (
        "403s from a destination on another node",
        |f| {
            let mut failure = crate::access_log::Failure {
                at_ms: 1,
                method: "GET".into(),
                authority: "backend.demo.aether.internal:8080".into(),
                path: "/".into(),
                status: 403,
                flags: String::new(),
                details: "via_upstream".into(),
                route: String::new(),
                upstream_cluster: String::new(),
                upstream_host: String::new(),
                upstream_failure: String::new(),
                duration_ms: 1,
            };
            failure.status = 403;
            f.recent_failures = vec![failure];
        },
        "authorization",
        Status::Warn,
        "answered 403 recently",
    ),
    (
        "a label-selected policy the node cannot judge",
        |f| authz(f).unjudged = vec!["demo/by-label".into()],
        "authorization",
        Status::Warn,
        "not judged here (label selectors): demo/by-label",
    ),
    (
        "pod unknown",
        |f| f.pod = None,
        "pod",
        Status::Fail,
        "not a pod this node's agent manages",
    ),
    (
        "pod terminating",
        |f| f.pod.as_mut().unwrap().terminating = true,
        "pod",
        Status::Warn,
        "terminating",
    ),
    (
        "bad annotation",
        |f| f.pod.as_mut().unwrap().config_errors = vec!["upstreams: \"B\"".into()],
        "pod",
        Status::Warn,
        "ignored",
    ),
    (
        "not a service name",
        |f| f.target = None,
        "service",
        Status::Fail,
        "does not name a mesh service",
    ),
    (
        "unknown service",
        |f| {
            target(f).vip = None;
            target(f).loaded = false
        },
        "service",
        Status::Fail,
        "not in the mesh catalog",
    ),
    (
        "registrar down",
        |f| f.registrar_connected = false,
        "registrar",
        Status::Warn,
        "watch on the registrar is down",
    ),
    (
        "no dns record",
        |f| f.dns.record = None,
        "dns",
        Status::Fail,
        "no record for backend.demo.aether.internal",
    ),
    (
        "stale dns record",
        |f| f.dns.record = Some(vec!["240.240.0.9".parse().unwrap()]),
        "dns",
        Status::Fail,
        "but its VIP is 240.240.0.1",
    ),
    (
        "mesh-dns silent",
        |f| f.dns.answer = Some(("10.0.0.1:53".into(), Err("timeout".into()))),
        "dns",
        Status::Fail,
        "mesh-dns at 10.0.0.1:53 did not answer: timeout",
    ),
    (
        "mesh-dns lacks the name",
        |f| f.dns.answer = Some(("10.0.0.1:53".into(), Ok(vec![]))),
        "dns",
        Status::Fail,
        "has no record for backend.demo",
    ),
    (
        "mesh-dns stale",
        |f| f.dns.answer = Some(("10.0.0.1:53".into(), Ok(vec!["240.240.0.9".parse().unwrap()]))),
        "dns",
        Status::Fail,
        "with 240.240.0.9, but its VIP is 240.240.0.1",
    ),
    (
        "record file unreadable",
        |f| f.dns.file_error = Some("not JSON".into()),
        "dns",
        Status::Fail,
        "cannot be read",
    ),
    (
        "capture removed",
        |f| f.capture = Capture::Drifted,
        "capture",
        Status::Fail,
        "missing or changed",
    ),
    (
        "capture off",
        |f| f.capture = Capture::NotCaptured,
        "capture",
        Status::Fail,
        "without traffic capture",
    ),
    (
        "nothing captured yet",
        |f| f.capture = Capture::Intact { captured: 0 },
        "capture",
        Status::Warn,
        "captured no connection yet",
    ),
    (
        "nft failed",
        |f| f.capture = Capture::Error("nft: no such file".into()),
        "capture",
        Status::Fail,
        "checking the capture rules failed",
    ),
    (
        "undeclared, on demand",
        |f| {
            f.pod.as_mut().unwrap().upstreams.clear();
            target(f).loaded = false
        },
        "upstreams",
        Status::Warn,
        "reachable on demand",
    ),
    (
        "undeclared, loaded",
        |f| f.pod.as_mut().unwrap().upstreams.clear(),
        "upstreams",
        Status::Warn,
        "the node holds it already",
    ),
    (
        "undeclared, registrar down",
        |f| {
            f.pod.as_mut().unwrap().upstreams.clear();
            target(f).loaded = false;
            f.registrar_connected = false
        },
        "upstreams",
        Status::Fail,
        "registrar is unreachable",
    ),
    (
        "no Envoy",
        |f| f.envoy.connected = false,
        "listener",
        Status::Fail,
        "no Envoy is connected",
    ),
    (
        "listener NACKed",
        |f| f.envoy.listener.rejected = Some("bad filter".into()),
        "listener",
        Status::Fail,
        "Envoy rejected the pod's listeners: bad filter",
    ),
    (
        "listener not acked",
        |f| f.envoy.listener.acked = false,
        "listener",
        Status::Fail,
        "has not taken",
    ),
    (
        "wrong port",
        |f| target(f).port = Some(9090),
        "cluster",
        Status::Fail,
        "serves port(s) 8080, not 9090",
    ),
    (
        "cluster not served",
        |f| f.envoy.cluster = None,
        "cluster",
        Status::Fail,
        "serves no cluster",
    ),
    (
        "no endpoints",
        |f| {
            target(f).endpoints = 0;
            f.envoy.cluster = None
        },
        "endpoints",
        Status::Fail,
        "has no endpoints",
    ),
    (
        "all hosts unhealthy",
        |f| f.envoy.hosts = Some(vec![host(false, false), host(true, true)]),
        "endpoints",
        Status::Fail,
        "none of demo/backend's 2 host(s)",
    ),
    (
        "one host ejected",
        |f| f.envoy.hosts = Some(vec![host(true, false), host(true, true)]),
        "endpoints",
        Status::Warn,
        "1 ejected",
    ),
    (
        "no SVID",
        |f| f.identity.as_mut().unwrap().svid = None,
        "identity",
        Status::Fail,
        "has no SVID",
    ),
    (
        "no SVID, so the agent withholds the listeners",
        |f| {
            f.identity.as_mut().unwrap().svid = None;
            f.envoy.listener.served = false;
        },
        "listener",
        Status::Fail,
        "withholds the pod's listeners: demo/frontend has no SVID",
    ),
    (
        "SVID expired",
        |f| f.identity.as_mut().unwrap().svid.as_mut().unwrap().not_after = now() - HOUR,
        "identity",
        Status::Fail,
        "expired 60m ago",
    ),
    (
        "clock skew",
        |f| f.identity.as_mut().unwrap().svid.as_mut().unwrap().not_before = now() + HOUR,
        "identity",
        Status::Fail,
        "clock skew",
    ),
    (
        "SVID not in Envoy",
        |f| f.identity.as_mut().unwrap().secret_acked = false,
        "identity",
        Status::Fail,
        "does not hold",
    ),
    (
        "SAN mismatch",
        |f| f.identity.as_mut().unwrap().local_destinations[0].1 = "spiffe://cluster.local/ns/demo/sa/other".into(),
        "identity",
        Status::Fail,
        "SAN mismatch",
    ),
    (
        "SAN mismatch on another node",
        |f| {
            f.identity.as_mut().unwrap().remote_destinations[0].presented =
                Ok("spiffe://cluster.local/ns/demo/sa/other".into())
        },
        "identity",
        Status::Fail,
        "SAN mismatch: destination pod 10.1.2.3 on node node-b presents spiffe://cluster.local/ns/demo/sa/other",
    ),
    (
        "a destination on another node not answering",
        |f| f.identity.as_mut().unwrap().remote_destinations[0].presented = Err("connection refused".into()),
        "identity",
        Status::Warn,
        "destination pod 10.1.2.3 on node node-b could not be asked who it is: connection refused",
    ),
];

#[test]
fn a_healthy_call_is_ok_at_every_hop() {
    let e = explain(&healthy());
    assert_eq!(e.verdict, Status::Ok, "{e:#?}");
    assert!(e.first.is_none());
    let names: Vec<_> = e.hops.iter().map(|h| h.hop).collect();
    assert_eq!(
        names,
        [
            "pod",
            "service",
            "registrar",
            "dns",
            "capture",
            "upstreams",
            "listener",
            "route",
            "cluster",
            "endpoints",
            "identity",
            "authorization"
        ]
    );
    for h in &e.hops {
        assert_eq!(h.status, Status::Ok, "{h:?}");
    }
    assert_eq!(e.hops[11].why, "no ALLOW policy selects the target");
    assert_eq!(
        e.hops[7].why,
        "no route attached: default routing (retries, outlier ejection)"
    );
}

#[test]
fn every_fault_is_named_at_its_hop() {
    for (name, fault, hop, status, words) in CASES {
        let mut facts = healthy();
        fault(&mut facts);
        let e = explain(&facts);
        let first = e.first.as_ref().unwrap_or_else(|| panic!("{name}: no verdict: {e:#?}"));
        assert_eq!((first.hop, first.status), (*hop, *status), "{name}: {e:#?}");
        assert!(first.why.contains(words), "{name}: {:?} lacks {words:?}", first.why);
        assert_eq!(e.verdict, *status, "{name}");
        if *status == Status::Fail {
            assert!(!first.fix.is_empty(), "{name}: a failure says how to fix it");
            let at = e.hops.iter().position(|h| h.hop == *hop).unwrap();
            assert!(
                e.hops[at + 1..].iter().all(|h| h.status == Status::Skip),
                "{name}: later hops are not judged"
            );
        }
    }
}

#[test]
fn a_vip_needs_no_lookup_and_plaintext_skips_identity() {
    let mut facts = healthy();
    target(&mut facts).by_ip = true;
    facts.dns.record = None;
    facts.identity = None;
    let e = explain(&facts);
    assert_eq!(e.verdict, Status::Ok, "{e:#?}");
    assert_eq!(e.hops[3].why, "addressed by IP 240.240.0.1: no lookup");
    assert!(e.hops[10].why.contains("--identity none"));
}

#[test]
fn recent_failures_are_reported_beside_the_hops_and_judge_nothing() {
    let mut facts = healthy();
    let failure = Failure {
        at_ms: 1,
        method: "GET".into(),
        authority: "backend.demo.aether.internal".into(),
        path: "/slow".into(),
        status: 504,
        flags: "UT".into(),
        details: "upstream_response_timeout".into(),
        route: String::new(),
        upstream_cluster: "backend.demo.aether.internal:8080".into(),
        upstream_host: "10.0.0.2:18008".into(),
        upstream_failure: String::new(),
        duration_ms: 15_000,
    };
    facts.recent_failures = vec![failure.clone()];
    let explained = explain(&facts);
    assert_eq!(explained.recent_failures, [failure]);
    assert_eq!(explained.hops, explain(&healthy()).hops);
}
