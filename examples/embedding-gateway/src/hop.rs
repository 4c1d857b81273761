//! A minimal reverse proxy, the baseline of the benchmark ([`crate::bench`]): what one
//! proxy hop costs in Rust, and nothing else.
//!
//! Every request (method, path and query, headers, body) goes to the upstream over a
//! pooled keep-alive client (hyper-util's legacy client), and the answer streams back as
//! it comes. One task per connection (hyper's HTTP/1.1 server), no limits, no logs, no
//! timeouts: the floor under any gateway written with the same crates.
//!
//! Only the headers that belong to a single hop are left out: `Host` (the client names
//! the upstream's) and `Connection` with `Keep-Alive` (each side keeps its own
//! connection). A call that fails is answered `502`.

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::pin::pin;

use bytes::Bytes;
use http::header::{CONNECTION, HOST};
use http::uri::{Authority, PathAndQuery, Scheme};
use http::{Request, Response, StatusCode, Uri};
use http_body_util::{Either, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;

/// The answer's body: the upstream's, streamed, or the proxy's own `502`.
type HopBody = Either<Incoming, Full<Bytes>>;

/// Where the hop sends every request: the scheme and authority of the upstream's URL.
#[derive(Debug, Clone)]
pub struct Upstream {
    scheme: Scheme,
    authority: Authority,
}

impl std::str::FromStr for Upstream {
    type Err = String;

    /// Reads `http://host:port` (a path, if any, is ignored: requests keep theirs).
    fn from_str(s: &str) -> Result<Self, String> {
        let uri: Uri = s.parse().map_err(|e| format!("{s:?} is not a URL: {e}"))?;
        let scheme = uri.scheme().cloned().ok_or_else(|| format!("{s:?} has no scheme (http://host:port)"))?;
        if scheme != Scheme::HTTP {
            return Err(format!("{s:?}: only plain http:// upstreams are supported"));
        }
        let authority = uri.authority().cloned().ok_or_else(|| format!("{s:?} has no host"))?;
        Ok(Upstream { scheme, authority })
    }
}

/// Proxies every connection accepted on `listener` to `upstream` until `shutdown`
/// completes; connections still open then are dropped.
///
/// # Errors
/// None so far: a failing `accept` is retried (after a short pause, not in a loop).
pub async fn serve(listener: TcpListener, upstream: Upstream, shutdown: impl Future<Output = ()>) -> io::Result<()> {
    let client: Client<HttpConnector, Incoming> =
        Client::builder(TokioExecutor::new()).pool_max_idle_per_host(1024).build_http();
    let mut shutdown = pin!(shutdown);
    loop {
        let (stream, _) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(_) => {
                    // Out of file descriptors, most likely: let some close.
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => return Ok(()),
        };
        let _ = stream.set_nodelay(true);
        let client = client.clone();
        let upstream = upstream.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| forward(client.clone(), upstream.clone(), req));
            let _ = hyper::server::conn::http1::Builder::new()
                .keep_alive(true)
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

/// Sends `req` on to `upstream` and gives back its answer, body streamed.
async fn forward(
    client: Client<HttpConnector, Incoming>,
    upstream: Upstream,
    req: Request<Incoming>,
) -> Result<Response<HopBody>, Infallible> {
    let (mut parts, body) = req.into_parts();
    let path = parts.uri.path_and_query().cloned().unwrap_or_else(|| PathAndQuery::from_static("/"));
    let uri = Uri::builder().scheme(upstream.scheme).authority(upstream.authority).path_and_query(path).build();
    let Ok(uri) = uri else { return Ok(bad_gateway("the upstream URL is not valid")) };
    parts.uri = uri;
    parts.headers.remove(HOST);
    parts.headers.remove(CONNECTION);
    parts.headers.remove("keep-alive");
    match client.request(Request::from_parts(parts, body)).await {
        Ok(response) => Ok(response.map(Either::Left)),
        Err(_) => Ok(bad_gateway("the upstream could not be reached")),
    }
}

fn bad_gateway(why: &'static str) -> Response<HopBody> {
    let mut r = Response::new(Either::Right(Full::new(Bytes::from_static(why.as_bytes()))));
    *r.status_mut() = StatusCode::BAD_GATEWAY;
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn upstreams_are_plain_http_urls() {
        let u: Upstream = "http://127.0.0.1:9100".parse().unwrap();
        assert_eq!(u.authority.as_str(), "127.0.0.1:9100");
        assert!("https://example.com".parse::<Upstream>().is_err());
        assert!("127.0.0.1:9100".parse::<Upstream>().is_err());
    }
}
