//! The real Envoy accepts the compiled filters: the inbound listener of a pod with every
//! matcher the compiler emits (principal patterns, service accounts, namespaces, blocks,
//! ports on both chains, methods, paths, hosts, negations, dry run, audit), in a static bootstrap checked by `envoy --mode validate`. Fails when Envoy is missing.

use envoy_types::pb::envoy::config::bootstrap::v3::{Bootstrap, bootstrap};
use envoy_types::pb::envoy::config::cluster::v3::Cluster;
use envoy_types::pb::envoy::config::core::v3::Node;
use envoy_types::pb::envoy::config::listener::v3::filter;
use envoy_types::pb::envoy::extensions::filters::network::rbac::v3::Rbac as NetworkRbac;

use super::*;
use crate::proxy::envoy::{EnvoyBinary, test_envoy_bin};
use crate::xds::resources::util::any;

const EVERY_MATCHER: &str = "apiVersion: security.aether.io/v1alpha1
kind: AuthorizationPolicy
metadata: {name: every-matcher, namespace: shop}
spec:
  rules:
    - from:
        - source:
            principals: ['spiffe://cluster.local/ns/shop/sa/frontend', 'spiffe://cluster.local/ns/ops/*', '*/sa/admin', '*']
            notServiceAccounts: [shop/legacy]
            namespaces: [shop, ops]
            ipBlocks: [10.0.0.0/8, 'fd00::/8']
            notIpBlocks: [10.9.0.0/16]
      to:
        - operation:
            ports: [8080, 9090]
            notMethods: [DELETE]
            methods: [GET, POST]
            paths: ['/api/*', '*.json', /healthz, '*']
            notPaths: [/api/admin]
            hosts: [cart.shop.aether.internal, '*.aether.internal', 'cart.*']
            notHosts: ['*.example']
    - to: [{operation: {ports: [5432]}}]
---
apiVersion: security.aether.io/v1alpha1
kind: AuthorizationPolicy
metadata: {name: deny-dry, namespace: shop}
spec:
  action: DENY
  dryRun: true
  rules: [{from: [{source: {notNamespaces: [shop]}}], to: [{operation: {notPorts: [9090]}}]}]
---
apiVersion: security.aether.io/v1alpha1
kind: AuthorizationPolicy
metadata: {name: audit, namespace: shop}
spec:
  action: AUDIT
  rules: [{from: [{source: {notPrincipals: ['*']}}]}]
";

/// The pod's inbound listener and its delivery clusters, static.
fn bootstrap(generated: &Generated, pod: &LocalPod) -> Bootstrap {
    let clusters = generated[crate::xds::CLUSTER]
        .iter()
        .filter(|r| r.name.starts_with("local|"));
    Bootstrap {
        node: Some(Node {
            id: "validate".into(),
            cluster: "validate".into(),
            ..Default::default()
        }),
        static_resources: Some(bootstrap::StaticResources {
            listeners: vec![inbound(generated, pod)],
            clusters: clusters.map(|r| Cluster::decode(&*r.body.value).unwrap()).collect(),
            ..Default::default()
        }),
        ..Default::default()
    }
}

#[tokio::test]
async fn envoy_accepts_the_compiled_rbac_filters() {
    let envoy = EnvoyBinary::new(test_envoy_bin());
    let pod = cart();
    // Plaintext: the filters are the same with mTLS, which would need SDS here.
    let mut generator = Generator::default();
    let generated = generate(
        &mut generator,
        &catalog(&policies(EVERY_MATCHER)),
        std::slice::from_ref(&pod),
    );
    assert_eq!(generator.refused_policies().count(), 0);
    let mut bootstrap = bootstrap(&generated, &pod);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bootstrap.pb");
    std::fs::write(&path, bootstrap.encode_to_vec()).unwrap();
    envoy
        .validate(&path)
        .await
        .unwrap_or_else(|e| panic!("Envoy refuses the compiled RBAC: {e}"));

    // The check is real: a network RBAC without its (required) stat prefix is refused.
    let listener = &mut bootstrap.static_resources.as_mut().unwrap().listeners[0];
    let first = &mut listener.default_filter_chain.as_mut().unwrap().filters[0];
    let Some(filter::ConfigType::TypedConfig(config)) = &mut first.config_type else {
        panic!("untyped")
    };
    let mut rbac = NetworkRbac::decode(&*config.value).unwrap();
    rbac.stat_prefix.clear();
    *config = any(&rbac);
    std::fs::write(&path, bootstrap.encode_to_vec()).unwrap();
    let refused = envoy.validate(&path).await.unwrap_err().to_string();
    assert!(refused.to_lowercase().contains("stat_prefix"), "{refused}");
}
