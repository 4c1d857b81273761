//! Bounded per-key memories of the last answers: refusals until their `retry_after`
//! (so a flood of refused requests for one tenant costs no round trip), and the last
//! snapshots of every limit (what [`Backend::peek`](tower_limits_core::Backend::peek)
//! answers for headers).
//!
//! Each is a few mutex-guarded hash maps keyed by [`TenantKey`]. A map never holds more
//! than its capacity: when one is full, its entries that are no longer useful are dropped,
//! and if that is not enough, all of them (a cache may forget; it never decides wrongly,
//! it only costs a round trip more).

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use tower_limits_core::{Instant, LimitSnapshot, Snapshot, TenantKey};

const SHARDS: usize = 16;

pub(crate) struct BoundedMap<V> {
    shards: Box<[Mutex<HashMap<TenantKey, V>>]>,
    cap: usize,
    hasher: RandomState,
}

impl<V> BoundedMap<V> {
    pub(crate) fn new(capacity: usize) -> Self {
        let shards = SHARDS.min(capacity.max(1));
        BoundedMap {
            shards: (0..shards).map(|_| Mutex::new(HashMap::new())).collect(),
            cap: capacity.div_ceil(shards).max(1),
            hasher: RandomState::new(),
        }
    }

    fn shard(&self, key: &TenantKey) -> std::sync::MutexGuard<'_, HashMap<TenantKey, V>> {
        let i = (self.hasher.hash_one(key) >> 32) as usize % self.shards.len();
        self.shards[i].lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn insert(&self, key: &TenantKey, value: V, useless: impl Fn(&V) -> bool) {
        let mut map = self.shard(key);
        if map.len() >= self.cap && !map.contains_key(key) {
            map.retain(|_, v| !useless(v));
            if map.len() >= self.cap {
                map.clear();
            }
        }
        map.insert(key.clone(), value);
    }

    pub(crate) fn with<R>(&self, key: &TenantKey, f: impl FnOnce(&mut HashMap<TenantKey, V>) -> R) -> R {
        f(&mut self.shard(key))
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.shards.iter().map(|s| s.lock().unwrap_or_else(PoisonError::into_inner).len()).sum()
    }
}

/// A refusal remembered until it expires.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CachedRefusal {
    /// When the refused request would pass, on the caller's clock.
    pub(crate) until: Instant,
    /// When the refusal was answered.
    pub(crate) at: Instant,
    /// The cost that was refused.
    pub(crate) cost: u64,
    /// Whether the blocking limit counts cost (a smaller cost may then pass sooner).
    pub(crate) counts_cost: bool,
    pub(crate) limit: usize,
    pub(crate) needs_release: bool,
    pub(crate) snapshot: Snapshot,
}

/// What a cached refusal answers for a request of `cost` at `now`: the blocking limit,
/// the wait, whether a release is needed and the snapshot as it stands.
pub(crate) type CachedAnswer = (usize, Duration, bool, Snapshot);

pub(crate) fn lookup(
    map: &BoundedMap<CachedRefusal>,
    key: &TenantKey,
    cost: u64,
    now: Instant,
) -> Option<CachedAnswer> {
    map.with(key, |m| {
        let d = m.get(key)?;
        if now >= d.until {
            m.remove(key);
            return None;
        }
        // Certain only when the same blocking limit would block this request at least as
        // long: it counts requests, or this request costs at least as much.
        if d.counts_cost && cost < d.cost {
            return None;
        }
        let elapsed = now.saturating_since(d.at);
        let snapshot = Snapshot { reset: d.snapshot.reset.saturating_sub(elapsed), ..d.snapshot };
        Some((d.limit, d.until.saturating_since(now), d.needs_release, snapshot))
    })
}

/// The last snapshots of every limit for one key, and when they were answered.
pub(crate) type CachedSnapshots = (Instant, Box<[LimitSnapshot]>);

pub(crate) fn snapshots_at(map: &BoundedMap<CachedSnapshots>, key: &TenantKey, now: Instant) -> Vec<LimitSnapshot> {
    map.with(key, |m| {
        let Some((at, snaps)) = m.get(key) else { return Vec::new() };
        let elapsed = now.saturating_since(*at);
        snaps
            .iter()
            .map(|s| LimitSnapshot {
                snapshot: Snapshot { reset: s.snapshot.reset.saturating_sub(elapsed), ..s.snapshot },
                ..s.clone()
            })
            .collect()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn never_holds_more_than_its_capacity() {
        let map = BoundedMap::new(32);
        for i in 0..1000 {
            map.insert(&TenantKey::single(format!("t{i}")).unwrap(), i, |_| false);
            assert!(map.len() <= 32 + SHARDS);
        }
    }

    #[test]
    fn refusals_expire_exactly() {
        let map = BoundedMap::new(8);
        let key = TenantKey::single("a").unwrap();
        let snapshot = Snapshot { quota: 1, remaining: 0, reset: Duration::from_secs(1), window: Duration::ZERO };
        let d = CachedRefusal {
            until: Instant::from_nanos(1_000),
            at: Instant::ZERO,
            cost: 2,
            counts_cost: true,
            limit: 0,
            needs_release: false,
            snapshot,
        };
        map.insert(&key, d, |_| false);
        assert_eq!(lookup(&map, &key, 1, Instant::from_nanos(10)), None, "a smaller cost may pass sooner");
        let (_, wait, _, _) = lookup(&map, &key, 2, Instant::from_nanos(10)).unwrap();
        assert_eq!(wait, Duration::from_nanos(990));
        assert_eq!(lookup(&map, &key, 2, Instant::from_nanos(1_000)), None);
        assert_eq!(map.len(), 0);
    }
}
