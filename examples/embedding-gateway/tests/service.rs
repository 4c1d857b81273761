//! The gateway as a service, over real sockets: stalled clients are closed, the
//! connection limit holds new connections back without refusing them, a hung upstream
//! gets a `504`, inputs in every form OpenAI takes, JSON on every error, health and
//! models, duplicate configuration keys named. The fleet on Redis is in `fleet.rs`.

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use axum::body::Body;
use common::{Answer, DEADLINE, closed_by_peer, config_text, embed, http, parse, until, upload};
use embedding_gateway::config::Config;
use embedding_gateway::gateway::{Gateway, Transport, http_transport, in_process};
use embedding_gateway::server::{self, ServerSettings, Stopped};
use embedding_gateway::upstream;
use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tower::ServiceExt;
use tower::util::BoxCloneSyncService;

/// A running gateway on a loopback port, stopped (drained) by `stop`.
struct Running {
    addr: SocketAddr,
    gateway: Gateway,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<std::io::Result<Stopped>>,
}

impl Running {
    async fn start(config: &Config, transport: Transport) -> Self {
        Self::start_with(config, transport, ServerSettings::from(&config.gateway)).await
    }

    async fn start_with(config: &Config, transport: Transport, settings: ServerSettings) -> Self {
        let gateway = Gateway::new(config, transport).unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(server::serve(
            listener,
            gateway.router.clone(),
            settings,
            Some(gateway.health.clone()),
            async move {
                let _ = stopped.await;
            },
        ));
        Running { addr, gateway, stop: Some(stop), task }
    }

    async fn stop(mut self) -> Stopped {
        let _ = self.stop.take().unwrap().send(());
        tokio::time::timeout(DEADLINE, self.task).await.expect("drained in time").unwrap().unwrap()
    }
}

/// The mock upstream on a loopback port: its base URL.
async fn mock_upstream(config_for_accounts: &Config) -> (String, Arc<upstream::UpstreamStats>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (router, stats) = upstream::router(
        &config_for_accounts.accounts,
        config_for_accounts.upstream,
        &config_for_accounts.gateway.encodings,
    );
    tokio::spawn(async move { axum::serve(listener, router).await });
    (url, stats)
}

fn parse_config(text: &str) -> Config {
    Config::parse(text, Some("test.toml")).unwrap_or_else(|e| panic!("{e}"))
}

/// A gateway in front of the mock upstream, both on real sockets.
async fn gateway_with(gateway_keys: &str, plan: &str) -> (Running, Arc<upstream::UpstreamStats>) {
    served_with(gateway_keys, plan, |_| {}).await
}

/// As [`gateway_with`], with the server's settings as `tweak` leaves them.
async fn served_with(
    gateway_keys: &str,
    plan: &str,
    tweak: impl FnOnce(&mut ServerSettings),
) -> (Running, Arc<upstream::UpstreamStats>) {
    let accounts = parse_config(&config_text("", plan, "http://127.0.0.1:9"));
    let (url, stats) = mock_upstream(&accounts).await;
    let config = parse_config(&config_text(gateway_keys, plan, &url));
    let mut settings = ServerSettings::from(&config.gateway);
    tweak(&mut settings);
    (Running::start_with(&config, http_transport(), settings).await, stats)
}

/// Waits until the server receives `n` bodies at once.
async fn receiving(running: &Running, n: u64) {
    let connections = running.gateway.health.connections().clone();
    until(&format!("{n} bodies being received"), || connections.receiving_body() == n).await;
}

fn assert_openai_error(answer: &Answer, status: u16, code: &str) {
    assert_eq!(answer.status, status, "{answer:?}");
    assert_eq!(answer.header("content-type").as_deref(), Some("application/json"), "{answer:?}");
    let body = answer.json();
    let error = body["error"].as_object().unwrap_or_else(|| panic!("no error object: {body}"));
    for field in ["message", "type", "param", "code"] {
        assert!(error.contains_key(field), "{field} missing: {body}");
    }
    assert_eq!(error["code"], code, "{body}");
}

// ---------------------------------------------------------------------------------------
// Connections.

#[tokio::test]
async fn stalled_clients_are_closed_within_their_timeouts() {
    let (running, _) = gateway_with(
        "header_timeout = \"300ms\"\nidle_timeout = \"300ms\"\nbody_timeout = \"300ms\"",
        "org = { rpm = 6000 }",
    )
    .await;
    let addr = running.addr;

    // Connects and sends nothing.
    let mut silent = TcpStream::connect(addr).await.unwrap();
    // Stalls in its headers.
    let mut partial = TcpStream::connect(addr).await.unwrap();
    partial.write_all(b"POST /v1/embeddings HTTP/1.1\r\nhost: x\r\n").await.unwrap();
    // Announces a body that never comes.
    let mut no_body = TcpStream::connect(addr).await.unwrap();
    no_body
        .write_all(b"POST /v1/embeddings HTTP/1.1\r\nhost: x\r\nauthorization: Bearer sk-acme-alice\r\ncontent-length: 80\r\n\r\n{\"model\":")
        .await
        .unwrap();
    // Keeps a keep-alive connection idle after one request.
    let mut idle = TcpStream::connect(addr).await.unwrap();
    idle.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n").await.unwrap();

    let mut read = Vec::new();
    assert!(closed_by_peer(&mut silent, &mut read).await, "a silent connection stayed open");
    assert!(read.is_empty());
    assert!(closed_by_peer(&mut partial, &mut read).await, "a connection stalled in its headers stayed open");
    let mut answer = Vec::new();
    assert!(closed_by_peer(&mut no_body, &mut answer).await, "a connection without its body stayed open");
    let answer = parse(&answer);
    assert_openai_error(&answer, 408, "body_timeout");
    assert_eq!(answer.header("connection").as_deref(), Some("close"));
    let mut answer = Vec::new();
    assert!(closed_by_peer(&mut idle, &mut answer).await, "an idle keep-alive connection stayed open");
    assert!(String::from_utf8_lossy(&answer).starts_with("HTTP/1.1 200"), "the request before was answered");

    // The server is still fine.
    assert_eq!(embed(addr, "sk-acme-alice", "hello".into()).await.status, 200);
    assert_eq!(running.stop().await, Stopped { cut: 0 });
}

#[tokio::test]
async fn at_max_connections_a_silent_connection_makes_room_for_a_real_client() {
    // Headers may take a minute: only the limit can free a connection here.
    let (running, _) = gateway_with("max_connections = 2\nheader_timeout = \"60s\"", "org = { rpm = 6000 }").await;
    // Two clients take every connection and send nothing.
    let mut a = TcpStream::connect(running.addr).await.unwrap();
    let _b = TcpStream::connect(running.addr).await.unwrap();
    // A real client is answered at once: the oldest silent connection is closed for it.
    let answer = http(running.addr, "GET", "/healthz", None, None).await;
    assert_eq!(answer.status, 200);
    let mut read = Vec::new();
    assert!(closed_by_peer(&mut a, &mut read).await, "the oldest silent connection was not the one closed");
    running.stop().await;
}

#[tokio::test]
async fn stalled_uploads_cost_their_tenant_not_the_others() {
    // Bodies may take a minute: only the per-tenant places bound them here.
    let (running, _) = gateway_with(
        "uploads_per_tenant = 2\nbody_timeout = \"60s\"\nbody_grace = \"60s\"",
        "org = { rpm = 6000, concurrency = 2 }",
    )
    .await;
    let addr = running.addr;
    // acme starts two uploads and sends a few bytes of each.
    let first = upload(addr, "sk-acme-alice", 100, "{\"model\":").await;
    let second = upload(addr, "sk-acme-alice", 100, "{\"model\":").await;
    receiving(&running, 2).await;

    // acme's next request is refused before its body is read, and its connection closed.
    let mut third = upload(addr, "sk-acme-alice", 100, "").await;
    let mut raw = Vec::new();
    assert!(closed_by_peer(&mut third, &mut raw).await, "the refused upload's connection stayed open");
    let refused = parse(&raw);
    assert_openai_error(&refused, 429, "too_many_uploads");
    assert!(refused.header("retry-after").is_some(), "{refused:?}");
    assert_eq!(refused.header("connection").as_deref(), Some("close"));
    // A request whose body comes whole needs no place.
    assert_eq!(embed(addr, "sk-acme-alice", "hello".into()).await.status, 200);

    // Another tenant, and the probes, are served as if nothing happened.
    assert_eq!(embed(addr, "sk-globex-bob", "hello".into()).await.status, 200);
    assert_eq!(http(addr, "GET", "/healthz", None, None).await.status, 200);

    // A stalled upload that goes away gives its place back.
    drop(first);
    receiving(&running, 1).await;
    assert_eq!(embed(addr, "sk-acme-alice", "hello".into()).await.status, 200);
    drop(second);
    running.stop().await;
}

#[tokio::test]
async fn a_body_that_falls_behind_its_pace_is_cut_after_the_grace() {
    let (running, _) =
        gateway_with("body_min_rate = 1000\nbody_grace = \"200ms\"\nbody_timeout = \"60s\"", "org = { rpm = 6000 }")
            .await;
    // Eleven bytes of a hundred, then nothing: cut after the grace and eleven milliseconds,
    // not after body_timeout.
    let mut slow = upload(running.addr, "sk-acme-alice", 100, "{\"model\":\"m").await;
    let mut raw = Vec::new();
    assert!(closed_by_peer(&mut slow, &mut raw).await, "a body behind its pace was not cut");
    let cut = parse(&raw);
    assert_openai_error(&cut, 408, "body_too_slow");
    assert!(cut.json()["error"]["message"].as_str().unwrap().contains("after 11 bytes"), "{cut:?}");
    // A body sent at once is well within any pace.
    assert_eq!(embed(running.addr, "sk-acme-alice", "hello".into()).await.status, 200);
    running.stop().await;
}

#[tokio::test]
async fn at_max_connections_probes_keep_answering_and_stalled_uploads_give_way() {
    // Two connections, both sending bodies that stall; a stall frees nothing for a minute.
    let (running, _) =
        served_with("max_connections = 2\nbody_timeout = \"60s\"\nbody_grace = \"60s\"", "org = { rpm = 6000 }", |s| {
            s.stalled_upload = std::time::Duration::from_secs(60)
        })
        .await;
    let addr = running.addr;
    let a = upload(addr, "sk-acme-alice", 100, "{").await;
    let b = upload(addr, "sk-globex-bob", 100, "{").await;
    receiving(&running, 2).await;
    // Every connection has a request in flight: probes get a place kept for them, and
    // anything else on such a place a 503 that says why.
    assert_eq!(http(addr, "GET", "/healthz", None, None).await.status, 200);
    assert_eq!(http(addr, "GET", "/readyz", None, None).await.status, 200);
    let busy = embed(addr, "sk-acme-alice", "hello".into()).await;
    assert_openai_error(&busy, 503, "server_busy");
    assert!(busy.header("retry-after").is_some(), "{busy:?}");
    drop((a, b));
    running.stop().await;

    // With stalls of any age evictable, a new client takes the place of the upload that
    // stalled first.
    let (running, _) =
        served_with("max_connections = 2\nbody_timeout = \"60s\"\nbody_grace = \"60s\"", "org = { rpm = 6000 }", |s| {
            s.stalled_upload = std::time::Duration::ZERO
        })
        .await;
    let addr = running.addr;
    let mut a = upload(addr, "sk-acme-alice", 100, "{").await;
    receiving(&running, 1).await;
    let b = upload(addr, "sk-globex-bob", 100, "{").await;
    receiving(&running, 2).await;
    assert_eq!(embed(addr, "sk-globex-bob", "hello".into()).await.status, 200);
    let mut raw = Vec::new();
    assert!(closed_by_peer(&mut a, &mut raw).await, "the upload stalled longest was not the one closed");
    assert_eq!(running.gateway.health.connections().probe_places(), 0);
    drop(b);
    running.stop().await;
}

#[tokio::test]
async fn shutdown_closes_connections_still_sending_their_headers() {
    let (running, _) = gateway_with("header_timeout = \"60s\"\nshutdown_grace = \"30s\"", "org = { rpm = 6000 }").await;
    let mut partial = TcpStream::connect(running.addr).await.unwrap();
    partial.write_all(b"POST /v1/embeddings HTTP/1.1\r\nhost: x\r\n").await.unwrap();
    let connections = running.gateway.health.connections().clone();
    until("the connection open", || connections.open() == 1).await;
    // Nothing is in flight on it: the drain closes it at once, none is cut at the grace.
    assert_eq!(running.stop().await, Stopped { cut: 0 });
    let mut read = Vec::new();
    assert!(closed_by_peer(&mut partial, &mut read).await);
}

#[tokio::test]
async fn http2_with_prior_knowledge_is_served_and_multiplexed() {
    let (running, _) = gateway_with("", "org = { rpm = 6000 }").await;
    let stream = TcpStream::connect(running.addr).await.unwrap();
    let (send, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(stream),
    )
    .await
    .unwrap();
    let driver = tokio::spawn(conn);
    let body = serde_json::json!({ "model": "m", "input": "hello" }).to_string();
    // Two requests at once on the one connection.
    let mut calls = Vec::new();
    for _ in 0..2 {
        let mut send = send.clone();
        let req = Request::post(format!("http://{}/v1/embeddings", running.addr))
            .header("authorization", "Bearer sk-acme-alice")
            .header("content-type", "application/json")
            .body(http_body_util::Full::new(bytes::Bytes::from(body.clone())))
            .unwrap();
        calls.push(tokio::spawn(async move { send.send_request(req).await }));
    }
    for call in calls {
        let response = call.await.unwrap().unwrap();
        assert_eq!((response.status(), response.version()), (StatusCode::OK, http::Version::HTTP_2));
        let json: serde_json::Value =
            serde_json::from_slice(&response.into_body().collect().await.unwrap().to_bytes()).unwrap();
        assert_eq!(json["object"], "list", "{json}");
    }
    drop(send);
    let _ = tokio::time::timeout(DEADLINE, driver).await;
    running.stop().await;
}

// ---------------------------------------------------------------------------------------
// The upstream call.

#[tokio::test]
async fn a_hung_upstream_gets_a_json_504_and_the_account_is_not_benched() {
    // An upstream that accepts connections and never answers.
    let hung = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", hung.local_addr().unwrap());
    let held = tokio::spawn(async move {
        let mut sockets = Vec::new();
        while let Ok((s, _)) = hung.accept().await {
            sockets.push(s);
        }
    });
    let config = parse_config(&config_text("upstream_timeout = \"300ms\"", "org = { rpm = 6000 }", &url));
    let running = Running::start(&config, http_transport()).await;
    let answer = embed(running.addr, "sk-acme-alice", "hello".into()).await;
    assert_openai_error(&answer, 504, "upstream_timeout");
    assert_eq!(answer.json()["error"]["type"], "upstream_error");
    let gateway = running.gateway.clone();
    assert_eq!(gateway.stats.upstream_timeouts.load(Ordering::Relaxed), 1);
    assert_eq!(gateway.stats.upstream_errors.load(Ordering::Relaxed), 0);
    assert_eq!(gateway.health.usable_accounts(), 1, "a timeout does not bench the account");
    running.stop().await;
    held.abort();
}

/// An upstream whose first call never answers; later calls answer with `usage` 50.
fn first_call_hangs() -> Transport {
    let calls = Arc::new(AtomicU64::new(0));
    BoxCloneSyncService::new(tower::service_fn(move |_req: Request<Body>| {
        let n = calls.fetch_add(1, Ordering::Relaxed);
        async move {
            if n == 0 {
                std::future::pending::<()>().await;
            }
            let body = serde_json::json!({
                "object": "list", "data": [], "model": "m",
                "usage": { "prompt_tokens": 50, "total_tokens": 50 }
            });
            Ok::<_, tower::BoxError>(Response::new(Body::from(body.to_string())))
        }
    }))
}

async fn remaining_after_a_timeout(on_timeout: &str) -> u64 {
    let text = config_text(
        &format!("upstream_timeout = \"100ms\"\non_upstream_timeout = \"{on_timeout}\""),
        // One token a second: the 100 ms of the timeout give back nothing visible.
        "user = { tpm = 60, tpm_burst = 1000 }",
        "http://127.0.0.1:9",
    );
    let gateway = Gateway::new(&parse_config(&text), first_call_hangs()).unwrap();
    // 50 tokens of cl100k_base.
    let input = serde_json::json!(format!("a{}", " a".repeat(49)));
    let request = || {
        Request::post("/v1/embeddings")
            .header("authorization", "Bearer sk-acme-alice")
            .body(Body::from(serde_json::json!({ "model": "m", "input": input }).to_string()))
            .unwrap()
    };
    let timed_out = gateway.router.clone().oneshot(request()).await.unwrap();
    assert_eq!(timed_out.status(), StatusCode::GATEWAY_TIMEOUT);
    // Read to its end, as a client does: the request's tokens are settled then.
    timed_out.into_body().collect().await.unwrap();
    let ok = gateway.router.clone().oneshot(request()).await.unwrap();
    assert_eq!(ok.status(), StatusCode::OK);
    ok.headers()["x-ratelimit-remaining-tokens"].to_str().unwrap().parse().unwrap()
}

#[tokio::test(start_paused = true)]
async fn a_timed_out_request_keeps_or_refunds_its_tokens_as_configured() {
    let kept = remaining_after_a_timeout("keep").await;
    let refunded = remaining_after_a_timeout("refund").await;
    assert_eq!(refunded, kept + 50, "refund gives the 50 estimated tokens back");
}

// ---------------------------------------------------------------------------------------
// Inputs and answers.

/// The gateway and the mock upstream in one process.
fn in_memory(plan: &str) -> (Gateway, Arc<upstream::UpstreamStats>) {
    let config = parse_config(&config_text("", plan, "http://127.0.0.1:9"));
    let (router, stats) = upstream::router(&config.accounts, config.upstream, &config.gateway.encodings);
    (Gateway::new(&config, in_process(router)).unwrap(), stats)
}

async fn call(gateway: &Gateway, method: &str, path: &str, body: serde_json::Value) -> (StatusCode, serde_json::Value) {
    let mut req = Request::builder().method(method).uri(path).header("authorization", "Bearer sk-acme-alice");
    if method == "POST" {
        req = req.header("content-type", "application/json");
    }
    let body = if body.is_null() { Body::empty() } else { Body::from(body.to_string()) };
    let response = gateway.router.clone().oneshot(req.body(body).unwrap()).await.unwrap();
    let status = response.status();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    let json = serde_json::from_slice(&bytes).unwrap_or_else(|e| panic!("{status}: not JSON ({e}): {bytes:?}"));
    (status, json)
}

#[tokio::test(start_paused = true)]
async fn token_arrays_are_embedded_and_each_token_counts_one() {
    let (gateway, _) = in_memory("org = { rpm = 6000 }");
    let (status, body) =
        call(&gateway, "POST", "/v1/embeddings", serde_json::json!({"model": "m", "input": [1, 2, 3]})).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["data"].as_array().unwrap().len(), 1);
    assert_eq!(body["usage"]["total_tokens"], 3);

    let input = serde_json::json!([[1, 2], [3], [40000, 5, 6, 7]]);
    let (status, body) =
        call(&gateway, "POST", "/v1/embeddings", serde_json::json!({"model": "m", "input": input})).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["data"].as_array().unwrap().len(), 3);
    assert_eq!(body["data"][2]["index"], 2);
    assert_eq!(body["usage"]["total_tokens"], 7);
}

fn base64_decode(text: &str) -> Vec<u8> {
    let value = |c: u8| match c {
        b'A'..=b'Z' => c - b'A',
        b'a'..=b'z' => c - b'a' + 26,
        b'0'..=b'9' => c - b'0' + 52,
        b'+' => 62,
        b'/' => 63,
        _ => panic!("not base64: {c}"),
    };
    let mut out = Vec::new();
    for chunk in text.as_bytes().chunks(4) {
        let n = chunk.iter().filter(|&&c| c != b'=').fold(0u32, |n, &c| n << 6 | u32::from(value(c)));
        let bits = 6 * chunk.iter().filter(|&&c| c != b'=').count();
        let n = n << (24 - bits);
        out.extend_from_slice(&n.to_be_bytes()[1..1 + bits / 8]);
    }
    out
}

#[tokio::test(start_paused = true)]
async fn dimensions_and_base64_are_honoured_as_openai_does() {
    let (gateway, _) = in_memory("org = { rpm = 6000 }");
    let ask = |format: &str| serde_json::json!({"model": "m", "input": ["a", "b"], "dimensions": 8, "encoding_format": format});
    let (status, floats) = call(&gateway, "POST", "/v1/embeddings", ask("float")).await;
    assert_eq!(status, StatusCode::OK);
    let (status, encoded) = call(&gateway, "POST", "/v1/embeddings", ask("base64")).await;
    assert_eq!(status, StatusCode::OK);
    for i in 0..2 {
        let floats: Vec<f32> =
            floats["data"][i]["embedding"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32).collect();
        assert_eq!(floats.len(), 8);
        let bytes = base64_decode(encoded["data"][i]["embedding"].as_str().unwrap());
        let decoded: Vec<f32> = bytes.chunks(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
        assert_eq!(decoded, floats, "base64 of the little-endian f32s");
    }
}

#[tokio::test(start_paused = true)]
async fn bad_inputs_are_explained_in_the_apis_terms() {
    let (gateway, stats) = in_memory("org = { rpm = 6000 }");
    let inputs = [
        serde_json::json!([1, "a"]),
        serde_json::json!({"text": "a"}),
        serde_json::json!([[]]),
        serde_json::json!([-1]),
        serde_json::json!([1.5]),
        serde_json::json!(true),
        serde_json::json!(""),
        serde_json::json!([["a"]]),
        // Beyond any encoding's ids.
        serde_json::json!([1_u64 << 40]),
    ];
    for input in inputs {
        let (status, body) =
            call(&gateway, "POST", "/v1/embeddings", serde_json::json!({"model": "m", "input": input})).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{input}: {body}");
        assert_eq!(body["error"]["param"], "input", "{body}");
        let message = body["error"]["message"].as_str().unwrap();
        for rust in ["enum", "untagged", "Vec<", "u64", "i64", "struct", "variant"] {
            assert!(!message.contains(rust), "{input}: {message:?} speaks Rust ({rust})");
        }
    }
    let (status, body) = call(&gateway, "POST", "/v1/embeddings", serde_json::json!({"input": "a"})).await;
    assert_eq!((status, &body["error"]["param"]), (StatusCode::BAD_REQUEST, &serde_json::json!("model")));
    let (status, body) =
        call(&gateway, "POST", "/v1/embeddings", serde_json::json!({"model": "other", "input": "a"})).await;
    assert_eq!((status, &body["error"]["code"]), (StatusCode::NOT_FOUND, &serde_json::json!("model_not_found")));
    let (status, body) = call(
        &gateway,
        "POST",
        "/v1/embeddings",
        serde_json::json!({"model": "m", "input": "a", "encoding_format": "hex"}),
    )
    .await;
    assert_eq!((status, &body["error"]["param"]), (StatusCode::BAD_REQUEST, &serde_json::json!("encoding_format")));
    assert_eq!(stats.served.load(Ordering::Relaxed), 0, "nothing bad reached the upstream");
}

/// Each endpoint serves the models of its kind; too many tokens is OpenAI's `400
/// context_length_exceeded` naming the parameter that asked for them.
#[tokio::test(start_paused = true)]
async fn models_are_served_by_kind_and_too_many_tokens_names_the_cause() {
    let text = config_text("", "org = { rpm = 6000 }", "http://127.0.0.1:9")
        .replace("chat_models = [\"m\"]", "chat_models = [\"c\"]")
        .replace("encodings = { m = \"cl100k_base\" }", "encodings = { m = \"cl100k_base\", c = \"o200k_base\" }");
    let config = parse_config(&text);
    let (router, stats) = upstream::router(&config.accounts, config.upstream, &config.gateway.encodings);
    let gateway = Gateway::new(&config, in_process(router)).unwrap();
    let chat = |model: &str, max_tokens: u64, content: &str| serde_json::json!({"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens});
    let (status, body) = call(&gateway, "POST", "/v1/chat/completions", chat("m", 5, "hi")).await;
    assert_eq!((status, &body["error"]["code"]), (StatusCode::NOT_FOUND, &serde_json::json!("model_not_found")));
    assert_eq!(body["error"]["param"], "model");
    assert!(body["error"]["message"].as_str().unwrap().contains("is not a chat model"), "{body}");
    let (status, body) =
        call(&gateway, "POST", "/v1/embeddings", serde_json::json!({"model": "c", "input": "a"})).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert!(body["error"]["message"].as_str().unwrap().contains("is not an embedding model"), "{body}");
    assert_eq!(call(&gateway, "POST", "/v1/chat/completions", chat("c", 5, "hi")).await.0, StatusCode::OK);

    // max_request_tokens is 100: a short prompt asking for 1,000 more is max_tokens' fault,
    // a prompt of its own too long the messages'.
    let (status, body) = call(&gateway, "POST", "/v1/chat/completions", chat("c", 1000, "hi")).await;
    assert_eq!((status, &body["error"]["param"]), (StatusCode::BAD_REQUEST, &serde_json::json!("max_tokens")));
    assert_eq!(body["error"]["code"], "context_length_exceeded");
    let long = "word ".repeat(200);
    let (status, body) = call(&gateway, "POST", "/v1/chat/completions", chat("c", 1, &long)).await;
    assert_eq!((status, &body["error"]["param"]), (StatusCode::BAD_REQUEST, &serde_json::json!("messages")));
    assert_eq!(body["error"]["code"], "context_length_exceeded");
    assert_eq!(stats.served.load(Ordering::Relaxed), 1, "only the good request reached the upstream");

    // The old single list is named, with what replaced it.
    let old = config_text("", "org = { rpm = 6000 }", "http://127.0.0.1:9")
        .replace("chat_models = [\"m\"]", "models = [\"m\"]");
    let err = Config::parse(&old, Some("old.toml")).unwrap_err();
    assert_eq!(err.field, "gateway.models", "{err}");
    assert!(err.message.contains("embedding_models") && err.message.contains("chat_models"), "{err}");
}

/// A chat request reserves every answer it asks for (`n`): `max_tokens` each, else
/// `gateway.default_max_tokens` each, else whatever `max_request_tokens` leaves of its
/// prompt; the mock bills each answer, and the reserve is exact when the answers fill it.
#[tokio::test(start_paused = true)]
async fn a_chat_reserves_every_answer_it_asks_for() {
    let charged = |gateway_settings: &'static str, extra: serde_json::Value| async move {
        let text = config_text(gateway_settings, "user = { tpm = 6000, tpm_burst = 1000 }", "http://127.0.0.1:9");
        let config = parse_config(&text);
        let (router, _) = upstream::router(&config.accounts, config.upstream, &config.gateway.encodings);
        let gateway = Gateway::new(&config, in_process(router)).unwrap();
        let mut body = serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "hello there"}]});
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        let request = || {
            Request::post("/v1/chat/completions")
                .header("authorization", "Bearer sk-acme-alice")
                .body(Body::from(body.to_string()))
                .unwrap()
        };
        let answer = gateway.router.clone().oneshot(request()).await.unwrap();
        assert_eq!(answer.status(), StatusCode::OK);
        let remaining = |a: &Response<Body>| -> u64 {
            a.headers()["x-ratelimit-remaining-tokens"].to_str().unwrap().parse().unwrap()
        };
        let reserved = 1000 - remaining(&answer);
        let billed: serde_json::Value =
            serde_json::from_slice(&answer.into_body().collect().await.unwrap().to_bytes()).unwrap();
        (reserved, billed["usage"]["total_tokens"].as_u64().unwrap(), billed["choices"].as_array().unwrap().len())
    };
    // "hello there" is 9 tokens of prompt with its framing; each mock answer, "the mock
    // says ...", 3 tokens within max_tokens = 3.
    assert_eq!(charged("", serde_json::json!({"max_tokens": 3, "n": 3})).await, (9 + 3 * 3, 9 + 3 * 3, 3));
    assert_eq!(charged("default_max_tokens = 20", serde_json::json!({})).await.0, 9 + 20);
    assert_eq!(charged("default_max_tokens = 20", serde_json::json!({"n": 2})).await.0, 9 + 2 * 20);
    // max_request_tokens (100) less the prompt, shared by the two answers.
    assert_eq!(charged("", serde_json::json!({"n": 2})).await.0, 9 + 2 * 45);
    // An image is charged gateway.image_tokens, by the gateway and the mock alike.
    let with_image = serde_json::json!({
        "max_tokens": 3,
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "hello there"},
            {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
        ]}],
    });
    assert_eq!(charged("image_tokens = 40", with_image).await, (9 + 40 + 3, 9 + 40 + 3, 1));
}

#[tokio::test]
async fn every_error_has_a_json_body_and_health_answers() {
    let (running, _) = gateway_with("", "org = { rpm = 6000 }").await;
    let addr = running.addr;
    assert_openai_error(&http(addr, "GET", "/nope", None, None).await, 404, "not_found");
    assert_openai_error(&http(addr, "GET", "/v1/embeddings", None, None).await, 405, "method_not_allowed");
    assert_openai_error(&http(addr, "DELETE", "/healthz", None, None).await, 405, "method_not_allowed");
    assert_openai_error(&http(addr, "POST", "/v1/embeddings", None, Some("{}")).await, 401, "invalid_api_key");
    assert_openai_error(
        &http(addr, "POST", "/v1/embeddings", Some("sk-acme-alice"), Some("{")).await,
        400,
        "invalid_json",
    );

    let health = http(addr, "GET", "/healthz", None, None).await;
    assert_eq!((health.status, health.json()["status"].as_str()), (200, Some("ok")));
    let ready = http(addr, "GET", "/readyz", None, None).await;
    assert_eq!(ready.status, 200, "{}", ready.body);
    assert_eq!(ready.json()["usable_accounts"], 1);
    // The model list wants a key, as OpenAI's does.
    assert_openai_error(&http(addr, "GET", "/v1/models", None, None).await, 401, "invalid_api_key");
    let models = http(addr, "GET", "/v1/models", Some("sk-acme-alice"), None).await;
    assert_eq!(models.status, 200);
    assert_eq!(models.json()["data"].as_array().unwrap().len(), 1, "m serves both kinds: listed once");
    assert_eq!(models.json()["data"][0]["id"], "m");
    assert_eq!(models.json()["object"], "list");

    // Draining turns readiness off before anything else.
    running.gateway.health.start_draining();
    let ready = http(addr, "GET", "/readyz", None, None).await;
    assert_eq!((ready.status, ready.json()["draining"].as_bool()), (503, Some(true)));
    running.stop().await;
}

#[test]
fn the_service_keys_have_defaults_and_are_checked_with_their_line() {
    use std::time::Duration;
    let g = parse_config(&config_text("", "org = { rpm = 60 }", "http://127.0.0.1:9")).gateway;
    assert_eq!(
        (g.header_timeout, g.idle_timeout, g.body_timeout, g.shutdown_grace, g.upstream_timeout),
        (
            Duration::from_secs(10),
            Duration::from_secs(60),
            Duration::from_secs(30),
            Duration::from_secs(20),
            Duration::from_secs(30)
        )
    );
    assert_eq!(g.max_connections, 512);
    assert_eq!((g.body_min_rate, g.body_grace, g.uploads_per_tenant), (1024, Duration::from_secs(5), 8));
    let cases = [
        ("uploads_per_tenant = 0", "gateway.uploads_per_tenant", "at least 1"),
        ("body_grace = \"0s\"", "gateway.body_grace", "longer than zero"),
        ("header_timeout = \"0s\"", "gateway.header_timeout", "longer than zero"),
        ("idle_timeout = \"soon\"", "gateway.idle_timeout", ""),
        ("max_connections = 0", "gateway.max_connections", "at least 1"),
        ("on_upstream_timeout = \"maybe\"", "gateway.on_upstream_timeout", "\"keep\" or \"refund\""),
        ("backend_failure = \"pray\"", "gateway.backend_failure", "\"fail_closed\""),
    ];
    for (key, field, message) in cases {
        let text = config_text(key, "org = { rpm = 60 }", "http://127.0.0.1:9");
        let err = Config::parse(&text, Some("bad.toml")).unwrap_err();
        assert_eq!(err.field, field, "{err}");
        assert!(err.message.contains(message), "{err}");
        let line = text.lines().position(|l| l == key).unwrap() + 1;
        assert_eq!(err.line, Some(line), "{err}");
    }
}

#[test]
fn duplicate_configuration_keys_are_named() {
    let text = config_text("max_wait = \"1s\"", "org = { rpm = 60 }", "http://127.0.0.1:9");
    let err = Config::parse(&text, Some("dup.toml")).unwrap_err();
    assert_eq!(err.field, "gateway.max_wait", "{err}");
    assert!(err.to_string().contains("`gateway.max_wait` is set twice"), "{err}");
    let text =
        config_text("", "org = { rpm = 60 }", "http://127.0.0.1:9").replace("weight = 2", "weight = 2\nweight = 3");
    let err = Config::parse(&text, Some("dup.toml")).unwrap_err();
    assert_eq!(err.field, "tenant.weight", "{err}");
    assert!(err.line.is_some(), "{err}");
}

/// A key may be given by its SHA-256 digest; a digest that is not one, or a key given both
/// ways, or neither, is named with its line.
#[test]
fn keys_given_by_digest_are_checked_with_their_line() {
    use embedding_gateway::config::KeyDigest;
    let text = config_text("", "org = { rpm = 60 }", "http://127.0.0.1:9");
    let alice = "key = \"sk-acme-alice\"";
    let digest = KeyDigest::of("sk-acme-alice");
    let by_digest = text.replace(alice, &format!("key_sha256 = \"{}\"", digest.to_hex().to_uppercase()));
    let config = parse_config(&by_digest);
    assert_eq!(config.tenants[0].keys[0].digest, digest, "upper-case digits read as well");
    let cases = [
        (format!("key_sha256 = \"{}\"", &digest.to_hex()[..63]), "tenant[0].key[0].key_sha256", "64 hexadecimal"),
        ("key_sha256 = \"zz\"".to_owned(), "tenant[0].key[0].key_sha256", "64 hexadecimal"),
        (format!("{alice}\nkey_sha256 = \"{}\"", digest.to_hex()), "tenant[0].key[0].key_sha256", "not both"),
        ("user2 = \"x\"".to_owned(), "tenant[0].key[0].user2", "key_sha256"),
    ];
    for (line, field, message) in cases {
        let text = text.replace(alice, &line);
        let err = Config::parse(&text, Some("keys.toml")).unwrap_err();
        assert_eq!(err.field, field, "{err}");
        assert!(err.message.contains(message), "{err}");
        assert!(err.line.is_some(), "{err}");
    }
    // The same key twice, once by digest: one owner.
    let twice = text
        .replace("key = \"sk-globex-bob\"", &format!("key_sha256 = \"{}\"", KeyDigest::of("sk-acme-alice").to_hex()));
    let err = Config::parse(&twice, Some("keys.toml")).unwrap_err();
    assert!(err.message.contains("already belongs to tenant \"acme\""), "{err}");
}
