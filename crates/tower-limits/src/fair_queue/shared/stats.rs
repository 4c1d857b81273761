//! The layer's counters: what it admitted, how long requests waited, what it refused.
//!
//! Global counters are kept under the state's lock and copied out by
//! [`FairQueueLayerStats`]; per-tenant counters live in [`Records`], bounded: when full,
//! the older half of the records of tenants with nothing queued is dropped, so their
//! number never exceeds the layer's `tracked_tenants`.

use std::time::Duration;

use hashbrown::HashMap;
use tower_limits_core::fair_queue::FairQueue;
use tower_limits_core::{Backend, Instant, TenantKey};

use super::{Queued, Shared, State};
use crate::error::ErrorKind;

/// Requests refused, by reason.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Refusals {
    /// The tenant's own queue was full (HTTP 429).
    pub tenant_queue_full: u64,
    /// The whole queue was full (HTTP 503).
    pub queue_full: u64,
    /// The request waited its maximum queueing time, or would have waited past it for
    /// the rate.
    pub wait_timed_out: u64,
    /// The rate backend refused it for the tenant's own limit (a limit keyed by a tier).
    pub rate_limited: u64,
    /// Its cost is above what the rate backend can ever grant.
    pub cost_above_capacity: u64,
    /// It carried no tenant key.
    pub missing_key: u64,
    /// Anything else: a full key table, an unavailable backend.
    pub other: u64,
}

impl Refusals {
    pub(super) fn count(&mut self, kind: ErrorKind) {
        let n = match kind {
            ErrorKind::TenantQueueFull => &mut self.tenant_queue_full,
            ErrorKind::QueueFull => &mut self.queue_full,
            ErrorKind::WaitTimedOut => &mut self.wait_timed_out,
            ErrorKind::RateLimited | ErrorKind::ConcurrencyLimited => &mut self.rate_limited,
            ErrorKind::CostAboveCapacity => &mut self.cost_above_capacity,
            ErrorKind::MissingKey => &mut self.missing_key,
            _ => &mut self.other,
        };
        *n += 1;
    }

    /// All of them.
    #[must_use]
    pub fn total(&self) -> u64 {
        self.tenant_queue_full
            + self.queue_full
            + self.wait_timed_out
            + self.rate_limited
            + self.cost_above_capacity
            + self.missing_key
            + self.other
    }
}

/// Counters of a [`FairQueueLayer`](crate::fair_queue::FairQueueLayer), shared by all its services.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FairQueueLayerStats {
    /// Requests queued now.
    pub queued: usize,
    /// Tenants with requests queued now.
    pub backlogged_tenants: usize,
    /// Slots taken now: admitted requests not finished, granted requests not yet called,
    /// and the request at the rate gate.
    pub in_flight: usize,
    /// Whether a request waits at the rate gate now (the next in fair order, for the
    /// instant the rate lets it pass).
    pub waiting_for_rate: bool,
    /// Requests admitted (the inner service was or is being called).
    pub admitted: u64,
    /// Their total cost (saturating).
    pub admitted_cost: u64,
    /// Admitted requests that waited in the queue first.
    pub waited: u64,
    /// Their total queueing time.
    pub wait_time: Duration,
    /// The longest queueing time of an admitted request.
    pub max_wait: Duration,
    /// Waiting requests dropped by their caller (granted ones included: their grant
    /// went back).
    pub cancelled: u64,
    /// Requests refused, by reason.
    pub refused: Refusals,
    /// Tenants whose counters are kept now (see
    /// [`FairQueueLayer::tracked_tenants`](crate::fair_queue::FairQueueLayer::tracked_tenants)).
    pub tracked_tenants: usize,
}

/// One tenant's queue and counters, from
/// [`FairQueueLayer::tenant_stats`](crate::fair_queue::FairQueueLayer::tenant_stats).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TenantQueueStats {
    /// Its configured weight.
    pub weight: u32,
    /// Its requests queued now.
    pub queued: usize,
    /// Their total cost.
    pub queued_cost: u64,
    /// Its requests admitted since its counters were created.
    pub admitted: u64,
    /// Their total cost (saturating).
    pub admitted_cost: u64,
    /// Its admitted requests that waited in the queue.
    pub waited: u64,
    /// Their total queueing time.
    pub wait_time: Duration,
}

#[derive(Default)]
pub(super) struct Counters {
    pub(super) admitted: u64,
    pub(super) admitted_cost: u64,
    pub(super) waited: u64,
    pub(super) wait_nanos: u64,
    pub(super) max_wait_nanos: u64,
    pub(super) cancelled: u64,
    pub(super) refused: Refusals,
}

/// Per-tenant counters, bounded: when full, the older half of the records of tenants
/// with nothing queued is dropped. A scan that frees little is not repeated for the next
/// `limit / 2` new tenants (their counters are not kept meanwhile), so insertion stays
/// amortized O(1) even when most tracked tenants are backlogged.
pub(super) struct Records {
    pub(super) map: HashMap<TenantKey, Record>,
    pub(super) limit: usize,
    /// New tenants to turn away before the next scan.
    pub(super) cooldown: usize,
}

#[derive(Default)]
pub(super) struct Record {
    pub(super) admitted: u64,
    pub(super) admitted_cost: u64,
    pub(super) waited: u64,
    pub(super) wait_nanos: u64,
    pub(super) last_admitted: Instant,
    /// The time between its last two admissions while it was backlogged (zero:
    /// unknown); estimates when its full queue will have room again.
    pub(super) interval: Duration,
    /// Whether it still had requests queued at its last admission.
    pub(super) backlogged: bool,
}

impl Records {
    fn update(&mut self, key: &TenantKey, queue: &FairQueue<TenantKey, Queued>, f: impl FnOnce(&mut Record)) {
        if let Some(record) = self.map.get_mut(key) {
            f(record);
            return;
        }
        if self.map.len() >= self.limit {
            if self.cooldown > 0 {
                self.cooldown -= 1;
                return;
            }
            self.evict(queue);
            if self.map.len() + self.limit / 4 > self.limit {
                self.cooldown = self.limit / 2;
            }
            if self.map.len() >= self.limit {
                return;
            }
        }
        let mut record = Record::default();
        f(&mut record);
        self.map.insert(key.clone(), record);
    }

    fn evict(&mut self, queue: &FairQueue<TenantKey, Queued>) {
        let idle = |key: &TenantKey| queue.tenant_stats(key).is_none_or(|t| t.queued == 0);
        let mut seen: Vec<Instant> = self.map.iter().filter(|(k, _)| idle(k)).map(|(_, r)| r.last_admitted).collect();
        if seen.is_empty() {
            return;
        }
        let middle = seen.len() / 2;
        let (_, &mut cut, _) = seen.select_nth_unstable(middle);
        self.map.retain(|k, r| r.last_admitted > cut || !idle(k));
    }
}

impl<B: Backend> Shared<B> {
    pub(crate) fn stats(&self) -> FairQueueLayerStats {
        let st = self.lock();
        let queue = st.queue.stats();
        let c = &st.counters;
        FairQueueLayerStats {
            queued: queue.queued,
            backlogged_tenants: queue.backlogged_tenants,
            in_flight: st.in_flight,
            waiting_for_rate: st.gate.is_some(),
            admitted: c.admitted,
            admitted_cost: c.admitted_cost,
            waited: c.waited,
            wait_time: Duration::from_nanos(c.wait_nanos),
            max_wait: Duration::from_nanos(c.max_wait_nanos),
            cancelled: c.cancelled,
            refused: c.refused,
            tracked_tenants: st.records.map.len(),
        }
    }

    pub(crate) fn tenant_stats(&self, key: &TenantKey) -> Option<TenantQueueStats> {
        let st = self.lock();
        let queued = st.queue.tenant_stats(key);
        let record = st.records.map.get(key);
        if queued.is_none() && record.is_none() {
            return None;
        }
        let mut stats = TenantQueueStats { weight: st.queue.weight(key), ..TenantQueueStats::default() };
        if let Some(q) = queued {
            stats.queued = q.queued;
            stats.queued_cost = q.queued_cost;
        }
        if let Some(r) = record {
            stats.admitted = r.admitted;
            stats.admitted_cost = r.admitted_cost;
            stats.waited = r.waited;
            stats.wait_time = Duration::from_nanos(r.wait_nanos);
        }
        Some(stats)
    }
}

impl<B: Backend> State<B> {
    pub(super) fn count_admission(&mut self, key: &TenantKey, cost: u64, waited: Option<Duration>, now: Instant) {
        let c = &mut self.counters;
        c.admitted += 1;
        c.admitted_cost = c.admitted_cost.saturating_add(cost);
        let wait_nanos = waited.map(|w| u64::try_from(w.as_nanos()).unwrap_or(u64::MAX));
        if let Some(n) = wait_nanos {
            c.waited += 1;
            c.wait_nanos = c.wait_nanos.saturating_add(n);
            c.max_wait_nanos = c.max_wait_nanos.max(n);
        }
        let backlogged = waited.is_some() && self.queue.tenant_stats(key).is_some_and(|t| t.queued > 0);
        self.records.update(key, &self.queue, |r| {
            r.admitted += 1;
            r.admitted_cost = r.admitted_cost.saturating_add(cost);
            if let Some(n) = wait_nanos {
                r.waited += 1;
                r.wait_nanos = r.wait_nanos.saturating_add(n);
            }
            if r.backlogged {
                r.interval = now.saturating_since(r.last_admitted);
            }
            r.last_admitted = now;
            r.backlogged = backlogged;
        });
    }
}
