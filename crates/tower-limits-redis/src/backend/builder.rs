//! Building a backend: the policy checked for what a script can count exactly, each
//! limit described once (its key suffix, its tier, the script's view of it), the script
//! generated and hashed, and the local fallback scaled to its share. Nothing here talks
//! to Redis; the first acquisition loads the script.

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use tokio::sync::Notify;
use tower_limits_core::algorithm::CalendarPeriod;
use tower_limits_core::{
    AlgorithmKind, Counts, Limit, LimitPolicy, LimitSet, LimitSetPolicy, Rate, Scope, Snapshot, intern,
};

use crate::cache::BoundedMap;
use crate::connection::RedisConnection;
use crate::error::BuildError;
use crate::failure::{Breaker, FailurePolicy};
use crate::keys::{SlotLayout, escape_into};
use crate::script::{self, ScriptLimit};

use super::shares::{self, ShareGroup, ShareLimit, Shares};
use super::{EXACT, Inner, LimitInfo, RedisBackend, Settings};
use crate::stats::Counters;

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
    refusal_cache: usize,
    peek_cache: usize,
    max_leases: usize,
    manual_clock: bool,
    shares: Option<ShareGroup>,
}

impl RedisBackend {
    /// A builder for a backend enforcing `policy`.
    ///
    /// Defaults: namespace `tl`, [`SlotLayout::PerTenant`], a 50 ms timeout,
    /// [`FailurePolicy::FailClosed`], a breaker opening after 3 failures in a row for 1 s,
    /// 30 s leases renewed for at most 1 h, and caches of 10,000 keys for refusals and for
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
            refusal_cache: 10_000,
            peek_cache: 10_000,
            max_leases: 100_000,
            manual_clock: false,
            shares: None,
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

    /// How many keys' refusals are remembered until their `retry_after` (default 10,000;
    /// 0 turns the cache off).
    pub fn refusal_cache(mut self, keys: usize) -> Self {
        self.refusal_cache = keys;
        self
    }

    /// How many keys' last snapshots [`Backend::peek`](tower_limits_core::Backend::peek) can answer from (default 10,000;
    /// 0 turns it off, and `peek` answers nothing). Without it, a grant's reply carries
    /// no states: three integers instead of six and two per limit, which for a set of
    /// three limits saves the server about a twentieth of its work per call. Turn it off
    /// when nothing reads the states (no rate-limit headers, no `peek`).
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

    /// Splits the set's limits among the replicas in capacity shares: each replica decides
    /// from the share it holds, and asks Redis once per refresh period for all of them,
    /// instead of once per request. The fleet still admits at most what each limit allows
    /// over every window. Scopes (a tenant's limit) busy with fewer than
    /// [`Shares::hot_after`] requests a period take from a pool in Redis, one round trip
    /// each. See [`Shares`] and the guide for the scheme and its bounds.
    ///
    /// Every limit of the set must be a GCRA, a token bucket, a semaphore, or a fixed or
    /// calendar window (leased in blocks of units).
    ///
    /// ```no_run
    /// use std::time::Duration;
    /// use tower_limits_core::{LimitPolicy, LimitSetPolicy, Quota, nz};
    /// use tower_limits_redis::{RedisBackend, RedisConnection, Shares};
    ///
    /// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// let policy = LimitSetPolicy::new()
    ///     .tiers(["tenant"])
    ///     .limit(LimitPolicy::gcra("requests", Quota::per_second(nz!(10_000))))
    ///     .limit(LimitPolicy::gcra("per-tenant", Quota::per_second(nz!(100))).per("tenant"));
    /// let redis = RedisConnection::connect("redis://127.0.0.1:6379/").await?;
    /// let backend = RedisBackend::builder(policy).shares(Shares::new()).build(&redis)?;
    /// # let _ = backend;
    /// # Ok(())
    /// # }
    /// ```
    pub fn shares(mut self, shares: Shares) -> Self {
        self.shares = Some(ShareGroup::new(shares));
        self
    }

    /// Capacity shares as with [`RedisBackendBuilder::shares`], with the settings of
    /// `group`, refreshed in one call with the other backends of the group: a replica
    /// with several limit sets (a plan each) costs Redis one refresh a period, not one per
    /// set. The backends of a group must be built on one [`RedisConnection`] (or its
    /// clones) and the same clock; [`RedisBackendBuilder::build`] refuses another.
    ///
    /// ```no_run
    /// use tower_limits_core::{LimitPolicy, LimitSetPolicy, Quota, nz};
    /// use tower_limits_redis::{RedisBackend, RedisConnection, ShareGroup, Shares};
    ///
    /// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// let redis = RedisConnection::connect("redis://127.0.0.1:6379/").await?;
    /// let group = ShareGroup::new(Shares::new());
    /// let requests = LimitSetPolicy::new().limit(LimitPolicy::gcra("requests", Quota::per_second(nz!(1000))));
    /// let bytes = LimitSetPolicy::new().limit(LimitPolicy::gcra("bytes", Quota::per_second(nz!(1_000_000))));
    /// let requests = RedisBackend::builder(requests).namespace("requests").shares_in(&group).build(&redis)?;
    /// let bytes = RedisBackend::builder(bytes).namespace("bytes").shares_in(&group).build(&redis)?;
    /// # let _ = (requests, bytes);
    /// # Ok(())
    /// # }
    /// ```
    pub fn shares_in(mut self, group: &ShareGroup) -> Self {
        self.shares = Some(group.clone());
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
    /// - [`BuildError::Unsupported`] also for a limit in shadow mode
    ///   ([`LimitPolicy::shadow`](tower_limits_core::LimitPolicy::shadow)): shadow limits
    ///   are decided in memory only.
    /// - [`BuildError::Invalid`]: a namespace or tag containing braces, a zero timeout or
    ///   lease, a fallback share outside `(0, 1]`, shares that cannot hold (naming the
    ///   setting), a [`ShareGroup`] whose backends are on another connection or clock
    ///   (`shares_in`).
    pub fn build(self, connection: &RedisConnection) -> Result<RedisBackend, BuildError> {
        self.policy.validate()?;
        #[cfg(feature = "metrics")]
        crate::metrics::register(crate::metrics::LIMITS);
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
        if let Some(group) = &self.shares {
            // A test's clock is not the one the timeout runs on.
            group.settings().validate(if self.manual_clock { Duration::ZERO } else { self.timeout })?;
            if let Some(message) = group.shared.refuses(connection, self.manual_clock) {
                return Err(BuildError::Invalid { field: "shares_in", message });
            }
        }
        let share_settings = self.shares.as_ref().map(ShareGroup::settings);
        let tiers: Box<[&'static str]> = self.policy.tiers.iter().map(|t| intern(t)).collect();
        let mut limits = Vec::with_capacity(self.policy.limits.len());
        let mut script_limits = Vec::with_capacity(self.policy.limits.len());
        for p in &self.policy.limits {
            if p.shadow {
                return Err(BuildError::Unsupported {
                    limit: p.name.clone(),
                    reason: "shadow mode is decided in memory only: enforce this limit, or try it on an \
                             in-memory LimitSetLayer in shadow mode"
                        .into(),
                });
            }
            let (info, mut script) = describe(p, &self.policy.tiers, &tiers, share_settings.as_ref())?;
            if let ScriptLimit::Calendar { slot, .. } = &mut script {
                *slot = script_limits.iter().filter(|l| matches!(l, ScriptLimit::Calendar { .. })).count();
            }
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
        let mut semaphores =
            script_limits.iter().enumerate().filter(|(_, l)| matches!(l, ScriptLimit::Semaphore { .. }));
        let lone_request_semaphore = match (semaphores.next(), semaphores.next()) {
            (Some((i, ScriptLimit::Semaphore { cost: false, .. })), None) => Some(i),
            _ => None,
        };
        let settles = limits.iter().any(|l| !l.is_semaphore && l.counts == Counts::Cost);
        // A calendar window's bounds come after the holder id: it is sent then too.
        let records_holders = script_limits.iter().any(|l| {
            matches!(l, ScriptLimit::Semaphore { .. } | ScriptLimit::Log { .. } | ScriptLimit::Calendar { .. })
        });
        let depth_needed = limits.iter().filter_map(|l| l.tier).map(|t| t + 1).max().unwrap_or(0);
        let backend = RedisBackend {
            inner: Arc::new(Inner {
                conn: connection.clone(),
                source,
                sha,
                limits: limits.into(),
                tiers,
                depth_needed,
                has_semaphore,
                lone_request_semaphore,
                records_holders,
                has_calendar: script_limits.iter().any(|l| matches!(l, ScriptLimit::Calendar { .. })),
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
                refusals: (self.refusal_cache > 0).then(|| BoundedMap::new(self.refusal_cache)),
                snapshots: (self.peek_cache > 0).then(|| BoundedMap::new(self.peek_cache)),
                fallback,
                policy: self.policy.clone(),
                stats: Counters::default(),
                instance,
                next_holder: AtomicU64::new(1),
                idle: Notify::new(),
                releases_pending: AtomicU64::new(0),
                releases_done: Notify::new(),
                leases: Mutex::new(HashMap::new()),
                runtime: OnceLock::new(),
                renewing: AtomicBool::new(false),
                shares: self
                    .shares
                    .as_ref()
                    .map(|g| Arc::new(shares::Table::new(g.shared.clone(), instance, self.lease))),
            }),
        };
        if let Some(group) = &self.shares {
            group.shared.join(&backend.inner);
        }
        Ok(backend)
    }
}

pub(super) fn tag(layout: &SlotLayout) -> &str {
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
    shares: Option<&Shares>,
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
            let quota = match &limit {
                Limit::Gcra(g) => g.quota(),
                Limit::TokenBucket(t) => t.quota(),
                _ => unreachable!("matched above"),
            };
            let burst = quota.max_burst();
            let interval = u64::try_from(quota.interval().as_nanos()).unwrap_or(u64::MAX);
            let tolerance = interval.saturating_mul(burst);
            if tolerance >= EXACT {
                return Err(unsupported(format!(
                    "its burst of {burst} at {} spans more than the 52 days a script counts exactly",
                    quota.rate()
                )));
            }
            (ScriptLimit::Gcra { cost, interval, tolerance }, Snapshot::rate_quota(quota).1)
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
        Limit::CalendarWindow(w) => {
            let nominal = match w.period() {
                CalendarPeriod::Day => 1,
                CalendarPeriod::Week => 7,
                CalendarPeriod::Month => 30,
                CalendarPeriod::Year => 365,
            };
            // The slot (its place among the set's calendar windows) is set by the caller.
            (
                ScriptLimit::Calendar { cost, limit: exact("limit", w.limit())?, slot: 0 },
                Duration::from_secs(nominal * 86_400),
            )
        }
    };
    let tier = match &p.scope {
        Scope::Global => None,
        Scope::Tier(t) => tier_names.iter().position(|x| x == t),
    };
    let share = match shares {
        Some(shares) => Some(share_limit(&limit, shares.excess_percent()).map_err(unsupported)?),
        None => None,
    };
    let mut suffix = String::from(":");
    escape_into(&mut suffix, &p.name);
    suffix.push(':');
    // A share table is not the limit's per-request state: its own kind.
    suffix.push(if shares.is_some() { 'S' } else { script.kind() });
    let info = LimitInfo {
        name: intern(&p.name),
        tier,
        tier_name: tier.map(|t| tiers[t]),
        counts: p.counts,
        capacity: limit.capacity(),
        is_semaphore: limit.is_semaphore(),
        quota: match &limit {
            Limit::Gcra(g) => Snapshot::rate_quota(g.quota()).0,
            Limit::TokenBucket(t) => Snapshot::rate_quota(t.quota()).0,
            _ => limit.capacity(),
        },
        window,
        suffix: suffix.into(),
        share,
        calendar: match &limit {
            Limit::CalendarWindow(w) => Some(w.clone()),
            _ => None,
        },
    };
    Ok((info, script))
}

/// A limit as the share tables count it: a rate (its burst raised by the excess the
/// shares allow) or a semaphore, with every number the script multiplies below 2^53.
fn share_limit(limit: &Limit, excess_percent: u32) -> Result<ShareLimit, String> {
    let quota = match limit {
        Limit::Gcra(g) => g.quota(),
        Limit::TokenBucket(t) => t.quota(),
        Limit::Semaphore(_) => {
            let amount = limit.capacity();
            if amount >= 1 << 53 {
                return Err(format!("its capacity {amount} is above 2^53, the largest integer a share table counts"));
            }
            return Ok(ShareLimit { amount, period_us: 1, burst: 0, permits: true, window: false });
        }
        Limit::FixedWindow(_) | Limit::CalendarWindow(_) => {
            let amount = limit.capacity();
            if amount >= 1 << 53 {
                return Err(format!("its limit {amount} is above 2^53, the largest integer a share table counts"));
            }
            let period_us = match limit {
                Limit::FixedWindow(w) => u64::try_from(w.window().as_micros()).unwrap_or(u64::MAX),
                _ => 0,
            };
            return Ok(ShareLimit { amount, period_us, burst: 0, permits: false, window: true });
        }
        _ => {
            return Err("capacity shares split rates, semaphores and fixed or calendar windows: a sliding \
                        window cannot be shared (use a GCRA or a token bucket)"
                .into());
        }
    };
    // The burst the shares split: the limit's, plus the excess the user allows.
    let rate = quota.rate();
    let burst = quota.max_burst().saturating_add(quota.max_burst().saturating_mul(u64::from(excess_percent)) / 100);
    let nanos = rate.period().as_nanos();
    if nanos % 1000 != 0 {
        return Err(format!(
            "its period {:?} is not a whole number of microseconds, the resolution of the share tables",
            rate.period()
        ));
    }
    let period_us = u64::try_from(nanos / 1000).unwrap_or(u64::MAX);
    if u128::from(burst) * u128::from(period_us) >= 1 << 53 {
        return Err(format!(
            "its burst of {burst} times its period in microseconds ({period_us}) is above 2^53, \
             the largest integer a share table counts exactly: count in larger units"
        ));
    }
    Ok(ShareLimit { amount: rate.amount(), period_us, burst, permits: false, window: false })
}

/// The policy with every limit scaled to `share`, for the local fallback.
pub(super) fn scaled(policy: &LimitSetPolicy, share: f64) -> LimitSetPolicy {
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
            AlgorithmKind::SlidingWindowLog
            | AlgorithmKind::SlidingWindowCounter
            | AlgorithmKind::FixedWindow
            | AlgorithmKind::CalendarWindow => {
                l.limit = l.limit.map(scale);
            }
            AlgorithmKind::Semaphore => l.capacity = l.capacity.map(scale),
        }
    }
    policy
}
