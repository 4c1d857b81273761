//! Rates as integer emission intervals.
//!
//! A [`Rate`] is "`amount` units every `period`". The algorithms never see it as a
//! floating-point number: it becomes an emission interval, the whole number of
//! nanoseconds one unit costs, rounded **up**. Rounding up can only make the effective
//! rate lower than the policy, never higher, so every admission bound proved for the
//! integer algorithms holds for the policy as written. A rate whose rounding would cost
//! more than 1% of its throughput (more than about ten million units per second) is
//! refused by validation rather than silently weakened.

use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::policy_error::PolicyError;
use crate::time::{duration_to_nanos, parse_duration};

/// `amount` units per `period`: requests per minute, tokens per second, and so on.
///
/// ```
/// use std::time::Duration;
/// use tower_limits_core::Rate;
///
/// let rpm = Rate::per_minute(600);
/// assert_eq!(rpm.interval().unwrap(), Duration::from_millis(100));
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
    /// the rate is used to build a limit, with an error naming the field.
    #[must_use]
    pub const fn new(amount: u64, period: Duration) -> Self {
        Rate { amount, period }
    }

    /// `amount` units per second.
    #[must_use]
    pub const fn per_second(amount: u64) -> Self {
        Self::new(amount, Duration::from_secs(1))
    }

    /// `amount` units per minute.
    #[must_use]
    pub const fn per_minute(amount: u64) -> Self {
        Self::new(amount, Duration::from_secs(60))
    }

    /// `amount` units per hour.
    #[must_use]
    pub const fn per_hour(amount: u64) -> Self {
        Self::new(amount, Duration::from_secs(3600))
    }

    /// `amount` units per day.
    #[must_use]
    pub const fn per_day(amount: u64) -> Self {
        Self::new(amount, Duration::from_secs(86_400))
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
        let interval = period.div_ceil(self.amount);
        // interval * amount >= period; the excess is what rounding takes away.
        let excess = u128::from(interval) * u128::from(self.amount) - u128::from(period);
        if excess * 100 > u128::from(period) {
            return Err(PolicyError::new(
                "rate",
                format!(
                    "{self} is too fast to represent at nanosecond resolution (one unit would \
                     cost {interval}ns after rounding, over 1% below the policy); count in \
                     larger units"
                ),
            ));
        }
        Ok(interval)
    }
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
        assert_eq!(Rate::per_second(1).interval_nanos().unwrap(), 1_000_000_000);
        assert_eq!(Rate::per_second(3).interval_nanos().unwrap(), 333_333_334);
        assert_eq!(Rate::per_minute(10_000_000).interval_nanos().unwrap(), 6_000);
        assert_eq!(Rate::per_second(1_000_000_000).interval_nanos().unwrap(), 1);
    }

    #[test]
    fn bad_rates_are_errors() {
        assert!(Rate::per_second(0).interval_nanos().is_err());
        assert!(Rate::new(5, Duration::ZERO).interval_nanos().is_err());
        // 600M/s would round to 2ns per unit: 17% below the policy.
        let err = Rate::per_second(600_000_000).interval_nanos().unwrap_err();
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
