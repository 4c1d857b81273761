//! Building a [`RedisAccounts`]: the members' limits checked and laid out as the script's
//! table of keys, and the store's background tasks started.

use std::fmt::Write as _;
use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::mpsc;
use tower_limits_core::fleet::FleetShares;
use tower_limits_core::{AlgorithmKind, Counts, Limit, LimitPolicy, LimitSetPolicy, Scope, intern};

use super::batches::send_batches;
use super::lease::{self, AccountLeases, LeasedLimit, Leases};
use super::renewal::renew_leases;
use super::{BLOCKED_NS, DEMAND_LIVES_US, Inner, LimitShape, MemberInfo, RedisAccounts, Stats, TAG_LIVES_US};
use crate::ShareGroup;
use crate::backend::SHARES_SCRIPT;
use crate::connection::RedisConnection;
use crate::error::BuildError;
use crate::failure::{Breaker, FailurePolicy};
use crate::keys::escape_into;

/// Builds a [`RedisAccounts`]; from [`RedisAccounts::builder`].
#[derive(Debug, Clone)]
#[must_use]
pub struct RedisAccountsBuilder {
    pub(super) pool: String,
    pub(super) namespace: String,
    pub(super) members: Vec<(String, LimitSetPolicy)>,
    pub(super) timeout: Duration,
    pub(super) failure: FailurePolicy,
    pub(super) breaker: (u32, Duration),
    pub(super) fleet: Option<Arc<FleetShares>>,
    pub(super) manual_clock: bool,
    pub(super) leases: Option<AccountLeases>,
    pub(super) replaceable: Option<Duration>,
    pub(super) reserve_ahead: Duration,
    pub(super) carried: Option<ShareGroup>,
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

    /// Carries the whole refresh of `group`'s capacity shares in this replica's lease
    /// refreshes: one call renews the accounts' lease and the shares of every backend of
    /// the group, rather than a call each. The group's refresh rides on the first lease
    /// refresh three quarters of its period after the last; while lease refreshes come,
    /// the group waits up to half a period more for one before sending its own (so its
    /// refreshes come every ¾ to 1½ periods). Needs [`leases`](Self::leases), the group's
    /// connection (or a clone) and clock, and a standalone server (on a cluster the
    /// accounts' keys and the shares' are in different slots).
    ///
    /// ```
    /// use tower_limits_redis::{AccountLeases, RedisAccounts, ShareGroup, Shares};
    ///
    /// let plans = ShareGroup::new(Shares::new());
    /// let builder = RedisAccounts::builder("accounts").leases(AccountLeases::new()).carry_shares(&plans);
    /// # drop(builder);
    /// ```
    pub fn carry_shares(mut self, group: &ShareGroup) -> Self {
        self.carried = Some(group.clone());
        self
    }

    /// Lets the members' limits be replaced while the fleet runs
    /// ([`RedisAccounts::replace_member_limits`]), for every replica: limits learned from
    /// the upstream's answers. `span` is what the upstream counts when it decides (its
    /// window, and the jitter of its answers): Redis keeps what the fleet was charged over
    /// it, in tenths, and a lowered limit is charged with it. Each call then reads the
    /// pool's replaced limits (one small hash) and records its charge. With
    /// [`leases`](Self::leases), each refresh brings the replaced limits to its replica,
    /// whose buckets keep the units they hold (up to the new bursts) and refill at the
    /// new rates: a replaced limit reaches every replica at its next refresh (within a
    /// refresh period, or a calm period while the fleet is settled), and
    /// nothing is charged at a lowering (leases make no call per request to record).
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_limits_redis::RedisAccounts;
    ///
    /// // Accounts limited per minute, their answers a second apart at most.
    /// let builder = RedisAccounts::builder("accounts").replaceable_limits(Duration::from_secs(61));
    /// # drop(builder);
    /// ```
    pub fn replaceable_limits(mut self, span: Duration) -> Self {
        self.replaceable = Some(span);
        self
    }

    /// Reservations: a request first in the fleet's order that finds no room yet, but
    /// room within `ahead`, is granted now and charged as if admitted at the instant the
    /// room comes; the acquisition then holds it until that instant (a cancelled or
    /// dropped acquisition gives the charge back). Under contention a grant then costs
    /// one call instead of two (one to learn the wait, one to be granted), and the bound
    /// is unchanged: the mirror's state is that of an admission at the instant the
    /// request is let go. Default zero: no reservations. At most 10 s; not with
    /// [`leases`](Self::leases), which decide locally.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_limits_redis::RedisAccounts;
    ///
    /// let builder = RedisAccounts::builder("accounts").reserve_ahead(Duration::from_millis(200));
    /// # drop(builder);
    /// ```
    pub fn reserve_ahead(mut self, ahead: Duration) -> Self {
        self.reserve_ahead = ahead;
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
        if self.replaceable.is_some_and(|span| span < Duration::from_millis(1)) {
            return Err(invalid(
                "replaceable_limits",
                "the span the upstream counts must be at least a millisecond".into(),
            ));
        }
        if self.reserve_ahead > Duration::from_secs(10) {
            return Err(invalid("reserve_ahead", "reservations reach at most 10 s ahead".into()));
        }
        if let Some(group) = &self.carried {
            if self.leases.is_none() {
                return Err(invalid("carry_shares", "only lease refreshes carry a share group's: set leases".into()));
            }
            if connection.is_cluster() {
                return Err(invalid(
                    "carry_shares",
                    "on a cluster the accounts' keys and the shares' are in different slots: refresh them apart".into(),
                ));
            }
            if let Some(message) = group.shared.refuses(connection, self.manual_clock) {
                return Err(invalid("carry_shares", message));
            }
        }
        if !self.reserve_ahead.is_zero() && self.leases.is_some() {
            return Err(invalid("reserve_ahead", "leases decide locally: choose leases or reservations".into()));
        }
        // (On a manual clock, calls take no time the leases count.)
        let call = if self.manual_clock { Duration::ZERO } else { self.timeout };
        if let Some(leases) = &self.leases {
            if leases.refresh().is_zero() {
                return Err(invalid("leases.refresh", "the refresh period must be positive".into()));
            }
            crate::periodic::check_lifetime("leases.lifetime", leases.refresh(), leases.lasts(), call)?;
            if let Some(calm) = leases.calm() {
                if calm < leases.refresh() {
                    return Err(invalid(
                        "leases.calm",
                        format!("must be at least the refresh period ({:?}), got {calm:?}", leases.refresh()),
                    ));
                }
                let least = calm.saturating_mul(2).saturating_add(call);
                if leases.lasts() < least {
                    return Err(invalid(
                        "leases.calm",
                        format!(
                            "the lifetime ({:?}) must cover two calm periods plus the timeout ({least:?})",
                            leases.lasts()
                        ),
                    ));
                }
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
            let mut shape = Vec::new();
            for p in &policy.limits {
                let (leased_limit, interval, tolerance) = mirror_of(p)?;
                let (burst, cost) = (leased_limit.burst, leased_limit.cost);
                limits.push(leased_limit);
                shape.push(LimitShape {
                    name: p.name.clone(),
                    cost,
                    declared: (interval, tolerance),
                    current: (interval, tolerance),
                });
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
            members.push(MemberInfo {
                name: name.clone(),
                max_cost: AtomicU64::new(max_cost),
                limit,
                shape: Mutex::new(shape),
            });
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
        keys.push(format!("{prefix}learned"));
        let _ = writeln!(table, "local LEARNED, LEARN = KEYS[{}], {}", keys.len(), self.replaceable.is_some());
        keys.push(format!("{prefix}recent"));
        let slot_us = self.replaceable.map_or(1, |span| (span.as_micros() / 10).max(1));
        let _ = writeln!(table, "local RECENT, SLOT = KEYS[{}], {slot_us}", keys.len());
        let life_us = self.leases.map_or(0, |l| l.lasts().as_micros());
        let smallest = lease::least_part(&leased, 1);
        let refresh_us = self.leases.map_or(0, |l| l.refresh().as_micros());
        let calm_us = self.leases.map_or(0, |l| l.calm_in_force(call).as_micros());
        let _ = writeln!(
            table,
            "local LIFE, REFRESH, CALM, WHOLE, QMIN = {life_us}, {refresh_us}, {calm_us}, {}, {smallest}",
            lease::WHOLE
        );
        let _ = writeln!(
            table,
            "local SMOOTH, DEAD, SETTLE, LARGE, CONFIRM = {}, {}, {}, {}, {}",
            lease::SMOOTH,
            lease::DEAD,
            lease::SETTLE,
            lease::LARGE,
            lease::CONFIRM_US
        );
        let _ = writeln!(table, "local LIVE, IDLE, BLOCKED = {DEMAND_LIVES_US}, {TAG_LIVES_US}, {BLOCKED_NS}");
        let _ = writeln!(table, "local AHEAD = {}", self.reserve_ahead.as_nanos());
        // The last arguments: whether this store reached Redis before, then (on a manual
        // clock) the time.
        if self.manual_clock {
            table.push_str("local NOW, SLACK = tonumber(ARGV[#ARGV]), 3600000\n");
            table.push_str("local KNOWN = ARGV[#ARGV - 1] == '1'\n");
        } else {
            table.push_str("local T = redis.call('TIME')\nlocal NOW, SLACK = T[1] * 1000000 + T[2], 0\n");
            table.push_str("local KNOWN = ARGV[#ARGV] == '1'\n");
        }
        let source: Arc<str> = match &self.carried {
            None => format!("{table}{SCRIPT}").into(),
            Some(_) => carrying(&table).into(),
        };
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
            riders: Mutex::new(Vec::new()),
            reserved: AtomicU64::new(0),
            stats: Stats::default(),
            id: format!("{:016x}", RandomState::new().hash_one((std::process::id(), std::time::SystemTime::now(), n))),
            fleet: self.fleet,
            manual_clock: self.manual_clock,
            last_now_us: AtomicU64::new(0),
            reached: AtomicBool::new(false),
            leases: self.leases.map(|settings| Leases::new(settings, leased)),
            replaceable: self.replaceable.is_some(),
            carried: self.carried.map(|group| group.shared),
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
const SCRIPT: &str = include_str!("script.lua");

/// The script of a store that carries a share group's refreshes: the accounts' script
/// (after its members' `table`) and the shares' as two functions of their own keys and
/// arguments, and `X`, a call of both.
fn carrying(table: &str) -> String {
    format!(
        "local accounts = function(KEYS, ARGV)\n{table}{SCRIPT}\nend\n\
         local shares = function(KEYS, ARGV)\n{SHARES_SCRIPT}\nend\n{CARRY}"
    )
}

/// `X`: a lease refresh carrying a share group's refresh. ARGV[2] the number of the lease's
/// keys (the first KEYS), ARGV[3] the number of its arguments (after these three), then
/// the shares' arguments; answers the number of the lease's answers, they, then the
/// shares' answers. Any other operation is the accounts'.
const CARRY: &str = r"
if ARGV[1] ~= 'X' then return accounts(KEYS, ARGV) end
local nk, na = tonumber(ARGV[2]), tonumber(ARGV[3])
local K1, A1, K2, A2 = {}, {}, {}, {}
for i = 1, #KEYS do
  if i <= nk then K1[#K1 + 1] = KEYS[i] else K2[#K2 + 1] = KEYS[i] end
end
for i = 4, #ARGV do
  if i <= 3 + na then A1[#A1 + 1] = ARGV[i] else A2[#A2 + 1] = ARGV[i] end
end
local r1 = accounts(K1, A1)
if type(r1) ~= 'table' or r1.err then return r1 end
local r2 = shares(K2, A2)
if type(r2) ~= 'table' or r2.err then return r2 end
local out = {#r1}
for i = 1, #r1 do out[#out + 1] = r1[i] end
for i = 1, #r2 do out[#out + 1] = r2[i] end
return out
";

/// A member's limit as Redis evaluates it: its lease shape, its interval and its
/// tolerance (ns); or why it cannot be.
pub(super) fn mirror_of(p: &LimitPolicy) -> Result<(LeasedLimit, u64, u64), BuildError> {
    let unsupported = |reason: &str| BuildError::Unsupported { limit: p.name.clone(), reason: reason.into() };
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
    let interval = u64::try_from(quota.interval().as_nanos()).unwrap_or(u64::MAX);
    let tolerance = interval.saturating_mul(burst);
    if tolerance >= 1 << 52 {
        return Err(unsupported("its burst spans more than the 52 days a script counts exactly"));
    }
    let leased = LeasedLimit { interval, burst, cost: p.counts == Counts::Cost };
    Ok((leased, interval, tolerance))
}
