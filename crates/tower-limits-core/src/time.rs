//! Monotonic time as integer nanoseconds.
//!
//! Every decision in this crate takes `now` explicitly, as an [`Instant`]: a count of
//! nanoseconds since an arbitrary origin chosen by the [`Clock`] that produced it. No
//! decision reads a clock by itself, so the same inputs always give the same answer, and
//! a [`ManualClock`] can drive every law test deterministically.
//!
//! Instants from different clocks must not be mixed: their origins differ.

use std::fmt;
use std::ops::{Add, Sub};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// A point in monotonic time: nanoseconds since the origin of the clock that made it.
///
/// Arithmetic saturates: an instant never wraps around, and the distance between two
/// instants is never negative.
#[derive(Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Instant(u64);

impl Instant {
    /// The origin of the clock.
    pub const ZERO: Instant = Instant(0);

    /// An instant `nanos` nanoseconds after the clock's origin.
    #[must_use]
    pub const fn from_nanos(nanos: u64) -> Self {
        Instant(nanos)
    }

    /// Nanoseconds since the clock's origin.
    #[must_use]
    pub const fn as_nanos(self) -> u64 {
        self.0
    }

    /// The time from `earlier` to `self`, zero if `earlier` is later.
    #[must_use]
    pub const fn saturating_since(self, earlier: Instant) -> Duration {
        Duration::from_nanos(self.0.saturating_sub(earlier.0))
    }

    /// Nanoseconds from `earlier` to `self`, zero if `earlier` is later.
    #[must_use]
    pub const fn nanos_since(self, earlier: Instant) -> u64 {
        self.0.saturating_sub(earlier.0)
    }
}

impl fmt::Debug for Instant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Instant({}ns)", self.0)
    }
}

impl Add<Duration> for Instant {
    type Output = Instant;
    fn add(self, rhs: Duration) -> Instant {
        Instant(self.0.saturating_add(duration_to_nanos(rhs)))
    }
}

impl Sub<Duration> for Instant {
    type Output = Instant;
    fn sub(self, rhs: Duration) -> Instant {
        Instant(self.0.saturating_sub(duration_to_nanos(rhs)))
    }
}

/// The longest span a limit can cover: 2^62 nanoseconds, about 146 years. A burst (its
/// emission intervals added up) or a window longer than that is refused by validation,
/// which leaves every sum of an instant and a span below `u64::MAX` (instants count from
/// the start of a process).
pub(crate) const MAX_SPAN_NANOS: u64 = 1 << 62;

/// A duration in whole nanoseconds, saturating at `u64::MAX` (about 584 years).
#[must_use]
pub const fn duration_to_nanos(d: Duration) -> u64 {
    let n = d.as_nanos();
    if n > u64::MAX as u128 { u64::MAX } else { n as u64 }
}

/// A source of monotonic time.
///
/// Implementations must never go backwards. The layers use a clock that follows
/// `tokio::time`, so that `tokio::time::pause()` drives them in tests; the law tests use
/// [`ManualClock`].
pub trait Clock: Send + Sync + 'static {
    /// The current instant.
    fn now(&self) -> Instant;
}

impl<C: Clock + ?Sized> Clock for Arc<C> {
    fn now(&self) -> Instant {
        (**self).now()
    }
}

/// The moment every clock this library makes reads [`Instant::ZERO`]: a little before the
/// first call (an hour before, where the machine's monotonic clock allows, so that a
/// paused tokio clock frozen a little earlier still reads as after it). Fixed once per
/// process.
#[must_use]
pub fn origin() -> std::time::Instant {
    origins().0
}

/// The wall-clock time of [`origin`]: how a [`CalendarWindow`](crate::algorithm::CalendarWindow)
/// places the instants of this library's clocks on the calendar. The wall clock is read
/// once, with the origin; a process that runs for months drifts from it by what the time
/// service corrects meanwhile.
///
/// ```
/// use std::time::SystemTime;
/// use tower_limits_core::{Clock, SystemClock};
/// use tower_limits_core::time::unix_origin;
///
/// let now = unix_origin() + std::time::Duration::from_nanos(SystemClock::new().now().as_nanos());
/// let wall = SystemTime::now();
/// let gap = now.duration_since(wall).or_else(|e| Ok::<_, ()>(e.duration())).unwrap();
/// assert!(gap.as_secs() < 60);
/// ```
#[must_use]
pub fn unix_origin() -> std::time::SystemTime {
    origins().1
}

fn origins() -> (std::time::Instant, std::time::SystemTime) {
    static ORIGINS: std::sync::OnceLock<(std::time::Instant, std::time::SystemTime)> = std::sync::OnceLock::new();
    *ORIGINS.get_or_init(|| {
        let (now, wall) = (std::time::Instant::now(), std::time::SystemTime::now());
        [3600, 60, 1]
            .iter()
            .map(|s| Duration::from_secs(*s))
            .find_map(|back| Some((now.checked_sub(back)?, wall.checked_sub(back)?)))
            .unwrap_or((now, wall))
    })
}

/// The machine's monotonic clock. Every `SystemClock` of a process counts from one origin
/// ([`origin`], shared with the layers' clocks), so instants read from any of them can be
/// mixed.
///
/// It reads the CPU's invariant time-stamp counter where there is one (calibrated once
/// against the operating system's monotonic clock, through the `quanta` crate), which
/// costs a third of `std::time::Instant::now()`; elsewhere it reads the monotonic clock.
/// Reading the clock is the largest single cost of an in-memory acquisition.
#[derive(Debug, Clone)]
pub struct SystemClock {
    clock: quanta::Clock,
    origin: u64,
    offset: u64,
}

impl SystemClock {
    /// The process's system clock. The first one calibrates the counter, which takes a
    /// few milliseconds, and fixes the origin.
    #[must_use]
    pub fn new() -> Self {
        static SHARED: std::sync::OnceLock<SystemClock> = std::sync::OnceLock::new();
        SHARED
            .get_or_init(|| {
                let clock = quanta::Clock::new();
                let origin = clock.raw();
                // The counter starts now: add the time since the shared origin.
                SystemClock { clock, origin, offset: duration_to_nanos(self::origin().elapsed()) }
            })
            .clone()
    }
}

impl Default for SystemClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for SystemClock {
    #[inline]
    fn now(&self) -> Instant {
        Instant(self.clock.delta_as_nanos(self.origin, self.clock.raw()).wrapping_add(self.offset))
    }
}

/// A clock that moves only when told to: the clock of every law test.
///
/// Clones share the same time, so a test can hand one clone to the code under test and
/// advance another.
///
/// ```
/// use std::time::Duration;
/// use tower_limits_core::{Clock, ManualClock};
///
/// let clock = ManualClock::new();
/// clock.advance(Duration::from_millis(250));
/// assert_eq!(clock.now().as_nanos(), 250_000_000);
/// ```
#[derive(Debug, Clone, Default)]
pub struct ManualClock {
    nanos: Arc<AtomicU64>,
}

impl ManualClock {
    /// A clock at its origin.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// Moves the clock forward by `by`.
    pub fn advance(&self, by: Duration) {
        self.advance_nanos(duration_to_nanos(by));
    }

    /// Moves the clock forward by `nanos` nanoseconds.
    pub fn advance_nanos(&self, nanos: u64) {
        let _ = self.nanos.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| Some(n.saturating_add(nanos)));
    }

    /// Sets the clock to `to`, if that is not earlier than its current time (a monotonic
    /// clock never goes back; an earlier `to` is ignored).
    pub fn set(&self, to: Instant) {
        self.nanos.fetch_max(to.0, Ordering::AcqRel);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Instant {
        Instant(self.nanos.load(Ordering::Acquire))
    }
}

/// Formats a duration in the largest unit that divides it (`90s` as `90s`, `2m` as `2m`).
#[must_use]
pub fn format_duration(d: Duration) -> String {
    let n = d.as_nanos();
    const UNITS: [(u128, &str); 7] = [
        (86_400_000_000_000, "d"),
        (3_600_000_000_000, "h"),
        (60_000_000_000, "m"),
        (1_000_000_000, "s"),
        (1_000_000, "ms"),
        (1_000, "us"),
        (1, "ns"),
    ];
    if n == 0 {
        return "0s".to_owned();
    }
    for (size, unit) in UNITS {
        if n % size == 0 {
            return format!("{}{unit}", n / size);
        }
    }
    unreachable!("every duration is a whole number of nanoseconds")
}

/// Parses a duration such as `1m`, `500ms`, `1h30m` or `2d`.
///
/// # Errors
/// A message saying what was expected.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    if text.is_empty() {
        return Err("expected a duration such as \"1m\" or \"500ms\", got an empty string".into());
    }
    let mut total: u128 = 0;
    let mut rest = text;
    while !rest.is_empty() {
        let digits = rest.find(|c: char| !c.is_ascii_digit()).unwrap_or(rest.len());
        if digits == 0 {
            return Err(format!("expected a number in duration {text:?}"));
        }
        let value: u128 = rest[..digits].parse().map_err(|_| format!("number too large in duration {text:?}"))?;
        rest = &rest[digits..];
        let unit_len = rest.find(|c: char| c.is_ascii_digit()).unwrap_or(rest.len());
        let nanos: u128 = match rest[..unit_len].trim() {
            "ns" => 1,
            "us" | "µs" => 1_000,
            "ms" => 1_000_000,
            "s" | "sec" => 1_000_000_000,
            "m" | "min" => 60_000_000_000,
            "h" => 3_600_000_000_000,
            "d" => 86_400_000_000_000,
            "" => return Err(format!("missing unit in duration {text:?} (use ns, us, ms, s, m, h or d)")),
            other => return Err(format!("unknown unit {other:?} in duration {text:?} (use ns, us, ms, s, m, h or d)")),
        };
        rest = &rest[unit_len..];
        total = value
            .checked_mul(nanos)
            .and_then(|v| total.checked_add(v))
            .ok_or_else(|| format!("duration {text:?} is too long"))?;
    }
    u64::try_from(total).map(Duration::from_nanos).map_err(|_| format!("duration {text:?} is too long"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manual_clock_is_shared_and_monotonic() {
        let a = ManualClock::new();
        let b = a.clone();
        a.advance(Duration::from_secs(2));
        assert_eq!(b.now(), Instant::from_nanos(2_000_000_000));
        b.set(Instant::from_nanos(5));
        assert_eq!(a.now(), Instant::from_nanos(2_000_000_000), "set never goes back");
    }

    #[test]
    fn arithmetic_saturates() {
        let t = Instant::from_nanos(10);
        assert_eq!(t - Duration::from_secs(1), Instant::ZERO);
        assert_eq!(Instant::from_nanos(u64::MAX - 1) + Duration::from_secs(1), Instant::from_nanos(u64::MAX));
        assert_eq!(Instant::ZERO.nanos_since(t), 0);
    }

    #[test]
    fn system_clock_does_not_go_back() {
        let c = SystemClock::new();
        let a = c.now();
        let b = c.now();
        assert!(b >= a);
    }
}
