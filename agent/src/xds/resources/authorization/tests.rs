//! The compiled RBAC against `decide`: an evaluator of the Envoy RBAC subset we emit
//! (`eval`), a request matrix over policy sets judged by both (`table`), the filters'
//! shape, refusals and re-generation (`compiled`), and Envoy's own validation (`envoy`).

mod compiled;
pub mod data_path;
mod drain;
mod envoy;
mod eval;
mod index;
mod table;

use std::collections::BTreeMap;
use std::sync::Arc;

use aether_api::authorization::{ProjectOptions, parse_documents, project};
use aether_proto::registry::v1::{AuthorizationPolicy, Locality};
use aether_proto::view::{CatalogView, policy_key};
use envoy_types::pb::envoy::config::listener::v3::{Listener, filter};
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::HttpConnectionManager;
use prost::Message;

use crate::pod::{ContainerPort, LocalPod, PodInfo};
use crate::xds::resources::{Generated, Generator, Inputs};

/// `shop/cart-1` (labels app=cart, service shop/cart): TCP 5432 (primary, so the TCP
/// chain's port), HTTP 8080 and HTTP/2 9090.
pub fn cart() -> LocalPod {
    let port = |name: &str, port: u16| ContainerPort {
        name: name.into(),
        port,
        protocol: "TCP".into(),
    };
    LocalPod {
        container_id: "c-cart".into(),
        listener_sockets: Default::default(),
        netns: "/run/aether/netns/cart".into(),
        ips: vec!["10.2.0.1".parse().unwrap()],
        info: PodInfo {
            namespace: "shop".into(),
            name: "cart-1".into(),
            service_account: "cart".into(),
            labels: BTreeMap::from([("app".into(), "cart".into())]),
            ports: vec![port("tcp-db", 5432), port("http", 8080), port("http2-admin", 9090)],
            ..Default::default()
        },
    }
}

/// A generator whose node's identities are of `trust_domain` (listeners stay plaintext).
pub fn generator_in(trust_domain: &str) -> Generator {
    let mut generator = Generator::default();
    generator.set_identities(Arc::new(crate::identity::Identities {
        trust_domain: trust_domain.to_owned(),
        ..Default::default()
    }));
    generator
}

/// Policies from YAML, projected as the registrar does.
pub fn policies(yaml: &str) -> Vec<Arc<AuthorizationPolicy>> {
    let objects = parse_documents(yaml).into_iter().map(|o| o.unwrap());
    let projected = objects.map(|o| project(&o, &ProjectOptions::default()).unwrap());
    projected.map(Arc::new).collect()
}

pub fn catalog(policies: &[Arc<AuthorizationPolicy>]) -> CatalogView {
    CatalogView {
        policies: policies.iter().map(|p| (policy_key(p), p.clone())).collect(),
        ..Default::default()
    }
}

pub fn generate(generator: &mut Generator, catalog: &CatalogView, pods: &[LocalPod]) -> Generated {
    let locality = Locality::default();
    let on_demand = BTreeMap::new();
    generator.generate(&Inputs {
        pods,
        catalog,
        mesh_domain: "aether.internal",
        locality: &locality,
        on_demand: &on_demand,
        own_only: &Default::default(),
    })
}

/// The pod's inbound listener as generated, with its route table (RDS) inlined, as
/// Envoy holds the two together.
pub fn inbound(generated: &Generated, pod: &LocalPod) -> Listener {
    let name = format!("inbound|{}", pod.id());
    let find = |type_url: &str| {
        let resources = &generated[type_url];
        resources.iter().find(|r| r.name == name).map(|r| r.body.value.clone())
    };
    let mut listener = Listener::decode(&*find(crate::xds::LISTENER).unwrap()).unwrap();
    let Some(routes) = find(crate::xds::ROUTE) else {
        return listener;
    };
    let hcm_filter = &mut listener.filter_chains[0].filters[0];
    let Some(filter::ConfigType::TypedConfig(any)) = &mut hcm_filter.config_type else {
        panic!("untyped HCM");
    };
    let mut hcm = HttpConnectionManager::decode(&*any.value).unwrap();
    hcm.route_specifier = None;
    // The table's own bytes as `route_config` (field 4): re-encoding it would shuffle its
    // per-filter map, and equal listeners must compare equal.
    any.value = hcm.encode_to_vec();
    any.value.extend(
        InlineRoutes {
            route_config: routes.to_vec(),
        }
        .encode_to_vec(),
    );
    listener
}

/// `HttpConnectionManager.route_config`, as raw bytes.
#[derive(Clone, PartialEq, prost::Message)]
struct InlineRoutes {
    #[prost(bytes = "vec", tag = "4")]
    route_config: Vec<u8>,
}
