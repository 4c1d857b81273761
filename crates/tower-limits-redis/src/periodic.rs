//! The pace of the background tasks that renew and refresh, and the rule their lifetimes
//! keep.

use std::time::Duration;

use tokio::time::{Interval, MissedTickBehavior};

/// Ticks every `period`, the first `first` from now; a tick that comes late delays the
/// ones after it rather than firing the missed ones in a burst.
pub(crate) fn ticks(first: Duration, period: Duration) -> Interval {
    let mut ticks = tokio::time::interval_at(tokio::time::Instant::now() + first, period);
    ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
    ticks
}

/// What a replica holds and renews every `refresh` (a share, an account lease) must live
/// through two refreshes and a call of `call`: one failed renewal leaves it covered until
/// the next one answers. The error names `field`.
pub(crate) fn check_lifetime(
    field: &'static str,
    refresh: Duration,
    lifetime: Duration,
    call: Duration,
) -> Result<(), crate::BuildError> {
    let least = refresh.saturating_mul(2).saturating_add(call);
    if lifetime < least {
        return Err(crate::BuildError::Invalid {
            field,
            message: format!("must be at least two refresh periods plus the timeout ({least:?}), got {lifetime:?}"),
        });
    }
    Ok(())
}
