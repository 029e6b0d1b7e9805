//! The webhooks' HTTPS server: HTTP/1.1 over TLS (the serving certificate reloaded from
//! its files), `POST /validate` and `POST /mutate/pods`, each body one AdmissionReview.
//! A body over [`MAX_BODY`] is refused with 413; another path or method with 404/405.
//! Every review is counted by webhook and verdict, and timed.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::header::{CONTENT_LENGTH, CONTENT_TYPE};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::admission::{self, Verdict};
use crate::mutate::Mutator;
use crate::validate::Validator;

pub const VALIDATE_PATH: &str = "/validate";
pub const MUTATE_PODS_PATH: &str = "/mutate/pods";
/// The largest review read: kube-apiserver's objects are at most ~3 MiB (etcd's request
/// limit is 1.5 MiB), and a review carries the object once (twice for an UPDATE).
pub const MAX_BODY: usize = 8 << 20;
/// A client that has not finished its TLS handshake by then is dropped.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// The two webhooks and their instruments.
pub struct Webhooks {
    pub validator: Validator,
    pub mutator: Mutator,
    pub metrics: Metrics,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReviewLabels {
    webhook: &'static str,
    verdict: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WebhookLabel {
    webhook: &'static str,
}

#[derive(Clone)]
pub struct Metrics {
    reviews: Family<ReviewLabels, Counter>,
    seconds: Family<WebhookLabel, Histogram>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            reviews: Family::default(),
            // 10 µs to ~0.3 s.
            seconds: Family::new_with_constructor(|| Histogram::new(exponential_buckets(0.000_01, 2.0, 15))),
        }
    }
}

impl Metrics {
    pub fn register(&self, registry: &mut Registry) {
        let registry = registry.sub_registry_with_prefix("aether_controller");
        registry.register(
            "admission_reviews",
            "AdmissionReviews answered, by webhook (validate, mutate_pods) and verdict (allow, patch, deny)",
            self.reviews.clone(),
        );
        registry.register(
            "admission_review_seconds",
            "Time from a review's body read to its answer, by webhook",
            self.seconds.clone(),
        );
    }
}

/// Serves HTTPS on `listener` until `shutdown`, then lets open requests finish.
pub async fn serve(
    listener: TcpListener,
    tls: Arc<rustls::ServerConfig>,
    webhooks: Arc<Webhooks>,
    shutdown: CancellationToken,
) {
    let acceptor = tokio_rustls::TlsAcceptor::from(tls);
    let connections = TaskTracker::new();
    loop {
        let tcp = tokio::select! {
            _ = shutdown.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok((tcp, _)) => tcp,
                Err(error) => {
                    tracing::warn!(%error, "accepting a webhook connection");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let (acceptor, webhooks, shutdown) = (acceptor.clone(), webhooks.clone(), shutdown.clone());
        connections.spawn(async move {
            let _ = tcp.set_nodelay(true);
            let tls = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                Ok(Ok(tls)) => tls,
                Ok(Err(error)) => return tracing::debug!(%error, "webhook TLS handshake failed"),
                Err(_) => return tracing::debug!("webhook TLS handshake timed out"),
            };
            let service = hyper::service::service_fn(move |request| answer(webhooks.clone(), request));
            let connection = hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(tls), service);
            tokio::pin!(connection);
            tokio::select! {
                _ = connection.as_mut() => {}
                _ = shutdown.cancelled() => {
                    connection.as_mut().graceful_shutdown();
                    let _ = connection.await;
                }
            }
        });
    }
    connections.close();
    connections.wait().await;
}

async fn answer(
    webhooks: Arc<Webhooks>,
    request: Request<Incoming>,
) -> Result<Response<Full<Bytes>>, std::convert::Infallible> {
    let webhook = match request.uri().path() {
        VALIDATE_PATH => "validate",
        MUTATE_PODS_PATH => "mutate_pods",
        _ => return Ok(plain(StatusCode::NOT_FOUND, "not found")),
    };
    if request.method() != Method::POST {
        return Ok(plain(StatusCode::METHOD_NOT_ALLOWED, "POST an AdmissionReview"));
    }
    let declared = request
        .headers()
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<usize>().ok());
    if declared.is_some_and(|length| length > MAX_BODY) {
        return Ok(plain(StatusCode::PAYLOAD_TOO_LARGE, "the review is larger than 8 MiB"));
    }
    let body = match Limited::new(request.into_body(), MAX_BODY).collect().await {
        Ok(body) => body.to_bytes(),
        Err(_) => return Ok(plain(StatusCode::PAYLOAD_TOO_LARGE, "the review is larger than 8 MiB")),
    };
    let started = Instant::now();
    let (verdict, out) = match webhook {
        "validate" => admission::review(&body, |r| webhooks.validator.decide(r)),
        _ => admission::review(&body, |r| webhooks.mutator.decide(&r)),
    };
    let metrics = &webhooks.metrics;
    metrics
        .seconds
        .get_or_create(&WebhookLabel { webhook })
        .observe(started.elapsed().as_secs_f64());
    let verdict_label = match &verdict {
        Verdict::Allow => "allow",
        Verdict::Patch(_) => "patch",
        Verdict::Deny(message) => {
            tracing::info!(webhook, %message, "admission refused");
            "deny"
        }
    };
    let labels = ReviewLabels {
        webhook,
        verdict: verdict_label,
    };
    metrics.reviews.get_or_create(&labels).inc();
    let mut response = Response::new(Full::new(Bytes::from(out)));
    response
        .headers_mut()
        .insert(CONTENT_TYPE, "application/json".parse().expect("a valid header"));
    Ok(response)
}

fn plain(status: StatusCode, text: &'static str) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from_static(text.as_bytes())));
    *response.status_mut() = status;
    response
}

/// TLS for kube-apiserver's calls: the serving certificate from `slot`, no client
/// certificate asked for (kube-apiserver presents none unless configured to), HTTP/1.1.
pub fn tls_config(slot: aether_common::tls::CertSlot) -> Result<Arc<rustls::ServerConfig>, rustls::Error> {
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_cert_resolver(Arc::new(slot));
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}
