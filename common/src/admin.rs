//! The admin HTTP server every binary runs: liveness, readiness and Prometheus metrics.
//!
//! `/healthz` answers 200 while the process serves; `/ready` answers 200 only while every
//! component registered with the [`Readiness`] is ready (503 naming those that are not);
//! `/metrics` is Prometheus text exposition of the registry handed in.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::header::CONTENT_TYPE;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::readiness::Readiness;
use crate::telemetry::otlp::Refresh;

const METRICS_CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    #[error("binding the admin server to {addr}: {source}")]
    Bind { addr: SocketAddr, source: std::io::Error },
}

/// Extra GET paths a binary serves (e.g. `/debug/...`): path → (status, JSON body), or
/// `None` for not found. Async: a page may ask other processes (Envoy's admin, mesh-dns)
/// before it answers.
pub type Pages = Arc<dyn Fn(&str) -> PageAnswer + Send + Sync>;

/// What a page answers, when it has gathered it.
pub type PageAnswer = Pin<Box<dyn Future<Output = Option<(u16, String)>> + Send>>;

/// A page answer that needs no waiting.
pub fn answered(answer: Option<(u16, String)>) -> PageAnswer {
    Box::pin(std::future::ready(answer))
}

/// A bound admin server; [`AdminServer::serve`] runs it until `shutdown`.
pub struct AdminServer {
    listener: TcpListener,
    readiness: Readiness,
    registry: Arc<Registry>,
    pages: Option<Pages>,
    refresh: Option<Refresh>,
}

impl AdminServer {
    pub async fn bind(addr: SocketAddr, readiness: Readiness, registry: Arc<Registry>) -> Result<Self, AdminError> {
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|source| AdminError::Bind { addr, source })?;
        Ok(Self {
            listener,
            readiness,
            registry,
            pages: None,
            refresh: None,
        })
    }

    /// [`AdminServer::bind`], retrying every `retry` while the address is in use; `None`
    /// once `stop` is cancelled. During a surge rollout on the host network the
    /// predecessor pod holds the address until it exits.
    pub async fn bind_retrying(
        addr: SocketAddr,
        readiness: Readiness,
        registry: Arc<Registry>,
        retry: std::time::Duration,
        stop: &CancellationToken,
    ) -> Option<Self> {
        let mut warned = false;
        loop {
            match Self::bind(addr, readiness.clone(), registry.clone()).await {
                Ok(server) => {
                    if warned {
                        tracing::info!(%addr, "admin address free again; serving");
                    }
                    return Some(server);
                }
                Err(error) => {
                    if !warned {
                        tracing::warn!(%error, "admin address busy (a predecessor still holds it?); retrying");
                        warned = true;
                    }
                    tokio::select! {
                        _ = stop.cancelled() => return None,
                        _ = tokio::time::sleep(retry) => {}
                    }
                }
            }
        }
    }

    /// Serves `pages` beside the standard endpoints.
    pub fn with_pages(mut self, pages: Pages) -> Self {
        self.pages = Some(pages);
        self
    }

    /// Runs `refresh` before answering each `/metrics` (e.g. reading values another process holds); it must bound
    /// its own time.
    pub fn with_refresh(mut self, refresh: Refresh) -> Self {
        self.refresh = Some(refresh);
        self
    }

    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    pub async fn serve(self, shutdown: CancellationToken) {
        loop {
            let (stream, _) = tokio::select! {
                _ = shutdown.cancelled() => return,
                accepted = self.listener.accept() => match accepted {
                    Ok(conn) => conn,
                    Err(error) => {
                        tracing::warn!(%error, "admin accept failed");
                        continue;
                    }
                },
            };
            let readiness = self.readiness.clone();
            let registry = self.registry.clone();
            let pages = self.pages.clone();
            let refresh = self.refresh.clone();
            tokio::spawn(async move {
                let service = service_fn(move |req: Request<Incoming>| {
                    let (readiness, registry, pages, refresh) =
                        (readiness.clone(), registry.clone(), pages.clone(), refresh.clone());
                    async move {
                        if req.uri().path() == "/metrics"
                            && let Some(refresh) = refresh
                        {
                            refresh().await;
                        }
                        Ok::<_, Infallible>(respond(&req, &readiness, &registry, pages.as_ref()).await)
                    }
                });
                let conn = http1::Builder::new().serve_connection(TokioIo::new(stream), service);
                if let Err(error) = conn.await {
                    tracing::debug!(%error, "admin connection ended with an error");
                }
            });
        }
    }
}

async fn respond(
    req: &Request<Incoming>,
    readiness: &Readiness,
    registry: &Registry,
    pages: Option<&Pages>,
) -> Response<Full<Bytes>> {
    if req.method() != Method::GET {
        return text(StatusCode::METHOD_NOT_ALLOWED, "only GET is served\n".into());
    }
    match req.uri().path() {
        "/healthz" => text(StatusCode::OK, "ok\n".into()),
        "/ready" => match readiness.get() {
            Ok(()) => text(StatusCode::OK, "ready\n".into()),
            Err(reason) => text(StatusCode::SERVICE_UNAVAILABLE, format!("not ready: {reason}\n")),
        },
        "/metrics" => {
            let mut body = String::new();
            match prometheus_client::encoding::text::encode(&mut body, registry) {
                Ok(()) => Response::builder()
                    .header(CONTENT_TYPE, METRICS_CONTENT_TYPE)
                    .body(Full::new(Bytes::from(body)))
                    .expect("static response parts are valid"),
                Err(error) => text(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    format!("encoding metrics: {error}\n"),
                ),
            }
        }
        path => match page(pages, path).await {
            Some((status, body)) => Response::builder()
                .status(StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR))
                .header(CONTENT_TYPE, "application/json")
                .body(Full::new(Bytes::from(body)))
                .expect("static response parts are valid"),
            None => text(
                StatusCode::NOT_FOUND,
                "not found: try /healthz, /ready or /metrics\n".into(),
            ),
        },
    }
}

async fn page(pages: Option<&Pages>, path: &str) -> Option<(u16, String)> {
    pages?(path).await
}

fn text(status: StatusCode, body: String) -> Response<Full<Bytes>> {
    Response::builder()
        .status(status)
        .header(CONTENT_TYPE, "text/plain; charset=utf-8")
        .body(Full::new(Bytes::from(body)))
        .expect("static response parts are valid")
}
