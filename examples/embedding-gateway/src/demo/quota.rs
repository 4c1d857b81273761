//! `demo --quota-changes`: the mock upstream's real quota drops to half the configured
//! one at a third of the run and rises to double at two thirds, and the gateway learns
//! both from the answers' `x-ratelimit-limit-*` (see `gateway::learning`).
//!
//! Per phase the demo prints the upstream's `429`s and the tokens served over the
//! phase's last third against the pace of the mirrors of the real quota. It fails when a
//! phase's last third used less than [`LEAST_USE`] of that pace. The `429`s are printed,
//! not judged: the calls already admitted, or in flight, when the quota drops meet the
//! upstream's refusals before any answer can say the quota dropped.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::config::Config;
use crate::upstream::UpstreamStats;

/// The least share of the real quota's mirror pace a phase's last third must use.
pub(super) const LEAST_USE: f64 = 0.95;

/// The real quota of each phase, in percent of the configured one.
const PHASES: [u64; 3] = [100, 50, 200];

/// The upstream's counters at one instant.
#[derive(Debug, Clone, Copy, Default)]
struct Sample {
    tokens: u64,
    refused: u64,
}

fn sample(stats: &UpstreamStats) -> Sample {
    Sample { tokens: stats.tokens.load(Ordering::Relaxed), refused: stats.refused() }
}

/// What each phase measured.
#[derive(Debug)]
pub(super) struct Phases {
    /// Per phase: its real quota (percent), its `429`s, the tokens a second served over
    /// its last third, and the mirrors' pace for its real quota.
    rows: Vec<(u64, u64, f64, f64)>,
    /// Whether the gateway's learning may follow the doubling (its ceiling reaches 200%).
    follows_doubling: bool,
}

impl Phases {
    /// Whether every phase used its real quota (the doubling only when it can be
    /// followed).
    pub(super) fn passed(&self) -> bool {
        self.rows
            .iter()
            .all(|&(percent, _, served, pace)| (percent > 100 && !self.follows_doubling) || served >= LEAST_USE * pace)
    }

    /// Prints a line per phase.
    #[allow(clippy::print_stdout)]
    pub(super) fn print(&self) {
        println!();
        for (i, &(percent, refused, served, pace)) in self.rows.iter().enumerate() {
            let note = if percent > 100 && !self.follows_doubling {
                " (not followed: mirror.learn_ceiling_percent is below 200)"
            } else {
                ""
            };
            println!(
                "phase {}: real quota {percent}% of the configured one, {refused} upstream 429s, {served:.0} tok/s over its last third against the real quota's mirror pace {pace:.0} ({:.1}%){note}",
                i + 1,
                served * 100.0 / pace.max(1.0)
            );
        }
    }
}

/// Changes the real quota at each third of `seconds` and samples the upstream's
/// counters; answers once the run is over.
pub(super) async fn run(stats: Arc<UpstreamStats>, config: &Config, seconds: u64) -> Phases {
    let third = Duration::from_secs(seconds).div_f64(3.0);
    let start = tokio::time::Instant::now();
    let mut rows = Vec::new();
    let mut at_start = sample(&stats);
    for (i, percent) in PHASES.into_iter().enumerate() {
        let phase_start = start + third * i as u32;
        stats.set_real_quota_percent(percent);
        tokio::time::sleep_until(phase_start + third.mul_f64(2.0 / 3.0)).await;
        let last_third = sample(&stats);
        tokio::time::sleep_until(phase_start + third).await;
        let end = sample(&stats);
        let served = (end.tokens - last_third.tokens) as f64 / third.div_f64(3.0).as_secs_f64();
        let pace = super::report::mirrors_allowance(&scaled(config, percent)).0;
        rows.push((percent, end.refused - at_start.refused, served, pace));
        at_start = end;
    }
    Phases { rows, follows_doubling: config.mirror.learn_ceiling_percent >= 200 }
}

/// `config` with every account's quota at `percent` of its own.
fn scaled(config: &Config, percent: u64) -> Config {
    let mut config = config.clone();
    for a in &mut config.accounts {
        a.rpm = a.rpm * percent / 100;
        a.tpm = a.tpm * percent / 100;
    }
    config
}
