//! Law 11, the laws of settling, and the memory bound of the sliding-window log, as
//! property tests on instants built by hand. Law numbers are those of
//! `crates/tower-limits/docs/laws.md`.
//!
//! A caller estimates a cost, acquires it, and settles to what was really used: a refund
//! when the estimate was too high (settling *down*), a charge when it was too low
//! (settling *up*). Both are promises a user of a token limit cannot check from outside,
//! so they are checked here on every algorithm that counts cost:
//!
//! - **Settling is committing the actual.** A grant of the estimate settled at once to
//!   the actual leaves a state that decides exactly like one that recorded the actual in
//!   the first place: the same `check` for every cost, the same `peek`.
//! - **The rate cap holds on settled costs.** What was really used, charges beyond the
//!   estimate included, stays within the algorithm's cap, except for the overrun of the
//!   last grant of the window (its work was already done when its usage became known):
//!   for GCRA and the token bucket `used * interval <= span + burst * interval +
//!   overrun * interval` over every span of grants; for the sliding-window log `used <=
//!   limit + overrun` in every window; for the fixed window and the sliding-window counter
//!   `used <= limit + overrun` in every aligned window.
//! - **The log's memory is bounded.** After any sequence of grants, refunds and charges
//!   (on any earlier grant), the log holds at most `limit` entries plus one per charge of
//!   the last window (a charge may recreate the entry of a grant refunded to nothing);
//!   so without charges, at most `limit`, whatever the length of the trace.

use std::time::Duration;

use proptest::prelude::*;
use proptest::sample::Index;
use tower_limits_core::algorithm::{
    Algorithm, FixedWindow, Gcra, SlidingWindowCounter, SlidingWindowLog, SlidingWindowLogState, TokenBucket,
};
use tower_limits_core::{Instant, Quota, nz};
use tower_limits_tests::params::{RateParams, WindowParams, rate_params, window_params};
use tower_limits_tests::proptest_config;

const CASES: u32 = 192;

fn at(nanos: u64) -> Instant {
    Instant::from_nanos(nanos)
}

// ---------------------------------------------------------------------------------------
// Generators
// ---------------------------------------------------------------------------------------

/// How far the clock moves before a request, in units of `unit`.
fn advance(unit: u64) -> impl Strategy<Value = u64> {
    prop_oneof![
        3 => Just(0u64),
        4 => 0..=unit,
        2 => 0..=4 * unit,
        1 => 0..=40 * unit,
    ]
}

/// A request: an estimate within (or just above) the capacity, and the real usage, which
/// is often the estimate, often below it, often above it (up to twice the capacity).
#[derive(Debug, Clone, Copy)]
struct Req {
    advance: u64,
    estimate: u64,
    actual: u64,
}

fn request(unit: u64, capacity: u64) -> impl Strategy<Value = Req> {
    let estimate = prop_oneof![3 => Just(1u64), 4 => 0..=capacity, 1 => Just(capacity + 1)];
    (advance(unit), estimate, any::<Index>(), 0u8..4).prop_map(move |(advance, estimate, pick, how)| {
        let actual = match how {
            0 => estimate,
            1 => pick.index(estimate as usize + 1) as u64,
            _ => estimate + 1 + pick.index(2 * capacity as usize) as u64,
        };
        Req { advance, estimate, actual }
    })
}

fn requests(unit: u64, capacity: u64) -> impl Strategy<Value = Vec<Req>> {
    prop::collection::vec(request(unit, capacity), 1..150)
}

fn rate_requests() -> impl Strategy<Value = (RateParams, Vec<Req>)> {
    rate_params().prop_flat_map(|p| (Just(p), requests(p.interval(), p.burst)))
}

fn window_requests() -> impl Strategy<Value = (WindowParams, Vec<Req>)> {
    window_params().prop_flat_map(|p| (Just(p), requests(p.unit(), p.limit)))
}

// ---------------------------------------------------------------------------------------
// Settling at once
// ---------------------------------------------------------------------------------------

/// A grant, settled: when, what was estimated, what was really used.
#[derive(Debug, Clone, Copy)]
struct Settled {
    at: u64,
    estimate: u64,
    actual: u64,
}

impl Settled {
    /// Usage beyond the estimate, known only once the work was done.
    fn overrun(self) -> u64 {
        self.actual.saturating_sub(self.estimate)
    }
}

/// Settles a grant of `estimate` made at `now` to `actual`, at `now`.
fn settle<A: Algorithm>(alg: &A, state: &mut A::State, now: u64, estimate: u64, actual: u64) {
    if actual < estimate {
        alg.refund(state, at(now), at(now), estimate - actual);
    } else if actual > estimate {
        alg.charge(state, at(now), at(now), actual - estimate);
    }
}

/// Runs `reqs`, settling every grant at once to its actual usage, and checks on the way
/// that the settled state decides exactly like a twin that committed the actual usage
/// directly. Returns the settled grants.
fn run_settled<A: Algorithm>(alg: &A, reqs: &[Req]) -> Vec<Settled> {
    let mut state = alg.fresh();
    let mut twin = alg.fresh();
    let mut now = 0u64;
    let mut out = Vec::new();
    for (step, r) in reqs.iter().enumerate() {
        now += r.advance;
        if alg.acquire(&mut state, at(now), r.estimate).is_ok() {
            settle(alg, &mut state, now, r.estimate, r.actual);
            alg.commit(&mut twin, at(now), r.actual);
            out.push(Settled { at: now, estimate: r.estimate, actual: r.actual });
        }
        // Decisions now and a little later: every cost, and the snapshot.
        for later in [now, now + alg.peek(&state, at(now)).reset.as_nanos() as u64 / 2] {
            assert_eq!(
                alg.peek(&state, at(later)),
                alg.peek(&twin, at(later)),
                "step {step} at {later}: settled {state:?} and committed {twin:?} disagree"
            );
            for cost in 0..=alg.capacity() + 1 {
                assert_eq!(
                    alg.check(&state, at(later), cost),
                    alg.check(&twin, at(later), cost),
                    "step {step} at {later}, cost {cost}: settled {state:?} and committed {twin:?} disagree"
                );
            }
        }
    }
    out
}

/// Over every span `[t_i, t_j]` of grants, settled usage within `span / interval +
/// burst`, plus the overrun of grant `j`.
fn assert_settled_rate_cap(p: RateParams, grants: &[Settled]) {
    let (burst, interval) = (u128::from(p.burst), u128::from(p.interval()));
    for i in 0..grants.len() {
        let mut used = 0u128;
        for j in i..grants.len() {
            used += u128::from(grants[j].actual);
            let span = u128::from(grants[j].at - grants[i].at);
            let overrun = u128::from(grants[j].overrun());
            assert!(
                used * interval <= span + (burst + overrun) * interval,
                "{used} used in [{}, {}] (overrun of the last {overrun}): above {p:?}",
                grants[i].at,
                grants[j].at,
            );
        }
    }
}

/// In every window `(t_j - window, t_j]`, settled usage within `limit` plus the overrun
/// of grant `j`.
fn assert_settled_window_cap(p: WindowParams, grants: &[Settled]) {
    for j in 0..grants.len() {
        let used: u128 =
            grants[..=j].iter().filter(|g| grants[j].at - g.at < p.window).map(|g| u128::from(g.actual)).sum();
        let overrun = u128::from(grants[j].overrun());
        assert!(
            used <= u128::from(p.limit) + overrun,
            "{used} used in the window ending at {} (overrun of the last {overrun}): above {p:?}",
            grants[j].at
        );
    }
}

/// In every aligned window, settled usage within `limit` plus the overrun of its last
/// grant.
fn assert_settled_aligned_cap(p: WindowParams, grants: &[Settled]) {
    let mut start = None;
    let mut used = 0u128;
    for g in grants {
        let s = g.at - g.at % p.window;
        if start != Some(s) {
            start = Some(s);
            used = 0;
        }
        used += u128::from(g.actual);
        assert!(
            used <= u128::from(p.limit) + u128::from(g.overrun()),
            "{used} used in the aligned window at {s} (overrun of the last {}): above {p:?}",
            g.overrun()
        );
    }
}

proptest! {
    #![proptest_config(proptest_config(CASES))]

    #[test]
    fn gcra_settles_exactly_and_caps_settled_usage((p, reqs) in rate_requests()) {
        let grants = run_settled(&p.gcra(), &reqs);
        assert_settled_rate_cap(p, &grants);
    }

    #[test]
    fn token_bucket_settles_exactly_and_caps_settled_usage((p, reqs) in rate_requests()) {
        let grants = run_settled(&p.bucket(), &reqs);
        assert_settled_rate_cap(p, &grants);
    }

    #[test]
    fn sliding_log_settles_exactly_and_caps_settled_usage((p, reqs) in window_requests()) {
        let grants = run_settled(&p.log(), &reqs);
        assert_settled_window_cap(p, &grants);
    }

    #[test]
    fn sliding_counter_settles_exactly_and_caps_settled_usage((p, reqs) in window_requests()) {
        let grants = run_settled(&p.counter(), &reqs);
        assert_settled_aligned_cap(p, &grants);
    }

    #[test]
    fn fixed_window_settles_exactly_and_caps_settled_usage((p, reqs) in window_requests()) {
        let grants = run_settled(&p.fixed(), &reqs);
        assert_settled_aligned_cap(p, &grants);
    }
}

// ---------------------------------------------------------------------------------------
// The log's memory bound
// ---------------------------------------------------------------------------------------

#[derive(Debug, Clone, Copy)]
enum Op {
    Acquire(u64),
    /// Refund this much of an earlier grant (picked by the step's index).
    Refund(u64),
    /// Charge this much more to an earlier grant.
    Charge(u64),
}

fn log_steps() -> impl Strategy<Value = (WindowParams, Vec<(u64, Op, Index)>)> {
    window_params().prop_flat_map(|p| {
        let op = prop_oneof![
            6 => prop_oneof![3 => Just(1u64), 4 => 0..=p.limit, 1 => Just(p.limit + 1)].prop_map(Op::Acquire),
            1 => (0..=2 * p.limit).prop_map(Op::Refund),
            1 => (0..=2 * p.limit).prop_map(Op::Charge),
        ];
        (Just(p), prop::collection::vec((advance(p.unit()), op, any::<Index>()), 1..300))
    })
}

/// The entries a log holds may exceed `limit` only by the charges of the last window.
fn assert_log_bounded(p: WindowParams, steps: &[(u64, Op, Index)]) {
    let log = p.log();
    let mut state: SlidingWindowLogState = log.fresh();
    let mut now = 0u64;
    let mut grants: Vec<u64> = Vec::new();
    let mut charges: Vec<u64> = Vec::new();
    let mut most = 0;
    for (step, &(advance, op, pick)) in steps.iter().enumerate() {
        now += advance;
        let granted_at = if grants.is_empty() { now } else { grants[pick.index(grants.len())] };
        let wrote = match op {
            Op::Acquire(cost) => {
                let ok = log.acquire(&mut state, at(now), cost).is_ok();
                if ok {
                    grants.push(now);
                }
                ok
            }
            Op::Refund(amount) => {
                log.refund(&mut state, at(now), at(granted_at), amount);
                true
            }
            Op::Charge(amount) => {
                log.charge(&mut state, at(now), at(granted_at), amount);
                if amount > 0 {
                    charges.push(now);
                }
                true
            }
        };
        // A refusal only reads the log; every write forgets what left the window first.
        if wrote {
            let recent = charges.iter().filter(|&&c| now - c < p.window).count();
            assert!(
                state.len() <= p.limit as usize + recent,
                "step {step} at {now}: {} entries, above the limit {} plus {recent} recent charges: {state:?}",
                state.len(),
                p.limit
            );
            // Everything left is live, so the log is idle exactly when it is empty.
            assert_eq!(state.is_empty(), log.is_idle(&state, at(now)), "step {step} at {now}: {state:?}");
        }
        most = most.max(state.len());
    }
    // Without charges the bound is the limit itself, however long the trace.
    if charges.is_empty() {
        assert!(most <= p.limit as usize, "{most} entries for a limit of {}", p.limit);
    }
}

proptest! {
    #![proptest_config(proptest_config(CASES))]

    #[test]
    fn the_log_holds_at_most_limit_entries_plus_recent_charges((p, steps) in log_steps()) {
        assert_log_bounded(p, &steps);
    }
}

/// A long steady trace: a grant every unit of time for a hundred windows never leaves
/// more than `limit` entries, and an idle log is empty after its next write.
#[test]
fn a_steady_log_forgets_what_left_the_window() {
    let log = SlidingWindowLog::new(4, Duration::from_nanos(100)).unwrap();
    let mut state = log.fresh();
    let mut granted = 0;
    for t in (0..10_000).step_by(5) {
        if log.acquire(&mut state, at(t), 1).is_ok() {
            granted += 1;
        }
        if t < 100 {
            // The first window: every grant so far is still in it, and in the log.
            assert_eq!(state.len(), granted, "at {t}");
        }
        assert!(state.len() <= 4, "{} entries at {t}", state.len());
    }
    // Four per window of 100ns, over 100 windows.
    assert_eq!(granted, 400);
    // Far later, one refund (a write) forgets everything.
    log.refund(&mut state, at(1_000_000), at(1_000_000), 0);
    assert!(state.is_empty(), "{state:?}");
}

// ---------------------------------------------------------------------------------------
// Settling on concrete numbers
// ---------------------------------------------------------------------------------------

/// Settling up on every algorithm: a grant of 1 that really used 3 leaves room for
/// exactly 1 more of a limit of 4 in the same window; settling down gives room back.
#[test]
fn settling_up_and_down_on_concrete_numbers() {
    let window = Duration::from_secs(1);
    fn room<A: Algorithm>(alg: &A, state: &A::State) -> u64 {
        (0..=alg.capacity()).rev().find(|&c| alg.check(state, Instant::ZERO, c).is_ok()).unwrap()
    }
    fn up_then_down<A: Algorithm + std::fmt::Debug>(alg: A) {
        let mut s = alg.fresh();
        alg.acquire(&mut s, Instant::ZERO, 1).unwrap();
        assert_eq!(room(&alg, &s), 3);
        alg.charge(&mut s, Instant::ZERO, Instant::ZERO, 2);
        assert_eq!(room(&alg, &s), 1, "{alg:?} after settling up: {s:?}");
        alg.refund(&mut s, Instant::ZERO, Instant::ZERO, 3);
        assert_eq!(room(&alg, &s), 4, "{alg:?} after settling down: {s:?}");
    }
    up_then_down(Gcra::new(Quota::per_second(nz!(4))));
    up_then_down(TokenBucket::new(Quota::per_second(nz!(4))));
    up_then_down(SlidingWindowLog::new(4, window).unwrap());
    up_then_down(SlidingWindowCounter::new(4, window).unwrap());
    up_then_down(FixedWindow::new(4, window).unwrap());
}

// ---------------------------------------------------------------------------------------
// Settling later, on the windowed algorithms
// ---------------------------------------------------------------------------------------

/// A step of a trace where grants are settled later, in any order.
#[derive(Debug, Clone, Copy)]
enum Later {
    /// Advance the clock, then acquire an estimate that will really use `actual`.
    Acquire { advance: u64, estimate: u64, actual: u64 },
    /// Settle one of the grants not settled yet.
    Settle(Index),
}

fn later_steps(unit: u64, capacity: u64) -> impl Strategy<Value = Vec<Later>> {
    let step = prop_oneof![
        3 => request(unit, capacity).prop_map(|r| Later::Acquire { advance: r.advance, estimate: r.estimate, actual: r.actual }),
        2 => any::<Index>().prop_map(Later::Settle),
    ];
    prop::collection::vec(step, 1..80)
}

/// Settling a grant of a windowed algorithm later, in any order (several grants may share
/// an instant), is exact too: at every step the state decides like a twin that committed,
/// at each grant's own instant, what is known by then (the actual usage of the settled
/// grants, the estimate of the others). Once a grant has left its window, neither counts.
fn assert_settles_later<A: Algorithm>(alg: &A, steps: &[Later]) {
    let mut state = alg.fresh();
    let mut now = 0u64;
    // (instant, estimate, actual, settled)
    let mut grants: Vec<(u64, u64, u64, bool)> = Vec::new();
    for (step, &s) in steps.iter().enumerate() {
        match s {
            Later::Acquire { advance, estimate, actual } => {
                now += advance;
                if alg.acquire(&mut state, at(now), estimate).is_ok() {
                    grants.push((now, estimate, actual, false));
                }
            }
            Later::Settle(pick) => {
                let open: Vec<usize> = (0..grants.len()).filter(|&i| !grants[i].3).collect();
                if open.is_empty() {
                    continue;
                }
                let g = &mut grants[open[pick.index(open.len())]];
                let (granted, estimate, actual) = (g.0, g.1, g.2);
                g.3 = true;
                if actual < estimate {
                    alg.refund(&mut state, at(now), at(granted), estimate - actual);
                } else if actual > estimate {
                    alg.charge(&mut state, at(now), at(granted), actual - estimate);
                }
            }
        }
        let mut twin = alg.fresh();
        for &(t, estimate, actual, settled) in &grants {
            alg.commit(&mut twin, at(t), if settled { actual } else { estimate });
        }
        assert_eq!(alg.peek(&state, at(now)), alg.peek(&twin, at(now)), "step {step}: {state:?} vs {twin:?}");
        for cost in 0..=alg.capacity() + 1 {
            assert_eq!(
                alg.check(&state, at(now), cost),
                alg.check(&twin, at(now), cost),
                "step {step}, cost {cost}: {state:?} vs {twin:?}"
            );
        }
    }
}

fn window_later() -> impl Strategy<Value = (WindowParams, Vec<Later>)> {
    window_params().prop_flat_map(|p| (Just(p), later_steps(p.unit(), p.limit)))
}

proptest! {
    #![proptest_config(proptest_config(CASES / 2))]

    #[test]
    fn the_log_settles_later_exactly((p, steps) in window_later()) {
        assert_settles_later(&p.log(), &steps);
    }

    #[test]
    fn the_fixed_window_settles_later_exactly((p, steps) in window_later()) {
        assert_settles_later(&p.fixed(), &steps);
    }

    #[test]
    fn the_sliding_counter_settles_later_exactly((p, steps) in window_later()) {
        assert_settles_later(&p.counter(), &steps);
    }
}
