//! The paced client: the point of this example.
//!
//! A `reqwest::Client` (any transport: a mock provider in the tests) wrapped in tower:
//!
//! ```text
//! LimitSetLayer (wait mode, usage: UpstreamReports)  ->  transport
//!      over a LimitPool of one account, mirroring the provider's published limit
//! ```
//!
//! - The layer's backend is a one-account [`LimitPool`] whose limit mirrors the provider's
//!   published one, so requests wait (in arrival order, to the exact instant) instead of
//!   being sent into a refusal.
//! - [`UpstreamReports`] hands every answer to the pool ([`upstream_report`] reads
//!   `Retry-After`, `retry-after-ms` and the `x-ratelimit-*` fields): a `429` benches the
//!   account until the provider's retry time, so **every** queued request waits for it,
//!   not only the refused one; [`send`] retries a refused request once, after that wait.

use std::time::Duration;

use tower::{BoxError, Service, ServiceBuilder, ServiceExt};
use tower_limits::extract::UpstreamReports;
use tower_limits::http::upstream_report;
use tower_limits::{LimitPolicy, LimitPool, LimitSet, LimitSetLayer, LimitSetPolicy, Quota, Selection};

/// How much the network delay of one request can differ from another's: the mirror
/// spaces `limit` requests over `window + JITTER_MARGIN`, so that no `window` at the
/// provider ever sees more than `limit` of them.
pub(crate) const JITTER_MARGIN: Duration = Duration::from_millis(100);

// ---- The limits: the one place this example builds them. ----

/// The mirror's quota for a provider that allows `limit` requests in any `window`:
/// `limit` per `window + JITTER_MARGIN`, with a burst of one.
///
/// # Errors
/// A limit of zero requests, or a window too short to represent.
pub(crate) fn mirror_quota(limit: u64, window: Duration) -> Result<Quota, tower_limits::PolicyError> {
    Quota::try_new(limit, window + JITTER_MARGIN)?.try_burst(1)
}

/// One account's mirror of the provider's limit: a GCRA of [`mirror_quota`]. It admits
/// at most `rate · T + 1` requests in any span `T`, so at most `limit` in any
/// `window + JITTER_MARGIN`.
fn mirror(limit: u64, window: Duration) -> Result<LimitSet, tower_limits::PolicyError> {
    LimitSet::new(LimitSetPolicy::new().limit(LimitPolicy::gcra("provider", mirror_quota(limit, window)?)))
}

// ---- The client. ----

/// What the provider's answer says of its limits.
fn report(response: &reqwest::Response) -> tower_limits::UpstreamReport {
    upstream_report(response.status(), response.headers())
}

/// The paced client over `transport`, for a provider that publishes `limit` requests in
/// any `window`; a request waits at most `max_wait` for room.
///
/// # Errors
/// A limit of zero requests, or a window too short to represent.
pub(crate) fn paced<S>(
    transport: S,
    limit: u64,
    window: Duration,
    max_wait: Duration,
) -> Result<
    impl Service<reqwest::Request, Response = reqwest::Response, Error = BoxError, Future: Send> + Clone,
    tower_limits::PolicyError,
>
where
    S: Service<reqwest::Request, Response = reqwest::Response> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Into<BoxError>,
{
    let pool = LimitPool::builder(Selection::RoundRobin).member("provider", mirror(limit, window)?, ()).build()?;
    // Every answer reaches the pool: no glue after each call.
    let limits = LimitSetLayer::with_backend(pool).usage(UpstreamReports::with(report)).wait(max_wait);
    Ok(ServiceBuilder::new().layer(limits).map_err(Into::into).service(transport))
}

/// Sends `req` through `client`, retrying once if the provider still refused it (the
/// retry waits in the limiter for the provider's `Retry-After`). Returns the last answer,
/// and whether it is the retry.
pub(crate) async fn send<C>(client: C, req: reqwest::Request) -> Result<(reqwest::Response, bool), BoxError>
where
    C: Service<reqwest::Request, Response = reqwest::Response, Error = BoxError> + Clone,
{
    let again = req.try_clone();
    let response = client.clone().oneshot(req).await?;
    match again {
        Some(again) if response.status() == http::StatusCode::TOO_MANY_REQUESTS => {
            Ok((client.oneshot(again).await?, true))
        }
        _ => Ok((response, false)),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;
    use crate::provider::{StrictWindow, lock};

    /// A provider enforcing `limit` requests in any `window` as a tower service (no
    /// network: the tests run on paused time), and its record.
    fn provider(
        limit: usize,
        window: Duration,
    ) -> (
        impl Service<reqwest::Request, Response = reqwest::Response, Error = BoxError, Future: Send> + Clone,
        Arc<Mutex<StrictWindow>>,
    ) {
        let shared = Arc::new(Mutex::new(StrictWindow::new(limit, window)));
        let seen = shared.clone();
        let svc = tower::service_fn(move |_req: reqwest::Request| {
            let answer = lock(&seen).answer(tokio::time::Instant::now());
            std::future::ready(Ok::<_, BoxError>(reqwest::Response::from(answer)))
        });
        (svc, shared)
    }

    fn get() -> reqwest::Request {
        reqwest::Request::new(reqwest::Method::GET, "http://provider.test/".parse().unwrap())
    }

    const SECOND: Duration = Duration::from_secs(1);

    #[tokio::test(start_paused = true)]
    async fn paced_at_the_published_limit_the_provider_never_refuses() {
        let (provider, shared) = provider(5, SECOND);
        let client = paced(provider, 5, SECOND, Duration::from_secs(60)).unwrap();
        let start = tokio::time::Instant::now();
        let calls: Vec<_> = (0..20).map(|_| tokio::spawn(send(client.clone(), get()))).collect();
        for c in calls {
            assert_eq!(c.await.unwrap().unwrap().0.status(), 200);
        }
        let p = lock(&shared);
        assert_eq!(p.log.len(), 20, "no retries: nothing was refused");
        assert!(p.log.iter().all(|a| a.refused.is_none()), "no 429 at all");
        // 20 requests, one every (1s + 100ms) / 5 = 220ms, the first at once.
        assert_eq!(p.log.last().unwrap().at - start, Duration::from_millis(19 * 220));
    }

    #[tokio::test(start_paused = true)]
    async fn without_the_layer_a_burst_is_refused_beyond_the_limit() {
        let (provider, shared) = provider(5, SECOND);
        let calls: Vec<_> = (0..10).map(|_| tokio::spawn(provider.clone().oneshot(get()))).collect();
        let mut refused = 0;
        for c in calls {
            refused += usize::from(c.await.unwrap().unwrap().status() == 429);
        }
        assert_eq!(refused, 5);
        assert_eq!(lock(&shared).log.len(), 10);
    }

    #[tokio::test(start_paused = true)]
    async fn a_429_benches_the_account_for_every_queued_request() {
        // The provider really allows 2/s though it published 5/s: the mirror, pacing at
        // 5/s, runs into its limit once in each of its windows.
        let (provider, shared) = provider(2, SECOND);
        let client = paced(provider, 5, SECOND, Duration::from_secs(60)).unwrap();
        let start = tokio::time::Instant::now();
        let calls: Vec<_> = (0..10).map(|_| tokio::spawn(send(client.clone(), get()))).collect();
        let mut ok = 0;
        for c in calls {
            ok += usize::from(c.await.unwrap().unwrap().0.status() == 200);
        }
        let p = lock(&shared);
        let refusals: Vec<_> = p.log.iter().filter_map(|a| Some((a.at, a.refused?))).collect();
        assert!(!refusals.is_empty(), "the provider is stricter than it said");
        for &(at, wait) in &refusals {
            // The whole account waits for the provider's retry time: nothing is sent
            // before it, from any queued request.
            let early = p.log.iter().filter(|a| a.at > at && a.at < at + wait).count();
            assert_eq!(early, 0, "a request reached the provider while the account was benched");
        }
        // Without the bench the mirror would send one every 220ms into the full window;
        // with it, at most one request per provider window is refused.
        let windows = (p.log.last().unwrap().at - start).as_secs() + 1;
        assert!(refusals.len() as u64 <= windows, "{} refusals in {windows} windows", refusals.len());
        assert_eq!(ok, p.log.len() - refusals.len(), "every admitted request is an answered one");
        assert!(ok >= 9, "a refused request is retried once, after the bench: {ok} of 10 got through");
    }

    #[tokio::test]
    async fn a_zero_limit_is_an_error_not_a_panic() {
        let (provider, _) = provider(1, SECOND);
        assert!(paced(provider, 0, SECOND, SECOND).is_err());
    }
}
