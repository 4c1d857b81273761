use tower_limits_core::LimitSet;

use super::{LimitLayer, door};
use crate::ReturnError;
use crate::extract::Extractors;

/// Several limits applied together: a request acquires every one of them or none,
/// each keyed by a tier of the tenant key, costed, and settled to the real usage.
///
/// Built from a [`LimitSetPolicy`](crate::LimitSetPolicy) (data: a file, a database row;
/// building it can fail, naming the field) with [`LimitSetLayer::new`](crate::LimitLayer::new), or over any
/// [`Backend`](crate::Backend), such as Redis, with [`LimitSetLayer::with_backend`](crate::LimitLayer::with_backend).
/// See the [shell](crate::shell) for the whole life of a request, and the
/// [named layers](crate::layers) for single limits.
///
/// ```
/// use std::convert::Infallible;
/// use tower::{ServiceBuilder, ServiceExt};
/// use tower_limits::extract::{Cost, CostFromExtension, FromExtension};
/// use tower_limits::http::HttpAnswer;
/// use tower_limits::{LimitPolicy, LimitSetLayer, LimitSetPolicy, Quota, TenantKey, nz};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), tower_limits::PolicyError> {
/// let limits = LimitSetLayer::new(
///     LimitSetPolicy::new()
///         .tiers(["org", "user"])
///         .limit(LimitPolicy::gcra("requests", Quota::per_minute(nz!(60)).burst(nz!(10))).per("user"))
///         .limit(
///             LimitPolicy::token_bucket("tokens", Quota::per_minute(nz!(100_000)).burst(nz!(20_000)))
///                 .per("org")
///                 .counting_cost(),
///         )
///         .limit(LimitPolicy::semaphore("concurrent", 4).per("org")),
/// )?
/// .key(FromExtension::<TenantKey>::new())
/// .cost(CostFromExtension)
/// .refuse_with(HttpAnswer::new());
///
/// # let _: axum::Router = axum::Router::new().layer(limits.clone()); // it goes on a Router as it is
/// let svc = ServiceBuilder::new()
///     .layer(limits)
///     .service_fn(|_req: http::Request<String>| async { Ok::<_, Infallible>(http::Response::new(String::new())) });
/// let mut req = http::Request::new(String::new());
/// req.extensions_mut().insert(TenantKey::new(["acme", "alice"]).unwrap()); // from the auth layer
/// req.extensions_mut().insert(Cost(30_000)); // more tokens than the org's burst
/// let refused = svc.oneshot(req).await.unwrap();
/// assert_eq!(refused.status(), 413); // it could never pass: refused at once
/// # Ok(()) }
/// ```
pub type LimitSetLayer<E = Extractors, R = ReturnError, B = LimitSet> = LimitLayer<E, R, B, door::Set>;
