//! Health, readiness, the model list, and JSON answers for unknown paths and methods.
//!
//! - `GET /healthz`: `200 {"status": "ok"}` while the process serves (liveness).
//! - `GET /readyz`: `200` when the gateway should get traffic, `503` otherwise, with the
//!   checks in the body: not draining (SIGTERM or SIGINT turn it not-ready before the
//!   listener closes), the tenants' limits decidable (in memory; or Redis answering; or
//!   Redis away but `gateway.backend_failure` admitting requests, `fail_open` or
//!   `fallback`), and at least one upstream account not benched by a `429`; and, for
//!   information, the connections open, receiving a body, and on places kept for
//!   probes (see [`crate::server`]), and with Redis the replicas configured and seen (see
//!   [`crate::roster`]).
//! - `GET /v1/models`: the models of `gateway.embedding_models` and `gateway.chat_models`,
//!   in OpenAI's list shape, for a known key (as OpenAI asks one): `401` otherwise.
//! - `GET /metrics`: the layers' numbers in Prometheus' text format (see
//!   [`crate::metrics`]), added here with the others.
//!
//! All four are answered from memory: no call to Redis or the upstream; all but the model
//! list without a key. Any other path gets a JSON `404`, a known path with another method a JSON
//! `405`, both in OpenAI's error shape.

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use axum::Router;
use axum::body::Body;
use axum::routing::get;
use http::{Method, Response, StatusCode, Uri};
use tower_limits::{Instant, LimitPool};
use tower_limits_redis::RedisBackend;

use crate::api;
use crate::config::{Account, BackendFailure};

/// Where the tenants' limits are decided, as far as readiness is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendStatus {
    /// In this process: always there.
    InMemory,
    /// Redis answers.
    Up,
    /// Redis does not answer (or was never reached): the failure policy decides.
    Down,
}

impl BackendStatus {
    fn as_str(self) -> &'static str {
        match self {
            BackendStatus::InMemory => "in_memory",
            BackendStatus::Up => "redis_up",
            BackendStatus::Down => "redis_down",
        }
    }
}

/// The gateway's health: draining or not, the limits backend, the upstream accounts.
pub struct Health {
    draining: AtomicBool,
    /// The server's connections, as it counts them.
    connections: Arc<crate::server::Connections>,
    /// The fleet's size, configured and seen (`serve --redis`).
    fleet: std::sync::OnceLock<Arc<crate::roster::FleetSize>>,
    /// `None` in memory; the plans' Redis backends once connected (empty before).
    redis: Option<Mutex<Vec<RedisBackend>>>,
    failure: BackendFailure,
    pool: LimitPool<Account>,
    now: Arc<dyn Fn() -> Instant + Send + Sync>,
}

impl fmt::Debug for Health {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Health")
            .field("draining", &self.is_draining())
            .field("backend", &self.backend())
            .finish_non_exhaustive()
    }
}

impl Health {
    pub(crate) fn new(
        pool: LimitPool<Account>,
        now: Arc<dyn Fn() -> Instant + Send + Sync>,
        failure: BackendFailure,
        redis: bool,
    ) -> Self {
        Health {
            draining: AtomicBool::new(false),
            connections: Arc::default(),
            fleet: std::sync::OnceLock::new(),
            redis: redis.then(|| Mutex::new(Vec::new())),
            failure,
            pool,
            now,
        }
    }

    /// Reports the fleet's size in `/readyz` (the first call wins).
    pub fn track_fleet(&self, size: Arc<crate::roster::FleetSize>) {
        let _ = self.fleet.set(size);
    }

    /// The server's connections: what `serve` counts for this gateway.
    #[must_use]
    pub fn connections(&self) -> &Arc<crate::server::Connections> {
        &self.connections
    }

    pub(crate) fn set_redis(&self, backends: Vec<RedisBackend>) {
        if let Some(r) = &self.redis {
            *r.lock().unwrap_or_else(PoisonError::into_inner) = backends;
        }
    }

    /// Turns `/readyz` not-ready for good: the process is shutting down.
    pub fn start_draining(&self) {
        self.draining.store(true, Ordering::Release);
    }

    /// Whether the process is shutting down.
    #[must_use]
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
    }

    /// The limits backend's state now.
    #[must_use]
    pub fn backend(&self) -> BackendStatus {
        let Some(redis) = &self.redis else { return BackendStatus::InMemory };
        let backends = redis.lock().unwrap_or_else(PoisonError::into_inner);
        if backends.is_empty() || backends.iter().any(|b| b.stats().breaker_open) {
            BackendStatus::Down
        } else {
            BackendStatus::Up
        }
    }

    /// Upstream accounts not benched now.
    #[must_use]
    pub fn usable_accounts(&self) -> usize {
        let now = (self.now)();
        (0..self.pool.len()).filter(|&i| self.pool.benched_until(i, now).is_none()).count()
    }

    /// Whether the gateway should get traffic, and the checks' body.
    #[must_use]
    pub fn readiness(&self) -> (bool, serde_json::Value) {
        let draining = self.is_draining();
        let backend = self.backend();
        let decidable = backend != BackendStatus::Down || self.failure != BackendFailure::FailClosed;
        let accounts = self.usable_accounts();
        let ready = !draining && decidable && accounts > 0;
        let body = serde_json::json!({
            "status": if ready { "ready" } else { "not_ready" },
            "draining": draining,
            "backend": backend.as_str(),
            "backend_failure_policy": match self.failure {
                BackendFailure::FailClosed => "fail_closed",
                BackendFailure::FailOpen => "fail_open",
                BackendFailure::Fallback => "fallback",
            },
            "limits_decidable": decidable,
            "usable_accounts": accounts,
            "accounts": self.pool.len(),
            "connections": self.connections.to_json(),
        });
        let mut body = body;
        if let Some(fleet) = self.fleet.get() {
            body["replicas"] = fleet.to_json();
        }
        (ready, body)
    }
}

fn json(status: StatusCode, body: &serde_json::Value) -> Response<Body> {
    let mut r = api::json_response(body.to_string());
    *r.status_mut() = status;
    r
}

/// `router` with `/healthz`, `/readyz`, `/v1/models`, `/metrics` (see [`crate::metrics`])
/// and the JSON `404` and `405`.
pub fn routes(router: Router, health: &Arc<Health>, models: &[String], auth: crate::auth::AuthLayer) -> Router {
    let router = crate::metrics::routes(router);
    let ready = health.clone();
    let list = serde_json::json!({
        "object": "list",
        "data": models
            .iter()
            .map(|m| serde_json::json!({ "id": m, "object": "model", "created": 0, "owned_by": "embedding-gateway" }))
            .collect::<Vec<_>>(),
    });
    router
        .route("/healthz", get(|| async { json(StatusCode::OK, &serde_json::json!({ "status": "ok" })) }))
        .route(
            "/readyz",
            get(move || {
                let (ok, body) = ready.readiness();
                let status = if ok { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
                async move { json(status, &body) }
            }),
        )
        .route(
            "/v1/models",
            axum::routing::get_service(tower::Layer::layer(
                &auth,
                tower::service_fn(move |_req: http::Request<Body>| {
                    let answer = json(StatusCode::OK, &list);
                    async move { Ok::<_, std::convert::Infallible>(answer) }
                }),
            )),
        )
        .fallback(|method: Method, uri: Uri| async move {
            api::error_response(
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                "not_found",
                &format!("no such endpoint: {method} {}", uri.path()),
            )
        })
        .method_not_allowed_fallback(|method: Method, uri: Uri| async move {
            api::error_response(
                StatusCode::METHOD_NOT_ALLOWED,
                "invalid_request_error",
                "method_not_allowed",
                &format!("{} does not take {method}", uri.path()),
            )
        })
}
