//! An axum server with per-tenant limits.
//!
//! An authentication middleware maps the bearer token to the tenant's tiers (org, user)
//! and puts the [`TenantKey`] in the request's extensions; the limits read it from there,
//! so a client cannot pick its own identity. Refused requests get `429` with
//! `Retry-After`, the `RateLimit` fields and a JSON problem body.
//!
//! Run it with `cargo run -p example-axum-tenants` and try
//! `curl -i -H 'authorization: Bearer alice-key' localhost:3000/`.
#![allow(clippy::print_stdout)] // a demo server says where it listens

use axum::Router;
use axum::extract::Request;
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use tower_limits::extract::FromExtension;
use tower_limits::http::HttpAnswer;
use tower_limits::{LimitPolicy, LimitSetLayer, LimitSetPolicy, Rate, TenantKey};

/// The tenants this demo knows: API key, org, user.
const KEYS: [(&str, &str, &str); 3] =
    [("alice-key", "acme", "alice"), ("bob-key", "acme", "bob"), ("carol-key", "globex", "carol")];

/// Maps the bearer token to the tenant's tiers, or answers 401.
async fn authenticate(mut req: Request, next: Next) -> Response {
    let token =
        req.headers().get("authorization").and_then(|v| v.to_str().ok()).and_then(|v| v.strip_prefix("Bearer "));
    match token.and_then(|t| KEYS.iter().find(|(key, _, _)| *key == t)) {
        Some((_, org, user)) => {
            let tenant = TenantKey::new([*org, *user]).expect("static keys are valid");
            req.extensions_mut().insert(tenant);
            next.run(req).await
        }
        None => (StatusCode::UNAUTHORIZED, "unknown API key").into_response(),
    }
}

/// The application: limits per user and per org, behind authentication.
fn app() -> Router {
    let limits = LimitSetLayer::new(
        LimitSetPolicy::new()
            .tiers(["org", "user"])
            .limit(LimitPolicy::gcra("user-requests", Rate::per_minute(60), 5).per("user"))
            .limit(LimitPolicy::gcra("org-requests", Rate::per_minute(600), 20).per("org"))
            .limit(LimitPolicy::semaphore("user-concurrency", 2).per("user")),
    )
    .expect("a valid policy")
    .key(FromExtension::<TenantKey>::new())
    .reject_with(HttpAnswer::new().with_json_body().with_all_limits());
    Router::new().route("/", get(|| async { "hello\n" })).layer(limits).layer(middleware::from_fn(authenticate))
}

#[tokio::main]
async fn main() -> std::io::Result<()> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
    println!("listening on http://{}", listener.local_addr()?);
    axum::serve(listener, app()).await
}

#[cfg(test)]
mod tests {
    use axum::body::Body;
    use http_body_util::BodyExt;
    use tower::ServiceExt;

    use super::*;

    fn get_as(token: &str) -> Request {
        Request::get("/").header("authorization", format!("Bearer {token}")).body(Body::empty()).unwrap()
    }

    #[tokio::test(start_paused = true)]
    async fn clones_of_the_router_share_each_users_limit() {
        let app = app();
        for _ in 0..5 {
            assert_eq!(app.clone().oneshot(get_as("alice-key")).await.unwrap().status(), StatusCode::OK);
        }
        let refused = app.clone().oneshot(get_as("alice-key")).await.unwrap();
        assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(refused.headers()["retry-after"], "1");
        assert!(refused.headers()["ratelimit-policy"].to_str().unwrap().contains("\"user-requests\";q=5;w=5"));
        let body = refused.into_body().collect().await.unwrap().to_bytes();
        let body = String::from_utf8(body.to_vec()).unwrap();
        assert!(body.contains("\"limit\":\"user-requests\"") && body.contains("\"tier\":\"user\""), "{body}");
        // Bob, in the same org, has his own user limit.
        assert_eq!(app.clone().oneshot(get_as("bob-key")).await.unwrap().status(), StatusCode::OK);
        assert_eq!(app.oneshot(get_as("mallory")).await.unwrap().status(), StatusCode::UNAUTHORIZED);
    }
}
