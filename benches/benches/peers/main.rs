//! One table of ratios against governor, from one run: the figures the targets
//! are stated in.
//!
//! Each row measures our path and its peer's in the same round, one after the other
//! (the order alternating from round to round), repeats the pair `ROUNDS` times and
//! reports the ratio of medians and the min / median / max of the per-round ratios. A
//! ratio below 1.0 means we are faster (or, for throughput rows, see the row's note).
//!
//! Run: `cargo bench -p tower-limits-benches --bench peers` (about two minutes; the Redis
//! rows need a `redis-server` on the `PATH` and are skipped without one).
//!
//! The modules are the groups of rows `PEERS_ONLY` chooses from, and the harness:
//!
//! - [`table`]: a row, the interleaved rounds that fill it, and the printed table;
//! - [`one_limit`]: one limit, allow and deny, and shared by threads (group `core`);
//! - [`keyed`]: keyed limits over text and numeric keys (group `core`), and on threads
//!   (group `keyed`, also part of `core`);
//! - [`sets`]: the set of three and its hand-written floors (group `core`), and on
//!   threads (group `sets`, also part of `core`);
//! - [`tower`]: the middlewares' overhead over a bare service (group `tower`);
//! - [`redis`]: the Redis backend against a plain script (group `redis`).

#![allow(clippy::print_stdout)]

mod keyed;
mod one_limit;
mod redis;
mod sets;
mod table;
mod tower;

use std::num::NonZeroU32;

use governor::{Quota as GovQuota, RateLimiter};

/// The rate (a second) and burst of the limits that never refuse.
const HUGE: u32 = 1_000_000_000;

fn nz_u32(n: u32) -> NonZeroU32 {
    NonZeroU32::new(n).expect("non-zero")
}

/// The peer of the one-limit and set rows: governor's direct limiter, a billion a second
/// with a burst of a million.
fn open_governor() -> governor::DefaultDirectRateLimiter {
    RateLimiter::direct(GovQuota::per_second(nz_u32(HUGE)).allow_burst(nz_u32(1_000_000)))
}

fn main() {
    // `cargo bench` passes `--bench`; rows are chosen by group, not by a filter argument:
    // `PEERS_ONLY=redis` (or `core`, `sets`, `tower`, comma-separated) runs those groups alone.
    let only = std::env::var("PEERS_ONLY").unwrap_or_default();
    let wants = |group: &str| only.is_empty() || only.split(',').any(|g| g.trim() == group);
    let mut rows = Vec::new();
    if wants("core") {
        one_limit::rows(&mut rows);
        keyed::rows(&mut rows);
        sets::rows(&mut rows);
    }
    if wants("core") || wants("keyed") {
        keyed::thread_rows(&mut rows);
    }
    if wants("core") || wants("sets") {
        sets::thread_rows(&mut rows);
    }
    if wants("tower") {
        tower::rows(&mut rows);
    }
    if wants("redis") {
        redis::rows(&mut rows);
    }
    table::print(&rows);
}
