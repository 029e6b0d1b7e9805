//! Authorization policies: users' `security.aether.io/v1alpha1` AuthorizationPolicy
//! objects, projected by `aether-api` (with the mesh root namespace as its option) into
//! `aether.registry.v1.AuthorizationPolicy`s that are stored and streamed like routes
//! (proposals/013, "Distribution"). [`Policies`] is their kind for the sources
//! (`crate::sources`), which also watch them in the cluster and write their `Accepted`
//! condition.

use aether_api::authorization::{self as projector, AuthorizationPolicy as PolicyObject, ProjectOptions};
use aether_api::{Document, ParseError};
use aether_proto::registry::v1::AuthorizationPolicy;

use crate::cluster::Sets;
use crate::sources::crd::CrdSet;
use crate::sources::{ObjectKind, namespaced_key};

/// A handle on the cluster's AuthorizationPolicy watch.
pub type ClusterPolicies = Sets<CrdSet<PolicyObject>>;

/// The policy kind: objects keyed `<namespace>/<name>`, projected with the mesh root
/// namespace.
#[derive(Clone, Debug, Default)]
pub struct Policies {
    pub options: ProjectOptions,
}

impl ObjectKind for Policies {
    type Object = PolicyObject;
    type Record = AuthorizationPolicy;

    fn key(object: &PolicyObject) -> String {
        namespaced_key(&object.metadata)
    }

    fn project(&self, object: &PolicyObject) -> Result<Option<AuthorizationPolicy>, String> {
        projector::project(object, &self.options)
            .map(Some)
            .map_err(|refusal| refusal.to_string())
    }

    fn pick(documents: &[Document]) -> Vec<Result<PolicyObject, ParseError>> {
        projector::from_documents(documents)
    }
}
