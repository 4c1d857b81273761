//! The gateway through `oneshot` on its router: configuration errors with their lines,
//! 401 for unknown keys, 429 with its fields for a tenant's own limit, settling with the
//! upstream's usage, and the mirror keeping a strict upstream from ever saying 429.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::body::Body;
use embedding_gateway::config::Config;
use embedding_gateway::gateway::{ACCOUNT_HEADER, Gateway, Sharing, Transport, in_process};
use embedding_gateway::tokenizer::Encoding;
use embedding_gateway::upstream;
use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use tower::ServiceExt;
use tower::util::BoxCloneSyncService;

/// A small configuration; `plan` and `extra` are spliced in.
fn config_text(plan: &str, extra: &str) -> String {
    format!(
        r#"tiers = ["org", "user"]

[gateway]
max_request_tokens = 100
max_wait = "60s"
embedding_models = ["m"]
chat_models = ["m"]
encodings = {{ m = "cl100k_base" }}
tenant_queue = 200
retry_spread_percent = 0 # the exact waits: the end-to-end tests see them spread

[mirror]
jitter = "100ms"

[plan.basic]
{plan}

[[tenant]]
name = "acme"
plan = "basic"
weight = 2

[[tenant.key]]
key = "sk-acme-alice"
user = "alice"

[[tenant]]
name = "globex"
plan = "basic"

[[tenant.key]]
key = "sk-globex-bob"
user = "bob"

[[account]]
name = "primary"
base_url = "http://127.0.0.1:9"
api_key = "up-primary"
rpm = 600
tpm = 60000
window = "1s"
{extra}"#
    )
}

fn config(plan: &str) -> Config {
    Config::parse(&config_text(plan, ""), Some("test.toml")).unwrap()
}

fn request(key: Option<&str>, input: &serde_json::Value) -> Request<Body> {
    let mut req = Request::post("/v1/embeddings").header("content-type", "application/json");
    if let Some(key) = key {
        req = req.header("authorization", format!("Bearer {key}"));
    }
    req.body(Body::from(serde_json::json!({ "model": "m", "input": input }).to_string())).unwrap()
}

async fn json(response: Response<Body>) -> serde_json::Value {
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    serde_json::from_slice(&bytes).unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&bytes)))
}

/// The mock upstream of `config`, in process.
fn mock(config: &Config) -> (Transport, Arc<upstream::UpstreamStats>) {
    let (router, stats) = upstream::router(&config.accounts, config.upstream, &config.gateway.encodings);
    (in_process(router), stats)
}

/// An upstream that answers with a fixed usage, counting its calls.
fn fixed_usage(total_tokens: u64, calls: Arc<AtomicU64>) -> Transport {
    BoxCloneSyncService::new(tower::service_fn(move |_req: Request<Body>| {
        calls.fetch_add(1, Ordering::Relaxed);
        let body = serde_json::json!({
            "object": "list",
            "data": [],
            "model": "m",
            "usage": { "prompt_tokens": total_tokens, "total_tokens": total_tokens }
        });
        async move { Ok::<_, tower::BoxError>(Response::new(Body::from(body.to_string()))) }
    }))
}

// ---------------------------------------------------------------------------------------
// Configuration errors name the field and the line.

fn config_error(text: &str) -> embedding_gateway::config::ConfigError {
    Config::parse(text, Some("bad.toml")).unwrap_err()
}

fn line_of(text: &str, needle: &str) -> usize {
    // The last occurrence: a duplicate is reported where it is repeated.
    text.lines().collect::<Vec<_>>().iter().rposition(|l| l.contains(needle)).unwrap() + 1
}

#[test]
fn syntax_errors_carry_the_line() {
    let text = config_text("org = { rpm = 60 }", "").replace("weight = 2", "weight = = 2");
    let err = config_error(&text);
    assert_eq!(err.line, Some(line_of(&text, "weight = = 2")), "{err}");
    assert!(err.to_string().starts_with(&format!("bad.toml, line {}", line_of(&text, "weight = = 2"))), "{err}");
}

#[test]
fn unknown_fields_and_wrong_types_carry_field_and_line() {
    let text = config_text("org = { rpm = 60 }", "").replace("weight = 2", "wieght = 2");
    let err = config_error(&text);
    assert_eq!(err.line, Some(line_of(&text, "wieght")), "{err}");
    assert_eq!(err.field, "tenant[0].wieght");
    assert!(err.message.contains("unknown field `wieght`"), "{err}");

    let text = config_text("org = { rpm = \"sixty\" }", "");
    let err = config_error(&text);
    assert_eq!(err.line, Some(line_of(&text, "sixty")), "{err}");
    assert!(err.field.starts_with("plan.basic.org"), "{err}");
}

#[test]
fn validation_errors_carry_field_and_line() {
    // (replace, with, the line to expect, field, message)
    let cases: [(&str, &str, &str, &str, &str); 8] = [
        ("weight = 2", "weight = 0", "weight = 0", "tenant[0].weight", "must be at least 1"),
        (
            "jitter = \"100ms\"",
            "jitter = \"100ms\"\nlearn_ceiling_percent = 50",
            "learn_ceiling_percent",
            "mirror.learn_ceiling_percent",
            "must be at least 100",
        ),
        (
            "[gateway]",
            "[gateway]\nplan_share_refresh = \"2m\"",
            "plan_share_refresh",
            "gateway.plan_share_refresh",
            "must be at most 60s (0s: no shares)",
        ),
        ("plan = \"basic\"", "plan = \"gold\"", "gold", "tenant[0].plan", "no plan is named \"gold\""),
        ("sk-globex-bob", "sk-acme-alice", "sk-acme-alice", "tenant[1].key[0].key", "already belongs"),
        ("user = \"bob\"", "usr = \"bob\"", "usr", "tenant[1].key[0].usr", "unknown field"),
        ("window = \"1s\"", "window = \"1 fortnight\"", "fortnight", "account[0].window", "unknown unit"),
        ("tpm = 60000", "tpm = 600", "tpm = 600", "account[0].tpm", "leave no room for a burst"),
    ];
    for (from, to, needle, field, message) in cases {
        let text = config_text("org = { rpm = 60 }", "").replacen(from, to, 1);
        let err = config_error(&text);
        assert_eq!(err.field, field, "{err}");
        assert_eq!(err.line, Some(line_of(&text, needle)), "{err}");
        assert!(err.message.contains(message), "{err}");
        assert!(err.to_string().contains(&format!("line {}", line_of(&text, needle))), "{err}");
    }
    let text = config_text("org = { tpm = 600 }", "");
    let err = config_error(&text);
    assert_eq!(err.field, "plan.basic.org.tpm_burst", "{err}");
    assert_eq!(err.line, Some(line_of(&text, "tpm = 600 }")), "{err}");
    // A rate too fast to represent, and a burst too long to, name their own fields.
    for (limits, field, message) in [
        ("org = { rpm = 1099511627776 }", "plan.basic.org.rpm", "too fast"),
        ("org = { rpm = 1, rpm_burst = 4611686018427387903 }", "plan.basic.org.rpm_burst", "146 years"),
    ] {
        let err = config_error(&config_text(limits, ""));
        assert_eq!(err.field, field, "{err}");
        assert!(err.message.contains(message), "{err}");
    }
}

#[test]
fn model_encodings_are_checked_by_name_and_line() {
    let base = config_text("org = { rpm = 60 }", "");
    let ours = "encodings = { m = \"cl100k_base\" }";
    // (the encodings line, the served models' line, the line to expect, field, message)
    let cases: [(&str, &str, &str, &str, &str); 4] = [
        (
            "encodings = { m = \"p50k_base\" }",
            "",
            "p50k_base",
            "gateway.encodings.\"m\"",
            "unknown encoding \"p50k_base\": one of cl100k_base, o200k_base, utf8_bytes",
        ),
        (
            "encodings = { m = \"cl100k_base\", x = \"cl100k_base\" }",
            "",
            "x = ",
            "gateway.encodings.\"x\"",
            "\"x\" is not served",
        ),
        ("", "chat_models = [\"m\", \"llama-3\"]", "llama-3", "gateway.chat_models[1]", "has no known encoding"),
        ("default_max_tokens = 100", "", "default_max_tokens", "gateway.default_max_tokens", "must be below"),
    ];
    for (encodings, models, needle, field, message) in cases {
        let mut text = base.replace(ours, &format!("{ours}\n{encodings}"));
        if encodings.starts_with("encodings") {
            text = base.replace(ours, encodings);
        }
        if !models.is_empty() {
            text = text.replace("chat_models = [\"m\"]", models);
        }
        let err = config_error(&text);
        assert_eq!(err.field, field, "{err}");
        assert_eq!(err.line, Some(line_of(&text, needle)), "{err}");
        assert!(err.message.contains(message), "{err}");
    }
    // OpenAI's models need no entry; the answer counts with theirs.
    let text = base.replace("chat_models = [\"m\"]", "chat_models = [\"m\", \"gpt-4o-mini\"]");
    let config = Config::parse(&text, None).unwrap();
    assert_eq!(config.gateway.encodings.get("gpt-4o-mini"), Some(Encoding::O200kBase));
    assert_eq!(config.gateway.encodings.get("m"), Some(Encoding::Cl100kBase));
}

#[test]
fn bands_are_checked_by_name_and_line() {
    let base = config_text("org = { rpm = 60 }", "");
    let bands =
        "tenant_queue = 200\nbands = [{ name = \"interactive\" }, { name = \"batch\", min_share_percent = 10 }]";
    // (replace, with, the line to expect, field, message)
    let cases: [(&str, &str, &str, &str, &str); 5] = [
        (
            "tenant_queue = 200",
            "bands = [{ name = \"a\", min_share_percent = 60 }, { name = \"b\", min_share_percent = 50 }]",
            "min_share_percent = 50",
            "gateway.bands[1].min_share_percent",
            "sum to 110%, above 100%",
        ),
        (
            "tenant_queue = 200",
            "bands = [{ name = \"a\" }, { name = \"a\" }]",
            "bands",
            "gateway.bands[1].name",
            "named twice",
        ),
        ("tenant_queue = 200", "band_header = \"x-band\"", "band_header", "gateway.band_header", "needs gateway.bands"),
        ("weight = 2", "weight = 2\nband = \"bulk\"", "bulk", "tenant[0].band", "no band is named \"bulk\""),
        (
            "tenant_queue = 200",
            &format!("{bands}\nband_header = \"x band\""),
            "x band",
            "gateway.band_header",
            "not a header name",
        ),
    ];
    for (from, to, needle, field, message) in cases {
        let text = base.replacen(from, to, 1);
        let err = config_error(&text);
        assert_eq!(err.field, field, "{err}");
        assert_eq!(err.line, Some(line_of(&text, needle)), "{err}");
        assert!(err.message.contains(message), "{err}");
    }
    let text = base.replacen("tenant_queue = 200", bands, 1).replacen(
        "plan = \"basic\"\n\n",
        "plan = \"basic\"\nband = \"batch\"\n\n",
        1,
    );
    let config = Config::parse(&text, None).unwrap();
    assert_eq!(config.gateway.bands.len(), 2);
    assert_eq!((config.tenants[0].band, config.tenants[1].band), (0, 1));
}

/// A client may move its requests to a later band than its tenant's through the header
/// the operator allows, never to an earlier one: that, or a band nobody configured, is a
/// `400` naming the header.
#[tokio::test(start_paused = true)]
async fn a_band_header_may_lower_a_tenant_s_band_never_raise_it() {
    let text = config_text("org = { rpm = 600 }", "")
        .replacen(
            "tenant_queue = 200",
            "tenant_queue = 200\nbands = [{ name = \"interactive\" }, { name = \"batch\", min_share_percent = 10 }]\nband_header = \"x-band\"",
            1,
        )
        .replacen("name = \"globex\"\nplan = \"basic\"", "name = \"globex\"\nplan = \"basic\"\nband = \"batch\"", 1);
    let config = Config::parse(&text, None).unwrap();
    assert_eq!(config.tenants[1].band, 1);
    let (transport, _) = mock(&config);
    let gateway = Gateway::new(&config, transport).unwrap();
    let call = |key: &str, band: Option<&str>| {
        let mut req = request(Some(key), &"hello".into());
        if let Some(band) = band {
            req.headers_mut().insert("x-band", band.parse().unwrap());
        }
        gateway.router.clone().oneshot(req)
    };
    for (key, band) in [("sk-acme-alice", Some("batch")), ("sk-acme-alice", None), ("sk-globex-bob", Some("batch"))] {
        assert_eq!(call(key, band).await.unwrap().status(), StatusCode::OK, "{key} {band:?}");
    }
    for (key, band, message) in [
        ("sk-globex-bob", "interactive", "may use band \"batch\" or a later one"),
        ("sk-acme-alice", "urgent", "no band is named \"urgent\""),
    ] {
        let response = call(key, Some(band)).await.unwrap();
        assert_eq!(response.status(), StatusCode::BAD_REQUEST);
        let body = json(response).await;
        assert_eq!(
            (body["error"]["code"].as_str(), body["error"]["param"].as_str()),
            (Some("invalid_band"), Some("x-band"))
        );
        assert!(body["error"]["message"].as_str().unwrap().contains(message), "{body}");
    }
}

#[test]
fn the_bundled_configuration_is_valid() {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/gateway.toml")).unwrap();
    let config = Config::parse(&text, None).unwrap();
    assert!(config.tenants.len() >= 3 && config.demo.clients.len() >= 3);
}

// ---------------------------------------------------------------------------------------
// Answers.

#[tokio::test(start_paused = true)]
async fn missing_and_unknown_keys_get_401() {
    let config = config("org = { rpm = 60 }");
    let (transport, _) = mock(&config);
    let gateway = Gateway::new(&config, transport).unwrap();
    for key in [None, Some("sk-nobody-at-all")] {
        let response = gateway.router.clone().oneshot(request(key, &"hello".into())).await.unwrap();
        assert_eq!(response.status(), StatusCode::UNAUTHORIZED);
        assert_eq!(response.headers()["www-authenticate"], "Bearer");
        assert_eq!(json(response).await["error"]["code"], "invalid_api_key");
    }
}

#[tokio::test(start_paused = true)]
async fn embeddings_come_back_in_openai_shape() {
    let config = config("org = { rpm = 60 }");
    let (transport, stats) = mock(&config);
    let gateway = Gateway::new(&config, transport).unwrap();
    let input = serde_json::json!(["Hello, world!", "rate limits"]);
    let response = gateway.router.clone().oneshot(request(Some("sk-acme-alice"), &input)).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(response.headers()[ACCOUNT_HEADER], "primary");
    let body = json(response).await;
    assert_eq!(body["object"], "list");
    assert_eq!(body["data"].as_array().unwrap().len(), 2);
    assert_eq!(body["data"][1]["index"], 1);
    assert_eq!(body["data"][0]["embedding"].as_array().unwrap().len(), 16);
    let tokens = Encoding::Cl100kBase.count("Hello, world!") + Encoding::Cl100kBase.count("rate limits");
    assert_eq!(body["usage"]["total_tokens"], tokens);
    assert_eq!(stats.served.load(Ordering::Relaxed), 1);
}

#[tokio::test(start_paused = true)]
async fn bad_bodies_and_large_requests_are_refused_before_any_limit() {
    let config = config("org = { rpm = 60, rpm_burst = 1 }");
    let (transport, stats) = mock(&config);
    let gateway = Gateway::new(&config, transport).unwrap();
    let bad = Request::post("/v1/embeddings").header("authorization", "Bearer sk-acme-alice").body(Body::from("{"));
    let response = gateway.router.clone().oneshot(bad.unwrap()).await.unwrap();
    assert_eq!(response.status(), StatusCode::BAD_REQUEST);
    let long = "word ".repeat(101);
    let response = gateway.router.clone().oneshot(request(Some("sk-acme-alice"), &long.into())).await.unwrap();
    assert_eq!(response.status(), StatusCode::BAD_REQUEST);
    assert_eq!(json(response).await["error"]["code"], "context_length_exceeded");
    // Neither used the tenant's only request.
    let ok = gateway.router.clone().oneshot(request(Some("sk-acme-alice"), &"hi".into())).await.unwrap();
    assert_eq!(ok.status(), StatusCode::OK);
    assert_eq!(stats.served.load(Ordering::Relaxed), 1);
}

#[tokio::test(start_paused = true)]
async fn a_tenant_over_its_plan_gets_429_with_its_fields() {
    let config = config("org = { rpm = 60, rpm_burst = 2 }\nuser = { tpm = 6000 }");
    let (transport, stats) = mock(&config);
    let gateway = Gateway::new(&config, transport).unwrap();
    for _ in 0..2 {
        let ok = gateway.router.clone().oneshot(request(Some("sk-acme-alice"), &"hello".into())).await.unwrap();
        assert_eq!(ok.status(), StatusCode::OK);
    }
    let refused = gateway.router.clone().oneshot(request(Some("sk-acme-alice"), &"hello".into())).await.unwrap();
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    let h = refused.headers();
    assert_eq!(h["retry-after"], "1");
    let wait_ms: u64 = h["retry-after-ms"].to_str().unwrap().parse().unwrap();
    assert!(wait_ms > 0 && wait_ms <= 1000, "{wait_ms}");
    assert_eq!(h["content-type"], "application/json");
    // Every limit of the plan, as the plan states it (60 per minute, 6,000 tokens per
    // minute), not as its burst.
    assert_eq!(h["ratelimit-policy"], "\"org.rpm\";q=60;w=60, \"user.tpm\";q=6000;w=60");
    assert!(h["ratelimit"].to_str().unwrap().starts_with("\"org.rpm\";r=0;t=2, \"user.tpm\";r="), "{h:?}");
    assert_eq!(h["x-ratelimit-limit-requests"], "60");
    assert_eq!(h["x-ratelimit-remaining-requests"], "0");
    // OpenAI's error object, and nothing else, for its SDKs.
    let body = json(refused).await;
    assert_eq!(body.as_object().unwrap().len(), 1, "{body}");
    assert_eq!(body["error"]["type"], "requests");
    assert_eq!(body["error"]["code"], "rate_limit_exceeded");
    assert_eq!(body["error"]["param"], serde_json::Value::Null);
    assert_eq!(
        body["error"]["message"],
        format!(
            "Rate limit reached for org.rpm (per org): limit 60 requests per 1m. Please try again in {:.3}s.",
            wait_ms as f64 / 1000.0
        )
    );
    assert_eq!(stats.served.load(Ordering::Relaxed), 2, "the refused request never reached the upstream");

    // Another tenant is not affected; acme passes again a second later.
    let other = gateway.router.clone().oneshot(request(Some("sk-globex-bob"), &"hello".into())).await.unwrap();
    assert_eq!(other.status(), StatusCode::OK);
    tokio::time::advance(Duration::from_secs(1)).await;
    let again = gateway.router.clone().oneshot(request(Some("sk-acme-alice"), &"hello".into())).await.unwrap();
    assert_eq!(again.status(), StatusCode::OK);
}

#[tokio::test(start_paused = true)]
async fn the_upstream_usage_settles_the_tenants_tokens() {
    let config = config("user = { tpm = 6000, tpm_burst = 1000 }");
    let calls = Arc::new(AtomicU64::new(0));
    // The estimate of this input is 50 tokens; the upstream reports 20.
    let input: serde_json::Value = format!("a{}", " a".repeat(49)).into();
    assert_eq!(Encoding::Cl100kBase.count(input.as_str().unwrap()), 50);
    let gateway = Gateway::new(&config, fixed_usage(20, calls.clone())).unwrap();
    let first = gateway.router.clone().oneshot(request(Some("sk-acme-alice"), &input)).await.unwrap();
    assert_eq!(first.status(), StatusCode::OK);
    assert_eq!(first.headers()["x-ratelimit-remaining-tokens"], "950", "charged the estimate at admission");
    // Settled when the answer's body has been read (it holds the estimate until then).
    json(first).await;
    let second = gateway.router.clone().oneshot(request(Some("sk-acme-alice"), &input)).await.unwrap();
    assert_eq!(second.headers()["x-ratelimit-remaining-tokens"], "930", "settled to 20: 30 came back");
    assert_eq!(calls.load(Ordering::Relaxed), 2);
}

#[tokio::test(start_paused = true)]
async fn an_upstream_429_benches_the_account_and_answers_503() {
    // The mock upstream allows less than the gateway's mirror believes.
    let config = config("org = { rpm = 6000 }");
    let mut stricter = config.accounts.clone();
    stricter[0].rpm = 60;
    let (router, upstream_stats) = upstream::router(&stricter, config.upstream, &config.gateway.encodings);
    let gateway = Gateway::new(&config, in_process(router)).unwrap();
    let ok = gateway.router.clone().oneshot(request(Some("sk-acme-alice"), &"one".into())).await.unwrap();
    assert_eq!(ok.status(), StatusCode::OK);
    let refused = gateway.router.clone().oneshot(request(Some("sk-acme-alice"), &"two".into())).await.unwrap();
    assert_eq!(refused.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(refused.headers()["retry-after"], "1");
    assert!(refused.headers().contains_key("retry-after-ms"));
    assert_eq!(json(refused).await["error"]["code"], "upstream_rate_limited");
    assert_eq!(upstream_stats.refused(), 1);
    assert_eq!(gateway.stats.upstream_refusals.load(Ordering::Relaxed), 1);
    assert!(gateway.pool.benched_until(0, tower_limits::Instant::from_nanos(0)).is_some());
}

/// Many tenants' requests at once, on paused time: everything waits for the mirror,
/// nothing is refused by the strict upstream, and every request is served.
#[tokio::test(start_paused = true)]
async fn the_mirror_keeps_a_strict_upstream_from_refusing() {
    let config = config("org = { rpm = 60000 }");
    let (transport, stats) = mock(&config);
    let gateway = Gateway::new(&config, transport).unwrap();
    let mut calls = tokio::task::JoinSet::new();
    for i in 0..120u64 {
        let router = gateway.router.clone();
        let key = if i % 3 == 0 { "sk-globex-bob" } else { "sk-acme-alice" };
        let words = 1 + (i * 7) % 45; // at most 90 tokens: under max_request_tokens
        let input: serde_json::Value = "token ".repeat(words as usize).into();
        calls.spawn(async move { router.oneshot(request(Some(key), &input)).await.map(|r| r.status()) });
    }
    let statuses: Vec<Result<StatusCode, Infallible>> = calls.join_all().await;
    assert!(statuses.iter().all(|s| *s.as_ref().unwrap() == StatusCode::OK), "{statuses:?}");
    assert_eq!(stats.refused(), 0);
    assert_eq!(stats.served.load(Ordering::Relaxed), 120);
}

/// Two replicas sharing the tenants' limits through a real `redis-server` (skipped, with
/// a note on stderr, when none can be started; `REQUIRE_REDIS=1` makes that a failure).
#[test]
fn replicas_share_the_tenants_limits_through_redis() {
    let Some(server) = tower_limits_redis::test_support::redis_for("replicas_share_the_tenants_limits_through_redis")
    else {
        return;
    };
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    runtime.block_on(async {
        let config = config("org = { rpm = 60, rpm_burst = 2 }");
        let (transport, stats) = mock(&config);
        let namespace = format!("egw-test-{}", std::process::id());
        let mut replicas = Vec::new();
        for _ in 0..2 {
            let connection = tower_limits_redis::RedisConnection::connect(&server.url()).await.unwrap();
            let sharing = Sharing::Redis { connection, replicas: 2, namespace: namespace.clone() };
            replicas.push(Gateway::with_sharing(&config, transport.clone(), &sharing).unwrap());
        }
        for replica in &replicas {
            let ok = replica.router.clone().oneshot(request(Some("sk-acme-alice"), &"hello".into())).await.unwrap();
            let status = ok.status();
            assert_eq!(status, StatusCode::OK, "{}", json(ok).await);
        }
        // acme's burst of two is spent across the fleet, whichever replica it asks.
        for replica in &replicas {
            let refused =
                replica.router.clone().oneshot(request(Some("sk-acme-alice"), &"hello".into())).await.unwrap();
            assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
            assert!(json(refused).await["error"]["message"].as_str().unwrap().contains("for org.rpm (per org)"));
        }
        assert_eq!(stats.served.load(Ordering::Relaxed), 2);
    });
}

/// The shared queue's refusals are OpenAI errors with a wait too: a tenant's queue full
/// (`429`, the suggested wait), and a turn that would wait longer than `max_wait` for an
/// account (`503`, with the account's exact wait).
#[tokio::test(start_paused = true)]
async fn the_queues_refusals_are_openai_errors_with_a_wait() {
    // An account of 2 requests a second: its mirror admits one, then one every 1.1 s.
    let queue = |max_wait: &str| {
        let text = config_text("org = { rpm = 6000 }", "")
            .replace("max_wait = \"60s\"", &format!("max_wait = \"{max_wait}\""))
            .replace("tenant_queue = 200", "tenant_queue = 1")
            .replace("rpm = 600\n", "rpm = 120\n");
        let config = Config::parse(&text, Some("test.toml")).unwrap();
        let (transport, _stats) = mock(&config);
        Gateway::new(&config, transport).unwrap()
    };

    let gateway = queue("60s");
    let first = gateway.router.clone().oneshot(request(Some("sk-acme-alice"), &"one".into())).await.unwrap();
    assert_eq!(first.status(), StatusCode::OK);
    // The second waits at the gate for the account, the third in acme's queue of one; a
    // fourth finds that queue full.
    let mut waiting = Vec::new();
    for text in ["two", "three"] {
        let router = gateway.router.clone();
        waiting.push(tokio::spawn(async move { router.oneshot(request(Some("sk-acme-alice"), &text.into())).await }));
        for _ in 0..8 {
            tokio::task::yield_now().await;
        }
    }
    let full = gateway.router.clone().oneshot(request(Some("sk-acme-alice"), &"four".into())).await.unwrap();
    assert_eq!(full.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(full.headers()["retry-after"], "1");
    assert_eq!(full.headers()["retry-after-ms"], "1000");
    assert_eq!(full.headers()["content-type"], "application/json");
    let body = json(full).await;
    assert_eq!(body["error"]["code"], "tenant_queue_full");
    assert_eq!(body["error"]["message"], "Too many of your requests are queued. Please try again in 1.000s.");
    for w in waiting {
        assert_eq!(w.await.unwrap().unwrap().status(), StatusCode::OK, "their turns came");
    }

    // With half a second to wait at most, the second is refused at once: the account's
    // next request is 1.1 s away, and the answer says so.
    let gateway = queue("500ms");
    let first = gateway.router.clone().oneshot(request(Some("sk-acme-alice"), &"one".into())).await.unwrap();
    assert_eq!(first.status(), StatusCode::OK);
    let busy = gateway.router.clone().oneshot(request(Some("sk-acme-alice"), &"two".into())).await.unwrap();
    assert_eq!(busy.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(busy.headers()["retry-after"], "2");
    assert_eq!(busy.headers()["retry-after-ms"], "1100");
    let body = json(busy).await;
    assert_eq!(body["error"]["type"], "server_error");
    assert_eq!(body["error"]["code"], "wait_timed_out");
    assert!(body["error"]["message"].as_str().unwrap().ends_with("Please try again in 1.100s."), "{body}");
}

/// Clients that retry as OpenAI's SDKs do (twice at most, exactly after `retry-after-ms`)
/// all get through a tenant's concurrency when more of them come at once than it allows:
/// each refusal tells its turn, so the retries come back as permits free up, not together.
#[tokio::test(start_paused = true)]
async fn sdk_clients_at_once_all_pass_a_concurrency_limit_with_two_retries() {
    // An account with room to spare and an upstream answering in 20 ms: the tenant's
    // concurrency is the only limit that binds.
    let gateway = sdk_gateway("600000");
    // A fresh gateway (its first refusals cannot know the hold time: a second), then the
    // same gateway again, which has learnt it.
    for (clients, within) in
        [(64, Duration::from_millis(1600)), (24, Duration::from_secs(1)), (64, Duration::from_secs(1))]
    {
        let took = sdk_burst(&gateway, clients, &["sk-acme-alice"]).await;
        assert!(took < within, "{clients} at once took {took:?}");
    }
}

/// The same clients when the upstream account binds (about 100 requests a second, below
/// what 8 requests in flight of 20 ms could send): requests hold their concurrency while
/// they queue for the account, and hold times grow only once that queue has formed. The
/// plans space their refused clients by the accounts' pace, so the first places are not
/// too close together: every call passes, for one tenant or two at once.
#[tokio::test(start_paused = true)]
async fn sdk_clients_at_once_all_pass_when_the_accounts_bind() {
    let gateway = sdk_gateway("7200");
    // 64 calls at the account's ~100 a second take at least 0.64 s.
    for (clients, within) in [(64, Duration::from_secs(2)), (24, Duration::from_secs(1)), (64, Duration::from_secs(1))]
    {
        let took = sdk_burst(&gateway, clients, &["sk-acme-alice"]).await;
        assert!(took < within, "{clients} at once took {took:?}");
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    let took = sdk_burst(&gateway, 128, &["sk-acme-alice", "sk-globex-bob"]).await;
    assert!(took < Duration::from_secs(2), "two tenants' 128 at once took {took:?}");
}

/// A gateway with a concurrency of 8 per tenant, an upstream answering in 20 ms, an
/// account of `rpm` requests a minute (checked over 1 s windows) and the default spread.
fn sdk_gateway(rpm: &str) -> Gateway {
    let text = config_text("org = { concurrency = 8 }", "\n[upstream]\nlatency = \"20ms\"")
        .replace("retry_spread_percent = 0", "retry_spread_percent = 25")
        .replace("rpm = 600\n", &format!("rpm = {rpm}\n"))
        .replace("tpm = 60000\n", "tpm = 60000000\n");
    let config = Config::parse(&text, Some("test.toml")).unwrap();
    let (transport, _stats) = mock(&config);
    Gateway::new(&config, transport).unwrap()
}

/// `clients` calls at once, taking `keys` in turn, each retrying as the SDKs do; asserts
/// that all of them pass, and answers how long they took.
async fn sdk_burst(gateway: &Gateway, clients: usize, keys: &[&'static str]) -> Duration {
    let started = tokio::time::Instant::now();
    let mut calls = Vec::new();
    for i in 0..clients {
        let router = gateway.router.clone();
        let key = keys[i % keys.len()];
        calls.push(tokio::spawn(async move {
            for attempt in 0..3 {
                let input = serde_json::Value::from(format!("call {i}"));
                let response = router.clone().oneshot(request(Some(key), &input)).await.unwrap();
                if response.status() == StatusCode::OK {
                    let _ = json(response).await;
                    return Ok(attempt);
                }
                let status = response.status();
                let Some(ms) = response.headers().get("retry-after-ms") else { return Err(status) };
                let wait = Duration::from_millis(ms.to_str().unwrap().parse().unwrap());
                drop(response);
                tokio::time::sleep(wait).await;
            }
            Err(StatusCode::TOO_MANY_REQUESTS)
        }));
    }
    let mut failed = Vec::new();
    for (i, call) in calls.into_iter().enumerate() {
        if let Err(status) = call.await.unwrap() {
            failed.push((i, status));
        }
    }
    assert!(failed.is_empty(), "{clients} at once: {} failed after two retries: {failed:?}", failed.len());
    started.elapsed()
}
