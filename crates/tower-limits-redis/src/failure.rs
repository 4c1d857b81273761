//! What happens when Redis cannot answer: the failure policy and the circuit breaker.
//!
//! Every call to Redis has a short timeout. A call that times out or fails counts as a
//! failure; after `threshold` failures in a row the breaker *opens* for `open_for`:
//! acquisitions then go straight to the failure policy without touching the network, so
//! a dead Redis does not add its timeout to every request. When `open_for` has passed,
//! one acquisition is let through as a probe; its success closes the breaker, its
//! failure opens it again. Any success resets the count.
//!
//! The state is three atomics, read without a lock on every acquisition.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use tokio::time::Instant;

/// What an acquisition does when Redis cannot answer within the timeout (or the circuit
/// breaker is open).
///
/// Whatever the policy, a timed-out acquisition is treated as *may have been granted*:
/// its semaphore holds are released by holder id as soon as Redis answers again (or
/// expire with their lease), and its rate charges are kept.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum FailurePolicy {
    /// Refuse with [`AcquireError::Unavailable`](tower_limits_core::AcquireError::Unavailable)
    /// (the HTTP layer answers 503). The safe default for limits that protect something.
    #[default]
    FailClosed,
    /// Admit the request without any limit, and count it in
    /// [`RedisStats::fail_open_admits`](crate::RedisStats::fail_open_admits). For limits
    /// that are a courtesy, where availability matters more.
    FailOpen,
    /// Decide with an in-memory [`LimitSet`](tower_limits_core::LimitSet) of this
    /// process, whose limits are `share` of the policy's (rates, bursts, window limits
    /// and capacities scaled down, at least 1): with `n` replicas, a share of `1/n` keeps
    /// the fleet near the shared limit while Redis is away.
    Fallback {
        /// The fraction of every limit this replica may use on its own, in `(0, 1]`.
        share: f64,
    },
}

/// The circuit breaker's answer for one call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Gate {
    /// Send it.
    Closed,
    /// Send it: it is the probe that may close the breaker.
    Probe,
    /// Do not send it.
    Open,
}

#[derive(Debug)]
pub(crate) struct Breaker {
    origin: Instant,
    threshold: u32,
    open_for: Duration,
    failures: AtomicU32,
    /// Nanoseconds since `origin` until which the breaker is open; 0 when closed.
    open_until: AtomicU64,
    /// When the current probe started (0: none).
    probe: AtomicU64,
}

impl Breaker {
    pub(crate) fn new(threshold: u32, open_for: Duration) -> Self {
        Breaker {
            origin: Instant::now(),
            threshold: threshold.max(1),
            open_for,
            failures: AtomicU32::new(0),
            open_until: AtomicU64::new(0),
            probe: AtomicU64::new(0),
        }
    }

    fn now(&self) -> u64 {
        u64::try_from(self.origin.elapsed().as_nanos()).unwrap_or(u64::MAX).saturating_add(1)
    }

    pub(crate) fn gate(&self) -> Gate {
        let until = self.open_until.load(Ordering::Acquire);
        if until == 0 {
            return Gate::Closed;
        }
        let now = self.now();
        if now < until {
            return Gate::Open;
        }
        // One probe at a time; a probe that never reported (its task was dropped) is
        // replaced after another `open_for`.
        let started = self.probe.load(Ordering::Acquire);
        let stale = started != 0 && now.saturating_sub(started) > duration_nanos(self.open_for);
        if (started == 0 || stale)
            && self.probe.compare_exchange(started, now, Ordering::AcqRel, Ordering::Acquire).is_ok()
        {
            Gate::Probe
        } else {
            Gate::Open
        }
    }

    /// Whether the breaker is open now.
    pub(crate) fn is_open(&self) -> bool {
        self.open_until.load(Ordering::Acquire) != 0
    }

    pub(crate) fn success(&self) {
        self.failures.store(0, Ordering::Release);
        if self.open_until.swap(0, Ordering::AcqRel) != 0 {
            tracing::info!(target: "tower_limits_redis", "redis answers again: circuit closed");
        }
        self.probe.store(0, Ordering::Release);
    }

    /// Records a failure; true when it opened the breaker.
    pub(crate) fn failure(&self) -> bool {
        let failures = self.failures.fetch_add(1, Ordering::AcqRel).saturating_add(1);
        let probing = self.probe.load(Ordering::Acquire) != 0;
        if failures >= self.threshold || probing {
            let was = self.open_until.swap(self.now().saturating_add(duration_nanos(self.open_for)), Ordering::AcqRel);
            self.probe.store(0, Ordering::Release);
            if was == 0 {
                tracing::warn!(
                    target: "tower_limits_redis",
                    failures,
                    open_for_ms = self.open_for.as_millis() as u64,
                    "redis does not answer: circuit open, acquisitions follow the failure policy"
                );
                return true;
            }
        }
        false
    }
}

fn duration_nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opens_after_threshold_and_closes_on_success() {
        let b = Breaker::new(2, Duration::from_secs(3600));
        assert_eq!(b.gate(), Gate::Closed);
        assert!(!b.failure());
        assert_eq!(b.gate(), Gate::Closed);
        assert!(b.failure());
        assert_eq!(b.gate(), Gate::Open);
        b.success();
        assert_eq!(b.gate(), Gate::Closed);
    }

    #[test]
    fn one_probe_after_open_for() {
        let b = Breaker::new(1, Duration::ZERO);
        assert!(b.failure());
        assert_eq!(b.gate(), Gate::Probe);
        assert!(b.is_open());
        // The probe fails: open again, and the next call probes again.
        b.failure();
        assert_eq!(b.gate(), Gate::Probe);
        b.success();
        assert!(!b.is_open());
    }
}
