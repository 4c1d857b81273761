//! Criterion benchmarks live in `benches/benches/`; run them with `cargo bench -p tower-limits-benches`.
//!
//! This library holds what several benchmarks share: the bare service every middleware
//! wraps, the requests it gets, one way to drive them, and the keyed limit set the keyed
//! rows measure; [`floor`] the hand-written sets of three (under locks, and with none) the
//! set-of-three row is read against.

pub mod floor;

use std::convert::Infallible;
use std::future::Future;
use std::pin::pin;
use std::task::{Context, Poll, Waker};

use axum::body::Body;
use http::{Request, Response};
use tower::Service;
use tower_limits_core::{LimitPolicy, LimitSet, LimitSetPolicy, Quota, nz};

/// The set of the keyed rows: one GCRA per tenant, a billion a second with a burst of a
/// million (never refusing in a benchmark), room for 200,000 keys.
///
/// ```
/// use tower_limits_core::{Instant, TenantKey};
///
/// let set = tower_limits_benches::open_keyed_set();
/// assert!(set.acquire(&TenantKey::from_u64(7), 1, Instant::ZERO).is_ok());
/// ```
#[must_use]
pub fn open_keyed_set() -> LimitSet {
    let policy = LimitSetPolicy::new()
        .tiers(["tenant"])
        .max_keys(200_000)
        .limit(LimitPolicy::gcra("r", Quota::per_second(nz!(1_000_000_000)).burst(nz!(1_000_000))).per("tenant"));
    // A constant policy that passes its own validation.
    LimitSet::new(policy).expect("a valid policy")
}

/// The request of every Tower row.
pub type Req = Request<()>;

/// The bare service every middleware wraps: it answers `200` at once.
///
/// ```
/// let mut svc = tower_limits_benches::bare();
/// assert!(tower_limits_benches::drive(&mut svc, http::Request::new(())));
/// ```
pub fn bare() -> impl Service<Req, Response = Response<Body>, Error = Infallible, Future: Send> + Clone + Send + 'static
{
    tower::service_fn(|_req: Req| std::future::ready(Ok::<_, Infallible>(Response::new(Body::empty()))))
}

/// One request through `svc`, polled once with a no-op waker (every service here
/// answers at once): whether it answered `Ok`.
///
/// ```
/// let mut svc = tower_limits_benches::bare();
/// assert!(tower_limits_benches::drive(&mut svc, tower_limits_benches::from_peer(7)));
/// ```
pub fn drive<S: Service<Req>>(svc: &mut S, req: Req) -> bool {
    let mut cx = Context::from_waker(Waker::noop());
    if !matches!(svc.poll_ready(&mut cx), Poll::Ready(Ok(()))) {
        return false;
    }
    let fut = pin!(svc.call(req));
    matches!(fut.poll(&mut cx), Poll::Ready(Ok(_)))
}

/// A request from peer `n` (`10.x.y.z`), its address where axum and a bare hyper accept
/// loop record it.
///
/// ```
/// let req = tower_limits_benches::from_peer(258);
/// let addr = req.extensions().get::<std::net::SocketAddr>().unwrap();
/// assert_eq!(addr.ip().to_string(), "10.0.1.2");
/// ```
pub fn from_peer(n: u32) -> Req {
    let addr = std::net::SocketAddr::from(([10, (n >> 16) as u8, (n >> 8) as u8, n as u8], 40_000));
    let mut req = Request::new(());
    req.extensions_mut().insert(addr);
    req.extensions_mut().insert(axum::extract::ConnectInfo(addr));
    req
}

/// How long `threads` threads take to run `op` `per_thread` times each, all released at
/// once: the wall time from their common start to the last one's end.
///
/// ```
/// use std::sync::Arc;
/// use std::sync::atomic::{AtomicU64, Ordering};
///
/// let calls = Arc::new(AtomicU64::new(0));
/// let counted = calls.clone();
/// tower_limits_benches::on_threads(2, 1_000, Arc::new(move || {
///     counted.fetch_add(1, Ordering::Relaxed);
/// }));
/// assert_eq!(calls.load(Ordering::Relaxed), 2_000);
/// ```
pub fn on_threads(threads: usize, per_thread: u64, op: std::sync::Arc<dyn Fn() + Send + Sync>) -> std::time::Duration {
    let barrier = std::sync::Arc::new(std::sync::Barrier::new(threads + 1));
    let handles: Vec<_> = (0..threads)
        .map(|_| {
            let (op, barrier) = (op.clone(), barrier.clone());
            std::thread::spawn(move || {
                barrier.wait();
                for _ in 0..per_thread {
                    op();
                }
            })
        })
        .collect();
    barrier.wait();
    let start = std::time::Instant::now();
    for h in handles {
        h.join().expect("bench thread");
    }
    start.elapsed()
}

/// The set of three that the Redis rows acquire: a GCRA per user, a token bucket counting
/// cost and a semaphore per organisation, none ever refusing in a benchmark.
///
/// ```
/// assert_eq!(tower_limits_benches::open_set_of_three().limits.len(), 3);
/// ```
#[must_use]
pub fn open_set_of_three() -> LimitSetPolicy {
    LimitSetPolicy::new()
        .tiers(["org", "user"])
        .limit(LimitPolicy::gcra("requests", Quota::per_second(nz!(1_000_000)).burst(nz!(1_000_000_000))).per("user"))
        .limit(
            LimitPolicy::token_bucket("tokens", Quota::per_second(nz!(1_000_000)).burst(nz!(1_000_000_000)))
                .per("org")
                .counting_cost(),
        )
        .limit(LimitPolicy::semaphore("concurrent", 1_000_000_000).per("org"))
}

/// The set of three that capacity shares are measured with: a global rate, a rate per
/// user and a semaphore per organisation, none ever refusing in a benchmark.
///
/// ```
/// assert_eq!(tower_limits_benches::open_global_user_org().limits.len(), 3);
/// ```
#[must_use]
pub fn open_global_user_org() -> LimitSetPolicy {
    LimitSetPolicy::new()
        .tiers(["org", "user"])
        .limit(LimitPolicy::gcra("requests", Quota::per_second(nz!(10_000_000))))
        .limit(LimitPolicy::gcra("per-user", Quota::per_second(nz!(1_000_000))).per("user"))
        .limit(LimitPolicy::semaphore("concurrent", 1_000_000).per("org"))
}
