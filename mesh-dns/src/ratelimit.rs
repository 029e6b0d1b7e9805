//! Log rate limiting: one line per period per call site; the rest are counted.

use std::time::{Duration, Instant};

#[derive(Debug)]
pub struct RateLimited {
    period: Duration,
    last: Option<Instant>,
    suppressed: u64,
}

impl RateLimited {
    pub fn new(period: Duration) -> Self {
        Self {
            period,
            last: None,
            suppressed: 0,
        }
    }

    /// Whether to log now; if not, the line is counted as suppressed.
    pub fn allow(&mut self) -> bool {
        let now = Instant::now();
        if self.last.is_none_or(|last| now.duration_since(last) >= self.period) {
            self.last = Some(now);
            true
        } else {
            self.suppressed += 1;
            false
        }
    }

    /// Lines suppressed since the last call.
    pub fn take_suppressed(&mut self) -> u64 {
        std::mem::take(&mut self.suppressed)
    }
}

/// A [`RateLimited`] shared between tasks.
#[derive(Debug)]
pub struct SharedRateLimited(parking_lot::Mutex<RateLimited>);

impl SharedRateLimited {
    pub fn new(period: Duration) -> Self {
        Self(parking_lot::Mutex::new(RateLimited::new(period)))
    }

    /// `Some(suppressed since the last line)` when a line may be logged now.
    pub fn allow(&self) -> Option<u64> {
        let mut inner = self.0.lock();
        inner.allow().then(|| inner.take_suppressed())
    }
}
