//! Logs: `tracing` events written by `tracing-subscriber`, as text or as JSON lines.
//!
//! The level comes from `RUST_LOG` (`info` when it is not set; `RUST_LOG=access=off`
//! silences the access lines, `RUST_LOG=debug` shows the connection timeouts). What an
//! operator sees at `info`:
//!
//! - one `access` line per request: method, path, status, tenant, tokens, time queued,
//!   time upstream, account, total time;
//! - warnings, at most one per kind every few seconds with the number left out, for
//!   upstream errors, upstream `429`s and timeouts, the limits backend (Redis) going away
//!   and coming back, and the connection limit reached;
//! - start, drain and stop.
//!
//! [`Throttle`] is the rate limit of those warnings.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::time::Instant;
use tracing_subscriber::EnvFilter;

/// How the log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LogFormat {
    /// One human-readable line per event (the default).
    #[default]
    Text,
    /// One JSON object per line, for log collectors.
    Json,
}

impl std::str::FromStr for LogFormat {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "text" => Ok(LogFormat::Text),
            "json" => Ok(LogFormat::Json),
            other => Err(format!("{other:?} is not a log format: \"text\" or \"json\"")),
        }
    }
}

/// Installs the global subscriber: the level from `RUST_LOG` (`info` by default), lines
/// on stderr. Does nothing if one is installed already.
pub fn init(format: LogFormat) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Text => builder.with_ansi(false).try_init(),
        LogFormat::Json => builder.json().flatten_event(true).with_current_span(false).try_init(),
    };
}

/// How often a throttled warning may be written.
pub const WARN_EVERY: Duration = Duration::from_secs(5);

/// A rate limit for one kind of warning: at most one line every [`WARN_EVERY`], and that
/// line says how many were left out since the last one.
#[derive(Debug, Default)]
pub struct Throttle {
    last: Mutex<Option<Instant>>,
    suppressed: AtomicU64,
}

impl Throttle {
    /// Whether a line may be written now; if so, how many were left out before it.
    pub fn ready(&self) -> Option<u64> {
        let now = Instant::now();
        let mut last = self.last.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        match *last {
            Some(t) if now.saturating_duration_since(t) < WARN_EVERY => {
                self.suppressed.fetch_add(1, Ordering::Relaxed);
                None
            }
            _ => {
                *last = Some(now);
                Some(self.suppressed.swap(0, Ordering::Relaxed))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_throttle_writes_one_line_per_period_and_counts_the_rest() {
        let t = Throttle::default();
        assert_eq!(t.ready(), Some(0));
        assert_eq!(t.ready(), None);
        assert_eq!(t.ready(), None);
        tokio::time::advance(WARN_EVERY).await;
        assert_eq!(t.ready(), Some(2));
        assert_eq!(t.ready(), None);
    }
}
