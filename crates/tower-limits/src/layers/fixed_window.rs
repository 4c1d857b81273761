use tower_limits_core::{LimitPolicy, LimitSet, Quota};

use super::{LimitLayer, door, single, window};
use crate::ReturnError;
use crate::extract::Extractors;
use crate::shell::shared::Settings;

/// A fixed window: at most the quota's amount per window of its period, the windows
/// starting at whole multiples of the period on the layer's clock. Cheapest in memory
/// and easiest to explain ("50,000 a day"), at the price of bursts of up to twice the
/// amount across a window boundary. The quota's burst is not used.
///
/// A [`LimitSetLayer`](crate::LimitSetLayer) of one limit (see [the named layers](crate::layers)).
///
/// ```
/// use tower::{ServiceBuilder, ServiceExt};
/// use tower_limits::extract::KeyFn;
/// use tower_limits::{FixedWindowLayer, Quota, TenantKey, nz};
///
/// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
/// // 2 a day for each user.
/// let daily = FixedWindowLayer::new(Quota::per_day(nz!(2))).key(KeyFn::new(|user: &&str| TenantKey::single(user).ok()));
/// let svc = ServiceBuilder::new().layer(daily).service_fn(|_req: &str| async { Ok::<_, std::convert::Infallible>(()) });
/// assert!(svc.clone().oneshot("alice").await.is_ok());
/// assert!(svc.clone().oneshot("alice").await.is_ok());
/// assert!(svc.clone().oneshot("alice").await.is_err());
/// assert!(svc.oneshot("bob").await.is_ok()); // each user has their own window
/// # }
/// ```
pub type FixedWindowLayer<E = Extractors, R = ReturnError, B = LimitSet> = LimitLayer<E, R, B, door::FixedWindow>;

impl FixedWindowLayer {
    /// A fixed window of `quota.amount()` per `quota.period()`.
    pub fn new(quota: Quota) -> Self {
        let (limit, period) = window(quota);
        single(LimitPolicy::fixed_window("fixed_window", limit, period), Settings::default())
    }
}
