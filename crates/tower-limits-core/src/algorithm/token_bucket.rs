//! The token bucket.
//!
//! The bucket holds up to `burst` tokens and gains one every emission interval. To keep
//! it exact in integers the level is kept in nanoseconds of credit (`tokens * T`), so
//! refilling is adding elapsed time and a grant of cost `c` removes `c*T`. With the same
//! rate and burst it makes exactly the decisions of [`Gcra`](super::Gcra) (a law test
//! checks it): the two are the same algorithm seen from opposite ends, GCRA storing when
//! the debt ends, the bucket storing the credit and when it was last updated.

use std::time::Duration;

use super::{Algorithm, Refusal, Snapshot};
use crate::rate::Quota;
use crate::time::Instant;

/// A token bucket: a quota's burst of tokens, refilled at its rate.
///
/// ```
/// use tower_limits_core::algorithm::{Algorithm, TokenBucket};
/// use tower_limits_core::{Instant, Quota, nz};
///
/// let bucket = TokenBucket::new(Quota::per_second(nz!(100)));
/// let mut state = bucket.fresh();
/// bucket.acquire(&mut state, Instant::ZERO, 60).unwrap();
/// assert_eq!(bucket.peek(&state, Instant::ZERO).remaining, 40);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenBucket {
    quota: Quota,
    /// `burst * interval`: at most 2^62 nanoseconds, which a quota guarantees.
    capacity: i64,
}

/// The state of one key under [`TokenBucket`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenBucketState {
    /// Credit in nanoseconds (tokens × interval) at `last`. Negative after a charge beyond
    /// what was available: the debt is paid back by refill before anything passes.
    level: i64,
    last: Instant,
}

impl TokenBucket {
    /// A bucket of `quota`'s burst in tokens, refilled at its rate. A quota is valid by
    /// construction, so this cannot fail (see [`Gcra::new`](super::Gcra::new)).
    #[must_use]
    pub const fn new(quota: Quota) -> Self {
        TokenBucket { quota, capacity: (quota.interval_nanos() * quota.max_burst()) as i64 }
    }

    /// The quota: the refill rate, and the burst, the size of the bucket in tokens.
    #[must_use]
    pub const fn quota(&self) -> Quota {
        self.quota
    }

    #[inline]
    fn burst(&self) -> u64 {
        self.quota.max_burst()
    }

    #[inline]
    fn interval(&self) -> u64 {
        self.quota.interval_nanos()
    }

    /// The state that makes GCRA's decisions on theoretical arrival time `tat`: the
    /// bucket is full from `tat` on, and short of `tat - now` nanoseconds of credit
    /// before. (The two algorithms make the same decisions; this is the bijection of
    /// their states that a lock-free GCRA serving a bucket works through.)
    pub(crate) fn state_full_at(&self, tat: Instant) -> TokenBucketState {
        // Credit counted from the epoch: the level at `now` is `capacity - (tat - now)`,
        // capped at the capacity, exactly as long as `now` is below 2^62 ns.
        let level = i128::from(self.capacity) - i128::from(tat.as_nanos());
        TokenBucketState { level: i64::try_from(level).unwrap_or(i64::MIN), last: Instant::ZERO }
    }

    /// The instant from which `state` is full: GCRA's theoretical arrival time of the same
    /// debt (the inverse of [`TokenBucket::state_full_at`]).
    pub(crate) fn full_at(&self, state: &TokenBucketState) -> Instant {
        let tat = i128::from(state.last.as_nanos()) + i128::from(self.capacity) - i128::from(state.level);
        Instant::from_nanos(u64::try_from(tat.max(0)).unwrap_or(u64::MAX))
    }

    /// The level at `now` in nanoseconds of credit, refilled and capped.
    #[inline]
    fn level_at(&self, state: &TokenBucketState, now: Instant) -> i64 {
        let elapsed = now.nanos_since(state.last).min(1 << 62) as i64;
        state.level.saturating_add(elapsed).min(self.capacity)
    }

    #[inline]
    fn nanos(&self, amount: u64) -> i64 {
        amount.saturating_mul(self.interval()).min(1 << 62) as i64
    }
}

impl Algorithm for TokenBucket {
    type State = TokenBucketState;

    fn fresh(&self) -> TokenBucketState {
        TokenBucketState { level: self.capacity, last: Instant::ZERO }
    }

    fn capacity(&self) -> u64 {
        self.burst()
    }

    #[inline]
    fn check(&self, state: &TokenBucketState, now: Instant, cost: u64) -> Result<(), Refusal> {
        if cost > self.burst() {
            return Err(Refusal::Never { capacity: self.burst() });
        }
        let level = self.level_at(state, now);
        let need = self.nanos(cost);
        if need > level {
            // A charge beyond the bucket can leave a debt down to `i64::MIN`: saturate.
            Err(Refusal::NotYet { retry_after: Some(Duration::from_nanos(need.saturating_sub(level) as u64)) })
        } else {
            Ok(())
        }
    }

    #[inline]
    fn commit(&self, state: &mut TokenBucketState, now: Instant, cost: u64) {
        let level = self.level_at(state, now);
        state.level = level - self.nanos(cost);
        state.last = now.max(state.last);
    }

    /// Puts the tokens back, never above the bucket's size. Exact at any time.
    fn refund(&self, state: &mut TokenBucketState, now: Instant, _granted_at: Instant, amount: u64) {
        let level = self.level_at(state, now);
        state.level = level.saturating_add(self.nanos(amount)).min(self.capacity);
        state.last = now.max(state.last);
    }

    fn charge(&self, state: &mut TokenBucketState, now: Instant, _granted_at: Instant, amount: u64) {
        let level = self.level_at(state, now);
        state.level = level.saturating_sub(self.nanos(amount));
        state.last = now.max(state.last);
    }

    fn peek(&self, state: &TokenBucketState, now: Instant) -> Snapshot {
        let level = self.level_at(state, now);
        let (quota, window) = Snapshot::rate_quota(self.quota);
        Snapshot {
            quota,
            remaining: (level.max(0) as u64) / self.interval(),
            reset: Duration::from_nanos(self.capacity.saturating_sub(level) as u64),
            window,
        }
    }

    fn is_idle(&self, state: &TokenBucketState, now: Instant) -> bool {
        self.level_at(state, now) == self.capacity
    }
}
