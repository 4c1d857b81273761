//! `GET /metrics`: the gateway's numbers in Prometheus' text format.
//!
//! The layers report through the `metrics` facade (tower-limits' feature `metrics`, see
//! `tower_limits::metrics`): every decision by result and reason (`rate_limiting_requests`),
//! time in queue and lease duration as histograms, queue depth (in total, and per tenant
//! for the configured tenants only), the upstream accounts' selections and answers, and,
//! with Redis, backend failures and the failure policy's decisions. The gateway names its
//! layers `plan` (each tenant's plan) and `upstream` (the fair queue in front of the
//! accounts). The gateway adds its own: `gateway_responses` (every answer, by `status`
//! and by the gateway's own error `code`, `none` for the others: the `401`s of guessed
//! keys, the `408 body_too_slow`s, the `502`s and `504`s of the upstream, ...; a spent
//! budget is `code="budget_exceeded"`), `gateway_spend_micros` (what the budgets counted
//! as settled, in micro-units, by configured `tenant` and `currency`) and
//! `gateway_connections` (by `state`: `open`, `receiving_body`, `probe_place`; see
//! [`crate::server`]).
//!
//! The recorder is `metrics-exporter-prometheus` without its HTTP listener: the process
//! installs it once as the global recorder, and this route renders it from its handle,
//! unauthenticated like `/healthz` (put it behind the network's own access rules). A
//! thread runs the exporter's upkeep every few seconds, so that histogram samples are
//! folded into their buckets even when nobody scrapes. If another global recorder was
//! installed first (the gateway embedded in a larger program), the route renders an
//! empty page: that recorder has the numbers.

use std::sync::OnceLock;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::routing::get;
use http::{Response, StatusCode, header};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

/// Histogram buckets, in seconds: from a millisecond to a minute, for waits and leases.
const BUCKETS: [f64; 14] = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 15.0, 60.0];

/// How often the exporter's upkeep runs.
const UPKEEP: Duration = Duration::from_secs(5);

/// The process's Prometheus recorder, installed as the global recorder on first use.
#[must_use]
pub fn handle() -> PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let builder = PrometheusBuilder::new();
            // Constant, valid buckets: `set_buckets` only refuses an empty list.
            let builder = builder.set_buckets(&BUCKETS).unwrap_or_else(|_| PrometheusBuilder::new());
            let recorder = builder.build_recorder();
            let handle = recorder.handle();
            if metrics::set_global_recorder(recorder).is_err() {
                tracing::warn!("another metrics recorder is installed: /metrics will be empty");
            }
            let upkeep = handle.clone();
            let spawned = std::thread::Builder::new().name("metrics-upkeep".into()).spawn(move || {
                loop {
                    std::thread::sleep(UPKEEP);
                    upkeep.run_upkeep();
                }
            });
            if let Err(e) = spawned {
                tracing::warn!(error = %e, "no upkeep thread for the metrics: histograms fold at scrape time only");
            }
            handle
        })
        .clone()
}

/// The sum of the samples of `name` in a Prometheus text page whose labels include every
/// `key="value"` of `labels`: how the demo's summary reads the numbers `/metrics` serves.
///
/// ```
/// let page = "# TYPE x counter\nx{layer=\"plan\",result=\"admitted\"} 3\nx{layer=\"plan\",result=\"refused\"} 1\n";
/// assert_eq!(embedding_gateway::metrics::sum(page, "x", &[r#"layer="plan""#]), 4.0);
/// assert_eq!(embedding_gateway::metrics::sum(page, "x", &[r#"result="refused""#]), 1.0);
/// ```
#[must_use]
pub fn sum(page: &str, name: &str, labels: &[&str]) -> f64 {
    page.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let metric = series.split('{').next()?;
            (metric == name && labels.iter().all(|label| series.contains(label))).then(|| value.parse::<f64>().ok())?
        })
        .fold(0.0, |total, v| total + v)
}

/// The `status` label of `gateway_responses`: the statuses the gateway answers, and
/// `other` for any other an upstream might send (a bounded set of labels).
pub(crate) fn status_label(status: http::StatusCode) -> &'static str {
    match status.as_u16() {
        200 => "200",
        400 => "400",
        401 => "401",
        404 => "404",
        405 => "405",
        408 => "408",
        413 => "413",
        429 => "429",
        500 => "500",
        502 => "502",
        503 => "503",
        504 => "504",
        s if s < 300 => "2xx",
        s if s < 500 => "4xx",
        _ => "5xx",
    }
}

/// Counts each answer of `router` in `gateway_responses` by status.
pub fn count_responses(router: Router) -> Router {
    // The recorder first: the handle of the most frequent answer is resolved once, here.
    let _ = handle();
    let ok = metrics::counter!("gateway_responses", "status" => "200", "code" => "none");
    router.layer(tower::util::MapResponseLayer::new(move |response: Response<Body>| {
        // The gateway's own error code, or that of a limit layer's refusal (which are also
        // counted by reason in `rate_limiting_requests`).
        let code = crate::api::answer_code(response.extensions());
        if response.status() == StatusCode::OK && code.is_none() {
            ok.increment(1);
        } else {
            let code = code.unwrap_or("none");
            metrics::counter!("gateway_responses", "status" => status_label(response.status()), "code" => code)
                .increment(1);
        }
        response
    }))
}

/// `router` with `GET /metrics`.
pub fn routes(router: Router) -> Router {
    let handle = handle();
    router.route(
        "/metrics",
        get(move || {
            let text = handle.render();
            async move {
                let mut response = Response::new(Body::from(text));
                *response.status_mut() = StatusCode::OK;
                response.headers_mut().insert(
                    header::CONTENT_TYPE,
                    http::HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
                );
                response
            }
        }),
    )
}
