//! Every refusal end to end, with a real HTTP client (reqwest) against the gateway served
//! on a loopback port: `400`, `401`, `404`, `405`, `413`, `429`, `502`, `503` and `504` all carry
//! OpenAI's error object as `application/json`, and those with a sensible wait carry
//! `Retry-After` and `retry-after-ms`. Then a client shaped like OpenAI's SDKs, which
//! retries a `429` or `503` after `retry-after-ms` (else `Retry-After`), on paused time:
//! it succeeds on its retry, after exactly the delay the gateway said.

mod common;

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use axum::body::Body;
use common::config_text;
use embedding_gateway::config::Config;
use embedding_gateway::gateway::{Gateway, Transport, http_transport, in_process};
use embedding_gateway::server::{self, ServerSettings};
use embedding_gateway::upstream;
use http::Request;
use tokio::net::TcpListener;
use tower::util::BoxCloneSyncService;

fn parse_config(text: &str) -> Config {
    Config::parse(text, Some("test.toml")).unwrap_or_else(|e| panic!("{e}"))
}

/// Serves `gateway` on a loopback port of the system's choosing until the test ends.
async fn serve(gateway: &Gateway, config: &Config) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let settings = ServerSettings { access_log: false, ..ServerSettings::from(&config.gateway) };
    let router = gateway.router.clone();
    let health = Some(gateway.health.clone());
    tokio::spawn(server::serve(listener, router, settings, health, std::future::pending()));
    addr
}

/// The mock upstream on its own loopback port: its base URL.
async fn mock_upstream(plan: &str) -> String {
    let accounts = parse_config(&config_text("", plan, "http://127.0.0.1:9"));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (router, _) = upstream::router(&accounts.accounts, accounts.upstream, &accounts.gateway.encodings);
    tokio::spawn(async move { axum::serve(listener, router).await });
    url
}

/// A gateway with `plan` (and `gateway` keys) in front of the mock upstream, both on
/// loopback ports.
async fn gateway_with(gateway: &str, plan: &str) -> (SocketAddr, Gateway) {
    let url = mock_upstream(plan).await;
    let config = parse_config(&config_text(gateway, plan, &url));
    let built = Gateway::new(&config, http_transport()).unwrap();
    (serve(&built, &config).await, built)
}

fn embeddings(key: Option<&str>, body: &str) -> (String, Option<String>, String) {
    ("/v1/embeddings".into(), key.map(str::to_owned), body.into())
}

fn input(text: &str) -> String {
    serde_json::json!({ "model": "m", "input": text }).to_string()
}

/// What a client saw.
#[derive(Debug)]
struct Seen {
    status: u16,
    headers: reqwest::header::HeaderMap,
    body: serde_json::Value,
}

impl Seen {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(|v| v.to_str().unwrap())
    }

    /// The wait it asks for, as OpenAI's SDKs read it: `retry-after-ms`, else
    /// `Retry-After` in seconds.
    fn retry_delay(&self) -> Option<Duration> {
        let ms = self.header("retry-after-ms").and_then(|v| v.parse::<f64>().ok());
        let s = self.header("retry-after").and_then(|v| v.parse::<f64>().ok());
        ms.map(|ms| Duration::from_secs_f64(ms / 1000.0)).or_else(|| s.map(Duration::from_secs_f64))
    }

    /// Asserts OpenAI's error shape: `application/json`, `{"error": {"message", "type",
    /// "param", "code"}}` and nothing else; returns the code.
    fn openai_error(&self, status: u16) -> &str {
        assert_eq!(self.status, status, "{self:?}");
        assert_eq!(self.header("content-type"), Some("application/json"), "{self:?}");
        let outer = self.body.as_object().unwrap_or_else(|| panic!("not an object: {self:?}"));
        assert_eq!(outer.len(), 1, "only `error`: {self:?}");
        let error = self.body["error"].as_object().unwrap_or_else(|| panic!("no error object: {self:?}"));
        let mut keys: Vec<&str> = error.keys().map(String::as_str).collect();
        keys.sort_unstable();
        assert_eq!(keys, ["code", "message", "param", "type"], "{self:?}");
        assert!(error["message"].as_str().is_some_and(|m| !m.is_empty()), "{self:?}");
        assert!(error["type"].is_string(), "{self:?}");
        error["code"].as_str().unwrap_or_else(|| panic!("no code: {self:?}"))
    }

    /// Asserts that both wait fields are present and say the same wait.
    fn assert_waits(&self) -> Duration {
        let ms: u64 =
            self.header("retry-after-ms").unwrap_or_else(|| panic!("no retry-after-ms: {self:?}")).parse().unwrap();
        let s: u64 = self.header("retry-after").unwrap_or_else(|| panic!("no retry-after: {self:?}")).parse().unwrap();
        assert!(ms > 0, "{self:?}");
        assert_eq!(s, ms.div_ceil(1000), "Retry-After is retry-after-ms in whole seconds, rounded up: {self:?}");
        Duration::from_millis(ms)
    }

    fn assert_no_wait(&self) {
        assert!(self.header("retry-after").is_none() && self.header("retry-after-ms").is_none(), "{self:?}");
    }
}

async fn send(
    client: &reqwest::Client,
    addr: SocketAddr,
    method: &str,
    (path, key, body): (String, Option<String>, String),
) -> Seen {
    let method = reqwest::Method::from_bytes(method.as_bytes()).unwrap();
    let mut request = client.request(method, format!("http://{addr}{path}")).header("content-type", "application/json");
    if let Some(key) = key {
        request = request.bearer_auth(key);
    }
    let response = request.body(body).send().await.unwrap();
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    let bytes = response.bytes().await.unwrap();
    let body = serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null);
    Seen { status, headers, body }
}

#[tokio::test]
async fn refusals_that_no_wait_helps_are_openai_errors_without_a_wait() {
    let (addr, _gateway) = gateway_with("", "org = { rpm = 6000 }").await;
    let client = reqwest::Client::new();
    let key = Some("sk-acme-alice");

    let no_key = send(&client, addr, "POST", embeddings(None, &input("hi"))).await;
    assert_eq!(no_key.openai_error(401), "invalid_api_key");
    no_key.assert_no_wait();
    let unknown_key = send(&client, addr, "POST", embeddings(Some("sk-nobody"), &input("hi"))).await;
    assert_eq!(unknown_key.openai_error(401), "invalid_api_key");

    let bad_json = send(&client, addr, "POST", embeddings(key, "{")).await;
    assert_eq!(bad_json.openai_error(400), "invalid_json");
    bad_json.assert_no_wait();
    let bad_chat =
        send(&client, addr, "POST", ("/v1/chat/completions".into(), key.map(Into::into), r#"{"model":"m"}"#.into()))
            .await;
    assert_eq!(bad_chat.openai_error(400), "invalid_messages");
    assert_eq!(bad_chat.body["error"]["param"], "messages");

    let model = send(&client, addr, "POST", embeddings(key, r#"{"model":"nope","input":"hi"}"#)).await;
    assert_eq!(model.openai_error(404), "model_not_found");
    assert_eq!(model.body["error"]["param"], "model");
    let path = send(&client, addr, "POST", ("/v1/nowhere".into(), key.map(Into::into), String::new())).await;
    path.openai_error(404);
    let method = send(&client, addr, "GET", embeddings(key, "")).await;
    method.openai_error(405);

    let large = send(&client, addr, "POST", embeddings(key, &input(&"word ".repeat(101)))).await;
    assert_eq!(large.openai_error(400), "context_length_exceeded");
    large.assert_no_wait();

    let ok = send(&client, addr, "POST", embeddings(key, &input("hi"))).await;
    assert_eq!(ok.status, 200, "{ok:?}");
}

#[tokio::test]
async fn guessing_keys_from_one_address_is_answered_429_once_its_failures_are_spent() {
    let gateway = "auth_failures_per_minute = 6\nauth_failure_burst = 5";
    let (addr, _gateway) = gateway_with(gateway, "org = { rpm = 6000 }").await;
    let client = reqwest::Client::new();
    // Five failures are the burst: each a 401.
    for i in 0..5 {
        let guess = send(&client, addr, "POST", embeddings(Some(&format!("sk-guess-{i}")), &input("hi"))).await;
        assert_eq!(guess.openai_error(401), "invalid_api_key");
    }
    // Then every request from the address waits for the refill (one failure, 10 s), a
    // valid key's too: a 429 must not tell a guesser that it guessed right.
    let guess = send(&client, addr, "POST", embeddings(Some("sk-guess-5"), &input("hi"))).await;
    assert_eq!(guess.openai_error(429), "too_many_auth_failures");
    let wait = guess.assert_waits();
    assert!(wait > Duration::from_secs(9) && wait <= Duration::from_secs(10), "{wait:?}");
    let valid = send(&client, addr, "POST", embeddings(Some("sk-acme-alice"), &input("hi"))).await;
    assert_eq!(valid.openai_error(429), "too_many_auth_failures");
}

#[tokio::test]
async fn a_valid_key_never_spends_its_address_s_failures() {
    let gateway = "auth_failures_per_minute = 6\nauth_failure_burst = 1";
    let (addr, _gateway) = gateway_with(gateway, "org = { rpm = 6000 }").await;
    let client = reqwest::Client::new();
    for _ in 0..20 {
        let ok = send(&client, addr, "POST", embeddings(Some("sk-acme-alice"), &input("hi"))).await;
        assert_eq!(ok.status, 200, "{ok:?}");
    }
    let guess = send(&client, addr, "POST", embeddings(Some("sk-guess"), &input("hi"))).await;
    assert_eq!(guess.openai_error(401), "invalid_api_key");
}

#[tokio::test]
async fn a_plan_refusal_429_says_the_plan_the_limit_and_the_wait() {
    let (addr, _gateway) = gateway_with("", "org = { rpm = 60, rpm_burst = 1 }").await;
    let client = reqwest::Client::new();
    let ok = send(&client, addr, "POST", embeddings(Some("sk-acme-alice"), &input("hi"))).await;
    assert_eq!(ok.status, 200);
    assert_eq!(ok.header("x-ratelimit-limit-requests"), Some("60"), "the plan, not its burst of 1");
    let refused = send(&client, addr, "POST", embeddings(Some("sk-acme-alice"), &input("hi"))).await;
    assert_eq!(refused.openai_error(429), "rate_limit_exceeded");
    let wait = refused.assert_waits();
    // At most a second, and the spread of a quarter more.
    assert!(wait <= Duration::from_millis(1250), "{refused:?}");
    assert_eq!(refused.body["error"]["type"], "requests");
    let message = refused.body["error"]["message"].as_str().unwrap();
    assert!(
        message.starts_with("Rate limit reached for org.rpm (per org): limit 60 requests per 1m. Please try again in "),
        "{message}"
    );
    assert_eq!(refused.header("ratelimit-policy"), Some("\"org.rpm\";q=60;w=60"));
    assert_eq!(refused.header("x-ratelimit-limit-requests"), Some("60"));
    assert_eq!(refused.header("x-ratelimit-remaining-requests"), Some("0"));
}

#[tokio::test]
async fn a_store_that_is_down_503_suggests_a_wait_and_claims_no_state() {
    let plan = "org = { rpm = 60 }";
    let url = mock_upstream(plan).await;
    let config = parse_config(&config_text("backend_failure = \"fail_closed\"", plan, &url));
    // Replicas sharing their limits through a Redis that has not answered yet.
    let gateway = Gateway::awaiting_redis(&config, http_transport(), 2).unwrap();
    let addr = serve(&gateway, &config).await;
    let down = send(&reqwest::Client::new(), addr, "POST", embeddings(Some("sk-acme-alice"), &input("hi"))).await;
    assert_eq!(down.openai_error(503), "limits_unavailable");
    assert_eq!(down.assert_waits(), Duration::from_secs(1));
    assert_eq!(down.body["error"]["type"], "server_error");
    for field in ["ratelimit", "ratelimit-policy", "x-ratelimit-limit-requests", "x-ratelimit-remaining-requests"] {
        assert!(down.header(field).is_none(), "{field} claims a state nobody read: {down:?}");
    }
}

#[tokio::test]
async fn a_replica_deciding_alone_while_its_store_is_away_states_no_plan() {
    let plan = "org = { rpm = 60, rpm_burst = 2 }";
    let url = mock_upstream(plan).await;
    let config = parse_config(&config_text("backend_failure = \"fallback\"", plan, &url));
    // One of two replicas, before Redis answers: it decides alone on half of the plan.
    let gateway = Gateway::awaiting_redis(&config, http_transport(), 2).unwrap();
    let addr = serve(&gateway, &config).await;
    let client = reqwest::Client::new();
    let ok = send(&client, addr, "POST", embeddings(Some("sk-acme-alice"), &input("hi"))).await;
    assert_eq!(ok.status, 200, "{ok:?}");
    let refused = send(&client, addr, "POST", embeddings(Some("sk-acme-alice"), &input("hi"))).await;
    assert_eq!(refused.openai_error(429), "rate_limit_exceeded");
    refused.assert_waits();
    for seen in [&ok, &refused] {
        for field in ["ratelimit", "ratelimit-policy", "x-ratelimit-limit-requests", "x-ratelimit-remaining-requests"] {
            assert!(seen.header(field).is_none(), "{field} states this replica's share as the plan: {seen:?}");
        }
    }
}

#[tokio::test]
async fn an_upstream_that_refuses_is_a_503_with_its_wait() {
    // The provider allows less than the gateway's mirror believes.
    let plan = "org = { rpm = 6000 }";
    let config = parse_config(&config_text("", plan, "http://127.0.0.1:9"));
    let mut stricter = config.accounts.clone();
    stricter[0].rpm = 60;
    let (router, _) = upstream::router(&stricter, config.upstream, &config.gateway.encodings);
    let gateway = Gateway::new(&config, in_process(router)).unwrap();
    let addr = serve(&gateway, &config).await;
    let client = reqwest::Client::new();
    assert_eq!(send(&client, addr, "POST", embeddings(Some("sk-acme-alice"), &input("one"))).await.status, 200);
    let refused = send(&client, addr, "POST", embeddings(Some("sk-acme-alice"), &input("two"))).await;
    assert_eq!(refused.openai_error(503), "upstream_rate_limited");
    refused.assert_waits();
}

#[tokio::test]
async fn a_tenant_at_its_concurrency_gets_a_429_with_the_suggested_wait() {
    let config = parse_config(&config_text("", "org = { concurrency = 1 }", "http://127.0.0.1:9"));
    let (transport, mut streams) = common::scripted();
    let gateway = Gateway::new(&config, transport).unwrap();
    let addr = serve(&gateway, &config).await;
    let client = reqwest::Client::new();
    let chat = serde_json::json!({ "model": "m", "messages": [{ "role": "user", "content": "hi" }], "stream": true });
    // A stream whose head is out holds the tenant's only slot until it ends.
    let streaming = client
        .post(format!("http://{addr}/v1/chat/completions"))
        .bearer_auth("sk-acme-alice")
        .body(chat.to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(streaming.status(), 200);
    let upstream = streams.recv().await.unwrap();
    let busy = send(&client, addr, "POST", embeddings(Some("sk-acme-alice"), &input("hi"))).await;
    assert_eq!(busy.openai_error(429), "concurrency_limited");
    // Nobody knows when a stream ends, and no permit came back yet: the suggested second,
    // and up to a quarter more, as the body says too.
    let wait = busy.assert_waits();
    assert!((Duration::from_secs(1)..=Duration::from_millis(1250)).contains(&wait), "{busy:?}");
    let message = busy.body["error"]["message"].as_str().unwrap();
    assert!(
        message.starts_with(
            "Too many requests in flight for org.concurrency (per org): limit 1 at once. Please try again in 1."
        ),
        "{message}"
    );
    drop(upstream);
    assert!(streaming.bytes().await.unwrap().is_empty());
}

#[tokio::test]
async fn an_unreachable_upstream_is_a_502() {
    // A port held by a socket that is bound and never listens: a connection to it is
    // refused, and no other test can take the port meanwhile (a port freed again could be,
    // by another test's listener, which made this test fail once in a while).
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let closed = socket.local_addr().unwrap();
    let config = parse_config(&config_text("", "org = { rpm = 6000 }", &format!("http://{closed}")));
    let gateway = Gateway::new(&config, http_transport()).unwrap();
    let addr = serve(&gateway, &config).await;
    let unreachable =
        send(&reqwest::Client::new(), addr, "POST", embeddings(Some("sk-acme-alice"), &input("hi"))).await;
    assert_eq!(unreachable.openai_error(502), "upstream_unreachable");
    assert_eq!(unreachable.assert_waits(), Duration::from_secs(1), "another try may reach it");
}

/// An upstream that never answers.
fn hung() -> Transport {
    BoxCloneSyncService::new(tower::service_fn(|_req: Request<Body>| async {
        std::future::pending::<()>().await;
        Ok::<_, tower::BoxError>(http::Response::new(Body::empty()))
    }))
}

#[tokio::test]
async fn a_hung_upstream_is_a_504() {
    let config =
        parse_config(&config_text("upstream_timeout = \"100ms\"", "org = { rpm = 6000 }", "http://127.0.0.1:9"));
    let gateway = Gateway::new(&config, hung()).unwrap();
    let addr = serve(&gateway, &config).await;
    let timed_out = send(&reqwest::Client::new(), addr, "POST", embeddings(Some("sk-acme-alice"), &input("hi"))).await;
    assert_eq!(timed_out.openai_error(504), "upstream_timeout");
    assert_eq!(timed_out.assert_waits(), Duration::from_secs(1), "another try may find it answering");
}

// ---------------------------------------------------------------------------------------
// A client shaped like OpenAI's SDKs.

/// What OpenAI's SDKs do with an answer: retry `408`, `409`, `429` and `5xx` up to
/// `max_retries` times, after `retry-after-ms`, else `Retry-After`, when it is between 0
/// and 60 s (else a backoff of their own, here half a second). `wait` is how the client
/// waits (a sleep in the SDKs; here, moving the paused clock). Returns the last answer and
/// every delay waited.
async fn sdk_request<W, F>(
    client: &reqwest::Client,
    addr: SocketAddr,
    body: &str,
    max_retries: usize,
    wait: W,
) -> (Seen, Vec<Duration>)
where
    W: Fn(Duration) -> F,
    F: Future<Output = ()>,
{
    let mut waited = Vec::new();
    loop {
        let seen = send(client, addr, "POST", embeddings(Some("sk-acme-alice"), body)).await;
        let retryable = matches!(seen.status, 408 | 409 | 429) || seen.status >= 500;
        if !retryable || waited.len() == max_retries {
            return (seen, waited);
        }
        let delay = seen
            .retry_delay()
            .filter(|d| !d.is_zero() && *d <= Duration::from_secs(60))
            .unwrap_or(Duration::from_millis(500));
        waited.push(delay);
        wait(delay).await;
    }
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn an_sdk_shaped_client_retries_after_exactly_the_wait_the_gateway_said() {
    // Time moves only when the client waits: a task that never idles keeps the paused
    // clock from jumping ahead while sockets are read (the runtime polls them every few
    // turns).
    let spinner = tokio::spawn(async {
        loop {
            tokio::task::yield_now().await;
        }
    });
    // 240 per minute, one at a time: 250 ms between requests.
    let plan = "org = { rpm = 240, rpm_burst = 1 }";
    // The exact wait: no spread.
    let gateway = "header_timeout = \"1h\"\nidle_timeout = \"1h\"\nretry_spread_percent = 0";
    let text = config_text(gateway, plan, "http://127.0.0.1:9");
    let config = parse_config(&text);
    let (router, stats) = upstream::router(&config.accounts, config.upstream, &config.gateway.encodings);
    let gateway = Gateway::new(&config, in_process(router)).unwrap();
    let addr = serve(&gateway, &config).await;
    let client = reqwest::Client::new();
    let advance = |d: Duration| tokio::time::advance(d);

    let (first, waited) = sdk_request(&client, addr, &input("hello"), 2, advance).await;
    assert_eq!((first.status, waited.len()), (200, 0));

    // Refused at once, the client waits what the gateway said and passes on its retry.
    let started = tokio::time::Instant::now();
    let said = send(&client, addr, "POST", embeddings(Some("sk-acme-alice"), &input("peek"))).await;
    assert_eq!(said.openai_error(429), "rate_limit_exceeded");
    assert_eq!(said.header("retry-after-ms"), Some("250"));
    assert_eq!(said.header("retry-after"), Some("1"));
    assert!(said.body["error"]["message"].as_str().unwrap().ends_with("Please try again in 0.250s."), "{said:?}");
    let (retried, waited) = sdk_request(&client, addr, &input("hello"), 2, advance).await;
    assert_eq!(retried.status, 200, "{retried:?}");
    assert_eq!(waited, [Duration::from_millis(250)], "one retry, after retry-after-ms rather than Retry-After's 1 s");
    assert_eq!(started.elapsed(), Duration::from_millis(250), "and no time went by otherwise");

    // The wait is exact: a millisecond less is refused (with a millisecond left), the
    // full wait passes.
    let refused = send(&client, addr, "POST", embeddings(Some("sk-acme-alice"), &input("again"))).await;
    assert_eq!(refused.header("retry-after-ms"), Some("250"));
    tokio::time::advance(Duration::from_millis(249)).await;
    let early = send(&client, addr, "POST", embeddings(Some("sk-acme-alice"), &input("again"))).await;
    assert_eq!(early.openai_error(429), "rate_limit_exceeded");
    assert_eq!(early.header("retry-after-ms"), Some("1"));
    tokio::time::advance(Duration::from_millis(1)).await;
    let on_time = send(&client, addr, "POST", embeddings(Some("sk-acme-alice"), &input("again"))).await;
    assert_eq!(on_time.status, 200, "{on_time:?}");
    assert_eq!(stats.refused(), 0, "the upstream never refused");
    spinner.abort();
}
