//! How a limit layer's refusals reach the caller.
//!
//! A [`Rejection`] decides the service's response and error types: [`ReturnError`] (the
//! default) passes refusals on as errors, boxed as tower middleware does, for axum's
//! `HandleErrorLayer` or a client's retry logic; [`crate::http::HttpAnswer`] answers
//! HTTP requests itself with `429`/`503` and the `RateLimit` fields.

use tower_limits_core::LimitSnapshot;

use crate::error::{BoxError, LimitError};

/// How refusals, responses and inner errors become the service's outputs.
pub trait Rejection<T, E>: Clone + Send + Sync + 'static {
    /// The service's response.
    type Response;
    /// The service's error.
    type Error;

    /// The answer to a refused request (boxed: refusals are the rare path, and a boxed
    /// error keeps the response future small).
    ///
    /// # Errors
    /// When refusals surface as errors.
    fn reject(&self, error: Box<LimitError>) -> Result<Self::Response, Self::Error>;

    /// A response of the inner service; `snapshots` holds the limits' state when
    /// [`Rejection::wants_snapshots`] asked for it.
    fn respond(&self, response: T, snapshots: Option<&[LimitSnapshot]>) -> Self::Response;

    /// An error of the inner service.
    fn fail(&self, error: E) -> Self::Error;

    /// Whether answers should report every limit's state (costs a peek per request).
    fn wants_snapshots(&self) -> bool {
        false
    }
}

/// Refusals are errors: a [`LimitError`] inside a [`BoxError`], next to the inner
/// service's own errors.
#[derive(Debug, Clone, Copy, Default)]
pub struct ReturnError;

impl<T, E: Into<BoxError>> Rejection<T, E> for ReturnError {
    type Response = T;
    type Error = BoxError;

    #[inline]
    fn reject(&self, error: Box<LimitError>) -> Result<T, BoxError> {
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
