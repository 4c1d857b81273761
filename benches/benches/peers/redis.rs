//! The Redis backend, against a `redis-server` started for the run, skipped without one
//! (group `redis`): a set of three limits against a single GCRA, 64 acquisitions in
//! flight on one connection (throughput), and the server CPU per call of our three-limit
//! script against a plain hand-written script over the same three keys, for acquisitions
//! alone and for whole requests; and a set of three (a global rate, a rate per user, a
//! semaphore per organisation) decided from capacity shares against the same set decided
//! per request, in throughput and in server CPU per admitted request.

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant as StdInstant};

use tokio::runtime::Runtime;
use tower_limits_core::{Backend, LimitPolicy, LimitSetPolicy, Quota, TenantKey, nz};
use tower_limits_redis::redis::{self, aio::MultiplexedConnection};
use tower_limits_redis::test_support::RedisServer;
use tower_limits_redis::{RedisBackend, RedisConnection, Shares};

use crate::table::{ROUNDS, Row};

/// Calls in flight at once on one connection in the Redis rows.
const IN_FLIGHT: usize = 64;
/// Calls per measurement in the Redis rows.
const CALLS: u64 = 6_400;
/// How long the shares rows call untimed (shares are granted within two refresh
/// periods), then timed (ten refresh periods).
const WARM: Duration = Duration::from_millis(300);
const TIMED: Duration = Duration::from_secs(1);

/// The Redis rows, in the order of the table: throughput, server CPU per acquisition (and
/// its ceiling), server CPU per whole request.
pub(crate) fn rows(rows: &mut Vec<Row>) {
    let server = match RedisServer::start() {
        Ok(server) => server,
        Err(e) => {
            eprintln!("peers: Redis rows skipped (no redis-server: {e})");
            return;
        }
    };
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    let url = server.url();
    let conn = rt.block_on(RedisConnection::connect(&url)).expect("a connection");
    let raw = rt
        .block_on(async { redis::Client::open(url.as_str())?.get_multiplexed_async_connection().await })
        .expect("a raw connection");
    let keys: Arc<[TenantKey]> =
        (0..1_000).map(|i| TenantKey::new([format!("org-{}", i / 10), format!("user-{i}")]).expect("key")).collect();
    let bench = Bench { rt, conn, raw, keys };
    let single = bench.backend(
        LimitSetPolicy::new().tiers(["org", "user"]).limit(
            LimitPolicy::gcra("requests", Quota::per_second(nz!(1_000_000)).burst(nz!(1_000_000_000))).per("user"),
        ),
        "single",
    );
    let three = bench.backend(tower_limits_benches::open_set_of_three(), "three");
    rows.push(bench.throughput_row(&three, &single));
    let sha: String = bench
        .rt
        .block_on(redis::cmd("SCRIPT").arg("LOAD").arg(PLAIN_THREE_KEYS).query_async(&mut bench.raw.clone()))
        .expect("SCRIPT LOAD");
    rows.extend(bench.cpu_rows(&three, &single, &sha));
    // A backend of its own: the rows above never release, and their semaphores' sets hold
    // every grant they made for a lease, which makes each write to them dearer than in a
    // service, where a set holds only the requests in flight.
    let three = bench.backend(tower_limits_benches::open_set_of_three(), "three-released");
    rows.push(bench.release_row(&three, &sha));
    let per_request = bench.backend(tower_limits_benches::open_global_user_org(), "set-per-request");
    let shared = bench.backend_with(tower_limits_benches::open_global_user_org(), "set-shared", |b| {
        b.timeout(Duration::from_millis(200)).shares(Shares::new())
    });
    rows.extend(bench.shares_rows(&shared, &per_request));
    drop(server);
}

/// What the Redis rows share: a runtime, our connection and a raw one to the same
/// server, and the 1,000 keys (100 organisations of 10 users) every row steps through.
struct Bench {
    rt: Runtime,
    conn: RedisConnection,
    raw: MultiplexedConnection,
    keys: Arc<[TenantKey]>,
}

impl Bench {
    fn backend(&self, policy: LimitSetPolicy, name: &str) -> RedisBackend {
        self.backend_with(policy, name, |b| b)
    }

    fn backend_with(
        &self,
        policy: LimitSetPolicy,
        name: &str,
        more: impl FnOnce(tower_limits_redis::RedisBackendBuilder) -> tower_limits_redis::RedisBackendBuilder,
    ) -> RedisBackend {
        let builder = RedisBackend::builder(policy)
            .namespace(format!("peers-{name}"))
            .timeout(Duration::from_secs(5))
            .max_leases(0)
            // Neither side reports the limits' states (nor does the plain script).
            .peek_cache(0);
        // The shares' lifetime must outlast two refreshes and the timeout.
        more(builder).build(&self.conn).expect("a backend")
    }

    /// Acquisitions through `b` with the clock running, [`IN_FLIGHT`] at once: for
    /// `WARM` untimed (long enough for shares to be granted), then for `TIMED`, over
    /// several refresh periods. Answers thousands of acquisitions a second and the
    /// server's CPU per admitted one.
    fn sustained(&self, b: &RedisBackend) -> (f64, f64) {
        use std::sync::atomic::{AtomicU64, Ordering};
        // One clock for every run: a backend's instants never go back.
        static ORIGIN: std::sync::OnceLock<StdInstant> = std::sync::OnceLock::new();
        let origin = *ORIGIN.get_or_init(StdInstant::now);
        let run = |length: Duration| {
            let (calls, admitted) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
            let start = StdInstant::now();
            self.rt.block_on(async {
                let tasks: Vec<_> = (0..IN_FLIGHT)
                    .map(|t| {
                        let (b, keys) = (b.clone(), self.keys.clone());
                        let (calls, admitted) = (calls.clone(), admitted.clone());
                        tokio::spawn(async move {
                            let mut i = 0;
                            while start.elapsed() < length {
                                let key = &keys[(t * 7919 + i) % keys.len()];
                                i += 1;
                                let now = tower_limits_core::Instant::from_nanos(origin.elapsed().as_nanos() as u64);
                                if let Ok(grant) = b.acquire(key, 1, now).await {
                                    admitted.fetch_add(1, Ordering::Relaxed);
                                    b.release(key, grant);
                                }
                                calls.fetch_add(1, Ordering::Relaxed);
                            }
                        })
                    })
                    .collect();
                for t in tasks {
                    t.await.expect("a task");
                }
            });
            let elapsed = start.elapsed().as_secs_f64();
            (calls.load(Ordering::Relaxed) as f64 / elapsed / 1e3, admitted.load(Ordering::Relaxed).max(1) as f64)
        };
        run(WARM);
        self.rt.block_on(b.flush());
        self.reset();
        let (speed, admitted) = run(TIMED);
        self.rt.block_on(b.flush());
        let info: String =
            self.rt.block_on(redis::cmd("INFO").arg("commandstats").query_async(&mut self.raw.clone())).expect("INFO");
        // Every command the run sent: scripts, and the releases' plain `ZREM`s.
        let usec: f64 = info
            .lines()
            .filter(|l| l.starts_with("cmdstat_") && !l.starts_with("cmdstat_info") && !l.starts_with("cmdstat_config"))
            .filter_map(|l| l.split([':', ',']).find_map(|f| f.strip_prefix("usec=")))
            .filter_map(|v| v.parse::<f64>().ok())
            .sum();
        (speed, usec / admitted)
    }

    /// A global rate, a rate per user over 1,000 users and a semaphore per organisation,
    /// decided from capacity shares against the same set decided per request,
    /// interleaved; every grant is released.
    fn shares_rows(&self, shared: &RedisBackend, per_request: &RedisBackend) -> [Row; 2] {
        let mut speed =
            Row::new(format!("Redis, {IN_FLIGHT} in flight: 3 limits, shares / per request kop/s"), "kop/s");
        let mut cpu = Row::new("Redis CPU per admitted request: 3 limits, shares / per request", "us");
        for round in 0..ROUNDS {
            let (ours, theirs) = if round % 2 == 0 {
                let ours = self.sustained(shared);
                (ours, self.sustained(per_request))
            } else {
                let theirs = self.sustained(per_request);
                (self.sustained(shared), theirs)
            };
            speed.ours.push(ours.0);
            speed.theirs.push(theirs.0);
            cpu.ours.push(ours.1);
            cpu.theirs.push(theirs.1);
        }
        [speed, cpu]
    }

    /// Thousands of acquisitions a second through `b`, [`IN_FLIGHT`] at once.
    fn throughput(&self, b: &RedisBackend) -> f64 {
        in_flight(&self.rt, &self.keys, b, |b, key| async move {
            black_box(b.acquire(&key, 1, tower_limits_core::Instant::ZERO).await.is_ok());
        })
    }

    /// Throughput of the set of three over a single GCRA's, interleaved over the rounds.
    fn throughput_row(&self, three: &RedisBackend, single: &RedisBackend) -> Row {
        let mut row = Row::new(format!("Redis, {IN_FLIGHT} in flight: 3 limits / 1 GCRA kop/s"), "kop/s");
        for round in 0..ROUNDS {
            if round % 2 == 0 {
                row.ours.push(self.throughput(three));
                row.theirs.push(self.throughput(single));
            } else {
                row.theirs.push(self.throughput(single));
                row.ours.push(self.throughput(three));
            }
        }
        row
    }

    /// The server's CPU per call over the top-level commands named (none of which the
    /// scripts call inside), since the last [`Bench::reset`].
    fn usec_per_call(&self, commands: &[&str]) -> f64 {
        let info: String =
            self.rt.block_on(redis::cmd("INFO").arg("commandstats").query_async(&mut self.raw.clone())).expect("INFO");
        let field = |line: &str, name: &str| -> f64 {
            line.split([':', ',']).find_map(|f| f.strip_prefix(name)).and_then(|v| v.parse().ok()).unwrap_or(0.0)
        };
        let (usec, calls) = info
            .lines()
            .filter(|l| {
                commands.iter().any(|c| l.strip_prefix("cmdstat_").is_some_and(|r| r.starts_with(&format!("{c}:"))))
            })
            .fold((0.0, 0.0), |(u, c), l| (u + field(l, "usec="), c + field(l, "calls=")));
        usec / calls
    }

    /// Clears the server's command statistics.
    fn reset(&self) {
        let () = self
            .rt
            .block_on(redis::cmd("CONFIG").arg("RESETSTAT").query_async(&mut self.raw.clone()))
            .expect("RESETSTAT");
    }

    /// Server CPU per call: ours (three limits) against a plain script over three keys;
    /// and our single GCRA's against the same plain script: with the server's CPU the
    /// bottleneck (one connection, 64 in flight), this ratio is the most the throughput
    /// row can reach, whatever three limits cost beyond the plain script.
    fn cpu_rows(&self, three: &RedisBackend, single: &RedisBackend, sha: &str) -> [Row; 2] {
        let mut row = Row::new("Redis CPU per call: 3 limits / plain 3-key script", "us");
        let mut bound = Row::new("Redis CPU per call: 1 GCRA / plain 3-key script (the ceiling)", "us");
        for round in 0..ROUNDS {
            self.reset();
            self.throughput(three);
            let ours = self.usec_per_call(&["evalsha"]);
            self.reset();
            self.throughput(single);
            let one = self.usec_per_call(&["evalsha"]);
            self.reset();
            // The same load as ours: 64 calls in flight on one connection (a server that
            // sleeps between calls pays some 30% more CPU for each).
            let state = (self.raw.clone(), sha.to_owned());
            in_flight(&self.rt, &self.keys, &state, move |(mut raw, sha), key| async move {
                plain_acquire(&mut raw, &sha, &key, round).await;
            });
            let plain = self.usec_per_call(&["evalsha"]);
            row.ours.push(ours);
            row.theirs.push(plain);
            bound.ours.push(one);
            bound.theirs.push(plain);
        }
        [row, bound]
    }

    /// A whole request: the acquisition and, once it is done, the release of its
    /// semaphore: ours a `ZREM` of the grant's member (the set's one semaphore counts
    /// requests), the plain side's a `DECR`, each a plain command. Two calls a request on
    /// each side, so the ratio per call is the ratio per request.
    fn release_row(&self, three: &RedisBackend, sha: &str) -> Row {
        let keys = &self.keys;
        let mut row = Row::new("Redis CPU per call, acquire + release: 3 limits / plain", "us");
        for round in 0..ROUNDS {
            self.reset();
            self.rt.block_on(async {
                for i in 0..CALLS {
                    let key = &keys[(i as usize * 7919) % keys.len()];
                    if let Ok(grant) = three.acquire(key, 1, tower_limits_core::Instant::ZERO).await {
                        three.release(key, grant);
                    }
                }
                three.flush().await;
            });
            let ours = self.usec_per_call(&["evalsha", "zrem"]);
            self.reset();
            self.rt.block_on(async {
                for i in 0..CALLS {
                    let key = &keys[(i as usize * 7919) % keys.len()];
                    let held = plain_acquire(&mut self.raw.clone(), sha, key, round).await;
                    let _: redis::Value =
                        redis::cmd("DECR").arg(&held).query_async(&mut self.raw.clone()).await.expect("DECR");
                }
            });
            row.ours.push(ours);
            row.theirs.push(self.usec_per_call(&["evalsha", "decr"]));
        }
        row
    }
}

/// `CALLS` calls of `call`, `IN_FLIGHT` at once (each task stepping through `keys` 7,919
/// places at a time, from its own start), each given its own clone of `state`; returns
/// thousands of calls per second.
fn in_flight<S, F, Fut>(rt: &Runtime, keys: &Arc<[TenantKey]>, state: &S, call: F) -> f64
where
    S: Clone + Send + 'static,
    F: Fn(S, TenantKey) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    rt.block_on(async {
        let start = StdInstant::now();
        let tasks: Vec<_> = (0..IN_FLIGHT)
            .map(|t| {
                let (state, keys, call) = (state.clone(), keys.clone(), call.clone());
                tokio::spawn(async move {
                    for i in 0..CALLS / IN_FLIGHT as u64 {
                        call(state.clone(), keys[(t * 7919 + i as usize) % keys.len()].clone()).await;
                    }
                })
            })
            .collect();
        for t in tasks {
            t.await.expect("a task");
        }
        CALLS as f64 / start.elapsed().as_secs_f64() / 1e3
    })
}

/// One acquisition through the plain script for `key`; returns the key of its counter.
async fn plain_acquire(raw: &mut MultiplexedConnection, sha: &str, key: &TenantKey, round: usize) -> String {
    let text = |i| key.part(i).map(|p| p.to_string()).unwrap_or_default();
    let (org, user) = (text(0), text(1));
    let held = format!("plain:{{{org}}}:s");
    let _: redis::Value = redis::cmd("EVALSHA")
        .arg(sha)
        .arg(3)
        .arg(format!("plain:{{{org}}}:{user}:g"))
        .arg(format!("plain:{{{org}}}:t"))
        .arg(&held)
        .arg(round)
        .query_async(raw)
        .await
        .expect("EVALSHA");
    held
}

/// A plain hand-written script over three keys: a GCRA, a token bucket and a semaphore
/// count, each read, decided and written with an expiry; the floor any 3-limit script
/// pays for its keys.
const PLAIN_THREE_KEYS: &str = r#"local t = redis.call('TIME')
local now = t[1] * 1000000 + t[2]
local tat = tonumber(redis.call('GET', KEYS[1]) or now)
if tat < now then tat = now end
local new_tat = tat + 1
if new_tat - now > 1000000000 then return {0, 1} end
redis.call('SET', KEYS[1], new_tat, 'PX', 60000)
local b = redis.call('HMGET', KEYS[2], 'tokens', 'at')
local tokens = tonumber(b[1] or 1000000000)
local at = tonumber(b[2] or now)
tokens = math.min(1000000000, tokens + (now - at))
if tokens < 1 then return {0, 2} end
redis.call('HSET', KEYS[2], 'tokens', tokens - 1, 'at', now)
redis.call('PEXPIRE', KEYS[2], 60000)
local held = redis.call('INCR', KEYS[3])
redis.call('PEXPIRE', KEYS[3], 60000)
if held > 1000000000 then redis.call('DECR', KEYS[3]) return {0, 3} end
return {1, 0}"#;
