//! The clocks the layers read.

use std::time::Duration;

use tower_limits_core::time::duration_to_nanos;
use tower_limits_core::{Clock, Instant, SystemClock};

/// The clock of a layer: it reads the time for decisions and turns an instant back into
/// a `tokio::time::Instant` to sleep until.
///
/// The default follows `tokio::time`, so that `tokio::time::pause()` drives the layers
/// in tests. [`LayerClock::system`] reads the CPU's counter instead, which is about a
/// third of the cost per request, but does not follow a paused tokio clock.
#[derive(Debug, Clone)]
pub struct LayerClock {
    kind: Kind,
    tokio_origin: tokio::time::Instant,
}

#[derive(Debug, Clone)]
enum Kind {
    Tokio,
    System(SystemClock),
}

impl LayerClock {
    /// A clock following `tokio::time` (and so `tokio::time::pause()`).
    #[must_use]
    pub fn tokio() -> Self {
        LayerClock { kind: Kind::Tokio, tokio_origin: tokio::time::Instant::now() }
    }

    /// The machine's monotonic counter (see [`SystemClock`]); not for paused-time tests.
    #[must_use]
    pub fn system() -> Self {
        let system = SystemClock::new();
        LayerClock { tokio_origin: tokio::time::Instant::now(), kind: Kind::System(system) }
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
