//! How many replicas the fleet has, as Redis sees them: each replica of `serve --redis`
//! says it is alive every [`BEAT`], and counts the replicas heard within [`WINDOW`].
//!
//! `--replicas N` sizes what a replica decides alone while Redis is away (`1 / N` of every
//! limit and account). A wrong `N` goes unnoticed until Redis goes away, and then costs
//! the upstream's `429`s (too large a share) or idle capacity (too small). The roster
//! makes it visible: `/readyz` states the replicas configured and seen, and a replica that
//! sees more replicas than it was told warns (at most once every few seconds), naming the
//! flag to fix.
//!
//! One key per deployment, a sorted set of replica ids scored by the time of their last
//! beat in Redis' own clock (`TIME`, so replicas' clocks do not matter); each beat is one
//! script: add itself, drop the replicas not heard within the window, count. The key
//! expires when the whole fleet is gone.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tower_limits_redis::redis;

use crate::logging::Throttle;

/// How often a replica says it is alive.
pub const BEAT: Duration = Duration::from_secs(1);

/// How long a replica counts as alive after its last beat.
pub const WINDOW: Duration = Duration::from_secs(5);

// Times in microseconds, written with `%.0f`: Lua would write them with 14 digits.
const SCRIPT: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
redis.call('ZADD', KEYS[1], string.format('%.0f', now), ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. string.format('%.0f', now - tonumber(ARGV[2])))
redis.call('PEXPIRE', KEYS[1], math.ceil(tonumber(ARGV[2]) / 1000) * 2)
return redis.call('ZCARD', KEYS[1])
";

/// One beat of replica `id` in the roster at `key`: the replicas heard within `window`,
/// this one included.
///
/// # Errors
/// Redis does not answer, or answers an error.
pub async fn beat(
    conn: &mut redis::aio::MultiplexedConnection,
    key: &str,
    id: &str,
    window: Duration,
) -> redis::RedisResult<u64> {
    let window_us = u64::try_from(window.as_micros()).unwrap_or(u64::MAX).max(1);
    redis::Script::new(SCRIPT).key(key).arg(id).arg(window_us).invoke_async(conn).await
}

/// What this replica knows of the fleet's size.
#[derive(Debug)]
pub struct FleetSize {
    configured: u64,
    seen: AtomicU64,
    warnings: Throttle,
}

impl FleetSize {
    /// A replica told there are `configured` replicas, having seen none yet.
    #[must_use]
    pub fn new(configured: u64) -> Self {
        FleetSize { configured: configured.max(1), seen: AtomicU64::new(0), warnings: Throttle::default() }
    }

    /// The replicas `--replicas` said.
    #[must_use]
    pub fn configured(&self) -> u64 {
        self.configured
    }

    /// The replicas heard within the window at the last beat (0 before one succeeded).
    #[must_use]
    pub fn seen(&self) -> u64 {
        self.seen.load(Ordering::Relaxed)
    }

    /// Records a count; warns when the fleet is larger than configured.
    pub fn saw(&self, replicas: u64) {
        self.seen.store(replicas, Ordering::Relaxed);
        if replicas > self.configured {
            if let Some(suppressed) = self.warnings.ready() {
                tracing::warn!(
                    configured = self.configured,
                    seen = replicas,
                    suppressed,
                    "more replicas share the limits than --replicas says: while Redis is away each would use \
                     1/{} of every limit and account, {} together; start them with --replicas {replicas}",
                    self.configured,
                    format_args!("{replicas}/{}", self.configured),
                );
            }
        }
    }

    /// The counts as a JSON object, for `/readyz`.
    #[must_use]
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({ "configured": self.configured, "seen": self.seen() })
    }
}

/// Beats for this replica (`id`) in the roster of `namespace` on `url` every [`BEAT`],
/// until the process ends; connects (and reconnects) on its own.
pub fn spawn(size: Arc<FleetSize>, url: String, namespace: &str, id: String) {
    let key = format!("{namespace}:replicas");
    tokio::spawn(async move {
        let mut conn = None;
        loop {
            if conn.is_none() {
                conn = match redis::Client::open(url.as_str()) {
                    Ok(client) => tokio::time::timeout(BEAT, client.get_multiplexed_async_connection())
                        .await
                        .ok()
                        .and_then(Result::ok),
                    Err(_) => return,
                };
            }
            if let Some(c) = conn.as_mut() {
                match tokio::time::timeout(BEAT, beat(c, &key, &id, WINDOW)).await {
                    Ok(Ok(n)) => size.saw(n),
                    _ => conn = None,
                }
            }
            tokio::time::sleep(BEAT).await;
        }
    });
}
