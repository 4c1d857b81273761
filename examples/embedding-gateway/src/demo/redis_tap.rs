//! A tap between the fleet and Redis: a loopback proxy that forwards every byte both ways
//! and keeps a copy of the script calls the replicas send, so that the demo can replay
//! them back to back afterwards. A server this idle pays more for each call than a busy
//! one (its caches are cold, it wakes for each), and the demo's fleet keeps it idle: the
//! replay measures what the same work costs a server kept busy, which is what bounds how
//! many answers one Redis core carries.

use std::sync::{Arc, Mutex, PoisonError};

use combine::parser::combinator::AnySendSyncPartialState;
use combine::stream::{Decoder, PointerOffset};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tower_limits_redis::redis::{self, Value};

/// The most script calls kept (a long run replays its first ones).
const KEPT: usize = 200_000;

/// The script calls seen so far, each as its arguments.
pub(super) type Recorded = Arc<Mutex<Vec<Vec<Vec<u8>>>>>;

/// A running tap: the URL the replicas connect to, and what it recorded.
pub(super) struct Tap {
    pub(super) url: String,
    pub(super) recorded: Recorded,
}

impl Tap {
    /// Listens on a loopback port and forwards to the server of `url` (a `redis://` URL
    /// over TCP); `None` for any other URL (TLS, a Unix socket), which the demo then
    /// measures live only.
    pub(super) async fn start(url: &str) -> Result<Option<Tap>, tower::BoxError> {
        let mut url = url::Url::parse(url)?;
        let (Some(host), "redis") = (url.host_str(), url.scheme()) else { return Ok(None) };
        let server = format!("{host}:{}", url.port().unwrap_or(6379));
        let listener = TcpListener::bind(("127.0.0.1", 0)).await?;
        let port = listener.local_addr()?.port();
        url.set_host(Some("127.0.0.1"))?;
        url.set_port(Some(port)).map_err(|()| "the Redis URL cannot take a port")?;
        let recorded: Recorded = Arc::default();
        let kept = recorded.clone();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let (server, kept) = (server.clone(), kept.clone());
                tokio::spawn(async move {
                    if let Ok(upstream) = TcpStream::connect(&server).await {
                        // Small writes go at once, as the client's own socket sends them.
                        let _ = (client.set_nodelay(true), upstream.set_nodelay(true));
                        forward(client, upstream, kept).await;
                    }
                });
            }
        });
        Ok(Some(Tap { url: url.into(), recorded }))
    }
}

/// Copies the server's bytes back as they come, and the client's on and into a pipe
/// whose reader records the script calls among them.
async fn forward(client: TcpStream, upstream: TcpStream, kept: Recorded) {
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = upstream.into_split();
    let back = tokio::spawn(async move {
        let _ = tokio::io::copy(&mut server_read, &mut client_write).await;
    });
    let (mut copy, commands) = tokio::io::duplex(64 * 1024);
    let recording = tokio::spawn(record(commands, kept));
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match client_read.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if server_write.write_all(&buf[..n]).await.is_err() {
            break;
        }
        // (A recorder that stopped, on bytes no client library sends, records no more.)
        let _ = copy.write_all(&buf[..n]).await;
    }
    drop(copy);
    let _ = recording.await;
    back.abort();
}

/// Reads the commands a client sends (RESP arrays of bulk strings) from `commands` until
/// it ends or holds something else, and keeps the script calls' arguments.
async fn record(mut commands: impl AsyncRead + Unpin, kept: Recorded) {
    let mut decoder: Decoder<AnySendSyncPartialState, PointerOffset<[u8]>> = Decoder::new();
    while let Ok(Value::Array(items)) = redis::parse_redis_value_async(&mut decoder, &mut commands).await {
        let args: Option<Vec<Vec<u8>>> =
            items.into_iter().map(|v| if let Value::BulkString(b) = v { Some(b) } else { None }).collect();
        let Some(args) = args else { break };
        if args.first().is_some_and(|c| c.eq_ignore_ascii_case(b"EVALSHA") || c.eq_ignore_ascii_case(b"EVAL")) {
            let mut kept = kept.lock().unwrap_or_else(PoisonError::into_inner);
            if kept.len() < KEPT {
                kept.push(args);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_script_calls_are_kept_once_whole() {
        let kept = Recorded::default();
        let (mut client, commands) = tokio::io::duplex(1024);
        let recording = tokio::spawn(record(commands, kept.clone()));
        let bytes =
            b"*3\r\n$7\r\nEVALSHA\r\n$2\r\nab\r\n$1\r\n0\r\n*1\r\n$4\r\nPING\r\n*2\r\n$4\r\nEVAL\r\n$1\r\nx\r\n";
        // Cut in two within a command: it is recorded once the rest comes.
        client.write_all(&bytes[..20]).await.unwrap();
        client.write_all(&bytes[20..]).await.unwrap();
        drop(client);
        recording.await.unwrap();
        let kept = kept.lock().unwrap().clone();
        assert_eq!(
            kept,
            vec![vec![b"EVALSHA".to_vec(), b"ab".to_vec(), b"0".to_vec()], vec![b"EVAL".to_vec(), b"x".to_vec()]]
        );
    }
}
