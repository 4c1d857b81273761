//! Law 29 for semaphores, capacity shares of permits: replicas deciding from their
//! shares never hold more than the capacity, a tenant within its limit finds its permits
//! wherever its requests land, and a permit taken for a request refused elsewhere comes
//! back. Against a real `redis-server`, several replicas, a manual clock. Law numbers are
//! those of `crates/tower-limits/docs/laws.md`.

mod redis_common;

use std::future::Future;
use std::time::Duration;

use tower_limits_core::{AcquireError, Backend, Instant, LimitPolicy, LimitSetPolicy, Quota, TenantKey, nz};
use tower_limits_redis::test_support::redis_for;
use tower_limits_redis::{RedisBackend, RedisGrant};
use tower_limits_tests::Rng;

use redis_common::{MS, Phases, connect, fleet, manual, namespace, refresh_fleet, runtime, shares};

#[test]
fn a_fleet_on_shares_never_holds_more_than_a_semaphore_s_capacity() {
    let Some(server) = redis_for("a_fleet_on_shares_never_holds_more_than_a_semaphore_s_capacity") else {
        return;
    };
    runtime().block_on(async {
        let url = server.url();
        // Per tenant: 8 requests at once, and a rate; the rate is generous, so the
        // semaphore decides.
        let policy = LimitSetPolicy::new()
            .tiers(["tenant"])
            .limit(LimitPolicy::semaphore("concurrent", 8).per("tenant"))
            .limit(LimitPolicy::gcra("rate", Quota::per_second(nz!(100_000))).per("tenant"));
        for seed in [11u64, 2_024, 77_777, 5, 909] {
            let mut rng = Rng(seed);
            let replicas = fleet(&url, &policy, &namespace("shares-permits"), 3).await;
            let tenants = ["a", "b"].map(|t| TenantKey::new([t]).unwrap());
            // Grants held, with the step they end at.
            let mut held: Vec<(u64, usize, usize, tower_limits_redis::RedisGrant)> = Vec::new();
            let (mut admitted, mut most) = (0u64, [0usize; 2]);
            let start = 1_000_000 * MS;
            // Phases of 100 ms: quiet, busy, busy on one replica only (which then holds
            // most permits when the others come back), or with one replica deaf.
            let mut phases = Phases::new();
            for step in 0..3_000u64 {
                let now = Instant::from_nanos(start + step * MS);
                phases.at(step, &mut rng);
                // Grants whose work is done give their permits back.
                let (done, kept): (Vec<_>, Vec<_>) = held.into_iter().partition(|h| h.0 <= step);
                held = kept;
                for (_, r, t, grant) in done {
                    replicas[r].release(&tenants[t], grant);
                }
                if step % 20 == 0 {
                    refresh_fleet(&replicas, now, phases.deaf, &mut rng).await;
                }
                let requests = if phases.phase == 0 { rng.below(2) } else { rng.below(5) };
                for _ in 0..requests {
                    let r = phases.replica(&mut rng);
                    let t = rng.below(2) as usize;
                    match replicas[r].acquire(&tenants[t], 1, now).await {
                        Ok(grant) => {
                            admitted += 1;
                            held.push((step + 1 + rng.below(120), r, t, grant));
                        }
                        Err(AcquireError::Refused(_)) => {}
                        Err(e) => panic!("{e}"),
                    }
                }
                for (t, most) in most.iter_mut().enumerate() {
                    let holding = held.iter().filter(|h| h.2 == t).count();
                    assert!(holding <= 8, "seed {seed}, step {step}: tenant {t} holds {holding} permits of 8");
                    *most = (*most).max(holding);
                }
            }
            // The permits are used: each tenant reached its capacity at some point.
            assert_eq!(most, [8, 8], "seed {seed}: {admitted} admitted");
        }
    });
}

/// A semaphore far from full on one replica leaves room for another replica's first
/// request: the share of the first holds its demand and half of what no demand claims,
/// so the second replica's fetch finds permits at once. Caught: handing every unclaimed
/// permit to the replicas that demand any, which refused the newcomer, with 2 of 64
/// permits in use, until the holder's next refresh.
#[test]
fn a_replica_s_first_request_finds_permits_another_replica_does_not_use() {
    let Some(server) = redis_for("a_replica_s_first_request_finds_permits_another_replica_does_not_use") else {
        return;
    };
    runtime().block_on(async {
        let replicas = semaphore_fleet(&server.url(), 64, "shares-first-permit", 2).await;
        let tenant = TenantKey::new(["a"]).unwrap();
        let start = 1_000_000 * MS;
        // Replica 0 holds two permits through several refreshes: its share settles.
        let mut held = Vec::new();
        for step in 0..100u64 {
            let now = Instant::from_nanos(start + step * MS);
            if step % 20 == 0 {
                replicas[0].refresh_shares(now).await;
            }
            if step < 2 {
                held.push(replicas[0].acquire(&tenant, 1, now).await.unwrap());
            }
        }
        // Replica 1's first requests: granted, with 62 permits free.
        let now = Instant::from_nanos(start + 100 * MS);
        for i in 0..4 {
            match replicas[1].acquire(&tenant, 1, now).await {
                Ok(grant) => replicas[1].release(&tenant, grant),
                Err(e) => panic!("request {i} of the second replica: {e}"),
            }
        }
        for grant in held {
            replicas[0].release(&tenant, grant);
        }
    });
}

/// A replica whose semaphore share is too small for a burst asks Redis for more before
/// refusing: its share follows the last period's demand (one permit here), but the
/// permits nobody holds are its for the asking. It gets the whole capacity, and the
/// request beyond it is refused. Caught: refusing locally once the share was full, with
/// most of the permits free (a gateway's tenant refused for its concurrency of 64 with 8
/// requests in flight).
#[test]
fn a_replica_whose_share_is_short_asks_for_more_before_refusing() {
    let Some(server) = redis_for("a_replica_whose_share_is_short_asks_for_more_before_refusing") else { return };
    runtime().block_on(async {
        let replicas = semaphore_fleet(&server.url(), 8, "shares-short", 2).await;
        let tenant = TenantKey::new(["a"]).unwrap();
        let start = 1_000_000 * MS;
        // One permit held through several refreshes: the share settles near it.
        let first = replicas[0].acquire(&tenant, 1, Instant::from_nanos(start)).await.unwrap();
        for step in 1..=5u64 {
            replicas[0].refresh_shares(Instant::from_nanos(start + step * 20 * MS)).await;
        }
        let now = Instant::from_nanos(start + 101 * MS);
        let mut held = vec![first];
        for i in 1..8 {
            match replicas[0].acquire(&tenant, 1, now).await {
                Ok(grant) => held.push(grant),
                Err(e) => panic!("request {i} of 8, the capacity: {e}"),
            }
        }
        // The ninth: one fetch finds no permit free, so no second one is sent.
        let calls = replicas[0].stats().share_refreshes;
        assert!(replicas[0].acquire(&tenant, 1, now).await.is_err(), "a ninth request");
        assert_eq!(replicas[0].stats().share_refreshes - calls, 1, "one fetch for the ninth request");
        for grant in held {
            replicas[0].release(&tenant, grant);
        }
    });
}

#[test]
fn requests_arriving_together_before_the_first_share_are_all_counted() {
    let Some(server) = redis_for("requests_arriving_together_before_the_first_share_are_all_counted") else {
        return;
    };
    runtime().block_on(async {
        let replicas = semaphore_fleet(&server.url(), 8, "shares-together", 2).await;
        let tenant = TenantKey::new(["a"]).unwrap();
        let now = Instant::from_nanos(1_000_000 * MS);
        // Six requests decided before any fetch is answered: the first sends a fetch that
        // reports all six, the others wait for its answer, which holds them all (a tenant
        // at six of its eight permits is never refused).
        let r = &replicas[0];
        let held = six_at_once(r.acquire(&tenant, 1, now), r, &tenant, now).await;
        assert_eq!(r.stats().share_refreshes, 1, "one fetch for the six: the others waited for its answer");
        for grant in held {
            replicas[0].release(&tenant, grant);
        }
    });
}

#[test]
fn requests_arriving_while_a_fetch_is_on_its_way_wait_for_it_and_share_the_next() {
    let Some(server) = redis_for("requests_arriving_while_a_fetch_is_on_its_way_wait_for_it_and_share_the_next") else {
        return;
    };
    runtime().block_on(async {
        let replicas = semaphore_fleet(&server.url(), 8, "shares-fetch-in-flight", 1).await;
        let (r, tenant) = (&replicas[0], TenantKey::new(["a"]).unwrap());
        let now = Instant::from_nanos(1_000_000 * MS);
        // The first request's fetch is sent (polled once) before the others arrive: it
        // reports one permit, and its answer holds one.
        let mut first = Box::pin(r.acquire(&tenant, 1, now));
        let sent = std::future::poll_fn(|cx| std::task::Poll::Ready(first.as_mut().poll(cx).is_pending())).await;
        assert!(sent, "the first request waits for its fetch");
        // Five more wait for that answer rather than send a fetch each; short of permits
        // once it comes, one of them fetches for all, the others waiting for it.
        let held = six_at_once(first, r, &tenant, now).await;
        assert_eq!(r.stats().share_refreshes, 2, "two fetches for six requests");
        for grant in held {
            r.release(&tenant, grant);
        }
    });
}

#[test]
fn a_tenant_at_its_limit_over_three_replicas_gets_every_permit() {
    let Some(server) = redis_for("a_tenant_at_its_limit_over_three_replicas_gets_every_permit") else { return };
    runtime().block_on(async {
        let replicas = semaphore_fleet(&server.url(), 8, "shares-at-limit", 3).await;
        let tenant = TenantKey::new(["a"]).unwrap();
        let now = Instant::from_nanos(1_000_000 * MS);
        // Its eight requests land 4, 2 and 2 on the replicas, the first replica's first:
        // each replica's share is what it asked, so the last two find their permits
        // free (a share with a margin, or with part of the free permits, took them).
        let mut held = Vec::new();
        for (r, n) in [(0, 4), (1, 2), (2, 2)] {
            for i in 0..n {
                match replicas[r].acquire(&tenant, 1, now).await {
                    Ok(grant) => held.push((r, grant)),
                    Err(e) => panic!("request {i} of {n} on replica {r}, the tenant within its 8: {e}"),
                }
            }
        }
        for (r, replica) in replicas.iter().enumerate() {
            assert!(replica.acquire(&tenant, 1, now).await.is_err(), "a ninth request on replica {r}");
        }
        for (r, grant) in held {
            replicas[r].release(&tenant, grant);
        }
    });
}

/// A replica whose fetch found every permit held elsewhere refuses locally, without a
/// call, for two refresh periods, unless a refresh grows its share meanwhile (its demand
/// is on record, so the holder's next allotments make room): then its requests are
/// admitted from the share that refresh brought, with no fetch. Caught: fetching again
/// after one period however full the semaphore (one call a period per starved replica,
/// the gateway's greedy batch tenant's largest cost in Redis).
#[test]
fn a_replica_refused_for_want_of_permits_waits_for_a_refresh_that_makes_room() {
    let Some(server) = redis_for("a_replica_refused_for_want_of_permits_waits_for_a_refresh_that_makes_room") else {
        return;
    };
    runtime().block_on(async {
        let replicas = semaphore_fleet(&server.url(), 4, "shares-starved", 2).await;
        let tenant = TenantKey::new(["a"]).unwrap();
        let start = 1_000_000 * MS;
        let at = |ms: u64| Instant::from_nanos(start + ms * MS);
        // Replica 0 holds all four permits; replica 1's fetch finds none free.
        let mut held = Vec::new();
        for _ in 0..4 {
            held.push(replicas[0].acquire(&tenant, 1, at(0)).await.unwrap());
        }
        let calls = |r: usize| replicas[r].stats().share_refreshes;
        let before = calls(1);
        assert!(replicas[1].acquire(&tenant, 1, at(1)).await.is_err());
        assert_eq!(calls(1) - before, 1, "one fetch");
        // A refresh period later (20 ms), nothing has made room: refused with no call.
        assert!(replicas[1].acquire(&tenant, 1, at(25)).await.is_err());
        assert_eq!(calls(1) - before, 1, "no fetch while nothing made room");
        // Replica 0 finishes two requests. Its refreshes report the four it held in the
        // period, then the two it still holds (given two, it is counted for four until
        // it confirms), then confirm; replica 1's report its refused demand, and the
        // last brings it the permits freed, before the two periods are over.
        for grant in held.drain(..2) {
            replicas[0].release(&tenant, grant);
        }
        for t in [27, 31, 35] {
            replicas[0].refresh_shares(at(t)).await;
            replicas[1].refresh_shares(at(t + 1)).await;
            // (Replica 0 serves on: its answers apply with its next request.)
            let served = replicas[0].acquire(&tenant, 1, at(t + 2)).await.unwrap();
            replicas[0].release(&tenant, served);
        }
        let refreshed = calls(1);
        let granted = replicas[1].acquire(&tenant, 1, at(38)).await.expect("admitted from the refreshed share");
        assert_eq!(calls(1), refreshed, "admitted with no fetch");
        replicas[1].release(&tenant, granted);
        for grant in held {
            replicas[0].release(&tenant, grant);
        }
    });
}

#[test]
fn a_permit_taken_for_a_request_the_pool_refuses_comes_back() {
    let Some(server) = redis_for("a_permit_taken_for_a_request_the_pool_refuses_comes_back") else { return };
    runtime().block_on(async {
        let conn = connect(&server.url()).await;
        let policy = LimitSetPolicy::new()
            .tiers(["tenant"])
            .limit(LimitPolicy::semaphore("concurrent", 2).per("tenant"))
            .limit(LimitPolicy::gcra("rate", Quota::per_second(nz!(1))).per("tenant"));
        // The rate never earns a share: every request takes it from the pool.
        let backend = manual(policy, "shares-undo").shares(shares().hot_after(u32::MAX)).build(&conn).unwrap();
        let key = TenantKey::new(["acme"]).unwrap();
        let t0 = Instant::from_nanos(1_000_000 * MS);
        let first = backend.acquire(&key, 1, t0).await.unwrap();
        // A permit is free, the pool's rate is not: refused, and the permit goes back.
        for _ in 0..5 {
            let refused = backend.acquire(&key, 1, t0).await.unwrap_err();
            assert_eq!(refused.as_refusal().map(|r| r.limit()), Some("rate"), "{refused}");
        }
        backend.release(&key, first);
        // Two seconds later both permits are free: two requests in flight at once.
        let t1 = t0 + Duration::from_secs(2);
        let second = backend.acquire(&key, 1, t1).await.unwrap();
        let t2 = t1 + Duration::from_secs(2);
        let third = backend.acquire(&key, 1, t2).await.expect("the refused requests' permits came back");
        backend.release(&key, second);
        backend.release(&key, third);
    });
}

/// `first` and five more requests of `tenant` on `r`, all decided (their acquisitions
/// made) before any is polled, then awaited together: their grants, each of which must be
/// one (8 permits were free).
async fn six_at_once(
    first: impl Future<Output = Result<RedisGrant, AcquireError>>,
    r: &RedisBackend,
    tenant: &TenantKey,
    now: Instant,
) -> Vec<RedisGrant> {
    let (a, b, c, d, e, f) = tokio::join!(
        first,
        r.acquire(tenant, 1, now),
        r.acquire(tenant, 1, now),
        r.acquire(tenant, 1, now),
        r.acquire(tenant, 1, now),
        r.acquire(tenant, 1, now),
    );
    let mut held = Vec::new();
    for (i, answer) in [a, b, c, d, e, f].into_iter().enumerate() {
        match answer {
            Ok(grant) => held.push(grant),
            Err(e) => panic!("request {i} of 6, with 8 permits free: {e}"),
        }
    }
    held
}

/// `n` replicas on capacity shares of a semaphore of `permits` per tenant, in namespace
/// `ns`.
async fn semaphore_fleet(url: &str, permits: u64, ns: &str, n: usize) -> Vec<RedisBackend> {
    let policy =
        LimitSetPolicy::new().tiers(["tenant"]).limit(LimitPolicy::semaphore("concurrent", permits).per("tenant"));
    fleet(url, &policy, &namespace(ns), n).await
}
