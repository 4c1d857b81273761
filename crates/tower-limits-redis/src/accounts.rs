//! Upstream accounts shared by a fleet: the members of a
//! [`LimitPool`](tower_limits_core::LimitPool) mirrored in Redis.
//!
//! # Why
//!
//! An in-memory pool lets each replica believe it owns every account, so a fleet of `n`
//! replicas must give each a fixed `1/n` of every account: a replica that gets more
//! traffic throttles while the others leave quota unused, adding a replica means
//! reconfiguring all of them, and a `429` seen by one does not slow the others.
//! [`RedisAccounts`] keeps one mirror per account in Redis, which every replica charges:
//! no `n` in the configuration, and feedback from the upstream is applied once for all.
//!
//! # One round trip to choose and charge
//!
//! An acquisition is one `EVALSHA` of the pool's script over every member's keys: it
//! reads the server's `TIME` once, skips benched members, evaluates each member's limits
//! (GCRA or token bucket, over the whole account) for the cost, picks the member with
//! the most headroom (the largest smallest-remaining-fraction over its limits after the
//! cost), and charges it; if none passes, nothing is written and the reply carries the
//! wait until the first would. The reply also carries every member's bench, which this
//! replica remembers for [`SharedAccounts::benched_until`].
//!
//! # Turns between replicas
//!
//! When capacity is scarce, every replica's waiting request retries when the account
//! frees, and the smallest request would always fit first: a replica whose next request
//! is large would starve. So the first replica refused takes the turn (key
//! `<namespace>:{<pool>}:hold`, its id and a deadline): until it is served, or its wait
//! plus 50 ms has passed (a replica that died or gave up), the others are refused with
//! the time left. Replicas are thereby served in the order they came to need the
//! accounts; inside a replica its fair queue orders the tenants.
//!
//! # Fair shares across the fleet
//!
//! Built with [`RedisAccountsBuilder::fleet`], the store replaces those turns with
//! start-time fair queuing among the replicas, kept in the pool's own script, so the
//! fairness decision and the account's charge stay one round trip. Each acquisition
//! carries the demand the replica's fair queue published (per tenant: weight, requests
//! waiting, requests waiting or in flight) and the request's tenant. The script keeps, in
//! the hash `<namespace>:{<pool>}:fleet`, the fleet's virtual time `V` and per replica
//! its finish tag, the start tag it waits with and its last demand report. From the
//! reports it computes the caller's share of each of its tenants' fleet demand
//! (`s_t = d_r,t / Σ_r d_r,t`, `d` the requests waiting or in flight) and the caller's
//! weight `W_r = Σ_t w_t · s_t` over the tenants it has waiting. The caller starts at
//! `S = max(V, F_r)`; it is served only if no other replica waits with a lower start
//! tag, and then `V = max(V, S)`, `F_r = S + cost / W_r`; a replica with more waiting
//! keeps its place with its next start tag for 50 ms, while its next request comes. The
//! reply carries the shares, which the fair queue uses as its tenants' weights
//! (`w_t · s_t`): tenant `t` gets, over the replicas, capacity in proportion to
//! `Σ_r w_t · s_r,t = w_t`. A report counts for 250 ms after the replica's last
//! acquisition, a wait for the replica's retry plus 50 ms, a finish tag for 10 s; a call
//! that fails clears the shares (per-replica fairness until Redis answers). The bounds
//! are in the guide.
//!
//! # Leases
//!
//! Built with [`RedisAccountsBuilder::leases`], the store asks Redis once per refresh
//! period instead of once per request: each replica holds a fraction of every member,
//! granted by Redis by the replicas' weighted demand, and decides from it locally. The
//! scheme and its bounds are in [`lease`].
//!
//! # One round trip, batched, after the call
//!
//! Settles (the real token count), cancels (a refund) and upstream reports (`Retry-After`
//! benches the member; `x-ratelimit-remaining-*` lower than the mirror's charge it down)
//! go to one background task per store, which sends whatever has accumulated as one
//! `EVALSHA` (up to 64 operations per call). Under load that is far less than one round
//! trip per request. A settle is not resent after a timeout (it may have been applied).
//!
//! # Keys and Cluster slots
//!
//! `<namespace>:{<pool>}:<member>:<limit>:g` holds a limit's theoretical arrival time in
//! whole microseconds of the server clock (charges round up, so the mirror never grants
//! more than the account); `<namespace>:{<pool>}:<member>:bench` the instant until which
//! the member is benched. The hash tag `{<pool>}` keeps one pool's keys in one slot, so
//! the script can take them all on a Redis Cluster. Keys expire once their state is
//! indistinguishable from a fresh one.
//!
//! # When Redis does not answer
//!
//! An acquisition is bounded by the timeout and a circuit breaker spares Redis while it
//! is away. [`FailurePolicy::FailClosed`] refuses (the caller answers 503);
//! [`FailurePolicy::Fallback`] makes the pool decide in its members' local sets, which
//! the caller sizes to this replica's share of each account (`1/n` of a fleet of `n`):
//! the fleet then stays within the accounts as long as the share is right.
//! [`FailurePolicy::FailOpen`] is refused when the store is built: an upstream account
//! does not forgive. An acquisition that timed out may have been charged; the charge is
//! kept (the account is under-used, never overrun). Dropping an acquisition future while
//! Redis works on it keeps its charge too.
//!
//! # Restarted empty
//!
//! A Redis that restarts empty (or is flushed, or fails over to a replica that had not
//! caught up) forgets what the accounts were charged, while the upstream's windows still
//! count it. The pool's key `<namespace>:{<pool>}:epoch` tells: it is written by the first
//! call and never expires, so a call from a store that reached Redis before and finds no
//! epoch knows the state was lost. That call starts every member with its bursts spent:
//! the mirrors admit at their rates alone until the bursts refill, so over any window an
//! account is charged at most its burst plus its rate, what it was charged before the
//! loss included. A store's first call after it was built cannot tell a lost state from
//! a new fleet: a fleet that loses its Redis at the same moment as every replica restarts
//! may be charged one burst more.

use std::fmt;
use std::fmt::Write as _;
use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use redis::Value;
use tokio::sync::{mpsc, oneshot};
use tower_limits_core::fleet::FleetShares;
use tower_limits_core::{
    AcquireError, AlgorithmKind, CostAboveCapacity, Counts, Instant, Limit, LimitRefusal, LimitSetPolicy, Scope,
    SharedAccounts, SharedAcquire, SharedGrant, Snapshot, TenantKey, Unavailable, UpstreamReport, intern,
};

use crate::connection::RedisConnection;
use crate::error::BuildError;
use crate::failure::{Breaker, FailurePolicy, Gate};
use crate::keys::escape_into;

pub mod lease;

pub use lease::AccountLeases;
use lease::{Decision, LeasedLimit, Leases};

/// The most operations one background call carries.
const BATCH: usize = 64;

/// How long a replica's reported demand counts after its last acquisition, us.
const DEMAND_LIVES_US: u64 = 250_000;
/// How long a replica's finish tag is kept after its last grant, us.
const TAG_LIVES_US: u64 = 10_000_000;
/// The wait of a replica refused because another's turn comes first while there is
/// room, ns.
const BLOCKED_NS: u64 = 2_000_000;

/// A pool's members mirrored in Redis, shared by every replica built with the same pool
/// name and namespace. Hand it to
/// [`LimitPoolBuilder::shared`](tower_limits_core::pool::LimitPoolBuilder::shared). See
/// the [module docs](self). Clones share everything.
#[derive(Clone)]
pub struct RedisAccounts {
    inner: Arc<Inner>,
}

struct Inner {
    conn: RedisConnection,
    source: Arc<str>,
    sha: Arc<str>,
    keys: Vec<String>,
    members: Vec<MemberInfo>,
    timeout: Duration,
    failure: FailurePolicy,
    breaker: Breaker,
    /// Per member: server-clock nanoseconds until which it is benched, as last heard,
    /// translated to the caller's clock at the time it was heard.
    benched: Mutex<Vec<u64>>,
    ops: mpsc::UnboundedSender<Op>,
    stats: Stats,
    /// This store's id in the turn key and the fleet's hash.
    id: String,
    /// Fleet-wide fairness: the fair queue's backlog to report, this replica's shares to
    /// set.
    fleet: Option<Arc<FleetShares>>,
    /// The script takes the time from the caller (tests).
    manual_clock: bool,
    /// The caller's last now, us (for the background calls of a manual clock).
    last_now_us: AtomicU64,
    /// Whether a call of this store was answered: a store found empty after that lost
    /// its state (see the module docs, "Restarted empty").
    reached: AtomicBool,
    /// With [`RedisAccountsBuilder::leases`]: this replica's lease of the pool.
    leases: Option<Leases>,
}

struct MemberInfo {
    name: String,
    /// The largest cost each cost-counting limit can ever grant (the smallest of them).
    max_cost: u64,
    /// The name of the member's first limit, for refusals.
    limit: &'static str,
}

#[derive(Default)]
struct Stats {
    acquire_calls: AtomicU64,
    lease_refreshes: AtomicU64,
    leased_grants: AtomicU64,
    batch_calls: AtomicU64,
    batched_ops: AtomicU64,
    failures: AtomicU64,
}

/// Counters of a [`RedisAccounts`] (this replica's view).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct AccountStats {
    /// Acquisition calls sent (one round trip each, two after a `NOSCRIPT`).
    pub acquire_calls: u64,
    /// Background calls sent, each carrying one or more settles, cancels and reports.
    pub batch_calls: u64,
    /// Settles, cancels and reports those calls carried.
    pub batched_ops: u64,
    /// Calls that failed or timed out.
    pub failures: u64,
    /// Lease refreshes sent ([`RedisAccountsBuilder::leases`]), one round trip each.
    pub lease_refreshes: u64,
    /// Acquisitions granted from this replica's lease, with no round trip.
    pub leased_grants: u64,
}

/// A background operation: an adjustment of a member's charges, or an upstream report.
#[derive(Debug)]
enum Op {
    Adjust {
        member: usize,
        requests: i64,
        cost: i64,
    },
    Report {
        member: usize,
        retry_us: i64,
        requests: i64,
        tokens: i64,
    },
    /// Answered once everything queued before it was sent and answered (or given up).
    Flush(oneshot::Sender<()>),
}

/// Builds a [`RedisAccounts`]; from [`RedisAccounts::builder`].
#[derive(Debug, Clone)]
#[must_use]
pub struct RedisAccountsBuilder {
    pool: String,
    namespace: String,
    members: Vec<(String, LimitSetPolicy)>,
    timeout: Duration,
    failure: FailurePolicy,
    breaker: (u32, Duration),
    fleet: Option<Arc<FleetShares>>,
    manual_clock: bool,
    leases: Option<AccountLeases>,
}

impl fmt::Debug for RedisAccounts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisAccounts")
            .field("members", &self.inner.members.iter().map(|m| &m.name).collect::<Vec<_>>())
            .field("sha", &self.inner.sha)
            .finish_non_exhaustive()
    }
}

impl RedisAccounts {
    /// A builder for the accounts of the pool named `pool` (the name is the hash tag of
    /// every key: replicas sharing accounts use the same name and namespace).
    ///
    /// Defaults: namespace `tl`, a 50 ms timeout, [`FailurePolicy::FailClosed`], a
    /// breaker opening after 3 failures in a row for 1 s.
    pub fn builder(pool: impl Into<String>) -> RedisAccountsBuilder {
        RedisAccountsBuilder {
            pool: pool.into(),
            namespace: "tl".to_owned(),
            members: Vec::new(),
            timeout: Duration::from_millis(50),
            failure: FailurePolicy::FailClosed,
            breaker: (3, Duration::from_secs(1)),
            fleet: None,
            manual_clock: false,
            leases: None,
        }
    }

    /// Counters of this store.
    #[must_use]
    pub fn stats(&self) -> AccountStats {
        let s = &self.inner.stats;
        AccountStats {
            acquire_calls: s.acquire_calls.load(Ordering::Relaxed),
            batch_calls: s.batch_calls.load(Ordering::Relaxed),
            batched_ops: s.batched_ops.load(Ordering::Relaxed),
            failures: s.failures.load(Ordering::Relaxed),
            lease_refreshes: s.lease_refreshes.load(Ordering::Relaxed),
            leased_grants: s.leased_grants.load(Ordering::Relaxed),
        }
    }

    /// Waits until every settle, cancel and report queued so far has been sent and
    /// answered (or given up): for tests, and before a graceful exit.
    ///
    /// # Cancel safety
    /// Dropping the future cancels only the wait.
    pub async fn flush(&self) {
        let (tx, rx) = oneshot::channel();
        if self.inner.ops.send(Op::Flush(tx)).is_ok() {
            let _ = rx.await;
        }
    }

    /// The Redis keys of the pool: per member its bench key, then one per limit.
    #[must_use]
    pub fn keys(&self) -> &[String] {
        &self.inner.keys
    }

    /// The pool's Lua script.
    #[must_use]
    pub fn script(&self) -> &str {
        &self.inner.source
    }
}

impl RedisAccountsBuilder {
    /// One more member: an account named `name` whose limits `policy` mirrors. Its limits
    /// must be GCRA or token-bucket limits over the whole account (no tiers).
    pub fn member(mut self, name: impl Into<String>, policy: LimitSetPolicy) -> Self {
        self.members.push((name.into(), policy));
        self
    }

    /// The prefix of every key (default `tl`).
    pub fn namespace(mut self, namespace: impl Into<String>) -> Self {
        self.namespace = namespace.into();
        self
    }

    /// How long a call to Redis may take before the failure policy decides (default 50 ms).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// What acquisitions do when Redis cannot answer: fail closed (the default), or fall
    /// back to the pool's local sets (the `share` is the caller's to apply to them).
    pub fn on_failure(mut self, policy: FailurePolicy) -> Self {
        self.failure = policy;
        self
    }

    /// The circuit breaker: open after `failures` failed calls in a row, for `open_for`.
    pub fn circuit_breaker(mut self, failures: u32, open_for: Duration) -> Self {
        self.breaker = (failures, open_for);
        self
    }

    /// Shares the accounts fairly across the fleet: every acquisition reports the
    /// backlog this replica's fair queue published to `fleet` (the same handle given to
    /// its [`FairQueueLayer::fleet`](https://docs.rs/tower-limits)), the replicas
    /// competing for the accounts take turns in start-time fair order weighted by their
    /// tenants' weights and demand, and the answer sets this replica's shares in `fleet`.
    /// See the guide's "Fleet-wide weighted fairness". Every replica sharing the pool
    /// must use it, or none.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use tower_limits_core::FleetShares;
    /// use tower_limits_redis::RedisAccounts;
    ///
    /// let fleet = Arc::new(FleetShares::new());
    /// let builder = RedisAccounts::builder("accounts").fleet(fleet.clone());
    /// # drop(builder);
    /// ```
    pub fn fleet(mut self, fleet: Arc<FleetShares>) -> Self {
        self.fleet = Some(fleet);
        self
    }

    /// Decides the accounts from leases: this replica holds a fraction of every member,
    /// granted by Redis and refreshed once per period for all of them, and admits from it
    /// with no round trip. The fractions follow the replicas' demand, weighted by their
    /// tenants' weights with [`fleet`](Self::fleet), and never sum to more than the whole
    /// pool: over every window the fleet charges an account at most its burst plus its
    /// rate. See [the scheme and its bounds](lease) and [`AccountLeases`].
    ///
    /// ```
    /// use tower_limits_redis::{AccountLeases, RedisAccounts};
    ///
    /// let builder = RedisAccounts::builder("accounts").leases(AccountLeases::new());
    /// # drop(builder);
    /// ```
    pub fn leases(mut self, leases: AccountLeases) -> Self {
        self.leases = Some(leases);
        self
    }

    /// Test support: the script decides with the `now` each acquisition is given (a
    /// [`ManualClock`](tower_limits_core::ManualClock)) instead of the server's `TIME`;
    /// background calls use the last one. Keys then expire an hour later than their
    /// state needs. Never in production: replicas' clocks disagree.
    ///
    /// ```
    /// use tower_limits_redis::RedisAccounts;
    ///
    /// let builder = RedisAccounts::builder("accounts").manual_clock();
    /// # drop(builder);
    /// ```
    #[cfg(feature = "test-support")]
    pub fn manual_clock(mut self) -> Self {
        self.manual_clock = true;
        self
    }

    /// Validates everything and builds the store on `connection`. Must be called inside
    /// a tokio runtime (it starts the background task that sends settles and reports).
    ///
    /// # Errors
    /// - [`BuildError::Policy`]: a member's policy is invalid.
    /// - [`BuildError::Unsupported`]: a limit other than GCRA or token bucket, a limit
    ///   keyed by a tier, or a tolerance beyond the 52 days a script counts exactly.
    /// - [`BuildError::Invalid`]: no member, two members with one name, a pool name or
    ///   namespace empty or with braces, a zero timeout, [`FailurePolicy::FailOpen`], or
    ///   no tokio runtime.
    pub fn build(self, connection: &RedisConnection) -> Result<RedisAccounts, BuildError> {
        let invalid = |field: &'static str, message: String| BuildError::Invalid { field, message };
        for (field, text) in [("pool", self.pool.as_str()), ("namespace", self.namespace.as_str())] {
            if text.is_empty() || text.contains(['{', '}']) {
                return Err(invalid(field, format!("{text:?} must be non-empty, without braces")));
            }
        }
        if self.members.is_empty() {
            return Err(invalid("members", "a pool needs at least one member".into()));
        }
        if self.timeout.is_zero() {
            return Err(invalid("timeout", "the timeout must be positive".into()));
        }
        if self.failure == FailurePolicy::FailOpen {
            return Err(invalid(
                "on_failure",
                "an upstream account cannot fail open: choose FailClosed or Fallback".into(),
            ));
        }
        if let Some(leases) = &self.leases {
            if leases.refresh().is_zero() {
                return Err(invalid("leases.refresh", "the refresh period must be positive".into()));
            }
            // (On a manual clock, calls take no time the leases count.)
            let call = if self.manual_clock { Duration::ZERO } else { self.timeout };
            if leases.lasts() < leases.refresh() * 2 + call {
                return Err(invalid(
                    "leases.lifetime",
                    format!(
                        "a lease of {:?} cannot outlive two refreshes of {:?} and a call of {:?}",
                        leases.lasts(),
                        leases.refresh(),
                        call
                    ),
                ));
            }
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return Err(invalid("runtime", "build the accounts inside a tokio runtime".into()));
        };
        let mut prefix = format!("{}:{{", self.namespace);
        escape_into(&mut prefix, &self.pool);
        prefix.push_str("}:");
        let mut keys = Vec::new();
        let mut members = Vec::new();
        let mut leased = Vec::new();
        let mut table = String::from("local M = {\n");
        for (i, (name, policy)) in self.members.iter().enumerate() {
            if self.members[..i].iter().any(|(n, _)| n == name) {
                return Err(invalid("members", format!("{name:?} is already a member's name")));
            }
            policy.validate()?;
            let mut base = prefix.clone();
            escape_into(&mut base, name);
            keys.push(format!("{base}:bench"));
            let _ = write!(table, "  {{b = {}, l = {{", keys.len());
            let mut max_cost = u64::MAX;
            let mut limits = Vec::new();
            for p in &policy.limits {
                let unsupported =
                    |reason: &str| BuildError::Unsupported { limit: p.name.clone(), reason: reason.into() };
                if !matches!(p.algorithm, AlgorithmKind::Gcra | AlgorithmKind::TokenBucket) {
                    return Err(unsupported("an account's limits in Redis are GCRA or token-bucket limits"));
                }
                if p.scope != Scope::Global {
                    return Err(unsupported("an account's limits cover the whole account (no tier)"));
                }
                let quota = match Limit::from_policy(p)? {
                    Limit::Gcra(g) => g.quota(),
                    Limit::TokenBucket(t) => t.quota(),
                    _ => return Err(unsupported("an account's limits in Redis are GCRA or token-bucket limits")),
                };
                let burst = quota.max_burst();
                limits.push(LeasedLimit {
                    amount: quota.amount(),
                    period_ns: u64::try_from(quota.period().as_nanos()).unwrap_or(u64::MAX),
                    burst,
                    cost: p.counts == Counts::Cost,
                });
                let interval = u64::try_from(quota.interval().as_nanos()).unwrap_or(u64::MAX);
                let tolerance = interval.saturating_mul(burst);
                if tolerance >= 1 << 52 {
                    return Err(unsupported("its burst spans more than the 52 days a script counts exactly"));
                }
                let cost = p.counts == Counts::Cost;
                if cost {
                    max_cost = max_cost.min(burst);
                }
                let mut key = base.clone();
                key.push(':');
                escape_into(&mut key, &p.name);
                key.push_str(":g");
                keys.push(key);
                let _ = write!(
                    table,
                    "{{k = {}, iv = {interval}, tol = {tolerance}, c = {}}}, ",
                    keys.len(),
                    u8::from(cost)
                );
            }
            table.push_str("}},\n");
            let limit = policy.limits.first().map_or("account", |l| intern(&l.name));
            members.push(MemberInfo { name: name.clone(), max_cost, limit });
            leased.push(limits);
        }
        table.push_str("}\n");
        keys.push(format!("{prefix}hold"));
        let _ = writeln!(table, "local HOLD = KEYS[{}]", keys.len());
        keys.push(format!("{prefix}fleet"));
        let _ = writeln!(table, "local FLEET = KEYS[{}]", keys.len());
        keys.push(format!("{prefix}epoch"));
        let _ = writeln!(table, "local EPOCH = KEYS[{}]", keys.len());
        keys.push(format!("{prefix}leases"));
        let _ = writeln!(table, "local LEASES = KEYS[{}]", keys.len());
        keys.push(format!("{prefix}lost"));
        let _ = writeln!(table, "local LOST = KEYS[{}]", keys.len());
        let life_us = self.leases.map_or(0, |l| l.lasts().as_micros());
        let smallest = self.leases.map_or(1, |l| l.smallest_fraction(&leased));
        let _ = writeln!(table, "local LIFE, WHOLE, QMIN = {life_us}, {}, {smallest}", lease::WHOLE);
        let _ = writeln!(table, "local LIVE, IDLE, BLOCKED = {DEMAND_LIVES_US}, {TAG_LIVES_US}, {BLOCKED_NS}");
        // The last arguments: whether this store reached Redis before, then (on a manual
        // clock) the time.
        if self.manual_clock {
            table.push_str("local NOW, SLACK = tonumber(ARGV[#ARGV]), 3600000\n");
            table.push_str("local KNOWN = ARGV[#ARGV - 1] == '1'\n");
        } else {
            table.push_str("local T = redis.call('TIME')\nlocal NOW, SLACK = T[1] * 1000000 + T[2], 0\n");
            table.push_str("local KNOWN = ARGV[#ARGV] == '1'\n");
        }
        let source: Arc<str> = format!("{table}{SCRIPT}").into();
        let sha: Arc<str> = redis::Script::new(&source).get_hash().into();
        let (tx, rx) = mpsc::unbounded_channel();
        let n = members.len();
        #[cfg(feature = "metrics")]
        crate::metrics::register(crate::metrics::ACCOUNTS);
        let inner = Arc::new(Inner {
            conn: connection.clone(),
            source,
            sha,
            keys,
            members,
            timeout: self.timeout,
            failure: self.failure,
            breaker: Breaker::new(self.breaker.0, self.breaker.1),
            benched: Mutex::new(vec![0; n]),
            ops: tx,
            stats: Stats::default(),
            id: format!("{:016x}", RandomState::new().hash_one((std::process::id(), std::time::SystemTime::now(), n))),
            fleet: self.fleet,
            manual_clock: self.manual_clock,
            last_now_us: AtomicU64::new(0),
            reached: AtomicBool::new(false),
            leases: self.leases.map(|settings| Leases::new(settings, leased)),
        });
        runtime.spawn(send_batches(Arc::downgrade(&inner), rx));
        // On a manual clock the test chooses when leases are refreshed.
        if let Some(leases) = inner.leases.as_ref().filter(|_| !inner.manual_clock) {
            runtime.spawn(renew_leases(Arc::downgrade(&inner), leases.settings.refresh()));
        }
        Ok(RedisAccounts { inner })
    }
}

/// The script after the members' table: `a` acquires, `b` applies a batch.
const SCRIPT: &str = include_str!("accounts/script.lua");

impl Inner {
    async fn eval(&self, args: &[String]) -> redis::RedisResult<Value> {
        let mut args = args.to_vec();
        args.push(if self.reached.load(Ordering::Relaxed) { "1" } else { "0" }.to_owned());
        if self.manual_clock {
            args.push(self.last_now_us.load(Ordering::Relaxed).to_string());
        }
        let args = &args[..];
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(&*self.sha).arg(self.keys.len()).arg(&self.keys).arg(args);
        match self.conn.query(&cmd).await {
            Err(e) if e.code() == Some("NOSCRIPT") => {
                let mut cmd = redis::cmd("EVAL");
                cmd.arg(&*self.source).arg(self.keys.len()).arg(&self.keys).arg(args);
                self.conn.query(&cmd).await
            }
            other => other,
        }
    }

    /// One call under the timeout, feeding the breaker.
    async fn call(&self, args: &[String]) -> Result<Value, String> {
        let (out, _kind) = match tokio::time::timeout(self.timeout, self.eval(args)).await {
            Ok(Ok(value)) => {
                self.breaker.success();
                self.reached.store(true, Ordering::Relaxed);
                return Ok(value);
            }
            Ok(Err(e)) => (e.to_string(), "error"),
            Err(_) => (format!("no answer within {:?}", self.timeout), "timeout"),
        };
        self.stats.failures.fetch_add(1, Ordering::Relaxed);
        #[cfg(feature = "metrics")]
        crate::metrics::failure(crate::metrics::ACCOUNTS, _kind);
        let _opened = self.breaker.failure();
        #[cfg(feature = "metrics")]
        if _opened {
            crate::metrics::circuit_opened(crate::metrics::ACCOUNTS);
        }
        Err(out)
    }

    fn unavailable(&self, why: &str) -> AcquireError {
        AcquireError::Unavailable(Unavailable::new(format!("redis (upstream accounts): {why}")))
    }

    async fn acquire(
        self: Arc<Self>,
        tenant: Option<TenantKey>,
        cost: u64,
        now: Instant,
    ) -> Result<SharedGrant, AcquireError> {
        self.stats.acquire_calls.fetch_add(1, Ordering::Relaxed);
        if self.manual_clock {
            self.last_now_us.fetch_max(now.as_nanos() / 1000, Ordering::Relaxed);
        }
        let mut args = Vec::new();
        let mut reported = Vec::new();
        match (&self.fleet, tenant) {
            (Some(fleet), Some(tenant)) => {
                reported = fleet.demand();
                args.extend(["f".to_owned(), cost.to_string(), self.id.clone(), tenant.to_string()]);
                demand_args(&reported, &mut args);
            }
            _ => args.extend(["a".to_owned(), cost.to_string(), self.id.clone()]),
        }
        let reply = match self.call(&args).await {
            Ok(reply) => reply,
            Err(e) => {
                // Per-replica fairness until the store answers again.
                if let Some(fleet) = &self.fleet {
                    fleet.clear_shares();
                }
                return Err(self.unavailable(&e));
            }
        };
        let Value::Array(items) = reply else { return Err(self.unavailable("unexpected reply")) };
        let ints: Option<Vec<i64>> =
            items.iter().map(|v| if let Value::Int(i) = v { Some(*i) } else { None }).collect();
        let members = self.members.len();
        let Some(ints) = ints.filter(|v| v.len() == 3 + members + reported.len()) else {
            return Err(self.unavailable("unexpected reply"));
        };
        self.heard(&ints[3..], reported, now);
        match usize::try_from(ints[0]) {
            Ok(best) if best >= 1 => Ok(SharedGrant { index: best - 1, charged: cost }),
            _ => Err(self.refusal(Duration::from_nanos(ints[2].max(0) as u64))),
        }
    }

    /// Takes what a reply says after its first three fields: the members' benches (ns
    /// from `now`), then this replica's part of each `reported` tenant's demand.
    fn heard(&self, rest: &[i64], reported: Vec<tower_limits_core::fleet::TenantDemand>, now: Instant) {
        let members = self.members.len();
        {
            let mut benched = self.benched.lock().unwrap_or_else(PoisonError::into_inner);
            for (b, &w) in benched.iter_mut().zip(&rest[..members]) {
                *b = if w > 0 { now.as_nanos().saturating_add(w as u64) } else { 0 };
            }
        }
        if let Some(fleet) = &self.fleet {
            if !reported.is_empty() {
                let shares = rest[members..].iter().map(|&sh| u32::try_from(sh.max(1)).unwrap_or(1));
                fleet.set_shares(reported.into_iter().map(|d| d.key).zip(shares));
            }
        }
    }

    /// A refusal by the accounts, with the wait until one could grant.
    fn refusal(&self, wait: Duration) -> AcquireError {
        let snapshot = Snapshot { quota: 0, remaining: 0, reset: wait, window: Duration::ZERO };
        let limit = self.members.first().map_or("account", |m| m.limit);
        AcquireError::Refused(LimitRefusal::new(limit, None, 0, wait, false, snapshot))
    }

    /// Renews this replica's lease at `now`, in one call; with `heard` false the answer is
    /// dropped as if lost on its way back (tests). Whether Redis answered.
    async fn refresh_lease(&self, now: Instant, heard: bool) -> bool {
        self.refresh_lease_if(now, heard, false).await
    }

    /// As [`refresh_lease`](Self::refresh_lease); with `unless_held`, nothing is sent if
    /// a lease came in force while this one waited for its turn (requests without a
    /// lease wait for one call, not one each).
    async fn refresh_lease_if(&self, now: Instant, heard: bool, unless_held: bool) -> bool {
        let Some(leases) = &self.leases else { return false };
        let _one_at_a_time = leases.refreshing.lock().await;
        if unless_held && leases.in_force(now) {
            return true;
        }
        if self.manual_clock {
            self.last_now_us.fetch_max(now.as_nanos() / 1000, Ordering::Relaxed);
        }
        let reported = self.fleet.as_ref().map(|f| f.demand()).unwrap_or_default();
        let ((rate, burst), cap, counts) = leases.report(now, reported.iter().any(|d| d.waiting > 0));
        let mut args = vec!["l".to_owned(), self.id.clone(), rate.to_string(), burst.to_string(), cap.to_string()];
        demand_args(&reported, &mut args);
        self.stats.lease_refreshes.fetch_add(1, Ordering::Relaxed);
        let sent = tokio::time::Instant::now();
        let reply = match self.call(&args).await {
            Ok(reply) => reply,
            Err(_) => {
                if let Some(fleet) = &self.fleet {
                    fleet.clear_shares();
                }
                leases.failed(now);
                return false;
            }
        };
        let took = sent.elapsed();
        let ints = match &reply {
            Value::Array(items) => items.iter().map(|v| if let Value::Int(i) = v { Some(*i) } else { None }).collect(),
            _ => None,
        };
        let Some(ints) = ints.filter(|v: &Vec<i64>| v.len() == 3 + self.members.len() + reported.len()) else {
            tracing::warn!(target: "tower_limits_redis", reply = ?reply, "unexpected reply to a lease refresh");
            return false;
        };
        leases.reported(counts);
        self.heard(&ints[3..], reported, now);
        if heard {
            let fraction = |i: i64| u64::try_from(i).unwrap_or(0).min(lease::WHOLE);
            leases.granted(fraction(ints[0]), fraction(ints[1]), now + leases.settings.lasts(), now + took, now);
        }
        true
    }

    fn send(&self, op: Op) {
        if self.ops.send(op).is_err() {
            self.stats.failures.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Sends the queued operations in batches while the store lives.
async fn send_batches(weak: std::sync::Weak<Inner>, mut rx: mpsc::UnboundedReceiver<Op>) {
    let mut batch = Vec::with_capacity(BATCH);
    // While Redis is away every batch fails: one warning every few seconds says so, with
    // how many it stands for.
    let warnings = crate::throttle::Throttle::new();
    while rx.recv_many(&mut batch, BATCH).await > 0 {
        let Some(inner) = weak.upgrade() else { return };
        let mut args = Vec::with_capacity(1 + 5 * batch.len());
        args.push("b".to_owned());
        let mut flushes = Vec::new();
        for op in batch.drain(..) {
            let fields = match op {
                Op::Adjust { member, requests, cost } => [1, member as i64 + 1, requests, cost, 0],
                Op::Report { member, retry_us, requests, tokens } => [2, member as i64 + 1, retry_us, requests, tokens],
                Op::Flush(done) => {
                    flushes.push(done);
                    continue;
                }
            };
            args.extend(fields.iter().map(i64::to_string));
        }
        if args.len() > 1 {
            inner.stats.batch_calls.fetch_add(1, Ordering::Relaxed);
            inner.stats.batched_ops.fetch_add(((args.len() - 1) / 5) as u64, Ordering::Relaxed);
            if let Err(e) = inner.call(&args).await {
                if let Some(suppressed) = warnings.warn_now() {
                    tracing::warn!(
                        target: "tower_limits_redis",
                        error = %e,
                        suppressed,
                        "a batch of account settles and reports may not have been applied"
                    );
                }
            }
        }
        for done in flushes {
            let _ = done.send(());
        }
    }
}

/// The fleet demand a call reports: the count, then per tenant its key, weight, requests
/// waiting, and requests waiting or in flight.
fn demand_args(reported: &[tower_limits_core::fleet::TenantDemand], args: &mut Vec<String>) {
    args.push(reported.len().to_string());
    for d in reported {
        args.extend([d.key.to_string(), d.weight.to_string(), d.waiting.to_string(), d.outstanding.to_string()]);
    }
}

/// Renews this replica's lease every period while the store lives and the replica is busy
/// (an acquisition within a lifetime, or a lease held).
async fn renew_leases(weak: std::sync::Weak<Inner>, every: Duration) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tick.tick().await;
        let Some(inner) = weak.upgrade() else { return };
        let Some(leases) = &inner.leases else { return };
        // The caller's clock, estimated: a lease counted from it ends no later than one
        // counted from the real instant.
        let now = leases.estimated_now();
        if leases.idle(now) || inner.breaker.gate() == Gate::Open {
            continue;
        }
        inner.refresh_lease(now, true).await;
    }
}

fn signed(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

impl RedisAccounts {
    fn acquire_inner(&self, tenant: Option<&TenantKey>, cost: u64, now: Instant) -> SharedAcquire {
        let inner = &self.inner;
        if inner.members.iter().all(|m| cost > m.max_cost) {
            let capacity = inner.members.iter().map(|m| m.max_cost).max().unwrap_or(0);
            let limit = inner.members.first().map_or("account", |m| m.limit);
            let e = AcquireError::CostAboveCapacity(CostAboveCapacity::new(limit, None, cost, capacity));
            return Box::pin(std::future::ready(Err(e)));
        }
        if let Some(leases) = &inner.leases {
            let largest = leases.settings.largest();
            if cost > largest {
                // A lease's burst holds no more than this: it would never pass.
                let limit = inner.members.first().map_or("account", |m| m.limit);
                let e = AcquireError::CostAboveCapacity(CostAboveCapacity::new(limit, None, cost, largest));
                return Box::pin(std::future::ready(Err(e)));
            }
            let benched = inner.benched.lock().unwrap_or_else(PoisonError::into_inner).clone();
            match leases.decide(cost, &benched, now) {
                Decision::Granted(index) => {
                    inner.stats.leased_grants.fetch_add(1, Ordering::Relaxed);
                    return Box::pin(std::future::ready(Ok(SharedGrant { index, charged: cost })));
                }
                Decision::Refused(wait) => return Box::pin(std::future::ready(Err(inner.refusal(wait)))),
                Decision::Down => {
                    return Box::pin(std::future::ready(Err(inner.unavailable("the last lease refresh failed"))));
                }
                Decision::NoLease => {}
            }
        }
        if inner.breaker.gate() == Gate::Open {
            if let Some(fleet) = &inner.fleet {
                fleet.clear_shares();
            }
            return Box::pin(std::future::ready(Err(inner.unavailable("circuit open after repeated failures"))));
        }
        if inner.leases.is_some() {
            // No lease in force: one call for it, then the lease decides.
            let inner = inner.clone();
            return Box::pin(async move {
                if !inner.refresh_lease_if(now, true, true).await {
                    return Err(inner.unavailable("no lease, and the lease refresh failed"));
                }
                let Some(leases) = &inner.leases else { return Err(inner.unavailable("no lease")) };
                let benched = inner.benched.lock().unwrap_or_else(PoisonError::into_inner).clone();
                match leases.decide(cost, &benched, now) {
                    Decision::Granted(index) => {
                        inner.stats.leased_grants.fetch_add(1, Ordering::Relaxed);
                        Ok(SharedGrant { index, charged: cost })
                    }
                    Decision::Refused(wait) => Err(inner.refusal(wait)),
                    Decision::NoLease => Err(inner.refusal(leases.settings.refresh())),
                    Decision::Down => Err(inner.unavailable("the last lease refresh failed")),
                }
            });
        }
        Box::pin(inner.clone().acquire(tenant.cloned(), cost, now))
    }

    /// Renews this replica's lease now ([`RedisAccountsBuilder::leases`]), as the
    /// background task does every refresh period: for tests on a manual clock, where no
    /// background task runs and the test chooses when refreshes happen. Whether Redis answered; `false` without leases.
    ///
    /// # Cancel safety
    /// Dropping the future drops the answer: the replica keeps its lease, and Redis
    /// counts the larger of the two until the next refresh.
    pub async fn refresh_leases(&self, now: Instant) -> bool {
        if let Some(leases) = &self.inner.leases {
            leases.latest.fetch_max(now.as_nanos(), Ordering::Relaxed);
        }
        self.inner.refresh_lease(now, true).await
    }

    /// As [`refresh_leases`](Self::refresh_leases), but the answer is lost on its way
    /// back: Redis applied it, the replica never learns it (tests).
    #[cfg(feature = "test-support")]
    pub async fn refresh_leases_unheard(&self, now: Instant) -> bool {
        if let Some(leases) = &self.inner.leases {
            leases.latest.fetch_max(now.as_nanos(), Ordering::Relaxed);
        }
        self.inner.refresh_lease(now, false).await
    }

    /// The part of every account's rate this replica's lease holds at `now`, from 0 to 1
    /// (`None` without leases).
    #[must_use]
    pub fn leased_fraction(&self, now: Instant) -> Option<f64> {
        let leases = self.inner.leases.as_ref()?;
        Some(leases.fractions(now).0 as f64 / lease::WHOLE as f64)
    }

    /// The part of every account's burst this replica's lease holds at `now`, from 0 to 1
    /// (`None` without leases): at least what holds one request of the largest cost.
    #[must_use]
    pub fn leased_burst(&self, now: Instant) -> Option<f64> {
        let leases = self.inner.leases.as_ref()?;
        Some(leases.fractions(now).1 as f64 / lease::WHOLE as f64)
    }
}

impl SharedAccounts for RedisAccounts {
    fn acquire(&self, cost: u64, now: Instant) -> SharedAcquire {
        self.acquire_inner(None, cost, now)
    }

    fn acquire_for(&self, key: &TenantKey, cost: u64, now: Instant) -> SharedAcquire {
        self.acquire_inner(Some(key), cost, now)
    }

    fn settle(&self, grant: &mut SharedGrant, actual: u64, _now: Instant) {
        let delta = signed(actual) - signed(grant.charged);
        grant.charged = actual;
        if delta != 0 {
            match &self.inner.leases {
                Some(leases) => leases.adjust(grant.index, 0, delta),
                None => self.inner.send(Op::Adjust { member: grant.index, requests: 0, cost: delta }),
            }
        }
    }

    fn cancel(&self, grant: SharedGrant, _now: Instant) {
        match &self.inner.leases {
            Some(leases) => leases.adjust(grant.index, -1, -signed(grant.charged)),
            None => self.inner.send(Op::Adjust { member: grant.index, requests: -1, cost: -signed(grant.charged) }),
        }
    }

    fn observe(&self, index: usize, report: &UpstreamReport, now: Instant) {
        if index >= self.inner.members.len() || *report == UpstreamReport::default() {
            return;
        }
        let opt = |v: Option<u64>| v.map_or(-1, signed);
        let retry_us = report.retry_after.map_or(-1, |d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX));
        if let Some(wait) = report.retry_after {
            let mut benched = self.inner.benched.lock().unwrap_or_else(PoisonError::into_inner);
            let until = (now + wait).as_nanos();
            benched[index] = benched[index].max(until);
        }
        if let Some(leases) = &self.inner.leases {
            // What is left corrects this replica's buckets; only a bench concerns the fleet
            // (the mirrors in Redis decide nothing under leases).
            leases.correct(index, report.remaining_requests, report.remaining_tokens);
            if report.retry_after.is_none() {
                return;
            }
        }
        self.inner.send(Op::Report {
            member: index,
            retry_us,
            requests: opt(report.remaining_requests),
            tokens: opt(report.remaining_tokens),
        });
    }

    fn benched_until(&self, index: usize, now: Instant) -> Option<Instant> {
        let benched = self.inner.benched.lock().unwrap_or_else(PoisonError::into_inner);
        let until = *benched.get(index)?;
        (until > now.as_nanos()).then(|| Instant::from_nanos(until))
    }

    fn local_fallback(&self) -> bool {
        matches!(self.inner.failure, FailurePolicy::Fallback { .. })
    }
}
