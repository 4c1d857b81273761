//! The set of three limits (a GCRA per tenant, a global token bucket counting cost, a
//! semaphore per tenant) against one governor check, beside the same three limits written
//! by hand (group `core`); and the set on threads over itself on one (group `sets`, also
//! part of `core`).

use std::hint::black_box;
use std::sync::Arc;

use tower_limits_benches::floor::{SetOfThreeFloor, SetOfThreeLockFree};
use tower_limits_core::{Clock, LimitPolicy, LimitSet, LimitSetPolicy, Quota, SystemClock, TenantKey, nz};

use crate::table::{Op, Row, pair, thread_counts, throughput_rounds};
use crate::{HUGE, open_governor};

/// The set of three, never refusing in a benchmark.
fn set_of_three() -> LimitSet {
    let open = Quota::per_second(nz!(HUGE as u64)).burst(nz!(1_000_000));
    LimitSet::new(
        LimitSetPolicy::new()
            .tiers(["tenant"])
            .limit(LimitPolicy::gcra("requests", open).per("tenant"))
            .limit(LimitPolicy::token_bucket("tokens", open).counting_cost())
            .limit(LimitPolicy::semaphore("concurrent", 64).per("tenant")),
    )
    .expect("policy")
}

/// The set of three acquired and released on one thread, then the two floors by hand,
/// each against one governor check.
pub(crate) fn rows(rows: &mut Vec<Row>) {
    let clock = SystemClock::new();
    let gov_open = open_governor();
    let set = set_of_three();
    let key = TenantKey::single("acme").expect("key");
    rows.push(pair(
        "3-limit set acquire + release / one governor check",
        &mut || {
            let permit = set.acquire(&key, 10, clock.now()).expect("granted");
            drop(black_box(permit));
        },
        &mut || {
            black_box(gov_open.check().is_ok());
        },
    ));
    // The same three limits written by hand for this one policy (see `floor.rs`): how
    // close a set that decides under locks can come.
    let floor = SetOfThreeFloor::new();
    rows.push(pair(
        "3-limit set by hand (the floor) / one governor check",
        &mut || {
            let grant = floor.acquire(b"acme", 10, clock.now().as_nanos()).expect("granted");
            floor.release(black_box(grant));
        },
        &mut || {
            black_box(gov_open.check().is_ok());
        },
    ));
    // And with no lock at all (see `floor.rs`): the floor of any design.
    let lock_free = SetOfThreeLockFree::new(&[b"acme"]);
    rows.push(pair(
        "3-limit set by hand, no lock (any design's floor) / one governor check",
        &mut || {
            let grant = lock_free.acquire(b"acme", 10, clock.now().as_nanos()).expect("granted");
            lock_free.release(black_box(grant));
        },
        &mut || {
            black_box(gov_open.check().is_ok());
        },
    ));
}

/// The set of three on threads, each on tenants of its own (16 a thread, in turn): what
/// the threads share is the set's global limit, and the shards their tenants hash to
/// (each thread's 16 fall in most of the 4 a core). Throughput of 2 threads (and of every
/// core, when there are more than two) over one thread's.
pub(crate) fn thread_rows(rows: &mut Vec<Row>) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static TURN: std::cell::Cell<usize> = std::cell::Cell::new(NEXT.fetch_add(16, Ordering::Relaxed));
    }
    let clock = SystemClock::new();
    let set = Arc::new(set_of_three());
    let keys: Arc<[TenantKey]> = (0..4_096).map(TenantKey::from_u64).collect();
    let op: Op = Arc::new(move || {
        let i = TURN.with(|t| {
            let i = t.get();
            // The next of this thread's 16 tenants.
            t.set((i & !15) | ((i + 1) & 15));
            i
        });
        let permit = set.acquire(&keys[i % keys.len()], 10, clock.now()).expect("granted");
        drop(black_box(permit));
    });
    for threads in thread_counts() {
        let mut row = Row::new(format!("3-limit set: {threads} threads / 1 thread ops/s"), "Mop/s");
        throughput_rounds(&mut row, (threads, &op), (1, &op));
        rows.push(row);
    }
}
