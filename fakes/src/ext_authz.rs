//! A fake external authorization server speaking Envoy's real
//! `envoy.service.auth.v3.Authorization/Check` gRPC API: it allows a request carrying
//! `x-allow: yes` and denies the rest with 403 and a body, counting the checks.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use envoy_types::pb::envoy::service::auth::v3::authorization_server::{Authorization, AuthorizationServer};
use envoy_types::pb::envoy::service::auth::v3::{
    CheckRequest, CheckResponse, DeniedHttpResponse, OkHttpResponse, check_response,
};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::google::rpc::Status as RpcStatus;

/// The body of a denial.
pub const DENIED_BODY: &str = "denied by the test authorization server";

/// The server, on loopback, until dropped.
pub struct ExtAuthzServer {
    pub addr: SocketAddr,
    checks: Arc<AtomicU32>,
    task: tokio::task::JoinHandle<()>,
}

impl ExtAuthzServer {
    pub async fn start() -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind ext_authz");
        let addr = listener.local_addr().unwrap();
        let checks = Arc::new(AtomicU32::new(0));
        let service = AuthorizationServer::new(Checker(checks.clone()));
        let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
        let server = tonic::transport::Server::builder()
            .add_service(service)
            .serve_with_incoming(incoming);
        let task = tokio::spawn(async move { server.await.expect("ext_authz server") });
        Self { addr, checks, task }
    }

    /// Checks answered so far.
    pub fn checks(&self) -> u32 {
        self.checks.load(Ordering::SeqCst)
    }
}

impl Drop for ExtAuthzServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

struct Checker(Arc<AtomicU32>);

#[tonic::async_trait]
impl Authorization for Checker {
    async fn check(
        &self,
        request: tonic::Request<CheckRequest>,
    ) -> Result<tonic::Response<CheckResponse>, tonic::Status> {
        self.0.fetch_add(1, Ordering::SeqCst);
        let attributes = request.into_inner().attributes.unwrap_or_default();
        let http = attributes.request.unwrap_or_default().http.unwrap_or_default();
        let allowed = http.headers.get("x-allow").is_some_and(|v| v == "yes");
        let (code, response) = match allowed {
            true => (0, check_response::HttpResponse::OkResponse(OkHttpResponse::default())),
            // PERMISSION_DENIED, with the answer the caller gets.
            false => (
                7,
                check_response::HttpResponse::DeniedResponse(DeniedHttpResponse {
                    status: Some(HttpStatus { code: 403 }),
                    body: DENIED_BODY.into(),
                    ..Default::default()
                }),
            ),
        };
        Ok(tonic::Response::new(CheckResponse {
            status: Some(RpcStatus {
                code,
                ..Default::default()
            }),
            http_response: Some(response),
            ..Default::default()
        }))
    }
}
