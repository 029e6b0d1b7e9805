//! A read-only view of the node for the debug API (`crate::debug`): what `aether status`,
//! `proxy-config` and `explain` judge. Taken at one moment; nothing in it changes the node.

use std::collections::BTreeSet;
use std::sync::Arc;

use super::Node;
use crate::catalog_watch::WatchedCatalog;
use crate::identity::Identities;
use crate::pod::LocalPod;
use crate::xds::cache::{Snapshot, Streams};

/// The node at one moment.
pub struct NodeView {
    pub mesh_domain: Arc<str>,
    pub pods: Vec<LocalPod>,
    /// The catalog slice the registrar sent for the node's dependency set.
    pub watched: Arc<WatchedCatalog>,
    /// What the agent serves to Envoy.
    pub snapshot: Arc<Snapshot>,
    /// What each connected Envoy ACKed and rejected.
    pub streams: Streams,
    /// `None`: plaintext (`--identity none`).
    pub identities: Option<Arc<Identities>>,
    /// Services in the dependency set because Envoy asked for them on demand.
    pub on_demand: BTreeSet<String>,
    /// The dependency set the node wants watched now (the registrar has answered for it
    /// once `watched.filter` holds it all).
    pub wanted: BTreeSet<String>,
}

impl Node {
    pub fn view(&self) -> NodeView {
        let pods = self.pods();
        NodeView {
            mesh_domain: self.mesh_domain.clone(),
            wanted: self.dependencies(&pods),
            pods,
            watched: self.catalog.borrow().clone(),
            snapshot: self.cache.snapshot(),
            streams: self.cache.streams(),
            identities: self.identity.as_ref().map(|i| i.current()),
            on_demand: self.on_demand.lock().services.keys().cloned().collect(),
        }
    }
}
