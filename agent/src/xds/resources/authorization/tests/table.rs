//! For a matrix of requests (identity, peer address, port, method, path, host) over
//! several policy sets, the generated listener's RBAC (evaluated by `eval`) and `decide`
//! agree: verdict, the DENY rule named, the dry-run verdict and the AUDIT matches.

use aether_api::authorization::{AuthzRequest, Cause, HttpRequest, decide};

use super::eval::judge;
use super::*;

/// The mesh's: `other.td` in the matrix is a federated one.
const TRUST_DOMAIN: &str = "cluster.local";

const HEADER: &str = "apiVersion: security.aether.io/v1alpha1\nkind: AuthorizationPolicy\n";

const ALLOW_AND_DENY: &str = "
metadata: {name: frontend-api, namespace: shop}
spec:
  selector: {matchLabels: {app: cart}}
  rules:
    - from: [{source: {serviceAccounts: [shop/frontend]}}]
      to: [{operation: {ports: [8080], methods: [GET], paths: ['/api/*']}}]
    - from: [{source: {namespaces: [ops]}}]
    - from: [{source: {notPrincipals: ['*']}}]
      to: [{operation: {ports: [5432]}}]
---
metadata: {name: no-admin, namespace: shop}
spec:
  action: DENY
  rules:
    - from: [{source: {notNamespaces: [ops]}}]
      to: [{operation: {ports: [8080, 9090], paths: [/admin]}}]
";

const DENY_ALL_AND_AUDIT: &str = "
metadata: {name: deny-all, namespace: shop}
spec: {}
---
metadata: {name: watch, namespace: shop}
spec:
  action: AUDIT
  rules:
    - to: [{operation: {ports: [9090], notMethods: [GET]}}]
    - from: [{source: {ipBlocks: [192.168.0.0/16]}}]
";

const DRY_RUN: &str = "
metadata: {name: shop-only, namespace: shop}
spec:
  rules: [{from: [{source: {namespaces: [shop]}}]}]
---
metadata: {name: try-deny-admin, namespace: shop}
spec:
  action: DENY
  dryRun: true
  rules: [{to: [{operation: {ports: [8080, 9090], paths: ['*min']}}]}]
---
metadata: {name: try-allow-ops, namespace: shop}
spec:
  dryRun: true
  rules: [{from: [{source: {principals: ['spiffe://cluster.local/ns/ops/*']}}]}]
";

const MESH_WIDE_AND_HOSTS: &str = "
metadata: {name: no-outside, namespace: aether-system}
spec:
  action: DENY
  rules:
    - from: [{source: {ipBlocks: [192.168.0.0/16], notPrincipals: ['spiffe://cluster.local/ns/ops/sa/admin']}}]
---
metadata: {name: by-host, namespace: shop}
spec:
  targetRefs: [{kind: Service, name: cart}]
  rules:
    - to: [{operation: {ports: [8080], hosts: [cart.shop.aether.internal]}}]
    - to: [{operation: {ports: [9090], notHosts: ['*.example']}}]
    - from: [{source: {principals: ['*']}}]
      to: [{operation: {ports: [5432]}}]
    - to: [{operation: {notPorts: [5432, 8080], methods: [POST]}}]
";

const NOT_SELECTING_AND_DRY_ONLY: &str = "
metadata: {name: elsewhere, namespace: web}
spec: {}
---
metadata: {name: other-app, namespace: shop}
spec: {selector: {matchLabels: {app: db}}}
---
metadata: {name: dry-only, namespace: shop}
spec:
  dryRun: true
  rules: [{from: [{source: {notIpBlocks: [192.168.0.0/16]}}]}]
";

fn set(documents: &str) -> Vec<Arc<AuthorizationPolicy>> {
    let yaml: Vec<String> = documents.split("---").map(|d| format!("{HEADER}{d}")).collect();
    policies(&yaml.join("---\n"))
}

/// Every combination of caller, peer, and TCP or HTTP request to cart's ports.
fn matrix() -> Vec<AuthzRequest> {
    let principals = [
        Some("spiffe://cluster.local/ns/shop/sa/frontend"),
        Some("spiffe://cluster.local/ns/ops/sa/admin"),
        Some("spiffe://other.td/ns/shop/sa/frontend"),
        None,
    ];
    let mut https = vec![None];
    for port in [8080, 9090] {
        for method in ["GET", "POST"] {
            for path in ["/api/items?x=1", "/admin", "/"] {
                for host in [
                    "cart.shop.aether.internal:8080",
                    "CART.shop.aether.internal",
                    "other.example",
                ] {
                    https.push(Some((port, method, path, host)));
                }
            }
        }
    }
    let mut requests = Vec::new();
    for principal in principals {
        for peer in ["10.1.0.5", "192.168.1.1"] {
            for http in &https {
                requests.push(AuthzRequest {
                    workload: super::super::workload(&cart()),
                    principal: principal.map(str::to_owned),
                    trust_domain: TRUST_DOMAIN.into(),
                    peer_ip: peer.parse().unwrap(),
                    // Raw TCP is delivered to the primary port.
                    port: http.map_or(5432, |h| h.0),
                    http: http.map(|(_, method, path, host)| HttpRequest {
                        method: method.into(),
                        path: path.into(),
                        host: host.into(),
                    }),
                });
            }
        }
    }
    requests
}

#[test]
fn the_compiled_rbac_decides_as_decide_does() {
    for (name, documents) in [
        ("allow and deny", ALLOW_AND_DENY),
        ("deny-all and audit", DENY_ALL_AND_AUDIT),
        ("dry run", DRY_RUN),
        ("mesh-wide and hosts", MESH_WIDE_AND_HOSTS),
        ("not selecting, dry run only", NOT_SELECTING_AND_DRY_ONLY),
    ] {
        let policies = set(documents);
        let mut generator = generator_in(TRUST_DOMAIN);
        let generated = generate(&mut generator, &catalog(&policies), &[cart()]);
        assert_eq!(generator.refused_policies().count(), 0, "{name}");
        let listener = inbound(&generated, &cart());
        let refs: Vec<&AuthorizationPolicy> = policies.iter().map(|p| &**p).collect();
        let mut verdicts = std::collections::BTreeSet::new();
        for request in matrix() {
            let decision = decide(&refs, &request);
            let judged = judge(&listener, &request);
            let context = format!("{name}: {request:?}\n{decision:?}\n{judged:?}");
            assert_eq!(judged.verdict, decision.verdict, "{context}");
            let denied_by = match &decision.cause {
                Cause::Denied(rule) => Some(format!("{}#{}", rule.policy, rule.rule)),
                _ => None,
            };
            assert_eq!(judged.denied_by, denied_by, "{context}");
            assert_eq!(judged.dry_run, decision.dry_run.as_ref().map(|d| d.0), "{context}");
            let audited: Vec<String> = (decision.audited.iter())
                .map(|r| format!("{}#{}", r.policy, r.rule))
                .collect();
            assert_eq!(judged.audited, audited, "{context}");
            verdicts.insert(format!("{:?}", decision.verdict));
            verdicts.extend(decision.dry_run.map(|d| format!("dry {:?}", d.0)));
            verdicts.extend((!decision.audited.is_empty()).then(|| "audited".to_owned()));
        }
        // Each set allows and denies something (or audits), so the agreement is not vacuous.
        let one_sided = ["deny-all and audit", "not selecting, dry run only"];
        let both = ["Allow", "Deny"].map(|v| verdicts.contains(v));
        assert!(
            both == [true, true] || one_sided.contains(&name),
            "{name}: {verdicts:?}"
        );
        assert!(verdicts.len() >= 2, "{name}: {verdicts:?}");
    }
}
