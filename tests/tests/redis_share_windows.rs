//! Law 29 for windows: replicas leasing a fixed or calendar window in blocks admit, in
//! every window, at most what it allows, counting the usage settled; a replica that dies
//! holding a block leaves it spent, nothing more; a busy window is used, mostly from
//! blocks. Against a real `redis-server`, several replicas (backends with their own
//! connections), random traffic, a manual clock. Law numbers are those of
//! `crates/tower-limits/docs/laws.md`.

mod redis_common;

use std::collections::HashMap;
use std::time::{Duration, SystemTime};

use tower_limits_core::algorithm::CalendarPeriod;
use tower_limits_core::{AcquireError, Backend, Instant, LimitPolicy, LimitSetPolicy, TenantKey};
use tower_limits_redis::test_support::{own_redis_for, redis_for};
use tower_limits_redis::{GrantSource, RedisBackend};
use tower_limits_tests::Rng;

use redis_common::{MS, Phases, connect, fleet, namespace, random_step, runtime};

/// A second, in the nanoseconds of a manual clock.
const SECOND: u64 = 1_000 * MS;

#[test]
fn a_fleet_leasing_windows_in_blocks_never_admits_more_than_a_window_allows() {
    let Some(server) = redis_for("a_fleet_leasing_windows_in_blocks_never_admits_more_than_a_window_allows") else {
        return;
    };
    runtime().block_on(async {
        let url = server.url();
        // A global window of 300 requests a second, and per tenant 120 units a second,
        // counting cost.
        let policy = LimitSetPolicy::new()
            .tiers(["tenant"])
            .limit(LimitPolicy::fixed_window("global", 300, Duration::from_secs(1)))
            .limit(LimitPolicy::fixed_window("tenant", 120, Duration::from_secs(1)).per("tenant").counting_cost());
        for seed in [3u64, 2024, 77_777, 5_151] {
            let mut rng = Rng(seed);
            let replicas = fleet(&url, &policy, &namespace("share-windows"), 3).await;
            let tenants = ["a", "b", "c", "d"].map(|t| TenantKey::new([t]).unwrap());
            // Per window (its start, in seconds) the requests admitted, and per tenant the
            // units they used.
            let mut global: HashMap<u64, u64> = HashMap::new();
            let mut per_tenant: HashMap<(u64, usize), u64> = HashMap::new();
            let (mut local, mut remote) = (0, 0);
            let start = 1_000 * SECOND;
            let mut phases = Phases::new();
            for step in 0..4_000u64 {
                let now = Instant::from_nanos(start + step * MS);
                let window = now.as_nanos() / SECOND;
                for a in random_step(&replicas, &tenants, &mut phases, step, now, &mut rng).await {
                    if a.from_share {
                        local += 1;
                    } else {
                        remote += 1;
                    }
                    *global.entry(window).or_default() += 1;
                    *per_tenant.entry((window, a.tenant)).or_default() += a.used;
                }
            }
            for (w, n) in &global {
                assert!(*n <= 300, "seed {seed}: {n} requests in window {w}");
            }
            for ((w, t), n) in &per_tenant {
                assert!(*n <= 120, "seed {seed}: tenant {t} used {n} units in window {w}");
            }
            // The traffic asks for more than the windows allow: they are used, mostly from
            // blocks.
            let busiest = global.values().max().copied().unwrap_or(0);
            assert!(busiest >= 250, "seed {seed}: at most {busiest} admitted in a window");
            assert!(local > remote, "seed {seed}: {local} from blocks, {remote} from Redis");
        }
    });
}

#[test]
fn a_replica_that_dies_holding_a_block_leaves_no_more_than_it_spent() {
    let Some(server) = redis_for("a_replica_that_dies_holding_a_block_leaves_no_more_than_it_spent") else {
        return;
    };
    runtime().block_on(async {
        let url = server.url();
        let policy = LimitSetPolicy::new().limit(LimitPolicy::fixed_window("w", 1_000, Duration::from_secs(60)));
        let replicas = fleet(&url, &policy, &namespace("share-window-death"), 2).await;
        let key = TenantKey::global();
        let start = 600 * SECOND;
        let mut admitted = [0u64; 2];
        // Both replicas busy for 200 ms: they hold blocks.
        for step in 0..200u64 {
            let now = Instant::from_nanos(start + step * MS);
            if step % 20 == 0 {
                for r in &replicas {
                    r.refresh_shares(now).await;
                }
            }
            for (i, r) in replicas.iter().enumerate() {
                if let Ok(g) = r.acquire(&key, 1, now).await {
                    admitted[i] += 1;
                    r.release(&key, g);
                }
            }
        }
        assert!(admitted[1] > 0 && replicas[1].stats().shared_grants > 0, "{admitted:?}");
        // Replica 1 dies. Replica 0 alone asks for everything: it gets the whole window
        // but for what replica 1 may have spent (its block, counted spent when it ends),
        // and never more.
        let mut after = 0;
        for step in 200..5_000u64 {
            let now = Instant::from_nanos(start + step * MS);
            if step % 20 == 0 {
                replicas[0].refresh_shares(now).await;
            }
            for _ in 0..4 {
                if let Ok(g) = replicas[0].acquire(&key, 1, now).await {
                    after += 1;
                    replicas[0].release(&key, g);
                }
            }
        }
        let total = admitted[0] + admitted[1] + after;
        assert!(total <= 1_000, "{total} admitted in a window of 1000");
        // Replica 1's block was two periods of its demand (at most a few dozen).
        assert!(total >= 900, "only {total} of 1000 admitted: the dead replica's block was large");
    });
}

#[test]
fn while_redis_is_away_a_replica_spends_its_block_then_the_failure_policy_answers() {
    let Some(mut server) =
        own_redis_for("while_redis_is_away_a_replica_spends_its_block_then_the_failure_policy_answers")
    else {
        return;
    };
    runtime().block_on(async {
        let conn = connect(&server.url()).await;
        let policy = LimitSetPolicy::new()
            .tiers(["tenant"])
            .limit(LimitPolicy::fixed_window("budget", 100_000, Duration::from_secs(60)).per("tenant").counting_cost());
        let key = TenantKey::new(["acme"]).unwrap();
        let start = 600 * SECOND;
        let at = |ms: u64| Instant::from_nanos(start + ms * MS);
        // A request of 3 units a millisecond: blocks of two periods of it (20 ms each).
        let backend = redis_common::busy_replica(&conn, policy, "share-window-away", &key, 3, start).await;
        server.stop();
        // Redis is away: the block decides, a request at a time, until it is spent; then
        // the failure policy (fail closed) answers.
        let mut from_block = 0;
        let refusal = loop {
            match backend.acquire(&key, 3, at(61 + from_block)).await {
                Ok(grant) => {
                    assert_eq!(grant.source(), GrantSource::Share, "request {from_block}");
                    backend.release(&key, grant);
                    from_block += 1;
                }
                Err(e) => break e,
            }
            assert!(from_block < 100, "a block of two periods' demand, not more");
        };
        assert!(matches!(refusal, AcquireError::Unavailable(_)), "{refusal}");
        // Two periods of 20 requests, and a quarter: 50 requests at most.
        assert!((35..=52).contains(&from_block), "{from_block} requests from the block");
    });
}

#[test]
fn a_monthly_budget_leased_in_blocks_is_spent_once_and_renews_on_the_first() {
    let Some(server) = redis_for("a_monthly_budget_leased_in_blocks_is_spent_once_and_renews_on_the_first") else {
        return;
    };
    runtime().block_on(async {
        let url = server.url();
        // 2026-11-30 22:00 UTC: midnight of December 1st in Berlin is an hour away.
        let origin = SystemTime::UNIX_EPOCH + Duration::from_secs(1_796_076_000);
        let policy = LimitSetPolicy::new().tiers(["team"]).limit(
            LimitPolicy::calendar_window("budget", 5_000, CalendarPeriod::Month, "Europe/Berlin")
                .with_clock_origin(origin)
                .per("team")
                .counting_cost(),
        );
        let ns = namespace("share-budget");
        let mut replicas = Vec::new();
        for _ in 0..3 {
            let conn = connect(&url).await;
            replicas.push(
                redis_common::manual(policy.clone(), "share-budget")
                    .namespace(&ns)
                    .shares(redis_common::shares())
                    .build(&conn)
                    .unwrap(),
            );
        }
        let team = TenantKey::new(["labs"]).unwrap();
        let mut rng = Rng(11);
        let spend = |replicas: &[RedisBackend], from: u64, steps: u64, rng: &mut Rng| {
            let replicas = replicas.to_vec();
            let team = team.clone();
            let mut rng = Rng(rng.below(1 << 30));
            async move {
                let mut spent = 0;
                let mut refusal = None;
                for step in from..from + steps {
                    let now = Instant::from_nanos(step * MS);
                    if step % 20 == 0 {
                        for r in &replicas {
                            r.refresh_shares(now).await;
                        }
                    }
                    let r = &replicas[rng.below(3) as usize];
                    let estimate = 20 + rng.below(20);
                    match r.acquire(&team, estimate, now).await {
                        Ok(mut g) => {
                            // The answer costs less than its estimate, or more.
                            let actual = estimate / 2 + rng.below(estimate);
                            r.settle(&team, &mut g, actual, now);
                            r.flush().await;
                            spent += actual;
                            r.release(&team, g);
                        }
                        Err(AcquireError::Refused(e)) => refusal = Some((step, e.retry_after())),
                        Err(e) => panic!("{e}"),
                    }
                }
                (spent, refusal)
            }
        };
        // Half an hour of a request a millisecond (in steps of 1 ms from 0, then from the
        // hour on): November's budget is spent at most once, however the replicas share
        // it (a charge beyond the estimate may exceed it by that grant's overrun).
        let (spent, refusal) = spend(&replicas, 0, 3_000, &mut rng).await;
        assert!(spent <= 5_000 + 40, "November: {spent} spent of 5000");
        assert!(spent >= 4_500, "November: only {spent} of 5000 spent");
        let (at, wait) = refusal.expect("the budget refuses once spent");
        // Refused until December 1st, midnight in Berlin: an hour after the origin.
        let left = Duration::from_secs(3_600) - Duration::from_millis(at);
        assert_eq!(wait, left, "refused at {at} ms until the month ends");
        // December: a new budget, from the first request.
        let (spent, _) = spend(&replicas, 3_600_000, 1_000, &mut rng).await;
        assert!((4_500..=5_040).contains(&spent), "December: {spent} spent of 5000");
    });
}
