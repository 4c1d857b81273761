//! How the Redis work of capacity shares grows: the server's CPU a second against the
//! number of replicas at a fixed total request rate, and against the request rate at a
//! fixed number of replicas, beside the per-request path at the same rates. Replicas are
//! tasks, each with its own backend and connection, sharing one `redis-server` started for
//! the run; each paces its share of the rate every millisecond, for a set of a global
//! rate, a rate per user over 100 users and a semaphore per organisation, every grant
//! released. A scope a replica sees fewer than `hot_after` times a refresh period (4 in
//! 100 ms) takes from the pool, one call a request: the curves show where that begins. Server CPU is `used_cpu_user + used_cpu_sys` of `INFO cpu` over one timed
//! second, after a warm-up, less the idle server's.
//!
//! Run: `cargo bench -p tower-limits-benches --bench shares_scaling`.

#![allow(clippy::print_stdout)] // the curves are the point

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant as StdInstant};

use tokio::runtime::Runtime;
use tower_limits_core::{Backend, Instant, TenantKey};
use tower_limits_redis::redis::{self, aio::MultiplexedConnection};
use tower_limits_redis::test_support::RedisServer;
use tower_limits_redis::{RedisBackend, RedisConnection, Shares};

const WARM: Duration = Duration::from_millis(500);
/// Users (ten to an organisation): at 20,000 requests a second, 200 a second each.
const USERS: usize = 100;
const TIMED: Duration = Duration::from_secs(1);

struct Run {
    rt: Runtime,
    url: String,
    admin: MultiplexedConnection,
    keys: Arc<[TenantKey]>,
    origin: StdInstant,
}

/// What one configuration cost: Redis CPU in ms a second, script calls a second, and the
/// requests a second the replicas made.
struct Cost {
    cpu_ms: f64,
    calls: f64,
    requests: f64,
}

impl Run {
    fn cpu_seconds(&self) -> f64 {
        let info: String =
            self.rt.block_on(redis::cmd("INFO").arg("cpu").query_async(&mut self.admin.clone())).expect("INFO cpu");
        let field = |name: &str| {
            info.lines().find_map(|l| l.strip_prefix(name)).and_then(|v| v.trim().parse::<f64>().ok()).unwrap_or(0.0)
        };
        field("used_cpu_user:") + field("used_cpu_sys:")
    }

    fn script_calls(&self) -> f64 {
        let info: String = self
            .rt
            .block_on(redis::cmd("INFO").arg("commandstats").query_async(&mut self.admin.clone()))
            .expect("INFO commandstats");
        info.lines()
            .filter(|l| l.starts_with("cmdstat_eval"))
            .filter_map(|l| l.split([':', ',']).find_map(|f| f.strip_prefix("calls=")))
            .filter_map(|v| v.parse::<f64>().ok())
            .sum()
    }

    /// `replicas` backends pacing `rate` requests a second between them.
    fn measure(&self, replicas: usize, rate: u64, shares: bool, idle_cpu_ms: f64) -> Cost {
        static RUNS: AtomicU64 = AtomicU64::new(0);
        let ns = format!("scaling-{}", RUNS.fetch_add(1, Ordering::Relaxed));
        let backends: Vec<RedisBackend> = self.rt.block_on(async {
            let mut backends = Vec::new();
            for _ in 0..replicas {
                let conn = RedisConnection::connect(&self.url).await.expect("a connection");
                let builder = RedisBackend::builder(tower_limits_benches::open_global_user_org())
                    .namespace(&ns)
                    .timeout(Duration::from_millis(200));
                let builder = if shares { builder.shares(Shares::new()) } else { builder };
                backends.push(builder.build(&conn).expect("a backend"));
            }
            backends
        });
        let requests = Arc::new(AtomicU64::new(0));
        let drive = |length: Duration| {
            let per_ms = rate as f64 / replicas as f64 / 1_000.0;
            self.rt.block_on(async {
                let start = StdInstant::now();
                let tasks: Vec<_> = backends
                    .iter()
                    .enumerate()
                    .map(|(r, b)| {
                        let (b, keys, requests, origin) = (b.clone(), self.keys.clone(), requests.clone(), self.origin);
                        tokio::spawn(async move {
                            let mut tick = tokio::time::interval(Duration::from_millis(1));
                            let (mut owed, mut i) = (0.0, r * 7919);
                            while start.elapsed() < length {
                                tick.tick().await;
                                owed += per_ms;
                                while owed >= 1.0 {
                                    owed -= 1.0;
                                    i += 1;
                                    let key = &keys[i % keys.len()];
                                    let now = Instant::from_nanos(origin.elapsed().as_nanos() as u64);
                                    if let Ok(grant) = b.acquire(key, 1, now).await {
                                        b.release(key, grant);
                                    }
                                    requests.fetch_add(1, Ordering::Relaxed);
                                }
                            }
                        })
                    })
                    .collect();
                for t in tasks {
                    t.await.expect("a replica");
                }
            });
        };
        drive(WARM);
        let (cpu, calls) = (self.cpu_seconds(), self.script_calls());
        requests.store(0, Ordering::Relaxed);
        let start = StdInstant::now();
        drive(TIMED);
        let elapsed = start.elapsed().as_secs_f64();
        for b in &backends {
            self.rt.block_on(b.flush());
        }
        let cpu_ms = (self.cpu_seconds() - cpu) * 1e3 / elapsed - idle_cpu_ms;
        Cost {
            cpu_ms: cpu_ms.max(0.0),
            calls: (self.script_calls() - calls) / elapsed,
            requests: requests.load(Ordering::Relaxed) as f64 / elapsed,
        }
    }
}

fn row(what: &str, shared: &Cost, per_request: Option<&Cost>) {
    let per = per_request
        .map_or_else(String::new, |p| format!("  | per request: {:7.1} ms/s, {:8.0} calls/s", p.cpu_ms, p.calls));
    println!(
        "{what:<24} {:9.0} req/s | shares: {:6.1} ms/s, {:6.0} calls/s, {:5.3} us per request{per}",
        shared.requests,
        shared.cpu_ms,
        shared.calls,
        shared.cpu_ms * 1e3 / shared.requests.max(1.0)
    );
}

fn main() {
    let server = match RedisServer::start() {
        Ok(server) => server,
        Err(e) => {
            eprintln!("shares_scaling: skipped, no redis-server ({e})");
            return;
        }
    };
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("a runtime");
    let url = server.url();
    let admin = rt
        .block_on(async { redis::Client::open(url.as_str())?.get_multiplexed_async_connection().await })
        .expect("an admin connection");
    let keys: Arc<[TenantKey]> =
        (0..USERS).map(|i| TenantKey::new([format!("org-{}", i / 10), format!("user-{i}")]).expect("key")).collect();
    let run = Run { rt, url, admin, keys, origin: StdInstant::now() };
    let idle = {
        let before = run.cpu_seconds();
        std::thread::sleep(TIMED);
        (run.cpu_seconds() - before) * 1e3
    };
    println!("shares_scaling: Redis CPU a second (idle server's {idle:.1} ms/s subtracted), 1 s timed after {WARM:?}");
    println!("at 20,000 requests a second in all, by replicas:");
    for replicas in [1, 3, 10, 30] {
        let shared = run.measure(replicas, 20_000, true, idle);
        let per_request = (replicas == 3).then(|| run.measure(replicas, 20_000, false, idle));
        row(&format!("  {replicas} replicas"), &shared, per_request.as_ref());
    }
    println!("at 3 replicas, by the request rate:");
    for rate in [2_000, 10_000, 40_000] {
        let shared = run.measure(3, rate, true, idle);
        let per_request = run.measure(3, rate, false, idle);
        row(&format!("  {rate} req/s"), &shared, Some(&per_request));
    }
    drop(server);
}
