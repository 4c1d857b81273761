//! An outbound client that paces itself.
//!
//! A `reqwest::Client` is wrapped in tower: a `LimitSetLayer` in wait mode over a
//! one-account [`LimitPool`] mirroring the provider's published limit, so requests wait
//! (in arrival order, to the exact instant) instead of being sent into a refusal. Every
//! answer is reported back to the pool: a `429` with `Retry-After` benches the account
//! until then, so **all** queued requests wait for it, not only the refused one, which
//! is retried once after the wait.
//!
//! Run it with `cargo run -p example-reqwest-client -- http://127.0.0.1:3000/` against
//! any HTTP server (for example the axum example).
#![allow(clippy::print_stdout)] // the demo prints what it got

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tower::{BoxError, Service, ServiceBuilder, ServiceExt};
use tower_limits::http::upstream_report;
use tower_limits::{Instant, LimitPolicy, LimitPool, LimitSet, LimitSetLayer, LimitSetPolicy, Rate, Selection};

/// Reports every answer of the provider to the pool.
#[derive(Clone)]
struct Report<S> {
    inner: S,
    pool: LimitPool,
    now: Arc<dyn Fn() -> Instant + Send + Sync>,
}

impl<S> Service<reqwest::Request> for Report<S>
where
    S: Service<reqwest::Request, Response = reqwest::Response> + Send,
    S::Future: Send + 'static,
    S::Error: Into<BoxError>,
{
    type Response = reqwest::Response;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<reqwest::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, req: reqwest::Request) -> Self::Future {
        let (pool, now) = (self.pool.clone(), self.now.clone());
        let fut = self.inner.call(req);
        Box::pin(async move {
            let response = fut.await.map_err(Into::into)?;
            pool.observe(0, &upstream_report(response.status(), response.headers()), now());
            Ok(response)
        })
    }
}

/// The paced client over any transport (reqwest in `main`, a mock provider in tests):
/// `rate` as the provider publishes it, waiting at most `max_wait` for room.
fn paced<S>(
    transport: S,
    rate: Rate,
    max_wait: Duration,
) -> impl Service<reqwest::Request, Response = reqwest::Response, Error = BoxError, Future: Send> + Clone
where
    S: Service<reqwest::Request, Response = reqwest::Response> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Into<BoxError>,
{
    let account =
        LimitSet::new(LimitSetPolicy::new().limit(LimitPolicy::gcra("provider", rate, 1))).expect("a valid policy");
    let pool = LimitPool::builder(Selection::RoundRobin).member("provider", account, ()).build().expect("one member");
    let limits = LimitSetLayer::with_backend(pool.clone()).wait(max_wait);
    let clock = limits.clone();
    let report = Report { inner: transport, pool, now: Arc::new(move || clock.now()) };
    ServiceBuilder::new().layer(limits).service(report)
}

/// Sends `req` through `client`, retrying once if the provider still refused it (the
/// retry waits in the limiter for the provider's `Retry-After`).
async fn send<C>(client: C, req: reqwest::Request) -> Result<reqwest::Response, BoxError>
where
    C: Service<reqwest::Request, Response = reqwest::Response, Error = BoxError> + Clone,
{
    let again = req.try_clone();
    let response = client.clone().oneshot(req).await?;
    match again {
        Some(again) if response.status() == http::StatusCode::TOO_MANY_REQUESTS => client.oneshot(again).await,
        _ => Ok(response),
    }
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let url = std::env::args().nth(1).unwrap_or_else(|| "http://127.0.0.1:3000/".to_owned());
    let http = reqwest::Client::new();
    let transport = tower::service_fn(move |req: reqwest::Request| http.execute(req));
    let client = paced(transport, Rate::per_second(2), Duration::from_secs(30));
    for i in 0..6 {
        let req = reqwest::Request::new(reqwest::Method::GET, url.parse()?);
        let response = send(client.clone(), req).await?;
        println!("request {i}: {}", response.status());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;

    /// When each request reached the provider, and the status it got.
    type Log = Arc<Mutex<Vec<(Duration, u16)>>>;

    /// A provider that allows `per_second` requests in each aligned second and answers
    /// 429 with `Retry-After` beyond; it records when each request arrived and its status.
    fn provider(
        per_second: u64,
    ) -> (impl Service<reqwest::Request, Response = reqwest::Response, Error = BoxError, Future: Send> + Clone, Log)
    {
        let log = Arc::new(Mutex::new(Vec::new()));
        let seen = log.clone();
        let start = tokio::time::Instant::now();
        let svc = tower::service_fn(move |_req: reqwest::Request| {
            let at = start.elapsed();
            let mut log = seen.lock().unwrap();
            let second = at.as_secs();
            let used = log.iter().filter(|(t, s): &&(Duration, u16)| t.as_secs() == second && *s == 200).count() as u64;
            let mut answer = http::Response::builder();
            let status = if used < per_second {
                200
            } else {
                let wait = 1_000 - at.subsec_millis() as u64;
                answer = answer.header("retry-after-ms", wait.to_string());
                429
            };
            log.push((at, status));
            let response = answer.status(status).body(String::new()).unwrap();
            std::future::ready(Ok::<_, BoxError>(reqwest::Response::from(response)))
        });
        (svc, log)
    }

    fn get() -> reqwest::Request {
        reqwest::Request::new(reqwest::Method::GET, "http://provider.test/".parse().unwrap())
    }

    #[tokio::test(start_paused = true)]
    async fn paced_at_the_published_rate_the_provider_never_refuses() {
        let (provider, log) = provider(5);
        let client = paced(provider, Rate::per_second(5), Duration::from_secs(60));
        let calls: Vec<_> = (0..20).map(|_| tokio::spawn(send(client.clone(), get()))).collect();
        for c in calls {
            assert_eq!(c.await.unwrap().unwrap().status(), 200);
        }
        let log = log.lock().unwrap();
        assert_eq!(log.len(), 20);
        assert!(log.iter().all(|(_, s)| *s == 200), "no 429 at all");
        assert_eq!(log.last().unwrap().0, Duration::from_millis(3_800), "20 requests at 5/s, the first at once");
    }

    #[tokio::test(start_paused = true)]
    async fn a_stricter_provider_is_honoured_through_retry_after() {
        // The provider really allows 2/s though it published 5/s.
        let (provider, log) = provider(2);
        let client = paced(provider, Rate::per_second(5), Duration::from_secs(60));
        for _ in 0..10 {
            assert_eq!(send(client.clone(), get()).await.unwrap().status(), 200, "every request gets through");
        }
        let log = log.lock().unwrap();
        let refused = log.iter().filter(|(_, s)| *s == 429).count();
        assert!(refused > 0, "the provider is stricter than it said");
        assert!(refused <= 5, "each refusal benches the account until the provider's retry time: {refused}");
    }
}
