//! What is particular to the Redis backend: the server's clock, round trips, the refusal
//! cache, key layout and expiries, leases, and the backend under a `LimitSetLayer`.

mod redis_common;

use std::convert::Infallible;
use std::time::Duration;

use tower::{ServiceBuilder, ServiceExt};
use tower_limits::extract::KeyFn;
use tower_limits::{BoxError, ErrorKind, LimitError, LimitSetLayer};
use tower_limits_core::algorithm::CalendarPeriod;
use tower_limits_core::{
    AcquireError, Backend, Clock, Instant, KeyPart, LimitPolicy, LimitSetPolicy, Quota, Rate, SystemClock, TenantKey,
    nz,
};
use tower_limits_redis::test_support::redis_for;
use tower_limits_redis::{GrantSource, RedisBackend, key_slot, redis};

use redis_common::{admin, cmd, connect, manual, namespace, runtime};

const S: u64 = 1_000_000_000;

fn at(nanos: u64) -> Instant {
    Instant::from_nanos(nanos)
}

fn three_limits() -> LimitSetPolicy {
    LimitSetPolicy::new()
        .tiers(["org", "user"])
        .limit(LimitPolicy::gcra("requests", Quota::per_second(nz!(10)).burst(nz!(2))).per("user"))
        .limit(LimitPolicy::token_bucket("tokens", Quota::per_second(nz!(1000))).per("org").counting_cost())
        .limit(LimitPolicy::semaphore("concurrent", 4).per("org"))
}

async fn server_time_us(admin: &mut redis::aio::MultiplexedConnection) -> u64 {
    let (s, us): (u64, u64) = cmd(admin, &["TIME"]).await;
    s * 1_000_000 + us
}

#[test]
fn one_round_trip_per_acquisition_and_none_for_a_cached_refusal() {
    let Some(server) = redis_for("one_round_trip_per_acquisition_and_none_for_a_cached_refusal") else { return };
    runtime().block_on(async {
        let conn = connect(&server.url()).await;
        let backend = RedisBackend::builder(three_limits()).namespace(namespace("rt")).build(&conn).unwrap();
        let alice = TenantKey::new(["acme", "alice"]).unwrap();
        // The first call loads the script: EVALSHA, NOSCRIPT, EVAL.
        let first = backend.acquire(&alice, 10, Instant::ZERO).await.unwrap();
        assert_eq!((backend.stats().round_trips, backend.stats().script_loads), (2, 1));
        let second = backend.acquire(&alice, 10, Instant::ZERO).await.unwrap();
        assert_eq!(backend.stats().round_trips, 3, "one round trip once the script is cached");
        // The third request of alice within 100 ms is refused by her GCRA (burst 2).
        let now = Instant::from_nanos(1_000);
        let refused = backend.acquire(&alice, 10, now).await.unwrap_err();
        let AcquireError::Refused(d) = refused else { panic!("{refused}") };
        assert_eq!((d.limit(), d.tier()), ("requests", Some("user")));
        assert!(d.retry_after() > Duration::ZERO && d.retry_after() <= Duration::from_millis(200));
        let trips = backend.stats().round_trips;
        for i in 0..100u64 {
            let later = now + Duration::from_nanos(i);
            let again = backend.acquire(&alice, 10, later).await.unwrap_err();
            let AcquireError::Refused(c) = again else { panic!("{again}") };
            assert_eq!(c.retry_after(), d.retry_after() - Duration::from_nanos(i), "the cached wait is exact");
        }
        assert_eq!(backend.stats().round_trips, trips, "cached refusals cost no round trip");
        assert_eq!(backend.stats().cached_refusals, 100);
        // Releases happen in the background, one round trip each.
        backend.release(&alice, first);
        backend.release(&alice, second);
        backend.flush().await;
        assert_eq!(backend.stats().round_trips, trips + 2);
        assert_eq!(backend.stats().background_pending, 0);
    });
}

#[test]
fn a_refusal_writes_nothing() {
    let Some(server) = redis_for("a_refusal_writes_nothing") else { return };
    runtime().block_on(async {
        let conn = connect(&server.url()).await;
        let mut admin = admin(&server.url()).await;
        let policy = three_limits()
            .limit(LimitPolicy::sliding_window_log("log", 3, Duration::from_secs(10)).per("org"))
            .limit(LimitPolicy::sliding_window_counter("counter", 100, Duration::from_secs(10)).per("user"))
            .limit(LimitPolicy::fixed_window("fixed", 100, Duration::from_secs(10)).per("org"));
        let backend =
            RedisBackend::builder(policy).namespace(namespace("atomic")).refusal_cache(0).build(&conn).unwrap();
        let alice = TenantKey::new(["acme", "alice"]).unwrap();
        let bob = TenantKey::new(["acme", "bob"]).unwrap();
        let _a = backend.acquire(&alice, 100, Instant::ZERO).await.unwrap();
        let _b = backend.acquire(&bob, 100, Instant::ZERO).await.unwrap();
        let _c = backend.acquire(&bob, 100, Instant::ZERO).await.unwrap();
        let keys = backend.keys(&alice);
        let mut dump = Vec::new();
        for k in &keys {
            let v: Option<Vec<u8>> = cmd(&mut admin, &["DUMP", k]).await;
            dump.push(v);
        }
        // Refused by the log (three per org): no key changes.
        let refused = backend.acquire(&alice, 1, Instant::ZERO).await.unwrap_err();
        assert_eq!(refused.as_refusal().map(|d| d.limit()), Some("log"), "{refused}");
        for (k, before) in keys.iter().zip(&dump) {
            let after: Option<Vec<u8>> = cmd(&mut admin, &["DUMP", k]).await;
            assert_eq!(&after, before, "{k} changed on a refusal");
        }
    });
}

#[test]
fn the_server_clock_decides() {
    let Some(server) = redis_for("the_server_clock_decides") else { return };
    runtime().block_on(async {
        let conn = connect(&server.url()).await;
        let mut admin = admin(&server.url()).await;
        let policy = LimitSetPolicy::new().limit(LimitPolicy::gcra("slow", Quota::per_second(nz!(1))));
        let backend = RedisBackend::builder(policy).namespace(namespace("clock")).build(&conn).unwrap();
        let key = TenantKey::global();
        // The caller's clock is ignored: a wildly different `now` changes nothing.
        let grant = backend.acquire(&key, 1, Instant::from_nanos(999 * S)).await.unwrap();
        let granted = grant.granted_at_micros().unwrap();
        let refused = backend.acquire(&key, 1, Instant::ZERO).await.unwrap_err();
        let after = server_time_us(&mut admin).await;
        let retry = refused.as_refusal().unwrap().retry_after();
        // Refused at a server time t in [granted, after]: the wait is exactly 1 s - (t - granted),
        // in whole microseconds (the resolution of TIME).
        let elapsed = Duration::from_secs(1) - retry;
        assert_eq!(retry.subsec_nanos() % 1000, 0, "{retry:?}");
        assert!(elapsed <= Duration::from_micros(after - granted), "{retry:?} against {}us", after - granted);
        // The theoretical arrival time is one integer of whole microseconds (the server's
        // clock and an interval of whole microseconds leave no nanoseconds), with an expiry.
        let k = &backend.keys(&key)[0];
        let tat: String = cmd(&mut admin, &["GET", k]).await;
        assert_eq!(tat.parse::<u64>().unwrap(), granted + 1_000_000);
        let pttl: i64 = cmd(&mut admin, &["PTTL", k]).await;
        assert!(pttl > 0 && pttl <= 1002, "{pttl}");
    });
}

#[test]
fn keys_are_escaped_tagged_and_expire() {
    let Some(server) = redis_for("keys_are_escaped_tagged_and_expire") else { return };
    runtime().block_on(async {
        let conn = connect(&server.url()).await;
        let mut admin = admin(&server.url()).await;
        let policy = three_limits()
            .limit(LimitPolicy::sliding_window_log("log", 30, Duration::from_secs(5)).per("user"))
            .limit(LimitPolicy::sliding_window_counter("counter", 30, Duration::from_secs(5)).per("org"))
            .limit(LimitPolicy::fixed_window("fixed", 30, Duration::from_secs(5)).per("user"));
        let ns = namespace("layout");
        let backend = RedisBackend::builder(policy).namespace(&ns).build(&conn).unwrap();
        let tricky = TenantKey::new(["a{b}c:d", "x/y z"]).unwrap();
        let keys = backend.keys(&tricky);
        assert_eq!(keys[0], format!("{ns}:{{a%7Bb%7Dc%3Ad}}/x%2Fy%20z:requests:g"));
        assert_eq!(keys[2], format!("{ns}:{{a%7Bb%7Dc%3Ad}}:concurrent:s"));
        assert!(keys.iter().all(|k| key_slot(k) == key_slot(&keys[0])), "{keys:?}");
        let other = backend.keys(&TenantKey::new(["a{b}c:d", "x"]).unwrap());
        assert_eq!(key_slot(&other[0]), key_slot(&keys[0]), "a tenant's users share its slot");
        // Numbers and addresses are marked apart from text ids that print alike.
        let ip = std::net::IpAddr::from([10, 0, 0, 7]);
        let typed = backend.keys(&TenantKey::from_parts([KeyPart::Number(7), KeyPart::Ip(ip)]).unwrap());
        assert_eq!(typed[0], format!("{ns}:{{#7}}/#10.0.0.7:requests:g"));
        let text = backend.keys(&TenantKey::new(["7", "10.0.0.7"]).unwrap());
        assert_eq!(text[0], format!("{ns}:{{7}}/10.0.0.7:requests:g"));
        let grant = backend.acquire(&tricky, 5, Instant::ZERO).await.unwrap();
        for k in &keys {
            // -1: the key has no expiry (the fault looked for); -2: it is gone already,
            // which a short expiry on a slow machine allows.
            let pttl: i64 = cmd(&mut admin, &["PTTL", k]).await;
            assert_ne!(pttl, -1, "{k} has no expiry");
        }
        backend.release(&tricky, grant);
        backend.flush().await;
        // Released: the semaphore's key is gone, nothing held.
        let exists: i64 = cmd(&mut admin, &["EXISTS", &keys[2]]).await;
        assert_eq!(exists, 0);
    });
}

#[test]
fn leases_expire_and_renewals_keep_them() {
    let Some(server) = redis_for("leases_expire_and_renewals_keep_them") else { return };
    runtime().block_on(async {
        let conn = connect(&server.url()).await;
        let policy = LimitSetPolicy::new().tiers(["org"]).limit(LimitPolicy::semaphore("one", 1).per("org"));
        let backend = manual(policy, "lease").lease(Duration::from_secs(10)).build(&conn).unwrap();
        let key = TenantKey::single("acme").unwrap();
        // A holder that never releases (its replica died).
        let lost = backend.acquire(&key, 1, at(S)).await.unwrap();
        let refused = backend.acquire(&key, 1, at(10 * S)).await.unwrap_err();
        assert!(refused.as_refusal().unwrap().needs_release());
        // At its deadline, exactly: reclaimed.
        let taken = backend.acquire(&key, 1, at(11 * S)).await.unwrap();
        // A late release of the lost holder changes nothing (idempotent, by holder id).
        backend.release(&key, lost);
        backend.flush().await;
        assert!(backend.acquire(&key, 1, at(11 * S)).await.is_err(), "the new holder still holds");
        // Renewed at 15 s, the lease runs to 25 s.
        assert!(backend.renew(&key, &taken, at(15 * S)).await.unwrap());
        assert!(backend.acquire(&key, 1, at(21 * S + 1)).await.is_err(), "renewed");
        let next = backend.acquire(&key, 1, at(25 * S)).await.unwrap();
        assert!(!backend.renew(&key, &taken, at(25 * S)).await.unwrap(), "a reclaimed lease is not renewed");
        // Nor one that expired before anyone reclaimed it: its permit may be counted free.
        assert!(!backend.renew(&key, &next, at(35 * S)).await.unwrap(), "an expired lease is not renewed");
        backend.release(&key, taken);
        backend.release(&key, next);
        backend.flush().await;
        assert!(backend.acquire(&key, 1, at(35 * S)).await.is_ok());
    });
}

/// How many times the server ran `command` since its statistics were last reset (calls
/// from inside scripts included).
async fn calls_of(admin: &mut redis::aio::MultiplexedConnection, command: &str) -> u64 {
    let info: String = cmd(admin, &["INFO", "commandstats"]).await;
    let head = format!("cmdstat_{command}:calls=");
    info.lines()
        .find_map(|line| line.strip_prefix(&head))
        .and_then(|rest| rest.split(',').next())
        .map_or(0, |n| n.parse().expect("a count"))
}

#[test]
fn the_release_of_a_lone_semaphore_counting_requests_is_one_zrem() {
    let Some(server) = redis_for("the_release_of_a_lone_semaphore_counting_requests_is_one_zrem") else { return };
    runtime().block_on(async {
        let conn = connect(&server.url()).await;
        let mut admin = admin(&server.url()).await;
        // The set of three: its one semaphore counts requests, four at once per org; each
        // request from a user of its own (their GCRAs allow two a burst).
        let backend = manual(three_limits(), "zrem").build(&conn).unwrap();
        let user = |i: usize| TenantKey::new(["acme".to_owned(), format!("user-{i}")]).unwrap();
        let mut held = Vec::new();
        for i in 0..4 {
            held.push((user(i), backend.acquire(&user(i), 1, at(S)).await.unwrap()));
        }
        assert!(backend.acquire(&user(4), 1, at(S)).await.unwrap_err().as_refusal().unwrap().needs_release());
        let () = cmd(&mut admin, &["CONFIG", "RESETSTAT"]).await;
        let trips = backend.stats().round_trips;
        for (key, grant) in held.drain(..2) {
            backend.release(&key, grant);
        }
        backend.flush().await;
        assert_eq!(calls_of(&mut admin, "zrem").await, 2, "one ZREM a release");
        assert_eq!(calls_of(&mut admin, "evalsha").await, 0, "no script");
        assert_eq!(backend.stats().round_trips, trips + 2, "one round trip a release");
        // The two permits came back, and no more.
        for i in 5..7 {
            held.push((user(i), backend.acquire(&user(i), 1, at(2 * S)).await.unwrap()));
        }
        assert!(backend.acquire(&user(7), 1, at(2 * S)).await.is_err(), "four held again");
        // One more released: its own permit comes back, and no other.
        let (key, grant) = held.pop().unwrap();
        backend.release(&key, grant);
        backend.flush().await;
        assert!(backend.acquire(&user(8), 1, at(3 * S)).await.is_ok());
        assert!(backend.acquire(&user(9), 1, at(3 * S)).await.is_err(), "one permit came back, not two");

        // A semaphore counting cost keeps its sum in the set: its release is the script's.
        let weighted = LimitSetPolicy::new()
            .tiers(["org"])
            .limit(LimitPolicy::semaphore("tokens in flight", 100).per("org").counting_cost());
        let backend = manual(weighted, "zrem-cost").build(&conn).unwrap();
        let acme = TenantKey::single("acme").unwrap();
        let grant = backend.acquire(&acme, 60, at(S)).await.unwrap();
        assert!(backend.acquire(&acme, 60, at(S)).await.is_err());
        let () = cmd(&mut admin, &["CONFIG", "RESETSTAT"]).await;
        backend.release(&acme, grant);
        backend.flush().await;
        assert_eq!(calls_of(&mut admin, "evalsha").await, 1, "the script releases");
        assert!(backend.acquire(&acme, 60, at(S)).await.is_ok());
    });
}

#[test]
fn peek_answers_from_the_last_reply() {
    let Some(server) = redis_for("peek_answers_from_the_last_reply") else { return };
    runtime().block_on(async {
        let conn = connect(&server.url()).await;
        let backend = manual(three_limits(), "peek").build(&conn).unwrap();
        let alice = TenantKey::new(["acme", "alice"]).unwrap();
        assert!(backend.peek(&alice, at(S)).is_empty());
        let _g = backend.acquire(&alice, 300, at(S)).await.unwrap();
        let snaps = backend.peek(&alice, at(S));
        let remaining: Vec<u64> = snaps.iter().map(|s| s.snapshot.remaining).collect();
        assert_eq!(remaining, [1, 700, 3]);
        assert_eq!(snaps[1].snapshot.reset, Duration::from_millis(300));
        let later = backend.peek(&alice, at(S + 100_000_000));
        assert_eq!(later[1].snapshot.reset, Duration::from_millis(200));
    });
}

#[test]
fn without_a_peek_cache_a_grant_answers_briefly_and_a_refusal_in_full() {
    let Some(server) = redis_for("without_a_peek_cache_a_grant_answers_briefly_and_a_refusal_in_full") else { return };
    runtime().block_on(async {
        let conn = connect(&server.url()).await;
        let backend = manual(three_limits(), "brief").peek_cache(0).build(&conn).unwrap();
        let (alice, bob) = (TenantKey::new(["acme", "alice"]).unwrap(), TenantKey::new(["acme", "bob"]).unwrap());
        // The brief reply still carries the server's time of the grant, which its settle
        // sends back.
        let mut grant = backend.acquire(&alice, 300, at(S + 1_234)).await.unwrap();
        assert_eq!(grant.granted_at_micros(), Some(S / 1_000 + 1));
        assert!(backend.peek(&alice, at(S)).is_empty(), "no cache, no states");
        backend.settle(&alice, &mut grant, 500, at(S + 2_000));
        backend.flush().await;
        // A refusal answers in full: the blocking limit and its state.
        let refused = backend.acquire(&bob, 600, at(S + 2_000)).await.unwrap_err();
        let d = refused.as_refusal().expect("a refusal");
        assert_eq!((d.limit(), d.snapshot().remaining), ("tokens", 500));
        assert!(d.retry_after() > Duration::from_millis(99) && d.retry_after() <= Duration::from_millis(100));
        backend.release(&alice, grant);
        backend.flush().await;
    });
}

fn limit_error(e: &BoxError) -> &LimitError {
    e.downcast_ref::<LimitError>().expect("a LimitError")
}

#[test]
fn a_layer_enforces_the_redis_limits() {
    let Some(server) = redis_for("a_layer_enforces_the_redis_limits") else { return };
    runtime().block_on(async {
        let conn = connect(&server.url()).await;
        let backend = RedisBackend::builder(three_limits()).namespace(namespace("layer")).build(&conn).unwrap();
        let layer = LimitSetLayer::with_backend(backend.clone())
            .key(KeyFn::new(|user: &&'static str| TenantKey::new(["acme", *user]).ok()));
        let svc = ServiceBuilder::new()
            .layer(layer)
            .service(tower::service_fn(|user: &'static str| async move { Ok::<_, Infallible>(user) }));
        assert_eq!(svc.clone().oneshot("alice").await.unwrap(), "alice");
        assert_eq!(svc.clone().oneshot("alice").await.unwrap(), "alice");
        let refused = svc.clone().oneshot("alice").await.unwrap_err();
        let refused = limit_error(&refused);
        assert_eq!((refused.kind(), refused.limit()), (ErrorKind::RateLimited, Some("requests")));
        assert_eq!(svc.clone().oneshot("bob").await.unwrap(), "bob");
        backend.flush().await;
        let stats = backend.stats();
        assert_eq!((stats.acquisitions, stats.granted, stats.refused), (4, 3, 1));
        // One round trip per acquisition (plus the first script load), one per release.
        assert_eq!(stats.round_trips, 4 + 1 + 3, "{stats:?}");
        assert_eq!(stats.leases_held, 0);
    });
}

#[test]
fn sets_are_checked_when_built() {
    let Some(server) = redis_for("sets_are_checked_when_built") else { return };
    runtime().block_on(async {
        let conn = connect(&server.url()).await;
        let build = |p: LimitSetPolicy| RedisBackend::builder(p).build(&conn).map(|_| ()).map_err(|e| e.to_string());
        let window = |d: Duration| LimitSetPolicy::new().limit(LimitPolicy::fixed_window("w", 1, d));
        assert!(build(window(Duration::from_nanos(1500))).unwrap_err().contains("whole number of microseconds"));
        assert!(build(window(Duration::from_secs(200 * 86_400))).unwrap_err().contains("52 days"));
        let long_burst = LimitSetPolicy::new().limit(LimitPolicy::gcra("g", Quota::per_day(nz!(1)).burst(nz!(200))));
        assert!(build(long_burst).unwrap_err().contains("52 days"));
        // A policy's fields are data: a rate of zero reaches the builder as it would from a file.
        let mut zero = LimitPolicy::gcra("g", Quota::per_second(nz!(1)));
        zero.rate = Some(Rate::new(0, Duration::from_secs(1)));
        let bad = LimitSetPolicy::new().limit(zero);
        assert!(build(bad).unwrap_err().contains("rate"));
        let braces = RedisBackend::builder(three_limits()).namespace("a{b}").build(&conn).unwrap_err();
        assert!(braces.to_string().contains("braces"), "{braces}");
        // A standalone server takes a set mixing global and keyed limits in one script.
        let mixed = three_limits().limit(LimitPolicy::gcra("global", Quota::per_second(nz!(100))));
        let backend = RedisBackend::builder(mixed).namespace(namespace("mixed")).build(&conn).unwrap();
        let alice = TenantKey::new(["acme", "alice"]).unwrap();
        let grant = backend.acquire(&alice, 1, Instant::ZERO).await.unwrap();
        assert_eq!(grant.source(), GrantSource::Redis);
        backend.release(&alice, grant);
        backend.flush().await;
    });
}

/// A permit given back is there for the next request at once, though its release is still
/// on its way to Redis: an acquisition that finds the semaphore full while this replica's
/// releases are in flight waits for them and asks again. On one thread the release's task
/// runs only after the next acquisition was sent: without the wait, every round but the
/// first would be refused.
#[test]
fn a_release_on_its_way_is_not_a_refusal() {
    let Some(server) = redis_for("a_release_on_its_way_is_not_a_refusal") else { return };
    let one_thread = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    one_thread.block_on(async {
        let conn = connect(&server.url()).await;
        let policy = LimitSetPolicy::new().tiers(["org"]).limit(LimitPolicy::semaphore("concurrency", 1).per("org"));
        let backend = manual(policy, "release-race").build(&conn).unwrap();
        let acme = TenantKey::single("acme").unwrap();
        for round in 0..20 {
            let grant = backend
                .acquire(&acme, 1, at(S))
                .await
                .unwrap_or_else(|e| panic!("round {round}: {e} {:?}", backend.stats()));
            backend.release(&acme, grant);
        }
        assert!(backend.stats().release_waits > 0, "{:?}", backend.stats());
        // Still one at a time: a permit held is a refusal, whatever is on its way.
        let held = backend.acquire(&acme, 1, at(S)).await.unwrap();
        assert!(backend.acquire(&acme, 1, at(S)).await.unwrap_err().as_refusal().unwrap().needs_release());
        backend.release(&acme, held);
        backend.flush().await;
    });
}

/// Law 32 on the server's clock: a budget per team and UTC day, shared by two replicas,
/// refused with the wait to midnight, still spent for a replica that starts afresh, and
/// kept in Redis until an hour after its day.
#[test]
fn a_calendar_budget_is_shared_by_replicas_and_outlives_them() {
    let Some(server) = redis_for("a_calendar_budget_is_shared_by_replicas_and_outlives_them") else { return };
    runtime().block_on(async {
        let conn = connect(&server.url()).await;
        let policy = LimitSetPolicy::new().tiers(["team"]).limit(
            LimitPolicy::calendar_window("usd-day", 100, CalendarPeriod::Day, "UTC").per("team").counting_cost(),
        );
        let ns = namespace("calendar");
        let replica = || RedisBackend::builder(policy.clone()).namespace(ns.clone()).build(&conn).unwrap();
        let (a, b) = (replica(), replica());
        let team = TenantKey::single("ops").unwrap();
        let clock = SystemClock::new();
        let spent = a.acquire(&team, 70, clock.now()).await.unwrap();
        a.release(&team, spent);
        let refused = b.acquire(&team, 31, clock.now()).await.unwrap_err();
        let AcquireError::Refused(d) = refused else { panic!("{refused}") };
        let since_epoch = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap();
        let midnight = Duration::from_secs((since_epoch.as_secs() / 86_400 + 1) * 86_400) - since_epoch;
        let off = d.retry_after().abs_diff(midnight);
        assert!(off < Duration::from_secs(5), "waits {:?} for midnight in {midnight:?}", d.retry_after());
        assert_eq!(
            (d.limit(), d.snapshot().remaining, d.snapshot().window),
            ("usd-day", 30, Duration::from_secs(86_400))
        );
        let rest = b.acquire(&team, 30, clock.now()).await.unwrap();
        b.release(&team, rest);
        drop((a, b));
        let restarted = replica();
        assert!(restarted.acquire(&team, 1, clock.now()).await.is_err(), "the day's budget outlives its replicas");
        let mut admin = admin(&server.url()).await;
        let ttl: i64 = cmd(&mut admin, &["PTTL", &restarted.keys(&team)[0]]).await;
        let ttl = Duration::from_millis(u64::try_from(ttl).unwrap());
        assert!(ttl > midnight && ttl <= midnight + Duration::from_secs(3605), "kept for {ttl:?}");
    });
}
