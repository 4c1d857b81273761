//! `POST /v1/chat/completions` with `stream: true`: what a request holds (its tenant's
//! concurrency, its tokens' estimate, its turn in the fair queue) lives as long as the
//! stream, and is settled from the stream's final `usage` chunk. On paused time, with an
//! upstream whose stream the test writes chunk by chunk.

mod common;

use std::sync::atomic::Ordering;

use axum::body::{Body, Bytes};
use common::{chat, config_text, content, scripted, usage_chunk};
use embedding_gateway::api::SSE_DONE;
use embedding_gateway::config::Config;
use embedding_gateway::gateway::{Gateway, in_process};
use embedding_gateway::upstream;
use http::{Response, StatusCode};
use http_body_util::BodyExt;
use tower::ServiceExt;

fn config(plan: &str) -> Config {
    Config::parse(&config_text("", plan, "http://127.0.0.1:9"), Some("test.toml")).unwrap()
}

fn usage(total: u64) -> Bytes {
    usage_chunk(1, total - 1)
}

async fn next_chunk(body: &mut Body) -> Bytes {
    loop {
        let frame = body.frame().await.expect("a frame").expect("no error");
        if let Ok(data) = frame.into_data() {
            return data;
        }
    }
}

fn remaining_tokens(r: &Response<Body>) -> u64 {
    r.headers()["x-ratelimit-remaining-tokens"].to_str().unwrap().parse().unwrap()
}

#[tokio::test(start_paused = true)]
async fn a_stream_holds_its_concurrency_until_it_ends() {
    let (transport, mut streams) = scripted();
    let gateway = Gateway::new(&config("org = { concurrency = 1 }"), transport).unwrap();
    let answer = gateway.router.clone().oneshot(chat("hello", 8, true)).await.unwrap();
    assert_eq!(answer.status(), StatusCode::OK);
    assert_eq!(answer.headers()["content-type"], "text/event-stream");
    let upstream = streams.recv().await.unwrap();
    let mut body = answer.into_body();

    // The head is out, the stream goes on: the tenant's only slot is still taken.
    upstream.send(content("Hi")).await.unwrap();
    assert_eq!(next_chunk(&mut body).await, content("Hi"));
    let busy = gateway.router.clone().oneshot(chat("again", 8, false)).await.unwrap();
    assert_eq!(busy.status(), StatusCode::TOO_MANY_REQUESTS);
    let error: serde_json::Value =
        serde_json::from_slice(&busy.into_body().collect().await.unwrap().to_bytes()).unwrap();
    assert_eq!(error["error"]["code"], "concurrency_limited");

    // The stream ends: the slot comes back.
    upstream.send(usage(9)).await.unwrap();
    upstream.send(Bytes::from_static(SSE_DONE)).await.unwrap();
    drop(upstream);
    assert_eq!(next_chunk(&mut body).await, usage(9));
    assert_eq!(next_chunk(&mut body).await, Bytes::from_static(SSE_DONE));
    assert!(body.frame().await.is_none(), "the stream ended");
    let next = gateway.router.clone().oneshot(chat("again", 8, true)).await.unwrap();
    assert_eq!(next.status(), StatusCode::OK);
    drop(streams.recv().await.unwrap());
}

#[tokio::test(start_paused = true)]
async fn a_client_that_leaves_mid_stream_releases_its_slot() {
    let (transport, mut streams) = scripted();
    let gateway = Gateway::new(&config("org = { concurrency = 1 }"), transport).unwrap();
    let answer = gateway.router.clone().oneshot(chat("hello", 8, true)).await.unwrap();
    let upstream = streams.recv().await.unwrap();
    let mut body = answer.into_body();
    upstream.send(content("Hi")).await.unwrap();
    next_chunk(&mut body).await;
    assert_eq!(gateway.router.clone().oneshot(chat("busy", 8, true)).await.unwrap().status(), 429);

    // The client goes away: the stream is dropped all the way to the upstream.
    drop(body);
    upstream.closed().await;
    let next = gateway.router.clone().oneshot(chat("again", 8, true)).await.unwrap();
    assert_eq!(next.status(), StatusCode::OK, "the slot came back when the client left");
}

#[tokio::test(start_paused = true)]
async fn a_stream_settles_the_tokens_to_its_final_usage() {
    // 100 tokens a second at most: nothing visible comes back on paused time.
    let (transport, mut streams) = scripted();
    let gateway = Gateway::new(&config("user = { tpm = 6000, tpm_burst = 1000 }"), transport).unwrap();
    // "a a a a a a a a a a": 10 tokens of text; with the message's framing (3), its role
    // (1) and the answer's priming (3), 17 of prompt; at most 50 of answer: 67 charged.
    let prompt = format!("a{}", " a".repeat(9));

    let first = gateway.router.clone().oneshot(chat(&prompt, 50, true)).await.unwrap();
    assert_eq!(remaining_tokens(&first), 1000 - 67, "charged the estimate at admission");
    let upstream = streams.recv().await.unwrap();
    let mut body = first.into_body();
    upstream.send(content("Hi")).await.unwrap();
    upstream.send(usage(15)).await.unwrap();
    upstream.send(Bytes::from_static(SSE_DONE)).await.unwrap();
    drop(upstream);
    while body.frame().await.is_some() {}

    // Settled to the reported 15: 52 came back.
    let second = gateway.router.clone().oneshot(chat(&prompt, 50, true)).await.unwrap();
    assert_eq!(remaining_tokens(&second), 1000 - 15 - 67);
    let upstream = streams.recv().await.unwrap();
    let mut body = second.into_body();
    // A stream that ends without a usage chunk keeps its estimate.
    upstream.send(content("Hi")).await.unwrap();
    upstream.send(Bytes::from_static(SSE_DONE)).await.unwrap();
    drop(upstream);
    while body.frame().await.is_some() {}

    let third = gateway.router.clone().oneshot(chat(&prompt, 50, true)).await.unwrap();
    assert_eq!(remaining_tokens(&third), 1000 - 15 - 67 - 67);
    drop(third);
}

/// The mock upstream streams chunks, a final usage chunk when asked, and `[DONE]`; the
/// gateway passes them on and settles the account's and the tenant's tokens to it.
#[tokio::test(start_paused = true)]
async fn the_mock_upstream_streams_chunks_usage_and_done() {
    let config = config("user = { tpm = 6000, tpm_burst = 1000 }");
    let (router, stats) = upstream::router(&config.accounts, config.upstream, &config.gateway.encodings);
    let gateway = Gateway::new(&config, in_process(router)).unwrap();
    let answer = gateway.router.clone().oneshot(chat("hello there", 3, true)).await.unwrap();
    assert_eq!(answer.status(), StatusCode::OK);
    let text = String::from_utf8(answer.into_body().collect().await.unwrap().to_bytes().to_vec()).unwrap();
    let events: Vec<&str> = text.split("\n\n").filter(|e| !e.is_empty()).collect();
    assert_eq!(events.last(), Some(&"data: [DONE]"), "{text}");
    let chunks: Vec<serde_json::Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e.strip_prefix("data: ").unwrap()).unwrap())
        .collect();
    let words: String = chunks.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect();
    assert_eq!(words, "the mock says");
    // "hello there": 2 tokens of text, 9 of prompt with its framing; 3 of answer.
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"], serde_json::json!([]));
    assert_eq!(last["usage"]["prompt_tokens"], 9);
    assert_eq!(last["usage"]["total_tokens"], 12);
    assert_eq!(stats.tokens.load(Ordering::Relaxed), 12);

    // Settled to 12 (the estimate was 9 + 3 = 12 too), then a whole answer.
    let whole = gateway.router.clone().oneshot(chat("hello there", 3, false)).await.unwrap();
    assert_eq!(remaining_tokens(&whole), 1000 - 12 - 12);
    let body: serde_json::Value =
        serde_json::from_slice(&whole.into_body().collect().await.unwrap().to_bytes()).unwrap();
    assert_eq!(body["object"], "chat.completion");
    assert_eq!(body["choices"][0]["message"]["content"], "the mock says");
    assert_eq!(body["usage"]["total_tokens"], 12);
}
