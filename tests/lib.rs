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
        AcquireError::MissingTier(e) => format!("{e:?}"),
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

/// Parameters of the algorithms for the property laws, and their strategies.
pub mod params {
    use std::time::Duration;

    use proptest::prelude::*;
    use tower_limits_core::Rate;
    use tower_limits_core::algorithm::{FixedWindow, Gcra, SlidingWindowCounter, SlidingWindowLog, TokenBucket};

    /// `amount` per `period` nanoseconds, with a burst. The period is at least a hundred
    /// times the amount, so that every rate is representable (its rounding costs under 1%),
    /// and is rarely a multiple of the amount, so that rounding the interval up matters.
    #[derive(Debug, Clone, Copy)]
    pub struct RateParams {
        /// Units per period.
        pub amount: u64,
        /// The period in nanoseconds.
        pub period: u64,
        /// The burst.
        pub burst: u64,
    }

    impl RateParams {
        /// The rate.
        pub fn rate(self) -> Rate {
            Rate::new(self.amount, Duration::from_nanos(self.period))
        }

        /// The emission interval, rounded up as the core documents.
        pub fn interval(self) -> u64 {
            self.period.div_ceil(self.amount)
        }

        /// A GCRA of these parameters.
        pub fn gcra(self) -> Gcra {
            Gcra::new(self.rate(), self.burst).expect("a valid rate and burst")
        }

        /// A token bucket of these parameters.
        pub fn bucket(self) -> TokenBucket {
            TokenBucket::new(self.rate(), self.burst).expect("a valid rate and burst")
        }
    }

    /// Rates that are representable, rarely a whole number of nanoseconds per unit.
    pub fn rate_params() -> impl Strategy<Value = RateParams> {
        (1u64..=20, 1u64..=20).prop_flat_map(|(amount, burst)| {
            (amount * 100..=amount * 1_000_000).prop_map(move |period| RateParams { amount, period, burst })
        })
    }

    /// `limit` per `window` nanoseconds; windows as short as one nanosecond.
    #[derive(Debug, Clone, Copy)]
    pub struct WindowParams {
        /// The most per window.
        pub limit: u64,
        /// The window in nanoseconds.
        pub window: u64,
    }

    impl WindowParams {
        /// A step of the clock comparable to the time one unit of the limit takes.
        pub fn unit(self) -> u64 {
            (self.window / self.limit).max(1)
        }

        /// A sliding log of these parameters.
        pub fn log(self) -> SlidingWindowLog {
            SlidingWindowLog::new(self.limit, Duration::from_nanos(self.window)).expect("valid")
        }

        /// A sliding counter of these parameters.
        pub fn counter(self) -> SlidingWindowCounter {
            SlidingWindowCounter::new(self.limit, Duration::from_nanos(self.window)).expect("valid")
        }

        /// A fixed window of these parameters.
        pub fn fixed(self) -> FixedWindow {
            FixedWindow::new(self.limit, Duration::from_nanos(self.window)).expect("valid")
        }
    }

    /// Windows from one nanosecond to ten milliseconds.
    pub fn window_params() -> impl Strategy<Value = WindowParams> {
        (1u64..=20, prop_oneof![1 => 1u64..=16, 4 => 1u64..=10_000_000])
            .prop_map(|(limit, window)| WindowParams { limit, window })
    }
}

/// The workspace README, whose Rust snippets are compiled (and, but for servers, run)
/// as doctests of this crate: a snippet that would not compile for a user fails CI.
#[doc = include_str!("../README.md")]
mod readme {}
