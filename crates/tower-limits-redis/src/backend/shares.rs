//! Capacity shares: each replica decides its rate limits and semaphores from a share it
//! holds, and asks Redis once per refresh for all of them, not once per request.
//!
//! # The scheme
//!
//! A rate limit of `A` units per period `P` with burst `B`, for one scope (the whole fleet
//! for a global limit, one tenant for a keyed one), is split in Redis into the *shares*
//! the replicas hold and a *pool* that none holds. A share is a rate `a_r` with a burst
//! `b_r = ⌊B·a_r/A⌋`, valid until it expires; the replica runs it as a token bucket of its
//! own and admits from it without a round trip. The pool is a token bucket refilled at
//! the rate no replica holds, `A − Σ a_r`, up to the burst no replica holds,
//! `B − Σ b_r`; a replica without a share for a scope takes from the pool, one round
//! trip per request (the per-request path, for cold keys).
//!
//! Every refresh period (100 ms by default) a replica sends one call carrying, for every
//! scope it is busy with, the share it may be using, the demand it saw (units per
//! period, with a quarter of headroom) and the tokens it gives back. The script
//! allots each scope's rate max-min fairly by the live replicas' demands, and grants the
//! caller `min(its allotment, A − Σ others)`: a replica whose allotment shrank gives up
//! the difference at its own next refresh, and only then can another take it. A share
//! too small to hold one unit of burst stays in the pool. Demand below `hot_after`
//! requests a refresh (4) asks for no share: the scope stays with the pool. A replica
//! whose share is spent asks the pool before refusing; refused there, its share alone
//! decides until the pool could have a token.
//!
//! # Bounds
//!
//! Over every window of length `W`, the fleet admits at most `B + W·A/P` units of a
//! scope: the bound of the limit itself, with no excess. Tokens are only created at the
//! replicas' rates and the pool's, which sum to at most `A`, and held in buckets whose
//! capacities sum to at most `B`:
//!
//! - Redis counts, for each replica, the larger of the share it granted last and the one
//!   the replica says it may still be using, until the replica confirms the smaller one
//!   at its next refresh or the share expires. So `Σ a_r ≤ A` and `Σ b_r ≤ B` hold for
//!   every share a replica may be using, even while a reply is in flight or lost.
//! - A replica stops using a share at its local expiry, counted from the instant before
//!   its request was sent, so never after Redis stops counting it (clocks need only run
//!   at the same rate over one lifetime, not agree).
//! - Tokens move between the pool and a replica only by a grant (`gift`, taken from the
//!   pool) or a give-back (taken from the replica first); when a share shrinks or ends,
//!   the tokens above its new burst are dropped, never moved. A new share starts with
//!   what the pool gives it, not with a full burst.
//! - A share that expired counts as held until Redis removes it, so the pool never
//!   refills faster than the rate nobody holds.
//!
//! Settles refund or charge the bucket that granted: a charge beyond what a grant took
//! is a debt of its share, repaid by the share's refill before it grants again, and
//! handed to the pool when the share ends. As in memory, where the last grant's overrun
//! may exceed the bound, the fleet may exceed it by the overrun of each share's last
//! grant.
//!
//! With [`Shares::burst_excess`], the bursts the shares split sum to `B` plus that
//! percentage of it, and the bound is that larger burst plus the rate: an excess the user
//! chooses, zero by default.
//!
//! The one documented margin: a Redis that restarts empty forgets every share, and
//! answers as a fresh limit while replicas still use theirs, so for one lifetime the
//! fleet may admit up to twice the limit.
//!
//! # What it costs
//!
//! Redis work grows with the replicas and the scopes they are busy with, not with
//! requests: one call per replica per refresh (one per Cluster slot on a cluster),
//! carrying every scope. A request admitted from a share takes a lock and a few
//! integer operations per limit; one refused by an exhausted share is refused locally,
//! with the exact wait of the share, and counts as demand.
//!
//! # Failure
//!
//! While Redis is slow or away, a replica keeps deciding from its shares until they
//! expire (the lifetime, 1 s by default); scopes without a share, and then every scope,
//! follow the failure policy. Refreshes are not retried: the next one carries the same
//! scopes.
//!
//! # Semaphores
//!
//! A semaphore's shares are permits, allotted by the same script (a burst of 0 marks
//! them): a replica admits while its requests in flight fit its share and releases
//! locally. It reports as the share it may be using the larger of its share and its
//! permits held, so a share shrinks in Redis only as its permits come back: the fleet
//! never holds more than the capacity. Its demand is the most it held or was asked at
//! once in the period, plus a quarter. A semaphore has no pool, so the permits no demand
//! claims are split among the replicas that demand any. A scope without a share fetches
//! one with its first request (one call), and when every permit is held elsewhere it is
//! refused, then refused locally until the next refresh period, its demand on record so
//! that the others' next allotments make room. Redis counts a semaphore's share for the
//! backend's lease rather than the share's lifetime: the requests in flight outlive the
//! share they were admitted under, and a dead replica's permits come back within the
//! lease.
//!
//! # What is not shared
//!
//! Fixed and sliding windows: a set with one is refused when the backend is built.
//! Settling a grant charges or refunds its share (locally) or the pool (one background
//! call); a semaphore's holding does not change with the usage.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;

use redis::Value;
use tower_limits_core::{AcquireError, Counts, Instant, LimitRefusal, Snapshot, TenantKey};

use super::grant::{GrantKind, RedisGrant};
use super::{Inner, RedisBackend};
use crate::cache::CachedRefusal;
use crate::failure::Gate;
use crate::keys::key_slot;
use crate::stats::bump;

/// The script of the share tables.
const SCRIPT: &str = include_str!("shares.lua");

/// How a [`RedisBackend`] splits its rate limits and semaphores among replicas: capacity
/// shares, leased from Redis and refreshed in the background, so that a request admitted
/// from a share makes no round trip. See [`RedisBackendBuilder::shares`](crate::RedisBackendBuilder::shares)
/// and the guide for the scheme and its bounds.
///
/// ```
/// use std::time::Duration;
/// use tower_limits_redis::Shares;
///
/// let shares = Shares::new().refresh_every(Duration::from_millis(50)).lifetime(Duration::from_millis(500));
/// assert_eq!(shares.refresh(), Duration::from_millis(50));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use]
pub struct Shares {
    refresh: Duration,
    lifetime: Duration,
    max_scopes: usize,
    hot_after: u32,
    burst_excess: u32,
}

impl Default for Shares {
    fn default() -> Self {
        Self::new()
    }
}

impl Shares {
    /// Refreshed every 100 ms, living 1 s, at most 10,000 scopes tracked, a scope asking
    /// for a share after 4 requests in a refresh period.
    pub const fn new() -> Shares {
        Shares {
            refresh: Duration::from_millis(100),
            lifetime: Duration::from_secs(1),
            max_scopes: 10_000,
            hot_after: 4,
            burst_excess: 0,
        }
    }

    /// How often a replica reports its demand and renews its shares (default 100 ms):
    /// the Redis work of the fleet is one call per replica per period, and capacity
    /// moves between replicas within about two periods.
    pub const fn refresh_every(mut self, every: Duration) -> Self {
        self.refresh = every;
        self
    }

    /// How long a share lives without a refresh (default 1 s): how long a replica serves
    /// while Redis is away, and how long the share of a replica that died stays taken.
    /// At least two refresh periods plus the call timeout.
    pub const fn lifetime(mut self, lifetime: Duration) -> Self {
        self.lifetime = lifetime;
        self
    }

    /// The most scopes (limit and tenant) one replica tracks (default 10,000), which
    /// bounds its memory; a scope is forgotten two refresh periods after its last
    /// request, its share given back. Beyond the bound, a new scope's rate takes from the
    /// pool, and its semaphore refuses (it has no pool), until quiet scopes are
    /// forgotten.
    pub const fn max_scopes(mut self, scopes: usize) -> Self {
        self.max_scopes = scopes;
        self
    }

    /// How many requests in one refresh period make a scope ask for a share (default 4);
    /// below it, the scope takes from the pool, one round trip per request.
    pub const fn hot_after(mut self, requests: u32) -> Self {
        self.hot_after = requests;
        self
    }

    /// Lets the shares of a rate's burst sum to the burst plus `percent` percent of it
    /// (default 0). A burst split over many replicas leaves each a small one, which
    /// refuses locally while the fleet has room; with an excess, each holds more. The
    /// price is stated: over every window the fleet may admit up to `burst * percent /
    /// 100` more than the limit allows (`B * (1 + percent / 100) + W * rate` in all), and
    /// nothing more. Zero admits no excess. At most 1,000.
    ///
    /// ```
    /// use tower_limits_redis::Shares;
    ///
    /// // Bursts split over replicas may sum to twice the burst.
    /// let shares = Shares::new().burst_excess(100);
    /// assert_eq!(shares.excess_percent(), 100);
    /// ```
    pub const fn burst_excess(mut self, percent: u32) -> Self {
        self.burst_excess = percent;
        self
    }

    /// The burst excess allowed, in percent of each rate's burst.
    #[must_use]
    pub const fn excess_percent(&self) -> u32 {
        self.burst_excess
    }

    /// The refresh period.
    #[must_use]
    pub const fn refresh(&self) -> Duration {
        self.refresh
    }

    /// The lifetime of a share.
    #[must_use]
    pub const fn share_lifetime(&self) -> Duration {
        self.lifetime
    }

    pub(super) fn validate(&self, timeout: Duration) -> Result<(), crate::BuildError> {
        let invalid = |field, message: String| Err(crate::BuildError::Invalid { field, message });
        if self.refresh < Duration::from_millis(1) {
            return invalid("shares.refresh", format!("must be at least 1ms, got {:?}", self.refresh));
        }
        if self.lifetime < self.refresh * 2 + timeout {
            return invalid(
                "shares.lifetime",
                format!(
                    "must be at least two refresh periods plus the timeout ({:?}), got {:?}",
                    self.refresh * 2 + timeout,
                    self.lifetime
                ),
            );
        }
        if self.max_scopes == 0 {
            return invalid("shares.max_scopes", "must be at least 1".into());
        }
        if self.burst_excess > 1_000 {
            return invalid(
                "shares.burst_excess",
                format!("must be at most 1000 (percent), got {}", self.burst_excess),
            );
        }
        Ok(())
    }
}

/// A limit as the share tables count it: a rate of `amount` units per period with its
/// burst, or, with `permits`, a semaphore of `amount` permits (no period, no burst).
#[derive(Debug, Clone, Copy)]
pub(super) struct ShareLimit {
    pub(super) amount: u64,
    pub(super) period_us: u64,
    pub(super) burst: u64,
    pub(super) permits: bool,
}

impl ShareLimit {
    fn period_ns(&self) -> i128 {
        i128::from(self.period_us) * 1000
    }
}

/// This replica's shares.
pub(super) struct Table {
    pub(super) settings: Shares,
    pub(super) source: Arc<str>,
    pub(super) sha: Arc<str>,
    replica: Arc<str>,
    /// How long Redis counts a semaphore's share without a refresh: the backend's lease,
    /// so that permits in flight stay counted after the share they were taken under ends.
    permit_lease: Duration,
    scopes: Mutex<HashMap<Arc<str>, Scope>>,
    latest: AtomicU64,
    running: AtomicBool,
}

struct Scope {
    limit: usize,
    share: u64,
    burst: u64,
    expires: Instant,
    /// Units times the period in nanoseconds: the bucket refills by `share` a nanosecond.
    tokens: i128,
    at: Instant,
    pending: Option<Pending>,
    asks: u32,
    /// Units asked for since the last report; for permits, the most held or asked at once.
    wanted: u64,
    reported: Instant,
    quiet: u8,
    /// Permits held by this replica's grants.
    in_flight: u64,
    /// Permits: no share to be had until then (the last fetch found every permit held).
    denied_until: Instant,
    /// Rates: the pool refused this scope; its share alone decides until then.
    pool_dry_until: Instant,
}

/// A refresh's answer, applied by the next acquisition (whose `now` is after it).
#[derive(Clone, Copy)]
struct Pending {
    share: u64,
    burst: u64,
    gift: u64,
    expires: Instant,
}

impl Scope {
    fn new(limit: usize, now: Instant) -> Scope {
        Scope {
            limit,
            share: 0,
            burst: 0,
            expires: now,
            tokens: 0,
            at: now,
            pending: None,
            asks: 0,
            wanted: 0,
            reported: now,
            quiet: 0,
            in_flight: 0,
            denied_until: now,
            pool_dry_until: now,
        }
    }

    /// Brings the bucket to `now`: refilled at the share until it expires, an expired
    /// share dropped (a debt is kept).
    fn advance(&mut self, l: &ShareLimit, now: Instant) {
        let p = l.period_ns();
        if now > self.at {
            let until = if now < self.expires { now } else { self.expires.max(self.at) };
            let refill = i128::from(until.nanos_since(self.at)) * i128::from(self.share);
            self.tokens = (self.tokens + refill).min(i128::from(self.burst) * p);
            self.at = now;
        }
        if now >= self.expires && self.share > 0 {
            self.share = 0;
            self.burst = 0;
            self.tokens = self.tokens.min(0);
        }
    }

    /// Applies the last refresh's answer, at an acquisition's `now`: after the answer
    /// came, up to the time between reading the clock and deciding (the same tolerance
    /// as racing callers of the in-memory set). A refresh never applies it: its `now` may
    /// lag the clock.
    fn take_pending(&mut self, l: &ShareLimit, now: Instant) {
        self.advance(l, now);
        if let Some(next) = self.pending.take() {
            let p = l.period_ns();
            self.share = next.share;
            self.burst = next.burst;
            self.expires = next.expires;
            self.tokens = (self.tokens + i128::from(next.gift) * p).min(i128::from(self.burst) * p);
            self.advance(l, now);
        }
    }

    /// The share this replica may be using, as Redis must keep counting it.
    fn using(&self, now: Instant) -> u64 {
        let live = |share, expires| if now < expires { share } else { 0 };
        let pending = self.pending.map_or(0, |p| live(p.share, p.expires));
        live(self.share, self.expires).max(pending)
    }
}

/// One limit's part of a grant from shares.
#[derive(Debug, Clone)]
pub(super) struct Part {
    pub(super) limit: usize,
    pub(super) scope: Arc<str>,
    pub(super) units: u64,
}

/// A grant from shares: what it took locally and from the pools.
#[derive(Debug)]
pub(super) struct SharedGrant {
    pub(super) local: Vec<Part>,
    pub(super) pooled: Vec<Part>,
    pub(super) charged: u64,
}

/// What the local shares decided.
pub(super) enum Local {
    Granted(SharedGrant),
    /// Refused by a share: a rate's exact wait, or a semaphore's (wait for a release).
    Refused {
        limit: usize,
        wait: Duration,
        release: bool,
    },
    /// The local parts are taken; the cold ones must come from the pools.
    Pool {
        local: Vec<Part>,
        cold: Vec<Part>,
    },
    /// Semaphores without a share: one must be fetched first (nothing is taken).
    Fetch(Vec<Arc<str>>),
}

impl Table {
    pub(super) fn new(settings: Shares, replica: u64, permit_lease: Duration) -> Table {
        let source: Arc<str> = SCRIPT.into();
        let sha: Arc<str> = redis::Script::new(SCRIPT).get_hash().into();
        Table {
            settings,
            source,
            sha,
            replica: format!("{replica:016x}").into(),
            permit_lease: permit_lease.max(settings.lifetime),
            scopes: Mutex::new(HashMap::new()),
            latest: AtomicU64::new(0),
            running: AtomicBool::new(false),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Arc<str>, Scope>> {
        self.scopes.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Decides what the shares can, taking from them; the rest goes to the pools, or
    /// waits for a semaphore's share to be fetched.
    pub(super) fn decide(&self, inner: &Inner, keys: Vec<String>, cost: u64, now: Instant) -> Local {
        self.latest.fetch_max(now.as_nanos(), Ordering::Relaxed);
        let mut scopes = self.lock();
        let (mut local, mut cold, mut fetch) = (Vec::new(), Vec::new(), Vec::new());
        // The limit that refuses, its wait in ns, and whether it waits for a release.
        let mut refused: Option<(usize, u64, bool)> = None;
        for (i, key) in keys.into_iter().enumerate() {
            let info = &inner.limits[i];
            let Some(l) = info.share else { continue };
            let units = if info.counts == Counts::Cost { cost } else { 1 };
            let tracked = scopes.contains_key(key.as_str()) || scopes.len() < self.settings.max_scopes;
            let scope: Arc<str> = key.into();
            if !tracked {
                if l.permits {
                    // No room to track a share: refused as a full semaphore would be.
                    refused.get_or_insert((i, 0, true));
                } else {
                    cold.push(Part { limit: i, scope, units });
                }
                continue;
            }
            let s = scopes.entry(scope.clone()).or_insert_with(|| Scope::new(i, now));
            s.take_pending(&l, now);
            s.asks = s.asks.saturating_add(1);
            if l.permits {
                s.wanted = s.wanted.max(s.in_flight.saturating_add(units));
                if s.share == 0 {
                    if now < s.denied_until {
                        refused.get_or_insert((i, 0, true));
                    } else {
                        fetch.push(scope);
                    }
                } else if s.in_flight.saturating_add(units) <= s.share {
                    local.push(Part { limit: i, scope, units });
                } else {
                    refused.get_or_insert((i, 0, true));
                }
                continue;
            }
            s.wanted = s.wanted.saturating_add(units);
            if s.share == 0 || units > s.burst {
                cold.push(Part { limit: i, scope, units });
                continue;
            }
            let need = i128::from(units) * l.period_ns();
            if s.tokens >= need {
                local.push(Part { limit: i, scope, units });
            } else if now >= s.pool_dry_until {
                // The share is spent: the pool may hold what no share does (a burst after
                // a quiet spell). Refused there, the scope refuses locally until the pool
                // could have it: one call per such wait, not per request.
                cold.push(Part { limit: i, scope, units });
            } else {
                let missing = u64::try_from(need - s.tokens).unwrap_or(u64::MAX);
                let wait = missing.div_ceil(s.share).min(s.pool_dry_until.nanos_since(now));
                if refused.is_none_or(|(_, w, _)| wait > w) {
                    refused = Some((i, wait, false));
                }
            }
        }
        if let Some((limit, wait, release)) = refused {
            return Local::Refused { limit, wait: Duration::from_nanos(wait), release };
        }
        if !fetch.is_empty() {
            return Local::Fetch(fetch);
        }
        for part in &local {
            if let (Some(s), Some(l)) = (scopes.get_mut(&part.scope), inner.limits[part.limit].share) {
                if l.permits {
                    s.in_flight += part.units;
                } else {
                    s.tokens -= i128::from(part.units) * l.period_ns();
                }
            }
        }
        if cold.is_empty() {
            Local::Granted(SharedGrant { local, pooled: Vec::new(), charged: cost })
        } else {
            Local::Pool { local, cold }
        }
    }

    /// Undoes what [`Table::decide`] took for parts that were not granted after all: the
    /// rates' tokens and the semaphores' permits. A scope forgotten meanwhile keeps what
    /// it took: charged, never generous.
    pub(super) fn undo(&self, inner: &Inner, parts: &[Part]) {
        let mut scopes = self.lock();
        for part in parts {
            if let (Some(s), Some(l)) = (scopes.get_mut(&part.scope), inner.limits[part.limit].share) {
                if l.permits {
                    s.in_flight = s.in_flight.saturating_sub(part.units);
                } else {
                    let p = l.period_ns();
                    s.tokens = (s.tokens + i128::from(part.units) * p).min(i128::from(s.burst) * p);
                }
            }
        }
    }

    /// The pool of `scope` refused until `until`: its share alone decides until then.
    fn pool_dry(&self, scope: &Arc<str>, until: Instant) {
        if let Some(s) = self.lock().get_mut(scope) {
            s.pool_dry_until = until;
        }
    }

    /// Gives back the permits of a grant's semaphore parts.
    pub(super) fn release(&self, inner: &Inner, grant: &SharedGrant) {
        let mut scopes = self.lock();
        for part in &grant.local {
            if let (Some(s), Some(l)) = (scopes.get_mut(&part.scope), inner.limits[part.limit].share) {
                if l.permits {
                    s.in_flight = s.in_flight.saturating_sub(part.units);
                }
            }
        }
    }

    /// Whether a grant holds permits.
    pub(super) fn holds_permits(inner: &Inner, grant: &SharedGrant) -> bool {
        grant.local.iter().any(|p| inner.limits[p.limit].share.is_some_and(|l| l.permits))
    }

    /// Marks semaphore scopes whose fetch found no permit free: refused locally until
    /// the next refresh period.
    fn deny(&self, scopes: &[Arc<str>], until: Instant) {
        let mut table = self.lock();
        for key in scopes {
            if let Some(s) = table.get_mut(key) {
                if s.share == 0 && s.pending.is_none_or(|p| p.share == 0) {
                    s.denied_until = until;
                }
            }
        }
    }

    /// Gives `units` back to (or, negative, charges them from) each part's local share.
    /// Answers the parts whose scope this replica no longer tracks: their pools must be
    /// settled instead.
    pub(super) fn adjust(&self, inner: &Inner, parts: &[Part], units: impl Fn(&Part) -> i128) -> Vec<Part> {
        let mut scopes = self.lock();
        let mut gone = Vec::new();
        for part in parts {
            match (scopes.get_mut(&part.scope), inner.limits[part.limit].share) {
                (_, Some(l)) if l.permits => {}
                (Some(s), Some(l)) => {
                    let p = l.period_ns();
                    s.tokens = (s.tokens + units(part) * p).min(i128::from(s.burst) * p);
                }
                _ => gone.push(part.clone()),
            }
        }
        gone
    }

    /// This refresh's report: keys and arguments per slot group, with the scopes in order.
    fn report(&self, inner: &Inner, now: Instant, only: Option<&[Arc<str>]>) -> Vec<(Vec<Arc<str>>, Vec<String>)> {
        let mut scopes = self.lock();
        let mut groups: HashMap<u16, (Vec<Arc<str>>, Vec<String>)> = HashMap::new();
        let cluster = inner.conn.is_cluster();
        let hot_after = self.settings.hot_after;
        scopes.retain(|key, s| {
            let Some(l) = inner.limits[s.limit].share else { return false };
            if only.is_some_and(|keys| !keys.contains(key)) {
                return true;
            }
            s.advance(&l, now);
            if l.permits {
                return report_permits(key, s, &l, now, cluster, &mut groups);
            }
            let elapsed = now.nanos_since(s.reported).max(1);
            let hot = s.asks >= hot_after;
            let mut using = s.using(now);
            let mut back = 0;
            let demand = if hot {
                let per_period = u128::from(s.wanted) * u128::from(l.period_us) * 1000 / u128::from(elapsed);
                u64::try_from(per_period * 5 / 4 + 1).unwrap_or(u64::MAX).min(l.amount)
            } else {
                if using > 0 || s.tokens < 0 {
                    // Idle: the share and its tokens go back to the pool, and a debt (a
                    // settle that charged more than was taken) is charged to it.
                    back = i64::try_from(s.tokens.div_euclid(l.period_ns())).unwrap_or(0);
                    s.share = 0;
                    s.burst = 0;
                    s.tokens = 0;
                    s.pending = None;
                    using = 0;
                } else if s.asks == 0 {
                    s.quiet += 1;
                }
                0
            };
            if using == 0 && s.tokens < 0 {
                // A debt where no share can repay it is the pool's.
                back = i64::try_from(s.tokens.div_euclid(l.period_ns())).unwrap_or(0);
                s.tokens = 0;
            }
            let report = hot || back != 0;
            s.asks = 0;
            s.wanted = 0;
            s.reported = now;
            if report {
                s.quiet = 0;
                let slot = if cluster { key_slot(key) } else { 0 };
                let (keys, args) = groups.entry(slot).or_default();
                keys.push(key.clone());
                for n in [l.amount, l.period_us, l.burst, using, demand] {
                    args.push(n.to_string());
                }
                args.push(back.to_string());
            }
            s.quiet < 2
        });
        groups.into_values().collect()
    }

    fn apply(&self, inner: &Inner, keys: &[Arc<str>], reply: &[i64], expires: Instant) {
        let mut scopes = self.lock();
        let at = |v: i64| u64::try_from(v).unwrap_or(0);
        for (k, key) in keys.iter().enumerate() {
            let (Some(s), Some(r)) = (scopes.get_mut(key), reply.get(1 + 3 * k..4 + 3 * k)) else { continue };
            if inner.limits[s.limit].share.is_none() {
                continue;
            }
            s.pending = Some(Pending { share: at(r[0]), burst: at(r[1]), gift: at(r[2]), expires });
        }
    }

    fn args_head<'a>(&'a self, inner: &Inner, op: &'a str, now: Instant) -> Vec<String> {
        let now_us = if inner.settings.manual_clock { (now.as_nanos() / 1000).to_string() } else { String::new() };
        let us = |d: Duration| u64::try_from(d.as_micros()).unwrap_or(u64::MAX).to_string();
        vec![op.to_owned(), self.replica.to_string(), now_us, us(self.settings.lifetime), us(self.permit_lease)]
    }
}

/// A semaphore scope's part of a report: the permits it may be using (held ones
/// included: a share shrinks only as its permits come back), and the most it held or was
/// asked at once in the period, plus a quarter; idle for a period, its share goes back.
/// Answers whether to keep tracking the scope.
fn report_permits(
    key: &Arc<str>,
    s: &mut Scope,
    l: &ShareLimit,
    now: Instant,
    cluster: bool,
    groups: &mut HashMap<u16, (Vec<Arc<str>>, Vec<String>)>,
) -> bool {
    let busy = s.asks > 0 || s.in_flight > 0;
    let demand = if busy { (s.wanted.max(s.in_flight).saturating_mul(5) / 4 + 1).min(l.amount) } else { 0 };
    if !busy {
        s.share = 0;
        s.pending = None;
    }
    let using = s.using(now).max(s.in_flight);
    s.asks = 0;
    s.wanted = s.in_flight;
    s.reported = now;
    if using == 0 && demand == 0 {
        s.quiet += 1;
        return s.quiet < 2;
    }
    s.quiet = 0;
    let slot = if cluster { key_slot(key) } else { 0 };
    let (keys, args) = groups.entry(slot).or_default();
    keys.push(key.clone());
    for n in [l.amount, l.period_us, 0, using, demand, 0] {
        args.push(n.to_string());
    }
    true
}

impl Inner {
    fn share_table(&self) -> &Table {
        self.shares.as_ref().expect("called only for a backend with shares")
    }

    async fn eval_shares(&self, keys: &[Arc<str>], args: &[String]) -> Result<Value, super::call::CallError> {
        let table = self.share_table();
        let keys: Vec<&str> = keys.iter().map(|k| &**k).collect();
        self.call_script(&table.sha, &table.source, &keys, args).await
    }

    /// Refreshes every share this replica holds or wants (or those of `only`), one call
    /// per slot; with `heard` false, the replies are dropped as if lost on the way back
    /// (tests).
    pub(super) async fn refresh_shares(&self, now: Instant, heard: bool, only: Option<&[Arc<str>]>) -> bool {
        let table = self.share_table();
        table.latest.fetch_max(now.as_nanos(), Ordering::Relaxed);
        let expires = now + table.settings.lifetime;
        let mut all = true;
        for (keys, args) in table.report(self, now, only) {
            let mut full = table.args_head(self, "R", now);
            full.extend(args);
            bump(&self.stats.share_refreshes);
            match self.eval_shares(&keys, &full).await {
                Ok(value) => match super::call::int_array(&value) {
                    Some(reply) if reply.len() == 1 + 3 * keys.len() => {
                        if heard {
                            table.apply(self, &keys, &reply, expires);
                        }
                    }
                    _ => {
                        all = false;
                        tracing::warn!(target: "tower_limits_redis", reply = ?value, "unexpected reply from the share script");
                    }
                },
                Err(_) => all = false,
            }
        }
        all
    }

    /// Settles a grant from shares: the local parts at once, the pooled ones in the
    /// background.
    pub(super) fn settle_shared(self: &Arc<Self>, grant: &SharedGrant, now: Instant, units: impl Fn(&Part) -> i128) {
        let table = self.share_table();
        let gone = table.adjust(self, &grant.local, &units);
        let mut keys = Vec::new();
        let mut args = table.args_head(self, "S", now);
        for part in grant.pooled.iter().chain(&gone) {
            let n = units(part);
            let Some(l) = self.limits[part.limit].share else { continue };
            if n != 0 {
                keys.push(part.scope.clone());
                for v in [l.amount.to_string(), l.period_us.to_string(), l.burst.to_string(), n.to_string()] {
                    args.push(v);
                }
            }
        }
        if keys.is_empty() {
            return;
        }
        let Some(handle) = self.handle() else {
            bump(&self.stats.background_failures);
            return;
        };
        // Not resent after a failure: it may have been applied.
        let guard = super::background::PendingGuard::new(self);
        let inner = self.clone();
        handle.spawn(async move {
            if inner.eval_shares(&keys, &args).await.is_ok() {
                bump(&inner.stats.background_ops);
            } else {
                bump(&inner.stats.background_failures);
            }
            drop(guard);
        });
    }
}

impl RedisBackend {
    /// Refreshes this replica's capacity shares now: reports its demand and renews every
    /// share it holds or wants, one call per slot. A backend built with
    /// [`RedisBackendBuilder::shares`](crate::RedisBackendBuilder::shares) does this
    /// every refresh period by itself; call it by hand with a manual clock (tests), where
    /// it is the only refresh. Answers whether every call succeeded (false also when the
    /// backend has no shares).
    pub async fn refresh_shares(&self, now: Instant) -> bool {
        if self.inner.shares.is_none() {
            return false;
        }
        self.inner.refresh_shares(now, true, None).await
    }

    /// Test support: [`RedisBackend::refresh_shares`] whose replies are lost on the way
    /// back: Redis applies the refresh, this replica never learns its answer.
    #[cfg(feature = "test-support")]
    pub async fn refresh_shares_unheard(&self, now: Instant) -> bool {
        if self.inner.shares.is_none() {
            return false;
        }
        self.inner.refresh_shares(now, false, None).await
    }

    pub(super) fn start_refreshing(&self) {
        let Some(table) = &self.inner.shares else { return };
        if self.inner.settings.manual_clock || table.running.swap(true, Ordering::AcqRel) {
            return;
        }
        match self.inner.handle() {
            Some(handle) => {
                handle.spawn(refresh_loop(Arc::downgrade(&self.inner), table.settings.refresh));
            }
            None => table.running.store(false, Ordering::Release),
        }
    }

    /// An acquisition through the shares.
    pub(super) fn acquire_shared(&self, key: &TenantKey, cost: u64, now: Instant) -> super::RedisAcquire {
        let inner = &self.inner;
        let table = inner.share_table();
        self.start_refreshing();
        match table.decide(inner, inner.keys_for(key), cost, now) {
            Local::Granted(grant) => {
                bump(&inner.stats.shared_grants);
                super::RedisAcquire::ready(Ok(RedisGrant { kind: GrantKind::Shared(grant) }))
            }
            Local::Refused { limit, wait, release } => {
                bump(&inner.stats.shared_refusals);
                super::RedisAcquire::ready(Err(inner.share_refusal(limit, wait, release)))
            }
            Local::Fetch(scopes) => {
                if inner.breaker.gate() == Gate::Open {
                    return super::RedisAcquire::ready(inner.unavailable(
                        key,
                        cost,
                        now,
                        "circuit open after repeated failures",
                    ));
                }
                let fut = fetch_then_acquire(inner.clone(), key.clone(), cost, now, scopes);
                super::RedisAcquire::remote(Box::pin(fut), self.clone(), key.clone(), now)
            }
            Local::Pool { local, cold } => {
                if let Some(cache) = &inner.refusals {
                    if let Some((i, retry, _, snapshot)) = crate::cache::lookup(cache, key, cost, now) {
                        table.undo(inner, &local);
                        bump(&inner.stats.cached_refusals);
                        let l = &inner.limits[i];
                        let refusal = LimitRefusal::new(l.name, l.tier_name, i, retry, false, snapshot);
                        return super::RedisAcquire::ready(Err(AcquireError::Refused(refusal)));
                    }
                }
                if inner.breaker.gate() == Gate::Open {
                    table.undo(inner, &local);
                    return super::RedisAcquire::ready(inner.unavailable(
                        key,
                        cost,
                        now,
                        "circuit open after repeated failures",
                    ));
                }
                let fut = take_from_pools(inner.clone(), key.clone(), cost, now, local, cold);
                super::RedisAcquire::remote(Box::pin(fut), self.clone(), key.clone(), now)
            }
        }
    }
}

impl Inner {
    fn share_refusal(&self, limit: usize, wait: Duration, release: bool) -> AcquireError {
        let l = &self.limits[limit];
        let snapshot = Snapshot { quota: l.quota, remaining: 0, reset: wait, window: l.window };
        AcquireError::Refused(LimitRefusal::new(l.name, l.tier_name, limit, wait, release, snapshot))
    }
}

/// A semaphore scope without a share: one call fetches its share (reporting the demand
/// that made it ask), then the acquisition is decided again. Still without a share, every
/// permit is held elsewhere: refused, and refused locally until the next refresh period.
async fn fetch_then_acquire(
    inner: Arc<Inner>,
    key: TenantKey,
    cost: u64,
    now: Instant,
    scopes: Vec<Arc<str>>,
) -> Result<RedisGrant, AcquireError> {
    let table = inner.share_table();
    if !inner.refresh_shares(now, true, Some(&scopes)).await {
        return inner.unavailable(&key, cost, now, "the share of a semaphore could not be fetched");
    }
    match table.decide(&inner, inner.keys_for(&key), cost, now) {
        Local::Granted(grant) => {
            bump(&inner.stats.shared_grants);
            Ok(RedisGrant { kind: GrantKind::Shared(grant) })
        }
        Local::Refused { limit, wait, release } => {
            bump(&inner.stats.shared_refusals);
            Err(inner.share_refusal(limit, wait, release))
        }
        Local::Pool { local, cold } => take_from_pools(inner.clone(), key, cost, now, local, cold).await,
        Local::Fetch(still) => {
            table.deny(&still, now + table.settings.refresh);
            bump(&inner.stats.shared_refusals);
            let limit = still.first().and_then(|k| inner.keys_for(&key).iter().position(|x| **x == **k)).unwrap_or(0);
            Err(inner.share_refusal(limit, Duration::ZERO, true))
        }
    }
}

/// The pools' part of an acquisition: one call, all or nothing; the local parts are given
/// back if it refuses or fails.
async fn take_from_pools(
    inner: Arc<Inner>,
    key: TenantKey,
    cost: u64,
    now: Instant,
    local: Vec<Part>,
    cold: Vec<Part>,
) -> Result<RedisGrant, AcquireError> {
    let table = inner.share_table();
    let mut args = table.args_head(&inner, "P", now);
    let mut keys = Vec::with_capacity(cold.len());
    for part in &cold {
        let Some(l) = inner.limits[part.limit].share else { continue };
        keys.push(part.scope.clone());
        for v in [l.amount, l.period_us, l.burst, part.units] {
            args.push(v.to_string());
        }
    }
    let give_back = |inner: &Inner| inner.share_table().undo(inner, &local);
    let why = match inner.eval_shares(&keys, &args).await {
        Ok(value) => match super::call::int_array(&value) {
            Some(reply) if reply.get(1) == Some(&1) => {
                bump(&inner.stats.granted);
                return Ok(RedisGrant { kind: GrantKind::Shared(SharedGrant { local, pooled: cold, charged: cost }) });
            }
            Some(reply) if reply.len() == 4 && reply[1] == 0 => {
                give_back(&inner);
                bump(&inner.stats.refused);
                let k = usize::try_from(reply[2] - 1).unwrap_or(0).min(cold.len() - 1);
                let limit = cold[k].limit;
                // No rate is free of shares: the pool refills when a share ends or shrinks.
                let wait_us = u64::try_from(reply[3]).unwrap_or(table.settings.refresh.as_micros() as u64);
                let wait = Duration::from_micros(wait_us);
                table.pool_dry(&cold[k].scope, now + wait);
                let refusal = inner.share_refusal(limit, wait, false);
                if let (Some(cache), AcquireError::Refused(r)) = (&inner.refusals, &refusal) {
                    let l = &inner.limits[limit];
                    let cached = CachedRefusal {
                        until: now + wait,
                        at: now,
                        cost,
                        counts_cost: l.counts == Counts::Cost,
                        limit,
                        needs_release: false,
                        snapshot: r.snapshot(),
                    };
                    cache.insert(&key, cached, |d| d.until <= now);
                }
                return Err(refusal);
            }
            _ => {
                bump(&inner.stats.errors);
                inner.failed();
                format!("unexpected reply {value:?}")
            }
        },
        Err(e) => e.message,
    };
    give_back(&inner);
    inner.unavailable(&key, cost, now, &why)
}

/// Refreshes every period while the backend lives. Its `now` is the latest an acquisition
/// was given: never later than the clock, so shares expire locally no later than in Redis.
async fn refresh_loop(inner: Weak<Inner>, every: Duration) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some(inner) = inner.upgrade() else { return };
        let Some(table) = &inner.shares else { return };
        let now = Instant::from_nanos(table.latest.load(Ordering::Relaxed));
        inner.refresh_shares(now, true, None).await;
    }
}
