use std::num::NonZeroU64;

use tower_limits_core::algorithm::{CalendarPeriod, CalendarWindow};
use tower_limits_core::{LimitPolicy, LimitSet, PolicyError};

use super::{LimitLayer, door, single};
use crate::ReturnError;
use crate::extract::Extractors;
use crate::shell::shared::Settings;

/// A calendar budget: at most `limit` (of the requests' cost) per calendar day, week,
/// month or year, each period starting at midnight in a named time zone and resetting
/// there, daylight-saving changes and months of every length included (see
/// [`CalendarWindow`]). For "100 USD a month per team, renewed on the 1st in Berlin":
/// count the cost in micro-dollars with [`cost`](LimitLayer::cost) and settle it with
/// [`usage`](LimitLayer::usage) once the real price is known.
///
/// A refusal's wait (and the `RateLimit` fields' reset) is the time to the next period.
/// A [`LimitSetLayer`](crate::LimitSetLayer) of one limit (see [the named layers](crate::layers)).
///
/// ```
/// use tower::{ServiceBuilder, ServiceExt};
/// use tower_limits::core::algorithm::CalendarPeriod;
/// use tower_limits::extract::KeyFn;
/// use tower_limits::{CalendarWindowLayer, TenantKey, nz};
///
/// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
/// // 2 a day for each user, the days of Berlin.
/// let daily = CalendarWindowLayer::new(nz!(2), CalendarPeriod::Day, "Europe/Berlin")
///     .unwrap()
///     .key(KeyFn::new(|user: &&str| TenantKey::single(user).ok()));
/// let svc = ServiceBuilder::new().layer(daily).service_fn(|_req: &str| async { Ok::<_, std::convert::Infallible>(()) });
/// assert!(svc.clone().oneshot("alice").await.is_ok());
/// assert!(svc.clone().oneshot("alice").await.is_ok());
/// assert!(svc.clone().oneshot("alice").await.is_err());
/// assert!(svc.oneshot("bob").await.is_ok()); // each user has their own budget
/// # }
/// ```
pub type CalendarWindowLayer<E = Extractors, R = ReturnError, B = LimitSet> = LimitLayer<E, R, B, door::CalendarWindow>;

impl CalendarWindowLayer {
    /// At most `limit` per `period`, the periods starting at midnight in `timezone` (a
    /// name of the IANA time-zone database, bundled with the library: `"UTC"`,
    /// `"Europe/Berlin"`, `"America/New_York"`).
    ///
    /// # Errors
    /// A time zone the database does not know, naming the `timezone` field.
    pub fn new(limit: NonZeroU64, period: CalendarPeriod, timezone: &str) -> Result<Self, PolicyError> {
        CalendarWindow::new(limit.get(), period, timezone)?;
        let policy = LimitPolicy::calendar_window("calendar_window", limit.get(), period, timezone);
        Ok(single(policy, Settings::default()))
    }
}
