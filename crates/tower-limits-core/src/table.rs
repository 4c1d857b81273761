//! Keyed state tables, one per limit and shard, each holding its algorithm's own state
//! type: a GCRA entry is its key and one integer, nothing more.
//!
//! Entries are found by the hash of the key path, computed once per tier by the caller,
//! and compared by the path itself, so a lookup allocates nothing. A path of up to 15
//! bytes (any IPv4 address, most single-tier ids) is kept in the entry and compared as two
//! words: no pointer to follow, no call to compare, no allocation on insertion. Longer
//! paths are copied to the heap when inserted.

use std::hash::BuildHasher;

use hashbrown::{DefaultHashBuilder, HashTable};

use crate::algorithm::{
    Algorithm, FixedWindowState, GcraState, Refusal, SemaphoreState, SlidingWindowCounterState, SlidingWindowLogState,
    Snapshot, TokenBucketState,
};
use crate::limit::{Limit, LimitState};
use crate::time::Instant;

pub(crate) struct Entry<S> {
    key: StoredKey,
    state: S,
}

/// The longest path kept inside an entry; the last of its 16 bytes holds the length.
const SHORT: usize = 15;

/// A key path as an entry keeps it.
enum StoredKey {
    /// The bytes as two little-endian words, zero-padded, with the length in the top byte
    /// of the second: two paths are equal when their words are.
    Short([u64; 2]),
    Long(Box<str>),
}

/// A path being looked up, in the form its entry keeps it: made once per lookup, so
/// that every comparison is the words' or, for a long path, the text's.
#[derive(Clone, Copy)]
enum Probe<'a> {
    Short([u64; 2]),
    Long(&'a str),
}

impl<'a> Probe<'a> {
    #[inline(always)]
    fn new(key: &'a str) -> Self {
        let bytes = key.as_bytes();
        if bytes.len() > SHORT {
            return Probe::Long(key);
        }
        let (lo, hi) = bytes.split_at(bytes.len().min(8));
        Probe::Short([word(lo), word(hi) | (bytes.len() as u64) << 56])
    }
}

/// Up to eight bytes as a little-endian word, zero-padded, read in at most two
/// overlapping loads. Never through a buffer: a word read back from bytes just written
/// into one, piece by piece, waits for every piece (the store cannot be forwarded).
#[inline(always)]
fn word(b: &[u8]) -> u64 {
    let n = b.len();
    if n >= 4 {
        let first = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        let last = u32::from_le_bytes([b[n - 4], b[n - 3], b[n - 2], b[n - 1]]);
        u64::from(first) | u64::from(last) << (8 * (n - 4))
    } else if n > 0 {
        u64::from(b[0]) | u64::from(b[n / 2]) << (8 * (n / 2)) | u64::from(b[n - 1]) << (8 * (n - 1))
    } else {
        0
    }
}

impl StoredKey {
    fn new(probe: Probe<'_>) -> Self {
        match probe {
            Probe::Short(words) => StoredKey::Short(words),
            Probe::Long(key) => StoredKey::Long(key.into()),
        }
    }

    #[inline(always)]
    fn matches(&self, probe: &Probe<'_>) -> bool {
        match (self, probe) {
            (StoredKey::Short(a), Probe::Short(b)) => a == b,
            (StoredKey::Long(a), Probe::Long(b)) => **a == **b,
            _ => false,
        }
    }

    /// The hash the entry was placed by, for the table to move it when it grows.
    fn hash(&self, hasher: &DefaultHashBuilder) -> u64 {
        match self {
            StoredKey::Short([lo, hi]) => {
                let mut text = [0u8; 16];
                text[..8].copy_from_slice(&lo.to_le_bytes());
                text[8..].copy_from_slice(&hi.to_le_bytes());
                let len = usize::from(text[SHORT]).min(SHORT);
                // The bytes were a `&str`'s, cut at its end: they are its text again.
                key_hash(hasher, std::str::from_utf8(&text[..len]).unwrap_or_default())
            }
            StoredKey::Long(key) => key_hash(hasher, key),
        }
    }
}

/// The table of one limit in one shard.
pub(crate) enum Table {
    Gcra(HashTable<Entry<GcraState>>),
    TokenBucket(HashTable<Entry<TokenBucketState>>),
    SlidingWindowLog(HashTable<Entry<SlidingWindowLogState>>),
    SlidingWindowCounter(HashTable<Entry<SlidingWindowCounterState>>),
    FixedWindow(HashTable<Entry<FixedWindowState>>),
    Semaphore(HashTable<Entry<SemaphoreState>>),
}

/// A correction applied to one state after a grant.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Op {
    Release(u64),
    Refund {
        granted_at: Instant,
        amount: u64,
    },
    Charge {
        granted_at: Instant,
        amount: u64,
    },
    /// Charge down so that at most this much remains.
    Align(u64),
}

impl Op {
    /// Whether the correction adds to a state, so that an evicted (idle) state must be
    /// brought back to receive it.
    pub(crate) fn adds(self) -> bool {
        matches!(self, Op::Charge { .. } | Op::Align(_))
    }
}

/// Runs `$body` with `$a` bound to the algorithm and `$t` to its table.
macro_rules! with_table {
    ($limit:expr, $table:expr, |$a:ident, $t:ident| $body:expr, $mismatch:expr) => {
        match ($limit, $table) {
            (Limit::Gcra($a), Table::Gcra($t)) => $body,
            (Limit::TokenBucket($a), Table::TokenBucket($t)) => $body,
            (Limit::SlidingWindowLog($a), Table::SlidingWindowLog($t)) => $body,
            (Limit::SlidingWindowCounter($a), Table::SlidingWindowCounter($t)) => $body,
            (Limit::FixedWindow($a), Table::FixedWindow($t)) => $body,
            (Limit::Semaphore($a), Table::Semaphore($t)) => $body,
            _ => $mismatch,
        }
    };
}

#[inline(always)]
fn find<'t, S>(t: &'t HashTable<Entry<S>>, h: u64, key: &str) -> Option<&'t S> {
    let probe = Probe::new(key);
    t.find(h, |e| e.key.matches(&probe)).map(|e| &e.state)
}

#[inline(always)]
fn find_mut<'t, S>(t: &'t mut HashTable<Entry<S>>, h: u64, key: &str) -> Option<&'t mut S> {
    let probe = Probe::new(key);
    t.find_mut(h, |e| e.key.matches(&probe)).map(|e| &mut e.state)
}

fn insert<S>(t: &mut HashTable<Entry<S>>, hasher: &DefaultHashBuilder, h: u64, key: &str, state: S) {
    t.insert_unique(h, Entry { key: StoredKey::new(Probe::new(key)), state }, |e| e.key.hash(hasher));
}

/// The hash of a key path as every table stores it.
#[inline]
pub(crate) fn key_hash(hasher: &DefaultHashBuilder, key: &str) -> u64 {
    hasher.hash_one(key)
}

pub(crate) fn apply<A: Algorithm>(a: &A, s: &mut A::State, op: Op, now: Instant) {
    match op {
        Op::Release(amount) => a.release(s, amount),
        Op::Refund { granted_at, amount } => a.refund(s, now, granted_at, amount),
        Op::Charge { granted_at, amount } => a.charge(s, now, granted_at, amount),
        Op::Align(remaining) => {
            let local = a.peek(s, now).remaining;
            if local > remaining {
                a.charge(s, now, now, local - remaining);
            }
        }
    }
}

impl Table {
    pub(crate) fn for_limit(limit: &Limit) -> Table {
        match limit {
            Limit::Gcra(_) => Table::Gcra(HashTable::new()),
            Limit::TokenBucket(_) => Table::TokenBucket(HashTable::new()),
            Limit::SlidingWindowLog(_) => Table::SlidingWindowLog(HashTable::new()),
            Limit::SlidingWindowCounter(_) => Table::SlidingWindowCounter(HashTable::new()),
            Limit::FixedWindow(_) => Table::FixedWindow(HashTable::new()),
            Limit::Semaphore(_) => Table::Semaphore(HashTable::new()),
        }
    }

    pub(crate) fn len(&self) -> usize {
        match self {
            Table::Gcra(t) => t.len(),
            Table::TokenBucket(t) => t.len(),
            Table::SlidingWindowLog(t) => t.len(),
            Table::SlidingWindowCounter(t) => t.len(),
            Table::FixedWindow(t) => t.len(),
            Table::Semaphore(t) => t.len(),
        }
    }

    /// Whether `key` has a state here.
    #[inline]
    pub(crate) fn contains(&self, h: u64, key: &str) -> bool {
        match self {
            Table::Gcra(t) => find(t, h, key).is_some(),
            Table::TokenBucket(t) => find(t, h, key).is_some(),
            Table::SlidingWindowLog(t) => find(t, h, key).is_some(),
            Table::SlidingWindowCounter(t) => find(t, h, key).is_some(),
            Table::FixedWindow(t) => find(t, h, key).is_some(),
            Table::Semaphore(t) => find(t, h, key).is_some(),
        }
    }

    /// Checks `cost` for `key` without writing: (where the key's state is, if it has one;
    /// the answer). The place stays valid for [`Table::commit_at`] until this table
    /// changes.
    #[inline]
    pub(crate) fn check(
        &self,
        limit: &Limit,
        h: u64,
        key: &str,
        now: Instant,
        cost: u64,
    ) -> (Option<usize>, Result<(), Refusal>) {
        with_table!(
            limit,
            self,
            |a, t| {
                let probe = Probe::new(key);
                match t.find_bucket_index(h, |e| e.key.matches(&probe)) {
                    Some(at) => (Some(at), t.get_bucket(at).map_or(Ok(()), |e| a.check(&e.state, now, cost))),
                    None => (None, a.check(&a.fresh(), now, cost)),
                }
            },
            (None, Err(Refusal::Never { capacity: 0 }))
        )
    }

    /// Records a grant that [`Table::check`] allowed, on the state it found at `at` (no
    /// second lookup); returns `false` if there is none there (the table changed since).
    #[inline]
    pub(crate) fn commit_at(&mut self, limit: &Limit, at: usize, now: Instant, cost: u64) -> bool {
        with_table!(
            limit,
            self,
            |a, t| match t.get_bucket_mut(at) {
                Some(e) => {
                    a.commit(&mut e.state, now, cost);
                    true
                }
                None => false,
            },
            false
        )
    }

    /// Remaining capacity of `key` (a fresh state's when it has none).
    pub(crate) fn peek(&self, limit: &Limit, h: u64, key: &str, now: Instant) -> Snapshot {
        with_table!(
            limit,
            self,
            |a, t| match find(t, h, key) {
                Some(s) => a.peek(s, now),
                None => a.peek(&a.fresh(), now),
            },
            limit.peek(&limit.fresh(), now)
        )
    }

    /// Records a grant that [`Table::check`] allowed; returns whether a state was created.
    #[inline]
    pub(crate) fn commit(
        &mut self,
        limit: &Limit,
        hasher: &DefaultHashBuilder,
        h: u64,
        key: &str,
        now: Instant,
        cost: u64,
    ) -> bool {
        with_table!(
            limit,
            self,
            |a, t| {
                if let Some(s) = find_mut(t, h, key) {
                    a.commit(s, now, cost);
                    false
                } else {
                    let mut s = a.fresh();
                    a.commit(&mut s, now, cost);
                    insert(t, hasher, h, key, s);
                    true
                }
            },
            false
        )
    }

    /// Check and commit on an existing state: `None` when `key` has no state here.
    #[inline]
    pub(crate) fn acquire_existing(
        &mut self,
        limit: &Limit,
        h: u64,
        key: &str,
        now: Instant,
        cost: u64,
    ) -> Option<Result<(), (Refusal, Snapshot)>> {
        with_table!(
            limit,
            self,
            |a, t| find_mut(t, h, key).map(|s| a.acquire(s, now, cost).map_err(|r| (r, a.peek(s, now)))),
            Some(Err((Refusal::Never { capacity: 0 }, limit.peek(&limit.fresh(), now))))
        )
    }

    /// Applies `op` to `key`'s state; a state evicted since (idle) is brought back when
    /// `create` says so. Returns whether a state was created.
    pub(crate) fn apply(
        &mut self,
        limit: &Limit,
        hasher: &DefaultHashBuilder,
        (h, key): (u64, &str),
        op: Op,
        now: Instant,
        create: bool,
    ) -> bool {
        with_table!(
            limit,
            self,
            |a, t| {
                if let Some(s) = find_mut(t, h, key) {
                    apply(a, s, op, now);
                    false
                } else if create {
                    let mut s = a.fresh();
                    apply(a, &mut s, op, now);
                    insert(t, hasher, h, key, s);
                    true
                } else {
                    false
                }
            },
            false
        )
    }

    /// Drops every idle state; returns how many.
    pub(crate) fn sweep(&mut self, limit: &Limit, now: Instant) -> usize {
        let before = self.len();
        with_table!(limit, &mut *self, |a, t| t.retain(|e| !a.is_idle(&e.state, now)), ());
        before - self.len()
    }

    /// Permits held over all keys (semaphores; zero otherwise).
    pub(crate) fn held(&self) -> u64 {
        match self {
            Table::Semaphore(t) => t.iter().map(|e| e.state.held()).sum(),
            _ => 0,
        }
    }
}

/// Applies `op` to a global state.
pub(crate) fn apply_global(limit: &Limit, state: &mut LimitState, op: Op, now: Instant) {
    match (limit, state) {
        (Limit::Gcra(a), LimitState::Gcra(s)) => apply(a, s, op, now),
        (Limit::TokenBucket(a), LimitState::TokenBucket(s)) => apply(a, s, op, now),
        (Limit::SlidingWindowLog(a), LimitState::SlidingWindowLog(s)) => apply(a, &mut **s, op, now),
        (Limit::SlidingWindowCounter(a), LimitState::SlidingWindowCounter(s)) => apply(a, s, op, now),
        (Limit::FixedWindow(a), LimitState::FixedWindow(s)) => apply(a, s, op, now),
        (Limit::Semaphore(a), LimitState::Semaphore(s)) => apply(a, s, op, now),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Paths of every length around the inline bound, some differing only in a trailing
    /// zero byte or in their length byte's position.
    fn paths() -> Vec<String> {
        let mut paths: Vec<String> = (0..40).map(|n| "k".repeat(n)).collect();
        paths.extend(
            ["a", "a\0", "\0", "\0\0", "10.0.0.1", "10.0.0.10", "fifteen-bytes-x", "sixteen-bytes-xy"]
                .map(String::from),
        );
        paths.extend((0..2_000).map(|i| format!("tenant-{i}")));
        paths.extend((0..500).map(|i| format!("a-much-longer-tenant-path-{i}")));
        paths
    }

    #[test]
    fn every_path_is_found_again_after_the_table_grows() {
        let hasher = DefaultHashBuilder::default();
        let mut table: HashTable<Entry<u64>> = HashTable::new();
        let paths = paths();
        for (i, path) in paths.iter().enumerate() {
            let h = key_hash(&hasher, path);
            assert!(find(&table, h, path).is_none(), "{path:?} before insertion");
            insert(&mut table, &hasher, h, path, i as u64);
        }
        // The table has grown (and moved every entry by its stored hash) many times.
        assert_eq!(table.len(), paths.len());
        for (i, path) in paths.iter().enumerate() {
            let h = key_hash(&hasher, path);
            assert_eq!(find(&table, h, path), Some(&(i as u64)), "{path:?}");
        }
        for absent in ["b", "a\0\0", "k".repeat(40).as_str(), "tenant-2000", "sixteen-bytes-xz"] {
            assert!(find(&table, key_hash(&hasher, absent), absent).is_none(), "{absent:?}");
        }
    }

    #[test]
    fn a_word_is_its_bytes_zero_padded() {
        let bytes = *b"abcdefgh";
        for n in 0..=8 {
            let mut padded = [0u8; 8];
            padded[..n].copy_from_slice(&bytes[..n]);
            assert_eq!(word(&bytes[..n]), u64::from_le_bytes(padded), "{n} bytes");
        }
    }

    #[test]
    fn a_short_path_and_a_long_one_never_match() {
        let short = Probe::new("fifteen-bytes-x");
        let long = Probe::new("sixteen-bytes-xy");
        assert!(matches!(short, Probe::Short(_)));
        assert!(matches!(long, Probe::Long(_)));
        assert!(StoredKey::new(short).matches(&short));
        assert!(!StoredKey::new(short).matches(&long));
        assert!(!StoredKey::new(long).matches(&short));
        assert!(StoredKey::new(long).matches(&long));
        assert!(!StoredKey::new(Probe::new("a")).matches(&Probe::new("a\0")));
    }
}
