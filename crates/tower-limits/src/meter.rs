//! What a layer reports to the `metrics` facade, and nothing at all without the feature.
//!
//! Every layer keeps one [`Meter`] in its settings and calls it at the points where it
//! already counts its own stats: an admission (a permit guard is made), a refusal, the
//! end of a lease, a request entering and leaving a queue. With the `metrics` feature the
//! meter records the families named in [`crate::metrics`]; without it the meter, the
//! lease start it hands out and the queue watch are zero-sized and every method is an
//! empty `#[inline(always)]` body, so the hot path has no extra field, branch or clock
//! read (see [`Meter::LEASES`] for the one decision that depends on the feature).
//!
//! Labels are bounded by construction: the layer's name (set by the user), a result and a
//! reason from fixed vocabularies, limit and tier names from the policy (interned,
//! `&'static str`), and tenant names only from a list the user configured
//! ([`FairQueueLayer::metrics_tenants`](crate::FairQueueLayer::metrics_tenants)). Each
//! event builds its key and asks the installed recorder for the handle: no handle is
//! cached, because a recorder installed after the layer was built must still see
//! everything.

#[cfg(feature = "metrics")]
pub(crate) use on::{Lease, Meter, QueueWatch};

#[cfg(not(feature = "metrics"))]
pub(crate) use off::{Lease, Meter, QueueWatch};

/// The reason label of a refusal.
#[cfg(feature = "metrics")]
pub(crate) fn reason(kind: crate::ErrorKind) -> &'static str {
    use crate::ErrorKind;
    match kind {
        ErrorKind::RateLimited => "rate_limited",
        ErrorKind::ConcurrencyLimited => "concurrency_limited",
        ErrorKind::TenantQueueFull => "tenant_queue_full",
        ErrorKind::QueueFull => "queue_full",
        ErrorKind::WaitTimedOut => "wait_timed_out",
        ErrorKind::CostAboveCapacity => "cost_above_capacity",
        ErrorKind::MissingKey => "missing_key",
        ErrorKind::KeySourceMissing => "key_source_missing",
        ErrorKind::KeyTableFull => "key_table_full",
        ErrorKind::Unavailable => "unavailable",
    }
}

#[cfg(feature = "metrics")]
mod on {
    use std::sync::{Arc, OnceLock};
    use std::time::Duration;

    use ::metrics::{Counter, Gauge, Histogram, SharedString, counter, gauge, histogram};
    use hashbrown::HashMap;
    use tower_limits_core::{Clock, Instant, TenantKey};

    use crate::clock::LayerClock;
    use crate::error::LimitError;
    use crate::metrics::{ACTIVE_LEASES, LEASE_DURATION, QUEUED_REQUESTS, REQUESTS, TIME_IN_QUEUE};

    /// A layer's meter: its name label, the tenants it may label by name, and the
    /// handles of the series every admission touches.
    #[derive(Clone)]
    pub(crate) struct Meter {
        layer: SharedString,
        tenants: Arc<HashMap<TenantKey, SharedString>>,
        hot: Arc<OnceLock<Hot>>,
    }

    /// The series of the layer that every admitted request writes, looked up in the
    /// recorder once, at the layer's first event, rather than by their labels per request.
    struct Hot {
        admitted: Counter,
        active: Gauge,
        lease: Histogram,
        queued: Gauge,
        waited: Histogram,
    }

    impl Default for Meter {
        fn default() -> Self {
            Meter { layer: SharedString::const_str("default"), tenants: Arc::default(), hot: Arc::default() }
        }
    }

    impl std::fmt::Debug for Meter {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("Meter").field("layer", &&*self.layer).field("tenants", &self.tenants.len()).finish()
        }
    }

    /// When a lease began.
    pub(crate) type Lease = Instant;

    impl Meter {
        /// Whether every admission needs a guard, to time its lease.
        pub(crate) const LEASES: bool = true;

        pub(crate) fn named(mut self, name: SharedString) -> Self {
            self.layer = name;
            self.hot = Arc::default();
            self
        }

        pub(crate) fn with_tenants(mut self, tenants: HashMap<TenantKey, SharedString>) -> Self {
            self.tenants = Arc::new(tenants);
            self
        }

        /// The layer's label; the first event of the process describes the families to
        /// the recorder installed by then.
        fn layer(&self) -> SharedString {
            static DESCRIBED: std::sync::Once = std::sync::Once::new();
            DESCRIBED.call_once(crate::metrics::describe);
            self.layer.clone()
        }

        /// The handles of the hot series, resolved in the recorder installed at the first
        /// event.
        fn hot(&self) -> &Hot {
            self.hot.get_or_init(|| {
                let layer = self.layer();
                Hot {
                    admitted: counter!(REQUESTS, "layer" => layer.clone(), "result" => "admitted"),
                    active: gauge!(ACTIVE_LEASES, "layer" => layer.clone()),
                    lease: histogram!(LEASE_DURATION, "layer" => layer.clone()),
                    queued: gauge!(QUEUED_REQUESTS, "layer" => layer.clone()),
                    waited: histogram!(TIME_IN_QUEUE, "layer" => layer, "result" => "admitted"),
                }
            })
        }

        /// A request admitted: its lease begins.
        pub(crate) fn admitted(&self, clock: &LayerClock) -> Lease {
            let hot = self.hot();
            hot.admitted.increment(1);
            hot.active.increment(1.0);
            clock.now()
        }

        /// A lease ended (the response completed, failed, or was dropped).
        pub(crate) fn lease_ended(&self, since: Lease, clock: &LayerClock) {
            let held = clock.now().saturating_since(since);
            let hot = self.hot();
            hot.lease.record(held.as_secs_f64());
            hot.active.decrement(1.0);
        }

        /// A request refused.
        pub(crate) fn refused(&self, error: &LimitError) {
            self.decided("refused", error);
        }

        /// A request that shadow mode let through: `error` is what it would have been
        /// refused with.
        pub(crate) fn shadow_refused(&self, error: &LimitError) {
            self.decided("shadow_refused", error);
        }

        /// A request that a limit in shadow mode would have refused, admitted: its lease
        /// begins.
        pub(crate) fn shadow_limit(
            &self,
            limit: &'static str,
            tier: Option<&'static str>,
            clock: &LayerClock,
        ) -> Lease {
            counter!(
                REQUESTS,
                "layer" => self.layer(),
                "result" => "shadow_refused",
                "reason" => "shadow_limit",
                "limit" => limit,
                "tier" => tier.unwrap_or(""),
            )
            .increment(1);
            self.hot().active.increment(1.0);
            clock.now()
        }

        fn decided(&self, result: &'static str, error: &LimitError) {
            let limit: &'static str = error.limit.unwrap_or("");
            let tier: &'static str = error.tier.unwrap_or("");
            counter!(
                REQUESTS,
                "layer" => self.layer(),
                "result" => result,
                "reason" => super::reason(error.kind()),
                "limit" => limit,
                "tier" => tier,
            )
            .increment(1);
        }

        /// A request enters a queue (waits for capacity, or for its fair turn).
        pub(crate) fn enter_queue(&self, key: &TenantKey, clock: &LayerClock) -> QueueWatch {
            let tenant = self.tenants.get(key).cloned();
            self.hot().queued.increment(1.0);
            if let Some(t) = &tenant {
                gauge!(QUEUED_REQUESTS, "layer" => self.layer(), "tenant" => t.clone()).increment(1.0);
            }
            QueueWatch { meter: self.clone(), tenant, since: clock.now(), clock: clock.clone(), left: false }
        }
    }

    /// A request in a queue. It leaves with [`QueueWatch::leave`]; dropped before, the
    /// request was cancelled while it waited.
    pub(crate) struct QueueWatch {
        meter: Meter,
        tenant: Option<SharedString>,
        since: Instant,
        clock: LayerClock,
        left: bool,
    }

    impl QueueWatch {
        /// The request leaves the queue, admitted or refused.
        pub(crate) fn leave(&mut self, admitted: bool) {
            self.record(if admitted { "admitted" } else { "refused" });
        }

        fn record(&mut self, result: &'static str) {
            if std::mem::replace(&mut self.left, true) {
                return;
            }
            let waited: Duration = self.clock.now().saturating_since(self.since);
            let layer = self.meter.layer();
            let hot = self.meter.hot();
            if result == "admitted" {
                hot.waited.record(waited.as_secs_f64());
            } else {
                histogram!(TIME_IN_QUEUE, "layer" => layer.clone(), "result" => result).record(waited.as_secs_f64());
            }
            hot.queued.decrement(1.0);
            if let Some(t) = self.tenant.take() {
                gauge!(QUEUED_REQUESTS, "layer" => layer.clone(), "tenant" => t).decrement(1.0);
            }
            if result == "cancelled" {
                counter!(REQUESTS, "layer" => layer, "result" => "cancelled").increment(1);
            }
        }
    }

    impl Drop for QueueWatch {
        fn drop(&mut self) {
            self.record("cancelled");
        }
    }
}

#[cfg(not(feature = "metrics"))]
mod off {
    use tower_limits_core::TenantKey;

    use crate::clock::LayerClock;
    use crate::error::LimitError;

    /// Nothing: metrics are off.
    #[derive(Clone, Copy, Debug, Default)]
    pub(crate) struct Meter {
        _off: (),
    }

    /// Nothing: metrics are off.
    #[derive(Clone, Copy)]
    pub(crate) struct Lease;

    /// Nothing: metrics are off.
    pub(crate) struct QueueWatch;

    impl Meter {
        pub(crate) const LEASES: bool = false;

        #[inline(always)]
        pub(crate) fn admitted(&self, _clock: &LayerClock) -> Lease {
            Lease
        }

        #[inline(always)]
        pub(crate) fn lease_ended(&self, _since: Lease, _clock: &LayerClock) {}

        #[inline(always)]
        pub(crate) fn refused(&self, _error: &LimitError) {}

        #[inline(always)]
        pub(crate) fn shadow_refused(&self, _error: &LimitError) {}

        #[inline(always)]
        pub(crate) fn shadow_limit(
            &self,
            _limit: &'static str,
            _tier: Option<&'static str>,
            _clock: &LayerClock,
        ) -> Lease {
            Lease
        }

        #[inline(always)]
        pub(crate) fn enter_queue(&self, _key: &TenantKey, _clock: &LayerClock) -> QueueWatch {
            QueueWatch
        }
    }

    impl QueueWatch {
        #[inline(always)]
        pub(crate) fn leave(&mut self, _admitted: bool) {}
    }
}

#[cfg(test)]
mod tests {
    /// Without the feature, what the layers carry for metrics takes no room.
    #[cfg(not(feature = "metrics"))]
    #[test]
    fn off_is_zero_sized() {
        assert_eq!(size_of::<super::Meter>(), 0);
        assert_eq!(size_of::<super::Lease>(), 0);
        assert_eq!(size_of::<super::QueueWatch>(), 0);
        const { assert!(!super::Meter::LEASES) };
    }

    #[cfg(feature = "metrics")]
    #[test]
    fn reasons_are_a_fixed_vocabulary() {
        use crate::ErrorKind;
        let kinds = [
            ErrorKind::RateLimited,
            ErrorKind::ConcurrencyLimited,
            ErrorKind::TenantQueueFull,
            ErrorKind::QueueFull,
            ErrorKind::WaitTimedOut,
            ErrorKind::CostAboveCapacity,
            ErrorKind::MissingKey,
            ErrorKind::KeySourceMissing,
            ErrorKind::KeyTableFull,
            ErrorKind::Unavailable,
        ];
        let mut reasons: Vec<_> = kinds.into_iter().map(super::reason).collect();
        reasons.sort_unstable();
        reasons.dedup();
        assert_eq!(reasons.len(), kinds.len());
    }
}
