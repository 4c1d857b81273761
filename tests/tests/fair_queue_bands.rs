//! Law 31, priority bands in the fair queue: the first band with requests goes first,
//! every band keeps its minimum share of what is dispatched while it waits (within one
//! request), tenants share by weight inside a band, and every request comes out once.
//! Checked through the public API on random traces from fixed seeds. Law numbers are
//! those of `crates/tower-limits/docs/laws.md`.

use std::collections::{BTreeMap, HashMap};

use proptest::prelude::*;
use proptest::test_runner::{Config, RngSeed, TestRunner};
use tower_limits_core::fair_queue::{FairQueue, FairQueueConfig, Ticket};
use tower_limits_tests::Rng;

fn runner(cases: u32) -> TestRunner {
    TestRunner::new(Config {
        cases,
        rng_seed: RngSeed::Fixed(0x0ba9_d5e1),
        failure_persistence: None,
        ..Config::default()
    })
}

/// Bands with minimum shares (percent) summing to at most 100.
fn bands() -> impl Strategy<Value = Vec<u32>> {
    prop::collection::vec(0u32..=60, 2..=4).prop_map(|mut shares| {
        let mut left = 100;
        for s in &mut shares {
            *s = (*s).min(left);
            left -= *s;
        }
        shares
    })
}

fn queue(shares: &[u32]) -> FairQueue<u32, u64> {
    let mut config = FairQueueConfig::new().tenant_queue_limit(1_000).global_queue_limit(4_000);
    for (b, share) in shares.iter().enumerate() {
        config = config.band(format!("band-{b}"), *share);
    }
    FairQueue::new(config).unwrap()
}

/// A band's backlog since it last started: the cost dispatched in all and to the band
/// when it started.
#[derive(Clone, Copy)]
struct Since {
    all: u64,
    own: u64,
}

/// What a trace measured: the worst shortfall of a band below its minimum share (in
/// hundredths of a cost unit), the largest cost, and the dispatches.
struct Outcome {
    worst_shortfall: i128,
    largest: u64,
    dispatched: u64,
}

/// Random arrivals in random bands (bursts that keep bands backlogged for a while, and
/// quiet spells that empty them), dispatches and cancellations. Checks, after every
/// dispatch, each waiting band's share against its minimum, and conservation at the end.
fn run(shares: &[u32], max_cost: u64, seed: u64, steps: usize) -> Outcome {
    let mut q = queue(shares);
    let mut rng = Rng(seed | 1);
    let n = shares.len();
    let (mut all, mut own) = (0u64, vec![0u64; n]);
    let mut since: Vec<Option<Since>> = vec![None; n];
    let mut queued: Vec<u64> = vec![0; n];
    let mut tickets: BTreeMap<u64, Ticket> = BTreeMap::new();
    let (mut next_id, mut out) = (0u64, Outcome { worst_shortfall: 0, largest: 0, dispatched: 0 });
    // Each band is busy (arrivals above the dispatch rate) or quiet, switched at random.
    let mut busy: Vec<bool> = (0..n).map(|_| rng.below(2) == 0).collect();
    for _ in 0..steps {
        if rng.below(50) == 0 {
            let b = rng.below(n as u64) as usize;
            busy[b] = !busy[b];
        }
        for b in 0..n {
            let arrivals = if busy[b] { rng.below(3) } else { u64::from(rng.below(8) == 0) };
            for _ in 0..arrivals {
                let cost = 1 + rng.below(max_cost);
                let tenant = rng.below(3) as u32;
                if let Ok(ticket) = q.enqueue_in(b, tenant, 1 + tenant, cost, next_id) {
                    assert_eq!(ticket.band(), b);
                    tickets.insert(next_id, ticket);
                    next_id += 1;
                    if queued[b] == 0 {
                        since[b] = Some(Since { all, own: own[b] });
                    }
                    queued[b] += 1;
                    out.largest = out.largest.max(cost);
                }
            }
        }
        if rng.below(10) == 0 && !tickets.is_empty() {
            let id = *tickets.keys().next().unwrap_or(&0);
            let ticket = tickets.remove(&id).unwrap();
            assert_eq!(q.cancel(ticket), Some(id), "a queued request comes out of a cancel");
            let b = ticket.band();
            queued[b] -= 1;
            if queued[b] == 0 {
                since[b] = None;
            }
        }
        for _ in 0..2 {
            let Some(peeked) = q.peek_next().map(|p| (p.ticket, p.cost)) else { break };
            let d = q.pop_next().unwrap();
            assert_eq!((d.ticket, d.cost), peeked, "pop_next dispatches what peek_next showed");
            assert!(tickets.remove(&d.item).is_some(), "each request comes out once");
            let b = d.ticket.band();
            // Band order: the first band with requests goes, unless a later one is owed
            // its minimum share; with no minimum share, never before an earlier band.
            if let Some(first) = queued.iter().position(|&k| k > 0) {
                if first < b {
                    let s = since[b].expect("a band dispatching is waiting");
                    let owed = i128::from(shares[b]) * i128::from(all - s.all) - 100 * i128::from(own[b] - s.own);
                    assert!(owed > 0, "band {b} went before band {first} without being owed its minimum share");
                }
            }
            all += d.cost;
            own[b] += d.cost;
            queued[b] -= 1;
            if queued[b] == 0 {
                since[b] = None;
            }
            out.dispatched += 1;
            // Minimum share: while a band waits, it has received at least its share of
            // what was dispatched since it started waiting, less one request.
            for (w, s) in since.iter().enumerate() {
                let Some(s) = s else { continue };
                let due = i128::from(shares[w]) * i128::from(all - s.all);
                let got = 100 * i128::from(own[w] - s.own);
                let shortfall = due - got;
                out.worst_shortfall = out.worst_shortfall.max(shortfall);
                assert!(
                    shortfall <= 100 * i128::from(max_cost),
                    "band {w} (minimum {}%) got {} of {} dispatched while it waited",
                    shares[w],
                    own[w] - s.own,
                    all - s.all
                );
            }
        }
        assert_eq!(q.len() as u64, queued.iter().sum::<u64>());
    }
    // Conservation: everything still queued comes out, once.
    while let Some(d) = q.pop_next() {
        assert!(tickets.remove(&d.item).is_some());
    }
    assert!(tickets.is_empty() && q.is_empty());
    out
}

#[test]
fn every_band_keeps_its_minimum_share_and_earlier_bands_go_first() {
    let worst = std::cell::Cell::new(0i128);
    runner(64)
        .run(&(bands(), 1u64..=50, any::<u64>()), |(shares, max_cost, seed)| {
            let o = run(&shares, max_cost, seed, 3_000);
            prop_assert!(o.dispatched > 1_000);
            worst.set(worst.get().max(o.worst_shortfall / i128::from(o.largest.max(1))));
            Ok(())
        })
        .unwrap();
    eprintln!("worst shortfall below a band's minimum share: {}% of the largest request", worst.get());
}

/// A batch band with a 20% minimum behind an interactive band that never empties: batch
/// gets a fifth of the cost, to the request, and interactive the rest, shared by weight.
#[test]
fn a_lower_band_with_work_gets_its_minimum_while_a_higher_band_is_backlogged() {
    let config = FairQueueConfig::new().band("interactive", 0).band("batch", 20).tenant_queue_limit(1_000);
    let mut q: FairQueue<&str, ()> = FairQueue::new(config.global_queue_limit(4_000)).unwrap();
    for _ in 0..600 {
        q.enqueue_in(0, "chat", 1, 1, ()).unwrap();
        q.enqueue_in(0, "search", 3, 1, ()).unwrap();
    }
    for _ in 0..600 {
        q.enqueue_in(1, "nightly", 1, 1, ()).unwrap();
    }
    let mut served: HashMap<&str, u64> = HashMap::new();
    for _ in 0..1_000 {
        *served.entry(q.pop_next().unwrap().key).or_default() += 1;
    }
    assert_eq!(served["nightly"], 200);
    // Inside the interactive band, weights 3 to 1.
    assert_eq!((served["search"], served["chat"]), (600, 200));
}

/// Without minimum shares, bands are strict priorities; the default band is the one
/// configured, and a band beyond the last is the last.
#[test]
fn without_minimum_shares_bands_are_strict_priorities() {
    let config = FairQueueConfig::new().band("high", 0).band("normal", 0).band("low", 0).default_band("normal");
    let mut q: FairQueue<&str, u32> = FairQueue::new(config).unwrap();
    q.enqueue("a", 1, 1).unwrap();
    q.enqueue_in(7, "a", 1, 1, 2).unwrap();
    q.enqueue_in(0, "a", 1, 1, 0).unwrap();
    let order: Vec<(u32, usize)> = std::iter::from_fn(|| q.pop_next().map(|d| (d.item, d.ticket.band()))).collect();
    assert_eq!(order, [(0, 0), (1, 1), (2, 2)]);
    assert_eq!(q.stats().dispatched, 3);
}

/// Bad band configurations are refused, naming the field.
#[test]
fn band_configurations_are_checked() {
    let err = |c: FairQueueConfig| c.validate().unwrap_err().to_string();
    assert_eq!(
        err(FairQueueConfig::new().band("a", 60).band("b", 50)),
        "bands[1].min_share_percent: the minimum shares sum to 110%, above 100%"
    );
    assert_eq!(err(FairQueueConfig::new().band("a", 0).band("a", 0)), "bands[1].name: \"a\" is named twice");
    assert_eq!(err(FairQueueConfig::new().band("", 0)), "bands[0].name: must not be empty");
    assert_eq!(err(FairQueueConfig::new().band("a", 0).default_band("b")), "default_band: no band is named \"b\"");
    let config: FairQueueConfig = serde_json::from_str(
        r#"{"default_band": "batch", "bands": [{"name": "interactive"}, {"name": "batch", "min_share_percent": 10}]}"#,
    )
    .unwrap();
    config.validate().unwrap();
    assert_eq!((config.band_index("batch"), config.default_band_index()), (Some(1), 1));
}
