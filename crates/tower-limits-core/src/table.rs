//! Keyed state tables, one per limit and shard, each holding its algorithm's own state
//! type: a GCRA entry is its key and one integer, nothing more.
//!
//! Entries are found by the hash of the key path, computed once per tier by the caller,
//! and compared by the path itself, so a lookup allocates nothing. A key that is one
//! number is kept as the number: a GCRA entry of 16 bytes. A path of up to 15 bytes (any
//! IPv4 address, most single-tier ids) is kept in the entry and compared as two words: no
//! pointer to follow, no call to compare, no allocation on insertion, a GCRA entry of 24
//! bytes. Longer paths are copied to the heap when inserted.

use std::hash::BuildHasher;

use hashbrown::{DefaultHashBuilder, HashTable};

use crate::algorithm::{
    Algorithm, CalendarWindowState, FixedWindowState, GcraState, Refusal, SemaphoreState, SlidingWindowCounterState,
    SlidingWindowLogState, Snapshot, TokenBucketState,
};
use crate::key::{NUMBER_PATH, as_ipv4, as_number};
use crate::limit::{Limit, LimitState};
use crate::time::Instant;

/// The states of one limit in one shard, by key, in three tables by the key's form, so
/// that every entry is its key and its state and nothing else (no tag saying which form
/// the key has): a GCRA entry for a short path is 24 bytes, for a number 16.
pub(crate) struct Tables<S> {
    /// Paths of up to 15 bytes (any IPv4 address, most ids), as two words: the bytes
    /// little-endian, zero-padded, with the length in the top byte of the second. Two
    /// paths are equal when their words are.
    short: HashTable<([u64; 2], S)>,
    /// Keys that are one number ([`TenantKey::from_u64`](crate::TenantKey::from_u64)),
    /// by the number.
    numbers: HashTable<(u64, S)>,
    /// Longer paths, copied to the heap once, when first seen.
    long: HashTable<(Box<[u8]>, S)>,
}

/// Where [`Table::check`] found a state, for [`Table::commit_at`]: a table and a bucket.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Place {
    Short(usize),
    Number(usize),
    Long(usize),
}

impl Place {
    /// The place as its table's number (0 for short paths, 1 for numbers, 2 for long
    /// paths) and the bucket: what [`Place::from_parts`] takes back.
    pub(crate) fn parts(self) -> (u8, usize) {
        match self {
            Place::Short(at) => (0, at),
            Place::Number(at) => (1, at),
            Place::Long(at) => (2, at),
        }
    }

    /// The place of [`Place::parts`]; `None` for a table number that is none of them.
    pub(crate) fn from_parts(table: u8, bucket: usize) -> Option<Place> {
        match table {
            0 => Some(Place::Short(bucket)),
            1 => Some(Place::Number(bucket)),
            2 => Some(Place::Long(bucket)),
            _ => None,
        }
    }
}

/// The longest path kept as words; the last of their 16 bytes holds the length.
const SHORT: usize = 15;

/// A path being looked up, in the form its table keeps it: made once per lookup, so
/// that every comparison is the number's, the words' or, for a long path, the bytes'.
#[derive(Clone, Copy)]
enum Probe<'a> {
    Number(u64),
    Short([u64; 2]),
    Long(&'a [u8]),
}

impl<'a> Probe<'a> {
    #[inline(always)]
    fn new(key: &'a [u8]) -> Self {
        if let Some(n) = as_number(key) {
            return Probe::Number(n);
        }
        if key.len() > SHORT {
            return Probe::Long(key);
        }
        let (lo, hi) = key.split_at(key.len().min(8));
        Probe::Short([word(lo), word(hi) | (key.len() as u64) << 56])
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

/// The hash a short path's entry was placed by, for its table to move it when it grows.
fn short_hash(hasher: &DefaultHashBuilder, [lo, hi]: [u64; 2]) -> u64 {
    let mut bytes = [0u8; 16];
    bytes[..8].copy_from_slice(&lo.to_le_bytes());
    bytes[8..].copy_from_slice(&hi.to_le_bytes());
    let len = usize::from(bytes[SHORT]).min(SHORT);
    key_hash(hasher, &bytes[..len])
}

impl<S> Tables<S> {
    fn new() -> Self {
        Tables { short: HashTable::new(), numbers: HashTable::new(), long: HashTable::new() }
    }

    fn len(&self) -> usize {
        self.short.len() + self.numbers.len() + self.long.len()
    }

    #[inline(always)]
    fn find(&self, h: u64, key: &[u8]) -> Option<&S> {
        self.place(h, key).and_then(|at| self.at(at))
    }

    #[inline(always)]
    fn find_mut(&mut self, h: u64, key: &[u8]) -> Option<&mut S> {
        match Probe::new(key) {
            Probe::Short(words) => self.short.find_mut(h, |e| e.0 == words).map(|e| &mut e.1),
            Probe::Number(n) => self.numbers.find_mut(h, |e| e.0 == n).map(|e| &mut e.1),
            Probe::Long(key) => self.long.find_mut(h, |e| *e.0 == *key).map(|e| &mut e.1),
        }
    }

    #[inline(always)]
    fn place(&self, h: u64, key: &[u8]) -> Option<Place> {
        match Probe::new(key) {
            Probe::Short(words) => self.short.find_bucket_index(h, |e| e.0 == words).map(Place::Short),
            Probe::Number(n) => self.numbers.find_bucket_index(h, |e| e.0 == n).map(Place::Number),
            Probe::Long(key) => self.long.find_bucket_index(h, |e| *e.0 == *key).map(Place::Long),
        }
    }

    #[inline(always)]
    fn at(&self, place: Place) -> Option<&S> {
        match place {
            Place::Short(at) => self.short.get_bucket(at).map(|e| &e.1),
            Place::Number(at) => self.numbers.get_bucket(at).map(|e| &e.1),
            Place::Long(at) => self.long.get_bucket(at).map(|e| &e.1),
        }
    }

    #[inline(always)]
    fn at_mut(&mut self, place: Place) -> Option<&mut S> {
        match place {
            Place::Short(at) => self.short.get_bucket_mut(at).map(|e| &mut e.1),
            Place::Number(at) => self.numbers.get_bucket_mut(at).map(|e| &mut e.1),
            Place::Long(at) => self.long.get_bucket_mut(at).map(|e| &mut e.1),
        }
    }

    /// The state at `place` if it is `key`'s (the bucket may be empty, or hold another
    /// key, since the place was found).
    #[inline(always)]
    fn at_key_mut(&mut self, place: Place, key: &[u8]) -> Option<&mut S> {
        match (place, Probe::new(key)) {
            (Place::Short(at), Probe::Short(words)) => {
                self.short.get_bucket_mut(at).filter(|e| e.0 == words).map(|e| &mut e.1)
            }
            (Place::Number(at), Probe::Number(n)) => {
                self.numbers.get_bucket_mut(at).filter(|e| e.0 == n).map(|e| &mut e.1)
            }
            (Place::Long(at), Probe::Long(key)) => {
                self.long.get_bucket_mut(at).filter(|e| *e.0 == *key).map(|e| &mut e.1)
            }
            _ => None,
        }
    }

    fn insert(&mut self, hasher: &DefaultHashBuilder, h: u64, key: &[u8], state: S) {
        match Probe::new(key) {
            Probe::Short(words) => {
                self.short.insert_unique(h, (words, state), |e| short_hash(hasher, e.0));
            }
            Probe::Number(n) => {
                self.numbers.insert_unique(h, (n, state), |e| hasher.hash_one(e.0));
            }
            Probe::Long(key) => {
                self.long.insert_unique(h, (key.into(), state), |e| key_hash(hasher, &e.0));
            }
        }
    }

    fn retain(&mut self, mut keep: impl FnMut(&S) -> bool) {
        self.short.retain(|e| keep(&e.1));
        self.numbers.retain(|e| keep(&e.1));
        self.long.retain(|e| keep(&e.1));
    }

    fn states(&self) -> impl Iterator<Item = &S> {
        let short = self.short.iter().map(|e| &e.1);
        short.chain(self.numbers.iter().map(|e| &e.1)).chain(self.long.iter().map(|e| &e.1))
    }
}

/// The table of one limit in one shard.
pub(crate) enum Table {
    Gcra(Tables<GcraState>),
    TokenBucket(Tables<TokenBucketState>),
    SlidingWindowLog(Tables<SlidingWindowLogState>),
    SlidingWindowCounter(Tables<SlidingWindowCounterState>),
    FixedWindow(Tables<FixedWindowState>),
    CalendarWindow(Tables<CalendarWindowState>),
    Semaphore(Tables<SemaphoreState>),
}

/// A decision on one state: granted, or the refusal with the state's snapshot.
pub(crate) type Decided = Result<(), (Refusal, Snapshot)>;

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
            (Limit::CalendarWindow($a), Table::CalendarWindow($t)) => $body,
            (Limit::Semaphore($a), Table::Semaphore($t)) => $body,
            _ => $mismatch,
        }
    };
}

/// The hash of a key path as every table stores it. A path that is one number is hashed
/// as that number, which is also what its table moves it by when it grows: that saves
/// the loop over its ten bytes on every lookup by numeric id (`ops keyed-ids`,
/// `keyed-ids-100k` show it). A path that is one IPv4 address is hashed as its 32 bits.
#[inline(always)]
pub(crate) fn key_hash(hasher: &DefaultHashBuilder, key: &[u8]) -> u64 {
    // The length first: any other path pays one comparison.
    if key.len() == NUMBER_PATH {
        if let Some(n) = as_number(key) {
            return hasher.hash_one(n);
        }
    }
    if let Some(ip) = as_ipv4(key) {
        return hasher.hash_one(ip);
    }
    hasher.hash_one(key)
}

/// Check and commit on one state, with the state's snapshot on a refusal.
#[inline(always)]
fn acquire_on<A: Algorithm>(a: &A, s: &mut A::State, now: Instant, cost: u64) -> Decided {
    match a.acquire(s, now, cost) {
        Ok(()) => Ok(()),
        Err(r) => Err((r, a.peek(s, now))),
    }
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
            Limit::Gcra(_) => Table::Gcra(Tables::new()),
            Limit::TokenBucket(_) => Table::TokenBucket(Tables::new()),
            Limit::SlidingWindowLog(_) => Table::SlidingWindowLog(Tables::new()),
            Limit::SlidingWindowCounter(_) => Table::SlidingWindowCounter(Tables::new()),
            Limit::FixedWindow(_) => Table::FixedWindow(Tables::new()),
            Limit::CalendarWindow(_) => Table::CalendarWindow(Tables::new()),
            Limit::Semaphore(_) => Table::Semaphore(Tables::new()),
        }
    }

    pub(crate) fn len(&self) -> usize {
        match self {
            Table::Gcra(t) => t.len(),
            Table::TokenBucket(t) => t.len(),
            Table::SlidingWindowLog(t) => t.len(),
            Table::SlidingWindowCounter(t) => t.len(),
            Table::FixedWindow(t) => t.len(),
            Table::CalendarWindow(t) => t.len(),
            Table::Semaphore(t) => t.len(),
        }
    }

    /// Whether `key` has a state here.
    #[inline]
    pub(crate) fn contains(&self, h: u64, key: &[u8]) -> bool {
        match self {
            Table::Gcra(t) => t.find(h, key).is_some(),
            Table::TokenBucket(t) => t.find(h, key).is_some(),
            Table::SlidingWindowLog(t) => t.find(h, key).is_some(),
            Table::SlidingWindowCounter(t) => t.find(h, key).is_some(),
            Table::FixedWindow(t) => t.find(h, key).is_some(),
            Table::CalendarWindow(t) => t.find(h, key).is_some(),
            Table::Semaphore(t) => t.find(h, key).is_some(),
        }
    }

    /// Checks `cost` for `key` without writing: (where the key's state is, if it has one;
    /// the answer). The place stays valid for [`Table::commit_at`] until this table
    /// changes.
    #[inline(always)]
    pub(crate) fn check(
        &self,
        limit: &Limit,
        h: u64,
        key: &[u8],
        now: Instant,
        cost: u64,
    ) -> (Option<Place>, Result<(), Refusal>) {
        with_table!(
            limit,
            self,
            |a, t| {
                match t.place(h, key) {
                    Some(at) => (Some(at), t.at(at).map_or(Ok(()), |s| a.check(s, now, cost))),
                    None => (None, a.check(&a.fresh(), now, cost)),
                }
            },
            (None, Err(Refusal::Never { capacity: 0 }))
        )
    }

    /// Records a grant that [`Table::check`] allowed, on the state it found at `at` (no
    /// second lookup); returns `false` if there is none there (the table changed since).
    #[inline(always)]
    pub(crate) fn commit_at(&mut self, limit: &Limit, at: Place, now: Instant, cost: u64) -> bool {
        with_table!(
            limit,
            self,
            |a, t| match t.at_mut(at) {
                Some(s) => {
                    a.commit(s, now, cost);
                    true
                }
                None => false,
            },
            false
        )
    }

    /// Remaining capacity of `key` (a fresh state's when it has none).
    pub(crate) fn peek(&self, limit: &Limit, h: u64, key: &[u8], now: Instant) -> Snapshot {
        with_table!(
            limit,
            self,
            |a, t| match t.find(h, key) {
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
        key: &[u8],
        now: Instant,
        cost: u64,
    ) -> bool {
        with_table!(
            limit,
            self,
            |a, t| {
                if let Some(s) = t.find_mut(h, key) {
                    a.commit(s, now, cost);
                    false
                } else {
                    let mut s = a.fresh();
                    a.commit(&mut s, now, cost);
                    t.insert(hasher, h, key, s);
                    true
                }
            },
            false
        )
    }

    /// Check and commit on an existing state: `None` when `key` has no state here.
    /// Inlined: its answer would otherwise come back through memory and be read again.
    #[inline(always)]
    pub(crate) fn acquire_existing(
        &mut self,
        limit: &Limit,
        h: u64,
        key: &[u8],
        now: Instant,
        cost: u64,
    ) -> Option<Decided> {
        with_table!(
            limit,
            self,
            // No closure: one the compiler kept out of line returned its answer through
            // memory, read back at once (a sixth of a numeric key's acquisition).
            |a, t| Some(acquire_on(a, t.find_mut(h, key)?, now, cost)),
            Some(Err((Refusal::Never { capacity: 0 }, limit.peek(&limit.fresh(), now))))
        )
    }

    /// [`Table::acquire_existing`] for a semaphore, with the place of the state it found
    /// (for a release with no lookup); `None` when `key` has no state here, or the limit is
    /// not a semaphore.
    #[inline(always)]
    pub(crate) fn acquire_semaphore_at(
        &mut self,
        limit: &Limit,
        h: u64,
        key: &[u8],
        now: Instant,
        cost: u64,
    ) -> Option<(Place, Decided)> {
        let (Limit::Semaphore(a), Table::Semaphore(t)) = (limit, self) else { return None };
        let at = t.place(h, key)?;
        Some((at, acquire_on(a, t.at_mut(at)?, now, cost)))
    }

    /// Applies `op` to `key`'s state; a state evicted since (idle) is brought back when
    /// `create` says so. Returns whether a state was created.
    pub(crate) fn apply(
        &mut self,
        limit: &Limit,
        hasher: &DefaultHashBuilder,
        (h, key): (u64, &[u8]),
        op: Op,
        now: Instant,
        create: bool,
    ) -> bool {
        with_table!(
            limit,
            self,
            |a, t| {
                if let Some(s) = t.find_mut(h, key) {
                    apply(a, s, op, now);
                    false
                } else if create {
                    let mut s = a.fresh();
                    apply(a, &mut s, op, now);
                    t.insert(hasher, h, key, s);
                    true
                } else {
                    false
                }
            },
            false
        )
    }

    /// Gives `amount` back to `key`'s semaphore; nothing for another limit, or for a key
    /// with no state (a semaphore holding nothing is idle, and may have been evicted).
    #[inline]
    pub(crate) fn release(&mut self, limit: &Limit, h: u64, key: &[u8], amount: u64) {
        if let (Limit::Semaphore(a), Table::Semaphore(t)) = (limit, self) {
            if let Some(s) = t.find_mut(h, key) {
                a.release(s, amount);
            }
        }
    }

    /// Gives `amount` back to the semaphore state at `place`, if that is still `key`'s
    /// state (a release that kept the place of its grant: no hash, no probe); returns
    /// whether it did. `false` sends the caller to [`Table::release`].
    #[inline]
    pub(crate) fn release_at(&mut self, limit: &Limit, place: Place, key: &[u8], amount: u64) -> bool {
        if let (Limit::Semaphore(a), Table::Semaphore(t)) = (limit, self) {
            if let Some(s) = t.at_key_mut(place, key) {
                a.release(s, amount);
                return true;
            }
        }
        false
    }

    /// Drops every idle state (the shard counts what is left).
    pub(crate) fn sweep(&mut self, limit: &Limit, now: Instant) {
        with_table!(limit, &mut *self, |a, t| t.retain(|s| !a.is_idle(s, now)), ());
    }

    /// Permits held over all keys (semaphores; zero otherwise).
    pub(crate) fn held(&self) -> u64 {
        match self {
            Table::Semaphore(t) => t.states().map(SemaphoreState::held).sum(),
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
        (Limit::CalendarWindow(a), LimitState::CalendarWindow(s)) => apply(a, s, op, now),
        (Limit::Semaphore(a), LimitState::Semaphore(s)) => apply(a, s, op, now),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::TenantKey;
    use crate::key::Typed;

    /// Paths of every length around the inline bound, some differing only in a trailing
    /// zero byte or in their length byte's position, and the paths of number and address
    /// keys, some of whose bytes look like the others'.
    fn paths() -> Vec<Vec<u8>> {
        let mut paths: Vec<Vec<u8>> = (0..40).map(|n| vec![b'k'; n]).collect();
        paths.extend(
            ["a", "a\0", "\0", "\0\0", "10.0.0.1", "10.0.0.10", "fifteen-bytes-x", "sixteen-bytes-xy"]
                .map(|p| p.as_bytes().to_vec()),
        );
        paths.extend((0..2_000).map(|i| format!("tenant-{i}").into_bytes()));
        paths.extend((0..500).map(|i| format!("a-much-longer-tenant-path-{i}").into_bytes()));
        let typed = (0..1_000u64)
            .map(|n| TenantKey::from_u64(n * 0x0101_0101))
            .chain([1, u64::MAX, 0x0a00_0001].map(TenantKey::from_u64))
            .chain((0..=255u8).map(|n| TenantKey::from_ip([10, 0, n, 1].into())))
            .chain([TenantKey::from_ip("2001:db8::1".parse().unwrap())]);
        paths.extend(typed.map(|key| key.prefix(1).unwrap_or_default().to_vec()));
        // A number's path with a byte more or less is not a number.
        let number = Typed::number(7);
        let number = number.as_bytes();
        paths.extend([number[..9].to_vec(), [number, b"x"].concat()]);
        paths
    }

    #[test]
    fn every_path_is_found_again_after_the_table_grows() {
        let hasher = DefaultHashBuilder::default();
        let mut table: Tables<u64> = Tables::new();
        let paths = paths();
        for (i, path) in paths.iter().enumerate() {
            let h = key_hash(&hasher, path);
            assert!(table.find(h, path).is_none(), "{path:?} before insertion");
            table.insert(&hasher, h, path, i as u64);
        }
        // The tables have grown (and moved every entry by its stored hash) many times.
        assert_eq!(table.len(), paths.len());
        assert_eq!(table.numbers.len(), 1_003, "every number key, and nothing else, is kept by its number");
        for (i, path) in paths.iter().enumerate() {
            let h = key_hash(&hasher, path);
            assert_eq!(table.find(h, path), Some(&(i as u64)), "{path:?}");
            let place = table.place(h, path).expect("found");
            assert_eq!(table.at(place), Some(&(i as u64)), "{path:?}");
            *table.find_mut(h, path).expect("found") += 1;
        }
        assert_eq!(table.states().sum::<u64>(), (1..=paths.len() as u64).sum::<u64>());
        let absent = [
            b"b".to_vec(),
            b"a\0\0".to_vec(),
            vec![b'k'; 40],
            b"tenant-2000".to_vec(),
            b"sixteen-bytes-xy!".to_vec(),
            Typed::number(2).as_bytes().to_vec(),
        ];
        for path in absent {
            assert!(table.find(key_hash(&hasher, &path), &path).is_none(), "{path:?}");
        }
        table.retain(|n| n % 2 == 0);
        assert_eq!(table.len(), paths.len() / 2);
        assert!(table.states().all(|n| n % 2 == 0));
    }

    /// A release at a place gives back to the state there only if it is the key's: never
    /// to another key's, nor through a place of another form, nor to a limit that is not
    /// a semaphore; an acquisition that found the state names its place.
    #[test]
    fn a_release_at_a_place_is_for_the_key_found_there() {
        use crate::algorithm::Semaphore;
        let hasher = DefaultHashBuilder::default();
        let limit = Limit::Semaphore(Semaphore::new(4).unwrap());
        let mut table = Table::for_limit(&limit);
        let now = Instant::ZERO;
        let number = TenantKey::from_u64(7);
        let number = number.prefix(1).unwrap_or_default();
        let long = [b'x'; 20];
        let keys: [&[u8]; 4] = [b"acme", b"globex", number, &long];
        let held = |t: &Table, key: &[u8]| t.peek(&limit, key_hash(&hasher, key), key, now).remaining;
        for key in keys {
            assert!(table.commit(&limit, &hasher, key_hash(&hasher, key), key, now, 2));
        }
        for key in keys {
            let h = key_hash(&hasher, key);
            let (place, result) = table.acquire_semaphore_at(&limit, h, key, now, 1).expect("found");
            assert!(result.is_ok());
            assert_eq!(Some(place.parts()), table.check(&limit, h, key, now, 1).0.map(Place::parts));
            assert_eq!(held(&table, key), 1);
            for other in keys.into_iter().filter(|&k| k != key) {
                assert!(!table.release_at(&limit, place, other, 1), "{other:?} is not at {key:?}'s place");
            }
            assert!(table.release_at(&limit, place, key, 1));
            assert_eq!(held(&table, key), 2);
            for other in keys.into_iter().filter(|&k| k != key) {
                assert_eq!(held(&table, other), 2, "{other:?} untouched");
            }
        }
        // No place of a key absent from the table, and nothing for another kind of limit.
        assert!(table.acquire_semaphore_at(&limit, key_hash(&hasher, b"initech"), b"initech", now, 1).is_none());
        let gcra = Limit::Gcra(crate::algorithm::Gcra::new(crate::Quota::per_second(crate::nz!(1))));
        let mut rates = Table::for_limit(&gcra);
        assert!(rates.commit(&gcra, &hasher, key_hash(&hasher, b"acme"), b"acme", now, 1));
        let place = rates.check(&gcra, key_hash(&hasher, b"acme"), b"acme", now, 0).0.expect("found");
        assert!(!rates.release_at(&gcra, place, b"acme", 1));
        assert!(rates.acquire_semaphore_at(&gcra, key_hash(&hasher, b"acme"), b"acme", now, 1).is_none());
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
    fn each_form_of_path_goes_to_its_own_table() {
        let number = Typed::number(u64::from_le_bytes(*b"fifteen-"));
        let number = number.as_bytes();
        assert!(matches!(Probe::new(b"fifteen-bytes-x"), Probe::Short(_)));
        assert!(matches!(Probe::new(b"sixteen-bytes-xy"), Probe::Long(_)));
        assert!(matches!(Probe::new(number), Probe::Number(_)));
        assert!(matches!(Probe::new(&number[..9]), Probe::Short(_)));
        assert!(matches!(Probe::new(&[number, b"x"].concat()), Probe::Short(_)));
        let hasher = DefaultHashBuilder::default();
        let mut t: Tables<()> = Tables::new();
        for path in [&b"fifteen-bytes-x"[..], b"sixteen-bytes-xy", number, b"a", b"a\0"] {
            t.insert(&hasher, key_hash(&hasher, path), path, ());
        }
        assert_eq!((t.short.len(), t.numbers.len(), t.long.len()), (3, 1, 1));
        // A short path's length is part of its words: "a" and "a\0" are two entries.
        assert_eq!(t.short.iter().filter(|e| e.0[0] == u64::from(b'a')).count(), 2);
    }
}
