#![doc = include_str!("../README.md")]
//!
//! # Where things are
//!
//! - [`layers`]: the named layers, one per limit type, and how they relate.
//! - [`shell`]: the one middleware under every limit layer: its service and future,
//!   waiting and settling; [`shell::body`]: permits held by response bodies.
//! - [`fair_queue`]: a weighted-fair tenant queue in front of shared capacity.
//! - [`extract`]: keys, costs and usage from requests and responses.
//! - [`http`] (feature `http`, on by default): `429`/`503` answers with `Retry-After` and
//!   the `RateLimit` fields, [`http::error_response`] for error handlers, and reports of
//!   an upstream's answers.
//! - `GrpcAnswer` (feature `tonic`): `RESOURCE_EXHAUSTED` statuses.
//! - `metrics` (feature `metrics`): the names the layers report under.
//! - [`guide`]: concepts, choosing an algorithm, the laws, axum, outbound clients, HTTP
//!   answers, streamed bodies, metrics and shadow mode, performance, migrating from tower,
//!   governor and tower_governor.
#![cfg_attr(docsrs, feature(doc_cfg))]

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
mod refusal;
pub mod shell;
mod wait;

pub use clock::LayerClock;
pub use error::{BoxError, ErrorKind, LimitError};
pub use fair_queue::{FairQueueLayer, FairQueueService};
#[cfg(feature = "tonic")]
pub use grpc::{GRPC_RETRY_PUSHBACK_MS, GrpcAnswer};
pub use layers::{
    CalendarWindowLayer, FixedWindowLayer, GcraLayer, LeakyBucketLayer, LimitSetLayer, SemaphoreLayer,
    SlidingWindowLayer, TokenBucketLayer,
};
pub use refusal::{Hold, RefusalMode, ReturnError};
pub use shell::{LayerStats, LimitLayer, LimitService, Unfinished};
pub use tower_limits_core::{
    AcquireError, Backend, Chosen, Grant, Instant, KeyPart, LimitPolicy, LimitPool, LimitSet, LimitSetPolicy,
    LimitSetStats, LimitSnapshot, PolicyError, Quota, Rate, Selection, SetError, Snapshot, TenantKey, UpstreamReport,
    nz,
};

/// The sans-IO core, in full.
pub use tower_limits_core as core;

/// The guide: concepts, axum servers, outbound clients, choosing an algorithm, the laws,
/// HTTP answers, streamed bodies, metrics and shadow mode, performance, and migrating.
pub mod guide {
    #[doc = include_str!("../docs/concepts.md")]
    pub mod concepts {}
    #[doc = include_str!("../docs/axum.md")]
    pub mod axum {}
    #[doc = include_str!("../docs/clients.md")]
    pub mod clients {}
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
