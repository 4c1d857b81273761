//! Law 34: account limits replaced while a fleet runs. A member's limits replaced by one
//! replica (say, learned from the upstream's answers) decide every replica's next call;
//! a lowered rate counts what its mirror holds at the new pace and charges the calls the
//! fleet admitted over the upstream's window, whichever replica lowers it; a fleet declared otherwise ignores the
//! replacement; after Redis restarts empty the replicas replace their limits again; a replacement that does not keep the member's limits is refused. Time is
//! a manual clock given to the script: the waits are exact. Law numbers are those of
//! `crates/tower-limits/docs/laws.md`.

mod redis_common;

use std::time::Duration;

use tower_limits_core::{AcquireError, Instant, LimitPolicy, LimitSetPolicy, Quota, SharedAccounts, SharedGrant, nz};
use tower_limits_redis::test_support::redis_for;
use tower_limits_redis::{AccountLeases, RedisAccounts, RedisConnection};

use redis_common::{admin, cmd, connect, namespace, runtime};

const MS: u64 = 1_000_000;

/// An account of `per_second` requests a second, a burst of one.
fn account(per_second: u32) -> LimitSetPolicy {
    let rate = std::num::NonZeroU64::new(u64::from(per_second)).unwrap();
    LimitSetPolicy::new().limit(LimitPolicy::gcra("rps", Quota::per_second(rate).burst(nz!(1))))
}

fn store(conn: &RedisConnection, ns: &str, per_second: u32) -> RedisAccounts {
    RedisAccounts::builder("accounts")
        .namespace(ns)
        .timeout(Duration::from_secs(5))
        .manual_clock()
        .replaceable_limits(Duration::from_secs(1))
        .member("a", account(per_second))
        .build(conn)
        .unwrap()
}

fn at(ns: u64) -> Instant {
    Instant::from_nanos(ns)
}

/// Requests `store` grants when asked every 10 ms over `[from, to)` (ns).
async fn granted(store: &RedisAccounts, from: u64, to: u64) -> u64 {
    let mut n = 0;
    let mut t = from;
    while t < to {
        if store.acquire(1, at(t)).await.is_ok() {
            n += 1;
        }
        t += 10 * MS;
    }
    n
}

/// The wait of a refusal at `t`.
async fn wait_at(store: &RedisAccounts, t: u64) -> Duration {
    match store.acquire(1, at(t)).await {
        Err(AcquireError::Refused(r)) => r.retry_after(),
        other => panic!("expected a refusal at {t}, got {other:?}"),
    }
}

#[test]
fn a_limit_replaced_by_one_replica_decides_for_every_replica() {
    let Some(server) = redis_for("a_limit_replaced_by_one_replica_decides_for_every_replica") else { return };
    runtime().block_on(async {
        let ns = namespace("learned");
        let (a, b) = (store(&connect(&server.url()).await, &ns, 10), store(&connect(&server.url()).await, &ns, 10));
        // Declared: 10 a second, and a burst of one: 10 s give 100 (the first at once).
        assert_eq!(granted(&b, 0, 10_000 * MS).await, 100);
        // Replica a learns half the rate; b's calls follow at once: the last second's 10
        // requests at the new pace end at 11 s, then 5 a second.
        a.replace_member_limits(0, &account(5), at(10_000 * MS)).unwrap();
        a.flush().await;
        assert_eq!(granted(&b, 10_000 * MS, 20_000 * MS).await, 45);
        // And back up.
        a.replace_member_limits(0, &account(10), at(20_000 * MS)).unwrap();
        a.flush().await;
        assert_eq!(granted(&b, 20_000 * MS, 30_000 * MS).await, 100);
    });
}

#[test]
fn a_lowered_rate_charges_what_the_fleet_admitted_over_the_window() {
    let Some(server) = redis_for("a_lowered_rate_charges_what_the_fleet_admitted_over_the_window") else {
        return;
    };
    runtime().block_on(async {
        let ns = namespace("learned-recent");
        let (a, b) = (store(&connect(&server.url()).await, &ns, 10), store(&connect(&server.url()).await, &ns, 10));
        // Replica b alone admits at the declared pace, one request every 100 ms, the last at
        // 1 s. The mirror holds it (100 ms); at 5 a second, 200 ms.
        for step in 1..=10 {
            b.acquire(1, at(step * 100 * MS)).await.unwrap();
        }
        let t0 = 1_000 * MS;
        // Replica a learns half the rate, though it admitted nothing: the fleet's 10
        // requests of the last second end, at the new pace, 2 s after the span's start,
        // 1 s from now, and the next request waits for them.
        a.replace_member_limits(0, &account(5), at(t0)).unwrap();
        a.flush().await;
        assert_eq!(wait_at(&b, t0).await, Duration::from_millis(1_000));
        // A raise charges nothing, and keeps what the mirror holds.
        a.replace_member_limits(0, &account(10), at(t0)).unwrap();
        a.flush().await;
        assert_eq!(wait_at(&b, t0).await, Duration::from_millis(1_000));
    });
}

#[test]
fn a_lowered_rate_converts_what_its_mirror_holds_to_the_new_pace() {
    let Some(server) = redis_for("a_lowered_rate_converts_what_its_mirror_holds_to_the_new_pace") else { return };
    runtime().block_on(async {
        let ns = namespace("learned-convert");
        let (a, b) = (store(&connect(&server.url()).await, &ns, 10), store(&connect(&server.url()).await, &ns, 10));
        // One request at 10 s, none before within the span: the mirror holds 100 ms, at 5
        // a second 200 ms, more than the recent use asks (200 ms - 1 s).
        let t0 = 10_000 * MS;
        b.acquire(1, at(t0)).await.unwrap();
        a.replace_member_limits(0, &account(5), at(t0)).unwrap();
        a.flush().await;
        assert_eq!(wait_at(&b, t0).await, Duration::from_millis(200));
    });
}

#[test]
fn a_fleet_declared_otherwise_starts_from_its_own_limits() {
    let Some(server) = redis_for("a_fleet_declared_otherwise_starts_from_its_own_limits") else { return };
    runtime().block_on(async {
        let ns = namespace("learned-redeclared");
        let old = store(&connect(&server.url()).await, &ns, 10);
        old.replace_member_limits(0, &account(5), at(0)).unwrap();
        old.flush().await;
        // A replica declared as the old one decides with the replaced limit...
        let same = store(&connect(&server.url()).await, &ns, 10);
        same.acquire(1, at(0)).await.unwrap();
        assert_eq!(wait_at(&same, 0).await, Duration::from_millis(200));
        // ...one declared at 20 a second does not.
        let ns = namespace("learned-redeclared-2");
        let first = store(&connect(&server.url()).await, &ns, 10);
        first.replace_member_limits(0, &account(5), at(0)).unwrap();
        first.flush().await;
        let other = store(&connect(&server.url()).await, &ns, 20);
        other.acquire(1, at(0)).await.unwrap();
        assert_eq!(wait_at(&other, 0).await, Duration::from_millis(50));
    });
}

#[test]
fn after_redis_restarts_empty_the_replicas_replace_their_limits_again() {
    let Some(server) = redis_for("after_redis_restarts_empty_the_replicas_replace_their_limits_again") else {
        return;
    };
    runtime().block_on(async {
        let ns = namespace("learned-lost");
        let (a, b) = (store(&connect(&server.url()).await, &ns, 10), store(&connect(&server.url()).await, &ns, 10));
        let t = 5_000 * MS;
        a.replace_member_limits(0, &account(5), at(t)).unwrap();
        a.flush().await;
        let mut admin = admin(&server.url()).await;
        let _: () = cmd(&mut admin, &["FLUSHALL"]).await;
        // The next batch of a's settles learns that no replaced limit is on record, and a
        // sends its own again.
        a.cancel(SharedGrant { index: 0, charged: 1 }, at(t));
        a.flush().await;
        a.flush().await;
        b.acquire(1, at(t)).await.unwrap();
        assert_eq!(wait_at(&b, t).await, Duration::from_millis(200), "5 a second, not the declared 10");
    });
}

#[test]
fn a_replacement_that_does_not_keep_the_members_limits_is_refused() {
    let Some(server) = redis_for("a_replacement_that_does_not_keep_the_members_limits_is_refused") else { return };
    runtime().block_on(async {
        let conn = connect(&server.url()).await;
        let ns = namespace("learned-errors");
        let s = store(&conn, &ns, 10);
        let renamed = LimitSetPolicy::new().limit(LimitPolicy::gcra("rpm", Quota::per_second(nz!(5)).burst(nz!(1))));
        let e = s.replace_member_limits(0, &renamed, at(0)).unwrap_err();
        assert!(e.to_string().contains("[\"rps\"]"), "{e}");
        let e = s.replace_member_limits(1, &account(5), at(0)).unwrap_err();
        assert!(e.to_string().contains("no member at 1"), "{e}");
        let counting_cost = LimitSetPolicy::new()
            .limit(LimitPolicy::gcra("rps", Quota::per_second(nz!(5)).burst(nz!(1))).counting_cost());
        assert!(s.replace_member_limits(0, &counting_cost, at(0)).is_err());
        // Not replaceable: said so.
        let fixed = RedisAccounts::builder("accounts").namespace(&ns).member("a", account(10)).build(&conn).unwrap();
        let e = fixed.replace_member_limits(0, &account(5), at(0)).unwrap_err();
        assert!(e.to_string().contains("replaceable_limits"), "{e}");
        // Leases take replaced limits too (redis_account_leases.rs), and a replacement
        // is checked the same way.
        let leased = RedisAccounts::builder("accounts")
            .namespace(&ns)
            .member("a", account(10))
            .replaceable_limits(Duration::from_secs(1))
            .leases(AccountLeases::new())
            .build(&conn)
            .unwrap();
        assert!(leased.replace_member_limits(0, &counting_cost, at(0)).is_err());
    });
}
