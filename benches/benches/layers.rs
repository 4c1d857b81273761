//! Per-request overhead of the layers over a bare `service_fn`, side by side in one run:
//! our GCRA layer and a three-limit `LimitSetLayer`, `tower::limit::RateLimit`,
//! `tower::limit::ConcurrencyLimit` and tower_governor's `GovernorLayer`; allow path and
//! deny path. Every service answers `http::Response<axum::body::Body>` (tower_governor
//! only builds its refusals for axum's and tonic's bodies) and is driven by polling it
//! directly, so no runtime scheduling is measured.
//!
//! Run: `cargo bench -p tower-limits-benches --bench layers`.

use std::future::Future;
use std::hint::black_box;
use std::pin::pin;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use axum::body::Body;
use criterion::{Criterion, criterion_group, criterion_main};
use http::{Request, Response, StatusCode};
use tower::{Layer, Service};
use tower_governor::GovernorLayer;
use tower_governor::governor::GovernorConfigBuilder;
use tower_governor::key_extractor::{GlobalKeyExtractor, PeerIpKeyExtractor};
use tower_limits::extract::{Extractors, PeerIp};
use tower_limits::http::HttpAnswer;
use tower_limits::{GcraLayer, LimitPolicy, LimitSetLayer, LimitSetPolicy, Quota, Rate, nz};
use tower_limits_benches::{Req, bare, from_peer};

/// One request through `svc`, polled to completion with a no-op waker: the status.
fn drive<S: Service<Req, Response = Response<RB>>, RB>(svc: &mut S) -> u16 {
    drive_with(svc, Request::new(()))
}

/// `req` through `svc`: the status.
fn drive_with<S: Service<Req, Response = Response<RB>>, RB>(svc: &mut S, req: Req) -> u16 {
    let mut cx = Context::from_waker(Waker::noop());
    match svc.poll_ready(&mut cx) {
        Poll::Ready(Ok(())) => {}
        _ => return 0,
    }
    let fut = pin!(svc.call(req));
    match fut.poll(&mut cx) {
        Poll::Ready(Ok(response)) => response.status().as_u16(),
        _ => 0,
    }
}

fn bench_service<S, RB>(c: &mut Criterion, name: &str, mut svc: S, expect: StatusCode)
where
    S: Service<Req, Response = Response<RB>>,
{
    assert_eq!(drive(&mut svc), expect.as_u16(), "{name}");
    c.bench_function(name, |b| b.iter(|| black_box(drive(&mut svc))));
}

const HUGE: u64 = 1_000_000_000;

fn ours_gcra(rate: Rate, burst: u64) -> GcraLayer<Extractors, HttpAnswer> {
    GcraLayer::new(Quota::try_new(rate.amount(), rate.period()).and_then(|q| q.try_burst(burst)).expect("quota"))
        .system_clock()
        .reject_with(HttpAnswer::new())
}

fn allow(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread().enable_time().build().expect("runtime");
    let _enter = rt.enter();
    bench_service(c, "allow/bare_service_fn", bare(), StatusCode::OK);
    bench_service(
        c,
        "allow/tower_limits_gcra",
        ours_gcra(Rate::per_second(HUGE), 1_000_000).layer(bare()),
        StatusCode::OK,
    );
    let plain = GcraLayer::new(Quota::per_second(nz!(HUGE)).burst(nz!(1_000_000))).system_clock();
    let mut plain = plain.layer(bare());
    c.bench_function("allow/tower_limits_gcra_error_mode", |b| {
        b.iter(|| {
            let mut cx = Context::from_waker(Waker::noop());
            let _ = plain.poll_ready(&mut cx);
            let fut = pin!(plain.call(Request::new(())));
            black_box(matches!(fut.poll(&mut cx), Poll::Ready(Ok(_))))
        });
    });
    let three = LimitSetLayer::new(
        LimitSetPolicy::new()
            .limit(LimitPolicy::gcra("requests", Rate::per_second(HUGE), 1_000_000))
            .limit(LimitPolicy::token_bucket("tokens", Rate::per_second(HUGE), 1_000_000).counting_cost())
            .limit(LimitPolicy::semaphore("concurrent", 64)),
    )
    .expect("policy")
    .system_clock()
    .reject_with(HttpAnswer::new());
    bench_service(c, "allow/tower_limits_three_limits", three.layer(bare()), StatusCode::OK);
    let rate = tower::limit::RateLimitLayer::new(HUGE, Duration::from_secs(1));
    bench_service(c, "allow/tower_rate_limit", rate.layer(bare()), StatusCode::OK);
    let concurrency = tower::limit::ConcurrencyLimitLayer::new(64);
    bench_service(c, "allow/tower_concurrency_limit", concurrency.layer(bare()), StatusCode::OK);
    let config = GovernorConfigBuilder::default()
        .per_nanosecond(1)
        .burst_size(1_000_000)
        .key_extractor(GlobalKeyExtractor)
        .finish()
        .expect("config");
    bench_service(c, "allow/tower_governor", GovernorLayer::<_, _, Body>::new(config).layer(bare()), StatusCode::OK);
}

/// The modes users compare: the `RateLimit` fields on every success against
/// tower_governor's `use_headers`, and a limit per peer IP against its
/// `PeerIpKeyExtractor` (1,000 peers in turn).
fn modes(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread().enable_time().build().expect("runtime");
    let _enter = rt.enter();
    let headers = GcraLayer::new(Quota::per_second(nz!(HUGE)).burst(nz!(1_000_000)))
        .system_clock()
        .reject_with(HttpAnswer::new().on_success());
    let mut ours = headers.layer(bare());
    assert!(matches!(drive(&mut ours), 200));
    c.bench_function("headers/tower_limits_gcra_on_success", |b| b.iter(|| black_box(drive(&mut ours))));
    let config = GovernorConfigBuilder::default()
        .per_nanosecond(1)
        .burst_size(1_000_000)
        .key_extractor(GlobalKeyExtractor)
        .use_headers()
        .finish()
        .expect("config");
    let mut theirs = GovernorLayer::<_, _, Body>::new(config).layer(bare());
    c.bench_function("headers/tower_governor_use_headers", |b| b.iter(|| black_box(drive(&mut theirs))));

    let per_ip = GcraLayer::new(Quota::per_second(nz!(HUGE)).burst(nz!(1_000_000)))
        .key(PeerIp)
        .system_clock()
        .reject_with(HttpAnswer::new());
    let mut ours = per_ip.layer(bare());
    let mut n = 0u32;
    assert_eq!(drive_with(&mut ours, from_peer(0)), 200);
    c.bench_function("peer_ip/tower_limits_gcra", |b| {
        b.iter(|| {
            n = (n + 1) % 1_000;
            black_box(drive_with(&mut ours, from_peer(n)))
        })
    });
    let config = GovernorConfigBuilder::default()
        .per_nanosecond(1)
        .burst_size(1_000_000)
        .key_extractor(PeerIpKeyExtractor)
        .finish()
        .expect("config");
    let mut theirs = GovernorLayer::<_, _, Body>::new(config).layer(bare());
    assert_eq!(drive_with(&mut theirs, from_peer(0)), 200);
    c.bench_function("peer_ip/tower_governor", |b| {
        b.iter(|| {
            n = (n + 1) % 1_000;
            black_box(drive_with(&mut theirs, from_peer(n)))
        })
    });
    c.bench_function("peer_ip/request_only", |b| {
        b.iter(|| {
            n = (n + 1) % 1_000;
            black_box(from_peer(n))
        })
    });
}

fn deny(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread().enable_time().build().expect("runtime");
    let _enter = rt.enter();
    let mut ours = ours_gcra(Rate::per_hour(1), 1).layer(bare());
    assert_eq!(drive(&mut ours), 200);
    bench_service(c, "deny/tower_limits_gcra", ours, StatusCode::TOO_MANY_REQUESTS);
    let mut plain = GcraLayer::new(Quota::per_hour(nz!(1)).burst(nz!(1))).system_clock().layer(bare());
    assert_eq!(drive(&mut plain), 200);
    c.bench_function("deny/tower_limits_gcra_error_mode", |b| {
        b.iter(|| {
            let mut cx = Context::from_waker(Waker::noop());
            let _ = plain.poll_ready(&mut cx);
            let fut = pin!(plain.call(Request::new(())));
            black_box(matches!(fut.poll(&mut cx), Poll::Ready(Err(_))))
        });
    });
    let config = GovernorConfigBuilder::default()
        .per_second(3600)
        .burst_size(1)
        .key_extractor(GlobalKeyExtractor)
        .finish()
        .expect("config");
    let mut theirs = GovernorLayer::<_, _, Body>::new(config).layer(bare());
    assert_eq!(drive(&mut theirs), 200);
    bench_service(c, "deny/tower_governor", theirs, StatusCode::TOO_MANY_REQUESTS);
}

criterion_group! {
    name = benches;
    config = Criterion::default().warm_up_time(Duration::from_millis(500)).measurement_time(Duration::from_secs(2));
    targets = allow, deny, modes
}
criterion_main!(benches);
