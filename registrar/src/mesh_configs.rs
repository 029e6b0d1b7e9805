//! Mesh settings: users' `mesh.aether.io/v1alpha1` MeshConfig objects, projected by
//! `aether-api` (with the mesh root namespace as its option) into
//! `aether.registry.v1.MeshConfig`s that are stored and streamed like policies
//! (proposals/016): a watcher gets the mesh-wide one, those of its policy namespaces (the
//! pods it hosts) and those of the namespaces of the services it watches (the callers'
//! side). [`MeshConfigs`] is their kind for the sources (`crate::sources`), which also
//! watch them in the cluster and write their `Accepted` condition.

use aether_api::authorization::ProjectOptions;
use aether_api::mesh_config::{self as projector, MeshConfig as ConfigObject};
use aether_api::{Document, ParseError};
use aether_proto::registry::v1::MeshConfig;

use crate::cluster::Sets;
use crate::sources::crd::CrdSet;
use crate::sources::{ObjectKind, namespaced_key};

/// A handle on the cluster's MeshConfig watch.
pub type ClusterMeshConfigs = Sets<CrdSet<ConfigObject>>;

/// The MeshConfig kind: objects keyed `<namespace>/<name>`, projected with the mesh root
/// namespace.
#[derive(Clone, Debug, Default)]
pub struct MeshConfigs {
    pub options: ProjectOptions,
}

impl ObjectKind for MeshConfigs {
    type Object = ConfigObject;
    type Record = MeshConfig;

    fn key(object: &ConfigObject) -> String {
        namespaced_key(&object.metadata)
    }

    fn project(&self, object: &ConfigObject) -> Result<Option<MeshConfig>, String> {
        projector::project(object, &self.options)
            .map(Some)
            .map_err(|refusal| refusal.to_string())
    }

    fn pick(documents: &[Document]) -> Vec<Result<ConfigObject, ParseError>> {
        projector::from_documents(documents)
    }
}
