//! How many replicas the fleet has, as Redis sees them: each replica of `serve --redis`
//! says it is alive every [`BEAT`], and counts the replicas heard within [`WINDOW`].
//!
//! What a replica decides alone while Redis is away is its share of every limit and
//! account: `1 / N` for a fleet of `N`. `--replicas N` was the only source of `N`, and a
//! wrong one went unnoticed until Redis went away, then cost the upstream's `429`s (too
//! large a share) or idle capacity (too small). With the roster each replica cuts its
//! shares for the larger of `--replicas` and the replicas it hears: at once when the fleet
//! grows, and only after [`SHRINK_AFTER`] of hearing fewer when it shrinks (a replica
//! that misses beats may still be serving with its share). `/readyz` states the
//! replicas configured, seen and sized for. While Redis is away no beat is heard, and the
//! last size stands.
//!
//! One key per deployment, a sorted set of replica ids scored by the time of their last
//! beat in Redis' own clock (`TIME`, so replicas' clocks do not matter); each beat is one
//! script: add itself, drop the replicas not heard within the window, count. The key
//! expires when the whole fleet is gone.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tower_limits_redis::redis;

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

/// How long the fleet must look smaller before a replica takes a larger share: a
/// replica that misses a few beats (a pause, a partition from Redis) may still be serving
/// with its share.
pub const SHRINK_AFTER: Duration = Duration::from_secs(60);

/// What this replica knows of the fleet's size, and the size it decides by.
#[derive(Debug)]
pub struct FleetSize {
    configured: u64,
    seen: AtomicU64,
    /// The fleet size this replica's shares are cut for: never below `configured`; up at
    /// once when more replicas are seen, down only after [`SHRINK_AFTER`].
    sized_for: AtomicU64,
    smaller_since: Mutex<Option<tokio::time::Instant>>,
}

impl FleetSize {
    /// A replica told there are `configured` replicas, having seen none yet.
    #[must_use]
    pub fn new(configured: u64) -> Self {
        let configured = configured.max(1);
        FleetSize {
            configured,
            seen: AtomicU64::new(0),
            sized_for: AtomicU64::new(configured),
            smaller_since: Mutex::new(None),
        }
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

    /// The fleet size this replica's shares are cut for now.
    #[must_use]
    pub fn sized_for(&self) -> u64 {
        self.sized_for.load(Ordering::Relaxed)
    }

    /// Records a count; the new size to cut the shares for, when it changed.
    pub fn saw(&self, replicas: u64) -> Option<u64> {
        self.seen.store(replicas, Ordering::Relaxed);
        let target = replicas.max(self.configured);
        let current = self.sized_for();
        let mut smaller = self.smaller_since.lock().unwrap_or_else(PoisonError::into_inner);
        let resized = if target > current {
            Some(target)
        } else if target < current {
            let since = *smaller.get_or_insert_with(tokio::time::Instant::now);
            (since.elapsed() >= SHRINK_AFTER).then_some(target)
        } else {
            None
        };
        if target >= current || resized.is_some() {
            *smaller = None;
        }
        if let Some(n) = resized {
            self.sized_for.store(n, Ordering::Relaxed);
        }
        resized
    }

    /// The counts as a JSON object, for `/readyz`.
    #[must_use]
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({ "configured": self.configured, "seen": self.seen(), "sized_for": self.sized_for() })
    }
}

/// Beats for this replica (`id`) in the roster of `namespace` on `url` every [`BEAT`],
/// until the process ends; connects (and reconnects) on its own. `resize` is called with
/// the fleet size to cut the shares for whenever it changes.
pub fn spawn(size: Arc<FleetSize>, url: String, namespace: &str, id: String, resize: impl Fn(u64) + Send + 'static) {
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
                    Ok(Ok(n)) => {
                        if let Some(sized_for) = size.saw(n) {
                            resize(sized_for);
                        }
                    }
                    _ => conn = None,
                }
            }
            tokio::time::sleep(BEAT).await;
        }
    });
}
