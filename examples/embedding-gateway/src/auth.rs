//! Authentication: a bearer API key becomes the tenant's tiers, in the request's
//! extensions.
//!
//! [`AuthLayer`] looks the `Authorization: Bearer <key>` token up in the configured keys.
//! A known key puts its [`TenantKey`] (org, team, user, agent) and the tenant's
//! [`Identity`] (plan, weight) into the request's extensions, where the limit layers
//! read them ([`FromExtension`](tower_limits::extract::FromExtension)): clients cannot
//! forge them. A missing or unknown key is answered `401` at once, before anything is
//! read or charged.

use std::collections::HashMap;
use std::convert::Infallible;
use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::body::Body;
use http::{HeaderValue, Request, Response, StatusCode, header};
use tower::{Layer, Service};
use tower_limits::TenantKey;
use tower_limits::extract::AsTenantKey;

use crate::access::AccessInfo;
use crate::api;
use crate::config::Config;

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
}

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

/// Maps bearer keys to tenants; `401` for the others.
#[derive(Clone)]
pub struct AuthLayer {
    keys: Arc<HashMap<String, Identity>>,
}

impl fmt::Debug for AuthLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never print the keys.
        f.debug_struct("AuthLayer").field("keys", &self.keys.len()).finish()
    }
}

impl AuthLayer {
    /// The keys of every tenant of `config`.
    #[must_use]
    pub fn new(config: &Config) -> Self {
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
                };
                keys.insert(k.secret.clone(), identity);
            }
        }
        AuthLayer { keys: Arc::new(keys) }
    }

    /// The identity a key stands for.
    #[must_use]
    pub fn identify(&self, key: &str) -> Option<&Identity> {
        self.keys.get(key)
    }
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
        let identity = api::bearer(req.headers()).and_then(|k| self.layer.identify(k)).cloned();
        let Some(identity) = identity else {
            let mut response = api::error_response(
                StatusCode::UNAUTHORIZED,
                "invalid_request_error",
                "invalid_api_key",
                "missing or unknown API key: send `Authorization: Bearer <key>`",
            );
            response.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            return Box::pin(std::future::ready(Ok(response)));
        };
        let tenant = identity.tenant.clone();
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
