//! What a request's access line reports beyond its status.
//!
//! The layers fill [`AccessInfo`] in on the way out, each with what it knows: the auth
//! layer the tenant, the gateway's stages the tokens, the time queued, the time upstream
//! and the account. The server reads it when it writes the access line. It sits in a
//! module of its own because both the auth layer and the gateway write it, and the
//! gateway is built on the auth layer.

use std::sync::Arc;
use std::time::Duration;

/// What the access log line of a request reports beyond its status: filled in on the
/// way out by the layers that know it.
#[derive(Debug, Clone, Default)]
pub struct AccessInfo {
    /// The tenant, once authenticated.
    pub tenant: Option<Arc<str>>,
    /// The request's tokens: the upstream's count when it answered, the estimate otherwise.
    pub tokens: Option<u64>,
    /// From arrival to the upstream call.
    pub queued: Option<Duration>,
    /// The upstream call.
    pub upstream: Option<Duration>,
    /// The upstream account.
    pub account: Option<Arc<str>>,
}
