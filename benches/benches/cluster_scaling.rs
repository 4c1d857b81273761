//! How the per-request path spreads over a Redis Cluster: the same load, a set of a rate
//! per user, a token rate and a semaphore per organisation over 1,000 users in 100
//! organisations, against clusters of 1 and 3 masters started for the run, 64
//! acquisitions in flight, each grant released. For each cluster: acquisitions a second
//! on this machine, Redis CPU per acquisition summed over the masters, the busiest
//! master's part of it, and the ceiling that part sets (the acquisitions a second at which
//! the busiest master's one core is saturated): what a fleet of clients could reach,
//! however many cores it has. Server CPU is `used_cpu_user + used_cpu_sys` of each
//! master's `INFO cpu` over the timed run.
//!
//! Run: `cargo bench -p tower-limits-benches --bench cluster_scaling`.

#![allow(clippy::print_stdout)] // the table is the point

use std::sync::Arc;
use std::time::{Duration, Instant as StdInstant};

use tower_limits_core::{Backend, Instant, LimitPolicy, LimitSetPolicy, Quota, TenantKey, nz};
use tower_limits_redis::test_support::{RedisCluster, RedisServer};
use tower_limits_redis::{RedisBackend, RedisConnection};

const IN_FLIGHT: usize = 64;
const ACQUISITIONS: u64 = 40_000;
const USERS: usize = 1_000;

fn policy() -> LimitSetPolicy {
    LimitSetPolicy::new()
        .tiers(["org", "user"])
        .limit(LimitPolicy::gcra("requests", Quota::per_second(nz!(1_000_000))).per("user"))
        .limit(LimitPolicy::token_bucket("tokens", Quota::per_second(nz!(100_000_000))).per("org").counting_cost())
        .limit(LimitPolicy::semaphore("concurrent", 1_000).per("org"))
}

/// Seconds of CPU a server has used.
fn cpu(node: &RedisServer) -> f64 {
    let info = node.command(&["INFO", "cpu"]).unwrap_or_default();
    let field = |name: &str| {
        info.lines().find_map(|l| l.strip_prefix(name)).and_then(|v| v.trim().parse::<f64>().ok()).unwrap_or(0.0)
    };
    field("used_cpu_user:") + field("used_cpu_sys:")
}

struct Row {
    masters: usize,
    per_second: f64,
    cpu_us: f64,
    busiest: f64,
}

fn run(rt: &tokio::runtime::Runtime, masters: usize) -> Option<Row> {
    let cluster = match RedisCluster::start(masters) {
        Ok(c) => c,
        Err(e) => {
            println!("cluster_scaling: a cluster of {masters} masters could not be started ({e}); skipped");
            return None;
        }
    };
    let keys: Arc<[TenantKey]> =
        (0..USERS).map(|u| TenantKey::new([format!("org-{}", u % 100), format!("user-{u}")]).expect("a key")).collect();
    rt.block_on(async {
        let conn = RedisConnection::connect_cluster(cluster.urls()).await.expect("a cluster connection");
        let backend = RedisBackend::builder(policy()).namespace("cluster-bench").build(&conn).expect("a backend");
        let go = |n: u64| {
            let tasks: Vec<_> = (0..IN_FLIGHT)
                .map(|t| {
                    let (b, keys) = (backend.clone(), keys.clone());
                    let per = n / IN_FLIGHT as u64;
                    tokio::spawn(async move {
                        for i in 0..per {
                            let key = &keys[(t * 7919 + i as usize) % keys.len()];
                            let grant = b.acquire(key, 1, Instant::ZERO).await.expect("granted");
                            b.release(key, grant);
                        }
                    })
                })
                .collect();
            async move {
                for t in tasks {
                    t.await.expect("a task");
                }
            }
        };
        go(ACQUISITIONS / 10).await;
        backend.flush().await;
        let before: Vec<f64> = cluster.nodes().iter().map(cpu).collect();
        let start = StdInstant::now();
        go(ACQUISITIONS).await;
        backend.flush().await;
        let elapsed = start.elapsed().max(Duration::from_micros(1));
        let used: Vec<f64> = cluster.nodes().iter().zip(&before).map(|(n, b)| (cpu(n) - b).max(0.0)).collect();
        let total: f64 = used.iter().sum();
        let busiest = used.iter().copied().fold(0.0, f64::max);
        Some(Row {
            masters,
            per_second: ACQUISITIONS as f64 / elapsed.as_secs_f64(),
            cpu_us: total * 1e6 / ACQUISITIONS as f64,
            busiest: if total > 0.0 { busiest / total } else { 1.0 },
        })
    })
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("a runtime");
    let rows: Vec<Row> = [1, 3].into_iter().filter_map(|m| run(&rt, m)).collect();
    println!();
    println!(
        "per request on Redis Cluster: 3 limits (rate per user, tokens and semaphore per org), {USERS} users, \
         {IN_FLIGHT} in flight"
    );
    println!(
        "{:>8} {:>16} {:>18} {:>16} {:>22}",
        "masters", "acq/s (here)", "Redis CPU/acq", "busiest master", "ceiling (busiest core)"
    );
    for r in &rows {
        let ceiling = 1e6 / (r.cpu_us * r.busiest).max(1e-9);
        println!(
            "{:>8} {:>16.0} {:>15.1} us {:>15.0}% {:>17.0} acq/s",
            r.masters,
            r.per_second,
            r.cpu_us,
            r.busiest * 100.0,
            ceiling
        );
    }
}
