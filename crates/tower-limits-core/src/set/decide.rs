//! An acquisition under the locks: which locks it takes, and the decision.
//!
//! **All or nothing.** Under those locks an acquisition first *checks* every limit
//! without writing anything ([`Algorithm::check`](crate::algorithm::Algorithm::check)),
//! and commits only if all of them pass. A refusal therefore changes no state: it names
//! the limit that frees last and the exact wait after which all of them would pass. A
//! cost above some limit's capacity is refused at once as
//! [`SetError::CostAboveCapacity`]: it can never pass, so it is never waited on.
//!
//! **Shadow limits.** A limit in shadow mode is checked like the others, but its refusal
//! does not block: the acquisition goes on without it, commits every other limit and
//! skips it, and the grant records it (one bit per limit) so that releases, settles and
//! refunds skip it too; nothing it never took is given back. It is counted as a shadow
//! refusal only when the acquisition is granted, so the count is exactly the refusals it
//! would add if it enforced, on the requests the enforcing limits let through.
//!
//! **Time.** `now` is passed in. Under the locks it is raised to the latest instant the
//! shard has seen, so two callers whose clock reads raced never move a state backwards.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use super::fast::{Decision, Fast};
use super::global::{Global, GlobalStates};
use super::permit::{Costs, Granted, HeldAt};
use super::shard::{Keyed, Shard};
use super::{Counters, LimitSnapshot, Shared, lock};
use crate::algorithm::{Refusal, Snapshot};
use crate::error::{CostAboveCapacity, KeyTableFull, LimitRefusal, MissingTier, SetError};
use crate::key::{MAX_TIERS, TenantKey};
use crate::limit::{Config, MAX_LIMITS};
use crate::table::{Place, key_hash};
use crate::time::Instant;

impl Shared {
    #[inline]
    pub(super) fn acquire(&self, key: &TenantKey, costs: &Costs, now: Instant) -> Result<Granted, SetError> {
        self.acquire_observed(key, costs, now, None)
    }

    /// An acquisition of the same cost on every limit. A set of one keyed limit (one rate
    /// per client, the commonest keyed set) is decided here, under its shard's lock
    /// alone, on one hash of the key that picks both the shard and, for a limit keyed by
    /// the first tier, the entry; any other set takes the general path.
    #[inline(always)]
    pub(super) fn acquire_uniform(&self, key: &TenantKey, cost: u64, now: Instant) -> Result<Granted, SetError> {
        if self.one_keyed.load(Ordering::Relaxed) {
            if let Some(root) = key.prefix(1) {
                let h = key_hash(&self.hasher, root);
                let mut shard = lock(self.shard_at(h));
                let Shard { config, keyed } = &mut *shard;
                // The hint is confirmed under the lock, which a replace holds to swap the
                // shard's config.
                if let Some(tier) = config.one_keyed {
                    return self.decide_keyed_one(config, keyed, key, (tier, root, h), cost, now);
                }
            }
        }
        self.acquire(key, &Costs::Uniform(cost), now)
    }

    /// The acquisition; with `observe`, every limit's state as the decision left it is
    /// read under the same locks, in the same pass.
    #[inline]
    pub(super) fn acquire_observed(
        &self,
        key: &TenantKey,
        costs: &Costs,
        now: Instant,
        mut observe: Option<&mut Vec<LimitSnapshot>>,
    ) -> Result<Granted, SetError> {
        if let Some(fast) = &self.fast {
            let cost = match costs {
                Costs::Uniform(c) => fast.cost(*c),
                Costs::Each(each) => each.first().copied().unwrap_or(u64::MAX),
            };
            let decision = fast.acquire(cost, now);
            if let (Some(out), Some(_)) = (observe.as_deref_mut(), &decision) {
                // Exactly one: the snapshots are boxed as they are, with no reallocation.
                out.reserve_exact(1);
                out.push(fast.observe(now));
            }
            match decision {
                Some(Decision::Granted(granted_at, version)) => {
                    return Ok(Granted { granted_at, version, shape: None, shadowed: 0, held: HeldAt::NONE });
                }
                Some(Decision::Refused(tat, at)) => return Err(SetError::Refused(fast.refusal(tat, at, cost))),
                Some(Decision::Never(capacity)) => {
                    return Err(SetError::CostAboveCapacity(fast_never(fast, cost, capacity)));
                }
                None => {}
            }
        }
        self.acquire_locked(key, costs, now, observe)
    }

    /// The acquisition under the locks. The answer is returned as it is, never wrapped,
    /// and without `observe` the decision is written straight into the caller's place: a
    /// result is some ninety bytes, and a copy of them read back right after the writes
    /// that made it stalls the core.
    fn acquire_locked(
        &self,
        key: &TenantKey,
        costs: &Costs,
        now: Instant,
        observe: Option<&mut Vec<LimitSnapshot>>,
    ) -> Result<Granted, SetError> {
        if !key.is_global() && self.tiered.load(Ordering::Acquire) {
            // The root's hash picks the shard and finds the states keyed by the first tier.
            let root = self.root_hash(key);
            let mut shard = lock(self.shard_at(root));
            let Shard { config, keyed } = &mut *shard;
            // The set's one global limit may live in its atomic: then the tenant's shard is
            // the only lock this acquisition takes.
            let atomic = if config.has_global { self.fast_global_live() } else { None };
            if config.has_global && atomic.is_none() {
                let mut global = self.lock_global();
                if self.fast_live().is_some() {
                    // A replace enabled the fast path while this call waited for a lock.
                    drop(global);
                    drop(shard);
                    return self.acquire_observed(key, costs, now, observe);
                }
                let Some(out) = observe else {
                    return self.decide::<false>(
                        config,
                        Some(keyed),
                        Some(&mut global.states),
                        (key, root),
                        costs,
                        now,
                    );
                };
                let result =
                    self.decide::<false>(config, Some(keyed), Some(&mut global.states), (key, root), costs, now);
                self.observe(config, Some(keyed), Some(&global.states), key, now, out);
                result
            } else {
                // Each its own decision: a set with no global limit decides with no trace of
                // the atomic's code.
                let Some(out) = observe else {
                    return if atomic.is_some() {
                        self.decide::<true>(config, Some(keyed), None, (key, root), costs, now)
                    } else {
                        self.decide::<false>(config, Some(keyed), None, (key, root), costs, now)
                    };
                };
                let result = self.decide::<true>(config, Some(keyed), None, (key, root), costs, now);
                self.observe(config, Some(keyed), None, key, now, out);
                result
            }
        } else {
            let mut global = self.lock_global();
            if self.fast_live().is_some() {
                drop(global);
                return self.acquire_observed(key, costs, now, observe);
            }
            if global.config.has_tiered && !key.is_global() {
                // The policy gained keyed limits since the hint was read: take the locks
                // in order.
                drop(global);
                let root = self.root_hash(key);
                let mut shard = lock(self.shard_at(root));
                let Shard { config, keyed } = &mut *shard;
                let mut global = self.lock_global();
                let result =
                    self.decide::<true>(config, Some(keyed), Some(&mut global.states), (key, root), costs, now);
                if let Some(out) = observe {
                    self.observe(config, Some(keyed), Some(&global.states), key, now, out);
                }
                return result;
            }
            let Global { config, states } = &mut *global;
            let Some(out) = observe else {
                return self.decide::<true>(config, None, Some(states), (key, 0), costs, now);
            };
            let result = self.decide::<true>(config, None, Some(states), (key, 0), costs, now);
            self.observe(config, None, Some(states), key, now, out);
            result
        }
    }

    /// Every limit's state for `key`, read under the locks the caller holds (the
    /// acquisition's, or a peek's); a keyed limit needs the shard, and is skipped for a
    /// key too shallow for its tier.
    pub(super) fn observe(
        &self,
        cfg: &Config,
        shard: Option<&Keyed>,
        global: Option<&GlobalStates>,
        key: &TenantKey,
        now: Instant,
        out: &mut Vec<LimitSnapshot>,
    ) {
        let mut now = now;
        if let Some(s) = shard {
            now = now.max(s.latest);
        }
        if let Some(g) = global {
            now = now.max(g.latest);
        }
        // Exactly the limits: the snapshots are boxed as they are, with no reallocation.
        out.reserve_exact(cfg.limits.len());
        for (i, def) in cfg.limits.iter().enumerate() {
            let snapshot = match def.tier {
                None => match self.fast_global_live() {
                    Some(fast) if fast.index() == i => fast.observe(now).snapshot,
                    _ => def.limit.peek(global.map_or(&cfg.fresh[i], |g| &g.states[i]), now),
                },
                Some(t) => {
                    let (Some(s), Some(prefix)) = (shard, key.prefix(t + 1)) else { continue };
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
    }

    /// The decision, under the locks the caller took; `root_hash` is the hash of the
    /// key's first tier, which picked the shard (unused without one). With `ATOMIC`, the
    /// set's one global limit is decided in its atomic while that rules; without, the
    /// caller knows that it does not.
    #[allow(clippy::too_many_lines)]
    #[inline]
    fn decide<const ATOMIC: bool>(
        &self,
        config: &Arc<Config>,
        mut shard: Option<&mut Keyed>,
        mut global: Option<&mut GlobalStates>,
        (key, root_hash): (&TenantKey, u64),
        costs: &Costs,
        now: Instant,
    ) -> Result<Granted, SetError> {
        let cfg: &Config = config;
        if cfg.depth_needed > 0 && key.prefix(cfg.depth_needed).is_none() {
            return Err(SetError::MissingTier(MissingTier { tier: cfg.tiers[key.depth()] }));
        }
        let mut now = now;
        if let Some(s) = &shard {
            now = now.max(s.latest);
        }
        if let Some(g) = &global {
            now = now.max(g.latest);
        }

        if cfg.limits.len() == 1 {
            return self.decide_one(config, shard, global, (key, root_hash), costs, now);
        }

        // Each tier the policy uses, as the key's path to it and that path's hash, found
        // once (the first tier's hash picked the shard). A tier the key lacks (only a
        // shadow limit's can be missing) is left empty and never read.
        let depth = key.depth();
        let mut paths: [(&[u8], u64); MAX_TIERS] = [(&[], 0); MAX_TIERS];
        if shard.is_some() {
            for &t in &cfg.tiers_used {
                let Some(prefix) = key.prefix(t + 1) else { break };
                paths[t] = (prefix, if t == 0 { root_hash } else { key_hash(&self.hasher, prefix) });
            }
        }

        // The set's one global limit, when its atomic rules (stable under any of the set's
        // locks): decided after every other limit passed, before any is committed.
        let atomic = if ATOMIC { self.fast_global_live() } else { None };
        let atomic_at = atomic.map_or(usize::MAX, Fast::index);

        // Phase 1: check everything, write nothing.
        let mut blocked: Option<(usize, Option<Duration>)> = None;
        let mut retry = Duration::ZERO;
        let mut needs_release = false;
        let mut new_entries = 0usize;
        // Where each keyed limit's state was found, for the commit (no second lookup).
        let mut found_at = [None::<Place>; MAX_LIMITS];
        // Shadow limits that would refuse: skipped below, not charged.
        let mut shadowed = 0u16;
        for (i, def) in cfg.limits.iter().enumerate() {
            let cost = costs.of(i, def);
            if def.shadow && def.tier.is_some_and(|t| t >= depth) {
                // The key lacks this shadow limit's tier: it would have been refused.
                shadowed |= 1 << i;
                continue;
            }
            let (found, result) = match def.tier {
                // Only a cost it can never take is refused here (at once, whatever else).
                None if i == atomic_at => (true, never_above(def.limit.capacity(), cost)),
                None => (true, def.limit.check(global.as_deref().map_or(&cfg.fresh[i], |g| &g.states[i]), now, cost)),
                Some(t) => {
                    let (prefix, h) = paths[t];
                    match shard.as_deref() {
                        Some(s) => {
                            let (at, result) = s.tables[i].check(&def.limit, h, prefix, now, cost);
                            found_at[i] = at;
                            (at.is_some(), result)
                        }
                        None => (false, def.limit.check(&cfg.fresh[i], now, cost)),
                    }
                }
            };
            if result.is_err() && def.shadow {
                shadowed |= 1 << i;
                continue;
            }
            if !found {
                new_entries += 1;
            }
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

        if let (Some(by), Some(fast)) = (blocked, atomic) {
            // The wait must cover the atomic's too; of equal waits the later limit names
            // the refusal, as in the pass above.
            if let Some(wait) = fast.wait(costs.of(atomic_at, &cfg.limits[atomic_at]), now) {
                let longer = match by {
                    (i, Some(_)) => wait > retry || (wait == retry && atomic_at > i),
                    (_, None) => true,
                };
                if longer {
                    retry = wait;
                    blocked = Some((atomic_at, Some(wait)));
                }
            }
        }
        if let Some((i, _)) = blocked {
            counters(&mut shard, &mut global).refused[i] += 1;
            let def = &cfg.limits[i];
            let snapshot = match def.tier {
                None if i == atomic_at => {
                    atomic.map_or_else(|| def.limit.peek(&cfg.fresh[i], now), |f| f.observe(now).snapshot)
                }
                None => def.limit.peek(global.as_deref().map_or(&cfg.fresh[i], |g| &g.states[i]), now),
                Some(t) => {
                    let (prefix, h) = paths[t];
                    match shard.as_deref() {
                        Some(s) => s.tables[i].peek(&def.limit, h, prefix, now),
                        None => def.limit.peek(&cfg.fresh[i], now),
                    }
                }
            };
            return Err(refused(cfg, i, retry, needs_release, snapshot));
        }

        // Room for the states this grant creates.
        if let Some(s) = shard.as_deref_mut() {
            if new_entries > 0 && s.len + new_entries > s.cap {
                s.sweep(cfg, now);
                // The tables changed: the states are looked up again at the commit.
                found_at = [None; MAX_LIMITS];
                // The sweep may have evicted idle states of this very key: count again.
                new_entries = cfg
                    .limits
                    .iter()
                    .enumerate()
                    .filter_map(|(i, def)| def.tier.map(|t| (i, t)))
                    .filter(|&(i, _)| shadowed & (1 << i) == 0)
                    .filter(|&(i, t)| {
                        let (prefix, h) = paths[t];
                        !s.tables[i].contains(h, prefix)
                    })
                    .count();
                if s.len + new_entries > s.cap {
                    return Err(SetError::KeyTableFull(KeyTableFull { max_keys: cfg.max_keys }));
                }
            }
        }

        // The atomic last: its grant is the one step that can still refuse, and then
        // nothing else has been written.
        if let Some(fast) = atomic {
            if let Err(refused) = take_atomic(cfg, fast, costs.of(atomic_at, &cfg.limits[atomic_at]), now) {
                // Not yet: a cost above its capacity was refused in its turn, above.
                counters(&mut shard, &mut global).refused[atomic_at] += 1;
                return Err(refused);
            }
        }

        // Phase 2: everything passed; commit everything.
        for (i, def) in cfg.limits.iter().enumerate() {
            if shadowed & (1 << i) != 0 {
                continue;
            }
            let cost = costs.of(i, def);
            match def.tier {
                None if i == atomic_at => {}
                None => {
                    if let Some(g) = global.as_deref_mut() {
                        def.limit.commit(&mut g.states[i], now, cost);
                    }
                }
                Some(t) => {
                    let Some(s) = shard.as_deref_mut() else { continue };
                    if let Some(at) = found_at[i] {
                        if s.tables[i].commit_at(&def.limit, at, now, cost) {
                            continue;
                        }
                        found_at[i] = None;
                    }
                    let (prefix, h) = paths[t];
                    if s.tables[i].commit(&def.limit, &self.hasher, h, prefix, now, cost) {
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
        let counters = counters(&mut shard, &mut global);
        counters.admitted += 1;
        if shadowed != 0 {
            count_shadowed(counters, shadowed);
        }
        let keep = cfg.has_semaphore || shadowed != 0;
        // The place of the policy's one keyed semaphore's state, for a release with no
        // lookup (when the commit found it there rather than creating it; the release
        // confirms the rest).
        let held = match cfg.keyed_semaphores[..] {
            [(j, _)] => found_at[j].map_or(HeldAt::NONE, |at| HeldAt::new(self.shard_index(root_hash), at)),
            _ => HeldAt::NONE,
        };
        Ok(Granted { granted_at: now, version: cfg.version, shape: keep.then_some(cfg.shape), shadowed, held })
    }

    /// The decision for a set of one limit: one lookup, check and commit together.
    #[inline]
    fn decide_one(
        &self,
        config: &Arc<Config>,
        mut shard: Option<&mut Keyed>,
        mut global: Option<&mut GlobalStates>,
        (key, root_hash): (&TenantKey, u64),
        costs: &Costs,
        now: Instant,
    ) -> Result<Granted, SetError> {
        let cfg: &Config = config;
        let def = &cfg.limits[0];
        let cost = costs.of(0, def);
        if def.shadow && def.tier.is_some_and(|t| key.prefix(t + 1).is_none()) {
            // The key lacks this shadow limit's tier: it would have been refused.
            let counters = counters(&mut shard, &mut global);
            counters.admitted += 1;
            counters.shadow_refused[0] += 1;
            return Ok(Granted {
                granted_at: now,
                version: cfg.version,
                shape: Some(cfg.shape),
                shadowed: 1,
                held: HeldAt::NONE,
            });
        }
        match (def.tier, shard, global) {
            (None, _, Some(g)) => {
                let result =
                    def.limit.acquire(&mut g.states[0], now, cost).map_err(|r| (r, def.limit.peek(&g.states[0], now)));
                if result.is_ok() {
                    g.latest = now;
                }
                answer_one(cfg, &mut g.counters, result, (cost, HeldAt::NONE), now)
            }
            (Some(t), Some(s), _) => {
                let prefix = key.prefix(t + 1).unwrap_or_default();
                let h = if t == 0 { root_hash } else { key_hash(&self.hasher, prefix) };
                self.decide_keyed(cfg, s, (prefix, h, root_hash), cost, now)
            }
            _ => unreachable!("the caller locks what the limit's scope needs"),
        }
    }

    /// The decision for a set of one keyed limit, keyed by `tier`, under its shard's lock;
    /// `root` is the key's first tier and `root_hash` its hash.
    #[inline(always)]
    fn decide_keyed_one(
        &self,
        cfg: &Config,
        keyed: &mut Keyed,
        key: &TenantKey,
        (tier, root, root_hash): (usize, &[u8], u64),
        cost: u64,
        now: Instant,
    ) -> Result<Granted, SetError> {
        let (prefix, h) = if tier == 0 {
            (root, root_hash)
        } else {
            let Some(prefix) = key.prefix(tier + 1) else {
                return Err(SetError::MissingTier(MissingTier { tier: cfg.tiers[key.depth()] }));
            };
            (prefix, key_hash(&self.hasher, prefix))
        };
        let cost = Costs::Uniform(cost).of(0, &cfg.limits[0]);
        self.decide_keyed(cfg, keyed, (prefix, h, root_hash), cost, now.max(keyed.latest))
    }

    /// The one limit's decision on the state of `prefix` (its hash `h`; `root_hash` picked
    /// the shard): the existing state's, or a fresh one's, created on a grant if there is
    /// room. A semaphore's grant keeps the place of the state it found, for its release.
    #[inline(always)]
    fn decide_keyed(
        &self,
        cfg: &Config,
        s: &mut Keyed,
        (prefix, h, root_hash): (&[u8], u64, u64),
        cost: u64,
        now: Instant,
    ) -> Result<Granted, SetError> {
        let def = &cfg.limits[0];
        let mut held = HeldAt::NONE;
        let existing = if cfg.has_semaphore {
            s.tables[0].acquire_semaphore_at(&def.limit, h, prefix, now, cost).map(|(at, result)| {
                held = HeldAt::new(self.shard_index(root_hash), at);
                result
            })
        } else {
            s.tables[0].acquire_existing(&def.limit, h, prefix, now, cost)
        };
        let result = match existing {
            Some(result) => result,
            None => match def.limit.check(&cfg.fresh[0], now, cost) {
                Err(r) => Err((r, def.limit.peek(&cfg.fresh[0], now))),
                Ok(()) => {
                    if s.len >= s.cap {
                        s.sweep(cfg, now);
                        if s.len >= s.cap {
                            return Err(SetError::KeyTableFull(KeyTableFull { max_keys: cfg.max_keys }));
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
        answer_one(cfg, &mut s.counters, result, (cost, held), now)
    }
}

/// The answer of a set of one limit, from its decision: counted, and a refusal turned
/// into a grant uncharged when the limit is in shadow mode.
#[inline(always)]
fn answer_one(
    cfg: &Config,
    counters: &mut Counters,
    result: Result<(), (Refusal, Snapshot)>,
    (cost, held): (u64, HeldAt),
    now: Instant,
) -> Result<Granted, SetError> {
    match result {
        Ok(()) => {
            counters.admitted += 1;
            Ok(Granted {
                granted_at: now,
                version: cfg.version,
                shape: cfg.has_semaphore.then_some(cfg.shape),
                shadowed: 0,
                held,
            })
        }
        Err(_) if cfg.limits[0].shadow => {
            // Would have refused: admitted uncharged, and counted.
            counters.admitted += 1;
            counters.shadow_refused[0] += 1;
            Ok(Granted {
                granted_at: now,
                version: cfg.version,
                shape: Some(cfg.shape),
                shadowed: 1,
                held: HeldAt::NONE,
            })
        }
        Err((Refusal::Never { capacity }, _)) => {
            counters.impossible[0] += 1;
            Err(cost_above_capacity(cfg, 0, cost, capacity))
        }
        Err((Refusal::NotYet { retry_after }, snapshot)) => {
            counters.refused[0] += 1;
            Err(refused(cfg, 0, retry_after.unwrap_or(Duration::ZERO), retry_after.is_none(), snapshot))
        }
    }
}

/// The grant of the set's global limit in its atomic, or its refusal.
#[inline(always)]
fn take_atomic(cfg: &Config, fast: &Fast, cost: u64, now: Instant) -> Result<(), SetError> {
    let mut decision = fast.acquire(cost, now);
    if let Some(Decision::Refused(tat, at)) = decision {
        // A clock read that lagged decides again at the latest instant, as it would under
        // the global lock.
        decision = fast.decide_again_if_contended(cost, tat, at);
    }
    match decision {
        Some(Decision::Granted(..)) => Ok(()),
        Some(Decision::Refused(tat, at)) => Err(SetError::Refused(fast.refusal(tat, at, cost))),
        Some(Decision::Never(capacity)) => Err(cost_above_capacity(cfg, fast.index(), cost, capacity)),
        None => unreachable!("the atomic stays enabled under any of the set's locks"),
    }
}

/// A refusal of a cost above `capacity`, which no wait would pass.
#[inline]
fn never_above(capacity: u64, cost: u64) -> Result<(), Refusal> {
    if cost > capacity { Err(Refusal::Never { capacity }) } else { Ok(()) }
}

#[cold]
#[inline(never)]
fn refused(cfg: &Config, limit: usize, retry_after: Duration, needs_release: bool, snapshot: Snapshot) -> SetError {
    let def = &cfg.limits[limit];
    SetError::Refused(LimitRefusal::new(
        def.name,
        def.tier.map(|t| cfg.tiers[t]),
        limit,
        retry_after,
        needs_release,
        snapshot,
    ))
}

#[cold]
#[inline(never)]
pub(super) fn fast_never(fast: &Fast, cost: u64, capacity: u64) -> CostAboveCapacity {
    CostAboveCapacity { limit: fast.name(), tier: None, cost, capacity }
}

#[cold]
#[inline(never)]
fn cost_above_capacity(cfg: &Config, limit: usize, cost: u64, capacity: u64) -> SetError {
    let def = &cfg.limits[limit];
    SetError::CostAboveCapacity(CostAboveCapacity {
        limit: def.name,
        tier: def.tier.map(|t| cfg.tiers[t]),
        cost,
        capacity,
    })
}

fn count_shadowed(counters: &mut Counters, shadowed: u16) {
    for (i, n) in counters.shadow_refused.iter_mut().enumerate() {
        if shadowed & (1 << i) != 0 {
            *n += 1;
        }
    }
}

fn counters<'a>(shard: &'a mut Option<&mut Keyed>, global: &'a mut Option<&mut GlobalStates>) -> &'a mut Counters {
    match (shard, global) {
        (Some(s), _) => &mut s.counters,
        (None, Some(g)) => &mut g.counters,
        (None, None) => unreachable!("an acquisition holds at least one lock"),
    }
}
