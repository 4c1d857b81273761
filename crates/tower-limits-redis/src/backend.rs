//! The backend: a [`LimitSetPolicy`] whose state lives in Redis.
//!
//! # An acquisition
//!
//! [`Backend::acquire`] first answers everything it can without the network: a key that
//! lacks a tier ([`AcquireError::MissingKey`]), a cost above some limit's capacity
//! ([`AcquireError::CostAboveCapacity`]), a denial still cached for this key, or, when
//! the circuit breaker is open, the failure policy. Otherwise it returns a future that
//! sends one `EVALSHA` of the set's script (see [`crate::script`]) with the set's keys
//! for this tenant, under the configured timeout. The reply is a grant (with the server
//! time it was made at and a holder id unique to it) or a denial naming the blocking
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
use std::future::Future;
use std::hash::{BuildHasher, RandomState};
use std::pin::{Pin, pin};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError, Weak};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use redis::Value;
use tokio::runtime::Handle;
use tokio::sync::{Notify, oneshot};
use tower_limits_core::{
    AcquireError, AlgorithmKind, Backend, CostAboveCapacity, Counts, Denial, Instant, Limit, LimitPolicy, LimitSet,
    LimitSetPolicy, LimitSnapshot, MissingKey, Rate, Scope, Snapshot, TenantKey, Unavailable, intern,
};

use crate::cache::{self, BoundedMap, CachedDenial, CachedSnapshots};
use crate::connection::RedisConnection;
use crate::error::BuildError;
use crate::failure::{Breaker, FailurePolicy, Gate};
use crate::keys::{SlotLayout, escape_into};
use crate::script::{self, ScriptLimit};
use crate::stats::{Counters, RedisStats, bump};

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

/// Builds a [`RedisBackend`]; from [`RedisBackend::builder`].
#[derive(Debug, Clone)]
#[must_use]
pub struct RedisBackendBuilder {
    policy: LimitSetPolicy,
    namespace: String,
    layout: SlotLayout,
    timeout: Duration,
    failure: FailurePolicy,
    lease: Duration,
    max_hold: Duration,
    breaker_threshold: u32,
    breaker_open_for: Duration,
    denial_cache: usize,
    peek_cache: usize,
    max_leases: usize,
    manual_clock: bool,
}

struct LimitInfo {
    name: &'static str,
    tier: Option<usize>,
    tier_name: Option<&'static str>,
    counts: Counts,
    capacity: u64,
    is_semaphore: bool,
    window: Duration,
    /// `:<escaped name>:<kind>`, appended to the tenant's part of the key.
    suffix: Box<str>,
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
    /// Some semaphore or log records the holder id of its grants.
    records_holders: bool,
    /// Some non-semaphore limit counts cost: settling can change something.
    settles: bool,
    namespace: Box<str>,
    layout: SlotLayout,
    settings: Settings,
    breaker: Breaker,
    denials: Option<BoundedMap<CachedDenial>>,
    snapshots: Option<BoundedMap<CachedSnapshots>>,
    fallback: Option<LimitSet>,
    stats: Counters,
    instance: u64,
    next_holder: AtomicU64,
    idle: Notify,
    leases: Mutex<HashMap<u64, Lease>>,
    runtime: OnceLock<Handle>,
    renewing: AtomicBool,
}

impl RedisBackend {
    /// A builder for a backend enforcing `policy`.
    ///
    /// Defaults: namespace `tl`, [`SlotLayout::PerTenant`], a 50 ms timeout,
    /// [`FailurePolicy::FailClosed`], a breaker opening after 3 failures in a row for 1 s,
    /// 30 s leases renewed for at most 1 h, and caches of 10,000 keys for denials and for
    /// snapshots.
    pub fn builder(policy: LimitSetPolicy) -> RedisBackendBuilder {
        RedisBackendBuilder {
            policy,
            namespace: "tl".to_owned(),
            layout: SlotLayout::PerTenant,
            timeout: Duration::from_millis(50),
            failure: FailurePolicy::FailClosed,
            lease: Duration::from_secs(30),
            max_hold: Duration::from_secs(3600),
            breaker_threshold: 3,
            breaker_open_for: Duration::from_secs(1),
            denial_cache: 10_000,
            peek_cache: 10_000,
            max_leases: 100_000,
            manual_clock: false,
        }
    }
}

impl RedisBackendBuilder {
    /// The prefix of every key (default `tl`). Sets sharing a namespace and limit names
    /// share state: give each deployment its own.
    pub fn namespace(mut self, namespace: impl Into<String>) -> Self {
        self.namespace = namespace.into();
        self
    }

    /// How the set's keys map to Cluster slots (default [`SlotLayout::PerTenant`]).
    pub fn slot_layout(mut self, layout: SlotLayout) -> Self {
        self.layout = layout;
        self
    }

    /// How long a call to Redis may take before the failure policy decides (default 50 ms).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// What acquisitions do when Redis cannot answer (default fail closed).
    pub fn on_failure(mut self, policy: FailurePolicy) -> Self {
        self.failure = policy;
        self
    }

    /// The lease of a semaphore hold (default 30 s): how long the permits of a replica
    /// that died stay taken. Live replicas renew their leases.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// The longest a replica keeps renewing one grant's lease (default 1 h), so that a
    /// grant leaked by a bug is eventually given back.
    pub fn max_hold(mut self, max_hold: Duration) -> Self {
        self.max_hold = max_hold;
        self
    }

    /// The circuit breaker: open after `failures` failed calls in a row, for `open_for`.
    pub fn circuit_breaker(mut self, failures: u32, open_for: Duration) -> Self {
        self.breaker_threshold = failures;
        self.breaker_open_for = open_for;
        self
    }

    /// How many keys' denials are remembered until their `retry_after` (default 10,000;
    /// 0 turns the cache off).
    pub fn denial_cache(mut self, keys: usize) -> Self {
        self.denial_cache = keys;
        self
    }

    /// How many keys' last snapshots [`Backend::peek`] can answer from (default 10,000;
    /// 0 turns it off, and `peek` answers nothing).
    pub fn peek_cache(mut self, keys: usize) -> Self {
        self.peek_cache = keys;
        self
    }

    /// The most grants whose leases this replica renews at once (default 100,000); grants
    /// beyond it keep their first lease only.
    pub fn max_leases(mut self, leases: usize) -> Self {
        self.max_leases = leases;
        self
    }

    /// Test support: decide with the `now` each call is given (a
    /// [`ManualClock`](tower_limits_core::ManualClock)) instead of the server's `TIME`, so
    /// that a test can compare with the in-memory set instant by instant and expire
    /// leases without waiting. Keys then expire an hour later than their state needs.
    /// Never in production: replicas' clocks disagree.
    #[cfg(feature = "test-support")]
    pub fn manual_clock(mut self) -> Self {
        self.manual_clock = true;
        self
    }

    /// Validates everything and builds the backend on `connection`. Nothing is sent to
    /// Redis until the first acquisition (the script is loaded by its first `EVAL`).
    ///
    /// # Errors
    /// - [`BuildError::Policy`]: the policy is invalid.
    /// - [`BuildError::Unsupported`]: a window is not a whole number of microseconds (the
    ///   server clock's resolution) or longer than 52 days, a GCRA or token-bucket burst
    ///   spans more than 52 days, or a limit is above 2^52.
    /// - [`BuildError::CrossSlot`]: on a cluster with [`SlotLayout::PerTenant`], the set
    ///   mixes global and keyed limits.
    /// - [`BuildError::Invalid`]: a namespace or tag containing braces, a zero timeout or
    ///   lease, a fallback share outside `(0, 1]`.
    pub fn build(self, connection: &RedisConnection) -> Result<RedisBackend, BuildError> {
        self.policy.validate()?;
        for (field, text) in [("namespace", self.namespace.as_str()), ("slot_layout", tag(&self.layout))] {
            if text.is_empty() || text.contains(['{', '}']) {
                return Err(BuildError::Invalid {
                    field,
                    message: format!("{text:?} must be non-empty, without braces"),
                });
            }
        }
        if self.timeout.is_zero() || self.lease < Duration::from_millis(3) {
            return Err(BuildError::Invalid { field: "timeout", message: "timeout and lease must be positive".into() });
        }
        let tiers: Box<[&'static str]> = self.policy.tiers.iter().map(|t| intern(t)).collect();
        let mut limits = Vec::with_capacity(self.policy.limits.len());
        let mut script_limits = Vec::with_capacity(self.policy.limits.len());
        for p in &self.policy.limits {
            let (info, script) = describe(p, &self.policy.tiers, &tiers)?;
            limits.push(info);
            script_limits.push(script);
        }
        let global = limits.iter().find(|l| l.tier.is_none());
        let keyed = limits.iter().find(|l| l.tier.is_some());
        if let (true, SlotLayout::PerTenant, Some(g), Some(k)) = (connection.is_cluster(), &self.layout, global, keyed)
        {
            return Err(BuildError::CrossSlot { global: g.name.to_owned(), keyed: k.name.to_owned() });
        }
        let fallback = match self.failure {
            FailurePolicy::Fallback { share } => {
                if !(share > 0.0 && share <= 1.0) {
                    return Err(BuildError::Invalid {
                        field: "on_failure",
                        message: format!("the fallback share must be in (0, 1], got {share}"),
                    });
                }
                Some(LimitSet::new(scaled(&self.policy, share))?)
            }
            _ => None,
        };
        let lease_us = u64::try_from(self.lease.as_micros()).unwrap_or(u64::MAX).min(EXACT / 1000);
        let source: Arc<str> = script::generate(&script_limits, lease_us, self.manual_clock).into();
        let sha: Arc<str> = redis::Script::new(&source).get_hash().into();
        let instance = RandomState::new().hash_one((std::process::id(), std::time::SystemTime::now()));
        let has_semaphore = limits.iter().any(|l| l.is_semaphore);
        let settles = limits.iter().any(|l| !l.is_semaphore && l.counts == Counts::Cost);
        let records_holders =
            script_limits.iter().any(|l| matches!(l, ScriptLimit::Semaphore { .. } | ScriptLimit::Log { .. }));
        let depth_needed = limits.iter().filter_map(|l| l.tier).map(|t| t + 1).max().unwrap_or(0);
        Ok(RedisBackend {
            inner: Arc::new(Inner {
                conn: connection.clone(),
                source,
                sha,
                limits: limits.into(),
                tiers,
                depth_needed,
                has_semaphore,
                records_holders,
                settles,
                namespace: self.namespace.into(),
                layout: self.layout,
                settings: Settings {
                    timeout: self.timeout,
                    failure: self.failure,
                    lease: self.lease,
                    max_hold: self.max_hold,
                    max_leases: self.max_leases,
                    manual_clock: self.manual_clock,
                },
                breaker: Breaker::new(self.breaker_threshold, self.breaker_open_for),
                denials: (self.denial_cache > 0).then(|| BoundedMap::new(self.denial_cache)),
                snapshots: (self.peek_cache > 0).then(|| BoundedMap::new(self.peek_cache)),
                fallback,
                stats: Counters::default(),
                instance,
                next_holder: AtomicU64::new(1),
                idle: Notify::new(),
                leases: Mutex::new(HashMap::new()),
                runtime: OnceLock::new(),
                renewing: AtomicBool::new(false),
            }),
        })
    }
}

fn tag(layout: &SlotLayout) -> &str {
    match layout {
        SlotLayout::PerTenant => "*",
        SlotLayout::OneSlot(tag) => tag,
    }
}

/// What the backend and the script need to know of one limit, checked for Redis.
fn describe(
    p: &LimitPolicy,
    tier_names: &[String],
    tiers: &[&'static str],
) -> Result<(LimitInfo, ScriptLimit), BuildError> {
    let unsupported = |reason: String| BuildError::Unsupported { limit: p.name.clone(), reason };
    let limit = Limit::from_policy(p)?;
    let cost = p.counts == Counts::Cost;
    let window_us = |window: Duration| {
        let nanos = window.as_nanos();
        if nanos % 1000 != 0 {
            return Err(unsupported(format!(
                "its window {window:?} is not a whole number of microseconds, the resolution of the server clock"
            )));
        }
        if nanos >= u128::from(EXACT) {
            return Err(unsupported(format!(
                "its window {window:?} is longer than the 52 days a script counts exactly"
            )));
        }
        Ok((nanos / 1000) as u64)
    };
    let exact = |what: &str, n: u64| {
        if n >= EXACT {
            Err(unsupported(format!("its {what} {n} is above 2^52, the largest integer a script counts exactly")))
        } else {
            Ok(n)
        }
    };
    let (script, window) = match &limit {
        Limit::Gcra(_) | Limit::TokenBucket(_) => {
            let (rate, burst) = match &limit {
                Limit::Gcra(g) => (g.rate(), g.burst()),
                Limit::TokenBucket(t) => (t.rate(), t.burst()),
                _ => unreachable!("matched above"),
            };
            let interval = u64::try_from(rate.interval()?.as_nanos()).unwrap_or(u64::MAX);
            let tolerance = interval.saturating_mul(burst);
            if tolerance >= EXACT {
                return Err(unsupported(format!(
                    "its burst of {burst} at {rate} spans more than the 52 days a script counts exactly"
                )));
            }
            (ScriptLimit::Gcra { cost, interval, tolerance }, Duration::from_nanos(tolerance))
        }
        Limit::FixedWindow(w) => (
            ScriptLimit::Fixed { cost, limit: exact("limit", w.limit())?, window_us: window_us(w.window())? },
            w.window(),
        ),
        Limit::SlidingWindowCounter(w) => (
            ScriptLimit::Counter { cost, limit: exact("limit", w.limit())?, window_us: window_us(w.window())? },
            w.window(),
        ),
        Limit::SlidingWindowLog(w) => (
            ScriptLimit::Log { cost, limit: exact("limit", w.limit())?, window_us: window_us(w.window())? },
            w.window(),
        ),
        Limit::Semaphore(_) => {
            (ScriptLimit::Semaphore { cost, capacity: exact("capacity", limit.capacity())? }, Duration::ZERO)
        }
    };
    let tier = match &p.scope {
        Scope::Global => None,
        Scope::Tier(t) => tier_names.iter().position(|x| x == t),
    };
    let mut suffix = String::from(":");
    escape_into(&mut suffix, &p.name);
    suffix.push(':');
    suffix.push(script.kind());
    let info = LimitInfo {
        name: intern(&p.name),
        tier,
        tier_name: tier.map(|t| tiers[t]),
        counts: p.counts,
        capacity: limit.capacity(),
        is_semaphore: limit.is_semaphore(),
        window,
        suffix: suffix.into(),
    };
    Ok((info, script))
}

/// The policy with every limit scaled to `share`, for the local fallback.
fn scaled(policy: &LimitSetPolicy, share: f64) -> LimitSetPolicy {
    let scale = |n: u64| ((n as f64 * share).floor() as u64).max(1);
    let mut policy = policy.clone();
    for l in &mut policy.limits {
        match l.algorithm {
            AlgorithmKind::Gcra | AlgorithmKind::TokenBucket => {
                if let Some(rate) = l.rate {
                    l.burst = Some(scale(l.burst.unwrap_or(rate.amount())));
                    l.rate = Some(Rate::new(rate.amount(), rate.period().div_f64(share)));
                }
            }
            AlgorithmKind::SlidingWindowLog | AlgorithmKind::SlidingWindowCounter | AlgorithmKind::FixedWindow => {
                l.limit = l.limit.map(scale);
            }
            AlgorithmKind::Semaphore => l.capacity = l.capacity.map(scale),
        }
    }
    policy
}

/// Where a grant came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GrantSource {
    /// Granted by Redis: shared by the fleet.
    Redis,
    /// Admitted without limits while Redis was unavailable ([`FailurePolicy::FailOpen`]).
    FailOpen,
    /// Granted by the local fallback limiter ([`FailurePolicy::Fallback`]).
    Fallback,
}

/// A grant from a [`RedisBackend`]: plain data, handed back to
/// [`Backend::settle`], [`Backend::release`] or [`Backend::cancel`].
#[must_use = "a grant holds concurrency until it is released"]
pub struct RedisGrant {
    kind: GrantKind,
}

enum GrantKind {
    Remote(Remote),
    Open,
    Local(tower_limits_core::Grant),
}

struct Remote {
    /// The server time of the grant: whole microseconds and the nanoseconds below.
    us: u64,
    sub: u64,
    /// The grant's number in this backend, and its holder id in Redis.
    holder: u64,
    id: Arc<str>,
    /// The cost acquired (what semaphores hold).
    acquired: u64,
    /// What limits counting cost are charged now.
    charged: u64,
    /// Done when the last settle of this grant has been applied.
    after: Option<oneshot::Receiver<()>>,
}

impl RedisGrant {
    /// Where the grant came from: Redis, or the failure policy.
    #[must_use]
    pub fn source(&self) -> GrantSource {
        match self.kind {
            GrantKind::Remote(_) => GrantSource::Redis,
            GrantKind::Open => GrantSource::FailOpen,
            GrantKind::Local(_) => GrantSource::Fallback,
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

impl Inner {
    fn holder_id(&self, seq: u64) -> Arc<str> {
        format!("{:016x}.{seq:x}", self.instance).into()
    }

    fn now_args(&self, now: Instant) -> (String, String) {
        if self.settings.manual_clock {
            let n = now.as_nanos();
            ((n / 1000).to_string(), (n % 1000).to_string())
        } else {
            (String::new(), String::new())
        }
    }

    /// The keys of every limit of the set for `key`, in the order of the policy.
    fn keys_for(&self, key: &TenantKey) -> Vec<String> {
        let mut heads: [Option<String>; tower_limits_core::MAX_TIERS] = Default::default();
        let mut keys = Vec::with_capacity(self.limits.len());
        for l in self.limits.iter() {
            let mut k = String::with_capacity(64);
            match l.tier {
                None => {
                    k.push_str(&self.namespace);
                    k.push_str(":{");
                    k.push_str(tag(&self.layout));
                    k.push('}');
                    if let SlotLayout::OneSlot(_) = self.layout {
                        k.push_str(":*");
                    }
                }
                Some(t) => {
                    let head = heads[t].get_or_insert_with(|| self.tenant_head(key, t));
                    k.push_str(head);
                }
            }
            k.push_str(&l.suffix);
            keys.push(k);
        }
        keys
    }

    fn tenant_head(&self, key: &TenantKey, tier: usize) -> String {
        let mut k = String::with_capacity(48);
        k.push_str(&self.namespace);
        k.push(':');
        match &self.layout {
            SlotLayout::PerTenant => {
                k.push('{');
                escape_into(&mut k, key.root());
                k.push('}');
            }
            SlotLayout::OneSlot(tag) => {
                k.push('{');
                k.push_str(tag);
                k.push_str("}:");
                escape_into(&mut k, key.root());
            }
        }
        for part in key.parts().skip(1).take(tier) {
            k.push('/');
            escape_into(&mut k, part);
        }
        k
    }

    /// The refusals decided without Redis.
    fn local_refusal(&self, key: &TenantKey, cost: u64) -> Option<AcquireError> {
        let depth = key.depth();
        if self.depth_needed > depth {
            return Some(AcquireError::MissingKey(MissingKey::new(self.tiers[depth])));
        }
        self.limits.iter().find_map(|l| {
            let c = if l.counts == Counts::Cost { cost } else { 1 };
            (c > l.capacity)
                .then(|| AcquireError::CostAboveCapacity(CostAboveCapacity::new(l.name, l.tier_name, c, l.capacity)))
        })
    }

    fn snapshot_of(&self, i: usize, remaining: i64, reset: i64) -> LimitSnapshot {
        let l = &self.limits[i];
        LimitSnapshot {
            name: l.name,
            tier: l.tier_name,
            counts: l.counts,
            is_semaphore: l.is_semaphore,
            snapshot: Snapshot {
                quota: l.capacity,
                remaining: u64::try_from(remaining).unwrap_or(0),
                reset: Duration::from_nanos(u64::try_from(reset).unwrap_or(0)),
                window: l.window,
            },
        }
    }

    /// One call of the script: `EVALSHA`, and after `NOSCRIPT` one `EVAL`.
    async fn eval(&self, keys: &[String], args: &[&str]) -> redis::RedisResult<Value> {
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(&*self.sha).arg(keys.len()).arg(keys).arg(args);
        bump(&self.stats.round_trips);
        match self.conn.query(&cmd).await {
            Err(e) if e.code() == Some("NOSCRIPT") => {
                bump(&self.stats.script_loads);
                bump(&self.stats.round_trips);
                let mut cmd = redis::cmd("EVAL");
                cmd.arg(&*self.source).arg(keys.len()).arg(keys).arg(args);
                self.conn.query(&cmd).await
            }
            other => other,
        }
    }

    /// One call under the timeout, feeding the breaker.
    async fn call(&self, keys: &[String], args: &[&str]) -> Result<Value, CallError> {
        match tokio::time::timeout(self.settings.timeout, self.eval(keys, args)).await {
            Ok(Ok(value)) => {
                self.breaker.success();
                Ok(value)
            }
            Ok(Err(e)) => {
                bump(&self.stats.errors);
                self.failed();
                let sent = !(e.is_connection_refusal() || e.kind() == redis::ErrorKind::ClusterConnectionNotFound);
                tracing::debug!(target: "tower_limits_redis", error = %e, "redis call failed");
                Err(CallError { message: e.to_string(), maybe_applied: sent })
            }
            Err(_) => {
                bump(&self.stats.timeouts);
                self.failed();
                Err(CallError { message: format!("no answer within {:?}", self.settings.timeout), maybe_applied: true })
            }
        }
    }

    fn failed(&self) {
        if self.breaker.failure() {
            bump(&self.stats.breaker_opened);
        }
    }

    /// The failure policy's answer.
    fn unavailable(&self, key: &TenantKey, cost: u64, now: Instant, why: &str) -> Result<RedisGrant, AcquireError> {
        bump(&self.stats.unavailable);
        match (&self.settings.failure, &self.fallback) {
            (FailurePolicy::FailOpen, _) => {
                bump(&self.stats.fail_open_admits);
                Ok(RedisGrant { kind: GrantKind::Open })
            }
            (FailurePolicy::Fallback { .. }, Some(local)) => {
                bump(&self.stats.fallback_acquisitions);
                local.acquire_grant(key, cost, now).map(|g| RedisGrant { kind: GrantKind::Local(g) })
            }
            _ => Err(AcquireError::Unavailable(Unavailable::new(format!("redis: {why}")))),
        }
    }

    /// Turns the script's reply into a grant or a denial.
    fn decide(
        &self,
        key: &TenantKey,
        cost: u64,
        now: Instant,
        holder: u64,
        id: Arc<str>,
        reply: &[i64],
    ) -> Result<RedisGrant, AcquireError> {
        let n = self.limits.len();
        let snapshots: Box<[LimitSnapshot]> =
            (0..n).map(|i| self.snapshot_of(i, reply[6 + 2 * i], reply[7 + 2 * i])).collect();
        let at = |v: i64| u64::try_from(v).unwrap_or(0);
        let result = if reply[0] == 1 {
            bump(&self.stats.granted);
            if self.has_semaphore && !self.settings.manual_clock {
                self.hold_lease(key, holder, &id, cost);
            }
            Ok(RedisGrant {
                kind: GrantKind::Remote(Remote {
                    us: at(reply[1]),
                    sub: at(reply[2]),
                    holder,
                    id,
                    acquired: cost,
                    charged: cost,
                    after: None,
                }),
            })
        } else {
            bump(&self.stats.denied);
            let i = usize::try_from(reply[3]).unwrap_or(0).min(n - 1);
            let l = &self.limits[i];
            let retry = Duration::from_nanos(at(reply[4]));
            let needs_release = reply[5] == 1;
            let snapshot = snapshots[i].snapshot;
            if let Some(cache) = &self.denials {
                if !retry.is_zero() {
                    let denial = CachedDenial {
                        until: now + retry,
                        at: now,
                        cost,
                        counts_cost: l.counts == Counts::Cost,
                        limit: i,
                        needs_release,
                        snapshot,
                    };
                    cache.insert(key, denial, |d| d.until <= now);
                }
            }
            Err(AcquireError::Denied(Denial::new(l.name, l.tier_name, i, retry, needs_release, snapshot)))
        };
        if let Some(map) = &self.snapshots {
            map.insert(key, (now, snapshots), |_| true);
        }
        result
    }

    fn hold_lease(&self, key: &TenantKey, holder: u64, id: &Arc<str>, acquired: u64) {
        let mut leases = self.leases.lock().unwrap_or_else(PoisonError::into_inner);
        if leases.len() < self.settings.max_leases {
            let lease = Lease { key: key.clone(), id: id.clone(), acquired, since: tokio::time::Instant::now() };
            leases.insert(holder, lease);
        }
    }

    fn drop_lease(&self, holder: u64) {
        self.leases.lock().unwrap_or_else(PoisonError::into_inner).remove(&holder);
    }

    fn handle(&self) -> Option<Handle> {
        Handle::try_current().ok().or_else(|| self.runtime.get().cloned())
    }
}

#[derive(Debug)]
struct CallError {
    message: String,
    /// Whether the script may have run (the call was sent): a charge must then not be
    /// sent again.
    maybe_applied: bool,
}

fn ints(value: &Value, n: usize) -> Option<Vec<i64>> {
    let Value::Array(items) = value else { return None };
    if items.len() != 6 + 2 * n {
        return None;
    }
    items.iter().map(|v| if let Value::Int(i) = v { Some(*i) } else { None }).collect()
}

/// The remote part of an acquisition.
async fn acquire_remote(
    inner: Arc<Inner>,
    key: TenantKey,
    cost: u64,
    now: Instant,
    holder: u64,
) -> Result<RedisGrant, AcquireError> {
    let keys = inner.keys_for(&key);
    let cost_arg = cost.min(EXACT).to_string();
    let id = inner.holder_id(holder);
    let result = if inner.settings.manual_clock {
        let (us, sub) = inner.now_args(now);
        inner.call(&keys, &["a", &us, &sub, &cost_arg, &id]).await
    } else if inner.records_holders {
        inner.call(&keys, &["a", &cost_arg, &id]).await
    } else {
        inner.call(&keys, &["a", &cost_arg]).await
    };
    let why = match result {
        Ok(value) => match ints(&value, inner.limits.len()) {
            Some(reply) => return inner.decide(&key, cost, now, holder, id, &reply),
            None => {
                bump(&inner.stats.errors);
                inner.failed();
                tracing::warn!(target: "tower_limits_redis", reply = ?value, "unexpected reply from the limit script");
                format!("unexpected reply {value:?}")
            }
        },
        Err(e) => {
            // It may have been granted: give back the concurrency it may hold.
            if e.maybe_applied && inner.has_semaphore {
                let op = Op { id, now, us: 0, sub: 0, acquired: cost, req: (1, 1), cost: (0, 0), release: true };
                spawn_op(&inner, key.clone(), op, None, None);
            }
            e.message
        }
    };
    inner.unavailable(&key, cost, now, &why)
}

/// A settle, release or cancel of one grant, as the script's `s` operation takes it.
#[derive(Debug, Clone)]
struct Op {
    id: Arc<str>,
    /// The caller's now (used only with a manual clock).
    now: Instant,
    us: u64,
    sub: u64,
    acquired: u64,
    /// Limits counting requests: from, to.
    req: (u64, u64),
    /// Limits counting cost: from, to.
    cost: (u64, u64),
    release: bool,
}

impl Op {
    fn adjusts(&self) -> bool {
        self.req.0 != self.req.1 || self.cost.0 != self.cost.1
    }
}

/// Tracks one background operation in the pending count, even if its task is dropped.
struct PendingGuard(Arc<Inner>);

impl Drop for PendingGuard {
    fn drop(&mut self) {
        if self.0.stats.background_pending.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.idle.notify_waiters();
        }
    }
}

/// Runs `op` in the background: after `after` (the grant's previous settle), retried while
/// Redis is away when that cannot apply it twice.
fn spawn_op(
    inner: &Arc<Inner>,
    key: TenantKey,
    op: Op,
    after: Option<oneshot::Receiver<()>>,
    done: Option<oneshot::Sender<()>>,
) {
    let Some(handle) = inner.handle() else {
        bump(&inner.stats.background_failures);
        tracing::warn!(target: "tower_limits_redis", "no tokio runtime to send a release or settle on");
        return;
    };
    inner.stats.background_pending.fetch_add(1, Ordering::AcqRel);
    let guard = PendingGuard(inner.clone());
    handle.spawn(async move {
        let inner = &guard.0;
        if let Some(after) = after {
            let _ = after.await;
        }
        run_op(inner, &key, op).await;
        if let Some(done) = done {
            let _ = done.send(());
        }
        drop(guard);
    });
}

async fn run_op(inner: &Inner, key: &TenantKey, mut op: Op) {
    let keys = inner.keys_for(key);
    let retry_for = inner.settings.lease.max(Duration::from_secs(1));
    let deadline = tokio::time::Instant::now() + retry_for;
    let mut backoff = Duration::from_millis(10);
    loop {
        // Sent even while the breaker is open (the breaker spares the request path, and
        // the backoff bounds these): sent now, a release (and the settle it waits for)
        // reaches Redis before any acquisition sent later on the connection. Held back,
        // the holds of requests that ended during a stall outlived it and refused new
        // requests until the release's backoff ran out.
        {
            let (now_us, now_sub) = inner.now_args(op.now);
            let n = |v: u64| v.min(EXACT).to_string();
            let (us, sub, acq) = (n(op.us), n(op.sub), n(op.acquired));
            let (rq0, rq1, c0, c1) = (n(op.req.0), n(op.req.1), n(op.cost.0), n(op.cost.1));
            let release = if op.release { "1" } else { "0" };
            let args = ["s", &now_us, &now_sub, &op.id, &us, &sub, &acq, &rq0, &rq1, &c0, &c1, release];
            match inner.call(&keys, &args).await {
                Ok(_) => {
                    bump(&inner.stats.background_ops);
                    return;
                }
                Err(e) if e.maybe_applied => {
                    if !op.release {
                        bump(&inner.stats.background_failures);
                        tracing::warn!(target: "tower_limits_redis", error = %e.message, "a settle may not have been applied");
                        return;
                    }
                    // Only the idempotent part is sent again.
                    op.req = (op.req.1, op.req.1);
                    op.cost = (op.cost.1, op.cost.1);
                }
                Err(_) => {}
            }
        }
        if tokio::time::Instant::now() + backoff > deadline {
            bump(&inner.stats.background_failures);
            tracing::warn!(
                target: "tower_limits_redis",
                release = op.release,
                "redis stayed unavailable: gave up a background operation (semaphore holds expire with their lease)"
            );
            return;
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(1));
    }
}

/// Renews the leases of this replica's grants every third of the lease, while the backend
/// lives.
async fn renew_leases(weak: Weak<Inner>, every: Duration) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tick.tick().await;
        let Some(inner) = weak.upgrade() else { return };
        let due: Vec<(TenantKey, Arc<str>, u64)> = {
            let mut leases = inner.leases.lock().unwrap_or_else(PoisonError::into_inner);
            let max_hold = inner.settings.max_hold;
            leases.retain(|_, l| l.since.elapsed() < max_hold);
            leases.values().map(|l| (l.key.clone(), l.id.clone(), l.acquired)).collect()
        };
        for (key, id, acquired) in due {
            if inner.breaker.gate() == Gate::Open {
                break;
            }
            let keys = inner.keys_for(&key);
            let acq = acquired.min(EXACT).to_string();
            if inner.call(&keys, &["n", "", "", &id, &acq]).await.is_ok() {
                bump(&inner.stats.leases_renewed);
            }
        }
    }
}

impl RedisBackend {
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
        loop {
            let notified = pin!(self.inner.idle.notified());
            let mut notified = notified;
            notified.as_mut().enable();
            if self.inner.stats.background_pending.load(Ordering::Acquire) == 0 {
                return;
            }
            notified.await;
        }
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

/// The acquisition future of a [`RedisBackend`]: ready at once for what is decided
/// locally, otherwise one round trip (two after a `NOSCRIPT`) bounded by the timeout.
///
/// # Cancel safety
/// Dropping it while Redis works on it finishes the call in the background and cancels
/// the grant if there was one; nothing is lost.
pub struct RedisAcquire {
    state: AcquireState,
}

type RemoteFuture = Pin<Box<dyn Future<Output = Result<RedisGrant, AcquireError>> + Send>>;

enum AcquireState {
    Ready(Option<Result<RedisGrant, AcquireError>>),
    Remote { fut: RemoteFuture, backend: RedisBackend, key: TenantKey, now: Instant },
    Done,
}

impl fmt::Debug for RedisAcquire {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match self.state {
            AcquireState::Ready(_) => "ready",
            AcquireState::Remote { .. } => "waiting for redis",
            AcquireState::Done => "done",
        };
        f.debug_struct("RedisAcquire").field("state", &state).finish()
    }
}

impl RedisAcquire {
    fn ready(result: Result<RedisGrant, AcquireError>) -> Self {
        RedisAcquire { state: AcquireState::Ready(Some(result)) }
    }
}

impl Future for RedisAcquire {
    type Output = Result<RedisGrant, AcquireError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let out = match &mut self.state {
            AcquireState::Ready(result) => result.take(),
            AcquireState::Remote { fut, .. } => Some(ready!(fut.as_mut().poll(cx))),
            AcquireState::Done => None,
        };
        self.state = AcquireState::Done;
        Poll::Ready(out.unwrap_or_else(|| {
            Err(AcquireError::Unavailable(Unavailable::new("acquisition polled after it completed")))
        }))
    }
}

impl Drop for RedisAcquire {
    fn drop(&mut self) {
        if let AcquireState::Remote { fut, backend, key, now } = std::mem::replace(&mut self.state, AcquireState::Done)
        {
            if let Some(handle) = backend.inner.handle() {
                handle.spawn(async move {
                    if let Ok(grant) = fut.await {
                        backend.cancel(&key, grant, now);
                    }
                });
            }
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
        if let Some(cache) = &inner.denials {
            if let Some((i, retry, needs_release, snapshot)) = cache::lookup(cache, key, cost, now) {
                bump(&inner.stats.cached_denials);
                let l = &inner.limits[i];
                let denial = Denial::new(l.name, l.tier_name, i, retry, needs_release, snapshot);
                return RedisAcquire::ready(Err(AcquireError::Denied(denial)));
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
