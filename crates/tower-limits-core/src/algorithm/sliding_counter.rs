//! The sliding-window counter: two counters, O(1), approximate.
//!
//! Time is cut into aligned windows of length `W`. The state keeps the count of the
//! current window and of the previous one, and estimates the usage of the last `W` as
//! `prev * (W - e) / W + curr`, where `e` is how far `now` is into the current window:
//! the previous window's count is assumed spread evenly across it. A request passes when
//! the estimate plus its cost is at most `limit`. All of this is computed multiplied
//! through by `W`, in 128-bit integers, so there is no division and no rounding.
//!
//! # Worst-case overshoot
//!
//! The estimate never undercounts the current window, so each aligned window admits at
//! most `limit`, and any span of length `T` admits at most `limit * (floor(T/W) + 2)`.
//! Within one window length the worst case is just under `2 * limit`: the previous
//! window's whole `limit` arrives in its last instant, the estimate then lets the
//! current window admit `limit * e / W` by the time `e`, and a window straddling the
//! boundary sees both. Under evenly spread traffic the estimate is exact. Use
//! [`SlidingWindowLog`](super::SlidingWindowLog) where the bound must be exact.

use std::time::Duration;

use super::{Algorithm, Refusal, Snapshot, window_nanos};
use crate::policy_error::PolicyError;
use crate::time::Instant;

/// About `limit` units per `window`, from two counters (see the module docs for the
/// worst case).
///
/// ```
/// use tower_limits_core::algorithm::{Algorithm, SlidingWindowCounter};
/// use tower_limits_core::Instant;
/// use std::time::Duration;
///
/// let counter = SlidingWindowCounter::new(100, Duration::from_secs(60)).unwrap();
/// let mut state = counter.fresh();
/// counter.acquire(&mut state, Instant::from_nanos(0), 100).unwrap();
/// // Halfway through the next window, half of the previous window still counts.
/// let later = Instant::from_nanos(90_000_000_000);
/// assert_eq!(counter.peek(&state, later).remaining, 50);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlidingWindowCounter {
    limit: u64,
    window: u64,
}

/// The state of one key under [`SlidingWindowCounter`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SlidingWindowCounterState {
    start: Instant,
    prev: u64,
    curr: u64,
}

/// A state brought forward to `now`: which window we are in and how far into it.
#[derive(Debug, Clone, Copy)]
struct View {
    start: u64,
    elapsed: u64,
    prev: u64,
    curr: u64,
}

impl SlidingWindowCounter {
    /// About `limit` units per `window`.
    ///
    /// # Errors
    /// A zero limit, or a window that is zero or longer than 2^62 nanoseconds (about 146
    /// years).
    pub fn new(limit: u64, window: Duration) -> Result<Self, PolicyError> {
        if limit == 0 {
            return Err(PolicyError::new("limit", "must be at least 1"));
        }
        let window = window_nanos(window)?;
        Ok(SlidingWindowCounter { limit, window })
    }

    /// The limit per window.
    #[must_use]
    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// The window.
    #[must_use]
    pub fn window(&self) -> Duration {
        Duration::from_nanos(self.window)
    }

    fn view(&self, s: &SlidingWindowCounterState, now: Instant) -> View {
        let now = now.as_nanos().max(s.start.as_nanos());
        let aligned = now - now % self.window;
        let start = s.start.as_nanos();
        let (prev, curr) = if aligned == start {
            (s.prev, s.curr)
        } else if aligned - start == self.window {
            (s.curr, 0)
        } else {
            (0, 0)
        };
        View { start: aligned, elapsed: now - aligned, prev, curr }
    }

    /// Whether `cost` fits with `prev` and `curr` at `elapsed` into a window.
    #[inline]
    fn fits(&self, prev: u64, curr: u64, elapsed: u64, cost: u64) -> bool {
        let w = u128::from(self.window);
        let used = u128::from(prev) * (w - u128::from(elapsed)) + (u128::from(curr) + u128::from(cost)) * w;
        used <= u128::from(self.limit) * w
    }

    /// The earliest offset into a window with counts `prev`, `curr` at which `cost`
    /// fits, if it fits before the window ends.
    fn earliest_in_window(&self, prev: u64, curr: u64, cost: u64) -> Option<u64> {
        let room = self.limit.checked_sub(curr)?.checked_sub(cost)?;
        if prev == 0 {
            return Some(0);
        }
        // prev * (W - e) <= room * W  <=>  W - e <= floor(room * W / prev)
        let slack = u128::from(room) * u128::from(self.window) / u128::from(prev);
        let e = u128::from(self.window).saturating_sub(slack);
        (e < u128::from(self.window)).then_some(e as u64)
    }
}

impl Algorithm for SlidingWindowCounter {
    type State = SlidingWindowCounterState;

    fn fresh(&self) -> SlidingWindowCounterState {
        SlidingWindowCounterState::default()
    }

    fn capacity(&self) -> u64 {
        self.limit
    }

    fn check(&self, state: &SlidingWindowCounterState, now: Instant, cost: u64) -> Result<(), Refusal> {
        if cost > self.limit {
            return Err(Refusal::Never { capacity: self.limit });
        }
        let v = self.view(state, now);
        if self.fits(v.prev, v.curr, v.elapsed, cost) {
            return Ok(());
        }
        let at = match self.earliest_in_window(v.prev, v.curr, cost) {
            Some(e) => v.start + e,
            None => match self.earliest_in_window(v.curr, 0, cost) {
                Some(e) => v.start + self.window + e,
                None => v.start + 2 * self.window,
            },
        };
        let now = v.start + v.elapsed;
        Err(Refusal::NotYet { retry_after: Some(Duration::from_nanos(at - now)) })
    }

    fn commit(&self, state: &mut SlidingWindowCounterState, now: Instant, cost: u64) {
        let v = self.view(state, now);
        *state = SlidingWindowCounterState {
            start: Instant::from_nanos(v.start),
            prev: v.prev,
            curr: v.curr.saturating_add(cost),
        };
    }

    /// Takes the amount off the count of the grant's window while that window is the
    /// current or the previous one; older windows no longer count.
    fn refund(&self, state: &mut SlidingWindowCounterState, now: Instant, granted_at: Instant, amount: u64) {
        self.adjust(state, now, granted_at, |c| c.saturating_sub(amount));
    }

    /// Adds the amount to the count of the grant's window, as for refunds.
    fn charge(&self, state: &mut SlidingWindowCounterState, now: Instant, granted_at: Instant, amount: u64) {
        self.adjust(state, now, granted_at, |c| c.saturating_add(amount));
    }

    fn peek(&self, state: &SlidingWindowCounterState, now: Instant) -> Snapshot {
        let v = self.view(state, now);
        let w = u128::from(self.window);
        let prev_part = u128::from(v.prev) * (w - u128::from(v.elapsed));
        let room = (u128::from(self.limit) * w).saturating_sub(prev_part) / w;
        let remaining = (room as u64).saturating_sub(v.curr);
        let reset = if v.curr > 0 {
            2 * self.window - v.elapsed
        } else if v.prev > 0 {
            self.window - v.elapsed
        } else {
            0
        };
        Snapshot {
            quota: self.limit,
            remaining,
            reset: Duration::from_nanos(reset),
            window: Duration::from_nanos(self.window),
        }
    }

    fn is_idle(&self, state: &SlidingWindowCounterState, now: Instant) -> bool {
        let v = self.view(state, now);
        v.prev == 0 && v.curr == 0
    }
}

impl SlidingWindowCounter {
    fn adjust(&self, state: &mut SlidingWindowCounterState, now: Instant, granted_at: Instant, f: impl Fn(u64) -> u64) {
        let v = self.view(state, now);
        let granted = granted_at.as_nanos() - granted_at.as_nanos() % self.window;
        let (mut prev, mut curr) = (v.prev, v.curr);
        if granted == v.start {
            curr = f(curr);
        } else if granted + self.window == v.start {
            prev = f(prev);
        }
        *state = SlidingWindowCounterState { start: Instant::from_nanos(v.start), prev, curr };
    }
}
