//! The backend seam: where the state of a limit set lives.
//!
//! The layers acquire through [`Backend`]. The in-memory [`LimitSet`] is one backend;
//! the Redis backend (crate `tower-limits-redis`) is another, evaluating the same
//! algorithms in one server-side script per acquisition. Both must pass the same
//! conformance suite.
//!
//! # The contract
//!
//! An implementation must guarantee, for every acquisition:
//!
//! 1. **All or nothing.** Either every limit of the set is charged, or none is. A denied
//!    acquisition leaves every limit's state as it was.
//! 2. **Linearizable per key.** Acquisitions, settles and releases touching the same
//!    (limit, key) states take effect in one total order consistent with real time; no
//!    two acquisitions both see the same remaining capacity.
//! 3. **One clock.** Every decision about one state uses one monotonic time source
//!    (the process clock in memory, the server's `TIME` on Redis), never the clocks of
//!    several callers.
//! 4. **Nothing lost.** A permit's concurrency comes back exactly once: on drop, on
//!    cancel, and, for backends that can lose contact with a holder, when its lease
//!    expires. Settling twice applies the difference once.
//! 5. **Exact refusals.** `CostAboveCapacity` is returned for a cost no state could
//!    ever grant; `Denied` carries the wait after which the same request would pass if
//!    nothing else happened, to the backend's clock resolution.

use std::future::Future;

use crate::error::AcquireError;
use crate::key::TenantKey;
use crate::set::{Grant, LimitSet, LimitSnapshot};
use crate::time::Instant;

/// Where the state of a limit set lives: in memory, or shared by a fleet.
///
/// A grant is plain data ([`Backend::Grant`]); the caller keeps the key and hands both
/// back to [`Backend::settle`], [`Backend::release`] or [`Backend::cancel`]. Exactly one
/// of `release` and `cancel` must be called for every grant. See the
/// [module docs](self) for the atomicity every implementation guarantees.
pub trait Backend: Clone + Send + Sync + 'static {
    /// What a grant remembers.
    type Grant: Send + Sync + 'static;
    /// The pending acquisition. In memory it is ready at once; callers poll it once
    /// before deciding to wait.
    type Acquire: Future<Output = Result<Self::Grant, AcquireError>> + Send + Unpin + 'static;

    /// Acquires every limit of the set for `key`, all or nothing. `now` is the caller's
    /// clock; a shared backend may use its own instead (see the contract).
    fn acquire(&self, key: &TenantKey, cost: u64, now: Instant) -> Self::Acquire;

    /// Corrects limits that count cost to the real usage.
    fn settle(&self, key: &TenantKey, grant: &mut Self::Grant, actual: u64, now: Instant);

    /// Releases the grant's concurrency, keeping what it charged.
    fn release(&self, key: &TenantKey, grant: Self::Grant);

    /// Refunds what the grant charged and releases it: for a request that did not happen.
    fn cancel(&self, key: &TenantKey, grant: Self::Grant, now: Instant);

    /// Whether [`Backend::release`] would do anything for this grant. When it would not,
    /// a caller that neither settles nor cancels may simply drop the grant.
    fn needs_release(&self, grant: &Self::Grant) -> bool {
        let _ = grant;
        true
    }

    /// Every limit's remaining capacity for `key`, as far as the backend knows it without
    /// waiting (a shared backend may answer from its last reply, or nothing).
    fn peek(&self, key: &TenantKey, now: Instant) -> Vec<LimitSnapshot> {
        let _ = (key, now);
        Vec::new()
    }
}

impl Backend for LimitSet {
    type Grant = Grant;
    type Acquire = std::future::Ready<Result<Grant, AcquireError>>;

    #[inline]
    fn acquire(&self, key: &TenantKey, cost: u64, now: Instant) -> Self::Acquire {
        std::future::ready(self.acquire_grant(key, cost, now))
    }

    fn settle(&self, key: &TenantKey, grant: &mut Grant, actual: u64, now: Instant) {
        self.settle_grant(key, grant, actual, now);
    }

    #[inline]
    fn release(&self, key: &TenantKey, grant: Grant) {
        self.release_grant(key, grant);
    }

    fn cancel(&self, key: &TenantKey, grant: Grant, now: Instant) {
        self.cancel_grant(key, grant, now);
    }

    #[inline]
    fn needs_release(&self, grant: &Grant) -> bool {
        grant.holds_concurrency()
    }

    fn peek(&self, key: &TenantKey, now: Instant) -> Vec<LimitSnapshot> {
        LimitSet::peek(self, key, now)
    }
}
