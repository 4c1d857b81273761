//! What the fleet cost Redis: script calls and server CPU, per answer, read from the
//! server's own counters (`INFO commandstats`, `INFO cpu`) around the load, beside what
//! the server costs idle (its timers run whatever the load: about 1.5 ms of CPU a second
//! at the default `hz 10`, a floor that a fleet answering few requests a second sees in
//! every answer).

use std::time::{Duration, Instant};

use tower_limits_redis::redis::{self, aio::MultiplexedConnection};

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
    /// answer of the gateways.
    pub(super) async fn print(mut self, answers: u64) -> Result<(), tower::BoxError> {
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
        Ok(())
    }
}

/// The CPU the server has used since it started, user and system, in seconds.
async fn cpu_seconds(conn: &mut MultiplexedConnection) -> Result<f64, tower::BoxError> {
    let info: String = redis::cmd("INFO").arg("cpu").query_async(conn).await?;
    let field = |name: &str| {
        info.lines().find_map(|l| l.strip_prefix(name)).and_then(|v| v.trim().parse::<f64>().ok()).unwrap_or(0.0)
    };
    Ok(field("used_cpu_user:") + field("used_cpu_sys:"))
}
