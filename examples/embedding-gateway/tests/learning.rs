//! The accounts' limits learned from the upstream: an account whose real quota is half
//! the declared one, or double it, on paused time. The mock upstream enforces the real
//! quota and states it in `x-ratelimit-limit-*`, as providers do.

mod common;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::body::Body;
use common::config_text;
use embedding_gateway::config::Config;
use embedding_gateway::gateway::{Gateway, in_process};
use embedding_gateway::upstream::{self, UpstreamStats};
use http::{Request, StatusCode};
use tokio::time::Instant;
use tower::ServiceExt;

/// A gateway whose one account is declared at 20 requests a second, in front of a mock
/// whose real quota is `real` requests a second; learning up to `ceiling` percent.
fn learning_gateway(real: u64, ceiling: u64) -> (Gateway, Arc<UpstreamStats>) {
    let text = config_text("", "org = { rpm = 6000000, concurrency = 64 }", "http://127.0.0.1:9")
        .replace("rpm = 60000\n", "rpm = 1200\n")
        .replace("jitter = \"100ms\"", &format!("jitter = \"100ms\"\nlearn_ceiling_percent = {ceiling}"));
    let config = Config::parse(&text, None).unwrap_or_else(|e| panic!("{e}"));
    let mut accounts = config.accounts.clone();
    accounts[0].rpm = real * 60;
    let (router, stats) = upstream::router(&accounts, config.upstream, &config.gateway.encodings);
    (Gateway::new(&config, in_process(router)).unwrap(), stats)
}

/// Eight clients calling back to back for `seconds` of paused time; the upstream's
/// answers served in the last `last` seconds.
async fn drive(gateway: &Gateway, stats: &UpstreamStats, seconds: u64, last: u64) -> u64 {
    drive_with(gateway, stats, seconds, last, "hello").await
}

/// [`drive`] with every input `input`.
async fn drive_with(gateway: &Gateway, stats: &UpstreamStats, seconds: u64, last: u64, input: &'static str) -> u64 {
    let start = Instant::now();
    let end = start + Duration::from_secs(seconds);
    let mut clients = tokio::task::JoinSet::new();
    for i in 0..8 {
        let router = gateway.router.clone();
        let key = if i % 2 == 0 { "sk-acme-alice" } else { "sk-globex-bob" };
        clients.spawn(async move {
            while Instant::now() < end {
                let req = Request::post("/v1/embeddings")
                    .header("authorization", format!("Bearer {key}"))
                    .header("content-type", "application/json")
                    .body(Body::from(serde_json::json!({ "model": "m", "input": input }).to_string()))
                    .unwrap();
                let status = router.clone().oneshot(req).await.unwrap().status();
                assert!(status == StatusCode::OK || status == StatusCode::SERVICE_UNAVAILABLE, "{status}");
            }
        });
    }
    tokio::time::sleep_until(end - Duration::from_secs(last)).await;
    let before = stats.served.load(Ordering::Relaxed);
    clients.join_all().await;
    stats.served.load(Ordering::Relaxed) - before
}

/// The mirror's steady pace, in requests a second, for a quota of `l` a 1 s window: its
/// burst is a tenth (at least one), its period the window plus 100 ms of jitter.
fn mirror_pace(l: u64) -> f64 {
    (l - (l / 10).max(1)) as f64 / 1.1
}

/// Declared 20 a second, really 10: the first answer states 10 and the mirror is rebuilt
/// at once. Only the calls admitted before that answer came back can meet a `429`; after
/// that the account is used at its mirror's pace for the real quota.
#[tokio::test(start_paused = true)]
async fn an_account_whose_real_quota_is_half_the_declared_one_is_learned_at_once() {
    let (gateway, stats) = learning_gateway(10, 100);
    let served = drive(&gateway, &stats, 8, 5).await;
    assert_eq!(gateway.learned_limits()[0].0, 10);
    assert!(stats.refused() <= 3, "{} upstream 429s", stats.refused());
    let pace = served as f64 / 5.0;
    assert!(pace >= 0.9 * mirror_pace(10) && pace <= 10.0, "{pace} a second");
}

/// Declared 20 a second, really 40, learning allowed up to three times the declared
/// quota: the mirror rises a quarter a second to the stated 40, never refused.
#[tokio::test(start_paused = true)]
async fn an_account_whose_real_quota_is_double_is_learned_within_seconds() {
    let (gateway, stats) = learning_gateway(40, 300);
    let served = drive(&gateway, &stats, 10, 4).await;
    assert_eq!(gateway.learned_limits()[0].0, 40);
    assert_eq!(stats.refused(), 0);
    let pace = served as f64 / 4.0;
    assert!(pace >= 0.9 * mirror_pace(40), "{pace} a second");
}

/// Without a ceiling above the declared quota, a higher stated limit is not followed;
/// with learning off, a lower one is not either, and the upstream refuses (8 times in
/// these 8 s, against none with learning).
#[tokio::test(start_paused = true)]
async fn the_ceiling_bounds_what_is_learned_and_zero_turns_learning_off() {
    let (gateway, stats) = learning_gateway(40, 100);
    drive(&gateway, &stats, 3, 1).await;
    assert_eq!(gateway.learned_limits()[0].0, 20);
    let (gateway, stats) = learning_gateway(10, 0);
    drive(&gateway, &stats, 8, 5).await;
    assert!(gateway.learned_limits().is_empty());
    assert!(stats.refused() > 3, "the declared quota overruns the real one: {} 429s", stats.refused());
}

/// An account of 2,000 tokens a second (its requests do not bind), saturated by requests
/// of 50 tokens from clients whose calls take 20 ms; at 3 s its real quota halves. The
/// calls the upstream counted over its last window were sent at the old pace, twice the
/// new quota: the rebuilt mirror is charged with them at its own pace and waits for the
/// upstream's window to drain, rather than sending its burst into it as soon as the
/// account's bench ends (2 upstream `429`s after the halving without that charge in
/// this test, 1 with it: the call that first meets the new quota).
#[tokio::test(start_paused = true)]
async fn a_quota_halved_under_load_is_not_overrun_while_the_upstream_window_drains() {
    let text = config_text("", "org = { rpm = 6000000, concurrency = 64 }", "http://127.0.0.1:9")
        .replace("rpm = 60000\n", "rpm = 600000\n")
        .replace("tpm = 6000000\n", "tpm = 120000\n")
        .replace("latency = \"0s\"", "latency = \"20ms\"");
    let config = Config::parse(&text, None).unwrap_or_else(|e| panic!("{e}"));
    let (router, stats) = upstream::router(&config.accounts, config.upstream, &config.gateway.encodings);
    let gateway = Gateway::new(&config, in_process(router)).unwrap();
    let changer = stats.clone();
    let change = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(3)).await;
        let before = changer.refused();
        changer.set_real_quota_percent(50);
        before
    });
    let input = "word word word word word word word word word word word word word word word word word word word word \
                 word word word word word word word word word word word word word word word word word word word word";
    drive_with(&gateway, &stats, 9, 4, input).await;
    let before = change.await.unwrap();
    assert_eq!(gateway.learned_limits()[0].1, 1_000);
    assert!(stats.refused() - before <= 1, "{} upstream 429s after the halving", stats.refused() - before);
}
