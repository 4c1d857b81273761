//! The clocks the layers read.

use std::sync::OnceLock;
use std::time::Duration;

use tower_limits_core::time::duration_to_nanos;
use tower_limits_core::{Clock, Instant, SystemClock};

/// The clock of a layer: it reads the time for decisions and turns an instant back into
/// a `tokio::time::Instant` to sleep until.
///
/// The default follows `tokio::time`, so that `tokio::time::pause()` drives the layers
/// in tests. [`LayerClock::system`] reads the CPU's counter instead, which is about a
/// third of the cost per request, but does not follow a paused tokio clock.
///
/// Every layer clock of a process counts from one origin, so layers that share a backend
/// (or code that passes a layer's [`now`](crate::LimitLayer::now) to a pool) agree
/// on what an instant means.
#[derive(Debug, Clone)]
pub struct LayerClock {
    kind: Kind,
    tokio_origin: tokio::time::Instant,
}

#[derive(Debug, Clone)]
enum Kind {
    Tokio,
    /// The system clock and how far its origin is after the process's.
    System(SystemClock, u64),
}

/// The origin of every layer clock: a moment before the first one was made. It is set
/// back an hour (where the machine's clock allows) so that a paused tokio clock frozen a
/// little before it still reads as after it.
fn origin() -> std::time::Instant {
    static ORIGIN: OnceLock<std::time::Instant> = OnceLock::new();
    *ORIGIN.get_or_init(|| {
        let now = std::time::Instant::now();
        [3600, 60, 1].iter().find_map(|s| now.checked_sub(Duration::from_secs(*s))).unwrap_or(now)
    })
}

impl LayerClock {
    /// A clock following `tokio::time` (and so `tokio::time::pause()`).
    #[must_use]
    pub fn tokio() -> Self {
        LayerClock { kind: Kind::Tokio, tokio_origin: tokio::time::Instant::from_std(origin()) }
    }

    /// The machine's monotonic counter (see [`SystemClock`]); not for paused-time tests.
    #[must_use]
    pub fn system() -> Self {
        static OFFSET: OnceLock<u64> = OnceLock::new();
        let system = SystemClock::new();
        let offset =
            *OFFSET.get_or_init(|| duration_to_nanos(origin().elapsed()).saturating_sub(system.now().as_nanos()));
        LayerClock { tokio_origin: tokio::time::Instant::from_std(origin()), kind: Kind::System(system, offset) }
    }

    /// The tokio instant that `at` stands for, to sleep until.
    #[must_use]
    pub fn to_tokio(&self, at: Instant) -> tokio::time::Instant {
        self.tokio_origin + Duration::from_nanos(at.as_nanos())
    }
}

impl Default for LayerClock {
    fn default() -> Self {
        Self::tokio()
    }
}

impl Clock for LayerClock {
    #[inline]
    fn now(&self) -> Instant {
        match &self.kind {
            Kind::Tokio => Instant::from_nanos(duration_to_nanos(
                tokio::time::Instant::now().saturating_duration_since(self.tokio_origin),
            )),
            Kind::System(c, offset) => Instant::from_nanos(c.now().as_nanos().saturating_add(*offset)),
        }
    }
}
