//! `embedding-gateway`: a per-tenant embedding API gateway built on tower-limits.
//!
//! ```text
//! embedding-gateway demo     [--config FILE] [--seconds N] [--svg PATH] [--quiet] [--quota-changes] [--redis URL --replicas N [--uneven] [--advisory-shares]]
//! embedding-gateway serve    [--config FILE] [--listen ADDR] [--redis URL --replicas N]
//! embedding-gateway upstream [--config FILE] [--listen ADDR]
//! embedding-gateway check    [--config FILE]
//! embedding-gateway hop      [--listen ADDR] --upstream URL
//! embedding-gateway bench    [--config FILE] [--seconds N] [--rounds N] [--connections N]
//! embedding-gateway help | --help | version | --version
//! ```
//!
//! `serve` and `upstream` log through `tracing` on stderr (`RUST_LOG` sets the level,
//! `--log-format json` writes JSON lines), drain on SIGTERM and SIGINT, and print the
//! address they listen on to stdout.
//!
//! Without `--config`, the bundled `gateway.toml` is used. `demo` runs the mock upstream,
//! the gateway and the load in this process, on loopback ports, and exits 1 if the
//! upstream answered any 429 or a tenant's share strayed beyond the tolerance.
//!
//! `hop` is a minimal reverse proxy (every request forwarded to `--upstream` over a
//! keep-alive pool, the answer streamed back): the baseline of `bench`, which spawns the
//! mock upstream, the gateway, the hop and nginx (when on `PATH`) as child processes,
//! drives each in interleaved rounds, and prints their requests a second, latency and CPU
//! per request, and the gateway's cost against the hop's and nginx's (see
//! `embedding_gateway::bench`). It exits 1 if any answer was not a `200`.

// Printing usage, errors and the demo's report is this binary's job.
#![allow(clippy::print_stdout, clippy::print_stderr)]

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use embedding_gateway::bench::{self, BenchOptions};
use embedding_gateway::config::{BackendFailure, Config};
use embedding_gateway::demo::{self, DemoOptions, RedisOptions};
use embedding_gateway::gateway::{Gateway, http_transport};
use embedding_gateway::health::BackendStatus;
use embedding_gateway::hop::{self as proxy, Upstream};
use embedding_gateway::logging::{self, LogFormat};
use embedding_gateway::server::{self, ServerSettings};
use embedding_gateway::upstream;
use tokio::net::TcpListener;
use tower_limits_redis::RedisConnection;

/// mimalloc: a request's buffers are often freed on another worker thread than the one
/// that allocated them, where the system allocator takes a lock per free (futex waits
/// between the workers under load); mimalloc frees those to the owner's queue without one.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// The configuration the demo runs when none is given.
const BUNDLED: &str = include_str!("../gateway.toml");

const USAGE: &str = "\
usage:
  embedding-gateway demo     [--config FILE] [--seconds N] [--svg PATH] [--quiet] [--quota-changes] [--redis URL --replicas N [--uneven] [--advisory-shares]]
  embedding-gateway demo     --budget [--config FILE]
  embedding-gateway serve    [--config FILE] [--listen ADDR] [--redis URL --replicas N] [--log-format text|json]
  embedding-gateway upstream [--config FILE] [--listen ADDR] [--log-format text|json]
  embedding-gateway check    [--config FILE]
  embedding-gateway hop      [--listen ADDR] --upstream URL
  embedding-gateway bench    [--config FILE] [--seconds N] [--rounds N] [--connections N]
  embedding-gateway help | --help | version | --version

Without --config, the bundled gateway.toml is used. With --redis, the tenants' limits
and the upstream accounts' mirrors live in Redis, shared by every replica (the demo runs
N of them; serve is one); N only sizes what a replica decides alone while Redis is away
(1/N of every limit and account; serve's replicas also count each other through Redis
and size for the larger fleet). serve starts even while Redis is down, and follows
gateway.backend_failure until it answers. --uneven routes the demo's first tenant only
to the first replica and splits the others' connections 60/30/10 (the replicas still
share the accounts by the tenants' weights across the fleet); --advisory-shares reports
the tenants' shares without failing on them. --quota-changes (in memory or on Redis) halves the mock
upstream's real quota at a third of the run and doubles it at two thirds: the gateway
learns both from the upstream's x-ratelimit-limit-* fields (give it 45 seconds or more:
following the doubling takes about seven seconds of each phase's third).
demo --budget runs a month on a paused clock instead: a team spends its monthly budget
in money (scaled down for the demo), is refused with the renewal named, and is served
again at the first instant of the next month in gateway.timezone.

serve and upstream log on stderr (level from RUST_LOG, default info), drain on SIGTERM
and SIGINT (gateway.shutdown_grace), and print the address they listen on to stdout.
The gateway answers GET /healthz, GET /readyz and GET /v1/models besides
POST /v1/embeddings and POST /v1/chat/completions (\"stream\": true for server-sent
events).

hop is a minimal reverse proxy to --upstream (default --listen 127.0.0.1:8081), the
baseline of bench. bench spawns the mock upstream (no latency), the gateway, the hop and
nginx (if on PATH) and drives each over --connections keep-alive connections (default
16) for --rounds interleaved rounds (default 5) of --seconds (default 3): it prints
requests a second, p50 and p99 latency and the CPU per request of each process, and the
gateway's CPU per request and added latency against the hop's and nginx's. Its
configuration (a small bundled one, or --config) is rewritten so that nothing is
refused. It exits 1 if any answer was not a 200.";

/// The parsed command line.
struct Args {
    command: String,
    config: Option<PathBuf>,
    seconds: Option<u64>,
    svg: PathBuf,
    listen: Option<SocketAddr>,
    quiet: bool,
    redis: Option<String>,
    replicas: Option<u64>,
    /// `--uneven`: the demo routes unevenly.
    uneven: bool,
    /// `--advisory-shares`: the demo does not fail on the shares.
    advisory_shares: bool,
    /// `--quota-changes`: the demo's upstream halves, then doubles, its real quota.
    quota_changes: bool,
    /// `--budget`: the demo spends a team's monthly budget on a paused clock.
    budget: bool,
    log_format: LogFormat,
    /// `--upstream URL`: where `hop` forwards.
    upstream: Option<String>,
    /// `--rounds N`: the bench's rounds.
    rounds: Option<u32>,
    /// `--connections N`: the bench's connections.
    connections: Option<usize>,
    /// `--only TARGET` (not in the usage): the bench drives one target, for profiling.
    only: Option<String>,
}

/// What the command line asks for.
enum Cli {
    Run(Box<Args>),
    Help,
    Version,
}

fn parse_args() -> Result<Cli, String> {
    let all: Vec<String> = std::env::args().skip(1).collect();
    if all.iter().any(|a| a == "-h" || a == "--help") || all.first().is_some_and(|a| a == "help") {
        return Ok(Cli::Help);
    }
    if all.iter().any(|a| a == "-V" || a == "--version") || all.first().is_some_and(|a| a == "version") {
        return Ok(Cli::Version);
    }
    let mut it = all.into_iter();
    let command = it.next().ok_or("no command given")?;
    if !["demo", "serve", "upstream", "check", "hop", "bench"].contains(&command.as_str()) {
        return Err(format!("unknown command {command:?}"));
    }
    let mut args = Args {
        command,
        config: None,
        seconds: None,
        svg: PathBuf::from("target/embedding-gateway-demo.svg"),
        listen: None,
        quiet: false,
        redis: None,
        replicas: None,
        uneven: false,
        advisory_shares: false,
        quota_changes: false,
        budget: false,
        log_format: LogFormat::Text,
        upstream: None,
        rounds: None,
        connections: None,
        only: None,
    };
    while let Some(flag) = it.next() {
        let mut value = |name: &str| it.next().ok_or_else(|| format!("{name} needs a value"));
        match flag.as_str() {
            "--config" => args.config = Some(PathBuf::from(value("--config")?)),
            "--seconds" => {
                let v = value("--seconds")?;
                let n: u64 = v.parse().map_err(|_| format!("--seconds: {v:?} is not a whole number"))?;
                if !(1..=600).contains(&n) {
                    return Err("--seconds: between 1 and 600".into());
                }
                args.seconds = Some(n);
            }
            "--svg" => args.svg = PathBuf::from(value("--svg")?),
            "--listen" => {
                let v = value("--listen")?;
                args.listen = Some(v.parse().map_err(|_| format!("--listen: {v:?} is not an address"))?);
            }
            "--quiet" => args.quiet = true,
            "--uneven" => args.uneven = true,
            "--advisory-shares" => args.advisory_shares = true,
            "--quota-changes" => args.quota_changes = true,
            "--budget" => args.budget = true,
            "--redis" => args.redis = Some(value("--redis")?),
            "--replicas" => {
                let v = value("--replicas")?;
                let n: u64 = v.parse().map_err(|_| format!("--replicas: {v:?} is not a whole number"))?;
                if !(1..=64).contains(&n) {
                    return Err("--replicas: between 1 and 64".into());
                }
                args.replicas = Some(n);
            }
            "--log-format" => args.log_format = value("--log-format")?.parse()?,
            "--upstream" => args.upstream = Some(value("--upstream")?),
            "--rounds" => {
                let v = value("--rounds")?;
                let n: u32 = v.parse().map_err(|_| format!("--rounds: {v:?} is not a whole number"))?;
                if !(1..=100).contains(&n) {
                    return Err("--rounds: between 1 and 100".into());
                }
                args.rounds = Some(n);
            }
            "--connections" => {
                let v = value("--connections")?;
                let n: usize = v.parse().map_err(|_| format!("--connections: {v:?} is not a whole number"))?;
                if !(1..=1024).contains(&n) {
                    return Err("--connections: between 1 and 1024".into());
                }
                args.connections = Some(n);
            }
            "--only" => args.only = Some(value("--only")?),
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    if args.uneven && args.redis.is_none() {
        return Err("--uneven needs --redis URL".into());
    }
    if args.replicas.is_some() && args.redis.is_none() {
        return Err("--replicas needs --redis URL".into());
    }
    if args.command == "hop" && args.upstream.is_none() {
        return Err("hop needs --upstream URL".into());
    }
    Ok(Cli::Run(Box::new(args)))
}

fn load(args: &Args) -> Result<Config, String> {
    load_from(args.config.as_deref())
}

fn load_from(path: Option<&std::path::Path>) -> Result<Config, String> {
    match path {
        Some(path) => Config::from_file(path),
        None => Config::parse(BUNDLED, Some("gateway.toml (bundled)")),
    }
    .map_err(|e| e.to_string())
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(Cli::Run(a)) => *a,
        Ok(Cli::Help) => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Ok(Cli::Version) => {
            println!("embedding-gateway {}", env!("CARGO_PKG_VERSION"));
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("error: {e}\n\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    // hop needs no configuration, and bench reads (and rewrites) its own.
    let config = if matches!(args.command.as_str(), "hop" | "bench") {
        None
    } else {
        match load(&args) {
            Ok(c) => Some(c),
            Err(e) => {
                eprintln!("error: {e}");
                return ExitCode::from(2);
            }
        }
    };
    if args.command == "demo" && args.budget {
        // A month on a paused clock of its own.
        let Some(config) = config else { return ExitCode::from(2) };
        return match demo::budget::run(&config) {
            Ok(true) => ExitCode::SUCCESS,
            Ok(false) => ExitCode::FAILURE,
            Err(e) => {
                eprintln!("error: {e}");
                ExitCode::FAILURE
            }
        };
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result: Result<bool, tower::BoxError> = runtime.block_on(async move {
        let config = match config {
            Some(c) => c,
            None if args.command == "hop" => return hop(&args).await.map(|()| true),
            None => {
                let options = BenchOptions {
                    config: args.config.clone(),
                    seconds: args.seconds.unwrap_or(3),
                    rounds: args.rounds.unwrap_or(5),
                    connections: args.connections.unwrap_or(16),
                    only: args.only.clone(),
                };
                return bench::run(&options).await;
            }
        };
        match args.command.as_str() {
            "check" => {
                println!(
                    "ok: {} tiers, {} plans, {} tenants, {} accounts",
                    config.tiers.len(),
                    config.plans.len(),
                    config.tenants.len(),
                    config.accounts.len()
                );
                for (model, encoding) in config.gateway.encodings.iter() {
                    let how = if encoding.is_exact() {
                        "the provider's count"
                    } else {
                        "an upper bound: one token per byte, settled to the provider's usage"
                    };
                    println!("model {model}: tokens counted with {encoding} ({how})");
                }
                if let Some(b) = &config.budgets {
                    for (plan, (budgets, _)) in config.plans.iter().zip(&b.plans) {
                        for budget in budgets {
                            println!(
                                "budget: plan {} gives each {} {} a {}, renewed at midnight in {}",
                                plan.name,
                                budget.tier,
                                b.money(budget.micros),
                                budget.period,
                                b.timezone
                            );
                        }
                    }
                }
                let plain = config.tenants.iter().flat_map(|t| &t.keys).filter(|k| k.plain).count();
                if plain > 0 {
                    println!(
                        "warning: {plain} API keys are written in plain text; give their digests instead \
                         (key_sha256 = the output of `printf %s \"$KEY\" | sha256sum`)"
                    );
                }
                Ok(true)
            }
            "demo" => {
                let redis = args.redis.clone().map(|url| RedisOptions {
                    url,
                    replicas: args.replicas.unwrap_or(2),
                    uneven: args.uneven,
                });
                let options = DemoOptions {
                    seconds: args.seconds,
                    svg: args.svg.clone(),
                    progress: !args.quiet,
                    redis,
                    advisory_shares: args.advisory_shares,
                    quota_changes: args.quota_changes,
                };
                demo::run(config, &options).await.map(|r| r.passed())
            }
            "serve" => serve(&args, &config).await.map(|()| true),
            _ => upstream(&args, &config).await.map(|()| true),
        }
    });
    // Whatever a drain left behind (a connection cut at the end of the grace period, a
    // background reconnect) must not hold the exit.
    runtime.shutdown_timeout(Duration::from_millis(100));
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("error: {e}");
            tracing::error!("{e}");
            ExitCode::FAILURE
        }
    }
}

/// Binds `addr`, naming it if that fails.
async fn bind(addr: SocketAddr, what: &str) -> Result<TcpListener, tower::BoxError> {
    TcpListener::bind(addr).await.map_err(|e| format!("{what}: cannot listen on {addr}: {e}").into())
}

/// Completes on SIGTERM or SIGINT, and says which. The handlers are installed at once, so
/// a signal that comes before the future is polled is not lost.
fn shutdown_signal() -> Result<impl Future<Output = ()>, tower::BoxError> {
    #[cfg(unix)]
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(|e| format!("cannot handle SIGTERM: {e}"))?;
    #[cfg(unix)]
    let mut int = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())
        .map_err(|e| format!("cannot handle SIGINT: {e}"))?;
    Ok(async move {
        #[cfg(unix)]
        let which = tokio::select! {
            _ = term.recv() => "SIGTERM",
            _ = int.recv() => "SIGINT",
        };
        #[cfg(not(unix))]
        let which = {
            let _ = tokio::signal::ctrl_c().await;
            "Ctrl-C"
        };
        tracing::info!(signal = which, "shutting down");
    })
}

async fn serve(args: &Args, config: &Config) -> Result<(), tower::BoxError> {
    logging::init(args.log_format);
    let stop = shutdown_signal()?;
    let addr = args.listen.unwrap_or(config.gateway.listen);
    let listener = bind(addr, "the gateway").await?;
    let gateway = match &args.redis {
        None => Gateway::new(config, http_transport())?,
        Some(url) => {
            // A URL that cannot be one is a start-up error; a server that does not answer
            // is not: the gateway follows its failure policy until it does.
            tower_limits_redis::redis::Client::open(url.as_str())
                .map_err(|e| format!("--redis {url:?} is not a Redis URL: {e}"))?;
            let replicas = args.replicas.unwrap_or(1);
            let gateway = Gateway::awaiting_redis(config, http_transport(), replicas)?;
            redis_link(gateway.clone(), url.clone(), config.gateway.backend_failure);
            // The fleet's size as Redis hears it, against --replicas.
            let size = std::sync::Arc::new(embedding_gateway::roster::FleetSize::new(replicas));
            gateway.health.track_fleet(size.clone());
            let started = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
            let id = format!("{addr}/{}/{}", std::process::id(), started.as_nanos());
            let resizing = gateway.clone();
            embedding_gateway::roster::spawn(size, url.clone(), "egw", id, move |replicas| {
                match resizing.resize_fleet(replicas) {
                    Ok(()) => tracing::info!(
                        replicas,
                        "fleet size changed: while Redis is away this replica decides 1/{replicas} of every limit \
                         and account"
                    ),
                    Err(e) => tracing::error!(replicas, error = %e, "cannot resize to the fleet's size"),
                }
            });
            gateway
        }
    };
    reload_on_hangup(gateway.clone(), args, config.clone())?;
    let local = listener.local_addr()?;
    println!("gateway listening on http://{local}");
    tracing::info!(%local, accounts = config.accounts.len(), tenants = config.tenants.len(), "gateway listening");
    let settings = ServerSettings::from(&config.gateway);
    server::serve(listener, gateway.router.clone(), settings, Some(gateway.health.clone()), stop).await?;
    Ok(())
}

/// On SIGHUP, reads the configuration again and replaces the API keys (only the keys: see
/// `Gateway::reload_keys`); a configuration that does not parse, or changes more than the
/// keys, is logged and changes nothing.
fn reload_on_hangup(gateway: Gateway, args: &Args, running: Config) -> Result<(), tower::BoxError> {
    #[cfg(unix)]
    {
        let mut hangup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
            .map_err(|e| format!("cannot handle SIGHUP: {e}"))?;
        let path = args.config.clone();
        tokio::spawn(async move {
            while hangup.recv().await.is_some() {
                match load_from(path.as_deref()) {
                    Ok(config) => match gateway.reload_keys(&running, &config) {
                        Ok(keys) => tracing::info!(keys, "SIGHUP: API keys reloaded"),
                        Err(e) => tracing::error!(error = %e, "SIGHUP: keys not reloaded"),
                    },
                    Err(e) => tracing::error!(error = %e, "SIGHUP: the configuration does not load; keys unchanged"),
                }
            }
        });
    }
    #[cfg(not(unix))]
    let _ = (gateway, args, running);
    Ok(())
}

/// Connects to Redis in the background (at once, then every second until it answers),
/// moves the tenants' limits there, and logs whenever the backend goes away or comes back.
fn redis_link(gateway: Gateway, url: String, policy: BackendFailure) {
    let policy = match policy {
        BackendFailure::FailClosed => "fail_closed: requests are refused with 503",
        BackendFailure::FailOpen => "fail_open: requests pass without the tenants' limits",
        BackendFailure::Fallback => "fallback: this replica decides with its share of every limit",
    };
    tokio::spawn(async move {
        let mut logged = false;
        loop {
            match tokio::time::timeout(Duration::from_secs(3), RedisConnection::connect(&url)).await {
                Ok(Ok(connection)) => match gateway.connect_redis(&connection) {
                    Ok(()) => {
                        tracing::info!(redis = %url, "the tenants' limits are shared through Redis");
                        break;
                    }
                    Err(e) => {
                        tracing::error!(redis = %url, error = %e, "cannot build the limits on Redis");
                        return;
                    }
                },
                Ok(Err(e)) if !logged => {
                    tracing::warn!(redis = %url, error = %e, policy, "limits backend down: Redis does not answer; retrying every second");
                    logged = true;
                }
                Err(_) if !logged => {
                    tracing::warn!(redis = %url, policy, "limits backend down: Redis does not answer; retrying every second");
                    logged = true;
                }
                _ => {}
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        // From now on: log the backend's state when it changes.
        let mut was = gateway.health.backend();
        let mut tick = tokio::time::interval(Duration::from_millis(250));
        loop {
            tick.tick().await;
            let now = gateway.health.backend();
            if now != was {
                match now {
                    BackendStatus::Down => {
                        tracing::warn!(redis = %url, policy, "limits backend down: Redis does not answer");
                    }
                    _ => tracing::info!(redis = %url, "limits backend up: Redis answers again"),
                }
                was = now;
            }
        }
    });
}

async fn upstream(args: &Args, config: &Config) -> Result<(), tower::BoxError> {
    logging::init(args.log_format);
    let stop = shutdown_signal()?;
    let (router, stats) = upstream::router(&config.accounts, config.upstream, &config.gateway.encodings);
    let addr = args.listen.unwrap_or(config.upstream.listen);
    let listener = bind(addr, "the mock upstream").await?;
    println!("mock upstream listening on http://{}", listener.local_addr()?);
    let settings = ServerSettings { access_log: false, ..ServerSettings::from(&config.gateway) };
    server::serve(listener, router, settings, None, stop).await?;
    println!("429 answers given: {}", stats.refused());
    Ok(())
}

/// `hop`: the baseline reverse proxy, until SIGTERM or SIGINT.
async fn hop(args: &Args) -> Result<(), tower::BoxError> {
    let stop = shutdown_signal()?;
    let upstream: Upstream = args.upstream.as_deref().ok_or("hop needs --upstream URL")?.parse()?;
    let addr = args.listen.unwrap_or(SocketAddr::from(([127, 0, 0, 1], 8081)));
    let listener = bind(addr, "the hop").await?;
    println!("hop listening on http://{}", listener.local_addr()?);
    proxy::serve(listener, upstream, stop).await?;
    Ok(())
}
