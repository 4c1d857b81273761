//! The backend: a [`LimitSetPolicy`] whose state lives in Redis.
//!
//! # An acquisition
//!
//! [`Backend::acquire`] first answers everything it can without the network: a key that
//! lacks a tier ([`AcquireError::MissingTier`]), a cost above some limit's capacity
//! ([`AcquireError::CostAboveCapacity`]), a refusal still cached for this key, or, when
//! the circuit breaker is open, the failure policy. Otherwise it returns a future that
//! sends one `EVALSHA` of the set's script (see [`crate::script`]) with the set's keys
//! for this tenant, under the configured timeout. The reply is a grant (with the server
//! time it was made at and a holder id unique to it) or a refusal naming the blocking
//! limit and its exact wait, which is cached until then.
//!
//! # After the grant
//!
//! The [`Backend`] methods after a grant are synchronous; their Redis calls run in the
//! background, on the tokio runtime the acquisition ran on:
//!
//! - `settle` sends one call that charges or refunds the difference on the limits that
//!   count cost. Settles of one grant are applied in order.
//! - `release` sends one call that removes the grant's holder id from the set's
//!   semaphores (nothing at all for a set without semaphores). It is idempotent.
//! - `cancel` refunds everything and releases, in one call.
//!
//! A release is retried until Redis answers (for up to the lease; after that the lease
//! has expired anyway). A charge or refund whose call timed out is *not* retried: it may
//! have been applied, and applying it twice would be worse than once or never.
//! [`RedisBackend::flush`] waits until everything sent so far is done.
//!
//! # Leases
//!
//! A semaphore hold is a member of a sorted set scored by its lease deadline, so the
//! permits of a replica that dies come back when its leases expire (the next acquisition
//! of that semaphore reclaims them). While a replica lives, a background task renews
//! the leases of its grants every third of the lease, for at most `max_hold`.
//!
//! # Cancel safety
//!
//! Dropping the acquisition future while Redis works on it cannot lose a grant: the call
//! is finished in the background and, if it was granted, cancelled.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::Duration;

use redis::Value;
use tokio::runtime::Handle;
use tokio::sync::{Notify, oneshot};
use tower_limits_core::{
    AcquireError, Backend, Counts, Instant, LimitRefusal, LimitSet, LimitSnapshot, TenantKey, Unavailable,
};

use crate::cache::{self, BoundedMap, CachedRefusal, CachedSnapshots};
use crate::connection::RedisConnection;
use crate::failure::{Breaker, FailurePolicy, Gate};
use crate::keys::SlotLayout;
use crate::stats::{Counters, RedisStats, bump};

mod acquire;
mod background;
mod builder;
mod call;
mod grant;
mod shares;

use acquire::AcquireState;
pub use acquire::RedisAcquire;
use background::{Op, renew_leases, spawn_op};
pub use builder::RedisBackendBuilder;
use call::acquire_remote;
use grant::GrantKind;
pub use grant::{GrantSource, RedisGrant};
pub(crate) use shares::{Group as SharesGroup, Ride, SCRIPT as SHARES_SCRIPT};
pub use shares::{ShareGroup, Shares};

/// The bound below which the script's double arithmetic (divisions included) is exact:
/// 2^52, which as nanoseconds is 52 days.
const EXACT: u64 = 1 << 52;

/// A [`Backend`] whose limits live in Redis, shared by every replica built with the same
/// policy and namespace.
///
/// Cloning is cheap; clones share everything. Build one per set with
/// [`RedisBackend::builder`], then hand it to
/// `LimitSetLayer::with_backend(backend)` (crate `tower-limits`). See the [crate
/// docs](crate) for an example and for operations.
#[derive(Clone)]
pub struct RedisBackend {
    inner: Arc<Inner>,
}

impl fmt::Debug for RedisBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisBackend")
            .field("limits", &self.inner.limits.iter().map(|l| l.name).collect::<Vec<_>>())
            .field("namespace", &self.inner.namespace)
            .field("sha", &self.inner.sha)
            .finish_non_exhaustive()
    }
}

struct LimitInfo {
    name: &'static str,
    tier: Option<usize>,
    tier_name: Option<&'static str>,
    counts: Counts,
    capacity: u64,
    is_semaphore: bool,
    /// The quota per `window` the headers state (see `Snapshot::rate_quota`).
    quota: u64,
    window: Duration,
    /// `:<escaped name>:<kind>`, appended to the tenant's part of the key.
    suffix: Box<str>,
    /// With capacity shares: the limit as the share tables count it.
    share: Option<shares::ShareLimit>,
    /// A calendar window: each acquisition tells the script the current period's bounds.
    calendar: Option<tower_limits_core::algorithm::CalendarWindow>,
}

struct Settings {
    timeout: Duration,
    failure: FailurePolicy,
    lease: Duration,
    max_hold: Duration,
    max_leases: usize,
    manual_clock: bool,
}

struct Lease {
    key: TenantKey,
    id: Arc<str>,
    acquired: u64,
    since: tokio::time::Instant,
}

pub(crate) struct Inner {
    conn: RedisConnection,
    source: Arc<str>,
    sha: Arc<str>,
    limits: Box<[LimitInfo]>,
    tiers: Box<[&'static str]>,
    depth_needed: usize,
    has_semaphore: bool,
    /// The set's one semaphore, when it is its only one and counts requests: a release
    /// is then one `ZREM` of the grant's member, sent as a plain command, not the script,
    /// which would do just that after a script's call (about 1.5 us of the server's CPU,
    /// against 0.1 to 0.3 us for the command).
    lone_request_semaphore: Option<usize>,
    /// Some semaphore or log records the holder id of its grants (or a calendar window's
    /// bounds follow it).
    records_holders: bool,
    /// Some limit is a calendar window: each acquisition carries its period's bounds.
    has_calendar: bool,
    /// Some non-semaphore limit counts cost: settling can change something.
    settles: bool,
    namespace: Box<str>,
    layout: SlotLayout,
    settings: Settings,
    breaker: Breaker,
    refusals: Option<BoundedMap<CachedRefusal>>,
    snapshots: Option<BoundedMap<CachedSnapshots>>,
    fallback: Option<LimitSet>,
    /// The set's policy, whole: what a new fallback share scales.
    policy: tower_limits_core::LimitSetPolicy,
    stats: Counters,
    instance: u64,
    next_holder: AtomicU64,
    idle: Notify,
    /// Releases of semaphore permits on their way to Redis, and who waits for them.
    releases_pending: AtomicU64,
    releases_done: Notify,
    leases: Mutex<HashMap<u64, Lease>>,
    runtime: OnceLock<Handle>,
    renewing: AtomicBool,
    /// With capacity shares: this replica's.
    shares: Option<Arc<shares::Table>>,
}

impl RedisBackend {
    /// Resizes the local fallback ([`FailurePolicy::Fallback`]) to `share` of every limit:
    /// for a fleet that grew or shrank while it runs (a roster of replicas, an autoscaler).
    /// Keys the fallback tracks keep their state where the limit keeps its kind (see
    /// [`LimitSet::replace_policy`]). Whether the backend has a fallback to resize.
    ///
    /// ```
    /// # async fn demo(conn: tower_limits_redis::RedisConnection) -> Result<(), Box<dyn std::error::Error>> {
    /// use tower_limits_core::{LimitPolicy, LimitSetPolicy, Quota, nz};
    /// use tower_limits_redis::{FailurePolicy, RedisBackend};
    ///
    /// let policy = LimitSetPolicy::new().limit(LimitPolicy::gcra("rps", Quota::per_second(nz!(100))));
    /// let backend = RedisBackend::builder(policy).on_failure(FailurePolicy::Fallback { share: 0.5 }).build(&conn)?;
    /// // A third replica joined: each decides a third alone while Redis is away.
    /// assert!(backend.set_fallback_share(1.0 / 3.0)?);
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// `share` is not in `(0, 1]`.
    pub fn set_fallback_share(&self, share: f64) -> Result<bool, crate::BuildError> {
        if !(share > 0.0 && share <= 1.0) {
            return Err(crate::BuildError::Invalid {
                field: "on_failure",
                message: format!("the fallback share must be in (0, 1], got {share}"),
            });
        }
        let Some(fallback) = &self.inner.fallback else { return Ok(false) };
        fallback.replace_policy(builder::scaled(&self.inner.policy, share))?;
        Ok(true)
    }

    /// Counters of this backend (this replica's view).
    #[must_use]
    pub fn stats(&self) -> RedisStats {
        let leases = self.inner.leases.lock().unwrap_or_else(PoisonError::into_inner).len() as u64;
        self.inner.stats.snapshot(self.inner.breaker.is_open(), leases)
    }

    /// Waits until every settle, release and cancel sent so far has been applied (or
    /// given up). For tests, and for a graceful shutdown before the process exits.
    ///
    /// # Cancel safety
    /// Dropping the future cancels only the wait.
    pub async fn flush(&self) {
        self.inner.background_idle().await;
    }

    /// The Redis keys of every limit of the set for `key`, in the order of the policy:
    /// what an operator looks at (see the crate docs for the layout).
    #[must_use]
    pub fn keys(&self, key: &TenantKey) -> Vec<String> {
        self.inner.keys_for(key)
    }

    /// The set's Lua script (what `EVAL` sends after a `NOSCRIPT`).
    #[must_use]
    pub fn script(&self) -> &str {
        &self.inner.source
    }

    /// The SHA1 of the set's script (what `EVALSHA` sends).
    #[must_use]
    pub fn script_sha(&self) -> &str {
        &self.inner.sha
    }

    /// Renews the leases of a grant's semaphore holds now, for a holder that wants to
    /// keep its permits beyond `max_hold` or that runs without the renewal task (a manual
    /// clock). Answers whether Redis renewed anything (false when the lease had already
    /// expired and been reclaimed).
    ///
    /// # Errors
    /// Redis did not answer within the timeout.
    pub async fn renew(&self, key: &TenantKey, grant: &RedisGrant, now: Instant) -> Result<bool, Unavailable> {
        let GrantKind::Remote(r) = &grant.kind else { return Ok(false) };
        if !self.inner.has_semaphore {
            return Ok(false);
        }
        let keys = self.inner.keys_for(key);
        let (us, sub) = self.inner.now_args(now);
        let acq = r.acquired.min(EXACT).to_string();
        match self.inner.call(&keys, &["n", &us, &sub, &r.id, &acq]).await {
            Ok(Value::Int(n)) => {
                bump(&self.inner.stats.leases_renewed);
                Ok(n > 0)
            }
            Ok(other) => Err(Unavailable::new(format!("redis: unexpected reply {other:?}"))),
            Err(e) => Err(Unavailable::new(format!("redis: {}", e.message))),
        }
    }

    fn start_renewal(&self) {
        if self.inner.settings.manual_clock || self.inner.renewing.swap(true, Ordering::AcqRel) {
            return;
        }
        if let Some(handle) = self.inner.handle() {
            handle.spawn(renew_leases(Arc::downgrade(&self.inner), self.inner.settings.lease / 3));
        } else {
            self.inner.renewing.store(false, Ordering::Release);
        }
    }
}

impl Backend for RedisBackend {
    type Grant = RedisGrant;
    type Acquire = RedisAcquire;

    fn acquire(&self, key: &TenantKey, cost: u64, now: Instant) -> RedisAcquire {
        let inner = &self.inner;
        bump(&inner.stats.acquisitions);
        if inner.runtime.get().is_none() {
            if let Ok(handle) = Handle::try_current() {
                let _ = inner.runtime.set(handle);
            }
        }
        if let Some(refusal) = inner.local_refusal(key, cost) {
            return RedisAcquire::ready(Err(refusal));
        }
        if let Some(table) = &inner.shares {
            // The shares decide first and count the demand; the cache answers for the pools.
            return self.acquire_shared(table, key, cost, now);
        }
        if let Some(cache) = &inner.refusals {
            if let Some((i, retry, needs_release, snapshot)) = cache::lookup(cache, key, cost, now) {
                bump(&inner.stats.cached_refusals);
                let l = &inner.limits[i];
                let refusal = LimitRefusal::new(l.name, l.tier_name, i, retry, needs_release, snapshot);
                return RedisAcquire::ready(Err(AcquireError::Refused(refusal)));
            }
        }
        if inner.breaker.gate() == Gate::Open {
            return RedisAcquire::ready(inner.unavailable(key, cost, now, "circuit open after repeated failures"));
        }
        if inner.has_semaphore {
            self.start_renewal();
        }
        let holder = inner.next_holder.fetch_add(1, Ordering::Relaxed);
        let fut = acquire_remote(inner.clone(), key.clone(), cost, now, holder);
        RedisAcquire {
            state: AcquireState::Remote { fut: Box::pin(fut), backend: self.clone(), key: key.clone(), now },
        }
    }

    fn settle(&self, key: &TenantKey, grant: &mut RedisGrant, actual: u64, now: Instant) {
        match &mut grant.kind {
            GrantKind::Local(g) => {
                if let Some(local) = &self.inner.fallback {
                    local.settle_grant(key, g, actual, now);
                }
            }
            GrantKind::Open => {}
            GrantKind::Shared(g) => {
                let (from, to) = (g.charged, actual);
                g.charged = actual;
                let limits = &self.inner.limits;
                let back = i128::from(from) - i128::from(to);
                self.inner.settle_shared(g, now, |p| if limits[p.limit].counts == Counts::Cost { back } else { 0 });
            }
            GrantKind::Remote(r) => {
                let (from, to) = (r.charged, actual);
                r.charged = actual;
                if from == to || !self.inner.settles {
                    return;
                }
                let op = Op {
                    id: r.id.clone(),
                    now,
                    us: r.us,
                    sub: r.sub,
                    acquired: r.acquired,
                    req: (1, 1),
                    cost: (from, to),
                    release: false,
                };
                let (done, after) = oneshot::channel();
                let before = r.after.replace(after);
                spawn_op(&self.inner, key.clone(), op, before, Some(done));
            }
        }
    }

    fn release(&self, key: &TenantKey, grant: RedisGrant) {
        match grant.kind {
            GrantKind::Local(g) => {
                if let Some(local) = &self.inner.fallback {
                    local.release_grant(key, g);
                }
            }
            GrantKind::Open => {}
            GrantKind::Shared(g) => {
                if let Some(table) = &self.inner.shares {
                    table.release(&self.inner, &g);
                }
            }
            GrantKind::Remote(r) => {
                if !self.inner.has_semaphore {
                    return;
                }
                self.inner.drop_lease(r.holder);
                let op = Op {
                    id: r.id.clone(),
                    now: Instant::from_nanos(r.us.saturating_mul(1000).saturating_add(r.sub)),
                    us: r.us,
                    sub: r.sub,
                    acquired: r.acquired,
                    req: (1, 1),
                    cost: (r.charged, r.charged),
                    release: true,
                };
                spawn_op(&self.inner, key.clone(), op, r.after, None);
            }
        }
    }

    fn cancel(&self, key: &TenantKey, grant: RedisGrant, now: Instant) {
        match grant.kind {
            GrantKind::Local(g) => {
                if let Some(local) = &self.inner.fallback {
                    local.cancel_grant(key, g, now);
                }
            }
            GrantKind::Open => {}
            GrantKind::Shared(g) => {
                let limits = &self.inner.limits;
                let charged = i128::from(g.charged);
                self.inner.settle_shared(&g, now, |p| if limits[p.limit].counts == Counts::Cost { charged } else { 1 });
                if let Some(table) = &self.inner.shares {
                    table.release(&self.inner, &g);
                }
            }
            GrantKind::Remote(r) => {
                self.inner.drop_lease(r.holder);
                let op = Op {
                    id: r.id.clone(),
                    now,
                    us: r.us,
                    sub: r.sub,
                    acquired: r.acquired,
                    req: (1, 0),
                    cost: (r.charged, 0),
                    release: self.inner.has_semaphore,
                };
                if op.adjusts() || op.release {
                    spawn_op(&self.inner, key.clone(), op, r.after, None);
                }
            }
        }
    }

    fn needs_release(&self, grant: &RedisGrant) -> bool {
        match &grant.kind {
            GrantKind::Remote(_) => self.inner.has_semaphore,
            GrantKind::Open => false,
            GrantKind::Shared(g) => shares::Table::holds_permits(&self.inner, g),
            GrantKind::Local(g) => g.holds_concurrency(),
        }
    }

    fn peek(&self, key: &TenantKey, now: Instant) -> Vec<LimitSnapshot> {
        match &self.inner.snapshots {
            Some(map) => cache::snapshots_at(map, key, now),
            None => Vec::new(),
        }
    }
}
