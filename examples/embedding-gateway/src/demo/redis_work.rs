//! What the fleet cost Redis: script calls and server CPU, per answer, read from the
//! server's own counters (`INFO commandstats`, `INFO cpu`) around the load, beside what
//! the server costs idle (its timers run whatever the load: about 1.5 ms of CPU a second
//! at the default `hz 10`, a floor that a fleet answering few requests a second sees in
//! every answer); then the same calls replayed back to back, which is what they cost a
//! server kept busy (see [`super::redis_tap`]).

use std::sync::PoisonError;
use std::time::{Duration, Instant};

use tower_limits_redis::redis::{self, aio::MultiplexedConnection};

use super::redis_tap::Recorded;

/// How many calls the pipelined replay sends at once.
const DEPTH: usize = 32;

/// How long the idle server is watched before the load.
const IDLE: Duration = Duration::from_millis(500);

/// The server's counters when the load started.
pub(super) struct RedisWork {
    conn: MultiplexedConnection,
    cpu_seconds: f64,
    /// The idle server's CPU, seconds a second.
    idle: f64,
    started: Instant,
}

impl RedisWork {
    /// Watches the idle server's CPU for a moment (the replicas are built and idle), then
    /// resets the command statistics and reads the CPU the server has used so far.
    pub(super) async fn start(url: &str) -> Result<Self, tower::BoxError> {
        let mut conn = redis::Client::open(url)?.get_multiplexed_async_connection().await?;
        let before = cpu_seconds(&mut conn).await?;
        tokio::time::sleep(IDLE).await;
        let idle = ((cpu_seconds(&mut conn).await? - before) / IDLE.as_secs_f64()).max(0.0);
        let () = redis::cmd("CONFIG").arg("RESETSTAT").query_async(&mut conn).await?;
        let cpu_seconds = cpu_seconds(&mut conn).await?;
        Ok(RedisWork { conn, cpu_seconds, idle, started: Instant::now() })
    }

    /// Prints the script calls and the server CPU since [`RedisWork::start`], in all and per
    /// answer of the gateways; with the calls a tap `recorded` (keys under `namespace`),
    /// what they cost the same server replayed back to back.
    pub(super) async fn print(mut self, answers: u64, replay: Option<(Recorded, &str)>) -> Result<(), tower::BoxError> {
        let info: String = redis::cmd("INFO").arg("commandstats").query_async(&mut self.conn).await?;
        let (mut scripts, mut commands) = (0u64, Vec::new());
        for line in info.lines().filter_map(|l| l.strip_prefix("cmdstat_")) {
            let calls = line
                .split([':', ','])
                .find_map(|f| f.strip_prefix("calls="))
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0);
            let name = line.split(':').next().unwrap_or_default();
            if name.starts_with("eval") {
                scripts += calls;
            } else if name != "info" && name != "config" {
                commands.push((calls, name.to_owned()));
            }
        }
        commands.sort_unstable_by(|a, b| b.cmp(a));
        let others: Vec<String> = commands.iter().map(|(n, name)| format!("{n} {name}")).collect();
        let others = if others.is_empty() { "no other command".to_owned() } else { others.join(", ") };
        let cpu = cpu_seconds(&mut self.conn).await? - self.cpu_seconds;
        let idle = self.idle * self.started.elapsed().as_secs_f64();
        let per = |n: f64| n / answers.max(1) as f64;
        println!(
            "redis: {scripts} script calls for {answers} answers ({:.2} per answer), {:.0} ms of server CPU ({:.1} us per answer; the idle server's {:.1} ms/s included, {:.1} us per answer above it); {others}",
            per(scripts as f64),
            cpu * 1e3,
            per(cpu * 1e6),
            self.idle * 1e3,
            per((cpu - idle).max(0.0) * 1e6)
        );
        if let Some((recorded, namespace)) = replay {
            let calls = std::mem::take(&mut *recorded.lock().unwrap_or_else(PoisonError::into_inner));
            self.replay(&calls, namespace, answers).await?;
        }
        Ok(())
    }

    /// Sends `calls` again back to back with their keys under a namespace of their own
    /// (the run's state stays as it was): once one at a time, each call waiting for the
    /// one before (every call then pays the server's wake-up and its reads and writes),
    /// once pipelined [`DEPTH`] deep in the same order (as a server busy with many
    /// replicas' calls reads them). Prints the server CPU each took above the idle
    /// server's, per answer of the run.
    async fn replay(&mut self, calls: &[Vec<Vec<u8>>], namespace: &str, answers: u64) -> Result<(), tower::BoxError> {
        if calls.is_empty() {
            return Ok(());
        }
        let from = namespace.as_bytes();
        let mut per_answer = [0.0; 2];
        let mut failed = 0;
        for (round, depth) in [1, DEPTH].into_iter().enumerate() {
            let to = format!("{namespace}-replay{round}").into_bytes();
            let before = cpu_seconds(&mut self.conn).await?;
            let started = Instant::now();
            for chunk in calls.chunks(depth) {
                let mut pipe = redis::pipe();
                pipe.ignore_errors();
                for call in chunk {
                    // (EVALSHA, or EVAL where the script was not loaded yet.)
                    let name = call.first().and_then(|c| std::str::from_utf8(c).ok()).unwrap_or("EVALSHA");
                    let cmd = pipe.cmd(name);
                    for arg in call.iter().skip(1) {
                        cmd.arg(replace(arg, from, &to));
                    }
                }
                let answers: Vec<redis::RedisResult<redis::Value>> = pipe.query_async(&mut self.conn).await?;
                failed += answers.iter().filter(|a| a.is_err()).count();
            }
            let took = started.elapsed().as_secs_f64();
            let cpu = (cpu_seconds(&mut self.conn).await? - before - self.idle * took).max(0.0);
            per_answer[round] = cpu * 1e6 / answers.max(1) as f64;
        }
        println!(
            "redis, the run's {} script calls replayed back to back on the same server{}: {:.1} us of server CPU per answer one at a time, {:.1} us pipelined {DEPTH} deep (one core at that cost: {:.0} answers a second)",
            calls.len(),
            if failed > 0 { format!(" ({failed} failed)") } else { String::new() },
            per_answer[0],
            per_answer[1],
            1e6 / per_answer[1].max(0.001)
        );
        Ok(())
    }
}

/// `arg` with every `from` in it replaced by `to`.
fn replace(arg: &[u8], from: &[u8], to: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(arg.len());
    let mut at = 0;
    for found in memchr::memmem::find_iter(arg, from) {
        out.extend_from_slice(&arg[at..found]);
        out.extend_from_slice(to);
        at = found + from.len();
    }
    out.extend_from_slice(&arg[at..]);
    out
}

/// The CPU the server has used since it started, user and system, in seconds.
async fn cpu_seconds(conn: &mut MultiplexedConnection) -> Result<f64, tower::BoxError> {
    let info: String = redis::cmd("INFO").arg("cpu").query_async(conn).await?;
    let field = |name: &str| {
        info.lines().find_map(|l| l.strip_prefix(name)).and_then(|v| v.trim().parse::<f64>().ok()).unwrap_or(0.0)
    };
    Ok(field("used_cpu_user:") + field("used_cpu_sys:"))
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_namespace_is_replaced_wherever_it_occurs() {
        let arg = b"egw-1:pool:{accounts}:leases egw-1:x";
        assert_eq!(
            super::replace(arg, b"egw-1", b"egw-1-replay0"),
            b"egw-1-replay0:pool:{accounts}:leases egw-1-replay0:x"
        );
        assert_eq!(super::replace(b"none here", b"egw-1", b"y"), b"none here");
    }
}
