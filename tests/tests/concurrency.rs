//! Law 6, concurrency, under real threads: OS threads hammer one `LimitSet` with
//! semaphores, and the number of permits held at once never exceeds a semaphore's
//! capacity; when every thread is done, nothing is held and every limit is back to full
//! (Law 5, conservation). Law numbers are those of `crates/tower-limits/docs/laws.md`.
//!
//! Time comes from a shared `ManualClock` that the threads advance themselves, so that
//! their reads race (the set raises a late reader's `now` to the latest it has seen).
//! There are no sleeps and no wall-clock thresholds: a thread that is refused yields
//! and tries again.

use std::sync::atomic::{AtomicU64, Ordering};
use std::thread;
use std::time::Duration;

use tower_limits_core::{
    AcquireError, Clock, LimitPolicy, LimitSet, LimitSetPolicy, ManualClock, Quota, TenantKey, nz,
};

const THREADS: usize = 4;
const PER_THREAD: u64 = 20_000;

/// Counts holders: incremented after a grant, decremented before the permit is dropped,
/// so it never counts more holders than the set does.
#[derive(Debug, Default)]
struct Gauge {
    now: AtomicU64,
    max: AtomicU64,
}

impl Gauge {
    fn enter(&self, amount: u64) -> u64 {
        let now = self.now.fetch_add(amount, Ordering::SeqCst) + amount;
        self.max.fetch_max(now, Ordering::SeqCst);
        now
    }

    fn leave(&self, amount: u64) {
        self.now.fetch_sub(amount, Ordering::SeqCst);
    }
}

/// Keeps the permit a little while, so that holders overlap.
fn hold_briefly(i: u64) {
    for _ in 0..(i % 64) {
        std::hint::spin_loop();
    }
}

#[test]
fn a_global_semaphore_never_admits_more_than_its_capacity() {
    const CAPACITY: u64 = 3;
    let set = LimitSet::new(
        LimitSetPolicy::new()
            .tiers(["tenant"])
            // A rate limit that never blocks: 80,000 grants fit in its burst.
            .limit(LimitPolicy::gcra("rate", Quota::per_second(nz!(1_000_000)).burst(nz!(1_000_000_000))).per("tenant"))
            .limit(LimitPolicy::semaphore("concurrent", CAPACITY)),
    )
    .unwrap();
    let clock = ManualClock::new();
    let gauge = Gauge::default();
    let refused = AtomicU64::new(0);
    thread::scope(|s| {
        for t in 0..THREADS {
            let (set, clock, gauge, refused) = (&set, &clock, &gauge, &refused);
            s.spawn(move || {
                let key = TenantKey::single(format!("tenant-{}", t % 2)).unwrap();
                let mut granted = 0;
                while granted < PER_THREAD {
                    clock.advance_nanos(1);
                    match set.acquire(&key, 1, clock.now()) {
                        Ok(permit) => {
                            let holders = gauge.enter(1);
                            assert!(holders <= CAPACITY, "{holders} holders of {CAPACITY} slots");
                            hold_briefly(granted);
                            gauge.leave(1);
                            drop(permit);
                            granted += 1;
                        }
                        Err(AcquireError::Refused(d)) => {
                            assert_eq!(d.limit(), "concurrent");
                            assert!(d.needs_release());
                            assert_eq!(d.retry_after(), Duration::ZERO);
                            refused.fetch_add(1, Ordering::Relaxed);
                            thread::yield_now();
                        }
                        Err(e) => panic!("unexpected: {e}"),
                    }
                }
            });
        }
    });
    let max = gauge.max.load(Ordering::SeqCst);
    assert!(max <= CAPACITY, "{max} holders at once");
    let stats = set.stats();
    assert_eq!(stats.admitted, THREADS as u64 * PER_THREAD);
    assert_eq!(stats.limits[1].held, 0);
    assert_eq!(stats.limits[1].refused, refused.load(Ordering::Relaxed));
}

/// Weighted permits against a per-tenant semaphore and a global one, with settles and
/// cancellations mixed in: per tenant and overall, the weight held never exceeds the
/// capacity, and everything comes back.
#[test]
fn weighted_semaphores_hold_under_threads() {
    const PER_TENANT: u64 = 5;
    const GLOBAL: u64 = 7;
    let set = LimitSet::new(
        LimitSetPolicy::new()
            .tiers(["tenant"])
            .limit(
                LimitPolicy::token_bucket("tokens", Quota::per_second(nz!(1_000_000)).burst(nz!(1_000_000_000)))
                    .counting_cost(),
            )
            .limit(LimitPolicy::semaphore("per-tenant", PER_TENANT).per("tenant").counting_cost())
            .limit(LimitPolicy::semaphore("global", GLOBAL).counting_cost()),
    )
    .unwrap();
    let clock = ManualClock::new();
    let tenants = [Gauge::default(), Gauge::default()];
    let global = Gauge::default();
    thread::scope(|s| {
        for t in 0..THREADS {
            let (set, clock, tenants, global) = (&set, &clock, &tenants, &global);
            s.spawn(move || {
                let tenant = t % 2;
                let key = TenantKey::single(format!("tenant-{tenant}")).unwrap();
                let mut granted = 0u64;
                let mut i = t as u64;
                while granted < PER_THREAD {
                    i += 1;
                    let cost = 1 + i % 3;
                    clock.advance_nanos(1);
                    match set.acquire(&key, cost, clock.now()) {
                        Ok(mut permit) => {
                            assert!(tenants[tenant].enter(cost) <= PER_TENANT);
                            assert!(global.enter(cost) <= GLOBAL);
                            hold_briefly(i);
                            global.leave(cost);
                            tenants[tenant].leave(cost);
                            match i % 3 {
                                0 => permit.settle(cost * 2, clock.now()),
                                1 => permit.settle(0, clock.now()),
                                _ => {}
                            }
                            if i % 5 == 0 {
                                permit.cancel(clock.now());
                            } else {
                                drop(permit);
                            }
                            granted += 1;
                        }
                        Err(AcquireError::Refused(d)) => {
                            assert!(d.needs_release(), "{d}");
                            thread::yield_now();
                        }
                        Err(e) => panic!("unexpected: {e}"),
                    }
                }
            });
        }
    });
    assert!(tenants.iter().all(|g| g.max.load(Ordering::SeqCst) <= PER_TENANT));
    assert!(global.max.load(Ordering::SeqCst) <= GLOBAL);
    let stats = set.stats();
    assert_eq!(stats.admitted, THREADS as u64 * PER_THREAD);
    assert_eq!(stats.limits[1].held, 0);
    assert_eq!(stats.limits[2].held, 0);
    clock.advance(Duration::from_secs(3600));
    for tenant in ["tenant-0", "tenant-1"] {
        for snap in set.peek(&TenantKey::single(tenant).unwrap(), clock.now()) {
            assert_eq!(snap.snapshot.remaining, snap.snapshot.quota, "{snap:?}");
        }
    }
}

/// Per-tenant semaphores alone, whose grants keep the place of their tenant's state for
/// the release: threads hold and release permits of a few busy tenants while new tenants
/// keep arriving, so that the tables grow and move the states under permits being held.
/// No busy tenant ever has more holders than its capacity, and everything comes back.
#[test]
fn per_tenant_semaphores_hold_while_their_tables_grow() {
    const CAPACITY: u64 = 2;
    const BUSY: usize = 4;
    // Refusals a thread may see in all before the test calls the permits lost (a
    // legitimate run sees a few thousand at most): a failure, never a hang.
    const PATIENCE: u64 = 5_000_000;
    let set = LimitSet::new(
        LimitSetPolicy::new()
            .tiers(["tenant"])
            .max_keys(1_000_000)
            .limit(LimitPolicy::gcra("rate", Quota::per_second(nz!(1_000_000)).burst(nz!(1_000_000_000))).per("tenant"))
            .limit(LimitPolicy::semaphore("concurrent", CAPACITY).per("tenant")),
    )
    .unwrap();
    let clock = ManualClock::new();
    let busy: Vec<TenantKey> = (0..BUSY).map(|i| TenantKey::single(format!("busy-{i}")).unwrap()).collect();
    let gauges: Vec<Gauge> = (0..BUSY).map(|_| Gauge::default()).collect();
    thread::scope(|s| {
        for t in 0..THREADS {
            let (set, clock, busy, gauges) = (&set, &clock, &busy, &gauges);
            s.spawn(move || {
                let (mut granted, mut refused, mut i) = (0u64, 0u64, t as u64);
                while granted < PER_THREAD {
                    i += 1;
                    clock.advance_nanos(1);
                    if i % 4 == 0 {
                        // A new tenant: its states grow the tables.
                        let newcomer = TenantKey::single(format!("new-{t}-{i}")).unwrap();
                        drop(set.acquire(&newcomer, 1, clock.now()).unwrap());
                    }
                    let b = (i % BUSY as u64) as usize;
                    match set.acquire(&busy[b], 1, clock.now()) {
                        Ok(permit) => {
                            let holders = gauges[b].enter(1);
                            assert!(holders <= CAPACITY, "{holders} holders of {CAPACITY} slots");
                            hold_briefly(i);
                            gauges[b].leave(1);
                            drop(permit);
                            granted += 1;
                        }
                        Err(AcquireError::Refused(d)) => {
                            assert!(d.needs_release(), "{d}");
                            refused += 1;
                            assert!(refused < PATIENCE, "busy-{b}'s permits never came back");
                            thread::yield_now();
                        }
                        Err(e) => panic!("unexpected: {e}"),
                    }
                }
            });
        }
    });
    assert!(gauges.iter().all(|g| g.max.load(Ordering::SeqCst) <= CAPACITY));
    let stats = set.stats();
    assert_eq!(stats.limits[1].held, 0);
    assert!(stats.limits[1].tracked_keys > BUSY + 10_000, "the tables grew: {}", stats.limits[1].tracked_keys);
    for key in &busy {
        assert_eq!(set.peek(key, clock.now())[1].snapshot.remaining, CAPACITY, "{key:?}");
    }
}
