//! HTTP filters: users' `networking.aether.io/v1alpha1` HTTPFilter objects, projected by
//! `aether-api` into `aether.registry.v1.HttpFilter`s that are stored and streamed like
//! routes and policies (proposals/014, "Distribution"): a watcher gets the filters of its
//! policy namespaces (the destination side) and those naming a service it watches (the
//! callers' side). [`HttpFilters`] is their kind for the sources (`crate::sources`),
//! which also watch them in the cluster and write their `Accepted` condition.

use aether_api::http_filter::{self as projector, HttpFilter as FilterObject};
use aether_api::{Document, ParseError};
use aether_proto::registry::v1::HttpFilter;

use crate::cluster::Sets;
use crate::sources::crd::CrdSet;
use crate::sources::{ObjectKind, namespaced_key};

/// A handle on the cluster's HTTPFilter watch.
pub type ClusterHttpFilters = Sets<CrdSet<FilterObject>>;

/// The HTTP filter kind: objects keyed `<namespace>/<name>`.
#[derive(Clone, Copy, Debug, Default)]
pub struct HttpFilters;

impl ObjectKind for HttpFilters {
    type Object = FilterObject;
    type Record = HttpFilter;

    fn key(object: &FilterObject) -> String {
        namespaced_key(&object.metadata)
    }

    fn project(&self, object: &FilterObject) -> Result<Option<HttpFilter>, String> {
        projector::project(object)
            .map(Some)
            .map_err(|refusal| refusal.to_string())
    }

    fn pick(documents: &[Document]) -> Vec<Result<FilterObject, ParseError>> {
        projector::from_documents(documents)
    }
}
