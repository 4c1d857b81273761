//! The resource semaphore: concurrency as a limit.
//!
//! Capacity is a number of permits; a grant of cost `c` holds `c` of them until it is
//! released. Time plays no part, so a refusal never carries a wait: only a release makes
//! room. Refund and charge do nothing: what a semaphore counts is what is held now, and
//! that is given back by release (a [`Permit`](crate::Permit) releases on drop).

use std::time::Duration;

use super::{Algorithm, Refusal, Snapshot};
use crate::policy_error::PolicyError;
use crate::time::Instant;

/// At most `capacity` permits held at once; acquisitions may take several.
///
/// ```
/// use tower_limits_core::algorithm::{Algorithm, Refusal, Semaphore};
/// use tower_limits_core::Instant;
///
/// let sem = Semaphore::new(2).unwrap();
/// let mut state = sem.fresh();
/// sem.acquire(&mut state, Instant::ZERO, 2).unwrap();
/// assert_eq!(sem.acquire(&mut state, Instant::ZERO, 1), Err(Refusal::NotYet { retry_after: None }));
/// sem.release(&mut state, 2);
/// assert!(sem.is_idle(&state, Instant::ZERO));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Semaphore {
    capacity: u64,
}

/// The state of one key under [`Semaphore`]: how many permits are held.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SemaphoreState {
    held: u64,
}

impl SemaphoreState {
    /// Permits held now.
    #[must_use]
    pub fn held(&self) -> u64 {
        self.held
    }
}

impl Semaphore {
    /// A semaphore of `capacity` permits.
    ///
    /// # Errors
    /// A zero capacity.
    pub fn new(capacity: u64) -> Result<Self, PolicyError> {
        if capacity == 0 {
            return Err(PolicyError::new("capacity", "must be at least 1"));
        }
        Ok(Semaphore { capacity })
    }
}

impl Algorithm for Semaphore {
    type State = SemaphoreState;

    fn fresh(&self) -> SemaphoreState {
        SemaphoreState::default()
    }

    fn capacity(&self) -> u64 {
        self.capacity
    }

    #[inline]
    fn check(&self, state: &SemaphoreState, _now: Instant, cost: u64) -> Result<(), Refusal> {
        if cost > self.capacity {
            Err(Refusal::Never { capacity: self.capacity })
        } else if state.held.checked_add(cost).is_none_or(|total| total > self.capacity) {
            Err(Refusal::NotYet { retry_after: None })
        } else {
            Ok(())
        }
    }

    #[inline]
    fn commit(&self, state: &mut SemaphoreState, _now: Instant, cost: u64) {
        state.held = state.held.saturating_add(cost);
    }

    fn refund(&self, _state: &mut SemaphoreState, _now: Instant, _granted_at: Instant, _amount: u64) {}

    fn charge(&self, _state: &mut SemaphoreState, _now: Instant, _granted_at: Instant, _amount: u64) {}

    #[inline]
    fn release(&self, state: &mut SemaphoreState, amount: u64) {
        debug_assert!(amount <= state.held, "released more permits than held");
        state.held = state.held.saturating_sub(amount);
    }

    fn peek(&self, state: &SemaphoreState, _now: Instant) -> Snapshot {
        Snapshot {
            quota: self.capacity,
            remaining: self.capacity.saturating_sub(state.held),
            reset: Duration::ZERO,
            window: Duration::ZERO,
        }
    }

    fn is_idle(&self, state: &SemaphoreState, _now: Instant) -> bool {
        state.held == 0
    }
}
