//! Captured connections are routed by their original destination and explicit calls by
//! their authority, through one table: the stamps of the two listener chains, the
//! domains each virtual host answers to, and ClusterIPs (with their Kubernetes names)
//! routed like the VIP.

use aether_proto::registry::v1::{KubernetesService, ServicePort};
use envoy_types::pb::envoy::config::core::v3::header_value_option::HeaderAppendAction;
use envoy_types::pb::envoy::extensions::http::early_header_mutation::header_mutation::v3::HeaderMutation as EarlyHeaderMutation;

use super::super::DESTINATION_HEADER;
use super::*;

/// The catalog with ClusterIPs on some services.
pub(super) fn with_cluster_ips(routes: Vec<Route>, ips: &[(&str, &[&str])]) -> CatalogView {
    let mut catalog = catalog(routes);
    for (key, ips) in ips {
        let service = catalog.services.get_mut(*key).unwrap();
        service.kubernetes = Some(KubernetesService {
            cluster_ips: ips.iter().map(|ip| (*ip).into()).collect(),
            traffic_distribution: 0,
            ports: Vec::new(),
        });
    }
    catalog
}

/// A Kubernetes Service port: `(name, port, numeric target or 0, named target)`.
fn service_port((name, port, target_port, target_port_name): (&str, u32, u32, &str)) -> ServicePort {
    ServicePort {
        name: name.into(),
        port,
        target_port,
        target_port_name: target_port_name.into(),
        app_protocol: String::new(),
    }
}

/// `key` gets these Kubernetes Service ports, and its endpoints' port 9000 the name `grpc`.
pub(super) fn with_service_ports(catalog: &mut CatalogView, key: &str, ports: &[(&str, u32, u32, &str)]) {
    let service = catalog.services.get_mut(key).unwrap();
    service.kubernetes.as_mut().unwrap().ports = ports.iter().copied().map(service_port).collect();
    let endpoints = Arc::make_mut(catalog.endpoints.get_mut(key).unwrap());
    for port in endpoints.values_mut().flat_map(|e| &mut e.ports) {
        if port.port == 9000 {
            port.name = "grpc".into();
        }
    }
}

/// The generator's output with the default cluster domain.
pub(super) fn generated_with(catalog: &CatalogView, pods: &[LocalPod]) -> Generated {
    let (locality, on_demand) = (Locality::default(), BTreeMap::new());
    crate::xds::resources::Generator::default().generate(&Inputs {
        pods,
        catalog,
        mesh_domain: DOMAIN,
        locality: &locality,
        on_demand: &on_demand,
        own_only: &Default::default(),
    })
}

pub(super) fn tables_of(generated: &Generated) -> BTreeMap<String, RouteConfiguration> {
    super::served_tables(generated)
}

#[test]
fn one_table_picks_virtual_hosts_by_the_stamped_destination_header() {
    let canary = http_route("canary", vec![rule(Vec::new(), &[("gamma/echo-v1", 1)])]);
    let tables = tables(vec![canary], &[]);
    assert_eq!(tables.keys().collect::<Vec<_>>(), ["outbound"]);
    let table = &tables["outbound"];
    assert_eq!(table.vhost_header, DESTINATION_HEADER);
    assert_eq!(table.request_headers_to_remove, [DESTINATION_HEADER]);
    assert!(table.most_specific_header_mutations_wins);
    // The authorities explicit calls use and the destinations captured ones have.
    assert_eq!(
        vhost(table, "echo.gamma.aether.internal:80").domains,
        [
            "echo.gamma.aether.internal:80",
            "240.240.0.1:80",
            "echo.gamma.aether.internal",
            "240.240.0.1"
        ]
    );
    assert_eq!(
        vhost(table, "echo.gamma.aether.internal:9000").domains,
        ["echo.gamma.aether.internal:9000", "240.240.0.1:9000"]
    );
    // Anything else falls to the catch-all, which routes by authority, on demand.
    assert_eq!(vhost(table, "mesh-on-demand").domains, ["*"]);
}

#[test]
fn the_mesh_wide_mesh_domain_is_answered_like_the_nodes_own() {
    let mut catalog = catalog(Vec::new());
    let mesh = aether_proto::registry::v1::MeshConfig {
        namespace: "aether-system".into(),
        name: "default".into(),
        mesh_wide: true,
        mesh_domain: "corp.internal".into(),
        ..Default::default()
    };
    catalog
        .mesh_configs
        .insert("aether-system/default".into(), Arc::new(mesh));
    let tables = tables_of(&generated(&catalog, &[]));
    assert_eq!(
        vhost(&tables["outbound"], "echo.gamma.aether.internal:80").domains,
        [
            "echo.gamma.aether.internal:80",
            "echo.gamma.corp.internal:80",
            "240.240.0.1:80",
            "echo.gamma.aether.internal",
            "echo.gamma.corp.internal",
            "240.240.0.1"
        ]
    );
    // The node's own domain named again: nothing twice.
    let mesh = Arc::make_mut(catalog.mesh_configs.get_mut("aether-system/default").unwrap());
    mesh.mesh_domain = DOMAIN.into();
    let tables = tables_of(&generated(&catalog, &[]));
    assert_eq!(
        vhost(&tables["outbound"], "echo.gamma.aether.internal:9000").domains,
        ["echo.gamma.aether.internal:9000", "240.240.0.1:9000"]
    );
}

#[test]
fn cluster_ips_route_like_the_vip_and_kubernetes_names_like_the_mesh_name() {
    let catalog = with_cluster_ips(Vec::new(), &[("gamma/echo-v1", &["10.96.0.11", "fd00::11"])]);
    let mut generator = crate::xds::resources::Generator::default();
    generator.set_cluster_domain("example.cluster");
    let (locality, on_demand) = (Locality::default(), BTreeMap::new());
    let generated = generator.generate(&Inputs {
        pods: &[],
        catalog: &catalog,
        mesh_domain: DOMAIN,
        locality: &locality,
        on_demand: &on_demand,
        own_only: &Default::default(),
    });
    let tables = tables_of(&generated);
    let name = "echo-v1.gamma.aether.internal:80";
    assert_eq!(
        vhost(&tables["outbound"], name).domains,
        [
            "echo-v1.gamma.aether.internal:80",
            "echo-v1.gamma.svc.example.cluster:80",
            "echo-v1.gamma.svc:80",
            "240.240.0.2:80",
            "echo-v1.gamma.aether.internal",
            "240.240.0.2",
            "echo-v1.gamma.svc.example.cluster",
            "echo-v1.gamma.svc",
            "10.96.0.11:80",
            "[fd00::11]:80",
        ]
    );
    // Without a Kubernetes Service, no Kubernetes names.
    assert!(
        !vhost(&tables["outbound"], "echo.gamma.aether.internal:80")
            .domains
            .iter()
            .any(|d| d.contains(".svc"))
    );
}

#[test]
fn an_address_two_services_claim_stays_with_the_first_so_envoy_never_refuses_the_table() {
    let catalog = with_cluster_ips(
        Vec::new(),
        &[("gamma/echo-v1", &["10.96.0.7"]), ("gamma/echo-v2", &["10.96.0.7"])],
    );
    let tables = tables_of(&generated(&catalog, &[]));
    for table in tables.values() {
        let mut domains: Vec<&String> = table.virtual_hosts.iter().flat_map(|v| &v.domains).collect();
        let all = domains.len();
        domains.sort();
        domains.dedup();
        assert_eq!(domains.len(), all, "{}: a domain twice", table.name);
    }
    let table = &tables["outbound"];
    assert!(
        vhost(table, "echo-v1.gamma.aether.internal:80")
            .domains
            .contains(&"10.96.0.7:80".into())
    );
    assert!(
        !vhost(table, "echo-v2.gamma.aether.internal:80")
            .domains
            .contains(&"10.96.0.7:80".into())
    );
}

#[test]
fn explicit_calls_route_by_authority_and_captured_ones_by_their_stamped_destination() {
    let catalog = with_cluster_ips(Vec::new(), &[("gamma/db", &["10.96.0.4"])]);
    let mut client = pod("web", "client");
    client
        .info
        .annotations
        .insert("config.aether.io/upstreams".into(), "gamma/echo,gamma/db".into());
    let generated = generated(&catalog, &[client]);
    let listener = generated[crate::xds::LISTENER]
        .iter()
        .find(|r| r.name == "outbound|web/client")
        .map(|r| Listener::decode(&*r.body.value).unwrap())
        .unwrap();
    let [tcp, explicit] = &listener.filter_chains[..] else {
        panic!("{:?}", listener.filter_chains)
    };
    // db's TCP port by VIP or ClusterIP.
    let ranges: Vec<&str> = tcp
        .filter_chain_match
        .as_ref()
        .unwrap()
        .prefix_ranges
        .iter()
        .map(|r| r.address_prefix.as_str())
        .collect();
    assert_eq!(ranges, ["240.240.0.4", "10.96.0.4"]);
    let explicit_match = explicit.filter_chain_match.as_ref().unwrap();
    assert_eq!(
        explicit_match.destination_port.unwrap().value,
        crate::xds::resources::OUTBOUND_PORT
    );
    assert_eq!(explicit_match.prefix_ranges[0].address_prefix, "127.0.0.1");
    // Both chains use the one table; each stamps what picks the virtual host.
    assert_eq!(rds_of(explicit), "outbound");
    assert_eq!(stamp_of(explicit), "%REQ(:AUTHORITY)%");
    let captured = listener.default_filter_chain.as_ref().unwrap();
    assert_eq!(rds_of(captured), "outbound");
    assert_eq!(stamp_of(captured), "%DOWNSTREAM_LOCAL_ADDRESS%");
}

/// The value a chain's early header mutation stamps in the destination header, which
/// always overwrites: a client's own value never picks the virtual host.
fn stamp_of(chain: &envoy_types::pb::envoy::config::listener::v3::FilterChain) -> String {
    let early = &hcm_of(chain).early_header_mutation_extensions;
    assert_eq!(early.len(), 1);
    let mutation = EarlyHeaderMutation::decode(&*early[0].typed_config.as_ref().unwrap().value).unwrap();
    let Some(envoy_types::pb::envoy::config::common::mutation_rules::v3::header_mutation::Action::Append(stamp)) =
        &mutation.mutations[0].action
    else {
        panic!("{mutation:?}")
    };
    assert_eq!(stamp.append_action, HeaderAppendAction::OverwriteIfExistsOrAdd as i32);
    let header = stamp.header.as_ref().unwrap();
    assert_eq!(header.key, DESTINATION_HEADER);
    header.value.clone()
}

#[test]
fn cluster_ips_and_kubernetes_names_answer_on_the_service_ports_mapped_to_their_targets() {
    let mut catalog = with_cluster_ips(Vec::new(), &[("gamma/echo-v1", &["10.96.0.11"])]);
    let ports = [
        ("http", 8080, 80, ""),
        ("http-too", 8081, 80, ""),
        ("grpc", 7070, 0, "grpc"),
        ("gone", 7071, 0, "no-such-name"),
    ];
    with_service_ports(&mut catalog, "gamma/echo-v1", &ports);
    let tables = tables_of(&generated_with(&catalog, &[]));
    let table = &tables["outbound"];
    // ClusterIP:8080 and :8081 reach endpoint port 80; the VIP keeps the endpoint port.
    let http = &vhost(table, "echo-v1.gamma.aether.internal:80").domains;
    assert!(
        ["240.240.0.2:80", "10.96.0.11:8080", "10.96.0.11:8081"]
            .iter()
            .all(|d| http.contains(&(*d).to_owned())),
        "{http:?}"
    );
    // A named targetPort resolves by the endpoints' port names; one no endpoint names reaches nothing.
    assert_eq!(
        vhost(table, "echo-v1.gamma.aether.internal:9000").domains,
        [
            "echo-v1.gamma.aether.internal:9000",
            "echo-v1.gamma.svc.cluster.local:7070",
            "echo-v1.gamma.svc:7070",
            "240.240.0.2:9000",
            "10.96.0.11:7070",
        ]
    );
    assert!(
        http.contains(&"echo-v1.gamma.svc.cluster.local:8080".to_owned()),
        "{http:?}"
    );
    assert!(
        !http.contains(&"echo-v1.gamma.svc.cluster.local:80".to_owned()),
        "{http:?}"
    );
    let every: Vec<&String> = table.virtual_hosts.iter().flat_map(|v| &v.domains).collect();
    assert!(
        !every.iter().any(|d| d.ends_with(":7071") || *d == "10.96.0.11:80"),
        "{every:?}"
    );
}

#[test]
fn a_name_without_port_reaches_the_target_of_service_port_80() {
    let mut catalog = with_cluster_ips(Vec::new(), &[("gamma/echo-v1", &["10.96.0.11"])]);
    with_service_ports(
        &mut catalog,
        "gamma/echo-v1",
        &[("grpc", 80, 9000, ""), ("http", 8080, 80, "")],
    );
    let tables = tables_of(&generated_with(&catalog, &[]));
    let domains = |port: u32| {
        vhost(&tables["outbound"], &format!("echo-v1.gamma.aether.internal:{port}"))
            .domains
            .clone()
    };
    assert!(domains(9000).contains(&"echo-v1.gamma.svc.cluster.local".to_owned()));
    assert!(domains(9000).contains(&"echo-v1.gamma.svc.cluster.local:80".to_owned()));
    // The mesh name without a port stays on the endpoints' port 80.
    assert!(domains(80).contains(&"echo-v1.gamma.aether.internal".to_owned()));
    assert!(!domains(80).contains(&"echo-v1.gamma.svc.cluster.local".to_owned()));
}

#[test]
fn tcp_to_a_cluster_ip_is_matched_on_the_service_port_that_targets_the_endpoint_port() {
    let mut catalog = with_cluster_ips(Vec::new(), &[("gamma/db", &["10.96.0.4"])]);
    with_service_ports(&mut catalog, "gamma/db", &[("pg", 15432, 5432, "")]);
    let mut client = pod("web", "client");
    client
        .info
        .annotations
        .insert("config.aether.io/upstreams".into(), "gamma/db".into());
    let generated = generated_with(&catalog, &[client]);
    let listener = generated[crate::xds::LISTENER]
        .iter()
        .find(|r| r.name == "outbound|web/client")
        .map(|r| Listener::decode(&*r.body.value).unwrap())
        .unwrap();
    let tcp: Vec<(u32, Vec<&str>)> = listener
        .filter_chains
        .iter()
        .filter_map(|chain| chain.filter_chain_match.as_ref())
        .filter(|m| m.prefix_ranges.iter().all(|r| r.address_prefix != "127.0.0.1"))
        .map(|m| {
            let ranges = m.prefix_ranges.iter().map(|r| r.address_prefix.as_str()).collect();
            (m.destination_port.unwrap().value, ranges)
        })
        .collect();
    assert_eq!(tcp, [(5432, vec!["240.240.0.4"]), (15432, vec!["10.96.0.4"])]);
}
