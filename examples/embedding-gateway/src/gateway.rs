//! The gateway's router: authentication, costing, the tenant's own limits, the shared
//! upstream capacity, and the call to the chosen upstream account.
//!
//! ```text
//! POST /v1/embeddings
//!   AuthLayer          Bearer key -> TenantKey + Identity          401
//!   Prepare            body -> Cost(tokens), before the call      400, 413
//!   PlanLimits         the tenant's plan: RPM/TPM per tier,        429 (RateLimit fields,
//!                      concurrency per tenant (LimitSetLayer)          JSON naming tier+limit)
//!   FairQueueLayer     tenants (orgs) take turns by weight for     429 tenant queue full,
//!                      the LimitPool of upstream accounts; the     503 queue full or
//!                      turn waits at the gate for an account       max_wait passed
//!                      with room; InsertChosen names it
//!   UpstreamCall       POST to the chosen account; Usage(total_tokens) settles every
//!                      layer above; the upstream's x-ratelimit-* feed LimitPool::observe
//! ```

use std::convert::Infallible;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::routing::post_service;
use http::{HeaderValue, Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Limited};
use tower::util::BoxCloneSyncService;
use tower::{BoxError, Layer, Service, ServiceBuilder, ServiceExt};
use tower_limits::core::fair_queue::FairQueueConfig;
use tower_limits::extract::{Cost, CostFromExtension, FromExtension, InsertChosen, Usage, UsageFromExtension};
use tower_limits::http::{HttpAnswer, upstream_report};
use tower_limits::{Chosen, FairQueueLayer, Instant, LimitPool, LimitSet, LimitSetLayer, TenantKey};
use tower_limits_redis::{RedisBackend, RedisConnection};

use crate::BoxFuture;
use crate::api::{self, EmbeddingRequest, UsageOnly};
use crate::auth::{Arrived, AuthLayer, FairTenant, Identity};
use crate::config::{Account, Config};
use crate::tokenizer;

/// How the gateway reaches the upstream: HTTP in production, or a router in the same
/// process (tests).
pub type Transport = BoxCloneSyncService<Request<Body>, Response<Body>, BoxError>;

/// A plain HTTP/1 client (no TLS), keeping connections alive.
#[must_use]
pub fn http_transport() -> Transport {
    use hyper_util::client::legacy::Client;
    use hyper_util::rt::TokioExecutor;
    let client: Client<_, Body> = Client::builder(TokioExecutor::new()).pool_max_idle_per_host(256).build_http();
    BoxCloneSyncService::new(tower::service_fn(move |req: Request<Body>| {
        let client = client.clone();
        async move {
            let response = client.request(req).await?;
            Ok::<_, BoxError>(response.map(Body::new))
        }
    }))
}

/// Calls `router` directly, without a network: for tests.
#[must_use]
pub fn in_process(router: Router) -> Transport {
    BoxCloneSyncService::new(tower::service_fn(move |req: Request<Body>| {
        let router = router.clone();
        async move { Ok::<_, BoxError>(router.oneshot(req).await.unwrap_or_else(|e: Infallible| match e {})) }
    }))
}

/// Counters of the gateway itself.
#[derive(Debug, Default)]
pub struct GatewayStats {
    /// Answers `429` from the upstream (the mirror's whole point is to keep this at zero).
    pub upstream_refusals: AtomicU64,
    /// Upstream calls that failed (connection errors, unreadable answers).
    pub upstream_errors: AtomicU64,
}

/// The request's body and token count, as read by [`Prepare`].
#[derive(Debug, Clone)]
pub struct Prepared {
    /// The body as received, forwarded as is.
    pub body: Bytes,
    /// Its tokens (also in the request's [`Cost`]).
    pub tokens: u64,
    /// How many inputs it has.
    pub inputs: usize,
}

/// Where the gateway keeps its tenants' limits.
#[derive(Clone, Default)]
pub enum Sharing {
    /// One process: every limit in memory.
    #[default]
    InMemory,
    /// One of `replicas` gateway replicas: the plans' limits (per tier RPM/TPM and
    /// concurrency) live in Redis, shared by every replica. Each replica mirrors
    /// `1 / replicas` of every upstream account (see [`Account::mirror_policy`]).
    Redis {
        /// The connection to Redis.
        connection: RedisConnection,
        /// How many replicas share the upstream accounts.
        replicas: u64,
        /// The prefix of every key, shared by the replicas of one deployment.
        namespace: String,
    },
}

impl fmt::Debug for Sharing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Sharing::InMemory => f.write_str("InMemory"),
            Sharing::Redis { replicas, namespace, .. } => {
                f.debug_struct("Redis").field("replicas", replicas).field("namespace", namespace).finish()
            }
        }
    }
}

impl Sharing {
    fn replicas(&self) -> u64 {
        match self {
            Sharing::InMemory => 1,
            Sharing::Redis { replicas, .. } => (*replicas).max(1),
        }
    }
}

/// The service behind each plan's limits, its backend's type erased.
type PlanService = BoxCloneSyncService<Request<Body>, Response<Body>, Infallible>;

/// A built gateway: its router and what the demo and tests look at.
#[derive(Debug, Clone)]
pub struct Gateway {
    /// `POST /v1/embeddings`.
    pub router: Router,
    /// The upstream accounts' mirrors.
    pub pool: LimitPool<Account>,
    /// Counters.
    pub stats: Arc<GatewayStats>,
}

impl Gateway {
    /// Builds the gateway of `config` with every limit in memory, reaching the upstream
    /// through `transport`.
    ///
    /// # Errors
    /// A plan or pool the library refuses (validation catches these first).
    pub fn new(config: &Config, transport: Transport) -> Result<Self, BoxError> {
        Self::with_sharing(config, transport, &Sharing::InMemory)
    }

    /// Builds one replica of the gateway of `config`, its limits kept as `sharing` says.
    ///
    /// # Errors
    /// A plan or pool the library refuses, or accounts too small to split between the
    /// replicas.
    pub fn with_sharing(config: &Config, transport: Transport, sharing: &Sharing) -> Result<Self, BoxError> {
        let replicas = sharing.replicas();
        let mut pool = LimitPool::builder(config.gateway.selection);
        for account in &config.accounts {
            let mirror = account
                .mirror_policy(&config.mirror, config.gateway.max_request_tokens, replicas)
                .map_err(|e| format!("account {:?}: {e}", account.name))?;
            pool = pool.member(account.name.clone(), LimitSet::new(mirror)?, account.clone());
        }
        let pool = pool.build()?;
        let stats = Arc::new(GatewayStats::default());

        // The shared upstream capacity: requests queue per tenant and take their turns in
        // weighted-fair order; the request whose turn it is waits at the gate until the
        // pool has an account with room (fairness first, then the cap), and goes to
        // that account.
        let mut weights = FairQueueConfig::new()
            .tenant_queue_limit(config.gateway.tenant_queue)
            .global_queue_limit(config.gateway.queue);
        for t in &config.tenants {
            weights = weights.weight(t.name.clone(), t.weight);
        }
        let shared = FairQueueLayer::rate(weights, pool.clone())?
            .key(FromExtension::<FairTenant>::new())
            .cost(CostFromExtension)
            .annotate(InsertChosen)
            .usage(UsageFromExtension)
            .max_queue_time(config.gateway.max_wait)
            .reject_with(HttpAnswer::new().with_json_body());
        let clock = shared.clone();
        let call =
            UpstreamCall { transport, pool: pool.clone(), now: Arc::new(move || clock.now()), stats: stats.clone() };
        let inner = ServiceBuilder::new().layer(shared).service(call);

        let answer = HttpAnswer::new().with_json_body().with_openai_fields().on_success();
        let mut plans: Vec<PlanService> = Vec::new();
        for plan in &config.plans {
            let service = match sharing {
                Sharing::InMemory => BoxCloneSyncService::new(
                    LimitSetLayer::new(plan.policy.clone())?
                        .key(FromExtension::<TenantKey>::new())
                        .cost(CostFromExtension)
                        .usage(UsageFromExtension)
                        .reject_with(answer)
                        .layer(inner.clone()),
                ),
                Sharing::Redis { connection, namespace, .. } => {
                    let backend = RedisBackend::builder(plan.policy.clone())
                        .namespace(format!("{namespace}:plan:{}", plan.name))
                        // Loopback or LAN: generous for a busy machine, still short.
                        .timeout(std::time::Duration::from_millis(250))
                        .build(connection)?;
                    BoxCloneSyncService::new(
                        LimitSetLayer::with_backend(backend)
                            .key(FromExtension::<TenantKey>::new())
                            .cost(CostFromExtension)
                            .usage(UsageFromExtension)
                            .reject_with(answer)
                            .layer(inner.clone()),
                    )
                }
            };
            plans.push(service);
        }

        let stack = ServiceBuilder::new()
            .layer(AuthLayer::new(config))
            .layer(PrepareLayer {
                max_body_bytes: config.gateway.max_body_bytes,
                max_tokens: config.gateway.max_request_tokens,
            })
            .service(PlanLimits { plans: plans.into() });
        let router = Router::new().route("/v1/embeddings", post_service(stack));
        Ok(Gateway { router, pool, stats })
    }
}

/// Reads the body, counts its tokens and puts the [`Cost`] in the request's extensions.
#[derive(Debug, Clone, Copy)]
pub struct PrepareLayer {
    max_body_bytes: usize,
    max_tokens: u64,
}

impl<S> Layer<S> for PrepareLayer {
    type Service = Prepare<S>;

    fn layer(&self, inner: S) -> Prepare<S> {
        Prepare { inner, settings: *self }
    }
}

/// The service of [`PrepareLayer`].
#[derive(Debug, Clone)]
pub struct Prepare<S> {
    inner: S,
    settings: PrepareLayer,
}

impl<S> Service<Request<Body>> for Prepare<S>
where
    S: Service<Request<Body>, Response = Response<Body>, Error = Infallible> + Clone + Send + 'static,
    S::Future: Send + 'static,
{
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<Body>) -> BoxFuture {
        // The service polled ready goes with the request.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let settings = self.settings;
        Box::pin(async move {
            let (mut parts, body) = req.into_parts();
            let bad = |code: &str, message: &str| {
                Ok(api::error_response(StatusCode::BAD_REQUEST, "invalid_request_error", code, message))
            };
            let body = match Limited::new(body, settings.max_body_bytes).collect().await {
                Ok(b) => b.to_bytes(),
                Err(_) => {
                    return Ok(api::error_response(
                        StatusCode::PAYLOAD_TOO_LARGE,
                        "invalid_request_error",
                        "body_too_large",
                        &format!("the body is larger than {} bytes", settings.max_body_bytes),
                    ));
                }
            };
            let request: EmbeddingRequest = match serde_json::from_slice(&body) {
                Ok(r) => r,
                Err(e) => return bad("invalid_json", &format!("expected {{\"model\", \"input\"}}: {e}")),
            };
            let texts = request.input.texts();
            if texts.is_empty() || texts.iter().any(|t| t.is_empty()) {
                return bad("invalid_input", "`input` must be a non-empty string or a non-empty array of them");
            }
            let tokens = tokenizer::count_all(&texts);
            if tokens > settings.max_tokens {
                return Ok(api::error_response(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    "invalid_request_error",
                    "too_many_tokens",
                    &format!("{tokens} tokens; a request may carry at most {}", settings.max_tokens),
                ));
            }
            parts.extensions.insert(Cost(tokens));
            parts.extensions.insert(Prepared { body, tokens, inputs: texts.len() });
            inner.call(Request::from_parts(parts, Body::empty())).await
        })
    }
}

/// Sends each request through the limits of its tenant's plan.
#[derive(Clone)]
pub struct PlanLimits<S = PlanService> {
    plans: Arc<[S]>,
}

impl<S> fmt::Debug for PlanLimits<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PlanLimits").field("plans", &self.plans.len()).finish()
    }
}

impl<S> Service<Request<Body>> for PlanLimits<S>
where
    S: Service<Request<Body>, Response = Response<Body>, Error = Infallible> + Clone + Send + 'static,
    S::Future: Send + 'static,
{
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        // Each call readies its own plan's service (`oneshot`).
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<Body>) -> BoxFuture {
        let plan = req.extensions().get::<Identity>().map_or(0, |id| id.plan);
        let svc = self.plans[plan.min(self.plans.len() - 1)].clone();
        Box::pin(svc.oneshot(req))
    }
}

/// The innermost service: sends the request to the account the pool chose, learns from
/// the answer, and reports the real usage.
#[derive(Clone)]
pub struct UpstreamCall {
    transport: Transport,
    pool: LimitPool<Account>,
    now: Arc<dyn Fn() -> Instant + Send + Sync>,
    stats: Arc<GatewayStats>,
}

impl fmt::Debug for UpstreamCall {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UpstreamCall").field("pool", &self.pool).finish_non_exhaustive()
    }
}

impl Service<Request<Body>> for UpstreamCall {
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<Body>) -> BoxFuture {
        let this = self.clone();
        Box::pin(async move { Ok(this.forward(req).await) })
    }
}

/// The queueing time of an answer, in microseconds: from arrival at the gateway to the
/// call to the upstream.
pub const QUEUE_TIME_HEADER: &str = "x-gateway-queue-us";
/// The upstream account that served an answer.
pub const ACCOUNT_HEADER: &str = "x-gateway-account";

impl UpstreamCall {
    async fn forward(self, req: Request<Body>) -> Response<Body> {
        let internal =
            |what: &str| api::error_response(StatusCode::INTERNAL_SERVER_ERROR, "server_error", "internal", what);
        let Some(chosen) = req.extensions().get::<Chosen<Account>>().cloned() else {
            return internal("no upstream account was chosen");
        };
        let Some(prepared) = req.extensions().get::<Prepared>().cloned() else {
            return internal("the request was not prepared");
        };
        let queued = req.extensions().get::<Arrived>().map(|a| a.0.elapsed());
        let account = &chosen.config;
        let upstream = Request::post(format!("{}/v1/embeddings", account.base_url))
            .header(header::AUTHORIZATION, format!("Bearer {}", account.api_key))
            .header(header::CONTENT_TYPE, "application/json")
            .body(Body::from(prepared.body));
        let Ok(upstream) = upstream else { return internal("the upstream URL is not valid") };
        let bad_gateway = |stats: &GatewayStats, e: &dyn fmt::Display| {
            stats.upstream_errors.fetch_add(1, Ordering::Relaxed);
            api::error_response(StatusCode::BAD_GATEWAY, "upstream_error", "upstream_unreachable", &e.to_string())
        };
        let response = match self.transport.clone().oneshot(upstream).await {
            Ok(r) => r,
            Err(e) => return bad_gateway(&self.stats, &e),
        };
        let (parts, body) = response.into_parts();
        // What the upstream says about the account corrects its mirror (and benches it
        // after a 429).
        let report = upstream_report(parts.status, &parts.headers);
        self.pool.observe(chosen.index, &report, (self.now)());
        let bytes = match body.collect().await {
            Ok(b) => b.to_bytes(),
            Err(e) => return bad_gateway(&self.stats, &e),
        };
        let mut out = if parts.status == StatusCode::TOO_MANY_REQUESTS {
            // Not the tenant's fault: shared overload, retry when the account is back.
            self.stats.upstream_refusals.fetch_add(1, Ordering::Relaxed);
            let mut r = api::error_response(
                StatusCode::SERVICE_UNAVAILABLE,
                "upstream_error",
                "upstream_rate_limited",
                &format!("upstream account {} is rate limited", chosen.name),
            );
            let wait = report.retry_after.unwrap_or_default();
            r.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(tower_limits::http::whole_seconds(wait)));
            r
        } else {
            let mut r = Response::new(Body::from(bytes.clone()));
            *r.status_mut() = parts.status;
            if let Some(ct) = parts.headers.get(header::CONTENT_TYPE) {
                r.headers_mut().insert(header::CONTENT_TYPE, ct.clone());
            }
            if parts.status.is_success() {
                if let Ok(u) = serde_json::from_slice::<UsageOnly>(&bytes) {
                    // Settles the tenant's TPM and the account's mirror to the real count.
                    r.extensions_mut().insert(Usage(u.usage.total_tokens));
                }
            }
            r
        };
        let h = out.headers_mut();
        if let Ok(v) = HeaderValue::from_str(&chosen.name) {
            h.insert(ACCOUNT_HEADER, v);
        }
        if let Some(q) = queued {
            h.insert(QUEUE_TIME_HEADER, HeaderValue::from(q.as_micros() as u64));
        }
        out
    }
}
