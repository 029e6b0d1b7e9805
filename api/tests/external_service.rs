//! The ExternalService projector: what a good declaration projects into, every refusal
//! with its field (bounded quotes), the proto re-validation agreeing with the projector,
//! and the ports the mesh reads off an external service.

use aether_api::external_service::{parse_documents, project, validate};
use aether_api::service_ports::ServicePorts;
use aether_proto::registry::v1::{External, ExternalPort, ExternalTls, Protocol, Service};
use proptest::prelude::*;

const CA: &str = "-----BEGIN CERTIFICATE-----\nMIIBszCCAVmgAwIBAgIUQ2Fyb2xpbmU=\n-----END CERTIFICATE-----\n";

fn object(spec: &str) -> String {
    format!(
        "apiVersion: networking.aether.io/v1alpha1\nkind: ExternalService\n\
         metadata: {{name: payments, namespace: shop, generation: 3}}\nspec:\n{spec}"
    )
}

fn one(yaml: &str) -> Result<External, String> {
    let mut objects = parse_documents(yaml);
    assert_eq!(objects.len(), 1, "{yaml}");
    let object = objects.remove(0).map_err(|e| format!("{}: {}", e.field, e.message))?;
    project(&object).map_err(|r| r.to_string())
}

#[test]
fn a_whole_declaration_projects_field_by_field() {
    let spec = format!(
        "  hosts: [API.Payments.example, backup.payments.example]\n  ports:\n  \
         - {{number: 443, protocol: TLS, name: tls}}\n  \
         - {{number: 80, protocol: HTTP, targetPort: 443, originateTls: true}}\n  \
         - {{number: 5432}}\n  \
         addresses: [203.0.113.7, \"2001:db8::7\"]\n  \
         tls:\n    serverName: API.payments.example\n    caCertificates: {CA:?}\n"
    );
    assert_eq!(
        one(&object(&spec)).unwrap(),
        External {
            hosts: vec!["api.payments.example".into(), "backup.payments.example".into()],
            ports: vec![
                ExternalPort {
                    number: 443,
                    protocol: Protocol::Tls.into(),
                    target_port: 443,
                    originate_tls: false,
                    name: "tls".into(),
                },
                ExternalPort {
                    number: 80,
                    protocol: Protocol::Http.into(),
                    target_port: 443,
                    originate_tls: true,
                    name: String::new(),
                },
                ExternalPort {
                    number: 5432,
                    protocol: Protocol::Tcp.into(),
                    target_port: 5432,
                    originate_tls: false,
                    name: String::new(),
                },
            ],
            addresses: vec!["203.0.113.7".into(), "2001:db8::7".into()],
            tls: Some(ExternalTls {
                server_name: "api.payments.example".into(),
                ca_certificates: CA.into(),
            }),
            generation: 3,
        }
    );
}

#[test]
fn every_bad_field_is_refused_by_name() {
    let port = "  ports: [{number: 443}]\n";
    let hosts = "  hosts: [api.payments.example]\n";
    for (spec, refusal) in [
        (port.to_owned(), "spec.hosts: needs at least one host"),
        (
            format!("  hosts: [localhost]\n{port}"),
            "spec.hosts[0]: \"localhost\" is not a host",
        ),
        (
            format!("  hosts: ['*.example.com']\n{port}"),
            "spec.hosts[0]: \"*.example.com\" is not a host",
        ),
        (
            format!("  hosts: [10.0.0.1]\n{port}"),
            "spec.hosts[0]: \"10.0.0.1\" is not a host",
        ),
        (
            format!("  hosts: [a.example, A.example]\n{port}"),
            "spec.hosts[1]: \"a.example\" is listed twice",
        ),
        (hosts.to_owned(), "spec.ports: needs at least one port"),
        (
            format!("{hosts}  ports: [{{number: 0}}]\n"),
            "spec.ports[0].number: 0 is not a port",
        ),
        (
            format!("{hosts}  ports: [{{number: 80, targetPort: 70000}}]\n"),
            "spec.ports[0].targetPort: 70000 is not a port",
        ),
        (
            format!("{hosts}  ports: [{{number: 80}}, {{number: 80}}]\n"),
            "spec.ports[1].number: 80 is declared twice",
        ),
        (
            format!("{hosts}  ports: [{{number: 80, protocol: UDP}}]\n"),
            "spec.ports[0].protocol: \"UDP\" is not TCP, TLS or HTTP",
        ),
        (
            format!("{hosts}  ports: [{{number: 443, protocol: TLS, originateTls: true}}]\n"),
            "spec.ports[0].originateTls: is for plaintext ports",
        ),
        (
            format!("{hosts}  ports: [{{number: 80, name: Web}}]\n"),
            "spec.ports[0].name: \"Web\"",
        ),
        (
            format!("{hosts}  ports: [{{number: 80, weight: 3}}]\n"),
            "spec.ports[0].weight: is not a field",
        ),
        (
            format!("{hosts}{port}  addresses: [\"010.0.0.1\"]\n"),
            "spec.addresses[0]: \"010.0.0.1\" is not an IP address",
        ),
        (
            format!("{hosts}{port}  tls: {{serverName: 'bad name'}}\n"),
            "spec.tls.serverName: \"bad name\" is not a host",
        ),
        (
            format!("{hosts}{port}  tls: {{caCertificates: 'hello'}}\n"),
            "spec.tls.caCertificates: is not PEM CA certificates",
        ),
        (
            format!("{hosts}{port}  tls: {{caCertificates: \"-----BEGIN CERTIFICATE-----\\nAAAA\\n\"}}\n"),
            "spec.tls.caCertificates: ends inside a CERTIFICATE block",
        ),
        (
            format!("{hosts}{port}  resolution: NONE\n"),
            "spec.resolution: is not a field",
        ),
    ] {
        let got = one(&object(&spec)).unwrap_err();
        assert!(got.starts_with(refusal), "{spec}\n  got:  {got}\n  want: {refusal}");
    }
    let name = "apiVersion: networking.aether.io/v1alpha1\nkind: ExternalService\nmetadata: {name: Pay, namespace: shop}\nspec: {hosts: [a.example], ports: [{number: 1}]}";
    assert!(one(name).unwrap_err().starts_with("metadata.name: \"Pay\""));
    let version = "apiVersion: networking.aether.io/v2\nkind: ExternalService\nmetadata: {name: pay}\n";
    assert!(
        one(version)
            .unwrap_err()
            .starts_with("apiVersion: \"networking.aether.io/v2\" is not served")
    );
}

#[test]
fn a_huge_value_is_quoted_bounded() {
    let host = "a".repeat(100_000);
    let got = one(&object(&format!(
        "  hosts: [{host}.example]\n  ports: [{{number: 1}}]\n"
    )))
    .unwrap_err();
    assert!(got.len() < 400, "{} bytes: {got:.200}", got.len());
    let ca = format!(
        "-----BEGIN CERTIFICATE-----\\n{}\\n-----END CERTIFICATE-----\\n",
        "A".repeat(70_000)
    );
    let spec = format!("  hosts: [a.example]\n  ports: [{{number: 1}}]\n  tls: {{caCertificates: \"{ca}\"}}\n");
    let got = one(&object(&spec)).unwrap_err();
    assert!(got.contains("(at most 65536)") && got.len() < 400, "{got:.200}");
}

#[test]
fn the_ports_of_an_external_service_are_its_declared_ones() {
    let mut service = Service {
        namespace: "shop".into(),
        name: "payments".into(),
        vip: "240.240.0.9".into(),
        kubernetes: None,
        external: Some(Box::new(
            one(&object(
                "  hosts: [a.example]\n  ports: [{number: 80, protocol: HTTP}, {number: 5432}]\n",
            ))
            .unwrap(),
        )),
    };
    let ports = ServicePorts::of(&service, std::iter::empty());
    assert_eq!(
        ports.endpoint.into_iter().collect::<Vec<_>>(),
        vec![(80, Protocol::Http), (5432, Protocol::Tcp)]
    );
    // A store can hold anything: a declaration the projector would refuse serves no port.
    service.external.as_mut().unwrap().hosts.clear();
    assert!(ServicePorts::of(&service, std::iter::empty()).endpoint.is_empty());
}

fn host() -> impl Strategy<Value = String> {
    prop::collection::vec("[a-z0-9]([a-z0-9-]{0,8}[a-z0-9])?", 2..4).prop_map(|labels| labels.join("."))
}

proptest! {
    /// What the projector accepts, the proto check accepts (apply-time and run-time agree);
    /// arbitrary field values never panic either of them.
    #[test]
    fn the_projector_and_the_proto_check_agree(
        hosts in prop::collection::vec(prop_oneof![host(), "[ -~]{0,12}"], 0..4),
        ports in prop::collection::vec((0i64..70_000, prop::option::of(0i64..70_000), any::<bool>(), 0usize..4), 0..4),
        addresses in prop::collection::vec(prop_oneof![Just("203.0.113.7".to_owned()), "[0-9.:]{0,10}"], 0..3),
    ) {
        let protocols = ["TCP", "TLS", "HTTP", "SCTP"];
        let ports: Vec<String> = ports
            .iter()
            .map(|(number, target, tls, protocol)| {
                let target = target.map(|t| format!(", targetPort: {t}")).unwrap_or_default();
                format!("{{number: {number}, protocol: {}, originateTls: {tls}{target}}}", protocols[*protocol])
            })
            .collect();
        let quote = |v: &Vec<String>| v.iter().map(|s| format!("{s:?}")).collect::<Vec<_>>().join(", ");
        let spec = format!("  hosts: [{}]\n  ports: [{}]\n  addresses: [{}]\n", quote(&hosts), ports.join(", "), quote(&addresses));
        let Ok(mut objects) = std::panic::catch_unwind(|| parse_documents(&object(&spec))) else {
            return Err(TestCaseError::fail("parsing panicked"));
        };
        if let Some(Ok(object)) = objects.pop() && let Ok(projected) = project(&object) {
            prop_assert!(validate(&projected).is_ok(), "{projected:?}");
        }
    }
}

mod authorization {
    use aether_api::authorization::{
        AuthzRequest, HttpRequest, ProjectOptions, Verdict, Workload, decide, decide_egress, parse_documents, project,
        validate,
    };
    use aether_proto::registry::v1::AuthorizationPolicy;

    fn policy(spec: &str) -> Result<AuthorizationPolicy, String> {
        let yaml = format!(
            "apiVersion: security.aether.io/v1alpha1\nkind: AuthorizationPolicy\n\
             metadata: {{name: guard, namespace: shop}}\nspec:\n{spec}"
        );
        let object = parse_documents(&yaml).remove(0).map_err(|e| e.to_string())?;
        project(&object, &ProjectOptions::default()).map_err(|r| r.to_string())
    }

    const EXTERNAL: &str = "  targetRefs: [{group: networking.aether.io, kind: ExternalService, name: payments}]\n";

    fn call(sa: &str, port: u32, method: Option<&str>) -> AuthzRequest {
        AuthzRequest {
            workload: Workload::default(),
            principal: Some(format!("spiffe://td/ns/shop/sa/{sa}")),
            trust_domain: "td".into(),
            peer_ip: "10.0.0.5".parse().unwrap(),
            port,
            http: method.map(|m| HttpRequest {
                method: m.into(),
                path: "/pay".into(),
                host: "api.payments.example".into(),
            }),
        }
    }

    #[test]
    fn a_policy_targets_external_services_and_selects_no_pod() {
        let allow = policy(&format!(
            "{EXTERNAL}  action: ALLOW\n  rules: [{{from: [{{source: {{serviceAccounts: [shop/cart]}}}}], to: [{{operation: {{methods: [GET]}}}}]}}]\n"
        ))
        .unwrap();
        let target = allow.target.as_ref().unwrap();
        assert_eq!(target.external_services, ["shop/payments"]);
        assert!(target.services.is_empty() && target.match_labels.is_empty());
        assert!(validate(&allow).is_ok());
        // As a destination policy it selects nothing: every pod of shop is untouched.
        let inbound = AuthzRequest {
            workload: Workload {
                namespace: "shop".into(),
                ..Default::default()
            },
            ..call("other", 8080, Some("POST"))
        };
        assert_eq!(decide(&[&allow], &inbound).verdict, Verdict::Allow);
        // On the callers' side: the ALLOW rule decides, by identity and method.
        let egress = |r: &AuthzRequest| decide_egress(&[&allow], "shop/payments", r).verdict;
        assert_eq!(egress(&call("cart", 80, Some("GET"))), Verdict::Allow);
        assert_eq!(egress(&call("cart", 80, Some("POST"))), Verdict::Deny);
        assert_eq!(egress(&call("other", 80, Some("GET"))), Verdict::Deny);
        assert_eq!(
            decide_egress(&[&allow], "shop/other", &call("other", 80, None)).verdict,
            Verdict::Allow
        );
        // On a TCP port the method cannot be judged: the ALLOW rule allows nothing there.
        assert_eq!(egress(&call("cart", 5432, None)), Verdict::Deny);
    }

    #[test]
    fn a_deny_rule_with_http_fields_closes_its_tcp_ports_and_dry_run_changes_nothing() {
        let deny = policy(&format!(
            "{EXTERNAL}  action: DENY\n  rules: [{{from: [{{source: {{serviceAccounts: [shop/cart]}}}}], to: [{{operation: {{ports: [5432], paths: [/admin]}}}}]}}]\n"
        ))
        .unwrap();
        let egress = |p: &AuthorizationPolicy, r: &AuthzRequest| decide_egress(&[p], "shop/payments", r).verdict;
        assert_eq!(egress(&deny, &call("cart", 5432, None)), Verdict::Deny, "fails closed");
        assert_eq!(
            egress(&deny, &call("cart", 6379, None)),
            Verdict::Allow,
            "its ports still hold"
        );
        assert_eq!(egress(&deny, &call("other", 5432, None)), Verdict::Allow);
        let dry_run = AuthorizationPolicy {
            dry_run: true,
            ..deny.clone()
        };
        assert_eq!(egress(&dry_run, &call("cart", 5432, None)), Verdict::Allow);
        // ... though it says what it would do, and an AUDIT policy what it matched.
        let judged = decide_egress(&[&dry_run], "shop/payments", &call("cart", 5432, None));
        assert_eq!(judged.dry_run.map(|(v, _)| v), Some(Verdict::Deny));
        let audit = policy(&format!(
            "{EXTERNAL}  action: AUDIT\n  rules: [{{from: [{{source: {{serviceAccounts: [shop/cart]}}}}], to: [{{operation: {{ports: [5432]}}}}]}}]\n"
        ))
        .unwrap();
        let judged = decide_egress(&[&audit], "shop/payments", &call("cart", 5432, None));
        assert_eq!((judged.verdict, judged.audited.len()), (Verdict::Allow, 1));
        assert!(
            decide_egress(&[&audit], "shop/payments", &call("cart", 6379, None))
                .audited
                .is_empty()
        );
        // An AUDIT rule with HTTP fields cannot be judged on a TCP port: it matches nothing there.
        let audit_l7 = AuthorizationPolicy {
            action: aether_proto::registry::v1::AuthorizationAction::Audit as i32,
            ..deny.clone()
        };
        assert!(
            decide_egress(&[&audit_l7], "shop/payments", &call("cart", 5432, None))
                .audited
                .is_empty()
        );
    }

    #[test]
    fn mixed_or_foreign_targets_are_refused_naming_the_field() {
        let mixed = "  targetRefs:\n  - {group: networking.aether.io, kind: ExternalService, name: payments}\n  - {kind: Service, name: cart}\n  action: ALLOW\n";
        let refusal = policy(mixed).unwrap_err();
        assert!(
            refusal.starts_with("spec.targetRefs[1].kind: mixes Services and ExternalServices"),
            "{refusal}"
        );
        let foreign = "  targetRefs: [{group: networking.aether.io, kind: HTTPFilter, name: x}]\n  action: ALLOW\n";
        let refusal = policy(foreign).unwrap_err();
        assert!(
            refusal.starts_with("spec.targetRefs[0].kind: \"networking.aether.io\"/\"HTTPFilter\" is neither"),
            "{refusal}"
        );
        let mut bad = policy(&format!("{EXTERNAL}  action: ALLOW\n")).unwrap();
        bad.target.as_mut().unwrap().services = vec!["shop/cart".into()];
        assert!(
            validate(&bad)
                .unwrap_err()
                .to_string()
                .starts_with("target.external_services")
        );
        bad.target.as_mut().unwrap().services.clear();
        bad.target.as_mut().unwrap().external_services = vec!["other/payments".into()];
        assert!(
            validate(&bad)
                .unwrap_err()
                .to_string()
                .contains("is not in the policy's namespace")
        );
    }
}
