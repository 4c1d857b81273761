//! Redis backend for tower-limits: one [`LimitSet`](tower_limits_core::LimitSet) policy
//! enforced across a fleet of replicas, one round trip per acquisition, or, with
//! [capacity shares](#capacity-shares), one call per replica per refresh period.
//!
//! When one gateway becomes several replicas, a limit kept in each process multiplies by
//! the number of replicas. A [`RedisBackend`] keeps the limits' state in Redis (or
//! Valkey) instead, and implements the core's [`Backend`](tower_limits_core::Backend)
//! seam, so every layer built on a limit set enforces one shared limit, with the same
//! algorithms, the same exact `retry_after` and the same all-or-nothing semantics as in
//! memory.
//!
//! ```no_run
//! use std::time::Duration;
//! use tower_limits_core::{LimitPolicy, LimitSetPolicy, Quota, nz};
//! use tower_limits_redis::{FailurePolicy, RedisBackend, RedisConnection};
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let policy = LimitSetPolicy::new()
//!     .tiers(["org", "user"])
//!     .limit(LimitPolicy::gcra("requests", Quota::per_minute(nz!(600)).burst(nz!(20))).per("user"))
//!     .limit(
//!         LimitPolicy::token_bucket("tokens", Quota::per_minute(nz!(1_000_000)).burst(nz!(100_000)))
//!             .per("org")
//!             .counting_cost(),
//!     )
//!     .limit(LimitPolicy::semaphore("concurrent", 8).per("org"));
//! let redis = RedisConnection::connect("redis://127.0.0.1:6379/").await?;
//! let backend = RedisBackend::builder(policy)
//!     .namespace("gateway")
//!     .timeout(Duration::from_millis(20))
//!     .on_failure(FailurePolicy::Fallback { share: 0.25 }) // four replicas
//!     .build(&redis)?;
//! // tower_limits::LimitSetLayer::with_backend(backend).key(...).cost(...) as in memory.
//! # let _ = backend;
//! # Ok(())
//! # }
//! ```
//!
//! Requires Redis 6.2 or later, or Valkey.
//!
//! # How an acquisition works
//!
//! Each set has one Lua script (generated from its policy when the backend is built; see
//! [`RedisBackend::script`]). An acquisition is one `EVALSHA` with the set's keys for the
//! tenant: the script reads the server's `TIME` once (integer microseconds: every replica
//! uses the same clock), evaluates every limit without writing, and commits all of them
//! only if all pass. The reply is integers only: granted or not, the server time, the
//! blocking limit and its exact wait, and each limit's remaining capacity and reset. After
//! a `NOSCRIPT` (script cache flushed, server restarted, failover) the backend sends one
//! `EVAL` of the full script, which caches it again: at most two round trips.
//!
//! Settling to the real usage, cancelling and releasing semaphore permits are one round
//! trip each, sent in the background on the tokio runtime, off the request path. Refusals
//! are cached locally until their exact `retry_after`, so a flood of refused requests
//! for one tenant costs no round trip at all. Refusals that need no state (a missing key
//! tier, a cost above a limit's capacity) are answered locally too.
//!
//! # Capacity shares
//!
//! Per request, the fleet waits on one Redis core. Built with
//! [`RedisBackendBuilder::shares`], each replica decides its rate limits, semaphores and
//! windows (budgets) from a share it holds, and refreshes all of them in one call per period (100 ms by
//! default): Redis work grows with the replicas and the tenants they are busy with, not
//! with requests. The fleet still admits at most each rate's burst plus its rate over
//! every window, with no excess, and holds at most each semaphore's capacity; capacity
//! follows the demand replicas report; a dead replica's share comes back within its
//! lifetime. Cold tenants take a rate from a pool in Redis, one round trip each. See
//! [`Shares`] and the [guide](guide::operations) for the scheme and its bounds.
//!
//! # State and key layout
//!
//! | algorithm | Redis type | value |
//! |---|---|---|
//! | GCRA, token bucket | string | the theoretical arrival time, whole microseconds (then `.nnn` nanoseconds if any) |
//! | fixed window | string | `window_start_us:count` |
//! | sliding-window counter | string | `window_start_us:previous:current` |
//! | sliding-window log | sorted set | one member per grant, scored by its time; member `=` carries the sum |
//! | semaphore | sorted set | one member `holder:weight` per grant, scored by its lease deadline (counting cost, member `=` carries the total) |
//!
//! Every key expires when its state has become indistinguishable from a fresh one, so
//! idle tenants leave nothing behind and Redis memory tracks active tenants only.
//!
//! Keys are `<namespace>:{<root>}[/<part>...]:<limit>:<kind>`: `tl:{acme}/alice:requests:g`
//! is the GCRA state of user `alice` of org `acme`. The hash tag `{<root>}` (the key's
//! broadest tier) puts all of a tenant's keys in one Cluster slot, so the script can take
//! them together. Tenant ids are escaped (`%XX` for anything but ASCII letters, digits
//! and `-_.~@+`), so no id can close the tag early or forge a separator; a number or an
//! IP address is written `#` and its text (`#42`), apart from any text id. See
//! [`RedisBackend::keys`] for a tenant's keys and [`key_slot`] for their slot.
//!
//! # Cluster slots and global limits
//!
//! A limit shared by every tenant (a global limit) lives under the tag `{*}`, a slot of
//! its own. On a standalone server that costs nothing. On a Redis Cluster one script
//! cannot touch two slots, so a set that mixes global and keyed limits is refused when it
//! is built ([`BuildError::CrossSlot`]) rather than failing with `CROSSSLOT` at run time.
//! Two ways out, each with its cost:
//!
//! - [`SlotLayout::OneSlot`]: every key of the set under one tag. Atomic and one round
//!   trip, but the whole set's traffic lands on one shard.
//! - Two layers: the tenant limits in one `LimitSetLayer` (spread over the cluster) and the
//!   global limits in another (one slot). Two round trips, and a request refused by the
//!   inner layer has been charged by the outer one until its guard gives the cost back
//!   (the layer's `on_error` setting).
//!
//! # Failure policies
//!
//! Every call has a short timeout ([`RedisBackendBuilder::timeout`], 50 ms by default).
//! A call that fails or times out is answered by the set's [`FailurePolicy`]:
//!
//! - [`FailurePolicy::FailClosed`] (the default): refuse with
//!   `AcquireError::Unavailable`, which the HTTP layer answers with 503.
//! - [`FailurePolicy::FailOpen`]: admit, and count it in
//!   [`RedisStats::fail_open_admits`].
//! - [`FailurePolicy::Fallback`]: decide with an in-memory set of this replica holding a
//!   configured share of every limit (1/n for n replicas).
//!
//! After a few failures in a row a circuit breaker opens: for a while acquisitions go to
//! the policy at once, without a network call, so a dead Redis does not add its timeout
//! to every request; then one probe is let through, and its success closes the breaker.
//!
//! A timed-out acquisition *may* have been granted. Its semaphore permits are released by
//! holder id as soon as Redis answers (the release is idempotent), and in any case when
//! their lease expires; its rate charges are kept (refunding a charge that never happened
//! would admit more than the limit).
//!
//! # Semaphores and leases
//!
//! A permit is a member `holder:weight` of the semaphore's sorted set, scored by its lease
//! deadline ([`RedisBackendBuilder::lease`], 30 s by default). Expired leases are reclaimed
//! by the next acquisition, so the permits of a crashed replica come back within one
//! lease. A live replica renews the leases of its grants every third of the lease (for at
//! most [`RedisBackendBuilder::max_hold`]); a holder can also renew by hand with
//! [`RedisBackend::renew`]. Release is idempotent: releasing twice, or after the lease was
//! reclaimed, changes nothing.
//!
//! # What to monitor
//!
//! [`RedisBackend::stats`] gives this replica's counters; on the server, `INFO
//! commandstats` and `SLOWLOG`.
//!
//! - `round_trips / acquisitions` near 1 (below 1 with cached refusals). A rise in
//!   `script_loads` means the script cache was flushed or a failover happened.
//! - `timeouts`, `errors`, `breaker_opened`, `breaker_open`: Redis is slow or away; each
//!   acquisition then follows the failure policy (`unavailable`, and `fail_open_admits` or
//!   `fallback_acquisitions`). Alert on `breaker_open`.
//! - `background_pending` should stay small; `background_failures` means releases or
//!   settles were given up (permits then return with their lease).
//! - `leases_held` is the number of permits this replica holds; it should follow the
//!   concurrency of the service.
//! - With the `metrics` feature, failures, breaker openings and the failure policy's
//!   decisions are also reported through the `metrics` facade (the `metrics` module):
//!   alert on `rate_limiting.backend.unavailable`.
//! - On the server: `cmdstat_evalsha` `usec_per_call` (a few microseconds per set), memory
//!   (`used_memory`: active tenants times limits, each key a few dozen bytes, a log one
//!   member per grant in its window), and `expired_keys`.
//!
//! A Redis failover loses at most the writes not yet replicated: limits may admit a little
//! more for a moment, never less. Replicas' clocks are not involved: only the server's
//! `TIME` decides.
//!
//! The [guide](guide::operations) has a longer version of these notes.

// docs.rs (`--cfg docsrs`): rustdoc's `doc_cfg` labels every item behind a feature with
// that feature.
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod accounts;
mod backend;
mod cache;
mod connection;
mod error;
mod failure;
mod keys;
#[cfg(feature = "metrics")]
pub mod metrics;
mod periodic;
pub mod script;
mod stats;
#[cfg(feature = "test-support")]
pub mod test_support;
mod throttle;

pub use accounts::{AccountLeases, AccountStats, RedisAccounts, RedisAccountsBuilder};
pub use backend::{GrantSource, RedisAcquire, RedisBackend, RedisBackendBuilder, RedisGrant, ShareGroup, Shares};
pub use connection::RedisConnection;
pub use error::BuildError;
pub use failure::FailurePolicy;
pub use keys::{SlotLayout, key_slot};
/// The redis-rs crate this backend is built on, for building connections by hand.
pub use redis;
pub use stats::RedisStats;

/// The operator's guide (`docs/redis.md` in the repository): failure policies, key layout,
/// cluster slots, leases, time and what to monitor.
pub mod guide {
    #[doc = include_str!("../docs/redis.md")]
    pub mod operations {}
}
