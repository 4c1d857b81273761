//! The gateway's router: authentication, costing, the tenant's own limits, the shared
//! upstream capacity, and the call to the chosen upstream account.
//!
//! ```text
//! POST /v1/embeddings, POST /v1/chat/completions (streamed or not)
//!   AuthLayer          Bearer key -> TenantKey + Identity          401
//!   Prepare            a place among the tenant's uploads; the     429 uploads_per_tenant,
//!                      body at its pace, within body_timeout ->    408, 413 (bytes), 400,
//!                      the inputs in any OpenAI form, counted      404 (model), 400
//!                      with the model's encoding ->                context_length_exceeded
//!                      Cost(tokens; for a chat: prompt +
//!                      max_tokens or default_max_tokens)
//!   BudgetLayer        the key's budgets in money per calendar     429 insufficient_quota
//!                      period (plan.NAME.TIER.budget): the price       budget_exceeded
//!                      estimated from the tokens, settled to the       (Retry-After: the
//!                      usage (streams: their final usage chunk)        renewal)
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
//! share of their demand (the Redis guide's "Fleet-wide weighted fairness"), and the
//! shared accounts order its priority bands for the fleet; in memory the fair queue is
//! exactly the single-process one. The accounts' limits learned from the upstream
//! replace the fleet's mirrors (`learning`).
//!
//! With Redis, the plans' services sit in a [`PlanSlot`]: a gateway can start before
//! Redis answers ([`Gateway::awaiting_redis`], following `gateway.backend_failure`) and
//! move its limits there when it does ([`Gateway::connect_redis`]).
//!
//! [`AccessInfo`]: crate::access::AccessInfo

use std::convert::Infallible;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::routing::post_service;
use http::{HeaderName, HeaderValue, Request, Response, StatusCode, header};
use http_body_util::BodyExt;
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
use tower_limits_redis::{
    AccountLeases, FailurePolicy, RedisAccounts, RedisBackend, RedisConnection, ShareGroup, Shares,
};

use crate::BoxFuture;
use crate::api::{self, EmbeddingRequest};
use crate::auth::{Arrived, AuthLayer, FairTenant, Identity, QueueBand};
use crate::config::{Account, BackendFailure, Config, TimeoutCharge};
use crate::health::Health;
use crate::logging::Throttle;

// The pipeline's own stages, in a module of their own.
mod budget;
mod learning;
mod stages;
pub mod upload;
pub use budget::{BudgetLayer, BudgetService};
use stages::AccountRoute;
pub use stages::{
    ACCOUNT_HEADER, BACKEND_DOWN_WAIT, PlanLimits, Prepare, PrepareLayer, QUEUE_TIME_HEADER, UpstreamCall,
};

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
    /// The tokens of its input (the prompt; for embeddings, all of `tokens`): what a
    /// price counts at the input rate, the rest at the output rate.
    pub prompt: u64,
    /// The model asked for.
    pub model: Arc<str>,
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

/// How far ahead the shared accounts reserve the next request of the replica first in
/// the fleet's order (`RedisAccountsBuilder::reserve_ahead`): a wait at the gate is
/// tens of milliseconds when the accounts are saturated.
const RESERVE_AHEAD: Duration = Duration::from_millis(100);

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
    /// The keys, replaceable while the gateway serves ([`Gateway::reload_keys`]).
    auth: AuthLayer,
    /// Builds the plans' Redis-backed services once a connection exists (see
    /// [`Gateway::connect_redis`]).
    redis_plans: Option<Arc<RedisPlans>>,
    /// The accounts' limits learned from the upstream (in memory).
    learning: Option<Arc<learning::Learning>>,
    /// The plans' budgets in money (`None`: no plan has one).
    budgets: Option<BudgetLayer>,
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
    /// `gateway.retry_spread_percent`.
    spread: u16,
    /// How far apart a plan's concurrency refusals place their clients: the accounts' pace.
    spacing: Duration,
    /// What sizes this replica's part of every account (see [`Gateway::resize_fleet`]).
    account_list: Vec<Account>,
    mirror: crate::config::MirrorSettings,
    max_request_tokens: u64,
    /// The plans' backends, once Redis answered.
    backends: Mutex<Vec<RedisBackend>>,
    /// `gateway.redis_timeout`.
    redis_timeout: Duration,
    /// `gateway.account_lease_refresh` (zero: the accounts per request).
    lease_refresh: Duration,
    /// `gateway.plan_share_refresh` (zero: the plans per request).
    share_refresh: Duration,
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
    ($layer:expr, $inner:expr, spread: $spread:expr) => {
        plan_layer!(
            $layer,
            $inner,
            HttpAnswer::new().with_openai_body().with_openai_fields().on_success().spread_retries($spread)
        )
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
                        .refuse_with($answer)
                        .hold_body()
                        .usage_from_body(OpenAiStreamUsage::default()),
                )
                .service($inner),
        )
    };
}

/// The service polled ready, to go with the request, leaving a clone in its place (which
/// is polled ready before the next call).
fn take_ready<S: Clone>(inner: &mut S) -> S {
    let clone = inner.clone();
    std::mem::replace(inner, clone)
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
        // Every encoding's tables, before the first request needs them (whichever way the
        // replica is built).
        config.gateway.encodings.load();
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
        for band in &config.gateway.bands {
            weights = weights.band(band.name.clone(), band.min_share_percent);
        }
        // A fleet's replicas share the accounts by the tenants' weights across the fleet:
        // the fair queue reports its backlog to the shared accounts and weighs its
        // tenants by this replica's share of their demand (in memory: as configured).
        let fleet = Arc::new(FleetShares::new());
        let spread = config.gateway.retry_spread_percent;
        // A tenant's requests hold their concurrency while they queue for an account: when
        // the accounts bind, refused clients are placed no faster than the accounts take
        // requests.
        let spacing = config.upstream_spacing(replicas);
        let mut shared = FairQueueLayer::rate(weights, pool.clone())?;
        if redis {
            shared = shared.fleet(fleet.clone());
        }
        let shared = shared
            .metrics_name("upstream")
            .metrics_tenants(config.tenants.iter().map(|t| t.name.clone()))?
            .key(FromExtension::<FairTenant>::new())
            .band(|req: &Request<Body>| req.extensions().get::<QueueBand>().map(|b| b.0))
            .cost(CostFromExtension)
            .annotate(InsertChosen)
            .usage(UsageFromExtension)
            .max_queue_time(config.gateway.max_wait)
            .refuse_with(HttpAnswer::new().with_openai_body().spread_retries(spread))
            // The turn and the account's tokens last as long as the answer's body.
            .hold_body()
            .usage_from_body(OpenAiStreamUsage::default());
        let clock = shared.clone();
        let now: Arc<dyn Fn() -> Instant + Send + Sync> = Arc::new(move || clock.now());
        // With Redis, learned quotas replace the shared mirrors (leased or not).
        let learning = learning::Learning::new(config, replicas).map(Arc::new);
        let call = UpstreamCall {
            transport,
            timeout: config.gateway.upstream_timeout,
            on_timeout: config.gateway.on_upstream_timeout,
            pool: pool.clone(),
            now: now.clone(),
            stats: stats.clone(),
            // The pool's members are the accounts, in order.
            routes: config.accounts.iter().map(AccountRoute::new).collect::<Result<_, _>>()?,
            learning: learning.clone(),
        };
        let inner: PlanService =
            BoxCloneSyncService::new(ServiceBuilder::new().map_response(unheld).layer(shared).service(call));

        let failure = config.gateway.backend_failure;
        let mut plans: Vec<PlanService> = Vec::new();
        for plan in &config.plans {
            let service = match (redis, failure) {
                // A plan of budgets alone: nothing more to check here.
                _ if plan.policy.limits.is_empty() => inner.clone(),
                (false, _) => plan_layer!(
                    LimitSetLayer::new(plan.policy.clone())?.metrics_name("plan").retry_spacing(spacing),
                    inner.clone(),
                    spread: spread
                ),
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
                    LimitSetLayer::new(share_of(&plan.policy, replicas))?.retry_spacing(spacing),
                    inner.clone(),
                    // This replica's share is not the tenant's plan: no field states it.
                    HttpAnswer::new().with_openai_body().without_limit_fields().spread_retries(spread)
                ),
            };
            plans.push(service);
        }
        let slot: PlanSlot = Arc::new(RwLock::new(plans.into()));
        let health = Arc::new(Health::new(pool.clone(), now.clone(), failure, redis));
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
                spread,
                spacing,
                account_list: config.accounts.clone(),
                mirror: config.mirror,
                max_request_tokens: config.gateway.max_request_tokens,
                backends: Mutex::new(Vec::new()),
                redis_timeout: config.gateway.redis_timeout,
                lease_refresh: config.gateway.account_lease_refresh,
                share_refresh: config.gateway.plan_share_refresh,
            })
        });

        // With Redis: each replica's share until it reaches Redis.
        let budgets = match &config.budgets {
            Some(b) => Some(BudgetLayer::share_of(b, if redis { replicas } else { 1 }, now.clone())?),
            None => None,
        };
        let auth = AuthLayer::new(config);
        let stack = ServiceBuilder::new()
            .layer(auth.clone())
            .layer(PrepareLayer {
                uploads: upload::UploadRules::new(
                    config.gateway.uploads_per_tenant,
                    config.gateway.max_body_bytes,
                    config.gateway.body_timeout,
                    config.gateway.body_min_rate,
                    config.gateway.body_grace,
                )?,
                max_tokens: config.gateway.max_request_tokens,
                embedding_models: config.gateway.embedding_models.iter().cloned().collect(),
                chat_models: config.gateway.chat_models.iter().cloned().collect(),
                encodings: config.gateway.encodings.clone(),
                default_max_tokens: config.gateway.default_max_tokens,
            })
            .option_layer(budgets.clone())
            .service(PlanLimits { plans: slot });
        let router = crate::metrics::count_responses(crate::health::routes(
            Router::new().route(EMBEDDINGS_PATH, post_service(stack.clone())).route(CHAT_PATH, post_service(stack)),
            &health,
            &config.gateway.models(),
            auth.clone(),
        ));
        Ok(Gateway { router, pool, stats, health, auth, redis_plans, learning, budgets })
    }

    /// Sizes what this replica decides alone while Redis is away for a fleet of `replicas`
    /// (at least 1): `1 / replicas` of every plan's limits and of every upstream account,
    /// as `--replicas` does at start. For a fleet that grew or shrank while it runs (the
    /// roster, [`crate::roster`]). Accounts keep the state of their limits. Nothing to do
    /// in memory; the plans are resized once Redis answered (before, they follow the size
    /// given at start).
    ///
    /// # Errors
    /// An account too small to split in `replicas`.
    pub fn resize_fleet(&self, replicas: u64) -> Result<(), BoxError> {
        let Some(r) = &self.redis_plans else { return Ok(()) };
        let replicas = replicas.max(1);
        let learned = self.learned_limits();
        if let Some(learning) = &self.learning {
            learning.set_replicas(replicas);
        }
        for (i, account) in r.account_list.iter().enumerate() {
            let (requests, tokens) =
                learned.get(i).copied().unwrap_or((account.requests_per_window(), account.tokens_per_window()));
            let mirror = account
                .mirror_policy_for(requests, tokens, &r.mirror, r.max_request_tokens, replicas)
                .map_err(|e| format!("account {:?}: {e}", account.name))?;
            if let Some(set) = self.pool.member_set(i) {
                set.replace_policy(mirror)?;
            }
        }
        for backend in r.backends.lock().unwrap_or_else(PoisonError::into_inner).iter() {
            backend.set_fallback_share(1.0 / replicas as f64)?;
        }
        Ok(())
    }

    /// Replaces the API keys with those of `config` (read again), for every route at once;
    /// `running` is the configuration the gateway was built from. See
    /// [`AuthLayer::reload`]: only keys may change. How many keys there are now.
    ///
    /// # Errors
    /// `config` changes the tenants, their plans or weights, or the tiers.
    pub fn reload_keys(&self, running: &Config, config: &Config) -> Result<usize, crate::auth::ReloadRefused> {
        self.auth.reload(running, config)
    }

    /// Each account's quotas per window as this replica learned them from the upstream's
    /// answers (requests, tokens), in the pool's order; empty with learning off
    /// (`mirror.learn_ceiling_percent = 0`).
    #[must_use]
    pub fn learned_limits(&self) -> Vec<(u64, u64)> {
        self.learning.as_ref().map_or_else(Vec::new, |l| l.learned())
    }

    /// What the budget `limit` (`TIER.budget`) of `key` on plan `plan` has left, in
    /// micro-units of the currency, and the time until it renews; `None` for a budget the
    /// plan does not have.
    #[must_use]
    pub fn budget_remaining(&self, plan: usize, key: &TenantKey, limit: &str) -> Option<(u64, Duration)> {
        self.budgets.as_ref()?.remaining(plan, key, limit)
    }

    /// The shared upstream accounts, once this replica reached Redis (`None` in memory).
    #[must_use]
    pub fn accounts(&self) -> Option<RedisAccounts> {
        self.redis_plans.as_ref()?.store.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// The plans' limits shared in Redis, one backend per plan, once this replica reached
    /// Redis (empty in memory): their [`stats`](RedisBackend::stats) say how many
    /// acquisitions took a round trip and how many were decided from shares.
    #[must_use]
    pub fn plan_backends(&self) -> Vec<RedisBackend> {
        self.redis_plans
            .as_ref()
            .map_or_else(Vec::new, |r| r.backends.lock().unwrap_or_else(PoisonError::into_inner).clone())
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
        // The plans' and the budgets' shares, refreshed in one call a period.
        let shares = (!r.share_refresh.is_zero()).then(|| {
            ShareGroup::new(
                Shares::new().refresh_every(r.share_refresh).lifetime(lifetime(r.share_refresh, r.redis_timeout)),
            )
        });
        for (name, policy) in &r.plans {
            if policy.limits.is_empty() {
                // A plan of budgets alone.
                services.push(r.inner.clone());
                continue;
            }
            let mut builder = RedisBackend::builder(policy.clone())
                .namespace(format!("{namespace}:plan:{name}"))
                .timeout(r.redis_timeout)
                .on_failure(r.failure);
            if let Some(group) = &shares {
                builder = builder.shares_in(group);
            }
            let backend = builder.build(connection)?;
            backends.push(backend.clone());
            services.push(plan_layer!(
                LimitSetLayer::with_backend(backend).metrics_name("plan").retry_spacing(r.spacing),
                r.inner.clone(),
                spread: r.spread
            ));
        }
        // The upstream accounts: one mirror per account in Redis, charged by every replica;
        // the pool's local mirrors (this replica's 1/N) decide only while Redis is away
        // (or refuse, failing closed; an account never fails open).
        let mut store = RedisAccounts::builder("accounts")
            .namespace(format!("{namespace}:pool"))
            .fleet(r.fleet.clone())
            .timeout(r.redis_timeout)
            .on_failure(match r.failure {
                FailurePolicy::FailClosed => FailurePolicy::FailClosed,
                _ => FailurePolicy::Fallback { share: 1.0 },
            });
        for (name, policy) in &r.accounts {
            store = store.member(name.clone(), policy.clone());
        }
        if self.learning.is_some() {
            // What the upstreams count when they decide: the longest window, and jitter.
            let window = r.account_list.iter().map(|a| a.window).max().unwrap_or_default();
            store = store.replaceable_limits(window + r.mirror.jitter);
        }
        if r.lease_refresh.is_zero() {
            // The request first in the fleet's order is granted as soon as the accounts
            // will have room within this, and held until then: one call per grant.
            store = store.reserve_ahead(RESERVE_AHEAD);
        } else {
            store = store.leases(
                AccountLeases::new()
                    .refresh_every(r.lease_refresh)
                    .lifetime(lifetime(r.lease_refresh, r.redis_timeout))
                    .largest_cost(r.max_request_tokens),
            );
            // One call a refresh for the accounts, the plans and the budgets (on one
            // server: a cluster keeps them in different slots).
            if let Some(group) = shares.as_ref().filter(|_| !connection.is_cluster()) {
                store = store.carry_shares(group);
            }
        }
        let store = store.build(connection)?;
        if self.pool.share_through(Arc::new(store.clone())) {
            if let Some(learning) = &self.learning {
                learning.share_through(store.clone());
            }
            *r.store.lock().unwrap_or_else(PoisonError::into_inner) = Some(store);
        }
        // The budgets: one backend per plan that has any, shared by the fleet; while Redis
        // is away, the failure policy (a replica's share of each budget, to fall back on).
        if let Some(budgets) = &self.budgets {
            let mut stores = Vec::new();
            for ((name, _), policy) in r.plans.iter().zip(budgets.policies()) {
                let Some(policy) = policy else {
                    stores.push(None);
                    continue;
                };
                let mut builder = RedisBackend::builder(policy)
                    .namespace(format!("{namespace}:budget:{name}"))
                    .timeout(r.redis_timeout)
                    .on_failure(r.failure);
                if let Some(group) = &shares {
                    // Budgets leased in blocks, renewed in the plans' calls.
                    builder = builder.shares_in(group);
                }
                let backend = builder.build(connection)?;
                stores.push(Some(backend));
            }
            budgets.share_through(stores);
        }
        *r.slot.write().unwrap_or_else(PoisonError::into_inner) = services.into();
        *r.backends.lock().unwrap_or_else(PoisonError::into_inner) = backends.clone();
        self.health.set_redis(backends);
        Ok(())
    }
}

/// How long a lease or a share renewed every `refresh` lives: ten periods, and at least
/// two periods and a call's timeout.
fn lifetime(refresh: Duration, timeout: Duration) -> Duration {
    (refresh * 10).max(refresh * 2 + timeout)
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
