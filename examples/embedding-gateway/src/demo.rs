//! The demo: a mock upstream and the gateway on loopback ports, a few tenants driving
//! load for a few seconds, then a table, an SVG chart and a verdict.
//!
//! Everything runs in this process, on `127.0.0.1` ports chosen by the system. Each
//! client of the configuration's `[demo]` section keeps `concurrency` requests in flight
//! with `batch` inputs of `words` words each, until the time is up (requests still in
//! flight then are dropped and not counted; each task also stops after
//! [`MAX_REQUESTS_PER_TASK`]). A refused client waits what the answer's `retry-after-ms`
//! (else `Retry-After`) says, as OpenAI's SDKs do (at most a second), or 50 ms when it
//! says nothing, before trying again.
//!
//! # The verdict
//!
//! The demo fails (exit status 1) when the upstream answered any `429`, or when a
//! tenant's share of the admitted tokens strays from its target by more than
//! `demo.tolerance` (absolute; 0.05 means five points of the whole). Shares are measured
//! after a warm-up (a quarter of the run, at most a second) while the fair queue fills.
//! A tenant refused by its own plan's rate limits is capped by its plan, not by the
//! shared capacity: its target is what it got, and the other tenants' targets split the
//! rest in proportion to their weights.

// Printing the progress, the table and the verdict is the demo's job.
#![allow(clippy::print_stdout)]

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, StatusCode, header};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde::Deserialize;
use tokio::net::TcpListener;
use tokio::time::Instant;

use crate::api::UsageOnly;
use crate::chart::{Reference, Series, line_chart};
use crate::config::Config;
use tower_limits_redis::RedisConnection;

use crate::gateway::{Gateway, QUEUE_TIME_HEADER, Sharing, http_transport};
use crate::upstream;

/// The most requests one client task sends.
pub const MAX_REQUESTS_PER_TASK: u64 = 100_000;

/// How often the chart samples the trailing second.
const STEP: Duration = Duration::from_millis(100);

/// What the demo is asked to do.
#[derive(Debug, Clone)]
pub struct DemoOptions {
    /// How long to drive load (the configuration's `demo.seconds` otherwise).
    pub seconds: Option<u64>,
    /// Where to write the SVG chart.
    pub svg: PathBuf,
    /// Print the progress lines.
    pub progress: bool,
    /// Run several gateway replicas sharing their limits through Redis.
    pub redis: Option<RedisOptions>,
    /// Print the shares' verdict without failing on it (to look at a configuration whose
    /// targets are not expected to hold).
    pub advisory_shares: bool,
}

/// The `--redis URL --replicas N` mode.
#[derive(Debug, Clone)]
pub struct RedisOptions {
    /// Where Redis is (`redis://127.0.0.1:6379/`).
    pub url: String,
    /// How many gateway replicas to run.
    pub replicas: u64,
    /// Route unevenly: the first tenant's connections all to the first replica, the
    /// others' split 60/30/10 (then evenly over any further replicas' share of the 10).
    pub uneven: bool,
}

/// The replica a client task's connection goes to.
fn route(client: usize, task: usize, replicas: usize, uneven: bool) -> usize {
    if !uneven || replicas < 2 {
        return (client + task) % replicas;
    }
    if client == 0 {
        return 0;
    }
    // 60/30/10 over ten slots, the task's slot spread by a stride coprime with ten.
    let slot = (task * 3 + client) % 10;
    match slot {
        0..=5 => 0,
        6..=8 => 1,
        _ => 2 + (task / 10) % (replicas - 2).max(1),
    }
    .min(replicas - 1)
}

/// The outcome, for the exit status.
#[derive(Debug, Clone)]
pub struct DemoReport {
    /// `429` answers the upstream gave.
    pub upstream_429: u64,
    /// Tenants whose share strayed beyond the tolerance.
    pub off_share: Vec<String>,
    /// A fleet of replicas used less than 90% of what the accounts' mirrors allowed.
    pub underused: bool,
    /// Shares beyond tolerance do not fail the demo.
    pub advisory_shares: bool,
}

impl DemoReport {
    /// Whether the demo passed.
    #[must_use]
    pub fn passed(&self) -> bool {
        self.upstream_429 == 0 && (self.off_share.is_empty() || self.advisory_shares) && !self.underused
    }
}

/// One finished request, as a client saw it.
#[derive(Debug, Clone)]
struct Event {
    tenant: usize,
    /// When the answer came, since the start.
    at: Duration,
    outcome: Outcome,
}

#[derive(Debug, Clone)]
enum Outcome {
    Ok { tokens: u64, queued: Duration },
    Refused { reason: String, own_rate_limit: bool },
}

/// The parts of a refusal body the demo reads: OpenAI's error object, as every refusal
/// of the gateway has it.
#[derive(Debug, Default, Deserialize)]
struct Refusal {
    error: Option<ErrorBody>,
}

#[derive(Debug, Default, Deserialize)]
struct ErrorBody {
    code: Option<String>,
    message: Option<String>,
}

#[derive(Debug)]
struct TenantInfo {
    name: String,
    weight: u32,
    plan: String,
}

/// Runs the demo on `config` and prints its progress, table and verdict.
///
/// # Errors
/// A loopback port cannot be bound, or the gateway cannot be built.
#[allow(clippy::too_many_lines)] // a script, read top to bottom
pub async fn run(mut config: Config, options: &DemoOptions) -> Result<DemoReport, tower::BoxError> {
    let seconds = options.seconds.unwrap_or(config.demo.seconds);
    if config.demo.clients.is_empty() {
        return Err("the configuration has no [[demo.client]]".into());
    }

    // The mock upstream, on a port of the system's choosing.
    let upstream_listener = TcpListener::bind(("127.0.0.1", 0)).await?;
    let upstream_addr = upstream_listener.local_addr()?;
    for account in &mut config.accounts {
        account.base_url = format!("http://{upstream_addr}");
    }
    let (upstream_router, upstream_stats) = upstream::router(&config.accounts, config.upstream);
    tokio::spawn(async move { axum::serve(upstream_listener, upstream_router).await });

    // The gateway: one replica in memory, or several sharing their limits in Redis.
    let mut gateways = Vec::new();
    let mut built = Vec::new();
    let replicas = options.redis.as_ref().map_or(1, |r| r.replicas.max(1));
    let namespace = format!(
        "egw-demo-{}-{}",
        std::process::id(),
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis())
    );
    for _ in 0..replicas {
        let sharing = match &options.redis {
            None => Sharing::InMemory,
            Some(r) => Sharing::Redis {
                connection: RedisConnection::connect(&r.url).await.map_err(|e| format!("redis at {}: {e}", r.url))?,
                replicas,
                namespace: namespace.clone(),
            },
        };
        let gateway = Gateway::with_sharing(&config, http_transport(), &sharing)?;
        let listener = TcpListener::bind(("127.0.0.1", 0)).await?;
        let addr = listener.local_addr()?;
        let router = gateway.router.clone();
        tokio::spawn(async move { axum::serve(listener, router).await });
        gateways.push(addr);
        built.push(gateway);
    }
    let gateway_addr = match &options.redis {
        None => gateways[0].to_string(),
        Some(r) => format!(
            "{} ({replicas} replicas sharing the tenants' limits and the accounts' mirrors through Redis at {}{})",
            gateways.iter().map(ToString::to_string).collect::<Vec<_>>().join(", "),
            r.url,
            if r.uneven { ", routed unevenly" } else { "" }
        ),
    };

    // Who drives what.
    let mut tenants: Vec<TenantInfo> = Vec::new();
    let mut client_tenant = Vec::new();
    for c in &config.demo.clients {
        let t = config.tenants.iter().find(|t| t.keys.iter().any(|k| k.secret == c.key)).ok_or("unknown demo key")?;
        let index = match tenants.iter().position(|x| x.name == t.name) {
            Some(i) => i,
            None => {
                tenants.push(TenantInfo {
                    name: t.name.clone(),
                    weight: t.weight,
                    plan: config.plans[t.plan].name.clone(),
                });
                tenants.len() - 1
            }
        };
        client_tenant.push(index);
    }

    println!(
        "embedding-gateway demo: upstream on {upstream_addr} ({} accounts), gateway on {gateway_addr}, {} tenants, {seconds}s",
        config.accounts.len(),
        tenants.len()
    );
    for a in &config.accounts {
        println!(
            "  account {:<10} {} requests and {} tokens per {:?} window (rpm {}, tpm {})",
            a.name,
            a.requests_per_window(),
            a.tokens_per_window(),
            a.window,
            a.rpm,
            a.tpm
        );
    }
    for (i, c) in config.demo.clients.iter().enumerate() {
        let t = &tenants[client_tenant[i]];
        println!(
            "  tenant  {:<10} weight {}, plan {:<9} {} in flight, {} inputs of {} words per request",
            t.name, t.weight, t.plan, c.concurrency, c.batch, c.words
        );
    }

    let client: Client<HttpConnector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).pool_max_idle_per_host(1024).build_http();
    let urls: Vec<http::Uri> =
        gateways.iter().map(|a| format!("http://{a}/v1/embeddings").parse()).collect::<Result<_, _>>()?;
    let start = Instant::now();
    let deadline = start + Duration::from_secs(seconds);
    let events: Arc<Mutex<Vec<Event>>> = Arc::default();
    let live: Arc<Vec<AtomicU64>> = Arc::new((0..tenants.len()).map(|_| AtomicU64::new(0)).collect());
    let refused_live = Arc::new(AtomicU64::new(0));
    // Per replica: answers, and tokens served.
    let per_replica: Arc<Vec<(AtomicU64, AtomicU64)>> =
        Arc::new((0..urls.len()).map(|_| (AtomicU64::new(0), AtomicU64::new(0))).collect());
    let uneven = options.redis.as_ref().is_some_and(|r| r.uneven);
    // Per replica and tenant: tokens served.
    let mix: Arc<Vec<AtomicU64>> = Arc::new((0..urls.len() * tenants.len()).map(|_| AtomicU64::new(0)).collect());
    let n_tenants = tenants.len();

    let mut tasks = Vec::new();
    for (ci, c) in config.demo.clients.iter().enumerate() {
        for task in 0..c.concurrency {
            // Each client's tasks spread over the replicas (or not: --uneven).
            let replica = route(ci, task, urls.len(), uneven);
            let url = urls[replica].clone();
            let (client, events, live, refused_live, per_replica, mix) =
                (client.clone(), events.clone(), live.clone(), refused_live.clone(), per_replica.clone(), mix.clone());
            let (key, batch, words, tenant) = (c.key.clone(), c.batch, c.words, client_tenant[ci]);
            tasks.push(tokio::spawn(async move {
                let mut seed = (ci as u64) << 40 | (task as u64) << 20;
                for _ in 0..MAX_REQUESTS_PER_TASK {
                    seed += 1;
                    let body = request_body(seed, batch, words);
                    let req = Request::post(url.clone())
                        .header(header::AUTHORIZATION, format!("Bearer {key}"))
                        .header(header::CONTENT_TYPE, "application/json")
                        .body(Full::new(Bytes::from(body)));
                    let Ok(req) = req else { break };
                    let answer = async {
                        let response = client.request(req).await.ok()?;
                        let status = response.status();
                        let queued = response
                            .headers()
                            .get(QUEUE_TIME_HEADER)
                            .and_then(|v| v.to_str().ok()?.parse::<u64>().ok())
                            .map(Duration::from_micros);
                        // As OpenAI's SDKs: `retry-after-ms`, else `Retry-After` in seconds.
                        let header = |name: &str| {
                            response.headers().get(name).and_then(|v| v.to_str().ok()?.parse::<u64>().ok())
                        };
                        let wait = header("retry-after-ms")
                            .map(Duration::from_millis)
                            .or_else(|| header("retry-after").map(Duration::from_secs));
                        let body = response.into_body().collect().await.ok()?.to_bytes();
                        Some((status, (queued, wait), body))
                    };
                    let Ok(answer) = tokio::time::timeout_at(deadline, answer).await else { break };
                    let at = start.elapsed();
                    let mut pause = Duration::ZERO;
                    per_replica[replica].0.fetch_add(1, Ordering::Relaxed);
                    let outcome = match answer {
                        Some((StatusCode::OK, (queued, _), body)) => {
                            let tokens = serde_json::from_slice::<UsageOnly>(&body).map_or(0, |u| u.usage.total_tokens);
                            per_replica[replica].1.fetch_add(tokens, Ordering::Relaxed);
                            mix[replica * n_tenants + tenant].fetch_add(tokens, Ordering::Relaxed);
                            live[tenant].fetch_add(tokens, Ordering::Relaxed);
                            Outcome::Ok { tokens, queued: queued.unwrap_or_default() }
                        }
                        Some((status, (_, wait), body)) => {
                            let r: Refusal = serde_json::from_slice(&body).unwrap_or_default();
                            pause = wait.unwrap_or(Duration::from_millis(50));
                            let error = r.error.unwrap_or_default();
                            let code = error.code.unwrap_or_else(|| "?".into());
                            // A plan's rate limit: `rate_limit_exceeded`, of `requests` or `tokens`.
                            let own_rate_limit = code == "rate_limit_exceeded";
                            // The limit the message names ("... for org.rpm (per org): ..."),
                            // else the code.
                            let what = error
                                .message
                                .as_deref()
                                .and_then(|m| m.split_once(" for ")?.1.split([' ', ':']).next())
                                .filter(|limit| !limit.is_empty())
                                .map_or(code, str::to_owned);
                            refused_live.fetch_add(1, Ordering::Relaxed);
                            Outcome::Refused { reason: format!("{} {what}", status.as_u16()), own_rate_limit }
                        }
                        None => {
                            pause = Duration::from_millis(50);
                            Outcome::Refused { reason: "transport error".into(), own_rate_limit: false }
                        }
                    };
                    events.lock().unwrap_or_else(PoisonError::into_inner).push(Event { tenant, at, outcome });
                    if !pause.is_zero() {
                        let until = (Instant::now() + pause.min(Duration::from_secs(1))).min(deadline);
                        tokio::time::sleep_until(until).await;
                    }
                    if Instant::now() >= deadline {
                        break;
                    }
                }
            }));
        }
    }

    // Live progress, once a second.
    let mut last: Vec<u64> = vec![0; tenants.len()];
    let mut tick = tokio::time::interval_at(start + Duration::from_secs(1), Duration::from_secs(1));
    while Instant::now() + Duration::from_millis(10) < deadline {
        tick.tick().await;
        if !options.progress {
            continue;
        }
        let mut line = format!("  {:>4.1}s ", start.elapsed().as_secs_f64());
        for (i, t) in tenants.iter().enumerate() {
            let now = live[i].load(Ordering::Relaxed);
            let _ = write!(line, " {} {:>6} tok/s", t.name, now - last[i]);
            last[i] = now;
        }
        let _ = write!(
            line,
            " | refused {} | upstream 429s {}",
            refused_live.load(Ordering::Relaxed),
            upstream_stats.refused()
        );
        println!("{line}");
    }
    for task in tasks {
        let _ = task.await;
    }
    let elapsed = start.elapsed().min(Duration::from_secs(seconds)).as_secs_f64();
    let events = std::mem::take(&mut *events.lock().unwrap_or_else(PoisonError::into_inner));

    // The table.
    let warmup = Duration::from_secs(seconds).div_f64(4.0).min(Duration::from_secs(1));
    let mut rows = Vec::new();
    for i in 0..tenants.len() {
        let mine = events.iter().filter(|e| e.tenant == i);
        let mut requests = 0u64;
        let mut tokens = 0u64;
        let mut measured = 0u64;
        let mut queued = Vec::new();
        let mut reasons: BTreeMap<String, u64> = BTreeMap::new();
        let mut capped = false;
        for e in mine {
            match &e.outcome {
                Outcome::Ok { tokens: n, queued: q } => {
                    requests += 1;
                    tokens += n;
                    if e.at >= warmup {
                        measured += n;
                    }
                    queued.push(*q);
                }
                Outcome::Refused { reason, own_rate_limit } => {
                    *reasons.entry(reason.clone()).or_default() += 1;
                    capped |= own_rate_limit;
                }
            }
        }
        queued.sort_unstable();
        rows.push(Row { requests, tokens, measured, queued, reasons, capped, share: 0.0, target: None });
    }
    let total_measured: u64 = rows.iter().map(|r| r.measured).sum::<u64>().max(1);
    for r in &mut rows {
        r.share = r.measured as f64 / total_measured as f64;
    }
    let capped_share: f64 = rows.iter().filter(|r| r.capped).map(|r| r.share).sum();
    let free_weight: u32 = tenants.iter().zip(&rows).filter(|(_, r)| !r.capped).map(|(t, _)| t.weight).sum();
    for (t, r) in tenants.iter().zip(&mut rows) {
        if !r.capped && free_weight > 0 {
            r.target = Some((1.0 - capped_share) * f64::from(t.weight) / f64::from(free_weight));
        }
    }

    println!();
    println!(
        "{:<10} {:>6} {:<9} {:>8} {:>9} {:>7} {:>7} {:>11} {:>10} {:>10}  rejected (status limit)",
        "tenant", "weight", "plan", "requests", "tokens", "tok/s", "share", "target", "p50 queue", "p99 queue"
    );
    let mut off_share = Vec::new();
    for (t, r) in tenants.iter().zip(&rows) {
        let target = match r.target {
            Some(target) => {
                if (r.share - target).abs() > config.demo.tolerance {
                    off_share.push(t.name.clone());
                }
                format!("{:.1}%", target * 100.0)
            }
            None => "own limit".to_owned(),
        };
        let rejected = if r.reasons.is_empty() {
            "-".to_owned()
        } else {
            r.reasons.iter().map(|(why, n)| format!("{n} × {why}")).collect::<Vec<_>>().join(", ")
        };
        println!(
            "{:<10} {:>6} {:<9} {:>8} {:>9} {:>7.0} {:>6.1}% {:>11} {:>10} {:>10}  {rejected}",
            t.name,
            t.weight,
            t.plan,
            r.requests,
            r.tokens,
            r.tokens as f64 / elapsed,
            r.share * 100.0,
            target,
            millis(percentile(&r.queued, 0.50)),
            millis(percentile(&r.queued, 0.99)),
        );
    }
    // The same numbers as `/metrics` serves (every replica of this process).
    let page = crate::metrics::handle().render();
    let sum = |name: &str, labels: &[&str]| crate::metrics::sum(&page, name, labels);
    let waits = sum("rate_limiting_request_time_in_queue_count", &[r#"layer="upstream""#, r#"result="admitted""#]);
    let waited = sum("rate_limiting_request_time_in_queue_sum", &[r#"layer="upstream""#, r#"result="admitted""#]);
    println!(
        "/metrics: plans admitted {:.0} and refused {:.0}; the fair queue admitted {:.0} ({waits:.0} after a mean wait of {:.0} ms) and refused {:.0}",
        sum("rate_limiting_requests", &[r#"layer="plan""#, r#"result="admitted""#]),
        sum("rate_limiting_requests", &[r#"layer="plan""#, r#"result="refused""#]),
        sum("rate_limiting_requests", &[r#"layer="upstream""#, r#"result="admitted""#]),
        waited * 1000.0 / waits.max(1.0),
        sum("rate_limiting_requests", &[r#"layer="upstream""#, r#"result="refused""#]),
    );
    let served = upstream_stats.served.load(Ordering::Relaxed);
    let upstream_tokens = upstream_stats.tokens.load(Ordering::Relaxed);
    let upstream_429 = upstream_stats.refused();
    let quota: u64 =
        config.accounts.iter().map(|a| a.tokens_per_window() as f64 / a.window.as_secs_f64()).sum::<f64>() as u64;
    // What the mirrors let through in the long run: (L - b) / (W + J) per account (one
    // mirror per account, shared by the replicas through Redis), plus the bursts once.
    let mirror_rate: f64 = config
        .accounts
        .iter()
        .filter_map(|a| {
            let policy = a.mirror_policy(&config.mirror, config.gateway.max_request_tokens, 1).ok()?;
            let rate = policy.limits.iter().find(|l| l.name == "upstream.tpm")?.rate?;
            Some(rate.amount() as f64 / rate.period().as_secs_f64())
        })
        .sum();
    let mirror_burst: u64 = config
        .accounts
        .iter()
        .filter_map(|a| {
            let policy = a.mirror_policy(&config.mirror, config.gateway.max_request_tokens, 1).ok()?;
            policy.limits.iter().find(|l| l.name == "upstream.tpm")?.burst
        })
        .sum();
    let allowed = mirror_rate * elapsed + mirror_burst as f64;
    let utilization = upstream_tokens as f64 / allowed.max(1.0);
    println!();
    println!(
        "upstream: {served} requests, {upstream_tokens} tokens, {:.0} tok/s (accounts' quota {quota}, mirrors' pace {mirror_rate:.0}); 429 answers: {upstream_429}",
        upstream_tokens as f64 / elapsed
    );
    println!("utilization: {:.1}% of the {allowed:.0} tokens the mirrors allowed over the run", utilization * 100.0);
    let stores: Vec<_> = built.iter().filter_map(Gateway::accounts).collect();
    if !stores.is_empty() {
        let (mut acquire, mut batches, mut ops) = (0, 0, 0);
        for s in &stores {
            let st = s.stats();
            (acquire, batches, ops) = (acquire + st.acquire_calls, batches + st.batch_calls, ops + st.batched_ops);
        }
        println!(
            "accounts in Redis: {acquire} acquisition calls and {batches} background calls carrying {ops} settles and reports, for {served} upstream calls ({:.2} and {:.2} per call)",
            acquire as f64 / served.max(1) as f64,
            batches as f64 / served.max(1) as f64
        );
    }
    if replicas > 1 {
        let all: u64 = per_replica.iter().map(|r| r.1.load(Ordering::Relaxed)).sum::<u64>().max(1);
        for (i, (answers, tokens)) in per_replica.iter().enumerate() {
            let (answers, tokens) = (answers.load(Ordering::Relaxed), tokens.load(Ordering::Relaxed));
            let by_tenant: Vec<String> = tenants
                .iter()
                .enumerate()
                .map(|(t, info)| format!("{} {}", info.name, mix[i * n_tenants + t].load(Ordering::Relaxed)))
                .collect();
            println!(
                "replica {i}: {answers} answers, {tokens} tokens served ({:.1}% of the fleet's: {})",
                tokens as f64 * 100.0 / all as f64,
                by_tenant.join(", ")
            );
        }
    }
    println!(
        "shares are of the tokens admitted after a {:.2}s warm-up; tolerance ±{:.1} points",
        warmup.as_secs_f64(),
        config.demo.tolerance * 100.0
    );

    // The chart.
    // Each point is what was admitted in the second before it: the quantity a provider
    // enforcing its quota over one-second windows checks.
    let steps = (Duration::from_secs(seconds).as_nanos() / STEP.as_nanos()) as usize;
    let trailing = |tenant: usize, at: Duration| -> f64 {
        let from = at.saturating_sub(Duration::from_secs(1));
        let tokens: u64 = events
            .iter()
            .filter(|e| e.tenant == tenant && e.at > from && e.at <= at)
            .map(|e| if let Outcome::Ok { tokens, .. } = e.outcome { tokens } else { 0 })
            .sum();
        tokens as f64
    };
    let mut series: Vec<Series> = tenants
        .iter()
        .enumerate()
        .map(|(i, t)| Series {
            name: format!("{} (w{})", t.name, t.weight),
            values: (0..=steps).map(|k| trailing(i, STEP * k as u32)).collect(),
        })
        .collect();
    let total: Vec<f64> = (0..=steps).map(|k| series.iter().map(|s| s.values[k]).sum()).collect();
    series.push(Series { name: "all tenants".into(), values: total });
    let references = [
        Reference { label: format!("accounts' quota {quota} tok/s"), value: quota as f64 },
        Reference { label: format!("mirrors' sustained rate {mirror_rate:.0} tok/s"), value: mirror_rate },
    ];
    let svg = line_chart(
        "Tokens admitted in the trailing second, by tenant",
        "tokens / s",
        STEP.as_secs_f64(),
        &series,
        &references,
    );
    if let Some(dir) = options.svg.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(&options.svg, svg)?;
    println!("chart: {}", options.svg.display());

    // The fleet's target: the replicas together use what the shared mirrors allow.
    let underused = replicas > 1 && utilization < 0.9;
    let report = DemoReport { upstream_429, off_share, underused, advisory_shares: options.advisory_shares };
    if report.passed() {
        if report.off_share.is_empty() {
            println!("PASS: zero upstream 429s, every share within tolerance");
        } else {
            println!("PASS: zero upstream 429s (shares beyond tolerance, advisory: {})", report.off_share.join(", "));
        }
    } else {
        if upstream_429 > 0 {
            println!("FAIL: the upstream answered 429 {upstream_429} times");
        }
        if !report.off_share.is_empty() {
            println!("FAIL: shares beyond tolerance: {}", report.off_share.join(", "));
        }
        if report.underused {
            println!("FAIL: the fleet used {:.1}% of what the mirrors allowed (target 90%)", utilization * 100.0);
        }
    }
    Ok(report)
}

struct Row {
    requests: u64,
    tokens: u64,
    measured: u64,
    queued: Vec<Duration>,
    reasons: BTreeMap<String, u64>,
    capped: bool,
    share: f64,
    target: Option<f64>,
}

fn percentile(sorted: &[Duration], p: f64) -> Option<Duration> {
    if sorted.is_empty() {
        return None;
    }
    let rank = ((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len());
    Some(sorted[rank - 1])
}

fn millis(d: Option<Duration>) -> String {
    d.map_or_else(|| "-".to_owned(), |d| format!("{:.1}ms", d.as_secs_f64() * 1000.0))
}

/// A deterministic request body: `batch` inputs of `words` words.
fn request_body(seed: u64, batch: usize, words: usize) -> String {
    const WORDS: [&str; 32] = [
        "rate",
        "limit",
        "tenant",
        "token",
        "embedding",
        "vector",
        "queue",
        "fair",
        "share",
        "weight",
        "upstream",
        "account",
        "burst",
        "window",
        "gateway",
        "request",
        "answer",
        "model",
        "search",
        "index",
        "document",
        "query",
        "cluster",
        "shard",
        "latency",
        "budget",
        "policy",
        "tier",
        "agent",
        "team",
        "user",
        "org",
    ];
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let inputs: Vec<String> = (0..batch)
        .map(|_| (0..words).map(|_| WORDS[(next() % WORDS.len() as u64) as usize]).collect::<Vec<_>>().join(" "))
        .collect();
    serde_json::json!({ "model": "mock-embedding-small", "input": inputs }).to_string()
}
