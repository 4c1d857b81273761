//! Corrections to a grant after the fact: its release, settle and cancel, under the
//! locks each needs, mapped to the current policy when a replace came in between.
//!
//! A release of a grant that kept the place of its one keyed semaphore's state (see
//! [`HeldAt`](super::permit::HeldAt)) tries that place first, under the shard's lock;
//! any other release goes by the key, under the shard's lock alone when every
//! semaphore of the policy is keyed, and through [`Shared::correct`] otherwise.

use super::permit::{Costs, Grant};
use super::shard::Shard;
use super::{ANY_VERSION, Shared, lock};
use crate::key::TenantKey;
use crate::limit::{Config, LimitDef, Shape};
use crate::table::{Op, Place, apply_global, key_hash};
use crate::time::Instant;

/// The index, in the policy `grant` was made under, of limit `j` of `current`: the same
/// index under the same policy, the limit it became by name after a replace, or `None`
/// for a limit the grant never held.
#[inline]
fn granted_as(current: &Config, grant: &Grant, j: usize) -> Option<usize> {
    if current.version == grant.version || grant.version == ANY_VERSION {
        Some(j)
    } else if let Some(old) = grant.shape {
        (0..old.limits.len()).find(|&i| current.successor(old, i) == Some(j))
    } else {
        None
    }
}

impl Shared {
    /// Applies to each limit of the current policy the correction `op_for` gives for the
    /// grant's limit it maps to (by index, or by name after a policy change), under the
    /// locks that needs. A correction that adds to a state evicted since the grant brings
    /// it back, room permitting.
    pub(super) fn correct(
        &self,
        key: &TenantKey,
        grant: &Grant,
        now: Instant,
        op_for: impl Fn(usize, &LimitDef) -> Option<Op>,
    ) {
        let mut shard = (!key.is_global()).then(|| lock(self.shard_of(key)));
        let mut guard = self.lock_global();
        // Borrowed field by field: the config is read while the states change, with no
        // reference count taken.
        let global = &mut *guard;
        let current = &*global.config;
        let mut now = now.max(global.states.latest);
        // The lock-free path that rules a global limit, if one does.
        let atomic = self.fast_live().or(self.fast_global_live());
        if let Some(fast) = atomic {
            now = now.max(fast.latest());
        }
        if let Some(s) = &shard {
            now = now.max(s.keyed.latest);
        }
        for (j, def) in current.limits.iter().enumerate() {
            let Some(op) = granted_as(current, grant, j).and_then(|i| op_for(i, def)) else { continue };
            match def.tier {
                None => match atomic {
                    Some(fast) if j == fast.index() => fast.update(|state| apply_global(&def.limit, state, op, now)),
                    _ => apply_global(&def.limit, &mut global.states.states[j], op, now),
                },
                Some(t) => {
                    let Some(s) = shard.as_deref_mut().map(|s| &mut s.keyed) else { continue };
                    let Some(prefix) = key.prefix(t + 1) else { continue };
                    let h = key_hash(&self.hasher, prefix);
                    let mut create = op.adds();
                    if create && s.len >= s.cap && !s.tables[j].contains(h, prefix) {
                        s.sweep(current, now);
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

    /// Gives back the concurrency `grant` holds, if any: out of line, so that a permit's
    /// drop is one test.
    #[inline(never)]
    pub(super) fn release(&self, key: &TenantKey, grant: &Grant) {
        let Some(shape) = grant.shape.filter(|s| s.has_semaphore) else { return };
        if let Some((at_shard, place)) = grant.held.get() {
            if self.release_at(key, grant, shape, at_shard, place) {
                return;
            }
        }
        self.release_by_key(key, grant, shape);
    }

    /// The release of a grant that kept no place, or whose place is stale: by the key.
    /// Out of line, so that none of its work is started before the place is tried.
    #[inline(never)]
    fn release_by_key(&self, key: &TenantKey, grant: &Grant, shape: &Shape) {
        let op_for = |i: usize, def: &LimitDef| {
            (def.limit.is_semaphore() && !grant.shadowed(i))
                .then(|| Op::Release(grant.acquired_of(i, shape.limits[i].counts)))
        };
        if !key.is_global() {
            // When every semaphore of the current policy is keyed, the release touches the
            // key's shard alone: its lock suffices (a replace swaps the shard's config
            // under it too), and a release needs no instant. The root's hash picks the
            // shard and finds the state of a semaphore keyed by the first tier.
            let root = key.prefix(1).unwrap_or_default();
            let root_hash = key_hash(&self.hasher, root);
            let mut shard = lock(self.shard_at(root_hash));
            let Shard { config: current, keyed } = &mut *shard;
            if !current.global_semaphore {
                for &(j, t) in &current.keyed_semaphores {
                    let def = &current.limits[j];
                    let Some(Op::Release(amount)) = granted_as(current, grant, j).and_then(|i| op_for(i, def)) else {
                        continue;
                    };
                    let (prefix, h) = if t == 0 {
                        (root, root_hash)
                    } else {
                        let Some(prefix) = key.prefix(t + 1) else { continue };
                        (prefix, key_hash(&self.hasher, prefix))
                    };
                    keyed.tables[j].release(&def.limit, h, prefix, amount);
                }
                return;
            }
        }
        self.correct(key, grant, grant.granted_at, op_for);
    }

    /// Gives back the permits of the policy's one keyed semaphore at the place the grant
    /// kept (see [`HeldAt`]), when the grant's policy is still the current one and the
    /// state there is still the key's; returns whether it did.
    #[inline]
    pub(super) fn release_at(
        &self,
        key: &TenantKey,
        grant: &Grant,
        shape: &Shape,
        at_shard: usize,
        place: Place,
    ) -> bool {
        let Some(shard) = self.shards.get(at_shard) else { return false };
        let mut shard = lock(&shard.0);
        let Shard { config: current, keyed } = &mut *shard;
        let [(j, t)] = current.keyed_semaphores[..] else { return false };
        if current.version != grant.version || current.global_semaphore || grant.shadowed(j) {
            return false;
        }
        let Some(prefix) = key.prefix(t + 1) else { return false };
        let amount = grant.acquired_of(j, shape.limits[j].counts);
        keyed.tables[j].release_at(&current.limits[j].limit, place, prefix, amount)
    }

    pub(super) fn settle(&self, key: &TenantKey, grant: &mut Grant, actual: Costs, now: Instant) {
        let granted_at = grant.granted_at;
        let before: &Grant = grant;
        self.correct(key, before, now, |i, def| {
            if def.limit.is_semaphore() || before.shadowed(i) {
                return None;
            }
            let (was, is) = (before.charged_of(i, def), actual.of(i, def));
            match is.cmp(&was) {
                std::cmp::Ordering::Greater => Some(Op::Charge { granted_at, amount: is - was }),
                std::cmp::Ordering::Less => Some(Op::Refund { granted_at, amount: was - is }),
                std::cmp::Ordering::Equal => None,
            }
        });
        grant.set_charged(actual);
    }

    pub(super) fn cancel(&self, key: &TenantKey, grant: &Grant, now: Instant) {
        let granted_at = grant.granted_at;
        self.correct(key, grant, now, |i, def| {
            (!def.limit.is_semaphore() && !grant.shadowed(i))
                .then(|| Op::Refund { granted_at, amount: grant.charged_of(i, def) })
        });
    }
}
