//! Loom models of the lock-free path: every interleaving of a few threads' acquisitions
//! (and of a replace that disables and re-enables the path) with at most two preemptions,
//! under the memory model loom checks, keeps the rate cap that the module's essay proves.
//!
//! Run with `RUSTFLAGS="--cfg loom" cargo test -p tower-limits-core --lib --release loom`
//! (`.ci/run` does). The models are small on purpose: two or three threads, one to four
//! calls each, and a bound on preemptions, which is where such protocols break.

use loom::sync::{Arc, Mutex};
use loom::thread;

use super::laws::{assert_rate_cap, fast, granted};
use super::*;
use crate::nz;
use crate::rate::Quota;

/// T = 1 us; a burst of `burst` units.
const T: u64 = 1_000;

fn model(f: impl Fn() + Sync + Send + 'static) {
    let mut builder = loom::model::Builder::new();
    builder.preemption_bound = Some(2);
    builder.check(f);
}

/// Runs `calls[t]` (the instants of thread `t`'s acquisitions of one unit) on `threads`
/// threads that have all seen contention (so that every grant may take or use a lease),
/// and returns every grant's instant.
fn run(limit: &Arc<Fast>, calls: &[&'static [u64]]) -> Vec<u64> {
    let grants = Arc::new(Mutex::new(Vec::new()));
    let handles: Vec<_> = calls
        .iter()
        .map(|&instants| {
            let (limit, grants) = (limit.clone(), grants.clone());
            thread::spawn(move || {
                limit.mark_contended();
                for &now in instants {
                    // Disabled (a replace in progress) counts as not granted here: a set
                    // takes its locked path then.
                    let decision = limit.acquire(1, Instant::from_nanos(now));
                    if let Some(at) = decision.and_then(|d| granted(Some(d))) {
                        grants.lock().unwrap().push(at);
                    }
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    let grants = grants.lock().unwrap().clone();
    grants
}

/// Every unit granted owns a slot of its own, of length T, that begins no earlier than
/// the first grant and ends no later than the shared TAT (a give-back returns only slots
/// no unit used): the essay's invariant, which holds whether or not the limit was
/// reached. Call once every thread is done.
fn assert_slots_fit(limit: &Fast, grants: &[u64]) {
    if let Some(&first) = grants.iter().min() {
        let span = limit.tat().saturating_sub(first);
        assert!(grants.len() as u64 * T <= span, "{} grants in {span} ns of slots", grants.len());
    }
}

#[test]
fn loom_leasing_threads_at_one_instant_never_pass_the_burst() {
    // A burst of 10: a first grant leaves 9 units of headroom, so it leases 2 more,
    // which its thread's next calls use up before it decides on the shared TAT again.
    drained(10, &[&[T, T, T, T], &[T, T]]);
}

#[test]
fn loom_leases_given_back_as_time_passes_keep_the_cap() {
    // Each thread's calls are spread over time, so leases end with slots begun unused,
    // teach their leads and are given back.
    drained(10, &[&[T, 5 * T, 5 * T], &[3 * T, 3 * T, 4 * T]]);
}

#[test]
fn loom_a_replace_racing_leases_never_over_admits() {
    model(|| {
        // A replace that keeps the limit: disabled (voiding every lease taken before),
        // then enabled again with the TAT it took back, as `replace_policy` does under the
        // set's locks (which lock-free acquisitions never take).
        let limit = Arc::new(fast(Quota::per_second(nz!(1_000_000)).burst(nz!(10))));
        let replacer = {
            let limit = limit.clone();
            thread::spawn(move || {
                let last = limit.disable().expect("enabled");
                limit.enable(&last, 2);
            })
        };
        let grants = run(&limit, &[&[T, T], &[T]]);
        replacer.join().unwrap();
        assert!(grants.len() <= 10, "{} grants at one instant, burst 10", grants.len());
        assert_slots_fit(&limit, &grants);
        assert_rate_cap(grants, T, 10 * T);
    });
}

/// Runs `calls` as [`run`] does and checks that the grants' slots fit, then takes every
/// unit left at the last instant any thread asked at (as a burst of requests would), and
/// checks the rate cap over all the grants: a slot handed out twice (a unit used twice, a
/// give-back that undid another thread's grant) shows as one grant too many.
fn drained(burst: u64, calls: &'static [&'static [u64]]) {
    model(move || {
        let limit = Arc::new(fast(Quota::per_second(nz!(1_000_000)).try_burst(burst).unwrap()));
        let mut grants = run(&limit, calls);
        assert_slots_fit(&limit, &grants);
        let end = calls.iter().flat_map(|c| c.iter()).copied().max().unwrap_or(T);
        for _ in 0..2 * burst {
            match limit.acquire(1, Instant::from_nanos(end)) {
                Some(Decision::Granted(at, _)) => grants.push(at.as_nanos()),
                _ => break,
            }
        }
        assert_rate_cap(grants, T, burst * T);
    });
}

#[test]
fn loom_a_give_back_racing_a_grant_never_hands_a_slot_out_twice() {
    // A burst of 5: each thread's first grant leases one unit. One thread's next call
    // finds its unit's slot begun and gives it back while the other grants: the give-back
    // must fail if the other moved the TAT first. (A give-back by plain store, after the
    // same check, fails both schedules.)
    drained(5, &[&[T, 3 * T], &[T, 2 * T]]);
    drained(5, &[&[T, 2 * T + 500], &[T, T]]);
}
