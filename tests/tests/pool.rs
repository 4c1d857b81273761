//! LimitPool through the layer: the chosen account reaches the inner service, exhausted
//! accounts make requests wait for the first to free, and upstream refusals bench an
//! account.

use std::convert::Infallible;
use std::time::Duration;

use http::{Request, Response, StatusCode};
use tower::{ServiceBuilder, ServiceExt};
use tower_limits::extract::InsertChosen;
use tower_limits::http::{HttpAnswer, upstream_report};
use tower_limits::{Chosen, LimitPolicy, LimitPool, LimitSet, LimitSetLayer, LimitSetPolicy, Rate, Selection};

fn account(rpm: u64) -> LimitSet {
    LimitSet::new(LimitSetPolicy::new().limit(LimitPolicy::gcra("rpm", Rate::per_minute(rpm), 1))).unwrap()
}

fn pool() -> LimitPool<&'static str> {
    LimitPool::builder(Selection::RoundRobin)
        .member("primary", account(60), "sk-primary")
        .member("secondary", account(30), "sk-secondary")
        .build()
        .unwrap()
}

fn upstream() -> impl tower::Service<Request<String>, Response = Response<String>, Error = Infallible, Future: Send>
+ Clone
+ Send
+ 'static {
    tower::service_fn(|req: Request<String>| async move {
        let chosen = req.extensions().get::<Chosen<&'static str>>().expect("the pool says which account");
        Ok::<_, Infallible>(Response::new(chosen.config.to_string()))
    })
}

#[tokio::test(start_paused = true)]
async fn the_chosen_account_reaches_the_inner_service() {
    let layer = LimitSetLayer::with_backend(pool()).annotate(InsertChosen).reject_with(HttpAnswer::new());
    let svc = ServiceBuilder::new().layer(layer).service(upstream());
    let a = svc.clone().oneshot(Request::new(String::new())).await.unwrap();
    let b = svc.clone().oneshot(Request::new(String::new())).await.unwrap();
    let mut bodies = vec![a.into_body(), b.into_body()];
    bodies.sort();
    assert_eq!(bodies, ["sk-primary", "sk-secondary"]);
    let refused = svc.oneshot(Request::new(String::new())).await.unwrap();
    assert_eq!(
        refused.status(),
        StatusCode::TOO_MANY_REQUESTS,
        "every account is out: a rate limit, paced by Retry-After"
    );
    assert_eq!(refused.headers()["retry-after"], "1", "the primary frees first, in one second");
}

#[tokio::test(start_paused = true)]
async fn waiting_requests_take_the_first_account_to_free() {
    let layer = LimitSetLayer::with_backend(pool())
        .annotate(InsertChosen)
        .wait(Duration::from_secs(5))
        .reject_with(HttpAnswer::new());
    let svc = ServiceBuilder::new().layer(layer).service(upstream());
    let start = tokio::time::Instant::now();
    for _ in 0..2 {
        svc.clone().oneshot(Request::new(String::new())).await.unwrap();
    }
    let third = svc.clone().oneshot(Request::new(String::new())).await.unwrap();
    assert_eq!(third.into_body(), "sk-primary");
    assert_eq!(start.elapsed(), Duration::from_secs(1));
    let fourth = svc.oneshot(Request::new(String::new())).await.unwrap();
    assert_eq!(fourth.into_body(), "sk-secondary", "the secondary frees at 2s, before the primary again");
    assert_eq!(start.elapsed(), Duration::from_secs(2));
}

#[tokio::test(start_paused = true)]
async fn an_upstream_refusal_benches_the_account() {
    let pool = pool();
    let layer = LimitSetLayer::with_backend(pool.clone()).annotate(InsertChosen).reject_with(HttpAnswer::new());
    let now = layer.now();
    let svc = ServiceBuilder::new().layer(layer).service(upstream());
    // The primary's upstream answers 429 with Retry-After: 30.
    let mut headers = http::HeaderMap::new();
    headers.insert("retry-after", http::HeaderValue::from_static("30"));
    let report = upstream_report(StatusCode::TOO_MANY_REQUESTS, &headers);
    pool.observe(pool.index_of("primary").unwrap(), &report, now);
    let first = svc.clone().oneshot(Request::new(String::new())).await.unwrap();
    assert_eq!(first.into_body(), "sk-secondary");
    let refused = svc.oneshot(Request::new(String::new())).await.unwrap();
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(refused.headers()["retry-after"], "2", "the secondary frees before the primary's bench ends");
}
