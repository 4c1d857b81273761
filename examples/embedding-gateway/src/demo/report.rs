//! What the demo prints and draws once its load ends: the table of tenants, the upstream's
//! and the stores' figures, the chart and the verdict.

use super::*;

/// Each tenant's row of the table: its answers, its share of the tokens admitted after
/// `warmup`, and its target share.
pub(super) fn tally(events: &[Event], tenants: &[TenantInfo], warmup: Duration) -> Vec<Row> {
    let mut rows = Vec::new();
    for i in 0..tenants.len() {
        let mine = events.iter().filter(|e| e.tenant == i);
        let mut requests = 0u64;
        let mut tokens = 0u64;
        let mut measured = 0u64;
        let mut queued = Vec::new();
        let mut reasons: BTreeMap<String, u64> = BTreeMap::new();
        let mut capped = false;
        for e in mine {
            match &e.outcome {
                Outcome::Ok { tokens: n, queued: q } => {
                    requests += 1;
                    tokens += n;
                    if e.at >= warmup {
                        measured += n;
                    }
                    queued.push(*q);
                }
                Outcome::Refused { reason, own_rate_limit } => {
                    *reasons.entry(reason.clone()).or_default() += 1;
                    capped |= own_rate_limit;
                }
            }
        }
        queued.sort_unstable();
        rows.push(Row { requests, tokens, measured, queued, reasons, capped, share: 0.0, target: None });
    }
    set_shares_and_targets(&mut rows, tenants);
    rows
}

/// Each row's share of the measured tokens, and the target of each tenant not capped by
/// its own plan: the rest after the capped tenants' shares, split by weight.
pub(super) fn set_shares_and_targets(rows: &mut [Row], tenants: &[TenantInfo]) {
    let total_measured: u64 = rows.iter().map(|r| r.measured).sum::<u64>().max(1);
    for r in rows.iter_mut() {
        r.share = r.measured as f64 / total_measured as f64;
    }
    // Tenants held by their own limits take what they take. A later band keeps its
    // minimum share (the first band being backlogged all along), split by weight among
    // its tenants; the first band's tenants share the rest by weight.
    let capped_share: f64 = rows.iter().filter(|r| r.capped).map(|r| r.share).sum();
    let capped: Vec<bool> = rows.iter().map(|r| r.capped).collect();
    let free = || tenants.iter().zip(&capped).filter(|(_, c)| !**c).map(|(t, _)| t);
    let band_weight = |band: usize| -> u32 { free().filter(|t| t.band == band).map(|t| t.weight).sum() };
    let mut later_bands: Vec<(usize, f64)> = free().filter(|t| t.band > 0).map(|t| (t.band, t.band_share)).collect();
    later_bands.sort_by_key(|b| b.0);
    later_bands.dedup_by_key(|b| b.0);
    let kept: f64 = later_bands.iter().map(|(_, share)| share).sum();
    let first_weight = band_weight(0);
    for (t, r) in tenants.iter().zip(rows.iter_mut()) {
        if r.capped {
            continue;
        }
        let (pie, weight) =
            if t.band == 0 { (1.0 - capped_share - kept, first_weight) } else { (t.band_share, band_weight(t.band)) };
        if weight > 0 {
            r.target = Some(pie * f64::from(t.weight) / f64::from(weight));
        }
    }
}

/// The tenants whose share strays from their target by more than `tolerance`.
pub(super) fn off_share(tenants: &[TenantInfo], rows: &[Row], tolerance: f64) -> Vec<String> {
    tenants
        .iter()
        .zip(rows)
        .filter(|(_, r)| r.target.is_some_and(|target| (r.share - target).abs() > tolerance))
        .map(|(t, _)| t.name.clone())
        .collect()
}

/// Prints the table: one row per tenant, over `elapsed` seconds.
pub(super) fn print_table(tenants: &[TenantInfo], rows: &[Row], elapsed: f64) {
    println!();
    println!(
        "{:<10} {:>6} {:<9} {:>8} {:>9} {:>7} {:>7} {:>11} {:>10} {:>10}  refused (status limit)",
        "tenant", "weight", "plan", "requests", "tokens", "tok/s", "share", "target", "p50 queue", "p99 queue"
    );
    for (t, r) in tenants.iter().zip(rows) {
        let target = r.target.map_or_else(|| "own limit".to_owned(), |target| format!("{:.1}%", target * 100.0));
        let refused = if r.reasons.is_empty() {
            "-".to_owned()
        } else {
            r.reasons.iter().map(|(why, n)| format!("{n} × {why}")).collect::<Vec<_>>().join(", ")
        };
        println!(
            "{:<10} {:>6} {:<9} {:>8} {:>9} {:>7.0} {:>6.1}% {:>11} {:>10} {:>10}  {refused}",
            t.name,
            t.weight,
            t.plan,
            r.requests,
            r.tokens,
            r.tokens as f64 / elapsed,
            r.share * 100.0,
            target,
            millis(percentile(&r.queued, 0.50)),
            millis(percentile(&r.queued, 0.99)),
        );
    }
}

/// Prints what the layers counted: the same numbers as `/metrics` serves (every replica
/// of this process).
pub(super) fn print_layer_metrics() {
    let page = crate::metrics::handle().render();
    let sum = |name: &str, labels: &[&str]| crate::metrics::sum(&page, name, labels);
    let waits = sum("rate_limiting_request_time_in_queue_count", &[r#"layer="upstream""#, r#"result="admitted""#]);
    let waited = sum("rate_limiting_request_time_in_queue_sum", &[r#"layer="upstream""#, r#"result="admitted""#]);
    println!(
        "/metrics: plans admitted {:.0} and refused {:.0}; the fair queue admitted {:.0} ({waits:.0} after a mean wait of {:.0} ms) and refused {:.0}",
        sum("rate_limiting_requests", &[r#"layer="plan""#, r#"result="admitted""#]),
        sum("rate_limiting_requests", &[r#"layer="plan""#, r#"result="refused""#]),
        sum("rate_limiting_requests", &[r#"layer="upstream""#, r#"result="admitted""#]),
        waited * 1000.0 / waits.max(1.0),
        sum("rate_limiting_requests", &[r#"layer="upstream""#, r#"result="refused""#]),
    );
}

/// What the upstream served over `elapsed` seconds against the accounts' quota and what
/// their mirrors allowed, over the run and (a run long enough) after its first
/// [`SETTLING`] seconds, from the answers' tokens; prints it.
pub(super) fn summarize_upstream(
    config: &Config,
    upstream_stats: &UpstreamStats,
    events: &[Event],
    elapsed: f64,
) -> UpstreamSummary {
    let served = upstream_stats.served.load(Ordering::Relaxed);
    let upstream_tokens = upstream_stats.tokens.load(Ordering::Relaxed);
    let upstream_429 = upstream_stats.refused();
    let quota: u64 =
        config.accounts.iter().map(|a| a.tokens_per_window() as f64 / a.window.as_secs_f64()).sum::<f64>() as u64;
    let (mirror_rate, mirror_burst) = mirrors_allowance(config);
    let allowed = mirror_rate * elapsed + mirror_burst as f64;
    let utilization = upstream_tokens as f64 / allowed.max(1.0);
    println!();
    println!(
        "upstream: {served} requests, {upstream_tokens} tokens, {:.0} tok/s (accounts' quota {quota}, mirrors' pace {mirror_rate:.0}); 429 answers: {upstream_429}",
        upstream_tokens as f64 / elapsed
    );
    let mut line =
        format!("utilization: {:.1}% of the {allowed:.0} tokens the mirrors allowed over the run", utilization * 100.0);
    if elapsed >= 2.0 * SETTLING {
        // Where a fleet starts its leases, the first seconds are its parts settling.
        let after: u64 = events
            .iter()
            .filter(|e| e.at.as_secs_f64() >= SETTLING)
            .map(|e| if let Outcome::Ok { tokens, .. } = e.outcome { tokens } else { 0 })
            .sum();
        let pace = after as f64 / (mirror_rate * (elapsed - SETTLING)).max(1.0);
        let _ = write!(line, ", {:.1}% of their pace after the first {SETTLING:.0} s", pace * 100.0);
    }
    println!("{line}");
    UpstreamSummary { served, refused: upstream_429, quota, mirror_rate, utilization }
}

/// The seconds after which the demo measures the utilization a second time: past a
/// fleet's first refreshes.
const SETTLING: f64 = 2.0;

/// What the mirrors let through in the long run: (L - b) / (W + J) tokens per second per
/// account (one mirror per account, shared by the replicas through Redis), and the
/// bursts, once.
pub(super) fn mirrors_allowance(config: &Config) -> (f64, u64) {
    let tpm_limit = |a: &crate::config::Account| {
        let policy = a.mirror_policy(&config.mirror, config.gateway.max_request_tokens, 1).ok()?;
        policy.limits.into_iter().find(|l| l.name == "upstream.tpm")
    };
    let rate: f64 = config
        .accounts
        .iter()
        .filter_map(|a| {
            let rate = tpm_limit(a)?.rate?;
            Some(rate.amount() as f64 / rate.period().as_secs_f64())
        })
        .sum();
    let burst: u64 = config.accounts.iter().filter_map(|a| tpm_limit(a)?.burst).sum();
    (rate, burst)
}

/// Prints how many calls the accounts shared in Redis took, per upstream call (nothing in
/// memory).
pub(super) fn print_account_store(gateways: &[Gateway], served: u64) {
    let stores: Vec<_> = gateways.iter().filter_map(Gateway::accounts).collect();
    if stores.is_empty() {
        return;
    }
    let (mut acquire, mut batches, mut ops, mut leases, mut leased, mut ridden) = (0, 0, 0, 0, 0, 0);
    for s in &stores {
        let st = s.stats();
        (acquire, batches, ops) = (acquire + st.acquire_calls, batches + st.batch_calls, ops + st.batched_ops);
        (leases, leased, ridden) = (leases + st.lease_refreshes, leased + st.leased_grants, ridden + st.ridden_ops);
    }
    println!(
        "accounts in Redis: {acquire} acquisition calls ({ridden} settles and reports rode on them), {leases} lease refreshes ({leased} grants from leases) and {batches} background calls carrying {ops} settles and reports, for {served} upstream calls ({:.2}, {:.2} and {:.2} per call)",
        acquire as f64 / served.max(1) as f64,
        leases as f64 / served.max(1) as f64,
        batches as f64 / served.max(1) as f64
    );
}

/// Prints how the plans shared in Redis decided: acquisitions with a round trip, from
/// shares, and share refreshes (nothing in memory).
pub(super) fn print_plan_store(gateways: &[Gateway]) {
    let backends: Vec<_> = gateways.iter().flat_map(Gateway::plan_backends).collect();
    if backends.is_empty() {
        return;
    }
    let (mut acquisitions, mut shared, mut refreshes, mut carried, mut trips) = (0, 0, 0, 0, 0);
    for b in &backends {
        let st = b.stats();
        (acquisitions, shared) = (acquisitions + st.acquisitions, shared + st.shared_grants);
        (refreshes, carried, trips) =
            (refreshes + st.share_refreshes, carried + st.share_refreshes_carried, trips + st.round_trips);
    }
    println!(
        "plans in Redis: {acquisitions} acquisitions, {shared} granted from shares, {refreshes} share refresh calls \
         (and {carried} carried by lease refreshes), {trips} round trips in all"
    );
}

/// Prints each replica's answers and tokens served, and its tokens by tenant.
pub(super) fn print_replicas(counters: &LoadCounters, tenants: &[TenantInfo]) {
    let all: u64 = counters.per_replica.iter().map(|r| r.1.load(Ordering::Relaxed)).sum::<u64>().max(1);
    for (i, (answers, tokens)) in counters.per_replica.iter().enumerate() {
        let (answers, tokens) = (answers.load(Ordering::Relaxed), tokens.load(Ordering::Relaxed));
        let by_tenant: Vec<String> = tenants
            .iter()
            .enumerate()
            .map(|(t, info)| {
                format!("{} {}", info.name, counters.mix[i * counters.tenants + t].load(Ordering::Relaxed))
            })
            .collect();
        println!(
            "replica {i}: {answers} answers, {tokens} tokens served ({:.1}% of the fleet's: {})",
            tokens as f64 * 100.0 / all as f64,
            by_tenant.join(", ")
        );
    }
}

/// Writes the SVG chart to `path` and prints where: per tenant and in all, the tokens
/// admitted in the trailing second, every [`STEP`], with the accounts' quota and the
/// mirrors' rate as reference lines.
pub(super) fn write_chart(
    events: &[Event],
    tenants: &[TenantInfo],
    seconds: u64,
    upstream: &UpstreamSummary,
    path: &Path,
) -> std::io::Result<()> {
    let steps = (Duration::from_secs(seconds).as_nanos() / STEP.as_nanos()) as usize;
    let mut series: Vec<Series> = tenants
        .iter()
        .enumerate()
        .map(|(i, t)| Series {
            name: format!("{} (w{})", t.name, t.weight),
            values: (0..=steps).map(|k| trailing_second_tokens(events, i, STEP * k as u32)).collect(),
        })
        .collect();
    let total: Vec<f64> = (0..=steps).map(|k| series.iter().map(|s| s.values[k]).sum()).collect();
    series.push(Series { name: "all tenants".into(), values: total });
    let (quota, mirror_rate) = (upstream.quota, upstream.mirror_rate);
    let references = [
        Reference { label: format!("accounts' quota {quota} tok/s"), value: quota as f64 },
        Reference { label: format!("mirrors' sustained rate {mirror_rate:.0} tok/s"), value: mirror_rate },
    ];
    let svg = line_chart(
        "Tokens admitted in the trailing second, by tenant",
        "tokens / s",
        STEP.as_secs_f64(),
        &series,
        &references,
    );
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(path, svg)?;
    println!("chart: {}", path.display());
    Ok(())
}

/// The tokens admitted to `tenant` in the second before `at`: the quantity a provider
/// enforcing its quota over one-second windows checks.
pub(super) fn trailing_second_tokens(events: &[Event], tenant: usize, at: Duration) -> f64 {
    let from = at.saturating_sub(Duration::from_secs(1));
    let tokens: u64 = events
        .iter()
        .filter(|e| e.tenant == tenant && e.at > from && e.at <= at)
        .map(|e| if let Outcome::Ok { tokens, .. } = e.outcome { tokens } else { 0 })
        .sum();
    tokens as f64
}

/// Prints the verdict: `PASS`, or a `FAIL` line for each reason.
pub(super) fn print_verdict(report: &DemoReport, utilization: f64) {
    let refusals = if report.quota_changed {
        format!("{} upstream 429s as the quota changed (reported, not judged), each phase used", report.upstream_429)
    } else {
        "zero upstream 429s".to_owned()
    };
    if report.passed() {
        if report.off_share.is_empty() {
            println!("PASS: {refusals}, every share within tolerance");
        } else {
            println!("PASS: {refusals} (shares beyond tolerance, advisory: {})", report.off_share.join(", "));
        }
        return;
    }
    if report.upstream_429 > 0 && !report.quota_changed {
        println!("FAIL: the upstream answered 429 {} times", report.upstream_429);
    }
    if !report.quota_changes_passed {
        println!("FAIL: a phase used less than {:.0}% of its real quota's mirrors", super::quota::LEAST_USE * 100.0);
    }
    if !report.off_share.is_empty() {
        println!("FAIL: shares beyond tolerance: {}", report.off_share.join(", "));
    }
    if report.underused {
        println!(
            "FAIL: the fleet used {:.1}% of what the mirrors allowed (at least {:.0}%)",
            utilization * 100.0,
            super::LEAST_FLEET_USE * 100.0
        );
    }
}

/// A tenant's row of the table.
pub(super) struct Row {
    pub(super) requests: u64,
    pub(super) tokens: u64,
    pub(super) measured: u64,
    pub(super) queued: Vec<Duration>,
    pub(super) reasons: BTreeMap<String, u64>,
    pub(super) capped: bool,
    pub(super) share: f64,
    pub(super) target: Option<f64>,
}

pub(super) fn percentile(sorted: &[Duration], p: f64) -> Option<Duration> {
    if sorted.is_empty() {
        return None;
    }
    let rank = ((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len());
    Some(sorted[rank - 1])
}

pub(super) fn millis(d: Option<Duration>) -> String {
    d.map_or_else(|| "-".to_owned(), |d| format!("{:.1}ms", d.as_secs_f64() * 1000.0))
}
