//! The Redis backend against a local `redis-server` started for the run (or the server at
//! `REDIS_URL`): round trips per acquisition, Redis CPU per call (`usec_per_call` of
//! `EVALSHA` in `INFO commandstats`), acquisitions per second at 1, 16 and 64 in flight,
//! the raw `SET` ceiling of the same server and connection kind in the same run, and a
//! cached refusal. Criterion measures the throughputs; a table with every number is
//! printed at the end.
//!
//! Targets: one round trip for any set in one slot; at most 6 us of Redis CPU
//! for a single GCRA limit and 15 us for three limits including a semaphore; zero round
//! trips for a cached refusal.
//!
//! Run: `cargo bench -p tower-limits-benches --bench redis`.

#![allow(clippy::print_stdout)] // the summary table is the point

use std::future::Future;
use std::hint::black_box;
use std::pin::pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use tokio::runtime::Runtime;
use tower_limits_core::{Backend, Instant, LimitPolicy, LimitSetPolicy, Quota, TenantKey, nz};
use tower_limits_redis::redis::{self, aio::MultiplexedConnection};
use tower_limits_redis::test_support::RedisServer;
use tower_limits_redis::{RedisBackend, RedisConnection};

const IN_FLIGHT: [usize; 3] = [1, 16, 64];
static NAMESPACES: AtomicU64 = AtomicU64::new(0);
const TENANTS: usize = 1_000;

struct Env {
    rt: Runtime,
    _server: Option<RedisServer>,
    url: String,
    conn: RedisConnection,
    raw: MultiplexedConnection,
}

fn env() -> Option<Env> {
    let (server, url) = match std::env::var("REDIS_URL") {
        Ok(url) if !url.is_empty() => (None, url),
        _ => match RedisServer::start() {
            Ok(s) => {
                let url = s.url();
                (Some(s), url)
            }
            Err(e) => {
                eprintln!("\n!!!!!!!! SKIPPED the redis bench: no redis-server ({e}) and REDIS_URL is not set\n");
                return None;
            }
        },
    };
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("a runtime");
    let (conn, raw) = rt.block_on(async {
        let conn = RedisConnection::connect(&url).await.expect("a connection");
        let raw = redis::Client::open(url.as_str())
            .expect("a url")
            .get_multiplexed_async_connection()
            .await
            .expect("a raw connection");
        (conn, raw)
    });
    Some(Env { rt, _server: server, url, conn, raw })
}

fn single_gcra() -> LimitSetPolicy {
    LimitSetPolicy::new()
        .tiers(["tenant"])
        .limit(LimitPolicy::gcra("requests", Quota::per_second(nz!(1_000_000)).burst(nz!(1_000_000_000))).per("tenant"))
}

fn backend(env: &Env, policy: LimitSetPolicy, name: &str) -> RedisBackend {
    RedisBackend::builder(policy)
        .namespace(format!("bench-{name}-{}-{}", std::process::id(), NAMESPACES.fetch_add(1, Ordering::Relaxed)))
        .timeout(Duration::from_secs(5))
        .max_leases(0) // permits are never released here; no renewal traffic either
        .build(&env.conn)
        .expect("a backend")
}

fn tenants(depth: usize) -> Arc<[TenantKey]> {
    (0..TENANTS)
        .map(|i| {
            let parts: Vec<String> = (0..depth).map(|d| format!("t{}-{d}", i / (d + 1))).collect();
            TenantKey::new(parts).expect("a key")
        })
        .collect()
}

/// `n` acquisitions with `in_flight` of them outstanding at any time; the time taken.
fn acquisitions(env: &Env, b: &RedisBackend, keys: &Arc<[TenantKey]>, in_flight: usize, n: u64) -> Duration {
    env.rt.block_on(async {
        let start = std::time::Instant::now();
        let tasks: Vec<_> = (0..in_flight)
            .map(|t| {
                let (b, keys) = (b.clone(), keys.clone());
                let per = n / in_flight as u64 + u64::from((t as u64) < n % in_flight as u64);
                tokio::spawn(async move {
                    for i in 0..per {
                        let key = &keys[(t * 7919 + i as usize) % keys.len()];
                        let grant = b.acquire(key, 1, Instant::ZERO).await.expect("granted");
                        black_box(&grant);
                    }
                })
            })
            .collect();
        for t in tasks {
            t.await.expect("a task");
        }
        start.elapsed()
    })
}

/// `n` raw `SET`s with `in_flight` outstanding; the time taken.
fn sets(env: &Env, in_flight: usize, n: u64) -> Duration {
    env.rt.block_on(async {
        let start = std::time::Instant::now();
        let tasks: Vec<_> = (0..in_flight)
            .map(|t| {
                let mut conn = env.raw.clone();
                let per = n / in_flight as u64 + u64::from((t as u64) < n % in_flight as u64);
                tokio::spawn(async move {
                    for i in 0..per {
                        let () = redis::cmd("SET")
                            .arg(format!("bench-set-{}", (t * 7919 + i as usize) % TENANTS))
                            .arg(i)
                            .query_async(&mut conn)
                            .await
                            .expect("SET");
                    }
                })
            })
            .collect();
        for t in tasks {
            t.await.expect("a task");
        }
        start.elapsed()
    })
}

/// The floor: a script that does nothing.
const EMPTY_SCRIPT: &str = "return 1";

/// What any GCRA script must do at least: read one key, write it with an expiry.
const GET_SET_SCRIPT: &str = "local v = redis.call('GET', KEYS[1])
redis.call('SET', KEYS[1], '1', 'PX', 1000)
return 1";

/// A well-known Lua GCRA (the script of the redis-gcra gem, with constants for this run):
/// the reference the issue's CPU targets are set against.
const KNOWN_GCRA_SCRIPT: &str = r#"redis.replicate_commands()
local rate_limit_key = KEYS[1]
local burst, rate, period, cost = 1000000000, 1000000, 1, 1
local emission_interval = period / rate
local increment = emission_interval * cost
local burst_offset = emission_interval * burst
local jan_1_2017 = 1483228800
local now = redis.call("TIME")
now = (now[1] - jan_1_2017) + (now[2] / 1000000)
local tat = redis.call("GET", rate_limit_key)
if not tat then tat = now else tat = tonumber(tat) end
tat = math.max(tat, now)
local new_tat = tat + increment
local allow_at = new_tat - burst_offset
local diff = now - allow_at
local remaining = diff / emission_interval
if remaining < 0 then
  return {0, 0, tostring(diff * -1), tostring(tat - now)}
end
local reset_after = new_tat - now
if reset_after > 0 then
  redis.call("SET", rate_limit_key, new_tat, "EX", math.ceil(reset_after))
end
return {cost, remaining, tostring(-1), tostring(reset_after)}"#;

/// Redis CPU per call (`usec_per_call` of each workload's command): the workloads take
/// turns for five rounds and each keeps its least, since on a shared machine the server's
/// own measure includes the time it was preempted; taking turns spreads that evenly.
fn cpu_table(env: &Env, workloads: &[(&str, &dyn Fn())]) -> Vec<f64> {
    let mut best = vec![f64::INFINITY; workloads.len()];
    for _ in 0..5 {
        for (i, (command, work)) in workloads.iter().enumerate() {
            reset_stats(env);
            work();
            best[i] = best[i].min(usec_per_call(env, command));
        }
    }
    best
}

/// Calls `source` 16 at a time on keys spread over the tenants.
fn script_runner<'a>(env: &'a Env, source: &str) -> impl Fn() + 'a {
    let sha: String = env.rt.block_on(async {
        let mut conn = env.raw.clone();
        redis::cmd("SCRIPT").arg("LOAD").arg(source).query_async(&mut conn).await.expect("SCRIPT LOAD")
    });
    move || {
        env.rt.block_on(async {
            let tasks: Vec<_> = (0..16u64)
                .map(|t| {
                    let (mut conn, sha) = (env.raw.clone(), sha.clone());
                    tokio::spawn(async move {
                        for i in 0..CPU_CALLS / 16 {
                            let key = format!("bench-baseline:{{t{}}}", (t * 7919 + i) % TENANTS as u64);
                            let _: redis::Value = redis::cmd("EVALSHA")
                                .arg(&sha)
                                .arg(1)
                                .arg(key)
                                .query_async(&mut conn)
                                .await
                                .expect("EVALSHA");
                        }
                    })
                })
                .collect();
            for t in tasks {
                t.await.expect("a task");
            }
        });
    }
}

/// Acquisitions of a fresh backend of `policy`, 16 at a time (semaphores here are never
/// released: a fresh namespace keeps their sorted sets at the size of a live service's).
fn acquire_runner<'a>(env: &'a Env, policy: LimitSetPolicy, keys: &'a Arc<[TenantKey]>) -> impl Fn() + 'a {
    move || {
        let fresh = backend(env, policy.clone(), "cpu");
        acquisitions(env, &fresh, keys, 1, 1);
        acquisitions(env, &fresh, keys, 16, CPU_CALLS);
    }
}

const CPU_CALLS: u64 = 16_000;

fn per_second(n: u64, d: Duration) -> f64 {
    n as f64 / d.as_secs_f64()
}

/// `usec_per_call` of `command` in `INFO commandstats` since the last `CONFIG RESETSTAT`.
fn usec_per_call(env: &Env, command: &str) -> f64 {
    env.rt.block_on(async {
        let mut conn = env.raw.clone();
        let info: String = redis::cmd("INFO").arg("commandstats").query_async(&mut conn).await.expect("INFO");
        let line = info.lines().find(|l| l.starts_with(&format!("cmdstat_{command}:"))).unwrap_or("");
        line.split(',').find_map(|f| f.strip_prefix("usec_per_call=")).and_then(|v| v.parse().ok()).unwrap_or(f64::NAN)
    })
}

fn reset_stats(env: &Env) {
    env.rt.block_on(async {
        let mut conn = env.raw.clone();
        let () = redis::cmd("CONFIG").arg("RESETSTAT").query_async(&mut conn).await.expect("RESETSTAT");
    });
}

fn server_version(env: &Env) -> String {
    env.rt.block_on(async {
        let mut conn = env.raw.clone();
        let info: String = redis::cmd("INFO").arg("server").query_async(&mut conn).await.expect("INFO");
        info.lines().find_map(|l| l.strip_prefix("redis_version:")).unwrap_or("?").trim().to_owned()
    })
}

struct Row {
    name: &'static str,
    round_trips: f64,
    cpu_us: f64,
    rates: Vec<f64>,
}

fn measure(env: &Env, name: &'static str, policy: &LimitSetPolicy, keys: &Arc<[TenantKey]>) -> Row {
    let b = backend(env, policy.clone(), "rt");
    // Warm up: the script is loaded, connections are up.
    acquisitions(env, &b, keys, 16, 2_000);
    let before = b.stats().round_trips;
    let n = 5_000;
    acquisitions(env, &b, keys, 1, n);
    let round_trips = (b.stats().round_trips - before) as f64 / n as f64;
    let rates = IN_FLIGHT.iter().map(|&k| per_second(20_000, acquisitions(env, &b, keys, k, 20_000))).collect();
    Row { name, round_trips, cpu_us: f64::NAN, rates }
}

fn redis_backend(c: &mut Criterion) {
    let Some(env) = env() else { return };
    let gcra = backend(&env, single_gcra(), "gcra");
    let three = backend(&env, tower_limits_benches::open_set_of_three(), "three");
    let (keys1, keys2) = (tenants(1), tenants(2));

    let mut group = c.benchmark_group("redis/acquire");
    group.throughput(Throughput::Elements(1)).sample_size(10).measurement_time(Duration::from_secs(3));
    for k in IN_FLIGHT {
        group.bench_function(format!("single_gcra/{k}_in_flight"), |bench| {
            bench.iter_custom(|iters| acquisitions(&env, &gcra, &keys1, k, iters))
        });
        group.bench_function(format!("three_limits/{k}_in_flight"), |bench| {
            bench.iter_custom(|iters| acquisitions(&env, &three, &keys2, k, iters))
        });
        group.bench_function(format!("raw_set/{k}_in_flight"), |bench| bench.iter_custom(|iters| sets(&env, k, iters)));
    }
    group.finish();

    // A refusal cached until its retry_after: answered at once, no round trip.
    let slow =
        backend(&env, LimitSetPolicy::new().limit(LimitPolicy::gcra("slow", Quota::per_hour(nz!(1)))), "refused");
    let global = TenantKey::global();
    env.rt.block_on(async {
        let _first = slow.acquire(&global, 1, Instant::ZERO).await;
        let _refused = slow.acquire(&global, 1, Instant::ZERO).await;
    });
    let before = slow.stats().round_trips;
    let cached = || {
        let acquire = pin!(slow.acquire(&global, 1, Instant::ZERO));
        match acquire.poll(&mut Context::from_waker(Waker::noop())) {
            Poll::Ready(r) => black_box(r.is_err()),
            Poll::Pending => panic!("a cached refusal waits for nothing"),
        }
    };
    c.bench_function("redis/cached_refusal", |bench| bench.iter(cached));
    let refusals = slow.stats().cached_refusals;
    let refusal_trips = (slow.stats().round_trips - before) as f64 / refusals.max(1) as f64;
    let refusal_ns = {
        let n = 100_000u32;
        let start = std::time::Instant::now();
        for _ in 0..n {
            cached();
        }
        start.elapsed().as_nanos() as f64 / f64::from(n)
    };

    let mut rows = [
        measure(&env, "single GCRA", &single_gcra(), &keys1),
        measure(&env, "3 limits incl. semaphore", &tower_limits_benches::open_set_of_three(), &keys2),
    ];
    let set_rates: Vec<f64> = IN_FLIGHT.iter().map(|&k| per_second(20_000, sets(&env, k, 20_000))).collect();
    let (ours1, ours3) = (
        acquire_runner(&env, single_gcra(), &keys1),
        acquire_runner(&env, tower_limits_benches::open_set_of_three(), &keys2),
    );
    let (empty, get_set, known) = (
        script_runner(&env, EMPTY_SCRIPT),
        script_runner(&env, GET_SET_SCRIPT),
        script_runner(&env, KNOWN_GCRA_SCRIPT),
    );
    let set = || {
        sets(&env, 16, CPU_CALLS);
    };
    let cpu = cpu_table(
        &env,
        &[
            ("evalsha", &ours1),
            ("evalsha", &ours3),
            ("set", &set),
            ("evalsha", &empty),
            ("evalsha", &get_set),
            ("evalsha", &known),
        ],
    );
    (rows[0].cpu_us, rows[1].cpu_us) = (cpu[0], cpu[1]);
    let set_cpu = cpu[2];
    let baselines = [("empty script", cpu[3]), ("GET + SET PX script", cpu[4]), ("well-known Lua GCRA", cpu[5])];

    println!("\nredis backend, redis-server {} at {}, tokio 2 workers", server_version(&env), env.url);
    println!(
        "{:<26} {:>14} {:>15} {:>12} {:>12} {:>12}",
        "", "round trips", "redis CPU", "acq/s @1", "acq/s @16", "acq/s @64"
    );
    for r in &rows {
        println!(
            "{:<26} {:>14.3} {:>12.2} us {:>12.0} {:>12.0} {:>12.0}",
            r.name, r.round_trips, r.cpu_us, r.rates[0], r.rates[1], r.rates[2]
        );
    }
    println!(
        "{:<26} {:>14.3} {:>12.2} us {:>12.0} {:>12.0} {:>12.0}",
        "raw SET (ceiling)", 1.0, set_cpu, set_rates[0], set_rates[1], set_rates[2]
    );
    println!("{:<26} {:>14.3} {:>15} {:>12.0} ns per refusal", "cached refusal", refusal_trips, "0 us", refusal_ns);
    for (name, cpu) in baselines {
        println!("{name:<26} {:>14} {cpu:>12.2} us   (Redis CPU of a reference script, same run)", "");
    }
    let known = baselines[2].1;
    for r in &rows {
        println!("{:<26} Redis CPU {:.2}x the well-known GCRA script's", r.name, r.cpu_us / known);
    }
    for (r, set) in rows.iter().zip([&set_rates, &set_rates]) {
        let ratios: Vec<String> = r.rates.iter().zip(set.iter()).map(|(a, s)| format!("{:.2}", a / s)).collect();
        println!("{:<26} of the SET ceiling at 1/16/64 in flight: {}", r.name, ratios.join(" / "));
    }
}

criterion_group!(benches, redis_backend);
criterion_main!(benches);
