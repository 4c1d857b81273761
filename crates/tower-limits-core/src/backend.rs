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
//! 1. **All or nothing.** Either every limit of the set is charged, or none is. A refused
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
//!    ever grant; `Refused` carries the wait after which the same request would pass if
//!    nothing else happened, to the backend's clock resolution.
//!
//! # One pass per request
//!
//! An answer that carries `RateLimit` headers needs every limit's state as the decision
//! left it. [`Backend::acquire_observed`] returns them with the decision: in memory they
//! are read under the acquisition's own locks, in the same pass; a backend that cannot
//! do better gets the default, which acquires and then [peeks](Backend::peek) (the
//! Redis backend answers its peek from the acquisition's own reply).

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

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

    /// The acquisition's answer at once, for a backend that decides without waiting (in
    /// memory); `None` (the default) for one that must wait, whose
    /// [`acquire`](Backend::acquire) the caller then makes and polls. A caller that gets
    /// `Some` does not call `acquire` for the same request: the answer is the acquisition.
    ///
    /// The answer is returned where the caller matches it: no future is built around it
    /// and polled out of it, which would copy it twice on the way.
    ///
    /// ```
    /// use tower_limits_core::{Backend, Instant, LimitSet, Quota, TenantKey, nz};
    ///
    /// let set = LimitSet::gcra(Quota::per_second(nz!(1)));
    /// let everyone = TenantKey::global();
    /// assert!(matches!(set.acquire_now(&everyone, 1, Instant::ZERO), Some(Ok(_))));
    /// assert!(matches!(set.acquire_now(&everyone, 1, Instant::ZERO), Some(Err(_))));
    /// ```
    #[inline]
    fn acquire_now(&self, key: &TenantKey, cost: u64, now: Instant) -> Option<Result<Self::Grant, AcquireError>> {
        let _ = (key, cost, now);
        None
    }

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

    /// Acquires like [`Backend::acquire`] and returns, with the decision, every limit's
    /// state as the decision left it (for the answer's headers). The default acquires,
    /// then peeks; the in-memory [`LimitSet`] reads the states under the acquisition's
    /// own locks.
    fn acquire_observed(&self, key: &TenantKey, cost: u64, now: Instant) -> Observed<Self> {
        Observed::then_peek(self.acquire(key, cost, now), self.clone(), key.clone(), now)
    }

    /// How many parts of a key a limit scoped to `tier` keeps its state by (1 for the
    /// broadest tier), if the backend knows. Waiting requests use it to tell which
    /// releases can help them: with `None`, every release of the limit wakes them.
    fn tier_depth(&self, tier: &str) -> Option<usize> {
        let _ = tier;
        None
    }

    /// The first limit in shadow mode (in the order of the policy) that would have refused
    /// this grant, by name and tier; `None` when none would have, or the backend has no
    /// shadow limits (see [`LimitPolicy::shadow`](crate::LimitPolicy::shadow)).
    fn shadow_refusal(&self, grant: &Self::Grant) -> Option<(&'static str, Option<&'static str>)> {
        let _ = grant;
        None
    }

    /// Learns from what the upstream that served `grant` answered: a
    /// [`LimitPool`](crate::LimitPool) benches the member it chose, or lowers its mirror
    /// (see [`LimitPool::observe`](crate::LimitPool::observe)). Nothing by default: a
    /// backend that mirrors no upstream has nothing to learn.
    fn observe_upstream(&self, grant: &Self::Grant, report: &crate::UpstreamReport, now: Instant) {
        let _ = (grant, report, now);
    }
}

impl Backend for LimitSet {
    type Grant = Grant;
    type Acquire = std::future::Ready<Result<Grant, AcquireError>>;

    #[inline(always)]
    fn acquire(&self, key: &TenantKey, cost: u64, now: Instant) -> Self::Acquire {
        std::future::ready(self.acquire_grant(key, cost, now))
    }

    #[inline(always)]
    fn acquire_now(&self, key: &TenantKey, cost: u64, now: Instant) -> Option<Result<Grant, AcquireError>> {
        Some(self.acquire_grant(key, cost, now))
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

    fn acquire_observed(&self, key: &TenantKey, cost: u64, now: Instant) -> Observed<Self> {
        let (granted, seen) = LimitSet::acquire_observed(self, key, cost, now);
        Observed::ready(granted, seen)
    }

    fn tier_depth(&self, tier: &str) -> Option<usize> {
        LimitSet::tier_depth(self, tier)
    }

    #[inline]
    fn shadow_refusal(&self, grant: &Grant) -> Option<(&'static str, Option<&'static str>)> {
        // One compare on the common path: no shadow limit refused.
        if grant.shadowed == 0 { None } else { grant.shadow_refusals().next() }
    }
}

/// The future of [`Backend::acquire_observed`]: the decision, and every limit's state as
/// it left them.
///
/// ```
/// use tower_limits_core::{Backend, Instant, LimitSet, Quota, TenantKey, nz};
///
/// # tokio_test_block_on(async {
/// let set = LimitSet::gcra(Quota::per_second(nz!(10)).burst(nz!(3)));
/// let (granted, seen) = Backend::acquire_observed(&set, &TenantKey::global(), 1, Instant::ZERO).await;
/// assert!(granted.is_ok());
/// assert_eq!(seen[0].snapshot.remaining, 2);
/// # });
/// # fn tokio_test_block_on(f: impl std::future::Future<Output = ()>) {
/// #     let mut f = std::pin::pin!(f);
/// #     let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
/// #     assert!(f.as_mut().poll(&mut cx).is_ready(), "in memory it is ready at once");
/// # }
/// ```
#[must_use = "futures do nothing unless polled"]
pub struct Observed<B: Backend> {
    state: ObservedState<B>,
}

/// A decision, and the states it left.
type Decided<B> = (Result<<B as Backend>::Grant, AcquireError>, Vec<LimitSnapshot>);

enum ObservedState<B: Backend> {
    Ready(Option<Decided<B>>),
    Then { acquire: B::Acquire, backend: B, key: TenantKey, now: Instant },
    Unobserved(B::Acquire),
    Done,
}

impl<B: Backend> Observed<B> {
    /// A decision already made, with the states it left.
    pub fn ready(granted: Result<B::Grant, AcquireError>, seen: Vec<LimitSnapshot>) -> Self {
        Observed { state: ObservedState::Ready(Some((granted, seen))) }
    }

    /// An acquisition under way; once it is decided, `backend` is peeked for `key`.
    pub fn then_peek(acquire: B::Acquire, backend: B, key: TenantKey, now: Instant) -> Self {
        Observed { state: ObservedState::Then { acquire, backend, key, now } }
    }

    /// An acquisition under way whose states nobody wants: it ends with none.
    pub fn unobserved(acquire: B::Acquire) -> Self {
        Observed { state: ObservedState::Unobserved(acquire) }
    }
}

// Nothing in it is ever pinned: the acquisition is `Unpin`, the rest is plain data.
impl<B: Backend> Unpin for Observed<B> {}

impl<B: Backend> Future for Observed<B> {
    type Output = Decided<B>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let out = match &mut self.state {
            ObservedState::Ready(out) => out.take(),
            ObservedState::Then { acquire, backend, key, now } => {
                let granted = std::task::ready!(Pin::new(acquire).poll(cx));
                Some((granted, backend.peek(key, *now)))
            }
            ObservedState::Unobserved(acquire) => Some((std::task::ready!(Pin::new(acquire).poll(cx)), Vec::new())),
            ObservedState::Done => None,
        };
        self.state = ObservedState::Done;
        match out {
            Some(out) => Poll::Ready(out),
            None => Poll::Pending,
        }
    }
}

impl<B: Backend> fmt::Debug for Observed<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match self.state {
            ObservedState::Ready(_) => "ready",
            ObservedState::Then { .. } | ObservedState::Unobserved(_) => "acquiring",
            ObservedState::Done => "done",
        };
        f.debug_struct("Observed").field("state", &state).finish()
    }
}
