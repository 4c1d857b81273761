//! Law 12: every overflow boundary is a clear error or a correct answer, never a panic.
//! Law numbers are those of `crates/tower-limits/docs/laws.md`.
//!
//! - A limit spans at most 2^62 nanoseconds (about 146 years): a burst whose emission
//!   intervals add up to more, or a window longer than that, is refused by validation
//!   (of a `Quota` read from data, or of a policy's fields), naming the field; exactly
//!   2^62 is accepted.
//! - Rates near `u64::MAX` units, periods near `Duration::MAX`, bursts and limits near
//!   `u64::MAX`: errors naming the field, or limits that work.
//! - Once built, no algorithm panics on any cost, refund or charge up to `u64::MAX`, at
//!   any instant up to 2^62 nanoseconds, and a `LimitSet` refuses a cost above capacity
//!   and settles any usage without panicking.

use std::time::Duration;

use proptest::prelude::*;
use tower_limits_core::algorithm::{
    Algorithm, FixedWindow, Gcra, Refusal, Semaphore, SlidingWindowCounter, SlidingWindowLog, TokenBucket,
};
use tower_limits_core::{
    AcquireError, Instant, Limit, LimitPolicy, LimitSet, LimitSetPolicy, PolicyError, Quota, Rate, TenantKey, nz,
};
use tower_limits_tests::proptest_config;

/// The longest span a limit can cover, in nanoseconds.
const SPAN: u64 = 1 << 62;

fn nanos(n: u64) -> Duration {
    Duration::from_nanos(n)
}

/// `limit` with `rate` and `burst` as a policy file gives them: data, checked when the
/// limit is built, so they may be invalid (a quota cannot be).
fn with_data(mut limit: LimitPolicy, rate: Rate, burst: u64) -> LimitPolicy {
    limit.rate = Some(rate);
    limit.burst = Some(burst);
    limit
}

/// The GCRA and the token bucket of a policy with this `rate` and `burst`.
fn from_data(rate: Rate, burst: u64) -> [Result<Limit, PolicyError>; 2] {
    let any = Quota::per_second(nz!(1));
    [LimitPolicy::gcra("g", any), LimitPolicy::token_bucket("t", any)]
        .map(|limit| Limit::from_policy(&with_data(limit, rate, burst)))
}

#[track_caller]
fn assert_field<T: std::fmt::Debug>(result: Result<T, PolicyError>, field: &str, says: &str) {
    let err = result.expect_err("an error");
    assert_eq!(err.field(), field, "{err}");
    assert!(err.to_string().contains(says), "{err:?} should say {says:?}");
}

// ---------------------------------------------------------------------------------------
// Bursts: burst * interval <= 2^62
// ---------------------------------------------------------------------------------------

#[test]
fn a_burst_spanning_exactly_the_limit_is_accepted_and_one_more_is_not() {
    // An interval of 2^40ns: 2^22 units span exactly 2^62ns.
    let quota = Quota::try_new(1, nanos(1 << 40)).unwrap();
    let widest = quota.try_burst(1 << 22).unwrap();
    assert_eq!(Gcra::new(widest).capacity(), 1 << 22);
    assert_eq!(TokenBucket::new(widest).capacity(), 1 << 22);
    assert_field(quota.try_burst((1 << 22) + 1), "burst", "146 years");
    for limit in from_data(quota.rate(), 1 << 22) {
        assert_eq!(limit.unwrap().capacity(), 1 << 22);
    }
    for limit in from_data(quota.rate(), (1 << 22) + 1) {
        assert_field(limit, "burst", "146 years");
    }
    // One nanosecond per unit: 2^62 units is the longest burst.
    let fast = Quota::per_second(nz!(1_000_000_000));
    assert!(fast.try_burst(SPAN).is_ok());
    assert_field(fast.try_burst(SPAN + 1), "burst", "146 years");
    for limit in from_data(fast.rate(), SPAN + 1) {
        assert_field(limit, "burst", "146 years");
    }
}

#[test]
fn a_burst_whose_span_overflows_u64_is_an_error() {
    // 2ns per unit: u64::MAX units overflow the multiplication itself.
    let quota = Quota::per_second(nz!(500_000_000));
    for burst in [u64::MAX, u64::MAX / 2 + 1, SPAN / 2 + 1] {
        assert_field(quota.try_burst(burst), "burst", "146 years");
        for limit in from_data(quota.rate(), burst) {
            assert_field(limit, "burst", "146 years");
        }
    }
    assert!(quota.try_burst(SPAN / 2).is_ok());
    assert_field(quota.try_burst(0), "burst", "at least 1");
    for limit in from_data(quota.rate(), 0) {
        assert_field(limit, "burst", "at least 1");
    }
}

#[test]
fn rates_near_the_edges_are_errors_or_limits_that_work() {
    // Too fast to represent, up to u64::MAX per nanosecond.
    for (amount, period) in [(u64::MAX, Duration::from_secs(1)), (u64::MAX, nanos(1)), (2, nanos(1))] {
        assert_field(Quota::try_new(amount, period), "rate", "too fast");
        for limit in from_data(Rate::new(amount, period), 1) {
            assert_field(limit, "rate", "too fast");
        }
    }
    for (amount, period, says) in [(0, nanos(1), "at least 1"), (1, Duration::ZERO, "longer than zero")] {
        assert_field(Quota::try_new(amount, period), "rate", says);
        for limit in from_data(Rate::new(amount, period), 1) {
            assert_field(limit, "rate", says);
        }
    }
    // A period beyond u64::MAX nanoseconds: one unit alone spans more than a limit can.
    // A quota's own amount must fit (`rate`); a policy's burst of one does not (`burst`).
    for period in [Duration::MAX, nanos(SPAN + 1)] {
        assert_field(Quota::try_new(1, period), "rate", "146 years");
        for limit in from_data(Rate::new(1, period), 1) {
            assert_field(limit, "burst", "146 years");
        }
    }
    // u64::MAX units over the longest period: an interval of whole nanoseconds that fits
    // a policy's burst (a quota's default burst, all u64::MAX units, does not).
    for limit in from_data(Rate::new(u64::MAX, Duration::MAX), 1 << 20) {
        assert_eq!(limit.unwrap().capacity(), 1 << 20);
    }
    assert_field(Quota::try_new(u64::MAX, Duration::MAX), "rate", "146 years");
    assert_eq!(Quota::try_new(1, nanos(SPAN)).unwrap().max_burst(), 1);
    for limit in from_data(Rate::new(1, nanos(SPAN)), 1) {
        assert!(limit.is_ok());
    }
}

// ---------------------------------------------------------------------------------------
// Windows: at most 2^62 nanoseconds
// ---------------------------------------------------------------------------------------

#[test]
fn a_window_longer_than_a_limit_can_span_is_an_error() {
    for window in [nanos(SPAN + 1), nanos(u64::MAX), Duration::MAX, Duration::from_secs(u64::MAX)] {
        assert_field(SlidingWindowLog::new(1, window), "window", "146 years");
        assert_field(SlidingWindowCounter::new(1, window), "window", "146 years");
        assert_field(FixedWindow::new(1, window), "window", "146 years");
    }
    for limit in [1, u64::MAX] {
        assert!(SlidingWindowLog::new(limit, nanos(SPAN)).is_ok());
        assert!(SlidingWindowCounter::new(limit, nanos(SPAN)).is_ok());
        assert!(FixedWindow::new(limit, nanos(SPAN)).is_ok());
    }
    assert_field(SlidingWindowLog::new(1, Duration::ZERO), "window", "longer than zero");
    assert_field(SlidingWindowCounter::new(0, nanos(1)), "limit", "at least 1");
    assert_field(Semaphore::new(0), "capacity", "at least 1");
}

#[test]
fn a_policy_at_an_overflow_boundary_names_its_field() {
    let set = |limit: LimitPolicy| LimitSet::new(LimitSetPolicy::new().limit(limit));
    let field = |limit: LimitPolicy| set(limit).expect_err("an invalid policy").field().to_owned();
    let fast = Quota::per_second(nz!(1_000_000_000));
    assert!(field(with_data(LimitPolicy::gcra("g", fast), fast.rate(), SPAN + 1)).ends_with("burst"));
    let any = Quota::per_second(nz!(1));
    assert!(field(with_data(LimitPolicy::token_bucket("t", any), Rate::new(1, Duration::MAX), 1)).ends_with("burst"));
    let too_fast = Rate::new(u64::MAX, Duration::from_secs(1));
    assert!(field(with_data(LimitPolicy::gcra("g", any), too_fast, 1)).ends_with("rate"));
    assert!(field(LimitPolicy::sliding_window_log("l", 1, Duration::MAX)).ends_with("window"));
    assert!(field(LimitPolicy::sliding_window_counter("c", u64::MAX, nanos(SPAN + 1))).ends_with("window"));
    assert!(field(LimitPolicy::fixed_window("f", 1, nanos(u64::MAX))).ends_with("window"));
    // At the boundary itself, the policies build.
    assert!(set(LimitPolicy::gcra("g", fast.try_burst(SPAN).unwrap())).is_ok());
    assert!(set(LimitPolicy::fixed_window("f", u64::MAX, nanos(SPAN))).is_ok());
    assert!(set(LimitPolicy::semaphore("s", u64::MAX)).is_ok());
}

// ---------------------------------------------------------------------------------------
// No panic once built
// ---------------------------------------------------------------------------------------

/// Values that sit on the boundaries, and some in between.
fn edgy(max: u64) -> impl Strategy<Value = u64> {
    prop_oneof![
        Just(0u64),
        Just(1u64),
        Just(max),
        Just(max.saturating_sub(1)),
        Just(max / 2),
        Just(u64::MAX),
        Just(u64::MAX - 1),
        Just(SPAN),
        Just(SPAN - 1),
        0..=max,
    ]
}

#[derive(Debug, Clone, Copy)]
enum Op {
    Acquire(u64),
    Refund(u64),
    Charge(u64),
    /// Release the latest grant still held.
    Release,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => edgy(u64::MAX).prop_map(Op::Acquire),
        1 => edgy(u64::MAX).prop_map(Op::Refund),
        2 => edgy(u64::MAX).prop_map(Op::Charge),
        1 => Just(Op::Release),
    ]
}

/// Runs `ops` at instants that stay within 2^62 nanoseconds, checking every answer's
/// shape: a grant within capacity, `Never` exactly above it, a snapshot within quota.
fn run_without_panic<A: Algorithm>(alg: &A, steps: &[(u64, Op)]) {
    let mut state = alg.fresh();
    let mut now = 0u64;
    let mut grants: Vec<(u64, u64)> = Vec::new();
    for &(advance, op) in steps {
        now = now.saturating_add(advance).min(SPAN);
        match op {
            Op::Acquire(cost) => match alg.acquire(&mut state, Instant::from_nanos(now), cost) {
                Ok(()) => {
                    assert!(cost <= alg.capacity());
                    grants.push((now, cost));
                }
                Err(Refusal::Never { capacity }) => assert!(cost > capacity && capacity == alg.capacity()),
                Err(Refusal::NotYet { .. }) => assert!(cost <= alg.capacity()),
            },
            Op::Refund(amount) => {
                let at = grants.last().map_or(now, |g| g.0);
                alg.refund(&mut state, Instant::from_nanos(now), Instant::from_nanos(at), amount);
            }
            Op::Charge(amount) => {
                let at = grants.last().map_or(now, |g| g.0);
                alg.charge(&mut state, Instant::from_nanos(now), Instant::from_nanos(at), amount);
            }
            Op::Release => {
                if let Some((_, cost)) = grants.pop() {
                    alg.release(&mut state, cost);
                }
            }
        }
        let snap = alg.peek(&state, Instant::from_nanos(now));
        assert!(snap.remaining <= snap.quota, "{snap:?}");
        assert_eq!(snap.quota, alg.capacity());
        let _ = alg.is_idle(&state, Instant::from_nanos(now));
        for cost in [0, 1, alg.capacity(), u64::MAX] {
            let _ = alg.check(&state, Instant::from_nanos(now), cost);
        }
    }
}

fn steps() -> impl Strategy<Value = Vec<(u64, Op)>> {
    prop::collection::vec((edgy(SPAN), op()), 1..60)
}

proptest! {
    #![proptest_config(proptest_config(256))]

    #[test]
    fn rate_algorithms_never_panic(interval in edgy(SPAN), burst in edgy(u64::MAX), steps in steps()) {
        if let Ok(quota) = Quota::try_new(1, nanos(interval)).and_then(|q| q.try_burst(burst)) {
            run_without_panic(&Gcra::new(quota), &steps);
            run_without_panic(&TokenBucket::new(quota), &steps);
        }
    }

    #[test]
    fn window_algorithms_never_panic(window in edgy(SPAN), limit in edgy(u64::MAX), steps in steps()) {
        if let Ok(log) = SlidingWindowLog::new(limit, nanos(window)) {
            run_without_panic(&log, &steps);
        }
        if let Ok(counter) = SlidingWindowCounter::new(limit, nanos(window)) {
            run_without_panic(&counter, &steps);
        }
        if let Ok(fixed) = FixedWindow::new(limit, nanos(window)) {
            run_without_panic(&fixed, &steps);
        }
    }

    #[test]
    fn semaphores_never_panic(capacity in edgy(u64::MAX), steps in steps()) {
        if let Ok(sem) = Semaphore::new(capacity) {
            run_without_panic(&sem, &steps);
        }
    }
}

/// The token bucket's debt after charges of `u64::MAX`: refusals with a wait, and a
/// snapshot, instead of an overflow.
#[test]
fn a_token_bucket_deep_in_debt_still_answers() {
    let bucket = TokenBucket::new(Quota::per_second(nz!(1)));
    let mut state = bucket.fresh();
    for _ in 0..3 {
        bucket.charge(&mut state, Instant::ZERO, Instant::ZERO, u64::MAX);
    }
    match bucket.check(&state, Instant::ZERO, 1) {
        Err(Refusal::NotYet { retry_after: Some(wait) }) => assert!(wait >= nanos(SPAN), "{wait:?}"),
        other => panic!("expected a long wait, got {other:?}"),
    }
    let snap = bucket.peek(&state, Instant::ZERO);
    assert_eq!(snap.remaining, 0);
    assert!(snap.reset >= nanos(SPAN), "{snap:?}");
}

/// A set refuses a cost of `u64::MAX` as above capacity, and settles a usage of
/// `u64::MAX` (a charge beyond anything) into a limit that then refuses for a long time.
#[test]
fn a_limit_set_takes_costs_near_u64_max() {
    let set = LimitSet::new(
        LimitSetPolicy::new()
            .tiers(["tenant"])
            .limit(LimitPolicy::gcra("g", Quota::per_second(nz!(10))).per("tenant").counting_cost())
            .limit(LimitPolicy::token_bucket("t", Quota::per_second(nz!(10))).counting_cost())
            .limit(LimitPolicy::sliding_window_log("l", 10, Duration::from_secs(1)).counting_cost())
            .limit(LimitPolicy::sliding_window_counter("c", 10, Duration::from_secs(1)).counting_cost())
            .limit(LimitPolicy::fixed_window("f", 10, Duration::from_secs(1)).counting_cost())
            .limit(LimitPolicy::semaphore("s", u64::MAX).counting_cost()),
    )
    .unwrap();
    let key = TenantKey::single("a").unwrap();
    match set.acquire(&key, u64::MAX, Instant::ZERO) {
        Err(AcquireError::CostAboveCapacity(e)) => assert_eq!((e.cost(), e.capacity()), (u64::MAX, 10)),
        other => panic!("expected CostAboveCapacity, got {other:?}"),
    }
    let mut permit = set.acquire(&key, 1, Instant::ZERO).unwrap();
    permit.settle(u64::MAX, Instant::ZERO);
    drop(permit);
    match set.acquire(&key, 1, Instant::from_nanos(SPAN / 2)) {
        Err(AcquireError::Refused(d)) => assert!(d.retry_after() > Duration::ZERO),
        other => panic!("expected a refusal after a charge of u64::MAX, got {other:?}"),
    }
    let stats = set.stats();
    assert_eq!(stats.admitted, 1);
    assert_eq!(stats.limits.iter().map(|l| l.held).sum::<u64>(), 0);
}
