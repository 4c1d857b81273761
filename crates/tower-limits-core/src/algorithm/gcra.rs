//! The generic cell rate algorithm.
//!
//! GCRA keeps one integer per key, the *theoretical arrival time* (TAT): the instant at
//! which the key would be back to full capacity if nothing else arrived. A grant of cost
//! `c` moves it to `max(tat, now) + c*T`, where `T` is the emission interval; it is
//! allowed when the result is no further than the tolerance `burst*T` ahead of `now`. So
//! the debt `max(tat, now) - now` never exceeds `burst*T`, which gives the rate cap: over
//! any window of length `W`, the admitted cost is at most `W/T + burst`.

use std::time::Duration;

use super::{Algorithm, Refusal, Snapshot};
use crate::rate::Quota;
use crate::time::Instant;

/// GCRA: a rate with a burst, one integer of state per key.
///
/// ```
/// use tower_limits_core::algorithm::{Algorithm, Gcra, Refusal};
/// use tower_limits_core::{Instant, Quota, nz};
/// use std::time::Duration;
///
/// let gcra = Gcra::new(Quota::per_second(nz!(10)).burst(nz!(5)));
/// let mut state = gcra.fresh();
/// let now = Instant::ZERO;
/// for _ in 0..5 {
///     gcra.acquire(&mut state, now, 1).unwrap();
/// }
/// assert_eq!(
///     gcra.acquire(&mut state, now, 1),
///     Err(Refusal::NotYet { retry_after: Some(Duration::from_millis(100)) })
/// );
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gcra {
    quota: Quota,
    /// `burst * interval`: at most 2^62 nanoseconds, which a quota guarantees.
    tolerance: u64,
}

/// The state of one key under [`Gcra`]: the theoretical arrival time.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GcraState {
    tat: Instant,
}

impl GcraState {
    /// The theoretical arrival time: when the key is back to full capacity.
    #[must_use]
    pub fn theoretical_arrival(&self) -> Instant {
        self.tat
    }

    /// The state whose theoretical arrival time is `tat`.
    pub(crate) const fn at(tat: Instant) -> Self {
        GcraState { tat }
    }
}

impl Gcra {
    /// GCRA of `quota`: its rate, and room for its burst at once. A quota is valid by
    /// construction (a rate of at least one unit per non-zero period, an interval within
    /// 1% of it, a burst of at least one spanning at most 2^62 nanoseconds), so this
    /// cannot fail.
    #[must_use]
    pub const fn new(quota: Quota) -> Self {
        Gcra { quota, tolerance: quota.interval_nanos() * quota.max_burst() }
    }

    /// The quota: the rate, and the burst, the most that can be granted at once.
    #[must_use]
    pub const fn quota(&self) -> Quota {
        self.quota
    }

    /// The emission interval in nanoseconds (rounded up).
    #[must_use]
    pub const fn interval_nanos(&self) -> u64 {
        self.quota.interval_nanos()
    }

    #[inline]
    fn burst(&self) -> u64 {
        self.quota.max_burst()
    }

    #[inline]
    fn cost_nanos(&self, cost: u64) -> u64 {
        // cost <= burst is checked first, and burst * interval fits (see `Quota`).
        cost.saturating_mul(self.interval_nanos())
    }
}

impl Algorithm for Gcra {
    type State = GcraState;

    fn fresh(&self) -> GcraState {
        GcraState::default()
    }

    fn capacity(&self) -> u64 {
        self.burst()
    }

    #[inline]
    fn check(&self, state: &GcraState, now: Instant, cost: u64) -> Result<(), Refusal> {
        if cost > self.burst() {
            return Err(Refusal::Never { capacity: self.burst() });
        }
        let base = state.tat.max(now).as_nanos();
        let new_tat = base.saturating_add(self.cost_nanos(cost));
        let ahead = new_tat - now.as_nanos();
        if ahead > self.tolerance {
            Err(Refusal::NotYet { retry_after: Some(Duration::from_nanos(ahead - self.tolerance)) })
        } else {
            Ok(())
        }
    }

    #[inline]
    fn commit(&self, state: &mut GcraState, now: Instant, cost: u64) {
        let base = state.tat.max(now).as_nanos();
        state.tat = Instant::from_nanos(base.saturating_add(self.cost_nanos(cost)));
    }

    #[inline]
    fn acquire(&self, state: &mut GcraState, now: Instant, cost: u64) -> Result<(), Refusal> {
        if cost > self.burst() {
            return Err(Refusal::Never { capacity: self.burst() });
        }
        let base = state.tat.max(now).as_nanos();
        let new_tat = base.saturating_add(self.cost_nanos(cost));
        let ahead = new_tat - now.as_nanos();
        if ahead > self.tolerance {
            return Err(Refusal::NotYet { retry_after: Some(Duration::from_nanos(ahead - self.tolerance)) });
        }
        state.tat = Instant::from_nanos(new_tat);
        Ok(())
    }

    /// Moves the TAT back by the refunded cost, never before `now` (which is full
    /// capacity): a refund cannot raise the key above its burst. Exact at any time.
    fn refund(&self, state: &mut GcraState, now: Instant, _granted_at: Instant, amount: u64) {
        let back = state.tat.as_nanos().saturating_sub(amount.saturating_mul(self.interval_nanos()));
        state.tat = Instant::from_nanos(back).max(now.min(state.tat));
    }

    fn charge(&self, state: &mut GcraState, now: Instant, _granted_at: Instant, amount: u64) {
        let base = state.tat.max(now).as_nanos();
        state.tat = Instant::from_nanos(base.saturating_add(amount.saturating_mul(self.interval_nanos())));
    }

    fn peek(&self, state: &GcraState, now: Instant) -> Snapshot {
        let debt = state.tat.nanos_since(now);
        let (quota, window) = Snapshot::rate_quota(self.quota);
        Snapshot {
            quota,
            remaining: self.tolerance.saturating_sub(debt) / self.interval_nanos(),
            reset: Duration::from_nanos(debt),
            window,
        }
    }

    fn is_idle(&self, state: &GcraState, now: Instant) -> bool {
        state.tat <= now
    }
}
