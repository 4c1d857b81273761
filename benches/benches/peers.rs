//! One table of ratios against governor, from one run: the figures the issue's targets
//! are stated in.
//!
//! Each row measures our path and its peer's in the same round, one after the other
//! (the order alternating from round to round), repeats the pair `ROUNDS` times and
//! reports the ratio of medians and the min / median / max of the per-round ratios. A
//! ratio below 1.0 means we are faster (or, for throughput rows, see the row's note).
//!
//! Run: `cargo bench -p tower-limits-benches --bench peers` (about two minutes; the Redis
//! rows need a `redis-server` on the `PATH` and are skipped without one).

#![allow(clippy::print_stdout)]

use std::hint::black_box;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::{Duration, Instant as StdInstant};

use axum::body::Body;
use governor::{Quota as GovQuota, RateLimiter};
use http::Request;
use tower::Layer;
use tower_governor::GovernorLayer;
use tower_governor::governor::GovernorConfigBuilder;
use tower_governor::key_extractor::{GlobalKeyExtractor, PeerIpKeyExtractor};
use tower_limits::extract::PeerIp;
use tower_limits::http::HttpAnswer;
use tower_limits::{GcraLayer, Quota, nz};
use tower_limits_benches::floor::{SetOfThreeFloor, SetOfThreeLockFree};
use tower_limits_benches::{bare, drive, from_peer, open_keyed_set};
use tower_limits_core::{Backend, Clock, LimitPolicy, LimitSet, LimitSetPolicy, Rate, SystemClock, TenantKey};
use tower_limits_redis::redis;
use tower_limits_redis::test_support::RedisServer;
use tower_limits_redis::{RedisBackend, RedisConnection};

const HUGE: u32 = 1_000_000_000;
const ROUNDS: usize = 9;
/// Wall time one side of one round aims for.
const SLICE: Duration = Duration::from_millis(40);

fn nz_u32(n: u32) -> NonZeroU32 {
    NonZeroU32::new(n).expect("non-zero")
}

fn open_set() -> LimitSet {
    LimitSet::new(LimitSetPolicy::new().limit(LimitPolicy::gcra("r", Rate::per_second(u64::from(HUGE)), 1_000_000)))
        .expect("policy")
}

/// Nanoseconds per call of `op`, over about `SLICE`.
fn per_call(op: &mut dyn FnMut()) -> f64 {
    // Calibrate the batch once, then time it.
    let mut n = 1_000u64;
    loop {
        let start = StdInstant::now();
        for _ in 0..n {
            op();
        }
        let took = start.elapsed();
        if took >= SLICE / 8 {
            let n = (n as f64 * SLICE.as_secs_f64() / took.as_secs_f64()) as u64;
            let start = StdInstant::now();
            for _ in 0..n {
                op();
            }
            return start.elapsed().as_nanos() as f64 / n as f64;
        }
        n *= 4;
    }
}

/// Total operations per second of `threads` threads running `op` for about `SLICE`.
fn throughput(threads: usize, op: Op) -> f64 {
    let per_thread = {
        // One thread's pace sizes the batch.
        let op = op.clone();
        let ns = per_call(&mut || op());
        (SLICE.as_nanos() as f64 / ns) as u64
    };
    let elapsed = tower_limits_benches::on_threads(threads, per_thread, op);
    (per_thread * threads as u64) as f64 / elapsed.as_secs_f64()
}

/// An operation each thread of [`throughput`] runs.
type Op = Arc<dyn Fn() + Send + Sync>;

/// The thread counts of the threaded rows: 2, and every core's when there are more.
fn thread_counts() -> Vec<usize> {
    let cores = std::thread::available_parallelism().map_or(2, usize::from);
    if cores > 2 { vec![2, cores] } else { vec![2] }
}

/// Fills `row` with [`ROUNDS`] rounds of two throughputs in Mop/s, ours on `ours.0`
/// threads and theirs on `theirs.0`, each side first in every other round.
fn throughput_rounds(row: &mut Row, ours: (usize, &Op), theirs: (usize, &Op)) {
    for round in 0..ROUNDS {
        if round % 2 == 0 {
            row.ours.push(throughput(ours.0, ours.1.clone()) / 1e6);
            row.theirs.push(throughput(theirs.0, theirs.1.clone()) / 1e6);
        } else {
            row.theirs.push(throughput(theirs.0, theirs.1.clone()) / 1e6);
            row.ours.push(throughput(ours.0, ours.1.clone()) / 1e6);
        }
    }
}

struct Row {
    name: String,
    ours: Vec<f64>,
    theirs: Vec<f64>,
    unit: &'static str,
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

impl Row {
    /// A row with no rounds yet.
    fn new(name: impl Into<String>, unit: &'static str) -> Row {
        Row { name: name.into(), ours: Vec::new(), theirs: Vec::new(), unit }
    }

    /// A side's throughput on more threads (`more`, Mop/s) over its own on one, round by
    /// round.
    fn scaling(name: String, more: &[f64], one: &[f64]) -> Row {
        Row { name, ours: more.to_vec(), theirs: one.to_vec(), unit: "Mop/s" }
    }

    fn print(&self) {
        let ratios: Vec<f64> = self.ours.iter().zip(&self.theirs).map(|(o, t)| o / t).collect();
        let mut sorted = ratios.clone();
        sorted.sort_by(f64::total_cmp);
        println!(
            "| {:<44} | {:>12.2} | {:>12.2} | {:>5} | {:>6.2}x | {:.2} / {:.2} / {:.2} |",
            self.name,
            median(&self.ours),
            median(&self.theirs),
            self.unit,
            median(&self.ours) / median(&self.theirs),
            sorted[0],
            median(&ratios),
            sorted[sorted.len() - 1],
        );
    }
}

/// Times `ours` and `theirs` per call, interleaved over the rounds.
fn pair(name: &str, ours: &mut dyn FnMut(), theirs: &mut dyn FnMut()) -> Row {
    let mut row = Row::new(name, "ns");
    for round in 0..ROUNDS {
        if round % 2 == 0 {
            row.ours.push(per_call(ours));
            row.theirs.push(per_call(theirs));
        } else {
            row.theirs.push(per_call(theirs));
            row.ours.push(per_call(ours));
        }
    }
    row
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
    let gov = RateLimiter::keyed(GovQuota::per_second(nz_u32(HUGE)).allow_burst(nz_u32(1_000_000)));
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

fn main() {
    // `cargo bench` passes `--bench`; rows are chosen by group, not by a filter argument:
    // `PEERS_ONLY=redis` (or `core`, `sets`, `tower`, comma-separated) runs those groups alone.
    let only = std::env::var("PEERS_ONLY").unwrap_or_default();
    let wants = |group: &str| only.is_empty() || only.split(',').any(|g| g.trim() == group);
    let mut rows = Vec::new();
    if wants("core") {
        core_rows(&mut rows);
    }
    if wants("core") || wants("keyed") {
        keyed_thread_rows(&mut rows);
    }
    if wants("core") || wants("sets") {
        set_thread_rows(&mut rows);
    }
    if wants("tower") {
        tower_rows(&mut rows);
    }
    if wants("redis") {
        redis_rows(&mut rows);
    }
    println!();
    let cores = std::thread::available_parallelism().map_or(2, usize::from);
    println!(
        "peers: tower-limits against governor, tower_governor, tower::limit; {ROUNDS} interleaved rounds, {cores} cores"
    );
    println!();
    println!(
        "| {:<44} | {:>12} | {:>12} | {:>5} | {:>7} | per-round ratio min / med / max |",
        "path", "ours (med)", "peer (med)", "unit", "ratio"
    );
    println!("|{:-<46}|{:-<14}|{:-<14}|{:-<7}|{:-<9}|{:-<33}|", "", "", "", "", "", "");
    for row in &rows {
        row.print();
    }
    println!();
    println!("ns rows: ratio below 1.0 is faster than the peer. Mop/s rows: above 1.0 is more throughput.");
    println!("tower rows: overhead over the same bare `service_fn` and request, measured in the same round.");
}

/// The in-process rows: one limit (allow, deny, threads), keyed, the set of three.
fn core_rows(rows: &mut Vec<Row>) {
    let clock = SystemClock::new();
    let global = TenantKey::global();

    let open = open_set();
    let gov_open = RateLimiter::direct(GovQuota::per_second(nz_u32(HUGE)).allow_burst(nz_u32(1_000_000)));
    // `check` against `check`: the one-line use, nothing kept. Then `acquire`, whose
    // permit is built and dropped, against the same `check`.
    rows.push(pair(
        "one limit, allow (check / check)",
        &mut || {
            black_box(open.check(&global, 1, clock.now()).is_ok());
        },
        &mut || {
            black_box(gov_open.check().is_ok());
        },
    ));
    rows.push(pair(
        "one limit, allow with a permit (ours acquire / governor check)",
        &mut || {
            black_box(open.acquire(&global, 1, clock.now()).is_ok());
        },
        &mut || {
            black_box(gov_open.check().is_ok());
        },
    ));

    let shut =
        LimitSet::new(LimitSetPolicy::new().limit(LimitPolicy::gcra("r", Rate::per_hour(1), 1))).expect("policy");
    let _first = shut.acquire(&global, 1, clock.now()).expect("first passes");
    let gov_shut = RateLimiter::direct(GovQuota::per_hour(nz_u32(1)));
    let _ = gov_shut.check();
    rows.push(pair(
        "one limit, deny (check / check)",
        &mut || {
            black_box(shut.check(&global, 1, clock.now()).is_err());
        },
        &mut || {
            black_box(gov_shut.check().is_err());
        },
    ));
    rows.push(pair(
        "one limit, deny (ours acquire / governor check)",
        &mut || {
            black_box(shut.acquire(&global, 1, clock.now()).is_err());
        },
        &mut || {
            black_box(gov_shut.check().is_err());
        },
    ));
    rows.push(pair(
        "one limit, our deny / our allow (check)",
        &mut || {
            black_box(shut.check(&global, 1, clock.now()).is_err());
        },
        &mut || {
            black_box(open.check(&global, 1, clock.now()).is_ok());
        },
    ));

    // Threads on one limit: throughput, ours over governor's (above 1.0 is better here);
    // then the same at a cost of 10 a call, as a limit of tokens charges (governor's
    // `check_n`).
    thread_rows(rows, 1);
    thread_rows(rows, 10);

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

    let set = LimitSet::new(
        LimitSetPolicy::new()
            .tiers(["tenant"])
            .limit(LimitPolicy::gcra("requests", Rate::per_second(u64::from(HUGE)), 1_000_000).per("tenant"))
            .limit(LimitPolicy::token_bucket("tokens", Rate::per_second(u64::from(HUGE)), 1_000_000).counting_cost())
            .limit(LimitPolicy::semaphore("concurrent", 64).per("tenant")),
    )
    .expect("policy");
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

/// One limit on 1, 2 (and every core's) threads, each call of `cost`: throughput, ours
/// over governor's, and ours on more threads over ours on one.
fn thread_rows(rows: &mut Vec<Row>, cost: u32) {
    let clock = SystemClock::new();
    let global = TenantKey::global();
    let what = if cost == 1 { String::from("one limit") } else { format!("one limit, cost {cost} a call") };
    let mut ours_one = Vec::new();
    for threads in std::iter::once(1).chain(thread_counts()) {
        let mut row = Row::new(format!("{what}, {threads} threads: ops/s (ours / governor)"), "Mop/s");
        // Charged its cost: a limit counts requests unless told to count costs. A rate of
        // one unit a nanosecond (the finest either side takes) and a burst of a second of
        // it, so that the threads spend the burst, not the rate: at cost 10 two threads
        // ask for more than the rate's hundred million calls a second, and with a burst of
        // a millisecond they were held to the rate (the row read 1.0, measuring the limit).
        // A thread's lease is as large either way (a quarter of the headroom is far more
        // than the largest lease).
        let ours = LimitSet::new(
            LimitSetPolicy::new()
                .limit(LimitPolicy::gcra("r", Rate::per_second(u64::from(HUGE)), u64::from(HUGE)).counting_cost()),
        )
        .expect("policy");
        let theirs = Arc::new(RateLimiter::direct(GovQuota::per_second(nz_u32(HUGE)).allow_burst(nz_u32(HUGE))));
        let ours_op: Op = {
            let (clock, key) = (clock.clone(), global.clone());
            Arc::new(move || {
                black_box(ours.check(&key, u64::from(cost), clock.now()).is_ok());
            })
        };
        let theirs_op: Op = if cost == 1 {
            Arc::new(move || {
                black_box(theirs.check().is_ok());
            })
        } else {
            let n = nz_u32(cost);
            Arc::new(move || {
                black_box(theirs.check_n(n).is_ok_and(|r| r.is_ok()));
            })
        };
        throughput_rounds(&mut row, (threads, &ours_op), (threads, &theirs_op));
        if threads == 1 {
            ours_one = row.ours.clone();
        } else {
            rows.push(Row::scaling(format!("{what}, ours: {threads} threads / 1 thread ops/s"), &row.ours, &ours_one));
        }
        rows.push(row);
    }
}

/// One keyed GCRA on 1, 2 (and every core's) threads over the same 1,000 numeric ids,
/// each thread from its own place in them, 7,919 places on a call: ours over governor's
/// keyed store, and each side on more threads over itself on one. Two threads meet on a
/// key only by chance, but on the table that holds it all the time: what the row
/// measures is the table's contention (a shard lock here, a `DashMap` shard there).
fn keyed_thread_rows(rows: &mut Vec<Row>) {
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
    let gov = Arc::new(RateLimiter::keyed(GovQuota::per_second(nz_u32(HUGE)).allow_burst(nz_u32(1_000_000))));
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

/// The set of three on threads, each on tenants of its own (16 a thread, in turn): what
/// the threads share is the set's global limit, and the shards their tenants hash to
/// (each thread's 16 fall in most of the 4 a core). Throughput of 2 threads (and of every
/// core, when there are more than two) over one thread's.
fn set_thread_rows(rows: &mut Vec<Row>) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static TURN: std::cell::Cell<usize> = std::cell::Cell::new(NEXT.fetch_add(16, Ordering::Relaxed));
    }
    let clock = SystemClock::new();
    let set = Arc::new(
        LimitSet::new(
            LimitSetPolicy::new()
                .tiers(["tenant"])
                .limit(LimitPolicy::gcra("requests", Rate::per_second(u64::from(HUGE)), 1_000_000).per("tenant"))
                .limit(
                    LimitPolicy::token_bucket("tokens", Rate::per_second(u64::from(HUGE)), 1_000_000).counting_cost(),
                )
                .limit(LimitPolicy::semaphore("concurrent", 64).per("tenant")),
        )
        .expect("policy"),
    );
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

/// The overhead of two middlewares over the same bare service and request: each round
/// times the bare service, ours and theirs (in turn), and keeps ours - bare and theirs -
/// bare.
fn overhead(name: &str, bare: &mut dyn FnMut(), ours: &mut dyn FnMut(), theirs: &mut dyn FnMut()) -> Row {
    let mut row = Row::new(name, "ns");
    for round in 0..ROUNDS {
        let (o, t, b) = if round % 2 == 0 {
            let b = per_call(bare);
            (per_call(ours), per_call(theirs), b)
        } else {
            let t = per_call(theirs);
            let o = per_call(ours);
            (o, t, per_call(bare))
        };
        // A floor keeps a ratio meaningful when a middleware costs about nothing.
        row.ours.push((o - b).max(0.5));
        row.theirs.push((t - b).max(0.5));
    }
    row
}

/// Tower stacks over a bare `service_fn`: our GCRA layer against tower_governor's
/// `GovernorLayer` (error mode, success headers, keyed by peer IP) and tower's own
/// `RateLimit`.
fn tower_rows(rows: &mut Vec<Row>) {
    let rt = tokio::runtime::Builder::new_current_thread().enable_time().build().expect("runtime");
    let _enter = rt.enter();
    let open = || Quota::per_second(nz!(1_000_000_000)).burst(nz!(1_000_000));
    let governed = || {
        let mut config = GovernorConfigBuilder::default();
        config.per_nanosecond(1).burst_size(1_000_000);
        config
    };
    let mut plain = bare();

    let mut ours = GcraLayer::new(open()).system_clock().layer(bare());
    let config = governed().key_extractor(GlobalKeyExtractor).finish().expect("config");
    let mut theirs = GovernorLayer::<_, _, Body>::new(config).layer(bare());
    let mut tower_rate = tower::limit::RateLimitLayer::new(1_000_000_000, Duration::from_secs(1)).layer(bare());
    rows.push(overhead(
        "tower, error mode: ours / tower_governor",
        &mut || assert!(drive(&mut plain, Request::new(()))),
        &mut || assert!(drive(&mut ours, Request::new(()))),
        &mut || assert!(drive(&mut theirs, Request::new(()))),
    ));
    rows.push(overhead(
        "tower, error mode: ours / tower::limit::RateLimit",
        &mut || assert!(drive(&mut plain, Request::new(()))),
        &mut || assert!(drive(&mut ours, Request::new(()))),
        &mut || {
            // tower's RateLimit must be polled ready before each call; `drive` does.
            black_box(drive(&mut tower_rate, Request::new(())));
        },
    ));

    let mut ours = GcraLayer::new(open()).system_clock().reject_with(HttpAnswer::new().on_success()).layer(bare());
    let config = governed().key_extractor(GlobalKeyExtractor).use_headers().finish().expect("config");
    let mut theirs = GovernorLayer::<_, _, Body>::new(config).layer(bare());
    rows.push(overhead(
        "tower, success headers: ours / use_headers",
        &mut || assert!(drive(&mut plain, Request::new(()))),
        &mut || assert!(drive(&mut ours, Request::new(()))),
        &mut || assert!(drive(&mut theirs, Request::new(()))),
    ));

    let mut ours = GcraLayer::new(open()).key(PeerIp).system_clock().layer(bare());
    let config = governed().key_extractor(PeerIpKeyExtractor).finish().expect("config");
    let mut theirs = GovernorLayer::<_, _, Body>::new(config).layer(bare());
    let (mut a, mut b, mut c) = (0u32, 0u32, 0u32);
    rows.push(overhead(
        "tower, keyed by peer IP (1,000 peers)",
        &mut || {
            a = (a + 1) % 1_000;
            assert!(drive(&mut plain, from_peer(a)));
        },
        &mut || {
            b = (b + 1) % 1_000;
            assert!(drive(&mut ours, from_peer(b)));
        },
        &mut || {
            c = (c + 1) % 1_000;
            assert!(drive(&mut theirs, from_peer(c)));
        },
    ));
}

/// The Redis backend, against a `redis-server` started for the run (skipped without one):
/// a set of three limits against a single GCRA, 64 acquisitions in flight on one
/// connection (throughput), and the server CPU per call of our three-limit script
/// against a plain hand-written script over the same three keys.
fn redis_rows(rows: &mut Vec<Row>) {
    let server = match RedisServer::start() {
        Ok(server) => server,
        Err(e) => {
            eprintln!("peers: Redis rows skipped (no redis-server: {e})");
            return;
        }
    };
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    let url = server.url();
    let conn = rt.block_on(RedisConnection::connect(&url)).expect("a connection");
    let mut raw = rt
        .block_on(async { redis::Client::open(url.as_str())?.get_multiplexed_async_connection().await })
        .expect("a raw connection");
    let backend = |policy: LimitSetPolicy, name: &str| {
        RedisBackend::builder(policy)
            .namespace(format!("peers-{name}"))
            .timeout(Duration::from_secs(5))
            .max_leases(0)
            // Neither side reports the limits' states (nor does the plain script).
            .peek_cache(0)
            .build(&conn)
            .expect("a backend")
    };
    let single = backend(
        LimitSetPolicy::new()
            .tiers(["org", "user"])
            .limit(LimitPolicy::gcra("requests", Rate::per_second(1_000_000), 1_000_000_000).per("user")),
        "single",
    );
    let three_policy = || {
        LimitSetPolicy::new()
            .tiers(["org", "user"])
            .limit(LimitPolicy::gcra("requests", Rate::per_second(1_000_000), 1_000_000_000).per("user"))
            .limit(
                LimitPolicy::token_bucket("tokens", Rate::per_second(1_000_000), 1_000_000_000)
                    .per("org")
                    .counting_cost(),
            )
            .limit(LimitPolicy::semaphore("concurrent", 1_000_000_000).per("org"))
    };
    let three = backend(three_policy(), "three");
    let keys: Arc<[TenantKey]> =
        (0..1_000).map(|i| TenantKey::new([format!("org-{}", i / 10), format!("user-{i}")]).expect("key")).collect();
    let throughput = |b: &RedisBackend| -> f64 {
        in_flight(&rt, &keys, b, |b, key| async move {
            black_box(b.acquire(&key, 1, tower_limits_core::Instant::ZERO).await.is_ok());
        })
    };
    let mut row = Row::new(format!("Redis, {IN_FLIGHT} in flight: 3 limits / 1 GCRA kop/s"), "kop/s");
    for round in 0..ROUNDS {
        if round % 2 == 0 {
            row.ours.push(throughput(&three));
            row.theirs.push(throughput(&single));
        } else {
            row.theirs.push(throughput(&single));
            row.ours.push(throughput(&three));
        }
    }
    rows.push(row);

    // Server CPU per call: ours (three limits) against a plain script over three keys.
    let sha: String =
        rt.block_on(redis::cmd("SCRIPT").arg("LOAD").arg(PLAIN_THREE_KEYS).query_async(&mut raw)).expect("SCRIPT LOAD");
    // The server's CPU per call over the top-level commands named (none of which the
    // scripts call inside).
    let usec_per_call = |raw: &mut redis::aio::MultiplexedConnection, commands: &[&str]| -> f64 {
        let info: String = rt.block_on(redis::cmd("INFO").arg("commandstats").query_async(raw)).expect("INFO");
        let field = |line: &str, name: &str| -> f64 {
            line.split([':', ',']).find_map(|f| f.strip_prefix(name)).and_then(|v| v.parse().ok()).unwrap_or(0.0)
        };
        let (usec, calls) = info
            .lines()
            .filter(|l| {
                commands.iter().any(|c| l.strip_prefix("cmdstat_").is_some_and(|r| r.starts_with(&format!("{c}:"))))
            })
            .fold((0.0, 0.0), |(u, c), l| (u + field(l, "usec="), c + field(l, "calls=")));
        usec / calls
    };
    let reset = |raw: &mut redis::aio::MultiplexedConnection| {
        let () = rt.block_on(redis::cmd("CONFIG").arg("RESETSTAT").query_async(raw)).expect("RESETSTAT");
    };
    // And our single GCRA's against the same plain script: with the server's CPU the
    // bottleneck (one connection, 64 in flight), this ratio is the most the throughput
    // row above can reach, whatever three limits cost beyond the plain script.
    let mut row = Row::new("Redis CPU per call: 3 limits / plain 3-key script", "us");
    let mut bound = Row::new("Redis CPU per call: 1 GCRA / plain 3-key script (the ceiling)", "us");
    for round in 0..ROUNDS {
        reset(&mut raw);
        throughput(&three);
        let ours = usec_per_call(&mut raw, &["evalsha"]);
        reset(&mut raw);
        throughput(&single);
        let one = usec_per_call(&mut raw, &["evalsha"]);
        reset(&mut raw);
        // The same load as ours: 64 calls in flight on one connection (a server that
        // sleeps between calls pays some 30% more CPU for each).
        in_flight(&rt, &keys, &(raw.clone(), sha.clone()), move |(mut raw, sha), key| async move {
            plain_acquire(&mut raw, &sha, &key, round).await;
        });
        let plain = usec_per_call(&mut raw, &["evalsha"]);
        row.ours.push(ours);
        row.theirs.push(plain);
        bound.ours.push(one);
        bound.theirs.push(plain);
    }
    rows.push(row);
    rows.push(bound);

    // A whole request: the acquisition and, once it is done, the release of its
    // semaphore: ours a `ZREM` of the grant's member (the set's one semaphore counts
    // requests), the plain side's a `DECR`, each a plain command. Two calls a request on
    // each side, so the ratio per call is the ratio per request. A backend of its own: the rows above
    // never release, and their semaphores' sets hold every grant they made for a lease,
    // which makes each write to them dearer than in a service, where a set holds only the
    // requests in flight.
    let three = backend(three_policy(), "three-released");
    let mut row = Row::new("Redis CPU per call, acquire + release: 3 limits / plain", "us");
    for round in 0..ROUNDS {
        reset(&mut raw);
        rt.block_on(async {
            for i in 0..CALLS {
                let key = &keys[(i as usize * 7919) % keys.len()];
                if let Ok(grant) = three.acquire(key, 1, tower_limits_core::Instant::ZERO).await {
                    three.release(key, grant);
                }
            }
            three.flush().await;
        });
        let ours = usec_per_call(&mut raw, &["evalsha", "zrem"]);
        reset(&mut raw);
        rt.block_on(async {
            for i in 0..CALLS {
                let key = &keys[(i as usize * 7919) % keys.len()];
                let held = plain_acquire(&mut raw.clone(), &sha, key, round).await;
                let _: redis::Value = redis::cmd("DECR").arg(&held).query_async(&mut raw.clone()).await.expect("DECR");
            }
        });
        row.ours.push(ours);
        row.theirs.push(usec_per_call(&mut raw, &["evalsha", "decr"]));
    }
    rows.push(row);
    drop(server);
}

/// Calls in flight at once on one connection in the Redis rows.
const IN_FLIGHT: usize = 64;
/// Calls per measurement in the Redis rows.
const CALLS: u64 = 6_400;

/// `CALLS` calls of `call`, `IN_FLIGHT` at once (each task stepping through `keys` 7,919
/// places at a time, from its own start), each given its own clone of `state`; returns
/// thousands of calls per second.
fn in_flight<S, F, Fut>(rt: &tokio::runtime::Runtime, keys: &Arc<[TenantKey]>, state: &S, call: F) -> f64
where
    S: Clone + Send + 'static,
    F: Fn(S, TenantKey) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    rt.block_on(async {
        let start = StdInstant::now();
        let tasks: Vec<_> = (0..IN_FLIGHT)
            .map(|t| {
                let (state, keys, call) = (state.clone(), keys.clone(), call.clone());
                tokio::spawn(async move {
                    for i in 0..CALLS / IN_FLIGHT as u64 {
                        call(state.clone(), keys[(t * 7919 + i as usize) % keys.len()].clone()).await;
                    }
                })
            })
            .collect();
        for t in tasks {
            t.await.expect("a task");
        }
        CALLS as f64 / start.elapsed().as_secs_f64() / 1e3
    })
}

/// One acquisition through the plain script for `key`; returns the key of its counter.
async fn plain_acquire(
    raw: &mut redis::aio::MultiplexedConnection,
    sha: &str,
    key: &TenantKey,
    round: usize,
) -> String {
    let text = |i| key.part(i).map(|p| p.to_string()).unwrap_or_default();
    let (org, user) = (text(0), text(1));
    let held = format!("plain:{{{org}}}:s");
    let _: redis::Value = redis::cmd("EVALSHA")
        .arg(sha)
        .arg(3)
        .arg(format!("plain:{{{org}}}:{user}:g"))
        .arg(format!("plain:{{{org}}}:t"))
        .arg(&held)
        .arg(round)
        .query_async(raw)
        .await
        .expect("EVALSHA");
    held
}

/// A plain hand-written script over three keys: a GCRA, a token bucket and a semaphore
/// count, each read, decided and written with an expiry; the floor any 3-limit script
/// pays for its keys.
const PLAIN_THREE_KEYS: &str = r#"local t = redis.call('TIME')
local now = t[1] * 1000000 + t[2]
local tat = tonumber(redis.call('GET', KEYS[1]) or now)
if tat < now then tat = now end
local new_tat = tat + 1
if new_tat - now > 1000000000 then return {0, 1} end
redis.call('SET', KEYS[1], new_tat, 'PX', 60000)
local b = redis.call('HMGET', KEYS[2], 'tokens', 'at')
local tokens = tonumber(b[1] or 1000000000)
local at = tonumber(b[2] or now)
tokens = math.min(1000000000, tokens + (now - at))
if tokens < 1 then return {0, 2} end
redis.call('HSET', KEYS[2], 'tokens', tokens - 1, 'at', now)
redis.call('PEXPIRE', KEYS[2], 60000)
local held = redis.call('INCR', KEYS[3])
redis.call('PEXPIRE', KEYS[3], 60000)
if held > 1000000000 then redis.call('DECR', KEYS[3]) return {0, 3} end
return {1, 0}"#;
