//! Absolute per-request times of the layers over a bare `service_fn`, for what the
//! `peers` table does not measure.
//!
//! `peers` (group `tower`) already compares, as overheads over the bare service: our GCRA
//! layer in error mode against tower_governor and against `tower::limit::RateLimit` on
//! the allow path, the rate-limit fields on every success against tower_governor's
//! `use_headers`, and a limit per peer IP against its `PeerIpKeyExtractor`. This bench
//! covers the rest:
//!
//! - the allow path of our GCRA layer answering refusals itself (`HttpAnswer`, the mode
//!   that goes on an axum `Router` as it is), of a three-limit `LimitSetLayer`, and of
//!   `tower::limit::ConcurrencyLimit` for scale, beside the bare service alone;
//! - the deny path, which `peers` has no tower row for: our GCRA layer's `429` answer and
//!   its error, against tower_governor's `429`.
//!
//! Every service answers `http::Response<axum::body::Body>` (tower_governor only builds
//! its refusals for axum's and tonic's bodies) and is driven by polling it directly, so
//! no runtime scheduling is measured.
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
use tower_governor::key_extractor::GlobalKeyExtractor;
use tower_limits::extract::Extractors;
use tower_limits::http::HttpAnswer;
use tower_limits::{GcraLayer, LimitPolicy, LimitSetLayer, LimitSetPolicy, Quota, nz};
use tower_limits_benches::{Req, bare};

/// One request through `svc`, polled to completion with a no-op waker: the status (0 for
/// an error or a service not ready).
fn drive<S: Service<Req, Response = Response<RB>>, RB>(svc: &mut S) -> u16 {
    let mut cx = Context::from_waker(Waker::noop());
    match svc.poll_ready(&mut cx) {
        Poll::Ready(Ok(())) => {}
        _ => return 0,
    }
    let fut = pin!(svc.call(Request::new(())));
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

/// One unit a nanosecond, with a burst of a millisecond of it: never refusing here.
const OPEN: Quota = Quota::per_second(nz!(1_000_000_000)).burst(nz!(1_000_000));

fn ours_gcra(quota: Quota) -> GcraLayer<Extractors, HttpAnswer> {
    GcraLayer::new(quota).system_clock().refuse_with(HttpAnswer::new())
}

fn allow(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread().enable_time().build().expect("runtime");
    let _enter = rt.enter();
    bench_service(c, "allow/bare_service_fn", bare(), StatusCode::OK);
    bench_service(c, "allow/tower_limits_gcra", ours_gcra(OPEN).layer(bare()), StatusCode::OK);
    let three = LimitSetLayer::new(
        LimitSetPolicy::new()
            .limit(LimitPolicy::gcra("requests", OPEN))
            .limit(LimitPolicy::token_bucket("tokens", OPEN).counting_cost())
            .limit(LimitPolicy::semaphore("concurrent", 64)),
    )
    .expect("policy")
    .system_clock()
    .refuse_with(HttpAnswer::new());
    bench_service(c, "allow/tower_limits_three_limits", three.layer(bare()), StatusCode::OK);
    let concurrency = tower::limit::ConcurrencyLimitLayer::new(64);
    bench_service(c, "allow/tower_concurrency_limit", concurrency.layer(bare()), StatusCode::OK);
}

fn deny(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread().enable_time().build().expect("runtime");
    let _enter = rt.enter();
    let mut ours = ours_gcra(Quota::per_hour(nz!(1))).layer(bare());
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
    targets = allow, deny
}
criterion_main!(benches);
