//! The response future of a limit layer.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use pin_project_lite::pin_project;
use tower_limits_core::{Backend, Clock, LimitSnapshot, TenantKey};
use tower_service::Service;

use super::shared::{Shared, Unfinished};
use crate::error::LimitError;
use crate::extract::UsageExtractor;
use crate::meter::Lease;
use crate::refusal::{Finish, Hold, RefusalMode};

/// A permit held while the inner service works. On completion it settles with the real
/// usage (or, after an error, refunds or keeps the cost as configured); dropped before
/// completion, it does what `on_cancel` says. Concurrency is released either way, and
/// waiters are told.
pub(crate) struct PermitGuard<B: Backend> {
    grant: Option<B::Grant>,
    key: TenantKey,
    shared: Arc<Shared<B>>,
    /// When it was granted (nothing without the `metrics` feature).
    lease: Lease,
    /// When it was granted, if it holds concurrency: its hold time feeds the wait that
    /// concurrency refusals suggest.
    held_since: Option<tower_limits_core::Instant>,
}

impl<B: Backend> PermitGuard<B> {
    /// Guards an admitted request's grant; where admissions are counted.
    pub(crate) fn new(grant: B::Grant, key: TenantKey, shared: Arc<Shared<B>>) -> Self {
        let meter = &shared.settings.meter;
        let lease = match shared.backend.shadow_refusal(&grant) {
            None => meter.admitted(&shared.clock),
            Some((limit, tier)) => {
                shared.shadow_refused.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                meter.shadow_limit(limit, tier, &shared.clock)
            }
        };
        let held_since = shared.backend.needs_release(&grant).then(|| shared.clock.now());
        PermitGuard { grant: Some(grant), key, shared, lease, held_since }
    }

    /// Tells the backend what the upstream that served this grant answered.
    fn observe_upstream(&self, report: &tower_limits_core::UpstreamReport) {
        if let Some(grant) = &self.grant {
            self.shared.backend.observe_upstream(grant, report, self.shared.clock.now());
        }
    }

    fn finish(&mut self, outcome: Outcome) {
        let Some(mut grant) = self.grant.take() else { return };
        let backend = &self.shared.backend;
        let refund = match outcome {
            Outcome::Done(Some(usage)) => {
                backend.settle(&self.key, &mut grant, usage, self.shared.clock.now());
                false
            }
            Outcome::Done(None) => false,
            Outcome::Failed => self.shared.settings.on_error == Unfinished::Refund,
            Outcome::Cancelled => self.shared.settings.on_cancel == Unfinished::Refund,
        };
        if refund {
            backend.cancel(&self.key, grant, self.shared.clock.now());
        } else {
            backend.release(&self.key, grant);
        }
        if self.shared.settings.max_wait.is_some() {
            self.shared.waiters.released(&self.key);
        }
        if let Some(since) = self.held_since {
            self.shared.holds.record(self.shared.clock.now().saturating_since(since));
        }
        self.shared.settings.meter.lease_ended(self.lease, &self.shared.clock);
    }
}

enum Outcome {
    Done(Option<u64>),
    Failed,
    Cancelled,
}

impl<B: Backend> Finish for PermitGuard<B> {
    fn done(mut self: Box<Self>, usage: Option<u64>) {
        self.finish(Outcome::Done(usage));
    }

    fn failed(mut self: Box<Self>) {
        self.finish(Outcome::Failed);
    }
}

impl<B: Backend> Drop for PermitGuard<B> {
    fn drop(&mut self) {
        self.finish(Outcome::Cancelled);
    }
}

/// What an admitted waiter carries to the call.
pub(crate) struct Admitted<B: Backend, S, Req> {
    /// `None` when shadow mode let the request through without a grant.
    pub(crate) guard: Option<Box<PermitGuard<B>>>,
    pub(crate) inner: S,
    pub(crate) req: Req,
    pub(crate) snapshots: Option<Box<[LimitSnapshot]>>,
}

type Admission<B, S, Req> = Pin<Box<dyn Future<Output = Result<Admitted<B, S, Req>, Box<LimitError>>> + Send>>;

pin_project! {
    #[project = StateProj]
    enum State<F, A, G> {
        // Called, holding nothing (a rate limit in error mode, the commonest layer): the
        // answer is the inner one's, and nothing is left to drop after it.
        Called { #[pin] fut: F },
        // Called, with a grant to finish or the limits' states for the answer.
        Holding { #[pin] fut: F, guard: Option<Box<G>>, snapshots: Option<Box<[LimitSnapshot]>> },
        Waiting { admission: A },
        Refused { error: Option<Box<LimitError>> },
        Done,
    }
}

pin_project! {
    /// The response future of [`LimitService`](super::LimitService).
    ///
    /// # Cancel safety
    /// Dropping it at any point gives back what it holds: a waiting request leaves its
    /// queue; an admitted one releases its concurrency and refunds or keeps its cost as
    /// `on_cancel` says.
    pub struct ResponseFuture<S, Req, U, R, B>
    where
        S: Service<Req>,
        B: Backend,
    {
        // The guard is boxed: a request that holds nothing (a rate limit, error mode)
        // moves a small future, and a held body takes the box as it is.
        #[pin]
        state: State<S::Future, Admission<B, S, Req>, PermitGuard<B>>,
        usage: U,
        refusal: R,
    }
}

impl<S, Req, U, R, B> ResponseFuture<S, Req, U, R, B>
where
    S: Service<Req>,
    B: Backend,
{
    #[inline]
    pub(crate) fn called(
        fut: S::Future,
        guard: Option<Box<PermitGuard<B>>>,
        usage: U,
        refusal: R,
        snapshots: Option<Box<[LimitSnapshot]>>,
    ) -> Self {
        if guard.is_none() && snapshots.is_none() {
            return Self::plain(fut, usage, refusal);
        }
        ResponseFuture { state: State::Holding { fut, guard, snapshots }, usage, refusal }
    }

    /// A call that holds nothing.
    #[inline(always)]
    pub(crate) fn plain(fut: S::Future, usage: U, refusal: R) -> Self {
        ResponseFuture { state: State::Called { fut }, usage, refusal }
    }

    pub(crate) fn refused(error: Box<LimitError>, usage: U, refusal: R) -> Self {
        ResponseFuture { state: State::Refused { error: Some(error) }, usage, refusal }
    }

    pub(crate) fn waiting(admission: Admission<B, S, Req>, usage: U, refusal: R) -> Self {
        ResponseFuture { state: State::Waiting { admission }, usage, refusal }
    }
}

impl<S, Req, U, R, B> Future for ResponseFuture<S, Req, U, R, B>
where
    S: Service<Req>,
    U: UsageExtractor<S::Response>,
    R: RefusalMode<S::Response, S::Error>,
    B: Backend,
{
    type Output = Result<R::Response, R::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            match this.state.as_mut().project() {
                StateProj::Called { fut } => {
                    // Left as it is once answered: polling a finished future again is the
                    // inner future's affair, and nothing here is held to be given back twice.
                    return fut.poll(cx).map(|out| match out {
                        Ok(response) => Ok(this.refusal.respond(response, None)),
                        Err(e) => Err(this.refusal.fail(e)),
                    });
                }
                StateProj::Holding { fut, guard, snapshots } => {
                    let out = ready!(fut.poll(cx));
                    let mut guard = guard.take();
                    let snapshots = snapshots.take();
                    this.state.set(State::Done);
                    return Poll::Ready(match out {
                        Ok(response) => {
                            let snapshots = snapshots.as_deref();
                            if let (Some(g), Some(report)) = (guard.as_ref(), this.usage.upstream(&response)) {
                                g.observe_upstream(&report);
                            }
                            match guard {
                                Some(g) if this.refusal.holds_body() => {
                                    let hold = Hold::new(g, this.usage.usage(&response));
                                    Ok(this.refusal.respond_held(response, snapshots, hold))
                                }
                                Some(mut g) => {
                                    g.finish(Outcome::Done(this.usage.usage(&response)));
                                    Ok(this.refusal.respond(response, snapshots))
                                }
                                None => Ok(this.refusal.respond(response, snapshots)),
                            }
                        }
                        Err(e) => {
                            if let Some(g) = guard.as_mut() {
                                g.finish(Outcome::Failed);
                            }
                            Err(this.refusal.fail(e))
                        }
                    });
                }
                StateProj::Waiting { admission } => {
                    let admitted = ready!(admission.as_mut().poll(cx));
                    match admitted {
                        Ok(Admitted { guard, mut inner, req, snapshots }) => {
                            let fut = inner.call(req);
                            this.state.set(State::Holding { fut, guard, snapshots });
                        }
                        Err(error) => this.state.set(State::Refused { error: Some(error) }),
                    }
                }
                StateProj::Refused { error } => {
                    let error =
                        error.take().unwrap_or_else(|| Box::new(LimitError::new(crate::ErrorKind::Unavailable)));
                    this.state.set(State::Done);
                    return Poll::Ready(this.refusal.refuse(error));
                }
                StateProj::Done => panic!("ResponseFuture polled after completion"),
            }
        }
    }
}

impl<S, Req, U, R, B> fmt::Debug for ResponseFuture<S, Req, U, R, B>
where
    S: Service<Req>,
    B: Backend,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let admitted = matches!(&self.state, State::Holding { guard: Some(_), .. });
        f.debug_struct("ResponseFuture").field("admitted", &admitted).finish_non_exhaustive()
    }
}
