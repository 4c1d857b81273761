//! What the layer was built with, and the backend of a layer without a rate.
//!
//! [`Fixed`] never changes once services exist: the backend, the clock, the slots, the
//! queueing time, the default key and the fair queue's configuration, whose weights are
//! keyed here by the tenant keys they name. [`NoRate`] grants every acquisition at once,
//! for a layer whose capacity is concurrency only.

use std::fmt;
use std::time::Duration;

use std::sync::Arc;

use hashbrown::HashMap;
use tower_limits_core::fair_queue::FairQueueConfig;
use tower_limits_core::fleet::FleetShares;
use tower_limits_core::{AcquireError, Backend, Instant, PolicyError, TenantKey};

use crate::clock::LayerClock;

/// A backend with no limits: every acquisition is granted at once. The rate of a
/// [`FairQueueLayer`](crate::fair_queue::FairQueueLayer) whose capacity is concurrency only.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoRate;

impl Backend for NoRate {
    type Grant = ();
    type Acquire = std::future::Ready<Result<(), AcquireError>>;

    #[inline]
    fn acquire(&self, _key: &TenantKey, _cost: u64, _now: Instant) -> Self::Acquire {
        std::future::ready(Ok(()))
    }

    #[inline]
    fn acquire_now(&self, _key: &TenantKey, _cost: u64, _now: Instant) -> Option<Result<(), AcquireError>> {
        Some(Ok(()))
    }

    #[inline]
    fn settle(&self, _key: &TenantKey, _grant: &mut (), _actual: u64, _now: Instant) {}

    #[inline]
    fn release(&self, _key: &TenantKey, _grant: ()) {}

    #[inline]
    fn cancel(&self, _key: &TenantKey, _grant: (), _now: Instant) {}
}

/// What the layer was built with; never changes once services exist.
#[derive(Clone)]
pub(crate) struct Fixed<B> {
    pub(crate) backend: B,
    pub(crate) clock: LayerClock,
    /// `usize::MAX`: no concurrency cap.
    pub(crate) slots: usize,
    pub(crate) max_queue_time: Option<Duration>,
    pub(crate) default_key: Option<TenantKey>,
    pub(crate) config: FairQueueConfig,
    /// `config.weights`, keyed by the tenant keys they name: handed to the queue, which
    /// looks them up itself.
    pub(crate) weights: HashMap<TenantKey, u32>,
    pub(crate) tracked_tenants: usize,
    /// Fleet-wide fairness: the backlog published before every acquisition, the weights
    /// scaled by this replica's shares (see [`tower_limits_core::fleet`]).
    pub(crate) fleet: Option<Arc<FleetShares>>,
    /// Where decisions are reported (nothing without the `metrics` feature).
    pub(crate) meter: crate::meter::Meter,
}

impl<B> Fixed<B> {
    pub(crate) fn new(config: FairQueueConfig, backend: B, slots: usize) -> Result<Self, PolicyError> {
        config.validate()?;
        let mut weights = HashMap::with_capacity(config.weights.len());
        for (name, &weight) in &config.weights {
            weights.insert(key_named(name)?, weight);
        }
        Ok(Fixed {
            backend,
            clock: LayerClock::default(),
            slots,
            max_queue_time: None,
            default_key: None,
            config,
            weights,
            tracked_tenants: 10_000,
            fleet: None,
            meter: crate::meter::Meter::default(),
        })
    }
}

/// The tenant key a weight's name stands for: its parts joined by `/`, as
/// `TenantKey`'s `Display` writes it; the empty name is the global key.
fn key_named(name: &str) -> Result<TenantKey, PolicyError> {
    if name.is_empty() {
        return Ok(TenantKey::global());
    }
    TenantKey::new(name.split('/'))
        .map_err(|e| PolicyError::new(format!("weights[{name:?}]"), format!("not a tenant key: {e}")))
}

impl<B> fmt::Debug for Fixed<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FairQueueSettings")
            .field("slots", &(self.slots != usize::MAX).then_some(self.slots))
            .field("max_queue_time", &self.max_queue_time)
            .field("default_key", &self.default_key)
            .field("config", &self.config)
            .field("tracked_tenants", &self.tracked_tenants)
            .finish_non_exhaustive()
    }
}
