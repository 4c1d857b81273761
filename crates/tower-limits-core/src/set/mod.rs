//! The LimitSet engine: named limits acquired together, all or nothing.
//!
//! # How it fits together
//!
//! A [`LimitSet`] holds a validated policy and the state of every (limit, key) pair it
//! tracks. Global limits keep one state each; a limit scoped to a tier keeps one state
//! per key path at that tier (see [`TenantKey`]).
//!
//! **Sharding and locks.** Keyed states live in shards chosen by the key's *root*, its
//! broadest tier. All the tiers of one tenant therefore share a shard, so an acquisition
//! takes at most two locks: the tenant's shard, then the global states, always in that
//! order (which is why it cannot deadlock); no global lock when the set's one global
//! limit lives in its atomic (below). Shards are padded to their own cache lines,
//! four per core (at most 128), fewer when the key table is small.
//!
//! **Permits.** A grant is a [`Permit`]. Dropping it releases what the set's semaphores
//! hold; [`Permit::settle`] corrects cost-counted limits to the real usage (refunding or
//! charging the difference); [`Permit::cancel`] gives back everything, for a request
//! that did not happen. Rate limits need nothing on drop, so for a set without
//! semaphores a permit is plain data. A grant of a policy with one keyed semaphore (the
//! commonest: concurrency per tenant) keeps where it found that semaphore's state, so
//! that its release takes the shard's lock and finds the state with no hash and no
//! probe; the release confirms the place under the lock and looks the key up if the
//! table has changed.
//!
//! **The one-limit path.** A set whose only limit is one global GCRA or token bucket
//! (the commonest use: one rate on one service) keeps that limit's state in one atomic
//! instead, and decides without any lock: see [`fast`] for the scheme, the per-thread
//! leases that keep many cores from queueing on one cache line, and why neither can
//! over-admit. The locked operations (settle, peek, replace) work on the atomic while it
//! rules. A set whose one global limit is such a rate beside keyed limits (per-tenant
//! limits under one global cap) keeps it in an atomic too: the acquisition takes the
//! tenant's shard lock alone and acquires the global limit last, after every other limit
//! passed and before any is committed, so that tenants on different cores share no lock.
//!
//! **One keyed limit.** A set whose only limit is keyed by a tier (one rate per client,
//! the commonest keyed use) is decided under its shard's lock alone, by a short path in
//! [`decide`]: one hash of the key's first tier picks the shard and, for a limit keyed by
//! that tier, the entry too; the state is checked and charged in one lookup. A hint read
//! without a lock says the set is such a set, and the shard's config confirms it under
//! the lock (a replace swaps that config under the same lock), so a stale hint only sends
//! the acquisition down the general path. A law holds the two paths to the same answers,
//! snapshots and counters.
//!
//! **Where things live.** This file holds the set: construction, the public operations,
//! replace and stats; [`correct`] the corrections after a grant (release, settle, cancel);
//! [`decide`] an acquisition under the locks, all or nothing, and the time it decides at; [`shard`] the keyed states, their shards and
//! the bound on memory (eviction); [`global`] the global states; [`fast`] the lock-free
//! one-limit path; [`permit`] what a grant is and how it is given back.
//!
//! **Policy changes.** [`LimitSet::replace_policy`] swaps the policy of a running set
//! under all of its locks. A limit that keeps its name, algorithm and scope keeps every
//! key's state; others start fresh. Permits granted under the old policy still release
//! their semaphores; a settle that races a policy change is applied to limits that
//! survived it.

mod correct;
mod decide;
mod fast;
mod global;
mod permit;
mod shard;

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use hashbrown::DefaultHashBuilder;

use crate::algorithm::Snapshot;
use crate::error::{AcquireError, SetError};
use crate::key::TenantKey;
use crate::limit::{Config, Counts, LimitState, MAX_LIMITS};
use crate::policy::LimitSetPolicy;
use crate::policy_error::PolicyError;
use crate::table::{Op, Table};
use crate::time::Instant;
use decide::fast_never;
use fast::{Decision, Fast};
use global::{Global, GlobalStates};
use permit::{Costs, Granted, HeldAt};
pub use permit::{Grant, OwnedPermit, Permit};
use shard::{Keyed, Padded, Shard, shard_cap, shard_count};

/// A grant version that matches whatever policy is current (for corrections that are not
/// tied to a grant).
const ANY_VERSION: u64 = u64::MAX;

/// In declared order (`repr(C)`): the count every grant writes comes first, so that in a
/// shard it shares the cache line of the shard's lock (see [`shard::Keyed`]).
#[derive(Clone, Copy, Default)]
#[repr(C)]
struct Counters {
    admitted: u64,
    refused: [u64; MAX_LIMITS],
    impossible: [u64; MAX_LIMITS],
    /// Grants a shadow limit would have refused (not yet, or never).
    shadow_refused: [u64; MAX_LIMITS],
}

struct Shared {
    shards: Box<[Padded<Mutex<Shard>>]>,
    global: Padded<Mutex<Global>>,
    hasher: DefaultHashBuilder,
    mask: usize,
    /// Whether the current config has keyed limits; read without a lock to decide which
    /// locks to take, and confirmed under them.
    tiered: AtomicBool,
    /// Whether the current config is one keyed limit ([`Config::one_keyed`]); a hint read
    /// without a lock, confirmed under the shard's.
    one_keyed: AtomicBool,
    replacing: Mutex<()>,
    /// The lock-free state, when the set is one global GCRA or token bucket (see
    /// [`fast`]).
    fast: Option<Fast>,
    /// The lock-free state of the set's one global GCRA or token bucket, beside keyed
    /// limits: decided under the tenant's shard lock alone, with no global lock (see
    /// [`fast`]).
    fast_global: Option<Fast>,
}

/// Named limits acquired together, all or nothing, in memory.
///
/// Cloning a `LimitSet` is cheap and every clone shares the same state.
///
/// ```
/// use std::time::Duration;
/// use tower_limits_core::{AcquireError, Instant, LimitPolicy, LimitSet, LimitSetPolicy, Quota, TenantKey, nz};
///
/// let set = LimitSet::new(
///     LimitSetPolicy::new()
///         .tiers(["org", "user"])
///         .limit(LimitPolicy::gcra("requests", Quota::per_minute(nz!(60)).burst(nz!(2))).per("user"))
///         .limit(
///             LimitPolicy::token_bucket("tokens", Quota::per_minute(nz!(10_000)).burst(nz!(1_000)))
///                 .per("org")
///                 .counting_cost(),
///         )
///         .limit(LimitPolicy::semaphore("concurrent", 8).per("org")),
/// )
/// .unwrap();
/// let alice = TenantKey::new(["acme", "alice"]).unwrap();
/// let now = Instant::ZERO;
///
/// // 812 estimated tokens: one request, 812 tokens, one concurrent slot.
/// let mut permit = set.acquire(&alice, 812, now).unwrap();
/// permit.settle(640, now); // the real usage: 172 tokens come back
///
/// let _second = set.acquire(&alice, 100, now).unwrap();
/// match set.acquire(&alice, 100, now) {
///     Err(AcquireError::Refused(d)) => {
///         assert_eq!(d.limit(), "requests");
///         assert_eq!(d.tier(), Some("user"));
///         assert_eq!(d.retry_after(), Duration::from_secs(1));
///     }
///     other => panic!("{other:?}"),
/// }
/// ```
#[derive(Clone)]
pub struct LimitSet {
    shared: Arc<Shared>,
}

impl fmt::Debug for LimitSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let g = self.shared.lock_global();
        f.debug_struct("LimitSet")
            .field("limits", &g.config.limits.iter().map(|l| l.name).collect::<Vec<_>>())
            .field("shards", &self.shared.shards.len())
            .finish()
    }
}

/// Returns from the enclosing acquisition the one-limit path's answer, with a grant made
/// into the answer by `$wrap`; goes on when the set has no such path (or it is off).
///
/// A macro and not a function: every branch builds its answer in the caller's place. An
/// answer returned as an `Option<Result<..>>` and unwrapped by the caller is copied, and
/// a refusal is some ninety bytes, a copy a refusal would pay on every call.
macro_rules! return_fast_answer {
    ($set:expr, $cost:expr, $now:expr, |$grant:ident| $wrap:expr) => {
        return_fast_answer!($set, $cost, $now, |$grant| $wrap, AcquireError)
    };
    ($set:expr, $cost:expr, $now:expr, |$grant:ident| $wrap:expr, $error:ident) => {
        if let Some(fast) = &$set.shared.fast {
            let charged = fast.cost($cost);
            match fast.acquire(charged, $now) {
                Some(Decision::Granted(granted_at, version)) => {
                    let $grant = Grant::uniform(
                        $cost,
                        Granted { granted_at, version, shape: None, shadowed: 0, held: HeldAt::NONE },
                    );
                    return Ok($wrap);
                }
                Some(Decision::Refused(tat, at)) => return Err($error::Refused(fast.refusal(tat, at, charged))),
                Some(Decision::Never(capacity)) => {
                    return Err($error::CostAboveCapacity(fast_never(fast, charged, capacity)));
                }
                None => {}
            }
        }
    };
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Nothing panics while a lock is held; if something did, the state is still whole.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl LimitSet {
    /// A set enforcing `policy`, with no key tracked yet.
    ///
    /// # Errors
    /// The first problem with the policy, naming its field.
    pub fn new(policy: LimitSetPolicy) -> Result<Self, PolicyError> {
        let config = Arc::new(Config::build(&policy)?);
        let shards = shard_count(config.max_keys, config.keyed_limits);
        let cap = shard_cap(config.max_keys, shards);
        let shard = |config: &Arc<Config>| Shard {
            config: config.clone(),
            keyed: Keyed {
                tables: config.limits.iter().map(|l| Table::for_limit(&l.limit)).collect(),
                len: 0,
                cap,
                latest: Instant::ZERO,
                counters: Counters::default(),
            },
        };
        // The lock-free state of its one global rate limit, if it has one: the set's only
        // limit, or one beside keyed limits.
        let (fast, fast_global) = match Fast::for_config(&config) {
            Some(fast) if fast.alone() => (Some(fast), None),
            beside => (None, beside),
        };
        Ok(LimitSet {
            shared: Arc::new(Shared {
                shards: (0..shards).map(|_| Padded(Mutex::new(shard(&config)))).collect(),
                global: Padded(Mutex::new(Global {
                    states: GlobalStates {
                        states: config.fresh.clone(),
                        latest: Instant::ZERO,
                        counters: Counters::default(),
                        fast_base: (0, 0),
                    },
                    config: config.clone(),
                })),
                hasher: DefaultHashBuilder::default(),
                mask: shards - 1,
                tiered: AtomicBool::new(config.has_tiered),
                one_keyed: AtomicBool::new(config.one_keyed.is_some()),
                replacing: Mutex::new(()),
                fast,
                fast_global,
            }),
        })
    }

    /// Acquires every limit of the set for `key` at `now`, all or nothing.
    ///
    /// Each limit is charged one (limits that count requests) or `cost` (limits that
    /// count cost).
    ///
    /// # Errors
    /// [`AcquireError::Refused`] when some limit is exhausted (no state changed),
    /// [`AcquireError::CostAboveCapacity`] when it never could pass,
    /// [`AcquireError::MissingTier`] when `key` lacks a tier some limit is keyed by, and
    /// [`AcquireError::KeyTableFull`] when the key table is full of active keys.
    #[inline(always)]
    pub fn acquire<'a>(&'a self, key: &'a TenantKey, cost: u64, now: Instant) -> Result<Permit<'a>, AcquireError> {
        return_fast_answer!(self, cost, now, |grant| Permit { set: self, key, grant });
        self.acquire_locked(key, cost, now)
    }

    /// Acquires like [`LimitSet::acquire`] and gives back at once whatever the grant
    /// holds: rate limits stay charged, and concurrency limits are tested, not held. What
    /// a caller that keeps no permit wants (a set of rate limits guarding a call, checked
    /// once per request): nothing is built to be dropped, and the refusal is a
    /// [`SetError`], a plain value with nothing to drop either (a set in this process is
    /// never unavailable).
    ///
    /// ```
    /// use tower_limits_core::{Instant, LimitSet, Quota, TenantKey, nz};
    ///
    /// let set = LimitSet::gcra(Quota::per_second(nz!(10)).burst(nz!(2)));
    /// let everyone = TenantKey::global();
    /// assert!(set.check(&everyone, 1, Instant::ZERO).is_ok());
    /// assert!(set.check(&everyone, 1, Instant::ZERO).is_ok());
    /// let refused = set.check(&everyone, 1, Instant::ZERO).unwrap_err();
    /// assert_eq!(refused.as_refusal().map(|d| d.retry_after().as_millis()), Some(100));
    /// ```
    ///
    /// # Errors
    /// As [`LimitSet::acquire`], as a [`SetError`].
    #[inline(always)]
    pub fn check(&self, key: &TenantKey, cost: u64, now: Instant) -> Result<(), SetError> {
        // A grant from the one-limit path holds nothing (no shape, no heap): forgetting
        // it is giving it back.
        return_fast_answer!(self, cost, now, |grant| drop(grant), SetError);
        self.check_locked(key, cost, now)
    }

    #[inline(never)]
    fn check_locked(&self, key: &TenantKey, cost: u64, now: Instant) -> Result<(), SetError> {
        let granted = self.shared.acquire_uniform(key, cost, now)?;
        self.release_grant(key, Grant::uniform(cost, granted));
        Ok(())
    }

    /// [`LimitSet::acquire`] under the locks: kept out of line so that the one-limit
    /// path above stays small enough to inline, with no stack frame of its own.
    #[inline(never)]
    fn acquire_locked<'a>(&'a self, key: &'a TenantKey, cost: u64, now: Instant) -> Result<Permit<'a>, AcquireError> {
        let granted = self.shared.acquire_uniform(key, cost, now)?;
        Ok(Permit { set: self, key, grant: Grant::uniform(cost, granted) })
    }

    /// Like [`LimitSet::acquire`], but with one cost per limit, in the order of the
    /// policy (a request can cost 1 against one limit and 812 against another).
    ///
    /// # Errors
    /// As [`LimitSet::acquire`]; a `costs` slice whose length is not the number of limits
    /// is refused as [`AcquireError::CostAboveCapacity`] of the first unmatched limit.
    pub fn acquire_each<'a>(
        &'a self,
        key: &'a TenantKey,
        costs: &[u64],
        now: Instant,
    ) -> Result<Permit<'a>, AcquireError> {
        let costs = Costs::Each(costs.into());
        let granted = self.shared.acquire(key, &costs, now)?;
        Ok(Permit { set: self, key, grant: Grant::new(costs, granted) })
    }

    /// Like [`LimitSet::acquire`], with a permit that owns a handle to the set and a copy
    /// of the key, to keep across an `await` or move into a response future.
    ///
    /// # Errors
    /// As [`LimitSet::acquire`].
    pub fn acquire_owned(&self, key: &TenantKey, cost: u64, now: Instant) -> Result<OwnedPermit, AcquireError> {
        let granted = self.shared.acquire_uniform(key, cost, now)?;
        let grant = Grant::uniform(cost, granted);
        Ok(OwnedPermit { set: self.clone(), key: key.clone(), grant })
    }

    /// Like [`LimitSet::acquire`], but the grant is plain data and the key stays with
    /// the caller: see [`Grant`] for the duty that comes with it.
    ///
    /// # Errors
    /// As [`LimitSet::acquire`].
    #[inline(always)]
    pub fn acquire_grant(&self, key: &TenantKey, cost: u64, now: Instant) -> Result<Grant, AcquireError> {
        return_fast_answer!(self, cost, now, |grant| grant);
        self.acquire_grant_locked(key, cost, now)
    }

    #[inline(never)]
    fn acquire_grant_locked(&self, key: &TenantKey, cost: u64, now: Instant) -> Result<Grant, AcquireError> {
        let granted = self.shared.acquire_uniform(key, cost, now)?;
        Ok(Grant::uniform(cost, granted))
    }

    /// Acquires like [`LimitSet::acquire_grant`] and reads every limit's state as the
    /// decision left it, under the same locks and in the same pass: what an answer's
    /// `RateLimit` headers need, with no second lookup. The snapshots come with a refusal
    /// too (then nothing was charged).
    ///
    /// ```
    /// use tower_limits_core::{Instant, LimitSet, Quota, TenantKey, nz};
    ///
    /// let set = LimitSet::gcra(Quota::per_second(nz!(10)).burst(nz!(3)));
    /// let (granted, seen) = set.acquire_observed(&TenantKey::global(), 1, Instant::ZERO);
    /// assert!(granted.is_ok());
    /// assert_eq!(seen[0].snapshot.remaining, 2);
    /// ```
    pub fn acquire_observed(
        &self,
        key: &TenantKey,
        cost: u64,
        now: Instant,
    ) -> (Result<Grant, AcquireError>, Vec<LimitSnapshot>) {
        let costs = Costs::Uniform(cost);
        let mut seen = Vec::new();
        let granted = self.shared.acquire_observed(key, &costs, now, Some(&mut seen));
        (granted.map(|g| Grant::uniform(cost, g)).map_err(AcquireError::from), seen)
    }

    /// Settles a [`Grant`] to the real usage; see [`Permit::settle`].
    pub fn settle_grant(&self, key: &TenantKey, grant: &mut Grant, actual: u64, now: Instant) {
        self.shared.settle(key, grant, Costs::Uniform(actual), now);
    }

    /// Releases the concurrency a [`Grant`] holds, keeping what it charged.
    #[inline]
    pub fn release_grant(&self, key: &TenantKey, grant: Grant) {
        if grant.holds_concurrency() {
            self.shared.release(key, &grant);
        }
    }

    /// Refunds what a [`Grant`] charged, as far as each limit can, and releases it.
    pub fn cancel_grant(&self, key: &TenantKey, grant: Grant, now: Instant) {
        self.shared.cancel(key, &grant, now);
        self.release_grant(key, grant);
    }

    /// Lowers what `key` has left on every rate limit counting `counts` to at most
    /// `remaining`, by charging the difference: how an upstream's own report
    /// (`x-ratelimit-remaining-*`) corrects a local mirror of its limits. Never raises
    /// anything.
    pub fn align_remaining(&self, key: &TenantKey, counts: Counts, remaining: u64, now: Instant) {
        let probe = Grant::probe(now);
        self.shared.correct(key, &probe, now, |_, def| {
            (def.counts == counts && !def.limit.is_semaphore()).then_some(Op::Align(remaining))
        });
    }

    /// Records `amount` of usage of `key` on every rate limit counting `counts`, as a
    /// charge made at `now` (never refused: the usage happened elsewhere, such as calls an
    /// upstream still counts against a limit that was just lowered). Later requests wait
    /// for it.
    ///
    /// ```
    /// use tower_limits_core::{Counts, Instant, LimitSet, Quota, TenantKey, nz};
    ///
    /// let set = LimitSet::gcra(Quota::per_second(nz!(10)).burst(nz!(5)));
    /// set.charge_usage(&TenantKey::global(), Counts::Cost, 7, Instant::ZERO);
    /// assert_eq!(set.peek(&TenantKey::global(), Instant::ZERO)[0].snapshot.remaining, 0);
    /// ```
    pub fn charge_usage(&self, key: &TenantKey, counts: Counts, amount: u64, now: Instant) {
        let probe = Grant::probe(now);
        self.shared.correct(key, &probe, now, |_, def| {
            (def.counts == counts && !def.limit.is_semaphore()).then_some(Op::Charge { granted_at: now, amount })
        });
    }

    /// Remaining capacity and reset time of every limit for `key` at `now`, without
    /// consuming anything (limits keyed by a tier the key lacks are left out).
    #[must_use]
    pub fn peek(&self, key: &TenantKey, now: Instant) -> Vec<LimitSnapshot> {
        self.shared.peek(key, now)
    }

    /// Forgets every idle state (one that decides exactly as a fresh one would). Idle
    /// states are also evicted automatically when a shard is full; call this to return
    /// memory sooner.
    pub fn evict_idle(&self, now: Instant) -> usize {
        let mut evicted = 0;
        for shard in self.shared.shards.iter() {
            let mut s = lock(&shard.0);
            let Shard { config, keyed } = &mut *s;
            let now = now.max(keyed.latest);
            evicted += keyed.sweep(config, now);
        }
        evicted
    }

    /// How many (limit, key) states are tracked now.
    #[must_use]
    pub fn tracked_keys(&self) -> usize {
        self.shared.shards.iter().map(|s| lock(&s.0).keyed.len).sum()
    }

    /// Counters and current holdings, per limit.
    #[must_use]
    pub fn stats(&self) -> LimitSetStats {
        self.shared.stats()
    }

    /// The names of the limits, in the order of the policy.
    #[must_use]
    pub fn limit_names(&self) -> Vec<String> {
        self.shared.lock_global().config.limits.iter().map(|l| l.name.to_string()).collect()
    }

    /// How many parts of a key a limit scoped to `tier` keeps its state by: 1 for the
    /// broadest tier, 2 for the next, ...; `None` if the policy has no such tier.
    ///
    /// ```
    /// use tower_limits_core::{LimitPolicy, LimitSet, LimitSetPolicy, Quota, nz};
    ///
    /// let policy = LimitSetPolicy::new()
    ///     .tiers(["org", "user"])
    ///     .limit(LimitPolicy::gcra("per-user", Quota::per_second(nz!(10))).per("user"));
    /// let set = LimitSet::new(policy)?;
    /// assert_eq!(set.tier_depth("org"), Some(1));
    /// assert_eq!(set.tier_depth("user"), Some(2));
    /// assert_eq!(set.tier_depth("team"), None);
    /// # Ok::<(), tower_limits_core::PolicyError>(())
    /// ```
    #[must_use]
    pub fn tier_depth(&self, tier: &str) -> Option<usize> {
        self.shared.lock_global().config.tiers.iter().position(|t| *t == tier).map(|i| i + 1)
    }

    /// Replaces the policy of the running set.
    ///
    /// Limits that keep their name, algorithm and scope keep the state of every key they
    /// track; the others start fresh. The change is atomic: no acquisition sees part of
    /// the old policy and part of the new.
    ///
    /// # Errors
    /// The new policy's first problem; the set then keeps its current policy.
    pub fn replace_policy(&self, policy: LimitSetPolicy) -> Result<(), PolicyError> {
        let new = Arc::new(Config::build(&policy)?);
        let shards = self.shared.shards.len();
        if shard_cap(new.max_keys, shards) < new.keyed_limits {
            return Err(PolicyError::new(
                "max_keys",
                format!(
                    "this set spreads its keys over {shards} shards, so it needs at least {} to hold one key \
                     of {} keyed limits in each",
                    shards * new.keyed_limits,
                    new.keyed_limits
                ),
            ));
        }
        let _serial = lock(&self.shared.replacing);
        let mut shards: Vec<_> = self.shared.shards.iter().map(|s| lock(&s.0)).collect();
        let mut global = lock(&self.shared.global.0);
        let old = global.config.clone();
        let moves: Vec<Option<usize>> = (0..old.limits.len()).map(|i| new.successor(old.shape, i)).collect();
        let cap = shard_cap(new.max_keys, shards.len());
        for shard in &mut shards {
            let k = &mut shard.keyed;
            let mut tables: Vec<Table> = new.limits.iter().map(|l| Table::for_limit(&l.limit)).collect();
            let mut counters = Counters { admitted: k.counters.admitted, ..Counters::default() };
            for (i, table) in std::mem::take(&mut k.tables).into_iter().enumerate() {
                if let Some(j) = moves[i] {
                    tables[j] = table;
                    counters.refused[j] = k.counters.refused[i];
                    counters.impossible[j] = k.counters.impossible[i];
                    counters.shadow_refused[j] = k.counters.shadow_refused[i];
                }
            }
            k.len = tables.iter().map(Table::len).sum();
            k.tables = tables;
            k.counters = counters;
            k.cap = cap;
            shard.config = new.clone();
        }
        let g = &mut global.states;
        if let Some(fast) = &self.shared.fast {
            hand_back(fast, g);
            // Its refusals so far move with the limit; grants stay a set-wide total.
            let (_, refused, impossible) = fast.counts();
            g.counters.refused[0] += refused - g.fast_base.0;
            g.counters.impossible[0] += impossible - g.fast_base.1;
            g.fast_base = (refused, impossible);
        }
        if let Some(fast) = &self.shared.fast_global {
            // Its answers are counted with the tenants' shards.
            hand_back(fast, g);
        }
        let mut states = new.fresh.clone();
        let mut counters = Counters { admitted: g.counters.admitted, ..Counters::default() };
        for (i, state) in std::mem::take(&mut g.states).into_iter().enumerate() {
            if let Some(j) = moves[i] {
                states[j] = state;
                counters.refused[j] = g.counters.refused[i];
                counters.impossible[j] = g.counters.impossible[i];
                counters.shadow_refused[j] = g.counters.shadow_refused[i];
            }
        }
        g.states = states;
        g.counters = counters;
        for fast in [&self.shared.fast, &self.shared.fast_global].into_iter().flatten() {
            if fast.fits(&new) {
                fast.enable(&g.states[fast.index()], new.version);
            }
        }
        global.config = new.clone();
        self.shared.tiered.store(new.has_tiered, Ordering::Release);
        self.shared.one_keyed.store(new.one_keyed.is_some(), Ordering::Relaxed);
        Ok(())
    }
}

/// Hands a lock-free path's state back to the lock (under all the locks, for a replace).
fn hand_back(fast: &Fast, g: &mut GlobalStates) {
    if let Some(last) = fast.disable() {
        g.states[fast.index()] = last;
    }
    g.latest = g.latest.max(fast.latest());
}

impl Shared {
    fn peek(&self, key: &TenantKey, now: Instant) -> Vec<LimitSnapshot> {
        let shard = (!key.is_global()).then(|| lock(self.shard_of(key)));
        let global = self.lock_global();
        if let Some(fast) = self.fast_live() {
            // The fast path rules a set of one global GCRA.
            return vec![fast.observe(now.max(fast.latest()).max(global.states.latest))];
        }
        let mut out = Vec::new();
        self.observe(&global.config, shard.as_deref().map(|s| &s.keyed), Some(&global.states), key, now, &mut out);
        out
    }

    fn stats(&self) -> LimitSetStats {
        let global = self.lock_global();
        let cfg = global.config.clone();
        let mut limits: Vec<LimitStats> = cfg
            .limits
            .iter()
            .enumerate()
            .map(|(i, def)| LimitStats {
                name: def.name.to_string(),
                tier: def.tier.map(|t| cfg.tiers[t].to_string()),
                refused: global.states.counters.refused[i],
                cost_above_capacity: global.states.counters.impossible[i],
                shadow_refused: global.states.counters.shadow_refused[i],
                held: match (&global.states.states[i], def.tier) {
                    (LimitState::Semaphore(s), None) => s.held(),
                    _ => 0,
                },
                tracked_keys: 0,
            })
            .collect();
        let mut admitted = global.states.counters.admitted;
        if let Some(fast) = &self.fast {
            let (a, d, i) = fast.counts();
            admitted += a;
            if let Some(first) = limits.first_mut() {
                first.refused += d - global.states.fast_base.0;
                first.cost_above_capacity += i - global.states.fast_base.1;
            }
        }

        drop(global);
        for shard in self.shared_shards() {
            let s = lock(shard);
            if !Arc::ptr_eq(&s.config, &cfg) {
                continue; // replaced since: its numbers belong to the new policy
            }
            let s = &s.keyed;
            admitted += s.counters.admitted;
            for (i, stats) in limits.iter_mut().enumerate() {
                stats.refused += s.counters.refused[i];
                stats.cost_above_capacity += s.counters.impossible[i];
                stats.shadow_refused += s.counters.shadow_refused[i];
                stats.tracked_keys += s.tables[i].len();
                stats.held += s.tables[i].held();
            }
        }
        LimitSetStats { admitted, limits }
    }
}

/// One limit's remaining capacity for one key, from [`LimitSet::peek`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LimitSnapshot {
    /// The limit's name.
    pub name: &'static str,
    /// The tier it is keyed by; `None` for a global limit.
    pub tier: Option<&'static str>,
    /// Whether it counts requests or cost.
    pub counts: Counts,
    /// Whether it is a concurrency limit.
    pub is_semaphore: bool,
    /// Quota, remaining and reset.
    pub snapshot: Snapshot,
}

/// Counters of a set, from [`LimitSet::stats`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LimitSetStats {
    /// Acquisitions granted.
    pub admitted: u64,
    /// Per limit, in the order of the policy.
    pub limits: Vec<LimitStats>,
}

/// Counters of one limit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LimitStats {
    /// The limit's name.
    pub name: String,
    /// The tier it is keyed by; `None` for a global limit.
    pub tier: Option<String>,
    /// Acquisitions this limit blocked.
    pub refused: u64,
    /// Acquisitions refused because their cost was above this limit's capacity.
    pub cost_above_capacity: u64,
    /// Acquisitions this limit, in shadow mode, would have refused (not yet, or never)
    /// and let through uncharged. Counted only for acquisitions every enforcing limit
    /// granted: exactly the refusals the limit would add if it enforced.
    pub shadow_refused: u64,
    /// Permits held now (semaphores; zero for rate limits).
    pub held: u64,
    /// Keys this limit tracks now.
    pub tracked_keys: usize,
}

/// Sets of one limit, from a quota that is valid by construction.
impl LimitSet {
    /// One global GCRA limit of `quota`, named `gcra`, counting each acquisition's cost:
    /// governor's `RateLimiter::direct`, with a permit, settling and exact waits, decided
    /// without a lock.
    ///
    /// ```
    /// use tower_limits_core::{Instant, LimitSet, Quota, TenantKey, nz};
    ///
    /// let limiter = LimitSet::gcra(Quota::per_second(nz!(2)));
    /// let global = TenantKey::global();
    /// assert!(limiter.acquire(&global, 2, Instant::ZERO).is_ok());
    /// assert!(limiter.acquire(&global, 1, Instant::ZERO).is_err());
    /// ```
    #[must_use]
    pub fn gcra(quota: crate::Quota) -> LimitSet {
        Self::of_quota(crate::LimitPolicy::gcra("gcra", quota))
    }

    /// One global token bucket of `quota` (its burst is the bucket's size), named
    /// `token_bucket`, counting each acquisition's cost. It makes exactly the decisions of
    /// [`LimitSet::gcra`] of the same quota, and takes the same lock-free path.
    ///
    /// ```
    /// use tower_limits_core::{Instant, LimitSet, Quota, TenantKey, nz};
    ///
    /// let bucket = LimitSet::token_bucket(Quota::per_second(nz!(10)).burst(nz!(5)));
    /// let global = TenantKey::global();
    /// assert!(bucket.acquire(&global, 5, Instant::ZERO).is_ok());
    /// let refused = bucket.acquire(&global, 1, Instant::ZERO).unwrap_err();
    /// // One token comes back every 100 ms.
    /// assert_eq!(refused.as_refusal().map(|d| d.retry_after().as_millis()), Some(100));
    /// ```
    #[must_use]
    pub fn token_bucket(quota: crate::Quota) -> LimitSet {
        Self::of_quota(crate::LimitPolicy::token_bucket("token_bucket", quota))
    }

    fn of_quota(limit: crate::LimitPolicy) -> LimitSet {
        // A quota is valid by construction (see `rate::quota_tests`), and one global
        // limit is a valid set.
        LimitSet::new(crate::LimitSetPolicy::new().limit(limit.counting_cost()))
            .unwrap_or_else(|e| unreachable!("a quota always builds: {e}"))
    }
}

#[cfg(test)]
mod tests;
