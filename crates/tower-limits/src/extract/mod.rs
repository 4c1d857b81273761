//! Who a request is and what it costs: key, cost and usage extractors.
//!
//! A layer asks a [`KeyExtractor`] for the request's [`TenantKey`], a [`CostExtractor`]
//! for its cost and, once the response is there, a [`UsageExtractor`] for the real usage
//! to settle with. The recommended source of identity is a typed value that an
//! authentication layer put in the request's extensions ([`FromExtension`]): it cannot be
//! forged by the client. Headers and peer addresses are available, with their caveats.

use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;

use tower_limits_core::TenantKey;

mod band;
pub use band::WithBand;

/// The request carries no key for the limits (and no default key was configured).
///
/// Two cases answer differently. A key the client did not give (no credentials, no
/// header) is the client's: `401`. A key whose source is not wired into the server (the
/// peer address that the server never recorded) is missing from every request alike: it
/// is made with [`MissingKey::unwired`], names the fix, is logged once as a warning and
/// answers `500`, so that an operator sees the cause instead of every client seeing `401`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MissingKey {
    what: &'static str,
    fix: Option<&'static str>,
}

impl MissingKey {
    /// A missing key, saying what was looked for.
    ///
    /// ```
    /// use tower_limits::extract::MissingKey;
    ///
    /// let missing = MissingKey::new("no x-api-key header");
    /// assert_eq!(missing.what(), "no x-api-key header");
    /// assert_eq!(missing.fix(), None);
    /// ```
    #[must_use]
    pub const fn new(what: &'static str) -> Self {
        MissingKey { what, fix: None }
    }

    /// A key whose source the server never provides, with the setup that provides it:
    /// the refusal is the server's fault, not the client's.
    ///
    /// ```
    /// use tower_limits::extract::MissingKey;
    ///
    /// let missing = MissingKey::unwired("no peer address", "record it when accepting connections");
    /// assert_eq!(missing.fix(), Some("record it when accepting connections"));
    /// ```
    #[must_use]
    pub const fn unwired(what: &'static str, fix: &'static str) -> Self {
        MissingKey { what, fix: Some(fix) }
    }

    /// What was looked for: an extension type, a header, the peer address.
    #[must_use]
    pub fn what(&self) -> &'static str {
        self.what
    }

    /// For a key whose source is not wired into the server, how to wire it.
    #[must_use]
    pub fn fix(&self) -> Option<&'static str> {
        self.fix
    }
}

impl fmt::Display for MissingKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "the request has no tenant key ({})", self.what)?;
        if let Some(fix) = self.fix {
            write!(f, "; the server does not provide it: {fix}")?;
        }
        Ok(())
    }
}

impl std::error::Error for MissingKey {}

/// Watches a layer's key extractor, to make a key that never comes loud: a source that
/// is not wired is logged once as a warning with its fix and refused as the server's
/// error; a key that no request has carried yet is logged once too, since an extension
/// that a middleware inserts after this layer (or never) looks just like that.
#[derive(Debug, Default)]
pub(crate) struct KeyWatch {
    seen: std::sync::atomic::AtomicBool,
    warned: std::sync::atomic::AtomicBool,
}

impl KeyWatch {
    /// A request carried its key. One read once a key was seen: no shared write per call.
    #[inline]
    pub(crate) fn found(&self) {
        use std::sync::atomic::Ordering::Relaxed;
        if !self.seen.load(Relaxed) {
            self.seen.store(true, Relaxed);
        }
    }

    /// The refusal for a request without a key.
    pub(crate) fn missing(&self, missing: &MissingKey) -> crate::LimitError {
        use crate::error::{ErrorKind, LimitError};
        use std::sync::atomic::Ordering::Relaxed;
        let first = !self.warned.load(Relaxed) && !self.warned.swap(true, Relaxed);
        if let Some(fix) = missing.fix() {
            if first {
                tracing::warn!(target: "tower_limits", what = missing.what(), fix, "a limit layer cannot find its key in any request: {fix}");
            }
            return LimitError::new(ErrorKind::KeySourceMissing).with_detail(missing.to_string());
        }
        if first && !self.seen.load(Relaxed) {
            tracing::warn!(
                target: "tower_limits",
                what = missing.what(),
                "the first request without a tenant key came before any request with one: if every request is refused \
                 as unauthenticated, the middleware that provides the key runs after the limit layer (in a \
                 ServiceBuilder or a Router, layers listed first run first) or not at all"
            );
        }
        LimitError::new(ErrorKind::MissingKey).with_detail(missing.to_string())
    }
}

/// What a layer reads from each request and response, in one value: who the request is
/// (`K`, a [`KeyExtractor`]), what it costs (`C`, a [`CostExtractor`]), the real usage its
/// response reports (`U`, a [`UsageExtractor`]) and how a grant is recorded on the request
/// (`A`, an [`Annotate`]). Every limit layer ([`LimitLayer`](crate::LimitLayer) and the
/// named ones, [`FairQueueLayer`](crate::FairQueueLayer)) carries one as its first type
/// parameter; the layers' verbs [`key`](crate::LimitLayer::key),
/// [`cost`](crate::LimitLayer::cost), [`usage`](crate::LimitLayer::usage) and
/// [`annotate`](crate::LimitLayer::annotate) set its parts, so user code rarely spells it.
///
/// ```
/// use tower_limits::extract::{Extractors, FromExtension, NoAnnotation, NoUsage, One};
/// use tower_limits::{GcraLayer, Quota, TenantKey, nz};
///
/// // The type of a layer keyed by a tenant from the request's extensions.
/// type PerTenant = GcraLayer<Extractors<FromExtension<TenantKey>>>;
/// let layer: PerTenant = GcraLayer::new(Quota::per_second(nz!(10))).key(FromExtension::new());
/// # drop(layer);
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct Extractors<K = GlobalKey, C = One, U = NoUsage, A = NoAnnotation> {
    pub(crate) keys: K,
    pub(crate) cost: C,
    pub(crate) usage: U,
    pub(crate) annotate: A,
}

impl<K, C, U, A> Extractors<K, C, U, A> {
    pub(crate) fn with_keys<K2>(self, keys: K2) -> Extractors<K2, C, U, A> {
        Extractors { keys, cost: self.cost, usage: self.usage, annotate: self.annotate }
    }

    pub(crate) fn with_cost<C2>(self, cost: C2) -> Extractors<K, C2, U, A> {
        Extractors { keys: self.keys, cost, usage: self.usage, annotate: self.annotate }
    }

    pub(crate) fn with_usage<U2>(self, usage: U2) -> Extractors<K, C, U2, A> {
        Extractors { keys: self.keys, cost: self.cost, usage, annotate: self.annotate }
    }

    pub(crate) fn with_annotate<A2>(self, annotate: A2) -> Extractors<K, C, U, A2> {
        Extractors { keys: self.keys, cost: self.cost, usage: self.usage, annotate }
    }
}

/// Finds the tenant key of a request.
pub trait KeyExtractor<Req>: Clone + Send + Sync + 'static {
    /// Whether every request's key is [`TenantKey::global()`]: the layer then uses one
    /// key it keeps, and never calls [`extract`](Self::extract). `false` unless said.
    ///
    /// ```
    /// use tower_limits::extract::{GlobalKey, KeyExtractor};
    ///
    /// assert!(<GlobalKey as KeyExtractor<()>>::GLOBAL);
    /// ```
    const GLOBAL: bool = false;

    /// The key, or why there is none.
    ///
    /// # Errors
    /// [`MissingKey`] when the request carries no key.
    fn extract(&self, req: &Req) -> Result<TenantKey, MissingKey>;

    /// The priority band the request waits in, in a fair queue with bands (0 is the first
    /// band configured); `None`, the default, for the queue's default band. Set with
    /// [`FairQueueLayer::band`](crate::FairQueueLayer::band); other layers do not ask.
    ///
    /// ```
    /// use tower_limits::extract::{GlobalKey, KeyExtractor};
    ///
    /// assert_eq!(KeyExtractor::<()>::band(&GlobalKey, &()), None);
    /// ```
    #[inline]
    fn band(&self, _req: &Req) -> Option<usize> {
        None
    }
}

/// The key of everyone: for sets whose limits are all global.
#[derive(Debug, Clone, Copy, Default)]
pub struct GlobalKey;

impl<Req> KeyExtractor<Req> for GlobalKey {
    const GLOBAL: bool = true;

    #[inline]
    fn extract(&self, _req: &Req) -> Result<TenantKey, MissingKey> {
        Ok(TenantKey::global())
    }
}

/// A key computed by a closure.
///
/// ```
/// use tower_limits::extract::{KeyExtractor, KeyFn};
/// use tower_limits::TenantKey;
///
/// let by_path = KeyFn::new(|path: &String| TenantKey::single(path).ok());
/// assert_eq!(by_path.extract(&"/v1/embeddings".to_owned()).unwrap().to_string(), "/v1/embeddings");
/// ```
pub struct KeyFn<F, Req> {
    f: Arc<F>,
    _req: PhantomData<fn(&Req)>,
}

impl<F, Req> KeyFn<F, Req>
where
    F: Fn(&Req) -> Option<TenantKey> + Send + Sync + 'static,
{
    /// The key `f` returns; `None` is a missing key.
    pub fn new(f: F) -> Self {
        KeyFn { f: Arc::new(f), _req: PhantomData }
    }
}

impl<F, Req> Clone for KeyFn<F, Req> {
    fn clone(&self) -> Self {
        KeyFn { f: self.f.clone(), _req: PhantomData }
    }
}

impl<F, Req> fmt::Debug for KeyFn<F, Req> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("KeyFn")
    }
}

impl<F, Req> KeyExtractor<Req> for KeyFn<F, Req>
where
    F: Fn(&Req) -> Option<TenantKey> + Send + Sync + 'static,
    Req: 'static,
{
    fn extract(&self, req: &Req) -> Result<TenantKey, MissingKey> {
        (self.f)(req).ok_or(MissingKey::new("the key function returned none"))
    }
}

/// A value that names a tenant: what an authentication layer puts in the request's
/// extensions. [`TenantKey`] itself is one (tiers from one extension).
pub trait AsTenantKey: Clone + Send + Sync + 'static {
    /// The tenant key this value stands for.
    fn tenant_key(&self) -> TenantKey;
}

impl AsTenantKey for TenantKey {
    #[inline]
    fn tenant_key(&self) -> TenantKey {
        self.clone()
    }
}

/// The key from a typed value in the request's extensions: what an authentication
/// layer inserted. The recommended extractor: clients cannot forge it.
pub struct FromExtension<T> {
    _t: PhantomData<fn() -> T>,
}

impl<T> FromExtension<T> {
    /// Reads a `T` from the request's extensions.
    #[must_use]
    pub const fn new() -> Self {
        FromExtension { _t: PhantomData }
    }
}

impl<T> Default for FromExtension<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T> Clone for FromExtension<T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for FromExtension<T> {}

impl<T> fmt::Debug for FromExtension<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "FromExtension<{}>", std::any::type_name::<T>())
    }
}

#[cfg(feature = "http")]
impl<T: AsTenantKey, B> KeyExtractor<http::Request<B>> for FromExtension<T> {
    #[inline]
    fn extract(&self, req: &http::Request<B>) -> Result<TenantKey, MissingKey> {
        req.extensions().get::<T>().map(AsTenantKey::tenant_key).ok_or(MissingKey::new(std::any::type_name::<T>()))
    }
}

/// The key from the peer's IP address, found in the request's extensions as axum's
/// `ConnectInfo<SocketAddr>` (feature `axum`, on by default: serve the router with
/// `into_make_service_with_connect_info::<SocketAddr>()`), a `std::net::SocketAddr` or a
/// `std::net::IpAddr` (insert one from your server's accept loop, as hyper and tonic
/// servers do). The key is the address's bytes ([`TenantKey::from_ip`]): nothing is
/// formatted or allocated per request.
///
/// A server that never records the peer's address has it in no request: that is a setup
/// error, not a client's, so it is refused as
/// [`ErrorKind::KeySourceMissing`](crate::ErrorKind::KeySourceMissing) (`500` in HTTP
/// answers) and logged once with the fix, never answered `401` as an unauthenticated
/// client would be.
///
/// Behind a proxy every request has the proxy's address: use an authenticated key
/// instead. `X-Forwarded-For` is never trusted by default.
///
/// ```
/// use std::net::SocketAddr;
/// use tower_limits::extract::{KeyExtractor, PeerIp};
///
/// let mut req = http::Request::new(());
/// assert!(PeerIp.extract(&req).unwrap_err().fix().is_some()); // the server's setup
/// req.extensions_mut().insert(SocketAddr::from(([192, 0, 2, 7], 443)));
/// assert_eq!(PeerIp.extract(&req).unwrap().to_string(), "192.0.2.7");
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct PeerIp;

#[cfg(feature = "http")]
impl<B> KeyExtractor<http::Request<B>> for PeerIp {
    /// Inlined, so that the key is written where the layer keeps it: a key returned from
    /// a call is read back at once from the bytes just written, which stalls the core.
    #[inline]
    fn extract(&self, req: &http::Request<B>) -> Result<TenantKey, MissingKey> {
        let ip = peer_ip(req).ok_or(NO_PEER_ADDRESS)?;
        Ok(TenantKey::from_ip(ip))
    }
}

#[cfg(feature = "http")]
const NO_PEER_ADDRESS: MissingKey = MissingKey::unwired(
    "no peer address in the request's extensions",
    "with axum, serve the router with `into_make_service_with_connect_info::<std::net::SocketAddr>()` \
     (and keep tower-limits' `axum` feature on); with hyper or tonic, insert the connection's \
     `SocketAddr` into each request's extensions",
);

/// The peer's address from the request's extensions.
#[cfg(feature = "http")]
fn peer_ip<B>(req: &http::Request<B>) -> Option<std::net::IpAddr> {
    req.extensions()
        .get::<std::net::SocketAddr>()
        .map(std::net::SocketAddr::ip)
        .or_else(|| req.extensions().get::<std::net::IpAddr>().copied())
        .or_else(|| connect_info(req))
}

#[cfg(feature = "axum")]
fn connect_info<B>(req: &http::Request<B>) -> Option<std::net::IpAddr> {
    req.extensions().get::<axum::extract::ConnectInfo<std::net::SocketAddr>>().map(|info| info.0.ip())
}

#[cfg(all(feature = "http", not(feature = "axum")))]
fn connect_info<B>(_req: &http::Request<B>) -> Option<std::net::IpAddr> {
    None
}

/// The key from a request header. **Opt-in and spoofable**: any client can send any
/// value, so use it only behind something that sets or checks the header.
///
/// ```
/// use http::{HeaderName, Request};
/// use tower_limits::TenantKey;
/// use tower_limits::extract::{HeaderKey, KeyExtractor};
///
/// let by_account = HeaderKey::new(HeaderName::from_static("x-account-id")).numeric();
/// let req = Request::builder().header("x-account-id", "4711").body(()).unwrap();
/// assert_eq!(by_account.extract(&req).unwrap(), TenantKey::from_u64(4711));
/// let req = Request::builder().header("x-account-id", "acme").body(()).unwrap();
/// assert!(by_account.extract(&req).is_err());
/// ```
#[cfg(feature = "http")]
#[derive(Debug, Clone)]
pub struct HeaderKey {
    name: http::HeaderName,
    numeric: bool,
}

#[cfg(feature = "http")]
impl HeaderKey {
    /// Reads the header `name`; its value is the key, as text.
    #[must_use]
    pub fn new(name: http::HeaderName) -> Self {
        HeaderKey { name, numeric: false }
    }

    /// Reads the value as a decimal number: the key is that number
    /// ([`TenantKey::from_u64`]), kept as its eight bytes. A value that is not a number
    /// is a missing key.
    #[must_use]
    pub fn numeric(self) -> Self {
        HeaderKey { numeric: true, ..self }
    }
}

#[cfg(feature = "http")]
impl<B> KeyExtractor<http::Request<B>> for HeaderKey {
    fn extract(&self, req: &http::Request<B>) -> Result<TenantKey, MissingKey> {
        let value = req.headers().get(&self.name).ok_or(MissingKey::new("no key header"))?;
        let text = value.to_str().map_err(|_| MissingKey::new("key header is not text"))?;
        if self.numeric {
            let id = text.parse().map_err(|_| MissingKey::new("key header is not a number"))?;
            return Ok(TenantKey::from_u64(id));
        }
        TenantKey::single(text).map_err(|_| MissingKey::new("unusable key header"))
    }
}

/// The cost of a request.
pub trait CostExtractor<Req>: Clone + Send + Sync + 'static {
    /// What the request costs against limits that count cost.
    fn cost(&self, req: &Req) -> u64;
}

/// Every request costs one.
#[derive(Debug, Clone, Copy, Default)]
pub struct One;

impl<Req> CostExtractor<Req> for One {
    #[inline]
    fn cost(&self, _req: &Req) -> u64 {
        1
    }
}

/// A request's estimated cost, put in its extensions (for example the token count of an
/// embedding request, known before the call). Read by [`CostFromExtension`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cost(pub u64);

/// The real usage of a request, put in its response's extensions (for example the
/// upstream's `usage.total_tokens`). Read by [`UsageFromExtension`] to settle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Usage(pub u64);

/// The cost from a [`Cost`] in the request's extensions; one when there is none.
#[derive(Debug, Clone, Copy, Default)]
pub struct CostFromExtension;

#[cfg(feature = "http")]
impl<B> CostExtractor<http::Request<B>> for CostFromExtension {
    #[inline]
    fn cost(&self, req: &http::Request<B>) -> u64 {
        req.extensions().get::<Cost>().map_or(1, |c| c.0)
    }
}

/// A cost computed by a closure.
pub struct CostFn<F, Req> {
    f: Arc<F>,
    _req: PhantomData<fn(&Req)>,
}

impl<F, Req> CostFn<F, Req>
where
    F: Fn(&Req) -> u64 + Send + Sync + 'static,
{
    /// The cost `f` returns.
    pub fn new(f: F) -> Self {
        CostFn { f: Arc::new(f), _req: PhantomData }
    }
}

impl<F, Req> Clone for CostFn<F, Req> {
    fn clone(&self) -> Self {
        CostFn { f: self.f.clone(), _req: PhantomData }
    }
}

impl<F, Req> fmt::Debug for CostFn<F, Req> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("CostFn")
    }
}

impl<F, Req> CostExtractor<Req> for CostFn<F, Req>
where
    F: Fn(&Req) -> u64 + Send + Sync + 'static,
    Req: 'static,
{
    fn cost(&self, req: &Req) -> u64 {
        (self.f)(req)
    }
}

/// The real usage of a request, read from its response, to settle the permit with.
pub trait UsageExtractor<Resp>: Clone + Send + Sync + 'static {
    /// Whether this extractor can ever report a usage; when not, nothing waits for the
    /// response to settle.
    const REPORTS: bool = true;

    /// The real usage, if the response reports one.
    fn usage(&self, resp: &Resp) -> Option<u64>;

    /// What the response says of the upstream's limits, for a backend that mirrors them
    /// (a [`LimitPool`](tower_limits_core::LimitPool) learns from it: see
    /// [`UpstreamReports`]). `None` by default.
    fn upstream(&self, resp: &Resp) -> Option<tower_limits_core::UpstreamReport> {
        let _ = resp;
        None
    }
}

/// Feeds each response's word on the upstream's limits back to the layer's
/// [`LimitPool`](tower_limits_core::LimitPool): a `429` or `503` with `Retry-After`
/// benches the account that served it for every queued request, and the
/// `x-ratelimit-remaining-*` counts lower its mirror; and settles with the usage that `U`
/// reads (none by default). By default it reads `http::Response`s with
/// [`upstream_report`](crate::http::upstream_report); [`UpstreamReports::with`] reads any
/// other response (a `reqwest::Response`, say) with a function. Set it as the layer's
/// usage extractor ([`usage`](crate::LimitLayer::usage)): no glue after each call.
///
/// ```
/// use std::time::Duration;
/// use tower::{ServiceBuilder, ServiceExt};
/// use tower_limits::extract::UpstreamReports;
/// use tower_limits::{LimitPolicy, LimitPool, LimitSet, LimitSetLayer, LimitSetPolicy, Quota, Selection, nz};
///
/// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
/// let rpm = Quota::per_minute(nz!(600)).burst(nz!(10));
/// let account = LimitSet::new(LimitSetPolicy::new().limit(LimitPolicy::gcra("rpm", rpm))).unwrap();
/// let pool = LimitPool::builder(Selection::RoundRobin).member("provider", account, ()).build().unwrap();
/// let client = ServiceBuilder::new()
///     .layer(LimitSetLayer::with_backend(pool).usage(UpstreamReports::new()).wait(Duration::from_secs(60)))
///     .service_fn(|_req: http::Request<()>| async {
///         // The provider refuses once, for 20 seconds.
///         let refused = http::Response::builder().status(429).header("retry-after", "20").body(()).unwrap();
///         Ok::<_, std::convert::Infallible>(refused)
///     });
/// let start = tokio::time::Instant::now();
/// client.clone().oneshot(http::Request::new(())).await.unwrap();
/// // The next request waits out the provider's 20 seconds in the limiter, unasked.
/// client.oneshot(http::Request::new(())).await.unwrap();
/// assert_eq!(start.elapsed(), Duration::from_secs(20));
/// # }
/// ```
pub struct UpstreamReports<F = ReadHttp, U = NoUsage> {
    read: F,
    usage: U,
}

/// How [`UpstreamReports`] reads an `http::Response`: with
/// [`upstream_report`](crate::http::upstream_report).
#[derive(Debug, Clone, Copy, Default)]
pub struct ReadHttp;

impl UpstreamReports {
    /// Reads `http::Response`s.
    #[must_use]
    pub const fn new() -> Self {
        UpstreamReports { read: ReadHttp, usage: NoUsage }
    }
}

impl Default for UpstreamReports {
    fn default() -> Self {
        Self::new()
    }
}

impl<F> UpstreamReports<F> {
    /// Reads responses of any type with `read`, for example a `reqwest::Response`:
    /// `UpstreamReports::with(|r: &reqwest::Response| upstream_report(r.status(), r.headers()))`.
    ///
    /// ```
    /// use tower_limits::extract::{UpstreamReports, UsageExtractor};
    /// use tower_limits::http::upstream_report;
    ///
    /// let reports = UpstreamReports::with(|r: &http::Response<()>| upstream_report(r.status(), r.headers()));
    /// let refused = http::Response::builder().status(429).header("retry-after", "3").body(()).unwrap();
    /// assert_eq!(reports.upstream(&refused).unwrap().retry_after, Some(std::time::Duration::from_secs(3)));
    /// ```
    pub fn with<Resp>(read: F) -> Self
    where
        F: Fn(&Resp) -> tower_limits_core::UpstreamReport,
    {
        UpstreamReports { read, usage: NoUsage }
    }
}

impl<F, U> UpstreamReports<F, U> {
    /// Also settles each request with the usage `usage` reads from the response (for
    /// example [`UsageFromExtension`]).
    ///
    /// ```
    /// use tower_limits::extract::{UpstreamReports, UsageFromExtension};
    ///
    /// let reports = UpstreamReports::new().settling(UsageFromExtension);
    /// # drop(reports);
    /// ```
    pub fn settling<U2>(self, usage: U2) -> UpstreamReports<F, U2> {
        UpstreamReports { read: self.read, usage }
    }
}

impl<F: Clone, U: Clone> Clone for UpstreamReports<F, U> {
    fn clone(&self) -> Self {
        UpstreamReports { read: self.read.clone(), usage: self.usage.clone() }
    }
}

impl<F, U: fmt::Debug> fmt::Debug for UpstreamReports<F, U> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UpstreamReports").field("usage", &self.usage).finish_non_exhaustive()
    }
}

#[cfg(feature = "http")]
impl<B, U: UsageExtractor<http::Response<B>>> UsageExtractor<http::Response<B>> for UpstreamReports<ReadHttp, U> {
    fn usage(&self, resp: &http::Response<B>) -> Option<u64> {
        self.usage.usage(resp)
    }

    fn upstream(&self, resp: &http::Response<B>) -> Option<tower_limits_core::UpstreamReport> {
        Some(crate::http::upstream_report(resp.status(), resp.headers()))
    }
}

impl<Resp, F, U> UsageExtractor<Resp> for UpstreamReports<F, U>
where
    F: Fn(&Resp) -> tower_limits_core::UpstreamReport + Clone + Send + Sync + 'static,
    U: UsageExtractor<Resp>,
{
    fn usage(&self, resp: &Resp) -> Option<u64> {
        self.usage.usage(resp)
    }

    fn upstream(&self, resp: &Resp) -> Option<tower_limits_core::UpstreamReport> {
        Some((self.read)(resp))
    }
}

/// Responses report no usage: the estimate stands.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoUsage;

impl<Resp> UsageExtractor<Resp> for NoUsage {
    const REPORTS: bool = false;

    #[inline]
    fn usage(&self, _resp: &Resp) -> Option<u64> {
        None
    }
}

/// The usage from a [`Usage`] in the response's extensions.
#[derive(Debug, Clone, Copy, Default)]
pub struct UsageFromExtension;

#[cfg(feature = "http")]
impl<B> UsageExtractor<http::Response<B>> for UsageFromExtension {
    #[inline]
    fn usage(&self, resp: &http::Response<B>) -> Option<u64> {
        resp.extensions().get::<Usage>().map(|u| u.0)
    }
}

/// A usage computed by a closure.
pub struct UsageFn<F, Resp> {
    f: Arc<F>,
    _resp: PhantomData<fn(&Resp)>,
}

impl<F, Resp> UsageFn<F, Resp>
where
    F: Fn(&Resp) -> Option<u64> + Send + Sync + 'static,
{
    /// The usage `f` returns.
    pub fn new(f: F) -> Self {
        UsageFn { f: Arc::new(f), _resp: PhantomData }
    }
}

impl<F, Resp> Clone for UsageFn<F, Resp> {
    fn clone(&self) -> Self {
        UsageFn { f: self.f.clone(), _resp: PhantomData }
    }
}

impl<F, Resp> fmt::Debug for UsageFn<F, Resp> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("UsageFn")
    }
}

impl<F, Resp> UsageExtractor<Resp> for UsageFn<F, Resp>
where
    F: Fn(&Resp) -> Option<u64> + Send + Sync + 'static,
    Resp: 'static,
{
    fn usage(&self, resp: &Resp) -> Option<u64> {
        (self.f)(resp)
    }
}

/// Records a grant on the request before the inner service sees it.
pub trait Annotate<Req, G>: Clone + Send + Sync + 'static {
    /// Writes what the inner service should know about `grant` into `req`.
    fn annotate(&self, req: &mut Req, grant: &G);
}

/// Records nothing.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoAnnotation;

impl<Req, G> Annotate<Req, G> for NoAnnotation {
    #[inline]
    fn annotate(&self, _req: &mut Req, _grant: &G) {}
}

/// Puts the member a [`LimitPool`](tower_limits_core::LimitPool) chose, a
/// [`Chosen<T>`](tower_limits_core::Chosen) with its configuration, in the request's
/// extensions: how the inner service learns which upstream account to use.
#[derive(Debug, Clone, Copy, Default)]
pub struct InsertChosen;

#[cfg(feature = "http")]
impl<B, T: Send + Sync + 'static> Annotate<http::Request<B>, tower_limits_core::PoolGrant<T>> for InsertChosen {
    fn annotate(&self, req: &mut http::Request<B>, grant: &tower_limits_core::PoolGrant<T>) {
        req.extensions_mut().insert(grant.chosen().clone());
    }
}
