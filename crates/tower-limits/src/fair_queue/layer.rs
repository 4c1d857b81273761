use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use tower_layer::Layer;
use tower_limits_core::fair_queue::FairQueueConfig;
use tower_limits_core::fleet::FleetShares;
use tower_limits_core::{Backend, PolicyError, TenantKey};

use super::service::FairQueueService;
use super::shared::{FairQueueLayerStats, Fixed, NoRate, Shared, TenantQueueStats};
use crate::clock::LayerClock;
use crate::extract::{Extractors, WithBand};
use crate::refusal::ReturnError;

/// Queues requests per tenant and admits them in weighted-fair order to the capacity it
/// owns: concurrent slots, a rate (any [`Backend`], such as a
/// [`LimitSet`](crate::LimitSet)), or both. See the [module docs](super) for an example
/// and how it works.
///
/// The layer is a small `Clone` value; every service it builds, and every clone of
/// those, shares one queue and one capacity. The type parameters, in the order of every
/// layer of this crate: what is read from requests and responses `E` (an
/// [`Extractors`]: the key, the cost, the usage settling the rate's grant, how the grant
/// is recorded on the request), how refusals surface `R`, and the rate backend `B`
/// ([`NoRate`] for concurrency only); the builder methods set them.
///
/// Its verbs are those of [`LimitLayer`](crate::LimitLayer), written again rather than
/// shared: its state is a queue, not a backend behind a shell, so the settings verbs
/// differ, and inherent methods need no trait in scope.
#[must_use]
pub struct FairQueueLayer<E = Extractors, R = ReturnError, B: Backend = NoRate> {
    pub(crate) shared: Arc<Shared<B>>,
    pub(crate) extract: E,
    pub(crate) refusal: R,
}

impl<E: Clone, R: Clone, B: Backend> Clone for FairQueueLayer<E, R, B> {
    fn clone(&self) -> Self {
        FairQueueLayer { shared: self.shared.clone(), extract: self.extract.clone(), refusal: self.refusal.clone() }
    }
}

impl<E: fmt::Debug, R: fmt::Debug, B: Backend> fmt::Debug for FairQueueLayer<E, R, B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FairQueueLayer")
            .field("extract", &self.extract)
            .field("refusal", &self.refusal)
            .field("settings", &self.shared)
            .finish()
    }
}

fn check_slots(slots: usize) -> Result<usize, PolicyError> {
    if slots == 0 { Err(PolicyError::new("slots", "must be at least 1")) } else { Ok(slots) }
}

impl FairQueueLayer {
    /// A fair queue in front of `slots` concurrent requests: a request holds a slot from
    /// its admission until its response completes or is dropped.
    ///
    /// # Errors
    /// The configuration's first problem, naming its field: a zero weight or queue
    /// limit, a weight whose name is not a tenant key, or zero slots.
    pub fn concurrency(config: FairQueueConfig, slots: usize) -> Result<Self, PolicyError> {
        Self::build(config, NoRate, check_slots(slots)?)
    }
}

impl<B: Backend> FairQueueLayer<Extractors, ReturnError, B> {
    /// A fair queue in front of a rate: each request, in fair order, acquires its cost
    /// from `backend` (for example a [`LimitSet`](crate::LimitSet) with a global
    /// tokens-per-minute limit). When the next request does not fit yet, it waits for
    /// the exact instant it will, and everyone queues behind it: fairness first, then
    /// the cap.
    ///
    /// The backend's limits should be global: a refusal by a limit keyed by a tier (the
    /// tenant's own quota) refuses that request rather than holding up the others; see
    /// the [module docs](super#with-per-tenant-limits).
    ///
    /// # Errors
    /// The configuration's first problem, naming its field.
    pub fn rate(config: FairQueueConfig, backend: B) -> Result<Self, PolicyError> {
        Self::build(config, backend, usize::MAX)
    }

    /// Both: `slots` concurrent requests, and a rate acquired from `backend`.
    ///
    /// # Errors
    /// The configuration's first problem, naming its field, or zero slots.
    pub fn rate_and_concurrency(config: FairQueueConfig, backend: B, slots: usize) -> Result<Self, PolicyError> {
        Self::build(config, backend, check_slots(slots)?)
    }

    fn build(config: FairQueueConfig, backend: B, slots: usize) -> Result<Self, PolicyError> {
        let shared = Shared::new(Fixed::new(config, backend, slots)?)?;
        Ok(FairQueueLayer { shared: Arc::new(shared), extract: Extractors::default(), refusal: ReturnError })
    }
}

impl<K, C, U, A, R, B: Backend> FairQueueLayer<Extractors<K, C, U, A>, R, B> {
    /// How requests are keyed: each distinct key is a tenant of the queue (see
    /// [`crate::extract`]). Until one is set, every request is the same tenant.
    pub fn key<K2>(self, keys: K2) -> FairQueueLayer<Extractors<K2, C, U, A>, R, B> {
        let FairQueueLayer { shared, extract, refusal } = self;
        FairQueueLayer { shared, extract: extract.with_keys(keys), refusal }
    }

    /// Which priority band each request waits in, for a queue configured with bands
    /// ([`FairQueueConfig::band`]): `band` returns the band's index (0 is the first, which
    /// goes first; an index beyond the last is the last), or `None` for the
    /// configuration's default band. Set it after [`key`](Self::key). Each band keeps its
    /// configured minimum share while it has requests waiting, so a lower band is served
    /// behind a backlogged higher one but never starved (see
    /// [`FairQueue`](tower_limits_core::fair_queue::FairQueue)).
    ///
    /// ```
    /// use tower_limits::core::fair_queue::FairQueueConfig;
    /// use tower_limits::FairQueueLayer;
    ///
    /// // Interactive requests first; batch keeps a tenth while it waits.
    /// let config = FairQueueConfig::new().band("interactive", 0).band("batch", 10);
    /// let queue = FairQueueLayer::concurrency(config, 8)
    ///     .unwrap()
    ///     .band(|req: &http::Request<()>| req.headers().contains_key("x-batch").then_some(1));
    /// # drop(queue);
    /// ```
    #[allow(clippy::type_complexity)] // the layer's own type, with the band in its keys
    pub fn band<F>(self, band: F) -> FairQueueLayer<Extractors<WithBand<K, F>, C, U, A>, R, B>
    where
        F: Send + Sync + 'static,
    {
        let FairQueueLayer { shared, extract, refusal } = self;
        let Extractors { keys, cost, usage, annotate } = extract;
        FairQueueLayer {
            shared,
            extract: Extractors { keys: WithBand::new(keys, band), cost, usage, annotate },
            refusal,
        }
    }

    /// What a request costs: its share of the queue and what it acquires from the rate.
    /// Defaults to one per request.
    pub fn cost<C2>(self, cost: C2) -> FairQueueLayer<Extractors<K, C2, U, A>, R, B> {
        let FairQueueLayer { shared, extract, refusal } = self;
        FairQueueLayer { shared, extract: extract.with_cost(cost), refusal }
    }

    /// Where the real usage is read from a response, to settle the rate backend's grant
    /// with (for example [`UsageFromExtension`](crate::extract::UsageFromExtension): the
    /// tokens an upstream reports). A settle that gives cost back lets the request
    /// waiting at the rate gate try again at once. Without it the estimate stands. An
    /// extractor that also reads what the upstream said of its own limits
    /// ([`UpstreamReports`](crate::extract::UpstreamReports)) hands it to the rate
    /// backend, so a `LimitPool` benches an account that answered `429`.
    pub fn usage<U2>(self, usage: U2) -> FairQueueLayer<Extractors<K, C, U2, A>, R, B> {
        let FairQueueLayer { shared, extract, refusal } = self;
        FairQueueLayer { shared, extract: extract.with_usage(usage), refusal }
    }

    /// How the rate backend's grant is recorded on the request before the inner service
    /// sees it: for a [`LimitPool`](tower_limits_core::LimitPool) backend,
    /// [`InsertChosen`](crate::extract::InsertChosen) puts the chosen member (the
    /// upstream account to call) in the request's extensions.
    pub fn annotate<A2>(self, annotate: A2) -> FairQueueLayer<Extractors<K, C, U, A2>, R, B> {
        let FairQueueLayer { shared, extract, refusal } = self;
        FairQueueLayer { shared, extract: extract.with_annotate(annotate), refusal }
    }
}

impl<E, R, B: Backend> FairQueueLayer<E, R, B> {
    /// A new state with changed settings. Services built before keep the old one.
    fn with_fixed(self, f: impl FnOnce(&mut Fixed<B>)) -> Self {
        let mut fixed = self.shared.fixed.clone();
        f(&mut fixed);
        match Shared::new(fixed) {
            Ok(shared) => FairQueueLayer { shared: Arc::new(shared), ..self },
            // Unreachable: the configuration was checked when the layer was made.
            Err(_) => self,
        }
    }

    /// How refusals surface: as errors ([`ReturnError`], the default), or as HTTP
    /// answers ([`crate::http::HttpAnswer`]: 429 for a full tenant queue, 503 for a full
    /// queue or a queueing timeout).
    pub fn refuse_with<R2>(self, refusal: R2) -> FairQueueLayer<E, R2, B> {
        let FairQueueLayer { shared, extract, .. } = self;
        FairQueueLayer { shared, extract, refusal }
    }

    /// Keeps each admitted request's slot (and its rate grant, with the estimate to
    /// settle) until its response body ends, fails or is dropped, rather than until the
    /// response's head is ready: for streamed bodies. An
    /// [`HttpAnswer`](crate::http::HttpAnswer) does so already; see
    /// [`LimitLayer::hold_body`](crate::LimitLayer::hold_body).
    ///
    /// ```
    /// use tower_limits::core::fair_queue::FairQueueConfig;
    /// use tower_limits::FairQueueLayer;
    ///
    /// let queue = FairQueueLayer::concurrency(FairQueueConfig::new(), 8).unwrap().hold_body();
    /// # drop(queue);
    /// ```
    #[cfg(feature = "http")]
    pub fn hold_body(self) -> FairQueueLayer<E, R::Held, B>
    where
        R: crate::shell::body::HoldsBody,
    {
        let FairQueueLayer { shared, extract, refusal } = self;
        FairQueueLayer { shared, extract, refusal: refusal.hold_body() }
    }

    /// Holds the body and settles each request's rate grant to the usage its response
    /// body reports as it streams by; see
    /// [`LimitLayer::usage_from_body`](crate::LimitLayer::usage_from_body).
    ///
    /// ```
    /// use tower_limits::core::fair_queue::FairQueueConfig;
    /// use tower_limits::shell::body::OpenAiStreamUsage;
    /// use tower_limits::FairQueueLayer;
    ///
    /// let queue = FairQueueLayer::concurrency(FairQueueConfig::new(), 8)
    ///     .unwrap()
    ///     .usage_from_body(OpenAiStreamUsage::default());
    /// # drop(queue);
    /// ```
    #[cfg(feature = "http")]
    pub fn usage_from_body<O: crate::shell::body::BodyUsage>(self, observer: O) -> FairQueueLayer<E, R::WithUsage<O>, B>
    where
        R: crate::shell::body::HoldsBody,
    {
        let FairQueueLayer { shared, extract, refusal } = self;
        FairQueueLayer { shared, extract, refusal: refusal.usage_from_body(observer) }
    }

    /// Now, on the layer's clock: the instant to pass to the backend's own methods (for
    /// example [`LimitPool::observe`](tower_limits_core::LimitPool::observe)).
    #[must_use]
    pub fn now(&self) -> tower_limits_core::Instant {
        use tower_limits_core::Clock;
        self.shared.fixed.clock.now()
    }

    /// Refuses requests that waited `max` in the queue with
    /// [`ErrorKind::WaitTimedOut`](crate::ErrorKind::WaitTimedOut), and, at the rate
    /// gate, requests the rate would let pass only later than that. Unbounded by
    /// default (the queue limits still bound memory).
    pub fn max_queue_time(self, max: Duration) -> Self {
        self.with_fixed(|f| f.max_queue_time = Some(max))
    }

    /// Requests without a key are the tenant `key` instead of being refused.
    pub fn default_key(self, key: TenantKey) -> Self {
        self.with_fixed(|f| f.default_key = Some(key))
    }

    /// The most tenants whose counters ([`FairQueueLayer::tenant_stats`]) are kept; when
    /// full, the older half of those with nothing queued is forgotten. Defaults to
    /// 10,000.
    pub fn tracked_tenants(self, max: usize) -> Self {
        self.with_fixed(|f| f.tracked_tenants = max)
    }

    /// Serves one replica of a fleet whose shared store divides capacity fairly across
    /// the fleet (the Redis upstream accounts built with the same handle): before every
    /// acquisition the layer publishes its backlog to `fleet`, and it queues each tenant
    /// with its weight scaled by this replica's share of the tenant's fleet demand, as
    /// the store last answered. Tenants then get capacity in proportion to their weights
    /// across the fleet, whichever replica their requests land on (see
    /// [`tower_limits_core::fleet`]). With priority bands, the layer tells `fleet` their
    /// minimum shares and each request's band, and the store orders the bands for the
    /// fleet. Without it, or while the store does not answer, the weights are the
    /// configured ones and the bands order this replica's queue alone.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use tower_limits::core::fair_queue::FairQueueConfig;
    /// use tower_limits::core::fleet::FleetShares;
    /// use tower_limits::{FairQueueLayer, LimitPolicy, LimitSet, LimitSetPolicy, Quota, nz};
    ///
    /// let fleet = Arc::new(FleetShares::new());
    /// let upstream = LimitSet::new(LimitSetPolicy::new().limit(
    ///     LimitPolicy::token_bucket("tokens", Quota::per_minute(nz!(600_000)).burst(nz!(10_000))).counting_cost(),
    /// ))?;
    /// let layer = FairQueueLayer::rate(FairQueueConfig::new().weight("acme", 3), upstream)?.fleet(fleet.clone());
    /// // Hand `fleet` to the shared store too (RedisAccountsBuilder::fleet).
    /// # drop(layer);
    /// # Ok::<(), tower_limits::PolicyError>(())
    /// ```
    pub fn fleet(self, fleet: Arc<FleetShares>) -> Self {
        self.with_fixed(|f| {
            if f.config.bands.len() > 1 {
                fleet.set_bands(f.config.bands.iter().map(|b| b.min_share_percent));
            }
            f.fleet = Some(fleet);
        })
    }

    /// The `layer` label of this layer's metrics (feature `metrics`; `default` when not
    /// set); see [`LimitLayer::metrics_name`](crate::LimitLayer::metrics_name).
    ///
    /// ```
    /// use tower_limits::FairQueueLayer;
    /// use tower_limits::core::fair_queue::FairQueueConfig;
    ///
    /// let fair = FairQueueLayer::concurrency(FairQueueConfig::new(), 8)?.metrics_name("upstream");
    /// # drop(fair);
    /// # Ok::<(), tower_limits::PolicyError>(())
    /// ```
    #[cfg(feature = "metrics")]
    pub fn metrics_name(self, name: impl Into<std::borrow::Cow<'static, str>>) -> Self {
        let name = match name.into() {
            std::borrow::Cow::Borrowed(s) => ::metrics::SharedString::const_str(s),
            std::borrow::Cow::Owned(s) => ::metrics::SharedString::from_owned(s),
        };
        self.with_fixed(|f| f.meter = f.meter.clone().named(name))
    }

    /// The tenants whose queue depth is also reported by name (the `tenant` label of
    /// `rate_limiting.queued_requests`, feature `metrics`), each named as in the weights
    /// (`"acme"`, `"acme/alice"`). Every other tenant counts only in the layer's total:
    /// the label's values are this list, never the open set of tenant keys.
    ///
    /// ```
    /// use tower_limits::FairQueueLayer;
    /// use tower_limits::core::fair_queue::FairQueueConfig;
    ///
    /// let fair = FairQueueLayer::concurrency(FairQueueConfig::new(), 8)?.metrics_tenants(["acme", "globex"])?;
    /// # drop(fair);
    /// # Ok::<(), tower_limits::PolicyError>(())
    /// ```
    ///
    /// # Errors
    /// A name that is not a tenant key.
    #[cfg(feature = "metrics")]
    pub fn metrics_tenants<I, T>(self, tenants: I) -> Result<Self, PolicyError>
    where
        I: IntoIterator<Item = T>,
        T: Into<String>,
    {
        let mut named = hashbrown::HashMap::new();
        for name in tenants {
            let name: String = name.into();
            // Named as the weights are: parts joined by `/`, the empty name global.
            let key = if name.is_empty() { Ok(TenantKey::global()) } else { TenantKey::new(name.split('/')) }.map_err(
                |e| PolicyError::new(format!("metrics_tenants[{name:?}]"), format!("not a tenant key: {e}")),
            )?;
            named.insert(key, ::metrics::SharedString::from_owned(name));
        }
        Ok(self.with_fixed(|f| f.meter = f.meter.clone().with_tenants(named)))
    }

    /// Reads time from the CPU's counter instead of `tokio::time`: cheaper per request,
    /// but it does not follow `tokio::time::pause()`. Timers still run on tokio.
    pub fn system_clock(self) -> Self {
        self.with_fixed(|f| f.clock = LayerClock::system())
    }

    /// The rate backend.
    pub fn backend(&self) -> &B {
        &self.shared.fixed.backend
    }

    /// The weights and queue limits.
    #[must_use]
    pub fn config(&self) -> &FairQueueConfig {
        &self.shared.fixed.config
    }

    /// The weight a tenant gets: the entry of the configuration's `weights` whose name
    /// is the key's parts joined by `/` (the key's `Display`), or the default weight.
    #[must_use]
    pub fn weight_of(&self, key: &TenantKey) -> u32 {
        self.shared.weight(key)
    }

    /// Counters of the layer: queue depth, slots taken, admitted cost, queueing time,
    /// refusals by reason.
    #[must_use]
    pub fn stats(&self) -> FairQueueLayerStats {
        self.shared.stats()
    }

    /// One tenant's queue depth and counters; `None` when it has nothing queued and its
    /// counters are not kept (never seen, or forgotten).
    #[must_use]
    pub fn tenant_stats(&self, key: &TenantKey) -> Option<TenantQueueStats> {
        self.shared.tenant_stats(key)
    }
}

impl<S, E: Clone, R: Clone, B: Backend> Layer<S> for FairQueueLayer<E, R, B> {
    type Service = FairQueueService<S, E, R, B>;

    fn layer(&self, inner: S) -> Self::Service {
        FairQueueService {
            inner,
            shared: self.shared.clone(),
            extract: self.extract.clone(),
            refusal: self.refusal.clone(),
        }
    }
}
