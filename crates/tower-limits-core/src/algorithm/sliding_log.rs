//! The sliding-window log: exact, at the price of one entry per grant.
//!
//! The log remembers every grant still inside the window (merging grants made at the
//! same instant), so it knows exactly what was admitted in the last `window` and never
//! admits more than `limit` in any window of that length. Memory per key is bounded by
//! the limit: every entry holds a cost of at least one, and the entries inside the window
//! add up to at most `limit` (plus whatever was charged by settling beyond estimates).

use std::collections::VecDeque;
use std::time::Duration;

use super::{Algorithm, Refusal, Snapshot, window_nanos};
use crate::policy_error::PolicyError;
use crate::time::Instant;

/// At most `limit` units in any window of length `window`, exactly.
///
/// ```
/// use tower_limits_core::algorithm::{Algorithm, Refusal, SlidingWindowLog};
/// use tower_limits_core::Instant;
/// use std::time::Duration;
///
/// let log = SlidingWindowLog::new(2, Duration::from_secs(10)).unwrap();
/// let mut state = log.fresh();
/// log.acquire(&mut state, Instant::from_nanos(0), 1).unwrap();
/// log.acquire(&mut state, Instant::from_nanos(4_000_000_000), 1).unwrap();
/// // Full until the first grant leaves the window, ten seconds after it was made.
/// assert_eq!(
///     log.acquire(&mut state, Instant::from_nanos(5_000_000_000), 1),
///     Err(Refusal::NotYet { retry_after: Some(Duration::from_secs(5)) })
/// );
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlidingWindowLog {
    limit: u64,
    window: u64,
}

/// The state of one key under [`SlidingWindowLog`]: the grants still in the window.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SlidingWindowLogState {
    entries: VecDeque<(Instant, u64)>,
}

impl SlidingWindowLogState {
    /// How many entries the log holds (grants at distinct instants, not yet pruned).
    #[must_use]
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether the log holds no entry.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

impl SlidingWindowLog {
    /// At most `limit` units in any window of length `window`.
    ///
    /// # Errors
    /// A zero limit, or a window that is zero or longer than 2^62 nanoseconds (about 146
    /// years).
    pub fn new(limit: u64, window: Duration) -> Result<Self, PolicyError> {
        if limit == 0 {
            return Err(PolicyError::new("limit", "must be at least 1"));
        }
        let window = window_nanos(window)?;
        Ok(SlidingWindowLog { limit, window })
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

    /// Whether an entry made at `at` still counts at `now`.
    #[inline]
    fn live(&self, at: Instant, now: Instant) -> bool {
        at.as_nanos().saturating_add(self.window) > now.as_nanos()
    }

    /// The index of the first live entry and the sum of the live entries.
    fn live_part(&self, state: &SlidingWindowLogState, now: Instant) -> (usize, u64) {
        let first = state.entries.partition_point(|&(at, _)| !self.live(at, now));
        let sum = state.entries.range(first..).map(|&(_, c)| c).fold(0u64, u64::saturating_add);
        (first, sum)
    }

    fn prune(&self, state: &mut SlidingWindowLogState, now: Instant) {
        while let Some(&(at, _)) = state.entries.front() {
            if self.live(at, now) {
                break;
            }
            state.entries.pop_front();
        }
    }

    /// `now`, but never before the newest entry, so the log stays sorted.
    fn clamp(state: &SlidingWindowLogState, now: Instant) -> Instant {
        state.entries.back().map_or(now, |&(at, _)| now.max(at))
    }
}

impl Algorithm for SlidingWindowLog {
    type State = SlidingWindowLogState;

    fn fresh(&self) -> SlidingWindowLogState {
        SlidingWindowLogState::default()
    }

    fn capacity(&self) -> u64 {
        self.limit
    }

    fn check(&self, state: &SlidingWindowLogState, now: Instant, cost: u64) -> Result<(), Refusal> {
        if cost > self.limit {
            return Err(Refusal::Never { capacity: self.limit });
        }
        let now = Self::clamp(state, now);
        let (first, sum) = self.live_part(state, now);
        let over = sum.saturating_add(cost).saturating_sub(self.limit);
        if over == 0 {
            return Ok(());
        }
        // Walk the live entries oldest first until enough of them have left the window.
        let mut freed = 0u64;
        for &(at, c) in state.entries.range(first..) {
            freed = freed.saturating_add(c);
            if freed >= over {
                let leaves = at.as_nanos().saturating_add(self.window);
                return Err(Refusal::NotYet { retry_after: Some(Duration::from_nanos(leaves - now.as_nanos())) });
            }
        }
        // Unreachable while cost <= limit: all live entries leaving frees `sum`.
        Err(Refusal::NotYet { retry_after: Some(Duration::from_nanos(self.window)) })
    }

    fn commit(&self, state: &mut SlidingWindowLogState, now: Instant, cost: u64) {
        let now = Self::clamp(state, now);
        self.prune(state, now);
        if cost == 0 {
            return;
        }
        match state.entries.back_mut() {
            Some((at, c)) if *at == now => *c = c.saturating_add(cost),
            _ => state.entries.push_back((now, cost)),
        }
    }

    /// Takes the amount off the grant's own entry while it is still in the window; once
    /// it has left, there is nothing to give back (its cost no longer counts anyway).
    fn refund(&self, state: &mut SlidingWindowLogState, now: Instant, granted_at: Instant, amount: u64) {
        self.prune(state, Self::clamp(state, now));
        if let Ok(i) = state.entries.binary_search_by_key(&granted_at, |&(at, _)| at) {
            let c = &mut state.entries[i].1;
            *c = c.saturating_sub(amount);
            if *c == 0 {
                state.entries.remove(i);
            }
        }
    }

    /// Adds the amount to the grant's own entry while it is in the window; a grant that
    /// has left the window no longer counts, so neither does its extra.
    fn charge(&self, state: &mut SlidingWindowLogState, now: Instant, granted_at: Instant, amount: u64) {
        let now = Self::clamp(state, now);
        self.prune(state, now);
        if amount == 0 || !self.live(granted_at, now) {
            return;
        }
        match state.entries.binary_search_by_key(&granted_at, |&(at, _)| at) {
            Ok(i) => state.entries[i].1 = state.entries[i].1.saturating_add(amount),
            Err(i) => state.entries.insert(i, (granted_at, amount)),
        }
    }

    fn peek(&self, state: &SlidingWindowLogState, now: Instant) -> Snapshot {
        let now = Self::clamp(state, now);
        let (_, sum) = self.live_part(state, now);
        let reset = match state.entries.back() {
            Some(&(at, _)) if self.live(at, now) => at.as_nanos() + self.window - now.as_nanos(),
            _ => 0,
        };
        Snapshot {
            quota: self.limit,
            remaining: self.limit.saturating_sub(sum),
            reset: Duration::from_nanos(reset),
            window: Duration::from_nanos(self.window),
        }
    }

    fn is_idle(&self, state: &SlidingWindowLogState, now: Instant) -> bool {
        state.entries.back().is_none_or(|&(at, _)| !self.live(at, now))
    }
}
