//! `aether-agent run`: wiring and start-up reconciliation.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::Arc;

use aether_common::admin::{AdminError, AdminServer, Pages, Readiness};
use aether_proto::cni::v1::cni_plugin_server::CniPluginServer;
use aether_proto::registry::v1::Locality;
use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_server::AggregatedDiscoveryServiceServer;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::net::UnixListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_stream::wrappers::UnixListenerStream;
use tokio_util::sync::CancellationToken;

use crate::cni::CniService;
use crate::config::{Config, PodSourceKind};
use crate::node::{Node, NodeMetrics, WatchedCatalog};
use crate::pod_source::{PodDirectory, kubernetes, static_dir};
use crate::pod_store::{PodStore, PodStoreError};
use crate::registrar::Registrar;
use crate::xds::cache::Cache;
use crate::xds::{AdsServer, Hooks, XdsMetrics};

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("creating {path}: {source}")]
    Dir { path: String, source: std::io::Error },
    #[error(transparent)]
    PodStore(#[from] PodStoreError),
    #[error("--registrar: {0}")]
    Registrar(String),
    #[error("binding the Unix socket {path}: {source}")]
    Socket { path: String, source: std::io::Error },
    #[error(transparent)]
    Admin(#[from] AdminError),
    #[error("--pod-source kubernetes: {0}")]
    Kubernetes(String),
}

pub struct Running {
    pub admin_addr: SocketAddr,
    pub node: Node,
    task: JoinHandle<()>,
}

impl Running {
    pub async fn wait(self) {
        let _ = self.task.await;
    }
}

/// Binds a Unix socket readable and writable by its owner only.
fn bind_private(path: &Path) -> Result<UnixListener, StartError> {
    let fail = |source| StartError::Socket {
        path: path.display().to_string(),
        source,
    };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(fail)?;
    }
    // A socket left by a previous run would make bind fail.
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(fail(e)),
    }
    let listener = UnixListener::bind(path).map_err(fail)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(fail)?;
    Ok(listener)
}

pub async fn start(config: Config, shutdown: CancellationToken) -> Result<Running, StartError> {
    std::fs::create_dir_all(&config.state_dir).map_err(|source| StartError::Dir {
        path: config.state_dir.display().to_string(),
        source,
    })?;
    let _ = std::fs::set_permissions(&config.state_dir, std::fs::Permissions::from_mode(0o700));
    let pods = PodStore::open(&config.state_dir)?;
    let locality = Locality {
        region: config.region.clone(),
        zone: config.zone.clone(),
        subzone: config.subzone.clone(),
    };
    let registrar =
        Registrar::new(&config.registrar, config.node_name.clone(), locality.clone()).map_err(StartError::Registrar)?;

    let mut registry = Registry::default();
    let metrics = registry.sub_registry_with_prefix("aether_agent");
    let xds_metrics = XdsMetrics::default();
    xds_metrics.register(metrics);
    let node_metrics = NodeMetrics::default();
    metrics.register(
        "dependencies",
        "Services in the node's dependency set",
        node_metrics.dependencies.clone(),
    );
    metrics.register(
        "clusters",
        "Clusters served to the node's Envoy",
        node_metrics.clusters.clone(),
    );
    metrics.register("pods", "Mesh pods on this node", node_metrics.pods.clone());
    metrics.register(
        "pod_config_errors",
        "Malformed mesh annotation entries on this node's pods (skipped; see /debug/pods)",
        node_metrics.pod_config_errors.clone(),
    );
    metrics.register(
        "rebuilds",
        "xDS snapshots that changed something",
        node_metrics.rebuilds.clone(),
    );
    let registrar_connected = Gauge::default();
    metrics.register(
        "registrar_connected",
        "1 while the registrar watch stream is up",
        registrar_connected.clone(),
    );
    let cni_calls = prometheus_client::metrics::family::Family::default();
    metrics.register("cni_calls", "CNI plugin calls, by method and result", cni_calls.clone());

    let (catalog_tx, catalog_rx) = watch::channel(Arc::new(WatchedCatalog::default()));
    let (deps_tx, deps_rx) = watch::channel(BTreeSet::new());
    let cache = Cache::default();
    let node = Node::new(
        &config.mesh_domain,
        locality,
        pods.clone(),
        cache.clone(),
        catalog_rx,
        deps_tx,
        node_metrics,
    );

    // Pods from a previous run: drop those whose sandbox is gone, re-register the rest.
    let mut known = 0;
    for pod in pods.all() {
        if !pod.netns.exists() {
            tracing::info!(pod = %pod.id(), netns = %pod.netns.display(), "forgetting a pod whose sandbox is gone");
            let _ = pods.remove(&pod.id());
            let registrar = registrar.clone();
            tokio::spawn(async move { registrar.unregister(&pod.info.service(), &pod.ips).await });
            continue;
        }
        known += 1;
        let registrar = registrar.clone();
        tokio::spawn(async move {
            if let Err(status) = registrar.register(&pod).await {
                tracing::warn!(pod = %pod.id(), %status, "re-registering a known pod failed; it is retried on the next change");
            }
        });
    }
    tracing::info!(pods = known, "local pods recovered from the state dir");
    node.rebuild();

    let directory = PodDirectory::default();
    match config.pod_source {
        PodSourceKind::Static => {
            tokio::spawn(static_dir::run(
                config.pod_dir.clone(),
                directory.clone(),
                shutdown.clone(),
            ));
        }
        PodSourceKind::Kubernetes => {
            let client = kubernetes::client_from_env().await.map_err(StartError::Kubernetes)?;
            tokio::spawn(kubernetes::run(
                client,
                config.node_name.clone(),
                directory.clone(),
                shutdown.clone(),
            ));
        }
    }
    tokio::spawn(sync_pod_info(
        directory.clone(),
        node.clone(),
        registrar.clone(),
        shutdown.clone(),
    ));
    tokio::spawn(
        registrar
            .clone()
            .watch(deps_rx, catalog_tx, registrar_connected, shutdown.clone()),
    );
    tokio::spawn(node.clone().run(shutdown.clone()));

    let hooks = Hooks {
        metrics: xds_metrics,
        on_demand: {
            let node = node.clone();
            Arc::new(move |type_url: &str, names: &[String]| node.on_demand(type_url, names))
        },
    };
    let xds_listener = bind_private(&config.xds_socket)?;
    let cni_listener = bind_private(&config.cni_socket)?;
    let xds_server = tonic::transport::Server::builder()
        .add_service(AggregatedDiscoveryServiceServer::new(AdsServer::new(
            cache.clone(),
            hooks,
        )))
        .serve_with_incoming_shutdown(
            UnixListenerStream::new(xds_listener),
            shutdown.clone().cancelled_owned(),
        );
    let cni = CniService {
        node: node.clone(),
        directory,
        registrar,
        excluded_namespaces: config.excluded(),
        pod_lookup_timeout: config.pod_lookup_timeout,
        calls: cni_calls,
    };
    let cni_server = tonic::transport::Server::builder()
        .add_service(CniPluginServer::new(cni))
        .serve_with_incoming_shutdown(
            UnixListenerStream::new(cni_listener),
            shutdown.clone().cancelled_owned(),
        );

    let readiness = Readiness::new("starting");
    let admin = AdminServer::bind(config.admin, readiness.clone(), Arc::new(registry))
        .await?
        .with_pages(debug_pages(node.clone()));
    let admin_addr = admin.local_addr().map_err(|source| StartError::Socket {
        path: config.admin.to_string(),
        source,
    })?;
    tokio::spawn(admin.serve(shutdown.clone()));
    readiness.set_ready();
    tracing::info!(node = %config.node_name, xds = %config.xds_socket.display(), cni = %config.cni_socket.display(),
        %admin_addr, "agent serving");

    let task = tokio::spawn(async move {
        let (xds, cni) = tokio::join!(xds_server, cni_server);
        for (what, result) in [("xDS", xds), ("CNI", cni)] {
            if let Err(error) = result {
                tracing::error!(%error, "{what} server failed");
            }
        }
        readiness.set_not_ready("stopped");
    });
    Ok(Running { admin_addr, node, task })
}

/// Keeps local pods' metadata current with the pod source: a pod that starts
/// terminating drains; annotation changes re-scope the node.
async fn sync_pod_info(directory: PodDirectory, node: Node, registrar: Registrar, shutdown: CancellationToken) {
    let mut changes = directory.subscribe();
    loop {
        for pod in node.pods.all() {
            let Some(info) = directory.get(&pod.id()) else { continue };
            if info == pod.info || (!pod.info.uid.is_empty() && info.uid != pod.info.uid) {
                continue;
            }
            let mut updated = pod.clone();
            updated.info = info;
            if let Err(error) = node.pods.put(updated.clone()) {
                tracing::error!(pod = %pod.id(), %error, "saving updated pod metadata failed");
                continue;
            }
            if let Err(status) = registrar.register(&updated).await {
                tracing::warn!(pod = %pod.id(), %status, "updating the pod's endpoint failed");
            }
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            changed = changes.changed() => if changed.is_err() { return },
        }
    }
}

fn debug_pages(node: Node) -> Pages {
    Arc::new(move |path: &str| {
        let body = match path {
            "/debug/pods" => {
                let pods: Vec<_> = node
                    .pods
                    .all()
                    .into_iter()
                    .map(|p| {
                        serde_json::json!({
                            "pod": p.id(),
                            "container_id": p.container_id,
                            "netns": p.netns,
                            "ips": p.ips,
                            "service": p.info.service(),
                            "upstreams": p.info.upstreams().services,
                            "config_errors": p.info.config_errors(),
                            "terminating": p.info.terminating,
                        })
                    })
                    .collect();
                serde_json::json!({ "pods": pods })
            }
            "/debug/dependencies" => {
                let pods = node.pods.all();
                let watched = node.catalog.borrow().clone();
                serde_json::json!({
                    "dependencies": node.dependencies(&pods),
                    "watched": watched.filter,
                    "known": watched.catalog.services.keys().collect::<Vec<_>>(),
                })
            }
            "/debug/xds" => {
                let snapshot = node.cache.snapshot();
                let acked = node.cache.acked();
                let types: serde_json::Map<String, serde_json::Value> = snapshot
                    .types
                    .iter()
                    .map(|(type_url, resources)| {
                        let entries: serde_json::Map<String, serde_json::Value> = resources
                            .iter()
                            .map(|(name, r)| {
                                let have = acked.get(type_url).and_then(|m| m.get(name));
                                (name.clone(), serde_json::json!({ "served": r.version, "acked": have }))
                            })
                            .collect();
                        (type_url.clone(), serde_json::Value::Object(entries))
                    })
                    .collect();
                serde_json::json!({ "serial": snapshot.serial, "types": types })
            }
            _ => return None,
        };
        Some((200, serde_json::to_string_pretty(&body).expect("JSON serialises")))
    })
}
