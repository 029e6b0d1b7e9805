//! The suite with Kubernetes Services: the registrar reads the fake API server (`--from-kubernetes`, which excludes
//! a routes directory), so routes are applied there as objects, and each echo service gets a core/v1 Service with
//! a ClusterIP from a test range and ports that map onto the echo pods' own (one by number, one by name).

use std::collections::BTreeMap;
use std::path::PathBuf;

use aether_api::gateway::{GrpcRoute, HttpRoute, TcpRoute, TlsRoute};
use aether_fakes::kube::ApiServer;
use k8s_openapi::api::core::v1::Service;
use serde_json::{Value, json};

use crate::mesh::NAMESPACE;

/// The cluster DNS domain the agent assumes (its `--cluster-domain` default).
pub const CLUSTER_DOMAIN: &str = "cluster.local";

/// The echo services' ClusterIPs (a test range, as a cluster's 10.96.0.0/12).
pub const CLUSTER_IPS: [(&str, &str); 3] = [
    ("echo", "10.96.7.10"),
    ("echo-v1", "10.96.7.11"),
    ("echo-v2", "10.96.7.12"),
];

/// A core/v1 Service in the test namespace: the echo pods' ports as themselves, plus `web` 8000 → 80 and `alt`
/// 9080 → 8080, as Services whose port is not the container's. (No named targetPort: the mesh's endpoints carry
/// no port names to resolve one by.)
pub fn kubernetes_service(name: &str, cluster_ip: &str, traffic_distribution: Option<&str>) -> Value {
    json!({
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "type": "ClusterIP",
            "clusterIP": cluster_ip,
            "clusterIPs": [cluster_ip],
            "trafficDistribution": traffic_distribution,
            "ports": [
                {"name": "http", "port": 80, "targetPort": 80, "appProtocol": "http"},
                {"name": "http-alt", "port": 8080, "appProtocol": "http"},
                {"name": "grpc", "port": 7070, "targetPort": 7070},
                {"name": "web", "port": 8000, "targetPort": 80},
                {"name": "alt", "port": 9080, "targetPort": 8080},
            ],
        },
    })
}

/// What a suite wrote to change the routes, to be undone with [`Written::remove`].
pub enum Written {
    /// A file in the registrar's routes directory.
    File(PathBuf),
    /// Route objects in the fake API server: (kind, namespace, name).
    Objects(Vec<(String, String, String)>),
}

impl Written {
    pub fn remove(self, cluster: &ApiServer) {
        match self {
            Written::File(file) => {
                std::fs::remove_file(&file).unwrap_or_else(|e| panic!("removing {}: {e}", file.display()))
            }
            Written::Objects(objects) => {
                for (kind, namespace, name) in objects {
                    match kind.as_str() {
                        "GRPCRoute" => cluster.delete::<GrpcRoute>(&namespace, &name),
                        "TCPRoute" => cluster.delete::<TcpRoute>(&namespace, &name),
                        "TLSRoute" => cluster.delete::<TlsRoute>(&namespace, &name),
                        _ => cluster.delete::<HttpRoute>(&namespace, &name),
                    }
                }
            }
        }
    }
}

/// Applies every HTTPRoute, GRPCRoute, TCPRoute and TLSRoute of `yaml` (one or more documents) to the fake API server, whole.
pub fn apply_routes(cluster: &ApiServer, yaml: &str) -> Written {
    let mut input = yaml.as_bytes();
    let mut applied = Vec::new();
    for document in serde_saphyr::read::<_, Value>(&mut input) {
        let document = document.unwrap_or_else(|e| panic!("routes YAML: {e}"));
        let kind = document["kind"].as_str().unwrap_or_default().to_owned();
        let metadata = &document["metadata"];
        let namespace = metadata["namespace"].as_str().unwrap_or("default").to_owned();
        let name = metadata["name"].as_str().expect("a route's name").to_owned();
        match kind.as_str() {
            "HTTPRoute" => cluster.apply::<HttpRoute>(document),
            "GRPCRoute" => cluster.apply::<GrpcRoute>(document),
            "TCPRoute" => cluster.apply::<TcpRoute>(document),
            "TLSRoute" => cluster.apply::<TlsRoute>(document),
            other => panic!("routes YAML: a {other:?}, not a route"),
        };
        applied.push((kind, namespace, name));
    }
    Written::Objects(applied)
}

/// Creates the echo services' Services; their ClusterIPs by service.
pub fn create_services(cluster: &ApiServer) -> BTreeMap<String, String> {
    CLUSTER_IPS
        .iter()
        .map(|(service, ip)| {
            cluster.apply::<Service>(kubernetes_service(service, ip, None));
            ((*service).to_owned(), (*ip).to_owned())
        })
        .collect()
}
