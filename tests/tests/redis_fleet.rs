//! Law 21, a fleet: several independent backends (as separate replicas would have, each
//! with its own connection) sharing one Redis, 64 concurrent tasks, the server's own
//! clock. The shared limits hold for the fleet as a whole. Law numbers are those of
//! `crates/tower-limits/docs/laws.md`.

mod redis_common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tower_limits_core::{AcquireError, Backend, Instant, LimitPolicy, LimitSetPolicy, Quota, TenantKey, nz};
use tower_limits_redis::RedisBackend;
use tower_limits_redis::test_support::redis_for;
use tower_limits_tests::quota;

use redis_common::{admin, cmd, connect, namespace, runtime};

const REPLICAS: usize = 4;
const TASKS: usize = 64;

async fn fleet(url: &str, policy: &LimitSetPolicy, ns: &str) -> Vec<RedisBackend> {
    let mut replicas = Vec::new();
    for _ in 0..REPLICAS {
        let conn = connect(url).await;
        replicas.push(
            RedisBackend::builder(policy.clone()).namespace(ns).timeout(Duration::from_secs(5)).build(&conn).unwrap(),
        );
    }
    replicas
}

async fn server_us(url: &str) -> u64 {
    let mut admin = admin(url).await;
    let (s, us): (u64, u64) = cmd(&mut admin, &["TIME"]).await;
    s * 1_000_000 + us
}

#[test]
fn the_fleet_never_admits_more_than_the_limit_plus_burst() {
    let Some(server) = redis_for("the_fleet_never_admits_more_than_the_limit_plus_burst") else { return };
    runtime().block_on(async {
        let url = server.url();
        let interval = Duration::from_secs(60);
        let (burst, window_limit) = (40u64, 25u64);
        let policy = LimitSetPolicy::new()
            .tiers(["org", "user"])
            .limit(LimitPolicy::gcra("requests", quota(1, interval, burst)).per("org"))
            .limit(
                LimitPolicy::token_bucket("tokens", Quota::per_minute(nz!(60)).burst(nz!(300)))
                    .per("org")
                    .counting_cost(),
            )
            .limit(LimitPolicy::sliding_window_log("exact", window_limit * 4, Duration::from_secs(3600)).per("org"));
        let replicas = fleet(&url, &policy, &namespace("fleet-rate")).await;
        let requests = Arc::new(AtomicU64::new(0));
        let tokens = Arc::new(AtomicU64::new(0));
        let start = server_us(&url).await;
        let mut tasks = Vec::new();
        for t in 0..TASKS {
            let backend = replicas[t % REPLICAS].clone();
            let (requests, tokens) = (requests.clone(), tokens.clone());
            tasks.push(tokio::spawn(async move {
                let key = TenantKey::new(["acme", &format!("user-{t}")]).unwrap();
                for i in 0..12u64 {
                    let cost = 1 + (t as u64 * 7 + i * 3) % 9;
                    match backend.acquire(&key, cost, Instant::ZERO).await {
                        Ok(grant) => {
                            requests.fetch_add(1, Ordering::Relaxed);
                            tokens.fetch_add(cost, Ordering::Relaxed);
                            backend.release(&key, grant);
                        }
                        Err(AcquireError::Refused(_)) => {}
                        Err(e) => panic!("{e}"),
                    }
                }
            }));
        }
        for task in tasks {
            task.await.unwrap();
        }
        let elapsed_us = server_us(&url).await - start;
        let requests = requests.load(Ordering::Relaxed);
        let tokens = tokens.load(Ordering::Relaxed);
        // Rate cap: admitted <= burst + elapsed / interval, over the whole run, for the fleet.
        let gcra_bound = burst + elapsed_us / 60_000_000;
        let token_bound = 300 + elapsed_us / 1_000_000;
        assert!(requests <= gcra_bound, "{requests} requests admitted, bound {gcra_bound}");
        assert!(tokens <= token_bound, "{tokens} tokens admitted, bound {token_bound}");
        assert!(requests >= 20, "the limits were hardly used ({requests} admitted)");
        let total: u64 = replicas.iter().map(|r| r.stats().granted).sum();
        assert_eq!(total, requests);
        for r in &replicas {
            r.flush().await;
        }
    });
}

#[test]
fn the_fleet_never_holds_more_than_the_capacity() {
    let Some(server) = redis_for("the_fleet_never_holds_more_than_the_capacity") else { return };
    runtime().block_on(async {
        let url = server.url();
        let capacity = 5u64;
        let policy = LimitSetPolicy::new()
            .tiers(["org"])
            .limit(LimitPolicy::semaphore("concurrent", capacity).per("org"))
            .limit(LimitPolicy::gcra("requests", Quota::per_second(nz!(1_000_000))).per("org"));
        let replicas = fleet(&url, &policy, &namespace("fleet-sem")).await;
        let held = Arc::new(AtomicU64::new(0));
        let most = Arc::new(AtomicU64::new(0));
        let admitted = Arc::new(AtomicU64::new(0));
        let mut tasks = Vec::new();
        for t in 0..TASKS {
            let backend = replicas[t % REPLICAS].clone();
            let (held, most, admitted) = (held.clone(), most.clone(), admitted.clone());
            tasks.push(tokio::spawn(async move {
                let key = TenantKey::single("acme").unwrap();
                for i in 0..20 {
                    match backend.acquire(&key, 1, Instant::ZERO).await {
                        Ok(grant) => {
                            let now = held.fetch_add(1, Ordering::SeqCst) + 1;
                            most.fetch_max(now, Ordering::SeqCst);
                            admitted.fetch_add(1, Ordering::Relaxed);
                            for _ in 0..(t + i) % 4 {
                                tokio::task::yield_now().await;
                            }
                            // Counted out before Redis hears of the release: conservative.
                            held.fetch_sub(1, Ordering::SeqCst);
                            backend.release(&key, grant);
                        }
                        Err(AcquireError::Refused(d)) => assert!(d.needs_release(), "{d:?}"),
                        Err(e) => panic!("{e}"),
                    }
                }
            }));
        }
        for task in tasks {
            task.await.unwrap();
        }
        for r in &replicas {
            r.flush().await;
        }
        let most = most.load(Ordering::SeqCst);
        assert!(most <= capacity, "{most} permits held at once, capacity {capacity}");
        assert!(admitted.load(Ordering::Relaxed) >= capacity, "hardly anything was admitted");
        // Everything came back: the whole capacity can be taken again.
        let key = TenantKey::single("acme").unwrap();
        let mut grants = Vec::new();
        for _ in 0..capacity {
            grants.push(replicas[0].acquire(&key, 1, Instant::ZERO).await.expect("all permits came back"));
        }
        assert!(replicas[1].acquire(&key, 1, Instant::ZERO).await.is_err());
        for g in grants {
            replicas[0].release(&key, g);
        }
        replicas[0].flush().await;
    });
}
