//! Laws 15, 16 and 17: the lock-free path of a set's one global rate limit, alone or
//! beside keyed limits, under real threads: every admission, by whichever thread and
//! path, respects the rate cap over every window, to the unit; a lone thread decides
//! exactly as the locked engine does; and the locked operations that borrow the state
//! (peek, settle, stats, policy changes) interleave with it without losing or inventing
//! capacity. Law numbers are those of `crates/tower-limits/docs/laws.md`.
//!
//! Time is explicit: each thread takes its instants from a shared counter that it
//! advances itself, so reads race as a real clock's would. No sleeps, no wall-clock
//! thresholds.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

use tower_limits_core::{AcquireError, Instant, LimitPolicy, LimitSet, LimitSetPolicy, Quota, SetError, TenantKey, nz};

const INTERVAL: u64 = 1_000; // ns: a million a second
const BURST: u64 = 50;

fn policy(burst: u64) -> LimitSetPolicy {
    LimitSetPolicy::new()
        .limit(LimitPolicy::gcra("r", Quota::per_second(nz!(1_000_000)).try_burst(burst).unwrap()).counting_cost())
}

/// One admission (`units > 0`) or refund (`units < 0`). Its decision was made at some
/// instant in `[from, to]`: the caller's clock read, raised at most to an instant another
/// thread read first (a stripe's latest, or the latest grant's when a contended refusal
/// is decided again), so never past the clock read just after the call.
#[derive(Debug, Clone, Copy)]
struct Event {
    from: u64,
    to: u64,
    units: i64,
}

impl Event {
    /// An event decided by a call that took `from` off `clock` and has returned.
    fn ended(from: u64, clock: &AtomicU64, units: i64) -> Self {
        Event { from, to: clock.load(Ordering::SeqCst), units }
    }
}

/// Every window `[a, b]` holds at most `(b - a) / T + burst` units admitted less units
/// refunded (a refund's credit counts at the instant it is made, whenever the grant it
/// belongs to was: it can give back a unit that time had already given back, so the cap
/// on grants alone would not hold).
///
/// The instants are known to intervals only, so the count is a lower bound of the true
/// one: an admission counts when its interval lies in the window, a refund subtracts
/// when its interval meets the window.
fn assert_cap(events: Vec<Event>, burst: u64) {
    let (mut grants, mut refunds): (Vec<Event>, Vec<Event>) = events.into_iter().partition(|e| e.units > 0);
    grants.sort_unstable_by_key(|e| e.from);
    refunds.sort_unstable_by_key(|e| e.from);
    let total: i64 = grants.iter().map(|e| e.units).sum();
    assert!(total > 1_000, "the run must admit plenty ({total})");
    let longest_refund = refunds.iter().map(|e| e.to - e.from).max().unwrap_or(0);
    for start in 0..grants.len() {
        // Windows from this admission's earliest instant, each to a later one's latest.
        let a = grants[start].from;
        let (mut b, mut in_window) = (a, 0i64);
        // Refunds that may meet the window, in order of their earliest instants.
        let mut next_refund = refunds.partition_point(|r| r.from + longest_refund < a);
        for g in &grants[start..] {
            b = b.max(g.to);
            in_window += g.units;
            while let Some(r) = refunds.get(next_refund).filter(|r| r.from <= b) {
                if r.to >= a {
                    in_window += r.units;
                }
                next_refund += 1;
            }
            let allowed = ((b - a) / INTERVAL + burst) as i64;
            assert!(in_window <= allowed, "{in_window} admitted less refunded in [{a}, {b}], at most {allowed}");
            if b - a > 4 * burst * INTERVAL {
                break; // far beyond the burst the bound only loosens
            }
        }
    }
}

/// What the locked path does meanwhile, over and over: 20,000 peeks at `key`'s limit
/// `limit` at the threads' latest instant, each within the burst, and every 100th a
/// replace by the same policy (a new generation, the state carried over).
fn borrow_over_and_over(
    set: &LimitSet,
    clock: &AtomicU64,
    key: &TenantKey,
    limit: usize,
    policy: impl Fn() -> LimitSetPolicy,
) {
    for n in 0..20_000u64 {
        let now = Instant::from_nanos(clock.load(Ordering::Relaxed));
        assert!(set.peek(key, now)[limit].snapshot.remaining <= BURST);
        if n % 100 == 0 {
            set.replace_policy(policy()).unwrap();
        }
    }
}

#[test]
fn threads_never_over_admit() {
    let set = LimitSet::new(policy(BURST)).unwrap();
    let clock = Arc::new(AtomicU64::new(1_000_000));
    let admitted = Arc::new(Mutex::new(Vec::new()));
    let global = TenantKey::global();
    thread::scope(|s| {
        for t in 0..4u64 {
            let (set, clock, admitted, global) = (&set, &clock, &admitted, &global);
            s.spawn(move || {
                let mut mine = Vec::new();
                for i in 0..40_000u64 {
                    // Time runs at about a third of the rate: most requests are refused.
                    let now = clock.fetch_add(if (i + t) % 3 == 0 { 1_000 } else { 0 }, Ordering::Relaxed);
                    let cost = 1 + (i * 7 + t) % 3;
                    match set.acquire(global, cost, Instant::from_nanos(now)) {
                        Ok(_permit) => mine.push(Event::ended(now, clock, cost as i64)),
                        Err(AcquireError::Refused(d)) => assert!(d.retry_after() > Duration::ZERO),
                        Err(e) => panic!("{e}"),
                    }
                }
                admitted.lock().unwrap().extend(mine);
            });
        }
        // Meanwhile the locked path borrows the state over and over.
        s.spawn(|| borrow_over_and_over(&set, &clock, &global, 0, || policy(BURST)));
    });
    let admitted = Arc::try_unwrap(admitted).unwrap().into_inner().unwrap();
    let stats = set.stats();
    assert_eq!(stats.admitted, admitted.len() as u64, "every admission is counted once");
    assert!(stats.limits[0].refused > 0);
    assert_cap(admitted, BURST);
}

/// Threads whose pace is far slower than the limit's interval lease ahead of the clock
/// (each lease begins past it by what the thread's last lease taught it): in the slow
/// phases demand is the rate and every thread asks once every 4 units of slots, so a
/// lease begun at the clock would be stale before its second unit; in the fast ones
/// demand is ten times the rate. Every window still holds no unit more than the law allows.
#[test]
fn leases_that_lead_the_clock_keep_the_cap() {
    let burst = 2_000;
    let set = LimitSet::new(policy(burst)).unwrap();
    let clock = AtomicU64::new(1_000_000);
    let admitted = Mutex::new(Vec::new());
    let global = TenantKey::global();
    thread::scope(|s| {
        for _ in 0..4u64 {
            let (set, clock, admitted, global) = (&set, &clock, &admitted, &global);
            s.spawn(move || {
                let mut mine = Vec::new();
                for i in 0..60_000u64 {
                    let step = if (i / 5_000) % 2 == 0 { 1_000 } else { 100 };
                    let now = clock.fetch_add(step, Ordering::Relaxed);
                    match set.check(global, 1, Instant::from_nanos(now)) {
                        Ok(()) => mine.push(Event::ended(now, clock, 1)),
                        Err(SetError::Refused(d)) => assert!(d.retry_after() > Duration::ZERO),
                        Err(e) => panic!("{e}"),
                    }
                }
                admitted.lock().unwrap().extend(mine);
            });
        }
    });
    let admitted = admitted.into_inner().unwrap();
    let stats = set.stats();
    assert_eq!(stats.admitted, admitted.len() as u64);
    assert!(stats.limits[0].refused > 0, "the fast phases reach the limit");
    assert_cap(admitted, burst);
}

/// A lone thread decides exactly as the locked engine: the same answers, the same waits,
/// step by step, against a twin that the lock-free path does not serve (a second limit,
/// which never binds, makes it a set of two).
#[test]
fn alone_it_decides_as_the_lock_does() {
    let fast = LimitSet::new(policy(5)).unwrap();
    let locked = LimitSet::new(
        policy(5).limit(LimitPolicy::gcra("never", Quota::per_second(nz!(1_000_000_000)).burst(nz!(1_000_000)))),
    )
    .unwrap();
    let global = TenantKey::global();
    let mut now = 10_000u64;
    let mut seed = 0x9e37_79b9_u64;
    for step in 0..20_000 {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        now += seed % 1_500;
        let cost = 1 + seed % 4;
        let at = Instant::from_nanos(now);
        let a = fast.acquire(&global, cost, at).map(|_| ()).map_err(|e| format!("{e:?}"));
        let b = locked.acquire(&global, cost, at).map(|_| ()).map_err(|e| format!("{e:?}"));
        assert_eq!(a, b, "step {step}");
        if step % 97 == 0 {
            // Settling and refunding borrow the state; both sets see the same.
            let mut g1 = fast.acquire_grant(&global, 1, at);
            let mut g2 = locked.acquire_grant(&global, 1, at);
            if let (Ok(g1), Ok(g2)) = (g1.as_mut(), g2.as_mut()) {
                fast.settle_grant(&global, g1, 3, at);
                locked.settle_grant(&global, g2, 3, at);
            }
            assert_eq!(fast.peek(&global, at)[0], locked.peek(&global, at)[0], "step {step}");
        }
    }
    let (a, b) = (fast.stats(), locked.stats());
    assert_eq!(a.admitted, b.admitted);
    assert_eq!(a.limits[0], b.limits[0]);
}

/// A policy change that renames the limit, or makes the set something else, takes the
/// state off the lock-free path; one that keeps it keeps its state.
#[test]
fn policy_changes_keep_or_move_the_state() {
    let set = LimitSet::new(policy(2)).unwrap();
    let global = TenantKey::global();
    let t = Instant::from_nanos(1_000_000);
    assert!(set.acquire(&global, 2, t).is_ok());
    assert!(set.acquire(&global, 1, t).is_err());
    set.replace_policy(policy(3)).unwrap();
    // The state survived (two spent of the new burst of three).
    assert!(set.acquire(&global, 1, t).is_ok());
    assert!(set.acquire(&global, 1, t).is_err());
    // Two limits: the locked engine takes over, with the state.
    set.replace_policy(policy(3).limit(LimitPolicy::semaphore("c", 10))).unwrap();
    assert!(set.acquire(&global, 1, t).is_err(), "the GCRA state came along");
    set.replace_policy(
        LimitSetPolicy::new().limit(LimitPolicy::gcra("renamed", Quota::per_second(nz!(1_000_000)).burst(nz!(3)))),
    )
    .unwrap();
    assert!(set.acquire(&global, 3, t).is_ok(), "a renamed limit starts fresh");
    let stats = set.stats();
    assert_eq!(stats.admitted, 3);
}

/// Threads released together at one instant share exactly the burst: never one more, in
/// any of many rounds (a lost update would admit twice from the same state).
#[test]
fn a_burst_is_shared_exactly() {
    const ROUND_BURST: u64 = 64;
    for round in 0..3_000u64 {
        let set = LimitSet::new(policy(ROUND_BURST)).unwrap();
        let start = std::sync::Barrier::new(4);
        let at = Instant::from_nanos(1_000_000 + round);
        let granted: u64 = thread::scope(|s| {
            let handles: Vec<_> = (0..4)
                .map(|_| {
                    let (set, start) = (&set, &start);
                    s.spawn(move || {
                        let global = TenantKey::global();
                        start.wait();
                        (0..ROUND_BURST).filter(|_| set.acquire(&global, 1, at).is_ok()).count() as u64
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).sum()
        });
        assert_eq!(granted, ROUND_BURST, "round {round}");
    }
}

/// A cost above the burst can never pass, on the lock-free path as on the locked one: it
/// is refused at once as such, never granted, and counted as impossible.
#[test]
fn a_cost_above_the_burst_is_never_granted() {
    let set = LimitSet::new(policy(5)).unwrap();
    let global = TenantKey::global();
    let at = Instant::from_nanos(1_000_000);
    for cost in [6, 7, u64::MAX] {
        match set.acquire(&global, cost, at) {
            Err(AcquireError::CostAboveCapacity(e)) => assert_eq!(e.capacity(), 5, "cost {cost}"),
            other => panic!("cost {cost}: {:?}", other.map(|_| ())),
        }
    }
    assert!(set.acquire(&global, 5, at).is_ok(), "nothing was charged");
    let stats = set.stats();
    assert_eq!((stats.admitted, stats.limits[0].cost_above_capacity), (1, 3));
}

/// A charge can move the limit's state to any instant, up to where time stops counting:
/// the lock-free path then refuses, cleanly and for as long as the charge says, whether
/// the state lands on an ordinary far instant or saturates at the end of time (584 years
/// of nanoseconds).
#[test]
fn a_charge_to_the_end_of_time_refuses_for_as_long_as_time_counts() {
    const YEAR: u64 = 365 * 86_400;
    // One unit a nanosecond: a charge of `n` units moves the state `n` nanoseconds.
    let set = LimitSet::new(
        LimitSetPolicy::new()
            .limit(LimitPolicy::gcra("r", Quota::per_second(nz!(1_000_000_000)).burst(nz!(10))).counting_cost()),
    )
    .unwrap();
    let key = TenantKey::global();
    let wait = |set: &LimitSet| match set.acquire_grant(&key, 1, Instant::ZERO) {
        Err(AcquireError::Refused(d)) => d.retry_after(),
        other => panic!("expected a refusal, got {other:?}"),
    };
    let mut grant = set.acquire_grant(&key, 1, Instant::ZERO).unwrap();
    // To 2^63 - 1 ns exactly: an instant like any other, 292 years out.
    set.settle_grant(&key, &mut grant, (1 << 63) - 1, Instant::ZERO);
    let far = wait(&set);
    assert!(far > Duration::from_secs(290 * YEAR) && far < Duration::from_secs(293 * YEAR), "{far:?}");
    // Past anything a u64 of nanoseconds holds: saturated, 584 years out.
    set.settle_grant(&key, &mut grant, u64::MAX, Instant::ZERO);
    let end = wait(&set);
    assert!(end > Duration::from_secs(580 * YEAR), "{end:?}");
}

/// The global token bucket of a set, beside per-tenant limits, in its atomic: threads on
/// tenants of their own (each tenant's limits far looser than the global one) admit no
/// unit more than the global bucket allows over any window, though no lock serializes
/// them; every grant and refusal is counted once; the tenants' semaphores all come back;
/// and replaces of the same policy, peeks and settles that refund interleave with them.
#[test]
fn beside_keyed_limits_threads_never_over_admit() {
    let policy = || {
        LimitSetPolicy::new()
            .tiers(["tenant"])
            .limit(LimitPolicy::gcra("each", Quota::per_second(nz!(1_000_000_000)).burst(nz!(1_000_000))).per("tenant"))
            .limit(
                LimitPolicy::token_bucket("everyone", Quota::per_second(nz!(1_000_000)).burst(nz!(BURST)))
                    .counting_cost(),
            )
            .limit(LimitPolicy::semaphore("concurrent", 1_000).per("tenant"))
    };
    let set = LimitSet::new(policy()).unwrap();
    let clock = AtomicU64::new(1_000_000);
    let admitted = Mutex::new(Vec::new());
    let refused = AtomicU64::new(0);
    thread::scope(|s| {
        for t in 0..4u64 {
            let (set, clock, admitted, refused) = (&set, &clock, &admitted, &refused);
            s.spawn(move || {
                let mut mine = Vec::new();
                for i in 0..40_000u64 {
                    let key = TenantKey::from_u64(t * 16 + i % 16);
                    // Time runs at about a third of the rate: most requests are refused.
                    let now = clock.fetch_add(if (i + t) % 3 == 0 { 1_000 } else { 0 }, Ordering::Relaxed);
                    let cost = 1 + (i * 7 + t) % 3;
                    match set.acquire_grant(&key, cost, Instant::from_nanos(now)) {
                        Ok(mut grant) => {
                            mine.push(Event::ended(now, clock, cost as i64));
                            if i % 50 == 0 {
                                // A settle to less refunds the difference, at the latest
                                // instant the set has seen.
                                set.settle_grant(&key, &mut grant, cost - 1, Instant::from_nanos(now));
                                mine.push(Event::ended(now, clock, -1));
                            }
                            set.release_grant(&key, grant);
                        }
                        Err(AcquireError::Refused(d)) => {
                            assert_eq!(d.limit(), "everyone");
                            assert!(d.retry_after() > Duration::ZERO);
                            refused.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(e) => panic!("{e}"),
                    }
                }
                admitted.lock().unwrap().extend(mine);
            });
        }
        // Meanwhile the locked path borrows the state over and over.
        s.spawn(|| borrow_over_and_over(&set, &clock, &TenantKey::from_u64(0), 1, policy));
    });
    let admitted = admitted.into_inner().unwrap();
    let stats = set.stats();
    assert_eq!(
        stats.admitted,
        admitted.iter().filter(|e| e.units > 0).count() as u64,
        "every admission is counted once"
    );
    assert_eq!(stats.limits[1].refused, refused.load(Ordering::Relaxed), "every refusal is counted once");
    assert!(stats.limits[1].refused > 0, "the global bucket binds");
    assert_eq!(stats.limits[2].held, 0, "every semaphore came back");
    assert_cap(admitted, BURST);
}
