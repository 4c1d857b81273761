//! The pace of the background tasks that renew and refresh.

use std::time::Duration;

use tokio::time::{Interval, MissedTickBehavior};

/// Ticks every `period`, the first `first` from now; a tick that comes late delays the
/// ones after it rather than firing the missed ones in a burst.
pub(crate) fn ticks(first: Duration, period: Duration) -> Interval {
    let mut ticks = tokio::time::interval_at(tokio::time::Instant::now() + first, period);
    ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
    ticks
}
