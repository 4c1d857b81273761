use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use tower_layer::Layer;
use tower_limits_core::{Backend, LimitPolicy, LimitSet, LimitSetPolicy, LimitSetStats, PolicyError, Rate, TenantKey};

use super::service::LimitSetService;
use super::shared::{Settings, Shared, Unfinished};
use crate::clock::LayerClock;
use crate::extract::{GlobalKey, NoAnnotation, NoUsage, One};
use crate::reject::ReturnError;

/// Applies a [`LimitSet`] (or any [`Backend`]) to every request of the wrapped service.
///
/// The layer is a small `Clone` value. Every service it builds, and every clone of those
/// services, shares one state: the limits hold across all of them.
///
/// The type parameters are the key extractor `K`, the cost extractor `C`, the usage
/// extractor `U`, how refusals surface `R`, and the backend `B`; the builder methods set
/// them.
#[must_use]
pub struct LimitSetLayer<K = GlobalKey, C = One, U = NoUsage, R = ReturnError, B = LimitSet, A = NoAnnotation> {
    pub(crate) shared: Arc<Shared<B>>,
    pub(crate) keys: K,
    pub(crate) cost: C,
    pub(crate) usage: U,
    pub(crate) rejection: R,
    pub(crate) annotate: A,
}

impl<K: Clone, C: Clone, U: Clone, R: Clone, B, A: Clone> Clone for LimitSetLayer<K, C, U, R, B, A> {
    fn clone(&self) -> Self {
        LimitSetLayer {
            shared: self.shared.clone(),
            keys: self.keys.clone(),
            cost: self.cost.clone(),
            usage: self.usage.clone(),
            rejection: self.rejection.clone(),
            annotate: self.annotate.clone(),
        }
    }
}

impl<K: fmt::Debug, C: fmt::Debug, U: fmt::Debug, R: fmt::Debug, B, A> fmt::Debug for LimitSetLayer<K, C, U, R, B, A> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LimitSetLayer")
            .field("keys", &self.keys)
            .field("cost", &self.cost)
            .field("usage", &self.usage)
            .field("rejection", &self.rejection)
            .field("settings", &self.shared.settings)
            .finish()
    }
}

impl LimitSetLayer {
    /// A layer enforcing `policy` in memory. Limits keyed by a tier need a key extractor
    /// ([`LimitSetLayer::key`]); until one is set every request has the global key.
    ///
    /// # Errors
    /// The policy's first problem, naming its field.
    pub fn new(policy: LimitSetPolicy) -> Result<Self, PolicyError> {
        Ok(Self::with_backend(LimitSet::new(policy)?))
    }

    /// A layer of one limit (see the constructors below): a single-limit layer is a set
    /// of one, with the same engine.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower::ServiceBuilder;
    /// use tower_limits::{LimitPolicy, LimitSetLayer, Rate};
    ///
    /// let svc = ServiceBuilder::new()
    ///     .layer(LimitSetLayer::concurrency(64).unwrap())
    ///     .layer(LimitSetLayer::gcra(Rate::per_second(100), 20).unwrap())
    ///     .layer(LimitSetLayer::token_bucket(Rate::per_minute(6_000), 500).unwrap())
    ///     .layer(LimitSetLayer::sliding_window_log(1_000, Duration::from_secs(60)).unwrap())
    ///     .layer(LimitSetLayer::sliding_window_counter(10_000, Duration::from_secs(3600)).unwrap())
    ///     .layer(LimitSetLayer::single(LimitPolicy::fixed_window("daily", 50_000, Duration::from_secs(86_400))).unwrap())
    ///     .service_fn(|req: String| async move { Ok::<_, std::convert::Infallible>(req) });
    /// # drop(svc);
    /// ```
    ///
    /// Stacked like this, each layer decides on its own: a request refused by an inner
    /// layer has already been charged by the outer ones. Put limits that must hold
    /// together in one set ([`LimitSetLayer::new`]) to have them all or nothing.
    ///
    /// # Errors
    /// The limit's first problem, naming its field.
    pub fn single(limit: LimitPolicy) -> Result<Self, PolicyError> {
        Self::new(LimitSetPolicy::new().limit(limit))
    }

    /// One global GCRA limit: `rate`, with room for `burst` at once.
    ///
    /// # Errors
    /// A zero or unrepresentable rate, or a zero burst.
    pub fn gcra(rate: Rate, burst: u64) -> Result<Self, PolicyError> {
        Self::single(LimitPolicy::gcra("gcra", rate, burst))
    }

    /// One global token bucket of `burst` tokens refilled at `rate`.
    ///
    /// # Errors
    /// A zero or unrepresentable rate, or a zero burst.
    pub fn token_bucket(rate: Rate, burst: u64) -> Result<Self, PolicyError> {
        Self::single(LimitPolicy::token_bucket("token_bucket", rate, burst))
    }

    /// One global sliding-window log: exactly `limit` per `window`.
    ///
    /// # Errors
    /// A zero limit or window.
    pub fn sliding_window_log(limit: u64, window: Duration) -> Result<Self, PolicyError> {
        Self::single(LimitPolicy::sliding_window_log("sliding_window", limit, window))
    }

    /// One global sliding-window counter: about `limit` per `window`.
    ///
    /// # Errors
    /// A zero limit or window.
    pub fn sliding_window_counter(limit: u64, window: Duration) -> Result<Self, PolicyError> {
        Self::single(LimitPolicy::sliding_window_counter("sliding_window", limit, window))
    }

    /// One global concurrency limit: at most `capacity` requests in flight. Unlike
    /// `tower::limit::ConcurrencyLimit` it does not hold a permit from `poll_ready`, so
    /// an idle keep-alive connection pins nothing.
    ///
    /// # Errors
    /// A zero capacity.
    pub fn concurrency(capacity: u64) -> Result<Self, PolicyError> {
        Self::single(LimitPolicy::semaphore("concurrency", capacity))
    }
}

impl<B: Backend> LimitSetLayer<GlobalKey, One, NoUsage, ReturnError, B> {
    /// A layer over any backend (for example Redis, shared by a fleet).
    pub fn with_backend(backend: B) -> Self {
        LimitSetLayer {
            shared: Arc::new(Shared::new(backend, LayerClock::default(), Settings::default())),
            keys: GlobalKey,
            cost: One,
            usage: NoUsage,
            rejection: ReturnError,
            annotate: NoAnnotation,
        }
    }
}

impl<K, C, U, R, B: Backend, A> LimitSetLayer<K, C, U, R, B, A> {
    fn with_settings(self, f: impl FnOnce(&mut Settings, &mut LayerClock)) -> Self {
        let mut settings = self.shared.settings.clone();
        let mut clock = self.shared.clock.clone();
        f(&mut settings, &mut clock);
        LimitSetLayer {
            shared: Arc::new(Shared::new(self.shared.backend.clone(), clock, settings)),
            keys: self.keys,
            cost: self.cost,
            usage: self.usage,
            rejection: self.rejection,
            annotate: self.annotate,
        }
    }

    /// How requests are keyed (see [`crate::extract`]).
    pub fn key<K2>(self, keys: K2) -> LimitSetLayer<K2, C, U, R, B, A> {
        let LimitSetLayer { shared, cost, usage, rejection, annotate, .. } = self;
        LimitSetLayer { shared, keys, cost, usage, rejection, annotate }
    }

    /// What a request costs against limits that count cost.
    pub fn cost<C2>(self, cost: C2) -> LimitSetLayer<K, C2, U, R, B, A> {
        let LimitSetLayer { shared, keys, usage, rejection, annotate, .. } = self;
        LimitSetLayer { shared, keys, cost, usage, rejection, annotate }
    }

    /// Where the real usage is read from a response, to settle the permit with.
    pub fn usage<U2>(self, usage: U2) -> LimitSetLayer<K, C, U2, R, B, A> {
        let LimitSetLayer { shared, keys, cost, rejection, annotate, .. } = self;
        LimitSetLayer { shared, keys, cost, usage, rejection, annotate }
    }

    /// How refusals surface: as errors ([`ReturnError`], the default, for axum's
    /// `HandleErrorLayer`), or as HTTP answers ([`crate::http::HttpAnswer`]).
    pub fn reject_with<R2>(self, rejection: R2) -> LimitSetLayer<K, C, U, R2, B, A> {
        let LimitSetLayer { shared, keys, cost, usage, annotate, .. } = self;
        LimitSetLayer { shared, keys, cost, usage, rejection, annotate }
    }

    /// How the grant is recorded on the request before the inner service sees it: for a
    /// [`LimitPool`](tower_limits_core::LimitPool) backend,
    /// [`InsertChosen`](crate::extract::InsertChosen) puts the chosen member in the
    /// request's extensions.
    pub fn annotate<A2>(self, annotate: A2) -> LimitSetLayer<K, C, U, R, B, A2> {
        let LimitSetLayer { shared, keys, cost, usage, rejection, .. } = self;
        LimitSetLayer { shared, keys, cost, usage, rejection, annotate }
    }

    /// Requests without a key use `key` instead of being refused.
    pub fn default_key(self, key: TenantKey) -> Self {
        self.with_settings(|s, _| s.default_key = Some(key))
    }

    /// Wait for capacity instead of refusing, for at most `max_wait`; a request whose wait
    /// would be longer fails at once. Waiters of one key are served in arrival order,
    /// wake at the exact instant they can pass (or when concurrency is released), and a
    /// dropped waiter leaves the queue and gives back everything. For clients and batch
    /// jobs; servers usually refuse fast (the default).
    pub fn wait(self, max_wait: Duration) -> Self {
        self.with_settings(|s, _| s.max_wait = Some(max_wait))
    }

    /// The most requests waiting at once (with [`LimitSetLayer::wait`]); beyond it they
    /// are refused with [`crate::ErrorKind::QueueFull`]. Defaults to 10,000.
    pub fn max_waiters(self, max_waiters: usize) -> Self {
        self.with_settings(|s, _| s.max_waiters = max_waiters)
    }

    /// What happens to the charged cost when the inner service fails: keep it (the
    /// default: an error may come after the work was done, and a retrying client stays
    /// paced) or refund it (for clients whose errors mean nothing was sent).
    pub fn on_error(self, what: Unfinished) -> Self {
        self.with_settings(|s, _| s.on_error = what)
    }

    /// What happens to the charged cost when the response future is dropped before it
    /// completes (the client went away): keep it (the default: the work may have been
    /// done) or refund it. Concurrency is released either way.
    pub fn on_cancel(self, what: Unfinished) -> Self {
        self.with_settings(|s, _| s.on_cancel = what)
    }

    /// Reads time from the CPU's counter instead of `tokio::time`: cheaper per request,
    /// but it does not follow `tokio::time::pause()`.
    pub fn system_clock(self) -> Self {
        self.with_settings(|_, c| *c = LayerClock::system())
    }

    /// The backend.
    pub fn backend(&self) -> &B {
        &self.shared.backend
    }

    /// Now, on the layer's clock: the instant to pass to the backend's own methods
    /// (for example [`LimitPool::observe`](tower_limits_core::LimitPool::observe)).
    #[must_use]
    pub fn now(&self) -> tower_limits_core::Instant {
        use tower_limits_core::Clock;
        self.shared.clock.now()
    }

    /// Counters of the layer itself (waits and timeouts); see
    /// [`LimitSetLayer::stats`] for the limits' own.
    #[must_use]
    pub fn layer_stats(&self) -> super::LayerStats {
        self.shared.layer_stats()
    }
}

impl<K, C, U, R, A> LimitSetLayer<K, C, U, R, LimitSet, A> {
    /// Per-limit counters of the in-memory set, with the layer's own.
    #[must_use]
    pub fn stats(&self) -> LimitSetStats {
        self.shared.backend.stats()
    }
}

impl<S, K, C, U, R, B, A> Layer<S> for LimitSetLayer<K, C, U, R, B, A>
where
    K: Clone,
    C: Clone,
    U: Clone,
    R: Clone,
    A: Clone,
{
    type Service = LimitSetService<S, K, C, U, R, B, A>;

    fn layer(&self, inner: S) -> Self::Service {
        LimitSetService {
            inner,
            shared: self.shared.clone(),
            keys: self.keys.clone(),
            cost: self.cost.clone(),
            usage: self.usage.clone(),
            rejection: self.rejection.clone(),
            annotate: self.annotate.clone(),
        }
    }
}
