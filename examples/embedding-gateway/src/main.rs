//! `embedding-gateway`: a per-tenant embedding API gateway built on tower-limits.
//!
//! ```text
//! embedding-gateway demo     [--config FILE] [--seconds N] [--svg PATH] [--quiet] [--redis URL --replicas N]
//! embedding-gateway serve    [--config FILE] [--listen ADDR] [--redis URL --replicas N]
//! embedding-gateway upstream [--config FILE] [--listen ADDR]
//! embedding-gateway check    [--config FILE]
//! ```
//!
//! Without `--config`, the bundled `gateway.toml` is used. `demo` runs the mock upstream,
//! the gateway and the load in this process, on loopback ports, and exits 1 if the
//! upstream answered any 429 or a tenant's share strayed beyond the tolerance.

// Printing usage, errors and the demo's report is this binary's job.
#![allow(clippy::print_stdout, clippy::print_stderr)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use embedding_gateway::config::Config;
use embedding_gateway::demo::{self, DemoOptions, RedisOptions};
use embedding_gateway::gateway::{Gateway, Sharing, http_transport};
use embedding_gateway::upstream;
use tower_limits_redis::RedisConnection;

/// The configuration the demo runs when none is given.
const BUNDLED: &str = include_str!("../gateway.toml");

const USAGE: &str = "\
usage:
  embedding-gateway demo     [--config FILE] [--seconds N] [--svg PATH] [--quiet] [--redis URL --replicas N]
  embedding-gateway serve    [--config FILE] [--listen ADDR] [--redis URL --replicas N]
  embedding-gateway upstream [--config FILE] [--listen ADDR]
  embedding-gateway check    [--config FILE]

Without --config, the bundled gateway.toml is used. With --redis, the tenants' limits
live in Redis, shared by N replicas (the demo runs them all; serve is one of them), and
each replica mirrors 1/N of every upstream account.";

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
}

fn parse_args() -> Result<Args, String> {
    let mut it = std::env::args().skip(1);
    let command = it.next().ok_or("no command")?;
    let mut args = Args {
        command,
        config: None,
        seconds: None,
        svg: PathBuf::from("target/embedding-gateway-demo.svg"),
        listen: None,
        quiet: false,
        redis: None,
        replicas: None,
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
            "--redis" => args.redis = Some(value("--redis")?),
            "--replicas" => {
                let v = value("--replicas")?;
                let n: u64 = v.parse().map_err(|_| format!("--replicas: {v:?} is not a whole number"))?;
                if !(1..=64).contains(&n) {
                    return Err("--replicas: between 1 and 64".into());
                }
                args.replicas = Some(n);
            }
            "-h" | "--help" => return Err(String::new()),
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    if args.replicas.is_some() && args.redis.is_none() {
        return Err("--replicas needs --redis URL".into());
    }
    Ok(args)
}

fn load(args: &Args) -> Result<Config, String> {
    match &args.config {
        Some(path) => Config::from_file(path),
        None => Config::parse(BUNDLED, Some("gateway.toml (bundled)")),
    }
    .map_err(|e| e.to_string())
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            if !e.is_empty() {
                eprintln!("error: {e}\n");
            }
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        }
    };
    let config = match load(&args) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result: Result<bool, tower::BoxError> = runtime.block_on(async move {
        match args.command.as_str() {
            "check" => {
                println!(
                    "ok: {} tiers, {} plans, {} tenants, {} accounts",
                    config.tiers.len(),
                    config.plans.len(),
                    config.tenants.len(),
                    config.accounts.len()
                );
                Ok(true)
            }
            "demo" => {
                let redis = args.redis.clone().map(|url| RedisOptions { url, replicas: args.replicas.unwrap_or(2) });
                let options =
                    DemoOptions { seconds: args.seconds, svg: args.svg.clone(), progress: !args.quiet, redis };
                demo::run(config, &options).await.map(|r| r.passed())
            }
            "serve" => {
                let sharing = match &args.redis {
                    None => Sharing::InMemory,
                    Some(url) => Sharing::Redis {
                        connection: RedisConnection::connect(url).await?,
                        replicas: args.replicas.unwrap_or(1),
                        namespace: "egw".into(),
                    },
                };
                let gateway = Gateway::with_sharing(&config, http_transport(), &sharing)?;
                let addr = args.listen.unwrap_or(config.gateway.listen);
                let listener = tokio::net::TcpListener::bind(addr).await?;
                println!("gateway listening on http://{}", listener.local_addr()?);
                axum::serve(listener, gateway.router).with_graceful_shutdown(ctrl_c()).await?;
                Ok(true)
            }
            "upstream" => {
                let (router, stats) = upstream::router(&config.accounts, config.upstream);
                let addr = args.listen.unwrap_or(config.upstream.listen);
                let listener = tokio::net::TcpListener::bind(addr).await?;
                println!("mock upstream listening on http://{}", listener.local_addr()?);
                axum::serve(listener, router).with_graceful_shutdown(ctrl_c()).await?;
                println!("429 answers given: {}", stats.refused());
                Ok(true)
            }
            other => Err(format!("unknown command {other:?}\n\n{USAGE}").into()),
        }
    });
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn ctrl_c() {
    let _ = tokio::signal::ctrl_c().await;
}
