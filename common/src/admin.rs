//! The admin HTTP server every binary runs: liveness, readiness and Prometheus metrics.
//!
//! `/healthz` answers 200 while the process serves; `/ready` answers 200 only once the
//! owner has called [`Readiness::set`] with `true` (503 with the reason otherwise);
//! `/metrics` is Prometheus text exposition of the registry handed in.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

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

use crate::telemetry::otlp::Refresh;

const METRICS_CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    #[error("binding the admin server to {addr}: {source}")]
    Bind { addr: SocketAddr, source: std::io::Error },
}

/// Whether the process is ready, and if not, why. Cheap to clone and share.
#[derive(Clone, Debug)]
pub struct Readiness(Arc<Mutex<Result<(), String>>>);

impl Readiness {
    /// Starts not ready, with `reason`.
    pub fn new(reason: impl Into<String>) -> Self {
        Self(Arc::new(Mutex::new(Err(reason.into()))))
    }

    pub fn set_ready(&self) {
        *self.0.lock().expect("readiness lock") = Ok(());
    }

    pub fn set_not_ready(&self, reason: impl Into<String>) {
        *self.0.lock().expect("readiness lock") = Err(reason.into());
    }

    pub fn get(&self) -> Result<(), String> {
        self.0.lock().expect("readiness lock").clone()
    }
}

/// Extra GET paths a binary serves (e.g. `/debug/...`): path → (status, JSON body),
/// or `None` for not found.
pub type Pages = Arc<dyn Fn(&str) -> Option<(u16, String)> + Send + Sync>;

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
                        Ok::<_, Infallible>(respond(&req, &readiness, &registry, pages.as_ref()))
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

fn respond(
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
        path => match pages.and_then(|pages| pages(path)) {
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

fn text(status: StatusCode, body: String) -> Response<Full<Bytes>> {
    Response::builder()
        .status(status)
        .header(CONTENT_TYPE, "text/plain; charset=utf-8")
        .body(Full::new(Bytes::from(body)))
        .expect("static response parts are valid")
}
