//! How a limit layer's refusals reach the caller.
//!
//! A [`RefusalMode`] decides the service's response and error types: [`ReturnError`] (the
//! default) passes refusals on as errors, boxed as tower middleware does, for axum's
//! `HandleErrorLayer` or a client's retry logic; [`crate::http::HttpAnswer`] answers
//! HTTP requests itself with `429`/`503` and the `RateLimit` fields.

use tower_limits_core::LimitSnapshot;

use crate::error::{BoxError, LimitError};

/// How refusals, responses and inner errors become the service's outputs.
pub trait RefusalMode<T, E>: Clone + Send + Sync + 'static {
    /// The service's response.
    type Response;
    /// The service's error.
    type Error;

    /// The answer to a refused request (boxed: refusals are the rare path, and a boxed
    /// error keeps the response future small).
    ///
    /// # Errors
    /// When refusals surface as errors.
    fn refuse(&self, error: Box<LimitError>) -> Result<Self::Response, Self::Error>;

    /// A response of the inner service; `snapshots` holds the limits' state when
    /// [`RefusalMode::wants_snapshots`] asked for it.
    fn respond(&self, response: T, snapshots: Option<&[LimitSnapshot]>) -> Self::Response;

    /// An error of the inner service.
    fn fail(&self, error: E) -> Self::Error;

    /// Whether answers should report every limit's state. They are read with the
    /// decision, in the same pass: see
    /// [`Backend::acquire_observed`](tower_limits_core::Backend::acquire_observed).
    fn wants_snapshots(&self) -> bool {
        false
    }

    /// A response whose request still holds what it acquired: `hold` is given back when
    /// the answer is done with it. By default at once (when the response's head is
    /// ready); [`HoldBody`](crate::shell::body::HoldBody) keeps it in the body until the
    /// body ends.
    fn respond_held(&self, response: T, snapshots: Option<&[LimitSnapshot]>, hold: Hold) -> Self::Response {
        hold.finish();
        self.respond(response, snapshots)
    }

    /// Whether [`RefusalMode::respond_held`] keeps the hold past the response's head.
    fn holds_body(&self) -> bool {
        false
    }

    /// Whether the response body may report the real usage to settle with: an admitted
    /// request then keeps a hold even when nothing else would need one (a rate limit
    /// with nothing to release).
    fn reads_body_usage(&self) -> bool {
        false
    }
}

/// What an admitted request still holds when its response is ready (its concurrency, a
/// fair-queue slot, a lease, an estimate to settle), to give back when the response is
/// done: [`Hold::finish`] settles to the usage found and releases; dropped unfinished, it
/// is given back as for a cancelled request (see the layers' `on_cancel`).
pub struct Hold {
    guard: Box<dyn Finish>,
    /// The real usage, when the response reported one.
    pub(crate) usage: Option<u64>,
}

impl Hold {
    pub(crate) fn new(guard: Box<dyn Finish>, usage: Option<u64>) -> Self {
        Hold { guard, usage }
    }

    /// The response is done: settle to the usage it reported (if any) and release.
    pub fn finish(self) {
        self.guard.done(self.usage);
    }

    /// The response failed (its body yielded an error): as after an inner error.
    pub fn fail(self) {
        self.guard.failed();
    }
}

impl std::fmt::Debug for Hold {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hold").field("usage", &self.usage).finish_non_exhaustive()
    }
}

/// How a guard is given back; dropping it unfinished is a cancellation.
pub(crate) trait Finish: Send + Sync + 'static {
    fn done(self: Box<Self>, usage: Option<u64>);
    fn failed(self: Box<Self>);
}

/// Refusals are errors: a [`LimitError`] inside a [`BoxError`], next to the inner
/// service's own errors.
#[derive(Debug, Clone, Copy, Default)]
pub struct ReturnError;

impl<T, E: Into<BoxError>> RefusalMode<T, E> for ReturnError {
    type Response = T;
    type Error = BoxError;

    #[inline]
    fn refuse(&self, error: Box<LimitError>) -> Result<T, BoxError> {
        Err(error)
    }

    #[inline]
    fn respond(&self, response: T, _snapshots: Option<&[LimitSnapshot]>) -> T {
        response
    }

    #[inline]
    fn fail(&self, error: E) -> BoxError {
        error.into()
    }
}
