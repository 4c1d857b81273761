//! Shared support for the integration tests in `tests/tests/`.

use proptest::test_runner::{Config, FileFailurePersistence};
use tower_limits_core::{AcquireError, Instant, LimitSet, LimitSnapshot, TenantKey};

/// A proptest configuration running `cases` cases, that keeps failing cases next to the
/// test file as `tests/tests/<file>.proptest-regressions` (proptest's default would put
/// them in a `proptest-regressions/` directory at the workspace root, because this crate
/// has a `lib.rs`). Commit those files: they are replayed first on every run.
#[must_use]
pub fn proptest_config(cases: u32) -> Config {
    Config {
        cases,
        failure_persistence: Some(Box::new(FileFailurePersistence::WithSource("proptest-regressions"))),
        ..Config::default()
    }
}

/// A comparable description of why an acquisition was refused: the kind, and for a
/// denial the blocking limit, the exact wait, whether a release is needed and the
/// snapshot. (`AcquireError` is not `PartialEq`: a denial holds the set's config.)
#[must_use]
pub fn describe(error: &AcquireError) -> String {
    match error {
        AcquireError::Denied(d) => format!(
            "denied by #{} {:?} (tier {:?}) retry {:?} release {} {:?}",
            d.limit_index(),
            d.limit(),
            d.tier(),
            d.retry_after(),
            d.needs_release(),
            d.snapshot()
        ),
        AcquireError::CostAboveCapacity(e) => format!("{e:?}"),
        AcquireError::MissingKey(e) => format!("{e:?}"),
        AcquireError::KeyTableFull(e) => format!("{e:?}"),
        other => format!("other: {other}"),
    }
}

/// The snapshots of every limit for every key, at `now`.
#[must_use]
pub fn peek_all(set: &LimitSet, keys: &[TenantKey], now: Instant) -> Vec<Vec<LimitSnapshot>> {
    keys.iter().map(|k| set.peek(k, now)).collect()
}

/// Tenant keys from `["org", "user"]` pairs.
///
/// # Panics
/// On an invalid key.
#[must_use]
pub fn keys(pairs: &[[&str; 2]]) -> Vec<TenantKey> {
    pairs.iter().map(|p| TenantKey::new(*p).expect("a valid key")).collect()
}
