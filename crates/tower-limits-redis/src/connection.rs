//! The connection the backends share: one multiplexed connection to a server (with
//! redis-rs's connection manager reconnecting it in the background), or a cluster client.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{Cmd, RedisResult, Value};

/// A connection to Redis (or Valkey), cheap to clone and shared by every backend built
/// on it.
///
/// Commands from all clones are pipelined on one connection per node. A standalone
/// connection goes through [`ConnectionManager`], which reconnects in the background when
/// the connection drops; a command sent while it reconnects fails (or waits for the new
/// connection), and the backend's own timeout bounds either.
#[derive(Clone)]
pub struct RedisConnection {
    inner: Conn,
    /// Shared by the clones of one connection: tells them from another connection's.
    origin: Arc<()>,
}

#[derive(Clone)]
enum Conn {
    Standalone(ConnectionManager),
    #[cfg(feature = "cluster")]
    Cluster(redis::cluster_async::ClusterConnection),
}

impl fmt::Debug for RedisConnection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisConnection").field("cluster", &self.is_cluster()).finish_non_exhaustive()
    }
}

impl RedisConnection {
    /// Connects to one server at `url` (`redis://host:port/db`, `rediss://` with TLS when
    /// redis-rs is built with it), with reconnection in the background.
    ///
    /// # Errors
    /// A malformed URL, or the first connection failing.
    pub async fn connect(url: &str) -> RedisResult<Self> {
        let client = redis::Client::open(url)?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(Duration::from_secs(1)))
            .set_number_of_retries(2)
            .set_max_delay(Duration::from_millis(200));
        Ok(Self::from_manager(ConnectionManager::new_with_config(client, config).await?))
    }

    /// A connection from a connection manager configured by the caller.
    #[must_use]
    pub fn from_manager(manager: ConnectionManager) -> Self {
        RedisConnection { inner: Conn::Standalone(manager), origin: Arc::new(()) }
    }

    /// Connects to a Redis Cluster through any of its `nodes`.
    ///
    /// # Errors
    /// Malformed URLs, or no node answering.
    #[cfg(feature = "cluster")]
    pub async fn connect_cluster<I, S>(nodes: I) -> RedisResult<Self>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let nodes: Vec<String> = nodes.into_iter().map(|s| s.as_ref().to_owned()).collect();
        let client = redis::cluster::ClusterClient::builder(nodes)
            .connection_timeout(Duration::from_secs(1))
            .retries(2)
            .build()?;
        Ok(Self::from_cluster(client.get_async_connection().await?))
    }

    /// A connection from a cluster connection configured by the caller.
    #[cfg(feature = "cluster")]
    #[must_use]
    pub fn from_cluster(connection: redis::cluster_async::ClusterConnection) -> Self {
        RedisConnection { inner: Conn::Cluster(connection), origin: Arc::new(()) }
    }

    /// Whether this is a Redis Cluster connection (a set's keys must then share a slot).
    #[must_use]
    pub fn is_cluster(&self) -> bool {
        match &self.inner {
            Conn::Standalone(_) => false,
            #[cfg(feature = "cluster")]
            Conn::Cluster(_) => true,
        }
    }

    /// Whether `other` is a clone of this connection.
    pub(crate) fn same_as(&self, other: &RedisConnection) -> bool {
        Arc::ptr_eq(&self.origin, &other.origin)
    }

    /// Sends one command and reads its reply; an error reply is an `Err`.
    pub(crate) async fn query(&self, cmd: &Cmd) -> RedisResult<Value> {
        let value = match &self.inner {
            Conn::Standalone(c) => c.clone().send_packed_command(cmd).await,
            #[cfg(feature = "cluster")]
            Conn::Cluster(c) => {
                use redis::aio::ConnectionLike;
                c.clone().req_packed_command(cmd).await
            }
        }?;
        value.extract_error()
    }
}
