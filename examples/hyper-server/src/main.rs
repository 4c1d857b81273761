//! A bare hyper server (no framework) with a `LimitSetLayer` in a `ServiceBuilder`:
//! every connection's service is a clone of one limited service, so the limit holds
//! across connections.
//!
//! Run it with `cargo run -p example-hyper-server`.
#![allow(clippy::print_stdout)] // a demo server says where it listens

use std::convert::Infallible;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tower::ServiceBuilder;
use tower_limits::http::HttpAnswer;
use tower_limits::{LimitPolicy, LimitSetLayer, LimitSetPolicy, Rate};

/// Serves `listener` forever: `rate` for everyone with a burst of two, four in flight.
async fn serve(listener: TcpListener, rate: Rate) -> std::io::Result<()> {
    let limits = LimitSetLayer::new(
        LimitSetPolicy::new()
            .limit(LimitPolicy::gcra("requests", rate, 2))
            .limit(LimitPolicy::semaphore("in-flight", 4)),
    )
    .expect("a valid policy")
    .reject_with(HttpAnswer::new());
    let service = ServiceBuilder::new().layer(limits).service_fn(|_req: Request<Incoming>| async {
        Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"hello\n"))))
    });
    loop {
        let (stream, _) = listener.accept().await?;
        let service = TowerToHyperService::new(service.clone());
        tokio::spawn(async move {
            // A connection that fails only affects itself.
            let _ = http1::Builder::new().serve_connection(TokioIo::new(stream), service).await;
        });
    }
}

#[tokio::main]
async fn main() -> std::io::Result<()> {
    let listener = TcpListener::bind("127.0.0.1:3001").await?;
    println!("listening on http://{}", listener.local_addr()?);
    serve(listener, Rate::per_second(2)).await
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    use super::*;

    /// One request on a fresh connection; the status line and headers.
    async fn get(addr: std::net::SocketAddr) -> String {
        let mut stream = TcpStream::connect(addr).await.unwrap();
        stream.write_all(b"GET / HTTP/1.1\r\nhost: test\r\nconnection: close\r\n\r\n").await.unwrap();
        let mut answer = String::new();
        stream.read_to_string(&mut answer).await.unwrap();
        answer
    }

    #[tokio::test]
    async fn the_limit_holds_across_connections() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        // One a minute with a burst of two: the third request, on a third connection,
        // is refused whatever the timing of the test.
        let server = tokio::spawn(serve(listener, Rate::per_minute(1)));
        let answers = [get(addr).await, get(addr).await, get(addr).await];
        assert!(answers[0].starts_with("HTTP/1.1 200"), "{}", answers[0]);
        assert!(answers[1].starts_with("HTTP/1.1 200"), "{}", answers[1]);
        assert!(answers[2].starts_with("HTTP/1.1 429"), "every rate limit paces its callers: {}", answers[2]);
        assert!(answers[2].contains("ratelimit-policy: \"requests\";q=2;w=120"), "{}", answers[2]);
        let retry: u64 = answers[2]
            .lines()
            .find_map(|l| l.strip_prefix("retry-after: "))
            .and_then(|v| v.trim().parse().ok())
            .expect("a retry-after field");
        assert!((59..=60).contains(&retry), "the next slot opens a minute after the first: {retry}");
        server.abort();
    }
}
