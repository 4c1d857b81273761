//! Law 22, the errors that are not refusals, and policies as data, through the public
//! API (law numbers are those of `crates/tower-limits/docs/laws.md`):
//!
//! - `KeyTableFull` when the key table is full of active keys: an error, not a panic,
//!   and the bound holds (Law 7);
//! - `MissingTier` for a key lacking a tier some limit is keyed by;
//! - `CostAboveCapacity` at once for a cost above a limit's capacity, whatever else;
//! - `replace_policy` keeping the state of the limits that survive it;
//! - TOML and JSON loading errors naming the line and the field.

use std::time::Duration;

use tower_limits_core::{
    AcquireError, Clock, Instant, LimitPolicy, LimitSet, LimitSetPolicy, LoadError, ManualClock, Quota, TenantKey, nz,
};
use tower_limits_tests::{describe, keys, peek_all};

fn remaining(set: &LimitSet, key: &TenantKey, now: Instant) -> Vec<(String, u64)> {
    set.peek(key, now).into_iter().map(|s| (s.name.to_string(), s.snapshot.remaining)).collect()
}

fn pairs(items: &[(&str, u64)]) -> Vec<(String, u64)> {
    items.iter().map(|&(n, r)| (n.to_owned(), r)).collect()
}

// ---------------------------------------------------------------------------------------
// KeyTableFull
// ---------------------------------------------------------------------------------------

#[test]
fn a_table_full_of_active_keys_refuses_new_keys() {
    let set = LimitSet::new(
        LimitSetPolicy::new().tiers(["tenant"]).max_keys(1).limit(LimitPolicy::semaphore("slots", 2).per("tenant")),
    )
    .unwrap();
    let (a, b) = (TenantKey::single("a").unwrap(), TenantKey::single("b").unwrap());
    let now = Instant::ZERO;
    let held = set.acquire(&a, 1, now).unwrap();
    match set.acquire(&b, 1, now) {
        Err(AcquireError::KeyTableFull(e)) => {
            assert_eq!(e.max_keys(), 1);
            assert_eq!(e.to_string(), "too many active keys: the table of at most 1 keys has no idle key to evict");
        }
        other => panic!("expected KeyTableFull, got {other:?}"),
    }
    // The tracked key still works; the refused one left nothing behind.
    drop(set.acquire(&a, 1, now).unwrap());
    assert_eq!(set.tracked_keys(), 1);
    // Once `a` is idle, it makes room for `b`.
    drop(held);
    drop(set.acquire(&b, 1, now).unwrap());
    assert_eq!(set.tracked_keys(), 1);
}

#[test]
fn a_rate_limited_key_is_active_until_it_is_full_again() {
    let set = LimitSet::new(
        LimitSetPolicy::new()
            .tiers(["tenant"])
            .max_keys(1)
            .limit(LimitPolicy::gcra("rps", Quota::per_second(nz!(10)).burst(nz!(2))).per("tenant")),
    )
    .unwrap();
    let (a, b) = (TenantKey::single("a").unwrap(), TenantKey::single("b").unwrap());
    let clock = ManualClock::new();
    drop(set.acquire(&a, 1, clock.now()).unwrap());
    clock.advance(Duration::from_millis(99));
    assert!(matches!(set.acquire(&b, 1, clock.now()), Err(AcquireError::KeyTableFull(_))));
    clock.advance(Duration::from_millis(1));
    assert!(set.acquire(&b, 1, clock.now()).is_ok(), "a is idle at 100ms and gives way");
}

/// Law 7, bounded memory, for key tables: however many tenants come, the number of
/// tracked states never exceeds `max_keys`, and the rest are refused, not tracked.
#[test]
fn the_key_table_stays_within_its_bound() {
    let set = LimitSet::new(
        LimitSetPolicy::new().tiers(["tenant"]).max_keys(64).limit(LimitPolicy::semaphore("slots", 1).per("tenant")),
    )
    .unwrap();
    let keys: Vec<TenantKey> = (0..500).map(|i| TenantKey::single(format!("t{i}")).unwrap()).collect();
    let mut held = Vec::new();
    let mut full = 0;
    for k in &keys {
        match set.acquire(k, 1, Instant::ZERO) {
            Ok(p) => held.push(p),
            Err(AcquireError::KeyTableFull(_)) => full += 1,
            Err(e) => panic!("{e}"),
        }
        assert!(set.tracked_keys() <= 64);
    }
    assert_eq!(held.len() + full, keys.len());
    assert_eq!(set.tracked_keys(), held.len());
    drop(held);
    let tracked = set.tracked_keys();
    assert_eq!(set.evict_idle(Instant::ZERO), tracked);
    assert_eq!(set.tracked_keys(), 0);
}

// ---------------------------------------------------------------------------------------
// MissingTier and CostAboveCapacity
// ---------------------------------------------------------------------------------------

#[test]
fn a_key_lacking_a_tier_is_refused_naming_the_tier() {
    let set = LimitSet::new(
        LimitSetPolicy::new()
            .tiers(["org", "user"])
            .limit(LimitPolicy::gcra("org-rate", Quota::per_second(nz!(10))).per("org"))
            .limit(LimitPolicy::gcra("user-rate", Quota::per_second(nz!(1))).per("user")),
    )
    .unwrap();
    for (key, tier) in [(TenantKey::single("acme").unwrap(), "user"), (TenantKey::global(), "org")] {
        match set.acquire(&key, 1, Instant::ZERO) {
            Err(AcquireError::MissingTier(e)) => {
                assert_eq!(e.tier(), tier);
                assert!(e.to_string().contains(&format!("{tier:?}")), "{e}");
            }
            other => panic!("expected MissingTier, got {other:?}"),
        }
    }
    assert_eq!(set.stats().admitted, 0);
    assert_eq!(set.tracked_keys(), 0);
    assert!(set.acquire(&TenantKey::new(["acme", "alice"]).unwrap(), 1, Instant::ZERO).is_ok());
}

#[test]
fn a_cost_above_capacity_is_refused_at_once_whatever_else() {
    // The semaphore comes first and is full: a NotYet; the bucket then says Never, and
    // Never wins, at once.
    for reversed in [false, true] {
        let mut limits = vec![
            LimitPolicy::semaphore("slots", 1).per("user"),
            LimitPolicy::token_bucket("tokens", Quota::per_minute(nz!(1000)).burst(nz!(500)))
                .per("org")
                .counting_cost(),
        ];
        if reversed {
            limits.reverse();
        }
        let policy = limits.into_iter().fold(LimitSetPolicy::new().tiers(["org", "user"]), |p, l| p.limit(l));
        let set = LimitSet::new(policy).unwrap();
        let all = keys(&[["acme", "alice"]]);
        let alice = &all[0];
        let now = Instant::ZERO;
        let _slot = set.acquire(alice, 10, now).unwrap();
        let before = peek_all(&set, &all, now);
        match set.acquire(alice, 501, now) {
            Err(AcquireError::CostAboveCapacity(e)) => {
                assert_eq!((e.limit(), e.tier(), e.cost(), e.capacity()), ("tokens", Some("org"), 501, 500));
                assert!(e.to_string().contains("never"), "{e}");
            }
            other => panic!("expected CostAboveCapacity, got {other:?}"),
        }
        assert_eq!(peek_all(&set, &all, now), before);
        let tokens = set.stats().limits.into_iter().find(|l| l.name == "tokens").unwrap();
        assert_eq!(tokens.cost_above_capacity, 1);
        // Within capacity, the full semaphore is what blocks.
        let e = set.acquire(alice, 5, now).unwrap_err();
        assert!(describe(&e).contains("\"slots\""), "{e}");
    }
}

#[test]
fn acquire_each_with_the_wrong_number_of_costs_never_passes() {
    let set = LimitSet::new(
        LimitSetPolicy::new()
            .limit(LimitPolicy::gcra("a", Quota::per_second(nz!(10))))
            .limit(LimitPolicy::gcra("b", Quota::per_second(nz!(10)))),
    )
    .unwrap();
    let key = TenantKey::global();
    match set.acquire_each(&key, &[1], Instant::ZERO) {
        Err(AcquireError::CostAboveCapacity(e)) => assert_eq!(e.limit(), "b"),
        other => panic!("expected CostAboveCapacity, got {other:?}"),
    }
    assert!(set.acquire_each(&key, &[1, 2], Instant::ZERO).is_ok());
}

// ---------------------------------------------------------------------------------------
// replace_policy
// ---------------------------------------------------------------------------------------

#[test]
fn replacing_a_policy_keeps_the_state_of_surviving_limits() {
    let old = LimitSetPolicy::new()
        .tiers(["org", "user"])
        .limit(LimitPolicy::gcra("rpm", Quota::per_minute(nz!(60)).burst(nz!(5))).per("user"))
        .limit(LimitPolicy::semaphore("slots", 2).per("org"))
        .limit(LimitPolicy::fixed_window("daily", 3, Duration::from_secs(86_400)).per("org"))
        .limit(LimitPolicy::sliding_window_log("global", 4, Duration::from_secs(60)));
    let set = LimitSet::new(old).unwrap();
    let all = keys(&[["acme", "alice"]]);
    let alice = &all[0];
    let now = Instant::ZERO;
    let held = set.acquire(alice, 1, now).unwrap();
    drop(set.acquire(alice, 1, now).unwrap());
    drop(set.acquire(alice, 1, now).unwrap());
    assert_eq!(remaining(&set, alice, now), pairs(&[("rpm", 2), ("slots", 1), ("daily", 0), ("global", 1)]));

    // A bad policy is refused, naming the field, and changes nothing.
    let mut bad = LimitPolicy::gcra("rpm", Quota::per_minute(nz!(60)));
    bad.burst = Some(0);
    let err = set.replace_policy(LimitSetPolicy::new().tiers(["org", "user"]).limit(bad)).unwrap_err();
    assert_eq!(err.field(), "limits[0] (rpm).burst");
    assert_eq!(set.limit_names(), ["rpm", "slots", "daily", "global"]);
    assert_eq!(remaining(&set, alice, now), pairs(&[("rpm", 2), ("slots", 1), ("daily", 0), ("global", 1)]));

    // `rpm` and `slots` keep name, algorithm and scope: they keep their state (rpm's
    // three grants now count against a burst of 10). `daily` changes algorithm and
    // starts fresh; `global` is gone; `new` is new.
    let new = LimitSetPolicy::new()
        .tiers(["org", "user"])
        .limit(LimitPolicy::gcra("rpm", Quota::per_minute(nz!(60)).burst(nz!(10))).per("user"))
        .limit(LimitPolicy::semaphore("slots", 2).per("org"))
        .limit(LimitPolicy::token_bucket("daily", Quota::per_day(nz!(3))).per("org"))
        .limit(LimitPolicy::semaphore("new", 1));
    set.replace_policy(new).unwrap();
    assert_eq!(set.limit_names(), ["rpm", "slots", "daily", "new"]);
    assert_eq!(remaining(&set, alice, now), pairs(&[("rpm", 7), ("slots", 1), ("daily", 3), ("new", 1)]));

    // The permit granted under the old policy still releases its slot.
    drop(held);
    assert_eq!(remaining(&set, alice, now), pairs(&[("rpm", 7), ("slots", 2), ("daily", 3), ("new", 1)]));
    assert!(set.stats().limits.iter().all(|l| l.held == 0));

    // A limit whose scope changes starts fresh.
    let rescoped = LimitSetPolicy::new()
        .tiers(["org", "user"])
        .limit(LimitPolicy::gcra("rpm", Quota::per_minute(nz!(60)).burst(nz!(10))).per("org"));
    set.replace_policy(rescoped).unwrap();
    assert_eq!(remaining(&set, alice, now), pairs(&[("rpm", 10)]));
}

// ---------------------------------------------------------------------------------------
// Loading policies
// ---------------------------------------------------------------------------------------

fn parse_error(result: Result<LimitSetPolicy, LoadError>) -> String {
    match result {
        Err(LoadError::Parse(msg)) => msg,
        other => panic!("expected a parse error, got {other:?}"),
    }
}

#[test]
fn toml_errors_name_the_line_and_the_field() {
    let head = "tiers = [\"user\"]\n\n[[limit]]\nname = \"rpm\"\nalgorithm = \"gcra\"\n";
    for (tail, line, needles) in [
        ("rate = \"60/1m\"\nburst = \"ten\"\n", 7, &["burst", "expected u64"][..]),
        ("rate = \"60/1m\"\nburts = 10\n", 7, &["unknown field `burts`"][..]),
        ("rate = \"sixty/1m\"\n", 6, &["rate", "expected a whole number"][..]),
        ("rate = \"60/1 parsec\"\n", 6, &["rate", "unknown unit"][..]),
    ] {
        let msg = parse_error(LimitSetPolicy::from_toml(&format!("{head}{tail}")));
        assert!(msg.contains(&format!("line {line}")), "{msg}");
        for needle in needles {
            assert!(msg.contains(needle), "{needle:?} not in {msg}");
        }
    }
}

#[test]
fn json_errors_name_the_line() {
    let doc = |field: &str| {
        format!(
            "{{\n  \"limit\": [\n    {{\n      \"name\": \"rpm\",\n      \"algorithm\": \"gcra\",\n      {field}\n    }}\n  ]\n}}"
        )
    };
    let msg = parse_error(LimitSetPolicy::from_json(&doc("\"rate\": \"60/1m\", \"burts\": 10")));
    assert!(msg.contains("unknown field `burts`") && msg.contains("line 6"), "{msg}");
    let msg = parse_error(LimitSetPolicy::from_json(&doc("\"rate\": \"60/1m\", \"burst\": \"ten\"")));
    assert!(msg.contains("line 6") && msg.contains("expected u64"), "{msg}");
}

#[test]
fn invalid_policies_name_the_field() {
    let text =
        "tiers = [\"user\"]\n\n[[limit]]\nname = \"rpm\"\nalgorithm = \"gcra\"\nscope = \"usr\"\nrate = \"60/1m\"\n";
    match LimitSetPolicy::from_toml(text) {
        Err(LoadError::Invalid(e)) => {
            assert_eq!(e.field(), "limits[0] (rpm).scope");
            assert_eq!(e.message(), "unknown tier \"usr\" (tiers are user)");
        }
        other => panic!("{other:?}"),
    }
    let json = r#"{"limit": [{"name": "c", "algorithm": "semaphore", "capacity": 0}]}"#;
    match LimitSetPolicy::from_json(json) {
        Err(LoadError::Invalid(e)) => assert_eq!(e.to_string(), "limits[0] (c).capacity: must be at least 1"),
        other => panic!("{other:?}"),
    }
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"));
    let path = dir.join("policy_and_errors_bad.json");
    std::fs::write(&path, "{\"limit\": [{\"name\": 1}]}").unwrap();
    let msg = parse_error(LimitSetPolicy::from_file(&path));
    assert!(msg.starts_with(&path.display().to_string()) && msg.contains("line 1"), "{msg}");
}

// ---------------------------------------------------------------------------------------
// Bugs and gaps found here (ignored until the core is fixed; run with `--ignored`)
// ---------------------------------------------------------------------------------------

/// `max_keys` is split over the shards (up to four per core), and a small table was once
/// split so thin that a shard had room for one state only (with 10 keys) or three (with
/// 100 keys and four keyed limits): a key that needs more states than its shard's share
/// was refused as `KeyTableFull` on an empty table.
#[test]
fn a_small_key_table_still_admits_one_key() {
    let cases = [
        (
            10,
            vec![
                LimitPolicy::gcra("o", Quota::per_second(nz!(1))).per("org"),
                LimitPolicy::semaphore("u", 1).per("user"),
            ],
        ),
        (
            100,
            vec![
                LimitPolicy::gcra("o", Quota::per_second(nz!(1))).per("org"),
                LimitPolicy::token_bucket("ot", Quota::per_second(nz!(1))).per("org").counting_cost(),
                LimitPolicy::gcra("u", Quota::per_second(nz!(1))).per("user"),
                LimitPolicy::semaphore("uc", 1).per("user"),
            ],
        ),
    ];
    let mut refused = Vec::new();
    for (max_keys, limits) in cases {
        let policy =
            limits.into_iter().fold(LimitSetPolicy::new().tiers(["org", "user"]).max_keys(max_keys), |p, l| p.limit(l));
        let set = LimitSet::new(policy).unwrap();
        let key = TenantKey::new(["acme", "alice"]).unwrap();
        if let Err(e) = set.acquire(&key, 1, Instant::ZERO) {
            refused.push(format!("max_keys {max_keys}, empty table: {}", describe(&e)));
        }
    }
    assert!(refused.is_empty(), "{refused:#?}");
}

/// When a shard is full, the sweep may evict the acquiring key's own idle state, which
/// the acquisition had counted as present; it then inserts it again, one state more than
/// it made room for, so the table grows past `max_keys`.
#[test]
fn the_key_table_never_exceeds_max_keys() {
    let set = LimitSet::new(
        LimitSetPolicy::new()
            .tiers(["org", "user"])
            .max_keys(64)
            .limit(LimitPolicy::gcra("org-rate", Quota::per_second(nz!(100)).burst(nz!(1))).per("org"))
            .limit(LimitPolicy::semaphore("user-slots", 1).per("user")),
    )
    .unwrap();
    let t0 = Instant::ZERO;
    let t1 = Instant::from_nanos(10_000_000);
    let mut held = Vec::new();
    let mut orgs = Vec::new();
    // One org per shard gets in (two states: its org rate and one user's slot).
    for i in 0..1000 {
        let org = format!("o{i}");
        if let Ok(p) = set.acquire_owned(&TenantKey::new([org.as_str(), "u1"]).unwrap(), 1, t0) {
            held.push(p);
            orgs.push(org);
        }
    }
    assert!(set.tracked_keys() <= 64);
    // 10ms later each org's rate state is idle; a second user of the org evicts it to
    // make room for one new state, then inserts two.
    for org in &orgs {
        if let Ok(p) = set.acquire_owned(&TenantKey::new([org.as_str(), "u2"]).unwrap(), 1, t1) {
            held.push(p);
        }
    }
    assert!(set.tracked_keys() <= 64, "{} states tracked, max_keys 64", set.tracked_keys());
}

/// serde_json reports where a JSON policy is wrong, but not which field: a type error
/// reads "invalid type: string \"ten\", expected u64 at line 6 column 37", and an error
/// in a rate or duration that ends its object is placed on the line of the closing brace.
#[test]
fn json_errors_name_the_field() {
    let doc = |fields: &str| {
        format!(
            "{{\n  \"limit\": [\n    {{\n      \"name\": \"rpm\",\n      \"algorithm\": \"gcra\",\n      {fields}\n    }}\n  ]\n}}"
        )
    };
    let mut gaps = Vec::new();
    // The offending value is on line 6 in both.
    for (fields, field) in [("\"rate\": \"60/1m\", \"burst\": \"ten\"", "burst"), ("\"rate\": \"sixty/1m\"", "rate")] {
        let msg = parse_error(LimitSetPolicy::from_json(&doc(fields)));
        // serde_json places an error in the last field of an object at the closing brace.
        if !msg.contains(&format!("limit[0].{field}")) || !(msg.contains("line 6") || msg.contains("line 7")) {
            gaps.push(format!("{field}: {msg}"));
        }
    }
    assert!(gaps.is_empty(), "{gaps:#?}");
}
