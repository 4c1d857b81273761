//! Law 20: upstream accounts shared by a fleet through Redis: several replicas (each its
//! own connection, store and pool) draw from one mirror per account. No account is ever
//! charged beyond its limits, the fleet uses all of them whichever replica the traffic
//! lands on, upstream feedback seen by one replica holds for all, and while Redis is away
//! the failure policy decides. Law numbers are those of
//! `crates/tower-limits/docs/laws.md`.

mod redis_common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tower_limits_core::{
    AcquireError, Backend, Instant, LimitPolicy, LimitPool, LimitSet, LimitSetPolicy, Selection, TenantKey,
    UpstreamReport,
};
use tower_limits_redis::test_support::{own_redis_for, redis_for};
use tower_limits_redis::{FailurePolicy, RedisAccounts, RedisConnection};
use tower_limits_tests::quota;

use redis_common::{admin, cmd, connect, namespace, runtime};

const REPLICAS: usize = 3;
const TASKS: usize = 48;

/// An account: `rpm` requests a minute (all of them as a burst) and `tpm` tokens.
fn account(rpm: u64, tpm: u64) -> LimitSetPolicy {
    LimitSetPolicy::new()
        .limit(LimitPolicy::gcra("rpm", quota(rpm, Duration::from_secs(60), rpm)))
        .limit(LimitPolicy::token_bucket("tpm", quota(tpm, Duration::from_secs(60), tpm)).counting_cost())
}

const ACCOUNTS: [(&str, u64, u64); 2] = [("a", 40, 400), ("b", 20, 150)];

/// One replica: its own store and pool, whose local sets are `share` of each account.
fn replica(conn: &RedisConnection, ns: &str, failure: FailurePolicy, timeout: Duration) -> (LimitPool, RedisAccounts) {
    let mut store = RedisAccounts::builder("accounts").namespace(ns).timeout(timeout).on_failure(failure);
    let mut pool = LimitPool::builder(Selection::MostHeadroom);
    for (name, rpm, tpm) in ACCOUNTS {
        store = store.member(name, account(rpm, tpm));
        let local = LimitSet::new(account((rpm / REPLICAS as u64).max(1), (tpm / REPLICAS as u64).max(1))).unwrap();
        pool = pool.member(name, local, ());
    }
    let store = store.build(conn).unwrap();
    // The pool shares the store; the test keeps a clone for flush and stats.
    (pool.shared(Arc::new(store.clone())).build().unwrap(), store)
}

async fn server_us(url: &str) -> u64 {
    let mut admin = admin(url).await;
    let (s, us): (u64, u64) = cmd(&mut admin, &["TIME"]).await;
    s * 1_000_000 + us
}

#[test]
fn replicas_sharing_accounts_never_overrun_one_and_use_them_all() {
    let Some(server) = redis_for("replicas_sharing_accounts_never_overrun_one_and_use_them_all") else { return };
    runtime().block_on(async {
        let url = server.url();
        let ns = namespace("accounts-fleet");
        let mut replicas = Vec::new();
        for _ in 0..REPLICAS {
            let conn = connect(&url).await;
            replicas.push(replica(&conn, &ns, FailurePolicy::FailClosed, Duration::from_secs(5)));
        }
        let requests: Arc<[AtomicU64; 2]> = Arc::new([AtomicU64::new(0), AtomicU64::new(0)]);
        let tokens: Arc<[AtomicU64; 2]> = Arc::new([AtomicU64::new(0), AtomicU64::new(0)]);
        let start = server_us(&url).await;
        let mut tasks = Vec::new();
        for t in 0..TASKS {
            // Uneven: most tasks on the first replica.
            let pool = replicas[if t % 6 < 4 { 0 } else { t % REPLICAS }].0.clone();
            let (requests, tokens) = (requests.clone(), tokens.clone());
            tasks.push(tokio::spawn(async move {
                let key = TenantKey::global();
                for i in 0..4u64 {
                    let cost = 1 + (t as u64 * 7 + i * 3) % 9;
                    match Backend::acquire(&pool, &key, cost, Instant::ZERO).await {
                        Ok(grant) => {
                            let m = grant.chosen().index;
                            requests[m].fetch_add(1, Ordering::Relaxed);
                            tokens[m].fetch_add(cost, Ordering::Relaxed);
                            Backend::release(&pool, &key, grant);
                        }
                        Err(AcquireError::Refused(d)) => assert!(d.is_global(), "{d:?}"),
                        Err(e) => panic!("{e}"),
                    }
                }
            }));
        }
        for task in tasks {
            task.await.unwrap();
        }
        let elapsed_us = server_us(&url).await - start;
        for (m, (name, rpm, tpm)) in ACCOUNTS.iter().enumerate() {
            let r = requests[m].load(Ordering::Relaxed);
            let k = tokens[m].load(Ordering::Relaxed);
            // GCRA: at most the burst plus what the rate frees over the run.
            let r_bound = rpm + elapsed_us * rpm / 60_000_000 + 1;
            let k_bound = tpm + elapsed_us * tpm / 60_000_000 + 1;
            assert!(r <= r_bound, "account {name}: {r} requests, bound {r_bound}");
            assert!(k <= k_bound, "account {name}: {k} tokens, bound {k_bound}");
        }
        let total: u64 = requests.iter().map(|r| r.load(Ordering::Relaxed)).sum();
        // 192 requests wanted 60 requests' worth of bursts: the fleet used nearly all of
        // both accounts although two thirds of the traffic hit one replica (a fixed
        // 1/3 split would have capped that replica at 20).
        assert!(total >= 55, "only {total} requests admitted of the accounts' 60");
        for (_, store) in &replicas {
            store.flush().await;
        }
        let calls: u64 = replicas.iter().map(|(_, s)| s.stats().acquire_calls).sum();
        assert_eq!(calls, (TASKS * 4) as u64, "one call per acquisition");
    });
}

#[test]
fn upstream_feedback_seen_by_one_replica_holds_for_all() {
    let Some(server) = redis_for("upstream_feedback_seen_by_one_replica_holds_for_all") else { return };
    runtime().block_on(async {
        let url = server.url();
        let ns = namespace("accounts-feedback");
        let conn = connect(&url).await;
        let (first, first_store) = replica(&conn, &ns, FailurePolicy::FailClosed, Duration::from_secs(5));
        let (second, _second_store) =
            replica(&connect(&url).await, &ns, FailurePolicy::FailClosed, Duration::from_secs(5));
        let key = TenantKey::global();
        // A 429 on account a, seen by the first replica.
        first.observe(
            0,
            &UpstreamReport { retry_after: Some(Duration::from_secs(30)), ..Default::default() },
            Instant::ZERO,
        );
        first_store.flush().await;
        for _ in 0..10 {
            let g = Backend::acquire(&second, &key, 1, Instant::ZERO).await.unwrap();
            assert_eq!(&*g.chosen().name, "b", "a is benched for the whole fleet");
            Backend::release(&second, &key, g);
        }
        assert!(second.benched_until(0, Instant::ZERO).is_some(), "the second replica heard of the bench");
        // b reports no tokens left: nobody gets b's tokens, and a is benched.
        first.observe(1, &UpstreamReport { remaining_tokens: Some(0), ..Default::default() }, Instant::ZERO);
        first_store.flush().await;
        match Backend::acquire(&second, &key, 5, Instant::ZERO).await {
            Err(AcquireError::Refused(d)) => {
                assert!(d.retry_after() > Duration::ZERO && d.retry_after() <= Duration::from_secs(30), "{d:?}")
            }
            other => panic!("expected a refusal, got {other:?}"),
        }
    });
}

#[test]
fn a_settle_rides_on_the_next_acquisition() {
    let Some(server) = redis_for("a_settle_rides_on_the_next_acquisition") else { return };
    // One thread: the background task runs only when the test awaits, so the settle is
    // still waiting when the acquisition is sent, however slow the machine.
    let one_thread = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    one_thread.block_on(async {
        let url = server.url();
        let ns = namespace("accounts-ride");
        let (pool, store) = replica(&connect(&url).await, &ns, FailurePolicy::FailClosed, Duration::from_secs(5));
        let key = TenantKey::global();
        // Both accounts' tokens taken (400 and 150), then 300 of a's given back by a settle.
        let mut a = Backend::acquire(&pool, &key, 400, Instant::ZERO).await.unwrap();
        assert_eq!(&*a.chosen().name, "a");
        let b = Backend::acquire(&pool, &key, 150, Instant::ZERO).await.unwrap();
        Backend::settle(&pool, &key, &mut a, 100, Instant::ZERO);
        // The next acquisition carries the settle and is decided after it, with no call of
        // the settle's own: the 300 tokens are there for it.
        let c = Backend::acquire(&pool, &key, 300, Instant::ZERO).await.expect("the settle's tokens");
        let stats = store.stats();
        assert_eq!((stats.ridden_ops, stats.batch_calls), (1, 0), "{stats:?}");
        for g in [a, b, c] {
            Backend::release(&pool, &key, g);
        }
    });
}

#[test]
fn while_redis_is_paused_the_fallback_decides_and_no_account_is_overrun() {
    let Some(server) = own_redis_for("while_redis_is_paused_the_fallback_decides_and_no_account_is_overrun") else {
        return;
    };
    let url = server.url();
    let rt = runtime();
    let ns = namespace("accounts-pause");
    let (pool, store) = rt.block_on(async {
        let conn = connect(&url).await;
        replica(&conn, &ns, FailurePolicy::Fallback { share: 1.0 / REPLICAS as f64 }, Duration::from_millis(100))
    });
    let key = TenantKey::global();
    // Redis answers: the shared mirrors decide.
    rt.block_on(async {
        let g = Backend::acquire(&pool, &key, 1, Instant::ZERO).await.unwrap();
        Backend::release(&pool, &key, g);
    });
    // Redis paused for 1.5 s (every client's commands wait): each acquisition times out
    // (or meets the open breaker) and the local share decides: at most a third of each
    // account's burst.
    rt.block_on(async {
        let mut admin_conn = admin(&url).await;
        let _: String = cmd(&mut admin_conn, &["CLIENT", "PAUSE", "1500", "ALL"]).await;
    });
    let granted = rt.block_on(async {
        let mut granted = 0u64;
        for _ in 0..40 {
            match Backend::acquire(&pool, &key, 1, Instant::ZERO).await {
                Ok(g) => {
                    granted += 1;
                    Backend::release(&pool, &key, g);
                }
                Err(AcquireError::Refused(_)) => {}
                Err(e) => panic!("the fallback should decide, got {e}"),
            }
        }
        granted
    });
    let shares: u64 = ACCOUNTS.iter().map(|(_, rpm, _)| rpm / REPLICAS as u64).sum();
    assert!(store.stats().failures > 0, "Redis never failed: the pause did not happen");
    assert!(granted <= shares + 1, "{granted} granted while Redis was paused, the replica's share is {shares}");
    assert!(granted >= shares - 1, "the fallback granted only {granted} of the replica's share {shares}");
}

#[test]
fn a_replica_that_stops_holds_the_turn_no_longer_than_its_wait_plus_the_grace() {
    let Some(server) = redis_for("a_replica_that_stops_holds_the_turn_no_longer_than_its_wait_plus_the_grace") else {
        return;
    };
    runtime().block_on(async {
        let url = server.url();
        let ns = namespace("accounts-turn");
        let (first, _s1) = replica(&connect(&url).await, &ns, FailurePolicy::FailClosed, Duration::from_secs(5));
        let (second, _s2) = replica(&connect(&url).await, &ns, FailurePolicy::FailClosed, Duration::from_secs(5));
        let key = TenantKey::global();
        // Use up both accounts' requests.
        let mut grants = Vec::new();
        while let Ok(g) = Backend::acquire(&first, &key, 1, Instant::ZERO).await {
            grants.push(g);
        }
        assert_eq!(grants.len() as u64, ACCOUNTS.iter().map(|(_, rpm, _)| rpm).sum::<u64>());
        // The first replica was refused last: it holds the turn, then stops (is dropped).
        let Err(AcquireError::Refused(first_wait)) = Backend::acquire(&first, &key, 1, Instant::ZERO).await else {
            panic!("the accounts are used up")
        };
        drop(first);
        // The second is refused for at most the first's wait plus the 50 ms grace.
        let Err(AcquireError::Refused(second_wait)) = Backend::acquire(&second, &key, 1, Instant::ZERO).await else {
            panic!("the accounts are used up")
        };
        let bound = first_wait.retry_after() + Duration::from_millis(50);
        assert!(second_wait.retry_after() <= bound, "{:?} > {bound:?}", second_wait.retry_after());
        assert!(second_wait.retry_after() + Duration::from_millis(100) >= first_wait.retry_after());
    });
}

/// Admits cost-1 requests through `pool` until the accounts refuse; how many passed.
async fn drain(pool: &LimitPool) -> u64 {
    let key = TenantKey::global();
    let mut granted = 0u64;
    loop {
        match Backend::acquire(pool, &key, 1, Instant::ZERO).await {
            Ok(g) => {
                granted += 1;
                Backend::release(pool, &key, g);
            }
            Err(AcquireError::Refused(_)) => return granted,
            Err(e) => panic!("{e}"),
        }
        assert!(granted <= 1_000, "the accounts never refused");
    }
}

/// A Redis that restarts empty forgets what the accounts were charged, while the
/// upstream's windows still count it: the store, which reached Redis before, finds the
/// pool's epoch gone and starts every mirror with its burst spent. Over the window that
/// holds the restart, an account is charged at most its burst plus its rate. A new fleet
/// (a store's first call) starts full.
#[test]
fn redis_restarted_empty_starts_the_mirrors_spent_and_feedback_still_corrects_them() {
    let Some(mut server) = own_redis_for("redis_restarted_empty_starts_the_mirrors_spent") else {
        return;
    };
    let url = server.url();
    runtime().block_on(async {
        let ns = namespace("accounts-restart");
        let conn = connect(&url).await;
        let (pool, store) = replica(&conn, &ns, FailurePolicy::FailClosed, Duration::from_millis(200));
        let bursts: u64 = ACCOUNTS.iter().map(|(_, rpm, _)| rpm).sum();
        let freed_in = |us: u64| ACCOUNTS.iter().map(|(_, rpm, _)| us * rpm / 60_000_000 + 1).sum::<u64>();
        let start = server_us(&url).await;
        let before = drain(&pool).await;
        let drained_us = server_us(&url).await - start;
        assert!(before >= bursts - 1, "{before}: a new fleet starts with its bursts");
        assert!(before <= bursts + freed_in(drained_us), "{before} before the restart");

        // Restarted empty: the first answer is a refusal, the bursts spent.
        server.restart().expect("the server restarts");
        let restart_us = server_us(&url).await;
        let key = TenantKey::global();
        let answered = async {
            loop {
                match Backend::acquire(&pool, &key, 1, Instant::ZERO).await {
                    Ok(g) => {
                        Backend::release(&pool, &key, g);
                        return 1;
                    }
                    Err(AcquireError::Refused(_)) => return 0,
                    Err(AcquireError::Unavailable(_)) => tokio::time::sleep(Duration::from_millis(5)).await,
                    Err(e) => panic!("{e}"),
                }
            }
        };
        let first = tokio::time::timeout(Duration::from_secs(20), answered).await.expect("redis never answered again");
        let after = first + drain(&pool).await;
        let since_us = server_us(&url).await - restart_us;
        // Only what the rates freed since the restart: no fresh burst.
        assert!(
            after <= freed_in(since_us),
            "{after} granted after the restart, the rates freed {}",
            freed_in(since_us)
        );
        assert!(before + after <= bursts + freed_in(drained_us + since_us), "{before} + {after} over one burst");

        // The upstream's own count still corrects the mirrors: nothing is left, and the
        // fleet stops charging the accounts at once.
        let t0 = server_us(&url).await;
        for (index, _) in ACCOUNTS.iter().enumerate() {
            pool.observe(index, &UpstreamReport { remaining_requests: Some(0), ..Default::default() }, Instant::ZERO);
        }
        store.flush().await;
        let refilled_us = server_us(&url).await - t0;
        let late = drain(&pool).await;
        assert!(late <= freed_in(refilled_us), "{late} granted after the upstream said nothing is left");
    });
}
