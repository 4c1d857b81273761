//! Runs one operation of the `peers` table a fixed number of times, for instruction
//! counts that do not depend on the machine's load:
//! `valgrind --tool=callgrind target/release/examples/ops set3 100000` (then
//! `callgrind_annotate`). Operations: `allow`, `deny` (through `acquire`), `check`,
//! `check-deny` (through `check`), `gov-allow`, `gov-deny`, `set3`, `floor-set3` (the
//! same three limits by hand, `floor.rs`), `lock-free-set3` (by hand with no lock, the
//! floor of any design), `keyed-sem` (one semaphore per tenant, acquired
//! and released),
//! `keyed1`, `gov-keyed1`, `keyed-text` (`keyed1` with the key made per call),
//! `keyed-ids` and `gov-keyed-ids` (1,000 numeric ids in turn, ours made per call),
//! `keyed-ids-100k` and `gov-keyed-ids-100k` (the `peers` row's 100,000 ids in turn),
//! `layer` and `gov-layer` (our GCRA layer and tower_governor's
//! over the same bare service, error mode), `headers` and `gov-headers` (the same with
//! the rate-limit header fields on every success), `peer` and `gov-peer` (both layers
//! keyed by the peer's IP address, 1,000 peers in turn), `bare` and `bare-peer` (the
//! bare service alone, with the requests of `layer` and of `peer`: what the tower rows
//! subtract), `none` (the loop, the call and the clock alone).
//!
//! Each operation is a closure of its own, called through a pointer, as `peers` calls
//! its sides: the compiler sees the same code in both, so the counts here are of what
//! `peers` times. (Inlined into one loop, the optimizer would drop a refusal's unread
//! fields, which `peers` does not allow.)

#![allow(clippy::print_stdout)]

use std::hint::black_box;
use std::num::NonZeroU32;

use axum::body::Body;
use governor::{Quota, RateLimiter};
use http::Request;
use tower::Layer;
use tower_governor::GovernorLayer;
use tower_governor::governor::GovernorConfigBuilder;
use tower_governor::key_extractor::{GlobalKeyExtractor, PeerIpKeyExtractor};
use tower_limits::{GcraLayer, nz};
use tower_limits_benches::floor::{SetOfThreeFloor, SetOfThreeLockFree};
use tower_limits_benches::{bare, drive, from_peer, open_keyed_set};
use tower_limits_core::{Clock, LimitPolicy, LimitSet, LimitSetPolicy, SystemClock, TenantKey};

/// The `i`-th of the 100,000 numeric ids of the `peers` row, in turn.
fn spread(i: u64) -> u64 {
    1_000_000_007 * (i % 100_000)
}

fn main() {
    let mut args = std::env::args().skip(1);
    let op = args.next().unwrap_or_else(|| "allow".into());
    let n: u64 = args.next().and_then(|a| a.parse().ok()).unwrap_or(100_000);
    let nz = |n: u32| NonZeroU32::new(n).unwrap_or(NonZeroU32::MIN);
    let clock = SystemClock::new();
    let global = TenantKey::global();
    let huge = tower_limits::Quota::per_second(nz!(1_000_000_000)).burst(nz!(1_000_000));
    let open = LimitSet::new(LimitSetPolicy::new().limit(LimitPolicy::gcra("r", huge))).ok();
    let shut =
        LimitSet::new(LimitSetPolicy::new().limit(LimitPolicy::gcra("r", tower_limits::Quota::per_hour(nz!(1))))).ok();
    let set3 = LimitSet::new(
        LimitSetPolicy::new()
            .tiers(["tenant"])
            .limit(LimitPolicy::gcra("requests", huge).per("tenant"))
            .limit(LimitPolicy::token_bucket("tokens", huge).counting_cost())
            .limit(LimitPolicy::semaphore("concurrent", 64).per("tenant")),
    )
    .ok();
    let floor = SetOfThreeFloor::new();
    let lock_free = SetOfThreeLockFree::new(&[b"acme"]);
    // Concurrency per tenant: one keyed semaphore, acquired and released.
    let keyed_sem = LimitSet::new(
        LimitSetPolicy::new().tiers(["tenant"]).limit(LimitPolicy::semaphore("concurrent", 64).per("tenant")),
    )
    .ok();
    // The `peers` rows' keyed set: room for every key of the 100,000-key rows.
    let keyed = Some(open_keyed_set());
    let acme = TenantKey::single("acme").ok();
    let gov_open = RateLimiter::direct(Quota::per_second(nz(1_000_000_000)).allow_burst(nz(1_000_000)));
    let gov_shut = RateLimiter::direct(Quota::per_hour(nz(1)));
    let gov_keyed = RateLimiter::keyed(Quota::per_second(nz(1_000_000_000)).allow_burst(nz(1_000_000)));
    let gov_keyed_ids = RateLimiter::keyed(Quota::per_second(nz(1_000_000_000)).allow_burst(nz(1_000_000)));
    if let Some(s) = &shut {
        let _ = s.acquire(&global, 1, clock.now());
    }
    let _ = gov_shut.check();
    let (Some(open), Some(shut), Some(set3), Some(keyed), Some(keyed_sem), Some(acme)) =
        (open, shut, set3, keyed, keyed_sem, acme)
    else {
        println!("bad setup");
        return;
    };
    let rt = tokio::runtime::Builder::new_current_thread().enable_time().build().ok();
    let _enter = rt.as_ref().map(tokio::runtime::Runtime::enter);
    let open_quota = tower_limits::Quota::per_second(nz!(1_000_000_000)).burst(nz!(1_000_000));
    // tower_governor's configurations: the same open quota, with three key extractors.
    let governed = || {
        let mut config = GovernorConfigBuilder::default();
        config.per_nanosecond(1).burst_size(1_000_000);
        config
    };
    let (Some(global_config), Some(headers_config), Some(peer_config)) = (
        governed().key_extractor(GlobalKeyExtractor).finish(),
        governed().key_extractor(GlobalKeyExtractor).use_headers().finish(),
        governed().key_extractor(PeerIpKeyExtractor).finish(),
    ) else {
        println!("bad governor config");
        return;
    };
    let mut layer = GcraLayer::new(open_quota).system_clock().layer(bare());
    let mut gov_layer = GovernorLayer::<_, _, Body>::new(global_config).layer(bare());
    let mut headers = GcraLayer::new(open_quota)
        .system_clock()
        .refuse_with(tower_limits::http::HttpAnswer::new().on_success())
        .layer(bare());
    let mut gov_headers = GovernorLayer::<_, _, Body>::new(headers_config).layer(bare());
    let mut peer = GcraLayer::new(open_quota).key(tower_limits::extract::PeerIp).system_clock().layer(bare());
    let mut gov_peer = GovernorLayer::<_, _, Body>::new(peer_config).layer(bare());
    let mut plain = bare();
    // Chosen once; called through a pointer, as the module's opening says.
    let mut run: Box<dyn FnMut(u64) -> bool + '_> = match op.as_str() {
        "allow" => Box::new(|_| open.acquire(&global, 1, clock.now()).is_ok()),
        "deny" => Box::new(|_| shut.acquire(&global, 1, clock.now()).is_err()),
        "check" => Box::new(|_| open.check(&global, 1, clock.now()).is_ok()),
        "check-deny" => Box::new(|_| shut.check(&global, 1, clock.now()).is_err()),
        "gov-allow" => Box::new(|_| gov_open.check().is_ok()),
        "gov-deny" => Box::new(|_| gov_shut.check().is_err()),
        "set3" => Box::new(|_| set3.acquire(&acme, 10, clock.now()).is_ok()),
        "floor-set3" => {
            Box::new(|_| floor.acquire(b"acme", 10, clock.now().as_nanos()).map(|grant| floor.release(grant)).is_some())
        }
        "lock-free-set3" => Box::new(|_| {
            lock_free.acquire(b"acme", 10, clock.now().as_nanos()).map(|grant| lock_free.release(grant)).is_some()
        }),
        "keyed-sem" => Box::new(|_| keyed_sem.acquire(&acme, 1, clock.now()).is_ok()),
        "keyed1" => Box::new(|_| keyed.acquire(&acme, 1, clock.now()).is_ok()),
        "gov-keyed1" => Box::new(|_| gov_keyed.check_key(&"acme").is_ok()),
        "keyed-text" => {
            Box::new(|_| TenantKey::single(black_box("acme")).is_ok_and(|k| keyed.acquire(&k, 1, clock.now()).is_ok()))
        }
        "keyed-ids" => Box::new(|i| keyed.acquire(&TenantKey::from_u64(i % 1_000), 1, clock.now()).is_ok()),
        "gov-keyed-ids" => Box::new(|i| gov_keyed_ids.check_key(&(i % 1_000)).is_ok()),
        "keyed-ids-100k" => Box::new(|i| keyed.acquire(&TenantKey::from_u64(spread(i)), 1, clock.now()).is_ok()),
        "gov-keyed-ids-100k" => Box::new(|i| gov_keyed_ids.check_key(&spread(i)).is_ok()),
        "layer" => Box::new(|_| drive(&mut layer, Request::new(()))),
        "gov-layer" => Box::new(|_| drive(&mut gov_layer, Request::new(()))),
        "headers" => Box::new(|_| drive(&mut headers, Request::new(()))),
        "gov-headers" => Box::new(|_| drive(&mut gov_headers, Request::new(()))),
        "peer" => Box::new(|i| drive(&mut peer, from_peer((i % 1_000) as u32))),
        "gov-peer" => Box::new(|i| drive(&mut gov_peer, from_peer((i % 1_000) as u32))),
        "bare" => Box::new(|_| drive(&mut plain, Request::new(()))),
        "bare-peer" => Box::new(|i| drive(&mut plain, from_peer((i % 1_000) as u32))),
        "none" => Box::new(|_| black_box(clock.now()) > tower_limits_core::Instant::ZERO),
        _ => {
            println!("unknown operation {op}");
            return;
        }
    };
    let mut hits = 0u64;
    for i in 0..n {
        hits += u64::from(black_box(run(black_box(i))));
    }
    println!("{op}: {hits} of {n}");
}
