//! Keyed state tables, one per limit and shard, each holding its algorithm's own state
//! type: a GCRA entry is its key and one integer, nothing more.
//!
//! Entries are found by the hash of the key path, computed once per tier by the caller,
//! and compared by the path itself, so a lookup allocates nothing; only an insertion
//! copies the path.

use std::hash::BuildHasher;

use hashbrown::{DefaultHashBuilder, HashTable};

use crate::algorithm::{
    Algorithm, FixedWindowState, GcraState, Refusal, SemaphoreState, SlidingWindowCounterState, SlidingWindowLogState,
    Snapshot, TokenBucketState,
};
use crate::limit::{Limit, LimitState};
use crate::time::Instant;

pub(crate) struct Entry<S> {
    key: Box<str>,
    state: S,
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

#[inline]
fn find<'t, S>(t: &'t HashTable<Entry<S>>, h: u64, key: &str) -> Option<&'t S> {
    t.find(h, |e| &*e.key == key).map(|e| &e.state)
}

#[inline]
fn find_mut<'t, S>(t: &'t mut HashTable<Entry<S>>, h: u64, key: &str) -> Option<&'t mut S> {
    t.find_mut(h, |e| &*e.key == key).map(|e| &mut e.state)
}

fn insert<S>(t: &mut HashTable<Entry<S>>, hasher: &DefaultHashBuilder, h: u64, key: &str, state: S) {
    t.insert_unique(h, Entry { key: key.into(), state }, |e| key_hash(hasher, &e.key));
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
            |a, t| match t.find_bucket_index(h, |e| &*e.key == key) {
                Some(at) => (Some(at), t.get_bucket(at).map_or(Ok(()), |e| a.check(&e.state, now, cost))),
                None => (None, a.check(&a.fresh(), now, cost)),
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
