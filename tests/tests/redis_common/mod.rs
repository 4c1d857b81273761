//! Helpers shared by the Redis test files: a runtime, a connection, fresh namespaces.

#![allow(dead_code, unreachable_pub)]

use std::sync::atomic::{AtomicU64, Ordering};

use tower_limits_core::LimitSetPolicy;
use tower_limits_redis::redis;
use tower_limits_redis::{RedisBackend, RedisBackendBuilder, RedisConnection};

/// A runtime for one test (Redis tests start their server before it, blocking).
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("a tokio runtime")
}

/// A namespace no other test uses.
pub fn namespace(test: &str) -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    format!("t-{test}-{}-{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed))
}

/// Connects to `url`.
pub async fn connect(url: &str) -> RedisConnection {
    RedisConnection::connect(url).await.expect("a connection to the test's redis")
}

/// A plain connection for administrative commands (SCRIPT FLUSH, CLIENT PAUSE, ...).
pub async fn admin(url: &str) -> redis::aio::MultiplexedConnection {
    redis::Client::open(url).unwrap().get_multiplexed_async_connection().await.expect("an admin connection")
}

/// Runs one command on the admin connection.
pub async fn cmd<T: redis::FromRedisValue>(conn: &mut redis::aio::MultiplexedConnection, args: &[&str]) -> T {
    let mut c = redis::cmd(args[0]);
    for a in &args[1..] {
        c.arg(*a);
    }
    c.query_async(conn).await.unwrap_or_else(|e| panic!("{args:?}: {e}"))
}

/// A builder with a fresh namespace and the test clock. Its timeout is generous: these
/// tests are about semantics, and a loaded CI machine can take longer than the
/// production default of 50ms to answer (the fault tests set their own).
pub fn manual(policy: LimitSetPolicy, test: &str) -> RedisBackendBuilder {
    RedisBackend::builder(policy).namespace(namespace(test)).manual_clock().timeout(std::time::Duration::from_secs(5))
}
