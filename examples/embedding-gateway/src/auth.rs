//! Authentication: a bearer API key becomes the tenant's tiers, in the request's
//! extensions.
//!
//! [`AuthLayer`] looks the `Authorization: Bearer <key>` token up in the configured keys,
//! by its SHA-256 digest: the gateway keeps digests only, and a configuration may give
//! them instead of the keys (`key_sha256`), so that neither holds a usable key. The keys
//! can be replaced while the gateway serves ([`AuthLayer::reload`], on SIGHUP in `serve`).
//! A known key puts its [`TenantKey`] (org, team, user, agent) and the tenant's
//! [`Identity`] (plan, weight) into the request's extensions, where the limit layers
//! read them ([`FromExtension`](tower_limits::extract::FromExtension)): clients cannot
//! forge them. A missing or unknown key is answered `401` at once, before anything is
//! read or charged.
//!
//! Guessing keys is throttled by client address: each failure charges the address's
//! budget (`gateway.auth_failures_per_minute`, with its burst), a GCRA of this library
//! keyed by the peer's IP, and while the budget is spent every request from the address
//! is answered `429` with `Retry-After`, valid keys included: a valid key must not tell
//! a guesser it guessed right. A client behind the same proxy as a guesser waits at most
//! the configured refill of one failure.

use std::collections::HashMap;
use std::convert::Infallible;
use std::fmt;
use std::sync::{Arc, PoisonError, RwLock};
use std::task::{Context, Poll};

use axum::body::Body;
use axum::extract::ConnectInfo;
use http::{HeaderName, HeaderValue, Request, Response, StatusCode, header};
use tower::{Layer, Service};
use tower_limits::extract::AsTenantKey;
use tower_limits::{LimitPolicy, LimitSet, LimitSetPolicy, TenantKey};

use crate::access::AccessInfo;
use crate::api;
use crate::config::{Config, KeyDigest};

/// Who a request is, as the auth layer found it.
#[derive(Debug, Clone)]
pub struct Identity {
    /// The tenant's name (its key at the first tier).
    pub tenant: Arc<str>,
    /// The tenant's index in the configuration.
    pub tenant_index: usize,
    /// The plan's index in the configuration.
    pub plan: usize,
    /// The tenant's weight in the fair queue.
    pub weight: u32,
    /// The tiers of the key.
    pub key: TenantKey,
    /// The key of its tenant in the fair queue.
    pub fair: FairTenant,
    /// The tenant's band in the fair queue (`gateway.bands`; 0 without bands).
    pub band: usize,
}

/// The band a request waits in at the fair queue: its tenant's, or one at or below it
/// that the request named in `gateway.band_header`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueBand(pub usize);

/// The tenant as the fair queue sees it: the key's first tier only (the org), so that
/// all of a tenant's users and agents share its weight.
#[derive(Debug, Clone)]
pub struct FairTenant(pub TenantKey);

impl AsTenantKey for FairTenant {
    fn tenant_key(&self) -> TenantKey {
        self.0.clone()
    }
}

/// When the request reached the gateway, for the queueing time.
#[derive(Debug, Clone, Copy)]
pub struct Arrived(pub tokio::time::Instant);

/// Maps bearer keys to tenants; `401` for the others, `429` for an address that failed
/// too often. Clones share one table of keys, which [`AuthLayer::reload`] replaces.
#[derive(Clone)]
pub struct AuthLayer {
    keys: Arc<RwLock<Arc<KeyTable>>>,
    failures: Option<Arc<Failures>>,
    /// The bands' names, the first going first.
    bands: Arc<[String]>,
    /// `gateway.band_header`.
    band_header: Option<HeaderName>,
}

/// The keys' digests and who each stands for.
type KeyTable = HashMap<KeyDigest, Identity>;

/// Why [`AuthLayer::reload`] kept the keys it had.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReloadRefused(pub String);

impl fmt::Display for ReloadRefused {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ReloadRefused {}

/// The failures of authentication each client address may still make.
struct Failures {
    set: LimitSet,
    quota: tower_limits::Quota,
    origin: tokio::time::Instant,
}

impl Failures {
    fn now(&self) -> tower_limits::Instant {
        tower_limits::Instant::from_nanos(u64::try_from(self.origin.elapsed().as_nanos()).unwrap_or(u64::MAX))
    }

    /// While the address's budget is spent: how long until it can fail once more. The
    /// snapshot's `reset` is the time until the whole burst is back; one failure comes
    /// back `burst - 1` intervals sooner.
    fn locked_for(&self, key: &TenantKey) -> Option<std::time::Duration> {
        let now = self.now();
        let s = self.set.peek(key, now).into_iter().next()?.snapshot;
        if s.remaining > 0 {
            return None;
        }
        let others =
            self.quota.interval().saturating_mul(u32::try_from(self.quota.max_burst() - 1).unwrap_or(u32::MAX));
        Some(s.reset.saturating_sub(others))
    }

    /// Charges one failure.
    fn failed(&self, key: &TenantKey) {
        let _ = self.set.check(key, 1, self.now());
    }
}

impl fmt::Debug for AuthLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let keys = self.keys.read().unwrap_or_else(PoisonError::into_inner).len();
        f.debug_struct("AuthLayer").field("keys", &keys).finish()
    }
}

impl AuthLayer {
    /// The keys of every tenant of `config`.
    #[must_use]
    pub fn new(config: &Config) -> Self {
        let keys = Arc::new(RwLock::new(Arc::new(key_table(config))));
        // Keyed by address: the table of addresses is bounded by the set's defaults.
        let failures = config.gateway.auth_failures.and_then(|quota| {
            let policy =
                LimitSetPolicy::new().tiers(["client"]).limit(LimitPolicy::gcra("auth_failures", quota).per("client"));
            let set = LimitSet::new(policy).ok()?;
            Some(Arc::new(Failures { set, quota, origin: tokio::time::Instant::now() }))
        });
        let bands = config.gateway.bands.iter().map(|b| b.name.clone()).collect();
        AuthLayer { keys, failures, bands, band_header: config.gateway.band_header.clone() }
    }

    /// The band `req` waits in: its tenant's `band`, or the one it names in
    /// `gateway.band_header`, which must exist and be at or below the tenant's own.
    ///
    /// # Errors
    /// An OpenAI-shaped `400` naming the header.
    fn band(&self, req: &Request<Body>, own: usize) -> Result<usize, Box<Response<Body>>> {
        let Some(header) = &self.band_header else { return Ok(own) };
        let Some(value) = req.headers().get(header) else { return Ok(own) };
        let name = value.to_str().unwrap_or_default().trim();
        let refuse = |message: String| {
            let mut response = api::error_with_param(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                "invalid_band",
                Some(header.as_str()),
                &message,
            );
            response.extensions_mut().insert(api::ErrorCode("invalid_band"));
            Box::new(response)
        };
        match self.bands.iter().position(|b| b == name) {
            None => Err(refuse(format!("no band is named {name:?} (bands: {})", self.bands.join(", ")))),
            Some(band) if band < own => {
                Err(refuse(format!("this key may use band {:?} or a later one, not {name:?}", self.bands[own])))
            }
            Some(band) => Ok(band),
        }
    }

    /// The identity a key stands for.
    #[must_use]
    pub fn identify(&self, key: &str) -> Option<Identity> {
        let table = self.keys.read().unwrap_or_else(PoisonError::into_inner).clone();
        table.get(&KeyDigest::of(key)).cloned()
    }

    /// Replaces the keys with those of `config` (a configuration read again, on SIGHUP),
    /// for every clone of this layer at once; requests already authenticated keep their
    /// identity. Only keys may change: the tenants and their plans, weights and tiers are
    /// built into the limits, so a `config` that changes them is refused (restart to apply
    /// it) and the keys stay as they were. Returns how many keys there are now.
    ///
    /// # Errors
    /// The tenants or their plans differ from those the gateway runs with.
    pub fn reload(&self, running: &Config, config: &Config) -> Result<usize, ReloadRefused> {
        let shape = |c: &Config| -> Vec<(String, String, u32, usize)> {
            c.tenants.iter().map(|t| (t.name.clone(), c.plans[t.plan].name.clone(), t.weight, t.band)).collect()
        };
        if shape(running) != shape(config)
            || running.tiers != config.tiers
            || running.gateway.bands != config.gateway.bands
        {
            return Err(ReloadRefused(
                "the tenants, their plans, weights or bands, the bands or the tiers changed: restart to apply them; \
                 the keys stay as they were"
                    .into(),
            ));
        }
        let table = key_table(config);
        let n = table.len();
        *self.keys.write().unwrap_or_else(PoisonError::into_inner) = Arc::new(table);
        Ok(n)
    }
}

/// Every key of `config`'s tenants, by digest.
fn key_table(config: &Config) -> KeyTable {
    let mut keys = HashMap::new();
    for (i, t) in config.tenants.iter().enumerate() {
        let tenant: Arc<str> = t.name.as_str().into();
        for k in &t.keys {
            let identity = Identity {
                fair: FairTenant(TenantKey::single(&t.name).unwrap_or_default()),
                tenant: tenant.clone(),
                tenant_index: i,
                plan: t.plan,
                weight: t.weight,
                key: k.tenant_key.clone(),
                band: t.band,
            };
            keys.insert(k.digest, identity);
        }
    }
    keys
}

impl<S> Layer<S> for AuthLayer {
    type Service = Auth<S>;

    fn layer(&self, inner: S) -> Auth<S> {
        Auth { inner, layer: self.clone() }
    }
}

/// The service of [`AuthLayer`].
#[derive(Clone, Debug)]
pub struct Auth<S> {
    inner: S,
    layer: AuthLayer,
}

impl<S> Service<Request<Body>> for Auth<S>
where
    S: Service<Request<Body>, Response = Response<Body>, Error = Infallible>,
    S::Future: Send + 'static,
{
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = crate::BoxFuture;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: Request<Body>) -> Self::Future {
        let arrived = Arrived(tokio::time::Instant::now());
        let client = req.extensions().get::<ConnectInfo<std::net::SocketAddr>>().map(|c| TenantKey::from_ip(c.0.ip()));
        let failures = self.layer.failures.as_deref().zip(client.as_ref());
        if let Some(wait) = failures.and_then(|(f, client)| f.locked_for(client)) {
            let mut response = api::error_response(
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_error",
                "too_many_auth_failures",
                "too many requests with a missing or unknown API key from this address",
            );
            tower_limits::http::write_retry_after(response.headers_mut(), wait);
            return Box::pin(std::future::ready(Ok(response)));
        }
        let identity = api::bearer(req.headers()).and_then(|k| self.layer.identify(k));
        let Some(identity) = identity else {
            if let Some((f, client)) = failures {
                f.failed(client);
            }
            let mut response = api::error_response(
                StatusCode::UNAUTHORIZED,
                "invalid_request_error",
                "invalid_api_key",
                "missing or unknown API key: send `Authorization: Bearer <key>`",
            );
            response.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            return Box::pin(std::future::ready(Ok(response)));
        };
        let band = match self.layer.band(&req, identity.band) {
            Ok(band) => band,
            Err(response) => return Box::pin(std::future::ready(Ok(*response))),
        };
        let tenant = identity.tenant.clone();
        req.extensions_mut().insert(QueueBand(band));
        req.extensions_mut().insert(identity.key.clone());
        req.extensions_mut().insert(identity.fair.clone());
        req.extensions_mut().insert(identity);
        req.extensions_mut().insert(arrived);
        let fut = self.inner.call(req);
        Box::pin(async move {
            let mut response = fut.await?;
            response.extensions_mut().get_or_insert_default::<AccessInfo>().tenant = Some(tenant);
            Ok(response)
        })
    }
}
