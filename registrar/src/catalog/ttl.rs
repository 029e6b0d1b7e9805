//! Time to live: services that stayed empty past their TTL are reaped (their VIP
//! freed), and the endpoints of nodes whose agent stopped refreshing are expired.
//! Registrations refresh their node's liveness in the store.

use std::net::IpAddr;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use super::Catalog;
use super::plan::Plan;
use super::state::State;
use super::writer::{Outcome, Write, Writer};
use crate::model::ServiceKey;
use crate::store::StoreOp;

impl Catalog {
    /// Periodically asks the writer to remove services that stayed empty past their
    /// TTL, and endpoints whose node stopped refreshing.
    pub async fn run_reaper(self, shutdown: CancellationToken) {
        let period = (self.config.empty_service_ttl / 4).clamp(Duration::from_millis(100), Duration::from_secs(60));
        let mut tick = tokio::time::interval(period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let period = (self.config.endpoint_ttl / 4).clamp(Duration::from_millis(100), Duration::from_secs(15));
        let mut expire = tokio::time::interval(period);
        expire.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            // A full queue means the writer is busy; try again next tick.
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tick.tick() => {
                    let _ = self.writes.try_send(Write::Reap);
                }
                _ = expire.tick() => {
                    let _ = self.writes.try_send(Write::Expire);
                }
            }
        }
    }
}

impl Plan {
    /// Removes services that have had no endpoints for longer than `ttl` (at most
    /// `most` of them: the rest next time).
    fn reap(&mut self, state: &State, now: Instant, ttl: Duration, most: usize) {
        for (key, entry) in &state.services {
            if self.ops.len() >= most {
                break;
            }
            // An external service never has endpoints: it lives as long as its declaration.
            let expired = entry.service.external.is_none()
                && entry
                    .empty_since
                    .is_some_and(|since| now.saturating_duration_since(since) >= ttl);
            if expired {
                self.remove_service(key, &entry.service);
            }
        }
    }
}

impl Writer {
    /// Tells the store that the agents of `nodes` are alive, at most once per node
    /// per quarter TTL, without holding up the writer.
    pub(super) fn refresh_nodes<'a>(&mut self, nodes: impl Iterator<Item = &'a str>) {
        let now = Instant::now();
        let every = self.config.endpoint_ttl / 4;
        let mut due = Vec::new();
        for node in nodes.filter(|n| !n.is_empty()) {
            let fresh = self
                .last_refresh
                .get(node)
                .is_some_and(|at| now.saturating_duration_since(*at) < every);
            if !fresh {
                self.last_refresh.insert(node.to_owned(), now);
                due.push(node.to_owned());
            }
        }
        if due.is_empty() {
            return;
        }
        let store = self.store.clone();
        tokio::spawn(async move {
            if let Err(error) = store.refresh(due).await {
                tracing::warn!(%error, "refreshing node liveness failed; the next registration retries");
            }
        });
    }

    /// Removes services that stayed empty past their TTL.
    pub(super) async fn reap(&mut self) {
        let mut plan = Plan::default();
        {
            let state = self.state.read();
            plan.reap(
                &state,
                Instant::now(),
                self.config.empty_service_ttl,
                self.store.max_batch_ops(),
            );
        }
        let removed: Vec<String> = plan.removed_services.iter().map(|(k, _)| k.to_string()).collect();
        if matches!(self.commit(plan).await, Outcome::Done(_)) && !removed.is_empty() {
            tracing::info!(services = ?removed, "removed services that had no endpoints for longer than the TTL");
        }
    }

    /// Removes the endpoints of nodes the store says stopped refreshing.
    pub(super) async fn expire(&mut self) {
        let nodes = match self.store.expired_nodes().await {
            Ok(nodes) => nodes,
            Err(error) => {
                tracing::warn!(%error, "could not list expired nodes; retrying later");
                return;
            }
        };
        for node in nodes {
            self.expire_node(node).await;
        }
    }

    /// Removes the endpoints of `node`, in store batches, then forgets the node (with
    /// the last batch, or alone if it had none).
    async fn expire_node(&mut self, node: String) {
        let most = self.store.max_batch_ops().max(2);
        let doomed = self.endpoints_of(&node);
        tracing::warn!(%node, endpoints = doomed.len(), ttl = ?self.config.endpoint_ttl,
            "removing the endpoints of a node whose agent stopped refreshing");
        let mut chunks = doomed.chunks(most - 1).peekable();
        let mut failed = false;
        while let Some(chunk) = chunks.next() {
            let mut plan = self.plan_removal(chunk);
            if chunks.peek().is_none() {
                plan.ops.push(StoreOp::ForgetNode(node.clone()));
            }
            let count = chunk.len() as u64;
            if matches!(self.commit(plan).await, Outcome::Done(_)) {
                self.metrics.expired_endpoints.inc_by(count);
            } else {
                failed = true;
                break;
            }
        }
        if doomed.is_empty() && !failed {
            let plan = Plan {
                ops: vec![StoreOp::ForgetNode(node.clone())],
                ..Default::default()
            };
            let _ = self.commit(plan).await;
        }
        self.last_refresh.remove(&node);
    }

    /// Every endpoint registered by `node`.
    fn endpoints_of(&self, node: &str) -> Vec<(ServiceKey, IpAddr)> {
        let state = self.state.read();
        state
            .services
            .iter()
            .flat_map(|(key, entry)| {
                entry
                    .endpoints
                    .iter()
                    .filter(|(_, e)| e.node == node)
                    .map(move |(address, _)| (key.clone(), *address))
            })
            .collect()
    }

    /// A plan removing `endpoints`. The reaper acts for no node: no owner check.
    fn plan_removal(&self, endpoints: &[(ServiceKey, IpAddr)]) -> Plan {
        let mut plan = Plan::default();
        let state = self.state.read();
        for (key, address) in endpoints {
            let _ = plan.unregister(&state, key.clone(), *address, None);
        }
        plan
    }
}
