//! Where the catalog lives durably. The registrar keeps the whole catalog in memory
//! and writes every change through a [`Store`] before acknowledging it or telling any
//! watcher, so nothing acknowledged is lost across restarts.
//!
//! The trait is shaped for the distributed backends (etcd, DynamoDB, Kubernetes):
//! writes are atomic batches of ops, and service creation is conditional
//! ([`StoreOp::CreateService`] fails with [`StoreError::Conflict`] when the key or the
//! VIP is already taken) so replicas racing to create one service agree on one VIP.

pub mod embedded;

use std::sync::Arc;

use aether_proto::registry::v1::{Endpoint, Service};
use async_trait::async_trait;

use crate::model::ServiceKey;

/// One durable change.
#[derive(Clone, Debug, PartialEq)]
pub enum StoreOp {
    /// Creates a service with its VIP; fails the batch with `Conflict` if the service
    /// key or the VIP already exists.
    CreateService(Service),
    /// Deletes a service and releases its VIP (its endpoints are deleted by their own ops).
    DeleteService {
        key: ServiceKey,
        vip: String,
    },
    PutEndpoint(Arc<Endpoint>),
    DeleteEndpoint {
        service: ServiceKey,
        address: String,
    },
}

/// Everything a store holds, as read at start-up. Records that could not be decoded
/// are reported, not dropped silently: they stay in the store untouched.
#[derive(Debug, Default)]
pub struct Contents {
    pub services: Vec<Service>,
    pub endpoints: Vec<Endpoint>,
    pub unreadable: Vec<UnreadableRecord>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct UnreadableRecord {
    pub key: String,
    pub reason: String,
}

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("store conflict: {0}")]
    Conflict(String),
    #[error("store unavailable: {0}")]
    Unavailable(String),
    #[error("store data is not usable: {0}")]
    Corrupt(String),
}

#[async_trait]
pub trait Store: Send + Sync + 'static {
    /// A short name for logs and metrics, e.g. "embedded".
    fn kind(&self) -> &'static str;

    /// Reads everything stored.
    async fn load(&self) -> Result<Contents, StoreError>;

    /// Applies `ops` atomically and durably: once this returns `Ok`, a crash loses
    /// none of them; on `Err`, none of them happened.
    async fn commit(&self, ops: Vec<StoreOp>) -> Result<(), StoreError>;
}
