//! A member's limits as a lease's buckets are sized: one unit in the buckets' scale, their
//! capacity at a part of the burst, and the least part of the bursts that holds a request.

use super::{AccountLeases, WHOLE};

/// The requests the members allow in one refresh period, together.
pub(super) fn per_refresh(settings: &AccountLeases, limits: &[Vec<LeasedLimit>]) -> f64 {
    let refresh_ns = settings.refresh().as_nanos() as f64;
    limits
        .iter()
        .filter_map(|member| member.iter().find(|l| !l.cost))
        .map(|l| refresh_ns / l.interval.max(1) as f64)
        .sum()
}

/// The smallest fraction (in millionths) whose part of every limit's burst holds one
/// request of `cost`.
pub(in crate::accounts) fn least_part(limits: &[Vec<LeasedLimit>], cost: u64) -> u64 {
    limits
        .iter()
        .flatten()
        .map(|l| {
            let need = if l.cost { cost.clamp(1, l.burst.max(1)) } else { 1 };
            (u128::from(need) * u128::from(WHOLE)).div_ceil(u128::from(l.burst.max(1))) as u64
        })
        .max()
        .unwrap_or(1)
        .clamp(1, WHOLE)
}

/// One limit of a member, as its bucket is sized.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::accounts) struct LeasedLimit {
    /// Nanoseconds per unit at the limit's rate.
    pub(in crate::accounts) interval: u64,
    pub(in crate::accounts) burst: u64,
    /// Counts the request's cost (else one per request).
    pub(in crate::accounts) cost: bool,
}

impl LeasedLimit {
    /// One unit, in the bucket's scale (a unit's interval times [`WHOLE`]): a bucket
    /// holding `fraction` of the rate refills `fraction` a nanosecond.
    pub(super) fn unit(&self) -> i128 {
        i128::from(self.interval.max(1)) * i128::from(WHOLE)
    }

    pub(super) fn capacity(&self, fraction: u64) -> i128 {
        i128::from(self.burst) * i128::from(self.interval.max(1)) * i128::from(fraction)
    }

    /// The refill a nanosecond.
    pub(super) fn refill(fraction: u64) -> i128 {
        i128::from(fraction)
    }

    pub(super) fn need(&self, cost: u64) -> i128 {
        i128::from(if self.cost { cost } else { 1 }) * self.unit()
    }

    /// Takes `(interval, tolerance)` (ns) as the limit, its bucket `t` keeping the units it
    /// holds up to its capacity at `fraction` of the burst; whether the limit changed.
    pub(super) fn replace(&mut self, t: &mut i128, (interval, tolerance): (u64, u64), fraction: u64) -> bool {
        if interval == 0 || interval == self.interval && tolerance / interval == self.burst {
            return false;
        }
        let old = self.interval.max(1);
        (self.interval, self.burst) = (interval, tolerance / interval);
        *t = (*t * i128::from(interval) / i128::from(old)).min(self.capacity(fraction));
        true
    }
}
