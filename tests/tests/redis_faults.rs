//! Law 21 under faults: the script cache flushed mid-run, the server stopped and
//! restarted, clients paused, the server asleep past the timeout. Each acquisition
//! follows the set's failure policy, never panics and never hangs past its timeout; once
//! Redis is back nothing is lost (semaphore holds of timed-out acquisitions are released
//! by holder id). Law numbers are those of `crates/tower-limits/docs/laws.md`.
//!
//! Every acquisition runs under a hang guard of a few seconds, far above the backends'
//! 50 ms timeout: tripping it is a failure, not a measurement.

mod redis_common;

use std::future::Future;
use std::time::Duration;

use tower_limits_core::{AcquireError, Backend, Instant, LimitPolicy, LimitSetPolicy, Quota, TenantKey, nz};
use tower_limits_redis::test_support::{own_redis_for, redis_for};
use tower_limits_redis::{FailurePolicy, GrantSource, RedisBackend, RedisConnection, RedisGrant};

use redis_common::{admin, cmd, connect, namespace, runtime};

const TIMEOUT: Duration = Duration::from_millis(50);

async fn guarded<T>(what: &str, f: impl Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(5), f).await.unwrap_or_else(|_| panic!("{what} hung"))
}

fn policy() -> LimitSetPolicy {
    LimitSetPolicy::new()
        .tiers(["org", "user"])
        .limit(LimitPolicy::semaphore("concurrent", 2).per("org"))
        .limit(LimitPolicy::sliding_window_log("hourly", 1_000, Duration::from_secs(3600)).per("org"))
        .limit(LimitPolicy::gcra("requests", Quota::per_second(nz!(1000))).per("user"))
}

fn backend(conn: &RedisConnection, failure: FailurePolicy, ns: &str) -> RedisBackend {
    RedisBackend::builder(policy())
        .namespace(ns)
        .timeout(TIMEOUT)
        .on_failure(failure)
        .circuit_breaker(3, Duration::from_millis(20))
        .build(conn)
        .unwrap()
}

fn alice() -> TenantKey {
    TenantKey::new(["acme", "alice"]).unwrap()
}

async fn acquire(b: &RedisBackend) -> Result<RedisGrant, AcquireError> {
    guarded("an acquisition", b.acquire(&alice(), 1, Instant::ZERO)).await
}

/// Acquires until Redis answers again, polling every few milliseconds while the circuit
/// breaker cools down (under a hang guard: Redis is up by then).
async fn until_redis_answers(b: &RedisBackend) -> RedisGrant {
    let answered = async {
        loop {
            match acquire(b).await {
                Ok(g) if g.source() == GrantSource::Redis => return g,
                Ok(g) => b.release(&alice(), g),
                Err(AcquireError::Unavailable(_)) => {}
                Err(e) => panic!("{e}"),
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(20), answered).await.expect("redis never answered again")
}

/// The whole semaphore can be taken again: nothing leaked.
async fn all_permits_back(b: &RedisBackend) {
    guarded("flush", b.flush()).await;
    let first = acquire(b).await.expect("a permit");
    let second = acquire(b).await.expect("a second permit");
    assert_eq!((first.source(), second.source()), (GrantSource::Redis, GrantSource::Redis));
    let third = acquire(b).await.unwrap_err();
    assert!(third.as_refusal().is_some_and(|d| d.needs_release()), "{third}");
    b.release(&alice(), first);
    b.release(&alice(), second);
    guarded("flush", b.flush()).await;
}

#[test]
fn script_flush_mid_run() {
    let Some(server) = redis_for("script_flush_mid_run") else { return };
    runtime().block_on(async {
        let url = server.url();
        let conn = connect(&url).await;
        let mut admin = admin(&url).await;
        let b = backend(&conn, FailurePolicy::FailClosed, &namespace("flush"));
        let mut admitted = 0;
        for i in 0..200 {
            if i % 50 == 25 {
                let _: () = cmd(&mut admin, &["SCRIPT", "FLUSH"]).await;
            }
            let g = acquire(&b).await.expect("granted");
            admitted += 1;
            b.release(&alice(), g);
            guarded("flush", b.flush()).await;
        }
        guarded("flush", b.flush()).await;
        let stats = b.stats();
        assert_eq!(stats.script_loads, 1 + 4, "{stats:?}");
        assert_eq!((stats.granted, stats.errors, stats.timeouts), (admitted, 0, 0), "{stats:?}");
        // 200 acquisitions, 200 releases, one extra EVAL per load: nothing lost or doubled.
        assert_eq!(stats.round_trips, 400 + 5, "{stats:?}");
        let hourly: String = cmd(&mut admin, &["ZSCORE", &b.keys(&alice())[1], "="]).await;
        assert_eq!(hourly, "-201", "the log counted every grant exactly once");
        all_permits_back(&b).await;
    });
}

#[test]
fn server_stopped_and_restarted() {
    let Some(mut server) = own_redis_for("server_stopped_and_restarted") else { return };
    runtime().block_on(async {
        let conn = connect(&server.url()).await;
        let ns = namespace("restart");
        let closed = backend(&conn, FailurePolicy::FailClosed, &ns);
        let open = backend(&conn, FailurePolicy::FailOpen, &ns);
        let fallback = backend(&conn, FailurePolicy::Fallback { share: 0.5 }, &ns);
        let held = acquire(&closed).await.unwrap();
        assert!(!closed.peek(&alice(), Instant::ZERO).is_empty(), "the state read with the grant");
        server.stop();
        // Away: each follows its policy, promptly.
        for _ in 0..20 {
            let e = acquire(&closed).await.unwrap_err();
            assert!(matches!(e, AcquireError::Unavailable(_)), "{e}");
            let g = acquire(&open).await.unwrap();
            assert_eq!(g.source(), GrantSource::FailOpen);
            open.release(&alice(), g);
        }
        // The state read before is no longer known: no header may claim it.
        assert!(closed.peek(&alice(), Instant::ZERO).is_empty());
        assert!(open.peek(&alice(), Instant::ZERO).is_empty());
        // The fallback holds half of each limit: one permit of the two.
        let local = acquire(&fallback).await.unwrap();
        assert_eq!(local.source(), GrantSource::Fallback);
        let refused = acquire(&fallback).await.unwrap_err();
        assert!(refused.as_refusal().is_some_and(|d| d.needs_release()), "{refused}");
        // The local share's state is not the fleet's: the refusal states no quota.
        assert!(refused.as_refusal().is_some_and(|d| d.snapshot().quota == 0), "{refused}");
        fallback.release(&alice(), local);
        assert!(closed.stats().breaker_opened >= 1, "{:?}", closed.stats());
        assert_eq!(open.stats().fail_open_admits, 20);
        // A release sent while the server is away waits for it.
        closed.release(&alice(), held);
        server.restart().expect("the server restarts");
        for b in [&closed, &open, &fallback] {
            let g = until_redis_answers(b).await;
            b.release(&alice(), g);
        }
        all_permits_back(&closed).await;
    });
}

#[test]
fn clients_paused_past_the_timeout() {
    let Some(server) = redis_for("clients_paused_past_the_timeout") else { return };
    runtime().block_on(async {
        let url = server.url();
        let conn = connect(&url).await;
        let mut admin = admin(&url).await;
        let b = backend(&conn, FailurePolicy::FailClosed, &namespace("pause"));
        let warm = acquire(&b).await.unwrap();
        b.release(&alice(), warm);
        guarded("flush", b.flush()).await;
        // Writes (scripts included) are held back by the server; our call times out.
        let _: () = cmd(&mut admin, &["CLIENT", "PAUSE", "10000", "WRITE"]).await;
        let e = acquire(&b).await.unwrap_err();
        assert!(matches!(e, AcquireError::Unavailable(_)), "{e}");
        assert_eq!(b.stats().timeouts, 1);
        let _: () = cmd(&mut admin, &["CLIENT", "UNPAUSE"]).await;
        // The paused acquisition ran when the pause ended and took a permit; the backend
        // released it by holder id, so both permits are free.
        all_permits_back(&b).await;
        assert_eq!(b.stats().background_failures, 0, "{:?}", b.stats());
    });
}

#[test]
fn server_asleep_past_the_timeout() {
    let Some(server) = own_redis_for("server_asleep_past_the_timeout") else { return };
    runtime().block_on(async {
        let url = server.url();
        let conn = connect(&url).await;
        let ns = namespace("sleep");
        let b = backend(&conn, FailurePolicy::Fallback { share: 0.5 }, &ns);
        let warm = acquire(&b).await.unwrap();
        b.release(&alice(), warm);
        guarded("flush", b.flush()).await;
        // A rate-only set notices when the server falls asleep.
        let fast = LimitSetPolicy::new().limit(LimitPolicy::gcra("fast", Quota::per_second(nz!(1_000_000))));
        let probe = RedisBackend::builder(fast)
            .namespace(&ns)
            .timeout(TIMEOUT)
            .on_failure(FailurePolicy::FailOpen)
            .build(&conn)
            .unwrap();
        let mut sleeper = admin(&url).await;
        let sleep = tokio::spawn(async move {
            let _: () = cmd(&mut sleeper, &["DEBUG", "SLEEP", "0.3"]).await;
        });
        let mut asleep = false;
        for _ in 0..100_000 {
            let g = guarded("a probe", probe.acquire(&alice(), 1, Instant::ZERO)).await.unwrap();
            if g.source() == GrantSource::FailOpen {
                asleep = true;
                break;
            }
        }
        assert!(asleep, "the server never fell asleep");
        // At least 250 ms of sleep are left: this call times out to the fallback.
        let local = acquire(&b).await.unwrap();
        assert_eq!(local.source(), GrantSource::Fallback);
        assert!(b.stats().timeouts >= 1);
        b.release(&alice(), local);
        guarded("the sleeper", sleep).await.unwrap();
        let g = until_redis_answers(&b).await;
        b.release(&alice(), g);
        all_permits_back(&b).await;
    });
}

/// A fleet that grew while it runs: the fallback, resized to the new share, decides with
/// it once Redis is away; a backend without a fallback has none to resize.
#[test]
fn the_fallback_share_follows_the_fleet() {
    let Some(mut server) = own_redis_for("the_fallback_share_follows_the_fleet") else { return };
    runtime().block_on(async {
        let conn = connect(&server.url()).await;
        let b = backend(&conn, FailurePolicy::Fallback { share: 1.0 }, &namespace("resize"));
        let closed = backend(&conn, FailurePolicy::FailClosed, &namespace("resize-closed"));
        assert!(!closed.set_fallback_share(0.5).unwrap());
        for wrong in [0.0, -1.0, 1.5, f64::NAN] {
            assert!(b.set_fallback_share(wrong).is_err(), "{wrong}");
        }
        // A second replica joined.
        assert!(b.set_fallback_share(0.5).unwrap());
        server.stop();
        // Half of the two permits: one, where the share it was built with gave two.
        let local = acquire(&b).await.unwrap();
        assert_eq!(local.source(), GrantSource::Fallback);
        let refused = acquire(&b).await.unwrap_err();
        assert!(refused.as_refusal().is_some_and(|d| d.needs_release()), "{refused}");
        b.release(&alice(), local);
    });
}
