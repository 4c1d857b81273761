//! What a grant remembers: where it came from (Redis, or the failure policy) and, for a
//! grant from Redis, the server time and holder id that its settle, release or cancel
//! send back, and the settle it must wait for so that settles apply in order.

use std::fmt;
use std::sync::Arc;

use tokio::sync::oneshot;

/// Where a grant came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GrantSource {
    /// Granted by Redis: shared by the fleet.
    Redis,
    /// Admitted without limits while Redis was unavailable ([`FailurePolicy::FailOpen`](crate::FailurePolicy::FailOpen)).
    FailOpen,
    /// Granted by the local fallback limiter ([`FailurePolicy::Fallback`](crate::FailurePolicy::Fallback)).
    Fallback,
    /// Granted from this replica's capacity shares alone, without a round trip
    /// ([`Shares`](crate::Shares)). A grant that also took from a pool, for a scope
    /// where this replica holds no share, is [`GrantSource::Redis`].
    Share,
}

/// A grant from a [`RedisBackend`](super::RedisBackend): plain data, handed back to
/// [`Backend::settle`](tower_limits_core::Backend::settle), [`Backend::release`](tower_limits_core::Backend::release) or
/// [`Backend::cancel`](tower_limits_core::Backend::cancel).
#[must_use = "a grant holds concurrency until it is released"]
pub struct RedisGrant {
    pub(super) kind: GrantKind,
}

pub(super) enum GrantKind {
    Remote(Remote),
    Shared(super::shares::SharedGrant),
    Open,
    Local(tower_limits_core::Grant),
}

pub(super) struct Remote {
    /// The server time of the grant: whole microseconds and the nanoseconds below.
    pub(super) us: u64,
    pub(super) sub: u64,
    /// The grant's number in this backend, and its holder id in Redis.
    pub(super) holder: u64,
    pub(super) id: Arc<str>,
    /// The cost acquired (what semaphores hold).
    pub(super) acquired: u64,
    /// What limits counting cost are charged now.
    pub(super) charged: u64,
    /// Done when the last settle of this grant has been applied.
    pub(super) after: Option<oneshot::Receiver<()>>,
}

impl RedisGrant {
    /// Where the grant came from: Redis, or the failure policy.
    #[must_use]
    pub fn source(&self) -> GrantSource {
        match &self.kind {
            GrantKind::Remote(_) => GrantSource::Redis,
            GrantKind::Open => GrantSource::FailOpen,
            GrantKind::Local(_) => GrantSource::Fallback,
            GrantKind::Shared(g) if g.pooled.is_empty() => GrantSource::Share,
            GrantKind::Shared(_) => GrantSource::Redis,
        }
    }

    /// For a grant from Redis, the server time it was made at, in microseconds since the
    /// epoch of the server's clock.
    #[must_use]
    pub fn granted_at_micros(&self) -> Option<u64> {
        match &self.kind {
            GrantKind::Remote(r) => Some(r.us),
            _ => None,
        }
    }

    /// For a grant from Redis, the holder id its semaphore holds and log entries carry
    /// (what an operator finds in the sorted sets).
    #[must_use]
    pub fn holder_id(&self) -> Option<String> {
        match &self.kind {
            GrantKind::Remote(r) => Some(r.id.to_string()),
            _ => None,
        }
    }
}

impl fmt::Debug for RedisGrant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("RedisGrant");
        d.field("source", &self.source());
        if let GrantKind::Remote(r) = &self.kind {
            d.field("holder", &r.id).field("granted_at_us", &r.us).field("charged", &r.charged);
        }
        d.finish()
    }
}
