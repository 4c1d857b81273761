//! The gateway's fleet on a real `redis-server` (each test skips, with a note on stderr,
//! when none can be started; `REQUIRE_REDIS=1` makes that a failure): the roster that
//! counts the replicas, the part of every account a replica decides alone while Redis is
//! away, a Redis stall, a Redis outage under load, and a tenant at exactly its concurrency.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use axum::body::Body;
use common::{DEADLINE, config_text, until};
use embedding_gateway::config::Config;
use embedding_gateway::gateway::{Gateway, Sharing, Transport, in_process};
use embedding_gateway::roster::{self, FleetSize};
use embedding_gateway::upstream;
use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use tower::ServiceExt;
use tower::util::BoxCloneSyncService;

fn parse_config(text: &str) -> Config {
    Config::parse(text, Some("test.toml")).unwrap_or_else(|e| panic!("{e}"))
}

/// One embedding call with `key`: its status and its JSON body.
async fn embed_as(gateway: &Gateway, key: &str, input: &str) -> (StatusCode, serde_json::Value) {
    let req = Request::post("/v1/embeddings")
        .header("authorization", format!("Bearer {key}"))
        .header("content-type", "application/json")
        .body(Body::from(serde_json::json!({ "model": "m", "input": input }).to_string()))
        .unwrap();
    let response = gateway.router.clone().oneshot(req).await.unwrap();
    let status = response.status();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    let json = serde_json::from_slice(&bytes).unwrap_or_else(|e| panic!("{status}: not JSON ({e}): {bytes:?}"));
    (status, json)
}

/// Two replicas started without `--replicas` (each configured for one) learn from the
/// roster that they are two, and cut what each decides alone while Redis is away to half
/// of every account: a Redis outage under a load above what the accounts allow brings no
/// `429` from the upstream (sized for one, each replica would use the whole account and
/// the upstream would refuse calls), nor does Redis coming back empty.
#[test]
fn two_replicas_without_a_count_send_no_429_upstream_through_a_redis_outage() {
    let Some(mut server) = tower_limits_redis::test_support::own_redis_for("two_replicas_without_a_count") else {
        return;
    };
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    runtime.block_on(async {
        // An account of 20 requests a second (checked over 1 s), and a plan that lets every
        // tenant send more than that: the accounts are what binds.
        let text = config_text("", "org = { rpm = 600000, concurrency = 16 }", "http://127.0.0.1:9")
            .replace("rpm = 60000\n", "rpm = 1200\n");
        let config = parse_config(&text);
        let (router, stats) = upstream::router(&config.accounts, config.upstream, &config.gateway.encodings);
        let namespace = format!("egw-outage-{}", std::process::id());
        let mut replicas = Vec::new();
        for i in 0..2 {
            let connection = tower_limits_redis::RedisConnection::connect(&server.url()).await.unwrap();
            let sharing = Sharing::Redis { connection, replicas: 1, namespace: namespace.clone() };
            let gateway = Gateway::with_sharing(&config, in_process(router.clone()), &sharing).unwrap();
            let size = Arc::new(FleetSize::new(1));
            let resizing = gateway.clone();
            roster::spawn(size.clone(), server.url(), &namespace, format!("replica-{i}"), move |n| {
                resizing.resize_fleet(n).unwrap();
            });
            replicas.push((gateway, size));
        }
        let sizes: Vec<_> = replicas.iter().map(|(_, size)| size.clone()).collect();
        until("both replicas sized for two", || sizes.iter().all(|s| s.sized_for() == 2)).await;

        // Four clients per replica call without pause (they queue for the accounts); a
        // refusal is retried after 10 ms.
        let stop = Arc::new(AtomicBool::new(false));
        let mut clients = Vec::new();
        for (gateway, _) in &replicas {
            for key in ["sk-acme-alice", "sk-globex-bob", "sk-acme-alice", "sk-globex-bob"] {
                let (gateway, stop) = (gateway.clone(), stop.clone());
                clients.push(tokio::spawn(async move {
                    while !stop.load(Ordering::Relaxed) {
                        let (status, _) = embed_as(&gateway, key, "hello").await;
                        if status != StatusCode::OK {
                            tokio::time::sleep(Duration::from_millis(10)).await;
                        }
                    }
                }));
            }
        }
        let served = |s: &upstream::UpstreamStats| s.served.load(Ordering::Relaxed);
        let before = served(&stats);
        until("calls served through Redis", || served(&stats) >= before + 20).await;
        // Redis goes away while the clients send some fifty calls more than the accounts
        // allow in a second: each replica now decides half of every account alone.
        server.stop();
        let at_outage = served(&stats);
        until("calls served while Redis is away", || served(&stats) >= at_outage + 50).await;
        let in_outage = stats.refused();
        // Redis comes back empty: the accounts' mirrors there forgot the calls of the
        // outage, which the upstream's window still counts.
        server.restart().unwrap();
        let at_return = served(&stats);
        until("calls served after Redis came back", || served(&stats) >= at_return + 50).await;
        stop.store(true, Ordering::Relaxed);
        for client in clients {
            client.await.unwrap();
        }
        assert_eq!(in_outage, 0, "the upstream refused calls while Redis was away");
        assert_eq!(stats.refused(), 0, "the upstream refused calls after Redis came back empty");
    });
}

/// With `gateway.account_lease_refresh` and `gateway.plan_share_refresh`, two replicas
/// decide the accounts from leases and the plans from shares: calls through both are
/// served, the upstream refuses none, the accounts make no call per request, and most
/// plan decisions take no round trip.
#[test]
fn replicas_leasing_the_accounts_serve_without_a_call_per_request() {
    let Some(server) = tower_limits_redis::test_support::redis_for("replicas_leasing_the_accounts") else {
        return;
    };
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    runtime.block_on(async {
        // An account of 200 requests a second, its mirror's burst half of it: each lease
        // holds a request.
        let text = config_text(
            "account_lease_refresh = \"50ms\"\nplan_share_refresh = \"200ms\"",
            "org = { rpm = 600000, concurrency = 64 }",
            "http://127.0.0.1:9",
        )
        .replace("rpm = 60000\n", "rpm = 12000\n")
        .replace("jitter = \"100ms\"", "jitter = \"100ms\"\nburst_percent = 50");
        let config = parse_config(&text);
        let (router, stats) = upstream::router(&config.accounts, config.upstream, &config.gateway.encodings);
        let namespace = format!("egw-leases-{}", std::process::id());
        let mut replicas = Vec::new();
        for _ in 0..2 {
            let connection = tower_limits_redis::RedisConnection::connect(&server.url()).await.unwrap();
            let sharing = Sharing::Redis { connection, replicas: 2, namespace: namespace.clone() };
            replicas.push(Gateway::with_sharing(&config, in_process(router.clone()), &sharing).unwrap());
        }
        // Eight clients, each sending 60 calls one after another: the plans' scopes turn
        // hot as the calls keep coming (a new fleet's leases start with the accounts'
        // bursts, so the first calls pass before any scope is hot).
        let mut clients = Vec::new();
        for i in 0..8 {
            let gateway = replicas[i % 2].clone();
            let key = if i % 3 == 0 { "sk-globex-bob" } else { "sk-acme-alice" };
            clients.push(tokio::spawn(async move {
                let mut answers = Vec::new();
                for _ in 0..60 {
                    answers.push(embed_as(&gateway, key, "hello").await);
                }
                answers
            }));
        }
        for client in clients {
            for (status, body) in client.await.unwrap() {
                let plans: Vec<_> = replicas.iter().flat_map(Gateway::plan_backends).map(|b| b.stats()).collect();
                assert_eq!(status, StatusCode::OK, "{body} {plans:#?}");
            }
        }
        assert_eq!(stats.refused(), 0, "the upstream refused calls");
        for gateway in &replicas {
            let accounts = gateway.accounts().unwrap().stats();
            assert_eq!(accounts.acquire_calls, 0, "a call per request");
            assert!(accounts.lease_refreshes > 0 && accounts.leased_grants > 0, "{accounts:?}");
        }
        let plans: Vec<_> = replicas.iter().flat_map(Gateway::plan_backends).map(|b| b.stats()).collect();
        let (acquisitions, shared) =
            plans.iter().fold((0, 0), |(a, s), st| (a + st.acquisitions, s + st.shared_grants));
        assert!(plans.iter().any(|st| st.share_refreshes + st.share_refreshes_carried > 0), "{plans:?}");
        assert!(shared * 2 > acquisitions, "most plan decisions from shares: {plans:?}");
    });
}

/// After a Redis stall, a tenant with nothing in flight is not refused for its
/// concurrency: the holds of the requests that ended during the stall are released as
/// soon as Redis answers, before any later acquisition.
#[test]
fn after_a_redis_stall_nothing_in_flight_means_nothing_held() {
    let Some(server) =
        tower_limits_redis::test_support::own_redis_for("after_a_redis_stall_nothing_in_flight_means_nothing_held")
    else {
        return;
    };
    let server = Arc::new(server);
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    runtime.block_on(async {
        let text = config_text(
            "backend_failure = \"fail_closed\"",
            "org = { rpm = 600000, concurrency = 2 }",
            "http://127.0.0.1:9",
        );
        let config = parse_config(&text);
        // An upstream that holds the calls whose input is "hold" until the gate opens.
        let gate = Arc::new(tokio::sync::Semaphore::new(0));
        let arrived = Arc::new(AtomicU64::new(0));
        let (g, a) = (gate.clone(), arrived.clone());
        let transport: Transport = BoxCloneSyncService::new(tower::service_fn(move |req: Request<Body>| {
            let (gate, arrived) = (g.clone(), a.clone());
            async move {
                let body = req.into_body().collect().await?.to_bytes();
                if String::from_utf8_lossy(&body).contains("hold") {
                    arrived.fetch_add(1, Ordering::Relaxed);
                    gate.acquire().await?.forget();
                }
                let body = serde_json::json!({
                    "object": "list", "data": [], "model": "m",
                    "usage": { "prompt_tokens": 1, "total_tokens": 1 }
                });
                Ok::<_, tower::BoxError>(Response::new(Body::from(body.to_string())))
            }
        }));
        let connection = tower_limits_redis::RedisConnection::connect(&server.url()).await.unwrap();
        let sharing = Sharing::Redis { connection, replicas: 1, namespace: format!("stall-{}", std::process::id()) };
        let gateway = Gateway::with_sharing(&config, transport, &sharing).unwrap();
        let send = |key: &'static str, input: &'static str| {
            let router = gateway.router.clone();
            async move {
                let req = Request::post("/v1/embeddings")
                    .header("authorization", format!("Bearer {key}"))
                    .body(Body::from(serde_json::json!({ "model": "m", "input": input }).to_string()))
                    .unwrap();
                let response = router.oneshot(req).await.unwrap();
                let status = response.status();
                let body = response.into_body().collect().await.unwrap().to_bytes();
                (status, String::from_utf8_lossy(&body).into_owned())
            }
        };
        let deadline = tokio::time::Instant::now() + DEADLINE;

        // acme's two permits are taken by two requests waiting for the upstream.
        let first = tokio::spawn(send("sk-acme-alice", "hold"));
        let second = tokio::spawn(send("sk-acme-alice", "hold"));
        while arrived.load(Ordering::Relaxed) < 2 {
            assert!(tokio::time::Instant::now() < deadline, "the two requests never reached the upstream");
            tokio::task::yield_now().await;
        }
        // Redis stalls; requests meanwhile time out until the breaker opens.
        let sleeper = server.clone();
        let stall = tokio::task::spawn_blocking(move || sleeper.command(&["DEBUG", "SLEEP", "2.5"]));
        loop {
            let (status, body) = send("sk-globex-bob", "pass").await;
            assert!(tokio::time::Instant::now() < deadline, "redis never stalled");
            if status == StatusCode::SERVICE_UNAVAILABLE
                && gateway.health.backend() == embedding_gateway::health::BackendStatus::Down
            {
                break;
            }
            assert!(status == StatusCode::OK || status == StatusCode::SERVICE_UNAVAILABLE, "{status} {body}");
        }
        // The two requests end during the stall.
        gate.add_permits(1000);
        assert_eq!(first.await.unwrap().0, StatusCode::OK);
        assert_eq!(second.await.unwrap().0, StatusCode::OK);
        stall.await.unwrap().unwrap();

        // Redis is back: the first answer that Redis decides must be a grant.
        loop {
            assert!(tokio::time::Instant::now() < deadline, "redis never came back");
            let (status, body) = send("sk-acme-alice", "pass").await;
            match status {
                StatusCode::SERVICE_UNAVAILABLE => tokio::task::yield_now().await,
                StatusCode::OK => break,
                other => panic!("nothing is in flight, yet {other}: {body}"),
            }
        }
    });
}

/// The roster counts each replica once, forgets those not heard within its window, and
/// its key expires with the fleet.
#[test]
fn the_roster_counts_the_replicas_heard_within_its_window() {
    use embedding_gateway::roster::{FleetSize, beat};
    use std::time::Duration;
    use tower_limits_redis::redis;
    let Some(server) = tower_limits_redis::test_support::redis_for("the_roster_counts_the_replicas") else {
        return;
    };
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    runtime.block_on(async {
        let client = redis::Client::open(server.url()).unwrap();
        let mut conn = client.get_multiplexed_async_connection().await.unwrap();
        let key = "egw-test:replicas";
        let hour = Duration::from_secs(3600);
        assert_eq!(beat(&mut conn, key, "a", hour).await.unwrap(), 1);
        assert_eq!(beat(&mut conn, key, "b", hour).await.unwrap(), 2);
        assert_eq!(beat(&mut conn, key, "a", hour).await.unwrap(), 2, "a replica beating again is one replica");
        // Within a microsecond only the replica beating now was heard.
        assert_eq!(beat(&mut conn, key, "c", Duration::from_micros(1)).await.unwrap(), 1);
        // The key lives two windows past the last beat.
        assert_eq!(beat(&mut conn, key, "c", hour).await.unwrap(), 1);
        let ttl: i64 = redis::cmd("PTTL").arg(key).query_async(&mut conn).await.unwrap();
        assert!((3_600_000..=7_200_000).contains(&ttl), "the roster's key must expire with the fleet: {ttl}");
    });
    // What /readyz says: a count above the configured one sizes the shares at once.
    let size = FleetSize::new(1);
    assert_eq!(size.seen(), 0);
    assert_eq!(size.saw(3), Some(3));
    assert_eq!(size.to_json(), serde_json::json!({ "configured": 1, "seen": 3, "sized_for": 3 }));
}

/// The fleet's size for the shares: never below `--replicas`, up at once, down only after
/// the fleet looked smaller for a minute without a break.
#[tokio::test(start_paused = true)]
async fn the_fleet_grows_at_once_and_shrinks_after_a_minute() {
    use embedding_gateway::roster::{FleetSize, SHRINK_AFTER};
    use std::time::Duration;
    let size = FleetSize::new(2);
    assert_eq!(size.saw(1), None, "never below --replicas");
    assert_eq!(size.saw(4), Some(4));
    assert_eq!(size.saw(3), None, "a smaller fleet waits");
    tokio::time::advance(SHRINK_AFTER - Duration::from_secs(1)).await;
    assert_eq!(size.saw(3), None);
    // Back to four for a beat: the wait starts over.
    assert_eq!(size.saw(4), None);
    tokio::time::advance(Duration::from_secs(2)).await;
    assert_eq!(size.saw(3), None);
    tokio::time::advance(SHRINK_AFTER).await;
    assert_eq!(size.saw(3), Some(3));
    assert_eq!(size.saw(1), None, "down to --replicas at most, after its own minute");
    tokio::time::advance(SHRINK_AFTER).await;
    assert_eq!(size.saw(1), Some(2));
    assert_eq!(size.sized_for(), 2);
}

/// Resizing a replica for a larger fleet cuts its part of every account (and of every
/// plan's fallback) while it serves.
#[test]
fn a_replica_resized_for_a_larger_fleet_mirrors_less_of_each_account() {
    let Some(server) = tower_limits_redis::test_support::redis_for("a_replica_resized_for_a_larger_fleet") else {
        return;
    };
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    runtime.block_on(async {
        let connection = tower_limits_redis::RedisConnection::connect(&server.url()).await.unwrap();
        let config = parse_config(&config_text("", "org = { rpm = 6000 }", "http://127.0.0.1:9"));
        let (router, _) = upstream::router(&config.accounts, config.upstream, &config.gateway.encodings);
        let sharing = Sharing::Redis { connection, replicas: 1, namespace: "egw-resize".into() };
        let gateway = Gateway::with_sharing(&config, in_process(router), &sharing).unwrap();
        let quota = |g: &Gateway| {
            let set = g.pool.member_set(0).unwrap();
            set.peek(&tower_limits::TenantKey::global(), tower_limits::Instant::ZERO)
                .iter()
                .map(|s| s.snapshot.quota)
                .collect::<Vec<_>>()
        };
        let whole = quota(&gateway);
        gateway.resize_fleet(4).unwrap();
        let quarter = quota(&gateway);
        assert_eq!(whole.len(), quarter.len());
        for (w, q) in whole.iter().zip(&quarter) {
            assert!(*q < *w && *q <= w.div_ceil(4) + 1, "a quarter of {w} is not {q}: {whole:?} -> {quarter:?}");
        }
        gateway.resize_fleet(1).unwrap();
        assert_eq!(quota(&gateway), whole, "and back");
    });
}

/// A quota one replica learns from the upstream replaces the account's mirror for the
/// fleet: an account declared at 20 requests a second whose upstream states 10. After one
/// answer through the first replica, the pool's hash in Redis holds the mirror of 10 a
/// second for the account's request limit (which every replica's next call reads: law
/// 34), and the replica's own mirror, which decides only while Redis is away, is its half
/// of the learned quota.
#[test]
fn a_quota_one_replica_learns_is_the_fleets_mirror() {
    let Some(server) = tower_limits_redis::test_support::redis_for("a_quota_one_replica_learns") else { return };
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    runtime.block_on(async {
        let text = config_text("", "org = { rpm = 6000000, concurrency = 64 }", "http://127.0.0.1:9")
            .replace("rpm = 60000\n", "rpm = 1200\n");
        let config = parse_config(&text);
        let mut real = config.accounts.clone();
        real[0].rpm = 600;
        let (router, _) = upstream::router(&real, config.upstream, &config.gateway.encodings);
        let namespace = format!("egw-learn-{}", std::process::id());
        let mut replicas = Vec::new();
        for _ in 0..2 {
            let connection = tower_limits_redis::RedisConnection::connect(&server.url()).await.unwrap();
            let sharing = Sharing::Redis { connection, replicas: 2, namespace: namespace.clone() };
            replicas.push(Gateway::with_sharing(&config, in_process(router.clone()), &sharing).unwrap());
        }
        let (status, _) = embed_as(&replicas[0], "sk-acme-alice", "hello").await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(replicas[0].learned_limits()[0].0, 10);
        replicas[0].accounts().unwrap().flush().await;
        let client = tower_limits_redis::redis::Client::open(server.url()).unwrap();
        let mut admin = client.get_multiplexed_async_connection().await.unwrap();
        let key = format!("{namespace}:pool:{{accounts}}:learned");
        let fields: std::collections::HashMap<String, String> =
            tower_limits_redis::redis::cmd("HGETALL").arg(&key).query_async(&mut admin).await.unwrap();
        // The request limit of the first member: the mirror of 10 a second (a burst of 1,
        // the rest over the window and the jitter: 1.1 s / 9, rounded up), declared as that
        // of 20.
        let field = fields.get("1:1").unwrap_or_else(|| panic!("{fields:?}"));
        let numbers: Vec<u64> = field.split(' ').map(|n| n.parse().unwrap()).collect();
        assert_eq!((numbers[1], numbers[3]), (1_100_000_000u64.div_ceil(9), 1_100_000_000u64.div_ceil(18)), "{field}");
        // The replica's own mirror: half of 10 a second, one of them as its burst.
        let set = replicas[0].pool.member_set(0).unwrap();
        let quotas: Vec<u64> = set
            .peek(&tower_limits::TenantKey::global(), tower_limits::Instant::ZERO)
            .iter()
            .map(|s| s.snapshot.quota)
            .collect();
        assert_eq!(quotas[0], 5 - 1, "{quotas:?}");
    });
}

/// A tenant that keeps exactly its concurrency in flight through a gateway on Redis is
/// never refused: a request's slot is back by the time its client sends the next one,
/// though the release travels to Redis after the answer.
#[test]
fn a_tenant_at_exactly_its_concurrency_on_redis_is_never_refused() {
    let Some(server) = tower_limits_redis::test_support::redis_for("a_tenant_at_exactly_its_concurrency") else {
        return;
    };
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    runtime.block_on(async {
        let connection = tower_limits_redis::RedisConnection::connect(&server.url()).await.unwrap();
        // Redis slower than usual on a loaded machine is Redis away, not this race: a
        // generous timeout keeps the failure policy out of the test.
        let config =
            parse_config(&config_text("redis_timeout = \"5s\"", "org = { concurrency = 2 }", "http://127.0.0.1:9"));
        let (router, _) = upstream::router(&config.accounts, config.upstream, &config.gateway.encodings);
        let sharing = Sharing::Redis { connection, replicas: 1, namespace: "egw-exact".into() };
        let gateway = Gateway::with_sharing(&config, in_process(router), &sharing).unwrap();
        let mut clients = Vec::new();
        for _ in 0..2 {
            let gateway = gateway.clone();
            clients.push(tokio::spawn(async move {
                let mut refused = Vec::new();
                for i in 0..150 {
                    let (status, body) = embed_as(&gateway, "sk-acme-alice", "hi").await;
                    if status != StatusCode::OK {
                        refused.push((i, status, body));
                    }
                }
                refused
            }));
        }
        for client in clients {
            let refused = client.await.unwrap();
            let first = refused.first().map(|(i, status, body)| format!("request {i}: {status} {}", body["error"]));
            assert!(refused.is_empty(), "{} refused at exactly the concurrency, first {first:?}", refused.len());
        }
    });
}
