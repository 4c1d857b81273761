use tower_limits_core::{LimitPolicy, LimitSet, Quota};

use super::{LimitLayer, door, single};
use crate::ReturnError;
use crate::extract::Extractors;
use crate::shell::shared::Settings;

/// A GCRA rate limit: the quota's rate, with room for its burst at once, exact to the
/// nanosecond. Refused requests learn exactly when to retry.
///
/// A [`LimitSetLayer`](crate::LimitSetLayer) of one limit (see [the named layers](crate::layers)): clones share
/// one state, and the builder verbs are the same.
///
/// ```
/// use tower::{ServiceBuilder, ServiceExt};
/// use tower_limits::http::HttpAnswer;
/// use tower_limits::{GcraLayer, Quota, nz};
///
/// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
/// let svc = ServiceBuilder::new()
///     .layer(GcraLayer::new(Quota::per_second(nz!(100)).burst(nz!(2))).refuse_with(HttpAnswer::new()))
///     .service_fn(|_req: http::Request<String>| async { Ok::<_, std::convert::Infallible>(http::Response::new(String::new())) });
/// for _ in 0..2 {
///     assert_eq!(svc.clone().oneshot(http::Request::new(String::new())).await.unwrap().status(), 200);
/// }
/// let refused = svc.oneshot(http::Request::new(String::new())).await.unwrap();
/// assert_eq!(refused.status(), 429);
/// assert_eq!(refused.headers()["retry-after"], "1"); // 10 ms, rounded up to whole seconds
/// # }
/// ```
pub type GcraLayer<E = Extractors, R = ReturnError, B = LimitSet> = LimitLayer<E, R, B, door::Gcra>;

impl GcraLayer {
    /// One global GCRA limit of `quota`, counting each request's cost (one by default).
    pub fn new(quota: Quota) -> Self {
        single(LimitPolicy::gcra("gcra", quota), Settings::default())
    }
}
