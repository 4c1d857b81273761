//! Tower stacks over a bare `service_fn` (group `tower`): our GCRA layer against
//! tower_governor's `GovernorLayer` (error mode, success headers, keyed by peer IP) and
//! tower's own `RateLimit`. Each row is an overhead: each side less the bare service,
//! timed in the same round.

use std::hint::black_box;
use std::time::Duration;

use axum::body::Body;
use http::Request;
use tower::Layer;
use tower_governor::GovernorLayer;
use tower_governor::governor::GovernorConfigBuilder;
use tower_governor::key_extractor::{GlobalKeyExtractor, PeerIpKeyExtractor};
use tower_limits::extract::PeerIp;
use tower_limits::http::HttpAnswer;
use tower_limits::{GcraLayer, Quota, nz};
use tower_limits_benches::{bare, drive, from_peer};

use crate::table::{Row, overhead};

/// The tower rows: error mode against tower_governor and against `tower::limit`, the
/// rate-limit fields on every success, and a limit per peer IP.
pub(crate) fn rows(rows: &mut Vec<Row>) {
    let rt = tokio::runtime::Builder::new_current_thread().enable_time().build().expect("runtime");
    let _enter = rt.enter();
    let open = || Quota::per_second(nz!(1_000_000_000)).burst(nz!(1_000_000));
    let governed = || {
        let mut config = GovernorConfigBuilder::default();
        config.per_nanosecond(1).burst_size(1_000_000);
        config
    };
    let mut plain = bare();

    let mut ours = GcraLayer::new(open()).system_clock().layer(bare());
    let config = governed().key_extractor(GlobalKeyExtractor).finish().expect("config");
    let mut theirs = GovernorLayer::<_, _, Body>::new(config).layer(bare());
    let mut tower_rate = tower::limit::RateLimitLayer::new(1_000_000_000, Duration::from_secs(1)).layer(bare());
    rows.push(overhead(
        "tower, error mode: ours / tower_governor",
        &mut || assert!(drive(&mut plain, Request::new(()))),
        &mut || assert!(drive(&mut ours, Request::new(()))),
        &mut || assert!(drive(&mut theirs, Request::new(()))),
    ));
    rows.push(overhead(
        "tower, error mode: ours / tower::limit::RateLimit",
        &mut || assert!(drive(&mut plain, Request::new(()))),
        &mut || assert!(drive(&mut ours, Request::new(()))),
        &mut || {
            // tower's RateLimit must be polled ready before each call; `drive` does.
            black_box(drive(&mut tower_rate, Request::new(())));
        },
    ));

    let mut ours = GcraLayer::new(open()).system_clock().refuse_with(HttpAnswer::new().on_success()).layer(bare());
    let config = governed().key_extractor(GlobalKeyExtractor).use_headers().finish().expect("config");
    let mut theirs = GovernorLayer::<_, _, Body>::new(config).layer(bare());
    rows.push(overhead(
        "tower, success headers: ours / use_headers",
        &mut || assert!(drive(&mut plain, Request::new(()))),
        &mut || assert!(drive(&mut ours, Request::new(()))),
        &mut || assert!(drive(&mut theirs, Request::new(()))),
    ));

    let mut ours = GcraLayer::new(open()).key(PeerIp).system_clock().layer(bare());
    let config = governed().key_extractor(PeerIpKeyExtractor).finish().expect("config");
    let mut theirs = GovernorLayer::<_, _, Body>::new(config).layer(bare());
    let (mut a, mut b, mut c) = (0u32, 0u32, 0u32);
    rows.push(overhead(
        "tower, keyed by peer IP (1,000 peers)",
        &mut || {
            a = (a + 1) % 1_000;
            assert!(drive(&mut plain, from_peer(a)));
        },
        &mut || {
            b = (b + 1) % 1_000;
            assert!(drive(&mut ours, from_peer(b)));
        },
        &mut || {
            c = (c + 1) % 1_000;
            assert!(drive(&mut theirs, from_peer(c)));
        },
    ));
}
