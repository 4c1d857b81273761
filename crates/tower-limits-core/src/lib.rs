//! The sans-IO core of tower-limits.
//!
//! Everything here is plain data and pure decisions: no async runtime, no tower, no HTTP.
//! The `tower-limits` crate turns it into middleware; `tower-limits-redis` shares it
//! across a fleet.
//!
//! - [`time`]: monotonic time as integer nanoseconds, a [`Clock`] trait, a
//!   [`ManualClock`] for tests and a [`SystemClock`].
//! - [`algorithm`]: GCRA, token bucket, sliding-window log and counter, fixed window and
//!   a resource semaphore, each a state machine deciding `acquire(state, now, cost)`.
//! - [`LimitSet`]: named limits, global or keyed by a tier of a [`TenantKey`], acquired
//!   all or nothing, granting a [`Permit`] that settles and releases, or just checked
//!   ([`LimitSet::check`]) when nothing is kept.
//! - [`policy`]: limits as data, loadable from TOML and JSON, validated with errors that
//!   name the field.
//! - [`backend`]: the seam through which a set's state can live elsewhere.
//!
//! ```
//! use tower_limits_core::{Instant, LimitPolicy, LimitSet, LimitSetPolicy, Quota, TenantKey, nz};
//!
//! let set = LimitSet::new(
//!     LimitSetPolicy::new()
//!         .tiers(["tenant"])
//!         .limit(LimitPolicy::gcra("rps", Quota::per_second(nz!(5))).per("tenant")),
//! )
//! .unwrap();
//! let key = TenantKey::single("acme").unwrap();
//! let granted = (0..10).filter(|_| set.acquire(&key, 1, Instant::ZERO).is_ok()).count();
//! assert_eq!(granted, 5);
//! ```

// docs.rs (`--cfg docsrs`): rustdoc's `doc_cfg` labels every item behind a feature with
// that feature.
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod algorithm;
pub mod backend;
mod error;
pub mod fair_queue;
pub mod fleet;
mod key;
pub mod learn;
mod limit;
#[cfg(feature = "metrics")]
pub mod metrics;
pub mod policy;
mod policy_error;
pub mod pool;
mod rate;
mod set;
mod table;
pub mod time;

pub use algorithm::{Refusal, Snapshot};
pub use backend::{Backend, Observed};
pub use error::{AcquireError, CostAboveCapacity, KeyTableFull, LimitRefusal, MissingTier, SetError, Unavailable};
pub use fair_queue::{FairQueue, FairQueueConfig, QueueFull, QueueKind, Ticket};
pub use fleet::{FleetShares, TenantDemand};
pub use key::{KeyError, KeyPart, MAX_TIERS, TenantKey};
pub use limit::{Limit, LimitState, intern};
pub use policy::{AlgorithmKind, Counts, LimitPolicy, LimitSetPolicy, LoadError, PolicyError, Scope};
pub use pool::{
    Chosen, LimitPool, PoolAcquire, PoolGrant, Selection, SharedAccounts, SharedAcquire, SharedGrant, UpstreamReport,
};
pub use rate::{Quota, Rate};
pub use set::{Grant, LimitSet, LimitSetStats, LimitSnapshot, LimitStats, OwnedPermit, Permit};
pub use time::{Clock, Instant, ManualClock, SystemClock};
