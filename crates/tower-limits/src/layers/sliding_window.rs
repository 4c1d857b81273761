use tower_limits_core::{LimitPolicy, LimitSet, Quota};

use super::{LimitLayer, door, single, window};
use crate::ReturnError;
use crate::extract::Extractors;
use crate::shell::shared::Settings;

/// A sliding window: at most the quota's amount in any window of its period.
///
/// - [`SlidingWindowLayer::new`]: exact, a log of admissions (memory per key grows with
///   the amount: at most one entry per admitted unit still in the window).
/// - [`SlidingWindowLayer::approximate`]: two counters per key, weighting the previous
///   window by how much of it still overlaps; O(1) memory, but across a window boundary
///   it can admit up to just under twice the amount (see the guide's algorithms page).
///
/// The quota's burst is not used: a window's amount is its burst. A [`LimitSetLayer`](crate::LimitSetLayer)
/// of one limit (see [the named layers](crate::layers)).
///
/// ```
/// use tower::{ServiceBuilder, ServiceExt};
/// use tower_limits::{Quota, SlidingWindowLayer, nz};
///
/// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
/// let svc = ServiceBuilder::new()
///     .layer(SlidingWindowLayer::new(Quota::per_minute(nz!(2))))
///     .service_fn(|_req: ()| async { Ok::<_, std::convert::Infallible>(()) });
/// assert!(svc.clone().oneshot(()).await.is_ok());
/// assert!(svc.clone().oneshot(()).await.is_ok());
/// assert!(svc.clone().oneshot(()).await.is_err());
/// tokio::time::advance(std::time::Duration::from_secs(60)).await;
/// assert!(svc.oneshot(()).await.is_ok()); // the first two left the window
/// # }
/// ```
pub type SlidingWindowLayer<E = Extractors, R = ReturnError, B = LimitSet> = LimitLayer<E, R, B, door::SlidingWindow>;

impl SlidingWindowLayer {
    /// An exact sliding window (a log): `quota.amount()` per `quota.period()`.
    pub fn new(quota: Quota) -> Self {
        let (limit, period) = window(quota);
        single(LimitPolicy::sliding_window_log("sliding_window", limit, period), Settings::default())
    }

    /// An approximate sliding window (two counters): about `quota.amount()` per
    /// `quota.period()`, in constant memory per key.
    pub fn approximate(quota: Quota) -> Self {
        let (limit, period) = window(quota);
        single(LimitPolicy::sliding_window_counter("sliding_window", limit, period), Settings::default())
    }
}
