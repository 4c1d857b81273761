//! The fixed window: a counter reset at aligned window boundaries.
//!
//! Simple and cheap, and what many upstream providers implement, which is the reason to
//! use it: to mirror an upstream exactly. Across a boundary it admits up to twice the
//! limit within one window length (the end of one window and the start of the next).

use std::time::Duration;

use super::{Algorithm, Refusal, Snapshot, window_nanos};
use crate::policy_error::PolicyError;
use crate::time::Instant;

/// At most `limit` units per aligned window of length `window`.
///
/// ```
/// use tower_limits_core::algorithm::{Algorithm, FixedWindow, Refusal};
/// use tower_limits_core::Instant;
/// use std::time::Duration;
///
/// let fixed = FixedWindow::new(1, Duration::from_secs(60)).unwrap();
/// let mut state = fixed.fresh();
/// fixed.acquire(&mut state, Instant::from_nanos(15_000_000_000), 1).unwrap();
/// assert_eq!(
///     fixed.acquire(&mut state, Instant::from_nanos(20_000_000_000), 1),
///     Err(Refusal::NotYet { retry_after: Some(Duration::from_secs(40)) })
/// );
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FixedWindow {
    limit: u64,
    window: u64,
}

/// The state of one key under [`FixedWindow`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FixedWindowState {
    start: Instant,
    count: u64,
}

impl FixedWindow {
    /// At most `limit` units per aligned window of length `window`.
    ///
    /// # Errors
    /// A zero limit, or a window that is zero or longer than 2^62 nanoseconds (about 146
    /// years).
    pub fn new(limit: u64, window: Duration) -> Result<Self, PolicyError> {
        if limit == 0 {
            return Err(PolicyError::new("limit", "must be at least 1"));
        }
        let window = window_nanos(window)?;
        Ok(FixedWindow { limit, window })
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

    /// (window start, count in it, now) brought forward to `now`.
    fn view(&self, s: &FixedWindowState, now: Instant) -> (u64, u64, u64) {
        let now = now.as_nanos().max(s.start.as_nanos());
        let aligned = now - now % self.window;
        let count = if aligned == s.start.as_nanos() { s.count } else { 0 };
        (aligned, count, now)
    }

    fn adjust(&self, state: &mut FixedWindowState, now: Instant, granted_at: Instant, f: impl Fn(u64) -> u64) {
        let (start, count, _) = self.view(state, now);
        let granted = granted_at.as_nanos() - granted_at.as_nanos() % self.window;
        let count = if granted == start { f(count) } else { count };
        *state = FixedWindowState { start: Instant::from_nanos(start), count };
    }
}

impl Algorithm for FixedWindow {
    type State = FixedWindowState;

    fn fresh(&self) -> FixedWindowState {
        FixedWindowState::default()
    }

    fn capacity(&self) -> u64 {
        self.limit
    }

    fn check(&self, state: &FixedWindowState, now: Instant, cost: u64) -> Result<(), Refusal> {
        if cost > self.limit {
            return Err(Refusal::Never { capacity: self.limit });
        }
        let (start, count, now) = self.view(state, now);
        if count.saturating_add(cost) <= self.limit {
            Ok(())
        } else {
            Err(Refusal::NotYet { retry_after: Some(Duration::from_nanos(start + self.window - now)) })
        }
    }

    fn commit(&self, state: &mut FixedWindowState, now: Instant, cost: u64) {
        let (start, count, _) = self.view(state, now);
        *state = FixedWindowState { start: Instant::from_nanos(start), count: count.saturating_add(cost) };
    }

    /// Takes the amount off the count while the grant's window is the current one; after
    /// the boundary the count has been reset anyway.
    fn refund(&self, state: &mut FixedWindowState, now: Instant, granted_at: Instant, amount: u64) {
        self.adjust(state, now, granted_at, |c| c.saturating_sub(amount));
    }

    /// Adds the amount to the count while the grant's window is the current one.
    fn charge(&self, state: &mut FixedWindowState, now: Instant, granted_at: Instant, amount: u64) {
        self.adjust(state, now, granted_at, |c| c.saturating_add(amount));
    }

    fn peek(&self, state: &FixedWindowState, now: Instant) -> Snapshot {
        let (start, count, now) = self.view(state, now);
        let reset = if count > 0 { start + self.window - now } else { 0 };
        Snapshot {
            quota: self.limit,
            remaining: self.limit.saturating_sub(count),
            reset: Duration::from_nanos(reset),
            window: Duration::from_nanos(self.window),
        }
    }

    fn is_idle(&self, state: &FixedWindowState, now: Instant) -> bool {
        self.view(state, now).1 == 0
    }
}
