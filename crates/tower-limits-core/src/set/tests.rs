//! Unit tests of the set: the one-limit and one-keyed-limit paths against the general
//! one, and the hints read without a lock.

use super::*;
use crate::nz;
use crate::policy::{LimitPolicy, LimitSetPolicy};
use crate::rate::Quota;

/// Replacing a one-limit policy by the same one keeps the lock-free path, its state
/// carried over; any other policy turns it off.
#[test]
fn the_same_one_limit_policy_keeps_the_lock_free_path() {
    let policy = || LimitSetPolicy::new().limit(LimitPolicy::gcra("r", Quota::per_second(nz!(10)).burst(nz!(5))));
    let set = LimitSet::new(policy()).unwrap();
    let key = TenantKey::global();
    assert!(set.shared.fast_live().is_some());
    drop(set.acquire(&key, 1, Instant::ZERO).unwrap());
    set.replace_policy(policy()).unwrap();
    assert!(set.shared.fast_live().is_some(), "the very same limit");
    assert_eq!(set.peek(&key, Instant::ZERO)[0].snapshot.remaining, 4, "its state carried over");
    set.replace_policy(LimitSetPolicy::new().limit(LimitPolicy::gcra("r", Quota::per_second(nz!(10)).burst(nz!(6)))))
        .unwrap();
    assert!(set.shared.fast_live().is_none(), "another burst");
    set.replace_policy(policy()).unwrap();
    assert!(set.shared.fast_live().is_some(), "back to the first limit: on again");
    assert_eq!(set.peek(&key, Instant::ZERO)[0].snapshot.remaining, 4, "with the state it had");
}

/// A read of a one-limit set raises its instant to the latest grant, as decisions do.
#[test]
fn a_peek_at_an_earlier_instant_reads_the_state_as_of_the_latest_grant() {
    let set =
        LimitSet::new(LimitSetPolicy::new().limit(LimitPolicy::gcra("r", Quota::per_second(nz!(1)).burst(nz!(5)))))
            .unwrap();
    let key = TenantKey::global();
    let at = |s: u64| Instant::from_nanos(s * 1_000_000_000);
    drop(set.acquire(&key, 1, at(10)).unwrap());
    assert_eq!(set.peek(&key, at(0))[0].snapshot.remaining, 4);
}

/// The one-keyed-limit path, for the law below: the same policy, with the path on
/// (`true`) or with its hint forced off so that every acquisition takes the general
/// path. One shard (`max_keys` below 8), so that both sets evict alike.
fn one_keyed_set(limit: usize, tier: usize, on: bool) -> LimitSet {
    let tiers = ["org", "user"];
    let policy = match limit {
        0 => LimitPolicy::gcra("r", Quota::per_second(nz!(10)).burst(nz!(3))),
        1 => LimitPolicy::token_bucket("t", Quota::per_second(nz!(20)).burst(nz!(8))).counting_cost(),
        2 => LimitPolicy::semaphore("c", 2),
        _ => LimitPolicy::sliding_window_counter("w", 4, std::time::Duration::from_millis(500)),
    };
    let set = LimitSet::new(LimitSetPolicy::new().tiers(tiers).max_keys(3).limit(policy.per(tiers[tier]))).unwrap();
    assert!(set.shared.one_keyed.load(Ordering::Relaxed), "a set of one keyed limit takes its own path");
    set.shared.one_keyed.store(on, Ordering::Relaxed);
    set
}

/// Grants two twin sets hold, each with the index of its key.
type Held = Vec<(usize, Grant, Grant)>;

/// One step of the same operation on two twin sets, which must give the same answers and
/// then show the same snapshots of every key and the same counters: `op` 0 and 1 acquire
/// `keys[k]` at `cost`, 2 acquires it at a cost per limit, 3 releases and 4 cancels the
/// oldest grant held, and 5 settles it to `cost`.
fn step_twins(
    (a, b): (&LimitSet, &LimitSet),
    keys: &[TenantKey],
    held: &mut Held,
    (op, k, cost): (u8, usize, u64),
    now: Instant,
) -> Result<(), proptest::test_runner::TestCaseError> {
    let key = &keys[k];
    match op {
        0 | 1 => {
            let (x, y) = (a.acquire_grant(key, cost, now), b.acquire_grant(key, cost, now));
            proptest::prop_assert_eq!(format!("{:?}", x.as_ref().err()), format!("{:?}", y.as_ref().err()));
            if let (Ok(x), Ok(y)) = (x, y) {
                held.push((k, x, y));
            }
        }
        2 => {
            let each = [cost, cost / 2, cost + 1];
            let each = &each[..a.limit_names().len().min(each.len())];
            let (x, y) = (a.acquire_each(key, each, now), b.acquire_each(key, each, now));
            proptest::prop_assert_eq!(format!("{:?}", x.as_ref().err()), format!("{:?}", y.as_ref().err()));
        }
        3 | 4 if !held.is_empty() => {
            let (k, x, y) = held.remove(0);
            if op == 3 {
                a.release_grant(&keys[k], x);
                b.release_grant(&keys[k], y);
            } else {
                a.cancel_grant(&keys[k], x, now);
                b.cancel_grant(&keys[k], y, now);
            }
        }
        _ => {
            if let Some((k, x, y)) = held.first_mut() {
                a.settle_grant(&keys[*k], x, cost, now);
                b.settle_grant(&keys[*k], y, cost, now);
            }
        }
    }
    for key in keys {
        proptest::prop_assert_eq!(a.peek(key, now), b.peek(key, now));
    }
    proptest::prop_assert_eq!(a.stats(), b.stats());
    Ok(())
}

proptest::proptest! {
    /// A set of one keyed limit decides on its own path exactly as on the general one:
    /// the same answers (each refusal to the field), the same snapshots and the same
    /// counters, over keys of every form (numbers, addresses, text, two tiers, and
    /// keys too shallow for the limit), with grants held, released, settled and
    /// cancelled, costs per limit, and a key table small enough to fill and evict.
    #[test]
    fn the_one_keyed_path_decides_as_the_general_path(
        limit in 0..4usize,
        tier in 0..2usize,
        steps in proptest::collection::vec((0..6u8, 0..7usize, 0..6u64, 0..400_000_000u64), 1..80),
    ) {
        use std::net::{IpAddr, Ipv4Addr};
        use crate::key::KeyPart;
        let keys = [
            TenantKey::from_u64(1),
            TenantKey::from_u64(2),
            TenantKey::single("acme").unwrap(),
            TenantKey::from_parts([KeyPart::Text("acme"), KeyPart::Number(7)]).unwrap(),
            TenantKey::from_parts([KeyPart::Ip(IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1))), KeyPart::Text("bob")]).unwrap(),
            TenantKey::from_ip(IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1))),
            TenantKey::global(),
        ];
        let (fast, general) = (one_keyed_set(limit, tier, true), one_keyed_set(limit, tier, false));
        let mut held = Held::new();
        let mut now = Instant::ZERO;
        for (op, k, cost, dt) in steps {
            now = Instant::from_nanos(now.as_nanos() + dt);
            step_twins((&fast, &general), &keys, &mut held, (op, k, cost), now)?;
        }
    }
}

/// The one-keyed hint may be stale as well: a set whose policy is no longer one keyed
/// limit finds that out under the shard's lock and decides on the general path; and
/// a replace sets the hint for the policy it installs.
#[test]
fn a_stale_one_keyed_hint_still_reaches_every_limit() {
    let one = || {
        LimitSetPolicy::new()
            .tiers(["tenant"])
            .limit(LimitPolicy::gcra("each", Quota::per_second(nz!(1_000))).per("tenant"))
    };
    let set = LimitSet::new(one().limit(LimitPolicy::gcra("everyone", Quota::per_hour(nz!(1))))).unwrap();
    assert!(!set.shared.one_keyed.load(Ordering::Relaxed));
    set.shared.one_keyed.store(true, Ordering::Relaxed);
    let alice = TenantKey::single("alice").unwrap();
    assert!(set.acquire_grant(&alice, 1, Instant::ZERO).is_ok());
    match set.acquire_grant(&alice, 1, Instant::ZERO) {
        Err(AcquireError::Refused(d)) => assert_eq!(d.limit(), "everyone", "the global limit was charged"),
        other => panic!("{other:?}"),
    }
    set.replace_policy(one()).unwrap();
    assert!(set.shared.one_keyed.load(Ordering::Relaxed), "one keyed limit now");
    set.replace_policy(one().limit(LimitPolicy::gcra("everyone", Quota::per_hour(nz!(1))))).unwrap();
    assert!(!set.shared.one_keyed.load(Ordering::Relaxed), "two limits again");
}

/// The lock-order hint may be stale: an acquisition that read it before a replace
/// added keyed limits finds them under the global lock, and takes the shard in order.
/// (The race cannot be staged through the public API; here the hint is made stale by
/// hand.)
#[test]
fn a_stale_lock_order_hint_still_reaches_the_keyed_limits() {
    let set = LimitSet::new(
        LimitSetPolicy::new()
            .tiers(["tenant"])
            .limit(LimitPolicy::gcra("everyone", Quota::per_second(nz!(1_000))))
            .limit(LimitPolicy::gcra("each", Quota::per_hour(nz!(1))).per("tenant")),
    )
    .unwrap();
    set.shared.tiered.store(false, Ordering::Release);
    let alice = TenantKey::single("alice").unwrap();
    assert!(set.acquire_grant(&alice, 1, Instant::ZERO).is_ok());
    assert!(
        matches!(set.acquire_grant(&alice, 1, Instant::ZERO), Err(AcquireError::Refused(_))),
        "the first grant was charged on alice's own limit"
    );
    assert_eq!(set.tracked_keys(), 1);
}

/// A tenant's GCRA and concurrency, and a global bucket: the set of three of `peers`,
/// with room for many tenants in one shard.
fn set_of_three(max_keys: usize) -> LimitSet {
    LimitSet::new(
        LimitSetPolicy::new()
            .tiers(["tenant"])
            .max_keys(max_keys)
            .limit(LimitPolicy::gcra("requests", Quota::per_second(nz!(1_000))).per("tenant"))
            .limit(LimitPolicy::token_bucket("tokens", Quota::per_second(nz!(1_000_000))).counting_cost())
            .limit(LimitPolicy::semaphore("concurrent", 2).per("tenant")),
    )
    .unwrap()
}

fn held(set: &LimitSet) -> u64 {
    set.stats().limits[2].held
}

/// A grant keeps the place of its tenant's semaphore state when it found one, and not
/// when it created it; a grant stays 56 bytes with it.
#[test]
fn a_grant_keeps_the_place_of_the_state_it_found() {
    assert_eq!(std::mem::size_of::<Grant>(), 56);
    let set = set_of_three(1_000);
    let acme = TenantKey::single("acme").unwrap();
    let first = set.acquire(&acme, 1, Instant::ZERO).unwrap();
    assert_eq!(first.grant.held, HeldAt::NONE, "the state was created");
    let second = set.acquire(&acme, 1, Instant::ZERO).unwrap();
    let (shard, _) = second.grant.held.get().expect("the state was found");
    assert_eq!(shard, set.shared.shard_index(set.shared.root_hash(&acme)));
    drop((first, second));
    assert_eq!(held(&set), 0);
    // A set of one keyed semaphore (its own short path) keeps it too.
    let one =
        LimitSet::new(LimitSetPolicy::new().tiers(["tenant"]).limit(LimitPolicy::semaphore("c", 2).per("tenant")))
            .unwrap();
    let first = one.acquire(&acme, 1, Instant::ZERO).unwrap();
    assert_eq!(first.grant.held, HeldAt::NONE, "the state was created");
    let second = one.acquire(&acme, 1, Instant::ZERO).unwrap();
    assert!(second.grant.held.get().is_some(), "the state was found");
    assert!(one.acquire(&acme, 1, Instant::ZERO).is_err(), "both permits held");
    drop(second);
    assert_eq!(one.stats().limits[0].held, 1, "the release by place gave one back");
    drop(first);
    assert_eq!(one.stats().limits[0].held, 0);
    // A policy with two keyed semaphores keeps no place.
    let two = LimitSet::new(
        LimitSetPolicy::new()
            .tiers(["org", "user"])
            .limit(LimitPolicy::semaphore("org", 4).per("org"))
            .limit(LimitPolicy::semaphore("user", 4).per("user")),
    )
    .unwrap();
    let alice = TenantKey::new(["acme", "alice"]).unwrap();
    let _first = two.acquire(&alice, 1, Instant::ZERO).unwrap();
    assert_eq!(two.acquire(&alice, 1, Instant::ZERO).unwrap().grant.held, HeldAt::NONE);
}

/// A release by the kept place gives back exactly its own tenant's permit, after the
/// table grew and moved every state (so that the place now holds another tenant's, or
/// nothing), and after a replace.
#[test]
fn a_release_by_its_place_gives_back_its_own_tenant_only() {
    let set = set_of_three(100_000);
    let key = |i: u32| TenantKey::single(format!("tenant-{i}")).unwrap();
    let tenants: Vec<TenantKey> = (0..2_000).map(key).collect();
    // Every tenant's state exists; each then holds one permit whose grant kept its place.
    for k in &tenants {
        drop(set.acquire(k, 1, Instant::ZERO).unwrap());
    }
    let early: Vec<Grant> = tenants[..50].iter().map(|k| set.acquire_grant(k, 1, Instant::ZERO).unwrap()).collect();
    assert!(early.iter().all(|g| g.held.get().is_some()));
    // Thousands more tenants, each holding a permit: the tables grow, every state moves,
    // and the kept places now hold other tenants' states.
    let more: Vec<TenantKey> = (2_000..20_000).map(key).collect();
    let others: Vec<Grant> = more.iter().map(|k| set.acquire_grant(k, 1, Instant::ZERO).unwrap()).collect();
    assert_eq!(held(&set), 50 + 18_000);
    for (k, g) in tenants[..50].iter().zip(early) {
        set.release_grant(k, g);
        assert_eq!(set.peek(k, Instant::ZERO)[2].snapshot.remaining, 2, "{k:?} gave its permit back");
    }
    assert_eq!(held(&set), 18_000, "no other tenant lost one");
    for (k, g) in more.iter().zip(others) {
        set.release_grant(k, g);
    }
    assert_eq!(held(&set), 0);

    // After a replace the place is not trusted: the release goes by the key, and still
    // gives the permit back.
    let acme = TenantKey::single("acme").unwrap();
    drop(set.acquire(&acme, 1, Instant::ZERO).unwrap());
    let acme_grant = set.acquire_grant(&acme, 1, Instant::ZERO).unwrap();
    assert!(acme_grant.held.get().is_some());
    let policy = LimitSetPolicy::new()
        .tiers(["tenant"])
        .max_keys(100_000)
        .limit(LimitPolicy::semaphore("concurrent", 2).per("tenant"))
        .limit(LimitPolicy::gcra("requests", Quota::per_second(nz!(1_000))).per("tenant"));
    set.replace_policy(policy).unwrap();
    assert_eq!(set.stats().limits[0].held, 1, "the permit moved with the limit");
    set.release_grant(&acme, acme_grant);
    assert_eq!(set.stats().limits[0].held, 0);
}

/// The kept place packs and unpacks every table, the largest shard and the largest
/// bucket it can hold; anything larger is not kept.
#[test]
fn a_kept_place_is_what_was_packed() {
    use crate::table::Place;
    let max_bucket = (1 << 23) - 1;
    for place in [Place::Short(0), Place::Number(7), Place::Long(max_bucket), Place::Short(12_345)] {
        for shard in [0, 1, 77, shard::MAX_SHARDS - 1] {
            let (got_shard, got) = HeldAt::new(shard, place).get().expect("kept");
            assert_eq!((got_shard, got.parts()), (shard, place.parts()));
        }
    }
    assert_eq!(HeldAt::new(0, Place::Short(max_bucket + 1)), HeldAt::NONE);
    assert_eq!(HeldAt::new(shard::MAX_SHARDS, Place::Short(0)), HeldAt::NONE);
    assert_eq!(HeldAt::NONE.get().map(|(s, p)| (s, p.parts())), None);
}

/// A grant of an earlier policy never gives back to a semaphore it did not hold, even
/// when the new semaphore's state sits at the very place the grant kept (one tenant in
/// a table of the same size, so the same bucket).
#[test]
fn a_kept_place_is_not_trusted_across_a_replace() {
    let policy = |name: &'static str| {
        LimitSetPolicy::new()
            .tiers(["tenant"])
            .max_keys(8)
            .limit(LimitPolicy::gcra("requests", Quota::per_second(nz!(1_000))).per("tenant"))
            .limit(LimitPolicy::semaphore(name, 2).per("tenant"))
    };
    let set = LimitSet::new(policy("concurrent")).unwrap();
    let acme = TenantKey::single("acme").unwrap();
    drop(set.acquire(&acme, 1, Instant::ZERO).unwrap());
    let old = set.acquire_grant(&acme, 1, Instant::ZERO).unwrap();
    let (_, kept) = old.held.get().expect("kept");
    set.replace_policy(policy("connections")).unwrap();
    drop(set.acquire(&acme, 1, Instant::ZERO).unwrap());
    let new = set.acquire_grant(&acme, 1, Instant::ZERO).unwrap();
    let (_, place) = new.held.get().expect("kept");
    assert_eq!(place.parts(), kept.parts(), "the new state sits where the old one did");
    set.release_grant(&acme, old);
    assert_eq!(set.stats().limits[1].held, 1, "the new semaphore still holds its grant");
    set.release_grant(&acme, new);
    assert_eq!(set.stats().limits[1].held, 0);
}

/// The release by place is taken when the place holds (and gives back there), and turned
/// down when the grant's policy is no longer the current one, when the set has a global
/// semaphore too, or when the grant holds nothing of that semaphore (a shadow refusal).
#[test]
fn the_release_by_place_is_taken_only_when_it_holds() {
    let acme = TenantKey::single("acme").unwrap();
    let kept = |set: &LimitSet| {
        drop(set.acquire(&acme, 1, Instant::ZERO).unwrap());
        let grant = set.acquire_grant(&acme, 1, Instant::ZERO).unwrap();
        let (shard, place) = grant.held.get().expect("kept");
        (grant, shard, place)
    };
    let set = set_of_three(1_000);
    let (grant, shard, place) = kept(&set);
    let shape = grant.shape.expect("a semaphore");
    assert_eq!(held(&set), 1);
    assert!(set.shared.release_at(&acme, &grant, shape, shard, place));
    assert_eq!(held(&set), 0);
    // After a replace by the same policy (a new version), the place is turned down.
    let (grant, shard, place) = kept(&set);
    set.replace_policy(
        LimitSetPolicy::new()
            .tiers(["tenant"])
            .max_keys(1_000)
            .limit(LimitPolicy::gcra("requests", Quota::per_second(nz!(1_000))).per("tenant"))
            .limit(LimitPolicy::token_bucket("tokens", Quota::per_second(nz!(1_000_000))).counting_cost())
            .limit(LimitPolicy::semaphore("concurrent", 2).per("tenant")),
    )
    .unwrap();
    assert!(!set.shared.release_at(&acme, &grant, shape, shard, place));
    set.release_grant(&acme, grant);
    assert_eq!(held(&set), 0);

    // A set with a global semaphore beside its keyed one releases both by the general
    // correction.
    let both = LimitSet::new(
        LimitSetPolicy::new()
            .tiers(["tenant"])
            .limit(LimitPolicy::semaphore("tenant", 4).per("tenant"))
            .limit(LimitPolicy::semaphore("all", 4)),
    )
    .unwrap();
    let (grant, shard, place) = kept(&both);
    assert!(!both.shared.release_at(&acme, &grant, grant.shape.expect("a semaphore"), shard, place));
    both.release_grant(&acme, grant);
    assert_eq!(both.stats().limits.iter().map(|l| l.held).collect::<Vec<_>>(), [0, 0]);

    // A shadow semaphore that refused holds nothing: its place is turned down.
    let shadow = LimitSet::new(
        LimitSetPolicy::new()
            .tiers(["tenant"])
            .limit(LimitPolicy::gcra("requests", Quota::per_second(nz!(1_000))).per("tenant"))
            .limit(LimitPolicy::semaphore("trial", 1).per("tenant").shadow()),
    )
    .unwrap();
    let (first, _, _) = kept(&shadow);
    let refused = shadow.acquire_grant(&acme, 1, Instant::ZERO).unwrap();
    assert_eq!(refused.shadow_refusals().count(), 1);
    let (shard, place) = refused.held.get().expect("the state was found");
    assert!(!shadow.shared.release_at(&acme, &refused, refused.shape.expect("a semaphore"), shard, place));
    shadow.release_grant(&acme, refused);
    assert_eq!(shadow.stats().limits[1].held, 1, "the first grant still holds its permit");
    shadow.release_grant(&acme, first);
    assert_eq!(shadow.stats().limits[1].held, 0);
}

/// A set whose one global rate limit sits beside keyed ones, for the law below: the
/// global limit (a GCRA counting requests, or a token bucket counting cost) at place
/// `at` among a per-user GCRA and a per-org semaphore, in its atomic (`on`) or handed
/// to the lock before the first call, so that every acquisition takes the global lock.
/// One shard (`max_keys` below 8), so that both sets evict alike.
fn global_beside_set(global: usize, at: usize, on: bool) -> LimitSet {
    let mut limits = vec![
        LimitPolicy::gcra("per-user", Quota::per_second(nz!(20)).burst(nz!(4))).per("user"),
        LimitPolicy::semaphore("per-org", 3).per("org"),
    ];
    let everyone = match global {
        0 => LimitPolicy::gcra("everyone", Quota::per_second(nz!(10)).burst(nz!(5))),
        _ => LimitPolicy::token_bucket("everyone", Quota::per_second(nz!(30)).burst(nz!(12))).counting_cost(),
    };
    limits.insert(at, everyone);
    let policy = limits.into_iter().fold(LimitSetPolicy::new().tiers(["org", "user"]).max_keys(6), |p, l| p.limit(l));
    let set = LimitSet::new(policy).unwrap();
    assert!(set.shared.fast.is_none(), "not the one-limit path");
    let fast = set.shared.fast_global.as_ref().expect("the global limit beside keyed ones is lock-free");
    assert_eq!(fast.index(), at);
    if !on {
        // Fresh, the locked state is the atomic's: nothing to hand back.
        assert!(fast.disable().is_some());
    }
    set
}

proptest::proptest! {
    /// A set's global rate limit decides in its atomic, beside keyed limits, exactly as
    /// under the global lock: the same answers (each refusal to the field, its wait
    /// covering every limit), the same snapshots and the same counters, with grants held,
    /// released, settled and cancelled, costs per limit, keys too shallow for a limit,
    /// the global key, and a key table small enough to fill and evict.
    #[test]
    fn the_global_atomic_decides_as_the_global_lock(
        global in 0..2usize,
        at in 0..3usize,
        steps in proptest::collection::vec((0..6u8, 0..5usize, 0..8u64, 0..200_000_000u64), 1..80),
    ) {
        let keys = [
            TenantKey::new(["acme", "alice"]).unwrap(),
            TenantKey::new(["acme", "bob"]).unwrap(),
            TenantKey::new(["globex", "carol"]).unwrap(),
            TenantKey::single("acme").unwrap(),
            TenantKey::global(),
        ];
        let (fast, locked) = (global_beside_set(global, at, true), global_beside_set(global, at, false));
        let mut held = Held::new();
        let mut now = Instant::ZERO;
        for (op, k, cost, dt) in steps {
            now = Instant::from_nanos(now.as_nanos() + dt);
            step_twins((&fast, &locked), &keys, &mut held, (op, k, cost), now)?;
        }
    }
}

/// A replace keeps the global limit's atomic when the new policy has the very same limit
/// at the same place beside keyed ones, its state carried over; any other turns it off,
/// the state handed to the lock, and a later replace back turns it on with that state.
#[test]
fn the_same_global_limit_beside_keyed_ones_keeps_its_atomic() {
    let with = |burst: u64| {
        LimitSetPolicy::new()
            .tiers(["tenant"])
            .limit(LimitPolicy::gcra("each", Quota::per_second(nz!(1_000))).per("tenant"))
            .limit(
                LimitPolicy::token_bucket("everyone", Quota::per_second(nz!(10)).try_burst(burst).unwrap())
                    .counting_cost(),
            )
    };
    let set = LimitSet::new(with(8)).unwrap();
    let alice = TenantKey::single("alice").unwrap();
    let remaining = |set: &LimitSet| set.peek(&alice, Instant::ZERO)[1].snapshot.remaining;
    assert!(set.shared.fast_global_live().is_some());
    drop(set.acquire(&alice, 3, Instant::ZERO).unwrap());
    assert_eq!(remaining(&set), 5);
    set.replace_policy(with(8)).unwrap();
    assert!(set.shared.fast_global_live().is_some(), "the very same limit");
    assert_eq!(remaining(&set), 5, "its state carried over");
    set.replace_policy(with(9)).unwrap();
    assert!(set.shared.fast_global_live().is_none(), "another burst");
    assert_eq!(remaining(&set), 5, "the state under the lock: the bucket's credit, in a bigger bucket");
    drop(set.acquire(&alice, 1, Instant::ZERO).unwrap());
    set.replace_policy(with(8)).unwrap();
    assert!(set.shared.fast_global_live().is_some(), "back to the first limit: on again");
    assert_eq!(remaining(&set), 4, "with the state it had");
    // A refusal by the atomic names the limit at its place, and its wait.
    match set.acquire(&alice, 5, Instant::ZERO) {
        Err(AcquireError::Refused(d)) => {
            assert_eq!((d.limit(), d.limit_index(), d.tier()), ("everyone", 1, None));
            assert_eq!(d.retry_after(), std::time::Duration::from_millis(100));
        }
        other => panic!("{other:?}"),
    }
    let stats = set.stats();
    assert_eq!((stats.admitted, stats.limits[1].refused), (2, 1));
}

/// Of equal waits the later limit names a refusal, whether or not the global limit is in
/// its atomic (decided after the others) or under the lock (in the policy's order).
#[test]
fn of_equal_waits_the_later_limit_names_the_refusal_either_way() {
    for at in 0..2 {
        let mut named = Vec::new();
        for on in [true, false] {
            let mut limits = vec![LimitPolicy::gcra("each", Quota::per_second(nz!(10)).burst(nz!(1))).per("tenant")];
            limits.insert(at, LimitPolicy::gcra("everyone", Quota::per_second(nz!(10)).burst(nz!(1))));
            let set =
                LimitSet::new(limits.into_iter().fold(LimitSetPolicy::new().tiers(["tenant"]), |p, l| p.limit(l)))
                    .unwrap();
            if !on {
                assert!(set.shared.fast_global.as_ref().and_then(Fast::disable).is_some());
            }
            let alice = TenantKey::single("alice").unwrap();
            drop(set.acquire(&alice, 1, Instant::ZERO).unwrap());
            match set.acquire(&alice, 1, Instant::ZERO) {
                Err(AcquireError::Refused(d)) => {
                    assert_eq!(d.retry_after(), std::time::Duration::from_millis(100));
                    named.push(d.limit_index());
                }
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(named, [1, 1], "the global limit at {at}");
    }
}

proptest::proptest! {
    /// A set of one global token bucket takes the one-limit path, as its GCRA, and decides
    /// exactly as the bucket under the lock: the same answers, snapshots and counters,
    /// through grants settled (refunds and charges) and cancelled.
    #[test]
    fn a_lone_token_bucket_decides_in_its_atomic_as_under_the_lock(
        counting_cost in proptest::bool::ANY,
        steps in proptest::collection::vec((0..4u8, 0..12u64, 0..300_000_000u64), 1..80),
    ) {
        let bucket = || {
            let limit = LimitPolicy::token_bucket("tokens", Quota::per_second(nz!(40)).burst(nz!(10)));
            let limit = if counting_cost { limit.counting_cost() } else { limit };
            LimitSet::new(LimitSetPolicy::new().limit(limit)).unwrap()
        };
        let (fast, locked) = (bucket(), bucket());
        proptest::prop_assert!(fast.shared.fast_live().is_some(), "a lone bucket is lock-free");
        proptest::prop_assert!(locked.shared.fast.as_ref().and_then(Fast::disable).is_some());
        let key = TenantKey::global();
        let mut held: Vec<(Grant, Grant)> = Vec::new();
        let mut now = Instant::ZERO;
        for (op, cost, dt) in steps {
            now = Instant::from_nanos(now.as_nanos() + dt);
            match op {
                0 | 1 => {
                    let (a, b) = (fast.acquire_grant(&key, cost, now), locked.acquire_grant(&key, cost, now));
                    proptest::prop_assert_eq!(format!("{:?}", a.as_ref().err()), format!("{:?}", b.as_ref().err()));
                    if let (Ok(a), Ok(b)) = (a, b) {
                        held.push((a, b));
                    }
                }
                2 if !held.is_empty() => {
                    let (a, b) = held.remove(0);
                    fast.cancel_grant(&key, a, now);
                    locked.cancel_grant(&key, b, now);
                }
                _ => {
                    if let Some((a, b)) = held.first_mut() {
                        fast.settle_grant(&key, a, cost, now);
                        locked.settle_grant(&key, b, cost, now);
                    }
                }
            }
            proptest::prop_assert_eq!(fast.peek(&key, now), locked.peek(&key, now));
            proptest::prop_assert_eq!(fast.stats(), locked.stats());
        }
    }
}

/// The global key of a set whose keyed limits are all in shadow mode decides under the
/// global lock, and there too the global limit's atomic rules, not the state the lock
/// last held for it: here that state is a grant behind, and the grant was cancelled since.
#[test]
fn the_global_key_decides_on_the_atomic_not_on_the_locked_state() {
    let with = |burst: u64| {
        LimitSetPolicy::new()
            .tiers(["tenant"])
            .limit(LimitPolicy::gcra("each", Quota::per_second(nz!(1))).per("tenant").shadow())
            .limit(LimitPolicy::gcra("everyone", Quota::per_second(nz!(1)).try_burst(burst).unwrap()).counting_cost())
    };
    let set = LimitSet::new(with(2)).unwrap();
    let everyone = TenantKey::global();
    let grant = set.acquire_grant(&everyone, 2, Instant::ZERO).unwrap();
    // Off and on again: the locked state keeps the two units spent.
    set.replace_policy(with(3)).unwrap();
    set.replace_policy(with(2)).unwrap();
    assert!(set.shared.fast_global_live().is_some());
    set.cancel_grant(&everyone, grant, Instant::ZERO);
    assert!(set.acquire_grant(&everyone, 2, Instant::ZERO).is_ok(), "the cancelled units came back");
}

/// A refusal of a contended global atomic at a clock read that lagged behind another
/// thread's grants is decided again at the latest grant's instant, as under the global
/// lock.
#[test]
fn a_lagging_read_of_a_contended_atomic_decides_at_the_latest_instant() {
    let set = LimitSet::new(
        LimitSetPolicy::new()
            .tiers(["tenant"])
            .limit(LimitPolicy::gcra("each", Quota::per_second(nz!(1_000))).per("tenant"))
            .limit(LimitPolicy::gcra("everyone", Quota::per_second(nz!(1)).burst(nz!(2)))),
    )
    .unwrap();
    let at = |s: u64| Instant::from_nanos(s * 1_000_000_000);
    let (a, b) = (TenantKey::single("a").unwrap(), TenantKey::single("b").unwrap());
    // This thread takes a stripe of its own; another thread grants at 10 s.
    assert!(set.acquire_grant(&b, 1, at(0)).is_ok());
    std::thread::scope(|s| {
        s.spawn(|| assert!(set.acquire_grant(&a, 1, at(10)).is_ok()));
    });
    // At 5 s the TAT (11 s) lies 6 s ahead, past the tolerance of 2 s: a lone thread would
    // be refused there (unless it shares a counter stripe with the other, which happens
    // when many threads hold stripes at once, as the test harness's do; its own instants
    // then are the latest already). Contended, the read is decided again at 10 s, the
    // latest grant's instant, and passes there.
    let fast = set.shared.fast_global_live().expect("the atomic rules");
    fast.mark_contended();
    assert!(set.acquire_grant(&b, 1, at(5)).is_ok(), "decided at the latest instant");
    assert_eq!(set.stats().limits[1].refused, 0, "the refusal decided again is not counted");
}

/// The bytes from the start of `lock` (its word first, as in std's futex mutex) to `field`.
fn bytes_from<T, F>(lock: &std::sync::Mutex<T>, field: &F) -> usize {
    std::ptr::from_ref(field) as usize - std::ptr::from_ref(lock) as usize
}

#[test]
fn a_grant_writes_one_cache_line_of_its_lock() {
    // A shard, and the global states: the latest instant and the count of grants, written
    // by every grant, lie on the cache line of the lock's word (shards and the global
    // lock are aligned to 128 bytes).
    let set = set_of_three(64);
    let shard = &set.shared.shards[0].0;
    assert_eq!(std::ptr::from_ref(shard) as usize % 128, 0, "the lock starts its line");
    let guard = shard.lock().expect("not poisoned");
    assert!(bytes_from(shard, &guard.keyed.latest) + 8 <= 64);
    assert!(bytes_from(shard, &guard.keyed.counters.admitted) + 8 <= 64);
    assert!(bytes_from(shard, &guard.keyed.len) + 8 <= 64, "and a new key's count");
    drop(guard);
    let global = &set.shared.global.0;
    let guard = global.lock().expect("not poisoned");
    assert!(bytes_from(global, &guard.states.latest) + 8 <= 64);
    assert!(bytes_from(global, &guard.states.counters.admitted) + 8 <= 64);
    assert_eq!(std::ptr::from_ref(global) as usize % 128, 0, "the lock starts its line");
}
