//! A mock upstream embedding provider: deterministic embeddings, and strict limits of
//! its own on every account, enforced independently of tower-limits.
//!
//! Each account allows at most `rpm · window / 1m` requests and `tpm · window / 1m`
//! tokens in **every** window of length `window` (a sliding-window log: one entry per
//! request, kept for exactly one window). That is how providers apply per-minute quotas
//! over shorter spans, and it is stricter than any fixed-window or bucket scheme with the
//! same numbers: a client passes it only if it really stays under the quota in every
//! window. A request over the quota is answered `429` with `Retry-After` (whole seconds,
//! rounded up), `retry-after-ms` (exact) and the `x-ratelimit-*` fields, and counted in
//! [`UpstreamStats::refused`]; accepted requests carry the `x-ratelimit-*` fields too.
//! Tokens are counted with each model's encoding ([`crate::tokenizer`], from the same
//! configuration as the gateway's) when the request arrives, before the answer is
//! prepared (a token-id input counts one token per id); a model the configuration does
//! not serve is answered `404 model_not_found`, as the provider does.
//!
//! Like the real provider, it honours `dimensions` (the length of the vectors; the
//! configured `upstream.dimensions` otherwise) and `encoding_format: "base64"` (each vector
//! as base64 of its little-endian `f32`s).
//!
//! `POST /v1/chat/completions` answers with a short fixed text, whole or streamed as
//! server-sent events with a final `usage` chunk when asked, under the same limits.
//!
//! The log is written on purpose without the library, so that the gateway's mirror is
//! checked against an independent implementation.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::routing::{get, post};
use http::{HeaderMap, HeaderValue, Response, StatusCode, header};
use tokio::time::Instant;

use crate::api::{self, Embedding, EmbeddingRequest, EmbeddingResponse, EncodingFormat, UsageReport, Vector};
use crate::config::{Account, UpstreamSettings};
use crate::tokenizer::{Encoding, ModelEncodings};

/// Counters of the mock provider.
#[derive(Debug, Default)]
pub struct UpstreamStats {
    /// Requests served.
    pub served: AtomicU64,
    /// Tokens served.
    pub tokens: AtomicU64,
    /// Requests refused with `429`.
    pub refused: AtomicU64,
    /// The accounts' real quota, in percent of the configured one (0 counts as 100).
    real_quota_percent: Arc<AtomicU64>,
}

impl UpstreamStats {
    /// Makes every account's real quota `percent` of its configured one from now on
    /// (stated in its `x-ratelimit-limit-*` fields too): an upstream whose limits change
    /// under the gateway.
    pub fn set_real_quota_percent(&self, percent: u64) {
        self.real_quota_percent.store(percent.max(1), Ordering::Relaxed);
    }

    /// The number of `429` answers given so far.
    #[must_use]
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }
}

/// One account's sliding-window log.
#[derive(Debug)]
struct AccountLimits {
    name: String,
    api_key: String,
    /// The configured quotas per window; the real ones are `real_quota_percent` of them.
    max_requests: u64,
    max_tokens: u64,
    window: Duration,
    log: Mutex<Log>,
    real_quota_percent: Arc<AtomicU64>,
}

#[derive(Debug, Default)]
struct Log {
    /// Arrival and tokens of every request of the last window, oldest first.
    entries: VecDeque<(Instant, u64)>,
    tokens: u64,
}

/// Why a request was refused, and for how long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verdict {
    Admitted,
    Requests(Duration),
    Tokens(Duration),
    Never,
}

impl AccountLimits {
    fn admit(&self, now: Instant, tokens: u64) -> (Verdict, Remaining) {
        let percent = match self.real_quota_percent.load(Ordering::Relaxed) {
            0 => 100,
            p => p,
        };
        let scale = |n: u64| (u128::from(n) * u128::from(percent) / 100).max(1) as u64;
        let (max_requests, max_tokens) = (scale(self.max_requests), scale(self.max_tokens));
        let mut log = self.log.lock().unwrap_or_else(PoisonError::into_inner);
        // An entry leaves when it is a whole window old: the window is (now - W, now].
        while let Some(&(t, c)) = log.entries.front() {
            if now.saturating_duration_since(t) >= self.window {
                log.entries.pop_front();
                log.tokens -= c;
            } else {
                break;
            }
        }
        let verdict = if tokens > max_tokens {
            Verdict::Never
        } else if log.entries.len() as u64 + 1 > max_requests {
            // The entry whose expiry leaves room for one more request.
            let i = log.entries.len() - max_requests as usize;
            Verdict::Requests(self.expiry(now, log.entries[i].0))
        } else if log.tokens + tokens > max_tokens {
            let mut freed = 0;
            let mut at = now;
            for &(t, c) in &log.entries {
                freed += c;
                at = t;
                if log.tokens - freed + tokens <= max_tokens {
                    break;
                }
            }
            Verdict::Tokens(self.expiry(now, at))
        } else {
            log.entries.push_back((now, tokens));
            log.tokens += tokens;
            Verdict::Admitted
        };
        let state = Remaining {
            limit_requests: max_requests,
            limit_tokens: max_tokens,
            remaining_requests: max_requests.saturating_sub(log.entries.len() as u64),
            remaining_tokens: max_tokens.saturating_sub(log.tokens),
            reset_requests: log.entries.front().map_or(Duration::ZERO, |&(t, _)| self.expiry(now, t)),
            reset_tokens: log.entries.back().map_or(Duration::ZERO, |&(t, _)| self.expiry(now, t)),
        };
        (verdict, state)
    }

    fn expiry(&self, now: Instant, arrived: Instant) -> Duration {
        (arrived + self.window).saturating_duration_since(now)
    }
}

/// What the headers report after a decision.
#[derive(Debug, Clone, Copy)]
struct Remaining {
    limit_requests: u64,
    limit_tokens: u64,
    remaining_requests: u64,
    remaining_tokens: u64,
    reset_requests: Duration,
    reset_tokens: Duration,
}

#[derive(Debug)]
struct Provider {
    accounts: Vec<AccountLimits>,
    settings: UpstreamSettings,
    encodings: ModelEncodings,
    stats: Arc<UpstreamStats>,
}

/// The mock provider's router (`POST /v1/embeddings`, `POST /v1/chat/completions`, `GET
/// /stats`) and its counters; `encodings` names the models it serves and how it counts
/// their tokens.
pub fn router(
    accounts: &[Account],
    settings: UpstreamSettings,
    encodings: &ModelEncodings,
) -> (Router, Arc<UpstreamStats>) {
    let stats = Arc::new(UpstreamStats::default());
    stats.set_real_quota_percent(100);
    let provider = Provider {
        accounts: accounts
            .iter()
            .map(|a| AccountLimits {
                name: a.name.clone(),
                api_key: a.api_key.clone(),
                max_requests: a.requests_per_window(),
                max_tokens: a.tokens_per_window(),
                window: a.window,
                log: Mutex::new(Log::default()),
                real_quota_percent: stats.real_quota_percent.clone(),
            })
            .collect(),
        settings,
        encodings: encodings.clone(),
        stats: stats.clone(),
    };
    let router = Router::new()
        .route("/v1/embeddings", post(embeddings))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/stats", get(stats_handler))
        .with_state(Arc::new(provider));
    (router, stats)
}

async fn stats_handler(State(p): State<Arc<Provider>>) -> Response<Body> {
    let s = &p.stats;
    api::json_response(
        serde_json::json!({
            "served": s.served.load(Ordering::Relaxed),
            "tokens": s.tokens.load(Ordering::Relaxed),
            "refused_429": s.refused(),
        })
        .to_string(),
    )
}

async fn embeddings(State(p): State<Arc<Provider>>, headers: HeaderMap, body: Bytes) -> Response<Body> {
    let now = Instant::now();
    let Some(account) = api::bearer(&headers).and_then(|k| p.accounts.iter().find(|a| a.api_key == k)) else {
        return api::error_response(
            StatusCode::UNAUTHORIZED,
            "invalid_request_error",
            "invalid_api_key",
            "unknown upstream API key",
        );
    };
    let request = match EmbeddingRequest::parse(&body) {
        Ok(r) => r,
        Err(e) => return e.response(),
    };
    if request.dimensions.is_some_and(|d| d > 4096) {
        return api::error_with_param(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "invalid_dimensions",
            Some("dimensions"),
            "this model gives at most 4096 dimensions",
        );
    }
    let Some(encoding) = p.encodings.get(&request.model) else { return unknown_model(&request.model) };
    let tokens = request.tokens(encoding);
    let (verdict, state) = account.admit(now, tokens);
    let mut response = match verdict {
        Verdict::Admitted => {
            if !p.settings.latency.is_zero() {
                tokio::time::sleep(p.settings.latency).await;
            }
            p.stats.served.fetch_add(1, Ordering::Relaxed);
            p.stats.tokens.fetch_add(tokens, Ordering::Relaxed);
            let answer = EmbeddingResponse {
                object: "list".into(),
                data: request
                    .inputs
                    .iter()
                    .enumerate()
                    .map(|(index, input)| {
                        let dimensions = request.dimensions.map_or(p.settings.dimensions, |d| d as usize);
                        let vector = embed(&input.seed_text(), dimensions);
                        Embedding {
                            object: "embedding".into(),
                            index,
                            embedding: match request.encoding_format {
                                EncodingFormat::Float => Vector::Float(vector),
                                EncodingFormat::Base64 => Vector::Base64(api::base64_f32(&vector)),
                            },
                        }
                    })
                    .collect(),
                model: request.model,
                usage: UsageReport { prompt_tokens: tokens, total_tokens: tokens },
            };
            api::json_response(serde_json::to_string(&answer).unwrap_or_default())
        }
        Verdict::Never => {
            return api::error_response(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                "context_length_exceeded",
                &format!("{tokens} tokens are more than account {} allows per window", account.name),
            );
        }
        Verdict::Requests(wait) | Verdict::Tokens(wait) => {
            p.stats.refused.fetch_add(1, Ordering::Relaxed);
            let what = if matches!(verdict, Verdict::Requests(_)) { "requests" } else { "tokens" };
            let mut r = api::error_response(
                StatusCode::TOO_MANY_REQUESTS,
                what,
                "rate_limit_exceeded",
                &format!("rate limit reached for {what} on account {}", account.name),
            );
            let h = r.headers_mut();
            h.insert(header::RETRY_AFTER, HeaderValue::from(tower_limits::http::whole_seconds(wait)));
            h.insert("retry-after-ms", HeaderValue::from(wait.as_millis().max(1) as u64));
            r
        }
    };
    let h = response.headers_mut();
    let go = |d: Duration| {
        HeaderValue::from_str(&tower_limits::http::go_duration(d)).unwrap_or(HeaderValue::from_static("0s"))
    };
    h.insert("x-ratelimit-limit-requests", HeaderValue::from(state.limit_requests));
    h.insert("x-ratelimit-limit-tokens", HeaderValue::from(state.limit_tokens));
    h.insert("x-ratelimit-remaining-requests", HeaderValue::from(state.remaining_requests));
    h.insert("x-ratelimit-remaining-tokens", HeaderValue::from(state.remaining_tokens));
    h.insert("x-ratelimit-reset-requests", go(state.reset_requests));
    h.insert("x-ratelimit-reset-tokens", go(state.reset_tokens));
    response
}

/// The words of every mock chat answer, joined by spaces.
const ANSWER: [&str; 8] = ["the", "mock", "says", "hi", "and", "then", "it", "ends"];

/// The most words of [`ANSWER`] whose text has at most `max_tokens` tokens, and those
/// tokens.
fn answer_within(encoding: Encoding, max_tokens: u64) -> (usize, u64) {
    (0..=ANSWER.len())
        .rev()
        .map(|words| (words, encoding.count(&ANSWER[..words].join(" "))))
        .find(|&(_, tokens)| tokens <= max_tokens)
        .unwrap_or((0, 0))
}

/// The provider's `404` for a model it does not serve.
fn unknown_model(model: &str) -> Response<Body> {
    api::error_with_param(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        "model_not_found",
        Some("model"),
        &format!("The model `{model}` does not exist or you do not have access to it."),
    )
}

/// `POST /v1/chat/completions`: `n` answers (one by default) of at most eight words each
/// (fewer when their tokens would pass `max_tokens`), counted with the prompt when the
/// request arrives. Streamed as
/// server-sent events when asked (`stream: true`): the head after `latency`, then one
/// `chat.completion.chunk` per word every quarter of `latency`, then, with
/// `stream_options.include_usage`, a chunk with no choices and the `usage`, then `data:
/// [DONE]`.
async fn chat_completions(State(p): State<Arc<Provider>>, headers: HeaderMap, body: Bytes) -> Response<Body> {
    let now = Instant::now();
    let Some(account) = api::bearer(&headers).and_then(|k| p.accounts.iter().find(|a| a.api_key == k)) else {
        return api::error_response(
            StatusCode::UNAUTHORIZED,
            "invalid_request_error",
            "invalid_api_key",
            "unknown upstream API key",
        );
    };
    let request = match api::ChatRequest::parse(&body) {
        Ok(r) => r,
        Err(e) => return e.response(),
    };
    let Some(encoding) = p.encodings.get(&request.model) else { return unknown_model(&request.model) };
    let (words, each) = answer_within(encoding, request.max_tokens.unwrap_or(u64::MAX));
    let completion = each * request.choices;
    let prompt = request.prompt_tokens(encoding) + request.images() * p.encodings.image_tokens();
    let tokens = prompt + completion;
    let (verdict, _) = account.admit(now, tokens);
    match verdict {
        Verdict::Admitted => {}
        Verdict::Never => {
            return api::error_response(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                "context_length_exceeded",
                &format!("{tokens} tokens are more than account {} allows per window", account.name),
            );
        }
        Verdict::Requests(wait) | Verdict::Tokens(wait) => {
            p.stats.refused.fetch_add(1, Ordering::Relaxed);
            let mut r = api::error_response(
                StatusCode::TOO_MANY_REQUESTS,
                "requests",
                "rate_limit_exceeded",
                &format!("rate limit reached on account {}", account.name),
            );
            tower_limits::http::write_retry_after(r.headers_mut(), wait);
            return r;
        }
    }
    if !p.settings.latency.is_zero() {
        tokio::time::sleep(p.settings.latency).await;
    }
    p.stats.served.fetch_add(1, Ordering::Relaxed);
    p.stats.tokens.fetch_add(tokens, Ordering::Relaxed);
    let usage = serde_json::json!({ "prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": tokens });
    let id = format!("chatcmpl-mock-{}", p.stats.served.load(Ordering::Relaxed));
    if !request.stream {
        let answer = serde_json::json!({
            "id": id,
            "object": "chat.completion",
            "model": request.model,
            "choices": (0..request.choices).map(|index| serde_json::json!({
                "index": index,
                "message": { "role": "assistant", "content": ANSWER[..words].join(" ") },
                "finish_reason": "stop",
            })).collect::<Vec<_>>(),
            "usage": usage,
        });
        return api::json_response(answer.to_string());
    }
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    let pause = p.settings.latency / 4;
    tokio::spawn(async move {
        let chunk = |index: u64, delta: serde_json::Value, finish: Option<&str>| {
            api::sse_event(&serde_json::json!({
                "id": id,
                "object": "chat.completion.chunk",
                "model": request.model,
                "choices": [{ "index": index, "delta": delta, "finish_reason": finish }],
            }))
        };
        let mut events = Vec::new();
        for index in 0..request.choices {
            events.push(chunk(index, serde_json::json!({ "role": "assistant", "content": "" }), None));
            for (i, word) in ANSWER[..words].iter().enumerate() {
                let text = if i == 0 { (*word).to_owned() } else { format!(" {word}") };
                events.push(chunk(index, serde_json::json!({ "content": text }), None));
            }
            events.push(chunk(index, serde_json::json!({}), Some("stop")));
        }
        if request.include_usage {
            events.push(api::sse_event(&serde_json::json!({
                "id": id,
                "object": "chat.completion.chunk",
                "model": request.model,
                "choices": [],
                "usage": usage,
            })));
        }
        events.push(Bytes::from_static(api::SSE_DONE));
        for event in events {
            if !pause.is_zero() {
                tokio::time::sleep(pause).await;
            }
            // The client went away: stop.
            if tx.send(event).await.is_err() {
                return;
            }
        }
    });
    let mut response = Response::new(Body::new(api::ChannelBody(rx)));
    response.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    response.headers_mut().insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    response
}

/// A deterministic unit vector for `text`: the same text always embeds the same way.
#[must_use]
pub fn embed(text: &str, dimensions: usize) -> Vec<f32> {
    // FNV-1a of the text seeds a splitmix64 stream.
    let mut seed = 0xcbf2_9ce4_8422_2325u64;
    for b in text.bytes() {
        seed = (seed ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    let mut next = || {
        seed = seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = seed;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    let v: Vec<f64> = (0..dimensions).map(|_| (next() >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0).collect();
    let norm = v.iter().map(|x| x * x).sum::<f64>().sqrt().max(f64::MIN_POSITIVE);
    v.iter().map(|x| (x / norm) as f32).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn account(max_requests: u64, max_tokens: u64) -> AccountLimits {
        AccountLimits {
            name: "a".into(),
            api_key: "k".into(),
            max_requests,
            max_tokens,
            window: Duration::from_secs(1),
            log: Mutex::new(Log::default()),
            real_quota_percent: Arc::new(AtomicU64::new(100)),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn the_log_enforces_every_window() {
        let ms = Duration::from_millis;
        let t0 = Instant::now();
        let requests = account(2, 1000);
        assert_eq!(requests.admit(t0, 10).0, Verdict::Admitted);
        assert_eq!(requests.admit(t0 + ms(400), 10).0, Verdict::Admitted);
        assert_eq!(requests.admit(t0 + ms(500), 10).0, Verdict::Requests(ms(500)), "until the first is 1s old");
        assert_eq!(requests.admit(t0 + ms(1000), 10).0, Verdict::Admitted, "the first left at 1s");

        let tokens = account(100, 100);
        assert_eq!(tokens.admit(t0, 10).0, Verdict::Admitted);
        assert_eq!(tokens.admit(t0 + ms(400), 10).0, Verdict::Admitted);
        assert_eq!(tokens.admit(t0 + ms(1000), 10).0, Verdict::Admitted);
        assert_eq!(tokens.admit(t0 + ms(1300), 90).0, Verdict::Tokens(ms(100)), "until the one at 400ms leaves");
        assert_eq!(tokens.admit(t0 + ms(1400), 90).0, Verdict::Admitted, "exactly the quota");
        assert_eq!(tokens.admit(t0 + ms(2000), 90).0, Verdict::Tokens(ms(400)));
        assert_eq!(tokens.admit(t0 + ms(2400), 101).0, Verdict::Never);
    }

    #[test]
    fn embeddings_are_deterministic_unit_vectors() {
        let a = embed("hello", 8);
        assert_eq!(a, embed("hello", 8));
        assert_ne!(a, embed("hello!", 8));
        let norm: f32 = a.iter().map(|x| x * x).sum();
        assert!((norm - 1.0).abs() < 1e-5);
    }
}
