//! The clocks the layers read.

use std::time::Duration;

use tower_limits_core::time::{duration_to_nanos, origin};
use tower_limits_core::{Clock, Instant, SystemClock};

/// The clock of a layer: it reads the time for decisions and turns an instant back into
/// a `tokio::time::Instant` to sleep until.
///
/// The default follows `tokio::time`, so that `tokio::time::pause()` drives the layers
/// in tests. [`LayerClock::system`] reads the CPU's counter instead, which is about a
/// third of the cost per request, but does not follow a paused tokio clock.
///
/// Every layer clock of a process counts from one origin, the core's
/// [`origin`](tower_limits_core::time::origin) (shared with its `SystemClock`), so layers
/// that share a backend (or code that passes a layer's [`now`](crate::LimitLayer::now) to
/// a pool) agree on what an instant means, and a calendar window places their instants on
/// the calendar through [`unix_origin`](tower_limits_core::time::unix_origin).
#[derive(Debug, Clone)]
pub struct LayerClock {
    kind: Kind,
    tokio_origin: tokio::time::Instant,
}

#[derive(Debug, Clone)]
enum Kind {
    Tokio,
    /// The system clock, which counts from the same origin.
    System(SystemClock),
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
        LayerClock { tokio_origin: tokio::time::Instant::from_std(origin()), kind: Kind::System(SystemClock::new()) }
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
            Kind::System(c) => c.now(),
        }
    }
}
