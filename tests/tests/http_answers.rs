//! Law 28, HTTP and gRPC answers: real `http::Request`s through `oneshot`, and an axum
//! `Router` whose clones share the limit and answer 429 with the right fields. Law
//! numbers are those of `crates/tower-limits/docs/laws.md`.

use std::convert::Infallible;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::routing::get;
use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use tower::{ServiceBuilder, ServiceExt};
use tower_limits::extract::{Cost, CostFromExtension, FromExtension, KeyFn, Usage, UsageFromExtension};
use tower_limits::http::HttpAnswer;
use tower_limits::{
    BoxError, ErrorKind, GcraLayer, LimitError, LimitPolicy, LimitSetLayer, LimitSetPolicy, Quota, SemaphoreLayer,
    TenantKey, nz,
};

fn policy() -> LimitSetPolicy {
    LimitSetPolicy::new()
        .tiers(["org", "user"])
        .limit(LimitPolicy::gcra("requests", Quota::per_minute(nz!(60)).burst(nz!(2))).per("user"))
        .limit(
            LimitPolicy::token_bucket("tokens", Quota::per_minute(nz!(60_000)).burst(nz!(10_000)))
                .per("org")
                .counting_cost(),
        )
        .limit(LimitPolicy::semaphore("shared", 100))
}

fn request(tenant: Option<[&str; 2]>, cost: u64) -> Request<String> {
    let mut req = Request::new(String::new());
    if let Some(parts) = tenant {
        req.extensions_mut().insert(TenantKey::new(parts).unwrap());
    }
    req.extensions_mut().insert(Cost(cost));
    req
}

fn ok_service() -> impl tower::Service<Request<String>, Response = Response<String>, Error = Infallible, Future: Send>
+ Clone
+ Send
+ 'static {
    tower::service_fn(|req: Request<String>| async move {
        let used = req.extensions().get::<Cost>().map_or(0, |c| c.0 / 2);
        let mut response = Response::new(String::from("ok"));
        response.extensions_mut().insert(Usage(used));
        Ok::<_, Infallible>(response)
    })
}

#[tokio::test(start_paused = true)]
async fn a_tenant_limit_answers_429_with_its_fields() {
    let layer = LimitSetLayer::new(policy())
        .unwrap()
        .key(FromExtension::<TenantKey>::new())
        .cost(CostFromExtension)
        .usage(UsageFromExtension)
        .refuse_with(HttpAnswer::new());
    let svc = ServiceBuilder::new().layer(layer).service(ok_service());
    for _ in 0..2 {
        let response = svc.clone().oneshot(request(Some(["acme", "alice"]), 100)).await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
    }
    let response = svc.clone().oneshot(request(Some(["acme", "alice"]), 100)).await.unwrap();
    assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
    let h = response.headers();
    assert_eq!(h["retry-after"], "1");
    // The plan (60 per minute), not its burst of 2 (which read as 2 per 2 s); the state:
    // nothing left, full again in 2 s.
    assert_eq!(h["ratelimit-policy"], "\"requests\";q=60;w=60");
    assert_eq!(h["ratelimit"], "\"requests\";r=0;t=2");
    assert!(response.body().get_ref().is_empty());
    // Another user of the same org is not blocked by alice's own limit.
    let bob = svc.oneshot(request(Some(["acme", "bob"]), 100)).await.unwrap();
    assert_eq!(bob.status(), StatusCode::OK);
}

#[tokio::test(start_paused = true)]
async fn rate_limits_answer_429_the_servers_capacity_503_and_a_missing_key_401() {
    // A rate limit paces its callers, global or keyed: 429.
    let layer = GcraLayer::new(Quota::per_second(nz!(1))).refuse_with(HttpAnswer::new());
    let svc = ServiceBuilder::new().layer(layer).service(ok_service());
    assert_eq!(svc.clone().oneshot(request(None, 1)).await.unwrap().status(), StatusCode::OK);
    let response = svc.oneshot(request(None, 1)).await.unwrap();
    assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(response.headers()["retry-after"], "1");
    assert_eq!(response.headers()["ratelimit-policy"], "\"gcra\";q=1;w=1");

    // A global semaphore is the server's own capacity: 503.
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let rx = std::sync::Arc::new(tokio::sync::Mutex::new(Some(rx)));
    let held = tower::service_fn(move |_req: Request<String>| {
        let rx = rx.clone();
        async move {
            if let Some(rx) = rx.lock().await.take() {
                let _ = rx.await;
            }
            Ok::<_, BoxError>(Response::new(String::new()))
        }
    });
    let svc = ServiceBuilder::new().layer(SemaphoreLayer::new(nz!(1)).refuse_with(HttpAnswer::new())).service(held);
    let first = tokio::spawn(svc.clone().oneshot(request(None, 1)));
    tokio::task::yield_now().await;
    let response = svc.clone().oneshot(request(None, 1)).await.unwrap();
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    // Nobody knows when a slot frees: the suggested wait, so that clients back off.
    assert_eq!(response.headers()["retry-after"], "1");
    assert_eq!(response.headers()["retry-after-ms"], "1000");
    tx.send(()).unwrap();
    assert_eq!(first.await.unwrap().unwrap().status(), StatusCode::OK);

    // Either can be chosen otherwise.
    let answer = HttpAnswer::new().with_status(|e: &LimitError| match e.kind() {
        ErrorKind::RateLimited => StatusCode::SERVICE_UNAVAILABLE,
        _ => e.status(),
    });
    let svc = ServiceBuilder::new()
        .layer(GcraLayer::new(Quota::per_second(nz!(1))).refuse_with(answer))
        .service(ok_service());
    assert_eq!(svc.clone().oneshot(request(None, 1)).await.unwrap().status(), StatusCode::OK);
    assert_eq!(svc.oneshot(request(None, 1)).await.unwrap().status(), StatusCode::SERVICE_UNAVAILABLE);

    let keyed = LimitSetLayer::new(policy())
        .unwrap()
        .key(FromExtension::<TenantKey>::new())
        .refuse_with(HttpAnswer::new().with_json_body());
    let svc = ServiceBuilder::new().layer(keyed).service(ok_service());
    let response = svc.oneshot(request(None, 1)).await.unwrap();
    assert_eq!(response.status(), StatusCode::UNAUTHORIZED);
    assert!(!response.headers().contains_key("retry-after"), "waiting cannot help a missing key");
    assert_eq!(response.headers()["www-authenticate"], "Bearer", "every 401 names its challenge");
    assert_eq!(response.headers()["content-type"], "application/problem+json");
    assert!(response.body().get_ref().contains("\"kind\":\"missing_key\""), "{}", response.body().get_ref());
}

#[tokio::test(start_paused = true)]
async fn json_bodies_name_the_limit_and_tier() {
    let layer = LimitSetLayer::new(policy())
        .unwrap()
        .key(FromExtension::<TenantKey>::new())
        .cost(CostFromExtension)
        .refuse_with(HttpAnswer::new().with_json_body());
    let svc = ServiceBuilder::new().layer(layer).service(ok_service());
    let response = svc.clone().oneshot(request(Some(["acme", "alice"]), 20_000)).await.unwrap();
    assert_eq!(response.status(), StatusCode::PAYLOAD_TOO_LARGE, "a cost above capacity can never pass");
    for _ in 0..2 {
        svc.clone().oneshot(request(Some(["acme", "alice"]), 1)).await.unwrap();
    }
    let response = svc.oneshot(request(Some(["acme", "alice"]), 1)).await.unwrap();
    assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
    let body = response.body().get_ref();
    for part in ["\"status\":429", "\"limit\":\"requests\"", "\"tier\":\"user\"", "\"retry_after_ms\":1000"] {
        assert!(body.contains(part), "{part} in {body}");
    }
}

#[tokio::test(start_paused = true)]
async fn openai_fields_and_success_headers() {
    let layer = LimitSetLayer::new(policy())
        .unwrap()
        .key(FromExtension::<TenantKey>::new())
        .cost(CostFromExtension)
        .usage(UsageFromExtension)
        .refuse_with(HttpAnswer::new().with_openai_fields().on_success());
    let svc = ServiceBuilder::new().layer(layer).service(ok_service());
    let response = svc.clone().oneshot(request(Some(["acme", "alice"]), 1_000)).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let h = response.headers();
    // The quota per minute the user signed up for; what is left right now (of the burst).
    assert_eq!(h["x-ratelimit-limit-requests"], "60");
    assert_eq!(h["x-ratelimit-remaining-requests"], "1");
    assert_eq!(h["x-ratelimit-reset-requests"], "1s");
    assert_eq!(h["x-ratelimit-limit-tokens"], "60000");
    assert_eq!(h["x-ratelimit-remaining-tokens"], "9000", "the snapshot is taken at admission, before settling");
    assert_eq!(
        h["ratelimit-policy"],
        "\"requests\";q=60;w=60, \"tokens\";q=60000;w=60, \"shared\";q=100;qu=\"concurrent-requests\""
    );
    // Settled to half the estimate when the body ends (as a server sends it): 500 came back.
    response.into_body().collect().await.unwrap();
    let response = svc.oneshot(request(Some(["acme", "alice"]), 1)).await.unwrap();
    assert_eq!(response.headers()["x-ratelimit-remaining-tokens"], "9499");
}

#[tokio::test(start_paused = true)]
async fn an_axum_router_shares_its_limit_across_clones() {
    // Stand-in for an auth layer: the bearer token names the tenant.
    let keys = KeyFn::new(|req: &Request<Body>| {
        let token = req.headers().get("authorization")?.to_str().ok()?.strip_prefix("Bearer ")?;
        TenantKey::new(["acme", token]).ok()
    });
    let limits = LimitSetLayer::new(policy()).unwrap().key(keys).refuse_with(HttpAnswer::new());
    let app = Router::new().route("/", get(|| async { "hello" })).layer(limits);
    let call = |app: Router, who: &str| {
        let req = Request::get("/").header("authorization", format!("Bearer {who}")).body(Body::empty()).unwrap();
        app.oneshot(req)
    };
    assert_eq!(call(app.clone(), "alice").await.unwrap().status(), StatusCode::OK);
    assert_eq!(call(app.clone(), "alice").await.unwrap().status(), StatusCode::OK);
    let refused = call(app.clone(), "alice").await.unwrap();
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS, "each clone of the router shares one limit");
    assert_eq!(refused.headers()["retry-after"], "1");
    assert_eq!(refused.headers()["ratelimit"], "\"requests\";r=0;t=2");
    let ok = call(app.clone(), "bob").await.unwrap();
    assert_eq!(ok.status(), StatusCode::OK);
    assert_eq!(ok.into_body().collect().await.unwrap().to_bytes(), "hello");
    tokio::time::advance(Duration::from_secs(1)).await;
    assert_eq!(call(app, "alice").await.unwrap().status(), StatusCode::OK, "one more after a second");
}

#[tokio::test(start_paused = true)]
async fn errors_map_to_grpc_statuses() {
    let svc = ServiceBuilder::new()
        .layer(LimitSetLayer::new(policy()).unwrap().key(FromExtension::<TenantKey>::new()))
        .service(ok_service());
    for _ in 0..2 {
        svc.clone().oneshot(request(Some(["acme", "alice"]), 1)).await.unwrap();
    }
    let err: BoxError = svc.oneshot(request(Some(["acme", "alice"]), 1)).await.unwrap_err();
    let err = err.downcast_ref::<LimitError>().unwrap().clone();
    assert_eq!(err.kind(), ErrorKind::RateLimited);
    let status = tonic::Status::from(err);
    assert_eq!(status.code(), tonic::Code::ResourceExhausted);
    assert_eq!(status.metadata().get("grpc-retry-pushback-ms").unwrap(), "1000");
    assert!(status.metadata().get("retry-after").is_none(), "gRPC's own pushback, not an HTTP field");
}

/// A limit per peer IP finds the address where axum records it (`ConnectInfo`) or where
/// an accept loop puts it (`SocketAddr`, `IpAddr`), and keeps one state per address.
#[tokio::test(start_paused = true)]
async fn a_limit_per_peer_ip_keeps_each_address_apart() {
    use std::net::{IpAddr, SocketAddr};
    use tower_limits::extract::PeerIp;

    let layer = GcraLayer::new(Quota::per_hour(nz!(1))).key(PeerIp).refuse_with(HttpAnswer::new());
    let svc = ServiceBuilder::new().layer(layer).service(ok_service());
    let from = |ip: [u8; 4], how: u8| {
        let mut req = request(None, 1);
        let addr = SocketAddr::from((ip, 4000));
        match how {
            0 => drop(req.extensions_mut().insert(axum::extract::ConnectInfo(addr))),
            1 => drop(req.extensions_mut().insert(addr)),
            _ => drop(req.extensions_mut().insert(IpAddr::from(ip))),
        }
        req
    };
    for how in 0..3 {
        let ip = [10, 0, 0, how];
        assert_eq!(svc.clone().oneshot(from(ip, how)).await.unwrap().status(), StatusCode::OK, "way {how}");
        // The same address, however it was recorded, is the same key.
        let again = svc.clone().oneshot(from(ip, (how + 1) % 3)).await.unwrap();
        assert_eq!(again.status(), StatusCode::TOO_MANY_REQUESTS, "way {how}");
        assert_eq!(again.headers()["ratelimit-policy"], "\"gcra\";q=1;w=3600");
    }
    let nowhere = svc.oneshot(request(None, 1)).await.unwrap();
    assert_eq!(nowhere.status(), StatusCode::INTERNAL_SERVER_ERROR, "no address anywhere: the server's setup");
}

/// Refusals in OpenAI's shape, with the wait in both `Retry-After` (whole seconds, up)
/// and `retry-after-ms` (milliseconds, up), as OpenAI's SDKs read them.
#[tokio::test(start_paused = true)]
async fn openai_refusals_carry_the_error_object_and_both_waits() {
    let layer = LimitSetLayer::new(policy())
        .unwrap()
        .key(FromExtension::<TenantKey>::new())
        .cost(CostFromExtension)
        .refuse_with(HttpAnswer::new().with_openai_body().with_all_limits());
    let svc = ServiceBuilder::new().layer(layer).service(ok_service());
    let mut last = None;
    for _ in 0..4 {
        last = Some(svc.clone().oneshot(request(Some(["acme", "alice"]), 10)).await.unwrap());
    }
    let refused = last.unwrap();
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(refused.headers()["content-type"], "application/json");
    let ms: u64 = refused.headers()["retry-after-ms"].to_str().unwrap().parse().unwrap();
    let s: u64 = refused.headers()["retry-after"].to_str().unwrap().parse().unwrap();
    assert!(ms > 0 && s * 1000 >= ms && (s - 1) * 1000 < ms, "{ms}ms within {s}s");
    let body = refused.into_body().into_inner();
    assert!(body.starts_with("{\"error\":{\"message\":\"Rate limit reached for "), "{body}");
    assert!(body.contains("\"type\":\"requests\",\"param\":null,\"code\":\"rate_limit_exceeded\""), "{body}");
    assert!(body.contains("Please try again in "), "{body}");

    // Waiting exactly retry-after-ms is never early.
    tokio::time::advance(Duration::from_millis(ms)).await;
    let again = svc.oneshot(request(Some(["acme", "alice"]), 10)).await.unwrap();
    assert_eq!(again.status(), StatusCode::OK);
}

/// The fields state the plan a user signed up for, and the truth about what is left, for
/// GCRA and the token bucket alike: 6,000 per minute with a burst of 600 says 6000 per
/// 60 s (the burst said 600 per 6 s), and 240 per minute with a burst of 2 says 240 per
/// 60 s (its 0.5 s burst window, rounded up to 1 s, read as 120 per minute).
#[tokio::test(start_paused = true)]
async fn fields_state_the_plan_not_the_burst() {
    const PLAN: Quota = Quota::per_minute(nz!(6_000)).burst(nz!(600));
    const SMALL_BURST: Quota = Quota::per_minute(nz!(240)).burst(nz!(2));
    for (gcra, quota, policy, after_one, reset) in [
        (true, PLAN, "\"plan\";q=6000;w=60", "599", "10ms"),
        (false, PLAN, "\"plan\";q=6000;w=60", "599", "10ms"),
        (true, SMALL_BURST, "\"plan\";q=240;w=60", "1", "250ms"),
        (false, SMALL_BURST, "\"plan\";q=240;w=60", "1", "250ms"),
    ] {
        let limit = if gcra { LimitPolicy::gcra("plan", quota) } else { LimitPolicy::token_bucket("plan", quota) };
        let layer = LimitSetLayer::new(LimitSetPolicy::new().tiers(["org", "user"]).limit(limit.per("org")))
            .unwrap()
            .key(FromExtension::<TenantKey>::new())
            .refuse_with(HttpAnswer::new().with_openai_fields().on_success());
        let svc = ServiceBuilder::new().layer(layer).service(ok_service());
        let ok = svc.clone().oneshot(request(Some(["acme", "alice"]), 1)).await.unwrap();
        let h = ok.headers();
        assert_eq!(h["ratelimit-policy"], policy, "gcra {gcra}");
        assert_eq!(h["x-ratelimit-limit-requests"], quota.amount().to_string().as_str());
        assert_eq!(h["x-ratelimit-remaining-requests"], after_one, "what can be granted right now");
        assert_eq!(h["x-ratelimit-reset-requests"], reset, "one interval until full again");
        for _ in 1..quota.max_burst() {
            svc.clone().oneshot(request(Some(["acme", "alice"]), 1)).await.unwrap();
        }
        let refused = svc.clone().oneshot(request(Some(["acme", "alice"]), 1)).await.unwrap();
        assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(refused.headers()["ratelimit-policy"], policy);
        assert_eq!(refused.headers()["x-ratelimit-remaining-requests"], "0");
    }
}

/// OpenAI-shaped refusals name the limit, its tier, the plan and when to retry, in the
/// body and in `retry-after-ms`; a concurrency refusal carries the suggested wait in both.
#[tokio::test(start_paused = true)]
async fn openai_bodies_name_the_plan_and_the_wait() {
    let policy = LimitSetPolicy::new()
        .tiers(["org", "user"])
        .limit(LimitPolicy::gcra("org.rpm", Quota::per_minute(nz!(240)).burst(nz!(2))).per("org"))
        .limit(LimitPolicy::semaphore("org.concurrency", 1).per("org"));
    let layer = LimitSetLayer::new(policy)
        .unwrap()
        .key(FromExtension::<TenantKey>::new())
        .refuse_with(HttpAnswer::new().with_openai_body().with_openai_fields());
    let (gate_tx, gate_rx) = tokio::sync::watch::channel(false);
    let svc = ServiceBuilder::new().layer(layer).service(tower::service_fn(move |_req: Request<String>| {
        let mut gate = gate_rx.clone();
        async move {
            let _ = gate.wait_for(|open| *open).await;
            Ok::<_, Infallible>(Response::new(String::from("ok")))
        }
    }));
    let held = tokio::spawn(svc.clone().oneshot(request(Some(["acme", "alice"]), 1)));
    tokio::task::yield_now().await;
    let busy = svc.clone().oneshot(request(Some(["acme", "bob"]), 1)).await.unwrap();
    assert_eq!(busy.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(busy.headers()["content-type"], "application/json");
    assert_eq!(busy.headers()["retry-after"], "1");
    assert_eq!(busy.headers()["retry-after-ms"], "1000");
    let body: serde_json::Value = serde_json::from_str(busy.body().get_ref()).unwrap();
    assert_eq!(body["error"]["code"], "concurrency_limited");
    assert_eq!(
        body["error"]["message"],
        "Too many requests in flight for org.concurrency (per org): limit 1 at once. Please try again in 1.000s."
    );
    gate_tx.send(true).unwrap();
    assert_eq!(held.await.unwrap().unwrap().status(), StatusCode::OK);
    // The refusal charged nothing: the burst's second request passes, the third waits.
    assert_eq!(svc.clone().oneshot(request(Some(["acme", "bob"]), 1)).await.unwrap().status(), StatusCode::OK);
    let rate = svc.clone().oneshot(request(Some(["acme", "bob"]), 1)).await.unwrap();
    assert_eq!(rate.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(rate.headers()["retry-after-ms"], "250");
    assert_eq!(rate.headers()["retry-after"], "1");
    let body: serde_json::Value = serde_json::from_str(rate.body().get_ref()).unwrap();
    assert_eq!(body["error"]["type"], "requests");
    assert_eq!(body["error"]["code"], "rate_limit_exceeded");
    assert_eq!(body["error"]["param"], serde_json::Value::Null);
    assert_eq!(
        body["error"]["message"],
        "Rate limit reached for org.rpm (per org): limit 240 requests per 1m. Please try again in 0.250s."
    );
}

/// Once a permit was given back, a concurrency refusal suggests how long permits are held
/// lately (here 20 ms, told 25: turns are a quarter longer than the mean hold) rather than
/// the second suggested when nobody knows, and refused clients are told successive places
/// in a queue.
#[tokio::test(start_paused = true)]
async fn a_concurrency_refusal_suggests_the_recent_hold_time() {
    let svc = ServiceBuilder::new().layer(SemaphoreLayer::new(nz!(1)).refuse_with(HttpAnswer::new())).service(
        tower::service_fn(|_req: Request<String>| async {
            tokio::time::sleep(Duration::from_millis(20)).await;
            Ok::<_, Infallible>(Response::new(String::from("ok")))
        }),
    );
    // Nothing given back yet: nobody knows.
    let held = tokio::spawn(svc.clone().oneshot(request(None, 1)));
    tokio::task::yield_now().await;
    let refused = svc.clone().oneshot(request(None, 1)).await.unwrap();
    assert_eq!(refused.headers()["retry-after-ms"], "1000");
    // The answer carries its error for the layers outside.
    let error = refused.extensions().get::<tower_limits::LimitError>().expect("the refusal in the extensions");
    assert_eq!(error.kind(), tower_limits::ErrorKind::ConcurrencyLimited);
    assert_eq!(error.openai_code(), "concurrency_limited");
    drop(held.await.unwrap().unwrap());
    // One request held its permit 20 ms: the next refusal says so.
    let held = tokio::spawn(svc.clone().oneshot(request(None, 1)));
    tokio::task::yield_now().await;
    let refused = svc.clone().oneshot(request(None, 1)).await.unwrap();
    assert_eq!(refused.status(), StatusCode::SERVICE_UNAVAILABLE);
    // The hold time and a quarter: the permit comes back around the mean.
    assert_eq!(refused.headers()["retry-after-ms"], "25");
    assert_eq!(refused.headers()["retry-after"], "1");
    // Refused at the same moment, the next ones are told the next places: one permit, so
    // one more turn each.
    for turn in [50, 75, 100] {
        let refused = svc.clone().oneshot(request(None, 1)).await.unwrap();
        assert_eq!(refused.headers()["retry-after-ms"], turn.to_string());
    }
    drop(held.await.unwrap().unwrap());
    // 20 ms later, a client refused joins the end of the queue (the place at 125 ms).
    let held = tokio::spawn(svc.clone().oneshot(request(None, 1)));
    tokio::task::yield_now().await;
    let refused = svc.clone().oneshot(request(None, 1)).await.unwrap();
    assert_eq!(refused.headers()["retry-after-ms"], "105");
    drop(held.await.unwrap().unwrap());
    // Once every place told has passed, the queue starts over a turn from now.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let held = tokio::spawn(svc.clone().oneshot(request(None, 1)));
    tokio::task::yield_now().await;
    let refused = svc.clone().oneshot(request(None, 1)).await.unwrap();
    assert_eq!(refused.headers()["retry-after-ms"], "25");
    drop(held.await.unwrap().unwrap());
}

/// With a retry spacing (the pace of the service behind the layer), refused clients'
/// places are at least that far apart, however short the holds: with 4 permits held 20 ms,
/// places would be 6.25 ms apart; a spacing of 10 ms puts them 10 ms apart.
#[tokio::test(start_paused = true)]
async fn a_retry_spacing_keeps_refused_clients_places_apart() {
    let places = |spacing: Duration| async move {
        let layer = SemaphoreLayer::new(nz!(4)).retry_spacing(spacing).refuse_with(HttpAnswer::new());
        let svc = ServiceBuilder::new().layer(layer).service(tower::service_fn(|_req: Request<String>| async {
            tokio::time::sleep(Duration::from_millis(20)).await;
            Ok::<_, Infallible>(Response::new(String::from("ok")))
        }));
        // One permit given back after 20 ms: the mean hold is known.
        drop(svc.clone().oneshot(request(None, 1)).await.unwrap());
        let held: Vec<_> = (0..4).map(|_| tokio::spawn(svc.clone().oneshot(request(None, 1)))).collect();
        tokio::task::yield_now().await;
        let mut told = Vec::new();
        for _ in 0..3 {
            let refused = svc.clone().oneshot(request(None, 1)).await.unwrap();
            told.push(refused.headers()["retry-after-ms"].to_str().unwrap().to_owned());
        }
        for h in held {
            drop(h.await.unwrap().unwrap());
        }
        told
    };
    // A turn is 25 ms (the hold and a quarter), four permits: 6.25 ms apart (told in
    // whole milliseconds, rounded up).
    assert_eq!(places(Duration::ZERO).await, ["25", "32", "38"]);
    assert_eq!(places(Duration::from_millis(10)).await, ["25", "35", "45"]);
}

/// Spread retries: every refusal of one moment suggests its own wait, never less than the
/// exact one and at most the spread more, so that they do not all come back together.
#[tokio::test(start_paused = true)]
async fn spread_retries_are_never_early_and_come_apart() {
    let layer = GcraLayer::new(Quota::per_second(nz!(1))).refuse_with(HttpAnswer::new().spread_retries(50));
    let svc = ServiceBuilder::new().layer(layer).service(ok_service());
    assert_eq!(svc.clone().oneshot(request(None, 1)).await.unwrap().status(), StatusCode::OK);
    let mut waits = std::collections::BTreeSet::new();
    for _ in 0..200 {
        let refused = svc.clone().oneshot(request(None, 1)).await.unwrap();
        let ms: u64 = refused.headers()["retry-after-ms"].to_str().unwrap().parse().unwrap();
        assert!((1000..=1500).contains(&ms), "{ms} ms is outside the exact wait and its spread");
        waits.insert(ms);
    }
    assert!(waits.len() > 50, "200 refusals suggested only {} waits", waits.len());
    // Without a spread, every refusal names the same instant.
    let exact = ServiceBuilder::new()
        .layer(GcraLayer::new(Quota::per_second(nz!(1))).refuse_with(HttpAnswer::new()))
        .service(ok_service());
    assert_eq!(exact.clone().oneshot(request(None, 1)).await.unwrap().status(), StatusCode::OK);
    for _ in 0..10 {
        assert_eq!(exact.clone().oneshot(request(None, 1)).await.unwrap().headers()["retry-after-ms"], "1000");
    }
}

/// A stand-in's answers keep the wait and state no limit: no field, no quota in the body.
#[tokio::test(start_paused = true)]
async fn without_limit_fields_keeps_only_the_wait() {
    let layer = GcraLayer::new(Quota::per_minute(nz!(240)).burst(nz!(1)))
        .refuse_with(HttpAnswer::new().with_openai_body().with_openai_fields().on_success().without_limit_fields());
    let svc = ServiceBuilder::new().layer(layer).service(ok_service());
    let ok = svc.clone().oneshot(request(None, 1)).await.unwrap();
    assert_eq!(ok.status(), StatusCode::OK);
    assert!(ok.headers().is_empty(), "{:?}", ok.headers());
    let refused = svc.oneshot(request(None, 1)).await.unwrap();
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    let mut names: Vec<&str> = refused.headers().keys().map(|k| k.as_str()).collect();
    names.sort_unstable();
    assert_eq!(names, ["content-type", "retry-after", "retry-after-ms"]);
    assert_eq!(refused.headers()["retry-after-ms"], "250");
    let body: serde_json::Value = serde_json::from_str(refused.body().get_ref()).unwrap();
    assert_eq!(body["error"]["message"], "Rate limit reached for gcra. Please try again in 0.250s.");
}
