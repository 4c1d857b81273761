//! The strict provider the demonstration runs in the same process: it publishes a limit
//! (`limit` requests in any `window`, a sliding window) and enforces it exactly, answering
//! `429 Too Many Requests` with `Retry-After` (whole seconds) and `retry-after-ms` beyond
//! it, as many real APIs do. It is not built with tower-limits on purpose: it stands for
//! someone else's server.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::routing::get;
use tokio::net::TcpListener;
use tokio::time::Instant;

/// One request as the provider saw it: when it arrived and, if refused, the retry delay
/// it answered with.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Arrival {
    pub(crate) at: Instant,
    pub(crate) refused: Option<Duration>,
}

/// The provider's limit and its record of what it admitted and refused.
#[derive(Debug)]
pub(crate) struct StrictWindow {
    limit: usize,
    window: Duration,
    /// Arrival instants of the admitted requests still inside the window, oldest first.
    admitted: VecDeque<Instant>,
    /// Every request, in order of arrival.
    pub(crate) log: Vec<Arrival>,
}

impl StrictWindow {
    /// At most `limit` admitted requests in any `window`.
    pub(crate) fn new(limit: usize, window: Duration) -> Self {
        StrictWindow { limit, window, admitted: VecDeque::new(), log: Vec::new() }
    }

    /// A request arriving at `now`: `None` if admitted, or how long until the window
    /// has room again.
    pub(crate) fn arrive(&mut self, now: Instant) -> Option<Duration> {
        // An admitted request counts while it is less than `window` old.
        while self.admitted.front().is_some_and(|&t| t + self.window <= now) {
            self.admitted.pop_front();
        }
        let refused = if self.admitted.len() < self.limit {
            self.admitted.push_back(now);
            None
        } else {
            self.admitted.front().map(|&oldest| oldest + self.window - now)
        };
        self.log.push(Arrival { at: now, refused });
        refused
    }

    /// The HTTP answer to a request arriving at `now`.
    pub(crate) fn answer(&mut self, now: Instant) -> http::Response<String> {
        let policy = format!("\"requests\";q={};w={}", self.limit, self.window.as_secs_f64());
        let answer = http::Response::builder().header("ratelimit-policy", policy);
        let answer = match self.arrive(now) {
            None => answer.status(200).body("ok\n".to_owned()),
            Some(wait) => {
                let ms = wait.as_nanos().div_ceil(1_000_000);
                answer
                    .status(429)
                    .header("retry-after", ms.div_ceil(1_000).to_string())
                    .header("retry-after-ms", ms.to_string())
                    .body("too many requests\n".to_owned())
            }
        };
        answer.unwrap_or_else(|_| http::Response::new(String::new()))
    }
}

/// The provider's state, shared by its connections and read by the demonstration.
pub(crate) type Shared = Arc<Mutex<StrictWindow>>;

/// Locks the provider's state (a panic elsewhere cannot corrupt a log of arrivals).
pub(crate) fn lock(shared: &Shared) -> std::sync::MutexGuard<'_, StrictWindow> {
    shared.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Serves `GET /` on `listener` until it fails.
pub(crate) async fn serve(listener: TcpListener, shared: Shared) -> std::io::Result<()> {
    let app = Router::new()
        .route("/", get(|State(s): State<Shared>| async move { lock(&s).answer(Instant::now()) }))
        .with_state(shared);
    axum::serve(listener, app).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn never_more_than_the_limit_in_any_window() {
        let mut p = StrictWindow::new(3, Duration::from_secs(1));
        let t0 = Instant::now();
        assert!((0..3).all(|_| p.arrive(t0).is_none()));
        assert_eq!(p.arrive(t0 + Duration::from_millis(400)), Some(Duration::from_millis(600)));
        // Exactly one window later the first three have left it.
        assert_eq!(p.arrive(t0 + Duration::from_secs(1)), None);
        assert_eq!(p.answer(t0 + Duration::from_millis(1_500)).status(), 200);
        assert_eq!(p.arrive(t0 + Duration::from_millis(1_999)), None);
        assert_eq!(p.log.iter().filter(|a| a.refused.is_some()).count(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_refusal_says_when_to_retry() {
        let mut p = StrictWindow::new(1, Duration::from_secs(1));
        let t0 = Instant::now();
        assert_eq!(p.answer(t0).status(), 200);
        let refused = p.answer(t0 + Duration::from_micros(1_500));
        assert_eq!(refused.status(), 429);
        assert_eq!(refused.headers()["retry-after-ms"], "999", "998.5ms, rounded up");
        assert_eq!(refused.headers()["retry-after"], "1");
        assert_eq!(refused.headers()["ratelimit-policy"], "\"requests\";q=1;w=1");
    }
}
