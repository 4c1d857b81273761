//! What an upstream's answer says about its limits, read from its headers for a
//! [`LimitPool`](tower_limits_core::LimitPool).

use std::time::{Duration, SystemTime};

use http::{HeaderMap, StatusCode};

/// What an upstream's answer says about its limits: `retry-after-ms`, or `Retry-After` in
/// either of its forms (seconds, or an HTTP date), the
/// `x-ratelimit-remaining-{requests,tokens}` counts, the `x-ratelimit-limit-*` quotas, and
/// for a `429` without a retry
/// time, the longer of the `x-ratelimit-reset-*` durations (one second when there is
/// none: a refusal with no hint still benches the account for a moment). Feed it to
/// [`LimitPool::observe`](tower_limits_core::LimitPool::observe).
///
/// A `Retry-After` date is counted from the answer's own `Date` field when it has one, so
/// that the two clocks' skew does not matter, and from this host's clock otherwise; a date
/// already past means no wait.
///
/// ```
/// use std::time::Duration;
/// use http::{HeaderMap, StatusCode};
/// use tower_limits::http::upstream_report;
///
/// let mut headers = HeaderMap::new();
/// headers.insert("date", "Wed, 21 Oct 2026 07:28:00 GMT".parse().unwrap());
/// headers.insert("retry-after", "Wed, 21 Oct 2026 07:28:30 GMT".parse().unwrap());
/// headers.insert("x-ratelimit-remaining-tokens", "1200".parse().unwrap());
/// headers.insert("x-ratelimit-limit-tokens", "150000".parse().unwrap());
/// let report = upstream_report(StatusCode::TOO_MANY_REQUESTS, &headers);
/// assert_eq!(report.retry_after, Some(Duration::from_secs(30)));
/// assert_eq!((report.remaining_tokens, report.limit_tokens), (Some(1200), Some(150_000)));
/// ```
#[must_use]
pub fn upstream_report(status: StatusCode, headers: &HeaderMap) -> tower_limits_core::UpstreamReport {
    upstream_report_at(status, headers, SystemTime::now())
}

/// [`upstream_report`] with the time to count a `Retry-After` date from when the answer
/// has no `Date` field: for tests, and for callers that keep their own clock.
///
/// ```
/// use std::time::{Duration, SystemTime};
/// use http::{HeaderMap, StatusCode};
/// use tower_limits::http::upstream_report_at;
///
/// let mut headers = HeaderMap::new();
/// headers.insert("retry-after", "Thu, 01 Jan 1970 00:01:40 GMT".parse().unwrap());
/// let now = SystemTime::UNIX_EPOCH + Duration::from_secs(90);
/// let report = upstream_report_at(StatusCode::SERVICE_UNAVAILABLE, &headers, now);
/// assert_eq!(report.retry_after, Some(Duration::from_secs(10)));
/// ```
#[must_use]
pub fn upstream_report_at(
    status: StatusCode,
    headers: &HeaderMap,
    now: SystemTime,
) -> tower_limits_core::UpstreamReport {
    let text = |name: &str| headers.get(name).and_then(|v| v.to_str().ok()).map(str::trim);
    let number = |name: &str| text(name).and_then(|t| t.parse::<u64>().ok());
    let retry_at = || {
        let at = httpdate::parse_http_date(text("retry-after")?).ok()?;
        let from = text("date").and_then(|d| httpdate::parse_http_date(d).ok()).unwrap_or(now);
        Some(at.duration_since(from).unwrap_or(Duration::ZERO))
    };
    let mut retry_after = number("retry-after-ms")
        .map(Duration::from_millis)
        .or_else(|| number("retry-after").map(Duration::from_secs))
        .or_else(retry_at);
    if retry_after.is_none() && status == StatusCode::TOO_MANY_REQUESTS {
        let resets = ["x-ratelimit-reset-requests", "x-ratelimit-reset-tokens"];
        let longest = resets.iter().filter_map(|n| text(n).and_then(parse_go_duration)).max();
        retry_after = Some(longest.unwrap_or(Duration::from_secs(1)));
    }
    tower_limits_core::UpstreamReport {
        retry_after,
        remaining_requests: number("x-ratelimit-remaining-requests"),
        remaining_tokens: number("x-ratelimit-remaining-tokens"),
        limit_requests: number("x-ratelimit-limit-requests"),
        limit_tokens: number("x-ratelimit-limit-tokens"),
    }
}

/// Parses a duration written as `6m0s`, `1.5s`, `250ms` or `1h2m3s`.
#[must_use]
pub fn parse_go_duration(text: &str) -> Option<Duration> {
    let mut total = 0f64;
    let mut rest = text.trim();
    if rest.is_empty() {
        return None;
    }
    while !rest.is_empty() {
        let end = rest.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(rest.len());
        let value: f64 = rest[..end].parse().ok()?;
        rest = &rest[end..];
        let unit_end = rest.find(|c: char| c.is_ascii_digit() || c == '.').unwrap_or(rest.len());
        let scale = match &rest[..unit_end] {
            "h" => 3600.0,
            "m" => 60.0,
            "s" => 1.0,
            "ms" => 1e-3,
            "us" | "µs" => 1e-6,
            "ns" => 1e-9,
            _ => return None,
        };
        total += value * scale;
        rest = &rest[unit_end..];
    }
    Duration::try_from_secs_f64(total).ok()
}

#[cfg(test)]
mod tests {
    use http::HeaderValue;
    use http::header::RETRY_AFTER;

    use super::*;
    use crate::http::go_duration;

    #[test]
    fn reports_read_openai_fields() {
        let mut h = HeaderMap::new();
        h.insert("x-ratelimit-remaining-requests", HeaderValue::from_static("59"));
        h.insert("x-ratelimit-remaining-tokens", HeaderValue::from_static("1200"));
        h.insert("x-ratelimit-reset-tokens", HeaderValue::from_static("6m0s"));
        let ok = upstream_report(StatusCode::OK, &h);
        assert_eq!((ok.remaining_requests, ok.remaining_tokens, ok.retry_after), (Some(59), Some(1200), None));
        let refused = upstream_report(StatusCode::TOO_MANY_REQUESTS, &h);
        assert_eq!(refused.retry_after, Some(Duration::from_secs(360)));
        h.insert(RETRY_AFTER, HeaderValue::from_static("2"));
        assert_eq!(upstream_report(StatusCode::TOO_MANY_REQUESTS, &h).retry_after, Some(Duration::from_secs(2)));
    }

    #[test]
    fn retry_after_dates_count_from_the_answers_date() {
        let at = |secs| httpdate::fmt_http_date(SystemTime::UNIX_EPOCH + Duration::from_secs(secs));
        let mut h = HeaderMap::new();
        h.insert(RETRY_AFTER, HeaderValue::from_str(&at(1_000_060)).unwrap());
        let local = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        // No Date field: from the local clock.
        let report = upstream_report_at(StatusCode::TOO_MANY_REQUESTS, &h, local);
        assert_eq!(report.retry_after, Some(Duration::from_secs(60)));
        // The answer's Date wins over a local clock that runs 50 s late.
        h.insert("date", HeaderValue::from_str(&at(1_000_050)).unwrap());
        let report = upstream_report_at(StatusCode::TOO_MANY_REQUESTS, &h, local);
        assert_eq!(report.retry_after, Some(Duration::from_secs(10)));
        // A date already past: retry now, not a second's default bench.
        h.insert("date", HeaderValue::from_str(&at(1_000_100)).unwrap());
        let report = upstream_report_at(StatusCode::TOO_MANY_REQUESTS, &h, local);
        assert_eq!(report.retry_after, Some(Duration::ZERO));
        // Neither a number nor a date: the hints of a 429, as without the field.
        h.insert(RETRY_AFTER, HeaderValue::from_static("soon"));
        let report = upstream_report_at(StatusCode::TOO_MANY_REQUESTS, &h, local);
        assert_eq!(report.retry_after, Some(Duration::from_secs(1)));
    }

    #[test]
    fn go_durations_parse() {
        assert_eq!(parse_go_duration("1.5s"), Some(Duration::from_millis(1500)));
        assert_eq!(parse_go_duration("1h2m3s"), Some(Duration::from_secs(3723)));
        assert_eq!(parse_go_duration("250ms"), Some(Duration::from_millis(250)));
        assert_eq!(parse_go_duration("soon"), None);
        assert_eq!(parse_go_duration(&go_duration(Duration::from_secs(360))), Some(Duration::from_secs(360)));
    }
}
