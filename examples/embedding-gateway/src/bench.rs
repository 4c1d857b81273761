//! `embedding-gateway bench`: what the gateway costs against a plain proxy hop, in CPU
//! per request and in added latency, measured in one run.
//!
//! The bench spawns, as child processes of the same binary, the mock upstream (no
//! latency), the gateway (`serve`, access lines off) and the baseline proxy
//! ([`crate::hop`]), all pointed at the mock, and nginx as a proxy too when `nginx` is on
//! `PATH`. Its own load generator then drives each target in turn over `connections`
//! keep-alive HTTP/1.1 connections, each sending `POST /v1/embeddings` with a short
//! input back to back:
//!
//! - `direct`: the mock upstream itself, the floor of every latency;
//! - `hop`: the minimal Rust reverse proxy;
//! - `nginx`: nginx as a reverse proxy with upstream keep-alive (if present);
//! - `gateway`: the gateway, every layer on (auth, costing, the plan's limits, the fair
//!   queue and the accounts' mirrors).
//!
//! Rounds are interleaved (round 1: every target, then round 2: ...), each target warmed
//! up for a moment before its measurement. Per target and round it measures requests a
//! second, the median and 99th percentile of latency, and the CPU per request of the
//! target's own process (`utime + stime` from `/proc/<pid>/stat`); the mock upstream's CPU
//! per request is reported beside it (it is the same work behind every proxy). The table
//! gives min / median / max over the rounds; the ratios are of the medians. Any answer
//! other than `200` is reported and fails the run (exit status 1).
//!
//! The configuration is [`BENCH_CONFIG`], or the file given with `--config`; either way
//! the bench rewrites it so that nothing is ever refused: accounts pointed at the mock
//! with very large quotas, plans' rates and concurrency raised, queues widened, the
//! mock's latency zero. Its load sends the first plain-text key of every tenant, in turn
//! per connection.
//!
//! # Reading the figures
//!
//! The load is closed-loop (each connection waits for its answer), so on a small machine
//! the latencies are mostly queueing behind the slowest process: the added p50 tracks the
//! throughput, not the cost of one request alone (`--connections 1` measures that). CPU
//! per request is the steadier figure, but it too rises as a process idles more between
//! requests (more wake-ups per request): compare the mock's own column across targets.
//!
//! # Profiling one target
//!
//! `--only TARGET` (not in the usage) drives one target and prints the pids, so that a
//! profiler can attach to it for the length of the run:
//!
//! ```text
//! embedding-gateway bench --only gateway --rounds 1 --seconds 20 &
//! perf record -g -p <gateway pid> -- sleep 10
//! ```

// Printing the progress and the report is the bench's job.
#![allow(clippy::print_stdout)]

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::{BufRead, BufReader};
use std::net::{SocketAddr, TcpListener as StdListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, StatusCode, header};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio::time::Instant;
use tower::BoxError;

use crate::config::Config;

/// The bench's own configuration (the accounts' `base_url` is replaced by the mock's
/// address): two tenants on a plan with per-tier rates and a concurrency limit, all far
/// above what one machine can send, and two accounts.
pub const BENCH_CONFIG: &str = r#"
tiers = ["org", "user"]

[gateway]
max_request_tokens = 512
tenant_queue = 65536
queue = 65536
uploads_per_tenant = 65536
max_connections = 4096
embedding_models = ["mock-embedding-small"]
encodings = { "mock-embedding-small" = "cl100k_base" }

[upstream]
dimensions = 16
latency = "0s"

[plan.bench]
org = { rpm = 60000000, tpm = 300000000, concurrency = 65536 }
user = { rpm = 60000000, tpm = 300000000 }

[[tenant]]
name = "acme"
plan = "bench"
weight = 3

[[tenant.key]]
key = "sk-bench-acme"
user = "indexer"

[[tenant]]
name = "globex"
plan = "bench"
weight = 1

[[tenant.key]]
key = "sk-bench-globex"
user = "alice"

[[account]]
name = "primary"
base_url = "http://127.0.0.1:9"
api_key = "up-key-primary"
rpm = 60000000
tpm = 300000000
window = "1s"

[[account]]
name = "secondary"
base_url = "http://127.0.0.1:9"
api_key = "up-key-secondary"
rpm = 60000000
tpm = 300000000
window = "1s"
"#;

/// The requests a minute every account and plan tier gets in the bench: a million a
/// second, beyond any one machine.
const BENCH_RPM: i64 = 60_000_000;
/// The tokens a minute every account and plan tier gets in the bench.
const BENCH_TPM: i64 = 300_000_000;
/// Concurrency, queues, uploads and connections in the bench: never the bound.
const BENCH_WIDE: i64 = 65_536;

/// The embedding each request asks for: a 25-character input.
const INPUT: &str = "The quick brown fox jumps";

/// How long each target is driven before each measurement.
const WARM_UP: Duration = Duration::from_millis(500);

/// How long a child may take to start listening.
const START_TIMEOUT: Duration = Duration::from_secs(10);

/// The targets, in the order of every round.
pub const TARGETS: [&str; 4] = ["direct", "hop", "nginx", "gateway"];

/// What `bench` was asked for.
#[derive(Debug, Clone)]
pub struct BenchOptions {
    /// A configuration to rewrite instead of [`BENCH_CONFIG`].
    pub config: Option<PathBuf>,
    /// Length of each measurement, per target and round.
    pub seconds: u64,
    /// Rounds over every target.
    pub rounds: u32,
    /// Keep-alive connections of the load, each sending requests back to back.
    pub connections: usize,
    /// Drive only this target (for profiling it), no ratios.
    pub only: Option<String>,
}

impl Default for BenchOptions {
    fn default() -> Self {
        BenchOptions { config: None, seconds: 3, rounds: 5, connections: 16, only: None }
    }
}

/// The configuration the bench runs: its text, and what its load sends.
#[derive(Debug, Clone)]
pub struct BenchConfig {
    /// The rewritten configuration (TOML).
    pub text: String,
    /// A plain-text API key of each tenant, for the gateway.
    pub tenant_keys: Vec<String>,
    /// Every account's upstream key, for the mock and the plain proxies.
    pub account_keys: Vec<String>,
    /// The embedding model asked for.
    pub model: String,
}

fn table_mut<'a>(doc: &'a mut toml::Table, key: &str) -> Result<&'a mut toml::Table, String> {
    doc.entry(key.to_owned())
        .or_insert_with(|| toml::Value::Table(toml::Table::new()))
        .as_table_mut()
        .ok_or_else(|| format!("`{key}` is not a table"))
}

fn array_of_tables<'a>(doc: &'a mut toml::Table, key: &str) -> Result<Vec<&'a mut toml::Table>, String> {
    match doc.get_mut(key) {
        None => Ok(Vec::new()),
        Some(toml::Value::Array(items)) => items
            .iter_mut()
            .map(|v| v.as_table_mut().ok_or_else(|| format!("`[[{key}]]` holds something else than tables")))
            .collect(),
        Some(_) => Err(format!("`{key}` is not an array of tables")),
    }
}

/// Rewrites the configuration `source` for the bench: every account's `base_url` becomes
/// `upstream` and its quotas 60M rpm and 300M tpm; every plan tier's rates
/// become those (their bursts the default), its concurrency 65,536; the queues,
/// uploads and connections are widened and the mock answers at once.
///
/// # Errors
/// `source` is not TOML, has no account or no tenant key in plain text, or the result
/// does not validate.
pub fn rewrite(source: &str, upstream: &str) -> Result<BenchConfig, String> {
    let mut doc: toml::Table = source.parse().map_err(|e| format!("the bench's configuration: {e}"))?;
    let gateway = table_mut(&mut doc, "gateway")?;
    for key in ["tenant_queue", "queue", "uploads_per_tenant", "max_connections"] {
        gateway.insert(key.to_owned(), toml::Value::Integer(BENCH_WIDE));
    }
    let model = match gateway.get("embedding_models") {
        Some(toml::Value::Array(models)) => models.first().and_then(toml::Value::as_str).map(str::to_owned),
        _ => None,
    }
    .unwrap_or_else(|| "mock-embedding-small".to_owned());
    table_mut(&mut doc, "upstream")?.insert("latency".to_owned(), toml::Value::String("0s".to_owned()));
    for (name, plan) in table_mut(&mut doc, "plan")?.iter_mut() {
        let plan = plan.as_table_mut().ok_or_else(|| format!("plan {name:?} is not a table"))?;
        for (tier, limits) in plan.iter_mut() {
            let limits = limits.as_table_mut().ok_or_else(|| format!("plan.{name}.{tier} is not a table"))?;
            for (key, value) in [("rpm", BENCH_RPM), ("tpm", BENCH_TPM), ("concurrency", BENCH_WIDE)] {
                if limits.contains_key(key) {
                    limits.insert(key.to_owned(), toml::Value::Integer(value));
                }
            }
            limits.remove("rpm_burst");
            limits.remove("tpm_burst");
        }
    }
    let mut account_keys = Vec::new();
    for account in array_of_tables(&mut doc, "account")? {
        account.insert("base_url".to_owned(), toml::Value::String(upstream.to_owned()));
        account.insert("rpm".to_owned(), toml::Value::Integer(BENCH_RPM));
        account.insert("tpm".to_owned(), toml::Value::Integer(BENCH_TPM));
        if let Some(key) = account.get("api_key").and_then(toml::Value::as_str) {
            account_keys.push(key.to_owned());
        }
    }
    let mut tenant_keys = Vec::new();
    for tenant in array_of_tables(&mut doc, "tenant")? {
        let first = array_of_tables(tenant, "key")?
            .into_iter()
            .find_map(|k| k.get("key").and_then(toml::Value::as_str).map(str::to_owned));
        tenant_keys.extend(first);
    }
    if account_keys.is_empty() {
        return Err("the bench's configuration has no [[account]]".into());
    }
    if tenant_keys.is_empty() {
        return Err("the bench needs a tenant's API key in plain text (`key = \"...\"`) in its configuration".into());
    }
    let text = toml::to_string(&doc).map_err(|e| format!("cannot write the bench's configuration: {e}"))?;
    Config::parse(&text, Some("the bench's configuration")).map_err(|e| e.to_string())?;
    Ok(BenchConfig { text, tenant_keys, account_keys, model })
}

/// The child processes of a run and their directory: killed and removed when dropped,
/// whether the run ends or fails.
#[derive(Debug)]
struct Children {
    dir: PathBuf,
    running: Vec<(&'static str, Child)>,
}

impl Children {
    fn new() -> Result<Self, BoxError> {
        let dir = std::env::temp_dir().join(format!("egw-bench-{}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
        Ok(Children { dir, running: Vec::new() })
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// The last lines a child wrote on stderr.
    fn log_tail(&self, name: &str) -> String {
        let text = std::fs::read_to_string(self.path(&format!("{name}.log"))).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(10)..].join("\n")
    }

    /// Spawns `command` (stderr to `<name>.log`), keeps it, and returns its pid.
    fn spawn(&mut self, name: &'static str, mut command: Command) -> Result<u32, BoxError> {
        let log = std::fs::File::create(self.path(&format!("{name}.log")))?;
        let child = command
            .stdin(Stdio::null())
            .stderr(log)
            .spawn()
            .map_err(|e| format!("cannot start {name} ({:?}): {e}", command.get_program()))?;
        let pid = child.id();
        self.running.push((name, child));
        Ok(pid)
    }

    /// Spawns this binary with `args`, and waits for the address it prints on stdout.
    fn spawn_self(&mut self, name: &'static str, args: &[&str]) -> Result<(u32, SocketAddr), BoxError> {
        let exe = std::env::current_exe().map_err(|e| format!("cannot find this binary: {e}"))?;
        let mut command = Command::new(exe);
        // Warnings and errors only: no access lines, no start-up lines.
        command.args(args).env("RUST_LOG", "warn,access=off").stdout(Stdio::piped());
        let pid = self.spawn(name, command)?;
        let stdout = self.running.last_mut().and_then(|(_, c)| c.stdout.take()).ok_or("no stdout to read")?;
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut reader = BufReader::new(stdout);
            let mut line = String::new();
            let _ = reader.read_line(&mut line);
            let _ = tx.send(line);
            // Whatever else it prints must not fill the pipe.
            let _ = std::io::copy(&mut reader, &mut std::io::sink());
        });
        let line = rx.recv_timeout(START_TIMEOUT).unwrap_or_default();
        let addr = line
            .rsplit_once("http://")
            .and_then(|(_, a)| a.trim().parse::<SocketAddr>().ok())
            .ok_or_else(|| format!("{name} printed no address ({line:?}); its stderr:\n{}", self.log_tail(name)))?;
        Ok((pid, addr))
    }

    /// Whether the child `name` has exited.
    fn exited(&mut self, name: &str) -> bool {
        self.running.iter_mut().any(|(n, c)| *n == name && !matches!(c.try_wait(), Ok(None)))
    }

    /// Kills the child `name`, if it runs.
    fn kill(&mut self, name: &str) {
        if let Some(i) = self.running.iter().position(|(n, _)| *n == name) {
            let (_, mut child) = self.running.remove(i);
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for Children {
    fn drop(&mut self) {
        for (_, child) in &mut self.running {
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A free port on loopback (for nginx, which cannot say which one it took).
fn free_port() -> Result<SocketAddr, BoxError> {
    let listener = StdListener::bind("127.0.0.1:0")?;
    Ok(listener.local_addr()?)
}

/// `nginx` on `PATH`, if any.
fn find_nginx() -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).map(|dir| dir.join("nginx")).find(|p| p.is_file())
}

/// A minimal nginx.conf: one process, no access log, a keep-alive upstream pool.
fn nginx_conf(dir: &Path, listen: SocketAddr, upstream: SocketAddr) -> String {
    let d = dir.display();
    format!(
        "daemon off;
master_process off;
worker_processes 1;
error_log {d}/nginx-error.log warn;
pid {d}/nginx.pid;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {d}/client_body;
    proxy_temp_path {d}/proxy;
    fastcgi_temp_path {d}/fastcgi;
    uwsgi_temp_path {d}/uwsgi;
    scgi_temp_path {d}/scgi;
    keepalive_requests 10000000;
    upstream mock {{
        server {upstream};
        keepalive 256;
        keepalive_requests 10000000;
    }}
    server {{
        listen {listen};
        location / {{
            proxy_pass http://mock;
            proxy_http_version 1.1;
            proxy_set_header Connection \"\";
        }}
    }}
}}
"
    )
}

/// Starts nginx in front of `upstream`; `None` (and why) if it did not start.
async fn start_nginx(children: &mut Children, upstream: SocketAddr) -> Result<(u32, SocketAddr), String> {
    let Some(nginx) = find_nginx() else { return Err("not on PATH".into()) };
    let listen = free_port().map_err(|e| e.to_string())?;
    let conf = children.path("nginx.conf");
    std::fs::write(&conf, nginx_conf(&children.dir, listen, upstream)).map_err(|e| e.to_string())?;
    let mut command = Command::new(nginx);
    command.arg("-p").arg(&children.dir).arg("-c").arg(&conf).arg("-e").arg(children.path("nginx-error.log"));
    command.stdout(Stdio::null());
    let pid = children.spawn("nginx", command).map_err(|e| e.to_string())?;
    let deadline = Instant::now() + START_TIMEOUT;
    loop {
        if TcpStream::connect(listen).await.is_ok() {
            return Ok((pid, listen));
        }
        if children.exited("nginx") || Instant::now() > deadline {
            children.kill("nginx");
            let log = std::fs::read_to_string(children.path("nginx-error.log")).unwrap_or_default();
            return Err(format!("it did not start: {}{}", children.log_tail("nginx"), log.trim()));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Clock ticks a second of `/proc/<pid>/stat`'s times: `getconf CLK_TCK`, or 100 (what
/// Linux reports on every architecture) if it cannot be asked.
fn clock_ticks() -> u64 {
    Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.trim().parse().ok())
        .filter(|&t: &u64| t > 0)
        .unwrap_or(100)
}

/// `utime + stime` of process `pid`, in clock ticks.
fn cpu_ticks(pid: u32) -> Result<u64, BoxError> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map_err(|e| format!("cannot read /proc/{pid}/stat: {e}"))?;
    // The command name, in parentheses, may hold spaces: count the fields after it.
    let rest = stat.rsplit_once(')').map(|(_, r)| r).ok_or("/proc/<pid>/stat without a command name")?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // Fields 14 and 15 of the whole line are 12th and 13th after the name (state is 3rd).
    let field = |i: usize| -> Result<u64, BoxError> {
        Ok(fields.get(i).ok_or("/proc/<pid>/stat is too short")?.parse::<u64>()?)
    };
    Ok(field(11)? + field(12)?)
}

/// One target: where it listens, its process, and the keys its load sends.
#[derive(Debug, Clone)]
struct Target {
    name: &'static str,
    addr: SocketAddr,
    pid: u32,
    keys: Vec<String>,
}

/// What one connection of the load saw.
#[derive(Debug, Default)]
struct ConnectionResult {
    /// Latencies of the requests sent and answered within the measurement, in ns.
    latencies: Vec<u64>,
    /// Answers by status, warm-up included.
    statuses: BTreeMap<u16, u64>,
    /// Transport errors.
    errors: Vec<String>,
}

/// One target's measurement in one round.
#[derive(Debug, Clone)]
struct Sample {
    per_second: f64,
    cpu_us: f64,
    upstream_cpu_us: f64,
    p50_us: f64,
    p99_us: f64,
}

/// The `p`-quantile of `sorted` (nearest rank), in µs.
fn quantile_us(sorted: &[u64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1] as f64 / 1000.0
}

/// One connection of the load: requests back to back from its start until `until`; only
/// those sent at `from` or later and answered by `until` are measured.
async fn load_connection(
    addr: SocketAddr,
    key: String,
    body: Bytes,
    from: Instant,
    until: Instant,
) -> ConnectionResult {
    let mut out = ConnectionResult::default();
    let stream = match TcpStream::connect(addr).await {
        Ok(s) => s,
        Err(e) => {
            out.errors.push(format!("connect: {e}"));
            return out;
        }
    };
    let _ = stream.set_nodelay(true);
    let (mut sender, connection) = match hyper::client::conn::http1::handshake(TokioIo::new(stream)).await {
        Ok(pair) => pair,
        Err(e) => {
            out.errors.push(format!("handshake: {e}"));
            return out;
        }
    };
    tokio::spawn(connection);
    let host = addr.to_string();
    let bearer = format!("Bearer {key}");
    loop {
        let sent = Instant::now();
        if sent >= until {
            break;
        }
        let request = Request::post("/v1/embeddings")
            .header(header::HOST, &host)
            .header(header::AUTHORIZATION, &bearer)
            .header(header::CONTENT_TYPE, "application/json")
            .body(Full::new(body.clone()));
        let request = match request {
            Ok(r) => r,
            Err(e) => {
                out.errors.push(format!("request: {e}"));
                break;
            }
        };
        if let Err(e) = sender.ready().await {
            out.errors.push(format!("connection: {e}"));
            break;
        }
        let answer = match sender.send_request(request).await {
            Ok(r) => r,
            Err(e) => {
                out.errors.push(format!("request: {e}"));
                break;
            }
        };
        let status = answer.status();
        if let Err(e) = answer.into_body().collect().await {
            out.errors.push(format!("body: {e}"));
            break;
        }
        let done = Instant::now();
        *out.statuses.entry(status.as_u16()).or_default() += 1;
        if status == StatusCode::OK && sent >= from && done <= until {
            out.latencies.push(u64::try_from((done - sent).as_nanos()).unwrap_or(u64::MAX));
        }
    }
    out
}

/// What one target's round gave, and what went wrong.
struct Round {
    sample: Sample,
    statuses: BTreeMap<u16, u64>,
    errors: Vec<String>,
}

/// Drives `target` for the warm-up and then `seconds`, measuring the second part.
async fn drive(
    target: &Target,
    upstream_pid: u32,
    body: &Bytes,
    connections: usize,
    seconds: u64,
    ticks: u64,
) -> Result<Round, BoxError> {
    let from = Instant::now() + WARM_UP;
    let until = from + Duration::from_secs(seconds);
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..connections {
        let key = target.keys[i % target.keys.len()].clone();
        tasks.spawn(load_connection(target.addr, key, body.clone(), from, until));
    }
    tokio::time::sleep_until(from).await;
    let (cpu0, up0) = (cpu_ticks(target.pid)?, cpu_ticks(upstream_pid)?);
    let started = Instant::now();
    tokio::time::sleep_until(until).await;
    let (cpu1, up1) = (cpu_ticks(target.pid)?, cpu_ticks(upstream_pid)?);
    let elapsed = started.elapsed().as_secs_f64();
    let mut latencies = Vec::new();
    let mut statuses = BTreeMap::new();
    let mut errors = Vec::new();
    while let Some(joined) = tasks.join_next().await {
        let c = joined.map_err(|e| format!("a load connection failed: {e}"))?;
        latencies.extend(c.latencies);
        for (status, n) in c.statuses {
            *statuses.entry(status).or_insert(0) += n;
        }
        errors.extend(c.errors);
    }
    latencies.sort_unstable();
    let n = latencies.len().max(1) as f64;
    let us_per_tick = 1e6 / ticks as f64;
    let sample = Sample {
        per_second: latencies.len() as f64 / elapsed,
        cpu_us: cpu1.saturating_sub(cpu0) as f64 * us_per_tick / n,
        upstream_cpu_us: up1.saturating_sub(up0) as f64 * us_per_tick / n,
        p50_us: quantile_us(&latencies, 0.50),
        p99_us: quantile_us(&latencies, 0.99),
    };
    Ok(Round { sample, statuses, errors })
}

/// Min, median and max of `values` (the median of an even count: the mean of the middle
/// two).
fn spread(values: &[f64]) -> (f64, f64, f64) {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| !x.is_nan()).collect();
    if v.is_empty() {
        return (f64::NAN, f64::NAN, f64::NAN);
    }
    v.sort_by(f64::total_cmp);
    let mid = v.len() / 2;
    let median = if v.len() % 2 == 0 { f64::midpoint(v[mid - 1], v[mid]) } else { v[mid] };
    (v[0], median, v[v.len() - 1])
}

fn cell(values: &[f64], decimals: usize) -> String {
    let (lo, med, hi) = spread(values);
    format!("{lo:.decimals$} / {med:.decimals$} / {hi:.decimals$}")
}

/// The report: the table of every target, then the ratios of the medians.
fn report(samples: &BTreeMap<&'static str, Vec<Sample>>, order: &[&'static str]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<8} {:>26} {:>26} {:>26} {:>26} {:>14}",
        "target",
        "req/s min/med/max",
        "CPU µs/req min/med/max",
        "p50 µs min/med/max",
        "p99 µs min/med/max",
        "upstream µs/req"
    );
    let median =
        |name: &str, f: fn(&Sample) -> f64| samples.get(name).map(|s| spread(&s.iter().map(f).collect::<Vec<_>>()).1);
    for name in order {
        let Some(s) = samples.get(name) else { continue };
        let col = |f: fn(&Sample) -> f64, d: usize| cell(&s.iter().map(f).collect::<Vec<_>>(), d);
        let _ = writeln!(
            out,
            "{:<8} {:>26} {:>26} {:>26} {:>26} {:>14.1}",
            name,
            col(|s| s.per_second, 0),
            col(|s| s.cpu_us, 1),
            col(|s| s.p50_us, 0),
            col(|s| s.p99_us, 0),
            median(name, |s| s.upstream_cpu_us).unwrap_or(f64::NAN),
        );
    }
    let _ = writeln!(out, "\nratios of medians:");
    let cpu = |name: &str| median(name, |s| s.cpu_us);
    let p50 = |name: &str| median(name, |s| s.p50_us);
    let direct = p50("direct");
    let added = |name: &str| Some(p50(name)? - direct?);
    for base in ["hop", "nginx"] {
        match (cpu("gateway"), cpu(base)) {
            (Some(g), Some(b)) => {
                let _ = writeln!(
                    out,
                    "  CPU per request      gateway / {base:<5} = {:>6.2}   (gateway {g:.1} µs, {base} {b:.1} µs)",
                    g / b
                );
            }
            _ => {
                let _ = writeln!(out, "  CPU per request      gateway / {base:<5} = n/a (not measured)");
            }
        }
    }
    for base in ["hop", "nginx"] {
        match (added("gateway"), added(base)) {
            (Some(g), Some(b)) if b > 0.0 => {
                let _ = writeln!(
                    out,
                    "  added p50 latency    gateway / {base:<5} = {:>6.2}   (gateway +{g:.0} µs, {base} +{b:.0} µs over direct)",
                    g / b
                );
            }
            (Some(g), Some(b)) => {
                let _ = writeln!(
                    out,
                    "  added p50 latency    gateway / {base:<5} = n/a   (gateway +{g:.0} µs, {base} +{b:.0} µs over direct)"
                );
            }
            _ => {
                let _ = writeln!(out, "  added p50 latency    gateway / {base:<5} = n/a (not measured)");
            }
        }
    }
    out
}

/// Runs the bench (see the module docs), printing its progress and its report on stdout.
/// Whether every answer was a `200`.
///
/// # Errors
/// A child that does not start, a configuration that does not load, `/proc` unreadable.
pub async fn run(options: &BenchOptions) -> Result<bool, BoxError> {
    if let Some(only) = &options.only {
        if !TARGETS.contains(&only.as_str()) {
            return Err(format!("--only: {only:?} is not one of {}", TARGETS.join(", ")).into());
        }
    }
    let wanted = |name: &str| options.only.as_deref().is_none_or(|o| o == name);
    let source = match &options.config {
        Some(path) => std::fs::read_to_string(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?,
        None => BENCH_CONFIG.to_owned(),
    };
    // Checked before anything starts.
    rewrite(&source, "http://127.0.0.1:9")?;
    let mut children = Children::new()?;
    let upstream_conf = children.path("upstream.toml");
    std::fs::write(&upstream_conf, rewrite(&source, "http://127.0.0.1:9")?.text)?;
    let conf = upstream_conf.to_string_lossy().into_owned();
    let (upstream_pid, upstream) =
        children.spawn_self("upstream", &["upstream", "--config", &conf, "--listen", "127.0.0.1:0"])?;
    let upstream_url = format!("http://{upstream}");
    let bench = rewrite(&source, &upstream_url)?;
    let gateway_conf = children.path("gateway.toml");
    std::fs::write(&gateway_conf, &bench.text)?;
    let gateway_conf = gateway_conf.to_string_lossy().into_owned();

    let mut targets = Vec::new();
    let accounts = bench.account_keys.clone();
    println!("upstream (mock)  pid {upstream_pid:<7} http://{upstream}");
    if wanted("direct") {
        targets.push(Target { name: "direct", addr: upstream, pid: upstream_pid, keys: accounts.clone() });
    }
    if wanted("hop") {
        let (pid, addr) =
            children.spawn_self("hop", &["hop", "--listen", "127.0.0.1:0", "--upstream", &upstream_url])?;
        println!("hop              pid {pid:<7} http://{addr}");
        targets.push(Target { name: "hop", addr, pid, keys: accounts.clone() });
    }
    if wanted("nginx") {
        match start_nginx(&mut children, upstream).await {
            Ok((pid, addr)) => {
                println!("nginx            pid {pid:<7} http://{addr}");
                targets.push(Target { name: "nginx", addr, pid, keys: accounts.clone() });
            }
            Err(why) => println!("nginx            skipped: {why}"),
        }
    }
    if wanted("gateway") {
        let (pid, addr) =
            children.spawn_self("gateway", &["serve", "--config", &gateway_conf, "--listen", "127.0.0.1:0"])?;
        println!("gateway          pid {pid:<7} http://{addr}");
        targets.push(Target { name: "gateway", addr, pid, keys: bench.tenant_keys.clone() });
    }
    println!(
        "{} rounds of {} s per target (after {} ms of warm-up), {} connections, POST /v1/embeddings {:?}",
        options.rounds,
        options.seconds,
        WARM_UP.as_millis(),
        options.connections,
        INPUT
    );

    let body = Bytes::from(format!("{{\"model\": \"{}\", \"input\": \"{INPUT}\"}}", bench.model));
    let ticks = clock_ticks();
    let mut samples: BTreeMap<&'static str, Vec<Sample>> = BTreeMap::new();
    let mut statuses: BTreeMap<&'static str, BTreeMap<u16, u64>> = BTreeMap::new();
    let mut errors: BTreeMap<&'static str, Vec<String>> = BTreeMap::new();
    for round in 1..=options.rounds {
        let mut line = format!("round {round}:");
        for target in &targets {
            for name in ["upstream", target.name] {
                if children.exited(name) {
                    return Err(format!("{name} exited; its stderr:\n{}", children.log_tail(name)).into());
                }
            }
            let r = drive(target, upstream_pid, &body, options.connections, options.seconds, ticks).await?;
            let _ = write!(line, " {} {:.0}/s", target.name, r.sample.per_second);
            samples.entry(target.name).or_default().push(r.sample);
            for (status, n) in r.statuses {
                *statuses.entry(target.name).or_default().entry(status).or_insert(0) += n;
            }
            errors.entry(target.name).or_default().extend(r.errors);
        }
        println!("{line}");
    }
    let order: Vec<&'static str> = targets.iter().map(|t| t.name).collect();
    println!("\n{}", report(&samples, &order));
    let mut clean = true;
    for target in &order {
        let bad: Vec<String> = statuses
            .get(target)
            .into_iter()
            .flatten()
            .filter(|(s, _)| **s != 200)
            .map(|(s, n)| format!("{n} × {s}"))
            .collect();
        if !bad.is_empty() {
            clean = false;
            println!("{target}: answers other than 200: {}", bad.join(", "));
        }
        if let Some(e) = errors.get(target).filter(|e| !e.is_empty()) {
            clean = false;
            println!("{target}: {} transport errors, the first: {}", e.len(), e[0]);
        }
    }
    if clean {
        let answered: u64 = statuses.values().flat_map(|s| s.values()).sum();
        println!("all {answered} answers were 200");
    }
    Ok(clean)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bench_config_is_rewritten_for_the_mock_and_validates() {
        let b = rewrite(BENCH_CONFIG, "http://127.0.0.1:4242").unwrap();
        assert!(b.text.contains("http://127.0.0.1:4242"));
        assert_eq!(b.tenant_keys, ["sk-bench-acme", "sk-bench-globex"]);
        assert_eq!(b.account_keys, ["up-key-primary", "up-key-secondary"]);
        assert_eq!(b.model, "mock-embedding-small");
    }

    #[test]
    fn the_bundled_config_can_be_benched() {
        let b = rewrite(include_str!("../gateway.toml"), "http://127.0.0.1:4242").unwrap();
        let config = Config::parse(&b.text, None).unwrap();
        assert!(config.accounts.iter().all(|a| a.base_url == "http://127.0.0.1:4242"));
        assert!(config.upstream.latency.is_zero());
    }

    #[test]
    fn quantiles_and_spreads() {
        let v: Vec<u64> = (1..=100).map(|i| i * 1000).collect();
        assert!((quantile_us(&v, 0.5) - 50.0).abs() < 1e-9);
        assert!((quantile_us(&v, 0.99) - 99.0).abs() < 1e-9);
        assert_eq!(spread(&[3.0, 1.0, 2.0]), (1.0, 2.0, 3.0));
        assert_eq!(spread(&[4.0, 1.0, 2.0, 3.0]), (1.0, 2.5, 4.0));
    }

    #[test]
    fn proc_stat_is_read() {
        assert!(cpu_ticks(std::process::id()).is_ok());
    }
}
