//! Law 19, same semantics on every backend: the laws, written once over the `Backend`
//! seam, run against the in-memory `LimitSet` and against Redis (Laws 1 to 5 here; the
//! numbers are those of `crates/tower-limits/docs/laws.md`).
//!
//! Redis runs with the test clock (`manual_clock`): its scripts take `now` from the call
//! instead of the server's `TIME`, so both backends see the same instants to the
//! nanosecond and the laws can demand exact answers. The production clock is exercised in
//! `redis_backend.rs` and the fleet and fault tests.

mod redis_common;

use std::future::Future;
use std::time::Duration;

use tower_limits_core::algorithm::CalendarPeriod;
use tower_limits_core::{
    AcquireError, Backend, Instant, LimitPolicy, LimitSet, LimitSetPolicy, Quota, Refusal, TenantKey, nz,
};
use tower_limits_redis::test_support::redis_for;
use tower_limits_redis::{RedisBackend, RedisConnection};
use tower_limits_tests::{Rng, describe, quota};

const MS: u64 = 1_000_000;
const S: u64 = 1_000_000_000;

/// A backend under test.
trait Harness {
    type B: Backend;
    fn name(&self) -> &'static str;
    fn make(&self, policy: LimitSetPolicy) -> Self::B;
    /// Waits until settles, releases and cancels sent so far are applied.
    fn flush(&self, backend: &Self::B) -> impl Future<Output = ()>;
}

struct Memory;

impl Harness for Memory {
    type B = LimitSet;
    fn name(&self) -> &'static str {
        "memory"
    }
    fn make(&self, policy: LimitSetPolicy) -> LimitSet {
        LimitSet::new(policy).unwrap()
    }
    async fn flush(&self, _: &LimitSet) {}
}

struct Redis {
    conn: RedisConnection,
    refusal_cache: bool,
}

impl Harness for Redis {
    type B = RedisBackend;
    fn name(&self) -> &'static str {
        if self.refusal_cache { "redis" } else { "redis without refusal cache" }
    }
    fn make(&self, policy: LimitSetPolicy) -> RedisBackend {
        let builder = redis_common::manual(policy, "conformance");
        let builder = if self.refusal_cache { builder } else { builder.refusal_cache(0) };
        builder.build(&self.conn).unwrap()
    }
    async fn flush(&self, backend: &RedisBackend) {
        backend.flush().await;
    }
}

fn at(nanos: u64) -> Instant {
    Instant::from_nanos(nanos)
}

fn outcome<G>(r: &Result<G, AcquireError>) -> String {
    match r {
        Ok(_) => "granted".to_owned(),
        Err(e) => describe(e),
    }
}

/// (limit, retry, needs release): what the laws compare of a refusal.
fn refusal<G>(r: &Result<G, AcquireError>) -> Option<(usize, Duration, bool)> {
    match r {
        Err(AcquireError::Refused(d)) => Some((d.limit_index(), d.retry_after(), d.needs_release())),
        _ => None,
    }
}

fn global() -> TenantKey {
    TenantKey::global()
}

/// Law 1, rate cap: over every window of length T, admitted cost <= what the algorithm
/// allows (rate * T + burst for GCRA and the token bucket, the limit per window for the
/// log, twice that across a boundary for the fixed window, below twice for the counter).
async fn rate_cap<H: Harness>(h: &H) {
    struct Case {
        policy: LimitPolicy,
        /// Window lengths to check, with the most admitted cost in each.
        bounds: Vec<(u64, u64)>,
        step: u64,
    }
    let interval = 100 * MS; // 10/s
    let gcra_bounds = |burst: u64| {
        [interval, 5 * interval, 2 * S, 7 * S].into_iter().map(|t| (t, burst + t / interval)).collect::<Vec<_>>()
    };
    let cases = [
        Case {
            policy: LimitPolicy::gcra("r", Quota::per_second(nz!(10)).burst(nz!(5))).counting_cost(),
            bounds: gcra_bounds(5),
            step: 60 * MS,
        },
        Case {
            policy: LimitPolicy::token_bucket("r", Quota::per_second(nz!(10)).burst(nz!(5))).counting_cost(),
            bounds: gcra_bounds(5),
            step: 60 * MS,
        },
        Case {
            policy: LimitPolicy::sliding_window_log("r", 6, Duration::from_secs(1)).counting_cost(),
            bounds: vec![(S, 6)],
            step: 90 * MS,
        },
        Case {
            policy: LimitPolicy::fixed_window("r", 6, Duration::from_secs(1)).counting_cost(),
            bounds: vec![(S, 12)],
            step: 90 * MS,
        },
        Case {
            policy: LimitPolicy::sliding_window_counter("r", 6, Duration::from_secs(1)).counting_cost(),
            bounds: vec![(S, 11), (3 * S, 6 * 5)],
            step: 90 * MS,
        },
    ];
    for (n, case) in cases.iter().enumerate() {
        for seed in 1..=3u64 {
            let backend = h.make(LimitSetPolicy::new().limit(case.policy.clone()));
            let mut rng = Rng(seed * 7919 + n as u64);
            let mut now = 5 * S + rng.below(S);
            let mut granted: Vec<(u64, u64)> = Vec::new();
            let mut refused = 0;
            for _ in 0..250 {
                now += rng.below(case.step);
                let cost = rng.range(1, 3);
                match backend.acquire(&global(), cost, at(now)).await {
                    Ok(g) => {
                        granted.push((now, cost));
                        backend.release(&global(), g);
                    }
                    Err(AcquireError::Refused(_)) => refused += 1,
                    Err(e) => panic!("{}: {e}", h.name()),
                }
            }
            assert!(refused > 10 && granted.len() > 10, "{}: case {n} does not exercise the limit", h.name());
            for &(span, bound) in &case.bounds {
                for &(t0, _) in &granted {
                    let sum: u64 = granted.iter().filter(|(t, _)| *t >= t0 && *t < t0 + span).map(|(_, c)| c).sum();
                    assert!(
                        sum <= bound,
                        "{}: case {n}: {sum} admitted in {span}ns from {t0}, bound {bound}",
                        h.name()
                    );
                }
            }
        }
    }
}

/// Law 2: GCRA and the token bucket with the same parameters decide the same way.
async fn gcra_is_token_bucket<H: Harness>(h: &H) {
    let gcra = h.make(
        LimitSetPolicy::new().limit(LimitPolicy::gcra("r", Quota::per_second(nz!(3)).burst(nz!(4))).counting_cost()),
    );
    let bucket = h.make(
        LimitSetPolicy::new()
            .limit(LimitPolicy::token_bucket("r", Quota::per_second(nz!(3)).burst(nz!(4))).counting_cost()),
    );
    let mut rng = Rng(42);
    let mut now = S;
    for _ in 0..200 {
        now += rng.below(400 * MS);
        let cost = rng.range(1, 4);
        let a = gcra.acquire(&global(), cost, at(now)).await;
        let b = bucket.acquire(&global(), cost, at(now)).await;
        assert_eq!(outcome(&a), outcome(&b), "{} at {now}", h.name());
        if let (Ok(a), Ok(b)) = (a, b) {
            gcra.release(&global(), a);
            bucket.release(&global(), b);
        }
    }
}

fn exact_policies() -> Vec<LimitSetPolicy> {
    let one = |l: LimitPolicy| LimitSetPolicy::new().limit(l.counting_cost());
    vec![
        one(LimitPolicy::gcra("r", Quota::per_second(nz!(3)).burst(nz!(2)))),
        one(LimitPolicy::token_bucket("r", quota(7, Duration::from_millis(1300), 3))),
        one(LimitPolicy::sliding_window_log("r", 4, Duration::from_millis(900))),
        one(LimitPolicy::fixed_window("r", 4, Duration::from_millis(700))),
        one(LimitPolicy::sliding_window_counter("r", 5, Duration::from_millis(800))),
        LimitSetPolicy::new()
            .tiers(["org", "user"])
            .limit(LimitPolicy::gcra("requests", Quota::per_second(nz!(4)).burst(nz!(3))).per("user"))
            .limit(
                LimitPolicy::token_bucket("tokens", Quota::per_second(nz!(5)).burst(nz!(4))).per("org").counting_cost(),
            )
            .limit(LimitPolicy::sliding_window_counter("window", 6, Duration::from_millis(1500)).counting_cost()),
    ]
}

/// Law 3, exact `retry_after`: a refused request passes at exactly `now + retry_after`, and not
/// one nanosecond earlier (nothing else happening in between).
async fn exact_retry_after<H: Harness>(h: &H) {
    let key = TenantKey::new(["acme", "alice"]).unwrap();
    for (n, policy) in exact_policies().into_iter().enumerate() {
        let backend = h.make(policy);
        let mut rng = Rng(1000 + n as u64);
        let mut now = 3 * S + rng.below(S);
        let mut checked = 0;
        for _ in 0..120 {
            let cost = rng.range(1, 2);
            match backend.acquire(&key, cost, at(now)).await {
                Ok(_) => now += rng.below(150 * MS),
                Err(AcquireError::Refused(d)) => {
                    let wait = u64::try_from(d.retry_after().as_nanos()).unwrap();
                    assert!(wait > 0 && !d.needs_release(), "{}: {d:?}", h.name());
                    let early = backend.acquire(&key, cost, at(now + wait - 1)).await;
                    assert!(
                        matches!(&early, Err(AcquireError::Refused(e)) if e.retry_after() == Duration::from_nanos(1)),
                        "{}: policy {n}: 1ns before the retry: {}",
                        h.name(),
                        outcome(&early)
                    );
                    now += wait;
                    let on_time = backend.acquire(&key, cost, at(now)).await;
                    assert!(on_time.is_ok(), "{}: policy {n}: at the retry: {}", h.name(), outcome(&on_time));
                    checked += 1;
                }
                Err(e) => panic!("{}: {e}", h.name()),
            }
        }
        assert!(checked > 10, "{}: policy {n}: only {checked} refusals", h.name());
    }
}

fn mixed_policy() -> LimitSetPolicy {
    LimitSetPolicy::new()
        .tiers(["org", "user"])
        .limit(LimitPolicy::gcra("requests", Quota::per_second(nz!(5)).burst(nz!(3))).per("user"))
        .limit(
            LimitPolicy::token_bucket("tokens", Quota::per_second(nz!(100)).burst(nz!(50))).per("org").counting_cost(),
        )
        .limit(LimitPolicy::semaphore("concurrent", 3).per("org"))
        .limit(LimitPolicy::sliding_window_log("log", 20, Duration::from_secs(2)))
        .limit(LimitPolicy::sliding_window_counter("counter", 40, Duration::from_secs(1)).per("user").counting_cost())
        .limit(LimitPolicy::fixed_window("fixed", 10, Duration::from_millis(500)).per("org"))
        .limit(LimitPolicy::semaphore("weight", 45).per("user").counting_cost())
}

fn tenants() -> Vec<TenantKey> {
    [["acme", "alice"], ["acme", "bob"], ["globex", "carol"], ["globex", "dave"]]
        .iter()
        .map(|p| TenantKey::new(*p).unwrap())
        .collect()
}

#[derive(Debug, Clone, Copy)]
enum Step {
    Acquire { key: usize, cost: u64 },
    Settle { held: u64, actual: u64 },
    Release { held: u64 },
    Cancel { held: u64 },
    Advance(u64),
}

fn program(seed: u64, len: usize) -> Vec<Step> {
    program_of(seed, len, 20, 30, 300 * MS)
}

/// `len` random steps: costs below `cost`, settles below `actual`, clock steps below
/// `advance` nanoseconds.
fn program_of(seed: u64, len: usize, cost: u64, actual: u64, advance: u64) -> Vec<Step> {
    let mut rng = Rng(seed);
    (0..len)
        .map(|_| match rng.below(10) {
            0..=3 => Step::Acquire { key: rng.below(4) as usize, cost: rng.range(0, cost) },
            4 => Step::Settle { held: rng.next_u64(), actual: rng.range(0, actual) },
            5 | 6 => Step::Release { held: rng.next_u64() },
            7 => Step::Cancel { held: rng.next_u64() },
            _ => Step::Advance(rng.below(advance)),
        })
        .collect()
}

/// Runs a program; answers the outcome of every step, and what is still held.
async fn run<H: Harness>(h: &H, backend: &H::B, steps: &[Step], skip: &[usize]) -> (Vec<String>, u64) {
    let keys = tenants();
    let mut held: Vec<(usize, <H::B as Backend>::Grant)> = Vec::new();
    let mut now = 10 * S;
    let mut out = Vec::with_capacity(steps.len());
    for (i, step) in steps.iter().enumerate() {
        if skip.contains(&i) {
            out.push("skipped".to_owned());
            continue;
        }
        let line = match *step {
            Step::Acquire { key, cost } => {
                let r = backend.acquire(&keys[key], cost, at(now)).await;
                let line = outcome(&r);
                if let Ok(g) = r {
                    held.push((key, g));
                }
                line
            }
            Step::Settle { held: pick, actual } if !held.is_empty() => {
                let n = held.len();
                let (key, g) = &mut held[(pick % n as u64) as usize];
                backend.settle(&keys[*key], g, actual, at(now));
                h.flush(backend).await;
                "settled".to_owned()
            }
            Step::Release { held: pick } if !held.is_empty() => {
                let n = held.len();
                let (key, g) = held.swap_remove((pick % n as u64) as usize);
                backend.release(&keys[key], g);
                h.flush(backend).await;
                "released".to_owned()
            }
            Step::Cancel { held: pick } if !held.is_empty() => {
                let n = held.len();
                let (key, g) = held.swap_remove((pick % n as u64) as usize);
                backend.cancel(&keys[key], g, at(now));
                h.flush(backend).await;
                "cancelled".to_owned()
            }
            Step::Advance(d) => {
                now += d;
                "advanced".to_owned()
            }
            _ => "nothing held".to_owned(),
        };
        out.push(line);
    }
    let still = held.len() as u64;
    for (key, g) in held {
        backend.release(&keys[key], g);
    }
    h.flush(backend).await;
    (out, still)
}

/// Law 4, atomicity: a refused acquisition changes no limit's state. The same program is
/// run twice, the second time without the acquisitions the first run refused: every other
/// step must answer the same.
async fn atomicity<H: Harness>(h: &H) {
    for seed in 1..=4u64 {
        let steps = program(seed * 31, 250);
        let (first, _) = run(h, &h.make(mixed_policy()), &steps, &[]).await;
        let refused: Vec<usize> = (0..steps.len()).filter(|&i| first[i].starts_with("refused")).collect();
        assert!(refused.len() > 10, "{}: seed {seed}: only {} refusals", h.name(), refused.len());
        let (second, _) = run(h, &h.make(mixed_policy()), &steps, &refused).await;
        for i in (0..steps.len()).filter(|i| !refused.contains(i)) {
            assert_eq!(first[i], second[i], "{}: seed {seed}, step {i} ({:?})", h.name(), steps[i]);
        }
    }
}

/// Law 5, conservation: after any interleaving of grants, settles, releases and
/// cancellations, all capacity comes back.
async fn conservation<H: Harness>(h: &H) {
    for seed in 1..=3u64 {
        let backend = h.make(mixed_policy());
        let steps = program(seed * 131, 300);
        run(h, &backend, &steps, &[]).await;
        // An hour later every rate limit is full again, and no permit is held.
        let late = 10 * S + 3600 * S;
        let alice = TenantKey::new(["acme", "alice"]).unwrap();
        let full = backend.acquire(&alice, 40, at(late)).await;
        assert!(full.is_ok(), "{}: {}", h.name(), outcome(&full));
        let bob = TenantKey::new(["acme", "bob"]).unwrap();
        let second = backend.acquire(&bob, 0, at(late)).await;
        let third = backend.acquire(&bob, 0, at(late)).await;
        assert!(second.is_ok() && third.is_ok(), "{}: the semaphore leaked", h.name());
        let fourth = backend.acquire(&bob, 0, at(late)).await;
        assert_eq!(refusal(&fourth).map(|r| (r.0, r.2)), Some((2, true)), "{}: {}", h.name(), outcome(&fourth));
        for g in [full, second, third].into_iter().flatten() {
            backend.cancel(&alice, g, at(late));
        }
        h.flush(&backend).await;
    }
}

/// Law 19 itself: the same program on two backends answers the same at every step, down
/// to the snapshots.
async fn same_answers<A: Harness, B: Harness>(a: &A, b: &B) {
    for seed in 1..=4u64 {
        let steps = program(seed * 977, 300);
        let (x, _) = run(a, &a.make(mixed_policy()), &steps, &[]).await;
        let (y, _) = run(b, &b.make(mixed_policy()), &steps, &[]).await;
        for i in 0..steps.len() {
            assert_eq!(x[i], y[i], "{} and {} differ at step {i} ({:?}), seed {seed}", a.name(), b.name(), steps[i]);
        }
    }
    // The single-limit paths too.
    for (n, policy) in exact_policies().into_iter().enumerate() {
        let (ba, bb) = (a.make(policy.clone()), b.make(policy));
        let key = TenantKey::new(["acme", "alice"]).unwrap();
        let mut rng = Rng(5 + n as u64);
        let mut now = S;
        for step in 0..200 {
            now += rng.below(200 * MS);
            let cost = rng.range(0, 5);
            let (x, y) = (ba.acquire(&key, cost, at(now)).await, bb.acquire(&key, cost, at(now)).await);
            assert_eq!(outcome(&x), outcome(&y), "policy {n}, step {step}");
            if let (Ok(x), Ok(y)) = (x, y) {
                if rng.below(4) == 0 {
                    ba.cancel(&key, x, at(now));
                    bb.cancel(&key, y, at(now));
                    b.flush(&bb).await;
                } else {
                    ba.release(&key, x);
                    bb.release(&key, y);
                }
            }
        }
    }
}

/// A budget per org and UTC day (law 32) beside a semaphore, on a clock whose origin
/// puts midnight a minute into the program: grants, settles, releases and cancels across
/// the day's end.
fn calendar_policy() -> LimitSetPolicy {
    // 2026-11-27 23:58:50 UTC: the program starts at 10 s, a minute before midnight.
    let origin = std::time::SystemTime::UNIX_EPOCH + Duration::from_secs(1_795_823_930);
    LimitSetPolicy::new()
        .tiers(["org", "user"])
        .limit(
            LimitPolicy::calendar_window("budget", 30, CalendarPeriod::Day, "UTC")
                .per("org")
                .counting_cost()
                .with_clock_origin(origin),
        )
        .limit(LimitPolicy::semaphore("concurrent", 3).per("user"))
}

/// Law 19 for calendar windows: the same answers, waits to midnight and snapshots on
/// both backends, before and after the day's end.
async fn calendar_answers_alike<A: Harness, B: Harness>(a: &A, b: &B) {
    for seed in 1..=3u64 {
        let steps = program_of(seed * 389, 300, 12, 16, 4 * S);
        let (x, _) = run(a, &a.make(calendar_policy()), &steps, &[]).await;
        let (y, _) = run(b, &b.make(calendar_policy()), &steps, &[]).await;
        assert!(
            x.iter().filter(|l| l.contains("\"budget\"")).count() > 5,
            "seed {seed}: the budget refused too little"
        );
        for i in 0..steps.len() {
            assert_eq!(x[i], y[i], "{} and {} differ at step {i} ({:?}), seed {seed}", a.name(), b.name(), steps[i]);
        }
        let advanced: u64 = steps.iter().map(|s| if let Step::Advance(d) = s { *d } else { 0 }).sum();
        assert!(advanced > 60 * S, "seed {seed}: the program never reached midnight");
    }
}

/// Law 32 on a backend: a grant of a day that ended, settled or cancelled in the next
/// day, changes nothing of the new day's budget.
async fn calendar_settles_stay_in_their_day<H: Harness>(h: &H) {
    let backend = h.make(calendar_policy());
    let alice = TenantKey::new(["acme", "alice"]).unwrap();
    let bob = TenantKey::new(["acme", "bob"]).unwrap();
    let mut old = backend.acquire(&alice, 20, at(10 * S)).await.unwrap();
    let spare = backend.acquire(&alice, 5, at(10 * S)).await.unwrap();
    let midnight = 70 * S;
    let r = backend.acquire(&bob, 11, at(midnight - 1)).await;
    assert_eq!(refusal(&r).map(|r| r.1), Some(Duration::from_nanos(1)), "{}: {}", h.name(), outcome(&r));
    let new = backend.acquire(&bob, 10, at(midnight)).await.unwrap();
    backend.settle(&alice, &mut old, 0, at(midnight + S));
    backend.cancel(&alice, spare, at(midnight + S));
    h.flush(&backend).await;
    let r = backend.acquire(&bob, 21, at(midnight + 2 * S)).await;
    assert_eq!(
        refusal(&r).map(|r| r.0),
        Some(0),
        "{}: the old day's refunds reached the new day: {}",
        h.name(),
        outcome(&r)
    );
    backend.settle(&alice, &mut old, 30, at(midnight + 2 * S));
    h.flush(&backend).await;
    let fits = backend.acquire(&bob, 20, at(midnight + 3 * S)).await;
    assert!(fits.is_ok(), "{}: the old day's charge reached the new day: {}", h.name(), outcome(&fits));
    for (key, g) in [(&alice, old), (&bob, new), (&bob, fits.unwrap())] {
        backend.release(key, g);
    }
    h.flush(&backend).await;
}

/// Law 19 for the errors that are not refusals (Law 22): decided without state, they
/// are the same too.
async fn local_refusals<H: Harness>(h: &H) {
    let backend = h.make(mixed_policy());
    let org_only = TenantKey::single("acme").unwrap();
    let r = backend.acquire(&org_only, 1, at(S)).await;
    assert!(matches!(&r, Err(AcquireError::MissingTier(m)) if m.tier() == "user"), "{}: {}", h.name(), outcome(&r));
    let alice = TenantKey::new(["acme", "alice"]).unwrap();
    let r = backend.acquire(&alice, 51, at(S)).await;
    match &r {
        Err(AcquireError::CostAboveCapacity(e)) => {
            assert_eq!((e.limit(), e.tier(), e.cost(), e.capacity()), ("tokens", Some("org"), 51, 50));
        }
        other => panic!("{}: {}", h.name(), outcome(other)),
    }
    let _ = Refusal::Never { capacity: 0 };
}

async fn all_laws<H: Harness>(h: &H) {
    rate_cap(h).await;
    gcra_is_token_bucket(h).await;
    exact_retry_after(h).await;
    atomicity(h).await;
    conservation(h).await;
    local_refusals(h).await;
}

#[test]
fn laws_in_memory() {
    redis_common::runtime().block_on(all_laws(&Memory));
}

#[test]
fn laws_on_redis() {
    let Some(server) = redis_for("laws_on_redis") else { return };
    redis_common::runtime().block_on(async {
        let conn = redis_common::connect(&server.url()).await;
        all_laws(&Redis { conn: conn.clone(), refusal_cache: true }).await;
        all_laws(&Redis { conn, refusal_cache: false }).await;
    });
}

#[test]
fn redis_answers_as_memory_does() {
    let Some(server) = redis_for("redis_answers_as_memory_does") else { return };
    redis_common::runtime().block_on(async {
        let conn = redis_common::connect(&server.url()).await;
        same_answers(&Memory, &Redis { conn, refusal_cache: false }).await;
    });
}

#[test]
fn a_calendar_budget_on_redis_answers_as_in_memory() {
    let Some(server) = redis_for("a_calendar_budget_on_redis_answers_as_in_memory") else { return };
    redis_common::runtime().block_on(async {
        let conn = redis_common::connect(&server.url()).await;
        calendar_answers_alike(&Memory, &Redis { conn: conn.clone(), refusal_cache: true }).await;
        calendar_answers_alike(&Memory, &Redis { conn: conn.clone(), refusal_cache: false }).await;
        calendar_settles_stay_in_their_day(&Memory).await;
        calendar_settles_stay_in_their_day(&Redis { conn, refusal_cache: true }).await;
    });
}

/// The named layers' own policies, global and per key: what `GcraLayer::new(..)` and the
/// others enforce, for the backend-level laws.
fn named_layer_policies() -> Vec<(&'static str, LimitSetPolicy)> {
    use tower_limits::extract::KeyFn;
    use tower_limits::{
        FixedWindowLayer, GcraLayer, LeakyBucketLayer, Quota, SemaphoreLayer, SlidingWindowLayer, TokenBucketLayer, nz,
    };
    let key = || KeyFn::new(|k: &&'static str| TenantKey::single(k).ok());
    let quota = Quota::per_second(nz!(3)).burst(nz!(2));
    let window = Quota::try_new(4, Duration::from_millis(900)).unwrap();
    let policy = |p: Option<&LimitSetPolicy>| p.expect("a named layer knows its policy").clone();
    vec![
        ("GcraLayer", policy(GcraLayer::new(quota).policy())),
        ("GcraLayer per key", policy(GcraLayer::new(quota).key(key()).policy())),
        ("TokenBucketLayer", policy(TokenBucketLayer::new(quota).policy())),
        ("TokenBucketLayer per key", policy(TokenBucketLayer::new(quota).key(key()).policy())),
        ("LeakyBucketLayer", policy(LeakyBucketLayer::new(quota).policy())),
        ("SlidingWindowLayer", policy(SlidingWindowLayer::new(window).policy())),
        ("SlidingWindowLayer per key", policy(SlidingWindowLayer::new(window).key(key()).policy())),
        ("SlidingWindowLayer::approximate", policy(SlidingWindowLayer::approximate(window).policy())),
        ("FixedWindowLayer per key", policy(FixedWindowLayer::new(window).key(key()).policy())),
        ("SemaphoreLayer per key", policy(SemaphoreLayer::new(nz!(3)).key(key()).policy())),
    ]
}

/// Law 19 for the named layers: their policies decide the same on every backend, step by
/// step, with costs, cancels and releases.
async fn named_layers_agree<A: Harness, B: Harness>(a: &A, b: &B) {
    let keys = [TenantKey::single("alice").unwrap(), TenantKey::single("bob").unwrap()];
    for (n, (name, policy)) in named_layer_policies().into_iter().enumerate() {
        let (ba, bb) = (a.make(policy.clone()), b.make(policy));
        let mut rng = Rng(77 + n as u64);
        let mut now = S;
        let mut held = Vec::new();
        let mut refused = 0;
        for step in 0..200 {
            now += rng.below(150 * MS);
            let key = &keys[rng.below(2) as usize];
            let cost = rng.range(1, 3);
            let (x, y) = (ba.acquire(key, cost, at(now)).await, bb.acquire(key, cost, at(now)).await);
            assert_eq!(outcome(&x), outcome(&y), "{name}: step {step}, {} and {}", a.name(), b.name());
            assert_eq!(refusal(&x), refusal(&y), "{name}: step {step}");
            refused += usize::from(x.is_err());
            if let (Ok(x), Ok(y)) = (x, y) {
                held.push((key.clone(), x, y));
            }
            // Give back some of what is held, oldest first, by release or cancel.
            while held.len() > 2 || (!held.is_empty() && rng.below(3) == 0) {
                let (key, x, y) = held.remove(0);
                if rng.below(4) == 0 {
                    ba.cancel(&key, x, at(now));
                    bb.cancel(&key, y, at(now));
                } else {
                    ba.release(&key, x);
                    bb.release(&key, y);
                }
                b.flush(&bb).await;
            }
        }
        assert!(refused > 5, "{name}: the program must reach the limit ({refused} refusals)");
    }
}

#[test]
fn named_layers_agree_on_every_backend() {
    redis_common::runtime().block_on(named_layers_agree(&Memory, &Memory));
    let Some(server) = redis_for("named_layers_agree_on_every_backend") else { return };
    redis_common::runtime().block_on(async {
        let conn = redis_common::connect(&server.url()).await;
        named_layers_agree(&Memory, &Redis { conn, refusal_cache: false }).await;
    });
}

/// The named layers themselves, as Tower middleware, over memory and over Redis (built
/// from the layer's own policy with `on_backend`): the same requests get the same
/// answers. Quotas refill once a day, so real time between requests changes nothing.
#[test]
fn named_layers_serve_alike_on_every_backend() {
    use tower::{Layer, Service, ServiceExt};
    use tower_limits::extract::KeyFn;
    use tower_limits::{
        FixedWindowLayer, GcraLayer, LimitError, Quota, SemaphoreLayer, SlidingWindowLayer, TokenBucketLayer, nz,
    };

    let Some(server) = redis_for("named_layers_serve_alike_on_every_backend") else { return };
    redis_common::runtime().block_on(async {
        let conn = redis_common::connect(&server.url()).await;
        let key = || KeyFn::new(|k: &(&'static str, u64)| TenantKey::single(k.0).ok());
        let daily = Quota::per_day(nz!(3)).burst(nz!(3));
        let requests: Vec<(&'static str, u64)> =
            [("alice", 1), ("bob", 2), ("alice", 1), ("alice", 2), ("bob", 1)].into_iter().cycle().take(12).collect();
        let answer = |r: Result<(), tower_limits::BoxError>| match r {
            Ok(()) => "ok".to_owned(),
            Err(e) => match e.downcast_ref::<LimitError>() {
                Some(e) => format!("{:?} {:?} {:?}", e.kind(), e.limit(), e.tier()),
                None => format!("other error: {e}"),
            },
        };
        macro_rules! compare {
            ($name:literal, $layer:expr) => {{
                let memory = $layer;
                let policy = memory.policy().expect("a named layer knows its policy").clone();
                let redis = redis_common::manual(policy, "named").build(&conn).unwrap();
                let on_redis = memory.clone().on_backend(redis);
                let inner =
                    tower::service_fn(|_req: (&'static str, u64)| async { Ok::<_, tower_limits::BoxError>(()) });
                let (a, b) = (memory.layer(inner), on_redis.layer(inner));
                let mut refused = 0;
                for (i, req) in requests.iter().enumerate() {
                    let x = answer(a.clone().oneshot(*req).await);
                    let y = answer(b.clone().oneshot(*req).await);
                    assert_eq!(x, y, "{}: request {i} ({req:?})", $name);
                    refused += usize::from(x != "ok");
                }
                assert!(refused > 0, "{}: the requests must reach the limit", $name);
            }};
        }
        compare!("GcraLayer", GcraLayer::new(daily).key(key()));
        compare!(
            "TokenBucketLayer",
            TokenBucketLayer::new(daily)
                .key(key())
                .cost(tower_limits::extract::CostFn::new(|r: &(&'static str, u64)| r.1))
        );
        compare!("SlidingWindowLayer", SlidingWindowLayer::new(daily).key(key()));
        compare!("SlidingWindowLayer::approximate", SlidingWindowLayer::approximate(daily));
        compare!("FixedWindowLayer", FixedWindowLayer::new(daily).key(key()));
        compare!("GcraLayer global", GcraLayer::new(daily));
        // A semaphore frees as soon as each request completes: nothing is refused in
        // sequence, so hold three and check the fourth on both backends.
        let memory = SemaphoreLayer::new(nz!(3)).key(key());
        let policy = memory.policy().unwrap().clone();
        let on_redis = memory.clone().on_backend(redis_common::manual(policy, "named").build(&conn).unwrap());
        let gate = std::sync::Arc::new(tokio::sync::Semaphore::new(0));
        let entered = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let held = {
            let (gate, entered) = (gate.clone(), entered.clone());
            // Requests marked 0 are probes: admitted, they return at once instead of
            // holding. Holders count themselves in, so the probe is sent only once all
            // three hold their permit (a probe sent earlier could take a holder's slot).
            tower::service_fn(move |req: (&'static str, u64)| {
                let (gate, entered) = (gate.clone(), entered.clone());
                async move {
                    if req.1 != 0 {
                        entered.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        let _ = gate.acquire().await;
                    }
                    Ok::<_, tower_limits::BoxError>(())
                }
            })
        };
        macro_rules! holds {
            ($label:literal, $svc:expr) => {{
                let mut svc = $svc;
                let mut calls = Vec::new();
                for _ in 0..3 {
                    calls.push(tokio::spawn(svc.ready().await.unwrap().call(("carol", 1))));
                }
                // Once all three hold their permit, the fourth is refused.
                while entered.load(std::sync::atomic::Ordering::SeqCst) < 3 {
                    tokio::task::yield_now().await;
                }
                let fourth = answer(svc.clone().oneshot(("carol", 0)).await);
                assert!(fourth.starts_with("ConcurrencyLimited"), "{}: {fourth}", $label);
                // Another key has its own capacity: admitted, it holds until the gate opens.
                let dave = tokio::spawn(svc.ready().await.unwrap().call(("dave", 1)));
                gate.add_permits(4);
                for call in calls {
                    call.await.unwrap().unwrap();
                }
                assert_eq!(answer(dave.await.unwrap()), "ok", "{}: another key has its own", $label);
                gate.forget_permits(gate.available_permits());
                entered.store(0, std::sync::atomic::Ordering::SeqCst);
            }};
        }
        holds!("memory", memory.layer(held.clone()));
        holds!("redis", on_redis.layer(held.clone()));
    });
}
