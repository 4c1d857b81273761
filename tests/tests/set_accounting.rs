//! What a `LimitSet` reports about itself, checked against a model, through the public
//! API only (so that the laws hold for any implementation of the engine). Law numbers are
//! those of `crates/tower-limits/docs/laws.md`.
//!
//! - Law 13, accounting: `stats()` counts exactly: `admitted` is the number of grants,
//!   each limit's `refused` the refusals naming it, its `cost_above_capacity` the refusals
//!   naming it, its `held` what outstanding permits hold of it, its `tracked_keys` add up
//!   to `tracked_keys()`; for sets of one limit (global or keyed) as for sets of several.
//! - Law 7, bounded memory: `tracked_keys()` never exceeds `max_keys`, whatever the
//!   tenants, and an acquisition refused because the table is full tracks nothing new.
//! - Law 13, policy changes keep counts: `replace_policy` keeps `admitted` across any
//!   change, and each surviving limit's own counters; a new limit starts at zero.
//! - A refusal's snapshot is what `peek` says of the blocking limit for that key.
//! - A `Grant` holds concurrency exactly when the set has a semaphore.
//! - Law 14, shadow mode: a shadow limit that would refuse (or whose tier the key lacks)
//!   is named by the grant and counted, is neither settled, cancelled nor released, and
//!   needs no room in the key table.

use std::time::Duration;

use proptest::prelude::*;
use proptest::sample::Index;
use tower_limits_core::{
    AcquireError, Instant, LimitPolicy, LimitSet, LimitSetPolicy, LimitSetStats, OwnedPermit, Quota, SetError,
    TenantKey, nz,
};
use tower_limits_tests::policies::{Kind, PolicyGen, Spec, TIERS, name, policy_of};
use tower_limits_tests::{describe, proptest_config};

const MS: u64 = 1_000_000;
const CASES: u32 = 128;

/// One limit of any kind, scope and counting, of size 1 to 4 (so that a cost of 5 is
/// above the capacity of every limit counting cost), a rate being `size` per 5 to 50 ms
/// with a burst of `size`.
fn spec() -> impl Strategy<Value = Spec> {
    PolicyGen::new().amount_is_size().sizes(1..=4).periods_ms(5..=50).spec()
}

fn keyed(specs: &[Spec]) -> usize {
    specs.iter().filter(|s| s.is_keyed()).count()
}

/// Keys: the global key, an org without a user, and many full keys, so that tables fill.
fn tenant_key(i: usize) -> TenantKey {
    match i {
        0 => TenantKey::global(),
        1 => TenantKey::single("solo").unwrap(),
        _ => TenantKey::new([format!("org{}", i % 5), format!("user{i}")]).unwrap(),
    }
}

#[derive(Debug, Clone, Copy)]
enum Op {
    /// Acquire a permit for a key and keep it.
    Acquire { key: usize, cost: u64 },
    /// Acquire a `Grant`, settle it to `actual`, and release it at once.
    Grant { key: usize, cost: u64, actual: u64 },
    /// Settle an outstanding permit to this usage.
    Settle(Index, u64),
    /// Drop an outstanding permit.
    Drop(Index),
    /// Let time pass.
    Advance(u64),
    /// Evict the idle keys.
    Evict,
}

fn op() -> impl Strategy<Value = Op> {
    let cost = prop_oneof![4 => 1u64..=2, 2 => 0u64..=4, 1 => Just(5u64), 1 => Just(u64::MAX)];
    prop_oneof![
        6 => (0usize..24, cost.clone()).prop_map(|(key, cost)| Op::Acquire { key, cost }),
        2 => (0usize..24, cost, 0u64..=6).prop_map(|(key, cost, actual)| Op::Grant { key, cost, actual }),
        2 => (any::<Index>(), 0u64..=6).prop_map(|(i, a)| Op::Settle(i, a)),
        3 => any::<Index>().prop_map(Op::Drop),
        2 => (0u64..=30 * MS).prop_map(Op::Advance),
        1 => Just(Op::Evict),
    ]
}

fn policy_and_ops() -> impl Strategy<Value = (Vec<Spec>, usize, Vec<Op>)> {
    (prop::collection::vec(spec(), 1..=3), 0usize..=10, prop::collection::vec(op(), 1..200)).prop_map(
        |(specs, extra, ops)| {
            let max_keys = keyed(&specs).max(1) + extra;
            (specs, max_keys, ops)
        },
    )
}

/// What the model expects `stats()` to say.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
struct Model {
    admitted: u64,
    refused: Vec<u64>,
    above: Vec<u64>,
    held: Vec<u64>,
}

impl Model {
    fn new(limits: usize) -> Self {
        Model { admitted: 0, refused: vec![0; limits], above: vec![0; limits], held: vec![0; limits] }
    }

    /// Counts a refusal where the stats count it (a full table or a missing key counts
    /// nowhere).
    fn refused(&mut self, specs: &[Spec], error: &AcquireError) {
        match error {
            AcquireError::Refused(d) => self.refused[d.limit_index()] += 1,
            AcquireError::CostAboveCapacity(e) => {
                let i = (0..specs.len()).find(|&i| name(i) == e.limit()).expect("a known limit");
                self.above[i] += 1;
            }
            AcquireError::KeyTableFull(_) | AcquireError::MissingTier(_) => {}
            other => panic!("unexpected refusal {}", describe(other)),
        }
    }

    fn assert_matches(&self, set: &LimitSet, max_keys: usize, step: usize) {
        let stats: LimitSetStats = set.stats();
        let seen = Model {
            admitted: stats.admitted,
            refused: stats.limits.iter().map(|l| l.refused).collect(),
            above: stats.limits.iter().map(|l| l.cost_above_capacity).collect(),
            held: stats.limits.iter().map(|l| l.held).collect(),
        };
        assert_eq!(&seen, self, "step {step}: stats {stats:?}");
        let tracked = set.tracked_keys();
        assert_eq!(stats.limits.iter().map(|l| l.tracked_keys).sum::<usize>(), tracked, "step {step}");
        assert!(tracked <= max_keys, "step {step}: {tracked} states tracked, above max_keys {max_keys}");
    }
}

fn run(specs: &[Spec], max_keys: usize, ops: &[Op]) -> (LimitSet, Model, Vec<(usize, OwnedPermit, u64)>) {
    let set = LimitSet::new(policy_of(specs, max_keys)).expect("generated policies are valid");
    let has_semaphore = specs.iter().any(|s| s.kind == Kind::Semaphore);
    let mut model = Model::new(specs.len());
    let mut permits: Vec<(usize, OwnedPermit, u64)> = Vec::new();
    let mut now = 0u64;
    for (step, &op) in ops.iter().enumerate() {
        match op {
            Op::Acquire { key, cost } => {
                let before = set.tracked_keys();
                match set.acquire_owned(&tenant_key(key), cost, Instant::from_nanos(now)) {
                    Ok(permit) => {
                        model.admitted += 1;
                        for (i, s) in specs.iter().enumerate() {
                            model.held[i] += s.holds(cost);
                        }
                        permits.push((key, permit, cost));
                    }
                    Err(e) => {
                        if let AcquireError::Refused(d) = &e {
                            // The refusal's snapshot is the blocking limit's, for this key, now.
                            let peeked = set.peek(&tenant_key(key), Instant::from_nanos(now));
                            let blocking = peeked.iter().find(|s| s.name == d.limit()).expect("the blocking limit");
                            assert_eq!(blocking.snapshot, d.snapshot(), "step {step}: {}", describe(&e));
                        }
                        if matches!(e, AcquireError::KeyTableFull(_)) {
                            assert!(
                                set.tracked_keys() <= before,
                                "step {step}: a refusal for a full table tracked more"
                            );
                        }
                        model.refused(specs, &e);
                    }
                }
            }
            Op::Grant { key, cost, actual } => {
                let key = tenant_key(key);
                match set.acquire_grant(&key, cost, Instant::from_nanos(now)) {
                    Ok(mut grant) => {
                        model.admitted += 1;
                        assert_eq!(grant.holds_concurrency(), has_semaphore, "step {step}: {grant:?}");
                        assert_eq!(grant.granted_at(), Instant::from_nanos(now));
                        set.settle_grant(&key, &mut grant, actual, Instant::from_nanos(now));
                        set.release_grant(&key, grant);
                    }
                    Err(e) => model.refused(specs, &e),
                }
            }
            Op::Settle(i, actual) => {
                if !permits.is_empty() {
                    let at = i.index(permits.len());
                    permits[at].1.settle(actual, Instant::from_nanos(now));
                }
            }
            Op::Drop(i) => {
                if !permits.is_empty() {
                    let (_, permit, cost) = permits.swap_remove(i.index(permits.len()));
                    drop(permit);
                    for (j, s) in specs.iter().enumerate() {
                        model.held[j] -= s.holds(cost);
                    }
                }
            }
            Op::Advance(by) => now += by,
            Op::Evict => {
                let before = set.tracked_keys();
                let evicted = set.evict_idle(Instant::from_nanos(now));
                assert_eq!(set.tracked_keys(), before - evicted, "step {step}");
            }
        }
        model.assert_matches(&set, max_keys, step);
    }
    (set, model, permits)
}

proptest! {
    #![proptest_config(proptest_config(CASES))]

    #[test]
    fn stats_count_every_decision_and_tables_stay_bounded((specs, max_keys, ops) in policy_and_ops()) {
        run(&specs, max_keys, &ops);
    }

    #[test]
    fn one_limit_sets_count_every_decision(
        (spec, extra, ops) in (spec(), 0usize..=6, prop::collection::vec(op(), 1..200))
    ) {
        run(&[spec], 1 + extra, &ops);
    }

    /// Replacing the policy with itself changes no count; replacing it with one that drops
    /// the last limit and adds a new one keeps `admitted` and the survivors' counts, and the
    /// new limit starts at zero.
    #[test]
    fn replacing_the_policy_keeps_the_counts(((specs, max_keys, ops), added) in (policy_and_ops(), spec())) {
        let (set, model, permits) = run(&specs, max_keys, &ops);
        set.replace_policy(policy_of(&specs, max_keys)).expect("the same policy");
        model.assert_matches(&set, max_keys, ops.len());

        let mut next: Vec<LimitPolicy> =
            specs.iter().enumerate().map(|(i, s)| s.policy(name(i))).collect();
        next.pop();
        next.push(added.policy("added"));
        let kept = specs.len() - 1;
        let policy = next.into_iter().fold(LimitSetPolicy::new().tiers(TIERS).max_keys(max_keys), |p, l| p.limit(l));
        let before = set.stats();
        match set.replace_policy(policy) {
            Ok(()) => {
                let after = set.stats();
                prop_assert_eq!(after.admitted, before.admitted);
                prop_assert_eq!(after.limits.len(), kept + 1);
                for i in 0..kept {
                    prop_assert_eq!(&after.limits[i].name, &before.limits[i].name);
                    prop_assert_eq!(after.limits[i].refused, before.limits[i].refused);
                    prop_assert_eq!(after.limits[i].cost_above_capacity, before.limits[i].cost_above_capacity);
                }
                prop_assert_eq!(after.limits[kept].refused, 0);
                prop_assert_eq!(after.limits[kept].cost_above_capacity, 0);
                prop_assert!(set.tracked_keys() <= max_keys);
            }
            Err(e) => {
                prop_assert_eq!(e.field(), "max_keys", "{}", e);
                prop_assert_eq!(set.stats(), before);
            }
        }
        drop(permits);
    }
}

// ---------------------------------------------------------------------------------------
// The same on concrete numbers
// ---------------------------------------------------------------------------------------

#[test]
fn a_one_limit_set_counts_grants_refusals_and_impossible_costs() {
    for keyed in [false, true] {
        let limit = LimitPolicy::fixed_window("f", 2, Duration::from_secs(1)).counting_cost();
        let limit = if keyed { limit.per("tenant") } else { limit };
        let set = LimitSet::new(LimitSetPolicy::new().tiers(["tenant"]).limit(limit)).unwrap();
        let key = TenantKey::single("a").unwrap();
        let now = Instant::ZERO;
        drop(set.acquire(&key, 1, now).unwrap());
        drop(set.acquire(&key, 1, now).unwrap());
        assert!(matches!(set.acquire(&key, 1, now), Err(AcquireError::Refused(_))));
        assert!(matches!(set.acquire(&key, 1, now), Err(AcquireError::Refused(_))));
        assert!(matches!(set.acquire(&key, 3, now), Err(AcquireError::CostAboveCapacity(_))));
        let stats = set.stats();
        assert_eq!(stats.admitted, 2, "keyed {keyed}: {stats:?}");
        assert_eq!(stats.limits[0].refused, 2, "keyed {keyed}: {stats:?}");
        assert_eq!(stats.limits[0].cost_above_capacity, 1, "keyed {keyed}: {stats:?}");
        assert_eq!(stats.limits[0].tracked_keys, usize::from(keyed));
    }
}

/// The one-limit path counts in its own counters and hands them to the locked state when
/// a replace disables it; replaced back and forth, the path is disabled more than once and
/// each hand-over moves only what was counted since the last one.
#[test]
fn counts_survive_the_one_limit_path_switching_off_and_on_again() {
    let gcra = || LimitPolicy::gcra("g", Quota::per_hour(nz!(1))).counting_cost();
    let one = || LimitSetPolicy::new().limit(gcra());
    let two = || LimitSetPolicy::new().limit(gcra()).limit(LimitPolicy::semaphore("s", 4));
    let set = LimitSet::new(one()).unwrap();
    let key = TenantKey::global();
    let now = Instant::ZERO;
    let expect = |admitted: u64, refused: u64, impossible: u64| {
        let stats = set.stats();
        assert_eq!(
            (stats.admitted, stats.limits[0].refused, stats.limits[0].cost_above_capacity),
            (admitted, refused, impossible),
            "{stats:?}"
        );
    };
    drop(set.acquire(&key, 1, now).unwrap());
    for _ in 0..2 {
        assert!(matches!(set.acquire(&key, 1, now), Err(AcquireError::Refused(_))));
    }
    assert!(matches!(set.acquire(&key, 2, now), Err(AcquireError::CostAboveCapacity(_))));
    expect(1, 2, 1);
    set.replace_policy(two()).unwrap();
    expect(1, 2, 1);
    assert!(matches!(set.acquire(&key, 1, now), Err(AcquireError::Refused(_))));
    expect(1, 3, 1);
    set.replace_policy(one()).unwrap();
    for _ in 0..3 {
        assert!(matches!(set.acquire(&key, 1, now), Err(AcquireError::Refused(_))));
    }
    assert!(matches!(set.acquire(&key, 5, now), Err(AcquireError::CostAboveCapacity(_))));
    expect(1, 6, 2);
    set.replace_policy(two()).unwrap();
    expect(1, 6, 2);
    set.replace_policy(one()).unwrap();
    expect(1, 6, 2);
}

/// Law 14: a limit in shadow mode that refused a grant holds nothing of it: settling the
/// grant refunds nothing of its rate, cancelling it refunds nothing either, and releasing
/// it gives back nothing of its semaphore. (The shadow limits come after an enforcing
/// one, so that their bits are not the first.)
#[test]
fn a_shadow_limit_that_refused_is_neither_settled_cancelled_nor_released() {
    let set = LimitSet::new(
        LimitSetPolicy::new()
            .limit(LimitPolicy::gcra("open", Quota::per_second(nz!(1_000))))
            .limit(LimitPolicy::gcra("rate", Quota::per_hour(nz!(1)).burst(nz!(10))).counting_cost().shadow())
            .limit(LimitPolicy::semaphore("slots", 1).shadow()),
    )
    .unwrap();
    let key = TenantKey::global();
    let now = Instant::ZERO;
    let first = set.acquire_grant(&key, 8, now).unwrap();
    assert_eq!(first.shadow_refusals().count(), 0);
    let mut second = set.acquire_grant(&key, 8, now).unwrap();
    assert_eq!(second.shadow_refusals().map(|(name, _)| name).collect::<Vec<_>>(), ["rate", "slots"]);
    let remaining = |set: &LimitSet| set.peek(&key, now)[1].snapshot.remaining;
    let held = |set: &LimitSet| set.stats().limits[2].held;
    assert_eq!(remaining(&set), 2, "the first grant charged the shadow rate");
    set.settle_grant(&key, &mut second, 0, now);
    assert_eq!(remaining(&set), 2, "the refused grant was never charged: nothing to refund");
    let third = set.acquire_grant(&key, 8, now).unwrap();
    assert_eq!(third.shadow_refusals().count(), 2);
    set.cancel_grant(&key, third, now);
    assert_eq!(remaining(&set), 2, "nor on a cancel");
    set.release_grant(&key, second);
    assert_eq!(held(&set), 1, "the first grant still holds the shadow semaphore");
    set.release_grant(&key, first);
    assert_eq!(held(&set), 0);
}

/// Shadow refusals are counted per limit, for keyed limits (kept in the shards) as for
/// global ones.
#[test]
fn shadow_refusals_of_keyed_and_global_limits_are_counted() {
    let set = LimitSet::new(
        LimitSetPolicy::new()
            .tiers(["tenant"])
            .limit(LimitPolicy::gcra("open", Quota::per_second(nz!(1_000))))
            .limit(LimitPolicy::gcra("per-tenant", Quota::per_hour(nz!(1))).per("tenant").shadow())
            .limit(LimitPolicy::gcra("everyone", Quota::per_hour(nz!(1)).burst(nz!(2))).shadow()),
    )
    .unwrap();
    let key = TenantKey::single("a").unwrap();
    for _ in 0..4 {
        drop(set.acquire_grant(&key, 1, Instant::ZERO).unwrap());
    }
    let stats = set.stats();
    assert_eq!(stats.admitted, 4);
    let refused: Vec<u64> = stats.limits.iter().map(|l| l.shadow_refused).collect();
    assert_eq!(refused, [0, 3, 2], "{stats:?}");
}

/// A key too shallow for a shadow limit's tier would have been refused by it: the grant
/// names it, the limit counts it, and nothing is charged on its behalf.
#[test]
fn a_key_too_shallow_for_a_shadow_limit_is_its_refusal() {
    let set = LimitSet::new(
        LimitSetPolicy::new()
            .tiers(["org", "user"])
            .limit(LimitPolicy::gcra("open", Quota::per_second(nz!(1_000))))
            .limit(LimitPolicy::gcra("per-user", Quota::per_hour(nz!(1)).burst(nz!(5))).per("user").shadow()),
    )
    .unwrap();
    let org_only = TenantKey::single("acme").unwrap();
    let grant = set.acquire_grant(&org_only, 1, Instant::ZERO).unwrap();
    assert_eq!(grant.shadow_refusals().collect::<Vec<_>>(), [("per-user", Some("user"))]);
    let stats = set.stats();
    assert_eq!(stats.limits[1].shadow_refused, 1, "{stats:?}");
    assert_eq!(stats.limits[1].tracked_keys, 0, "no state made for a key without the tier");
}

/// When the table is full, the sweep's recount asks room only for the states the grant
/// will make: a shadow limit that refused makes none.
#[test]
fn a_shadow_limit_that_refused_needs_no_room_after_a_sweep() {
    let set = LimitSet::new(
        LimitSetPolicy::new()
            .tiers(["tenant"])
            .max_keys(3)
            .limit(LimitPolicy::gcra("open", Quota::per_second(nz!(1_000))))
            .limit(LimitPolicy::gcra("each", Quota::per_hour(nz!(1)).burst(nz!(10))).per("tenant").counting_cost())
            .limit(LimitPolicy::gcra("trial", Quota::per_second(nz!(1))).per("tenant").counting_cost().shadow()),
    )
    .unwrap();
    let [a, b, c] = ["a", "b", "c"].map(|t| TenantKey::single(t).unwrap());
    let at = |s: u64| Instant::from_nanos(s * 1_000_000_000);
    // a: a state on each limit; c: on `each` only (its cost of 2 is above `trial`'s burst).
    drop(set.acquire_grant(&a, 1, at(0)).unwrap());
    let for_c = set.acquire_grant(&c, 2, at(0)).unwrap();
    assert_eq!(for_c.shadow_refusals().count(), 1);
    assert_eq!(set.tracked_keys(), 3);
    // Two seconds on, a's `trial` state is idle and `each` states are not: the sweep frees
    // one place, which is all that b's grant needs (its `trial` refuses, in shadow).
    let for_b = set.acquire_grant(&b, 2, at(2)).expect("room after the sweep");
    assert_eq!(for_b.shadow_refusals().count(), 1);
    assert_eq!(set.tracked_keys(), 3);
}

/// Sets of one shadow limit decide on their own path: a global one refuses only past its
/// burst, a keyed one refuses a key too shallow for its tier.
#[test]
fn one_shadow_limit_alone_refuses_only_what_it_should() {
    let global =
        LimitSet::new(LimitSetPolicy::new().limit(LimitPolicy::gcra("trial", Quota::per_hour(nz!(1))).shadow()))
            .unwrap();
    let key = TenantKey::global();
    assert_eq!(global.acquire_grant(&key, 1, Instant::ZERO).unwrap().shadow_refusals().count(), 0);
    assert_eq!(global.acquire_grant(&key, 1, Instant::ZERO).unwrap().shadow_refusals().count(), 1);
    let stats = global.stats();
    assert_eq!((stats.admitted, stats.limits[0].shadow_refused), (2, 1), "{stats:?}");

    let keyed = LimitSet::new(
        LimitSetPolicy::new()
            .tiers(["org", "user"])
            .limit(LimitPolicy::gcra("per-user", Quota::per_hour(nz!(1)).burst(nz!(5))).per("user").shadow()),
    )
    .unwrap();
    let org_only = TenantKey::single("acme").unwrap();
    let grant = keyed.acquire_grant(&org_only, 1, Instant::ZERO).unwrap();
    assert_eq!(grant.shadow_refusals().collect::<Vec<_>>(), [("per-user", Some("user"))]);
    assert_eq!(keyed.tracked_keys(), 0);
    let stats = keyed.stats();
    assert_eq!((stats.admitted, stats.limits[0].shadow_refused), (1, 1), "{stats:?}");
}

/// A key's state is found again after its table has grown many times over (a lookup uses
/// the hash the table files it under).
#[test]
fn a_key_is_found_again_after_its_table_grew() {
    let set = LimitSet::new(
        LimitSetPolicy::new()
            .tiers(["tenant"])
            .max_keys(10_000)
            .limit(LimitPolicy::gcra("open", Quota::per_second(nz!(1_000_000))))
            .limit(LimitPolicy::gcra("each", Quota::per_hour(nz!(1))).per("tenant")),
    )
    .unwrap();
    let tenants: Vec<TenantKey> = (0..300).map(|i| TenantKey::single(format!("t{i}")).unwrap()).collect();
    for key in &tenants {
        drop(set.acquire_grant(key, 1, Instant::ZERO).unwrap());
    }
    for key in &tenants {
        assert!(
            matches!(set.acquire_grant(key, 1, Instant::ZERO), Err(AcquireError::Refused(_))),
            "{key:?} was served twice"
        );
    }
    assert_eq!(set.tracked_keys(), 300);
}

/// A settle up of a grant whose state was evicted brings the state back with the charge
/// when a sweep makes room, even if the table was full of idle states when it came.
#[test]
fn a_charge_after_eviction_comes_back_when_a_sweep_makes_room() {
    let set = LimitSet::new(
        LimitSetPolicy::new()
            .tiers(["tenant"])
            .max_keys(2)
            .limit(LimitPolicy::token_bucket("tokens", Quota::per_second(nz!(10))).counting_cost().per("tenant")),
    )
    .unwrap();
    let [a, b, c] = ["a", "b", "c"].map(|t| TenantKey::single(t).unwrap());
    let at = |s: u64| Instant::from_nanos(s * 1_000_000_000);
    let mut grant = set.acquire_grant(&a, 1, at(0)).unwrap();
    drop(set.acquire_grant(&b, 1, at(10)).unwrap());
    // Full: the sweep evicts a's state, idle since it refilled.
    drop(set.acquire_grant(&c, 1, at(10)).unwrap());
    assert_eq!(set.tracked_keys(), 2);
    // Later b and c are idle too; the table is full of them when a's settle comes.
    set.settle_grant(&a, &mut grant, 6, at(20));
    assert_eq!(set.peek(&a, at(20))[0].snapshot.remaining, 5, "the charge of 5 came back with the state");
    assert_eq!(set.tracked_keys(), 1);
}

/// A table full of active keys, behind a global limit (so the set takes its path for
/// several limits): a sweep that finds nothing idle refuses the new key.
#[test]
fn a_full_table_refuses_after_a_sweep_that_frees_nothing() {
    let set = LimitSet::new(
        LimitSetPolicy::new()
            .tiers(["tenant"])
            .max_keys(4)
            .limit(LimitPolicy::gcra("global", Quota::per_second(nz!(1000))))
            .limit(LimitPolicy::semaphore("slots", 1).per("tenant")),
    )
    .unwrap();
    let mut held = Vec::new();
    let mut full = 0;
    for i in 0..12 {
        match set.acquire_owned(&TenantKey::single(format!("t{i}")).unwrap(), 1, Instant::ZERO) {
            Ok(p) => held.push(p),
            Err(AcquireError::KeyTableFull(e)) => {
                assert_eq!(e.max_keys(), 4);
                full += 1;
            }
            Err(e) => panic!("{e}"),
        }
        assert!(set.tracked_keys() <= 4, "{} keys tracked after t{i}", set.tracked_keys());
    }
    assert_eq!(held.len(), set.tracked_keys());
    assert_eq!(held.len() + full, 12);
    assert!(full >= 8);
}

#[test]
fn a_grant_holds_concurrency_only_with_a_semaphore() {
    let key = TenantKey::single("a").unwrap();
    let rates = LimitSet::new(LimitSetPolicy::new().limit(LimitPolicy::gcra("g", Quota::per_second(nz!(10))))).unwrap();
    let grant = rates.acquire_grant(&key, 1, Instant::ZERO).unwrap();
    assert!(!grant.holds_concurrency());
    rates.release_grant(&key, grant);

    let slots = LimitSet::new(
        LimitSetPolicy::new()
            .limit(LimitPolicy::gcra("g", Quota::per_second(nz!(10))))
            .limit(LimitPolicy::semaphore("s", 1)),
    )
    .unwrap();
    let grant = slots.acquire_grant(&key, 1, Instant::ZERO).unwrap();
    assert!(grant.holds_concurrency());
    assert!(matches!(slots.acquire_grant(&key, 1, Instant::ZERO), Err(AcquireError::Refused(_))));
    slots.release_grant(&key, grant);
    let again = slots.acquire_grant(&key, 1, Instant::ZERO).unwrap();
    slots.release_grant(&key, again);
    assert_eq!(slots.stats().limits[1].held, 0);
}

/// A full table that a sweep makes room in admits a key whose broader tier is already
/// tracked: only the states the key lacks count against the bound.
#[test]
fn after_a_sweep_only_the_states_a_key_lacks_need_room() {
    let set = LimitSet::new(
        LimitSetPolicy::new()
            .tiers(["org", "user"])
            .max_keys(4)
            .limit(LimitPolicy::gcra("org-rate", Quota::per_hour(nz!(1000))).per("org"))
            .limit(LimitPolicy::semaphore("user-slots", 1).per("user")),
    )
    .unwrap();
    let key = |org: &str, user: &str| TenantKey::new([org, user]).unwrap();
    let now = Instant::ZERO;
    // o1 and o1/u1, held: active.
    let held = set.acquire_owned(&key("o1", "u1"), 1, now).unwrap();
    // o2 (active: its rate is in debt) and o2/u2 (idle once its permit is dropped).
    drop(set.acquire_owned(&key("o2", "u2"), 1, now).unwrap());
    assert_eq!(set.tracked_keys(), 4);
    // o1/u3 needs one state (o1 is tracked): the sweep frees o2/u2, which is room enough.
    let third = set.acquire_owned(&key("o1", "u3"), 1, now);
    assert!(third.is_ok(), "{:?}", third.err().map(|e| describe(&e)));
    assert_eq!(set.tracked_keys(), 4);
    // A new org needs two states, and nothing idle is left: refused.
    assert!(matches!(set.acquire_owned(&key("o3", "u4"), 1, now), Err(AcquireError::KeyTableFull(_))));
    drop((held, third));
}

/// A `Grant` settles and cancels like a permit: settling up takes the difference from the
/// limit, cancelling gives everything back; and the set, its permits and its grants say
/// what they are in `Debug`.
#[test]
fn grants_settle_and_cancel_like_permits() {
    let set = LimitSet::new(
        LimitSetPolicy::new()
            .tiers(["tenant"])
            .limit(LimitPolicy::gcra("tokens", Quota::per_hour(nz!(100))).per("tenant").counting_cost())
            .limit(LimitPolicy::semaphore("slots", 2)),
    )
    .unwrap();
    let key = TenantKey::single("a").unwrap();
    let now = Instant::ZERO;
    let remaining = |set: &LimitSet| set.peek(&key, now).iter().map(|s| s.snapshot.remaining).collect::<Vec<_>>();
    let mut grant = set.acquire_grant(&key, 10, now).unwrap();
    assert_eq!(remaining(&set), [90, 1]);
    set.settle_grant(&key, &mut grant, 30, now);
    assert_eq!(remaining(&set), [70, 1], "settled up by 20");
    set.settle_grant(&key, &mut grant, 5, now);
    assert_eq!(remaining(&set), [95, 1], "settled down to 5");
    set.cancel_grant(&key, grant, now);
    assert_eq!(remaining(&set), [100, 2], "cancelled: everything back");

    let debug = format!("{set:?}");
    assert!(debug.contains("LimitSet") && debug.contains("tokens") && debug.contains("slots"), "{debug}");
    let permit = set.acquire(&key, 1, now).unwrap();
    assert!(format!("{permit:?}").contains("Permit"), "{permit:?}");
    drop(permit);
    let owned = set.acquire_owned(&key, 1, now).unwrap();
    assert!(format!("{owned:?}").contains("OwnedPermit"), "{owned:?}");
}

/// A permit moves between one cost and costs per limit as it is settled either way:
/// rate limits are charged the last settle's costs, semaphores give back what was
/// acquired, and a cancel refunds what is charged now.
#[test]
fn settles_of_one_cost_and_of_costs_per_limit_mix() {
    let set = LimitSet::new(
        LimitSetPolicy::new()
            .limit(LimitPolicy::token_bucket("tokens", Quota::per_hour(nz!(100))).counting_cost())
            .limit(LimitPolicy::semaphore("slots", 10).counting_cost()),
    )
    .unwrap();
    let key = TenantKey::global();
    let now = Instant::ZERO;
    let remaining = |set: &LimitSet| set.peek(&key, now).iter().map(|s| s.snapshot.remaining).collect::<Vec<_>>();

    let mut one = set.acquire(&key, 4, now).unwrap();
    assert_eq!(remaining(&set), [96, 6]);
    one.settle_each(&[7, 9], now);
    assert_eq!(remaining(&set), [93, 6], "settled per limit: 7 tokens, the slots unchanged");
    one.settle(2, now);
    assert_eq!(remaining(&set), [98, 6], "settled back to one cost");
    one.settle(2, now);
    assert_eq!(remaining(&set), [98, 6], "settling to the same cost changes nothing");
    one.cancel(now);
    assert_eq!(remaining(&set), [100, 10], "cancelled: the 2 charged and the 4 slots held");

    let mut each = set.acquire_each(&key, &[5, 3], now).unwrap();
    assert_eq!(remaining(&set), [95, 7]);
    each.settle(1, now);
    assert_eq!(remaining(&set), [99, 7]);
    each.settle_each(&[6, 0], now);
    assert_eq!(remaining(&set), [94, 7]);
    drop(each);
    assert_eq!(remaining(&set), [94, 10], "dropped: the 3 slots back, the 6 tokens kept");
}

/// `check` admits and refuses as `acquire` does, and holds nothing afterwards: rate
/// limits stay charged, semaphores are tested and given back at once.
#[test]
fn a_check_charges_rates_and_holds_no_concurrency() {
    let key = TenantKey::single("a").unwrap();
    let now = Instant::ZERO;
    let one =
        LimitSet::new(LimitSetPolicy::new().limit(LimitPolicy::gcra("g", Quota::per_hour(nz!(2))).counting_cost()))
            .unwrap();
    assert!(one.check(&key, 1, now).is_ok());
    assert!(one.check(&key, 1, now).is_ok());
    let refused = one.check(&key, 1, now).unwrap_err();
    assert_eq!(refused.as_refusal().map(|d| d.limit()), Some("g"));
    assert!(matches!(one.check(&key, 3, now), Err(SetError::CostAboveCapacity(_))));
    assert_eq!(one.stats().admitted, 2);

    let set = LimitSet::new(
        LimitSetPolicy::new()
            .tiers(["user"])
            .limit(LimitPolicy::gcra("rate", Quota::per_hour(nz!(3))).per("user"))
            .limit(LimitPolicy::semaphore("slots", 1)),
    )
    .unwrap();
    let remaining = |set: &LimitSet| set.peek(&key, now).iter().map(|s| s.snapshot.remaining).collect::<Vec<_>>();
    assert!(set.check(&key, 1, now).is_ok());
    assert_eq!(remaining(&set), [2, 1], "the rate is charged, the slot given back");
    let held = set.acquire(&key, 1, now).unwrap();
    let refused = set.check(&key, 1, now).unwrap_err();
    assert_eq!(refused.as_refusal().map(|d| d.limit()), Some("slots"));
    drop(held);
    assert!(set.check(&key, 1, now).is_ok());
    assert_eq!(remaining(&set), [0, 1]);
    assert!(matches!(set.check(&TenantKey::global(), 1, now), Err(SetError::MissingTier(_))));
}

/// Keys spread over the set's shards: when many tenants come, a table of `max_keys` is
/// filled to its bound, not refused early because every key went to one shard. (The
/// shards are chosen by a randomly seeded hash: 500 tenants over at most 16 shards of 4,
/// however many cores, leave one short with a probability below 1e-9.)
#[test]
fn many_tenants_fill_the_whole_table() {
    let set = LimitSet::new(
        LimitSetPolicy::new().tiers(["tenant"]).max_keys(64).limit(LimitPolicy::semaphore("slots", 1).per("tenant")),
    )
    .unwrap();
    let held: Vec<OwnedPermit> = (0..500)
        .filter_map(|i| set.acquire_owned(&TenantKey::single(format!("t{i}")).unwrap(), 1, Instant::ZERO).ok())
        .collect();
    assert_eq!(held.len(), 64);
    assert_eq!(set.tracked_keys(), 64);
}

/// How deep each tier keeps its state: what waiting uses to wake only the requests a
/// release can help (a wrong depth would wake the wrong ones, or none).
#[test]
fn tier_depth_names_how_deep_each_tier_keeps_its_state() {
    let set = LimitSet::new(
        LimitSetPolicy::new()
            .tiers(["org", "team", "user"])
            .limit(LimitPolicy::semaphore("per-team", 2).per("team"))
            .limit(LimitPolicy::semaphore("per-user", 1).per("user")),
    )
    .expect("a valid policy");
    assert_eq!(set.tier_depth("org"), Some(1));
    assert_eq!(set.tier_depth("team"), Some(2));
    assert_eq!(set.tier_depth("user"), Some(3));
    assert_eq!(set.tier_depth("region"), None);
    assert_eq!(tower_limits_core::Backend::tier_depth(&set, "user"), Some(3));
}

/// A grant made before a replace that reorders the limits settles each limit by name, not
/// by its old place in the policy.
/// A keyed semaphore that moves to another place in the policy is released by name, its
/// cost taken as the limit counted it when granted (for a policy whose semaphores are all
/// keyed, the release takes only the key's shard).
#[test]
fn a_release_after_a_reordering_replace_finds_a_keyed_semaphore_by_name() {
    let a = || LimitPolicy::gcra("a", Quota::per_hour(nz!(1)).burst(nz!(100))).per("tenant");
    let b = || LimitPolicy::gcra("b", Quota::per_hour(nz!(1)).burst(nz!(100)));
    let s = || LimitPolicy::semaphore("s", 10).per("tenant").counting_cost();
    let policy = |limits: Vec<LimitPolicy>| {
        limits.into_iter().fold(LimitSetPolicy::new().tiers(["tenant"]), LimitSetPolicy::limit)
    };
    let set = LimitSet::new(policy(vec![a(), b(), s()])).expect("a valid policy");
    let key = TenantKey::single("alice").unwrap();
    let grant = set.acquire_grant(&key, 3, Instant::ZERO).expect("granted");
    assert_eq!(set.stats().limits[2].held, 3);
    set.replace_policy(policy(vec![s(), a(), b()])).expect("a valid policy");
    assert_eq!(set.stats().limits[0].held, 3, "the hold moved with the semaphore");
    set.release_grant(&key, grant);
    assert_eq!(set.stats().limits[0].held, 0, "released by name, all 3 of it");
}

#[test]
fn a_settle_after_a_reordering_replace_finds_each_limit_by_name() {
    let a = || LimitPolicy::token_bucket("a", Quota::per_hour(nz!(1)).burst(nz!(100))).counting_cost();
    let b = || LimitPolicy::token_bucket("b", Quota::per_hour(nz!(1)).burst(nz!(100))).counting_cost();
    let s = || LimitPolicy::semaphore("s", 4);
    let set = LimitSet::new(LimitSetPolicy::new().limit(a()).limit(b()).limit(s())).expect("a valid policy");
    let key = TenantKey::global();
    let now = Instant::ZERO;
    let mut permit = set.acquire_each(&key, &[10, 30, 1], now).expect("granted");
    set.replace_policy(LimitSetPolicy::new().limit(b()).limit(a()).limit(s())).expect("a valid policy");
    permit.settle(5, now);
    let left: Vec<(&str, u64)> = set.peek(&key, now).iter().map(|l| (l.name, l.snapshot.remaining)).collect();
    assert_eq!(left, [("b", 95), ("a", 95), ("s", 3)], "each limit refunded down to 5 of what it took");
    drop(permit);
    assert_eq!(set.peek(&key, now)[2].snapshot.remaining, 4, "the semaphore found by name too");
}

#[test]
fn a_refund_for_an_evicted_key_does_not_bring_it_back() {
    // Five tokens a second, ten at most, per user; alice's grant is settled after her
    // state went idle and was forgotten.
    let set = LimitSet::new(LimitSetPolicy::new().tiers(["user"]).limit(
        LimitPolicy::token_bucket("tokens", Quota::per_second(nz!(5)).burst(nz!(10))).per("user").counting_cost(),
    ))
    .unwrap();
    let alice = TenantKey::single("alice").unwrap();
    let mut permit = set.acquire_owned(&alice, 8, Instant::ZERO).unwrap();
    assert_eq!(set.tracked_keys(), 1);
    let later = Instant::from_nanos(60_000 * MS);
    assert_eq!(set.evict_idle(later), 1, "refilled: idle");
    assert_eq!(set.tracked_keys(), 0);
    // A refund to an idle state leaves it idle: nothing to keep.
    permit.settle(2, later);
    assert_eq!(set.tracked_keys(), 0, "the refund brought an idle state back");
    // A charge adds to it: the state is brought back to carry it.
    permit.settle(10, later);
    assert_eq!(set.tracked_keys(), 1, "the charge was lost with the evicted state");
}
