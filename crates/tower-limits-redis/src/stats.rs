//! Counters of one backend (one replica's view), for dashboards and alerts.

use std::sync::atomic::{AtomicU64, Ordering};

/// Counters of a [`RedisBackend`](crate::RedisBackend) since it was built, as seen by this
/// replica. See the crate docs, *What to monitor*, for what each one means in operation.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RedisStats {
    /// Acquisitions asked for.
    pub acquisitions: u64,
    /// Acquisitions Redis granted.
    pub granted: u64,
    /// Acquisitions Redis refused (a limit was exhausted).
    pub refused: u64,
    /// Refusals answered from the local cache, without a round trip.
    pub cached_refusals: u64,
    /// Network round trips to Redis, for every operation.
    pub round_trips: u64,
    /// `NOSCRIPT` answers, each followed by one `EVAL` (after `SCRIPT FLUSH`, a restart
    /// or a failover).
    pub script_loads: u64,
    /// Calls that did not answer within the timeout.
    pub timeouts: u64,
    /// Calls that failed (connection errors, server errors, unexpected replies).
    pub errors: u64,
    /// Times the circuit breaker opened.
    pub breaker_opened: u64,
    /// Whether the breaker is open now.
    pub breaker_open: bool,
    /// Acquisitions answered by the failure policy (Redis unavailable or breaker open).
    pub unavailable: u64,
    /// Of those, requests admitted without limits ([`FailurePolicy::FailOpen`](crate::FailurePolicy::FailOpen)).
    pub fail_open_admits: u64,
    /// Of those, acquisitions decided by the local fallback limiter.
    pub fallback_acquisitions: u64,
    /// Settles, releases, cancels and renewals applied in the background.
    pub background_ops: u64,
    /// Background operations given up (Redis stayed away longer than their retry window);
    /// semaphore holds then come back when their lease expires.
    pub background_failures: u64,
    /// Background operations waiting or in flight now.
    pub background_pending: u64,
    /// Semaphore leases renewed.
    pub leases_renewed: u64,
    /// Semaphore grants whose leases this replica renews now.
    pub leases_held: u64,
    /// Acquisitions granted from this replica's capacity shares, without a round trip.
    pub shared_grants: u64,
    /// Acquisitions refused by an exhausted share, without a round trip.
    pub shared_refusals: u64,
    /// Calls refreshing the shares (one per refresh period, per Cluster slot).
    pub share_refreshes: u64,
    /// Refreshes of the shares carried in a lease refresh's call
    /// ([`RedisAccountsBuilder::carry_shares`](crate::RedisAccountsBuilder::carry_shares)),
    /// with no call of their own. A refresh group's calls and carried refreshes count
    /// with the first backend of the group.
    pub share_refreshes_carried: u64,
    /// Acquisitions that found a semaphore full while this replica's releases were on
    /// their way, waited for them and asked again (once each).
    pub release_waits: u64,
}

#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) acquisitions: AtomicU64,
    pub(crate) granted: AtomicU64,
    pub(crate) refused: AtomicU64,
    pub(crate) cached_refusals: AtomicU64,
    pub(crate) round_trips: AtomicU64,
    pub(crate) script_loads: AtomicU64,
    pub(crate) timeouts: AtomicU64,
    pub(crate) errors: AtomicU64,
    pub(crate) breaker_opened: AtomicU64,
    pub(crate) unavailable: AtomicU64,
    pub(crate) fail_open_admits: AtomicU64,
    pub(crate) fallback_acquisitions: AtomicU64,
    pub(crate) background_ops: AtomicU64,
    pub(crate) background_failures: AtomicU64,
    pub(crate) background_pending: AtomicU64,
    pub(crate) leases_renewed: AtomicU64,
    pub(crate) shared_grants: AtomicU64,
    pub(crate) shared_refusals: AtomicU64,
    pub(crate) share_refreshes: AtomicU64,
    pub(crate) share_refreshes_carried: AtomicU64,
    pub(crate) release_waits: AtomicU64,
}

pub(crate) fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

impl Counters {
    pub(crate) fn snapshot(&self, breaker_open: bool, leases_held: u64) -> RedisStats {
        let l = |c: &AtomicU64| c.load(Ordering::Relaxed);
        RedisStats {
            acquisitions: l(&self.acquisitions),
            granted: l(&self.granted),
            refused: l(&self.refused),
            cached_refusals: l(&self.cached_refusals),
            round_trips: l(&self.round_trips),
            script_loads: l(&self.script_loads),
            timeouts: l(&self.timeouts),
            errors: l(&self.errors),
            breaker_opened: l(&self.breaker_opened),
            breaker_open,
            unavailable: l(&self.unavailable),
            fail_open_admits: l(&self.fail_open_admits),
            fallback_acquisitions: l(&self.fallback_acquisitions),
            background_ops: l(&self.background_ops),
            background_failures: l(&self.background_failures),
            background_pending: l(&self.background_pending),
            leases_renewed: l(&self.leases_renewed),
            leases_held,
            shared_grants: l(&self.shared_grants),
            shared_refusals: l(&self.shared_refusals),
            share_refreshes: l(&self.share_refreshes),
            share_refreshes_carried: l(&self.share_refreshes_carried),
            release_waits: l(&self.release_waits),
        }
    }
}
