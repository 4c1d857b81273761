//! `GET /metrics` after some traffic: every family is there, in Prometheus' text format,
//! with the gateway's layer names and only bounded labels.
//!
//! The recorder is global to the test process, so these tests check what is present,
//! never exact counts (other tests of this binary add to them).

mod common;

use std::sync::Arc;

use axum::body::Body;
use common::config_text;
use embedding_gateway::config::Config;
use embedding_gateway::gateway::{Gateway, Sharing, in_process};
use embedding_gateway::upstream;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use tower::ServiceExt;

fn parse_config(text: &str) -> Config {
    Config::parse(text, Some("test.toml")).unwrap_or_else(|e| panic!("{e}"))
}

/// The test configuration with a small upstream account (two requests a second, so that
/// requests queue for their fair turn) and a plan of two requests per minute per user.
fn config() -> Config {
    let text = config_text("", "user = { rpm = 2, rpm_burst = 2 }", "http://127.0.0.1:9")
        .replace("rpm = 60000\ntpm = 6000000", "rpm = 120\ntpm = 6000000");
    parse_config(&text)
}

async fn embed(gateway: &Gateway, key: &str) -> StatusCode {
    let req = Request::post("/v1/embeddings")
        .header("authorization", format!("Bearer {key}"))
        .header("content-type", "application/json")
        .body(Body::from(serde_json::json!({ "model": "m", "input": "hello" }).to_string()))
        .unwrap();
    let response = gateway.router.clone().oneshot(req).await.unwrap();
    let status = response.status();
    let _ = response.into_body().collect().await.unwrap();
    status
}

async fn scrape(gateway: &Gateway) -> String {
    let req = Request::get("/metrics").body(Body::empty()).unwrap();
    let response = gateway.router.clone().oneshot(req).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let content_type = response.headers()["content-type"].to_str().unwrap().to_owned();
    assert!(content_type.starts_with("text/plain; version=0.0.4"), "{content_type}");
    String::from_utf8(response.into_body().collect().await.unwrap().to_bytes().to_vec()).unwrap()
}

/// The lines of `text` for the metric `name` (samples, not comments) that carry every
/// label of `labels`.
fn samples<'a>(text: &'a str, name: &str, labels: &[&str]) -> Vec<&'a str> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| l.split(['{', ' ']).next() == Some(name))
        .filter(|l| labels.iter().all(|label| l.contains(label)))
        .collect()
}

/// The recorder is the process's: the tests take turns, so that one's requests in flight
/// are not in the other's gauges.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
fn metrics_show_every_family_after_traffic() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().start_paused(true).build().unwrap();
    runtime.block_on(every_family_after_traffic());
}

async fn every_family_after_traffic() {
    let config = config();
    let (router, _stats) = upstream::router(&config.accounts, config.upstream, &config.gateway.encodings);
    let gateway = Gateway::new(&config, in_process(router)).unwrap();

    // Two tenants at once: the account's mirror admits one, the others wait their turn.
    let mut calls = Vec::new();
    for key in ["sk-acme-alice", "sk-globex-bob", "sk-acme-alice"] {
        let gateway = gateway.clone();
        calls.push(tokio::spawn(async move { embed(&gateway, key).await }));
    }
    for call in calls {
        assert_eq!(call.await.unwrap(), StatusCode::OK);
    }
    // alice's plan allows two a minute: the third is refused.
    assert_eq!(embed(&gateway, "sk-acme-alice").await, StatusCode::TOO_MANY_REQUESTS);
    // A guessed key, an unknown path.
    assert_eq!(embed(&gateway, "sk-guess").await, StatusCode::UNAUTHORIZED);
    let req = Request::get("/v1/nothing").body(Body::empty()).unwrap();
    assert_eq!(gateway.router.clone().oneshot(req).await.unwrap().status(), StatusCode::NOT_FOUND);

    let text = scrape(&gateway).await;
    let requests = "rate_limiting_requests";
    for (name, labels) in [
        (requests, &[r#"layer="plan""#, r#"result="admitted""#][..]),
        (requests, &[r#"layer="upstream""#, r#"result="admitted""#]),
        (
            requests,
            &[
                r#"layer="plan""#,
                r#"result="refused""#,
                r#"reason="rate_limited""#,
                r#"limit="user.rpm""#,
                r#"tier="user""#,
            ],
        ),
        ("rate_limiting_request_time_in_queue_bucket", &[r#"layer="upstream""#, r#"result="admitted""#]),
        ("rate_limiting_request_time_in_queue_count", &[r#"layer="upstream""#]),
        ("rate_limiting_request_lease_duration_bucket", &[r#"layer="plan""#]),
        ("rate_limiting_request_lease_duration_count", &[r#"layer="upstream""#]),
        ("rate_limiting_queued_requests", &[r#"layer="upstream""#]),
        ("rate_limiting_queued_requests", &[r#"layer="upstream""#, r#"tenant="globex""#]),
        ("rate_limiting_active_request_leases", &[r#"layer="plan""#]),
        ("rate_limiting_pool_selections", &[r#"member="primary""#]),
        ("rate_limiting_upstream_responses", &[r#"member="primary""#, r#"result="ok""#]),
        ("gateway_responses", &[r#"status="200""#]),
        ("gateway_responses", &[r#"status="401""#, r#"code="invalid_api_key""#]),
        ("gateway_responses", &[r#"status="404""#, r#"code="not_found""#]),
        // A limit layer's refusal is counted with the code its answer gives.
        ("gateway_responses", &[r#"status="429""#, r#"code="rate_limit_exceeded""#]),
    ] {
        assert!(!samples(&text, name, labels).is_empty(), "no {name} with {labels:?} in\n{text}");
    }
    // Queue depth by tenant only for configured tenants; nothing else carries a tenant.
    for line in text.lines().filter(|l| l.contains("tenant=")) {
        assert!(line.contains(r#"tenant="acme""#) || line.contains(r#"tenant="globex""#), "{line}");
    }
    // Nothing waits or holds a permit now.
    for line in samples(&text, "rate_limiting_queued_requests", &[]) {
        assert!(line.ends_with(" 0"), "{line}");
    }
}

/// With Redis, the backends' families (the limits' and the upstream accounts' store) are
/// there from the start (at zero until a failure).
#[test]
fn metrics_show_the_redis_backend_families() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let Some(server) = tower_limits_redis::test_support::own_redis_for("metrics_show_the_redis_backend_families")
    else {
        return;
    };
    let server = Arc::new(server);
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    runtime.block_on(async {
        let config = parse_config(&config_text("", "user = { rpm = 600 }", "http://127.0.0.1:9"));
        let (router, _stats) = upstream::router(&config.accounts, config.upstream, &config.gateway.encodings);
        let connection = tower_limits_redis::RedisConnection::connect(&server.url()).await.unwrap();
        let sharing = Sharing::Redis { connection, replicas: 1, namespace: format!("metrics-{}", std::process::id()) };
        let gateway = Gateway::with_sharing(&config, in_process(router), &sharing).unwrap();
        assert_eq!(embed(&gateway, "sk-acme-alice").await, StatusCode::OK);
        let text = scrape(&gateway).await;
        for (name, label) in [
            ("rate_limiting_backend_failures", r#"kind="timeout""#),
            ("rate_limiting_backend_failures", r#"kind="error""#),
            ("rate_limiting_backend_circuit_opened", r#"backend="redis""#),
            ("rate_limiting_backend_unavailable", r#"decision="fail_open""#),
            ("rate_limiting_backend_unavailable", r#"decision="fail_closed""#),
            ("rate_limiting_backend_failures", r#"backend="redis_accounts""#),
            ("rate_limiting_backend_circuit_opened", r#"backend="redis_accounts""#),
        ] {
            assert!(!samples(&text, name, &[label]).is_empty(), "no {name} with {label} in\n{text}");
        }
    });
}

/// Budgets: what they counted, by tenant and currency, and their refusals by code.
#[tokio::test(start_paused = true)]
async fn budgets_report_the_spend_and_their_refusals() {
    let text = config_text("", "user = { budget = \"2 USD / day\" }", "http://127.0.0.1:9")
        + "\n[price.m]\ncurrency = \"USD\"\ninput = 1000000\n";
    let config = parse_config(&text);
    let (router, _) = upstream::router(&config.accounts, config.upstream, &config.gateway.encodings);
    let gateway = Gateway::new(&config, in_process(router)).unwrap();
    for _ in 0..3 {
        embed(&gateway, "sk-acme-alice").await;
    }
    let page = scrape(&gateway).await;
    let spend = samples(&page, "gateway_spend_micros", &[r#"tenant="acme""#, r#"currency="USD""#]);
    assert!(!spend.is_empty(), "{page}");
    assert!(
        !samples(&page, "gateway_responses", &[r#"status="429""#, r#"code="budget_exceeded""#]).is_empty(),
        "{page}"
    );
}
