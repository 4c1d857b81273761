//! One table of ratios against governor, from one run: the figures the issue's targets
//! are stated in.
//!
//! Each row measures our path and its peer's in the same round, one after the other
//! (the order alternating from round to round), repeats the pair `ROUNDS` times and
//! reports the ratio of medians and the min / median / max of the per-round ratios. A
//! ratio below 1.0 means we are faster (or, for throughput rows, see the row's note).
//!
//! Run: `cargo bench -p tower-limits-benches --bench peers` (about a minute).

#![allow(clippy::print_stdout)]

use std::hint::black_box;
use std::num::NonZeroU32;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant as StdInstant};

use governor::{Quota, RateLimiter};
use tower_limits_core::{Clock, LimitPolicy, LimitSet, LimitSetPolicy, Rate, SystemClock, TenantKey};

const HUGE: u32 = 1_000_000_000;
const ROUNDS: usize = 9;
/// Wall time one side of one round aims for.
const SLICE: Duration = Duration::from_millis(40);

fn nz(n: u32) -> NonZeroU32 {
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
fn throughput(threads: usize, op: Arc<dyn Fn() + Send + Sync>) -> f64 {
    let per_thread = {
        // One thread's pace sizes the batch.
        let op = op.clone();
        let ns = per_call(&mut || op());
        (SLICE.as_nanos() as f64 / ns) as u64
    };
    let barrier = Arc::new(Barrier::new(threads + 1));
    let handles: Vec<_> = (0..threads)
        .map(|_| {
            let (op, barrier) = (op.clone(), barrier.clone());
            std::thread::spawn(move || {
                barrier.wait();
                for _ in 0..per_thread {
                    op();
                }
            })
        })
        .collect();
    barrier.wait();
    let start = StdInstant::now();
    for h in handles {
        h.join().expect("bench thread");
    }
    (per_thread * threads as u64) as f64 / start.elapsed().as_secs_f64()
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
    let mut row = Row { name: name.to_string(), ours: Vec::new(), theirs: Vec::new(), unit: "ns" };
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

fn main() {
    // `cargo bench` passes `--bench`; a filter is not supported: the table is one piece.
    let clock = SystemClock::new();
    let global = TenantKey::global();
    let mut rows = Vec::new();

    let open = open_set();
    let gov_open = RateLimiter::direct(Quota::per_second(nz(HUGE)).allow_burst(nz(1_000_000)));
    rows.push(pair(
        "one limit, allow (ours acquire / governor check)",
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
    let gov_shut = RateLimiter::direct(Quota::per_hour(nz(1)));
    let _ = gov_shut.check();
    rows.push(pair(
        "one limit, deny",
        &mut || {
            black_box(shut.acquire(&global, 1, clock.now()).is_err());
        },
        &mut || {
            black_box(gov_shut.check().is_err());
        },
    ));
    let mut deny_vs_allow = pair(
        "one limit, our deny / our allow",
        &mut || {
            black_box(shut.acquire(&global, 1, clock.now()).is_err());
        },
        &mut || {
            black_box(open.acquire(&global, 1, clock.now()).is_ok());
        },
    );
    deny_vs_allow.name = "one limit, our deny / our allow".into();
    rows.push(deny_vs_allow);

    // Threads on one limit: throughput, ours over governor's (above 1.0 is better here).
    let cores = std::thread::available_parallelism().map_or(2, usize::from);
    let mut thread_counts = vec![1, 2];
    if cores > 2 {
        thread_counts.push(cores);
    }
    let mut ours_one = Vec::new();
    for &threads in &thread_counts {
        let mut row = Row {
            name: format!("one limit, {threads} threads: ops/s (ours / governor)"),
            ours: Vec::new(),
            theirs: Vec::new(),
            unit: "Mop/s",
        };
        let ours = open_set();
        let theirs = Arc::new(RateLimiter::direct(Quota::per_second(nz(HUGE)).allow_burst(nz(1_000_000))));
        let ours_op: Arc<dyn Fn() + Send + Sync> = {
            let (clock, key) = (clock.clone(), global.clone());
            Arc::new(move || {
                black_box(ours.acquire(&key, 1, clock.now()).is_ok());
            })
        };
        let theirs_op: Arc<dyn Fn() + Send + Sync> = Arc::new(move || {
            black_box(theirs.check().is_ok());
        });
        for round in 0..ROUNDS {
            if round % 2 == 0 {
                row.ours.push(throughput(threads, ours_op.clone()) / 1e6);
                row.theirs.push(throughput(threads, theirs_op.clone()) / 1e6);
            } else {
                row.theirs.push(throughput(threads, theirs_op.clone()) / 1e6);
                row.ours.push(throughput(threads, ours_op.clone()) / 1e6);
            }
        }
        if threads == 1 {
            ours_one = row.ours.clone();
        } else {
            rows.push(Row {
                name: format!("one limit, ours: {threads} threads / 1 thread ops/s"),
                ours: row.ours.clone(),
                theirs: ours_one.clone(),
                unit: "Mop/s",
            });
        }
        rows.push(row);
    }

    for n in [1usize, 1_000, 100_000] {
        let names: Vec<String> = (0..n).map(|i| format!("tenant-{i:06}")).collect();
        let keys: Vec<TenantKey> = names.iter().map(|s| TenantKey::single(s).expect("key")).collect();
        let ours = LimitSet::new(
            LimitSetPolicy::new()
                .tiers(["tenant"])
                .max_keys(200_000)
                .limit(LimitPolicy::gcra("r", Rate::per_second(u64::from(HUGE)), 1_000_000).per("tenant")),
        )
        .expect("policy");
        let theirs = RateLimiter::keyed(Quota::per_second(nz(HUGE)).allow_burst(nz(1_000_000)));
        for (k, s) in keys.iter().zip(&names) {
            let _ = ours.acquire(k, 1, clock.now());
            let _ = theirs.check_key(s);
        }
        let (mut i, mut j) = (0usize, 0usize);
        rows.push(pair(
            &format!("keyed, {n} keys"),
            &mut || {
                i = (i + 7919) % n;
                black_box(ours.acquire(&keys[i], 1, clock.now()).is_ok());
            },
            &mut || {
                j = (j + 7919) % n;
                black_box(theirs.check_key(&names[j]).is_ok());
            },
        ));
    }

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

    println!();
    println!("peers: tower-limits against governor, {ROUNDS} interleaved rounds, {cores} cores");
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
    println!("TODO (the lead's, tower layers): tower_governor and tower::limit rows, tower modes, Redis.");
}
