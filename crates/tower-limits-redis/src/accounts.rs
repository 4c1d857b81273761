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
//! keeps its place with its next start tag for 50 ms, while its next request comes. A
//! replica refused waits with its start tag and its request's cost, and is told to come
//! back when the requests ahead of it could have been served, each no sooner than its
//! own replica comes back, rather than polling while they are. The reply carries the
//! shares, which the fair queue uses as its tenants' weights
//! (`w_t · s_t`): tenant `t` gets, over the replicas, capacity in proportion to
//! `Σ_r w_t · s_r,t = w_t`. A report counts for 250 ms after the replica's last
//! acquisition, a wait for the replica's retry plus 50 ms, a finish tag for 10 s; a call
//! that fails clears the shares (per-replica fairness until Redis answers). The bounds
//! are in the guide.
//!
//! **Priority bands.** When the fair queue has bands, each acquisition also carries the
//! request's band and the bands' minimum shares, and each tenant's report the bands it
//! waits in. Each band is then the scheme above on its own (its virtual time, the
//! replicas' finish tags in it, their weights over their tenants waiting in it), and the
//! script orders the bands as a fair queue does, for the fleet:
//!
//! - a band with work anywhere in the fleet (a request at a gate or in a replica's
//!   queue) and a minimum share `m` keeps a deficit in the hash: `m`% of every cost
//!   granted while it has work, less what it was granted; it is dropped when the band
//!   has no work left, so nothing is banked;
//! - among the bands with a request at a gate, the one owed most (a deficit above
//!   zero) goes, else the first; a caller of another band is refused until the
//!   requests of the band that goes could have been served;
//! - the reply names the band the replica dispatches from next: the band owed most, to
//!   the one replica with work in it whose finish tag there is lowest, and to every
//!   other replica its first band with work. So a replica never holds a request of a
//!   band whose turn has not come at its gate, where it would block the requests queued
//!   behind it, and an owed band's request reaches a gate within one acquisition.
//!
//! A band with work fleet-wide thus keeps its minimum share within about one request,
//! whichever replicas its requests land on, and no more while earlier bands have work
//! (law 33).
//!
//! # Leases
//!
//! Built with [`RedisAccountsBuilder::leases`], the store asks Redis once per refresh
//! period instead of once per request: each replica holds a fraction of every member,
//! granted by Redis by the replicas' weighted demand, and decides from it locally. The
//! scheme and its bounds are in [`lease`].
//!
//! # Limits replaced while the fleet runs
//!
//! Built with [`RedisAccountsBuilder::replaceable_limits`], a member's limits can be
//! replaced for every replica ([`RedisAccounts::replace_member_limits`]): an account's
//! quota learned from its upstream. The scheme and its bounds are in [`replace`].
//!
//! # Settles ride on the next acquisition
//!
//! Settles (the real token count), cancels (a refund) and the upstream's
//! `x-ratelimit-remaining-*` (lower than the mirror's, it charges the mirror down) wait
//! up to 10 ms for this replica's next acquisition, which carries them and applies them
//! before it decides, so a busy replica's settles cost no call of their own and a refund
//! is seen by the very next decision. What no acquisition took in time, and every
//! `Retry-After` (which benches the member for the fleet and cannot wait), goes to one
//! background task per store, which sends whatever has accumulated as one `EVALSHA` (up
//! to 64 operations per call). Neither is resent after a timeout (it may have been
//! applied).
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
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use redis::Value;
use tokio::sync::{mpsc, oneshot};
use tower_limits_core::fleet::FleetShares;
use tower_limits_core::{
    AcquireError, CostAboveCapacity, Instant, LimitRefusal, SharedAccounts, SharedAcquire, SharedGrant, Snapshot,
    TenantKey, Unavailable, UpstreamReport,
};

use crate::backend::Ride;
use crate::connection::RedisConnection;
use crate::failure::{Breaker, FailurePolicy, Gate};

mod batches;
mod builder;
pub mod lease;
mod renewal;
pub mod replace;

pub use builder::RedisAccountsBuilder;

pub use lease::AccountLeases;
use lease::{Decision, Leases};

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
    /// Settles, cancels and reports (their script fields) waiting to ride on the next
    /// acquisition.
    riders: Mutex<Vec<[i64; 5]>>,
    /// On a manual clock: the instant (ns) the last reservation may go, for the test
    /// driving it (the store does not hold it).
    reserved: AtomicU64,
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
    /// With [`RedisAccountsBuilder::replaceable_limits`].
    replaceable: bool,
    /// With [`RedisAccountsBuilder::carry_shares`]: the share group whose refreshes the
    /// lease refreshes carry.
    carried: Option<Arc<crate::backend::SharesGroup>>,
}

struct MemberInfo {
    name: String,
    /// The largest cost each cost-counting limit can ever grant (the smallest of them).
    max_cost: AtomicU64,
    /// The name of the member's first limit, for refusals.
    limit: &'static str,
    /// Per limit, in order: what a replacement must keep, and what this replica set.
    shape: Mutex<Vec<LimitShape>>,
}

/// A member's limit as declared and as this replica last replaced it.
struct LimitShape {
    name: String,
    /// Whether it counts cost (else requests).
    cost: bool,
    /// Interval and tolerance (ns) as declared.
    declared: (u64, u64),
    /// Interval and tolerance (ns) as this replica last set them.
    current: (u64, u64),
}

#[derive(Default)]
struct Stats {
    acquire_calls: AtomicU64,
    lease_refreshes: AtomicU64,
    leased_grants: AtomicU64,
    batch_calls: AtomicU64,
    batched_ops: AtomicU64,
    ridden_ops: AtomicU64,
    reservations: AtomicU64,
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
    /// Settles, cancels and reports that rode on acquisitions instead (no call of their
    /// own).
    pub ridden_ops: u64,
    /// Grants reserved ahead ([`RedisAccountsBuilder::reserve_ahead`]): granted by the
    /// call that found no room yet, and held until their instant.
    pub reservations: u64,
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
    /// New limits for a member's limit at `limit` (its place): interval and tolerance
    /// (ns), and whether they lower it (else they raise it).
    Replace {
        member: usize,
        limit: usize,
        interval: u64,
        tolerance: u64,
        lowered: bool,
    },
    /// Answered once everything queued before it was sent and answered (or given up).
    Flush(oneshot::Sender<()>),
    /// A settle, cancel or report waits in `riders` for an acquisition to carry it; the
    /// background task sends what is left after a linger.
    Ride,
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
            replaceable: None,
            reserve_ahead: Duration::ZERO,
            carried: None,
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
            ridden_ops: s.ridden_ops.load(Ordering::Relaxed),
            reservations: s.reservations.load(Ordering::Relaxed),
            failures: s.failures.load(Ordering::Relaxed),
            lease_refreshes: s.lease_refreshes.load(Ordering::Relaxed),
            leased_grants: s.leased_grants.load(Ordering::Relaxed),
        }
    }

    /// Test support, on a [`manual_clock`](RedisAccountsBuilder::manual_clock): the
    /// instant the last reserved grant may go ([`RedisAccountsBuilder::reserve_ahead`]),
    /// taken (`None` once read, or when there was none). On a manual clock the store
    /// does not hold a reserved grant: the test lets it go at that instant.
    ///
    /// ```no_run
    /// # async fn run(conn: tower_limits_redis::RedisConnection) -> Result<(), Box<dyn std::error::Error>> {
    /// use std::time::Duration;
    /// use tower_limits_core::{Instant, LimitPolicy, LimitSetPolicy, Quota, SharedAccounts, nz};
    /// use tower_limits_redis::RedisAccounts;
    ///
    /// let account = LimitSetPolicy::new().limit(LimitPolicy::gcra("rpm", Quota::per_second(nz!(10))));
    /// let store = RedisAccounts::builder("accounts")
    ///     .manual_clock()
    ///     .reserve_ahead(Duration::from_millis(200))
    ///     .member("a", account)
    ///     .build(&conn)?;
    /// let now = Instant::ZERO;
    /// for _ in 0..11 {
    ///     store.acquire(1, now).await?;
    /// }
    /// // The eleventh found room 100 ms ahead: granted, to go then.
    /// assert_eq!(store.last_reservation(), Some(now + Duration::from_millis(100)));
    /// # Ok(()) }
    /// ```
    #[cfg(feature = "test-support")]
    #[must_use]
    pub fn last_reservation(&self) -> Option<Instant> {
        let at = self.inner.reserved.swap(0, Ordering::Relaxed);
        (at > 0).then(|| Instant::from_nanos(at))
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

impl Inner {
    async fn eval(&self, args: &[String], ride: Option<&Ride>) -> redis::RedisResult<Value> {
        let mut args = args.to_vec();
        args.push(if self.reached.load(Ordering::Relaxed) { "1" } else { "0" }.to_owned());
        if self.manual_clock {
            args.push(self.last_now_us.load(Ordering::Relaxed).to_string());
        }
        if let Some(ride) = ride {
            // `X`: the lease's keys and arguments, then the shares'.
            let head = ["X".to_owned(), self.keys.len().to_string(), args.len().to_string()];
            args.splice(0..0, head);
            args.extend(ride.args.iter().cloned());
        }
        let shares: Vec<&str> = ride.map_or_else(Vec::new, |r| r.keys.iter().map(|k| &**k).collect());
        let args = &args[..];
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(&*self.sha).arg(self.keys.len() + shares.len()).arg(&self.keys).arg(&shares).arg(args);
        match self.conn.query(&cmd).await {
            Err(e) if e.code() == Some("NOSCRIPT") => {
                let mut cmd = redis::cmd("EVAL");
                cmd.arg(&*self.source).arg(self.keys.len() + shares.len()).arg(&self.keys).arg(&shares).arg(args);
                self.conn.query(&cmd).await
            }
            other => other,
        }
    }

    /// One call under the timeout, feeding the breaker.
    async fn call(&self, args: &[String]) -> Result<Value, String> {
        self.call_carrying(args, None).await
    }

    /// One call under the timeout, feeding the breaker, carrying a share group's refresh
    /// with `ride`.
    async fn call_carrying(&self, args: &[String], ride: Option<&Ride>) -> Result<Value, String> {
        let (out, _kind) = match tokio::time::timeout(self.timeout, self.eval(args, ride)).await {
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
                let min_shares = fleet.min_shares();
                args.extend(["f".to_owned(), cost.to_string(), self.id.clone(), tenant.to_string()]);
                args.extend([fleet.band().to_string(), min_shares.len().to_string()]);
                args.extend(min_shares.iter().map(u32::to_string));
                demand_args(&reported, &mut args);
            }
            _ => args.extend(["a".to_owned(), cost.to_string(), self.id.clone()]),
        }
        // The settles and reports waiting ride on this call, applied before it decides.
        let riders = self.take_riders();
        self.stats.ridden_ops.fetch_add(riders.len() as u64, Ordering::Relaxed);
        args.push(riders.len().to_string());
        args.extend(riders.iter().flatten().map(i64::to_string));
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
        // A fair acquisition's reply ends with the band to dispatch from next; every
        // reply ends with the wait of a reservation (0: none).
        let fair = usize::from(args.first().is_some_and(|a| a == "f"));
        let Some(ints) = ints.filter(|v| v.len() == 3 + members + reported.len() + fair + 1) else {
            return Err(self.unavailable("unexpected reply"));
        };
        if let (Some(fleet), 1) = (&self.fleet, fair) {
            fleet.set_next_band(usize::try_from(ints[ints.len() - 2]).ok());
        }
        self.heard(&ints[3..3 + members + reported.len()], reported, now);
        let reserved = ints.last().map_or(0, |&w| u64::try_from(w).unwrap_or(0));
        match usize::try_from(ints[0]) {
            Ok(best) if best >= 1 => {
                let grant = SharedGrant { index: best - 1, charged: cost };
                if reserved > 0 {
                    self.hold_reserved(&grant, Duration::from_nanos(reserved), now).await;
                }
                Ok(grant)
            }
            _ => Err(self.refusal(Duration::from_nanos(ints[2].max(0) as u64))),
        }
    }

    /// Holds a reserved grant until its instant, `wait` after `now`; dropped before
    /// (the request cancelled), the charge goes back. On a manual clock the test drives
    /// time: the instant is recorded for it ([`RedisAccounts::last_reservation`]).
    async fn hold_reserved(&self, grant: &SharedGrant, wait: Duration, now: Instant) {
        self.stats.reservations.fetch_add(1, Ordering::Relaxed);
        if self.manual_clock {
            self.reserved.store((now + wait).as_nanos(), Ordering::Relaxed);
            return;
        }
        /// Gives the reserved charge back unless disarmed.
        struct Held<'a> {
            inner: &'a Inner,
            member: usize,
            cost: u64,
            armed: bool,
        }
        impl Drop for Held<'_> {
            fn drop(&mut self) {
                if self.armed {
                    self.inner.send(Op::Adjust { member: self.member, requests: -1, cost: -signed(self.cost) });
                }
            }
        }
        let mut held = Held { inner: self, member: grant.index, cost: grant.charged, armed: true };
        tokio::time::sleep(wait).await;
        held.armed = false;
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

    /// What this replica's lease decides for a request of `cost` at `now`, the members'
    /// benches read in place.
    fn decide_leased(&self, leases: &Leases, cost: u64, now: Instant) -> Decision {
        let benched = self.benched.lock().unwrap_or_else(PoisonError::into_inner);
        leases.decide(cost, &benched, now)
    }

    /// The acquisition's answer for a lease's decision (no lease even after a refresh: a
    /// refusal until the next one).
    fn leased_answer(&self, leases: &Leases, decision: Decision, cost: u64) -> Result<SharedGrant, AcquireError> {
        match decision {
            Decision::Granted(index) => {
                self.stats.leased_grants.fetch_add(1, Ordering::Relaxed);
                Ok(SharedGrant { index, charged: cost })
            }
            Decision::Refused(wait) => Err(self.refusal(wait)),
            Decision::NoLease => Err(self.refusal(leases.settings.refresh())),
            Decision::Down => Err(self.unavailable("the last lease refresh failed")),
        }
    }

    fn send(&self, op: Op) {
        // A bench goes at once (the other replicas must stop sending to the member); a
        // settle, cancel or correction waits briefly for an acquisition to ride on.
        let op = match op {
            Op::Adjust { member, requests, cost } => self.ride([1, signed_index(member), requests, cost, 0]),
            Op::Report { member, retry_us, requests, tokens } if retry_us < 0 => {
                self.ride([2, signed_index(member), retry_us, requests, tokens])
            }
            op => op,
        };
        if self.ops.send(op).is_err() {
            self.stats.failures.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Queues an operation's fields for the next acquisition (or the linger's end).
    fn ride(&self, fields: [i64; 5]) -> Op {
        self.riders.lock().unwrap_or_else(PoisonError::into_inner).push(fields);
        Op::Ride
    }

    /// The operations waiting to ride, taken.
    fn take_riders(&self) -> Vec<[i64; 5]> {
        std::mem::take(&mut *self.riders.lock().unwrap_or_else(PoisonError::into_inner))
    }
}

/// The fleet demand a call reports: the count, then per tenant its key, weight, requests
/// waiting, requests waiting or in flight, and the bands it waits in (`,0,2,`).
fn demand_args(reported: &[tower_limits_core::fleet::TenantDemand], args: &mut Vec<String>) {
    use std::fmt::Write as _;
    args.push(reported.len().to_string());
    for d in reported {
        let mut bands = String::from(",");
        for b in (0..64).filter(|b| d.bands & (1 << b) != 0) {
            let _ = write!(bands, "{b},");
        }
        args.extend([d.key.to_string(), d.weight.to_string(), d.waiting.to_string(), d.outstanding.to_string(), bands]);
    }
}

fn signed(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// A member's place as the script counts it (from 1).
fn signed_index(member: usize) -> i64 {
    i64::try_from(member).unwrap_or(i64::MAX).saturating_add(1)
}

impl RedisAccounts {
    fn acquire_inner(&self, tenant: Option<&TenantKey>, cost: u64, now: Instant) -> SharedAcquire {
        let inner = &self.inner;
        if inner.members.iter().all(|m| cost > m.max_cost.load(Ordering::Relaxed)) {
            let capacity = inner.members.iter().map(|m| m.max_cost.load(Ordering::Relaxed)).max().unwrap_or(0);
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
            let decision = inner.decide_leased(leases, cost, now);
            if decision != Decision::NoLease {
                return Box::pin(std::future::ready(inner.leased_answer(leases, decision, cost)));
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
                if !inner.refresh_lease_if(now, true, renewal::Ask::UnlessHeld).await {
                    return Err(inner.unavailable("no lease, and the lease refresh failed"));
                }
                let Some(leases) = &inner.leases else { return Err(inner.unavailable("no lease")) };
                let decision = inner.decide_leased(leases, cost, now);
                inner.leased_answer(leases, decision, cost)
            });
        }
        Box::pin(inner.clone().acquire(tenant.cloned(), cost, now))
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
