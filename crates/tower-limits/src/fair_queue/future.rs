//! The response future of [`FairQueueService`](super::FairQueueService).

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use pin_project_lite::pin_project;
use tokio::time::Sleep;
use tower_limits_core::fair_queue::Ticket;
use tower_limits_core::{Backend, Clock, Instant, TenantKey};
use tower_service::Service;

use super::shared::{Admitted, Shared, WaiterStep};
use crate::error::{ErrorKind, LimitError};
use crate::extract::{Annotate, NoAnnotation, UsageExtractor};
use crate::meter::{Lease, QueueWatch};
use crate::refusal::{Finish, Hold, RefusalMode};

/// What an admitted request holds while the inner service works: a slot and the rate
/// backend's grant. Dropped (the response completed, failed or was dropped), the grant
/// is released, keeping what it charged (or what it was settled to), and the slot goes
/// to the next request in fair order.
pub(crate) struct Held<B: Backend> {
    shared: Arc<Shared<B>>,
    key: TenantKey,
    grant: Option<B::Grant>,
    /// What the grant charged, until a settle corrects it.
    cost: u64,
    /// A settle gave cost back: the request at the gate may fit now.
    gave_back: bool,
    /// When it was admitted (nothing without the `metrics` feature).
    lease: Lease,
}

impl<B: Backend> Held<B> {
    /// What an admitted request holds; where admissions are counted. `weight` is the
    /// tenant's, read with the admission, when the fleet publishes admissions.
    pub(crate) fn new(shared: Arc<Shared<B>>, key: TenantKey, grant: B::Grant, cost: u64, weight: Option<u32>) -> Self {
        if let (Some(fleet), Some(weight)) = (&shared.fixed.fleet, weight) {
            fleet.admitted(&key, weight);
        }
        let lease = shared.fixed.meter.admitted(&shared.fixed.clock);
        Held { shared, key, grant: Some(grant), cost, gave_back: false, lease }
    }

    /// Tells the backend what the upstream answered of its own limits.
    fn observe_upstream(&self, report: &tower_limits_core::UpstreamReport) {
        if let Some(grant) = self.grant.as_ref() {
            self.shared.fixed.backend.observe_upstream(grant, report, self.shared.now());
        }
    }

    /// Corrects the grant's cost to the real usage.
    fn settle(&mut self, actual: u64) {
        if let Some(grant) = self.grant.as_mut() {
            let now = self.shared.now();
            self.shared.fixed.backend.settle(&self.key, grant, actual, now);
            self.gave_back |= actual < self.cost;
            self.cost = actual;
        }
    }
}

impl<B: Backend> Finish for Held<B> {
    fn done(mut self: Box<Self>, usage: Option<u64>) {
        if let Some(actual) = usage {
            self.settle(actual);
        }
    }

    fn failed(self: Box<Self>) {}
}

impl<B: Backend> Drop for Held<B> {
    fn drop(&mut self) {
        if let Some(grant) = self.grant.take() {
            self.shared.fixed.backend.release(&self.key, grant);
        }
        if let Some(fleet) = &self.shared.fixed.fleet {
            fleet.finished(&self.key);
        }
        // A settle that gave cost back may have made room for the request at the gate;
        // one that kept or charged more did not, and retrying it would be a wasted call
        // to a shared backend.
        self.shared.release(self.gave_back);
        self.shared.fixed.meter.lease_ended(self.lease, &self.shared.fixed.clock);
    }
}

/// A request waiting for its turn: in the queue, at the rate gate, or decided but not yet
/// told. Dropped before it learns its outcome, it leaves (see the
/// [module docs](super#cancellation)).
pub(crate) struct Waiter<B: Backend> {
    shared: Arc<Shared<B>>,
    ticket: Ticket,
    key: TenantKey,
    sleep: Option<Pin<Box<Sleep>>>,
    sleep_at: Instant,
    /// The last instant a timer of ours fired for: time is at least that.
    floor: Instant,
    done: bool,
    /// Reports the time in queue; dropped before the outcome, a cancellation.
    watch: QueueWatch,
}

impl<B: Backend> Waiter<B> {
    pub(crate) fn new(shared: Arc<Shared<B>>, ticket: Ticket, key: TenantKey) -> Self {
        let watch = shared.fixed.meter.enter_queue(&key, &shared.fixed.clock);
        Waiter { shared, ticket, key, sleep: None, sleep_at: Instant::ZERO, floor: Instant::ZERO, done: false, watch }
    }

    /// Ready with the grant once the request is admitted, or with its refusal.
    pub(crate) fn poll_admit(&mut self, cx: &mut Context<'_>) -> Poll<Result<Admitted<B::Grant>, Box<LimitError>>> {
        if self.done {
            return Poll::Ready(Err(Box::new(LimitError::new(ErrorKind::Unavailable))));
        }
        loop {
            match self.shared.poll_waiter(self.ticket, &self.key, cx, self.floor) {
                WaiterStep::Again => continue,
                WaiterStep::Done(outcome) => {
                    self.done = true;
                    return Poll::Ready(match outcome {
                        Ok(admitted) => {
                            if !admitted.waited.is_zero() {
                                tracing::debug!(
                                    target: "tower_limits",
                                    wait_ms = admitted.waited.as_millis() as u64,
                                    "admitted after waiting for a fair turn"
                                );
                            }
                            self.watch.leave(true);
                            Ok(admitted)
                        }
                        Err(error) => {
                            self.watch.leave(false);
                            self.shared.fixed.meter.refused(&error);
                            trace_refusal(&error, &self.key);
                            Err(error)
                        }
                    });
                }
                WaiterStep::Sleep { until: None, .. } => return Poll::Pending,
                WaiterStep::Sleep { until: Some(at), at_gate } => {
                    let deadline = self.shared.fixed.clock.to_tokio(at);
                    let sleep = match &mut self.sleep {
                        Some(sleep) => {
                            if self.sleep_at != at {
                                sleep.as_mut().reset(deadline);
                            }
                            sleep
                        }
                        None => self.sleep.insert(Box::pin(tokio::time::sleep_until(deadline))),
                    };
                    if at_gate && self.sleep_at != at {
                        tracing::debug!(
                            target: "tower_limits",
                            wait_ms = at.saturating_since(self.shared.fixed.clock.now()).as_millis() as u64,
                            "next in fair order, waiting for the rate"
                        );
                    }
                    self.sleep_at = at;
                    if sleep.as_mut().poll(cx).is_pending() {
                        return Poll::Pending;
                    }
                    self.floor = self.floor.max(at);
                }
            }
        }
    }
}

impl<B: Backend> Drop for Waiter<B> {
    fn drop(&mut self) {
        if !self.done {
            self.shared.leave(self.ticket, &self.key);
        }
    }
}

/// Logs a refusal: at debug level without the tenant, whose key is personal data (an
/// address, an account), and at trace level with it.
pub(crate) fn trace_refusal(error: &LimitError, key: &TenantKey) {
    tracing::trace!(target: "tower_limits", kind = ?error.kind(), tenant = %key, "the fair queue refused a tenant");
    tracing::debug!(
        target: "tower_limits",
        kind = ?error.kind(),
        limit = error.limit().unwrap_or(""),
        tier = error.tier().unwrap_or(""),
        retry_after_ms = error.retry_after().map_or(0, |d| d.as_millis() as u64),
        "request refused by the fair queue"
    );
}

/// A queued request, with the (ready) inner service that will take it.
pub(crate) struct Waiting<S, Req, B: Backend, A> {
    pub(crate) waiter: Waiter<B>,
    pub(crate) inner: Option<S>,
    pub(crate) req: Option<Req>,
    pub(crate) annotate: A,
}

pin_project! {
    #[project = StateProj]
    enum State<F, W, H> {
        Called { #[pin] fut: F, held: Option<H> },
        Waiting { waiting: W },
        Refused { error: Option<Box<LimitError>> },
        Done,
    }
}

pin_project! {
    /// The response future of [`FairQueueService`](super::FairQueueService).
    ///
    /// # Cancel safety
    /// Dropping it at any point gives back what it holds: a queued request leaves the
    /// queue; the request at the rate gate hands the gate (and its timer) to the next
    /// one; a request granted but not yet called returns its slot and refunds its grant;
    /// a called one releases its slot (its rate cost stays charged: the work may have
    /// been done). Each time, the next request in fair order is dispatched.
    pub struct ResponseFuture<S, Req, U, R, B, A = NoAnnotation>
    where
        S: Service<Req>,
        B: Backend,
    {
        #[pin]
        state: State<S::Future, Box<Waiting<S, Req, B, A>>, Held<B>>,
        refusal: R,
        usage: U,
    }
}

impl<S, Req, U, R, B, A> ResponseFuture<S, Req, U, R, B, A>
where
    S: Service<Req>,
    B: Backend,
{
    pub(crate) fn called(fut: S::Future, held: Held<B>, refusal: R, usage: U) -> Self {
        ResponseFuture { state: State::Called { fut, held: Some(held) }, refusal, usage }
    }

    pub(crate) fn waiting(waiting: Waiting<S, Req, B, A>, refusal: R, usage: U) -> Self {
        ResponseFuture { state: State::Waiting { waiting: Box::new(waiting) }, refusal, usage }
    }

    pub(crate) fn refused(error: Box<LimitError>, refusal: R, usage: U) -> Self {
        ResponseFuture { state: State::Refused { error: Some(error) }, refusal, usage }
    }
}

impl<S, Req, U, R, B, A> Future for ResponseFuture<S, Req, U, R, B, A>
where
    S: Service<Req>,
    R: RefusalMode<S::Response, S::Error>,
    B: Backend,
    U: UsageExtractor<S::Response>,
    A: Annotate<Req, B::Grant>,
{
    type Output = Result<R::Response, R::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            match this.state.as_mut().project() {
                StateProj::Called { fut, held } => {
                    let out = ready!(fut.poll(cx));
                    let held = held.take();
                    this.state.set(State::Done);
                    if let (Ok(response), Some(held)) = (&out, &held) {
                        // What the upstream said of its own limits (a `Retry-After`, its
                        // remaining quota) goes to the backend, as the limit layers do.
                        if let Some(report) = this.usage.upstream(response) {
                            held.observe_upstream(&report);
                        }
                    }
                    return Poll::Ready(match (out, held) {
                        (Ok(response), Some(held)) if this.refusal.holds_body() => {
                            // The slot goes back when the body ends.
                            let hold = Hold::new(Box::new(held), this.usage.usage(&response));
                            Ok(this.refusal.respond_held(response, None, hold))
                        }
                        (Ok(response), held) => {
                            if let Some(mut held) = held {
                                if let Some(actual) = this.usage.usage(&response) {
                                    held.settle(actual);
                                }
                            }
                            // The slot went back before the caller sees the response.
                            Ok(this.refusal.respond(response, None))
                        }
                        (Err(e), held) => {
                            drop(held);
                            Err(this.refusal.fail(e))
                        }
                    });
                }
                StateProj::Waiting { waiting } => {
                    let admitted = ready!(waiting.waiter.poll_admit(cx));
                    let next = match admitted {
                        Ok(Admitted { grant, cost, weight, .. }) => {
                            let held = Held::new(
                                waiting.waiter.shared.clone(),
                                waiting.waiter.key.clone(),
                                grant,
                                cost,
                                weight,
                            );
                            match (waiting.inner.take(), waiting.req.take()) {
                                (Some(mut inner), Some(mut req)) => {
                                    if let Some(grant) = held.grant.as_ref() {
                                        waiting.annotate.annotate(&mut req, grant);
                                    }
                                    State::Called { fut: inner.call(req), held: Some(held) }
                                }
                                // Unreachable: the request is called once. The slot goes back.
                                _ => State::Refused { error: Some(Box::new(LimitError::new(ErrorKind::Unavailable))) },
                            }
                        }
                        Err(error) => State::Refused { error: Some(error) },
                    };
                    this.state.set(next);
                }
                StateProj::Refused { error } => {
                    let error = error.take().unwrap_or_else(|| Box::new(LimitError::new(ErrorKind::Unavailable)));
                    this.state.set(State::Done);
                    return Poll::Ready(this.refusal.refuse(error));
                }
                StateProj::Done => panic!("ResponseFuture polled after completion"),
            }
        }
    }
}

impl<S, Req, U, R, B, A> fmt::Debug for ResponseFuture<S, Req, U, R, B, A>
where
    S: Service<Req>,
    B: Backend,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match &self.state {
            State::Called { .. } => "called",
            State::Waiting { .. } => "waiting",
            State::Refused { .. } => "refused",
            State::Done => "done",
        };
        f.debug_struct("ResponseFuture").field("state", &state).finish_non_exhaustive()
    }
}
