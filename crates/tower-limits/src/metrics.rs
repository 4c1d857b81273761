//! Metrics (feature `metrics`): the names the layers report under, through the
//! [`metrics`](https://docs.rs/metrics) facade.
//!
//! # Why the `metrics` facade
//!
//! A library should not choose where its numbers go. The `metrics` crate is a facade
//! like `log`: the layers call `counter!`, `gauge!` and `histogram!`, and the
//! application installs one recorder (most Rust services use
//! `metrics-exporter-prometheus`; StatsD, Datadog and OpenTelemetry bridges exist).
//! Without a recorder every call is a no-op. OpenTelemetry's Rust SDK was the other
//! candidate: it is heavier to depend on from a middleware (an SDK, a meter provider to
//! thread through, a runtime for its exporters), and services that use it can still
//! receive these numbers through a `metrics`-to-OpenTelemetry bridge. The names follow
//! OpenTelemetry's conventions all the same, as ASP.NET Core's rate limiting does
//! (`rate_limiting.requests`, `rate_limiting.request.time_in_queue`, ...): a Prometheus
//! exporter turns the dots into underscores.
//!
//! Without the feature nothing here exists and the layers carry no metrics code at all:
//! no field, no branch, no clock read.
//!
//! # Families and labels
//!
//! | name | kind | labels | what |
//! |---|---|---|---|
//! | [`REQUESTS`] | counter | `layer`, `result`, and for refusals `reason`, `limit`, `tier` | every decision: `result` is `admitted`, `refused`, `shadow_refused` (shadow mode let it through) or `cancelled` (dropped while it waited) |
//! | [`TIME_IN_QUEUE`] | histogram (seconds) | `layer`, `result` (`admitted`, `refused`, `cancelled`) | how long a request waited (wait mode, or the fair queue) |
//! | [`LEASE_DURATION`] | histogram (seconds) | `layer` | how long an admitted request held its permit (to the end of its body with `hold_body`) |
//! | [`ACTIVE_LEASES`] | gauge | `layer` | permits held now |
//! | [`QUEUED_REQUESTS`] | gauge | `layer`, and `tenant` for configured tenants only | requests waiting now |
//! | [`POOL_SELECTIONS`] | counter | `member` | which upstream account a [`LimitPool`](crate::LimitPool) chose |
//! | [`UPSTREAM_RESPONSES`] | counter | `member`, `result` (`rate_limited`, `ok`) | what upstreams told the pool ([`LimitPool::observe`](crate::LimitPool::observe)) |
//!
//! `reason` is one of `rate_limited`, `concurrency_limited`, `queue_full`,
//! `tenant_queue_full`, `wait_timed_out`, `cost_above_capacity`, `missing_key`,
//! `key_source_missing` (the server never provides the key: see the warning logged),
//! `key_table_full`, `unavailable`, or `shadow_limit` (a limit in shadow mode would have
//! refused). The Redis backend (its own `metrics` feature) adds `rate_limiting.backend.*`
//! families.
//!
//! Every label is bounded: `layer` is the name given with
//! [`LimitLayer::metrics_name`](crate::LimitLayer::metrics_name) (`default` otherwise);
//! `limit` and `tier` come from the policy; `member` from the pool's configuration;
//! `tenant` only from the list given to
//! [`FairQueueLayer::metrics_tenants`](crate::FairQueueLayer::metrics_tenants). No label
//! ever carries an unbounded tenant key.
//!
//! Each family is described to the recorder, with its unit and a line of help (the `HELP`
//! and unit of a Prometheus exporter), by [`describe`]: the layers call it at their first
//! event, and an application that wants the descriptions before any traffic calls it
//! after installing its recorder.
//!
//! ```
//! use tower_limits::metrics::REQUESTS;
//! assert_eq!(REQUESTS, "rate_limiting.requests");
//! ```

/// Decisions, by `result` (counter).
pub const REQUESTS: &str = "rate_limiting.requests";
/// Time spent waiting for admission, in seconds (histogram).
pub const TIME_IN_QUEUE: &str = "rate_limiting.request.time_in_queue";
/// How long an admitted request held its permit, in seconds (histogram).
pub const LEASE_DURATION: &str = "rate_limiting.request_lease.duration";
/// Permits held now (gauge).
pub const ACTIVE_LEASES: &str = "rate_limiting.active_request_leases";
/// Requests waiting now (gauge).
pub const QUEUED_REQUESTS: &str = "rate_limiting.queued_requests";
/// Members a pool chose, by `member` (counter).
pub const POOL_SELECTIONS: &str = tower_limits_core::metrics::POOL_SELECTIONS;
/// Upstream answers a pool was told about, by `member` and `result` (counter).
pub const UPSTREAM_RESPONSES: &str = tower_limits_core::metrics::UPSTREAM_RESPONSES;

/// Describes every family above to the installed recorder: its unit and what it counts.
/// Called by the layers at their first event; call it yourself after installing a
/// recorder to have the descriptions before any traffic. Calling it again is harmless.
///
/// ```
/// use metrics_util::debugging::DebuggingRecorder;
///
/// use tower_limits::metrics::{REQUESTS, describe};
///
/// let recorder = DebuggingRecorder::new();
/// let snapshotter = recorder.snapshotter();
/// metrics::with_local_recorder(&recorder, || {
///     describe();
///     metrics::counter!(REQUESTS, "result" => "admitted").increment(1);
/// });
/// let (key, unit, help, _) = snapshotter.snapshot().into_vec().pop().unwrap();
/// assert_eq!(key.key().name(), REQUESTS);
/// assert_eq!(unit, Some(metrics::Unit::Count));
/// assert!(help.unwrap().starts_with("Decisions"));
/// ```
pub fn describe() {
    use ::metrics::{Unit, describe_counter, describe_gauge, describe_histogram};
    describe_counter!(
        REQUESTS,
        Unit::Count,
        "Decisions of the rate and concurrency limit layers, by result and reason."
    );
    describe_histogram!(TIME_IN_QUEUE, Unit::Seconds, "Time a request waited for admission.");
    describe_histogram!(LEASE_DURATION, Unit::Seconds, "Time an admitted request held its permit.");
    describe_gauge!(ACTIVE_LEASES, Unit::Count, "Permits held now.");
    describe_gauge!(QUEUED_REQUESTS, Unit::Count, "Requests waiting for admission now.");
    describe_counter!(POOL_SELECTIONS, Unit::Count, "Upstream accounts a limit pool chose, by member.");
    describe_counter!(
        UPSTREAM_RESPONSES,
        Unit::Count,
        "Upstream answers reported to a limit pool, by member and result."
    );
}
