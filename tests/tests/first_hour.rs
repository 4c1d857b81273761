//! A Tower user's first hour: the programs a newcomer writes from the README and the
//! guides, at default features, on an axum `Router`, against a real server where the
//! point is the server's wiring (connection info), through `oneshot` otherwise. Law
//! numbers are those of `crates/tower-limits/docs/laws.md`.
//!
//! - a per-IP limit works when the router is served with connection info, and is loud
//!   (`500`, one warning naming the fix) when it is not, never `401` to every client
//!   (Law 28);
//! - a layer in its default error mode goes on a `Router` through `HandleErrorLayer`;
//! - a per-tenant set behind an authentication middleware;
//! - a concurrency limit that answers HTTP bounds the streams in flight, whatever the
//!   order of the builder verbs, unless told to release at the head (Law 18).

use std::convert::Infallible;
use std::io::Write;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use axum::Router;
use axum::body::Body;
use axum::error_handling::HandleErrorLayer;
use axum::extract::Request;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use bytes::Bytes;
use http::StatusCode;
use http_body::Frame;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;
use tower::{ServiceBuilder, ServiceExt};
use tower_limits::extract::{FromExtension, PeerIp};
use tower_limits::http::HttpAnswer;
use tower_limits::{GcraLayer, LimitPolicy, LimitSetLayer, LimitSetPolicy, Quota, SemaphoreLayer, TenantKey, nz};

/// One `GET path` over a fresh connection: the whole answer, head and body.
async fn fetch(addr: SocketAddr, path: &str, headers: &str) -> String {
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let request = format!("GET {path} HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\n{headers}\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).await.unwrap();
    answer
}

fn status(answer: &str) -> u16 {
    answer[9..12].parse().unwrap()
}

/// Log lines, captured.
#[derive(Clone, Default)]
struct Logs(Arc<Mutex<Vec<u8>>>);

impl Write for Logs {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Logs {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

fn per_ip_app() -> Router {
    Router::new()
        .route("/", get(|| async { "hello" }))
        .layer(GcraLayer::new(Quota::per_minute(nz!(2)).burst(nz!(2))).key(PeerIp).refuse_with(HttpAnswer::new()))
}

#[tokio::test]
async fn a_per_ip_limit_finds_the_address_that_axum_records() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = axum::serve(listener, per_ip_app().into_make_service_with_connect_info::<SocketAddr>());
    tokio::spawn(async move { server.await });
    let statuses = [fetch(addr, "/", "").await, fetch(addr, "/", "").await, fetch(addr, "/", "").await];
    assert_eq!(statuses.each_ref().map(|a| status(a)), [200, 200, 429]);
    assert!(statuses[2].contains("retry-after: 30"), "{}", statuses[2]);
}

#[tokio::test(flavor = "current_thread")]
async fn a_per_ip_limit_on_a_server_without_connection_info_is_loud_not_unauthorized() {
    let logs = Logs::default();
    let writer = logs.clone();
    let subscriber = tracing_subscriber::fmt().with_writer(move || writer.clone()).with_ansi(false).finish();
    let _logging = tracing::subscriber::set_default(subscriber);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    // The mistake: served without `into_make_service_with_connect_info`.
    let server = axum::serve(listener, per_ip_app());
    tokio::spawn(async move { server.await });
    for _ in 0..3 {
        let answer = fetch(addr, "/", "").await;
        assert_eq!(status(&answer), 500, "the server's setup, not the client's: {answer}");
    }
    let logs = logs.text();
    assert_eq!(logs.matches("WARN").count(), 1, "warned once: {logs}");
    assert!(logs.contains("into_make_service_with_connect_info"), "the warning names the fix: {logs}");
}

#[tokio::test]
async fn the_default_error_mode_goes_on_a_router_through_handle_error_layer() {
    let app = Router::new().route("/", get(|| async { "hello" })).layer(
        ServiceBuilder::new()
            .layer(HandleErrorLayer::new(tower_limits::http::error_response))
            .layer(SemaphoreLayer::new(nz!(4)))
            .layer(GcraLayer::new(Quota::per_minute(nz!(1)))),
    );
    let get = || Request::new(Body::empty());
    assert_eq!(app.clone().oneshot(get()).await.unwrap().status(), StatusCode::OK);
    let refused = app.oneshot(get()).await.unwrap();
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(refused.headers()["retry-after"], "60");
    let text = String::from_utf8(axum::body::to_bytes(refused.into_body(), 1024).await.unwrap().to_vec()).unwrap();
    assert!(text.starts_with("rate limited by \"gcra\""), "{text}");
}

#[tokio::test]
async fn the_error_mode_answers_a_missing_key_with_its_challenge() {
    let app = Router::new().route("/", get(|| async { "hello" })).layer(
        ServiceBuilder::new()
            .layer(HandleErrorLayer::new(tower_limits::http::error_response))
            .layer(GcraLayer::new(Quota::per_minute(nz!(1))).key(FromExtension::<TenantKey>::new())),
    );
    let refused = app.oneshot(Request::new(Body::empty())).await.unwrap();
    assert_eq!(refused.status(), StatusCode::UNAUTHORIZED);
    assert_eq!(refused.headers()["www-authenticate"], "Bearer", "every 401 names its challenge");
}

/// Maps `Bearer <user>` to the tiers `acme > user`; no token is `401`.
async fn authenticate(mut req: Request, next: Next) -> Response {
    let token = req.headers().get("authorization").and_then(|v| v.to_str().ok());
    let Some(user) = token.and_then(|t| t.strip_prefix("Bearer ")) else {
        return StatusCode::UNAUTHORIZED.into_response();
    };
    let Ok(tenant) = TenantKey::new(["acme", user]) else {
        return StatusCode::UNAUTHORIZED.into_response();
    };
    req.extensions_mut().insert(tenant);
    next.run(req).await
}

#[tokio::test]
async fn a_per_tenant_set_reads_the_key_an_auth_middleware_inserted() {
    let policy = LimitSetPolicy::new()
        .tiers(["org", "user"])
        .limit(LimitPolicy::gcra("requests", Quota::per_minute(nz!(2))).per("user"))
        .limit(LimitPolicy::semaphore("concurrent", 8).per("org"));
    let limits = LimitSetLayer::new(policy)
        .unwrap()
        .key(FromExtension::<TenantKey>::new())
        .refuse_with(HttpAnswer::new().with_json_body());
    let app =
        Router::new().route("/", get(|| async { "hello" })).layer(limits).layer(middleware::from_fn(authenticate));
    let as_user =
        |user: &str| Request::builder().header("authorization", format!("Bearer {user}")).body(Body::empty()).unwrap();
    for _ in 0..2 {
        assert_eq!(app.clone().oneshot(as_user("alice")).await.unwrap().status(), StatusCode::OK);
    }
    let refused = app.clone().oneshot(as_user("alice")).await.unwrap();
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    let body = axum::body::to_bytes(refused.into_body(), 4096).await.unwrap();
    let body: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!((body["limit"].as_str(), body["tier"].as_str()), (Some("requests"), Some("user")));
    assert_eq!(app.clone().oneshot(as_user("bob")).await.unwrap().status(), StatusCode::OK, "bob's own limit");
    let anonymous = app.oneshot(Request::new(Body::empty())).await.unwrap();
    assert_eq!(anonymous.status(), StatusCode::UNAUTHORIZED, "the middleware's answer");
}

/// A body fed by the test: a stream that lasts until the test ends it.
struct Fed(mpsc::UnboundedReceiver<Bytes>);

impl http_body::Body for Fed {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.0.poll_recv(cx).map(|chunk| chunk.map(|c| Ok(Frame::data(c))))
    }
}

/// A router streaming events until the test ends each stream; `feeds` gets each stream's
/// sender.
fn streaming(feeds: mpsc::UnboundedSender<mpsc::UnboundedSender<Bytes>>) -> Router {
    Router::new().route(
        "/events",
        get(move || {
            let feeds = feeds.clone();
            async move {
                let (feed, events) = mpsc::unbounded_channel();
                feed.send(Bytes::from_static(b"data: hello\n\n")).unwrap();
                feeds.send(feed).unwrap();
                Response::new(Body::new(Fed(events)))
            }
        }),
    )
}

/// How many streams of `app` run at once before a refusal, and whether ending one makes
/// room: `(admitted, refused status, admitted after the end)`.
async fn streams_in_flight(
    app: Router,
    mut feeds: mpsc::UnboundedReceiver<mpsc::UnboundedSender<Bytes>>,
) -> (usize, u16, bool) {
    let get = || Request::get("/events").body(Body::empty()).unwrap();
    let mut open = Vec::new();
    let refused = loop {
        let response = app.clone().oneshot(get()).await.unwrap();
        if response.status() != StatusCode::OK {
            break response.status().as_u16();
        }
        open.push((response.into_body(), feeds.recv().await.unwrap()));
        if open.len() > 4 {
            return (open.len(), 0, false);
        }
    };
    // The first stream ends: its last frame is read, the body reports its end.
    let (mut body, feed) = open.remove(0);
    drop(feed);
    while http_body_util::BodyExt::frame(&mut body).await.is_some() {}
    let again = app.oneshot(get()).await.unwrap().status() == StatusCode::OK;
    (open.len() + 1, refused, again)
}

#[tokio::test]
async fn a_concurrency_limit_that_answers_http_bounds_the_streams_whatever_the_verbs_order() {
    let layers = [
        SemaphoreLayer::new(nz!(2)).refuse_with(HttpAnswer::new()),
        SemaphoreLayer::new(nz!(2)).refuse_with(HttpAnswer::new()).hold_body(),
        SemaphoreLayer::new(nz!(2)).hold_body().refuse_with(HttpAnswer::new()),
    ];
    for (i, layer) in layers.into_iter().enumerate() {
        let (tx, rx) = mpsc::unbounded_channel();
        let app = streaming(tx).layer(layer);
        assert_eq!(streams_in_flight(app, rx).await, (2, 503, true), "layer {i}: two streams, then 503");
    }
    // Released at the head: streams are not bounded (the limit holds heads only).
    let (tx, rx) = mpsc::unbounded_channel();
    let app = streaming(tx).layer(SemaphoreLayer::new(nz!(2)).refuse_with(HttpAnswer::new().release_at_head()));
    assert_eq!(streams_in_flight(app, rx).await.0, 5, "more streams than slots run at once");
}

#[test]
fn the_readmes_and_the_algorithm_guide_s_policy_files_load() {
    for (file, text) in [
        ("README.md", include_str!("../../README.md")),
        ("algorithms.md", include_str!("../../crates/tower-limits/docs/algorithms.md")),
    ] {
        let mut blocks = text.split("```toml\n").skip(1).map(|rest| &rest[..rest.find("```").unwrap()]).peekable();
        assert!(blocks.peek().is_some(), "{file} shows a policy file");
        for block in blocks {
            tower_limits::LimitSetPolicy::from_toml(block).unwrap_or_else(|e| panic!("{file}: {e}\n{block}"));
        }
    }
}
