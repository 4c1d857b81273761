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

pub mod budget;
mod quota;
mod redis_tap;
mod redis_work;
mod report;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
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
use crate::upstream::{self, UpstreamStats};

use report::*;

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
    /// Halve the upstream's real quota at a third of the run and double it at two thirds
    /// (in memory: the gateway learns the accounts' limits there).
    pub quota_changes: bool,
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
    /// A fleet of replicas used less than 95% of what the accounts' mirrors allowed.
    pub underused: bool,
    /// Shares beyond tolerance do not fail the demo.
    pub advisory_shares: bool,
    /// The upstream's quota changed under the gateway: its `429`s are reported, not
    /// judged (the calls in flight at a drop meet them).
    pub quota_changed: bool,
    /// With quota changes: whether every change and phase kept its targets.
    pub quota_changes_passed: bool,
}

impl DemoReport {
    /// Whether the demo passed.
    #[must_use]
    pub fn passed(&self) -> bool {
        (self.upstream_429 == 0 || self.quota_changed)
            && (self.off_share.is_empty() || self.advisory_shares)
            && !self.underused
            && self.quota_changes_passed
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
    /// Its band in the fair queue (0: the first).
    band: usize,
    /// Its band's minimum share (a fraction of the whole; 0 for none).
    band_share: f64,
}

/// The gateway replicas the demo started, each serving on a loopback port of its own.
struct Fleet {
    /// Where each replica listens, in the order they were built.
    addrs: Vec<SocketAddr>,
    /// The replicas, for their shared accounts' counters.
    gateways: Vec<Gateway>,
    /// With Redis: the prefix of this run's keys, and the tap the replicas reach Redis
    /// through (none for a URL it cannot tap).
    namespace: String,
    tap: Option<redis_tap::Tap>,
}

/// What the client tasks count as they go: read by the progress lines while the load
/// runs, and by the table, the summaries and the chart once it is over.
struct LoadCounters {
    /// Every finished request.
    events: Mutex<Vec<Event>>,
    /// Per tenant: the tokens served so far.
    live: Vec<AtomicU64>,
    /// Refusals so far, of every tenant.
    refused: AtomicU64,
    /// Per replica: answers, and tokens served.
    per_replica: Vec<(AtomicU64, AtomicU64)>,
    /// Per replica and tenant (`replica * tenants + tenant`): tokens served.
    mix: Vec<AtomicU64>,
    /// How many tenants `mix` has per replica.
    tenants: usize,
}

impl LoadCounters {
    fn new(tenants: usize, replicas: usize) -> Self {
        LoadCounters {
            events: Mutex::default(),
            live: (0..tenants).map(|_| AtomicU64::new(0)).collect(),
            refused: AtomicU64::new(0),
            per_replica: (0..replicas).map(|_| (AtomicU64::new(0), AtomicU64::new(0))).collect(),
            mix: (0..replicas * tenants).map(|_| AtomicU64::new(0)).collect(),
            tenants,
        }
    }
}

/// One client task: it sends its client's requests to one replica, one at a time.
struct ClientTask {
    client: Client<HttpConnector, Full<Bytes>>,
    url: http::Uri,
    replica: usize,
    /// The API key it sends.
    key: String,
    batch: usize,
    words: usize,
    /// The tenant the key belongs to (an index into the demo's tenants).
    tenant: usize,
    /// Where the task's sequence of request bodies starts.
    seed: u64,
}

/// An answer as a client task reads it.
struct ClientAnswer {
    status: StatusCode,
    /// The gateway's queueing time ([`QUEUE_TIME_HEADER`]).
    queued: Option<Duration>,
    /// The wait a refusal suggests.
    wait: Option<Duration>,
    body: Bytes,
}

/// The least share of what the mirrors allow over the run that a fleet of replicas must
/// use (a fleet leasing the accounts leaves a part unused while its parts move).
const LEAST_FLEET_USE: f64 = 0.95;

/// What the upstream served over the run, against what the accounts and their mirrors
/// allow.
struct UpstreamSummary {
    /// Requests the upstream served.
    served: u64,
    /// `429` answers the upstream gave.
    refused: u64,
    /// The accounts' quota, in tokens per second.
    quota: u64,
    /// The pace the mirrors sustain, in tokens per second.
    mirror_rate: f64,
    /// The tokens served, as a share of what the mirrors allowed over the run.
    utilization: f64,
}

/// Runs the demo on `config` and prints its progress, table and verdict.
///
/// The steps, in order: start the mock upstream and the gateway replicas, print who
/// drives what, drive the load while printing its progress, then print the table and the
/// summaries, write the chart and print the verdict.
///
/// # Errors
/// A loopback port cannot be bound, or the gateway cannot be built.
pub async fn run(mut config: Config, options: &DemoOptions) -> Result<DemoReport, tower::BoxError> {
    let seconds = options.seconds.unwrap_or(config.demo.seconds);
    if config.demo.clients.is_empty() {
        return Err("the configuration has no [[demo.client]]".into());
    }
    let (upstream_addr, upstream_stats) = start_upstream(&mut config).await?;
    let fleet = start_gateways(&config, options.redis.as_ref()).await?;
    let (tenants, client_tenant) = demo_tenants(&config)?;
    let gateway_addr = describe_fleet(&fleet, options.redis.as_ref());
    print_setup(&config, upstream_addr, &gateway_addr, &tenants, &client_tenant, seconds);

    let redis_work = match &options.redis {
        Some(r) => Some(redis_work::RedisWork::start(&r.url).await?),
        None => None,
    };
    let load = Load::new(&fleet, tenants.len(), seconds)?;
    let uneven = options.redis.as_ref().is_some_and(|r| r.uneven);
    let tasks = load.spawn_clients(&config, &client_tenant, uneven);
    let changes = options.quota_changes.then(|| {
        let (stats, config) = (upstream_stats.clone(), config.clone());
        tokio::spawn(async move { quota::run(stats, &config, seconds).await })
    });
    load.print_progress(options.progress, &tenants, &upstream_stats).await;
    for task in tasks {
        let _ = task.await;
    }
    let elapsed = load.start.elapsed().min(Duration::from_secs(seconds)).as_secs_f64();
    let counters = &load.counters;
    let events = std::mem::take(&mut *counters.events.lock().unwrap_or_else(PoisonError::into_inner));

    let warmup = Duration::from_secs(seconds).div_f64(4.0).min(Duration::from_secs(1));
    let rows = tally(&events, &tenants, warmup);
    let off_share = off_share(&tenants, &rows, config.demo.tolerance);
    print_table(&tenants, &rows, elapsed);
    print_layer_metrics();
    let upstream = summarize_upstream(&config, &upstream_stats, &events, elapsed);
    print_account_store(&fleet.gateways, upstream.served);
    print_plan_store(&fleet.gateways);
    if let Some(work) = redis_work {
        let answers = counters.per_replica.iter().map(|r| r.0.load(Ordering::Relaxed)).sum();
        let replay = fleet.tap.as_ref().map(|t| (t.recorded.clone(), fleet.namespace.as_str()));
        work.print(answers, replay).await?;
    }
    if fleet.addrs.len() > 1 {
        print_replicas(counters, &tenants);
    }
    println!(
        "shares are of the tokens admitted after a {:.2}s warm-up; tolerance ±{:.1} points",
        warmup.as_secs_f64(),
        config.demo.tolerance * 100.0
    );
    write_chart(&events, &tenants, seconds, &upstream, &options.svg)?;

    let phases = match changes {
        Some(task) => Some(task.await?),
        None => None,
    };
    if let Some(p) = &phases {
        p.print();
    }
    // The fleet's target: the replicas together use what the shared mirrors allow.
    let underused = fleet.addrs.len() > 1 && upstream.utilization < LEAST_FLEET_USE;
    let report = DemoReport {
        upstream_429: upstream.refused,
        off_share,
        underused,
        advisory_shares: options.advisory_shares,
        quota_changed: phases.is_some(),
        quota_changes_passed: phases.as_ref().is_none_or(quota::Phases::passed),
    };
    print_verdict(&report, upstream.utilization);
    Ok(report)
}

/// Starts the mock upstream on a port of the system's choosing and points every account
/// of `config` at it.
async fn start_upstream(config: &mut Config) -> Result<(SocketAddr, Arc<UpstreamStats>), tower::BoxError> {
    let upstream_listener = TcpListener::bind(("127.0.0.1", 0)).await?;
    let upstream_addr = upstream_listener.local_addr()?;
    for account in &mut config.accounts {
        account.base_url = format!("http://{upstream_addr}");
    }
    let (upstream_router, upstream_stats) =
        upstream::router(&config.accounts, config.upstream, &config.gateway.encodings);
    tokio::spawn(async move { axum::serve(upstream_listener, upstream_router).await });
    Ok((upstream_addr, upstream_stats))
}

/// Starts the gateway: one replica in memory, or `redis.replicas` replicas sharing their
/// limits in Redis under a namespace of this run's own.
async fn start_gateways(config: &Config, redis: Option<&RedisOptions>) -> Result<Fleet, tower::BoxError> {
    let namespace = format!(
        "egw-demo-{}-{}",
        std::process::id(),
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis())
    );
    let tap = match redis {
        Some(r) => redis_tap::Tap::start(&r.url).await?,
        None => None,
    };
    let mut fleet = Fleet { addrs: Vec::new(), gateways: Vec::new(), namespace: namespace.clone(), tap };
    let replicas = redis.map_or(1, |r| r.replicas.max(1));
    for _ in 0..replicas {
        let sharing = match redis {
            None => Sharing::InMemory,
            Some(r) => {
                let url = fleet.tap.as_ref().map_or(r.url.as_str(), |t| t.url.as_str());
                Sharing::Redis {
                    connection: RedisConnection::connect(url).await.map_err(|e| format!("redis at {}: {e}", r.url))?,
                    replicas,
                    namespace: namespace.clone(),
                }
            }
        };
        let gateway = Gateway::with_sharing(config, http_transport(), &sharing)?;
        let listener = TcpListener::bind(("127.0.0.1", 0)).await?;
        let addr = listener.local_addr()?;
        let router = gateway.router.clone();
        tokio::spawn(async move { axum::serve(listener, router).await });
        fleet.addrs.push(addr);
        fleet.gateways.push(gateway);
    }
    Ok(fleet)
}

/// Where the gateway listens, as the first line of the demo names it.
fn describe_fleet(fleet: &Fleet, redis: Option<&RedisOptions>) -> String {
    match redis {
        None => fleet.addrs[0].to_string(),
        Some(r) => format!(
            "{} ({} replicas sharing the tenants' limits and the accounts' mirrors through Redis at {}{})",
            fleet.addrs.iter().map(ToString::to_string).collect::<Vec<_>>().join(", "),
            fleet.addrs.len(),
            r.url,
            if r.uneven { ", routed unevenly" } else { "" }
        ),
    }
}

/// The tenants the demo's clients drive, in the order their first client appears, and
/// for each client the index of its tenant among them.
fn demo_tenants(config: &Config) -> Result<(Vec<TenantInfo>, Vec<usize>), tower::BoxError> {
    let mut tenants: Vec<TenantInfo> = Vec::new();
    let mut client_tenant = Vec::new();
    for c in &config.demo.clients {
        let digest = crate::config::KeyDigest::of(&c.key);
        let t = config.tenants.iter().find(|t| t.keys.iter().any(|k| k.digest == digest)).ok_or("unknown demo key")?;
        let index = match tenants.iter().position(|x| x.name == t.name) {
            Some(i) => i,
            None => {
                let min = config.gateway.bands.get(t.band).map_or(0, |b| b.min_share_percent);
                tenants.push(TenantInfo {
                    name: t.name.clone(),
                    weight: t.weight,
                    plan: config.plans[t.plan].name.clone(),
                    band: t.band,
                    band_share: f64::from(min) / 100.0,
                });
                tenants.len() - 1
            }
        };
        client_tenant.push(index);
    }
    Ok((tenants, client_tenant))
}

/// Prints the demo's first lines: where the upstream and the gateway listen, the
/// accounts' limits, and what each client sends.
fn print_setup(
    config: &Config,
    upstream_addr: SocketAddr,
    gateway_addr: &str,
    tenants: &[TenantInfo],
    client_tenant: &[usize],
    seconds: u64,
) {
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
        let band = match config.gateway.bands.get(t.band) {
            Some(b) if b.min_share_percent > 0 => format!(", band {} (keeps {}%)", b.name, b.min_share_percent),
            Some(b) => format!(", band {}", b.name),
            None => String::new(),
        };
        println!(
            "  tenant  {:<10} weight {}, plan {:<9} {} in flight, {} inputs of {} words per request{band}",
            t.name, t.weight, t.plan, c.concurrency, c.batch, c.words
        );
    }
}

/// The load the client tasks drive: where they send it, from when until when, and what
/// they count.
struct Load {
    client: Client<HttpConnector, Full<Bytes>>,
    /// Each replica's `POST /v1/embeddings`.
    urls: Vec<http::Uri>,
    start: Instant,
    deadline: Instant,
    counters: Arc<LoadCounters>,
}

impl Load {
    /// A load on `fleet` for `tenants` tenants, starting now and lasting `seconds`.
    fn new(fleet: &Fleet, tenants: usize, seconds: u64) -> Result<Self, tower::BoxError> {
        let client: Client<HttpConnector, Full<Bytes>> =
            Client::builder(TokioExecutor::new()).pool_max_idle_per_host(1024).build_http();
        let urls: Vec<http::Uri> =
            fleet.addrs.iter().map(|a| format!("http://{a}/v1/embeddings").parse()).collect::<Result<_, _>>()?;
        let start = Instant::now();
        let deadline = start + Duration::from_secs(seconds);
        let counters = Arc::new(LoadCounters::new(tenants, urls.len()));
        Ok(Load { client, urls, start, deadline, counters })
    }

    /// Spawns `concurrency` tasks per client of `config`, each on the replica [`route`]
    /// gives it (`uneven`: as `--uneven` routes), all sending until the deadline.
    fn spawn_clients(
        &self,
        config: &Config,
        client_tenant: &[usize],
        uneven: bool,
    ) -> Vec<tokio::task::JoinHandle<()>> {
        let mut tasks = Vec::new();
        for (ci, c) in config.demo.clients.iter().enumerate() {
            for task in 0..c.concurrency {
                // Each client's tasks spread over the replicas (or not: --uneven).
                let replica = route(ci, task, self.urls.len(), uneven);
                let spec = ClientTask {
                    client: self.client.clone(),
                    url: self.urls[replica].clone(),
                    replica,
                    key: c.key.clone(),
                    batch: c.batch,
                    words: c.words,
                    tenant: client_tenant[ci],
                    seed: (ci as u64) << 40 | (task as u64) << 20,
                };
                tasks.push(tokio::spawn(spec.drive(self.start, self.deadline, self.counters.clone())));
            }
        }
        tasks
    }

    /// Waits until the deadline, printing once a second (when `progress`) each tenant's
    /// tokens served in the last second, the refusals and the upstream's `429`s so far.
    async fn print_progress(&self, progress: bool, tenants: &[TenantInfo], upstream_stats: &UpstreamStats) {
        let mut last: Vec<u64> = vec![0; tenants.len()];
        let mut tick = tokio::time::interval_at(self.start + Duration::from_secs(1), Duration::from_secs(1));
        while Instant::now() + Duration::from_millis(10) < self.deadline {
            tick.tick().await;
            if !progress {
                continue;
            }
            let mut line = format!("  {:>4.1}s ", self.start.elapsed().as_secs_f64());
            for (i, t) in tenants.iter().enumerate() {
                let now = self.counters.live[i].load(Ordering::Relaxed);
                let _ = write!(line, " {} {:>6} tok/s", t.name, now - last[i]);
                last[i] = now;
            }
            let _ = write!(
                line,
                " | refused {} | upstream 429s {}",
                self.counters.refused.load(Ordering::Relaxed),
                upstream_stats.refused()
            );
            println!("{line}");
        }
    }
}

impl ClientTask {
    /// Sends one request after another until `deadline` (or [`MAX_REQUESTS_PER_TASK`]),
    /// recording each answer in `counters` and waiting what a refusal suggests before
    /// the next. A request still in flight at `deadline` is dropped and not recorded.
    async fn drive(self, start: Instant, deadline: Instant, counters: Arc<LoadCounters>) {
        let mut seed = self.seed;
        for _ in 0..MAX_REQUESTS_PER_TASK {
            seed += 1;
            let body = request_body(seed, self.batch, self.words);
            let req = Request::post(self.url.clone())
                .header(header::AUTHORIZATION, format!("Bearer {}", self.key))
                .header(header::CONTENT_TYPE, "application/json")
                .body(Full::new(Bytes::from(body)));
            let Ok(req) = req else { break };
            let Ok(answer) = tokio::time::timeout_at(deadline, send(&self.client, req)).await else { break };
            let at = start.elapsed();
            counters.per_replica[self.replica].0.fetch_add(1, Ordering::Relaxed);
            let (outcome, pause) = self.record(answer, &counters);
            counters.events.lock().unwrap_or_else(PoisonError::into_inner).push(Event {
                tenant: self.tenant,
                at,
                outcome,
            });
            if !pause.is_zero() {
                let until = (Instant::now() + pause.min(Duration::from_secs(1))).min(deadline);
                tokio::time::sleep_until(until).await;
            }
            if Instant::now() >= deadline {
                break;
            }
        }
    }

    /// The outcome of `answer` (`None`: the transport failed) and the pause before the
    /// next request; counts the tokens served, or the refusal, in `counters`.
    fn record(&self, answer: Option<ClientAnswer>, counters: &LoadCounters) -> (Outcome, Duration) {
        match answer {
            Some(a) if a.status == StatusCode::OK => {
                let tokens = serde_json::from_slice::<UsageOnly>(&a.body).map_or(0, |u| u.usage.total_tokens);
                counters.per_replica[self.replica].1.fetch_add(tokens, Ordering::Relaxed);
                counters.mix[self.replica * counters.tenants + self.tenant].fetch_add(tokens, Ordering::Relaxed);
                counters.live[self.tenant].fetch_add(tokens, Ordering::Relaxed);
                (Outcome::Ok { tokens, queued: a.queued.unwrap_or_default() }, Duration::ZERO)
            }
            Some(a) => {
                let pause = a.wait.unwrap_or(Duration::from_millis(50));
                let outcome = refusal(a.status, &a.body);
                counters.refused.fetch_add(1, Ordering::Relaxed);
                (outcome, pause)
            }
            None => (
                Outcome::Refused { reason: "transport error".into(), own_rate_limit: false },
                Duration::from_millis(50),
            ),
        }
    }
}

/// Sends `req` and reads the whole answer; `None` when the transport fails.
async fn send(client: &Client<HttpConnector, Full<Bytes>>, req: Request<Full<Bytes>>) -> Option<ClientAnswer> {
    let response = client.request(req).await.ok()?;
    let status = response.status();
    let queued = response
        .headers()
        .get(QUEUE_TIME_HEADER)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok())
        .map(Duration::from_micros);
    // As OpenAI's SDKs: `retry-after-ms`, else `Retry-After` in seconds.
    let header = |name: &str| response.headers().get(name).and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    let wait =
        header("retry-after-ms").map(Duration::from_millis).or_else(|| header("retry-after").map(Duration::from_secs));
    let body = response.into_body().collect().await.ok()?.to_bytes();
    Some(ClientAnswer { status, queued, wait, body })
}

/// A refusal as the table reports it: the status and the limit its message names (else
/// its code), and whether it is the tenant's own plan's rate limit.
fn refusal(status: StatusCode, body: &[u8]) -> Outcome {
    let r: Refusal = serde_json::from_slice(body).unwrap_or_default();
    let error = r.error.unwrap_or_default();
    let code = error.code.unwrap_or_else(|| "?".into());
    // A plan's rate limit: `rate_limit_exceeded`, of `requests` or `tokens`.
    let own_rate_limit = code == "rate_limit_exceeded";
    // The limit the message names ("... for org.rpm (per org): ..."), else the code.
    let what = error
        .message
        .as_deref()
        .and_then(|m| m.split_once(" for ")?.1.split([' ', ':']).next())
        .filter(|limit| !limit.is_empty())
        .map_or(code, str::to_owned);
    Outcome::Refused { reason: format!("{} {what}", status.as_u16()), own_rate_limit }
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
