//! The limit algorithms: small state machines over plain data.
//!
//! Each algorithm is a value holding its validated parameters (a [`Gcra`], a
//! [`TokenBucket`], ...) and a separate, plain `State` per key. Every decision is a pure
//! function of the parameters, the state, `now` and the cost:
//!
//! - [`Algorithm::check`] answers whether `cost` fits at `now` **without changing the
//!   state**; a refusal is either [`Refusal::NotYet`] with the exact wait after which the
//!   same request would pass if nothing else happened, or [`Refusal::Never`] when the cost
//!   is above what the limit could ever grant (it is returned at once, never waited on).
//! - [`Algorithm::commit`] records a grant that `check` allowed. Splitting the two is what
//!   lets a [`LimitSet`](crate::LimitSet) check every limit first and write only when all
//!   of them pass.
//! - [`Algorithm::refund`] and [`Algorithm::charge`] correct a grant once the real usage
//!   is known; [`Algorithm::release`] gives back concurrency.
//! - [`Algorithm::peek`] reports remaining capacity and reset time for headers.
//! - [`Algorithm::is_idle`] says that a state decides exactly like a fresh one, so the
//!   key holding it can be forgotten without changing any decision.
//!
//! # Which algorithm
//!
//! | algorithm | state per key | exact? | refund | use for |
//! |---|---|---|---|---|
//! | [`Gcra`] | 8 bytes | yes: `rate*T + burst` in every window | yes | the default for rates |
//! | [`TokenBucket`] | 16 bytes | identical decisions to GCRA | yes | when you think in tokens |
//! | [`SlidingWindowLog`] | one entry per grant in the window | yes: `limit` in every window of length `window` | yes | hard "N per window" contracts |
//! | [`SlidingWindowCounter`] | 24 bytes | approximate: below `2*limit` in the worst case | within the last two windows | cheap "N per window" |
//! | [`FixedWindow`] | 16 bytes | `limit` per aligned window, `2*limit` across a boundary | within the current window | matching an upstream that counts that way |
//! | [`CalendarWindow`] | 24 bytes | `limit` per calendar period in a time zone | within the current period | budgets per day, week, month or year |
//! | [`Semaphore`] | 8 bytes | `capacity` held at once | n/a (release) | concurrency |

mod calendar_window;
mod fixed_window;
mod gcra;
mod semaphore;
mod sliding_counter;
mod sliding_log;
mod token_bucket;

use std::time::Duration;

pub use calendar_window::{CalendarPeriod, CalendarWindow, CalendarWindowState};
pub use fixed_window::{FixedWindow, FixedWindowState};
pub use gcra::{Gcra, GcraState};
pub use semaphore::{Semaphore, SemaphoreState};
pub use sliding_counter::{SlidingWindowCounter, SlidingWindowCounterState};
pub use sliding_log::{SlidingWindowLog, SlidingWindowLogState};
pub use token_bucket::{TokenBucket, TokenBucketState};

use crate::policy_error::PolicyError;
use crate::rate::Quota;
use crate::time::{Instant, duration_to_nanos};

pub(crate) use crate::time::MAX_SPAN_NANOS;

/// A window in nanoseconds, or the error naming the `window` field when it is zero or
/// longer than a limit can span.
pub(crate) fn window_nanos(window: Duration) -> Result<u64, PolicyError> {
    let nanos = duration_to_nanos(window);
    if nanos == 0 {
        return Err(PolicyError::new("window", "must be longer than zero"));
    }
    if nanos > MAX_SPAN_NANOS {
        return Err(PolicyError::new("window", format!("{window:?} is longer than the 146 years a limit can span")));
    }
    Ok(nanos)
}

/// Why a cost does not fit now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// Not now, but later. `retry_after` is the exact wait after which the same request
    /// passes if nothing else happens (a request one nanosecond earlier would not), or
    /// `None` when only a release of concurrency can make room.
    NotYet {
        /// The exact wait, or `None` for "when capacity is released".
        retry_after: Option<Duration>,
    },
    /// Never: the cost is above the most this limit can grant at once.
    Never {
        /// The most the limit can grant at once (its burst, limit or capacity).
        capacity: u64,
    },
}

/// Remaining capacity and reset time of one limit for one key: what the `RateLimit`
/// header fields report.
///
/// `quota` per `window` is the limit as the policy states it, the quota a user signed up
/// for: `limit` per `window` for the windowed limits, `amount` per `period` of the rate
/// for GCRA and the token bucket (see [`Snapshot::rate_quota`]), `capacity` for a
/// semaphore. `remaining` and `reset` are the state: what could be granted right now, and
/// when the limit is back to where it would be had nothing been granted. So `remaining`
/// of a GCRA or a token bucket is at most its burst, which may be far below its quota.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Snapshot {
    /// The quota per `window`: the policy's limit, the rate's amount (or the burst when it
    /// is larger), or a semaphore's capacity. Zero when no limit's state stands behind
    /// the snapshot (for example a pool whose every upstream is benched).
    pub quota: u64,
    /// What could be granted right now.
    pub remaining: u64,
    /// How long until the limit is back to its full quota if nothing else happens.
    pub reset: Duration,
    /// The time `quota` is counted over: the window of a windowed limit, the rate's period
    /// for GCRA and the token bucket (or the time to refill the burst when the burst is
    /// larger than the rate's amount), zero for a semaphore (concurrency has no window).
    pub window: Duration,
}

impl Snapshot {
    /// The quota and window that a rate limit of `quota` advertises: its rate's own
    /// `amount` per `period` (6,000 per minute stays 6,000 per minute, whatever its
    /// burst), or, when the burst is larger than the amount, the burst per the time it
    /// takes to refill (`burst * interval`), so that `remaining <= quota` always holds.
    /// Either way `quota / window` is the rate.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_limits_core::{Quota, Snapshot, nz};
    ///
    /// let minute = Duration::from_secs(60);
    /// assert_eq!(Snapshot::rate_quota(Quota::per_minute(nz!(6_000)).burst(nz!(600))), (6_000, minute));
    /// assert_eq!(Snapshot::rate_quota(Quota::per_minute(nz!(240)).burst(nz!(2))), (240, minute));
    /// // A burst above the amount: 100 per 10 s, still 10 per second.
    /// assert_eq!(Snapshot::rate_quota(Quota::per_second(nz!(10)).burst(nz!(100))), (100, Duration::from_secs(10)));
    /// ```
    #[must_use]
    #[inline]
    pub fn rate_quota(quota: Quota) -> (u64, Duration) {
        let burst = quota.max_burst();
        if burst <= quota.amount() {
            return (quota.amount(), quota.period());
        }
        (burst, Duration::from_nanos(quota.interval_nanos() * burst))
    }
}

/// A limit algorithm: parameters here, state per key elsewhere.
///
/// Implementations are deterministic: the same parameters, state, `now` and cost always
/// give the same answer. `now` is expected never to go backwards for one state; an
/// earlier `now` is treated as the latest time the state has seen.
pub trait Algorithm {
    /// The state of one key.
    type State: Clone + std::fmt::Debug + Send + 'static;

    /// The state of a key never used.
    fn fresh(&self) -> Self::State;

    /// The most this limit can grant at once: a larger cost is refused with
    /// [`Refusal::Never`].
    fn capacity(&self) -> u64;

    /// Whether `cost` fits at `now`. Never changes `state`.
    ///
    /// # Errors
    /// The [`Refusal`] when it does not fit.
    fn check(&self, state: &Self::State, now: Instant, cost: u64) -> Result<(), Refusal>;

    /// Records a grant of `cost` at `now`. Call only after [`Algorithm::check`] passed for
    /// the same state, `now` and cost.
    fn commit(&self, state: &mut Self::State, now: Instant, cost: u64);

    /// [`Algorithm::check`], then [`Algorithm::commit`] when it passes.
    ///
    /// # Errors
    /// The [`Refusal`] when the cost does not fit; the state is then unchanged.
    fn acquire(&self, state: &mut Self::State, now: Instant, cost: u64) -> Result<(), Refusal> {
        self.check(state, now, cost)?;
        self.commit(state, now, cost);
        Ok(())
    }

    /// Gives back `amount` of a grant made at `granted_at`, as far as the algorithm can:
    /// never above the full quota, and not at all once the grant has left the algorithm's
    /// memory (see each algorithm's docs).
    fn refund(&self, state: &mut Self::State, now: Instant, granted_at: Instant, amount: u64);

    /// Records `amount` more usage for a grant made at `granted_at` (the work is already
    /// done, so it is never refused; later requests wait for it).
    fn charge(&self, state: &mut Self::State, now: Instant, granted_at: Instant, amount: u64);

    /// Gives back concurrency held by a grant of `amount`. Only the semaphore holds
    /// anything; for rate algorithms this does nothing.
    fn release(&self, state: &mut Self::State, amount: u64) {
        let _ = (state, amount);
    }

    /// Remaining capacity and reset time at `now`, without consuming anything.
    fn peek(&self, state: &Self::State, now: Instant) -> Snapshot;

    /// Whether `state` decides exactly as [`Algorithm::fresh`] would from `now` on, so that
    /// forgetting the key changes no decision.
    fn is_idle(&self, state: &Self::State, now: Instant) -> bool;
}
