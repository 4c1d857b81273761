//! Law 14, shadow mode, per limit and per layer, through the public API. Law numbers are
//! those of `crates/tower-limits/docs/laws.md`.
//!
//! Per limit ([`LimitPolicy::shadow`]), against two enforcing twins on the same sequence:
//! `enforcing` holds the set's other limits, `alone` the shadow limit alone and sees
//! only the acquisitions `enforcing` granted (the requests that reach the shadow limit).
//!
//! - The set with the shadow limit refuses exactly what `enforcing` refuses, with the same
//!   refusal: the shadow limit never refuses and leaves the others enforced.
//! - A grant names the shadow limit among its shadow refusals exactly when `alone`
//!   refuses the same acquisition, and `shadow_refused` counts exactly `alone`'s
//!   refusals (refused and above capacity).
//! - After every step, every limit's state for every key is what the twin holding it
//!   says (`peek` and `held`): a shadow refusal charges nothing, its settle corrects
//!   nothing, its release gives back nothing (Law 5, conservation: nothing leaks and
//!   nothing is released twice). When every permit is gone, no limit holds anything.
//!
//! Per layer ([`LimitLayer::shadow`]): never refuses, counts in `shadow_refused` exactly
//! what an enforcing twin layer refuses on the same requests at the same instants, and
//! holds nothing for the requests it lets through.

use std::convert::Infallible;
use std::time::Duration;

use proptest::prelude::*;
use proptest::sample::Index;
use tower::{Service, ServiceExt};
use tower_limits::{GcraLayer, LimitLayer, LimitSetLayer, Quota, nz};
use tower_limits_core::{AcquireError, Grant, Instant, LimitPolicy, LimitSet, LimitSetPolicy, TenantKey};
use tower_limits_tests::policies::{PolicyGen, Spec, TIERS};
use tower_limits_tests::proptest_config;

const MS: u64 = 1_000_000;

/// One limit of any kind, scope and counting, of size 1 to 4 (so that a cost of 9 is
/// above the capacity of every limit counting cost), a rate being `size` per 5 to 50 ms
/// with a burst of `size`.
fn spec() -> impl Strategy<Value = Spec> {
    PolicyGen::new().amount_is_size().sizes(1..=4).periods_ms(5..=50).spec()
}

#[derive(Debug, Clone, Copy)]
enum Op {
    Acquire { key: usize, cost: u64 },
    Settle(Index, u64),
    Drop(Index),
    Cancel(Index),
    Advance(u64),
}

fn op() -> impl Strategy<Value = Op> {
    let cost = prop_oneof![4 => 1u64..=2, 2 => 0u64..=4, 1 => Just(9u64)];
    prop_oneof![
        6 => (0usize..6, cost).prop_map(|(key, cost)| Op::Acquire { key, cost }),
        2 => (any::<Index>(), 0u64..=6).prop_map(|(i, a)| Op::Settle(i, a)),
        3 => any::<Index>().prop_map(Op::Drop),
        1 => any::<Index>().prop_map(Op::Cancel),
        2 => (0u64..=30 * MS).prop_map(Op::Advance),
    ]
}

fn key(i: usize) -> TenantKey {
    TenantKey::new([format!("org{}", i % 2), format!("user{i}")]).unwrap()
}

/// A refusal, comparable across sets whose limits sit at other positions.
fn refusal(e: &AcquireError) -> String {
    match e {
        AcquireError::Refused(d) => {
            format!(
                "refused by {} {:?} retry {:?} release {} {:?}",
                d.limit(),
                d.tier(),
                d.retry_after(),
                d.needs_release(),
                d.snapshot()
            )
        }
        AcquireError::CostAboveCapacity(c) => format!("above capacity of {} {:?}", c.limit(), c.tier()),
        other => format!("{other}"),
    }
}

/// One outstanding request: its grant in the set under test, and in each twin.
struct Held {
    key: TenantKey,
    shadowed: Grant,
    enforcing: Grant,
    alone: Option<Grant>,
}

fn check_states(
    under_test: &LimitSet,
    enforcing: &LimitSet,
    alone: &LimitSet,
    filler: bool,
    now: Instant,
    step: usize,
) {
    for k in 0..6 {
        let key = key(k);
        let mut expected = if filler { Vec::new() } else { enforcing.peek(&key, now) };
        expected.extend(alone.peek(&key, now));
        let mut seen = under_test.peek(&key, now);
        expected.sort_by_key(|s| s.name);
        seen.sort_by_key(|s| s.name);
        assert_eq!(seen, expected, "step {step}: states for {key}");
    }
    let held = |set: &LimitSet| set.stats().limits.into_iter().map(|l| (l.name, l.held)).collect::<Vec<_>>();
    let mut expected = if filler { Vec::new() } else { held(enforcing) };
    expected.extend(held(alone));
    let mut seen = held(under_test);
    expected.sort();
    seen.sort();
    assert_eq!(seen, expected, "step {step}: held");
}

proptest! {
    #![proptest_config(proptest_config(256))]

    #[test]
    fn a_shadow_limit_decides_like_its_enforcing_twin_and_never_refuses(
        others in prop::collection::vec(spec(), 0..=2),
        shadow in spec(),
        position in any::<Index>(),
        ops in prop::collection::vec(op(), 1..150),
    ) {
        let names = ["a", "b"];
        let at = position.index(others.len() + 1);
        let mut policy = LimitSetPolicy::new().tiers(TIERS).max_keys(10_000);
        let mut enforcing = LimitSetPolicy::new().tiers(TIERS).max_keys(10_000);
        for (i, s) in others.iter().enumerate() {
            if i == at {
                policy = policy.limit(shadow.policy("s").shadow());
            }
            policy = policy.limit(s.policy(names[i]));
            enforcing = enforcing.limit(s.policy(names[i]));
        }
        if at == others.len() {
            policy = policy.limit(shadow.policy("s").shadow());
        }
        let under_test = LimitSet::new(policy).unwrap();
        // With no other limit, the set under test is the shadow limit alone, and its
        // enforcing twin grants everything.
        let enforcing = if others.is_empty() {
            LimitSet::new(enforcing.limit(LimitPolicy::gcra("unbounded", Quota::per_second(nz!(1_000_000))))).unwrap()
        } else {
            LimitSet::new(enforcing).unwrap()
        };
        let filler = others.is_empty();
        let alone = LimitSet::new(LimitSetPolicy::new().tiers(TIERS).max_keys(10_000).limit(shadow.policy("s"))).unwrap();

        let mut now = Instant::ZERO;
        let mut held: Vec<Held> = Vec::new();
        let mut refused_alone = 0u64;
        for (step, op) in ops.into_iter().enumerate() {
            match op {
                Op::Acquire { key: k, cost } => {
                    let key = key(k);
                    let got = under_test.acquire_grant(&key, cost, now);
                    let want = enforcing.acquire_grant(&key, cost, now);
                    match (got, want) {
                        (Ok(shadowed), Ok(enforced)) => {
                            let alone_grant = match alone.acquire_grant(&key, cost, now) {
                                Ok(g) => Some(g),
                                Err(_) => {
                                    refused_alone += 1;
                                    None
                                }
                            };
                            let named: Vec<_> = shadowed.shadow_refusals().collect();
                            let expected: Vec<_> = alone_grant
                                .is_none()
                                .then_some(("s", shadow.tier.name()))
                                .into_iter()
                                .collect();
                            prop_assert_eq!(named, expected, "step {}", step);
                            held.push(Held { key, shadowed, enforcing: enforced, alone: alone_grant });
                        }
                        (Err(a), Err(b)) => prop_assert_eq!(refusal(&a), refusal(&b), "step {}", step),
                        (a, b) => prop_assert!(false, "step {step}: {:?} vs {:?}", a.map(|_| ()).map_err(|e| refusal(&e)), b.map(|_| ()).map_err(|e| refusal(&e))),
                    }
                }
                Op::Settle(i, actual) if !held.is_empty() => {
                    let n = held.len();
                    let h = &mut held[i.index(n)];
                    under_test.settle_grant(&h.key, &mut h.shadowed, actual, now);
                    enforcing.settle_grant(&h.key, &mut h.enforcing, actual, now);
                    if let Some(g) = h.alone.as_mut() {
                        alone.settle_grant(&h.key, g, actual, now);
                    }
                }
                Op::Drop(i) if !held.is_empty() => {
                    let h = held.swap_remove(i.index(held.len()));
                    under_test.release_grant(&h.key, h.shadowed);
                    enforcing.release_grant(&h.key, h.enforcing);
                    if let Some(g) = h.alone {
                        alone.release_grant(&h.key, g);
                    }
                }
                Op::Cancel(i) if !held.is_empty() => {
                    let h = held.swap_remove(i.index(held.len()));
                    under_test.cancel_grant(&h.key, h.shadowed, now);
                    enforcing.cancel_grant(&h.key, h.enforcing, now);
                    if let Some(g) = h.alone {
                        alone.cancel_grant(&h.key, g, now);
                    }
                }
                Op::Advance(d) => now = now + Duration::from_nanos(d),
                _ => {}
            }
            check_states(&under_test, &enforcing, &alone, filler, now, step);
            let stats = under_test.stats();
            let s = stats.limits.iter().find(|l| l.name == "s").unwrap();
            prop_assert_eq!(s.shadow_refused, refused_alone, "step {}", step);
            prop_assert_eq!(s.refused + s.cost_above_capacity, 0, "a shadow limit refuses nothing");
            let alone_stats = alone.stats();
            prop_assert_eq!(alone_stats.limits[0].refused + alone_stats.limits[0].cost_above_capacity, refused_alone);
        }
        for h in held.drain(..) {
            under_test.release_grant(&h.key, h.shadowed);
            enforcing.release_grant(&h.key, h.enforcing);
            if let Some(g) = h.alone {
                alone.release_grant(&h.key, g);
            }
        }
        prop_assert!(under_test.stats().limits.iter().all(|l| l.held == 0), "everything came back");
    }
}

#[test]
fn a_key_too_short_for_a_shadow_limit_is_admitted_and_counted() {
    let set = LimitSet::new(
        LimitSetPolicy::new()
            .tiers(TIERS)
            .limit(LimitPolicy::gcra("org_rate", Quota::per_second(nz!(10))).per("org"))
            .limit(LimitPolicy::gcra("user_rate", Quota::per_second(nz!(10))).per("user").shadow()),
    )
    .unwrap();
    let org_only = TenantKey::single("acme").unwrap();
    let grant = set.acquire_grant(&org_only, 1, Instant::ZERO).unwrap();
    assert_eq!(grant.shadow_refusals().collect::<Vec<_>>(), [("user_rate", Some("user"))]);
    assert_eq!(set.stats().limits[1].shadow_refused, 1);
}

#[test]
fn a_shadow_limit_survives_a_policy_change_to_enforcing_with_its_state() {
    let trial = |shadow: bool| {
        let p = LimitPolicy::gcra("trial", Quota::per_second(nz!(1)).burst(nz!(2)));
        LimitSetPolicy::new().limit(if shadow { p.shadow() } else { p })
    };
    let set = LimitSet::new(trial(true)).unwrap();
    let global = TenantKey::global();
    for _ in 0..3 {
        let _ = set.acquire_grant(&global, 1, Instant::ZERO).unwrap();
    }
    set.replace_policy(trial(false)).unwrap();
    // Two were charged, the third was a shadow refusal: enforcing now refuses at once.
    assert!(set.acquire_grant(&global, 1, Instant::ZERO).is_err());
}

// ---- the layer in shadow mode ----

type Echo = tower::util::BoxCloneSyncService<u32, u32, tower::BoxError>;

fn echo<L>(layer: L) -> Echo
where
    L: tower::Layer<tower::util::ServiceFn<fn(u32) -> std::future::Ready<Result<u32, Infallible>>>>,
    L::Service: Service<u32, Response = u32, Error = tower::BoxError> + Clone + Send + Sync + 'static,
    <L::Service as Service<u32>>::Future: Send + 'static,
{
    let f: fn(u32) -> std::future::Ready<Result<u32, Infallible>> = |r| std::future::ready(Ok(r));
    tower::util::BoxCloneSyncService::new(layer.layer(tower::service_fn(f)))
}

#[tokio::test(start_paused = true)]
async fn a_shadow_layer_never_refuses_and_counts_what_its_twin_refuses() {
    let quota = Quota::per_second(nz!(5)).burst(nz!(3));
    let shadow = GcraLayer::new(quota).shadow();
    let twin = GcraLayer::new(quota);
    let under_test = echo(shadow.clone());
    let enforcing = echo(twin.clone());
    let mut refused = 0;
    // Bursts and pauses: some arrive too early, some find room.
    for (i, pause_ms) in [0u64, 0, 0, 0, 0, 50, 0, 300, 0, 0, 0, 0, 1000, 0, 10, 10, 10].into_iter().enumerate() {
        tokio::time::advance(Duration::from_millis(pause_ms)).await;
        let i = i as u32;
        assert_eq!(under_test.clone().oneshot(i).await.unwrap(), i, "shadow mode refused request {i}");
        if enforcing.clone().oneshot(i).await.is_err() {
            refused += 1;
        }
        assert_eq!(shadow.layer_stats().shadow_refused, refused, "after request {i}");
    }
    assert!(refused > 0, "the sequence must exercise refusals");
    assert_eq!(shadow.layer_stats().refused, 0);
    assert_eq!(twin.layer_stats().refused, refused);
    assert_eq!(shadow.stats().admitted, twin.stats().admitted, "the limit was charged exactly as the twin's");
}

#[tokio::test(start_paused = true)]
async fn a_shadow_layer_holds_no_concurrency_for_what_it_lets_through() {
    let layer: LimitLayer<_, _, _, _> =
        LimitSetLayer::new(LimitSetPolicy::new().limit(LimitPolicy::semaphore("concurrent", 2))).unwrap().shadow();
    let (svc, mut handle) = tower_test::mock::pair::<u32, u32>();
    let mut svc = tower::Layer::layer(&layer, svc);
    handle.allow(10);
    let mut calls = Vec::new();
    for i in 0..5 {
        calls.push(tokio::spawn(svc.ready().await.unwrap().call(i)));
    }
    let mut pending = Vec::new();
    for _ in 0..5 {
        pending.push(handle.next_request().await.unwrap());
    }
    // Two hold the semaphore; three were let through holding nothing.
    assert_eq!(layer.stats().limits[0].held, 2);
    assert_eq!(layer.layer_stats().shadow_refused, 3);
    for (req, respond) in pending {
        respond.send_response(req);
    }
    for call in calls {
        call.await.unwrap().unwrap();
    }
    assert_eq!(layer.stats().limits[0].held, 0, "nothing leaked, nothing released twice");
    // And the next two find the semaphore free.
    let _a = tokio::spawn(svc.ready().await.unwrap().call(5));
    let _b = tokio::spawn(svc.ready().await.unwrap().call(6));
    let _ = handle.next_request().await.unwrap();
    let _ = handle.next_request().await.unwrap();
    assert_eq!(layer.stats().limits[0].held, 2);
    assert_eq!(layer.layer_stats().shadow_refused, 3);
}

#[tokio::test(start_paused = true)]
async fn a_shadow_limit_in_a_layer_is_counted_and_the_other_limits_still_refuse() {
    let layer = LimitSetLayer::new(
        LimitSetPolicy::new()
            .limit(LimitPolicy::gcra("enforced", Quota::per_second(nz!(10)).burst(nz!(4))))
            .limit(LimitPolicy::gcra("trial", Quota::per_second(nz!(10)).burst(nz!(2))).shadow()),
    )
    .unwrap();
    let svc = echo(layer.clone());
    let mut ok = 0;
    let mut refused = 0;
    for i in 0..6 {
        match svc.clone().oneshot(i).await {
            Ok(_) => ok += 1,
            Err(e) => {
                let e = e.downcast_ref::<tower_limits::LimitError>().unwrap();
                assert_eq!(e.limit(), Some("enforced"));
                refused += 1;
            }
        }
    }
    assert_eq!((ok, refused), (4, 2), "the enforcing limit still refuses");
    assert_eq!(layer.layer_stats().shadow_refused, 2, "the trial limit would have refused two of the four");
    assert_eq!(layer.stats().limits[1].shadow_refused, 2);
}

#[tokio::test(start_paused = true)]
async fn a_shadow_limit_of_a_pool_member_is_reported_through_the_layer() {
    let member = LimitSet::new(
        LimitSetPolicy::new()
            .limit(LimitPolicy::gcra("rpm", Quota::per_minute(nz!(100))))
            .limit(LimitPolicy::gcra("trial", Quota::per_minute(nz!(1))).shadow()),
    )
    .unwrap();
    let pool = tower_limits::LimitPool::builder(tower_limits::Selection::RoundRobin)
        .member("only", member, ())
        .build()
        .unwrap();
    let layer = LimitSetLayer::with_backend(pool);
    let svc = echo(layer.clone());
    for i in 0..3 {
        assert_eq!(svc.clone().oneshot(i).await.unwrap(), i);
    }
    assert_eq!(layer.layer_stats().shadow_refused, 2);
}

#[tokio::test(start_paused = true)]
async fn a_shadow_layer_still_tells_clients_what_is_left() {
    use tower_limits::http::HttpAnswer;
    let layer = GcraLayer::new(Quota::per_minute(nz!(60)).burst(nz!(2)))
        .refuse_with(HttpAnswer::new().with_openai_fields().on_success())
        .shadow();
    let svc = tower::ServiceBuilder::new()
        .layer(layer.clone())
        .service_fn(|_req: http::Request<String>| async { Ok::<_, Infallible>(http::Response::new(String::new())) });
    let mut remaining = Vec::new();
    for _ in 0..3 {
        let response = svc.clone().oneshot(http::Request::new(String::new())).await.unwrap();
        assert_eq!(response.status(), http::StatusCode::OK, "never refused");
        remaining.push(response.headers()["x-ratelimit-remaining-tokens"].to_str().unwrap().to_owned());
        assert!(response.headers().contains_key("ratelimit-policy"));
    }
    // (A named layer's limit counts cost: the OpenAI family calls it tokens.) The third
    // would have been refused: nothing left, and it took nothing.
    assert_eq!(remaining, ["1", "0", "0"]);
    assert_eq!(layer.layer_stats().shadow_refused, 1);
}
