//! The calendar window: a budget per calendar day, week, month or year in a named time
//! zone.
//!
//! "100 USD a month per team, resetting on the 1st at midnight in Berlin" is a window
//! whose length changes (28 to 31 days, a day of 23 or 25 hours across a daylight-saving
//! change), so it cannot be a [`FixedWindow`](super::FixedWindow) of a duration. A
//! calendar window counts cost from the start of the current period (midnight of its first
//! day in the limit's time zone) to the start of the next, and resets there. Within a
//! period it is exact: at most `limit` is granted (counting settled usage), a refund gives
//! back to the period the grant was made in, and a grant made in a period that has ended
//! is neither refunded nor charged (the new period starts from zero).
//!
//! Periods are computed with `jiff` and its bundled time-zone database, so a fresh
//! machine needs no system zone files and every machine agrees on the rules. A period's
//! bounds are computed once per key and period (at its first grant), not per request.
//!
//! # Instants and the calendar
//!
//! Decisions take a monotonic [`Instant`]; the window places it on the calendar through
//! the Unix time at which the clock reads [`Instant::ZERO`]. Every clock this library makes
//! ([`SystemClock`](crate::SystemClock) and the layers' clocks) counts from one origin
//! per process, whose Unix time is [`unix_origin`](crate::time::unix_origin): the default.
//! A [`ManualClock`](crate::ManualClock) starts wherever a test says, so a test sets the
//! origin with [`CalendarWindow::with_origin`] (or the policy's `clock_origin`). The
//! machine's wall clock is read once, when the origin is fixed: a process that runs for
//! months drifts from the wall clock by what the time service corrects (seconds a month
//! at most), and its period boundaries move by as much.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use jiff::ToSpan;
use jiff::civil::Date;
use jiff::tz::TimeZone;
use serde::{Deserialize, Serialize};

use super::{Algorithm, Refusal, Snapshot};
use crate::policy_error::PolicyError;
use crate::time::Instant;

/// The calendar period of a [`CalendarWindow`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CalendarPeriod {
    /// From midnight to midnight.
    Day,
    /// From Monday's midnight to the next Monday's (ISO 8601 weeks).
    Week,
    /// From midnight of the 1st to midnight of the next month's 1st.
    Month,
    /// From midnight of January 1st to the next year's.
    Year,
}

impl CalendarPeriod {
    /// The name used in policy files: `day`, `week`, `month` or `year`.
    ///
    /// ```
    /// use tower_limits_core::algorithm::CalendarPeriod;
    ///
    /// assert_eq!(CalendarPeriod::Month.as_str(), "month");
    /// assert_eq!("week".parse::<CalendarPeriod>(), Ok(CalendarPeriod::Week));
    /// ```
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            CalendarPeriod::Day => "day",
            CalendarPeriod::Week => "week",
            CalendarPeriod::Month => "month",
            CalendarPeriod::Year => "year",
        }
    }

    /// The first day of the period holding `date`, and the first day of the next one.
    fn bounds(self, date: Date) -> Result<(Date, Date), jiff::Error> {
        let start = match self {
            CalendarPeriod::Day => date,
            CalendarPeriod::Week => date.checked_sub(i64::from(date.weekday().to_monday_zero_offset()).days())?,
            CalendarPeriod::Month => date.first_of_month(),
            CalendarPeriod::Year => date.first_of_year(),
        };
        let next = match self {
            CalendarPeriod::Day => start.checked_add(1.day())?,
            CalendarPeriod::Week => start.checked_add(1.week())?,
            CalendarPeriod::Month => start.checked_add(1.month())?,
            CalendarPeriod::Year => start.checked_add(1.year())?,
        };
        Ok((start, next))
    }
}

impl std::str::FromStr for CalendarPeriod {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "day" => Ok(CalendarPeriod::Day),
            "week" => Ok(CalendarPeriod::Week),
            "month" => Ok(CalendarPeriod::Month),
            "year" => Ok(CalendarPeriod::Year),
            other => Err(format!("unknown calendar period {other:?} (use day, week, month or year)")),
        }
    }
}

impl std::fmt::Display for CalendarPeriod {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// At most `limit` units per calendar period in a time zone.
///
/// ```
/// use std::time::{Duration, SystemTime};
/// use tower_limits_core::Instant;
/// use tower_limits_core::algorithm::{Algorithm, CalendarPeriod, CalendarWindow, Refusal};
///
/// // A clock whose origin is 2026-03-31 12:00 UTC, and 100 units a month in Berlin.
/// let origin = SystemTime::UNIX_EPOCH + Duration::from_secs(1_774_958_400);
/// let budget = CalendarWindow::new(100, CalendarPeriod::Month, "Europe/Berlin")?.with_origin(origin);
/// let mut state = budget.fresh();
/// budget.acquire(&mut state, Instant::ZERO, 100).unwrap();
/// // The month ends at midnight in Berlin, 22:00 UTC: ten hours later.
/// assert_eq!(
///     budget.check(&state, Instant::ZERO, 1),
///     Err(Refusal::NotYet { retry_after: Some(Duration::from_secs(10 * 3600)) })
/// );
/// assert!(budget.acquire(&mut state, Instant::ZERO + Duration::from_secs(10 * 3600), 100).is_ok());
/// # Ok::<(), tower_limits_core::PolicyError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CalendarWindow {
    limit: u64,
    period: CalendarPeriod,
    zone_name: String,
    zone: TimeZone,
    /// Unix nanoseconds at `Instant::ZERO`.
    origin: i128,
}

/// The state of one key under [`CalendarWindow`]: the current period's bounds and what
/// was counted in it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CalendarWindowState {
    /// The end of the period counted in `count` (exclusive); zero for a fresh state.
    end: Instant,
    /// The period's length in nanoseconds (it may have begun before the clock's origin).
    len: u64,
    count: u64,
}

impl CalendarWindow {
    /// At most `limit` units per `period` in the time zone named `timezone` (a name of the
    /// IANA database such as `"Europe/Berlin"`, `"America/New_York"` or `"UTC"`).
    ///
    /// # Errors
    /// A zero limit (naming `limit`), or a time zone the database does not know (naming
    /// `timezone`).
    pub fn new(limit: u64, period: CalendarPeriod, timezone: &str) -> Result<Self, PolicyError> {
        if limit == 0 {
            return Err(PolicyError::new("limit", "must be at least 1"));
        }
        let zone = TimeZone::get(timezone).map_err(|_| {
            PolicyError::new(
                "timezone",
                format!("{timezone:?} is not a time zone of the IANA database (such as \"Europe/Berlin\" or \"UTC\")"),
            )
        })?;
        Ok(CalendarWindow {
            limit,
            period,
            zone_name: timezone.to_owned(),
            zone,
            origin: unix_nanos(crate::time::unix_origin()),
        })
    }

    /// The same window for a clock that reads [`Instant::ZERO`] at `origin` (a
    /// [`ManualClock`](crate::ManualClock) in a test). The default is
    /// [`unix_origin`](crate::time::unix_origin), the origin of every clock this library
    /// makes.
    #[must_use]
    pub fn with_origin(mut self, origin: SystemTime) -> Self {
        self.origin = unix_nanos(origin);
        self
    }

    /// The most per period.
    #[must_use]
    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// The calendar period.
    #[must_use]
    pub fn period(&self) -> CalendarPeriod {
        self.period
    }

    /// The time zone's name, as given.
    #[must_use]
    pub fn timezone(&self) -> &str {
        &self.zone_name
    }

    /// The bounds of the period holding `now`, as instants of the clock: its start (zero
    /// when it began before the clock's origin) and its end.
    ///
    /// ```
    /// use std::time::{Duration, SystemTime};
    /// use tower_limits_core::Instant;
    /// use tower_limits_core::algorithm::{CalendarPeriod, CalendarWindow};
    ///
    /// // 2026-10-24 12:00 UTC; Berlin's clocks go back an hour on the 25th.
    /// let origin = SystemTime::UNIX_EPOCH + Duration::from_secs(1_792_843_200);
    /// let day = CalendarWindow::new(1, CalendarPeriod::Day, "Europe/Berlin")?.with_origin(origin);
    /// let hour = 3_600_000_000_000;
    /// let (_, end) = day.period_at(Instant::ZERO);
    /// assert_eq!(end, Instant::from_nanos(10 * hour)); // midnight in Berlin, 22:00 UTC
    /// let (start, next) = day.period_at(end);
    /// assert_eq!((start, next.as_nanos() - start.as_nanos()), (end, 25 * hour));
    /// # Ok::<(), tower_limits_core::PolicyError>(())
    /// ```
    #[must_use]
    pub fn period_at(&self, now: Instant) -> (Instant, Instant) {
        let (start, end) = self.unix_period_at(now);
        let start = Instant::from_nanos(u64::try_from((start - self.origin).max(0)).unwrap_or(u64::MAX));
        (start.min(now), self.instant_after(end, now))
    }

    /// The clock's instant at Unix nanoseconds `unix`, at least a nanosecond after `now`.
    fn instant_after(&self, unix: i128, now: Instant) -> Instant {
        let at = Instant::from_nanos(u64::try_from((unix - self.origin).max(0)).unwrap_or(u64::MAX));
        at.max(Instant::from_nanos(now.as_nanos().saturating_add(1)))
    }

    /// The bounds of the period holding `now` in Unix nanoseconds (the wall-clock time
    /// this window's clock origin places them at): what a shared store that counts in
    /// wall-clock time is told.
    ///
    /// ```
    /// use std::time::{Duration, SystemTime};
    /// use tower_limits_core::Instant;
    /// use tower_limits_core::algorithm::{CalendarPeriod, CalendarWindow};
    ///
    /// let origin = SystemTime::UNIX_EPOCH + Duration::from_secs(90_000); // 1970-01-02 01:00 UTC
    /// let day = CalendarWindow::new(1, CalendarPeriod::Day, "UTC")?.with_origin(origin);
    /// assert_eq!(day.unix_period_at(Instant::ZERO), (86_400_000_000_000, 172_800_000_000_000));
    /// # Ok::<(), tower_limits_core::PolicyError>(())
    /// ```
    #[must_use]
    pub fn unix_period_at(&self, now: Instant) -> (i128, i128) {
        let unix = self.origin + i128::from(now.as_nanos());
        let bounds = jiff::Timestamp::from_nanosecond(unix).ok().and_then(|t| {
            let date = t.to_zoned(self.zone.clone()).date();
            let (start, next) = self.period.bounds(date).ok()?;
            let at = |d: Date| d.to_zoned(self.zone.clone()).ok().map(|z| z.timestamp().as_nanosecond());
            Some((at(start)?, at(next)?))
        });
        // Beyond the calendar's range (year 9999): one period to the end of time.
        bounds.unwrap_or((unix, i128::MAX))
    }

    /// The length in nanoseconds of the period holding `now` (23 hours for a day that
    /// springs forward, 29 days for February 2028): what a snapshot states as its window.
    #[must_use]
    pub fn period_len_at(&self, now: Instant) -> u64 {
        let (start, end) = self.unix_period_at(now);
        u64::try_from(end - start).unwrap_or(u64::MAX)
    }

    /// The state of the period holding `now`: the state itself when it is current.
    fn view(&self, s: &CalendarWindowState, now: Instant) -> CalendarWindowState {
        if now < s.end {
            *s
        } else {
            let (start, end) = self.unix_period_at(now);
            CalendarWindowState {
                end: self.instant_after(end, now),
                len: u64::try_from(end - start).unwrap_or(u64::MAX),
                count: 0,
            }
        }
    }

    fn adjust(&self, state: &mut CalendarWindowState, now: Instant, granted_at: Instant, f: impl Fn(u64) -> u64) {
        // Only a grant of the period the state counts: an ended period's grant has left it.
        let start = Instant::from_nanos(state.end.as_nanos().saturating_sub(state.len));
        if now < state.end && granted_at >= start && granted_at < state.end {
            state.count = f(state.count);
        }
    }
}

fn unix_nanos(t: SystemTime) -> i128 {
    match t.duration_since(UNIX_EPOCH) {
        Ok(d) => i128::try_from(d.as_nanos()).unwrap_or(i128::MAX),
        Err(e) => -i128::try_from(e.duration().as_nanos()).unwrap_or(i128::MAX),
    }
}

impl Algorithm for CalendarWindow {
    type State = CalendarWindowState;

    fn fresh(&self) -> CalendarWindowState {
        CalendarWindowState::default()
    }

    fn capacity(&self) -> u64 {
        self.limit
    }

    fn check(&self, state: &CalendarWindowState, now: Instant, cost: u64) -> Result<(), Refusal> {
        if cost > self.limit {
            return Err(Refusal::Never { capacity: self.limit });
        }
        // An ended period counts nothing: no calendar arithmetic on this path.
        let count = if now < state.end { state.count } else { 0 };
        if count.saturating_add(cost) <= self.limit {
            Ok(())
        } else {
            Err(Refusal::NotYet { retry_after: Some(state.end.saturating_since(now)) })
        }
    }

    fn commit(&self, state: &mut CalendarWindowState, now: Instant, cost: u64) {
        let current = self.view(state, now);
        *state = CalendarWindowState { count: current.count.saturating_add(cost), ..current };
    }

    /// Takes the amount off the count while the grant's period is the current one.
    fn refund(&self, state: &mut CalendarWindowState, now: Instant, granted_at: Instant, amount: u64) {
        self.adjust(state, now, granted_at, |c| c.saturating_sub(amount));
    }

    /// Adds the amount to the count while the grant's period is the current one (it may
    /// go above the limit: the work is done; later requests of the period are refused).
    fn charge(&self, state: &mut CalendarWindowState, now: Instant, granted_at: Instant, amount: u64) {
        self.adjust(state, now, granted_at, |c| c.saturating_add(amount));
    }

    /// `reset` is the time to the end of the period (whether or not anything was
    /// counted: a budget's answer says when it renews), `window` the period's length.
    fn peek(&self, state: &CalendarWindowState, now: Instant) -> Snapshot {
        let current = self.view(state, now);
        Snapshot {
            quota: self.limit,
            remaining: self.limit.saturating_sub(current.count),
            reset: current.end.saturating_since(now),
            window: Duration::from_nanos(current.len),
        }
    }

    fn is_idle(&self, state: &CalendarWindowState, now: Instant) -> bool {
        now >= state.end || state.count == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HOUR: u64 = 3_600_000_000_000;

    /// Unix seconds of a civil date-time in a zone.
    fn unix(zone: &str, y: i16, m: i8, d: i8, h: i8) -> u64 {
        let dt = jiff::civil::date(y, m, d).at(h, 0, 0, 0);
        let z = dt.to_zoned(TimeZone::get(zone).unwrap()).unwrap();
        u64::try_from(z.timestamp().as_second()).unwrap()
    }

    /// The bounds in Unix seconds of the `period` in `zone` holding a civil time there, from
    /// a window whose clock counts from the Unix epoch.
    fn bounds(zone: &str, period: CalendarPeriod, y: i16, m: i8, d: i8, h: i8) -> (u64, u64) {
        let w = CalendarWindow::new(1, period, zone).unwrap().with_origin(UNIX_EPOCH);
        let (s, e) = w.period_at(Instant::from_nanos(unix(zone, y, m, d, h) * 1_000_000_000));
        (s.as_nanos() / 1_000_000_000, e.as_nanos() / 1_000_000_000)
    }

    fn hours(b: (u64, u64)) -> u64 {
        (b.1 - b.0) / 3600
    }

    #[test]
    fn periods_follow_the_calendar_across_daylight_saving_and_month_ends() {
        let berlin = "Europe/Berlin";
        // Days of 23 and 25 hours; the autumn day starts at its midnight.
        assert_eq!(hours(bounds(berlin, CalendarPeriod::Day, 2026, 3, 29, 12)), 23);
        let autumn = bounds(berlin, CalendarPeriod::Day, 2026, 10, 25, 12);
        assert_eq!((autumn.0, hours(autumn)), (unix(berlin, 2026, 10, 25, 0), 25));
        // February 2028 has 29 days; a month across the spring change is an hour short.
        assert_eq!(hours(bounds(berlin, CalendarPeriod::Month, 2028, 2, 10, 0)), 29 * 24);
        let march = bounds(berlin, CalendarPeriod::Month, 2026, 3, 31, 23);
        assert_eq!(hours(march), 31 * 24 - 1);
        assert_eq!(march.1, unix(berlin, 2026, 4, 1, 0));
        // ISO weeks start on Monday: 2026-11-28 is a Saturday.
        let week = bounds(berlin, CalendarPeriod::Week, 2026, 11, 28, 15);
        assert_eq!(week, (unix(berlin, 2026, 11, 23, 0), unix(berlin, 2026, 11, 30, 0)));
        // A leap year in UTC; New York's day starts 6 hours after Berlin's.
        assert_eq!(hours(bounds("UTC", CalendarPeriod::Year, 2028, 7, 1, 0)), 366 * 24);
        let ny = bounds("America/New_York", CalendarPeriod::Day, 2026, 6, 1, 0);
        assert_eq!(ny.0, unix(berlin, 2026, 6, 1, 6));
    }

    #[test]
    fn a_period_begun_before_the_clock_s_origin_starts_at_zero() {
        let origin = UNIX_EPOCH + Duration::from_secs(unix("UTC", 2026, 1, 1, 18));
        let w = CalendarWindow::new(1, CalendarPeriod::Day, "UTC").unwrap().with_origin(origin);
        assert_eq!(w.period_at(Instant::ZERO), (Instant::ZERO, Instant::from_nanos(6 * HOUR)));
        assert_eq!(w.period_at(Instant::from_nanos(HOUR)), (Instant::ZERO, Instant::from_nanos(6 * HOUR)));
        // The next day starts on the clock, 6 hours in, and is a whole day long.
        let next = Instant::from_nanos(7 * HOUR);
        assert_eq!(w.period_at(next), (Instant::from_nanos(6 * HOUR), Instant::from_nanos(30 * HOUR)));
        assert_eq!(w.period_len_at(Instant::ZERO), 24 * HOUR, "the whole day, not the part after the origin");
        // A clock whose origin is before 1970 (six hours before the epoch).
        let early = UNIX_EPOCH.checked_sub(Duration::from_secs(6 * 3600)).unwrap();
        let w = CalendarWindow::new(1, CalendarPeriod::Day, "UTC").unwrap().with_origin(early);
        assert_eq!(w.period_at(Instant::ZERO).1, Instant::from_nanos(6 * HOUR));
    }

    #[test]
    fn a_window_states_its_parameters() {
        let w = CalendarWindow::new(7, CalendarPeriod::Week, "Europe/Berlin").unwrap();
        assert_eq!((w.limit(), w.capacity(), w.period(), w.timezone()), (7, 7, CalendarPeriod::Week, "Europe/Berlin"));
        for (p, name) in [
            (CalendarPeriod::Day, "day"),
            (CalendarPeriod::Week, "week"),
            (CalendarPeriod::Month, "month"),
            (CalendarPeriod::Year, "year"),
        ] {
            assert_eq!((p.as_str(), p.to_string(), name.parse()), (name, name.to_owned(), Ok(p)));
        }
    }

    #[test]
    fn the_budget_resets_at_the_period_s_end_and_refunds_only_its_own_period() {
        let w = CalendarWindow::new(10, CalendarPeriod::Day, "UTC")
            .unwrap()
            .with_origin(UNIX_EPOCH + Duration::from_secs(unix("UTC", 2026, 1, 1, 18)));
        let mut s = w.fresh();
        w.acquire(&mut s, Instant::ZERO, 8).unwrap();
        assert_eq!(
            w.check(&s, Instant::from_nanos(HOUR), 3),
            Err(Refusal::NotYet { retry_after: Some(Duration::from_nanos(5 * HOUR)) })
        );
        w.refund(&mut s, Instant::from_nanos(HOUR), Instant::ZERO, 3);
        assert!(w.check(&s, Instant::from_nanos(HOUR), 5).is_ok());
        w.charge(&mut s, Instant::from_nanos(HOUR), Instant::ZERO, 10);
        assert_eq!(w.peek(&s, Instant::from_nanos(HOUR)).remaining, 0);
        // The next day: the old grant is neither refunded nor charged.
        let next = Instant::from_nanos(6 * HOUR);
        assert!(w.is_idle(&s, next));
        w.acquire(&mut s, next, 1).unwrap();
        w.refund(&mut s, next, Instant::ZERO, 1);
        w.charge(&mut s, next, Instant::ZERO, 9);
        let snap = w.peek(&s, next);
        assert_eq!(
            (snap.remaining, snap.reset, snap.window),
            (9, Duration::from_nanos(24 * HOUR), Duration::from_nanos(24 * HOUR))
        );
        assert_eq!(w.check(&s, next, 11), Err(Refusal::Never { capacity: 10 }));
    }

    #[test]
    fn bad_parameters_name_their_field() {
        assert_eq!(CalendarWindow::new(0, CalendarPeriod::Day, "UTC").unwrap_err().field(), "limit");
        let e = CalendarWindow::new(1, CalendarPeriod::Day, "Mars/Olympus").unwrap_err();
        assert_eq!(e.field(), "timezone");
        assert!(e.to_string().contains("Mars/Olympus"), "{e}");
        assert!("fortnight".parse::<CalendarPeriod>().unwrap_err().contains("day, week, month or year"));
    }
}
