use std::any::TypeId;
use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Duration;

use tower_layer::Layer;
use tower_limits_core::{Backend, LimitSet, LimitSetPolicy, LimitSetStats, PolicyError, TenantKey};

use super::service::LimitService;
use super::shared::{Settings, Shared, Source, Unfinished};
use crate::clock::LayerClock;
use crate::extract::{Extractors, GlobalKey};
use crate::layers::door;
use crate::refusal::ReturnError;

/// The one limit layer under every named one: applies a [`LimitSet`] (or any
/// [`Backend`]) to every request of the wrapped service, every limit of the set, all or
/// nothing.
///
/// Users name it through its aliases: [`LimitSetLayer`](crate::LimitSetLayer) and the
/// named layers ([`GcraLayer`](crate::GcraLayer),
/// [`TokenBucketLayer`](crate::TokenBucketLayer), ...), which differ only in the door `D`,
/// which chooses the constructors: a single-limit layer is a set of one, with the same
/// service, the same response future and the same builder verbs, documented here.
///
/// The layer is a small `Clone` value. Every service it builds, and every clone of those
/// services, shares one state: the limits hold across all of them.
///
/// The type parameters, in the same order on every layer of this crate: what is read
/// from requests and responses `E` (an [`Extractors`]: the key, the cost, the usage and
/// how a grant is recorded), how refusals surface `R`, the backend `B` (then the door
/// `D`). The builder methods set them; user code rarely spells one.
#[must_use]
pub struct LimitLayer<E, R, B, D> {
    pub(crate) shared: Arc<Shared<B>>,
    pub(crate) extract: E,
    pub(crate) refusal: R,
    pub(crate) door: PhantomData<fn() -> D>,
}

impl<E: Clone, R: Clone, B, D> Clone for LimitLayer<E, R, B, D> {
    fn clone(&self) -> Self {
        LimitLayer {
            shared: self.shared.clone(),
            extract: self.extract.clone(),
            refusal: self.refusal.clone(),
            door: PhantomData,
        }
    }
}

impl<E: fmt::Debug, R: fmt::Debug, B, D: door::Door> fmt::Debug for LimitLayer<E, R, B, D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct(D::NAME)
            .field("extract", &self.extract)
            .field("refusal", &self.refusal)
            .field("settings", &self.shared.settings)
            .finish()
    }
}

impl crate::LimitSetLayer {
    /// A layer enforcing `policy` in memory. Limits keyed by a tier need a key extractor
    /// ([`LimitSetLayer::key`](crate::LimitLayer::key)); until one is set every request has the global key.
    ///
    /// ```
    /// use tower::ServiceBuilder;
    /// use tower_limits::extract::FromExtension;
    /// use tower_limits::{LimitPolicy, LimitSetLayer, LimitSetPolicy, Quota, TenantKey, nz};
    ///
    /// // Policies are data (a file, a database row): building them can fail, naming the field.
    /// let policy = LimitSetPolicy::new()
    ///     .tiers(["org", "user"])
    ///     .limit(LimitPolicy::gcra("requests", Quota::per_minute(nz!(600)).burst(nz!(20))).per("user"))
    ///     .limit(LimitPolicy::semaphore("concurrent", 8).per("org"));
    /// let limits = LimitSetLayer::new(policy)?.key(FromExtension::<TenantKey>::new());
    /// let svc = ServiceBuilder::new()
    ///     .layer(limits)
    ///     .service_fn(|_req: http::Request<String>| async { Ok::<_, std::convert::Infallible>(()) });
    /// # drop(svc);
    /// # Ok::<(), tower_limits::PolicyError>(())
    /// ```
    ///
    /// # Errors
    /// The policy's first problem, naming its field.
    pub fn new(policy: LimitSetPolicy) -> Result<Self, PolicyError> {
        let set = LimitSet::new(policy.clone())?;
        let mut layer = Self::with_backend(set);
        if let Some(shared) = Arc::get_mut(&mut layer.shared) {
            shared.source = Some(Source::memory(policy));
        }
        Ok(layer)
    }
}

impl<B: Backend> crate::LimitSetLayer<Extractors, ReturnError, B> {
    /// A layer over any backend (for example Redis, shared by a fleet).
    pub fn with_backend(backend: B) -> Self {
        Self::from_shared(Shared::new(backend, LayerClock::default(), Settings::default()))
    }
}

impl<B: Backend, D> LimitLayer<Extractors, ReturnError, B, D> {
    pub(crate) fn from_shared(shared: Shared<B>) -> Self {
        LimitLayer { shared: Arc::new(shared), extract: Extractors::default(), refusal: ReturnError, door: PhantomData }
    }
}

impl<K, C, U, A, R, B: Backend, D> LimitLayer<Extractors<K, C, U, A>, R, B, D> {
    /// How requests are keyed (see [`crate::extract`]).
    ///
    /// On a named single-limit layer ([`GcraLayer`](crate::GcraLayer) and the others), a
    /// key extractor other than [`GlobalKey`] makes the limit per key: each key gets its
    /// own state (a fresh one: set the key before serving). On a [`LimitSetLayer`](crate::LimitSetLayer) built
    /// from a policy, each limit keeps the scope its policy gives it.
    pub fn key<K2: 'static>(self, keys: K2) -> LimitLayer<Extractors<K2, C, U, A>, R, B, D> {
        let shared = match &self.shared.source {
            Some(source) if source.single && TypeId::of::<K2>() != TypeId::of::<GlobalKey>() => {
                let keyed = source.keyed();
                let mut shared = Shared::new(keyed.backend(), self.shared.clock.clone(), self.shared.settings.clone());
                shared.source = Some(keyed);
                Arc::new(shared)
            }
            _ => self.shared,
        };
        LimitLayer { shared, extract: self.extract.with_keys(keys), refusal: self.refusal, door: PhantomData }
    }

    /// What a request costs against limits that count cost.
    pub fn cost<C2>(self, cost: C2) -> LimitLayer<Extractors<K, C2, U, A>, R, B, D> {
        let LimitLayer { shared, extract, refusal, door } = self;
        LimitLayer { shared, extract: extract.with_cost(cost), refusal, door }
    }

    /// Where the real usage is read from a response, to settle the permit with.
    pub fn usage<U2>(self, usage: U2) -> LimitLayer<Extractors<K, C, U2, A>, R, B, D> {
        let LimitLayer { shared, extract, refusal, door } = self;
        LimitLayer { shared, extract: extract.with_usage(usage), refusal, door }
    }

    /// How the grant is recorded on the request before the inner service sees it: for a
    /// [`LimitPool`](tower_limits_core::LimitPool) backend,
    /// [`InsertChosen`](crate::extract::InsertChosen) puts the chosen member in the
    /// request's extensions.
    pub fn annotate<A2>(self, annotate: A2) -> LimitLayer<Extractors<K, C, U, A2>, R, B, D> {
        let LimitLayer { shared, extract, refusal, door } = self;
        LimitLayer { shared, extract: extract.with_annotate(annotate), refusal, door }
    }
}

impl<E, R, B: Backend, D> LimitLayer<E, R, B, D> {
    fn with_settings(self, f: impl FnOnce(&mut Settings, &mut LayerClock)) -> Self {
        let mut settings = self.shared.settings.clone();
        let mut clock = self.shared.clock.clone();
        f(&mut settings, &mut clock);
        let mut shared = Shared::new(self.shared.backend.clone(), clock, settings);
        shared.source = self.shared.source.clone();
        LimitLayer { shared: Arc::new(shared), ..self }
    }

    /// How refusals surface: as errors ([`ReturnError`], the default, as tower's
    /// middleware do: for axum's `HandleErrorLayer` with
    /// [`error_response`](crate::http::error_response), or a client's retry logic), as
    /// HTTP answers ([`HttpAnswer`](crate::http::HttpAnswer): what a layer on an axum
    /// `Router` needs, whose services may not fail), or as gRPC statuses (`GrpcAnswer`).
    ///
    /// ```
    /// use axum::{Router, routing::get};
    /// use tower_limits::http::HttpAnswer;
    /// use tower_limits::{GcraLayer, Quota, nz};
    ///
    /// let app: Router = Router::new()
    ///     .route("/", get(|| async { "hello" }))
    ///     .layer(GcraLayer::new(Quota::per_second(nz!(10))).refuse_with(HttpAnswer::new()));
    /// # drop(app);
    /// ```
    pub fn refuse_with<R2>(self, refusal: R2) -> LimitLayer<E, R2, B, D> {
        let LimitLayer { shared, extract, door, .. } = self;
        LimitLayer { shared, extract, refusal, door }
    }

    /// Keeps what each request holds (its concurrency, the estimate to settle) until its
    /// response body ends, fails or is dropped, rather than until the response's head is
    /// ready: for streamed bodies (server-sent events, downloads, LLM answers), whose
    /// work goes on after the head. An [`HttpAnswer`](crate::http::HttpAnswer) does so
    /// already (this verb only undoes its
    /// [`release_at_head`](crate::http::HttpAnswer::release_at_head)); a layer that
    /// returns its refusals as errors needs it wherever bodies stream. See
    /// [`shell::body`](crate::shell::body).
    ///
    /// ```
    /// use tower_limits::{SemaphoreLayer, nz};
    ///
    /// // Refusals as errors, for a `HandleErrorLayer`; slots held until the body ends.
    /// let streams = SemaphoreLayer::new(nz!(10)).hold_body();
    /// # drop(streams);
    /// ```
    #[cfg(feature = "http")]
    pub fn hold_body(self) -> LimitLayer<E, R::Held, B, D>
    where
        R: crate::shell::body::HoldsBody,
    {
        let LimitLayer { shared, extract, refusal, door } = self;
        LimitLayer { shared, extract, refusal: refusal.hold_body(), door }
    }

    /// Holds the body (as [`hold_body`](Self::hold_body)) and settles each request to the
    /// usage its response body reports as it streams by (for example
    /// [`OpenAiStreamUsage`](crate::shell::body::OpenAiStreamUsage)); a body that ends
    /// without one keeps the usage read from the head, or the estimate.
    ///
    /// ```
    /// use tower_limits::extract::CostFromExtension;
    /// use tower_limits::http::HttpAnswer;
    /// use tower_limits::shell::body::OpenAiStreamUsage;
    /// use tower_limits::{Quota, TokenBucketLayer, nz};
    ///
    /// let tokens = TokenBucketLayer::new(Quota::per_minute(nz!(100_000)))
    ///     .cost(CostFromExtension)
    ///     .usage_from_body(OpenAiStreamUsage::default())
    ///     .refuse_with(HttpAnswer::new().usage_from_body(OpenAiStreamUsage::default()));
    /// # drop(tokens);
    /// ```
    #[cfg(feature = "http")]
    pub fn usage_from_body<O: crate::shell::body::BodyUsage>(self, observer: O) -> LimitLayer<E, R::WithUsage<O>, B, D>
    where
        R: crate::shell::body::HoldsBody,
    {
        let LimitLayer { shared, extract, refusal, door } = self;
        LimitLayer { shared, extract, refusal: refusal.usage_from_body(observer), door }
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

    /// The least time between the retry instants told to clients refused by a concurrency
    /// limit: the time the service behind this layer takes per request when it is what
    /// binds, such as one interval of an upstream's request rate.
    ///
    /// A concurrency refusal tells each client a place in a queue of refused clients,
    /// spaced by how long permits have been held lately. When the service behind the
    /// layer is the bottleneck, hold times grow only after its queue has formed, and the
    /// first places come too close together: clients that retry exactly when told are
    /// refused again. With a spacing, places come no faster than that service takes
    /// requests. Zero (the default) spaces by hold times alone.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_limits::{SemaphoreLayer, nz};
    ///
    /// // The upstream takes 100 requests a second: refused clients come back 10 ms apart.
    /// let layer = SemaphoreLayer::new(nz!(8)).retry_spacing(Duration::from_millis(10));
    /// # let _ = layer;
    /// ```
    pub fn retry_spacing(self, spacing: Duration) -> Self {
        self.with_settings(|s, _| s.retry_spacing = spacing)
    }

    /// The most requests waiting at once (with [`LimitSetLayer::wait`](crate::LimitLayer::wait)); beyond it they
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

    /// Shadow mode: every request is decided and recorded as usual (the layer's
    /// [`layer_stats`](Self::layer_stats), tracing, metrics, and the `RateLimit` headers
    /// of an [`HttpAnswer`](crate::http::HttpAnswer)), but none is refused: one that
    /// would have been is counted in [`LayerStats::shadow_refused`](super::LayerStats)
    /// (and as `result="shadow_refused"` in the metrics) and passes on, holding nothing
    /// (no concurrency was taken, so none is given back). Shadow mode never waits: it
    /// decides as a layer that refuses fast would, whatever [`wait`](Self::wait) says.
    /// For trying a limit on live traffic before enforcing it; to try one limit of a set,
    /// mark that limit instead ([`LimitPolicy::shadow`](crate::LimitPolicy::shadow)).
    ///
    /// ```
    /// use std::convert::Infallible;
    /// use tower::{ServiceBuilder, ServiceExt};
    /// use tower_limits::{GcraLayer, Quota, nz};
    ///
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
    /// let layer = GcraLayer::new(Quota::per_minute(nz!(1))).shadow();
    /// let svc = ServiceBuilder::new()
    ///     .layer(layer.clone())
    ///     .service_fn(|req: u32| async move { Ok::<_, Infallible>(req) });
    /// for i in 0..3 {
    ///     assert_eq!(svc.clone().oneshot(i).await.unwrap(), i); // never refused
    /// }
    /// assert_eq!(layer.layer_stats().shadow_refused, 2); // what enforcing would have refused
    /// # }
    /// ```
    pub fn shadow(self) -> Self {
        self.with_settings(|s, _| s.shadow = true)
    }

    /// The `layer` label of this layer's metrics (feature `metrics`; `default` when not
    /// set): a name of the user's choosing, such as `"gateway"` or `"upstream"`. Give each
    /// layer of a service its own, from a small fixed set.
    ///
    /// ```
    /// use tower_limits::{GcraLayer, Quota, nz};
    ///
    /// let layer = GcraLayer::new(Quota::per_second(nz!(10))).metrics_name("gateway");
    /// # drop(layer);
    /// ```
    #[cfg(feature = "metrics")]
    pub fn metrics_name(self, name: impl Into<std::borrow::Cow<'static, str>>) -> Self {
        let name = match name.into() {
            std::borrow::Cow::Borrowed(s) => ::metrics::SharedString::const_str(s),
            std::borrow::Cow::Owned(s) => ::metrics::SharedString::from_owned(s),
        };
        self.with_settings(|s, _| s.meter = s.meter.clone().named(name))
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

    /// The policy the layer enforces, when it was built from one (by
    /// [`LimitSetLayer::new`](crate::LimitLayer::new) or a named layer's constructor, after [`key`](Self::key)):
    /// what to give another backend, such as Redis, to enforce the same limits there.
    #[must_use]
    pub fn policy(&self) -> Option<&LimitSetPolicy> {
        self.shared.source.as_ref().map(|s| &s.policy)
    }

    /// The same layer over another backend (for example Redis built from
    /// [`policy`](Self::policy), shared by a fleet), with the same settings.
    ///
    /// ```
    /// use tower_limits::extract::PeerIp;
    /// use tower_limits::{GcraLayer, LimitSet, Quota, nz};
    ///
    /// let in_memory = GcraLayer::new(Quota::per_second(nz!(10))).key(PeerIp);
    /// let policy = in_memory.policy().unwrap().clone();
    /// // In production: tower_limits_redis::RedisBackend::builder(policy).build(&connection)?
    /// let elsewhere = LimitSet::new(policy).unwrap();
    /// let layer = in_memory.on_backend(elsewhere);
    /// # drop(layer);
    /// ```
    pub fn on_backend<B2: Backend>(self, backend: B2) -> LimitLayer<E, R, B2, D> {
        let shared = Shared::new(backend, self.shared.clock.clone(), self.shared.settings.clone());
        let LimitLayer { extract, refusal, door, .. } = self;
        LimitLayer { shared: Arc::new(shared), extract, refusal, door }
    }

    /// Now, on the layer's clock: the instant to pass to the backend's own methods
    /// (for example [`LimitPool::observe`](tower_limits_core::LimitPool::observe)).
    #[must_use]
    pub fn now(&self) -> tower_limits_core::Instant {
        use tower_limits_core::Clock;
        self.shared.clock.now()
    }

    /// Counters of the layer itself (waits and timeouts); see
    /// [`LimitSetLayer::stats`](crate::LimitLayer::stats) for the limits' own.
    #[must_use]
    pub fn layer_stats(&self) -> super::LayerStats {
        self.shared.layer_stats()
    }
}

impl<E, R, D> LimitLayer<E, R, LimitSet, D> {
    /// Per-limit counters of the in-memory set, with the layer's own.
    #[must_use]
    pub fn stats(&self) -> LimitSetStats {
        self.shared.backend.stats()
    }
}

impl<S, E: Clone, R: Clone, B, D> Layer<S> for LimitLayer<E, R, B, D> {
    type Service = LimitService<S, E, R, B>;

    fn layer(&self, inner: S) -> Self::Service {
        LimitService {
            inner,
            shared: self.shared.clone(),
            extract: self.extract.clone(),
            refusal: self.refusal.clone(),
        }
    }
}
