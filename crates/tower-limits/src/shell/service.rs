use std::fmt;
use std::future::Future;
use std::pin::{Pin, pin};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll, Waker};

use tower_limits_core::{Backend, Clock, LimitSnapshot, Observed, TenantKey};
use tower_service::Service;

use super::future::{Admitted, PermitGuard, ResponseFuture};
use super::shared::{Shared, Unfinished};
use crate::error::{ErrorKind, LimitError};
use crate::extract::{Annotate, CostExtractor, Extractors, KeyExtractor, UsageExtractor};
use crate::meter::Meter;
use crate::refusal::RefusalMode;
use crate::wait::Blocked;

/// The service built by [`LimitSetLayer`](crate::LimitSetLayer).
///
/// `poll_ready` only forwards the inner service's readiness: nothing is reserved before
/// a request exists, so an idle connection pins no capacity. The decision is made in
/// `call`; the inner service is called only once the request is admitted. Clones share
/// the limits.
pub struct LimitService<S, E, R, B> {
    pub(crate) inner: S,
    pub(crate) shared: Arc<Shared<B>>,
    pub(crate) extract: E,
    pub(crate) refusal: R,
}

impl<S, E, R, B> LimitService<S, E, R, B> {
    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// The inner service, unwrapped.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S: Clone, E: Clone, R: Clone, B> Clone for LimitService<S, E, R, B> {
    fn clone(&self) -> Self {
        LimitService {
            inner: self.inner.clone(),
            shared: self.shared.clone(),
            extract: self.extract.clone(),
            refusal: self.refusal.clone(),
        }
    }
}

impl<S: fmt::Debug, E: fmt::Debug, R, B> fmt::Debug for LimitService<S, E, R, B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LimitService")
            .field("inner", &self.inner)
            .field("extract", &self.extract)
            .field("settings", &self.shared.settings)
            .finish_non_exhaustive()
    }
}

impl<S, Req, K, C, U, A, R, B> Service<Req> for LimitService<S, Extractors<K, C, U, A>, R, B>
where
    A: Annotate<Req, B::Grant>,
    S: Service<Req> + Clone + Send + 'static,
    S::Future: Send,
    Req: Send + 'static,
    K: KeyExtractor<Req>,
    C: CostExtractor<Req>,
    U: UsageExtractor<S::Response>,
    R: RefusalMode<S::Response, S::Error>,
    B: Backend,
{
    type Response = R::Response;
    type Error = R::Error;
    type Future = ResponseFuture<S, Req, U, R, B>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(|e| self.refusal.fail(e))
    }

    fn call(&mut self, mut req: Req) -> Self::Future {
        let shared = &self.shared;
        // Borrowed, never moved: a key is some sixty bytes, written in pieces by whoever
        // builds it, and a copy read back whole right after those writes stalls the core.
        // The global key is one kept for every request.
        static GLOBAL: TenantKey = TenantKey::global();
        let extracted;
        let key: &TenantKey = if K::GLOBAL {
            &GLOBAL
        } else {
            match self.extract.keys.extract(&req) {
                Ok(key) => {
                    shared.key_watch.found();
                    extracted = key;
                    &extracted
                }
                Err(missing) => match &shared.settings.default_key {
                    Some(key) => {
                        extracted = key.clone();
                        &extracted
                    }
                    None => {
                        let error = shared.key_watch.missing(&missing);
                        if shared.settings.shadow {
                            return self.pass(error, req, None);
                        }
                        return self.refuse(None, error, None);
                    }
                },
            }
        };
        let cost = self.extract.cost.cost(&req);
        let now = shared.clock.now();
        let waits = shared.settings.max_wait.is_some() && !shared.settings.shadow;
        if waits && shared.waiters.has_waiters(key) {
            // Others of this key wait already: queue behind them.
            return self.wait(key.clone(), cost, req, None);
        }
        if self.refusal.wants_snapshots() {
            return self.call_observed(key, cost, req, now);
        }
        // In memory the answer comes at once, matched where it is returned; a remote
        // backend's acquisition is polled once, and finished in the response future if it
        // is under way.
        if let Some(decided) = shared.backend.acquire_now(key, cost, now) {
            return match decided {
                Ok(grant) => {
                    // The request goes to the inner service from here, not through a helper,
                    // so that it is not copied whole on the way.
                    let guard = self.guard(key, grant, &mut req);
                    if guard.is_none() {
                        // Holding nothing: the inner future is made in the answer's place.
                        return ResponseFuture::plain(
                            self.inner.call(req),
                            self.extract.usage.clone(),
                            self.refusal.clone(),
                        );
                    }
                    let fut = self.inner.call(req);
                    ResponseFuture::called(fut, guard, self.extract.usage.clone(), self.refusal.clone(), None)
                }
                Err(e) => self.not_admitted(e, key, cost, req),
            };
        }
        let mut acquire = shared.backend.acquire(key, cost, now);
        match Pin::new(&mut acquire).poll(&mut Context::from_waker(Waker::noop())) {
            Poll::Ready(Ok(grant)) => self.admitted(key, grant, req, None),
            Poll::Ready(Err(e)) => self.not_admitted(e, key, cost, req),
            Poll::Pending => self.wait(key.clone(), cost, req, Some(Observed::unobserved(acquire))),
        }
    }
}

impl<S, K, C, U, A, R, B> LimitService<S, Extractors<K, C, U, A>, R, B>
where
    B: Backend,
    U: Clone,
    R: Clone,
{
    /// The call of a layer whose answers carry the limits' states: they come with the
    /// decision, in the same pass.
    fn call_observed<Req>(
        &mut self,
        key: &TenantKey,
        cost: u64,
        req: Req,
        now: tower_limits_core::Instant,
    ) -> ResponseFuture<S, Req, U, R, B>
    where
        S: Service<Req> + Clone + Send + 'static,
        S::Future: Send,
        Req: Send + 'static,
        U: UsageExtractor<S::Response>,
        R: RefusalMode<S::Response, S::Error>,
        A: Annotate<Req, B::Grant>,
    {
        let shared = &self.shared;
        let mut observed = shared.backend.acquire_observed(key, cost, now);
        match Pin::new(&mut observed).poll(&mut Context::from_waker(Waker::noop())) {
            Poll::Ready((Ok(grant), seen)) => self.admitted(key, grant, req, Some(seen.into_boxed_slice())),
            Poll::Ready((Err(e), seen)) => {
                let error = LimitError::from(e);
                if shared.settings.shadow {
                    return self.pass(error, req, Some(seen));
                }
                if shared.settings.max_wait.is_some_and(|w| waitable(&error, w)) {
                    return self.wait(key.clone(), cost, req, None);
                }
                self.refuse(Some(key), error, Some(seen))
            }
            Poll::Pending => self.wait(key.clone(), cost, req, Some(observed)),
        }
    }

    /// A refused acquisition: wait for capacity when the layer waits and waiting can
    /// help, pass in shadow mode, refuse otherwise.
    fn not_admitted<Req>(
        &mut self,
        e: tower_limits_core::AcquireError,
        key: &TenantKey,
        cost: u64,
        req: Req,
    ) -> ResponseFuture<S, Req, U, R, B>
    where
        S: Service<Req> + Clone + Send + 'static,
        S::Future: Send,
        Req: Send + 'static,
        U: UsageExtractor<S::Response>,
        R: RefusalMode<S::Response, S::Error>,
        A: Annotate<Req, B::Grant>,
    {
        let settings = &self.shared.settings;
        let error = LimitError::from(e);
        if settings.max_wait.is_some_and(|w| !settings.shadow && waitable(&error, w)) {
            return self.wait(key.clone(), cost, req, None);
        }
        if settings.shadow {
            return self.pass(error, req, None);
        }
        self.refuse(Some(key), error, None)
    }

    /// Calls the inner service for an admitted request.
    #[inline(always)]
    fn admitted<Req>(
        &mut self,
        // Borrowed: a request that holds nothing never copies its key (a key is some
        // sixty bytes, and its moves cost more than their size suggests).
        key: &TenantKey,
        grant: B::Grant,
        mut req: Req,
        snapshots: Option<Box<[LimitSnapshot]>>,
    ) -> ResponseFuture<S, Req, U, R, B>
    where
        S: Service<Req>,
        U: UsageExtractor<S::Response>,
        R: RefusalMode<S::Response, S::Error>,
        A: Annotate<Req, B::Grant>,
    {
        let guard = self.guard(key, grant, &mut req);
        let fut = self.inner.call(req);
        ResponseFuture::called(fut, guard, self.extract.usage.clone(), self.refusal.clone(), snapshots)
    }

    /// What an admitted request keeps until its response is in: nothing, when nothing is
    /// to be done then (a rate limit in error mode), or a guard of its grant. Annotates
    /// the request with the grant.
    #[inline(always)]
    fn guard<Req>(&self, key: &TenantKey, grant: B::Grant, req: &mut Req) -> Option<Box<PermitGuard<B>>>
    where
        S: Service<Req>,
        U: UsageExtractor<S::Response>,
        R: RefusalMode<S::Response, S::Error>,
        A: Annotate<Req, B::Grant>,
    {
        let shared = &self.shared;
        let settings = &shared.settings;
        let idle = !U::REPORTS
            && !self.refusal.reads_body_usage()
            && settings.on_error == Unfinished::Keep
            && settings.on_cancel == Unfinished::Keep
            && !shared.backend.needs_release(&grant)
            && !Meter::LEASES
            && shared.backend.shadow_refusal(&grant).is_none();
        self.extract.annotate.annotate(req, &grant);
        (!idle).then(|| Box::new(PermitGuard::new(grant, key.clone(), shared.clone())))
    }

    /// Refuses, with the limits' states when the decision read them.
    fn refuse<Req>(
        &self,
        key: Option<&TenantKey>,
        mut error: LimitError,
        seen: Option<Vec<LimitSnapshot>>,
    ) -> ResponseFuture<S, Req, U, R, B>
    where
        S: tower_service::Service<Req>,
        R: RefusalMode<S::Response, S::Error>,
    {
        self.shared.count_refusal(&mut error, key);
        trace_refusal(&error);
        error.snapshots = seen.map(Into::into);
        ResponseFuture::refused(Box::new(error), self.extract.usage.clone(), self.refusal.clone())
    }

    /// Shadow mode: records what would have been refused, and calls the inner service
    /// anyway, holding nothing (nothing was granted, so nothing is released).
    fn pass<Req>(
        &mut self,
        error: LimitError,
        req: Req,
        seen: Option<Vec<LimitSnapshot>>,
    ) -> ResponseFuture<S, Req, U, R, B>
    where
        S: tower_service::Service<Req>,
        R: RefusalMode<S::Response, S::Error>,
    {
        self.shared.shadow_refused.fetch_add(1, Ordering::Relaxed);
        self.shared.settings.meter.shadow_refused(&error);
        trace_shadow(&error);
        // The states read with the decision tell the answer's headers what is left.
        let snapshots = seen.map(Vec::into_boxed_slice);
        ResponseFuture::called(self.inner.call(req), None, self.extract.usage.clone(), self.refusal.clone(), snapshots)
    }

    /// The slow path: wait for capacity (or for a remote backend's `pending` acquisition),
    /// then call a ready clone of the inner service.
    fn wait<Req>(
        &mut self,
        key: TenantKey,
        cost: u64,
        mut req: Req,
        pending: Option<Observed<B>>,
    ) -> ResponseFuture<S, Req, U, R, B>
    where
        S: Service<Req> + Clone + Send + 'static,
        Req: Send + 'static,
        R: RefusalMode<S::Response, S::Error>,
        A: Annotate<Req, B::Grant>,
    {
        // The service polled ready goes with the request; the clone stays for the next.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let shared = self.shared.clone();
        let wants_snapshots = self.refusal.wants_snapshots();
        let annotate = self.extract.annotate.clone();
        let admitted = async move {
            let answered = match pending {
                Some(acquire) => match acquire.await {
                    (Ok(grant), seen) => Some((grant, wants_snapshots.then(|| seen.into_boxed_slice()))),
                    (Err(e), seen) => {
                        let mut error = LimitError::from(e);
                        if shared.settings.shadow {
                            shared.shadow_refused.fetch_add(1, Ordering::Relaxed);
                            shared.settings.meter.shadow_refused(&error);
                            trace_shadow(&error);
                            let snapshots = wants_snapshots.then(|| seen.into_boxed_slice());
                            return Ok(Admitted { guard: None, inner, req, snapshots });
                        }
                        if !shared.settings.max_wait.is_some_and(|w| waitable(&error, w)) {
                            shared.count_refusal(&mut error, Some(&key));
                            trace_refusal(&error);
                            error.snapshots = wants_snapshots.then(|| seen.into());
                            return Err(Box::new(error));
                        }
                        None
                    }
                },
                None => None,
            };
            let (grant, snapshots) = match answered {
                Some(admitted) => admitted,
                None => admit(&shared, &key, cost, wants_snapshots).await.map_err(Box::new)?,
            };
            annotate.annotate(&mut req, &grant);
            Ok(Admitted { guard: Some(Box::new(PermitGuard::new(grant, key, shared.clone()))), inner, req, snapshots })
        };
        ResponseFuture::waiting(Box::pin(admitted), self.extract.usage.clone(), self.refusal.clone())
    }
}

/// One attempt: the decision, and the limits' states when the answer wants them.
async fn attempt<B: Backend>(
    shared: &Shared<B>,
    key: &TenantKey,
    cost: u64,
    now: tower_limits_core::Instant,
    wants_snapshots: bool,
) -> (Result<B::Grant, LimitError>, Option<Vec<LimitSnapshot>>) {
    if wants_snapshots {
        let (granted, seen) = shared.backend.acquire_observed(key, cost, now).await;
        (granted.map_err(LimitError::from), Some(seen))
    } else {
        (shared.backend.acquire(key, cost, now).await.map_err(LimitError::from), None)
    }
}

/// Whether waiting can help: a rate refusal within `max_wait`, or a concurrency refusal.
fn waitable(error: &LimitError, max_wait: std::time::Duration) -> bool {
    match error.kind() {
        ErrorKind::RateLimited => error.retry_after().is_some_and(|d| d <= max_wait),
        ErrorKind::ConcurrencyLimited => true,
        _ => false,
    }
}

fn trace_shadow(error: &LimitError) {
    tracing::debug!(
        target: "tower_limits",
        kind = ?error.kind(),
        limit = error.limit().unwrap_or(""),
        tier = error.tier().unwrap_or(""),
        "shadow mode: request would have been refused, admitted"
    );
}

fn trace_refusal(error: &LimitError) {
    tracing::debug!(
        target: "tower_limits",
        kind = ?error.kind(),
        limit = error.limit().unwrap_or(""),
        tier = error.tier().unwrap_or(""),
        retry_after_ms = error.retry_after().map_or(0, |d| d.as_millis() as u64),
        "request refused"
    );
}

/// Waits in the key's queue until the request can be admitted or its time is up, inside
/// a `limit_wait` span (debug level; the tenant's key is personal data and stays out of
/// it). The span is attached to the future, never entered across an `.await`: entered,
/// it would follow the thread to whatever task it polls next.
///
/// # Cancel safety
/// Dropping the future leaves the queue (waking the next waiter) and holds nothing.
async fn admit<B: Backend>(
    shared: &Shared<B>,
    key: &TenantKey,
    cost: u64,
    wants_snapshots: bool,
) -> Result<(B::Grant, Option<Box<[LimitSnapshot]>>), LimitError> {
    use tracing::Instrument;
    let span = tracing::debug_span!(target: "tower_limits", "limit_wait");
    admit_in_turn(shared, key, cost, wants_snapshots).instrument(span).await
}

/// [`admit`], outside its span.
async fn admit_in_turn<B: Backend>(
    shared: &Shared<B>,
    key: &TenantKey,
    cost: u64,
    wants_snapshots: bool,
) -> Result<(B::Grant, Option<Box<[LimitSnapshot]>>), LimitError> {
    let max_wait = shared.settings.max_wait.unwrap_or_default();
    let start = shared.clock.now();
    let deadline = start + max_wait;
    let Some(ticket) = shared.waiters.join(key, shared.settings.max_waiters) else {
        let mut error = LimitError::new(ErrorKind::QueueFull).with_detail("too many requests are waiting");
        shared.count_refusal(&mut error, Some(key));
        return Err(error);
    };
    // Reports the wait when it ends; dropped with this future, a cancelled one.
    let mut watch = shared.settings.meter.enter_queue(key, &shared.clock);
    ticket.head().await;
    let mut waited = false;
    loop {
        let epoch = shared.waiters.epoch();
        let now = shared.clock.now();
        let (granted, seen) = attempt(shared, key, cost, now, wants_snapshots).await;
        let mut error = match granted {
            Ok(grant) => {
                // A grant may leave room for the next waiter on the same state.
                ticket.unpark();
                if waited {
                    shared.waited.fetch_add(1, Ordering::Relaxed);
                }
                watch.leave(true);
                return Ok((grant, seen.map(Vec::into_boxed_slice)));
            }
            Err(error) => error,
        };
        error.snapshots = seen.map(Into::into);
        let until = match error.kind() {
            ErrorKind::RateLimited => {
                let wait = error.retry_after().unwrap_or_default();
                if now + wait > deadline {
                    shared.count_refusal(&mut error, Some(key));
                    if waited {
                        shared.wait_timeouts.fetch_add(1, Ordering::Relaxed);
                    }
                    trace_refusal(&error);
                    watch.leave(false);
                    return Err(error);
                }
                now + wait
            }
            ErrorKind::ConcurrencyLimited if now < deadline => deadline,
            ErrorKind::ConcurrencyLimited => {
                shared.wait_timeouts.fetch_add(1, Ordering::Relaxed);
                let mut timed_out = LimitError { kind: ErrorKind::WaitTimedOut, ..error };
                shared.count_refusal(&mut timed_out, Some(key));
                trace_refusal(&timed_out);
                watch.leave(false);
                return Err(timed_out);
            }
            _ => {
                shared.count_refusal(&mut error, Some(key));
                trace_refusal(&error);
                watch.leave(false);
                return Err(error);
            }
        };
        tracing::debug!(
            target: "tower_limits",
            limit = error.limit().unwrap_or(""),
            tier = error.tier().unwrap_or(""),
            wait_ms = until.saturating_since(now).as_millis() as u64,
            "waiting for capacity"
        );
        waited = true;
        let sleep = tokio::time::sleep_until(shared.clock.to_tokio(until));
        let mut sleep = pin!(sleep);
        if error.kind() == ErrorKind::ConcurrencyLimited {
            // Park on the state that refused: only its releases wake this request.
            let limit = error.limit.unwrap_or("");
            let depth = match error.tier() {
                None => Some(0),
                Some(tier) => shared.backend.tier_depth(tier),
            };
            let state = Blocked::new(limit, depth, key);
            let park = ticket.park(&state, epoch);
            let mut park = pin!(park);
            std::future::poll_fn(|cx| {
                if sleep.as_mut().poll(cx).is_ready() || park.as_mut().poll(cx).is_ready() {
                    Poll::Ready(())
                } else {
                    Poll::Pending
                }
            })
            .await;
        } else {
            // A rate limit names its instant: this request's own timer, no one's wake-up.
            ticket.unpark();
            sleep.await;
        }
    }
}
