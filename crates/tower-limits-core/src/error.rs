//! What an acquisition can answer besides a grant.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use crate::algorithm::Snapshot;

/// Why a [`LimitSet`](crate::LimitSet) acquisition was not granted.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum AcquireError {
    /// Not now: a limit is exhausted. Carries which one and when to retry.
    Refused(LimitRefusal),
    /// Never: the cost is above what a limit can grant at once. Waiting cannot help.
    CostAboveCapacity(CostAboveCapacity),
    /// The tenant key lacks a tier that a limit is keyed by.
    MissingTier(MissingTier),
    /// The bound on tracked keys is reached and no tracked key is idle.
    KeyTableFull(KeyTableFull),
    /// The backend holding the limits' state could not answer.
    Unavailable(Unavailable),
}

impl AcquireError {
    /// The refusal, if this is one.
    #[must_use]
    pub fn as_refusal(&self) -> Option<&LimitRefusal> {
        match self {
            AcquireError::Refused(d) => Some(d),
            _ => None,
        }
    }
}

impl fmt::Display for AcquireError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AcquireError::Refused(e) => e.fmt(f),
            AcquireError::CostAboveCapacity(e) => e.fmt(f),
            AcquireError::MissingTier(e) => e.fmt(f),
            AcquireError::KeyTableFull(e) => e.fmt(f),
            AcquireError::Unavailable(e) => e.fmt(f),
        }
    }
}

impl std::error::Error for AcquireError {}

impl From<SetError> for AcquireError {
    #[inline]
    fn from(e: SetError) -> Self {
        match e {
            SetError::Refused(d) => AcquireError::Refused(d),
            SetError::CostAboveCapacity(c) => AcquireError::CostAboveCapacity(c),
            SetError::MissingTier(m) => AcquireError::MissingTier(m),
            SetError::KeyTableFull(k) => AcquireError::KeyTableFull(k),
        }
    }
}

/// Why a [`LimitSet`](crate::LimitSet) in this process refused: every
/// [`AcquireError`] but [`AcquireError::Unavailable`], which only a remote backend
/// answers. What [`LimitSet::check`](crate::LimitSet::check) returns.
///
/// A plain value (`Copy`, nothing to drop), so a caller that only asks whether it was
/// refused pays nothing for the refusal's fields. `?` makes it an [`AcquireError`].
///
/// ```
/// use tower_limits_core::{AcquireError, Instant, LimitSet, Quota, SetError, TenantKey, nz};
///
/// let set = LimitSet::gcra(Quota::per_second(nz!(1)));
/// let everyone = TenantKey::global();
/// assert!(set.check(&everyone, 1, Instant::ZERO).is_ok());
/// let refused: SetError = set.check(&everyone, 1, Instant::ZERO).unwrap_err();
/// assert_eq!(refused.as_refusal().map(|d| d.retry_after().as_secs()), Some(1));
/// assert!(matches!(AcquireError::from(refused), AcquireError::Refused(_)));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum SetError {
    /// Not now: a limit is exhausted. Carries which one and when to retry.
    Refused(LimitRefusal),
    /// Never: the cost is above what a limit can grant at once. Waiting cannot help.
    CostAboveCapacity(CostAboveCapacity),
    /// The tenant key lacks a tier that a limit is keyed by.
    MissingTier(MissingTier),
    /// The bound on tracked keys is reached and no tracked key is idle.
    KeyTableFull(KeyTableFull),
}

impl SetError {
    /// The refusal, if this is one.
    ///
    /// ```
    /// use tower_limits_core::{Instant, LimitSet, Quota, TenantKey, nz};
    ///
    /// let set = LimitSet::gcra(Quota::per_second(nz!(1)));
    /// let everyone = TenantKey::global();
    /// let too_much = set.check(&everyone, 2, Instant::ZERO).unwrap_err();
    /// assert!(too_much.as_refusal().is_none(), "a cost above the burst is never granted");
    /// ```
    #[must_use]
    pub fn as_refusal(&self) -> Option<&LimitRefusal> {
        match self {
            SetError::Refused(d) => Some(d),
            _ => None,
        }
    }
}

impl fmt::Display for SetError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SetError::Refused(e) => e.fmt(f),
            SetError::CostAboveCapacity(e) => e.fmt(f),
            SetError::MissingTier(e) => e.fmt(f),
            SetError::KeyTableFull(e) => e.fmt(f),
        }
    }
}

impl std::error::Error for SetError {}

/// A limit is exhausted for now.
///
/// Names the limit that blocked (when several did, the one that frees last) and carries
/// the exact wait after which every limit of the set would pass if nothing else happened.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct LimitRefusal {
    pub(crate) name: &'static str,
    pub(crate) tier: Option<&'static str>,
    pub(crate) limit: usize,
    /// The times are kept in nanoseconds and made [`Duration`]s by the accessors: a
    /// refusal that nobody reads the times of costs no division.
    pub(crate) retry_nanos: u64,
    pub(crate) needs_release: bool,
    pub(crate) quota: u64,
    pub(crate) remaining: u64,
    pub(crate) reset_nanos: u64,
    pub(crate) window_nanos: u64,
}

/// A duration in nanoseconds, saturating (at 584 years).
#[inline]
pub(crate) fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

impl LimitRefusal {
    /// A refusal decided by a backend outside this crate (the Redis backend evaluates the
    /// same algorithms in a server-side script). `limit` is the blocking limit's index in
    /// the policy; the other fields are as their accessors describe.
    #[must_use]
    pub fn new(
        name: &'static str,
        tier: Option<&'static str>,
        limit: usize,
        retry_after: Duration,
        needs_release: bool,
        snapshot: Snapshot,
    ) -> Self {
        LimitRefusal {
            name,
            tier,
            limit,
            retry_nanos: nanos(retry_after),
            needs_release,
            quota: snapshot.quota,
            remaining: snapshot.remaining,
            reset_nanos: nanos(snapshot.reset),
            window_nanos: nanos(snapshot.window),
        }
    }

    /// Every upstream of a pool refused and is benched for `wait`.
    pub(crate) fn upstream(wait: Duration) -> Self {
        LimitRefusal::new(
            "upstream",
            None,
            0,
            wait,
            false,
            Snapshot { quota: 0, remaining: 0, reset: wait, window: Duration::ZERO },
        )
    }

    /// The name of the limit that blocked (names live as long as the process).
    #[must_use]
    pub fn limit(&self) -> &'static str {
        self.name
    }

    /// The index of the limit that blocked, in the order of the policy.
    #[must_use]
    pub fn limit_index(&self) -> usize {
        self.limit
    }

    /// The tier the blocking limit is keyed by; `None` for a global limit.
    #[must_use]
    pub fn tier(&self) -> Option<&'static str> {
        self.tier
    }

    /// Whether the blocking limit is shared by every tenant (a global limit): shared
    /// overload rather than the tenant's own quota.
    #[must_use]
    pub fn is_global(&self) -> bool {
        self.tier.is_none()
    }

    /// The exact wait after which every rate limit of the set would pass the same
    /// request, if nothing else happened. Zero when only concurrency blocked.
    #[must_use]
    pub fn retry_after(&self) -> Duration {
        Duration::from_nanos(self.retry_nanos)
    }

    /// Whether a concurrency limit (a semaphore) also has to release capacity before the
    /// request can pass; its timing is unknown.
    #[must_use]
    pub fn needs_release(&self) -> bool {
        self.needs_release
    }

    /// The blocking limit's quota, remaining capacity and reset time, for headers.
    #[must_use]
    pub fn snapshot(&self) -> Snapshot {
        Snapshot {
            quota: self.quota,
            remaining: self.remaining,
            reset: Duration::from_nanos(self.reset_nanos),
            window: Duration::from_nanos(self.window_nanos),
        }
    }
}

impl fmt::Debug for LimitRefusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LimitRefusal")
            .field("limit", &self.limit())
            .field("tier", &self.tier())
            .field("retry_after", &self.retry_after())
            .field("needs_release", &self.needs_release)
            .field("snapshot", &self.snapshot())
            .finish()
    }
}

impl fmt::Display for LimitRefusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rate limited by {:?}", self.limit())?;
        if let Some(tier) = self.tier() {
            write!(f, " (tier {tier})")?;
        }
        if self.retry_nanos > 0 {
            write!(f, ", retry after {:?}", self.retry_after())?;
        }
        if self.needs_release {
            f.write_str(", waiting for concurrency to be released")?;
        }
        Ok(())
    }
}

/// A cost above what a limit can ever grant at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CostAboveCapacity {
    pub(crate) limit: &'static str,
    pub(crate) tier: Option<&'static str>,
    pub(crate) cost: u64,
    pub(crate) capacity: u64,
}

impl CostAboveCapacity {
    /// A refusal decided by a backend outside this crate: `cost` asked of the limit
    /// `limit` (keyed by `tier`), which can grant at most `capacity` at once.
    #[must_use]
    pub fn new(limit: &'static str, tier: Option<&'static str>, cost: u64, capacity: u64) -> Self {
        CostAboveCapacity { limit, tier, cost, capacity }
    }

    /// The name of the limit.
    #[must_use]
    pub fn limit(&self) -> &'static str {
        self.limit
    }

    /// The tier it is keyed by; `None` for a global limit.
    #[must_use]
    pub fn tier(&self) -> Option<&'static str> {
        self.tier
    }

    /// The cost asked for.
    #[must_use]
    pub fn cost(&self) -> u64 {
        self.cost
    }

    /// The most the limit can grant at once.
    #[must_use]
    pub fn capacity(&self) -> u64 {
        self.capacity
    }
}

impl fmt::Display for CostAboveCapacity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "cost {} is above the capacity {} of limit {:?}, so it can never be granted",
            self.cost, self.capacity, self.limit
        )
    }
}

/// The tenant key lacks a tier some limit is keyed by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MissingTier {
    pub(crate) tier: &'static str,
}

impl MissingTier {
    /// A refusal decided by a backend outside this crate: the key lacks `tier`.
    #[must_use]
    pub fn new(tier: &'static str) -> Self {
        MissingTier { tier }
    }

    /// The first tier the key lacks.
    #[must_use]
    pub fn tier(&self) -> &str {
        self.tier
    }
}

impl fmt::Display for MissingTier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "the tenant key has no {:?} tier, which a limit is keyed by", self.tier)
    }
}

/// The bound on tracked keys is reached and none of them is idle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyTableFull {
    pub(crate) max_keys: usize,
}

impl KeyTableFull {
    /// The configured bound.
    #[must_use]
    pub fn max_keys(&self) -> usize {
        self.max_keys
    }
}

impl fmt::Display for KeyTableFull {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "too many active keys: the table of at most {} keys has no idle key to evict", self.max_keys)
    }
}

/// The backend holding the state could not answer (for example Redis is unreachable).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unavailable {
    message: Arc<str>,
}

impl Unavailable {
    /// An unavailability with a message for operators.
    pub fn new(message: impl Into<Arc<str>>) -> Self {
        Unavailable { message: message.into() }
    }

    /// The message.
    #[must_use]
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl fmt::Display for Unavailable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "limit backend unavailable: {}", self.message)
    }
}
