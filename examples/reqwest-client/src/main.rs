//! **An outbound client that paces itself.**
//!
//! What it shows: a `reqwest::Client` wrapped in tower, with a [`LimitSetLayer`] in wait
//! mode over a one-account [`LimitPool`] that mirrors the provider's published limit
//! (see `src/client.rs`, the point of the example). Against a provider that enforces its
//! limit strictly (`src/provider.rs`, started in this process on a loopback port), the
//! demonstration sends
//!
//! 1. a burst without the layer: the provider refuses what exceeds its limit;
//! 2. the same burst through the layer: zero refusals, in the time the limit implies;
//! 3. a burst after someone else spent the account's window: the provider's `429` with
//!    `Retry-After` benches the account, and every queued request waits for it, not only
//!    the refused one.
//!
//! API used: `LimitSetLayer::with_backend(LimitPool)` with `.wait(max_wait)`,
//! `UpstreamReports` feeding `tower_limits::http::upstream_report` to the pool, `LimitPolicy::gcra`.
//!
//! Run: `cargo run -p example-reqwest-client` (the demonstration, a few seconds);
//! `-- --serve` keeps a strict provider up and prints the commands to try it;
//! `-- --url URL [--per-second N] [--header 'name: value']` paces requests to any server.
//!
//! [`LimitSetLayer`]: tower_limits::LimitSetLayer
//! [`LimitPool`]: tower_limits::LimitPool
#![allow(clippy::print_stdout)] // a demonstration prints what happens

mod client;
mod provider;

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use reqwest::header::{HeaderName, HeaderValue};
use tokio::net::TcpListener;
use tokio::time::Instant;
use tower::{BoxError, Service, ServiceExt};

use crate::client::{paced, send};
use crate::provider::{Shared, StrictWindow, lock};

/// The demonstration's provider: at most 5 requests in any second.
const LIMIT: u64 = 5;
const WINDOW: Duration = Duration::from_secs(1);
/// How long a request may wait in the client's layer.
const MAX_WAIT: Duration = Duration::from_secs(60);

const USAGE: &str = "usage: cargo run -p example-reqwest-client [-- --serve [--port N] | \
                     --url http://HOST:PORT/PATH [--per-second N] [--requests N] [--header 'name: value']...]";

/// What the command line asks for.
#[derive(Debug)]
enum Mode {
    /// The scripted demonstration.
    Demo,
    /// A strict provider on `port`, kept up.
    Serve { port: u16 },
    /// The paced client against someone's server.
    Client { url: reqwest::Url, per_second: u64, requests: usize, headers: Vec<(HeaderName, HeaderValue)> },
}

fn parse_args(args: impl IntoIterator<Item = String>) -> Result<Mode, String> {
    let (mut serve, mut port, mut url) = (false, None, None);
    let (mut per_second, mut requests, mut headers) = (None, None, Vec::new());
    let mut it = args.into_iter();
    while let Some(arg) = it.next() {
        let mut value = |example: &str| it.next().ok_or(format!("{arg} needs a value, for example {arg} {example}"));
        match arg.as_str() {
            "--serve" => serve = true,
            "--port" => {
                let v = value("3002")?;
                port = Some(v.parse().map_err(|_| format!("--port {v:?} is not a port number (0 to 65535)"))?);
            }
            "--url" => url = Some(parse_url(&value("http://127.0.0.1:3002/")?)?),
            "--per-second" => {
                let v = value("5")?;
                let n: u64 = v.parse().map_err(|_| format!("--per-second {v:?} is not a whole number"))?;
                per_second = Some(if n == 0 { return Err("--per-second must be at least 1".into()) } else { n });
            }
            "--requests" => {
                let v = value("10")?;
                requests = Some(v.parse().map_err(|_| format!("--requests {v:?} is not a whole number"))?);
            }
            "--header" => headers.push(parse_header(&value("'authorization: Bearer alice-key'")?)?),
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    match (serve, url) {
        (true, Some(_)) => Err("--serve and --url are two different modes: give one of them".into()),
        (true, None) if per_second.is_some() || requests.is_some() || !headers.is_empty() => {
            Err("--per-second, --requests and --header go with --url".into())
        }
        (true, None) => Ok(Mode::Serve { port: port.unwrap_or(0) }),
        (false, _) if port.is_some() => Err("--port goes with --serve".into()),
        (false, Some(url)) => {
            Ok(Mode::Client { url, per_second: per_second.unwrap_or(LIMIT), requests: requests.unwrap_or(10), headers })
        }
        (false, None) if per_second.is_some() || requests.is_some() || !headers.is_empty() => {
            Err("--per-second, --requests and --header go with --url".into())
        }
        (false, None) => Ok(Mode::Demo),
    }
}

/// An `http://` URL with a host (this example is built without TLS).
fn parse_url(text: &str) -> Result<reqwest::Url, String> {
    let url = reqwest::Url::parse(text)
        .map_err(|e| format!("--url {text:?} is not a URL ({e}); write it in full, like http://127.0.0.1:3002/"))?;
    if url.scheme() != "http" || url.host().is_none() {
        return Err(format!("--url {text:?}: only http://HOST[:PORT]/PATH URLs (this example is built without TLS)"));
    }
    Ok(url)
}

/// `name: value`, as curl's `-H` takes it.
fn parse_header(text: &str) -> Result<(HeaderName, HeaderValue), String> {
    let bad =
        || format!("--header {text:?} is not 'name: value', for example --header 'authorization: Bearer alice-key'");
    let (name, value) = text.split_once(':').ok_or_else(bad)?;
    let name = HeaderName::from_bytes(name.trim().as_bytes()).map_err(|_| bad())?;
    let value = HeaderValue::from_str(value.trim()).map_err(|_| bad())?;
    Ok((name, value))
}

#[tokio::main]
async fn main() -> ExitCode {
    if std::env::args().skip(1).any(|a| a == "-h" || a == "--help") {
        println!("{USAGE}");
        return ExitCode::SUCCESS;
    }
    let mode = match parse_args(std::env::args().skip(1)) {
        Ok(mode) => mode,
        Err(e) => {
            eprintln!("error: {e}; {USAGE}");
            return ExitCode::from(2);
        }
    };
    let outcome = match mode {
        Mode::Demo => demo().await,
        Mode::Serve { port } => serve(port).await,
        Mode::Client { url, per_second, requests, headers } => run_client(url, per_second, requests, headers).await,
    };
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The transport: a plain reqwest client, as a tower service.
fn transport() -> Result<
    impl Service<reqwest::Request, Response = reqwest::Response, Error = reqwest::Error, Future: Send>
    + Clone
    + Send
    + 'static,
    String,
> {
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .map_err(|e| format!("cannot build the HTTP client: {e}"))?;
    Ok(tower::service_fn(move |req: reqwest::Request| http.execute(req)))
}

/// One line saying what went wrong with a request to `url`, and what to do.
fn explain(e: &BoxError, url: &reqwest::Url) -> String {
    let mut root: &(dyn std::error::Error + 'static) = &**e;
    while let Some(next) = root.source() {
        root = next;
    }
    match e.downcast_ref::<reqwest::Error>() {
        Some(r) if r.is_connect() => format!(
            "cannot connect to {url} ({root}); is a server listening there? \
             `cargo run -p example-reqwest-client -- --serve` starts one"
        ),
        Some(r) if r.is_timeout() => format!("{url} did not answer within 10s; is it the right server?"),
        _ => format!("the request to {url} failed: {e}"),
    }
}

/// A GET of `url` with `headers`.
fn request(url: &reqwest::Url, headers: &[(HeaderName, HeaderValue)]) -> reqwest::Request {
    let mut req = reqwest::Request::new(reqwest::Method::GET, url.clone());
    for (name, value) in headers {
        req.headers_mut().append(name.clone(), value.clone());
    }
    req
}

/// Starts a strict provider on `port` of the loopback interface (0: the system chooses).
async fn start_provider(port: u16) -> Result<(SocketAddr, Shared), String> {
    let listener = TcpListener::bind(("127.0.0.1", port))
        .await
        .map_err(|e| format!("cannot listen on 127.0.0.1:{port}: {e}; choose another --port"))?;
    let addr = listener.local_addr().map_err(|e| format!("the listener has no address: {e}"))?;
    let shared = Arc::new(Mutex::new(StrictWindow::new(LIMIT as usize, WINDOW)));
    tokio::spawn(provider::serve(listener, shared.clone()));
    Ok((addr, shared))
}

async fn serve(port: u16) -> Result<(), String> {
    let (addr, _shared) = start_provider(port).await?;
    println!("a strict provider on http://{addr}/ (Ctrl-C to stop): at most {LIMIT} requests in any second, else 429");
    println!("try it bare, then through the paced client:");
    println!("  for i in $(seq 8); do curl -s -o /dev/null -w '%{{http_code}} ' http://{addr}/; done; echo");
    println!("  cargo run -p example-reqwest-client -- --url http://{addr}/ --per-second {LIMIT} --requests 10");
    std::future::pending().await
}

/// Sends `requests` GETs at once through the paced client and prints each answer.
async fn run_client(
    url: reqwest::Url,
    per_second: u64,
    requests: usize,
    headers: Vec<(HeaderName, HeaderValue)>,
) -> Result<(), String> {
    let client = paced(transport()?, per_second, Duration::from_secs(1), MAX_WAIT).map_err(|e| e.to_string())?;
    println!("{requests} requests at once to {url}, paced at {per_second} per second (plus a 100ms jitter margin)");
    let start = Instant::now();
    let mut calls = tokio::task::JoinSet::new();
    for i in 1..=requests {
        let (client, req) = (client.clone(), request(&url, &headers));
        calls.spawn(async move { (i, send(client, req).await, start.elapsed()) });
    }
    let (mut ok, mut retried, mut refused) = (0, 0, 0);
    while let Some(call) = calls.join_next().await {
        let (i, answer, after) = call.map_err(|e| format!("a request task failed: {e}"))?;
        let (answer, again) = answer.map_err(|e| explain(&e, &url))?;
        let status = answer.status();
        let note = if again { " (refused first: sent again after the Retry-After)" } else { "" };
        println!("  {:>6.2}s  request {i:>2}: {status}{note}", after.as_secs_f64());
        ok += usize::from(status.is_success());
        retried += usize::from(again);
        refused += usize::from(status == 429);
    }
    println!("{ok} of {requests} succeeded; refused once, then retried: {retried}; still refused: {refused}");
    Ok(())
}

/// What the provider saw, from index `from` of its log on: (seconds after `t0`, the
/// retry delay if refused).
fn arrivals(shared: &Shared, from: usize, t0: Instant) -> Vec<(f64, Option<Duration>)> {
    lock(shared).log[from..].iter().map(|a| ((a.at - t0).as_secs_f64(), a.refused)).collect()
}

/// Sends `n` requests to `url` at once through `service`, each with [`send`] (one retry
/// after a refusal) if `retry`, else once; the last answers' statuses, in order.
async fn burst<S>(service: S, url: &reqwest::Url, n: usize, retry: bool) -> Result<Vec<u16>, String>
where
    S: Service<reqwest::Request, Response = reqwest::Response, Error = BoxError> + Clone + Send + 'static,
    S::Future: Send,
{
    let calls: Vec<_> = (0..n)
        .map(|_| {
            let (service, req) = (service.clone(), request(url, &[]));
            tokio::spawn(async move {
                if retry { send(service, req).await.map(|(answer, _)| answer) } else { service.oneshot(req).await }
            })
        })
        .collect();
    let mut statuses = Vec::new();
    for call in calls {
        let answer = call.await.map_err(|e| format!("a request task failed: {e}"))?;
        statuses.push(answer.map_err(|e| explain(&e, url))?.status().as_u16());
    }
    Ok(statuses)
}

fn count(statuses: &[u16], status: u16) -> usize {
    statuses.iter().filter(|&&s| s == status).count()
}

/// The scripted demonstration; an error if what it shows did not happen.
async fn demo() -> Result<(), String> {
    const N: usize = 10;
    let bare = transport()?.map_err(BoxError::from);
    let interval = client::mirror_quota(LIMIT, WINDOW).map_err(|e| e.to_string())?.interval();
    println!("reqwest-client: client-side pacing against a provider that enforces its published limit strictly");
    println!("the provider: at most {LIMIT} requests in any {}s, else 429 with Retry-After", WINDOW.as_secs());
    let mut wrong = Vec::new();

    let (addr, shared) = start_provider(0).await?;
    let url: reqwest::Url = format!("http://{addr}/").parse().map_err(|e| format!("{e}"))?;
    println!("\n1. {N} requests at once to http://{addr}/, no pacing layer");
    let statuses = burst(bare.clone(), &url, N, false).await?;
    let retry = arrivals(&shared, 0, Instant::now()).iter().find_map(|a| a.1);
    println!(
        "   {} × 200, {} × 429 (the first refusal's retry-after-ms: {})",
        count(&statuses, 200),
        count(&statuses, 429),
        retry.map_or("-".into(), |r| r.as_millis().to_string())
    );
    if count(&statuses, 429) == 0 {
        wrong.push("the bare burst got no refusal");
    }

    let (addr, shared) = start_provider(0).await?;
    let url: reqwest::Url = format!("http://{addr}/").parse().map_err(|e| format!("{e}"))?;
    println!("\n2. the same {N} requests through the client's layer (a fresh provider on http://{addr}/)");
    let client = paced(bare.clone(), LIMIT, WINDOW, MAX_WAIT).map_err(|e| e.to_string())?;
    let t0 = Instant::now();
    let statuses = burst(client, &url, N, true).await?;
    let took = t0.elapsed();
    let seen = arrivals(&shared, 0, t0);
    let times: Vec<String> = seen.iter().map(|a| format!("{:.2}", a.0)).collect();
    println!("   the provider saw them at {} s", times.join(" "));
    println!(
        "   {} × 200, {} × 429 at the provider, done in {:.2}s",
        count(&statuses, 200),
        seen.iter().filter(|a| a.1.is_some()).count(),
        took.as_secs_f64()
    );
    println!(
        "   the limit implies {:.2}s: {LIMIT} per {}s, spaced evenly with a {}ms jitter margin, is one every {}ms; \
         {N} requests take {} intervals",
        interval.as_secs_f64() * (N - 1) as f64,
        WINDOW.as_secs(),
        client::JITTER_MARGIN.as_millis(),
        interval.as_millis(),
        N - 1
    );
    if seen.iter().any(|a| a.1.is_some()) || count(&statuses, 200) != N {
        wrong.push("the paced burst was refused");
    }

    let (addr, shared) = start_provider(0).await?;
    let url: reqwest::Url = format!("http://{addr}/").parse().map_err(|e| format!("{e}"))?;
    println!(
        "\n3. someone else spends the account's window ({LIMIT} requests), then our layer sends 6 (http://{addr}/)"
    );
    let t0 = Instant::now();
    let others = burst(bare.clone(), &url, LIMIT as usize, false).await?;
    let client = paced(bare, LIMIT, WINDOW, MAX_WAIT).map_err(|e| e.to_string())?;
    let statuses = burst(client, &url, 6, true).await?;
    let seen = arrivals(&shared, others.len(), t0);
    for (at, refused) in &seen {
        match refused {
            None => println!("   {at:.3}s  200"),
            Some(r) => println!(
                "   {at:.3}s  429, retry-after-ms: {} -> the client benches the account until {:.3}s",
                r.as_millis(),
                at + r.as_secs_f64()
            ),
        }
    }
    let benched = seen.iter().filter_map(|&(at, r)| Some((at, at + r?.as_secs_f64())));
    let early = benched.clone().flat_map(|(from, to)| seen.iter().filter(move |a| a.0 > from && a.0 < to)).count();
    for (from, to) in benched {
        let next = seen.iter().map(|a| a.0).find(|&t| t > from).unwrap_or(to);
        println!(
            "   after the 429 at {from:.3}s nothing reached the provider for {:.3}s: every queued request waited, \
             and the refused one was sent again after the wait",
            next - from
        );
    }
    println!("   ours: {} × 200 in the end", count(&statuses, 200));
    if early > 0 {
        wrong.push("a request was sent while the account was benched");
    }
    if count(&statuses, 200) != 6 {
        wrong.push("a paced request was still refused after its retry");
    }

    if wrong.is_empty() {
        Ok(())
    } else {
        Err(format!("the demonstration did not show its point: {}", wrong.join("; ")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(a: &[&str]) -> Result<Mode, String> {
        parse_args(a.iter().map(|s| (*s).to_owned()))
    }

    #[test]
    fn arguments_are_checked() {
        assert!(matches!(args(&[]), Ok(Mode::Demo)));
        assert!(matches!(args(&["--serve", "--port", "3002"]), Ok(Mode::Serve { port: 3002 })));
        let client = args(&["--url", "http://127.0.0.1:3000/", "--header", "authorization: Bearer k"]).unwrap();
        let Mode::Client { per_second, requests, headers, .. } = client else { panic!("{client:?}") };
        assert_eq!((per_second, requests), (LIMIT, 10));
        assert_eq!(headers[0].0, "authorization");
        assert_eq!(headers[0].1, "Bearer k");
        assert!(args(&["--url", "localhost:3000"]).unwrap_err().contains("only http://"));
        assert!(args(&["--url", "not a url"]).unwrap_err().contains("is not a URL"));
        assert!(args(&["--url", "https://example.com/"]).unwrap_err().contains("without TLS"));
        assert!(args(&["--url"]).unwrap_err().contains("needs a value"));
        assert!(args(&["--url", "http://h/", "--per-second", "0"]).unwrap_err().contains("at least 1"));
        assert!(args(&["--url", "http://h/", "--header", "nocolon"]).unwrap_err().contains("'name: value'"));
        assert!(args(&["--serve", "--url", "http://h/"]).unwrap_err().contains("two different modes"));
        assert!(args(&["--per-second", "3"]).unwrap_err().contains("go with --url"));
        assert!(args(&["--port", "1"]).unwrap_err().contains("goes with --serve"));
        assert!(args(&["http://h/"]).unwrap_err().contains("unknown argument"));
    }

    #[tokio::test]
    async fn a_refused_connection_says_what_to_do() {
        // A port that was just free: nothing listens there.
        let addr = TcpListener::bind("127.0.0.1:0").await.unwrap().local_addr().unwrap();
        let url: reqwest::Url = format!("http://{addr}/").parse().unwrap();
        let err = transport().unwrap().oneshot(request(&url, &[])).await.unwrap_err();
        let line = explain(&BoxError::from(err), &url);
        assert!(line.starts_with(&format!("cannot connect to {url}")), "{line}");
        assert!(line.contains("--serve") && !line.contains('\n'), "{line}");
    }
}
