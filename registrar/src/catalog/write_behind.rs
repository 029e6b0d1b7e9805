//! The write-behind queue: while the store is unreachable, accepted writes are
//! applied to memory and queued, then committed in order once it is back. A queued
//! batch that lost a race with another replica is rewritten and retried; one that
//! keeps failing is dropped (agents re-register on their next refresh).

use std::collections::{HashMap, HashSet, VecDeque};
use std::time::Instant;

use aether_proto::registry::v1::Service;
use tonic::Status;

use super::plan::Plan;
use super::revisions::{RecordKey, is_delete};
use super::writer::{Outcome, Writer};
use crate::model::ServiceKey;
use crate::store::{Conflict, FeedChangeKind, Revision, StoreError, StoreOp};

/// Attempts at one queued batch whose conditions keep failing before it is dropped.
const MAX_QUEUED_ATTEMPTS: u32 = 5;

/// A batch accepted while the store was unreachable, waiting to be committed.
struct Queued {
    ops: Vec<StoreOp>,
    attempts: u32,
}

#[derive(Default)]
pub(super) struct WriteBehind {
    /// Oldest first.
    queue: VecDeque<Queued>,
    /// How many ops the queue holds.
    pub(super) ops: usize,
    /// How many queued batches touch each record.
    pending: HashMap<RecordKey, usize>,
}

impl WriteBehind {
    pub(super) fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }

    /// Whether a queued write to `key` is newer than anything committed.
    pub(super) fn touches(&self, key: &RecordKey) -> bool {
        self.pending.contains_key(key)
    }
}

impl Writer {
    /// Accepts `plan` into memory and the write-behind queue, if it fits.
    pub(super) fn enqueue(&mut self, mut plan: Plan) -> Outcome {
        if let Err(refused) = self.queue_has_room(plan.ops.len()) {
            return Outcome::Refused(refused);
        }
        for op in &plan.ops {
            if let Some(key) = RecordKey::of_op(op) {
                *self.behind.pending.entry(key.clone()).or_default() += 1;
                self.revisions.set_pending(key);
            }
        }
        let ops = std::mem::take(&mut plan.ops);
        self.behind.ops += ops.len();
        self.metrics.write_behind_ops.set(self.behind.ops as i64);
        self.behind.queue.push_back(Queued { ops, attempts: 0 });
        Outcome::Done(self.apply(plan))
    }

    /// Why `ops` more operations may not be queued, if they may not.
    fn queue_has_room(&self, ops: usize) -> Result<(), Status> {
        let limit = self.config.write_behind_limit;
        if limit == 0 {
            let reason = self.health.down.clone().unwrap_or_default();
            return Err(Status::unavailable(format!(
                "the catalog store is unreachable ({reason}) and writes are not queued \
                 (--write-behind-limit 0); retry later or against another replica"
            )));
        }
        if self.behind.ops + ops > limit {
            self.metrics.write_behind_refused.inc();
            let reason = self.health.down.clone().unwrap_or_else(|| "catching up".into());
            return Err(Status::unavailable(format!(
                "the catalog store is unreachable ({reason}) and the write-behind queue is full \
                 ({} of {limit} operations); retry later or against another replica",
                self.behind.ops
            )));
        }
        Ok(())
    }

    /// Commits queued batches in order until the queue is empty or the store fails.
    pub(super) async fn drain_queue(&mut self) {
        while let Some(front) = self.behind.queue.front() {
            let ops = front.ops.clone();
            if ops.is_empty() {
                self.behind.queue.pop_front();
                continue;
            }
            match self.store.commit(ops.clone()).await {
                Ok(revision) => {
                    self.behind.queue.pop_front();
                    self.finish_queued(&ops, Some(revision));
                }
                Err(StoreError::Unavailable(reason)) => {
                    self.health.failed(reason);
                    return;
                }
                Err(StoreError::Conflict(conflict)) => self.retry_queued(conflict),
                Err(error) => {
                    let entry = self.behind.queue.pop_front().expect("front exists");
                    tracing::error!(%error, ops = entry.ops.len(), "the store refused a queued batch; dropping it");
                    self.drop_queued(entry);
                }
            }
        }
        self.health.set_up();
    }

    /// Rewrites the front batch after it lost a race and puts it back, or drops it
    /// once its conditions kept failing.
    fn retry_queued(&mut self, conflict: Conflict) {
        self.metrics.store_conflicts.inc();
        let mut entry = self.behind.queue.pop_front().expect("front exists");
        entry.attempts += 1;
        if entry.attempts > MAX_QUEUED_ATTEMPTS {
            tracing::error!(detail = %conflict.detail, ops = entry.ops.len(),
                "dropping a queued batch whose conditions keep failing");
            self.drop_queued(entry);
            return;
        }
        tracing::info!(detail = %conflict.detail,
            "a queued batch raced another replica; adopting its records and retrying");
        let before = entry.ops.len();
        self.rewrite_queued(&mut entry.ops, conflict);
        self.behind.ops = self.behind.ops + entry.ops.len() - before;
        self.behind.queue.push_front(entry);
    }

    fn drop_queued(&mut self, entry: Queued) {
        self.metrics.write_behind_dropped.inc_by(entry.ops.len() as u64);
        self.finish_queued(&entry.ops, None);
    }

    /// Bookkeeping once a queued batch left the queue (`None`: dropped).
    fn finish_queued(&mut self, ops: &[StoreOp], revision: Option<Revision>) {
        self.behind.ops -= ops.len().min(self.behind.ops);
        self.metrics.write_behind_ops.set(self.behind.ops as i64);
        for op in ops {
            let Some(key) = RecordKey::of_op(op) else { continue };
            let left = match self.behind.pending.get_mut(&key) {
                Some(n) => {
                    *n -= 1;
                    *n
                }
                None => 0,
            };
            if left == 0 {
                self.behind.pending.remove(&key);
                match revision {
                    Some(revision) => self.set_rev(key, revision, is_delete(op)),
                    // Unknown: let the feed or the next resync decide.
                    None => self.revisions.forget(&key),
                }
            }
        }
    }

    /// Makes a queued batch that lost a race committable: adopt the winners, give a
    /// service whose VIP was taken meanwhile a new one, recreate services another
    /// replica deleted.
    fn rewrite_queued(&mut self, ops: &mut Vec<StoreOp>, conflict: Conflict) {
        let winners: HashMap<String, Service> = conflict
            .existing
            .iter()
            .map(|s| (format!("{}/{}", s.namespace, s.name), s.clone()))
            .collect();
        let taken: HashSet<String> = conflict.existing.iter().map(|s| s.vip.clone()).collect();
        self.apply_remote(
            conflict
                .existing
                .into_iter()
                .map(|s| (None, FeedChangeKind::ServicePut(s)))
                .collect(),
        );
        let gone: HashSet<String> = conflict.missing.iter().map(ToString::to_string).collect();
        ops.retain(|op| match op {
            StoreOp::CreateService(service) => {
                !winners.contains_key(&format!("{}/{}", service.namespace, service.name))
            }
            // Recreated below from memory, which already holds the update.
            StoreOp::UpdateService(service) => !gone.contains(&format!("{}/{}", service.namespace, service.name)),
            _ => true,
        });
        for op in ops.iter_mut() {
            let StoreOp::CreateService(service) = op else { continue };
            if taken.contains(&service.vip) {
                self.move_to_fresh_vip(service);
            }
        }
        let recreate = self.recreate_ops(conflict.missing);
        for op in recreate.into_iter().rev() {
            ops.insert(0, op);
        }
    }

    /// Gives a queued new service whose VIP another replica took a free one.
    fn move_to_fresh_vip(&mut self, service: &mut Service) {
        let Ok(key) = ServiceKey::from_parts("service", &service.namespace, &service.name) else {
            return;
        };
        let fresh = {
            let state = self.state.read();
            self.config.vips.allocate(&key, |ip| state.vips.contains_key(&ip))
        };
        match fresh {
            Ok(vip) => {
                service.vip = vip.to_string();
                self.apply_remote(vec![(None, FeedChangeKind::ServicePut(service.clone()))]);
            }
            Err(error) => tracing::error!(%key, %error, "no VIP left for a queued service"),
        }
    }

    /// Ops that create again the services of `missing` this replica still holds.
    fn recreate_ops(&self, missing: Vec<ServiceKey>) -> Vec<StoreOp> {
        let state = self.state.read();
        missing
            .into_iter()
            .filter_map(|key| state.services.get(&key))
            .map(|entry| StoreOp::CreateService(entry.service.clone()))
            .collect()
    }

    /// Tries to commit what is queued before the writer exits, for at most `deadline`.
    pub(super) async fn flush_queue(&mut self, deadline: Instant) {
        while !self.behind.queue.is_empty() && Instant::now() < deadline {
            self.drain_queue().await;
            if !self.behind.queue.is_empty() {
                tokio::time::sleep(self.health.backoff).await;
            }
        }
    }
}
