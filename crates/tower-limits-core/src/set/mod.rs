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
//! order (which is why it cannot deadlock). Shards are padded to their own cache lines.
//!
//! **All or nothing.** Under those locks an acquisition first *checks* every limit
//! without writing anything ([`Algorithm::check`](crate::algorithm::Algorithm::check)),
//! and commits only if all of them pass. A denial therefore changes no state: it names
//! the limit that frees last and the exact wait after which all of them would pass. A
//! cost above some limit's capacity is refused at once as
//! [`AcquireError::CostAboveCapacity`]: it can never pass, so it is never waited on.
//!
//! **Time.** `now` is passed in. Under the locks it is raised to the latest instant the
//! shard has seen, so two callers whose clock reads raced never move a state backwards.
//!
//! **Permits.** A grant is a [`Permit`]. Dropping it releases what the set's semaphores
//! hold; [`Permit::settle`] corrects cost-counted limits to the real usage (refunding or
//! charging the difference); [`Permit::cancel`] gives back everything, for a request
//! that did not happen. Rate limits need nothing on drop, so for a set without
//! semaphores a permit is plain data.
//!
//! **Bounded memory.** The number of tracked (limit, key) states is bounded by the
//! policy's `max_keys`, split evenly over the shards. When a shard is full, its idle
//! states (those that decide exactly as a fresh state would, see
//! [`Algorithm::is_idle`](crate::algorithm::Algorithm::is_idle)) are evicted, which
//! changes no decision; if none is idle the acquisition fails with
//! [`AcquireError::KeyTableFull`] rather than forget a key that still matters. A settle
//! that charges a state evicted since its grant recreates it; only when the table is
//! full of active keys at that moment is such a charge dropped, because the bound on
//! memory comes first.
//!
//! **The one-limit path.** A set whose only limit is one global GCRA (the commonest
//! use: one rate on one service) keeps that limit's state in one atomic instead, and
//! decides without any lock: see [`fast`] for the scheme, the per-thread leases that keep
//! many cores from queueing on one cache line, and why neither can over-admit. The
//! locked operations (settle, peek, replace) work on the atomic while it rules.
//!
//! **Where things live.** This file holds the engine (shards, global states, the
//! decision, corrections, replace, stats); [`fast`] the lock-free one-limit path;
//! [`permit`] what a grant is and how it is given back.
//!
//! **Policy changes.** [`LimitSet::replace_policy`] swaps the policy of a running set
//! under all of its locks. A limit that keeps its name, algorithm and scope keeps every
//! key's state; others start fresh. Permits granted under the old policy still release
//! their semaphores; a settle that races a policy change is applied to limits that
//! survived it.

mod fast;
mod permit;

use std::fmt;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use hashbrown::DefaultHashBuilder;

use crate::algorithm::{Refusal, Snapshot};
use crate::error::{AcquireError, CostAboveCapacity, Denial, KeyTableFull, MissingKey};
use crate::key::{MAX_TIERS, TenantKey};
use crate::limit::{Config, Counts, LimitDef, LimitState, MAX_LIMITS};
use crate::policy::LimitSetPolicy;
use crate::policy_error::PolicyError;
use crate::table::{Op, Table, apply_global, key_hash};
use crate::time::Instant;
use fast::{Decision, Fast};
use permit::{Costs, Granted};
pub use permit::{Grant, OwnedPermit, Permit};

/// A grant version that matches whatever policy is current (for corrections that are not
/// tied to a grant).
const ANY_VERSION: u64 = u64::MAX;

/// The most shards a set spreads its keys over.
const MAX_SHARDS: usize = 32;

/// Keeps each lock on its own cache line, so that shards do not slow each other down.
#[repr(align(128))]
struct Padded<T>(T);

/// Keyed states of the tenants whose root hashes here.
struct Shard {
    config: Arc<Config>,
    keyed: Keyed,
}

struct Keyed {
    /// One table per limit of the config (empty for global limits).
    tables: Vec<Table>,
    len: usize,
    cap: usize,
    latest: Instant,
    counters: Counters,
}

/// The states of the global limits.
struct Global {
    config: Arc<Config>,
    states: GlobalStates,
}

struct GlobalStates {
    /// One state per limit of the config (unused for keyed limits).
    states: Vec<LimitState>,
    latest: Instant,
    counters: Counters,
    /// The fast path's denial counts already moved into `counters` (they never reset).
    fast_base: (u64, u64),
}

#[derive(Clone, Copy, Default)]
struct Counters {
    admitted: u64,
    denied: [u64; MAX_LIMITS],
    impossible: [u64; MAX_LIMITS],
}

struct Shared {
    shards: Box<[Padded<Mutex<Shard>>]>,
    global: Padded<Mutex<Global>>,
    hasher: DefaultHashBuilder,
    mask: usize,
    /// Whether the current config has keyed limits; read without a lock to decide which
    /// locks to take, and confirmed under them.
    tiered: AtomicBool,
    replacing: Mutex<()>,
    /// The lock-free state, when the set is one global GCRA (see [`fast`]).
    fast: Option<Fast>,
}

/// Named limits acquired together, all or nothing, in memory.
///
/// Cloning a `LimitSet` is cheap and every clone shares the same state.
///
/// ```
/// use std::time::Duration;
/// use tower_limits_core::{AcquireError, Instant, LimitPolicy, LimitSet, LimitSetPolicy, Rate, TenantKey};
///
/// let set = LimitSet::new(
///     LimitSetPolicy::new()
///         .tiers(["org", "user"])
///         .limit(LimitPolicy::gcra("requests", Rate::per_minute(60), 2).per("user"))
///         .limit(LimitPolicy::token_bucket("tokens", Rate::per_minute(10_000), 1_000).per("org").counting_cost())
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
///     Err(AcquireError::Denied(d)) => {
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
                replacing: Mutex::new(()),
                fast: Fast::for_config(&config),
            }),
        })
    }

    /// Acquires every limit of the set for `key` at `now`, all or nothing.
    ///
    /// Each limit is charged one (limits that count requests) or `cost` (limits that
    /// count cost).
    ///
    /// # Errors
    /// [`AcquireError::Denied`] when some limit is exhausted (no state changed),
    /// [`AcquireError::CostAboveCapacity`] when it never could pass,
    /// [`AcquireError::MissingKey`] when `key` lacks a tier some limit is keyed by, and
    /// [`AcquireError::KeyTableFull`] when the key table is full of active keys.
    #[inline]
    pub fn acquire<'a>(&'a self, key: &'a TenantKey, cost: u64, now: Instant) -> Result<Permit<'a>, AcquireError> {
        if let Some(fast) = &self.shared.fast {
            // The one-limit path, its answer built in place.
            let charged = fast.cost(cost);
            match fast.acquire(charged, now) {
                Some(Decision::Granted(granted_at, version)) => {
                    let grant = Grant::new(Costs::Uniform(cost), Granted { granted_at, version, config: None });
                    return Ok(Permit { set: self, key, grant, done: false });
                }
                Some(Decision::Denied(tat, at)) => return Err(fast_denied(fast, tat, at, charged)),
                Some(Decision::Never(capacity)) => return Err(fast_never(fast, charged, capacity)),
                None => {}
            }
        }
        let costs = Costs::Uniform(cost);
        let granted = self.shared.acquire(key, &costs, now)?;
        Ok(Permit { set: self, key, grant: Grant::new(costs, granted), done: false })
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
        Ok(Permit { set: self, key, grant: Grant::new(costs, granted), done: false })
    }

    /// Like [`LimitSet::acquire`], with a permit that owns a handle to the set and a copy
    /// of the key, to keep across an `await` or move into a response future.
    ///
    /// # Errors
    /// As [`LimitSet::acquire`].
    pub fn acquire_owned(&self, key: &TenantKey, cost: u64, now: Instant) -> Result<OwnedPermit, AcquireError> {
        let costs = Costs::Uniform(cost);
        let granted = self.shared.acquire(key, &costs, now)?;
        Ok(OwnedPermit { set: self.clone(), key: key.clone(), grant: Grant::new(costs, granted), done: false })
    }

    /// Like [`LimitSet::acquire`], but the grant is plain data and the key stays with
    /// the caller: see [`Grant`] for the duty that comes with it.
    ///
    /// # Errors
    /// As [`LimitSet::acquire`].
    #[inline]
    pub fn acquire_grant(&self, key: &TenantKey, cost: u64, now: Instant) -> Result<Grant, AcquireError> {
        let costs = Costs::Uniform(cost);
        let granted = self.shared.acquire(key, &costs, now)?;
        Ok(Grant::new(costs, granted))
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
        let probe =
            Grant { granted_at: now, version: ANY_VERSION, config: None, acquired: Costs::Uniform(0), settled: None };
        self.shared.correct(key, &probe, now, |_, def| {
            (def.counts == counts && !def.limit.is_semaphore()).then_some(Op::Align(remaining))
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
        let moves: Vec<Option<usize>> = (0..old.limits.len()).map(|i| new.successor(&old, i)).collect();
        let cap = shard_cap(new.max_keys, shards.len());
        for shard in &mut shards {
            let k = &mut shard.keyed;
            let mut tables: Vec<Table> = new.limits.iter().map(|l| Table::for_limit(&l.limit)).collect();
            let mut counters = Counters { admitted: k.counters.admitted, ..Counters::default() };
            for (i, table) in std::mem::take(&mut k.tables).into_iter().enumerate() {
                if let Some(j) = moves[i] {
                    tables[j] = table;
                    counters.denied[j] = k.counters.denied[i];
                    counters.impossible[j] = k.counters.impossible[i];
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
            // The atomic hands the state back to the lock, with what it counted.
            if let Some(last) = fast.disable() {
                g.states[0] = last;
            }
            g.latest = g.latest.max(fast.latest());
            // Its denials so far move with the limit; grants stay a set-wide total.
            let (_, d, i) = fast.counts();
            g.counters.denied[0] += d - g.fast_base.0;
            g.counters.impossible[0] += i - g.fast_base.1;
            g.fast_base = (d, i);
        }
        let mut states = new.fresh.clone();
        let mut counters = Counters { admitted: g.counters.admitted, ..Counters::default() };
        for (i, state) in std::mem::take(&mut g.states).into_iter().enumerate() {
            if let Some(j) = moves[i] {
                states[j] = state;
                counters.denied[j] = g.counters.denied[i];
                counters.impossible[j] = g.counters.impossible[i];
            }
        }
        g.states = states;
        g.counters = counters;
        if let Some(fast) = self.shared.fast.as_ref().filter(|f| f.fits(&new)) {
            fast.enable(&g.states[0], new.version);
        }
        global.config = new.clone();
        self.shared.tiered.store(new.has_tiered, Ordering::Release);
        Ok(())
    }
}

/// As many shards as keep room for a few keys in each: a key needs one state per keyed
/// limit, all in its shard.
fn shard_count(max_keys: usize, states_per_key: usize) -> usize {
    let mut n = MAX_SHARDS;
    while n > 1 && max_keys / n < states_per_key.max(1) * 4 {
        n /= 2;
    }
    n
}

fn shard_cap(max_keys: usize, shards: usize) -> usize {
    (max_keys / shards).max(1)
}

impl Shared {
    fn lock_global(&self) -> MutexGuard<'_, Global> {
        lock(&self.global.0)
    }

    #[inline]
    fn shard_of(&self, key: &TenantKey) -> &Mutex<Shard> {
        let h = self.hasher.hash_one(key.root());
        // The high bits: the table uses the low ones.
        &self.shards[(h >> 40) as usize & self.mask].0
    }

    /// The lock-free state, while it rules (stable under the global lock).
    #[inline]
    fn fast_live(&self) -> Option<&Fast> {
        self.fast.as_ref().filter(|f| f.enabled())
    }

    #[inline]
    fn acquire(&self, key: &TenantKey, costs: &Costs, now: Instant) -> Result<Granted, AcquireError> {
        loop {
            if let Some(fast) = &self.fast {
                let cost = match costs {
                    Costs::Uniform(c) => fast.cost(*c),
                    Costs::Each(each) => each.first().copied().unwrap_or(u64::MAX),
                };
                match fast.acquire(cost, now) {
                    Some(Decision::Granted(granted_at, version)) => {
                        return Ok(Granted { granted_at, version, config: None });
                    }
                    Some(Decision::Denied(tat, at)) => return Err(fast_denied(fast, tat, at, cost)),
                    Some(Decision::Never(capacity)) => return Err(fast_never(fast, cost, capacity)),
                    None => {}
                }
            }
            // `None`: a replace enabled the fast path while this call waited for a lock.
            if let Some(result) = self.acquire_locked(key, costs, now) {
                return result;
            }
        }
    }

    /// The acquisition under the locks; `None` when the fast path rules the state now.
    fn acquire_locked(&self, key: &TenantKey, costs: &Costs, now: Instant) -> Option<Result<Granted, AcquireError>> {
        if !key.is_global() && self.tiered.load(Ordering::Acquire) {
            let mut shard = lock(self.shard_of(key));
            let Shard { config, keyed } = &mut *shard;
            if config.has_global {
                let mut global = self.lock_global();
                if self.fast_live().is_some() {
                    return None;
                }
                Some(self.decide(config, Some(keyed), Some(&mut global.states), key, costs, now))
            } else {
                Some(self.decide(config, Some(keyed), None, key, costs, now))
            }
        } else {
            let mut global = self.lock_global();
            if self.fast_live().is_some() {
                return None;
            }
            if global.config.has_tiered && !key.is_global() {
                // The policy gained keyed limits since the hint was read: take the locks
                // in order.
                drop(global);
                let mut shard = lock(self.shard_of(key));
                let Shard { config, keyed } = &mut *shard;
                let mut global = self.lock_global();
                return Some(self.decide(config, Some(keyed), Some(&mut global.states), key, costs, now));
            }
            let Global { config, states } = &mut *global;
            Some(self.decide(config, None, Some(states), key, costs, now))
        }
    }

    /// The decision, under the locks the caller took.
    #[allow(clippy::too_many_lines)]
    #[inline]
    fn decide(
        &self,
        config: &Arc<Config>,
        mut shard: Option<&mut Keyed>,
        mut global: Option<&mut GlobalStates>,
        key: &TenantKey,
        costs: &Costs,
        now: Instant,
    ) -> Result<Granted, AcquireError> {
        let cfg: &Config = config;
        if cfg.depth_needed > 0 && key.prefix(cfg.depth_needed).is_none() {
            return Err(AcquireError::MissingKey(MissingKey { tier: cfg.tiers[key.depth()] }));
        }
        let mut now = now;
        if let Some(s) = &shard {
            now = now.max(s.latest);
        }
        if let Some(g) = &global {
            now = now.max(g.latest);
        }

        if cfg.limits.len() == 1 {
            return self.decide_one(config, shard, global, key, costs, now);
        }

        // One hash per tier the policy uses.
        let mut hashes = [0u64; MAX_TIERS];
        let mut hashed = [false; MAX_TIERS];
        for def in &cfg.limits {
            if let Some(t) = def.tier {
                if !hashed[t] {
                    hashes[t] = key_hash(&self.hasher, key.prefix(t + 1).unwrap_or(""));
                    hashed[t] = true;
                }
            }
        }

        // Phase 1: check everything, write nothing.
        let mut blocked: Option<(usize, Option<Duration>)> = None;
        let mut retry = Duration::ZERO;
        let mut needs_release = false;
        let mut new_entries = 0usize;
        for (i, def) in cfg.limits.iter().enumerate() {
            let cost = costs.of(i, def);
            let result = match def.tier {
                None => def.limit.check(global.as_deref().map_or(&cfg.fresh[i], |g| &g.states[i]), now, cost),
                Some(t) => {
                    let prefix = key.prefix(t + 1).unwrap_or("");
                    let (found, result) = match shard.as_deref() {
                        Some(s) => s.tables[i].check(&def.limit, hashes[t], prefix, now, cost),
                        None => (false, def.limit.check(&cfg.fresh[i], now, cost)),
                    };
                    if !found {
                        new_entries += 1;
                    }
                    result
                }
            };
            match result {
                Ok(()) => {}
                Err(Refusal::Never { capacity }) => {
                    counters(&mut shard, &mut global).impossible[i] += 1;
                    return Err(cost_above_capacity(cfg, i, cost, capacity));
                }
                Err(Refusal::NotYet { retry_after }) => match retry_after {
                    Some(wait) if wait >= retry => {
                        retry = wait;
                        blocked = Some((i, Some(wait)));
                    }
                    Some(_) => {}
                    None => {
                        needs_release = true;
                        if blocked.is_none() {
                            blocked = Some((i, None));
                        }
                    }
                },
            }
        }

        if let Some((i, _)) = blocked {
            counters(&mut shard, &mut global).denied[i] += 1;
            let def = &cfg.limits[i];
            let snapshot = match def.tier {
                None => def.limit.peek(global.as_deref().map_or(&cfg.fresh[i], |g| &g.states[i]), now),
                Some(t) => {
                    let prefix = key.prefix(t + 1).unwrap_or("");
                    match shard.as_deref() {
                        Some(s) => s.tables[i].peek(&def.limit, hashes[t], prefix, now),
                        None => def.limit.peek(&cfg.fresh[i], now),
                    }
                }
            };
            return Err(denied(cfg, i, retry, needs_release, snapshot));
        }

        // Room for the states this grant creates.
        if let Some(s) = shard.as_deref_mut() {
            if new_entries > 0 && s.len + new_entries > s.cap {
                s.sweep(cfg, now);
                // The sweep may have evicted idle states of this very key: count again.
                new_entries = cfg
                    .limits
                    .iter()
                    .enumerate()
                    .filter_map(|(i, def)| def.tier.map(|t| (i, t)))
                    .filter(|&(i, t)| {
                        let prefix = key.prefix(t + 1).unwrap_or("");
                        !s.tables[i].contains(hashes[t], prefix)
                    })
                    .count();
                if s.len + new_entries > s.cap {
                    return Err(AcquireError::KeyTableFull(KeyTableFull { max_keys: cfg.max_keys }));
                }
            }
        }

        // Phase 2: everything passed; commit everything.
        for (i, def) in cfg.limits.iter().enumerate() {
            let cost = costs.of(i, def);
            match def.tier {
                None => {
                    if let Some(g) = global.as_deref_mut() {
                        def.limit.commit(&mut g.states[i], now, cost);
                    }
                }
                Some(t) => {
                    let Some(s) = shard.as_deref_mut() else { continue };
                    let prefix = key.prefix(t + 1).unwrap_or("");
                    if s.tables[i].commit(&def.limit, &self.hasher, hashes[t], prefix, now, cost) {
                        s.len += 1;
                    }
                }
            }
        }
        if let Some(s) = shard.as_deref_mut() {
            s.latest = now;
        }
        if let Some(g) = global.as_deref_mut() {
            g.latest = now;
        }
        counters(&mut shard, &mut global).admitted += 1;

        Ok(Granted { granted_at: now, version: cfg.version, config: cfg.has_semaphore.then(|| config.clone()) })
    }

    /// The decision for a set of one limit: one lookup, check and commit together.
    #[inline]
    fn decide_one(
        &self,
        config: &Arc<Config>,
        shard: Option<&mut Keyed>,
        global: Option<&mut GlobalStates>,
        key: &TenantKey,
        costs: &Costs,
        now: Instant,
    ) -> Result<Granted, AcquireError> {
        let cfg: &Config = config;
        let def = &cfg.limits[0];
        let cost = costs.of(0, def);
        let (result, counters) = match (def.tier, shard, global) {
            (None, _, Some(g)) => {
                let result =
                    def.limit.acquire(&mut g.states[0], now, cost).map_err(|r| (r, def.limit.peek(&g.states[0], now)));
                if result.is_ok() {
                    g.latest = now;
                }
                (result, &mut g.counters)
            }
            (Some(t), Some(s), _) => {
                let prefix = key.prefix(t + 1).unwrap_or("");
                let h = key_hash(&self.hasher, prefix);
                let result = match s.tables[0].acquire_existing(&def.limit, h, prefix, now, cost) {
                    Some(result) => result,
                    None => match def.limit.check(&cfg.fresh[0], now, cost) {
                        Err(r) => Err((r, def.limit.peek(&cfg.fresh[0], now))),
                        Ok(()) => {
                            if s.len >= s.cap {
                                s.sweep(cfg, now);
                                if s.len >= s.cap {
                                    return Err(AcquireError::KeyTableFull(KeyTableFull { max_keys: cfg.max_keys }));
                                }
                            }
                            s.tables[0].commit(&def.limit, &self.hasher, h, prefix, now, cost);
                            s.len += 1;
                            Ok(())
                        }
                    },
                };
                if result.is_ok() {
                    s.latest = now;
                }
                (result, &mut s.counters)
            }
            _ => unreachable!("the caller locks what the limit's scope needs"),
        };
        match result {
            Ok(()) => {
                counters.admitted += 1;
                Ok(Granted { granted_at: now, version: cfg.version, config: cfg.has_semaphore.then(|| config.clone()) })
            }
            Err((Refusal::Never { capacity }, _)) => {
                counters.impossible[0] += 1;
                Err(cost_above_capacity(cfg, 0, cost, capacity))
            }
            Err((Refusal::NotYet { retry_after }, snapshot)) => {
                counters.denied[0] += 1;
                Err(denied(cfg, 0, retry_after.unwrap_or(Duration::ZERO), retry_after.is_none(), snapshot))
            }
        }
    }

    /// Runs `f` on each limit of the current config that grant-limit `i` maps to, with
    /// its state for the grant's key, under the locks that needs.
    /// Applies to each limit of the current policy the correction `op_for` gives for the
    /// grant's limit it maps to (by index, or by name after a policy change), under the
    /// locks that needs. A correction that adds to a state evicted since the grant brings
    /// it back, room permitting.
    fn correct(&self, key: &TenantKey, grant: &Grant, now: Instant, op_for: impl Fn(usize, &LimitDef) -> Option<Op>) {
        let mut shard = (!key.is_global()).then(|| lock(self.shard_of(key)));
        let mut global = self.lock_global();
        let current = global.config.clone();
        let mut now = now.max(global.states.latest);
        if let Some(fast) = self.fast_live() {
            now = now.max(fast.latest());
        }
        if let Some(s) = &shard {
            now = now.max(s.keyed.latest);
        }
        for (j, def) in current.limits.iter().enumerate() {
            let from = if current.version == grant.version || grant.version == ANY_VERSION {
                Some(j)
            } else if let Some(old) = &grant.config {
                (0..old.limits.len()).find(|&i| current.successor(old, i) == Some(j))
            } else {
                None
            };
            let Some(op) = from.and_then(|i| op_for(i, def)) else { continue };
            match def.tier {
                None => match self.fast_live() {
                    Some(fast) if j == 0 => fast.update(|state| apply_global(&def.limit, state, op, now)),
                    _ => apply_global(&def.limit, &mut global.states.states[j], op, now),
                },
                Some(t) => {
                    let Some(s) = shard.as_deref_mut().map(|s| &mut s.keyed) else { continue };
                    let Some(prefix) = key.prefix(t + 1) else { continue };
                    let h = key_hash(&self.hasher, prefix);
                    let mut create = op.adds();
                    if create && s.len >= s.cap && !s.tables[j].contains(h, prefix) {
                        s.sweep(&current, now);
                        // The bound on memory comes first: a charge with no room is dropped.
                        create = s.len < s.cap;
                    }
                    if s.tables[j].apply(&def.limit, &self.hasher, (h, prefix), op, now, create) {
                        s.len += 1;
                    }
                }
            }
        }
    }

    fn release(&self, key: &TenantKey, grant: &Grant) {
        let Some(config) = &grant.config else { return };
        self.correct(key, grant, grant.granted_at, |i, def| {
            def.limit.is_semaphore().then(|| Op::Release(grant.acquired.of(i, &config.limits[i])))
        });
    }

    fn settle(&self, key: &TenantKey, grant: &mut Grant, actual: Costs, now: Instant) {
        let granted_at = grant.granted_at;
        let before = grant.charged().clone();
        self.correct(key, grant, now, |i, def| {
            if def.limit.is_semaphore() {
                return None;
            }
            let (was, is) = (before.of(i, def), actual.of(i, def));
            match is.cmp(&was) {
                std::cmp::Ordering::Greater => Some(Op::Charge { granted_at, amount: is - was }),
                std::cmp::Ordering::Less => Some(Op::Refund { granted_at, amount: was - is }),
                std::cmp::Ordering::Equal => None,
            }
        });
        grant.settled = Some(actual);
    }

    fn cancel(&self, key: &TenantKey, grant: &Grant, now: Instant) {
        let granted_at = grant.granted_at;
        self.correct(key, grant, now, |i, def| {
            (!def.limit.is_semaphore()).then(|| Op::Refund { granted_at, amount: grant.charged().of(i, def) })
        });
    }

    fn peek(&self, key: &TenantKey, now: Instant) -> Vec<LimitSnapshot> {
        let shard = (!key.is_global()).then(|| lock(self.shard_of(key)));
        let global = self.lock_global();
        let cfg = global.config.clone();
        let mut now = now.max(global.states.latest);
        if let Some(fast) = self.fast_live() {
            now = now.max(fast.latest());
        }
        if let Some(s) = &shard {
            now = now.max(s.keyed.latest);
        }
        let mut out = Vec::with_capacity(cfg.limits.len());
        for (i, def) in cfg.limits.iter().enumerate() {
            let snapshot = match def.tier {
                None => match self.fast_live() {
                    Some(fast) if i == 0 => def.limit.peek(&fast.state(), now),
                    _ => def.limit.peek(&global.states.states[i], now),
                },
                Some(t) => {
                    let (Some(s), Some(prefix)) = (shard.as_deref().map(|s| &s.keyed), key.prefix(t + 1)) else {
                        continue;
                    };
                    s.tables[i].peek(&def.limit, key_hash(&self.hasher, prefix), prefix, now)
                }
            };
            out.push(LimitSnapshot {
                name: def.name,
                tier: def.tier.map(|t| cfg.tiers[t]),
                counts: def.counts,
                is_semaphore: def.limit.is_semaphore(),
                snapshot,
            });
        }
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
                denied: global.states.counters.denied[i],
                cost_above_capacity: global.states.counters.impossible[i],
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
                first.denied += d - global.states.fast_base.0;
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
                stats.denied += s.counters.denied[i];
                stats.cost_above_capacity += s.counters.impossible[i];
                stats.tracked_keys += s.tables[i].len();
                stats.held += s.tables[i].held();
            }
        }
        LimitSetStats { admitted, limits }
    }

    fn shared_shards(&self) -> impl Iterator<Item = &Mutex<Shard>> {
        self.shards.iter().map(|s| &s.0)
    }
}

#[cold]
#[inline(never)]
fn denied(cfg: &Config, limit: usize, retry_after: Duration, needs_release: bool, snapshot: Snapshot) -> AcquireError {
    let def = &cfg.limits[limit];
    AcquireError::Denied(Denial {
        name: def.name,
        tier: def.tier.map(|t| cfg.tiers[t]),
        limit,
        retry_after,
        needs_release,
        snapshot,
    })
}

#[inline]
fn fast_denied(fast: &Fast, tat: u64, now: Instant, cost: u64) -> AcquireError {
    let (retry_after, snapshot) = fast.denial(tat, now, cost);
    AcquireError::Denied(Denial {
        name: fast.name(),
        tier: None,
        limit: 0,
        retry_after,
        needs_release: false,
        snapshot,
    })
}

#[cold]
#[inline(never)]
fn fast_never(fast: &Fast, cost: u64, capacity: u64) -> AcquireError {
    AcquireError::CostAboveCapacity(CostAboveCapacity { limit: fast.name(), tier: None, cost, capacity })
}

#[cold]
#[inline(never)]
fn cost_above_capacity(cfg: &Config, limit: usize, cost: u64, capacity: u64) -> AcquireError {
    let def = &cfg.limits[limit];
    AcquireError::CostAboveCapacity(CostAboveCapacity {
        limit: def.name,
        tier: def.tier.map(|t| cfg.tiers[t]),
        cost,
        capacity,
    })
}

fn counters<'a>(shard: &'a mut Option<&mut Keyed>, global: &'a mut Option<&mut GlobalStates>) -> &'a mut Counters {
    match (shard, global) {
        (Some(s), _) => &mut s.counters,
        (None, Some(g)) => &mut g.counters,
        (None, None) => unreachable!("an acquisition holds at least one lock"),
    }
}

impl Keyed {
    /// Drops every idle state; returns how many.
    fn sweep(&mut self, config: &Config, now: Instant) -> usize {
        let before = self.len;
        for (i, table) in self.tables.iter_mut().enumerate() {
            table.sweep(&config.limits[i].limit, now);
        }
        self.len = self.tables.iter().map(Table::len).sum();
        before - self.len
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
    pub denied: u64,
    /// Acquisitions refused because their cost was above this limit's capacity.
    pub cost_above_capacity: u64,
    /// Permits held now (semaphores; zero for rate limits).
    pub held: u64,
    /// Keys this limit tracks now.
    pub tracked_keys: usize,
}

/// Sets of one limit, from a quota that is valid by construction.
impl LimitSet {
    /// One global GCRA limit of `quota`, named `gcra`, counting each acquisition's cost:
    /// governor's `RateLimiter::direct`, with a permit, settling and exact waits.
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
        Self::of_quota(crate::LimitPolicy::gcra("gcra", quota.rate(), quota.max_burst()))
    }

    /// One global token bucket of `quota` (its burst is the bucket's size), named
    /// `token_bucket`, counting each acquisition's cost.
    #[must_use]
    pub fn token_bucket(quota: crate::Quota) -> LimitSet {
        Self::of_quota(crate::LimitPolicy::token_bucket("token_bucket", quota.rate(), quota.max_burst()))
    }

    fn of_quota(limit: crate::LimitPolicy) -> LimitSet {
        // A quota is valid by construction (see `rate::quota_tests`), and one global
        // limit is a valid set.
        LimitSet::new(crate::LimitSetPolicy::new().limit(limit.counting_cost()))
            .unwrap_or_else(|e| unreachable!("a quota always builds: {e}"))
    }
}
