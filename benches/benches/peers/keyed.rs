//! A keyed GCRA against governor's keyed store: over 1, 1,000 and 100,000 text keys, made
//! ahead or made on every call, and over 100,000 numeric ids (group `core`); and on
//! threads over the same 1,000 numeric ids (group `keyed`, also part of `core`).

use std::hint::black_box;
use std::sync::Arc;

use governor::{Quota as GovQuota, RateLimiter};
use tower_limits_benches::open_keyed_set;
use tower_limits_core::{Clock, LimitSet, SystemClock, TenantKey};

use crate::table::{Op, Row, pair, thread_counts, throughput_rounds};
use crate::{HUGE, nz_u32};

/// Governor's keyed store with the quota of [`open_keyed_set`].
fn open_keyed_governor<K: std::hash::Hash + Eq + Clone>() -> governor::DefaultKeyedRateLimiter<K> {
    RateLimiter::keyed(GovQuota::per_second(nz_u32(HUGE)).allow_burst(nz_u32(1_000_000)))
}

/// One keyed GCRA per key on each side, every one of the `n` keys seen once before the
/// measurement; each call takes the key 7,919 places on. `ours` and `theirs` acquire the
/// `i`-th key on each side, from keys made ahead or from the id, as the row says.
fn keyed_row<K: std::hash::Hash + Eq + Clone>(
    name: &str,
    n: usize,
    ours: impl Fn(&LimitSet, usize) -> bool,
    theirs: impl Fn(&governor::DefaultKeyedRateLimiter<K>, usize) -> bool,
) -> Row {
    let set = open_keyed_set();
    let gov = open_keyed_governor();
    for i in 0..n {
        ours(&set, i);
        theirs(&gov, i);
    }
    let (mut i, mut j) = (0usize, 0usize);
    pair(
        name,
        &mut || {
            i = (i + 7919) % n;
            black_box(ours(&set, i));
        },
        &mut || {
            j = (j + 7919) % n;
            black_box(theirs(&gov, j));
        },
    )
}

/// The keyed rows on one thread: text keys made ahead, text keys made per call, numeric
/// ids made per call.
pub(crate) fn rows(rows: &mut Vec<Row>) {
    let clock = SystemClock::new();
    // Keyed by text ids, two ways. Keys made ahead: each side's key is ready in a slice
    // (ours a `TenantKey`, governor's a `String`). Keys made per call: both sides start
    // from the id as a service reads it from a request, a `&str`, and make their key on
    // every call: ours with `TenantKey::single`, governor's an owned `String`, which its
    // keyed store needs to look a key up.
    for n in [1usize, 1_000, 100_000] {
        let names: Vec<String> = (0..n).map(|i| format!("tenant-{i:06}")).collect();
        let keys: Vec<TenantKey> = names.iter().map(|s| TenantKey::single(s).expect("a valid key")).collect();
        rows.push(keyed_row(
            &format!("keyed, {n} keys made ahead"),
            n,
            |set, i| set.acquire(&keys[i], 1, clock.now()).is_ok(),
            |gov, i| gov.check_key(&names[i]).is_ok(),
        ));
    }
    for n in [1usize, 1_000, 100_000] {
        let names: Vec<String> = (0..n).map(|i| format!("tenant-{i:06}")).collect();
        let ids: Vec<&str> = names.iter().map(String::as_str).collect();
        rows.push(keyed_row(
            &format!("keyed, {n} keys made per call"),
            n,
            |set, i| TenantKey::single(ids[i]).is_ok_and(|key| set.acquire(&key, 1, clock.now()).is_ok()),
            |gov, i| gov.check_key(&ids[i].to_owned()).is_ok(),
        ));
    }
    // Numeric ids, made into keys per call: governor's key is the number itself, ours
    // `TenantKey::from_u64` of it. (Made ahead, ours would be a 7 MB slice of 72-byte keys
    // against governor's 0.8 MB of numbers: the slice's cache misses, not the limiter.)
    let ids: Vec<u64> = (0..100_000u64).map(|i| 1_000_000_007 * i).collect();
    rows.push(keyed_row(
        "keyed by u64 id, 100000 keys",
        ids.len(),
        |set, i| set.acquire(&TenantKey::from_u64(ids[i]), 1, clock.now()).is_ok(),
        |gov, i| gov.check_key(&ids[i]).is_ok(),
    ));
}

/// One keyed GCRA on 1, 2 (and every core's) threads over the same 1,000 numeric ids,
/// each thread from its own place in them, 7,919 places on a call: ours over governor's
/// keyed store, and each side on more threads over itself on one. Two threads meet on a
/// key only by chance, but on the table that holds it all the time: what the row
/// measures is the table's contention (a shard lock here, a `DashMap` shard there).
pub(crate) fn thread_rows(rows: &mut Vec<Row>) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    // Each new thread starts 389 ids on from the last one's start (389 is prime to 1,000,
    // so the starts of up to 1,000 threads are all different).
    thread_local! {
        static AT: std::cell::Cell<usize> = std::cell::Cell::new(NEXT.fetch_add(389, Ordering::Relaxed));
    }
    const IDS: usize = 1_000;
    let next = || {
        AT.with(|at| {
            let i = (at.get() + 7919) % IDS;
            at.set(i);
            1_000_000_007 * i as u64
        })
    };
    let clock = SystemClock::new();
    let set = Arc::new(open_keyed_set());
    let gov = Arc::new(open_keyed_governor());
    for i in 0..IDS as u64 {
        let _ = set.acquire(&TenantKey::from_u64(1_000_000_007 * i), 1, clock.now());
        let _ = gov.check_key(&(1_000_000_007 * i));
    }
    let ours: Op = Arc::new(move || {
        black_box(set.acquire(&TenantKey::from_u64(next()), 1, clock.now()).is_ok());
    });
    let theirs: Op = Arc::new(move || {
        black_box(gov.check_key(&next()).is_ok());
    });
    let (mut ours_one, mut theirs_one) = (Vec::new(), Vec::new());
    for threads in std::iter::once(1).chain(thread_counts()) {
        let mut row = Row::new(format!("keyed, {IDS} ids, {threads} threads: ops/s (ours / governor)"), "Mop/s");
        throughput_rounds(&mut row, (threads, &ours), (threads, &theirs));
        if threads == 1 {
            ours_one = row.ours.clone();
            theirs_one = row.theirs.clone();
        } else {
            rows.push(Row::scaling(format!("keyed, ours: {threads} threads / 1 thread ops/s"), &row.ours, &ours_one));
            rows.push(Row::scaling(
                format!("keyed, governor: {threads} threads / 1 thread ops/s"),
                &row.theirs,
                &theirs_one,
            ));
        }
        rows.push(row);
    }
}
