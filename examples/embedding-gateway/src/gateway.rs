//! The gateway's router: authentication, costing, the tenant's own limits, the shared
//! upstream capacity, and the call to the chosen upstream account.
//!
//! ```text
//! POST /v1/embeddings, POST /v1/chat/completions (streamed or not)
//!   AuthLayer          Bearer key -> TenantKey + Identity          401
//!   Prepare            body (within body_timeout) -> the inputs    408, 400, 404 (model),
//!                      in any OpenAI form -> Cost(tokens; for a    413
//!                      chat: prompt + max_tokens)
//!   PlanLimits         the tenant's plan: RPM/TPM per tier,        429 (Retry-After,
//!                      concurrency per tenant (LimitSetLayer,          retry-after-ms, the
//!                      in memory or on Redis)                          RateLimit and x-ratelimit
//!                                                                      fields, OpenAI's error)
//!   FairQueueLayer     tenants (orgs) take turns by weight for     429 tenant queue full,
//!                      the LimitPool of upstream accounts; the     503 queue full or
//!                      turn waits at the gate for an account       max_wait passed
//!                      with room; InsertChosen names it
//!   UpstreamCall       POST to the chosen account within           504 upstream_timeout,
//!                      upstream_timeout; Usage(total_tokens)       502 unreachable,
//!                      settles every layer above; the upstream's   503 upstream 429
//!                      x-ratelimit-* feed LimitPool::observe           (Retry-After)
//! GET /v1/models, /healthz, /readyz                               see [`crate::health`]
//! ```
//!
//! Every refusal, whoever answers it, is OpenAI's error object, `{"error": {"message",
//! "type", "param", "code"}}` as `application/json`; those with a sensible wait (a rate, a
//! concurrency limit, a full queue, a store that is down, a benched account) carry
//! `Retry-After` and `retry-after-ms`, as OpenAI's SDKs read them.
//!
//! What a request holds (its tenant's concurrency and tokens, its turn at the upstream
//! accounts) lives as long as the answer's body (`hold_body`): for a streamed chat
//! completion, until its last chunk, or until the client goes away mid-stream. The
//! stream's final `usage` chunk (`stream_options.include_usage`) settles the tokens; a
//! stream without one keeps the estimate, the whole of `max_tokens`. `upstream_timeout`
//! bounds a stream's head, not its length.
//!
//! Each layer adds what it knows to the answer's [`AccessInfo`] (tenant, tokens, time
//! queued, time upstream, account), which the server's access line reports.
//!
//! With Redis, the replicas share the upstream accounts (`RedisAccounts`) and their fair
//! queues share them by the tenants' weights across the fleet: each fair queue reports
//! its backlog through a `FleetShares` handle and weighs its tenants by this replica's
//! share of their demand (the Redis guide's "Fleet-wide weighted fairness"); in memory
//! the fair queue is exactly the single-process one.
//!
//! With Redis, the plans' services sit in a [`PlanSlot`]: a gateway can start before
//! Redis answers ([`Gateway::awaiting_redis`], following `gateway.backend_failure`) and
//! move its limits there when it does ([`Gateway::connect_redis`]).

use std::convert::Infallible;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::routing::post_service;
use http::{HeaderValue, Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Limited};
use tower::util::BoxCloneSyncService;
use tower::{BoxError, Layer, Service, ServiceBuilder, ServiceExt};
use tower_limits::core::fair_queue::FairQueueConfig;
use tower_limits::core::fleet::FleetShares;
use tower_limits::extract::{Cost, CostFromExtension, FromExtension, InsertChosen, Usage, UsageFromExtension};
use tower_limits::http::{HttpAnswer, upstream_report, write_retry_after};
use tower_limits::shell::body::{HeldBody, OpenAiStreamUsage};
use tower_limits::{
    Chosen, FairQueueLayer, Instant, LimitPool, LimitSet, LimitSetLayer, LimitSetPolicy, Rate, TenantKey,
};
use tower_limits_redis::{FailurePolicy, RedisAccounts, RedisBackend, RedisConnection};

use crate::BoxFuture;
use crate::api::{self, EmbeddingRequest, UsageOnly};
use crate::auth::{Arrived, AuthLayer, FairTenant, Identity};
use crate::config::{Account, BackendFailure, Config, TimeoutCharge};
use crate::health::Health;
use crate::logging::Throttle;

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
    /// Upstream calls that failed (connection errors, unreadable answers, 5xx).
    pub upstream_errors: AtomicU64,
    /// Upstream calls that took longer than `gateway.upstream_timeout` (answered `504`).
    pub upstream_timeouts: AtomicU64,
    /// Rate limits the warnings about upstream errors.
    pub error_log: Throttle,
    /// Rate limits the warnings about upstream `429`s.
    pub refusal_log: Throttle,
    /// Rate limits the warnings about upstream timeouts.
    pub timeout_log: Throttle,
}

/// The request's body and token count, as read by [`Prepare`].
#[derive(Debug, Clone)]
pub struct Prepared {
    /// The body as received, forwarded as is.
    pub body: Bytes,
    /// Its tokens (also in the request's [`Cost`]): counted for embeddings, the most it
    /// may use for a chat completion (prompt and `max_tokens`).
    pub tokens: u64,
    /// How many inputs (or messages) it has.
    pub inputs: usize,
    /// The upstream path it goes to ([`EMBEDDINGS_PATH`] or [`CHAT_PATH`]).
    pub path: &'static str,
    /// Whether the answer streams (a chat completion with `stream: true`).
    pub stream: bool,
}

/// `POST /v1/embeddings`.
pub const EMBEDDINGS_PATH: &str = "/v1/embeddings";
/// `POST /v1/chat/completions`.
pub const CHAT_PATH: &str = "/v1/chat/completions";

/// Where the gateway keeps its tenants' limits.
#[derive(Clone, Default)]
pub enum Sharing {
    /// One process: every limit in memory.
    #[default]
    InMemory,
    /// One of several gateway replicas: the plans' limits (per tier RPM/TPM and
    /// concurrency) and the upstream accounts' mirrors live in Redis, shared by every
    /// replica, however many there are. `replicas` only sizes what one replica decides on
    /// its own while Redis is away: `1 / replicas` of every limit and account (see
    /// [`Account::mirror_policy`]).
    Redis {
        /// The connection to Redis.
        connection: RedisConnection,
        /// How many replicas share the limits: what one may use while Redis is away.
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
pub type PlanService = BoxCloneSyncService<Request<Body>, Response<Body>, Infallible>;

/// A built gateway: its router and what the demo and tests look at.
#[derive(Debug, Clone)]
pub struct Gateway {
    /// `POST /v1/embeddings`, `GET /v1/models`, `/healthz`, `/readyz`, `/metrics`; JSON
    /// errors for the rest.
    pub router: Router,
    /// The upstream accounts' mirrors.
    pub pool: LimitPool<Account>,
    /// Counters.
    pub stats: Arc<GatewayStats>,
    /// Liveness, readiness and the limits backend's state.
    pub health: Arc<Health>,
    /// Builds the plans' Redis-backed services once a connection exists (see
    /// [`Gateway::connect_redis`]).
    redis_plans: Option<Arc<RedisPlans>>,
}

/// What it takes to build the plans' services on Redis later.
struct RedisPlans {
    plans: Vec<(String, LimitSetPolicy)>,
    /// Every account's whole mirror, in the pool's order: shared through Redis.
    accounts: Vec<(String, LimitSetPolicy)>,
    namespace: String,
    failure: FailurePolicy,
    inner: PlanService,
    slot: PlanSlot,
    /// The shared accounts, once Redis answered.
    store: Mutex<Option<RedisAccounts>>,
    /// What the fair queue and the shared accounts tell each other (fleet-wide shares).
    fleet: Arc<FleetShares>,
}

impl fmt::Debug for RedisPlans {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisPlans").field("namespace", &self.namespace).finish_non_exhaustive()
    }
}

/// The plans' services, replaceable while the gateway serves (when Redis answers for the
/// first time).
pub type PlanSlot = Arc<RwLock<Arc<[PlanService]>>>;

/// Every plan's limits: a `LimitSetLayer` (in memory or on Redis) keyed by the tenant's
/// tiers, costed by its tokens, settled by the upstream's usage, over `inner`.
///
/// What a request holds (its concurrency, its tokens' estimate) lives as long as the
/// answer's body: to the end of a stream, settled from its final `usage` chunk
/// ([`OpenAiStreamUsage`]), else from the answer's [`Usage`], else the estimate stands.
macro_rules! plan_layer {
    ($layer:expr, $inner:expr) => {
        plan_layer!($layer, $inner, HttpAnswer::new().with_openai_body().with_openai_fields().on_success())
    };
    ($layer:expr, $inner:expr, $answer:expr) => {
        BoxCloneSyncService::new(
            ServiceBuilder::new()
                .map_response(unheld)
                .layer(
                    $layer
                        .key(FromExtension::<TenantKey>::new())
                        .cost(CostFromExtension)
                        .usage(UsageFromExtension)
                        .reject_with($answer)
                        .hold_body()
                        .usage_from_body(OpenAiStreamUsage::default()),
                )
                .service($inner),
        )
    };
}

/// A held body as the router's body (it keeps holding).
fn unheld(response: Response<HeldBody<Body, OpenAiStreamUsage>>) -> Response<Body> {
    response.map(Body::new)
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
        let gateway = Self::build(config, transport, sharing.replicas(), !matches!(sharing, Sharing::InMemory))?;
        if let Sharing::Redis { connection, namespace, .. } = sharing {
            gateway.connect_redis_in(connection, Some(namespace))?;
        }
        Ok(gateway)
    }

    /// Builds one of `replicas` replicas sharing the tenants' limits through Redis, before
    /// Redis could be reached: until [`Gateway::connect_redis`], the tenants' limits follow
    /// `gateway.backend_failure` (refuse with `503`, admit, or decide in this replica with
    /// `1 / replicas` of every limit).
    ///
    /// # Errors
    /// As [`Gateway::with_sharing`].
    pub fn awaiting_redis(config: &Config, transport: Transport, replicas: u64) -> Result<Self, BoxError> {
        Self::build(config, transport, replicas.max(1), true)
    }

    fn build(config: &Config, transport: Transport, replicas: u64, redis: bool) -> Result<Self, BoxError> {
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
        // A fleet's replicas share the accounts by the tenants' weights across the fleet:
        // the fair queue reports its backlog to the shared accounts and weighs its
        // tenants by this replica's share of their demand (in memory: as configured).
        let fleet = Arc::new(FleetShares::new());
        let mut shared = FairQueueLayer::rate(weights, pool.clone())?;
        if redis {
            shared = shared.fleet(fleet.clone());
        }
        let shared = shared
            .metrics_name("upstream")
            .metrics_tenants(config.tenants.iter().map(|t| t.name.clone()))?
            .key(FromExtension::<FairTenant>::new())
            .cost(CostFromExtension)
            .annotate(InsertChosen)
            .usage(UsageFromExtension)
            .max_queue_time(config.gateway.max_wait)
            .reject_with(HttpAnswer::new().with_openai_body())
            // The turn and the account's tokens last as long as the answer's body.
            .hold_body()
            .usage_from_body(OpenAiStreamUsage::default());
        let clock = shared.clone();
        let now: Arc<dyn Fn() -> Instant + Send + Sync> = Arc::new(move || clock.now());
        let call = UpstreamCall {
            transport,
            timeout: config.gateway.upstream_timeout,
            on_timeout: config.gateway.on_upstream_timeout,
            pool: pool.clone(),
            now: now.clone(),
            stats: stats.clone(),
        };
        let inner: PlanService =
            BoxCloneSyncService::new(ServiceBuilder::new().map_response(unheld).layer(shared).service(call));

        let failure = config.gateway.backend_failure;
        let mut plans: Vec<PlanService> = Vec::new();
        for plan in &config.plans {
            let service = match (redis, failure) {
                (false, _) => plan_layer!(LimitSetLayer::new(plan.policy.clone())?.metrics_name("plan"), inner.clone()),
                // Until Redis answers: the failure policy.
                (true, BackendFailure::FailClosed) => BoxCloneSyncService::new(tower::service_fn(|_req| async {
                    let mut r = api::error_response(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "server_error",
                        "limits_unavailable",
                        "The rate limits cannot be checked right now (their store does not answer). \
                         Please try again in 1.000s.",
                    );
                    // As the layers' own answer while the store is down: the suggested wait.
                    write_retry_after(r.headers_mut(), BACKEND_DOWN_WAIT);
                    Ok::<_, Infallible>(r)
                })),
                (true, BackendFailure::FailOpen) => inner.clone(),
                (true, BackendFailure::Fallback) => plan_layer!(
                    LimitSetLayer::new(share_of(&plan.policy, replicas))?,
                    inner.clone(),
                    // This replica's share is not the tenant's plan: no field states it.
                    HttpAnswer::new().with_openai_body().without_limit_fields()
                ),
            };
            plans.push(service);
        }
        let slot: PlanSlot = Arc::new(RwLock::new(plans.into()));
        let health = Arc::new(Health::new(pool.clone(), now, failure, redis));
        let accounts = if redis {
            let mut whole = Vec::new();
            for account in &config.accounts {
                let mirror = account
                    .mirror_policy(&config.mirror, config.gateway.max_request_tokens, 1)
                    .map_err(|e| format!("account {:?}: {e}", account.name))?;
                whole.push((account.name.clone(), mirror));
            }
            whole
        } else {
            Vec::new()
        };
        let redis_plans = redis.then(|| {
            Arc::new(RedisPlans {
                plans: config.plans.iter().map(|p| (p.name.clone(), p.policy.clone())).collect(),
                accounts,
                namespace: "egw".to_owned(),
                failure: match failure {
                    BackendFailure::FailClosed => FailurePolicy::FailClosed,
                    BackendFailure::FailOpen => FailurePolicy::FailOpen,
                    BackendFailure::Fallback => FailurePolicy::Fallback { share: 1.0 / replicas as f64 },
                },
                inner: inner.clone(),
                slot: slot.clone(),
                store: Mutex::new(None),
                fleet,
            })
        });

        let stack = ServiceBuilder::new()
            .layer(AuthLayer::new(config))
            .layer(PrepareLayer {
                max_body_bytes: config.gateway.max_body_bytes,
                max_tokens: config.gateway.max_request_tokens,
                body_timeout: config.gateway.body_timeout,
                models: config.gateway.models.iter().cloned().collect(),
            })
            .service(PlanLimits { plans: slot });
        let router = crate::health::routes(
            Router::new().route(EMBEDDINGS_PATH, post_service(stack.clone())).route(CHAT_PATH, post_service(stack)),
            &health,
            &config.gateway.models,
        );
        Ok(Gateway { router, pool, stats, health, redis_plans })
    }

    /// The shared upstream accounts, once this replica reached Redis (`None` in memory).
    #[must_use]
    pub fn accounts(&self) -> Option<RedisAccounts> {
        self.redis_plans.as_ref()?.store.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// Moves the tenants' limits to Redis on `connection` (a gateway built with
    /// [`Gateway::with_sharing`] on Redis, or [`Gateway::awaiting_redis`]); requests
    /// already admitted keep what they hold until they end. Does nothing for a gateway in
    /// memory.
    ///
    /// # Errors
    /// A plan the Redis backend refuses.
    pub fn connect_redis(&self, connection: &RedisConnection) -> Result<(), BoxError> {
        self.connect_redis_in(connection, None)
    }

    /// As [`Gateway::connect_redis`], with the prefix of every key (`egw` by default):
    /// replicas of one deployment share it.
    ///
    /// # Errors
    /// As [`Gateway::connect_redis`].
    pub fn connect_redis_in(&self, connection: &RedisConnection, namespace: Option<&str>) -> Result<(), BoxError> {
        let Some(r) = &self.redis_plans else { return Ok(()) };
        let namespace = namespace.unwrap_or(&r.namespace);
        let mut services = Vec::new();
        let mut backends = Vec::new();
        for (name, policy) in &r.plans {
            let backend = RedisBackend::builder(policy.clone())
                .namespace(format!("{namespace}:plan:{name}"))
                // Loopback or LAN: generous for a busy machine, still short.
                .timeout(Duration::from_millis(250))
                .on_failure(r.failure)
                .build(connection)?;
            backends.push(backend.clone());
            services.push(plan_layer!(LimitSetLayer::with_backend(backend).metrics_name("plan"), r.inner.clone()));
        }
        // The upstream accounts: one mirror per account in Redis, charged by every replica;
        // the pool's local mirrors (this replica's 1/N) decide only while Redis is away
        // (or refuse, failing closed; an account never fails open).
        let mut store = RedisAccounts::builder("accounts")
            .namespace(format!("{namespace}:pool"))
            .fleet(r.fleet.clone())
            .timeout(Duration::from_millis(250))
            .on_failure(match r.failure {
                FailurePolicy::FailClosed => FailurePolicy::FailClosed,
                _ => FailurePolicy::Fallback { share: 1.0 },
            });
        for (name, policy) in &r.accounts {
            store = store.member(name.clone(), policy.clone());
        }
        let store = store.build(connection)?;
        if self.pool.share_through(Arc::new(store.clone())) {
            *r.store.lock().unwrap_or_else(PoisonError::into_inner) = Some(store);
        }
        *r.slot.write().unwrap_or_else(PoisonError::into_inner) = services.into();
        self.health.set_redis(backends);
        Ok(())
    }
}

/// `share` of every limit of `policy` (`1 / replicas`, at least 1 of each): what one
/// replica may use on its own while the shared store is away.
fn share_of(policy: &LimitSetPolicy, replicas: u64) -> LimitSetPolicy {
    let mut policy = policy.clone();
    if replicas <= 1 {
        return policy;
    }
    let part = |n: u64| (n / replicas).max(1);
    for l in &mut policy.limits {
        if let Some(rate) = l.rate {
            l.rate = Some(Rate::new(rate.amount(), rate.period().saturating_mul(replicas as u32)));
        }
        l.burst = l.burst.map(part);
        l.limit = l.limit.map(part);
        l.capacity = l.capacity.map(part);
    }
    policy
}

/// Reads the body (within `body_timeout`, `408` after it), checks it, counts its tokens
/// and puts the [`Cost`] in the request's extensions.
#[derive(Debug, Clone)]
pub struct PrepareLayer {
    max_body_bytes: usize,
    max_tokens: u64,
    body_timeout: Duration,
    models: Arc<[String]>,
}

impl<S> Layer<S> for PrepareLayer {
    type Service = Prepare<S>;

    fn layer(&self, inner: S) -> Prepare<S> {
        Prepare { inner, settings: self.clone() }
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
        let settings = self.settings.clone();
        Box::pin(async move {
            let (mut parts, body) = req.into_parts();
            let read =
                tokio::time::timeout(settings.body_timeout, Limited::new(body, settings.max_body_bytes).collect());
            let body = match read.await {
                Ok(Ok(b)) => b.to_bytes(),
                Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => {
                    return Ok(api::error_response(
                        StatusCode::PAYLOAD_TOO_LARGE,
                        "invalid_request_error",
                        "body_too_large",
                        &format!("the body is larger than {} bytes", settings.max_body_bytes),
                    ));
                }
                Ok(Err(_)) => {
                    let mut r = api::error_response(
                        StatusCode::BAD_REQUEST,
                        "invalid_request_error",
                        "body_incomplete",
                        "the connection failed before the whole body arrived",
                    );
                    r.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("close"));
                    return Ok(r);
                }
                Err(_) => {
                    let mut r = api::error_response(
                        StatusCode::REQUEST_TIMEOUT,
                        "invalid_request_error",
                        "body_timeout",
                        &format!(
                            "the body did not arrive within {} (gateway.body_timeout)",
                            tower_limits::core::policy::format_duration(settings.body_timeout)
                        ),
                    );
                    // The rest of the body may still come: the connection cannot be reused.
                    r.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("close"));
                    return Ok(r);
                }
            };
            let is_chat = parts.uri.path() == CHAT_PATH;
            let (model, tokens, inputs, stream, param) = if is_chat {
                match api::ChatRequest::parse(&body) {
                    Ok(r) => (r.model.clone(), r.estimate(settings.max_tokens), r.messages.len(), r.stream, "messages"),
                    Err(e) => return Ok(e.response()),
                }
            } else {
                match EmbeddingRequest::parse(&body) {
                    Ok(r) => (r.model.clone(), r.tokens(), r.inputs.len(), false, "input"),
                    Err(e) => return Ok(e.response()),
                }
            };
            if !settings.models.contains(&model) {
                return Ok(api::error_with_param(
                    StatusCode::NOT_FOUND,
                    "invalid_request_error",
                    "model_not_found",
                    Some("model"),
                    &format!(
                        "the model {model:?} does not exist here; this gateway serves {}",
                        settings.models.join(", ")
                    ),
                ));
            }
            if tokens > settings.max_tokens {
                let mut r = api::error_with_param(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    "invalid_request_error",
                    "too_many_tokens",
                    Some(param),
                    &format!("{tokens} tokens; a request may carry at most {}", settings.max_tokens),
                );
                r.extensions_mut().insert(AccessInfo { tokens: Some(tokens), ..AccessInfo::default() });
                return Ok(r);
            }
            parts.extensions.insert(Cost(tokens));
            let path = if is_chat { CHAT_PATH } else { EMBEDDINGS_PATH };
            parts.extensions.insert(Prepared { body, tokens, inputs, path, stream });
            let mut response = inner.call(Request::from_parts(parts, Body::empty())).await?;
            // The upstream's count when it gave one, the estimate otherwise.
            response.extensions_mut().get_or_insert_default::<AccessInfo>().tokens.get_or_insert(tokens);
            Ok(response)
        })
    }
}

/// What the access log line of a request reports beyond its status: filled in on the
/// way out by the layers that know it.
#[derive(Debug, Clone, Default)]
pub struct AccessInfo {
    /// The tenant, once authenticated.
    pub tenant: Option<Arc<str>>,
    /// The request's tokens: the upstream's count when it answered, the estimate otherwise.
    pub tokens: Option<u64>,
    /// From arrival to the upstream call.
    pub queued: Option<Duration>,
    /// The upstream call.
    pub upstream: Option<Duration>,
    /// The upstream account.
    pub account: Option<Arc<str>>,
}

/// Sends each request through the limits of its tenant's plan.
#[derive(Clone)]
pub struct PlanLimits {
    plans: PlanSlot,
}

impl fmt::Debug for PlanLimits {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PlanLimits").finish_non_exhaustive()
    }
}

impl Service<Request<Body>> for PlanLimits {
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        // Each call readies its own plan's service (`oneshot`).
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<Body>) -> BoxFuture {
        let plan = req.extensions().get::<Identity>().map_or(0, |id| id.plan);
        let svc = {
            let plans = self.plans.read().unwrap_or_else(PoisonError::into_inner);
            plans[plan.min(plans.len() - 1)].clone()
        };
        Box::pin(svc.oneshot(req))
    }
}

/// The innermost service: sends the request to the account the pool chose, learns from
/// the answer, and reports the real usage.
#[derive(Clone)]
pub struct UpstreamCall {
    transport: Transport,
    timeout: Duration,
    on_timeout: TimeoutCharge,
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

/// An upstream answer: read whole, or a stream passed on as it comes.
enum Answer {
    Whole(Bytes),
    Stream(Body),
}

/// The wait suggested when nobody knows how long: the limits' store is down, an upstream
/// account is benched without saying for how long (the layers suggest the same).
pub const BACKEND_DOWN_WAIT: Duration = Duration::from_secs(1);

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
        let tenant = req.extensions().get::<Identity>().map(|i| i.tenant.clone());
        let queued = req.extensions().get::<Arrived>().map(|a| a.0.elapsed());
        let account = &chosen.config;
        let upstream = Request::post(format!("{}{}", account.base_url, prepared.path))
            .header(header::AUTHORIZATION, format!("Bearer {}", account.api_key))
            .header(header::CONTENT_TYPE, "application/json")
            .body(Body::from(prepared.body));
        let Ok(upstream) = upstream else { return internal("the upstream URL is not valid") };
        let started = tokio::time::Instant::now();
        let call = async {
            let response = self.transport.clone().oneshot(upstream).await?;
            let (parts, body) = response.into_parts();
            if prepared.stream && parts.status.is_success() {
                // The stream goes on to the client as it comes: the layers above hold
                // their permits in it and settle them from its final usage chunk.
                return Ok::<_, BoxError>((parts, Answer::Stream(body)));
            }
            let bytes = body.collect().await?.to_bytes();
            Ok((parts, Answer::Whole(bytes)))
        };
        let result = tokio::time::timeout(self.timeout, call).await;
        let took = started.elapsed();
        let info = AccessInfo {
            tenant,
            tokens: Some(prepared.tokens),
            queued,
            upstream: Some(took),
            account: Some(Arc::from(&*chosen.name)),
        };
        let mut out = match result {
            Err(_) => {
                // The upstream hung: not the account's fault as far as anyone knows (no
                // answer, no bench), and not the tenant's either.
                let n = self.stats.upstream_timeouts.fetch_add(1, Ordering::Relaxed) + 1;
                if let Some(suppressed) = self.stats.timeout_log.ready() {
                    tracing::warn!(
                        account = %chosen.name,
                        timeout_ms = self.timeout.as_millis() as u64,
                        total = n,
                        suppressed,
                        "upstream call timed out: answered 504"
                    );
                }
                let mut r = api::error_response(
                    StatusCode::GATEWAY_TIMEOUT,
                    "upstream_error",
                    "upstream_timeout",
                    &format!(
                        "the upstream did not answer within {} (gateway.upstream_timeout); try again",
                        tower_limits::core::policy::format_duration(self.timeout)
                    ),
                );
                if self.on_timeout == TimeoutCharge::Refund {
                    r.extensions_mut().insert(Usage(0));
                }
                r
            }
            Ok(Err(e)) => {
                let n = self.stats.upstream_errors.fetch_add(1, Ordering::Relaxed) + 1;
                if let Some(suppressed) = self.stats.error_log.ready() {
                    tracing::warn!(account = %chosen.name, error = %e, total = n, suppressed, "upstream call failed: answered 502");
                }
                api::error_response(
                    StatusCode::BAD_GATEWAY,
                    "upstream_error",
                    "upstream_unreachable",
                    &format!("the upstream account {} could not be reached: {e}", chosen.name),
                )
            }
            Ok(Ok((parts, Answer::Whole(bytes)))) => self.answer(&chosen, parts, bytes),
            Ok(Ok((parts, Answer::Stream(body)))) => {
                let report = upstream_report(parts.status, &parts.headers);
                self.pool.observe(chosen.index, &report, (self.now)());
                let mut r = Response::new(body);
                *r.status_mut() = parts.status;
                for name in [header::CONTENT_TYPE, header::CACHE_CONTROL] {
                    if let Some(v) = parts.headers.get(&name) {
                        r.headers_mut().insert(name, v.clone());
                    }
                }
                r
            }
        };
        let h = out.headers_mut();
        if let Ok(v) = HeaderValue::from_str(&chosen.name) {
            h.insert(ACCOUNT_HEADER, v);
        }
        if let Some(q) = queued {
            h.insert(QUEUE_TIME_HEADER, HeaderValue::from(q.as_micros() as u64));
        }
        let usage = out.extensions().get::<Usage>().map(|u| u.0);
        out.extensions_mut().insert(AccessInfo { tokens: usage.or(info.tokens), ..info });
        out
    }

    /// The answer to the client for an upstream answer.
    fn answer(&self, chosen: &Chosen<Account>, parts: http::response::Parts, bytes: Bytes) -> Response<Body> {
        // What the upstream says about the account corrects its mirror (and benches it
        // after a 429).
        let report = upstream_report(parts.status, &parts.headers);
        self.pool.observe(chosen.index, &report, (self.now)());
        if parts.status == StatusCode::TOO_MANY_REQUESTS {
            // Not the tenant's fault: shared overload, retry when the account is back.
            let n = self.stats.upstream_refusals.fetch_add(1, Ordering::Relaxed) + 1;
            if let Some(suppressed) = self.stats.refusal_log.ready() {
                tracing::warn!(account = %chosen.name, total = n, suppressed, "upstream answered 429: account benched, answered 503");
            }
            let wait = report.retry_after.filter(|w| !w.is_zero()).unwrap_or(BACKEND_DOWN_WAIT);
            let mut r = api::error_response(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                "upstream_rate_limited",
                &format!(
                    "The upstream account {} is rate limited. Please try again in {:.3}s.",
                    chosen.name,
                    wait.as_secs_f64()
                ),
            );
            write_retry_after(r.headers_mut(), wait);
            return r;
        }
        if parts.status.is_server_error() {
            let n = self.stats.upstream_errors.fetch_add(1, Ordering::Relaxed) + 1;
            if let Some(suppressed) = self.stats.error_log.ready() {
                tracing::warn!(account = %chosen.name, status = parts.status.as_u16(), total = n, suppressed, "upstream answered an error");
            }
        }
        if !parts.status.is_success() && !api::is_openai_error(&bytes) {
            // Whatever the upstream said, the client gets OpenAI's shape.
            return api::error_response(
                parts.status,
                if parts.status.is_server_error() { "server_error" } else { "invalid_request_error" },
                "upstream_error",
                &format!("The upstream account {} answered {}.", chosen.name, parts.status),
            );
        }
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
    }
}
