//! External services: users' `networking.aether.io/v1alpha1` ExternalService objects,
//! projected by `aether-api` into `aether.registry.v1.External` and made catalog services
//! of their own (proposals/017): a VIP from the same pool, no endpoints, the declaration
//! in `Service.external`. So they are stored in every backend, demand-scoped, streamed and
//! answered by mesh-dns exactly like mesh services. [`ExternalServices`] is their kind for
//! the sources (`crate::sources`), which also watch them in the cluster and write their
//! `Accepted` condition.

use std::collections::BTreeMap;

use aether_api::external_service::{self as projector, ExternalService as ExternalObject};
use aether_api::{Document, ParseError};
use aether_proto::registrar::v1::Version;
use aether_proto::registry::v1::External;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use tonic::Status;

use crate::catalog::Catalog;
use crate::cluster::Sets;
use crate::metrics::{Labels, Metrics};
use crate::model::ServiceKey;
use crate::sources::crd::CrdSet;
use crate::sources::{Destination, ObjectKind};

/// A handle on the cluster's ExternalService watch.
pub type ClusterExternalServices = Sets<CrdSet<ExternalObject>>;

/// The ExternalService kind: objects keyed by the service key `<namespace>/<name>`.
#[derive(Clone, Copy, Debug, Default)]
pub struct ExternalServices;

impl ObjectKind for ExternalServices {
    type Object = ExternalObject;
    type Record = External;

    fn key(object: &ExternalObject) -> String {
        projector::key(object)
    }

    fn project(&self, object: &ExternalObject) -> Result<Option<External>, String> {
        projector::project(object)
            .map(Some)
            .map_err(|refusal| refusal.to_string())
    }

    fn pick(documents: &[Document]) -> Vec<Result<ExternalObject, ParseError>> {
        projector::from_documents(documents)
    }
}

impl Destination for External {
    fn noun() -> &'static str {
        "external service"
    }
    fn objects() -> &'static str {
        "ExternalService"
    }
    fn held(catalog: &Catalog) -> Vec<(String, Self)> {
        let state = catalog.read();
        let external = state
            .services()
            .filter_map(|(key, entry)| Some((key.to_string(), *entry.service.external.clone()?)));
        external.collect()
    }
    fn refused_gauge(metrics: &Metrics) -> &Family<Labels, Gauge> {
        &metrics.external_services_refused
    }
    async fn store(
        catalog: &Catalog,
        desired: BTreeMap<String, Self>,
    ) -> Result<(Version, Vec<(String, String)>), Status> {
        // Keys come from objects' namespace and name, which the projector checked.
        let desired = (desired.into_iter())
            .filter_map(|(key, external)| Some((ServiceKey::parse("service", &key).ok()?, external)))
            .collect();
        let applied = catalog.set_external_services(desired).await?;
        let refused = applied.refused.into_iter().map(|(key, why)| (key.to_string(), why));
        Ok((applied.version, refused.collect()))
    }
}
