//! Law 23, one pass per request: an acquisition returns the states the answer's headers
//! need, read as the decision left them, and the layer never looks the same states up
//! again. Law numbers are those of `crates/tower-limits/docs/laws.md`.

use std::convert::Infallible;
use std::time::Duration;

use http::{Request, Response, StatusCode};
use proptest::prelude::*;
use tower::{ServiceBuilder, ServiceExt};
use tower_limits::extract::{Cost, CostFromExtension, FromExtension};
use tower_limits::http::HttpAnswer;
use tower_limits::{LimitPolicy, LimitSetLayer, LimitSetPolicy, Quota, TenantKey, nz};
use tower_limits_core::{Instant, LimitSet};
use tower_limits_tests::Counting;

fn policy() -> LimitSetPolicy {
    LimitSetPolicy::new()
        .tiers(["org", "user"])
        .limit(LimitPolicy::gcra("requests", Quota::per_minute(nz!(60)).burst(nz!(2))).per("user"))
        .limit(
            LimitPolicy::token_bucket("tokens", Quota::per_minute(nz!(60_000)).burst(nz!(10_000)))
                .per("org")
                .counting_cost(),
        )
        .limit(LimitPolicy::semaphore("shared", 100))
}

fn request(cost: u64) -> Request<String> {
    let mut req = Request::new(String::new());
    req.extensions_mut().insert(TenantKey::new(["acme", "alice"]).expect("a valid key"));
    req.extensions_mut().insert(Cost(cost));
    req
}

#[tokio::test(start_paused = true)]
async fn the_headers_come_from_the_acquisition_itself() {
    let backend = Counting::new(LimitSet::new(policy()).expect("a valid policy"));
    let layer = LimitSetLayer::with_backend(backend.clone())
        .key(FromExtension::<TenantKey>::new())
        .cost(CostFromExtension)
        .refuse_with(HttpAnswer::new().with_openai_fields().on_success());
    let svc = ServiceBuilder::new()
        .layer(layer)
        .service(tower::service_fn(|_: Request<String>| async { Ok::<_, Infallible>(Response::new(String::new())) }));

    let first = svc.clone().oneshot(request(1_000)).await.expect("answered");
    assert_eq!(first.status(), StatusCode::OK);
    assert_eq!(first.headers()["x-ratelimit-remaining-requests"], "1", "as the grant left it");
    assert_eq!(first.headers()["x-ratelimit-remaining-tokens"], "9000");
    let second = svc.clone().oneshot(request(1_000)).await.expect("answered");
    assert_eq!(second.headers()["x-ratelimit-remaining-requests"], "0");
    let refused = svc.clone().oneshot(request(1_000)).await.expect("answered");
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(refused.headers()["x-ratelimit-remaining-tokens"], "8000", "nothing charged by the refusal");
    assert!(refused.headers().contains_key("ratelimit"));
    assert_eq!(backend.peeks(), 0, "no second lookup of the same states");
}

#[tokio::test(start_paused = true)]
async fn a_waiter_admitted_later_gets_the_states_of_its_own_grant() {
    let backend = Counting::new(
        LimitSet::new(LimitSetPolicy::new().limit(LimitPolicy::gcra("requests", Quota::per_second(nz!(1)))))
            .expect("a valid policy"),
    );
    let layer = LimitSetLayer::with_backend(backend.clone())
        .wait(Duration::from_secs(5))
        .refuse_with(HttpAnswer::new().on_success());
    let svc = ServiceBuilder::new()
        .layer(layer)
        .service(tower::service_fn(|_: Request<String>| async { Ok::<_, Infallible>(Response::new(String::new())) }));
    let first = svc.clone().oneshot(Request::new(String::new())).await.expect("answered");
    assert_eq!(first.status(), StatusCode::OK);
    let start = tokio::time::Instant::now();
    let waited = svc.oneshot(Request::new(String::new())).await.expect("answered");
    assert_eq!(waited.status(), StatusCode::OK);
    assert_eq!(start.elapsed(), Duration::from_secs(1), "it waited for its slot");
    assert!(waited.headers().contains_key("ratelimit"));
    assert_eq!(backend.peeks(), 0);
}

/// A random step against two twin sets.
#[derive(Debug, Clone)]
enum Step {
    Acquire { user: usize, cost: u64 },
    Release(usize),
    Advance(u64),
}

fn steps() -> impl Strategy<Value = Vec<Step>> {
    prop::collection::vec(
        prop_oneof![
            4 => (0..3usize, 0..3_000u64).prop_map(|(user, cost)| Step::Acquire { user, cost }),
            1 => (0..8usize).prop_map(Step::Release),
            2 => (1..2_000u64).prop_map(Step::Advance),
        ],
        1..80,
    )
}

fn twin_policies() -> impl Strategy<Value = LimitSetPolicy> {
    prop_oneof![
        // One global GCRA: the lock-free path.
        Just(LimitSetPolicy::new().limit(LimitPolicy::gcra("one", Quota::per_second(nz!(5)).burst(nz!(3))))),
        // Keyed and global limits of every kind together.
        Just(policy().limit(LimitPolicy::sliding_window_log("daily", 20, Duration::from_secs(10)).per("org"))),
        Just(
            LimitSetPolicy::new()
                .tiers(["org", "user"])
                .limit(LimitPolicy::fixed_window("window", 4, Duration::from_secs(2)).per("user"))
                .limit(LimitPolicy::semaphore("per-org", 3).per("org"))
        ),
    ]
}

proptest! {
    /// What `acquire_observed` returns is the decision `acquire_grant` makes on a twin,
    /// and the states a peek of the twin reads right after it.
    #[test]
    fn observed_states_are_the_states_the_decision_left(policy in twin_policies(), steps in steps()) {
        let (a, b) = (LimitSet::new(policy.clone()).expect("valid"), LimitSet::new(policy).expect("valid"));
        let users = ["alice", "bob", "carol"];
        let mut now = Instant::ZERO;
        let mut held = Vec::new();
        for step in steps {
            match step {
                Step::Acquire { user, cost } => {
                    let key = TenantKey::new(["acme", users[user]]).expect("valid");
                    let (granted, seen) = a.acquire_observed(&key, cost, now);
                    let twin = b.acquire_grant(&key, cost, now);
                    prop_assert_eq!(granted.is_ok(), twin.is_ok());
                    if let (Err(x), Err(y)) = (&granted, &twin) {
                        prop_assert_eq!(x.to_string(), y.to_string());
                    }
                    let granted_now = granted.is_ok();
                    if let (Ok(x), Ok(y)) = (granted, twin) {
                        held.push((key.clone(), x, y));
                    }
                    // Read independently: a global semaphore has what its holders left.
                    if let Some(shared) = seen.iter().find(|s| s.name == "shared") {
                        prop_assert_eq!(shared.snapshot.remaining, 100 - held.len() as u64, "granted: {}", granted_now);
                    }
                    prop_assert_eq!(seen, b.peek(&key, now));
                }
                Step::Release(i) => {
                    if !held.is_empty() {
                        let (key, x, y) = held.swap_remove(i % held.len());
                        a.release_grant(&key, x);
                        b.release_grant(&key, y);
                    }
                }
                Step::Advance(ms) => now = now + Duration::from_millis(ms),
            }
        }
    }
}

proptest! {
    /// The lock-free path reads what the locked path reads: the same GCRA beside a limit
    /// that never binds (which keeps the set off the lock-free path) sees the same states.
    #[test]
    fn the_lock_free_path_observes_what_the_locked_path_does(
        steps in prop::collection::vec((0..4u64, 0..500u64), 1..100),
    ) {
        let gcra = || LimitPolicy::gcra("one", Quota::per_second(nz!(5)).burst(nz!(3)));
        let fast = LimitSet::new(LimitSetPolicy::new().limit(gcra())).expect("valid");
        let locked = LimitSet::new(LimitSetPolicy::new().limit(gcra()).limit(LimitPolicy::semaphore("never", 1 << 40)))
            .expect("valid");
        let key = TenantKey::global();
        let mut now = Instant::ZERO;
        for (cost, ms) in steps {
            now = now + Duration::from_millis(ms);
            let (x, seen_fast) = fast.acquire_observed(&key, cost, now);
            let (y, seen_locked) = locked.acquire_observed(&key, cost, now);
            prop_assert_eq!(x.is_ok(), y.is_ok());
            prop_assert_eq!(seen_fast.len(), 1);
            prop_assert_eq!(seen_fast[0].snapshot, seen_locked[0].snapshot);
            if let (Ok(x), Ok(y)) = (x, y) {
                fast.release_grant(&key, x);
                locked.release_grant(&key, y);
            }
        }
    }
}
