//! The stages of the gateway's pipeline that are its own (see the parent module's
//! diagram): [`Prepare`] reads and costs a request, [`PlanLimits`] sends it through its
//! tenant's plan, [`UpstreamCall`] calls the chosen account; each reports what it knows
//! in the answer's [`AccessInfo`], for the access line.

use super::upload::UploadRules;
use super::*;
use crate::access::AccessInfo;
use crate::tokenizer::{Encoding, ModelEncodings};

/// Reads the body (within the bounds of [`UploadRules`]: a place among its tenant's
/// uploads, a pace, `body_timeout`), checks it, counts its tokens and puts the [`Cost`]
/// in the request's extensions.
#[derive(Debug, Clone)]
pub struct PrepareLayer {
    pub(super) uploads: UploadRules,
    pub(super) max_tokens: u64,
    pub(super) embedding_models: Arc<[String]>,
    pub(super) chat_models: Arc<[String]>,
    pub(super) encodings: ModelEncodings,
    pub(super) default_max_tokens: Option<u64>,
}

impl<S> Layer<S> for PrepareLayer {
    type Service = Prepare<S>;

    fn layer(&self, inner: S) -> Prepare<S> {
        Prepare { inner, settings: Arc::new(self.clone()) }
    }
}

/// The service of [`PrepareLayer`].
#[derive(Debug, Clone)]
pub struct Prepare<S> {
    inner: S,
    settings: Arc<PrepareLayer>,
}

impl<S> Service<Request<Body>> for Prepare<S>
where
    S: Service<Request<Body>, Response = Response<Body>, Error = Infallible> + Clone + Send + 'static,
    S::Future: Send + 'static,
{
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<Body>) -> BoxFuture {
        let mut inner = super::take_ready(&mut self.inner);
        let settings = self.settings.clone();
        Box::pin(async move {
            let (mut parts, body) = req.into_parts();
            // A body still to come takes one of its tenant's upload places while it does;
            // with none free, it must come at once.
            let place = match parts.extensions.get::<Identity>() {
                Some(id) if !http_body::Body::is_end_stream(&body) => Some(settings.uploads.place(&id.fair.0)),
                _ => None,
            };
            let read = match place {
                Some(Err(refused)) => settings.uploads.read_without_place(body, refused).await,
                Some(Ok(place)) => {
                    let read = settings.uploads.read(body).await;
                    drop(place);
                    read
                }
                None => settings.uploads.read(body).await,
            };
            let body = match read {
                Ok(b) => b,
                Err(refused) => return Ok(*refused),
            };
            let is_chat = parts.uri.path() == CHAT_PATH;
            let request = if is_chat {
                api::ChatRequest::parse(&body).map(Parsed::Chat)
            } else {
                EmbeddingRequest::parse(&body).map(Parsed::Embedding)
            };
            let request = match request {
                Ok(r) => r,
                Err(e) => return Ok(e.response()),
            };
            let model = request.model();
            let Some(encoding) = settings.served(is_chat, model) else {
                return Ok(not_served(&settings, is_chat, model, parts.uri.path()));
            };
            let limit = settings.max_tokens;
            let (tokens, prompt, inputs, stream) = match &request {
                Parsed::Embedding(r) => match r.tokens_within(encoding, limit) {
                    Some(tokens) => (tokens, tokens, r.inputs.len(), false),
                    None => {
                        return Ok(too_many_tokens("input", &format!("`input` has more than {limit} tokens"), limit));
                    }
                },
                Parsed::Chat(r) => {
                    let images = r.images().saturating_mul(settings.encodings.image_tokens());
                    let text = limit.checked_sub(images).and_then(|left| r.prompt_tokens_within(encoding, left));
                    let Some(prompt) = text.map(|t| t + images) else {
                        return Ok(too_many_tokens(
                            "messages",
                            &format!("the messages have more than {limit} tokens"),
                            limit,
                        ));
                    };
                    let completion = r.completion_reserve(prompt, settings.default_max_tokens, limit);
                    let tokens = prompt.saturating_add(completion);
                    if tokens > limit {
                        let mut response = too_many_tokens(
                            "max_tokens",
                            &format!(
                                "you requested {tokens} tokens ({prompt} in the messages, {completion} for the \
                                 completion)"
                            ),
                            limit,
                        );
                        response.extensions_mut().insert(AccessInfo { tokens: Some(tokens), ..AccessInfo::default() });
                        return Ok(response);
                    }
                    (tokens, prompt, r.messages.len(), r.stream)
                }
            };
            parts.extensions.insert(Cost(tokens));
            let path = if is_chat { CHAT_PATH } else { EMBEDDINGS_PATH };
            let model = Arc::from(model);
            parts.extensions.insert(Prepared { body, tokens, prompt, model, inputs, path, stream });
            let mut response = inner.call(Request::from_parts(parts, Body::empty())).await?;
            // The upstream's count when it gave one, the estimate otherwise.
            response.extensions_mut().get_or_insert_default::<AccessInfo>().tokens.get_or_insert(tokens);
            Ok(response)
        })
    }
}

/// A request body read and checked.
enum Parsed {
    Embedding(EmbeddingRequest),
    Chat(api::ChatRequest),
}

impl Parsed {
    fn model(&self) -> &str {
        match self {
            Parsed::Embedding(r) => &r.model,
            Parsed::Chat(r) => &r.model,
        }
    }
}

impl PrepareLayer {
    /// The encoding of `model` if it is served on the path (chat or embeddings).
    fn served(&self, is_chat: bool, model: &str) -> Option<Encoding> {
        let served = if is_chat { &self.chat_models } else { &self.embedding_models };
        served.iter().any(|m| m == model).then(|| self.encodings.get(model)).flatten()
    }
}

/// The `404` for a model not served on `path`.
fn not_served(settings: &PrepareLayer, is_chat: bool, model: &str, path: &str) -> Response<Body> {
    let (served, kind, other) = if is_chat {
        (&settings.chat_models, "chat", &settings.embedding_models)
    } else {
        (&settings.embedding_models, "embedding", &settings.chat_models)
    };
    let message = if other.iter().any(|m| m == model) {
        format!(
            "the model {model:?} is not a{} {kind} model and is not served on {path}",
            if kind == "embedding" { "n" } else { "" },
        )
    } else {
        format!("the model {model:?} does not exist here; {path} serves {}", served.join(", "))
    };
    api::error_with_param(StatusCode::NOT_FOUND, "invalid_request_error", "model_not_found", Some("model"), &message)
}

/// OpenAI's `400 context_length_exceeded` for a request over `limit` tokens.
fn too_many_tokens(param: &'static str, what: &str, limit: u64) -> Response<Body> {
    api::error_with_param(
        StatusCode::BAD_REQUEST,
        "invalid_request_error",
        "context_length_exceeded",
        Some(param),
        &format!("{what}; a request may carry at most {limit} tokens. Please reduce the request."),
    )
}

/// Sends each request through the limits of its tenant's plan.
#[derive(Clone)]
pub struct PlanLimits {
    pub(super) plans: PlanSlot,
}

impl fmt::Debug for PlanLimits {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PlanLimits").finish_non_exhaustive()
    }
}

impl Service<Request<Body>> for PlanLimits {
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        // Each call readies its own plan's service (`oneshot`).
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<Body>) -> BoxFuture {
        let plan = req.extensions().get::<Identity>().map_or(0, |id| id.plan);
        let svc = {
            let plans = self.plans.read().unwrap_or_else(PoisonError::into_inner);
            plans[plan.min(plans.len() - 1)].clone()
        };
        Box::pin(svc.oneshot(req))
    }
}

/// The innermost service: sends the request to the account the pool chose, learns from
/// the answer, and reports the real usage.
#[derive(Clone)]
pub struct UpstreamCall {
    pub(super) transport: Transport,
    pub(super) timeout: Duration,
    pub(super) on_timeout: TimeoutCharge,
    pub(super) pool: LimitPool<Account>,
    pub(super) now: Arc<dyn Fn() -> Instant + Send + Sync>,
    pub(super) stats: Arc<GatewayStats>,
    /// Each account's addresses and headers, by its place in the pool.
    pub(super) routes: Arc<[AccountRoute]>,
    /// The accounts' limits learned from the answers (in memory; `None` otherwise).
    pub(super) learning: Option<Arc<super::learning::Learning>>,
}

/// What a call to one account needs, built once: its two addresses, its `Authorization`
/// and the value of [`ACCOUNT_HEADER`].
#[derive(Debug)]
pub(super) struct AccountRoute {
    embeddings: http::Uri,
    chat: http::Uri,
    authorization: HeaderValue,
    name: HeaderValue,
}

impl AccountRoute {
    /// The route to `account`.
    ///
    /// # Errors
    /// Its base URL does not make an address, or its key or name a header value.
    pub(super) fn new(account: &Account) -> Result<Self, BoxError> {
        let uri = |path: &str| -> Result<http::Uri, BoxError> {
            format!("{}{path}", account.base_url)
                .parse()
                .map_err(|e| format!("account {}: base_url {:?}: {e}", account.name, account.base_url).into())
        };
        Ok(AccountRoute {
            embeddings: uri(EMBEDDINGS_PATH)?,
            chat: uri(CHAT_PATH)?,
            authorization: HeaderValue::try_from(format!("Bearer {}", account.api_key))
                .map_err(|_| format!("account {}: the API key is not a valid header value", account.name))?,
            name: HeaderValue::try_from(account.name.as_str())
                .map_err(|_| format!("account {}: the name is not a valid header value", account.name))?,
        })
    }
}

impl fmt::Debug for UpstreamCall {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UpstreamCall").field("pool", &self.pool).finish_non_exhaustive()
    }
}

impl Service<Request<Body>> for UpstreamCall {
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<Body>) -> BoxFuture {
        let this = self.clone();
        Box::pin(async move { Ok(this.forward(req).await) })
    }
}

/// An upstream answer: read whole, or a stream passed on as it comes.
enum Answer {
    Whole(Bytes),
    Stream(Body),
}

/// The wait suggested when nobody knows how long: the limits' store is down, an upstream
/// account is benched without saying for how long (the layers suggest the same).
pub const BACKEND_DOWN_WAIT: Duration = Duration::from_secs(1);

/// The queueing time of an answer, in microseconds: from arrival at the gateway to the
/// call to the upstream.
pub const QUEUE_TIME_HEADER: HeaderName = HeaderName::from_static("x-gateway-queue-us");
/// The upstream account that served an answer.
pub const ACCOUNT_HEADER: HeaderName = HeaderName::from_static("x-gateway-account");

impl UpstreamCall {
    async fn forward(self, req: Request<Body>) -> Response<Body> {
        let internal =
            |what: &str| api::error_response(StatusCode::INTERNAL_SERVER_ERROR, "server_error", "internal", what);
        let Some(chosen) = req.extensions().get::<Chosen<Account>>().cloned() else {
            return internal("no upstream account was chosen");
        };
        let Some(prepared) = req.extensions().get::<Prepared>().cloned() else {
            return internal("the request was not prepared");
        };
        let tenant = req.extensions().get::<Identity>().map(|i| i.tenant.clone());
        let queued = req.extensions().get::<Arrived>().map(|a| a.0.elapsed());
        let Some(route) = self.routes.get(chosen.index) else { return internal("the account has no route") };
        let uri = if prepared.path == CHAT_PATH { route.chat.clone() } else { route.embeddings.clone() };
        let mut upstream = Request::new(Body::from(prepared.body));
        *upstream.method_mut() = http::Method::POST;
        *upstream.uri_mut() = uri;
        let h = upstream.headers_mut();
        h.insert(header::AUTHORIZATION, route.authorization.clone());
        h.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
        let started = tokio::time::Instant::now();
        let call = async {
            let response = self.transport.clone().oneshot(upstream).await?;
            let (parts, body) = response.into_parts();
            if prepared.stream && parts.status.is_success() {
                // The stream goes on to the client as it comes: the layers above hold
                // their permits in it and settle them from its final usage chunk.
                return Ok::<_, BoxError>((parts, Answer::Stream(body)));
            }
            let bytes = body.collect().await?.to_bytes();
            Ok((parts, Answer::Whole(bytes)))
        };
        let result = tokio::time::timeout(self.timeout, call).await;
        let took = started.elapsed();
        let info = AccessInfo {
            tenant,
            tokens: Some(prepared.tokens),
            queued,
            upstream: Some(took),
            account: Some(chosen.name.clone()),
        };
        let mut out = match result {
            Err(_) => {
                // The upstream hung: not the account's fault as far as anyone knows (no
                // answer, no bench), and not the tenant's either.
                let n = self.stats.upstream_timeouts.fetch_add(1, Ordering::Relaxed) + 1;
                if let Some(suppressed) = self.stats.timeout_log.ready() {
                    tracing::warn!(
                        account = %chosen.name,
                        timeout_ms = self.timeout.as_millis() as u64,
                        total = n,
                        suppressed,
                        "upstream call timed out: answered 504"
                    );
                }
                let mut r = api::error_response(
                    StatusCode::GATEWAY_TIMEOUT,
                    "upstream_error",
                    "upstream_timeout",
                    &format!(
                        "the upstream did not answer within {} (gateway.upstream_timeout); try again",
                        tower_limits::core::policy::format_duration(self.timeout)
                    ),
                );
                if self.on_timeout == TimeoutCharge::Refund {
                    r.extensions_mut().insert(Usage(0));
                }
                // Another try may find the upstream answering: say when to try.
                write_retry_after(r.headers_mut(), BACKEND_DOWN_WAIT);
                r
            }
            Ok(Err(e)) => {
                let n = self.stats.upstream_errors.fetch_add(1, Ordering::Relaxed) + 1;
                if let Some(suppressed) = self.stats.error_log.ready() {
                    tracing::warn!(account = %chosen.name, error = %e, total = n, suppressed, "upstream call failed: answered 502");
                }
                let mut r = api::error_response(
                    StatusCode::BAD_GATEWAY,
                    "upstream_error",
                    "upstream_unreachable",
                    &format!("the upstream account {} could not be reached: {e}", chosen.name),
                );
                write_retry_after(r.headers_mut(), BACKEND_DOWN_WAIT);
                r
            }
            Ok(Ok((parts, Answer::Whole(bytes)))) => self.answer(&chosen, parts, bytes, prepared.tokens),
            Ok(Ok((parts, Answer::Stream(body)))) => {
                self.observe(&chosen, parts.status, &parts.headers, prepared.tokens);
                let mut r = Response::new(body);
                *r.status_mut() = parts.status;
                for name in [header::CONTENT_TYPE, header::CACHE_CONTROL] {
                    if let Some(v) = parts.headers.get(&name) {
                        r.headers_mut().insert(name, v.clone());
                    }
                }
                r
            }
        };
        let h = out.headers_mut();
        h.insert(ACCOUNT_HEADER, route.name.clone());
        if let Some(q) = queued {
            h.insert(QUEUE_TIME_HEADER, HeaderValue::from(q.as_micros() as u64));
        }
        let usage = out.extensions().get::<Usage>().map(|u| u.0);
        out.extensions_mut().insert(AccessInfo { tokens: usage.or(info.tokens), ..info });
        out
    }

    /// What the upstream says about the account corrects its mirror, benches it after a
    /// `429`, and teaches its limits (the call carried `tokens`).
    fn observe(
        &self,
        chosen: &Chosen<Account>,
        status: StatusCode,
        headers: &http::HeaderMap,
        tokens: u64,
    ) -> tower_limits::UpstreamReport {
        let report = upstream_report(status, headers);
        let now = (self.now)();
        // Learning first: a rebuilt mirror starts with its burst, and the remaining counts
        // of this very answer must then bring it down to what the upstream has left.
        if let Some(learning) = &self.learning {
            learning.observe(&self.pool, chosen.index, &report, status == StatusCode::TOO_MANY_REQUESTS, tokens, now);
        }
        self.pool.observe(chosen.index, &report, now);
        report
    }

    /// The answer to the client for an upstream answer.
    fn answer(
        &self,
        chosen: &Chosen<Account>,
        parts: http::response::Parts,
        bytes: Bytes,
        tokens: u64,
    ) -> Response<Body> {
        // What the upstream says about the account corrects its mirror (and benches it
        // after a 429).
        let report = self.observe(chosen, parts.status, &parts.headers, tokens);
        if parts.status == StatusCode::TOO_MANY_REQUESTS {
            // Not the tenant's fault: shared overload, retry when the account is back.
            let n = self.stats.upstream_refusals.fetch_add(1, Ordering::Relaxed) + 1;
            if let Some(suppressed) = self.stats.refusal_log.ready() {
                tracing::warn!(account = %chosen.name, total = n, suppressed, "upstream answered 429: account benched, answered 503");
            }
            let wait = report.retry_after.filter(|w| !w.is_zero()).unwrap_or(BACKEND_DOWN_WAIT);
            let mut r = api::error_response(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                "upstream_rate_limited",
                &format!(
                    "The upstream account {} is rate limited. Please try again in {:.3}s.",
                    chosen.name,
                    wait.as_secs_f64()
                ),
            );
            write_retry_after(r.headers_mut(), wait);
            return r;
        }
        if parts.status.is_server_error() {
            let n = self.stats.upstream_errors.fetch_add(1, Ordering::Relaxed) + 1;
            if let Some(suppressed) = self.stats.error_log.ready() {
                tracing::warn!(account = %chosen.name, status = parts.status.as_u16(), total = n, suppressed, "upstream answered an error");
            }
        }
        if !parts.status.is_success() && !api::is_openai_error(&bytes) {
            // Whatever the upstream said, the client gets OpenAI's shape.
            return api::error_response(
                parts.status,
                if parts.status.is_server_error() { "server_error" } else { "invalid_request_error" },
                "upstream_error",
                &format!("The upstream account {} answered {}.", chosen.name, parts.status),
            );
        }
        let mut r = Response::new(Body::from(bytes.clone()));
        *r.status_mut() = parts.status;
        if let Some(ct) = parts.headers.get(header::CONTENT_TYPE) {
            r.headers_mut().insert(header::CONTENT_TYPE, ct.clone());
        }
        if parts.status.is_success() {
            if let Some(total) = api::usage_total(&bytes) {
                // Settles the tenant's TPM and the account's mirror to the real count.
                r.extensions_mut().insert(Usage(total));
            }
        }
        r
    }
}
