//! What an upstream's answer says about its limits, read from its headers for a
//! [`LimitPool`](tower_limits_core::LimitPool).

use std::time::Duration;

use http::{HeaderMap, StatusCode};

/// What an upstream's answer says about its limits: `Retry-After` (seconds) or
/// `retry-after-ms`, the `x-ratelimit-remaining-{requests,tokens}` counts, and for a
/// `429` without `Retry-After`, the longer of the `x-ratelimit-reset-*` durations. Feed it
/// to [`LimitPool::observe`](tower_limits_core::LimitPool::observe).
#[must_use]
pub fn upstream_report(status: StatusCode, headers: &HeaderMap) -> tower_limits_core::UpstreamReport {
    let text = |name: &str| headers.get(name).and_then(|v| v.to_str().ok()).map(str::trim);
    let number = |name: &str| text(name).and_then(|t| t.parse::<u64>().ok());
    let mut retry_after =
        number("retry-after-ms").map(Duration::from_millis).or_else(|| number("retry-after").map(Duration::from_secs));
    if retry_after.is_none() && status == StatusCode::TOO_MANY_REQUESTS {
        let resets = ["x-ratelimit-reset-requests", "x-ratelimit-reset-tokens"];
        let longest = resets.iter().filter_map(|n| text(n).and_then(parse_go_duration)).max();
        // A refusal with no hint at all still benches the account for a moment.
        retry_after = Some(longest.unwrap_or(Duration::from_secs(1)));
    }
    tower_limits_core::UpstreamReport {
        retry_after,
        remaining_requests: number("x-ratelimit-remaining-requests"),
        remaining_tokens: number("x-ratelimit-remaining-tokens"),
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
    fn go_durations_parse() {
        assert_eq!(parse_go_duration("1.5s"), Some(Duration::from_millis(1500)));
        assert_eq!(parse_go_duration("1h2m3s"), Some(Duration::from_secs(3723)));
        assert_eq!(parse_go_duration("250ms"), Some(Duration::from_millis(250)));
        assert_eq!(parse_go_duration("soon"), None);
        assert_eq!(parse_go_duration(&go_duration(Duration::from_secs(360))), Some(Duration::from_secs(360)));
    }
}
