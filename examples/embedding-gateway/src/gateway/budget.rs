//! Budgets in money: each request's price is taken from its key's budgets before its
//! plan's limits, and settled to the real usage once the answer says it.
//!
//! The price is estimated from the tokens [`Prepare`](super::Prepare) counted: the prompt
//! at the model's input price, the reserved completion (`max_tokens`) at its output
//! price. Once the answer is known it is settled:
//!
//! - an answer with a usage (a whole answer's `usage`, or `Usage(0)` for a timed-out call
//!   under `on_upstream_timeout = "refund"`) settles to that usage's price;
//! - a stream settles to the price of its final `usage` chunk when its body ends or is
//!   dropped (the prompt is the one counted here, the completion the rest of the total),
//!   and keeps the estimate when the stream sends none;
//! - a refusal or an error that reached no upstream (a `4xx`, a `502`, a `503`) gives the
//!   whole estimate back; a `504` keeps it (the upstream may have billed the call), as
//!   `on_upstream_timeout = "keep"` does for the tokens.
//!
//! A spent budget is answered `429` with OpenAI's error shape (`type`
//! `insufficient_quota`, `code` `budget_exceeded`), naming the budget, what was used of
//! it and when it renews, with `Retry-After` set to the renewal.
//!
//! In memory each plan's budgets are a [`LimitSet`]; with Redis, once the replica reached
//! it ([`Gateway::connect_redis`]), a [`RedisBackend`] shared by the fleet, so that a
//! team's month is one budget whichever replica serves it, and outlives the replicas.
//! Before that, and while Redis is away under `backend_failure = "fallback"`, each
//! replica decides from `1 / replicas` of every budget.

use std::pin::Pin;

use http_body::Frame;
use jiff::tz::TimeZone;
use tower_limits::shell::body::BodyUsage;
use tower_limits::{AcquireError, Backend, Grant};
use tower_limits_redis::RedisGrant;

use super::*;
use crate::config::{Budgets, ModelPrice};

/// The budgets of every plan, as a stage of the pipeline over `S` (the plans' limits).
#[derive(Clone)]
pub struct BudgetLayer {
    rules: Arc<BudgetRules>,
}

struct BudgetRules {
    /// Each plan's budgets (by the plan's index; `None`: the plan has none), replaced when
    /// the replica reaches Redis.
    stores: RwLock<Arc<[Option<BudgetStore>]>>,
    budgets: Budgets,
    /// The currency, as the spend metric's label (shared, not copied per request).
    currency: Arc<str>,
    zone: TimeZone,
    now: Arc<dyn Fn() -> Instant + Send + Sync>,
}

impl fmt::Debug for BudgetLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BudgetLayer").field("currency", &self.rules.budgets.currency).finish_non_exhaustive()
    }
}

impl BudgetLayer {
    /// The budgets of `budgets`, deciding at the instants `now` reads (a layer clock's, so
    /// that the calendar places them).
    ///
    /// # Errors
    /// A budget the library refuses (validation catches these first), or an unknown time
    /// zone.
    pub fn new(budgets: &Budgets, now: Arc<dyn Fn() -> Instant + Send + Sync>) -> Result<Self, BoxError> {
        Self::share_of(budgets, 1, now)
    }

    /// Like [`BudgetLayer::new`], each budget `1 / replicas` of its amount: what one of
    /// `replicas` replicas decides alone until it reaches Redis.
    ///
    /// # Errors
    /// As [`BudgetLayer::new`].
    pub fn share_of(
        budgets: &Budgets,
        replicas: u64,
        now: Arc<dyn Fn() -> Instant + Send + Sync>,
    ) -> Result<Self, BoxError> {
        let stores: Arc<[Option<BudgetStore>]> = budgets
            .plans
            .iter()
            .map(|(_, policy)| {
                policy.as_ref().map(|p| LimitSet::new(share_of(p, replicas)).map(BudgetStore::Memory)).transpose()
            })
            .collect::<Result<_, _>>()?;
        let zone = TimeZone::get(&budgets.timezone)?;
        Ok(BudgetLayer {
            rules: Arc::new(BudgetRules {
                stores: RwLock::new(stores),
                budgets: budgets.clone(),
                currency: budgets.currency.as_str().into(),
                zone,
                now,
            }),
        })
    }

    /// Moves every plan's budgets to Redis: one backend per plan with budgets (by the
    /// plan's index), the state of the budgets decided so far left behind.
    pub(super) fn share_through(&self, backends: Vec<Option<RedisBackend>>) {
        let stores: Arc<[Option<BudgetStore>]> = backends.into_iter().map(|b| b.map(BudgetStore::Redis)).collect();
        *self.rules.stores.write().unwrap_or_else(PoisonError::into_inner) = stores;
    }

    /// Each plan's budget policy (by the plan's index), as configured.
    pub(super) fn policies(&self) -> Vec<Option<LimitSetPolicy>> {
        self.rules.budgets.plans.iter().map(|(_, p)| p.clone()).collect()
    }

    /// What the key's budget named `limit` (`TIER.budget`) has left now, in micro-units,
    /// and the time to its renewal; `None` for a budget the plan does not have.
    ///
    /// In memory the budget's state; with Redis, what this replica last read of it.
    #[must_use]
    pub fn remaining(&self, plan: usize, key: &TenantKey, limit: &str) -> Option<(u64, Duration)> {
        let store = self.rules.store(plan)?;
        let now = (self.rules.now)();
        let seen = match &store {
            BudgetStore::Memory(set) => set.peek(key, now),
            BudgetStore::Redis(backend) => backend.peek(key, now),
        };
        seen.into_iter().find(|s| s.name == limit).map(|s| (s.snapshot.remaining, s.snapshot.reset))
    }
}

impl<S> Layer<S> for BudgetLayer {
    type Service = BudgetService<S>;

    fn layer(&self, inner: S) -> BudgetService<S> {
        BudgetService { inner, rules: self.rules.clone() }
    }
}

/// The service of [`BudgetLayer`].
#[derive(Clone)]
pub struct BudgetService<S> {
    inner: S,
    rules: Arc<BudgetRules>,
}

impl<S> fmt::Debug for BudgetService<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BudgetService").finish_non_exhaustive()
    }
}

impl<S> Service<Request<Body>> for BudgetService<S>
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
        let inner = super::take_ready(&mut self.inner);
        let rules = self.rules.clone();
        Box::pin(async move { Ok(rules.through(inner, req).await) })
    }
}

/// Where a plan's budgets are counted.
#[derive(Clone)]
enum BudgetStore {
    Memory(LimitSet),
    Redis(RedisBackend),
}

/// A grant of one of the stores.
enum BudgetGrant {
    Memory(Grant),
    Redis(RedisGrant),
}

impl BudgetStore {
    async fn acquire(&self, key: &TenantKey, cost: u64, now: Instant) -> Result<BudgetGrant, AcquireError> {
        match self {
            BudgetStore::Memory(set) => set.acquire_grant(key, cost, now).map(BudgetGrant::Memory),
            BudgetStore::Redis(backend) => backend.acquire(key, cost, now).await.map(BudgetGrant::Redis),
        }
    }
}

/// A grant of a request's price, to settle once its answer is known.
struct Charge {
    rules: Arc<BudgetRules>,
    store: BudgetStore,
    tenant: Arc<str>,
    key: TenantKey,
    grant: BudgetGrant,
    price: ModelPrice,
    prompt: u64,
    /// The price taken at admission.
    estimate: u64,
}

impl Charge {
    /// Settles to the price of `total` tokens (the prompt counted here, the rest output),
    /// or keeps the estimate; then lets the grant go.
    fn settle(self, total: Option<u64>) {
        let Charge { rules, store, tenant, key, grant, price, prompt, estimate } = self;
        let actual = total.map(|total| price.micros(prompt.min(total), total.saturating_sub(prompt)));
        let now = (rules.now)();
        let spent = actual.unwrap_or(estimate);
        metrics::counter!("gateway_spend_micros", "tenant" => tenant, "currency" => rules.currency.clone())
            .increment(spent);
        match (store, grant) {
            (BudgetStore::Memory(set), BudgetGrant::Memory(mut g)) => {
                if let Some(actual) = actual {
                    set.settle_grant(&key, &mut g, actual, now);
                }
                set.release_grant(&key, g);
            }
            (BudgetStore::Redis(backend), BudgetGrant::Redis(mut g)) => {
                if let Some(actual) = actual {
                    backend.settle(&key, &mut g, actual, now);
                }
                backend.release(&key, g);
            }
            // A grant goes back to the store that made it: the pair never differs.
            _ => {}
        }
    }

    fn cancel(self) {
        let now = (self.rules.now)();
        match (self.store, self.grant) {
            (BudgetStore::Memory(set), BudgetGrant::Memory(g)) => set.cancel_grant(&self.key, g, now),
            (BudgetStore::Redis(backend), BudgetGrant::Redis(g)) => backend.cancel(&self.key, g, now),
            _ => {}
        }
    }
}

impl BudgetRules {
    /// The store of plan `plan`'s budgets, if it has any.
    fn store(&self, plan: usize) -> Option<BudgetStore> {
        self.stores.read().unwrap_or_else(PoisonError::into_inner).get(plan)?.clone()
    }

    async fn through<S>(self: Arc<Self>, inner: S, req: Request<Body>) -> Response<Body>
    where
        S: Service<Request<Body>, Response = Response<Body>, Error = Infallible>,
    {
        let (Some(id), Some(prepared)) = (req.extensions().get::<Identity>(), req.extensions().get::<Prepared>())
        else {
            return answer_of(inner.oneshot(req).await);
        };
        let Some(store) = self.store(id.plan) else {
            return answer_of(inner.oneshot(req).await);
        };
        let Some(price) = self.budgets.prices.get(&*prepared.model).copied() else {
            // Validation gives every served model a price once a budget exists.
            return api::error_response(
                StatusCode::INTERNAL_SERVER_ERROR,
                "server_error",
                "internal",
                "the model has no price",
            );
        };
        let (prompt, stream) = (prepared.prompt, prepared.stream);
        let estimate = price.micros(prompt, prepared.tokens.saturating_sub(prompt));
        let key = id.key.clone();
        let grant = match store.acquire(&key, estimate, (self.now)()).await {
            Ok(grant) => grant,
            Err(e) => return self.refusal(&e, estimate),
        };
        let tenant = id.tenant.clone();
        let charge = Charge { rules: self.clone(), store, tenant, key, grant, price, prompt, estimate };
        let response = answer_of(inner.oneshot(req).await);
        if let Some(Usage(total)) = response.extensions().get::<Usage>().copied() {
            charge.settle(Some(total));
            return response;
        }
        let status = response.status();
        if stream && status.is_success() {
            return response.map(|body| {
                Body::new(SettledBody {
                    inner: body,
                    usage: OpenAiStreamUsage::default(),
                    seen: None,
                    charge: Some(charge),
                })
            });
        }
        if status.is_success() || status == StatusCode::GATEWAY_TIMEOUT {
            charge.settle(None);
        } else {
            charge.cancel();
        }
        response
    }

    /// The answer to a request its budget cannot pay for.
    fn refusal(&self, error: &AcquireError, estimate: u64) -> Response<Body> {
        let b = &self.budgets;
        match error {
            AcquireError::Refused(r) => {
                let wait = r.retry_after();
                let snap = r.snapshot();
                let used = snap.quota.saturating_sub(snap.remaining);
                let renews = tower_limits::core::time::unix_origin()
                    .checked_add(Duration::from_nanos(((self.now)() + wait).as_nanos()))
                    .and_then(|t| jiff::Timestamp::try_from(t).ok())
                    .map(|t| t.to_zoned(self.zone.clone()).strftime("%Y-%m-%d %H:%M %Z").to_string())
                    .unwrap_or_default();
                let message = format!(
                    "The budget {} of {} is spent: {} used, and this request is estimated at {}. It renews at {} ({}), \
                     in {}s.",
                    r.limit(),
                    b.money(snap.quota),
                    b.money(used),
                    b.money(estimate),
                    renews,
                    b.timezone,
                    wait.as_secs(),
                );
                let mut response = api::error_response(
                    StatusCode::TOO_MANY_REQUESTS,
                    "insufficient_quota",
                    "budget_exceeded",
                    &message,
                );
                write_retry_after(response.headers_mut(), wait);
                response
            }
            AcquireError::CostAboveCapacity(e) => api::error_response(
                StatusCode::TOO_MANY_REQUESTS,
                "insufficient_quota",
                "budget_exceeded",
                &format!(
                    "This request is estimated at {}, above the whole budget {} of {}: reduce max_tokens or the input.",
                    b.money(estimate),
                    e.limit(),
                    b.money(e.capacity()),
                ),
            ),
            other => api::error_response(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                "budget_unavailable",
                &format!("The budget could not be checked: {other}"),
            ),
        }
    }
}

fn answer_of(result: Result<Response<Body>, Infallible>) -> Response<Body> {
    match result {
        Ok(r) => r,
        Err(never) => match never {},
    }
}

/// A streamed answer that settles its request's price from the stream's final `usage`
/// chunk when it ends, or keeps the estimate when it is dropped without one.
struct SettledBody {
    inner: Body,
    usage: OpenAiStreamUsage,
    seen: Option<u64>,
    charge: Option<Charge>,
}

impl http_body::Body for SettledBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let this = &mut *self;
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    if let Some(total) = this.usage.data(data) {
                        this.seen = Some(total);
                    }
                }
            }
            Poll::Ready(None) => {
                if let Some(charge) = this.charge.take() {
                    charge.settle(this.seen);
                }
            }
            _ => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for SettledBody {
    fn drop(&mut self) {
        if let Some(charge) = self.charge.take() {
            charge.settle(self.seen);
        }
    }
}
