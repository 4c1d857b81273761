use tower_limits_core::{LimitPolicy, LimitSet, Quota};

use super::{LimitLayer, door, single};
use crate::ReturnError;
use crate::extract::Extractors;
use crate::shell::shared::Settings;

/// A token bucket: `burst` tokens, refilled at the quota's rate; a request takes its
/// cost in tokens. It admits exactly what a [`GcraLayer`](crate::GcraLayer) of the same
/// quota admits (a law of this crate); pick the one whose words fit your policy.
///
/// A [`LimitSetLayer`](crate::LimitSetLayer) of one limit (see [the named layers](crate::layers)).
///
/// ```
/// use tower::{ServiceBuilder, ServiceExt};
/// use tower_limits::extract::{Cost, CostFromExtension};
/// use tower_limits::{Quota, TokenBucketLayer, nz};
///
/// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
/// // 6,000 tokens a minute, 1,000 at once; each request costs its estimated tokens.
/// let tokens = TokenBucketLayer::new(Quota::per_minute(nz!(6_000)).burst(nz!(1_000))).cost(CostFromExtension);
/// let svc = ServiceBuilder::new()
///     .layer(tokens)
///     .service_fn(|_req: http::Request<String>| async { Ok::<_, std::convert::Infallible>("done") });
/// let request = |tokens| {
///     let mut req = http::Request::new(String::new());
///     req.extensions_mut().insert(Cost(tokens));
///     req
/// };
/// assert!(svc.clone().oneshot(request(800)).await.is_ok());
/// assert!(svc.clone().oneshot(request(300)).await.is_err()); // 200 left
/// assert!(svc.oneshot(request(200)).await.is_ok());
/// # }
/// ```
pub type TokenBucketLayer<E = Extractors, R = ReturnError, B = LimitSet> = LimitLayer<E, R, B, door::TokenBucket>;

impl TokenBucketLayer {
    /// One global token bucket of `quota`: its burst is the bucket's size.
    pub fn new(quota: Quota) -> Self {
        single(LimitPolicy::token_bucket("token_bucket", quota), Settings::default())
    }
}
