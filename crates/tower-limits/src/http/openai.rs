//! OpenAI's error object for a refusal: what its SDKs read in a `429` or `503`.

use std::fmt::Write as _;

use tower_limits_core::Counts;

use super::{json_string, kind_name};
use crate::error::{ErrorKind, LimitError};

impl LimitError {
    /// The `code` of this refusal's [OpenAI error object](Self::openai_json):
    /// `rate_limit_exceeded` for a tenant's rate limit, `limits_unavailable` when the
    /// limits' store cannot answer, and the refusal's kind otherwise (as a metric label,
    /// say).
    ///
    /// ```
    /// use tower_limits::{Instant, LimitError, LimitSet, Quota, TenantKey, nz};
    ///
    /// let set = LimitSet::gcra(Quota::per_second(nz!(1)));
    /// let global = TenantKey::global();
    /// let _first = set.acquire(&global, 1, Instant::ZERO).unwrap();
    /// let refused = LimitError::from(set.acquire(&global, 1, Instant::ZERO).unwrap_err());
    /// assert_eq!(refused.openai_code(), "rate_limit_exceeded");
    /// ```
    #[must_use]
    pub fn openai_code(&self) -> &'static str {
        self.openai_type_and_code().1
    }

    fn openai_type_and_code(&self) -> (&'static str, &'static str) {
        match self.kind() {
            ErrorKind::MissingKey => ("invalid_request_error", "invalid_api_key"),
            ErrorKind::KeySourceMissing => ("server_error", "key_source_missing"),
            ErrorKind::CostAboveCapacity => ("invalid_request_error", "cost_above_capacity"),
            // Says what cannot be reached, as a gateway's own answer while its store is
            // away says it.
            ErrorKind::Unavailable => ("server_error", "limits_unavailable"),
            _ if self.is_shared() => ("server_error", kind_name(self.kind())),
            ErrorKind::RateLimited => {
                let counts_cost = self.counts() == Some(Counts::Cost);
                (if counts_cost { "tokens" } else { "requests" }, "rate_limit_exceeded")
            }
            other => ("requests", kind_name(other)),
        }
    }

    /// The error object OpenAI's APIs answer with, which OpenAI's SDKs read:
    /// `{"error": {"message", "type", "param", "code"}}`. The message names the limit, its
    /// tier and when to retry; `type` is `requests` or `tokens` for a rate limit (as
    /// OpenAI's own), `server_error` for the server's own capacity,
    /// `invalid_request_error` otherwise; `code` is `rate_limit_exceeded` for a rate limit,
    /// `limits_unavailable` when the limits' store cannot answer, and the refusal's kind
    /// otherwise.
    ///
    /// ```
    /// use tower_limits::{Instant, LimitError, LimitSet, Quota, TenantKey, nz};
    ///
    /// let set = LimitSet::gcra(Quota::per_second(nz!(2)));
    /// let global = TenantKey::global();
    /// let _first = set.acquire(&global, 2, Instant::ZERO).unwrap();
    /// let refused = LimitError::from(set.acquire(&global, 1, Instant::ZERO).unwrap_err());
    /// assert_eq!(
    ///     refused.openai_json(),
    ///     r#"{"error":{"message":"Rate limit reached for gcra: limit 2 per 1s. Please try again in 0.500s.","type":"requests","param":null,"code":"rate_limit_exceeded"}}"#
    /// );
    /// ```
    #[must_use]
    pub fn openai_json(&self) -> String {
        let (kind, code) = self.openai_type_and_code();
        let mut message = String::from(match self.kind() {
            ErrorKind::RateLimited => "Rate limit reached",
            ErrorKind::ConcurrencyLimited if !self.is_shared() => "Too many requests in flight",
            ErrorKind::TenantQueueFull => "Too many of your requests are queued",
            ErrorKind::MissingKey => "No valid API key was given",
            ErrorKind::KeySourceMissing => "The server is misconfigured: its rate limiter cannot identify clients",
            ErrorKind::CostAboveCapacity => "The request is larger than the limit allows at once",
            ErrorKind::Unavailable => "The rate limits cannot be checked right now",
            ErrorKind::KeyTableFull => "The server tracks too many clients right now",
            ErrorKind::WaitTimedOut => "The server is at capacity for longer than a request may wait",
            _ => "The server is at capacity",
        });
        if let Some(limit) = self.limit() {
            let _ = write!(message, " for {limit}");
            if let Some(tier) = self.tier() {
                let _ = write!(message, " (per {tier})");
            }
        }
        if let Some(s) = self.snapshot().filter(|s| s.quota > 0) {
            let _ = write!(message, ": limit {}", s.quota);
            if s.window.is_zero() {
                message.push_str(" at once");
            } else {
                let unit = match self.counts() {
                    Some(Counts::Cost) => " tokens",
                    Some(Counts::Requests) => " requests",
                    None => "",
                };
                let _ = write!(message, "{unit} per {}", tower_limits_core::policy::format_duration(s.window));
            }
        }
        match self.retry_after() {
            Some(wait) => {
                let _ = write!(message, ". Please try again in {:.3}s.", wait.as_secs_f64());
            }
            None => message.push('.'),
        }
        format!(
            "{{\"error\":{{\"message\":{},\"type\":{},\"param\":null,\"code\":{}}}}}",
            json_string(&message),
            json_string(kind),
            json_string(code)
        )
    }
}
