//! **Per-tenant limits in an axum server.**
//!
//! What it shows: an authentication middleware maps the bearer token to the tenant's tiers
//! (org > user) and puts the [`TenantKey`] in the request's extensions; a
//! [`LimitSetLayer`] reads it from there ([`FromExtension`]), so a client cannot pick its
//! own identity. Each user has a rate limit and a concurrency limit, each org a rate limit
//! over all its users; a request takes all three or none. Refusals are answered by the
//! layer ([`HttpAnswer`]): `429` with `Retry-After`, the IETF `RateLimit-Policy` and
//! `RateLimit` fields, and a JSON problem body naming the limit and its tier. The router is
//! cloned per connection and every clone shares the same limits.
//!
//! API used: `LimitSetLayer::new(LimitSetPolicy)`, `.key(FromExtension::<TenantKey>::new())`,
//! `.refuse_with(HttpAnswer::new().with_json_body().on_success())`, `Router::layer`.
//!
//! Run: `cargo run -p example-axum-tenants` (a scripted demonstration on a loopback port,
//! a few seconds), or `cargo run -p example-axum-tenants -- --serve` to keep the server up
//! and try it with curl.
#![allow(clippy::print_stdout)] // a demonstration prints what happens

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use axum::Router;
use axum::extract::Request;
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tower_limits::extract::{Extractors, FromExtension};
use tower_limits::http::{HttpAnswer, JsonBody};
use tower_limits::{LimitPolicy, LimitSetLayer, LimitSetPolicy, Quota, TenantKey, nz};

/// The tenants this example knows: API key, org, user.
const KEYS: [(&str, &str, &str); 3] =
    [("alice-key", "acme", "alice"), ("bob-key", "acme", "bob"), ("carol-key", "globex", "carol")];

// ---- The limits: the one place this example builds its layer. ----

/// The layer's type: keys from the request's extensions, one unit per request, refusals
/// answered as HTTP with a JSON body.
type Limits = LimitSetLayer<Extractors<FromExtension<TenantKey>>, HttpAnswer<JsonBody>>;

/// Per user: 1 request a second with a burst of 3, and 2 in flight; per org: 2 a second
/// with a burst of 5, shared by the org's users.
fn limits() -> Limits {
    LimitSetLayer::new(
        LimitSetPolicy::new()
            .tiers(["org", "user"])
            .limit(LimitPolicy::gcra("user-requests", Quota::per_second(nz!(1)).burst(nz!(3))).per("user"))
            .limit(LimitPolicy::gcra("org-requests", Quota::per_second(nz!(2)).burst(nz!(5))).per("org"))
            .limit(LimitPolicy::semaphore("user-concurrency", 2).per("user")),
    )
    .expect("the policy above is valid")
    .key(FromExtension::<TenantKey>::new())
    .refuse_with(HttpAnswer::new().with_json_body().on_success())
}

// ---- The application. ----

/// Maps the bearer token to the tenant's tiers, or answers 401.
async fn authenticate(mut req: Request, next: Next) -> Response {
    let token =
        req.headers().get("authorization").and_then(|v| v.to_str().ok()).and_then(|v| v.strip_prefix("Bearer "));
    match token.and_then(|t| KEYS.iter().find(|(key, _, _)| *key == t)) {
        Some((_, org, user)) => match TenantKey::new([*org, *user]) {
            Ok(tenant) => {
                req.extensions_mut().insert(tenant);
                next.run(req).await
            }
            Err(_) => (StatusCode::INTERNAL_SERVER_ERROR, "bad tenant table\n").into_response(),
        },
        None => (StatusCode::UNAUTHORIZED, "unknown API key\n").into_response(),
    }
}

/// The application: `/` answers at once, `/slow` after half a second (to hold a
/// concurrency slot); both behind the limits, behind authentication.
fn app() -> Router {
    Router::new()
        .route("/", get(|| async { "hello\n" }))
        .route(
            "/slow",
            get(|| async {
                tokio::time::sleep(Duration::from_millis(500)).await;
                "hello, slowly\n"
            }),
        )
        .layer(limits())
        .layer(middleware::from_fn(authenticate))
}

// ---- Running it: a scripted demonstration, or a server to try by hand. ----

const USAGE: &str = "usage: cargo run -p example-axum-tenants [-- --serve [--port N]]";

#[tokio::main]
async fn main() -> ExitCode {
    example_support::run(
        USAGE,
        3000,
        |listener| async move { axum::serve(listener, app()).await },
        print_commands,
        demo,
    )
    .await
}

fn print_commands(addr: SocketAddr) {
    println!("serving on http://{addr} (Ctrl-C to stop)");
    println!("limits: per user 1/s with a burst of 3 and 2 in flight; per org 2/s with a burst of 5");
    println!("keys: alice-key and bob-key (org acme), carol-key (org globex); try:");
    println!("  curl -i -H 'authorization: Bearer alice-key' http://{addr}/");
    println!(
        "  for i in 1 2 3 4; do curl -si -H 'authorization: Bearer alice-key' http://{addr}/ \
         | grep -iE '^(HTTP/|retry-after|ratelimit)'; done"
    );
    println!(
        "  for i in 1 2 3; do curl -s -H 'authorization: Bearer carol-key' http://{addr}/slow & done; wait   # 2 in flight"
    );
    println!("  curl -i http://{addr}/   # no key: 401");
    println!("a client that paces itself to alice's limit gets no 429:");
    println!(
        "  cargo run -p example-reqwest-client -- --url http://{addr}/ --header 'authorization: Bearer alice-key' \
         --per-second 1 --requests 5"
    );
}

/// One answer as the demonstration's client saw it.
#[derive(Debug)]
struct Answer {
    status: u16,
    /// Header fields, names in lowercase.
    headers: Vec<(String, String)>,
    body: String,
}

impl Answer {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str())
    }

    /// A string field of the JSON problem body, if there is one.
    fn problem_field(&self, name: &str) -> Option<String> {
        let json: serde_json::Value = serde_json::from_str(&self.body).ok()?;
        json.get(name)?.as_str().map(str::to_owned)
    }
}

/// `GET path` on a fresh connection, as curl would send it, with the tenant's key.
async fn get_as(addr: SocketAddr, path: &str, key: Option<&str>) -> std::io::Result<Answer> {
    let mut stream = TcpStream::connect(addr).await?;
    let auth = key.map(|k| format!("authorization: Bearer {k}\r\n")).unwrap_or_default();
    let request = format!("GET {path} HTTP/1.1\r\nhost: {addr}\r\n{auth}connection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await?;
    let mut raw = String::new();
    stream.read_to_string(&mut raw).await?;
    let (head, body) = raw.split_once("\r\n\r\n").unwrap_or((&raw, ""));
    let mut lines = head.lines();
    let status = lines.next().and_then(|l| l.split(' ').nth(1)).and_then(|s| s.parse().ok()).unwrap_or(0);
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    Ok(Answer { status, headers, body: body.to_owned() })
}

/// Prints one answer in a line or three: status, then what the limits said.
fn show(who: &str, path: &str, a: &Answer) {
    let reason = StatusCode::from_u16(a.status).ok().and_then(|s| s.canonical_reason()).unwrap_or("");
    let status = format!("{} {reason}", a.status);
    match a.status {
        200 => println!("  {who:<6} GET {path:<6} {status:<22} RateLimit: {}", a.header("ratelimit").unwrap_or("-")),
        401 => println!("  {who:<6} GET {path:<6} {status:<22} (no valid key: the limits never see it)"),
        _ => {
            let by = match (a.problem_field("limit"), a.problem_field("tier")) {
                (Some(limit), Some(tier)) => format!("refused by {limit} (tier {tier})"),
                _ => "refused".to_owned(),
            };
            let retry = a.header("retry-after").map(|r| format!(", Retry-After: {r}")).unwrap_or_default();
            println!("  {who:<6} GET {path:<6} {status:<22} {by}{retry}");
            println!("  {:<35} RateLimit-Policy: {}", "", a.header("ratelimit-policy").unwrap_or("-"));
            println!("  {:<35} RateLimit: {}", "", a.header("ratelimit").unwrap_or("-"));
        }
    }
}

/// 1 (and says so) if `a` is not the answer the limits promise.
fn check(a: &Answer, want: u16) -> usize {
    if a.status == want {
        0
    } else {
        println!("  ^ expected {want}");
        1
    }
}

/// Drives the scripted sequence against the server at `addr`; returns how many answers
/// differed from what the limits promise.
async fn demo(addr: SocketAddr) -> std::io::Result<usize> {
    println!("axum-tenants: per-tenant limits behind an auth middleware, server on http://{addr}");
    println!("limits: per user 1/s with a burst of 3 and 2 in flight; per org 2/s with a burst of 5");
    let mut wrong = 0;

    println!("\n1. alice (org acme) sends 4 requests in a row: her own limit allows a burst of 3");
    for want in [200, 200, 200, 429] {
        let a = get_as(addr, "/", Some("alice-key")).await?;
        show("alice", "/", &a);
        wrong += check(&a, want);
    }

    println!("\n2. bob, same org: his own limit has room, but the org's burst of 5 runs out on his 3rd");
    for want in [200, 200, 429] {
        let a = get_as(addr, "/", Some("bob-key")).await?;
        show("bob", "/", &a);
        wrong += check(&a, want);
    }

    println!("\n3. carol, another org, is not affected; 3 slow requests at once: 2 may be in flight");
    let slow: Vec<_> = (0..3).map(|_| tokio::spawn(get_as(addr, "/slow", Some("carol-key")))).collect();
    let mut statuses = Vec::new();
    for s in slow {
        let a = s.await.map_err(std::io::Error::other)??;
        show("carol", "/slow", &a);
        statuses.push(a.status);
    }
    statuses.sort_unstable();
    if statuses != [200, 200, 429] {
        println!("  ^ expected two 200 and one 429");
        wrong += 1;
    }

    let first = get_as(addr, "/", Some("alice-key")).await?;
    let wait = first.header("retry-after").and_then(|r| r.parse().ok()).unwrap_or(1);
    println!("\n4. alice again, and again after waiting the {wait}s her Retry-After says");
    show("alice", "/", &first);
    tokio::time::sleep(Duration::from_secs(wait)).await;
    println!("  ... {wait}s later");
    let a = get_as(addr, "/", Some("alice-key")).await?;
    show("alice", "/", &a);
    wrong += check(&a, 200);

    println!("\n5. a request without a valid key");
    let a = get_as(addr, "/", Some("mallory")).await?;
    show("?", "/", &a);
    wrong += check(&a, 401);
    Ok(wrong)
}

#[cfg(test)]
mod tests {
    use axum::body::Body;
    use http_body_util::BodyExt;
    use tower::ServiceExt;

    use super::*;

    fn get_as(token: &str, path: &str) -> Request {
        Request::get(path).header("authorization", format!("Bearer {token}")).body(Body::empty()).unwrap()
    }

    #[tokio::test(start_paused = true)]
    async fn clones_of_the_router_share_each_users_and_each_orgs_limit() {
        let app = app();
        for _ in 0..3 {
            let ok = app.clone().oneshot(get_as("alice-key", "/")).await.unwrap();
            assert_eq!(ok.status(), StatusCode::OK);
            assert!(ok.headers()["ratelimit"].to_str().unwrap().contains("\"user-requests\";r="));
        }
        let refused = app.clone().oneshot(get_as("alice-key", "/")).await.unwrap();
        assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(refused.headers()["retry-after"], "1");
        assert!(refused.headers()["ratelimit-policy"].to_str().unwrap().contains("\"user-requests\";q=3;w=3"));
        let body = refused.into_body().collect().await.unwrap().to_bytes();
        let body = String::from_utf8(body.to_vec()).unwrap();
        assert!(body.contains("\"limit\":\"user-requests\"") && body.contains("\"tier\":\"user\""), "{body}");
        // Bob, in the same org, has his own user limit, but the org's burst of 5 is shared.
        for _ in 0..2 {
            assert_eq!(app.clone().oneshot(get_as("bob-key", "/")).await.unwrap().status(), StatusCode::OK);
        }
        let refused = app.clone().oneshot(get_as("bob-key", "/")).await.unwrap();
        assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
        let body = refused.into_body().collect().await.unwrap().to_bytes();
        let body = String::from_utf8(body.to_vec()).unwrap();
        assert!(body.contains("\"limit\":\"org-requests\"") && body.contains("\"tier\":\"org\""), "{body}");
        // Carol, in another org, is not affected.
        assert_eq!(app.clone().oneshot(get_as("carol-key", "/")).await.unwrap().status(), StatusCode::OK);
        assert_eq!(app.oneshot(get_as("mallory", "/")).await.unwrap().status(), StatusCode::UNAUTHORIZED);
    }

    #[tokio::test(start_paused = true)]
    async fn a_user_has_two_requests_in_flight_at_most() {
        let app = app();
        let slow: Vec<_> = (0..2).map(|_| tokio::spawn(app.clone().oneshot(get_as("carol-key", "/slow")))).collect();
        // Let both start and hold their slots (time is paused: they sleep until advanced).
        tokio::time::sleep(Duration::from_millis(1)).await;
        let third = app.clone().oneshot(get_as("carol-key", "/slow")).await.unwrap();
        assert_eq!(third.status(), StatusCode::TOO_MANY_REQUESTS);
        assert!(third.headers()["ratelimit-policy"].to_str().unwrap().contains("qu=\"concurrent-requests\""));
        for s in slow {
            assert_eq!(s.await.unwrap().unwrap().status(), StatusCode::OK);
        }
        // The slots came back with the responses.
        assert_eq!(app.oneshot(get_as("carol-key", "/")).await.unwrap().status(), StatusCode::OK);
    }

    #[tokio::test(start_paused = true)]
    async fn the_user_limit_refills_after_retry_after() {
        let app = app();
        for _ in 0..3 {
            assert_eq!(app.clone().oneshot(get_as("alice-key", "/")).await.unwrap().status(), StatusCode::OK);
        }
        assert_eq!(app.clone().oneshot(get_as("alice-key", "/")).await.unwrap().status(), 429);
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert_eq!(app.oneshot(get_as("alice-key", "/")).await.unwrap().status(), StatusCode::OK);
    }
}
