//! Receiving a request's body without letting slow senders hold the house.
//!
//! Two bounds, both on before a byte of the body is read:
//!
//! - **Per tenant.** A body being received holds one of its tenant's upload places
//!   (`gateway.uploads_per_tenant`, a semaphore of this library keyed by tenant). When a
//!   tenant's places are all taken, a body that arrives within [`QUICK_BODY`] needs none
//!   (a client's request usually comes whole, in one segment, and a burst of them must
//!   not be refused for it); any other is answered `429`, the rest of its body unread
//!   and the connection closed: one tenant's stalled uploads cost that tenant, not the
//!   others.
//! - **Per body, a pace.** The body must average `gateway.body_min_rate` bytes a second,
//!   and may fall behind that pace by `gateway.body_grace` at most: after `n` bytes the
//!   next ones must come by `start + body_grace + n / body_min_rate`. A body that stops
//!   is cut after the grace, whatever its announced length, rather than after
//!   `body_timeout`, which still bounds the whole. Either is a `408`.
//!
//! The server adds the third bound, for when connections run short: a connection whose
//! body has made no progress for a while is the first to give way to a new client (see
//! [`crate::server`]).

use std::time::Duration;

use axum::body::{Body, Bytes};
use http::{HeaderValue, Response, StatusCode, header};
use http_body_util::BodyExt;
use tower_limits::core::OwnedPermit;
use tower_limits::core::policy::format_duration;
use tower_limits::{LimitPolicy, LimitSet, LimitSetPolicy, PolicyError, TenantKey};

use super::BACKEND_DOWN_WAIT;
use crate::api;

/// How long a body may take without an upload place, when its tenant's are all taken.
pub const QUICK_BODY: Duration = Duration::from_millis(50);

/// How bodies are received: the per-tenant places and the pace (see the module docs).
#[derive(Clone)]
pub struct UploadRules {
    places: LimitSet,
    per_tenant: u64,
    origin: tokio::time::Instant,
    /// The largest body read, in bytes (`413` beyond it).
    pub max_bytes: usize,
    /// The whole body's time (`gateway.body_timeout`).
    pub timeout: Duration,
    /// Bytes a second on average; 0 for no pace.
    pub min_rate: u64,
    /// How far behind the pace a body may fall.
    pub grace: Duration,
}

impl std::fmt::Debug for UploadRules {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UploadRules")
            .field("per_tenant", &self.per_tenant)
            .field("max_bytes", &self.max_bytes)
            .field("timeout", &self.timeout)
            .field("min_rate", &self.min_rate)
            .field("grace", &self.grace)
            .finish_non_exhaustive()
    }
}

/// A place taken by a body being received; given back on drop.
#[derive(Debug)]
pub struct UploadPlace(#[allow(dead_code, reason = "held for its drop")] OwnedPermit);

impl UploadRules {
    /// `per_tenant` bodies at once per tenant, each within `max_bytes` and `timeout`, at
    /// `min_rate` bytes a second after `grace`.
    ///
    /// # Errors
    /// `per_tenant` is zero.
    pub fn new(
        per_tenant: u64,
        max_bytes: usize,
        timeout: Duration,
        min_rate: u64,
        grace: Duration,
    ) -> Result<Self, PolicyError> {
        let policy = LimitSetPolicy::new()
            .tiers(["tenant"])
            .limit(LimitPolicy::semaphore("uploads_per_tenant", per_tenant).per("tenant"));
        let places = LimitSet::new(policy)?;
        Ok(UploadRules { places, per_tenant, origin: tokio::time::Instant::now(), max_bytes, timeout, min_rate, grace })
    }

    fn now(&self) -> tower_limits::Instant {
        tower_limits::Instant::from_nanos(u64::try_from(self.origin.elapsed().as_nanos()).unwrap_or(u64::MAX))
    }

    /// A place for one more body of `tenant`, or the `429` that says there is none.
    ///
    /// # Errors
    /// The tenant's places are all taken.
    pub fn place(&self, tenant: &TenantKey) -> Result<UploadPlace, Box<Response<Body>>> {
        match self.places.acquire_owned(tenant, 1, self.now()) {
            Ok(permit) => Ok(UploadPlace(permit)),
            Err(_) => {
                let mut r = api::error_response(
                    StatusCode::TOO_MANY_REQUESTS,
                    "rate_limit_error",
                    "too_many_uploads",
                    &format!(
                        "{} requests of this tenant are already sending their bodies (gateway.uploads_per_tenant); \
                         finish those first",
                        self.per_tenant
                    ),
                );
                tower_limits::http::write_retry_after(r.headers_mut(), BACKEND_DOWN_WAIT);
                // The body was not read: the connection cannot carry another request.
                r.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("close"));
                Err(Box::new(r))
            }
        }
    }

    /// The body of a request that found no upload place (`refused` is the answer that
    /// says so): read if it arrives within [`QUICK_BODY`].
    ///
    /// # Errors
    /// `refused` when the body takes longer; as [`read`](Self::read) otherwise.
    pub async fn read_without_place(
        &self,
        body: Body,
        refused: Box<Response<Body>>,
    ) -> Result<Bytes, Box<Response<Body>>> {
        match tokio::time::timeout(QUICK_BODY, self.read(body)).await {
            Ok(read) => read,
            Err(_) => Err(refused),
        }
    }

    /// The body, read within the bounds, or the answer that says which was broken.
    ///
    /// # Errors
    /// `413` too large, `408` too slow or too long, `400` cut short.
    pub async fn read(&self, mut body: Body) -> Result<Bytes, Box<Response<Body>>> {
        let start = tokio::time::Instant::now();
        let whole = start + self.timeout;
        // A body of one frame (most are) is passed on as it came, without a copy.
        let mut received = Received::default();
        loop {
            let paced = self.pace_deadline(start, received.len());
            let deadline = paced.min(whole);
            let frame = match tokio::time::timeout_at(deadline, body.frame()).await {
                Ok(Some(Ok(frame))) => frame,
                Ok(None) => return Ok(received.into_bytes()),
                Ok(Some(Err(_))) => {
                    return Err(Box::new(closing(api::error_response(
                        StatusCode::BAD_REQUEST,
                        "invalid_request_error",
                        "body_incomplete",
                        "the connection failed before the whole body arrived",
                    ))));
                }
                Err(_) if deadline < whole => return Err(Box::new(closing(self.too_slow(received.len())))),
                Err(_) => {
                    return Err(Box::new(closing(api::error_response(
                        StatusCode::REQUEST_TIMEOUT,
                        "invalid_request_error",
                        "body_timeout",
                        &format!(
                            "the body did not arrive within {} (gateway.body_timeout)",
                            format_duration(self.timeout)
                        ),
                    ))));
                }
            };
            let Ok(data) = frame.into_data() else { continue };
            if received.len() + data.len() > self.max_bytes {
                return Err(Box::new(api::error_response(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    "invalid_request_error",
                    "body_too_large",
                    &format!("the body is larger than {} bytes", self.max_bytes),
                )));
            }
            received.push(data);
        }
    }

    /// When the bytes after the first `received` are due.
    fn pace_deadline(&self, start: tokio::time::Instant, received: usize) -> tokio::time::Instant {
        if self.min_rate == 0 {
            return start + self.timeout;
        }
        let earned = Duration::from_secs_f64(received as f64 / self.min_rate as f64);
        start + self.grace.saturating_add(earned)
    }

    fn too_slow(&self, received: usize) -> Response<Body> {
        api::error_response(
            StatusCode::REQUEST_TIMEOUT,
            "invalid_request_error",
            "body_too_slow",
            &format!(
                "the body fell more than {} behind {} bytes a second after {received} bytes \
                 (gateway.body_min_rate, gateway.body_grace)",
                format_duration(self.grace),
                self.min_rate
            ),
        )
    }
}

/// The bytes of a body so far: its one frame as it came, or the frames copied into one
/// buffer once a second arrives.
#[derive(Default)]
enum Received {
    #[default]
    Nothing,
    One(Bytes),
    Many(Vec<u8>),
}

impl Received {
    fn len(&self) -> usize {
        match self {
            Received::Nothing => 0,
            Received::One(b) => b.len(),
            Received::Many(v) => v.len(),
        }
    }

    fn push(&mut self, data: Bytes) {
        *self = match std::mem::take(self) {
            Received::Nothing => Received::One(data),
            Received::One(first) => {
                let mut all = Vec::with_capacity(first.len() + data.len());
                all.extend_from_slice(&first);
                all.extend_from_slice(&data);
                Received::Many(all)
            }
            Received::Many(mut all) => {
                all.extend_from_slice(&data);
                Received::Many(all)
            }
        };
    }

    fn into_bytes(self) -> Bytes {
        match self {
            Received::Nothing => Bytes::new(),
            Received::One(b) => b,
            Received::Many(v) => Bytes::from(v),
        }
    }
}

/// `response`, closing its connection: the rest of the body may still come.
fn closing(mut response: Response<Body>) -> Response<Body> {
    response.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("close"));
    response
}
