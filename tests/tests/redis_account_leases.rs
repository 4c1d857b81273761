//! Law 30: upstream accounts leased to a fleet through Redis. Each replica holds a
//! fraction of every account and decides from it alone; over every window the fleet
//! charges an account at most its burst plus its rate, whatever the traffic, the order
//! of refreshes, answers lost on their way back or replicas that stop; capacity follows
//! demand; a replica that stops gives its fraction back within a lifetime; a Redis that
//! lost its state does not hand the fleet's leases out twice. Every test runs against a
//! real `redis-server`, on a manual clock (the test chooses when leases are refreshed).

mod redis_common;

use std::time::Duration;

use tower_limits_core::fleet::Waiting;
use tower_limits_core::{
    AcquireError, Backend, FleetShares, Instant, LimitPolicy, LimitPool, LimitSet, LimitSetPolicy, Selection, TenantKey,
};
use tower_limits_redis::test_support::{own_redis_for, redis_for};
use tower_limits_redis::{AccountLeases, FailurePolicy, RedisAccounts, RedisConnection};
use tower_limits_tests::{Rng, quota};

use redis_common::{connect, namespace, runtime};

/// Two accounts: requests per second with a burst, and tokens per second (cost).
const ACCOUNTS: [(&str, u64, u64, u64, u64); 2] = [("a", 100, 10, 2_000, 300), ("b", 40, 4, 1_000, 200)];

/// The largest cost the tests ask for: every lease's burst holds it.
const LARGEST: u64 = 40;

fn account(rps: u64, burst: u64, tps: u64, tburst: u64) -> LimitSetPolicy {
    LimitSetPolicy::new()
        .limit(LimitPolicy::gcra("rpm", quota(rps, Duration::from_secs(1), burst)))
        .limit(LimitPolicy::token_bucket("tpm", quota(tps, Duration::from_secs(1), tburst)).counting_cost())
}

const LIFETIME: Duration = Duration::from_millis(300);

/// One replica: its own connection, store and pool, leasing the accounts.
async fn replica(url: &str, ns: &str) -> (LimitPool, RedisAccounts) {
    let conn: RedisConnection = connect(url).await;
    let mut store = RedisAccounts::builder("accounts")
        .namespace(ns)
        .timeout(Duration::from_secs(5))
        .on_failure(FailurePolicy::FailClosed)
        .manual_clock()
        .leases(AccountLeases::new().refresh_every(Duration::from_millis(50)).lifetime(LIFETIME).largest_cost(LARGEST));
    let mut pool = LimitPool::builder(Selection::MostHeadroom);
    for (name, rps, burst, tps, tburst) in ACCOUNTS {
        store = store.member(name, account(rps, burst, tps, tburst));
        pool = pool.member(name, LimitSet::new(account(rps, burst, tps, tburst)).unwrap(), ());
    }
    let store = store.build(&conn).unwrap();
    (pool.shared(std::sync::Arc::new(store.clone())).build().unwrap(), store)
}

/// A replica of a pool of one member, `only`, with `policy`, leasing it (and taking its
/// replaced limits, with `replaceable`).
async fn single(
    url: &str,
    ns: &str,
    policy: &LimitSetPolicy,
    leases: AccountLeases,
    replaceable: bool,
) -> (LimitPool, RedisAccounts) {
    let conn = connect(url).await;
    let mut store = RedisAccounts::builder("accounts")
        .namespace(ns)
        .timeout(Duration::from_secs(5))
        .manual_clock()
        .member("only", policy.clone())
        .leases(leases);
    if replaceable {
        store = store.replaceable_limits(Duration::from_secs(1));
    }
    let store = store.build(&conn).unwrap();
    let pool = LimitPool::builder(Selection::MostHeadroom)
        .member("only", LimitSet::new(policy.clone()).unwrap(), ())
        .shared(std::sync::Arc::new(store.clone()))
        .build()
        .unwrap();
    (pool, store)
}

/// Two replicas sharing a namespace of their own.
async fn replicas(url: &str, prefix: &str) -> [(LimitPool, RedisAccounts); 2] {
    let ns = namespace(prefix);
    [replica(url, &ns).await, replica(url, &ns).await]
}

/// Two replicas leasing the accounts (refreshed every 50 ms, on the test clock), each
/// with a fleet-shares handle (with `bands`' minimum shares when given) for its demand.
async fn sides_with_fleet_shares(
    url: &str,
    prefix: &str,
    bands: Option<[u32; 2]>,
) -> Vec<(LimitPool, RedisAccounts, std::sync::Arc<FleetShares>)> {
    let ns = namespace(prefix);
    let mut sides = Vec::new();
    for _ in 0..2 {
        let conn = connect(url).await;
        let fleet = std::sync::Arc::new(FleetShares::new());
        if let Some(bands) = bands {
            fleet.set_bands(bands);
        }
        let mut store = RedisAccounts::builder("accounts")
            .namespace(&ns)
            .timeout(Duration::from_secs(5))
            .manual_clock()
            .fleet(fleet.clone())
            .leases(
                AccountLeases::new().refresh_every(Duration::from_millis(50)).lifetime(LIFETIME).largest_cost(LARGEST),
            );
        let mut pool = LimitPool::builder(Selection::MostHeadroom);
        for (name, rps, burst, tps, tburst) in ACCOUNTS {
            store = store.member(name, account(rps, burst, tps, tburst));
            pool = pool.member(name, LimitSet::new(account(rps, burst, tps, tburst)).unwrap(), ());
        }
        let store = store.build(&conn).unwrap();
        let pool = pool.shared(std::sync::Arc::new(store.clone())).build().unwrap();
        sides.push((pool, store, fleet));
    }
    sides
}

/// One 10 ms step of side `i` at `t` ms: publishes what waits there (in `band`), asks for
/// five requests while something waits, and refreshes every 50 ms (side `i` 20·i ms into
/// the period).
async fn side_step(
    (pool, store, fleet): (&LimitPool, &RedisAccounts, &std::sync::Arc<FleetShares>),
    i: usize,
    waiting: Option<Waiting>,
    band: usize,
    t: u64,
) {
    let busy = waiting.is_some();
    fleet.publish(waiting, band);
    if busy {
        let key = TenantKey::global();
        for _ in 0..5 {
            if let Ok(g) = Backend::acquire(pool, &key, 1, ms(t)).await {
                Backend::release(pool, &key, g);
            }
        }
    }
    if t % 50 == 20 * i as u64 {
        store.refresh_leases(ms(t)).await;
    }
}

fn ms(n: u64) -> Instant {
    Instant::from_nanos(n * 1_000_000)
}

/// Asks `pool` for `times` requests of cost 1 at `t` ms, each released at once: how many
/// were granted.
async fn ask(pool: &LimitPool, times: usize, t: u64) -> usize {
    let key = TenantKey::global();
    let mut granted = 0;
    for _ in 0..times {
        if let Ok(g) = Backend::acquire(pool, &key, 1, ms(t)).await {
            granted += 1;
            Backend::release(pool, &key, g);
        }
    }
    granted
}

/// The rate bound over every window: for each account and limit, no window of length
/// `w` holds more than the burst plus what the rate refills in `w`.
fn assert_bound(grants: &[(u64, usize, u64)], seed: u64) {
    for (m, (name, rps, burst, tps, tburst)) in ACCOUNTS.iter().enumerate() {
        let mine: Vec<(u64, u64)> = grants.iter().filter(|g| g.1 == m).map(|g| (g.0, g.2)).collect();
        for w_ms in [10, 50, 100, 300, 1000, 3000] {
            let mut j = 0;
            let (mut requests, mut tokens) = (0u64, 0u64);
            for i in 0..mine.len() {
                // The window [mine[i].0, mine[i].0 + w]: grants from i on.
                while j < mine.len() && mine[j].0 <= mine[i].0 + w_ms * 1_000_000 {
                    requests += 1;
                    tokens += mine[j].1;
                    j += 1;
                }
                let r_bound = burst + rps * w_ms / 1000 + 1;
                let t_bound = tburst + tps * w_ms / 1000 + 1;
                assert!(
                    requests <= r_bound,
                    "seed {seed}: account {name}, {requests} requests in {w_ms} ms > {r_bound}"
                );
                assert!(tokens <= t_bound, "seed {seed}: account {name}, {tokens} tokens in {w_ms} ms > {t_bound}");
                requests -= 1;
                tokens -= mine[i].1;
            }
        }
    }
}

/// Random traffic over three replicas: phases of flood, one busy replica, a replica that
/// stops for a while (no traffic, no refresh), refreshes heard, lost on the way back, or
/// not sent. The bound holds over every window, and the fleet uses the accounts.
#[test]
fn leased_accounts_keep_the_rate_bound_under_random_traffic() {
    let Some(server) = redis_for("leased_accounts_keep_the_rate_bound_under_random_traffic") else { return };
    runtime().block_on(async {
        for seed in [1u64, 7, 42] {
            let ns = namespace("leases-law");
            let mut replicas = Vec::new();
            for _ in 0..3 {
                replicas.push(replica(&server.url(), &ns).await);
            }
            let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
            let key = TenantKey::global();
            let mut grants = Vec::new();
            let mut now_ms = 0;
            let mut last_refresh = [0u64; 3];
            while now_ms < 6_000 {
                now_ms += 1 + rng.below(8);
                let now = ms(now_ms);
                let phase = (now_ms / 1000) % 3;
                // Phase 0: everyone floods; 1: replica 0 alone; 2: replica 2 is deaf and
                // silent.
                for (r, (pool, store)) in replicas.iter().enumerate() {
                    // Phase 1: replica 0 floods, the others trickle (one step in eight).
                    let active = match phase {
                        0 => true,
                        1 => r == 0 || rng.below(8) == 0,
                        _ => r != 2,
                    };
                    if phase == 2 && r == 2 {
                        continue;
                    }
                    if now_ms - last_refresh[r] >= 50 + rng.below(30) {
                        last_refresh[r] = now_ms;
                        match rng.below(10) {
                            0 => {}
                            1 => {
                                store.refresh_leases_unheard(now).await;
                            }
                            _ => {
                                store.refresh_leases(now).await;
                            }
                        }
                    }
                    // The fractions in force never sum to more than the whole pool.
                    let held: f64 = replicas.iter().map(|(_, s)| s.leased_fraction(now).unwrap()).sum();
                    assert!(held <= 1.0 + 1e-9, "seed {seed}: {held} of the rates held at {now_ms} ms");
                    let bursts: f64 = replicas.iter().map(|(_, s)| s.leased_burst(now).unwrap()).sum();
                    assert!(bursts <= 1.0 + 1e-9, "seed {seed}: {bursts} of the bursts held at {now_ms} ms");
                    if !active {
                        continue;
                    }
                    for _ in 0..rng.below(4) {
                        let cost = 1 + rng.below(LARGEST);
                        match Backend::acquire(pool, &key, cost, now).await {
                            Ok(grant) => {
                                grants.push((now.as_nanos(), grant.chosen().index, cost));
                                Backend::release(pool, &key, grant);
                            }
                            Err(AcquireError::Refused(_)) => {}
                            Err(e) => panic!("seed {seed}: {e}"),
                        }
                    }
                }
            }
            assert_bound(&grants, seed);
            // 6 s of mostly saturated traffic: the fleet used most of what the accounts
            // allow (140 requests a second, and the bursts).
            assert!(grants.len() > 400, "seed {seed}: only {} grants", grants.len());
            for (_, store) in &replicas {
                assert_eq!(store.stats().acquire_calls, 0, "seed {seed}: no call per request");
            }
        }
    });
}

/// Two replicas that both want more than the accounts allow end with half each; one
/// that stops refreshing gives its fraction back within a lifetime.
#[test]
fn capacity_follows_demand_and_a_silent_replica_gives_its_lease_back() {
    let Some(server) = redis_for("capacity_follows_demand_and_a_silent_replica_gives_its_lease_back") else {
        return;
    };
    runtime().block_on(async {
        let [(first, first_store), (second, second_store)] = replicas(&server.url(), "leases-demand").await;
        // The first alone takes everything.
        ask(&first, 50, 0).await;
        first_store.refresh_leases(ms(10)).await;
        assert_eq!(first_store.leased_fraction(ms(10)), Some(1.0));
        // Both flood: within a few refreshes each holds half.
        let mut t = 20;
        for _ in 0..6 {
            ask(&first, 50, t).await;
            ask(&second, 50, t).await;
            first_store.refresh_leases(ms(t + 1)).await;
            second_store.refresh_leases(ms(t + 2)).await;
            ask(&first, 50, t + 3).await;
            t += 50;
        }
        let (a, b) = (first_store.leased_fraction(ms(t)).unwrap(), second_store.leased_fraction(ms(t)).unwrap());
        assert!((a - 0.5).abs() < 0.01 && (b - 0.5).abs() < 0.01, "{a} and {b}, not half each");
        // The first falls silent: the second gets everything once the first's lease has
        // lived its lifetime, not before.
        let silent_from = t;
        ask(&second, 50, t).await;
        second_store.refresh_leases(ms(t + 1)).await;
        assert!(second_store.leased_fraction(ms(t + 1)).unwrap() <= 0.5 + 0.01);
        let back = silent_from + LIFETIME.as_millis() as u64 + 1;
        ask(&second, 50, back).await;
        second_store.refresh_leases(ms(back)).await;
        assert_eq!(second_store.leased_fraction(ms(back)), Some(1.0));
    });
}

/// A fraction moves from one replica to another only once the first has confirmed it
/// gave it up: an answer lost on its way back leaves the replica using its old fraction,
/// and Redis keeps counting that until the replica says otherwise or its lease ends.
#[test]
fn a_hand_over_never_counts_a_fraction_twice() {
    let Some(server) = redis_for("a_hand_over_never_counts_a_fraction_twice") else { return };
    runtime().block_on(async {
        let [(x, x_store), (y, y_store)] = replicas(&server.url(), "leases-hand-over").await;
        let held = |t: u64| {
            let rates = x_store.leased_fraction(ms(t)).unwrap() + y_store.leased_fraction(ms(t)).unwrap();
            let bursts = x_store.leased_burst(ms(t)).unwrap() + y_store.leased_burst(ms(t)).unwrap();
            rates.max(bursts)
        };
        ask(&x, 20, 0).await;
        assert_eq!(x_store.leased_fraction(ms(0)), Some(1.0));
        // y wants some: nothing is free.
        ask(&y, 20, 10).await;
        assert_eq!(y_store.leased_fraction(ms(10)), Some(0.0));
        // x is granted half, but never hears it: it keeps using the whole.
        ask(&x, 20, 20).await;
        x_store.refresh_leases_unheard(ms(20)).await;
        assert_eq!(x_store.leased_fraction(ms(21)), Some(1.0));
        ask(&y, 20, 70).await;
        y_store.refresh_leases(ms(70)).await;
        assert_eq!(y_store.leased_fraction(ms(70)), Some(0.0), "x may still be using the whole");
        assert!(held(70) <= 1.0);
        // x hears half now. Until it says so Redis counts the whole, and x keeps using
        // the whole until then rather than leave the other half to nobody.
        ask(&x, 20, 80).await;
        x_store.refresh_leases(ms(80)).await;
        assert_eq!(x_store.leased_fraction(ms(81)), Some(1.0));
        ask(&y, 20, 90).await;
        y_store.refresh_leases(ms(90)).await;
        assert_eq!(y_store.leased_fraction(ms(90)), Some(0.0), "x has not confirmed the half yet");
        assert!(held(90) <= 1.0);
        // x confirms, holding the half from when its report is sent; then y gets the
        // other half.
        ask(&x, 20, 130).await;
        x_store.refresh_leases(ms(130)).await;
        assert_eq!(x_store.leased_fraction(ms(130)), Some(0.5));
        ask(&y, 20, 140).await;
        y_store.refresh_leases(ms(140)).await;
        assert_eq!(y_store.leased_fraction(ms(140)), Some(0.5));
        assert!(held(140) <= 1.0);
    });
}

/// A burst too small to hold one request is never granted: with a burst of one request,
/// two replicas cannot each hold half (neither could ever admit); one holds the whole at
/// a time, the heavier (here a tie, broken by the replicas' ids).
#[test]
fn no_lease_is_too_small_to_hold_a_request() {
    let Some(server) = redis_for("no_lease_is_too_small_to_hold_a_request") else { return };
    runtime().block_on(async {
        let ns = namespace("leases-smallest");
        let tight = || LimitSetPolicy::new().limit(LimitPolicy::gcra("rpm", quota(20, Duration::from_secs(1), 1)));
        let mut sides = Vec::new();
        for _ in 0..2 {
            sides.push(
                single(
                    &server.url(),
                    &ns,
                    &tight(),
                    AccountLeases::new().refresh_every(Duration::from_millis(50)).lifetime(LIFETIME),
                    false,
                )
                .await,
            );
        }
        let key = TenantKey::global();
        let mut served = [0u64; 2];
        for t in (0..1000).step_by(10) {
            for (i, (pool, store)) in sides.iter().enumerate() {
                if let Ok(g) = Backend::acquire(pool, &key, 1, ms(t)).await {
                    served[i] += 1;
                    Backend::release(pool, &key, g);
                }
                if t % 50 == 0 {
                    store.refresh_leases(ms(t)).await;
                }
                let f = store.leased_fraction(ms(t)).unwrap();
                assert!(f == 0.0 || f == 1.0, "a fraction of {f} cannot hold a request of a burst of one");
            }
        }
        // One holds the account at a time and uses it: 20 a second, less the hand-overs.
        assert!(served[0] + served[1] >= 12, "{served:?}");
    });
}

/// A lease's burst is sized by the requests its replica is asked, not by the largest a
/// request may be: with a burst of one largest request, three replicas asking small ones
/// all hold leases at once; a replica then asked a large one reports it, the others'
/// parts shrink at their refreshes, and the large request passes within a few periods.
/// The bursts held never sum to more than the whole.
#[test]
fn bursts_follow_the_requests_each_replica_is_asked() {
    let Some(server) = redis_for("bursts_follow_the_requests_each_replica_is_asked") else { return };
    runtime().block_on(async {
        let ns = namespace("leases-least");
        let one = || {
            LimitSetPolicy::new()
                .limit(LimitPolicy::gcra("rpm", quota(100, Duration::from_secs(1), 10)))
                .limit(LimitPolicy::token_bucket("tpm", quota(1_000, Duration::from_secs(1), 100)).counting_cost())
        };
        let mut sides = Vec::new();
        for _ in 0..3 {
            sides.push(
                single(
                    &server.url(),
                    &ns,
                    &one(),
                    AccountLeases::new().refresh_every(Duration::from_millis(50)).lifetime(LIFETIME).largest_cost(100),
                    false,
                )
                .await,
            );
        }
        let key = TenantKey::global();
        let bursts = |t: u64| sides.iter().map(|(_, s)| s.leased_burst(ms(t)).unwrap()).sum::<f64>();
        let (mut all_held, mut large_at) = (false, None);
        for t in (0..3000).step_by(10) {
            for (i, (pool, store)) in sides.iter().enumerate() {
                // From 1 s on, replica 0 asks for 60 tokens until it gets them.
                let cost = if i == 0 && t >= 1000 && large_at.is_none() { 60 } else { 10 };
                if let Ok(g) = Backend::acquire(pool, &key, cost, ms(t)).await {
                    if cost == 60 {
                        large_at = Some(t);
                    }
                    Backend::release(pool, &key, g);
                }
                if t % 50 == 10 * i as u64 {
                    store.refresh_leases(ms(t)).await;
                }
                assert!(bursts(t) <= 1.0 + 1e-9, "{} of the burst held at {t} ms", bursts(t));
            }
            if (500..1000).contains(&t) {
                all_held |= sides.iter().all(|(_, s)| s.leased_fraction(ms(t)).unwrap() > 0.0);
            }
        }
        assert!(all_held, "three replicas asking 10 tokens of a burst of 100 never held leases together");
        let large_at = large_at.expect("the request of 60 tokens never passed");
        assert!(large_at < 1400, "the request of 60 tokens waited until {large_at} ms");
    });
}

/// Bands across leases: a replica whose only tenant waits in a later band with a
/// minimum share of 10% gets about that part of the accounts, not an equal one, while
/// the other's tenant waits in the first band; once the first band's work ends, the
/// later band takes everything.
#[test]
fn a_later_band_leases_its_minimum_share_while_the_first_has_work() {
    let Some(server) = redis_for("a_later_band_leases_its_minimum_share_while_the_first_has_work") else { return };
    runtime().block_on(async {
        let sides = sides_with_fleet_shares(&server.url(), "leases-bands", Some([0, 10])).await;
        let (chat, nightly) = (TenantKey::new(["chat"]).unwrap(), TenantKey::new(["nightly"]).unwrap());
        let mut first_band_ends = None;
        for t in (0..4000).step_by(10) {
            for (i, (pool, store, fleet)) in sides.iter().enumerate() {
                let waiting = if i == 0 {
                    first_band_ends.is_none().then(|| Waiting::new(chat.clone(), 1, 5).in_band(0))
                } else {
                    Some(Waiting::new(nightly.clone(), 1, 5).in_band(1))
                };
                let band = waiting.as_ref().map_or(0, |_| i);
                side_step((pool, store, fleet), i, waiting, band, t).await;
            }
            let later = sides[1].1.leased_fraction(ms(t)).unwrap();
            if t == 2000 {
                let first = sides[0].1.leased_fraction(ms(t)).unwrap();
                assert!((later - 0.1).abs() < 0.03, "the later band holds {later} of the rates, not 0.1");
                assert!(first > 0.85, "the first band holds {first} of the rates");
                first_band_ends = Some(t);
            }
        }
        let later = sides[1].1.leased_fraction(ms(4000)).unwrap();
        assert!(later > 0.95, "alone, the later band holds {later} of the rates");
    });
}

/// A new fleet's first lease holds the full bursts, as a new per-request store's first
/// acquisition finds them; they are handed out once: a lease taken after the first has
/// ended starts empty.
#[test]
fn a_new_fleet_hands_its_bursts_out_once() {
    let Some(server) = redis_for("a_new_fleet_hands_its_bursts_out_once") else { return };
    runtime().block_on(async {
        let (pool, _store) = replica(&server.url(), &namespace("leases-unspent")).await;
        let bursts: usize = ACCOUNTS.iter().map(|a| a.2 as usize).sum();
        assert_eq!(ask(&pool, 100, 0).await, bursts, "the first lease holds both accounts' request bursts");
        // The lease ends unrenewed; the next one is taken by the next request.
        let later = LIFETIME.as_millis() as u64 + 10;
        assert_eq!(ask(&pool, 100, later).await, 0, "the bursts were handed out already");
    });
}

/// The bursts a new fleet's first lease holds pass to the replica the fleet gives them
/// to: the first replica to refresh takes everything, gives most of it back once the
/// other reports its demand, and the tokens its shrunk burst part dropped go back to
/// Redis with its next report, for the other's growing part to take. (Before, they were
/// lost, and the busy replica started from an empty bucket.)
#[test]
fn a_burst_part_given_back_passes_its_tokens_on() {
    let Some(server) = redis_for("a_burst_part_given_back_passes_its_tokens_on") else { return };
    runtime().block_on(async {
        let [(quiet, quiet_store), (busy, busy_store)] = replicas(&server.url(), "leases-pass-on").await;
        assert_eq!(ask(&quiet, 1, 0).await, 1, "the first lease: everything, the bursts as tokens");
        assert_eq!(ask(&busy, 100, 0).await, 0, "the other holds everything");
        // The quiet one, asked one request in a period, keeps a sliver; its next report
        // gives back what its shrunk burst part dropped.
        assert!(quiet_store.refresh_leases(ms(50)).await);
        ask(&busy, 100, 51).await;
        assert!(busy_store.refresh_leases(ms(51)).await);
        assert!(quiet_store.refresh_leases(ms(52)).await);
        ask(&busy, 100, 53).await;
        assert!(busy_store.refresh_leases(ms(53)).await);
        let part = busy_store.leased_fraction(ms(54));
        assert!(part.is_some_and(|f| f > 0.5), "{part:?}");
        let bursts: usize = ACCOUNTS.iter().map(|a| a.2 as usize).sum();
        let served = ask(&busy, 100, 54).await;
        assert!(served * 2 >= bursts, "the busy replica serves from the bursts at once: {served} of {bursts}");
    });
}

/// Limits replaced while a leased fleet runs (learned from the upstream): one replica
/// halves the account's rate, and from each replica's next refresh on the fleet keeps to
/// the new limit over every window; doubled again, the fleet uses the new rate.
#[test]
fn leases_take_the_limits_the_fleet_replaced() {
    let Some(server) = redis_for("leases_take_the_limits_the_fleet_replaced") else { return };
    runtime().block_on(async {
        let ns = namespace("leases-replaced");
        let one = |rps: u64, burst: u64| {
            LimitSetPolicy::new().limit(LimitPolicy::gcra("rpm", quota(rps, Duration::from_secs(1), burst)))
        };
        let mut sides = Vec::new();
        for _ in 0..2 {
            sides.push(
                single(
                    &server.url(),
                    &ns,
                    &one(100, 10),
                    AccountLeases::new().refresh_every(Duration::from_millis(50)).lifetime(LIFETIME),
                    true,
                )
                .await,
            );
        }
        let key = TenantKey::global();
        let mut grants = Vec::new();
        for t in (0..3000).step_by(5) {
            if t == 1000 || t == 2000 {
                let (rps, burst) = if t == 1000 { (50, 5) } else { (100, 10) };
                sides[0].1.replace_member_limits(0, &one(rps, burst), ms(t)).unwrap();
                sides[0].1.flush().await;
            }
            for (i, (pool, store)) in sides.iter().enumerate() {
                for _ in 0..3 {
                    if let Ok(g) = Backend::acquire(pool, &key, 1, ms(t)).await {
                        grants.push(t);
                        Backend::release(pool, &key, g);
                    }
                }
                if t % 50 == 10 * i as u64 {
                    store.refresh_leases(ms(t)).await;
                }
            }
        }
        let count = |from: u64, to: u64| grants.iter().filter(|&&t| t >= from && t < to).count() as u64;
        // Halved at 1 s: once both replicas refreshed (60 ms), every window keeps to
        // 5 + 50 a second.
        for from in (1060..2000).step_by(5) {
            for w in [50, 200, 940] {
                let to = (from + w).min(2000);
                let most = 5 + 50 * (to - from) / 1000 + 1;
                assert!(count(from, to) <= most, "{} grants in [{from}, {to}) ms > {most}", count(from, to));
            }
        }
        // Doubled again at 2 s: the fleet uses the new rate (100 a second, less the
        // parts' settling).
        assert!(count(2200, 3000) >= 70, "{} grants in the last 800 ms at 100 a second", count(2200, 3000));
        assert!(count(1200, 2000) >= 35, "{} grants in 800 ms at 50 a second", count(1200, 2000));
    });
}

/// The replica that lowers a limit decides with it at once, from the lease it holds,
/// without waiting for its next refresh.
#[test]
fn a_replica_lowering_a_limit_keeps_to_it_before_its_next_refresh() {
    let Some(server) = redis_for("a_replica_lowering_a_limit_keeps_to_it_before_its_next_refresh") else {
        return;
    };
    runtime().block_on(async {
        let one = |rps: u64, burst: u64| {
            LimitSetPolicy::new().limit(LimitPolicy::gcra("rpm", quota(rps, Duration::from_secs(1), burst)))
        };
        let leases = AccountLeases::new().refresh_every(Duration::from_millis(50)).lifetime(LIFETIME);
        let (pool, store) = single(&server.url(), &namespace("leases-lowered"), &one(100, 10), leases, true).await;
        let key = TenantKey::global();
        let mut grants = Vec::new();
        // The first request takes the lease (at 0, for the lifetime: 300 ms); no refresh
        // follows. Lowered to a tenth at 100 ms.
        for t in 0..250 {
            if t == 100 {
                store.replace_member_limits(0, &one(10, 1), ms(t)).unwrap();
            }
            if let Ok(g) = Backend::acquire(&pool, &key, 1, ms(t)).await {
                grants.push(t);
                Backend::release(&pool, &key, g);
            }
        }
        assert_eq!(store.stats().lease_refreshes, 1, "one lease, taken by the first request");
        let count = |from: u64, to: u64| grants.iter().filter(|&&t| t >= from && t < to).count();
        assert!(count(50, 100) >= 4, "{} grants in 50 ms at 100 a second", count(50, 100));
        // 10 a second with a burst of 1: at most 1 + 1.5 in 150 ms (at 100 a second: 15).
        assert!(count(100, 250) <= 2, "{} grants in 150 ms once lowered", count(100, 250));
    });
}

/// A replica short of its part while another holds more than its own (told to give part
/// back, or to be told at its next refresh) is asked to refresh again just after that one
/// confirms it, rather than at its own next period; a replica that got its part is not. A
/// replica that took a large part, or was allotted one and granted nothing, looks again a
/// tenth of a period on. The one told to give a large part back (a tenth of the whole or
/// more) while another waits confirms at once: the one waiting is asked again just after
/// that (5 ms after the giver's refresh).
#[test]
fn a_replica_short_of_its_part_asks_again_after_the_holder_refreshes() {
    let Some(server) = redis_for("a_replica_short_of_its_part_asks_again_after_the_holder_refreshes") else {
        return;
    };
    runtime().block_on(async {
        let [(x, x_store), (y, y_store)] = replicas(&server.url(), "leases-soon").await;
        // x takes the whole at 0 (refresh periods are 50 ms) and, having taken a large
        // part, is asked to look again a tenth of a period on (5 ms, and the 2 ms every
        // early call waits). y, at 10, gets nothing: allotted half and granted nothing,
        // it looks again a tenth on too (x may give the half back sooner than its
        // period, and y would not hear of it).
        ask(&x, 20, 0).await;
        assert_eq!(x_store.lease_asked_again_in(), Some(Duration::from_millis(7)));
        ask(&y, 20, 10).await;
        assert_eq!(y_store.leased_fraction(ms(10)), Some(0.0));
        assert_eq!(y_store.lease_asked_again_in(), Some(Duration::from_millis(7)));
        // x does not look again at 5 here (the test's clock): what follows is as when a
        // holder keeps its period.
        // x is told at 40 to keep half (y's weight counts whole at once) and, y waiting,
        // to confirm at once (a microsecond, and the 2 ms every early call waits); it
        // keeps the whole until it does.
        ask(&x, 20, 40).await;
        x_store.refresh_leases(ms(40)).await;
        assert_eq!(x_store.leased_fraction(ms(40)), Some(1.0));
        assert_eq!(x_store.lease_asked_again_in(), Some(Duration::from_micros(2_001)));
        // y, at 42, is asked again 2 ms after x's confirmation is due: at 47.
        ask(&y, 20, 42).await;
        y_store.refresh_leases(ms(42)).await;
        assert_eq!(y_store.leased_fraction(ms(42)), Some(0.0));
        assert_eq!(y_store.lease_asked_again_in(), Some(Duration::from_millis(5)));
        // x does not confirm; y, at 45, would be asked again 2 ms after x's next refresh
        // (at 90, which confirms the half), but granted nothing while allotted half, it
        // looks again a tenth of a period on at the latest (5 ms, and 2 ms).
        ask(&y, 20, 45).await;
        y_store.refresh_leases(ms(45)).await;
        assert_eq!(y_store.leased_fraction(ms(45)), Some(0.0));
        assert_eq!(y_store.lease_asked_again_in(), Some(Duration::from_millis(7)));
        ask(&x, 20, 90).await;
        x_store.refresh_leases(ms(90)).await;
        // y refused locally only until the refresh it was asked for (52): its requests
        // at 92 ask for a lease themselves and take the half x confirmed. Not short any
        // more; having taken a large part, it looks again a tenth on.
        ask(&y, 20, 92).await;
        assert_eq!(y_store.leased_fraction(ms(92)), Some(0.5));
        assert_eq!(y_store.lease_asked_again_in(), Some(Duration::from_millis(7)));
    });
}

/// A fleet whose replicas hold what they are allotted is settled: each answer doubles the
/// period until the next refresh, up to the calm period (150 ms here: half of what the
/// lifetime leaves); once a replica's demand moves, the answers give the refresh period
/// again, to it and to the one its part goes to.
#[test]
fn a_settled_fleet_spaces_its_refreshes_out_until_demand_moves() {
    let Some(server) = redis_for("a_settled_fleet_spaces_its_refreshes_out_until_demand_moves") else { return };
    runtime().block_on(async {
        let [(x, x_store), (y, y_store)] = replicas(&server.url(), "leases-calm").await;
        let periods = |store: &RedisAccounts| store.lease_period().unwrap().as_millis();
        // Both flood from the start: the whole moves to half each, every answer the
        // refresh period while it moves.
        let mut given = Vec::new();
        let mut t = 0;
        for _ in 0..8 {
            ask(&x, 50, t).await;
            ask(&y, 50, t).await;
            x_store.refresh_leases(ms(t + 1)).await;
            y_store.refresh_leases(ms(t + 2)).await;
            given.push((periods(&x_store), periods(&y_store)));
            t += 50;
        }
        assert_eq!(given[0], (50, 50), "{given:?}");
        let (a, b) = (x_store.leased_fraction(ms(t)).unwrap(), y_store.leased_fraction(ms(t)).unwrap());
        assert!((a - 0.5).abs() < 0.01 && (b - 0.5).abs() < 0.01, "{a} and {b}, not half each");
        // Settled: the periods double to the calm period and stay there.
        assert_eq!(given.last(), Some(&(150, 150)), "{given:?}");
        let first_long = given.iter().position(|&(p, _)| p > 50).unwrap();
        assert_eq!(given[first_long].0, 100, "{given:?}");
        // y stops asking: its next report wants a little of the rate, it is told to give
        // the rest back, and both are answered the refresh period again.
        x_store.refresh_leases(ms(t + 1)).await;
        ask(&x, 50, t + 1).await;
        y_store.refresh_leases(ms(t + 2)).await;
        assert_eq!(periods(&y_store), 50);
        ask(&x, 50, t + 3).await;
        x_store.refresh_leases(ms(t + 3)).await;
        assert_eq!(periods(&x_store), 50);
    });
}

/// Lease settings that cannot keep their promise are refused when the store is built,
/// naming the setting: a refresh period of zero, a lifetime shorter than two refresh
/// periods and the timeout, a calm period shorter than the refresh period, or one that
/// the lifetime cannot cover twice with the timeout.
#[test]
fn lease_settings_that_cannot_hold_are_refused_naming_the_setting() {
    let Some(server) = redis_for("lease_settings_that_cannot_hold_are_refused_naming_the_setting") else { return };
    runtime().block_on(async {
        let conn = connect(&server.url()).await;
        let ms = Duration::from_millis;
        let build = |leases: AccountLeases| {
            RedisAccounts::builder("accounts")
                .namespace(namespace("leases-settings"))
                .timeout(ms(100))
                .member("a", account(10, 2, 100, 50))
                .leases(leases)
                .build(&conn)
                .err()
                .map(|e| match e {
                    tower_limits_redis::BuildError::Invalid { field, .. } => field,
                    other => panic!("{other}"),
                })
        };
        let leases = AccountLeases::new().refresh_every(ms(100)).lifetime(ms(1000));
        assert_eq!(build(leases), None);
        assert_eq!(build(leases.calm_every(ms(450))), None);
        assert_eq!(build(leases.refresh_every(Duration::ZERO)), Some("leases.refresh"));
        assert_eq!(build(leases.lifetime(ms(299))), Some("leases.lifetime"));
        assert_eq!(build(leases.calm_every(ms(99))), Some("leases.calm"));
        assert_eq!(build(leases.calm_every(ms(451))), Some("leases.calm"));
    });
}

/// A replica whose tenants start waiting after it first reported none counts its whole
/// weight at once: the part it holds is its weight's, not a part smoothed up from nothing
/// over five periods.
#[test]
fn a_replica_s_first_demand_counts_whole_at_once() {
    let Some(server) = redis_for("a_replica_s_first_demand_counts_whole_at_once") else { return };
    runtime().block_on(async {
        let sides = sides_with_fleet_shares(&server.url(), "leases-first-demand", None).await;
        let tenants = [TenantKey::new(["a"]).unwrap(), TenantKey::new(["b"]).unwrap()];
        // Side 0's tenant waits from the start; side 1 reports nothing waiting at first,
        // then, from 50 ms, a tenant of the same weight.
        for t in (0..=170).step_by(10) {
            for (i, (pool, store, fleet)) in sides.iter().enumerate() {
                let waiting = (i == 0 || t >= 50).then(|| Waiting::new(tenants[i].clone(), 1, 5));
                side_step((pool, store, fleet), i, waiting, 0, t).await;
            }
        }
        // Side 0 kept half at 100 and confirmed it at 150; side 1, at 170, holds its half
        // (smoothed up from nothing it would hold 0.66 / 1.66 of the whole, 0.40).
        let held = sides[1].1.leased_fraction(ms(170)).unwrap();
        assert!(held > 0.45, "side 1 holds {held} of the rates, not half");
    });
}

/// While Redis is away a replica decides from its lease until it expires, then the
/// failure policy (here fail closed) answers; no request makes a call meanwhile.
#[test]
fn while_redis_is_away_a_lease_serves_until_it_expires() {
    let Some(mut server) = own_redis_for("while_redis_is_away_a_lease_serves_until_it_expires") else { return };
    runtime().block_on(async {
        let ns = namespace("leases-away");
        let (pool, store) = replica(&server.url(), &ns).await;
        let key = TenantKey::global();
        // The lease is taken (the first request waits for it); a new fleet's first lease
        // holds the full bursts.
        let first = Backend::acquire(&pool, &key, 1, ms(0)).await.expect("granted from the full bursts");
        Backend::release(&pool, &key, first);
        server.stop();
        let mut granted = 0;
        for t in (10..LIFETIME.as_millis() as u64).step_by(10) {
            granted += ask(&pool, 1, t).await;
        }
        assert!(granted >= 20, "only {granted} granted from the lease while Redis was away");
        let after = Backend::acquire(&pool, &key, 1, ms(LIFETIME.as_millis() as u64 + 1)).await;
        assert!(matches!(after, Err(AcquireError::Unavailable(_))), "{after:?}");
        drop(store);
    });
}

/// A Redis that restarts empty forgot the fleet's leases: for a lifetime, no replica is
/// granted more than it says it may still be using, so a replica that held nothing gets
/// nothing while the one that held everything may still be using it.
#[test]
fn a_redis_restarted_empty_does_not_hand_the_leases_out_twice() {
    let Some(mut server) = own_redis_for("a_redis_restarted_empty_does_not_hand_the_leases_out_twice") else {
        return;
    };
    runtime().block_on(async {
        let [(holder, holder_store), (other, other_store)] = replicas(&server.url(), "leases-lost").await;
        let key = TenantKey::global();
        let _ = Backend::acquire(&holder, &key, 1, ms(0)).await;
        assert_eq!(holder_store.leased_fraction(ms(0)), Some(1.0));
        // The other has reached Redis before (it refreshed, holding nothing, asking for
        // nothing).
        other_store.refresh_leases(ms(5)).await;
        server.restart().expect("the server restarts");
        // The other asks for everything: Redis remembers no lease, yet grants nothing.
        let _ = Backend::acquire(&other, &key, 1, ms(20)).await;
        refreshed_once_redis_answers(&other_store, ms(30)).await;
        assert_eq!(other_store.leased_fraction(ms(30)), Some(0.0), "a lease handed out twice");
        // The holder may keep what it says it uses (here its fair half, the other asking
        // too), never more: the two never hold more than the whole.
        refreshed_once_redis_answers(&holder_store, ms(40)).await;
        let holder = holder_store.leased_fraction(ms(40)).unwrap();
        assert!(holder > 0.0 && holder <= 1.0, "{holder}");
        assert_eq!(other_store.leased_fraction(ms(40)), Some(0.0));
    });
}

/// Refreshes `store`'s lease at `now` once the restarted Redis answers (within 2 s).
async fn refreshed_once_redis_answers(store: &RedisAccounts, now: Instant) {
    for _ in 0..100 {
        if store.refresh_leases(now).await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("redis never answered again");
}
