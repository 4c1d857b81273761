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

mod config;
mod load;
mod processes;

pub use config::{BENCH_CONFIG, BenchConfig, rewrite};
use load::*;
use processes::*;

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
