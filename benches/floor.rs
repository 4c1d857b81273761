//! The floor of the `peers` set of three: the same three limits written by hand for that
//! one policy, with nothing a general set needs, to show how close any set that decides
//! under locks ([`SetOfThreeFloor`]), and any set at all ([`SetOfThreeLockFree`]), can come
//! to the target of three governor checks.
//!
//! It keeps what the laws need and drops the rest: one lock per shard, a tenant's GCRA
//! and semaphore in one row found by one probe, the global bucket in one atomic taken
//! by compare-and-swap (a GCRA of the bucket's rate: the same admissions), and a grant
//! that holds its row's place, so that the release takes the lock and no lookup. No
//! policy, no shadow limits, no costs per limit, no settle, no replace, no bound on
//! memory, no counters, keys of at most 15 bytes: a measuring stick, not a limiter.

use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};

use hashbrown::{DefaultHashBuilder, HashTable};

/// A tenant's two states: its GCRA's theoretical arrival time and its permits held.
#[derive(Clone, Copy, Debug)]
struct Row {
    tat: u64,
    held: u64,
}

/// Keeps each lock on its own cache lines.
#[derive(Debug)]
#[repr(align(128))]
struct Padded<T>(T);

/// Rows by the tenant's bytes as two words (at most 15 bytes, the length in the last).
type Rows = HashTable<([u64; 2], Row)>;

/// The `peers` set of three, by hand: per tenant a GCRA of one request a nanosecond with
/// a burst of a million and a semaphore of 64; globally a bucket of a billion tokens a
/// second, a million deep.
///
/// ```
/// use tower_limits_benches::floor::SetOfThreeFloor;
///
/// let set = SetOfThreeFloor::new();
/// let grant = set.acquire(b"acme", 10, 1_000).expect("granted");
/// set.release(grant);
/// assert!(set.acquire(&[b'x'; 16], 10, 1_000).is_none(), "keys of at most 15 bytes");
/// ```
#[derive(Debug)]
pub struct SetOfThreeFloor {
    shards: Box<[Padded<Mutex<Rows>>]>,
    bucket: Padded<AtomicU64>,
    hasher: DefaultHashBuilder,
}

/// Where a grant's row is: its shard and its bucket.
#[derive(Debug)]
#[must_use = "a grant holds a permit until it is released"]
pub struct FloorGrant {
    shard: usize,
    bucket: usize,
}

const SHARDS: usize = 8;
const GCRA_INTERVAL: u64 = 1;
const GCRA_TOLERANCE: u64 = 1_000_000;
const PERMITS: u64 = 64;
const TOKEN_INTERVAL: u64 = 1;
const BUCKET_TOLERANCE: u64 = 1_000_000;

/// The key as two words, built in registers: bytes written into a buffer and read back
/// as words would wait for every byte's store (a stall of a dozen cycles or more).
fn words(key: &[u8]) -> Option<[u64; 2]> {
    if key.len() > 15 {
        return None;
    }
    let word = |bytes: &[u8]| bytes.iter().rev().fold(0u64, |w, &b| w << 8 | u64::from(b));
    let (lo, hi) = key.split_at(key.len().min(8));
    Some([word(lo), word(hi) | (key.len() as u64) << 56])
}

impl Default for SetOfThreeFloor {
    fn default() -> Self {
        Self::new()
    }
}

impl SetOfThreeFloor {
    /// A set with no tenant yet.
    #[must_use]
    pub fn new() -> Self {
        SetOfThreeFloor {
            shards: (0..SHARDS).map(|_| Padded(Mutex::new(HashTable::new()))).collect(),
            bucket: Padded(AtomicU64::new(0)),
            hasher: DefaultHashBuilder::default(),
        }
    }

    /// One request of `cost` tokens for `key` at `now` (nanoseconds): all three limits
    /// or none. `None` when refused (or the key is longer than 15 bytes).
    #[inline(never)]
    pub fn acquire(&self, key: &[u8], cost: u64, now: u64) -> Option<FloorGrant> {
        let words = words(key)?;
        let h = self.hasher.hash_one(key);
        let shard = (h >> 40) as usize % SHARDS;
        let mut rows = self.shards[shard].0.lock().unwrap_or_else(PoisonError::into_inner);
        let bucket = match rows.find_bucket_index(h, |e| e.0 == words) {
            Some(bucket) => bucket,
            None => {
                let hasher = &self.hasher;
                let entry = rows.insert_unique(h, (words, Row { tat: 0, held: 0 }), |e| rehash(hasher, e.0));
                entry.bucket_index()
            }
        };
        let row = rows.get_bucket_mut(bucket)?;
        let tat = row.1.tat.max(now) + GCRA_INTERVAL;
        if tat - now > GCRA_TOLERANCE || row.1.held >= PERMITS {
            return None;
        }
        // The bucket last, by compare-and-swap: nothing to undo when it refuses.
        let mut seen = self.bucket.0.load(Ordering::Relaxed);
        loop {
            let next = seen.max(now) + TOKEN_INTERVAL * cost;
            if next - now > BUCKET_TOLERANCE {
                return None;
            }
            match self.bucket.0.compare_exchange_weak(seen, next, Ordering::AcqRel, Ordering::Relaxed) {
                Ok(_) => break,
                Err(now_seen) => seen = now_seen,
            }
        }
        row.1.tat = tat;
        row.1.held += 1;
        Some(FloorGrant { shard, bucket })
    }

    /// Gives back the permit of `grant`, at the place it kept.
    #[inline(never)]
    pub fn release(&self, grant: FloorGrant) {
        let mut rows = self.shards[grant.shard].0.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(row) = rows.get_bucket_mut(grant.bucket) {
            row.1.held -= 1;
        }
    }
}

/// A tenant's two states in atomics, on a cache line of their own.
#[derive(Debug, Default)]
#[repr(align(64))]
struct AtomicRow {
    tat: AtomicU64,
    held: AtomicU64,
}

/// The same set of three with no lock at all: the floor of any design, locked or not.
///
/// Its tenants are registered when it is made, and their table is never written again,
/// so that finding a tenant's row is a hash and a probe with no synchronization (any map
/// that takes tenants while it is read costs at least that). Each row keeps its GCRA's
/// arrival time and its permits held in atomics, and the global bucket is one atomic:
/// an acquisition takes the permit, then the GCRA, then the bucket, each by one atomic
/// read-modify-write, and gives back what it took when a later one refuses. Four locked
/// instructions a grant and its release (the locked floor takes five), and nothing else a
/// set needs. A hold that is given back can make a concurrent acquisition refuse where a
/// lock would have let it pass: a measuring stick, not a limiter.
///
/// ```
/// use tower_limits_benches::floor::SetOfThreeLockFree;
///
/// let set = SetOfThreeLockFree::new(&[b"acme"]);
/// let grant = set.acquire(b"acme", 10, 1_000).expect("granted");
/// set.release(grant);
/// assert!(set.acquire(b"other", 10, 1_000).is_none(), "tenants are registered ahead");
///
/// // 64 permits a tenant: the 65th waits for a release, and a refusal keeps nothing.
/// let held: Vec<_> = (0..64).map(|_| set.acquire(b"acme", 10, 1_000).expect("granted")).collect();
/// assert!(set.acquire(b"acme", 10, 1_000).is_none());
/// held.into_iter().for_each(|grant| set.release(grant));
/// assert!(set.acquire(b"acme", 10, 1_000).is_some());
/// ```
#[derive(Debug)]
pub struct SetOfThreeLockFree {
    index: HashTable<([u64; 2], usize)>,
    rows: Box<[AtomicRow]>,
    bucket: Padded<AtomicU64>,
    hasher: DefaultHashBuilder,
}

/// A grant of [`SetOfThreeLockFree`]: its tenant's row.
#[derive(Debug)]
#[must_use = "a grant holds a permit until it is released"]
pub struct LockFreeGrant {
    row: usize,
}

impl SetOfThreeLockFree {
    /// A set of the given tenants (keys of at most 15 bytes; longer ones are skipped).
    #[must_use]
    pub fn new(tenants: &[&[u8]]) -> Self {
        let hasher = DefaultHashBuilder::default();
        let mut index = HashTable::new();
        let mut rows = Vec::new();
        for &key in tenants {
            let Some(words) = words(key) else { continue };
            let h = hasher.hash_one(key);
            if index.find(h, |e: &([u64; 2], usize)| e.0 == words).is_none() {
                index.insert_unique(h, (words, rows.len()), |e| rehash(&hasher, e.0));
                rows.push(AtomicRow::default());
            }
        }
        SetOfThreeLockFree { index, rows: rows.into_boxed_slice(), bucket: Padded(AtomicU64::new(0)), hasher }
    }

    /// One request of `cost` tokens for `key` at `now` (nanoseconds): all three limits
    /// or none. `None` when refused, or when `key` was not registered.
    #[inline(never)]
    pub fn acquire(&self, key: &[u8], cost: u64, now: u64) -> Option<LockFreeGrant> {
        let words = words(key)?;
        let h = self.hasher.hash_one(key);
        let &(_, row_at) = self.index.find(h, |e| e.0 == words)?;
        let row = self.rows.get(row_at)?;
        if row.held.fetch_add(1, Ordering::Acquire) >= PERMITS {
            row.held.fetch_sub(1, Ordering::Release);
            return None;
        }
        let mut seen = row.tat.load(Ordering::Relaxed);
        loop {
            let next = seen.max(now) + GCRA_INTERVAL;
            if next - now > GCRA_TOLERANCE {
                row.held.fetch_sub(1, Ordering::Release);
                return None;
            }
            match row.tat.compare_exchange_weak(seen, next, Ordering::AcqRel, Ordering::Relaxed) {
                Ok(_) => break,
                Err(now_seen) => seen = now_seen,
            }
        }
        let mut seen = self.bucket.0.load(Ordering::Relaxed);
        loop {
            let next = seen.max(now) + TOKEN_INTERVAL * cost;
            if next - now > BUCKET_TOLERANCE {
                // Given back: the GCRA's interval and the permit.
                row.tat.fetch_sub(GCRA_INTERVAL, Ordering::Release);
                row.held.fetch_sub(1, Ordering::Release);
                return None;
            }
            match self.bucket.0.compare_exchange_weak(seen, next, Ordering::AcqRel, Ordering::Relaxed) {
                Ok(_) => break,
                Err(now_seen) => seen = now_seen,
            }
        }
        Some(LockFreeGrant { row: row_at })
    }

    /// Gives back the permit of `grant`.
    #[inline(never)]
    pub fn release(&self, grant: LockFreeGrant) {
        if let Some(row) = self.rows.get(grant.row) {
            row.held.fetch_sub(1, Ordering::Release);
        }
    }
}

/// The hash of a key kept as two words, from its bytes (as it was first hashed).
fn rehash(hasher: &DefaultHashBuilder, key: [u64; 2]) -> u64 {
    let mut bytes = [0u8; 16];
    bytes[..8].copy_from_slice(&key[0].to_le_bytes());
    bytes[8..].copy_from_slice(&key[1].to_le_bytes());
    hasher.hash_one(&bytes[..usize::from(bytes[15]).min(15)])
}
