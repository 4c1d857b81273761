//! Tower middleware for rate limiting, concurrency limiting and multi-tenant fairness.
//!
//! Each limit type is a named layer that wraps a service ([`GcraLayer`],
//! [`TokenBucketLayer`], [`LeakyBucketLayer`], [`SlidingWindowLayer`],
//! [`FixedWindowLayer`], [`SemaphoreLayer`]); a [`LimitSetLayer`] composes limits so that a
//! request takes all of them or none, keyed by tenant tiers taken from the request, costed
//! (for example in tokens) and settled to the real usage once the response is known; a
//! [`FairQueueLayer`] shares capacity between tenants by weight. A constant limit is a
//! [`Quota`], so building a layer cannot fail; limits read from data are a
//! [`LimitSetPolicy`], whose errors name the field. The algorithms, the engine and the
//! policies live in the sans-IO [`tower_limits_core`], re-exported here.
//!
//! ```
//! use std::convert::Infallible;
//! use tower::{ServiceBuilder, ServiceExt};
//! use tower_limits::{GcraLayer, LimitError, Quota, nz};
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! let svc = ServiceBuilder::new()
//!     .layer(GcraLayer::new(Quota::per_second(nz!(10)).burst(nz!(2))))
//!     .service_fn(|req: &'static str| async move { Ok::<_, Infallible>(req) });
//! assert_eq!(svc.clone().oneshot("a").await.unwrap(), "a");
//! assert_eq!(svc.clone().oneshot("b").await.unwrap(), "b");
//! let refused = svc.oneshot("c").await.unwrap_err();
//! let refused = refused.downcast_ref::<LimitError>().unwrap();
//! assert_eq!(refused.limit(), Some("gcra"));
//! # }
//! ```
//!
//! - [`layers`]: the named layers, one per limit type, and how they relate.
//! - [`shell`]: the one middleware under every limit layer: its service and future,
//!   waiting and settling.
//! - [`fair_queue`]: a weighted-fair tenant queue in front of shared capacity.
//! - [`extract`]: keys, costs and usage from requests and responses.
//! - [`http`] (feature `http`, on by default): `429`/`503` answers with `Retry-After` and
//!   the `RateLimit` fields.
//! - `grpc` (feature `tonic`): `RESOURCE_EXHAUSTED` statuses.
//! - `metrics` (feature `metrics`): the names the layers report under.
//! - [`guide`]: concepts, choosing an algorithm, the laws, HTTP answers, streamed bodies,
//!   metrics and shadow mode, migrating from tower, governor and tower_governor.

mod clock;
mod error;
pub mod extract;
pub mod fair_queue;
#[cfg(feature = "tonic")]
mod grpc;
#[cfg(feature = "http")]
pub mod http;
pub mod layers;
mod meter;
#[cfg(feature = "metrics")]
pub mod metrics;
mod reject;
pub mod shell;
mod wait;

pub use clock::LayerClock;
pub use error::{BoxError, ErrorKind, LimitError};
pub use fair_queue::{FairQueueLayer, FairQueueService};
#[cfg(feature = "tonic")]
pub use grpc::GrpcAnswer;
pub use layers::{
    FixedWindowLayer, GcraLayer, LeakyBucketLayer, LimitSetLayer, SemaphoreLayer, SlidingWindowLayer, TokenBucketLayer,
};
pub use reject::{Hold, Rejection, ReturnError};
pub use shell::{LayerStats, LimitLayer, LimitService, Unfinished};
pub use tower_limits_core::{
    AcquireError, Backend, Chosen, Grant, Instant, KeyPart, LimitPolicy, LimitPool, LimitSet, LimitSetPolicy,
    LimitSetStats, LimitSnapshot, PolicyError, Quota, Rate, Selection, SetError, Snapshot, TenantKey, UpstreamReport,
    nz,
};

/// The sans-IO core, in full.
pub use tower_limits_core as core;

/// The guide: concepts, choosing an algorithm, the laws, HTTP answers, streamed bodies,
/// metrics and shadow mode, and migrating.
pub mod guide {
    #[doc = include_str!("../docs/concepts.md")]
    pub mod concepts {}
    #[doc = include_str!("../docs/algorithms.md")]
    pub mod algorithms {}
    #[doc = include_str!("../docs/laws.md")]
    pub mod laws {}
    #[doc = include_str!("../docs/http.md")]
    pub mod http_answers {}
    #[doc = include_str!("../docs/performance.md")]
    pub mod performance {}
    #[doc = include_str!("../docs/streaming.md")]
    pub mod streaming {}
    #[doc = include_str!("../docs/metrics.md")]
    pub mod metrics_and_shadow {}
    #[doc = include_str!("../docs/migration.md")]
    pub mod migration {}
}
