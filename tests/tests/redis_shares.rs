//! Law 29, capacity shares: replicas deciding from the shares they hold admit, over every
//! window, at most what the limit allows; capacity follows demand; a replica that stops
//! refreshing gives its share back within the lifetime. Against a real `redis-server`,
//! several replicas (backends with their own connections), random traffic, a manual
//! clock. Law numbers are those of `crates/tower-limits/docs/laws.md`.

mod redis_common;

use std::collections::HashMap;
use std::time::Duration;

use tower_limits_core::{
    AcquireError, Backend, Instant, LimitPolicy, LimitPool, LimitSet, LimitSetPolicy, Quota, Selection, TenantKey, nz,
};
use tower_limits_redis::test_support::{own_redis_for, redis_for};
use tower_limits_redis::{AccountLeases, BuildError, GrantSource, RedisAccounts, RedisBackend, ShareGroup, Shares};
use tower_limits_tests::Rng;

use redis_common::{MS, Phases, busy_replica, connect, fleet, manual, namespace, random_step, runtime, shares};

/// Over every window between two admissions, the units used are at most
/// `burst + window * amount / period`.
fn assert_bound(what: &str, used: &[(u64, u64)], amount: u64, period: u64, burst: u64) {
    for i in 0..used.len() {
        let mut units = 0;
        for &(at, n) in &used[i..] {
            units += n;
            let window = at - used[i].0;
            let allowed = u128::from(burst) + u128::from(window) * u128::from(amount) / u128::from(period);
            assert!(
                u128::from(units) <= allowed,
                "{what}: {units} units in {window} ns from {} (allowed {allowed})",
                used[i].0
            );
        }
    }
}

#[test]
fn a_fleet_on_shares_never_admits_more_than_the_limit_over_any_window() {
    let Some(server) = redis_for("a_fleet_on_shares_never_admits_more_than_the_limit_over_any_window") else {
        return;
    };
    runtime().block_on(async {
        let url = server.url();
        // A global rate of 200/s with a burst of 20, and per tenant 50/s, burst 10,
        // counting cost.
        let policy = LimitSetPolicy::new()
            .tiers(["tenant"])
            .limit(LimitPolicy::gcra("global", Quota::per_second(nz!(200)).burst(nz!(20))))
            .limit(
                LimitPolicy::token_bucket("tenant", Quota::per_second(nz!(50)).burst(nz!(10)))
                    .per("tenant")
                    .counting_cost(),
            );
        for seed in [7u64, 1234, 98_765, 31_337, 4_242] {
            let mut rng = Rng(seed);
            let replicas = fleet(&url, &policy, &namespace("shares-bound"), 3).await;
            let tenants = ["a", "b", "c", "d"].map(|t| TenantKey::new([t]).unwrap());
            let mut global = Vec::new();
            let mut per_tenant: HashMap<usize, Vec<(u64, u64)>> = HashMap::new();
            let (mut local, mut remote) = (0, 0);
            let start = 1_000_000 * MS;
            // Phases of 100 ms: idle, a flood from every replica, traffic on one replica,
            // or one replica whose refreshes go unheard (Redis applies them, the replica
            // never learns) or unsent.
            let mut phases = Phases::new();
            for step in 0..3_000u64 {
                let now = Instant::from_nanos(start + step * MS);
                for a in random_step(&replicas, &tenants, &mut phases, step, now, &mut rng).await {
                    if a.from_share {
                        local += 1;
                    } else {
                        remote += 1;
                    }
                    global.push((now.as_nanos(), 1));
                    per_tenant.entry(a.tenant).or_default().push((now.as_nanos(), a.used));
                }
            }
            for r in &replicas {
                r.flush().await;
            }
            assert_bound("global", &global, 200, 1_000 * MS, 20);
            for (t, admitted) in &per_tenant {
                assert_bound(&format!("tenant {t}"), admitted, 50, 1_000 * MS, 10);
            }
            // The traffic asks for more than the limits allow: they are used, mostly from shares.
            assert!(global.len() > 200, "seed {seed}: only {} admitted in 3 s", global.len());
            assert!(local > remote, "seed {seed}: {local} from shares, {remote} from the pools");
        }
    });
}

#[test]
fn capacity_follows_demand_and_a_silent_replica_gives_its_share_back() {
    let Some(server) = redis_for("capacity_follows_demand_and_a_silent_replica_gives_its_share_back") else {
        return;
    };
    runtime().block_on(async {
        let url = server.url();
        let policy =
            LimitSetPolicy::new().limit(LimitPolicy::gcra("global", Quota::per_second(nz!(1_000)).burst(nz!(50))));
        let replicas = fleet(&url, &policy, &namespace("shares-demand"), 2).await;
        let key = TenantKey::global();
        let start = 1_000_000 * MS;
        // Both replicas ask for far more than the limit: each settles near half.
        let mut admitted = [0u64; 2];
        let mut last_second = [0u64; 2];
        for step in 0..2_000u64 {
            let now = Instant::from_nanos(start + step * MS);
            let silent = step >= 1_000;
            if step % 20 == 0 {
                for (i, r) in replicas.iter().enumerate() {
                    // From the second second on, replica 1 stops refreshing, as a replica
                    // that died would.
                    if !(silent && i == 1) {
                        r.refresh_shares(now).await;
                    }
                }
            }
            for (i, r) in replicas.iter().enumerate() {
                if silent && i == 1 {
                    continue;
                }
                for _ in 0..4 {
                    if let Ok(grant) = r.acquire(&key, 1, now).await {
                        admitted[i] += 1;
                        if step >= 1_200 {
                            last_second[i] += 1;
                        }
                        r.release(&key, grant);
                    }
                }
            }
            if step == 999 {
                // Fair shares while both ask: neither has less than 40% of what was admitted.
                let total = admitted[0] + admitted[1];
                assert!(total >= 900, "the limit is used: {admitted:?}");
                assert!(
                    admitted[0] * 10 >= total * 4 && admitted[1] * 10 >= total * 4,
                    "shares by demand: {admitted:?}"
                );
            }
        }
        // Replica 1 went silent at 1 s; its share ended at 1.1 s at the latest, and from
        // 1.2 s replica 0 has (nearly) the whole limit: at least 90% of 800 admissions.
        assert!(last_second[0] >= 720, "the silent replica's share came back: {last_second:?}");
        let stats = replicas[0].stats();
        assert!(stats.shared_grants > stats.granted, "{stats:?}");
    });
}

/// One replica holds the whole limit, then all three flood it; `adversary` decides how
/// the first replica refreshes from then on. Answers every admission of the fleet.
async fn hand_over(url: &str, adversary: fn(u64) -> Refresh) -> Vec<(u64, u64)> {
    let policy = LimitSetPolicy::new().limit(LimitPolicy::gcra("global", Quota::per_second(nz!(300)).burst(nz!(30))));
    let replicas = fleet(url, &policy, &namespace("shares-hand-over"), 3).await;
    let key = TenantKey::global();
    let start = 1_000_000 * MS;
    let mut admitted = Vec::new();
    for step in 0..600u64 {
        let now = Instant::from_nanos(start + step * MS);
        let everyone = step >= 200;
        if step % 20 == 0 {
            for (i, r) in replicas.iter().enumerate() {
                match (i, adversary(step)) {
                    (0, Refresh::Unheard) if everyone => {
                        r.refresh_shares_unheard(now).await;
                    }
                    (0, Refresh::Unsent) if everyone => {}
                    _ => {
                        r.refresh_shares(now).await;
                    }
                }
            }
        }
        for (i, r) in replicas.iter().enumerate() {
            if i > 0 && !everyone {
                continue;
            }
            for _ in 0..3 {
                if let Ok(grant) = r.acquire(&key, 1, now).await {
                    admitted.push((now.as_nanos(), 1));
                    r.release(&key, grant);
                }
            }
        }
    }
    admitted
}

#[derive(Clone, Copy)]
enum Refresh {
    Heard,
    /// Redis applies it; the replica never learns the answer.
    Unheard,
    /// Never sent: the replica keeps serving from its share until it expires.
    Unsent,
}

#[test]
fn a_share_moves_only_once_its_holder_cannot_be_using_it() {
    let Some(server) = redis_for("a_share_moves_only_once_its_holder_cannot_be_using_it") else { return };
    runtime().block_on(async {
        let url = server.url();
        for adversary in [|_| Refresh::Heard, |_| Refresh::Unheard, |_| Refresh::Unsent] as [fn(u64) -> Refresh; 3] {
            let admitted = hand_over(&url, adversary).await;
            assert_bound("global", &admitted, 300, 1_000 * MS, 30);
            // The limit is used: 30 + 0.6 s at 300/s is 210; at least 80% of it.
            assert!(admitted.len() >= 168, "{} admitted", admitted.len());
        }
    });
}

#[test]
fn a_refund_to_a_pool_that_refilled_meanwhile_does_not_raise_it_above_its_burst() {
    let Some(server) = redis_for("a_refund_to_a_pool_that_refilled_meanwhile_does_not_raise_it_above_its_burst") else {
        return;
    };
    runtime().block_on(async {
        let conn = connect(&server.url()).await;
        let policy = LimitSetPolicy::new()
            .limit(LimitPolicy::token_bucket("tokens", Quota::per_second(nz!(10)).burst(nz!(20))).counting_cost());
        // Never hot: every grant comes from the pool.
        let backend = manual(policy, "shares-refund").shares(shares().hot_after(u32::MAX)).build(&conn).unwrap();
        let key = TenantKey::global();
        let t0 = Instant::from_nanos(1_000_000 * MS);
        let grant = backend.acquire(&key, 20, t0).await.unwrap();
        assert_eq!(grant.source(), GrantSource::Redis);
        // Three seconds later the pool is full again; the grant is cancelled then.
        let t1 = t0 + Duration::from_secs(3);
        backend.cancel(&key, grant, t1);
        backend.flush().await;
        assert!(backend.acquire(&key, 20, t1).await.is_ok());
        assert!(matches!(backend.acquire(&key, 1, t1).await, Err(AcquireError::Refused(_))));
    });
}

#[test]
fn a_charge_beyond_what_a_share_granted_is_repaid_before_it_grants_again() {
    let Some(server) = redis_for("a_charge_beyond_what_a_share_granted_is_repaid_before_it_grants_again") else {
        return;
    };
    runtime().block_on(async {
        let url = server.url();
        let policy = LimitSetPolicy::new()
            .limit(LimitPolicy::token_bucket("tokens", Quota::per_second(nz!(100)).burst(nz!(10))).counting_cost());
        let replicas = fleet(&url, &policy, &namespace("shares-debt"), 1).await;
        let r = &replicas[0];
        let key = TenantKey::global();
        let start = 1_000_000 * MS;
        // Hot, then a share of the whole limit.
        for step in 0..60u64 {
            let now = Instant::from_nanos(start + step * MS);
            if step % 20 == 0 {
                r.refresh_shares(now).await;
            }
            if let Ok(grant) = r.acquire(&key, 1, now).await {
                r.release(&key, grant);
            }
        }
        let now = Instant::from_nanos(start + 60 * MS);
        let mut grant = r.acquire(&key, 1, now).await.unwrap();
        assert_eq!(grant.source(), GrantSource::Share);
        // It used 30, 29 beyond what it took. The share held from nothing to its burst
        // (10), so it owes 20 to 30 units: 200 to 310 ms of its 100/s before it grants
        // again, not sooner (the debt is kept), nor much later (it is repaid).
        r.settle(&key, &mut grant, 30, now);
        r.release(&key, grant);
        let mut first = None;
        for step in 61..400u64 {
            let now = Instant::from_nanos(start + step * MS);
            if step % 20 == 0 {
                r.refresh_shares(now).await;
            }
            if let Ok(grant) = r.acquire(&key, 1, now).await {
                assert_eq!(grant.source(), GrantSource::Share);
                first.get_or_insert(step);
                r.release(&key, grant);
            }
        }
        let first = first.expect("the share grants again once repaid");
        assert!((260..=380).contains(&first), "first grant after the debt at {first} ms");
    });
}

#[test]
fn while_redis_is_away_a_replica_decides_from_its_shares_until_they_end() {
    let Some(mut server) = own_redis_for("while_redis_is_away_a_replica_decides_from_its_shares_until_they_end") else {
        return;
    };
    runtime().block_on(async {
        let conn = connect(&server.url()).await;
        let policy = LimitSetPolicy::new()
            .tiers(["tenant"])
            .limit(LimitPolicy::gcra("rate", Quota::per_second(nz!(1_000))).per("tenant"))
            .limit(LimitPolicy::semaphore("concurrent", 4).per("tenant"));
        let key = TenantKey::new(["acme"]).unwrap();
        let start = 1_000_000 * MS;
        let at = |ms: u64| Instant::from_nanos(start + ms * MS);
        // Busy long enough for shares of both limits.
        let backend = busy_replica(&conn, policy, "shares-away", &key, 1, start).await;
        server.stop();
        // Redis is away: the shares decide until they end (the last refresh at 60 ms, a
        // lifetime of 100 ms); the refreshes fail.
        for ms in 61..160 {
            if ms % 20 == 0 {
                assert!(!backend.refresh_shares(at(ms)).await);
            }
            let grant = backend.acquire(&key, 1, at(ms)).await.unwrap();
            assert_eq!(grant.source(), GrantSource::Share, "at {ms} ms");
            backend.release(&key, grant);
        }
        // Then the failure policy: fail closed.
        let after = backend.acquire(&key, 1, at(161)).await.unwrap_err();
        assert!(matches!(after, AcquireError::Unavailable(_)), "{after}");
    });
}

#[test]
fn after_redis_restarts_empty_the_fleet_stays_within_the_documented_margin() {
    let Some(mut server) = own_redis_for("after_redis_restarts_empty_the_fleet_stays_within_the_documented_margin")
    else {
        return;
    };
    runtime().block_on(async {
        let url = server.url();
        let policy =
            LimitSetPolicy::new().limit(LimitPolicy::gcra("global", Quota::per_second(nz!(300)).burst(nz!(30))));
        let replicas = fleet(&url, &policy, &namespace("shares-restart"), 3).await;
        let key = TenantKey::global();
        let start = 1_000_000 * MS;
        let (mut before, mut after) = (Vec::new(), Vec::new());
        for step in 0..900u64 {
            let now = Instant::from_nanos(start + step * MS);
            if step == 300 {
                // Empty, and the scripts forgotten.
                server.restart().unwrap();
            }
            if step % 20 == 0 {
                for r in &replicas {
                    r.refresh_shares(now).await;
                }
            }
            for r in &replicas {
                for _ in 0..2 {
                    if let Ok(grant) = r.acquire(&key, 1, now).await {
                        let at = (now.as_nanos(), 1);
                        if step < 300 {
                            before.push(at)
                        } else {
                            after.push(at)
                        }
                        r.release(&key, grant);
                    }
                }
            }
        }
        assert_bound("before the restart", &before, 300, 1_000 * MS, 30);
        // For one lifetime (100 ms) after the restart, up to twice the limit; then the limit.
        assert_bound("after the restart", &after, 2 * 300, 1_000 * MS, 2 * 30);
        let settled: Vec<(u64, u64)> = after.iter().copied().filter(|&(at, _)| at >= start + 400 * MS).collect();
        assert_bound("a lifetime after the restart", &settled, 300, 1_000 * MS, 30);
        assert!(settled.len() > 100, "the limit is used again: {}", settled.len());
    });
}

#[test]
fn a_burst_excess_lets_split_bursts_sum_to_more_and_bounds_the_fleet_by_it() {
    let Some(server) = redis_for("a_burst_excess_lets_split_bursts_sum_to_more_and_bounds_the_fleet_by_it") else {
        return;
    };
    runtime().block_on(async {
        let url = server.url();
        let policy =
            LimitSetPolicy::new().limit(LimitPolicy::gcra("global", Quota::per_second(nz!(300)).burst(nz!(30))));
        let ns = namespace("shares-excess");
        let mut replicas = Vec::new();
        for _ in 0..3 {
            let conn = connect(&url).await;
            let doubled = shares().hot_after(1).burst_excess(100);
            replicas.push(manual(policy.clone(), "shares").namespace(&ns).shares(doubled).build(&conn).unwrap());
        }
        let key = TenantKey::global();
        let start = 1_000_000 * MS;
        let (mut admitted, mut at_flood) = (Vec::new(), 0);
        for step in 0..800u64 {
            let now = Instant::from_nanos(start + step * MS);
            if step % 20 == 0 {
                for r in &replicas {
                    r.refresh_shares(now).await;
                }
            }
            // Busy for 300 ms (shares by demand), a trickle below them until 700 ms
            // (their buckets and the pool fill), then every replica floods at once.
            let requests = match step {
                0..300 => 3,
                700 => 40,
                _ => u64::from(step % 20 == 0),
            };
            for r in &replicas {
                for _ in 0..requests {
                    if let Ok(grant) = r.acquire(&key, 1, now).await {
                        admitted.push((now.as_nanos(), 1));
                        at_flood += u64::from(step == 700);
                        r.release(&key, grant);
                    }
                }
            }
        }
        // The bound with the excess: twice the burst.
        assert_bound("global", &admitted, 300, 1_000 * MS, 2 * 30);
        // And the excess is there to use: the flood gets more than one burst at once.
        assert!(at_flood > 30, "the flood got {at_flood}");
    });
}

/// A tenant far below its limits whose requests come in bunches of uneven size (3, then
/// 30, every refresh period) on one replica of three: its share follows the bunches, and
/// it is never refused, as it would not be without shares; most grants come from the
/// share. Caught: a share given up by every period with fewer than `hot_after` requests
/// (then 87 of 990 grants came from the share, the rest a round trip each), and a
/// shrinking share dropping its tokens above the new burst instead of giving them back
/// (each growth then took the pool's tokens as a gift and each shrink lost them, until
/// the pool was dry: 64 refusals).
#[test]
fn a_tenant_far_below_its_limits_with_bunched_requests_is_never_refused() {
    let Some(server) = redis_for("a_tenant_far_below_its_limits_with_bunched_requests_is_never_refused") else {
        return;
    };
    runtime().block_on(async {
        let url = server.url();
        // A plan as the embedding gateway's: requests and tokens a minute per org.
        let policy = LimitSetPolicy::new()
            .tiers(["org"])
            .limit(LimitPolicy::gcra("rpm", Quota::per_minute(nz!(12_000)).burst(nz!(1_200))).per("org"))
            .limit(
                LimitPolicy::gcra("tpm", Quota::per_minute(nz!(1_200_000)).burst(nz!(120_000)))
                    .per("org")
                    .counting_cost(),
            );
        let ns = namespace("shares-bunched");
        let mut replicas = Vec::new();
        for _ in 0..3 {
            let conn = connect(&url).await;
            let settings = Shares::new().refresh_every(Duration::from_millis(100)).lifetime(Duration::from_secs(1));
            replicas.push(manual(policy.clone(), "shares").namespace(&ns).shares(settings).build(&conn).unwrap());
        }
        let key = TenantKey::new(["acme"]).unwrap();
        let start = 1_000_000 * MS;
        let (mut admitted, mut refused) = (0u64, Vec::new());
        for step in 0..6_000u64 {
            let now = Instant::from_nanos(start + step * MS);
            if step % 100 == 0 {
                for r in &replicas {
                    r.refresh_shares(now).await;
                }
            }
            if step % 100 == 50 {
                let bunch = if (step / 100) % 2 == 0 { 3 } else { 30 };
                let r = &replicas[0];
                for _ in 0..bunch {
                    match r.acquire(&key, 100, now).await {
                        Ok(grant) => {
                            admitted += 1;
                            r.release(&key, grant);
                        }
                        Err(e) => refused.push((step, e)),
                    }
                }
            }
        }
        assert!(refused.is_empty(), "refused {} of {}: {:?}", refused.len(), admitted, refused.first());
        let shared: u64 = replicas.iter().map(|r| r.stats().shared_grants).sum();
        assert!(shared * 4 >= admitted * 3, "most grants from the shares: {shared} of {admitted}");
    });
}

/// A thin rate (a free plan's 240 a minute with a burst of 2, below `min_burst`) is not
/// split: a tenant spread over three replicas is decided from the pool per request, and
/// admitted exactly what the per-request path admits, where split shares of 0 or 1 would
/// pace it at a third of its rate.
#[test]
fn a_thin_rate_is_decided_per_request_and_admits_what_the_limit_allows() {
    let Some(server) = redis_for("a_thin_rate_is_decided_per_request_and_admits_what_the_limit_allows") else {
        return;
    };
    runtime().block_on(async {
        let url = server.url();
        let policy = LimitSetPolicy::new()
            .tiers(["org"])
            .limit(LimitPolicy::gcra("rpm", Quota::per_minute(nz!(240)).burst(nz!(2))).per("org"));
        let ns = namespace("shares-thin");
        let settings = Shares::new().refresh_every(Duration::from_millis(100)).lifetime(Duration::from_secs(1));
        let mut replicas = Vec::new();
        for _ in 0..3 {
            let conn = connect(&url).await;
            replicas.push(manual(policy.clone(), "shares").namespace(&ns).shares(settings).build(&conn).unwrap());
        }
        let conn = connect(&url).await;
        let per_request =
            manual(policy.clone(), "shares").namespace(namespace("shares-thin-per-request")).build(&conn).unwrap();
        let key = TenantKey::new(["hooli"]).unwrap();
        let start = 1_000_000 * MS;
        let (mut shared, mut alone) = (0u64, 0u64);
        let mut admitted = Vec::new();
        // Ten seconds of a client asking every 5 ms (fifty times what the limit allows, as
        // a client retrying its refusals does), routed 60/30/10.
        for step in 0..10_000u64 {
            let now = Instant::from_nanos(start + step * MS);
            if step % 100 == 0 {
                for r in &replicas {
                    r.refresh_shares(now).await;
                }
            }
            if step % 5 == 0 {
                let r = &replicas[match (step / 5) % 10 {
                    0..=5 => 0,
                    6..=8 => 1,
                    _ => 2,
                }];
                if let Ok(grant) = r.acquire(&key, 1, now).await {
                    shared += 1;
                    admitted.push((now.as_nanos(), 1));
                    r.release(&key, grant);
                }
                if let Ok(grant) = per_request.acquire(&key, 1, now).await {
                    alone += 1;
                    per_request.release(&key, grant);
                }
            }
        }
        assert_eq!(shared, alone, "the fleet admits what the per-request path admits");
        assert!((40..=42).contains(&alone), "the limit's 4 a second and its burst: {alone}");
        let refreshes: u64 = replicas.iter().map(|r| r.stats().share_refreshes).sum();
        assert_eq!(refreshes, 0, "a thin rate is never split: no share to refresh");

        assert_bound("rpm", &admitted, 240, 60_000 * MS, 2);
        // A pool that refused, or that a grant left without a unit, refuses locally until it
        // refills one, and books the unit it refills next for the replica that asked: each
        // call grants a unit or books one, unless the bookings already hold the whole
        // burst. (Without bookings, the three replicas raced for every unit: 122 calls.)
        let calls: u64 = replicas.iter().map(|r| r.stats().round_trips).sum();
        assert!(calls < 2 * 41, "fewer than two calls per unit admitted: {calls}");
    });
}

#[test]
fn a_scope_that_turns_hot_is_refreshed_early_and_alone() {
    let Some(server) = redis_for("a_scope_that_turns_hot_is_refreshed_early_and_alone") else { return };
    runtime().block_on(async {
        let policy = LimitSetPolicy::new()
            .tiers(["tenant"])
            .limit(LimitPolicy::gcra("rate", Quota::per_second(nz!(1_000)).burst(nz!(100))).per("tenant"));
        let conn = connect(&server.url()).await;
        let replica = manual(policy, "shares-early").shares(shares().hot_after(4)).build(&conn).unwrap();
        let (hot, cold) = (TenantKey::new(["hot"]).unwrap(), TenantKey::new(["cold"]).unwrap());
        let start = 1_000_000 * MS;
        let at = |ms: u64| Instant::from_nanos(start + ms * MS);
        for _ in 0..2 {
            let _ = replica.acquire(&cold, 1, at(0)).await.unwrap();
        }
        assert!(!replica.refresh_turned_hot(at(1)).await, "two requests: nothing turned hot");
        for _ in 0..4 {
            let grant = replica.acquire(&hot, 1, at(1)).await.unwrap();
            assert_ne!(grant.source(), GrantSource::Share, "no share yet");
        }
        let calls = replica.stats().share_refreshes;
        assert!(replica.refresh_turned_hot(at(2)).await, "the fourth request turned the scope hot");
        assert_eq!(replica.stats().share_refreshes - calls, 1);
        // The hot scope decides from its share now; the cold one still takes from the pool.
        assert_eq!(replica.acquire(&hot, 1, at(3)).await.unwrap().source(), GrantSource::Share);
        assert_ne!(replica.acquire(&cold, 1, at(3)).await.unwrap().source(), GrantSource::Share);
        // Once reported, a scope does not ask again before the next period.
        for _ in 0..8 {
            let _ = replica.acquire(&hot, 1, at(4)).await.unwrap();
        }
        assert!(!replica.refresh_turned_hot(at(5)).await, "a scope turns hot once");
    });
}

#[test]
fn a_share_group_refreshes_its_backends_in_one_call_as_each_would_alone() {
    let Some(server) = redis_for("a_share_group_refreshes_its_backends_in_one_call_as_each_would_alone") else {
        return;
    };
    runtime().block_on(async {
        let url = server.url();
        // A plan's rates and a budget's window, as a gateway has: two limit sets.
        let plan = LimitSetPolicy::new()
            .tiers(["org"])
            .limit(LimitPolicy::gcra("rpm", Quota::per_second(nz!(200)).burst(nz!(20))).per("org"))
            .limit(LimitPolicy::semaphore("concurrency", 6).per("org"));
        let budget = LimitSetPolicy::new()
            .tiers(["org"])
            .limit(LimitPolicy::fixed_window("budget", 400, Duration::from_secs(1)).per("org"));
        // Two replicas of each: one pair refreshed by a group each, the other alone.
        let (grouped_ns, alone_ns) = (namespace("group"), namespace("alone"));
        let mut grouped = Vec::new();
        let mut alone = Vec::new();
        for _ in 0..2 {
            let conn = connect(&url).await;
            let group = ShareGroup::new(shares());
            let build = |policy: &LimitSetPolicy, ns: String| manual(policy.clone(), "group").namespace(ns);
            grouped.push([
                build(&plan, format!("{grouped_ns}:plan")).shares_in(&group).build(&conn).unwrap(),
                build(&budget, format!("{grouped_ns}:budget")).shares_in(&group).build(&conn).unwrap(),
            ]);
            alone.push([
                build(&plan, format!("{alone_ns}:plan")).shares(shares()).build(&conn).unwrap(),
                build(&budget, format!("{alone_ns}:budget")).shares(shares()).build(&conn).unwrap(),
            ]);
        }
        let tenants: Vec<TenantKey> = ["a", "b", "c"].iter().map(|t| TenantKey::new([*t]).unwrap()).collect();
        let mut rng = Rng(37);
        let start = 1_000_000 * MS;
        let calls = |pair: &[RedisBackend; 2]| pair.iter().map(|b| b.stats().share_refreshes).sum::<u64>();
        let (mut group_calls, mut alone_calls) = (0, 0);
        for step in 0..600u64 {
            let now = Instant::from_nanos(start + step * MS);
            if step % 20 == 0 {
                for (g, a) in grouped.iter().zip(&alone) {
                    let (g0, a0) = (calls(g), a.iter().map(|b| b.stats().share_refreshes).collect::<Vec<_>>());
                    // Either backend refreshes its whole group.
                    assert!(g[(step / 20 % 2) as usize].refresh_shares(now).await);
                    for backend in a {
                        assert!(backend.refresh_shares(now).await);
                    }
                    let alone: Vec<u64> =
                        a.iter().zip(a0).map(|(b, before)| b.stats().share_refreshes - before).collect();
                    let group = calls(g) - g0;
                    assert_eq!(group, alone.iter().copied().max().unwrap_or(0), "step {step}: one call for the group");
                    group_calls += group;
                    alone_calls += alone.iter().sum::<u64>();
                }
            }
            for _ in 0..rng.below(4) {
                let (replica, set, tenant) = (rng.below(2) as usize, rng.below(2) as usize, rng.below(3) as usize);
                let key = &tenants[tenant];
                let cost = 1 + rng.below(3);
                let g = grouped[replica][set].acquire(key, cost, now).await;
                let a = alone[replica][set].acquire(key, cost, now).await;
                match (g, a) {
                    (Ok(g), Ok(a)) => {
                        assert_eq!(g.source(), a.source(), "step {step}: granted from the same place");
                        grouped[replica][set].release(key, g);
                        alone[replica][set].release(key, a);
                    }
                    (Err(g), Err(a)) => assert_eq!(g.to_string(), a.to_string(), "step {step}"),
                    (g, a) => panic!("step {step}: grouped {g:?}, alone {a:?}"),
                }
            }
        }
        let from_shares = |pair: &[RedisBackend; 2]| pair.iter().map(|b| b.stats().shared_grants).sum::<u64>();
        for (g, a) in grouped.iter().zip(&alone) {
            assert!(from_shares(g) > 100, "the shares decided most requests: {}", from_shares(g));
            assert_eq!(from_shares(g), from_shares(a));
        }
        assert!(alone_calls > group_calls * 3 / 2, "refreshed alone: {alone_calls} calls, as a group: {group_calls}");
    });
}

#[test]
fn a_lease_refresh_carries_the_share_group_s_refresh_in_its_call() {
    let Some(server) = redis_for("a_lease_refresh_carries_the_share_group_s_refresh_in_its_call") else {
        return;
    };
    runtime().block_on(async {
        let url = server.url();
        let plan = LimitSetPolicy::new()
            .tiers(["org"])
            .limit(LimitPolicy::gcra("rpm", Quota::per_second(nz!(200)).burst(nz!(20))).per("org"));
        let account = LimitSetPolicy::new().limit(LimitPolicy::gcra("rps", Quota::per_second(nz!(100)).burst(nz!(10))));
        let leases = AccountLeases::new().refresh_every(Duration::from_millis(20)).lifetime(Duration::from_millis(100));
        let conn = connect(&url).await;
        let group = ShareGroup::new(shares());
        let carried = manual(plan.clone(), "carried").shares_in(&group).build(&conn).unwrap();
        let store = RedisAccounts::builder("accounts")
            .namespace(namespace("carried"))
            .manual_clock()
            .timeout(Duration::from_secs(5))
            .member("only", account.clone())
            .leases(leases)
            .carry_shares(&group)
            .build(&conn)
            .unwrap();
        let pool = LimitPool::builder(Selection::MostHeadroom)
            .member("only", LimitSet::new(account.clone()).unwrap(), ())
            .shared(std::sync::Arc::new(store.clone()))
            .build()
            .unwrap();
        // The same plan refreshed alone.
        let alone = manual(plan.clone(), "alone").shares(shares()).build(&conn).unwrap();
        let tenants: Vec<TenantKey> = ["a", "b"].iter().map(|t| TenantKey::new([*t]).unwrap()).collect();
        let mut rng = Rng(30);
        let start = 1_000_000 * MS;
        for step in 0..400u64 {
            let now = Instant::from_nanos(start + step * MS);
            if step % 20 == 0 {
                assert!(store.refresh_leases(now).await, "step {step}: the lease refresh answered");
                assert!(alone.refresh_shares(now).await);
                if step > 0 {
                    assert!(store.leased_fraction(now).is_some_and(|f| f > 0.0), "step {step}: the lease is held");
                }
            }
            // The accounts' demand: a request a step.
            if let Ok(grant) = Backend::acquire(&pool, &TenantKey::global(), 1, now).await {
                Backend::release(&pool, &TenantKey::global(), grant);
            }
            for _ in 0..rng.below(4) {
                let key = &tenants[rng.below(2) as usize];
                let cost = 1 + rng.below(3);
                match (carried.acquire(key, cost, now).await, alone.acquire(key, cost, now).await) {
                    (Ok(c), Ok(a)) => assert_eq!(c.source(), a.source(), "step {step}: granted from the same place"),
                    (Err(c), Err(a)) => assert_eq!(c.to_string(), a.to_string(), "step {step}"),
                    (c, a) => panic!("step {step}: carried {c:?}, alone {a:?}"),
                }
            }
        }
        assert!(carried.stats().shared_grants > 100, "the shares decided: {:?}", carried.stats());
        assert_eq!(carried.stats().shared_grants, alone.stats().shared_grants);
        assert_eq!(carried.stats().share_refreshes, 0, "every refresh rode on a lease refresh");
        // Every refresh but the first, which had nothing to report yet.
        assert_eq!(carried.stats().share_refreshes_carried, 19, "{:?}", carried.stats());
        assert!(alone.stats().share_refreshes >= 15, "{:?}", alone.stats());
        // Carrying needs leases, and the group's connection.
        let without_leases = RedisAccounts::builder("accounts").member("only", account.clone()).carry_shares(&group);
        let err = without_leases.manual_clock().build(&conn).unwrap_err();
        assert!(matches!(err, BuildError::Invalid { field: "carry_shares", .. }), "{err}");
        let other = connect(&url).await;
        let elsewhere = RedisAccounts::builder("accounts").member("only", account).leases(leases).carry_shares(&group);
        let err = elsewhere.manual_clock().build(&other).unwrap_err();
        assert!(matches!(err, BuildError::Invalid { field: "carry_shares", .. }), "{err}");
    });
}

#[test]
fn a_share_group_refuses_a_backend_on_another_connection_or_clock() {
    let Some(server) = redis_for("a_share_group_refuses_a_backend_on_another_connection_or_clock") else {
        return;
    };
    runtime().block_on(async {
        let (one, other) = (connect(&server.url()).await, connect(&server.url()).await);
        let rate = LimitSetPolicy::new().limit(LimitPolicy::gcra("r", Quota::per_second(nz!(10))));
        let group = ShareGroup::new(shares());
        let _first = manual(rate.clone(), "group").shares_in(&group).build(&one).unwrap();
        let _clone = manual(rate.clone(), "group").shares_in(&group).build(&one.clone()).unwrap();
        let err = manual(rate.clone(), "group").shares_in(&group).build(&other).unwrap_err();
        assert!(matches!(err, BuildError::Invalid { field: "shares_in", .. }), "{err}");
        assert!(err.to_string().contains("one RedisConnection"), "{err}");
        let err = RedisBackend::builder(rate).namespace(namespace("group")).shares_in(&group).build(&one).unwrap_err();
        assert!(err.to_string().contains("manual clock"), "{err}");
    });
}

#[test]
fn shares_are_refused_for_limits_they_cannot_split_and_for_bad_settings() {
    let Some(server) = redis_for("shares_are_refused_for_limits_they_cannot_split_and_for_bad_settings") else {
        return;
    };
    runtime().block_on(async {
        let conn = connect(&server.url()).await;
        let window = LimitSetPolicy::new().limit(LimitPolicy::sliding_window_log("w", 4, Duration::from_secs(1)));
        let err = RedisBackend::builder(window).shares(Shares::new()).build(&conn).unwrap_err();
        assert!(err.to_string().contains("a sliding window cannot be shared"), "{err}");
        let rate = LimitSetPolicy::new().limit(LimitPolicy::gcra("r", Quota::per_second(nz!(10))));
        let err = RedisBackend::builder(rate.clone())
            .shares(Shares::new().lifetime(Duration::from_millis(100)))
            .build(&conn)
            .unwrap_err();
        assert!(err.to_string().starts_with("shares.lifetime: must be at least"), "{err}");
        let err = RedisBackend::builder(rate.clone())
            .shares(Shares::new().refresh_every(Duration::ZERO))
            .build(&conn)
            .unwrap_err();
        assert!(err.to_string().starts_with("shares.refresh:"), "{err}");
        let err = RedisBackend::builder(rate).shares(Shares::new().burst_excess(1_001)).build(&conn).unwrap_err();
        assert!(err.to_string().starts_with("shares.burst_excess:"), "{err}");
    });
}
