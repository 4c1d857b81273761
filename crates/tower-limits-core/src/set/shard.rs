//! The keyed states: shards, their per-limit tables, room and eviction.
//!
//! Keyed states live in shards chosen by the key's *root*, its broadest tier, so all the
//! tiers of one tenant share a shard. Shards are padded to their own cache lines.
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

use std::sync::{Arc, Mutex};

use super::{Counters, Shared};
use crate::key::TenantKey;
use crate::limit::Config;
use crate::table::{Table, key_hash};
use crate::time::Instant;

/// The most shards a set spreads its keys over.
pub(super) const MAX_SHARDS: usize = 128;

/// Shards per core that could contend for them.
const SHARDS_PER_CORE: usize = 4;

/// Keeps each lock on its own cache line, so that shards do not slow each other down.
#[repr(align(128))]
pub(super) struct Padded<T>(pub(super) T);

/// Keyed states of the tenants whose root hashes here. In declared order (`repr(C)`), the
/// keyed states first: see [`Keyed`].
#[repr(C)]
pub(super) struct Shard {
    pub(super) keyed: Keyed,
    pub(super) config: Arc<Config>,
}

/// In declared order (`repr(C)`): what every grant writes (the latest instant, the count
/// of grants, first of the counters) and what a new key's state writes (the count of
/// states) lie right after the lock's word, on its cache line. A grant then moves one line
/// of the shard's between cores, not three: laid out by the compiler, the count of grants
/// sat 430 bytes from the lock. The tables, which a grant only reads, come last.
#[repr(C)]
pub(super) struct Keyed {
    pub(super) latest: Instant,
    pub(super) len: usize,
    pub(super) cap: usize,
    pub(super) counters: Counters,
    /// One table per limit of the config (empty for global limits).
    pub(super) tables: Vec<Table>,
}

/// The shards of a set on this machine: see [`shard_count_for`].
pub(super) fn shard_count(max_keys: usize, states_per_key: usize) -> usize {
    shard_count_for(max_keys, states_per_key, std::thread::available_parallelism().map_or(1, usize::from))
}

/// Four shards per core (a power of two, at most [`MAX_SHARDS`]), and no more than keep
/// room for a few keys in each: a key needs one state per keyed limit, all in its shard.
///
/// Shards exist to spread the cores' locks; more than the cores can contend for only
/// spread the keys' tables and the shards' own lines thinner, so that a lookup that
/// misses the cache misses more.
pub(super) fn shard_count_for(max_keys: usize, states_per_key: usize, cores: usize) -> usize {
    let mut n = (cores.min(MAX_SHARDS) * SHARDS_PER_CORE).next_power_of_two().min(MAX_SHARDS);
    while n > 1 && max_keys / n < states_per_key.max(1) * 4 {
        n /= 2;
    }
    n
}

pub(super) fn shard_cap(max_keys: usize, shards: usize) -> usize {
    (max_keys / shards).max(1)
}

impl Shared {
    #[inline]
    pub(super) fn shard_of(&self, key: &TenantKey) -> &Mutex<Shard> {
        self.shard_at(self.root_hash(key))
    }

    /// The hash of the key's first tier: it picks the shard, and finds the states of
    /// limits keyed by that tier.
    #[inline]
    pub(super) fn root_hash(&self, key: &TenantKey) -> u64 {
        key_hash(&self.hasher, key.prefix(1).unwrap_or_default())
    }

    /// The shard of the keys whose root hashes to `h`.
    #[inline]
    pub(super) fn shard_at(&self, h: u64) -> &Mutex<Shard> {
        &self.shards[self.shard_index(h)].0
    }

    /// The number of the shard of the keys whose root hashes to `h`.
    #[inline]
    pub(super) fn shard_index(&self, h: u64) -> usize {
        // The high bits: the table uses the low ones.
        (h >> 40) as usize & self.mask
    }

    pub(super) fn shared_shards(&self) -> impl Iterator<Item = &Mutex<Shard>> {
        self.shards.iter().map(|s| &s.0)
    }
}

impl Keyed {
    /// Drops every idle state; returns how many.
    pub(super) fn sweep(&mut self, config: &Config, now: Instant) -> usize {
        let before = self.len;
        for (i, table) in self.tables.iter_mut().enumerate() {
            table.sweep(&config.limits[i].limit, now);
        }
        self.len = self.tables.iter().map(Table::len).sum();
        before - self.len
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn four_shards_per_core_within_the_bound_and_the_room() {
        // Room for 100,000 keys: four shards per core, rounded up to a power of two, at
        // most 128.
        assert_eq!(shard_count_for(100_000, 1, 1), 4);
        assert_eq!(shard_count_for(100_000, 1, 2), 8);
        assert_eq!(shard_count_for(100_000, 1, 3), 16);
        assert_eq!(shard_count_for(100_000, 1, 64), 128);
        assert_eq!(shard_count_for(100_000, 1, usize::MAX), 128);
        // Few keys: no fewer than four keys' states in each shard.
        assert_eq!(shard_count_for(64, 1, 64), 16);
        assert_eq!(shard_count_for(64, 4, 64), 4);
        assert_eq!(shard_count_for(10, 2, 2), 1);
        assert_eq!(shard_count_for(1, 1, 64), 1);
        // A machine that cannot tell its cores: one.
        assert_eq!(shard_count_for(100_000, 1, 0), 1);
    }
}
