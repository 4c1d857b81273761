//! Metrics (feature `metrics`): what a [`LimitPool`](crate::LimitPool) reports through
//! the [`metrics`](https://docs.rs/metrics) facade.
//!
//! The rest of the families (decisions, queueing, leases) are reported by the layers of
//! `tower-limits`, whose guide lists them all. Here: which member each acquisition chose,
//! and what upstreams said about members. The `member` label is the member's configured
//! name, so it is bounded by the pool's configuration.
//!
//! ```
//! assert_eq!(tower_limits_core::metrics::POOL_SELECTIONS, "rate_limiting.pool.selections");
//! ```

/// Members chosen by a pool's acquisitions, by `member` (counter).
pub const POOL_SELECTIONS: &str = "rate_limiting.pool.selections";
/// Upstream answers given to [`LimitPool::observe`](crate::LimitPool::observe), by
/// `member` and `result`: `rate_limited` when the answer carried a retry time (a `429`),
/// `ok` otherwise (counter).
pub const UPSTREAM_RESPONSES: &str = "rate_limiting.upstream.responses";

#[inline]
pub(crate) fn selected(member: &std::sync::Arc<str>) {
    ::metrics::counter!(POOL_SELECTIONS, "member" => ::metrics::SharedString::from(member.clone())).increment(1);
}

#[inline]
pub(crate) fn upstream(member: &std::sync::Arc<str>, rate_limited: bool) {
    let result = if rate_limited { "rate_limited" } else { "ok" };
    ::metrics::counter!(UPSTREAM_RESPONSES, "member" => ::metrics::SharedString::from(member.clone()), "result" => result)
        .increment(1);
}
