//! gRPC answers: a refusal as `RESOURCE_EXHAUSTED` (or `UNAVAILABLE` for shared overload),
//! with the retry delay in the `retry-after` metadata and the message.

use crate::error::{ErrorKind, LimitError};

impl LimitError {
    /// The gRPC status for this refusal: `RESOURCE_EXHAUSTED` for a tenant's own limit,
    /// `UNAVAILABLE` for shared overload, `UNAUTHENTICATED` without a key,
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
            if let Ok(v) = wait.as_millis().to_string().parse() {
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
