//! Budgets in money over calendar periods: each request's price taken from its key's
//! budget, settled to the real usage, refused with OpenAI's error shape once spent, and
//! renewed at the period's first instant. On paused time.

mod common;

use std::time::Duration;

use axum::body::{Body, Bytes};
use common::{chat, config_text, content, scripted, usage_chunk};
use embedding_gateway::api::SSE_DONE;
use embedding_gateway::config::Config;
use embedding_gateway::gateway::{Gateway, Sharing, in_process};
use embedding_gateway::upstream;
use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use tower::ServiceExt;
use tower_limits::TenantKey;

/// One dollar a million tokens is a micro-dollar a token.
const USD: u64 = 1_000_000;

/// The test configuration with `plan`, the model `m` priced `price` (its TOML table) and
/// `gateway` in `[gateway]`.
fn text(gateway: &str, plan: &str, price: &str) -> String {
    format!("{}\n[price.m]\n{price}\n", config_text(gateway, plan, "http://127.0.0.1:9"))
}

fn config(gateway: &str, plan: &str, price: &str) -> Config {
    Config::parse(&text(gateway, plan, price), Some("test.toml")).unwrap_or_else(|e| panic!("{e}"))
}

fn embed(input: &str) -> Request<Body> {
    Request::post("/v1/embeddings")
        .header("authorization", "Bearer sk-acme-alice")
        .header("content-type", "application/json")
        .body(Body::from(serde_json::json!({ "model": "m", "input": input }).to_string()))
        .unwrap()
}

async fn json(r: Response<Body>) -> serde_json::Value {
    serde_json::from_slice(&r.into_body().collect().await.unwrap().to_bytes()).unwrap()
}

fn alice() -> TenantKey {
    TenantKey::new(["acme", "alice"]).unwrap()
}

/// A user's budget of 5 USD a day at a dollar a token: five one-token embeddings pass, the
/// sixth is refused naming the budget, with the wait to midnight; a millisecond before
/// midnight it is still refused, at midnight the whole budget is back.
#[tokio::test(start_paused = true)]
async fn a_spent_budget_is_refused_until_the_day_renews() {
    let config = config(
        "timezone = \"Europe/Berlin\"",
        "user = { budget = \"5 USD / day\" }",
        "currency = \"USD\"\ninput = 1000000",
    );
    let (router, _) = upstream::router(&config.accounts, config.upstream, &config.gateway.encodings);
    let gateway = Gateway::new(&config, in_process(router)).unwrap();
    for _ in 0..5 {
        assert_eq!(gateway.router.clone().oneshot(embed("hello")).await.unwrap().status(), StatusCode::OK);
    }
    let (left, renews) = gateway.budget_remaining(0, &alice(), "user.budget").unwrap();
    assert_eq!(left, 0);
    let refused = gateway.router.clone().oneshot(embed("hello")).await.unwrap();
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    let wait_ms: u64 = refused.headers()["retry-after-ms"].to_str().unwrap().parse().unwrap();
    let wait = Duration::from_millis(wait_ms);
    assert!(wait >= renews && wait < renews + Duration::from_millis(1), "{wait:?} against {renews:?}");
    let error = json(refused).await;
    assert_eq!(
        (error["error"]["type"].as_str(), error["error"]["code"].as_str()),
        (Some("insufficient_quota"), Some("budget_exceeded"))
    );
    let message = error["error"]["message"].as_str().unwrap();
    assert!(message.contains("user.budget of 5 USD is spent: 5 USD used"), "{message}");
    assert!(
        message.contains("00:00 CE") && message.contains("(Europe/Berlin)"),
        "renews at midnight in Berlin: {message}"
    );

    tokio::time::advance(renews - Duration::from_millis(1)).await;
    assert_eq!(gateway.router.clone().oneshot(embed("hello")).await.unwrap().status(), StatusCode::TOO_MANY_REQUESTS);
    tokio::time::advance(Duration::from_millis(1)).await;
    assert_eq!(gateway.router.clone().oneshot(embed("hello")).await.unwrap().status(), StatusCode::OK);
    assert_eq!(gateway.budget_remaining(0, &alice(), "user.budget").unwrap().0, 4 * USD);
}

/// A streamed chat completion is charged its estimate (17 prompt tokens at 1 USD, 50 of
/// `max_tokens` at 2 USD: 117 USD) while it streams, and settled to its final usage (17
/// in, 10 out: 37 USD) when it ends; a stream the client drops before any usage keeps
/// its estimate.
#[tokio::test(start_paused = true)]
async fn a_stream_is_charged_its_estimate_then_settled_to_its_usage() {
    let (transport, mut streams) = scripted();
    let config =
        config("", "user = { budget = \"1000 USD / month\" }", "currency = \"USD\"\ninput = 1000000\noutput = 2000000");
    let gateway = Gateway::new(&config, transport).unwrap();
    let left = || gateway.budget_remaining(0, &alice(), "user.budget").unwrap().0;
    let prompt = format!("a{}", " a".repeat(9));

    let answer = gateway.router.clone().oneshot(chat(&prompt, 50, true)).await.unwrap();
    assert_eq!(answer.status(), StatusCode::OK);
    let upstream = streams.recv().await.unwrap();
    assert_eq!(left(), 1000 * USD - 117 * USD, "the estimate is charged while it streams");
    let mut body = answer.into_body();
    upstream.send(content("Hi")).await.unwrap();
    upstream.send(usage_chunk(17, 10)).await.unwrap();
    upstream.send(Bytes::from_static(SSE_DONE)).await.unwrap();
    drop(upstream);
    while body.frame().await.is_some() {}
    assert_eq!(left(), 1000 * USD - 37 * USD, "settled to 17 tokens in and 10 out");

    let answer = gateway.router.clone().oneshot(chat(&prompt, 50, true)).await.unwrap();
    let upstream = streams.recv().await.unwrap();
    upstream.send(content("Hi")).await.unwrap();
    drop(answer);
    upstream.closed().await;
    assert_eq!(left(), 1000 * USD - 37 * USD - 117 * USD, "a stream without usage keeps its estimate");
}

/// A request its plan refuses (one request a minute) gives its price back; a request whose
/// estimate is above the whole budget is refused at once, saying so.
#[tokio::test(start_paused = true)]
async fn a_refused_request_costs_nothing_and_one_above_the_budget_is_named() {
    let config = config(
        "",
        "user = { rpm = 1, rpm_burst = 1, budget = \"3 USD / week\" }",
        "currency = \"USD\"\ninput = 1000000",
    );
    let (router, _) = upstream::router(&config.accounts, config.upstream, &config.gateway.encodings);
    let gateway = Gateway::new(&config, in_process(router)).unwrap();
    assert_eq!(gateway.router.clone().oneshot(embed("hello")).await.unwrap().status(), StatusCode::OK);
    let refused = gateway.router.clone().oneshot(embed("hello")).await.unwrap();
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(json(refused).await["error"]["code"], "rate_limit_exceeded");
    assert_eq!(gateway.budget_remaining(0, &alice(), "user.budget").unwrap().0, 2 * USD);

    let big = gateway.router.clone().oneshot(embed("one two three four five")).await.unwrap();
    assert_eq!(big.status(), StatusCode::TOO_MANY_REQUESTS);
    let message = json(big).await["error"]["message"].as_str().unwrap().to_owned();
    assert!(message.contains("estimated at 5 USD, above the whole budget user.budget of 3 USD"), "{message}");
}

/// Every mistake in budgets and prices is an error naming its field and line.
#[test]
fn bad_budgets_and_prices_name_their_field() {
    let error = |gateway: &str, plan: &str, price: &str| {
        Config::parse(&text(gateway, plan, price), Some("test.toml")).unwrap_err().to_string()
    };
    let usd = "currency = \"USD\"\ninput = 1";
    let cases = [
        (
            error("timezone = \"Mars/Olympus\"", "user = { budget = \"1 USD / day\" }", usd),
            "gateway.timezone: \"Mars/Olympus\" is not a time zone",
        ),
        (
            error("", "user = { budget = \"0 USD / day\" }", usd),
            "plan.basic.user.budget: a budget of zero admits nothing",
        ),
        (
            error("", "user = { budget = \"1 USD / fortnight\" }", usd),
            "plan.basic.user.budget: unknown calendar period",
        ),
        (
            error("", "user = { budget = \"1 EUR / day\" }", usd),
            "plan.basic.user.budget: \"EUR\" is not \"USD\", the currency of price.m.currency",
        ),
        (
            error("", "user = { budget = \"1 USD / day\" }", "currency = \"usd\"\ninput = 1"),
            "price.m.currency: must be a currency code",
        ),
        (
            error("", "user = { budget = \"1 USD / day\" }", "currency = \"USD\"\ninput = -1"),
            "price.m.input: must be a price per million tokens",
        ),
    ];
    for (got, want) in cases {
        assert!(got.contains(want) && got.contains("line"), "{got}\n  should say: {want}");
    }
    // A served model without a price, once a budget counts money.
    let no_price = config_text("", "user = { budget = \"1 USD / day\" }", "http://127.0.0.1:9")
        + "\n[price.other]\ncurrency = \"USD\"\ninput = 1\n";
    let got = Config::parse(&no_price, None).unwrap_err().to_string();
    assert!(got.contains("price.m: the model \"m\" has no price, and plan.basic.user.budget counts"), "{got}");
}

/// With Redis, the replicas share every budget: what one replica spends, the other
/// refuses, and a replica that starts afresh finds the budget as the others left it.
#[test]
fn replicas_share_a_budget_through_redis() {
    let Some(server) = tower_limits_redis::test_support::redis_for("replicas_share_a_budget_through_redis") else {
        return;
    };
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    runtime.block_on(async {
        let config = config("", "user = { budget = \"3 USD / month\" }", "currency = \"USD\"\ninput = 1000000");
        let (router, _) = upstream::router(&config.accounts, config.upstream, &config.gateway.encodings);
        let namespace = format!("egw-budget-{}", std::process::id());
        let replica = || async {
            let connection = tower_limits_redis::RedisConnection::connect(&server.url()).await.unwrap();
            let sharing = Sharing::Redis { connection, replicas: 2, namespace: namespace.clone() };
            Gateway::with_sharing(&config, in_process(router.clone()), &sharing).unwrap()
        };
        let (a, b) = (replica().await, replica().await);
        for gateway in [&a, &b, &a] {
            assert_eq!(gateway.router.clone().oneshot(embed("hello")).await.unwrap().status(), StatusCode::OK);
        }
        let refused = b.router.clone().oneshot(embed("hello")).await.unwrap();
        assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(json(refused).await["error"]["code"], "budget_exceeded");
        drop((a, b));
        let restarted = replica().await;
        let refused = restarted.router.clone().oneshot(embed("hello")).await.unwrap();
        assert_eq!(json(refused).await["error"]["code"], "budget_exceeded", "the month's budget outlives the replicas");
    });
}

/// `demo --budget` on the bundled configuration: a month on a paused clock, its checks
/// all holding.
#[test]
fn the_budget_demo_passes_on_the_bundled_configuration() {
    let config = Config::parse(include_str!("../gateway.toml"), Some("gateway.toml")).unwrap();
    assert!(embedding_gateway::demo::budget::run(&config).unwrap());
}
