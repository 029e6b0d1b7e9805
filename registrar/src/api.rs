//! The `aether.registrar.v1.Registrar` gRPC service: validation at the edge, then
//! the catalog.

use aether_proto::registrar::v1::registrar_server::Registrar;
use aether_proto::registrar::v1::{
    ListEndpointsRequest, ListEndpointsResponse, ListServicesRequest, ListServicesResponse, RegisterEndpointRequest,
    RegisterEndpointResponse, UnregisterEndpointRequest, UnregisterEndpointResponse, WatchRequest, WatchResponse,
};
use aether_proto::registry::v1::Endpoint;
use futures::StreamExt;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status, Streaming};

use crate::auth::{self, Policy};
use crate::catalog::Catalog;
use crate::model::{InvalidField, ServiceKey, parse_address, validate_endpoint};
use crate::watch;

/// Messages buffered per Watch stream between its task and the transport.
const WATCH_OUTBOX: usize = 16;

pub struct RegistrarApi {
    catalog: Catalog,
    policy: Policy,
    shutdown: CancellationToken,
}

impl RegistrarApi {
    pub fn new(catalog: Catalog, policy: Policy, shutdown: CancellationToken) -> Self {
        Self {
            catalog,
            policy,
            shutdown,
        }
    }

    /// Counts and logs a refusal the catalog made (an endpoint another node holds).
    fn refused(&self, method: &'static str, owner: &Option<String>, status: Status) -> Status {
        if status.code() == tonic::Code::PermissionDenied {
            self.policy
                .denied_by_catalog(method, owner.as_deref().unwrap_or_default(), status.message());
        }
        status
    }

    fn invalid(&self, method: &'static str, error: InvalidField) -> Status {
        self.catalog
            .metrics()
            .invalid_requests
            .get_or_create(&[("method", method)])
            .inc();
        error.into()
    }
}

#[tonic::async_trait]
impl Registrar for RegistrarApi {
    async fn register_endpoint(
        &self,
        request: Request<RegisterEndpointRequest>,
    ) -> Result<Response<RegisterEndpointResponse>, Status> {
        const METHOD: &str = "RegisterEndpoint";
        let node = request
            .get_ref()
            .endpoint
            .as_ref()
            .map(|e| e.node.as_str())
            .unwrap_or_default();
        let owner = self.policy.writer(METHOD, &request, node)?;
        let valid =
            validate_endpoint("endpoint", request.into_inner().endpoint).map_err(|e| self.invalid(METHOD, e))?;
        let (service, version) = (self.catalog.register(valid, owner.clone()).await)
            .map_err(|status| self.refused(METHOD, &owner, status))?;
        Ok(Response::new(RegisterEndpointResponse {
            service: Some(service),
            version: Some(version),
        }))
    }

    async fn unregister_endpoint(
        &self,
        request: Request<UnregisterEndpointRequest>,
    ) -> Result<Response<UnregisterEndpointResponse>, Status> {
        const METHOD: &str = "UnregisterEndpoint";
        // Who may remove it depends on whose it is: checked against the catalog, atomically.
        let owner = self.policy.agent(METHOD, &request)?;
        let request = request.into_inner();
        let service = ServiceKey::parse("service", &request.service).map_err(|e| self.invalid(METHOD, e))?;
        let address = parse_address("address", &request.address).map_err(|e| self.invalid(METHOD, e))?;
        let (existed, version) = (self.catalog.unregister(service, address, owner.clone()).await)
            .map_err(|status| self.refused(METHOD, &owner, status))?;
        Ok(Response::new(UnregisterEndpointResponse {
            existed,
            version: Some(version),
        }))
    }

    async fn list_services(
        &self,
        request: Request<ListServicesRequest>,
    ) -> Result<Response<ListServicesResponse>, Status> {
        self.policy.reader("ListServices", &request)?;
        let state = self.catalog.read();
        Ok(Response::new(ListServicesResponse {
            services: state.services().map(|(_, e)| e.service.clone()).collect(),
            version: Some(state.version()),
        }))
    }

    async fn list_endpoints(
        &self,
        request: Request<ListEndpointsRequest>,
    ) -> Result<Response<ListEndpointsResponse>, Status> {
        self.policy.reader("ListEndpoints", &request)?;
        let key = ServiceKey::parse("service", &request.into_inner().service)
            .map_err(|e| self.invalid("ListEndpoints", e))?;
        let state = self.catalog.read();
        let entry = state
            .service(key.as_str())
            .ok_or_else(|| Status::not_found(format!("service: {key} is not in the catalog")))?;
        Ok(Response::new(ListEndpointsResponse {
            service: Some(entry.service.clone()),
            endpoints: entry.endpoints.values().map(|e| Endpoint::clone(e)).collect(),
            version: Some(state.version()),
        }))
    }

    type WatchStream =
        futures::stream::Map<ReceiverStream<watch::Outgoing>, fn(watch::Outgoing) -> Result<WatchResponse, Status>>;

    async fn watch(&self, request: Request<Streaming<WatchRequest>>) -> Result<Response<Self::WatchStream>, Status> {
        self.policy.reader("Watch", &request)?;
        let (out, outbox) = mpsc::channel(WATCH_OUTBOX);
        let stream_end = self.shutdown.child_token();
        if let Some(expiry) = auth::expiry(&request) {
            tokio::spawn(end_at_expiry(expiry, out.clone(), stream_end.clone()));
        }
        tokio::spawn(watch::serve(
            self.catalog.clone(),
            request.into_inner(),
            out,
            stream_end,
        ));
        let unbox: fn(watch::Outgoing) -> Result<WatchResponse, Status> = |outgoing| *outgoing;
        Ok(Response::new(ReceiverStream::new(outbox).map(unbox)))
    }
}

/// Ends a Watch stream when the certificate its connection was opened with expires:
/// authentication holds for a certificate's lifetime, not a connection's. The agent
/// rotates its certificate at half-life and resumes on a fresh connection long before.
async fn end_at_expiry(
    expiry: std::time::SystemTime,
    out: mpsc::Sender<watch::Outgoing>,
    stream_end: CancellationToken,
) {
    let left = expiry.duration_since(std::time::SystemTime::now()).unwrap_or_default();
    tokio::select! {
        _ = out.closed() => return,
        _ = stream_end.cancelled() => return,
        _ = tokio::time::sleep(left) => {}
    }
    let _ = out
        .send(Box::new(Err(Status::unauthenticated(
            "rule certificate-valid: the client certificate of this stream expired; resume on a connection with a fresh one",
        ))))
        .await;
    stream_end.cancel();
}
