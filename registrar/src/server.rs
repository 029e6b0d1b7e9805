//! Wiring: store → catalog → gRPC and admin servers, and the shutdown order that
//! loses nothing: stop accepting, end watch streams, finish in-flight writes, then
//! close the store.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use aether_api::authorization::ProjectOptions;
use aether_common::admin::{AdminError, AdminServer};
use aether_common::quote::quote;
use aether_common::readiness::{Gate, Readiness};
use aether_common::tasks::Tasks;
use aether_common::telemetry::{Component, MetricsPush};
use aether_common::tls::{self, CertFiles, CertSlot, TlsError};
use aether_proto::registrar::v1::node_bootstrap_server::NodeBootstrapServer;
use aether_proto::registrar::v1::registrar_server::RegistrarServer;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::api::RegistrarApi;
use crate::auth::Policy;
use crate::bootstrap::{Bootstrap, BootstrapConfig, BootstrapError};
use crate::catalog::{Catalog, CatalogConfig, OpenError};
use crate::cluster::ClusterAccess;
use crate::config::{Config, SecurityConfig, StoreKind};
use crate::external_services::ExternalServices;
use crate::http_filters::HttpFilters;
use crate::mesh_configs::MeshConfigs;
use crate::metrics::Metrics;
use crate::model::MAX_SERVICE_KEY_BYTES;
use crate::policies::Policies;
use crate::routes::Routes;
use crate::routes::kubernetes::status;
use crate::sources;
use crate::store::dynamodb::{DynamoConfig, DynamoStore};
use crate::store::embedded::EmbeddedStore;
use crate::store::etcd::{DEFAULT_MAX_TXN_OPS, EtcdConfig, EtcdStore, EtcdTlsFiles};
use crate::store::kubernetes::{KubeConfig, KubeStore};
use crate::store::{Store, StoreError, StoreSettings};
use crate::vip::{VipAllocator, VipError};
use crate::watch::MAX_FILTER_SERVICES;

/// Names the registrar's telemetry (`aether_registrar_*`, service.name aether-registrar).
pub const TELEMETRY: Component = Component {
    component: "registrar",
    binary: "aether-registrar",
    version: env!("CARGO_PKG_VERSION"),
};

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("--vip-cidr: {0}")]
    VipRange(#[from] VipError),
    #[error("--routes-dir: the kubernetes store is read-only and serves the cluster's own routes; drop --routes-dir")]
    RoutesOnReadOnlyStore,
    #[error("--mesh-root-namespace: {0}")]
    RootNamespace(String),
    #[error("opening the store: {0}")]
    Store(#[from] StoreError),
    #[error(transparent)]
    Open(#[from] OpenError),
    #[error("binding the gRPC listener to {addr}: {source}")]
    Bind { addr: SocketAddr, source: std::io::Error },
    #[error(transparent)]
    Admin(#[from] AdminError),
    #[error("TLS: {0}")]
    Tls(#[from] TlsError),
    #[error("node bootstrap: {0}")]
    Bootstrap(#[from] BootstrapError),
    #[error("telemetry: {0}")]
    Telemetry(#[from] aether_common::telemetry::TelemetryError),
}

/// The largest gRPC message the registrar decodes. The largest valid request is a
/// Watch filter naming [`MAX_FILTER_SERVICES`] keys of the longest valid form
/// ([`MAX_SERVICE_KEY_BYTES`], plus 2 bytes of protobuf framing each): about 12.9 MB.
/// Every other request is far smaller (a valid RegisterEndpoint is under 25 KiB: at
/// most 16 KiB of metadata, 64 ports and a few 253-byte labels). A request above this
/// cannot be valid and is refused by the transport from its length prefix, before it
/// is buffered (OUT_OF_RANGE "decoded message length too large"); a smaller one with an
/// oversized field is refused by validation, naming the field (INVALID_ARGUMENT).
///
/// No encoding limit: responses grow with the catalog (ListServices, ListEndpoints of a
/// large service, the Delta that answers a filter change), Watch snapshots are already
/// chunked ([`crate::watch::SNAPSHOT_CHUNK_ENDPOINTS`]), and each client decides how much
/// it accepts.
pub const MAX_REQUEST_BYTES: usize = 16 * 1024 * 1024;
const _: () = assert!(MAX_FILTER_SERVICES * (MAX_SERVICE_KEY_BYTES + 2) + 1024 <= MAX_REQUEST_BYTES);

/// TCP keepalive on accepted gRPC connections.
const TCP_KEEPALIVE: Duration = Duration::from_secs(60);
/// How often an HTTP/2 ping checks a connection, and how long its answer may take. The
/// answer waits behind whatever the connection is sending: a 10 s limit cut off about half
/// of 2,000 agents while their snapshots streamed (proposals/011), so it is well above a
/// snapshot's transfer time; dead peers are also found by TCP keepalive.
const H2_PING_INTERVAL: Duration = Duration::from_secs(30);
const H2_PING_TIMEOUT: Duration = Duration::from_secs(60);

/// Connections the kernel queues before the registrar accepts them. Every agent of a
/// cluster reconnects at once after a registrar restart; tokio's bind uses 128, and
/// beyond it connections are reset (the registrar bench saw ~170 of 1,000 watchers
/// reset). The kernel caps it at `net.core.somaxconn` (4096 by default).
const LISTEN_BACKLOG: i32 = 4096;

/// The gRPC listener, with [`LISTEN_BACKLOG`].
fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let socket = socket2::Socket::new(
        socket2::Domain::for_address(addr),
        socket2::Type::STREAM,
        Some(socket2::Protocol::TCP),
    )?;
    socket.set_reuse_address(true)?;
    socket.set_nonblocking(true)?;
    socket.bind(&addr.into())?;
    socket.listen(LISTEN_BACKLOG)?;
    TcpListener::from_std(socket.into())
}

/// The server's TLS config (None with `--insecure`): its certificate from files
/// (reloaded on rotation), client certificates verified against the node CA and
/// `--client-ca`.
fn server_tls(
    security: &SecurityConfig,
    shutdown: &CancellationToken,
) -> Result<Option<Arc<rustls::ServerConfig>>, StartError> {
    if security.insecure {
        tracing::warn!(
            "--insecure: the registrar serves PLAINTEXT gRPC and lets ANY client read and rewrite the catalog. \
             This is for the registrar's own tests only; never run it like this in a cluster."
        );
        return Ok(None);
    }
    let cert = CertSlot::from_files(
        CertFiles {
            cert_flag: "--tls-cert",
            cert: security.tls_cert.clone(),
            key_flag: "--tls-key",
            key: security.tls_key.clone(),
        },
        shutdown.clone(),
    )?;
    let mut client_cas = Vec::new();
    for (flag, path) in [
        ("--node-ca-cert", &security.node_ca_cert),
        ("--client-ca", &security.client_ca),
    ] {
        if let Some(path) = path.as_ref().filter(|p| !p.as_os_str().is_empty()) {
            client_cas.extend(tls::read_certs(flag, path)?);
        }
    }
    if client_cas.is_empty() {
        return Err(TlsError::Config(
            "no CA to verify agents with: set --node-ca-cert (the built-in node bootstrap) and/or --client-ca \
             (e.g. SPIRE's trust bundle), or --insecure for a test"
                .into(),
        )
        .into());
    }
    let roots = tls::roots("--client-ca", client_cas)?;
    tracing::info!(identity = ?cert.identity(), "serving gRPC over mTLS");
    Ok(Some(tls::server_config(cert, roots)?))
}

/// The node bootstrap, when the registrar holds a node CA.
async fn bootstrap(security: &SecurityConfig) -> Result<Option<Bootstrap>, StartError> {
    let set = |p: &Option<std::path::PathBuf>| p.clone().filter(|p| !p.as_os_str().is_empty());
    let (Some(ca_cert), Some(ca_key)) = (set(&security.node_ca_cert), set(&security.node_ca_key)) else {
        if security.edge_service_accounts.iter().any(|e| !e.trim().is_empty()) {
            tracing::warn!(
                "--edge-service-accounts is ignored: the node bootstrap needs --node-ca-cert and --node-ca-key"
            );
        }
        return Ok(None);
    };
    if security.insecure {
        return Ok(None);
    }
    Ok(Some(
        Bootstrap::new(BootstrapConfig {
            ca_cert: &ca_cert,
            ca_key: &ca_key,
            trust_domain: &security.trust_domain,
            ttl: security.node_cert_ttl,
            audience: security.bootstrap_audience.clone(),
            agent_service_account: &security.agent_service_account,
            edge_service_accounts: &security.edge_service_accounts,
        })
        .await?,
    ))
}

/// A started registrar.
pub struct Running {
    pub grpc_addr: SocketAddr,
    pub admin_addr: SocketAddr,
    pub catalog: Catalog,
    task: JoinHandle<Result<(), Stopped>>,
}

/// Why the registrar stopped before it was asked to.
#[derive(Debug, thiserror::Error)]
pub enum Stopped {
    #[error(transparent)]
    CriticalTask(#[from] aether_common::tasks::TaskFailed),
    #[error("the gRPC server failed: {0}")]
    Grpc(String),
    #[error("the gRPC server stopped before shutdown")]
    GrpcEnded,
    #[error("the registrar task failed: {0}")]
    Join(#[from] tokio::task::JoinError),
}

/// How long shutdown waits for the writer and the reaper after the gRPC server stopped.
const DRAIN_DEADLINE: Duration = Duration::from_secs(30);

impl Running {
    /// Waits until the registrar has shut down completely (after `shutdown` fired).
    /// `Err` names what stopped it early: a critical task or the gRPC server.
    pub async fn wait(self) -> Result<(), Stopped> {
        self.task.await?
    }
}

/// Opens the store `--store` names (`cluster`: from [`crate::cluster::connect`]).
pub async fn open_store(config: &Config, cluster: Option<&ClusterAccess>) -> Result<Arc<dyn Store>, StoreError> {
    let settings = StoreSettings {
        endpoint_ttl: config.endpoint_ttl,
    };
    Ok(match config.store {
        StoreKind::Embedded => Arc::new(EmbeddedStore::open(&config.data_dir, settings)?),
        StoreKind::Etcd => Arc::new(
            EtcdStore::connect(
                EtcdConfig {
                    endpoints: config.etcd_endpoints.clone(),
                    prefix: config.etcd_prefix.clone(),
                    timeout: config.etcd_timeout,
                    max_txn_ops: DEFAULT_MAX_TXN_OPS,
                    username: config.etcd_username.clone(),
                    password: config.etcd_password.clone(),
                    tls: EtcdTlsFiles {
                        ca_file: config.etcd_ca_file.clone(),
                        cert_file: config.etcd_cert_file.clone(),
                        key_file: config.etcd_key_file.clone(),
                    },
                },
                settings,
            )
            .await?,
        ),
        StoreKind::Dynamodb => Arc::new(
            DynamoStore::connect(DynamoConfig {
                table: config.dynamodb_table.clone(),
                endpoint_url: config.dynamodb_endpoint_url.clone(),
                region: config.dynamodb_region.clone(),
                sync_interval: config.dynamodb_sync_interval,
                create_table: config.dynamodb_create_table,
                page_size: config.dynamodb_page_size,
                request_timeout: config.dynamodb_timeout,
                static_credentials: None,
                settings,
            })
            .await?,
        ),
        StoreKind::Kubernetes => {
            let cluster =
                cluster.ok_or_else(|| StoreError::Config("--store kubernetes: no Kubernetes client".into()))?;
            let vips =
                VipAllocator::new(config.vip_cidr).map_err(|e| StoreError::Config(format!("--vip-cidr: {e}")))?;
            Arc::new(KubeStore::start(
                cluster.client.clone(),
                KubeConfig {
                    vip_configmap: config.kube_vip_configmap.clone(),
                    vips,
                    routes: cluster.routes.clone(),
                    services: cluster.services.clone(),
                    policies: cluster.policies.clone(),
                    policy_options: policy_options(config),
                    http_filters: cluster.http_filters.clone(),
                    mesh_configs: cluster.mesh_configs.clone(),
                    external_services: cluster.external_services.clone(),
                },
            )?)
        }
    })
}

/// Opens the store, loads the catalog and starts serving; runs until `shutdown`.
pub async fn start(config: Config, shutdown: CancellationToken) -> Result<Running, StartError> {
    if config.routes_dir.is_some() && config.store == StoreKind::Kubernetes {
        return Err(StartError::RoutesOnReadOnlyStore);
    }
    let root = &config.mesh_root_namespace;
    aether_common::names::dns_label(root).map_err(|r| StartError::RootNamespace(format!("{}: {r}", quote(root))))?;
    let vips = VipAllocator::new(config.vip_cidr)?;
    let cluster = crate::cluster::connect(&config).await?;
    let store = open_store(&config, cluster.as_ref()).await?;
    let mut registry = Registry::default();
    let metrics = Metrics::new(&mut registry);
    let metrics_push = MetricsPush::register(&config.telemetry, TELEMETRY, &mut registry);
    let readiness = Readiness::new();
    let serving = readiness.gate("registrar");
    let security = &config.security;
    let tls = server_tls(security, &shutdown)?;
    let bootstrap = bootstrap(security).await?;
    let policy = Policy::new(security.insecure, &security.trust_domain, security.reader_ids.clone());
    let own = registry.sub_registry_with_prefix("aether_registrar");
    policy.register(own);
    if let Some(bootstrap) = &bootstrap {
        bootstrap.register(own);
    }
    let (catalog, writer) = open_catalog(&config, vips, &store, metrics).await?;

    let bind_error = |addr| move |source| StartError::Bind { addr, source };
    let listener = bind(config.listen).map_err(bind_error(config.listen))?;
    let grpc_addr = listener.local_addr().map_err(bind_error(config.listen))?;
    let registry = Arc::new(registry);
    let admin = AdminServer::bind(config.admin, readiness.clone(), registry.clone()).await?;
    let admin_addr = admin.local_addr().map_err(bind_error(config.admin))?;

    // The writer outlives the gRPC server so in-flight writes still get answers.
    let writer_stop = CancellationToken::new();
    let writer = writer.with_readiness(readiness.gate("store"));
    let tasks = Tasks::new(shutdown.clone(), &readiness);
    tasks.critical("the catalog writer", writer.run(writer_stop.clone()));
    tasks.critical("the reaper", catalog.clone().run_reaper(shutdown.clone()));
    run_sources(&config, cluster, &tasks, &catalog, &shutdown);
    let admin_stop = CancellationToken::new();
    let admin_task = tokio::spawn(admin.serve(admin_stop.clone()));
    // Stops with the admin server, after the writer: the last push carries the final values.
    let push_task = metrics_push.spawn(registry, None, admin_stop.clone())?;

    let api = RegistrarApi::new(catalog.clone(), policy, shutdown.clone());
    let server = tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(H2_PING_INTERVAL))
        .http2_keepalive_timeout(Some(H2_PING_TIMEOUT))
        .add_service(RegistrarServer::new(api).max_decoding_message_size(MAX_REQUEST_BYTES))
        .add_optional_service(bootstrap.map(NodeBootstrapServer::new))
        .serve_with_incoming_shutdown(tls::incoming(listener, tls, TCP_KEEPALIVE, shutdown.clone()), {
            let (shutdown, serving) = (shutdown.clone(), serving.clone());
            async move {
                shutdown.cancelled().await;
                serving.set_not_ready("shutting down");
            }
        });
    serving.set_ready();
    tracing::info!(%grpc_addr, %admin_addr, "registrar serving");
    let stop = StopOrder {
        shutdown,
        serving,
        writer_stop,
        tasks,
        admin_stop,
        admin_task,
        push_task,
        store,
    };
    let task = tokio::spawn(stop.after(server));
    Ok(Running {
        grpc_addr,
        admin_addr,
        catalog,
        task,
    })
}

/// The configuration sources: `--config-dir` (routes, policies, HTTP filters), or the cluster's
/// objects of each kind and Service attributes into the catalog (a writable store; the
/// Kubernetes store derives them itself) with their status written back to the cluster
/// (both stores).
fn run_sources(
    config: &Config,
    cluster: Option<ClusterAccess>,
    tasks: &Tasks,
    catalog: &Catalog,
    shutdown: &CancellationToken,
) {
    if let Some(dir) = &config.routes_dir {
        let settings = crate::sources::directory::Settings {
            policy_options: policy_options(config),
        };
        let source = crate::sources::directory::run(
            dir.clone(),
            settings,
            catalog.clone(),
            catalog.metrics().clone(),
            shutdown.clone(),
        );
        tasks.critical("the configuration directory source", source);
    }
    let Some(cluster) = cluster else { return };
    let policies = Policies {
        options: policy_options(config),
    };
    let mesh_configs = MeshConfigs {
        options: policy_options(config),
    };
    let (client, stop) = (cluster.client.clone(), shutdown.clone());
    if config.store != StoreKind::Kubernetes {
        let source = sources::run(cluster.routes.clone(), Routes, catalog.clone(), stop.clone());
        tasks.critical("the Kubernetes route source", source);
        let source = crate::cluster::services::run(cluster.services.clone(), catalog.clone(), stop.clone());
        tasks.critical("the Kubernetes Service attribute source", source);
        let source = sources::run(
            cluster.policies.clone(),
            policies.clone(),
            catalog.clone(),
            stop.clone(),
        );
        tasks.critical("the Kubernetes AuthorizationPolicy source", source);
        let source = sources::run(cluster.http_filters.clone(), HttpFilters, catalog.clone(), stop.clone());
        tasks.critical("the Kubernetes HTTPFilter source", source);
        let source = sources::run(
            cluster.mesh_configs.clone(),
            mesh_configs.clone(),
            catalog.clone(),
            stop.clone(),
        );
        tasks.critical("the Kubernetes MeshConfig source", source);
        let source = sources::run(
            cluster.external_services.clone(),
            ExternalServices,
            catalog.clone(),
            stop.clone(),
        );
        tasks.critical("the Kubernetes ExternalService source", source);
    }
    let writer = sources::accepted::run(cluster.policies, policies, client.clone(), stop.clone());
    tasks.critical("the AuthorizationPolicy status writer", writer);
    let writer = sources::accepted::run(cluster.http_filters, HttpFilters, client.clone(), stop.clone());
    tasks.critical("the HTTPFilter status writer", writer);
    let writer = sources::accepted::run(cluster.mesh_configs, mesh_configs, client.clone(), stop.clone());
    tasks.critical("the MeshConfig status writer", writer);
    let writer = sources::accepted::run(
        cluster.external_services,
        ExternalServices,
        client.clone(),
        stop.clone(),
    );
    tasks.critical("the ExternalService status writer", writer);
    let writer = status::run(cluster.routes, catalog.clone(), client, stop);
    tasks.critical("the route status writer", writer);
}

/// How policies and MeshConfigs are projected: `--mesh-root-namespace`.
fn policy_options(config: &Config) -> ProjectOptions {
    ProjectOptions {
        root_namespace: config.mesh_root_namespace.clone(),
    }
}

/// Loads the catalog from the store.
async fn open_catalog(
    config: &Config,
    vips: VipAllocator,
    store: &Arc<dyn Store>,
    metrics: Metrics,
) -> Result<(Catalog, crate::catalog::Writer), StartError> {
    let catalog_config = CatalogConfig {
        vips,
        history_changes: config.history_changes,
        watch_buffer: config.watch_buffer,
        empty_service_ttl: config.empty_service_ttl,
        endpoint_ttl: config.endpoint_ttl,
        write_behind_limit: config.write_behind_limit,
    };
    let (catalog, writer) = Catalog::open(store.clone(), catalog_config, metrics).await?;
    let state = catalog.read();
    tracing::info!(
        store = store.kind(),
        services = state.services().count(),
        instance = state.instance(),
        "catalog loaded"
    );
    drop(state);
    Ok((catalog, writer))
}

/// The shutdown order that loses nothing: the gRPC server stops accepting and ends its
/// streams, then the writer finishes in-flight writes (and the reaper stops), then the
/// admin server and the last metrics push, then the store closes.
struct StopOrder {
    shutdown: CancellationToken,
    /// The `registrar` readiness gate.
    serving: Gate,
    writer_stop: CancellationToken,
    tasks: Tasks,
    admin_stop: CancellationToken,
    admin_task: JoinHandle<()>,
    push_task: Option<JoinHandle<()>>,
    store: Arc<dyn Store>,
}

impl StopOrder {
    /// Runs `server` to its end, then stops the rest in order. `Err` names what stopped
    /// the registrar early.
    async fn after<E: std::fmt::Display>(self, server: impl Future<Output = Result<(), E>>) -> Result<(), Stopped> {
        let served = server.await;
        let early = !self.shutdown.is_cancelled();
        if let Err(error) = &served {
            tracing::error!(%error, "gRPC server failed");
        }
        if early {
            self.serving.set_not_ready("the gRPC server stopped");
            self.shutdown.cancel();
        }
        self.writer_stop.cancel();
        let drained = self.tasks.drain(DRAIN_DEADLINE).await;
        self.admin_stop.cancel();
        let _ = self.admin_task.await;
        if let Some(push) = self.push_task {
            let _ = push.await;
        }
        drop(self.store);
        tracing::info!("registrar stopped");
        match (drained, early) {
            (Err(failure), _) => Err(Stopped::CriticalTask(failure)),
            (Ok(()), true) => Err(match served {
                Err(error) => Stopped::Grpc(error.to_string()),
                Ok(()) => Stopped::GrpcEnded,
            }),
            (Ok(()), false) => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt;

    #[tokio::test]
    async fn accepted_connections_have_nodelay_and_keepalive() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut incoming = std::pin::pin!(tls::incoming(listener, None, TCP_KEEPALIVE, CancellationToken::new()));
        let _client = tokio::net::TcpStream::connect(addr).await.unwrap();
        let tls::Conn::Plain(accepted, _) = incoming.next().await.unwrap().unwrap() else {
            panic!("no TLS configured, yet a TLS connection")
        };
        assert!(accepted.nodelay().unwrap(), "TCP_NODELAY is off");
        let socket = socket2::SockRef::from(&accepted);
        assert!(socket.keepalive().unwrap(), "SO_KEEPALIVE is off");
        assert_eq!(socket.tcp_keepalive_time().unwrap(), TCP_KEEPALIVE);
    }
}
