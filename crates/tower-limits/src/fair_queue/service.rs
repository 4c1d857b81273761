use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};

use tower_limits_core::Backend;
use tower_service::Service;

use super::future::{Held, ResponseFuture, Waiter, Waiting, trace_refusal};
use super::shared::{Arrival, FairQueueLayerStats, Shared};
use crate::extract::{Annotate, CostExtractor, Extractors, KeyExtractor, UsageExtractor};
use crate::refusal::RefusalMode;

/// The service built by [`FairQueueLayer`](super::FairQueueLayer).
///
/// `poll_ready` only forwards the inner service's readiness: it reserves nothing, so the
/// inner service's own queueing (a FIFO) never decides the order. In `call`, a request
/// that finds nothing queued and capacity free is admitted at once; any other waits for
/// its fair turn in the response future, which then calls the ready service it took
/// along (a clone stays behind for the next request). Clones share one queue.
pub struct FairQueueService<S, E, R, B: Backend> {
    pub(crate) inner: S,
    pub(crate) shared: Arc<Shared<B>>,
    pub(crate) extract: E,
    pub(crate) refusal: R,
}

impl<S, E, R, B: Backend> FairQueueService<S, E, R, B> {
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

    /// Counters of the layer this service belongs to.
    #[must_use]
    pub fn stats(&self) -> FairQueueLayerStats {
        self.shared.stats()
    }
}

impl<S: Clone, E: Clone, R: Clone, B: Backend> Clone for FairQueueService<S, E, R, B> {
    fn clone(&self) -> Self {
        FairQueueService {
            inner: self.inner.clone(),
            shared: self.shared.clone(),
            extract: self.extract.clone(),
            refusal: self.refusal.clone(),
        }
    }
}

impl<S: fmt::Debug, E: fmt::Debug, R: fmt::Debug, B: Backend> fmt::Debug for FairQueueService<S, E, R, B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FairQueueService")
            .field("inner", &self.inner)
            .field("extract", &self.extract)
            .field("refusal", &self.refusal)
            .field("settings", &self.shared)
            .finish()
    }
}

impl<S, Req, K, C, U, A, R, B> Service<Req> for FairQueueService<S, Extractors<K, C, U, A>, R, B>
where
    S: Service<Req> + Clone,
    K: KeyExtractor<Req>,
    C: CostExtractor<Req>,
    R: RefusalMode<S::Response, S::Error>,
    B: Backend,
    U: UsageExtractor<S::Response>,
    A: Annotate<Req, B::Grant>,
{
    type Response = R::Response;
    type Error = R::Error;
    type Future = ResponseFuture<S, Req, U, R, B, A>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(|e| self.refusal.fail(e))
    }

    fn call(&mut self, mut req: Req) -> Self::Future {
        let shared = &self.shared;
        let key = match self.extract.keys.extract(&req) {
            Ok(key) => {
                shared.key_watch.found();
                key
            }
            Err(missing) => match &shared.fixed.default_key {
                Some(key) => key.clone(),
                None => {
                    let error = shared.key_watch.missing(&missing);
                    shared.count_refusal(error.kind());
                    shared.fixed.meter.refused(&error);
                    trace_refusal(&error, &tower_limits_core::TenantKey::global());
                    return ResponseFuture::refused(Box::new(error), self.refusal.clone(), self.extract.usage.clone());
                }
            },
        };
        let cost = self.extract.cost.cost(&req);
        let band = self.extract.keys.band(&req);
        match shared.arrive(&key, band, cost) {
            Arrival::Admitted(grant, weight) => {
                self.extract.annotate.annotate(&mut req, &grant);
                let held = Held::new(shared.clone(), key, grant, cost, weight);
                ResponseFuture::called(self.inner.call(req), held, self.refusal.clone(), self.extract.usage.clone())
            }
            Arrival::Queued(ticket) => {
                tracing::trace!(target: "tower_limits", tenant = %key, cost, "queued for a fair turn");
                // The service polled ready goes with the request; the clone stays.
                let clone = self.inner.clone();
                let inner = std::mem::replace(&mut self.inner, clone);
                let waiter = Waiter::new(shared.clone(), ticket, key);
                let annotate = self.extract.annotate.clone();
                ResponseFuture::waiting(
                    Waiting { waiter, inner: Some(inner), req: Some(req), annotate },
                    self.refusal.clone(),
                    self.extract.usage.clone(),
                )
            }
            Arrival::Refused(error) => {
                shared.fixed.meter.refused(&error);
                trace_refusal(&error, &key);
                ResponseFuture::refused(error, self.refusal.clone(), self.extract.usage.clone())
            }
        }
    }
}
