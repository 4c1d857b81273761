//! The laws of the algorithms, as property tests on a manual clock. Law numbers are those
//! of `crates/tower-limits/docs/laws.md`.
//!
//! - Law 1, the rate cap: GCRA and the token bucket admit at most `rate * T + burst` in
//!   every window of the admitted trace, the sliding-window log at most `limit` in every
//!   window of length `window`, the sliding-window counter at most `limit` per aligned
//!   window (and `limit * (floor(T/W) + 2)` over any span), the fixed window at most
//!   `limit` per aligned window.
//! - Law 2: GCRA and the token bucket with the same parameters make the same decisions,
//!   including refunds and charges.
//! - Law 3: a `retry_after` is exact: the same request passes after it, and not one
//!   nanosecond earlier; `peek` agrees with `check`, and its `reset` is exact.
//! - Law 7, what makes eviction safe: an idle state decides like a fresh one.
//! - Law 6: a semaphore never holds more than its capacity.
//!
//! Everything is driven through `tower_limits_core::algorithm` and the [`Algorithm`]
//! trait, with instants built by `Instant::from_nanos`.

use std::time::Duration;

use proptest::prelude::*;
use proptest::sample::Index;
use tower_limits_core::algorithm::{
    Algorithm, FixedWindow, Gcra, Refusal, Semaphore, SlidingWindowCounter, SlidingWindowLog, TokenBucket,
};
use tower_limits_core::{Instant, Quota, Rate, nz};
use tower_limits_tests::params::{RateParams, WindowParams, rate_params, window_params};
use tower_limits_tests::proptest_config;

const CASES: u32 = 192;

fn at(nanos: u64) -> Instant {
    Instant::from_nanos(nanos)
}

/// The grant a refund or charge is about: one of the earlier grants, or `now` if none.
fn pick(grant: Index, grants: &[u64], now: u64) -> u64 {
    if grants.is_empty() { now } else { grants[grant.index(grants.len())] }
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).expect("waits in these tests fit in u64")
}

// ---------------------------------------------------------------------------------------
// Generators
// ---------------------------------------------------------------------------------------

/// How far the clock moves before a step, in units of `unit` (an emission interval or a
/// fraction of a window): often not at all, sometimes far.
fn advance(unit: u64) -> impl Strategy<Value = u64> {
    prop_oneof![
        3 => Just(0u64),
        4 => 0..=unit,
        2 => 0..=4 * unit,
        1 => 0..=40 * unit,
    ]
}

/// A cost: mostly one, often anything up to the capacity, sometimes zero or one above.
fn cost(capacity: u64) -> impl Strategy<Value = u64> {
    prop_oneof![
        4 => Just(1u64),
        4 => 0..=capacity,
        1 => Just(capacity + 1),
    ]
}

/// One request: advance the clock, then ask for `cost`.
#[derive(Debug, Clone, Copy)]
struct Req {
    advance: u64,
    cost: u64,
}

fn requests(unit: u64, capacity: u64) -> impl Strategy<Value = Vec<Req>> {
    prop::collection::vec((advance(unit), cost(capacity)).prop_map(|(advance, cost)| Req { advance, cost }), 1..150)
}

/// What a step does after the clock moved.
#[derive(Debug, Clone, Copy)]
enum Op {
    /// Acquire this cost.
    Acquire(u64),
    /// Refund this amount of an earlier grant (picked by the step's index).
    Refund(u64),
    /// Charge this amount more to an earlier grant.
    Charge(u64),
}

#[derive(Debug, Clone, Copy)]
struct Step {
    advance: u64,
    op: Op,
    /// Which earlier grant a refund or charge is about.
    grant: Index,
}

fn steps(unit: u64, capacity: u64, len: std::ops::Range<usize>) -> impl Strategy<Value = Vec<Step>> {
    let op = prop_oneof![
        6 => cost(capacity).prop_map(Op::Acquire),
        1 => (0..=2 * capacity).prop_map(Op::Refund),
        1 => (0..=2 * capacity).prop_map(Op::Charge),
    ];
    prop::collection::vec(
        (advance(unit), op, any::<Index>()).prop_map(|(advance, op, grant)| Step { advance, op, grant }),
        len,
    )
}

fn rate_requests() -> impl Strategy<Value = (RateParams, Vec<Req>)> {
    rate_params().prop_flat_map(|p| (Just(p), requests(p.interval(), p.burst)))
}

fn window_requests() -> impl Strategy<Value = (WindowParams, Vec<Req>)> {
    window_params().prop_flat_map(|p| (Just(p), requests(p.unit(), p.limit)))
}

fn rate_steps(len: std::ops::Range<usize>) -> impl Strategy<Value = (RateParams, Vec<Step>)> {
    rate_params().prop_flat_map(move |p| (Just(p), steps(p.interval(), p.burst, len.clone())))
}

fn window_steps(len: std::ops::Range<usize>) -> impl Strategy<Value = (WindowParams, Vec<Step>)> {
    window_params().prop_flat_map(move |p| (Just(p), steps(p.unit(), p.limit, len.clone())))
}

// ---------------------------------------------------------------------------------------
// Running a trace
// ---------------------------------------------------------------------------------------

/// The outcome of one request of a trace.
#[derive(Debug, Clone, Copy)]
struct Outcome {
    now: u64,
    cost: u64,
    granted: bool,
}

/// Runs `reqs` from a fresh state, checking the shape of every refusal on the way.
fn run<A: Algorithm>(alg: &A, reqs: &[Req]) -> Vec<Outcome> {
    let mut state = alg.fresh();
    let mut now = 0u64;
    let mut out = Vec::with_capacity(reqs.len());
    for r in reqs {
        now += r.advance;
        let result = alg.acquire(&mut state, at(now), r.cost);
        match result {
            Ok(()) => assert!(r.cost <= alg.capacity(), "granted {} above the capacity {}", r.cost, alg.capacity()),
            Err(Refusal::Never { capacity }) => {
                assert_eq!(capacity, alg.capacity());
                assert!(r.cost > capacity, "Never for cost {} within capacity {capacity}", r.cost);
            }
            Err(Refusal::NotYet { retry_after }) => {
                assert!(r.cost <= alg.capacity(), "cost {} above capacity refused as NotYet", r.cost);
                let wait = retry_after.expect("a rate limit always knows when to retry");
                assert!(wait > Duration::ZERO, "a refusal with a zero wait at {now}");
            }
        }
        out.push(Outcome { now, cost: r.cost, granted: result.is_ok() });
    }
    out
}

/// The admitted (time, cost) pairs of a trace.
fn admitted(trace: &[Outcome]) -> Vec<(u64, u64)> {
    trace.iter().filter(|o| o.granted).map(|o| (o.now, o.cost)).collect()
}

/// `prefix[i]` is the admitted cost of the first `i` grants.
fn prefix_sums(admitted: &[(u64, u64)]) -> Vec<u128> {
    let mut prefix = vec![0u128];
    for &(_, c) in admitted {
        prefix.push(prefix.last().unwrap() + u128::from(c));
    }
    prefix
}

/// The largest admitted cost in a half-open window `[t, t + len)`: the worst window
/// starts at an admission, so only those starts are tried.
fn max_in_window(admitted: &[(u64, u64)], len: u64) -> u128 {
    let prefix = prefix_sums(admitted);
    let mut best = 0;
    let mut end = 0;
    for (i, &(t, _)) in admitted.iter().enumerate() {
        end = end.max(i);
        while end < admitted.len() && admitted[end].0 - t < len {
            end += 1;
        }
        best = best.max(prefix[end] - prefix[i]);
    }
    best
}

/// Admitted cost per aligned window of length `len`.
fn per_aligned_window(admitted: &[(u64, u64)], len: u64) -> Vec<(u64, u128)> {
    let mut out: Vec<(u64, u128)> = Vec::new();
    for &(t, c) in admitted {
        let start = t - t % len;
        match out.last_mut() {
            Some((s, sum)) if *s == start => *sum += u128::from(c),
            _ => out.push((start, u128::from(c))),
        }
    }
    out
}

// ---------------------------------------------------------------------------------------
// Law 1: the rate cap
// ---------------------------------------------------------------------------------------

/// Every window `[t1, t2]` of the admitted trace holds at most `rate * T + burst`, in
/// exact integers: `cost * period <= amount * T + burst * period`; and the tighter bound
/// of the rounded interval, `cost * interval <= T + burst * interval`.
fn assert_rate_cap(p: RateParams, admitted: &[(u64, u64)]) {
    let prefix = prefix_sums(admitted);
    let (amount, period, burst, interval) =
        (u128::from(p.amount), u128::from(p.period), u128::from(p.burst), u128::from(p.interval()));
    for i in 0..admitted.len() {
        for j in i..admitted.len() {
            let span = u128::from(admitted[j].0 - admitted[i].0);
            let cost = prefix[j + 1] - prefix[i];
            assert!(
                cost * period <= amount * span + burst * period,
                "{cost} admitted in [{}, {}]: above {p:?}",
                admitted[i].0,
                admitted[j].0
            );
            assert!(
                cost * interval <= span + burst * interval,
                "{cost} admitted in [{}, {}]: above the rounded interval {interval}ns",
                admitted[i].0,
                admitted[j].0
            );
        }
    }
}

proptest! {
    #![proptest_config(proptest_config(CASES))]

    #[test]
    fn gcra_caps_the_rate((p, reqs) in rate_requests()) {
        let trace = run(&p.gcra(), &reqs);
        assert_rate_cap(p, &admitted(&trace));
        // Not vacuous: a fresh state grants any first cost within the burst.
        prop_assert_eq!(trace[0].granted, reqs[0].cost <= p.burst);
    }

    #[test]
    fn token_bucket_caps_the_rate((p, reqs) in rate_requests()) {
        let trace = run(&p.bucket(), &reqs);
        assert_rate_cap(p, &admitted(&trace));
        prop_assert_eq!(trace[0].granted, reqs[0].cost <= p.burst);
    }

    /// At most `limit` in every half-open window `[t, t + window)`, and exact: a refusal
    /// happens only when the request would really go over.
    #[test]
    fn sliding_log_caps_every_window((p, reqs) in window_requests()) {
        let trace = run(&p.log(), &reqs);
        let admitted = admitted(&trace);
        let worst = max_in_window(&admitted, p.window);
        prop_assert!(worst <= u128::from(p.limit), "{} in one window of {:?}", worst, p);
        for o in trace.iter().filter(|o| !o.granted && o.cost <= p.limit) {
            let live: u64 = admitted.iter().filter(|&&(t, _)| t <= o.now && o.now - t < p.window).map(|&(_, c)| c).sum();
            prop_assert!(live + o.cost > p.limit, "refused {} at {} with only {} in the window", o.cost, o.now, live);
        }
    }

    /// At most `limit` per aligned window, at most `limit * (floor(T/W) + 2)` over any
    /// span `T`, and (the documented worst case) under `2 * limit` in any window of
    /// length `W`.
    #[test]
    fn sliding_counter_caps_the_rate((p, reqs) in window_requests()) {
        let admitted = admitted(&run(&p.counter(), &reqs));
        for (start, sum) in per_aligned_window(&admitted, p.window) {
            prop_assert!(sum <= u128::from(p.limit), "{} in the window at {}", sum, start);
        }
        let prefix = prefix_sums(&admitted);
        for i in 0..admitted.len() {
            for j in i..admitted.len() {
                let span = admitted[j].0 - admitted[i].0;
                let bound = u128::from(p.limit) * u128::from(span / p.window + 2);
                prop_assert!(prefix[j + 1] - prefix[i] <= bound);
            }
        }
        let worst = max_in_window(&admitted, p.window);
        prop_assert!(worst < 2 * u128::from(p.limit), "{} in one window of {:?}", worst, p);
    }

    /// At most `limit` per aligned window (so at most twice that across a boundary), and
    /// a refusal happens only when the window is really full.
    #[test]
    fn fixed_window_caps_each_window((p, reqs) in window_requests()) {
        let trace = run(&p.fixed(), &reqs);
        let admitted = admitted(&trace);
        let windows = per_aligned_window(&admitted, p.window);
        for &(start, sum) in &windows {
            prop_assert!(sum <= u128::from(p.limit), "{} in the window at {}", sum, start);
        }
        prop_assert!(max_in_window(&admitted, p.window) <= 2 * u128::from(p.limit));
        for o in trace.iter().filter(|o| !o.granted && o.cost <= p.limit) {
            let start = o.now - o.now % p.window;
            let used = windows.iter().find(|w| w.0 == start).map_or(0, |w| w.1);
            prop_assert!(used + u128::from(o.cost) > u128::from(p.limit));
        }
    }
}

// ---------------------------------------------------------------------------------------
// Law 2: GCRA and the token bucket are the same algorithm
// ---------------------------------------------------------------------------------------

proptest! {
    #![proptest_config(proptest_config(CASES))]

    /// Same decisions, same waits, same snapshots, same idleness, for any mix of
    /// acquisitions, refunds and charges; and GCRA's fused `acquire` is `check` then
    /// `commit`.
    #[test]
    fn gcra_and_token_bucket_decide_alike((p, steps) in rate_steps(1..200)) {
        let (gcra, bucket) = (p.gcra(), p.bucket());
        let (mut g, mut b, mut split) = (gcra.fresh(), bucket.fresh(), gcra.fresh());
        let mut now = 0u64;
        let mut grants: Vec<u64> = Vec::new();
        for (i, s) in steps.iter().enumerate() {
            now += s.advance;
            let t = at(now);
            match s.op {
                Op::Acquire(cost) => {
                    let checked = gcra.check(&g, t, cost);
                    prop_assert_eq!(checked, bucket.check(&b, t, cost), "check, step {}", i);
                    let rg = gcra.acquire(&mut g, t, cost);
                    prop_assert_eq!(rg, bucket.acquire(&mut b, t, cost), "acquire, step {}", i);
                    prop_assert_eq!(rg, checked);
                    if gcra.check(&split, t, cost).is_ok() {
                        gcra.commit(&mut split, t, cost);
                    }
                    if rg.is_ok() {
                        grants.push(now);
                    }
                }
                Op::Refund(amount) => {
                    let granted = pick(s.grant, &grants, now);
                    gcra.refund(&mut g, t, at(granted), amount);
                    gcra.refund(&mut split, t, at(granted), amount);
                    bucket.refund(&mut b, t, at(granted), amount);
                }
                Op::Charge(amount) => {
                    let granted = pick(s.grant, &grants, now);
                    gcra.charge(&mut g, t, at(granted), amount);
                    gcra.charge(&mut split, t, at(granted), amount);
                    bucket.charge(&mut b, t, at(granted), amount);
                }
            }
            prop_assert_eq!(g, split, "acquire differs from check + commit, step {}", i);
            prop_assert_eq!(gcra.peek(&g, t), bucket.peek(&b, t), "peek, step {}", i);
            prop_assert_eq!(gcra.is_idle(&g, t), bucket.is_idle(&b, t), "is_idle, step {}", i);
        }
    }
}

// ---------------------------------------------------------------------------------------
// Law 3: exact retry_after, and peek agreeing with check
// ---------------------------------------------------------------------------------------

/// Runs `steps`; at every refusal, checks on a copy of the state that the same request
/// passes at `now + retry_after`, is refused at `now + retry_after - 1ns` with a wait of
/// exactly 1ns, and that from any instant in between the wait points at the same
/// instant. After every step, checks that `peek` agrees with `check` and that its
/// `reset` is exact.
fn assert_retry_exact<A: Algorithm>(alg: &A, steps: &[Step]) {
    let mut state = alg.fresh();
    let mut now = 0u64;
    let mut grants: Vec<u64> = Vec::new();
    for (i, s) in steps.iter().enumerate() {
        now += s.advance;
        let t = at(now);
        match s.op {
            Op::Acquire(cost) => match alg.acquire(&mut state, t, cost) {
                Ok(()) => grants.push(now),
                Err(Refusal::Never { capacity }) => assert!(cost > capacity, "step {i}"),
                Err(Refusal::NotYet { retry_after }) => {
                    let wait = nanos(retry_after.expect("rate limits know when"));
                    assert!(wait > 0, "step {i}: zero wait");
                    let copy = state.clone();
                    assert_eq!(alg.check(&copy, at(now + wait), cost), Ok(()), "step {i}: refused after {wait}ns");
                    assert_eq!(
                        alg.check(&copy, at(now + wait - 1), cost),
                        Err(Refusal::NotYet { retry_after: Some(Duration::from_nanos(1)) }),
                        "step {i}: not exact, {wait}ns"
                    );
                    let mid = now + s.grant.index(usize::try_from(wait).unwrap_or(usize::MAX)) as u64;
                    assert_eq!(
                        alg.check(&copy, at(mid), cost),
                        Err(Refusal::NotYet { retry_after: Some(Duration::from_nanos(now + wait - mid)) }),
                        "step {i}: the wait from {mid} points elsewhere"
                    );
                    let mut copy = copy;
                    assert_eq!(alg.acquire(&mut copy, at(now + wait), cost), Ok(()));
                }
            },
            Op::Refund(amount) => {
                let granted = pick(s.grant, &grants, now);
                alg.refund(&mut state, t, at(granted), amount);
            }
            Op::Charge(amount) => {
                let granted = pick(s.grant, &grants, now);
                alg.charge(&mut state, t, at(granted), amount);
            }
        }
        assert_peek_exact(alg, &state, now, i);
    }
}

/// `peek(now).remaining` is the largest cost `check` grants at `now` (at most the
/// capacity, the burst of a rate limit, which may be below its quota per window), and the
/// limit is back to its full capacity at exactly `now + reset`.
fn assert_peek_exact<A: Algorithm>(alg: &A, state: &A::State, now: u64, step: usize) {
    let snap = alg.peek(state, at(now));
    let full = alg.capacity();
    assert!(full <= snap.quota, "step {step}: the quota is below what can be granted at once: {snap:?}");
    assert!(snap.remaining <= full, "step {step}: remaining above capacity: {snap:?}");
    if snap.remaining > 0 {
        assert_eq!(alg.check(state, at(now), snap.remaining), Ok(()), "step {step}: peek promises too much: {snap:?}");
    }
    if snap.remaining < full {
        assert!(
            matches!(alg.check(state, at(now), snap.remaining + 1), Err(Refusal::NotYet { .. })),
            "step {step}: peek promises too little: {snap:?}"
        );
    }
    let reset = nanos(snap.reset);
    assert_eq!(alg.peek(state, at(now + reset)).remaining, full, "step {step}: not full after reset {snap:?}");
    if reset > 0 {
        assert!(alg.peek(state, at(now + reset - 1)).remaining < full, "step {step}: full before reset: {snap:?}");
    }
}

proptest! {
    #![proptest_config(proptest_config(CASES))]

    #[test]
    fn gcra_retry_after_is_exact((p, steps) in rate_steps(1..120)) {
        assert_retry_exact(&p.gcra(), &steps);
    }

    #[test]
    fn token_bucket_retry_after_is_exact((p, steps) in rate_steps(1..120)) {
        assert_retry_exact(&p.bucket(), &steps);
    }

    #[test]
    fn sliding_log_retry_after_is_exact((p, steps) in window_steps(1..120)) {
        assert_retry_exact(&p.log(), &steps);
    }

    #[test]
    fn sliding_counter_retry_after_is_exact((p, steps) in window_steps(1..120)) {
        assert_retry_exact(&p.counter(), &steps);
    }

    #[test]
    fn fixed_window_retry_after_is_exact((p, steps) in window_steps(1..120)) {
        assert_retry_exact(&p.fixed(), &steps);
    }
}

// ---------------------------------------------------------------------------------------
// Law 7: idle states decide like fresh ones (what makes eviction safe)
// ---------------------------------------------------------------------------------------

/// Runs `prefix`, waits `gap`; if the state then says it is idle, runs `rest` on it and
/// on a fresh state side by side and requires the same answers throughout.
fn assert_idle_is_fresh<A: Algorithm>(alg: &A, prefix: &[Step], gap: u64, rest: &[Step]) -> bool {
    let mut state = alg.fresh();
    let mut now = 0u64;
    let mut grants = Vec::new();
    for s in prefix {
        now += s.advance;
        match s.op {
            Op::Acquire(cost) => {
                if alg.acquire(&mut state, at(now), cost).is_ok() {
                    grants.push(now);
                }
            }
            Op::Refund(a) => alg.refund(&mut state, at(now), at(pick(s.grant, &grants, now)), a),
            Op::Charge(a) => alg.charge(&mut state, at(now), at(pick(s.grant, &grants, now)), a),
        }
    }
    now += gap;
    if !alg.is_idle(&state, at(now)) {
        return false;
    }
    let mut fresh = alg.fresh();
    let mut grants = Vec::new();
    assert_eq!(alg.peek(&state, at(now)), alg.peek(&fresh, at(now)));
    for (i, s) in rest.iter().enumerate() {
        now += s.advance;
        let t = at(now);
        match s.op {
            Op::Acquire(cost) => {
                let r = alg.acquire(&mut state, t, cost);
                assert_eq!(r, alg.acquire(&mut fresh, t, cost), "step {i} after idle");
                if r.is_ok() {
                    grants.push(now);
                }
            }
            Op::Refund(a) => {
                let g = at(pick(s.grant, &grants, now));
                alg.refund(&mut state, t, g, a);
                alg.refund(&mut fresh, t, g, a);
            }
            Op::Charge(a) => {
                let g = at(pick(s.grant, &grants, now));
                alg.charge(&mut state, t, g, a);
                alg.charge(&mut fresh, t, g, a);
            }
        }
        assert_eq!(alg.peek(&state, t), alg.peek(&fresh, t), "peek, step {i} after idle");
        assert_eq!(alg.is_idle(&state, t), alg.is_idle(&fresh, t), "is_idle, step {i} after idle");
    }
    true
}

fn gap(unit: u64) -> impl Strategy<Value = u64> {
    prop_oneof![Just(0u64), 0..=8 * unit, 0..=400 * unit]
}

proptest! {
    #![proptest_config(proptest_config(CASES))]

    #[test]
    fn idle_rate_states_decide_like_fresh(
        (p, prefix, gap, rest) in rate_params().prop_flat_map(|p| {
            let u = p.interval();
            (Just(p), steps(u, p.burst, 0..40), gap(u), steps(u, p.burst, 1..40))
        })
    ) {
        assert_idle_is_fresh(&p.gcra(), &prefix, gap, &rest);
        assert_idle_is_fresh(&p.bucket(), &prefix, gap, &rest);
    }

    #[test]
    fn idle_window_states_decide_like_fresh(
        (p, prefix, gap, rest) in window_params().prop_flat_map(|p| {
            let u = p.unit();
            (Just(p), steps(u, p.limit, 0..40), gap(u), steps(u, p.limit, 1..40))
        })
    ) {
        assert_idle_is_fresh(&p.log(), &prefix, gap, &rest);
        assert_idle_is_fresh(&p.counter(), &prefix, gap, &rest);
        assert_idle_is_fresh(&p.fixed(), &prefix, gap, &rest);
    }

    /// Law 6, concurrency: acquire and release at random; never more than the capacity
    /// held, a refusal has no wait (only a release helps), a cost above capacity is
    /// refused as `Never`.
    #[test]
    fn semaphore_never_exceeds_capacity(
        capacity in 1u64..=8,
        ops in prop::collection::vec((any::<bool>(), 0u64..=9, any::<Index>()), 1..200),
    ) {
        let sem = Semaphore::new(capacity).unwrap();
        let mut state = sem.fresh();
        let mut held: Vec<u64> = Vec::new();
        for (acquire, cost, pick) in ops {
            if acquire || held.is_empty() {
                match sem.acquire(&mut state, Instant::ZERO, cost) {
                    Ok(()) => held.push(cost),
                    Err(Refusal::NotYet { retry_after }) => {
                        prop_assert_eq!(retry_after, None);
                        prop_assert!(held.iter().sum::<u64>() + cost > capacity);
                    }
                    Err(Refusal::Never { capacity: c }) => prop_assert!(cost > c && c == capacity),
                }
            } else {
                sem.release(&mut state, held.swap_remove(pick.index(held.len())));
            }
            let total: u64 = held.iter().sum();
            prop_assert!(total <= capacity);
            prop_assert_eq!(state.held(), total);
            prop_assert_eq!(sem.peek(&state, Instant::ZERO).remaining, capacity - total);
            prop_assert_eq!(sem.is_idle(&state, Instant::ZERO), total == 0);
        }
    }
}

// ---------------------------------------------------------------------------------------
// A few fixed cases, to read the laws on concrete numbers
// ---------------------------------------------------------------------------------------

#[test]
fn rounding_the_interval_up_keeps_the_cap() {
    // 3 per second: the interval rounds up to 333_333_334ns, so three grants after the
    // burst take one second and two nanoseconds, never less.
    let gcra = Gcra::new(Quota::per_second(nz!(3)).burst(nz!(1)));
    assert_eq!(gcra.interval_nanos(), 333_333_334);
    let mut s = gcra.fresh();
    let mut now = 0;
    let mut granted = 0;
    while now <= 1_000_000_000 {
        if gcra.acquire(&mut s, at(now), 1).is_ok() {
            granted += 1;
        }
        now += 1_000;
    }
    // At 0, 333_333_334 and 666_666_668 ns, then 1_000_000_002 is past the second.
    assert_eq!(granted, 3);
}

#[test]
fn cost_above_capacity_is_never_for_every_algorithm() {
    let p = RateParams { amount: 10, period: 1_000_000_000, burst: 5 };
    let w = WindowParams { limit: 5, window: 1_000 };
    let never = Err(Refusal::Never { capacity: 5 });
    assert_eq!(p.gcra().acquire(&mut p.gcra().fresh(), Instant::ZERO, 6), never);
    assert_eq!(p.bucket().acquire(&mut p.bucket().fresh(), Instant::ZERO, 6), never);
    assert_eq!(w.log().acquire(&mut w.log().fresh(), Instant::ZERO, 6), never);
    assert_eq!(w.counter().acquire(&mut w.counter().fresh(), Instant::ZERO, 6), never);
    assert_eq!(w.fixed().acquire(&mut w.fixed().fresh(), Instant::ZERO, 6), never);
    let sem = Semaphore::new(5).unwrap();
    assert_eq!(sem.acquire(&mut sem.fresh(), Instant::ZERO, 6), never);
}

/// Every algorithm reports the parameters it was built with, and a fresh state is full.
#[test]
fn accessors_report_the_parameters() {
    let quota = Quota::try_new(7, Duration::from_secs(3)).unwrap().burst(nz!(5));
    let gcra = Gcra::new(quota);
    assert_eq!((gcra.quota(), gcra.capacity()), (quota, 5));
    assert_eq!(quota.rate(), Rate::new(7, Duration::from_secs(3)));
    assert_eq!(gcra.interval_nanos(), 428_571_429);
    let mut state = gcra.fresh();
    assert_eq!(state.theoretical_arrival(), Instant::ZERO);
    gcra.acquire(&mut state, at(1_000), 2).unwrap();
    assert_eq!(state.theoretical_arrival(), at(1_000 + 2 * 428_571_429));

    let bucket = TokenBucket::new(quota);
    assert_eq!((bucket.quota(), bucket.capacity()), (quota, 5));

    let window = Duration::from_millis(1_500);
    let log = SlidingWindowLog::new(9, window).unwrap();
    assert_eq!((log.limit(), log.window(), log.capacity()), (9, window, 9));
    let counter = SlidingWindowCounter::new(9, window).unwrap();
    assert_eq!((counter.limit(), counter.window(), counter.capacity()), (9, window, 9));
    let fixed = FixedWindow::new(9, window).unwrap();
    assert_eq!((fixed.limit(), fixed.window(), fixed.capacity()), (9, window, 9));
    let sem = Semaphore::new(3).unwrap();
    assert_eq!((sem.capacity(), sem.fresh().held()), (3, 0));

    // Rate limits state their rate's amount per period (the plan), and can grant their
    // burst right now; windowed limits and semaphores state what they grant.
    for ((quota, window), full, snap) in [
        ((quota.amount(), quota.period()), 5, gcra.peek(&gcra.fresh(), Instant::ZERO)),
        ((quota.amount(), quota.period()), 5, bucket.peek(&bucket.fresh(), Instant::ZERO)),
        ((9, window), 9, log.peek(&log.fresh(), Instant::ZERO)),
        ((9, window), 9, counter.peek(&counter.fresh(), Instant::ZERO)),
        ((9, window), 9, fixed.peek(&fixed.fresh(), Instant::ZERO)),
        ((3, Duration::ZERO), 3, sem.peek(&sem.fresh(), Instant::ZERO)),
    ] {
        assert_eq!(
            (snap.quota, snap.window, snap.remaining, snap.reset),
            (quota, window, full, Duration::ZERO),
            "{snap:?}"
        );
    }
}
