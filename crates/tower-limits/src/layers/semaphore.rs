use std::num::NonZeroU64;

use tower_limits_core::{LimitPolicy, LimitSet};

use super::{LimitLayer, door, single};
use crate::ReturnError;
use crate::extract::Extractors;
use crate::shell::shared::Settings;

/// A weighted semaphore: at most `capacity` in flight, each request holding its cost
/// (one by default; [`cost`](LimitLayer::cost) weighs it, by bytes, tokens or GPU
/// memory) until its response completes or is dropped.
///
/// Unlike `tower::limit::ConcurrencyLimitLayer` (whose name it does not take, so both can
/// be imported together), it reserves nothing in `poll_ready`, so an idle keep-alive
/// connection pins no capacity; a refused request fails at once (or waits, with
/// [`wait`](LimitLayer::wait)), and its clones share one capacity. A cost above the
/// capacity is refused at once as it could never pass. A [`LimitSetLayer`](crate::LimitSetLayer) of one limit
/// (see [the named layers](crate::layers)).
///
/// ```
/// use tower::{Service, ServiceBuilder, ServiceExt};
/// use tower_limits::{SemaphoreLayer, nz};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let (release, held) = tokio::sync::oneshot::channel::<()>();
/// let held = std::sync::Arc::new(tokio::sync::Mutex::new(Some(held)));
/// let mut svc = ServiceBuilder::new().layer(SemaphoreLayer::new(nz!(1))).service_fn(move |_req: ()| {
///     let held = held.clone();
///     async move {
///         if let Some(rx) = held.lock().await.take() { let _ = rx.await; }
///         Ok::<_, std::convert::Infallible>(())
///     }
/// });
/// let first = tokio::spawn(svc.ready().await.unwrap().call(()));
/// tokio::task::yield_now().await;
/// assert!(svc.clone().oneshot(()).await.is_err()); // the one slot is taken
/// release.send(()).unwrap();
/// first.await.unwrap().unwrap();
/// assert!(svc.oneshot(()).await.is_ok()); // and back
/// # }
/// ```
pub type SemaphoreLayer<E = Extractors, R = ReturnError, B = LimitSet> = LimitLayer<E, R, B, door::Semaphore>;

impl SemaphoreLayer {
    /// At most `capacity` in flight (summing each request's cost).
    pub fn new(capacity: NonZeroU64) -> Self {
        single(LimitPolicy::semaphore("concurrency", capacity.get()), Settings::default())
    }
}
