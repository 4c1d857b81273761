//! Quotas, and rates as integer emission intervals.
//!
//! A rate limit is built from a [`Quota`]: a rate with its burst, valid by construction
//! (`Quota::per_minute(nz!(600)).burst(nz!(20))`), or checked once when read from data
//! ([`Quota::try_new`], [`Quota::try_burst`]). A [`Rate`] is the data form of the rate
//! alone, "`amount` units every `period`", as the `rate` field of a policy file spells it
//! (`rate = "600/1m"`); a policy's rate is checked when the policy is validated.
//!
//! The algorithms never see a rate as a floating-point number: it becomes an emission
//! interval, the whole number of nanoseconds one unit costs, rounded **up**. Rounding up
//! can only make the effective rate lower than the policy, never higher, so every
//! admission bound proved for the integer algorithms holds for the policy as written. A
//! rate whose rounding would cost more than 1% of its throughput (more than about ten
//! million units per second) is refused rather than silently weakened.

use std::fmt;
use std::num::NonZeroU64;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::policy_error::PolicyError;
use crate::time::{MAX_SPAN_NANOS, duration_to_nanos, parse_duration};

/// The spelling of a rate in a policy file: `amount` units per `period`, the `rate` field
/// of a [`LimitPolicy`](crate::LimitPolicy) (`rate = "600/1m"`, `"10/s"`).
///
/// In code, build a [`Quota`] instead, a rate with its burst that is valid by
/// construction: `Quota::per_minute(nz!(600)).burst(nz!(20))`. The layers, the
/// algorithms, [`LimitPolicy::gcra`](crate::LimitPolicy::gcra) and
/// [`LimitPolicy::token_bucket`](crate::LimitPolicy::token_bucket) take one, and
/// [`Quota::rate`] is its rate in this form. A `Rate` is plain data and may be invalid (a
/// zero amount or period, a rate too fast to represent): a policy holding one is refused
/// when it is validated, with an error naming the field.
///
/// ```
/// use std::time::Duration;
/// use tower_limits_core::{LimitPolicy, Quota, Rate, nz};
///
/// let limit = LimitPolicy::gcra("rpm", Quota::per_minute(nz!(600)).burst(nz!(20)));
/// let rate = limit.rate.unwrap();
/// assert_eq!(rate, Rate::new(600, Duration::from_secs(60)));
/// assert_eq!(rate.to_string(), "600/1m");
/// assert_eq!(rate.interval().unwrap(), Duration::from_millis(100));
/// assert_eq!(Rate::new(3, Duration::from_secs(1)).interval().unwrap().as_nanos(), 333_333_334);
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "crate::rate::RateRepr", into = "crate::rate::RateRepr")]
pub struct Rate {
    amount: u64,
    period: Duration,
}

impl Rate {
    /// `amount` units every `period`. Validity (non-zero, representable) is checked when
    /// a policy holding the rate is validated, with an error naming the field.
    #[must_use]
    pub const fn new(amount: u64, period: Duration) -> Self {
        Rate { amount, period }
    }

    /// The number of units per period.
    #[must_use]
    pub const fn amount(&self) -> u64 {
        self.amount
    }

    /// The period.
    #[must_use]
    pub const fn period(&self) -> Duration {
        self.period
    }

    /// The emission interval: what one unit costs in time, rounded up to the nanosecond.
    ///
    /// # Errors
    /// A zero amount, a zero period, or a rate too fast to represent within 1% at
    /// nanosecond resolution.
    pub fn interval(&self) -> Result<Duration, PolicyError> {
        self.interval_nanos().map(Duration::from_nanos)
    }

    pub(crate) fn interval_nanos(&self) -> Result<u64, PolicyError> {
        if self.amount == 0 {
            return Err(PolicyError::new("rate", "the amount must be at least 1"));
        }
        let period = duration_to_nanos(self.period);
        if period == 0 {
            return Err(PolicyError::new("rate", "the period must be longer than zero"));
        }
        match interval_of(self.amount, period) {
            Some(interval) => Ok(interval),
            None => Err(PolicyError::new(
                "rate",
                format!(
                    "{self} is too fast to represent at nanosecond resolution (one unit would \
                     cost {}ns after rounding, over 1% below the policy); count in larger units",
                    period.div_ceil(self.amount)
                ),
            )),
        }
    }
}

/// The emission interval of `amount` units per `period` nanoseconds (both non-zero),
/// rounded up, or `None` when rounding would take more than 1% of the rate away.
const fn interval_of(amount: u64, period: u64) -> Option<u64> {
    let interval = period.div_ceil(amount);
    // interval * amount >= period; the excess is what rounding takes away.
    let excess = interval as u128 * amount as u128 - period as u128;
    if excess * 100 > period as u128 { None } else { Some(interval) }
}

/// Whether `burst` units of `interval` nanoseconds fit the span a limit can represent.
const fn burst_fits(interval: u64, burst: u64) -> bool {
    match interval.checked_mul(burst) {
        Some(t) => t <= MAX_SPAN_NANOS,
        None => false,
    }
}

/// A rate with its burst, valid by construction: what a rate limit is built from, by the
/// layers, [`LimitSet::gcra`](crate::LimitSet::gcra),
/// [`LimitPolicy::gcra`](crate::LimitPolicy::gcra) and
/// [`LimitPolicy::token_bucket`](crate::LimitPolicy::token_bucket), and the algorithms
/// ([`Gcra::new`](crate::algorithm::Gcra::new)).
///
/// The constructors take [`NonZeroU64`] (write constants with [`nz!`](crate::nz)), so a
/// constant quota needs no `Result` and no `unwrap`. The burst, the most admitted at once,
/// defaults to the amount of one period (`per_second(100)` admits 100 at once after an
/// idle second) and is set with [`Quota::burst`]. For quotas read from data, use
/// [`Quota::try_new`] and [`Quota::try_burst`], whose errors name the field.
///
/// ```
/// use std::time::Duration;
/// use tower_limits_core::{Quota, nz};
///
/// let quota = Quota::per_second(nz!(100)).burst(nz!(20));
/// assert_eq!(quota.amount(), 100);
/// assert_eq!(quota.max_burst(), 20);
/// assert_eq!(quota.interval(), Duration::from_millis(10));
///
/// // A constant quota is checked while compiling.
/// const TOKENS: Quota = Quota::per_minute(nz!(1_000_000)).burst(nz!(100_000));
/// assert_eq!(TOKENS.to_string(), "1000000/1m burst 100000");
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Quota {
    amount: u64,
    period: u64,
    interval: u64,
    burst: u64,
}

impl Quota {
    /// `amount` per second, with a burst of `amount`.
    ///
    /// # Panics
    /// When `amount` is over ten million: one unit would cost less time than nanosecond
    /// resolution represents within 1% (count in larger units). In a `const`, while compiling.
    #[must_use]
    pub const fn per_second(amount: NonZeroU64) -> Quota {
        Self::of_period(amount, 1_000_000_000)
    }

    /// `amount` per minute, with a burst of `amount`.
    ///
    /// # Panics
    /// When `amount` is over 600 million (see [`Quota::per_second`]).
    #[must_use]
    pub const fn per_minute(amount: NonZeroU64) -> Quota {
        Self::of_period(amount, 60_000_000_000)
    }

    /// `amount` per hour, with a burst of `amount`.
    ///
    /// # Panics
    /// When `amount` is over 36 billion (see [`Quota::per_second`]).
    #[must_use]
    pub const fn per_hour(amount: NonZeroU64) -> Quota {
        Self::of_period(amount, 3_600_000_000_000)
    }

    /// `amount` per day, with a burst of `amount`.
    ///
    /// # Panics
    /// When `amount` is over 864 billion (see [`Quota::per_second`]).
    #[must_use]
    pub const fn per_day(amount: NonZeroU64) -> Quota {
        Self::of_period(amount, 86_400_000_000_000)
    }

    const fn of_period(amount: NonZeroU64, period: u64) -> Quota {
        let amount = amount.get();
        match interval_of(amount, period) {
            Some(interval) => Quota { amount, period, interval, burst: amount },
            None => panic!("a quota this fast cannot be represented at nanosecond resolution; count in larger units"),
        }
    }

    /// `amount` per `period`, from data: a zero amount or period, or a rate too fast to
    /// represent, is an error naming the field `rate`.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_limits_core::Quota;
    ///
    /// let quota = Quota::try_new(500, Duration::from_secs(10)).unwrap();
    /// assert_eq!(quota.interval(), Duration::from_millis(20));
    /// assert_eq!(Quota::try_new(0, Duration::from_secs(1)).unwrap_err().field(), "rate");
    /// ```
    ///
    /// # Errors
    /// What is wrong with the rate.
    pub fn try_new(amount: u64, period: Duration) -> Result<Quota, PolicyError> {
        let interval = Rate::new(amount, period).interval_nanos()?;
        let period = duration_to_nanos(period);
        if !burst_fits(interval, amount) {
            return Err(PolicyError::new("rate", "a period this long cannot be represented (at most 146 years)"));
        }
        Ok(Quota { amount, period, interval, burst: amount })
    }

    /// The same rate with room for `burst` at once.
    ///
    /// # Panics
    /// When `burst` units of the rate span more than 146 years, the longest a limit can
    /// represent. In a `const`, while compiling.
    #[must_use]
    pub const fn burst(self, burst: NonZeroU64) -> Quota {
        let burst = burst.get();
        if !burst_fits(self.interval, burst) {
            panic!("a burst this long cannot be represented: it spans more than 146 years");
        }
        Quota { burst, ..self }
    }

    /// [`Quota::burst`] from data.
    ///
    /// # Errors
    /// A zero burst, or one spanning more than 146 years, naming the field `burst`.
    pub fn try_burst(self, burst: u64) -> Result<Quota, PolicyError> {
        if burst == 0 {
            return Err(PolicyError::new("burst", "must be at least 1"));
        }
        if !burst_fits(self.interval, burst) {
            return Err(PolicyError::new(
                "burst",
                format!("{burst} units at {}ns each is longer than the 146 years a limit can span", self.interval),
            ));
        }
        Ok(Quota { burst, ..self })
    }

    /// The quota a policy's `rate` and `burst` fields describe, with the errors that
    /// validating a policy gives: the rate's first (naming `rate`), then the burst's
    /// (naming `burst`). Unlike `try_new(..)?.try_burst(..)`, it does not ask the rate's
    /// own amount to fit in the span of a limit: only the burst the policy gives.
    pub(crate) fn of_policy(rate: Rate, burst: u64) -> Result<Quota, PolicyError> {
        let interval = rate.interval_nanos()?;
        let period = duration_to_nanos(rate.period);
        Quota { amount: rate.amount, period, interval, burst: rate.amount }.try_burst(burst)
    }

    /// Units per period.
    #[must_use]
    pub const fn amount(&self) -> u64 {
        self.amount
    }

    /// The period.
    #[must_use]
    pub const fn period(&self) -> Duration {
        Duration::from_nanos(self.period)
    }

    /// The most admitted at once.
    #[must_use]
    pub const fn max_burst(&self) -> u64 {
        self.burst
    }

    /// What one unit costs in time, rounded up to the nanosecond.
    #[must_use]
    pub const fn interval(&self) -> Duration {
        Duration::from_nanos(self.interval)
    }

    /// [`Quota::interval`] in nanoseconds: at least 1, and at most 2^62 divided by the
    /// burst.
    pub(crate) const fn interval_nanos(&self) -> u64 {
        self.interval
    }

    /// The rate, as policies write it.
    #[must_use]
    pub const fn rate(&self) -> Rate {
        Rate::new(self.amount, Duration::from_nanos(self.period))
    }
}

impl fmt::Debug for Quota {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl fmt::Display for Quota {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} burst {}", self.rate(), self.burst)
    }
}

/// A [`NonZeroU64`] constant, checked while compiling: `nz!(100)`. Zero does not compile.
///
/// ```
/// use tower_limits_core::{Quota, nz};
///
/// let quota = Quota::per_minute(nz!(600)).burst(nz!(10));
/// assert_eq!(quota.max_burst(), 10);
/// ```
///
/// ```compile_fail
/// let zero = tower_limits_core::nz!(0);
/// ```
#[macro_export]
macro_rules! nz {
    ($n:expr) => {
        const {
            match ::core::num::NonZeroU64::new($n) {
                ::core::option::Option::Some(n) => n,
                ::core::option::Option::None => ::core::panic!("nz!(0): the value must be at least 1"),
            }
        }
    };
}

impl fmt::Debug for Rate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl fmt::Display for Rate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.amount, crate::time::format_duration(self.period))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn intervals_round_up() {
        let second = Duration::from_secs(1);
        assert_eq!(Rate::new(1, second).interval_nanos().unwrap(), 1_000_000_000);
        assert_eq!(Rate::new(3, second).interval_nanos().unwrap(), 333_333_334);
        assert_eq!(Rate::new(10_000_000, Duration::from_secs(60)).interval_nanos().unwrap(), 6_000);
        assert_eq!(Rate::new(1_000_000_000, second).interval_nanos().unwrap(), 1);
    }

    #[test]
    fn bad_rates_are_errors() {
        assert!(Rate::new(0, Duration::from_secs(1)).interval_nanos().is_err());
        assert!(Rate::new(5, Duration::ZERO).interval_nanos().is_err());
        // 600M/s would round to 2ns per unit: 17% below the policy.
        let err = Rate::new(600_000_000, Duration::from_secs(1)).interval_nanos().unwrap_err();
        assert!(err.to_string().contains("too fast"), "{err}");
    }
}

/// Parses a rate such as `600/1m`, `10/s` or `1000000/minute`.
///
/// # Errors
/// A message saying what was expected.
pub fn parse_rate(text: &str) -> Result<Rate, String> {
    let (amount, period) =
        text.split_once('/').ok_or_else(|| format!("expected a rate such as \"600/1m\" or \"10/s\", got {text:?}"))?;
    let amount: u64 = amount
        .trim()
        .replace('_', "")
        .parse()
        .map_err(|_| format!("expected a whole number before '/' in rate {text:?}"))?;
    let period = match period.trim() {
        "s" | "sec" | "second" => Duration::from_secs(1),
        "m" | "min" | "minute" => Duration::from_secs(60),
        "h" | "hour" => Duration::from_secs(3600),
        "d" | "day" => Duration::from_secs(86_400),
        other => parse_duration(other)?,
    };
    Ok(Rate::new(amount, period))
}

/// The textual form of [`Rate`] in policy files.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(transparent)]
#[doc(hidden)]
pub struct RateRepr(String);

impl TryFrom<RateRepr> for Rate {
    type Error = String;
    fn try_from(r: RateRepr) -> Result<Rate, String> {
        parse_rate(&r.0)
    }
}

impl From<Rate> for RateRepr {
    fn from(r: Rate) -> RateRepr {
        RateRepr(r.to_string())
    }
}

#[cfg(test)]
mod quota_tests {
    use super::*;
    use crate::{Limit, LimitPolicy, LimitSet, LimitSetPolicy};

    /// Every quota the infallible constructors accept builds every rate algorithm, and a
    /// policy's `rate` and `burst` fields hold it whole: the limit built from them has
    /// the very quota.
    fn builds(quota: Quota) {
        for limit in [LimitPolicy::gcra("q", quota), LimitPolicy::token_bucket("q", quota)] {
            match Limit::from_policy(&limit) {
                Ok(Limit::Gcra(g)) => assert_eq!(g.quota(), quota),
                Ok(Limit::TokenBucket(t)) => assert_eq!(t.quota(), quota),
                other => panic!("{quota}: {other:?}"),
            }
        }
        for limit in [
            LimitPolicy::gcra("q", quota),
            LimitPolicy::token_bucket("q", quota),
            LimitPolicy::sliding_window_log("q", quota.amount(), quota.period()),
            LimitPolicy::sliding_window_counter("q", quota.amount(), quota.period()),
            LimitPolicy::fixed_window("q", quota.amount(), quota.period()),
        ] {
            if let Err(e) = LimitSet::new(LimitSetPolicy::new().limit(limit)) {
                panic!("{quota} does not build: {e}");
            }
        }
    }

    #[test]
    fn constant_quotas_always_build() {
        builds(Quota::per_second(crate::nz!(1)));
        builds(Quota::per_second(crate::nz!(10_000_000)));
        builds(Quota::per_minute(crate::nz!(600_000_000)));
        builds(Quota::per_day(crate::nz!(1)).burst(crate::nz!(53_375)));
        builds(Quota::per_hour(crate::nz!(7)).burst(crate::nz!(1)));
        let widest = MAX_SPAN_NANOS / 1_000_000_000;
        builds(Quota::per_second(crate::nz!(1)).burst(NonZeroU64::new(widest).unwrap()));
    }

    #[test]
    #[should_panic(expected = "cannot be represented")]
    fn too_fast_a_constant_panics() {
        let _ = Quota::per_second(NonZeroU64::new(600_000_000).unwrap());
    }

    #[test]
    #[should_panic(expected = "146 years")]
    fn too_long_a_burst_panics() {
        let _ = Quota::per_day(crate::nz!(1)).burst(crate::nz!(53_376));
    }

    #[test]
    fn data_quotas_are_errors_naming_the_field() {
        assert_eq!(Quota::try_new(0, Duration::from_secs(1)).unwrap_err().field(), "rate");
        assert_eq!(Quota::try_new(1, Duration::ZERO).unwrap_err().field(), "rate");
        assert_eq!(Quota::try_new(600_000_000, Duration::from_secs(1)).unwrap_err().field(), "rate");
        assert_eq!(Quota::try_new(1, Duration::from_secs(u64::MAX)).unwrap_err().field(), "rate");
        let q = Quota::try_new(1, Duration::from_secs(86_400)).unwrap();
        assert_eq!(q.try_burst(0).unwrap_err().field(), "burst");
        assert_eq!(q.try_burst(53_376).unwrap_err().field(), "burst");
        assert_eq!(q.try_burst(53_375).unwrap().max_burst(), 53_375);
        builds(q.try_burst(53_375).unwrap());
    }
}
