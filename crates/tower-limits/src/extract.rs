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

/// The request carries no key for the limits (and no default key was configured).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyMissing {
    what: &'static str,
}

impl KeyMissing {
    /// A missing key, saying what was looked for.
    #[must_use]
    pub const fn new(what: &'static str) -> Self {
        KeyMissing { what }
    }

    /// What was looked for: an extension type, a header, the peer address.
    #[must_use]
    pub fn what(&self) -> &'static str {
        self.what
    }
}

impl fmt::Display for KeyMissing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "the request has no tenant key ({})", self.what)
    }
}

impl std::error::Error for KeyMissing {}

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
    /// [`KeyMissing`] when the request carries no key.
    fn extract(&self, req: &Req) -> Result<TenantKey, KeyMissing>;
}

/// The key of everyone: for sets whose limits are all global.
#[derive(Debug, Clone, Copy, Default)]
pub struct GlobalKey;

impl<Req> KeyExtractor<Req> for GlobalKey {
    const GLOBAL: bool = true;

    #[inline]
    fn extract(&self, _req: &Req) -> Result<TenantKey, KeyMissing> {
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
    fn extract(&self, req: &Req) -> Result<TenantKey, KeyMissing> {
        (self.f)(req).ok_or(KeyMissing::new("the key function returned none"))
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
    fn extract(&self, req: &http::Request<B>) -> Result<TenantKey, KeyMissing> {
        req.extensions().get::<T>().map(AsTenantKey::tenant_key).ok_or(KeyMissing::new("no tenant extension"))
    }
}

/// The key from the peer's IP address, found in the request's extensions as a
/// `std::net::SocketAddr` or `std::net::IpAddr` (insert one from your server's accept
/// loop), or, with the feature `axum`, as axum's `ConnectInfo<SocketAddr>`. The key is
/// the address's bytes ([`TenantKey::from_ip`]): nothing is formatted or allocated per
/// request. Behind a proxy every request has the proxy's address: use
/// an authenticated key instead. `X-Forwarded-For` is never trusted by default.
#[derive(Debug, Clone, Copy, Default)]
pub struct PeerIp;

#[cfg(feature = "http")]
impl<B> KeyExtractor<http::Request<B>> for PeerIp {
    /// Inlined, so that the key is written where the layer keeps it: a key returned from
    /// a call is read back at once from the bytes just written, which stalls the core.
    #[inline]
    fn extract(&self, req: &http::Request<B>) -> Result<TenantKey, KeyMissing> {
        let ip = peer_ip(req).ok_or(KeyMissing::new("no peer address extension"))?;
        Ok(TenantKey::from_ip(ip))
    }
}

/// The peer's address from the request's extensions.
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
    fn extract(&self, req: &http::Request<B>) -> Result<TenantKey, KeyMissing> {
        let value = req.headers().get(&self.name).ok_or(KeyMissing::new("no key header"))?;
        let text = value.to_str().map_err(|_| KeyMissing::new("key header is not text"))?;
        if self.numeric {
            let id = text.parse().map_err(|_| KeyMissing::new("key header is not a number"))?;
            return Ok(TenantKey::from_u64(id));
        }
        TenantKey::single(text).map_err(|_| KeyMissing::new("unusable key header"))
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
