//! Metrics (feature `metrics`): what the Redis backend reports through the
//! [`metrics`](https://docs.rs/metrics) facade, next to the layers' families (see
//! `tower_limits::metrics`).
//!
//! | name | kind | labels | what |
//! |---|---|---|---|
//! | [`BACKEND_FAILURES`] | counter | `backend` (`redis` for the limits, `redis_accounts` for the upstream accounts' store), `kind` (`error`, `timeout`) | calls to Redis that failed or did not answer in time |
//! | [`BACKEND_CIRCUIT_OPENED`] | counter | `backend` | times the circuit breaker opened |
//! | [`BACKEND_UNAVAILABLE`] | counter | `backend` (`redis`), `decision` (`fail_open`, `fail_closed`, `fallback`) | acquisitions answered by the failure policy (the accounts' store falls back to the pool's local mirrors: see `rate_limiting.pool.selections`) |
//!
//! Every label comes from a fixed vocabulary. Building a backend registers every
//! series at zero, so that dashboards and alerts see them (and `rate()` works) before the
//! first failure.
//!
//! ```
//! assert_eq!(tower_limits_redis::metrics::BACKEND_UNAVAILABLE, "rate_limiting.backend.unavailable");
//! ```

/// Failed or timed-out calls to the backend, by `kind` (counter).
pub const BACKEND_FAILURES: &str = "rate_limiting.backend.failures";
/// Circuit-breaker openings (counter).
pub const BACKEND_CIRCUIT_OPENED: &str = "rate_limiting.backend.circuit_opened";
/// Acquisitions answered by the failure policy, by `decision` (counter).
pub const BACKEND_UNAVAILABLE: &str = "rate_limiting.backend.unavailable";

/// The `backend` label of a [`RedisBackend`](crate::RedisBackend).
pub(crate) const LIMITS: &str = "redis";
/// The `backend` label of the upstream accounts' store ([`RedisAccounts`](crate::accounts::RedisAccounts)).
pub(crate) const ACCOUNTS: &str = "redis_accounts";

/// Registers every series of `backend` at zero.
pub(crate) fn register(backend: &'static str) {
    for kind in ["error", "timeout"] {
        ::metrics::counter!(BACKEND_FAILURES, "backend" => backend, "kind" => kind).increment(0);
    }
    ::metrics::counter!(BACKEND_CIRCUIT_OPENED, "backend" => backend).increment(0);
    if backend == LIMITS {
        for decision in ["fail_open", "fail_closed", "fallback"] {
            ::metrics::counter!(BACKEND_UNAVAILABLE, "backend" => backend, "decision" => decision).increment(0);
        }
    }
}

pub(crate) fn failure(backend: &'static str, kind: &'static str) {
    ::metrics::counter!(BACKEND_FAILURES, "backend" => backend, "kind" => kind).increment(1);
}

pub(crate) fn circuit_opened(backend: &'static str) {
    ::metrics::counter!(BACKEND_CIRCUIT_OPENED, "backend" => backend).increment(1);
}

pub(crate) fn unavailable(decision: &'static str) {
    ::metrics::counter!(BACKEND_UNAVAILABLE, "backend" => "redis", "decision" => decision).increment(1);
}
