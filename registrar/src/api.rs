//! The `aether.registrar.v1.Registrar` gRPC service: validation at the edge, then
//! the catalog.

use aether_proto::registrar::v1::registrar_server::Registrar;
use aether_proto::registrar::v1::{
    ListEndpointsRequest, ListEndpointsResponse, ListServicesRequest, ListServicesResponse, RegisterEndpointRequest,
    RegisterEndpointResponse, UnregisterEndpointRequest, UnregisterEndpointResponse, WatchRequest, WatchResponse,
};
use aether_proto::registry::v1::Endpoint;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status, Streaming};

use crate::catalog::Catalog;
use crate::model::{InvalidField, ServiceKey, parse_address, validate_endpoint};
use crate::watch;

/// Messages buffered per Watch stream between its task and the transport.
const WATCH_OUTBOX: usize = 16;

pub struct RegistrarApi {
    catalog: Catalog,
    shutdown: CancellationToken,
}

impl RegistrarApi {
    pub fn new(catalog: Catalog, shutdown: CancellationToken) -> Self {
        Self { catalog, shutdown }
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
        let valid = validate_endpoint("endpoint", request.into_inner().endpoint)
            .map_err(|e| self.invalid("RegisterEndpoint", e))?;
        let (service, version) = self.catalog.register(valid).await?;
        Ok(Response::new(RegisterEndpointResponse {
            service: Some(service),
            version: Some(version),
        }))
    }

    async fn unregister_endpoint(
        &self,
        request: Request<UnregisterEndpointRequest>,
    ) -> Result<Response<UnregisterEndpointResponse>, Status> {
        let request = request.into_inner();
        let service =
            ServiceKey::parse("service", &request.service).map_err(|e| self.invalid("UnregisterEndpoint", e))?;
        let address = parse_address("address", &request.address).map_err(|e| self.invalid("UnregisterEndpoint", e))?;
        let (existed, version) = self.catalog.unregister(service, address).await?;
        Ok(Response::new(UnregisterEndpointResponse {
            existed,
            version: Some(version),
        }))
    }

    async fn list_services(
        &self,
        _request: Request<ListServicesRequest>,
    ) -> Result<Response<ListServicesResponse>, Status> {
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

    type WatchStream = ReceiverStream<Result<WatchResponse, Status>>;

    async fn watch(&self, request: Request<Streaming<WatchRequest>>) -> Result<Response<Self::WatchStream>, Status> {
        let (out, outbox) = mpsc::channel(WATCH_OUTBOX);
        tokio::spawn(watch::serve(
            self.catalog.clone(),
            request.into_inner(),
            out,
            self.shutdown.clone(),
        ));
        Ok(Response::new(ReceiverStream::new(outbox)))
    }
}
