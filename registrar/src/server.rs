//! Wiring: store → catalog → gRPC and admin servers, and the shutdown order that
//! loses nothing: stop accepting, end watch streams, finish in-flight writes, then
//! close the store.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use aether_common::admin::{AdminError, AdminServer, Readiness};
use aether_proto::registrar::v1::registrar_server::RegistrarServer;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_stream::wrappers::TcpListenerStream;
use tokio_util::sync::CancellationToken;

use crate::api::RegistrarApi;
use crate::catalog::{Catalog, CatalogConfig, OpenError};
use crate::config::{Config, StoreKind};
use crate::metrics::Metrics;
use crate::store::embedded::EmbeddedStore;
use crate::store::{Store, StoreError};
use crate::vip::{VipAllocator, VipError};

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("--vip-cidr: {0}")]
    VipRange(#[from] VipError),
    #[error("opening the store: {0}")]
    Store(#[from] StoreError),
    #[error(transparent)]
    Open(#[from] OpenError),
    #[error("binding the gRPC listener to {addr}: {source}")]
    Bind { addr: SocketAddr, source: std::io::Error },
    #[error(transparent)]
    Admin(#[from] AdminError),
}

/// A started registrar.
pub struct Running {
    pub grpc_addr: SocketAddr,
    pub admin_addr: SocketAddr,
    pub catalog: Catalog,
    task: JoinHandle<()>,
}

impl Running {
    /// Waits until the registrar has shut down completely (after `shutdown` fired).
    pub async fn wait(self) {
        if let Err(error) = self.task.await {
            tracing::error!(%error, "registrar task failed");
        }
    }
}

/// Opens the store, loads the catalog and starts serving; runs until `shutdown`.
pub async fn start(config: Config, shutdown: CancellationToken) -> Result<Running, StartError> {
    let vips = VipAllocator::new(config.vip_cidr)?;
    let store: Arc<dyn Store> = match config.store {
        StoreKind::Embedded => Arc::new(EmbeddedStore::open(&config.data_dir)?),
    };
    let mut registry = Registry::default();
    let metrics = Metrics::new(&mut registry);
    let readiness = Readiness::new("loading the catalog");

    let (catalog, writer) = Catalog::open(
        store.clone(),
        CatalogConfig {
            vips,
            history_changes: config.history_changes,
            watch_buffer: config.watch_buffer,
            empty_service_ttl: config.empty_service_ttl,
        },
        metrics,
    )
    .await?;
    {
        let state = catalog.read();
        tracing::info!(
            store = store.kind(),
            services = state.services().count(),
            instance = state.instance(),
            "catalog loaded"
        );
    }

    let listener = TcpListener::bind(config.listen)
        .await
        .map_err(|source| StartError::Bind {
            addr: config.listen,
            source,
        })?;
    let grpc_addr = listener.local_addr().map_err(|source| StartError::Bind {
        addr: config.listen,
        source,
    })?;
    let admin = AdminServer::bind(config.admin, readiness.clone(), Arc::new(registry)).await?;
    let admin_addr = admin.local_addr().map_err(|source| StartError::Bind {
        addr: config.admin,
        source,
    })?;

    // The writer outlives the gRPC server so in-flight writes still get answers.
    let writer_stop = CancellationToken::new();
    let writer_task = tokio::spawn(writer.run(writer_stop.clone()));
    tokio::spawn(catalog.clone().run_reaper(shutdown.clone()));
    let admin_stop = CancellationToken::new();
    let admin_task = tokio::spawn(admin.serve(admin_stop.clone()));

    let api = RegistrarApi::new(catalog.clone(), shutdown.clone());
    let server = tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(Duration::from_secs(30)))
        .http2_keepalive_timeout(Some(Duration::from_secs(10)))
        .tcp_keepalive(Some(Duration::from_secs(60)))
        .add_service(RegistrarServer::new(api))
        .serve_with_incoming_shutdown(TcpListenerStream::new(listener), {
            let shutdown = shutdown.clone();
            let readiness = readiness.clone();
            async move {
                shutdown.cancelled().await;
                readiness.set_not_ready("shutting down");
            }
        });
    readiness.set_ready();
    tracing::info!(%grpc_addr, %admin_addr, "registrar serving");

    let task = tokio::spawn(async move {
        if let Err(error) = server.await {
            tracing::error!(%error, "gRPC server failed");
        }
        writer_stop.cancel();
        if let Err(error) = writer_task.await {
            tracing::error!(%error, "catalog writer failed");
        }
        admin_stop.cancel();
        let _ = admin_task.await;
        drop(store);
        tracing::info!("registrar stopped");
    });
    Ok(Running {
        grpc_addr,
        admin_addr,
        catalog,
        task,
    })
}
