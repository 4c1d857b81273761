//! Permits that live as long as the response body.
//!
//! A response's headers are often not the end of the work: a streamed body (server-sent
//! events, a download, an LLM answer token by token) keeps the upstream busy long after
//! the inner service's future resolved. A layer that answers HTTP
//! ([`HttpAnswer`](crate::http::HttpAnswer)) therefore moves what the request holds (its
//! concurrency, its fair-queue slot, a Redis lease, the estimate still to settle) into the
//! response body, a [`HeldBody`], by default; a layer that returns its refusals as errors
//! does so with the verb [`hold_body`](crate::LimitLayer::hold_body) (see [`HoldsBody`]).
//! What is held is given back when the body
//!
//! - ends (the inner body reports its end, or yields its last frame): the permit settles
//!   to the usage the body reported (see [`BodyUsage`]), else to the usage read from the
//!   response's head, else the estimate stands; then it is released;
//! - fails (the inner body yields an error): as after an inner error (`on_error`);
//! - is dropped before its end (the client went away mid-stream): as a cancelled
//!   request (`on_cancel`); concurrency comes back either way.
//!
//! A response that holds nothing, or whose body is already at its end, is passed on
//! without an allocation; one that holds something costs one allocation, for the hold.

use std::fmt;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Buf;
use http::{HeaderMap, Response};
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;
use tower_limits_core::LimitSnapshot;

use crate::error::LimitError;
use crate::refusal::{Hold, RefusalMode};

pin_project! {
    /// A response body that holds what its request acquired until it ends, fails or is
    /// dropped (see the [module docs](self)). Frames pass through unchanged.
    pub struct HeldBody<B, O = NoBodyUsage> {
        #[pin]
        inner: B,
        hold: Option<Hold>,
        observer: O,
    }
}

impl<B, O> HeldBody<B, O> {
    /// A body holding nothing.
    pub fn free(inner: B, observer: O) -> Self {
        HeldBody { inner, hold: None, observer }
    }

    /// A body holding `hold` until it ends.
    pub(crate) fn holding(inner: B, hold: Hold, observer: O) -> Self {
        HeldBody { inner, hold: Some(hold), observer }
    }

    /// The inner body.
    pub fn get_ref(&self) -> &B {
        &self.inner
    }

    /// Whether it still holds something.
    pub fn is_holding(&self) -> bool {
        self.hold.is_some()
    }

    /// The inner body, giving back what it holds as if it had ended.
    pub fn into_inner(mut self) -> B {
        if let Some(hold) = self.hold.take() {
            hold.finish();
        }
        // `HeldBody` has no `Drop` of its own: moving the body out is allowed.
        self.inner
    }
}

impl<B: fmt::Debug, O> fmt::Debug for HeldBody<B, O> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HeldBody").field("inner", &self.inner).field("holding", &self.hold.is_some()).finish()
    }
}

impl<B: Default, O: Default> Default for HeldBody<B, O> {
    fn default() -> Self {
        HeldBody::free(B::default(), O::default())
    }
}

impl<B, O> From<String> for HeldBody<B, O>
where
    B: From<String>,
    O: Default,
{
    fn from(text: String) -> Self {
        HeldBody::free(B::from(text), O::default())
    }
}

impl<B, O> Body for HeldBody<B, O>
where
    B: Body,
    O: BodyUsage,
{
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<B::Data>, B::Error>>> {
        let mut this = self.project();
        let polled = this.inner.as_mut().poll_frame(cx);
        let Some(hold) = this.hold.as_mut() else { return polled };
        match &polled {
            Poll::Pending => return Poll::Pending,
            Poll::Ready(Some(Ok(frame))) => {
                let found = match (frame.data_ref(), frame.trailers_ref()) {
                    (Some(data), _) => this.observer.data(data.chunk()),
                    (None, Some(trailers)) => this.observer.trailers(trailers),
                    (None, None) => None,
                };
                if found.is_some() {
                    hold.usage = found;
                }
            }
            Poll::Ready(Some(Err(_))) => {
                if let Some(hold) = this.hold.take() {
                    hold.fail();
                }
                return polled;
            }
            Poll::Ready(None) => {}
        }
        if matches!(polled, Poll::Ready(None)) || this.inner.is_end_stream() {
            if let Some(hold) = this.hold.take() {
                hold.finish();
            }
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// Reads the real usage from a response body as it streams by, to settle the request's
/// permit with when the body ends. The last usage found wins; a body that ends without
/// one keeps the usage read from the response's head, or else the estimate.
///
/// Each response gets its own copy (`Clone`), so an observer may keep state across
/// frames, such as a partial line.
pub trait BodyUsage: Clone + Send + Sync + 'static {
    /// Whether it can ever report a usage; when not, a request that holds nothing else
    /// keeps no hold for its body.
    const REPORTS: bool = true;

    /// Sees a data frame (its first contiguous chunk: the whole frame for `Bytes`).
    fn data(&mut self, chunk: &[u8]) -> Option<u64> {
        let _ = chunk;
        None
    }

    /// Sees the trailers.
    fn trailers(&mut self, trailers: &HeaderMap) -> Option<u64> {
        let _ = trailers;
        None
    }
}

/// Reads no usage from bodies.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoBodyUsage;

impl BodyUsage for NoBodyUsage {
    const REPORTS: bool = false;
}

/// The usage an OpenAI-compatible stream reports: the `total_tokens` of the final
/// `usage` object that a server-sent-events stream sends when the request asked for it
/// (`"stream_options": {"include_usage": true}`). Data lines are reassembled across
/// frames, each kept to at most 64 KiB (a longer line is skipped); any other line, such
/// as a whole JSON answer, is skipped as it passes, without being copied.
///
/// ```
/// use tower_limits::shell::body::{BodyUsage, OpenAiStreamUsage};
///
/// let mut usage = OpenAiStreamUsage::default();
/// assert_eq!(usage.data(b"data: {\"choices\":[{\"delta\":{\"content\":\"Hi\"}}]}\n\n"), None);
/// assert_eq!(usage.data(b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":9,\"completion_tok"), None);
/// assert_eq!(usage.data(b"ens\":3,\"total_tokens\":12}}\n\ndata: [DONE]\n\n"), Some(12));
///
/// // A line split inside its `data:` is reassembled; other lines count for nothing.
/// assert_eq!(usage.data(b"event: usage\nda"), None);
/// assert_eq!(usage.data(b"ta: {\"usage\":{\"total_tokens\":7}}\n"), Some(7));
/// assert_eq!(usage.data(b"{\"usage\":{\"total_tokens\":5}}\n"), None);
/// ```
#[derive(Debug, Clone, Default)]
pub struct OpenAiStreamUsage {
    line: Vec<u8>,
    skipping: bool,
}

/// What a server-sent event's data line begins with.
const DATA: &[u8] = b"data:";

/// The longest line [`OpenAiStreamUsage`] reassembles.
const MAX_LINE: usize = 64 * 1024;

impl OpenAiStreamUsage {
    fn line_usage(line: &[u8]) -> Option<u64> {
        let data = line.strip_prefix(DATA)?;
        let at = find(data, b"\"usage\"")?;
        let rest = &data[at..];
        let total = find(rest, b"\"total_tokens\"")?;
        let rest = &rest[total + b"\"total_tokens\"".len()..];
        let rest = rest.iter().position(|b| !matches!(b, b' ' | b':')).map(|i| &rest[i..])?;
        let digits = rest.iter().take_while(|b| b.is_ascii_digit()).count();
        std::str::from_utf8(&rest[..digits]).ok()?.parse().ok()
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

impl BodyUsage for OpenAiStreamUsage {
    fn data(&mut self, chunk: &[u8]) -> Option<u64> {
        let mut found = None;
        for piece in chunk.split_inclusive(|b| *b == b'\n') {
            let complete = piece.ends_with(b"\n");
            let piece = piece.strip_suffix(b"\n").unwrap_or(piece);
            // Only a `data:` line carries usage: a line that begins otherwise (a whole
            // JSON answer, an `event:` line) is skipped without being copied.
            let have = self.line.len();
            if !self.skipping && have < DATA.len() {
                let n = (DATA.len() - have).min(piece.len());
                if piece[..n] != DATA[have..have + n] {
                    self.skipping = true;
                    self.line.clear();
                }
            }
            if !self.skipping {
                if self.line.len() + piece.len() > MAX_LINE {
                    self.skipping = true;
                    self.line.clear();
                } else {
                    self.line.extend_from_slice(piece);
                }
            }
            if complete {
                let line = self.line.strip_suffix(b"\r").unwrap_or(&self.line);
                if !self.skipping {
                    if let Some(usage) = Self::line_usage(line) {
                        found = Some(usage);
                    }
                }
                self.line.clear();
                self.skipping = false;
            }
        }
        found
    }
}

/// A [`BodyUsage`] from a closure over each data chunk.
#[derive(Clone)]
pub struct BodyUsageFn<F>(pub F);

impl<F> fmt::Debug for BodyUsageFn<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("BodyUsageFn")
    }
}

impl<F> BodyUsage for BodyUsageFn<F>
where
    F: FnMut(&[u8]) -> Option<u64> + Clone + Send + Sync + 'static,
{
    fn data(&mut self, chunk: &[u8]) -> Option<u64> {
        (self.0)(chunk)
    }
}

/// Refusals and responses as `R` answers them, with the request's permit held by the
/// response body until it ends (see the [module docs](self)); `O` reads the real usage
/// from the body. Made by the layers' [`hold_body`](crate::LimitLayer::hold_body) verb
/// for a layer that returns its refusals as errors (for axum's `HandleErrorLayer`, say);
/// an [`HttpAnswer`](crate::http::HttpAnswer) holds the body itself.
///
/// ```
/// use axum::error_handling::HandleErrorLayer;
/// use axum::{Router, routing::get};
/// use tower::ServiceBuilder;
/// use tower_limits::{SemaphoreLayer, nz};
///
/// // At most 10 streams at once, each holding its slot until its last byte; refusals
/// // are errors, answered by the handler.
/// let app: Router = Router::new().route("/events", get(|| async { "data: [DONE]\n\n" })).layer(
///     ServiceBuilder::new()
///         .layer(HandleErrorLayer::new(tower_limits::http::error_response))
///         .layer(SemaphoreLayer::new(nz!(10)).hold_body()),
/// );
/// # drop(app);
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct HoldBody<R, O = NoBodyUsage> {
    inner: R,
    observer: O,
}

impl<R> HoldBody<R> {
    /// Holds permits in the body, answering as `inner` does.
    pub const fn new(inner: R) -> Self {
        HoldBody { inner, observer: NoBodyUsage }
    }
}

impl<R, O> HoldBody<R, O> {
    /// Reads the real usage from the body with `observer`.
    pub fn usage_from_body<O2: BodyUsage>(self, observer: O2) -> HoldBody<R, O2> {
        HoldBody { inner: self.inner, observer }
    }
}

impl<R, O, B, E> RefusalMode<Response<B>, E> for HoldBody<R, O>
where
    R: RefusalMode<Response<HeldBody<B, O>>, E>,
    O: BodyUsage,
    B: Body + Send + 'static,
    E: Send + 'static,
{
    type Response = R::Response;
    type Error = R::Error;

    fn refuse(&self, error: Box<LimitError>) -> Result<Self::Response, Self::Error> {
        self.inner.refuse(error)
    }

    fn respond(&self, response: Response<B>, snapshots: Option<&[LimitSnapshot]>) -> Self::Response {
        let observer = self.observer.clone();
        self.inner.respond(response.map(|body| HeldBody::free(body, observer)), snapshots)
    }

    fn respond_held(&self, response: Response<B>, snapshots: Option<&[LimitSnapshot]>, hold: Hold) -> Self::Response {
        let observer = self.observer.clone();
        if response.body().is_end_stream() {
            hold.finish();
            return self.inner.respond(response.map(|body| HeldBody::free(body, observer)), snapshots);
        }
        let response = response.map(|inner| HeldBody { inner, hold: Some(hold), observer });
        self.inner.respond(response, snapshots)
    }

    fn fail(&self, error: E) -> Self::Error {
        self.inner.fail(error)
    }

    fn wants_snapshots(&self) -> bool {
        self.inner.wants_snapshots()
    }

    fn holds_body(&self) -> bool {
        true
    }

    fn reads_body_usage(&self) -> bool {
        O::REPORTS
    }
}

/// Refusal modes whose responses can hold the request's permit in their body: what the
/// layers' [`hold_body`](crate::LimitLayer::hold_body) and
/// [`usage_from_body`](crate::LimitLayer::usage_from_body) verbs turn a mode into.
/// An [`HttpAnswer`](crate::http::HttpAnswer) holds already (these verbs keep it, only
/// ending a release at the head); any other mode is wrapped in a [`HoldBody`].
pub trait HoldsBody: Sized {
    /// The mode, holding the body.
    type Held;
    /// The mode, holding the body and reading the usage from it with `O`.
    type WithUsage<O: BodyUsage>;

    /// This mode, holding the body.
    fn hold_body(self) -> Self::Held;

    /// This mode, holding the body and settling to the usage `observer` reads from it.
    fn usage_from_body<O: BodyUsage>(self, observer: O) -> Self::WithUsage<O>;
}

/// Modes that cannot hold a body themselves hold it in a [`HoldBody`].
macro_rules! held_in_a_wrapper {
    ($($(#[$attr:meta])* $mode:ty),*) => {$(
        $(#[$attr])*
        impl HoldsBody for $mode {
            type Held = HoldBody<Self>;
            type WithUsage<O: BodyUsage> = HoldBody<Self, O>;

            fn hold_body(self) -> HoldBody<Self> {
                HoldBody::new(self)
            }

            fn usage_from_body<O: BodyUsage>(self, observer: O) -> HoldBody<Self, O> {
                HoldBody::new(self).usage_from_body(observer)
            }
        }
    )*};
}

held_in_a_wrapper!(
    crate::ReturnError,
    #[cfg(feature = "tonic")]
    crate::GrpcAnswer
);

impl<R, O0> HoldsBody for HoldBody<R, O0> {
    type Held = Self;
    type WithUsage<O: BodyUsage> = HoldBody<R, O>;

    fn hold_body(self) -> Self {
        self
    }

    fn usage_from_body<O: BodyUsage>(self, observer: O) -> HoldBody<R, O> {
        HoldBody::usage_from_body(self, observer)
    }
}
