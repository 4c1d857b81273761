//! The load generator, its measurements and the table they make.

use super::*;

/// One target: where it listens, its process, and the keys its load sends.
#[derive(Debug, Clone)]
pub(super) struct Target {
    pub(super) name: &'static str,
    pub(super) addr: SocketAddr,
    pub(super) pid: u32,
    pub(super) keys: Vec<String>,
}

/// What one connection of the load saw.
#[derive(Debug, Default)]
pub(super) struct ConnectionResult {
    /// Latencies of the requests sent and answered within the measurement, in ns.
    pub(super) latencies: Vec<u64>,
    /// Answers by status, warm-up included.
    pub(super) statuses: BTreeMap<u16, u64>,
    /// Transport errors.
    pub(super) errors: Vec<String>,
}

/// One target's measurement in one round.
#[derive(Debug, Clone)]
pub(super) struct Sample {
    pub(super) per_second: f64,
    pub(super) cpu_us: f64,
    pub(super) upstream_cpu_us: f64,
    pub(super) p50_us: f64,
    pub(super) p99_us: f64,
}

/// The `p`-quantile of `sorted` (nearest rank), in µs.
pub(super) fn quantile_us(sorted: &[u64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1] as f64 / 1000.0
}

/// One connection of the load: requests back to back from its start until `until`; only
/// those sent at `from` or later and answered by `until` are measured.
pub(super) async fn load_connection(
    addr: SocketAddr,
    key: String,
    body: Bytes,
    from: Instant,
    until: Instant,
) -> ConnectionResult {
    let mut out = ConnectionResult::default();
    let stream = match TcpStream::connect(addr).await {
        Ok(s) => s,
        Err(e) => {
            out.errors.push(format!("connect: {e}"));
            return out;
        }
    };
    let _ = stream.set_nodelay(true);
    let (mut sender, connection) = match hyper::client::conn::http1::handshake(TokioIo::new(stream)).await {
        Ok(pair) => pair,
        Err(e) => {
            out.errors.push(format!("handshake: {e}"));
            return out;
        }
    };
    tokio::spawn(connection);
    let host = addr.to_string();
    let bearer = format!("Bearer {key}");
    loop {
        let sent = Instant::now();
        if sent >= until {
            break;
        }
        let request = Request::post("/v1/embeddings")
            .header(header::HOST, &host)
            .header(header::AUTHORIZATION, &bearer)
            .header(header::CONTENT_TYPE, "application/json")
            .body(Full::new(body.clone()));
        let request = match request {
            Ok(r) => r,
            Err(e) => {
                out.errors.push(format!("request: {e}"));
                break;
            }
        };
        if let Err(e) = sender.ready().await {
            out.errors.push(format!("connection: {e}"));
            break;
        }
        let answer = match sender.send_request(request).await {
            Ok(r) => r,
            Err(e) => {
                out.errors.push(format!("request: {e}"));
                break;
            }
        };
        let status = answer.status();
        if let Err(e) = answer.into_body().collect().await {
            out.errors.push(format!("body: {e}"));
            break;
        }
        let done = Instant::now();
        *out.statuses.entry(status.as_u16()).or_default() += 1;
        if status == StatusCode::OK && sent >= from && done <= until {
            out.latencies.push(u64::try_from((done - sent).as_nanos()).unwrap_or(u64::MAX));
        }
    }
    out
}

/// What one target's round gave, and what went wrong.
pub(super) struct Round {
    pub(super) sample: Sample,
    pub(super) statuses: BTreeMap<u16, u64>,
    pub(super) errors: Vec<String>,
}

/// Drives `target` for the warm-up and then `seconds`, measuring the second part.
pub(super) async fn drive(
    target: &Target,
    upstream_pid: u32,
    body: &Bytes,
    connections: usize,
    seconds: u64,
    ticks: u64,
) -> Result<Round, BoxError> {
    let from = Instant::now() + WARM_UP;
    let until = from + Duration::from_secs(seconds);
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..connections {
        let key = target.keys[i % target.keys.len()].clone();
        tasks.spawn(load_connection(target.addr, key, body.clone(), from, until));
    }
    tokio::time::sleep_until(from).await;
    let (cpu0, up0) = (cpu_ticks(target.pid)?, cpu_ticks(upstream_pid)?);
    let started = Instant::now();
    tokio::time::sleep_until(until).await;
    let (cpu1, up1) = (cpu_ticks(target.pid)?, cpu_ticks(upstream_pid)?);
    let elapsed = started.elapsed().as_secs_f64();
    let mut latencies = Vec::new();
    let mut statuses = BTreeMap::new();
    let mut errors = Vec::new();
    while let Some(joined) = tasks.join_next().await {
        let c = joined.map_err(|e| format!("a load connection failed: {e}"))?;
        latencies.extend(c.latencies);
        for (status, n) in c.statuses {
            *statuses.entry(status).or_insert(0) += n;
        }
        errors.extend(c.errors);
    }
    latencies.sort_unstable();
    let n = latencies.len().max(1) as f64;
    let us_per_tick = 1e6 / ticks as f64;
    let sample = Sample {
        per_second: latencies.len() as f64 / elapsed,
        cpu_us: cpu1.saturating_sub(cpu0) as f64 * us_per_tick / n,
        upstream_cpu_us: up1.saturating_sub(up0) as f64 * us_per_tick / n,
        p50_us: quantile_us(&latencies, 0.50),
        p99_us: quantile_us(&latencies, 0.99),
    };
    Ok(Round { sample, statuses, errors })
}

/// Min, median and max of `values` (the median of an even count: the mean of the middle
/// two).
pub(super) fn spread(values: &[f64]) -> (f64, f64, f64) {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| !x.is_nan()).collect();
    if v.is_empty() {
        return (f64::NAN, f64::NAN, f64::NAN);
    }
    v.sort_by(f64::total_cmp);
    let mid = v.len() / 2;
    let median = if v.len() % 2 == 0 { f64::midpoint(v[mid - 1], v[mid]) } else { v[mid] };
    (v[0], median, v[v.len() - 1])
}

pub(super) fn cell(values: &[f64], decimals: usize) -> String {
    let (lo, med, hi) = spread(values);
    format!("{lo:.decimals$} / {med:.decimals$} / {hi:.decimals$}")
}

/// The report: the table of every target, then the ratios of the medians.
pub(super) fn report(samples: &BTreeMap<&'static str, Vec<Sample>>, order: &[&'static str]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<8} {:>26} {:>26} {:>26} {:>26} {:>14}",
        "target",
        "req/s min/med/max",
        "CPU µs/req min/med/max",
        "p50 µs min/med/max",
        "p99 µs min/med/max",
        "upstream µs/req"
    );
    let median =
        |name: &str, f: fn(&Sample) -> f64| samples.get(name).map(|s| spread(&s.iter().map(f).collect::<Vec<_>>()).1);
    for name in order {
        let Some(s) = samples.get(name) else { continue };
        let col = |f: fn(&Sample) -> f64, d: usize| cell(&s.iter().map(f).collect::<Vec<_>>(), d);
        let _ = writeln!(
            out,
            "{:<8} {:>26} {:>26} {:>26} {:>26} {:>14.1}",
            name,
            col(|s| s.per_second, 0),
            col(|s| s.cpu_us, 1),
            col(|s| s.p50_us, 0),
            col(|s| s.p99_us, 0),
            median(name, |s| s.upstream_cpu_us).unwrap_or(f64::NAN),
        );
    }
    let _ = writeln!(out, "\nratios of medians:");
    let cpu = |name: &str| median(name, |s| s.cpu_us);
    let p50 = |name: &str| median(name, |s| s.p50_us);
    let direct = p50("direct");
    let added = |name: &str| Some(p50(name)? - direct?);
    for base in ["hop", "nginx"] {
        match (cpu("gateway"), cpu(base)) {
            (Some(g), Some(b)) => {
                let _ = writeln!(
                    out,
                    "  CPU per request      gateway / {base:<5} = {:>6.2}   (gateway {g:.1} µs, {base} {b:.1} µs)",
                    g / b
                );
            }
            _ => {
                let _ = writeln!(out, "  CPU per request      gateway / {base:<5} = n/a (not measured)");
            }
        }
    }
    for base in ["hop", "nginx"] {
        match (added("gateway"), added(base)) {
            (Some(g), Some(b)) if b > 0.0 => {
                let _ = writeln!(
                    out,
                    "  added p50 latency    gateway / {base:<5} = {:>6.2}   (gateway +{g:.0} µs, {base} +{b:.0} µs over direct)",
                    g / b
                );
            }
            (Some(g), Some(b)) => {
                let _ = writeln!(
                    out,
                    "  added p50 latency    gateway / {base:<5} = n/a   (gateway +{g:.0} µs, {base} +{b:.0} µs over direct)"
                );
            }
            _ => {
                let _ = writeln!(out, "  added p50 latency    gateway / {base:<5} = n/a (not measured)");
            }
        }
    }
    out
}
