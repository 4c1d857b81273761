//! The global states: one state per global limit, behind one lock.
//!
//! An acquisition takes this lock after the tenant's shard, never before. While a
//! lock-free path rules a global limit (see [`fast`](super::fast)), the limit's state
//! lives in its atomic instead, and the locked operations work on the atomic; the
//! one-limit path's refusal counts are moved into `counters` when a replace hands the state
//! back to the lock. A set whose one global limit lives in its atomic beside keyed limits
//! takes this lock only for those operations and for the global key.

use std::sync::{Arc, MutexGuard};

use super::fast::Fast;
use super::{Counters, Shared, lock};
use crate::limit::{Config, LimitState};
use crate::time::Instant;

/// The states of the global limits. In declared order (`repr(C)`), the states first: see
/// [`GlobalStates`].
#[repr(C)]
pub(super) struct Global {
    pub(super) states: GlobalStates,
    pub(super) config: Arc<Config>,
}

/// In declared order (`repr(C)`): what every grant writes besides the limits' states (the
/// latest instant, the count of grants) lies right after the lock's word, on its cache
/// line, as in a shard ([`Keyed`](super::shard::Keyed)).
#[repr(C)]
pub(super) struct GlobalStates {
    pub(super) latest: Instant,
    pub(super) counters: Counters,
    /// One state per limit of the config (unused for keyed limits).
    pub(super) states: Vec<LimitState>,
    /// The one-limit path's refusal counts already moved into `counters` (they never
    /// reset).
    pub(super) fast_base: (u64, u64),
}

impl Shared {
    pub(super) fn lock_global(&self) -> MutexGuard<'_, Global> {
        lock(&self.global.0)
    }

    /// The lock-free state, while it rules (stable under the global lock).
    #[inline]
    pub(super) fn fast_live(&self) -> Option<&Fast> {
        self.fast.as_ref().filter(|f| f.enabled())
    }

    /// The lock-free state of the global limit beside keyed ones, while it rules: stable
    /// under any one of the set's locks (a replace takes them all to change it).
    #[inline]
    pub(super) fn fast_global_live(&self) -> Option<&Fast> {
        self.fast_global.as_ref().filter(|f| f.enabled())
    }
}
