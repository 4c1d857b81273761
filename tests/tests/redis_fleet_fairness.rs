//! Law 27, fleet-wide weighted fairness through the Redis upstream accounts: replicas
//! whose balancer routes tenants unevenly still give every backlogged tenant its weight's
//! share of the accounts, never overrun an account in any window, and a replica that
//! stops coming loses its turn and its share of the demand within the documented bound.
//! Law numbers are those of `crates/tower-limits/docs/laws.md`.
//!
//! Each replica is simulated as its fair queue would drive the store: a core
//! [`FairQueue`] weighted through a [`FleetShares`] handle, the request at its gate
//! published with the backlog before every acquisition, a refused gate retried at the
//! instant the store named (at least a millisecond later), and every admitted request
//! replaced by a new one of its tenant (closed-loop clients). Time is a manual clock
//! given to the store's script: the run is the same on any machine, and admitted tokens
//! are counted, never timed.

// The shares and costs are printed: the figures the guide quotes (`--nocapture`).
#![allow(clippy::print_stdout)]

mod redis_common;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tower_limits_core::fair_queue::{FairQueue, FairQueueConfig};
use tower_limits_core::fleet::Waiting;
use tower_limits_core::{
    AcquireError, FleetShares, Instant, LimitPolicy, LimitSetPolicy, Quota, SharedAccounts, TenantKey, nz,
};
use tower_limits_redis::test_support::{own_redis_for, redis_for};
use tower_limits_redis::{RedisAccounts, RedisConnection};

use redis_common::{admin, cmd, connect, namespace, runtime};

/// The account: 10,000 tokens a second, a burst of 500.
const RATE: u64 = 10_000;
const BURST: u64 = 500;

/// A tenant: name, weight, cost per request, requests kept waiting per replica, band.
type Tenant = (&'static str, u32, u64, [usize; 3], usize);

/// Tenants (uneven: acme only on replica 0, the others 60/30/10 as nearly as whole
/// clients allow), all in one band.
const TENANTS: [Tenant; 3] =
    [("acme", 3, 100, [6, 0, 0], 0), ("globex", 2, 50, [4, 2, 1], 0), ("initech", 1, 80, [5, 2, 1], 0)];

/// Tenants in two bands: interactive acme and globex, each on its own replicas, and a
/// batch job routed mostly to the replica that has the least interactive work.
const BANDED: [Tenant; 3] =
    [("acme", 3, 100, [6, 0, 0], 0), ("globex", 2, 50, [0, 4, 1], 0), ("initech", 1, 80, [1, 1, 6], 1)];

/// The batch band's minimum share, percent.
const BATCH_SHARE: u32 = 10;

fn account() -> LimitSetPolicy {
    LimitSetPolicy::new()
        .limit(LimitPolicy::token_bucket("tpm", Quota::per_second(nz!(RATE)).burst(nz!(BURST))).counting_cost())
}

struct Replica {
    store: RedisAccounts,
    fleet: Arc<FleetShares>,
    tenants: &'static [Tenant],
    queue: FairQueue<TenantKey, ()>,
    gate: Option<(TenantKey, u64, usize)>,
    wake: Instant,
}

fn key(name: &str) -> TenantKey {
    TenantKey::single(name).unwrap()
}

fn replica(conn: &RedisConnection, ns: &str, r: usize) -> Replica {
    replica_of(conn, ns, r, &TENANTS, FairQueueConfig::new(), Duration::ZERO)
}

/// The three replicas of the [`TENANTS`], their stores reserving `reserve_ahead`.
async fn uneven_fleet(url: &str, ns: &str, reserve_ahead: Duration) -> Vec<Replica> {
    let mut replicas = Vec::new();
    for r in 0..3 {
        let conn = connect(url).await;
        replicas.push(replica_of(&conn, ns, r, &TENANTS, FairQueueConfig::new(), reserve_ahead));
    }
    replicas
}

/// Replica `r` of a fleet serving `tenants`, its fair queue configured by `config` (its
/// bands told to the fleet's handle).
fn replica_of(
    conn: &RedisConnection,
    ns: &str,
    r: usize,
    tenants: &'static [Tenant],
    config: FairQueueConfig,
    reserve_ahead: Duration,
) -> Replica {
    let fleet = Arc::new(FleetShares::new());
    if config.bands.len() > 1 {
        fleet.set_bands(config.bands.iter().map(|b| b.min_share_percent));
    }
    let store = RedisAccounts::builder("accounts")
        .namespace(ns)
        .timeout(Duration::from_secs(5))
        .manual_clock()
        .fleet(fleet.clone())
        .reserve_ahead(reserve_ahead)
        .member("a", account())
        .build(conn)
        .unwrap();
    let mut replica = Replica {
        store,
        fleet,
        tenants,
        queue: FairQueue::new(config.tenant_queue_limit(64).global_queue_limit(256)).unwrap(),
        gate: None,
        wake: Instant::ZERO,
    };
    for (name, _, _, clients, _) in tenants {
        for _ in 0..clients[r] {
            replica.enqueue(name);
        }
    }
    replica
}

impl Replica {
    fn tenant(&self, name: &str) -> Tenant {
        self.tenants.iter().find(|t| t.0 == name).copied().unwrap()
    }

    fn enqueue(&mut self, name: &str) {
        let (_, weight, cost, _, band) = self.tenant(name);
        let k = key(name);
        let local = self.fleet.local_weight(&k, weight);
        self.queue.enqueue_in(band, k, local, cost, ()).unwrap();
    }

    /// What the fair queue layer publishes before an acquisition: the queue's backlog
    /// per band and the gate's request.
    fn publish(&self) {
        let mut waiting = Vec::new();
        for band in 0..self.queue.bands() {
            for (k, n, _) in self.queue.band_backlog(band) {
                waiting.push(Waiting::new(k.clone(), self.tenant(&k.to_string()).1, n).in_band(band));
            }
        }
        let band = self.gate.as_ref().map_or(0, |g| g.2);
        if let Some((k, _, band)) = &self.gate {
            waiting.push(Waiting::new(k.clone(), self.tenant(&k.to_string()).1, 1).in_band(*band));
        }
        self.fleet.publish(waiting, band);
    }
}

/// What a run admitted: per grant, when, which replica, which tenant, what cost; and the
/// acquisitions it took (one round trip each).
struct Run {
    grants: Vec<(u64, usize, String, u64)>,
    calls: usize,
}

impl Run {
    /// Each tenant's share of the tokens admitted in `[from, to)` (ns).
    fn shares(&self, from: u64, to: u64) -> HashMap<String, f64> {
        let mut by: HashMap<String, u64> = HashMap::new();
        let mut all = 0;
        for (at, _, t, c) in &self.grants {
            if (from..to).contains(at) {
                *by.entry(t.clone()).or_default() += c;
                all += c;
            }
        }
        by.into_iter().map(|(t, c)| (t, c as f64 / all.max(1) as f64)).collect()
    }

    /// Never beyond the account in any window of 0.1, 1 or 5 s, and at least 97% of it
    /// used after the first second.
    fn check_bound_and_use(&self) {
        for window in [SECOND / 10, SECOND, 5 * SECOND] {
            let cap = RATE * window / SECOND + BURST;
            assert!(self.busiest(window) <= cap, "{} tokens in {window} ns, cap {cap}", self.busiest(window));
        }
        let used = self.tokens(SECOND, 12 * SECOND) as f64 / (RATE * 11) as f64;
        assert!(used >= 0.97, "the fleet used {:.1}% of the account", used * 100.0);
    }

    fn tokens(&self, from: u64, to: u64) -> u64 {
        self.grants.iter().filter(|g| (from..to).contains(&g.0)).map(|g| g.3).sum()
    }

    /// The most tokens admitted in any window of `window` ns.
    fn busiest(&self, window: u64) -> u64 {
        let mut best = 0;
        let mut sum = 0;
        let mut lo = 0;
        for hi in 0..self.grants.len() {
            sum += self.grants[hi].3;
            while self.grants[hi].0 - self.grants[lo].0 >= window {
                sum -= self.grants[lo].3;
                lo += 1;
            }
            best = best.max(sum);
        }
        best
    }
}

/// Drives the replicas until `until` (ns of the manual clock); replica `dead.0` stops
/// coming at `dead.1`.
async fn drive(replicas: &mut [Replica], until: u64, dead: Option<(usize, u64)>) -> Run {
    let mut grants = Vec::new();
    let mut turn = 0;
    let mut calls = 0;
    loop {
        let alive = |r: usize, at: u64| dead.is_none_or(|(d, when)| d != r || at < when);
        let Some(now) =
            (0..replicas.len()).filter(|&r| alive(r, replicas[r].wake.as_nanos())).map(|r| replicas[r].wake).min()
        else {
            break;
        };
        if now.as_nanos() >= until {
            break;
        }
        turn += 1;
        // The replicas due at this instant, in an order that rotates.
        let n = replicas.len();
        for k in 0..n {
            let r = (turn + k) % n;
            if replicas[r].wake != now || !alive(r, now.as_nanos()) {
                continue;
            }
            loop {
                let rep = &mut replicas[r];
                if rep.gate.is_none() {
                    let popped = match rep.fleet.next_band() {
                        Some(band) => rep.queue.pop_next_in(band),
                        None => rep.queue.pop_next(),
                    };
                    let Some(next) = popped else { break };
                    rep.gate = Some((next.key, next.cost, next.ticket.band()));
                }
                rep.publish();
                let (k, cost, _) = rep.gate.clone().unwrap();
                calls += 1;
                match rep.store.acquire_for(&k, cost, now).await {
                    Ok(_) => {
                        let name = k.to_string();
                        rep.gate = None;
                        rep.enqueue(&name);
                        // A reserved grant goes at its instant, and holds the replica's
                        // gate until then, as the store's acquisition does.
                        if let Some(at) = rep.store.last_reservation() {
                            grants.push((at.as_nanos(), r, name, cost));
                            rep.wake = at;
                            break;
                        }
                        grants.push((now.as_nanos(), r, name, cost));
                    }
                    Err(AcquireError::Refused(d)) => {
                        rep.wake = now + d.retry_after().max(Duration::from_millis(1));
                        break;
                    }
                    Err(e) => panic!("{e}"),
                }
            }
        }
    }
    grants.sort_by_key(|g| g.0);
    Run { grants, calls }
}

const SECOND: u64 = 1_000_000_000;

fn check_shares(shares: &HashMap<String, f64>, tolerance: f64) {
    let total: u32 = TENANTS.iter().map(|t| t.1).sum();
    for (name, weight, _, _, _) in TENANTS {
        let target = f64::from(weight) / f64::from(total);
        let got = shares.get(name).copied().unwrap_or(0.0);
        assert!((got - target).abs() <= tolerance, "{name}: share {got:.3}, target {target:.3} (all: {shares:?})");
    }
}

#[test]
fn uneven_routing_shares_the_accounts_by_weight_and_never_overruns_them() {
    let Some(server) = redis_for("uneven_routing_shares_the_accounts_by_weight_and_never_overruns_them") else {
        return;
    };
    runtime().block_on(async {
        let mut replicas = uneven_fleet(&server.url(), &namespace("fleet-fair"), Duration::ZERO).await;
        let run = drive(&mut replicas, 12 * SECOND, None).await;
        // After a second (the burst spent, the reports in), over whole seconds.
        let shares = run.shares(SECOND, 12 * SECOND);
        let per_replica: Vec<u64> =
            (0..3).map(|r| run.grants.iter().filter(|g| g.1 == r && g.0 >= SECOND).map(|g| g.3).sum()).collect();
        let per_grant = run.calls as f64 / run.grants.len() as f64;
        println!(
            "shares {shares:?}, tokens per replica {per_replica:?}, {} grants, {per_grant:.2} calls per grant",
            run.grants.len()
        );
        check_shares(&shares, 0.02);
        // A replica behind another's turn comes back when its own could come, not every
        // few milliseconds while the others are served (6.8 calls per grant that way):
        // one call learns the wait, about one more is granted.
        assert!(per_grant <= 3.5, "{per_grant:.2} acquisitions per grant");
        // Every second taken alone is within 5 points too.
        for s in 1..12 {
            check_shares(&run.shares(s * SECOND, (s + 1) * SECOND), 0.05);
        }
        // Never beyond the account in any window; and the fleet used it.
        run.check_bound_and_use();
        // The per-replica split follows demand, not a fixed third.
        let r0: u64 = run.grants.iter().filter(|g| g.1 == 0).map(|g| g.3).sum();
        assert!(r0 as f64 > 0.6 * run.tokens(0, 12 * SECOND) as f64);
    });
}

#[test]
fn reserved_grants_take_one_call_each_and_keep_the_bound_and_the_shares() {
    // The fleet of the test above, its stores reserving 250 ms ahead: the replica first
    // in the fleet's order is granted when the account will have room, and sends at
    // that instant.
    let Some(server) = redis_for("reserved_grants_take_one_call_each_and_keep_the_bound_and_the_shares") else {
        return;
    };
    runtime().block_on(async {
        let mut replicas = uneven_fleet(&server.url(), &namespace("fleet-reserve"), Duration::from_millis(250)).await;
        let run = drive(&mut replicas, 12 * SECOND, None).await;
        let shares = run.shares(SECOND, 12 * SECOND);
        let per_grant = run.calls as f64 / run.grants.len() as f64;
        println!("reserving: shares {shares:?}, {} grants, {per_grant:.2} calls per grant", run.grants.len());
        check_shares(&shares, 0.02);
        // Sent at their instants, the grants never exceed the account in any window.
        run.check_bound_and_use();
        // The replica first in line is granted in one call; one behind it is still told
        // when to come back, then reserves (2.8 calls per grant without reservations).
        assert!(per_grant <= 2.2, "{per_grant:.2} acquisitions per grant");
    });
}

/// A fleet of the [`BANDED`] tenants, its replicas' queues with an interactive band and a
/// batch band keeping [`BATCH_SHARE`]%; `tell_fleet` says whether the handles learn the
/// bands (the store then orders them for the fleet).
async fn banded_run(url: &str, ns: &str, tell_fleet: bool) -> Run {
    let mut replicas = Vec::new();
    for r in 0..3 {
        let conn = connect(url).await;
        let config = FairQueueConfig::new().band("interactive", 0).band("batch", BATCH_SHARE);
        let rep = replica_of(&conn, ns, r, &BANDED, config, Duration::ZERO);
        if !tell_fleet {
            rep.fleet.set_bands([]);
        }
        replicas.push(rep);
    }
    drive(&mut replicas, 12 * SECOND, None).await
}

#[test]
fn a_batch_band_keeps_its_minimum_share_of_the_fleet_and_no_more() {
    // Law 33: bands across a fleet. The batch job's requests land mostly on the replica
    // with the least interactive work; each replica orders its own queue by band, and
    // the store orders the bands for the fleet: the batch band gets its minimum share of
    // the account (no less, though it has work; no more, though its replica has room),
    // and the interactive tenants share the rest by weight.
    let Some(server) = redis_for("a_batch_band_keeps_its_minimum_share_of_the_fleet_and_no_more") else { return };
    runtime().block_on(async {
        let run = banded_run(&server.url(), &namespace("fleet-bands"), true).await;
        let shares = run.shares(SECOND, 12 * SECOND);
        println!("bands across the fleet: {shares:?}, {} grants", run.grants.len());
        let batch = f64::from(BATCH_SHARE) / 100.0;
        let share = |name: &str| shares.get(name).copied().unwrap_or(0.0);
        assert!((share("initech") - batch).abs() <= 0.02, "batch got {:.3}", share("initech"));
        // The interactive band's share is split 3:2.
        let interactive = 1.0 - share("initech");
        assert!((share("acme") - interactive * 0.6).abs() <= 0.02, "acme got {:.3}", share("acme"));
        assert!((share("globex") - interactive * 0.4).abs() <= 0.02, "globex got {:.3}", share("globex"));
        // Every second alone: the batch band within 3 points of its share.
        for s in 1..12 {
            let b = run.shares(s * SECOND, (s + 1) * SECOND).get("initech").copied().unwrap_or(0.0);
            assert!((b - batch).abs() <= 0.03, "second {s}: batch got {b:.3}");
        }
        // Never beyond the account, and the fleet used it.
        run.check_bound_and_use();
    });
}

#[test]
fn bands_told_to_no_fleet_follow_the_routing() {
    // The reference point: the same fleet whose handles do not know the bands. Each
    // replica orders only its own queue, and the replica that serves mostly the batch
    // job gives it most of its part of the account: far more than its minimum share.
    let Some(server) = redis_for("bands_told_to_no_fleet_follow_the_routing") else { return };
    runtime().block_on(async {
        let run = banded_run(&server.url(), &namespace("fleet-bands-local"), false).await;
        let shares = run.shares(SECOND, 12 * SECOND);
        println!("bands per replica: {shares:?}");
        let batch = shares.get("initech").copied().unwrap_or(0.0);
        assert!(batch > 0.15, "batch got {batch:.3} with per-replica bands");
    });
}

#[test]
fn without_fleet_shares_the_routing_decides() {
    // The reference point: the same run without the fleet (each replica fair on its own,
    // replicas taking the first-refused turn) leaves acme, routed to one replica only,
    // well below its weight's share. In this closed loop, with no upstream latency, the
    // replica that was just served is always the first refused again, and replica 0 never
    // gets the turn at all.
    let Some(server) = redis_for("without_fleet_shares_the_routing_decides") else { return };
    runtime().block_on(async {
        let ns = namespace("fleet-unfair");
        let mut replicas = Vec::new();
        for r in 0..3 {
            let conn = connect(&server.url()).await;
            let mut rep = replica(&conn, &ns, r);
            // A handle the store does not know: shares stay whole, reports go nowhere.
            rep.fleet = Arc::new(FleetShares::new());
            let store = RedisAccounts::builder("accounts")
                .namespace(&ns)
                .timeout(Duration::from_secs(5))
                .manual_clock()
                .member("a", account())
                .build(&conn)
                .unwrap();
            rep.store = store;
            replicas.push(rep);
        }
        let run = drive(&mut replicas, 6 * SECOND, None).await;
        let acme = run.shares(SECOND, 6 * SECOND).get("acme").copied().unwrap_or(0.0);
        println!("without fleet shares: {:?}", run.shares(SECOND, 6 * SECOND));
        assert!(acme < 0.40, "acme got {acme:.3} without fleet shares");
    });
}

#[test]
fn a_replica_that_stops_loses_its_turn_and_its_demand_within_the_bound() {
    let Some(server) = redis_for("a_replica_that_stops_loses_its_turn_and_its_demand_within_the_bound") else {
        return;
    };
    runtime().block_on(async {
        let url = server.url();
        let ns = namespace("fleet-dead");
        let mut replicas = Vec::new();
        for r in 0..3 {
            let conn = connect(&url).await;
            replicas.push(replica(&conn, &ns, r));
        }
        // Replica 1 (globex and initech) stops at 4 s, in the middle of its waits.
        let death = 4 * SECOND;
        let run = drive(&mut replicas, 10 * SECOND, Some((1, death))).await;
        assert!(run.grants.iter().all(|g| g.1 != 1 || g.0 < death));
        // The documented bound: its turn lasts its last wait plus 50 ms, its demand
        // 250 ms. After it, the others use the whole account and share it by weight.
        let bound = death + 250_000_000 + 50_000_000;
        println!("after the bound: {:?}", run.shares(bound, 10 * SECOND));
        check_shares(&run.shares(bound, 10 * SECOND), 0.03);
        let used = run.tokens(bound, 10 * SECOND) as f64 / (RATE as f64 * (10 * SECOND - bound) as f64 / SECOND as f64);
        assert!(used >= 0.97, "after the bound the fleet used {:.1}% of the account", used * 100.0);
        // What the death cost while it lasted: the tokens the account could have served
        // in the bound, at most.
        let lost = (RATE as f64 * (bound - death) as f64 / SECOND as f64) - run.tokens(death, bound) as f64;
        println!("lost in the bound: {lost} tokens");
        assert!(lost <= RATE as f64 * 0.3, "{lost} tokens lost");
        // Its entries leave the fleet's hash.
        let mut admin = admin(&url).await;
        let fields: Vec<String> = cmd(&mut admin, &["HKEYS", &format!("{ns}:{{accounts}}:fleet")]).await;
        let count = |kind: &str| fields.iter().filter(|f| f.starts_with(kind)).count();
        assert_eq!(count("d:"), 2, "only the live replicas' demand remains: {fields:?}");
        assert!(count("w:") <= 2, "only the live replicas wait: {fields:?}");
    });
}

#[test]
fn while_redis_is_away_every_share_is_whole_again() {
    // Per-replica fairness while the store cannot answer: a failed acquisition clears the
    // shares the last answer set (the pool's failure policy then decides, as without a
    // fleet), and the next answer sets them again.
    let Some(mut server) = own_redis_for("while_redis_is_away_every_share_is_whole_again") else { return };
    runtime().block_on(async {
        let ns = namespace("fleet-away");
        let conn = connect(&server.url()).await;
        let (a, b) = (replica(&conn, &ns, 0), replica(&conn, &ns, 1));
        let globex = key("globex");
        for r in [&a, &b] {
            r.publish();
            r.store.acquire_for(&globex, 50, Instant::ZERO).await.unwrap();
        }
        // Replica 0 has 4 of globex's requests waiting, replica 1 reported 2: a's share
        // is 4/6 of 1024.
        a.publish();
        a.store.acquire_for(&globex, 50, Instant::ZERO).await.unwrap();
        assert_eq!(a.fleet.share(&globex), 683);
        server.stop();
        let refused = a.store.acquire_for(&globex, 50, Instant::ZERO).await;
        assert!(matches!(refused, Err(AcquireError::Unavailable(_))), "{refused:?}");
        assert_eq!(a.fleet.share(&globex), tower_limits_core::fleet::FULL_SHARE);
        assert_eq!(a.fleet.local_weight(&globex, 2), 2 * tower_limits_core::fleet::FULL_SHARE);
    });
}
