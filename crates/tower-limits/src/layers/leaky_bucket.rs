use tower_limits_core::{LimitPolicy, LimitSet, Quota, nz};

use super::{LimitLayer, door, single};
use crate::ReturnError;
use crate::extract::Extractors;
use crate::shell::shared::Settings;

/// A leaky bucket as a shaper: requests wait and leave at the quota's steady pace, one
/// every [`interval`](Quota::interval), never in bursts. The quota's burst is the
/// bucket's depth: a request that would wait longer than `burst` intervals is refused
/// at once instead. Waiters leave in arrival order; a dropped one leaves the queue.
///
/// For outbound clients that must not exceed a provider's pace, and for smoothing load
/// on a fragile backend. A [`LimitSetLayer`](crate::LimitSetLayer) of one GCRA limit with a burst of one, in
/// [`wait`](LimitLayer::wait) mode (see [the named layers](crate::layers)).
///
/// ```
/// use std::time::Duration;
/// use tower::{ServiceBuilder, ServiceExt};
/// use tower_limits::{LeakyBucketLayer, Quota, nz};
///
/// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
/// // 10 a second, at most 5 waiting.
/// let svc = ServiceBuilder::new()
///     .layer(LeakyBucketLayer::new(Quota::per_second(nz!(10)).burst(nz!(5))))
///     .service_fn(|_req: ()| async { Ok::<_, std::convert::Infallible>(tokio::time::Instant::now()) });
/// let start = tokio::time::Instant::now();
/// let mut left = Vec::new();
/// for _ in 0..3 {
///     left.push(svc.clone().oneshot(()).await.unwrap() - start);
/// }
/// assert_eq!(left, [Duration::ZERO, Duration::from_millis(100), Duration::from_millis(200)]);
/// # }
/// ```
pub type LeakyBucketLayer<E = Extractors, R = ReturnError, B = LimitSet> = LimitLayer<E, R, B, door::LeakyBucket>;

impl LeakyBucketLayer {
    /// A shaper at `quota`'s pace, `quota.max_burst()` intervals deep.
    pub fn new(quota: Quota) -> Self {
        let depth = quota.interval().saturating_mul(u32::try_from(quota.max_burst()).unwrap_or(u32::MAX));
        let settings = Settings { max_wait: Some(depth), ..Settings::default() };
        // Paced one at a time: the depth is the wait. (A burst of one always fits.)
        single(LimitPolicy::gcra("leaky_bucket", quota.burst(nz!(1))), settings)
    }
}
