//! Helpers shared by the Redis test files: a runtime, a connection, fresh namespaces.

#![allow(dead_code, unreachable_pub)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tower_limits_core::{AcquireError, Backend, Instant, LimitSetPolicy, TenantKey};
use tower_limits_redis::redis;
use tower_limits_redis::{GrantSource, RedisBackend, RedisBackendBuilder, RedisConnection, Shares};
use tower_limits_tests::Rng;

/// A runtime for one test (Redis tests start their server before it, blocking).
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("a tokio runtime")
}

/// A namespace no other test uses.
pub fn namespace(test: &str) -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    format!("t-{test}-{}-{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed))
}

/// Connects to `url`.
pub async fn connect(url: &str) -> RedisConnection {
    RedisConnection::connect(url).await.expect("a connection to the test's redis")
}

/// A plain connection for administrative commands (SCRIPT FLUSH, CLIENT PAUSE, ...).
pub async fn admin(url: &str) -> redis::aio::MultiplexedConnection {
    redis::Client::open(url).unwrap().get_multiplexed_async_connection().await.expect("an admin connection")
}

/// Runs one command on the admin connection.
pub async fn cmd<T: redis::FromRedisValue>(conn: &mut redis::aio::MultiplexedConnection, args: &[&str]) -> T {
    let mut c = redis::cmd(args[0]);
    for a in &args[1..] {
        c.arg(*a);
    }
    c.query_async(conn).await.unwrap_or_else(|e| panic!("{args:?}: {e}"))
}

/// A builder with a fresh namespace and the test clock. Its timeout is generous: these
/// tests are about semantics, and a loaded CI machine can take longer than the
/// production default of 50ms to answer (the fault tests set their own).
pub fn manual(policy: LimitSetPolicy, test: &str) -> RedisBackendBuilder {
    RedisBackend::builder(policy).namespace(namespace(test)).manual_clock().timeout(std::time::Duration::from_secs(5))
}

/// A millisecond, in the nanoseconds of a manual clock.
pub const MS: u64 = 1_000_000;

/// Every 20 ms each replica refreshes, but one in six refreshes is lost (never sent),
/// and the `deaf` replica's answers are lost on the way back (Redis applies them).
pub async fn refresh_fleet(replicas: &[RedisBackend], now: Instant, deaf: usize, rng: &mut Rng) {
    for (i, r) in replicas.iter().enumerate() {
        match (i == deaf, rng.below(6)) {
            (_, 0) => {}
            (true, _) => {
                r.refresh_shares_unheard(now).await;
            }
            (false, _) => {
                r.refresh_shares(now).await;
            }
        }
    }
}

/// Capacity shares for the share tests: refreshed every 20 ms, living 100 ms, hot after
/// two requests a period.
pub fn shares() -> Shares {
    Shares::new().refresh_every(Duration::from_millis(20)).lifetime(Duration::from_millis(100)).hot_after(2)
}

/// `n` replicas sharing `policy` in namespace `ns` on [`shares`], each with its own
/// connection.
pub async fn fleet(url: &str, policy: &LimitSetPolicy, ns: &str, n: usize) -> Vec<RedisBackend> {
    let mut replicas = Vec::new();
    for _ in 0..n {
        let conn = connect(url).await;
        replicas.push(manual(policy.clone(), "shares").namespace(ns).shares(shares()).build(&conn).unwrap());
    }
    replicas
}

/// The random traffic phases of the share laws, 100 steps (ms) each: 0 quiet, 1 busy on
/// every replica, 2 busy on one replica only (`busy`), 3 with one replica deaf (`deaf`:
/// its refreshes' answers lost, see [`refresh_fleet`]).
pub struct Phases {
    pub phase: u64,
    pub busy: usize,
    pub deaf: usize,
}

impl Phases {
    pub fn new() -> Phases {
        Phases { phase: 0, busy: 0, deaf: usize::MAX }
    }

    /// At `step`: every 100 steps, a new phase drawn from `rng`.
    pub fn at(&mut self, step: u64, rng: &mut Rng) {
        if step % 100 == 0 {
            self.phase = rng.below(4);
            self.busy = rng.below(3) as usize;
            self.deaf = if self.phase == 3 { rng.below(3) as usize } else { usize::MAX };
        }
    }

    /// The replica of three the next request lands on.
    pub fn replica(&self, rng: &mut Rng) -> usize {
        if self.phase == 2 { self.busy } else { rng.below(3) as usize }
    }
}

/// One admission of [`random_step`]: the tenant (its index), the units it used, and
/// whether shares alone granted it.
pub struct Admitted {
    pub tenant: usize,
    pub used: u64,
    pub from_share: bool,
}

/// One step (a millisecond at `now`) of the share laws' random traffic: every 20 steps
/// the fleet refreshes (see [`refresh_fleet`]); then requests as many as the phase draws,
/// each on the replica it picks, for one of `tenants` at a cost of 1 to 3, a third
/// settled at once to a usage below their cost (what counts is the usage).
pub async fn random_step(
    replicas: &[RedisBackend],
    tenants: &[TenantKey],
    phases: &mut Phases,
    step: u64,
    now: Instant,
    rng: &mut Rng,
) -> Vec<Admitted> {
    phases.at(step, rng);
    if step % 20 == 0 {
        refresh_fleet(replicas, now, phases.deaf, rng).await;
    }
    let requests = match phases.phase {
        0 => rng.below(2),
        1 => 2 + rng.below(12),
        _ => rng.below(8),
    };
    let mut admitted = Vec::new();
    for _ in 0..requests {
        let r = &replicas[phases.replica(rng)];
        let tenant = rng.below(tenants.len() as u64) as usize;
        let key = &tenants[tenant];
        let cost = 1 + rng.below(3);
        match r.acquire(key, cost, now).await {
            Ok(mut grant) => {
                let from_share = grant.source() == GrantSource::Share;
                let used = if rng.below(3) == 0 { rng.below(cost + 1) } else { cost };
                if used != cost {
                    r.settle(key, &mut grant, used, now);
                    // A pool's settle is a call in the background: in place before the
                    // next decision, as the laws' order has it.
                    r.flush().await;
                }
                r.release(key, grant);
                admitted.push(Admitted { tenant, used, from_share });
            }
            Err(AcquireError::Refused(_)) => {}
            Err(e) => panic!("{e}"),
        }
    }
    admitted
}

/// A replica on [`shares`] for `policy` that finds Redis away quickly (calls of 200 ms, a
/// breaker that stays closed), busy with `key` for 60 ms from `start` (a request of
/// `cost` a millisecond, refreshing every 20 ms) and refreshed once more at 60 ms: it
/// holds a share of every limit. For the tests that then stop the server.
pub async fn busy_replica(
    conn: &RedisConnection,
    policy: LimitSetPolicy,
    test: &str,
    key: &TenantKey,
    cost: u64,
    start: u64,
) -> RedisBackend {
    let backend = manual(policy, test)
        .shares(shares())
        .timeout(Duration::from_millis(200))
        .circuit_breaker(1_000, Duration::from_secs(1))
        .build(conn)
        .unwrap();
    let at = |ms: u64| Instant::from_nanos(start + ms * MS);
    for ms in 0..60 {
        if ms % 20 == 0 {
            assert!(backend.refresh_shares(at(ms)).await);
        }
        let grant = backend.acquire(key, cost, at(ms)).await.unwrap();
        backend.release(key, grant);
    }
    assert!(backend.refresh_shares(at(60)).await);
    backend
}
