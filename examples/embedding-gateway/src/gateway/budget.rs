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

use std::pin::Pin;

use http_body::Frame;
use jiff::tz::TimeZone;
use tower_limits::shell::body::BodyUsage;
use tower_limits::{AcquireError, Grant};

use super::*;
use crate::config::{Budgets, ModelPrice};

/// The budgets of every plan, as a stage of the pipeline over `S` (the plans' limits).
#[derive(Clone)]
pub struct BudgetLayer {
    rules: Arc<BudgetRules>,
}

struct BudgetRules {
    /// Each plan's budgets (by the plan's index; `None`: the plan has none).
    sets: Vec<Option<LimitSet>>,
    prices: std::collections::HashMap<String, ModelPrice>,
    budgets: Budgets,
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
        let sets = budgets
            .plans
            .iter()
            .map(|(_, policy)| policy.clone().map(LimitSet::new).transpose())
            .collect::<Result<_, _>>()?;
        let zone = TimeZone::get(&budgets.timezone)?;
        Ok(BudgetLayer {
            rules: Arc::new(BudgetRules { sets, prices: budgets.prices.clone(), budgets: budgets.clone(), zone, now }),
        })
    }

    /// What the key's budget named `limit` (`TIER.budget`) has left now, in micro-units,
    /// and the time to its renewal; `None` for a budget the plan does not have.
    #[must_use]
    pub fn remaining(&self, plan: usize, key: &TenantKey, limit: &str) -> Option<(u64, Duration)> {
        let set = self.rules.sets.get(plan)?.as_ref()?;
        let now = (self.rules.now)();
        set.peek(key, now).into_iter().find(|s| s.name == limit).map(|s| (s.snapshot.remaining, s.snapshot.reset))
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
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let rules = self.rules.clone();
        Box::pin(async move { Ok(rules.through(inner, req).await) })
    }
}

/// A grant of a request's price, to settle once its answer is known.
struct Charge {
    rules: Arc<BudgetRules>,
    set: LimitSet,
    key: TenantKey,
    grant: Grant,
    price: ModelPrice,
    prompt: u64,
}

impl Charge {
    /// Settles to the price of `total` tokens (the prompt counted here, the rest output),
    /// or keeps the estimate; then lets the grant go.
    fn settle(self, total: Option<u64>) {
        let Charge { rules, set, key, mut grant, price, prompt } = self;
        if let Some(total) = total {
            let actual = price.micros(prompt.min(total), total.saturating_sub(prompt));
            set.settle_grant(&key, &mut grant, actual, (rules.now)());
        }
        set.release_grant(&key, grant);
    }

    fn cancel(self) {
        let now = (self.rules.now)();
        self.set.cancel_grant(&self.key, self.grant, now);
    }
}

impl BudgetRules {
    async fn through<S>(self: Arc<Self>, inner: S, req: Request<Body>) -> Response<Body>
    where
        S: Service<Request<Body>, Response = Response<Body>, Error = Infallible>,
    {
        let (Some(id), Some(prepared)) = (req.extensions().get::<Identity>(), req.extensions().get::<Prepared>())
        else {
            return answer_of(inner.oneshot(req).await);
        };
        let Some(set) = self.sets.get(id.plan).and_then(Option::as_ref) else {
            return answer_of(inner.oneshot(req).await);
        };
        let Some(price) = self.prices.get(&*prepared.model).copied() else {
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
        let grant = match set.acquire_grant(&key, estimate, (self.now)()) {
            Ok(grant) => grant,
            Err(e) => return self.refusal(&e, estimate),
        };
        let charge = Charge { rules: self.clone(), set: set.clone(), key, grant, price, prompt };
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
