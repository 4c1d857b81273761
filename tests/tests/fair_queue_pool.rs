//! Laws 10 and 25: a `FairQueueLayer` in front of a `LimitPool`: the account the pool
//! chose reaches the inner service (`annotate`), whether the request passed at once or
//! waited its turn, and the real usage settles the pool's grant (`usage`), letting the
//! request at the rate gate through as soon as a settle gives cost back. On paused tokio
//! time; no sleeps. Law numbers are those of `crates/tower-limits/docs/laws.md`.

use std::convert::Infallible;
use std::time::Duration;

use http::{Request, Response};
use tokio::sync::oneshot;
use tower::{ServiceBuilder, ServiceExt};
use tower_limits::core::fair_queue::FairQueueConfig;
use tower_limits::extract::{
    Cost, CostFromExtension, FromExtension, InsertChosen, UpstreamReports, Usage, UsageFromExtension,
};
use tower_limits::{Chosen, FairQueueLayer, LimitPolicy, LimitPool, LimitSet, LimitSetPolicy, Selection, TenantKey};
use tower_limits_tests::{Counting, quota};

/// An account allowing `burst` tokens at once, refilled at 60 a second.
fn account(burst: u64) -> LimitSet {
    LimitSet::new(
        LimitSetPolicy::new()
            .limit(LimitPolicy::gcra("tokens", quota(60, Duration::from_secs(1), burst)).counting_cost()),
    )
    .unwrap()
}

fn pool() -> LimitPool<&'static str> {
    LimitPool::builder(Selection::RoundRobin)
        .member("primary", account(100), "sk-primary")
        .member("secondary", account(100), "sk-secondary")
        .build()
        .unwrap()
}

fn tokens_left(pool: &LimitPool<&'static str>, member: usize) -> u64 {
    let now = tower_limits::Instant::from_nanos(0);
    pool.member_set(member).unwrap().peek(&TenantKey::global(), now)[0].snapshot.remaining
}

fn request(tenant: &str, cost: u64) -> Request<()> {
    let mut req = Request::new(());
    req.extensions_mut().insert(TenantKey::single(tenant).unwrap());
    req.extensions_mut().insert(Cost(cost));
    req
}

/// Answers with the chosen account's configuration, reporting `cost / 4` as the usage.
async fn upstream(req: Request<()>) -> Result<Response<String>, Infallible> {
    let chosen = req.extensions().get::<Chosen<&'static str>>().expect("the pool's choice");
    let used = req.extensions().get::<Cost>().map_or(0, |c| c.0 / 4);
    let mut response = Response::new(chosen.config.to_string());
    response.extensions_mut().insert(Usage(used));
    Ok(response)
}

#[tokio::test(start_paused = true)]
async fn the_chosen_account_reaches_the_inner_service_and_the_usage_settles() {
    let pool = pool();
    let fair = FairQueueLayer::rate(FairQueueConfig::new(), pool.clone())
        .unwrap()
        .key(FromExtension::<TenantKey>::new())
        .cost(CostFromExtension)
        .annotate(InsertChosen)
        .usage(UsageFromExtension);
    let svc = ServiceBuilder::new().layer(fair).service_fn(upstream);
    let first = svc.clone().oneshot(request("acme", 80)).await.unwrap();
    let second = svc.clone().oneshot(request("acme", 80)).await.unwrap();
    let mut bodies = vec![first.into_body(), second.into_body()];
    bodies.sort();
    assert_eq!(bodies, ["sk-primary", "sk-secondary"]);
    // Each account charged 80 and was settled to 20.
    assert_eq!((tokens_left(&pool, 0), tokens_left(&pool, 1)), (80, 80));
}

#[tokio::test(start_paused = true)]
async fn a_request_admitted_after_waiting_gets_the_account_too() {
    let pool = LimitPool::builder(Selection::RoundRobin).member("only", account(100), "sk-only").build().unwrap();
    let fair = FairQueueLayer::rate(FairQueueConfig::new(), pool)
        .unwrap()
        .key(FromExtension::<TenantKey>::new())
        .cost(CostFromExtension)
        .annotate(InsertChosen);
    let svc = ServiceBuilder::new().layer(fair).service_fn(upstream);
    let start = tokio::time::Instant::now();
    assert_eq!(svc.clone().oneshot(request("acme", 100)).await.unwrap().into_body(), "sk-only");
    // The account is empty: this one waits a second at the gate, then is annotated.
    assert_eq!(svc.oneshot(request("globex", 60)).await.unwrap().into_body(), "sk-only");
    // Tokio's timer rounds up to the millisecond.
    let waited = start.elapsed();
    assert!(waited >= Duration::from_secs(1) && waited <= Duration::from_millis(1001), "{waited:?}");
}

/// The first answer's hold: whoever takes it first waits until the test lets it go.
#[derive(Clone)]
struct HoldFirst(std::sync::Arc<std::sync::Mutex<Option<oneshot::Receiver<()>>>>);

impl HoldFirst {
    /// The sender that lets the first answer go, and the hold.
    fn new() -> (oneshot::Sender<()>, HoldFirst) {
        let (release, held) = oneshot::channel();
        (release, HoldFirst(std::sync::Arc::new(std::sync::Mutex::new(Some(held)))))
    }

    /// The hold, for the first caller only.
    fn take(&self) -> Option<oneshot::Receiver<()>> {
        self.0.lock().unwrap().take()
    }

    /// Waits until the test lets the first answer go (at once for the others).
    async fn wait(hold: Option<oneshot::Receiver<()>>) {
        if let Some(hold) = hold {
            let _ = hold.await;
        }
    }
}

#[tokio::test(start_paused = true)]
async fn a_settle_that_gives_back_lets_the_gate_through_at_once() {
    let pool = LimitPool::builder(Selection::RoundRobin).member("only", account(100), "sk-only").build().unwrap();
    let fair = FairQueueLayer::rate(FairQueueConfig::new(), pool)
        .unwrap()
        .key(FromExtension::<TenantKey>::new())
        .cost(CostFromExtension)
        .annotate(InsertChosen)
        .usage(UsageFromExtension);
    // The first request's answer is held until the test lets it go.
    let (release, held) = HoldFirst::new();
    let svc = ServiceBuilder::new().layer(fair).service_fn(move |req: Request<()>| {
        let wait = held.take();
        async move {
            HoldFirst::wait(wait).await;
            upstream(req).await
        }
    });
    let start = tokio::time::Instant::now();
    let first = tokio::spawn(svc.clone().oneshot(request("acme", 100)));
    tokio::task::yield_now().await;
    // Nothing left: the second request waits at the gate (for 1s, by the rate alone).
    let second = tokio::spawn(svc.oneshot(request("globex", 60)));
    tokio::task::yield_now().await;
    // The first answer reports 25 of its 100: 75 come back, and the gate passes now.
    release.send(()).unwrap();
    first.await.unwrap().unwrap();
    assert_eq!(second.await.unwrap().unwrap().into_body(), "sk-only");
    assert_eq!(start.elapsed(), Duration::ZERO, "no wait for the rate once the settle refunded");
}

#[tokio::test(start_paused = true)]
async fn a_settle_that_keeps_its_cost_does_not_ask_again_for_the_gate() {
    let backend = Counting::new(account(100));
    let fair = FairQueueLayer::rate(FairQueueConfig::new(), backend.clone())
        .unwrap()
        .key(FromExtension::<TenantKey>::new())
        .cost(CostFromExtension)
        .usage(UsageFromExtension);
    // The first request's answer is held until the test lets it go; every answer reports
    // its whole cost as used.
    let (release, held) = HoldFirst::new();
    let svc = ServiceBuilder::new().layer(fair).service_fn(move |req: Request<()>| {
        let wait = held.take();
        async move {
            HoldFirst::wait(wait).await;
            let used = req.extensions().get::<Cost>().map_or(0, |c| c.0);
            let mut response = Response::new(String::new());
            response.extensions_mut().insert(Usage(used));
            Ok::<_, Infallible>(response)
        }
    });
    let start = tokio::time::Instant::now();
    let first = tokio::spawn(svc.clone().oneshot(request("acme", 100)));
    tokio::task::yield_now().await;
    let second = tokio::spawn(svc.oneshot(request("globex", 60)));
    tokio::task::yield_now().await;
    assert_eq!(backend.acquisitions(), 2, "the second request was refused once, at the gate");
    // The first answer used all it charged: nothing came back, so the gate is not tried
    // again before its timer (a call per finished request to a shared backend).
    release.send(()).unwrap();
    first.await.unwrap().unwrap();
    tokio::task::yield_now().await;
    assert_eq!(backend.acquisitions(), 2, "no acquisition for a settle that gave nothing back");
    second.await.unwrap().unwrap();
    // Tokio's timer rounds up to the millisecond.
    let waited = start.elapsed();
    assert!(waited >= Duration::from_secs(1) && waited <= Duration::from_millis(1001), "{waited:?}");
    assert_eq!(backend.acquisitions(), 3);
}

/// Answers `429` with `Retry-After: 30` from the primary account, `200` from the others.
async fn one_account_refuses(req: Request<()>) -> Result<Response<String>, Infallible> {
    let chosen = req.extensions().get::<Chosen<&'static str>>().expect("the pool's choice");
    let mut response = Response::new(chosen.config.to_string());
    if *chosen.config == "sk-primary" {
        *response.status_mut() = http::StatusCode::TOO_MANY_REQUESTS;
        response.headers_mut().insert("retry-after", http::HeaderValue::from_static("30"));
    }
    Ok(response)
}

#[tokio::test(start_paused = true)]
async fn what_the_upstream_says_of_its_limits_reaches_the_pool() {
    let pool = pool();
    let fair = FairQueueLayer::rate(FairQueueConfig::new(), pool.clone())
        .unwrap()
        .key(FromExtension::<TenantKey>::new())
        .cost(CostFromExtension)
        .annotate(InsertChosen)
        .usage(UpstreamReports::new());
    let svc = ServiceBuilder::new().layer(fair).service_fn(one_account_refuses);
    let now = tower_limits::Instant::from_nanos(0);
    assert_eq!(pool.benched_until(0, now), None);
    // Round robin: the first request goes to the primary account, which answers 429.
    let first = svc.clone().oneshot(request("acme", 1)).await.unwrap();
    assert_eq!(first.status(), http::StatusCode::TOO_MANY_REQUESTS);
    assert!(pool.benched_until(0, now).is_some(), "the primary is benched for its Retry-After");
    // Every later request goes to the secondary.
    for _ in 0..3 {
        assert_eq!(svc.clone().oneshot(request("acme", 1)).await.unwrap().into_body(), "sk-secondary");
    }
}
