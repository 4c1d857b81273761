//! How the Redis work of capacity shares and account leases grows: the server's CPU a
//! second against the number of replicas at a fixed total request rate, and against the
//! request rate at a fixed number of replicas, beside the per-request paths at the same
//! rates. Replicas are tasks, each with its own backend and connection, sharing one
//! `redis-server` started for the run; each paces its share of the rate every
//! millisecond, every grant released. Two workloads: a set of a global rate, a rate per
//! user over 100 users and a semaphore per organisation (capacity shares; a scope a
//! replica sees fewer than `hot_after` times a refresh period, 4 in 100 ms, takes from the
//! pool, one call a request: the curves show where that begins), and a pool of two
//! upstream accounts shared by the fleet, each a request rate and a token rate, ten
//! tokens a request (account leases, refreshed every 100 ms). Server CPU is
//! `used_cpu_user + used_cpu_sys` of `INFO cpu` over one timed second, after a warm-up,
//! less the idle server's.
//!
//! Run: `cargo bench -p tower-limits-benches --bench shares_scaling`.

#![allow(clippy::print_stdout)] // the curves are the point

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant as StdInstant};

use tokio::runtime::Runtime;
use tower_limits_core::{
    Backend, Instant, LimitPolicy, LimitPool, LimitSet, LimitSetPolicy, Quota, Selection, TenantKey, nz,
};
use tower_limits_redis::redis::{self, aio::MultiplexedConnection};
use tower_limits_redis::test_support::RedisServer;
use tower_limits_redis::{AccountLeases, RedisAccounts, RedisBackend, RedisConnection, Shares};

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

/// What the replicas are, and whether they decide from what they hold.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// The set, per request or from capacity shares.
    Set { shares: bool },
    /// The pool of two shared accounts, per request or from leases.
    Accounts { leased: bool },
}

/// One replica: a backend of the set, or a pool over the shared accounts.
#[derive(Clone)]
enum Replica {
    Set(RedisBackend),
    Accounts(LimitPool),
}

/// An upstream account: 100,000 requests and 10,000,000 tokens a second.
fn account() -> LimitSetPolicy {
    LimitSetPolicy::new()
        .limit(LimitPolicy::gcra("rps", Quota::per_second(nz!(100_000)).burst(nz!(1_000))))
        .limit(LimitPolicy::token_bucket("tps", Quota::per_second(nz!(10_000_000)).burst(nz!(100_000))).counting_cost())
}

impl Replica {
    async fn build(kind: Kind, url: &str, ns: &str) -> Replica {
        let conn = RedisConnection::connect(url).await.expect("a connection");
        match kind {
            Kind::Set { shares } => {
                let builder = RedisBackend::builder(tower_limits_benches::open_global_user_org())
                    .namespace(ns)
                    .timeout(Duration::from_millis(200));
                let builder = if shares { builder.shares(Shares::new()) } else { builder };
                Replica::Set(builder.build(&conn).expect("a backend"))
            }
            Kind::Accounts { leased } => {
                let mut store = RedisAccounts::builder("accounts").namespace(ns).timeout(Duration::from_millis(200));
                let mut pool = LimitPool::builder(Selection::MostHeadroom);
                for name in ["primary", "secondary"] {
                    store = store.member(name, account());
                    pool = pool.member(name, LimitSet::new(account()).expect("a set"), ());
                }
                if leased {
                    store = store.leases(AccountLeases::new());
                }
                let store = store.build(&conn).expect("the accounts");
                Replica::Accounts(pool.shared(Arc::new(store)).build().expect("a pool"))
            }
        }
    }

    /// One request (of ten tokens, to the accounts), released when granted.
    async fn ask(&self, key: &TenantKey, now: Instant) {
        match self {
            Replica::Set(b) => {
                if let Ok(grant) = b.acquire(key, 1, now).await {
                    b.release(key, grant);
                }
            }
            Replica::Accounts(pool) => {
                let key = TenantKey::global();
                if let Ok(grant) = Backend::acquire(pool, &key, 10, now).await {
                    Backend::release(pool, &key, grant);
                }
            }
        }
    }

    async fn flush(&self) {
        if let Replica::Set(b) = self {
            b.flush().await;
        }
    }
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
    fn measure(&self, kind: Kind, replicas: usize, rate: u64, idle_cpu_ms: f64) -> Cost {
        static RUNS: AtomicU64 = AtomicU64::new(0);
        let ns = format!("scaling-{}", RUNS.fetch_add(1, Ordering::Relaxed));
        let backends: Vec<Replica> = self.rt.block_on(async {
            let mut backends = Vec::new();
            for _ in 0..replicas {
                backends.push(Replica::build(kind, &self.url, &ns).await);
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
                                    b.ask(key, now).await;
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

fn row(what: &str, held: &str, shared: &Cost, per_request: Option<&Cost>) {
    let per = per_request
        .map_or_else(String::new, |p| format!("  | per request: {:7.1} ms/s, {:8.0} calls/s", p.cpu_ms, p.calls));
    println!(
        "{what:<24} {:9.0} req/s | {held}: {:6.1} ms/s, {:6.0} calls/s, {:5.3} us per request{per}",
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
    let workloads = [
        ("the set (capacity shares)", "shares", Kind::Set { shares: true }, Kind::Set { shares: false }),
        ("two shared accounts (leases)", "leases", Kind::Accounts { leased: true }, Kind::Accounts { leased: false }),
    ];
    for (what, held, holding, per) in workloads {
        println!("{what}, at 20,000 requests a second in all, by replicas:");
        for replicas in [1, 3, 10, 30] {
            let shared = run.measure(holding, replicas, 20_000, idle);
            let per_request = (replicas == 3).then(|| run.measure(per, replicas, 20_000, idle));
            row(&format!("  {replicas} replicas"), held, &shared, per_request.as_ref());
        }
        println!("{what}, at 3 replicas, by the request rate:");
        for rate in [2_000, 10_000, 40_000] {
            let shared = run.measure(holding, 3, rate, idle);
            let per_request = run.measure(per, 3, rate, idle);
            row(&format!("  {rate} req/s"), held, &shared, Some(&per_request));
        }
    }
    drop(server);
}
