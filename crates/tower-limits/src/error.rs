//! The error a limit layer answers with instead of calling the inner service.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use tower_limits_core::{AcquireError, LimitSnapshot, Snapshot};

/// A boxed error, as tower middleware passes them on.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// What kind of refusal a [`LimitError`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// A rate limit is exhausted for now ([`LimitError::retry_after`] says until when).
    RateLimited,
    /// A concurrency limit is full; only a release makes room.
    ConcurrencyLimited,
    /// The tenant's own queue is full (weighted-fair queue).
    TenantQueueFull,
    /// The shared queue is full (weighted-fair queue).
    QueueFull,
    /// The request waited as long as it was allowed to.
    WaitTimedOut,
    /// The request's cost is above what a limit can ever grant: it will never pass.
    CostAboveCapacity,
    /// The request carries no tenant key for the limits.
    MissingKey,
    /// The key's source is not wired into the server, so no request carries it (for
    /// example [`PeerIp`](crate::extract::PeerIp) on a server that never records the
    /// peer's address): the server's setup error, with the fix in
    /// [`LimitError::detail`]. HTTP `500`.
    KeySourceMissing,
    /// The key table is full of active keys.
    KeyTableFull,
    /// The backend holding the limits could not answer.
    Unavailable,
}

/// Why a limit layer refused a request: which limit and tier, when to retry, and the
/// numbers for the `RateLimit` header fields.
///
/// With the `http` feature, [`LimitError::status`] and
/// [`crate::http::HttpAnswer`] turn it into a `429` or `503` response.
#[derive(Clone)]
pub struct LimitError {
    pub(crate) kind: ErrorKind,
    pub(crate) limit: Option<&'static str>,
    pub(crate) tier: Option<&'static str>,
    pub(crate) retry_after: Option<Duration>,
    pub(crate) snapshot: Option<Snapshot>,
    pub(crate) detail: Option<Arc<str>>,
    pub(crate) snapshots: Option<Arc<[LimitSnapshot]>>,
}

impl LimitError {
    pub(crate) fn new(kind: ErrorKind) -> Self {
        LimitError { kind, limit: None, tier: None, retry_after: None, snapshot: None, detail: None, snapshots: None }
    }

    pub(crate) fn with_detail(mut self, detail: impl Into<Arc<str>>) -> Self {
        self.detail = Some(detail.into());
        self
    }

    /// What kind of refusal this is.
    #[must_use]
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// The name of the limit that refused, when one did.
    #[must_use]
    pub fn limit(&self) -> Option<&str> {
        self.limit
    }

    /// The tier that limit is keyed by; `None` for a global limit or no limit.
    #[must_use]
    pub fn tier(&self) -> Option<&str> {
        self.tier
    }

    /// How long to wait before the same request would pass, when that is known.
    #[must_use]
    pub fn retry_after(&self) -> Option<Duration> {
        self.retry_after
    }

    /// Whether the refusal is about the server's own capacity rather than the caller's
    /// pace: a global concurrency limit, the shared queue (full, or waited on too long),
    /// the key table, the backend. HTTP 503 rather than 429. A rate limit, global or
    /// keyed, is never the server's capacity: it paces callers (429).
    #[must_use]
    pub fn is_shared(&self) -> bool {
        match self.kind {
            ErrorKind::RateLimited => false,
            ErrorKind::ConcurrencyLimited | ErrorKind::WaitTimedOut => self.limit.is_some() && self.tier.is_none(),
            ErrorKind::QueueFull | ErrorKind::KeyTableFull | ErrorKind::Unavailable | ErrorKind::KeySourceMissing => {
                true
            }
            ErrorKind::TenantQueueFull | ErrorKind::CostAboveCapacity | ErrorKind::MissingKey => false,
        }
    }

    /// Quota, remaining and reset of the limit that refused, for the `RateLimit` fields.
    #[must_use]
    pub fn snapshot(&self) -> Option<Snapshot> {
        self.snapshot
    }

    /// Every limit's state for the request's key, when the layer was asked to report them
    /// (for the `x-ratelimit-*` family).
    #[must_use]
    pub fn snapshots(&self) -> Option<&[LimitSnapshot]> {
        self.snapshots.as_deref()
    }

    /// More words for operators (why a key was missing, what the backend said).
    #[must_use]
    pub fn detail(&self) -> Option<&str> {
        self.detail.as_deref()
    }
}

impl From<AcquireError> for LimitError {
    fn from(e: AcquireError) -> Self {
        match e {
            AcquireError::Refused(d) => LimitError {
                kind: if d.retry_after() == Duration::ZERO && d.needs_release() {
                    ErrorKind::ConcurrencyLimited
                } else {
                    ErrorKind::RateLimited
                },
                limit: Some(d.limit()),
                tier: d.tier(),
                retry_after: (d.retry_after() > Duration::ZERO).then_some(d.retry_after()),
                snapshot: Some(d.snapshot()),
                detail: None,
                snapshots: None,
            },
            AcquireError::CostAboveCapacity(c) => {
                LimitError { limit: Some(c.limit()), tier: c.tier(), ..LimitError::new(ErrorKind::CostAboveCapacity) }
                    .with_detail(c.to_string())
            }
            AcquireError::MissingTier(m) => LimitError::new(ErrorKind::MissingKey).with_detail(m.to_string()),
            AcquireError::KeyTableFull(k) => LimitError::new(ErrorKind::KeyTableFull).with_detail(k.to_string()),
            AcquireError::Unavailable(u) => LimitError::new(ErrorKind::Unavailable).with_detail(u.to_string()),
            other => LimitError::new(ErrorKind::Unavailable).with_detail(other.to_string()),
        }
    }
}

impl fmt::Debug for LimitError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LimitError")
            .field("kind", &self.kind)
            .field("limit", &self.limit)
            .field("tier", &self.tier)
            .field("retry_after", &self.retry_after)
            .field("detail", &self.detail)
            .finish()
    }
}

impl fmt::Display for LimitError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let what = match self.kind {
            ErrorKind::RateLimited => "rate limited",
            ErrorKind::ConcurrencyLimited => "too many concurrent requests",
            ErrorKind::TenantQueueFull => "the tenant's queue is full",
            ErrorKind::QueueFull => "the queue is full",
            ErrorKind::WaitTimedOut => "waited too long for capacity",
            ErrorKind::CostAboveCapacity => "request cost above the limit's capacity",
            ErrorKind::MissingKey => "no tenant key",
            ErrorKind::KeySourceMissing => "the server provides no tenant key",
            ErrorKind::KeyTableFull => "too many active keys",
            ErrorKind::Unavailable => "limits unavailable",
        };
        f.write_str(what)?;
        if let Some(limit) = self.limit {
            write!(f, " by {limit:?}")?;
            if let Some(tier) = self.tier {
                write!(f, " (tier {tier})")?;
            }
        }
        if let Some(wait) = self.retry_after {
            write!(f, ", retry after {}ms", wait.as_millis())?;
        }
        Ok(())
    }
}

impl std::error::Error for LimitError {}
