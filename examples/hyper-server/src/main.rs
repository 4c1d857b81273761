//! **Limits around a bare hyper server, no framework.**
//!
//! What it shows: two named layers in a tower `ServiceBuilder` around a plain
//! `service_fn`: a [`GcraLayer`] (a rate with a burst) and a [`SemaphoreLayer`] (requests
//! in flight). Hyper serves each connection with a clone of that one service, and every
//! clone shares the same limits, so they hold across connections. The limits here are
//! global (one for everyone). Refusals are answered by the layers ([`HttpAnswer`]): the
//! rate limit with `429 Too Many Requests`, `Retry-After` and the IETF `RateLimit-Policy`
//! and `RateLimit` fields; the in-flight limit, the server's own capacity, with `503`.
//!
//! API used: `GcraLayer::new(Quota::per_second(nz!(1)).burst(nz!(2)))`,
//! `SemaphoreLayer::new(nz!(4))`, `.refuse_with(HttpAnswer::new())`,
//! `ServiceBuilder::layer`, hyper-util's `TowerToHyperService`.
//!
//! Run: `cargo run -p example-hyper-server` (a scripted demonstration on a loopback port,
//! a few seconds), or `cargo run -p example-hyper-server -- --serve` to keep the server up
//! and try it with curl.
#![allow(clippy::print_stdout)] // a demonstration prints what happens

use std::convert::Infallible;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tower::ServiceBuilder;
use tower_limits::extract::Extractors;
use tower_limits::http::HttpAnswer;
use tower_limits::{GcraLayer, Quota, SemaphoreLayer, nz};

// ---- The limits: the one place this example builds its layers. ----

/// The layers' types: global (one state for everyone), one unit per request, refusals
/// answered as HTTP.
type RateLimit = GcraLayer<Extractors, HttpAnswer>;
type InFlight = SemaphoreLayer<Extractors, HttpAnswer>;

/// For everyone together: `quota` (a rate with a burst), and four requests in flight.
fn limits(quota: Quota) -> (RateLimit, InFlight) {
    (GcraLayer::new(quota).refuse_with(HttpAnswer::new()), SemaphoreLayer::new(nz!(4)).refuse_with(HttpAnswer::new()))
}

// ---- The server. ----

/// Serves `listener` until it fails, every connection through one limited service.
async fn serve(listener: TcpListener, quota: Quota) -> std::io::Result<()> {
    let (rate, in_flight) = limits(quota);
    // The rate limit first: a request it refuses never takes a slot in flight.
    let service = ServiceBuilder::new().layer(rate).layer(in_flight).service_fn(|_req: Request<Incoming>| async {
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

// ---- Running it: a scripted demonstration, or a server to try by hand. ----

/// The demonstration's rate: one a second, with a burst of two.
const QUOTA: Quota = Quota::per_second(nz!(1)).burst(nz!(2));

const USAGE: &str = "usage: cargo run -p example-hyper-server [-- --serve [--port N]]";

#[tokio::main]
async fn main() -> ExitCode {
    example_support::run(USAGE, 3001, |listener| serve(listener, QUOTA), print_commands, demo).await
}

/// What to try against a server kept running with `--serve`.
fn print_commands(addr: SocketAddr) {
    println!("serving on http://{addr} (Ctrl-C to stop)");
    println!("limits, for everyone together: 1 request a second with a burst of 2, 4 in flight; try:");
    println!("  curl -i http://{addr}/");
    println!("  for i in 1 2 3; do curl -si http://{addr}/ | grep -iE '^(HTTP/|retry-after|ratelimit)'; done");
}

/// One request on a fresh connection, as curl would send it: the status and the
/// header lines (names in lowercase).
async fn get(addr: SocketAddr) -> std::io::Result<(u16, Vec<(String, String)>)> {
    let mut stream = TcpStream::connect(addr).await?;
    stream.write_all(format!("GET / HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\n\r\n").as_bytes()).await?;
    let mut raw = String::new();
    stream.read_to_string(&mut raw).await?;
    let head = raw.split("\r\n\r\n").next().unwrap_or_default();
    let mut lines = head.lines();
    let status = lines.next().and_then(|l| l.split(' ').nth(1)).and_then(|s| s.parse().ok()).unwrap_or(0);
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    Ok((status, headers))
}

/// Sends one request on connection `n`, prints the answer, and says whether it was `want`.
async fn step(addr: SocketAddr, n: usize, want: u16) -> std::io::Result<(bool, Vec<(String, String)>)> {
    let (status, headers) = get(addr).await?;
    let field = |name: &str| headers.iter().find(|(h, _)| h == name).map_or("-", |(_, v)| v.as_str());
    if status == 200 {
        println!("  connection {n}: 200 OK");
    } else {
        let reason = hyper::StatusCode::from_u16(status).ok().and_then(|s| s.canonical_reason()).unwrap_or("");
        println!("  connection {n}: {status} {reason}, Retry-After: {}", field("retry-after"));
        println!("                RateLimit-Policy: {}", field("ratelimit-policy"));
        println!("                RateLimit: {}", field("ratelimit"));
    }
    if status != want {
        println!("  ^ expected {want}");
    }
    Ok((status == want, headers))
}

/// Drives the scripted sequence against the server at `addr`; returns how many answers
/// differed from what the limits promise.
async fn demo(addr: SocketAddr) -> std::io::Result<usize> {
    println!("hyper-server: one limited service for every connection, server on http://{addr}");
    println!("limits, for everyone together: 1 request a second with a burst of 2, 4 in flight");
    println!("\n1. three requests, each on its own connection: the burst of 2 is shared by all connections");
    let mut wrong = 0;
    let mut last = Vec::new();
    for (n, want) in [(1, 200), (2, 200), (3, 429)] {
        let (ok, headers) = step(addr, n, want).await?;
        wrong += usize::from(!ok);
        last = headers;
    }
    let wait = last.iter().find(|(h, _)| h == "retry-after").and_then(|(_, v)| v.parse().ok()).unwrap_or(1);
    println!("\n2. wait the {wait}s that Retry-After says");
    tokio::time::sleep(Duration::from_secs(wait)).await;
    let (ok, _) = step(addr, 4, 200).await?;
    wrong += usize::from(!ok);
    Ok(wrong)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_limit_holds_across_connections() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        // One a minute with a burst of two: the third request, on a third connection,
        // is refused whatever the timing of the test.
        let server = tokio::spawn(serve(listener, Quota::per_minute(nz!(1)).burst(nz!(2))));
        let answers = [get(addr).await.unwrap(), get(addr).await.unwrap(), get(addr).await.unwrap()];
        assert_eq!(answers[0].0, 200);
        assert_eq!(answers[1].0, 200);
        assert_eq!(answers[2].0, 429, "every rate limit paces its callers");
        let field = |name: &str| answers[2].1.iter().find(|(h, _)| h == name).map(|(_, v)| v.clone());
        assert_eq!(field("ratelimit-policy").as_deref(), Some("\"gcra\";q=2;w=120"));
        let retry: u64 = field("retry-after").and_then(|v| v.parse().ok()).expect("a retry-after field");
        assert!((59..=60).contains(&retry), "the next slot opens a minute after the first: {retry}");
        server.abort();
    }
}
