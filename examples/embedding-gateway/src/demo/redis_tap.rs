//! A tap between the fleet and Redis: a loopback proxy that forwards every byte both ways
//! and keeps a copy of the script calls the replicas send, so that the demo can replay
//! them back to back afterwards. A server this idle pays more for each call than a busy
//! one (its caches are cold, it wakes for each), and the demo's fleet keeps it idle: the
//! replay measures what the same work costs a server kept busy, which is what bounds how
//! many answers one Redis core carries.

use std::sync::{Arc, Mutex, PoisonError};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

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

/// Copies the server's bytes back as they come, and the client's on, recording each
/// complete script call among them.
async fn forward(client: TcpStream, upstream: TcpStream, kept: Recorded) {
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = upstream.into_split();
    let back = tokio::spawn(async move {
        let _ = tokio::io::copy(&mut server_read, &mut client_write).await;
    });
    let mut buf = vec![0u8; 64 * 1024];
    let mut pending = Vec::new();
    loop {
        let n = match client_read.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if server_write.write_all(&buf[..n]).await.is_err() {
            break;
        }
        pending.extend_from_slice(&buf[..n]);
        let mut at = 0;
        while let Some((args, used)) = parse_command(&pending[at..]) {
            at += used;
            let script =
                args.first().is_some_and(|c| c.eq_ignore_ascii_case(b"EVALSHA") || c.eq_ignore_ascii_case(b"EVAL"));
            if script {
                let mut kept = kept.lock().unwrap_or_else(PoisonError::into_inner);
                if kept.len() < KEPT {
                    kept.push(args);
                }
            }
        }
        pending.drain(..at);
        if pending.first().is_some_and(|&b| b != b'*') {
            // Not what a client library sends: forwarded, not recorded.
            pending.clear();
        }
    }
    back.abort();
}

/// One command as a client sends it (a RESP array of bulk strings), and the bytes it
/// took; `None` until it is all there.
fn parse_command(bytes: &[u8]) -> Option<(Vec<Vec<u8>>, usize)> {
    let (count, mut at) = header(bytes, b'*')?;
    let mut args = Vec::with_capacity(count);
    for _ in 0..count {
        let (len, used) = header(&bytes[at..], b'$')?;
        at += used;
        let end = at.checked_add(len)?;
        if bytes.len() < end + 2 {
            return None;
        }
        args.push(bytes[at..end].to_vec());
        at = end + 2;
    }
    Some((args, at))
}

/// A RESP header line of `kind` (`*3\r\n`): its number and the bytes it took.
fn header(bytes: &[u8], kind: u8) -> Option<(usize, usize)> {
    if bytes.first() != Some(&kind) {
        return None;
    }
    let end = bytes.windows(2).position(|w| w == b"\r\n")?;
    let n = std::str::from_utf8(&bytes[1..end]).ok()?.parse().ok()?;
    Some((n, end + 2))
}

#[cfg(test)]
mod tests {
    use super::parse_command;

    #[test]
    fn a_command_is_parsed_once_it_is_whole() {
        let bytes = b"*3\r\n$7\r\nEVALSHA\r\n$2\r\nab\r\n$1\r\n0\r\n*1\r\n$4\r\nPING\r\n";
        let (args, used) = parse_command(bytes).unwrap();
        assert_eq!(args, vec![b"EVALSHA".to_vec(), b"ab".to_vec(), b"0".to_vec()]);
        assert_eq!(parse_command(&bytes[used..]).unwrap().0, vec![b"PING".to_vec()]);
        assert!(parse_command(&bytes[..used - 1]).is_none(), "a command cut short waits for the rest");
        assert!(parse_command(b"*2\r\n$3\r\nGET").is_none());
    }
}
