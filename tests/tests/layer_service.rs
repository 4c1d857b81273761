//! Law 9: the `LimitSetLayer` service contract, on paused tokio time: shared state across
//! clones, readiness, keys and costs, settling, cancellation and waiting. Law numbers are
//! those of `crates/tower-limits/docs/laws.md`.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::Poll;
use std::time::Duration;

use tokio::time::Instant as TokioInstant;
use tower::{Service, ServiceBuilder, ServiceExt};
use tower_limits::extract::{Extractors, KeyFn, UsageFn};
use tower_limits::{
    BoxError, ErrorKind, GcraLayer, LimitError, LimitPolicy, LimitSetLayer, LimitSetPolicy, Quota, SemaphoreLayer,
    TenantKey, Unfinished, nz,
};
use tower_test::mock;

fn limit_error(e: &BoxError) -> &LimitError {
    e.downcast_ref::<LimitError>().expect("a LimitError")
}

fn echo() -> impl Service<u64, Response = u64, Error = Infallible, Future: Send> + Clone + Send + 'static {
    tower::service_fn(|x: u64| async move { Ok::<_, Infallible>(x) })
}

#[tokio::test(start_paused = true)]
async fn clones_share_one_limit() {
    let svc = ServiceBuilder::new().layer(GcraLayer::new(Quota::per_second(nz!(1)).burst(nz!(2)))).service(echo());
    let (a, b, c) = (svc.clone(), svc.clone(), svc);
    assert_eq!(a.oneshot(1).await.unwrap(), 1);
    assert_eq!(b.oneshot(2).await.unwrap(), 2);
    let err = c.oneshot(3).await.unwrap_err();
    let err = limit_error(&err);
    assert_eq!(err.kind(), ErrorKind::RateLimited);
    assert_eq!(err.limit(), Some("gcra"));
    assert_eq!(err.retry_after(), Some(Duration::from_secs(1)));
}

#[tokio::test(start_paused = true)]
async fn services_from_one_layer_share_state() {
    let layer = GcraLayer::new(Quota::per_second(nz!(1)));
    let first = ServiceBuilder::new().layer(layer.clone()).service(echo());
    let second = ServiceBuilder::new().layer(layer).service(echo());
    first.oneshot(1).await.unwrap();
    assert!(second.oneshot(2).await.is_err(), "a second service of the same layer shares the limit");
}

#[tokio::test(start_paused = true)]
async fn poll_ready_forwards_the_inner_readiness_and_reserves_nothing() {
    let layer = SemaphoreLayer::new(nz!(1));
    let (inner, mut handle) = mock::pair::<u64, u64>();
    let mut svc = tower_test::mock::Spawn::new(tower::Layer::layer(&layer, inner));
    handle.allow(0);
    assert!(svc.poll_ready().is_pending(), "not ready while the inner service is not");
    handle.allow(10);
    // Polling ready on many clones pins no concurrency: an idle connection holds nothing.
    for _ in 0..5 {
        let mut clone = tower_test::mock::Spawn::new(svc.get_ref().clone());
        assert!(clone.poll_ready().is_ready());
    }
    assert!(svc.poll_ready().is_ready());
    let fut = svc.call(7);
    let (req, send) = handle.next_request().await.unwrap();
    assert_eq!(req, 7);
    send.send_response(70);
    assert_eq!(fut.await.unwrap(), 70);
}

#[tokio::test(start_paused = true)]
async fn concurrency_comes_back_when_the_response_future_is_dropped() {
    let layer = SemaphoreLayer::new(nz!(1));
    let (inner, mut handle) = mock::pair::<u64, u64>();
    handle.allow(100);
    let mut svc = tower::Layer::layer(&layer, inner);
    svc.ready().await.unwrap();
    let held = svc.call(1);
    let refused = svc.ready().await.unwrap().call(2).await.unwrap_err();
    assert_eq!(limit_error(&refused).kind(), ErrorKind::ConcurrencyLimited);
    drop(held);
    let third = svc.ready().await.unwrap().call(3);
    let (_, send) = handle.next_request().await.unwrap(); // request 1 reached the inner service
    drop(send);
    let (req, send) = handle.next_request().await.unwrap();
    assert_eq!(req, 3);
    send.send_response(30);
    assert_eq!(third.await.unwrap(), 30);
    assert_eq!(layer.stats().limits[0].held, 0);
}

type Req = (String, u64);
type TenantKeys = KeyFn<fn(&Req) -> Option<TenantKey>, Req>;
type TenantCost = tower_limits::extract::CostFn<fn(&Req) -> u64, Req>;

fn tenant_layer() -> LimitSetLayer<Extractors<TenantKeys, TenantCost>> {
    LimitSetLayer::new(
        LimitSetPolicy::new()
            .tiers(["tenant"])
            .limit(LimitPolicy::token_bucket("tokens", Quota::per_minute(nz!(100))).per("tenant").counting_cost()),
    )
    .unwrap()
    .key(KeyFn::new((|r: &Req| (!r.0.is_empty()).then(|| TenantKey::single(&r.0).unwrap())) as fn(&Req) -> _))
    .cost(tower_limits::extract::CostFn::new((|r: &Req| r.1) as fn(&Req) -> u64))
}

fn remaining(layer: &LimitSetLayer<impl Sized, impl Sized>, tenant: &str) -> u64 {
    let key = TenantKey::single(tenant).unwrap();
    layer.backend().peek(&key, tower_limits::Instant::ZERO)[0].snapshot.remaining
}

#[tokio::test(start_paused = true)]
async fn keys_and_costs_come_from_the_request() {
    let layer = tenant_layer();
    let svc = ServiceBuilder::new()
        .layer(layer.clone())
        .service(tower::service_fn(|r: (String, u64)| async move { Ok::<_, Infallible>(r.1) }));
    svc.clone().oneshot(("acme".into(), 60)).await.unwrap();
    let err = svc.clone().oneshot(("acme".into(), 60)).await.unwrap_err();
    assert_eq!(limit_error(&err).tier(), Some("tenant"));
    svc.clone().oneshot(("globex".into(), 60)).await.expect("another tenant has its own bucket");
    let err = svc.clone().oneshot(("acme".into(), 101)).await.unwrap_err();
    assert_eq!(limit_error(&err).kind(), ErrorKind::CostAboveCapacity, "never waits, never passes");
    let err = svc.clone().oneshot((String::new(), 1)).await.unwrap_err();
    assert_eq!(limit_error(&err).kind(), ErrorKind::MissingKey);
    assert_eq!(remaining(&layer, "acme"), 40);
}

#[tokio::test(start_paused = true)]
async fn a_default_key_replaces_a_missing_one() {
    let layer = tenant_layer().default_key(TenantKey::single("anonymous").unwrap());
    let svc = ServiceBuilder::new()
        .layer(layer.clone())
        .service(tower::service_fn(|r: (String, u64)| async move { Ok::<_, Infallible>(r.1) }));
    svc.oneshot((String::new(), 30)).await.unwrap();
    assert_eq!(remaining(&layer, "anonymous"), 70);
}

#[tokio::test(start_paused = true)]
async fn usage_settles_the_permit() {
    let layer = tenant_layer().usage(UsageFn::new(|used: &u64| Some(*used / 10)));
    let svc = ServiceBuilder::new()
        .layer(layer.clone())
        .service(tower::service_fn(|r: (String, u64)| async move { Ok::<_, Infallible>(r.1) }));
    // Estimated 80, really used 8: 72 come back.
    svc.oneshot(("acme".into(), 80)).await.unwrap();
    assert_eq!(remaining(&layer, "acme"), 92);
}

#[tokio::test(start_paused = true)]
async fn an_inner_error_refunds_by_default_and_keeps_when_asked() {
    for (policy, expected) in [(Unfinished::Refund, 100), (Unfinished::Keep, 20)] {
        let layer = tenant_layer().on_error(policy);
        let svc = ServiceBuilder::new()
            .layer(layer.clone())
            .service(tower::service_fn(|_: (String, u64)| async move { Err::<u64, _>("upstream failed") }));
        let err = svc.oneshot(("acme".into(), 80)).await.unwrap_err();
        assert_eq!(err.to_string(), "upstream failed");
        assert_eq!(remaining(&layer, "acme"), expected, "{policy:?}");
    }
}

#[tokio::test(start_paused = true)]
async fn a_cancelled_request_keeps_or_refunds_as_configured() {
    for (policy, expected) in [(Unfinished::Keep, 20), (Unfinished::Refund, 100)] {
        let layer = tenant_layer().on_cancel(policy);
        let (inner, mut handle) = mock::pair::<(String, u64), u64>();
        handle.allow(1);
        let mut svc = tower::Layer::layer(&layer, inner);
        svc.ready().await.unwrap();
        let fut = svc.call(("acme".into(), 80));
        drop(fut);
        assert_eq!(remaining(&layer, "acme"), expected, "{policy:?}");
    }
}

#[tokio::test(start_paused = true)]
async fn a_waiter_wakes_at_the_exact_instant() {
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let record = seen.clone();
    let start = TokioInstant::now();
    let svc = ServiceBuilder::new()
        .layer(GcraLayer::new(Quota::per_second(nz!(1))).wait(Duration::from_secs(10)))
        .service(tower::service_fn(move |x: u64| {
            record.lock().unwrap().push((x, start.elapsed()));
            async move { Ok::<_, Infallible>(x) }
        }));
    let calls: Vec<_> = (0..3).map(|i| tokio::spawn(svc.clone().oneshot(i))).collect();
    for c in calls {
        c.await.unwrap().unwrap();
    }
    let seen = seen.lock().unwrap().clone();
    assert_eq!(
        seen,
        vec![(0, Duration::ZERO), (1, Duration::from_secs(1)), (2, Duration::from_secs(2))],
        "served in arrival order, each at the instant it fits"
    );
}

#[tokio::test(start_paused = true)]
async fn a_wait_longer_than_max_wait_fails_at_once() {
    let layer = GcraLayer::new(Quota::per_second(nz!(1))).wait(Duration::from_millis(500));
    let svc = ServiceBuilder::new().layer(layer.clone()).service(echo());
    svc.clone().oneshot(1).await.unwrap();
    let start = TokioInstant::now();
    let err = svc.oneshot(2).await.unwrap_err();
    assert_eq!(start.elapsed(), Duration::ZERO, "no waiting for a wait that cannot fit");
    assert_eq!(limit_error(&err).retry_after(), Some(Duration::from_secs(1)));
}

#[tokio::test(start_paused = true)]
async fn a_concurrency_waiter_wakes_on_release() {
    let layer = SemaphoreLayer::new(nz!(1)).wait(Duration::from_secs(60));
    let (inner, mut handle) = mock::pair::<u64, u64>();
    handle.allow(10);
    let svc = tower::Layer::layer(&layer, inner);
    let first = tokio::spawn(svc.clone().oneshot(1));
    let (_, send_first) = handle.next_request().await.unwrap();
    let start = TokioInstant::now();
    let second = tokio::spawn(svc.clone().oneshot(2));
    tokio::task::yield_now().await;
    assert_eq!(layer.layer_stats().waiting, 1);
    send_first.send_response(10);
    assert_eq!(first.await.unwrap().unwrap(), 10);
    let (req, send_second) = handle.next_request().await.unwrap();
    assert_eq!(req, 2);
    assert_eq!(start.elapsed(), Duration::ZERO, "woken by the release, not by a timer");
    send_second.send_response(20);
    assert_eq!(second.await.unwrap().unwrap(), 20);
    assert_eq!(layer.layer_stats().waited, 1);
}

#[tokio::test(start_paused = true)]
async fn a_concurrency_waiter_times_out_at_its_deadline() {
    let layer = SemaphoreLayer::new(nz!(1)).wait(Duration::from_secs(3));
    let (inner, mut handle) = mock::pair::<u64, u64>();
    handle.allow(10);
    let svc = tower::Layer::layer(&layer, inner);
    let _first = tokio::spawn(svc.clone().oneshot(1));
    let _held = handle.next_request().await.unwrap();
    let start = TokioInstant::now();
    let err = svc.oneshot(2).await.unwrap_err();
    assert_eq!(limit_error(&err).kind(), ErrorKind::WaitTimedOut);
    assert_eq!(start.elapsed(), Duration::from_secs(3));
}

#[tokio::test(start_paused = true)]
async fn dropping_a_waiter_at_any_point_leaves_nothing_behind() {
    for polls in 0..4 {
        let layer = LimitSetLayer::new(
            LimitSetPolicy::new()
                .limit(LimitPolicy::gcra("rate", Quota::per_second(nz!(1))))
                .limit(LimitPolicy::semaphore("concurrent", 1)),
        )
        .unwrap()
        .wait(Duration::from_secs(10));
        let calls = Arc::new(AtomicUsize::new(0));
        let counter = calls.clone();
        let svc = ServiceBuilder::new().layer(layer.clone()).service(tower::service_fn(move |x: u64| {
            counter.fetch_add(1, Ordering::SeqCst);
            async move { Ok::<_, Infallible>(x) }
        }));
        svc.clone().oneshot(0).await.unwrap();
        let mut waiting = Box::pin(svc.clone().oneshot(1));
        for _ in 0..polls {
            let polled = futures_poll(&mut waiting).await;
            assert!(polled.is_pending());
        }
        drop(waiting);
        assert_eq!(layer.layer_stats().waiting, 0, "after {polls} polls");
        assert_eq!(layer.stats().limits[1].held, 0, "after {polls} polls");
        tokio::time::advance(Duration::from_secs(1)).await;
        svc.oneshot(2).await.expect("capacity came back");
        assert_eq!(calls.load(Ordering::SeqCst), 2, "the dropped request never reached the service");
    }
}

async fn futures_poll<F: std::future::Future + Unpin>(f: &mut F) -> Poll<F::Output> {
    std::future::poll_fn(|cx| Poll::Ready(std::pin::Pin::new(&mut *f).poll(cx))).await
}

#[tokio::test(start_paused = true)]
async fn a_full_wait_queue_refuses() {
    let layer = GcraLayer::new(Quota::per_second(nz!(1))).wait(Duration::from_secs(60)).max_waiters(2);
    let svc = ServiceBuilder::new().layer(layer.clone()).service(echo());
    svc.clone().oneshot(0).await.unwrap();
    let waiting: Vec<_> = (1..3).map(|i| tokio::spawn(svc.clone().oneshot(i))).collect();
    tokio::task::yield_now().await;
    let err = svc.clone().oneshot(9).await.unwrap_err();
    assert_eq!(limit_error(&err).kind(), ErrorKind::QueueFull);
    for w in waiting {
        w.await.unwrap().unwrap();
    }
}
