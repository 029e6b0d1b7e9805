//! Whether the store is reachable, as the writer sees it: logged on each change,
//! exported as a metric, reported on the readiness endpoint, and when to try again.

use std::time::{Duration, Instant};

use aether_common::readiness::Gate;

use crate::metrics::Metrics;

const RETRY_MIN: Duration = Duration::from_millis(100);
const RETRY_MAX: Duration = Duration::from_secs(2);

pub(super) struct StoreHealth {
    /// The store's kind, for logs.
    kind: &'static str,
    metrics: Metrics,
    /// Why the store is considered down (None: up).
    pub(super) down: Option<String>,
    retry_at: Instant,
    pub(super) backoff: Duration,
    /// The `store` readiness gate, if the writer reports to one.
    pub(super) readiness: Option<Gate>,
}

impl StoreHealth {
    pub(super) fn new(kind: &'static str, metrics: Metrics) -> StoreHealth {
        StoreHealth {
            kind,
            metrics,
            down: None,
            retry_at: Instant::now(),
            backoff: RETRY_MIN,
            readiness: None,
        }
    }

    pub(super) fn is_down(&self) -> bool {
        self.down.is_some()
    }

    /// Whether the backoff after the last failure has passed.
    pub(super) fn retry_due(&self) -> bool {
        Instant::now() >= self.retry_at
    }

    pub(super) fn set_down(&mut self, reason: String) {
        if self.down.is_none() {
            tracing::error!(store = self.kind, %reason,
                "the catalog store is unreachable: serving the last snapshot, queueing writes");
            if let Some(readiness) = &self.readiness {
                readiness.set_not_ready(format!("the {} store is unreachable: {reason}", self.kind));
            }
        }
        self.metrics.store_up.set(0);
        self.down = Some(reason);
    }

    pub(super) fn set_up(&mut self) {
        if self.down.take().is_some() {
            tracing::info!(store = self.kind, "the catalog store is reachable again");
            if let Some(readiness) = &self.readiness {
                readiness.set_ready();
            }
        }
        self.metrics.store_up.set(1);
        self.backoff = RETRY_MIN;
    }

    pub(super) fn schedule_retry(&mut self) {
        self.retry_at = Instant::now() + self.backoff;
        self.backoff = (self.backoff * 2).min(RETRY_MAX);
    }

    /// Marks the store down for `reason` and backs off before the next attempt.
    pub(super) fn failed(&mut self, reason: String) {
        self.set_down(reason);
        self.schedule_retry();
    }
}
