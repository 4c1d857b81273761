//! gRPC answers: a refusal as `RESOURCE_EXHAUSTED` (or `UNAVAILABLE` for the server's own
//! capacity),
//! with the retry delay in the `retry-after` metadata and the message.

use crate::error::{ErrorKind, LimitError};

impl LimitError {
    /// The gRPC status for this refusal: `RESOURCE_EXHAUSTED` for every rate limit and a
    /// tenant's own limits, `UNAVAILABLE` for the server's own capacity (see
    /// [`LimitError::is_shared`]), `UNAUTHENTICATED` without a key,
    /// `INVALID_ARGUMENT` for a cost that can never pass. The retry delay, when known,
    /// is in the `retry-after` metadata (whole seconds) and `retry-after-ms`.
    #[must_use]
    pub fn to_grpc_status(&self) -> tonic::Status {
        let code = match self.kind() {
            ErrorKind::MissingKey => tonic::Code::Unauthenticated,
            ErrorKind::CostAboveCapacity => tonic::Code::InvalidArgument,
            _ if self.is_shared() => tonic::Code::Unavailable,
            _ => tonic::Code::ResourceExhausted,
        };
        let mut status = tonic::Status::new(code, self.to_string());
        if let Some(wait) = self.retry_after() {
            let md = status.metadata_mut();
            if let Ok(v) = crate::http::whole_seconds(wait).to_string().parse() {
                md.insert("retry-after", v);
            }
            if let Ok(v) = crate::http::whole_millis(wait).to_string().parse() {
                md.insert("retry-after-ms", v);
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
/// tenant's own limit). For tonic servers: `Server::builder().layer(limits)`.
#[derive(Debug, Clone, Copy, Default)]
pub struct GrpcAnswer;

impl<B: Default, E> crate::Rejection<http::Response<B>, E> for GrpcAnswer {
    type Response = http::Response<B>;
    type Error = E;

    fn reject(&self, error: Box<LimitError>) -> Result<http::Response<B>, E> {
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
