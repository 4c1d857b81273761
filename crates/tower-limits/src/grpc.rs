//! gRPC answers: a refusal as `RESOURCE_EXHAUSTED` (or `UNAVAILABLE` for the server's own
//! capacity), with the retry delay in the `grpc-retry-pushback-ms` metadata, which gRPC
//! clients with a retry policy honour (gRPC's retry design, A6), and in the message.

use crate::error::{ErrorKind, LimitError};

/// The metadata key of gRPC's retry pushback: the delay, in milliseconds, before a
/// client may retry.
pub const GRPC_RETRY_PUSHBACK_MS: &str = "grpc-retry-pushback-ms";

impl LimitError {
    /// The gRPC status for this refusal: `RESOURCE_EXHAUSTED` for every rate limit and a
    /// tenant's own limits, `UNAVAILABLE` for the server's own capacity (see
    /// [`LimitError::is_shared`]), `UNAUTHENTICATED` without a key,
    /// `INVALID_ARGUMENT` for a cost that can never pass, `INTERNAL` for a key the server
    /// never provides. The retry delay, when known, is in the `grpc-retry-pushback-ms`
    /// metadata (milliseconds, rounded up), where gRPC clients with a retry policy read it.
    ///
    /// ```
    /// use tower_limits::{Instant, LimitError, LimitSet, Quota, TenantKey, nz};
    ///
    /// let set = LimitSet::gcra(Quota::per_second(nz!(2)));
    /// let global = TenantKey::global();
    /// let _first = set.acquire(&global, 2, Instant::ZERO).unwrap();
    /// let refused = LimitError::from(set.acquire(&global, 1, Instant::ZERO).unwrap_err());
    /// let status = refused.to_grpc_status();
    /// assert_eq!(status.code(), tonic::Code::ResourceExhausted);
    /// assert_eq!(status.metadata().get("grpc-retry-pushback-ms").unwrap(), "500");
    /// ```
    #[must_use]
    pub fn to_grpc_status(&self) -> tonic::Status {
        let code = match self.kind() {
            ErrorKind::MissingKey => tonic::Code::Unauthenticated,
            ErrorKind::KeySourceMissing => tonic::Code::Internal,
            ErrorKind::CostAboveCapacity => tonic::Code::InvalidArgument,
            _ if self.is_shared() => tonic::Code::Unavailable,
            _ => tonic::Code::ResourceExhausted,
        };
        let mut status = tonic::Status::new(code, self.to_string());
        if let Some(wait) = self.retry_after() {
            if let Ok(v) = crate::http::whole_millis(wait).to_string().parse() {
                status.metadata_mut().insert(GRPC_RETRY_PUSHBACK_MS, v);
            }
        }
        status
    }
}

impl From<LimitError> for tonic::Status {
    fn from(e: LimitError) -> Self {
        e.to_grpc_status()
    }
}

/// Refused gRPC calls are answered by the layer itself: a trailers-only response with the
/// status of [`LimitError::to_grpc_status`] (`RESOURCE_EXHAUSTED` and the retry delay for a
/// tenant's own limit). For tonic servers: `Server::builder().layer(limits)`. For
/// server-streaming calls, add [`hold_body`](crate::LimitLayer::hold_body): the call then
/// holds what it took until its stream ends.
///
/// ```
/// use tower::{ServiceBuilder, ServiceExt};
/// use tower_limits::{GcraLayer, GrpcAnswer, Quota, nz};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let svc = ServiceBuilder::new()
///     .layer(GcraLayer::new(Quota::per_minute(nz!(1))).refuse_with(GrpcAnswer))
///     .service_fn(|_req: http::Request<tonic::body::Body>| async {
///         Ok::<_, std::convert::Infallible>(http::Response::new(tonic::body::Body::empty()))
///     });
/// let call = || http::Request::new(tonic::body::Body::empty());
/// assert!(svc.clone().oneshot(call()).await.unwrap().headers().get("grpc-status").is_none());
/// let refused = svc.oneshot(call()).await.unwrap();
/// assert_eq!(refused.headers()["grpc-status"], "8"); // RESOURCE_EXHAUSTED
/// assert_eq!(refused.headers()["grpc-retry-pushback-ms"], "60000");
/// # }
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct GrpcAnswer;

impl<B: Default, E> crate::RefusalMode<http::Response<B>, E> for GrpcAnswer {
    type Response = http::Response<B>;
    type Error = E;

    fn refuse(&self, error: Box<LimitError>) -> Result<http::Response<B>, E> {
        Ok(error.to_grpc_status().into_http())
    }

    fn respond(
        &self,
        response: http::Response<B>,
        _snapshots: Option<&[tower_limits_core::LimitSnapshot]>,
    ) -> http::Response<B> {
        response
    }

    fn fail(&self, error: E) -> E {
        error
    }
}
