//! One global limit against governor's direct limiter (group `core`): allow and deny,
//! through `check` and through `acquire`, and the limit shared by threads, at a cost of 1
//! and of 10 a call.

use std::hint::black_box;
use std::sync::Arc;

use governor::{Quota as GovQuota, RateLimiter};
use tower_limits_core::{Clock, LimitPolicy, LimitSet, LimitSetPolicy, Quota, SystemClock, TenantKey, nz};

use crate::table::{Op, Row, pair, thread_counts, throughput_rounds};
use crate::{HUGE, nz_u32, open_governor};

fn open_set() -> LimitSet {
    let open = Quota::per_second(nz!(HUGE as u64)).burst(nz!(1_000_000));
    LimitSet::new(LimitSetPolicy::new().limit(LimitPolicy::gcra("r", open))).expect("policy")
}

/// One limit, allow and deny, on one thread; then on threads (see [`thread_rows`]).
pub(crate) fn rows(rows: &mut Vec<Row>) {
    let clock = SystemClock::new();
    let global = TenantKey::global();

    let open = open_set();
    let gov_open = open_governor();
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
        LimitSet::new(LimitSetPolicy::new().limit(LimitPolicy::gcra("r", Quota::per_hour(nz!(1))))).expect("policy");
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
            LimitSetPolicy::new().limit(LimitPolicy::gcra("r", Quota::per_second(nz!(HUGE as u64))).counting_cost()),
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
