//! HTTP answers: status codes, `Retry-After`, the IETF `RateLimit` fields and the
//! `x-ratelimit-*` family.
//!
//! | refusal | status |
//! |---|---|
//! | every rate limit, global or keyed; a tenant's own concurrency limit, its own queue, a wait that timed out on them | `429 Too Many Requests` |
//! | the server's own capacity: a global semaphore, the shared queue (full or waited on too long), a full key table, an unavailable backend | `503 Service Unavailable` |
//! | a cost above a limit's capacity (it can never pass) | `413 Content Too Large` |
//! | no tenant key | `401 Unauthorized` |
//! | a key source the server never provides (see [`ErrorKind::KeySourceMissing`]) | `500 Internal Server Error` |
//!
//! `Retry-After` is in whole seconds, rounded up, and never `0` for a non-zero wait;
//! `retry-after-ms` carries the same wait in milliseconds, rounded up. The
//! `RateLimit-Policy` and `RateLimit` fields follow draft-ietf-httpapi-ratelimit-headers
//! (-10): one list member per limit, a string naming it, with `q` (quota), `w` (window
//! in seconds), `r` (remaining) and `t` (seconds until reset); `qu="concurrent-requests"`
//! marks a concurrency limit. The `x-ratelimit-limit-requests` / `-tokens`,
//! `x-ratelimit-remaining-*` and `x-ratelimit-reset-*` fields that OpenAI clients read
//! are opt-in. The quota fields state the plan (6,000 per minute, not its burst), the
//! state fields what is left of it now; a refusal that stands for no limit's state writes
//! no such field (the guide's page on answers maps each algorithm onto them).
//! [`write_retry_after`] gives a service's own refusals the same two wait fields.
//!
//! [`HttpAnswer`] makes a layer answer refused requests itself, for any response body
//! that can be built empty (`B: Default`), with default features off too, and hold what
//! an admitted request took until its body ends. [`error_response`] answers the same way
//! from an error handler, for layers that return their refusals as errors.
//!
//! ```
//! use std::time::Duration;
//! use tower::{ServiceBuilder, ServiceExt};
//! use tower_limits::http::HttpAnswer;
//! use tower_limits::{GcraLayer, Quota, nz};
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! let layer = GcraLayer::new(Quota::per_second(nz!(1))).refuse_with(HttpAnswer::new());
//! # let _: axum::Router = axum::Router::new().layer(layer.clone()); // it goes on a Router as it is
//! let svc = ServiceBuilder::new().layer(layer).service_fn(|_req: http::Request<String>| async {
//!     Ok::<_, std::convert::Infallible>(http::Response::new(String::from("hello")))
//! });
//! let first = svc.clone().oneshot(http::Request::new(String::new())).await.unwrap();
//! assert_eq!(first.status(), 200);
//! let second = svc.oneshot(http::Request::new(String::new())).await.unwrap();
//! assert_eq!(second.status(), 429); // every rate limit paces its callers
//! assert_eq!(second.headers()["retry-after"], "1");
//! # }
//! ```
//!
//! Every status can be chosen otherwise with [`HttpAnswer::with_status`].

use std::fmt::Write as _;
use std::marker::PhantomData;
use std::time::Duration;

use http::header::{CONTENT_TYPE, HeaderName, HeaderValue, RETRY_AFTER};
use http::{HeaderMap, Response, StatusCode};
use http_body::Body;
use tower_limits_core::{Counts, LimitSnapshot};

use crate::error::{ErrorKind, LimitError};
use crate::refusal::{Hold, RefusalMode};
use crate::shell::body::{BodyUsage, HeldBody, HoldsBody, NoBodyUsage};

mod fields;
mod openai;
mod upstream;

pub use fields::{go_duration, write_openai_fields, write_ratelimit_fields};
use fields::{policy_value, scratch_value, write_state_member};
pub use upstream::{parse_go_duration, upstream_report, upstream_report_at};

/// `RateLimit-Policy`.
pub const RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
/// `RateLimit`.
pub const RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");
/// `retry-after-ms`: the wait in milliseconds, rounded up, which OpenAI's SDKs read
/// before `Retry-After`.
pub const RETRY_AFTER_MS: HeaderName = HeaderName::from_static("retry-after-ms");

impl LimitError {
    /// The status this refusal answers with (see the [module docs](crate::http)).
    #[must_use]
    pub fn status(&self) -> StatusCode {
        match self.kind() {
            ErrorKind::MissingKey => StatusCode::UNAUTHORIZED,
            ErrorKind::KeySourceMissing => StatusCode::INTERNAL_SERVER_ERROR,
            ErrorKind::CostAboveCapacity => StatusCode::PAYLOAD_TOO_LARGE,
            _ if self.is_shared() => StatusCode::SERVICE_UNAVAILABLE,
            _ => StatusCode::TOO_MANY_REQUESTS,
        }
    }

    /// Writes `Retry-After` and the `RateLimit` fields of this refusal into `headers`.
    pub fn write_headers(&self, headers: &mut HeaderMap) {
        if let Some(wait) = self.retry_after() {
            write_retry_after(headers, wait);
        }
        // A snapshot without a quota stands for no limit's state (every upstream benched):
        // no field may claim one.
        if let (Some(name), Some(snapshot)) = (self.limit, self.snapshot().filter(|s| s.quota > 0)) {
            let is_semaphore = matches!(self.kind(), ErrorKind::ConcurrencyLimited) && snapshot.window.is_zero();
            if let Some(v) = policy_value(std::iter::once((name, &snapshot, is_semaphore))) {
                headers.insert(RATELIMIT_POLICY, v);
            }
            if let Some(v) = scratch_value(|out| write_state_member(out, name, &snapshot)) {
                headers.insert(RATELIMIT, v);
            }
        }
    }

    /// An empty-bodied response for this refusal, with its status and headers.
    #[must_use]
    pub fn to_response<B: Default>(&self) -> Response<B> {
        let mut response = Response::new(B::default());
        *response.status_mut() = self.status();
        self.write_headers(response.headers_mut());
        response
    }

    /// A JSON problem document (RFC 9457) naming the refusal, its limit and tier.
    #[must_use]
    pub fn problem_json(&self) -> String {
        let status = self.status();
        let mut out = String::from("{");
        let _ = write!(out, "\"type\":\"about:blank\",\"status\":{}", status.as_u16());
        let _ = write!(out, ",\"title\":{}", json_string(status.canonical_reason().unwrap_or("Error")));
        let _ = write!(out, ",\"detail\":{}", json_string(&self.to_string()));
        let _ = write!(out, ",\"kind\":{}", json_string(kind_name(self.kind())));
        if let Some(limit) = self.limit() {
            let _ = write!(out, ",\"limit\":{}", json_string(limit));
        }
        if let Some(tier) = self.tier() {
            let _ = write!(out, ",\"tier\":{}", json_string(tier));
        }
        if let Some(wait) = self.retry_after() {
            let _ = write!(out, ",\"retry_after_ms\":{}", whole_millis(wait));
        }
        out.push('}');
        out
    }
}

impl LimitError {
    /// What the limit that refused counts, when the refusal carries every limit's state.
    fn counts(&self) -> Option<Counts> {
        let name = self.limit?;
        self.snapshots()?.iter().find(|l| l.name == name).map(|l| l.counts)
    }

    /// This refusal with `wait` as its retry time when it has none and is one whose wait
    /// nobody can know (see [`HttpAnswer::with_unknown_wait`]).
    fn suggest_wait(&mut self, wait: Duration) {
        let waits = matches!(
            self.kind(),
            ErrorKind::ConcurrencyLimited
                | ErrorKind::TenantQueueFull
                | ErrorKind::QueueFull
                | ErrorKind::WaitTimedOut
                | ErrorKind::KeyTableFull
                | ErrorKind::Unavailable
        );
        if waits && self.retry_after.is_none() {
            self.retry_after = Some(wait);
        }
    }
}

/// Writes `Retry-After` (whole seconds, rounded up) and `retry-after-ms` (milliseconds,
/// rounded up) for `wait`: what a service's own refusals (an upstream that is benched, a
/// store that is down) need to say, in the same form as the layers' refusals.
///
/// ```
/// use std::time::Duration;
/// use tower_limits::http::write_retry_after;
///
/// let mut headers = http::HeaderMap::new();
/// write_retry_after(&mut headers, Duration::from_millis(1_250));
/// assert_eq!(headers["retry-after"], "2");
/// assert_eq!(headers["retry-after-ms"], "1250");
/// ```
pub fn write_retry_after(headers: &mut HeaderMap, wait: Duration) {
    headers.insert(RETRY_AFTER, HeaderValue::from(whole_seconds(wait)));
    headers.insert(RETRY_AFTER_MS, HeaderValue::from(u64::try_from(whole_millis(wait)).unwrap_or(u64::MAX)));
}

/// The snake-case name of a kind, as in JSON bodies.
#[must_use]
pub fn kind_name(kind: ErrorKind) -> &'static str {
    match kind {
        ErrorKind::RateLimited => "rate_limited",
        ErrorKind::ConcurrencyLimited => "concurrency_limited",
        ErrorKind::TenantQueueFull => "tenant_queue_full",
        ErrorKind::QueueFull => "queue_full",
        ErrorKind::WaitTimedOut => "wait_timed_out",
        ErrorKind::CostAboveCapacity => "cost_above_capacity",
        ErrorKind::MissingKey => "missing_key",
        ErrorKind::KeySourceMissing => "key_source_missing",
        ErrorKind::KeyTableFull => "key_table_full",
        ErrorKind::Unavailable => "unavailable",
    }
}

/// `wait` and a uniformly random part of up to `percent` of it more, in whole
/// milliseconds (rounded up, as `retry-after-ms` says it, so that the body's message and
/// the fields agree).
fn spread(wait: Duration, percent: u16) -> Duration {
    let most = wait.saturating_mul(u32::from(percent)) / 100;
    let nanos = u64::try_from(most.as_nanos()).unwrap_or(u64::MAX);
    let spread = wait.saturating_add(Duration::from_nanos(fastrand::u64(0..=nanos)));
    Duration::from_millis(u64::try_from(whole_millis(spread)).unwrap_or(u64::MAX))
}

/// Whole milliseconds, rounded up: a client that waits exactly this long is not early.
#[must_use]
pub fn whole_millis(d: Duration) -> u128 {
    d.as_nanos().div_ceil(1_000_000)
}

/// Whole seconds, rounded up: `Retry-After` never says `0` for a non-zero wait.
#[must_use]
pub fn whole_seconds(d: Duration) -> u64 {
    d.as_secs() + u64::from(d.subsec_nanos() > 0)
}

fn json_string(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 2);
    out.push('"');
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// Bodies of refusal responses of type `B`: empty, or a JSON problem document.
pub trait AnswerBody<B>: Clone + Send + Sync + 'static {
    /// The body answering `error`.
    fn body(error: &LimitError) -> B;
    /// Its content type, if any.
    fn content_type() -> Option<HeaderValue>;
}

/// Refusals answer with an empty body (any `B: Default`).
#[derive(Debug, Clone, Copy, Default)]
pub struct EmptyBody;

/// Refusals answer with a JSON problem document (the body type must be `From<String>`).
#[derive(Debug, Clone, Copy, Default)]
pub struct JsonBody;

/// Refusals answer with OpenAI's error object (the body type must be `From<String>`):
/// see [`LimitError::openai_json`].
#[derive(Debug, Clone, Copy, Default)]
pub struct OpenAiBody;

impl<B: From<String>> AnswerBody<B> for OpenAiBody {
    fn body(error: &LimitError) -> B {
        B::from(error.openai_json())
    }

    fn content_type() -> Option<HeaderValue> {
        Some(HeaderValue::from_static("application/json"))
    }
}

impl<B: Default> AnswerBody<B> for EmptyBody {
    fn body(_error: &LimitError) -> B {
        B::default()
    }

    fn content_type() -> Option<HeaderValue> {
        None
    }
}

impl<B: From<String>> AnswerBody<B> for JsonBody {
    fn body(error: &LimitError) -> B {
        B::from(error.problem_json())
    }

    fn content_type() -> Option<HeaderValue> {
        Some(HeaderValue::from_static("application/problem+json"))
    }
}

/// Refused HTTP requests are answered by the layer itself: `429` or `503` with
/// `Retry-After` and the `RateLimit` fields (see the [module docs](crate::http)), and
/// admitted ones hold what they took until their response body ends (see
/// [`shell::body`](crate::shell::body)): a concurrency limit bounds the streams in flight,
/// not only the heads. The layer's response body is then a
/// [`HeldBody`] around the inner one; `O` reads the real
/// usage from it ([`usage_from_body`](Self::usage_from_body)). A refusal's answer carries
/// its [`LimitError`] in the response's extensions, for the layers outside to count or
/// log (by [`LimitError::openai_code`], say) without reading the body.
///
/// ```
/// use axum::{Router, routing::get};
/// use tower_limits::http::HttpAnswer;
/// use tower_limits::{SemaphoreLayer, nz};
///
/// let app: Router = Router::new()
///     .route("/", get(|| async { "hello" }))
///     .layer(SemaphoreLayer::new(nz!(64)).refuse_with(HttpAnswer::new()));
/// # drop(app);
/// ```
#[derive(Debug, Clone, Copy)]
#[must_use]
pub struct HttpAnswer<J = EmptyBody, O = NoBodyUsage> {
    how: Answering,
    observer: O,
    _body: PhantomData<J>,
}

/// What an [`HttpAnswer`] says and when it gives back what a request holds, whatever
/// its body kinds.
#[derive(Debug, Clone, Copy)]
struct Answering {
    openai: bool,
    on_success: bool,
    all_limits: bool,
    /// Whether the limits' state may be stated at all (`RateLimit`, `x-ratelimit-*`).
    limit_fields: bool,
    status: fn(&LimitError) -> StatusCode,
    /// The wait suggested for refusals whose wait nobody can know.
    unknown_wait: Option<Duration>,
    /// The `WWW-Authenticate` challenge of a `401`.
    challenge: Option<&'static str>,
    /// Whether what a request holds is given back when its response's head is ready,
    /// rather than when its body ends.
    release_at_head: bool,
    /// How much later than the wait a refusal may suggest, in percent of the wait.
    spread_percent: u16,
}

impl HttpAnswer {
    /// Empty-bodied refusals with `Retry-After` and `RateLimit` fields for the limit that
    /// refused; admitted requests hold what they took until their body ends.
    pub const fn new() -> Self {
        let how = Answering {
            openai: false,
            on_success: false,
            all_limits: false,
            limit_fields: true,
            status: LimitError::status,
            unknown_wait: Some(Duration::from_secs(1)),
            challenge: Some("Bearer"),
            release_at_head: false,
            spread_percent: 0,
        };
        HttpAnswer { how, observer: NoBodyUsage, _body: PhantomData }
    }
}

impl Default for HttpAnswer {
    fn default() -> Self {
        Self::new()
    }
}

impl<J, O> HttpAnswer<J, O> {
    /// Gives back what a request holds as soon as its response's head is ready, instead
    /// of when its body ends: for services whose responses are whole once their head is
    /// (no streaming), where the body's end comes as good as at once anyway. The body
    /// type stays a [`HeldBody`], holding nothing.
    ///
    /// ```
    /// use tower_limits::http::HttpAnswer;
    ///
    /// let answer = HttpAnswer::new().release_at_head();
    /// # drop(answer);
    /// ```
    pub fn release_at_head(self) -> Self {
        HttpAnswer { how: Answering { release_at_head: true, ..self.how }, ..self }
    }

    /// Settles each request to the usage its response body reports as it streams by (for
    /// example [`OpenAiStreamUsage`](crate::shell::body::OpenAiStreamUsage)); a body that
    /// ends without one keeps the usage read from the head, or the estimate. Holds the
    /// body, whatever [`release_at_head`](Self::release_at_head) said.
    ///
    /// ```
    /// use tower_limits::http::HttpAnswer;
    /// use tower_limits::shell::body::OpenAiStreamUsage;
    ///
    /// let answer = HttpAnswer::new().with_openai_body().usage_from_body(OpenAiStreamUsage::default());
    /// # drop(answer);
    /// ```
    pub fn usage_from_body<O2: BodyUsage>(self, observer: O2) -> HttpAnswer<J, O2> {
        HttpAnswer { how: Answering { release_at_head: false, ..self.how }, observer, _body: PhantomData }
    }
}

impl<J, O> HoldsBody for HttpAnswer<J, O> {
    type Held = Self;
    type WithUsage<O2: BodyUsage> = HttpAnswer<J, O2>;

    fn hold_body(self) -> Self {
        HttpAnswer { how: Answering { release_at_head: false, ..self.how }, ..self }
    }

    fn usage_from_body<O2: BodyUsage>(self, observer: O2) -> HttpAnswer<J, O2> {
        HttpAnswer::usage_from_body(self, observer)
    }
}

impl<J, O> HttpAnswer<J, O> {
    /// Chooses the status of each refusal (the default is [`LimitError::status`]).
    ///
    /// ```
    /// use http::StatusCode;
    /// use tower_limits::http::HttpAnswer;
    /// use tower_limits::{ErrorKind, LimitError};
    ///
    /// // This API's clients expect 503 for every refusal but a missing key.
    /// let answer = HttpAnswer::new().with_status(|e: &LimitError| match e.kind() {
    ///     ErrorKind::MissingKey => StatusCode::UNAUTHORIZED,
    ///     _ => StatusCode::SERVICE_UNAVAILABLE,
    /// });
    /// # drop(answer);
    /// ```
    pub fn with_status(self, status: fn(&LimitError) -> StatusCode) -> Self {
        HttpAnswer { how: Answering { status, ..self.how }, ..self }
    }

    /// Also the `x-ratelimit-*` fields OpenAI clients read (implies every limit's state).
    pub fn with_openai_fields(self) -> Self {
        HttpAnswer { how: Answering { openai: true, all_limits: true, ..self.how }, ..self }
    }

    /// `RateLimit` fields for every limit of the set, not only the one that refused.
    pub fn with_all_limits(self) -> Self {
        HttpAnswer { how: Answering { all_limits: true, ..self.how }, ..self }
    }

    /// The fields on successful responses too (the states are read with the decision, in the same pass).
    pub fn on_success(self) -> Self {
        HttpAnswer { how: Answering { on_success: true, all_limits: true, ..self.how }, ..self }
    }

    /// Refusals carry OpenAI's error object (`{"error": {"message", "type", "param",
    /// "code"}}`), which OpenAI's SDKs show and retry on: for gateways in front of
    /// OpenAI-compatible APIs.
    pub fn with_openai_body(self) -> HttpAnswer<OpenAiBody, O> {
        self.with_body()
    }

    /// Refusals carry a JSON problem document naming the limit and tier.
    pub fn with_json_body(self) -> HttpAnswer<JsonBody, O> {
        self.with_body()
    }

    /// The same answer with refusal bodies of kind `J2`.
    fn with_body<J2>(self) -> HttpAnswer<J2, O> {
        HttpAnswer { how: self.how, observer: self.observer, _body: PhantomData }
    }

    /// The wait that `Retry-After` and `retry-after-ms` suggest for refusals whose wait
    /// cannot be known (a full concurrency limit or queue, a backend that is down, a full
    /// key table): `None` leaves them without. One second by default, so that clients
    /// that retry on `Retry-After` (OpenAI's SDKs among them) back off instead of
    /// hammering. Refusals that can never pass (a missing key, a cost above capacity)
    /// carry no wait either way.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_limits::http::HttpAnswer;
    ///
    /// let answer = HttpAnswer::new().with_unknown_wait(Some(Duration::from_millis(250)));
    /// # drop(answer);
    /// ```
    pub fn with_unknown_wait(self, wait: Option<Duration>) -> Self {
        HttpAnswer { how: Answering { unknown_wait: wait, ..self.how }, ..self }
    }

    /// Spreads the waits that refusals suggest: each says its wait plus a random part of
    /// up to `percent` of it, drawn afresh for every refusal. Clients refused at the same
    /// moment (many callers of one rate limit, retrying exactly when told, as OpenAI's
    /// SDKs do with `retry-after-ms`) then come back spread over that span instead of
    /// together, where all but the first would be refused again. Never earlier than the
    /// wait: a client that follows the suggestion is not early. Concurrency refusals are
    /// not spread: they are told their places in a queue already (see the guide's HTTP
    /// page). `0` (the default) says the exact wait; `percent` above 1000 counts as 1000.
    ///
    /// ```
    /// use tower_limits::http::HttpAnswer;
    /// use tower_limits::{GcraLayer, Quota, nz};
    ///
    /// // A refusal that must wait 500 ms suggests between 500 and 625 ms.
    /// let layer = GcraLayer::new(Quota::per_second(nz!(2))).refuse_with(HttpAnswer::new().spread_retries(25));
    /// # drop(layer);
    /// ```
    pub fn spread_retries(self, percent: u16) -> Self {
        HttpAnswer { how: Answering { spread_percent: percent.min(1000), ..self.how }, ..self }
    }

    /// Only `Retry-After` and `retry-after-ms`: no `RateLimit`, `RateLimit-Policy` or
    /// `x-ratelimit-*` field, on refusals or on success, whatever else was asked, and no
    /// quota in the body's message (it still names the limit, its tier and the wait). For
    /// limits whose state is not the one to advertise: a replica's local stand-in while the
    /// shared store is away decides on its own share, which no client's quota is.
    ///
    /// ```
    /// use tower_limits::http::HttpAnswer;
    /// use tower_limits::{LimitSetLayer, LimitSetPolicy, LimitPolicy, Quota, nz};
    ///
    /// // This replica's half of a 240-per-minute plan, while the fleet's store is away.
    /// let half = LimitSetPolicy::new().limit(LimitPolicy::gcra("rpm", Quota::per_minute(nz!(120)).burst(nz!(1))));
    /// let layer = LimitSetLayer::new(half)
    ///     .unwrap()
    ///     .refuse_with(HttpAnswer::new().with_openai_body().on_success().without_limit_fields());
    /// # drop(layer);
    /// ```
    pub fn without_limit_fields(self) -> Self {
        HttpAnswer { how: Answering { limit_fields: false, ..self.how }, ..self }
    }

    /// The `WWW-Authenticate` challenge that a `401` (a request without a tenant key)
    /// carries, as HTTP requires of every `401`: `Bearer` by default, for APIs keyed by a
    /// bearer token; `None` leaves the field out (for a status chosen otherwise with
    /// [`with_status`](Self::with_status)).
    ///
    /// ```
    /// use tower_limits::http::HttpAnswer;
    ///
    /// let answer = HttpAnswer::new().with_challenge(Some("ApiKey realm=\"embeddings\""));
    /// # drop(answer);
    /// ```
    pub fn with_challenge(self, challenge: Option<&'static str>) -> Self {
        HttpAnswer { how: Answering { challenge, ..self.how }, ..self }
    }

    fn headers(&self, headers: &mut HeaderMap, error: &LimitError) {
        if let (ErrorKind::MissingKey, Some(challenge)) = (error.kind(), self.how.challenge) {
            if let Ok(value) = HeaderValue::from_str(challenge) {
                headers.insert(http::header::WWW_AUTHENTICATE, value);
            }
        }
        if !self.how.limit_fields {
            if let Some(wait) = error.retry_after() {
                write_retry_after(headers, wait);
            }
            return;
        }
        error.write_headers(headers);
        if let Some(all) = error.snapshots() {
            if self.how.all_limits {
                write_ratelimit_fields(headers, all);
            }
            if self.how.openai {
                write_openai_fields(headers, all);
            }
        }
    }

    fn success_headers(&self, headers: &mut HeaderMap, snapshots: Option<&[LimitSnapshot]>) {
        if let (true, true, Some(all)) = (self.how.limit_fields, self.how.on_success, snapshots) {
            write_ratelimit_fields(headers, all);
            if self.how.openai {
                write_openai_fields(headers, all);
            }
        }
    }
}

impl<B, E, J, O> RefusalMode<Response<B>, E> for HttpAnswer<J, O>
where
    B: Body + Send + 'static,
    J: AnswerBody<B>,
    O: BodyUsage,
{
    type Response = Response<HeldBody<B, O>>;
    type Error = E;

    fn refuse(&self, mut error: Box<LimitError>) -> Result<Self::Response, E> {
        if let Some(wait) = self.how.unknown_wait {
            // The body and the fields say the same wait.
            error.suggest_wait(wait);
        }
        // A concurrency refusal is told its place already: spread, places would overlap.
        let spreads = self.how.spread_percent > 0 && error.kind() != ErrorKind::ConcurrencyLimited;
        if let Some(wait) = error.retry_after.filter(|_| spreads) {
            error.retry_after = Some(spread(wait, self.how.spread_percent));
        }
        if !self.how.limit_fields {
            // Nor does the body state the limits.
            error.snapshot = None;
            error.snapshots = None;
        }
        let mut response = Response::new(HeldBody::free(J::body(&error), self.observer.clone()));
        *response.status_mut() = (self.how.status)(&error);
        if let Some(content_type) = J::content_type() {
            response.headers_mut().insert(CONTENT_TYPE, content_type);
        }
        self.headers(response.headers_mut(), &error);
        // For the layers outside: what the answer says, to count or log.
        response.extensions_mut().insert(*error);
        Ok(response)
    }

    fn respond(&self, mut response: Response<B>, snapshots: Option<&[LimitSnapshot]>) -> Self::Response {
        self.success_headers(response.headers_mut(), snapshots);
        let observer = self.observer.clone();
        response.map(|body| HeldBody::free(body, observer))
    }

    fn respond_held(
        &self,
        mut response: Response<B>,
        snapshots: Option<&[LimitSnapshot]>,
        hold: Hold,
    ) -> Self::Response {
        if self.how.release_at_head || response.body().is_end_stream() {
            hold.finish();
            return <Self as RefusalMode<Response<B>, E>>::respond(self, response, snapshots);
        }
        self.success_headers(response.headers_mut(), snapshots);
        let observer = self.observer.clone();
        response.map(|body| HeldBody::holding(body, hold, observer))
    }

    fn fail(&self, error: E) -> E {
        error
    }

    fn wants_snapshots(&self) -> bool {
        self.how.all_limits && self.how.limit_fields
    }

    fn holds_body(&self) -> bool {
        !self.how.release_at_head
    }

    fn reads_body_usage(&self) -> bool {
        O::REPORTS && !self.how.release_at_head
    }
}

/// The answer to an error of a layer stack, for axum's `HandleErrorLayer` (or any error
/// handler): a refusal of a limit layer answers as an [`HttpAnswer`] would (its status,
/// `Retry-After`, the `RateLimit` fields of the limit that refused, a missing key's
/// `401` with `WWW-Authenticate: Bearer`, and its message as plain text); any other
/// error is `500 Internal Server Error`, logged at error level with its message, which
/// the client does not see. A one-line way to put a layer that returns its refusals as
/// errors on an axum `Router`.
///
/// ```
/// use axum::error_handling::HandleErrorLayer;
/// use axum::{Router, routing::get};
/// use tower::{ServiceBuilder, ServiceExt};
/// use tower_limits::{GcraLayer, Quota, nz};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let app: Router = Router::new().route("/", get(|| async { "hello" })).layer(
///     ServiceBuilder::new()
///         .layer(HandleErrorLayer::new(tower_limits::http::error_response))
///         .layer(GcraLayer::new(Quota::per_minute(nz!(1)))),
/// );
/// let request = || http::Request::new(axum::body::Body::empty());
/// assert_eq!(app.clone().oneshot(request()).await.unwrap().status(), 200);
/// let refused = app.oneshot(request()).await.unwrap();
/// assert_eq!(refused.status(), 429);
/// assert_eq!(refused.headers()["retry-after"], "60");
/// # }
/// ```
pub async fn error_response(error: crate::BoxError) -> Response<String> {
    let mut response = Response::new(String::new());
    match error.downcast_ref::<LimitError>() {
        Some(refusal) => {
            *response.status_mut() = refusal.status();
            // The same headers as the default answer, the challenge of a 401 included.
            HttpAnswer::new().headers(response.headers_mut(), refusal);
            let mut text = refusal.to_string();
            if let Some(detail) = refusal.detail().filter(|_| refusal.kind() == ErrorKind::KeySourceMissing) {
                // The server's own setup: say what to fix.
                text = format!("{text}: {detail}");
            }
            *response.body_mut() = text;
        }
        None => {
            tracing::error!(target: "tower_limits", error = %error, "a service behind a limit layer failed");
            *response.status_mut() = StatusCode::INTERNAL_SERVER_ERROR;
            *response.body_mut() = String::from("internal server error");
        }
    }
    response.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("text/plain; charset=utf-8"));
    response
}

#[cfg(test)]
mod tests {
    use tower_limits_core::Snapshot;

    use super::*;

    #[test]
    fn a_store_that_cannot_answer_has_one_openai_code() {
        let down = LimitError::new(ErrorKind::Unavailable).openai_json();
        assert!(down.contains(r#""type":"server_error""#), "{down}");
        assert!(down.contains(r#""code":"limits_unavailable""#), "{down}");
    }

    #[test]
    fn retry_after_rounds_up() {
        assert_eq!(whole_seconds(Duration::from_millis(1)), 1);
        assert_eq!(whole_seconds(Duration::from_secs(2)), 2);
        assert_eq!(whole_seconds(Duration::from_millis(2001)), 3);
        assert_eq!(whole_seconds(Duration::ZERO), 0);
        assert_eq!(whole_millis(Duration::from_nanos(1)), 1);
        assert_eq!(whole_millis(Duration::from_micros(2_000)), 2);
        assert_eq!(whole_millis(Duration::from_micros(2_001)), 3);
    }

    #[test]
    fn a_state_that_could_not_be_read_writes_no_fields() {
        // Every upstream benched: a wait, but no limit's state behind it.
        let stateless = Snapshot { quota: 0, remaining: 0, reset: Duration::from_secs(2), window: Duration::ZERO };
        let error = LimitError {
            limit: Some("upstream"),
            retry_after: Some(Duration::from_millis(1_500)),
            snapshot: Some(stateless),
            ..LimitError::new(ErrorKind::RateLimited)
        };
        let mut headers = HeaderMap::new();
        error.write_headers(&mut headers);
        assert_eq!(headers["retry-after"], "2");
        assert_eq!(headers["retry-after-ms"], "1500");
        assert!(!headers.contains_key(RATELIMIT) && !headers.contains_key(RATELIMIT_POLICY), "{headers:?}");
        assert!(error.openai_json().contains("Rate limit reached for upstream. Please try again in 1.500s."));
        let snapshot = LimitSnapshot {
            name: "upstream",
            tier: None,
            counts: Counts::Requests,
            is_semaphore: false,
            snapshot: stateless,
        };
        let mut headers = HeaderMap::new();
        write_ratelimit_fields(&mut headers, std::slice::from_ref(&snapshot));
        write_openai_fields(&mut headers, &[snapshot]);
        assert!(headers.is_empty(), "{headers:?}");
    }

    #[test]
    fn openai_fields_report_what_can_be_sent_now() {
        let limit = |name, quota, remaining| LimitSnapshot {
            name,
            tier: None,
            counts: Counts::Requests,
            is_semaphore: false,
            snapshot: Snapshot { quota, remaining, reset: Duration::from_secs(1), window: Duration::from_secs(60) },
        };
        // An org's 6,000 a minute, untouched (its burst of 600 left), and a user's 60 a
        // minute with 59 left: the client may send 59 now, whatever the shares of the plans.
        let mut headers = HeaderMap::new();
        write_openai_fields(&mut headers, &[limit("org", 6_000, 600), limit("user", 60, 59)]);
        assert_eq!(headers["x-ratelimit-remaining-requests"], "59");
        assert_eq!(headers["x-ratelimit-limit-requests"], "60");
    }

    #[test]
    fn structured_strings_are_escaped() {
        assert_eq!(json_string("a\"\n"), "\"a\\\"\\n\"");
    }
}
