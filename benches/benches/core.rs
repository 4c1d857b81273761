//! The core against governor, in one run: single-limit allow and deny paths, keyed
//! acquisition over 1, 1,000 and 100,000 keys, a three-limit atomic acquisition, and two
//! threads sharing one limit.
//!
//! Run: `cargo bench -p tower-limits-benches --bench core`.

use std::hint::black_box;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use governor::{Quota, RateLimiter};
use tower_limits_benches::open_keyed_set;
use tower_limits_core::{Clock, LimitPolicy, LimitSet, LimitSetPolicy, Rate, SystemClock, TenantKey};

const HUGE: u32 = 1_000_000_000;

fn nz(n: u32) -> NonZeroU32 {
    NonZeroU32::new(n).expect("non-zero")
}

fn single(c: &mut Criterion) {
    let mut g = c.benchmark_group("single_gcra");
    let clock = SystemClock::new();
    let global = TenantKey::global();

    let open = LimitSet::new(LimitSetPolicy::new().limit(LimitPolicy::gcra(
        "r",
        Rate::per_second(u64::from(HUGE)),
        1_000_000,
    )))
    .expect("policy");
    g.bench_function("tower_limits/allow", |b| {
        b.iter(|| black_box(open.acquire(&global, 1, clock.now()).is_ok()));
    });
    let gov_open = RateLimiter::direct(Quota::per_second(nz(HUGE)).allow_burst(nz(1_000_000)));
    g.bench_function("governor/allow", |b| b.iter(|| black_box(gov_open.check().is_ok())));

    let shut =
        LimitSet::new(LimitSetPolicy::new().limit(LimitPolicy::gcra("r", Rate::per_hour(1), 1))).expect("policy");
    let _first = shut.acquire(&global, 1, clock.now()).expect("first passes");
    g.bench_function("tower_limits/deny", |b| {
        b.iter(|| black_box(shut.acquire(&global, 1, clock.now()).is_err()));
    });
    let gov_shut = RateLimiter::direct(Quota::per_hour(nz(1)));
    let _ = gov_shut.check();
    g.bench_function("governor/deny", |b| b.iter(|| black_box(gov_shut.check().is_err())));
    g.finish();
}

fn keyed(c: &mut Criterion) {
    let mut g = c.benchmark_group("keyed_gcra");
    let clock = SystemClock::new();
    for n in [1usize, 1_000, 100_000] {
        let names: Vec<String> = (0..n).map(|i| format!("tenant-{i:06}")).collect();
        let keys: Vec<TenantKey> = names.iter().map(|s| TenantKey::single(s).expect("key")).collect();
        let ours = open_keyed_set();
        let theirs = RateLimiter::keyed(Quota::per_second(nz(HUGE)).allow_burst(nz(1_000_000)));
        for (k, s) in keys.iter().zip(&names) {
            let _ = ours.acquire(k, 1, clock.now());
            let _ = theirs.check_key(s);
        }
        let mut i = 0usize;
        g.bench_with_input(BenchmarkId::new("tower_limits", n), &n, |b, _| {
            b.iter(|| {
                i = (i + 7919) % n;
                black_box(ours.acquire(&keys[i], 1, clock.now()).is_ok())
            });
        });
        let mut i = 0usize;
        g.bench_with_input(BenchmarkId::new("governor", n), &n, |b, _| {
            b.iter(|| {
                i = (i + 7919) % n;
                black_box(theirs.check_key(&names[i]).is_ok())
            });
        });
    }
    g.finish();
}

fn three_limits(c: &mut Criterion) {
    let mut g = c.benchmark_group("limit_set");
    let clock = SystemClock::new();
    let set = LimitSet::new(
        LimitSetPolicy::new()
            .tiers(["tenant"])
            .limit(LimitPolicy::gcra("requests", Rate::per_second(u64::from(HUGE)), 1_000_000).per("tenant"))
            .limit(LimitPolicy::token_bucket("tokens", Rate::per_second(u64::from(HUGE)), 1_000_000).counting_cost())
            .limit(LimitPolicy::semaphore("concurrent", 64).per("tenant")),
    )
    .expect("policy");
    let key = TenantKey::single("acme").expect("key");
    g.bench_function("tower_limits/three_limits_acquire_release", |b| {
        b.iter(|| {
            let permit = set.acquire(&key, 10, clock.now()).expect("granted");
            drop(black_box(permit));
        });
    });
    let gov = RateLimiter::direct(Quota::per_second(nz(HUGE)).allow_burst(nz(1_000_000)));
    g.bench_function("governor/single_check", |b| b.iter(|| black_box(gov.check().is_ok())));
    g.finish();
}

fn contended(c: &mut Criterion) {
    let mut g = c.benchmark_group("contended");
    let clock = SystemClock::new();
    let global = TenantKey::global();
    let ours = LimitSet::new(LimitSetPolicy::new().limit(LimitPolicy::gcra(
        "r",
        Rate::per_second(u64::from(HUGE)),
        1_000_000,
    )))
    .expect("policy");
    let theirs = Arc::new(RateLimiter::direct(Quota::per_second(nz(HUGE)).allow_burst(nz(1_000_000))));
    for threads in [1usize, 2] {
        let (set, key, clock) = (ours.clone(), global.clone(), clock.clone());
        let op: Arc<dyn Fn() + Send + Sync> = Arc::new(move || {
            black_box(set.acquire(&key, 1, clock.now()).is_ok());
        });
        g.bench_function(BenchmarkId::new("tower_limits", threads), |b| {
            b.iter_custom(|iters| {
                tower_limits_benches::on_threads(threads, iters.div_ceil(threads as u64), op.clone())
            });
        });
        let gov = theirs.clone();
        let op: Arc<dyn Fn() + Send + Sync> = Arc::new(move || {
            black_box(gov.check().is_ok());
        });
        g.bench_function(BenchmarkId::new("governor", threads), |b| {
            b.iter_custom(|iters| {
                tower_limits_benches::on_threads(threads, iters.div_ceil(threads as u64), op.clone())
            });
        });
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().warm_up_time(Duration::from_millis(500)).measurement_time(Duration::from_secs(2));
    targets = single, keyed, three_limits, contended
}
criterion_main!(benches);
