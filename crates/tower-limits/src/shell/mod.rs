//! The one middleware under every limit layer: its layer ([`LimitLayer`]), service
//! ([`LimitService`]), response future and permit guard, and the waiting of wait mode.
//!
//! Every named layer ([`GcraLayer`](crate::GcraLayer), [`SemaphoreLayer`](crate::SemaphoreLayer),
//! ...) and the [`LimitSetLayer`](crate::LimitSetLayer) are this middleware over a
//! [`Backend`](crate::Backend): a set of one limit or of several, in memory or on Redis.
//! There is no second implementation.
//!
//! The life of a request: it is keyed (by default everyone shares the global key),
//! costed (by default one), and admitted only if every limit of the set has room, all or
//! nothing, in `call` (`poll_ready` only forwards the inner service's readiness, so an
//! idle connection pins nothing). An admitted request holds its permit until its response
//! completes: then the permit settles with the real usage if the response reports one,
//! keeps or refunds the cost after an inner error (configurable) and releases
//! concurrency; dropped before that, it does what `on_cancel` says. A refused request
//! fails fast with a [`LimitError`](crate::LimitError) naming the limit, tier and retry
//! time, or, with [`wait`](crate::LimitLayer::wait), waits in arrival order for exactly as
//! long as needed.
//!
//! In shadow mode ([`shadow`](crate::LimitLayer::shadow)) a request that would be refused
//! is counted and passed on holding nothing; a limit in shadow mode
//! ([`LimitPolicy::shadow`](crate::LimitPolicy::shadow)) is decided by the backend, and
//! the grant says which one would have refused. Admissions, refusals, waits and leases are
//! reported where they are counted: a permit guard is made (an admission), dropped (the
//! lease ends), a refusal is counted, a waiter joins or leaves its queue; with the
//! `metrics` feature they go to the `metrics` facade (see the guide's page on metrics),
//! and without it that code is not compiled.
//!
//! ```
//! use std::convert::Infallible;
//! use tower::{ServiceBuilder, ServiceExt};
//! use tower_limits::extract::{Cost, CostFromExtension, FromExtension, Usage, UsageFromExtension};
//! use tower_limits::http::HttpAnswer;
//! use tower_limits::{LimitPolicy, LimitSetLayer, LimitSetPolicy, Quota, TenantKey, nz};
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), tower_limits::BoxError> {
//! let limits = LimitSetLayer::new(
//!     LimitSetPolicy::new()
//!         .tiers(["org", "user"])
//!         .limit(LimitPolicy::gcra("requests", Quota::per_minute(nz!(60)).burst(nz!(10))).per("user"))
//!         .limit(
//!             LimitPolicy::token_bucket("tokens", Quota::per_minute(nz!(100_000)).burst(nz!(20_000)))
//!                 .per("org")
//!                 .counting_cost(),
//!         )
//!         .limit(LimitPolicy::semaphore("concurrent", 4).per("org")),
//! )?
//! .key(FromExtension::<TenantKey>::new())
//! .cost(CostFromExtension)
//! .usage(UsageFromExtension)
//! .refuse_with(HttpAnswer::new().with_json_body());
//!
//! # let _: axum::Router = axum::Router::new().layer(limits.clone()); // it goes on a Router as it is
//! let svc = ServiceBuilder::new().layer(limits).service_fn(|_req: http::Request<String>| async {
//!     let mut response = http::Response::new(String::from("embedded"));
//!     response.extensions_mut().insert(Usage(640)); // what the upstream really used
//!     Ok::<_, Infallible>(response)
//! });
//!
//! let mut req = http::Request::new(String::new());
//! req.extensions_mut().insert(TenantKey::new(["acme", "alice"])?); // from the auth layer
//! req.extensions_mut().insert(Cost(812)); // estimated tokens
//! let response = svc.oneshot(req).await?;
//! assert_eq!(response.status(), 200);
//! # Ok(()) }
//! ```

#[cfg(feature = "http")]
pub mod body;
mod future;
mod layer;
mod service;
pub(crate) mod shared;

pub use future::ResponseFuture;
pub use layer::LimitLayer;
pub use service::LimitService;
pub use shared::{LayerStats, Unfinished};
